package gateway

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/store"
)

// movingRaft is the Raft state of a node whose leadership moves just after
// a restore: its first `refusals` applies fail with ErrNotLeader, and
// Leader() answers leader; then, if it leads, applies go to the FSM.
type movingRaft struct {
	mu       sync.Mutex
	f        *fsm.FSM
	refusals int
	leader   string
	index    uint64
	applies  int
}

func (r *movingRaft) Apply(_ context.Context, cmd []byte) (any, uint64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.applies++
	if r.refusals > 0 || r.leader != "node-a" {
		r.refusals--
		return nil, 0, fmt.Errorf("apply: %w", store.ErrNotLeader)
	}
	r.index++
	return r.f.Apply(&raft.Log{Index: r.index, Term: 1, Type: raft.LogCommand, Data: cmd}), r.index, nil
}
func (r *movingRaft) Leader() (string, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.leader, r.leader + ":8300"
}
func (r *movingRaft) ReadIndex(context.Context) (uint64, error) { return 0, errors.New("unused") }
func (r *movingRaft) RaftStatus() RaftStatus                    { return RaftStatus{} }

// The marker of a restore is proposed again when this node leads again
// after losing leadership; when another node leads, a committed restore
// is answered at the applied index, and an uncommitted one fails once the
// mark's time is up.
func TestMarkRestoredAcrossALeadershipChange(t *testing.T) {
	meta := &archive.Meta{ID: "snap-1", Index: 7}
	for _, tc := range []struct {
		name      string
		leader    string
		refusals  int
		committed bool
		wantErr   bool
		wantIndex uint64
	}{
		{name: "leads again", leader: "node-a", refusals: 3, committed: true, wantIndex: 1},
		{name: "another node leads, restore committed", leader: "node-b", refusals: 1, committed: true, wantIndex: 0},
		{name: "another node leads, restore not committed", leader: "node-b", refusals: 1, committed: false, wantErr: true},
		{name: "no leader", leader: "", refusals: 1, committed: true, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &movingRaft{refusals: tc.refusals, leader: tc.leader}
			cs, f := newTestService(t, "node-a", r, nil, &followerView{})
			r.f = f
			s := NewSnapshotService(SnapshotServiceConfig{}, cs, nil, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			index, err := s.markRestored(ctx, meta, tc.committed)
			if tc.wantErr {
				if !errors.Is(err, store.ErrNotLeader) {
					t.Fatalf("markRestored: %v (index %d), want the not-leader error", err, index)
				}
				return
			}
			if err != nil || index != tc.wantIndex {
				t.Fatalf("markRestored: index %d, %v; want index %d", index, err, tc.wantIndex)
			}
			if tc.leader == "node-a" && r.applies != tc.refusals+1 {
				t.Fatalf("%d proposals, want %d", r.applies, tc.refusals+1)
			}
		})
	}
}
