package observe

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"
	"time"
)

// HeaderRequestID carries a request's correlation ID: taken from the
// caller when it sends a usable one, else made here; returned to the
// caller, passed to backends and to the leader a write is forwarded to,
// and on every log line of the request.
const HeaderRequestID = "X-Request-Id"

type requestKey struct{}

// Request is what the API port knows of a call in progress; the access
// control fills in the identity.
type Request struct {
	ID       string
	Identity string
}

// WithRequest records the call in ctx.
func WithRequest(ctx context.Context, r *Request) context.Context {
	return context.WithValue(ctx, requestKey{}, r)
}

// RequestFrom returns the call of ctx.
func RequestFrom(ctx context.Context) (*Request, bool) {
	r, ok := ctx.Value(requestKey{}).(*Request)
	return r, ok
}

// requestID is the caller's ID when usable (1 to 128 printable ASCII
// characters), else a new one.
func requestID(given string) string {
	if n := len(given); n > 0 && n <= 128 {
		ok := true
		for i := range n {
			if c := given[i]; c < 0x21 || c > 0x7e {
				ok = false
				break
			}
		}
		if ok {
			return given
		}
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ReplaceAttr is the agent's slog.HandlerOptions.ReplaceAttr: a
// time.Duration renders as its String ("1.5s", "250ms") in both formats.
// The text handler does so already; the JSON handler would write an
// integer of nanoseconds.
func ReplaceAttr(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

// HandlerOptions returns slog options at level with ReplaceAttr.
func HandlerOptions(level slog.Leveler) *slog.HandlerOptions {
	return &slog.HandlerOptions{Level: level, ReplaceAttr: ReplaceAttr}
}

// Sampling is logging.sampling: per message and level, the first Initial
// entries of each second are logged, then every Thereafter-th; zero
// Initial logs everything.
type Sampling struct {
	Initial, Thereafter int
}

// NewHandler wraps h: records logged with a request's context carry its
// request_id, and the sampling applies.
func NewHandler(h slog.Handler, s Sampling, now func() time.Time) slog.Handler {
	if now == nil {
		now = time.Now
	}
	var sm *sampler
	if s.Initial > 0 {
		sm = &sampler{cfg: s, now: now, counts: map[sampleKey]int{}}
	}
	return &handler{inner: h, sampler: sm}
}

type handler struct {
	inner   slog.Handler
	sampler *sampler
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool { return h.inner.Enabled(ctx, l) }

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if h.sampler != nil && !exempt(r) && !h.sampler.keep(r.Level, r.Message) {
		return nil
	}
	if req, ok := RequestFrom(ctx); ok && req.ID != "" {
		r = r.Clone()
		r.AddAttrs(slog.String("request_id", req.ID))
	}
	return h.inner.Handle(ctx, r)
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &handler{inner: h.inner.WithAttrs(as), sampler: h.sampler}
}

func (h *handler) WithGroup(name string) slog.Handler {
	return &handler{inner: h.inner.WithGroup(name), sampler: h.sampler}
}

// exempt: audit records (audit=true) and the access log are never
// sampled away.
func exempt(r slog.Record) bool {
	if r.Message == "access" {
		return true
	}
	audit := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "audit" && a.Value.Kind() == slog.KindBool && a.Value.Bool() {
			audit = true
			return false
		}
		return true
	})
	return audit
}

type sampleKey struct {
	level slog.Level
	msg   string
}

// sampler counts messages per second (zap's sampling).
type sampler struct {
	cfg    Sampling
	now    func() time.Time
	mu     sync.Mutex
	second int64
	counts map[sampleKey]int
}

func (s *sampler) keep(l slog.Level, msg string) bool {
	sec := s.now().Unix()
	s.mu.Lock()
	defer s.mu.Unlock()
	if sec != s.second {
		s.second = sec
		clear(s.counts)
	}
	k := sampleKey{l, msg}
	s.counts[k]++
	n := s.counts[k]
	if n <= s.cfg.Initial {
		return true
	}
	return s.cfg.Thereafter > 0 && (n-s.cfg.Initial)%s.cfg.Thereafter == 0
}

// WithRequestIDs wraps h so that records logged with a request's context
// carry its request_id (once: a handler of this package is returned as
// it is).
func WithRequestIDs(h slog.Handler) slog.Handler {
	if _, ok := h.(*handler); ok {
		return h
	}
	return &handler{inner: h}
}
