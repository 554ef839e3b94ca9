// Package config defines the pivirt-agent configuration file (/etc/pivirt-agent/config.yaml)
// and the command-line flags that override it.
//
// The YAML keys are those of the reference configurations (testdata/spec-agent.yaml and
// testdata/spec-mesh.yaml), plus node_name, data_dir and the cluster block for the embedded
// Raft/gossip cluster. Load reads a file strictly (unknown keys, wrong types, bad durations and
// bad enum values are errors naming the full key path); Validate checks the semantics; Flags
// applies the flags the user actually set on top.
//
// Only cmd/ reads files and flags: the composition root turns a *Config into the Config of
// each package it wires.
package config

import (
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"
)

// Default listen addresses and other defaults shared by Default, ApplyDev and the flag help.
const (
	DefaultAPIAddr       = "0.0.0.0:8443"
	DefaultInternalAddr  = "0.0.0.0:9000"
	DefaultMetricsAddr   = "0.0.0.0:8444"
	DefaultMetricsPath   = "/metrics"
	DefaultGossipAddr    = "0.0.0.0:7946"
	DefaultRaftAddr      = "0.0.0.0:8300"
	DefaultDataDir       = "/var/lib/pivirt-agent"
	DefaultServicePrefix = "/pivirt/services"
	DefaultVoters        = 3
	DefaultMaxNonVoters  = 64
	// DefaultMaxStreamsPerCaller and DefaultBodyTimeout bound what one
	// caller holds on the API port (server.connectrpc).
	DefaultMaxStreamsPerCaller = 128
	DefaultBodyTimeout         = 30 * time.Second
	DefaultRetryInterval       = 30 * time.Second
	DefaultForwardHoldTimeout  = 7 * time.Second

	// DefaultClusterName is the cluster name unless cluster.name is set.
	DefaultClusterName = "pivirt"

	// DevNodeName is the node name ApplyDev sets unless --node-name is given.
	DevNodeName = "dev"
)

// Service discovery types (service_discovery.type).
const (
	DiscoveryRaft = "raft"
	DiscoveryEtcd = "etcd"
)

// Config is the whole agent configuration file. Field tags are the YAML keys; the `enum` tag
// lists the allowed values of a string key (a leading comma allows the empty string).
type Config struct {
	// NodeName is this node's human-readable name (default: the hostname). It is not the node
	// ID, which is created once in DataDir.
	NodeName string `yaml:"node_name"`
	// DataDir holds the node ID, the Raft log and snapshots. Empty only in dev mode, where
	// the caller uses a temporary directory.
	DataDir string `yaml:"data_dir"`

	Server           ServerConfig           `yaml:"server"`
	TLS              TLSConfig              `yaml:"tls"`
	ServiceDiscovery ServiceDiscoveryConfig `yaml:"service_discovery"`
	// Backends are the backend clusters by name (pivirtd, iscsiman, osinfodb, ...).
	Backends        map[string]BackendConfig `yaml:"backends"`
	Auth            AuthConfig               `yaml:"auth"`
	Logging         LoggingConfig            `yaml:"logging"`
	Tracing         TracingConfig            `yaml:"tracing"`
	Routing         RoutingConfig            `yaml:"routing"`
	LoadBalancing   LoadBalancingConfig      `yaml:"load_balancing"`
	CircuitBreaking CircuitBreakingConfig    `yaml:"circuit_breaking"`
	RateLimiting    RateLimitingConfig       `yaml:"rate_limiting"`
	Cluster         ClusterConfig            `yaml:"cluster"`
	Snapshot        SnapshotConfig           `yaml:"snapshot"`

	// PinnedSettings are cluster settings this node's file decides: the
	// cluster's value of a pinned key is not applied here
	// ("backends.<name>.retry" pins every backend's).
	PinnedSettings []string `yaml:"pinned_settings"`

	// Dev is set by --dev (ApplyDev): a single loopback node with a throw-away PKI. Not a
	// file key.
	Dev bool `yaml:"-"`
}

// SnapshotConfig is the snapshot block: the archives the leader writes on its own
// (`pvcli snapshot save` writes the same format on demand).
type SnapshotConfig struct {
	// Interval between two archives; 0 turns automatic snapshots off.
	Interval Duration `yaml:"interval"`
	// Dir receives the archives; empty means <data_dir>/backups.
	Dir string `yaml:"dir"`
	// Retain is how many archives are kept; older ones are deleted.
	Retain int `yaml:"retain"`
}

// Snapshot defaults.
const (
	DefaultSnapshotInterval = time.Hour
	DefaultSnapshotRetain   = 24
)

// ServerConfig is the server block: the agent's listeners.
type ServerConfig struct {
	ConnectRPC   ConnectRPCConfig `yaml:"connectrpc"`
	GRPCInternal ListenerConfig   `yaml:"grpc_internal"`
	Metrics      MetricsConfig    `yaml:"metrics"`
	UI           UIConfig         `yaml:"ui"`
}

// UIConfig is the operator web UI served on the API port at /ui/. It logs
// in with auth.oidc's issuer (authorization code with PKCE) or, without
// one, with the browser's client certificate.
type UIConfig struct {
	// Enabled serves the UI (the default); false answers 404 under /ui/.
	Enabled bool `yaml:"enabled"`
	// ClientID is the UI's OIDC client (a public client: no secret), when
	// it is not auth.oidc.client_id; its tokens must still carry the
	// agent's audience (auth.oidc.client_id).
	ClientID string `yaml:"client_id"`
	// Scopes asked for at login (default: openid).
	Scopes []string `yaml:"scopes"`
	// ConnectOrigins are origins (https://host[:port]) the page may call
	// besides the agent and the issuer: an identity provider whose token
	// endpoint is on another origin than its issuer URL.
	ConnectOrigins []string `yaml:"connect_origins"`
}

// ConnectRPCConfig is the external ConnectRPC/gRPC/gRPC-Web listener (port 8443).
type ConnectRPCConfig struct {
	Addr string          `yaml:"addr"`
	TLS  ServerTLSConfig `yaml:"tls"`
	// MaxStreamsPerCaller bounds the streaming calls (watches, consoles,
	// uploads) one caller may hold open at once; 0 means no bound.
	MaxStreamsPerCaller int `yaml:"max_streams_per_caller"`
	// BodyTimeout is how long the request of a call that sends one
	// message may take to arrive; 0 means no bound.
	BodyTimeout Duration `yaml:"body_timeout"`
}

// ServerTLSConfig holds the server certificate of the external listener.
type ServerTLSConfig struct {
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	CAFile   string `yaml:"ca_file"`
	// ClientCAFile verifies client certificates.
	ClientCAFile string `yaml:"client_ca_file"`
}

// ListenerConfig is a listener with only an address (the internal gRPC port 9000).
type ListenerConfig struct {
	Addr string `yaml:"addr"`
}

// MetricsConfig is the plain-HTTP operations listener (port 8444).
type MetricsConfig struct {
	Addr string `yaml:"addr"`
	Path string `yaml:"path"`
	// AllowRemoteManagement lets every caller use POST /reload and
	// /debug/*; by default they answer the callers of
	// ManagementAllowFrom only.
	AllowRemoteManagement bool `yaml:"allow_remote_management"`
	// ManagementAllowFrom are the caller addresses (IP addresses or CIDR
	// prefixes) that POST /reload and /debug/* answer (default 127.0.0.1
	// and ::1, as Consul's allow_write_http_from).
	ManagementAllowFrom []string `yaml:"management_allow_from"`
}

// KeyFiles lists the configured files that hold secret keys, by the key
// that names them: TLS keys (the agent's, the API listener's, the cluster
// CA's, each backend's and etcd's) and the gossip key.
func (c *Config) KeyFiles() [][2]string {
	var out [][2]string
	add := func(key, path string) {
		if path != "" {
			out = append(out, [2]string{key, path})
		}
	}
	add("tls.key_file", c.TLS.KeyFile)
	add("server.connectrpc.tls.key_file", c.Server.ConnectRPC.TLS.KeyFile)
	add("tls.cluster_ca.key_file", c.TLS.ClusterCA.KeyFile)
	add("cluster.gossip.encrypt_key_file", c.Cluster.Gossip.EncryptKeyFile)
	add("service_discovery.etcd.key_file", c.ServiceDiscovery.Etcd.KeyFile)
	for _, name := range slices.Sorted(maps.Keys(c.Backends)) {
		add("backends."+name+".tls.key_file", c.Backends[name].TLS.KeyFile)
	}
	return out
}

// DefaultManagementAllowFrom are the callers the management endpoints
// answer by default: this host's own loopback addresses.
var DefaultManagementAllowFrom = []string{"127.0.0.1", "::1"}

// ManagementPrefixes returns ManagementAllowFrom as prefixes (an address is
// a prefix of its full length); entries that do not parse are left out
// (Validate refuses them).
func (m MetricsConfig) ManagementPrefixes() []netip.Prefix {
	out := make([]netip.Prefix, 0, len(m.ManagementAllowFrom))
	for _, s := range m.ManagementAllowFrom {
		if p, err := parsePrefix(s); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// parsePrefix parses an IP address or a CIDR prefix.
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err == nil && p.Addr().Is4In6() && p.Bits() >= 96 {
			// ::ffff:10.0.0.0/104 is 10.0.0.0/8: callers are unmapped.
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		return p.Masked(), err
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
}

// TLSConfig is the top-level tls block: the agent's own mTLS identity, used between agents
// and towards backends. Enabled false turns TLS off everywhere (--dev keeps it on, with a throw-away PKI).
type TLSConfig struct {
	Enabled           bool   `yaml:"enabled"`
	CAFile            string `yaml:"ca_file"`
	CertFile          string `yaml:"cert_file"`
	KeyFile           string `yaml:"key_file"`
	VerifyPeer        bool   `yaml:"verify_peer"`
	RequireClientCert bool   `yaml:"require_client_cert"`
	// InsecureKeyPermissions lets the agent start with key files (TLS
	// keys, the gossip key) that group or others may read, with a
	// warning; by default it refuses them.
	InsecureKeyPermissions bool `yaml:"insecure_key_permissions"`
	// ClusterCA is the optional built-in cluster CA that renews the
	// agents' certificates.
	ClusterCA ClusterCAConfig `yaml:"cluster_ca"`
	// CAServer is the PiTrust CA server (pitrust serve) the agent renews
	// its certificates through.
	CAServer CAServerConfig `yaml:"ca_server"`
	// Revocation is how peers' certificates are checked for revocation.
	Revocation RevocationConfig `yaml:"revocation"`
}

// CAServerConfig is tls.ca_server: the agent renews its server and client
// certificates through a PiTrust CA server when RenewBefore or less of
// their lifetime remains. Off while URL is empty. Not with tls.cluster_ca.
type CAServerConfig struct {
	// URL is the CA server's API, e.g. https://pitrust.pivirt.internal:8080;
	// its certificate must verify against tls.ca_file.
	URL string `yaml:"url"`
	// RenewBefore is how long before expiry a certificate is renewed (at
	// most a third of its lifetime, less a jitter of up to a tenth).
	RenewBefore Duration `yaml:"renew_before"`
}

// DefaultRenewBefore is tls.ca_server.renew_before: 30 days.
const DefaultRenewBefore = 30 * 24 * time.Hour

// RevocationConfig is tls.revocation: every TLS listener and client of the
// agent refuses certificates their CA revoked, as its CRL (the
// certificate's CRL distribution point) or OCSP responder (its AIA) says.
type RevocationConfig struct {
	// Mode is what is asked: "crl", "ocsp", "both" (the CRL when it can
	// be had, else OCSP) or "off"; empty means "both".
	Mode string `yaml:"mode" enum:",crl,ocsp,both,off"`
	// OnUnavailable is what a certificate whose status cannot be learnt
	// (no answer, a stale CRL) gets: "allow" (logged) or "deny"; empty
	// means "allow".
	OnUnavailable string `yaml:"on_unavailable" enum:",allow,deny"`
	// Refresh is how often cached CRLs are fetched again (sooner at their
	// next update); connections of newly revoked certificates are closed
	// then. Zero means 30s.
	Refresh Duration `yaml:"refresh"`
}

// Revocation defaults.
const DefaultRevocationRefresh = 30 * time.Second

// ClusterCAConfig is tls.cluster_ca: an intermediate CA kept in the
// replicated state signs renewals of the agents' own certificates. Off by
// default: certificates come from PiTrust files only.
type ClusterCAConfig struct {
	// Enabled makes the agent renew its server and client certificates
	// through the leader, at a random 60-90% of their lifetime, and the
	// leader sign such renewals.
	Enabled bool `yaml:"enabled"`
	// CertFile and KeyFile are the intermediate CA (e.g. PiCA.pem and
	// PiCA.key) a leader installs into the replicated state when the state
	// holds none, or an older one. Only needed on the nodes that install it.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// LeafTTL is the lifetime of a renewed certificate.
	LeafTTL Duration `yaml:"leaf_ttl"`
	// CSRMaxPerSecond and CSRBurst rate-limit the renewals the leader signs.
	CSRMaxPerSecond float64 `yaml:"csr_max_per_second"`
	CSRBurst        int     `yaml:"csr_burst"`
}

// Cluster CA defaults.
const (
	DefaultLeafTTL         = 72 * time.Hour
	DefaultCSRMaxPerSecond = 10
	DefaultCSRBurst        = 20
)

// ServiceDiscoveryConfig selects where service registrations live: the embedded Raft store
// ("raft", default) or an external etcd ("etcd").
type ServiceDiscoveryConfig struct {
	Type string     `yaml:"type" enum:"raft,etcd"`
	Etcd EtcdConfig `yaml:"etcd"`
	// ServicesDir is a directory of service definition files (*.yaml, *.yml, *.json: one
	// instance each, as `pvcli service register --file` takes them) that the agent registers
	// for its node at start and on every reload; an instance whose file left the directory is
	// deregistered. Empty: none.
	ServicesDir string `yaml:"services_dir"`
}

// EtcdConfig is the etcd client used when service_discovery.type is "etcd". Prefix is also
// the key prefix of the services table in Raft mode.
type EtcdConfig struct {
	Endpoints []string `yaml:"endpoints"`
	CAFile    string   `yaml:"ca_file"`
	CertFile  string   `yaml:"cert_file"`
	KeyFile   string   `yaml:"key_file"`
	Prefix    string   `yaml:"prefix"`
}

// TLS reports whether the agent talks to etcd over TLS: with ca_file or
// cert_file set, or https:// endpoints.
func (e *EtcdConfig) TLS() bool {
	return e.CAFile != "" || e.CertFile != "" || slices.ContainsFunc(e.Endpoints, func(ep string) bool { return strings.HasPrefix(ep, "https://") })
}

// BackendConfig is one backend cluster. Endpoint is unix:///abs/path, dns:///host:port,
// host:port, https://host[:port] or registry:///<service> (the instances the services
// registry holds for that service). A zero Timeout means no per-try timeout; a zero
// Retry.MaxAttempts means a single attempt.
type BackendConfig struct {
	Endpoint string `yaml:"endpoint"`
	// Scope is "node" (the daemon of this node: the objects it holds live on
	// this node, and calls naming them are routed to this node's agent) or
	// "cluster" (one service for the whole cluster, load-balanced). Empty:
	// node for a unix:// endpoint, cluster otherwise (EffectiveScope).
	Scope   string           `yaml:"scope" enum:",node,cluster"`
	Timeout Duration         `yaml:"timeout"`
	Retry   RetryConfig      `yaml:"retry"`
	TLS     BackendTLSConfig `yaml:"tls"`
	// Required: /ready reports not ready while the backend has no
	// available endpoint.
	Required bool `yaml:"required"`
}

// Backend scopes (backends.<name>.scope).
const (
	ScopeNode    = "node"
	ScopeCluster = "cluster"
)

// EffectiveScope is the backend's scope: the configured one, else node for
// a daemon on a local socket (unix://) and cluster for anything reached
// over the network.
func (b BackendConfig) EffectiveScope() string {
	if b.Scope != "" {
		return b.Scope
	}
	if strings.HasPrefix(b.Endpoint, "unix://") {
		return ScopeNode
	}
	return ScopeCluster
}

// DefaultRoutes are the routes of a configuration without a routing block:
// each API to the backend that serves it in a PiVirt deployment.
var DefaultRoutes = []struct{ Service, Backend string }{
	{"pivirt.vm.v1.VMService", "pivirtd"},
	{"pivirt.network.v1.NetworkService", "pivirtd"},
	{"pivirt.storage.v1.StorageService", "iscsiman"},
}

// EffectiveRoutes are the routing rules in force: routing.rules when the
// file has any, else DefaultRoutes for the backends that are configured.
// unrouted lists the default services left without a route: because
// their backend is not configured, or because routing.rules has no rule
// for them (a call to them answers Unimplemented).
func (c *Config) EffectiveRoutes() (rules []RouteRule, unrouted []string) {
	if len(c.Routing.Rules) > 0 {
		for _, d := range DefaultRoutes {
			method := "/" + d.Service + "/"
			if !slices.ContainsFunc(c.Routing.Rules, func(r RouteRule) bool { return coversMethod(r.Match.Prefix, method) }) {
				unrouted = append(unrouted, fmt.Sprintf("%s (no routing.rules prefix covers it: its calls answer Unimplemented; add {match: {prefix: \"/%s\"}, route: {cluster: %s}} to serve it)",
					d.Service, d.Service, d.Backend))
			}
		}
		return c.Routing.Rules, unrouted
	}
	for _, d := range DefaultRoutes {
		if _, ok := c.Backends[d.Backend]; !ok {
			unrouted = append(unrouted, d.Service+" (backends."+d.Backend+" is not configured)")
			continue
		}
		rules = append(rules, RouteRule{Match: RouteMatch{Prefix: "/" + d.Service + "/"}, Route: RouteTarget{Cluster: d.Backend}})
	}
	return rules, unrouted
}

// coversMethod reports whether a routing prefix covers the methods
// beginning with method ("/pkg.Service/"), on name boundaries as the
// gateway's proxy matches them: "/pivirt.vm.v1.VMService" and "/pivirt."
// cover "/pivirt.vm.v1.VMService/", "/pivirt.vm.v1.VMServiceAdmin" does not.
func coversMethod(prefix, method string) bool {
	if strings.HasPrefix(method, prefix) {
		rest := method[len(prefix):]
		return rest == "" || strings.HasSuffix(prefix, "/") || strings.HasSuffix(prefix, ".") || strings.HasPrefix(rest, "/")
	}
	return false
}

// RetryConfig is a backend's retry policy.
type RetryConfig struct {
	MaxAttempts int      `yaml:"max_attempts"`
	Backoff     Duration `yaml:"backoff"`
}

// BackendTLSConfig is the client TLS towards one backend; empty files fall back to the
// top-level tls block.
type BackendTLSConfig struct {
	Enabled    bool   `yaml:"enabled"`
	CertFile   string `yaml:"cert_file"`
	KeyFile    string `yaml:"key_file"`
	CAFile     string `yaml:"ca_file"`
	ServerName string `yaml:"server_name"`
}

// AuthConfig is the authentication and authorization of external clients.
type AuthConfig struct {
	OIDC OIDCConfig `yaml:"oidc"`
	// RBACPolicy is the path of the RBAC policy file (rbac.yaml).
	RBACPolicy string `yaml:"rbac_policy"`
	// NetworkPolicy is the path of a file of NetworkPolicy documents
	// (package netpolicy): when set, peers on the internal and Raft
	// ports and the backends the agent calls must be allowed by one.
	NetworkPolicy string `yaml:"network_policy"`
	// CertificateRoles gives callers authenticated by a client certificate
	// their roles, by the certificate's CN: an exact name or a prefix
	// ending in "*" ("pivirt-agent-*").
	CertificateRoles map[string][]string `yaml:"certificate_roles"`
}

// OIDCConfig verifies bearer tokens; empty IssuerURL disables OIDC.
type OIDCConfig struct {
	IssuerURL string `yaml:"issuer_url"`
	ClientID  string `yaml:"client_id"`
	// IdentityClaim and RolesClaim are dotted claim paths (default "sub"
	// and "roles"; "preferred_username" and "realm_access.roles" for
	// Keycloak).
	IdentityClaim string `yaml:"identity_claim"`
	RolesClaim    string `yaml:"roles_claim"`
	// AllowHTTPIssuer accepts an http:// issuer on a loopback address
	// (a development issuer such as pitrust dev-issuer): any local
	// process that binds its port while it is down could mint tokens.
	// --dev allows it; otherwise the issuer must be https://.
	AllowHTTPIssuer bool `yaml:"allow_http_issuer"`
}

// LoggingConfig is the logging block. Output is "stdout", "stderr" or an absolute file path.
type LoggingConfig struct {
	Level string `yaml:"level" enum:"debug,info,warn,error"`
	// Components are levels of their own for parts of the agent (the
	// component attribute of their log lines: raft, gossip, access, ...).
	Components map[string]string `yaml:"components"`
	Format     string            `yaml:"format" enum:"json,text"`
	Output     string            `yaml:"output"`
	Sampling   SamplingConfig    `yaml:"sampling"`
	AccessLog  AccessLogConfig   `yaml:"access_log"`
}

// SlogLevels parses Level and Components.
func (l LoggingConfig) SlogLevels() (slog.Level, map[string]slog.Level, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(l.Level)); err != nil {
		return 0, nil, fmt.Errorf("logging.level: %w", err)
	}
	comps := make(map[string]slog.Level, len(l.Components))
	for name, v := range l.Components {
		var cl slog.Level
		if err := cl.UnmarshalText([]byte(v)); err != nil {
			return 0, nil, fmt.Errorf("%s: %w", joinKey("logging.components", name), err)
		}
		comps[name] = cl
	}
	return level, comps, nil
}

// SamplingConfig logs the first Initial entries with the same message each second, then
// every Thereafter-th. Zero values disable sampling.
type SamplingConfig struct {
	Initial    int `yaml:"initial"`
	Thereafter int `yaml:"thereafter"`
}

// AccessLogConfig is the per-request access log.
type AccessLogConfig struct {
	Enabled bool   `yaml:"enabled"`
	Format  string `yaml:"format" enum:"json,text"`
}

// TracingConfig is OpenTelemetry tracing. Exporter otlp sends OTLP over gRPC to Endpoint
// (host:port or http(s)://host:port), jaeger to the OTLP port of the Jaeger collector
// Endpoint names, zipkin posts Zipkin v2 JSON to Endpoint, an http(s) URL
// (http://zipkin:9411/api/v2/spans; /api/v2/spans when it has no path). An empty Exporter
// lets the telemetry code choose from the endpoint (zipkin for a URL ending in
// /api/v2/spans, else OTLP).
type TracingConfig struct {
	Enabled      bool    `yaml:"enabled"`
	Exporter     string  `yaml:"exporter" enum:",otlp,jaeger,zipkin"`
	Endpoint     string  `yaml:"endpoint"`
	SamplingRate float64 `yaml:"sampling_rate"`
}

// RoutingConfig maps request path prefixes to backend clusters.
type RoutingConfig struct {
	Rules []RouteRule `yaml:"rules"`
}

// RouteRule sends requests whose path starts with Match.Prefix to Route.Cluster.
type RouteRule struct {
	Match RouteMatch  `yaml:"match"`
	Route RouteTarget `yaml:"route"`
}

// RouteMatch is the request side of a route rule.
type RouteMatch struct {
	Prefix string `yaml:"prefix"`
}

// RouteTarget is the backend side of a route rule.
type RouteTarget struct {
	Cluster string `yaml:"cluster"`
	// DescriptorSet names a FileDescriptorSet file (binary: buf build
	// -o FILE.binpb, or protoc --include_imports --descriptor_set_out)
	// holding the schema of the services the rule routes: with it, JSON
	// callers are transcoded to proto, Connect GET is served for
	// idempotent methods only, and methods annotated with
	// (pivirt.api.v1.authz) get the access control of the built-in APIs.
	DescriptorSet string `yaml:"descriptor_set"`
}

// LoadBalancingConfig is the endpoint picking and active health checking of backend clusters.
type LoadBalancingConfig struct {
	Policy      string            `yaml:"policy" enum:"round_robin,least_connections,random"`
	HealthCheck HealthCheckConfig `yaml:"health_check"`
}

// HealthCheckConfig is active grpc.health.v1 checking of backend endpoints.
type HealthCheckConfig struct {
	Enabled            bool     `yaml:"enabled"`
	Interval           Duration `yaml:"interval"`
	Timeout            Duration `yaml:"timeout"`
	HealthyThreshold   int      `yaml:"healthy_threshold"`
	UnhealthyThreshold int      `yaml:"unhealthy_threshold"`
}

// CircuitBreakingConfig is outlier ejection with Envoy semantics.
type CircuitBreakingConfig struct {
	Enabled    bool                     `yaml:"enabled"`
	Thresholds CircuitBreakerThresholds `yaml:"thresholds"`
}

// CircuitBreakerThresholds are the outlier detection parameters.
type CircuitBreakerThresholds struct {
	Consecutive5xx     int      `yaml:"consecutive_5xx"`
	Interval           Duration `yaml:"interval"`
	BaseEjectionTime   Duration `yaml:"base_ejection_time"`
	MaxEjectionPercent int      `yaml:"max_ejection_percent"`
}

// RateLimitingConfig limits the calls of each principal on the API port with token
// buckets: one per route listed (the longest matching prefix of the method,
// "/pivirt.vm.v1.VMService/" or "/pivirt.vm.v1.VMService/PowerOn"), and one for every other
// method. A call over the limit fails with ResourceExhausted and a retry hint.
type RateLimitingConfig struct {
	Enabled           bool             `yaml:"enabled"`
	RequestsPerSecond float64          `yaml:"requests_per_second"`
	Burst             int              `yaml:"burst"`
	Routes            []RateLimitRoute `yaml:"routes"`
}

// RateLimitRoute is the bucket of the methods under Prefix.
type RateLimitRoute struct {
	Prefix            string  `yaml:"prefix"`
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	Burst             int     `yaml:"burst"`
}

// Rate limit defaults (per principal, when rate_limiting.enabled).
const (
	DefaultRequestsPerSecond = 100
	DefaultRateBurst         = 200
)

// ClusterConfig is the embedded cluster: gossip membership and the Raft group.
type ClusterConfig struct {
	// Name is the cluster's name (default "pivirt"). Agents refuse gossip
	// members of another cluster, so two clusters on one network can never
	// merge by a wrong join address.
	Name string `yaml:"name"`
	// AdvertiseAddr is the IP other nodes use to reach this one; empty derives it from the
	// bind addresses.
	AdvertiseAddr string       `yaml:"advertise_addr"`
	Gossip        GossipConfig `yaml:"gossip"`
	Raft          RaftConfig   `yaml:"raft"`
	// Join lists gossip addresses (host:port) contacted once at start.
	Join []string `yaml:"join"`
	// RetryJoin lists gossip addresses retried every RetryInterval, at most RetryMax times
	// (0 = forever).
	RetryJoin        []string `yaml:"retry_join"`
	RetryInterval    Duration `yaml:"retry_interval"`
	RetryMax         int      `yaml:"retry_max"`
	LeaveOnTerminate bool     `yaml:"leave_on_terminate"`
	// TransferLeadershipOnShutdown: a leader stopping without leaving
	// (SIGTERM, systemctl stop) first hands leadership to another voter,
	// so writes see no election timeout.
	TransferLeadershipOnShutdown bool `yaml:"transfer_leadership_on_shutdown"`
	// ForwardHoldTimeout is how long a request waits for a leader before failing.
	ForwardHoldTimeout Duration `yaml:"forward_hold_timeout"`
}

// GossipConfig is the memberlist ring.
type GossipConfig struct {
	BindAddr      string `yaml:"bind_addr"`
	AdvertiseAddr string `yaml:"advertise_addr"`
	// EncryptKeyFile holds a base64 16, 24 or 32 byte key; empty disables gossip encryption.
	EncryptKeyFile string `yaml:"encrypt_key_file"`
}

// RaftConfig is the Raft group. The timeouts map to the hashicorp/raft Config fields of the
// same names.
type RaftConfig struct {
	Addr          string `yaml:"addr"`
	AdvertiseAddr string `yaml:"advertise_addr"`
	// Voters is the target voter count (odd, 1..7); further servers are non-voters.
	Voters int `yaml:"voters"`
	// MaxNonVoters caps the non-voters (0: no cap): a server past it waits in
	// gossip until a seat frees. It bounds the replication fan-out.
	MaxNonVoters int `yaml:"max_non_voters"`
	// BootstrapExpect bootstraps once this many servers are seen (0 = never).
	BootstrapExpect int `yaml:"bootstrap_expect"`
	// Bootstrap starts a single-node cluster on an empty log.
	Bootstrap bool `yaml:"bootstrap"`
	// DeadServerCleanup removes a failed server after this long (0 disables).
	DeadServerCleanup  Duration `yaml:"dead_server_cleanup"`
	HeartbeatTimeout   Duration `yaml:"heartbeat_timeout"`
	ElectionTimeout    Duration `yaml:"election_timeout"`
	LeaderLeaseTimeout Duration `yaml:"leader_lease_timeout"`
	SnapshotThreshold  uint64   `yaml:"snapshot_threshold"`
	SnapshotInterval   Duration `yaml:"snapshot_interval"`
	TrailingLogs       uint64   `yaml:"trailing_logs"`
	// LogStore is the Raft log store of a new data dir: "wal" (hashicorp/raft-wal, the default)
	// or "boltdb" (raft-boltdb). A data dir that already holds a log keeps its store; convert
	// one with `pivirt-agent raft migrate-log-store`.
	LogStore string `yaml:"log_store"`
	// WALSegmentSizeMB is the size of the WAL's preallocated segment files, in MiB.
	WALSegmentSizeMB int `yaml:"wal_segment_size_mb"`
	// LogVerification checks every node's log against the leader's checksums.
	LogVerification LogVerificationConfig `yaml:"log_verification"`
	// ReplicaCheck compares every server's replicated state with the leader's.
	ReplicaCheck ReplicaCheckConfig `yaml:"replica_check"`
}

// ReplicaCheckConfig is the leader's periodic comparison of the replicas: every Interval it
// appends a checkpoint and compares each server's state hash at that index with its own, table
// by table (pvcli operator raft verify does the same on demand); a difference is logged,
// counted (pivirt_raft_replica_mismatches) and shown by /ready.
type ReplicaCheckConfig struct {
	Enabled  bool     `yaml:"enabled"`
	Interval Duration `yaml:"interval"`
}

// LogVerificationConfig is the Raft log verification: the leader appends a checkpoint every
// Interval and every node compares the checksum of the entries since the previous one, as
// written and as read back from its disk, with the leader's.
type LogVerificationConfig struct {
	Enabled  bool     `yaml:"enabled"`
	Interval Duration `yaml:"interval"`
}

// Default returns the configuration used for every key the file does not set: the values of
// the spec, node_name from the hostname, and certificate paths of the spec's example (TLS is
// enabled by default).
func Default() *Config {
	hostname, _ := os.Hostname() // empty on error: Validate reports node_name
	return &Config{
		NodeName: hostname,
		DataDir:  DefaultDataDir,
		Server: ServerConfig{
			ConnectRPC: ConnectRPCConfig{
				Addr: DefaultAPIAddr,
				TLS: ServerTLSConfig{
					CertFile:     "/etc/pivirt/certs/agent-server.crt",
					KeyFile:      "/etc/pivirt/certs/agent-server.key",
					CAFile:       "/etc/pivirt/certs/ca-chain.pem",
					ClientCAFile: "/etc/pivirt/certs/ca-chain.pem",
				},
				MaxStreamsPerCaller: DefaultMaxStreamsPerCaller,
				BodyTimeout:         Duration(DefaultBodyTimeout),
			},
			GRPCInternal: ListenerConfig{Addr: DefaultInternalAddr},
			Metrics:      MetricsConfig{Addr: DefaultMetricsAddr, Path: DefaultMetricsPath, ManagementAllowFrom: slices.Clone(DefaultManagementAllowFrom)},
			UI:           UIConfig{Enabled: true},
		},
		TLS: TLSConfig{
			Enabled:           true,
			CAFile:            "/etc/pivirt/certs/ca-chain.pem",
			CertFile:          "/etc/pivirt/certs/agent-client.crt",
			KeyFile:           "/etc/pivirt/certs/agent-client.key",
			VerifyPeer:        true,
			RequireClientCert: true,
			ClusterCA: ClusterCAConfig{
				LeafTTL:         Duration(DefaultLeafTTL),
				CSRMaxPerSecond: DefaultCSRMaxPerSecond,
				CSRBurst:        DefaultCSRBurst,
			},
			CAServer:   CAServerConfig{RenewBefore: Duration(DefaultRenewBefore)},
			Revocation: RevocationConfig{Mode: "both", OnUnavailable: "allow", Refresh: Duration(DefaultRevocationRefresh)},
		},
		ServiceDiscovery: ServiceDiscoveryConfig{
			Type: DiscoveryRaft,
			Etcd: EtcdConfig{Prefix: DefaultServicePrefix},
		},
		Logging: LoggingConfig{
			Level:     "info",
			Format:    "json",
			Output:    "stdout",
			Sampling:  SamplingConfig{Initial: 100, Thereafter: 100},
			AccessLog: AccessLogConfig{Enabled: false, Format: "json"},
		},
		Tracing: TracingConfig{SamplingRate: 0.1},
		LoadBalancing: LoadBalancingConfig{
			Policy: "round_robin",
			HealthCheck: HealthCheckConfig{
				Enabled:            true,
				Interval:           Duration(10 * time.Second),
				Timeout:            Duration(5 * time.Second),
				HealthyThreshold:   2,
				UnhealthyThreshold: 3,
			},
		},
		CircuitBreaking: CircuitBreakingConfig{
			Enabled: true,
			Thresholds: CircuitBreakerThresholds{
				Consecutive5xx:     5,
				Interval:           Duration(10 * time.Second),
				BaseEjectionTime:   Duration(30 * time.Second),
				MaxEjectionPercent: 50,
			},
		},
		RateLimiting: RateLimitingConfig{RequestsPerSecond: DefaultRequestsPerSecond, Burst: DefaultRateBurst},
		Cluster: ClusterConfig{
			Name:   DefaultClusterName,
			Gossip: GossipConfig{BindAddr: DefaultGossipAddr},
			Raft: RaftConfig{
				Addr:               DefaultRaftAddr,
				Voters:             DefaultVoters,
				MaxNonVoters:       DefaultMaxNonVoters,
				DeadServerCleanup:  Duration(time.Minute),
				HeartbeatTimeout:   Duration(time.Second),
				ElectionTimeout:    Duration(time.Second),
				LeaderLeaseTimeout: Duration(500 * time.Millisecond),
				SnapshotThreshold:  8192,
				SnapshotInterval:   Duration(2 * time.Minute),
				TrailingLogs:       10240,
				WALSegmentSizeMB:   64,
				LogVerification:    LogVerificationConfig{Enabled: true, Interval: Duration(time.Minute)},
				ReplicaCheck:       ReplicaCheckConfig{Enabled: true, Interval: Duration(5 * time.Minute)},
			},
			RetryInterval:                Duration(DefaultRetryInterval),
			TransferLeadershipOnShutdown: true,
			ForwardHoldTimeout:           Duration(DefaultForwardHoldTimeout),
		},
		Snapshot: SnapshotConfig{
			Interval: Duration(DefaultSnapshotInterval),
			Retain:   DefaultSnapshotRetain,
		},
	}
}

// ApplyDev turns cfg into a single development node: every listener on 127.0.0.1 with the
// default ports, TLS on with no certificate files (the agent makes a throw-away PiTrust PKI
// in its data dir), Raft discovery, a self-bootstrapped one-voter cluster, node name "dev"
// and an empty data_dir (the caller uses a temporary directory). Flags.Apply calls it for
// --dev before the explicit flags, so those still win.
func ApplyDev(cfg *Config) {
	cfg.Dev = true
	cfg.NodeName = DevNodeName
	cfg.DataDir = ""
	cfg.Server.ConnectRPC.Addr = loopback(DefaultAPIAddr)
	cfg.Server.GRPCInternal.Addr = loopback(DefaultInternalAddr)
	cfg.Server.Metrics.Addr = loopback(DefaultMetricsAddr)
	cfg.TLS = TLSConfig{Enabled: true, VerifyPeer: true, RequireClientCert: true}
	cfg.Server.ConnectRPC.TLS = ServerTLSConfig{}
	cfg.ServiceDiscovery.Type = DiscoveryRaft
	cfg.Cluster.AdvertiseAddr = "127.0.0.1"
	cfg.Cluster.Gossip.BindAddr = loopback(DefaultGossipAddr)
	cfg.Cluster.Gossip.AdvertiseAddr = ""
	cfg.Cluster.Raft.Addr = loopback(DefaultRaftAddr)
	cfg.Cluster.Raft.AdvertiseAddr = ""
	cfg.Cluster.Raft.Voters = 1
	cfg.Cluster.Raft.Bootstrap = true
	cfg.Cluster.Raft.BootstrapExpect = 0
	cfg.Cluster.Join = nil
	cfg.Cluster.RetryJoin = nil
}

// loopback replaces the host of a default "0.0.0.0:port" address with 127.0.0.1.
func loopback(addr string) string {
	_, port, _ := net.SplitHostPort(addr) // addr is one of the constants above
	return net.JoinHostPort("127.0.0.1", port)
}
