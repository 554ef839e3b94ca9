package etcdstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"pilab.hu/pivirt-agent/store"
)

// leadership is this node's hold on the schedule leadership: the election
// key it owns while it leads, and the subscribers told of each change.
type leadership struct {
	mu      sync.Mutex
	leading bool
	key     string // this node's election key while leading
	rev     int64  // its create revision: the fencing token
	leader  string // node ID of the current leader, from the mirror
	subs    map[int]chan bool
	next    int
	closed  bool
}

func (l *leadership) init() { l.subs = make(map[int]chan bool) }

func (l *leadership) is() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.leading
}

func (l *leadership) id() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.leader
}

// token returns the election key and its create revision while leading.
func (l *leadership) token() (string, int64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.key, l.rev, l.leading
}

func (l *leadership) set(leading bool, key string, rev int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.leading == leading && l.key == key {
		return
	}
	l.leading, l.key, l.rev = leading, key, rev
	for _, ch := range l.subs {
		offer(ch, leading)
	}
}

// offer delivers v, replacing an undelivered older value: a subscriber
// always sees the latest state.
func offer(ch chan bool, v bool) {
	for {
		select {
		case ch <- v:
			return
		default:
		}
		select {
		case <-ch:
		default:
		}
	}
}

func (l *leadership) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	for id, ch := range l.subs {
		close(ch)
		delete(l.subs, id)
	}
}

// SubscribeLeadership returns a channel that receives true when this node
// wins the schedule leadership and false when it loses it (the latest value
// only, as store.Store's), closed when the Store closes.
func (s *Store) SubscribeLeadership() (<-chan bool, func()) {
	l := &s.leader
	l.mu.Lock()
	defer l.mu.Unlock()
	ch := make(chan bool, 1)
	if l.closed {
		close(ch)
		return ch, func() {}
	}
	id := l.next
	l.next++
	l.subs[id] = ch
	if l.leading {
		ch <- true
	}
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if c, ok := l.subs[id]; ok {
			close(c)
			delete(l.subs, id)
		}
	}
}

// IsLeader reports whether this node holds the schedule leadership.
func (s *Store) IsLeader() bool { return s.leader.is() }

// LeaderID returns the node ID of the schedule leader ("" when none).
func (s *Store) LeaderID() string { return s.leader.id() }

// updateLeaderLocked sets the known leader from the election keys in the
// mirror: the one created first. mu must be held.
func (s *Store) updateLeaderLocked() {
	var best candidate
	for _, c := range s.elected {
		if best.create == 0 || c.create < best.create {
			best = c
		}
	}
	s.leader.mu.Lock()
	s.leader.leader = best.value
	s.leader.mu.Unlock()
}

// campaign runs for the schedule leadership until the Store closes: an
// etcd session (a lease kept alive) and an election under <root>/leader.
// The leadership ends when the session's lease is lost (etcd unreachable
// longer than SessionTTL) and is then sought again.
func (s *Store) campaign() {
	ttl := max(1, int(s.cfg.SessionTTL/time.Second))
	backoff := 100 * time.Millisecond
	for s.ctx.Err() == nil {
		sess, err := concurrency.NewSession(s.cli, concurrency.WithTTL(ttl), concurrency.WithContext(s.ctx))
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			s.logger.Debug("etcd session for the election failed", "error", err)
			if !s.sleep(&backoff) {
				return
			}
			continue
		}
		backoff = 100 * time.Millisecond
		el := concurrency.NewElection(sess, s.lay.election())
		cctx, cancel := context.WithCancel(s.ctx)
		go func() {
			// A session that ends while campaigning ends the campaign.
			select {
			case <-sess.Done():
			case <-cctx.Done():
			}
			cancel()
		}()
		err = el.Campaign(cctx, s.cfg.NodeID)
		if err != nil {
			cancel()
			s.closeSession(sess)
			if s.ctx.Err() != nil {
				return
			}
			if !s.sleep(&backoff) {
				return
			}
			continue
		}
		s.leader.set(true, el.Key(), el.Rev())
		s.logger.Info("schedule leadership won", "key", el.Key(), "revision", el.Rev())
		select {
		case <-sess.Done():
			s.leader.set(false, "", 0)
			s.logger.Warn("schedule leadership lost: the etcd session expired")
		case <-s.ctx.Done():
			// Closing: the session's revocation below frees the key too;
			// neither may hold the shutdown up for long.
			s.leader.set(false, "", 0)
			rctx, rcancel := context.WithTimeout(context.Background(), time.Second)
			if err := el.Resign(rctx); err != nil {
				s.logger.Debug("resign the schedule leadership", "error", err)
			}
			rcancel()
		case done := <-s.resignReq:
			s.leader.set(false, "", 0)
			rctx, rcancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
			if err := el.Resign(rctx); err != nil {
				s.logger.Warn("resign the schedule leadership", "error", err)
			}
			rcancel()
			s.logger.Info("schedule leadership resigned")
			close(done)
		}
		cancel()
		s.closeSession(sess)
	}
}

func (s *Store) closeSession(sess *concurrency.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	// Revoking the lease deletes the election key at once, so that another
	// node need not wait for the TTL.
	_, _ = s.cli.Revoke(ctx, sess.Lease())
	_ = sess.Close()
}

// Resign gives up the schedule leadership (if held) so that another node
// takes over; this node campaigns again afterwards, behind the others. It
// is the etcd mode's leadership transfer. It returns once this node has
// resigned.
func (s *Store) Resign(ctx context.Context) error {
	if !s.leader.is() {
		return fmt.Errorf("%w: this node does not hold the schedule leadership", store.ErrNotLeader)
	}
	return s.ask(ctx, s.resignReq)
}

// sleep waits for backoff (with jitter) and doubles it, up to 5s; false
// when the Store closed meanwhile.
func (s *Store) sleep(backoff *time.Duration) bool {
	t := time.NewTimer(*backoff + rand.N(*backoff/2+1))
	defer t.Stop()
	*backoff = min(2**backoff, 5*time.Second)
	select {
	case <-s.ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// fence is the compare that holds while this node still leads: its
// election key exists with the create revision it won with.
func (s *Store) fence() (clientv3.Cmp, bool) {
	key, rev, ok := s.leader.token()
	if !ok {
		return clientv3.Cmp{}, false
	}
	return clientv3.Compare(clientv3.CreateRevision(key), "=", rev), true
}
