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
