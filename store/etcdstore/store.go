// Package etcdstore keeps the agent's replicated state in etcd v3 instead of
// the embedded Raft group: service registrations as keys under the
// configured prefix with leases for TTLs, config and schedules as keys
// written with compare-and-set transactions, and the schedule dispatcher's
// leadership through an etcd election. It serves the same consumer
// interfaces as store.Store; see DESIGN.md.
package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/store"
)

// Config configures a Store.
type Config struct {
	// Client is the etcd client; the Store does not close it.
	Client *clientv3.Client
	// Prefix is service_discovery.etcd.prefix, e.g. "/pivirt/services".
	Prefix string
	// NodeID is this agent's node ID, its value in the election.
	NodeID string
	// FSM is the local mirror of the state: the Store feeds it from etcd and
	// evaluates commands on it. It must be new (empty).
	FSM *fsm.FSM
	// DedupeWindow is the FSM's (fsm.Config.DedupeWindow): dedupe records
	// live in etcd at least this long.
	DedupeWindow time.Duration
	// SessionTTL is the TTL of the election session: how long a leader
	// that lost etcd keeps the leadership key. Default 10s.
	SessionTTL time.Duration
	// RequestTimeout bounds one etcd request. Default 5s.
	RequestTimeout time.Duration
	// HealthInterval is how often etcd is probed. Default 1s.
	HealthInterval time.Duration
	// MaxTxnOps is the etcd server's --max-txn-ops (default 128): restores
	// write in transactions of at most this many operations.
	MaxTxnOps int
	// Conns, when the Client dials with its DialOptions, names the cause
	// of connection failures in the errors the Store reports.
	Conns  *Conns
	Logger *slog.Logger
}

// Store is the etcd-backed state. It is safe for concurrent use.
type Store struct {
	cfg    Config
	cli    *clientv3.Client
	fsm    *fsm.FSM
	lay    layout
	logger *slog.Logger

	// mu guards the mirror's key index below and orders it with the FSM:
	// ingest holds it for writing, an evaluation for reading, so that an
	// evaluation sees the FSM state and the key index at one revision.
	mu      sync.RWMutex
	entries map[string]*entry // etcd key -> what it holds
	byPK    map[string]string // table + "\x00" + primary key -> etcd key
	// elected are the keys of the election, by key: value and create revision.
	elected map[string]candidate

	healthy     atomic.Bool
	synced      atomic.Bool
	lastContact atomic.Int64 // unix nanos of the last answer from etcd
	lastErr     atomic.Pointer[string]

	leader leadership
	// resignReq asks the campaign to resign; it closes the channel sent
	// once it has.
	resignReq chan chan struct{}

	// reloadReq asks follow to load the state afresh (Restore); the
	// channel sent is closed once it has. pending holds them meanwhile
	// (follow's alone).
	reloadReq chan chan struct{}
	pending   []chan struct{}

	dedupeMu    sync.Mutex
	dedupeLease clientv3.LeaseID
	dedupeUntil time.Time // when dedupeLease stops being handed out

	// batchMu guards the writes waiting for their transaction (batch.go)
	// and whether a goroutine is sending them (committing, tracked by
	// batchWG); batchClosed refuses new ones once Close began.
	batchMu     sync.Mutex
	queue       []*txnReq
	committing  bool
	batchClosed bool
	batchWG     sync.WaitGroup

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool
}

// entry is the mirror of one etcd key.
type entry struct {
	table string
	recs  []proto.Message // one, or the list of a grouped key, in key order
	pks   []string        // primary keys of recs
	mod   int64
	lease clientv3.LeaseID
}

type candidate struct {
	value  string
	create int64
}

// Open loads the state from etcd into cfg.FSM and starts following it: the
// watch that keeps the mirror current, the health probe and the election
// campaign. It fails when etcd cannot be read within ctx.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Client == nil || cfg.FSM == nil || cfg.NodeID == "" {
		return nil, errors.New("etcdstore: Client, FSM and NodeID are required")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/pivirt/services"
	}
	if cfg.DedupeWindow <= 0 {
		cfg.DedupeWindow = fsm.DefaultConfig().DedupeWindow
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 10 * time.Second
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 5 * time.Second
	}
	if cfg.HealthInterval <= 0 {
		cfg.HealthInterval = time.Second
	}
	if cfg.MaxTxnOps <= 0 {
		cfg.MaxTxnOps = 128
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Store{
		cfg:     cfg,
		cli:     cfg.Client,
		fsm:     cfg.FSM,
		lay:     newLayout(cfg.Prefix),
		logger:  cfg.Logger.With("component", "etcdstore"),
		entries: make(map[string]*entry),
		byPK:    make(map[string]string),
		elected: make(map[string]candidate),

		reloadReq: make(chan chan struct{}),
		resignReq: make(chan chan struct{}),
	}
	s.leader.init()
	rev, err := s.load(ctx)
	if err != nil {
		// Not fatal: the Store starts not ready, serving an empty state,
		// and loads it once etcd answers.
		s.logger.Warn("etcd not reachable at start; retrying in the background", "error", s.explain(err))
		rev = 0
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Go(func() { s.follow(rev) })
	s.wg.Go(s.probe)
	s.wg.Go(s.campaign)
	return s, nil
}

// Close stops following etcd and resigns the leadership (within the request
// timeout). The client stays open.
func (s *Store) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	s.batchMu.Lock()
	s.batchClosed = true
	s.batchMu.Unlock()
	s.cancel()
	s.batchWG.Wait()
	s.wg.Wait()
	s.leader.close()
	return nil
}

// Prefix is the services prefix (service_discovery.etcd.prefix).
func (s *Store) Prefix() string { return s.lay.services }

// Root is the key prefix of everything the Store keeps.
func (s *Store) Root() string { return s.lay.watchPrefix() }

func pkKey(table string, pk []byte) string { return table + "\x00" + string(pk) }

// contact records an answer from etcd.
func (s *Store) contact() {
	s.lastContact.Store(time.Now().UnixNano())
}

// fail records an error talking to etcd, unless the request ended because
// its caller's ctx did: a cancelled call says nothing about etcd.
func (s *Store) fail(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	msg := s.explain(err).Error()
	s.lastErr.Store(&msg)
	s.healthy.Store(false)
}

// explain adds why connections to etcd fail (Config.Conns) to err.
func (s *Store) explain(err error) error {
	if s.cfg.Conns == nil {
		return err
	}
	if why := s.cfg.Conns.Err(); why != nil {
		return fmt.Errorf("%w (connecting: %v)", err, why)
	}
	return err
}

// unavailable wraps an etcd client error as store.ErrUnavailable, keeping
// the end of ctx recognisable.
func unavailable(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("%w: %s: %w (%w)", store.ErrUnavailable, what, store.ErrTimeout, err)
		}
		return err
	}
	return fmt.Errorf("%w: %s: %w", store.ErrUnavailable, what, err)
}

// load reads every key of the layout at one revision and replaces the
// mirror with it. It returns the revision.
func (s *Store) load(ctx context.Context) (int64, error) {
	const page = 1000
	var (
		rev     int64
		kvs     = map[string]*entry{}
		records []fsm.TableRecord
		elected = map[string]candidate{}
	)
	from := s.lay.watchPrefix()
	end := clientv3.GetPrefixRangeEnd(from)
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(page)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Get(rctx, from, opts...)
		cancel()
		if err != nil {
			s.fail(ctx, err)
			return 0, unavailable(ctx, "read the state", err)
		}
		s.contact()
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			key := string(kv.Key)
			if c, ok := s.electionKey(key, kv.Value, kv.CreateRevision); ok {
				elected[key] = c
				continue
			}
			table := s.lay.table(key)
			if table == "" {
				continue
			}
			e, err := s.newEntry(table, key, kv.Value, kv.ModRevision, clientv3.LeaseID(kv.Lease))
			if err != nil {
				s.logger.Error("etcd key not understood: left out of the state", "key", key, "error", err)
				continue
			}
			kvs[key] = e
			for _, rec := range e.recs {
				records = append(records, fsm.TableRecord{Table: table, Record: rec})
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fsm.Replace(uint64(rev), records); err != nil {
		return 0, fmt.Errorf("etcdstore: load the state: %w", err)
	}
	s.entries = kvs
	s.byPK = make(map[string]string, len(records))
	for key, e := range kvs {
		for _, pk := range e.pks {
			s.byPK[pkKey(e.table, []byte(pk))] = key
		}
	}
	s.elected = elected
	s.updateLeaderLocked()
	s.synced.Store(true)
	s.healthy.Store(true)
	s.logger.Info("state loaded from etcd", "revision", rev, "keys", len(kvs), "records", len(records))
	return rev, nil
}

// newEntry decodes the value of key.
func (s *Store) newEntry(table, key string, value []byte, mod int64, lease clientv3.LeaseID) (*entry, error) {
	recs, err := decode(table, value, mod)
	if err != nil {
		return nil, err
	}
	e := &entry{table: table, recs: recs, mod: mod, lease: lease, pks: make([]string, len(recs))}
	for i, rec := range recs {
		want, err := s.lay.key(table, rec)
		if err != nil {
			return nil, err
		}
		if want != key {
			return nil, fmt.Errorf("a %s record that belongs under %s", table, want)
		}
		pk, err := fsm.PrimaryKey(table, rec)
		if err != nil {
			return nil, err
		}
		e.pks[i] = string(pk)
	}
	return e, nil
}

func (s *Store) electionKey(key string, value []byte, create int64) (candidate, bool) {
	p := s.lay.election() + "/"
	if len(key) <= len(p) || key[:len(p)] != p {
		return candidate{}, false
	}
	return candidate{value: string(value), create: create}, true
}

// follow keeps the mirror current from revision rev on (0: load it
// first), reloading it when the watch cannot continue (compaction, a lost
// stream, etcd unreachable).
func (s *Store) follow(rev int64) {
	backoff := 100 * time.Millisecond
	refused := ""
	for s.ctx.Err() == nil {
		if rev == 0 {
			lctx, cancel := context.WithTimeout(s.ctx, 2*s.cfg.RequestTimeout)
			r, err := s.load(lctx)
			cancel()
			if err != nil {
				if (errors.Is(err, fsm.ErrNeedsNewerVersion) || errors.Is(err, fsm.ErrUnsupportedSnapshot)) && err.Error() != refused {
					refused = err.Error()
					s.logger.Error("etcd holds a state this release cannot run; upgrade this agent", "error", err)
				}
				if !s.sleep(&backoff) {
					return
				}
				continue
			}
			rev, backoff = r, 100*time.Millisecond
			for _, done := range s.pending {
				close(done)
			}
			s.pending = nil
		}
		next, err := s.watch(rev)
		if s.ctx.Err() != nil {
			return
		}
		if err == nil {
			rev = next
			continue
		}
		rev = 0
		if errors.Is(err, errReload) {
			continue
		}
		s.synced.Store(false)
		s.fail(s.ctx, err)
		s.logger.Warn("etcd watch ended; reloading the state", "error", err, "revision", next)
		if !s.sleep(&backoff) {
			return
		}
	}
}

// errCompacted ends a watch whose start revision etcd compacted away.
var errCompacted = errors.New("the watched revision was compacted")

// errReload ends a watch to load the state afresh (reload).
var errReload = errors.New("reload requested")

// reload makes the mirror load the whole state from etcd again, replacing
// it at once (watchers re-list, as after a Raft restore), and returns once
// it has.
func (s *Store) reload(ctx context.Context) error { return s.ask(ctx, s.reloadReq) }

// ask hands a fresh channel to the goroutine receiving on req and waits
// until it closes it.
func (s *Store) ask(ctx context.Context, req chan<- chan struct{}) error {
	done := make(chan struct{})
	select {
	case req <- done:
	case <-ctx.Done():
		return ctx.Err()
	case <-s.ctx.Done():
		return store.ErrShutdown
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-s.ctx.Done():
		return store.ErrShutdown
	}
}

// watch follows the layout's keys from rev+1 until the stream ends. It
// returns the revision the mirror reached and why it ended (nil: the stream
// closed and may be reopened from there).
func (s *Store) watch(rev int64) (int64, error) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	defer cancel()
	ch := s.cli.Watch(ctx, s.lay.watchPrefix(), clientv3.WithPrefix(), clientv3.WithRev(rev+1),
		clientv3.WithProgressNotify(), clientv3.WithCreatedNotify())
	for {
		var resp clientv3.WatchResponse
		select {
		case done := <-s.reloadReq:
			s.pending = append(s.pending, done)
			return rev, errReload
		case r, ok := <-ch:
			if !ok {
				if s.ctx.Err() != nil {
					return rev, nil
				}
				return rev, errors.New("the watch stream closed")
			}
			resp = r
		}
		if err := resp.Err(); err != nil {
			if resp.CompactRevision != 0 || errors.Is(err, rpctypes.ErrCompacted) {
				return rev, fmt.Errorf("%w: %v", errCompacted, err)
			}
			return rev, err
		}
		s.contact()
		s.healthy.Store(true)
		if resp.Created {
			continue
		}
		if resp.IsProgressNotify() {
			if h := resp.Header.Revision; h > rev {
				if err := s.fsm.Ingest(uint64(h), nil); err != nil {
					return rev, err
				}
				rev = h
			}
			continue
		}
		// Events of one transaction share a revision; apply them together.
		for i := 0; i < len(resp.Events); {
			r := resp.Events[i].Kv.ModRevision
			if r <= rev {
				// A progress notification ran ahead of queued events
				// (etcd servers before the fix of etcd-io/etcd#15220):
				// the mirror may have answered reads too early. Load it
				// afresh rather than go back.
				return rev, fmt.Errorf("an event of revision %d arrived after the state reached %d", r, rev)
			}
			j := i
			for j < len(resp.Events) && resp.Events[j].Kv.ModRevision == r {
				j++
			}
			if err := s.ingest(r, resp.Events[i:j]); err != nil {
				return rev, err
			}
			rev = r
			i = j
		}
	}
}

// ingest applies the events of one revision to the mirror.
func (s *Store) ingest(rev int64, events []*clientv3.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var (
		changes []fsm.Ingested
		set     = map[string]*entry{}
		gone    = map[string]bool{}
		leaders bool
	)
	for _, ev := range events {
		key := string(ev.Kv.Key)
		if ev.Type == clientv3.EventTypePut {
			if c, ok := s.electionKey(key, ev.Kv.Value, ev.Kv.CreateRevision); ok {
				s.elected[key] = c
				leaders = true
				continue
			}
		} else if _, ok := s.elected[key]; ok {
			delete(s.elected, key)
			leaders = true
			continue
		}
		table := s.lay.table(key)
		if table == "" {
			continue
		}
		old := s.entries[key]
		if cur, ok := set[key]; ok {
			old = cur
		} else if gone[key] {
			old = nil
		}
		var e *entry
		if ev.Type == clientv3.EventTypePut {
			var err error
			e, err = s.newEntry(table, key, ev.Kv.Value, ev.Kv.ModRevision, clientv3.LeaseID(ev.Kv.Lease))
			if err != nil {
				s.logger.Error("etcd key not understood: left out of the state", "key", key, "revision", rev, "error", err)
				e = nil
			}
		}
		keep := map[string]bool{}
		if e != nil {
			for _, pk := range e.pks {
				keep[pk] = true
			}
		}
		if old != nil {
			for i, pk := range old.pks {
				if !keep[pk] {
					changes = append(changes, fsm.Ingested{Table: table, Delete: old.recs[i]})
				}
			}
		}
		if e != nil {
			for _, rec := range e.recs {
				changes = append(changes, fsm.Ingested{Table: table, Record: rec})
			}
			set[key] = e
			delete(gone, key)
		} else {
			delete(set, key)
			gone[key] = true
		}
	}
	if err := s.fsm.Ingest(uint64(rev), changes); err != nil {
		return err
	}
	for key := range gone {
		if old := s.entries[key]; old != nil {
			for _, pk := range old.pks {
				delete(s.byPK, pkKey(old.table, []byte(pk)))
			}
		}
		delete(s.entries, key)
	}
	for key, e := range set {
		if old := s.entries[key]; old != nil {
			for _, pk := range old.pks {
				delete(s.byPK, pkKey(old.table, []byte(pk)))
			}
		}
		s.entries[key] = e
		for _, pk := range e.pks {
			s.byPK[pkKey(e.table, []byte(pk))] = key
		}
	}
	if leaders {
		s.updateLeaderLocked()
	}
	return nil
}

// probe checks etcd every HealthInterval with a linearizable read.
func (s *Store) probe() {
	t := time.NewTicker(s.cfg.HealthInterval)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(s.ctx, min(s.cfg.RequestTimeout, 2*s.cfg.HealthInterval))
		_, err := s.cli.Get(ctx, s.lay.election(), clientv3.WithCountOnly())
		cancel()
		if s.ctx.Err() != nil {
			return
		}
		if err != nil {
			if s.healthy.Load() {
				s.logger.Warn("etcd unreachable", "error", s.explain(err))
			}
			s.fail(s.ctx, err)
			continue
		}
		if !s.healthy.Load() && s.synced.Load() {
			s.logger.Info("etcd reachable again")
		}
		s.contact()
		s.healthy.Store(true)
	}
}

// Status describes the Store's view of etcd.
type Status struct {
	// Healthy: the last request to etcd succeeded.
	Healthy bool
	// Synced: the mirror follows etcd's watch (a reload is not pending).
	Synced bool
	// Revision is the etcd revision the mirror has applied.
	Revision uint64
	// LastContact is when etcd last answered; zero if never.
	LastContact time.Time
	// LastError is the last error talking to etcd.
	LastError string
	// LeaderID is the node ID holding the schedule leadership ("" none).
	LeaderID string
	// IsLeader reports whether this node holds it.
	IsLeader bool
}

// Status returns the current status.
func (s *Store) Status() Status {
	st := Status{
		Healthy:  s.healthy.Load(),
		Synced:   s.synced.Load(),
		Revision: s.fsm.AppliedIndex(),
		IsLeader: s.leader.is(),
	}
	if n := s.lastContact.Load(); n != 0 {
		st.LastContact = time.Unix(0, n)
	}
	if e := s.lastErr.Load(); e != nil {
		st.LastError = *e
	}
	st.LeaderID = s.leader.id()
	return st
}

// Ready reports whether the Store serves current reads and writes: etcd
// answers and the mirror follows it.
func (s *Store) Ready() bool { return s.healthy.Load() && s.synced.Load() }

// ReadIndex returns a revision at least as new as every write etcd
// acknowledged before the call: reads of the mirror once it applied that
// revision (WaitApplied) are linearizable.
func (s *Store) ReadIndex(ctx context.Context) (uint64, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Get(rctx, s.lay.election(), clientv3.WithCountOnly())
	if err != nil {
		s.fail(ctx, err)
		return 0, unavailable(ctx, "read index", err)
	}
	s.contact()
	return uint64(resp.Header.Revision), nil
}

// State returns the mirror's current state.
func (s *Store) State() *fsm.State { return s.fsm.State() }

// AppliedIndex returns the etcd revision the mirror has applied.
func (s *Store) AppliedIndex() uint64 { return s.fsm.AppliedIndex() }

// WaitApplied returns once the mirror has applied revision index. etcd's
// revision also counts writes outside the layout, which the watch does not
// report: while behind, the watch is asked for a progress notification,
// which moves the mirror to the revision etcd is at.
func (s *Store) WaitApplied(ctx context.Context, index uint64) error {
	return s.waitApplied(ctx, index, false)
}

// progressWait is the first wait for the watch after (or, for an own
// write, before) a progress request; it doubles up to half a second.
const progressWait = 20 * time.Millisecond

// waitApplied is WaitApplied; own says index is the revision of a write
// under the layout's root, which the watch delivers by itself: the first
// progress request then waits ownWriteGrace (one per write cost the etcd
// member a request on the watch stream and the agent a goroutine for a
// revision already on its way), so it comes only after progressWait.
func (s *Store) waitApplied(ctx context.Context, index uint64, own bool) error {
	if s.fsm.AppliedIndex() >= index {
		return nil
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.fsm.WaitApplied(wctx, index) }()
	wait := progressWait
	for first := true; ; first = false {
		if !first || !own {
			if err := s.cli.RequestProgress(clientv3.WithRequireLeader(s.ctx)); err != nil && ctx.Err() == nil {
				s.logger.Debug("watch progress request failed", "error", err)
			}
		}
		t := time.NewTimer(wait)
		select {
		case err := <-done:
			t.Stop()
			return err
		case <-s.ctx.Done():
			t.Stop()
			return store.ErrShutdown
		case <-t.C:
			wait = min(2*wait, 500*time.Millisecond)
		}
	}
}
