package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store"
)

// maxAttempts bounds the evaluations of one write that lose their
// compare-and-set to concurrent writes of the same keys.
const maxAttempts = 64

// Apply applies an encoded fsm command (fsm.Encode) and returns its
// *fsm.Result and the etcd revision of its outcome, as store.Store.Apply
// does (DESIGN.md, "Writes"): the command is evaluated on the mirror with
// the FSM's own apply functions, and the records it writes are committed
// in one etcd transaction on the condition that every key it read or
// wrote is unchanged since; on a conflict it is evaluated again. It
// returns once the mirror has applied the write. claim_slot and record_run
// need the schedule leadership and are fenced by it.
func (s *Store) Apply(ctx context.Context, data []byte) (any, uint64, error) {
	if s.closed.Load() {
		return nil, 0, store.ErrShutdown
	}
	cmd, derr := fsm.Decode(data)
	leaderOnly := derr == nil && (cmd.GetClaimSlot() != nil || cmd.GetRecordRun() != nil)
	var readIdx uint64
	for range maxAttempts {
		if ctx.Err() != nil {
			return nil, 0, unavailable(ctx, "apply", ctx.Err())
		}
		s.mu.RLock()
		ev, err := s.fsm.Evaluate(data)
		var p plan
		if err == nil {
			p, err = s.plan(ev)
		}
		s.mu.RUnlock()
		if err != nil {
			return nil, 0, fmt.Errorf("etcdstore: %w", err)
		}
		if len(p.puts) == 0 && len(p.dels) == 0 {
			// Nothing to write: the outcome holds at the mirror's revision,
			// if that is not older than the call.
			if readIdx == 0 {
				if readIdx, err = s.ReadIndex(ctx); err != nil {
					return nil, 0, err
				}
			}
			if ev.Applied >= readIdx {
				res := ev.Result
				if !res.Duplicate {
					res.Index = ev.Applied
				}
				return res, res.Index, nil
			}
			if err := s.WaitApplied(ctx, readIdx); err != nil {
				return nil, 0, unavailable(ctx, "wait for the mirror", err)
			}
			continue
		}
		cmps := p.cmps
		var fenceKey string
		if leaderOnly {
			f, ok := s.fence()
			if !ok {
				return nil, 0, fmt.Errorf("%w: this node does not hold the schedule leadership", store.ErrNotLeader)
			}
			fenceKey = string(f.KeyBytes())
			// Not while a restore writes (restoreMarker).
			cmps = append(cmps, f, clientv3.Compare(clientv3.CreateRevision(s.restoreMarker()), "=", 0))
		}
		// A fenced write goes alone: its fence compares keys other
		// writes of the batch may compare too.
		rev, ok, err := s.commit(ctx, p, cmps, !leaderOnly)
		if errors.Is(err, errTooLarge) {
			// A rejected write: nothing was stored.
			return &fsm.Result{Err: fmt.Errorf("%w: %w", fsm.ErrInvalidCommand, err)}, 0, nil
		}
		if err != nil {
			return nil, 0, err
		}
		if !ok {
			if leaderOnly {
				if !s.stillLeads(ctx, fenceKey) {
					return nil, 0, fmt.Errorf("%w: the schedule leadership moved", store.ErrLeadershipLost)
				}
				if s.restoring(ctx) {
					return nil, 0, fmt.Errorf("%w: a snapshot restore is writing the state; schedules wait for it", store.ErrUnavailable)
				}
			}
			// Another write changed a key this one depends on: evaluate
			// again once the mirror has it.
			if err := s.WaitApplied(ctx, uint64(rev)); err != nil {
				return nil, 0, unavailable(ctx, "wait for the mirror", err)
			}
			continue
		}
		// The revision of this write: the watch delivers it.
		if err := s.waitApplied(ctx, uint64(rev), true); err != nil {
			return nil, 0, unavailable(ctx, "wait for the mirror", err)
		}
		res := ev.Result
		res.Index = uint64(rev)
		if res.Value != nil {
			// The evaluated record is this write's own copy.
			fsm.SetIndexFields(res.Value, fsm.PendingIndex, uint64(rev))
		}
		return res, uint64(rev), nil
	}
	return nil, 0, fmt.Errorf("%w: the write lost to concurrent writes of the same keys %d times", store.ErrUnavailable, maxAttempts)
}

// stillLeads checks with etcd that the election key is still this node's.
func (s *Store) stillLeads(ctx context.Context, key string) bool {
	_, rev, ok := s.leader.token()
	if !ok {
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Get(rctx, key)
	if err != nil || len(resp.Kvs) == 0 {
		return false
	}
	return resp.Kvs[0].CreateRevision == rev
}

// restoring reports whether the restore marker exists.
func (s *Store) restoring(ctx context.Context) bool {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Get(rctx, s.restoreMarker(), clientv3.WithCountOnly())
	return err == nil && resp.Count > 0
}

// plan is the etcd transaction of an evaluated command.
type plan struct {
	keys []string // every key compared: each key read or written
	cmps []clientv3.Cmp
	puts []put
	dels []string
}

// put writes one key.
type put struct {
	key   string
	table string
	recs  []proto.Message
	// lease is the lease to keep (renewed after the write); grant, when
	// positive, asks for a new lease of that many seconds instead; dedupe
	// attaches the dedupe lease.
	lease  clientv3.LeaseID
	grant  int64
	dedupe bool
	// val is the value written.
	val []byte
}

// plan turns an evaluation into compares and operations. mu must be held
// (for reading), so that the key index matches the evaluated state.
func (s *Store) plan(ev fsm.Evaluation) (plan, error) {
	var p plan
	expect := map[string]int64{}
	check := func(key string) {
		if _, ok := expect[key]; ok {
			return
		}
		var mod int64
		if e := s.entries[key]; e != nil {
			mod = e.mod
		}
		expect[key] = mod
	}
	for _, r := range ev.Reads {
		rec, err := fsm.KeyRecord(r.Table, r.Args...)
		if err != nil {
			return plan{}, err
		}
		key, err := s.lay.key(r.Table, rec)
		if err != nil {
			return plan{}, err
		}
		check(key)
	}
	type group struct {
		table   string
		changes []fsm.Change
	}
	groups := map[string]*group{}
	var order []string
	for _, c := range ev.Changes {
		var key string
		if c.Record != nil {
			k, err := s.lay.key(c.Table, c.Record)
			if err != nil {
				return plan{}, err
			}
			key = k
		} else {
			k, ok := s.byPK[pkKey(c.Table, c.Key)]
			if !ok {
				return plan{}, fmt.Errorf("a deleted %s record is not in the mirror", c.Table)
			}
			key = k
		}
		check(key)
		g := groups[key]
		if g == nil {
			g = &group{table: c.Table}
			groups[key] = g
			order = append(order, key)
		}
		g.changes = append(g.changes, c)
	}
	for _, key := range order {
		g := groups[key]
		e := s.entries[key]
		var recs []proto.Message
		if !grouped(g.table) {
			if last := g.changes[len(g.changes)-1]; last.Record != nil {
				recs = []proto.Message{last.Record}
			}
		} else {
			byPK := map[string]proto.Message{}
			if e != nil {
				for i, pk := range e.pks {
					byPK[pk] = e.recs[i]
				}
			}
			for _, c := range g.changes {
				if c.Record != nil {
					byPK[string(c.Key)] = c.Record
				} else {
					delete(byPK, string(c.Key))
				}
			}
			pks := make([]string, 0, len(byPK))
			for pk := range byPK {
				pks = append(pks, pk)
			}
			slices.Sort(pks)
			for _, pk := range pks {
				recs = append(recs, byPK[pk])
			}
		}
		if len(recs) == 0 {
			p.dels = append(p.dels, key)
			continue
		}
		w := put{key: key, table: g.table, recs: recs}
		var err error
		if grouped(g.table) {
			var dropped int
			w.val, dropped, err = fitGroup(g.table, recs)
			if dropped > 0 {
				s.logger.Warn("etcd mode keeps less history for a large key", "key", key, "left_out", dropped, "limit_bytes", maxGroupBytes)
			}
		} else {
			w.val, err = encode(g.table, recs)
		}
		if err != nil {
			return plan{}, err
		}
		switch g.table {
		case fsm.TableServices:
			inst, _ := recs[0].(*clusterv1.ServiceInstance)
			if ttl := inst.GetTtl().AsDuration(); ttl > 0 {
				if e != nil && e.lease != 0 && sameTTL(e.recs[0], inst) {
					w.lease = e.lease
				} else {
					w.grant = int64(math.Ceil(ttl.Seconds()))
				}
			}
		case fsm.TableDedupe:
			w.dedupe = true
		}
		p.puts = append(p.puts, w)
	}
	keys := make([]string, 0, len(expect))
	for k := range expect {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		p.cmps = append(p.cmps, clientv3.Compare(clientv3.ModRevision(k), "=", expect[k]))
	}
	p.keys = keys
	return p, nil
}

func sameTTL(old proto.Message, inst *clusterv1.ServiceInstance) bool {
	o, ok := old.(*clusterv1.ServiceInstance)
	return ok && o.GetTtl().AsDuration() == inst.GetTtl().AsDuration()
}

// errTooLarge: etcd refuses the transaction for its size (its
// --max-request-bytes, 1.5 MiB by default, or --max-txn-ops): the write
// cannot be stored in etcd as it is, however often it is retried.
var errTooLarge = errors.New("the write is larger than etcd accepts")

// commit runs the transaction of p under cmps, batched with concurrent
// writes of this agent when batch is set (batch.go). It returns the
// revision of the write when it succeeded, else (false) a revision to
// catch the mirror up to before evaluating again.
func (s *Store) commit(ctx context.Context, p plan, cmps []clientv3.Cmp, batch bool) (int64, bool, error) {
	// Leases granted here are revoked when the write certainly did not
	// happen; after an answer that was lost they are left to expire, as
	// the write may have committed with them.
	var granted []clientv3.LeaseID
	revoke := func() {
		for _, id := range granted {
			rctx, cancel := context.WithTimeout(context.Background(), s.cfg.RequestTimeout)
			_, _ = s.cli.Revoke(rctx, id)
			cancel()
		}
	}
	again := func() (int64, bool, error) {
		rev, err := s.ReadIndex(ctx)
		if err != nil {
			return 0, false, err
		}
		return int64(rev), false, nil
	}
	ops := make([]clientv3.Op, 0, len(p.puts)+len(p.dels))
	size := 0
	for _, w := range p.puts {
		val := w.val
		size += len(w.key) + len(val)
		lease := w.lease
		switch {
		case w.grant > 0:
			rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
			resp, err := s.cli.Grant(rctx, w.grant)
			cancel()
			if err != nil {
				revoke()
				s.fail(ctx, err)
				return 0, false, unavailable(ctx, "grant a lease", err)
			}
			lease = resp.ID
			granted = append(granted, lease)
		case w.dedupe:
			id, err := s.dedupeLeaseID(ctx)
			if err != nil {
				revoke()
				return 0, false, err
			}
			lease = id
		case lease != 0:
			// A write of an instance is a heartbeat: renew its TTL first,
			// so that the lease cannot run out between the write and the
			// renewal.
			rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
			_, err := s.cli.KeepAliveOnce(rctx, lease)
			cancel()
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				// Expired: the key is gone or going; evaluate again.
				revoke()
				return again()
			}
			if err != nil {
				revoke()
				s.fail(ctx, err)
				return 0, false, unavailable(ctx, "renew a lease", err)
			}
		}
		var opts []clientv3.OpOption
		if lease != 0 {
			opts = append(opts, clientv3.WithLease(lease))
		}
		ops = append(ops, clientv3.OpPut(w.key, string(val), opts...))
	}
	for _, key := range p.dels {
		ops = append(ops, clientv3.OpDelete(key))
		size += len(key)
	}
	var (
		rev       int64
		succeeded bool
		err       error
	)
	if batch {
		rev, succeeded, err = s.txn(ctx, p.keys, cmps, ops, size)
	} else {
		rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		var resp *clientv3.TxnResponse
		resp, err = s.cli.Txn(rctx).If(cmps...).Then(ops...).Commit()
		cancel()
		if err == nil {
			rev, succeeded = resp.Header.Revision, resp.Succeeded
		}
	}
	switch {
	case errors.Is(err, rpctypes.ErrLeaseNotFound):
		// A lease expired between the evaluation and the write (the key
		// it held is gone too, or the dedupe lease ran out).
		revoke()
		s.dropDedupeLease()
		return again()
	case errors.Is(err, rpctypes.ErrRequestTooLarge), errors.Is(err, rpctypes.ErrTooManyOps):
		revoke()
		return 0, false, fmt.Errorf("%w (%v)", errTooLarge, err)
	case err != nil:
		s.fail(ctx, err)
		return 0, false, unavailable(ctx, "commit", err)
	}
	s.contact()
	if !succeeded {
		revoke()
		return rev, false, nil
	}
	return rev, true, nil
}

// dedupeLeaseID returns the lease dedupe records are written with: they
// expire between DedupeWindow and 1.25×DedupeWindow (+1s) after their
// write. One lease serves the writes of a quarter window.
func (s *Store) dedupeLeaseID(ctx context.Context) (clientv3.LeaseID, error) {
	s.dedupeMu.Lock()
	defer s.dedupeMu.Unlock()
	now := time.Now()
	if s.dedupeLease != 0 && now.Before(s.dedupeUntil) {
		return s.dedupeLease, nil
	}
	rotate := max(s.cfg.DedupeWindow/4, time.Second)
	ttl := int64(math.Ceil((s.cfg.DedupeWindow + rotate + time.Second).Seconds()))
	rctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	resp, err := s.cli.Grant(rctx, ttl)
	if err != nil {
		s.fail(ctx, err)
		return 0, unavailable(ctx, "grant the dedupe lease", err)
	}
	s.dedupeLease, s.dedupeUntil = resp.ID, now.Add(rotate)
	return resp.ID, nil
}

func (s *Store) dropDedupeLease() {
	s.dedupeMu.Lock()
	s.dedupeLease = 0
	s.dedupeMu.Unlock()
}
