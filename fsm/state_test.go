package fsm

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-memdb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

func instanceKeys(list []*clusterv1.ServiceInstance) []string {
	var out []string
	for _, in := range list {
		out = append(out, in.GetService()+"/"+in.GetInstanceId())
	}
	return out
}

// fired reports whether a watch set has fired, without waiting.
func fired(ws memdb.WatchSet) bool {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 100 { // WatchCtx picks randomly between ready cases
		if ws.WatchCtx(ctx) == nil {
			return true
		}
	}
	return false
}

// waitFired waits for a watch set to fire, failing the test after a while.
func waitFired(t *testing.T, ws memdb.WatchSet) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := ws.WatchCtx(ctx); err != nil {
		t.Fatalf("watch did not fire: %v", err)
	}
}

func TestServicesOrderAndFilter(t *testing.T) {
	h := newHarness(t)
	for _, k := range [][2]string{{"web", "b"}, {"webapp", "a"}, {"web", "a"}, {"api", "z"}, {"web-x", "a"}} {
		in := instance(k[0], k[1])
		if k[0] == "api" {
			in.Node = "node-9"
		}
		h.mustApply(register(in))
	}
	st := h.f.State()
	idx, all, err := st.Services("", nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"api/z", "web/a", "web/b", "web-x/a", "webapp/a"}; !slices.Equal(instanceKeys(all), want) || idx != 5 {
		t.Errorf("Services(\"\") = %d %v, want 5 %v", idx, instanceKeys(all), want)
	}
	_, web, _ := st.Services("web", nil)
	if want := []string{"web/a", "web/b"}; !slices.Equal(instanceKeys(web), want) {
		t.Errorf("Services(web) = %v, want %v", instanceKeys(web), want)
	}
	_, none, _ := st.Services("we", nil)
	if len(none) != 0 {
		t.Errorf("Services(we) = %v, want none", instanceKeys(none))
	}
	_, byNode, _ := st.ServicesByNode("node-9", nil)
	if want := []string{"api/z"}; !slices.Equal(instanceKeys(byNode), want) {
		t.Errorf("ServicesByNode(node-9) = %v, want %v", instanceKeys(byNode), want)
	}
	if _, err := st.Service("web", "c"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Service(web, c) = %v, want ErrNotFound", err)
	}
}

func TestStateIsASnapshot(t *testing.T) {
	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	st := h.f.State()
	h.mustApply(register(instance("web", "b")))
	h.mustApply(deregister("web", "a"))
	if _, list, _ := st.Services("", nil); !slices.Equal(instanceKeys(list), []string{"web/a"}) {
		t.Errorf("old view = %v, want [web/a]", instanceKeys(list))
	}
	if st.AppliedIndex() != 1 {
		t.Errorf("old view AppliedIndex = %d, want 1", st.AppliedIndex())
	}
	if _, list, _ := h.f.State().Services("", nil); !slices.Equal(instanceKeys(list), []string{"web/b"}) {
		t.Errorf("new view = %v, want [web/b]", instanceKeys(list))
	}
}

func TestWatches(t *testing.T) {
	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	h.mustApply(setConfig("k", "v"))

	st := h.f.State()
	wsWeb, wsConfig := memdb.NewWatchSet(), memdb.NewWatchSet()
	if _, _, err := st.Services("web", wsWeb); err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.ConfigEntries(wsConfig); err != nil {
		t.Fatal(err)
	}

	h.mustApply(register(instance("api", "a")))
	if fired(wsWeb) || fired(wsConfig) {
		t.Fatalf("watches fired on an unrelated change: web %v, config %v", fired(wsWeb), fired(wsConfig))
	}
	h.mustApply(register(instance("web", "b")))
	waitFired(t, wsWeb)
	if fired(wsConfig) {
		t.Errorf("config watch fired on a service change")
	}
	h.mustApply(setConfig("k", "v2"))
	waitFired(t, wsConfig)

	// A table that never changed may wake its watchers spuriously; one that
	// changed wakes them only on its own change.
	wsTables := memdb.NewWatchSet()
	idx, err := h.f.State().WatchTables(wsTables, TableConfig)
	if err != nil || idx != 5 {
		t.Fatalf("WatchTables = %d, %v; want 5", idx, err)
	}
	h.mustApply(register(instance("web", "c")))
	if fired(wsTables) {
		t.Errorf("config table watch fired on a service change")
	}
	h.mustApply(deleteConfig("k"))
	waitFired(t, wsTables)

	if idx, _ := h.f.State().WatchTables(nil, TableSchedules, TableServices); idx != 6 {
		t.Errorf("WatchTables index = %d, want 6", idx)
	}
}

func TestRestoreWakesWatchers(t *testing.T) {
	src := newHarness(t)
	populate(src)
	snap := src.snapshot()

	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	st := h.f.State()
	ws := memdb.NewWatchSet()
	if _, _, err := st.Schedules(ws); err != nil {
		t.Fatal(err)
	}
	abandon := h.f.AbandonCh()
	if err := h.f.Restore(readCloser(snap)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	waitFired(t, ws)
	select {
	case <-abandon:
	default:
		t.Errorf("FSM.AbandonCh not closed by Restore")
	}
	select {
	case <-h.f.AbandonCh():
		t.Errorf("new AbandonCh already closed")
	case <-h.f.State().AbandonCh():
		t.Errorf("new State().AbandonCh already closed")
	default:
	}
	if got, want := h.f.AppliedIndex(), src.f.AppliedIndex(); got != want {
		t.Errorf("AppliedIndex after restore = %d, want %d", got, want)
	}
}

func TestExpiredTTL(t *testing.T) {
	h := newHarness(t)
	h.now = t0.Add(time.Second)
	h.mustApply(registerTTL("web", "a", 10*time.Second)) // expires at(11)
	h.mustApply(registerTTL("web", "b", 30*time.Second)) // expires at(31)
	h.mustApply(register(instance("web", "c")))          // no TTL
	h.mustApply(registerTTL("web", "d", 0))              // zero TTL: none
	h.mustApply(registerTTL("api", "e", 5*time.Second))  // expires at(6) but critical
	h.mustApply(setHealth("api", "e", clusterv1.Health_HEALTH_CRITICAL, at(1)))
	h.now = t0.Add(5 * time.Second)
	h.mustApply(heartbeat("web", "b")) // expires at(35)

	tests := []struct {
		now  time.Time
		want []string
	}{
		{t0.Add(11 * time.Second), nil},
		{t0.Add(11*time.Second + 1), []string{"web/a"}},
		// b's first deadline (31) went with its heartbeat.
		{t0.Add(33 * time.Second), []string{"web/a"}},
		{t0.Add(36 * time.Second), []string{"web/a", "web/b"}},
	}
	// The same answers from a state restored from a snapshot (the
	// deadline index is built on restore).
	restored := newHarness(t)
	if err := restored.f.Restore(readCloser(h.snapshot())); err != nil {
		t.Fatal(err)
	}
	for name, st := range map[string]*State{"applied": h.f.State(), "restored": restored.f.State()} {
		for _, tt := range tests {
			if got := instanceKeys(st.ExpiredTTL(tt.now)); !slices.Equal(got, tt.want) {
				t.Errorf("%s: ExpiredTTL(%s) = %v, want %v", name, tt.now.Sub(t0), got, tt.want)
			}
		}
	}
	// An instance that turns critical, or goes, leaves the index.
	h.mustApply(setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)))
	if got := instanceKeys(h.f.State().ExpiredTTL(t0.Add(36 * time.Second))); !slices.Equal(got, []string{"web/b"}) {
		t.Errorf("ExpiredTTL after web/a turned critical = %v, want [web/b]", got)
	}
}

func TestScheduleQueries(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"s3", "s1", "s2"} {
		s := schedule(id)
		if id != "s2" {
			s.VmId = "vm-x"
		}
		h.mustApply(putSchedule(s))
	}
	st := h.f.State()
	ids := func(list []*schedulev1.Schedule) []string {
		var out []string
		for _, s := range list {
			out = append(out, s.GetId())
		}
		return out
	}
	idx, all, err := st.Schedules(nil)
	if err != nil || idx != 3 || !slices.Equal(ids(all), []string{"s1", "s2", "s3"}) {
		t.Errorf("Schedules = %d %v %v, want 3 [s1 s2 s3]", idx, ids(all), err)
	}
	_, byVM, _ := st.SchedulesByVM("vm-x", nil)
	if !slices.Equal(ids(byVM), []string{"s1", "s3"}) {
		t.Errorf("SchedulesByVM(vm-x) = %v, want [s1 s3]", ids(byVM))
	}
	if runs, err := st.Runs("s1"); err != nil || len(runs) != 0 {
		t.Errorf("Runs(s1) = %v, %v; want none", runs, err)
	}
	if _, err := st.Schedule("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Schedule(nope) = %v, want ErrNotFound", err)
	}
	if _, err := st.Run("s1", t0); !errors.Is(err, ErrNotFound) {
		t.Errorf("Run = %v, want ErrNotFound", err)
	}
	if _, err := st.ConfigEntry("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("ConfigEntry(nope) = %v, want ErrNotFound", err)
	}
}

// TestConcurrentReaders runs readers while commands are applied and a
// snapshot is restored; the race detector checks the locking.
func TestConcurrentReaders(t *testing.T) {
	src := newHarness(t)
	populate(src)
	snap := src.snapshot()

	h := newHarness(t)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				st := h.f.State()
				_, list, err := st.Services("", nil)
				if err != nil {
					t.Error(err)
					return
				}
				for _, in := range list {
					_ = in.GetAddress()
				}
				_ = h.f.AppliedIndex()
			}
		})
	}
	for i := range 200 {
		h.mustApply(register(instance("web", string(rune('a'+i%26)))))
		if i == 100 {
			if err := h.f.Restore(readCloser(snap)); err != nil {
				t.Error(err)
			}
			h.index = h.f.AppliedIndex()
		}
	}
	close(stop)
	wg.Wait()
}

func TestWatchConfigKey(t *testing.T) {
	h := newHarness(t)
	ws := memdb.NewWatchSet()
	rev, err := h.f.State().WatchConfigKey(ws, "k")
	if err != nil || rev != 0 {
		t.Fatalf("missing key in an empty table: index %d, %v", rev, err)
	}
	h.mustApply(setConfig("other", "v"))
	// Another key's change may or may not fire the channel (memdb watches
	// radix nodes); the revision of "k" is what a caller re-checks.
	h.mustApply(setConfig("k", "v1"))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ws.WatchCtx(ctx); err != nil {
		t.Fatalf("creating the key did not fire the watch: %v", err)
	}
	ws = memdb.NewWatchSet()
	rev, err = h.f.State().WatchConfigKey(ws, "k")
	if err != nil || rev == 0 {
		t.Fatalf("existing key: revision %d, %v", rev, err)
	}
	h.mustApply(setConfig("k", "v2"))
	if err := ws.WatchCtx(ctx); err != nil {
		t.Fatalf("updating the key did not fire the watch: %v", err)
	}
	rev2, _ := h.f.State().WatchConfigKey(nil, "k")
	if rev2 <= rev {
		t.Fatalf("revision after update %d, want > %d", rev2, rev)
	}
	// A deletion fires the watch and moves the index above every revision.
	ws = memdb.NewWatchSet()
	_, _ = h.f.State().WatchConfigKey(ws, "k")
	h.mustApply(deleteConfig("k"))
	if err := ws.WatchCtx(ctx); err != nil {
		t.Fatalf("deleting the key did not fire the watch: %v", err)
	}
	if got, _ := h.f.State().WatchConfigKey(nil, "k"); got <= rev2 {
		t.Fatalf("index of the deleted key %d, want > %d (its last revision)", got, rev2)
	}
}

// A service's index moves with its own instances only, stays after its
// last instance is gone, and is at least the index of the last restore or
// Restored command.
func TestWatchService(t *testing.T) {
	h := newHarness(t)
	index := func(service string) uint64 {
		t.Helper()
		idx, err := h.f.State().WatchService(nil, service)
		if err != nil {
			t.Fatal(err)
		}
		return idx
	}
	h.mustApply(register(instance("web", "a"))) // 1
	h.mustApply(register(instance("api", "a"))) // 2
	if got := index("web"); got != 1 {
		t.Errorf("web index = %d, want 1", got)
	}
	if got := index("db"); got != 1 {
		t.Errorf("index of a service never registered = %d, want 1", got)
	}

	ws := memdb.NewWatchSet()
	if _, err := h.f.State().WatchService(ws, "web"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(setConfig("k", "v"))            // 3
	h.mustApply(register(instance("api", "b"))) // 4
	if got := index("web"); got != 1 {
		t.Errorf("web index after changes to api and config = %d, want 1", got)
	}
	h.mustApply(heartbeat("web", "a")) // 5
	waitFired(t, ws)
	if got := index("web"); got != 5 {
		t.Errorf("web index after a heartbeat = %d, want 5", got)
	}

	ws = memdb.NewWatchSet()
	if _, err := h.f.State().WatchService(ws, "web"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(deregister("web", "a")) // 6: the last instance
	waitFired(t, ws)
	if got := index("web"); got != 6 {
		t.Errorf("web index after its last instance left = %d, want 6", got)
	}
	if got := index("api"); got != 4 {
		t.Errorf("api index = %d, want 4", got)
	}
	// A failed write changes no index.
	if res := h.apply(deregister("web", "a")); res.Err == nil {
		t.Fatal("deregistering a missing instance succeeded")
	}
	if got := index("web"); got != 6 {
		t.Errorf("web index after a failed write = %d, want 6", got)
	}

	// Restored moves every service, listed or not.
	restored := h.mustApply(&fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{SnapshotId: "s", SnapshotIndex: 1}}}).Index
	for _, svc := range []string{"web", "api", "db"} {
		if got := index(svc); got != restored {
			t.Errorf("%s index after Restored = %d, want %d", svc, got, restored)
		}
	}

	// A restore starts every service at the restored index; the derived
	// table is not in snapshots.
	snap := h.snapshot()
	h2 := newHarness(t)
	if err := h2.f.Restore(readCloser(snap)); err != nil {
		t.Fatal(err)
	}
	for _, svc := range []string{"web", "api", "db"} {
		if got, _ := h2.f.State().WatchService(nil, svc); got != h.f.AppliedIndex() {
			t.Errorf("%s index after a restore = %d, want %d", svc, got, h.f.AppliedIndex())
		}
	}
	if !bytes.Equal(h2.snapshot(), snap) {
		t.Error("the restored state snapshots differently")
	}
}

// The index of a schedule's runs moves with that schedule and its runs
// only: a claim, a recorded outcome, a change of the schedule; its
// deletion moves it above every index the schedule had. Another
// schedule's runs move neither the index nor, where the radix tree keeps
// them apart, the channel.
func TestWatchRuns(t *testing.T) {
	h := newHarness(t)
	index := func(id string) uint64 {
		t.Helper()
		idx, err := h.f.State().WatchRuns(nil, id)
		if err != nil {
			t.Fatal(err)
		}
		return idx
	}
	h.mustApply(putSchedule(schedule("s1")))             // 1
	h.mustApply(putSchedule(schedule("other-schedule"))) // 2
	if got := index("s1"); got != 1 {
		t.Errorf("s1 index = %d, want 1 (its creation)", got)
	}

	ws := memdb.NewWatchSet()
	if _, err := h.f.State().WatchRuns(ws, "s1"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(claim("other-schedule", at(100))) // 3
	h.mustApply(setConfig("k", "v"))              // 4
	if got := index("s1"); got != 1 {
		t.Errorf("s1 index after another schedule's run = %d, want 1", got)
	}
	h.mustApply(claim("s1", at(100))) // 5
	waitFired(t, ws)
	if got := index("s1"); got != 5 {
		t.Errorf("s1 index after its claim = %d, want 5", got)
	}

	// A recorded outcome changes the run only.
	ws = memdb.NewWatchSet()
	if _, err := h.f.State().WatchRuns(ws, "s1"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(recordRun(&schedulev1.Run{ScheduleId: "s1", Slot: at(100), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK})) // 6
	waitFired(t, ws)
	if got := index("s1"); got != 6 {
		t.Errorf("s1 index after a recorded run = %d, want 6", got)
	}
	if got := index("other-schedule"); got != 3 {
		t.Errorf("other-schedule index = %d, want 3", got)
	}

	// Deleted: the index goes above every index the schedule had.
	ws = memdb.NewWatchSet()
	if _, err := h.f.State().WatchRuns(ws, "s1"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(deleteSchedule("s1")) // 7
	waitFired(t, ws)
	if got := index("s1"); got != 7 {
		t.Errorf("index of the deleted s1 = %d, want 7 (the schedules table's)", got)
	}
	if got := index("never"); got != 7 {
		t.Errorf("index of a schedule never created = %d, want 7 (the schedules table's)", got)
	}
	// Created again: the watch of the missing schedule fires.
	ws = memdb.NewWatchSet()
	if _, err := h.f.State().WatchRuns(ws, "s1"); err != nil {
		t.Fatal(err)
	}
	h.mustApply(putSchedule(schedule("s1"))) // 8
	waitFired(t, ws)
	if got := index("s1"); got != 8 {
		t.Errorf("s1 index after it was created again = %d, want 8", got)
	}
}
