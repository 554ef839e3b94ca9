package observe

import (
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestTeeLevelsAndDrops: a monitor gets the records at its level whatever
// the output's level; the recent records are the output's; a monitor that
// does not read loses the records past its buffer, counted, and logging
// goes on.
func TestTeeLevelsAndDrops(t *testing.T) {
	levels := new(Levels)
	levels.SetLevel(slog.LevelInfo)
	var out strings.Builder
	tee := NewTee()
	logger := slog.New(tee.Handler(levels.Handler(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})))).With("component", "test")

	logger.Debug("before any monitor")
	sub := tee.Subscribe(slog.LevelDebug)
	logger.Debug("seen by the monitor", "k", 1)
	logger.WithGroup("g").Info("in a group", "k", 2, "took", 1500*time.Millisecond)
	e := <-sub.C()
	if got := e.Text(); !strings.Contains(got, "level=DEBUG") || !strings.Contains(got, `msg="seen by the monitor"`) || !strings.Contains(got, "component=test") {
		t.Errorf("monitor line %q", got)
	}
	if got := (<-sub.C()).JSON(); !strings.Contains(got, `"g":{"k":2,"took":"1.5s"}`) {
		t.Errorf("monitor JSON %q, want the group with the duration as text", got)
	}
	if strings.Contains(out.String(), "monitor") {
		t.Errorf("the output (info) has debug records:\n%s", out.String())
	}
	recent := tee.Recent(0)
	if len(recent) != 1 || !strings.Contains(recent[0].Text(), "in a group") {
		t.Errorf("recent = %d records, want the one info record", len(recent))
	}

	for range TeeBuffer + 10 {
		logger.Debug("flood")
	}
	if n := sub.Dropped(); n != 10 {
		t.Errorf("dropped %d, want 10", n)
	}
	sub.Close()
	if logger.Enabled(t.Context(), slog.LevelDebug) {
		t.Error("debug enabled after the only monitor closed")
	}
	for range TeeRecent + 5 {
		logger.Info("many")
	}
	if n := len(tee.Recent(0)); n != TeeRecent {
		t.Errorf("recent keeps %d, want %d", n, TeeRecent)
	}
	if n := len(tee.Recent(3)); n != 3 {
		t.Errorf("Recent(3) = %d records", n)
	}
}
