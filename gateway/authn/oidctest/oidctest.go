// Package oidctest is a real OIDC issuer for tests: an HTTP server on
// 127.0.0.1 serving discovery and the JWKS of keys it generates, and
// tokens signed with them.
package oidctest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// Audience is the aud of Claims: the agent's auth.oidc.client_id in tests.
const Audience = "pivirt-agent"

// Issuer is an OIDC issuer; it counts JWKS fetches.
type Issuer struct {
	// URL is the issuer URL (auth.oidc.issuer_url).
	URL string

	srv     *httptest.Server
	mu      sync.Mutex
	keys    []jose.JSONWebKey // public keys served
	fetches atomic.Int64
}

// New starts an issuer, closed when the test ends.
func New(t testing.TB) *Issuer {
	t.Helper()
	is := &Issuer{}
	mux := http.NewServeMux()
	mux.HandleFunc("/.well-known/openid-configuration", func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{
			"issuer": is.URL, "jwks_uri": is.URL + "/keys",
			"id_token_signing_alg_values_supported": []string{"RS256", "ES256"},
		})
	})
	mux.HandleFunc("/keys", func(w http.ResponseWriter, _ *http.Request) {
		is.fetches.Add(1)
		is.mu.Lock()
		defer is.mu.Unlock()
		_ = json.NewEncoder(w).Encode(jose.JSONWebKeySet{Keys: is.keys})
	})
	is.srv = httptest.NewServer(mux)
	is.URL = is.srv.URL
	t.Cleanup(is.srv.Close)
	return is
}

// Fetches is how many times the JWKS was fetched.
func (is *Issuer) Fetches() int64 { return is.fetches.Load() }

// Key is a signing key of the issuer.
type Key struct {
	KID  string
	Alg  jose.SignatureAlgorithm
	Priv crypto.Signer
}

// NewKey generates a key (ES256: P-256, else RSA 2048); publish adds it to
// the JWKS.
func (is *Issuer) NewKey(t testing.TB, kid string, alg jose.SignatureAlgorithm, publish bool) Key {
	t.Helper()
	var priv crypto.Signer
	var err error
	if alg == jose.ES256 {
		priv, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	} else {
		priv, err = rsa.GenerateKey(rand.Reader, 2048)
	}
	if err != nil {
		t.Fatal(err)
	}
	if publish {
		is.mu.Lock()
		is.keys = append(is.keys, jose.JSONWebKey{Key: priv.Public(), KeyID: kid, Algorithm: string(alg), Use: "sig"})
		is.mu.Unlock()
	}
	return Key{KID: kid, Alg: alg, Priv: priv}
}

// Unpublish removes the keys of kid from the JWKS.
func (is *Issuer) Unpublish(kid string) {
	is.mu.Lock()
	defer is.mu.Unlock()
	is.keys = slices.DeleteFunc(is.keys, func(k jose.JSONWebKey) bool { return k.KeyID == kid })
}

// Sign makes a signed JWT of claims.
func (k Key) Sign(t testing.TB, claims map[string]any) string {
	t.Helper()
	s, err := jose.NewSigner(jose.SigningKey{Algorithm: k.Alg, Key: jose.JSONWebKey{Key: k.Priv, KeyID: k.KID}}, (&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := jwt.Signed(s).Claims(claims).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// Claims are valid claims for sub (an hour's lifetime, aud Audience, roles
// admin); mod changes them.
func (is *Issuer) Claims(sub string, mod func(map[string]any)) map[string]any {
	now := time.Now()
	c := map[string]any{"iss": is.URL, "aud": Audience, "sub": sub, "exp": now.Add(time.Hour).Unix(),
		"iat": now.Unix(), "nbf": now.Add(-time.Minute).Unix(), "roles": []string{"admin"}}
	if mod != nil {
		mod(c)
	}
	return c
}
