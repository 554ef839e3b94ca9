package castore

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"net/http/httptest"

	"pilab.hu/pivirt-agent/identity"
)

// openssl runs the openssl command with args and returns its output.
func openssl(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "openssl", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("openssl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestOpenSSLChecksOCSPAndCRL asks the OCSP responder with the openssl
// command, and has it read the CRL.
func TestOpenSSLChecksOCSPAndCRL(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl is not on PATH")
	}
	c, cfg := newTestCA(t, Config{})
	srv := httptest.NewServer(c.Handler()) // 127.0.0.1
	defer srv.Close()
	csr, _ := newCSR(t)
	certPEM, rec, err := c.Issue(csr, serverGrant("web1"), "alice")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	leafPath := filepath.Join(dir, "leaf.crt")
	if err := os.WriteFile(leafPath, pemCert(parseLeaf(t, certPEM)[0].Raw), 0o600); err != nil {
		t.Fatal(err)
	}
	ask := func() string {
		return openssl(t, "ocsp", "-issuer", filepath.Join(cfg.CertsDir, identity.IntermediateCertFile), "-cert", leafPath,
			"-url", srv.URL+"/ocsp", "-CAfile", filepath.Join(cfg.CertsDir, identity.RootCertFile))
	}
	out := ask()
	if !strings.Contains(out, leafPath+": good") || !strings.Contains(out, "Response verify OK") {
		t.Fatalf("openssl ocsp before revocation:\n%s", out)
	}
	if _, err := c.Revoke(rec.Serial, "", "keyCompromise"); err != nil {
		t.Fatal(err)
	}
	out = ask()
	if !strings.Contains(out, leafPath+": revoked") || !strings.Contains(out, "Response verify OK") ||
		!strings.Contains(out, "keyCompromise") {
		t.Fatalf("openssl ocsp after revocation:\n%s", out)
	}

	crlPath := filepath.Join(dir, "pitrust.crl")
	der, _ := c.CRL()
	if err := os.WriteFile(crlPath, der, 0o600); err != nil {
		t.Fatal(err)
	}
	out = openssl(t, "crl", "-inform", "DER", "-in", crlPath, "-noout", "-text")
	if !strings.Contains(out, "Serial Number: "+rec.Serial) || !strings.Contains(out, "Key Compromise") ||
		!strings.Contains(out, "X509v3 CRL Number") {
		t.Fatalf("openssl crl does not list serial %s as a key compromise:\n%s", rec.Serial, out)
	}
	// openssl verifies the CRL's signature with X1.
	out = openssl(t, "crl", "-inform", "DER", "-in", crlPath, "-noout", "-CAfile", filepath.Join(cfg.CertsDir, identity.IntermediateCertFile))
	if !strings.Contains(out, "verify OK") {
		t.Fatalf("openssl crl -CAfile PiCA.pem:\n%s", out)
	}
}
