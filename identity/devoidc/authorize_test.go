package devoidc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"golang.org/x/net/html"
	"golang.org/x/oauth2"
)

// uiRedirect is where the web UI of an agent takes the code.
const uiRedirect = "https://127.0.0.1:8443/ui/callback?from=login"

// testIssuer is an issuer served on 127.0.0.1 until the test ends, its
// code clock shifted by skew.
type testIssuer struct {
	*Issuer
	secret string
	skew   atomic.Int64
	// client follows no redirect: the test reads each.
	client *http.Client
	// transport is the clients', its connections closed before the
	// server shuts down (which would wait for new, idle ones).
	transport *http.Transport
}

func startIssuer(t *testing.T) *testIssuer {
	t.Helper()
	dir := t.TempDir()
	is, ln, err := Listen(dir, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	ti := &testIssuer{Issuer: is, transport: tr, client: &http.Client{
		Transport:     tr,
		Timeout:       10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
	is.now = func() time.Time { return time.Now().Add(time.Duration(ti.skew.Load())) }
	secret, err := os.ReadFile(filepath.Join(dir, SecretFile))
	if err != nil {
		t.Fatal(err)
	}
	ti.secret = strings.TrimSpace(string(secret))
	srv := &http.Server{Handler: is.Handler(), ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("dev issuer: %v", err)
		}
	})
	return ti
}

// authParamsFor is an authorization request of the web UI with the
// challenge of verifier.
func authParamsFor(verifier, state string) url.Values {
	return url.Values{
		"response_type": {"code"}, "client_id": {Audience}, "redirect_uri": {uiRedirect}, "state": {state},
		"code_challenge": {oauth2.S256ChallengeFromVerifier(verifier)}, "code_challenge_method": {"S256"}, "scope": {"openid"},
	}
}

// get fetches u, with the request's headers h.
func (ti *testIssuer) do(t *testing.T, method, u string, body url.Values, h http.Header) (*http.Response, string) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = strings.NewReader(body.Encode())
	}
	req, err := http.NewRequestWithContext(t.Context(), method, u, rd)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range h {
		req.Header[k] = v
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := ti.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

// form is the login form of a page: its action, its fields by name (the
// hidden ones with their values), and whether each visible field has a
// label.
type form struct {
	action  string
	hidden  url.Values
	visible []string
	labeled map[string]bool
	scripts int
	remote  []string // resources of another origin
}

func parsePage(t *testing.T, page string) form {
	t.Helper()
	doc, err := html.Parse(strings.NewReader(page))
	if err != nil {
		t.Fatalf("the page is not HTML: %v", err)
	}
	f := form{hidden: url.Values{}, labeled: map[string]bool{}}
	ids := map[string]string{}
	var labels []string
	for n := range doc.Descendants() {
		if n.Type != html.ElementNode {
			continue
		}
		attr := map[string]string{}
		for _, a := range n.Attr {
			attr[a.Key] = a.Val
		}
		for _, k := range []string{"href", "src"} {
			if v, ok := attr[k]; ok && !strings.HasPrefix(v, "/") {
				f.remote = append(f.remote, v)
			}
		}
		switch n.Data {
		case "script":
			f.scripts++
		case "form":
			f.action = attr["action"]
		case "label":
			labels = append(labels, attr["for"])
		case "input":
			if attr["type"] == "hidden" {
				f.hidden.Add(attr["name"], attr["value"])
			} else {
				f.visible = append(f.visible, attr["name"])
				ids[attr["id"]] = attr["name"]
			}
		}
	}
	for _, id := range labels {
		f.labeled[ids[id]] = true
	}
	return f
}

// signIn gets the login form of params and posts it with the user, roles
// and password; it returns the answer to the post, not followed.
func (ti *testIssuer) signIn(t *testing.T, params url.Values, user, roles, password string) (*http.Response, string) {
	t.Helper()
	resp, page := ti.do(t, http.MethodGet, ti.URL+"/authorize?"+params.Encode(), nil, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /authorize: %s: %s", resp.Status, page)
	}
	f := parsePage(t, page)
	body := f.hidden
	body.Set("user", user)
	body.Set("roles", roles)
	body.Set("password", password)
	return ti.do(t, http.MethodPost, ti.URL+f.action, body, nil)
}

// code signs in as alice (admin) and returns the code of the redirect.
func (ti *testIssuer) code(t *testing.T, verifier string) string {
	t.Helper()
	resp, page := ti.signIn(t, authParamsFor(verifier, "s1"), "alice", "admin", ti.secret)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST /authorize: %s: %s", resp.Status, page)
	}
	loc, err := url.Parse(resp.Header.Get("Location"))
	if err != nil || loc.Query().Get("code") == "" {
		t.Fatalf("POST /authorize redirected to %q (%v), want a code", resp.Header.Get("Location"), err)
	}
	return loc.Query().Get("code")
}

// exchange posts grant_type=authorization_code with form to /token.
func (ti *testIssuer) exchange(t *testing.T, form url.Values) (int, map[string]any) {
	t.Helper()
	form.Set("grant_type", "authorization_code")
	resp, body := ti.do(t, http.MethodPost, ti.URL+"/token", form, nil)
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("/token answered %s %q: not JSON: %v", resp.Status, body, err)
	}
	return resp.StatusCode, m
}

func exchangeForm(code, verifier string) url.Values {
	return url.Values{"code": {code}, "redirect_uri": {uiRedirect}, "client_id": {Audience}, "code_verifier": {verifier}}
}

// TestAuthorizationCodeFlow walks the flow of the web UI: an OAuth 2.0
// client (golang.org/x/oauth2, PKCE S256) with the endpoints of the
// discovery document (go-oidc) asks for the form, which is one page of
// this origin (no script, labelled fields, framing and foreign form
// targets refused by its headers) carrying the request in hidden fields;
// the posted form redirects (303) to the redirect URI with the code, the
// state, the issuer and the URI's own query; the client exchanges the code
// with its verifier; the access and ID tokens verify against /keys with
// the user, roles, audience and nonce of the sign-in.
func TestAuthorizationCodeFlow(t *testing.T) {
	t.Parallel()
	ti := startIssuer(t)
	ctx := oidc.ClientContext(t.Context(), &http.Client{Transport: ti.transport, Timeout: 10 * time.Second})
	provider, err := oidc.NewProvider(ctx, ti.URL)
	if err != nil {
		t.Fatal(err)
	}
	var meta struct {
		AuthorizationEndpoint string   `json:"authorization_endpoint"`
		ResponseTypes         []string `json:"response_types_supported"`
		GrantTypes            []string `json:"grant_types_supported"`
		Methods               []string `json:"code_challenge_methods_supported"`
		AuthMethods           []string `json:"token_endpoint_auth_methods_supported"`
	}
	if err := provider.Claims(&meta); err != nil {
		t.Fatal(err)
	}
	if meta.AuthorizationEndpoint != ti.URL+"/authorize" || !slices.Equal(meta.ResponseTypes, []string{"code"}) ||
		!slices.Equal(meta.GrantTypes, []string{"client_credentials", "authorization_code"}) || !slices.Equal(meta.Methods, []string{"S256"}) ||
		!slices.Equal(meta.AuthMethods, []string{"client_secret_basic", "none"}) {
		t.Errorf("discovery: %+v", meta)
	}
	endpoint := provider.Endpoint()
	endpoint.AuthStyle = oauth2.AuthStyleInParams // a public client
	conf := oauth2.Config{ClientID: Audience, Endpoint: endpoint, RedirectURL: uiRedirect, Scopes: []string{oidc.ScopeOpenID}}
	verifier := oauth2.GenerateVerifier()

	resp, page := ti.do(t, http.MethodGet, conf.AuthCodeURL("st-1", oauth2.S256ChallengeOption(verifier), oidc.Nonce("n-1")), nil, nil)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /authorize: %s %s: %s", resp.Status, resp.Header.Get("Content-Type"), page)
	}
	csp := resp.Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "form-action 'self' https://127.0.0.1:8443;", "frame-ancestors 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("Content-Security-Policy %q has no %q", csp, want)
		}
	}
	if xfo := resp.Header.Get("X-Frame-Options"); xfo != "DENY" {
		t.Errorf("X-Frame-Options %q, want DENY", xfo)
	}
	f := parsePage(t, page)
	if f.action != "/authorize" || f.scripts != 0 || len(f.remote) != 0 {
		t.Errorf("the form posts to %q, with %d scripts and resources %v; want /authorize, none, none of another origin", f.action, f.scripts, f.remote)
	}
	if !slices.Equal(f.visible, []string{"user", "roles", "password"}) {
		t.Errorf("the form asks for %v, want user, roles, password", f.visible)
	}
	for _, name := range f.visible {
		if !f.labeled[name] {
			t.Errorf("field %s has no label", name)
		}
	}
	for _, p := range []string{"response_type", "client_id", "redirect_uri", "state", "code_challenge", "code_challenge_method", "nonce"} {
		if f.hidden.Get(p) == "" {
			t.Errorf("the form does not carry %s", p)
		}
	}
	if resp, _ := ti.do(t, http.MethodGet, ti.URL+"/authorize.css", nil, nil); resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/css") {
		t.Errorf("GET /authorize.css: %s %s", resp.Status, resp.Header.Get("Content-Type"))
	}

	body := f.hidden
	body.Set("user", "alice")
	body.Set("roles", "vm-owner, viewer")
	body.Set("password", ti.secret)
	resp, page = ti.do(t, http.MethodPost, ti.URL+f.action, body, nil)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST /authorize: %s: %s", resp.Status, page)
	}
	loc, err := url.Parse(resp.Header.Get("Location"))
	if err != nil {
		t.Fatal(err)
	}
	q := loc.Query()
	if loc.Scheme+"://"+loc.Host+loc.Path != "https://127.0.0.1:8443/ui/callback" || q.Get("from") != "login" ||
		q.Get("state") != "st-1" || q.Get("iss") != ti.URL || len(q.Get("code")) != 43 {
		t.Fatalf("redirected to %s, want the redirect URI with its query, the code, state st-1 and iss", loc)
	}

	tok, err := conf.Exchange(ctx, q.Get("code"), oauth2.VerifierOption(verifier))
	if err != nil {
		t.Fatalf("exchange: %v", err)
	}
	if tok.TokenType != "Bearer" || time.Until(tok.Expiry) < DefaultTTL-time.Minute || time.Until(tok.Expiry) > DefaultTTL {
		t.Errorf("token type %q, expiry in %s; want Bearer, %s", tok.TokenType, time.Until(tok.Expiry), DefaultTTL)
	}
	rawID, _ := tok.Extra("id_token").(string)
	verifier2 := provider.Verifier(&oidc.Config{ClientID: Audience})
	for name, raw := range map[string]string{"access token": tok.AccessToken, "ID token": rawID} {
		idt, err := verifier2.Verify(ctx, raw)
		if err != nil {
			t.Errorf("the %s does not verify against %s/keys: %v", name, ti.URL, err)
			continue
		}
		var c struct {
			Sub   string   `json:"sub"`
			Roles []string `json:"roles"`
		}
		if err := idt.Claims(&c); err != nil || c.Sub != "alice" || !slices.Equal(c.Roles, []string{"vm-owner", "viewer"}) ||
			!slices.Equal(idt.Audience, []string{Audience}) || idt.Nonce != "n-1" {
			t.Errorf("%s: claims %+v aud %v nonce %q (%v), want alice, [vm-owner viewer], %s, n-1", name, c, idt.Audience, idt.Nonce, err, Audience)
		}
	}
	if _, err := conf.Exchange(ctx, q.Get("code"), oauth2.VerifierOption(verifier)); err == nil {
		t.Error("the code was exchanged twice")
	}
}

// TestTokenExchangeRefusals: the token endpoint refuses a wrong verifier,
// a reused code, an expired code (the clock moved past CodeTTL), another
// redirect_uri or client_id, a malformed verifier and missing parameters,
// each with its RFC 6749 error; a refused well-formed exchange spends the
// code. Client credentials still answer with the secret only.
func TestTokenExchangeRefusals(t *testing.T) {
	t.Parallel()
	ti := startIssuer(t)
	verifier := oauth2.GenerateVerifier()
	expect := func(name string, form url.Values, wantStatus int, wantErr string) {
		t.Helper()
		status, body := ti.exchange(t, form)
		if status != wantStatus || body["error"] != wantErr || body["error_description"] == "" || body["access_token"] != nil {
			t.Errorf("%s: %d %v, want %d %s with a description", name, status, body, wantStatus, wantErr)
		}
	}

	code := ti.code(t, verifier)
	expect("wrong verifier", exchangeForm(code, oauth2.GenerateVerifier()), http.StatusBadRequest, "invalid_grant")
	expect("the right verifier after a wrong one", exchangeForm(code, verifier), http.StatusBadRequest, "invalid_grant")

	code = ti.code(t, verifier)
	if status, body := ti.exchange(t, exchangeForm(code, verifier)); status != http.StatusOK || body["token_type"] != "Bearer" {
		t.Fatalf("exchange: %d %v", status, body)
	}
	expect("reused code", exchangeForm(code, verifier), http.StatusBadRequest, "invalid_grant")

	code = ti.code(t, verifier)
	ti.skew.Store(int64(CodeTTL + time.Second))
	expect("expired code", exchangeForm(code, verifier), http.StatusBadRequest, "invalid_grant")
	ti.skew.Store(0)

	code = ti.code(t, verifier)
	f := exchangeForm(code, verifier)
	f.Set("redirect_uri", "https://127.0.0.1:8443/ui/other")
	expect("another redirect_uri", f, http.StatusBadRequest, "invalid_grant")

	code = ti.code(t, verifier)
	f = exchangeForm(code, verifier)
	f.Set("client_id", "someone-else")
	expect("another client_id", f, http.StatusBadRequest, "invalid_grant")

	code = ti.code(t, verifier)
	expect("a short verifier", exchangeForm(code, "abc"), http.StatusBadRequest, "invalid_request")
	f = exchangeForm(code, verifier)
	f.Del("redirect_uri")
	expect("no redirect_uri", f, http.StatusBadRequest, "invalid_request")
	f = exchangeForm(code, verifier)
	f.Add("code", code)
	expect("two codes", f, http.StatusBadRequest, "invalid_request")
	// The malformed requests left the code as it was.
	if status, body := ti.exchange(t, exchangeForm(code, verifier)); status != http.StatusOK {
		t.Errorf("exchange after malformed requests: %d %v", status, body)
	}
	expect("unknown code", exchangeForm("bm90LWEtY29kZQ", verifier), http.StatusBadRequest, "invalid_grant")

	resp, body := ti.do(t, http.MethodPost, ti.URL+"/token", url.Values{"grant_type": {"password"}}, nil)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "unsupported_grant_type") {
		t.Errorf("grant_type=password: %s %s", resp.Status, body)
	}
	cc := url.Values{"grant_type": {"client_credentials"}, "user": {"bob"}, "roles": {"viewer"}}
	for secret, want := range map[string]int{ti.secret: http.StatusOK, "wrong": http.StatusUnauthorized, "": http.StatusUnauthorized} {
		h := http.Header{}
		if secret != "" {
			req, _ := http.NewRequest(http.MethodPost, "/", nil)
			req.SetBasicAuth(Audience, secret)
			h = req.Header
		}
		if resp, body := ti.do(t, http.MethodPost, ti.URL+"/token", cc, h); resp.StatusCode != want {
			t.Errorf("client credentials with secret %q: %s %s, want %d", secret, resp.Status, body, want)
		}
	}
}

// TestCodeSingleUseConcurrently: of 8 concurrent exchanges of one code,
// exactly one gets a token.
func TestCodeSingleUseConcurrently(t *testing.T) {
	t.Parallel()
	ti := startIssuer(t)
	verifier := oauth2.GenerateVerifier()
	for range 5 {
		code := ti.code(t, verifier)
		var (
			wg    sync.WaitGroup
			ok    atomic.Int32
			start = make(chan struct{})
		)
		form := exchangeForm(code, verifier)
		form.Set("grant_type", "authorization_code")
		errs := make(chan error, 8)
		for range 8 {
			wg.Go(func() {
				<-start
				resp, err := ti.client.PostForm(ti.URL+"/token", form)
				if err != nil {
					errs <- err
					return
				}
				defer resp.Body.Close()
				var body map[string]any
				if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
					errs <- err
					return
				}
				switch {
				case resp.StatusCode == http.StatusOK && body["access_token"] != nil:
					ok.Add(1)
				case resp.StatusCode != http.StatusBadRequest || body["error"] != "invalid_grant":
					errs <- fmt.Errorf("%s %v, want a token or invalid_grant", resp.Status, body)
				}
			})
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if n := ok.Load(); n != 1 {
			t.Fatalf("%d of 8 concurrent exchanges of one code got a token, want 1", n)
		}
	}
}

// TestAuthorizeRefusals: a request without a client_id or redirect_uri
// to trust (unknown client, non-loopback host, another scheme, a fragment,
// user information, twice) is refused on the page, never redirected; once
// both are valid, the request's errors (response type, PKCE missing or
// plain) are redirected with error, error_description and state; the
// form's errors (wrong password, bad role, no user) show the form again
// with the error; cancel redirects access_denied; a form with a tampered
// redirect_uri or posted from another origin is refused.
func TestAuthorizeRefusals(t *testing.T) {
	t.Parallel()
	ti := startIssuer(t)
	verifier := oauth2.GenerateVerifier()
	valid := func(mod func(url.Values)) url.Values {
		v := authParamsFor(verifier, "st-9")
		mod(v)
		return v
	}
	for name, params := range map[string]url.Values{
		"unknown client":         valid(func(v url.Values) { v.Set("client_id", "other") }),
		"no client":              valid(func(v url.Values) { v.Del("client_id") }),
		"no redirect_uri":        valid(func(v url.Values) { v.Del("redirect_uri") }),
		"non-loopback host":      valid(func(v url.Values) { v.Set("redirect_uri", "https://evil.example/cb") }),
		"non-loopback IP":        valid(func(v url.Values) { v.Set("redirect_uri", "http://10.0.0.1:8443/cb") }),
		"loopback-looking name":  valid(func(v url.Values) { v.Set("redirect_uri", "https://127.0.0.1.evil.example/cb") }),
		"another scheme":         valid(func(v url.Values) { v.Set("redirect_uri", "javascript://127.0.0.1/%0aalert(1)") }),
		"a fragment":             valid(func(v url.Values) { v.Set("redirect_uri", "https://127.0.0.1:8443/cb#x") }),
		"user information":       valid(func(v url.Values) { v.Set("redirect_uri", "https://evil@127.0.0.1:8443/cb") }),
		"relative":               valid(func(v url.Values) { v.Set("redirect_uri", "/cb") }),
		"another path":           valid(func(v url.Values) { v.Set("redirect_uri", "https://127.0.0.1:8443/steal") }),
		"redirect_uri twice":     valid(func(v url.Values) { v.Add("redirect_uri", "https://127.0.0.1:9/cb") }),
		"both bad, client first": valid(func(v url.Values) { v.Set("client_id", "x"); v.Set("redirect_uri", "https://evil.example/") }),
	} {
		resp, page := ti.do(t, http.MethodGet, ti.URL+"/authorize?"+params.Encode(), nil, nil)
		f := parsePage(t, page)
		if resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Location") != "" || f.action != "" ||
			!strings.Contains(page, `role="alert"`) || !strings.Contains(page, "cannot be answered") {
			t.Errorf("%s: %s Location %q, form %q: want 400 with the error on the page, no redirect, no form:\n%s",
				name, resp.Status, resp.Header.Get("Location"), f.action, page)
		}
	}
	for _, ok := range []string{"http://localhost/ui/callback", "https://[::1]:8443/ui/callback", "http://127.0.0.2:1/ui/callback?y=z"} {
		resp, page := ti.do(t, http.MethodGet, ti.URL+"/authorize?"+valid(func(v url.Values) { v.Set("redirect_uri", ok) }).Encode(), nil, nil)
		if resp.StatusCode != http.StatusOK {
			t.Errorf("redirect_uri %s: %s: %s", ok, resp.Status, page)
		}
		// A CSP source cannot name an IPv6 address: its scheme stands in.
		want := "form-action 'self' " + strings.TrimSuffix(ok, "/ui/callback") + ";"
		switch ok {
		case "https://[::1]:8443/ui/callback":
			want = "form-action 'self' https:;"
		case "http://127.0.0.2:1/ui/callback?y=z":
			want = "form-action 'self' http://127.0.0.2:1;"
		}
		if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, want) {
			t.Errorf("redirect_uri %s: Content-Security-Policy %q, want %q", ok, csp, want)
		}
	}

	for name, c := range map[string]struct {
		mod  func(url.Values)
		want string
	}{
		"token response":      {func(v url.Values) { v.Set("response_type", "token") }, "unsupported_response_type"},
		"no response_type":    {func(v url.Values) { v.Del("response_type") }, "invalid_request"},
		"no PKCE":             {func(v url.Values) { v.Del("code_challenge"); v.Del("code_challenge_method") }, "invalid_request"},
		"plain PKCE":          {func(v url.Values) { v.Set("code_challenge_method", "plain") }, "invalid_request"},
		"no challenge method": {func(v url.Values) { v.Del("code_challenge_method") }, "invalid_request"},
		"short challenge":     {func(v url.Values) { v.Set("code_challenge", "abc") }, "invalid_request"},
		"state twice":         {func(v url.Values) { v.Add("state", "again") }, "invalid_request"},
		"fragment response":   {func(v url.Values) { v.Set("response_mode", "fragment") }, "invalid_request"},
	} {
		resp, page := ti.do(t, http.MethodGet, ti.URL+"/authorize?"+valid(c.mod).Encode(), nil, nil)
		loc, _ := url.Parse(resp.Header.Get("Location"))
		if resp.StatusCode != http.StatusSeeOther || loc == nil || !strings.HasPrefix(loc.String(), "https://127.0.0.1:8443/ui/callback?") ||
			loc.Query().Get("error") != c.want || loc.Query().Get("error_description") == "" || loc.Query().Get("code") != "" {
			t.Errorf("%s: %s Location %q: want a redirect with error %s: %s", name, resp.Status, resp.Header.Get("Location"), c.want, page)
		} else if name != "state twice" && loc.Query().Get("state") != "st-9" {
			t.Errorf("%s: the error redirect %s does not carry the state", name, loc)
		}
	}

	for name, c := range map[string]struct {
		user, roles, password string
		status                int
		says                  string
	}{
		"wrong password": {"alice", "admin", "guess", http.StatusUnauthorized, "Wrong password"},
		"no password":    {"alice", "admin", "", http.StatusUnauthorized, "Wrong password"},
		"bad role":       {"alice", "admin;x", ti.secret, http.StatusBadRequest, "role"},
		"no user":        {"", "admin", ti.secret, http.StatusBadRequest, "user"},
	} {
		resp, page := ti.signIn(t, authParamsFor(verifier, "st-9"), c.user, c.roles, c.password)
		f := parsePage(t, page)
		if resp.StatusCode != c.status || resp.Header.Get("Location") != "" || !strings.Contains(page, c.says) ||
			f.action != "/authorize" || f.hidden.Get("code_challenge") == "" || strings.Contains(page, ti.secret) {
			t.Errorf("%s: %s Location %q: want %d, the form again saying %q, without the secret:\n%s",
				name, resp.Status, resp.Header.Get("Location"), c.status, c.says, page)
		}
	}

	// Cancel.
	resp, page := ti.do(t, http.MethodPost, ti.URL+"/authorize", func() url.Values {
		v := authParamsFor(verifier, "st-9")
		v.Set("cancel", "1")
		return v
	}(), nil)
	if loc, _ := url.Parse(resp.Header.Get("Location")); resp.StatusCode != http.StatusSeeOther || loc == nil || loc.Query().Get("error") != "access_denied" {
		t.Errorf("cancel: %s Location %q: want a redirect with access_denied: %s", resp.Status, resp.Header.Get("Location"), page)
	}
	// A form whose hidden redirect_uri was changed to another host.
	tampered := authParamsFor(verifier, "st-9")
	tampered.Set("redirect_uri", "https://evil.example/cb")
	tampered.Set("user", "alice")
	tampered.Set("password", ti.secret)
	if resp, page := ti.do(t, http.MethodPost, ti.URL+"/authorize", tampered, nil); resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Location") != "" {
		t.Errorf("tampered form: %s Location %q, want 400 on the page: %s", resp.Status, resp.Header.Get("Location"), page)
	}
	// The form posted by a page of another site.
	cross := authParamsFor(verifier, "st-9")
	cross.Set("user", "alice")
	cross.Set("password", ti.secret)
	if resp, _ := ti.do(t, http.MethodPost, ti.URL+"/authorize", cross, http.Header{"Sec-Fetch-Site": {"cross-site"}, "Origin": {"https://evil.example"}}); resp.StatusCode != http.StatusForbidden || resp.Header.Get("Location") != "" {
		t.Errorf("a cross-site form post: %s Location %q, want 403", resp.Status, resp.Header.Get("Location"))
	}
}

// TestCORS: discovery, /keys and /token answer a loopback origin's
// preflight and requests with its origin in Access-Control-Allow-Origin
// (and Vary: Origin, no credentials); another origin's preflight is
// refused and its requests carry no CORS header.
func TestCORS(t *testing.T) {
	t.Parallel()
	ti := startIssuer(t)
	for _, path := range []string{"/.well-known/openid-configuration", "/keys", "/token"} {
		method := http.MethodGet
		if path == "/token" {
			method = http.MethodPost
		}
		for origin, allowed := range map[string]bool{
			"https://127.0.0.1:8443": true, "http://localhost:5173": true, "https://[::1]:8443": true,
			"https://evil.example": false, "null": false, "https://127.0.0.1.evil.example": false, "http://10.1.2.3:8443": false,
		} {
			resp, body := ti.do(t, http.MethodOptions, ti.URL+path, nil, http.Header{
				"Origin": {origin}, "Access-Control-Request-Method": {method}, "Access-Control-Request-Headers": {"content-type"},
			})
			acao := resp.Header.Get("Access-Control-Allow-Origin")
			vary := resp.Header.Values("Vary")
			if allowed && (resp.StatusCode != http.StatusNoContent || acao != origin || !strings.Contains(resp.Header.Get("Access-Control-Allow-Methods"), method) ||
				!strings.EqualFold(resp.Header.Get("Access-Control-Allow-Headers"), "content-type") || !slices.Contains(vary, "Origin")) {
				t.Errorf("preflight %s from %s: %s %v, want 204 allowing the origin, %s and content-type", path, origin, resp.Status, resp.Header, method)
			}
			if !allowed && (resp.StatusCode != http.StatusForbidden || acao != "") {
				t.Errorf("preflight %s from %s: %s %v %s, want 403 without Access-Control-Allow-Origin", path, origin, resp.Status, resp.Header, body)
			}
			if resp.Header.Get("Access-Control-Allow-Credentials") != "" {
				t.Errorf("preflight %s from %s allows credentials", path, origin)
			}

			var form url.Values
			if method == http.MethodPost {
				form = url.Values{"grant_type": {"authorization_code"}}
			}
			resp, _ = ti.do(t, method, ti.URL+path, form, http.Header{"Origin": {origin}})
			if got := resp.Header.Get("Access-Control-Allow-Origin"); allowed != (got == origin) || (!allowed && got != "") || !slices.Contains(resp.Header.Values("Vary"), "Origin") {
				t.Errorf("%s %s from %s: Access-Control-Allow-Origin %q, Vary %v; want the origin echoed: %v", method, path, origin, got, resp.Header.Values("Vary"), allowed)
			}
		}
	}
	// The login form is no CORS endpoint.
	resp, _ := ti.do(t, http.MethodGet, ti.URL+"/authorize?client_id=x", nil, http.Header{"Origin": {"https://127.0.0.1:8443"}})
	if resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Error("GET /authorize answers CORS")
	}
}

// TestCodeTableBounded: at most MaxCodes codes wait; expired ones make
// room; a code is taken once.
func TestCodeTableBounded(t *testing.T) {
	t.Parallel()
	var tab codeTable
	now := time.Now()
	var first string
	for i := range MaxCodes {
		c, err := tab.put(now, grant{user: "u"})
		if err != nil {
			t.Fatalf("code %d: %v", i, err)
		}
		if i == 0 {
			first = c
		}
	}
	if _, err := tab.put(now.Add(CodeTTL-time.Second), grant{}); !errors.Is(err, errTooManyCodes) {
		t.Fatalf("code %d: %v, want %v", MaxCodes+1, err, errTooManyCodes)
	}
	if _, err := tab.put(now.Add(CodeTTL), grant{}); err != nil {
		t.Fatalf("a code once the others expired: %v", err)
	}
	if n := len(tab.m); n != 1 {
		t.Errorf("%d codes after pruning, want 1", n)
	}
	if _, ok := tab.take(first); ok {
		t.Error("an expired, pruned code was taken")
	}
	// An authorization request of too many bytes is refused.
	ti := startIssuer(t)
	resp, _ := ti.do(t, http.MethodGet, ti.URL+"/authorize?state="+strings.Repeat("x", maxQuery), nil, nil)
	if resp.StatusCode != http.StatusRequestURITooLong {
		t.Errorf("a long query: %s, want 414", resp.Status)
	}
	resp, _ = ti.do(t, http.MethodPost, ti.URL+"/token", url.Values{"grant_type": {"authorization_code"}, "code": {strings.Repeat("x", maxForm)}}, nil)
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a long token request: %s, want 400", resp.Status)
	}
}

// TestWrongSecretsAreLimited: a burst of wrong client secrets is logged and
// then refused without comparing (429, slow_down), the right secret too,
// until the budget refills.
func TestWrongSecretsAreLimited(t *testing.T) {
	ti := startIssuer(t)
	var logs strings.Builder
	var mu sync.Mutex
	ti.Logger = slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &mu}, nil))
	cc := url.Values{"grant_type": {"client_credentials"}, "user": {"bob"}, "roles": {"viewer"}}
	with := func(secret string) http.Header {
		req, _ := http.NewRequest(http.MethodPost, "/", nil)
		req.SetBasicAuth(Audience, secret)
		return req.Header
	}
	limited := 0
	for range failedBurst + 10 {
		resp, _ := ti.do(t, http.MethodPost, ti.URL+"/token", cc, with("guess"))
		if resp.StatusCode == http.StatusTooManyRequests {
			limited++
		}
	}
	if limited == 0 {
		t.Fatalf("%d wrong secrets in a burst: none refused without comparing", failedBurst+10)
	}
	if resp, body := ti.do(t, http.MethodPost, ti.URL+"/token", cc, with(ti.secret)); resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(body, "slow_down") {
		t.Errorf("the right secret right after the burst: %s %s, want 429 slow_down", resp.Status, body)
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(logs.String(), "dev-issuer: refused") || !strings.Contains(logs.String(), "wrong secret") {
		t.Errorf("no log line of the refusals:\n%s", logs.String())
	}
}

type lockedWriter struct {
	w  *strings.Builder
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
