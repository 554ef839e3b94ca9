package fsm

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/go-memdb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// State is a read-only view of the FSM state: one memdb read transaction,
// consistent for its whole life and unaffected by later applies. It is safe
// for concurrent use and needs no closing.
//
// Records are returned as stored, without copying: callers must never
// modify a returned message (or anything it points to). Clone it with
// proto.Clone first when a modified copy is needed.
//
// Methods that take a memdb.WatchSet add to it (when non-nil) the channels
// that fire when the result may have changed, and the abandon channel that
// fires when a restore replaces the state. The uint64 they return is the
// index of the last change to the queried table (0 if it never changed):
// the index to return to a blocking query.
type State struct {
	txn       *memdb.Txn
	applied   uint64
	abandonCh <-chan struct{}
}

// AppliedIndex is the index of the last log entry applied to this view.
func (s *State) AppliedIndex() uint64 { return s.applied }

// AbandonCh is closed when a restore replaces the state this view was taken
// from.
func (s *State) AbandonCh() <-chan struct{} { return s.abandonCh }

// Index returns the largest index recorded for the given tables: the index
// of the last change to any of them.
func (s *State) Index(tables ...string) uint64 {
	var maxIndex uint64
	for _, table := range tables {
		e, err := first[*indexEntry](s.txn, TableIndex, indexID, table)
		if err == nil && e != nil && e.Value > maxIndex {
			maxIndex = e.Value
		}
	}
	return maxIndex
}

// WatchTables adds to ws a channel per table that fires on any change to
// it (and the abandon channel), and returns their Index. The channel of a
// table that never changed may also fire on changes to other tables; like
// every blocking query, callers re-check the index after a wake-up.
func (s *State) WatchTables(ws memdb.WatchSet, tables ...string) (uint64, error) {
	var maxIndex uint64
	s.watch(ws, nil)
	for _, table := range tables {
		ch, obj, err := s.txn.FirstWatch(TableIndex, indexID, table)
		if err != nil {
			return 0, fmt.Errorf("watch %s: %w", table, err)
		}
		s.watch(ws, ch)
		if e, ok := obj.(*indexEntry); ok && e.Value > maxIndex {
			maxIndex = e.Value
		}
	}
	return maxIndex, nil
}

// WatchService adds to ws a channel that fires when an instance of service
// is registered, changed or removed (and the abandon channel), and returns
// the index of the service's last change as this node knows it: kept after
// its last instance is gone, at least the index of the last restore or
// Restored command (a restored state has no history of what it replaced),
// 1 for a service never seen. It is never below the service's last change
// and never above the applied index, but it is not replicated: two nodes
// may answer differently. Changes to other services move neither. Like
// every blocking query, callers re-check the index after a wake-up.
//
// A row is kept for every service name seen since the last restore (or
// the agent's start) and every service the restored state held, a few
// dozen bytes each.
func (s *State) WatchService(ws memdb.WatchSet, service string) (uint64, error) {
	s.watch(ws, nil)
	var index uint64
	for _, key := range []string{service, serviceIndexBase} {
		ch, obj, err := s.txn.FirstWatch(tableServiceIndex, indexID, key)
		if err != nil {
			return 0, fmt.Errorf("watch service %q: %w", service, err)
		}
		s.watch(ws, ch)
		if e, ok := obj.(*serviceIndexEntry); ok {
			index = max(index, e.Value)
		}
	}
	return max(index, 1), nil
}

// ServiceCounts returns the number of instances of each service in each
// health state (only non-zero counts), sorted by service then health. It
// reads counts kept by every write, one row per (service, health), not the
// instances.
func (s *State) ServiceCounts() []ServiceCount {
	it, err := tget(s.txn, tableServiceCounts, indexID)
	if err != nil {
		return nil
	}
	var out []ServiceCount
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if c, ok := obj.(*ServiceCount); ok {
			out = append(out, *c)
		}
	}
	return out
}

// watch adds ch and the abandon channel to ws, if ws is not nil.
func (s *State) watch(ws memdb.WatchSet, ch <-chan struct{}) {
	if ws == nil {
		return
	}
	ws.Add(s.abandonCh)
	if ch != nil {
		ws.Add(ch)
	}
}

// list runs a Get and collects the records.
func list[T any](s *State, ws memdb.WatchSet, table, index string, args ...any) ([]T, error) {
	it, err := tget(s.txn, table, index, args...)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", table, err)
	}
	s.watch(ws, it.WatchCh())
	return collect[T](it), nil
}

// listReverse runs a GetReverse and collects the records.
func listReverse[T any](s *State, table, index string, args ...any) ([]T, error) {
	it, err := s.txn.GetReverse(table, index, args...)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", table, err)
	}
	return collect[T](it), nil
}

// Services lists the instances of one service, or of all services when
// service is "", sorted by service then instance ID. The watch of one
// service fires on changes to it (WatchService's), not to the others.
func (s *State) Services(service string, ws memdb.WatchSet) (uint64, []*clusterv1.ServiceInstance, error) {
	var (
		out []*clusterv1.ServiceInstance
		err error
	)
	if service == "" {
		out, err = list[*clusterv1.ServiceInstance](s, ws, TableServices, indexID)
	} else {
		// The table is compact: its own channel fires on every change.
		out, err = list[*clusterv1.ServiceInstance](s, nil, TableServices, indexIDPrefix, service)
		if err == nil && ws != nil {
			_, err = s.WatchService(ws, service)
		}
	}
	if err != nil {
		return 0, nil, err
	}
	return s.Index(TableServices), out, nil
}

// ServicesByNode lists the instances registered with the given node,
// sorted by service then instance ID. It scans the services table: a node
// index would cost every registration, on every node, an insert into a
// radix tree whose keys all share a handful of prefixes (a third of the
// apply cost of a registration), for a lookup that only node failure
// handling and operators make.
func (s *State) ServicesByNode(node string, ws memdb.WatchSet) (uint64, []*clusterv1.ServiceInstance, error) {
	all, err := list[*clusterv1.ServiceInstance](s, ws, TableServices, indexID)
	if err != nil {
		return 0, nil, err
	}
	out := slices.DeleteFunc(all, func(in *clusterv1.ServiceInstance) bool { return in.GetNode() != node })
	return s.Index(TableServices), out, nil
}

// ChecksByNode lists the health checks of the instances registered with
// node, sorted by service then instance ID, and adds to ws (when not nil)
// a channel that fires when one of them is added, changed or removed (and
// the abandon channel): heartbeats and writes of instances without a check
// do not fire it (a check change of another node's instance may: a
// neighbour in the radix tree). It reads rows kept per checked instance,
// not every instance.
func (s *State) ChecksByNode(node string, ws memdb.WatchSet) ([]CheckEntry, error) {
	if node == "" {
		// No instance has an empty node (register_service requires one).
		s.watch(ws, nil)
		return nil, nil
	}
	it, err := tget(s.txn, tableServiceChecks, indexIDPrefix, node)
	if err != nil {
		return nil, fmt.Errorf("read the checks of node %q: %w", node, err)
	}
	s.watch(ws, it.WatchCh())
	var out []CheckEntry
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if e, ok := obj.(*CheckEntry); ok {
			out = append(out, *e)
		}
	}
	return out, nil
}

// Service returns one instance, or ErrNotFound.
func (s *State) Service(service, instanceID string) (*clusterv1.ServiceInstance, error) {
	inst, err := first[*clusterv1.ServiceInstance](s.txn, TableServices, indexID, service, instanceID)
	if err != nil {
		return nil, err
	}
	if inst == nil {
		return nil, fmt.Errorf("%w: service %q instance %q", ErrNotFound, service, instanceID)
	}
	return inst, nil
}

// ExpiredTTL returns the passing instances with a positive TTL whose last
// heartbeat plus TTL is before now, sorted by service then instance ID. The
// leader's TTL reaper proposes set_service_health for them.
func (s *State) ExpiredTTL(now time.Time) []*clusterv1.ServiceInstance {
	return s.due(deadlineTTL, now)
}

// CriticalExpired returns the critical instances with a positive
// deregister_critical_after that have been critical for longer than it at
// now, sorted by service then instance ID. The leader's reaper deregisters
// them.
func (s *State) CriticalExpired(now time.Time) []*clusterv1.ServiceInstance {
	return s.due(deadlineCritical, now)
}

// due returns the instances with a deadline of kind before now, sorted by
// service then instance ID. It reads tableServiceDeadlines in time order
// and stops at the first deadline not due, so its cost is the instances
// due, not every instance.
func (s *State) due(kind string, now time.Time) []*clusterv1.ServiceInstance {
	it, err := tget(s.txn, tableServiceDeadlines, indexIDPrefix, kind)
	if err != nil {
		return nil
	}
	var out []*clusterv1.ServiceInstance
	for obj := it.Next(); obj != nil; obj = it.Next() {
		e, ok := obj.(*deadlineEntry)
		if !ok || !e.At.AsTime().Before(now) {
			break
		}
		if inst, err := first[*clusterv1.ServiceInstance](s.txn, TableServices, indexID, e.Service, e.Instance); err == nil && inst != nil {
			out = append(out, inst)
		}
	}
	slices.SortFunc(out, func(a, b *clusterv1.ServiceInstance) int {
		return cmp.Or(cmp.Compare(a.GetService(), b.GetService()), cmp.Compare(a.GetInstanceId(), b.GetInstanceId()))
	})
	return out
}

// ConfigEntry returns the current version of a config key, or ErrNotFound.
func (s *State) ConfigEntry(key string) (*clusterv1.ConfigEntry, error) {
	e, err := first[*clusterv1.ConfigEntry](s.txn, TableConfig, indexID, key)
	if err != nil {
		return nil, err
	}
	if e == nil {
		return nil, fmt.Errorf("%w: config %q", ErrNotFound, key)
	}
	return e, nil
}

// WatchConfigKey adds to ws a channel that fires when the config key
// changes (is set, deleted or created) and the abandon channel, and returns
// the key's index: its revision, or when it does not exist the config
// table's index, which is above every revision the key had (its deletion
// changed the table), so that a watcher of the key sees the deletion.
func (s *State) WatchConfigKey(ws memdb.WatchSet, key string) (uint64, error) {
	ch, obj, err := s.txn.FirstWatch(TableConfig, indexID, key)
	if err != nil {
		return 0, fmt.Errorf("watch config %q: %w", key, err)
	}
	s.watch(ws, ch)
	if e, ok := obj.(*clusterv1.ConfigEntry); ok {
		return e.GetRevision(), nil
	}
	return s.Index(TableConfig), nil
}

// ConfigEntries lists the current version of every config key, sorted by
// key.
func (s *State) ConfigEntries(ws memdb.WatchSet) (uint64, []*clusterv1.ConfigEntry, error) {
	out, err := list[*clusterv1.ConfigEntry](s, ws, TableConfig, indexID)
	if err != nil {
		return 0, nil, err
	}
	return s.Index(TableConfig), out, nil
}

// ConfigHistory returns the kept versions of a key, newest first (the first
// is the current version), or ErrNotFound when the key does not exist.
// Deleting a key deletes its history.
func (s *State) ConfigHistory(key string) ([]*clusterv1.ConfigEntry, error) {
	out, err := listReverse[*clusterv1.ConfigEntry](s, TableConfigHistory, indexIDPrefix, key)
	if err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: config %q", ErrNotFound, key)
	}
	return out, nil
}

// Schedules lists all schedules, sorted by ID.
func (s *State) Schedules(ws memdb.WatchSet) (uint64, []*schedulev1.Schedule, error) {
	out, err := list[*schedulev1.Schedule](s, ws, TableSchedules, indexID)
	if err != nil {
		return 0, nil, err
	}
	return s.Index(TableSchedules), out, nil
}

// SchedulesByVM lists the schedules of one VM, sorted by ID.
func (s *State) SchedulesByVM(vmID string, ws memdb.WatchSet) (uint64, []*schedulev1.Schedule, error) {
	out, err := list[*schedulev1.Schedule](s, ws, TableSchedules, indexVM, vmID)
	if err != nil {
		return 0, nil, err
	}
	return s.Index(TableSchedules), out, nil
}

// Schedule returns one schedule, or ErrNotFound.
func (s *State) Schedule(id string) (*schedulev1.Schedule, error) {
	sc, err := first[*schedulev1.Schedule](s.txn, TableSchedules, indexID, id)
	if err != nil {
		return nil, err
	}
	if sc == nil {
		return nil, fmt.Errorf("%w: schedule %q", ErrNotFound, id)
	}
	return sc, nil
}

// Runs returns the kept runs of a schedule, newest slot first, or
// ErrNotFound when the schedule does not exist.
func (s *State) Runs(scheduleID string) ([]*schedulev1.Run, error) {
	if _, err := s.Schedule(scheduleID); err != nil {
		return nil, err
	}
	return listReverse[*schedulev1.Run](s, TableScheduleRuns, indexIDPrefix, scheduleID)
}

// WatchRuns adds to ws the channels that fire when schedule scheduleID or
// one of its runs changes (is written, claimed, recorded, trimmed or
// deleted) and the abandon channel, and returns the index of the
// schedule's runs: the largest modify index of the schedule and its kept
// runs, or, when the schedule does not exist, the schedules table's index,
// which is above every index the schedule had (its deletion changed the
// table), so that a watcher sees the deletion. Every change to a
// schedule's runs moves it: a claim changes the schedule too, and a
// trim comes with a claim or a change of the schedule. It is built from
// replicated records only, so every node answers the same for the same
// applied state; changes to other schedules and their runs move neither
// the index nor (except where memdb's radix nodes are shared) the
// channels. Like every blocking query, callers re-check the index after a
// wake-up. A restore may move it back, as it may a config key's revision.
func (s *State) WatchRuns(ws memdb.WatchSet, scheduleID string) (uint64, error) {
	ch, obj, err := s.txn.FirstWatch(TableSchedules, indexID, scheduleID)
	if err != nil {
		return 0, fmt.Errorf("watch schedule %q: %w", scheduleID, err)
	}
	s.watch(ws, ch)
	sc, ok := obj.(*schedulev1.Schedule)
	if !ok {
		return s.Index(TableSchedules), nil
	}
	it, err := tget(s.txn, TableScheduleRuns, indexIDPrefix, scheduleID)
	if err != nil {
		return 0, fmt.Errorf("watch runs of schedule %q: %w", scheduleID, err)
	}
	s.watch(ws, it.WatchCh())
	index := sc.GetModifyIndex()
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if r, ok := obj.(*schedulev1.Run); ok {
			index = max(index, r.GetModifyIndex())
		}
	}
	return index, nil
}

// Run returns the run of a schedule at a slot, or ErrNotFound.
func (s *State) Run(scheduleID string, slot time.Time) (*schedulev1.Run, error) {
	r, err := first[*schedulev1.Run](s.txn, TableScheduleRuns, indexID, scheduleID, slot)
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("%w: run of schedule %q at slot %s", ErrNotFound, scheduleID, slot.Format(time.RFC3339Nano))
	}
	return r, nil
}

// ClusterCA returns the cluster CA, or nil when none is installed. It holds
// the CA's private key: never return it to a client.
func (s *State) ClusterCA() (*fsmv1.ClusterCA, error) {
	return first[*fsmv1.ClusterCA](s.txn, TableCA, indexID, clusterCAKey)
}

// Placement returns the placement catalog's entry of an object: the node
// whose backend holds it, or nil when no node reported it.
func (s *State) Placement(kind, id string) (*fsmv1.Placement, error) {
	return first[*fsmv1.Placement](s.txn, TablePlacements, indexID, kind, id)
}

// Placements lists the placement catalog's entries of one kind, or of
// every kind when kind is "", sorted by kind then ID.
func (s *State) Placements(kind string, ws memdb.WatchSet) (uint64, []*fsmv1.Placement, error) {
	var (
		out []*fsmv1.Placement
		err error
	)
	if kind == "" {
		out, err = list[*fsmv1.Placement](s, ws, TablePlacements, indexID)
	} else {
		out, err = list[*fsmv1.Placement](s, ws, TablePlacements, indexIDPrefix, kind)
	}
	if err != nil {
		return 0, nil, err
	}
	return s.Index(TablePlacements), out, nil
}

// PlacementsByNode lists the placement catalog's entries a node holds,
// sorted by kind then ID.
func (s *State) PlacementsByNode(node string) ([]*fsmv1.Placement, error) {
	if node == "" {
		return nil, nil
	}
	return list[*fsmv1.Placement](s, nil, TablePlacements, indexNode, node)
}

// WriteOutcome reports whether the write of a client ID and sequence was
// applied (its client's session, or in etcd mode its dedupe record, keeps
// its outcome) and, if so, its outcome: the Result
// a repeat of it gets (Duplicate set): its index, nil or the error it was
// answered with, and the record it wrote (a config entry without its
// value, which only the repeat carries). A retried write that the leader
// rebuilds from the current state (an update) answers from it instead of
// proposing again.
func (s *State) WriteOutcome(clientID string, sequence uint64) (*Result, error) {
	if clientID == "" {
		return nil, nil
	}
	sess, err := lookupSession(s.txn, clientID)
	if err != nil {
		return nil, err
	}
	if sess != nil {
		if o := sess.find(sequence); o != nil {
			return o.replay(nil), nil
		}
	}
	rec, err := lookupDedupe(s.txn, clientID, sequence)
	if err != nil || rec == nil {
		return nil, err
	}
	return replayResult(rec, nil), nil
}
