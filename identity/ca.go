package identity

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"time"
)

// ErrRenewalRefused is returned (wrapped) for a renewal request the cluster
// CA does not sign; the message says why.
var ErrRenewalRefused = errors.New("renewal refused")

// renewalProofContext prefixes what a renewal proof signs, so that the
// signature cannot be taken for any other signature of the key.
const renewalProofContext = "pivirt-renewal-v1\x00"

// CertAuthority is the built-in cluster CA: an intermediate CA certificate
// (signed by the PiTrust root the agents trust) and its key. It signs only
// renewals: a new key for a certificate its requester already holds.
type CertAuthority struct {
	// Cert is the signing CA.
	Cert *x509.Certificate
	// Chain is Cert followed by the CA certificates found after it in its
	// PEM file; issued certificates carry it after the leaf.
	Chain []*x509.Certificate
	// OCSPServer and CRLDistributionPoints, when set, go into every
	// certificate Renew issues (the OCSP responder URLs and the CRL
	// distribution points of the CA server that renews).
	OCSPServer            []string
	CRLDistributionPoints []string
	key                   crypto.Signer
}

// ParseCertAuthority reads a CA certificate (first in certPEM, optionally
// followed by the CAs above it) and its private key, and checks that the
// certificate is a CA that may sign certificates and that the key is its.
func ParseCertAuthority(certPEM, keyPEM []byte) (*CertAuthority, error) {
	chain, err := ParseCertificates(certPEM)
	if err != nil {
		return nil, fmt.Errorf("cluster ca: %w", err)
	}
	ca := chain[0]
	if !ca.IsCA || ca.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("cluster ca: %q is not a CA certificate that may sign certificates", ca.Subject.CommonName)
	}
	key, err := parsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("cluster ca key: %w", err)
	}
	if !publicKeysEqual(key.Public(), ca.PublicKey) {
		return nil, fmt.Errorf("cluster ca: the key does not belong to %q", ca.Subject.CommonName)
	}
	return &CertAuthority{Cert: ca, Chain: chain, key: key}, nil
}

// RenewalRequest asks the cluster CA for a new certificate with the
// subject, names and usages of a certificate the requester holds now.
type RenewalRequest struct {
	// CSR is a PKCS#10 request signed with the new key; only its public
	// key is used.
	CSR []byte
	// Current is the certificate being renewed (DER), leaf first.
	Current [][]byte
	// Proof is a signature over the CSR made with the current
	// certificate's key: only the holder of that key can renew it.
	Proof []byte
}

// NewRenewalRequest makes a renewal request for the certificate current,
// whose key is key, with a new ECDSA P-256 key, returned for the new
// certificate.
func NewRenewalRequest(current [][]byte, key crypto.Signer) (RenewalRequest, crypto.Signer, error) {
	newKey, err := newKey()
	if err != nil {
		return RenewalRequest{}, nil, err
	}
	return NewRenewalRequestFor(current, key, newKey)
}

// NewRenewalRequestFor is NewRenewalRequest for a new key the caller
// made (and kept, so that a renewal whose answer was lost is asked again
// with the same key: the CA then answers the same certificate).
func NewRenewalRequestFor(current [][]byte, key, newKey crypto.Signer) (RenewalRequest, crypto.Signer, error) {
	if len(current) == 0 {
		return RenewalRequest{}, nil, errors.New("renewal: no current certificate")
	}
	leaf, err := x509.ParseCertificate(current[0])
	if err != nil {
		return RenewalRequest{}, nil, fmt.Errorf("renewal: current certificate: %w", err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: leaf.Subject}, newKey)
	if err != nil {
		return RenewalRequest{}, nil, fmt.Errorf("renewal: csr: %w", err)
	}
	proof, err := signProof(key, csr)
	if err != nil {
		return RenewalRequest{}, nil, err
	}
	return RenewalRequest{CSR: csr, Current: current, Proof: proof}, newKey, nil
}

// ChainVerifier checks a certificate chain, leaf first, against the CAs the
// cluster trusts, for usage, at the moment of the call.
type ChainVerifier func(chain []*x509.Certificate, usage x509.ExtKeyUsage) error

// Renew checks a renewal request and issues the new certificate, valid for
// ttl (at most until the CA expires): the current certificate must verify
// with verify, still be valid, be a leaf for server or client
// authentication, and the proof must be signed by its key. The new
// certificate copies its subject, DNS and IP names, URIs and extended key
// usages; the CSR contributes only the public key. It returns the PEM of
// the new certificate followed by the CA chain.
func (ca *CertAuthority) Renew(req RenewalRequest, verify ChainVerifier, ttl time.Duration, now time.Time) ([]byte, *x509.Certificate, error) {
	refuse := func(format string, args ...any) ([]byte, *x509.Certificate, error) {
		return nil, nil, fmt.Errorf("%w: %s", ErrRenewalRefused, fmt.Sprintf(format, args...))
	}
	if ttl <= 0 {
		return nil, nil, fmt.Errorf("cluster ca: leaf lifetime %s must be positive", ttl)
	}
	if len(req.Current) == 0 {
		return refuse("no current certificate")
	}
	chain := make([]*x509.Certificate, len(req.Current))
	for i, b := range req.Current {
		c, err := x509.ParseCertificate(b)
		if err != nil {
			return refuse("current certificate %d: %v", i, err)
		}
		chain[i] = c
	}
	cur := chain[0]
	if cur.IsCA {
		return refuse("%q is a CA certificate; only leaves are renewed", cur.Subject.String())
	}
	// Every usage copied must be one the current chain allows: verified
	// one at a time (a chain check passes when any one usage matches).
	if len(cur.ExtKeyUsage) == 0 || len(cur.UnknownExtKeyUsage) > 0 {
		return refuse("%q is neither a server nor a client certificate", cur.Subject.String())
	}
	for _, usage := range cur.ExtKeyUsage {
		if usage != x509.ExtKeyUsageServerAuth && usage != x509.ExtKeyUsageClientAuth {
			return refuse("%q has extended key usages other than server and client authentication", cur.Subject.String())
		}
		if err := verify(chain, usage); err != nil {
			return refuse("current certificate %q: %v", cur.Subject.String(), err)
		}
	}
	if err := checkProof(cur, req.CSR, req.Proof); err != nil {
		return refuse("proof of possession for %q: %v", cur.Subject.String(), err)
	}
	csr, err := x509.ParseCertificateRequest(req.CSR)
	if err != nil {
		return refuse("csr: %v", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return refuse("csr signature: %v", err)
	}
	if now.After(ca.Cert.NotAfter) {
		return nil, nil, fmt.Errorf("cluster ca %q expired on %s", ca.Cert.Subject.CommonName, ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               cur.Subject,
		NotBefore:             now.Add(-backdate(ttl)),
		NotAfter:              minTime(now.Add(ttl), ca.Cert.NotAfter),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           slices.Clone(cur.ExtKeyUsage),
		BasicConstraintsValid: true,
		DNSNames:              slices.Clone(cur.DNSNames),
		IPAddresses:           slices.Clone(cur.IPAddresses),
		URIs:                  slices.Clone(cur.URIs),
		OCSPServer:            slices.Clone(ca.OCSPServer),
		CRLDistributionPoints: slices.Clone(ca.CRLDistributionPoints),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, csr.PublicKey, ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster ca: sign %q: %w", cur.Subject.String(), err)
	}
	issued, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	out := certPEM(der)
	for _, c := range ca.Chain {
		out = append(out, certPEM(c.Raw)...)
	}
	return out, issued, nil
}

// RenewalTime is when a certificate is due for renewal: at fraction
// (0.6 to 0.9, drawn at random by the caller so that agents do not renew
// together) of its lifetime.
func RenewalTime(c *x509.Certificate, fraction float64) time.Time {
	life := c.NotAfter.Sub(c.NotBefore)
	return c.NotBefore.Add(time.Duration(float64(life) * fraction))
}

// backdate is how far before its issue a certificate's validity starts, to
// tolerate clock skew between nodes: five minutes, or a tenth of a short
// lifetime.
func backdate(lifetime time.Duration) time.Duration {
	return min(5*time.Minute, lifetime/10)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// signProof signs the renewal proof for csr with key.
func signProof(key crypto.Signer, csr []byte) ([]byte, error) {
	return sign(key, append([]byte(renewalProofContext), csr...))
}

// checkProof verifies a renewal proof against the current certificate's key.
func checkProof(cur *x509.Certificate, csr, proof []byte) error {
	err := checkSignature(cur, append([]byte(renewalProofContext), csr...), proof)
	if errors.Is(err, errBadSignature) {
		return errors.New("not signed by the current certificate's key")
	}
	return err
}

// sign signs msg with key: SHA-256 for ECDSA and RSA, pure Ed25519.
func sign(key crypto.Signer, msg []byte) ([]byte, error) {
	if _, ok := key.Public().(ed25519.PublicKey); ok {
		return key.Sign(rand.Reader, msg, crypto.Hash(0))
	}
	digest := sha256.Sum256(msg)
	return key.Sign(rand.Reader, digest[:], crypto.SHA256)
}

// checkSignature verifies sign's signature over msg with cert's key.
func checkSignature(cert *x509.Certificate, msg, sig []byte) error {
	var alg x509.SignatureAlgorithm
	switch cert.PublicKey.(type) {
	case *ecdsa.PublicKey:
		alg = x509.ECDSAWithSHA256
	case *rsa.PublicKey:
		alg = x509.SHA256WithRSA
	case ed25519.PublicKey:
		alg = x509.PureEd25519
	default:
		return fmt.Errorf("unsupported key type %T", cert.PublicKey)
	}
	if err := cert.CheckSignature(alg, msg, sig); err != nil {
		return errBadSignature
	}
	return nil
}

var errBadSignature = errors.New("not signed by the certificate's key")

// KeyPEM encodes a private key as PKCS#8 PEM.
func KeyPEM(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// Signer is the CA's private key.
func (ca *CertAuthority) Signer() crypto.Signer { return ca.key }
