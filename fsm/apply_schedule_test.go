package fsm

import (
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

func storedSchedule(t *testing.T, h *harness, id string) *schedulev1.Schedule {
	t.Helper()
	s, err := h.f.State().Schedule(id)
	if err != nil {
		t.Fatalf("Schedule(%q): %v", id, err)
	}
	return s
}

// runSlots returns the slots (as seconds after t0) and outcomes of a
// schedule's runs, newest first.
func runSlots(t *testing.T, h *harness, id string) ([]int64, []schedulev1.RunOutcome) {
	t.Helper()
	runs, err := h.f.State().Runs(id)
	if err != nil {
		t.Fatalf("Runs(%q): %v", id, err)
	}
	var slots []int64
	var outcomes []schedulev1.RunOutcome
	for _, r := range runs {
		slots = append(slots, r.GetSlot().GetSeconds()-t0.Unix())
		outcomes = append(outcomes, r.GetOutcome())
	}
	return slots, outcomes
}

func TestPutSchedule(t *testing.T) {
	mod := func(f func(*schedulev1.Schedule)) *schedulev1.Schedule {
		s := schedule("s1")
		f(s)
		return s
	}
	runApplyCases(t, []applyCase{
		{
			name: "new schedule ignores input bookkeeping",
			cmd: putSchedule(mod(func(s *schedulev1.Schedule) {
				s.LastSlot, s.CreatedAt, s.CreateIndex, s.ModifyIndex = at(500), at(-100), 77, 78
			})),
			check: func(t *testing.T, h *harness, res *Result) {
				want := schedule("s1")
				want.CreatedAt, want.UpdatedAt = at(1), at(1)
				want.CreateIndex, want.ModifyIndex = 1, 1
				if got := storedSchedule(t, h, "s1"); !proto.Equal(got, want) {
					t.Errorf("stored = %v\nwant     %v", got, want)
				}
				if !proto.Equal(res.Value, want) {
					t.Errorf("Result.Value = %v, want %v", res.Value, want)
				}
			},
		},
		{
			name:  "replace keeps last_slot, created_at and create_index",
			setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))},
			cmd:   putSchedule(mod(func(s *schedulev1.Schedule) { s.Cron = "@daily"; s.LastSlot = nil })),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedSchedule(t, h, "s1")
				if got.GetCron() != "@daily" || !proto.Equal(got.GetLastSlot(), at(100)) || !proto.Equal(got.GetCreatedAt(), at(1)) ||
					!proto.Equal(got.GetUpdatedAt(), at(3)) || got.GetCreateIndex() != 1 || got.GetModifyIndex() != 3 {
					t.Errorf("stored = %v, want cron @daily, last slot at(100), created at(1), updated at(3), indexes 1/3", got)
				}
			},
		},
		{
			name:  "lowering history_limit trims runs",
			setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100)), claim("s1", at(200)), claim("s1", at(300))},
			cmd:   putSchedule(mod(func(s *schedulev1.Schedule) { s.HistoryLimit = 2 })),
			check: func(t *testing.T, h *harness, res *Result) {
				if slots, _ := runSlots(t, h, "s1"); !slices.Equal(slots, []int64{300, 200}) {
					t.Errorf("run slots = %v, want [300 200]", slots)
				}
			},
		},
		{name: "cas 0 on a new schedule", cmd: putScheduleCAS(schedule("s1"), 0)},
		{name: "cas matching modify index", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: putScheduleCAS(schedule("s1"), 2)},
		{name: "cas stale modify index", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: putScheduleCAS(schedule("s1"), 1), wantErr: ErrCASConflict},
		{name: "cas 0 on an existing schedule", setup: []*fsmv1.Command{putSchedule(schedule("s1"))}, cmd: putScheduleCAS(schedule("s1"), 0), wantErr: ErrCASConflict},
		{name: "missing schedule", cmd: putSchedule(nil), wantErr: ErrInvalidCommand, check: wantField("put_schedule.schedule")},
		{name: "missing id", cmd: putSchedule(mod(func(s *schedulev1.Schedule) { s.Id = "" })), wantErr: ErrInvalidCommand, check: wantField("schedule.id")},
		{name: "missing vm_id", cmd: putSchedule(mod(func(s *schedulev1.Schedule) { s.VmId = "" })), wantErr: ErrInvalidCommand, check: wantField("schedule.vm_id")},
		{name: "missing cron", cmd: putSchedule(mod(func(s *schedulev1.Schedule) { s.Cron = "" })), wantErr: ErrInvalidCommand, check: wantField("schedule.cron")},
		{name: "unspecified action", cmd: putSchedule(mod(func(s *schedulev1.Schedule) { s.Action = schedulev1.Action_ACTION_UNSPECIFIED })), wantErr: ErrInvalidCommand, check: wantField("schedule.action")},
		{name: "negative catch_up_window", cmd: putSchedule(mod(func(s *schedulev1.Schedule) { s.CatchUpWindow = durationpb.New(-time.Minute) })), wantErr: ErrInvalidCommand, check: wantField("schedule.catch_up_window")},
	})
}

func TestDeleteSchedule(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name: "deletes the schedule and its runs",
			setup: []*fsmv1.Command{
				putSchedule(schedule("s1")), claim("s1", at(100)), claim("s1", at(200)),
				putSchedule(schedule("s2")), claim("s2", at(100)),
			},
			cmd: deleteSchedule("s1"),
			check: func(t *testing.T, h *harness, res *Result) {
				st := h.f.State()
				if _, err := st.Schedule("s1"); !errors.Is(err, ErrNotFound) {
					t.Errorf("Schedule after delete: %v, want ErrNotFound", err)
				}
				if _, err := st.Runs("s1"); !errors.Is(err, ErrNotFound) {
					t.Errorf("Runs after delete: %v, want ErrNotFound", err)
				}
				if slots, _ := runSlots(t, h, "s2"); !slices.Equal(slots, []int64{100}) {
					t.Errorf("runs of s2 = %v, want [100]", slots)
				}
			},
		},
		{name: "absent", cmd: deleteSchedule("s1"), wantErr: ErrNotFound},
		{name: "missing id", cmd: deleteSchedule(""), wantErr: ErrInvalidCommand, check: wantField("delete_schedule.id")},
	})
}

func TestClaimSlot(t *testing.T) {
	badTS := &timestamppb.Timestamp{Seconds: 1, Nanos: 2e9}
	limited := schedule("s1")
	limited.HistoryLimit = 3
	runApplyCases(t, []applyCase{
		{
			name:  "first slot",
			setup: []*fsmv1.Command{putSchedule(schedule("s1"))},
			cmd:   claim("s1", at(100)),
			check: func(t *testing.T, h *harness, res *Result) {
				s := storedSchedule(t, h, "s1")
				if !proto.Equal(s.GetLastSlot(), at(100)) || s.GetModifyIndex() != 2 {
					t.Errorf("schedule = %v, want last slot at(100), modify 2", s)
				}
				want := &schedulev1.Run{
					ScheduleId: "s1", Slot: at(100), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_STARTED,
					Node: "node-2", StartedAt: at(2), CreateIndex: 2, ModifyIndex: 2,
				}
				if !proto.Equal(res.Value, want) {
					t.Errorf("Result.Value = %v, want %v", res.Value, want)
				}
				got, err := h.f.State().Run("s1", at(100).AsTime())
				if err != nil || !proto.Equal(got, want) {
					t.Errorf("Run = %v, %v; want %v", got, err, want)
				}
			},
		},
		{
			name:  "skipped slots",
			setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))},
			cmd: func() *fsmv1.Command {
				c := claim("s1", at(400), at(300), at(200))
				c.GetClaimSlot().SkipReason = "missed"
				return c
			}(),
			check: func(t *testing.T, h *harness, res *Result) {
				for _, slot := range []int{200, 300} {
					r, err := h.f.State().Run("s1", at(slot).AsTime())
					if err != nil || r.GetError() != "missed" {
						t.Errorf("skipped run at(%d) = %v, %v; want the error %q", slot, r, err, "missed")
					}
				}
				slots, outcomes := runSlots(t, h, "s1")
				wantOutcomes := []schedulev1.RunOutcome{
					schedulev1.RunOutcome_RUN_OUTCOME_STARTED, schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED,
					schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED, schedulev1.RunOutcome_RUN_OUTCOME_STARTED,
				}
				if !slices.Equal(slots, []int64{400, 300, 200, 100}) || !slices.Equal(outcomes, wantOutcomes) {
					t.Errorf("runs = %v %v, want [400 300 200 100] %v", slots, outcomes, wantOutcomes)
				}
			},
		},
		{
			name:  "history limit keeps the newest runs",
			setup: []*fsmv1.Command{putSchedule(limited), claim("s1", at(100)), claim("s1", at(200))},
			cmd:   claim("s1", at(600), at(300), at(400), at(500)),
			check: func(t *testing.T, h *harness, res *Result) {
				if slots, _ := runSlots(t, h, "s1"); !slices.Equal(slots, []int64{600, 500, 400}) {
					t.Errorf("run slots = %v, want [600 500 400]", slots)
				}
			},
		},
		{
			name:  "default history limit",
			mods:  []func(*Config){func(c *Config) { c.MaxRunHistory = 2 }},
			setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100)), claim("s1", at(200))},
			cmd:   claim("s1", at(300)),
			check: func(t *testing.T, h *harness, res *Result) {
				if slots, _ := runSlots(t, h, "s1"); !slices.Equal(slots, []int64{300, 200}) {
					t.Errorf("run slots = %v, want [300 200]", slots)
				}
			},
		},
		{name: "nanosecond after last", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: claim("s1", &timestamppb.Timestamp{Seconds: at(100).Seconds, Nanos: 1})},
		{name: "same slot", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: claim("s1", at(100)), wantErr: ErrSlotNotAfterLast},
		{name: "earlier slot", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: claim("s1", at(50)), wantErr: ErrSlotNotAfterLast},
		{name: "skipped at last slot", setup: []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}, cmd: claim("s1", at(300), at(100)), wantErr: ErrInvalidCommand, check: wantField("claim_slot.skipped[0]")},
		{name: "skipped at slot", setup: []*fsmv1.Command{putSchedule(schedule("s1"))}, cmd: claim("s1", at(300), at(200), at(300)), wantErr: ErrInvalidCommand, check: wantField("claim_slot.skipped[1]")},
		{name: "invalid skipped", setup: []*fsmv1.Command{putSchedule(schedule("s1"))}, cmd: claim("s1", at(300), badTS), wantErr: ErrInvalidCommand, check: wantField("claim_slot.skipped[0]")},
		{name: "unknown schedule", cmd: claim("s1", at(100)), wantErr: ErrNotFound},
		{name: "missing schedule_id", cmd: claim("", at(100)), wantErr: ErrInvalidCommand, check: wantField("claim_slot.schedule_id")},
		{name: "missing slot", setup: []*fsmv1.Command{putSchedule(schedule("s1"))}, cmd: claim("s1", nil), wantErr: ErrInvalidCommand, check: wantField("claim_slot.slot")},
		{name: "invalid slot", setup: []*fsmv1.Command{putSchedule(schedule("s1"))}, cmd: claim("s1", badTS), wantErr: ErrInvalidCommand, check: wantField("claim_slot.slot")},
	})
}

func TestRecordRun(t *testing.T) {
	finished := &schedulev1.Run{
		ScheduleId: "s1", Slot: at(100), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_ERROR,
		Error: "backend unavailable", Attempts: 3, Latency: durationpb.New(1500 * time.Millisecond),
		FinishedAt: at(102), Node: "ignored", StartedAt: at(-5),
	}
	mod := func(f func(*schedulev1.Run)) *schedulev1.Run {
		r := proto.CloneOf(finished)
		f(r)
		return r
	}
	setup := []*fsmv1.Command{putSchedule(schedule("s1")), claim("s1", at(100))}
	runApplyCases(t, []applyCase{
		{
			name:  "started run finishes",
			setup: setup,
			cmd:   recordRun(proto.CloneOf(finished)),
			check: func(t *testing.T, h *harness, res *Result) {
				want := &schedulev1.Run{
					ScheduleId: "s1", Slot: at(100), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_ERROR,
					Error: "backend unavailable", Attempts: 3, Latency: durationpb.New(1500 * time.Millisecond),
					Node: "node-2", StartedAt: at(2), FinishedAt: at(102), CreateIndex: 2, ModifyIndex: 3,
				}
				got, err := h.f.State().Run("s1", at(100).AsTime())
				if err != nil || !proto.Equal(got, want) {
					t.Errorf("Run = %v, %v\nwant %v", got, err, want)
				}
				if !proto.Equal(res.Value, want) {
					t.Errorf("Result.Value = %v, want %v", res.Value, want)
				}
			},
		},
		{name: "no run at slot", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.Slot = at(200) })), wantErr: ErrNotFound},
		{name: "unknown schedule", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.ScheduleId = "s2" })), wantErr: ErrNotFound},
		{name: "missing run", setup: setup, cmd: recordRun(nil), wantErr: ErrInvalidCommand, check: wantField("record_run.run")},
		{name: "missing schedule_id", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.ScheduleId = "" })), wantErr: ErrInvalidCommand, check: wantField("run.schedule_id")},
		{name: "missing slot", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.Slot = nil })), wantErr: ErrInvalidCommand, check: wantField("run.slot")},
		{name: "unspecified outcome", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.Outcome = 0 })), wantErr: ErrInvalidCommand, check: wantField("run.outcome")},
		{name: "negative latency", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.Latency = durationpb.New(-time.Second) })), wantErr: ErrInvalidCommand, check: wantField("run.latency")},
		{name: "invalid finished_at", setup: setup, cmd: recordRun(mod(func(r *schedulev1.Run) { r.FinishedAt = &timestamppb.Timestamp{Nanos: -1} })), wantErr: ErrInvalidCommand, check: wantField("run.finished_at")},
	})
}
