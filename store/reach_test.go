package store

import (
	"context"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestReachQuorumWithout: a removal counts as safe only when the voters
// left, counting the leader and those its heartbeats reach, are a quorum
// among themselves, and only once the leadership is older than the grace
// time.
func TestReachQuorumWithout(t *testing.T) {
	voter := func(id string) raft.Server { return raft.Server{ID: raft.ServerID(id), Suffrage: raft.Voter} }
	three := []raft.Server{voter("a"), voter("b"), voter("c")}
	five := []raft.Server{voter("a"), voter("b"), voter("c"), voter("d"), voter("e"), {ID: "n", Suffrage: raft.Nonvoter}}
	tests := []struct {
		name    string
		servers []raft.Server
		failing []string
		moving  string
		want    bool
	}{
		{"three, all reached", three, nil, "c", true},
		{"three, another voter down", three, []string{"b"}, "c", false},
		{"three, the moving one down", three, []string{"c"}, "c", true},
		{"five, one other down", five, []string{"b"}, "c", true},
		{"five, two others down", five, []string{"b", "d"}, "c", false},
		{"five, a non-voter down", five, []string{"n"}, "c", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &reach{grace: time.Millisecond, failing: map[raft.ServerID]bool{}}
			p.observe(raft.Observation{Data: raft.LeaderObservation{LeaderID: "a"}}, "a")
			for _, id := range tt.failing {
				p.observe(raft.Observation{Data: raft.FailedHeartbeatObservation{PeerID: raft.ServerID(id)}}, "a")
			}
			if err := p.settle(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := p.quorumWithout(tt.servers, "a", raft.ServerID(tt.moving)); got != tt.want {
				t.Errorf("quorumWithout(%s) = %v, want %v", tt.moving, got, tt.want)
			}
		})
	}

	p := &reach{grace: time.Hour, failing: map[raft.ServerID]bool{}}
	p.observe(raft.Observation{Data: raft.LeaderObservation{LeaderID: "a"}}, "a")
	if p.quorumWithout(three, "a", "c") {
		t.Error("a leader younger than the grace time counts a removal as safe")
	}
	p.grace = time.Millisecond
	p.observe(raft.Observation{Data: raft.FailedHeartbeatObservation{PeerID: "b"}}, "a")
	p.observe(raft.Observation{Data: raft.ResumedHeartbeatObservation{PeerID: "b"}}, "a")
	if err := p.settle(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !p.quorumWithout(three, "a", "c") {
		t.Error("a voter whose heartbeats resumed still counts as unreached")
	}
	p.observe(raft.Observation{Data: raft.LeaderObservation{LeaderID: "b"}}, "a")
	if p.quorumWithout(three, "a", "c") {
		t.Error("a follower counts a removal as safe")
	}
}
