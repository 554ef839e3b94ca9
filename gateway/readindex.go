package gateway

import (
	"context"
	"sync"
	"time"
)

// readIndexTimeout bounds one ReadIndex round trip to the leader, which
// serves every read waiting for it (each read is still bounded by its own
// context).
const readIndexTimeout = 5 * time.Second

// readIndexBatcher shares ReadIndex round trips between the consistent reads
// a follower serves at the same time: at most one round per leader address
// is in flight, and reads that arrive meanwhile wait for the next round,
// which starts after all of them arrived (a round that started earlier
// could return an index older than a write acknowledged before such a
// read, so it must not answer it). Under load a follower then asks the
// leader about once per round trip instead of once per read, as etcd's
// linearizable read loop does.
type readIndexBatcher struct {
	ask func(ctx context.Context, internalAddr string) (uint64, error)

	mu    sync.Mutex
	addrs map[string]*readIndexQueue
}

// readIndexQueue is the state of one leader address.
type readIndexQueue struct {
	running bool
	next    *readIndexRound // the round not started yet, nil if none waits
}

// readIndexRound is one ReadIndex round trip and its waiters.
type readIndexRound struct {
	done    chan struct{}
	waiters int // reads waiting for it (guarded by the batcher's mu)
	index   uint64
	err     error
}

func newReadIndexBatcher(ask func(ctx context.Context, internalAddr string) (uint64, error)) *readIndexBatcher {
	return &readIndexBatcher{ask: ask, addrs: make(map[string]*readIndexQueue)}
}

// readIndex returns a read index from the leader at internalAddr, asked
// after this call began.
func (b *readIndexBatcher) readIndex(ctx context.Context, internalAddr string) (uint64, error) {
	b.mu.Lock()
	q := b.addrs[internalAddr]
	if q == nil {
		q = &readIndexQueue{}
		b.addrs[internalAddr] = q
	}
	if q.next == nil {
		q.next = &readIndexRound{done: make(chan struct{})}
	}
	r := q.next
	r.waiters++
	if !q.running {
		q.running = true
		go b.run(internalAddr, q)
	}
	b.mu.Unlock()
	select {
	case <-r.done:
		return r.index, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// run serves rounds for one address until nobody waits.
func (b *readIndexBatcher) run(internalAddr string, q *readIndexQueue) {
	for {
		b.mu.Lock()
		r := q.next
		q.next = nil
		if r == nil {
			q.running = false
			// Forget an idle address, so leaders of the past do not pile up.
			delete(b.addrs, internalAddr)
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), readIndexTimeout)
		r.index, r.err = b.ask(ctx, internalAddr)
		cancel()
		close(r.done)
	}
}
