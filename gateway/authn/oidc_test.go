package authn

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"

	"pilab.hu/pivirt-agent/gateway/authn/oidctest"
)

type issuer = oidctest.Issuer

func newIssuer(t *testing.T) *issuer { return oidctest.New(t) }

func newOIDC(t *testing.T, is *issuer, mod func(*OIDCConfig)) *OIDC {
	t.Helper()
	cfg := OIDCConfig{IssuerURL: is.URL, ClientID: "pivirt-agent", RefetchInterval: time.Hour}
	if mod != nil {
		mod(&cfg)
	}
	o, err := NewOIDC(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

func TestOIDCVerify(t *testing.T) {
	is := newIssuer(t)
	rs := is.NewKey(t, "rs-1", jose.RS256, true)
	es := is.NewKey(t, "es-1", jose.ES256, true)
	o := newOIDC(t, is, nil)

	for _, k := range []oidctest.Key{rs, es} {
		exp := time.Now().Add(42 * time.Minute).Truncate(time.Second)
		p, err := o.Verify(t.Context(), k.Sign(t, is.Claims("alice", func(c map[string]any) { c["exp"] = exp.Unix() })))
		if err != nil || p.Identity != "alice" || len(p.Roles) != 1 || p.Roles[0] != "admin" || p.Certificate {
			t.Errorf("%s token: %+v, %v", k.Alg, p, err)
		}
		if !p.Expiry.Equal(exp) {
			t.Errorf("%s token: expiry %v, want the exp claim %v", k.Alg, p.Expiry, exp)
		}
	}

	good := rs.Sign(t, is.Claims("alice", nil))
	parts := strings.Split(good, ".")
	payload, _ := base64.RawURLEncoding.DecodeString(parts[1])
	tampered := parts[0] + "." + b64([]byte(strings.Replace(string(payload), `"alice"`, `"admin"`, 1))) + "." + parts[2]
	none := b64([]byte(`{"alg":"none","kid":"rs-1"}`)) + "." + parts[1] + "."
	// HS256 with the RSA public key (DER, as an attacker would fetch it)
	// as the HMAC secret.
	pubDER, _ := x509.MarshalPKIXPublicKey(rs.Priv.Public())
	hsHeader := b64([]byte(`{"alg":"HS256","kid":"rs-1","typ":"JWT"}`))
	mac := hmac.New(sha256.New, pubDER)
	mac.Write([]byte(hsHeader + "." + parts[1]))
	hs := hsHeader + "." + parts[1] + "." + b64(mac.Sum(nil))
	stranger := is.NewKey(t, "rs-9", jose.RS256, false)

	for name, tc := range map[string]struct {
		token string
		want  string
	}{
		"expired":        {rs.Sign(t, is.Claims("alice", func(c map[string]any) { c["exp"] = time.Now().Add(-time.Minute).Unix() })), "expired"},
		"not yet valid":  {rs.Sign(t, is.Claims("alice", func(c map[string]any) { c["nbf"] = time.Now().Add(10 * time.Minute).Unix() })), "before the nbf"},
		"wrong issuer":   {rs.Sign(t, is.Claims("alice", func(c map[string]any) { c["iss"] = "https://evil.example" })), "different provider"},
		"wrong audience": {rs.Sign(t, is.Claims("alice", func(c map[string]any) { c["aud"] = "someone-else" })), "expected audience"},
		"alg none":       {none, "unexpected signature algorithm"},
		"HS256 with key": {hs, "unexpected signature algorithm"},
		"unknown kid":    {stranger.Sign(t, is.Claims("alice", nil)), `unknown key ID "rs-9"`},
		"tampered":       {tampered, "signature"},
		"no identity":    {rs.Sign(t, is.Claims("", nil)), `no "sub" claim`},
		"not a token":    {"not.a.token", "malformed"},
		"empty":          {"", "malformed"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := o.Verify(t.Context(), tc.token)
			if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Verify = %v, want ErrUnauthenticated containing %q", err, tc.want)
			}
		})
	}
}

// TestOIDCKeyRefetch: an unknown key ID fetches the JWKS again, at most
// once per interval; a rotated-in key is then accepted.
func TestOIDCKeyRefetch(t *testing.T) {
	is := newIssuer(t)
	is.NewKey(t, "k1", jose.RS256, true)
	o := newOIDC(t, is, func(c *OIDCConfig) { c.RefetchInterval = time.Hour })
	if got := is.Fetches(); got != 1 {
		t.Fatalf("%d JWKS fetches at start, want 1", got)
	}
	stranger := is.NewKey(t, "k9", jose.RS256, false)
	for range 20 {
		if _, err := o.Verify(t.Context(), stranger.Sign(t, is.Claims("eve", nil))); err == nil {
			t.Fatal("a token of an unknown key was accepted")
		}
	}
	if got := is.Fetches(); got != 1 {
		t.Errorf("%d JWKS fetches after 20 tokens of unknown keys within the interval, want 1 (rate-limited)", got)
	}

	// Rotation: the issuer publishes a new key; the first token signed
	// with it fetches the keys again (the interval has passed).
	o2 := newOIDC(t, is, func(c *OIDCConfig) { c.RefetchInterval = time.Millisecond })
	k2 := is.NewKey(t, "k2", jose.ES256, true)
	token := k2.Sign(t, is.Claims("alice", nil))
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := o2.Verify(t.Context(), token)
		if err == nil && p.Identity == "alice" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a token of a rotated-in key is still refused: %v", err)
		}
	}
}

func TestClaimsMapping(t *testing.T) {
	is := newIssuer(t)
	k := is.NewKey(t, "k1", jose.RS256, true)
	o := newOIDC(t, is, func(c *OIDCConfig) { c.IdentityClaim, c.RolesClaim = "preferred_username", "realm_access.roles" })
	p, err := o.Verify(t.Context(), k.Sign(t, is.Claims("uuid-1", func(c map[string]any) {
		c["preferred_username"] = "alice"
		c["realm_access"] = map[string]any{"roles": []string{"vm-owner", "viewer"}}
	})))
	if err != nil || p.Identity != "alice" || strings.Join(p.Roles, ",") != "vm-owner,viewer" {
		t.Errorf("Keycloak-style claims: %+v, %v", p, err)
	}
	if got := roles("a b,c"); strings.Join(got, "|") != "a|b|c" {
		t.Errorf("roles of a string = %v", got)
	}
	if got := roles([]any{"viewer", "x,admin", "a b", "", 7}); strings.Join(got, "|") != "viewer" {
		t.Errorf("roles of a list with commas, spaces and non-strings = %v, want [viewer]", got)
	}
	if _, err := NewOIDC(t.Context(), OIDCConfig{IssuerURL: is.URL, ClientID: "x", Algorithms: []string{"HS256"}}); err == nil || !strings.Contains(err.Error(), `"HS256" is not allowed`) {
		t.Errorf("HS256 allowed by configuration: %v", err)
	}
	if _, err := NewOIDC(t.Context(), OIDCConfig{IssuerURL: is.URL + "/nope", ClientID: "x"}); err == nil || !strings.Contains(err.Error(), "discovery") {
		t.Errorf("a wrong issuer URL: %v", err)
	}
}

// TestOIDCKeyReplacedUnderItsID: the issuer replaces a key under the same
// key ID; a token of the new key fetches the JWKS again and is accepted,
// and tokens whose signature fails under a known ID fetch it at most once
// per interval.
func TestOIDCKeyReplacedUnderItsID(t *testing.T) {
	is := newIssuer(t)
	is.NewKey(t, "k1", jose.RS256, true)
	o := newOIDC(t, is, func(c *OIDCConfig) { c.RefetchInterval = time.Millisecond })
	is.Unpublish("k1")
	k1 := is.NewKey(t, "k1", jose.ES256, true)
	token := k1.Sign(t, is.Claims("alice", nil))
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := o.Verify(t.Context(), token)
		if err == nil && p.Identity == "alice" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a token of the key replaced under k1 is still refused: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // the refetch interval
	}

	o = newOIDC(t, is, func(c *OIDCConfig) { c.RefetchInterval = time.Hour })
	before := is.Fetches()
	forger := oidctest.Key{KID: "k1", Alg: jose.ES256, Priv: is.NewKey(t, "other", jose.ES256, false).Priv}
	for range 20 {
		if _, err := o.Verify(t.Context(), forger.Sign(t, is.Claims("eve", nil))); err == nil {
			t.Fatal("a token signed by another key under k1 was accepted")
		}
	}
	if got := is.Fetches() - before; got != 0 {
		t.Errorf("%d JWKS fetches after 20 bad signatures under a known ID within the interval, want none past the start", got)
	}
}
