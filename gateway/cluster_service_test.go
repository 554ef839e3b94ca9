package gateway

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/store"
)

// Tests of ClusterService flows against fakes of its dependencies.

// followerView is a node that follows "leader-id", reachable at
// "leader:9000"; its peers answer ReadIndex with readIndex/readErr and
// forwarded reads with forwarded.
type followerView struct {
	readIndex uint64
	readErr   error
	asked     atomic.Int32 // ReadIndex calls
	forwarded atomic.Int32 // forwarded GetService calls
}

// followerRaft is the Raft state of a follower of "leader-id".
type followerRaft struct{}

func (followerRaft) Apply(context.Context, []byte) (any, uint64, error) {
	return nil, 0, errors.New("not the leader")
}
func (followerRaft) Leader() (string, string) { return "leader-id", "leader:8300" }
func (followerRaft) ReadIndex(context.Context) (uint64, error) {
	return 0, errors.New("not the leader")
}
func (followerRaft) RaftStatus() RaftStatus {
	return RaftStatus{State: "Follower", LeaderID: "leader-id", LastContact: time.Now()}
}
func (v *followerView) Members() []cluster.Member { return nil }
func (v *followerView) MemberByID(id string) (cluster.Member, bool) {
	return cluster.Member{Name: "leader", Meta: cluster.NodeMeta{ID: id, InternalAddr: "leader:9000"}}, id == "leader-id"
}
func (v *followerView) ServerByID(id, _ string) (cluster.Member, bool) { return v.MemberByID(id) }
func (v *followerView) Join([]string) (int, error)                     { return 0, nil }
func (v *followerView) Status(context.Context, string) (*nodev1.StatusResponse, error) {
	return &nodev1.StatusResponse{}, nil
}
func (v *followerView) Cluster(string) clusterv1connect.ClusterServiceClient {
	return forwardedTo{v: v}
}
func (v *followerView) ReadIndex(_ context.Context, addr string) (uint64, error) {
	v.asked.Add(1)
	return v.readIndex, v.readErr
}

// forwardedTo answers forwarded reads as the leader. The handler
// interface has the client's method set; the rest answers Unimplemented.
type forwardedTo struct {
	clusterv1connect.UnimplementedClusterServiceHandler
	v *followerView
}

func (f forwardedTo) GetService(context.Context, *connect.Request[clusterv1.GetServiceRequest]) (*connect.Response[clusterv1.GetServiceResponse], error) {
	f.v.forwarded.Add(1)
	resp := connect.NewResponse(&clusterv1.GetServiceResponse{Instances: []*clusterv1.ServiceInstance{{Service: "web", InstanceId: "from-leader"}}})
	resp.Header().Set(HeaderServedBy, "leader")
	return resp, nil
}

// WatchStatus is a stream: the client's form of it, which the embedded
// handler does not have.
func (forwardedTo) WatchStatus(context.Context, *connect.Request[clusterv1.WatchStatusRequest]) (*connect.ServerStreamForClient[clusterv1.WatchStatusResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("not forwarded"))
}

// newTestService builds the ClusterService of node id over a fresh FSM,
// with v as its membership and peers.
func newTestService(t *testing.T, id string, raft Consensus, admin RaftAdmin, v *followerView) (*ClusterService, *fsm.FSM) {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultClusterServiceConfig()
	cfg.NodeID, cfg.NodeName = id, id
	cfg.HoldTimeout = time.Second
	h, err := NewClusterService(cfg, raft, admin, v, v, f)
	if err != nil {
		t.Fatal(err)
	}
	return h, f
}

func newFollowerService(t *testing.T, v *followerView) (*ClusterService, *fsm.FSM) {
	return newTestService(t, "follower-id", followerRaft{}, nil, v)
}

func consistentGet(ctx context.Context, h *ClusterService) (*connect.Response[clusterv1.GetServiceResponse], error) {
	return h.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{
		Service: "web", Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}))
}

// A follower serves a consistent read itself only once its state has
// applied the leader's read index; until then it waits (here: until the
// call's deadline, as the index is never reached).
func TestFollowerConsistentReadWaitsForTheReadIndex(t *testing.T) {
	v := &followerView{readIndex: 1_000}
	h, f := newFollowerService(t, v)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := consistentGet(ctx, h)
	if connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Fatalf("read index %d above the applied %d: got %v, want DeadlineExceeded", v.readIndex, f.AppliedIndex(), err)
	}
	if v.asked.Load() == 0 || v.forwarded.Load() != 0 {
		t.Fatalf("ReadIndex asked %d times, %d reads forwarded; want ReadIndex and no forwarding", v.asked.Load(), v.forwarded.Load())
	}
}

// A leader on an older binary has no ReadIndex: the follower forwards the
// read instead of failing it.
func TestFollowerConsistentReadFallsBackToForwarding(t *testing.T) {
	v := &followerView{readErr: connect.NewError(connect.CodeUnimplemented, errors.New("unknown method ReadIndex"))}
	h, _ := newFollowerService(t, v)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := consistentGet(ctx, h)
	if err != nil {
		t.Fatalf("consistent read with a leader that lacks ReadIndex: %v", err)
	}
	if got := resp.Header().Get(HeaderServedBy); got != "leader" || v.forwarded.Load() != 1 {
		t.Fatalf("served by %q after %d forwards, want the leader after 1", got, v.forwarded.Load())
	}
}

// leaderAdmin is a leader ("self") whose first RemoveServer removes the
// server but reports leadership lost, as when the leader steps down right
// after the change committed.
type leaderAdmin struct {
	followerRaft
	servers   []cluster.RaftServer
	removes   int
	leader    string // "" is "self"
	transfers int
}

func (l *leaderAdmin) Leader() (string, string) {
	if l.leader == "" {
		return "self", "self:8300"
	}
	return l.leader, l.leader + ":8300"
}
func (l *leaderAdmin) Servers(context.Context) ([]cluster.RaftServer, error) {
	return l.servers, nil
}
func (l *leaderAdmin) RemoveServer(_ context.Context, id string) error {
	l.removes++
	l.servers = slices.DeleteFunc(l.servers, func(s cluster.RaftServer) bool { return s.ID == id })
	if l.removes == 1 {
		return store.ErrLeadershipLost
	}
	return nil
}

// TransferLeadership hands leadership to "leader-id" and, the first time,
// reports leadership lost as if the answer had been cut short.
func (l *leaderAdmin) TransferLeadership(context.Context, string) (string, error) {
	l.transfers++
	l.leader = "leader-id"
	if l.transfers == 1 {
		return "", store.ErrLeadershipLost
	}
	return l.leader, nil
}

func TestRemovePeerRetriedAfterItTookEffectSucceeds(t *testing.T) {
	l := &leaderAdmin{servers: []cluster.RaftServer{{ID: "self", Voter: true}, {ID: "gone", Voter: true}}}
	h, _ := newTestService(t, "self", l, l, &followerView{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := h.RemovePeer(ctx, connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: "gone"})); err != nil {
		t.Fatalf("a removal retried after it took effect: %v, want success", err)
	}
	if l.removes != 1 {
		t.Fatalf("RemoveServer called %d times, want 1", l.removes)
	}
	// A node that never was a peer is still NotFound.
	_, err := h.RemovePeer(ctx, connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: "stranger"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("removing a stranger: %v, want NotFound", err)
	}
}

func TestTransferLeaderRetriedAfterItTookEffectDoesNotTransferAgain(t *testing.T) {
	l := &leaderAdmin{}
	h, _ := newTestService(t, "self", l, l, &followerView{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := h.TransferLeader(ctx, connect.NewRequest(&clusterv1.TransferLeaderRequest{}))
	if err != nil {
		t.Fatalf("a transfer retried after it took effect: %v, want success", err)
	}
	if resp.Msg.GetNodeId() != "leader-id" || l.transfers != 1 {
		t.Fatalf("new leader %q after %d transfers, want leader-id after 1", resp.Msg.GetNodeId(), l.transfers)
	}
}

// TestNotFoundNamesOnce: a read of a missing service, instance or config
// key is NotFound, and its message names what is missing once.
func TestNotFoundNamesOnce(t *testing.T) {
	h, _ := newFollowerService(t, &followerView{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stale := &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_STALE}
	for _, tc := range []struct {
		call func() error
		name string
		want string
	}{
		{func() error {
			_, err := h.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: "web", InstanceId: "web-1", Read: stale}))
			return err
		}, "web-1", `not found: service "web" instance "web-1"`},
		{func() error {
			_, err := h.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: "web", Read: stale}))
			return err
		}, "web", `not found: service "web"`},
		{func() error {
			_, err := h.GetConfig(ctx, connect.NewRequest(&clusterv1.GetConfigRequest{Key: "kv/x", Read: stale}))
			return err
		}, "kv/x", `not found: config "kv/x"`},
		{func() error {
			_, err := h.ConfigHistory(ctx, connect.NewRequest(&clusterv1.ConfigHistoryRequest{Key: "kv/x", Read: stale}))
			return err
		}, "kv/x", `not found: config "kv/x"`},
	} {
		err := tc.call()
		var ce *connect.Error
		if connect.CodeOf(err) != connect.CodeNotFound || !errors.As(err, &ce) || ce.Message() != tc.want || strings.Count(ce.Message(), tc.name) != 1 {
			t.Errorf("%v, want NotFound %q", err, tc.want)
		}
	}
}
