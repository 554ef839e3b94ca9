package etcdstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/store/conformance"
	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestConformance runs the backend conformance suite on three stores (three
// agents) over a three-member etcd cluster.
func TestConformance(t *testing.T) {
	ec := etcdtest.Start(t, 3)
	stores := openStores(t, ec, 3)
	apply := func(ctx context.Context, i int, cmd []byte) (*fsm.Result, error) {
		resp, _, err := stores[i].Apply(ctx, cmd)
		return conformance.Result(resp, err)
	}
	conformance.Run(t, conformance.Harness{
		N:          3,
		Write:      apply,
		ApplyLocal: apply,
		Sync: func(ctx context.Context, i int) error {
			idx, err := stores[i].ReadIndex(ctx)
			if err != nil {
				return err
			}
			return stores[i].WaitApplied(ctx, idx)
		},
		State:      func(i int) *fsm.State { return stores[i].State() },
		Leadership: func(i int) (<-chan bool, func()) { return stores[i].SubscribeLeadership() },
		IsLeader:   func(i int) bool { return stores[i].IsLeader() },
		Stop:       func(i int) { _ = stores[i].Close() },
	})
}

// openStores opens n stores, each with its own client over every member
// and its own FSM, as n agents would. They are closed at cleanup.
func openStores(t *testing.T, ec *etcdtest.Cluster, n int) []*etcdstore.Store {
	t.Helper()
	stores := make([]*etcdstore.Store, n)
	for i := range n {
		stores[i] = openStore(t, ec, fmt.Sprintf("node-%d", i))
	}
	return stores
}

func openStore(t *testing.T, ec *etcdtest.Cluster, id string) *etcdstore.Store {
	t.Helper()
	return openStoreWith(t, ec, id, fsm.LatestConfig())
}

func openStoreWith(t *testing.T, ec *etcdtest.Cluster, id string, cfg fsm.Config) *etcdstore.Store {
	t.Helper()
	f, err := fsm.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := etcdstore.Open(ctx, etcdstore.Config{
		Client: ec.Client(t), NodeID: id, FSM: f, SessionTTL: 2 * time.Second,
	})
	if err != nil {
		t.Fatalf("open store %s: %v", id, err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}
