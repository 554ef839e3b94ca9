package store

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// reach tracks, on the leader, which servers its heartbeats currently fail
// to reach, from raft's own observations (FailedHeartbeatObservation,
// ResumedHeartbeatObservation). Membership changes ask it whether a
// removal would leave a quorum that can commit (see DESIGN.md,
// "Invariants": address changes). On every node it also follows since when
// the node has known no leader (LeaderObservation), which the errors of
// requests that found none report.
type reach struct {
	grace time.Duration // how long a new leader hears nothing before it trusts the absence of failures
	// lastContact is raft's LastContact: a follower's last contact with
	// its leader.
	lastContact func() time.Time

	mu      sync.Mutex
	failing map[raft.ServerID]bool
	since   time.Time // when the current leadership began; zero when not leader
	// noLeader is since when this node knows no leader (for a follower
	// that lost its leader, its last contact with it); zero while it knows
	// one. leaderKnown is when the leader it knows (knew) became known,
	// selfLed whether that was this node.
	noLeader    time.Time
	leaderKnown time.Time
	selfLed     bool
	obs         *raft.Observer
	done        chan struct{}
}

// start registers the observer on r and follows its observations until
// closing is closed.
func (p *reach) start(r *raft.Raft, self raft.ServerID, closing <-chan struct{}) {
	p.failing = map[raft.ServerID]bool{}
	p.lastContact = r.LastContact
	ch := make(chan raft.Observation, 64)
	p.obs = raft.NewObserver(ch, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.FailedHeartbeatObservation, raft.ResumedHeartbeatObservation, raft.LeaderObservation:
			return true
		}
		return false
	})
	r.RegisterObserver(p.obs)
	// No leader yet, unless one was observed already.
	p.mu.Lock()
	if _, id := r.LeaderWithID(); id == "" && p.leaderKnown.IsZero() && p.noLeader.IsZero() {
		p.noLeader = time.Now()
	}
	p.mu.Unlock()
	p.done = make(chan struct{})
	go func() {
		defer close(p.done)
		for {
			select {
			case o := <-ch:
				p.observe(o, self)
			case <-closing:
				r.DeregisterObserver(p.obs)
				return
			}
		}
	}()
}

func (p *reach) observe(o raft.Observation, self raft.ServerID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch d := o.Data.(type) {
	case raft.LeaderObservation:
		// A new term starts with no knowledge: the heartbeats of the new
		// leadership tell within the grace time.
		clear(p.failing)
		p.since = time.Time{}
		if d.LeaderID == self {
			p.since = time.Now()
		}
		switch {
		case d.LeaderID != "":
			p.noLeader, p.leaderKnown, p.selfLed = time.Time{}, time.Now(), d.LeaderID == self
		case p.noLeader.IsZero():
			// A leader's own LastContact is older than its term: it
			// lost its leadership now.
			p.noLeader = time.Now()
			if c := p.lastContact(); !p.selfLed && c.After(p.leaderKnown) && c.Before(p.noLeader) {
				p.noLeader = c
			}
		}
	case raft.FailedHeartbeatObservation:
		p.failing[d.PeerID] = true
	case raft.ResumedHeartbeatObservation:
		delete(p.failing, d.PeerID)
	}
}

// noLeaderSince is since when this node has known no leader; zero while it
// knows one (or has not yet observed the loss).
func (p *reach) noLeaderSince() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.noLeader
}

// stop waits for the observing goroutine (closing must already be closed).
func (p *reach) stop() {
	if p.done != nil {
		<-p.done
	}
}

// settle waits until this node's leadership is older than the grace time,
// so that its heartbeats had the time to find the servers they cannot
// reach; at once when not leader or already settled, ctx's error when it
// ends first.
func (p *reach) settle(ctx context.Context) error {
	p.mu.Lock()
	var wait time.Duration
	if !p.since.IsZero() {
		wait = p.grace - time.Since(p.since)
	}
	p.mu.Unlock()
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return contextError(ctx)
	}
}

// quorumWithout reports whether the voters of servers other than id,
// counting the leader self and every voter its heartbeats reach, form a
// quorum among themselves: whether a configuration without id could still
// commit. A leader younger than the grace time, or a node that does not
// lead, knows too little and answers false.
func (p *reach) quorumWithout(servers []raft.Server, self raft.ServerID, id raft.ServerID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.since.IsZero() || time.Since(p.since) < p.grace {
		return false
	}
	voters, reached := 0, 0
	for _, s := range servers {
		if s.Suffrage != raft.Voter || s.ID == id {
			continue
		}
		voters++
		if s.ID == self || !p.failing[s.ID] {
			reached++
		}
	}
	return voters > 0 && reached >= voters/2+1
}
