package agent_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// TestNoLeaderSaysWhy: with two of three agents stopped, a default read
// and a write through the third fail with Unavailable saying how many
// voters it reaches of how many, since when there has been no leader, and
// that stale reads still work — a read whose deadline is shorter than the
// hold timeout before its deadline, not with "deadline exceeded". A stale
// read is served.
func TestNoLeaderSaysWhy(t *testing.T) {
	const hold = 3 * time.Second
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		cfg.Cluster.ForwardHoldTimeout = config.Duration(hold)
	})
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	survivor := c.Follower()
	mustRegister(t, survivor, "web", "before")
	// The survivor must have the write before it is cut off: a stale
	// read answers from its own state.
	agenttest.Eventually(t, 10*time.Second, "the write on the survivor", func() error {
		resp, err := listServices(t, survivor, clusterv1.Consistency_CONSISTENCY_STALE)
		if err != nil || len(resp.Msg.GetInstances()) != 1 {
			return fmt.Errorf("%v %v", resp, err)
		}
		return nil
	})
	killed := time.Now()
	for _, n := range c.Nodes() {
		if n != survivor {
			c.Kill(c.Index(n))
		}
	}
	// Gossip may still call the stopped agents alive for a while: the
	// answer must not depend on it.
	agenttest.Eventually(t, 20*time.Second, "the survivor without a leader", func() error {
		if id := survivor.LeaderID(); id != "" {
			return fmt.Errorf("leader %s", id)
		}
		return nil
	})

	since := regexp.MustCompile(`none since (\S+) \(`)
	check := func(what string, err error, start time.Time, within time.Duration) {
		t.Helper()
		took := time.Since(start)
		if connect.CodeOf(err) != connect.CodeUnavailable {
			t.Fatalf("%s: %v after %s, want Unavailable", what, err, took)
		}
		if took > within {
			t.Errorf("%s answered after %s, want within %s", what, took, within)
		}
		msg := err.Error()
		t.Logf("%s: %s", what, msg)
		for _, want := range []string{"no cluster leader", "1 of 3 voters reachable from " + survivor.Name, "electing a leader needs 2", "consistency stale"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: %q does not say %q", what, msg, want)
			}
		}
		m := since.FindStringSubmatch(msg)
		if m == nil {
			t.Fatalf("%s: %q says not since when", what, msg)
		}
		at, perr := time.Parse(time.RFC3339, m[1])
		// The last contact with the leader: before the leader stopped,
		// within a heartbeat timeout (1s; RFC3339 drops the fraction).
		if perr != nil || at.Before(killed.Add(-2*time.Second)) || at.After(time.Now()) {
			t.Errorf("%s: no leader since %q (%v); the leader stopped at %s", what, m[1], perr, killed.UTC().Format(time.RFC3339))
		}
		var ce *connect.Error
		if !errors.As(err, &ce) {
			t.Fatalf("%s: %T", what, err)
		}
		var info *errdetails.ErrorInfo
		for _, d := range ce.Details() {
			if v, err := d.Value(); err == nil {
				if ei, ok := v.(*errdetails.ErrorInfo); ok {
					info = ei
				}
			}
		}
		if info.GetReason() != gateway.ReasonNoLeader || info.GetMetadata()["voters"] != "3" || info.GetMetadata()["voters_reachable"] != "1" || info.GetMetadata()["no_leader_since"] != m[1] {
			t.Errorf("%s: error info %v", what, info)
		}
	}

	// A default read whose deadline comes before the hold timeout.
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	start := time.Now()
	_, err := survivor.API.ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{}))
	cancel()
	check("a default read with a 2s deadline", err, start, 2*time.Second)
	if !strings.Contains(err.Error(), "the call's deadline is near") {
		t.Errorf("%q does not say the deadline ended the wait", err)
	}

	// A write waits for the hold timeout.
	start = time.Now()
	_, err = agenttest.Register(ctxT(t), survivor, "web", "after", "10.0.0.2", 80)
	check("a write", err, start, hold+2*time.Second)
	if !strings.Contains(err.Error(), "after waiting "+hold.String()) {
		t.Errorf("%q does not name the hold timeout", err)
	}

	resp, err := listServices(t, survivor, clusterv1.Consistency_CONSISTENCY_STALE)
	if err != nil || len(resp.Msg.GetInstances()) != 1 {
		t.Fatalf("a stale read without a leader: %v %v, want the instance written before", resp, err)
	}
}
