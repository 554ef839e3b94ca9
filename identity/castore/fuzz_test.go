package castore

import (
	"crypto"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"net/http"
	"path/filepath"
	"testing"

	"golang.org/x/crypto/ocsp"

	"pilab.hu/pivirt-agent/identity"
)

// FuzzParseCSR feeds Issue's CSR parsing: it never panics, and what it
// accepts is a request with a signature that checks and a key the CA
// signs for.
func FuzzParseCSR(f *testing.F) {
	csrPEM, _ := newCSR(f)
	block, _ := pem.Decode(csrPEM)
	f.Add(csrPEM)
	f.Add(block.Bytes)
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\nMIIB\n-----END CERTIFICATE REQUEST-----\n"))
	f.Add([]byte{0x30, 0x82, 0x01})
	f.Add([]byte("hello"))
	f.Fuzz(func(t *testing.T, b []byte) {
		csr, err := ParseCSR(b)
		if err != nil {
			if csr != nil || !errors.Is(err, identity.ErrInvalidRequest) {
				t.Fatalf("refusal %v with %v, or not identity.ErrInvalidRequest", err, csr)
			}
			return
		}
		if err := csr.CheckSignature(); err != nil {
			t.Fatalf("accepted a CSR whose signature does not check: %v", err)
		}
		if err := checkPublicKey(csr.PublicKey); err != nil {
			t.Fatalf("accepted a CSR with key %T: %v", csr.PublicKey, err)
		}
	})
}

// FuzzOCSPRequest feeds the OCSP handler's request parsing, as a POST
// body and as a GET path: it never panics, a request it cannot parse is
// answered 400 with malformedRequest, and every other answer parses.
func FuzzOCSPRequest(f *testing.F) {
	dir := f.TempDir()
	certsDir := filepath.Join(dir, "pki")
	if _, err := identity.InitCA(certsDir, identity.CAOptions{}); err != nil {
		f.Fatal(err)
	}
	c, err := Open(Config{CertsDir: certsDir, DBPath: filepath.Join(dir, "db")})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { c.Close() })
	csr, _ := newCSR(f)
	certPEM, _, err := c.Issue(csr, serverGrant("web1"), "fuzz")
	if err != nil {
		f.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(mustPEM(f, certPEM))
	for _, h := range []crypto.Hash{crypto.SHA1, crypto.SHA256, crypto.SHA512} {
		req, err := ocsp.CreateRequest(leaf, c.Intermediate(), &ocsp.RequestOptions{Hash: h})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(req)
		f.Add([]byte(base64.StdEncoding.EncodeToString(req)))
	}
	f.Add([]byte{})
	f.Add([]byte("MEMwQTA/MD0wOzAJBgUrDgMCGgUABBQ%2F%2F%2F"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ans, status := c.answerOCSP(b)
		_, perr := parseOCSPRequest(b)
		switch {
		case perr != nil && (status != http.StatusBadRequest || string(ans.der) != string(ocsp.MalformedRequestErrorResponse)):
			t.Fatalf("unparsable request answered %d", status)
		case perr == nil && status != http.StatusOK:
			t.Fatalf("parsed request answered %d", status)
		case perr == nil:
			if _, err := ocsp.ParseResponse(ans.der, nil); err != nil {
				var re ocsp.ResponseError
				if !errors.As(err, &re) {
					t.Fatalf("answer does not parse: %v", err)
				}
			}
		}
		if raw, err := decodeOCSPGet(string(b)); err == nil {
			_, _ = c.answerOCSP(raw)
		}
	})
}

func mustPEM(f *testing.F, b []byte) []byte {
	block, _ := pem.Decode(b)
	if block == nil {
		f.Fatal("no PEM block")
	}
	return block.Bytes
}
