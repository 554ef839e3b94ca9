// Package ui serves the operator web UI that every agent offers on its API
// port at /ui/: the assets built from ui/src (TypeScript, bundled by
// esbuild into ui/dist by make build) are embedded in the binary. The UI
// is a client of the same Connect APIs as pvcli, with the caller's own
// credentials; this package serves code and the login settings only, never
// data. ui/DESIGN.md says why it is built this way.
package ui

import (
	"bytes"
	"embed"
	"encoding/json"
	"fmt"
	"io/fs"
	"mime"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"
)

// Prefix is the path the UI is served under.
const Prefix = "/ui/"

//go:embed all:dist
var dist embed.FS

// Config is what the browser needs before its first call: how to log in.
// It is public (served without credentials), so it holds nothing secret.
type Config struct {
	// IssuerURL is the OIDC issuer of auth.oidc (the login is the
	// authorization code flow with PKCE); empty: the browser's client
	// certificate is the login.
	IssuerURL string `json:"issuer_url,omitempty"`
	// ClientID is the UI's OIDC client ID.
	ClientID string `json:"client_id,omitempty"`
	// Scopes are asked for at login ("openid" at least).
	Scopes []string `json:"scopes,omitempty"`
	// AccessControlOff says the API port admits every caller without
	// credentials (no TLS and no auth configured): the console needs no
	// login and says so. Nothing secret: any caller learns it by calling.
	AccessControlOff bool `json:"access_control_off,omitempty"`
	// ConnectOrigins are origins the page may connect to besides the
	// agent and the issuer (an identity provider whose token endpoint is
	// on another origin). Not sent to the browser: they go into the
	// Content-Security-Policy.
	ConnectOrigins []string `json:"-"`
}

// Handler serves the UI under Prefix: the hashed assets with a year's
// cache, index.html (for every other path under Prefix, so a shared URL
// such as /ui/vms/web-1 loads the application) and config.json without
// caching. Every answer carries a strict Content-Security-Policy: scripts
// and styles only from the agent, connections only to the agent and the
// OIDC issuer, no framing. config is called per request: a reload of the
// agent's configuration shows at once.
// A nil Config from config (the UI is turned off) answers 404.
func Handler(config func() *Config) http.Handler {
	sub, err := fs.Sub(dist, "dist")
	if err != nil {
		panic(err) // the embed pattern guarantees the directory
	}
	index, err := fs.ReadFile(sub, "index.html")
	if err != nil {
		index = []byte(missingBuild)
	}
	return &handler{files: sub, index: index, config: config}
}

// missingBuild is served when the binary was built without the UI's
// assets (go build before make build ever ran on a fresh clone).
const missingBuild = `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>PiVirt</title></head>` +
	`<body><p>This agent was built without its web UI: run make build.</p></body></html>`

type handler struct {
	files  fs.FS
	index  []byte
	config func() *Config
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "the UI answers GET and HEAD only", http.StatusMethodNotAllowed)
		return
	}
	cfg := h.config()
	if cfg == nil {
		http.NotFound(w, r)
		return
	}
	securityHeaders(w.Header(), cfg)
	rel := strings.TrimPrefix(r.URL.Path, Prefix)
	switch {
	case rel == "config.json":
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(cfg)
	case strings.HasPrefix(rel, "assets/"):
		h.asset(w, r, rel)
	default:
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		http.ServeContent(w, r, "index.html", time.Time{}, bytes.NewReader(h.index))
	}
}

// asset serves a file of dist/assets: its name carries a hash of its
// content, so it may be cached for a year and never revalidated. A browser
// that accepts gzip gets the build's compressed copy (name.gz).
func (h *handler) asset(w http.ResponseWriter, r *http.Request, rel string) {
	name := path.Clean(rel)
	if !fs.ValidPath(name) || !strings.HasPrefix(name, "assets/") {
		http.NotFound(w, r)
		return
	}
	data, err := fs.ReadFile(h.files, name)
	if err != nil || strings.HasSuffix(name, ".gz") {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	w.Header().Add("Vary", "Accept-Encoding")
	if acceptsGzip(r) {
		if gz, err := fs.ReadFile(h.files, name+".gz"); err == nil {
			// The type of the file, not of its compressed copy.
			if ct := mime.TypeByExtension(path.Ext(name)); ct != "" {
				w.Header().Set("Content-Type", ct)
			}
			w.Header().Set("Content-Encoding", "gzip")
			http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(gz))
			return
		}
	}
	http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(data))
}

// acceptsGzip reports whether the request's Accept-Encoding names gzip
// (without q=0).
func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		enc, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.EqualFold(strings.TrimSpace(enc), "gzip") {
			q := strings.ReplaceAll(params, " ", "")
			return q != "q=0" && q != "q=0.0" && q != "q=0.00" && q != "q=0.000"
		}
	}
	return false
}

// securityHeaders sets the policy of every answer. The issuer's origin
// (discovery, keys, token) and server.ui.connect_origins are the only
// other places the page may connect to; the login itself is a top-level
// navigation.
func securityHeaders(h http.Header, cfg *Config) {
	connect := "'self'"
	if o := origin(cfg.IssuerURL); o != "" {
		connect += " " + o
	}
	for _, c := range cfg.ConnectOrigins {
		if o := origin(c); o != "" {
			connect += " " + o
		}
	}
	h.Set("Content-Security-Policy", fmt.Sprintf("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; font-src 'self'; connect-src %s; "+
		"manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'", connect))
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
}

// origin is scheme://host[:port] of u, or "" when u is not an absolute
// http(s) URL.
func origin(u string) string {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "https" && p.Scheme != "http") || p.Host == "" {
		return ""
	}
	return p.Scheme + "://" + p.Host
}

// Root answers / on the API port: a browser (a GET whose Accept names
// text/html) is sent to the UI; anything else (API clients, probes) gets
// 404 as before.
func Root() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.Header.Get("Accept"), "text/html") {
			http.Redirect(w, r, Prefix, http.StatusFound)
			return
		}
		http.NotFound(w, r)
	})
}
