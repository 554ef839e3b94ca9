package ui

import (
	"compress/gzip"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
)

func get(t *testing.T, h http.Handler, path string, hdr ...string) *http.Response {
	t.Helper()
	req := httptest.NewRequest(http.MethodGet, path, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Result()
}

func body(t *testing.T, r *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestServesBuiltAssets(t *testing.T) {
	cfg := &Config{IssuerURL: "http://127.0.0.1:5556/dex", ClientID: "pivirt-ui", Scopes: []string{"openid"}, ConnectOrigins: []string{"https://oauth2.example.com"}}
	h := Handler(func() *Config { return cfg })

	// Every path under /ui/ that is not an asset is the application, so a
	// shared URL opens its view.
	for _, p := range []string{"/ui/", "/ui/vms/vm-1", "/ui/schedules/nightly"} {
		r := get(t, h, p)
		if r.StatusCode != http.StatusOK || !strings.Contains(r.Header.Get("Content-Type"), "text/html") {
			t.Fatalf("%s: %d %s", p, r.StatusCode, r.Header.Get("Content-Type"))
		}
		if cc := r.Header.Get("Cache-Control"); cc != "no-cache" {
			t.Errorf("%s: Cache-Control %q, want no-cache", p, cc)
		}
	}
	html := body(t, get(t, h, "/ui/"))
	refs := regexp.MustCompile(`/ui/(assets/[A-Za-z0-9._-]+)`).FindAllStringSubmatch(html, -1)
	if len(refs) < 2 {
		t.Fatalf("index.html names %d assets, want the script and the stylesheet:\n%s", len(refs), html)
	}
	for _, m := range refs {
		r := get(t, h, "/ui/"+m[1])
		if r.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d", m[1], r.StatusCode)
		}
		if cc := r.Header.Get("Cache-Control"); !strings.Contains(cc, "immutable") {
			t.Errorf("%s: Cache-Control %q, want immutable (hashed name)", m[1], cc)
		}
		ct := r.Header.Get("Content-Type")
		if !strings.Contains(ct, "javascript") && !strings.Contains(ct, "css") {
			t.Errorf("%s: Content-Type %q", m[1], ct)
		}
	}

	// The policy: only the agent's scripts and styles; connections to the
	// agent and the issuer; no framing; no inline script.
	csp := get(t, h, "/ui/").Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self' http://127.0.0.1:5556 https://oauth2.example.com;", "frame-ancestors 'none'", "base-uri 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("Content-Security-Policy %q lacks %q", csp, want)
		}
	}
	if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "unsafe-eval") {
		t.Errorf("Content-Security-Policy allows inline code: %q", csp)
	}
	if strings.Contains(html, "<script>") || strings.Contains(html, " style=") {
		t.Errorf("index.html has inline script or style, which the policy refuses:\n%s", html)
	}

	r := get(t, h, "/ui/config.json")
	if r.Header.Get("Cache-Control") != "no-store" {
		t.Errorf("config.json Cache-Control %q", r.Header.Get("Cache-Control"))
	}
	// How to log in, and nothing else (it is served without
	// credentials).
	var got map[string]any
	if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got["issuer_url"] != cfg.IssuerURL || got["client_id"] != "pivirt-ui" {
		t.Errorf("config.json = %v, want issuer_url, client_id and scopes only", got)
	}

	// The compressed copy, for a browser that takes it.
	js := refs[0][1]
	for _, m := range refs {
		if strings.HasSuffix(m[1], ".js") {
			js = m[1]
		}
	}
	plain := body(t, get(t, h, "/ui/"+js))
	r = get(t, h, "/ui/"+js, "Accept-Encoding", "gzip, deflate, br")
	if r.Header.Get("Content-Encoding") != "gzip" || !strings.Contains(r.Header.Get("Content-Type"), "javascript") {
		t.Fatalf("%s with Accept-Encoding gzip: Content-Encoding %q, Content-Type %q", js, r.Header.Get("Content-Encoding"), r.Header.Get("Content-Type"))
	}
	zr, err := gzip.NewReader(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	unzipped, err := io.ReadAll(zr)
	if err != nil || string(unzipped) != plain {
		t.Fatalf("the gzip copy of %s differs from the file (%v)", js, err)
	}
	if r := get(t, h, "/ui/"+js, "Accept-Encoding", "gzip;q=0"); r.Header.Get("Content-Encoding") != "" {
		t.Errorf("gzip;q=0 got Content-Encoding %q", r.Header.Get("Content-Encoding"))
	}

	for _, p := range []string{"/ui/assets/missing.js", "/ui/assets/../ui.go", "/ui/assets/", "/ui/" + js + ".gz"} {
		if r := get(t, h, p); r.StatusCode != http.StatusNotFound {
			t.Errorf("%s: %d, want 404", p, r.StatusCode)
		}
	}
	req := httptest.NewRequest(http.MethodPost, "/ui/", nil)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /ui/: %d, want 405", rec.Code)
	}
}

func TestDisabled(t *testing.T) {
	h := Handler(func() *Config { return nil })
	if r := get(t, h, "/ui/"); r.StatusCode != http.StatusNotFound {
		t.Fatalf("a disabled UI answered %d, want 404", r.StatusCode)
	}
}

func TestCertificateLoginHasNoIssuerInPolicy(t *testing.T) {
	h := Handler(func() *Config { return &Config{} })
	csp := get(t, h, "/ui/").Header.Get("Content-Security-Policy")
	if !strings.Contains(csp, "connect-src 'self';") {
		t.Errorf("without an issuer the page connects to the agent only; policy %q", csp)
	}
}

func TestRootSendsBrowsersToTheUI(t *testing.T) {
	h := Root()
	r := get(t, h, "/", "Accept", "text/html,application/xhtml+xml")
	if r.StatusCode != http.StatusFound || r.Header.Get("Location") != Prefix {
		t.Fatalf("browser at /: %d Location %q", r.StatusCode, r.Header.Get("Location"))
	}
	if r := get(t, h, "/", "Accept", "application/json"); r.StatusCode != http.StatusNotFound {
		t.Fatalf("API client at /: %d, want 404", r.StatusCode)
	}
}

// TestAccessControlOff: an agent without access control says so in
// config.json, and nothing else besides how to log in.
func TestAccessControlOff(t *testing.T) {
	h := Handler(func() *Config { return &Config{Scopes: []string{"openid"}, AccessControlOff: true} })
	var got map[string]any
	if err := json.NewDecoder(get(t, h, "/ui/config.json").Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["access_control_off"] != true {
		t.Errorf("config.json = %v, want scopes and access_control_off: true", got)
	}
	// Any other setup keeps the login: the key is not sent.
	h = Handler(func() *Config { return &Config{Scopes: []string{"openid"}} })
	got = nil
	if err := json.NewDecoder(get(t, h, "/ui/config.json").Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if _, ok := got["access_control_off"]; ok {
		t.Errorf("config.json = %v, want no access_control_off", got)
	}
}
