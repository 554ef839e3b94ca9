package castore

import (
	"crypto/rand"
	"crypto/x509"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// crlBackdate is how far before its making a CRL's ThisUpdate lies, for
// the clock skew of the relying parties.
const crlBackdate = 5 * time.Minute

// buildCRL makes the CRL from the database (the revoked certificates that
// have not expired), with the next CRL number, signed by X1, and installs
// it.
func (c *CA) buildCRL() error {
	c.crlBuildMu.Lock()
	defer c.crlBuildMu.Unlock()
	now := c.cfg.Now()
	recs, number, err := c.db.revokedForCRL(now)
	if err != nil {
		return fmt.Errorf("castore: CRL: %w", err)
	}
	tmpl := &x509.RevocationList{
		Number:     number,
		ThisUpdate: now.Add(-crlBackdate),
		NextUpdate: now.Add(c.cfg.CRLValidity),
	}
	for _, r := range recs {
		serial, err := parseSerial(r.Serial)
		if err != nil {
			return fmt.Errorf("castore: CRL: record %s: %w", r.Serial, err)
		}
		code, err := ParseRevocationReason(r.Reason)
		if err != nil {
			code = 0
		}
		tmpl.RevokedCertificateEntries = append(tmpl.RevokedCertificateEntries, x509.RevocationListEntry{
			SerialNumber: serial, RevocationTime: r.RevokedAt, ReasonCode: code,
		})
	}
	der, err := x509.CreateRevocationList(rand.Reader, tmpl, c.x1, c.key)
	if err != nil {
		return fmt.Errorf("castore: sign the CRL: %w", err)
	}
	c.mu.Lock()
	c.crl, c.crlThis, c.crlNext, c.crlNumber = der, tmpl.ThisUpdate, tmpl.NextUpdate, number
	c.mu.Unlock()
	return nil
}

// CRL returns the current CRL (DER) and its NextUpdate.
func (c *CA) CRL() ([]byte, time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.crl, c.crlNext
}

// serveCRL answers GET and HEAD /crl.
func (c *CA) serveCRL(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "GET or HEAD the CRL", http.StatusMethodNotAllowed)
		return
	}
	der, _ := c.CRL()
	w.Header().Set("Content-Type", "application/pkix-crl")
	w.Header().Set("Content-Length", strconv.Itoa(len(der)))
	setCacheControl(w)
	if r.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(der)
}

// setCacheControl keeps caches (a proxy between agents and the server)
// from serving an answer again: a revocation must reach the agents within
// their refresh, not at the answer's next update.
func setCacheControl(w http.ResponseWriter) {
	w.Header().Set("Cache-Control", "max-age=0, no-cache, no-transform")
}
