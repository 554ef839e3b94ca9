package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/conformance"
	"pilab.hu/pivirt-agent/store/storetest"
)

// TestConformance runs the backend conformance suite on a three-node Raft
// cluster; store/etcdstore runs the same suite on etcd.
func TestConformance(t *testing.T) {
	c := storetest.NewCluster(t, 3, func() raft.FSM {
		f, err := fsm.New(fsm.LatestConfig())
		if err != nil {
			panic(err)
		}
		return f
	})
	c.WaitLeader(t, 10*time.Second)
	// onLeader runs op on the current leader, retrying across leader
	// changes until ctx ends, as the agent's forwarding does.
	onLeader := func(ctx context.Context, op func(*store.Store) error) error {
		for {
			var err error
			if l := c.Leader(); l != nil {
				if err = op(l); err == nil || !storetest.Retryable(err) {
					return err
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("no leader answered: %w (last error %v)", ctx.Err(), err)
			case <-time.After(20 * time.Millisecond): // poll interval
			}
		}
	}
	fsmOf := func(i int) *fsm.FSM { return c.FSM(i).(*fsm.FSM) }
	conformance.Run(t, conformance.Harness{
		N: 3,
		Write: func(ctx context.Context, _ int, cmd []byte) (*fsm.Result, error) {
			var res *fsm.Result
			err := onLeader(ctx, func(l *store.Store) error {
				resp, _, err := l.Apply(ctx, cmd)
				res, err = conformance.Result(resp, err)
				return err
			})
			return res, err
		},
		ApplyLocal: func(ctx context.Context, i int, cmd []byte) (*fsm.Result, error) {
			resp, _, err := c.Store(i).Apply(ctx, cmd)
			return conformance.Result(resp, err)
		},
		Sync: func(ctx context.Context, i int) error {
			var idx uint64
			if err := onLeader(ctx, func(l *store.Store) error {
				var err error
				idx, err = l.ReadIndex(ctx)
				return err
			}); err != nil {
				return err
			}
			return fsmOf(i).WaitApplied(ctx, idx)
		},
		State:      func(i int) *fsm.State { return fsmOf(i).State() },
		Leadership: func(i int) (<-chan bool, func()) { return c.Store(i).SubscribeLeadership() },
		IsLeader:   func(i int) bool { s := c.Store(i); return s != nil && s.IsLeader() },
		Stop:       c.Stop,
	})
}
