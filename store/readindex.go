package store

import (
	"context"
	"fmt"
	"sync"
)

// readRounds batches the leadership checks of concurrent ReadIndex calls:
// one VerifyLeader round at a time is in flight, and it serves every call
// that arrived before it started. A call that arrives while a round is in
// flight joins the next round, which starts when the current one ends. So
// every call waits for a round that started after it arrived: the commit
// index that round read, and the quorum that confirmed the leadership,
// come after the call, as a read index of its own would.
type readRounds struct {
	mu sync.Mutex
	// running is set while a round's goroutine is at work.
	running bool
	// next is the round the calls arriving now join; nil until one does.
	next *readRound
	// started counts the rounds started; read by tests.
	started uint64
	// waiting counts the calls that joined next; read by tests.
	waiting int
	// beforeVerify, when set, is called by a round after it read the
	// commit index and before it asks for VerifyLeader. Tests use it to
	// hold a round in flight.
	beforeVerify func()
}

// readRound is one VerifyLeader round and its outcome, shared by the calls
// that joined it.
type readRound struct {
	done  chan struct{} // closed when index and err are set
	index uint64
	err   error
}

// ReadIndex returns the index a linearizable read must wait for, on this
// server or on a follower, before it reads its local FSM: the commit index,
// read before VerifyLeader confirmed with a quorum that this server is still
// the leader, moved down to the last entry at or below it that the FSM is
// handed. (Raft gives the FSM commands and configuration changes, never its
// no-op and barrier entries, so an FSM's applied index may never equal a
// commit index that ends on one of those.) Every write acknowledged before
// the call is at or below it, and so is everything any FSM, follower or
// leader, may already have applied: a read that waits for it never sees less
// than a read that came before. Leader only, and only meaningful once the
// leader has passed its Barrier for the current term.
//
// Concurrent calls share rounds (readRounds): the cost of a quorum round
// trip is paid once per round, not once per read.
func (s *Store) ReadIndex(ctx context.Context) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("read index: verify leader: %w", contextError(ctx))
	}
	b := &s.reads
	b.mu.Lock()
	r := b.next
	if r == nil {
		r = &readRound{done: make(chan struct{})}
		b.next = r
	}
	start := !b.running
	if start {
		b.running = true
		b.next = nil
		b.started++
	} else {
		b.waiting++
	}
	b.mu.Unlock()
	if start {
		go s.runReadRounds(r)
	}
	select {
	case <-r.done:
	case <-ctx.Done():
		select {
		case <-r.done:
		default:
			return 0, fmt.Errorf("read index: verify leader: %w", contextError(ctx))
		}
	}
	if r.err != nil {
		return 0, fmt.Errorf("read index: verify leader: %w", r.err)
	}
	return r.index, nil
}

// runReadRounds runs round r, then every round that calls joined while one
// was in flight, until none is waiting. The rounds are not bound to any
// caller's context: others wait on them. Each ends with raft's answer or
// with Close.
func (s *Store) runReadRounds(r *readRound) {
	b := &s.reads
	b.mu.Lock()
	hook := b.beforeVerify
	b.mu.Unlock()
	for {
		commit := s.raft.CommitIndex()
		if hook != nil {
			hook()
		}
		f := s.raft.VerifyLeader()
		select {
		case err := <-errorOf(f):
			r.err = mapRaftError(err)
		case <-s.closing:
			r.err = ErrShutdown
		}
		if r.err == nil {
			r.index = s.lastFSMEntry(commit)
		}
		close(r.done)

		b.mu.Lock()
		r = b.next
		if r == nil {
			b.running = false
			b.mu.Unlock()
			return
		}
		b.next = nil
		b.started++
		b.waiting = 0
		hook = b.beforeVerify
		b.mu.Unlock()
	}
}

// errorOf delivers a future's error on a channel.
func errorOf(f interface{ Error() error }) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f.Error() }()
	return ch
}
