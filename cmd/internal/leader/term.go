package leader

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/scheduler"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/etcdstore"
)

// Proposer proposes a command through the node's state backend (Raft, or
// etcd) and returns the FSM's result: the agent's observed Apply.
type Proposer interface {
	Apply(ctx context.Context, cmd []byte) (any, uint64, error)
}

// Config wires the [Work] of a leadership term. Exactly one of Store
// (Raft mode) and Etcd (etcd mode) is set.
type Config struct {
	NodeID string
	Logger *slog.Logger

	// Store is the Raft store (nil in etcd mode).
	Store *store.Store
	// Etcd is the etcd-backed store (nil in Raft mode); its election is
	// the schedule leadership.
	Etcd *etcdstore.Store
	// FSM is the local state: Raft's state machine, or the etcd mirror.
	FSM *fsm.FSM
	// Proposer proposes the leader's commands (TTL expiries, slot claims,
	// the cluster ID).
	Proposer Proposer

	// Reconcile configures the membership reconciler (Raft mode);
	// LeaderLastIndex is filled in. Voters, Members and Peers are its
	// views of Raft, gossip and the other agents.
	Reconcile cluster.ReconcileConfig
	Voters    cluster.VoterManager
	Members   cluster.Membership
	Peers     cluster.PeerStatus

	// TTLInterval is the TTL reaper's scan interval (0: its default).
	TTLInterval time.Duration
	// Snapshots configures automatic snapshot archives (Interval 0: off),
	// taken by TakeSnapshot.
	Snapshots    scheduler.SnapshotterConfig
	TakeSnapshot scheduler.SnapshotTaker
	// Dispatcher configures the power-schedule dispatcher, whose actions
	// Invoke calls.
	Dispatcher scheduler.DispatcherConfig
	Invoke     scheduler.Invoker
	// CA is the cluster CA whose install loop runs while this node leads
	// (Raft mode); nil: none.
	CA *ClusterCA
}

// Work is what a leadership term starts, in either mode: [Work.Start] is
// the [Starter] of the agent's [Loop].
type Work struct {
	cfg Config
	// readyTerm is the Raft term whose leader barrier completed on this
	// node; etcdLeading is set once the etcd schedule leadership is
	// established.
	readyTerm   atomic.Uint64
	etcdLeading atomic.Bool
	// reconciler is the membership reconciler of the current term (Raft
	// mode, on the leader), nil outside one.
	reconciler atomic.Pointer[cluster.Reconciler]
}

// Reconciler is the report of the current term's membership reconciler;
// false when this node runs none (not the leader, or etcd mode).
func (w *Work) Reconciler() (cluster.ReconcileReport, bool) {
	rec := w.reconciler.Load()
	if rec == nil {
		return cluster.ReconcileReport{}, false
	}
	rep := rec.Report()
	return rep, rep.Servers != nil
}

// NewWork returns the term work of cfg.
func NewWork(cfg Config) *Work {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Work{cfg: cfg}
}

// Ready reports whether this node leads and its leader state is established:
// in Raft mode, it leads the current term and the barrier of that term
// completed (its state holds every entry committed before the term); in
// etcd mode, it holds the schedule leadership and caught up with etcd.
func (w *Work) Ready() bool {
	if w.cfg.Etcd != nil {
		return w.cfg.Etcd.IsLeader() && w.etcdLeading.Load()
	}
	return w.cfg.Store.IsLeader() && w.cfg.Store.Term() == w.readyTerm.Load()
}

// IsLeader reports whether this node leads (Raft) or holds the schedule
// leadership (etcd), established or not.
func (w *Work) IsLeader() bool {
	if w.cfg.Etcd != nil {
		return w.cfg.Etcd.IsLeader()
	}
	return w.cfg.Store.IsLeader()
}

// Subscribe returns the leadership notifications of the mode.
func (w *Work) Subscribe() (<-chan bool, func()) {
	if w.cfg.Etcd != nil {
		return w.cfg.Etcd.SubscribeLeadership()
	}
	return w.cfg.Store.SubscribeLeadership()
}

// Revoked marks the leader state gone (a term's work has stopped).
func (w *Work) Revoked() {
	w.readyTerm.Store(0)
	w.etcdLeading.Store(false)
}

// Start establishes leadership and starts the term's work (a [Starter]).
// Raft mode: barrier (retried), then reads may be served as leader
// (Ready), then the membership reconciler, the TTL reaper, the cluster
// CA's install loop and the work of both modes. etcd mode: catch up with
// etcd, then the work of both modes. A leadership change before the term
// is established starts nothing: the next notification starts a new term.
func (w *Work) Start(ctx context.Context, wg *sync.WaitGroup) {
	if w.cfg.Etcd != nil {
		w.startEtcd(ctx, wg)
		return
	}
	s := w.cfg.Store
	termStart := time.Now()
	term := s.Status().Term
	if !retryUntil(ctx, w.cfg.Logger, "leader barrier failed, retrying", s.Barrier) {
		return
	}
	st := s.Status()
	if st.Term != term || st.State != "Leader" {
		// Leadership changed while the barrier ran: a fresh notification
		// starts the next term.
		return
	}
	if w.cfg.FSM.Halted() != nil {
		// This node's state machine stopped (it needs a newer release):
		// it cannot lead. Another voter takes over; the term does nothing.
		wg.Go(func() { w.handOverWhileHalted(ctx) })
		return
	}
	w.completeRestore(ctx)
	// A new cluster (or one whose servers were all upgraded while no
	// leader ran) gets its version before the term serves anything.
	w.versionPass(ctx)
	w.readyTerm.Store(term)
	w.cfg.Logger.Info("leadership established", "term", st.Term, "index", st.AppliedIndex)

	rc := w.cfg.Reconcile
	rc.LeaderLastIndex = func() uint64 { return s.Status().LastIndex }
	rec := cluster.NewReconciler(rc, w.cfg.Voters, w.cfg.Members, w.cfg.Peers)
	w.startCommon(ctx, wg, w.cfg.FSM, termStart)
	wg.Go(func() { w.runClusterVersion(ctx) })
	wg.Go(func() { w.handOverWhileHalted(ctx) }) // a stop during the term
	w.reconciler.Store(rec)
	wg.Go(func() {
		defer w.reconciler.CompareAndSwap(rec, nil)
		rec.Run(ctx)
	})
	if w.cfg.CA != nil {
		wg.Go(func() { w.cfg.CA.installLoop(ctx) })
	}
	wg.Go(func() {
		tcfg := scheduler.DefaultTTLReaperConfig()
		if w.cfg.TTLInterval > 0 {
			tcfg.Interval = w.cfg.TTLInterval
		}
		tcfg.Logger = w.cfg.Logger
		tcfg.TermStart = termStart
		scheduler.RunTTLReaper(ctx, tcfg, w.cfg.FSM, w.cfg.Proposer)
	})
}

// startEtcd is the schedule leader's work in etcd mode, run while this
// agent holds the etcd election: once its mirror has caught up with etcd,
// the dispatcher and the snapshotter (no Raft membership, no TTL reaper:
// etcd leases expire instances).
func (w *Work) startEtcd(ctx context.Context, wg *sync.WaitGroup) {
	e := w.cfg.Etcd
	caughtUp := retryUntil(ctx, w.cfg.Logger, "schedule leader: catching up with etcd failed, retrying", func(ctx context.Context) error {
		idx, err := e.ReadIndex(ctx)
		if err == nil {
			err = e.WaitApplied(ctx, idx)
		}
		return err
	})
	if !caughtUp || !e.IsLeader() {
		return
	}
	w.versionPass(ctx)
	w.etcdLeading.Store(true)
	w.cfg.Logger.Info("schedule leadership established", "revision", e.AppliedIndex())
	wg.Go(func() { w.runClusterVersion(ctx) })
	w.startCommon(ctx, wg, e, time.Now())
}

// startCommon starts the leader's work of both modes: automatic
// snapshots, the cluster-ID check, the schedule dispatcher reading state
// and the reaper of instances critical for longer than their
// deregister_critical_after.
func (w *Work) startCommon(ctx context.Context, wg *sync.WaitGroup, state scheduler.StateReader, termStart time.Time) {
	if sc := w.cfg.Snapshots; sc.Interval > 0 {
		wg.Go(func() { scheduler.RunSnapshotter(ctx, sc, w.cfg.TakeSnapshot) })
	}
	wg.Go(func() { w.ensureClusterID(ctx) })
	wg.Go(func() { scheduler.RunDispatcher(ctx, w.cfg.Dispatcher, state, w.cfg.Proposer, w.cfg.Invoke) })
	wg.Go(func() {
		tcfg := scheduler.DefaultTTLReaperConfig()
		if w.cfg.TTLInterval > 0 {
			tcfg.Interval = w.cfg.TTLInterval
		}
		tcfg.Logger = w.cfg.Logger
		tcfg.TermStart = termStart
		scheduler.RunCriticalReaper(ctx, tcfg, state, w.cfg.Proposer)
	})
}

// completeRestore writes the Restored marker of a snapshot restore whose
// leader stopped between installing the state and committing the marker:
// the state then sits at a Raft index its FSM never reaches (the FSM holds
// the archive's index; no entry follows the restore), so every consistent
// read would wait for it until the next write. The marker moves every
// table's index past the restore, as the restore itself would have.
func (w *Work) completeRestore(ctx context.Context) {
	s := w.cfg.Store
	idx, err := s.ReadIndex(ctx)
	if err != nil || w.cfg.FSM.AppliedIndex() >= idx {
		return
	}
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{
		SnapshotIndex: w.cfg.FSM.AppliedIndex(),
	}}})
	if err != nil {
		w.cfg.Logger.Error("encode restore marker", "error", err)
		return
	}
	w.cfg.Logger.Warn("completing a snapshot restore whose marker was not committed (its leader stopped)",
		"fsm_index", w.cfg.FSM.AppliedIndex(), "raft_index", idx)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := resultErr(w.cfg.Proposer.Apply(ctx, data)); err != nil && ctx.Err() == nil {
		w.cfg.Logger.Warn("could not complete the snapshot restore; the next leader term tries again", "error", err)
	}
}

// ensureClusterID gives the cluster its ID the first time a leader is
// established: a random UUID under gateway.ClusterIDKey, written with
// compare-and-set on "absent" so that two leaders in a row cannot both set
// one. A snapshot restore keeps the cluster's ID.
func (w *Work) ensureClusterID(ctx context.Context) {
	if _, err := w.cfg.FSM.State().ConfigEntry(gateway.ClusterIDKey); err == nil {
		return
	}
	absent := uint64(0)
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{
		Key: gateway.ClusterIDKey, Value: uuid.NewString(), CasRevision: &absent,
	}}})
	if err != nil {
		w.cfg.Logger.Error("encode cluster id", "error", err)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// A conflict: another leader set it first.
	if err := resultErr(w.cfg.Proposer.Apply(ctx, data)); err != nil && !errors.Is(err, fsm.ErrCASConflict) {
		if ctx.Err() == nil {
			w.cfg.Logger.Warn("could not set the cluster id; the next leader term tries again", "error", err)
		}
		return
	}
	id, _ := w.cfg.FSM.State().ConfigEntry(gateway.ClusterIDKey)
	w.cfg.Logger.Info("cluster id set", "cluster_id", id.GetValue())
}

// resultErr is the error of a proposal: the proposal's own, else the
// command's (an *fsm.Result's Err).
func resultErr(resp any, _ uint64, err error) error {
	if err != nil {
		return err
	}
	if res, ok := resp.(*fsm.Result); ok && res.Err != nil {
		return res.Err
	}
	return nil
}

// retryUntil runs f (each attempt bounded to 30 s) until it succeeds,
// every 100 ms, logging each failure as what; false when ctx ended first.
func retryUntil(ctx context.Context, logger *slog.Logger, what string, f func(context.Context) error) bool {
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := f(actx)
		cancel()
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		logger.Warn(what, "error", err, "attempt", attempt)
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return false
		}
	}
}

// sleepCtx waits d; false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool { return waitCtx(ctx, d, nil) }

// waitCtx waits d, or until wake is closed; false when ctx ended first.
func waitCtx(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	case <-wake:
		return true
	}
}

// haltedCheckInterval is how often a leader looks whether its state
// machine stopped, and tries again to hand leadership over while it is.
const haltedCheckInterval = 2 * time.Second

// handOverWhileHalted hands leadership over once this node's state machine
// stopped applying the log (it needs a newer release), trying again every
// haltedCheckInterval until the term ends: a transfer fails while no
// other voter is caught up, and nothing else would end the term (Raft
// itself is healthy).
func (w *Work) handOverWhileHalted(ctx context.Context) {
	t := time.NewTicker(haltedCheckInterval)
	defer t.Stop()
	failed := false
	for {
		if h := w.cfg.FSM.Halted(); h != nil {
			if !failed {
				w.cfg.Logger.Error("this node leads but stopped applying the log; handing leadership over", "error", h.Error())
			}
			_, err := w.cfg.Store.TransferLeadership(ctx, "")
			if err == nil || ctx.Err() != nil {
				return // the leadership change ends the term
			}
			if !failed {
				w.cfg.Logger.Warn("leadership transfer failed; trying again while this node leads", "error", err, "every", haltedCheckInterval)
			}
			failed = true
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
