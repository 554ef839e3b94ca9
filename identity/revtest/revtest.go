// Package revtest is a revocation service for tests: it serves a CRL and
// an OCSP responder for a PiTrust test CA on 127.0.0.1, as the PiTrust CA
// server does (/crl in DER, /ocsp answering with a delegated responder
// certificate issued by X1), and signs leaves that point at them.
package revtest

import (
	"bytes"
	"cmp"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/ocsp"

	"pilab.hu/pivirt-agent/identity"
)

// Server is the revocation service of one test CA (the X1 intermediate of
// a directory made by identity.InitCA).
type Server struct {
	// URL is the service's base URL; CRLURL and OCSPURL its endpoints.
	URL, CRLURL, OCSPURL string
	// CA is X1, the issuer of the leaves and of the CRL.
	CA    *x509.Certificate
	caKey crypto.Signer
	// responder is the delegated OCSP-signing certificate.
	responder    *x509.Certificate
	responderKey crypto.Signer

	mu      sync.Mutex
	revoked map[string]time.Time
	unknown map[string]bool
	number  int64
	// CRLDown and OCSPDown make the endpoints answer 503; StaleCRL serves
	// a CRL past its NextUpdate.
	CRLDown, OCSPDown, StaleCRL atomic.Bool
	// CRLFetches and OCSPRequests count the requests served.
	CRLFetches, OCSPRequests atomic.Int64
	// CRLValidity is the CRL's NextUpdate - ThisUpdate (default 1h).
	CRLValidity time.Duration
}

// New starts the service for the CA in caDir, stopped at the test's end.
func New(t testing.TB, caDir string) *Server {
	t.Helper()
	ca, key, err := identity.LoadCA(caDir)
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{CA: ca, caKey: key, revoked: map[string]time.Time{}, unknown: map[string]bool{}, CRLValidity: time.Hour}
	rk, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(now.UnixNano()),
		Subject:      pkix.Name{CommonName: "PiTrust OCSP Responder", Organization: []string{identity.Organization}},
		NotBefore:    now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageOCSPSigning},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, rk.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	if s.responder, err = x509.ParseCertificate(der); err != nil {
		t.Fatal(err)
	}
	s.responderKey = rk
	mux := http.NewServeMux()
	mux.HandleFunc("/crl", s.serveCRL)
	mux.HandleFunc("/ocsp", s.serveOCSP)
	mux.HandleFunc("/ocsp/", s.serveOCSP)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewUnstartedServer(mux)
	hs.Listener.Close()
	hs.Listener = ln
	hs.Start()
	t.Cleanup(hs.Close)
	s.URL = hs.URL
	s.CRLURL, s.OCSPURL = hs.URL+"/crl", hs.URL+"/ocsp"
	return s
}

// Revoke lists serial in the CRLs served from now on and answers revoked
// for it over OCSP.
func (s *Server) Revoke(serial *big.Int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.revoked[serial.String()] = time.Now().Add(-time.Second).Truncate(time.Second)
}

// Unknown makes OCSP answer "unknown" for serial.
func (s *Server) Unknown(serial *big.Int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unknown[serial.String()] = true
}

// CRL returns a CRL signed by the CA listing the revoked serials.
func (s *Server) CRL(t testing.TB) []byte {
	t.Helper()
	der, err := s.crl()
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func (s *Server) crl() ([]byte, error) {
	s.mu.Lock()
	s.number++
	tmpl := &x509.RevocationList{Number: big.NewInt(s.number)}
	for serial, at := range s.revoked {
		n, _ := new(big.Int).SetString(serial, 10)
		tmpl.RevokedCertificateEntries = append(tmpl.RevokedCertificateEntries, x509.RevocationListEntry{SerialNumber: n, RevocationTime: at, ReasonCode: 1})
	}
	s.mu.Unlock()
	now := time.Now()
	tmpl.ThisUpdate, tmpl.NextUpdate = now.Add(-time.Minute), now.Add(s.CRLValidity)
	if s.StaleCRL.Load() {
		tmpl.ThisUpdate, tmpl.NextUpdate = now.Add(-2*time.Hour), now.Add(-time.Hour)
	}
	return x509.CreateRevocationList(rand.Reader, tmpl, s.CA, s.caKey)
}

func (s *Server) serveCRL(w http.ResponseWriter, _ *http.Request) {
	if s.CRLDown.Load() {
		http.Error(w, "down", http.StatusServiceUnavailable)
		return
	}
	s.CRLFetches.Add(1)
	der, err := s.crl()
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/pkix-crl")
	_, _ = w.Write(der)
}

func (s *Server) serveOCSP(w http.ResponseWriter, r *http.Request) {
	if s.OCSPDown.Load() {
		http.Error(w, "down", http.StatusServiceUnavailable)
		return
	}
	s.OCSPRequests.Add(1)
	var body []byte
	var err error
	if r.Method == http.MethodPost {
		body, err = io.ReadAll(io.LimitReader(r.Body, 1<<16))
	} else {
		body, err = base64.StdEncoding.DecodeString(strings.TrimPrefix(r.URL.Path, "/ocsp/"))
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req, err := ocsp.ParseRequest(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	der, err := s.response(req.SerialNumber, time.Hour)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/ocsp-response")
	_, _ = w.Write(der)
}

// Response returns an OCSP response for serial valid for validity, signed
// by the delegated responder (as a staple would be).
func (s *Server) Response(t testing.TB, serial *big.Int, validity time.Duration) []byte {
	t.Helper()
	der, err := s.response(serial, validity)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func (s *Server) response(serial *big.Int, validity time.Duration) ([]byte, error) {
	s.mu.Lock()
	at, revoked := s.revoked[serial.String()]
	unknown := s.unknown[serial.String()]
	s.mu.Unlock()
	now := time.Now()
	tmpl := ocsp.Response{Status: ocsp.Good, SerialNumber: serial, ThisUpdate: now.Add(-time.Minute), NextUpdate: now.Add(validity), Certificate: s.responder}
	switch {
	case revoked:
		tmpl.Status, tmpl.RevokedAt, tmpl.RevocationReason = ocsp.Revoked, at, ocsp.KeyCompromise
	case unknown:
		tmpl.Status = ocsp.Unknown
	}
	return ocsp.CreateResponse(s.CA, s.responder, tmpl, s.responderKey)
}

// LeafOptions describe a leaf Leaf signs.
type LeafOptions struct {
	// Server: a server certificate for 127.0.0.1 and localhost; else a
	// client certificate.
	Server bool
	// NoCRL and NoOCSP leave out the CRL distribution point or the OCSP
	// responder.
	NoCRL, NoOCSP bool
	// CRLURL and OCSPURL, when set, name other endpoints (a closed port).
	CRLURL, OCSPURL string
	// Cluster binds an agent's certificate to its cluster
	// (identity.ClusterURI).
	Cluster string
}

// Leaf signs a leaf with the CA, naming this service's CRL and OCSP
// responder, and writes <name>.crt (leaf, then X1) and <name>.key in dir.
func (s *Server) Leaf(t testing.TB, dir, name string, o LeafOptions) (identity.LeafFiles, *x509.Certificate) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name, Organization: []string{identity.Organization}},
		NotBefore:    now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if o.Server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.DNSNames, tmpl.IPAddresses = []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	if o.Cluster != "" {
		tmpl.URIs = []*url.URL{identity.ClusterURI(o.Cluster)}
	}
	if !o.NoCRL {
		tmpl.CRLDistributionPoints = []string{cmp.Or(o.CRLURL, s.CRLURL)}
	}
	if !o.NoOCSP {
		tmpl.OCSPServer = []string{cmp.Or(o.OCSPURL, s.OCSPURL)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, s.CA, k.Public(), s.caKey)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := identity.KeyPEM(k)
	if err != nil {
		t.Fatal(err)
	}
	var certPEM bytes.Buffer
	_ = pem.Encode(&certPEM, &pem.Block{Type: "CERTIFICATE", Bytes: der})
	_ = pem.Encode(&certPEM, &pem.Block{Type: "CERTIFICATE", Bytes: s.CA.Raw})
	files := identity.LeafFiles{Cert: filepath.Join(dir, name+".crt"), Key: filepath.Join(dir, name+".key")}
	if err := identity.WriteFileAtomic(files.Key, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := identity.WriteFileAtomic(files.Cert, certPEM.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return files, leaf
}
