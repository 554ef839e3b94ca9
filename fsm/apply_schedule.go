package fsm

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

func getSchedule(t *writeTxn, id string) (*schedulev1.Schedule, error) {
	return first[*schedulev1.Schedule](t.txn, TableSchedules, indexID, id)
}

func mustGetSchedule(t *writeTxn, id string) (*schedulev1.Schedule, error) {
	s, err := getSchedule(t, id)
	if err != nil {
		return nil, err
	}
	if s == nil {
		return nil, fmt.Errorf("%w: schedule %q", ErrNotFound, id)
	}
	return s, nil
}

// runLimit is how many runs a schedule keeps.
func (f *FSM) runLimit(s *schedulev1.Schedule) int {
	if n := s.GetHistoryLimit(); n > 0 {
		return int(n)
	}
	return int(f.cfg.MaxRunHistory)
}

// trimRuns deletes a schedule's oldest runs (by slot) beyond its limit.
func (f *FSM) trimRuns(t *writeTxn, s *schedulev1.Schedule) error {
	it, err := t.txn.Get(TableScheduleRuns, indexSchedule, s.GetId())
	if err != nil {
		return fmt.Errorf("read %s: %w", TableScheduleRuns, err)
	}
	runs := collect[*schedulev1.Run](it) // oldest slot first
	for limit := f.runLimit(s); len(runs) > limit; runs = runs[1:] {
		if err := t.delete(TableScheduleRuns, runs[0]); err != nil {
			return err
		}
	}
	return nil
}

// applyPutSchedule creates or replaces a schedule. The stored last_slot,
// created_at and create_index survive a replace; cas_revision, when present,
// must equal the stored modify_index (0: the schedule must not exist). The
// cron expression and time zone are validated by the leader, not here.
func (f *FSM) applyPutSchedule(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetPutSchedule()
	in := op.GetSchedule()
	const p = "put_schedule.schedule"
	if in == nil {
		return nil, invalidf("%s: required", p)
	}
	if err := checkID(p+".id", in.GetId()); err != nil {
		return nil, err
	}
	if err := checkID(p+".vm_id", in.GetVmId()); err != nil {
		return nil, err
	}
	if in.GetCron() == "" {
		return nil, invalidf("%s.cron: required", p)
	}
	if in.GetAction() == schedulev1.Action_ACTION_UNSPECIFIED {
		return nil, invalidf("%s.action: required (ACTION_POWER_ON, ACTION_POWER_OFF or ACTION_REBOOT)", p)
	}
	if err := checkDuration(p+".catch_up_window", in.GetCatchUpWindow()); err != nil {
		return nil, err
	}
	old, err := getSchedule(t, in.GetId())
	if err != nil {
		return nil, err
	}
	if op.CasRevision != nil && op.GetCasRevision() != old.GetModifyIndex() {
		return nil, fmt.Errorf("%w: schedule %q: cas_revision %d, current modify index %d",
			ErrCASConflict, in.GetId(), op.GetCasRevision(), old.GetModifyIndex())
	}
	s := proto.CloneOf(in)
	s.UpdatedAt = cmd.GetTime()
	s.ModifyIndex = t.index
	if old != nil {
		s.LastSlot = old.GetLastSlot()
		s.CreatedAt = old.GetCreatedAt()
		s.CreateIndex = old.GetCreateIndex()
	} else {
		s.LastSlot = nil
		s.CreatedAt = cmd.GetTime()
		s.CreateIndex = t.index
	}
	if err := t.insert(TableSchedules, s); err != nil {
		return nil, err
	}
	if old != nil {
		if err := f.trimRuns(t, s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// applyDeleteSchedule deletes a schedule and all its runs.
func (f *FSM) applyDeleteSchedule(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetDeleteSchedule()
	if err := checkID("delete_schedule.id", op.GetId()); err != nil {
		return nil, err
	}
	s, err := mustGetSchedule(t, op.GetId())
	if err != nil {
		return nil, err
	}
	if err := t.delete(TableSchedules, s); err != nil {
		return nil, err
	}
	return nil, t.deleteAll(TableScheduleRuns, indexSchedule, op.GetId())
}

// applyClaimSlot records that a slot is about to run: the slot must be
// strictly after the schedule's last_slot, which it becomes. It inserts a
// STARTED run for the slot and a SKIPPED run for each skipped slot (each
// strictly between the previous last_slot and the slot), then trims the
// schedule's runs to its limit. The result value is the started run.
func (f *FSM) applyClaimSlot(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetClaimSlot()
	const p = "claim_slot"
	if err := checkID(p+".schedule_id", op.GetScheduleId()); err != nil {
		return nil, err
	}
	if err := checkTime(p+".slot", op.GetSlot(), true); err != nil {
		return nil, err
	}
	if err := checkOptionalID(p+".node", op.GetNode()); err != nil {
		return nil, err
	}
	for i, sk := range op.GetSkipped() {
		if err := checkTime(fmt.Sprintf("%s.skipped[%d]", p, i), sk, true); err != nil {
			return nil, err
		}
	}
	old, err := mustGetSchedule(t, op.GetScheduleId())
	if err != nil {
		return nil, err
	}
	last := old.GetLastSlot()
	if last != nil && compareTime(op.GetSlot(), last) <= 0 {
		return nil, fmt.Errorf("%w: schedule %q: slot %s, last slot %s",
			ErrSlotNotAfterLast, op.GetScheduleId(), formatTime(op.GetSlot()), formatTime(last))
	}
	for i, sk := range op.GetSkipped() {
		if (last != nil && compareTime(sk, last) <= 0) || compareTime(sk, op.GetSlot()) >= 0 {
			return nil, invalidf("%s.skipped[%d]: %s must be after the last slot (%s) and before the slot (%s)",
				p, i, formatTime(sk), formatTime(last), formatTime(op.GetSlot()))
		}
	}

	s := proto.CloneOf(old)
	s.LastSlot = op.GetSlot()
	s.ModifyIndex = t.index
	if err := t.insert(TableSchedules, s); err != nil {
		return nil, err
	}
	for _, sk := range op.GetSkipped() {
		skipped := &schedulev1.Run{
			ScheduleId:  s.GetId(),
			Slot:        sk,
			Outcome:     schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED,
			Node:        op.GetNode(),
			CreateIndex: t.index,
			ModifyIndex: t.index,
		}
		if err := t.insert(TableScheduleRuns, skipped); err != nil {
			return nil, err
		}
	}
	run := &schedulev1.Run{
		ScheduleId:  s.GetId(),
		Slot:        op.GetSlot(),
		Outcome:     schedulev1.RunOutcome_RUN_OUTCOME_STARTED,
		Node:        op.GetNode(),
		StartedAt:   cmd.GetTime(),
		CreateIndex: t.index,
		ModifyIndex: t.index,
	}
	if err := t.insert(TableScheduleRuns, run); err != nil {
		return nil, err
	}
	if err := f.trimRuns(t, s); err != nil {
		return nil, err
	}
	return run, nil
}

// applyRecordRun updates the outcome of an existing run: outcome, error,
// attempts, latency and finished_at. Other fields of the stored run stay.
func (f *FSM) applyRecordRun(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	in := cmd.GetRecordRun().GetRun()
	const p = "record_run.run"
	if in == nil {
		return nil, invalidf("%s: required", p)
	}
	if err := checkID(p+".schedule_id", in.GetScheduleId()); err != nil {
		return nil, err
	}
	if err := checkTime(p+".slot", in.GetSlot(), true); err != nil {
		return nil, err
	}
	if in.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_UNSPECIFIED {
		return nil, invalidf("%s.outcome: required", p)
	}
	if err := checkDuration(p+".latency", in.GetLatency()); err != nil {
		return nil, err
	}
	if err := checkTime(p+".finished_at", in.GetFinishedAt(), false); err != nil {
		return nil, err
	}
	old, err := first[*schedulev1.Run](t.txn, TableScheduleRuns, indexID, in.GetScheduleId(), in.GetSlot())
	if err != nil {
		return nil, err
	}
	if old == nil {
		return nil, fmt.Errorf("%w: run of schedule %q at slot %s", ErrNotFound, in.GetScheduleId(), formatTime(in.GetSlot()))
	}
	run := proto.CloneOf(old)
	run.Outcome = in.GetOutcome()
	run.Error = in.GetError()
	run.Attempts = in.GetAttempts()
	run.Latency = in.GetLatency()
	run.FinishedAt = in.GetFinishedAt()
	run.ModifyIndex = t.index
	if err := t.insert(TableScheduleRuns, run); err != nil {
		return nil, err
	}
	return run, nil
}
