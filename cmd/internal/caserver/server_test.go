package caserver

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/crypto/ocsp"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// env is a CA directory with an operator ("operator", pitrust-admin) and
// a client without the role ("nobody").
type env struct {
	dir string
	cfg *Config
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	certs := filepath.Join(dir, "certs")
	if _, err := identity.InitCA(certs, identity.CAOptions{RootDays: 800, IntermediateDays: 700}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"operator", "nobody"} {
		if _, err := identity.Issue(certs, identity.LeafRequest{Kind: identity.KindClient, Name: n, Days: 5}); err != nil {
			t.Fatal(err)
		}
	}
	cfg := Default()
	cfg.Server.Addr = "127.0.0.1:0"
	cfg.Server.CertsDir = certs
	cfg.Server.DBPath = filepath.Join(dir, "db", "certs.db")
	cfg.Auth.CertificateRoles = map[string][]string{"operator": {AdminRole}, "ops-*": {AdminRole}}
	return &env{dir: dir, cfg: cfg}
}

// syncBuffer is a log sink safe for the server's goroutines.
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

// running is a server serving in the background.
type running struct {
	srv  *Server
	log  *syncBuffer
	stop func()
}

// start runs a server on e's configuration until the test ends (or stop).
func (e *env) start(t *testing.T) *running {
	t.Helper()
	log := &syncBuffer{}
	srv, err := New(e.cfg, slog.New(slog.NewJSONHandler(log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Serve: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Error("Serve did not return after its context ended")
			}
		})
	}
	t.Cleanup(stop)
	r := &running{srv: srv, log: log, stop: stop}
	r.waitHealthy(t)
	return r
}

func (r *running) base() string { return "https://" + r.srv.Addr().String() }

func (r *running) waitHealthy(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + r.srv.Addr().String() + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server never answered /healthz: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// httpClient trusts e's CA and presents the client certificate name
// ("" for none); http1 forbids HTTP/2.
func (e *env) httpClient(t *testing.T, name string, http1 bool) *http.Client {
	t.Helper()
	sc := identity.SourceConfig{CAFile: filepath.Join(e.cfg.Server.CertsDir, identity.ChainFile)}
	if name != "" {
		sc.CertFile = filepath.Join(e.cfg.Server.CertsDir, name+".crt")
		sc.KeyFile = filepath.Join(e.cfg.Server.CertsDir, name+".key")
	}
	src, err := identity.NewSource(sc)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: src.ClientConfig("127.0.0.1"), ForceAttemptHTTP2: !http1}
	if http1 {
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

func (e *env) client(t *testing.T, r *running, name string) pitrustv1connect.CertificateServiceClient {
	return pitrustv1connect.NewCertificateServiceClient(e.httpClient(t, name, false), r.base())
}

func newCSR(t *testing.T, cn string) ([]byte, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: cn}}, key)
	if err != nil {
		t.Fatal(err)
	}
	return csr, key
}

func wantCode(t *testing.T, err error, code connect.Code) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Fatalf("got %v (%v), want %v", connect.CodeOf(err), err, code)
	}
}

// clusterOf is the cluster an agent certificate names.
func clusterOf(t *testing.T, c *x509.Certificate) string {
	t.Helper()
	name, err := identity.AgentCluster(c)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

func leafOf(t *testing.T, pemBytes []byte) *x509.Certificate {
	t.Helper()
	certs, err := identity.ParseCertificates(pemBytes)
	if err != nil || len(certs) == 0 {
		t.Fatalf("certificate: %v", err)
	}
	return certs[0]
}

func (e *env) issueAsOperator(t *testing.T, cl pitrustv1connect.CertificateServiceClient, name string) *pitrustv1.IssueCertificateResponse {
	t.Helper()
	csr, _ := newCSR(t, "ignored")
	resp, err := cl.IssueCertificate(context.Background(), connect.NewRequest(&pitrustv1.IssueCertificateRequest{
		Csr: csr, Kind: "mtls-server", Name: name, DnsNames: []string{name + ".pivirt.internal"}, Days: 10,
	}))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Msg
}

// TestIssueWithOperatorCert: an operator's certificate gets any name; the
// certificate points at the server's OCSP and CRL; the CSR's subject is
// not copied.
func TestIssueWithOperatorCert(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	cl := e.client(t, r, "operator")
	msg := e.issueAsOperator(t, cl, "node1")
	leaf := leafOf(t, msg.GetCertPem())
	if leaf.Subject.CommonName != "node1" || len(leaf.DNSNames) != 1 || leaf.DNSNames[0] != "node1.pivirt.internal" {
		t.Fatalf("subject %s, dns %v", leaf.Subject, leaf.DNSNames)
	}
	if len(leaf.OCSPServer) != 1 || leaf.OCSPServer[0] != r.srv.ExternalURL()+"/ocsp" {
		t.Errorf("OCSP server %v, want %s/ocsp", leaf.OCSPServer, r.srv.ExternalURL())
	}
	if len(leaf.CRLDistributionPoints) != 1 || leaf.CRLDistributionPoints[0] != r.srv.ExternalURL()+"/crl" {
		t.Errorf("CRL DP %v", leaf.CRLDistributionPoints)
	}
	if msg.GetCertificate().GetIssuedBy() != "operator" || msg.GetCertificate().GetStatus() != "valid" {
		t.Errorf("record %+v", msg.GetCertificate())
	}
	if !bytes.Contains(msg.GetCaChainPem(), []byte("BEGIN CERTIFICATE")) {
		t.Error("no CA chain in the answer")
	}
	// The server's own certificate was issued at start, for 127.0.0.1.
	if _, err := os.Stat(filepath.Join(e.cfg.Server.CertsDir, ServerCertStem+".key")); err != nil {
		t.Error(err)
	}
	// A wildcard pattern of auth.certificate_roles gives the role too.
	if _, err := identity.Issue(e.cfg.Server.CertsDir, identity.LeafRequest{Kind: identity.KindClient, Name: "ops-anna", Days: 5}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client(t, r, "ops-anna").ListCertificates(context.Background(), connect.NewRequest(&pitrustv1.ListCertificatesRequest{})); err != nil {
		t.Errorf("ops-* caller: %v", err)
	}
}

func (e *env) createToken(t *testing.T, cl pitrustv1connect.CertificateServiceClient, req *pitrustv1.CreateBootstrapTokenRequest) string {
	t.Helper()
	resp, err := cl.CreateBootstrapToken(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.GetId() == "" || !resp.Msg.GetExpiresAt().AsTime().After(time.Now()) {
		t.Fatalf("token answer %+v", resp.Msg)
	}
	return resp.Msg.GetToken()
}

// TestIssueWithToken: a token serves once, only before it expires, and
// only for what it grants; a request asking for more is refused without
// using the token up.
func TestIssueWithToken(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	now := time.Now()
	e.cfg.Now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	r := e.start(t)
	op := e.client(t, r, "operator")
	anon := e.client(t, r, "")
	ctx := context.Background()

	tok := e.createToken(t, op, &pitrustv1.CreateBootstrapTokenRequest{Name: "node2", DnsNames: []string{"node2.pivirt.internal"}, IpAddresses: []string{"10.0.0.2"}})
	csr, key := newCSR(t, "whatever")

	// A CSR that cannot be signed: refused before the token is used.
	_, err := anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: []byte("garbage"), BootstrapToken: tok}))
	wantCode(t, err, connect.CodeInvalidArgument)
	// Wider than the grant: refused, the token stays usable.
	for _, wide := range []*pitrustv1.IssueCertificateRequest{
		{Csr: csr, BootstrapToken: tok, DnsNames: []string{"evil.pivirt.internal"}},
		{Csr: csr, BootstrapToken: tok, Name: "node3"},
		{Csr: csr, BootstrapToken: tok, IpAddresses: []string{"10.0.0.3"}},
		{Csr: csr, BootstrapToken: tok, Kind: "mtls-client"},
		{Csr: csr, BootstrapToken: tok, Usages: []string{"server", "client"}},
		{Csr: csr, BootstrapToken: tok, Days: 400},
	} {
		_, err := anon.IssueCertificate(ctx, connect.NewRequest(wide))
		wantCode(t, err, connect.CodePermissionDenied)
	}
	if !strings.Contains(r.log.String(), `"method":"IssueCertificate"`) {
		t.Error("no audit line for the refusal")
	}
	{
		// Narrower than the grant (fewer days; names left empty take the
		// token's): fine.
		resp, err := anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok, IpAddresses: []string{"10.0.0.2"}, Days: 30}))
		if err != nil {
			t.Fatal(err)
		}
		leaf := leafOf(t, resp.Msg.GetCertPem())
		if leaf.Subject.CommonName != "node2" || len(leaf.DNSNames) != 1 || len(leaf.IPAddresses) != 1 {
			t.Errorf("token certificate: %s %v %v, want node2's names", leaf.Subject, leaf.DNSNames, leaf.IPAddresses)
		}
		if life := leaf.NotAfter.Sub(leaf.NotBefore); life > 31*24*time.Hour {
			t.Errorf("token certificate lives %s, want the 30 days asked", life)
		}
		if !leaf.PublicKey.(*ecdsa.PublicKey).Equal(&key.PublicKey) {
			t.Error("the certificate is not for the CSR's key")
		}
		if !strings.HasPrefix(resp.Msg.GetCertificate().GetIssuedBy(), "token ") {
			t.Errorf("issued by %q", resp.Msg.GetCertificate().GetIssuedBy())
		}
		// Used: a second try is Unauthenticated.
		_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok}))
		wantCode(t, err, connect.CodeUnauthenticated)
	}

	// Single use, with the token's own names.
	tok2 := e.createToken(t, op, &pitrustv1.CreateBootstrapTokenRequest{Name: "node4", DnsNames: []string{"node4.pivirt.internal"}})
	resp, err := anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok2}))
	if err != nil {
		t.Fatal(err)
	}
	if leaf := leafOf(t, resp.Msg.GetCertPem()); leaf.Subject.CommonName != "node4" || leaf.DNSNames[0] != "node4.pivirt.internal" {
		t.Errorf("token certificate: %s %v", leaf.Subject, leaf.DNSNames)
	}
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok2}))
	wantCode(t, err, connect.CodeUnauthenticated)

	// Expired.
	tok3 := e.createToken(t, op, &pitrustv1.CreateBootstrapTokenRequest{Name: "node5", Ttl: durationpb.New(time.Minute)})
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok3}))
	wantCode(t, err, connect.CodeUnauthenticated)

	// An agent's token bound to its cluster: the certificate names the
	// cluster, another cluster is wider than the grant, and a cluster for
	// a name that is no agent's is refused when the token is made.
	tok4 := e.createToken(t, op, &pitrustv1.CreateBootstrapTokenRequest{Name: "pivirt-agent-node6", Cluster: "prod"})
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok4, Cluster: "staging"}))
	wantCode(t, err, connect.CodePermissionDenied)
	resp, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok4}))
	if err != nil {
		t.Fatal(err)
	}
	if got := clusterOf(t, leafOf(t, resp.Msg.GetCertPem())); got != "prod" || resp.Msg.GetCertificate().GetCluster() != "prod" {
		t.Errorf("agent certificate of a token for cluster prod names cluster %q (inventory %q)", got, resp.Msg.GetCertificate().GetCluster())
	}
	_, err = op.CreateBootstrapToken(ctx, connect.NewRequest(&pitrustv1.CreateBootstrapTokenRequest{Name: "node7", DnsNames: []string{"node7.pivirt.internal"}, Cluster: "prod"}))
	wantCode(t, err, connect.CodeInvalidArgument)

	// Unknown.
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: "ptb_nonsense"}))
	wantCode(t, err, connect.CodeUnauthenticated)

	// Neither a token nor a certificate.
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, Name: "x"}))
	wantCode(t, err, connect.CodeUnauthenticated)
}

// TestAdminRoleRequired: a client certificate without pitrust-admin may
// not issue without a token, revoke, list or create tokens.
func TestAdminRoleRequired(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	ctx := context.Background()
	nobody := e.client(t, r, "nobody")
	csr, _ := newCSR(t, "x")
	_, err := nobody.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, Name: "x", DnsNames: []string{"x.example"}}))
	wantCode(t, err, connect.CodePermissionDenied)
	_, err = nobody.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Name: "operator"}))
	wantCode(t, err, connect.CodePermissionDenied)
	_, err = nobody.ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{}))
	wantCode(t, err, connect.CodePermissionDenied)
	_, err = nobody.CreateBootstrapToken(ctx, connect.NewRequest(&pitrustv1.CreateBootstrapTokenRequest{Name: "x"}))
	wantCode(t, err, connect.CodePermissionDenied)
	_, err = e.client(t, r, "").ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{}))
	wantCode(t, err, connect.CodeUnauthenticated)
	for _, m := range []string{"RevokeCertificate", "ListCertificates", "CreateBootstrapToken"} {
		if !strings.Contains(r.log.String(), `"method":"`+m+`"`) {
			t.Errorf("no audit line for the refused %s", m)
		}
	}
}

// TestNoAdminWarned: the specification's configuration (no auth block)
// gives nobody the admin role: the server says so at start, with the fix;
// with the role given, it does not.
func TestNoAdminWarned(t *testing.T) {
	e := newEnv(t)
	e.cfg.Auth.CertificateRoles = nil
	r := e.start(t)
	// The start's lines follow the listener's: wait for "pitrust serving".
	logged := func(r *running) string {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !strings.Contains(r.log.String(), "pitrust serving"); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no \"pitrust serving\" line:\n%s", r.log.String())
			}
		}
		return r.log.String()
	}
	if l := logged(r); !strings.Contains(l, "no certificate has the pitrust-admin role") || !strings.Contains(l, "operator: [pitrust-admin]") {
		t.Errorf("no warning that nobody may issue:\n%s", l)
	}
	e = newEnv(t)
	if l := logged(e.start(t)); strings.Contains(l, "no certificate has the pitrust-admin role") {
		t.Errorf("warned with the role given:\n%s", l)
	}
}

// TestRevokedAdminRefused: an admin certificate revoked through the server
// loses its rights at once, before any CRL reaches anyone.
func TestRevokedAdminRefused(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	ctx := context.Background()
	op := e.client(t, r, "operator")
	csr, key := newCSR(t, "ops-bob")
	resp, err := op.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, Name: "ops-bob", Kind: "mtls-client"}))
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.cfg.Server.CertsDir, "ops-bob.crt"), resp.Msg.GetCertPem(), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.cfg.Server.CertsDir, "ops-bob.key"), keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	bob := e.client(t, r, "ops-bob")
	if _, err := bob.ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{})); err != nil {
		t.Fatalf("ops-bob before the revocation: %v", err)
	}
	if _, err := op.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Name: "ops-bob", Reason: "keyCompromise"})); err != nil {
		t.Fatal(err)
	}
	csr2, _ := newCSR(t, "x")
	_, err = bob.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr2, Name: "operator", Kind: "mtls-client"}))
	wantCode(t, err, connect.CodePermissionDenied)
	if !strings.Contains(err.Error(), "revoked") {
		t.Errorf("refusal %v, want it to say the certificate was revoked", err)
	}
	_, err = bob.ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{}))
	wantCode(t, err, connect.CodePermissionDenied)
}

// TestRequestSizeBounded: a body larger than any request is refused
// without credentials being needed to send it.
func TestRequestSizeBounded(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	_, err := e.client(t, r, "").RenewCertificate(context.Background(), connect.NewRequest(&pitrustv1.RenewCertificateRequest{Csr: make([]byte, 1<<20)}))
	wantCode(t, err, connect.CodeResourceExhausted)
}

// TestRevokeAndPlainHTTP: the CRL and OCSP answer over plain HTTP on the
// API's port and follow a revocation at once; the API refuses plain HTTP.
func TestRevokeAndPlainHTTP(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	ctx := context.Background()
	op := e.client(t, r, "operator")
	leaf := leafOf(t, e.issueAsOperator(t, op, "node1").GetCertPem())
	plain := "http://" + r.srv.Addr().String()
	x1 := r.srv.ca.Intermediate()

	ocspStatus := func() int {
		t.Helper()
		req, err := ocsp.CreateRequest(leaf, x1, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.Post(plain+"/ocsp", "application/ocsp-request", bytes.NewReader(req))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		o, err := ocsp.ParseResponseForCert(body, leaf, x1)
		if err != nil {
			t.Fatalf("OCSP answer (HTTP %d): %v", resp.StatusCode, err)
		}
		return o.Status
	}
	crlHas := func() bool {
		t.Helper()
		resp, err := http.Get(plain + "/crl")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		crl, err := x509.ParseRevocationList(body)
		if err != nil {
			t.Fatalf("CRL (HTTP %d): %v", resp.StatusCode, err)
		}
		if err := crl.CheckSignatureFrom(x1); err != nil {
			t.Fatal(err)
		}
		for _, rc := range crl.RevokedCertificateEntries {
			if rc.SerialNumber.Cmp(leaf.SerialNumber) == 0 {
				return true
			}
		}
		return false
	}
	if ocspStatus() != ocsp.Good || crlHas() {
		t.Fatal("a fresh certificate is not good")
	}
	resp, err := op.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Name: "node1", Reason: "keyCompromise"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.GetRevoked()) != 1 || resp.Msg.GetRevoked()[0].GetRevocationReason() != "keyCompromise" {
		t.Fatalf("revoked %+v", resp.Msg.GetRevoked())
	}
	if ocspStatus() != ocsp.Revoked || !crlHas() {
		t.Error("the revocation is not in OCSP and the CRL")
	}
	list, err := op.ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{Status: "revoked"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Msg.GetCertificates()) != 1 || list.Msg.GetCertificates()[0].GetName() != "node1" {
		t.Errorf("revoked list %+v", list.Msg.GetCertificates())
	}
	_, err = op.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Serial: "ABCDEF"}))
	wantCode(t, err, connect.CodeNotFound)

	// The API over plain HTTP: refused, saying to use TLS.
	api, err := http.Post(plain+pitrustv1connect.CertificateServiceListCertificatesProcedure, "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(api.Body)
	api.Body.Close()
	if api.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "the API needs TLS: use https://") {
		t.Errorf("plain API: %d %q", api.StatusCode, body)
	}
	// /healthz on both.
	hc := e.httpClient(t, "", false)
	h, err := hc.Get(r.base() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	h.Body.Close()
	if h.StatusCode != http.StatusOK {
		t.Errorf("TLS /healthz: %d", h.StatusCode)
	}
}

// TestRestartKeepsDatabase: the inventory and revocations survive a
// restart on the same database.
func TestRestartKeepsDatabase(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	ctx := context.Background()
	op := e.client(t, r, "operator")
	e.issueAsOperator(t, op, "keep")
	e.issueAsOperator(t, op, "gone")
	if _, err := op.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Name: "gone"})); err != nil {
		t.Fatal(err)
	}
	r.stop()

	r2 := e.start(t)
	list, err := e.client(t, r2, "operator").ListCertificates(ctx, connect.NewRequest(&pitrustv1.ListCertificatesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, c := range list.Msg.GetCertificates() {
		got[c.GetName()] = c.GetStatus()
	}
	if got["keep"] != "valid" || got["gone"] != "revoked" {
		t.Errorf("after the restart: %v", got)
	}
}

// TestRateLimit: above the burst a caller gets ResourceExhausted.
func TestRateLimit(t *testing.T) {
	e := newEnv(t)
	e.cfg.RateLimit = RateLimitConfig{IssuePerMinute: 1, Burst: 2}
	r := e.start(t)
	op := e.client(t, r, "operator")
	e.issueAsOperator(t, op, "a")
	e.issueAsOperator(t, op, "b")
	csr, _ := newCSR(t, "c")
	_, err := op.IssueCertificate(context.Background(), connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, Name: "c", DnsNames: []string{"c.example"}}))
	wantCode(t, err, connect.CodeResourceExhausted)

	// Failed token attempts from one address are limited too.
	anon := e.client(t, r, "")
	for range 2 {
		_, err = anon.IssueCertificate(context.Background(), connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: "ptb_guess"}))
		wantCode(t, err, connect.CodeUnauthenticated)
	}
	_, err = anon.IssueCertificate(context.Background(), connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: "ptb_guess"}))
	wantCode(t, err, connect.CodeResourceExhausted)
}

// TestConnectJSONOverHTTP1: what curl does — a JSON POST over HTTP/1.1.
func TestConnectJSONOverHTTP1(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	e.issueAsOperator(t, e.client(t, r, "operator"), "node1")
	hc := e.httpClient(t, "operator", true)
	resp, err := hc.Post(r.base()+pitrustv1connect.CertificateServiceListCertificatesProcedure, "application/json", strings.NewReader(`{"name":"node1"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != 1 {
		t.Fatalf("%s %d: %s", resp.Proto, resp.StatusCode, body)
	}
	var out struct {
		Certificates []struct {
			Name, Status string
		}
	}
	if err := json.Unmarshal(body, &out); err != nil || len(out.Certificates) != 1 || out.Certificates[0].Name != "node1" {
		t.Errorf("%s: %v", body, err)
	}
	// The same over HTTP/2 (ALPN h2).
	h2, err := e.httpClient(t, "operator", false).Post(r.base()+pitrustv1connect.CertificateServiceListCertificatesProcedure, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	h2.Body.Close()
	if h2.StatusCode != http.StatusOK || h2.ProtoMajor != 2 {
		t.Errorf("%s %d, want HTTP/2 200", h2.Proto, h2.StatusCode)
	}
}

// TestConfigErrors: unknown keys and bad values are errors naming the key.
func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"server:\n  adr: x\n", "server.adr"},
		{"polcy: {}\n", "polcy"},
		{"server:\n  addr: nonsense\n", "server.addr"},
		{"server:\n  external_url: https://x\n", "server.external_url"},
		{"server:\n  tls:\n    cert_file: a.crt\n", "server.tls"},
		{"policy:\n  default_days: 400\n", "policy.default_days"},
		{"policy:\n  max_days: 0\n", "policy.max_days"},
		{"policy:\n  crl_validity: 1s\n", "policy.crl_validity"},
		{"policy:\n  ocsp_validity: soon\n", "policy.ocsp_validity"},
		{"rate_limit:\n  burst: 0\n", "rate_limit.burst"},
		{"rate_limit:\n  issue_per_minute: many\n", "rate_limit.issue_per_minute"},
		{"auth:\n  certificate_roles:\n    operator: []\n", "auth.certificate_roles.operator"},
	} {
		_, err := ParseConfig([]byte(tc.yaml), "pitrust.yaml")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error naming %s", tc.yaml, err, tc.want)
		}
	}
	var fe *config.FieldError
	if _, err := ParseConfig([]byte("server:\n  adr: x\n"), "f"); !errors.As(err, &fe) || !errors.Is(err, config.ErrUnknownKey) {
		t.Errorf("unknown key: %v", err)
	}
	cfg, err := ParseConfig([]byte("server:\n  addr: 0.0.0.0:9443\n"), "f")
	if err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	if got := cfg.ExternalURLOrDefault(); host != "" && got != "http://"+host+":9443" {
		t.Errorf("default external_url %q", got)
	}
	cfg.Server.Addr = "10.1.2.3:8080"
	if got := cfg.ExternalURLOrDefault(); got != "http://10.1.2.3:8080" {
		t.Errorf("default external_url %q", got)
	}
}

// TestExampleConfig: the packaged example configuration is valid.
func TestExampleConfig(t *testing.T) {
	cfg, err := LoadConfig(filepath.Join("..", "..", "..", "packaging", "pitrust.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Auth.CertificateRoles) == 0 {
		t.Error("the example gives no certificate roles")
	}
}

// TestCAStoreErrorMapping: errors of the CA become the documented codes.
func TestCAStoreErrorMapping(t *testing.T) {
	s := &service{logger: slog.New(slog.DiscardHandler)}
	ctx := context.Background()
	for _, tc := range []struct {
		err  error
		want connect.Code
	}{
		{castore.ErrTokenInvalid, connect.CodeUnauthenticated},
		{castore.ErrNotFound, connect.CodeNotFound},
		{identity.ErrRenewalRefused, connect.CodePermissionDenied},
		{identity.ErrInvalidRequest, connect.CodeInvalidArgument},
		{castore.ErrRefused, connect.CodeInvalidArgument},
		{errors.New("disk on fire"), connect.CodeInternal},
	} {
		if got := s.codeOf(ctx, "M", tc.err, connect.CodeInvalidArgument).Code(); got != tc.want {
			t.Errorf("%v: %v, want %v", tc.err, got, tc.want)
		}
	}
}

// TestRenew: the holder of a certificate renews it with a proof of its key
// and no role; a revoked certificate is refused.
func TestRenew(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	ctx := context.Background()
	op := e.client(t, r, "operator")
	csr, key := newCSR(t, "x")
	resp, err := op.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, Kind: "mtls-client", Name: "pivirt-agent-n1", Days: 30, Cluster: "prod"}))
	if err != nil {
		t.Fatal(err)
	}
	cur := leafOf(t, resp.Msg.GetCertPem())
	renew := func() (*connect.Response[pitrustv1.RenewCertificateResponse], error) {
		req, _, err := identity.NewRenewalRequest([][]byte{cur.Raw}, key)
		if err != nil {
			t.Fatal(err)
		}
		return e.client(t, r, "nobody").RenewCertificate(ctx, connect.NewRequest(&pitrustv1.RenewCertificateRequest{Csr: req.CSR, Current: req.Current, Proof: req.Proof}))
	}
	got, err := renew()
	if err != nil {
		t.Fatal(err)
	}
	if leaf := leafOf(t, got.Msg.GetCertPem()); leaf.Subject.CommonName != "pivirt-agent-n1" || leaf.SerialNumber.Cmp(cur.SerialNumber) == 0 || clusterOf(t, leaf) != "prod" {
		t.Errorf("renewed %s serial %s cluster %q, want another serial of pivirt-agent-n1 of cluster prod", leaf.Subject, leaf.SerialNumber, clusterOf(t, leaf))
	}
	if _, err := op.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Serial: resp.Msg.GetCertificate().GetSerial()})); err != nil {
		t.Fatal(err)
	}
	_, err = renew()
	wantCode(t, err, connect.CodePermissionDenied)
}

// TestRenewOwnCertificate: the server renews the certificate it issued
// itself once two thirds of its lifetime have passed, and serves the new
// one.
func TestRenewOwnCertificate(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	now := time.Now()
	e.cfg.Now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	e.cfg.Policy.DefaultDays = 3
	r := e.start(t)
	// The server's own loop looks once at start, then hourly: let that
	// look pass before moving the clock.
	deadline := time.Now().Add(20 * time.Second)
	for r.srv.renewPasses.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the renewal loop did not make its first pass")
		}
		time.Sleep(5 * time.Millisecond)
	}
	old := r.srv.src.Leaf()
	if renewed, err := r.srv.renewOwn(); renewed || err != nil {
		t.Fatalf("renewed a fresh certificate: %v %v", renewed, err)
	}
	mu.Lock()
	now = now.Add(50 * time.Hour)
	mu.Unlock()
	if renewed, err := r.srv.renewOwn(); !renewed || err != nil {
		t.Fatalf("not renewed when due: %v %v", renewed, err)
	}
	cur := r.srv.src.Leaf()
	if cur.SerialNumber.Cmp(old.SerialNumber) == 0 || cur.Subject.CommonName != old.Subject.CommonName {
		t.Fatalf("renewed to %s %s", cur.Subject, cur.SerialNumber)
	}
	onDisk, err := identity.ReadCertificates(filepath.Join(e.cfg.Server.CertsDir, ServerCertStem+".crt"))
	if err != nil || onDisk[0].SerialNumber.Cmp(cur.SerialNumber) != 0 {
		t.Fatalf("the file holds another certificate: %v", err)
	}
	// New connections get it (the test's clock is ahead: look, don't verify).
	conn, err := tls.Dial("tcp", r.srv.Addr().String(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if got := conn.ConnectionState().PeerCertificates[0].SerialNumber; got.Cmp(cur.SerialNumber) != 0 {
		t.Errorf("served serial %s, want %s", got, cur.SerialNumber)
	}
}

// TestIssueLifetime: a lifetime shorter than a day (the operator's short
// durations) is granted as asked; below a minute, negative or above the
// policy is refused naming the lifetime; a token's holder gets no more
// than the token grants.
func TestIssueLifetime(t *testing.T) {
	e := newEnv(t)
	r := e.start(t)
	op := e.client(t, r, "operator")
	anon := e.client(t, r, "")
	ctx := context.Background()
	csr, _ := newCSR(t, "x")
	resp, err := op.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{
		Csr: csr, Kind: "mtls-server", Name: "short", DnsNames: []string{"short.pivirt.internal"}, Lifetime: durationpb.New(90 * time.Second),
	}))
	if err != nil {
		t.Fatal(err)
	}
	leaf := leafOf(t, resp.Msg.GetCertPem())
	if life := time.Until(leaf.NotAfter); life < 80*time.Second || life > 91*time.Second {
		t.Errorf("a 90s lifetime: the certificate ends in %s", life)
	}
	for _, bad := range []*durationpb.Duration{durationpb.New(30 * time.Second), durationpb.New(-time.Hour), durationpb.New(24 * 400 * time.Hour)} {
		_, err := op.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{
			Csr: csr, Kind: "mtls-server", Name: "short", DnsNames: []string{"short.pivirt.internal"}, Lifetime: bad,
		}))
		wantCode(t, err, connect.CodeInvalidArgument)
		if err != nil && !strings.Contains(err.Error(), "lifetime") {
			t.Errorf("lifetime %s refused with %v, want it named", bad.AsDuration(), err)
		}
	}
	tok := e.createToken(t, op, &pitrustv1.CreateBootstrapTokenRequest{Name: "node9", DnsNames: []string{"node9.pivirt.internal"}, Days: 1})
	_, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok, Lifetime: durationpb.New(48 * time.Hour)}))
	wantCode(t, err, connect.CodePermissionDenied)
	resp, err = anon.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: tok, Lifetime: durationpb.New(time.Hour)}))
	if err != nil {
		t.Fatal(err)
	}
	if life := time.Until(leafOf(t, resp.Msg.GetCertPem()).NotAfter); life > time.Hour {
		t.Errorf("token narrowed to 1h: the certificate ends in %s", life)
	}
}
