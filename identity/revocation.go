package identity

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ocsp"
	"golang.org/x/sync/singleflight"
	"golang.org/x/time/rate"
)

// ErrRevoked is wrapped by the error of a certificate its CA revoked.
var ErrRevoked = errors.New("certificate revoked")

// ErrRevocationUnavailable is wrapped by a refusal under OnUnavailable
// "deny": neither the CRL nor the OCSP responder answered usably.
var ErrRevocationUnavailable = errors.New("revocation status unavailable")

// Revocation modes (RevocationConfig.Mode).
const (
	RevocationCRL  = "crl"
	RevocationOCSP = "ocsp"
	RevocationBoth = "both"
	RevocationOff  = "off"
)

// Failure policies (RevocationConfig.OnUnavailable).
const (
	RevocationAllow = "allow"
	RevocationDeny  = "deny"
)

// Revocation check results, as RevocationConfig.OnCheck reports them.
const (
	RevocationGood        = "good"
	RevocationRevoked     = "revoked"
	RevocationUnavailable = "unavailable"
	RevocationSkipped     = "skipped"
)

// Defaults of RevocationConfig.
const (
	DefaultRevocationRefresh = 30 * time.Second
	DefaultRevocationTimeout = 5 * time.Second
)

// errNoAnswer: a check gave up waiting for a fetch (which goes on).
var errNoAnswer = errors.New("no answer within the timeout")

// maxRevocationBody bounds a CRL or OCSP response read from the network.
const maxRevocationBody = 16 << 20

// RevocationConfig configures a RevocationChecker.
type RevocationConfig struct {
	// Mode is what is asked: "crl" (the leaf's CRL distribution points),
	// "ocsp" (its OCSP responder), "both" (the CRL when it can be had,
	// else OCSP; the default) or "off".
	Mode string
	// OnUnavailable is what a certificate whose status cannot be learnt
	// gets: "allow" (the default; logged) or "deny".
	OnUnavailable string
	// Refresh is how often a cached CRL is fetched again (sooner at its
	// NextUpdate), and the longest an OCSP answer is cached. Default 30s.
	Refresh time.Duration
	// Timeout bounds each HTTP request, and so what a handshake can wait
	// for a status. Default 5s.
	Timeout time.Duration
	// Client makes the requests; nil: a client with Timeout.
	Client *http.Client
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// OnCheck, when set, is told each check's result (RevocationGood,
	// RevocationRevoked, RevocationUnavailable, RevocationSkipped).
	OnCheck func(result string)
	// OnFetch, when set, is told each CRL fetch's result ("ok" or
	// "error").
	OnFetch func(result string)
	// OnConnectionClosed, when set, is told each connection a Source
	// closed because a CRL revoked its peer's certificate.
	OnConnectionClosed func()
}

// RevokedCert is a certificate a new CRL lists.
type RevokedCert struct {
	// Issuer is the issuer's raw subject, as in x509.Certificate.RawIssuer
	// of the revoked certificate.
	Issuer []byte
	Serial *big.Int
	// RevokedAt and Reason are the CRL entry's (reason: RFC 5280 code).
	RevokedAt time.Time
	Reason    int
}

// Matches reports whether c is this revoked certificate.
func (r RevokedCert) Matches(c *x509.Certificate) bool {
	return c != nil && c.SerialNumber.Cmp(r.Serial) == 0 && bytes.Equal(c.RawIssuer, r.Issuer)
}

// RevocationChecker enforces revocation: Check asks a certificate's CRL or
// OCSP responder (cached), and Run keeps the cached CRLs fresh and tells
// OnRevoked's callbacks about certificates a new CRL lists. It is safe for
// concurrent use.
type RevocationChecker struct {
	mu     sync.Mutex
	cfg    RevocationConfig
	client *http.Client
	logger *slog.Logger
	crls   map[string]*crlEntry
	ocsps  map[string]*ocspEntry
	cbs    []func([]RevokedCert)
	// kick wakes Run when a CRL is cached for the first time.
	kick chan struct{}
	// allowLogs rate-limits the lines about statuses allowed unknown
	// (one per handshake otherwise); the failed fetches are logged too.
	allowLogs *rate.Limiter

	flight singleflight.Group
}

// crlEntry is one CRL distribution point of one issuer.
type crlEntry struct {
	url    string
	issuer *x509.Certificate
	crl    *x509.RevocationList // nil until one was fetched
	// revoked: the serials of crl (decimal string → entry).
	revoked   map[string]x509.RevocationListEntry
	fetchedAt time.Time
	failedAt  time.Time
	failure   error
}

// ocspEntry is an OCSP answer for one certificate.
type ocspEntry struct {
	url          string
	leaf, issuer *x509.Certificate
	resp         *ocsp.Response
	fetchedAt    time.Time
	failedAt     time.Time
	failure      error
}

// NewRevocationChecker returns a checker for cfg (see RevocationConfig for
// the defaults); the mode and policy must be known values.
func NewRevocationChecker(cfg RevocationConfig) (*RevocationChecker, error) {
	r := &RevocationChecker{crls: map[string]*crlEntry{}, ocsps: map[string]*ocspEntry{}, kick: make(chan struct{}, 1),
		allowLogs: rate.NewLimiter(rate.Every(10*time.Second), 1)}
	if err := r.SetConfig(cfg); err != nil {
		return nil, err
	}
	return r, nil
}

// SetConfig changes the mode, policy and refresh of a running checker (a
// configuration reload); the caches stay.
func (r *RevocationChecker) SetConfig(cfg RevocationConfig) error {
	if cfg.Mode == "" {
		cfg.Mode = RevocationBoth
	}
	if cfg.OnUnavailable == "" {
		cfg.OnUnavailable = RevocationAllow
	}
	switch cfg.Mode {
	case RevocationCRL, RevocationOCSP, RevocationBoth, RevocationOff:
	default:
		return fmt.Errorf("revocation mode %q: must be crl, ocsp, both or off", cfg.Mode)
	}
	switch cfg.OnUnavailable {
	case RevocationAllow, RevocationDeny:
	default:
		return fmt.Errorf("revocation on_unavailable %q: must be allow or deny", cfg.OnUnavailable)
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = DefaultRevocationRefresh
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultRevocationTimeout
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	client := cfg.Client
	if client == nil {
		client = &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{
			Proxy: http.ProxyFromEnvironment, MaxIdleConnsPerHost: 2, IdleConnTimeout: time.Minute,
			ResponseHeaderTimeout: cfg.Timeout, TLSHandshakeTimeout: cfg.Timeout,
		}}
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r.mu.Lock()
	r.cfg, r.client, r.logger = cfg, client, logger.With("component", "tls")
	r.mu.Unlock()
	return nil
}

func (r *RevocationChecker) config() (RevocationConfig, *http.Client, *slog.Logger) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg, r.client, r.logger
}

// Mode is the mode in force.
func (r *RevocationChecker) Mode() string {
	cfg, _, _ := r.config()
	return cfg.Mode
}

// OnRevoked registers fn, called with the certificates a refreshed CRL
// lists that its previous version did not, or that a refreshed OCSP answer
// reports revoked where the previous did not.
func (r *RevocationChecker) OnRevoked(fn func([]RevokedCert)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cbs = append(r.cbs, fn)
}

// Check checks chain — a verified chain, leaf first, then its issuer — for
// revocation of the leaf. nil: not revoked (or nothing to ask, or unknown
// under "allow"); otherwise an error wrapping ErrRevoked or, under
// "deny", ErrRevocationUnavailable.
func (r *RevocationChecker) Check(chain []*x509.Certificate) error {
	return r.CheckStapled(chain, nil)
}

// CheckStapled is Check with an OCSP response the peer stapled (TLS
// ConnectionState.OCSPResponse): a valid one answers instead of asking.
func (r *RevocationChecker) CheckStapled(chain []*x509.Certificate, staple []byte) error {
	cfg, _, logger := r.config()
	result, err := r.status(cfg, chain, staple)
	if cfg.OnCheck != nil {
		cfg.OnCheck(result)
	}
	switch result {
	case RevocationRevoked:
		return err
	case RevocationUnavailable:
		if cfg.OnUnavailable == RevocationDeny {
			return fmt.Errorf("%w for certificate %s (serial %s): %w", ErrRevocationUnavailable, chain[0].Subject, SerialHex(chain[0].SerialNumber), err)
		}
		if !r.allowLogs.Allow() {
			return nil
		}
		logger.Warn("tls: revocation status unavailable; allowed (tls.revocation.on_unavailable: allow)",
			"serial", SerialHex(chain[0].SerialNumber), "subject", chain[0].Subject.String(), "error", err)
	}
	return nil
}

// status finds the leaf's status: a result and, unless good or skipped,
// why.
func (r *RevocationChecker) status(cfg RevocationConfig, chain []*x509.Certificate, staple []byte) (string, error) {
	if cfg.Mode == RevocationOff || len(chain) < 2 {
		return RevocationSkipped, nil
	}
	leaf, issuer := chain[0], chain[1]
	// One deadline for the whole check: a handshake waits at most the
	// HTTP timeout, whatever it asks (a fetch it gives up on goes on and
	// fills the cache).
	deadline := time.Now().Add(cfg.Timeout)
	// A stapled answer is the peer's choice of answer: one that says
	// revoked decides; one that says good only stands in when neither the
	// CRL nor the responder answers, so that an old "good" answer (OCSP is
	// unauthenticated HTTP: anyone may keep one until its NextUpdate)
	// never outlives a revocation the CRL or the responder already tells.
	var stapledGood bool
	if len(staple) > 0 {
		if resp, err := r.parseOCSP(cfg, staple, leaf, issuer); err == nil {
			switch resp.Status {
			case ocsp.Revoked:
				return ocspResult(leaf, resp)
			case ocsp.Good:
				stapledGood = true
			}
		}
	}
	dps, responders := httpURLs(leaf.CRLDistributionPoints), httpURLs(leaf.OCSPServer)
	useCRL := cfg.Mode != RevocationOCSP && len(dps) > 0
	useOCSP := cfg.Mode != RevocationCRL && len(responders) > 0
	if !useCRL && !useOCSP {
		if stapledGood {
			return RevocationGood, nil
		}
		return RevocationSkipped, nil
	}
	var errs []error
	if useCRL {
		for _, u := range dps {
			e, err := r.crl(cfg, issuer, u, deadline)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if rc, ok := e.revoked[leaf.SerialNumber.String()]; ok {
				return RevocationRevoked, revokedError(leaf, rc.RevocationTime, rc.ReasonCode, "CRL "+u)
			}
			return RevocationGood, nil
		}
	}
	if useOCSP {
		for _, u := range responders {
			resp, err := r.ocsp(cfg, leaf, issuer, u, deadline)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			res, err := ocspResult(leaf, resp)
			if res == RevocationUnavailable {
				errs = append(errs, fmt.Errorf("OCSP %s: %w", u, err))
				continue
			}
			return res, err
		}
	}
	if stapledGood {
		return RevocationGood, nil
	}
	return RevocationUnavailable, errors.Join(errs...)
}

func ocspResult(leaf *x509.Certificate, resp *ocsp.Response) (string, error) {
	switch resp.Status {
	case ocsp.Good:
		return RevocationGood, nil
	case ocsp.Revoked:
		return RevocationRevoked, revokedError(leaf, resp.RevokedAt, resp.RevocationReason, "OCSP")
	default:
		return RevocationUnavailable, errors.New("the responder does not know the certificate (status unknown)")
	}
}

// revokedError names the revoked certificate, when and why.
func revokedError(leaf *x509.Certificate, at time.Time, reason int, source string) error {
	return fmt.Errorf("%w: serial %s (%s) revoked on %s, reason %s (%s)", ErrRevoked, SerialHex(leaf.SerialNumber),
		leaf.Subject, at.UTC().Format(time.RFC3339), ReasonText(reason), source)
}

// SerialHex writes a serial number as openssl does: upper-case hex
// (an even number of digits).
func SerialHex(n *big.Int) string {
	if n == nil {
		return ""
	}
	s := strings.ToUpper(n.Text(16))
	if len(s)%2 == 1 {
		s = "0" + s
	}
	return s
}

// ReasonText names an RFC 5280 revocation reason code.
func ReasonText(code int) string {
	names := map[int]string{0: "unspecified", 1: "keyCompromise", 2: "cACompromise", 3: "affiliationChanged", 4: "superseded",
		5: "cessationOfOperation", 6: "certificateHold", 8: "removeFromCRL", 9: "privilegeWithdrawn", 10: "aACompromise"}
	if n, ok := names[code]; ok {
		return n
	}
	return fmt.Sprintf("code %d", code)
}

// httpURLs keeps the http:// URLs (a CRL or OCSP fetch over https would
// need revocation checking itself).
func httpURLs(urls []string) []string {
	var out []string
	for _, u := range urls {
		if p, err := url.Parse(u); err == nil && p.Scheme == "http" && p.Host != "" {
			out = append(out, u)
		}
	}
	return out
}

// issuerKey identifies an issuer by its subject and key.
func issuerKey(issuer *x509.Certificate) string {
	h := sha256.New()
	h.Write(issuer.RawSubject)
	h.Write(issuer.RawSubjectPublicKeyInfo)
	return string(h.Sum(nil))
}

// failRetry is how long a failed fetch is remembered before it is tried
// again: handshakes do not each wait for an unreachable server.
func failRetry(cfg RevocationConfig) time.Duration {
	return min(cfg.Refresh, 5*time.Second)
}

// crl returns a usable (verified, not past NextUpdate) CRL of issuer at u:
// the cached one when fetched within Refresh, else a new fetch (the cached
// one while still valid if that fails).
func (r *RevocationChecker) crl(cfg RevocationConfig, issuer *x509.Certificate, u string, deadline time.Time) (*crlEntry, error) {
	key := issuerKey(issuer) + "\x00" + u
	now := cfg.Now()
	r.mu.Lock()
	e := r.crls[key]
	if e == nil {
		e = &crlEntry{url: u, issuer: issuer}
		r.crls[key] = e
		select {
		case r.kick <- struct{}{}:
		default:
		}
	}
	usable := e.crl != nil && crlUsable(e.crl, now)
	fresh := usable && now.Sub(e.fetchedAt) < cfg.Refresh
	recentFail := !e.failedAt.IsZero() && now.Sub(e.failedAt) < failRetry(cfg) && e.failedAt.After(e.fetchedAt)
	snap := *e
	if usable && !fresh {
		// Run refreshes it (each refresh, or now): a handshake never
		// waits for a CA server that does not answer while the CRL it
		// has is still valid.
		select {
		case r.kick <- struct{}{}:
		default:
		}
	}
	r.mu.Unlock()
	if usable {
		return &snap, nil
	}
	var err error
	if recentFail {
		err = snap.failure
	} else {
		if err = r.fetchCRL(key, deadline); errors.Is(err, errNoAnswer) {
			err = fmt.Errorf("CRL %s: %w", u, err)
		}
	}
	r.mu.Lock()
	snap = *e
	r.mu.Unlock()
	if snap.crl != nil && crlUsable(snap.crl, cfg.Now()) {
		return &snap, nil
	}
	if err == nil && snap.crl != nil {
		err = fmt.Errorf("CRL %s: past its next update (%s)", u, snap.crl.NextUpdate.UTC().Format(time.RFC3339))
	} else if err == nil {
		err = fmt.Errorf("CRL %s: not fetched", u)
	}
	return nil, err
}

// crlUsable: not past its NextUpdate, not from the future.
func crlUsable(c *x509.RevocationList, now time.Time) bool {
	if !c.NextUpdate.IsZero() && now.After(c.NextUpdate) {
		return false
	}
	return !c.ThisUpdate.After(now.Add(5 * time.Minute))
}

// fetchCRL fetches the CRL of entry key once however many ask at the same
// time, verifies it and installs it; newly revoked serials go to the
// callbacks.
func (r *RevocationChecker) fetchCRL(key string, deadline time.Time) error {
	_, err, _ := r.doFlight("crl\x00"+key, deadline, func() (any, error) {
		cfg, client, logger := r.config()
		r.mu.Lock()
		e := r.crls[key]
		r.mu.Unlock()
		if e == nil {
			return nil, nil
		}
		crl, err := r.getCRL(cfg, client, e.url, e.issuer)
		if cfg.OnFetch != nil {
			if err != nil {
				cfg.OnFetch("error")
			} else {
				cfg.OnFetch("ok")
			}
		}
		r.mu.Lock()
		if err != nil {
			e.failedAt, e.failure = cfg.Now(), err
			r.mu.Unlock()
			logger.Warn("tls: fetching a CRL failed", "url", e.url, "error", err)
			return nil, err
		}
		if e.crl != nil && crl.Number != nil && e.crl.Number != nil && crl.Number.Cmp(e.crl.Number) < 0 {
			e.fetchedAt = cfg.Now()
			r.mu.Unlock()
			return nil, nil // an older CRL (a lagging mirror): keep the newer
		}
		revoked := make(map[string]x509.RevocationListEntry, len(crl.RevokedCertificateEntries))
		var added []RevokedCert
		for _, rc := range crl.RevokedCertificateEntries {
			s := rc.SerialNumber.String()
			revoked[s] = rc
			// The first CRL hands every entry over too: a peer let in while
			// no CRL could be had (on_unavailable: allow) may be listed.
			if _, known := e.revoked[s]; !known {
				added = append(added, RevokedCert{Issuer: e.issuer.RawSubject, Serial: rc.SerialNumber, RevokedAt: rc.RevocationTime, Reason: rc.ReasonCode})
			}
		}
		first := e.crl == nil
		e.crl, e.revoked, e.fetchedAt, e.failedAt, e.failure = crl, revoked, cfg.Now(), time.Time{}, nil
		cbs := append([]func([]RevokedCert){}, r.cbs...)
		r.mu.Unlock()
		if len(added) > 0 {
			for _, a := range added {
				if first {
					break // the CRL's whole list, not news
				}
				logger.Warn("tls: a CRL lists a newly revoked certificate", "serial", SerialHex(a.Serial), "revoked_at", a.RevokedAt.UTC().Format(time.RFC3339), "reason", ReasonText(a.Reason), "url", e.url)
			}
			for _, cb := range cbs {
				cb(added)
			}
		}
		return nil, nil
	})
	return err
}

// getCRL downloads and verifies the CRL at u, signed by issuer.
func (r *RevocationChecker) getCRL(cfg RevocationConfig, client *http.Client, u string, issuer *x509.Certificate) (*x509.RevocationList, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("CRL %s: %w", u, err)
	}
	body, err := do(client, req)
	if err != nil {
		return nil, fmt.Errorf("CRL %s: %w", u, err)
	}
	crl, err := x509.ParseRevocationList(body)
	if err != nil {
		return nil, fmt.Errorf("CRL %s: %w", u, err)
	}
	if err := crl.CheckSignatureFrom(issuer); err != nil {
		return nil, fmt.Errorf("CRL %s is not signed by %s: %w", u, issuer.Subject, err)
	}
	now := cfg.Now()
	if !crlUsable(crl, now) {
		return nil, fmt.Errorf("CRL %s is stale (this update %s, next update %s)", u,
			crl.ThisUpdate.UTC().Format(time.RFC3339), crl.NextUpdate.UTC().Format(time.RFC3339))
	}
	return crl, nil
}

// do sends req and reads a 200 answer's body.
func do(client *http.Client, req *http.Request) ([]byte, error) {
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %s", resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxRevocationBody+1))
	if err != nil {
		return nil, err
	}
	if len(body) > maxRevocationBody {
		return nil, fmt.Errorf("answer larger than %d bytes", maxRevocationBody)
	}
	return body, nil
}

// ocsp returns an OCSP answer for leaf from responder u: the cached one
// until its NextUpdate or Refresh, whichever comes first.
func (r *RevocationChecker) ocsp(cfg RevocationConfig, leaf, issuer *x509.Certificate, u string, deadline time.Time) (*ocsp.Response, error) {
	key := issuerKey(issuer) + "\x00" + leaf.SerialNumber.String() + "\x00" + u
	now := cfg.Now()
	r.mu.Lock()
	e := r.ocsps[key]
	if e == nil {
		e = &ocspEntry{url: u, leaf: leaf, issuer: issuer}
		r.ocsps[key] = e
	}
	resp, fetchedAt, failedAt, failure := e.resp, e.fetchedAt, e.failedAt, e.failure
	r.mu.Unlock()
	if resp != nil && now.Sub(fetchedAt) < cfg.Refresh && ocspUsable(resp, now) {
		return resp, nil
	}
	if !failedAt.IsZero() && failedAt.After(fetchedAt) && now.Sub(failedAt) < failRetry(cfg) {
		return nil, failure
	}
	v, err := r.fetchOCSPEntry(key, e, deadline)
	if errors.Is(err, errNoAnswer) {
		return nil, fmt.Errorf("OCSP %s: %w", u, err)
	}
	if err != nil {
		return nil, err
	}
	return v.(*ocsp.Response), nil
}

// fetchOCSPEntry asks e's responder once however many ask at the same
// time and caches the answer; a certificate it newly reports revoked goes
// to the callbacks.
func (r *RevocationChecker) fetchOCSPEntry(key string, e *ocspEntry, deadline time.Time) (any, error) {
	v, err, _ := r.doFlight("ocsp\x00"+key, deadline, func() (any, error) {
		resp, err := r.FetchOCSP(e.leaf, e.issuer, e.url)
		cfg, _, logger := r.config()
		r.mu.Lock()
		if err != nil {
			e.failedAt, e.failure = cfg.Now(), err
			r.mu.Unlock()
			return nil, err
		}
		newly := resp.Status == ocsp.Revoked && (e.resp == nil || e.resp.Status != ocsp.Revoked)
		e.resp, e.fetchedAt, e.failedAt, e.failure = resp, cfg.Now(), time.Time{}, nil
		cbs := append([]func([]RevokedCert){}, r.cbs...)
		r.mu.Unlock()
		if newly {
			rc := RevokedCert{Issuer: e.leaf.RawIssuer, Serial: e.leaf.SerialNumber, RevokedAt: resp.RevokedAt, Reason: resp.RevocationReason}
			logger.Warn("tls: the OCSP responder reports a newly revoked certificate", "serial", SerialHex(rc.Serial),
				"revoked_at", rc.RevokedAt.UTC().Format(time.RFC3339), "reason", ReasonText(rc.Reason), "url", e.url)
			for _, cb := range cbs {
				cb([]RevokedCert{rc})
			}
		}
		return resp, nil
	})
	return v, err
}

// doFlight runs fn once for all callers of key at the same time, waiting
// until deadline at most.
func (r *RevocationChecker) doFlight(key string, deadline time.Time, fn func() (any, error)) (any, error, bool) {
	ch := r.flight.DoChan(key, fn)
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case res := <-ch:
		return res.Val, res.Err, res.Shared
	case <-t.C:
		return nil, errNoAnswer, false
	}
}

// ocspUsable: within its validity.
func ocspUsable(resp *ocsp.Response, now time.Time) bool {
	if !resp.NextUpdate.IsZero() && now.After(resp.NextUpdate) {
		return false
	}
	return !resp.ThisUpdate.After(now.Add(5 * time.Minute))
}

// FetchOCSP asks responder u for leaf's status and verifies the answer:
// signed by issuer or by a certificate issuer gave the OCSP-signing usage
// to, within its validity. It is also how a server fetches its own staple.
func (r *RevocationChecker) FetchOCSP(leaf, issuer *x509.Certificate, u string) (*ocsp.Response, error) {
	cfg, client, _ := r.config()
	reqDER, err := ocsp.CreateRequest(leaf, issuer, nil)
	if err != nil {
		return nil, fmt.Errorf("OCSP request for %s: %w", SerialHex(leaf.SerialNumber), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(reqDER))
	if err != nil {
		return nil, fmt.Errorf("OCSP %s: %w", u, err)
	}
	req.Header.Set("Content-Type", "application/ocsp-request")
	req.Header.Set("Accept", "application/ocsp-response")
	body, err := do(client, req)
	if err != nil {
		return nil, fmt.Errorf("OCSP %s: %w", u, err)
	}
	resp, err := r.parseOCSP(cfg, body, leaf, issuer)
	if err != nil {
		return nil, fmt.Errorf("OCSP %s: %w", u, err)
	}
	return resp, nil
}

// parseOCSP parses and verifies an OCSP response for leaf. x/crypto/ocsp
// checks the signatures (the response's, and the delegated responder
// certificate's by issuer); the responder's usage and validity, and the
// response's, are checked here.
func (r *RevocationChecker) parseOCSP(cfg RevocationConfig, der []byte, leaf, issuer *x509.Certificate) (*ocsp.Response, error) {
	resp, err := ocsp.ParseResponseForCert(der, leaf, issuer)
	if err != nil {
		return nil, err
	}
	now := cfg.Now()
	if c := resp.Certificate; c != nil && !bytes.Equal(c.Raw, issuer.Raw) {
		ok := false
		for _, u := range c.ExtKeyUsage {
			ok = ok || u == x509.ExtKeyUsageOCSPSigning
		}
		if !ok {
			return nil, fmt.Errorf("the responder certificate %q lacks the OCSP-signing usage", c.Subject)
		}
		if now.Before(c.NotBefore) || now.After(c.NotAfter) {
			return nil, fmt.Errorf("the responder certificate %q is not valid now (%s to %s)", c.Subject,
				c.NotBefore.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	if !ocspUsable(resp, now) {
		return nil, fmt.Errorf("the response is stale (this update %s, next update %s)",
			resp.ThisUpdate.UTC().Format(time.RFC3339), resp.NextUpdate.UTC().Format(time.RFC3339))
	}
	return resp, nil
}

// Run refreshes every cached CRL and OCSP answer each Refresh (sooner at
// its NextUpdate), which calls the OnRevoked callbacks with newly revoked
// certificates, and forgets OCSP answers for certificates that expired,
// until ctx ends.
func (r *RevocationChecker) Run(ctx context.Context) {
	for {
		cfg, _, _ := r.config()
		wait := cfg.Refresh
		now := cfg.Now()
		r.mu.Lock()
		var due []string
		for k, e := range r.crls {
			next := e.fetchedAt.Add(cfg.Refresh)
			if e.crl != nil && !e.crl.NextUpdate.IsZero() && e.crl.NextUpdate.Before(next) {
				next = e.crl.NextUpdate
			}
			if e.failedAt.After(e.fetchedAt) {
				if retry := e.failedAt.Add(failRetry(cfg)); retry.After(next) {
					next = retry
				}
			}
			if !now.Before(next) {
				due = append(due, k)
			} else {
				wait = min(wait, next.Sub(now))
			}
		}
		// Certificates an OCSP responder answered for are asked again,
		// so that the connections of one revoked meanwhile are closed
		// in "ocsp" mode too; forgotten once expired.
		dueOCSP := map[string]*ocspEntry{}
		for k, e := range r.ocsps {
			if now.After(e.leaf.NotAfter) {
				delete(r.ocsps, k)
				continue
			}
			if e.resp == nil {
				continue
			}
			next := e.fetchedAt.Add(cfg.Refresh)
			if !e.resp.NextUpdate.IsZero() && e.resp.NextUpdate.Before(next) {
				next = e.resp.NextUpdate
			}
			if e.failedAt.After(e.fetchedAt) {
				if retry := e.failedAt.Add(failRetry(cfg)); retry.After(next) {
					next = retry
				}
			}
			if !now.Before(next) {
				dueOCSP[k] = e
			} else {
				wait = min(wait, next.Sub(now))
			}
		}
		r.mu.Unlock()
		if cfg.Mode != RevocationOff {
			var wg sync.WaitGroup
			for _, k := range due {
				wg.Go(func() { _ = r.fetchCRL(k, time.Now().Add(2*cfg.Timeout)) })
			}
			for k, e := range dueOCSP {
				wg.Go(func() { _, _ = r.fetchOCSPEntry(k, e, time.Now().Add(2*cfg.Timeout)) })
			}
			wg.Wait()
		}
		if len(due) > 0 || len(dueOCSP) > 0 {
			wait = min(wait, cfg.Refresh)
		}
		t := time.NewTimer(max(wait, 100*time.Millisecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-r.kick:
		case <-t.C:
		}
		t.Stop()
	}
}
