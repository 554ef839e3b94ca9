package fsm

import (
	"fmt"
	"slices"

	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

func getSchedule(t *writeTxn, id string) (*schedulev1.Schedule, error) {
	return lookup[*schedulev1.Schedule](t, TableSchedules, id)
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

// runs returns the stored runs of a schedule, oldest slot first.
func runs(t *writeTxn, scheduleID string) ([]*schedulev1.Run, error) {
	return scan[*schedulev1.Run](t, TableScheduleRuns, indexIDPrefix, scheduleID)
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
	// The schedule of the command becomes the stored record: the command
	// was decoded for this apply alone.
	s := in
	var trim []*schedulev1.Run
	if old != nil {
		// A lower history_limit trims the oldest runs.
		rs, err := runs(t, in.GetId())
		if err != nil {
			return nil, err
		}
		trim = rs[:max(0, len(rs)-f.runLimit(s))]
	}
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
	for _, r := range trim {
		if err := t.delete(TableScheduleRuns, r); err != nil {
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
	rs, err := runs(t, op.GetId())
	if err != nil {
		return nil, err
	}
	if err := t.delete(TableSchedules, s); err != nil {
		return nil, err
	}
	for _, r := range rs {
		if err := t.delete(TableScheduleRuns, r); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// applyClaimSlot records that a slot is about to run: the slot must be
// strictly after the schedule's last_slot, which it becomes. It inserts a
// STARTED run for the slot and a SKIPPED run for each skipped slot (each
// strictly between the previous last_slot and the slot, with the command's
// skip_reason as its error), then trims the
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

	existing, err := runs(t, op.GetScheduleId())
	if err != nil {
		return nil, err
	}

	s := proto.CloneOf(old)
	s.LastSlot = op.GetSlot()
	s.ModifyIndex = t.index
	run := &schedulev1.Run{
		ScheduleId:  s.GetId(),
		Slot:        op.GetSlot(),
		Outcome:     schedulev1.RunOutcome_RUN_OUTCOME_STARTED,
		Node:        op.GetNode(),
		StartedAt:   cmd.GetTime(),
		CreateIndex: t.index,
		ModifyIndex: t.index,
	}
	skipReason := op.GetSkipReason()
	if t.legacy() {
		skipReason = "" // 0.0 records no reason
	}
	added := make([]*schedulev1.Run, 0, len(op.GetSkipped())+1)
	for _, sk := range op.GetSkipped() {
		added = append(added, &schedulev1.Run{
			ScheduleId:  s.GetId(),
			Slot:        sk,
			Outcome:     schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED,
			Error:       skipReason,
			Node:        op.GetNode(),
			CreateIndex: t.index,
			ModifyIndex: t.index,
		})
	}
	added = append(added, run)
	keep, drop := trimClaimedRuns(existing, added, f.runLimit(s))

	if err := t.insert(TableSchedules, s); err != nil {
		return nil, err
	}
	// The started run is always written, even in the (impossible) case
	// where the trim drops it again.
	if err := t.touch(TableScheduleRuns); err != nil {
		return nil, err
	}
	for _, r := range keep {
		if err := t.insert(TableScheduleRuns, r); err != nil {
			return nil, err
		}
	}
	for _, r := range drop {
		if err := t.delete(TableScheduleRuns, r); err != nil {
			return nil, err
		}
	}
	return run, nil
}

// trimClaimedRuns works out, before anything is written, what inserting
// the added runs (in order: a later run replaces an earlier one at the same
// slot) after the existing ones (oldest slot first), then trimming to the
// newest limit runs by slot, leaves: the added runs to insert and the
// existing runs to delete.
func trimClaimedRuns(existing, added []*schedulev1.Run, limit int) (keep, drop []*schedulev1.Run) {
	type entry struct {
		run   *schedulev1.Run
		added bool
	}
	all := make([]entry, 0, len(existing)+len(added))
	for _, r := range existing {
		all = append(all, entry{run: r})
	}
	for _, r := range added {
		i := slices.IndexFunc(all, func(e entry) bool { return compareTime(e.run.GetSlot(), r.GetSlot()) == 0 })
		if i < 0 {
			all = append(all, entry{run: r, added: true})
			continue
		}
		if !all[i].added {
			// Replaced: the insert overwrites it, or, if the new run is
			// trimmed, the stored one must go.
			drop = append(drop, all[i].run)
		}
		all[i] = entry{run: r, added: true}
	}
	slices.SortStableFunc(all, func(a, b entry) int { return compareTime(a.run.GetSlot(), b.run.GetSlot()) })
	cut := max(0, len(all)-limit)
	for i, e := range all {
		switch {
		case i >= cut && e.added:
			keep = append(keep, e.run)
		case i < cut && !e.added:
			drop = append(drop, e.run)
		}
	}
	// An existing run replaced by a kept added run is overwritten, not
	// deleted.
	drop = slices.DeleteFunc(drop, func(r *schedulev1.Run) bool {
		return slices.ContainsFunc(keep, func(k *schedulev1.Run) bool { return compareTime(k.GetSlot(), r.GetSlot()) == 0 })
	})
	return keep, drop
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
	old, err := lookup[*schedulev1.Run](t, TableScheduleRuns, in.GetScheduleId(), in.GetSlot())
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
	if in.GetHost() != "" && !t.legacy() {
		run.Host = in.GetHost()
	}
	run.ModifyIndex = t.index
	if err := t.insert(TableScheduleRuns, run); err != nil {
		return nil, err
	}
	return run, nil
}
