package etcdstore

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store"
)

// Snapshot streams the mirror's state in the fsm snapshot format, as of
// the returned etcd revision: the same state.bin a Raft snapshot holds, so
// an archive of one mode restores into the other.
func (s *Store) Snapshot(ctx context.Context) (uint64, io.ReadCloser, error) {
	if s.closed.Load() {
		return 0, nil, store.ErrShutdown
	}
	// The state the snapshot holds is at least as new as the call.
	idx, err := s.ReadIndex(ctx)
	if err != nil {
		return 0, nil, err
	}
	if err := s.WaitApplied(ctx, idx); err != nil {
		return 0, nil, unavailable(ctx, "wait for the mirror", err)
	}
	st := s.fsm.State()
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(st.WriteSnapshot(pw))
	}()
	return st.AppliedIndex(), pr, nil
}

// Restore replaces the state kept in etcd with the snapshot read from r
// (state.bin of an archive of either mode), as store.Store.Restore does
// for Raft. The records are written in transactions of at most MaxTxnOps
// operations: keys the snapshot lacks are deleted first, then every key of
// the snapshot is written. Indexes restart from etcd's revisions: a
// record's create and modify index and a config key's revision become the
// revision that restored it; the older versions of a config key keep
// their order below it. Dedupe records are not restored (they only matter
// for a couple of minutes); TTL instances get fresh leases. index and
// size are not needed (the snapshot is read to the end).
func (s *Store) Restore(ctx context.Context, _ uint64, _ int64, r io.Reader) error {
	if s.closed.Load() {
		return store.ErrShutdown
	}
	scratch, err := fsm.New(fsm.DefaultConfig())
	if err != nil {
		return err
	}
	if err := scratch.Restore(io.NopCloser(r)); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	st := scratch.State()
	want := map[string]*put{}
	var order []string
	maxHistory := 0
	history := map[string][]*clusterv1.ConfigEntry{}
	current := map[string]uint64{}
	for _, table := range fsm.Tables() {
		if table == fsm.TableIndex || table == fsm.TableDedupe || table == fsm.TableSessions {
			continue
		}
		recs, err := st.Records(table)
		if err != nil {
			return fmt.Errorf("restore: %w", err)
		}
		for _, rec := range recs {
			rec = proto.Clone(rec)
			switch table {
			case fsm.TableConfigHistory:
				e := rec.(*clusterv1.ConfigEntry)
				history[e.GetKey()] = append(history[e.GetKey()], e)
				maxHistory = max(maxHistory, len(history[e.GetKey()]))
				continue
			case fsm.TableConfig:
				current[rec.(*clusterv1.ConfigEntry).GetKey()] = rec.(*clusterv1.ConfigEntry).GetRevision()
			}
			fsm.ClearIndexFields(rec)
			if err := s.addPut(want, &order, table, rec); err != nil {
				return fmt.Errorf("restore: %w", err)
			}
		}
	}
	// The older versions of a config key get revisions below the one the
	// restore writes, in their order: etcd's revision must be above their
	// count first.
	rev, err := s.ReadIndex(ctx)
	if err != nil {
		return err
	}
	for i := 0; rev <= uint64(maxHistory)+1 && i < maxHistory+2; i++ {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Put(rctx, s.lay.root+dirMeta+"restore", "revision")
		cancel()
		if err != nil {
			return unavailable(ctx, "restore", err)
		}
		rev = uint64(resp.Header.Revision)
	}
	keys := make([]string, 0, len(history))
	for k := range history {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		versions := history[k] // in key order: oldest first
		for i, e := range versions {
			if i == len(versions)-1 && e.GetRevision() == current[k] {
				fsm.ClearIndexFields(e)
			} else {
				e.Revision = rev - uint64(len(versions)) + uint64(i)
				e.CreateIndex = 0
			}
			if err := s.addPut(want, &order, fsm.TableConfigHistory, e); err != nil {
				return fmt.Errorf("restore: %w", err)
			}
		}
	}

	// From here on the writes go on whatever the caller does: a restore
	// stopped half-way would leave a mix of both states.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), restoreTimeout)
	defer cancel()
	release, err := s.markRestoring(ctx)
	if err != nil {
		return err
	}
	defer release()

	// The keys to delete are read from etcd, not from this agent's
	// mirror, which may lag writes made through other agents.
	dels, err := s.stateKeys(ctx)
	if err != nil {
		return err
	}
	dels = slices.DeleteFunc(dels, func(k string) bool {
		_, keep := want[k]
		return keep || s.lay.table(k) == fsm.TableDedupe
	})
	// A config key and its versions go in one transaction, so that the
	// current version's revision is the same in both.
	slices.SortStableFunc(order, func(a, b string) int {
		return compareRestoreKeys(s.lay, a, b)
	})

	var (
		ops       = make([]clientv3.Op, 0, s.cfg.MaxTxnOps)
		opBytes   int
		last      int64
		committed bool
	)
	defer func() {
		if committed {
			// This agent's state is replaced whole, as a Raft restore
			// replaces it: watchers re-list (the others follow the
			// writes). Also after a failure half-way: the state changed.
			if err := s.reload(ctx); err != nil {
				s.logger.Error("restore: reload the state", "error", err)
			}
		}
	}()
	flush := func() error {
		if len(ops) == 0 {
			return nil
		}
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Txn(rctx).If(s.restoringCmp()).Then(ops...).Commit()
		cancel()
		if err != nil {
			return unavailable(ctx, "restore", err)
		}
		if !resp.Succeeded {
			return fmt.Errorf("%w: restore: the restore marker disappeared (another restore?)", store.ErrUnavailable)
		}
		committed = true
		last = resp.Header.Revision
		ops, opBytes = ops[:0], 0
		return nil
	}
	add := func(op clientv3.Op, size int) error {
		if len(ops) > 0 && (len(ops)+1 > s.cfg.MaxTxnOps-1 || opBytes+size > restoreTxnBytes) {
			if err := flush(); err != nil {
				return err
			}
		}
		ops = append(ops, op)
		opBytes += size
		return nil
	}
	for _, key := range dels {
		if err := add(clientv3.OpDelete(key), len(key)); err != nil {
			return err
		}
	}
	if err := flush(); err != nil {
		return err
	}
	for i, key := range order {
		w := want[key]
		var val []byte
		if grouped(w.table) {
			val, _, err = fitGroup(w.table, w.recs)
		} else {
			val, err = encode(w.table, w.recs)
		}
		if err != nil {
			return fmt.Errorf("restore: %w", err)
		}
		// Keep a config key with its history: flush first when the pair
		// would not fit.
		if w.table == fsm.TableConfig && i+1 < len(order) && want[order[i+1]].table == fsm.TableConfigHistory &&
			(len(ops)+2 > s.cfg.MaxTxnOps-1 || opBytes+2*len(val) > restoreTxnBytes) {
			if err := flush(); err != nil {
				return err
			}
		}
		var opts []clientv3.OpOption
		if inst, ok := w.recs[0].(*clusterv1.ServiceInstance); ok && inst.GetTtl().AsDuration() > 0 {
			rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
			lease, err := s.cli.Grant(rctx, int64(math.Ceil(inst.GetTtl().AsDuration().Seconds())))
			cancel()
			if err != nil {
				return unavailable(ctx, "restore: grant a lease", err)
			}
			opts = append(opts, clientv3.WithLease(lease.ID))
		}
		if err := add(clientv3.OpPut(key, string(val), opts...), len(key)+len(val)); err != nil {
			return err
		}
	}
	if err := flush(); err != nil {
		return err
	}
	s.logger.Info("state restored into etcd", "keys", len(order), "deleted", len(dels), "revision", last)
	return nil
}

// Restores write in transactions of at most restoreTxnBytes (and
// MaxTxnOps operations, one of them the marker's compare) and give up
// after restoreTimeout.
const (
	restoreTxnBytes = 1 << 20
	restoreTimeout  = 10 * time.Minute
)

// restoreMarker is the key that exists while a restore writes: the
// schedule leader's claims and run records are fenced by its absence, so
// the dispatcher cannot write between the restore's transactions.
func (s *Store) restoreMarker() string { return s.lay.root + dirMeta + "restoring" }

func (s *Store) restoringCmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.Value(s.restoreMarker()), "=", s.cfg.NodeID)
}

// markRestoring creates the restore marker, held by a lease kept alive
// until release is called (a restore whose agent dies frees the marker
// within restoreMarkerTTL).
func (s *Store) markRestoring(ctx context.Context) (release func(), err error) {
	const restoreMarkerTTL = 15
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	lease, err := s.cli.Grant(rctx, restoreMarkerTTL)
	if err != nil {
		return nil, unavailable(ctx, "restore: grant the marker's lease", err)
	}
	resp, err := s.cli.Txn(rctx).
		If(clientv3.Compare(clientv3.CreateRevision(s.restoreMarker()), "=", 0)).
		Then(clientv3.OpPut(s.restoreMarker(), s.cfg.NodeID, clientv3.WithLease(lease.ID))).
		Commit()
	if err != nil {
		return nil, unavailable(ctx, "restore: write the marker", err)
	}
	if !resp.Succeeded {
		_, _ = s.cli.Revoke(rctx, lease.ID)
		return nil, fmt.Errorf("%w: another restore is in progress (%s exists)", store.ErrUnavailable, s.restoreMarker())
	}
	kctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	ka, err := s.cli.KeepAlive(kctx, lease.ID)
	if err != nil {
		stop()
		return nil, unavailable(ctx, "restore: keep the marker", err)
	}
	go func() {
		for range ka {
		}
	}()
	return func() {
		stop()
		rctx, cancel := context.WithTimeout(context.Background(), s.cfg.RequestTimeout)
		defer cancel()
		_, _ = s.cli.Revoke(rctx, lease.ID)
	}, nil
}

// stateKeys lists every key of the layout's tables, from etcd.
func (s *Store) stateKeys(ctx context.Context) ([]string, error) {
	from := s.lay.watchPrefix()
	end := clientv3.GetPrefixRangeEnd(from)
	var keys []string
	for {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		resp, err := s.cli.Get(rctx, from, clientv3.WithRange(end), clientv3.WithKeysOnly(), clientv3.WithLimit(10000))
		cancel()
		if err != nil {
			return nil, unavailable(ctx, "restore: list the keys", err)
		}
		for _, kv := range resp.Kvs {
			if s.lay.table(string(kv.Key)) != "" {
				keys = append(keys, string(kv.Key))
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return keys, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// addPut adds rec to the key that holds it in want.
func (s *Store) addPut(want map[string]*put, order *[]string, table string, rec proto.Message) error {
	key, err := s.lay.key(table, rec)
	if err != nil {
		return err
	}
	w := want[key]
	if w == nil {
		w = &put{key: key, table: table}
		want[key] = w
		*order = append(*order, key)
	}
	w.recs = append(w.recs, rec)
	return nil
}

// compareRestoreKeys orders keys so that a config key's history follows
// the key itself; other keys keep their order.
func compareRestoreKeys(l layout, a, b string) int {
	rank := func(k string) string {
		switch l.table(k) {
		case fsm.TableConfig:
			return "c" + k[len(l.root+dirConfig):] + "\x00a"
		case fsm.TableConfigHistory:
			return "c" + k[len(l.root+dirHistory):] + "\x00b"
		}
		return ""
	}
	ra, rb := rank(a), rank(b)
	switch {
	case ra == "" && rb == "":
		return 0
	case ra == "":
		return -1
	case rb == "":
		return 1
	}
	if ra < rb {
		return -1
	}
	if ra > rb {
		return 1
	}
	return 0
}
