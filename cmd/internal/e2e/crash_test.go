package e2e_test

import (
	"context"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// crashConfig makes Raft snapshot every 64 entries (checked every 200 ms)
// and keep only 32 entries behind a snapshot, so that under load a node is
// almost always snapshotting or compacting its log when it is killed.
const crashConfig = `cluster:
  raft:
    snapshot_threshold: 64
    snapshot_interval: 200ms
    trailing_logs: 32
`

// TestCrashDuringSnapshots SIGKILLs agents (leader or not, chosen at
// random) at random moments while they snapshot and compact their logs
// under a stream of registrations, and restarts each from its data dir:
// every restart opens its data dir (the damaged-log check included),
// catches up, and at the end every acknowledged registration is on every
// node.
func TestCrashDuringSnapshots(t *testing.T) {
	if testing.Short() {
		t.Skip("kills real processes for a minute")
	}
	bins := buildBinaries(t)
	c := startClusterWith(t, bins, crashConfig)
	hc := c.httpClient(t)
	api := make([]clusterv1connect.ClusterServiceClient, len(c.nodes))
	for i, n := range c.nodes {
		api[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
	}
	st := newSoakStats()
	var reg registry
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() { reg.run(ctx, api, w, st) })
	}
	const kills = 8
	for k := range kills {
		time.Sleep(time.Duration(200+rand.IntN(1800)) * time.Millisecond) // a random point of the snapshot cycle
		n := c.nodes[rand.IntN(len(c.nodes))]
		c.kill(t, n)
		c.restart(t, n)
		// Caught up: a consistent read through it answers.
		i := c.index(n)
		c.eventually(t, 60*time.Second, n.name+" serving consistent reads after the crash", func() error {
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := api[i].ListServices(rctx, connect.NewRequest(&clusterv1.ListServicesRequest{Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			return err
		})
		t.Logf("crash %d: %s killed and back", k+1, n.name)
	}
	stop()
	wg.Wait()
	failed := st.report(t)
	reg.verify(t, c, api)
	snapshots, compactions := 0, 0
	for _, n := range c.nodes {
		b, err := os.ReadFile(n.log)
		if err != nil {
			t.Fatal(err)
		}
		snapshots += strings.Count(string(b), "snapshot complete up to")
		compactions += strings.Count(string(b), "compacting logs")
	}
	t.Logf("%d crashes; %d snapshots and %d log compactions completed meanwhile", kills, snapshots, compactions)
	if snapshots < kills {
		t.Errorf("only %d snapshots: the crashes did not meet snapshotting", snapshots)
	}
	if failed {
		t.Fatal("unexpected errors (above)")
	}
}

// index returns n's position in c.nodes.
func (c *cluster) index(n *node) int {
	for i, m := range c.nodes {
		if m == n {
			return i
		}
	}
	return -1
}
