package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// The specification's examples, kept verbatim where the project reads
// them too.
const (
	specAgentConfig   = "../config/testdata/spec-agent.yaml"
	specMeshConfig    = "../config/testdata/spec-mesh.yaml"
	specRBAC          = "../../../gateway/authz/testdata/spec-rbac.yaml"
	specMeshRBAC      = "../../../gateway/authz/testdata/spec-mesh-rbac.yaml"
	specNetworkPolicy = "../../../gateway/netpolicy/testdata/spec-networkpolicy.yaml"
	specCAServer      = "../caserver/testdata/spec-pitrust.yaml"
	specPivirtd       = "testdata/spec-pivirtd.yaml"
)

// TestSpecificationExamples runs each example of the specification as
// printed — configuration files, policies and commands — with the real
// binaries against real agents, adapting only ports, paths and host names
// (every host is 127.0.0.1; one that must not answer is a closed port
// there), and asserts its outcome: it works, or it is refused or warned
// about with a message that names the consequence and the fix.
//
// Two agents run the examples: the specification's config.yaml (etcd mode,
// on a real three-member etcd with client certificates) and the service
// mesh's agent configuration (embedded Raft, a pivirtd-sim configured as
// the specification's pivirtd behind mutual TLS). Their certificates are
// those the specification's pitrust commands issue.
//
// Not run here: the systemd unit and the systemctl and journalctl commands
// (make package-check verifies the unit, TestSystemdNotify the agent's
// side of Type=notify), `ss -tlnp | grep 9001` and `nft list ruleset`
// (they show the host's sockets and firewall, not the agents': nothing of
// the project to check), and the ManagedCertificate resource, which is
// the PiTrust Kubernetes operator's, not part of this repository.
func TestSpecificationExamples(t *testing.T) {
	if testing.Short() {
		t.Skip("starts agents, an etcd, pitrust serve and pivirtd-sim; skipped with -short")
	}
	needTools(t, "curl", "openssl", "etcdctl") // etcdctl: Debian's etcd-client
	e := newSpecEnv(t)

	// Each example depends on the PKI; the agents' examples on their agent.
	if !t.Run("pitrust issue-mtls-server, issue-mtls-client", e.pkiCommands) {
		t.FailNow()
	}
	t.Run("openssl verify, openssl x509", e.opensslCommands)
	t.Run("PiTrust CA server configuration, openssl ocsp", e.caServer)

	t.Run("config.yaml", e.agentConfig)
	t.Run("rbac.yaml", e.agentRBAC)
	t.Run("health, management and debug endpoints", e.managementEndpoints)
	t.Run("grpcurl", e.grpcurlCommands)
	t.Run("etcdctl and service_discovery metrics", e.serviceDiscovery)
	t.Run("config.yaml logging", e.agentLogging)

	t.Run("pivirtd config and the mesh's agent config", e.meshConfig)
	t.Run("the mesh's RBAC policy", e.meshRBAC)
	t.Run("NetworkPolicy", e.networkPolicy)
}

// specEnv is what the examples share.
type specEnv struct {
	// top is the test, for what outlives a subtest.
	top  *testing.T
	bins binaries
	// c starts and stops every process (it has no nodes); c.certs is pki,
	// so that c.operatorEnv and c.httpClient use its operator certificate.
	c   *cluster
	dir string
	// pki is the specification's /etc/pivirt/certs, made by its commands.
	pki string
	// issuerDir holds the development OIDC issuer's key; issuer is its URL.
	issuerDir, issuer string
	// sim is the unix socket of the pivirtd-sim behind the spec's unix://
	// endpoints (pivirtd and iscsiman).
	sim string
	// closed is 127.0.0.1:port where nothing listens: the hosts that must
	// not answer (osinfodb, the tracing collector).
	closed string
	// shEnv is the environment of the commands: the built binaries first
	// on PATH (grpcurl is the module's go tool, built with them).
	shEnv []string
	// adapt maps the spec's hosts, ports and paths in its commands to the
	// test's (see sh).
	adapt map[string]string

	etcd    *etcdtest.Cluster
	etcdPKI etcdtest.TLS
	// a runs config.yaml, b the service mesh's configuration; nil until
	// (unless) started.
	a, b *specAgent
}

// specAgent is one agent of the examples.
type specAgent struct {
	name             string
	config, log      string
	api, metrics     string
	proc             *proc
	simAddr, simHost string // its TLS pivirtd-sim (b only)
}

func newSpecEnv(t *testing.T) *specEnv {
	bins := buildBinaries(t)
	dir := t.TempDir()
	e := &specEnv{top: t, bins: bins, dir: dir, pki: filepath.Join(dir, "certs"), issuerDir: filepath.Join(dir, "oidc"), adapt: map[string]string{}}
	e.c = &cluster{bins: bins, dir: dir, certs: e.pki}
	t.Cleanup(func() { e.c.report(t) })
	t.Cleanup(e.c.stopAll)
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	e.closed = "127.0.0.1:" + strconv.Itoa(ports[0])
	e.shEnv = append(raceEnv(), "PATH="+filepath.Dir(bins.agent)+string(os.PathListSeparator)+os.Getenv("PATH"), "HOME="+dir)
	if err := os.Mkdir(e.issuerDir, 0o700); err != nil {
		t.Fatal(err)
	}
	e.issuer = e.c.startDevIssuer(t, e.issuerDir)
	e.sim = filepath.Join(dir, "sim.sock")
	if _, err := e.c.spawn(filepath.Join(dir, "sim.log"), bins.sim, []string{"--listen", "unix://" + e.sim,
		"--data-dir", filepath.Join(dir, "sim"), "--host", "node-01-sim"}); err != nil {
		t.Fatal(err)
	}
	// The spec's paths and hosts in its commands.
	e.adapt["pitrust issue-"] = "pitrust --dir " + e.pki + " issue-"
	e.adapt["/etc/pivirt/certs/"] = e.pki + "/"
	e.adapt["~/.config/pvcli/client.crt"] = filepath.Join(e.pki, "operator.crt")
	e.adapt["~/.config/pvcli/client.key"] = filepath.Join(e.pki, "operator.key")
	e.adapt["heap.prof"] = filepath.Join(dir, "heap.prof")
	return e
}

// shOut is what a command printed and its exit status.
type shOut struct {
	cmd            string
	stdout, stderr string
	code           int
}

func (o shOut) String() string {
	return fmt.Sprintf("$ %s\nexit status %d\nstdout:\n%s\nstderr:\n%s", o.cmd, o.code, o.stdout, o.stderr)
}

// sh runs a command of the specification with bash, as printed but for
// the spec's hosts, ports and paths (e.adapt; for a, the agent whose
// ports localhost:8443 and :8444 are: the spec's hosts are 127.0.0.1).
func (e *specEnv) sh(t *testing.T, a *specAgent, printed string) shOut {
	t.Helper()
	pairs := map[string]string{}
	for k, v := range e.adapt {
		pairs[k] = v
	}
	if a != nil {
		pairs["localhost:8443"] = a.api
		pairs["localhost:8444"] = a.metrics
	}
	// Longest first: strings.Replacer takes the first old string of its
	// arguments that matches at a position.
	olds := slices.Collect(maps.Keys(pairs))
	slices.SortFunc(olds, func(x, y string) int { return len(y) - len(x) })
	var args []string
	for _, o := range olds {
		args = append(args, o, pairs[o])
	}
	cmd := strings.NewReplacer(args...).Replace(printed)
	stdout, stderr, code := e.c.bash(t, e.shEnv, cmd)
	return shOut{cmd: cmd, stdout: stdout, stderr: stderr, code: code}
}

// shOK is sh, failing the test unless the command exits 0.
func (e *specEnv) shOK(t *testing.T, a *specAgent, printed string) shOut {
	t.Helper()
	o := e.sh(t, a, printed)
	if o.code != 0 {
		t.Fatalf("%s\nwant exit status 0", o)
	}
	return o
}

// adaptFile writes the example at path into the test's directory as name,
// each old string of pairs (which must occur in it: the example changed
// otherwise) replaced by its new one, and returns the new file's path.
func (e *specEnv) adaptFile(t *testing.T, path, name string, pairs ...string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(pairs); i += 2 {
		if !strings.Contains(string(b), pairs[i]) {
			t.Fatalf("%s no longer holds %q: update the adaptation", path, pairs[i])
		}
	}
	out := filepath.Join(e.dir, name)
	if err := os.WriteFile(out, []byte(strings.NewReplacer(pairs...).Replace(string(b))), 0o600); err != nil {
		t.Fatal(err)
	}
	return out
}

// abs is a path of the repository, absolute.
func abs(t *testing.T, path string) string {
	t.Helper()
	p, err := filepath.Abs(path)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// token is a bearer token of the development issuer for user with roles.
func (e *specEnv) token(t *testing.T, user, roles string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, e.bins.pitrust, "dev-token", "--dir", e.issuerDir, "--user", user, "--roles", roles)
	cmd.Env = raceEnv()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pitrust dev-token --user %s --roles %s: %v", user, roles, err)
	}
	return strings.TrimSpace(string(out))
}

// pvcli runs pvcli against a with the operator's certificate and, unless
// empty, a bearer token.
func (e *specEnv) pvcli(t *testing.T, a *specAgent, token string, args ...string) result {
	t.Helper()
	return e.pvcliAs(t, a, "operator", token, args...)
}

// pvcliAs runs pvcli against a with the client certificate cert (a name in
// the PKI) and, unless empty, a bearer token.
func (e *specEnv) pvcliAs(t *testing.T, a *specAgent, cert, token string, args ...string) result {
	t.Helper()
	env := []string{"PVCLI_CA_FILE=" + filepath.Join(e.pki, identity.ChainFile), "PVCLI_CERT_FILE=" + filepath.Join(e.pki, cert+".crt"),
		"PVCLI_KEY_FILE=" + filepath.Join(e.pki, cert+".key"), "PVCLI_TOKEN=" + token}
	return e.c.pvcliEnv(t, env, append([]string{"--endpoint", "https://" + a.api}, args...)...)
}

// pvcliOK is pvcli, failing the test unless it exits 0.
func (e *specEnv) pvcliOK(t *testing.T, a *specAgent, token string, args ...string) result {
	t.Helper()
	r := e.pvcli(t, a, token, args...)
	if r.code != 0 {
		t.Fatalf("%s\nwant exit status 0", r)
	}
	return r
}

// validate runs pivirt-agent validate --config file.
func (e *specEnv) validate(t *testing.T, file string) shOut {
	t.Helper()
	return e.sh(t, nil, fmt.Sprintf("pivirt-agent validate --config %q", file))
}

// startAgent starts the agent with args and waits until its /ready answers
// 200.
func (e *specEnv) startAgent(t *testing.T, a *specAgent, args ...string) {
	t.Helper()
	p, err := e.c.spawn(a.log, e.bins.agent, args)
	if err != nil {
		t.Fatal(err)
	}
	a.proc = p
	e.waitHTTP(t, a, "/ready", 60*time.Second)
}

// waitHTTP polls GET path on a's operations port until it answers 200.
func (e *specEnv) waitHTTP(t *testing.T, a *specAgent, path string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		code, body, err := get("http://" + a.metrics + path)
		if err == nil && code == http.StatusOK {
			return
		}
		if a.proc.exited() {
			t.Fatalf("%s exited (%s); log tail:\n%s", a.name, a.proc.state(), tail(a.log, 40))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: GET %s not 200 within %s (%d %v): %s\nlog tail:\n%s", a.name, path, timeout, code, err, body, tail(a.log, 40))
		}
		time.Sleep(pollInterval)
	}
}

// get is an HTTP GET with a deadline.
func get(url string) (int, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// needs skips a subtest whose agent did not start (its own subtest failed).
func needs(t *testing.T, a *specAgent, example string) {
	t.Helper()
	if a == nil || a.proc == nil || a.proc.exited() {
		t.Skipf("the agent of %s is not running (see that subtest)", example)
	}
}

// logged waits (up to timeout) until a's log holds want.
func logged(t *testing.T, a *specAgent, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(a.log)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not log %q within %s; log tail:\n%s", a.name, want, timeout, tail(a.log, 40))
		}
		time.Sleep(pollInterval)
	}
}

// --- the PKI -------------------------------------------------------------------

// pkiCommands runs the specification's pitrust commands: the agent's
// provisioning (a server and a client certificate of node-01), the
// service mesh's issuance of pivirtd's server certificate and its manual
// rotation. pitrust init makes the CA they sign with (PiRootR1.pem, PiCA.pem,
// ca-chain.pem); --dir is the test's directory instead of /etc/pivirt/certs.
func (e *specEnv) pkiCommands(t *testing.T) {
	e.shOK(t, nil, "pitrust init --dir "+e.pki)

	// As printed, the files are named after --name; pitrust says which
	// --out gives the names config.yaml reads.
	o := e.shOK(t, nil, `pitrust issue-mtls-server \
  --name "node-01.pivirt.internal" \
  --dns "node-01.pivirt.internal" \
  --days 365`)
	for _, want := range []string{filepath.Join(e.pki, "node-01.pivirt.internal.crt"), filepath.Join(e.pki, "node-01.pivirt.internal.key"),
		"usage: server authentication", "names: node-01.pivirt.internal",
		"note: the agent's default configuration reads /etc/pivirt/certs/agent-server.crt and .key (server.connectrpc.tls.cert_file); --out agent-server names the files so"} {
		if !strings.Contains(o.stdout, want) {
			t.Errorf("%s\nwant %q", o, want)
		}
	}
	o = e.shOK(t, nil, `pitrust issue-mtls-client \
  --name "pivirt-agent-node-01" \
  --days 365`)
	for _, want := range []string{filepath.Join(e.pki, "pivirt-agent-node-01.crt"), "usage: client authentication",
		"note: the agent's default configuration reads /etc/pivirt/certs/agent-client.crt and .key (tls.cert_file); --out agent-client names the files so"} {
		if !strings.Contains(o.stdout, want) {
			t.Errorf("%s\nwant %q", o, want)
		}
	}
	// The same commands with pitrust's --out, for config.yaml's file names.
	// The server certificate also names 127.0.0.1, the address
	// node-01.pivirt.internal is here; the client certificate the service
	// name network policies give agents (agent.pivirt.internal, as
	// scripts/cluster.sh and the security guide issue it).
	e.shOK(t, nil, `pitrust issue-mtls-server \
  --name "node-01.pivirt.internal" \
  --dns "node-01.pivirt.internal" \
  --days 365 --out agent-server --ip 127.0.0.1`)
	e.shOK(t, nil, `pitrust issue-mtls-client \
  --name "pivirt-agent-node-01" \
  --days 365 --out agent-client --dns agent.pivirt.internal`)

	// The service mesh's: pivirtd's server certificate.
	o = e.shOK(t, nil, `pitrust issue-mtls-server \
  --name "pivirtd.pivirt.internal" \
  --dns "pivirtd.pivirt.internal" \
  --dns "node-01" \
  --days 365`)
	if !strings.Contains(o.stdout, "names: pivirtd.pivirt.internal, node-01") {
		t.Errorf("%s\nwant both names", o)
	}
	// Its manual rotation: issued again, the old files kept.
	o = e.shOK(t, nil, `pitrust issue-mtls-server --name "node-01.pivirt.internal" --days 365`)
	if !strings.Contains(o.stdout, "the files replaced are kept as:") || !strings.Contains(o.stdout, "node-01.pivirt.internal.crt.prev") {
		t.Errorf("%s\nwant the replaced files kept as .prev", o)
	}

	// Not in the specification: pvcli's certificate (its ~/.config/pvcli/client.crt).
	e.shOK(t, nil, "pitrust issue-mtls-client --name operator --days 365")
}

// opensslCommands runs the troubleshooting guides' openssl commands on the
// certificates the spec's commands issued.
func (e *specEnv) opensslCommands(t *testing.T) {
	o := e.shOK(t, nil, `openssl verify -CAfile /etc/pivirt/certs/ca-chain.pem /etc/pivirt/certs/agent-server.crt`)
	if want := filepath.Join(e.pki, "agent-server.crt") + ": OK"; strings.TrimSpace(o.stdout) != want {
		t.Errorf("%s\nwant %q", o, want)
	}
	o = e.shOK(t, nil, `openssl x509 -in /etc/pivirt/certs/agent-server.crt -enddate -noout`)
	end, err := time.Parse("Jan _2 15:04:05 2006 MST", strings.TrimPrefix(strings.TrimSpace(o.stdout), "notAfter="))
	if err != nil {
		t.Errorf("%s\nwant notAfter=<date>: %v", o, err)
	} else if d := time.Until(end); d < 364*24*time.Hour || d > 366*24*time.Hour {
		t.Errorf("%s\nwant the end 365 days ahead (--days 365), got %s", o, d)
	}
	// The rotation's check names node-01.crt; pitrust wrote the rotated
	// certificate under its --name, node-01.pivirt.internal.crt.
	e.adapt["/etc/pivirt/certs/node-01.crt"] = filepath.Join(e.pki, "node-01.pivirt.internal.crt")
	o = e.shOK(t, nil, `openssl x509 -in /etc/pivirt/certs/node-01.crt -text -noout | grep -A1 "Subject Alternative Name"`)
	if !strings.Contains(o.stdout, "X509v3 Subject Alternative Name:") || !strings.Contains(o.stdout, "DNS:node-01.pivirt.internal") {
		t.Errorf("%s\nwant the DNS name --name gave", o)
	}
}

// caServer runs pitrust serve with the specification's configuration
// (server.addr on a free port of 127.0.0.1, certs_dir the spec's PKI,
// db_path in the test's directory): it serves, warns that no certificate
// may administer it, and answers the troubleshooting guide's openssl ocsp.
func (e *specEnv) caServer(t *testing.T) {
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(ports[0])
	db := filepath.Join(e.dir, "pitrust", "certs.db")
	cfg := e.adaptFile(t, specCAServer, "pitrust.yaml",
		`"0.0.0.0:8080"`, strconv.Quote(addr),
		`"/etc/pitrust/certs"`, strconv.Quote(e.pki),
		`"/var/lib/pitrust/certs.db"`, strconv.Quote(db))
	s := &caServer{bins: e.bins, dir: e.pki, url: "https://" + addr, http: "http://" + addr, cfg: cfg, log: filepath.Join(e.dir, "pitrust.log")}
	s.start(t, e.c)
	e.adapt["http://pitrust.pivirt.internal:8080"] = s.http

	code, body, err := get(s.http + "/healthz")
	if err != nil || code != http.StatusOK {
		t.Errorf("GET /healthz: %d %q %v, want 200", code, body, err)
	}
	log := tail(s.log, 100)
	if !strings.Contains(log, "no certificate has the pitrust-admin role (auth.certificate_roles): nobody may issue, revoke, list or create bootstrap tokens, only renewals are served; "+
		"give your operator certificate the role, e.g. auth: {certificate_roles: {operator: [pitrust-admin]}}") {
		t.Errorf("pitrust serve with the spec's configuration did not warn that nobody may administer it:\n%s", log)
	}
	for line := range strings.SplitSeq(strings.TrimSpace(log), "\n") {
		if !strings.HasPrefix(line, "=== e2e ") && !json.Valid([]byte(line)) {
			t.Errorf("pitrust serve logged a line that is not JSON: %q", line)
		}
	}

	const ocsp = `openssl ocsp \
  -issuer /etc/pivirt/certs/PiCA.pem \
  -cert /etc/pivirt/certs/agent-server.crt \
  -url http://pitrust.pivirt.internal:8080/ocsp \
  -CAfile /etc/pivirt/certs/PiRootR1.pem`
	// The spec's certificates were issued offline, without --db: the
	// server never recorded them, and says so as OCSP can (unknown). The
	// PiTrust guide: such certificates are reissued through the server,
	// or recorded with pitrust issue-* --db while it is stopped.
	o := e.shOK(t, nil, ocsp)
	if !strings.Contains(o.stdout, filepath.Join(e.pki, "agent-server.crt")+": unknown") || !strings.Contains(o.stderr+o.stdout, "Response verify OK") {
		t.Errorf("%s\nwant a verified answer: unknown (issued offline, not in the server's database)", o)
	}
	s.stop(t)
	e.shOK(t, nil, `pitrust issue-mtls-server --name "node-01.pivirt.internal" --dns "node-01.pivirt.internal" --days 365 --out agent-server --ip 127.0.0.1 --db `+db)
	s.start(t, e.c)
	o = e.shOK(t, nil, ocsp)
	if !strings.Contains(o.stdout, filepath.Join(e.pki, "agent-server.crt")+": good") || !strings.Contains(o.stderr+o.stdout, "Response verify OK") {
		t.Errorf("%s\nwant a verified answer: good (recorded with --db)", o)
	}
}

// --- config.yaml: the agent in etcd mode --------------------------------------------

// agentConfig runs the specification's config.yaml: etcd endpoints of a
// real three-member etcd over HTTPS with client certificates of an etcd
// PKI of its own, pivirtd and iscsiman on a pivirtd-sim's unix socket,
// osinfodb and the tracing collector on a closed port, the development
// issuer as the OIDC issuer (plain http on loopback: allow_http_issuer
// added), the spec's RBAC policy.
func (e *specEnv) agentConfig(t *testing.T) {
	// The etcd outlives this subtest: the examples after it use it.
	e.etcdPKI = agenttest.EtcdPKI(t, filepath.Join(e.dir, "etcd-pki"))
	e.etcd = etcdtest.StartTLS(e.top, 3, e.etcdPKI)
	ports, err := freePorts(4)
	if err != nil {
		t.Fatal(err)
	}
	addr := func(i int) string { return "127.0.0.1:" + strconv.Itoa(ports[i]) }
	a := &specAgent{name: "config.yaml's agent", api: addr(0), metrics: addr(2), log: filepath.Join(e.dir, "agent-a.log")}
	a.config = e.adaptFile(t, specAgentConfig, "config.yaml",
		`addr: "0.0.0.0:8443"`, "addr: "+strconv.Quote(a.api),
		`addr: "0.0.0.0:9000"`, "addr: "+strconv.Quote(addr(1)),
		`addr: "0.0.0.0:8444"`, "addr: "+strconv.Quote(a.metrics),
		"/etc/pivirt/certs/", e.pki+"/",
		"https://etcd-0.pilab.hu:2379", e.etcd.Endpoints[0],
		"https://etcd-1.pilab.hu:2379", e.etcd.Endpoints[1],
		"https://etcd-2.pilab.hu:2379", e.etcd.Endpoints[2],
		"/etc/pivirt-agent/etcd/ca.crt", e.etcdPKI.CAFile,
		"/etc/pivirt-agent/etcd/client.crt", e.etcdPKI.ClientCertFile,
		"/etc/pivirt-agent/etcd/client.key", e.etcdPKI.ClientKeyFile,
		"unix:///run/pivirtd/pivirtd.sock", "unix://"+e.sim,
		"unix:///run/iscsiman/iscsiman.sock", "unix://"+e.sim,
		"https://osinfodb.pilab.hu:8443", "https://"+e.closed,
		`issuer_url: "https://auth.pilab.hu/realms/pivirt"`, fmt.Sprintf("issuer_url: %q\n    allow_http_issuer: true", e.issuer),
		"/etc/pivirt-agent/rbac.yaml", abs(t, specRBAC),
		"http://jaeger.pilab.hu:14268/api/traces", "http://"+e.closed+"/api/traces",
	)
	// Not in the example: a cluster name of the test's own, so that agents
	// of other tests never take this one's gossip port for a peer's.
	f, err := os.OpenFile(a.config, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteString("\n" + withClusterName("", "spec-etcd"))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	for i, ep := range e.etcd.Endpoints {
		e.adapt[fmt.Sprintf("https://etcd-%d.pilab.hu:2379", i)] = ep
	}
	e.adapt["/etc/pivirt-agent/etcd/ca.crt"] = e.etcdPKI.CAFile
	e.adapt["/etc/pivirt-agent/etcd/client.crt"] = e.etcdPKI.ClientCertFile
	e.adapt["/etc/pivirt-agent/etcd/client.key"] = e.etcdPKI.ClientKeyFile

	o := e.validate(t, a.config)
	if o.code != 0 || !strings.Contains(o.stdout, a.config+": ok") {
		t.Fatalf("%s\nwant ok", o)
	}
	for _, want := range []string{
		"backend pivirtd: unix://" + e.sim + ", scope node",
		"default route: /pivirt.vm.v1.VMService/ -> pivirtd",
		"default route: /pivirt.network.v1.NetworkService/ -> pivirtd",
		"default route: /pivirt.storage.v1.StorageService/ -> iscsiman",
	} {
		if !strings.Contains(o.stdout, want) {
			t.Errorf("validate printed:\n%s\nwant %q", o.stdout, want)
		}
	}

	// The spec's start is `pivirt-agent --config /etc/pivirt-agent/config.yaml`:
	// the data dir and the gossip port, which config.yaml leaves at their
	// defaults, are the test's.
	e.startAgent(t, a, "--config", a.config, "--data-dir", filepath.Join(e.dir, "agent-a"), "--gossip-addr", addr(3))
	e.a = a
	// Stopped before the etcd (cleanups run last-in first-out).
	e.top.Cleanup(func() { a.proc.cancel(); <-a.proc.done })
	for _, path := range []string{"/health", "/ready"} {
		if code, body, err := get("http://" + a.metrics + path); err != nil || code != http.StatusOK {
			t.Errorf("GET %s: %d %v %s", path, code, err, body)
		}
	}

	// A VM call with an admin's token reaches pivirtd-sim: the VM is on the
	// simulator's host.
	admin := e.token(t, "root", "admin")
	var created struct {
		VM vmOut `json:"vm"`
	}
	r := e.pvcliOK(t, a, admin, "-o", "json", "vm", "create", "web-1", "--owner", "alice")
	if err := json.Unmarshal([]byte(r.stdout), &created); err != nil || created.VM.Host != "node-01-sim" {
		t.Errorf("%s\nwant the VM created on pivirtd-sim (host node-01-sim): %v", r, err)
	}

	// A traced call (its traceparent sampled): its span goes to the
	// collector, which does not answer.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "https://"+a.api+"/pivirt.vm.v1.VMService/ListVMs", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+admin)
	req.Header.Set("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	resp, err := e.c.httpClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), created.VM.ID) {
		t.Errorf("ListVMs over Connect with a traceparent: %s %s", resp.Status, body)
	}
	checkJSONLog(t, a.log)
}

// checkJSONLog fails the test for each line of the log at path (the
// harness's own "=== e2e" lines aside) that is not a JSON object.
func checkJSONLog(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.SplitSeq(strings.TrimRight(string(b), "\n"), "\n") {
		if strings.HasPrefix(line, "=== e2e ") {
			continue
		}
		var obj map[string]any
		if err := json.Unmarshal([]byte(line), &obj); err != nil {
			t.Errorf("%s: a line that is not JSON (logging.format: json): %q", filepath.Base(path), line)
			continue
		}
		n++
	}
	if n == 0 {
		t.Errorf("%s: no JSON lines", filepath.Base(path))
	}
}

// loggedMsg reports whether a JSON line of the log at path has a "msg" or
// an "error" holding s.
func loggedMsg(t *testing.T, path, s string) bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		var rec struct {
			Msg   string `json:"msg"`
			Error string `json:"error"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && (strings.Contains(rec.Msg, s) || strings.Contains(rec.Error, s)) {
			return true
		}
	}
	return false
}

// agentLogging: after every example of config.yaml's agent has run,
// its log is still JSON, line by line, the tracing collector's absence
// included.
func (e *specEnv) agentLogging(t *testing.T) {
	needs(t, e.a, "config.yaml")
	// The traced call's span is exported within the batch timeout (5 s);
	// the export fails within the exporter's own (10 s). A Jaeger
	// collector's URL names its host, whose OTLP port (4317) the agent
	// sends to: nothing listens there either, unless this machine runs a
	// collector.
	if c, err := net.DialTimeout("tcp", "127.0.0.1:4317", time.Second); err == nil {
		c.Close()
		t.Logf("a collector listens on 127.0.0.1:4317: the export may succeed")
	} else {
		logged(t, e.a, "opentelemetry: traces export", 45*time.Second)
	}
	checkJSONLog(t, e.a.log)
}

// agentRBAC runs the agent specification's RBAC policy on config.yaml's
// agent.
func (e *specEnv) agentRBAC(t *testing.T) {
	a := e.a
	needs(t, a, "config.yaml")
	// validate warns that config.yaml gives certificates no role.
	const noRoles = "warning: auth.certificate_roles is empty: a caller with a client certificate (pvcli with its certificate) has no role, " +
		"so auth.rbac_policy's rules allow it nothing, unless the cluster setting auth.certificate_roles gives it roles; " +
		"map certificate names to roles, e.g. certificate_roles: {operator: [admin]}"
	if o := e.validate(t, a.config); !strings.Contains(o.stdout, noRoles) {
		t.Errorf("%s\nwant %q", o, noRoles)
	}
	if !loggedMsg(t, a.log, strings.TrimPrefix(noRoles, "warning: ")) {
		t.Errorf("the agent did not warn at start that certificates have no role")
	}
	// And so it is: the operator's certificate may call nothing.
	r := e.pvcli(t, a, "", "vm", "list")
	const denied = `operator (roles none) may not list virtualmachines: no rule of the RBAC policy allows it (a client certificate's roles come from auth.certificate_roles, ` +
		`which gives "operator" none: map the name to roles there, e.g. certificate_roles: {operator: [viewer]})`
	if r.code != 1 || !strings.Contains(r.stderr, denied) {
		t.Errorf("%s\nwant the denial of a certificate without a role: %q", r, denied)
	}

	// Tokens of the development issuer, by role.
	admin := e.token(t, "root", "admin")
	var bobs struct {
		VM vmOut `json:"vm"`
	}
	if err := json.Unmarshal([]byte(e.pvcliOK(t, a, admin, "-o", "json", "vm", "create", "db-1", "--owner", "bob").stdout), &bobs); err != nil {
		t.Fatal(err)
	}
	var all struct {
		VMs []vmOut `json:"vms"`
	}
	if err := json.Unmarshal([]byte(e.pvcliOK(t, a, admin, "-o", "json", "vm", "list").stdout), &all); err != nil {
		t.Fatal(err)
	}
	var alices string
	for _, vm := range all.VMs {
		if vm.Metadata.Owner == "alice" {
			alices = vm.ID
		}
	}
	if alices == "" || len(all.VMs) < 2 {
		t.Fatalf("vm list as admin: %+v, want alice's web-1 and bob's db-1", all.VMs)
	}

	// vm-owner: its own VMs only ({{.user.identity}} is the token's user).
	alice := e.token(t, "alice", "vm-owner")
	var mine struct {
		VMs []vmOut `json:"vms"`
	}
	if err := json.Unmarshal([]byte(e.pvcliOK(t, a, alice, "-o", "json", "vm", "list").stdout), &mine); err != nil {
		t.Fatal(err)
	}
	if len(mine.VMs) == 0 || slices.ContainsFunc(mine.VMs, func(vm vmOut) bool { return vm.Metadata.Owner != "alice" }) {
		t.Errorf("vm list as alice (vm-owner): %+v, want alice's VMs only", mine.VMs)
	}
	e.pvcliOK(t, a, alice, "vm", "start", alices)
	// Her VM's console (stdin empty: it opens, then ends); bob's is refused
	// before anything reaches the backend.
	if r := e.pvcliOK(t, a, alice, "vm", "console", alices); !strings.Contains(r.stdout, "serial console of") {
		t.Errorf("%s\nwant alice's console", r)
	}
	if r := e.pvcli(t, a, alice, "vm", "console", bobs.VM.ID); r.code != 1 || !strings.Contains(r.stderr, "alice (roles vm-owner) may not console virtualmachines") || r.stdout != "" {
		t.Errorf("%s\nwant bob's VM's console refused to alice", r)
	}
	e.pvcliOK(t, a, alice, "vm", "stop", alices, "--shutdown-timeout", "5s")
	if r := e.pvcli(t, a, alice, "vm", "console", alices); r.code != 1 || !strings.Contains(r.stderr, "its console needs it running") {
		t.Errorf("%s\nwant the console of a stopped VM refused with the reason", r)
	}
	if r := e.pvcli(t, a, alice, "vm", "get", bobs.VM.ID); r.code != 1 || !strings.Contains(r.stderr, "alice (roles vm-owner) may not get virtualmachines") {
		t.Errorf("%s\nwant bob's VM refused to alice", r)
	}
	if r := e.pvcli(t, a, alice, "vm", "create", "alice-2"); r.code != 1 || !strings.Contains(r.stderr, "alice (roles vm-owner) may not create virtualmachines") {
		t.Errorf("%s\nwant create refused to a vm-owner", r)
	}
	// operator: VM lifecycle, no delete; viewer: read-only.
	op := e.token(t, "olga", "operator")
	e.pvcliOK(t, a, op, "vm", "update", bobs.VM.ID, "--vcpus", "2")
	if r := e.pvcli(t, a, op, "vm", "delete", bobs.VM.ID); r.code != 1 || !strings.Contains(r.stderr, "olga (roles operator) may not delete virtualmachines") {
		t.Errorf("%s\nwant delete refused to an operator", r)
	}
	viewer := e.token(t, "vera", "viewer")
	e.pvcliOK(t, a, viewer, "vm", "get", bobs.VM.ID)
	if r := e.pvcli(t, a, viewer, "vm", "start", bobs.VM.ID); r.code != 1 || !strings.Contains(r.stderr, "vera (roles viewer) may not start virtualmachines") {
		t.Errorf("%s\nwant start refused to a viewer", r)
	}

	// The warning's fix: the operator's certificate mapped to admin, taken
	// up by the spec's reload.
	b, err := os.ReadFile(a.config)
	if err != nil {
		t.Fatal(err)
	}
	fixed := strings.Replace(string(b), "  # RBAC policy file\n", "  certificate_roles:\n    operator: [admin]\n  # RBAC policy file\n", 1)
	if fixed == string(b) {
		t.Fatal("config.yaml: no \"# RBAC policy file\" line to put certificate_roles before")
	}
	if err := os.WriteFile(a.config, []byte(fixed), 0o600); err != nil {
		t.Fatal(err)
	}
	if o := e.validate(t, a.config); o.code != 0 || strings.Contains(o.stdout, "auth.certificate_roles is empty") {
		t.Errorf("%s\nwant ok without the warning", o)
	}
	o := e.shOK(t, a, `curl -X POST http://localhost:8444/reload`)
	if !strings.Contains(o.stdout, `"applied":["auth.certificate_roles.operator"]`) {
		t.Errorf("%s\nwant auth.certificate_roles applied", o)
	}
	e.pvcliOK(t, a, "", "vm", "delete", bobs.VM.ID)
}

// managementEndpoints runs the agent specification's curl commands on the
// operations port of config.yaml's agent.
func (e *specEnv) managementEndpoints(t *testing.T) {
	a := e.a
	needs(t, a, "config.yaml")
	// The answers are JSON.
	var health struct {
		Status    string            `json:"status"`
		NodeID    string            `json:"node_id"`
		RaftState string            `json:"raft_state"`
		Checks    map[string]string `json:"checks"`
	}
	decode := func(o shOut) {
		t.Helper()
		health.Status, health.NodeID, health.RaftState, health.Checks = "", "", "", nil
		if err := json.Unmarshal([]byte(o.stdout), &health); err != nil {
			t.Errorf("%s\nwant JSON: %v", o, err)
		}
	}
	o := e.shOK(t, a, `curl http://localhost:8444/health`)
	if decode(o); health.Status != "ok" || health.NodeID == "" || health.RaftState != "etcd" {
		t.Errorf("%s\nwant status ok, the node ID, raft_state etcd", o)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/ready`)
	if decode(o); health.Status != "ready" || !strings.HasPrefix(health.Checks["etcd"], "ok: revision ") || !strings.HasPrefix(health.Checks["backend:pivirtd"], "ok: ") {
		t.Errorf("%s\nwant ready, etcd and pivirtd ok", o)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/live`)
	if decode(o); health.Status != "ok" {
		t.Errorf("%s\nwant status ok", o)
	}
	o = e.shOK(t, a, `curl -X POST http://localhost:8444/reload`)
	if decode(o); health.Status != "ok" {
		t.Errorf("%s\nwant status ok", o)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/debug/vars`)
	if !strings.Contains(o.stdout, `"memstats"`) {
		t.Errorf("%s\nwant expvar's memstats", o)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/debug/pprof/goroutine?debug=1`)
	if !strings.HasPrefix(o.stdout, "goroutine profile: total ") {
		t.Errorf("%.400s\nwant a goroutine profile", o)
	}
	e.shOK(t, a, `curl http://localhost:8444/debug/pprof/heap > heap.prof`)
	if b, err := os.ReadFile(filepath.Join(e.dir, "heap.prof")); err != nil || len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
		t.Errorf("heap.prof: %v, want a gzipped profile", err)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/metrics`)
	if !strings.Contains(o.stdout, "# TYPE pivirt_api_requests_total counter") {
		t.Errorf("%.400s\nwant the Prometheus text format", o)
	}
	o = e.shOK(t, a, `curl http://localhost:8444/metrics | grep pivirt_api_requests_total`)
	if !strings.Contains(o.stdout, `pivirt_api_requests_total{code="ok",method="CreateVM",service="pivirt.vm.v1.VMService"}`) {
		t.Errorf("%s\nwant the VM calls counted", o)
	}
}

// grpcurlCommands runs the specification's grpcurl commands against
// config.yaml's agent, whose API port speaks TLS only and wants a client
// certificate (tls.require_client_cert: true). grpcurl need not be
// installed: it is a Go tool of the module (go tool grpcurl), which
// buildBinaries builds beside the agent, first on the commands' PATH.
func (e *specEnv) grpcurlCommands(t *testing.T) {
	a := e.a
	needs(t, a, "config.yaml")
	const plaintext = "this port speaks TLS only and the client sent HTTP/2 in plaintext: connect with TLS (https:// for HTTP and Connect; grpcurl without -plaintext, with -cacert or -insecure)"
	for _, cmd := range []string{
		`grpcurl -plaintext localhost:8443 grpc.health.v1.Health/Check`,
		`grpcurl -plaintext -d '{"service": "pivirt.vm.v1.VMService"}' \
  localhost:8443 grpc.health.v1.Health/Check`,
	} {
		o := e.sh(t, a, cmd)
		if o.code == 0 || !strings.Contains(o.stderr+o.stdout, plaintext) {
			t.Errorf("%s\nwant the refusal naming TLS: %q", o, plaintext)
		}
		// The refusal's fix: TLS (and config.yaml's client certificate).
		o = e.shOK(t, a, strings.Replace(cmd, "-plaintext", "-insecure -cert ~/.config/pvcli/client.crt -key ~/.config/pvcli/client.key", 1))
		if !strings.Contains(o.stdout, `"status": "SERVING"`) {
			t.Errorf("%s\nwant SERVING", o)
		}
	}
	// -insecure with a token alone: config.yaml wants a client certificate
	// of every caller (tls.require_client_cert: true), so the handshake
	// fails before the token is read; grpcurl tries again until its connect
	// timeout (10 s; 2 s here, to keep the test short) and says no more.
	// validate and the start say it, with the fix. The same command with a
	// client certificate works.
	const tokenAlone = "auth.oidc is set, but tls.require_client_cert is true: the API port's TLS handshake refuses a caller without a client certificate " +
		"of the PiTrust chain before any token is read, so a bearer token alone (the web console in a browser, grpcurl -H \"authorization: Bearer …\" without -cert) cannot call; " +
		"set tls.require_client_cert: false to take tokens without a certificate (every call still needs a token or a certificate)"
	if o := e.validate(t, a.config); !strings.Contains(o.stdout, "warning: "+tokenAlone) {
		t.Errorf("%s\nwant the warning %q", o, tokenAlone)
	}
	if !loggedMsg(t, a.log, tokenAlone) {
		t.Errorf("the agent did not warn at start that tokens alone are refused")
	}
	e.adapt["$TOKEN"] = e.token(t, "root", "admin")
	defer delete(e.adapt, "$TOKEN")
	for _, tc := range []struct {
		printed string
		want    []string
	}{
		{`grpcurl -insecure \
  -H "authorization: Bearer $TOKEN" \
  localhost:8443 list`, []string{ // the specification's API table
			"pivirt.vm.v1.VMService\n", "pivirt.storage.v1.StorageService\n", "pivirt.network.v1.NetworkService\n", "pivirt.cluster.v1.ClusterService\n"}},
		{`grpcurl -insecure \
  -H "authorization: Bearer $TOKEN" \
  -d '{}' \
  localhost:8443 pivirt.vm.v1.VMService/ListVMs`, []string{`"name": "web-1"`}},
	} {
		o := e.sh(t, a, strings.Replace(tc.printed, "-insecure", "-insecure -connect-timeout 2", 1))
		if o.code == 0 || !strings.Contains(o.stderr, `Failed to dial target host "`+a.api+`": context deadline exceeded`) {
			t.Errorf("%s\nwant the handshake refused for the missing client certificate", o)
		}
		o = e.shOK(t, a, strings.Replace(tc.printed, "-insecure", "-insecure -cert ~/.config/pvcli/client.crt -key ~/.config/pvcli/client.key", 1))
		for _, want := range tc.want {
			if !strings.Contains(o.stdout, want) {
				t.Errorf("%s\nwant %q", o, want)
			}
		}
	}
}

// serviceDiscovery runs the troubleshooting guides' etcdctl commands on the
// etcd of config.yaml's agent, and the curl of the service discovery
// metrics on its API port.
func (e *specEnv) serviceDiscovery(t *testing.T) {
	a := e.a
	needs(t, a, "config.yaml")
	e.pvcliOK(t, a, "", "service", "register", "web", "--address", "10.0.0.5", "--port", "8080")
	o := e.shOK(t, nil, `etcdctl --endpoints=https://etcd-0.pilab.hu:2379 \
  --cacert=/etc/pivirt-agent/etcd/ca.crt \
  --cert=/etc/pivirt-agent/etcd/client.crt \
  --key=/etc/pivirt-agent/etcd/client.key \
  get /pivirt/services --prefix`)
	if !regexp.MustCompile(`(?m)^/pivirt/services/web/web-`).MatchString(o.stdout) || !strings.Contains(o.stdout, `"address":"10.0.0.5"`) {
		t.Errorf("%s\nwant the instance registered", o)
	}
	// The service mesh's shorter forms, with the endpoints and files in
	// etcdctl's environment.
	saved := e.shEnv
	e.shEnv = append(slices.Clone(saved), "ETCDCTL_ENDPOINTS="+strings.Join(e.etcd.Endpoints, ","), "ETCDCTL_CACERT="+e.etcdPKI.CAFile,
		"ETCDCTL_CERT="+e.etcdPKI.ClientCertFile, "ETCDCTL_KEY="+e.etcdPKI.ClientKeyFile)
	defer func() { e.shEnv = saved }()
	o = e.shOK(t, nil, `etcdctl endpoint health`)
	if strings.Count(o.stdout+o.stderr, "is healthy") != 3 {
		t.Errorf("%s\nwant three healthy endpoints", o)
	}
	o = e.shOK(t, nil, `etcdctl get /pivirt/services --prefix`)
	if !strings.Contains(o.stdout, `"address":"10.0.0.5"`) {
		t.Errorf("%s\nwant the instance registered", o)
	}
	o = e.shOK(t, a, `curl -k --cert ~/.config/pvcli/client.crt \
  --key ~/.config/pvcli/client.key \
  https://localhost:8443/metrics | grep service_discovery`)
	if !strings.Contains(o.stdout, `service_discovery_instances{health="passing",service="web"} 1`) {
		t.Errorf("%s\nwant the instance counted", o)
	}
}

// --- the service mesh ---------------------------------------------------------------

// meshConfig runs the service mesh's pivirtd configuration (as
// pivirtd-sim's flags: listen address and mutual TLS) and its agent
// configuration blocks (spec-mesh.yaml: a pivirtd backend over TLS with a
// server_name, routing rules, load balancing, circuit breaking, tracing,
// access log) on an agent in Raft mode, bootstrapped alone.
func (e *specEnv) meshConfig(t *testing.T) {
	ports, err := freePorts(6)
	if err != nil {
		t.Fatal(err)
	}
	addr := func(i int) string { return "127.0.0.1:" + strconv.Itoa(ports[i]) }
	b := &specAgent{name: "the mesh's agent", api: addr(0), metrics: addr(2), log: filepath.Join(e.dir, "agent-b.log"), simAddr: addr(5)}

	// pivirtd: the spec's server configuration, with the certificate its
	// issuance command made.
	pv := e.adaptFile(t, specPivirtd, "pivirtd.yaml",
		`"0.0.0.0:9001"`, strconv.Quote(b.simAddr),
		"/etc/pivirtd/tls/server.crt", filepath.Join(e.pki, "pivirtd.pivirt.internal.crt"),
		"/etc/pivirtd/tls/server.key", filepath.Join(e.pki, "pivirtd.pivirt.internal.key"),
		"/etc/pivirtd/tls/ca.crt", filepath.Join(e.pki, identity.ChainFile))
	var pvCfg struct {
		Server struct {
			GRPCAddr string `yaml:"grpc_addr"`
			TLS      struct {
				Enabled      bool   `yaml:"enabled"`
				CertFile     string `yaml:"cert_file"`
				KeyFile      string `yaml:"key_file"`
				ClientCAFile string `yaml:"client_ca_file"`
			} `yaml:"tls"`
		} `yaml:"server"`
	}
	raw, err := os.ReadFile(pv)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &pvCfg); err != nil || !pvCfg.Server.TLS.Enabled {
		t.Fatalf("%s: %v (tls.enabled %v)", pv, err, pvCfg.Server.TLS.Enabled)
	}
	b.simHost = "node-01-tls"
	simLog := filepath.Join(e.dir, "sim-tls.log")
	if _, err := e.c.spawn(simLog, e.bins.sim, []string{"--listen", pvCfg.Server.GRPCAddr,
		"--tls-cert-file", pvCfg.Server.TLS.CertFile, "--tls-key-file", pvCfg.Server.TLS.KeyFile, "--tls-ca-file", pvCfg.Server.TLS.ClientCAFile,
		"--data-dir", filepath.Join(e.dir, "sim-tls"), "--host", b.simHost, "--role", "pivirtd"}); err != nil {
		t.Fatal(err)
	}

	// The agent: the mesh's blocks, with what they leave to config.yaml's
	// defaults (the agent's certificates, /etc/pivirt/certs/...) and the
	// RBAC policy of the mesh's security section.
	mesh := e.adaptFile(t, specMeshConfig, "mesh.yaml",
		`endpoint: "pivirtd:9001"`, fmt.Sprintf("endpoint: %q", b.simAddr),
		"/etc/pivirt-agent/tls/client.crt", filepath.Join(e.pki, "agent-client.crt"),
		"/etc/pivirt-agent/tls/client.key", filepath.Join(e.pki, "agent-client.key"),
		"/etc/pivirt-agent/tls/ca.crt", filepath.Join(e.pki, identity.ChainFile),
		"unix:///run/iscsiman/iscsiman.sock", "unix://"+e.sim,
		"http://jaeger.pilab.hu:14268/api/traces", "http://"+e.closed+"/api/traces")
	body, err := os.ReadFile(mesh)
	if err != nil {
		t.Fatal(err)
	}
	b.config = mesh
	// The cluster name is the test's own, as for config.yaml's agent.
	rest := fmt.Sprintf(`
# config.yaml's certificates, the node they name, and the mesh's RBAC policy
node_name: node-01
tls:
  ca_file: %[1]s/ca-chain.pem
  cert_file: %[1]s/agent-client.crt
  key_file: %[1]s/agent-client.key
server:
  connectrpc:
    tls:
      cert_file: %[1]s/agent-server.crt
      key_file: %[1]s/agent-server.key
      ca_file: %[1]s/ca-chain.pem
      client_ca_file: %[1]s/ca-chain.pem
auth:
  rbac_policy: %[2]s
%[3]s`, e.pki, abs(t, specMeshRBAC), meshCertificateRoles)
	if err := os.WriteFile(mesh, append(body, withClusterName(rest, "spec-mesh")...), 0o600); err != nil {
		t.Fatal(err)
	}

	// validate: ok, and the network API the routing rules leave out.
	o := e.validate(t, mesh)
	const unserved = `not served: pivirt.network.v1.NetworkService (no routing.rules prefix covers it: its calls answer Unimplemented; add {match: {prefix: "/pivirt.network.v1.NetworkService"}, route: {cluster: pivirtd}} to serve it)`
	if o.code != 0 || !strings.Contains(o.stdout, mesh+": ok") || !strings.Contains(o.stdout, unserved) {
		t.Errorf("%s\nwant ok and %q", o, unserved)
	}

	e.startAgent(t, b, "--config", mesh, "--data-dir", filepath.Join(e.dir, "agent-b"),
		"--api-addr", b.api, "--internal-addr", addr(1), "--metrics-addr", b.metrics, "--gossip-addr", addr(3), "--raft-addr", addr(4),
		"--bootstrap")
	e.b = b
	logged(t, b, `"msg":"API not served: its calls answer Unimplemented"`, 10*time.Second)
	if log := tailMatching(b.log, 20, "API not served"); !strings.Contains(log, `pivirt.network.v1.NetworkService (no routing.rules prefix covers it`) {
		t.Errorf("the start's warning names another API:\n%s", log)
	}
	// So it is: a call of the network API answers Unimplemented.
	if r := e.pvcli(t, b, "", "network", "list"); r.code != 1 ||
		!strings.Contains(r.stderr, "unimplemented: unknown method /pivirt.network.v1.NetworkService/ListNetworks: no routing rule matches it") {
		t.Errorf("%s\nwant Unimplemented for the network API", r)
	}

	// The VM API reaches pivirtd over mutual TLS, checked against
	// server_name: pivirtd.pilab.hu, a name pivirtd's certificate (issued by
	// the mesh's own command for pivirtd.pivirt.internal and node-01) does
	// not carry: refused, naming both.
	const mismatch = `tls: server certificate \"CN=pivirtd.pivirt.internal,OU=mtls-server,O=PiTrust\" refused: pivirtd.pivirt.internal is not valid for \"pivirtd.pilab.hu\" (DNS names [pivirtd.pivirt.internal node-01], IPs []): x509: certificate is valid for pivirtd.pivirt.internal, node-01, not pivirtd.pilab.hu`
	if r := e.pvcli(t, b, "", "vm", "list"); r.code != 1 || !strings.Contains(r.stderr, mismatch) {
		t.Errorf("%s\nwant the certificate refused for server_name: %s", r, mismatch)
	}
	if !loggedMsg(t, b.log, strings.ReplaceAll(mismatch, `\"`, `"`)) {
		t.Errorf("the agent did not log the refused certificate")
	}
	// With server_name the name pivirtd's certificate carries, taken up by
	// the spec's reload, it works.
	raw, err = os.ReadFile(mesh)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mesh, []byte(strings.Replace(string(raw), `server_name: "pivirtd.pilab.hu"`, `server_name: "pivirtd.pivirt.internal"`, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if o := e.shOK(t, b, `curl -X POST http://localhost:8444/reload`); !strings.Contains(o.stdout, `"backends.pivirtd.tls.server_name"`) {
		t.Errorf("%s\nwant backends.pivirtd.tls.server_name applied", o)
	}
	var created struct {
		VM vmOut `json:"vm"`
	}
	r := e.pvcliOK(t, b, "", "-o", "json", "vm", "create", "mesh-1")
	if err := json.Unmarshal([]byte(r.stdout), &created); err != nil || created.VM.Host != b.simHost {
		t.Errorf("%s\nwant the VM on the TLS pivirtd-sim (%s): %v", r, b.simHost, err)
	}

	// The routing rule validate names, as a cluster setting: the network
	// API is served.
	rules := `[{match: {prefix: "/pivirt.vm.v1.VMService"}, route: {cluster: pivirtd}}, ` +
		`{match: {prefix: "/pivirt.storage.v1.StorageService"}, route: {cluster: iscsiman}}, ` +
		`{match: {prefix: "/pivirt.network.v1.NetworkService"}, route: {cluster: pivirtd}}]`
	e.pvcliOK(t, b, "", "config", "set", "routing.rules", rules)
	e.c.eventually(t, 30*time.Second, "the network API served after routing.rules", func() error {
		if r := e.pvcli(t, b, "", "network", "list"); r.code != 0 {
			return fmt.Errorf("%s", r)
		}
		return nil
	})

	// The mesh's metrics. The request duration is a histogram (its
	// percentiles are Prometheus's histogram_quantile, as the gateway guide
	// shows), not the spec's summary with a quantile label.
	o = e.shOK(t, b, `curl http://localhost:8444/metrics | grep mesh`)
	for _, want := range []string{
		`pivirt_mesh_requests_total{service="pivirtd",status="200"}`,
		`pivirt_mesh_request_duration_seconds_bucket{service="pivirtd",le="0.05"}`,
		`pivirt_mesh_request_duration_seconds_count{service="pivirtd"}`,
		`pivirt_mesh_active_connections{service="pivirtd"} 0`,
		`pivirt_mesh_endpoints{service="pivirtd",status="healthy"} 1`, // load_balancing.health_check
	} {
		if !strings.Contains(o.stdout, want) {
			t.Errorf("%s\nwant %s", o, want)
		}
	}
	guide, err := os.ReadFile(filepath.Join(repoRoot, "docs", "gateway.md"))
	if err != nil {
		t.Fatal(err)
	}
	if q := `histogram_quantile(0.99, sum by (le) (rate(pivirt_mesh_request_duration_seconds_bucket{service="pivirtd"}[5m])))`; !strings.Contains(string(guide), q) {
		t.Errorf("docs/gateway.md no longer shows the 99th percentile's query %s", q)
	}
	checkJSONLog(t, b.log)
	if !strings.Contains(tail(b.log, 1000), `"log":"access"`) {
		t.Errorf("no access log line (logging.access_log.enabled) in the mesh agent's log")
	}
}

// meshCertificateRoles is the mesh agent's auth.certificate_roles: the
// operator's certificate admin, two others a role each of the mesh's
// policy.
const meshCertificateRoles = `  certificate_roles:
    operator: [admin]
    auditor: [viewer]
    deployer: [operator]
`

// meshRBAC: the mesh's three-role policy on the mesh's agent, by
// certificate (auth.certificate_roles).
func (e *specEnv) meshRBAC(t *testing.T) {
	b := e.b
	needs(t, b, "the mesh's agent config")
	// Without certificate_roles validate says certificates get no role.
	raw, err := os.ReadFile(b.config)
	if err != nil {
		t.Fatal(err)
	}
	without := filepath.Join(e.dir, "mesh-without-roles.yaml")
	if err := os.WriteFile(without, []byte(strings.Replace(string(raw), meshCertificateRoles, "", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if o := e.validate(t, without); o.code != 0 || !strings.Contains(o.stdout, "warning: auth.certificate_roles is empty: a caller with a client certificate") {
		t.Errorf("%s\nwant ok and the warning about certificates without a role", o)
	}
	for _, name := range []string{"auditor", "deployer", "guest"} {
		e.shOK(t, nil, "pitrust issue-mtls-client --name "+name+" --days 365")
	}
	// admin: everything; viewer: get and list; operator: get, list, create
	// and update on VMs and volumes, nothing else.
	var created struct {
		VM vmOut `json:"vm"`
	}
	r := e.pvcliAs(t, b, "deployer", "", "-o", "json", "vm", "create", "rbac-1")
	if err := json.Unmarshal([]byte(r.stdout), &created); r.code != 0 || err != nil {
		t.Fatalf("%s\nwant the operator role to create a VM", r)
	}
	if r := e.pvcliAs(t, b, "deployer", "", "vm", "update", created.VM.ID, "--vcpus", "2"); r.code != 0 {
		t.Errorf("%s\nwant the operator role to update a VM", r)
	}
	for _, tc := range []struct {
		cert string
		args []string
		deny string // "" allowed
	}{
		{"deployer", []string{"vm", "delete", created.VM.ID}, "deployer (roles operator) may not delete virtualmachines"},
		{"deployer", []string{"network", "list"}, "deployer (roles operator) may not list networks"},
		{"auditor", []string{"vm", "get", created.VM.ID}, ""},
		{"auditor", []string{"network", "list"}, ""},
		{"auditor", []string{"vm", "start", created.VM.ID}, "auditor (roles viewer) may not start virtualmachines"},
		{"guest", []string{"vm", "list"}, `guest (roles none) may not list virtualmachines: no rule of the RBAC policy allows it (a client certificate's roles come from auth.certificate_roles, which gives "guest" none`},
		{"operator", []string{"vm", "delete", created.VM.ID}, ""},
	} {
		r := e.pvcliAs(t, b, tc.cert, "", tc.args...)
		switch {
		case tc.deny == "" && r.code != 0:
			t.Errorf("%s\nwant it allowed", r)
		case tc.deny != "" && (r.code != 1 || !strings.Contains(r.stderr, tc.deny)):
			t.Errorf("%s\nwant %q", r, tc.deny)
		}
	}
}

// networkPolicy applies the specification's NetworkPolicy to the mesh's
// agent as the cluster's policy (pvcli config set auth.network_policy, as
// the security guide does).
func (e *specEnv) networkPolicy(t *testing.T) {
	b := e.b
	needs(t, b, "the mesh's agent config")
	// As printed, alone: it allows nothing to the agents' own ports, which
	// every node would then close. Refused, naming the rule to add.
	r := e.pvcli(t, b, "", "config", "set", "auth.network_policy", "--file", abs(t, specNetworkPolicy))
	const refused = "this network policy would cut the agents off from each other: no NetworkPolicy allows agent.pivirt.internal to connect to node-01.pivirt.internal on the "
	if r.code != 1 || !strings.Contains(r.stderr, refused) || !strings.Contains(r.stderr, "or pass --force (force: true) to store it anyway") {
		t.Fatalf("%s\nwant the refusal %q…", r, refused)
	}
	m := regexp.MustCompile(`allow them \(e\.g\. add to spec\.ingress: (\{from: \[\{service: "agent\.pivirt\.internal"\}\], ports: \[\{port: \d+\}, \{port: \d+\}\]\})\)`).FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("%s\nwant the ingress rule to add for the internal and Raft ports", r)
	}
	// With the rule the refusal names added to its ingress: stored.
	// pivirtd's port, 9001 in the policy, is the test's pivirtd-sim's.
	policy := func(name string, pivirtdPort string) string {
		t.Helper()
		pairs := []string{}
		if pivirtdPort != "" {
			pairs = append(pairs, "port: 9001", "port: "+pivirtdPort)
		}
		p := e.adaptFile(t, specNetworkPolicy, name, pairs...)
		f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := fmt.Fprintf(f, "    - %s\n", m[1]); err != nil {
			t.Fatal(err)
		}
		return p
	}
	_, simPort, _ := strings.Cut(b.simAddr, ":")
	// As printed (pivirtd on 9001) with the agents' rule: accepted, and the
	// agent's calls to pivirtd on the test's port are refused.
	e.pvcliOK(t, b, "", "config", "set", "auth.network_policy", "--file", policy("networkpolicy-9001.yaml", ""))
	deny := fmt.Sprintf("network policy: no NetworkPolicy allows agent.pivirt.internal to connect to pivirtd.pivirt.internal|node-01 on port %s", simPort)
	e.c.eventually(t, 30*time.Second, "pivirtd refused on another port than the policy's", func() error {
		if r := e.pvcli(t, b, "", "vm", "list"); r.code == 0 || !strings.Contains(r.stderr, deny) {
			return fmt.Errorf("%s\nwant %q", r, deny)
		}
		return nil
	})
	// pivirtd's port: allowed.
	e.pvcliOK(t, b, "", "config", "set", "auth.network_policy", "--file", policy("networkpolicy.yaml", simPort))
	r = e.pvcliOK(t, b, "", "policy", "check", "--from", "agent.pivirt.internal", "--to", "pivirtd.pivirt.internal", "--port", simPort)
	if want := fmt.Sprintf("ALLOWED: agent.pivirt.internal -> pivirtd.pivirt.internal:%s by NetworkPolicy allow-agent-to-pivirtd (the cluster policy on node-01)", simPort); !strings.Contains(r.stdout, want) {
		t.Errorf("%s\nwant %q", r, want)
	}
	e.c.eventually(t, 30*time.Second, "pivirtd reached under the policy", func() error {
		if r := e.pvcli(t, b, "", "vm", "list"); r.code != 0 {
			return fmt.Errorf("%s", r)
		}
		return nil
	})
}
