// Package leader is the agent's work that follows the replicated state
// rather than serving it: the leadership term (what a node starts when it
// becomes leader, and stops when it is not), the cluster CA (the leader's
// signer and install loop, every node's renewals) and the cluster-wide RBAC
// policy (kept in force on every node as the replicated key changes).
//
// cmd/internal/agent wires it; see DESIGN.md in this directory.
package leader

import (
	"context"
	"log/slog"
	"sync"
)

// Starter starts the work of one leadership term: it runs until ctx (the
// term) ends, on goroutines it adds to wg.
type Starter func(ctx context.Context, wg *sync.WaitGroup)

// LoopConfig wires a [Loop].
type LoopConfig struct {
	// Subscribe returns the leadership notifications (true: this node
	// became leader; false: it lost leadership) and the cancel of the
	// subscription: store.Store's or etcdstore.Store's.
	Subscribe func() (<-chan bool, func())
	// IsLeader reports whether this node leads now, established or not;
	// asked when a pause ends.
	IsLeader func() bool
	// Start starts a term's work.
	Start Starter
	// Revoked is called after a term's work has stopped.
	Revoked func()
	Logger  *slog.Logger
}

// Loop runs one leadership term at a time: a fresh term on every "became
// leader" notification, torn down on "lost leadership", and paused around
// a snapshot restore on this node ([Loop.Pause], [Loop.Resume]).
type Loop struct {
	cfg      LoopConfig
	pauseCh  chan chan struct{}
	resumeCh chan struct{}
	done     chan struct{} // closed when Run returned
}

// NewLoop returns a loop; Run runs it.
func NewLoop(cfg LoopConfig) *Loop {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Revoked == nil {
		cfg.Revoked = func() {}
	}
	return &Loop{cfg: cfg, pauseCh: make(chan chan struct{}), resumeCh: make(chan struct{}), done: make(chan struct{})}
}

// Run follows leadership until ctx ends or the notifications end, and stops
// the term in force before it returns.
func (l *Loop) Run(ctx context.Context) {
	defer close(l.done)
	ch, unsubscribe := l.cfg.Subscribe()
	defer unsubscribe()
	var (
		t       *term
		leading bool // the last notification said "leader"
		paused  int  // restores in progress here
	)
	revoke := func(why string) {
		if t == nil {
			return
		}
		t.stop()
		t = nil
		l.cfg.Revoked()
		l.cfg.Logger.Info("leader state revoked", "reason", why)
	}
	defer revoke("agent stopping")
	for {
		select {
		case <-ctx.Done():
			return
		case done := <-l.pauseCh:
			paused++
			revoke("snapshot restore")
			close(done)
		case <-l.resumeCh:
			paused--
			if paused == 0 && leading && t == nil && l.cfg.IsLeader() {
				l.cfg.Logger.Info("re-establishing leader state after a snapshot restore")
				t = l.startTerm(ctx)
			}
		case isLeader, ok := <-ch:
			if !ok {
				return
			}
			leading = isLeader
			if !isLeader {
				revoke("leadership lost")
				continue
			}
			// A second "true" means leadership was lost and regained
			// between two notifications: establish the new term afresh.
			revoke("leadership regained")
			if paused == 0 {
				t = l.startTerm(ctx)
			}
		}
	}
}

// Pause stops the term's work before a snapshot restore on this node and
// returns once it has stopped. Pauses nest: the work starts again at the
// last Resume.
func (l *Loop) Pause() {
	done := make(chan struct{})
	select {
	case l.pauseCh <- done:
		<-done
	case <-l.done:
	}
}

// Resume ends a pause: the term's work starts again, from the (restored)
// state, if this node still leads; a leadership change during the pause
// is acted on now.
func (l *Loop) Resume() {
	select {
	case l.resumeCh <- struct{}{}:
	case <-l.done:
	}
}

// term is the work of one leadership term.
type term struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func (t *term) stop() {
	t.cancel()
	t.wg.Wait()
}

func (l *Loop) startTerm(ctx context.Context) *term {
	termCtx, cancel := context.WithCancel(ctx)
	t := &term{cancel: cancel}
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		l.cfg.Start(termCtx, &t.wg)
	}()
	return t
}
