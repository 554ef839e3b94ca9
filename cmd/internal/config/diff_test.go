package config

import (
	"strings"
	"testing"
	"time"
)

func TestDiff(t *testing.T) {
	a, b := Default(), Default()
	if d := Diff(a, b); len(d) != 0 {
		t.Fatalf("equal configurations differ at %v", d)
	}
	b.Logging.Level = "debug"
	b.Server.Metrics.Addr = "127.0.0.1:9444"
	b.Backends = map[string]BackendConfig{"pivirtd": {Endpoint: "unix:///run/p.sock"}}
	a.Backends = map[string]BackendConfig{"pivirtd": {Endpoint: "unix:///run/p.sock", Timeout: Duration(time.Second)}}
	b.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/x"}}}
	got := strings.Join(Diff(a, b), " ")
	if want := "backends.pivirtd.timeout logging.level routing.rules server.metrics.addr"; got != want {
		t.Errorf("Diff = %q, want %q", got, want)
	}
	if !Under("backends.pivirtd.timeout", "backends") || Under("backendsx", "backends") {
		t.Error("Under")
	}
}
