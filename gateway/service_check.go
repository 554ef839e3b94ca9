package gateway

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// Bounds of a service instance's check and deregister_critical_after
// (gateway/DESIGN.md, "Service checks").
const (
	// DefaultCheckInterval and DefaultCheckTimeout are a check's interval
	// and timeout when the registration sets none; the timeout is at most
	// half the interval.
	DefaultCheckInterval = 10 * time.Second
	DefaultCheckTimeout  = 5 * time.Second
	// MinCheckInterval is the shortest interval a check may have, and
	// MinDeregisterCriticalAfter the shortest deregister_critical_after
	// (Consul's), unless ClusterServiceConfig lowers them (tests).
	MinCheckInterval           = time.Second
	MinDeregisterCriticalAfter = time.Minute
	maxCheckInterval           = time.Hour
	maxDeregisterCriticalAfter = 30 * 24 * time.Hour
	maxCheckThreshold          = 100
)

// validateCheck checks an instance's check and deregister_critical_after,
// and fills in the check's defaults (so that what is stored, and shown, is
// what runs).
func (h *ClusterService) validateCheck(in *clusterv1.ServiceInstance) error {
	minInterval, minDCA := MinCheckInterval, MinDeregisterCriticalAfter
	if h.cfg.MinCheckInterval > 0 {
		minInterval = h.cfg.MinCheckInterval
	}
	if h.cfg.MinDeregisterCriticalAfter > 0 {
		minDCA = h.cfg.MinDeregisterCriticalAfter
	}
	if d := in.GetDeregisterCriticalAfter(); d != nil {
		if err := d.CheckValid(); err != nil {
			return invalid("instance.deregister_critical_after", "%v", err)
		}
		if v := d.AsDuration(); v != 0 && (v < minDCA || v > maxDeregisterCriticalAfter) {
			return invalid("instance.deregister_critical_after", "%s is out of range %s-%s", v, minDCA, maxDeregisterCriticalAfter)
		}
	}
	c := in.GetCheck()
	if c == nil {
		return nil
	}
	if in.GetTtl().AsDuration() > 0 {
		return invalid("instance.check", "an instance has either a ttl (heartbeats) or a check the agent runs, not both; drop one of them")
	}
	kinds := 0
	for _, s := range []string{c.GetHttp(), c.GetTcp(), c.GetGrpc()} {
		if s != "" {
			kinds++
		}
	}
	if kinds != 1 {
		return invalid("instance.check", "set exactly one of http (a URL), tcp (host:port) and grpc (host:port)")
	}
	switch {
	case c.GetHttp() != "":
		u, err := url.Parse(c.GetHttp())
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || !printable(c.GetHttp()) || len(c.GetHttp()) > 1024 {
			return invalid("instance.check.http", "%q must be an http:// or https:// URL of at most 1024 characters, such as http://127.0.0.1:8080/health", c.GetHttp())
		}
		if c.GetTlsSkipVerify() && u.Scheme != "https" {
			return invalid("instance.check.tls_skip_verify", "applies to an https:// URL or a grpc check with grpc_use_tls only")
		}
	case c.GetTcp() != "":
		if err := checkHostPort(c.GetTcp()); err != nil {
			return invalid("instance.check.tcp", "%q %v", c.GetTcp(), err)
		}
		if c.GetTlsSkipVerify() {
			return invalid("instance.check.tls_skip_verify", "applies to an https:// URL or a grpc check with grpc_use_tls only")
		}
	default:
		if err := checkHostPort(c.GetGrpc()); err != nil {
			return invalid("instance.check.grpc", "%q %v", c.GetGrpc(), err)
		}
		if c.GetTlsSkipVerify() && !c.GetGrpcUseTls() {
			return invalid("instance.check.tls_skip_verify", "applies to an https:// URL or a grpc check with grpc_use_tls only")
		}
	}
	if c.GetGrpc() == "" && (c.GetGrpcService() != "" || c.GetGrpcUseTls()) {
		return invalid("instance.check.grpc_service", "grpc_service and grpc_use_tls apply to a grpc check only")
	}
	if s := c.GetGrpcService(); len(s) > 256 || !printable(s) {
		return invalid("instance.check.grpc_service", "%q must be at most 256 printable characters", s)
	}
	if c.GetInterval() == nil {
		c.Interval = durationpb.New(DefaultCheckInterval)
	}
	if err := c.GetInterval().CheckValid(); err != nil {
		return invalid("instance.check.interval", "%v", err)
	}
	interval := c.GetInterval().AsDuration()
	if interval < minInterval || interval > maxCheckInterval {
		return invalid("instance.check.interval", "%s is out of range %s-%s", interval, minInterval, maxCheckInterval)
	}
	if c.GetTimeout() == nil {
		c.Timeout = durationpb.New(min(DefaultCheckTimeout, interval/2))
	}
	if err := c.GetTimeout().CheckValid(); err != nil {
		return invalid("instance.check.timeout", "%v", err)
	}
	if t := c.GetTimeout().AsDuration(); t <= 0 || t >= interval {
		return invalid("instance.check.timeout", "%s must be positive and shorter than the interval (%s)", t, interval)
	}
	if c.GetSuccessBeforePassing() == 0 {
		c.SuccessBeforePassing = 1
	}
	if c.GetFailuresBeforeCritical() == 0 {
		c.FailuresBeforeCritical = 1
	}
	if n := c.GetSuccessBeforePassing(); n > maxCheckThreshold {
		return invalid("instance.check.success_before_passing", "%d is out of range 1-%d", n, maxCheckThreshold)
	}
	if n := c.GetFailuresBeforeCritical(); n > maxCheckThreshold {
		return invalid("instance.check.failures_before_critical", "%d is out of range 1-%d", n, maxCheckThreshold)
	}
	return nil
}

// checkHostPort checks a check's host:port target.
func checkHostPort(s string) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" || len(s) > 261 || !printable(s) {
		return fmt.Errorf("must be host:port, such as 127.0.0.1:9000")
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("has port %q, out of range 1-65535", port)
	}
	return nil
}
