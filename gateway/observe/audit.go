package observe

import (
	"context"
	"log/slog"
)

// auditKey marks the context of an audit record.
type auditKey struct{}

// Audit logs an audit record: msg with the attribute audit=true and args.
// Records at Info and above (changes, denials, break-glass) pass whatever
// the levels of Levels say: the audit trail is not a log level, and a
// cluster setting (logging.level, logging.components) cannot silence it.
// Below Info (the reads allowed) the levels decide, as for any record.
func Audit(logger *slog.Logger, level slog.Level, msg string, args ...any) {
	ctx := context.Background()
	if level >= slog.LevelInfo {
		ctx = context.WithValue(ctx, auditKey{}, true)
	}
	logger.Log(ctx, level, msg, append([]any{"audit", true}, args...)...)
}

// AuditEnabled reports whether Audit at level writes a record, so that a
// caller builds a record's attributes only when it does.
func AuditEnabled(logger *slog.Logger, level slog.Level) bool {
	return level >= slog.LevelInfo || logger.Enabled(context.Background(), level)
}

// audited reports whether ctx is an audit record's that levels do not
// filter.
func audited(ctx context.Context) bool {
	v, _ := ctx.Value(auditKey{}).(bool)
	return v
}
