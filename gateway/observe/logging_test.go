package observe

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestSamplingAndRequestID(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1_800_000_000, 0)
	logger := slog.New(NewHandler(slog.NewTextHandler(&buf, nil), Sampling{Initial: 2, Thereafter: 3}, func() time.Time { return now }))
	for range 10 {
		logger.Info("busy")
	}
	logger.Info("other")
	if got := strings.Count(buf.String(), "msg=busy"); got != 4 { // 1, 2, 5, 8
		t.Errorf("%d of 10 equal messages logged in one second, want 4 (initial 2, then every 3rd)", got)
	}
	if !strings.Contains(buf.String(), "msg=other") {
		t.Error("another message was sampled away")
	}
	now = now.Add(time.Second)
	buf.Reset()
	logger.Info("busy")
	if !strings.Contains(buf.String(), "msg=busy") {
		t.Error("the next second starts again")
	}

	buf.Reset()
	ctx := WithRequest(context.Background(), &Request{ID: "req-1"})
	logger.With("component", "x").InfoContext(ctx, "handled")
	if !strings.Contains(buf.String(), "request_id=req-1") || !strings.Contains(buf.String(), "component=x") {
		t.Errorf("line %q lacks the request ID or the logger's attributes", buf.String())
	}
}

func TestRequestIDAccepted(t *testing.T) {
	for given, keep := range map[string]bool{"abc-123": true, "": false, "has space": false, strings.Repeat("x", 129): false, "ünicode": false} {
		got := requestID(given)
		if (got == given) != keep || got == "" {
			t.Errorf("requestID(%q) = %q, keep %v", given, got, keep)
		}
	}
}

func TestComponentLevels(t *testing.T) {
	var buf bytes.Buffer
	var levels Levels
	levels.SetLevel(slog.LevelInfo)
	log := slog.New(levels.Handler(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	raft, access := log.With(ComponentKey, "raft"), log.With("node", "n1").With(ComponentKey, "access")
	lines := func() string { defer buf.Reset(); return buf.String() }

	log.Debug("d0")
	raft.Debug("d1")
	access.Info("i1")
	if got := lines(); strings.Contains(got, "d0") || strings.Contains(got, "d1") || !strings.Contains(got, "i1") {
		t.Errorf("at info: %q", got)
	}
	levels.SetComponents(map[string]slog.Level{"raft": slog.LevelDebug, "access": slog.LevelWarn})
	log.Debug("d2")
	raft.Debug("d3")
	access.Info("i2")
	access.Warn("w2")
	if got := lines(); strings.Contains(got, "d2") || !strings.Contains(got, "d3") || strings.Contains(got, "i2") || !strings.Contains(got, "w2") {
		t.Errorf("with component levels: %q", got)
	}
	if raft.Enabled(context.Background(), slog.LevelDebug) != true || access.Enabled(context.Background(), slog.LevelInfo) {
		t.Error("Enabled does not follow the component levels")
	}
	levels.SetComponents(nil)
	levels.SetLevel(slog.LevelDebug)
	access.Debug("d4")
	if got := lines(); !strings.Contains(got, "d4") {
		t.Errorf("after the components are removed: %q", got)
	}
}
