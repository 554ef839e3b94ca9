package agent

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// TestManagementLoopbackOnly: /reload and /debug/* refuse a caller from
// another address unless server.metrics.allow_remote_management is set.
func TestManagementLoopbackOnly(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	for _, tc := range []struct {
		remote string
		allow  bool
		want   int
	}{
		{"127.0.0.1:5000", false, http.StatusOK},
		{"[::1]:5000", false, http.StatusOK},
		{"10.0.0.7:5000", false, http.StatusForbidden},
		{"10.0.0.7:5000", true, http.StatusOK},
	} {
		cfg := config.Default()
		cfg.Server.Metrics.AllowRemoteManagement = tc.allow
		a := &Agent{cfg: cfg}
		req := httptest.NewRequest(http.MethodGet, "/debug/vars", nil)
		req.RemoteAddr = tc.remote
		rec := httptest.NewRecorder()
		a.management(ok).ServeHTTP(rec, req)
		if rec.Code != tc.want {
			t.Errorf("%s (allow %v): %d, want %d", tc.remote, tc.allow, rec.Code, tc.want)
		}
	}
}
