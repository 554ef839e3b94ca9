package e2e_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// revocationBound is the documented bound between pitrust revoke and the
// refusal of the certificate by every agent with the default
// tls.revocation.refresh of 30 s: the next CRL fetch, plus its time.
const revocationBound = 60 * time.Second

// caServer is a running pitrust serve.
type caServer struct {
	bins binaries
	dir  string // certs_dir: the CA, and the certificates issued for the test
	url  string // https://127.0.0.1:port: the API
	http string // http://127.0.0.1:port: /ocsp and /crl
	cfg  string
	log  string
	proc *proc
}

// startCAServer makes a PiTrust CA in dir/certs, an offline admin
// certificate recorded in the database, and starts pitrust serve on a
// free port of 127.0.0.1.
func startCAServer(t *testing.T, c *cluster) *caServer {
	t.Helper()
	return startCAServerOn(t, c, filepath.Join(c.dir, "certs"), true)
}

// startCAServerOn is startCAServer on the CA in dir, made there first when
// create (else dir holds one already, as a started cluster's certs).
func startCAServerOn(t *testing.T, c *cluster, dir string, create bool) *caServer {
	t.Helper()
	s := &caServer{bins: c.bins, dir: dir}
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(ports[0])
	s.url, s.http = "https://"+addr, "http://"+addr
	db := filepath.Join(c.dir, "pitrust", "certs.db")
	if create {
		s.pitrust(t, "init")
	}
	s.pitrust(t, "issue-mtls-client", "--name", "pitrust-admin", "--db", db, "--force")
	s.cfg = filepath.Join(c.dir, "pitrust.yaml")
	s.log = filepath.Join(c.dir, "pitrust.log")
	if err := os.WriteFile(s.cfg, fmt.Appendf(nil, `server:
  addr: %q
  external_url: %q
  certs_dir: %q
  db_path: %q
auth:
  certificate_roles:
    pitrust-admin: [pitrust-admin]
`, addr, s.http, s.dir, db), 0o600); err != nil {
		t.Fatal(err)
	}
	s.start(t, c)
	return s
}

// start starts pitrust serve and waits until it answers.
func (s *caServer) start(t *testing.T, c *cluster) {
	t.Helper()
	p, err := c.spawn(s.log, s.bins.pitrust, []string{"serve", "--config", s.cfg})
	if err != nil {
		t.Fatal(err)
	}
	s.proc = p
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(s.http + "/crl")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if p.exited() || time.Now().After(deadline) {
			t.Fatalf("pitrust serve not answering (%v); log:\n%s", err, tail(s.log, 30))
		}
		time.Sleep(pollInterval)
	}
}

// stop stops pitrust serve and waits for it.
func (s *caServer) stop(t *testing.T) {
	t.Helper()
	s.proc.cancel()
	select {
	case <-s.proc.done:
	case <-time.After(2 * termGrace):
		t.Fatalf("pitrust serve still running %s after SIGTERM", 2*termGrace)
	}
}

// pitrust runs the pitrust binary with --dir and fails the test unless it
// succeeds.
func (s *caServer) pitrust(t *testing.T, args ...string) string {
	t.Helper()
	out, err := s.try(args...)
	if err != nil {
		t.Fatalf("pitrust %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func (s *caServer) try(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), pvcliBackstop)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.bins.pitrust, append([]string{"--dir", s.dir}, args...)...)
	cmd.Env = raceEnv()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	dieWithTest(cmd)
	err := cmd.Run()
	return out.String(), err
}

// admin are the flags of a call through the server as the admin.
func (s *caServer) admin() []string {
	return []string{"--server", s.url, "--ca", filepath.Join(s.dir, identity.ChainFile),
		"--cert", filepath.Join(s.dir, "pitrust-admin.crt"), "--key", filepath.Join(s.dir, "pitrust-admin.key")}
}

// request issues a certificate through the server into the CA directory.
func (s *caServer) request(t *testing.T, args ...string) {
	t.Helper()
	s.pitrust(t, append(append([]string{"request"}, s.admin()...), args...)...)
}

// serial is the serial of the leaf in file, as openssl prints it.
func serial(t *testing.T, file string) string {
	t.Helper()
	certs, err := identity.ReadCertificates(file)
	if err != nil {
		t.Fatal(err)
	}
	return identity.SerialHex(certs[0].SerialNumber)
}

// openssl runs openssl with args and returns its combined output.
func openssl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("openssl", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("openssl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestPiTrustRevocation runs the CA server with a cluster whose every
// certificate it issued: openssl's OCSP and CRL commands, a revoked
// operator certificate refused by every agent within the documented bound
// while another works, a revoked agent kept out of Raft after a restart,
// and the server's database kept over its own restart.
func TestPiTrustRevocation(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl not installed")
	}
	bins := buildBinaries(t)
	c := &cluster{bins: bins, dir: t.TempDir()}
	t.Cleanup(c.stopAll)
	ca := startCAServer(t, c)
	for i := 1; i <= 3; i++ {
		ca.request(t, "--kind", "mtls-server", "--name", fmt.Sprintf("node%d-server", i), "--dns", "localhost", "--ip", "127.0.0.1")
		ca.request(t, "--kind", "mtls-client", "--name", fmt.Sprintf("pivirt-agent-node%d", i))
	}
	ca.request(t, "--kind", "mtls-client", "--name", "operator")
	// Two certificates of the operator: the one the harness uses and
	// another, which leaks and is revoked by its serial.
	ca.request(t, "--kind", "mtls-client", "--name", "operator", "--out", "operator-leaked")
	c.certs = ca.dir
	c.tlsExtra = "  revocation:\n    mode: both\n    on_unavailable: allow\n"
	startClusterOn(t, c)

	chain := filepath.Join(ca.dir, identity.ChainFile)
	ocsp := func(cert string) string {
		// The command of the troubleshooting guide, against this server.
		return openssl(t, "ocsp", "-issuer", filepath.Join(ca.dir, identity.IntermediateCertFile), "-cert", cert,
			"-url", ca.http+"/ocsp", "-CAfile", filepath.Join(ca.dir, identity.RootCertFile))
	}
	for _, f := range []string{"node1-server.crt", "operator-leaked.crt"} {
		if out := ocsp(filepath.Join(ca.dir, f)); !strings.Contains(out, ": good") || !strings.Contains(out, "Response verify OK") {
			t.Fatalf("openssl ocsp %s before the revocation:\n%s\nwant good and a verified response", f, out)
		}
	}
	leaked := []string{"PVCLI_CA_FILE=" + chain, "PVCLI_CERT_FILE=" + filepath.Join(ca.dir, "operator-leaked.crt"),
		"PVCLI_KEY_FILE=" + filepath.Join(ca.dir, "operator-leaked.key")}
	status := func(n *node, env []string) result {
		return c.pvcliEnv(t, env, "--endpoint", "https://"+n.api, "--timeout", "5s", "cluster", "members")
	}
	for _, n := range c.nodes {
		if r := status(n, leaked); r.code != 0 {
			t.Fatalf("leaked before the revocation: %s", r)
		}
	}

	// A leaked operator certificate is revoked: every agent refuses it
	// within the bound; the other operator keeps working.
	revoked := serial(t, filepath.Join(ca.dir, "operator-leaked.crt"))
	out := ca.pitrust(t, append(append([]string{"revoke", revoked}, ca.admin()...), "--reason", "keyCompromise")...)
	if !strings.Contains(out, revoked) {
		t.Errorf("pitrust revoke %s answered:\n%s\nwant the serial", revoked, out)
	}
	start := time.Now()
	refused := map[string]time.Duration{}
	c.eventually(t, revocationBound+15*time.Second, "every agent refuses the revoked operator certificate", func() error {
		var still []string
		for _, n := range c.nodes {
			if _, ok := refused[n.name]; ok {
				continue
			}
			if r := status(n, leaked); r.code == 0 {
				still = append(still, n.name)
				continue
			}
			refused[n.name] = time.Since(start)
		}
		if len(still) > 0 {
			return fmt.Errorf("still accepted by %s", strings.Join(still, ", "))
		}
		return nil
	})
	for name, d := range refused {
		t.Logf("%s refuses the revoked certificate %s after %s", name, revoked, d.Round(100*time.Millisecond))
		if d > revocationBound {
			t.Errorf("%s refused the revoked certificate only after %s, over the documented %s", name, d, revocationBound)
		}
	}
	for _, n := range c.nodes {
		if r := status(n, c.operatorEnv()); r.code != 0 {
			t.Errorf("the operator certificate that was not revoked: %s", r)
		}
		if !strings.Contains(tailMatching(n.log, 2000, revoked), revoked) {
			t.Errorf("%s did not log the refusal naming serial %s", n.name, revoked)
		}
	}
	if out := ocsp(filepath.Join(ca.dir, "operator-leaked.crt")); !strings.Contains(out, ": revoked") || !strings.Contains(out, "Response verify OK") {
		t.Errorf("openssl ocsp leaked.crt after the revocation:\n%s\nwant revoked and a verified response", out)
	}
	resp, err := http.Get(ca.http + "/crl")
	if err != nil {
		t.Fatal(err)
	}
	der, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	crlFile := filepath.Join(c.dir, "pitrust.crl")
	if err := os.WriteFile(crlFile, der, 0o600); err != nil {
		t.Fatal(err)
	}
	if out := openssl(t, "crl", "-inform", "DER", "-in", crlFile, "-noout", "-text", "-CAfile", chain); !strings.Contains(out, revoked) ||
		!strings.Contains(out, "verify OK") || !strings.Contains(out, "Key Compromise") {
		t.Errorf("openssl crl:\n%s\nwant a verified CRL listing %s for Key Compromise", out, revoked)
	}

	// A node whose agent certificates are revoked cannot come back into
	// Raft: the others refuse its connections, and writes they commit
	// do not reach it.
	n3 := c.nodes[2]
	agentSerial := serial(t, filepath.Join(ca.dir, "pivirt-agent-node3.crt"))
	serverSerial := serial(t, filepath.Join(ca.dir, "node3-server.crt"))
	leader, err := c.agreedLeader(t, c.nodes...)
	if err != nil {
		t.Fatal(err)
	}
	if leader.Name == n3.name {
		// Revoking the leader's certificates ends its term (its peers
		// drop it); move the leadership first so that the check below
		// watches a leader that replicates to node3.
		c.stop(t, n3)
		c.mustStart(t, n3, false)
		c.eventually(t, 30*time.Second, "a leader other than node3", func() error {
			l, err := c.agreedLeader(t, c.nodes...)
			if err == nil && l.Name == n3.name {
				err = errors.New("node3 leads")
			}
			return err
		})
		leader, _ = c.agreedLeader(t, c.nodes...)
	}
	lead := c.byName(t, leader.Name)
	ca.pitrust(t, append(append([]string{"revoke"}, ca.admin()...), "--name", "pivirt-agent-node3", "--reason", "keyCompromise")...)
	ca.pitrust(t, append(append([]string{"revoke"}, ca.admin()...), "--name", "node3-server", "--reason", "keyCompromise")...)
	// Within the bound, the leader has the CRL listing node3's
	// certificates: it closes its connections to and from node3 and
	// refuses new ones, naming the serials.
	c.eventually(t, revocationBound+15*time.Second, "the leader drops node3's certificates", func() error {
		if log := tailMatching(lead.log, 4000, agentSerial, serverSerial); !strings.Contains(log, agentSerial) && !strings.Contains(log, serverSerial) {
			return fmt.Errorf("%s has not logged serial %s or %s yet", lead.name, agentSerial, serverSerial)
		}
		return nil
	})
	// node3 gets no write from then on, running or restarted: it is out
	// of the replication.
	notReplicated := func(when string) {
		t.Helper()
		marker := fmt.Sprintf("after-revocation-%d", time.Now().UnixNano())
		c.eventually(t, 30*time.Second, "a write through "+lead.name, func() error {
			if r := c.pvcli(t, lead, "service", "register", marker, "--id", marker+"-1", "--address", "10.0.0.9", "--port", "80"); r.code != 0 {
				return errors.New(r.String())
			}
			return nil
		})
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) && !n3.proc.exited() {
			r := c.pvcliEnv(t, c.operatorEnv(), "--endpoint", "https://"+n3.api, "--timeout", "3s", "--consistency", "stale",
				"service", "list", "-o", "json")
			if r.code == 0 && strings.Contains(r.stdout, marker) {
				t.Fatalf("node3, whose certificates are revoked, received a write %s:\n%s", when, r.stdout)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	notReplicated("while running")
	c.stop(t, n3)
	c.mustStart(t, n3, false)
	notReplicated("after its restart")
	if log := tailMatching(lead.log, 4000, agentSerial, serverSerial); !strings.Contains(log, "revoked") {
		t.Errorf("%s logged no refusal of node3's certificates:\n%s", lead.name, log)
	}
	// The CA server keeps its database over a restart: the revocations
	// stand.
	ca.stop(t)
	ca.start(t, c)
	list := ca.pitrust(t, append(append([]string{"list"}, ca.admin()...), "--status", "revoked")...)
	for _, s := range []string{revoked, agentSerial} {
		if !strings.Contains(list, s) {
			t.Errorf("pitrust list --status revoked after a restart of the server:\n%s\nwant %s", list, s)
		}
	}
	if out := ocsp(filepath.Join(ca.dir, "operator-leaked.crt")); !strings.Contains(out, ": revoked") {
		t.Errorf("openssl ocsp after a restart of the server:\n%s\nwant revoked", out)
	}
}

// TestPiTrustRenewal: three agents whose certificates live 45 s renew
// their server and client certificates through the CA server (a third of
// the lifetime before expiry, as 30 days is of a 90-day certificate),
// twice, while new TLS connections to every agent and writes forwarded
// over mutual TLS between them go on without one failure; /ready and
// pivirt_tls_cert_expiry_seconds show the renewed certificates.
func TestPiTrustRenewal(t *testing.T) {
	bins := buildBinaries(t)
	c := &cluster{bins: bins, dir: t.TempDir()}
	t.Cleanup(c.stopAll)
	ca := startCAServer(t, c)
	// Short-lived certificates, issued offline (the server renews
	// certificates of its CA that it did not issue itself), again for a
	// second start attempt: the first one's may have run out meanwhile.
	c.beforeBoot = func(t *testing.T) {
		for i := 1; i <= 3; i++ {
			name := fmt.Sprintf("node%d", i)
			if _, err := identity.Issue(ca.dir, identity.LeafRequest{Kind: identity.KindServer, Name: name + "-server",
				DNS: []string{"localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Validity: 45 * time.Second, Force: true}); err != nil {
				t.Fatal(err)
			}
			if _, err := identity.Issue(ca.dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-" + name,
				Validity: 45 * time.Second, Force: true}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := identity.Issue(ca.dir, identity.LeafRequest{Kind: identity.KindClient, Name: "operator", Force: true}); err != nil {
		t.Fatal(err)
	}
	c.certs = ca.dir
	c.tlsExtra = "  ca_server:\n    url: " + ca.url + "\n"
	startClusterOn(t, c)

	var files []string
	for i := 1; i <= 3; i++ {
		files = append(files, filepath.Join(ca.dir, fmt.Sprintf("node%d-server.crt", i)), filepath.Join(ca.dir, fmt.Sprintf("pivirt-agent-node%d.crt", i)))
	}
	load := startLoad(t, c)
	seen := map[string]map[string]bool{}
	for _, f := range files {
		seen[f] = map[string]bool{}
	}
	c.eventually(t, 150*time.Second, "every certificate renewed twice through the CA server", func() error {
		var behind []string
		for _, f := range files {
			certs, err := identity.ReadCertificates(f)
			if err != nil {
				return err
			}
			seen[f][certs[0].SerialNumber.String()] = true
			if len(seen[f]) < 3 {
				behind = append(behind, fmt.Sprintf("%s: %d", filepath.Base(f), len(seen[f])-1))
			}
		}
		if len(behind) > 0 {
			return fmt.Errorf("renewals so far: %s", strings.Join(behind, ", "))
		}
		return nil
	})
	ok, failed, first := load.stop()
	if failed != 0 || ok == 0 {
		t.Errorf("%d of %d requests failed while the certificates were renewed; first: %v", failed, ok+failed, first)
	}
	t.Logf("%d requests while 6 certificates were renewed twice each through the CA server, %d failed", ok, failed)

	// The renewals are in the server's inventory, and the agents report
	// them.
	list := ca.pitrust(t, append(append([]string{"list"}, ca.admin()...), "--name", "pivirt-agent-node1")...)
	if !strings.Contains(list, "pivirt-agent-node1") {
		t.Errorf("pitrust list --name pivirt-agent-node1:\n%s\nwant the renewed certificates", list)
	}
	n := c.nodes[0]
	resp, err := http.Get("http://" + n.metrics + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `"tls_renewal"`) || !strings.Contains(string(body), "server: renewal at") {
		t.Errorf("/ready of %s: %s\nwant the tls_renewal check with the next renewal", n.name, body)
	}
	resp, err = http.Get("http://" + n.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`pivirt_tls_cert_expiry_seconds{cert="client",subject="pivirt-agent-node1"}`, `pivirt_tls_cert_renewals_total{cert="server",result="ok"}`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics of %s lacks %s", n.name, want)
		}
	}
}

// load is requests run against every agent until stopped: reads on new
// TLS connections, and writes through a follower, forwarded to the leader
// over mutual TLS.
type load struct {
	stopc      chan struct{}
	wg         sync.WaitGroup
	ok, failed atomic.Int64
	first      atomic.Value
}

func startLoad(t *testing.T, c *cluster) *load {
	t.Helper()
	tlsCfg := c.clientTLS(t)
	tr := &http.Transport{TLSClientConfig: tlsCfg, ForceAttemptHTTP2: true, DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	l := &load{stopc: make(chan struct{})}
	leader, err := c.agreedLeader(t, c.nodes...)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		api := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: tr}, "https://"+n.api)
		write := n.name != leader.Name
		l.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-l.stopc:
					return
				case <-time.After(50 * time.Millisecond):
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				var err error
				if write {
					_, err = api.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
						Service: "web", InstanceId: fmt.Sprintf("w-%s-%d", n.name, i%20), Address: "10.0.0.1", Port: 80,
					}}))
				} else {
					_, err = api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
				}
				cancel()
				if err != nil {
					l.failed.Add(1)
					l.first.CompareAndSwap(nil, fmt.Errorf("%s: %w", n.name, err))
					continue
				}
				l.ok.Add(1)
			}
		})
	}
	t.Cleanup(func() { l.stop() })
	return l
}

// stop ends the load and returns its counts and its first error.
func (l *load) stop() (ok, failed int64, first any) {
	select {
	case <-l.stopc:
	default:
		close(l.stopc)
	}
	l.wg.Wait()
	return l.ok.Load(), l.failed.Load(), l.first.Load()
}
