// Package store owns the node's *raft.Raft: the log store (raft-wal, or
// raft-boltdb in older data dirs), the bbolt stable store,
// the file snapshot store, the network transport over a caller-supplied
// stream layer, and the Raft instance itself. It turns hashicorp/raft's
// future-based API into context-aware calls, maps raft's errors to this
// package's sentinels in one place, fans leadership changes out to any number
// of subscribers, and makes membership changes idempotent.
//
// The replicated state machine is not this package's concern: it is passed in
// as a raft.FSM. See DESIGN.md beside this file.
package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	walmetrics "github.com/hashicorp/raft-wal/metrics"
	"github.com/hashicorp/raft-wal/verifier"
	"go.etcd.io/bbolt"
	bberrors "go.etcd.io/bbolt/errors"
)

const (
	// raftDir is the subdirectory of Config.DataDir that holds Raft state.
	raftDir = "raft"
	// boltFile is the log and stable store inside raftDir.
	boltFile = "raft.db"
	// boltOpenTimeout bounds the wait for bbolt's file lock, so a second
	// agent on the same data directory fails instead of hanging.
	boltOpenTimeout = 2 * time.Second
)

// Store is one Raft server. All methods are safe for concurrent use.
type Store struct {
	id        string
	raft      *raft.Raft
	fsm       raft.FSM
	logs      raft.LogStore // the log store as Raft sees it (raftStores.logs)
	transport *raft.NetworkTransport
	stores    *raftStores
	snaps     *raft.FileSnapshotStore
	snapDir   string // where snaps keeps its snapshots
	// verify counts log verification reports; nil when it is off.
	verify *verification
	log    *slog.Logger // this package's logs, component=store

	// existed is raft.HasExistingState as found by New, before NewRaft.
	existed bool
	// electionTimeout bounds how long TransferLeadership waits to learn the
	// new leader.
	electionTimeout time.Duration

	// closing is closed when Close starts; in-flight waits return
	// ErrShutdown instead of waiting on futures raft may never answer.
	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error

	leadership leadership
	// reach knows, on the leader, which servers its heartbeats fail to
	// reach.
	reach reach
	// reads batches the VerifyLeader rounds of concurrent ReadIndex calls.
	reads readRounds
}

// New opens (or creates) the Raft state in cfg.DataDir/raft and starts the
// Raft server. A server with no existing state waits, as a follower, to be
// bootstrapped (Bootstrap) or added to a cluster by its leader.
//
// New takes ownership of cfg.StreamLayer: Close closes it, and so does New
// when it fails, together with everything else it opened.
func New(cfg Config) (s *Store, err error) {
	if err := cfg.Validate(); err != nil {
		if cfg.StreamLayer != nil {
			cfg.StreamLayer.Close()
		}
		return nil, err
	}
	if a, ok := cfg.StreamLayer.Addr().(*net.TCPAddr); ok && (a.IP == nil || a.IP.IsUnspecified()) {
		cfg.StreamLayer.Close()
		return nil, &ConfigError{Field: "StreamLayer", Reason: "must advertise a reachable address, not an unspecified one", Value: a}
	}

	var closers []func() error
	defer func() {
		if err != nil {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		}
	}()
	closers = append(closers, cfg.StreamLayer.Close)

	dir := filepath.Join(cfg.DataDir, raftDir)
	// The caller's logger carries the node identity (node_id); raft's own
	// "node_id" attribute would repeat it.
	logger := newHCLogAdapter(cfg.Logger)
	slogger := cfg.Logger
	if slogger == nil {
		slogger = slog.New(slog.DiscardHandler)
	}
	slogger = slogger.With("component", "store")

	stores, err := openStores(cfg, dir, logger, slogger)
	if err != nil {
		return nil, err
	}
	closers = append(closers, stores.Close)
	logStoreChosen(slogger, stores.choice)

	existed, err := raft.HasExistingState(stores.logs, stores.stable, stores.snaps)
	if err != nil {
		return nil, fmt.Errorf("check existing raft state: %w", err)
	}

	transport := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:  cfg.StreamLayer,
		MaxPool: cfg.TransportMaxPool,
		Timeout: cfg.TransportTimeout,
		Logger:  logger.Named("transport"),
		// Pipelined replication at raft's default depth: two AppendEntries
		// in flight per follower, the next one prepared and sent while the
		// answer to the last is on its way. Raft's pipeline wedges after a
		// follower rejects an append (hashicorp/raft#612); endingPipelines
		// (transport.go) closes it on the rejection so Raft falls back and
		// starts a fresh one (see DESIGN.md).
		MaxRPCsInFlight: raft.DefaultMaxRPCsInFlight,
	})
	closers = append(closers, transport.Close)

	s = &Store{
		id:              cfg.NodeID,
		fsm:             cfg.FSM,
		logs:            stores.logs,
		transport:       transport,
		stores:          stores,
		snaps:           stores.snaps,
		snapDir:         filepath.Join(dir, "snapshots"),
		verify:          stores.verify,
		log:             slogger,
		existed:         existed,
		electionTimeout: cfg.ElectionTimeout,
		closing:         make(chan struct{}),
		reach:           reach{grace: 2 * cfg.HeartbeatTimeout},
	}
	// Raft blocks its main loop on NotifyCh until the value is taken, so a
	// dedicated goroutine takes it at once and fans it out without blocking.
	notify := make(chan bool, 1)
	var snapStore raft.SnapshotStore = stores.snaps
	if cfg.SnapshotCheck != nil {
		snapStore = checkedSnapshots{FileSnapshotStore: stores.snaps, check: cfg.SnapshotCheck, log: slogger}
	}
	r, err := raft.NewRaft(cfg.raftConfig(logger, notify), filterCheckpoints(cfg.FSM), stores.logs, stores.stable, snapStore, endingPipelines{transport})
	if err != nil {
		return nil, fmt.Errorf("start raft: %w", err)
	}
	s.raft = r
	stores.raft.Store(r)
	s.leadership.start(notify, s.closing)
	s.reach.start(r, raft.ServerID(cfg.NodeID), s.closing)
	go s.watchSnapshotIndex(time.Duration(snapshotIndexCheck.Load()))
	if cfg.LogVerificationInterval > 0 {
		go s.runCheckpoints(cfg.LogVerificationInterval, cfg.LogVerificationAllowed)
	}
	slogger.Info("raft started", "address", transport.LocalAddr(), "existing_state", existed, "log_store", stores.choice.Kind)
	return s, nil
}

// wrapLog, set by tests only, wraps the log store under everything else.
var wrapLog atomic.Pointer[func(dir string, log raft.LogStore) raft.LogStore]

// raftStores are the stores Raft runs on, as openStores opened them.
type raftStores struct {
	// stable is raft.db: the stable store (term, vote) in every data dir,
	// and the log too when kind is LogStoreBoltDB.
	stable *guardedBolt
	// logs is the log store as Raft sees it: the log cache, in front of
	// snapshotEntryLog, in front of the verifier (when log verification is
	// on), in front of the log.
	logs  raft.LogStore
	snaps *raft.FileSnapshotStore
	// choice is the log store in use and why.
	choice LogStoreChoice
	// closeLog closes the log store (the verifier and the WAL); the
	// stable store is closed by stable.Close.
	closeLog func() error
	// verify receives the verifier's reports; nil when verification is off.
	verify *verification
	// raft is set once Raft runs on these stores (snapshotEntryLog).
	raft atomic.Pointer[raft.Raft]
}

// Close closes the log store, then the stable store.
func (st *raftStores) Close() error {
	return errors.Join(st.closeLog(), st.stable.Close())
}

// openStores opens raft.db (the stable store, and in boltdb data dirs the
// log), the log store the data dir uses (chooseLogStore), with the
// verifier and the log cache in front of it when configured, and the file
// snapshot store in dir, creating dir if needed. On error nothing is left
// open.
func openStores(cfg Config, dir string, logger *hclogAdapter, slogger *slog.Logger) (*raftStores, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create raft directory: %w", err)
	}
	// Decided before raft.db is created below, which would make every new
	// data dir look like an old one.
	choice, err := chooseLogStore(dir, cfg.LogStore)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, boltFile)
	bopts := &bbolt.Options{
		Timeout:        boltOpenTimeout,
		NoFreelistSync: cfg.NoFreelistSync,
		FreelistType:   bbolt.FreelistMapType,
	}
	// A damaged log is refused before Raft reads it (integrity.go).
	present, err := checkBolt(path, bopts)
	if errors.Is(err, bberrors.ErrTimeout) {
		return nil, fmt.Errorf("open raft log %s: %w", path, ErrDataDirLocked)
	}
	if err != nil {
		return nil, err
	}
	// Data this release cannot read is refused before anything is written
	// (opening raft.db for writing commits a transaction).
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, cfg.SnapshotRetain, logger.Named("snapshot"))
	if err != nil {
		return nil, fmt.Errorf("open raft snapshot store: %w", err)
	}
	snap, err := restorableSnapshot(filepath.Join(dir, "snapshots"), snaps, cfg.SnapshotCheck)
	if err != nil {
		return nil, err
	}
	if choice.Kind == LogStoreWAL && !choice.Existing {
		// The wal directory is what marks a WAL data dir: it exists before
		// raft.db does, so a crash in between leaves a WAL data dir.
		if err := os.MkdirAll(filepath.Join(dir, walDir), 0o700); err != nil {
			return nil, fmt.Errorf("create raft log directory: %w", err)
		}
	}
	raw, err := raftboltdb.New(raftboltdb.Options{Path: path, BoltOptions: bopts})
	if errors.Is(err, bberrors.ErrTimeout) {
		return nil, fmt.Errorf("open raft log %s: %w", path, ErrDataDirLocked)
	}
	if err != nil {
		return nil, fmt.Errorf("open raft log %s: %w", path, err)
	}
	bolt := &guardedBolt{bolt: raw}
	st := &raftStores{stable: bolt, snaps: snaps, choice: choice}
	var base raft.LogStore
	switch choice.Kind {
	case LogStoreBoltDB:
		if err := checkLogs(path, raw, present, snap); err != nil {
			bolt.Close()
			return nil, err
		}
		base, st.closeLog = bolt, bolt.Close
	default:
		// raft.db holds no log here; its lock, taken above, keeps a second
		// agent away from the WAL too.
		w, err := openWAL(dir, cfg.WALSegmentSize, logger, snap)
		if err != nil {
			bolt.Close()
			return nil, err
		}
		base, st.closeLog = walLog{w}, w.Close
	}
	if wrap := wrapLog.Load(); wrap != nil {
		base = (*wrap)(dir, base)
	}
	st.logs = base
	if cfg.LogVerificationInterval > 0 {
		st.verify = &verification{log: slogger.With("component", "log_verification")}
		v := verifier.NewLogStore(base, isCheckpoint, st.verify.report, &walmetrics.NoOpCollector{})
		st.logs, st.closeLog = v, v.Close // closes base too
	}
	st.logs = &snapshotEntryLog{LogStore: st.logs, raft: &st.raft}
	if cfg.LogCacheSize > 0 {
		cache, err := raft.NewLogCache(cfg.LogCacheSize, st.logs)
		if err != nil {
			st.Close()
			return nil, fmt.Errorf("create raft log cache: %w", err)
		}
		st.logs = cache
	}
	return st, nil
}

// ID is this server's Raft ID (Config.NodeID).
func (s *Store) ID() string { return s.id }

// LocalAddr is the Raft address this server advertises to its peers.
func (s *Store) LocalAddr() string { return string(s.transport.LocalAddr()) }

// HasExistingState reports whether this server had Raft state (a log, a term
// or a snapshot) when it was opened, or has acquired some since: it was
// bootstrapped, or a leader replicated to it. A server without state must be
// bootstrapped or joined before it can take part in the cluster.
func (s *Store) HasExistingState() bool {
	return s.existed || s.raft.LastIndex() > 0 || s.raft.CurrentTerm() > 0
}

// Apply proposes cmd to the cluster and waits until it is committed and
// applied by the local FSM. It must be called on the leader (ErrNotLeader
// otherwise). resp is whatever the FSM's Apply returned for cmd, passed
// through uninterpreted, including an error value; index is the log index of
// the entry.
//
// ctx's deadline is also raft's enqueue timeout (ErrTimeout). If ctx ends
// before the entry is applied, Apply returns the context's error (a deadline
// as ErrTimeout) but the entry may still be committed and applied later, as it
// may after ErrLeadershipLost: the client ID and sequence number every command
// carries, deduplicated by the FSM, are what make retrying safe.
func (s *Store) Apply(ctx context.Context, cmd []byte) (resp any, index uint64, err error) {
	timeout, err := enqueueTimeout(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("apply: %w", err)
	}
	f := s.raft.Apply(cmd, timeout)
	if err := s.wait(ctx, f); err != nil {
		return nil, 0, fmt.Errorf("apply: %w", err)
	}
	return f.Response(), f.Index(), nil
}

// Barrier waits until every entry committed before it has been applied to the
// local FSM. Called by a new leader before it serves consistent reads or
// starts leader-only work. Leader only.
func (s *Store) Barrier(ctx context.Context) error {
	timeout, err := enqueueTimeout(ctx)
	if err != nil {
		return fmt.Errorf("barrier: %w", err)
	}
	if err := s.wait(ctx, s.raft.Barrier(timeout)); err != nil {
		return fmt.Errorf("barrier: %w", err)
	}
	return nil
}

// VerifyLeader confirms with a quorum that this server is still the leader.
// Leader only. For linearizable reads use ReadIndex, which builds on it.
func (s *Store) VerifyLeader(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("verify leader: %w", contextError(ctx))
	}
	// Through wait, not the future alone: a verification raft queued just
	// as it shut down is never answered.
	if err := s.wait(ctx, s.raft.VerifyLeader()); err != nil {
		return fmt.Errorf("verify leader: %w", err)
	}
	return nil
}

// AppliedIndexer is implemented by FSMs that report the index of the last
// entry they applied; ReadIndex uses it to stop its search early.
type AppliedIndexer interface {
	AppliedIndex() uint64
}

// lastFSMEntry returns the largest index at or below top whose entry raft
// hands to the FSM, or the FSM's applied index when every entry above it up
// to top is a no-op or barrier (at most a few per term). An entry already
// compacted away is at or below the last snapshot, which the FSM holds.
func (s *Store) lastFSMEntry(top uint64) uint64 {
	var floor uint64
	if ai, ok := s.fsm.(AppliedIndexer); ok {
		floor = min(ai.AppliedIndex(), top)
	}
	var l raft.Log
	for i := top; i > floor; i-- {
		if err := s.logs.GetLog(i, &l); err != nil {
			return i
		}
		if l.Type == raft.LogCommand || l.Type == raft.LogConfiguration {
			return i
		}
	}
	return floor
}

// enqueueTimeout turns ctx's deadline into raft's enqueue timeout (0: wait as
// long as needed).
func enqueueTimeout(ctx context.Context) (time.Duration, error) {
	if err := ctx.Err(); err != nil {
		return 0, contextError(ctx)
	}
	dl, ok := ctx.Deadline()
	if !ok {
		return 0, nil
	}
	d := time.Until(dl)
	if d <= 0 {
		return 0, &timeoutError{cause: context.DeadlineExceeded}
	}
	return d, nil
}

// wait waits for f, for ctx to end, or for the Store to close, whichever is
// first, and maps the result. raft's futures cannot be selected on, so f is
// awaited in a goroutine, which ends when raft answers f. raft answers every
// future except those still queued when it shuts down; the goroutines of
// calls that raced with Close in that way stay blocked, and their callers get
// ErrShutdown.
func (s *Store) wait(ctx context.Context, f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return mapRaftError(err)
	case <-ctx.Done():
		select {
		case err := <-done:
			return mapRaftError(err)
		default:
			return contextError(ctx)
		}
	case <-s.closing:
		return ErrShutdown
	}
}

// IsLeader reports whether this server is the leader right now. Leadership can
// be lost at any moment; use VerifyLeader where that matters.
func (s *Store) IsLeader() bool { return s.raft.State() == raft.Leader }

// Leader returns the current leader's ID and address as known to this server,
// or empty strings when there is none.
func (s *Store) Leader() (id, addr string) {
	a, i := s.raft.LeaderWithID()
	return string(i), string(a)
}

// Term is the current term.
func (s *Store) Term() uint64 { return s.raft.CurrentTerm() }

// Role is the part of Status that requests read on every call: raft's
// getters only, without the copy of the configuration Status makes.
type Role struct {
	State        string    // "Follower", "Candidate", "Leader" or "Shutdown"
	Term         uint64    // current term
	LastIndex    uint64    // last index in the log or latest snapshot
	CommitIndex  uint64    // highest index known to be committed
	AppliedIndex uint64    // highest index handed to the FSM
	LastContact  time.Time // last contact from the leader; zero on the leader or if never
	LeaderID     string    // current leader's ID, "" if unknown
	// NoLeaderSince is, while no leader is known, since when: a
	// follower's last contact with the leader it lost, the time a leader
	// stepped down, or the start. Zero while a leader is known.
	NoLeaderSince time.Time
}

// Role returns the current Role.
func (s *Store) Role() Role {
	state := s.raft.State()
	r := Role{
		State:        state.String(),
		Term:         s.raft.CurrentTerm(),
		LastIndex:    s.raft.LastIndex(),
		CommitIndex:  s.raft.CommitIndex(),
		AppliedIndex: s.raft.AppliedIndex(),
	}
	_, id := s.raft.LeaderWithID()
	r.LeaderID = string(id)
	if id == "" {
		r.NoLeaderSince = s.reach.noLeaderSince()
	}
	if state != raft.Leader {
		r.LastContact = s.raft.LastContact()
	}
	return r
}

// Status is a point-in-time view of this server's Raft state: its Role and
// its place in the configuration.
type Status struct {
	Role
	ID         string // this server's ID
	Address    string // this server's advertised address
	LeaderAddr string // current leader's address, "" if unknown
	HasState   bool   // see HasExistingState
	Voter      bool   // this server is a voter in the latest configuration
	NumPeers   int    // voters other than this one; 0 if this server is not a voter
}

// Status returns a snapshot of this server's Raft state. It is cheap: it reads
// raft's getters and the in-memory configuration.
func (s *Store) Status() Status {
	st := Status{
		Role:     s.Role(),
		ID:       s.id,
		Address:  s.LocalAddr(),
		HasState: s.HasExistingState(),
	}
	_, st.LeaderAddr = s.Leader()
	if f := s.raft.GetConfiguration(); f.Error() == nil {
		for _, srv := range f.Configuration().Servers {
			if srv.Suffrage != raft.Voter {
				continue
			}
			if string(srv.ID) == s.id {
				st.Voter = true
			} else {
				st.NumPeers++
			}
		}
	}
	if !st.Voter {
		st.NumPeers = 0
	}
	return st
}

// Close shuts Raft down, then closes the transport (and with it the stream
// layer) and the log store, and ends every leadership subscription. It does
// not hand leadership over first; call TransferLeadership before a planned
// shutdown. Close is idempotent; later calls return the first call's error.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		close(s.closing)
		var errs []error
		if err := s.raft.Shutdown().Error(); err != nil {
			errs = append(errs, fmt.Errorf("shut down raft: %w", err))
		}
		if err := s.transport.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close raft transport: %w", err))
		}
		s.leadership.stop()
		s.reach.stop()
		if err := s.stores.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close raft log: %w", err))
		}
		s.closeErr = errors.Join(errs...)
		s.log.Info("raft stopped")
	})
	return s.closeErr
}
