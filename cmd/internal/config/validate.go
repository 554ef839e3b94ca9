package config

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
)

// Validate checks the semantics of c: addresses and ports, enumerations, ranges, required
// keys and combinations that exclude each other. It returns every problem at once, each a
// *FieldError naming the key path, joined with errors.Join; nil if c is usable. It reads the
// file system only to check that cluster.gossip.encrypt_key_file exists.
func (c *Config) Validate() error {
	v := &validator{}
	c.validateAll(v)
	return errors.Join(v.errs...)
}

func (c *Config) validateAll(v *validator) {
	v.enums(reflect.ValueOf(c).Elem(), "")
	c.validateNode(v)
	c.validateServer(v)
	c.validateTLS(v)
	c.validateDiscovery(v)
	c.validateBackends(v)
	c.validateAuth(v)
	c.validateRateLimiting(v)
	c.validateLogging(v)
	c.validateTracing(v)
	c.validateMesh(v)
	c.validateCluster(v)
	c.validateSnapshot(v)
	c.validatePinned(v)
}

// validatePinned checks pinned_settings: each names a cluster setting.
func (c *Config) validatePinned(v *validator) {
	for i, p := range c.PinnedSettings {
		known := slices.Contains(SettingKeys(), p)
		if s, _, ok, err := LookupSetting(p); err == nil && ok && !s.Document {
			known = true
		}
		if !known {
			v.add(fmt.Sprintf("pinned_settings[%d]", i), "%w %q: not a cluster setting (settings: %s)", ErrInvalid, p, strings.Join(SettingKeys(), ", "))
		}
	}
}

func (c *Config) validateSnapshot(v *validator) {
	s := c.Snapshot
	if s.Interval < 0 {
		v.add("snapshot.interval", "%w %s: must not be negative (0 turns automatic snapshots off)", ErrInvalid, s.Interval)
	} else if s.Interval > 0 && s.Interval.Std() < time.Minute {
		v.add("snapshot.interval", "%w %s: at least 1m (or 0 to turn automatic snapshots off)", ErrInvalid, s.Interval)
	}
	if s.Retain < 1 {
		v.add("snapshot.retain", "%w %d: must keep at least 1 archive", ErrInvalid, s.Retain)
	}
}

var componentName = regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`)

type validator struct {
	errs []error
	// setting: a cluster setting is checked on its own; what it names
	// elsewhere in the configuration (a route's backend) is checked where
	// it is applied.
	setting bool
}

func (v *validator) add(path, format string, args ...any) {
	v.errs = append(v.errs, &FieldError{Path: path, Err: fmt.Errorf(format, args...)})
}

// enums checks every string field with an `enum` tag, through structs, maps and slices.
func (v *validator) enums(rv reflect.Value, path string) {
	switch rv.Kind() {
	case reflect.Pointer:
		if !rv.IsNil() {
			v.enums(rv.Elem(), path)
		}
	case reflect.Struct:
		for _, f := range fieldsOf(rv.Type()) {
			fv := rv.Field(f.index)
			p := joinKey(path, f.name)
			if f.enum != nil && fv.Kind() == reflect.String {
				if err := checkEnum(fv.String(), f.enum); err != nil {
					v.errs = append(v.errs, &FieldError{Path: p, Err: err})
				}
				continue
			}
			v.enums(fv, p)
		}
	case reflect.Map:
		keys := rv.MapKeys()
		slices.SortFunc(keys, func(a, b reflect.Value) int { return strings.Compare(a.String(), b.String()) })
		for _, k := range keys {
			v.enums(rv.MapIndex(k), joinKey(path, k.String()))
		}
	case reflect.Slice:
		for i := range rv.Len() {
			v.enums(rv.Index(i), path+"["+strconv.Itoa(i)+"]")
		}
	}
}

func (c *Config) validateNode(v *validator) {
	switch {
	case c.NodeName == "":
		v.add("node_name", "%w: required (default: the hostname)", ErrInvalid)
	case strings.ContainsFunc(c.NodeName, func(r rune) bool {
		return unicode.IsSpace(r) || !unicode.IsPrint(r) || r == '/' || r == '\\'
	}):
		v.add("node_name", "%w %q: must not contain spaces, slashes or control characters", ErrInvalid, c.NodeName)
	case len(c.NodeName) > 128:
		v.add("node_name", "%w: longer than 128 bytes", ErrInvalid)
	}
	if c.DataDir == "" && !c.Dev {
		v.add("data_dir", "%w: required (only --dev runs without one)", ErrInvalid)
	}
}

func (c *Config) validateServer(v *validator) {
	s := &c.Server
	v.listenAddr("server.connectrpc.addr", s.ConnectRPC.Addr, false)
	if s.ConnectRPC.MaxStreamsPerCaller < 0 {
		v.add("server.connectrpc.max_streams_per_caller", "%w: must not be negative (0 means no bound), got %d", ErrInvalid, s.ConnectRPC.MaxStreamsPerCaller)
	}
	v.nonNegative("server.connectrpc.body_timeout", s.ConnectRPC.BodyTimeout)
	v.listenAddr("server.grpc_internal.addr", s.GRPCInternal.Addr, false)
	v.listenAddr("server.metrics.addr", s.Metrics.Addr, false)
	if !strings.HasPrefix(s.Metrics.Path, "/") {
		v.add("server.metrics.path", "%w %q: must start with \"/\"", ErrInvalid, s.Metrics.Path)
	}
	for i, o := range s.UI.ConnectOrigins {
		if u, err := url.Parse(o); err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil {
			v.add(fmt.Sprintf("server.ui.connect_origins[%d]", i), "%w %q: want an origin, https://host[:port], without a path", ErrInvalid, o)
		}
	}
	for i, a := range s.Metrics.ManagementAllowFrom {
		if _, err := parsePrefix(a); err != nil {
			v.add(fmt.Sprintf("server.metrics.management_allow_from[%d]", i), "%w %q: want an IP address (127.0.0.1) or a CIDR prefix (10.0.0.0/8)", ErrInvalid, a)
		}
	}
	v.pair("server.connectrpc.tls", s.ConnectRPC.TLS.CertFile, s.ConnectRPC.TLS.KeyFile)

	// Listeners that must not share a port. Raft may share server.grpc_internal.addr (one
	// port, multiplexed), so that pair is allowed.
	type listener struct{ path, addr string }
	ls := []listener{
		{"server.connectrpc.addr", s.ConnectRPC.Addr},
		{"server.grpc_internal.addr", s.GRPCInternal.Addr},
		{"server.metrics.addr", s.Metrics.Addr},
		{"cluster.gossip.bind_addr", c.Cluster.Gossip.BindAddr},
		{"cluster.raft.addr", c.Cluster.Raft.Addr},
	}
	for i := range ls {
		for j := range i {
			a, b := ls[j], ls[i]
			if a.path == "server.grpc_internal.addr" && b.path == "cluster.raft.addr" {
				continue
			}
			if addrsOverlap(a.addr, b.addr) {
				v.add(b.path, "%w %q: same port as %s %q", ErrInvalid, b.addr, a.path, a.addr)
			}
		}
	}
}

func (c *Config) validateTLS(v *validator) {
	t := &c.TLS
	v.pair("tls", t.CertFile, t.KeyFile)
	c.validateClusterCA(v)
	c.validateCAServer(v)
	c.validateRevocation(v)
	if !t.Enabled {
		return
	}
	if !t.VerifyPeer {
		v.add("tls.verify_peer", "%w false: not supported, agents always verify their peers (leave it true, or set tls.enabled: false on a trusted network)", ErrInvalid)
	}
	if c.Dev && t.CertFile == "" && t.CAFile == "" && c.Server.ConnectRPC.TLS.CertFile == "" {
		// --dev without certificate files: the agent makes a throw-away PKI.
		return
	}
	const why = "required when tls.enabled is true"
	for _, r := range []struct{ path, val string }{
		{"server.connectrpc.tls.cert_file", c.Server.ConnectRPC.TLS.CertFile},
		{"server.connectrpc.tls.key_file", c.Server.ConnectRPC.TLS.KeyFile},
		{"tls.cert_file", t.CertFile},
		{"tls.key_file", t.KeyFile},
		{"tls.ca_file", t.CAFile},
	} {
		if r.val == "" {
			v.add(r.path, "%w: %s", ErrInvalid, why)
		}
	}
	if t.RequireClientCert && c.Server.ConnectRPC.TLS.ClientCAFile == "" && t.CAFile == "" {
		v.add("server.connectrpc.tls.client_ca_file", "%w: required when tls.require_client_cert is true (or set tls.ca_file)", ErrInvalid)
	}
}

func (c *Config) validateClusterCA(v *validator) {
	ca := &c.TLS.ClusterCA
	v.pair("tls.cluster_ca", ca.CertFile, ca.KeyFile)
	if !ca.Enabled {
		return
	}
	if !c.TLS.Enabled {
		v.add("tls.cluster_ca.enabled", "%w: the cluster CA renews TLS certificates; it needs tls.enabled: true", ErrInvalid)
	}
	if c.ServiceDiscovery.Type == DiscoveryEtcd {
		v.add("tls.cluster_ca.enabled", "%w: the cluster CA signs on the Raft leader; with service_discovery.type \"etcd\" issue certificates with pitrust instead", ErrInvalid)
	}
	if ca.LeafTTL.Std() < 10*time.Second {
		v.add("tls.cluster_ca.leaf_ttl", "%w %s: at least 10s", ErrInvalid, ca.LeafTTL)
	}
	if ca.CSRMaxPerSecond <= 0 {
		v.add("tls.cluster_ca.csr_max_per_second", "%w %v: must be positive", ErrInvalid, ca.CSRMaxPerSecond)
	}
	if ca.CSRBurst < 1 {
		v.add("tls.cluster_ca.csr_burst", "%w %d: at least 1", ErrInvalid, ca.CSRBurst)
	}
}

func (c *Config) validateCAServer(v *validator) {
	cs := &c.TLS.CAServer
	if cs.URL == "" {
		return
	}
	if u, err := url.Parse(cs.URL); err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		v.add("tls.ca_server.url", "%w %q: want the CA server's https://host:port (e.g. https://pitrust.pivirt.internal:8080)", ErrInvalid, cs.URL)
	}
	if !c.TLS.Enabled {
		v.add("tls.ca_server.url", "%w: renewal through a CA server needs tls.enabled: true", ErrInvalid)
	}
	if c.TLS.ClusterCA.Enabled {
		v.add("tls.ca_server.url", "%w: tls.cluster_ca.enabled also renews the certificates; use one of them", ErrInvalid)
	}
	if cs.RenewBefore.Std() < time.Minute {
		v.add("tls.ca_server.renew_before", "%w %s: at least 1m (default 720h: 30 days)", ErrInvalid, cs.RenewBefore)
	}
}

func (c *Config) validateDiscovery(v *validator) {
	sd := &c.ServiceDiscovery
	e := &sd.Etcd
	if sd.Type == DiscoveryEtcd && len(e.Endpoints) == 0 {
		v.add("service_discovery.etcd.endpoints", "%w: at least one endpoint is required when service_discovery.type is \"etcd\"", ErrInvalid)
	}
	for i, ep := range e.Endpoints {
		p := "service_discovery.etcd.endpoints[" + strconv.Itoa(i) + "]"
		if err := checkURLOrHostPort(ep, "http", "https"); err != nil {
			v.add(p, "%w %q: %w", ErrInvalid, ep, err)
		} else if strings.HasPrefix(ep, "http://") && e.TLS() {
			v.add(p, "%w %q: plaintext, but the agent talks to etcd over TLS (ca_file, cert_file or an https:// endpoint is set); use https://", ErrInvalid, ep)
		}
	}
	v.pair("service_discovery.etcd", e.CertFile, e.KeyFile)
	if !strings.HasPrefix(e.Prefix, "/") {
		v.add("service_discovery.etcd.prefix", "%w %q: must start with \"/\"", ErrInvalid, e.Prefix)
	}
}

func (c *Config) validateBackends(v *validator) {
	names := make([]string, 0, len(c.Backends))
	for name := range c.Backends {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		b := c.Backends[name]
		p := joinKey("backends", name)
		if err := checkName(name); err != nil {
			v.add(p, "%w: backend name %q %w", ErrInvalid, name, err)
		}
		if b.Endpoint == "" {
			v.add(p+".endpoint", "%w: required", ErrInvalid)
		} else if err := checkBackendEndpoint(b.Endpoint); err != nil {
			v.add(p+".endpoint", "%w %q: %w", ErrInvalid, b.Endpoint, err)
		}
		v.nonNegative(p+".timeout", b.Timeout)
		if b.EffectiveScope() == ScopeNode && strings.HasPrefix(b.Endpoint, "registry:///") {
			v.add(p+".scope", "%w: a node-scoped backend is this node's own daemon; registry:/// spreads calls over the instances of a service (use scope: cluster)", ErrInvalid)
		}
		if b.Retry.MaxAttempts < 0 {
			v.add(p+".retry.max_attempts", "%w: must not be negative, got %d", ErrInvalid, b.Retry.MaxAttempts)
		}
		v.nonNegative(p+".retry.backoff", b.Retry.Backoff)
		v.pair(p+".tls", b.TLS.CertFile, b.TLS.KeyFile)
	}
}

func (c *Config) validateRateLimiting(v *validator) {
	r := c.RateLimiting
	if !r.Enabled {
		return
	}
	if r.RequestsPerSecond <= 0 {
		v.add("rate_limiting.requests_per_second", "%w %g: must be positive", ErrInvalid, r.RequestsPerSecond)
	}
	if r.Burst < 1 {
		v.add("rate_limiting.burst", "%w %d: must be at least 1", ErrInvalid, r.Burst)
	}
	seen := map[string]bool{}
	for i, rt := range r.Routes {
		at := fmt.Sprintf("rate_limiting.routes[%d]", i)
		switch {
		case !strings.HasPrefix(rt.Prefix, "/"):
			v.add(at+".prefix", "%w %q: a method prefix such as \"/pivirt.vm.v1.VMService/\"", ErrInvalid, rt.Prefix)
		case seen[rt.Prefix]:
			v.add(at+".prefix", "%w %q: listed twice", ErrInvalid, rt.Prefix)
		}
		seen[rt.Prefix] = true
		if rt.RequestsPerSecond <= 0 {
			v.add(at+".requests_per_second", "%w %g: must be positive", ErrInvalid, rt.RequestsPerSecond)
		}
		if rt.Burst < 1 {
			v.add(at+".burst", "%w %d: must be at least 1", ErrInvalid, rt.Burst)
		}
	}
}

func (c *Config) validateAuth(v *validator) {
	if c.Auth.NetworkPolicy != "" && !c.TLS.Enabled {
		v.add("auth.network_policy", "%w: network policies match the service names of TLS certificates; they need tls.enabled: true", ErrInvalid)
	}
	for _, pattern := range slices.Sorted(maps.Keys(c.Auth.CertificateRoles)) {
		p := joinKey("auth.certificate_roles", pattern)
		if prefix, _ := strings.CutSuffix(pattern, "*"); prefix == "" || strings.Contains(prefix, "*") {
			v.add(p, "%w: %q: a certificate CN, or a CN prefix ending in \"*\"", ErrInvalid, pattern)
		}
		roles := c.Auth.CertificateRoles[pattern]
		if len(roles) == 0 {
			v.add(p, "%w: no roles", ErrInvalid)
		}
		for i, r := range roles {
			if strings.TrimSpace(r) == "" {
				v.add(p+"["+strconv.Itoa(i)+"]", "%w: empty role", ErrInvalid)
			}
		}
	}
	for _, cl := range []struct{ path, val string }{{"auth.oidc.identity_claim", c.Auth.OIDC.IdentityClaim}, {"auth.oidc.roles_claim", c.Auth.OIDC.RolesClaim}} {
		if cl.val != "" && !claimPath.MatchString(cl.val) {
			v.add(cl.path, "%w %q: a claim name or a dotted path of claim names", ErrInvalid, cl.val)
		}
	}
	o := &c.Auth.OIDC
	if o.IssuerURL == "" {
		return
	}
	u, err := url.Parse(o.IssuerURL)
	switch {
	case err != nil:
		v.add("auth.oidc.issuer_url", "%w %q: %w", ErrInvalid, o.IssuerURL, err)
	case u.Host == "" || (u.Scheme != "https" && !(u.Scheme == "http" && isLoopbackHost(u.Hostname()))):
		v.add("auth.oidc.issuer_url", "%w %q: must be an https:// URL (http:// only on loopback, for development)", ErrInvalid, o.IssuerURL)
	case u.Scheme == "http" && !o.AllowHTTPIssuer && !c.Dev:
		v.add("auth.oidc.issuer_url", "%w %q: an http:// issuer is accepted only for development (--dev, or auth.oidc.allow_http_issuer: true): any local process that binds its port while it is down could sign tokens; use an https:// issuer", ErrInvalid, o.IssuerURL)
	}
	if o.ClientID == "" {
		v.add("auth.oidc.client_id", "%w: required when auth.oidc.issuer_url is set", ErrInvalid)
	}
}

func (c *Config) validateLogging(v *validator) {
	l := &c.Logging
	for _, name := range slices.Sorted(maps.Keys(l.Components)) {
		p := joinKey("logging.components", name)
		if !componentName.MatchString(name) {
			v.add(p, "%w: component %q: lowercase letters, digits and '-' (the component of the log lines: raft, gossip, access, ...)", ErrInvalid, name)
		}
		if err := checkEnum(l.Components[name], enumOf(reflect.TypeFor[LoggingConfig](), "level")); err != nil {
			v.add(p, "%w", err)
		}
	}
	if out := l.Output; out != "stdout" && out != "stderr" && !filepath.IsAbs(out) {
		v.add("logging.output", "%w %q: must be \"stdout\", \"stderr\" or an absolute file path", ErrInvalid, out)
	}
	if l.Sampling.Initial < 0 {
		v.add("logging.sampling.initial", "%w: must not be negative, got %d", ErrInvalid, l.Sampling.Initial)
	}
	if l.Sampling.Thereafter < 0 {
		v.add("logging.sampling.thereafter", "%w: must not be negative, got %d", ErrInvalid, l.Sampling.Thereafter)
	}
}

func (c *Config) validateTracing(v *validator) {
	t := &c.Tracing
	if r := t.SamplingRate; !(r >= 0 && r <= 1) {
		v.add("tracing.sampling_rate", "%w %v: must be between 0 and 1", ErrInvalid, r)
	}
	switch {
	case t.Endpoint != "" && t.Exporter == "zipkin":
		// Zipkin takes spans as JSON over HTTP: a URL, no bare host:port.
		const example = "e.g. http://zipkin:9411/api/v2/spans"
		if !strings.Contains(t.Endpoint, "://") {
			v.add("tracing.endpoint", "%w %q: tracing.exporter zipkin posts spans over HTTP and needs a URL, %s", ErrInvalid, t.Endpoint, example)
		} else if err := checkURLOrHostPort(t.Endpoint, "http", "https"); err != nil {
			v.add("tracing.endpoint", "%w %q: %w (tracing.exporter zipkin needs an http or https URL, %s)", ErrInvalid, t.Endpoint, err, example)
		}
	case t.Endpoint != "":
		if err := checkURLOrHostPort(t.Endpoint, "http", "https"); err != nil {
			v.add("tracing.endpoint", "%w %q: %w", ErrInvalid, t.Endpoint, err)
		}
	case t.Enabled:
		v.add("tracing.endpoint", "%w: required when tracing.enabled is true", ErrInvalid)
	}
}

func (c *Config) validateMesh(v *validator) {
	seen := make(map[string]int)
	for i, r := range c.Routing.Rules {
		p := "routing.rules[" + strconv.Itoa(i) + "]"
		switch prefix := r.Match.Prefix; {
		case !strings.HasPrefix(prefix, "/"):
			v.add(p+".match.prefix", "%w %q: must start with \"/\"", ErrInvalid, prefix)
		default:
			if j, dup := seen[prefix]; dup {
				v.add(p+".match.prefix", "%w %q: same prefix as routing.rules[%d]", ErrInvalid, prefix, j)
			} else {
				seen[prefix] = i
			}
		}
		if r.Route.Cluster == "" {
			v.add(p+".route.cluster", "%w: required", ErrInvalid)
		} else if err := checkName(r.Route.Cluster); err != nil {
			v.add(p+".route.cluster", "%w %q: %w", ErrInvalid, r.Route.Cluster, err)
		} else if _, ok := c.Backends[r.Route.Cluster]; !ok && !v.setting {
			names := slices.Sorted(maps.Keys(c.Backends))
			v.add(p+".route.cluster", "%w %q: not a backend (backends: %s)", ErrInvalid, r.Route.Cluster, strings.Join(names, ", "))
		}
		if ds := r.Route.DescriptorSet; ds != "" && !v.setting {
			if !filepath.IsAbs(ds) {
				v.add(p+".route.descriptor_set", "%w %q: an absolute path of a FileDescriptorSet file", ErrInvalid, ds)
			} else if _, err := os.Stat(ds); err != nil {
				v.add(p+".route.descriptor_set", "%w: %v", ErrInvalid, err)
			}
		}
	}

	hc := &c.LoadBalancing.HealthCheck
	const hp = "load_balancing.health_check"
	if !hc.Enabled {
		v.nonNegative(hp+".interval", hc.Interval)
		v.nonNegative(hp+".timeout", hc.Timeout)
	} else {
		if hc.Interval <= 0 {
			v.add(hp+".interval", "%w: must be positive when health checks are enabled", ErrInvalid)
		}
		if hc.Timeout <= 0 {
			v.add(hp+".timeout", "%w: must be positive when health checks are enabled", ErrInvalid)
		} else if hc.Interval > 0 && hc.Timeout > hc.Interval {
			v.add(hp+".timeout", "%w %s: must not exceed load_balancing.health_check.interval (%s)", ErrInvalid, hc.Timeout, hc.Interval)
		}
		if hc.HealthyThreshold < 1 {
			v.add(hp+".healthy_threshold", "%w: must be at least 1, got %d", ErrInvalid, hc.HealthyThreshold)
		}
		if hc.UnhealthyThreshold < 1 {
			v.add(hp+".unhealthy_threshold", "%w: must be at least 1, got %d", ErrInvalid, hc.UnhealthyThreshold)
		}
	}

	th := &c.CircuitBreaking.Thresholds
	const cp = "circuit_breaking.thresholds"
	if th.MaxEjectionPercent < 0 || th.MaxEjectionPercent > 100 {
		v.add(cp+".max_ejection_percent", "%w %d: must be between 0 and 100", ErrInvalid, th.MaxEjectionPercent)
	}
	if !c.CircuitBreaking.Enabled {
		v.nonNegative(cp+".interval", th.Interval)
		v.nonNegative(cp+".base_ejection_time", th.BaseEjectionTime)
		if th.Consecutive5xx < 0 {
			v.add(cp+".consecutive_5xx", "%w: must not be negative, got %d", ErrInvalid, th.Consecutive5xx)
		}
	} else {
		if th.Consecutive5xx < 1 {
			v.add(cp+".consecutive_5xx", "%w: must be at least 1 when circuit breaking is enabled", ErrInvalid)
		}
		if th.Interval <= 0 {
			v.add(cp+".interval", "%w: must be positive when circuit breaking is enabled", ErrInvalid)
		}
		if th.BaseEjectionTime <= 0 {
			v.add(cp+".base_ejection_time", "%w: must be positive when circuit breaking is enabled", ErrInvalid)
		}
	}
}

// claimPath is a token claim name or a dotted path of names.
var claimPath = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_:-]*(\.[A-Za-z_][A-Za-z0-9_:-]*)*$`)

// minRaftTimeout is hashicorp/raft's lower bound for its timeouts and snapshot interval.
const minRaftTimeout = 5 * time.Millisecond

func (c *Config) validateCluster(v *validator) {
	cl := &c.Cluster
	if err := checkName(cl.Name); err != nil {
		v.add("cluster.name", "%w %q: %w", ErrInvalid, cl.Name, err)
	}
	if a := cl.AdvertiseAddr; a != "" {
		if ip, err := netip.ParseAddr(a); err != nil || ip.IsUnspecified() || ip.Zone() != "" {
			v.add("cluster.advertise_addr", "%w %q: must be an IP address without a port, not 0.0.0.0 or ::", ErrInvalid, a)
		}
	}

	v.listenAddr("cluster.gossip.bind_addr", cl.Gossip.BindAddr, true)
	v.advertiseAddr("cluster.gossip.advertise_addr", cl.Gossip.AdvertiseAddr)
	if f := cl.Gossip.EncryptKeyFile; f != "" {
		if fi, err := os.Stat(f); err != nil {
			v.add("cluster.gossip.encrypt_key_file", "%w: %w", ErrInvalid, err)
		} else if !fi.Mode().IsRegular() {
			v.add("cluster.gossip.encrypt_key_file", "%w %q: not a regular file", ErrInvalid, f)
		}
	}

	r := &cl.Raft
	v.listenAddr("cluster.raft.addr", r.Addr, true)
	v.advertiseAddr("cluster.raft.advertise_addr", r.AdvertiseAddr)
	if r.Voters < 1 || r.Voters > 7 || r.Voters%2 == 0 {
		v.add("cluster.raft.voters", "%w %d: must be odd, from 1 to 7 (usually 3 or 5)", ErrInvalid, r.Voters)
	}
	if r.MaxNonVoters < 0 {
		v.add("cluster.raft.max_non_voters", "%w: must not be negative (0 means no cap), got %d", ErrInvalid, r.MaxNonVoters)
	}
	if r.BootstrapExpect < 0 {
		v.add("cluster.raft.bootstrap_expect", "%w: must not be negative, got %d", ErrInvalid, r.BootstrapExpect)
	}
	if r.Bootstrap && r.BootstrapExpect > 0 {
		v.add("cluster.raft.bootstrap", "%w: cannot be combined with cluster.raft.bootstrap_expect (%d); use one or the other", ErrInvalid, r.BootstrapExpect)
	}
	v.nonNegative("cluster.raft.dead_server_cleanup", r.DeadServerCleanup)
	for _, t := range []struct {
		path string
		d    Duration
	}{
		{"cluster.raft.heartbeat_timeout", r.HeartbeatTimeout},
		{"cluster.raft.election_timeout", r.ElectionTimeout},
		{"cluster.raft.leader_lease_timeout", r.LeaderLeaseTimeout},
		{"cluster.raft.snapshot_interval", r.SnapshotInterval},
	} {
		if t.d.Std() < minRaftTimeout {
			v.add(t.path, "%w %s: must be at least %s", ErrInvalid, t.d, minRaftTimeout)
		}
	}
	if r.ElectionTimeout < r.HeartbeatTimeout {
		v.add("cluster.raft.election_timeout", "%w %s: must not be less than cluster.raft.heartbeat_timeout (%s)", ErrInvalid, r.ElectionTimeout, r.HeartbeatTimeout)
	}
	if r.LeaderLeaseTimeout > r.HeartbeatTimeout {
		v.add("cluster.raft.leader_lease_timeout", "%w %s: must not exceed cluster.raft.heartbeat_timeout (%s)", ErrInvalid, r.LeaderLeaseTimeout, r.HeartbeatTimeout)
	}
	if r.SnapshotThreshold == 0 {
		v.add("cluster.raft.snapshot_threshold", "%w: must be at least 1", ErrInvalid)
	}
	switch r.LogStore {
	case "", "wal", "boltdb":
	default:
		v.add("cluster.raft.log_store", "%w %q: must be wal or boltdb", ErrInvalid, r.LogStore)
	}
	if r.WALSegmentSizeMB < 1 || r.WALSegmentSizeMB > 1024 {
		v.add("cluster.raft.wal_segment_size_mb", "%w %d: must be between 1 and 1024 (MiB)", ErrInvalid, r.WALSegmentSizeMB)
	}
	if lv := r.LogVerification; lv.Enabled && lv.Interval.Std() < time.Second {
		v.add("cluster.raft.log_verification.interval", "%w %s: must be at least 1s (or set cluster.raft.log_verification.enabled: false)", ErrInvalid, lv.Interval)
	}
	if rc := r.ReplicaCheck; rc.Enabled && rc.Interval.Std() < time.Second {
		v.add("cluster.raft.replica_check.interval", "%w %s: must be at least 1s (or set cluster.raft.replica_check.enabled: false)", ErrInvalid, rc.Interval)
	}

	for _, list := range []struct {
		path  string
		addrs []string
	}{{"cluster.join", cl.Join}, {"cluster.retry_join", cl.RetryJoin}} {
		for i, a := range list.addrs {
			if err := checkHostPort(a, false); err != nil {
				v.add(list.path+"["+strconv.Itoa(i)+"]", "%w %q: %w", ErrInvalid, a, err)
			}
		}
	}
	if cl.RetryInterval <= 0 {
		v.add("cluster.retry_interval", "%w %s: must be positive", ErrInvalid, cl.RetryInterval)
	}
	if cl.RetryMax < 0 {
		v.add("cluster.retry_max", "%w: must not be negative (0 retries forever), got %d", ErrInvalid, cl.RetryMax)
	}
	if cl.ForwardHoldTimeout <= 0 {
		v.add("cluster.forward_hold_timeout", "%w %s: must be positive", ErrInvalid, cl.ForwardHoldTimeout)
	}
}

// listenAddr checks a listen address: host:port with a port from 0 to 65535 (0 picks a free
// port). ipOnly requires an IP host (gossip and Raft bind to an IP); otherwise the host may
// also be a name or empty (all interfaces).
func (v *validator) listenAddr(path, addr string, ipOnly bool) {
	if addr == "" {
		v.add(path, "%w: required", ErrInvalid)
		return
	}
	host, port, err := net.SplitHostPort(addr)
	if err == nil {
		_, err = parsePort(port, true)
	}
	if err == nil && ipOnly {
		if _, perr := netip.ParseAddr(host); perr != nil {
			err = errors.New("the host must be an IP address, such as 0.0.0.0")
		}
	}
	if err == nil && host != "" && !ipOnly {
		err = checkHost(host)
	}
	if err != nil {
		v.add(path, "%w %q: %w", ErrInvalid, addr, err)
	}
}

// advertiseAddr checks an optional advertised IP:port: a routable IP and a real port.
func (v *validator) advertiseAddr(path, addr string) {
	if addr == "" {
		return
	}
	ap, err := netip.ParseAddrPort(addr)
	switch {
	case err != nil:
		v.add(path, "%w %q: must be IP:port: %w", ErrInvalid, addr, err)
	case ap.Addr().IsUnspecified():
		v.add(path, "%w %q: must be an address other nodes can reach, not 0.0.0.0 or ::", ErrInvalid, addr)
	case ap.Port() == 0:
		v.add(path, "%w %q: port must be from 1 to 65535", ErrInvalid, addr)
	}
}

// pair reports a certificate without its key or a key without its certificate.
func (v *validator) pair(path, cert, key string) {
	switch {
	case cert != "" && key == "":
		v.add(path+".key_file", "%w: required when %s.cert_file is set", ErrInvalid, path)
	case cert == "" && key != "":
		v.add(path+".cert_file", "%w: required when %s.key_file is set", ErrInvalid, path)
	}
}

func (v *validator) nonNegative(path string, d Duration) {
	if d < 0 {
		v.add(path, "%w %s: must not be negative", ErrInvalid, d)
	}
}

func parsePort(s string, allowZero bool) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 0 || p > math.MaxUint16 || (p == 0 && !allowZero) {
		if allowZero {
			return 0, fmt.Errorf("port %q must be a number from 0 to 65535", s)
		}
		return 0, fmt.Errorf("port %q must be a number from 1 to 65535", s)
	}
	return p, nil
}

// checkHostPort checks host:port with a non-empty host (name or IP) and a port from 1 to
// 65535 (0 too if allowZero).
func checkHostPort(s string, allowZero bool) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("must be host:port: %w", err)
	}
	if host == "" {
		return errors.New("the host is missing")
	}
	if _, err := parsePort(port, allowZero); err != nil {
		return err
	}
	return checkHost(host)
}

// checkHost accepts an IP address or a DNS name.
func checkHost(host string) error {
	if _, err := netip.ParseAddr(host); err == nil {
		return nil
	}
	if len(host) > 253 {
		return errors.New("host name too long")
	}
	for label := range strings.SplitSeq(strings.TrimSuffix(host, "."), ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("invalid host name %q", host)
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				return fmt.Errorf("invalid host name %q", host)
			}
		}
	}
	return nil
}

// checkURLOrHostPort accepts host:port or a URL with one of schemes and a host.
func checkURLOrHostPort(s string, schemes ...string) error {
	if !strings.Contains(s, "://") {
		return checkHostPort(s, false)
	}
	u, err := url.Parse(s)
	if err != nil {
		return err
	}
	if !slices.Contains(schemes, u.Scheme) {
		return fmt.Errorf("scheme must be one of %s", strings.Join(schemes, ", "))
	}
	return checkURLHost(u)
}

func checkURLHost(u *url.URL) error {
	if u.Host == "" {
		return errors.New("the host is missing")
	}
	if p := u.Port(); p != "" {
		if _, err := parsePort(p, false); err != nil {
			return err
		}
	}
	return checkHost(u.Hostname())
}

// checkBackendEndpoint accepts unix:///abs/path, dns:///host:port, host:port and
// https://host[:port].
func checkBackendEndpoint(ep string) error {
	const want = "must be unix:///abs/path, dns:///host:port, host:port, https://host[:port] or registry:///<service>"
	switch {
	case strings.HasPrefix(ep, "registry:///"):
		if svc := strings.TrimPrefix(ep, "registry:///"); svc == "" || strings.ContainsAny(svc, "/:") {
			return errors.New("registry:///<service> names a service of the registry")
		}
		return nil
	case strings.HasPrefix(ep, "unix://"):
		p := strings.TrimPrefix(ep, "unix://")
		if !strings.HasPrefix(p, "/") || p != filepath.Clean(p) || p == "/" {
			return errors.New("a unix socket must be unix:///abs/path (an absolute, clean path)")
		}
		return nil
	case strings.HasPrefix(ep, "dns:///"):
		if err := checkHostPort(strings.TrimPrefix(ep, "dns:///"), false); err != nil {
			return fmt.Errorf("dns:///host:port: %w", err)
		}
		return nil
	case strings.HasPrefix(ep, "https://"):
		u, err := url.Parse(ep)
		if err != nil {
			return err
		}
		return checkURLHost(u)
	case strings.Contains(ep, "://") || strings.HasPrefix(ep, "unix:") || strings.HasPrefix(ep, "dns:") || strings.HasPrefix(ep, "registry:"):
		return errors.New(want)
	default:
		if err := checkHostPort(ep, false); err != nil {
			return fmt.Errorf("%s: %w", want, err)
		}
		return nil
	}
}

// checkName accepts backend cluster names: letters, digits, '-' and '_', starting with a
// letter or digit, at most 63 bytes.
func checkName(s string) error {
	if s == "" || len(s) > 63 || !isIdent(s) || s[0] == '-' || s[0] == '_' {
		return errors.New("must be 1-63 letters, digits, '-' or '_', starting with a letter or digit")
	}
	return nil
}

func isLoopbackHost(h string) bool {
	if h == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(h)
	return err == nil && ip.IsLoopback()
}

// addrsOverlap reports whether two listen addresses would claim the same port: equal non-zero
// ports and equal hosts, or either host is a wildcard.
func addrsOverlap(a, b string) bool {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil || pa != pb || pa == "0" {
		return false
	}
	return ha == hb || isWildcard(ha) || isWildcard(hb)
}

func isWildcard(h string) bool {
	if h == "" {
		return true
	}
	ip, err := netip.ParseAddr(h)
	return err == nil && ip.IsUnspecified()
}

func (c *Config) validateRevocation(v *validator) {
	// The mode and policy are enumerations (checked with the others); an
	// empty value or a zero refresh is the default.
	if r := c.TLS.Revocation.Refresh; r != 0 && r.Std() < time.Second {
		v.add("tls.revocation.refresh", "%w %s: at least 1s", ErrInvalid, r)
	}
}
