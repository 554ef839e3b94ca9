package agent_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/lincheck"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
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
	run := startLinClients(t, c)

	// The fault schedule runs here, on the test goroutine, because the
	// cluster kit fails the test from it.
	linPause(t, 2*time.Second)
	for round := 1; round <= 2; round++ {
		leader := c.WaitLeader(waitFor)
		i := c.Index(leader)
		run.hist.Event(t, "kill leader %s", leader.Name)
		c.Kill(i)
		run.hist.Event(t, "%s stopped", leader.Name)
		next := c.WaitLeader(waitFor)
		run.hist.Event(t, "new leader %s", next.Name)
		c.Restart(i, false, next.GossipAddr())
		run.hist.Event(t, "restarted %s", leader.Name)
		linWaitHealed(t, c)
		run.hist.Event(t, "healed (round %d)", round)
	}
	run.finish(t, c)
}

// TestEtcdLinearizability is TestLinearizability in etcd mode: three agents
// over a three-member etcd, while etcd's leader member is stopped and
// started again, then the agent holding the schedule leadership is killed
// and restarted.
func TestEtcdLinearizability(t *testing.T) {
	ec := etcdtest.Start(t, 3)
	c := agenttest.NewEtcd(t, 3, ec.Endpoints, nil)
	c.WaitLeader(waitFor)
	run := startLinClients(t, c)

	linPause(t, 2*time.Second)
	for round := 1; round <= 2; round++ {
		name := ec.Leader()
		m := slices.Index(ec.Names, name)
		if m < 0 {
			t.Fatalf("no etcd member leads (%s)", name)
		}
		run.hist.Event(t, "stop etcd leader %s", name)
		ec.Stop(m)
		linPause(t, 1500*time.Millisecond)
		ec.Restart(m)
		run.hist.Event(t, "restarted etcd member %s", name)
		etcdWaitReady(t, c)
		run.hist.Event(t, "healed (round %d)", round)
	}
	leader := c.WaitLeader(waitFor)
	i := c.Index(leader)
	run.hist.Event(t, "kill agent %s (schedule leader)", leader.Name)
	c.Kill(i)
	next := c.WaitLeader(waitFor)
	run.hist.Event(t, "new schedule leader %s", next.Name)
	c.Restart(i, false, next.GossipAddr())
	run.hist.Event(t, "restarted %s", leader.Name)
	etcdWaitReady(t, c)
	run.hist.Event(t, "healed (round 3)")
	run.finish(t, c)
}

// etcdWaitReady waits until every agent follows etcd.
func etcdWaitReady(t *testing.T, c *agenttest.Cluster) {
	t.Helper()
	for _, n := range c.Nodes() {
		agenttest.Eventually(t, waitFor, n.Name+" ready", func() error {
			if code, body := get(t, "http://"+n.MetricsAddr()+"/ready"); code != 200 {
				return fmt.Errorf("%d %s", code, body)
			}
			return nil
		})
	}
}

// linRun is the lincheck clients of one test, running against every node
// of a cluster.
type linRun struct {
	hist *lincheck.History
	stop func()
}

func startLinClients(t *testing.T, c *agenttest.Cluster) *linRun {
	t.Helper()
	var addrs []string
	for _, n := range c.Nodes() {
		addrs = append(addrs, n.APIAddr())
	}
	hist := lincheck.NewHistory()
	stop := make(chan struct{})
	var budget atomic.Int64
	budget.Store(linMaxOps)
	var wg sync.WaitGroup
	run := &linRun{hist: hist, stop: sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})}
	t.Cleanup(run.stop) // also when the fault schedule fails the test
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
	return run
}

// finish lets the load run its minimum and until enough operations were
// answered, stops the clients, reads every key through every node and
// checks the history.
func (r *linRun) finish(t *testing.T, c *agenttest.Cluster) {
	t.Helper()
	linPause(t, max(linTail, linMinLoad-time.Since(r.hist.Start())))
	for time.Since(r.hist.Start()) < linMaxLoad {
		if w, rd := r.hist.Answered(); w >= linWantOps && rd >= linWantOps {
			break
		}
		linPause(t, 100*time.Millisecond) // polling interval
	}
	r.stop()
	r.hist.Event(t, "clients stopped")

	// Final reads through every node: every acknowledged write that was not
	// overwritten must be visible.
	for _, n := range c.Nodes() {
		for k := range lincheck.Keys {
			key := fmt.Sprintf("i%d", k)
			agenttest.Eventually(t, waitFor, "final read of "+key+" through "+n.Name, func() error {
				return lincheck.FinalGet(ctxT(t), r.hist, n.API, key)
			})
		}
	}
	lincheck.Check(t, r.hist, 100)
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
