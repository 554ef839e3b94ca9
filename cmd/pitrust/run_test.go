package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"

	"pilab.hu/pivirt-agent/identity/devoidc"
)

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := Run(context.Background(), args, &out, &errOut)
	return out.String(), err
}

func TestPitrustCommands(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	out, err := run(t, "init", "--dir", dir)
	if err != nil || !strings.Contains(out, "PiRootR1.pem") {
		t.Fatalf("init: %q, %v", out, err)
	}
	// The spec's commands, as written there.
	out, err = run(t, "issue-mtls-server", "--dir", dir, "--name", "node-01.pivirt.internal", "--dns", "node-01.pivirt.internal", "--ip", "127.0.0.1", "--days", "365")
	if err != nil || !strings.Contains(out, "node-01.pivirt.internal, 127.0.0.1") {
		t.Fatalf("issue-mtls-server: %q, %v", out, err)
	}
	// The spec's troubleshooting reads agent-server.crt: the output says
	// which flag writes that name.
	if !strings.Contains(out, "/etc/pivirt/certs/agent-server.crt") || !strings.Contains(out, "--out agent-server") {
		t.Errorf("issue-mtls-server without --out: %q, want the agent's default file and --out agent-server", out)
	}
	if out, err := run(t, "issue-mtls-server", "--dir", dir, "--name", "node-01.pivirt.internal", "--out", "agent-server"); err != nil || strings.Contains(out, "note: the agent's default") {
		t.Errorf("issue-mtls-server --out agent-server: %q, %v, want no note", out, err)
	}
	if _, err := run(t, "issue-mtls-client", "--dir", dir, "--name", "pivirt-agent-node-01", "--days", "365"); err != nil {
		t.Fatalf("issue-mtls-client: %v", err)
	}
	for _, f := range []string{"node-01.pivirt.internal.crt", "node-01.pivirt.internal.key", "pivirt-agent-node-01.crt", "pivirt-agent-node-01.key"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}

	srv := filepath.Join(dir, "node-01.pivirt.internal.crt")
	out, err = run(t, "verify", "--dir", dir, "--name", "127.0.0.1", srv)
	if err != nil || !strings.Contains(out, "OK (trusted by") || !strings.Contains(out, "server authentication") || strings.Count(out, "chain[") != 3 {
		t.Errorf("verify: %q, %v", out, err)
	}
	out, err = run(t, "verify", "--dir", dir, "-o", "json", filepath.Join(dir, "pivirt-agent-node-01.crt"))
	var res struct {
		Usage string `json:"usage"`
		Chain []struct {
			Subject string `json:"subject"`
		} `json:"chain"`
	}
	if err != nil || json.Unmarshal([]byte(out), &res) != nil || res.Usage != "client authentication" || len(res.Chain) != 3 {
		t.Errorf("verify -o json: %q, %v", out, err)
	}
	if _, err := run(t, "verify", "--dir", dir, "--name", "other.example", srv); err == nil || !strings.Contains(err.Error(), "NOT trusted") {
		t.Errorf("verify with a wrong name = %v", err)
	}
	other := filepath.Join(t.TempDir(), "other")
	if _, err := run(t, "init", "--dir", other); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "verify", "--ca", filepath.Join(other, "ca-chain.pem"), srv); err == nil || !strings.Contains(err.Error(), "not signed by the given CA chain") {
		t.Errorf("verify against another CA = %v", err)
	}

	out, err = run(t, "inspect", srv)
	if err != nil || !strings.Contains(out, "certificate[1]") || !strings.Contains(out, "PiTrust X1 Intermediate CA") || !strings.Contains(out, "days left") {
		t.Errorf("inspect: %q, %v", out, err)
	}
	out, err = run(t, "inspect", "-o", "json", filepath.Join(dir, "ca-chain.pem"))
	var infos []struct {
		Subject string `json:"subject"`
		IsCA    bool   `json:"isCa"`
	}
	if err != nil || json.Unmarshal([]byte(out), &infos) != nil || len(infos) != 2 || !infos[0].IsCA {
		t.Errorf("inspect -o json: %q, %v", out, err)
	}
	checkCamelKeys(t, "inspect -o json", out)
	out, _ = run(t, "verify", "--dir", dir, "-o", "json", srv)
	checkCamelKeys(t, "verify -o json", out)
}

// checkCamelKeys fails unless out is JSON whose object keys are all
// lowerCamelCase (pvcli's -o json contract, docs/getting-started.md, "Scripting with pvcli").
func checkCamelKeys(t *testing.T, what, out string) {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("%s: %v\n%s", what, err, out)
	}
	camel := regexp.MustCompile(`^[a-z][a-zA-Z0-9]*$`)
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				if !camel.MatchString(k) {
					t.Errorf("%s: key %q is not lowerCamelCase", what, k)
				}
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(v)
}

func TestPitrustRefuses(t *testing.T) {
	dir := t.TempDir()
	if _, err := run(t, "init", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "PiCA.key")
	before, _ := os.ReadFile(key)
	var ue *usageError
	for _, tt := range []struct {
		args  []string
		want  string
		usage bool
	}{
		{[]string{"init", "--dir", dir}, "already exists (use --force", false},
		{[]string{"issue-mtls-server", "--dir", dir}, "--name is required", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--ip", "300.1.1.1"}, `--ip "300.1.1.1" is not an IP address`, true},
		{[]string{"issue-mtls-client", "--dir", dir, "--name", "c", "--ip", "10.0.0.1"}, "unknown flag: --ip", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--days", "0"}, "--days 0", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--days", "99999"}, "days 99999", false},
		{[]string{"issue-mtls-server", "--dir", filepath.Join(dir, "nothing"), "--name", "a.example"}, "no PiTrust CA", false},
		{[]string{"verify", "--dir", dir, filepath.Join(dir, "missing.crt")}, "missing.crt", false},
		{[]string{"inspect", "-o", "yaml", key}, "--output", true},
		{[]string{"inspect", key}, "no PEM certificate", false},
		{[]string{"rotate"}, "unknown command", true},
	} {
		_, err := run(t, tt.args...)
		if err == nil || !strings.Contains(err.Error(), tt.want) || errors.As(err, &ue) != tt.usage {
			t.Errorf("pitrust %s = %v (usage error: %v), want an error containing %q (usage error: %v)",
				strings.Join(tt.args, " "), err, errors.As(err, &ue), tt.want, tt.usage)
		}
	}
	if after, _ := os.ReadFile(key); !bytes.Equal(after, before) {
		t.Error("a refused command changed the CA key")
	}
}

// TestPitrustOutUsageReissue: --out names the files, --usage
// server,client makes one certificate that serves both ends of a real
// mutual TLS handshake, and issuing again keeps the replaced pair as
// .prev (keys 0600) unless --force.
func TestPitrustOutUsageReissue(t *testing.T) {
	dir := t.TempDir()
	if _, err := run(t, "init", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	issue := func(extra ...string) string {
		t.Helper()
		out, err := run(t, append([]string{"issue-mtls-server", "--dir", dir, "--name", "pivirt-agent-node-01", "--dns", "localhost", "--ip", "127.0.0.1",
			"--usage", "server,client", "--out", "agent-server"}, extra...)...)
		if err != nil {
			t.Fatalf("issue-mtls-server --out agent-server: %v", err)
		}
		return out
	}
	read := func(name string) []byte {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	keyModes := func(names ...string) {
		t.Helper()
		for _, n := range names {
			if st, err := os.Stat(filepath.Join(dir, n)); err != nil || st.Mode().Perm() != 0o600 {
				t.Errorf("%s: %v, want mode 0600", n, err)
			}
		}
	}

	out := issue()
	if !strings.Contains(out, "agent-server.crt") || !strings.Contains(out, "usage: server authentication, client authentication") || strings.Contains(out, ".prev") {
		t.Errorf("first issue printed %q", out)
	}
	for _, f := range []string{"pivirt-agent-node-01.crt", "pivirt-agent-node-01.key", "agent-server.crt.prev", "agent-server.key.prev"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			t.Errorf("%s was written", f)
		}
	}
	keyModes("agent-server.key")
	cert := filepath.Join(dir, "agent-server.crt")
	if out, err := run(t, "verify", "--dir", dir, "--name", "127.0.0.1", cert); err != nil || !strings.Contains(out, "for server and client authentication") {
		t.Errorf("verify: %q, %v", out, err)
	}
	pair, err := tls.LoadX509KeyPair(cert, filepath.Join(dir, "agent-server.key"))
	if err != nil {
		t.Fatal(err)
	}
	if pair.Leaf.Subject.CommonName != "pivirt-agent-node-01" {
		t.Errorf("CN %q, want the --name", pair.Leaf.Subject.CommonName)
	}
	handshake(t, filepath.Join(dir, "ca-chain.pem"), pair)

	// Reissue: the old pair is kept as .prev; again: .prev is the one
	// just replaced.
	for i := range 2 {
		oldCert, oldKey := read("agent-server.crt"), read("agent-server.key")
		out = issue()
		if !strings.Contains(out, "agent-server.crt.prev") || !strings.Contains(out, "agent-server.key.prev") {
			t.Errorf("reissue %d printed %q, want the .prev files named", i+1, out)
		}
		if !bytes.Equal(read("agent-server.crt.prev"), oldCert) || !bytes.Equal(read("agent-server.key.prev"), oldKey) {
			t.Errorf("reissue %d: the .prev files are not the pair it replaced", i+1)
		}
		if bytes.Equal(read("agent-server.crt"), oldCert) || bytes.Equal(read("agent-server.key"), oldKey) {
			t.Errorf("reissue %d did not replace the pair", i+1)
		}
		keyModes("agent-server.key", "agent-server.key.prev")
		if _, err := tls.LoadX509KeyPair(filepath.Join(dir, "agent-server.crt.prev"), filepath.Join(dir, "agent-server.key.prev")); err != nil {
			t.Errorf("reissue %d: the kept pair does not load: %v", i+1, err)
		}
	}

	// --force keeps nothing: the .prev files stay those of the last
	// reissue.
	prevCert, prevKey, oldCert := read("agent-server.crt.prev"), read("agent-server.key.prev"), read("agent-server.crt")
	if out := issue("--force"); strings.Contains(out, ".prev") {
		t.Errorf("--force printed %q", out)
	}
	if bytes.Equal(read("agent-server.crt"), oldCert) || !bytes.Equal(read("agent-server.crt.prev"), prevCert) || !bytes.Equal(read("agent-server.key.prev"), prevKey) {
		t.Error("--force: want the pair replaced and the .prev files untouched")
	}
	keyModes("agent-server.key", "agent-server.key.prev")
	pair, err = tls.LoadX509KeyPair(cert, filepath.Join(dir, "agent-server.key"))
	if err != nil {
		t.Fatal(err)
	}
	handshake(t, filepath.Join(dir, "ca-chain.pem"), pair)

	// The default usages stay one each.
	if out, err := run(t, "issue-mtls-client", "--dir", dir, "--name", "pivirt-agent-node-02", "--out", "agent-client"); err != nil || !strings.Contains(out, "usage: client authentication\n") {
		t.Errorf("issue-mtls-client --out agent-client: %q, %v", out, err)
	}
	var ue *usageError
	for _, tt := range []struct {
		args  []string
		want  string
		usage bool
	}{
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--usage", "server,peer"}, `--usage "peer": want server, client or both`, true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--usage", "client"}, "always for server authentication", false},
		{[]string{"issue-mtls-client", "--dir", dir, "--name", "c", "--usage", "server"}, "always for client authentication", false},
		{[]string{"issue-mtls-client", "--dir", dir, "--name", "node_1", "--usage", "client,server"}, "needs --dns or --ip", false},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--out", "../a"}, `out "../a": a file name without directory`, false},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--out", "PiCA"}, `"PiCA" is the CA's own file name`, false},
	} {
		_, err := run(t, tt.args...)
		if err == nil || !strings.Contains(err.Error(), tt.want) || errors.As(err, &ue) != tt.usage {
			t.Errorf("pitrust %s = %v (usage error: %v), want an error containing %q (usage error: %v)",
				strings.Join(tt.args, " "), err, errors.As(err, &ue), tt.want, tt.usage)
		}
	}
}

// handshake runs mutual TLS on 127.0.0.1 with pair on both ends, each
// verifying the other against caFile for its own role.
func handshake(t *testing.T, caFile string, pair tls.Certificate) {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("no CA in " + caFile)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{pair}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		served <- c.(*tls.Conn).Handshake()
	}()
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", ln.Addr().String(), &tls.Config{
		Certificates: []tls.Certificate{pair}, RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12,
	})
	if err != nil {
		t.Fatalf("client handshake with the certificate as server: %v", err)
	}
	// The server's verdict on the client certificate arrives with the
	// first read under TLS 1.3.
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = conn.Read(make([]byte, 1))
	conn.Close()
	if err := <-served; err != nil {
		t.Fatalf("server handshake with the certificate as client: %v", err)
	}
}

// TestDevIssuerAndToken runs pitrust dev-issuer on 127.0.0.1 and mints
// tokens with pitrust dev-token from its directory: go-oidc, discovering
// the issuer, verifies them (iss, aud, signature by the served JWKS) and
// reads the user and roles; a token of another directory's key does not
// verify; the token endpoint answers only with the directory's secret; the
// issuer listens only on loopback.
func TestDevIssuerAndToken(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	if _, err := run(t, "dev-token", "--dir", dir, "--user", "alice"); err == nil || !strings.Contains(err.Error(), "dev-issuer") {
		t.Errorf("dev-token without a key = %v, want an error saying how to make one", err)
	}
	if _, err := run(t, "dev-issuer", "--dir", dir, "--addr", "0.0.0.0:0"); err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("dev-issuer --addr 0.0.0.0:0 = %v, want a refusal: loopback only", err)
	}

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"dev-issuer", "--dir", dir, "--addr", "127.0.0.1:0"}, io.Discard, io.Discard)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("dev-issuer: %v", err)
		}
	}()
	var issuer string
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(filepath.Join(dir, devoidc.IssuerFile))
		if issuer = strings.TrimSpace(string(b)); strings.HasPrefix(issuer, "http://127.0.0.1:") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dev-issuer recorded no URL in %s within 10 s", dir)
		}
		time.Sleep(20 * time.Millisecond) // poll, bounded by the deadline
	}
	for _, f := range []string{devoidc.KeyFile, devoidc.SecretFile} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v, want mode 0600", f, err)
		}
	}

	out, err := run(t, "dev-token", "--dir", dir, "--user", "alice", "--roles", "vm-owner,viewer", "--ttl", "30m")
	if err != nil {
		t.Fatalf("dev-token: %v", err)
	}
	raw := strings.TrimSuffix(out, "\n")
	if strings.ContainsAny(raw, " \n") {
		t.Fatalf("dev-token printed %q, want the token alone on a line", out)
	}
	provider, err := oidc.NewProvider(ctx, issuer)
	if err != nil {
		t.Fatalf("discovery of %s: %v", issuer, err)
	}
	verifier := provider.Verifier(&oidc.Config{ClientID: devoidc.Audience})
	tok, err := verifier.Verify(ctx, raw)
	if err != nil {
		t.Fatalf("the dev token does not verify: %v", err)
	}
	var claims struct {
		Sub   string   `json:"sub"`
		Roles []string `json:"roles"`
	}
	if err := tok.Claims(&claims); err != nil || claims.Sub != "alice" || !slices.Equal(claims.Roles, []string{"vm-owner", "viewer"}) {
		t.Errorf("claims %+v (%v), want sub alice, roles [vm-owner viewer]", claims, err)
	}
	if life := time.Until(tok.Expiry); life > 30*time.Minute || life < 29*time.Minute {
		t.Errorf("the token expires in %s, want --ttl 30m", life)
	}

	// Another directory's key, with this issuer's iss: refused.
	other := filepath.Join(t.TempDir(), "other")
	if _, err := devoidc.LoadOrCreateKey(other); err != nil {
		t.Fatal(err)
	}
	forged, err := run(t, "dev-token", "--dir", other, "--issuer", issuer, "--user", "mallory", "--roles", "admin")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := verifier.Verify(ctx, strings.TrimSpace(forged)); err == nil {
		t.Error("a token of another key verifies")
	}
	for _, args := range [][]string{
		{"--user", "alice", "--ttl", "13h"},
		{"--user", "alice", "--ttl", "0s"},
		{"--user", "alice", "--roles", "x;admin"},
		{"--roles", "admin"},
	} {
		if _, err := run(t, append([]string{"dev-token", "--dir", dir}, args...)...); err == nil {
			t.Errorf("dev-token %v: no error", args)
		}
	}

	// The token endpoint, with and without the directory's secret.
	secret, err := os.ReadFile(filepath.Join(dir, devoidc.SecretFile))
	if err != nil {
		t.Fatal(err)
	}
	post := func(secret string) (int, map[string]any) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, issuer+"/token",
			strings.NewReader(url.Values{"grant_type": {"client_credentials"}, "user": {"bob"}, "roles": {"viewer"}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.SetBasicAuth(devoidc.Audience, secret)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return resp.StatusCode, body
	}
	if code, body := post("wrong"); code != http.StatusUnauthorized || body["error"] != "invalid_client" {
		t.Errorf("token endpoint with a wrong secret: %d %v, want 401 invalid_client", code, body)
	}
	code, body := post(strings.TrimSpace(string(secret)))
	at, _ := body["access_token"].(string)
	if code != http.StatusOK || body["token_type"] != "Bearer" || at == "" {
		t.Fatalf("token endpoint: %d %v", code, body)
	}
	if tok, err := verifier.Verify(ctx, at); err != nil {
		t.Errorf("the token endpoint's token does not verify: %v", err)
	} else if tok.Subject != "bob" {
		t.Errorf("the token endpoint's token has subject %q, want bob", tok.Subject)
	}
}

// TestDirFromEnvironment: PITRUST_DIR is the directory when --dir is not
// given; --dir wins over it.
func TestDirFromEnvironment(t *testing.T) {
	env, flag := filepath.Join(t.TempDir(), "env"), filepath.Join(t.TempDir(), "flag")
	t.Setenv(envDir, env)
	if err := Run(t.Context(), []string{"init"}, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(env, "ca-chain.pem")); err != nil {
		t.Errorf("pitrust init with %s=%s: %v", envDir, env, err)
	}
	if err := Run(t.Context(), []string{"init", "--dir", flag}, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(flag, "ca-chain.pem")); err != nil {
		t.Errorf("pitrust init --dir %s beside %s: %v", flag, envDir, err)
	}
}

// TestVerifyAndInspectLookInDir: a bare file name not in the current
// directory is found in --dir (PITRUST_DIR).
func TestVerifyAndInspectLookInDir(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(envDir, dir)
	t.Chdir(t.TempDir())
	for _, args := range [][]string{
		{"init"},
		{"issue-mtls-server", "--name", "node-01", "--dns", "node-01"},
		{"verify", "node-01.crt", "--name", "node-01"},
		{"inspect", "node-01.crt"},
	} {
		var out bytes.Buffer
		if err := Run(t.Context(), args, &out, io.Discard); err != nil {
			t.Fatalf("pitrust %s: %v", strings.Join(args, " "), err)
		}
	}
	err := Run(t.Context(), []string{"verify", "missing.crt"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "missing.crt") {
		t.Errorf("verify of a file in neither directory: %v, want its name in the error", err)
	}
}
