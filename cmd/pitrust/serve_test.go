package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/caserver"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
)

// clearEnv keeps the caller's PITRUST_* variables out of a test.
func clearEnv(t *testing.T) {
	for _, v := range []string{envServer, envCA, envCert, envKey, "PITRUST_TOKEN"} {
		t.Setenv(v, "")
	}
}

// startServe runs `pitrust serve --config` in-process until the test ends
// and returns the API's URL.
func startServe(t *testing.T, dir string) string {
	t.Helper()
	cfgFile := filepath.Join(t.TempDir(), "pitrust.yaml")
	// --addr wins over server.addr (port 1 would not be ours to bind).
	cfg := "server:\n  addr: 127.0.0.1:1\n  certs_dir: " + dir + "\n  db_path: " + filepath.Join(dir, "..", "certs.db") +
		"\nauth:\n  certificate_roles:\n    operator: [pitrust-admin]\n"
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	started := make(chan *caserver.Server, 1)
	serveHook = func(s *caserver.Server) { started <- s }
	t.Cleanup(func() { serveHook = nil })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"serve", "--config", cfgFile, "--addr", "127.0.0.1:0"}, io.Discard, io.Discard)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("serve did not stop")
		}
	})
	select {
	case s := <-started:
		return "https://" + s.Addr().String()
	case err := <-done:
		t.Fatalf("serve: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not start")
	}
	return ""
}

// TestServeTokenRequestRevokeList: the bootstrap of a new host end to end
// — an operator makes a token through the server, the host gets its
// certificate with it — then revoke and list through the server.
func TestServeTokenRequestRevokeList(t *testing.T) {
	clearEnv(t)
	dir := filepath.Join(t.TempDir(), "certs")
	if _, err := run(t, "init", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "issue-mtls-client", "--dir", dir, "--name", "operator"); err != nil {
		t.Fatal(err)
	}
	url := startServe(t, dir)
	chain := filepath.Join(dir, identity.ChainFile)
	op := []string{"--server", url, "--ca", chain, "--cert", filepath.Join(dir, "operator.crt"), "--key", filepath.Join(dir, "operator.key")}

	out, err := run(t, append([]string{"token", "create", "--name", "node7", "--dns", "node7.pivirt.internal", "--ip", "127.0.0.1"}, op...)...)
	if err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(out)
	if !strings.HasPrefix(token, castore.TokenPrefix) {
		t.Fatalf("token create printed %q", out)
	}

	// A new host has no CA chain: request refuses to trust on first use.
	host := filepath.Join(t.TempDir(), "node7")
	_, err = run(t, "request", "--dir", host, "--server", url, "--token", token, "--out", "node7")
	if err == nil || !strings.Contains(err.Error(), "--ca is required") {
		t.Fatalf("request without --ca: %v", err)
	}
	// With the chain copied over it gets its certificate; the token was
	// not used by the refusal.
	out, err = run(t, "request", "--dir", host, "--server", url, "--token", token, "--ca", chain, "--out", "node7")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "node7.pivirt.internal") {
		t.Errorf("request: %q", out)
	}
	for f, perm := range map[string]os.FileMode{"node7.crt": 0o644, "node7.key": 0o600, identity.ChainFile: 0o644} {
		st, err := os.Stat(filepath.Join(host, f))
		if err != nil || st.Mode().Perm() != perm {
			t.Errorf("%s: %v %v, want %v", f, st.Mode().Perm(), err, perm)
		}
	}
	if _, err := identity.Verify(filepath.Join(host, "node7.crt"), filepath.Join(host, identity.ChainFile), "node7.pivirt.internal", time.Now()); err != nil {
		t.Errorf("the certificate does not verify: %v", err)
	}
	// The token is used up.
	_, err = run(t, "request", "--dir", host, "--server", url, "--token", token, "--ca", chain, "--out", "again")
	if err == nil || !strings.Contains(err.Error(), "not authenticated") {
		t.Errorf("second use: %v", err)
	}

	// Revoke through the server; list shows it revoked.
	if out, err = run(t, append([]string{"revoke", "--name", "node7", "--reason", "superseded"}, op...)...); err != nil || !strings.Contains(out, "Revoked") {
		t.Fatalf("revoke: %q %v", out, err)
	}
	out, err = run(t, append([]string{"list", "--status", "revoked", "-o", "json"}, op...)...)
	if err != nil {
		t.Fatal(err)
	}
	var certs []certJSON
	if err := json.Unmarshal([]byte(out), &certs); err != nil || len(certs) != 1 || certs[0].Name != "node7" || certs[0].RevocationReason != "superseded" {
		t.Errorf("list: %s %v", out, err)
	}
	out, err = run(t, append([]string{"list"}, op...)...)
	if err != nil || !strings.Contains(out, "node7") || !strings.Contains(out, "revoked (superseded)") {
		t.Errorf("list: %q %v", out, err)
	}

	// The running server holds the database: --db says to use --server.
	_, err = run(t, "list", "--db", filepath.Join(dir, "..", "certs.db"))
	if err == nil || !strings.Contains(err.Error(), "--server") || !errors.Is(err, castore.ErrLocked) {
		t.Errorf("list --db while serving: %v", err)
	}
	// Without the admin role nothing is listed.
	if _, err := run(t, "issue-mtls-client", "--dir", dir, "--name", "nobody"); err != nil {
		t.Fatal(err)
	}
	_, err = run(t, "list", "--server", url, "--ca", chain, "--cert", filepath.Join(dir, "nobody.crt"), "--key", filepath.Join(dir, "nobody.key"))
	if err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("list as nobody: %v", err)
	}
	// A plain-HTTP URL is refused by the client already.
	_, err = run(t, append([]string{"list"}, append(op[2:], "--server", strings.Replace(url, "https", "http", 1))...)...)
	if err == nil || !strings.Contains(err.Error(), "needs TLS") {
		t.Errorf("http:// server: %v", err)
	}
}

// TestOfflineDatabase: issue-* --db records, list and revoke --db work on
// the database without a server, and a certificate issued after a server
// recorded its URL points its OCSP and CRL there.
func TestOfflineDatabase(t *testing.T) {
	clearEnv(t)
	dir := filepath.Join(t.TempDir(), "certs")
	db := filepath.Join(t.TempDir(), "certs.db")
	if _, err := run(t, "init", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "issue-mtls-server", "--dir", dir, "--db", db, "--name", "a.pivirt.internal"); err != nil {
		t.Fatal(err)
	}
	a, err := identity.ReadCertificates(filepath.Join(dir, "a.pivirt.internal.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(a[0].OCSPServer) != 0 {
		t.Errorf("OCSP %v without a server URL in the database", a[0].OCSPServer)
	}

	// A server records its external URL in the database.
	ca, err := castore.Open(castore.Config{CertsDir: dir, DBPath: db, ExternalURL: "http://pitrust.example:8080"})
	if err != nil {
		t.Fatal(err)
	}
	ca.Close()
	if _, err := run(t, "issue-mtls-client", "--dir", dir, "--db", db, "--name", "b"); err != nil {
		t.Fatal(err)
	}
	b, err := identity.ReadCertificates(filepath.Join(dir, "b.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(b[0].OCSPServer) != 1 || b[0].OCSPServer[0] != "http://pitrust.example:8080/ocsp" ||
		len(b[0].CRLDistributionPoints) != 1 || b[0].CRLDistributionPoints[0] != "http://pitrust.example:8080/crl" {
		t.Errorf("AIA %v, CDP %v", b[0].OCSPServer, b[0].CRLDistributionPoints)
	}

	out, err := run(t, "list", "--db", db, "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var certs []certJSON
	if err := json.Unmarshal([]byte(out), &certs); err != nil || len(certs) != 2 || certs[0].IssuedBy != "pitrust (offline)" {
		t.Fatalf("list: %s %v", out, err)
	}
	serial := a[0].SerialNumber.Text(16)
	if out, err := run(t, "revoke", "--db", db, strings.ToLower(serial), "--reason", "keyCompromise"); err != nil || !strings.Contains(out, "Revoked") {
		t.Fatalf("revoke: %q %v", out, err)
	}
	out, err = run(t, "list", "--db", db, "--status", "revoked")
	if err != nil || !strings.Contains(out, "a.pivirt.internal") || strings.Contains(out, " b ") {
		t.Errorf("list revoked: %q %v", out, err)
	}

	// Usage errors.
	for _, args := range [][]string{
		{"list"},
		{"list", "--db", db, "--server", "https://127.0.0.1:1"},
		{"revoke", "--db", db},
		{"revoke", "--db", db, "ABC", "--name", "b"},
		{"revoke", "--db", db, "ABC", "--reason", "bored"},
		{"list", "--db", db, "--status", "maybe"},
	} {
		var ue *usageError
		if _, err := run(t, args...); !errors.As(err, &ue) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// TestServeConfigErrors: serve refuses a bad configuration file, naming
// the key.
func TestServeConfigErrors(t *testing.T) {
	for yaml, key := range map[string]string{
		"server:\n  certs_dir: /x\n  colour: blue\n": "server.colour",
		"policy:\n  max_days: -1\n":                  "policy.max_days",
	} {
		f := filepath.Join(t.TempDir(), "pitrust.yaml")
		if err := os.WriteFile(f, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := run(t, "serve", "--config", f)
		if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), f) {
			t.Errorf("%q: %v, want an error naming %s in %s", yaml, err, key, f)
		}
	}
}
