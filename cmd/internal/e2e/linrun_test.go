package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/lincheck"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// linRun is lincheck's clients running through a cluster's agents while a
// fault test injects faults: it records the history, waits for healing
// and checks the history at the end.
type linRun struct {
	t    *testing.T
	c    *cluster
	apis []clusterv1connect.ClusterServiceClient
	hist *lincheck.History
	stop func()
}

// startLinRun starts lincheck.Clients clients through every node of c.
func startLinRun(t *testing.T, c *cluster, name string) *linRun {
	t.Helper()
	hc := c.httpClient(t)
	r := &linRun{t: t, c: c, hist: lincheck.NewHistory()}
	for _, n := range c.nodes {
		r.apis = append(r.apis, clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api))
	}
	stop := make(chan struct{})
	var budget atomic.Int64
	budget.Store(50000)
	var wg sync.WaitGroup
	r.stop = sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	t.Cleanup(r.stop)
	seed := rand.Uint64()
	t.Logf("client seed %d", seed)
	for id := range lincheck.Clients {
		cl := lincheck.NewClient(id, fmt.Sprintf("%s-%d-%x", name, id, seed), rand.New(rand.NewPCG(seed, uint64(id))), r.apis, r.hist)
		wg.Go(func() { cl.Run(t.Context(), stop, &budget) })
	}
	return r
}

// pause lets the load run for d.
func (r *linRun) pause(d time.Duration) {
	select {
	case <-time.After(d):
	case <-r.t.Context().Done():
	}
}

// event notes a fault in the log and the history.
func (r *linRun) event(format string, args ...any) {
	r.t.Helper()
	r.hist.Event(r.t, format, args...)
}

// leader waits until the nodes among agree on a leader and returns it.
func (r *linRun) leader(among ...*node) *node {
	r.t.Helper()
	if len(among) == 0 {
		among = r.c.nodes
	}
	var l leaderOut
	r.c.eventually(r.t, 60*time.Second, "an agreed leader", func() error {
		var err error
		l, err = r.c.agreedLeader(r.t, among...)
		return err
	})
	return r.c.byAPI(r.t, l.APIAddr)
}

// follower returns a node that does not lead.
func (r *linRun) follower() *node {
	return r.c.others(r.leader())[0]
}

// healed waits until every node agrees on one leader and answers a
// consistent read (it has caught up), without operator action.
func (r *linRun) healed(what string) {
	r.t.Helper()
	r.c.eventually(r.t, 90*time.Second, "healed after "+what, func() error {
		if _, err := r.c.agreedLeader(r.t, r.c.nodes...); err != nil {
			return err
		}
		// Every node is asked, so that a failure names all that fail.
		var errs []error
		for i, a := range r.apis {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := a.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: lincheck.Service,
				Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			cancel()
			if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
				errs = append(errs, fmt.Errorf("%s: %w", r.c.nodes[i].name, err))
			}
		}
		return errors.Join(errs...)
	})
	r.event("healed after %s", what)
}

// finish stops the clients, reads every key through every node and checks
// the history with porcupine.
func (r *linRun) finish() {
	r.t.Helper()
	r.pause(3 * time.Second)
	r.stop()
	r.event("clients stopped")
	for i, a := range r.apis {
		for k := range lincheck.Keys {
			key := fmt.Sprintf("i%d", k)
			r.c.eventually(r.t, 30*time.Second, "final read of "+key+" through "+r.c.nodes[i].name, func() error {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				return lincheck.FinalGet(ctx, r.hist, a, key)
			})
		}
	}
	lincheck.Check(r.t, r.hist, 100)
	r.c.agreeReplicas(r.t, "after the faults")
}
