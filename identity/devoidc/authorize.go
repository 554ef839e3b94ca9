package devoidc

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"
)

// The authorization code flow (RFC 6749 section 4.1 with PKCE, RFC 7636).
const (
	// CodeTTL is how long an authorization code can be exchanged.
	CodeTTL = 60 * time.Second
	// MaxCodes bounds the codes issued and not yet exchanged or expired;
	// past it the authorization endpoint answers temporarily_unavailable.
	MaxCodes = 1024
)

// Bounds of the requests.
const (
	maxForm        = 64 << 10 // a POST body
	maxQuery       = 8 << 10  // the query of GET /authorize
	maxRedirectURI = 2048
	maxState       = 1024
	maxNonce       = 512
	maxScope       = 1024
	maxUser        = 256
	maxRoles       = 4096 // the roles field, as typed
)

var (
	// challengeSyntax is an S256 code challenge: base64url (no padding) of
	// a SHA-256 digest.
	challengeSyntax = regexp.MustCompile(`^[A-Za-z0-9_-]{43}$`)
	// verifierSyntax is a code verifier (RFC 7636 section 4.1).
	verifierSyntax = regexp.MustCompile(`^[A-Za-z0-9._~-]{43,128}$`)
)

// authParams are the parameters of an authorization request, carried by
// the login form in hidden fields.
var authParams = []string{"response_type", "client_id", "redirect_uri", "state", "code_challenge", "code_challenge_method", "scope", "nonce", "response_mode"}

// authRequest is a validated authorization request.
type authRequest struct {
	params   url.Values // authParams as given (one value each)
	redirect *url.URL   // redirect_uri, parsed
	origin   string     // the redirect's origin, for the page's form-action
}

// authError refuses an authorization request: on the page when there is
// no valid redirect_uri (or client_id) to answer to, else by redirect with
// code (RFC 6749 section 4.1.2.1).
type authError struct {
	code string
	desc string
}

// parseAuthRequest validates the parameters of an authorization request.
// With an error, ar.redirect is set once redirect_uri and client_id
// validated: the error is then redirected, else shown.
func parseAuthRequest(v url.Values) (authRequest, *authError) {
	ar := authRequest{params: url.Values{}}
	for _, p := range []string{"client_id", "redirect_uri"} {
		if len(v[p]) > 1 {
			return ar, &authError{desc: p + " is given more than once"}
		}
	}
	switch id := v.Get("client_id"); {
	case id == "":
		return ar, &authError{desc: "the request names no client_id: the client is " + Audience}
	case id != Audience:
		return ar, &authError{desc: fmt.Sprintf("client_id %q is unknown: the development issuer's one client is %s", id, Audience)}
	}
	u, origin, err := checkRedirectURI(v.Get("redirect_uri"))
	if err != nil {
		return ar, &authError{desc: err.Error()}
	}
	ar.redirect, ar.origin = u, origin
	for _, p := range authParams {
		if len(v[p]) > 1 {
			return ar, &authError{"invalid_request", p + " is given more than once"}
		}
		if s := v.Get(p); s != "" {
			ar.params.Set(p, s)
		}
	}
	// state first: the errors below carry it back.
	if len(ar.params.Get("state")) > maxState {
		ar.params.Del("state")
		return ar, &authError{"invalid_request", fmt.Sprintf("state is longer than %d characters", maxState)}
	}
	switch rt := ar.params.Get("response_type"); rt {
	case "code":
	case "":
		return ar, &authError{"invalid_request", "no response_type: the development issuer answers response_type=code"}
	default:
		return ar, &authError{"unsupported_response_type", fmt.Sprintf("response_type %q: the development issuer answers response_type=code only", rt)}
	}
	if m := ar.params.Get("response_mode"); m != "" && m != "query" {
		return ar, &authError{"invalid_request", fmt.Sprintf("response_mode %q: the development issuer answers in the query only", m)}
	}
	switch c := ar.params.Get("code_challenge"); {
	case c == "":
		return ar, &authError{"invalid_request", "no code_challenge: PKCE is required (code_challenge_method=S256)"}
	case ar.params.Get("code_challenge_method") != "S256":
		return ar, &authError{"invalid_request", fmt.Sprintf("code_challenge_method %q: only S256 (plain is refused)", ar.params.Get("code_challenge_method"))}
	case !challengeSyntax.MatchString(c):
		return ar, &authError{"invalid_request", "code_challenge: an S256 challenge is 43 characters of base64url (the SHA-256 of the verifier)"}
	}
	if n := ar.params.Get("nonce"); len(n) > maxNonce || strings.ContainsFunc(n, isControl) {
		return ar, &authError{"invalid_request", fmt.Sprintf("nonce: at most %d characters, no control characters", maxNonce)}
	}
	if len(ar.params.Get("scope")) > maxScope {
		return ar, &authError{"invalid_request", fmt.Sprintf("scope is longer than %d characters", maxScope)}
	}
	return ar, nil
}

// CallbackPath is the only path a code is sent to: the web console's
// login callback. Another local user could listen on any loopback port;
// a fixed path makes a link naming their port send the code to the page
// only if it serves the console there.
const CallbackPath = "/ui/callback"

// checkRedirectURI accepts an http or https URL of a loopback host, any
// port, path CallbackPath, without user information or fragment, and
// returns it with its origin as a CSP source.
func checkRedirectURI(raw string) (*url.URL, string, error) {
	if raw == "" {
		return nil, "", errors.New("the request names no redirect_uri")
	}
	if len(raw) > maxRedirectURI {
		return nil, "", fmt.Errorf("redirect_uri is longer than %d characters", maxRedirectURI)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, "", fmt.Errorf("redirect_uri %q is not a URL: %v", raw, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https", u.Opaque != "", u.Host == "":
		return nil, "", fmt.Errorf("redirect_uri %q: an absolute http:// or https:// URL is required", raw)
	case u.User != nil:
		return nil, "", fmt.Errorf("redirect_uri %q: no user information in the URL", raw)
	case strings.Contains(raw, "#"):
		return nil, "", fmt.Errorf("redirect_uri %q: no fragment (#) in the URL", raw)
	case !loopbackHost(u.Hostname()):
		return nil, "", fmt.Errorf("redirect_uri %q: the development issuer redirects to loopback pages only (127.0.0.1, ::1, localhost)", raw)
	case u.Path != CallbackPath:
		return nil, "", fmt.Errorf("redirect_uri %q: the development issuer redirects to the web console's login (%s) only", raw, CallbackPath)
	}
	origin := u.Scheme + "://" + u.Host
	if strings.HasPrefix(u.Host, "[") {
		// A CSP host source cannot be an IPv6 literal: the scheme stands
		// for it (the page has no script and one form).
		origin = u.Scheme + ":"
	}
	return u, origin, nil
}

// loopbackHost is a loopback IP address or localhost.
func loopbackHost(h string) bool {
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

func isControl(c rune) bool { return c < 0x20 || c == 0x7f }

// authorizeForm is GET /authorize: the login form of a valid request.
func (is *Issuer) authorizeForm(w http.ResponseWriter, r *http.Request) {
	if len(r.URL.RawQuery) > maxQuery {
		is.page(w, http.StatusRequestURITooLong, page{Error: fmt.Sprintf("The request's query is longer than %d bytes.", maxQuery)})
		return
	}
	ar, aerr := parseAuthRequest(r.URL.Query())
	if aerr != nil {
		is.refuse(w, r, ar, aerr)
		return
	}
	is.page(w, http.StatusOK, is.formPage(ar, "", ""))
}

// authorize is POST /authorize: the login form submitted. The request's
// parameters come back in hidden fields and are validated again; the
// password is the issuer's secret.
func (is *Issuer) authorize(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxForm)
	if err := r.ParseForm(); err != nil {
		is.page(w, http.StatusBadRequest, page{Error: "The form could not be read: " + err.Error()})
		return
	}
	f := r.PostForm
	ar, aerr := parseAuthRequest(f)
	if aerr != nil {
		is.refuse(w, r, ar, aerr)
		return
	}
	if f.Has("cancel") {
		is.refuse(w, r, ar, &authError{"access_denied", "the user cancelled the sign-in"})
		return
	}
	user, rolesField := strings.TrimSpace(f.Get("user")), f.Get("roles")
	p := is.formPage(ar, user, rolesField)
	switch is.checkSecret(r, "sign-in page", f.Get("password")) {
	case secretLimited:
		p.Error = "Too many wrong passwords lately: wait a few seconds."
		is.page(w, http.StatusTooManyRequests, p)
		return
	case secretWrong:
		p.Error = "Wrong password: it is the content of " + p.SecretPath + "."
		is.page(w, http.StatusUnauthorized, p)
		return
	}
	roles := ParseRoles(rolesField)
	err := checkIdentity(user, roles)
	switch {
	case len(user) > maxUser:
		err = fmt.Errorf("the user name is longer than %d bytes", maxUser)
	case len(rolesField) > maxRoles:
		err = fmt.Errorf("the roles are longer than %d bytes", maxRoles)
	}
	if err != nil {
		p.Error = strings.TrimPrefix(err.Error(), ErrInvalid.Error()+": ")
		is.page(w, http.StatusBadRequest, p)
		return
	}
	code, err := is.codes.put(is.clock(), grant{
		clientID: Audience, redirectURI: ar.params.Get("redirect_uri"), challenge: ar.params.Get("code_challenge"),
		nonce: ar.params.Get("nonce"), user: user, roles: roles,
	})
	if err != nil {
		is.refuse(w, r, ar, &authError{"temporarily_unavailable", err.Error()})
		return
	}
	q := ar.redirect.Query()
	q.Set("code", code)
	if s := ar.params.Get("state"); s != "" {
		q.Set("state", s)
	}
	q.Set("iss", is.URL) // RFC 9207
	u := *ar.redirect
	u.RawQuery = q.Encode()
	http.Redirect(w, r, u.String(), http.StatusSeeOther)
}

// refuse answers a refused authorization request: redirected to the
// validated redirect_uri (error, error_description, state, iss), or shown
// on the page when there is none to trust.
func (is *Issuer) refuse(w http.ResponseWriter, r *http.Request, ar authRequest, e *authError) {
	if ar.redirect == nil || e.code == "" {
		is.page(w, http.StatusBadRequest, page{Error: "This sign-in request cannot be answered: " + e.desc + "."})
		return
	}
	q := ar.redirect.Query()
	q.Set("error", e.code)
	q.Set("error_description", describe(e.desc))
	if s := ar.params.Get("state"); s != "" {
		q.Set("state", s)
	}
	q.Set("iss", is.URL)
	u := *ar.redirect
	u.RawQuery = q.Encode()
	http.Redirect(w, r, u.String(), http.StatusSeeOther)
}

// exchange answers grant_type=authorization_code (RFC 6749 section 4.1.3,
// RFC 7636 section 4.6) for a public client. A code is spent by its first
// well-formed exchange, successful or not.
func (is *Issuer) exchange(w http.ResponseWriter, r *http.Request) {
	fail := func(status int, code, desc string) {
		w.Header().Set("Cache-Control", "no-store")
		writeJSON(w, status, map[string]string{"error": code, "error_description": describe(desc)})
	}
	f := r.PostForm
	if r.Header.Get("Authorization") != "" {
		// A public client sends none; a client that authenticates must
		// do it right.
		id, secret, ok := r.BasicAuth()
		if !ok || id != Audience {
			secret = ""
		}
		switch is.checkSecret(r, "token endpoint (authorization_code)", secret) {
		case secretLimited:
			fail(http.StatusTooManyRequests, "slow_down", limitedAnswer)
			return
		case secretWrong:
			w.Header().Set("WWW-Authenticate", `Basic realm="pivirt dev OIDC issuer"`)
			fail(http.StatusUnauthorized, "invalid_client", "a client that authenticates is "+Audience+" with the secret in "+SecretFile+"; a public client sends no Authorization header")
			return
		}
	}
	for _, p := range []string{"code", "redirect_uri", "client_id", "code_verifier"} {
		switch len(f[p]) {
		case 0:
			fail(http.StatusBadRequest, "invalid_request", "no "+p)
			return
		case 1:
		default:
			fail(http.StatusBadRequest, "invalid_request", p+" is given more than once")
			return
		}
	}
	verifier := f.Get("code_verifier")
	if !verifierSyntax.MatchString(verifier) {
		fail(http.StatusBadRequest, "invalid_request", "code_verifier: 43 to 128 characters of A-Z a-z 0-9 - . _ ~ (RFC 7636)")
		return
	}
	g, ok := is.codes.take(f.Get("code"))
	switch {
	case !ok:
		fail(http.StatusBadRequest, "invalid_grant", "the code is unknown or already used: a code is exchanged once; sign in again")
		return
	case !is.clock().Before(g.expires):
		fail(http.StatusBadRequest, "invalid_grant", fmt.Sprintf("the code expired: it is exchanged within %s of the sign-in; sign in again", CodeTTL))
		return
	case f.Get("client_id") != g.clientID:
		fail(http.StatusBadRequest, "invalid_grant", "the code was issued to client "+g.clientID)
		return
	case f.Get("redirect_uri") != g.redirectURI:
		fail(http.StatusBadRequest, "invalid_grant", "redirect_uri is not the one of the authorization request")
		return
	}
	sum := sha256.Sum256([]byte(verifier))
	if subtle.ConstantTimeCompare([]byte(base64.RawURLEncoding.EncodeToString(sum[:])), []byte(g.challenge)) != 1 {
		fail(http.StatusBadRequest, "invalid_grant", "code_verifier does not match the code_challenge of the authorization request (S256)")
		return
	}
	raw, exp, err := is.key.Mint(Request{Issuer: is.URL, User: g.user, Roles: g.roles, Nonce: g.nonce})
	if err != nil {
		fail(http.StatusInternalServerError, "server_error", err.Error())
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Pragma", "no-cache")
	writeJSON(w, http.StatusOK, map[string]any{"access_token": raw, "id_token": raw, "token_type": "Bearer", "expires_in": int(time.Until(exp).Seconds())})
}

func (is *Issuer) clock() time.Time {
	if is.now != nil {
		return is.now()
	}
	return time.Now()
}

// describe makes s an error_description: RFC 6749 allows printable ASCII
// but for '"' and '\'.
func describe(s string) string {
	return strings.Map(func(c rune) rune {
		switch {
		case c == '"':
			return '\''
		case c == '\\':
			return '/'
		case c < 0x20 || c > 0x7e:
			return '?'
		}
		return c
	}, s)
}

// grant is what a code stands for.
type grant struct {
	clientID, redirectURI, challenge, nonce, user string
	roles                                         []string
	expires                                       time.Time
}

// codeTable holds the outstanding codes by their SHA-256 (a lookup's
// timing tells nothing of a code), at most MaxCodes of them.
type codeTable struct {
	mu sync.Mutex
	m  map[[sha256.Size]byte]grant
}

var errTooManyCodes = fmt.Errorf("%d sign-ins wait for their code to be exchanged: try again within %s", MaxCodes, CodeTTL)

// put records g, valid CodeTTL from now, under a new code.
func (t *codeTable) put(now time.Time, g grant) (string, error) {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	code := base64.RawURLEncoding.EncodeToString(b)
	g.expires = now.Add(CodeTTL)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[[sha256.Size]byte]grant{}
	}
	if len(t.m) >= MaxCodes {
		for k, o := range t.m {
			if !now.Before(o.expires) {
				delete(t.m, k)
			}
		}
		if len(t.m) >= MaxCodes {
			return "", errTooManyCodes
		}
	}
	t.m[sha256.Sum256([]byte(code))] = g
	return code, nil
}

// take removes code and returns what it stands for, expired or not: of
// concurrent takes, one gets it.
func (t *codeTable) take(code string) (grant, bool) {
	k := sha256.Sum256([]byte(code))
	t.mu.Lock()
	defer t.mu.Unlock()
	g, ok := t.m[k]
	delete(t.m, k)
	return g, ok
}

// cors answers cross-origin requests from loopback origins (a page of the
// web UI on https://127.0.0.1:8443, say): Access-Control-Allow-Origin
// echoes the origin, no credentials; a preflight (OPTIONS) from another
// origin is refused.
func cors(methods string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Vary", "Origin")
		origin := r.Header.Get("Origin")
		allowed := origin != "" && loopbackOrigin(origin)
		if r.Method == http.MethodOptions {
			w.Header().Add("Vary", "Access-Control-Request-Method")
			w.Header().Add("Vary", "Access-Control-Request-Headers")
			w.Header().Set("Allow", "OPTIONS, "+methods)
			if origin != "" && !allowed {
				http.Error(w, "origin "+origin+" is not a loopback origin: the development issuer answers cross-origin requests of loopback pages only", http.StatusForbidden)
				return
			}
			if allowed {
				w.Header().Set("Access-Control-Allow-Origin", origin)
				w.Header().Set("Access-Control-Allow-Methods", methods)
				w.Header().Set("Access-Control-Allow-Headers", "Content-Type")
				w.Header().Set("Access-Control-Max-Age", "600")
			}
			w.WriteHeader(http.StatusNoContent)
			return
		}
		if allowed {
			w.Header().Set("Access-Control-Allow-Origin", origin)
		}
		h.ServeHTTP(w, r)
	})
}

// loopbackOrigin is an http or https origin of a loopback host.
func loopbackOrigin(origin string) bool {
	u, err := url.Parse(origin)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Opaque == "" && u.User == nil &&
		u.Path == "" && u.RawQuery == "" && u.Fragment == "" && !strings.Contains(origin, "#") && loopbackHost(u.Hostname())
}

// page is what the login page shows.
type page struct {
	Error string
	// With a form (a valid request):
	Form       bool
	Hidden     []hiddenField
	Client     string // the redirect's origin, as the user reads it
	SecretPath string
	User       string
	Roles      string
	origin     string
}

type hiddenField struct{ Name, Value string }

func (is *Issuer) formPage(ar authRequest, user, roles string) page {
	p := page{Form: true, User: user, Roles: roles, origin: ar.origin,
		Client: ar.redirect.Scheme + "://" + ar.redirect.Host, SecretPath: filepath.Join(is.dir, SecretFile)}
	for _, name := range authParams {
		if v := ar.params.Get(name); v != "" {
			p.Hidden = append(p.Hidden, hiddenField{name, v})
		}
	}
	return p
}

//go:embed authorize.html
var pageHTML string

//go:embed authorize.css
var pageCSS []byte

var pageTemplate = template.Must(template.New("authorize").Parse(pageHTML))

// page writes the login page. Its policy: no script, no frame, styles of
// this origin only, and forms posting to this origin, and to the
// redirect's (a 303 after the form is a form navigation to it).
func (is *Issuer) page(w http.ResponseWriter, status int, p page) {
	formAction := "'self'"
	if p.origin != "" {
		formAction += " " + p.origin
	}
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; form-action "+formAction+"; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_ = pageTemplate.Execute(w, p)
}

func serveStyle(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/css; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Cache-Control", "max-age=300")
	_, _ = w.Write(pageCSS)
}
