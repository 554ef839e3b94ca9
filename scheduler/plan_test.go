package scheduler

import (
	"testing"
	"time"

	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

func TestPlanSlots(t *testing.T) {
	s, err := ParseSpec("*/10 * * * *", "")
	if err != nil {
		t.Fatal(err)
	}
	at := func(h, m int) time.Time { return time.Date(2026, 5, 1, h, m, 0, 0, time.UTC) }
	mins := func(ts []time.Time) []string {
		var out []string
		for _, t := range ts {
			out = append(out, t.Format("15:04"))
		}
		return out
	}
	for _, tc := range []struct {
		name         string
		anchor, now  time.Time
		policy       schedulev1.CatchUp
		window       time.Duration
		run, skipped []string
	}{
		{"nothing due", at(10, 0), at(10, 5), schedulev1.CatchUp_CATCH_UP_SKIP, 0, nil, nil},
		{"due on time", at(10, 0), at(10, 10).Add(2 * time.Second), schedulev1.CatchUp_CATCH_UP_SKIP, 0, []string{"10:10"}, nil},
		{"skip: the newest is late too", at(10, 0), at(10, 35), schedulev1.CatchUp_CATCH_UP_SKIP, 0, nil, []string{"10:10", "10:20", "10:30"}},
		{"skip: the newest is due", at(10, 0), at(10, 30).Add(30 * time.Second), schedulev1.CatchUp_CATCH_UP_SKIP, 0, []string{"10:30"}, []string{"10:10", "10:20"}},
		{"latest_once", at(10, 0), at(10, 35), schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, 0, []string{"10:30"}, []string{"10:10", "10:20"}},
		{"all", at(10, 0), at(10, 35), schedulev1.CatchUp_CATCH_UP_ALL, 0, []string{"10:10", "10:20", "10:30"}, nil},
		{"all within the window", at(9, 0), at(10, 35), schedulev1.CatchUp_CATCH_UP_ALL, 30 * time.Minute, []string{"10:10", "10:20", "10:30"}, []string{"09:10", "09:20", "09:30", "09:40", "09:50", "10:00"}},
		{"latest_once outside the window", at(9, 0), at(10, 35), schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, 4 * time.Minute, nil, []string{"09:10", "09:20", "09:30", "09:40", "09:50", "10:00", "10:10", "10:20", "10:30"}},
	} {
		p := PlanSlots(s, tc.anchor, tc.now, tc.policy, tc.window, 0)
		if got, want := mins(p.Run), tc.run; !equal(got, want) {
			t.Errorf("%s: run %v, want %v", tc.name, got, want)
		}
		if got, want := mins(p.Skipped), tc.skipped; !equal(got, want) {
			t.Errorf("%s: skipped %v, want %v", tc.name, got, want)
		}
	}
	// A week of @every 1s is taken in bounded plans, each going on from
	// the last.
	e, _ := ParseSpec("@every 1s", "")
	base := at(0, 0)
	p := PlanSlots(e, base, base.Add(7*24*time.Hour), schedulev1.CatchUp_CATCH_UP_ALL, MaxCatchUpWindow, 0)
	if len(p.Run) != maxSlotsPerPlan || len(p.Skipped) != 0 || !p.Last().Equal(base.Add(maxSlotsPerPlan*time.Second)) {
		t.Errorf("a week of seconds: %d run, %d skipped, last %v", len(p.Run), len(p.Skipped), p.Last())
	}
	// A month of seconds with an hour's window: the hour runs, the rest
	// is skipped (the newest listed).
	now := base.Add(30 * 24 * time.Hour)
	p = PlanSlots(e, base, now, schedulev1.CatchUp_CATCH_UP_ALL, time.Hour, 0)
	if len(p.Run) != 3600 || len(p.Skipped) != MaxListedSkips || !p.MoreSkipped || !p.Skipped[len(p.Skipped)-1].Equal(now.Add(-time.Hour)) {
		t.Errorf("a month of seconds, window 1h: %d run, %d skipped (more %v), newest skipped %v", len(p.Run), len(p.Skipped), p.MoreSkipped, p.Skipped[len(p.Skipped)-1])
	}
	// latest_once after a day away runs the true newest slot.
	p = PlanSlots(e, base, base.Add(24*time.Hour), schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, 48*time.Hour, 0)
	if len(p.Run) != 1 || !p.Run[0].Equal(base.Add(24*time.Hour)) || len(p.Skipped) != MaxListedSkips || !p.MoreSkipped {
		t.Errorf("latest_once after a day: run %v, %d skipped", p.Run, len(p.Skipped))
	}
	// @every longer than the window still runs, on its own phase.
	two, _ := ParseSpec("@every 2h", "")
	if p := PlanSlots(two, at(10, 0), at(12, 0).Add(30*time.Second), schedulev1.CatchUp_CATCH_UP_SKIP, 0, 0); !equal(mins(p.Run), []string{"12:00"}) {
		t.Errorf("@every 2h due: run %v skipped %v", mins(p.Run), mins(p.Skipped))
	}
	if p := PlanSlots(two, at(10, 0), at(12, 30), schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, 0, 0); !equal(mins(p.Run), []string{"12:00"}) {
		t.Errorf("@every 2h latest_once: run %v skipped %v", mins(p.Run), mins(p.Skipped))
	}
	half, _ := ParseSpec("@every 30m", "")
	p = PlanSlots(half, at(10, 0), at(11, 45).Add(17*time.Second), schedulev1.CatchUp_CATCH_UP_ALL, time.Hour, 0)
	if !equal(mins(p.Run), []string{"11:00", "11:30"}) || !equal(mins(p.Skipped), []string{"10:30"}) {
		t.Errorf("@every 30m keeps its phase: run %v skipped %v", mins(p.Run), mins(p.Skipped))
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
