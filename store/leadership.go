package store

import "sync"

// leadership fans raft's NotifyCh out to any number of subscribers. Each
// subscriber has a one-slot channel that always holds the latest value not
// yet received: a slow subscriber misses intermediate values, never the last
// one, and raft is never blocked by a subscriber.
type leadership struct {
	mu     sync.Mutex
	leader bool                   // latest value received from raft
	subs   map[chan bool]struct{} // open subscriber channels
	closed bool                   // stop has run; no new subscribers
	done   chan struct{}          // closed when the fan-out goroutine exits
}

// start runs the fan-out goroutine until closing is closed.
func (l *leadership) start(notify <-chan bool, closing <-chan struct{}) {
	l.done = make(chan struct{})
	go func() {
		defer close(l.done)
		for {
			select {
			case v := <-notify:
				l.publish(v)
			case <-closing:
				return
			}
		}
	}()
}

// publish records v and offers it to every subscriber, replacing a value the
// subscriber has not received yet.
func (l *leadership) publish(v bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.leader = v
	for ch := range l.subs {
		offer(ch, v)
	}
}

// offer puts v in ch's only slot, dropping an unread older value. Only
// publish and subscribe send, both under l.mu, so the send cannot block.
func offer(ch chan bool, v bool) {
	select {
	case <-ch:
	default:
	}
	select {
	case ch <- v:
	default:
	}
}

// stop waits for the fan-out goroutine (closing must already be closed),
// sends false to every subscriber and closes their channels.
func (l *leadership) stop() {
	if l.done != nil {
		<-l.done
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	l.leader = false
	for ch := range l.subs {
		offer(ch, false)
		close(ch)
		delete(l.subs, ch)
	}
}

// SubscribeLeadership returns a channel that delivers this server's
// leadership: true when it becomes the leader, false when it stops being the
// leader. The current value is delivered first. The channel holds one value:
// a subscriber that falls behind receives only the latest, so two trues in a
// row mean leadership was lost and regained in between (as with raft's
// LeaderCh), and leader state must be re-established (Barrier again).
//
// cancel ends the subscription and closes the channel; it may be called more
// than once. Close also closes every subscription's channel, after a final
// false.
func (s *Store) SubscribeLeadership() (ch <-chan bool, cancel func()) {
	l := &s.leadership
	c := make(chan bool, 1)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		c <- false
		close(c)
		return c, func() {}
	}
	if l.subs == nil {
		l.subs = make(map[chan bool]struct{})
	}
	l.subs[c] = struct{}{}
	c <- l.leader
	return c, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if _, ok := l.subs[c]; ok {
			delete(l.subs, c)
			close(c)
		}
	}
}
