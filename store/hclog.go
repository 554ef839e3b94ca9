package store

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"

	"github.com/hashicorp/go-hclog"
)

// LevelTrace is the slog level that hclog's Trace maps to.
const LevelTrace = slog.LevelDebug - 4

// hclogAdapter implements hclog.Logger on top of an *slog.Logger, so that
// hashicorp/raft (and its transport and snapshot store) log through the
// agent's structured logger. The level is owned by the slog handler:
// SetLevel is ignored and the Is* methods ask the handler.
type hclogAdapter struct {
	logger  *slog.Logger
	name    string
	implied []any
}

var _ hclog.Logger = (*hclogAdapter)(nil)

// newHCLogAdapter returns an hclog.Logger that writes to l with
// component=raft. A nil l discards everything.
func newHCLogAdapter(l *slog.Logger) *hclogAdapter {
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	return &hclogAdapter{logger: l.With("component", "raft")}
}

func slogLevel(l hclog.Level) slog.Level {
	switch l {
	case hclog.Trace:
		return LevelTrace
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default: // NoLevel, Info
		return slog.LevelInfo
	}
}

func (a *hclogAdapter) Log(level hclog.Level, msg string, args ...any) {
	if level == hclog.Off {
		return
	}
	lvl := slogLevel(level)
	ctx := context.Background()
	if !a.logger.Enabled(ctx, lvl) {
		return
	}
	var attrs []any
	if a.name != "" {
		attrs = append(attrs, "logger", a.name)
	}
	attrs = append(attrs, a.implied...)
	for _, v := range args {
		if f, ok := v.(hclog.Format); ok && len(f) > 0 {
			if format, ok := f[0].(string); ok {
				v = fmt.Sprintf(format, f[1:]...)
			}
		}
		attrs = append(attrs, v)
	}
	a.logger.Log(ctx, lvl, msg, attrs...)
}

func (a *hclogAdapter) Trace(msg string, args ...any) { a.Log(hclog.Trace, msg, args...) }
func (a *hclogAdapter) Debug(msg string, args ...any) { a.Log(hclog.Debug, msg, args...) }
func (a *hclogAdapter) Info(msg string, args ...any)  { a.Log(hclog.Info, msg, args...) }
func (a *hclogAdapter) Warn(msg string, args ...any)  { a.Log(hclog.Warn, msg, args...) }
func (a *hclogAdapter) Error(msg string, args ...any) { a.Log(hclog.Error, msg, args...) }

func (a *hclogAdapter) enabled(l slog.Level) bool {
	return a.logger.Enabled(context.Background(), l)
}

func (a *hclogAdapter) IsTrace() bool { return a.enabled(LevelTrace) }
func (a *hclogAdapter) IsDebug() bool { return a.enabled(slog.LevelDebug) }
func (a *hclogAdapter) IsInfo() bool  { return a.enabled(slog.LevelInfo) }
func (a *hclogAdapter) IsWarn() bool  { return a.enabled(slog.LevelWarn) }
func (a *hclogAdapter) IsError() bool { return a.enabled(slog.LevelError) }

func (a *hclogAdapter) ImpliedArgs() []any { return a.implied }

func (a *hclogAdapter) With(args ...any) hclog.Logger {
	c := *a
	c.implied = append(append([]any(nil), a.implied...), args...)
	return &c
}

func (a *hclogAdapter) Name() string { return a.name }

func (a *hclogAdapter) Named(name string) hclog.Logger {
	c := *a
	if c.name != "" {
		c.name += "." + name
	} else {
		c.name = name
	}
	return &c
}

func (a *hclogAdapter) ResetNamed(name string) hclog.Logger {
	c := *a
	c.name = name
	return &c
}

// SetLevel is a no-op: the slog handler decides what is logged.
func (a *hclogAdapter) SetLevel(hclog.Level) {}

func (a *hclogAdapter) GetLevel() hclog.Level {
	switch {
	case a.IsTrace():
		return hclog.Trace
	case a.IsDebug():
		return hclog.Debug
	case a.IsInfo():
		return hclog.Info
	case a.IsWarn():
		return hclog.Warn
	case a.IsError():
		return hclog.Error
	default:
		return hclog.Off
	}
}

func (a *hclogAdapter) StandardLogger(opts *hclog.StandardLoggerOptions) *log.Logger {
	return log.New(a.StandardWriter(opts), "", 0)
}

func (a *hclogAdapter) StandardWriter(opts *hclog.StandardLoggerOptions) io.Writer {
	if opts == nil {
		opts = &hclog.StandardLoggerOptions{}
	}
	return &stdWriter{a: a, infer: opts.InferLevels || opts.InferLevelsWithTimestamp, force: opts.ForceLevel}
}

// stdWriter turns lines written through a standard *log.Logger into log
// records, taking the level from a "[LEVEL]" prefix when asked to.
type stdWriter struct {
	a     *hclogAdapter
	infer bool
	force hclog.Level
}

var levelPrefixes = [...]struct {
	prefix string
	level  hclog.Level
}{
	{"[TRACE]", hclog.Trace},
	{"[DEBUG]", hclog.Debug},
	{"[INFO]", hclog.Info},
	{"[WARN]", hclog.Warn},
	{"[ERR]", hclog.Error},
	{"[ERROR]", hclog.Error},
}

func (w *stdWriter) Write(p []byte) (int, error) {
	for line := range bytes.Lines(p) {
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 {
			continue
		}
		level := hclog.Info
		if w.force != hclog.NoLevel {
			level = w.force
		}
		if w.infer {
			// Skip an optional timestamp before the level tag.
			if i := bytes.IndexByte(line, '['); i >= 0 {
				for _, lp := range levelPrefixes {
					if bytes.HasPrefix(line[i:], []byte(lp.prefix)) {
						level = lp.level
						line = bytes.TrimSpace(line[i+len(lp.prefix):])
						break
					}
				}
			}
		}
		w.a.Log(level, string(line))
	}
	return len(p), nil
}
