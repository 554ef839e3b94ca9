package scheduler

import (
	"strings"
	"testing"
	"time"
)

func mustZone(t *testing.T, name string) *time.Location {
	t.Helper()
	l, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// slots returns the first n slots after from, in UTC RFC 3339.
func slots(t *testing.T, expr, zone string, from time.Time, n int) []string {
	t.Helper()
	s, err := ParseSpec(expr, zone)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	at := from
	for range n {
		at = s.Next(at)
		out = append(out, at.UTC().Format(time.RFC3339))
	}
	return out
}

func TestSpecSlots(t *testing.T) {
	ny, bud := mustZone(t, "America/New_York"), mustZone(t, "Europe/Budapest")
	utc := func(y int, m time.Month, d, h, min int) time.Time { return time.Date(y, m, d, h, min, 0, 0, time.UTC) }
	for _, tc := range []struct {
		name, expr, zone string
		from             time.Time
		want             []string
	}{
		{"hourly", "@hourly", "", utc(2026, 1, 1, 10, 15), []string{"2026-01-01T11:00:00Z", "2026-01-01T12:00:00Z"}},
		{"daily in a zone", "@daily", "Europe/Budapest", utc(2026, 1, 1, 10, 15), []string{"2026-01-01T23:00:00Z", "2026-01-02T23:00:00Z"}},
		{"weekly is Sunday midnight", "@weekly", "", utc(2026, 1, 1, 0, 0), []string{"2026-01-04T00:00:00Z", "2026-01-11T00:00:00Z"}},
		{"monthly", "@monthly", "", utc(2026, 1, 15, 0, 0), []string{"2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z"}},
		{"yearly", "@yearly", "", utc(2026, 6, 1, 0, 0), []string{"2027-01-01T00:00:00Z", "2028-01-01T00:00:00Z"}},
		{"every 90m", "@every 90m", "America/New_York", utc(2026, 3, 8, 5, 0), []string{"2026-03-08T06:30:00Z", "2026-03-08T08:00:00Z"}},
		{"weekdays at 8", "0 8 * * 1-5", "", utc(2026, 1, 2, 9, 0), []string{"2026-01-05T08:00:00Z", "2026-01-06T08:00:00Z"}},
		// Month ends: the 31st exists in some months only.
		{"31st", "0 0 31 * *", "", utc(2026, 1, 31, 1, 0), []string{"2026-03-31T00:00:00Z", "2026-05-31T00:00:00Z"}},
		{"30th skips February", "0 0 30 * *", "", utc(2026, 1, 30, 1, 0), []string{"2026-03-30T00:00:00Z", "2026-04-30T00:00:00Z"}},
		// Leap day: every four years.
		{"leap day", "0 0 29 2 *", "", utc(2025, 3, 1, 0, 0), []string{"2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"}},
		// New York, spring forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z):
		// the 02:30 slot runs once, at the jump.
		{"NY skipped hour", "30 2 * * *", "America/New_York", utc(2026, 3, 7, 12, 0), []string{"2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"}},
		// Every 15 minutes through the jump: 01:30, 01:45 EST, then the
		// slots of the skipped hour and 03:00 EDT collapse into one.
		{"NY quarter hours over the jump", "*/15 * * * *", "America/New_York", utc(2026, 3, 8, 6, 15), []string{"2026-03-08T06:30:00Z", "2026-03-08T06:45:00Z", "2026-03-08T07:00:00Z", "2026-03-08T07:15:00Z"}},
		// New York, fall back 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z): the
		// 01:30 slot runs once (its first occurrence, EDT).
		{"NY repeated hour", "30 1 * * *", "America/New_York", utc(2026, 10, 31, 12, 0), []string{"2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"}},
		{"NY half hours over the repeat", "*/30 * * * *", "America/New_York", utc(2026, 11, 1, 4, 15), []string{"2026-11-01T04:30:00Z", "2026-11-01T05:00:00Z", "2026-11-01T05:30:00Z", "2026-11-01T07:00:00Z"}},
		// Budapest, spring 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z); fall
		// 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z).
		{"Budapest skipped hour", "30 2 * * *", "Europe/Budapest", utc(2026, 3, 28, 12, 0), []string{"2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"}},
		{"Budapest repeated hour", "30 2 * * *", "Europe/Budapest", utc(2026, 10, 24, 12, 0), []string{"2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"}},
		// Lord Howe shifts by 30 minutes (2026-10-04 02:00 -> 02:30).
		{"Lord Howe half-hour jump", "15 2 * * *", "Australia/Lord_Howe", utc(2026, 10, 3, 0, 0), []string{"2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"}},
	} {
		got := slots(t, tc.expr, tc.zone, tc.from, len(tc.want))
		if strings.Join(got, " ") != strings.Join(tc.want, " ") {
			t.Errorf("%s (%q in %q after %s):\n got %v\nwant %v", tc.name, tc.expr, tc.zone, tc.from.Format(time.RFC3339), got, tc.want)
		}
	}
	_, _ = ny, bud
}

// TestSpecDailyAroundTheYear: a daily job runs exactly once on every day
// of a year with two DST changes, in several zones.
func TestSpecDailyAroundTheYear(t *testing.T) {
	for _, zone := range []string{"America/New_York", "Europe/Budapest", "Australia/Lord_Howe", "UTC"} {
		for _, expr := range []string{"30 2 * * *", "0 1 * * *", "59 23 * * *"} {
			s, err := ParseSpec(expr, zone)
			if err != nil {
				t.Fatal(err)
			}
			loc := s.Location()
			start := time.Date(2026, 1, 1, 0, 0, 0, 0, loc)
			days := map[string]int{}
			prev := start
			for at := s.Next(start); at.Year() == 2026; at = s.Next(at) {
				if !at.After(prev) {
					t.Fatalf("%s %s: slot %s not after %s", zone, expr, at, prev)
				}
				prev = at
				days[at.In(loc).Format("2006-01-02")]++
			}
			if len(days) != 365 {
				t.Errorf("%s %s: slots on %d days of 2026, want 365", zone, expr, len(days))
			}
			for d, n := range days {
				if n != 1 {
					t.Errorf("%s %s: %d slots on %s", zone, expr, n, d)
				}
			}
		}
	}
}

func TestParseSpecErrors(t *testing.T) {
	for _, tc := range []struct{ expr, zone, want string }{
		{"", "", "cron: required"},
		{"* * * *", "", "want minute hour day-of-month month weekday"},
		{"0 0 * * * *", "", "want minute hour"},
		{"61 * * * *", "", "61"},
		{"@fortnightly", "", "unrecognized descriptor"},
		{"@every 500ms", "", "at least 1s"},
		{"@every soon", "", "failed to parse duration"},
		{"CRON_TZ=Europe/Budapest 0 8 * * *", "", "set the zone in time_zone"},
		{"0 8 30 2 *", "", "never matches"},
		{"0 8 * * *", "Mars/Olympus", `time_zone "Mars/Olympus" is not an IANA time zone`},
		{"0 8 * * *", "Local", "is not an IANA time zone"},
	} {
		_, err := ParseSpec(tc.expr, tc.zone)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSpec(%q, %q) = %v, want an error with %q", tc.expr, tc.zone, err, tc.want)
		}
	}
}

func TestSlotsBounded(t *testing.T) {
	s, err := ParseSpec("@every 1s", "")
	if err != nil {
		t.Fatal(err)
	}
	from := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	got, more := s.Slots(from, from, from.Add(time.Hour), 100)
	if len(got) != 100 || !more || !got[0].Equal(from.Add(time.Second)) {
		t.Errorf("Slots: %d slots (more %v), first %v", len(got), more, got[0])
	}
	got, more = s.Slots(from, from, from.Add(5*time.Second), 100)
	if len(got) != 5 || more {
		t.Errorf("Slots over 5 s: %d (more %v)", len(got), more)
	}
}
