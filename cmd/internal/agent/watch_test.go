package agent_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// TestWatchStatusAndMetrics: three agents with TLS on every port. Through
// a follower's API port, WatchMetrics of the leader is relayed to it and
// answers with the leader's name, its history and then a new sample with
// the replication progress of both followers; WatchStatus shows three
// alive members, the leader, three peers and the autopilot state, and,
// once the third agent is stopped, that agent failed.
func TestWatchStatusAndMetrics(t *testing.T) {
	dir := testPKI(t, 3)
	c := agenttest.NewExpect(t, 3, withTLS(dir))
	c.WaitPeers(60*time.Second, 3, 0)
	leader := c.WaitLeader(60 * time.Second)
	follower := c.Follower()
	var other *agenttest.Node
	for _, n := range c.Nodes() {
		if n != leader && n != follower {
			other = n
		}
	}
	hc := httpsClient(t, filepath.Join(dir, identity.ChainFile), apiClientCert(t, dir))

	t.Run("metrics of another node", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		api := clusterv1connect.NewAgentServiceClient(hc, "https://"+follower.APIAddr())
		stream, err := api.WatchMetrics(ctx, connect.NewRequest(&clusterv1.WatchMetricsRequest{Node: leader.Name}))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		if !stream.Receive() {
			t.Fatalf("no first message: %v", stream.Err())
		}
		first := stream.Msg()
		if first.GetNode() != leader.Name || len(first.GetHistory()) == 0 || first.GetInterval().AsDuration() != 5*time.Second {
			t.Fatalf("first message: node %q, %d samples, interval %v; want %s, its history, 5s",
				first.GetNode(), len(first.GetHistory()), first.GetInterval().AsDuration(), leader.Name)
		}
		// The next sample, taken while the leader leads, has both
		// followers' progress.
		for {
			if !stream.Receive() {
				t.Fatalf("the stream ended before a sample of the leader with 2 peers: %v", stream.Err())
			}
			m := stream.Msg()
			s := m.GetSample()
			if m.GetNode() != leader.Name || s == nil || len(m.GetHistory()) != 0 {
				t.Fatalf("later message %v, want one sample of %s", m, leader.Name)
			}
			if !s.GetLeader() {
				continue
			}
			if len(s.GetPeers()) != 2 {
				t.Fatalf("a sample of the leader with peers %v, want the 2 followers", s.GetPeers())
			}
			for _, p := range s.GetPeers() {
				if !p.GetReachable() || !p.GetVoter() || p.GetName() == "" || p.GetName() == leader.Name {
					t.Errorf("peer %v, want a reachable voter follower", p)
				}
			}
			break
		}
	})

	t.Run("status through a follower", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
		defer cancel()
		api := clusterv1connect.NewClusterServiceClient(hc, "https://"+follower.APIAddr())
		stream, err := api.WatchStatus(ctx, connect.NewRequest(&clusterv1.WatchStatusRequest{Interval: durationpb.New(250 * time.Millisecond)}))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		// until waits, at most within, for a snapshot for which ok is nil.
		until := func(within time.Duration, ok func(*clusterv1.WatchStatusResponse) error) {
			t.Helper()
			deadline := time.Now().Add(within)
			var last error
			for {
				if !stream.Receive() {
					t.Fatalf("the stream ended: %v (last snapshot: %v)", stream.Err(), last)
				}
				m := stream.Msg()
				if m.GetNode() != follower.Name {
					t.Fatalf("a snapshot of %q, want %s", m.GetNode(), follower.Name)
				}
				if last = ok(m); last == nil {
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("not within %v: %v", within, last)
				}
			}
		}
		until(30*time.Second, func(m *clusterv1.WatchStatusResponse) error {
			alive := 0
			for _, x := range m.GetMembers() {
				if x.GetStatus() == clusterv1.MemberStatus_MEMBER_STATUS_ALIVE {
					alive++
				}
			}
			switch {
			case len(m.GetMembers()) != 3 || alive != 3:
				return fmt.Errorf("members %v, want 3 alive", m.GetMembers())
			case m.GetLeader().GetNodeId() != leader.NodeID() || m.GetLeader().GetName() != leader.Name:
				return fmt.Errorf("leader %v (%s), want %s", m.GetLeader(), m.GetLeaderError(), leader.Name)
			case len(m.GetPeers()) != 3:
				return fmt.Errorf("peers %v (%s), want 3", m.GetPeers(), m.GetPeersError())
			case m.GetAutopilot() == nil || m.GetAutopilot().GetLeader() != leader.Name:
				return fmt.Errorf("autopilot %v (%s), want the leader's", m.GetAutopilot(), m.GetAutopilotError())
			}
			return nil
		})
		stopped := time.Now()
		c.Kill(c.Index(other))
		until(30*time.Second, func(m *clusterv1.WatchStatusResponse) error {
			for _, x := range m.GetMembers() {
				if x.GetName() == other.Name {
					if x.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
						return fmt.Errorf("%s is %v", other.Name, x.GetStatus())
					}
					return nil
				}
			}
			return fmt.Errorf("%s is not a member: %v", other.Name, m.GetMembers())
		})
		t.Logf("the stream showed %s failed %v after it stopped", other.Name, time.Since(stopped).Round(10*time.Millisecond))
	})
}

// The bound of WatchStatus's interval is checked on the API port, before
// any snapshot.
func TestWatchStatusRefusesAnIntervalOutOfBounds(t *testing.T) {
	c := agenttest.NewExpect(t, 1, nil)
	c.WaitLeader(30 * time.Second)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	stream, err := c.Node(0).API.WatchStatus(ctx, connect.NewRequest(&clusterv1.WatchStatusRequest{Interval: durationpb.New(10 * time.Millisecond)}))
	if err == nil {
		defer stream.Close()
		if stream.Receive() {
			t.Fatalf("a stream with interval 10ms sent %v", stream.Msg())
		}
		err = stream.Err()
	}
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("interval 10ms: %v, want InvalidArgument", err)
	}
}
