package store

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/hashicorp/raft"
)

// Config configures a Store. Obtain one from DefaultConfig, set NodeID,
// DataDir, StreamLayer and FSM, adjust what else is needed, and pass it to
// New. A Store never reads its Config again after New returns.
type Config struct {
	// NodeID is the Raft server ID: the node's stable identity, never derived
	// from an address. Required.
	NodeID string

	// DataDir is the node's data directory. Raft state lives in DataDir/raft:
	// raft.db (the bbolt log and stable store) and snapshots/. Required.
	DataDir string

	// StreamLayer carries Raft RPCs between servers: it accepts inbound
	// connections and dials outbound ones. Its Addr is the address this
	// server advertises to its peers, so it must be reachable by them (not
	// 0.0.0.0). Close is called by Store.Close. Required.
	StreamLayer raft.StreamLayer

	// FSM is the replicated state machine. Required.
	FSM raft.FSM

	// Logger receives Raft's logs with component=raft. Nil discards them.
	Logger *slog.Logger

	// SnapshotRetain is how many snapshots are kept on disk (at least 1).
	SnapshotRetain int
	// SnapshotThreshold is how many log entries must be written since the
	// last snapshot before Raft takes another one.
	SnapshotThreshold uint64
	// SnapshotInterval is how often Raft checks whether to take a snapshot.
	SnapshotInterval time.Duration
	// TrailingLogs is how many log entries are kept after a snapshot, so a
	// slightly lagging follower can catch up without a snapshot install.
	TrailingLogs uint64

	// HeartbeatTimeout is how long a follower waits without contact from the
	// leader before it starts an election.
	HeartbeatTimeout time.Duration
	// ElectionTimeout is how long a candidate waits without winning before it
	// starts a new election. At least HeartbeatTimeout.
	ElectionTimeout time.Duration
	// LeaderLeaseTimeout is how long a leader stays leader without being able
	// to contact a quorum. At most HeartbeatTimeout.
	LeaderLeaseTimeout time.Duration
	// CommitTimeout bounds how long an idle leader waits before sending an
	// AppendEntries that carries the latest commit index to followers.
	CommitTimeout time.Duration

	// MaxAppendEntries is the largest number of log entries sent in one
	// AppendEntries RPC and, with BatchApplyCh, the largest group committed
	// in one disk write (1..1024).
	MaxAppendEntries int
	// BatchApplyCh buffers Raft's apply channel to MaxAppendEntries, so
	// concurrent Apply calls are grouped into one log write and one RPC.
	BatchApplyCh bool
	// LogCacheSize is how many recent log entries are kept in memory in front
	// of the bbolt log store, so replication to followers rarely reads the
	// disk. 0 disables the cache.
	LogCacheSize int
	// NoFreelistSync skips writing bbolt's freelist on every commit, which
	// makes log writes cheaper at the cost of a freelist scan when the file is
	// opened (as Consul does).
	NoFreelistSync bool

	// LogStore is the log store of a new data dir: LogStoreWAL (the
	// default, also when empty) or LogStoreBoltDB. A data dir that already holds a log keeps
	// its kind whatever this says (see chooseLogStore); MigrateLogStore
	// converts one offline.
	LogStore string
	// WALSegmentSize is the size of raft-wal's segment files in bytes,
	// preallocated when each is created.
	WALSegmentSize int
	// LogVerificationInterval is how often the leader appends a log
	// verification checkpoint (verify.go); 0 turns verification off on
	// this node (it still handles the leader's checkpoints as no-ops).
	LogVerificationInterval time.Duration
	// LogVerificationAllowed, when set, is asked before each checkpoint:
	// agents that predate log verification cannot decode a checkpoint
	// entry, so the leader appends none until the cluster version allows
	// it. nil: always.
	LogVerificationAllowed func() bool
	// SnapshotCheck, when set, reads the start of a snapshot's data (the
	// FSM's header) and says whether this release can restore it. A
	// snapshot it refuses is never kept (one a leader sends is cancelled
	// before it is stored, so the snapshots this node can restore stay),
	// and a data dir whose newest snapshot it refuses is refused at start
	// before anything is written. The check's error wraps ErrNewerData for
	// a snapshot a newer release wrote; any other error is a snapshot that
	// cannot be read (ErrCorruptLog at start). nil: every snapshot is
	// taken.
	SnapshotCheck func(io.Reader) error

	// TransportMaxPool is how many idle outbound connections are pooled per
	// peer.
	TransportMaxPool int
	// TransportTimeout is the I/O deadline of Raft RPCs (scaled up for
	// snapshot installs).
	TransportTimeout time.Duration
}

// DefaultConfig returns a Config with production defaults and the required
// fields (NodeID, DataDir, StreamLayer, FSM) left empty.
func DefaultConfig() Config {
	return Config{
		SnapshotRetain:     2,
		SnapshotThreshold:  16384,
		SnapshotInterval:   30 * time.Second,
		TrailingLogs:       10240,
		HeartbeatTimeout:   1000 * time.Millisecond,
		ElectionTimeout:    1000 * time.Millisecond,
		LeaderLeaseTimeout: 500 * time.Millisecond,
		CommitTimeout:      50 * time.Millisecond,
		MaxAppendEntries:   128,
		BatchApplyCh:       true,
		LogCacheSize:       512,
		NoFreelistSync:     true,
		WALSegmentSize:     DefaultWALSegmentSize,
		// Consul's default interval.
		LogVerificationInterval: time.Minute,
		TransportMaxPool:        3,
		TransportTimeout:        10 * time.Second,
	}
}

// ConfigError reports one invalid Config field.
type ConfigError struct {
	Field  string // the Config field name, e.g. "HeartbeatTimeout"
	Reason string // what is allowed, e.g. "must be at least 5ms"
	Value  any    // the rejected value
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("store config: %s %s (got %v)", e.Field, e.Reason, e.Value)
}

// The WAL segment sizes allowed: a segment must hold the largest entry Raft
// writes (a snapshot is not an entry; a write is at most a few MiB), and
// raft-wal's format limits a file to 4 GiB (its preallocation to 2 GiB).
const (
	minWALSegmentSize = 1 << 20
	maxWALSegmentSize = 1 << 30
)

// minTimeout is raft's lower bound for every timeout it validates.
const minTimeout = 5 * time.Millisecond

// Validate reports every invalid field, joined, each as a *ConfigError that
// names the field and the allowed values.
func (c Config) Validate() error { return c.validate(true) }

// validate is Validate; needStream is false for the offline RecoverCluster.
func (c Config) validate(needStream bool) error {
	var errs []error
	bad := func(field, reason string, v any) {
		errs = append(errs, &ConfigError{Field: field, Reason: reason, Value: v})
	}
	if c.NodeID == "" {
		bad("NodeID", "is required", `""`)
	}
	if c.DataDir == "" {
		bad("DataDir", "is required", `""`)
	}
	if needStream && c.StreamLayer == nil {
		bad("StreamLayer", "is required", nil)
	}
	if c.FSM == nil {
		bad("FSM", "is required", nil)
	}
	if c.SnapshotRetain < 1 {
		bad("SnapshotRetain", "must be at least 1", c.SnapshotRetain)
	}
	if c.SnapshotThreshold < 1 {
		bad("SnapshotThreshold", "must be at least 1", c.SnapshotThreshold)
	}
	if c.SnapshotInterval < minTimeout {
		bad("SnapshotInterval", "must be at least 5ms", c.SnapshotInterval)
	}
	if c.HeartbeatTimeout < minTimeout {
		bad("HeartbeatTimeout", "must be at least 5ms", c.HeartbeatTimeout)
	}
	if c.ElectionTimeout < minTimeout || c.ElectionTimeout < c.HeartbeatTimeout {
		bad("ElectionTimeout", fmt.Sprintf("must be at least 5ms and at least HeartbeatTimeout (%s)", c.HeartbeatTimeout), c.ElectionTimeout)
	}
	if c.LeaderLeaseTimeout < minTimeout || c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		bad("LeaderLeaseTimeout", fmt.Sprintf("must be between 5ms and HeartbeatTimeout (%s)", c.HeartbeatTimeout), c.LeaderLeaseTimeout)
	}
	if c.CommitTimeout < time.Millisecond {
		bad("CommitTimeout", "must be at least 1ms", c.CommitTimeout)
	}
	if c.MaxAppendEntries < 1 || c.MaxAppendEntries > 1024 {
		bad("MaxAppendEntries", "must be between 1 and 1024", c.MaxAppendEntries)
	}
	if c.LogCacheSize < 0 {
		bad("LogCacheSize", "must be 0 (off) or positive", c.LogCacheSize)
	}
	if c.LogStore != "" && c.LogStore != LogStoreWAL && c.LogStore != LogStoreBoltDB {
		bad("LogStore", fmt.Sprintf("must be %q or %q", LogStoreWAL, LogStoreBoltDB), fmt.Sprintf("%q", c.LogStore))
	}
	if c.WALSegmentSize < minWALSegmentSize || c.WALSegmentSize > maxWALSegmentSize {
		bad("WALSegmentSize", fmt.Sprintf("must be between %d and %d bytes", minWALSegmentSize, maxWALSegmentSize), c.WALSegmentSize)
	}
	if c.LogVerificationInterval < 0 || (c.LogVerificationInterval > 0 && c.LogVerificationInterval < time.Second) {
		bad("LogVerificationInterval", "must be 0 (off) or at least 1s", c.LogVerificationInterval)
	}
	if c.TransportMaxPool < 1 {
		bad("TransportMaxPool", "must be at least 1", c.TransportMaxPool)
	}
	if c.TransportTimeout <= 0 {
		bad("TransportTimeout", "must be positive", c.TransportTimeout)
	}
	return errors.Join(errs...)
}

// raftConfig translates c into hashicorp/raft's configuration.
func (c Config) raftConfig(logger *hclogAdapter, notify chan<- bool) *raft.Config {
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(c.NodeID)
	rc.HeartbeatTimeout = c.HeartbeatTimeout
	rc.ElectionTimeout = c.ElectionTimeout
	rc.LeaderLeaseTimeout = c.LeaderLeaseTimeout
	rc.CommitTimeout = c.CommitTimeout
	rc.MaxAppendEntries = c.MaxAppendEntries
	rc.BatchApplyCh = c.BatchApplyCh
	rc.SnapshotThreshold = c.SnapshotThreshold
	rc.SnapshotInterval = c.SnapshotInterval
	rc.TrailingLogs = c.TrailingLogs
	// A server removed from the configuration keeps running as a follower,
	// so it can be added back (Consul does the same); the cluster package
	// decides when a node should leave for good.
	rc.ShutdownOnRemove = false
	// Emit only the labelled form of per-peer metrics, not the legacy
	// duplicates with the peer in the metric name.
	rc.NoLegacyTelemetry = true
	rc.NotifyCh = notify
	rc.Logger = logger
	return rc
}
