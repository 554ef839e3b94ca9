package agent_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

const waitFor = 30 * time.Second

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	t.Cleanup(cancel)
	return ctx
}

func mustRegister(t *testing.T, n *agenttest.Node, service, id string) *clusterv1.RegisterServiceResponse {
	t.Helper()
	resp, err := agenttest.Register(ctxT(t), n, service, id, "10.0.0.1", 8080)
	if err != nil {
		t.Fatalf("register %s/%s through %s: %v", service, id, n.Name, err)
	}
	return resp
}

func listServices(t *testing.T, n *agenttest.Node, mode clusterv1.Consistency) (*connect.Response[clusterv1.ListServicesResponse], error) {
	t.Helper()
	return n.API.ListServices(ctxT(t), connect.NewRequest(&clusterv1.ListServicesRequest{
		Read: &clusterv1.ReadOptions{Consistency: mode},
	}))
}

func TestFormationWithBootstrapExpect(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	for _, n := range c.Nodes() {
		resp, err := n.API.Members(ctxT(t), connect.NewRequest(&clusterv1.MembersRequest{}))
		if err != nil {
			t.Fatalf("members via %s: %v", n.Name, err)
		}
		if got := len(resp.Msg.GetMembers()); got != 3 {
			t.Errorf("%s sees %d gossip members, want 3", n.Name, got)
		}
	}
	resp, err := c.Follower().API.Leader(ctxT(t), connect.NewRequest(&clusterv1.LeaderRequest{}))
	if err != nil {
		t.Fatalf("leader: %v", err)
	}
	if resp.Msg.GetNodeId() != leader.NodeID() || resp.Msg.GetName() != leader.Name {
		t.Errorf("follower reports leader %s (%s), want %s (%s)", resp.Msg.GetName(), resp.Msg.GetNodeId(), leader.Name, leader.NodeID())
	}
}

func TestFormationWithBootstrapAndJoin(t *testing.T) {
	c := agenttest.New(t)
	cfg := agenttest.Config("seed", filepath.Join(t.TempDir(), "seed"))
	cfg.Cluster.Raft.Bootstrap = true
	seed := c.Start(0, cfg)
	c.WaitLeader(waitFor)
	for i := 1; i <= 2; i++ {
		cfg := agenttest.Config(fmt.Sprintf("joiner%d", i), filepath.Join(t.TempDir(), fmt.Sprintf("j%d", i)))
		cfg.Cluster.Join = []string{seed.GossipAddr()}
		c.Start(i, cfg)
	}
	c.WaitPeers(waitFor, 3, 0)
	// Every node serves a write and sees it.
	for i, n := range c.Nodes() {
		mustRegister(t, n, "web", "w"+strconv.Itoa(i))
	}
	for _, n := range c.Nodes() {
		agenttest.Eventually(t, waitFor, "replication to "+n.Name, func() error {
			resp, err := listServices(t, n, clusterv1.Consistency_CONSISTENCY_STALE)
			if err != nil {
				return err
			}
			if got := len(resp.Msg.GetInstances()); got != 3 {
				return fmt.Errorf("%d instances", got)
			}
			return nil
		})
	}
}

func TestForwardingAndReadModes(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(waitFor)
	f := c.Follower()
	reg := mustRegister(t, f, "db", "db-1")
	if reg.GetIndex() == 0 || reg.GetInstance().GetNode() != f.Name {
		t.Fatalf("register via follower: index %d node %q, want index > 0 and node %s", reg.GetIndex(), reg.GetInstance().GetNode(), f.Name)
	}
	for _, tc := range []struct {
		name string
		mode clusterv1.Consistency
	}{
		{"default", clusterv1.Consistency_CONSISTENCY_DEFAULT},
		{"consistent", clusterv1.Consistency_CONSISTENCY_CONSISTENT},
		{"unspecified", clusterv1.Consistency_CONSISTENCY_UNSPECIFIED},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := listServices(t, f, tc.mode)
			if err != nil {
				t.Fatalf("list: %v", err)
			}
			if got := len(resp.Msg.GetInstances()); got != 1 {
				t.Fatalf("got %d instances, want 1: a %s read after an acknowledged write must see it", got, tc.name)
			}
			idx, _ := strconv.ParseUint(resp.Header().Get("Pivirt-Index"), 10, 64)
			if idx < reg.GetIndex() {
				t.Errorf("Pivirt-Index %d < write index %d", idx, reg.GetIndex())
			}
			if resp.Header().Get("Pivirt-Known-Leader") != "true" {
				t.Errorf("Pivirt-Known-Leader = %q, want true", resp.Header().Get("Pivirt-Known-Leader"))
			}
			// A consistent read is served by the follower asked, after the
			// leader's read index; a default read by the leader.
			wantBy := leader.Name
			if tc.mode == clusterv1.Consistency_CONSISTENCY_CONSISTENT {
				wantBy = f.Name
			}
			if got := resp.Header().Get("Pivirt-Served-By"); got != wantBy {
				t.Errorf("Pivirt-Served-By = %q, want %s", got, wantBy)
			}
		})
	}
	t.Run("stale", func(t *testing.T) {
		agenttest.Eventually(t, waitFor, "stale read on the follower", func() error {
			resp, err := listServices(t, f, clusterv1.Consistency_CONSISTENCY_STALE)
			if err != nil {
				return err
			}
			if resp.Header().Get("Pivirt-Served-By") != f.Name {
				return fmt.Errorf("served by %q, want %s", resp.Header().Get("Pivirt-Served-By"), f.Name)
			}
			if len(resp.Msg.GetInstances()) != 1 {
				return fmt.Errorf("%d instances", len(resp.Msg.GetInstances()))
			}
			if resp.Header().Get("Pivirt-Last-Contact") == "" {
				return errors.New("no Pivirt-Last-Contact header")
			}
			return nil
		})
	})
	t.Run("config-cas", func(t *testing.T) {
		set := func(value string, cas *uint64) (*clusterv1.ConfigEntry, error) {
			resp, err := f.API.SetConfig(ctxT(t), connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/log_level", Value: value, CasRevision: cas}))
			if err != nil {
				return nil, err
			}
			return resp.Msg.GetEntry(), nil
		}
		zero := uint64(0)
		e1, err := set("info", &zero)
		if err != nil {
			t.Fatalf("create with cas 0: %v", err)
		}
		if _, err := set("debug", &zero); connect.CodeOf(err) != connect.CodeAborted {
			t.Fatalf("second create with cas 0: got %v, want Aborted", err)
		}
		rev := e1.GetRevision()
		if _, err := set("debug", &rev); err != nil {
			t.Fatalf("update with the current revision: %v", err)
		}
		if _, err := set("warn", &rev); connect.CodeOf(err) != connect.CodeAborted {
			t.Fatalf("update with a stale revision: got %v, want Aborted", err)
		}
		hist, err := f.API.ConfigHistory(ctxT(t), connect.NewRequest(&clusterv1.ConfigHistoryRequest{Key: "kv/log_level"}))
		if err != nil {
			t.Fatalf("history: %v", err)
		}
		var values []string
		for _, e := range hist.Msg.GetEntries() {
			values = append(values, e.GetValue())
		}
		if fmt.Sprint(values) != "[debug info]" {
			t.Errorf("history = %v, want [debug info] (newest first)", values)
		}
	})
	t.Run("bad-input", func(t *testing.T) {
		_, err := agenttest.Register(ctxT(t), f, "bad name", "x", "10.0.0.1", 80)
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Fatalf("got %v, want InvalidArgument", err)
		}
		_, err = agenttest.Register(ctxT(t), f, "web", "x", "10.0.0.1", 70000)
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Fatalf("port 70000: got %v, want InvalidArgument", err)
		}
		resp, err := listServices(t, f, clusterv1.Consistency_CONSISTENCY_CONSISTENT)
		if err != nil || len(resp.Msg.GetInstances()) != 1 {
			t.Fatalf("after bad input: %v instances, err %v; want the one stored instance", len(resp.Msg.GetInstances()), err)
		}
	})
	t.Run("blocking-queries", func(t *testing.T) {
		list := func(ctx context.Context, mode clusterv1.Consistency, waitIndex uint64, wait time.Duration) (*connect.Response[clusterv1.ListServicesResponse], error) {
			ro := &clusterv1.ReadOptions{Consistency: mode, WaitIndex: waitIndex}
			if wait != 0 {
				ro.WaitTime = durationpb.New(wait)
			}
			return f.API.ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{Service: "blk", Read: ro}))
		}
		indexOf := func(resp *connect.Response[clusterv1.ListServicesResponse]) uint64 {
			idx, _ := strconv.ParseUint(resp.Header().Get("Pivirt-Index"), 10, 64)
			return idx
		}
		modes := []clusterv1.Consistency{clusterv1.Consistency_CONSISTENCY_STALE, clusterv1.Consistency_CONSISTENCY_DEFAULT, clusterv1.Consistency_CONSISTENCY_CONSISTENT}
		for i, mode := range modes {
			resp, err := list(ctxT(t), clusterv1.Consistency_CONSISTENCY_CONSISTENT, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			start := indexOf(resp)
			// Nothing changes: the answer comes after the wait, unchanged.
			began := time.Now()
			resp, err = list(ctxT(t), mode, start, 300*time.Millisecond)
			if err != nil {
				t.Fatalf("%v: blocking query that times out: %v", mode, err)
			}
			if took := time.Since(began); took < 300*time.Millisecond || indexOf(resp) != start {
				t.Fatalf("%v: answered after %v with index %d; want the wait (300ms) and index %d", mode, took, indexOf(resp), start)
			}
			type answer struct {
				resp *connect.Response[clusterv1.ListServicesResponse]
				err  error
			}
			// A write to another service does not wake it.
			other := make(chan answer, 1)
			began = time.Now()
			go func() {
				r, err := list(ctxT(t), mode, start, time.Second)
				other <- answer{r, err}
			}()
			mustRegister(t, c.Nodes()[i%3], "blk-other", fmt.Sprintf("other-%d", i))
			if a := <-other; a.err != nil {
				t.Fatalf("%v: blocking query while another service changed: %v", mode, a.err)
			} else if took := time.Since(began); took < time.Second || len(a.resp.Msg.GetInstances()) != i {
				// The answer's index is the services table's: it moved.
				t.Fatalf("%v: a change to another service answered a blocking query on blk after %v with %d instances; want the wait (1s) and %d", mode, took, len(a.resp.Msg.GetInstances()), i)
			}
			// A write wakes it with the new state.
			got := make(chan answer, 1)
			go func() {
				r, err := list(ctxT(t), mode, start, time.Minute)
				got <- answer{r, err}
			}()
			mustRegister(t, c.Nodes()[i%3], "blk", fmt.Sprintf("blk-%d", i))
			select {
			case a := <-got:
				if a.err != nil {
					t.Fatalf("%v: woken blocking query: %v", mode, a.err)
				}
				if indexOf(a.resp) <= start || len(a.resp.Msg.GetInstances()) != i+1 {
					t.Fatalf("%v: woken with index %d (waited on %d) and %d instances, want a newer index and %d", mode, indexOf(a.resp), start, len(a.resp.Msg.GetInstances()), i+1)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("%v: a write did not wake the blocking query", mode)
			}
		}
		// A config key blocks on its own revision.
		set, err := f.API.SetConfig(ctxT(t), connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/blk", Value: "1"}))
		if err != nil {
			t.Fatal(err)
		}
		rev := set.Msg.GetEntry().GetRevision()
		gotCfg := make(chan *clusterv1.ConfigEntry, 1)
		go func() {
			r, err := f.API.GetConfig(ctxT(t), connect.NewRequest(&clusterv1.GetConfigRequest{Key: "kv/blk",
				Read: &clusterv1.ReadOptions{WaitIndex: rev, WaitTime: durationpb.New(time.Minute)}}))
			if err != nil {
				t.Error(err)
			}
			gotCfg <- r.Msg.GetEntry()
		}()
		if _, err := f.API.SetConfig(ctxT(t), connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/blk", Value: "2"})); err != nil {
			t.Fatal(err)
		}
		select {
		case e := <-gotCfg:
			if e.GetValue() != "2" || e.GetRevision() <= rev {
				t.Fatalf("config blocking query woke with %v, want value 2 at a revision above %d", e, rev)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("setting the key did not wake the blocking query")
		}
		// Bad input.
		_, err = f.API.Peers(ctxT(t), connect.NewRequest(&clusterv1.PeersRequest{Read: &clusterv1.ReadOptions{WaitIndex: 1}}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("wait_index on Peers: %v, want InvalidArgument", err)
		}
		_, err = list(ctxT(t), clusterv1.Consistency_CONSISTENCY_DEFAULT, 1, -time.Second)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "read.wait_time") {
			t.Errorf("negative wait_time: %v, want InvalidArgument naming read.wait_time", err)
		}
	})
	t.Run("grpc-clients", func(t *testing.T) {
		// The API and internal ports serve gRPC clients through grpc-go:
		// a write through the follower's API port is forwarded, a
		// consistent read sees it with the query headers, and the
		// leader-only instance of the internal port refuses on a follower.
		cc, err := grpc.NewClient(f.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		api := clusterv1.NewClusterServiceClient(cc)
		reg, err := api.RegisterService(ctxT(t), &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
			Service: "grpc", InstanceId: "grpc-1", Address: "10.0.0.9", Port: 9,
		}})
		if err != nil {
			t.Fatalf("register over gRPC via the follower: %v", err)
		}
		var hdr metadata.MD
		got, err := api.GetService(ctxT(t), &clusterv1.GetServiceRequest{
			Service: "grpc", InstanceId: "grpc-1",
			Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
		}, grpc.Header(&hdr))
		if err != nil || len(got.GetInstances()) != 1 {
			t.Fatalf("consistent get over gRPC: %v, %v", got, err)
		}
		idx, _ := strconv.ParseUint(first(hdr.Get("pivirt-index")), 10, 64)
		if idx < reg.GetIndex() {
			t.Errorf("pivirt-index %d < write index %d (headers %v)", idx, reg.GetIndex(), hdr)
		}
		_, err = api.RegisterService(ctxT(t), &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{Service: "bad name", InstanceId: "x", Address: "10.0.0.1"}})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("bad name over gRPC: got %v, want InvalidArgument", err)
		}

		ic, err := grpc.NewClient(f.InternalAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer ic.Close()
		if _, err := nodev1.NewNodeServiceClient(ic).Status(ctxT(t), &nodev1.StatusRequest{}); err != nil {
			t.Errorf("node status over gRPC on the internal port: %v", err)
		}
		_, err = clusterv1.NewClusterServiceClient(ic).GetService(ctxT(t), &clusterv1.GetServiceRequest{Service: "grpc"})
		if status.Code(err) != codes.Unavailable {
			t.Errorf("leader-only instance on a follower: got %v, want Unavailable", err)
		}
	})
	t.Run("retry through another node", func(t *testing.T) { retryThroughAnotherNode(t, f, leader) })
	t.Run("register without an ID replaces the node's instance", func(t *testing.T) {
		// The default instance ID is SERVICE-NODE: registering again on
		// a node replaces its instance; another node adds its own.
		for _, r := range []struct {
			n    *agenttest.Node
			addr string
		}{{f, "10.0.0.1"}, {f, "10.0.0.2"}, {leader, "10.0.0.3"}} {
			if _, err := agenttest.Register(ctxT(t), r.n, "noid", "", r.addr, 80); err != nil {
				t.Fatalf("register noid through %s: %v", r.n.Name, err)
			}
		}
		resp, err := f.API.GetService(ctxT(t), connect.NewRequest(&clusterv1.GetServiceRequest{
			Service: "noid", Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
		}))
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for _, in := range resp.Msg.GetInstances() {
			got[in.GetInstanceId()] = in.GetNode() + " " + in.GetAddress()
		}
		want := map[string]string{"noid-" + f.Name: f.Name + " 10.0.0.2", "noid-" + leader.Name: leader.Name + " 10.0.0.3"}
		if !maps.Equal(got, want) {
			t.Errorf("instances %v, want %v", got, want)
		}
	})
}

// retryThroughAnotherNode registers through a, then sends the very same
// write (same client ID and sequence) through b, as a client does after an
// unknown outcome: b would record the instance on itself, yet the retry is
// answered as the write it repeats (once refused as "already used for a
// different write").
func retryThroughAnotherNode(t *testing.T, a, b *agenttest.Node) {
	t.Helper()
	req := &clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: "retried", InstanceId: "r-1", Address: "127.0.0.1", Port: 6379},
		Write:    &clusterv1.WriteOptions{ClientId: "retrying-client", Sequence: 1},
	}
	var got []string
	for _, n := range []*agenttest.Node{a, b} {
		resp, err := n.API.RegisterService(ctxT(t), connect.NewRequest(proto.CloneOf(req)))
		if err != nil {
			t.Fatalf("register through %s: %v", n.Name, err)
		}
		got = append(got, resp.Msg.GetInstance().GetNode())
	}
	if got[0] != a.Name || got[1] != a.Name {
		t.Fatalf("nodes of the write and its retry: %v, want %s for both", got, a.Name)
	}
}

func TestLeaderFailoverWritesContinueThroughFollower(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(waitFor)
	mustRegister(t, c.Follower(), "web", "before")
	c.Kill(c.Index(leader))
	var survivor *agenttest.Node
	for _, n := range c.Nodes() {
		survivor = n
	}
	// The write waits (up to the hold timeout) for the new leader.
	mustRegister(t, survivor, "web", "after")
	newLeader := c.WaitLeader(waitFor)
	if newLeader.NodeID() == leader.NodeID() {
		t.Fatalf("leader did not change")
	}
	resp, err := listServices(t, survivor, clusterv1.Consistency_CONSISTENCY_CONSISTENT)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(resp.Msg.GetInstances()); got != 2 {
		t.Fatalf("got %d instances after failover, want 2", got)
	}
}

func TestNoLeaderFailsAfterHoldTimeout(t *testing.T) {
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		cfg.Cluster.ForwardHoldTimeout = config.Duration(time.Second)
	})
	c.WaitLeader(waitFor)
	c.Kill(0)
	c.Kill(1)
	n := c.Node(2)
	start := time.Now()
	_, err := agenttest.Register(ctxT(t), n, "web", "x", "10.0.0.1", 80)
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("got %v, want Unavailable", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "no cluster leader") {
		t.Errorf("error %q does not say there is no leader", msg)
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("failed after %s, before the 1s hold timeout", d)
	}
}

func TestRestartRejoinsWithSameID(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	f := c.Follower()
	i := c.Index(f)
	id := f.NodeID()
	mustRegister(t, f, "web", "a")
	c.Kill(i)
	mustRegister(t, c.Node((i+1)%3), "web", "b")
	// No join address: the node rejoins the members it saved before stopping.
	n := c.Restart(i, false, "")
	if n.NodeID() != id {
		t.Fatalf("restarted node has id %s, want %s", n.NodeID(), id)
	}
	c.WaitPeers(waitFor, 3, 0)
	agenttest.Eventually(t, waitFor, "restarted node catches up", func() error {
		resp, err := listServices(t, n, clusterv1.Consistency_CONSISTENCY_STALE)
		if err != nil {
			return err
		}
		if got := len(resp.Msg.GetInstances()); got != 2 {
			return fmt.Errorf("%d instances", got)
		}
		return nil
	})
}

func TestRestartOnNewAddressKeepsIdentity(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	f := c.Follower()
	i := c.Index(f)
	oldRaft := f.RaftAddr()
	c.Kill(i)
	seed := c.Node((i + 1) % 3).GossipAddr()
	n := c.Restart(i, true, seed)
	if n.RaftAddr() == oldRaft {
		t.Fatalf("restart kept raft address %s; the test needs a new one", oldRaft)
	}
	agenttest.Eventually(t, waitFor, "leader learns the new raft address", func() error {
		leader := c.WaitLeader(waitFor)
		servers, err := leader.Store().Servers(t.Context())
		if err != nil {
			return err
		}
		for _, s := range servers {
			if s.ID == n.NodeID() {
				if s.Address != n.RaftAddr() {
					return fmt.Errorf("raft has %s for %s, want %s", s.Address, n.Name, n.RaftAddr())
				}
				return nil
			}
		}
		return fmt.Errorf("%s not in raft configuration", n.Name)
	})
	c.WaitPeers(waitFor, 3, 0)
	mustRegister(t, n, "web", "via-moved-node")
}

func TestNonVoterPromotionAndDeadServerCleanup(t *testing.T) {
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		cfg.Cluster.Raft.DeadServerCleanup = config.Duration(2 * time.Second)
	})
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	cfg := agenttest.Config("node4", filepath.Join(t.TempDir(), "node4"))
	cfg.Cluster.Raft.DeadServerCleanup = config.Duration(2 * time.Second)
	cfg.Cluster.Join = []string{c.Node(0).GossipAddr()}
	n4 := c.Start(3, cfg)
	c.WaitPeers(waitFor, 3, 1)
	// Kill a voter that is not the leader: the leader removes it once it has
	// been failed past the threshold and promotes the non-voter.
	var victim *agenttest.Node
	for _, n := range c.Nodes() {
		if !n.Store().IsLeader() && n != n4 {
			victim = n
		}
	}
	c.Kill(c.Index(victim))
	c.WaitPeers(waitFor, 3, 0)
	leader := c.WaitLeader(waitFor)
	servers, err := leader.Store().Servers(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range servers {
		if s.ID == victim.NodeID() {
			t.Fatalf("dead server %s still in the configuration", victim.Name)
		}
		if s.ID == n4.NodeID() && !s.Voter {
			t.Fatalf("node4 not promoted")
		}
	}
	mustRegister(t, n4, "web", "after-promotion")
}

func TestDeadServerCleanupKeepsQuorum(t *testing.T) {
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		cfg.Cluster.Raft.DeadServerCleanup = config.Duration(time.Second)
	})
	c.WaitLeader(waitFor)
	// One dead voter of three is removed (two healthy voters remain).
	f := c.Follower()
	c.Kill(c.Index(f))
	c.WaitPeers(waitFor, 2, 0)
}

func TestLeaveRemovesServer(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	f := c.Follower()
	if _, err := f.API.Leave(ctxT(t), connect.NewRequest(&clusterv1.LeaveRequest{})); err != nil {
		t.Fatalf("leave: %v", err)
	}
	select {
	case <-f.Done():
	case <-time.After(waitFor):
		t.Fatal("agent did not stop after leave")
	}
	c.WaitPeers(waitFor, 2, 0)
}

func TestTransferAndRemovePeer(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(waitFor)
	f := c.Follower()
	resp, err := f.API.TransferLeader(ctxT(t), connect.NewRequest(&clusterv1.TransferLeaderRequest{NodeId: f.NodeID()}))
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	if resp.Msg.GetNodeId() != f.NodeID() {
		t.Fatalf("transferred to %s, want %s", resp.Msg.GetNodeId(), f.NodeID())
	}
	if got := c.WaitLeader(waitFor); got.NodeID() != f.NodeID() {
		t.Fatalf("leader is %s, want %s", got.Name, f.Name)
	}
	_, err = f.API.RemovePeer(ctxT(t), connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: "no-such-node"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("remove unknown peer: got %v, want NotFound", err)
	}
	c.Kill(c.Index(leader))
	if _, err := f.API.RemovePeer(ctxT(t), connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: leader.NodeID()})); err != nil {
		t.Fatalf("remove old leader: %v", err)
	}
	c.WaitPeers(waitFor, 2, 0)
}

func TestTTLExpiryMarksCritical(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	f := c.Follower()
	_, err := f.API.RegisterService(ctxT(t), connect.NewRequest(&clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: "ttl", InstanceId: "t1", Address: "10.0.0.1", Port: 1, Ttl: durationProto(time.Second)},
	}))
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "instance turns critical", func() error {
		resp, err := f.API.GetService(ctxT(t), connect.NewRequest(&clusterv1.GetServiceRequest{Service: "ttl", InstanceId: "t1"}))
		if err != nil {
			return err
		}
		if h := resp.Msg.GetInstances()[0].GetHealth(); h != clusterv1.Health_HEALTH_CRITICAL {
			return fmt.Errorf("health %s", h)
		}
		return nil
	})
	hb, err := f.API.Heartbeat(ctxT(t), connect.NewRequest(&clusterv1.HeartbeatRequest{Service: "ttl", InstanceId: "t1"}))
	if err != nil {
		t.Fatal(err)
	}
	if hb.Msg.GetInstance().GetHealth() != clusterv1.Health_HEALTH_PASSING {
		t.Fatalf("after heartbeat: %s, want passing", hb.Msg.GetInstance().GetHealth())
	}
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// TestAutopilotStateAndForceLeave: autopilot state tells each server's
// health and why the fourth server stays a non-voter; force-leave marks a
// killed voter left on every member, and the leader then removes it and
// promotes the non-voter, long before dead_server_cleanup would.
func TestAutopilotStateAndForceLeave(t *testing.T) {
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		cfg.Cluster.Raft.DeadServerCleanup = config.Duration(time.Hour)
	})
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	cfg := agenttest.Config("node4", filepath.Join(t.TempDir(), "node4"))
	cfg.Cluster.Raft.DeadServerCleanup = config.Duration(time.Hour)
	cfg.Cluster.Join = []string{c.Node(0).GossipAddr()}
	n4 := c.Start(3, cfg)
	c.WaitPeers(waitFor, 3, 1)

	state := func(n *agenttest.Node) (*clusterv1.AutopilotStateResponse, error) {
		resp, err := n.API.AutopilotState(ctxT(t), connect.NewRequest(&clusterv1.AutopilotStateRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	byName := func(st *clusterv1.AutopilotStateResponse, name string) *clusterv1.AutopilotServer {
		for _, s := range st.GetServers() {
			if s.GetName() == name {
				return s
			}
		}
		return nil
	}
	leader := c.WaitLeader(waitFor)
	var victim *agenttest.Node
	for _, n := range c.Nodes() {
		if n != leader && n != n4 {
			victim = n
		}
	}
	agenttest.Eventually(t, waitFor, "autopilot state with a healthy non-voter node4", func() error {
		st, err := state(victim) // a follower forwards to the leader
		if err != nil {
			return err
		}
		s4 := byName(st, "node4")
		switch {
		case len(st.GetServers()) != 4 || s4 == nil:
			return fmt.Errorf("servers %v", st.GetServers())
		case !st.GetHealthy() || st.GetFailureTolerance() != 1 || st.GetLeader() != leader.Name || st.GetVotersTarget() != 3:
			return fmt.Errorf("healthy %t, failure tolerance %d, leader %q, voters target %d", st.GetHealthy(), st.GetFailureTolerance(), st.GetLeader(), st.GetVotersTarget())
		case s4.GetVoter() || !s4.GetHealthy() || s4.GetStableSince() == nil || !strings.Contains(s4.GetStatus(), "the cluster has its 3 voters"):
			return fmt.Errorf("node4: %v", s4)
		case byName(st, leader.Name).GetStatus() != "leader" || byName(st, victim.Name).GetStatus() != "voter":
			return fmt.Errorf("statuses: %v", st.GetServers())
		}
		return nil
	})

	_, err := leader.API.ForceLeave(ctxT(t), connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: victim.Name}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "pvcli cluster leave") {
		t.Errorf("force-leave of an alive member: %v, want FailedPrecondition pointing to leave", err)
	}
	_, err = leader.API.ForceLeave(ctxT(t), connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: "node9"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("force-leave of an unknown member: %v, want NotFound", err)
	}

	c.Kill(c.Index(victim))
	agenttest.Eventually(t, waitFor, victim.Name+" failed in gossip and unhealthy in autopilot", func() error {
		st, err := state(n4)
		if err != nil {
			return err
		}
		if s := byName(st, victim.Name); st.GetHealthy() || s == nil || s.GetHealthy() ||
			s.GetGossipStatus() != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
			return fmt.Errorf("healthy %t, %s: %v", st.GetHealthy(), victim.Name, s)
		}
		return nil
	})
	// force-leave checks the view of the agent asked: wait for node4's own.
	agenttest.Eventually(t, waitFor, victim.Name+" failed in node4's gossip view", func() error {
		members, err := n4.API.Members(ctxT(t), connect.NewRequest(&clusterv1.MembersRequest{}))
		if err != nil {
			return err
		}
		for _, m := range members.Msg.GetMembers() {
			if m.GetName() == victim.Name && m.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
				return fmt.Errorf("node4 sees %s %v", victim.Name, m.GetStatus())
			}
		}
		return nil
	})
	resp, err := n4.API.ForceLeave(ctxT(t), connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: victim.Name}))
	if err != nil {
		t.Fatalf("force-leave %s: %v", victim.Name, err)
	}
	if len(resp.Msg.GetNodes()) != 3 {
		t.Errorf("force-leave told %d members, want the 3 live ones: %v", len(resp.Msg.GetNodes()), resp.Msg.GetNodes())
	}
	for _, n := range resp.Msg.GetNodes() {
		if n.GetError() != "" {
			t.Errorf("force-leave on %s: %s", n.GetNode(), n.GetError())
		}
	}
	c.WaitPeers(waitFor, 3, 0)
	// A member that still saw the victim alive when told marks it left
	// once its own failure detection agrees.
	agenttest.Eventually(t, waitFor, victim.Name+" left on every member", func() error {
		for _, n := range c.Nodes() {
			members, err := n.API.Members(ctxT(t), connect.NewRequest(&clusterv1.MembersRequest{}))
			if err != nil {
				return err
			}
			for _, m := range members.Msg.GetMembers() {
				if m.GetName() == victim.Name && m.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_LEFT {
					return fmt.Errorf("%s sees %s %v, want left", n.Name, victim.Name, m.GetStatus())
				}
			}
		}
		return nil
	})
}
