package castore

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ocsp"
	"golang.org/x/time/rate"

	"pilab.hu/pivirt-agent/identity"
)

// OCSP signing certificate and request limits.
const (
	// ocspSignerLifetime is the delegated OCSP signing certificate's
	// lifetime; Run makes a new one at half of it.
	ocspSignerLifetime = 7 * 24 * time.Hour
	// maxOCSPRequest bounds an OCSP request (one is about 100 bytes).
	maxOCSPRequest = 10 << 10
)

// oidOCSPNoCheck is id-pkix-ocsp-nocheck (RFC 6960 4.2.2.2.1): relying
// parties do not check the OCSP signer's own revocation.
var oidOCSPNoCheck = asn1.ObjectIdentifier{1, 3, 6, 1, 5, 5, 7, 48, 1, 5}

// asn1Null is the DER of ASN.1 NULL, the value of id-pkix-ocsp-nocheck.
var asn1Null = []byte{0x05, 0x00}

// makeOCSPSigner issues the delegated OCSP signing certificate (X1's, a
// new P-256 key, kept in memory only) and installs it.
func (c *CA) makeOCSPSigner() error {
	now := c.cfg.Now()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "PiTrust X1 OCSP Responder", Organization: []string{identity.Organization}},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              minTime(now.Add(ocspSignerLifetime), c.x1.NotAfter),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageOCSPSigning},
		BasicConstraintsValid: true,
		ExtraExtensions:       []pkix.Extension{{Id: oidOCSPNoCheck, Value: asn1Null}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.x1, key.Public(), c.key)
	if err != nil {
		return fmt.Errorf("castore: issue the OCSP signing certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.signer, c.signerKey = cert, key
	c.mu.Unlock()
	return nil
}

// OCSPSigner is the current delegated OCSP signing certificate.
func (c *CA) OCSPSigner() *x509.Certificate {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.signer
}

// Handler serves the plain-HTTP endpoints: the OCSP responder (GET
// /ocsp/<base64 request>, POST /ocsp with an application/ocsp-request
// body) and the CRL (GET or HEAD /crl, DER).
func (c *CA) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Not a ServeMux: it would redirect the "//" a base64 request may
		// hold.
		path := r.URL.EscapedPath()
		switch {
		case path == "/crl":
			c.serveCRL(w, r)
		case path == "/ocsp" || strings.HasPrefix(path, "/ocsp/"):
			c.serveOCSP(w, r, strings.TrimPrefix(strings.TrimPrefix(path, "/ocsp"), "/"))
		default:
			http.NotFound(w, r)
		}
	})
}

// serveOCSP answers one OCSP request (RFC 6960 appendix A).
func (c *CA) serveOCSP(w http.ResponseWriter, r *http.Request, escaped string) {
	var raw []byte
	switch r.Method {
	case http.MethodGet:
		b, err := decodeOCSPGet(escaped)
		if err != nil {
			writeOCSP(w, http.StatusBadRequest, ocsp.MalformedRequestErrorResponse)
			return
		}
		raw = b
	case http.MethodPost:
		b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxOCSPRequest))
		if err != nil {
			writeOCSP(w, http.StatusBadRequest, ocsp.MalformedRequestErrorResponse)
			return
		}
		raw = b
	default:
		w.Header().Set("Allow", "GET, POST")
		http.Error(w, "GET /ocsp/<base64 request> or POST /ocsp", http.StatusMethodNotAllowed)
		return
	}
	resp, status := c.answerOCSP(raw)
	if status == http.StatusOK && resp.next != (time.Time{}) {
		setCacheControl(w)
	}
	writeOCSP(w, status, resp.der)
}

// ocspAnswer is a response and how long it may be cached.
type ocspAnswer struct {
	der  []byte
	next time.Time
}

// decodeOCSPGet decodes the URL-escaped base64 of a GET request.
func decodeOCSPGet(escaped string) ([]byte, error) {
	if len(escaped) > 2*maxOCSPRequest {
		return nil, errors.New("request too large")
	}
	s, err := url.PathUnescape(escaped)
	if err != nil {
		return nil, err
	}
	s = strings.ReplaceAll(s, " ", "+") // a '+' some clients leave unescaped
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	return base64.RawURLEncoding.DecodeString(strings.TrimRight(s, "="))
}

// answerOCSP parses a DER request and signs the answer; the status is
// 400 for a malformed request.
func (c *CA) answerOCSP(raw []byte) (ocspAnswer, int) {
	req, err := parseOCSPRequest(raw)
	if err != nil {
		return ocspAnswer{der: ocsp.MalformedRequestErrorResponse}, http.StatusBadRequest
	}
	if !c.isOurIssuer(req) {
		return ocspAnswer{der: ocsp.UnauthorizedErrorResponse}, http.StatusOK
	}
	now := c.cfg.Now()
	c.mu.Lock()
	signer, key := c.signer, c.signerKey
	c.mu.Unlock()
	tmpl := ocsp.Response{
		Status:       ocsp.Unknown,
		SerialNumber: req.SerialNumber,
		ThisUpdate:   now.Add(-crlBackdate).Truncate(time.Second),
		NextUpdate:   minTime(now.Add(c.cfg.OCSPValidity), signer.NotAfter).Truncate(time.Second),
		Certificate:  signer,
		IssuerHash:   req.HashAlgorithm,
	}
	if rec, err := c.db.get(serialString(req.SerialNumber), now); err == nil {
		tmpl.Status = ocsp.Good
		if rec.Status == StatusRevoked {
			tmpl.Status, tmpl.RevokedAt = ocsp.Revoked, rec.RevokedAt
			if code, err := ParseRevocationReason(rec.Reason); err == nil {
				tmpl.RevocationReason = code
			}
		}
	} else if !errors.Is(err, ErrNotFound) {
		c.cfg.Logger.Error("OCSP: read the inventory", "err", err)
		return ocspAnswer{der: ocsp.InternalErrorErrorResponse}, http.StatusOK
	}
	key2 := fmt.Sprintf("%x|%d|%d|%d|%s|%x", req.SerialNumber, req.HashAlgorithm, tmpl.Status, tmpl.RevocationReason, tmpl.RevokedAt.UTC().Format(time.RFC3339Nano), signer.SerialNumber)
	if a, ok := c.ocsp.cached(key2, now); ok {
		return a, http.StatusOK
	}
	if !c.ocsp.sign() {
		if c.ocsp.logRefusal() {
			c.cfg.Logger.Warn("OCSP: over the signing budget: answering tryLater", "per_second", ocspSignsPerSecond, "burst", ocspSignBurst)
		}
		return ocspAnswer{der: ocsp.TryLaterErrorResponse}, http.StatusOK
	}
	der, err := ocsp.CreateResponse(c.x1, signer, tmpl, key)
	if err != nil {
		c.cfg.Logger.Error("OCSP: sign the response", "err", err)
		return ocspAnswer{der: ocsp.InternalErrorErrorResponse}, http.StatusOK
	}
	a := ocspAnswer{der: der, next: tmpl.NextUpdate}
	// Reused for the first half of its validity: the same question
	// (serial, hash, status) costs no signature meanwhile.
	c.ocsp.store(key2, a, now.Add(tmpl.NextUpdate.Sub(now)/2))
	return a, http.StatusOK
}

// The OCSP responder signs at most ocspSignsPerSecond responses a second
// (a burst of ocspSignBurst); past that it answers tryLater (RFC 6960,
// unsigned) and logs it at most once a second. Answers are reused for the
// first half of their validity (at most ocspCacheMax of them), so clients
// asking about the same certificates cost no signature: only a flood of
// different questions meets the budget.
const (
	ocspSignsPerSecond = 200
	ocspSignBurst      = 400
	ocspCacheMax       = 8192
)

type ocspBudget struct {
	once   sync.Once
	signs  *rate.Limiter
	logged *rate.Limiter

	mu    sync.Mutex
	cache map[string]ocspCached
}

type ocspCached struct {
	answer ocspAnswer
	until  time.Time
}

func (b *ocspBudget) init() {
	b.once.Do(func() {
		b.signs = rate.NewLimiter(ocspSignsPerSecond, ocspSignBurst)
		b.logged = rate.NewLimiter(1, 1)
		b.cache = make(map[string]ocspCached)
	})
}

func (b *ocspBudget) cached(key string, now time.Time) (ocspAnswer, bool) {
	b.init()
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.cache[key]
	if !ok || !now.Before(e.until) {
		return ocspAnswer{}, false
	}
	return e.answer, true
}

func (b *ocspBudget) store(key string, a ocspAnswer, until time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.cache) >= ocspCacheMax {
		clear(b.cache)
	}
	b.cache[key] = ocspCached{answer: a, until: until}
}

func (b *ocspBudget) sign() bool {
	b.init()
	return b.signs.Allow()
}

func (b *ocspBudget) logRefusal() bool { return b.logged.Allow() }

// parseOCSPRequest parses a DER OCSP request (the handler's parsing,
// fuzzed): one request about a serial, with a hash the responder knows.
func parseOCSPRequest(raw []byte) (*ocsp.Request, error) {
	if len(raw) == 0 || len(raw) > maxOCSPRequest {
		return nil, fmt.Errorf("OCSP request of %d bytes", len(raw))
	}
	req, err := ocsp.ParseRequest(raw)
	if err != nil {
		return nil, err
	}
	if req.SerialNumber == nil || req.SerialNumber.Sign() < 0 {
		return nil, errors.New("OCSP request without a serial number")
	}
	if !req.HashAlgorithm.Available() {
		return nil, fmt.Errorf("OCSP request hash %v not available", req.HashAlgorithm)
	}
	return req, nil
}

// isOurIssuer checks the request's issuer name and key hashes against X1.
func (c *CA) isOurIssuer(req *ocsp.Request) bool {
	var spki struct {
		Algorithm pkix.AlgorithmIdentifier
		PublicKey asn1.BitString
	}
	if _, err := asn1.Unmarshal(c.x1.RawSubjectPublicKeyInfo, &spki); err != nil {
		return false
	}
	return bytes.Equal(hashOf(req.HashAlgorithm, c.x1.RawSubject), req.IssuerNameHash) &&
		bytes.Equal(hashOf(req.HashAlgorithm, spki.PublicKey.RightAlign()), req.IssuerKeyHash)
}

func hashOf(h crypto.Hash, b []byte) []byte {
	d := h.New()
	d.Write(b)
	return d.Sum(nil)
}

func writeOCSP(w http.ResponseWriter, status int, der []byte) {
	w.Header().Set("Content-Type", "application/ocsp-response")
	w.WriteHeader(status)
	_, _ = w.Write(der)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func parseSerial(s string) (*big.Int, error) {
	n, ok := new(big.Int).SetString(s, 16)
	if !ok {
		return nil, fmt.Errorf("serial %q is not hex", s)
	}
	return n, nil
}
