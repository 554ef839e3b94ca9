package access

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"time"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// Bounds on what a caller may hold on the API port (gateway/access/DESIGN.md,
// "Before the body").
const (
	// DefaultMaxStreams is how many streaming calls one caller may hold
	// open at once (Config.MaxStreams).
	DefaultMaxStreams = 128
	// DefaultBodyTimeout is how long a one-message request body may take
	// to arrive (Config.BodyTimeout).
	DefaultBodyTimeout = 30 * time.Second
	// maxAuthInFlight is how many calls of one source may be between
	// their headers and the end of their authentication at once (a
	// verification may wait for the issuer's keys).
	maxAuthInFlight = 32
)

// counters counts held things per key; keys at zero are dropped.
type counters struct {
	mu sync.Mutex
	n  map[string]int
}

// take counts one more for key unless it holds limit already.
func (c *counters) take(key string, limit int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = make(map[string]int)
	}
	if limit > 0 && c.n[key] >= limit {
		return false
	}
	c.n[key]++
	return true
}

func (c *counters) give(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[key] <= 1 {
		delete(c.n, key)
		return
	}
	c.n[key]--
}

// holdStream counts a streaming call against its caller's bound (an
// identity; a source address for the open methods, which need no
// credentials) until release is called.
func (g *Guard) holdStream(ctx context.Context, c call) (release func(), err error) {
	// grpc-go reports every call of the proxy as a stream: the method's
	// own shape decides.
	if md := g.lookup(c.procedure).md; g.cfg.MaxStreams < 0 || c.via != "" || (md != nil && !md.IsStreamingClient() && !md.IsStreamingServer()) {
		return func() {}, nil
	}
	key := "source " + sourceOf(c.remote)
	if who, ok := authz.PrincipalFrom(ctx); ok {
		key = "identity " + who.Identity
	}
	if !g.streams.take(key, g.cfg.MaxStreams) {
		g.denied.WithLabelValues("streams").Inc()
		return nil, &denial{code: codeResourceExhausted,
			msg: fmt.Sprintf("%s holds %d open streams, the most one caller may (server.connectrpc.max_streams_per_caller); close one first", key, g.cfg.MaxStreams)}
	}
	return func() { g.streams.give(key) }, nil
}

// bodyDoneKey holds what ends a call's body timeout once its one request
// message is in (a *bodyWatch).
type bodyDoneKey struct{}

type bodyWatch struct {
	once sync.Once
	stop func()
}

// arrived stops the body timeout; later calls do nothing.
func (b *bodyWatch) arrived() { b.once.Do(b.stop) }

// armBodyTimer ends the grpc-go call of ctx unless its request message
// arrives within the body timeout (one-message requests: unary and
// server-streaming methods); bodyArrived stops it.
func (g *Guard) armBodyTimer(ctx context.Context, c call, m *method) context.Context {
	if g.cfg.BodyTimeout <= 0 || m.md == nil || m.md.IsStreamingClient() {
		return ctx
	}
	ctx, cancel := context.WithCancel(ctx)
	t := time.AfterFunc(g.cfg.BodyTimeout, func() {
		if ctx.Err() != nil {
			return // the call ended first (refused, failed)
		}
		g.slowBody(c)
		cancel()
	})
	return context.WithValue(ctx, bodyDoneKey{}, &bodyWatch{stop: func() { t.Stop() }})
}

func (g *Guard) slowBody(c call) {
	g.denied.WithLabelValues("slow_body").Inc()
	g.cfg.Logger.Info("call ended: its request did not arrive within the body timeout", "method", c.procedure, "remote", c.remote,
		"timeout", g.cfg.BodyTimeout)
}

// StopBodyTimer ends the body timeout TapHandle armed in ctx, for a call
// refused after it (by another tap check).
func StopBodyTimer(ctx context.Context) { bodyArrived(ctx) }

// bodyArrived ends ctx's body timeout: the request message is in.
func bodyArrived(ctx context.Context) {
	if b, ok := ctx.Value(bodyDoneKey{}).(*bodyWatch); ok {
		b.arrived()
	}
}

// setBodyDeadline gives a one-message request body on net/http the body
// timeout to arrive (HTTP/1.1 and HTTP/2 alike): a read deadline, lifted
// when the body ends or the handler has its message, so a long call is
// not cut short (net/http/1.1 cancels a request whose connection read
// times out).
func (g *Guard) setBodyDeadline(w http.ResponseWriter, r *http.Request, c call, m *method) *http.Request {
	if g.cfg.BodyTimeout <= 0 || m.md == nil || m.md.IsStreamingClient() {
		return r
	}
	rc := http.NewResponseController(w)
	if rc.SetReadDeadline(time.Now().Add(g.cfg.BodyTimeout)) != nil {
		return r
	}
	watch := &bodyWatch{stop: func() { _ = rc.SetReadDeadline(time.Time{}) }}
	r = r.WithContext(context.WithValue(r.Context(), bodyDoneKey{}, watch))
	r.Body = &deadlineBody{ReadCloser: r.Body, watch: watch, timedOut: func() { g.slowBody(c) }}
	return r
}

// deadlineBody lifts the read deadline when the body ends.
type deadlineBody struct {
	io.ReadCloser
	watch    *bodyWatch
	timedOut func()
	logged   sync.Once
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == io.EOF:
		b.watch.arrived()
	case errors.Is(err, os.ErrDeadlineExceeded):
		b.logged.Do(b.timedOut)
	}
	return n, err
}

// authInFlight bounds the calls of one source being authenticated at once.
func (g *Guard) authInFlight(src string) (release func(), err error) {
	if !g.authenticating.take(src, maxAuthInFlight) {
		g.denied.WithLabelValues("auth_flood").Inc()
		return nil, &denial{code: codeResourceExhausted, retry: time.Second,
			msg: fmt.Sprintf("too many calls from %s waiting for authentication", src)}
	}
	return func() { g.authenticating.give(src) }, nil
}
