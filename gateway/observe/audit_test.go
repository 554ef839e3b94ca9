package observe_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/gateway/observe"
)

// TestAuditIsNotALogLevel: with the level at error and the access
// component at error (what a caller with update on config can set), audit
// records of changes and denials are still written; an allowed read's audit
// record (debug) and ordinary records follow the levels.
func TestAuditIsNotALogLevel(t *testing.T) {
	var buf bytes.Buffer
	levels := new(observe.Levels)
	levels.SetLevel(slog.LevelError)
	levels.SetComponents(map[string]slog.Level{"access": slog.LevelError})
	logger := slog.New(levels.Handler(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))).With(observe.ComponentKey, "access")

	observe.Audit(logger, slog.LevelWarn, "audit: call denied", "identity", "mallory")
	observe.Audit(logger, slog.LevelInfo, "audit: call allowed", "verb", "update")
	observe.Audit(logger, slog.LevelDebug, "audit: call allowed", "verb", "get")
	logger.Warn("ordinary warning")

	out := buf.String()
	for _, want := range []string{`msg="audit: call denied" component=access audit=true identity=mallory`, `verb=update`} {
		if !strings.Contains(out, want) {
			t.Errorf("the audit trail lacks %q:\n%s", want, out)
		}
	}
	for _, not := range []string{"verb=get", "ordinary warning"} {
		if strings.Contains(out, not) {
			t.Errorf("%q passed the level error:\n%s", not, out)
		}
	}
}
