package mesh

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

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
	for method, want := range map[string]methodInfo{
		"/pivirt.vm.v1.VMService/GetVM":                  {known: true, idempotent: true},
		"/pivirt.vm.v1.VMService/ListVMs":                {known: true, idempotent: true},
		"/pivirt.vm.v1.VMService/CreateVM":               {known: true},
		"/pivirt.vm.v1.VMService/PowerOn":                {known: true},
		"/pivirt.vm.v1.VMService/WatchVMs":               {known: true, serverStreams: true, idempotent: true},
		"/pivirt.vm.v1.VMService/Console":                {known: true, clientStreams: true, serverStreams: true},
		"/pivirt.storage.v1.StorageService/UploadVolume": {known: true, clientStreams: true},
		"/pivirt.nope.v1.Nope/Call":                      {},
		"nonsense":                                       {},
	} {
		if got := lookupMethod(method); got != want {
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
