package mesh

import (
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	// The schemas lookupMethod finds (the agent links them too).
	_ "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	_ "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

func TestParseEndpoint(t *testing.T) {
	for spec, want := range map[string]target{
		"unix:///run/pivirtd/pivirtd.sock": {unixPath: "/run/pivirtd/pivirtd.sock"},
		"dns:///pivirtd.pilab.hu:9001":     {host: "pivirtd.pilab.hu", port: "9001"},
		"pivirtd:9001":                     {host: "pivirtd", port: "9001"},
		"https://osinfodb.pilab.hu:8443":   {host: "osinfodb.pilab.hu", port: "8443", tls: true},
		"https://osinfodb.pilab.hu":        {host: "osinfodb.pilab.hu", port: "443", tls: true},
		"registry:///pivirtd":              {registry: "pivirtd"},
		"[::1]:9001":                       {host: "::1", port: "9001"},
	} {
		got, err := parseEndpoint(spec)
		if err != nil || got != want {
			t.Errorf("parseEndpoint(%q) = %+v, %v; want %+v", spec, got, err, want)
		}
	}
	for _, bad := range []string{"unix://relative.sock", "dns:///nohost", "http://x:1", "registry:///", "registry:///a/b", "justahost", "https://x/path"} {
		if _, err := parseEndpoint(bad); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("parseEndpoint(%q) = %v, want an error naming it", bad, err)
		}
	}
}

// TestDNSEndpoints: a host name resolves to one endpoint per address.
func TestDNSEndpoints(t *testing.T) {
	b, err := NewBackend(BackendConfig{Name: "t", Endpoint: "dns:///localhost:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var addrs []string
	for _, e := range b.Endpoints() {
		addrs = append(addrs, e.Addr)
	}
	if len(addrs) == 0 || !strings.Contains(strings.Join(addrs, " "), "127.0.0.1:1") {
		t.Errorf("dns:///localhost:1 → %v, want 127.0.0.1:1 among them", addrs)
	}
	for _, e := range b.Endpoints() {
		if got, want := b.serverName(e.Addr), "localhost"; got != want {
			t.Errorf("server name of %s = %q, want the endpoint's host name %q", e.Addr, got, want)
		}
	}
}

func TestNewBackendRefuses(t *testing.T) {
	for want, cfg := range map[string]BackendConfig{
		"needs the service registry": {Name: "t", Endpoint: "registry:///x"},
		"no TLS configuration":       {Name: "t", Endpoint: "https://x:1"},
		"load-balancing policy":      {Name: "t", Endpoint: "127.0.0.1:1", Policy: "fastest"},
		"circuit breaking needs":     {Name: "t", Endpoint: "127.0.0.1:1", Outlier: Outlier{Enabled: true}},
		"health checks need":         {Name: "t", Endpoint: "127.0.0.1:1", HealthCheck: HealthCheck{Enabled: true}},
	} {
		if _, err := NewBackend(cfg); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("NewBackend(%+v) = %v, want an error containing %q", cfg, err, want)
		}
	}
}

func TestLookupMethod(t *testing.T) {
	type shape struct {
		known, clientStreams, serverStreams, idempotent bool
		verb, getter, listField                         string
	}
	for method, want := range map[string]shape{
		"/pivirt.vm.v1.VMService/GetVM":                  {known: true, idempotent: true, verb: "get", getter: "/pivirt.vm.v1.VMService/GetVM"},
		"/pivirt.vm.v1.VMService/ListVMs":                {known: true, idempotent: true, verb: "list", getter: "/pivirt.vm.v1.VMService/GetVM", listField: "vms"},
		"/pivirt.vm.v1.VMService/CreateVM":               {known: true, verb: "create", getter: "/pivirt.vm.v1.VMService/GetVM"},
		"/pivirt.vm.v1.VMService/PowerOn":                {known: true, verb: "start", getter: "/pivirt.vm.v1.VMService/GetVM"},
		"/pivirt.vm.v1.VMService/WatchVMs":               {known: true, serverStreams: true, idempotent: true, verb: "list", getter: "/pivirt.vm.v1.VMService/GetVM"},
		"/pivirt.vm.v1.VMService/Console":                {known: true, clientStreams: true, serverStreams: true, verb: "console", getter: "/pivirt.vm.v1.VMService/GetVM"},
		"/pivirt.storage.v1.StorageService/UploadVolume": {known: true, clientStreams: true, verb: "update", getter: "/pivirt.storage.v1.StorageService/GetVolume"},
		"/pivirt.nope.v1.Nope/Call":                      {},
		"nonsense":                                       {},
	} {
		m := lookupMethod(method)
		got := shape{known: m.known, clientStreams: m.clientStreams, serverStreams: m.serverStreams, idempotent: m.idempotent,
			verb: m.rule.GetVerb(), getter: m.getter}
		if m.listField != nil {
			got.listField = string(m.listField.Name())
		}
		if got != want {
			t.Errorf("lookupMethod(%q) = %+v, want %+v", method, got, want)
		}
	}
}

func TestIsFailureAndBackoff(t *testing.T) {
	for _, c := range []codes.Code{codes.Unavailable, codes.Internal, codes.Unknown, codes.DataLoss} {
		if !isFailure(c, false) {
			t.Errorf("%s is not a failure", c)
		}
	}
	for _, c := range []codes.Code{codes.OK, codes.NotFound, codes.InvalidArgument, codes.Unimplemented, codes.PermissionDenied, codes.DeadlineExceeded} {
		if isFailure(c, false) {
			t.Errorf("%s counts as a failure of the endpoint", c)
		}
	}
	if !isFailure(codes.DeadlineExceeded, true) {
		t.Error("a per-try timeout is not a failure")
	}
	for n := 1; n <= 20; n++ {
		if d := backoff(10*time.Millisecond, n); d < 0 || d > 100*time.Millisecond {
			t.Errorf("backoff(10ms, %d) = %s, want within [0, 100ms]", n, d)
		}
	}
	if backoff(0, 3) != 0 {
		t.Error("backoff without a base is not zero")
	}
}

func TestHTTPStatus(t *testing.T) {
	for c, want := range map[codes.Code]int{codes.OK: 200, codes.NotFound: 404, codes.Unavailable: 503, codes.ResourceExhausted: 429, codes.DataLoss: 500, codes.Unauthenticated: 401} {
		if got := HTTPStatus(c); got != want {
			t.Errorf("HTTPStatus(%s) = %d, want %d", c, got, want)
		}
	}
}

// fakeClock is a settable clock for ejections.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time { return c.now }

// ejectionBackend is a backend of n unix endpoints (never dialled: only
// the ejection bookkeeping runs) with consecutive_5xx 2.
func ejectionBackend(t *testing.T, n, maxPercent int, clock *fakeClock) *Backend {
	t.Helper()
	b, err := NewBackend(BackendConfig{Name: "t", Endpoint: "unix:///nonexistent/0.sock", Now: clock.Now,
		Outlier: Outlier{Enabled: true, Consecutive5xx: 2, Interval: time.Hour, BaseEjectionTime: 10 * time.Second, MaxEjectionPercent: maxPercent}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	var addrs []string
	for i := range n {
		addrs = append(addrs, "unix:///nonexistent/"+string(rune('a'+i))+".sock")
	}
	if err := b.setAddrs(addrs); err != nil {
		t.Fatal(err)
	}
	return b
}

func statuses(b *Backend) map[string]int {
	out := map[string]int{}
	for _, e := range b.Endpoints() {
		out[e.Status()]++
	}
	return out
}

func TestEjection(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	b := ejectionBackend(t, 4, 50, clock)
	eps := b.Endpoints()
	fail := func(e *Endpoint) { b.report(e, codes.Unavailable, false) }

	// A success in between resets the count.
	fail(eps[0])
	b.report(eps[0], codes.NotFound, false)
	fail(eps[0])
	if eps[0].Status() != "healthy" {
		t.Fatal("ejected without consecutive failures")
	}
	fail(eps[0])
	if eps[0].Status() != "ejected" {
		t.Fatal("not ejected after consecutive_5xx failures")
	}
	// Cancellations and the caller's deadline say nothing.
	for range 5 {
		b.report(eps[1], codes.Canceled, false)
		b.report(eps[1], codes.DeadlineExceeded, false)
	}
	if eps[1].Status() != "healthy" {
		t.Error("cancelled calls or the caller's deadline ejected an endpoint")
	}
	// 50% of 4: a second ejection is allowed, a third is not.
	fail(eps[1])
	fail(eps[1])
	fail(eps[2])
	fail(eps[2])
	if got := statuses(b); got["ejected"] != 2 {
		t.Errorf("statuses %v, want exactly 2 ejected of 4 at 50%%", got)
	}
	// The ejection lasts base_ejection_time, then a sweep ends it.
	clock.now = clock.now.Add(9 * time.Second)
	b.sweep()
	if eps[0].Status() != "ejected" {
		t.Error("back before base_ejection_time")
	}
	clock.now = clock.now.Add(2 * time.Second)
	b.sweep()
	if eps[0].Status() != "healthy" || eps[1].Status() != "healthy" {
		t.Errorf("not back after base_ejection_time: %v", statuses(b))
	}
	// A second ejection lasts twice as long (the multiplier), unless
	// sweeps without an ejection brought it down first.
	fail(eps[0])
	fail(eps[0])
	clock.now = clock.now.Add(11 * time.Second)
	b.sweep()
	if eps[0].Status() != "ejected" {
		t.Error("a second ejection did not last twice base_ejection_time")
	}
	clock.now = clock.now.Add(10 * time.Second)
	b.sweep()
	if eps[0].Status() != "healthy" {
		t.Error("not back after twice base_ejection_time")
	}
}

// TestSoleEndpointNotEjected: a cluster of one endpoint is never emptied
// by ejection (the share after it would exceed any maximum below 100%).
func TestSoleEndpointNotEjected(t *testing.T) {
	b := ejectionBackend(t, 1, 50, &fakeClock{now: time.Unix(1000, 0)})
	e := b.Endpoints()[0]
	for range 10 {
		b.report(e, codes.Internal, false)
	}
	if e.Status() != "healthy" {
		t.Errorf("the only endpoint is %s", e.Status())
	}
	if ep, err := b.pick(nil); err != nil || ep != e {
		t.Errorf("pick = %v, %v", ep, err)
	}
}

// TestPanicRouting: with fewer than half the endpoints available, picks
// spread over all of them.
func TestPanicRouting(t *testing.T) {
	b := ejectionBackend(t, 3, 100, &fakeClock{now: time.Unix(1000, 0)})
	eps := b.Endpoints()
	for _, e := range eps[:2] {
		b.report(e, codes.Internal, false)
		b.report(e, codes.Internal, false)
	}
	seen := map[*Endpoint]bool{}
	for range 30 {
		e, err := b.pick(nil)
		if err != nil {
			t.Fatal(err)
		}
		seen[e] = true
	}
	if len(seen) != 3 {
		t.Errorf("with 1 of 3 available, picks reached %d endpoints, want all 3 (panic routing)", len(seen))
	}
}

func TestMatchPrefix(t *testing.T) {
	for _, c := range []struct {
		method, prefix string
		want           bool
	}{
		{"/pivirt.vm.v1.VMService/GetVM", "/pivirt.vm.v1.VMService", true},
		{"/pivirt.vm.v1.VMService/GetVM", "/pivirt.vm.v1.VMService/", true},
		{"/pivirt.vm.v1.VMService/GetVM", "/pivirt.vm.v1.VMService/GetVM", true},
		{"/pivirt.vm.v1.VMServiceAdmin/Wipe", "/pivirt.vm.v1.VMService", false},
		{"/pivirt.vm.v1.VMService/GetVMs", "/pivirt.vm.v1.VMService/GetVM", false},
		{"/pivirt.vm.v1.VMService/GetVM", "/pivirt.storage", false},
	} {
		if got := matchPrefix(c.method, c.prefix); got != c.want {
			t.Errorf("matchPrefix(%q, %q) = %v, want %v", c.method, c.prefix, got, c.want)
		}
	}
}

// TestHealthCheckUnejects: a passing active health check ends an ejection
// (against a real grpc.health.v1 server on 127.0.0.1).
func TestHealthCheckUnejects(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	go func() { _ = gs.Serve(ln) }()
	defer gs.Stop()

	clock := &fakeClock{now: time.Unix(1000, 0)}
	b, err := NewBackend(BackendConfig{Name: "t", Endpoint: ln.Addr().String(), Now: clock.Now,
		HealthCheck: HealthCheck{Enabled: true, Interval: time.Hour, Timeout: 5 * time.Second, HealthyThreshold: 1, UnhealthyThreshold: 2},
		Outlier:     Outlier{Enabled: true, Consecutive5xx: 1, Interval: time.Hour, BaseEjectionTime: time.Hour, MaxEjectionPercent: 100}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	e := b.Endpoints()[0]
	// The health loop checks once at start: wait for that check, so it
	// cannot land among the ones below.
	deadline := time.Now().Add(10 * time.Second)
	for {
		e.state.mu.Lock()
		done := e.state.hcSuccess > 0
		e.state.mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the health loop's first check did not run")
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.report(e, codes.Internal, false)
	if e.Status() != "ejected" {
		t.Fatalf("status %s after a failure with consecutive_5xx 1", e.Status())
	}
	b.check(t.Context(), e)
	if e.Status() != "healthy" {
		t.Errorf("status %s after a passing health check, want healthy (un-ejected)", e.Status())
	}
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	b.check(t.Context(), e)
	if e.Status() != "healthy" {
		t.Error("unhealthy after one failed check (threshold 2)")
	}
	b.check(t.Context(), e)
	if e.Status() != "unhealthy" {
		t.Errorf("status %s after two failed checks, want unhealthy", e.Status())
	}
	if err := b.Close(); err != nil { // a second Close is harmless
		t.Error(err)
	}
}
