package castore

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"pilab.hu/pivirt-agent/identity"
)

// maxCSRSize bounds a CSR (an RSA 8192 request is under 3 KiB).
const maxCSRSize = 64 << 10

// ParseCSR parses a PKCS#10 certificate signing request, PEM ("CERTIFICATE
// REQUEST" or "NEW CERTIFICATE REQUEST") or DER, checks its signature and
// its key (ECDSA P-256, P-384 or P-521, RSA of at least 2048 bits, or
// Ed25519). Anything else is refused, wrapping
// identity.ErrInvalidRequest.
func ParseCSR(b []byte) (*x509.CertificateRequest, error) {
	bad := func(format string, args ...any) (*x509.CertificateRequest, error) {
		return nil, fmt.Errorf("%w: csr: %s", identity.ErrInvalidRequest, fmt.Sprintf(format, args...))
	}
	if len(b) > maxCSRSize {
		return bad("%d bytes: larger than any certificate request (%d bytes at most)", len(b), maxCSRSize)
	}
	der := b
	if t := bytes.TrimSpace(b); bytes.HasPrefix(t, []byte("-----BEGIN")) {
		block, rest := pem.Decode(t)
		if block == nil {
			return bad("a PEM header without a complete PEM block")
		}
		if block.Type != "CERTIFICATE REQUEST" && block.Type != "NEW CERTIFICATE REQUEST" {
			return bad("PEM block %q: want CERTIFICATE REQUEST", block.Type)
		}
		if len(bytes.TrimSpace(rest)) > 0 {
			return bad("data after the PEM block: send one certificate request")
		}
		der = block.Bytes
	} else if len(b) == 0 || b[0] != 0x30 {
		return bad("neither PEM (-----BEGIN CERTIFICATE REQUEST-----) nor DER (a PKCS#10 SEQUENCE)")
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return bad("%v", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return bad("signature: %v (the request must be signed by the key it carries)", err)
	}
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return bad("%v", err)
	}
	return csr, nil
}

// checkPublicKey accepts the keys the CA signs for.
func checkPublicKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256(), elliptic.P384(), elliptic.P521():
			return nil
		}
		return fmt.Errorf("ECDSA key on curve %s: want P-256, P-384 or P-521", k.Curve.Params().Name)
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return fmt.Errorf("RSA key of %d bits: at least 2048 bits", k.N.BitLen())
		}
		return nil
	case ed25519.PublicKey:
		return nil
	}
	return fmt.Errorf("key type %T: want ECDSA, RSA (2048 bits or more) or Ed25519", pub)
}

// leafRequest turns a grant into identity's request, checked: the
// lifetime defaulted and capped by MaxDays, names and usages by
// identity's rules.
func (c *CA) leafRequest(g Grant) (identity.LeafRequest, error) {
	days := g.Days
	if days == 0 {
		days = c.cfg.DefaultDays
	}
	if days > c.cfg.MaxDays {
		return identity.LeafRequest{}, fmt.Errorf("%w: days %d: this CA grants %d days at most", ErrRefused, days, c.cfg.MaxDays)
	}
	life := time.Duration(days) * 24 * time.Hour
	if g.Validity != 0 {
		if g.Validity < time.Minute || g.Validity > time.Duration(c.cfg.MaxDays)*24*time.Hour {
			return identity.LeafRequest{}, fmt.Errorf("%w: lifetime %s: this CA grants between 1m and %d days", ErrRefused, g.Validity, c.cfg.MaxDays)
		}
		life = g.Validity
	}
	req := identity.LeafRequest{
		Kind: g.Kind, Name: g.Name, Usages: slices.Clone(g.Usages), DNS: slices.Clone(g.DNS), IPs: slices.Clone(g.IPs),
		Days: days, Validity: g.Validity, Cluster: g.Cluster, OCSPServer: c.ocspURL, CRLDistributionPoints: c.crlURL, Now: c.cfg.Now,
	}
	checked, err := identity.CheckLeafRequest(req)
	if err != nil {
		return identity.LeafRequest{}, err
	}
	if end := c.cfg.Now().Add(life); end.After(c.x1.NotAfter) {
		return identity.LeafRequest{}, fmt.Errorf("%w: days %d: the certificate would outlive the intermediate CA (valid until %s)",
			identity.ErrInvalidRequest, days, c.x1.NotAfter.UTC().Format(time.RFC3339))
	}
	return checked, nil
}

// Issue signs a certificate for the public key of csr (PEM or DER; its
// signature is checked, its names ignored) with the names, kind, usages
// and lifetime of g, checked with identity's rules, records it as issued
// by issuedBy and returns the certificate followed by X1 (PEM). Every
// issuance and refusal is audited.
func (c *CA) Issue(csr []byte, g Grant, issuedBy string) ([]byte, Record, error) {
	req, err := c.leafRequest(g)
	if err != nil {
		return nil, Record{}, c.refuse(issuedBy, g.Name, err)
	}
	parsed, err := ParseCSR(csr)
	if err != nil {
		return nil, Record{}, c.refuse(issuedBy, g.Name, err)
	}
	der, err := identity.SignLeaf(c.x1, c.key, parsed.PublicKey, req)
	if err != nil {
		return nil, Record{}, c.refuse(issuedBy, g.Name, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, Record{}, err
	}
	rec, err := c.record(cert, issuedBy, "issue")
	if err != nil {
		return nil, Record{}, err
	}
	return append(pemCert(der), pemCert(c.x1.Raw)...), rec, nil
}

// record stores a new certificate with its audit event and logs it.
func (c *CA) record(cert *x509.Certificate, issuedBy, event string) (Record, error) {
	rec := recordOf(cert, issuedBy)
	err := c.db.bolt.Update(func(tx *bolt.Tx) error {
		if err := putRecord(tx, rec); err != nil {
			return err
		}
		return putAudit(tx, auditEvent{Time: c.cfg.Now().UTC(), Event: event, By: issuedBy, Name: rec.Name, DNS: rec.DNSNames, IPs: rec.IPs, Serial: rec.Serial})
	})
	if err != nil {
		return Record{}, fmt.Errorf("castore: record %s (serial %s; the certificate is not handed out): %w", rec.Name, rec.Serial, err)
	}
	c.cfg.Logger.Info("audit", "event", event, "by", issuedBy, "name", rec.Name, "dns", rec.DNSNames, "ips", rec.IPs, "serial", rec.Serial,
		"not_after", rec.NotAfter)
	return rec, nil
}

// Renew signs a renewal (identity.CertAuthority.Renew): the current
// chain must verify against this CA for each of its usages, be neither
// revoked nor expired, and the proof must be made by its key. The new
// certificate copies the current one's names and usages, lives as long
// as it did (at most MaxDays), and is recorded as "renewal of <serial>".
func (c *CA) Renew(req identity.RenewalRequest) ([]byte, Record, error) {
	now := c.cfg.Now()
	var cur *x509.Certificate
	name := ""
	if len(req.Current) > 0 {
		if cert, err := x509.ParseCertificate(req.Current[0]); err == nil {
			cur, name = cert, cert.Subject.CommonName
		}
	}
	// The new key must be one Issue would take.
	if csr, err := x509.ParseCertificateRequest(req.CSR); err == nil {
		if err := checkPublicKey(csr.PublicKey); err != nil {
			return nil, Record{}, fmt.Errorf("%w: %v", identity.ErrRenewalRefused, err)
		}
	}
	by := "renewal"
	if cur != nil {
		by = "renewal of " + serialString(cur.SerialNumber)
	}
	if cur != nil {
		// A certificate is renewed once: its renewal retires it. The same
		// request again (its answer was lost) gets the same certificate;
		// any other is refused, so that a copy of a renewed key cannot
		// renew again beside its successor.
		prior, err := c.db.renewals(serialString(cur.SerialNumber))
		if err != nil {
			return nil, Record{}, err
		}
		for _, p := range prior {
			if csr, err := x509.ParseCertificateRequest(req.CSR); err == nil && p.StatusAt(now) == StatusValid && samePublicKey(p.CertPEM, csr.PublicKey) {
				return append(slices.Clone(p.CertPEM), pemCert(c.x1.Raw)...), p.at(now), nil
			}
		}
		if len(prior) > 0 {
			p := prior[len(prior)-1]
			return nil, Record{}, c.refuse(by, name, fmt.Errorf("%w: serial %s was renewed already (serial %s, %s): a certificate is renewed once; renew serial %s, or request a new certificate",
				identity.ErrRenewalRefused, serialString(cur.SerialNumber), p.Serial, p.StatusAt(now), p.Serial))
		}
	}
	ttl := time.Duration(c.cfg.MaxDays) * 24 * time.Hour
	if cur != nil {
		life := cur.NotAfter.Sub(cur.NotBefore)
		life -= min(5*time.Minute, life/11) // what was issued before the backdating
		ttl = min(max(life, time.Minute), ttl)
	}
	verify := func(chain []*x509.Certificate, usage x509.ExtKeyUsage) error {
		if _, err := chain[0].Verify(x509.VerifyOptions{
			Roots: c.roots, Intermediates: c.inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{usage},
		}); err != nil {
			return fmt.Errorf("not a valid certificate of this CA: %w", err)
		}
		if revoked, at, reason := c.IsRevoked(chain[0].SerialNumber); revoked {
			return fmt.Errorf("serial %s was revoked on %s (%s)", serialString(chain[0].SerialNumber), at.UTC().Format(time.RFC3339), reason)
		}
		return nil
	}
	out, cert, err := c.renew.Renew(req, verify, ttl, now)
	if err != nil {
		return nil, Record{}, c.refuse(by, name, err)
	}
	rec, err := c.record(cert, by, "renew")
	if err != nil {
		return nil, Record{}, err
	}
	return out, rec, nil
}

// samePublicKey reports whether the certificate of certPEM is for pub.
func samePublicKey(certPEM []byte, pub any) bool {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return false
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return false
	}
	k, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	return ok && k.Equal(pub)
}
