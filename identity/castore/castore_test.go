package castore

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ocsp"

	"pilab.hu/pivirt-agent/identity"
)

const testURL = "http://pitrust.pivirt.internal:8080"

// clock is a settable test clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newTestCA makes a PiTrust CA in a temporary directory and opens a CA
// server core on it; cfg's CertsDir and DBPath are filled in.
func newTestCA(t *testing.T, cfg Config) (*CA, Config) {
	t.Helper()
	dir := t.TempDir()
	if cfg.CertsDir == "" {
		cfg.CertsDir = filepath.Join(dir, "pki")
		if _, err := identity.InitCA(cfg.CertsDir, identity.CAOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if cfg.DBPath == "" {
		cfg.DBPath = filepath.Join(dir, "db", "pitrust.db")
	}
	c, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, cfg
}

// newCSR makes a CSR, with names the CA must ignore, and its key.
func newCSR(t testing.TB) ([]byte, crypto.Signer) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:     pkix.Name{CommonName: "evil", Organization: []string{"Evil"}},
		DNSNames:    []string{"evil.example"},
		IPAddresses: []net.IP{net.ParseIP("203.0.113.66")},
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), key
}

func serverGrant(name string) Grant {
	return Grant{Kind: identity.KindServer, Name: name, DNS: []string{name + ".pivirt.internal"}, IPs: []net.IP{net.ParseIP("10.0.0.7")}}
}

func parseLeaf(t *testing.T, certPEM []byte) []*x509.Certificate {
	t.Helper()
	certs, err := identity.ParseCertificates(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	return certs
}

func TestIssueIgnoresCSRNames(t *testing.T) {
	c, cfg := newTestCA(t, Config{ExternalURL: testURL + "/"})
	csr, key := newCSR(t)
	certPEM, rec, err := c.Issue(csr, serverGrant("web1"), "operator alice")
	if err != nil {
		t.Fatal(err)
	}
	certs := parseLeaf(t, certPEM)
	if len(certs) != 2 || !certs[1].Equal(c.Intermediate()) {
		t.Fatalf("want the leaf followed by X1, got %d certificates", len(certs))
	}
	leaf := certs[0]
	if leaf.Subject.CommonName != "web1" || !slices.Equal(leaf.DNSNames, []string{"web1.pivirt.internal"}) ||
		len(leaf.IPAddresses) != 1 || !leaf.IPAddresses[0].Equal(net.ParseIP("10.0.0.7")) ||
		!slices.Equal(leaf.Subject.Organization, []string{identity.Organization}) {
		t.Fatalf("names from the CSR or missing: CN %q O %v DNS %v IPs %v", leaf.Subject.CommonName, leaf.Subject.Organization, leaf.DNSNames, leaf.IPAddresses)
	}
	if !key.Public().(*ecdsa.PublicKey).Equal(leaf.PublicKey) {
		t.Fatal("the certificate is not for the CSR's key")
	}
	if !slices.Equal(leaf.OCSPServer, []string{testURL + "/ocsp"}) || !slices.Equal(leaf.CRLDistributionPoints, []string{testURL + "/crl"}) {
		t.Fatalf("AIA %v, CDP %v", leaf.OCSPServer, leaf.CRLDistributionPoints)
	}
	if life := leaf.NotAfter.Sub(leaf.NotBefore); life != 90*24*time.Hour+5*time.Minute {
		t.Fatalf("default lifetime %s, want 90 days (and 5 minutes of backdating)", life)
	}
	if _, err := identity.Verify(writeTemp(t, certPEM), filepath.Join(cfg.CertsDir, identity.RootCertFile), "web1.pivirt.internal", time.Now()); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(strings.ToLower(leaf.SerialNumber.Text(16)))
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.ToUpper(hex.EncodeToString(leaf.SerialNumber.Bytes())); got.Serial != rec.Serial || got.Serial != want {
		t.Fatalf("serial %s, record %s, certificate %X", got.Serial, rec.Serial, leaf.SerialNumber)
	}
	if got.Status != StatusValid || got.Kind != identity.KindServer || !slices.Equal(got.Usages, []identity.Usage{identity.UsageServer}) ||
		got.IssuedBy != "operator alice" || !bytes.Equal(got.CertPEM, pemCert(leaf.Raw)) || !slices.Equal(got.IPs, []string{"10.0.0.7"}) {
		t.Fatalf("record %+v", got)
	}

	// Without an external URL, no AIA or CDP.
	plain, _ := newTestCA(t, Config{})
	certPEM, _, err = plain.Issue(csr, serverGrant("web2"), "alice")
	if err != nil {
		t.Fatal(err)
	}
	if leaf := parseLeaf(t, certPEM)[0]; len(leaf.OCSPServer) != 0 || len(leaf.CRLDistributionPoints) != 0 {
		t.Fatalf("AIA %v, CDP %v without an external URL", leaf.OCSPServer, leaf.CRLDistributionPoints)
	}
}

func writeTemp(t *testing.T, b []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cert.pem")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestIssueRefusals(t *testing.T) {
	var logs bytes.Buffer
	c, _ := newTestCA(t, Config{MaxDays: 30, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	csr, _ := newCSR(t)
	block, _ := pem.Decode(csr)
	rsaKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weak, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, rsaKey)
	if err != nil {
		t.Fatal(err)
	}
	tampered := bytes.Clone(block.Bytes)
	tampered[len(tampered)-3] ^= 0xff
	g := serverGrant("web1")
	long := g
	long.Days = 31
	for _, tc := range []struct {
		name string
		csr  []byte
		g    Grant
		want error
		msg  string
	}{
		{"days beyond the maximum", csr, long, ErrRefused, "30 days at most"},
		{"garbage", []byte("hello"), g, identity.ErrInvalidRequest, "neither PEM"},
		{"certificate instead of CSR", pemCert(c.Intermediate().Raw), g, identity.ErrInvalidRequest, `"CERTIFICATE"`},
		{"bad signature", tampered, g, identity.ErrInvalidRequest, "signature"},
		{"weak RSA", weak, g, identity.ErrInvalidRequest, "1024 bits"},
		{"bad name", csr, Grant{Kind: identity.KindServer, Name: "../x"}, identity.ErrInvalidRequest, "name"},
		{"client with IP", csr, Grant{Kind: identity.KindClient, Name: "bob", IPs: []net.IP{net.IPv4(10, 0, 0, 1)}}, identity.ErrInvalidRequest, "--ip"},
	} {
		_, _, err := c.Issue(tc.csr, tc.g, "alice")
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: got %v, want %v with %q", tc.name, err, tc.want, tc.msg)
		}
	}
	// DER is accepted as well as PEM, and the refusals were audited.
	if _, _, err := c.Issue(block.Bytes, g, "alice"); err != nil {
		t.Fatalf("DER CSR: %v", err)
	}
	events, err := c.DB().AuditEvents()
	if err != nil {
		t.Fatal(err)
	}
	var refusals, issues int
	for _, e := range events {
		switch {
		case bytes.Contains(e, []byte(`"event":"refuse"`)):
			refusals++
		case bytes.Contains(e, []byte(`"event":"issue"`)):
			issues++
		}
	}
	if refusals != 7 || issues != 1 {
		t.Fatalf("audit: %d refusals and %d issues, want 7 and 1", refusals, issues)
	}
	if n, m := strings.Count(logs.String(), `"msg":"audit","event":"refuse"`), strings.Count(logs.String(), `"msg":"audit","event":"issue"`); n != 7 || m != 1 {
		t.Fatalf("audit log: %d refusals and %d issues, want 7 and 1:\n%s", n, m, logs.String())
	}
}

// ocspQuery asks the handler at base about cert (issued by issuer) with
// GET or POST and hash h.
func ocspQuery(t *testing.T, base string, cert, issuer *x509.Certificate, get bool, h crypto.Hash) *ocsp.Response {
	t.Helper()
	req, err := ocsp.CreateRequest(cert, issuer, &ocsp.RequestOptions{Hash: h})
	if err != nil {
		t.Fatal(err)
	}
	var resp *http.Response
	if get {
		resp, err = http.Get(base + "/ocsp/" + url.PathEscape(base64.StdEncoding.EncodeToString(req)))
	} else {
		resp, err = http.Post(base+"/ocsp", "application/ocsp-request", bytes.NewReader(req))
	}
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/ocsp-response" {
		t.Fatalf("OCSP: %s, %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	if !strings.HasPrefix(resp.Header.Get("Cache-Control"), "max-age=") {
		t.Fatalf("Cache-Control %q", resp.Header.Get("Cache-Control"))
	}
	r, err := ocsp.ParseResponseForCert(body, cert, issuer)
	if err != nil {
		t.Fatalf("OCSP response: %v", err)
	}
	return r
}

func TestRevocationInCRLAndOCSP(t *testing.T) {
	c, _ := newTestCA(t, Config{ExternalURL: testURL})
	srv := httptest.NewServer(c.Handler())
	defer srv.Close()
	x1 := c.Intermediate()

	var leaves []*x509.Certificate
	for _, name := range []string{"web1", "web1", "web2"} {
		csr, _ := newCSR(t)
		certPEM, _, err := c.Issue(csr, serverGrant(name), "alice")
		if err != nil {
			t.Fatal(err)
		}
		leaves = append(leaves, parseLeaf(t, certPEM)[0])
	}
	for _, get := range []bool{true, false} {
		for _, h := range []crypto.Hash{crypto.SHA1, crypto.SHA256} {
			r := ocspQuery(t, srv.URL, leaves[0], x1, get, h)
			if r.Status != ocsp.Good || r.Certificate == nil || !slices.Contains(r.Certificate.ExtKeyUsage, x509.ExtKeyUsageOCSPSigning) {
				t.Fatalf("before revocation (GET %v, %v): status %d, signer %v", get, h, r.Status, r.Certificate)
			}
			if time.Until(r.NextUpdate) > time.Hour+time.Minute || r.NextUpdate.Before(time.Now()) {
				t.Fatalf("NextUpdate %s", r.NextUpdate)
			}
		}
	}

	recs, err := c.Revoke(strings.ToLower(leaves[2].SerialNumber.Text(16)), "", "keyCompromise")
	if err != nil || len(recs) != 1 || recs[0].Status != StatusRevoked || recs[0].Reason != "keyCompromise" {
		t.Fatalf("revoke by serial: %+v, %v", recs, err)
	}
	first := recs[0]
	// Again: the existing record, not an error.
	recs, err = c.Revoke(first.Serial, "", "superseded")
	if err != nil || len(recs) != 1 || recs[0].Reason != "keyCompromise" || !recs[0].RevokedAt.Equal(first.RevokedAt) {
		t.Fatalf("revoke again: %+v, %v", recs, err)
	}
	recs, err = c.Revoke("", "web1", "superseded")
	if err != nil || len(recs) != 2 {
		t.Fatalf("revoke by name: %+v, %v", recs, err)
	}
	if recs, err := c.Revoke("", "web1", ""); err != nil || len(recs) != 0 {
		t.Fatalf("revoke a name again: %+v, %v (want nothing revoked, no error)", recs, err)
	}
	for _, bad := range [][3]string{{"ABCDEF", "", ""}, {"", "nobody", ""}} {
		if _, err := c.Revoke(bad[0], bad[1], bad[2]); !errors.Is(err, ErrNotFound) {
			t.Fatalf("revoke %v: %v, want ErrNotFound", bad, err)
		}
	}
	if _, err := c.Revoke(first.Serial, "", "bored"); !errors.Is(err, ErrRefused) {
		t.Fatalf("unknown reason: %v", err)
	}
	if revoked, at, reason := c.IsRevoked(leaves[2].SerialNumber); !revoked || !at.Equal(first.RevokedAt) || reason != "keyCompromise" {
		t.Fatalf("IsRevoked: %v %s %s", revoked, at, reason)
	}

	// The CRL, served over HTTP.
	resp, err := http.Get(srv.URL + "/crl")
	if err != nil {
		t.Fatal(err)
	}
	der, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.Header.Get("Content-Type") != "application/pkix-crl" || !strings.HasPrefix(resp.Header.Get("Cache-Control"), "max-age=") {
		t.Fatalf("CRL headers %v", resp.Header)
	}
	crl, err := x509.ParseRevocationList(der)
	if err != nil {
		t.Fatal(err)
	}
	head, err := http.Head(srv.URL + "/crl")
	if err != nil {
		t.Fatal(err)
	}
	head.Body.Close()
	if head.StatusCode != http.StatusOK || head.ContentLength != int64(len(der)) {
		t.Fatalf("HEAD /crl: %s, length %d", head.Status, head.ContentLength)
	}
	if err := crl.CheckSignatureFrom(x1); err != nil {
		t.Fatal(err)
	}
	if len(crl.RevokedCertificateEntries) != 3 {
		t.Fatalf("CRL lists %d certificates, want 3", len(crl.RevokedCertificateEntries))
	}
	for _, e := range crl.RevokedCertificateEntries {
		if e.SerialNumber.Cmp(leaves[2].SerialNumber) == 0 && e.ReasonCode != 1 {
			t.Fatalf("reason code %d, want keyCompromise (1)", e.ReasonCode)
		}
	}
	if crl.NextUpdate.Sub(crl.ThisUpdate) != 24*time.Hour+crlBackdate {
		t.Fatalf("CRL validity %s", crl.NextUpdate.Sub(crl.ThisUpdate))
	}

	// OCSP says revoked, with the time and reason.
	r := ocspQuery(t, srv.URL, leaves[2], x1, true, crypto.SHA256)
	if r.Status != ocsp.Revoked || r.RevocationReason != ocsp.KeyCompromise || !r.RevokedAt.Equal(first.RevokedAt.Truncate(time.Second)) {
		t.Fatalf("after revocation: status %d reason %d at %s", r.Status, r.RevocationReason, r.RevokedAt)
	}
	// A serial the database does not know: unknown.
	unknown := *leaves[0]
	unknown.SerialNumber = big.NewInt(42)
	if r := ocspQuery(t, srv.URL, &unknown, x1, false, crypto.SHA1); r.Status != ocsp.Unknown {
		t.Fatalf("unknown serial: status %d", r.Status)
	}

	// Another issuer: unauthorized.
	other, _ := newTestCA(t, Config{})
	req, err := ocsp.CreateRequest(leaves[0], other.Intermediate(), nil)
	if err != nil {
		t.Fatal(err)
	}
	status, body := post(t, srv.URL+"/ocsp", req)
	if _, err := ocsp.ParseResponse(body, nil); status != http.StatusOK || !isResponseError(err, ocsp.Unauthorized) {
		t.Fatalf("another issuer: %d, %v", status, err)
	}
	// Malformed: 400 with a malformedRequest response.
	for _, u := range []string{srv.URL + "/ocsp/!!notbase64", srv.URL + "/ocsp/" + base64.StdEncoding.EncodeToString([]byte("junk"))} {
		resp, err := http.Get(u)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if _, err := ocsp.ParseResponse(body, nil); resp.StatusCode != http.StatusBadRequest || !isResponseError(err, ocsp.Malformed) {
			t.Fatalf("%s: %d, %v", u, resp.StatusCode, err)
		}
	}
	if status, _ := post(t, srv.URL+"/ocsp", bytes.Repeat([]byte{0x30}, 11<<10)); status != http.StatusBadRequest {
		t.Fatalf("oversized request: %d", status)
	}
}

func post(t *testing.T, u string, body []byte) (int, []byte) {
	t.Helper()
	resp, err := http.Post(u, "application/ocsp-request", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

func isResponseError(err error, status ocsp.ResponseStatus) bool {
	var re ocsp.ResponseError
	return errors.As(err, &re) && re.Status == status
}

func crlNumber(t *testing.T, c *CA) *big.Int {
	t.Helper()
	der, _ := c.CRL()
	crl, err := x509.ParseRevocationList(der)
	if err != nil {
		t.Fatal(err)
	}
	return crl.Number
}

func TestRestartKeepsState(t *testing.T) {
	c, cfg := newTestCA(t, Config{ExternalURL: testURL})
	csr, _ := newCSR(t)
	_, rec, err := c.Issue(csr, serverGrant("web1"), "alice")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Revoke(rec.Serial, "", "superseded"); err != nil {
		t.Fatal(err)
	}
	secret, id, _, err := c.CreateToken(serverGrant("web2"), 0)
	if err != nil {
		t.Fatal(err)
	}
	before := crlNumber(t, c)

	// The database is locked while the CA holds it.
	if _, err := OpenDB(cfg.DBPath); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "--server") {
		t.Fatalf("second open: %v, want ErrLocked naming --server", err)
	}
	if fi, err := os.Stat(cfg.DBPath); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("database file mode: %v %v", fi, err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}

	c2, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	got, err := c2.Get(rec.Serial)
	if err != nil || got.Status != StatusRevoked || got.Reason != "superseded" {
		t.Fatalf("after restart: %+v, %v", got, err)
	}
	if after := crlNumber(t, c2); after.Cmp(before) <= 0 {
		t.Fatalf("CRL number %s after restart, was %s", after, before)
	}
	der, _ := c2.CRL()
	crl, _ := x509.ParseRevocationList(der)
	if len(crl.RevokedCertificateEntries) != 1 || serialString(crl.RevokedCertificateEntries[0].SerialNumber) != rec.Serial {
		t.Fatalf("CRL after restart: %+v", crl.RevokedCertificateEntries)
	}
	g, gotID, err := c2.RedeemToken(secret)
	if err != nil || gotID != id || g.Name != "web2" {
		t.Fatalf("token after restart: %+v %s %v", g, gotID, err)
	}
	if c2.DB().ExternalURL() != testURL {
		t.Fatalf("external URL %q", c2.DB().ExternalURL())
	}
}

func TestTokens(t *testing.T) {
	clk := &clock{t: time.Now()}
	c, _ := newTestCA(t, Config{Now: clk.Now})
	g := Grant{Kind: identity.KindClient, Name: "pivirt-agent-node1", Usages: []identity.Usage{identity.UsageClient}, Days: 30}
	secret, id, expires, err := c.CreateToken(g, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(secret, TokenPrefix) || len(id) != 8 || !expires.Equal(clk.Now().UTC().Add(time.Hour)) {
		t.Fatalf("token %q id %q expires %s", secret, id, expires)
	}
	got, gotID, err := c.RedeemToken(secret)
	if err != nil || gotID != id || got.Name != g.Name || got.Kind != g.Kind || got.Days != 30 {
		t.Fatalf("redeem: %+v %s %v", got, gotID, err)
	}
	if _, _, err := c.RedeemToken(secret); !errors.Is(err, ErrTokenInvalid) {
		t.Fatalf("second use: %v", err)
	}
	if _, _, err := c.RedeemToken(TokenPrefix + "nope"); !errors.Is(err, ErrTokenInvalid) {
		t.Fatalf("unknown: %v", err)
	}
	short, _, _, err := c.CreateToken(g, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(time.Minute)
	if _, _, err := c.RedeemToken(short); !errors.Is(err, ErrTokenInvalid) {
		t.Fatalf("expired: %v", err)
	}
	// Redeemed concurrently, a token serves once.
	racy, _, _, err := c.CreateToken(g, 0)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	wins := 0
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := c.RedeemToken(racy)
			switch {
			case err == nil:
				mu.Lock()
				wins++
				mu.Unlock()
			case !errors.Is(err, ErrTokenInvalid):
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if wins != 1 {
		t.Fatalf("a token redeemed concurrently served %d times", wins)
	}
	// Only the hash is stored.
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(c.db.path)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(raw, []byte(secret)) || bytes.Contains(raw, []byte(short)) {
		t.Fatal("a token's secret is in the database")
	}

	c, _ = newTestCA(t, Config{MaxDays: 10})
	for _, tc := range []struct {
		g    Grant
		ttl  time.Duration
		want error
	}{
		{Grant{Kind: identity.KindServer, Name: "bad name!"}, 0, identity.ErrInvalidRequest},
		{Grant{Kind: identity.KindServer, Name: "web", DNS: []string{"web"}, Days: 11}, 0, ErrRefused},
		{serverGrant("web"), 8 * 24 * time.Hour, ErrRefused},
		{serverGrant("web"), -time.Second, ErrRefused},
	} {
		if _, _, _, err := c.CreateToken(tc.g, tc.ttl); !errors.Is(err, tc.want) {
			t.Errorf("CreateToken(%+v, %s): %v, want %v", tc.g, tc.ttl, err, tc.want)
		}
	}
}

func TestRenew(t *testing.T) {
	clk := &clock{t: time.Now()}
	c, _ := newTestCA(t, Config{ExternalURL: testURL, Now: clk.Now, MaxDays: 20})
	issue := func(days int) ([][]byte, crypto.Signer, Record) {
		csr, key := newCSR(t)
		g := serverGrant("web1")
		g.Days = days
		certPEM, rec, err := c.Issue(csr, g, "alice")
		if err != nil {
			t.Fatal(err)
		}
		var ders [][]byte
		for _, cert := range parseLeaf(t, certPEM) {
			ders = append(ders, cert.Raw)
		}
		return ders, key, rec
	}
	cur, key, rec := issue(10)
	req, _, err := identity.NewRenewalRequest(cur, key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM, newRec, err := c.Renew(req)
	if err != nil {
		t.Fatal(err)
	}
	leaf := parseLeaf(t, certPEM)[0]
	if newRec.IssuedBy != "renewal of "+rec.Serial || newRec.Name != "web1" || !slices.Equal(leaf.DNSNames, []string{"web1.pivirt.internal"}) {
		t.Fatalf("renewed record %+v", newRec)
	}
	if !slices.Equal(leaf.OCSPServer, []string{testURL + "/ocsp"}) || !slices.Equal(leaf.CRLDistributionPoints, []string{testURL + "/crl"}) {
		t.Fatalf("renewed AIA %v, CDP %v", leaf.OCSPServer, leaf.CRLDistributionPoints)
	}
	if life := leaf.NotAfter.Sub(leaf.NotBefore); life != 10*24*time.Hour+5*time.Minute {
		t.Fatalf("renewed lifetime %s, want the current one's", life)
	}
	if _, err := c.Get(newRec.Serial); err != nil {
		t.Fatal(err)
	}

	// Revoked: refused; the renewal made from it goes with it.
	revoked, err := c.Revoke(rec.Serial, "", "keyCompromise")
	if err != nil {
		t.Fatal(err)
	}
	if len(revoked) != 2 || revoked[0].Serial != rec.Serial || revoked[1].Serial != newRec.Serial {
		t.Fatalf("revoking %s revoked %+v, want it and its renewal %s", rec.Serial, revoked, newRec.Serial)
	}
	if got, _ := c.Get(newRec.Serial); got.Status != StatusRevoked || got.Reason != "keyCompromise" {
		t.Fatalf("the renewal of a revoked certificate: %+v", got)
	}
	if _, _, err := c.Renew(req); !errors.Is(err, identity.ErrRenewalRefused) || !strings.Contains(err.Error(), "revoked") {
		t.Fatalf("revoked: %v", err)
	}
	// Another CA's certificate: refused.
	other, otherCfg := newTestCA(t, Config{})
	csr, okey := newCSR(t)
	otherPEM, _, err := other.Issue(csr, serverGrant("web1"), "mallory")
	if err != nil {
		t.Fatal(err)
	}
	var otherDER [][]byte
	for _, cert := range parseLeaf(t, otherPEM) {
		otherDER = append(otherDER, cert.Raw)
	}
	_ = otherCfg
	oreq, _, err := identity.NewRenewalRequest(otherDER, okey)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Renew(oreq); !errors.Is(err, identity.ErrRenewalRefused) || !strings.Contains(err.Error(), "not a valid certificate of this CA") {
		t.Fatalf("foreign: %v", err)
	}
	// Expired: refused.
	cur, key, _ = issue(1)
	req, _, err = identity.NewRenewalRequest(cur, key)
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(25 * time.Hour)
	if _, _, err := c.Renew(req); !errors.Is(err, identity.ErrRenewalRefused) || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired: %v", err)
	}
	// The refusals were audited; List shows the expired one as expired.
	expired, err := c.List(StatusExpired, "web1")
	if err != nil || len(expired) != 1 {
		t.Fatalf("expired list: %+v %v", expired, err)
	}
}

func TestLongLivedCertificateRenewsCappedAtMaxDays(t *testing.T) {
	c, cfg := newTestCA(t, Config{MaxDays: 40})
	// A certificate issued offline for a year, recorded in the database.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	x1, x1Key, err := identity.LoadCA(cfg.CertsDir)
	if err != nil {
		t.Fatal(err)
	}
	der, err := identity.SignLeaf(x1, x1Key, key.Public(), identity.LeafRequest{Kind: identity.KindClient, Name: "bob", Days: 365})
	if err != nil {
		t.Fatal(err)
	}
	req, _, err := identity.NewRenewalRequest([][]byte{der, x1.Raw}, key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM, _, err := c.Renew(req)
	if err != nil {
		t.Fatal(err)
	}
	if life := parseLeaf(t, certPEM)[0].NotAfter.Sub(parseLeaf(t, certPEM)[0].NotBefore); life != 40*24*time.Hour+5*time.Minute {
		t.Fatalf("lifetime %s, want MaxDays", life)
	}
}

func TestOfflineDB(t *testing.T) {
	c, cfg := newTestCA(t, Config{ExternalURL: testURL})
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDB(cfg.DBPath)
	if err != nil {
		t.Fatal(err)
	}
	if d.ExternalURL() != testURL {
		t.Fatalf("external URL %q", d.ExternalURL())
	}
	x1, x1Key, err := identity.LoadCA(cfg.CertsDir)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	now := time.Now()
	for _, name := range []string{"a", "b"} {
		der, err := identity.SignLeaf(x1, x1Key, key.Public(), identity.LeafRequest{Kind: identity.KindClient, Name: name, Days: 1, Now: func() time.Time { return now }})
		if err != nil {
			t.Fatal(err)
		}
		cert, _ := x509.ParseCertificate(der)
		if err := d.Record(cert, IssuedByOffline); err != nil {
			t.Fatal(err)
		}
		now = now.Add(time.Second)
	}
	all, err := d.List("", "", time.Now())
	if err != nil || len(all) != 2 || all[0].Name != "b" || all[1].IssuedBy != IssuedByOffline {
		t.Fatalf("list: %+v %v", all, err)
	}
	if recs, err := d.Revoke("", "a", "cessationOfOperation", time.Now()); err != nil || len(recs) != 1 {
		t.Fatalf("revoke: %+v %v", recs, err)
	}
	if revoked, err := d.List(StatusRevoked, "", time.Now()); err != nil || len(revoked) != 1 || revoked[0].Name != "a" {
		t.Fatalf("revoked: %+v %v", revoked, err)
	}
	if expired, err := d.List(StatusExpired, "", time.Now().Add(48*time.Hour)); err != nil || len(expired) != 1 || expired[0].Name != "b" {
		t.Fatalf("expired: %+v %v", expired, err)
	}
	if _, err := d.List("bogus", "", time.Now()); err == nil {
		t.Fatal("a bogus status was accepted")
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	// The server rebuilds its CRL from the database.
	c, err = Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	der, _ := c.CRL()
	crl, _ := x509.ParseRevocationList(der)
	if len(crl.RevokedCertificateEntries) != 1 || crl.RevokedCertificateEntries[0].ReasonCode != 5 {
		t.Fatalf("CRL after an offline revocation: %+v", crl.RevokedCertificateEntries)
	}
}

func TestRunRefreshesCRL(t *testing.T) {
	c, _ := newTestCA(t, Config{CRLValidity: 2 * time.Minute})
	// Pretend the CRL was made just over half its validity ago.
	c.mu.Lock()
	c.crlThis = time.Now().Add(-crlBackdate - time.Minute - time.Second)
	c.mu.Unlock()
	before := crlNumber(t, c)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for crlNumber(t, c).Cmp(before) <= 0 {
		if time.Now().After(deadline) {
			t.Fatal("Run did not make the CRL again")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestRevocationReasons(t *testing.T) {
	for code, name := range reasons {
		got, err := ParseRevocationReason(strings.ToUpper(name))
		if err != nil || got != code || RevocationReasonName(code) != name {
			t.Fatalf("%d %s: %d %v", code, name, got, err)
		}
	}
	if _, err := ParseRevocationReason("removeFromCRL"); err == nil {
		t.Fatal("removeFromCRL accepted")
	}
}

func TestNormalizeSerial(t *testing.T) {
	for in, want := range map[string]string{"0a:bc": "0ABC", "abc": "0ABC", "00FF": "FF", "1": "01"} {
		if got, err := NormalizeSerial(in); err != nil || got != want {
			t.Errorf("%s: %s %v, want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "xyz", "-1"} {
		if _, err := NormalizeSerial(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestRenewalRetiresTheRenewed: a certificate is renewed once. The same
// request again (its answer lost) gets the same certificate; another key
// is refused, naming the renewal; revoking the renewal revokes the
// certificate it renewed (a lineage), so a copy of the old key cannot go
// on beside a revoked successor.
func TestRenewalRetiresTheRenewed(t *testing.T) {
	c, _ := newTestCA(t, Config{ExternalURL: testURL, MaxDays: 20})
	csr, key := newCSR(t)
	certPEM, a, err := c.Issue(csr, serverGrant("web1"), "alice")
	if err != nil {
		t.Fatal(err)
	}
	var cur [][]byte
	for _, cert := range parseLeaf(t, certPEM) {
		cur = append(cur, cert.Raw)
	}
	req, _, err := identity.NewRenewalRequest(cur, key)
	if err != nil {
		t.Fatal(err)
	}
	_, b, err := c.Renew(req)
	if err != nil {
		t.Fatal(err)
	}
	again, b2, err := c.Renew(req)
	if err != nil || b2.Serial != b.Serial || parseLeaf(t, again)[0].SerialNumber.Cmp(parseLeaf(t, b.CertPEM)[0].SerialNumber) != 0 {
		t.Fatalf("the same renewal again: %s, %v; want serial %s again", b2.Serial, err, b.Serial)
	}
	other, _, err := identity.NewRenewalRequest(cur, key)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Renew(other); !errors.Is(err, identity.ErrRenewalRefused) || !strings.Contains(err.Error(), "renewed already (serial "+b.Serial) {
		t.Fatalf("a second renewal of %s with another key: %v, want a refusal naming %s", a.Serial, err, b.Serial)
	}
	revoked, err := c.Revoke(b.Serial, "", "keyCompromise")
	if err != nil {
		t.Fatal(err)
	}
	if len(revoked) != 2 || revoked[0].Serial != b.Serial || revoked[1].Serial != a.Serial {
		t.Fatalf("revoking the renewal %s revoked %+v, want it and %s, which it renewed", b.Serial, revoked, a.Serial)
	}
	if got, _ := c.Get(a.Serial); got.Status != StatusRevoked {
		t.Fatalf("the renewed certificate after its renewal's revocation: %+v", got)
	}
}

// TestOCSPSigningBudget: the same question asked again and again is
// answered from the responses already signed; a flood of different ones
// meets the signing budget and gets tryLater (and a log line), not a
// signature each.
func TestOCSPSigningBudget(t *testing.T) {
	c, _ := newTestCA(t, Config{ExternalURL: testURL})
	csr, _ := newCSR(t)
	certPEM, _, err := c.Issue(csr, serverGrant("web1"), "alice")
	if err != nil {
		t.Fatal(err)
	}
	leaf := parseLeaf(t, certPEM)[0]
	same, err := ocsp.CreateRequest(leaf, c.Intermediate(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 * ocspSignBurst {
		a, _ := c.answerOCSP(same)
		if r, err := ocsp.ParseResponse(a.der, c.Intermediate()); err != nil || r.Status != ocsp.Good {
			t.Fatalf("the same question, %d: %v, %v", i, r, err)
		}
	}
	tryLater := 0
	for i := range 3 * ocspSignBurst {
		req, err := ocsp.CreateRequest(&x509.Certificate{SerialNumber: big.NewInt(int64(1_000_000 + i))}, c.Intermediate(), nil)
		if err != nil {
			t.Fatal(err)
		}
		a, _ := c.answerOCSP(req)
		if _, err := ocsp.ParseResponse(a.der, c.Intermediate()); isResponseError(err, ocsp.TryLater) {
			tryLater++
		}
	}
	if tryLater == 0 {
		t.Fatalf("%d different questions at once: every one signed", 3*ocspSignBurst)
	}
}
