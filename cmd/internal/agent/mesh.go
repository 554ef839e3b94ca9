package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// apiServices are the backend APIs the gateway knows the schema of: Connect
// and gRPC-Web clients reach them through the transcoder (gRPC clients
// reach any routed service).
var apiServices = []protoreflect.ServiceDescriptor{
	vmv1.File_pivirt_vm_v1_vm_proto.Services().ByName("VMService"),
	storagev1.File_pivirt_storage_v1_storage_proto.Services().ByName("StorageService"),
	networkv1.File_pivirt_network_v1_network_proto.Services().ByName("NetworkService"),
}

// startMesh builds the backend clusters of the configuration and the
// proxy that routes to them.
func (a *Agent) startMesh() error {
	a.meshStats = mesh.NewStats(a.metrics)
	a.proxy = mesh.NewProxy(a.logger, a.meshStats)
	a.peerProxy = mesh.NewProxy(a.logger, a.meshStats)
	a.peerProxy.SetLocal(a.cfg.NodeName)
	a.proxy.SetPlacement(placement{a})
	backends, routes, err := a.buildBackends(a.cfg)
	if err != nil {
		return err
	}
	a.backendsMu.Lock()
	a.backends = backends
	a.backendsMu.Unlock()
	a.setRoutes(routes)
	mesh.RegisterEndpoints(a.metrics, a.currentBackends)
	a.logRoutes(a.cfg)
	return nil
}

// setRoutes puts routes in use on the API port's proxy and on the
// internal port's (the calls other agents route to this node).
func (a *Agent) setRoutes(routes []mesh.Route) {
	a.proxy.SetRoutes(routes)
	a.peerProxy.SetRoutes(routes)
}

// logRoutes says at start (and after a reload) which APIs are routed
// where, and which APIs no backend serves.
func (a *Agent) logRoutes(cfg *config.Config) {
	rules, unrouted := cfg.EffectiveRoutes()
	for _, r := range rules {
		a.logger.Info("routing", "prefix", r.Match.Prefix, "backend", r.Route.Cluster, "descriptor_set", r.Route.DescriptorSet,
			"scope", cfg.Backends[r.Route.Cluster].EffectiveScope(), "default", len(cfg.Routing.Rules) == 0)
	}
	for _, u := range unrouted {
		a.logger.Warn("API not served: its calls answer Unimplemented", "service", u)
	}
}

// currentBackends are the backend clusters in use.
func (a *Agent) currentBackends() []*mesh.Backend {
	a.backendsMu.RLock()
	defer a.backendsMu.RUnlock()
	return a.backends
}

// buildBackends makes the backend clusters of cfg and the routes to them;
// on error nothing is left running.
func (a *Agent) buildBackends(cfg *config.Config) (backends []*mesh.Backend, routes []mesh.Route, err error) {
	defer func() {
		if err != nil {
			for _, b := range backends {
				_ = b.Close()
			}
		}
	}()
	byName := make(map[string]*mesh.Backend, len(cfg.Backends))
	hc, cb := cfg.LoadBalancing.HealthCheck, cfg.CircuitBreaking
	stats := a.meshStats
	for _, name := range slices.Sorted(maps.Keys(cfg.Backends)) {
		bc := cfg.Backends[name]
		tlsFor, track, err := a.backendTLS(name, bc.Endpoint, bc.TLS)
		if err != nil {
			return backends, nil, err
		}
		b, err := mesh.NewBackend(mesh.BackendConfig{
			Name:            name,
			Endpoint:        bc.Endpoint,
			NodeScoped:      bc.EffectiveScope() == config.ScopeNode,
			Registry:        a.registryEndpoints,
			Policy:          cfg.LoadBalancing.Policy,
			Timeout:         bc.Timeout.Std(),
			TLS:             tlsFor,
			Track:           track,
			ServerName:      bc.TLS.ServerName,
			MaxMessageBytes: cluster.MaxMessageBytes,
			HealthCheck: mesh.HealthCheck{
				Enabled: hc.Enabled, Interval: hc.Interval.Std(), Timeout: hc.Timeout.Std(),
				HealthyThreshold: hc.HealthyThreshold, UnhealthyThreshold: hc.UnhealthyThreshold,
			},
			Outlier: mesh.Outlier{
				Enabled: cb.Enabled, Consecutive5xx: cb.Thresholds.Consecutive5xx, Interval: cb.Thresholds.Interval.Std(),
				BaseEjectionTime: cb.Thresholds.BaseEjectionTime.Std(), MaxEjectionPercent: cb.Thresholds.MaxEjectionPercent,
			},
			Retry:       mesh.Retry{MaxAttempts: bc.Retry.MaxAttempts, Backoff: bc.Retry.Backoff.Std()},
			DialOptions: a.backendDialOptions(),
			OnEject:     func(string) { stats.Ejected(name) },
			Logger:      a.logger,
		})
		if err != nil {
			return backends, nil, err
		}
		backends = append(backends, b)
		byName[name] = b
	}
	rules, _ := cfg.EffectiveRoutes()
	routes = make([]mesh.Route, 0, len(rules))
	for i, r := range rules {
		b, ok := byName[r.Route.Cluster]
		if !ok {
			return backends, nil, fmt.Errorf("routing.rules[%d].route.cluster: %q is not a backend", i, r.Route.Cluster)
		}
		route, err := a.newRoute(i, r, b)
		if err != nil {
			return backends, nil, err
		}
		routes = append(routes, route)
	}
	return backends, routes, nil
}

// newRoute is the proxy's route of routing rule i to b: with the schema
// of the rule's descriptor set, else one asked of the backend's server
// reflection when a call needs it.
func (a *Agent) newRoute(i int, r config.RouteRule, b *mesh.Backend) (mesh.Route, error) {
	route := mesh.Route{Prefix: r.Match.Prefix, Backend: b}
	if r.Route.DescriptorSet != "" {
		var err error
		if route.Schema, err = routeSchema(i, r); err != nil {
			return mesh.Route{}, err
		}
	} else {
		// Services not linked into the agent: their schema is asked
		// of the backend's server reflection when a call needs it.
		route.Reflector = mesh.NewReflector(b, r.Match.Prefix, a.logger)
	}
	return route, nil
}

// replaceBackends puts new backend clusters in use (a reload): new calls
// go to them at once; the old ones are closed once their calls in flight
// ended (at most drainTimeout).
func (a *Agent) replaceBackends(backends []*mesh.Backend, routes []mesh.Route) {
	a.backendsMu.Lock()
	old := a.backends
	a.backends = backends
	a.backendsMu.Unlock()
	a.setRoutes(routes)
	a.wg.Go(func() {
		deadline := time.Now().Add(drainTimeout)
		for _, b := range old {
			for b.Inflight() > 0 && time.Now().Before(deadline) && a.ctx.Err() == nil {
				sleepCtx(a.ctx, 50*time.Millisecond)
			}
			_ = b.Close()
		}
	})
}

// drainTimeout bounds how long replaced backend clusters keep serving
// the calls they have.
const drainTimeout = 30 * time.Second

// registryEndpoints feeds a registry:///<service> backend with the
// addresses of the service's instances in the replicated state (those not
// critical), now and after every change, until ctx ends.
func (a *Agent) registryEndpoints(ctx context.Context, service string, update func([]string)) {
	var last []string
	for ctx.Err() == nil {
		ws := memdb.NewWatchSet()
		_, insts, err := a.fsm.State().Services(service, ws)
		if err != nil {
			a.logger.Error("registry endpoints: reading the services table failed; retrying", "service", service, "error", err)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		addrs := make([]string, 0, len(insts))
		for _, in := range insts {
			if in.GetHealth() != clusterv1.Health_HEALTH_CRITICAL && in.GetAddress() != "" && in.GetPort() != 0 {
				addrs = append(addrs, net.JoinHostPort(in.GetAddress(), strconv.Itoa(int(in.GetPort()))))
			}
		}
		slices.Sort(addrs)
		if last == nil || !slices.Equal(addrs, last) {
			update(addrs)
			last = addrs
		}
		_ = ws.WatchCtx(ctx)
	}
}

// backendTLS returns the TLS configuration towards a backend (nil:
// plaintext). Files not given in backends.<name>.tls are the top-level tls
// block's: the agent's own client identity and CA chain. With
// auth.network_policy set, a backend whose certificate no policy lets the
// agent's identity reach on the endpoint's port is refused.
// backendFiles are the certificate, key and CA files of a backend's TLS:
// the backend's own, else the top-level tls block's.
func backendFiles(cfg *config.Config, name string, bt config.BackendTLSConfig) (cert, key, ca string, err error) {
	cert, key, ca = bt.CertFile, bt.KeyFile, bt.CAFile
	if cert == "" {
		cert, key = cfg.TLS.CertFile, cfg.TLS.KeyFile
	}
	if ca == "" {
		ca = cfg.TLS.CAFile
	}
	if ca == "" {
		return "", "", "", fmt.Errorf("backends.%s.tls.ca_file: required (the tls block has no ca_file either)", name)
	}
	return cert, key, ca, nil
}

// backendSource loads the certificate source of a backend's TLS (at start,
// and for pivirt-agent validate through Check).
func backendSource(cfg *config.Config, name string, bt config.BackendTLSConfig, logger *slog.Logger) (*identity.Source, error) {
	cert, key, ca, err := backendFiles(cfg, name, bt)
	if err != nil {
		return nil, err
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: cert, KeyFile: key, CAFile: ca, Logger: logger})
	if err != nil {
		return nil, fmt.Errorf("backends.%s.tls: %w", name, unprefixed{err, "tls: "})
	}
	return src, nil
}

// routeSchema loads the descriptor set of routing rule i, when it names
// one (at start, on a reload, and for pivirt-agent validate through Check).
func routeSchema(i int, r config.RouteRule) (*mesh.Schema, error) {
	if r.Route.DescriptorSet == "" {
		return nil, nil
	}
	s, err := mesh.LoadSchema(r.Route.DescriptorSet, r.Match.Prefix)
	if err != nil {
		return nil, fmt.Errorf("routing.rules[%d].route.descriptor_set: %w", i, err)
	}
	return s, nil
}

func (a *Agent) backendTLS(name, endpoint string, bt config.BackendTLSConfig) (func(serverName, addr string) *tls.Config, cluster.Tracker, error) {
	if !bt.Enabled && strings.HasPrefix(endpoint, "https://") {
		// An https:// backend without its tls block (a public service such
		// as an OS info database): TLS verified against the system's trust
		// store, as curl and grpcurl do, without a client certificate. Its
		// connections carry no mesh identity: network policy does not
		// apply, as to a plaintext backend.
		return func(serverName, _ string) *tls.Config {
			return &tls.Config{ServerName: serverName, MinVersion: tls.VersionTLS12}
		}, nil, nil
	}
	if !bt.Enabled {
		return nil, nil, nil
	}
	cert, key, ca, err := backendFiles(a.cfg, name, bt)
	if err != nil {
		return nil, nil, err
	}
	var src *identity.Source
	if a.tls != nil && cert == a.cfg.TLS.CertFile && key == a.cfg.TLS.KeyFile && ca == a.cfg.TLS.CAFile {
		src = a.tls.client
	} else {
		// One source (and one watcher) per set of files, however often the
		// backends are rebuilt (reloads, network policy changes).
		files := [3]string{cert, key, ca}
		a.backendsMu.Lock()
		src = a.backendSourceByFiles[files]
		if src == nil {
			if src, err = backendSource(a.cfg, name, bt, a.logger); err != nil {
				a.backendsMu.Unlock()
				return nil, nil, err
			}
			if a.backendSourceByFiles == nil {
				a.backendSourceByFiles = map[[3]string]*identity.Source{}
			}
			src.SetRevocation(a.revocation)
			a.backendSourceByFiles[files] = src
			a.backendSources = append(a.backendSources, src)
			a.wg.Go(func() { src.Watch(a.ctx, tlsWatchInterval) })
		}
		a.backendsMu.Unlock()
	}
	return func(serverName, addr string) *tls.Config {
		c := src.ClientConfig(serverName)
		verify := c.VerifyConnection
		c.VerifyConnection = func(cs tls.ConnectionState) error {
			if err := verify(cs); err != nil {
				return err
			}
			var peer *x509.Certificate
			if len(cs.PeerCertificates) > 0 {
				peer = cs.PeerCertificates[0]
			}
			return a.checkNetworkPolicy(src.Leaf(), peer, addr, "backend "+name)
		}
		return c
	}, src.TrackDialed, nil
}

// proxyServerOptions make a gRPC server forward the calls of services it
// does not serve itself through the proxy.
func (a *Agent) proxyServerOptions() []grpc.ServerOption {
	opts := []grpc.ServerOption{
		grpc.UnknownServiceHandler(a.proxy.Handle),
		grpc.ForceServerCodecV2(mesh.Codec()),
		// Static flow-control windows (no BDP probing): less per-call
		// work on a port that forwards.
		grpc.InitialWindowSize(1 << 20),
		grpc.InitialConnWindowSize(4 << 20),
	}
	if a.tls != nil {
		// TLS ends before the protocol mux: the caller's certificate
		// reaches handlers as the peer's AuthInfo.
		opts = append(opts, grpc.Creds(gateway.PeerTLSCredentials{}))
	}
	return opts
}

// addTranscoder serves the backend APIs to Connect and gRPC-Web clients on
// mux, through gs (the API port's gRPC server): those whose schema is
// compiled in through the transcoder, every other routed service through
// the bridge.
func (a *Agent) addTranscoder(mux *http.ServeMux, gs *grpc.Server, wrap func(http.Handler) http.Handler) error {
	t, err := mesh.NewTranscoder(apiServices, gs, gateway.MaxGRPCRequestBytes)
	if err != nil {
		return err
	}
	for _, sd := range apiServices {
		mux.Handle("/"+string(sd.FullName())+"/", wrap(t))
	}
	// Any other service: the bridge, without a schema. Paths that name
	// no method stay 404.
	bridge := wrap(mesh.NewBridge(gs, cluster.MaxMessageBytes, a.proxy))
	mux.Handle("/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !mesh.IsRPCPath(r.URL.Path) {
			http.NotFound(w, r)
			return
		}
		bridge.ServeHTTP(w, r)
	}))
	return nil
}

// closeMesh closes the backend connections.
func (a *Agent) closeMesh() error {
	var errs []error
	for _, b := range a.currentBackends() {
		errs = append(errs, b.Close())
	}
	return errors.Join(errs...)
}

// healthInterval is how often the API port's grpc.health.v1 statuses are
// brought up to date.
const healthInterval = time.Second

// registerAPIExtras serves grpc.health.v1 and server reflection (v1 and
// v1alpha, so grpcurl and grpc-health-probe work) on the API port's gRPC
// server; reflection lists the routed backend APIs too.
func (a *Agent) registerAPIExtras(gs *grpc.Server) {
	a.health = health.NewServer()
	healthpb.RegisterHealthServer(gs, a.health)
	opts := reflection.ServerOptions{
		Services:           apiServiceInfo{a: a, gs: gs},
		DescriptorResolver: schemaResolver{a},
		ExtensionResolver:  protoregistry.GlobalTypes,
	}
	reflectionv1.RegisterServerReflectionServer(gs, reflection.NewServerV1(opts))
	reflectionv1alpha.RegisterServerReflectionServer(gs, reflection.NewServer(opts))
	a.updateHealth()
	a.wg.Go(func() {
		t := time.NewTicker(healthInterval)
		defer t.Stop()
		for {
			select {
			case <-a.ctx.Done():
				a.health.Shutdown()
				return
			case <-t.C:
				a.updateHealth()
			}
		}
	})
}

// updateHealth sets the grpc.health.v1 statuses: "" and the agent's own
// APIs (cluster, snapshots, schedules) are SERVING while this node knows a
// leader (etcd mode: follows etcd); each routed backend API — the
// built-in ones and every service a rule routes whole — is SERVING while
// its backend cluster has an available endpoint.
func (a *Agent) updateHealth() {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if a.etcdMode() {
		if a.etcd.Ready() {
			st = healthpb.HealthCheckResponse_SERVING
		}
	} else if id, _ := a.raft.Leader(); id != "" {
		st = healthpb.HealthCheckResponse_SERVING
	}
	a.health.SetServingStatus("", st)
	for _, name := range []string{clusterv1.ClusterService_ServiceDesc.ServiceName, clusterv1.SnapshotService_ServiceDesc.ServiceName, schedulev1.ScheduleService_ServiceDesc.ServiceName} {
		a.health.SetServingStatus(name, st)
	}
	names := make([]string, 0, len(apiServices))
	for _, sd := range apiServices {
		names = append(names, string(sd.FullName()))
	}
	// Every other service a rule routes whole, too.
	for name := range a.proxy.RoutedServices() {
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	for name := range a.healthRouted {
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	for _, name := range names {
		b := a.proxy.Route("/" + name + "/")
		if b == nil && !a.healthRouted[name] {
			continue // never routed here: unknown to this agent (NotFound)
		}
		if a.healthRouted == nil {
			a.healthRouted = map[string]bool{}
		}
		a.healthRouted[name] = true
		// A route a reload removed: not serving any more.
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if b != nil && b.Healthy() {
			st = healthpb.HealthCheckResponse_SERVING
		}
		a.health.SetServingStatus(name, st)
	}
}

// apiServiceInfo lists the services of the API port for reflection: those
// the gRPC server serves and the routed backend APIs.
type apiServiceInfo struct {
	a  *Agent
	gs *grpc.Server
}

func (p apiServiceInfo) GetServiceInfo() map[string]grpc.ServiceInfo {
	m := p.gs.GetServiceInfo()
	services := slices.Clone(apiServices)
	// The services of the routes' descriptor sets.
	for _, s := range p.a.proxy.Schemas() {
		services = append(services, s.ServiceDescriptors()...)
	}
	for _, sd := range services {
		name := string(sd.FullName())
		if p.a.proxy.Route("/"+name+"/") == nil {
			continue
		}
		info := grpc.ServiceInfo{Metadata: sd.ParentFile().Path()}
		for i := range sd.Methods().Len() {
			md := sd.Methods().Get(i)
			info.Methods = append(info.Methods, grpc.MethodInfo{Name: string(md.Name()), IsClientStream: md.IsStreamingClient(), IsServerStream: md.IsStreamingServer()})
		}
		m[name] = info
	}
	return m
}

// schemaResolver finds descriptors for reflection: those linked into the
// program, then those of the routes' descriptor sets.
type schemaResolver struct{ a *Agent }

func (r schemaResolver) FindFileByPath(path string) (protoreflect.FileDescriptor, error) {
	if f, err := protoregistry.GlobalFiles.FindFileByPath(path); err == nil {
		return f, nil
	}
	for _, s := range r.a.proxy.Schemas() {
		if f, err := s.Files().FindFileByPath(path); err == nil {
			return f, nil
		}
	}
	return nil, protoregistry.NotFound
}

func (r schemaResolver) FindDescriptorByName(name protoreflect.FullName) (protoreflect.Descriptor, error) {
	if d, err := protoregistry.GlobalFiles.FindDescriptorByName(name); err == nil {
		return d, nil
	}
	for _, s := range r.a.proxy.Schemas() {
		if d, err := s.Files().FindDescriptorByName(name); err == nil {
			return d, nil
		}
	}
	return nil, protoregistry.NotFound
}

// devSimSocket is where --dev serves its simulated backend, in the data dir.
const devSimSocket = "pivirtd-sim.sock"

// devBackends gives --dev, when no backends are configured, an in-process
// pivirtd-sim (pivirtd and iscsiman) on a unix socket in the data dir,
// routed to by the default routes: the VM and network APIs to pivirtd,
// volumes to iscsiman.
func (a *Agent) devBackends() error {
	if !a.cfg.Dev || len(a.cfg.Backends) > 0 || len(a.cfg.Routing.Rules) > 0 {
		return nil
	}
	s, err := sim.Open(sim.Config{DataDir: filepath.Join(a.dataDir, "sim"), Host: a.cfg.NodeName, Logger: a.logger.With("component", "pivirtd-sim")})
	if err != nil {
		return fmt.Errorf("dev backends: %w", err)
	}
	addr := "unix://" + filepath.Join(a.dataDir, devSimSocket)
	ln, err := sim.Listen(addr)
	if err != nil {
		s.Close()
		return fmt.Errorf("dev backends: %w", err)
	}
	gs := grpc.NewServer(append(s.ServerOptions(), grpc.MaxRecvMsgSize(cluster.MaxMessageBytes), grpc.MaxSendMsgSize(cluster.MaxMessageBytes))...)
	s.Register(gs)
	a.wg.Go(func() { _ = gs.Serve(ln) })
	a.wg.Go(func() {
		<-a.ctx.Done()
		gs.Stop()
		_ = s.Close()
	})
	cfg := *a.cfg // the caller's configuration stays as it was given
	cfg.Backends = map[string]config.BackendConfig{
		"pivirtd":  {Endpoint: addr, Timeout: config.Duration(30 * time.Second), Retry: config.RetryConfig{MaxAttempts: 3, Backoff: config.Duration(100 * time.Millisecond)}},
		"iscsiman": {Endpoint: addr, Timeout: config.Duration(10 * time.Second)},
	}
	a.cfg = &cfg
	a.logger.Warn("dev mode: the VM, storage and network APIs go to an in-process pivirtd-sim (a simulator, not a hypervisor)", "socket", addr)
	return nil
}

// backendDialOptions are added to the backend connections: with tracing
// on, a span per attempt, whose context goes to the backend.
func (a *Agent) backendDialOptions() []grpc.DialOption {
	// Backends see the agent as the client of the call (grpc-go appends
	// its own "grpc-go/…"), and the caller's user agent in
	// x-forwarded-user-agent (mesh.ForwardedUserAgentHeader).
	opts := []grpc.DialOption{grpc.WithUserAgent("pivirt-agent/" + version.Version)}
	if a.cfg.Tracing.Enabled {
		opts = append(opts, a.tracing.ClientOption())
	}
	return opts
}

// tracingServerOptions instrument a gRPC server of the agent: a span per
// call, continuing the caller's trace.
func (a *Agent) tracingServerOptions() []grpc.ServerOption {
	if !a.cfg.Tracing.Enabled {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(a.tracing.ServerHandler())}
}
