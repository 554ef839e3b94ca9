package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// watchCluster is a two-server cluster as n1 sees it: n1 leads (leader
// "" makes it leaderless), n2 follows 3 entries behind; its gossip
// members change when the test says so, and subscribers hear of it.
type watchCluster struct {
	mu      sync.Mutex
	members []cluster.Member
	subs    map[chan struct{}]struct{}
	leader  string
}

func newWatchCluster() *watchCluster {
	return &watchCluster{
		leader: "n1",
		subs:   map[chan struct{}]struct{}{},
		members: []cluster.Member{
			{Name: "n1", Status: cluster.StatusAlive, Meta: cluster.NodeMeta{ID: "n1", RaftAddr: "n1:8300", InternalAddr: "n1:9000"}},
			{Name: "n2", Status: cluster.StatusAlive, Meta: cluster.NodeMeta{ID: "n2", RaftAddr: "n2:8300", InternalAddr: "n2:9000"}},
		},
	}
}

// setStatus changes the gossip status of a member and tells subscribers.
func (c *watchCluster) setStatus(name string, st cluster.MemberStatus) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.members {
		if c.members[i].Name == name {
			c.members[i].Status = st
		}
	}
	for ch := range c.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (c *watchCluster) Subscribe() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	c.mu.Lock()
	c.subs[ch] = struct{}{}
	c.mu.Unlock()
	return ch, func() {
		c.mu.Lock()
		delete(c.subs, ch)
		c.mu.Unlock()
	}
}

func (c *watchCluster) Members() []cluster.Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]cluster.Member(nil), c.members...)
}

func (c *watchCluster) MemberByID(id string) (cluster.Member, bool) {
	for _, m := range c.Members() {
		if m.Meta.ID == id {
			return m, true
		}
	}
	return cluster.Member{}, false
}
func (c *watchCluster) ServerByID(id, _ string) (cluster.Member, bool) { return c.MemberByID(id) }
func (c *watchCluster) Join([]string) (int, error)                     { return 0, nil }

// Consensus, as n1.
func (c *watchCluster) Apply(context.Context, []byte) (any, uint64, error) {
	return nil, 0, errors.New("no writes here")
}
func (c *watchCluster) Leader() (string, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.leader == "" {
		return "", ""
	}
	return c.leader, c.leader + ":8300"
}
func (c *watchCluster) ReadIndex(context.Context) (uint64, error) { return 10, nil }
func (c *watchCluster) RaftStatus() RaftStatus {
	id, _ := c.Leader()
	st := RaftStatus{State: "Leader", Term: 2, LastIndex: 10, CommitIndex: 10, AppliedIndex: 10, LeaderID: id}
	if id == "" {
		st.State, st.NoLeaderSince = "Candidate", time.Now().Add(-time.Minute)
	}
	return st
}

// RaftAdmin.
func (c *watchCluster) Servers(context.Context) ([]cluster.RaftServer, error) {
	return []cluster.RaftServer{{ID: "n1", Address: "n1:8300", Voter: true}, {ID: "n2", Address: "n2:8300", Voter: true}}, nil
}
func (c *watchCluster) RemoveServer(context.Context, string) error { return errors.New("no") }
func (c *watchCluster) TransferLeadership(context.Context, string) (string, error) {
	return "", errors.New("no")
}

// Peers.
func (c *watchCluster) Status(_ context.Context, addr string) (*nodev1.StatusResponse, error) {
	if addr != "n2:9000" {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("unknown "+addr))
	}
	return &nodev1.StatusResponse{RaftState: "Follower", Term: 2, LastIndex: 7, CommitIndex: 7, AppliedIndex: 7, LastContact: durationpb.New(40 * time.Millisecond)}, nil
}
func (c *watchCluster) Cluster(string) clusterv1connect.ClusterServiceClient {
	return forwardedTo{v: &followerView{}}
}

type watchPeers struct{ *watchCluster }

func (p watchPeers) ReadIndex(context.Context, string) (uint64, error) {
	return 0, connect.NewError(connect.CodeUnavailable, errors.New("no leader"))
}

func newWatchService(t *testing.T, c *watchCluster) *ClusterService {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultClusterServiceConfig()
	cfg.NodeID, cfg.NodeName = "n1", "n1"
	cfg.HoldTimeout = time.Second
	cfg.Autopilot = func() (cluster.ReconcileReport, bool) {
		return cluster.ReconcileReport{Voters: 3, MaxTrailingLogs: 100, Servers: map[string]cluster.ServerReport{}}, true
	}
	h, err := NewClusterService(cfg, c, c, c, watchPeers{c}, f)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// startWatch runs a WatchStatus stream and returns its messages; the
// stream ends with the test.
func startWatch(t *testing.T, h *ClusterService, req *clusterv1.WatchStatusRequest) <-chan *clusterv1.WatchStatusResponse {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan *clusterv1.WatchStatusResponse, 16)
	done := make(chan error, 1)
	go func() {
		done <- h.watchStatus(ctx, req, http.Header{}, func(m *clusterv1.WatchStatusResponse) error {
			select {
			case out <- m:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("stream ended with %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("the stream did not end within 5s of its client going away")
		}
	})
	return out
}

func next(t *testing.T, ch <-chan *clusterv1.WatchStatusResponse, within time.Duration) *clusterv1.WatchStatusResponse {
	t.Helper()
	select {
	case m := <-ch:
		return m
	case <-time.After(within):
		t.Fatalf("no snapshot within %v", within)
		return nil
	}
}

func memberStatus(m *clusterv1.WatchStatusResponse, name string) clusterv1.MemberStatus {
	for _, x := range m.GetMembers() {
		if x.GetName() == name {
			return x.GetStatus()
		}
	}
	return clusterv1.MemberStatus_MEMBER_STATUS_UNSPECIFIED
}

// The first snapshot comes at once, whatever the interval, and holds
// every part: members, peers with their lag, the leader and autopilot.
func TestWatchStatusFirstSnapshotAtOnce(t *testing.T) {
	c := newWatchCluster()
	h := newWatchService(t, c)
	start := time.Now()
	m := next(t, startWatch(t, h, &clusterv1.WatchStatusRequest{Interval: durationpb.New(time.Minute)}), 3*time.Second)
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("first snapshot after %v, want at once", d)
	}
	if m.GetNode() != "n1" || m.GetTime() == nil {
		t.Errorf("node %q time %v, want n1 and a time", m.GetNode(), m.GetTime())
	}
	if len(m.GetMembers()) != 2 || memberStatus(m, "n2") != clusterv1.MemberStatus_MEMBER_STATUS_ALIVE {
		t.Errorf("members %v, want n1 and n2 alive", m.GetMembers())
	}
	if m.GetPeersError() != "" || len(m.GetPeers()) != 2 {
		t.Fatalf("peers %v (error %q), want 2", m.GetPeers(), m.GetPeersError())
	}
	for _, p := range m.GetPeers() {
		if p.GetNodeId() == "n2" && (p.GetTrailing() != 3 || p.GetState() != clusterv1.RaftState_RAFT_STATE_FOLLOWER) {
			t.Errorf("n2: trailing %d state %v, want 3 behind, follower", p.GetTrailing(), p.GetState())
		}
	}
	if m.GetLeader().GetNodeId() != "n1" || m.GetLeaderError() != "" {
		t.Errorf("leader %v (error %q), want n1", m.GetLeader(), m.GetLeaderError())
	}
	if m.GetAutopilot() == nil || m.GetAutopilotError() != "" || len(m.GetAutopilot().GetServers()) != 2 {
		t.Errorf("autopilot %v (error %q), want the state of 2 servers", m.GetAutopilot(), m.GetAutopilotError())
	}
}

// A change of the gossip membership sends a snapshot at once, long before
// the interval.
func TestWatchStatusMemberChangeSendsSnapshot(t *testing.T) {
	c := newWatchCluster()
	h := newWatchService(t, c)
	ch := startWatch(t, h, &clusterv1.WatchStatusRequest{Interval: durationpb.New(time.Minute)})
	if m := next(t, ch, 3*time.Second); memberStatus(m, "n2") != clusterv1.MemberStatus_MEMBER_STATUS_ALIVE {
		t.Fatalf("first snapshot: n2 is %v, want alive", memberStatus(m, "n2"))
	}
	c.setStatus("n2", cluster.StatusFailed)
	m := next(t, ch, 3*time.Second)
	if got := memberStatus(m, "n2"); got != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
		t.Fatalf("after n2 failed: n2 is %v, want failed", got)
	}
}

// Without a change, a snapshot comes every interval.
func TestWatchStatusEveryInterval(t *testing.T) {
	h := newWatchService(t, newWatchCluster())
	ch := startWatch(t, h, &clusterv1.WatchStatusRequest{Interval: durationpb.New(MinWatchInterval)})
	first := next(t, ch, 3*time.Second)
	second := next(t, ch, 3*time.Second)
	if gap := second.GetTime().AsTime().Sub(first.GetTime().AsTime()); gap < MinWatchInterval-20*time.Millisecond {
		t.Errorf("snapshots %v apart, want at least the interval %v", gap, MinWatchInterval)
	}
}

// Without a leader the snapshot still comes, with the members and the
// reasons in place of what only a leader can tell.
func TestWatchStatusWithoutLeader(t *testing.T) {
	c := newWatchCluster()
	c.leader = ""
	h := newWatchService(t, c)
	m := next(t, startWatch(t, h, &clusterv1.WatchStatusRequest{Interval: durationpb.New(MinWatchInterval)}), 5*time.Second)
	if len(m.GetMembers()) != 2 {
		t.Errorf("members %v, want 2", m.GetMembers())
	}
	if m.GetAutopilot() != nil || !strings.Contains(m.GetAutopilotError(), "no cluster leader") || !strings.HasPrefix(m.GetAutopilotError(), "unavailable: ") {
		t.Errorf("autopilot %v error %q, want unset and an unavailable error naming no leader", m.GetAutopilot(), m.GetAutopilotError())
	}
	if m.GetLeader() != nil || m.GetLeaderError() == "" {
		t.Errorf("leader %v error %q, want unset with a reason", m.GetLeader(), m.GetLeaderError())
	}
	if m.GetPeersError() == "" {
		t.Errorf("peers %v without an error, want the reason", m.GetPeers())
	}
}

func TestWatchStatusInterval(t *testing.T) {
	for _, tc := range []struct {
		in   *durationpb.Duration
		want time.Duration // 0: InvalidArgument
	}{
		{nil, time.Second},
		{durationpb.New(MinWatchInterval), MinWatchInterval},
		{durationpb.New(time.Minute), time.Minute},
		{durationpb.New(249 * time.Millisecond), 0},
		{durationpb.New(time.Minute + time.Millisecond), 0},
		{durationpb.New(-time.Second), 0},
		{&durationpb.Duration{Seconds: 1, Nanos: -1}, 0},
	} {
		got, err := WatchStatusInterval(&clusterv1.WatchStatusRequest{Interval: tc.in})
		if tc.want != 0 {
			if err != nil || got != tc.want {
				t.Errorf("interval %v: got %v, %v; want %v", tc.in, got, err, tc.want)
			}
			continue
		}
		ce := toConnect(err)
		if connect.CodeOf(ce) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "interval") {
			t.Errorf("interval %v: got %v, want InvalidArgument naming interval", tc.in, err)
		}
	}
	// The stream refuses it before sending anything.
	h := newWatchService(t, newWatchCluster())
	err := h.watchStatus(context.Background(), &clusterv1.WatchStatusRequest{Interval: durationpb.New(time.Hour)}, http.Header{}, func(*clusterv1.WatchStatusResponse) error {
		t.Error("a snapshot was sent for an invalid interval")
		return nil
	})
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "250ms to 1m0s") {
		t.Errorf("interval 1h: got %v, want InvalidArgument with the bounds", err)
	}
}

// The gRPC adapter serves the same stream, and its errors as gRPC codes.
func TestWatchStatusOverGRPC(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	clusterv1.RegisterClusterServiceServer(gs, NewClusterGRPC(newWatchService(t, newWatchCluster())))
	served := make(chan error, 1)
	go func() { served <- gs.Serve(ln) }()
	t.Cleanup(func() {
		gs.Stop()
		<-served
	})
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	client := clusterv1.NewClusterServiceClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	stream, err := client.WatchStatus(ctx, &clusterv1.WatchStatusRequest{Interval: durationpb.New(MinWatchInterval)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		m, err := stream.Recv()
		if err != nil {
			t.Fatalf("snapshot %d: %v", i, err)
		}
		if m.GetNode() != "n1" || len(m.GetMembers()) != 2 || m.GetAutopilot() == nil {
			t.Fatalf("snapshot %d: %v, want n1's with 2 members and autopilot", i, m)
		}
	}

	bad, err := client.WatchStatus(ctx, &clusterv1.WatchStatusRequest{Interval: durationpb.New(2 * time.Minute)})
	if err == nil {
		_, err = bad.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("interval 2m over gRPC: %v, want InvalidArgument", err)
	}
}

// A stopping agent ends its streams with Unavailable after the snapshot
// in flight, rather than holding its shutdown up.
func TestWatchStatusEndsWhenTheAgentStops(t *testing.T) {
	h := newWatchService(t, newWatchCluster())
	stopping := make(chan struct{})
	h.cfg.Stopping = stopping
	sent := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- h.watchStatus(context.Background(), &clusterv1.WatchStatusRequest{Interval: durationpb.New(time.Minute)}, http.Header{}, func(*clusterv1.WatchStatusResponse) error {
			sent <- struct{}{}
			return nil
		})
	}()
	select {
	case <-sent:
	case <-time.After(5 * time.Second):
		t.Fatal("no first snapshot within 5s")
	}
	close(stopping)
	select {
	case err := <-done:
		if connect.CodeOf(err) != connect.CodeUnavailable {
			t.Fatalf("stream of a stopping agent ended with %v, want Unavailable", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stream went on after the agent began to stop")
	}
}
