package config

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"time"

	"github.com/spf13/pflag"
)

// Flag names, as the operator types them.
const (
	FlagConfig           = "config"
	FlagNodeName         = "node-name"
	FlagDataDir          = "data-dir"
	FlagGossipAddr       = "gossip-addr"
	FlagAdvertiseAddr    = "advertise-addr"
	FlagAPIAddr          = "api-addr"
	FlagInternalAddr     = "internal-addr"
	FlagMetricsAddr      = "metrics-addr"
	FlagRaftAddr         = "raft-addr"
	FlagJoin             = "join"
	FlagRetryJoin        = "retry-join"
	FlagRetryInterval    = "retry-interval"
	FlagRetryMax         = "retry-max"
	FlagBootstrapExpect  = "bootstrap-expect"
	FlagBootstrap        = "bootstrap"
	FlagVoters           = "voters"
	FlagLeaveOnTerminate = "leave-on-terminate"
	FlagLogLevel         = "log-level"
	FlagLogFormat        = "log-format"
	FlagDev              = "dev"
)

// Flags are the pivirt-agent command-line flags. Each overrides one configuration key, and
// only when the user set it: an unset flag never replaces a value from the file.
type Flags struct {
	fs *pflag.FlagSet

	configFile       string
	nodeName         string
	dataDir          string
	gossipAddr       string
	advertiseAddr    string
	apiAddr          string
	internalAddr     string
	metricsAddr      string
	raftAddr         string
	join             []string
	retryJoin        []string
	retryInterval    time.Duration
	retryMax         int
	bootstrapExpect  int
	bootstrap        bool
	voters           int
	leaveOnTerminate bool
	logLevel         string
	logFormat        string
	dev              bool
}

// Register defines the agent's flags on fs and returns the handle that applies them after
// fs has been parsed. The defaults shown in the help are those of Default.
func Register(fs *pflag.FlagSet) *Flags {
	f := &Flags{fs: fs}
	fs.StringVar(&f.configFile, FlagConfig, "", "configuration file (YAML), e.g. /etc/pivirt-agent/config.yaml; flags override it")
	fs.StringVar(&f.nodeName, FlagNodeName, "", "node name (node_name; default: the hostname)")
	fs.StringVar(&f.dataDir, FlagDataDir, DefaultDataDir, "data directory: node ID, Raft log, snapshots (data_dir)")
	fs.StringVar(&f.gossipAddr, FlagGossipAddr, DefaultGossipAddr, "gossip bind address ip:port (cluster.gossip.bind_addr)")
	fs.StringVar(&f.advertiseAddr, FlagAdvertiseAddr, "", "IP address other nodes use to reach this one (cluster.advertise_addr; default: derived from the bind addresses)")
	fs.StringVar(&f.apiAddr, FlagAPIAddr, DefaultAPIAddr, "external ConnectRPC listen address (server.connectrpc.addr)")
	fs.StringVar(&f.internalAddr, FlagInternalAddr, DefaultInternalAddr, "internal gRPC listen address between agents (server.grpc_internal.addr)")
	fs.StringVar(&f.metricsAddr, FlagMetricsAddr, DefaultMetricsAddr, "metrics, health and debug HTTP listen address (server.metrics.addr)")
	fs.StringVar(&f.raftAddr, FlagRaftAddr, DefaultRaftAddr, "Raft listen address ip:port (cluster.raft.addr)")
	fs.StringSliceVar(&f.join, FlagJoin, nil, "gossip address host:port of a member to join at start; repeatable or comma-separated (cluster.join)")
	fs.StringSliceVar(&f.retryJoin, FlagRetryJoin, nil, "like --join, retried until it succeeds; repeatable or comma-separated (cluster.retry_join)")
	fs.DurationVar(&f.retryInterval, FlagRetryInterval, DefaultRetryInterval, "time between --retry-join attempts (cluster.retry_interval)")
	fs.IntVar(&f.retryMax, FlagRetryMax, 0, "maximum --retry-join attempts, 0 = forever (cluster.retry_max)")
	fs.IntVar(&f.bootstrapExpect, FlagBootstrapExpect, 0, "bootstrap the cluster once this many servers are seen (cluster.raft.bootstrap_expect)")
	fs.BoolVar(&f.bootstrap, FlagBootstrap, false, "bootstrap a single-node cluster on an empty Raft log (cluster.raft.bootstrap)")
	fs.IntVar(&f.voters, FlagVoters, DefaultVoters, "target number of Raft voters: 1, 3 or 5 (odd, up to 7) (cluster.raft.voters)")
	fs.BoolVar(&f.leaveOnTerminate, FlagLeaveOnTerminate, false, "leave the cluster gracefully on SIGTERM (cluster.leave_on_terminate)")
	fs.StringVar(&f.logLevel, FlagLogLevel, "info", "log level: debug, info, warn or error (logging.level)")
	fs.StringVar(&f.logFormat, FlagLogFormat, "json", "log format: json or text (logging.format)")
	fs.BoolVar(&f.dev, FlagDev, false, "development mode: one node on 127.0.0.1, bootstrapped alone, TLS on with a throw-away PKI (pvcli's settings printed to stderr), a development OIDC issuer on 127.0.0.1 for bearer tokens (pitrust dev-token) unless auth.oidc is configured, a temporary data dir, a simulated backend unless backends are configured; refuses a --config that sets the keys it sets (addresses, tls, cluster); explicit flags win")
	return f
}

// ConfigFile returns the value of --config; empty when no file was given.
func (f *Flags) ConfigFile() string { return f.configFile }

// Dev reports whether --dev was given.
func (f *Flags) Dev() bool { return f.dev }

// Apply overrides cfg with the flags the user set (fs.Changed). With --dev it first applies
// ApplyDev, so the explicit flags win over the dev defaults. A list flag (--join,
// --retry-join) replaces the file's list. Apply checks what can be checked per flag, naming
// the flag; the caller still runs cfg.Validate.
func (f *Flags) Apply(cfg *Config) error {
	if !f.fs.Parsed() {
		return errors.New("config: Apply called before the flags were parsed")
	}
	set := f.fs.Changed
	if set(FlagDev) && f.dev {
		ApplyDev(cfg)
	}
	strs := []struct {
		name string
		dst  *string
		val  string
	}{
		{FlagNodeName, &cfg.NodeName, f.nodeName},
		{FlagDataDir, &cfg.DataDir, f.dataDir},
		{FlagGossipAddr, &cfg.Cluster.Gossip.BindAddr, f.gossipAddr},
		{FlagAdvertiseAddr, &cfg.Cluster.AdvertiseAddr, f.advertiseAddr},
		{FlagAPIAddr, &cfg.Server.ConnectRPC.Addr, f.apiAddr},
		{FlagInternalAddr, &cfg.Server.GRPCInternal.Addr, f.internalAddr},
		{FlagMetricsAddr, &cfg.Server.Metrics.Addr, f.metricsAddr},
		{FlagRaftAddr, &cfg.Cluster.Raft.Addr, f.raftAddr},
		{FlagLogLevel, &cfg.Logging.Level, f.logLevel},
		{FlagLogFormat, &cfg.Logging.Format, f.logFormat},
	}
	for _, s := range strs {
		if set(s.name) {
			*s.dst = s.val
		}
	}
	if set(FlagJoin) {
		cfg.Cluster.Join = slices.Clone(f.join)
	}
	if set(FlagRetryJoin) {
		cfg.Cluster.RetryJoin = slices.Clone(f.retryJoin)
	}
	if set(FlagRetryInterval) {
		cfg.Cluster.RetryInterval = Duration(f.retryInterval)
	}
	if set(FlagRetryMax) {
		cfg.Cluster.RetryMax = f.retryMax
	}
	if set(FlagBootstrapExpect) {
		cfg.Cluster.Raft.BootstrapExpect = f.bootstrapExpect
	}
	if set(FlagBootstrap) {
		cfg.Cluster.Raft.Bootstrap = f.bootstrap
	}
	if set(FlagVoters) {
		cfg.Cluster.Raft.Voters = f.voters
	}
	if set(FlagLeaveOnTerminate) {
		cfg.Cluster.LeaveOnTerminate = f.leaveOnTerminate
	}

	var errs []error
	check := func(name string, err error) {
		if err != nil && set(name) {
			errs = append(errs, fmt.Errorf("--%s: %w", name, err))
		}
	}
	logging := reflect.TypeFor[LoggingConfig]()
	check(FlagLogLevel, checkEnum(f.logLevel, enumOf(logging, "level")))
	check(FlagLogFormat, checkEnum(f.logFormat, enumOf(logging, "format")))
	check(FlagRetryMax, nonNegativeInt(f.retryMax))
	check(FlagBootstrapExpect, nonNegativeInt(f.bootstrapExpect))
	if f.retryInterval <= 0 {
		check(FlagRetryInterval, fmt.Errorf("%w %s: must be positive", ErrInvalid, f.retryInterval))
	}
	return errors.Join(errs...)
}

// Resolve is the agent's whole configuration step: Load the --config file (Default() without
// one), Apply the flags, then Validate. Call it again on reload to re-read the file with the
// same flags on top.
//
// With --dev, a file that sets keys dev mode sets itself (DevKeys) is refused, naming
// them, unless the key's flag is given too: dev mode would silently ignore them.
func (f *Flags) Resolve() (*Config, error) {
	cfg := Default()
	if f.configFile != "" {
		data, err := os.ReadFile(f.configFile)
		if err != nil {
			return nil, fmt.Errorf("read config file: %w", err)
		}
		if cfg, err = Parse(data, f.configFile); err != nil {
			return nil, err
		}
		if f.fs.Changed(FlagDev) && f.dev {
			if err := devConflicts(f.configFile, data, f.fs.Changed); err != nil {
				return nil, err
			}
		}
	}
	if err := f.Apply(cfg); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// enumOf returns the allowed values of key in struct type t (its `enum` tag).
func enumOf(t reflect.Type, key string) []string {
	for _, f := range fieldsOf(t) {
		if f.name == key {
			return f.enum
		}
	}
	panic("config: no key " + key + " in " + t.String())
}

func nonNegativeInt(n int) error {
	if n < 0 {
		return fmt.Errorf("%w %d: must not be negative", ErrInvalid, n)
	}
	return nil
}
