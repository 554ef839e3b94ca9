package scheduler

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// calls records the actions a dispatcher invoked.
type calls struct {
	mu    sync.Mutex
	list  []string // method vm
	block chan struct{}
	delay time.Duration
	// inflight counts the calls under way, most the largest count seen.
	inflight, most int
}

// invoke is the dispatcher's Invoker: every VM is on node-a.
func (c *calls) invoke(ctx context.Context, method string, req, resp proto.Message) (string, error) {
	return "node-a", c.call(ctx, method, req, resp)
}

func (c *calls) call(ctx context.Context, method string, req, _ proto.Message) error {
	c.mu.Lock()
	c.inflight++
	c.most = max(c.most, c.inflight)
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.inflight--
		c.mu.Unlock()
	}()
	if c.delay > 0 {
		t := time.NewTimer(c.delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
	if c.block != nil {
		select {
		case <-c.block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	id := ""
	switch r := req.(type) {
	case *vmv1.PowerOnRequest:
		id = r.GetId()
	case *vmv1.ShutdownDefaultRequest:
		id = r.GetId()
	case *vmv1.RebootRequest:
		id = r.GetId()
	}
	c.list = append(c.list, method[strings.LastIndexByte(method, '/')+1:]+" "+id)
	return nil
}

func (c *calls) n() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.list)
}

func newLog(t *testing.T) *localLog {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	return &localLog{fsm: f}
}

func (l *localLog) State() *fsm.State { return l.fsm.State() }

// put stores a schedule as the leader would, stamped at "at".
func (l *localLog) put(t *testing.T, s *schedulev1.Schedule, at time.Time) {
	t.Helper()
	l.apply(t, &fsmv1.Command{Time: timestamppb.New(at), Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: s}}})
}

func (l *localLog) apply(t *testing.T, cmd *fsmv1.Command) {
	t.Helper()
	data, err := fsm.Encode(cmd)
	if err != nil {
		t.Fatal(err)
	}
	res, _, _ := l.Apply(context.Background(), data)
	if r := res.(*fsm.Result); r.Err != nil {
		t.Fatal(r.Err)
	}
}

func (l *localLog) runs(t *testing.T, id string) []*schedulev1.Run {
	t.Helper()
	rs, err := l.fsm.State().Runs(id)
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

func outcomes(rs []*schedulev1.Run) map[schedulev1.RunOutcome]int {
	out := map[schedulev1.RunOutcome]int{}
	for _, r := range rs {
		out[r.GetOutcome()]++
	}
	return out
}

// eventually polls f until it returns nil, for up to 15 s.
func eventually(t *testing.T, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(20 * time.Millisecond) // poll, bounded by the deadline
	}
}

func start(t *testing.T, l *localLog, c *calls, cfg DispatcherConfig) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	cfg.NodeID = "node-a"
	go func() { RunDispatcher(ctx, cfg, l, l, c.invoke); close(done) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// TestDispatcherRuns: an @every 1s schedule runs its action once per slot,
// recording each run (ok, attempts, latency, node); a new dispatcher (the
// next leadership term) goes on without running a slot twice.
func TestDispatcherRuns(t *testing.T) {
	l := newLog(t)
	l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@every 1s", Enabled: true}, time.Now())
	c := &calls{}
	stop := start(t, l, c, DispatcherConfig{})
	eventually(t, "three runs", func() error {
		if n := outcomes(l.runs(t, "s1"))[schedulev1.RunOutcome_RUN_OUTCOME_OK]; n < 3 {
			return fmt.Errorf("%d runs ok", n)
		}
		return nil
	})
	stop()
	start(t, l, c, DispatcherConfig{})
	eventually(t, "runs in the next term", func() error {
		if n := outcomes(l.runs(t, "s1"))[schedulev1.RunOutcome_RUN_OUTCOME_OK]; n < 5 {
			return fmt.Errorf("%d runs ok", n)
		}
		return nil
	})
	rs := l.runs(t, "s1")
	seen := map[time.Time]bool{}
	for _, r := range rs {
		if seen[r.GetSlot().AsTime()] {
			t.Errorf("slot %s twice", r.GetSlot().AsTime())
		}
		seen[r.GetSlot().AsTime()] = true
		if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_OK && (r.GetNode() != "node-a" || r.GetAttempts() != 1 || r.GetLatency() == nil) {
			t.Errorf("run %v", r)
		}
	}
	if c.n() < len(rs)-1 || c.list[0] != "PowerOn vm-1" {
		t.Errorf("%d calls for %d runs: %v", c.n(), len(rs), c.list)
	}
}

// TestUpcoming: the coming slots of an "@every" schedule are those of its
// own phase (its anchor's first slot plus whole intervals), each the slot a
// plan at its instant runs; for a 5-field expression they are the
// calendar's.
func TestUpcoming(t *testing.T) {
	every, err := ParseSpec("@every 1m", "")
	if err != nil {
		t.Fatal(err)
	}
	changed := time.Date(2030, 1, 1, 10, 0, 20, 500_000_000, time.UTC)
	s := &schedulev1.Schedule{Cron: "@every 1m", UpdatedAt: timestamppb.New(changed)}
	now := changed.Add(90 * time.Second) // 10:01:50.5: the first slot (10:01:20) is past
	got := Upcoming(every, s, now, 3)
	want := []time.Time{changed.Add(2 * time.Minute).Truncate(time.Second), changed.Add(3 * time.Minute).Truncate(time.Second), changed.Add(4 * time.Minute).Truncate(time.Second)}
	if !slices.EqualFunc(got, want, time.Time.Equal) {
		t.Errorf("Upcoming at %s = %v, want %v (10:02:20 on: the phase of 10:00:20.5)", now, got, want)
	}
	for _, slot := range got {
		if p := PlanSlots(every, slot.Add(-time.Minute), slot, schedulev1.CatchUp_CATCH_UP_SKIP, 0, 0); len(p.Run) != 1 || !p.Run[0].Equal(slot) {
			t.Errorf("a plan at %s after the slot before runs %v, want that slot", slot, p.Run)
		}
	}
	// After a claimed slot, from it; before the anchor (a clock behind),
	// from the anchor.
	s.LastSlot = timestamppb.New(want[0])
	if got := Upcoming(every, s, want[0].Add(10*time.Second), 1); len(got) != 1 || !got[0].Equal(want[1]) {
		t.Errorf("after the claimed slot %s: %v, want %s", want[0], got, want[1])
	}
	if got := Upcoming(every, s, changed, 1); len(got) != 1 || !got[0].Equal(want[1]) {
		t.Errorf("at a time before the claimed slot: %v, want %s", got, want[1])
	}

	daily, err := ParseSpec("30 6 * * *", "Europe/Budapest")
	if err != nil {
		t.Fatal(err)
	}
	got = Upcoming(daily, &schedulev1.Schedule{UpdatedAt: timestamppb.New(changed)}, now, 2)
	if want := []time.Time{time.Date(2030, 1, 2, 5, 30, 0, 0, time.UTC), time.Date(2030, 1, 3, 5, 30, 0, 0, time.UTC)}; !slices.EqualFunc(got, want, time.Time.Equal) {
		t.Errorf("daily: %v, want %v", got, want)
	}
}

// TestDispatcherRunsUpcoming: the slots Upcoming lists before a dispatcher
// starts are the slots it runs.
func TestDispatcherRunsUpcoming(t *testing.T) {
	l := newLog(t)
	// Changed half a second ago: the first slot is 1.5 to 2.5 s ahead,
	// the next 3 s later.
	changed := time.Now().Add(-500 * time.Millisecond)
	l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@every 3s", Enabled: true}, changed)
	sc, err := l.State().Schedule("s1")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := ParseSpec(sc.GetCron(), sc.GetTimeZone())
	if err != nil {
		t.Fatal(err)
	}
	want := Upcoming(spec, sc, time.Now(), 2)
	start(t, l, &calls{}, DispatcherConfig{})
	var ran []time.Time
	eventually(t, "two runs", func() error {
		ran = ran[:0]
		for _, r := range l.runs(t, "s1") {
			if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_OK {
				ran = append(ran, r.GetSlot().AsTime())
			}
		}
		if len(ran) < 2 {
			return fmt.Errorf("%d runs ok", len(ran))
		}
		return nil
	})
	slices.SortFunc(ran, time.Time.Compare)
	if !slices.EqualFunc(ran[:2], want, time.Time.Equal) {
		t.Errorf("ran the slots %v, Upcoming said %v", ran[:2], want)
	}
}

// TestDispatcherCatchUp: slots missed (ten slots of a schedule no leader
// ran) are run or skipped by the schedule's policy, and each
// skipped one is recorded.
func TestDispatcherCatchUp(t *testing.T) {
	for _, tc := range []struct {
		policy         schedulev1.CatchUp
		late           time.Duration // of the newest missed slot
		calls, skipped int
	}{
		{schedulev1.CatchUp_CATCH_UP_SKIP, 90 * time.Second, 0, 10},
		{schedulev1.CatchUp_CATCH_UP_SKIP, 30 * time.Second, 1, 9},
		{schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, 90 * time.Second, 1, 9},
		{schedulev1.CatchUp_CATCH_UP_ALL, 90 * time.Second, 10, 0},
	} {
		t.Run(fmt.Sprintf("%s/%s", tc.policy, tc.late), func(t *testing.T) {
			l := newLog(t)
			// Ten slots, five minutes apart, the newest tc.late ago.
			created := time.Now().Add(-50*time.Minute - tc.late)
			l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 5m", Enabled: true,
				CatchUp: tc.policy, CatchUpWindow: durationpb.New(time.Hour)}, created)
			c := &calls{}
			start(t, l, c, DispatcherConfig{})
			eventually(t, "the catch-up recorded", func() error {
				o := outcomes(l.runs(t, "s1"))
				if o[schedulev1.RunOutcome_RUN_OUTCOME_OK] != tc.calls || o[schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED] != tc.skipped {
					return fmt.Errorf("runs %v, want %d ok and %d skipped", o, tc.calls, tc.skipped)
				}
				return nil
			})
			if c.n() != tc.calls {
				t.Errorf("%d calls, want %d", c.n(), tc.calls)
			}
			for _, r := range l.runs(t, "s1") {
				if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED && r.GetError() != reasonCatchUp {
					t.Errorf("skipped run of %s: error %q, want %q", r.GetSlot().AsTime(), r.GetError(), reasonCatchUp)
				}
			}
			s, _ := l.fsm.State().Schedule("s1")
			if got, want := s.GetLastSlot().AsTime(), created.Add(50*time.Minute).Truncate(time.Second); !got.Equal(want) {
				t.Errorf("last slot %s, want %s", got, want)
			}
		})
	}
}

// TestDispatcherOrphansAndOverlap: a run a lost leader left STARTED is
// recorded as an error of unknown outcome and not repeated; with overlap
// forbid, slots while the previous action runs are skipped.
func TestDispatcherOrphansAndOverlap(t *testing.T) {
	l := newLog(t)
	now := time.Now()
	l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_OFF, Cron: "@every 1s", Enabled: true, Overlap: schedulev1.Overlap_OVERLAP_FORBID}, now)
	l.apply(t, &fsmv1.Command{Time: timestamppb.New(now), Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{ScheduleId: "s1", Slot: timestamppb.New(now.Add(time.Second)), Node: "old-leader"}}})
	c := &calls{block: make(chan struct{})}
	start(t, l, c, DispatcherConfig{})
	var blockedSince time.Time
	eventually(t, "the orphan closed and a run in flight", func() error {
		var orphan, started bool
		for _, r := range l.runs(t, "s1") {
			orphan = orphan || (r.GetNode() == "old-leader" && r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_ERROR && strings.Contains(r.GetError(), "outcome unknown"))
			started = started || (r.GetNode() == "node-a" && r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_STARTED)
		}
		if !orphan || !started {
			return fmt.Errorf("orphan closed %v, run started %v", orphan, started)
		}
		blockedSince = time.Now()
		return nil
	})
	// The action takes over two slots; those are skipped when it ends.
	eventually(t, "two slots pass", func() error {
		if time.Since(blockedSince) < 2500*time.Millisecond {
			return fmt.Errorf("%s", time.Since(blockedSince))
		}
		return nil
	})
	close(c.block)
	eventually(t, "the slots of the long run skipped", func() error {
		n := 0
		for _, r := range l.runs(t, "s1") {
			if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED && r.GetError() == reasonOverlap {
				n++
			}
		}
		if n < 2 {
			return fmt.Errorf("%d slots skipped for the overlap: %v", n, outcomes(l.runs(t, "s1")))
		}
		return nil
	})
	for _, r := range l.runs(t, "s1") {
		if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED && r.GetError() == "" {
			t.Errorf("skipped run of %s names no reason", r.GetSlot().AsTime())
		}
	}
}

// flakyLog fails the nth ClaimSlot proposal (as a Raft timeout would).
type flakyLog struct {
	*localLog
	mu     sync.Mutex
	claims int
	failAt int
}

func (f *flakyLog) Apply(ctx context.Context, data []byte) (any, uint64, error) {
	cmd, err := fsm.Decode(data)
	if err == nil && cmd.GetClaimSlot() != nil {
		f.mu.Lock()
		f.claims++
		n := f.claims
		f.mu.Unlock()
		if n == f.failAt {
			return nil, 0, fmt.Errorf("timed out enqueuing operation")
		}
	}
	return f.localLog.Apply(ctx, data)
}

// contiguous checks that the runs of schedule id are consecutive slots of
// spec from the first after created: none missing, none twice.
func contiguous(t *testing.T, l *localLog, id, expr string, created time.Time) []*schedulev1.Run {
	t.Helper()
	spec, err := ParseSpec(expr, "")
	if err != nil {
		t.Fatal(err)
	}
	rs := l.runs(t, id)
	slices.SortFunc(rs, func(a, b *schedulev1.Run) int { return a.GetSlot().AsTime().Compare(b.GetSlot().AsTime()) })
	want := spec.After(created, created)
	for _, r := range rs {
		if got := r.GetSlot().AsTime(); !got.Equal(want) {
			t.Fatalf("slot %s where %s was due (runs %v)", got, want, outcomes(rs))
		}
		want = spec.After(created, want)
	}
	return rs
}

// TestDispatcherFailedClaim: a claim that fails (Raft timed out) is
// planned again; the slot is not lost.
func TestDispatcherFailedClaim(t *testing.T) {
	l := newLog(t)
	created := time.Now()
	l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@every 1s", Enabled: true}, created)
	f := &flakyLog{localLog: l, failAt: 2}
	c := &calls{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		RunDispatcher(ctx, DispatcherConfig{NodeID: "node-a", RetryAfter: 100 * time.Millisecond}, l, f, c.invoke)
		close(done)
	}()
	defer func() { cancel(); <-done }()
	eventually(t, "five slots recorded", func() error {
		if n := len(l.runs(t, "s1")); n < 5 {
			return fmt.Errorf("%d runs", n)
		}
		return nil
	})
	cancel()
	<-done
	contiguous(t, l, "s1", "@every 1s", created)
}

// TestDispatcherSlowCatchUp: with catch-up all and actions slower than
// the interval, every slot is run or recorded as skipped (overlap), in
// order; none is lost to a later plan overtaking an earlier one.
func TestDispatcherSlowCatchUp(t *testing.T) {
	l := newLog(t)
	created := time.Now().Add(-5 * time.Second)
	l.put(t, &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
		CatchUp: schedulev1.CatchUp_CATCH_UP_ALL, HistoryLimit: 1000}, created)
	c := &calls{delay: 700 * time.Millisecond}
	stop := start(t, l, c, DispatcherConfig{})
	eventually(t, "twelve slots recorded", func() error {
		if n := len(l.runs(t, "s1")); n < 12 {
			return fmt.Errorf("%d runs: %v", n, outcomes(l.runs(t, "s1")))
		}
		return nil
	})
	stop()
	rs := contiguous(t, l, "s1", "@every 1s", created)
	o := outcomes(rs)
	if o[schedulev1.RunOutcome_RUN_OUTCOME_OK] < 5 || o[schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED] == 0 {
		t.Errorf("outcomes %v: want the five missed slots run and later ones skipped while runs were in flight", o)
	}
}

// TestDispatcherPauseStopsAPlan: a pause stops a catch-up plan in flight
// after its current run.
func TestDispatcherPauseStopsAPlan(t *testing.T) {
	l := newLog(t)
	created := time.Now().Add(-20 * time.Second)
	s := &schedulev1.Schedule{Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
		CatchUp: schedulev1.CatchUp_CATCH_UP_ALL, HistoryLimit: 1000}
	l.put(t, s, created)
	c := &calls{delay: 300 * time.Millisecond}
	start(t, l, c, DispatcherConfig{})
	eventually(t, "two runs", func() error {
		if n := outcomes(l.runs(t, "s1"))[schedulev1.RunOutcome_RUN_OUTCOME_OK]; n < 2 {
			return fmt.Errorf("%d runs", n)
		}
		return nil
	})
	paused := proto.CloneOf(s)
	paused.Enabled = false
	l.put(t, paused, time.Now())
	n := c.n()
	eventually(t, "no run after the pause", func() error {
		if c.n() > n+1 {
			return fmt.Errorf("%d calls after the pause", c.n()-n)
		}
		if rs := l.runs(t, "s1"); outcomes(rs)[schedulev1.RunOutcome_RUN_OUTCOME_STARTED] > 0 {
			return fmt.Errorf("a run in flight")
		}
		return nil
	})
	if got := c.n(); got > n+1 || got >= 20 {
		t.Errorf("%d calls, %d after the pause: the plan went on", got, got-n)
	}
}

// TestDispatcherClaimsAhead: slots due together are all claimed without
// waiting for a place among the actions in flight; MaxConcurrent bounds the
// backend calls and MaxClaimed the runs claimed and not finished; when the
// actions return, every claimed run is recorded ok, once.
func TestDispatcherClaimsAhead(t *testing.T) {
	l := newLog(t)
	created := time.Now()
	const n = 6
	for i := range n {
		l.put(t, &schedulev1.Schedule{Id: fmt.Sprintf("s%d", i), VmId: fmt.Sprintf("vm-%d", i), Action: schedulev1.Action_ACTION_REBOOT,
			Cron: "@every 1s", Enabled: true}, created)
	}
	c := &calls{block: make(chan struct{})}
	start(t, l, c, DispatcherConfig{MaxConcurrent: 2, MaxClaimed: 4})
	started := func() int {
		k := 0
		for i := range n {
			k += outcomes(l.runs(t, fmt.Sprintf("s%d", i)))[schedulev1.RunOutcome_RUN_OUTCOME_STARTED]
		}
		return k
	}
	eventually(t, "four runs claimed, two of them calling the backend", func() error {
		c.mu.Lock()
		inflight := c.inflight
		c.mu.Unlock()
		if k := started(); k != 4 || inflight != 2 {
			return fmt.Errorf("%d runs claimed, %d calls in flight", k, inflight)
		}
		return nil
	})
	// While the actions hang, no claim goes past MaxClaimed and no call
	// past MaxConcurrent (observed for half a second, bounded).
	for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if k := started(); k > 4 {
			t.Fatalf("%d runs claimed and not finished, MaxClaimed 4", k)
		}
	}
	close(c.block)
	eventually(t, "every schedule's first slot ran", func() error {
		for i := range n {
			if outcomes(l.runs(t, fmt.Sprintf("s%d", i)))[schedulev1.RunOutcome_RUN_OUTCOME_OK] == 0 {
				return fmt.Errorf("s%d: %v", i, outcomes(l.runs(t, fmt.Sprintf("s%d", i))))
			}
		}
		return nil
	})
	c.mu.Lock()
	most := c.most
	c.mu.Unlock()
	if most > 2 {
		t.Errorf("%d backend calls at once, MaxConcurrent 2", most)
	}
	for i := range n {
		contiguous(t, l, fmt.Sprintf("s%d", i), "@every 1s", created)
	}
}
