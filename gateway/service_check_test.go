package gateway

import (
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// TestValidateCheck: a registration's check and deregister_critical_after
// are checked field by field, each refusal naming the field and what it
// must be, and a check's defaults are filled in.
func TestValidateCheck(t *testing.T) {
	h, _ := newFollowerService(t, &followerView{})
	base := func(c *clusterv1.HealthCheck) *clusterv1.ServiceInstance {
		return &clusterv1.ServiceInstance{Service: "web", Address: "127.0.0.1", Port: 80, Check: c}
	}
	d := durationpb.New
	for _, tc := range []struct {
		name  string
		in    *clusterv1.ServiceInstance
		field string
		says  string
	}{
		{"no kind", base(&clusterv1.HealthCheck{}), "instance.check", "exactly one of http"},
		{"two kinds", base(&clusterv1.HealthCheck{Http: "http://a/", Tcp: "a:1"}), "instance.check", "exactly one of http"},
		{"ftp URL", base(&clusterv1.HealthCheck{Http: "ftp://a/"}), "instance.check.http", "http:// or https:// URL"},
		{"URL without a host", base(&clusterv1.HealthCheck{Http: "http:///health"}), "instance.check.http", "http:// or https:// URL"},
		{"tcp without a port", base(&clusterv1.HealthCheck{Tcp: "127.0.0.1"}), "instance.check.tcp", "host:port"},
		{"grpc port out of range", base(&clusterv1.HealthCheck{Grpc: "127.0.0.1:70000"}), "instance.check.grpc", "out of range 1-65535"},
		{"grpc_service on tcp", base(&clusterv1.HealthCheck{Tcp: "a:1", GrpcService: "x"}), "instance.check.grpc_service", "grpc check only"},
		{"tls_skip_verify on http", base(&clusterv1.HealthCheck{Http: "http://a/", TlsSkipVerify: true}), "instance.check.tls_skip_verify", "https://"},
		{"interval too short", base(&clusterv1.HealthCheck{Tcp: "a:1", Interval: d(100 * time.Millisecond)}), "instance.check.interval", "out of range 1s-1h0m0s"},
		{"interval too long", base(&clusterv1.HealthCheck{Tcp: "a:1", Interval: d(2 * time.Hour)}), "instance.check.interval", "out of range"},
		{"timeout not below the interval", base(&clusterv1.HealthCheck{Tcp: "a:1", Interval: d(time.Second), Timeout: d(time.Second)}), "instance.check.timeout", "shorter than the interval"},
		{"threshold too high", base(&clusterv1.HealthCheck{Tcp: "a:1", FailuresBeforeCritical: 101}), "instance.check.failures_before_critical", "1-100"},
		{"check and ttl", func() *clusterv1.ServiceInstance {
			in := base(&clusterv1.HealthCheck{Tcp: "a:1"})
			in.Ttl = d(time.Minute)
			return in
		}(), "instance.check", "not both"},
		{"deregister_critical_after too short", func() *clusterv1.ServiceInstance {
			in := base(nil)
			in.DeregisterCriticalAfter = d(time.Second)
			return in
		}(), "instance.deregister_critical_after", "out of range 1m0s-720h0m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := h.validateInstance(tc.in)
			var ia *invalidArgument
			if !errors.As(err, &ia) || ia.field != tc.field || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("validateInstance = %v, want an invalid argument on %s saying %q", err, tc.field, tc.says)
			}
		})
	}

	in := base(&clusterv1.HealthCheck{Http: "https://127.0.0.1:8443/health", TlsSkipVerify: true, Interval: d(4 * time.Second)})
	in.Output, in.Health = "forged", clusterv1.Health_HEALTH_PASSING
	if err := h.validateInstance(in); err != nil {
		t.Fatalf("validateInstance: %v", err)
	}
	c := in.GetCheck()
	if c.GetTimeout().AsDuration() != 2*time.Second || c.GetSuccessBeforePassing() != 1 || c.GetFailuresBeforeCritical() != 1 {
		t.Errorf("check after validation = %v, want timeout 2s (half the interval) and thresholds 1", c)
	}
	if in.GetOutput() != "" || in.GetHealth() != clusterv1.Health_HEALTH_UNSPECIFIED {
		t.Errorf("server-owned output %q and health %s kept from the request", in.GetOutput(), in.GetHealth())
	}
	in = base(&clusterv1.HealthCheck{Grpc: "127.0.0.1:9000"})
	if err := h.validateInstance(in); err != nil {
		t.Fatalf("validateInstance: %v", err)
	}
	if got := in.GetCheck().GetInterval().AsDuration(); got != DefaultCheckInterval || in.GetCheck().GetTimeout().AsDuration() != DefaultCheckTimeout {
		t.Errorf("default interval/timeout = %s/%s, want %s/%s", got, in.GetCheck().GetTimeout().AsDuration(), DefaultCheckInterval, DefaultCheckTimeout)
	}
}
