package observe

import (
	"bytes"
	"context"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// TeeRecent is how many of the last records a Tee keeps (Recent).
const TeeRecent = 1000

// TeeBuffer is how many records a monitor may fall behind before the
// next ones are dropped (and counted) for it.
const TeeBuffer = 1024

// Tee copies a logger's records to monitors (Subscribe), each at its own
// level whatever level the logger's output passes (a monitor at debug sees
// debug records while the log file takes info), and keeps the last
// TeeRecent records the output was given (Recent). Logging never waits
// for a monitor: a monitor that falls TeeBuffer records behind loses the
// next ones, counted.
type Tee struct {
	mu   sync.Mutex
	subs map[*Subscription]struct{}
	// min is the lowest level a monitor asked for (math.MaxInt64: none),
	// read on every Enabled.
	min atomic.Int64

	ringMu sync.Mutex
	ring   []Entry
	next   int
}

// NewTee returns a Tee without monitors.
func NewTee() *Tee {
	t := &Tee{subs: map[*Subscription]struct{}{}}
	t.min.Store(math.MaxInt64)
	return t
}

// Entry is one record as a handler of the logger was given it, with the
// attributes and groups of the logger it was logged with.
type Entry struct {
	rec slog.Record
	ops []teeOp
}

// teeOp is one With or WithGroup of a logger.
type teeOp struct {
	attrs []slog.Attr
	group string
}

// Time is when the record was logged.
func (e Entry) Time() time.Time { return e.rec.Time }

// Level is the record's level.
func (e Entry) Level() slog.Level { return e.rec.Level }

// Text renders the record as slog's text handler does (key=value), without
// the newline.
func (e Entry) Text() string { return e.render(false) }

// JSON renders the record as slog's JSON handler does, without the
// newline.
func (e Entry) JSON() string { return e.render(true) }

func (e Entry) render(json bool) string {
	var buf bytes.Buffer
	opts := HandlerOptions(slog.Level(math.MinInt32))
	var h slog.Handler
	if json {
		h = slog.NewJSONHandler(&buf, opts)
	} else {
		h = slog.NewTextHandler(&buf, opts)
	}
	for _, op := range e.ops {
		if op.group != "" {
			h = h.WithGroup(op.group)
		} else {
			h = h.WithAttrs(op.attrs)
		}
	}
	_ = h.Handle(context.Background(), e.rec)
	return string(bytes.TrimSuffix(buf.Bytes(), []byte("\n")))
}

// Subscription is one monitor of a Tee.
type Subscription struct {
	tee     *Tee
	level   slog.Level
	c       chan Entry
	dropped atomic.Uint64
	once    sync.Once
}

// Subscribe starts a monitor of the records at or above level; Close ends
// it.
func (t *Tee) Subscribe(level slog.Level) *Subscription {
	s := &Subscription{tee: t, level: level, c: make(chan Entry, TeeBuffer)}
	t.mu.Lock()
	t.subs[s] = struct{}{}
	t.updateMin()
	t.mu.Unlock()
	return s
}

// C delivers the records.
func (s *Subscription) C() <-chan Entry { return s.c }

// Dropped returns how many records were dropped since the last call.
func (s *Subscription) Dropped() uint64 { return s.dropped.Swap(0) }

// Close ends the monitor.
func (s *Subscription) Close() {
	s.once.Do(func() {
		t := s.tee
		t.mu.Lock()
		delete(t.subs, s)
		t.updateMin()
		t.mu.Unlock()
	})
}

// updateMin recomputes min; t.mu is held.
func (t *Tee) updateMin() {
	m := int64(math.MaxInt64)
	for s := range t.subs {
		m = min(m, int64(s.level))
	}
	t.min.Store(m)
}

// Recent returns the last n records the logger's output was given,
// oldest first (n <= 0: all kept, at most TeeRecent).
func (t *Tee) Recent(n int) []Entry {
	t.ringMu.Lock()
	defer t.ringMu.Unlock()
	var out []Entry
	if len(t.ring) < TeeRecent {
		out = append(out, t.ring...)
	} else {
		out = append(append(out, t.ring[t.next:]...), t.ring[:t.next]...)
	}
	if n > 0 && len(out) > n {
		out = out[len(out)-n:]
	}
	return out
}

func (t *Tee) keep(e Entry) {
	t.ringMu.Lock()
	defer t.ringMu.Unlock()
	if len(t.ring) < TeeRecent {
		t.ring = append(t.ring, e)
		return
	}
	t.ring[t.next] = e
	t.next = (t.next + 1) % TeeRecent
}

func (t *Tee) publish(e Entry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for s := range t.subs {
		if e.rec.Level < s.level {
			continue
		}
		select {
		case s.c <- e:
		default:
			s.dropped.Add(1)
		}
	}
}

// Handler wraps h, the logger's output (which decides its own level, e.g.
// Levels.Handler): records pass to h as before and are copied to the
// monitors and the recent records.
func (t *Tee) Handler(h slog.Handler) slog.Handler { return &teeHandler{tee: t, inner: h} }

type teeHandler struct {
	tee   *Tee
	inner slog.Handler
	ops   []teeOp
}

func (h *teeHandler) monitored(l slog.Level) bool { return int64(l) >= h.tee.min.Load() }

func (h *teeHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.monitored(l) || h.inner.Enabled(ctx, l)
}

func (h *teeHandler) Handle(ctx context.Context, r slog.Record) error {
	out := h.inner.Enabled(ctx, r.Level)
	mon := h.monitored(r.Level)
	if out || mon {
		c := r.Clone()
		if req, ok := RequestFrom(ctx); ok && req.ID != "" {
			c.AddAttrs(slog.String("request_id", req.ID))
		}
		e := Entry{rec: c, ops: h.ops}
		if out {
			h.tee.keep(e)
		}
		if mon {
			h.tee.publish(e)
		}
	}
	if !out {
		return nil
	}
	return h.inner.Handle(ctx, r)
}

func (h *teeHandler) WithAttrs(as []slog.Attr) slog.Handler {
	if len(as) == 0 {
		return h
	}
	return &teeHandler{tee: h.tee, inner: h.inner.WithAttrs(as), ops: append(h.ops[:len(h.ops):len(h.ops)], teeOp{attrs: as})}
}

func (h *teeHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return &teeHandler{tee: h.tee, inner: h.inner.WithGroup(name), ops: append(h.ops[:len(h.ops):len(h.ops)], teeOp{group: name})}
}
