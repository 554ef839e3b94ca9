// Package conformance is the test suite both state backends must pass: the
// embedded Raft store (store.Store) and the etcd-backed store
// (etcdstore.Store). Each backend's tests build a Harness over a real
// three-node cluster of it (Raft over TCP on 127.0.0.1; three stores on a
// real etcd cluster) and call Run. The suite drives the consumer
// interfaces the gateway and scheduler use: Apply of fsm commands, the
// read index, the local state with its watches, and the leadership.
package conformance

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/store"
)

// Harness is a running cluster of N nodes of one backend. Node indexes
// are 0..N-1; a stopped node is not used again.
type Harness struct {
	N int
	// Write applies cmd the way the agent does when node i receives the
	// request: Raft forwards it to the leader, etcd mode writes from node
	// i. It retries across leader changes.
	Write func(ctx context.Context, i int, cmd []byte) (*fsm.Result, error)
	// ApplyLocal applies cmd on node i itself, without forwarding: the
	// scheduler's path (Raft: only the leader may; etcd: only the holder
	// of the schedule leadership may claim slots).
	ApplyLocal func(ctx context.Context, i int, cmd []byte) (*fsm.Result, error)
	// Sync makes node i's state include every write acknowledged before
	// the call (a linearizable read barrier).
	Sync func(ctx context.Context, i int) error
	// State returns node i's local state.
	State func(i int) *fsm.State
	// Leadership subscribes to node i's leadership changes.
	Leadership func(i int) (<-chan bool, func())
	// IsLeader reports whether node i leads (dispatches schedules).
	IsLeader func(i int) bool
	// Stop stops node i (its process ends; the others go on).
	Stop func(i int)
}

// Run runs the suite. Subtests share the cluster; the last one stops the
// leader.
func Run(t *testing.T, h Harness) {
	t.Run("Registry", func(t *testing.T) { testRegistry(t, h) })
	t.Run("ConfigCAS", func(t *testing.T) { testConfigCAS(t, h) })
	t.Run("ConcurrentCAS", func(t *testing.T) { testConcurrentCAS(t, h) })
	t.Run("Dedupe", func(t *testing.T) { testDedupe(t, h) })
	t.Run("Watches", func(t *testing.T) { testWatches(t, h) })
	t.Run("Placements", func(t *testing.T) { testPlacements(t, h) })
	t.Run("SlotExactlyOnce", func(t *testing.T) { testSlots(t, h) })
	t.Run("LeadershipHandover", func(t *testing.T) { testHandover(t, h) })
}

const timeout = 30 * time.Second

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return c
}

// Encode encodes cmd as a backend's Apply takes it, stamping the time if
// it has none.
func Encode(tb testing.TB, cmd *fsmv1.Command) []byte {
	tb.Helper()
	if cmd.Time == nil {
		cmd.Time = timestamppb.Now()
	}
	b, err := fsm.Encode(cmd)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// Result converts what a backend's Apply returns into its *fsm.Result.
func Result(resp any, err error) (*fsm.Result, error) {
	if err != nil {
		return nil, err
	}
	r, ok := resp.(*fsm.Result)
	if !ok {
		return nil, fmt.Errorf("apply returned %T", resp)
	}
	return r, nil
}

// write applies cmd through node i and fails the test on a transport
// error; the outcome's error is returned.
func write(t *testing.T, h Harness, i int, cmd *fsmv1.Command) *fsm.Result {
	t.Helper()
	res, err := h.Write(ctx(t), i, Encode(t, cmd))
	if err != nil {
		t.Fatalf("write through node %d: %v", i, err)
	}
	return res
}

func synced(t *testing.T, h Harness, i int) *fsm.State {
	t.Helper()
	if err := h.Sync(ctx(t), i); err != nil {
		t.Fatalf("sync node %d: %v", i, err)
	}
	return h.State(i)
}

func register(inst *clusterv1.ServiceInstance) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: inst}}}
}

func setConfig(key, value string, cas *uint64) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: value, CasRevision: cas}}}
}

func ptr(v uint64) *uint64 { return &v }

func testRegistry(t *testing.T, h Harness) {
	inst := &clusterv1.ServiceInstance{
		Service: "pivirtd", InstanceId: "node-1", Node: "n1", Address: "127.0.0.1", Port: 9001,
		Tags: []string{"primary"}, Meta: map[string]string{"rack": "r1"}, Ttl: durationpb.New(time.Minute),
	}
	res := write(t, h, 0, register(inst))
	if res.Err != nil {
		t.Fatalf("register: %v", res.Err)
	}
	got, ok := res.Value.(*clusterv1.ServiceInstance)
	if !ok || got.GetCreateIndex() == 0 || got.GetModifyIndex() != res.Index || got.GetCreateIndex() != res.Index {
		t.Fatalf("register returned %v at index %d: want create and modify index = the write's index", res.Value, res.Index)
	}
	for i := range h.N {
		st := synced(t, h, i)
		s, err := st.Service("pivirtd", "node-1")
		if err != nil || s == nil {
			t.Fatalf("node %d: instance not found (%v)", i, err)
		}
		if s.GetAddress() != "127.0.0.1" || s.GetPort() != 9001 || s.GetMeta()["rack"] != "r1" || s.GetHealth() != clusterv1.Health_HEALTH_PASSING ||
			s.GetCreateIndex() != res.Index || s.GetModifyIndex() != res.Index || s.GetRegisteredAt() == nil {
			t.Fatalf("node %d: instance %v, want the registered one passing at index %d", i, s, res.Index)
		}
		if st.AppliedIndex() < res.Index {
			t.Fatalf("node %d: applied index %d below the write's %d after a sync", i, st.AppliedIndex(), res.Index)
		}
	}

	// A heartbeat through another node moves modify_index only.
	hb := write(t, h, 1, &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: "pivirtd", InstanceId: "node-1"}}})
	if hb.Err != nil {
		t.Fatalf("heartbeat: %v", hb.Err)
	}
	s, _ := synced(t, h, 2).Service("pivirtd", "node-1")
	if s.GetCreateIndex() != res.Index || s.GetModifyIndex() != hb.Index || hb.Index <= res.Index {
		t.Fatalf("after heartbeat at %d: create %d modify %d, want %d and %d", hb.Index, s.GetCreateIndex(), s.GetModifyIndex(), res.Index, hb.Index)
	}

	// A second instance; list in key order.
	second := write(t, h, 2, register(&clusterv1.ServiceInstance{Service: "pivirtd", InstanceId: "node-0", Node: "n0", Address: "127.0.0.2", Port: 9001}))
	if second.Err != nil {
		t.Fatalf("register second: %v", second.Err)
	}
	_, list, err := synced(t, h, 0).Services("pivirtd", nil)
	if err != nil || len(list) != 2 || list[0].GetInstanceId() != "node-0" || list[1].GetInstanceId() != "node-1" {
		t.Fatalf("list: %v (%v), want node-0 and node-1", list, err)
	}

	// Deregister; again is NotFound; a heartbeat of a missing instance too.
	if d := write(t, h, 1, &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{DeregisterService: &fsmv1.DeregisterService{Service: "pivirtd", InstanceId: "node-1"}}}); d.Err != nil {
		t.Fatalf("deregister: %v", d.Err)
	}
	if d := write(t, h, 0, &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{DeregisterService: &fsmv1.DeregisterService{Service: "pivirtd", InstanceId: "node-1"}}}); !errors.Is(d.Err, fsm.ErrNotFound) {
		t.Fatalf("deregister again: %v, want ErrNotFound", d.Err)
	}
	if d := write(t, h, 2, &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: "pivirtd", InstanceId: "node-1"}}}); !errors.Is(d.Err, fsm.ErrNotFound) {
		t.Fatalf("heartbeat of a deregistered instance: %v, want ErrNotFound", d.Err)
	}
	for i := range h.N {
		if s, _ := synced(t, h, i).Service("pivirtd", "node-1"); s != nil {
			t.Fatalf("node %d still has the deregistered instance", i)
		}
	}
	// Invalid input is refused and stores nothing.
	if r := write(t, h, 0, register(&clusterv1.ServiceInstance{Service: "bad\x00name", InstanceId: "x"})); !errors.Is(r.Err, fsm.ErrInvalidCommand) {
		t.Fatalf("register with a NUL in the name: %v, want ErrInvalidCommand", r.Err)
	}
}

func testConfigCAS(t *testing.T, h Harness) {
	first := write(t, h, 0, setConfig("routing.rules", "v1", ptr(0)))
	if first.Err != nil {
		t.Fatalf("create with cas 0: %v", first.Err)
	}
	rev1 := first.Value.(*clusterv1.ConfigEntry).GetRevision()
	if rev1 != first.Index {
		t.Fatalf("revision %d, want the write's index %d", rev1, first.Index)
	}
	if r := write(t, h, 1, setConfig("routing.rules", "v1b", ptr(0))); !errors.Is(r.Err, fsm.ErrCASConflict) {
		t.Fatalf("create again with cas 0: %v, want ErrCASConflict", r.Err)
	}
	if r := write(t, h, 2, setConfig("routing.rules", "v2", ptr(rev1+1000))); !errors.Is(r.Err, fsm.ErrCASConflict) {
		t.Fatalf("set with a wrong cas: %v, want ErrCASConflict", r.Err)
	}
	second := write(t, h, 2, setConfig("routing.rules", "v2", ptr(rev1)))
	if second.Err != nil {
		t.Fatalf("set with the current cas: %v", second.Err)
	}
	rev2 := second.Value.(*clusterv1.ConfigEntry).GetRevision()
	if rev2 <= rev1 {
		t.Fatalf("revision went from %d to %d", rev1, rev2)
	}
	for i := range h.N {
		st := synced(t, h, i)
		e, err := st.ConfigEntry("routing.rules")
		if err != nil || e.GetValue() != "v2" || e.GetRevision() != rev2 || e.GetCreateIndex() != rev1 {
			t.Fatalf("node %d: %v (%v), want v2 at revision %d created at %d", i, e, err, rev2, rev1)
		}
		hist, err := st.ConfigHistory("routing.rules")
		if err != nil || len(hist) != 2 || hist[0].GetValue() != "v2" || hist[1].GetValue() != "v1" ||
			hist[0].GetRevision() != rev2 || hist[1].GetRevision() != rev1 {
			t.Fatalf("node %d: history %v (%v), want v2@%d then v1@%d", i, hist, err, rev2, rev1)
		}
	}
	del := func(cas *uint64) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: "routing.rules", CasRevision: cas}}}
	}
	if r := write(t, h, 0, del(ptr(rev1))); !errors.Is(r.Err, fsm.ErrCASConflict) {
		t.Fatalf("delete with a stale cas: %v, want ErrCASConflict", r.Err)
	}
	if r := write(t, h, 1, del(ptr(rev2))); r.Err != nil {
		t.Fatalf("delete with the current cas: %v", r.Err)
	}
	for i := range h.N {
		st := synced(t, h, i)
		if e, _ := st.ConfigEntry("routing.rules"); e != nil {
			t.Fatalf("node %d: deleted key still there: %v", i, e)
		}
		if hist, _ := st.ConfigHistory("routing.rules"); len(hist) != 0 {
			t.Fatalf("node %d: history of a deleted key: %v", i, hist)
		}
	}
}

// testConcurrentCAS races writers on every node for one revision: exactly
// one wins each round.
func testConcurrentCAS(t *testing.T, h Harness) {
	const rounds, perNode = 5, 3
	r := write(t, h, 0, setConfig("race", "start", nil))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	rev := r.Index
	for round := range rounds {
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			wins []uint64
			errs []error
		)
		for i := range h.N {
			for w := range perNode {
				wg.Go(func() {
					res, err := h.Write(ctx(t), i, Encode(t, setConfig("race", fmt.Sprintf("r%d-n%d-w%d", round, i, w), ptr(rev))))
					mu.Lock()
					defer mu.Unlock()
					switch {
					case err != nil:
						errs = append(errs, err)
					case res.Err == nil:
						wins = append(wins, res.Index)
					case !errors.Is(res.Err, fsm.ErrCASConflict):
						errs = append(errs, res.Err)
					}
				})
			}
		}
		wg.Wait()
		if len(errs) > 0 || len(wins) != 1 {
			t.Fatalf("round %d: %d writers won (%v), errors %v; want exactly one", round, len(wins), wins, errs)
		}
		rev = wins[0]
	}
	for i := range h.N {
		if e, _ := synced(t, h, i).ConfigEntry("race"); e.GetRevision() != rev {
			t.Fatalf("node %d: revision %d, want the last winner's %d", i, e.GetRevision(), rev)
		}
	}
}

// testDedupe retries one write through different nodes: it applies once.
func testDedupe(t *testing.T, h Harness) {
	cmd := setConfig("dedupe", "once", nil)
	cmd.ClientId, cmd.Sequence, cmd.Time = "client-a", 7, timestamppb.Now()
	first := write(t, h, 0, cmd)
	if first.Err != nil || first.Duplicate {
		t.Fatalf("first: %+v", first)
	}
	for i := range h.N {
		again := write(t, h, i, cmd)
		if !again.Duplicate || again.Index != first.Index || again.Err != nil {
			t.Fatalf("retry through node %d: %+v, want a duplicate of index %d", i, again, first.Index)
		}
	}
	if e, _ := synced(t, h, 1).ConfigEntry("dedupe"); e.GetRevision() != first.Index {
		t.Fatalf("revision %d, want %d (applied once)", e.GetRevision(), first.Index)
	}
	// The same identity for another write is refused.
	other := setConfig("dedupe", "twice", nil)
	other.ClientId, other.Sequence, other.Time = "client-a", 7, timestamppb.Now()
	if r := write(t, h, 2, other); !errors.Is(r.Err, fsm.ErrInvalidCommand) {
		t.Fatalf("reused identity: %v, want ErrInvalidCommand", r.Err)
	}

	// A repeat answers with what its write wrote, not with the record as
	// other writers left it since: a registration replaced by another
	// client's, a config key set again.
	reg := register(&clusterv1.ServiceInstance{Service: "dedupe", InstanceId: "i1", Node: "n1", Address: "10.0.0.1", Port: 80})
	reg.ClientId, reg.Sequence, reg.Time = "client-b", 1, timestamppb.Now()
	mine := write(t, h, 0, reg)
	if mine.Err != nil || mine.Value == nil {
		t.Fatalf("register: %+v", mine)
	}
	want := proto.Clone(mine.Value)
	theirs := register(&clusterv1.ServiceInstance{Service: "dedupe", InstanceId: "i1", Node: "n2", Address: "10.0.0.2", Port: 81})
	theirs.ClientId, theirs.Sequence, theirs.Time = "client-c", 1, timestamppb.Now()
	if r := write(t, h, 1, theirs); r.Err != nil {
		t.Fatalf("the other client's register: %v", r.Err)
	}
	set := setConfig("dedupe", "again", nil)
	set.ClientId, set.Sequence, set.Time = "client-c", 2, timestamppb.Now()
	if r := write(t, h, 1, set); r.Err != nil {
		t.Fatalf("set again: %v", r.Err)
	}
	for i := range h.N {
		again := write(t, h, i, reg)
		if !again.Duplicate || again.Index != mine.Index || !proto.Equal(again.Value, want) {
			t.Fatalf("repeated register through node %d: %+v, want index %d and the write's own instance %v", i, again, mine.Index, want)
		}
		cfg := write(t, h, i, cmd)
		if e, ok := cfg.Value.(*clusterv1.ConfigEntry); !ok || e.GetValue() != "once" || e.GetRevision() != first.Index {
			t.Fatalf("repeated set_config through node %d: %+v, want value \"once\" at revision %d", i, cfg.Value, first.Index)
		}
	}
}

// testPlacements: every node records its objects in the placement
// catalog at once; an object moves to the node that reports it; a full
// listing drops only the lister's entries; a listing that changes nothing
// moves no index.
func testPlacements(t *testing.T, h Harness) {
	const vm = "virtualmachines"
	listing := func(node string, full bool, ids ...string) *fsmv1.Command {
		op := &fsmv1.SetPlacements{Node: node}
		if full {
			op.FullKinds = []string{vm}
		}
		for _, id := range ids {
			op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: vm, Id: id})
		}
		return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: op}}
	}
	held := func(i int) []string {
		var ids []string
		for j := range 5 {
			ids = append(ids, fmt.Sprintf("vm-%d-%d", i, j))
		}
		return ids
	}
	var wg sync.WaitGroup
	errs := make([]error, h.N)
	for i := range h.N {
		wg.Go(func() {
			res, err := h.Write(ctx(t), i, Encode(t, listing(fmt.Sprint("node-", i), true, held(i)...)))
			if err == nil {
				err = res.Err
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d's listing: %v", i, err)
		}
	}
	if r := write(t, h, 1, listing("node-1", false, "vm-0-0")); r.Err != nil {
		t.Fatalf("move: %v", r.Err)
	}
	if r := write(t, h, 2, listing("node-0", true, held(0)[1:4]...)); r.Err != nil {
		t.Fatalf("node-0's full listing: %v", r.Err)
	}
	var index uint64
	for i := range h.N {
		st := synced(t, h, i)
		idx, all, err := st.Placements(vm, nil)
		if err != nil || len(all) != 3*5-1 {
			t.Fatalf("node %d: %d placements (%v), want 14", i, len(all), err)
		}
		if p, _ := st.Placement(vm, "vm-0-0"); p.GetNode() != "node-1" {
			t.Fatalf("node %d places the moved VM on %q, want node-1", i, p.GetNode())
		}
		if p, _ := st.Placement(vm, "vm-0-4"); p != nil {
			t.Fatalf("node %d keeps the VM node-0's listing dropped: %v", i, p)
		}
		for n, want := range []int{3, 6, 5} {
			if got, _ := st.PlacementsByNode(fmt.Sprint("node-", n)); len(got) != want {
				t.Fatalf("node %d: node-%d holds %d entries, want %d", i, n, len(got), want)
			}
		}
		if i == 0 {
			index = idx
		}
	}
	if r := write(t, h, 0, listing("node-2", true, held(2)...)); r.Err != nil {
		t.Fatalf("an unchanged listing: %v", r.Err)
	}
	for i := range h.N {
		if idx, _, _ := synced(t, h, i).Placements(vm, nil); idx != index {
			t.Fatalf("node %d: the placements' index moved from %d to %d on an unchanged listing", i, index, idx)
		}
	}
}

// testWatches blocks on node 2's state and writes through node 0.
func testWatches(t *testing.T, h Harness) {
	last := h.N - 1
	st := synced(t, h, last)
	ws := memdb.NewWatchSet()
	before, err := st.WatchTables(ws, fsm.TableServices)
	if err != nil {
		t.Fatal(err)
	}
	cws := memdb.NewWatchSet()
	cbefore, err := st.WatchConfigKey(cws, "watched")
	if err != nil {
		t.Fatal(err)
	}
	fired := make(chan error, 2)
	go func() { fired <- ws.WatchCtx(ctx(t)) }()
	go func() { fired <- cws.WatchCtx(ctx(t)) }()
	r := write(t, h, 0, register(&clusterv1.ServiceInstance{Service: "watched", InstanceId: "a", Node: "n", Address: "127.0.0.1", Port: 1}))
	c := write(t, h, 0, setConfig("watched", "x", nil))
	if r.Err != nil || c.Err != nil {
		t.Fatal(r.Err, c.Err)
	}
	for range 2 {
		select {
		case err := <-fired:
			if err != nil {
				t.Fatalf("watch did not fire: %v", err)
			}
		case <-time.After(timeout):
			t.Fatal("watch did not fire")
		}
	}
	now := synced(t, h, last)
	idx, _ := now.WatchTables(nil, fsm.TableServices)
	cidx, _ := now.WatchConfigKey(nil, "watched")
	if idx <= before || idx < r.Index || cidx <= cbefore || cidx < c.Index {
		t.Fatalf("indexes after the writes: services %d (was %d, write %d), config %d (was %d, write %d)", idx, before, r.Index, cidx, cbefore, c.Index)
	}
}

func leader(t *testing.T, h Harness, skip map[int]bool) int {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		n, at := 0, -1
		for i := range h.N {
			if !skip[i] && h.IsLeader(i) {
				n++
				at = i
			}
		}
		if n == 1 {
			return at
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	t.Fatal("no single leader")
	return -1
}

func claim(id string, slot time.Time) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{ScheduleId: id, Slot: timestamppb.New(slot), Node: "n"}}}
}

func putSchedule(id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: &schedulev1.Schedule{
		Id: id, VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@every 1m", Enabled: true,
	}}}}
}

// testSlots claims one slot from many goroutines on the leader: one wins;
// a node that does not lead cannot claim at all.
func testSlots(t *testing.T, h Harness) {
	if r := write(t, h, 0, putSchedule("s1")); r.Err != nil {
		t.Fatal(r.Err)
	}
	l := leader(t, h, nil)
	if err := h.Sync(ctx(t), l); err != nil {
		t.Fatal(err)
	}
	base := time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)
	for round := range 3 {
		slot := base.Add(time.Duration(round) * time.Minute)
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			won, lst int
			other    []error
		)
		for range 8 {
			wg.Go(func() {
				res, err := h.ApplyLocal(ctx(t), l, Encode(t, claim("s1", slot)))
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					other = append(other, err)
				case res.Err == nil:
					won++
				case errors.Is(res.Err, fsm.ErrSlotNotAfterLast):
					lst++
				default:
					other = append(other, res.Err)
				}
			})
		}
		wg.Wait()
		if won != 1 || len(other) > 0 {
			t.Fatalf("slot %s: %d claims won, %d refused as not after the last, other errors %v; want exactly one", slot, won, lst, other)
		}
	}
	for i := range h.N {
		if i == l {
			continue
		}
		_, err := h.ApplyLocal(ctx(t), i, Encode(t, claim("s1", base.Add(time.Hour))))
		if !errors.Is(err, store.ErrNotLeader) {
			t.Fatalf("claim on node %d, which does not lead: %v, want store.ErrNotLeader", i, err)
		}
	}
	for i := range h.N {
		runs, err := synced(t, h, i).Runs("s1")
		if err != nil || len(runs) != 3 {
			t.Fatalf("node %d: runs %v (%v), want 3", i, runs, err)
		}
		for _, r := range runs {
			if r.GetOutcome() != schedulev1.RunOutcome_RUN_OUTCOME_STARTED || r.GetCreateIndex() == 0 {
				t.Fatalf("node %d: run %v", i, r)
			}
		}
	}
}

// testHandover stops the leader: another node is told it leads, claims the
// next slot, and the state kept every run.
func testHandover(t *testing.T, h Harness) {
	old := leader(t, h, nil)
	subs := map[int]<-chan bool{}
	for i := range h.N {
		if i != old {
			ch, cancel := h.Leadership(i)
			t.Cleanup(cancel)
			subs[i] = ch
		}
	}
	h.Stop(old)
	next := leader(t, h, map[int]bool{old: true})
	select {
	case v := <-subs[next]:
		if !v {
			// The latest value is what counts; wait for true.
			select {
			case v = <-subs[next]:
			case <-time.After(timeout):
			}
		}
		if !v {
			t.Fatalf("node %d leads but was not told", next)
		}
	case <-time.After(timeout):
		t.Fatalf("node %d leads but was not told", next)
	}
	if err := h.Sync(ctx(t), next); err != nil {
		t.Fatal(err)
	}
	slot := time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)
	// The slot claimed before the handover cannot be claimed again.
	res, err := h.ApplyLocal(ctx(t), next, Encode(t, claim("s1", slot.Add(-58*time.Minute))))
	if err != nil || !errors.Is(res.Err, fsm.ErrSlotNotAfterLast) {
		t.Fatalf("claim of an earlier slot after the handover: %v %v, want ErrSlotNotAfterLast", res, err)
	}
	res, err = h.ApplyLocal(ctx(t), next, Encode(t, claim("s1", slot)))
	if err != nil || res.Err != nil {
		t.Fatalf("new leader's claim: %v %v", res, err)
	}
	runs, err := synced(t, h, next).Runs("s1")
	if err != nil || len(runs) != 4 {
		t.Fatalf("runs after the handover: %v (%v), want 4", runs, err)
	}
}
