package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/devoidc"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// TestRecoverCommandRefuses checks the recover subcommand's input errors:
// each names what is wrong and touches nothing.
func TestRecoverCommandRefuses(t *testing.T) {
	dir := t.TempDir()
	peers := filepath.Join(dir, "peers.json")
	if err := os.WriteFile(peers, []byte(`[{"id":"n1","address":"127.0.0.1:8300"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"recover"}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty, "--peers", filepath.Join(dir, "missing.json")}, "peers file"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers}, "no node-id here"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers, "extra"}, "unknown command"},
	} {
		var out, errOut bytes.Buffer
		err := Run(context.Background(), tt.args, &out, &errOut)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("pivirt-agent %s = %v, want an error containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Errorf("a refused recover wrote into the data dir: %v", entries)
	}
}

// TestUsageErrors: a command line cobra refuses, or a subcommand without
// its required flag, is a *UsageError (exit status 2); an error of a
// command that ran is not.
func TestUsageErrors(t *testing.T) {
	for _, tt := range []struct {
		args  []string
		usage bool
	}{
		{[]string{"--nonsense"}, true},
		{[]string{"nonsense"}, true},
		{[]string{"validate", "extra"}, true},
		{[]string{"validate"}, true},
		{[]string{"recover", "--data-dir", t.TempDir(), "--peers", "x", "extra"}, true},
		{[]string{"validate", "--config", filepath.Join(t.TempDir(), "missing.yaml")}, false},
	} {
		err := Run(t.Context(), tt.args, io.Discard, io.Discard)
		var ue *UsageError
		if err == nil || errors.As(err, &ue) != tt.usage {
			t.Errorf("pivirt-agent %s = %v (%T), want a usage error: %v", strings.Join(tt.args, " "), err, err, tt.usage)
		}
	}
}

// TestValidateCommand: pivirt-agent validate --config FILE checks the
// file's keys and values and the files it names, offline.
func TestValidateCommand(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	badPolicy := write("rbac.yaml", "apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules:\n  - roles: [x]\n    resources: [vms]\n    verbs: [get]\n")
	shortKey := write("short.key", "YWJj\n") // "abc": 3 bytes
	notBase64 := write("garbled.key", "not base64!\n")
	readableKey := write("readable.key", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n") // 32 bytes
	if err := os.Chmod(readableKey, 0o644); err != nil {
		t.Fatal(err)
	}
	pki := filepath.Join(dir, "pki")
	if _, err := identity.InitCA(pki, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindServer, Name: "node-01", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node-02"})
	if err != nil {
		t.Fatal(err)
	}
	cli3, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node-03", Cluster: "lab"})
	if err != nil {
		t.Fatal(err)
	}
	withCerts := func(nodeName string, tlsLines ...string) string {
		return "data_dir: " + dir + "\nnode_name: " + nodeName + "\ntls:\n  enabled: true\n  ca_file: " + filepath.Join(pki, identity.ChainFile) +
			"\n  cert_file: " + cli.Cert + "\n  key_file: " + cli.Key + "\n" + strings.Join(tlsLines, "") + "server:\n  connectrpc:\n    tls:\n      cert_file: " + srv.Cert + "\n      key_file: " + srv.Key + "\n      ca_file: " + filepath.Join(pki, identity.ChainFile) + "\n      client_ca_file: " + filepath.Join(pki, identity.ChainFile) + "\n"
	}
	otherPKI := filepath.Join(dir, "other-pki")
	if _, err := identity.InitCA(otherPKI, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	etcd := "service_discovery:\n  type: etcd\n  etcd:\n    endpoints: [\"https://127.0.0.1:2379\"]\n"
	for name, tc := range map[string]struct {
		body string
		want string
	}{
		"good with certificates": {withCerts("node-02"), "ok"},
		"good cluster ca": {withCerts("node-02", "  cluster_ca:\n    enabled: true\n    cert_file: "+filepath.Join(pki, identity.IntermediateCertFile)+
			"\n    key_file: "+filepath.Join(pki, identity.IntermediateKeyFile)+"\n"), "ok"},
		"cluster ca of another chain": {withCerts("node-02", "  cluster_ca:\n    enabled: true\n    cert_file: "+filepath.Join(otherPKI, identity.IntermediateCertFile)+
			"\n    key_file: "+filepath.Join(otherPKI, identity.IntermediateKeyFile)+"\n"), "does not chain to tls.ca_file"},
		"backend tls files": {withCerts("node-02") + "backends:\n  pivirtd:\n    endpoint: unix:///run/pivirtd/pivirtd.sock\n    tls:\n      enabled: true\n      ca_file: " + dir + "/none.pem\n",
			"backends.pivirtd.tls"},
		"etcd tls files": {withCerts("node-02") + etcd + "    ca_file: " + dir + "/none.pem\n",
			"service_discovery.etcd.ca_file: open " + dir + "/none.pem: no such file"},
		"etcd key file missing": {withCerts("node-02") + etcd + "    cert_file: " + cli.Cert + "\n    key_file: " + dir + "/none.key\n",
			"service_discovery.etcd.key_file: open " + dir + "/none.key: no such file"},
		"etcd ca file unreadable":          {withCerts("node-02") + etcd + "    ca_file: " + pki + "\n", "service_discovery.etcd.ca_file: read " + pki},
		"two problems":                     {"data_dir: " + dir + "\ntls:\n  enabled: false\nratelimiting: {}\nfoo: 1\n", "2 problems:\n  ratelimiting: unknown key"},
		"another node's agent certificate": {withCerts("node-01"), `is the agent identity of node "node-02", but node_name is "node-01"`},
		"good":                             {"data_dir: " + dir + "\ntls:\n  enabled: false\n", "ok"},
		"bad value":                        {"data_dir: " + dir + "\ntls:\n  enabled: false\nrate_limiting:\n  enabled: true\n  requests_per_second: 0\n", "rate_limiting.requests_per_second"},
		"unknown key":                      {"data_dir: " + dir + "\ntls:\n  enabled: false\nratelimiting: {}\n", "ratelimiting: unknown key"},
		"bad policy":                       {"data_dir: " + dir + "\ntls:\n  enabled: false\nauth:\n  rbac_policy: " + badPolicy + "\n", `rules[0].resources[0]: unknown "vms"`},
		"missing certificates":             {"data_dir: " + dir + "\ntls:\n  enabled: true\n  cert_file: " + dir + "/none.crt\n  key_file: " + dir + "/none.key\n  ca_file: " + dir + "/ca.pem\n", "none.crt"},
		// What the agent refuses at start, validate refuses too.
		"3-byte gossip key":                    {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + shortKey + "\n", "key is 3 bytes"},
		"gossip key not base64":                {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + notBase64 + "\n", "is not base64"},
		"missing gossip key":                   {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + dir + "/none.key\n", "cluster.gossip.encrypt_key_file"},
		"gossip key readable by others":        {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + readableKey + "\n", "readable by group or others"},
		"verify_peer false":                    {"data_dir: " + dir + "\ntls:\n  enabled: true\n  verify_peer: false\n", "tls.verify_peer"},
		"server certificate as the agent's":    {strings.Replace(withCerts("node-02"), "cert_file: "+cli.Cert+"\n  key_file: "+cli.Key, "cert_file: "+srv.Cert+"\n  key_file: "+srv.Key, 1), "tls.cert_file " + srv.Cert},
		"agent certificate of another cluster": {strings.Replace(withCerts("node-03"), cli.Cert+"\n  key_file: "+cli.Key, cli3.Cert+"\n  key_file: "+cli3.Key, 1) + "cluster:\n  name: other\n", "set cluster.name to the certificate's cluster"},
		"missing descriptor set": {"data_dir: " + dir + "\ntls:\n  enabled: false\nbackends:\n  echo:\n    endpoint: 127.0.0.1:1\nrouting:\n  rules:\n    - match: {prefix: /echo.v1.Echo/}\n      route: {cluster: echo, descriptor_set: " + dir + "/none.binpb}\n",
			"routing.rules[0].route.descriptor_set"},
		"bad network policy":  {withCerts("node-02") + "auth:\n  network_policy: " + badPolicy + "\n", "auth.network_policy"},
		"missing rbac policy": {"data_dir: " + dir + "\ntls:\n  enabled: false\nauth:\n  rbac_policy: " + dir + "/none.yaml\n", "none.yaml"},
		"backend certificate missing": {"data_dir: " + dir + "\ntls:\n  enabled: false\nbackends:\n  osinfodb:\n    endpoint: https://127.0.0.1:1\n    tls:\n      enabled: true\n      cert_file: " + dir + "/none.crt\n      key_file: " + dir + "/none.key\n      ca_file: " + filepath.Join(pki, identity.ChainFile) + "\n",
			"backends.osinfodb.tls: cert file: stat " + dir + "/none.crt"},
		"log file in a missing directory": {"data_dir: " + dir + "\ntls:\n  enabled: false\nlogging:\n  output: " + dir + "/none/agent.log\n", "logging.output: the directory of " + dir + "/none/agent.log"},
		"route to no backend":             {"data_dir: " + dir + "\ntls:\n  enabled: false\nrouting:\n  rules:\n    - match: {prefix: /echo.v1.Echo/}\n      route: {cluster: echo}\n", "routing.rules[0].route.cluster"},
	} {
		path := write(strings.ReplaceAll(name, " ", "-")+".yaml", tc.body)
		var out, errOut bytes.Buffer
		err := Run(t.Context(), []string{"validate", "--config", path}, &out, &errOut)
		if tc.want == "ok" {
			if err != nil || !strings.Contains(out.String(), path+": ok") {
				t.Errorf("%s: %v %q", name, err, out.String())
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Count(err.Error(), path) != 1 {
			t.Errorf("%s: %v, want an error naming the file once and %q", name, err, tc.want)
			continue
		}
		// The start refuses it, by the same check and in the same words.
		if serr := startRefusal(t, path); serr == nil || !strings.Contains(serr.Error(), tc.want) {
			t.Errorf("%s: validate refuses it (%v), the start: %v", name, err, serr)
		}
	}
	missing := filepath.Join(dir, "missing.yaml")
	err = Run(t.Context(), []string{"validate", "--config", missing}, io.Discard, io.Discard)
	if want := missing + ": no such file or directory"; err == nil || err.Error() != want {
		t.Errorf("a missing file: %v, want %q", err, want)
	}
}

// startRefusal starts an agent with the configuration file (on free ports
// of 127.0.0.1, in a data dir of its own) and returns its refusal; one that
// starts is stopped and reported as nil.
func startRefusal(t *testing.T, file string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"--config", file, "--data-dir", t.TempDir(), "--api-addr", "127.0.0.1:0", "--internal-addr", "127.0.0.1:0",
			"--metrics-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0", "--raft-addr", "127.0.0.1:0"}, &out, &out)
	}()
	for {
		select {
		case err := <-done:
			return err
		case <-ctx.Done():
			t.Fatalf("%s: the agent neither refused nor started within 60 s; its log:\n%s", file, out.String())
		case <-time.After(50 * time.Millisecond): // poll the log, bounded by ctx
			if strings.Contains(out.String(), "agent started") {
				cancel()
				<-done
				return nil
			}
		}
	}
}

// TestValidateShowsRoutes: validate prints the backends with their scope,
// the routes in force (the defaults without a routing block, as the spec's
// example configuration has none) and the APIs no backend serves.
func TestValidateShowsRoutes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.yaml")
	body := "data_dir: " + dir + "\ntls:\n  enabled: false\nbackends:\n  pivirtd:\n    endpoint: unix:///run/pivirtd/pivirtd.sock\n    timeout: 30s\n" +
		"  osinfodb:\n    endpoint: https://osinfodb.pilab.hu:8443\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if err := Run(t.Context(), []string{"validate", "--config", path}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		path + ": ok",
		"backend pivirtd: unix:///run/pivirtd/pivirtd.sock, scope node",
		"backend osinfodb: https://osinfodb.pilab.hu:8443, scope cluster",
		"default route: /pivirt.vm.v1.VMService/ -> pivirtd",
		"default route: /pivirt.network.v1.NetworkService/ -> pivirtd",
		"not served: pivirt.storage.v1.StorageService (backends.iscsiman is not configured)",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("validate printed\n%s\nwant a line %q", out.String(), want)
		}
	}
}

// syncBuffer is a bytes.Buffer for a writer in another goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestDevHelp: the help of --dev says what dev mode does: TLS on, with a
// throw-away PKI, and a --config that sets its keys refused.
func TestDevHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if err := Run(t.Context(), []string{"--help"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	var line string
	for l := range strings.Lines(out.String()) {
		if strings.Contains(l, "--dev") {
			line = l
		}
	}
	for _, want := range []string{"127.0.0.1", "TLS on with a throw-away PKI", "printed to stderr", "refuses a --config that sets the keys it sets"} {
		if !strings.Contains(line, want) {
			t.Errorf("--dev help %q does not say %q", line, want)
		}
	}
	if strings.Contains(line, "TLS off") {
		t.Errorf("--dev help %q says TLS is off", line)
	}
}

// TestDevRefusesConfigKeys: pivirt-agent --dev --config FILE refuses a
// file that sets keys dev mode would ignore, naming them, before it
// starts anything.
func TestDevRefusesConfigKeys(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "agent.yaml")
	if err := os.WriteFile(file, []byte("tls:\n  enabled: false\ncluster:\n  retry_join: [\"10.0.0.2:7946\"]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A context already done: were the file accepted, the agent would stop
	// at once rather than run on.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var out, errOut bytes.Buffer
	err := Run(ctx, []string{"--dev", "--config", file, "--data-dir", filepath.Join(dir, "data"), "--api-addr", "127.0.0.1:0", "--internal-addr", "127.0.0.1:0",
		"--metrics-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0", "--raft-addr", "127.0.0.1:0"}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error(), "would ignore the file's values: tls.enabled (line 2), cluster.retry_join (line 4); remove them from the file") {
		t.Errorf("pivirt-agent --dev --config with tls.enabled and cluster.retry_join = %v, want a refusal naming both", err)
	}
	if _, serr := os.Stat(filepath.Join(dir, "data")); serr == nil {
		t.Error("the refused agent made its data dir")
	}
}

// TestDevBanner runs pivirt-agent --dev in-process: it prints a banner to
// stderr with the export PVCLI_… lines, one per line, that reach the node
// over TLS with the throw-away PKI; the log does not carry them, and does
// not warn that the certificates it just made expire soon.
func TestDevBanner(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"--dev", "--data-dir", dir, "--api-addr", "127.0.0.1:0", "--internal-addr", "127.0.0.1:0",
			"--metrics-addr", "127.0.0.1:0", "--gossip-addr", "127.0.0.1:0", "--raft-addr", "127.0.0.1:0"}, &out, &errOut)
	}()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("pivirt-agent --dev: %v", err)
			}
		}
	}
	defer stop()

	env := map[string]string{}
	deadline := time.Now().Add(90 * time.Second)
	for len(env) < 4 {
		select {
		case err := <-done:
			stopped = true
			t.Fatalf("pivirt-agent --dev exited: %v\nstderr:\n%s\nlog:\n%s", err, errOut.String(), out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no export PVCLI_ lines on stderr within 90 s; stderr:\n%s\nlog:\n%s", errOut.String(), out.String())
		}
		for l := range strings.Lines(errOut.String()) {
			if k, v, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(l), "export "), "="); ok && strings.HasPrefix(strings.TrimSpace(l), "export PVCLI_") {
				env[k] = v
			}
		}
		if len(env) < 4 {
			time.Sleep(50 * time.Millisecond) // poll, bounded by the deadline
		}
	}
	banner := errOut.String()
	for _, want := range []string{"pivirt-agent --dev", "TLS is on", "data dir: " + dir + "\n", "To use pvcli"} {
		if !strings.Contains(banner, want) {
			t.Errorf("banner %q does not say %q", banner, want)
		}
	}
	if ep := env["PVCLI_ENDPOINT"]; !strings.HasPrefix(ep, "https://127.0.0.1:") || strings.HasSuffix(ep, ":0") {
		t.Errorf("PVCLI_ENDPOINT=%s, want the API port's https address", ep)
	}
	for _, k := range []string{"PVCLI_CA_FILE", "PVCLI_CERT_FILE", "PVCLI_KEY_FILE"} {
		if !strings.HasPrefix(env[k], filepath.Join(dir, agent.DevPKIDir)+"/") {
			t.Errorf("%s=%s, want a file of the dev PKI in %s", k, env[k], dir)
		}
	}

	// The lines as pvcli would use them: the node answers over mutual TLS.
	op, err := tls.LoadX509KeyPair(env["PVCLI_CERT_FILE"], env["PVCLI_KEY_FILE"])
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(env["PVCLI_CA_FILE"])
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{op}, MinVersion: tls.VersionTLS12}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	api := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: tr, Timeout: 10 * time.Second}, env["PVCLI_ENDPOINT"])
	deadline = time.Now().Add(60 * time.Second)
	for {
		_, err := api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dev node did not answer with the banner's settings within 60 s: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // poll, bounded by the deadline
	}

	// The development OIDC issuer: the banner's dev-token line, as pitrust
	// runs it (its key and recorded URL in the named directory), gives a
	// token the node takes without a client certificate; a token of another
	// key, and no credentials at all, are refused.
	var tokenDir string
	for l := range strings.Lines(banner) {
		if _, rest, ok := strings.Cut(l, "export TOKEN=$(pitrust dev-token --dir "); ok {
			tokenDir, _, _ = strings.Cut(rest, " ")
		}
	}
	if tokenDir != filepath.Join(dir, agent.DevPKIDir) {
		t.Fatalf("banner %q: no export TOKEN=$(pitrust dev-token --dir %s ...) line", banner, filepath.Join(dir, agent.DevPKIDir))
	}
	for _, want := range []string{"development OIDC issuer serves on http://127.0.0.1:", `-H "authorization: Bearer $TOKEN"`, `--token "$TOKEN"`} {
		if !strings.Contains(banner, want) {
			t.Errorf("banner %q does not say %q", banner, want)
		}
	}
	mint := func(dir string) string {
		t.Helper()
		key, err := devoidc.LoadOrCreateKey(dir)
		if err != nil {
			t.Fatal(err)
		}
		iss, err := devoidc.IssuerURL(tokenDir)
		if err != nil {
			t.Fatal(err)
		}
		raw, _, err := key.Mint(devoidc.Request{Issuer: iss, User: "alice", Roles: []string{"vm-owner"}})
		if err != nil {
			t.Fatal(err)
		}
		return raw
	}
	certless := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, ForceAttemptHTTP2: true}
	defer certless.CloseIdleConnections()
	bearerAPI := func(token string) error {
		c := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: certless, Timeout: 10 * time.Second}, env["PVCLI_ENDPOINT"])
		req := connect.NewRequest(&clusterv1.LeaderRequest{})
		if token != "" {
			req.Header().Set("Authorization", "Bearer "+token)
		}
		_, err := c.Leader(ctx, req)
		return err
	}
	if err := bearerAPI(mint(tokenDir)); err != nil {
		t.Errorf("a dev token without a client certificate: %v", err)
	}
	if err := bearerAPI(mint(t.TempDir())); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("a token of another key: %v, want Unauthenticated", err)
	}
	if err := bearerAPI(""); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("neither token nor certificate: %v, want Unauthenticated", err)
	}

	// Stopped, the agent has run its certificate check (at start, before
	// waiting a day): the whole log is in.
	stop()
	log := out.String()
	if strings.Contains(log, "PVCLI_") {
		t.Error("the log carries the pvcli settings; they belong in the banner")
	}
	if strings.Contains(log, "need renewal") || strings.Contains(log, "renew soon") {
		t.Errorf("dev mode warns about its own certificates:\n%s", log)
	}
	if !strings.Contains(log, "dev mode: TLS with a throw-away PKI") {
		t.Errorf("the log does not say dev mode made a PKI:\n%s", log)
	}
}
