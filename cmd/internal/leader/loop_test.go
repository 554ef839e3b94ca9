package leader

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// loopHarness runs a Loop on a leadership channel the test drives and
// records the terms it starts and stops.
type loopHarness struct {
	t       *testing.T
	notify  chan bool
	leading atomic.Bool
	// started receives each term's context as it starts; revoked counts
	// the terms stopped.
	started chan context.Context
	revoked atomic.Int32
	loop    *Loop
	cancel  context.CancelFunc
	done    chan struct{}
}

func newLoopHarness(t *testing.T) *loopHarness {
	t.Helper()
	h := &loopHarness{t: t, notify: make(chan bool), started: make(chan context.Context, 16), done: make(chan struct{})}
	h.loop = NewLoop(LoopConfig{
		Subscribe: func() (<-chan bool, func()) { return h.notify, func() {} },
		IsLeader:  h.leading.Load,
		Start: func(ctx context.Context, wg *sync.WaitGroup) {
			wg.Go(func() { <-ctx.Done() }) // work that runs for the term
			h.started <- ctx
		},
		Revoked: func() { h.revoked.Add(1) },
	})
	ctx, cancel := context.WithCancel(t.Context())
	h.cancel = cancel
	go func() {
		defer close(h.done)
		h.loop.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-h.done
	})
	return h
}

func (h *loopHarness) send(leader bool) {
	h.t.Helper()
	h.leading.Store(leader)
	select {
	case h.notify <- leader:
	case <-time.After(10 * time.Second):
		h.t.Fatal("the loop did not take the notification")
	}
}

// term waits for the next term to start.
func (h *loopHarness) term() context.Context {
	h.t.Helper()
	select {
	case ctx := <-h.started:
		return ctx
	case <-time.After(10 * time.Second):
		h.t.Fatal("no term started")
		return nil
	}
}

// noTerm checks that no term started. Pause returns once the loop has
// taken everything sent before it and stopped any term that started (whose
// Start has then returned and been recorded); the loop stays paused.
func (h *loopHarness) noTerm() {
	h.t.Helper()
	h.loop.Pause()
	select {
	case <-h.started:
		h.t.Fatal("a term started")
	default:
	}
}

func stopped(ctx context.Context) bool { return ctx.Err() != nil }

func TestLoopTerms(t *testing.T) {
	h := newLoopHarness(t)
	h.send(true)
	t1 := h.term()
	h.send(false)
	h.loop.Pause() // the loop is past the notification
	if !stopped(t1) || h.revoked.Load() != 1 {
		t.Fatalf("leadership lost: term stopped %v, revoked %d", stopped(t1), h.revoked.Load())
	}
	h.leading.Store(false)
	h.loop.Resume()

	// A second "true" without a "false" between: a new term.
	h.send(true)
	t2 := h.term()
	h.send(true)
	t3 := h.term()
	if !stopped(t2) || stopped(t3) {
		t.Fatalf("leadership regained: old term stopped %v, new term stopped %v", stopped(t2), stopped(t3))
	}

	h.cancel()
	<-h.done
	if !stopped(t3) {
		t.Fatal("the term outlived the loop")
	}
}

func TestLoopPause(t *testing.T) {
	h := newLoopHarness(t)
	h.send(true)
	t1 := h.term()

	// Pause returns once the term has stopped; Resume starts a new one.
	h.loop.Pause()
	if !stopped(t1) {
		t.Fatal("Pause returned with the term running")
	}
	h.loop.Resume()
	t2 := h.term()

	// Pauses nest: only the last Resume starts a term.
	h.loop.Pause()
	h.loop.Pause()
	h.loop.Resume()
	if !stopped(t2) {
		t.Fatal("term running during a nested pause")
	}
	h.noTerm() // a third pause
	h.loop.Resume()
	h.loop.Resume()
	h.term()

	// Leadership lost and regained during a pause: nothing starts until
	// the Resume, which starts one term.
	h.loop.Pause()
	h.send(false)
	h.send(true)
	h.noTerm()
	h.loop.Resume()
	h.loop.Resume()
	h.term()

	// Lost during a pause: the Resume starts nothing.
	h.loop.Pause()
	h.send(false)
	h.loop.Resume()
	h.noTerm()
}

func TestLoopEndsWithTheNotifications(t *testing.T) {
	h := newLoopHarness(t)
	h.send(true)
	t1 := h.term()
	close(h.notify)
	select {
	case <-h.done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return when the notifications ended")
	}
	if !stopped(t1) {
		t.Fatal("the term outlived the loop")
	}
	// Pause and Resume return once the loop is gone.
	h.loop.Pause()
	h.loop.Resume()
}
