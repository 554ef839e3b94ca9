package config

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestValidate(t *testing.T) {
	keyFile := filepath.Join(t.TempDir(), "gossip.key")
	if err := os.WriteFile(keyFile, []byte("c2VjcmV0c2VjcmV0c2VjcmV0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	tests := []struct {
		name   string
		mutate func(c *Config)
		want   []string // one substring per expected problem; nil = valid
	}{
		// Node.
		{"node_name empty", func(c *Config) { c.NodeName = "" }, []string{"node_name: invalid value: required"}},
		{"node_name with space", func(c *Config) { c.NodeName = "node 01" }, []string{`node_name: invalid value "node 01": must not contain spaces, slashes`}},
		{"node_name with slash", func(c *Config) { c.NodeName = "a/b" }, []string{`node_name: invalid value "a/b"`}},
		{"node_name with dots and dashes", func(c *Config) { c.NodeName = "node-01.pivirt.internal" }, nil},
		{"data_dir empty", func(c *Config) { c.DataDir = "" }, []string{"data_dir: invalid value: required"}},
		{"data_dir empty in dev", func(c *Config) { c.DataDir = ""; c.Dev = true }, nil},

		// Listeners.
		{"api addr without port", func(c *Config) { c.Server.ConnectRPC.Addr = "0.0.0.0" }, []string{`server.connectrpc.addr: invalid value "0.0.0.0"`}},
		{"api addr port out of range", func(c *Config) { c.Server.ConnectRPC.Addr = ":70000" }, []string{`server.connectrpc.addr: invalid value ":70000": port "70000" must be a number from 0 to 65535`}},
		{"api addr named port", func(c *Config) { c.Server.ConnectRPC.Addr = "localhost:https" }, []string{`server.connectrpc.addr: invalid value "localhost:https"`}},
		{"api addr empty host", func(c *Config) { c.Server.ConnectRPC.Addr = ":8443" }, nil},
		{"api addr host name", func(c *Config) { c.Server.ConnectRPC.Addr = "localhost:8443" }, nil},
		{"api addr port 0", func(c *Config) { c.Server.ConnectRPC.Addr = "127.0.0.1:0" }, nil},
		{"api addr IPv6", func(c *Config) { c.Server.ConnectRPC.Addr = "[::1]:8443" }, nil},
		{"internal addr empty", func(c *Config) { c.Server.GRPCInternal.Addr = "" }, []string{"server.grpc_internal.addr: invalid value: required"}},
		{"metrics path", func(c *Config) { c.Server.Metrics.Path = "metrics" }, []string{`server.metrics.path: invalid value "metrics": must start with "/"`}},
		{"ui connect origin", func(c *Config) {
			c.Server.UI.ConnectOrigins = []string{"https://idp.example.com", "idp.example.com/token"}
		}, []string{`server.ui.connect_origins[1]: invalid value "idp.example.com/token": want an origin, https://host[:port], without a path`}},
		{"management callers", func(c *Config) {
			c.Server.Metrics.ManagementAllowFrom = []string{"127.0.0.1", "localhost", "10.0.0.0/33"}
		}, []string{
			`server.metrics.management_allow_from[1]: invalid value "localhost": want an IP address (127.0.0.1) or a CIDR prefix (10.0.0.0/8)`,
			`server.metrics.management_allow_from[2]: invalid value "10.0.0.0/33"`}},
		{"metrics on the api port", func(c *Config) { c.Server.Metrics.Addr = "127.0.0.1:8443" }, []string{`server.metrics.addr: invalid value "127.0.0.1:8443": same port as server.connectrpc.addr "0.0.0.0:8443"`}},
		{"same port on different IPs", func(c *Config) {
			c.Server.ConnectRPC.Addr = "10.0.0.1:8443"
			c.Server.Metrics.Addr = "127.0.0.1:8443"
		}, nil},
		{"raft shares the internal port", func(c *Config) { c.Cluster.Raft.Addr = c.Server.GRPCInternal.Addr }, nil},
		{"raft on the gossip port", func(c *Config) { c.Cluster.Raft.Addr = "0.0.0.0:7946" }, []string{"cluster.raft.addr: invalid value \"0.0.0.0:7946\": same port as cluster.gossip.bind_addr"}},
		{"gossip bind on a host name", func(c *Config) { c.Cluster.Gossip.BindAddr = "localhost:7946" }, []string{`cluster.gossip.bind_addr: invalid value "localhost:7946": the host must be an IP address`}},

		// TLS.
		{"revocation off", func(c *Config) { c.TLS.Revocation.Mode = "off" }, nil},
		{"revocation bad values", func(c *Config) {
			c.TLS.Revocation = RevocationConfig{Mode: "crls", OnUnavailable: "maybe", Refresh: Duration(500 * time.Millisecond)}
		}, []string{`tls.revocation.mode: invalid value "crls" (allowed: "", crl, ocsp, both, off)`,
			`tls.revocation.on_unavailable: invalid value "maybe" (allowed: "", allow, deny)`,
			"tls.revocation.refresh: invalid value 500ms: at least 1s"}},
		{"tls on without cert", func(c *Config) { c.TLS.CertFile, c.TLS.KeyFile = "", "" }, []string{"tls.cert_file: invalid value: required when tls.enabled is true", "tls.key_file: invalid value: required when tls.enabled is true"}},
		{"tls on without server cert", func(c *Config) { c.Server.ConnectRPC.TLS.CertFile = "" }, []string{
			"server.connectrpc.tls.cert_file: invalid value: required when server.connectrpc.tls.key_file is set",
			"server.connectrpc.tls.cert_file: invalid value: required when tls.enabled is true",
		}},
		{"tls off without files", func(c *Config) {
			c.TLS = TLSConfig{}
			c.Server.ConnectRPC.TLS = ServerTLSConfig{}
		}, nil},
		{"client certs required without a CA", func(c *Config) {
			c.TLS.CAFile = ""
			c.Server.ConnectRPC.TLS.ClientCAFile = ""
		}, []string{"tls.ca_file: invalid value: required when tls.enabled is true", "server.connectrpc.tls.client_ca_file: invalid value: required when tls.require_client_cert is true"}},

		// Service discovery.
		{"etcd without endpoints", func(c *Config) { c.ServiceDiscovery.Type = "etcd" }, []string{"service_discovery.etcd.endpoints: invalid value: at least one endpoint is required"}},
		{"etcd endpoints", func(c *Config) {
			c.ServiceDiscovery.Type = "etcd"
			c.ServiceDiscovery.Etcd.Endpoints = []string{"https://etcd-0:2379", "https://127.0.0.1:2379", "etcd-2:2379"}
		}, nil},
		{"etcd plaintext endpoints", func(c *Config) {
			c.ServiceDiscovery.Type = "etcd"
			c.ServiceDiscovery.Etcd.Endpoints = []string{"http://etcd-0:2379", "etcd-1:2379"}
		}, nil},
		{"etcd plaintext endpoint beside TLS", func(c *Config) {
			c.ServiceDiscovery.Type = "etcd"
			c.ServiceDiscovery.Etcd.Endpoints = []string{"http://etcd-0:2379", "etcd-1:2379"}
			c.ServiceDiscovery.Etcd.CAFile = "/etc/pivirt-agent/etcd/ca.crt"
		}, []string{`service_discovery.etcd.endpoints[0]: invalid value "http://etcd-0:2379": plaintext, but the agent talks to etcd over TLS (ca_file, cert_file or an https:// endpoint is set); use https://`}},
		{"etcd bad endpoint", func(c *Config) {
			c.ServiceDiscovery.Type = "etcd"
			c.ServiceDiscovery.Etcd.Endpoints = []string{"https://etcd-0:2379", "ftp://etcd-1:2379"}
		}, []string{`service_discovery.etcd.endpoints[1]: invalid value "ftp://etcd-1:2379": scheme must be one of http, https`}},
		{"etcd cert without key", func(c *Config) { c.ServiceDiscovery.Etcd.CertFile = "/c.crt" }, []string{"service_discovery.etcd.key_file: invalid value: required when service_discovery.etcd.cert_file is set"}},
		{"prefix", func(c *Config) { c.ServiceDiscovery.Etcd.Prefix = "pivirt" }, []string{`service_discovery.etcd.prefix: invalid value "pivirt": must start with "/"`}},
		{"bad enum set in code", func(c *Config) { c.ServiceDiscovery.Type = "zookeeper" }, []string{`service_discovery.type: invalid value "zookeeper" (allowed: raft, etcd)`}},

		// Backends.
		{"backend without endpoint", func(c *Config) { c.Backends = map[string]BackendConfig{"pivirtd": {}} }, []string{"backends.pivirtd.endpoint: invalid value: required"}},
		{"backend scope unknown", func(c *Config) { c.Backends = map[string]BackendConfig{"p": {Endpoint: "a:1", Scope: "global"}} }, []string{`backends.p.scope: invalid value "global" (allowed: "", node, cluster)`}},
		{"node-scoped registry backend", func(c *Config) {
			c.Backends = map[string]BackendConfig{"p": {Endpoint: "registry:///pivirtd", Scope: ScopeNode}}
		}, []string{"backends.p.scope: invalid value: a node-scoped backend is this node's own daemon"}},
		{"cluster-scoped unix backend", func(c *Config) {
			c.Backends = map[string]BackendConfig{"p": {Endpoint: "unix:///run/p.sock", Scope: ScopeCluster}}
		}, nil},
		{"backend bad name", func(c *Config) { c.Backends = map[string]BackendConfig{"x y": {Endpoint: "a:1"}} }, []string{`backends["x y"]: invalid value: backend name "x y" must be`}},
		{"backend name starting with a dash", func(c *Config) { c.Backends = map[string]BackendConfig{"-x": {Endpoint: "a:1"}} }, []string{`backends.-x: invalid value: backend name "-x" must be`}},
		{"backend negative values", func(c *Config) {
			c.Backends = map[string]BackendConfig{"b": {
				Endpoint: "a:1", Timeout: Duration(-time.Second),
				Retry: RetryConfig{MaxAttempts: -1, Backoff: Duration(-time.Second)},
			}}
		}, []string{"backends.b.timeout: invalid value -1s: must not be negative", "backends.b.retry.max_attempts: invalid value: must not be negative", "backends.b.retry.backoff: invalid value -1s"}},
		{"backend tls key without cert", func(c *Config) {
			c.Backends = map[string]BackendConfig{"b": {Endpoint: "a:1", TLS: BackendTLSConfig{KeyFile: "/k"}}}
		}, []string{"backends.b.tls.cert_file: invalid value: required when backends.b.tls.key_file is set"}},

		// Auth.
		{"oidc without client id", func(c *Config) { c.Auth.OIDC.IssuerURL = "https://auth.example/realms/x" }, []string{"auth.oidc.client_id: invalid value: required when auth.oidc.issuer_url is set"}},
		{"oidc over http", func(c *Config) { c.Auth.OIDC = OIDCConfig{IssuerURL: "http://auth.example", ClientID: "a"} }, []string{`auth.oidc.issuer_url: invalid value "http://auth.example": must be an https:// URL`}},
		{"oidc over http on loopback", func(c *Config) { c.Auth.OIDC = OIDCConfig{IssuerURL: "http://127.0.0.1:5556/dex", ClientID: "a"} }, []string{`auth.oidc.issuer_url: invalid value "http://127.0.0.1:5556/dex": an http:// issuer is accepted only for development`}},
		{"oidc over http on loopback, allowed", func(c *Config) {
			c.Auth.OIDC = OIDCConfig{IssuerURL: "http://127.0.0.1:5556/dex", ClientID: "a", AllowHTTPIssuer: true}
		}, nil},
		{"oidc over http on loopback with --dev", func(c *Config) {
			c.Dev = true
			c.Auth.OIDC = OIDCConfig{IssuerURL: "http://127.0.0.1:5556/dex", ClientID: "a"}
		}, nil},

		// Logging and tracing.
		{"logging output relative", func(c *Config) { c.Logging.Output = "agent.log" }, []string{`logging.output: invalid value "agent.log": must be "stdout", "stderr" or an absolute file path`}},
		{"logging output file", func(c *Config) { c.Logging.Output = "/var/log/pivirt-agent/agent.log" }, nil},
		{"logging sampling negative", func(c *Config) { c.Logging.Sampling.Initial = -1 }, []string{"logging.sampling.initial: invalid value: must not be negative"}},
		{"bad log level set in code", func(c *Config) { c.Logging.Level = "trace" }, []string{`logging.level: invalid value "trace" (allowed: debug, info, warn, error)`}},
		{"sampling_rate above 1", func(c *Config) { c.Tracing.SamplingRate = 1.5 }, []string{"tracing.sampling_rate: invalid value 1.5: must be between 0 and 1"}},
		{"sampling_rate negative", func(c *Config) { c.Tracing.SamplingRate = -0.1 }, []string{"tracing.sampling_rate: invalid value -0.1"}},
		{"sampling_rate NaN", func(c *Config) { c.Tracing.SamplingRate = math.NaN() }, []string{"tracing.sampling_rate: invalid value NaN"}},
		{"sampling_rate bounds", func(c *Config) { c.Tracing.SamplingRate = 1 }, nil},
		{"tracing on without endpoint", func(c *Config) { c.Tracing.Enabled = true }, []string{"tracing.endpoint: invalid value: required when tracing.enabled is true"}},
		{"tracing otlp host:port", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "otlp", Endpoint: "otel-collector:4317", SamplingRate: 0.5}
		}, nil},
		{"tracing zipkin URL", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: "http://127.0.0.1:9411/api/v2/spans", SamplingRate: 0.5}
		}, nil},
		{"tracing zipkin https without a path", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: "https://zipkin.pilab.hu"}
		}, nil},
		{"tracing zipkin host:port", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: "zipkin:9411"}
		}, []string{`tracing.endpoint: invalid value "zipkin:9411": tracing.exporter zipkin posts spans over HTTP and needs a URL, e.g. http://zipkin:9411/api/v2/spans`}},
		{"tracing zipkin other scheme", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: "grpc://zipkin:9411/api/v2/spans"}
		}, []string{`tracing.endpoint: invalid value "grpc://zipkin:9411/api/v2/spans": scheme must be one of http, https (tracing.exporter zipkin needs an http or https URL`}},
		{"tracing zipkin without a host", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: "http:///api/v2/spans"}
		}, []string{`tracing.endpoint: invalid value "http:///api/v2/spans": the host is missing`}},
		{"tracing zipkin without an endpoint", func(c *Config) {
			c.Tracing = TracingConfig{Enabled: true, Exporter: "zipkin"}
		}, []string{"tracing.endpoint: invalid value: required when tracing.enabled is true"}},

		// Routing, load balancing, circuit breaking.
		{"route prefix without slash", func(c *Config) {
			c.Backends = map[string]BackendConfig{"pivirtd": {Endpoint: "unix:///run/p.sock"}, "iscsiman": {Endpoint: "unix:///run/i.sock"}}
			c.Routing.Rules = []RouteRule{
				{Match: RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: RouteTarget{Cluster: "pivirtd"}},
				{Match: RouteMatch{Prefix: "pivirt.storage.v1.StorageService"}, Route: RouteTarget{Cluster: "iscsiman"}},
			}
		}, []string{`routing.rules[1].match.prefix: invalid value "pivirt.storage.v1.StorageService": must start with "/"`}},
		{"route duplicate prefix", func(c *Config) {
			r := RouteRule{Match: RouteMatch{Prefix: "/a"}, Route: RouteTarget{Cluster: "x"}}
			c.Backends = map[string]BackendConfig{"x": {Endpoint: "unix:///run/x.sock"}}
			c.Routing.Rules = []RouteRule{r, r}
		}, []string{`routing.rules[1].match.prefix: invalid value "/a": same prefix as routing.rules[0]`}},
		{"route without cluster", func(c *Config) { c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/a"}}} }, []string{"routing.rules[0].route.cluster: invalid value: required"}},
		{"route to an unknown backend", func(c *Config) {
			c.Backends = map[string]BackendConfig{"b": {Endpoint: "unix:///run/b.sock"}, "a": {Endpoint: "unix:///run/a.sock"}}
			c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/a"}, Route: RouteTarget{Cluster: "pivirtd"}}}
		}, []string{`routing.rules[0].route.cluster: invalid value "pivirtd": not a backend (backends: a, b)`}},
		{"descriptor set by a relative path", func(c *Config) {
			c.Backends = map[string]BackendConfig{"a": {Endpoint: "unix:///run/a.sock"}}
			c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/a.B"}, Route: RouteTarget{Cluster: "a", DescriptorSet: "a.binpb"}}}
		}, []string{`routing.rules[0].route.descriptor_set: invalid value "a.binpb": an absolute path of a FileDescriptorSet file`}},
		{"descriptor set missing", func(c *Config) {
			c.Backends = map[string]BackendConfig{"a": {Endpoint: "unix:///run/a.sock"}}
			c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/a.B"}, Route: RouteTarget{Cluster: "a", DescriptorSet: "/nonexistent/a.binpb"}}}
		}, []string{`routing.rules[0].route.descriptor_set: invalid value: stat /nonexistent/a.binpb: no such file or directory`}},
		{"health check timeout above interval", func(c *Config) { c.LoadBalancing.HealthCheck.Timeout = Duration(time.Minute) }, []string{"load_balancing.health_check.timeout: invalid value 1m0s: must not exceed load_balancing.health_check.interval (10s)"}},
		{"health check zero interval", func(c *Config) { c.LoadBalancing.HealthCheck.Interval = 0 }, []string{"load_balancing.health_check.interval: invalid value: must be positive when health checks are enabled"}},
		{"health check zero threshold", func(c *Config) { c.LoadBalancing.HealthCheck.HealthyThreshold = 0 }, []string{"load_balancing.health_check.healthy_threshold: invalid value: must be at least 1"}},
		{"health check disabled with zero values", func(c *Config) { c.LoadBalancing.HealthCheck = HealthCheckConfig{} }, nil},
		{"max_ejection_percent above 100", func(c *Config) { c.CircuitBreaking.Thresholds.MaxEjectionPercent = 101 }, []string{"circuit_breaking.thresholds.max_ejection_percent: invalid value 101: must be between 0 and 100"}},
		{"max_ejection_percent negative", func(c *Config) { c.CircuitBreaking.Thresholds.MaxEjectionPercent = -1 }, []string{"circuit_breaking.thresholds.max_ejection_percent: invalid value -1"}},
		{"max_ejection_percent bounds", func(c *Config) { c.CircuitBreaking.Thresholds.MaxEjectionPercent = 100 }, nil},
		{"circuit breaking zero 5xx", func(c *Config) { c.CircuitBreaking.Thresholds.Consecutive5xx = 0 }, []string{"circuit_breaking.thresholds.consecutive_5xx: invalid value: must be at least 1"}},

		// Cluster.
		{"voters even", func(c *Config) { c.Cluster.Raft.Voters = 4 }, []string{"cluster.raft.voters: invalid value 4: must be odd, from 1 to 7"}},
		{"voters zero", func(c *Config) { c.Cluster.Raft.Voters = 0 }, []string{"cluster.raft.voters: invalid value 0"}},
		{"voters nine", func(c *Config) { c.Cluster.Raft.Voters = 9 }, []string{"cluster.raft.voters: invalid value 9"}},
		{"max non-voters negative", func(c *Config) { c.Cluster.Raft.MaxNonVoters = -1 }, []string{"cluster.raft.max_non_voters: invalid value: must not be negative (0 means no cap), got -1"}},
		{"voters five", func(c *Config) { c.Cluster.Raft.Voters = 5 }, nil},
		{"voters seven", func(c *Config) { c.Cluster.Raft.Voters = 7 }, nil},
		{"bootstrap and bootstrap_expect", func(c *Config) { c.Cluster.Raft.Bootstrap = true; c.Cluster.Raft.BootstrapExpect = 3 }, []string{"cluster.raft.bootstrap: invalid value: cannot be combined with cluster.raft.bootstrap_expect (3)"}},
		{"bootstrap_expect negative", func(c *Config) { c.Cluster.Raft.BootstrapExpect = -1 }, []string{"cluster.raft.bootstrap_expect: invalid value: must not be negative"}},
		{"bootstrap alone", func(c *Config) { c.Cluster.Raft.Bootstrap = true }, nil},
		{"bootstrap_expect alone", func(c *Config) { c.Cluster.Raft.BootstrapExpect = 3 }, nil},
		{"dead_server_cleanup disabled", func(c *Config) { c.Cluster.Raft.DeadServerCleanup = 0 }, nil},
		{"dead_server_cleanup negative", func(c *Config) { c.Cluster.Raft.DeadServerCleanup = Duration(-time.Second) }, []string{"cluster.raft.dead_server_cleanup: invalid value -1s: must not be negative"}},
		{"heartbeat too short", func(c *Config) {
			c.Cluster.Raft.HeartbeatTimeout = Duration(time.Millisecond)
			c.Cluster.Raft.LeaderLeaseTimeout = Duration(time.Millisecond)
		}, []string{"cluster.raft.heartbeat_timeout: invalid value 1ms: must be at least 5ms", "cluster.raft.leader_lease_timeout: invalid value 1ms: must be at least 5ms"}},
		{"election below heartbeat", func(c *Config) { c.Cluster.Raft.ElectionTimeout = Duration(500 * time.Millisecond) }, []string{"cluster.raft.election_timeout: invalid value 500ms: must not be less than cluster.raft.heartbeat_timeout (1s)"}},
		{"lease above heartbeat", func(c *Config) { c.Cluster.Raft.LeaderLeaseTimeout = Duration(2 * time.Second) }, []string{"cluster.raft.leader_lease_timeout: invalid value 2s: must not exceed cluster.raft.heartbeat_timeout (1s)"}},
		{"snapshot_threshold zero", func(c *Config) { c.Cluster.Raft.SnapshotThreshold = 0 }, []string{"cluster.raft.snapshot_threshold: invalid value: must be at least 1"}},
		{"log_store unknown", func(c *Config) { c.Cluster.Raft.LogStore = "rocksdb" }, []string{`cluster.raft.log_store: invalid value "rocksdb": must be wal or boltdb`}},
		{"wal segment size zero", func(c *Config) { c.Cluster.Raft.WALSegmentSizeMB = 0 }, []string{"cluster.raft.wal_segment_size_mb: invalid value 0: must be between 1 and 1024 (MiB)"}},
		{"log verification too often", func(c *Config) { c.Cluster.Raft.LogVerification.Interval = Duration(time.Millisecond) }, []string{"cluster.raft.log_verification.interval: invalid value 1ms: must be at least 1s (or set cluster.raft.log_verification.enabled: false)"}},
		{"advertise addr with port", func(c *Config) { c.Cluster.AdvertiseAddr = "10.0.0.1:7946" }, []string{`cluster.advertise_addr: invalid value "10.0.0.1:7946": must be an IP address without a port`}},
		{"advertise addr unspecified", func(c *Config) { c.Cluster.AdvertiseAddr = "0.0.0.0" }, []string{`cluster.advertise_addr: invalid value "0.0.0.0"`}},
		{"advertise addr IPv6", func(c *Config) { c.Cluster.AdvertiseAddr = "fd00::1" }, nil},
		{"gossip advertise unspecified", func(c *Config) { c.Cluster.Gossip.AdvertiseAddr = "0.0.0.0:7946" }, []string{`cluster.gossip.advertise_addr: invalid value "0.0.0.0:7946": must be an address other nodes can reach`}},
		{"raft advertise without port", func(c *Config) { c.Cluster.Raft.AdvertiseAddr = "10.0.0.1" }, []string{`cluster.raft.advertise_addr: invalid value "10.0.0.1": must be IP:port`}},
		{"raft advertise port 0", func(c *Config) { c.Cluster.Raft.AdvertiseAddr = "10.0.0.1:0" }, []string{`cluster.raft.advertise_addr: invalid value "10.0.0.1:0": port must be from 1 to 65535`}},
		{"encrypt key file missing", func(c *Config) { c.Cluster.Gossip.EncryptKeyFile = filepath.Join(t.TempDir(), "nope.key") }, []string{"cluster.gossip.encrypt_key_file: invalid value: stat "}},
		{"encrypt key file is a directory", func(c *Config) { c.Cluster.Gossip.EncryptKeyFile = dir }, []string{`cluster.gossip.encrypt_key_file: invalid value "` + dir + `": not a regular file`}},
		{"encrypt key file exists", func(c *Config) { c.Cluster.Gossip.EncryptKeyFile = keyFile }, nil},
		{"join entries", func(c *Config) {
			c.Cluster.Join = []string{"10.0.0.2:7946", "node-3.pivirt.internal:7946", "[fd00::4]:7946"}
			c.Cluster.RetryJoin = c.Cluster.Join
		}, nil},
		{"join without port", func(c *Config) { c.Cluster.Join = []string{"10.0.0.2:7946", "10.0.0.3"} }, []string{`cluster.join[1]: invalid value "10.0.0.3": must be host:port`}},
		{"retry_join port 0", func(c *Config) { c.Cluster.RetryJoin = []string{"10.0.0.3:0"} }, []string{`cluster.retry_join[0]: invalid value "10.0.0.3:0": port "0" must be a number from 1 to 65535`}},
		{"retry_interval zero", func(c *Config) { c.Cluster.RetryInterval = 0 }, []string{"cluster.retry_interval: invalid value 0s: must be positive"}},
		{"retry_max negative", func(c *Config) { c.Cluster.RetryMax = -1 }, []string{"cluster.retry_max: invalid value: must not be negative"}},
		{"forward_hold_timeout zero", func(c *Config) { c.Cluster.ForwardHoldTimeout = 0 }, []string{"cluster.forward_hold_timeout: invalid value 0s: must be positive"}},
		{"snapshot interval negative", func(c *Config) { c.Snapshot.Interval = Duration(-time.Minute) }, []string{"snapshot.interval: invalid value -1m0s: must not be negative"}},
		{"snapshot interval too short", func(c *Config) { c.Snapshot.Interval = Duration(time.Second) }, []string{"snapshot.interval: invalid value 1s: at least 1m"}},
		{"snapshot retain zero", func(c *Config) { c.Snapshot.Retain = 0 }, []string{"snapshot.retain: invalid value 0: must keep at least 1 archive"}},
		{"certificate roles pattern", func(c *Config) { c.Auth.CertificateRoles = map[string][]string{"*": {"admin"}} }, []string{`auth.certificate_roles["*"]: invalid value: "*": a certificate CN, or a CN prefix ending in "*"`}},
		{"certificate roles empty", func(c *Config) { c.Auth.CertificateRoles = map[string][]string{"operator": nil} }, []string{"auth.certificate_roles.operator: invalid value: no roles"}},
		{"network policy without tls", func(c *Config) { c.Auth.NetworkPolicy, c.TLS.Enabled = "/etc/np.yaml", false }, []string{"auth.network_policy: invalid value: network policies match the service names of TLS certificates"}},
		{"rate limit zero", func(c *Config) { c.RateLimiting.Enabled, c.RateLimiting.RequestsPerSecond = true, 0 }, []string{"rate_limiting.requests_per_second: invalid value 0: must be positive"}},
		{"rate limit off ignores values", func(c *Config) { c.RateLimiting.RequestsPerSecond = -1 }, nil},
		{"rate limit route prefix", func(c *Config) {
			c.RateLimiting.Enabled = true
			c.RateLimiting.Routes = []RateLimitRoute{{Prefix: "pivirt.vm.v1.VMService", RequestsPerSecond: 1, Burst: 1}, {Prefix: "/a/", RequestsPerSecond: 1}}
		}, []string{`rate_limiting.routes[0].prefix: invalid value "pivirt.vm.v1.VMService": a method prefix`, "rate_limiting.routes[1].burst: invalid value 0: must be at least 1"}},
		{"roles claim", func(c *Config) { c.Auth.OIDC.RolesClaim = "realm access.roles" }, []string{`auth.oidc.roles_claim: invalid value "realm access.roles": a claim name or a dotted path of claim names`}},
		{"cluster ca cert without key", func(c *Config) { c.TLS.ClusterCA.CertFile = "/x/PiCA.pem" }, []string{"tls.cluster_ca.key_file: invalid value: required when tls.cluster_ca.cert_file is set"}},
		{"cluster ca without tls", func(c *Config) { c.TLS.ClusterCA.Enabled, c.TLS.Enabled = true, false }, []string{"tls.cluster_ca.enabled: invalid value: the cluster CA renews TLS certificates; it needs tls.enabled: true"}},
		{"cluster ca leaf ttl short", func(c *Config) { c.TLS.ClusterCA.Enabled, c.TLS.ClusterCA.LeafTTL = true, Duration(time.Second) }, []string{"tls.cluster_ca.leaf_ttl: invalid value 1s: at least 10s"}},
		{"cluster ca rate zero", func(c *Config) { c.TLS.ClusterCA.Enabled, c.TLS.ClusterCA.CSRMaxPerSecond = true, 0 }, []string{"tls.cluster_ca.csr_max_per_second: invalid value 0: must be positive"}},
		{"cluster ca burst zero", func(c *Config) { c.TLS.ClusterCA.Enabled, c.TLS.ClusterCA.CSRBurst = true, 0 }, []string{"tls.cluster_ca.csr_burst: invalid value 0: at least 1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Default()
			tt.mutate(c)
			err := c.Validate()
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want %q", tt.want)
			}
			got := err.Error()
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("Validate() =\n%s\nwant it to contain %q", got, w)
				}
			}
			if n := len(unjoin(err)); n != len(tt.want) {
				t.Errorf("Validate() returned %d problems, want %d:\n%s", n, len(tt.want), got)
			}
		})
	}
}

func TestBackendEndpoints(t *testing.T) {
	tests := []struct {
		endpoint string
		ok       bool
	}{
		{"unix:///run/pivirtd/pivirtd.sock", true},
		{"dns:///pivirtd.pilab.hu:9001", true},
		{"pivirtd:9001", true},
		{"10.0.0.5:9001", true},
		{"[fd00::5]:9001", true},
		{"https://osinfodb.pilab.hu:8443", true},
		{"https://osinfodb.pilab.hu", true},
		{"unix://run/pivirtd.sock", false},
		{"unix:/run/pivirtd.sock", false},
		{"unix:///run/../pivirtd.sock", false},
		{"unix:///", false},
		{"dns:///pivirtd.pilab.hu", false},
		{"dns://8.8.8.8/pivirtd:9001", false},
		{"http://osinfodb.pilab.hu", false},
		{"https://", false},
		{"https://host:99999", false},
		{"pivirtd", false},
		{"pivirtd:0", false},
		{"bad host!:9001", false},
	}
	for _, tt := range tests {
		t.Run(tt.endpoint, func(t *testing.T) {
			c := Default()
			c.Backends = map[string]BackendConfig{"b": {Endpoint: tt.endpoint}}
			err := c.Validate()
			if got := err == nil; got != tt.ok {
				t.Errorf("Validate() with endpoint %q = %v, want ok=%v", tt.endpoint, err, tt.ok)
			}
			if err != nil && !strings.HasPrefix(err.Error(), "backends.b.endpoint: invalid value ") {
				t.Errorf("error %q does not name backends.b.endpoint", err)
			}
		})
	}
}

// TestValidateReportsEverything checks that Validate collects all problems, each a
// *FieldError with its path.
func TestValidateReportsEverything(t *testing.T) {
	c := Default()
	c.NodeName = ""
	c.Cluster.Raft.Voters = 2
	c.Tracing.SamplingRate = 2
	c.CircuitBreaking.Thresholds.MaxEjectionPercent = 200
	c.Backends = map[string]BackendConfig{"c": {Endpoint: "unix:///run/c.sock"}}
	c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "x"}, Route: RouteTarget{Cluster: "c"}}}
	errs := unjoin(c.Validate())
	var paths []string
	for _, err := range errs {
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("%v is not a *FieldError", err)
		}
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%v does not wrap ErrInvalid", err)
		}
		paths = append(paths, fe.Path)
	}
	want := []string{
		"node_name",
		"tracing.sampling_rate",
		"routing.rules[0].match.prefix",
		"circuit_breaking.thresholds.max_ejection_percent",
		"cluster.raft.voters",
	}
	if strings.Join(paths, " ") != strings.Join(want, " ") {
		t.Errorf("problem paths = %q, want %q", paths, want)
	}
}

func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// TestEffectiveScopesAndRoutes: a unix:// backend is node-scoped, anything
// else cluster-scoped, unless configured; without a routing block the
// default routes serve the configured backends and name the APIs left
// without one.
func TestEffectiveScopesAndRoutes(t *testing.T) {
	for endpoint, want := range map[string]string{
		"unix:///run/pivirtd/pivirtd.sock": ScopeNode, "dns:///pivirtd.pilab.hu:9001": ScopeCluster,
		"https://osinfodb.pilab.hu:8443": ScopeCluster, "10.0.0.1:9001": ScopeCluster, "registry:///pivirtd": ScopeCluster,
	} {
		if got := (BackendConfig{Endpoint: endpoint}).EffectiveScope(); got != want {
			t.Errorf("scope of %s = %s, want %s", endpoint, got, want)
		}
	}
	if got := (BackendConfig{Endpoint: "unix:///x.sock", Scope: ScopeCluster}).EffectiveScope(); got != ScopeCluster {
		t.Errorf("configured scope not kept: %s", got)
	}

	c := Default()
	c.Backends = map[string]BackendConfig{"pivirtd": {Endpoint: "unix:///run/pivirtd/pivirtd.sock"}}
	rules, unrouted := c.EffectiveRoutes()
	var got []string
	for _, r := range rules {
		got = append(got, r.Match.Prefix+" "+r.Route.Cluster)
	}
	want := []string{"/pivirt.vm.v1.VMService/ pivirtd", "/pivirt.network.v1.NetworkService/ pivirtd"}
	if !slices.Equal(got, want) {
		t.Errorf("default routes %v, want %v", got, want)
	}
	if len(unrouted) != 1 || !strings.Contains(unrouted[0], "pivirt.storage.v1.StorageService (backends.iscsiman is not configured)") {
		t.Errorf("unrouted %v, want the storage API naming backends.iscsiman", unrouted)
	}
	// The specification's rules: VM and storage; the network API is left
	// unserved, and said so.
	c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: RouteTarget{Cluster: "pivirtd"}},
		{Match: RouteMatch{Prefix: "/pivirt.storage.v1.StorageService/"}, Route: RouteTarget{Cluster: "iscsiman"}}}
	rules, unrouted = c.EffectiveRoutes()
	if len(rules) != 2 || len(unrouted) != 1 || !strings.HasPrefix(unrouted[0], "pivirt.network.v1.NetworkService (no routing.rules prefix covers it") {
		t.Errorf("with routing.rules: %v %v, want the file's rules and the network API unserved", rules, unrouted)
	}
	c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/pivirt."}, Route: RouteTarget{Cluster: "pivirtd"}}}
	if rules, unrouted := c.EffectiveRoutes(); len(rules) != 1 || unrouted != nil {
		t.Errorf("with one rule for every API: %v %v, want it alone and nothing unserved", rules, unrouted)
	}
	c.Routing.Rules = []RouteRule{{Match: RouteMatch{Prefix: "/pivirt.vm.v1.VMServiceAdmin"}, Route: RouteTarget{Cluster: "pivirtd"}}}
	if _, unrouted := c.EffectiveRoutes(); len(unrouted) != 3 {
		t.Errorf("a prefix on another name boundary: unrouted %v, want all three APIs", unrouted)
	}
}
