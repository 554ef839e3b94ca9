// Package agent is the composition root of pivirt-agent: it turns a
// config.Config into running parts (fsm, store, cluster, gateway,
// scheduler) and wires them together. It lives under cmd/ because wiring is
// cmd's job; tests and benchmarks under cmd/ start whole agents through it.
package agent

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	sockaddr "github.com/hashicorp/go-sockaddr"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	_ "google.golang.org/grpc/encoding/gzip" // gRPC clients may compress requests, as Connect clients may
	"google.golang.org/grpc/health"
	"google.golang.org/grpc/keepalive"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/caclient"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/leader"
	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/console"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/gateway/observe"
	"pilab.hu/pivirt-agent/gateway/watchfile"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
	"pilab.hu/pivirt-agent/scheduler"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/ui"
)

// Options are knobs that are not part of the configuration file: they exist
// for tests and for the dev mode.
type Options struct {
	Logger *slog.Logger
	// EtcdSessionTTL is the TTL of the etcd election session in etcd mode
	// (how long a lost schedule leader keeps the leadership); 0: 10s.
	EtcdSessionTTL time.Duration
	// GossipProfile is "lan" (default) or "local" (fast failure detection).
	GossipProfile string
	// AccessLogger receives the access log (logging.access_log); nil: the
	// agent's logger.
	AccessLogger *slog.Logger
	// TraceBatchTimeout is how long spans wait to be exported (default
	// 5 s; tests shorten it).
	TraceBatchTimeout time.Duration
	// Levels are the levels of the agent's logger (logging.level,
	// logging.components), set live; nil: they need a restart.
	Levels *observe.Levels
	// LoadConfig reads the configuration again (file and flags) for POST
	// /reload; nil: /reload reloads the files only.
	LoadConfig func() (*config.Config, error)
	// AdmissionBackoff is the first wait before a server that failed to
	// prove its identity is asked again (default 1 s, doubling to 1 min).
	AdmissionBackoff time.Duration
	// CatalogSync is the placement catalog's anti-entropy period (0: 30 s).
	CatalogSync time.Duration
	// ReconcileInterval is how often the leader reconciles Raft membership
	// with gossip when nothing changes (default 5s).
	ReconcileInterval time.Duration
	// DeadNodeReclaimTime lets a restarted node take its gossip name back
	// on a new address (default 10s).
	DeadNodeReclaimTime time.Duration
	// LeaveTimeout bounds a graceful leave (default 10s).
	LeaveTimeout time.Duration
	// TTLInterval is the TTL reaper's scan interval (default 1s); the
	// reaper of deregister_critical_after scans as often.
	TTLInterval time.Duration
	// MinCheckInterval and MinDeregisterCriticalAfter lower the bounds a
	// registration's check interval and deregister_critical_after are
	// refused below (0: 1s and 1m). For tests only: a probe more often
	// than every second is a load on the service, not a check.
	MinCheckInterval           time.Duration
	MinDeregisterCriticalAfter time.Duration
	// FirstRequestTimeout is how long the API and internal ports' protocol
	// mux waits for a connection's first request before it hands it to
	// net/http (default 10 s), and ConnIdleTimeout how long their servers
	// keep a connection without calls (default 5 min). Tests shorten both
	// to idle past them.
	FirstRequestTimeout time.Duration
	ConnIdleTimeout     time.Duration
	// Stabilization is how long a new server must be healthy before it
	// is promoted to voter (default 10s).
	Stabilization time.Duration
	// GossipReconnectInterval is how often failed members are contacted
	// again (default 30s).
	GossipReconnectInterval time.Duration
}

// Agent is one running pivirt-agent.
type Agent struct {
	cfg    *config.Config
	opts   Options
	logger *slog.Logger
	// tee copies the logger's records to monitors (pvcli monitor) and
	// keeps the last ones (pvcli debug).
	tee *observe.Tee

	nodeID  string
	dataDir string
	tempDir bool
	// devCreds are the dev PKI's pvcli settings (--dev); zero otherwise.
	devCreds DevCredentials

	lnAPI, lnInternal, lnMetrics, lnRaft net.Listener
	advertiseIP                          string
	// raftLayer carries Raft over lnRaft (TCP, or mutual TLS).
	raftLayer raft.StreamLayer

	fsm   *fsm.FSM
	store *store.Store // nil in etcd mode
	raft  raftAdapter
	// etcd is the etcd-backed store (service_discovery.type etcd), else
	// nil.
	etcd       *etcdstore.Store
	etcdClient *clientv3.Client
	// cons is the state backend the gateway, the scheduler and the node
	// service use: raft or an etcdAdapter.
	cons   backend
	gossip *cluster.Gossip
	pool   *cluster.Pool
	// api, snapshots and schedules serve the cluster, snapshot and
	// schedule services on the API port; internal, internalSnapshots and
	// internalSchedules the leader-only ones on the internal port.
	api, internal                *gateway.ClusterService
	snapshots, internalSnapshots *gateway.SnapshotService
	// agentSvc and internalAgentSvc serve AgentService (monitor, support
	// bundle) on the API port and, for this node only, the internal port.
	agentSvc, internalAgentSvc *gateway.AgentService
	// history is this node's metrics history (runMetricsHistory), which
	// AgentService.WatchMetrics streams.
	history                      *gateway.MetricsHistory
	schedules, internalSchedules *gateway.ScheduleService
	scheduleMetrics              *scheduler.ScheduleMetrics
	// work is what a leadership term starts; terms runs one term at a
	// time, paused around a snapshot restore.
	work  *leader.Work
	terms *leader.Loop
	// tls is the TLS material; nil with tls.enabled false.
	tls *agentTLS
	// revocation checks the peers of every TLS source (tls.revocation).
	revocation        *identity.RevocationChecker
	revocationMetrics *revocationMetrics
	// metrics is the registry /metrics serves.
	metrics     *registry
	snapMetrics *scheduler.SnapshotMetrics
	// replicaMetrics count the leader's replica checks; replicas keeps the
	// last one's result.
	replicaMetrics replicaMetrics
	replicas       replicaCheck
	// lag caches a follower's /ready verdict on how far behind the leader
	// it is.
	lag lagCheck
	// ca is the built-in cluster CA (tls.cluster_ca.enabled), else nil.
	ca *leader.ClusterCA
	// renewers renew this agent's certificates through the PiTrust CA
	// server (tls.ca_server), else nil.
	renewers []*identity.Renewer
	// proxy forwards the backend APIs to the backend clusters.
	proxy *mesh.Proxy
	// peerProxy serves, on the internal port, the calls other agents
	// route to this node's node-scoped backends.
	peerProxy *mesh.Proxy
	health    *health.Server
	// healthRouted are the backend APIs routed at some point (updateHealth's
	// alone: it runs on one goroutine).
	healthRouted map[string]bool
	// backends and backendSources change with a reload (backendsMu).
	backendsMu     sync.RWMutex
	backends       []*mesh.Backend
	backendSources []*identity.Source
	// backendSourceByFiles: the source of each set of files (cert, key,
	// CA) of backendSources.
	backendSourceByFiles map[[3]string]*identity.Source
	meshStats            *mesh.Stats
	// tracing exports spans (tracing.enabled); a no-op otherwise.
	tracing *observe.Tracing
	// raftApplyTime is pivirt_raft_apply_duration_seconds.
	raftApplyTime prometheus.Observer
	// apiMetrics counts the API port's calls.
	apiMetrics *observe.Metrics
	// current is the configuration in force after reloads; reloadMu
	// serialises them.
	current  atomic.Pointer[config.Config]
	reloadMu sync.Mutex
	// fileCfg is the configuration of the file and flags, without the
	// cluster settings; settings follows the cluster settings.
	fileCfg  atomic.Pointer[config.Config]
	settings *settingsStatus
	// authn names the API port's callers; nil when access control is off.
	authn *authn.Authenticator
	// guard is the API port's access control; nil when it is off.
	guard *access.Guard
	// policyFile is auth.rbac_policy; clusterPolicy follows the
	// cluster-wide policy of the replicated config, which takes
	// precedence (nil while access control is off).
	policyFile    *authz.File
	clusterPolicy *leader.ClusterPolicy
	// netPolicy is auth.network_policy; nil when none is set.
	netPolicy *watchfile.File[*netpolicy.Set]
	// clusterNetPolicy is the cluster setting auth.network_policy, which
	// takes precedence; netPolicyChanged wakes its enforcement on open
	// connections (peerConns).
	clusterNetPolicy atomic.Pointer[netpolicy.Set]
	// clusterNetPolicyDoc is its text (reloadMu).
	clusterNetPolicyDoc string
	netPolicyChanged    chan struct{}
	// settingsKick makes the settings follower apply the replicated
	// settings again (after a file reload).
	settingsKick chan struct{}
	// servicesKick makes the services directory be read again (a reload).
	servicesKick chan struct{}
	peerConns    connTracker

	servers     []*http.Server
	grpcServers []*grpc.Server

	view *cluster.BootstrapView
	// meta is what this node claims in gossip; admission checks the
	// claims of others (nil with TLS off).
	meta      cluster.NodeMeta
	admission cluster.Admitter
	// proving holds the names of refused members being asked again in
	// the background (refusedMember).
	proving sync.Map

	// mu guards the lifecycle: Start runs under it, and Leave and Shutdown
	// take it, so neither can run while Start is still wiring.
	mu      sync.Mutex
	started bool
	// startedAt is when Start began.
	startedAt time.Time

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	stopErr error
	done    chan struct{}
}

// New validates cfg and prepares an agent; Start runs it.
func New(cfg *config.Config, opts Options) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.GossipProfile == "" {
		opts.GossipProfile = "lan"
	}
	if opts.ReconcileInterval <= 0 {
		opts.ReconcileInterval = 5 * time.Second
	}
	if opts.DeadNodeReclaimTime <= 0 {
		opts.DeadNodeReclaimTime = 10 * time.Second
	}
	if opts.LeaveTimeout <= 0 {
		opts.LeaveTimeout = 10 * time.Second
	}
	if opts.Stabilization <= 0 {
		opts.Stabilization = 10 * time.Second
	}
	// Lines logged in a request's context carry its request ID; the tee
	// copies them to monitors and keeps the last ones for support
	// bundles.
	tee := observe.NewTee()
	logger := slog.New(tee.Handler(observe.WithRequestIDs(opts.Logger.Handler())))
	a := &Agent{cfg: cfg, opts: opts, logger: logger, tee: tee, done: make(chan struct{})}
	a.metrics = newRegistry()
	a.metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	a.snapMetrics = scheduler.NewSnapshotMetrics(a.metrics)
	a.metrics.MustRegister(newStateCollector(a))
	apply := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "pivirt_raft_apply_duration_seconds",
		Help:    "Time from proposing a command through Raft on this node (the leader) until it is applied.",
		Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
	})
	a.metrics.MustRegister(apply)
	a.raftApplyTime = apply
	a.replicaMetrics = newReplicaMetrics(a.metrics)
	a.settings = newSettingsStatus(a.metrics)
	a.settingsKick = make(chan struct{}, 1)
	a.servicesKick = make(chan struct{}, 1)
	return a, nil
}

// Start opens the data dir and every listener, starts Raft and gossip,
// bootstraps or joins as configured, and serves the APIs. On error all that
// was started is stopped again.
func (a *Agent) Start(ctx context.Context) (err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.started {
		return errors.New("agent already started")
	}
	a.started, a.startedAt = true, time.Now()
	a.ctx, a.cancel = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			_ = a.shutdownLocked()
		}
	}()
	// What validate refuses, the start refuses first, by the same code.
	check := func() error { return Check(a.cfg) }
	keyFiles := func() error { return checkKeyPermissions(a.cfg, a.logger) }
	// ctx bounds the steps that wait for something outside the agent.
	openState := func() error { return a.openState(ctx) }
	formCluster := func() error { return a.formCluster(ctx) }
	for _, step := range []func() error{
		check,               // the configuration and the files it names, as pivirt-agent validate
		a.openDataDir,       // the data dir and the node ID
		a.loadSettings,      // the cluster settings this node last applied, on top of the file
		a.startTracing,      // tracing.*
		keyFiles,            // key files readable by group or others refused
		a.listen,            // API, internal, metrics and Raft listeners
		a.startTLS,          // certificates, TLS on the listeners, the peer pool
		openState,           // the FSM, and the Raft store or the etcd mirror
		a.startGossip,       // the memberlist ring
		a.startLeadership,   // the leader term's work and the cluster CA
		a.buildServices,     // the cluster, snapshot and schedule services
		a.startGateway,      // backends, routing and access control
		a.serveAll,          // the API, internal and metrics ports
		a.runTerms,          // the leader loop
		a.runMetricsHistory, // the metrics history of WatchMetrics, sampled every 5s
		formCluster,         // bootstrap and join
		a.startRenewals,     // the renewals of this agent's certificates (cluster CA or CA server)
		a.runCatalog,        // the placement catalog of this node's backends
		a.runChecks,         // the checks of the service instances registered with this node
		a.runServicesDir,    // the service definitions of service_discovery.services_dir
		a.runSettings,       // the cluster settings, applied as they change
		a.startReplicaCheck, // the leader's periodic comparison of the replicas
	} {
		if err := step(); err != nil {
			return err
		}
	}
	if !a.cfg.TLS.Enabled {
		a.logger.Warn("TLS IS DISABLED: the API, internal and Raft ports are plaintext; use only on a trusted network or loopback")
	}
	a.logger.Info("agent started",
		"api_addr", a.APIAddr(), "internal_addr", a.InternalAddr(), "raft_addr", a.RaftAddr(),
		"gossip_addr", a.GossipAddr(), "metrics_addr", a.MetricsAddr())
	return nil
}

// startTracing sets up span export (tracing.*; a no-op when disabled).
func (a *Agent) startTracing() error {
	a.current.Store(a.cfg)
	a.logger = a.logger.With("node_id", a.nodeID)
	tc := a.cfg.Tracing
	var err error
	a.tracing, err = observe.NewTracing(a.ctx, observe.TraceConfig{
		Enabled: tc.Enabled, Exporter: tc.Exporter, Endpoint: tc.Endpoint, SamplingRate: tc.SamplingRate,
		Service: "pivirt-agent", NodeID: a.nodeID, BatchTimeout: a.opts.TraceBatchTimeout,
	})
	if err != nil {
		return err
	}
	a.logger.Info("starting pivirt-agent", "node_name", a.cfg.NodeName, "data_dir", a.dataDir, "version", version.Version, "protocol", version.Protocol)
	return nil
}

// startTLS loads the TLS material (tls.enabled), puts TLS on the listeners
// and builds the pool of connections to other agents.
func (a *Agent) startTLS() error {
	if a.lnRaft != nil {
		a.raftLayer = store.NewTCPStreamLayer(a.lnRaft, advertiseTCP(a.lnRaft, a.cfg.Cluster.Raft.AdvertiseAddr, a.advertiseIP))
	}
	a.pool = cluster.NewPool()
	if err := a.devPKI(); err != nil {
		return err
	}
	if err := a.devIssuer(); err != nil {
		return err
	}
	if err := a.startRevocation(); err != nil {
		return err
	}
	if a.cfg.TLS.Enabled {
		var err error
		if a.tls, err = loadTLS(a.cfg, a.logger); err != nil {
			return err
		}
		for _, s := range a.tls.sources() {
			s.SetRevocation(a.revocation)
			a.wg.Go(func() { s.Watch(a.ctx, tlsWatchInterval) })
		}
		// The server certificate's OCSP status is stapled to the
		// handshakes of both ports.
		a.wg.Go(func() { a.tls.api.RunStapling(a.ctx) })
		a.wg.Go(func() { a.tls.internal.RunStapling(a.ctx) })
		a.wg.Go(func() { a.watchExpiry(a.ctx) })
		a.metrics.MustRegister(newExpiryCollector(a.tls))
		if err := a.loadNetworkPolicy(); err != nil {
			return err
		}
		// A plaintext client (curl http://, grpcurl -plaintext) is told to
		// use TLS instead of seeing its connection dropped.
		// Connections are tracked by their peer's certificate, closed when
		// a CRL revokes it (revocation.go).
		a.lnAPI = tls.NewListener(a.tls.api.TrackConnections(gateway.RefusePlaintext(a.lnAPI, a.logger)), a.tls.api.ServerConfig(a.tls.apiClientAuth, nil))
		// Agents' connections are tracked: a network policy that no longer
		// allows one closes it (netpolicy.go).
		a.lnInternal = tls.NewListener(a.track(a.tls.internal.TrackConnections(a.lnInternal), "internal port"), recordPeer(a.tls.internal.ServerConfig(tls.RequireAndVerifyClientCert, a.peerCheck(a.lnInternal.Addr().String(), "internal port"))))
		if a.lnRaft != nil {
			raftPeers := recordPeer(a.tls.internal.ServerConfig(tls.RequireAndVerifyClientCert, a.peerCheck(a.lnRaft.Addr().String(), "raft port")))
			a.raftLayer = cluster.NewTLSStreamLayer(a.track(a.tls.internal.TrackConnections(a.lnRaft), "raft port"), advertiseTCP(a.lnRaft, a.cfg.Cluster.Raft.AdvertiseAddr, a.advertiseIP), raftPeers, a.tls.client.ClientConfig).WithTracker(a.tls.client.TrackDialed)
		}
		a.netPolicyChanged = make(chan struct{}, 1)
		a.wg.Go(a.watchNetworkPolicy)
		// A call made for a caller carries the caller's credential to the
		// agent that runs it (noderestrict.go).
		a.pool = cluster.NewPoolTLS(a.tls.client.ClientConfig).WithTracker(a.tls.client.TrackDialed).WithDialOptions(
			grpc.WithChainUnaryInterceptor(access.RelayUnaryClientInterceptor),
			grpc.WithChainStreamInterceptor(access.RelayStreamClientInterceptor))
	}
	if a.cfg.Tracing.Enabled {
		// Calls to other agents (forwarded writes, reads) carry the trace.
		a.pool.WithDialOptions(a.tracing.ClientOption())
	}
	return nil
}

// checkSnapshot is the store's snapshot check: the FSM's header check,
// with a snapshot of a newer release marked as such (store.ErrNewerData).
func checkSnapshot(r io.Reader) error {
	err := fsm.CheckSnapshotHeader(r)
	if errors.Is(err, fsm.ErrUnsupportedSnapshot) || errors.Is(err, fsm.ErrNeedsNewerVersion) {
		return fmt.Errorf("%w: %w", store.ErrNewerData, err)
	}
	return err
}

// openState creates the FSM and opens the Raft store over it, or in etcd
// mode the etcd-backed store that mirrors etcd into it.
func (a *Agent) openState(ctx context.Context) error {
	fcfg := fsm.DefaultConfig()
	fcfg.Logger = a.logger
	var err error
	a.fsm, err = fsm.New(fcfg)
	if err != nil {
		return fmt.Errorf("create state machine: %w", err)
	}
	a.view = &cluster.BootstrapView{}
	if a.cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
		return a.openEtcd(ctx)
	}
	rc := a.cfg.Cluster.Raft
	scfg := store.DefaultConfig()
	scfg.NodeID = a.nodeID
	scfg.DataDir = a.dataDir
	scfg.StreamLayer = a.raftLayer
	scfg.FSM = a.fsm
	scfg.Logger = a.logger
	scfg.HeartbeatTimeout = rc.HeartbeatTimeout.Std()
	scfg.ElectionTimeout = rc.ElectionTimeout.Std()
	scfg.LeaderLeaseTimeout = rc.LeaderLeaseTimeout.Std()
	scfg.SnapshotThreshold = rc.SnapshotThreshold
	scfg.SnapshotInterval = rc.SnapshotInterval.Std()
	scfg.TrailingLogs = rc.TrailingLogs
	scfg.LogStore = rc.LogStore
	scfg.WALSegmentSize = rc.WALSegmentSizeMB << 20
	scfg.LogVerificationInterval = 0
	if rc.LogVerification.Enabled {
		scfg.LogVerificationInterval = rc.LogVerification.Interval.Std()
	}
	scfg.LogVerificationAllowed = func() bool { return a.allows(fsm.FeatureLogVerification) }
	scfg.SnapshotCheck = checkSnapshot
	a.store, err = store.New(scfg)
	if err != nil {
		return fmt.Errorf("start raft: %w", err)
	}
	a.raft = raftAdapter{s: a.store, expect: rc.BootstrapExpect, name: a.cfg.NodeName, view: a.view, applyTime: a.raftApplyTime, tracer: a.tracing.Tracer()}
	a.cons = a.raft
	return nil
}

// startGossip joins nobody yet: it starts the memberlist ring with this
// node's meta (formCluster joins).
func (a *Agent) startGossip() error {
	rc := a.cfg.Cluster.Raft
	gcfg := cluster.DefaultGossipConfig()
	gcfg.NodeName = a.cfg.NodeName
	gcfg.BindAddr = a.cfg.Cluster.Gossip.BindAddr
	gcfg.AdvertiseAddr = a.gossipAdvertise()
	gcfg.Profile = a.opts.GossipProfile
	gcfg.DeadNodeReclaimTime = a.opts.DeadNodeReclaimTime
	gcfg.Logger = a.logger
	gcfg.PeersFile = filepath.Join(a.dataDir, "gossip-peers.json")
	if a.opts.GossipReconnectInterval > 0 {
		gcfg.ReconnectInterval = a.opts.GossipReconnectInterval
	}
	gcfg.Meta = cluster.NodeMeta{
		Cluster:         a.cfg.Cluster.Name,
		ID:              a.nodeID,
		Role:            cluster.RoleServer,
		RaftAddr:        a.RaftAddr(),
		APIAddr:         advertiseTCP(a.lnAPI, "", a.advertiseIP).String(),
		InternalAddr:    advertiseTCP(a.lnInternal, "", a.advertiseIP).String(),
		Version:         version.Version,
		Protocol:        version.Protocol,
		BootstrapExpect: rc.BootstrapExpect,
		Started:         a.startedAt.UnixMilli(),
		ClusterVersion:  fsm.Latest.String(),
	}
	a.meta = gcfg.Meta
	if f := a.cfg.Cluster.Gossip.EncryptKeyFile; f != "" {
		key, err := readGossipKey(f)
		if err != nil {
			return err
		}
		gcfg.SecretKey = key
	}
	// Keys installed and used through pvcli cluster keyring survive
	// restarts here.
	gcfg.KeyringFile = filepath.Join(a.dataDir, "gossip-keyring.json")
	var err error
	if a.gossip, err = cluster.NewGossip(gcfg); err != nil {
		return err
	}
	if a.etcdMode() {
		a.cons = etcdAdapter{s: a.etcd, nodeID: a.nodeID, name: a.cfg.NodeName, applyTime: a.raftApplyTime, tracer: a.tracing.Tracer(), members: a.gossip}
	}
	return nil
}

// startLeadership builds what a leadership term starts (leader.Work), the
// loop that runs one term at a time, and the cluster CA
// (tls.cluster_ca.enabled).
func (a *Agent) startLeadership() error {
	rc := a.cfg.Cluster.Raft
	a.scheduleMetrics = scheduler.NewScheduleMetrics(a.metrics)
	a.admission = a.newAdmission()
	if a.admission != nil && a.gossip != nil {
		a.gossip.SetProven(a.memberProven)
	}
	lc := leader.Config{
		NodeID:   a.nodeID,
		Logger:   a.logger,
		Store:    a.store,
		Etcd:     a.etcd,
		FSM:      a.fsm,
		Proposer: a.cons,
		Reconcile: cluster.ReconcileConfig{
			SelfID:            a.nodeID,
			SelfName:          a.cfg.NodeName,
			Admission:         a.admission,
			MaxNonvoters:      rc.MaxNonVoters,
			Voters:            rc.Voters,
			DeadServerCleanup: rc.DeadServerCleanup.Std(),
			Stabilization:     a.opts.Stabilization,
			Interval:          a.opts.ReconcileInterval,
			Logger:            a.logger,
			ClusterVersion:    a.fsm.Version,
		},
		Voters:      a.raft,
		Members:     a.gossip,
		Peers:       cluster.PoolStatus{Pool: a.pool},
		TTLInterval: a.opts.TTLInterval,
		Snapshots: scheduler.SnapshotterConfig{
			Interval: a.cfg.Snapshot.Interval.Std(),
			Dir:      a.snapshotDir(),
			Retain:   a.cfg.Snapshot.Retain,
			Logger:   a.logger,
			Metrics:  a.snapMetrics,
		},
		TakeSnapshot: a.takeSnapshot,
		Dispatcher: scheduler.DispatcherConfig{
			NodeID:  a.nodeID,
			Logger:  a.logger,
			Metrics: a.scheduleMetrics,
			Tracer:  a.tracing.Tracer(),
		},
		Invoke: a.invokeBackend,
	}
	if a.tls != nil && a.cfg.TLS.ClusterCA.Enabled {
		a.ca = leader.NewClusterCA(leader.CAConfig{
			CA:         a.cfg.TLS.ClusterCA,
			NodeID:     a.nodeID,
			Logger:     a.logger,
			Trust:      a.tls.internal,
			FSM:        a.fsm,
			Proposer:   a.store,
			Ready:      a.leaderReady,
			Leader:     a.raft.Leader,
			Members:    a.gossip,
			Node:       a.pool.Node,
			Registerer: a.metrics,
		})
		lc.CA = a.ca
	}
	a.work = leader.NewWork(lc)
	a.terms = leader.NewLoop(leader.LoopConfig{
		Subscribe: a.work.Subscribe,
		IsLeader:  a.work.IsLeader,
		Start:     a.work.Start,
		Revoked:   a.work.Revoked,
		Logger:    a.logger,
	})
	return nil
}

// buildServices builds the cluster, snapshot and schedule services, each
// twice: for the API port and, leader-only, for the internal port.
func (a *Agent) buildServices() error {
	var state gateway.StateReader = a.fsm
	var restorer gateway.Restorer = a.store
	if a.etcdMode() {
		state, restorer = a.etcd, a.etcd
	}
	hcfg := gateway.DefaultClusterServiceConfig()
	hcfg.Require = a.requireFeature
	hcfg.ClusterVersion = a.clusterVersion
	hcfg.NodeID = a.nodeID
	hcfg.NodeName = a.cfg.NodeName
	hcfg.HoldTimeout = a.cfg.Cluster.ForwardHoldTimeout.Std()
	hcfg.LeaderReady = a.leaderReady
	if a.etcdMode() {
		hcfg.Direct = true
		hcfg.LeaderReady = a.etcd.Ready
		hcfg.NotReady = a.etcdNotReady
	}
	hcfg.Leave = func() { _ = a.Leave(context.Background()) }
	hcfg.Stopping = a.ctx.Done()
	hcfg.Logger = a.logger
	hcfg.ValidateConfig = a.validateClusterConfig
	hcfg.Retire = a.retireFromCatalog
	hcfg.ForceLeave = func(ctx context.Context, addr, name string, prune bool) (bool, error) {
		resp, err := a.pool.Node(addr).ForceLeave(ctx, connect.NewRequest(&nodev1.ForceLeaveRequest{Node: name, Prune: prune}))
		if err != nil {
			return false, err
		}
		return resp.Msg.GetPending(), nil
	}
	if a.etcd == nil {
		hcfg.Autopilot = a.work.Reconciler
		hcfg.VerifyReplicas = a.verifyReplicas
		hcfg.Downgrade = a.downgrade
	}
	hcfg.Keyring = func(ctx context.Context, addr string, op clusterv1.KeyringOp, key string) (*clusterv1.NodeKeyring, error) {
		resp, err := a.pool.Node(addr).Keyring(ctx, connect.NewRequest(&nodev1.KeyringRequest{Op: op, Key: key}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetKeyring(), nil
	}
	hcfg.ConfigStatus = func(ctx context.Context, addr string) (*clusterv1.NodeConfigStatus, error) {
		resp, err := a.pool.Node(addr).ConfigStatus(ctx, connect.NewRequest(&nodev1.ConfigStatusRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetStatus(), nil
	}
	hcfg.CheckAccess = a.checkAccess
	hcfg.Explain, hcfg.PolicySource, hcfg.APIServices = a.explain, a.policySource, apiDescriptors()
	hcfg.MinCheckInterval = a.opts.MinCheckInterval
	hcfg.MinDeregisterCriticalAfter = a.opts.MinDeregisterCriticalAfter
	hcfg.CheckNetworkPolicy = a.checkNetworkPolicyRPC
	peers := peerClients{pool: a.pool}
	var err error
	a.api, err = gateway.NewClusterService(hcfg, a.cons, a.cons, a.gossip, peers, state)
	if err != nil {
		return err
	}
	icfg := hcfg
	icfg.LeaderOnly = true
	icfg.Leave = nil
	a.internal, err = gateway.NewClusterService(icfg, a.cons, a.cons, a.gossip, peers, state)
	if err != nil {
		return err
	}
	tmp := filepath.Join(a.dataDir, "tmp")
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return fmt.Errorf("data_dir: %w", err)
	}
	// Uploads a crash left behind.
	for _, pattern := range []string{gateway.RestoreTempPattern, archiveTempPattern} {
		if stale, err := filepath.Glob(filepath.Join(tmp, pattern)); err == nil {
			for _, f := range stale {
				_ = os.Remove(f)
			}
		}
	}
	snapCfg := gateway.SnapshotServiceConfig{
		Take:         a.takeSnapshot,
		Fork:         func() (*fsm.FSM, error) { return a.fsm.Fork(fsm.DefaultConfig()) },
		TempDir:      tmp,
		PauseLeader:  a.terms.Pause,
		ResumeLeader: a.terms.Resume,
		Restoring:    new(sync.Mutex), // one uploaded state at a time, whichever port it came in on
		Logger:       a.logger,
	}
	a.snapshots = gateway.NewSnapshotService(snapCfg, a.api, restorer, peers)
	a.internalSnapshots = gateway.NewSnapshotService(snapCfg, a.internal, restorer, peers)
	a.schedules = gateway.NewScheduleService(a.api, a.pool.Schedules)
	a.internalSchedules = gateway.NewScheduleService(a.internal, a.pool.Schedules)
	a.history = gateway.NewMetricsHistory(gateway.MetricsSamples)
	acfg := gateway.AgentServiceConfig{NodeName: a.cfg.NodeName, Tee: a.tee, DebugFiles: a.debugFiles, History: a.history, Stopping: a.ctx.Done(), Logger: a.logger}
	a.agentSvc = gateway.NewAgentService(acfg, a.gossip, a.pool)
	acfg.Local = true
	a.internalAgentSvc = gateway.NewAgentService(acfg, a.gossip, a.pool)
	return nil
}

// startGateway builds the backends (and the simulated ones of --dev), the
// routing to them and the API port's access control.
func (a *Agent) startGateway() error {
	if err := a.devBackends(); err != nil {
		return err
	}
	if err := a.startMesh(); err != nil {
		return err
	}
	var accessLog *slog.Logger
	if a.cfg.Logging.AccessLog.Enabled {
		accessLog = a.opts.AccessLogger
		if accessLog == nil {
			accessLog = a.logger.With("log", "access")
		}
	}
	a.apiMetrics = observe.New(a.metrics, accessLog)
	if err := a.startAccess(); err != nil {
		return err
	}
	if a.guard != nil {
		a.schedules.SetAuthorize(a.guard.Authorize)
	}
	a.schedules.SetVMCheck(a.vmExists)
	return nil
}

// serveAll serves the API port (Connect, gRPC, the proxied backend APIs),
// the internal port (the leader-only services and the node service) and
// the metrics port.
func (a *Agent) serveAll() error {
	if err := a.serveSplit(a.lnAPI, a.apiMux, func(s *grpc.Server) {
		clusterv1.RegisterClusterServiceServer(s, gateway.NewClusterGRPC(a.api))
		clusterv1.RegisterSnapshotServiceServer(s, gateway.NewSnapshotGRPC(a.snapshots))
		schedulev1.RegisterScheduleServiceServer(s, gateway.NewScheduleGRPC(a.schedules))
		clusterv1.RegisterAgentServiceServer(s, gateway.NewAgentGRPC(a.agentSvc))
		a.registerAPIExtras(s)
	}, append(append(append(a.proxyServerOptions(), a.accessServerOptions()...), a.tracingServerOptions()...),
		grpc.MaxRecvMsgSize(gateway.MaxGRPCRequestBytes))...); err != nil {
		return err
	}
	var signer cluster.CertificateSigner
	if a.ca != nil {
		signer = a.ca
	}
	nodeSvc := cluster.NewNodeService(a.nodeStatus(), a.internal, a.gossip, signer)
	nodeSvc.SetStateHash(a.stateHash)
	if a.tls != nil {
		nodeSvc.SetProver(a.proveIdentity)
	}
	nodeSvc.SetPlacementSink(a.proposePlacements)
	nodeSvc.SetConfigStatus(a.nodeConfigStatus)
	if err := a.serveSplit(a.lnInternal, func(gs *grpc.Server) (http.Handler, error) {
		return gateway.SplitGRPC(internalNotGRPC(), gs), nil
	}, func(s *grpc.Server) {
		clusterv1.RegisterClusterServiceServer(s, gateway.NewClusterGRPC(a.internal))
		clusterv1.RegisterSnapshotServiceServer(s, gateway.NewSnapshotGRPC(a.internalSnapshots))
		schedulev1.RegisterScheduleServiceServer(s, gateway.NewScheduleGRPC(a.internalSchedules))
		clusterv1.RegisterAgentServiceServer(s, gateway.NewAgentGRPC(a.internalAgentSvc))
		nodev1.RegisterNodeServiceServer(s, gateway.NewNodeGRPC(nodeSvc))
	}, append(append(append(a.tracingServerOptions(), observe.RequestIDServerOptions()...), a.internalServerOptions()...),
		grpc.UnknownServiceHandler(a.peerProxy.Handle), grpc.ForceServerCodecV2(mesh.Codec()))...); err != nil {
		return err
	}
	a.serve(a.lnMetrics, a.metricsMux())
	return nil
}

// runTerms runs the leader loop until the agent stops.
func (a *Agent) runTerms() error {
	a.wg.Go(func() { a.terms.Run(a.ctx) })
	return nil
}

// startRenewals starts the renewals of this agent's server and client
// certificates: through the cluster CA (tls.cluster_ca.enabled) or the
// PiTrust CA server (tls.ca_server.url).
func (a *Agent) startRenewals() error {
	if a.ca != nil {
		// The internal source verifies against tls.ca_file, the chain the
		// cluster CA's certificates must verify against (the API source may
		// trust a client_ca_file of its own).
		a.wg.Go(func() { a.ca.RenewLoop(a.ctx, "server", a.tls.internal, a.tls.api) })
		a.wg.Go(func() { a.ca.RenewLoop(a.ctx, "client", a.tls.client) })
		return nil
	}
	cs := a.cfg.TLS.CAServer
	if cs.URL == "" || a.tls == nil {
		return nil
	}
	host, err := caclient.ServerName(cs.URL)
	if err != nil {
		return fmt.Errorf("tls.ca_server.url: %w", err)
	}
	// The agent's client certificate towards the CA server, whose own
	// certificate must verify against tls.ca_file.
	client, err := caclient.New(cs.URL, a.tls.client.ClientConfig(host))
	if err != nil {
		return fmt.Errorf("tls.ca_server.url: %w", err)
	}
	renewed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pivirt_tls_cert_renewals_total",
		Help: "Renewals of this agent's own certificates through the PiTrust CA server, by certificate (server, client) and result (ok, error).",
	}, []string{"cert", "result"})
	if err := a.metrics.Register(renewed); err != nil {
		return err
	}
	result := func(name string, err error) {
		r := "ok"
		if err != nil {
			r = "error"
		}
		renewed.WithLabelValues(name, r).Inc()
	}
	ask := caclient.Asker(client, cs.URL)
	ca := "the PiTrust CA server " + cs.URL
	due := identity.RenewBeforeExpiry(cs.RenewBefore.Std())
	a.renewers = []*identity.Renewer{
		{Name: "server", Source: a.tls.internal, Also: []*identity.Source{a.tls.api}, CA: ca, Ask: ask, Due: due, Logger: a.logger, Result: result},
		{Name: "client", Source: a.tls.client, CA: ca, Ask: ask, Due: due, Logger: a.logger, Result: result},
	}
	for _, r := range a.renewers {
		a.wg.Go(func() { r.Run(a.ctx) })
	}
	return nil
}

func (a *Agent) openDataDir() error {
	a.dataDir = a.cfg.DataDir
	if a.dataDir == "" {
		if !a.cfg.Dev {
			return errors.New("data_dir: required outside dev mode")
		}
		dir, err := os.MkdirTemp("", "pivirt-agent-dev-")
		if err != nil {
			return fmt.Errorf("create dev data dir: %w", err)
		}
		a.dataDir, a.tempDir = dir, true
	}
	if err := os.MkdirAll(a.dataDir, 0o700); err != nil {
		return fmt.Errorf("data_dir: %w", err)
	}
	id, err := identity.LoadOrCreateNodeID(a.dataDir)
	if err != nil {
		return err
	}
	a.nodeID = id
	return nil
}

func (a *Agent) listen() error {
	for _, l := range []struct {
		key  string
		addr string
		ln   *net.Listener
	}{
		{"server.connectrpc.addr", a.cfg.Server.ConnectRPC.Addr, &a.lnAPI},
		{"server.grpc_internal.addr", a.cfg.Server.GRPCInternal.Addr, &a.lnInternal},
		{"server.metrics.addr", a.cfg.Server.Metrics.Addr, &a.lnMetrics},
		{"cluster.raft.addr", a.cfg.Cluster.Raft.Addr, &a.lnRaft},
	} {
		if l.ln == &a.lnRaft && a.cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
			continue // no Raft group in etcd mode
		}
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			return fmt.Errorf("%s: listen on %s: %w", l.key, l.addr, err)
		}
		*l.ln = ln
	}
	ip := a.cfg.Cluster.AdvertiseAddr
	if ip == "" {
		// Take the host of the first bind address that is not a wildcard.
		for _, ln := range []net.Listener{a.lnRaft, a.lnInternal, a.lnAPI} {
			if ln == nil {
				continue
			}
			if t := ln.Addr().(*net.TCPAddr); !t.IP.IsUnspecified() {
				ip = t.IP.String()
				break
			}
		}
	}
	if ip == "" {
		priv, err := sockaddr.GetPrivateIP()
		if err != nil || priv == "" {
			return fmt.Errorf("cluster.advertise_addr: cannot pick an address to advertise (bind addresses are wildcards and no private IP was found); set it: %v", err)
		}
		ip = priv
	}
	a.advertiseIP = ip
	return nil
}

// advertiseTCP is the address peers use to reach ln: the explicit advertise
// address, else the listener's address with a wildcard host replaced by ip.
func advertiseTCP(ln net.Listener, explicit, ip string) *net.TCPAddr {
	if explicit != "" {
		if t, err := net.ResolveTCPAddr("tcp", explicit); err == nil {
			return t
		}
	}
	t := *ln.Addr().(*net.TCPAddr)
	if t.IP.IsUnspecified() {
		t.IP = net.ParseIP(ip)
	}
	return &t
}

func (a *Agent) gossipAdvertise() string {
	if g := a.cfg.Cluster.Gossip.AdvertiseAddr; g != "" {
		return g
	}
	host, port, err := net.SplitHostPort(a.cfg.Cluster.Gossip.BindAddr)
	if err != nil {
		return ""
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		if port == "0" {
			return "" // memberlist picks the port; it advertises its bind IP
		}
		return net.JoinHostPort(a.advertiseIP, port)
	}
	return ""
}

func (a *Agent) formCluster(ctx context.Context) error {
	rc := a.cfg.Cluster.Raft
	switch {
	case a.etcdMode():
		// etcd holds the state: nothing to bootstrap. Gossip still joins
		// the agents, for membership and the cluster's view of its nodes.
	case rc.Bootstrap && !a.store.HasExistingState():
		err := a.store.Bootstrap([]store.Server{{ID: a.nodeID, Address: a.store.LocalAddr(), Voter: true}})
		if err != nil && !errors.Is(err, store.ErrAlreadyBootstrapped) {
			return fmt.Errorf("bootstrap: %w", err)
		}
		a.logger.Info("bootstrapped a single-server cluster")
	case rc.Bootstrap:
		a.logger.Info("not bootstrapping: raft state already exists")
	case rc.BootstrapExpect > 0:
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			err := cluster.RunBootstrapExpect(a.ctx, cluster.BootstrapConfig{
				SelfID: a.nodeID, SelfName: a.cfg.NodeName, Expect: rc.BootstrapExpect, Voters: rc.Voters, Logger: a.logger,
				Admission: a.admission,
			}, a.raft, a.gossip, cluster.PoolStatus{Pool: a.pool}, a.view)
			if err != nil && !errors.Is(err, cluster.ErrBootstrapSkipped) && a.ctx.Err() == nil {
				a.logger.Error("bootstrap-expect failed", "error", err)
			}
		}()
	}
	if join := a.cfg.Cluster.Join; len(join) > 0 {
		if _, err := a.gossip.Join(join); err != nil {
			return fmt.Errorf("cluster.join: %w", err)
		}
	}
	// A restarted server rejoins the members it knew, as Serf's snapshot
	// does, so a restart without join flags does not look like a dead
	// server to the leader.
	if len(a.cfg.Cluster.Join) == 0 && len(a.cfg.Cluster.RetryJoin) == 0 {
		known, err := cluster.LoadPeers(filepath.Join(a.dataDir, "gossip-peers.json"))
		if err != nil {
			a.logger.Warn("not rejoining known members", "error", err)
		}
		if len(known) > 0 {
			a.logger.Info("rejoining known gossip members", "addrs", known)
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				_ = cluster.RetryJoin(a.ctx, cluster.RetryJoinConfig{
					Addrs: known, Interval: time.Second, MaxAttempts: 60, Logger: a.logger,
				}, a.gossip)
			}()
		}
	}
	if rj := a.cfg.Cluster.RetryJoin; len(rj) > 0 {
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			_ = cluster.RetryJoin(a.ctx, cluster.RetryJoinConfig{
				Addrs: rj, Interval: a.cfg.Cluster.RetryInterval.Std(), MaxAttempts: a.cfg.Cluster.RetryMax, Logger: a.logger,
			}, a.gossip)
		}()
	}
	return nil
}

// snapshotDir is where automatic snapshot archives go.
func (a *Agent) snapshotDir() string {
	if d := a.cfg.Snapshot.Dir; d != "" {
		return d
	}
	return filepath.Join(a.dataDir, "backups")
}

// archiveTempPattern names the temporary files of archive states in
// <data_dir>/tmp.
const archiveTempPattern = "archive-state-*"

// takeSnapshot snapshots this node's state and describes it as an
// archive: the source of `pvcli snapshot save` and of automatic snapshots.
// Archives leave the cluster, so the state goes without the cluster CA's
// table (its private key). In Raft mode the FSM's state is captured (a
// read transaction, O(1)) and encoded as the returned reader is read: no
// Raft snapshot is taken, nothing is copied to disk or decoded. In etcd
// mode the mirror's snapshot is copied without the table into a temporary
// file, removed when the returned reader is closed.
func (a *Agent) takeSnapshot(ctx context.Context) (archive.Meta, io.ReadCloser, error) {
	var clusterID string
	if e, err := a.fsm.State().ConfigEntry(gateway.ClusterIDKey); err == nil {
		clusterID = e.GetValue()
	}
	if !a.etcdMode() {
		return a.captureSnapshot(ctx, clusterID)
	}
	sm, rc, err := a.etcdSnapshot(ctx)
	if err != nil {
		return archive.Meta{}, nil, err
	}
	defer rc.Close()
	tmp, err := os.CreateTemp(filepath.Join(a.dataDir, "tmp"), archiveTempPattern)
	if err != nil {
		return archive.Meta{}, nil, err
	}
	state := &tempFile{File: tmp}
	stateVersion, size, err := fsm.FilterSnapshot(rc, tmp, fsm.TableCA)
	if err == nil {
		_, err = tmp.Seek(0, io.SeekStart)
	}
	if err != nil {
		state.Close()
		return archive.Meta{}, nil, fmt.Errorf("snapshot %s: %w", sm.ID, err)
	}
	return archive.Meta{
		ID: sm.ID, Index: sm.Index, Term: sm.Term,
		FormatVersion: archive.FormatVersion, StateFormatVersion: stateVersion,
		ClusterID: clusterID, AgentVersion: version.Version,
		Size: size, CreatedAt: time.Now().UTC().Truncate(time.Millisecond),
	}, state, nil
}

// captureSnapshot captures the FSM's state without the CA table and
// returns a reader that encodes it as it is read (a goroutine writes
// into a pipe; closing the reader stops it). The ID has the form of
// Raft's snapshot IDs, term-index-milliseconds.
func (a *Agent) captureSnapshot(ctx context.Context, clusterID string) (archive.Meta, io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return archive.Meta{}, nil, err
	}
	snap, err := a.fsm.CaptureSnapshot(fsm.TableCA)
	if err != nil {
		return archive.Meta{}, nil, err
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	term, _ := a.store.LogTerm(snap.Index())
	pr, pw := io.Pipe()
	go func() {
		_, err := snap.WriteTo(pw)
		pw.CloseWithError(err)
	}()
	return archive.Meta{
		ID: fmt.Sprintf("%d-%d-%d", term, snap.Index(), now.UnixMilli()), Index: snap.Index(), Term: term,
		FormatVersion: archive.FormatVersion, StateFormatVersion: snap.FormatVersion(),
		ClusterID: clusterID, AgentVersion: version.Version,
		Size: snap.Size(), CreatedAt: now,
	}, pr, nil
}

// etcdSnapshot opens a snapshot of the etcd mirror in the fsm format, as
// of a revision at least as new as the call.
func (a *Agent) etcdSnapshot(ctx context.Context) (snapshotMeta, io.ReadCloser, error) {
	rev, rc, err := a.etcd.Snapshot(ctx)
	if err != nil {
		return snapshotMeta{}, nil, err
	}
	return snapshotMeta{ID: fmt.Sprintf("etcd-%d-%d", rev, time.Now().UnixMilli()), Index: rev}, rc, nil
}

// snapshotMeta identifies a snapshot of either mode.
type snapshotMeta struct {
	ID          string
	Index, Term uint64
}

// tempFile is a temporary file removed when closed.
type tempFile struct{ *os.File }

func (f *tempFile) Close() error {
	err := f.File.Close()
	return errors.Join(err, os.Remove(f.Name()))
}

func (a *Agent) serve(ln net.Listener, h http.Handler) {
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:           h,
		Protocols:         &protos,
		ConnContext:       gateway.WithConnTLS, // the caller's certificate, for handlers
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       a.connIdleTimeout(),
		ErrorLog:          slog.NewLogLogger(a.logger.Handler(), slog.LevelWarn),
	}
	a.servers = append(a.servers, srv)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) && !gateway.IsClosed(err) {
			a.logger.Error("server stopped", "addr", ln.Addr().String(), "error", err)
		}
	}()
}

// connIdleTimeout is how long the servers keep a connection without
// calls (Options.ConnIdleTimeout).
func (a *Agent) connIdleTimeout() time.Duration { return cmp.Or(a.opts.ConnIdleTimeout, 5*time.Minute) }

// streamWorkers is the size of the grpc-go servers' pool of stream
// workers (at least one per CPU).
const streamWorkers = 64

// serveSplit serves ln with grpc-go for gRPC connections and with h for
// everything else (gateway.ProtocolMux).
func (a *Agent) serveSplit(ln net.Listener, handler func(*grpc.Server) (http.Handler, error), register func(*grpc.Server), opts ...grpc.ServerOption) error {
	pm := gateway.NewProtocolMux(ln, cmp.Or(a.opts.FirstRequestTimeout, 10*time.Second))
	gs := grpc.NewServer(append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(cluster.MaxMessageBytes),
		grpc.MaxSendMsgSize(cluster.MaxMessageBytes),
		// A pool of stream workers instead of a goroutine per call (a
		// call finding every worker busy still gets its own goroutine):
		// measurably lower latency for short calls such as reads. As many
		// as the calls usually in flight, not one per CPU: a worker keeps
		// the stack a call grew, a new goroutine grows its own again
		// (runtime.newstack: about a tenth of the process's CPU at 64
		// concurrent proxied calls with one worker per CPU).
		grpc.NumStreamWorkers(max(streamWorkers, uint32(runtime.GOMAXPROCS(0)))),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		// The limits net/http applies to the same port's HTTP/2
		// connections: concurrent streams per connection, idle time.
		grpc.MaxConcurrentStreams(250),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: a.connIdleTimeout()}),
	}, opts...)...)
	register(gs)
	h, err := handler(gs)
	if err != nil {
		return err
	}
	a.grpcServers = append(a.grpcServers, gs)
	a.serve(pm.HTTP, h)
	a.wg.Add(2)
	go func() {
		defer a.wg.Done()
		if err := gs.Serve(pm.GRPC); err != nil && !gateway.IsClosed(err) {
			a.logger.Error("grpc server stopped", "addr", ln.Addr().String(), "error", err)
		}
	}()
	go func() {
		defer a.wg.Done()
		if err := pm.Serve(); err != nil {
			a.logger.Error("listener stopped", "addr", ln.Addr().String(), "error", err)
		}
	}()
	return nil
}

// uiConfig is what the web UI needs to log in: the issuer the agent
// checks tokens against (a.cfg: auth.oidc changes on a restart; --dev's
// issuer is only there), whether access control is off (no login then)
// and server.ui in force; nil when server.ui.enabled is false.
func (a *Agent) uiConfig() *ui.Config {
	cfg := a.current.Load()
	if !cfg.Server.UI.Enabled {
		return nil
	}
	oidc := a.cfg.Auth.OIDC
	c := &ui.Config{
		IssuerURL:      oidc.IssuerURL,
		ClientID:       cmp.Or(cfg.Server.UI.ClientID, oidc.ClientID),
		Scopes:         cfg.Server.UI.Scopes,
		ConnectOrigins: cfg.Server.UI.ConnectOrigins,
		// startAccess left the guard unset: every call is allowed.
		AccessControlOff: a.guard == nil,
	}
	if len(c.Scopes) == 0 {
		c.Scopes = []string{"openid"}
	}
	return c
}

func handlerOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(cluster.MaxMessageBytes),
		connect.WithSendMaxBytes(cluster.MaxMessageBytes),
		// Small messages are sent uncompressed: gzip costs more CPU than
		// it saves bytes below about a kilobyte.
		connect.WithCompressMinBytes(cluster.CompressMinBytes),
	}
}

func (a *Agent) apiMux(gs *grpc.Server) (http.Handler, error) {
	mux := http.NewServeMux()
	opts := append(handlerOptions(), connect.WithReadMaxBytes(gateway.MaxRequestBytes))
	if a.cfg.Tracing.Enabled {
		opts = append(opts, connect.WithInterceptors(a.tracing.ConnectInterceptor()))
	}
	opts = append(opts, connect.WithInterceptors(a.apiMetrics.ConnectInterceptor()))
	if a.guard != nil {
		opts = append(opts, connect.WithInterceptors(a.guard.ConnectInterceptor()))
	}
	// Callers are authenticated from the headers, before any body is read
	// (gateway/access/DESIGN.md, "Before the body").
	authenticated := func(h http.Handler) http.Handler {
		if a.guard == nil {
			return h
		}
		return a.guard.Authenticated(h)
	}
	path, h := clusterv1connect.NewClusterServiceHandler(a.api, opts...)
	mux.Handle(path, authenticated(h))
	path, h = clusterv1connect.NewSnapshotServiceHandler(a.snapshots, opts...)
	mux.Handle(path, authenticated(h))
	path, h = schedulev1connect.NewScheduleServiceHandler(a.schedules, opts...)
	mux.Handle(path, authenticated(h))
	path, h = clusterv1connect.NewAgentServiceHandler(a.agentSvc, opts...)
	mux.Handle(path, authenticated(h))
	// The metrics also on the API port, behind its TLS and (with access
	// control on) for authenticated callers.
	metrics := a.metricsHandler()
	if a.guard != nil {
		metrics = a.guard.HTTPHandler(metrics)
	}
	mux.Handle("GET "+a.cfg.Server.Metrics.Path, metrics)
	// The web UI: code and login settings only, no data (ui/DESIGN.md);
	// its calls come back here with the caller's credentials.
	mux.Handle("GET "+ui.Prefix, ui.Handler(a.uiConfig))
	mux.Handle("GET /ui", http.RedirectHandler(ui.Prefix, http.StatusMovedPermanently))
	mux.Handle("GET /{$}", ui.Root())
	// A VM's console for browsers: a WebSocket bridged to the Console
	// call, made in process through the gRPC server's access control.
	con := &console.Handler{
		GRPC:     gs,
		Origins:  func() []string { return a.current.Load().Server.UI.ConnectOrigins },
		Stopping: a.ctx.Done(),
		Logger:   a.logger,
	}
	if a.guard != nil {
		con.Authenticate = a.guard.Authenticated
	}
	mux.Handle("GET "+console.Path, con)
	if err := a.addTranscoder(mux, gs, authenticated); err != nil {
		return nil, err
	}
	// gRPC calls on a connection the protocol mux handed to net/http
	// (its first request came late) go to the gRPC server all the same.
	return gateway.SplitGRPC(mux, authenticated(gs)), nil
}

// peerClients adapts the pool to gateway.Peers.
type peerClients struct{ pool *cluster.Pool }

func (p peerClients) Status(ctx context.Context, addr string) (*nodeStatus, error) {
	return cluster.PoolStatus{Pool: p.pool}.Status(ctx, addr)
}

func (p peerClients) Cluster(addr string) clusterv1connect.ClusterServiceClient {
	return p.pool.Cluster(addr)
}

func (p peerClients) Snapshots(addr string) clusterv1.SnapshotServiceClient {
	return p.pool.Snapshots(addr)
}

func (p peerClients) ReadIndex(ctx context.Context, addr string) (uint64, error) {
	resp, err := p.pool.Node(addr).ReadIndex(ctx, connect.NewRequest(&nodev1.ReadIndexRequest{}))
	if err != nil {
		return 0, err
	}
	return resp.Msg.GetIndex(), nil
}

// Leave leaves the cluster gracefully and shuts the agent down: a leader
// first hands leadership over; then the node gossips its leave intent and
// leaves the ring (so no leader re-adds it), asks the leader to remove it
// from the Raft configuration, waits (bounded) until that happened, and
// stops. It is a no-op once the agent has stopped.
func (a *Agent) Leave(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.started || a.stopped() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, a.opts.LeaveTimeout)
	defer cancel()
	a.logger.Info("leaving the cluster")
	if a.etcdMode() {
		// Nothing to remove: the schedule leadership (if held) goes to
		// another agent as this one closes its etcd session.
		if err := a.gossip.Leave(a.opts.LeaveTimeout / 3); err != nil {
			a.logger.Warn("gossip leave", "error", err)
		}
		return a.shutdownLocked()
	}
	// This node's objects leave with it: the catalog stops naming it
	// (first, while it may still lead and record that itself).
	if err := a.retireFromCatalog(ctx, a.cfg.NodeName); err != nil {
		a.logger.Warn("leave: this node's entries stay in the placement catalog until the leader sees it gone", "error", err)
	}
	st := a.store.Status()
	if st.State == "Leader" && st.NumPeers > 0 {
		if id, err := a.store.TransferLeadership(ctx, ""); err != nil {
			a.logger.Warn("leadership transfer before leave failed", "error", err)
		} else {
			a.logger.Info("handed leadership over before leaving", "new_leader", id)
		}
	}
	if err := a.gossip.Leave(a.opts.LeaveTimeout / 3); err != nil {
		a.logger.Warn("gossip leave", "error", err)
	}
	if st.NumPeers > 0 {
		req := connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: a.nodeID})
		if _, err := a.api.RemovePeer(ctx, req); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			a.logger.Warn("leave: asking the leader to remove this server failed; it will be removed as a departed gossip member", "error", err)
		}
		a.waitRemoved(ctx)
	}
	return a.shutdownLocked()
}

func (a *Agent) waitRemoved(ctx context.Context) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		servers, err := a.store.Servers(ctx)
		if err == nil {
			found := false
			for _, s := range servers {
				found = found || s.ID == a.nodeID
			}
			if !found {
				return
			}
		}
		select {
		case <-ctx.Done():
			a.logger.Warn("leave: not yet seen removed from the raft configuration; stopping anyway")
			return
		case <-t.C:
		}
	}
}

// HandOff transfers leadership to another voter when this node leads and
// has peers (cluster.transfer_leadership_on_shutdown); bounded by ctx.
func (a *Agent) HandOff(ctx context.Context) {
	if a.etcdMode() {
		if a.cfg.Cluster.TransferLeadershipOnShutdown && a.etcd.IsLeader() {
			if err := a.etcd.Resign(ctx); err != nil {
				a.logger.Warn("handing the schedule leadership over before shutdown failed", "error", err)
				return
			}
			a.logger.Info("schedule leadership handed over before shutdown", "to", a.etcd.LeaderID())
		}
		return
	}
	if !a.cfg.Cluster.TransferLeadershipOnShutdown || a.store == nil || a.store.Status().State != "Leader" || a.store.Status().NumPeers == 0 {
		return
	}
	to, err := a.store.TransferLeadership(ctx, "")
	if err != nil {
		a.logger.Warn("handing leadership over before shutdown failed; the others elect a leader", "error", err)
		return
	}
	a.logger.Info("leadership handed over before shutdown", "to", to)
}

// Alive reports whether the agent is running: not stopped, and its Raft
// node not shut down (the systemd watchdog is pinged only then).
func (a *Agent) Alive() bool {
	if a.etcdMode() {
		return !a.stopped()
	}
	if a.stopped() || a.store == nil {
		return false
	}
	return a.store.Status().State != "Shutdown"
}

func (a *Agent) stopped() bool {
	select {
	case <-a.done:
		return true
	default:
		return false
	}
}

// Shutdown stops everything without leaving: the node stays a member and
// is expected back. It is idempotent, and waits for a running Start.
func (a *Agent) Shutdown() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.shutdownLocked()
}

func (a *Agent) shutdownLocked() error {
	if a.stopped() {
		return a.stopErr
	}
	defer close(a.done)
	if a.cancel != nil {
		a.cancel()
	}
	began := time.Now()
	var errs []error
	// Raft stops first: from then on this node answers "not leader" at
	// once, so peers forward to (and elect) another leader instead of
	// waiting for this node's HTTP servers to drain.
	if a.store != nil {
		if err := a.store.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if a.etcd != nil {
		// Resigns the schedule leadership, so another agent takes it now.
		if err := a.etcd.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if a.etcdClient != nil {
		_ = a.etcdClient.Close()
	}
	a.logger.Debug("shutdown: raft stopped", "took", time.Since(began).Round(time.Millisecond))
	// In-flight requests get a short grace; HTTP/2 connections that peers
	// keep open would otherwise hold each server for its GOAWAY timeout.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var swg sync.WaitGroup
	for _, s := range a.servers {
		swg.Add(1)
		go func() {
			defer swg.Done()
			if err := s.Shutdown(ctx); err != nil {
				_ = s.Close()
			}
		}()
	}
	for _, s := range a.grpcServers {
		swg.Add(1)
		go func() {
			defer swg.Done()
			stopped := make(chan struct{})
			go func() {
				s.GracefulStop()
				close(stopped)
			}()
			select {
			case <-stopped:
			case <-ctx.Done():
				s.Stop()
				<-stopped
			}
		}()
	}
	swg.Wait()
	a.logger.Debug("shutdown: servers stopped", "took", time.Since(began).Round(time.Millisecond))
	if a.tracing != nil {
		tctx, tcancel := context.WithTimeout(context.Background(), 2*time.Second)
		if err := a.tracing.Shutdown(tctx); err != nil {
			a.logger.Warn("exporting the last spans failed", "error", err)
		}
		tcancel()
	}
	if err := a.closeMesh(); err != nil {
		errs = append(errs, err)
	}
	if a.gossip != nil {
		if err := a.gossip.Shutdown(); err != nil {
			errs = append(errs, err)
		}
	}
	a.logger.Debug("shutdown: gossip stopped", "took", time.Since(began).Round(time.Millisecond))
	for _, ln := range []net.Listener{a.lnAPI, a.lnInternal, a.lnMetrics} {
		if ln != nil {
			_ = ln.Close()
		}
	}
	if a.store == nil && a.lnRaft != nil {
		_ = a.lnRaft.Close()
	}
	a.wg.Wait()
	if a.pool != nil {
		a.pool.Close()
	}
	if a.tempDir {
		if err := os.RemoveAll(a.dataDir); err != nil {
			errs = append(errs, err)
		}
	}
	a.stopErr = errors.Join(errs...)
	a.logger.Info("agent stopped", "took", time.Since(began).Round(time.Millisecond))
	return a.stopErr
}

// Done is closed when the agent has stopped (after Shutdown or Leave).
func (a *Agent) Done() <-chan struct{} { return a.done }

// NodeID is the node's stable ID.
func (a *Agent) NodeID() string { return a.nodeID }

// NodeName is the node's name.
func (a *Agent) NodeName() string { return a.cfg.NodeName }

// DataDir is the data directory in use.
func (a *Agent) DataDir() string { return a.dataDir }

// APIAddr is the advertised external API address.
func (a *Agent) APIAddr() string { return advertiseTCP(a.lnAPI, "", a.advertiseIP).String() }

// InternalAddr is the advertised internal address.
func (a *Agent) InternalAddr() string {
	return advertiseTCP(a.lnInternal, "", a.advertiseIP).String()
}

// MetricsAddr is the management address.
func (a *Agent) MetricsAddr() string { return a.lnMetrics.Addr().String() }

// RaftAddr is the advertised Raft address.
func (a *Agent) RaftAddr() string {
	if a.store == nil {
		return "" // etcd mode
	}
	return a.store.LocalAddr()
}

// GossipAddr is the advertised gossip address.
func (a *Agent) GossipAddr() string { return a.gossip.LocalAddr() }

// LeaderID returns the node ID of the leader this node knows: the Raft
// leader, or in etcd mode the holder of the schedule leadership.
func (a *Agent) LeaderID() string {
	if a.etcdMode() {
		return a.etcd.LeaderID()
	}
	id, _ := a.store.Leader()
	return id
}

// IsLeader reports whether this agent is the Raft leader with its leader
// state established.
func (a *Agent) IsLeader() bool { return a.leaderReady() }

// leaderReady reports whether this node leads and its leader state is
// established (leader.Work.Ready).
func (a *Agent) leaderReady() bool { return a.work != nil && a.work.Ready() }

// Store exposes the Raft store to tests in cmd/.
func (a *Agent) Store() *store.Store { return a.store }

// FSM returns the agent's state machine (for tests and tools).
func (a *Agent) FSM() *fsm.FSM { return a.fsm }

// Gossip exposes the gossip ring to tests in cmd/.
func (a *Agent) Gossip() *cluster.Gossip { return a.gossip }
