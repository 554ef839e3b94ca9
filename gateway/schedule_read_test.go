package gateway

import (
	"context"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// Tests of the schedule reads' ReadOptions: consistency modes and
// blocking queries.

// scheduleLeader is the ScheduleService of a single leader ("self") over
// a fresh FSM, with l applying its writes.
func scheduleLeader(t *testing.T) (*ScheduleService, *fsmLeader) {
	t.Helper()
	l := &fsmLeader{}
	h, f := newTestService(t, "self", l, nil, &followerView{})
	l.f = f
	return NewScheduleService(h, nil), l
}

// mustApply applies a command through l as a replicated entry.
func mustApply(t *testing.T, l *fsmLeader, cmd *fsmv1.Command) uint64 {
	t.Helper()
	if cmd.Time == nil {
		cmd.Time = timestamppb.Now()
	}
	data, err := fsm.Encode(cmd)
	if err != nil {
		t.Fatal(err)
	}
	res, idx, err := l.Apply(t.Context(), data)
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := res.(*fsm.Result); ok && r.Err != nil {
		t.Fatalf("apply %v: %v", cmd, r.Err)
	}
	return idx
}

func putScheduleCmd(id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: &schedulev1.Schedule{
		Id: id, VmId: "vm-" + id, Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
	}}}}
}

func claimCmd(id string, slot time.Time) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{ScheduleId: id, Slot: timestamppb.New(slot), Node: "self"}}}
}

// blocking is the ReadOptions of a blocking query after index.
func blocking(c clusterv1.Consistency, index uint64) *clusterv1.ReadOptions {
	return &clusterv1.ReadOptions{Consistency: c, WaitIndex: index, WaitTime: durationpb.New(time.Minute)}
}

// answer is what a call in a goroutine returned.
type answer[T any] struct {
	resp *connect.Response[T]
	err  error
}

// async runs call in a goroutine; its answer comes on the channel.
func async[T any](call func() (*connect.Response[T], error)) <-chan answer[T] {
	ch := make(chan answer[T], 1)
	go func() {
		resp, err := call()
		ch <- answer[T]{resp, err}
	}()
	return ch
}

// stillBlocked fails the test if a blocking query answers within a short
// while (it must wait for a change).
func stillBlocked[T any](t *testing.T, ch <-chan answer[T], what string) {
	t.Helper()
	select {
	case a := <-ch:
		t.Fatalf("%s answered before the change it waits for: %v %v", what, a.resp, a.err)
	case <-time.After(300 * time.Millisecond):
	}
}

// await waits for a blocking query's answer.
func await[T any](t *testing.T, ch <-chan answer[T], what string) *connect.Response[T] {
	t.Helper()
	select {
	case a := <-ch:
		if a.err != nil {
			t.Fatalf("%s: %v", what, a.err)
		}
		return a.resp
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not answer after the change it waits for", what)
		return nil
	}
}

// checkIndexHeader checks that the Pivirt-Index header and meta.index agree.
func checkIndexHeader(t *testing.T, hdr http.Header, meta *clusterv1.QueryMeta) {
	t.Helper()
	if got := hdr.Get(HeaderIndex); got != strconv.FormatUint(meta.GetIndex(), 10) || meta.GetServedBy() == "" {
		t.Errorf("Pivirt-Index %q, meta %v: want the same index and the serving node", got, meta)
	}
}

// A blocking ListRuns answers once a run of its schedule is recorded, with
// that run and a higher index; changes to another schedule's runs and to
// other tables do not answer it.
func TestListRunsBlocksUntilARun(t *testing.T) {
	s, l := scheduleLeader(t)
	ctx := t.Context()
	mustApply(t, l, putScheduleCmd("a"))
	mustApply(t, l, putScheduleCmd("b"))
	first, err := s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a"}))
	if err != nil {
		t.Fatal(err)
	}
	index := first.Msg.GetMeta().GetIndex()
	if index == 0 || len(first.Msg.GetRuns()) != 0 {
		t.Fatalf("first ListRuns: %v, want no runs and an index", first.Msg)
	}
	checkIndexHeader(t, first.Header(), first.Msg.GetMeta())

	for _, c := range []clusterv1.Consistency{clusterv1.Consistency_CONSISTENCY_DEFAULT, clusterv1.Consistency_CONSISTENCY_CONSISTENT, clusterv1.Consistency_CONSISTENCY_STALE} {
		t.Run(c.String(), func(t *testing.T) {
			ch := async(func() (*connect.Response[schedulev1.ListRunsResponse], error) {
				return s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: blocking(c, index)}))
			})
			stillBlocked(t, ch, "ListRuns of a")
			mustApply(t, l, claimCmd("b", time.Now().Add(time.Duration(c)*time.Hour)))
			mustApply(t, l, &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: "k", Value: c.String()}}})
			stillBlocked(t, ch, "ListRuns of a after changes elsewhere")
			slot := time.Now().Add(time.Duration(c) * time.Hour).Truncate(time.Second)
			claimed := mustApply(t, l, claimCmd("a", slot))
			resp := await(t, ch, "ListRuns of a")
			runs := resp.Msg.GetRuns()
			if len(runs) == 0 || !runs[0].GetSlot().AsTime().Equal(slot) {
				t.Fatalf("runs %v, want the run of slot %s first", runs, slot)
			}
			if got := resp.Msg.GetMeta().GetIndex(); got != claimed || got <= index {
				t.Fatalf("index %d, want %d (the claim's), above the wait index %d", got, claimed, index)
			}
			checkIndexHeader(t, resp.Header(), resp.Msg.GetMeta())
			index = claimed
		})
	}

	// A recorded outcome answers too.
	ch := async(func() (*connect.Response[schedulev1.ListRunsResponse], error) {
		return s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: blocking(clusterv1.Consistency_CONSISTENCY_DEFAULT, index)}))
	})
	stillBlocked(t, ch, "ListRuns of a")
	latest, err := s.h.state.State().Runs("a")
	if err != nil {
		t.Fatal(err)
	}
	recorded := mustApply(t, l, &fsmv1.Command{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: &schedulev1.Run{
		ScheduleId: "a", Slot: latest[0].GetSlot(), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK,
	}}}})
	resp := await(t, ch, "ListRuns of a")
	if got := resp.Msg.GetRuns()[0]; got.GetOutcome() != schedulev1.RunOutcome_RUN_OUTCOME_OK || resp.Msg.GetMeta().GetIndex() != recorded {
		t.Fatalf("after the recorded outcome: run %v at index %d, want OK at %d", got, resp.Msg.GetMeta().GetIndex(), recorded)
	}

	// Deleted: the blocking query answers NotFound.
	ch = async(func() (*connect.Response[schedulev1.ListRunsResponse], error) {
		return s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: blocking(clusterv1.Consistency_CONSISTENCY_DEFAULT, recorded)}))
	})
	stillBlocked(t, ch, "ListRuns of a")
	mustApply(t, l, &fsmv1.Command{Op: &fsmv1.Command_DeleteSchedule{DeleteSchedule: &fsmv1.DeleteSchedule{Id: "a"}}})
	select {
	case a := <-ch:
		if connect.CodeOf(a.err) != connect.CodeNotFound {
			t.Fatalf("blocking ListRuns of a deleted schedule: %v %v, want NotFound", a.resp, a.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("blocking ListRuns did not answer the deletion of its schedule")
	}
}

// A blocking ListSchedules (and GetSchedule) answers once a schedule is
// created, with it and a higher index.
func TestListSchedulesWakesOnCreate(t *testing.T) {
	s, l := scheduleLeader(t)
	ctx := t.Context()
	// Raft's first entry is its configuration: the state's first change
	// comes after index 1.
	mustApply(t, l, &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: "k", Value: "v"}}})
	first, err := s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{Read: &clusterv1.ReadOptions{}}))
	if err != nil {
		t.Fatal(err)
	}
	index := first.Msg.GetMeta().GetIndex()
	if index != 1 {
		t.Fatalf("ListSchedules before any schedule: index %d, want 1 (never 0, which does not block)", index)
	}
	list := async(func() (*connect.Response[schedulev1.ListSchedulesResponse], error) {
		return s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{Read: blocking(clusterv1.Consistency_CONSISTENCY_DEFAULT, index)}))
	})
	byVM := async(func() (*connect.Response[schedulev1.ListSchedulesResponse], error) {
		return s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{VmId: "vm-1", Read: blocking(clusterv1.Consistency_CONSISTENCY_CONSISTENT, index)}))
	})
	stillBlocked(t, list, "ListSchedules")
	created, err := s.CreateSchedule(ctx, connect.NewRequest(&schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		Id: "wake", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "@daily",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	want := created.Msg.GetSchedule().GetModifyIndex()
	for name, ch := range map[string]<-chan answer[schedulev1.ListSchedulesResponse]{"ListSchedules": list, "ListSchedules of vm-1": byVM} {
		resp := await(t, ch, name)
		if got := resp.Msg.GetSchedules(); len(got) != 1 || got[0].GetId() != "wake" {
			t.Errorf("%s: %v, want the created schedule", name, got)
		}
		if got := resp.Msg.GetMeta().GetIndex(); got != want || got <= index {
			t.Errorf("%s: index %d, want %d (the create's), above %d", name, got, want, index)
		}
		checkIndexHeader(t, resp.Header(), resp.Msg.GetMeta())
	}

	get := async(func() (*connect.Response[schedulev1.GetScheduleResponse], error) {
		return s.GetSchedule(ctx, connect.NewRequest(&schedulev1.GetScheduleRequest{Id: "wake", Read: blocking(clusterv1.Consistency_CONSISTENCY_DEFAULT, want)}))
	})
	stillBlocked(t, get, "GetSchedule")
	paused, err := s.PauseSchedule(ctx, connect.NewRequest(&schedulev1.PauseScheduleRequest{Id: "wake"}))
	if err != nil {
		t.Fatal(err)
	}
	resp := await(t, get, "GetSchedule")
	if resp.Msg.GetSchedule().GetEnabled() || resp.Msg.GetMeta().GetIndex() != paused.Msg.GetSchedule().GetModifyIndex() {
		t.Fatalf("GetSchedule after the pause: %v, want it paused at index %d", resp.Msg, paused.Msg.GetSchedule().GetModifyIndex())
	}
}

// A wait index the state already passed answers at once, whatever the
// wait time.
func TestScheduleWaitIndexPassedAnswersAtOnce(t *testing.T) {
	s, l := scheduleLeader(t)
	mustApply(t, l, putScheduleCmd("a"))
	claimed := mustApply(t, l, claimCmd("a", time.Now().Truncate(time.Second)))
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	start := time.Now()
	runs, err := s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: blocking(clusterv1.Consistency_CONSISTENCY_DEFAULT, claimed-1)}))
	if err != nil || len(runs.Msg.GetRuns()) != 1 || runs.Msg.GetMeta().GetIndex() != claimed {
		t.Fatalf("ListRuns after index %d: %v %v, want the run at index %d", claimed-1, runs, err, claimed)
	}
	list, err := s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{Read: blocking(clusterv1.Consistency_CONSISTENCY_STALE, 1)}))
	if err != nil || len(list.Msg.GetSchedules()) != 1 {
		t.Fatalf("ListSchedules after index 1: %v %v", list, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("reads with passed wait indexes took %s, want an answer at once", d)
	}
	// A bad wait time is refused naming the field.
	_, err = s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: &clusterv1.ReadOptions{WaitIndex: 1, WaitTime: durationpb.New(-time.Second)}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("a negative wait time: %v, want InvalidArgument", err)
	}
}

// leaderSchedules answers forwarded schedule reads as the leader (the
// rest of the client's methods are not called).
type leaderSchedules struct {
	schedulev1.ScheduleServiceClient
	forwarded atomic.Int32
}

func (l *leaderSchedules) ListSchedules(context.Context, *schedulev1.ListSchedulesRequest, ...grpc.CallOption) (*schedulev1.ListSchedulesResponse, error) {
	l.forwarded.Add(1)
	return &schedulev1.ListSchedulesResponse{Schedules: []*schedulev1.Schedule{{Id: "from-leader"}}}, nil
}

// On a follower: a stale read is served from its own state without asking
// the leader, a blocking one wakes when its state applies the change; a
// read without ReadOptions stays consistent (a read index from the leader,
// then the local state); a default read goes to the leader.
func TestScheduleReadsOnAFollower(t *testing.T) {
	v := &followerView{}
	h, f := newFollowerService(t, v)
	leader := &leaderSchedules{}
	s := NewScheduleService(h, func(string) schedulev1.ScheduleServiceClient { return leader })
	replica := &fsmLeader{f: f} // applies what the leader replicates
	ctx := t.Context()
	created := mustApply(t, replica, putScheduleCmd("a"))

	stale := &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_STALE}
	resp, err := s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{Read: stale}))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetSchedules(); len(got) != 1 || got[0].GetId() != "a" || resp.Msg.GetMeta().GetIndex() != created {
		t.Fatalf("stale ListSchedules on the follower: %v, want schedule a at index %d", resp.Msg, created)
	}
	if by := resp.Header().Get(HeaderServedBy); by != "follower-id" || v.asked.Load() != 0 || leader.forwarded.Load() != 0 {
		t.Fatalf("stale read served by %q after %d read index requests and %d forwards, want the follower alone", by, v.asked.Load(), leader.forwarded.Load())
	}

	ch := async(func() (*connect.Response[schedulev1.ListRunsResponse], error) {
		return s.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: "a", Read: blocking(clusterv1.Consistency_CONSISTENCY_STALE, created)}))
	})
	stillBlocked(t, ch, "stale ListRuns on the follower")
	claimed := mustApply(t, replica, claimCmd("a", time.Now().Truncate(time.Second)))
	runs := await(t, ch, "stale ListRuns on the follower")
	if len(runs.Msg.GetRuns()) != 1 || runs.Msg.GetMeta().GetIndex() != claimed || runs.Msg.GetMeta().GetServedBy() != "follower-id" {
		t.Fatalf("stale blocking ListRuns: %v, want the run at index %d from the follower", runs.Msg, claimed)
	}

	v.readIndex = f.AppliedIndex()
	if _, err := s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{})); err != nil {
		t.Fatal(err)
	}
	if v.asked.Load() != 1 || leader.forwarded.Load() != 0 {
		t.Fatalf("a read without ReadOptions: %d read index requests, %d forwards; want one read index and no forward", v.asked.Load(), leader.forwarded.Load())
	}

	resp, err = s.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{Read: &clusterv1.ReadOptions{}}))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetSchedules(); len(got) != 1 || got[0].GetId() != "from-leader" || leader.forwarded.Load() != 1 {
		t.Fatalf("default read on the follower: %v after %d forwards, want the leader's answer", got, leader.forwarded.Load())
	}
}
