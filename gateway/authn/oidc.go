// Package authn authenticates callers of the gateway: OIDC bearer tokens
// verified against the issuer's keys, or client certificates of the
// PiTrust chain.
package authn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"github.com/go-jose/go-jose/v4"
	"golang.org/x/time/rate"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// DefaultAlgorithms are the signature algorithms accepted by default:
// asymmetric ones only ("none" and HMAC never are).
var DefaultAlgorithms = []string{oidc.RS256, oidc.RS384, oidc.RS512, oidc.ES256, oidc.ES384, oidc.ES512, oidc.PS256, oidc.PS384, oidc.PS512, oidc.EdDSA}

// ErrUnauthenticated wraps every refusal of a credential; the message says
// why.
var ErrUnauthenticated = errors.New("unauthenticated")

// OIDCConfig configures token verification (auth.oidc).
type OIDCConfig struct {
	// IssuerURL is discovered (/.well-known/openid-configuration) for the
	// JWKS URL; tokens must carry it as iss.
	IssuerURL string
	// ClientID must be in a token's aud.
	ClientID string
	// Algorithms allowed; empty: DefaultAlgorithms. Symmetric and "none"
	// algorithms are refused whatever this says.
	Algorithms []string
	// IdentityClaim and RolesClaim are dotted claim paths: the principal's
	// identity (default "sub") and roles (default "roles"; a list of
	// strings, or one string of space- or comma-separated roles), e.g.
	// "preferred_username" and "realm_access.roles" for Keycloak.
	IdentityClaim, RolesClaim string
	// RefetchInterval bounds how often the JWKS is fetched again for a
	// token whose key is unknown (default 30 s).
	RefetchInterval time.Duration
	// HTTPClient fetches discovery and keys; nil: a client with a 10 s
	// timeout.
	HTTPClient *http.Client
	// Now is the clock of expiry checks; nil: time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

// OIDC verifies bearer tokens.
type OIDC struct {
	cfg      OIDCConfig
	verifier *oidc.IDTokenVerifier
	keys     *keySet
}

// NewOIDC discovers the issuer and fetches its keys.
func NewOIDC(ctx context.Context, cfg OIDCConfig) (*OIDC, error) {
	if cfg.ClientID == "" {
		return nil, errors.New("auth.oidc.client_id: required")
	}
	if len(cfg.Algorithms) == 0 {
		cfg.Algorithms = DefaultAlgorithms
	}
	for _, a := range cfg.Algorithms {
		if !slices.Contains(DefaultAlgorithms, a) {
			return nil, fmt.Errorf("auth.oidc: signature algorithm %q is not allowed (allowed: %s)", a, strings.Join(DefaultAlgorithms, ", "))
		}
	}
	if cfg.IdentityClaim == "" {
		cfg.IdentityClaim = "sub"
	}
	if cfg.RolesClaim == "" {
		cfg.RolesClaim = "roles"
	}
	if cfg.RefetchInterval <= 0 {
		cfg.RefetchInterval = 30 * time.Second
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{Timeout: 10 * time.Second}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	ctx = oidc.ClientContext(ctx, cfg.HTTPClient)
	provider, err := oidc.NewProvider(ctx, cfg.IssuerURL)
	if err != nil {
		return nil, fmt.Errorf("auth.oidc.issuer_url %s: discovery: %w", cfg.IssuerURL, err)
	}
	var meta struct {
		JWKSURL string `json:"jwks_uri"`
	}
	if err := provider.Claims(&meta); err != nil || meta.JWKSURL == "" {
		return nil, fmt.Errorf("auth.oidc.issuer_url %s: discovery names no jwks_uri", cfg.IssuerURL)
	}
	ks := &keySet{url: meta.JWKSURL, client: cfg.HTTPClient, algs: cfg.Algorithms, limiter: rate.NewLimiter(rate.Every(cfg.RefetchInterval), 1), logger: cfg.Logger}
	if err := ks.refresh(ctx); err != nil {
		return nil, fmt.Errorf("auth.oidc: %w", err)
	}
	ks.limiter.Allow() // the fetch above counts
	o := &OIDC{cfg: cfg, keys: ks}
	o.verifier = oidc.NewVerifier(cfg.IssuerURL, ks, &oidc.Config{ClientID: cfg.ClientID, SupportedSigningAlgs: cfg.Algorithms, Now: cfg.Now})
	return o, nil
}

// Verify checks a bearer token and returns its principal.
func (o *OIDC) Verify(ctx context.Context, raw string) (authz.Principal, error) {
	tok, err := o.verifier.Verify(oidc.ClientContext(ctx, o.cfg.HTTPClient), raw)
	if err != nil {
		return authz.Principal{}, fmt.Errorf("%w: bearer token: %v", ErrUnauthenticated, err)
	}
	var claims map[string]any
	if err := tok.Claims(&claims); err != nil {
		return authz.Principal{}, fmt.Errorf("%w: bearer token claims: %v", ErrUnauthenticated, err)
	}
	id, _ := claim(claims, o.cfg.IdentityClaim).(string)
	if id == "" {
		return authz.Principal{}, fmt.Errorf("%w: bearer token has no %q claim to name the caller", ErrUnauthenticated, o.cfg.IdentityClaim)
	}
	return authz.Principal{Identity: id, Roles: roles(claim(claims, o.cfg.RolesClaim)), Expiry: tok.Expiry}, nil
}

// claim follows a dotted path through nested claim objects.
func claim(claims map[string]any, path string) any {
	var v any = claims
	for _, k := range strings.Split(path, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// roles reads a roles claim: a list of strings, or one string of roles
// separated by spaces or commas.
func roles(v any) []string {
	var out []string
	switch r := v.(type) {
	case []any:
		for _, x := range r {
			if s, ok := x.(string); ok && roleName.MatchString(s) {
				out = append(out, s)
			}
		}
	case string:
		for _, s := range strings.FieldsFunc(r, func(c rune) bool { return c == ' ' || c == ',' }) {
			if roleName.MatchString(s) {
				out = append(out, s)
			}
		}
	}
	return out
}

// roleName is what a role may be: a list element "x,admin" must not
// become the role admin where roles travel comma-separated (to backends,
// in x-pivirt-roles), so such a role is dropped.
var roleName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$`)

// keySet is the issuer's JWKS, fetched again for an unknown key ID at
// most once per RefetchInterval (go-oidc's remote key set would fetch on
// every token with an unknown kid, which a caller can choose).
type keySet struct {
	url     string
	client  *http.Client
	algs    []string
	limiter *rate.Limiter
	logger  *slog.Logger

	mu   sync.RWMutex
	keys jose.JSONWebKeySet
}

func (k *keySet) refresh(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.url, nil)
	if err != nil {
		return err
	}
	resp, err := k.client.Do(req)
	if err != nil {
		return fmt.Errorf("fetch JWKS %s: %w", k.url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("fetch JWKS %s: %w", k.url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch JWKS %s: %s", k.url, resp.Status)
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(body, &set); err != nil {
		return fmt.Errorf("JWKS %s: %w", k.url, err)
	}
	k.mu.Lock()
	k.keys = set
	k.mu.Unlock()
	k.logger.Info("OIDC keys fetched", "jwks_uri", k.url, "keys", len(set.Keys))
	return nil
}

// VerifySignature implements oidc.KeySet.
func (k *keySet) VerifySignature(ctx context.Context, raw string) ([]byte, error) {
	algs := make([]jose.SignatureAlgorithm, len(k.algs))
	for i, a := range k.algs {
		algs[i] = jose.SignatureAlgorithm(a)
	}
	jws, err := jose.ParseSignedCompact(raw, algs)
	if err != nil {
		return nil, fmt.Errorf("malformed or disallowed token: %w", err)
	}
	if len(jws.Signatures) != 1 {
		return nil, errors.New("a token carries exactly one signature")
	}
	kid := jws.Signatures[0].Header.KeyID
	keys := k.lookup(kid)
	if len(keys) == 0 {
		if !k.limiter.Allow() {
			return nil, fmt.Errorf("unknown key ID %q (the issuer's keys were fetched again recently)", kid)
		}
		if err := k.refresh(ctx); err != nil {
			return nil, err
		}
		if keys = k.lookup(kid); len(keys) == 0 {
			return nil, fmt.Errorf("unknown key ID %q", kid)
		}
	} else if payload, ok := verifyWith(jws, keys); ok {
		return payload, nil
	} else if kid != "" && k.limiter.Allow() {
		// A known key ID whose key does not verify: the issuer may have
		// replaced the key under the same ID. The keys are fetched again
		// (within the same budget as for unknown IDs) and the token
		// checked against what the issuer publishes now.
		if err := k.refresh(ctx); err != nil {
			return nil, err
		}
		keys = k.lookup(kid)
	} else {
		return nil, errors.New("signature does not verify")
	}
	if payload, ok := verifyWith(jws, keys); ok {
		return payload, nil
	}
	return nil, errors.New("signature does not verify")
}

// verifyWith verifies jws with the first of keys that does.
func verifyWith(jws *jose.JSONWebSignature, keys []jose.JSONWebKey) ([]byte, bool) {
	for _, key := range keys {
		if payload, err := jws.Verify(key); err == nil {
			return payload, true
		}
	}
	return nil, false
}

// lookup returns the keys for kid (every key when the token names none).
func (k *keySet) lookup(kid string) []jose.JSONWebKey {
	k.mu.RLock()
	defer k.mu.RUnlock()
	if kid == "" {
		return k.keys.Keys
	}
	return k.keys.Key(kid)
}

// Verifier verifies bearer tokens: *OIDC, or a *Discovery until it has one.
type Verifier interface {
	Verify(ctx context.Context, raw string) (authz.Principal, error)
}

// Discovery is an OIDC verifier whose issuer may be unreachable when the
// agent starts: it retries discovery in the background (backoff up to a
// minute) and refuses tokens, saying why, until it succeeds. An agent does
// not fail to start, nor stop serving certificate callers, because the
// identity provider is down.
type Discovery struct {
	issuer  string
	oidc    atomic.Pointer[OIDC]
	lastErr atomic.Pointer[error]
}

// Discover tries NewOIDC once now and, if that fails, again in the
// background until it succeeds or ctx ends; done is called when the
// background work ends.
func Discover(ctx context.Context, cfg OIDCConfig, done func()) *Discovery {
	d := &Discovery{issuer: cfg.IssuerURL}
	if d.try(ctx, cfg) {
		done()
		return d
	}
	go func() {
		defer done()
		wait := time.Second
		for {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			if d.try(ctx, cfg) {
				return
			}
			wait = min(2*wait, time.Minute)
		}
	}()
	return d
}

func (d *Discovery) try(ctx context.Context, cfg OIDCConfig) bool {
	o, err := NewOIDC(ctx, cfg)
	if err != nil {
		if cfg.Logger != nil {
			cfg.Logger.Warn("OIDC issuer not reachable; bearer tokens are refused until it is (retrying)", "issuer", cfg.IssuerURL, "error", err)
		}
		d.lastErr.Store(&err)
		return false
	}
	if cfg.Logger != nil && d.lastErr.Load() != nil {
		cfg.Logger.Info("OIDC issuer reached; bearer tokens are accepted", "issuer", cfg.IssuerURL)
	}
	d.oidc.Store(o)
	return true
}

// Ready reports whether the issuer has been discovered.
func (d *Discovery) Ready() bool { return d.oidc.Load() != nil }

// Verify implements Verifier.
func (d *Discovery) Verify(ctx context.Context, raw string) (authz.Principal, error) {
	if o := d.oidc.Load(); o != nil {
		return o.Verify(ctx, raw)
	}
	reason := "not tried yet"
	if e := d.lastErr.Load(); e != nil {
		reason = (*e).Error()
	}
	return authz.Principal{}, fmt.Errorf("%w: the OIDC issuer %s has not been reached yet, so bearer tokens cannot be verified: %s", ErrUnauthenticated, d.issuer, reason)
}
