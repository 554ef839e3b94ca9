package mesh

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cluster"
)

// Load-balancing policies (load_balancing.policy).
const (
	RoundRobin       = "round_robin"
	LeastConnections = "least_connections"
	Random           = "random"
)

// dnsRefresh is how often dns:/// endpoints are resolved again.
const dnsRefresh = 30 * time.Second

// panicThreshold: below this share of available endpoints (percent),
// picks ignore health and ejection (Envoy's default panic threshold).
const panicThreshold = 50

// drainLimit bounds how long an endpoint gone from the endpoint list
// keeps serving the calls it has in flight before its connection closes.
const drainLimit = 10 * time.Minute

// BackendConfig configures a backend cluster.
type BackendConfig struct {
	// Name is the cluster's name (backends.<name>).
	Name string
	// NodeScoped: the cluster is this node's own daemon (backends.<name>.scope
	// node): the objects it holds live on this node, and the proxy routes
	// calls naming objects of other nodes to those nodes' agents
	// (SetPlacement).
	NodeScoped bool
	// Endpoint is unix:///abs/path, dns:///host:port, host:port,
	// https://host[:port] or registry:///<service> (the instances of a
	// service in the replicated registry, through Registry).
	Endpoint string
	// Registry feeds a registry:/// cluster: it calls update with the
	// service's addresses ("host:port") now and on every change, until ctx
	// ends.
	Registry func(ctx context.Context, service string, update func(addrs []string))
	// Policy is RoundRobin (default), LeastConnections or Random.
	Policy string
	// Timeout bounds each attempt (0: only the caller's deadline).
	Timeout time.Duration
	// DialOptions are added to every endpoint's connection (tracing).
	DialOptions []grpc.DialOption
	// TLS returns the client TLS configuration that verifies the server
	// at addr (an endpoint address) as serverName; nil: plaintext (an
	// https:// endpoint requires it).
	TLS func(serverName, addr string) *tls.Config
	// Track, with TLS, is given every connection dialled and the server's
	// certificate (identity.Source.TrackDialed: closed once that
	// certificate is revoked); nil: not tracked.
	Track cluster.Tracker
	// ServerName is the name the server's certificate must carry; empty:
	// the endpoint's host name (dns:///, https://, host:port), else its
	// address (localhost for a unix socket).
	ServerName string
	// MaxMessageBytes bounds messages both ways.
	MaxMessageBytes int
	HealthCheck     HealthCheck
	Outlier         Outlier
	Retry           Retry
	// OnEject, when set, is told of every ejection (metrics).
	OnEject func(addr string)
	// Now is the clock of ejections; nil: time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

// Retry is a cluster's retry policy (backends.<name>.retry): idempotent
// calls (the get and list verbs) that fail with Unavailable, or whose
// attempt timed out, before anything was sent to the client, are tried
// again on another endpoint while attempts, the retry budget and the
// caller's deadline allow.
type Retry struct {
	// MaxAttempts is the number of attempts, the first included (<= 1:
	// no retries).
	MaxAttempts int
	// Backoff is the base of the exponential backoff between attempts
	// (full jitter, at most ten times the base).
	Backoff time.Duration
	// BudgetPercent of the calls in flight may be retries at once, and at
	// least MinRetryConcurrency (Envoy's retry budget; defaults 20 and 3).
	BudgetPercent       int
	MinRetryConcurrency int
}

// target is a parsed endpoint specification.
type target struct {
	unixPath string // a unix socket, or
	host     string // a host (IP or name) and port, or
	port     string
	registry string // a service of the registry
	tls      bool   // https://
}

// parseEndpoint parses a backend endpoint specification.
func parseEndpoint(spec string) (target, error) {
	switch {
	case strings.HasPrefix(spec, "unix://"):
		p := strings.TrimPrefix(spec, "unix://")
		if !strings.HasPrefix(p, "/") {
			return target{}, fmt.Errorf("endpoint %q: unix:///abs/path takes an absolute path", spec)
		}
		return target{unixPath: p}, nil
	case strings.HasPrefix(spec, "registry:///"):
		svc := strings.TrimPrefix(spec, "registry:///")
		if svc == "" || strings.ContainsAny(svc, "/:") {
			return target{}, fmt.Errorf("endpoint %q: want registry:///<service>", spec)
		}
		return target{registry: svc}, nil
	case strings.HasPrefix(spec, "dns:///"):
		host, port, err := net.SplitHostPort(strings.TrimPrefix(spec, "dns:///"))
		if err != nil || host == "" || port == "" {
			return target{}, fmt.Errorf("endpoint %q: want dns:///host:port", spec)
		}
		return target{host: host, port: port}, nil
	case strings.HasPrefix(spec, "https://"):
		u, err := url.Parse(spec)
		if err != nil || u.Host == "" || (u.Path != "" && u.Path != "/") {
			return target{}, fmt.Errorf("endpoint %q: want https://host[:port]", spec)
		}
		port := u.Port()
		if port == "" {
			port = "443"
		}
		return target{host: u.Hostname(), port: port, tls: true}, nil
	case strings.Contains(spec, "://"):
		return target{}, fmt.Errorf("endpoint %q: want unix:///abs/path, dns:///host:port, host:port, https://host[:port] or registry:///<service>", spec)
	}
	host, port, err := net.SplitHostPort(spec)
	if err != nil || host == "" || port == "" {
		return target{}, fmt.Errorf("endpoint %q: want host:port", spec)
	}
	return target{host: host, port: port}, nil
}

// Endpoint is one address of a backend cluster and its connection.
type Endpoint struct {
	// Addr is "unix:///path" or "ip:port".
	Addr string
	conn *grpc.ClientConn
	// active counts the calls in flight (least_connections).
	active atomic.Int64
	state  endpointState
	// out mirrors state: unhealthy or ejected (read by picks without the
	// lock).
	out atomic.Bool
	// accepts is the grpc-accept-encoding the endpoint last answered
	// with: the compressions it takes (nil until it answered).
	accepts atomic.Pointer[string]
}

// acceptsCompression reports whether the endpoint said it takes a
// compression: a call is compressed as its caller's was only then.
func (e *Endpoint) acceptsCompression(name string) bool {
	a := e.accepts.Load()
	if a == nil {
		return false
	}
	for v := range strings.SplitSeq(*a, ",") {
		if strings.TrimSpace(v) == name {
			return true
		}
	}
	return false
}

// Active is the number of calls in flight to the endpoint.
func (e *Endpoint) Active() int64 { return e.active.Load() }

// Backend is a backend cluster: its endpoints, how calls are spread over
// them, and the connections to them.
type Backend struct {
	cfg    BackendConfig
	target target
	logger *slog.Logger

	mu        sync.RWMutex
	endpoints []*Endpoint
	closed    bool
	rr        atomic.Uint64
	// ejectMu serialises ejections, so that two cannot both pass the
	// max_ejection_percent check.
	ejectMu sync.Mutex
	// inflight counts the cluster's calls, retries its retries in flight
	// (the retry budget).
	inflight, retries atomic.Int64

	stop      context.CancelFunc
	closing   chan struct{} // closed by Close
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// NewBackend parses cfg and connects to the endpoints it names (lazily:
// grpc-go dials on first use). A dns:/// or host-name endpoint is resolved
// now and every 30 s.
func NewBackend(cfg BackendConfig) (*Backend, error) {
	t, err := parseEndpoint(cfg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("backends.%s: %w", cfg.Name, err)
	}
	switch cfg.Policy {
	case "":
		cfg.Policy = RoundRobin
	case RoundRobin, LeastConnections, Random:
	default:
		return nil, fmt.Errorf("backends.%s: load-balancing policy %q: want %s, %s or %s", cfg.Name, cfg.Policy, RoundRobin, LeastConnections, Random)
	}
	if t.registry != "" && cfg.Registry == nil {
		return nil, fmt.Errorf("backends.%s: endpoint %q needs the service registry, which is not available here", cfg.Name, cfg.Endpoint)
	}
	if t.tls && cfg.TLS == nil {
		return nil, fmt.Errorf("backends.%s: endpoint %q is https:// but no TLS configuration is given", cfg.Name, cfg.Endpoint)
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = 16 << 20
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Retry.BudgetPercent <= 0 {
		cfg.Retry.BudgetPercent = 20
	}
	if cfg.Retry.MinRetryConcurrency <= 0 {
		cfg.Retry.MinRetryConcurrency = 3
	}
	if o := &cfg.Outlier; o.Enabled {
		if o.Consecutive5xx < 1 || o.Interval <= 0 || o.BaseEjectionTime <= 0 {
			return nil, fmt.Errorf("backends.%s: circuit breaking needs consecutive_5xx >= 1, a positive interval and base_ejection_time", cfg.Name)
		}
		if o.MaxEjectionTime <= 0 {
			o.MaxEjectionTime = max(300*time.Second, o.BaseEjectionTime)
		}
	}
	if h := cfg.HealthCheck; h.Enabled && (h.Interval <= 0 || h.Timeout <= 0 || h.HealthyThreshold < 1 || h.UnhealthyThreshold < 1) {
		return nil, fmt.Errorf("backends.%s: health checks need a positive interval and timeout and thresholds of at least 1", cfg.Name)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	b := &Backend{cfg: cfg, target: t, logger: logger.With("backend", cfg.Name), closing: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	b.stop = cancel
	var addrs []string
	switch {
	case t.unixPath != "":
		addrs = []string{"unix://" + t.unixPath}
	default:
		if ip, err := netip.ParseAddr(t.host); err == nil {
			addrs = []string{net.JoinHostPort(ip.String(), t.port)}
		}
	}
	switch {
	case t.registry != "":
		b.wg.Go(func() {
			cfg.Registry(ctx, t.registry, func(addrs []string) {
				addrs = slices.Clone(addrs)
				slices.Sort(addrs)
				if err := b.setAddrs(slices.Compact(addrs)); err != nil && ctx.Err() == nil {
					b.logger.Error("backend endpoints from the registry not applied", "service", t.registry, "error", err)
				}
			})
		})
	case addrs != nil:
		if err := b.setAddrs(addrs); err != nil {
			cancel()
			return nil, err
		}
	default:
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		err = b.resolve(rctx)
		rcancel()
		if err != nil {
			// Not fatal: the name may resolve later; calls fail until then.
			b.logger.Warn("backend endpoint does not resolve yet", "endpoint", cfg.Endpoint, "error", err)
		}
		b.wg.Go(func() { b.refreshLoop(ctx) })
	}
	if cfg.HealthCheck.Enabled {
		b.wg.Go(func() { b.healthLoop(ctx) })
	}
	if cfg.Outlier.Enabled {
		b.wg.Go(func() { b.outlierLoop(ctx) })
	}
	return b, nil
}

func (b *Backend) now() time.Time { return b.cfg.Now() }

// Name is the cluster's name.
func (b *Backend) Name() string { return b.cfg.Name }

// NodeScoped reports whether the cluster is this node's own daemon.
func (b *Backend) NodeScoped() bool { return b.cfg.NodeScoped }

// serverName is the name an endpoint's certificate must carry.
func (b *Backend) serverName(addr string) string {
	switch {
	case b.cfg.ServerName != "":
		return b.cfg.ServerName
	case b.target.unixPath != "":
		return "localhost"
	case b.target.host != "":
		return b.target.host
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return host
}

func (b *Backend) refreshLoop(ctx context.Context) {
	t := time.NewTicker(dnsRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := b.resolve(rctx); err != nil && ctx.Err() == nil {
			b.logger.Warn("backend endpoint resolution failed; keeping the known addresses", "endpoint", b.cfg.Endpoint, "error", err)
		}
		cancel()
	}
}

// resolve looks the host name up and replaces the endpoints with its
// addresses.
func (b *Backend) resolve(ctx context.Context) error {
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", b.target.host)
	if err != nil {
		return err
	}
	addrs := make([]string, 0, len(ips))
	for _, ip := range ips {
		addrs = append(addrs, net.JoinHostPort(ip.Unmap().String(), b.target.port))
	}
	slices.Sort(addrs)
	return b.setAddrs(slices.Compact(addrs))
}

// setAddrs makes the endpoint list addrs: endpoints that stay keep their
// connection and counters, new ones get a connection, gone ones are
// closed.
func (b *Backend) setAddrs(addrs []string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("backend closed")
	}
	var next, gone []*Endpoint
	for _, e := range b.endpoints {
		if slices.Contains(addrs, e.Addr) {
			next = append(next, e)
		} else {
			gone = append(gone, e)
		}
	}
	var dialed []*Endpoint
	for _, a := range addrs {
		if slices.ContainsFunc(next, func(e *Endpoint) bool { return e.Addr == a }) {
			continue
		}
		conn, err := b.dial(a)
		if err != nil {
			for _, e := range dialed {
				_ = e.conn.Close()
			}
			return err
		}
		ep := &Endpoint{Addr: a, conn: conn}
		ep.state.healthy = true // until checks say otherwise
		dialed = append(dialed, ep)
	}
	next = append(next, dialed...)
	slices.SortFunc(next, func(x, y *Endpoint) int { return strings.Compare(x.Addr, y.Addr) })
	b.endpoints = next
	for _, e := range gone {
		// Calls in flight (a watch, an upload) finish first.
		b.wg.Go(func() { b.drain(e) })
	}
	if len(gone) > 0 || len(next) != len(addrs) {
		b.logger.Info("backend endpoints changed", "endpoints", addrs)
	}
	return nil
}

// drain closes the connection of an endpoint no longer listed once its
// calls ended, or after drainLimit, or when the backend closes.
func (b *Backend) drain(e *Endpoint) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	limit := time.Now().Add(drainLimit)
	// One tick first: a call that picked the endpoint just before it left
	// the list has not counted itself in active yet.
	for first := true; first || e.active.Load() > 0 && time.Now().Before(limit); first = false {
		select {
		case <-b.closing:
			_ = e.conn.Close()
			return
		case <-t.C:
		}
	}
	_ = e.conn.Close()
}

func (b *Backend) dial(addr string) (*grpc.ClientConn, error) {
	target := "passthrough:///" + addr
	if strings.HasPrefix(addr, "unix://") {
		target = addr
	}
	name := b.serverName(addr)
	creds := insecure.NewCredentials()
	if b.cfg.TLS != nil {
		creds = cluster.TrackedCredentials(credentials.NewTLS(b.cfg.TLS(name, addr)), b.cfg.Track)
	}
	conn, err := grpc.NewClient(target, append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithAuthority(name),
		grpc.WithInitialWindowSize(1 << 20),
		grpc.WithInitialConnWindowSize(4 << 20),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(b.cfg.MaxMessageBytes),
			grpc.MaxCallSendMsgSize(b.cfg.MaxMessageBytes),
			grpc.ForceCodecV2(Codec()),
		),
	}, b.cfg.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("backends.%s: %s: %w", b.cfg.Name, addr, err)
	}
	return conn, nil
}

// Endpoints returns the current endpoints.
func (b *Backend) Endpoints() []*Endpoint {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return slices.Clone(b.endpoints)
}

// pick chooses an endpoint for a call by the cluster's policy among the
// available ones (healthy, not ejected), preferring those not in avoid
// (tried already). With none available the call fails fast, naming why.
func (b *Backend) pick(avoid []*Endpoint) (*Endpoint, error) {
	b.mu.RLock()
	eps := b.endpoints
	b.mu.RUnlock()
	if len(eps) == 0 {
		return nil, fmt.Errorf("backend %s has no endpoints (%s)", b.cfg.Name, b.cfg.Endpoint)
	}
	cands := eps
	if slices.ContainsFunc(eps, func(e *Endpoint) bool { return !e.available() }) || len(avoid) > 0 {
		cands = make([]*Endpoint, 0, len(eps))
		for _, e := range eps {
			if e.available() {
				cands = append(cands, e)
			}
		}
		// Envoy's panic threshold: with fewer than half the endpoints
		// available, spread over all of them rather than overload the
		// few left (or fail every call when none is).
		if len(cands)*100 < panicThreshold*len(eps) {
			cands = slices.Clone(eps)
		}
		if fresh := slices.DeleteFunc(slices.Clone(cands), func(e *Endpoint) bool { return slices.Contains(avoid, e) }); len(fresh) > 0 {
			cands = fresh
		}
	}
	switch b.cfg.Policy {
	case Random:
		return cands[rand.IntN(len(cands))], nil
	case LeastConnections:
		// The fewest calls in flight; ties go round robin.
		start := int(b.rr.Add(1))
		var best *Endpoint
		for i := range cands {
			e := cands[(start+i)%len(cands)]
			if best == nil || e.active.Load() < best.active.Load() {
				best = e
			}
		}
		return best, nil
	default:
		return cands[int(b.rr.Add(1)-1)%len(cands)], nil
	}
}

// Inflight is the number of calls in flight to the cluster.
func (b *Backend) Inflight() int64 { return b.inflight.Load() }

// Healthy reports whether the cluster has an available endpoint.
func (b *Backend) Healthy() bool {
	for _, e := range b.Endpoints() {
		if e.available() {
			return true
		}
	}
	return false
}

// retryPossible reports whether the retry budget has room now (a later
// retryAllowed may still refuse).
func (b *Backend) retryPossible() bool {
	return b.retries.Load() < b.retryLimit()
}

func (b *Backend) retryLimit() int64 {
	return max(int64(b.cfg.Retry.MinRetryConcurrency), b.inflight.Load()*int64(b.cfg.Retry.BudgetPercent)/100)
}

// retryAllowed reports whether the retry budget allows one more retry in
// flight; release must be called when it ends.
func (b *Backend) retryAllowed() (release func(), ok bool) {
	if b.retries.Add(1) > b.retryLimit() {
		b.retries.Add(-1)
		return nil, false
	}
	return func() { b.retries.Add(-1) }, true
}

// Close closes every connection.
func (b *Backend) Close() error {
	b.stop()
	b.closeOnce.Do(func() { close(b.closing) })
	b.wg.Wait()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	var errs []error
	for _, e := range b.endpoints {
		errs = append(errs, e.conn.Close())
	}
	b.endpoints = nil
	return errors.Join(errs...)
}

// String describes the backend for logs.
func (b *Backend) String() string {
	return b.cfg.Name + " (" + b.cfg.Endpoint + ", " + strconv.Itoa(len(b.Endpoints())) + " endpoints)"
}

// Conn is the connection to an available endpoint, for a long-lived call
// of the agent's own (the placement catalog's watch); messages go with the
// proto codec. It fails when no endpoint is available.
func (b *Backend) Conn() (grpc.ClientConnInterface, error) {
	ep, err := b.pick(nil)
	if err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	return ep.conn, nil
}

// Invoke makes one unary call to an endpoint of the cluster on behalf of
// the caller of ctx (its metadata and principal go along as for a
// forwarded call), bounded by the cluster's timeout. The gateway uses it
// to read the object a conditional RBAC rule is checked against.
func (b *Backend) Invoke(ctx context.Context, method string, req, resp any) error {
	ep, err := b.pick(nil)
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	ep.active.Add(1)
	defer ep.active.Add(-1)
	if b.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, b.cfg.Timeout)
		defer cancel()
	}
	err = ep.conn.Invoke(outgoingContext(ctx), method, req, resp)
	b.report(ep, status.Code(err), false)
	return err
}
