package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
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
	// The command line is not served; a browser's cross-site POST /reload
	// and a name that is not an address (DNS rebinding) are refused.
	if code, body := get(t, base+"/debug/pprof/cmdline"); code != http.StatusNotFound {
		t.Errorf("GET /debug/pprof/cmdline: %d %q, want 404", code, body)
	}
	if code, body := get(t, base+"/debug/vars"); strings.Contains(body, `"cmdline"`) {
		t.Errorf("GET /debug/vars (%d) serves the command line", code)
	}
	for name, set := range map[string]func(*http.Request){
		"cross-site": func(r *http.Request) {
			r.Header.Set("Origin", "http://evil.example")
			r.Header.Set("Content-Type", "text/plain")
		},
		"rebinding host": func(r *http.Request) { r.Host = "evil.example" },
	} {
		req, _ := http.NewRequest(http.MethodPost, base+"/reload", strings.NewReader("{}"))
		set(req)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("POST /reload, %s: %d, want 403", name, resp.StatusCode)
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

// TestMetricsLint runs promtool check metrics on what /metrics serves
// after calls of every kind (CI installs Debian's prometheus package;
// elsewhere the test is skipped without promtool), and checks the spec's
// names are there.
func TestMetricsLint(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool is not installed (.ci/run installs Debian's prometheus package)")
		}
		t.Skip("promtool is not installed")
	}
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, withBackends(s.addr))
	n := c.WaitLeader(20 * time.Second)
	conn := dialPlain(t, n.APIAddr())
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	vm, err := vmv1.NewVMServiceClient(conn).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "m", Vcpus: 1, MemoryMib: 128}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vmv1.NewVMServiceClient(conn).GetVM(ctx, &vmv1.GetVMRequest{Id: "vm-missing"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetVM of a missing VM: %v", err)
	}
	if _, err := schedulev1.NewScheduleServiceClient(conn).CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		VmId: vm.GetVm().GetId(), Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@daily", Enabled: true}}); err != nil {
		t.Fatal(err)
	}
	if _, err := agenttest.Register(ctx, n, "web", "web-1", "10.0.0.1", 80); err != nil {
		t.Fatal(err)
	}
	code, body := get(t, "http://"+n.MetricsAddr()+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d", code)
	}
	for _, name := range []string{
		"service_discovery_services 1", `service_discovery_instances{health="passing",service="web"} 1`, `pivirt_gossip_members{state="alive"} 1`,
		"pivirt_raft_leader 1", "pivirt_raft_term ", "pivirt_raft_commit_index ", "pivirt_raft_applied_index ", "pivirt_raft_last_contact_seconds 0",
		"pivirt_raft_apply_duration_seconds_count",
		`pivirt_api_requests_total{code="ok",method="CreateVM",service="pivirt.vm.v1.VMService"} 1`,
		`pivirt_api_requests_total{code="not_found",method="GetVM",service="pivirt.vm.v1.VMService"} 1`,
		`pivirt_api_requests_total{code="ok",method="CreateSchedule",service="pivirt.schedule.v1.ScheduleService"} 1`,
		"pivirt_api_request_duration_seconds_bucket", "pivirt_mesh_requests_total", "pivirt_mesh_request_duration_seconds",
		"pivirt_mesh_active_connections", "pivirt_schedule_lateness_seconds",
	} {
		if !strings.Contains(body, name) {
			t.Errorf("/metrics has no %s", name)
		}
	}
	cmd := exec.CommandContext(ctx, promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// TestRequestIDs: every API call gets a request ID — the caller's, or a
// new one — returned in the response, passed to the backend, and on the
// access log line of the call (logging.access_log.enabled).
func TestRequestIDs(t *testing.T) {
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		cfg.Logging.AccessLog.Enabled = true
	})
	n := c.WaitLeader(20 * time.Second)
	conn := dialPlain(t, n.APIAddr())
	vms := vmv1.NewVMServiceClient(conn)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	// Given by the caller: kept, returned, and sent on to the backend.
	var hdr metadata.MD
	_, err := vms.ListVMs(metadata.AppendToOutgoingContext(ctx, "x-request-id", "req-given-1", sim.EchoHeader, "1"), &vmv1.ListVMsRequest{}, grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if got := hdr.Get("x-request-id"); len(got) == 0 || got[0] != "req-given-1" {
		t.Errorf("response x-request-id %v, want req-given-1", got)
	}
	if got := hdr.Get(sim.RequestIDHeader); len(got) != 1 || got[0] != "req-given-1" {
		t.Errorf("the backend received x-request-id %v, want req-given-1", got)
	}
	// Not given, on a call to the backend: made, returned, and the same
	// one sent on to the backend.
	hdr = nil
	if _, err := vms.ListVMs(metadata.AppendToOutgoingContext(ctx, sim.EchoHeader, "1"), &vmv1.ListVMsRequest{}, grpc.Header(&hdr)); err != nil {
		t.Fatal(err)
	}
	if made, sent := hdr.Get("x-request-id"), hdr.Get(sim.RequestIDHeader); len(made) != 1 || len(made[0]) != 24 || len(sent) != 1 || sent[0] != made[0] {
		t.Errorf("a call without an ID: answered with x-request-id %v, the backend got %v; want one new 24-hex-digit ID, the same", made, sent)
	}
	// Not given: made, and returned.
	hdr = nil
	if _, err := clusterv1.NewClusterServiceClient(conn).Leader(ctx, &clusterv1.LeaderRequest{}, grpc.Header(&hdr)); err != nil {
		t.Fatal(err)
	}
	made := hdr.Get("x-request-id")
	if len(made) == 0 || len(made[0]) != 24 {
		t.Fatalf("response x-request-id %v, want a new 24-hex-digit ID", made)
	}
	// Connect: the same, in HTTP headers.
	api := agenttest.NewClient(agenttest.NewHTTPClient(), n.APIAddr())
	req := connect.NewRequest(&clusterv1.LeaderRequest{})
	req.Header().Set("X-Request-Id", "req-connect-2")
	resp, err := api.Leader(ctx, req)
	if err != nil || resp.Header().Get("X-Request-Id") != "req-connect-2" {
		t.Errorf("Connect response X-Request-Id %q (%v), want req-connect-2", resp.Header().Get("X-Request-Id"), err)
	}
	agenttest.Eventually(t, 10*time.Second, "access log lines", func() error {
		for _, want := range []string{
			`log=access method=/pivirt.vm.v1.VMService/ListVMs protocol=grpc code=ok`,
			`request_id=req-given-1`, `request_id=req-connect-2`, "request_id=" + made[0],
		} {
			if !c.Logs().Contains(want) {
				return fmt.Errorf("no access log line with %s", want)
			}
		}
		return nil
	})
}

// TestReloadConfig: a reloaded configuration applies what can change live
// (routing.rules here), names the keys that need a restart, and is
// refused whole when a live part cannot be applied (a route to a backend
// that does not run), the running configuration staying.
func TestReloadConfig(t *testing.T) {
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, withBackends(s.addr))
	n := c.WaitLeader(20 * time.Second)
	conn := dialPlain(t, n.APIAddr())
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	vols := storagev1.NewStorageServiceClient(conn)
	if _, err := vols.ListVolumes(ctx, &storagev1.ListVolumesRequest{}); err != nil {
		t.Fatal(err)
	}

	bad := *n.Cfg
	bad.Routing.Rules = append(slices.Clone(n.Cfg.Routing.Rules), config.RouteRule{Match: config.RouteMatch{Prefix: "/pivirt.network.v1.NetworkService"}, Route: config.RouteTarget{Cluster: "netd"}})
	if _, _, err := n.ReloadConfig(&bad); err == nil || !strings.Contains(err.Error(), `routing.rules[2].route.cluster: "netd" is not a running backend`) {
		t.Errorf("a route to a backend that does not run: %v", err)
	}
	if _, err := vols.ListVolumes(ctx, &storagev1.ListVolumesRequest{}); err != nil {
		t.Errorf("after a refused reload the volumes route is gone: %v", err)
	}

	next := *n.Cfg
	next.Routing.Rules = n.Cfg.Routing.Rules[:1] // the VM API only
	next.Server.Metrics.Addr = "127.0.0.1:1"
	next.Logging.Level = "warn"
	applied, restart, err := n.ReloadConfig(&next)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(applied, []string{"logging.level", "routing.rules"}) || !slices.Equal(restart, []string{"server.metrics.addr"}) {
		t.Errorf("applied %v, restart required %v", applied, restart)
	}
	if _, err := vols.ListVolumes(ctx, &storagev1.ListVolumesRequest{}); status.Code(err) != codes.Unimplemented {
		t.Errorf("the volumes route after it was removed: %v, want Unimplemented", err)
	}
	if _, err := vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
		t.Errorf("the VM route after the reload: %v", err)
	}
	agenttest.Eventually(t, 10*time.Second, "the removed route's health", func() error {
		r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "pivirt.storage.v1.StorageService"})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
			return fmt.Errorf("%v %v, want NOT_SERVING", r, err)
		}
		return nil
	})
	// Backends, load balancing and circuit breaking: new backend clusters
	// replace the old ones.
	lb := next
	lb.Backends = map[string]config.BackendConfig{}
	for k, v := range next.Backends {
		v.Timeout = config.Duration(3 * time.Second)
		lb.Backends[k] = v
	}
	lb.LoadBalancing.Policy = "least_connections"
	lb.CircuitBreaking.Thresholds.Consecutive5xx = 7
	applied, _, err = n.ReloadConfig(&lb)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"backends.iscsiman.timeout", "backends.pivirtd.timeout", "circuit_breaking.thresholds.consecutive_5xx", "load_balancing.policy"} {
		if !slices.Contains(applied, want) {
			t.Errorf("applied %v, want %s among them", applied, want)
		}
	}
	for range 5 {
		if _, err := vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
			t.Errorf("the VM API through the new backend clusters: %v", err)
		}
	}
	if _, body := get(t, "http://"+n.MetricsAddr()+"/metrics"); !strings.Contains(body, `pivirt_mesh_endpoints{service="pivirtd",status="healthy"} 1`) {
		t.Error("the endpoint gauge does not show the new backend cluster")
	}
	next = lb

	// Reloading the same again changes nothing.
	if applied, restart, err := n.ReloadConfig(&next); err != nil || len(applied) != 0 || !slices.Equal(restart, []string{"server.metrics.addr"}) {
		t.Errorf("the same reload again: applied %v, restart %v, %v", applied, restart, err)
	}
}

// TestHandOffOnShutdown: a leader stopping without leaving hands its
// leadership to another voter first (cluster.transfer_leadership_on_shutdown).
func TestHandOffOnShutdown(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(60 * time.Second)
	c.WaitPeers(60*time.Second, 3, 0)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	leader.HandOff(ctx)
	if leader.IsLeader() {
		t.Fatal("still the leader after handing off")
	}
	next := c.WaitLeader(10 * time.Second)
	if next.NodeID() == leader.NodeID() {
		t.Errorf("leadership stayed with %s", leader.Name)
	}
	if !c.Logs().Contains("leadership handed over before shutdown") {
		t.Error("the hand-off was not logged")
	}
}
