package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/scheduler"
)

const rebootMethod = "/pivirt.vm.v1.VMService/Reboot"

// scheduleEnv is a cluster with a simulated pivirtd and a running VM.
type scheduleEnv struct {
	t    *testing.T
	c    *agenttest.Cluster
	sim  *simServer
	vmID string
}

func newScheduleEnv(t *testing.T, nodes int) *scheduleEnv {
	t.Helper()
	s := startSim(t)
	return newScheduleEnvOn(t, s, agenttest.NewExpect(t, nodes, withBackends(s.addr)))
}

// newScheduleEnvOn creates the running VM on c, whose agents route the VM
// API to s.
func newScheduleEnvOn(t *testing.T, s *simServer, c *agenttest.Cluster) *scheduleEnv {
	t.Helper()
	n := c.WaitLeader(60 * time.Second)
	vm := vmv1.NewVMServiceClient(dialPlain(t, n.APIAddr()))
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	r, err := vm.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "scheduled", Vcpus: 1, MemoryMib: 256}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vm.PowerOn(ctx, &vmv1.PowerOnRequest{Id: r.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	return &scheduleEnv{t: t, c: c, sim: s, vmID: r.GetVm().GetId()}
}

func dialPlain(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func (e *scheduleEnv) client(n *agenttest.Node) schedulev1.ScheduleServiceClient {
	return schedulev1.NewScheduleServiceClient(dialPlain(e.t, n.APIAddr()))
}

func (e *scheduleEnv) ctx() context.Context {
	ctx, cancel := context.WithTimeout(e.t.Context(), 20*time.Second)
	e.t.Cleanup(cancel)
	return ctx
}

// settledRuns waits until no run of schedule id is in flight (the
// schedule paused) and returns its runs.
func settledRuns(t *testing.T, ctx context.Context, c schedulev1.ScheduleServiceClient, id string) []*schedulev1.Run {
	t.Helper()
	var runs []*schedulev1.Run
	agenttest.Eventually(t, 15*time.Second, "no run in flight", func() error {
		r, err := c.ListRuns(ctx, &schedulev1.ListRunsRequest{ScheduleId: id})
		if err != nil {
			return err
		}
		runs = r.GetRuns()
		if n := runOutcomes(runs)[schedulev1.RunOutcome_RUN_OUTCOME_STARTED]; n > 0 {
			return fmt.Errorf("%d runs started", n)
		}
		return nil
	})
	return runs
}

func runOutcomes(runs []*schedulev1.Run) map[schedulev1.RunOutcome]int {
	out := map[schedulev1.RunOutcome]int{}
	for _, r := range runs {
		out[r.GetOutcome()]++
	}
	return out
}

// waitRuns waits until schedule id has at least n runs with outcome ok.
func (e *scheduleEnv) waitRuns(c schedulev1.ScheduleServiceClient, id string, n int) []*schedulev1.Run {
	e.t.Helper()
	var runs []*schedulev1.Run
	agenttest.Eventually(e.t, 30*time.Second, fmt.Sprintf("%d runs of %s", n, id), func() error {
		r, err := c.ListRuns(e.ctx(), &schedulev1.ListRunsRequest{ScheduleId: id})
		if err != nil {
			return err
		}
		runs = r.GetRuns()
		if got := runOutcomes(runs)[schedulev1.RunOutcome_RUN_OUTCOME_OK]; got < n {
			return fmt.Errorf("%d ok runs: %v", got, runOutcomes(runs))
		}
		return nil
	})
	return runs
}

// TestSchedules: bad input is refused naming the field and stores
// nothing; a schedule runs its action on the simulated pivirtd once per
// slot and records each run; next slots, pause, resume, update and delete
// behave as documented; the runs metric counts.
func TestSchedules(t *testing.T) {
	e := newScheduleEnv(t, 1)
	n := e.c.Node(0)
	sc := e.client(n)
	valid := func() *schedulev1.Schedule {
		return &schedulev1.Schedule{VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true, HistoryLimit: 1000}
	}
	for field, mod := range map[string]func(*schedulev1.Schedule){
		"schedule.cron":            func(s *schedulev1.Schedule) { s.Cron = "61 * * * *" },
		"schedule.time_zone":       func(s *schedulev1.Schedule) { s.TimeZone = "Mars/Olympus" },
		"schedule.action":          func(s *schedulev1.Schedule) { s.Action = 0 },
		"schedule.vm_id":           func(s *schedulev1.Schedule) { s.VmId = "" },
		"schedule.catch_up_window": func(s *schedulev1.Schedule) { s.CatchUpWindow = durationpb.New(8 * 24 * time.Hour) },
		"schedule.history_limit":   func(s *schedulev1.Schedule) { s.HistoryLimit = 5000 },
	} {
		s := valid()
		mod(s)
		_, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: s})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), field) {
			t.Errorf("a bad %s: %v, want InvalidArgument naming it", field, err)
		}
	}
	if l, err := sc.ListSchedules(e.ctx(), &schedulev1.ListSchedulesRequest{}); err != nil || len(l.GetSchedules()) != 0 {
		t.Fatalf("after refused creates: %v %v, want none stored", l, err)
	}

	s1, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: valid()})
	if err != nil {
		t.Fatal(err)
	}
	clock := valid()
	clock.Id = "clock"
	if _, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: clock}); err != nil {
		t.Fatal(err)
	}
	if _, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: clock}); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the same ID twice: %v, want AlreadyExists", err)
	}
	// A retried write (same client ID and sequence) answers as the first
	// did: one schedule, the same generated ID; a retried pause too.
	w := &clusterv1.WriteOptions{ClientId: "test-client", Sequence: 7}
	first, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@daily"}, Write: w})
	if err != nil {
		t.Fatal(err)
	}
	again, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@daily"}, Write: w})
	if err != nil || again.GetSchedule().GetId() != first.GetSchedule().GetId() {
		t.Errorf("a retried create: %v %v, want schedule %s again", again, err, first.GetSchedule().GetId())
	}
	pw := &clusterv1.WriteOptions{ClientId: "test-client", Sequence: 8}
	for range 2 {
		if _, err := sc.PauseSchedule(e.ctx(), &schedulev1.PauseScheduleRequest{Id: first.GetSchedule().GetId(), Write: pw}); err != nil {
			t.Errorf("a retried pause: %v", err)
		}
	}
	if _, err := sc.DeleteSchedule(e.ctx(), &schedulev1.DeleteScheduleRequest{Id: first.GetSchedule().GetId()}); err != nil {
		t.Fatal(err)
	}
	id := s1.GetSchedule().GetId()
	runs := e.waitRuns(sc, id, 3)
	for _, r := range runs {
		if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_OK && (r.GetNode() != n.NodeID() || r.GetAttempts() != 1 || r.GetLatency() == nil || r.GetFinishedAt() == nil) {
			t.Errorf("run %v", r)
		}
	}
	next, err := sc.NextSlots(e.ctx(), &schedulev1.NextSlotsRequest{Id: id})
	if err != nil || len(next.GetSlots()) != 5 || next.GetTimeZone() != "UTC" {
		t.Fatalf("NextSlots: %v %v", next, err)
	}
	for i := 1; i < 5; i++ {
		if d := next.GetSlots()[i].AsTime().Sub(next.GetSlots()[i-1].AsTime()); d != time.Second {
			t.Errorf("next slots %d s apart", d)
		}
	}

	// Paused: no new slots while the clock schedule goes on.
	p, err := sc.PauseSchedule(e.ctx(), &schedulev1.PauseScheduleRequest{Id: id})
	if err != nil || p.GetSchedule().GetEnabled() {
		t.Fatalf("pause: %v %v", p, err)
	}
	before := len(e.waitRuns(sc, id, 0))
	clockRuns := runOutcomes(e.waitRuns(sc, "clock", 0))[schedulev1.RunOutcome_RUN_OUTCOME_OK]
	e.waitRuns(sc, "clock", clockRuns+3)
	if after := len(e.waitRuns(sc, id, 0)); after > before+1 {
		t.Errorf("a paused schedule ran %d more slots", after-before)
	}
	if _, err := sc.ResumeSchedule(e.ctx(), &schedulev1.ResumeScheduleRequest{Id: id}); err != nil {
		t.Fatal(err)
	}
	e.waitRuns(sc, id, runOutcomes(e.waitRuns(sc, id, 0))[schedulev1.RunOutcome_RUN_OUTCOME_OK]+2)

	// Update through a mask, with the field check of create.
	if _, err := sc.UpdateSchedule(e.ctx(), &schedulev1.UpdateScheduleRequest{Schedule: &schedulev1.Schedule{Id: id, Cron: "0 25 * * *"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"cron"}}}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "schedule.cron") {
		t.Errorf("update to a bad cron: %v", err)
	}
	if _, err := sc.UpdateSchedule(e.ctx(), &schedulev1.UpdateScheduleRequest{Schedule: &schedulev1.Schedule{Id: id, Cron: "0 7 * * 1-5", TimeZone: "Europe/Budapest"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"cron", "time_zone"}}}); err != nil {
		t.Fatal(err)
	}
	next, err = sc.NextSlots(e.ctx(), &schedulev1.NextSlotsRequest{Id: id, Count: 3})
	if err != nil || next.GetTimeZone() != "Europe/Budapest" {
		t.Fatalf("NextSlots after the update: %v %v", next, err)
	}
	bud, _ := time.LoadLocation("Europe/Budapest")
	for _, s := range next.GetSlots() {
		if lt := s.AsTime().In(bud); lt.Hour() != 7 || lt.Minute() != 0 || lt.Weekday() == time.Saturday || lt.Weekday() == time.Sunday {
			t.Errorf("slot %s is not a weekday 07:00 in Budapest", lt)
		}
	}
	// A preview, before a create: the slots of an expression, no schedule.
	prev, err := sc.NextSlots(e.ctx(), &schedulev1.NextSlotsRequest{Cron: "0 7 * * 1-5", TimeZone: "Europe/Budapest", Count: 3})
	if err != nil || len(prev.GetSlots()) != 3 || prev.GetTimeZone() != "Europe/Budapest" || !prev.GetSlots()[0].AsTime().Equal(next.GetSlots()[0].AsTime()) {
		t.Fatalf("NextSlots preview: %v %v, want the schedule's %v", prev, err, next.GetSlots())
	}
	if _, err := sc.NextSlots(e.ctx(), &schedulev1.NextSlotsRequest{Cron: "0 25 * * *"}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "cron") {
		t.Errorf("NextSlots preview of a bad expression: %v, want InvalidArgument naming cron", err)
	}

	// Deleted: gone with its runs.
	if _, err := sc.DeleteSchedule(e.ctx(), &schedulev1.DeleteScheduleRequest{Id: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := sc.ListRuns(e.ctx(), &schedulev1.ListRunsRequest{ScheduleId: id}); status.Code(err) != codes.NotFound {
		t.Errorf("runs of a deleted schedule: %v, want NotFound", err)
	}
	if !strings.Contains(httpGet(t, "http://"+n.MetricsAddr()+"/metrics"), `pivirt_schedule_runs_total{action="reboot",result="ok"}`) {
		t.Error("no pivirt_schedule_runs_total for reboot ok")
	}
}

// TestNextSlotsAreRun: NextSlots of an "@every" schedule lists the slots
// of its phase — its last slot plus whole intervals — however long after
// that slot it is asked, and the dispatcher then runs the first of them.
func TestNextSlotsAreRun(t *testing.T) {
	e := newScheduleEnv(t, 1)
	sc := e.client(e.c.Node(0))
	const every = 5 * time.Second
	s, err := sc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 5s", Enabled: true}})
	if err != nil {
		t.Fatal(err)
	}
	id := s.GetSchedule().GetId()
	e.waitRuns(sc, id, 1)
	last := func() time.Time {
		g, err := sc.GetSchedule(e.ctx(), &schedulev1.GetScheduleRequest{Id: id})
		if err != nil {
			t.Fatal(err)
		}
		return g.GetSchedule().GetLastSlot().AsTime()
	}
	before := last()
	// Ask 1.5 s into the interval, where now plus the interval is not a
	// slot of the schedule's phase (the clock positioned, nothing waited for).
	time.Sleep(time.Until(before.Add(1500 * time.Millisecond)))
	next, err := sc.NextSlots(e.ctx(), &schedulev1.NextSlotsRequest{Id: id, Count: 3})
	if err != nil || len(next.GetSlots()) != 3 {
		t.Fatalf("NextSlots: %v %v", next, err)
	}
	after := last()
	first := next.GetSlots()[0].AsTime()
	if !first.Equal(after.Add(every)) && !first.Equal(after) {
		t.Fatalf("first next slot %s, want %s (the last slot %s plus %s)", first, after.Add(every), after, every)
	}
	for i, sl := range next.GetSlots() {
		if d := sl.AsTime().Sub(before); d <= 0 || d%every != 0 {
			t.Errorf("next slot %d %s is %s after the last slot %s, want whole intervals of %s", i, sl.AsTime(), d, before, every)
		}
	}
	agenttest.Eventually(t, 30*time.Second, "the first next slot run", func() error {
		r, err := sc.ListRuns(e.ctx(), &schedulev1.ListRunsRequest{ScheduleId: id})
		if err != nil {
			return err
		}
		for _, run := range r.GetRuns() {
			if run.GetSlot().AsTime().Equal(first) && run.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_OK {
				return nil
			}
		}
		return fmt.Errorf("no ok run of the slot %s among %d runs", first, len(r.GetRuns()))
	})
}

// TestScheduleLeaderKills: a schedule every second runs on a 3-node
// cluster while the leader is stopped and started again three times: every
// slot from the first to the last is recorded exactly once (run, or
// skipped by policy), never twice, never silently lost, and the backend
// saw one call per run (plus at most one per run whose leader was lost
// mid-action).
func TestScheduleLeaderKills(t *testing.T) {
	if testing.Short() {
		t.Skip("kills leaders; skipped with -short")
	}
	leaderKills(t, newScheduleEnv(t, 3))
}

// leaderKills runs an @every 1s schedule while the leader is stopped and
// restarted three times, and checks that every slot from the first to the
// last was recorded exactly once.
func leaderKills(t *testing.T, e *scheduleEnv) {
	leader := e.c.WaitLeader(30 * time.Second)
	created, err := e.client(e.c.Follower()).CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		Id: "every-second", VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
		CatchUp: schedulev1.CatchUp_CATCH_UP_ALL, HistoryLimit: 1000,
	}})
	if err != nil {
		t.Fatalf("create through a follower: %v", err)
	}
	const id = "every-second"
	okRuns := 0
	for round := range 3 {
		okRuns += 2
		e.waitRuns(e.client(leader), id, okRuns)
		i := e.c.Index(leader)
		e.c.Kill(i)
		leader = e.c.WaitLeader(30 * time.Second)
		e.c.Restart(i, false, leader.GossipAddr())
		t.Logf("round %d: leader %s stopped and restarted; new leader %s", round, e.c.Node(i).Name, leader.Name)
	}
	e.waitRuns(e.client(leader), id, okRuns+2)
	// Settle: stop the schedule so that no run is in flight while
	// counting backend calls.
	if _, err := e.client(leader).PauseSchedule(e.ctx(), &schedulev1.PauseScheduleRequest{Id: id}); err != nil {
		t.Fatal(err)
	}
	runs := settledRuns(t, e.ctx(), e.client(leader), id)
	spec, err := scheduler.ParseSpec("@every 1s", "")
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(runs, func(a, b *schedulev1.Run) int { return a.GetSlot().AsTime().Compare(b.GetSlot().AsTime()) })
	if first, want := runs[0].GetSlot().AsTime(), spec.Next(created.GetSchedule().GetUpdatedAt().AsTime()); !first.Equal(want) {
		t.Errorf("first slot %s, want %s (the first after the schedule was created)", first, want)
	}
	for i := 1; i < len(runs); i++ {
		prev, cur := runs[i-1].GetSlot().AsTime(), runs[i].GetSlot().AsTime()
		if want := spec.Next(prev); !cur.Equal(want) {
			t.Errorf("after slot %s comes %s, want %s: a slot is missing or doubled", prev, cur, want)
		}
	}
	o := runOutcomes(runs)
	unknown := 0
	for _, r := range runs {
		if r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_ERROR && strings.Contains(r.GetError(), "outcome unknown") {
			unknown++
		}
	}
	calls, _ := e.sim.stats(t, rebootMethod)
	ok := o[schedulev1.RunOutcome_RUN_OUTCOME_OK]
	if int(calls) < ok || int(calls) > ok+unknown {
		t.Errorf("%d backend calls for %d ok runs and %d of unknown outcome", calls, ok, unknown)
	}
	t.Logf("%d slots recorded over 3 leader changes: %v (%d of unknown outcome); %d backend calls", len(runs), o, unknown, calls)
}

// TestBlockingListRunsOnAFollower: a blocking ListRuns asked of a
// follower (stale, and default: forwarded to the leader) answers when the
// leader runs the schedule, with the run and a higher index; that index,
// given to another node, waits for the next run there (it compares the same
// on every node).
func TestBlockingListRunsOnAFollower(t *testing.T) {
	e := newScheduleEnv(t, 3)
	leader := e.c.WaitLeader(30 * time.Second)
	follower := e.c.Follower()
	fc, lc := e.client(follower), e.client(leader)
	created, err := lc.CreateSchedule(e.ctx(), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		VmId: e.vmID, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 2s", Enabled: true,
	}})
	if err != nil {
		t.Fatal(err)
	}
	id := created.GetSchedule().GetId()
	first, err := fc.ListRuns(e.ctx(), &schedulev1.ListRunsRequest{ScheduleId: id}) // consistent
	if err != nil {
		t.Fatal(err)
	}
	index := first.GetMeta().GetIndex()
	if index < created.GetSchedule().GetModifyIndex() {
		t.Fatalf("ListRuns on the follower after the create: index %d, want at least %d (the create's)", index, created.GetSchedule().GetModifyIndex())
	}
	// woke checks a blocking query's answer: a run changed after index,
	// and the answer's index is that change's.
	woke := func(c schedulev1.ScheduleServiceClient, mode clusterv1.Consistency, after uint64, node string) uint64 {
		t.Helper()
		var hdr metadata.MD
		resp, err := c.ListRuns(e.ctx(), &schedulev1.ListRunsRequest{ScheduleId: id, Read: &clusterv1.ReadOptions{
			Consistency: mode, WaitIndex: after, WaitTime: durationpb.New(15 * time.Second),
		}}, grpc.Header(&hdr))
		if err != nil {
			t.Fatalf("%s blocking ListRuns on %s: %v", mode, node, err)
		}
		got := resp.GetMeta().GetIndex()
		var newest uint64
		for _, r := range resp.GetRuns() {
			newest = max(newest, r.GetModifyIndex())
		}
		if got <= after || newest != got {
			t.Fatalf("%s blocking ListRuns on %s after %d: index %d, newest run changed at %d; want a run changed after %d at the answer's index (runs %v)",
				mode, node, after, got, newest, after, resp.GetRuns())
		}
		if h := hdr.Get("pivirt-index"); len(h) != 1 || h[0] != strconv.FormatUint(got, 10) {
			t.Errorf("Pivirt-Index %v, want %d as meta.index", h, got)
		}
		return got
	}
	index = woke(fc, clusterv1.Consistency_CONSISTENCY_STALE, index, follower.Name)
	index = woke(fc, clusterv1.Consistency_CONSISTENCY_DEFAULT, index, follower.Name)
	woke(lc, clusterv1.Consistency_CONSISTENCY_CONSISTENT, index, leader.Name)
}
