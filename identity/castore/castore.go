// Package castore is the core of the PiTrust CA server (`pitrust serve`):
// it issues certificates from CSRs with the X1 intermediate CA, renews
// them, keeps the inventory, the bootstrap tokens and an audit trail in a
// bbolt database, revokes, and publishes the revocations as a CRL and an
// OCSP responder. See DESIGN.md.
package castore

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// Defaults of Config.
const (
	DefaultDays         = 90
	DefaultMaxDays      = 365
	DefaultCRLValidity  = 24 * time.Hour
	DefaultOCSPValidity = time.Hour
)

// Config of a CA (pitrust serve's server.certs_dir, server.db_path,
// server.external_url and policy).
type Config struct {
	// CertsDir holds PiCA.pem and PiCA.key (the X1 intermediate that
	// signs) and ca-chain.pem (X1, then the root).
	CertsDir string
	// DBPath is the bbolt file; created (0600, its directory 0700) when
	// missing.
	DBPath string
	// ExternalURL is where clients reach the server's plain-HTTP
	// endpoints, e.g. "http://pitrust.pivirt.internal:8080": certificates
	// carry <ExternalURL>/ocsp as their OCSP responder and <ExternalURL>/crl
	// as their CRL distribution point. Empty: neither.
	ExternalURL string
	// DefaultDays is the lifetime when a request gives none (default 90,
	// or MaxDays when that is less).
	DefaultDays int
	// MaxDays is the longest lifetime granted (default 365).
	MaxDays int
	// CRLValidity is NextUpdate - ThisUpdate of the CRL (default 24h);
	// the CRL is made again on every revocation and at half its validity.
	CRLValidity time.Duration
	// OCSPValidity is how long an OCSP response is valid (default 1h).
	OCSPValidity time.Duration
	// Logger receives the audit events: Info("audit", "event",
	// issue|refuse|revoke|renew|token, ...). Nil: none are logged (the
	// database keeps them still).
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Record is one certificate of the inventory.
type Record struct {
	// Serial is uppercase hex without colons, as `openssl x509 -serial`
	// prints it.
	Serial  string
	Subject string
	// Name is the CN.
	Name      string
	Kind      identity.Kind
	Usages    []identity.Usage
	DNSNames  []string
	IPs       []string
	NotBefore time.Time
	NotAfter  time.Time
	// Status is "valid", "revoked" or "expired" (StatusAt computes
	// expired).
	Status    string
	RevokedAt time.Time
	// Reason is the RFC 5280 name of the revocation reason.
	Reason string
	// IssuedBy is who had it issued: an operator's CN, "token <id>",
	// "renewal of <serial>" or "pitrust (offline)".
	IssuedBy string
	CertPEM  []byte
}

// StatusAt is the record's status at now: revoked, expired (past
// NotAfter) or valid.
func (r Record) StatusAt(now time.Time) string {
	switch {
	case r.Status == StatusRevoked:
		return StatusRevoked
	case !now.Before(r.NotAfter):
		return StatusExpired
	}
	return StatusValid
}

// at is r with its Status at now.
func (r Record) at(now time.Time) Record {
	r.Status = r.StatusAt(now)
	return r
}

// Grant is what a caller may get: names, kind, usages and lifetime (from
// an operator's request or a bootstrap token).
type Grant struct {
	Kind   identity.Kind
	Usages []identity.Usage
	Name   string
	DNS    []string
	IPs    []net.IP
	// Days is the lifetime; 0 means Config.DefaultDays.
	Days int
	// Validity, when set, is the lifetime instead of Days (at least a
	// minute, at most Config.MaxDays).
	Validity time.Duration `json:",omitempty"`
	// Cluster binds an agent's client certificate to its cluster
	// (identity.LeafRequest.Cluster).
	Cluster string `json:",omitempty"`
}

// Errors of the CA; the wrapping message says what and why.
var (
	// ErrNotFound: the serial, name or token is unknown.
	ErrNotFound = errors.New("not found")
	// ErrTokenInvalid: the bootstrap token is unknown, used or expired
	// (one error: the caller is not told which).
	ErrTokenInvalid = errors.New("invalid bootstrap token (unknown, already used or expired): ask an operator for a new one")
	// ErrRefused: a policy refusal (lifetime beyond the CA's maximum, an
	// unacceptable CSR key, a revoked certificate's renewal...). A request
	// identity refuses wraps identity.ErrInvalidRequest or
	// identity.ErrRenewalRefused instead, as identity made it.
	ErrRefused = errors.New("refused")
	// ErrLocked: the database is held by another process, a running
	// `pitrust serve`; use --server to ask it.
	ErrLocked = errors.New("database locked")
)

// CA is the PiTrust CA server's core. Its methods may be called
// concurrently.
type CA struct {
	cfg   Config
	db    *DB
	x1    *x509.Certificate
	key   crypto.Signer
	roots *x509.CertPool
	inter *x509.CertPool
	chain []byte // ca-chain.pem
	renew *identity.CertAuthority

	ocspURL, crlURL []string

	mu         sync.Mutex // guards what follows
	crl        []byte
	crlThis    time.Time
	crlNext    time.Time
	crlNumber  *big.Int
	signer     *x509.Certificate
	signerKey  crypto.Signer
	crlBuildMu sync.Mutex // one CRL build at a time, installed in order

	ocsp ocspBudget
}

// Open opens (or creates) the database, loads the CA from CertsDir,
// records ExternalURL in the database, makes the delegated OCSP signing
// certificate and builds the CRL.
func Open(cfg Config) (*CA, error) {
	if cfg.MaxDays == 0 {
		cfg.MaxDays = DefaultMaxDays
	}
	if cfg.DefaultDays == 0 {
		cfg.DefaultDays = min(DefaultDays, cfg.MaxDays)
	}
	if cfg.CRLValidity == 0 {
		cfg.CRLValidity = DefaultCRLValidity
	}
	if cfg.OCSPValidity == 0 {
		cfg.OCSPValidity = DefaultOCSPValidity
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	switch {
	case cfg.MaxDays < 1 || cfg.MaxDays > identity.MaxDays:
		return nil, fmt.Errorf("castore: max days %d: must be between 1 and %d", cfg.MaxDays, identity.MaxDays)
	case cfg.DefaultDays < 1 || cfg.DefaultDays > cfg.MaxDays:
		return nil, fmt.Errorf("castore: default days %d: must be between 1 and max days (%d)", cfg.DefaultDays, cfg.MaxDays)
	case cfg.CRLValidity < time.Minute:
		return nil, fmt.Errorf("castore: CRL validity %s: at least a minute", cfg.CRLValidity)
	case cfg.OCSPValidity < time.Minute:
		return nil, fmt.Errorf("castore: OCSP validity %s: at least a minute", cfg.OCSPValidity)
	}
	cfg.ExternalURL = strings.TrimRight(cfg.ExternalURL, "/")

	x1, key, err := identity.LoadCA(cfg.CertsDir)
	if err != nil {
		return nil, err
	}
	certPEM, err := os.ReadFile(filepath.Join(cfg.CertsDir, identity.IntermediateCertFile))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(cfg.CertsDir, identity.IntermediateKeyFile))
	if err != nil {
		return nil, err
	}
	renew, err := identity.ParseCertAuthority(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	chainPath := filepath.Join(cfg.CertsDir, identity.ChainFile)
	chainPEM, err := os.ReadFile(chainPath)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", identity.ErrNoCA, err)
	}
	chain, err := identity.ParseCertificates(chainPEM)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", identity.ErrNoCA, chainPath, err)
	}
	c := &CA{cfg: cfg, x1: x1, key: key, chain: chainPEM, renew: renew, roots: x509.NewCertPool(), inter: x509.NewCertPool()}
	c.inter.AddCert(x1)
	for _, cert := range chain {
		if bytes.Equal(cert.RawIssuer, cert.RawSubject) && cert.CheckSignatureFrom(cert) == nil {
			c.roots.AddCert(cert)
		}
	}
	if _, err := x1.Verify(x509.VerifyOptions{Roots: c.roots, CurrentTime: cfg.Now(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("%w: %s does not verify against the root in %s: %w", identity.ErrNoCA, identity.IntermediateCertFile, chainPath, err)
	}
	if cfg.ExternalURL != "" {
		c.ocspURL = []string{cfg.ExternalURL + "/ocsp"}
		c.crlURL = []string{cfg.ExternalURL + "/crl"}
		renew.OCSPServer, renew.CRLDistributionPoints = c.ocspURL, c.crlURL
	}

	db, err := OpenDB(cfg.DBPath)
	if err != nil {
		return nil, err
	}
	c.db = db
	if err := db.setExternalURL(cfg.ExternalURL); err != nil {
		db.Close()
		return nil, fmt.Errorf("castore: record the external URL: %w", err)
	}
	if err := c.makeOCSPSigner(); err != nil {
		db.Close()
		return nil, err
	}
	if err := c.buildCRL(); err != nil {
		db.Close()
		return nil, err
	}
	return c, nil
}

// Close closes the database.
func (c *CA) Close() error {
	return c.db.Close()
}

// DB is the CA's database (the inventory, tokens and audit trail).
func (c *CA) DB() *DB { return c.db }

// Run keeps the published revocation data fresh until ctx ends: it makes
// the CRL again at half its validity and the OCSP signing certificate
// again before it expires.
func (c *CA) Run(ctx context.Context) {
	floor := time.Second // a failed attempt is retried after a minute
	for {
		c.mu.Lock()
		crlDue := c.crlThis.Add(crlBackdate).Add(c.cfg.CRLValidity / 2)
		life := c.signer.NotAfter.Sub(c.signer.NotBefore)
		signerDue := c.signer.NotAfter.Add(-life / 2)
		c.mu.Unlock()
		now := c.cfg.Now()
		wait := max(min(crlDue.Sub(now), signerDue.Sub(now)), floor)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		now = c.cfg.Now()
		floor = time.Second
		if !now.Before(signerDue) {
			if err := c.makeOCSPSigner(); err != nil {
				c.cfg.Logger.Error("make the OCSP signing certificate (retried in a minute)", "err", err)
				floor = time.Minute
			}
		}
		if !now.Before(crlDue) {
			if err := c.buildCRL(); err != nil {
				c.cfg.Logger.Error("make the CRL (retried in a minute)", "err", err)
				floor = time.Minute
			}
		}
		if err := c.db.purgeTokens(now); err != nil {
			c.cfg.Logger.Error("purge expired bootstrap tokens", "err", err)
		}
	}
}

// CAChainPEM returns ca-chain.pem's bytes (X1, then the root).
func (c *CA) CAChainPEM() []byte { return bytes.Clone(c.chain) }

// Intermediate is the X1 intermediate CA that signs.
func (c *CA) Intermediate() *x509.Certificate { return c.x1 }

// List returns the records with that status ("" or "all": any; valid,
// revoked, expired) and CN ("" any), newest first.
func (c *CA) List(status, name string) ([]Record, error) {
	return c.db.List(status, name, c.cfg.Now())
}

// Get returns the record of a serial (hex, colons and lower case
// accepted); ErrNotFound if none.
func (c *CA) Get(serial string) (Record, error) {
	return c.db.get(serial, c.cfg.Now())
}

// IsRevoked reports whether the certificate with that serial is recorded
// as revoked, when, and the reason's name.
func (c *CA) IsRevoked(serial *big.Int) (bool, time.Time, string) {
	if serial == nil {
		return false, time.Time{}, ""
	}
	rec, err := c.db.get(serialString(serial), c.cfg.Now())
	if err != nil || rec.Status != StatusRevoked {
		return false, time.Time{}, ""
	}
	return true, rec.RevokedAt, rec.Reason
}

// Revoke revokes, for reason (an RFC 5280 reason name; "" unspecified),
// the certificate with that serial (hex, colons and lower case accepted)
// or every valid certificate whose CN is name, and makes the CRL again
// before returning the records revoked. A serial already revoked answers
// its record as it is; an unknown serial or name is ErrNotFound.
func (c *CA) Revoke(serial, name, reason string) ([]Record, error) {
	recs, err := c.db.revoke(serial, name, reason, c.cfg.Now(), "pitrust serve")
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		c.cfg.Logger.Info("audit", "event", "revoke", "name", r.Name, "serial", r.Serial, "reason", r.Reason)
	}
	if err := c.buildCRL(); err != nil {
		return recs, fmt.Errorf("castore: revoked, but the CRL could not be made again (it will be at the next revocation or refresh): %w", err)
	}
	return recs, nil
}

// refuse audits a refusal and returns err.
func (c *CA) refuse(by, name string, err error) error {
	c.cfg.Logger.Info("audit", "event", "refuse", "by", by, "name", name, "reason", err.Error())
	if aerr := c.db.audit(auditEvent{Event: "refuse", By: by, Name: name, Reason: err.Error()}); aerr != nil {
		c.cfg.Logger.Error("record an audit event", "err", aerr)
	}
	return err
}

func pemCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}
