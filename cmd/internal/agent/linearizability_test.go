package agent_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/lincheck"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// Shape of the linearizability run.
const (
	// linMinLoad is how long the clients run at least; they also run until
	// the fault schedule has healed the cluster, plus linTail.
	linMinLoad = 9 * time.Second
	linTail    = time.Second
	// After that the load goes on, up to linMaxLoad in all, until
	// linWantOps writes and reads each have been answered.
	linMaxLoad = 25 * time.Second
	linWantOps = 150
	// linMaxOps caps the operations all clients start together.
	linMaxOps = 6000
)

// TestLinearizability records concurrent register, deregister and consistent
// get operations on a few instances of one service while the leader is
// killed and restarted twice, and checks with porcupine that the history is
// linearizable. Reads after healing make every acknowledged write that was
// not overwritten visible to the check.
func TestLinearizability(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	var addrs []string
	for i := range 3 {
		addrs = append(addrs, c.Node(i).APIAddr())
	}

	hist := lincheck.NewHistory()
	stop := make(chan struct{})
	var budget atomic.Int64
	budget.Store(linMaxOps)
	var wg sync.WaitGroup
	stopClients := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	defer stopClients() // also when the fault schedule fails the test
	seed := rand.Uint64()
	t.Logf("client seed %d", seed)
	for id := range lincheck.Clients {
		hc := agenttest.NewHTTPClient()
		var apis []clusterv1connect.ClusterServiceClient
		for _, a := range addrs {
			apis = append(apis, agenttest.NewClient(hc, a))
		}
		cl := lincheck.NewClient(id, fmt.Sprintf("lin-%d-%x", id, seed), rand.New(rand.NewPCG(seed, uint64(id))), apis, hist)
		wg.Go(func() {
			defer hc.CloseIdleConnections()
			cl.Run(t.Context(), stop, &budget)
		})
	}

	// The fault schedule runs here, on the test goroutine, because the
	// cluster kit fails the test from it.
	linPause(t, 2*time.Second)
	for round := 1; round <= 2; round++ {
		leader := c.WaitLeader(waitFor)
		i := c.Index(leader)
		hist.Event(t, "kill leader %s", leader.Name)
		c.Kill(i)
		hist.Event(t, "%s stopped", leader.Name)
		next := c.WaitLeader(waitFor)
		hist.Event(t, "new leader %s", next.Name)
		c.Restart(i, false, next.GossipAddr())
		hist.Event(t, "restarted %s", leader.Name)
		linWaitHealed(t, c)
		hist.Event(t, "healed (round %d)", round)
	}
	linPause(t, max(linTail, linMinLoad-time.Since(hist.Start())))
	for time.Since(hist.Start()) < linMaxLoad {
		if w, r := hist.Answered(); w >= linWantOps && r >= linWantOps {
			break
		}
		linPause(t, 100*time.Millisecond) // polling interval
	}
	stopClients()
	hist.Event(t, "clients stopped")

	// Final reads through every node: every acknowledged write that was not
	// overwritten must be visible.
	for _, n := range c.Nodes() {
		for k := range lincheck.Keys {
			key := fmt.Sprintf("i%d", k)
			agenttest.Eventually(t, waitFor, "final read of "+key+" through "+n.Name, func() error {
				return lincheck.FinalGet(ctxT(t), hist, n.API, key)
			})
		}
	}
	lincheck.Check(t, hist, 100)
}

// linPause waits d as part of the fault schedule (load runs meanwhile).
func linPause(t *testing.T, d time.Duration) {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-t.Context().Done():
	}
}

// linWaitHealed waits until every node follows one leader and has applied
// what that leader had committed when the wait began.
func linWaitHealed(t *testing.T, c *agenttest.Cluster) {
	t.Helper()
	leader := c.WaitLeader(waitFor)
	want := leader.Store().Status().CommitIndex
	agenttest.Eventually(t, waitFor, "every node catches up", func() error {
		for _, n := range c.Nodes() {
			if got := n.Store().Status().AppliedIndex; got < want {
				return fmt.Errorf("%s applied %d, leader had committed %d", n.Name, got, want)
			}
		}
		return nil
	})
}
