package gateway

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// claimingLeader is an fsmLeader on which the dispatcher claims a slot of
// a schedule between an update's read and its write: before the first
// put_schedule that carries a revision, a claim_slot of that schedule is
// applied (the put's revision is then out of date).
type claimingLeader struct {
	fsmLeader
	claimed atomic.Bool
	err     atomic.Value // error of the claim, if any
}

func (l *claimingLeader) Apply(ctx context.Context, data []byte) (any, uint64, error) {
	if cmd, err := fsm.Decode(data); err == nil && cmd.GetPutSchedule().GetCasRevision() != 0 && !l.claimed.Swap(true) {
		claim, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{
			ScheduleId: cmd.GetPutSchedule().GetSchedule().GetId(), Slot: timestamppb.New(time.Now().Truncate(time.Second)), Node: "self",
		}}})
		if err != nil {
			return nil, 0, err
		}
		if res, _, _ := l.fsmLeader.Apply(ctx, claim); res.(*fsm.Result).Err != nil {
			l.err.Store(res.(*fsm.Result).Err)
		}
	}
	return l.fsmLeader.Apply(ctx, data)
}

// TestPauseWhileASlotIsClaimed: a pause whose first proposal loses to a
// slot claim (a compare-and-set conflict) is proposed again on the new
// version, and the schedule ends paused. A retry of the very same request
// afterwards answers with the paused schedule.
func TestPauseWhileASlotIsClaimed(t *testing.T) {
	l := &claimingLeader{}
	h, f := newTestService(t, "self", l, nil, &followerView{})
	l.f = f
	s := NewScheduleService(h, nil)
	ctx := t.Context()
	created, err := s.CreateSchedule(ctx, connect.NewRequest(&schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		VmId: "vm-1", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
	}}))
	if err != nil {
		t.Fatal(err)
	}
	id := created.Msg.GetSchedule().GetId()
	req := connect.NewRequest(&schedulev1.PauseScheduleRequest{Id: id})
	resp, err := s.PauseSchedule(ctx, req)
	if err != nil {
		t.Fatalf("pause: %v", err)
	}
	if e := l.err.Load(); e != nil || !l.claimed.Load() {
		t.Fatalf("the claim in between: claimed %v, error %v", l.claimed.Load(), e)
	}
	got, err := f.State().Schedule(id)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetEnabled() || resp.Msg.GetSchedule().GetEnabled() {
		t.Fatalf("after the pause: stored enabled=%v, answered enabled=%v; want both paused", got.GetEnabled(), resp.Msg.GetSchedule().GetEnabled())
	}
	again, err := s.PauseSchedule(ctx, connect.NewRequest(&schedulev1.PauseScheduleRequest{Id: id, Write: req.Msg.GetWrite()}))
	if err != nil || again.Msg.GetSchedule().GetEnabled() {
		t.Fatalf("the same pause again: %v (%v), want the paused schedule", again, err)
	}
}
