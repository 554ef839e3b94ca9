package scheduler

import (
	"time"

	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// Catch-up defaults.
const (
	// DefaultGrace: a slot found later than this after its time is
	// missed (a leader change, a paused leader), and its schedule's
	// catch-up policy decides; an earlier one is simply due.
	DefaultGrace = time.Minute
	// DefaultCatchUpWindow bounds how far back missed slots are
	// considered when a schedule sets no catch_up_window.
	DefaultCatchUpWindow = time.Hour
	// MaxCatchUpWindow is the largest catch_up_window.
	MaxCatchUpWindow = 7 * 24 * time.Hour
	// maxSlotsPerPlan bounds the slots one plan looks at (an "@every 1s"
	// schedule over a week's window); the rest waits for the next plan.
	maxSlotsPerPlan = 10_000
)

// Plan is what to do with a schedule's slots up to now.
type Plan struct {
	// Run are the slots to run, in order.
	Run []time.Time
	// Skipped are the slots the catch-up policy (or the window) does not
	// run, in order; each is recorded as such.
	Skipped []time.Time
	// Dropped counts slots before the window that were neither listed
	// nor run (only when there were more than maxSlotsPerPlan).
	Dropped bool
}

// Last is the newest slot the plan covers, zero when it covers none.
func (p Plan) Last() time.Time {
	var last time.Time
	if n := len(p.Run); n > 0 {
		last = p.Run[n-1]
	}
	if n := len(p.Skipped); n > 0 && p.Skipped[n-1].After(last) {
		last = p.Skipped[n-1]
	}
	return last
}

// PlanSlots decides, at now, what happens to the slots of spec after
// anchor (the last slot claimed, or the schedule's last change):
//
//   - a slot older than the catch-up window is skipped;
//   - the newest slot is run when it is due (less than grace late), and
//     by the policies latest_once and all even when it is missed;
//   - older slots within the window are run by the policy all, else
//     skipped.
func PlanSlots(spec *Spec, anchor, now time.Time, policy schedulev1.CatchUp, window, grace time.Duration) Plan {
	if window <= 0 {
		window = DefaultCatchUpWindow
	}
	if grace <= 0 {
		grace = DefaultGrace
	}
	var p Plan
	start := now.Add(-window)
	if anchor.Before(start) {
		old, more := spec.Slots(anchor, start, maxSlotsPerPlan)
		p.Skipped = old
		p.Dropped = more
		anchor = start
		if more {
			anchor = old[len(old)-1]
		}
	}
	due, _ := spec.Slots(anchor, now, maxSlotsPerPlan-len(p.Skipped))
	if len(due) == 0 {
		return p
	}
	latest := due[len(due)-1]
	onTime := now.Sub(latest) < grace
	switch policy {
	case schedulev1.CatchUp_CATCH_UP_ALL:
		p.Run = due
	case schedulev1.CatchUp_CATCH_UP_LATEST_ONCE:
		p.Skipped = append(p.Skipped, due[:len(due)-1]...)
		p.Run = []time.Time{latest}
	default: // skip
		if onTime {
			p.Skipped = append(p.Skipped, due[:len(due)-1]...)
			p.Run = []time.Time{latest}
		} else {
			p.Skipped = append(p.Skipped, due...)
		}
	}
	return p
}
