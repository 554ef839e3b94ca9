package scheduler

import (
	"errors"
	"testing"
	"time"
)

// FuzzParseSpec feeds arbitrary cron expressions and zones to ParseSpec:
// it must not panic, must refuse with ErrInvalidSpec, and an accepted spec
// must produce slots strictly after the time asked, in order, bounded.
func FuzzParseSpec(f *testing.F) {
	for _, s := range [][2]string{
		{"0 22 * * 1-5", "Europe/Budapest"}, {"@daily", ""}, {"@every 90s", "UTC"}, {"*/15 2 * * *", "America/New_York"},
		{"30 2 31 2 *", ""}, {"0 0 29 2 *", "Australia/Lord_Howe"}, {"@every 0s", ""}, {"61 * * * *", ""}, {"TZ=UTC 0 * * * *", ""},
		{"@yearly", "Local"}, {"* * * * * *", ""}, {"@every -1h", ""},
	} {
		f.Add(s[0], s[1], int64(1764460800))
	}
	f.Fuzz(func(t *testing.T, expr, zone string, unix int64) {
		s, err := ParseSpec(expr, zone)
		if err != nil {
			if !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("ParseSpec error %v wraps no ErrInvalidSpec", err)
			}
			return
		}
		// Keep t in years cron handles (1970..2200).
		t0 := time.Unix(unix%(230*365*86400), 0).UTC()
		if t0.Before(time.Unix(0, 0)) {
			t0 = time.Unix(0, 0).UTC()
		}
		if n := s.Next(t0); !n.IsZero() && !n.After(t0) {
			t.Fatalf("Next(%s) = %s, not after it", t0, n)
		}
		slots, more := s.Slots(t0, t0, t0.Add(48*time.Hour), 50)
		if len(slots) > 50 || (more && len(slots) != 50) {
			t.Fatalf("Slots: %d slots, more %v", len(slots), more)
		}
		for i, sl := range slots {
			if !sl.After(t0) || sl.After(t0.Add(48*time.Hour)) || (i > 0 && !sl.After(slots[i-1])) {
				t.Fatalf("Slots out of range or order at %d: %v", i, slots)
			}
		}
		if n, ok := s.Newest(t0, t0.Add(48*time.Hour)); ok && (len(slots) == 0 || n.Before(slots[len(slots)-1])) {
			t.Fatalf("Newest = %s, but the slots listed go to %v", n, slots)
		}
	})
}
