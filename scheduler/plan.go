package scheduler

import (
	"slices"
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
	// maxSlotsPerPlan bounds the slots one plan runs (catch-up all over a
	// long window); the next plan goes on from the last.
	maxSlotsPerPlan = 10_000
	// MaxListedSkips bounds the skipped slots a plan lists (and records):
	// a schedule keeps at most this many runs anyway.
	MaxListedSkips = 1000
)

// Plan is what to do with a schedule's slots up to now.
type Plan struct {
	// Run are the slots to run, in order.
	Run []time.Time
	// Skipped are the slots not run (the newest MaxListedSkips of them),
	// in order; each is recorded as skipped.
	Skipped []time.Time
	// MoreSkipped: older skipped slots were not listed.
	MoreSkipped bool
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
//     by the policies latest_once and all when it is missed but within
//     the window;
//   - older slots within the window are run by the policy all (in order,
//     at most maxSlotsPerPlan per plan), else skipped.
//
// Slots are always those of the schedule's own sequence: an "@every"
// schedule keeps its phase across late plans.
func PlanSlots(spec *Spec, anchor, now time.Time, policy schedulev1.CatchUp, window, grace time.Duration) Plan {
	if window <= 0 {
		window = DefaultCatchUpWindow
	}
	if grace <= 0 {
		grace = DefaultGrace
	}
	newest, ok := spec.Newest(anchor, now)
	if !ok {
		return Plan{}
	}
	start := now.Add(-window)
	var p Plan
	switch {
	case policy == schedulev1.CatchUp_CATCH_UP_ALL && newest.After(start):
		from := anchor
		if start.After(from) {
			// Before the window: skipped.
			p.Skipped, p.MoreSkipped = lastSlots(spec, anchor, anchor, start, MaxListedSkips)
			from = start
		}
		p.Run, _ = spec.Slots(anchor, from, now, maxSlotsPerPlan)
	case policy == schedulev1.CatchUp_CATCH_UP_LATEST_ONCE && newest.After(start),
		now.Sub(newest) < grace:
		p.Skipped, p.MoreSkipped = lastSlots(spec, anchor, anchor, newest.Add(-time.Nanosecond), MaxListedSkips)
		p.Run = []time.Time{newest}
	default:
		p.Skipped, p.MoreSkipped = lastSlots(spec, anchor, anchor, newest, MaxListedSkips)
	}
	return p
}

// lastSlots lists the newest n slots in (after, until] of the schedule
// anchored at anchor, in order, and whether there are older ones.
func lastSlots(spec *Spec, anchor, after, until time.Time, n int) ([]time.Time, bool) {
	newest, ok := spec.Newest(anchor, until)
	if !ok || !newest.After(after) {
		return nil, false
	}
	if spec.every > 0 {
		var out []time.Time
		for t := newest; t.After(after) && len(out) < n; t = t.Add(-spec.every) {
			out = append(out, t)
		}
		slices.Reverse(out)
		first := out[0].Add(-spec.every)
		return out, first.After(after) && !first.Before(spec.Next(anchor))
	}
	for span := time.Minute; ; span *= 2 {
		from := newest.Add(-span)
		if !from.After(after) {
			from = after
		}
		slots, _ := spec.Slots(anchor, from, newest, 1<<20)
		if len(slots) >= n {
			return slots[len(slots)-n:], len(slots) > n || from.After(after)
		}
		if from.Equal(after) {
			return slots, false
		}
	}
}
