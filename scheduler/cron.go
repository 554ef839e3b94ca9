package scheduler

import (
	"errors"
	"fmt"
	"strings"
	"time"
	_ "time/tzdata" // IANA zones on machines without /usr/share/zoneinfo

	"github.com/robfig/cron/v3"
)

// ErrInvalidSpec wraps every problem of a schedule's cron expression or
// time zone.
var ErrInvalidSpec = errors.New("invalid schedule")

// MinEvery is the shortest "@every" interval.
const MinEvery = time.Second

// parser reads the 5-field expressions of the spec (minute, hour, day of
// month, month, weekday) and the descriptors (@hourly, @daily, @midnight,
// @weekly, @monthly, @yearly, @annually, @every <duration>).
var parser = cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// Spec is a schedule's expression in its time zone: which instants are
// its slots.
//
// A 5-field expression is evaluated on the zone's wall clock, and a wall
// time is then placed on the time line: one that a daylight-saving jump
// skips (02:30 on a spring-forward night) becomes the instant of the jump
// (03:00 new time), once, however many slots fell into the skipped hour;
// one that a fall-back night repeats is its first occurrence only. So a
// daily job runs once every day, DST or not. (cron/v3's own Next adds
// hours on the absolute time line: it skips the first case and runs the
// second twice.) "@every" is an interval on the absolute time line.
type Spec struct {
	expr   string
	loc    *time.Location
	every  time.Duration
	fields *cron.SpecSchedule // on the wall clock, expressed in UTC
}

// ParseSpec checks a cron expression and an IANA time zone ("" is UTC).
func ParseSpec(expr, zone string) (*Spec, error) {
	loc := time.UTC
	if zone != "" {
		l, err := time.LoadLocation(zone)
		if err != nil || zone == "Local" {
			return nil, fmt.Errorf("%w: time_zone %q is not an IANA time zone such as Europe/Budapest", ErrInvalidSpec, zone)
		}
		loc = l
	}
	e := strings.TrimSpace(expr)
	if e == "" {
		return nil, fmt.Errorf("%w: cron: required", ErrInvalidSpec)
	}
	if strings.HasPrefix(e, "TZ=") || strings.HasPrefix(e, "CRON_TZ=") {
		return nil, fmt.Errorf("%w: cron %q: set the zone in time_zone, not in the expression", ErrInvalidSpec, expr)
	}
	if d, ok := strings.CutPrefix(e, "@every "); ok {
		// cron/v3 rounds an interval to whole seconds, up to one second:
		// say so instead.
		if v, err := time.ParseDuration(strings.TrimSpace(d)); err == nil && (v < MinEvery || v%time.Second != 0) {
			return nil, fmt.Errorf("%w: cron %q: the interval must be whole seconds, at least %s", ErrInvalidSpec, expr, MinEvery)
		}
	}
	sched, err := parser.Parse(e)
	if err != nil {
		return nil, fmt.Errorf("%w: cron %q: %v (want minute hour day-of-month month weekday, @daily-style, or @every <duration>)", ErrInvalidSpec, expr, err)
	}
	s := &Spec{expr: e, loc: loc}
	switch v := sched.(type) {
	case cron.ConstantDelaySchedule:
		if v.Delay < MinEvery {
			return nil, fmt.Errorf("%w: cron %q: the interval must be at least %s", ErrInvalidSpec, expr, MinEvery)
		}
		s.every = v.Delay
	case *cron.SpecSchedule:
		c := *v
		c.Location = time.UTC
		s.fields = &c
		// An expression that never matches (30 February) has no slot
		// within cron/v3's five-year search.
		if s.Next(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).IsZero() {
			return nil, fmt.Errorf("%w: cron %q never matches a date", ErrInvalidSpec, expr)
		}
	default:
		return nil, fmt.Errorf("%w: cron %q: unsupported schedule", ErrInvalidSpec, expr)
	}
	return s, nil
}

// Location is the schedule's time zone.
func (s *Spec) Location() *time.Location { return s.loc }

// Next is the first slot strictly after t; zero when there is none within
// five years.
func (s *Spec) Next(t time.Time) time.Time {
	if s.every > 0 {
		// Whole seconds, as cron/v3 does.
		return t.Add(s.every).Truncate(time.Second)
	}
	w := t.In(s.loc)
	wall := time.Date(w.Year(), w.Month(), w.Day(), w.Hour(), w.Minute(), w.Second(), w.Nanosecond(), time.UTC)
	for range 1000 { // a few steps past a repeated hour at most
		wall = s.fields.Next(wall)
		if wall.IsZero() {
			return time.Time{}
		}
		if at := s.place(wall); at.After(t) {
			return at
		}
	}
	return time.Time{}
}

// place puts a wall time (its fields, in UTC) on the time line of the
// zone: the first instant showing it, or the instant of the jump that
// skips it.
func (s *Spec) place(wall time.Time) time.Time {
	t := time.Date(wall.Year(), wall.Month(), wall.Day(), wall.Hour(), wall.Minute(), wall.Second(), 0, s.loc)
	if !sameWall(t, wall) {
		// Skipped by a jump: t is on one side of it.
		start, end := t.ZoneBounds()
		if wallOf(t).After(wall) {
			return start
		}
		return end
	}
	// Repeated by a fall-back: the first occurrence is in the zone period
	// before t's, if that period shows the same wall time.
	if start, _ := t.ZoneBounds(); !start.IsZero() {
		_, off := start.Add(-time.Nanosecond).Zone()
		earlier := wall.Add(-time.Duration(off) * time.Second)
		if earlier.Before(t) && sameWall(earlier.In(s.loc), wall) {
			return earlier.In(s.loc)
		}
	}
	return t
}

func wallOf(t time.Time) time.Time {
	return time.Date(t.Year(), t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), 0, time.UTC)
}

func sameWall(t, wall time.Time) bool { return wallOf(t).Equal(wall.Truncate(time.Second)) }

// After is the first slot later than t of the schedule whose previous
// slot (or start) is anchor. A 5-field expression's slots are fixed on the
// calendar; "@every" slots are anchor's first slot plus whole intervals, so
// a late wake-up or a leader change never shifts them.
func (s *Spec) After(anchor, t time.Time) time.Time {
	if s.every <= 0 || t.Before(anchor) {
		return s.Next(t)
	}
	base := s.Next(anchor)
	if t.Before(base) {
		return base
	}
	return base.Add((t.Sub(base)/s.every + 1) * s.every)
}

// Newest is the latest slot in (anchor, until] of the schedule anchored
// at anchor; false when there is none.
func (s *Spec) Newest(anchor, until time.Time) (time.Time, bool) {
	if !until.After(anchor) {
		return time.Time{}, false
	}
	if s.every > 0 {
		base := s.Next(anchor)
		if base.After(until) {
			return time.Time{}, false
		}
		return base.Add(until.Sub(base) / s.every * s.every), true
	}
	// Look back from until over doubling spans: a 5-field slot is at most
	// a few years (29 February) before the next.
	for span := time.Minute; span < 10*366*24*time.Hour; span *= 2 {
		from := until.Add(-span)
		if from.Before(anchor) {
			from = anchor
		}
		var last time.Time
		for t := s.Next(from); !t.IsZero() && !t.After(until); t = s.Next(t) {
			last = t
		}
		if !last.IsZero() {
			return last, true
		}
		if !from.After(anchor) {
			return time.Time{}, false
		}
	}
	return time.Time{}, false
}

// Slots lists the slots in (after, until] of the schedule anchored at
// anchor, at most max of them (the earliest), and whether there are more.
func (s *Spec) Slots(anchor, after, until time.Time, max int) (slots []time.Time, more bool) {
	for t := s.After(anchor, after); !t.IsZero() && !t.After(until); t = s.After(anchor, t) {
		if len(slots) == max {
			return slots, true
		}
		slots = append(slots, t)
	}
	return slots, false
}
