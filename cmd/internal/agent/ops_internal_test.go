package agent

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// TestManagementCallers: /reload and /debug/* answer the callers of
// server.metrics.management_allow_from (127.0.0.1 and ::1 by default, not
// the rest of 127.0.0.0/8), everyone with allow_remote_management, a Host
// that is an address or localhost only (DNS rebinding), and no browser's
// cross-site POST.
func TestManagementCallers(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	for _, tc := range []struct {
		name    string
		method  string
		remote  string
		host    string
		headers map[string]string
		allow   bool
		from    []string
		want    int
	}{
		{name: "loopback v4", remote: "127.0.0.1:5000", want: http.StatusOK},
		{name: "loopback v6", remote: "[::1]:5000", want: http.StatusOK},
		{name: "localhost by name", remote: "127.0.0.1:5000", host: "localhost:8444", want: http.StatusOK},
		{name: "another loopback address", remote: "127.0.0.2:5000", want: http.StatusForbidden},
		{name: "v4-mapped loopback", remote: "[::ffff:127.0.0.1]:5000", want: http.StatusOK},
		{name: "remote", remote: "10.0.0.7:5000", want: http.StatusForbidden},
		{name: "remote allowed", remote: "10.0.0.7:5000", allow: true, want: http.StatusOK},
		{name: "remote named", remote: "10.0.0.7:5000", from: []string{"10.0.0.0/8"}, want: http.StatusOK},
		{name: "loopback not named", remote: "127.0.0.1:5000", from: []string{"10.0.0.0/8"}, want: http.StatusForbidden},
		{name: "rebinding host", remote: "127.0.0.1:5000", host: "evil.example:8444", want: http.StatusForbidden},
		{name: "rebinding host, remote allowed", remote: "10.0.0.7:5000", host: "evil.example:8444", allow: true, want: http.StatusForbidden},
		{name: "curl POST", method: http.MethodPost, remote: "127.0.0.1:5000", want: http.StatusOK},
		{name: "cross-site POST", method: http.MethodPost, remote: "127.0.0.1:5000",
			headers: map[string]string{"Origin": "http://evil.example", "Content-Type": "text/plain"}, want: http.StatusForbidden},
		{name: "cross-site POST by fetch metadata", method: http.MethodPost, remote: "127.0.0.1:5000",
			headers: map[string]string{"Sec-Fetch-Site": "cross-site"}, want: http.StatusForbidden},
		{name: "cross-site GET (an <img> starting a profile)", remote: "127.0.0.1:5000",
			headers: map[string]string{"Sec-Fetch-Site": "cross-site"}, want: http.StatusForbidden},
		{name: "localhost with a trailing dot", remote: "127.0.0.1:5000", host: "localhost.:8444", want: http.StatusOK},
		{name: "this host's name", remote: "127.0.0.1:5000", host: hostname(t) + ":8444", want: http.StatusOK},
		{name: "link-local caller with a zone", remote: "[fe80::1%eth0]:5000", from: []string{"fe80::/10"}, want: http.StatusOK},
		{name: "mapped prefix", remote: "10.0.0.7:5000", from: []string{"::ffff:10.0.0.0/104"}, want: http.StatusOK},
		{name: "same-origin POST", method: http.MethodPost, remote: "127.0.0.1:5000",
			headers: map[string]string{"Origin": "http://127.0.0.1:8444", "Sec-Fetch-Site": "same-origin"}, want: http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.Server.Metrics.AllowRemoteManagement = tc.allow
			if tc.from != nil {
				cfg.Server.Metrics.ManagementAllowFrom = tc.from
			}
			a := &Agent{cfg: cfg}
			method := tc.method
			if method == "" {
				method = http.MethodGet
			}
			req := httptest.NewRequest(method, "/reload", nil)
			req.RemoteAddr = tc.remote
			req.Host = "127.0.0.1:8444"
			if tc.host != "" {
				req.Host = tc.host
			}
			for k, v := range tc.headers {
				req.Header.Set(k, v)
			}
			rec := httptest.NewRecorder()
			a.management(ok).ServeHTTP(rec, req)
			if rec.Code != tc.want {
				t.Errorf("%d (%s), want %d", rec.Code, strings.TrimSpace(rec.Body.String()), tc.want)
			}
		})
	}
}

// TestDebugVarsWithoutCommandLine: /debug/vars serves expvar's variables
// but not the command line.
func TestDebugVarsWithoutCommandLine(t *testing.T) {
	rec := httptest.NewRecorder()
	debugVars(rec, httptest.NewRequest(http.MethodGet, "/debug/vars", nil))
	var vars map[string]json.RawMessage
	if err := json.Unmarshal(rec.Body.Bytes(), &vars); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, rec.Body.String())
	}
	if _, ok := vars["memstats"]; !ok {
		t.Error("memstats missing")
	}
	if _, ok := vars["cmdline"]; ok || strings.Contains(rec.Body.String(), os.Args[0]) {
		t.Error("the command line is served")
	}
}

func hostname(t *testing.T) string {
	h, err := os.Hostname()
	if err != nil {
		t.Skip(err)
	}
	return h
}

// TestRBACResetIsLoopbackOnly: the break-glass endpoint answers callers on
// this host only, even where the operations port's other management
// endpoints are opened to the network.
func TestRBACResetIsLoopbackOnly(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	for remote, want := range map[string]int{
		"127.0.0.1:5000":          http.StatusOK,
		"[::1]:5000":              http.StatusOK,
		"[::ffff:127.0.0.1]:5000": http.StatusOK,
		"10.0.0.7:5000":           http.StatusForbidden,
		"[fe80::1%eth0]:5000":     http.StatusForbidden,
	} {
		cfg := config.Default()
		cfg.Server.Metrics.AllowRemoteManagement = true
		a := &Agent{cfg: cfg}
		req := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:8444/rbac/reset", nil)
		req.RemoteAddr = remote
		rec := httptest.NewRecorder()
		a.management(loopbackOnly(ok)).ServeHTTP(rec, req)
		if rec.Code != want || want != http.StatusOK && !strings.Contains(rec.Body.String(), "answers callers on this host only") {
			t.Errorf("%s: %d %s, want %d", remote, rec.Code, rec.Body, want)
		}
	}
}
