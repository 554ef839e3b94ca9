package observe

import (
	"context"
	"log/slog"
	"sync/atomic"
)

// ComponentKey is the attribute that names the part of the program a
// logger belongs to (logger.With(ComponentKey, "raft")).
const ComponentKey = "component"

// Levels decides which records a logger passes: one level for the whole
// program and, optionally, one per component (the ComponentKey attribute a
// logger was given with With). Both change live.
type Levels struct {
	base       slog.LevelVar
	components atomic.Pointer[map[string]slog.Level]
}

// SetLevel sets the level of every component without one of its own.
func (l *Levels) SetLevel(v slog.Level) { l.base.Set(v) }

// Level is the level of components without one of their own.
func (l *Levels) Level() slog.Level { return l.base.Level() }

// SetComponents sets the components' own levels (nil or empty: none).
func (l *Levels) SetComponents(m map[string]slog.Level) {
	c := make(map[string]slog.Level, len(m))
	for k, v := range m {
		c[k] = v
	}
	l.components.Store(&c)
}

func (l *Levels) enabled(component string, v slog.Level) bool {
	if m := l.components.Load(); m != nil && component != "" {
		if min, ok := (*m)[component]; ok {
			return v >= min
		}
	}
	return v >= l.base.Level()
}

// Handler wraps h, which should pass every level the program logs at:
// Levels decides.
func (l *Levels) Handler(h slog.Handler) slog.Handler { return &levelHandler{inner: h, levels: l} }

type levelHandler struct {
	inner     slog.Handler
	levels    *Levels
	component string
}

func (h *levelHandler) Enabled(ctx context.Context, v slog.Level) bool {
	return (audited(ctx) || h.levels.enabled(h.component, v)) && h.inner.Enabled(ctx, v)
}

func (h *levelHandler) Handle(ctx context.Context, r slog.Record) error {
	if !audited(ctx) && !h.levels.enabled(h.component, r.Level) {
		return nil
	}
	return h.inner.Handle(ctx, r)
}

func (h *levelHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := h.component
	for _, a := range attrs {
		if a.Key == ComponentKey {
			c = a.Value.String()
		}
	}
	return &levelHandler{inner: h.inner.WithAttrs(attrs), levels: h.levels, component: c}
}

func (h *levelHandler) WithGroup(name string) slog.Handler {
	return &levelHandler{inner: h.inner.WithGroup(name), levels: h.levels, component: h.component}
}
