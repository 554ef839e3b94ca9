package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
)

// get fetches url and returns its status code and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// TestOperationsEndpoints: each endpoint of the operations port answers
// with its status code and body; /ready follows a required backend.
func TestOperationsEndpoints(t *testing.T) {
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		b := cfg.Backends["pivirtd"]
		b.Required = true
		cfg.Backends["pivirtd"] = b
		cfg.LoadBalancing.HealthCheck = config.HealthCheckConfig{Enabled: true, Interval: config.Duration(100 * time.Millisecond),
			Timeout: config.Duration(100 * time.Millisecond), HealthyThreshold: 1, UnhealthyThreshold: 1}
	})
	n := c.WaitLeader(20 * time.Second)
	base := "http://" + n.MetricsAddr()
	for path, want := range map[string]string{
		"/live":                          `"status":"ok"`,
		"/health":                        `"raft_state":"Leader"`,
		"/debug/vars":                    `"memstats"`,
		"/debug/pprof/":                  "goroutine",
		"/debug/pprof/goroutine?debug=1": "goroutine profile",
		"/metrics":                       "pivirt_",
	} {
		if code, body := get(t, base+path); code != http.StatusOK || !strings.Contains(body, want) {
			t.Errorf("GET %s: %d, want 200 with %q in:\n%.300s", path, code, want, body)
		}
	}
	ready := func() (int, map[string]string) {
		code, body := get(t, base+"/ready")
		var r struct {
			Status string            `json:"status"`
			Checks map[string]string `json:"checks"`
		}
		if err := json.Unmarshal([]byte(body), &r); err != nil {
			t.Fatalf("/ready body %q: %v", body, err)
		}
		return code, r.Checks
	}
	agenttest.Eventually(t, 10*time.Second, "ready", func() error {
		code, checks := ready()
		if code != http.StatusOK {
			return fmt.Errorf("%d %v", code, checks)
		}
		for _, k := range []string{"leader", "fsm", "backend:pivirtd", "backend:iscsiman"} {
			if !strings.HasPrefix(checks[k], "ok") {
				return fmt.Errorf("check %s: %q", k, checks[k])
			}
		}
		return nil
	})
	// The required backend down: not ready, and the body says which.
	s.setServing(t, false)
	agenttest.Eventually(t, 10*time.Second, "not ready without the required backend", func() error {
		code, checks := ready()
		if code != http.StatusServiceUnavailable || !strings.Contains(checks["backend:pivirtd"], "required") || !strings.HasPrefix(checks["leader"], "ok") {
			return fmt.Errorf("%d %v", code, checks)
		}
		return nil
	})
	s.setServing(t, true)
	agenttest.Eventually(t, 10*time.Second, "ready again", func() error {
		if code, checks := ready(); code != http.StatusOK {
			return fmt.Errorf("%d %v", code, checks)
		}
		return nil
	})
	if code, body := httpPost(t, base+"/reload"); code != http.StatusOK || !strings.Contains(body, `"status":"ok"`) {
		t.Errorf("POST /reload: %d %s", code, body)
	}
}

// setServing sets the simulator's grpc.health.v1 status.
func (s *simServer) setServing(t *testing.T, serving bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := s.ctl.SetServing(ctx, &simv1.SetServingRequest{Serving: serving}); err != nil {
		t.Fatal(err)
	}
}
