// Package devoidc is a local OpenID Connect issuer for development: its
// signing key lives in a directory (the dev PKI's), tokens are minted with
// that key offline (pitrust dev-token), from its token endpoint (client
// credentials with the directory's secret), or through its authorization
// endpoint (authorization code with PKCE, for a browser page on loopback,
// the secret as the login password), and the issuer serves the discovery
// document and the JWKS on 127.0.0.1 so that an agent's auth.oidc can point
// at it. It is never a production identity provider: it listens on loopback
// only, redirects to loopback pages only, and its tokens are short-lived.
package devoidc

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// Files of the issuer in its directory.
const (
	// KeyFile is the signing key (ECDSA P-256, PKCS#8 PEM, 0600).
	KeyFile = "dev-oidc.key"
	// SecretFile is the client secret of the token endpoint and the
	// password of the authorization endpoint's login form (0600).
	SecretFile = "dev-oidc.secret"
	// IssuerFile holds the URL of the issuer that last served from the
	// directory, for minting offline with the matching iss.
	IssuerFile = "dev-oidc.issuer"
)

// Claims and lifetimes of the tokens.
const (
	// Audience is the tokens' aud and the token endpoint's client ID: the
	// agent's auth.oidc.client_id.
	Audience = "pivirt-agent"
	// RolesClaim is the claim listing the roles (auth.oidc.roles_claim's
	// default); the identity is sub.
	RolesClaim = "roles"
	// DefaultTTL and MaxTTL bound a token's lifetime.
	DefaultTTL = time.Hour
	MaxTTL     = 12 * time.Hour
	// Marker is a field of the discovery document, true: how a client
	// (pvcli login) tells the development issuer from a real one.
	Marker = "pivirt_dev_issuer"
)

// ErrInvalid wraps every refusal of a token request; the message says why.
var ErrInvalid = errors.New("invalid token request")

// roleName is what the agent accepts as a role (gateway/authn drops
// others): a role it would drop is refused here, where the user sees it.
var roleName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$`)

// Key is the issuer's signing key with its key ID (the JWK thumbprint).
type Key struct {
	Priv *ecdsa.PrivateKey
	KID  string
}

// LoadKey reads the signing key of dir.
func LoadKey(dir string) (Key, error) {
	path := filepath.Join(dir, KeyFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return Key{}, fmt.Errorf("dev OIDC key: %w", err)
	}
	block, _ := pem.Decode(b)
	if block == nil || block.Type != "PRIVATE KEY" {
		return Key{}, fmt.Errorf("dev OIDC key %s: not a PEM PRIVATE KEY", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return Key{}, fmt.Errorf("dev OIDC key %s: %w", path, err)
	}
	priv, ok := k.(*ecdsa.PrivateKey)
	if !ok || priv.Curve != elliptic.P256() {
		return Key{}, fmt.Errorf("dev OIDC key %s: not an ECDSA P-256 key", path)
	}
	return newKey(priv)
}

// LoadOrCreateKey reads the signing key of dir, making it (and the token
// endpoint's secret) first when there is none.
func LoadOrCreateKey(dir string) (Key, error) {
	if _, err := os.Stat(filepath.Join(dir, KeyFile)); errors.Is(err, fs.ErrNotExist) {
		priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return Key{}, err
		}
		der, err := x509.MarshalPKCS8PrivateKey(priv)
		if err != nil {
			return Key{}, err
		}
		if err := writeFile(dir, KeyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})); err != nil {
			return Key{}, fmt.Errorf("dev OIDC key: %w", err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, SecretFile)); errors.Is(err, fs.ErrNotExist) {
		b := make([]byte, 24)
		_, _ = rand.Read(b)
		if err := writeFile(dir, SecretFile, []byte(hex.EncodeToString(b)+"\n")); err != nil {
			return Key{}, fmt.Errorf("dev OIDC secret: %w", err)
		}
	}
	return LoadKey(dir)
}

func newKey(priv *ecdsa.PrivateKey) (Key, error) {
	tp, err := (&jose.JSONWebKey{Key: priv.Public()}).Thumbprint(crypto.SHA256)
	if err != nil {
		return Key{}, err
	}
	return Key{Priv: priv, KID: base64.RawURLEncoding.EncodeToString(tp)}, nil
}

// JWKS is the public key set of k.
func (k Key) JWKS() jose.JSONWebKeySet {
	return jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: k.Priv.Public(), KeyID: k.KID, Algorithm: string(jose.ES256), Use: "sig"}}}
}

// Request asks for a token.
type Request struct {
	// Issuer is the iss: the issuer's URL (the agent's auth.oidc.issuer_url).
	Issuer string
	// User is the sub (and preferred_username).
	User string
	// Roles are the roles claim.
	Roles []string
	// TTL is the lifetime: DefaultTTL when zero, at most MaxTTL.
	TTL time.Duration
	// Now is the time of issue; zero: time.Now.
	Now time.Time
	// Nonce, when set, is the nonce claim: the one of the authorization
	// request, which an OpenID Connect client checks in the ID token.
	Nonce string
}

// ParseRoles splits roles given as one string, separated by commas or
// spaces.
func ParseRoles(s string) []string {
	return strings.FieldsFunc(s, func(c rune) bool { return c == ',' || c == ' ' })
}

// Mint signs a token for r with k (ES256) and returns it with its expiry.
func (k Key) Mint(r Request) (string, time.Time, error) {
	if r.Issuer == "" {
		return "", time.Time{}, fmt.Errorf("%w: no issuer URL", ErrInvalid)
	}
	if err := checkIdentity(r.User, r.Roles); err != nil {
		return "", time.Time{}, err
	}
	ttl := r.TTL
	if ttl == 0 {
		ttl = DefaultTTL
	}
	if ttl < 0 || ttl > MaxTTL {
		return "", time.Time{}, fmt.Errorf("%w: ttl %s: dev tokens live between 0 and %s", ErrInvalid, r.TTL, MaxTTL)
	}
	now := r.Now
	if now.IsZero() {
		now = time.Now()
	}
	roles := r.Roles
	if roles == nil {
		roles = []string{}
	}
	exp := now.Add(ttl)
	jti := make([]byte, 12)
	_, _ = rand.Read(jti)
	claims := map[string]any{
		"iss": r.Issuer, "aud": Audience, "sub": r.User, "preferred_username": r.User, RolesClaim: roles,
		"iat": now.Unix(), "nbf": now.Unix(), "exp": exp.Unix(), "jti": hex.EncodeToString(jti),
	}
	if r.Nonce != "" {
		claims["nonce"] = r.Nonce
	}
	s, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.ES256, Key: jose.JSONWebKey{Key: k.Priv, KeyID: k.KID}}, (&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		return "", time.Time{}, err
	}
	raw, err := jwt.Signed(s).Claims(claims).Serialize()
	return raw, exp, err
}

// checkIdentity refuses a user or roles that a token must not carry.
func checkIdentity(user string, roles []string) error {
	if user == "" || strings.ContainsFunc(user, func(c rune) bool { return c < 0x20 || c == 0x7f }) {
		return fmt.Errorf("%w: the user must be a non-empty name without control characters", ErrInvalid)
	}
	for _, role := range roles {
		if !roleName.MatchString(role) {
			return fmt.Errorf("%w: role %q: a role is letters, digits and ._:/@- (starting with a letter or digit), at most 128", ErrInvalid, role)
		}
	}
	return nil
}

// IssuerURL reads the URL of the issuer that last served from dir.
func IssuerURL(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, IssuerFile))
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("no dev OIDC issuer has served from %s (no %s): start one (pitrust dev-issuer --dir %s, pivirt-agent --dev) or name its URL", dir, IssuerFile, dir)
	}
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// Issuer serves discovery, the JWKS, the token endpoint and the
// authorization endpoint of a key.
type Issuer struct {
	// URL is the issuer URL (http://127.0.0.1:PORT).
	URL    string
	key    Key
	secret string
	dir    string
	// now is the clock of the authorization codes' expiry; nil: time.Now.
	now   func() time.Time
	codes codeTable
	// Logger receives the refusals of wrong secrets; nil: slog.Default().
	Logger  *slog.Logger
	secrets secrets
}

// Listen opens addr (a loopback address; port 0 picks one) for the issuer
// of dir's key, made if missing, and records its URL in dir (IssuerFile).
// Serve it with http.Serve(ln, is.Handler()).
func Listen(dir, addr string) (*Issuer, net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, nil, fmt.Errorf("dev OIDC issuer address %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, nil, fmt.Errorf("dev OIDC issuer address %q: only a loopback IP address (127.0.0.1:PORT): its token endpoint mints tokens for anyone who holds the secret", addr)
	}
	key, err := LoadOrCreateKey(dir)
	if err != nil {
		return nil, nil, err
	}
	secret, err := os.ReadFile(filepath.Join(dir, SecretFile))
	if err != nil {
		return nil, nil, fmt.Errorf("dev OIDC secret: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("dev OIDC issuer: %w", err)
	}
	is := &Issuer{URL: "http://" + ln.Addr().String(), key: key, secret: strings.TrimSpace(string(secret)), dir: dir}
	if err := writeFile(dir, IssuerFile, []byte(is.URL+"\n")); err != nil {
		ln.Close()
		return nil, nil, fmt.Errorf("dev OIDC issuer: %w", err)
	}
	return is, ln, nil
}

// Handler serves the issuer:
//
//	GET  /.well-known/openid-configuration   discovery
//	GET  /keys                                the JWKS
//	POST /token                               a token (RFC 6749 section 5 answers and errors):
//	       grant_type=client_credentials:     HTTP Basic client auth (Audience, the secret of
//	                                          SecretFile); user, roles (comma-separated), ttl
//	                                          (a Go duration)
//	       grant_type=authorization_code:     a public client (no client auth): code,
//	                                          redirect_uri, client_id, code_verifier (PKCE)
//	GET  /authorize                           the login form of the authorization code flow:
//	                                          response_type=code, client_id=Audience,
//	                                          redirect_uri (a loopback http(s) URL), state,
//	                                          code_challenge, code_challenge_method=S256,
//	                                          scope, nonce, response_mode=query optional
//	POST /authorize                           the form: the request's parameters, user,
//	                                          roles, password (the secret of SecretFile);
//	                                          303 to redirect_uri?code=...&state=...&iss=...
//	GET  /authorize.css                       the form's style sheet
//
// Discovery, /keys and /token answer CORS requests (and preflights) from
// loopback origins, for a browser page on loopback.
func (is *Issuer) Handler() http.Handler {
	mux := http.NewServeMux()
	discovery := cors("GET", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{
			"issuer": is.URL, "jwks_uri": is.URL + "/keys", "token_endpoint": is.URL + "/token",
			"authorization_endpoint":                         is.URL + "/authorize",
			"grant_types_supported":                          []string{"client_credentials", "authorization_code"},
			"token_endpoint_auth_methods_supported":          []string{"client_secret_basic", "none"},
			"response_types_supported":                       []string{"code"},
			"response_modes_supported":                       []string{"query"},
			"code_challenge_methods_supported":               []string{"S256"},
			"scopes_supported":                               []string{"openid"},
			"authorization_response_iss_parameter_supported": true,
			"subject_types_supported":                        []string{"public"},
			"id_token_signing_alg_values_supported":          []string{string(jose.ES256)},
			"claims_supported":                               []string{"sub", "preferred_username", RolesClaim, "nonce"},
			Marker:                                           true,
		})
	}))
	mux.Handle("GET /.well-known/openid-configuration", discovery)
	mux.Handle("OPTIONS /.well-known/openid-configuration", discovery)
	keys := cors("GET", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, is.key.JWKS())
	}))
	mux.Handle("GET /keys", keys)
	mux.Handle("OPTIONS /keys", keys)
	token := cors("POST", http.HandlerFunc(is.token))
	mux.Handle("POST /token", token)
	mux.Handle("OPTIONS /token", token)
	mux.HandleFunc("GET /authorize", is.authorizeForm)
	// The form posts to its own origin: a cross-origin POST (another
	// page's form) is refused before it is read.
	mux.Handle("POST /authorize", http.NewCrossOriginProtection().Handler(http.HandlerFunc(is.authorize)))
	mux.HandleFunc("GET /authorize.css", serveStyle)
	return mux
}

// token is the token endpoint (errors as RFC 6749 section 5.2 has them).
func (is *Issuer) token(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxForm)
	if err := r.ParseForm(); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "invalid_request", "error_description": err.Error()})
		return
	}
	switch g := r.PostForm.Get("grant_type"); g {
	case "client_credentials":
		is.clientCredentials(w, r)
	case "authorization_code":
		is.exchange(w, r)
	default:
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "unsupported_grant_type",
			"error_description": describe(fmt.Sprintf("grant_type %q: client_credentials or authorization_code", g))})
	}
}

// clientCredentials answers grant_type=client_credentials: the client
// authenticates with the secret and names the user and roles.
func (is *Issuer) clientCredentials(w http.ResponseWriter, r *http.Request) {
	id, secret, ok := r.BasicAuth()
	if !ok || id != Audience {
		secret = ""
	}
	switch is.checkSecret(r, "token endpoint (client_credentials)", secret) {
	case secretLimited:
		writeJSON(w, http.StatusTooManyRequests, map[string]string{"error": "slow_down", "error_description": limitedAnswer})
		return
	case secretWrong:
		w.Header().Set("WWW-Authenticate", `Basic realm="pivirt dev OIDC issuer"`)
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "invalid_client",
			"error_description": "authenticate as client " + Audience + " with the secret in " + SecretFile + " of the issuer's directory"})
		return
	}
	var ttl time.Duration
	if s := r.PostForm.Get("ttl"); s != "" {
		var err error
		if ttl, err = time.ParseDuration(s); err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "invalid_request", "error_description": "ttl: " + err.Error()})
			return
		}
	}
	raw, exp, err := is.key.Mint(Request{Issuer: is.URL, User: r.PostForm.Get("user"), Roles: ParseRoles(r.PostForm.Get("roles")), TTL: ttl})
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "invalid_request", "error_description": err.Error()})
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, http.StatusOK, map[string]any{"access_token": raw, "id_token": raw, "token_type": "Bearer", "expires_in": int(time.Until(exp).Seconds())})
}

// Fetch asks the development issuer at issuerURL for a token with the
// client secret of its directory: discovery first, which must carry Marker
// (another issuer is refused, saying so), then the token endpoint. Only
// loopback http:// issuers are asked: the secret travels in clear text.
func Fetch(ctx context.Context, client *http.Client, issuerURL, secret string, r Request) (string, time.Time, error) {
	u, err := url.Parse(issuerURL)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return "", time.Time{}, fmt.Errorf("issuer %q: not the development issuer's http://127.0.0.1:PORT URL", issuerURL)
	}
	if ip := net.ParseIP(u.Hostname()); ip == nil || !ip.IsLoopback() {
		return "", time.Time{}, fmt.Errorf("issuer %q: the development issuer serves on loopback only", issuerURL)
	}
	var meta map[string]any
	if err := getJSON(ctx, client, strings.TrimSuffix(issuerURL, "/")+"/.well-known/openid-configuration", &meta); err != nil {
		return "", time.Time{}, err
	}
	ep, _ := meta["token_endpoint"].(string)
	if meta[Marker] != true || ep == "" {
		return "", time.Time{}, fmt.Errorf("%s is not a PiVirt development OIDC issuer (its discovery document has no %s)", issuerURL, Marker)
	}
	form := url.Values{"grant_type": {"client_credentials"}, "user": {r.User}, "roles": {strings.Join(r.Roles, ",")}}
	if r.TTL != 0 {
		form.Set("ttl", r.TTL.String())
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep, strings.NewReader(form.Encode()))
	if err != nil {
		return "", time.Time{}, err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.SetBasicAuth(Audience, secret)
	resp, err := client.Do(req)
	if err != nil {
		return "", time.Time{}, err
	}
	defer resp.Body.Close()
	var body struct {
		AccessToken string `json:"access_token"`
		ExpiresIn   int    `json:"expires_in"`
		Error       string `json:"error"`
		Description string `json:"error_description"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body); err != nil {
		return "", time.Time{}, fmt.Errorf("token endpoint %s: %s: %w", ep, resp.Status, err)
	}
	if resp.StatusCode != http.StatusOK || body.AccessToken == "" {
		return "", time.Time{}, fmt.Errorf("token endpoint %s: %s: %s: %s", ep, resp.Status, body.Error, body.Description)
	}
	return body.AccessToken, time.Now().Add(time.Duration(body.ExpiresIn) * time.Second), nil
}

func getJSON(ctx context.Context, client *http.Client, u string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", u, resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(v); err != nil {
		return fmt.Errorf("%s: %w", u, err)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// writeFile writes dir/name atomically, 0600, making dir (0700) if needed.
func writeFile(dir, name string, data []byte) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+name+"-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), filepath.Join(dir, name))
}
