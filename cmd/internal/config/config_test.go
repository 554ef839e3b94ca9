package config

import (
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestDefault(t *testing.T) {
	hostname, err := os.Hostname()
	if err != nil {
		t.Fatalf("os.Hostname: %v", err)
	}
	c := Default()
	tests := []struct {
		name      string
		got, want any
	}{
		{"node_name", c.NodeName, hostname},
		{"data_dir", c.DataDir, "/var/lib/pivirt-agent"},
		{"server.connectrpc.addr", c.Server.ConnectRPC.Addr, "0.0.0.0:8443"},
		{"server.connectrpc.max_streams_per_caller", c.Server.ConnectRPC.MaxStreamsPerCaller, 128},
		{"server.connectrpc.body_timeout", c.Server.ConnectRPC.BodyTimeout.Std(), 30 * time.Second},
		{"server.connectrpc.tls.cert_file", c.Server.ConnectRPC.TLS.CertFile, "/etc/pivirt/certs/agent-server.crt"},
		{"server.grpc_internal.addr", c.Server.GRPCInternal.Addr, "0.0.0.0:9000"},
		{"server.metrics.addr", c.Server.Metrics.Addr, "0.0.0.0:8444"},
		{"server.metrics.path", c.Server.Metrics.Path, "/metrics"},
		{"tls.enabled", c.TLS.Enabled, true},
		{"tls.verify_peer", c.TLS.VerifyPeer, true},
		{"tls.require_client_cert", c.TLS.RequireClientCert, true},
		{"service_discovery.type", c.ServiceDiscovery.Type, "raft"},
		{"service_discovery.etcd.prefix", c.ServiceDiscovery.Etcd.Prefix, "/pivirt/services"},
		{"backends", len(c.Backends), 0},
		{"logging.level", c.Logging.Level, "info"},
		{"logging.format", c.Logging.Format, "json"},
		{"logging.output", c.Logging.Output, "stdout"},
		{"logging.sampling", c.Logging.Sampling, SamplingConfig{Initial: 100, Thereafter: 100}},
		{"routing.rules", len(c.Routing.Rules), 0},
		{"load_balancing.policy", c.LoadBalancing.Policy, "round_robin"},
		{"load_balancing.health_check", c.LoadBalancing.HealthCheck, HealthCheckConfig{
			Enabled: true, Interval: Duration(10 * time.Second), Timeout: Duration(5 * time.Second),
			HealthyThreshold: 2, UnhealthyThreshold: 3,
		}},
		{"circuit_breaking.thresholds", c.CircuitBreaking.Thresholds, CircuitBreakerThresholds{
			Consecutive5xx: 5, Interval: Duration(10 * time.Second),
			BaseEjectionTime: Duration(30 * time.Second), MaxEjectionPercent: 50,
		}},
		{"cluster.advertise_addr", c.Cluster.AdvertiseAddr, ""},
		{"cluster.gossip.bind_addr", c.Cluster.Gossip.BindAddr, "0.0.0.0:7946"},
		{"cluster.raft.addr", c.Cluster.Raft.Addr, "0.0.0.0:8300"},
		{"cluster.raft.voters", c.Cluster.Raft.Voters, 3},
		{"cluster.raft.bootstrap_expect", c.Cluster.Raft.BootstrapExpect, 0},
		{"cluster.raft.bootstrap", c.Cluster.Raft.Bootstrap, false},
		{"cluster.raft.dead_server_cleanup", c.Cluster.Raft.DeadServerCleanup.Std(), time.Minute},
		{"cluster.raft.max_non_voters", c.Cluster.Raft.MaxNonVoters, 64},
		{"cluster.raft.heartbeat_timeout", c.Cluster.Raft.HeartbeatTimeout.Std(), time.Second},
		{"cluster.raft.election_timeout", c.Cluster.Raft.ElectionTimeout.Std(), time.Second},
		{"cluster.raft.leader_lease_timeout", c.Cluster.Raft.LeaderLeaseTimeout.Std(), 500 * time.Millisecond},
		{"cluster.raft.snapshot_threshold", c.Cluster.Raft.SnapshotThreshold, uint64(8192)},
		{"cluster.raft.snapshot_interval", c.Cluster.Raft.SnapshotInterval.Std(), 2 * time.Minute},
		{"cluster.raft.trailing_logs", c.Cluster.Raft.TrailingLogs, uint64(10240)},
		{"cluster.join", len(c.Cluster.Join), 0},
		{"cluster.retry_interval", c.Cluster.RetryInterval.Std(), 30 * time.Second},
		{"cluster.retry_max", c.Cluster.RetryMax, 0},
		{"cluster.leave_on_terminate", c.Cluster.LeaveOnTerminate, false},
		{"cluster.forward_hold_timeout", c.Cluster.ForwardHoldTimeout.Std(), 7 * time.Second},
		{"snapshot.interval", c.Snapshot.Interval.Std(), time.Hour},
		{"snapshot.dir", c.Snapshot.Dir, ""},
		{"snapshot.retain", c.Snapshot.Retain, 24},
		{"dev", c.Dev, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !reflect.DeepEqual(tt.got, tt.want) {
				t.Errorf("Default().%s = %#v, want %#v", tt.name, tt.got, tt.want)
			}
		})
	}
}

func TestDefaultAndDevValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  func() *Config
	}{
		{"default", Default},
		{"dev", func() *Config { c := Default(); ApplyDev(c); return c }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.cfg().Validate(); err != nil {
				t.Errorf("Validate() = %v, want nil", err)
			}
		})
	}
}

func TestApplyDev(t *testing.T) {
	c := mustParse(t, `
node_name: n1
data_dir: /data
service_discovery:
  type: etcd
  etcd:
    endpoints: ["etcd:2379"]
cluster:
  join: ["10.0.0.2:7946"]
  raft:
    bootstrap_expect: 3
    advertise_addr: "10.0.0.1:8300"
`)
	ApplyDev(c)
	tests := []struct {
		name      string
		got, want any
	}{
		{"dev", c.Dev, true},
		{"node_name", c.NodeName, "dev"},
		{"data_dir", c.DataDir, ""},
		{"server.connectrpc.addr", c.Server.ConnectRPC.Addr, "127.0.0.1:8443"},
		{"server.grpc_internal.addr", c.Server.GRPCInternal.Addr, "127.0.0.1:9000"},
		{"server.metrics.addr", c.Server.Metrics.Addr, "127.0.0.1:8444"},
		{"cluster.gossip.bind_addr", c.Cluster.Gossip.BindAddr, "127.0.0.1:7946"},
		{"cluster.raft.addr", c.Cluster.Raft.Addr, "127.0.0.1:8300"},
		{"cluster.raft.advertise_addr", c.Cluster.Raft.AdvertiseAddr, ""},
		{"cluster.advertise_addr", c.Cluster.AdvertiseAddr, "127.0.0.1"},
		{"tls.enabled", c.TLS.Enabled, true},
		{"service_discovery.type", c.ServiceDiscovery.Type, "raft"},
		{"cluster.raft.bootstrap", c.Cluster.Raft.Bootstrap, true},
		{"cluster.raft.bootstrap_expect", c.Cluster.Raft.BootstrapExpect, 0},
		{"cluster.raft.voters", c.Cluster.Raft.Voters, 1},
		{"cluster.join", len(c.Cluster.Join), 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !reflect.DeepEqual(tt.got, tt.want) {
				t.Errorf("%s = %#v, want %#v", tt.name, tt.got, tt.want)
			}
		})
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Validate() after ApplyDev = %v, want nil", err)
	}
}

// TestSpecExamples loads the spec's example configurations, kept verbatim in testdata.
func TestSpecExamples(t *testing.T) {
	tests := []struct {
		file   string
		checks func(c *Config) map[string][2]any // key → {got, want}
	}{
		{"testdata/spec-agent.yaml", func(c *Config) map[string][2]any {
			return map[string][2]any{
				"server.connectrpc.tls.client_ca_file": {c.Server.ConnectRPC.TLS.ClientCAFile, "/etc/pivirt/certs/ca-chain.pem"},
				"tls.cert_file":                        {c.TLS.CertFile, "/etc/pivirt/certs/agent-client.crt"},
				"service_discovery.type":               {c.ServiceDiscovery.Type, "etcd"},
				"service_discovery.etcd.endpoints":     {c.ServiceDiscovery.Etcd.Endpoints, []string{"https://etcd-0.pilab.hu:2379", "https://etcd-1.pilab.hu:2379", "https://etcd-2.pilab.hu:2379"}},
				"service_discovery.etcd.key_file":      {c.ServiceDiscovery.Etcd.KeyFile, "/etc/pivirt-agent/etcd/client.key"},
				"backends.pivirtd.endpoint":            {c.Backends["pivirtd"].Endpoint, "unix:///run/pivirtd/pivirtd.sock"},
				"backends.pivirtd.timeout":             {c.Backends["pivirtd"].Timeout.Std(), 30 * time.Second},
				"backends.pivirtd.retry":               {c.Backends["pivirtd"].Retry, RetryConfig{MaxAttempts: 3, Backoff: Duration(100 * time.Millisecond)}},
				"backends.iscsiman.timeout":            {c.Backends["iscsiman"].Timeout.Std(), 10 * time.Second},
				"backends.osinfodb.endpoint":           {c.Backends["osinfodb"].Endpoint, "https://osinfodb.pilab.hu:8443"},
				"auth.oidc.issuer_url":                 {c.Auth.OIDC.IssuerURL, "https://auth.pilab.hu/realms/pivirt"},
				"auth.rbac_policy":                     {c.Auth.RBACPolicy, "/etc/pivirt-agent/rbac.yaml"},
				"logging.sampling.thereafter":          {c.Logging.Sampling.Thereafter, 100},
				"tracing.enabled":                      {c.Tracing.Enabled, true},
				"tracing.sampling_rate":                {c.Tracing.SamplingRate, 0.1},
				"cluster.raft.voters (default kept)":   {c.Cluster.Raft.Voters, 3},
			}
		}},
		{"testdata/spec-mesh.yaml", func(c *Config) map[string][2]any {
			return map[string][2]any{
				"backends.pivirtd.endpoint":        {c.Backends["pivirtd"].Endpoint, "pivirtd:9001"},
				"backends.pivirtd.tls.server_name": {c.Backends["pivirtd"].TLS.ServerName, "pivirtd.pilab.hu"},
				"routing.rules": {c.Routing.Rules, []RouteRule{
					{Match: RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: RouteTarget{Cluster: "pivirtd"}},
					{Match: RouteMatch{Prefix: "/pivirt.storage.v1.StorageService"}, Route: RouteTarget{Cluster: "iscsiman"}},
				}},
				"load_balancing.policy":                            {c.LoadBalancing.Policy, "round_robin"},
				"load_balancing.health_check.timeout":              {c.LoadBalancing.HealthCheck.Timeout.Std(), 5 * time.Second},
				"circuit_breaking.thresholds.base_ejection_time":   {c.CircuitBreaking.Thresholds.BaseEjectionTime.Std(), 30 * time.Second},
				"circuit_breaking.thresholds.max_ejection_percent": {c.CircuitBreaking.Thresholds.MaxEjectionPercent, 50},
				"tracing.exporter":                                 {c.Tracing.Exporter, "jaeger"},
				"logging.access_log":                               {c.Logging.AccessLog, AccessLogConfig{Enabled: true, Format: "json"}},
				"service_discovery.type (default kept)":            {c.ServiceDiscovery.Type, "raft"},
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			c, err := Load(tt.file)
			if err != nil {
				t.Fatalf("Load(%q) = %v", tt.file, err)
			}
			if err := c.Validate(); err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
			for key, gw := range tt.checks(c) {
				if !reflect.DeepEqual(gw[0], gw[1]) {
					t.Errorf("%s = %#v, want %#v", key, gw[0], gw[1])
				}
			}
		})
	}
}

// TestMarshalRoundTrip checks that yaml.Marshal of a Config loads back to the same Config,
// so an "effective configuration" dump is a valid configuration file.
func TestMarshalRoundTrip(t *testing.T) {
	spec, err := Load("testdata/spec-agent.yaml")
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	tests := []struct {
		name string
		cfg  *Config
	}{
		{"default", Default()},
		{"spec-agent", spec},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data, err := yaml.Marshal(tt.cfg)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			got, err := Parse(data, "marshalled.yaml")
			if err != nil {
				t.Fatalf("Parse(Marshal(cfg)) = %v\n%s", err, data)
			}
			again, err := yaml.Marshal(got)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			if string(again) != string(data) {
				t.Errorf("round trip changed the config:\ngot:\n%s\nwant:\n%s", again, data)
			}
		})
	}
}

// TestKeysAreTagged makes sure every field reachable from Config has an explicit snake_case
// yaml tag, so no key silently falls back to a lowercased Go name.
func TestKeysAreTagged(t *testing.T) {
	snake := regexp.MustCompile(`^[a-z][a-z0-9_]*$`)
	seen := map[reflect.Type]bool{}
	var walk func(typ reflect.Type, path string)
	walk = func(typ reflect.Type, path string) {
		switch typ.Kind() {
		case reflect.Pointer, reflect.Slice, reflect.Map:
			walk(typ.Elem(), path)
			return
		case reflect.Struct:
		default:
			return
		}
		if seen[typ] {
			return
		}
		seen[typ] = true
		for i := range typ.NumField() {
			sf := typ.Field(i)
			tag, ok := sf.Tag.Lookup("yaml")
			name, _, _ := strings.Cut(tag, ",")
			switch {
			case !ok:
				t.Errorf("%s.%s (%s): no yaml tag", typ, sf.Name, path)
			case name == "-":
			case !snake.MatchString(name):
				t.Errorf("%s.%s: yaml key %q is not snake_case", typ, sf.Name, name)
			default:
				walk(sf.Type, joinKey(path, name))
			}
		}
	}
	walk(reflect.TypeFor[Config](), "")
}

func mustParse(tb testing.TB, doc string) *Config {
	tb.Helper()
	c, err := Parse([]byte(doc), "test.yaml")
	if err != nil {
		tb.Fatalf("Parse: %v", err)
	}
	return c
}
