// Package gateway is the agent's Connect edge: the handlers of the agent's
// own services (forward-or-handle); the proxy for the backend services is
// gateway/mesh and access control gateway/access. Errors become Connect
// codes here and nowhere else.
package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authz"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// RaftStatus is the part of the Raft state the handlers report.
type RaftStatus struct {
	State        string // "Leader", "Follower", "Candidate", "Shutdown"
	Term         uint64
	LastIndex    uint64
	CommitIndex  uint64
	AppliedIndex uint64
	// LastContact is when a follower last heard from the leader.
	LastContact time.Time
	LeaderID    string
	// NoLeaderSince is, while no leader is known, since when (zero when
	// unknown).
	NoLeaderSince time.Time
}

// Consensus is the replicated log as the handlers use it.
type Consensus interface {
	Apply(ctx context.Context, cmd []byte) (resp any, index uint64, err error)
	Leader() (id, addr string)
	// ReadIndex is the index a linearizable read waits for before reading
	// local state (store.Store.ReadIndex). Leader only.
	ReadIndex(ctx context.Context) (uint64, error)
	RaftStatus() RaftStatus
}

// RaftAdmin changes the Raft configuration. Leader only.
type RaftAdmin interface {
	Servers(ctx context.Context) ([]cluster.RaftServer, error)
	RemoveServer(ctx context.Context, id string) error
	TransferLeadership(ctx context.Context, id string) (string, error)
}

// Membership is the gossip ring.
type Membership interface {
	Members() []cluster.Member
	MemberByID(id string) (cluster.Member, bool)
	// ServerByID is MemberByID for a server at the Raft configuration's
	// address raftAddr: the member gossiping that address wins.
	ServerByID(id, raftAddr string) (cluster.Member, bool)
	Join(addrs []string) (int, error)
}

// Peers reaches other agents' internal ports.
type Peers interface {
	Status(ctx context.Context, internalAddr string) (*nodev1.StatusResponse, error)
	Cluster(internalAddr string) clusterv1connect.ClusterServiceClient
	// ReadIndex asks the leader at internalAddr for a read index
	// (LeaderReadIndex there). Errors are Connect errors.
	ReadIndex(ctx context.Context, internalAddr string) (uint64, error)
}

// StateReader reads the local replicated state.
type StateReader interface {
	State() *fsm.State
	// AppliedIndex is the index of the last entry applied to the state.
	AppliedIndex() uint64
	// WaitApplied returns once the state has applied index.
	WaitApplied(ctx context.Context, index uint64) error
}

// ClusterServiceConfig configures a ClusterService.
type ClusterServiceConfig struct {
	NodeID   string
	NodeName string
	// HoldTimeout is how long a request waits for a leader.
	HoldTimeout time.Duration
	// Direct marks an agent whose state lives in an external store (etcd
	// mode): it serves every request itself, writes included, and never
	// forwards; Consensus.Leader names the schedule leader, for display.
	Direct bool
	// LeaderOnly marks the instance served on the internal port: it answers
	// only when this node is the leader and never forwards.
	LeaderOnly bool
	// LeaderReady reports whether this leader has applied everything
	// committed before its term (its barrier completed).
	LeaderReady func() bool
	// NotReady, when set, is the error of a request LeaderReady refuses
	// (an etcd-mode agent names etcd's state); else ErrLeaderNotReady.
	// It must be retryable (Unavailable).
	NotReady func() error
	// Leave starts a graceful leave and shutdown of this agent.
	Leave func()
	// Stopping is closed when the agent begins to shut down; requests
	// waiting for a leader then fail at once instead of holding the
	// shutdown up.
	Stopping <-chan struct{}
	// ValidateConfig checks a change of the cluster config before it is
	// proposed: on the node the caller asked (ctx then carries the caller's
	// authz.Principal, for the checks of the caller's own rights) and again
	// on the leader. Nil accepts any change.
	ValidateConfig func(ctx context.Context, c ConfigChange) error
	// Keyring runs one gossip keyring operation on the member with the
	// given internal address (NodeService.Keyring). Nil: Keyring answers
	// Unimplemented.
	Keyring func(ctx context.Context, internalAddr string, op clusterv1.KeyringOp, key string) (*clusterv1.NodeKeyring, error)
	// ForceLeave marks the failed member name as left on the member with
	// the given internal address (NodeService.ForceLeave). Nil: ForceLeave
	// answers Unimplemented.
	ForceLeave func(ctx context.Context, internalAddr, name string, prune bool) (pending bool, err error)
	// Retire, when set, is called after a force-leave: it drops what the
	// replicated state keeps of the node (its placement catalog entries).
	Retire func(ctx context.Context, name string) error
	// Autopilot is the leader's reconciler report; false when this node
	// runs none (not the leader, or etcd mode). Nil: AutopilotState answers
	// Unimplemented.
	Autopilot func() (cluster.ReconcileReport, bool)
	// ConfigStatus asks the member with the given internal address for its
	// state of the cluster settings (NodeService.ConfigStatus). Nil:
	// ConfigStatus answers Unimplemented.
	ConfigStatus func(ctx context.Context, internalAddr string) (*clusterv1.NodeConfigStatus, error)
	// CheckAccess and CheckNetworkPolicy answer the checks of the same
	// name with the policies in force on this node. Nil: Unimplemented.
	CheckAccess        func(ctx context.Context, req *clusterv1.CheckAccessRequest) (*clusterv1.CheckAccessResponse, error)
	CheckNetworkPolicy func(ctx context.Context, req *clusterv1.CheckNetworkPolicyRequest) (*clusterv1.CheckNetworkPolicyResponse, error)
	// Explain is the guard's answer for a principal calling a method,
	// nothing called (access.Guard.Explain: the decision code of the guard
	// and of CheckAccess); WhoAmI asks it for each method. Nil: WhoAmI
	// answers Unimplemented.
	Explain func(who authz.Principal, procedure, objectJSON string) (access.Explanation, error)
	// PolicySource names where the RBAC policy in force on this node comes
	// from: "cluster", "file" or "none" (nil: "none").
	PolicySource func() string
	// APIServices are the services of the API port: WhoAmI answers for
	// every method of them when no method is named, and resolves short
	// service names ("VMService/PowerOn") against them.
	APIServices []protoreflect.ServiceDescriptor
	Logger      *slog.Logger
	// MinCheckInterval and MinDeregisterCriticalAfter lower the bounds of
	// a registration's check interval and deregister_critical_after
	// (tests); zero: MinCheckInterval and MinDeregisterCriticalAfter.
	MinCheckInterval           time.Duration
	MinDeregisterCriticalAfter time.Duration
	// Require is nil when the cluster version allows a feature (an fsm
	// feature name), else the FailedPrecondition that says what to
	// upgrade; what names what the caller asked for. Nil: everything is
	// allowed.
	Require func(feature, what string) error
	// ClusterVersion, VerifyReplicas and Downgrade answer the methods of
	// the same names on the leader (cmd/internal/agent, which sees the
	// servers, their releases and states). Nil: Unimplemented.
	ClusterVersion func(ctx context.Context) (*clusterv1.ClusterVersionResponse, error)
	VerifyReplicas func(ctx context.Context) (*clusterv1.VerifyReplicasResponse, error)
	Downgrade      func(ctx context.Context, req *clusterv1.DowngradeRequest) (*clusterv1.DowngradeResponse, error)
}

// require is cfg.Require, or nil without one.
func (h *ClusterService) require(feature, what string) error {
	if h.cfg.Require == nil {
		return nil
	}
	return h.cfg.Require(feature, what)
}

// DefaultClusterServiceConfig returns the defaults.
func DefaultClusterServiceConfig() ClusterServiceConfig {
	return ClusterServiceConfig{HoldTimeout: 7 * time.Second}
}

// Validate checks the configuration.
func (c ClusterServiceConfig) Validate() error {
	var errs []error
	if c.NodeID == "" {
		errs = append(errs, errors.New("cluster service: node id is required"))
	}
	if c.HoldTimeout <= 0 {
		errs = append(errs, errors.New("cluster service: hold timeout must be positive"))
	}
	return errors.Join(errs...)
}

// ClusterService implements pivirt.cluster.v1.ClusterService.
type ClusterService struct {
	cfg     ClusterServiceConfig
	raft    Consensus
	admin   RaftAdmin
	members Membership
	peers   Peers
	state   StateReader
	logger  *slog.Logger

	clientID string
	seq      atomic.Uint64

	readIndex *readIndexBatcher

	// status is the last WatchStatus snapshot, shared by every stream
	// (watch_status.go, sharedSnapshot).
	status statusCache
}

var _ clusterv1connect.ClusterServiceHandler = (*ClusterService)(nil)

// NewClusterService returns the handler.
func NewClusterService(cfg ClusterServiceConfig, raft Consensus, admin RaftAdmin, members Membership, peers Peers, state StateReader) (*ClusterService, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("generate client id: %w", err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.LeaderReady == nil {
		cfg.LeaderReady = func() bool { return true }
	}
	return &ClusterService{
		cfg:       cfg,
		raft:      raft,
		admin:     admin,
		members:   members,
		peers:     peers,
		state:     state,
		logger:    logger.With("component", "cluster-api"),
		clientID:  "node:" + cfg.NodeID + ":" + hex.EncodeToString(b[:]),
		readIndex: newReadIndexBatcher(func(ctx context.Context, addr string) (uint64, error) { return peers.ReadIndex(ctx, addr) }),
	}, nil
}

func (h *ClusterService) leaderReady() bool { return h.cfg.LeaderReady() }

// notReady is the error of a request refused because leaderReady is false.
func (h *ClusterService) notReady() error {
	if h.cfg.NotReady != nil {
		if err := h.cfg.NotReady(); err != nil {
			return err
		}
	}
	return ErrLeaderNotReady
}

// fillWrite gives a write a client ID and sequence when the client sent
// none, so that forwarding retries are deduplicated by the FSM.
func (h *ClusterService) fillWrite(w **clusterv1.WriteOptions) error {
	if *w == nil || (*w).GetClientId() == "" {
		if *w != nil && (*w).GetSequence() != 0 {
			return invalid("write.client_id", "is required when write.sequence is set")
		}
		*w = &clusterv1.WriteOptions{ClientId: h.clientID, Sequence: h.seq.Add(1)}
		return nil
	}
	if len((*w).GetClientId()) > 128 {
		return invalid("write.client_id", "longer than 128 characters")
	}
	if (*w).GetSequence() == 0 {
		return invalid("write.sequence", "must be positive when write.client_id is set")
	}
	return nil
}

// propose stamps, encodes and applies a command on the leader.
func (h *ClusterService) propose(ctx context.Context, w *clusterv1.WriteOptions, cmd *fsmv1.Command) (*fsm.Result, error) {
	cmd.ClientId = w.GetClientId()
	cmd.Sequence = w.GetSequence()
	cmd.Time = timestamppb.Now()
	data, err := fsm.Encode(cmd)
	if err != nil {
		return nil, fmt.Errorf("encode command: %w", err)
	}
	resp, _, err := h.raft.Apply(ctx, data)
	if err != nil {
		return nil, err
	}
	res, ok := resp.(*fsm.Result)
	if !ok {
		return nil, fmt.Errorf("unexpected apply response %T", resp)
	}
	if res.Err != nil {
		return res, res.Err
	}
	return res, nil
}

// written is the record the answer to a write carries: the one the write
// wrote (fsm.Result.Value), also for a repeat of it, whose dedupe record
// keeps it, so that a retry through any agent gets the write's own outcome
// and never the state as another writer left it since. A repeat of a write
// that an older agent recorded keeps none: then the current record if it
// is still the write's own (its index is the write's), else none (the
// answer carries the write's index alone).
func written[T proto.Message](res *fsm.Result, current func() (T, error), index func(T) uint64) T {
	if v, ok := res.Value.(T); ok {
		return v
	}
	var none T
	cur, err := current()
	if err != nil || index(cur) != res.Index {
		return none
	}
	return cur
}

// --- membership and raft ---

// Members implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) Members(ctx context.Context, req *connect.Request[clusterv1.MembersRequest]) (*connect.Response[clusterv1.MembersResponse], error) {
	out := &clusterv1.MembersResponse{}
	for _, m := range h.members.Members() {
		out.Members = append(out.Members, memberProto(m))
	}
	resp := connect.NewResponse(out)
	// The member answering: pvcli version reports its version.
	resp.Header().Set(HeaderServedBy, h.cfg.NodeName)
	return resp, nil
}

func memberProto(m cluster.Member) *clusterv1.Member {
	st := clusterv1.MemberStatus_MEMBER_STATUS_UNSPECIFIED
	switch m.Status {
	case cluster.StatusAlive:
		st = clusterv1.MemberStatus_MEMBER_STATUS_ALIVE
	case cluster.StatusSuspect:
		st = clusterv1.MemberStatus_MEMBER_STATUS_SUSPECT
	case cluster.StatusFailed:
		st = clusterv1.MemberStatus_MEMBER_STATUS_FAILED
	case cluster.StatusLeft:
		st = clusterv1.MemberStatus_MEMBER_STATUS_LEFT
	}
	return &clusterv1.Member{
		Name:            m.Name,
		NodeId:          m.Meta.ID,
		GossipAddr:      m.Addr,
		Status:          st,
		Role:            m.Meta.Role,
		RaftAddr:        m.Meta.RaftAddr,
		ApiAddr:         m.Meta.APIAddr,
		InternalAddr:    m.Meta.InternalAddr,
		Version:         m.Meta.Version,
		BootstrapExpect: int32(m.Meta.BootstrapExpect),
		Protocol:        int32(m.Meta.Protocol),
	}
}

// Peers implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) Peers(ctx context.Context, req *connect.Request[clusterv1.PeersRequest]) (*connect.Response[clusterv1.PeersResponse], error) {
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.Peers, nil,
		func(ctx context.Context) (*clusterv1.PeersResponse, uint64, error) {
			peers, applied, err := h.peerList(ctx)
			if err != nil {
				return nil, 0, err
			}
			return &clusterv1.PeersResponse{Peers: peers, Meta: h.queryMeta(applied)}, applied, nil
		})
}

// peerList is the Raft configuration with each server's state as it
// reports it (unreachable when it does not answer), and this node's
// applied index.
func (h *ClusterService) peerList(ctx context.Context) ([]*clusterv1.Peer, uint64, error) {
	servers, err := h.admin.Servers(ctx)
	if err != nil {
		return nil, 0, err
	}
	self := h.raft.RaftStatus()
	peers := make([]*clusterv1.Peer, len(servers))
	var wg sync.WaitGroup
	for i, s := range servers {
		p := &clusterv1.Peer{NodeId: s.ID, Address: s.Address, Voter: s.Voter, State: clusterv1.RaftState_RAFT_STATE_UNREACHABLE}
		peers[i] = p
		if s.ID == h.cfg.NodeID {
			p.Name = h.cfg.NodeName
			fillPeer(p, &nodev1.StatusResponse{
				RaftState: self.State, Term: self.Term, LastIndex: self.LastIndex,
				CommitIndex: self.CommitIndex, AppliedIndex: self.AppliedIndex,
				LastContact: contactProto(self),
			})
			continue
		}
		m, ok := h.members.ServerByID(s.ID, s.Address)
		if !ok {
			continue
		}
		p.Name = m.Name
		if m.Status != cluster.StatusAlive && m.Status != cluster.StatusSuspect {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := h.peers.Status(ctx, m.Meta.InternalAddr)
			if err == nil {
				fillPeer(p, st)
			}
		}()
	}
	wg.Wait()
	var leaderLast uint64
	for _, p := range peers {
		if p.State == clusterv1.RaftState_RAFT_STATE_LEADER {
			leaderLast = p.LastIndex
		}
	}
	for _, p := range peers {
		if p.State != clusterv1.RaftState_RAFT_STATE_UNREACHABLE && leaderLast > p.LastIndex {
			p.Trailing = leaderLast - p.LastIndex
		}
	}
	return peers, self.AppliedIndex, nil
}

func contactProto(st RaftStatus) *durationpb.Duration {
	if st.State == "Leader" || st.LastContact.IsZero() {
		return durationpb.New(0)
	}
	return durationpb.New(time.Since(st.LastContact))
}

func fillPeer(p *clusterv1.Peer, st *nodev1.StatusResponse) {
	switch st.GetRaftState() {
	case "Leader":
		p.State = clusterv1.RaftState_RAFT_STATE_LEADER
	case "Follower":
		p.State = clusterv1.RaftState_RAFT_STATE_FOLLOWER
	case "Candidate":
		p.State = clusterv1.RaftState_RAFT_STATE_CANDIDATE
	case "Shutdown":
		p.State = clusterv1.RaftState_RAFT_STATE_SHUTDOWN
	}
	p.Term = st.GetTerm()
	p.LastIndex = st.GetLastIndex()
	p.CommitIndex = st.GetCommitIndex()
	p.AppliedIndex = st.GetAppliedIndex()
	p.LastContact = st.GetLastContact()
}

// Leader implements clusterv1connect.ClusterServiceHandler. In default and
// stale mode it reports this node's view; in consistent mode the leader
// confirms its leadership first.
func (h *ClusterService) Leader(ctx context.Context, req *connect.Request[clusterv1.LeaderRequest]) (*connect.Response[clusterv1.LeaderResponse], error) {
	local := func(ctx context.Context) (*clusterv1.LeaderResponse, uint64, error) {
		id, addr := h.raft.Leader()
		st := h.raft.RaftStatus()
		if id == "" {
			return nil, 0, ErrNoLeader
		}
		out := &clusterv1.LeaderResponse{NodeId: id, RaftAddr: addr, Term: st.Term}
		if m, ok := h.members.ServerByID(id, addr); ok {
			out.Name = m.Name
			out.ApiAddr = m.Meta.APIAddr
		}
		out.Meta = h.queryMeta(st.AppliedIndex)
		return out, st.AppliedIndex, nil
	}
	mode, _, err := readMode(req.Msg.GetRead())
	if err != nil {
		return nil, toConnect(err)
	}
	if mode != clusterv1.Consistency_CONSISTENCY_CONSISTENT && !h.cfg.LeaderOnly {
		msg, index, err := local(ctx)
		if err != nil {
			return nil, toConnect(err)
		}
		resp := connect.NewResponse(msg)
		h.setQueryHeaders(resp.Header(), index)
		return resp, nil
	}
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.Leader, nil, local)
}

// maxJoinAddrs bounds one Join request (memberlist dials them in turn).
const maxJoinAddrs = 16

// Join implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) Join(ctx context.Context, req *connect.Request[clusterv1.JoinRequest]) (*connect.Response[clusterv1.JoinResponse], error) {
	addrs := req.Msg.GetAddresses()
	if len(addrs) == 0 || len(addrs) > maxJoinAddrs {
		return nil, toConnect(invalid("addresses", "between 1 and %d gossip addresses (host:port) are required, got %d", maxJoinAddrs, len(addrs)))
	}
	for i, a := range addrs {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return nil, toConnect(invalid(fmt.Sprintf("addresses[%d]", i), "%q is not host:port: %v", a, err))
		}
	}
	n, err := h.members.Join(addrs)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return connect.NewResponse(&clusterv1.JoinResponse{Joined: int32(n)}), nil
}

// Leave implements clusterv1connect.ClusterServiceHandler. The agent leaves
// after the response is sent.
func (h *ClusterService) Leave(ctx context.Context, req *connect.Request[clusterv1.LeaveRequest]) (*connect.Response[clusterv1.LeaveResponse], error) {
	if h.cfg.Leave == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("leave is not available on this port"))
	}
	h.logger.InfoContext(ctx, "leave requested through the API")
	go h.cfg.Leave()
	return connect.NewResponse(&clusterv1.LeaveResponse{}), nil
}

// RemovePeer implements clusterv1connect.ClusterServiceHandler. A node
// that is not a peer is NotFound, unless an earlier attempt of this same
// call may have removed it (it failed in a way that is retried: leadership
// lost, the leader unreachable after the request went out): the retry then
// reports the removal done.
func (h *ClusterService) RemovePeer(ctx context.Context, req *connect.Request[clusterv1.RemovePeerRequest]) (*connect.Response[clusterv1.RemovePeerResponse], error) {
	id := req.Msg.GetNodeId()
	if id == "" {
		return nil, toConnect(invalid("node_id", "is required"))
	}
	var tried bool
	remote := func(c clusterv1connect.ClusterServiceClient, ctx context.Context, r *connect.Request[clusterv1.RemovePeerRequest]) (*connect.Response[clusterv1.RemovePeerResponse], error) {
		resp, err := c.RemovePeer(ctx, r)
		if err != nil && retryable(err) {
			tried = true
		}
		return resp, err
	}
	resp, err := onLeader(ctx, h, req, remote, func(ctx context.Context) (*connect.Response[clusterv1.RemovePeerResponse], error) {
		servers, err := h.admin.Servers(ctx)
		if err != nil {
			return nil, err
		}
		found := false
		for _, s := range servers {
			found = found || s.ID == id
		}
		if !found {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("node_id %q is not a raft peer", id))
		}
		tried = true
		if err := h.admin.RemoveServer(ctx, id); err != nil {
			return nil, err
		}
		h.logger.InfoContext(ctx, "removed raft peer through the API", "node_id", id)
		return connect.NewResponse(&clusterv1.RemovePeerResponse{Index: h.raft.RaftStatus().LastIndex}), nil
	})
	if connect.CodeOf(err) == connect.CodeNotFound && tried {
		h.logger.InfoContext(ctx, "raft peer gone after a retried removal", "node_id", id)
		return connect.NewResponse(&clusterv1.RemovePeerResponse{Index: h.raft.RaftStatus().LastIndex}), nil
	}
	return resp, err
}

// TransferLeader implements clusterv1connect.ClusterServiceHandler. When an
// attempt to hand leadership to any server fails in a way that is retried
// (leadership lost, the leader unreachable after the request went out), the
// transfer may have happened: if the leader has changed since, the retry
// reports that leader instead of transferring once more.
func (h *ClusterService) TransferLeader(ctx context.Context, req *connect.Request[clusterv1.TransferLeaderRequest]) (*connect.Response[clusterv1.TransferLeaderResponse], error) {
	id := req.Msg.GetNodeId()
	var from string // the leader of a retried attempt, "" before one
	moved := func() (string, bool) {
		cur, _ := h.raft.Leader()
		return cur, id == "" && from != "" && cur != "" && cur != from
	}
	remote := func(c clusterv1connect.ClusterServiceClient, ctx context.Context, r *connect.Request[clusterv1.TransferLeaderRequest]) (*connect.Response[clusterv1.TransferLeaderResponse], error) {
		if cur, ok := moved(); ok {
			return connect.NewResponse(&clusterv1.TransferLeaderResponse{NodeId: cur}), nil
		}
		leader, _ := h.raft.Leader()
		resp, err := c.TransferLeader(ctx, r)
		if err != nil && retryable(err) {
			from = leader
		}
		return resp, err
	}
	// Even in Direct mode only the leader (of the schedules) can hand over.
	return onElected(ctx, h, req, remote, func(ctx context.Context) (*connect.Response[clusterv1.TransferLeaderResponse], error) {
		if id == h.cfg.NodeID {
			return connect.NewResponse(&clusterv1.TransferLeaderResponse{NodeId: id}), nil
		}
		if id != "" {
			servers, err := h.admin.Servers(ctx)
			if err != nil {
				return nil, err
			}
			ok := false
			for _, s := range servers {
				ok = ok || (s.ID == id && s.Voter)
			}
			if !ok {
				return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("node_id %q is not a voter", id))
			}
		}
		newID, err := h.admin.TransferLeadership(ctx, id)
		if err != nil {
			if retryable(err) {
				from = h.cfg.NodeID
			}
			return nil, err
		}
		return connect.NewResponse(&clusterv1.TransferLeaderResponse{NodeId: newID}), nil
	})
}

// --- services ---

var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

func checkName(field, v string) error {
	if v == "" {
		return invalid(field, "is required")
	}
	if !namePattern.MatchString(v) {
		return invalid(field, "%q must be 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit", v)
	}
	return nil
}

func (h *ClusterService) validateInstance(in *clusterv1.ServiceInstance) error {
	if in == nil {
		return invalid("instance", "is required")
	}
	if err := checkName("instance.service", in.GetService()); err != nil {
		return err
	}
	if in.GetNode() == "" {
		in.Node = h.cfg.NodeName
	}
	if in.GetInstanceId() == "" {
		// One instance of a service per node by default, as Consul's
		// service name is its default ID on an agent: registering again
		// replaces it. A retry through another node is answered as the
		// write it repeats, whatever this node would have chosen.
		in.InstanceId = in.GetService() + "-" + in.GetNode()
	}
	if err := checkName("instance.instance_id", in.GetInstanceId()); err != nil {
		return err
	}
	if in.GetAddress() == "" {
		return invalid("instance.address", "is required")
	}
	if len(in.GetAddress()) > 255 || !printable(in.GetAddress()) || strings.ContainsAny(in.GetAddress(), " \t") {
		return invalid("instance.address", "%q must be a host name or IP address of at most 255 printable characters", in.GetAddress())
	}
	if in.GetPort() == 0 || in.GetPort() > 65535 {
		return invalid("instance.port", "%d is out of range 1-65535", in.GetPort())
	}
	if in.GetTtl() != nil {
		if err := in.GetTtl().CheckValid(); err != nil {
			return invalid("instance.ttl", "%v", err)
		}
		if d := in.GetTtl().AsDuration(); d != 0 && (d < time.Second || d > 24*time.Hour) {
			return invalid("instance.ttl", "%s is out of range 1s-24h", d)
		}
	}
	if len(in.GetTags()) > 64 {
		return invalid("instance.tags", "at most 64 tags")
	}
	for i, tag := range in.GetTags() {
		if tag == "" || len(tag) > 128 || !printable(tag) {
			return invalid(fmt.Sprintf("instance.tags[%d]", i), "%q must be 1-128 printable characters", tag)
		}
	}
	if len(in.GetMeta()) > 64 {
		return invalid("instance.meta", "at most 64 entries")
	}
	for k, v := range in.GetMeta() {
		if k == "" || len(k) > 128 || len(v) > 512 || !printable(k) || !printable(v) {
			return invalid("instance.meta", "key %q: keys are 1-128 and values at most 512 printable characters", k)
		}
	}
	if err := h.validateCheck(in); err != nil {
		return err
	}
	// Server-owned fields.
	in.Health = clusterv1.Health_HEALTH_UNSPECIFIED
	in.Output, in.HealthSince = "", nil
	in.RegisteredAt, in.LastHeartbeat = nil, nil
	in.CreateIndex, in.ModifyIndex = 0, 0
	return nil
}

// printable reports whether s is valid UTF-8 without control characters.
func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

// RegisterService implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) RegisterService(ctx context.Context, req *connect.Request[clusterv1.RegisterServiceRequest]) (*connect.Response[clusterv1.RegisterServiceResponse], error) {
	if err := h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	if err := h.validateInstance(req.Msg.GetInstance()); err != nil {
		return nil, toConnect(err)
	}
	return write(ctx, h, req, req.Msg.GetWrite(), clusterv1connect.ClusterServiceClient.RegisterService, func(ctx context.Context) (*connect.Response[clusterv1.RegisterServiceResponse], error) {
		if in := req.Msg.GetInstance(); in.GetCheck() != nil || in.GetDeregisterCriticalAfter() != nil {
			if err := h.require(fsm.FeatureHealthChecks, "a registration with a check or deregister_critical_after"); err != nil {
				return nil, err
			}
		}
		res, err := h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_RegisterService{
			RegisterService: &fsmv1.RegisterService{Instance: req.Msg.GetInstance()},
		}})
		if err != nil {
			return nil, err
		}
		inst := written(res, func() (*clusterv1.ServiceInstance, error) {
			return h.state.State().Service(req.Msg.GetInstance().GetService(), req.Msg.GetInstance().GetInstanceId())
		}, (*clusterv1.ServiceInstance).GetModifyIndex)
		return connect.NewResponse(&clusterv1.RegisterServiceResponse{Instance: inst, Index: res.Index}), nil
	})
}

// checkInstanceWrite validates the instance a write names and fills in the
// write's identity.
func (h *ClusterService) checkInstanceWrite(service, instanceID string, w **clusterv1.WriteOptions) error {
	if err := checkName("service", service); err != nil {
		return err
	}
	if err := checkName("instance_id", instanceID); err != nil {
		return err
	}
	return h.fillWrite(w)
}

// DeregisterService implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) DeregisterService(ctx context.Context, req *connect.Request[clusterv1.DeregisterServiceRequest]) (*connect.Response[clusterv1.DeregisterServiceResponse], error) {
	if err := h.checkInstanceWrite(req.Msg.GetService(), req.Msg.GetInstanceId(), &req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	return write(ctx, h, req, req.Msg.GetWrite(), clusterv1connect.ClusterServiceClient.DeregisterService, func(ctx context.Context) (*connect.Response[clusterv1.DeregisterServiceResponse], error) {
		res, err := h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{
			DeregisterService: &fsmv1.DeregisterService{Service: req.Msg.GetService(), InstanceId: req.Msg.GetInstanceId()},
		}})
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&clusterv1.DeregisterServiceResponse{Index: res.Index}), nil
	})
}

// Heartbeat implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) Heartbeat(ctx context.Context, req *connect.Request[clusterv1.HeartbeatRequest]) (*connect.Response[clusterv1.HeartbeatResponse], error) {
	if err := h.checkInstanceWrite(req.Msg.GetService(), req.Msg.GetInstanceId(), &req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	switch req.Msg.GetHealth() {
	case clusterv1.Health_HEALTH_UNSPECIFIED, clusterv1.Health_HEALTH_PASSING, clusterv1.Health_HEALTH_CRITICAL:
	default:
		return nil, toConnect(invalid("health", "%s must be HEALTH_PASSING or HEALTH_CRITICAL (or unset: passing)", req.Msg.GetHealth()))
	}
	if n := len(req.Msg.GetOutput()); n > fsm.MaxOutputSize || !utf8.ValidString(req.Msg.GetOutput()) {
		return nil, toConnect(invalid("output", "must be valid UTF-8 of at most %d bytes (it has %d)", fsm.MaxOutputSize, n))
	}
	return write(ctx, h, req, req.Msg.GetWrite(), clusterv1connect.ClusterServiceClient.Heartbeat, func(ctx context.Context) (*connect.Response[clusterv1.HeartbeatResponse], error) {
		if (req.Msg.GetHealth() != clusterv1.Health_HEALTH_UNSPECIFIED && req.Msg.GetHealth() != clusterv1.Health_HEALTH_PASSING) || req.Msg.GetOutput() != "" {
			if err := h.require(fsm.FeatureHealthChecks, "a heartbeat with a health or an output"); err != nil {
				return nil, err
			}
		}
		res, err := h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{
			Heartbeat: &fsmv1.Heartbeat{Service: req.Msg.GetService(), InstanceId: req.Msg.GetInstanceId(), Health: req.Msg.GetHealth(), Output: req.Msg.GetOutput()},
		}})
		if err != nil {
			return nil, err
		}
		inst := written(res, func() (*clusterv1.ServiceInstance, error) {
			return h.state.State().Service(req.Msg.GetService(), req.Msg.GetInstanceId())
		}, (*clusterv1.ServiceInstance).GetModifyIndex)
		return connect.NewResponse(&clusterv1.HeartbeatResponse{Instance: inst, Index: res.Index}), nil
	})
}

// ListServices implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) ListServices(ctx context.Context, req *connect.Request[clusterv1.ListServicesRequest]) (*connect.Response[clusterv1.ListServicesResponse], error) {
	if s := req.Msg.GetService(); s != "" {
		if err := checkName("service", s); err != nil {
			return nil, toConnect(err)
		}
	}
	// Filtered on one service, a blocking query waits for a change to that
	// service (serviceIndex); the answer's index is the services table's,
	// the same on every node.
	blockOn := tablesIndex(fsm.TableServices)
	if s := req.Msg.GetService(); s != "" {
		blockOn = serviceIndex(s)
	}
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.ListServices, blockOn,
		func(ctx context.Context) (*clusterv1.ListServicesResponse, uint64, error) {
			index, list, err := h.state.State().Services(req.Msg.GetService(), nil)
			if err != nil {
				return nil, 0, err
			}
			return &clusterv1.ListServicesResponse{Instances: list, Meta: h.queryMeta(index)}, index, nil
		})
}

// GetService implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) GetService(ctx context.Context, req *connect.Request[clusterv1.GetServiceRequest]) (*connect.Response[clusterv1.GetServiceResponse], error) {
	if err := checkName("service", req.Msg.GetService()); err != nil {
		return nil, toConnect(err)
	}
	if id := req.Msg.GetInstanceId(); id != "" {
		if err := checkName("instance_id", id); err != nil {
			return nil, toConnect(err)
		}
	}
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.GetService, serviceIndex(req.Msg.GetService()),
		func(ctx context.Context) (*clusterv1.GetServiceResponse, uint64, error) {
			st := h.state.State()
			index := st.Index(fsm.TableServices)
			if id := req.Msg.GetInstanceId(); id != "" {
				inst, err := st.Service(req.Msg.GetService(), id)
				if err != nil {
					return nil, 0, err // names the service and the instance
				}
				return &clusterv1.GetServiceResponse{Instances: []*clusterv1.ServiceInstance{inst}, Meta: h.queryMeta(index)}, index, nil
			}
			_, list, err := st.Services(req.Msg.GetService(), nil)
			if err != nil {
				return nil, 0, err
			}
			if len(list) == 0 {
				return nil, 0, fmt.Errorf("%w: service %q", fsm.ErrNotFound, req.Msg.GetService())
			}
			return &clusterv1.GetServiceResponse{Instances: list, Meta: h.queryMeta(index)}, index, nil
		})
}

// --- config ---

// ConfigChange is a change of the cluster config ValidateConfig checks.
type ConfigChange struct {
	Key, Value string
	// Delete: the key is to be deleted (Value is empty).
	Delete bool
	// Force: the caller accepts losing its own rights (--force).
	Force bool
	// Restore: the value comes from a snapshot archive (written by any
	// version; keys this version does not know are accepted).
	Restore bool
}

// validateChange runs ValidateConfig; its refusal is InvalidArgument.
func (h *ClusterService) validateChange(ctx context.Context, c ConfigChange) error {
	if h.cfg.ValidateConfig == nil {
		return nil
	}
	if err := h.cfg.ValidateConfig(ctx, c); err != nil {
		if ce := new(connect.Error); errors.As(err, &ce) {
			return err
		}
		return invalid("value", "%v", err)
	}
	return nil
}

var configKeyPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$`)

// MaxConfigValueBytes bounds one config document.
const MaxConfigValueBytes = 512 << 10

func checkConfigKey(key string) error {
	if key == "" {
		return invalid("key", "is required")
	}
	if !configKeyPattern.MatchString(key) {
		return invalid("key", "%q must be 1-256 characters of letters, digits, '.', '_', '/' or '-'", key)
	}
	return nil
}

// GetConfig implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) GetConfig(ctx context.Context, req *connect.Request[clusterv1.GetConfigRequest]) (*connect.Response[clusterv1.GetConfigResponse], error) {
	if err := checkConfigKey(req.Msg.GetKey()); err != nil {
		return nil, toConnect(err)
	}
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.GetConfig, configKeyIndex(req.Msg.GetKey()),
		func(ctx context.Context) (*clusterv1.GetConfigResponse, uint64, error) {
			e, err := h.state.State().ConfigEntry(req.Msg.GetKey())
			if err != nil {
				return nil, 0, err // names the key
			}
			return &clusterv1.GetConfigResponse{Entry: e, Meta: h.queryMeta(e.GetRevision())}, e.GetRevision(), nil
		})
}

// configKeyIndex is the blockIndex of a read of one config key: its
// revision, which GetConfig and ConfigHistory answer with.
func configKeyIndex(key string) blockIndex {
	return func(st *fsm.State, ws memdb.WatchSet) (uint64, error) { return st.WatchConfigKey(ws, key) }
}

// ListConfig implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) ListConfig(ctx context.Context, req *connect.Request[clusterv1.ListConfigRequest]) (*connect.Response[clusterv1.ListConfigResponse], error) {
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.ListConfig, tablesIndex(fsm.TableConfig),
		func(ctx context.Context) (*clusterv1.ListConfigResponse, uint64, error) {
			index, list, err := h.state.State().ConfigEntries(nil)
			if err != nil {
				return nil, 0, err
			}
			return &clusterv1.ListConfigResponse{Entries: list, Meta: h.queryMeta(index)}, index, nil
		})
}

// SetConfig implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) SetConfig(ctx context.Context, req *connect.Request[clusterv1.SetConfigRequest]) (*connect.Response[clusterv1.SetConfigResponse], error) {
	if err := checkConfigKey(req.Msg.GetKey()); err != nil {
		return nil, toConnect(err)
	}
	if req.Msg.GetKey() == ClusterIDKey {
		return nil, toConnect(invalid("key", "%s is set by the cluster itself and cannot be changed", ClusterIDKey))
	}
	if req.Msg.GetKey() == DowngradeKey {
		return nil, toConnect(invalid("key", "%s is set by pvcli operator downgrade enable and removed by pvcli operator downgrade cancel", DowngradeKey))
	}
	if len(req.Msg.GetValue()) > MaxConfigValueBytes {
		return nil, toConnect(invalid("value", "%d bytes is over the %d-byte limit", len(req.Msg.GetValue()), MaxConfigValueBytes))
	}
	change := ConfigChange{Key: req.Msg.GetKey(), Value: req.Msg.GetValue(), Force: req.Msg.GetForce()}
	// Checked here first, where the caller is known (its rights after the
	// change), then again on the leader.
	if err := h.validateChange(ctx, change); err != nil {
		return nil, toConnect(err)
	}
	if req.Msg.GetDryRun() {
		// Nothing is stored: the answer is the version stored now, as this
		// node knows it, for the caller to compare with its value.
		e, err := h.state.State().ConfigEntry(req.Msg.GetKey())
		if err != nil && !errors.Is(err, fsm.ErrNotFound) {
			return nil, toConnect(err)
		}
		return connect.NewResponse(&clusterv1.SetConfigResponse{Entry: e, DryRun: true}), nil
	}
	if err := h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	return write(ctx, h, req, req.Msg.GetWrite(), clusterv1connect.ClusterServiceClient.SetConfig, func(ctx context.Context) (*connect.Response[clusterv1.SetConfigResponse], error) {
		if err := h.validateChange(ctx, change); err != nil {
			return nil, err
		}
		res, err := h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_SetConfig{
			SetConfig: &fsmv1.SetConfig{Key: req.Msg.GetKey(), Value: req.Msg.GetValue(), CasRevision: req.Msg.CasRevision},
		}})
		if err != nil {
			return nil, err
		}
		e := written(res, func() (*clusterv1.ConfigEntry, error) {
			return h.state.State().ConfigEntry(req.Msg.GetKey())
		}, (*clusterv1.ConfigEntry).GetRevision)
		return connect.NewResponse(&clusterv1.SetConfigResponse{Entry: e}), nil
	})
}

// DeleteConfig implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) DeleteConfig(ctx context.Context, req *connect.Request[clusterv1.DeleteConfigRequest]) (*connect.Response[clusterv1.DeleteConfigResponse], error) {
	if err := checkConfigKey(req.Msg.GetKey()); err != nil {
		return nil, toConnect(err)
	}
	if req.Msg.GetKey() == ClusterIDKey {
		return nil, toConnect(invalid("key", "%s is set by the cluster itself and cannot be changed", ClusterIDKey))
	}
	if req.Msg.GetKey() == DowngradeKey {
		return nil, toConnect(invalid("key", "%s is set by pvcli operator downgrade enable and removed by pvcli operator downgrade cancel", DowngradeKey))
	}
	change := ConfigChange{Key: req.Msg.GetKey(), Delete: true, Force: req.Msg.GetForce()}
	if err := h.validateChange(ctx, change); err != nil {
		return nil, toConnect(err)
	}
	if err := h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	return write(ctx, h, req, req.Msg.GetWrite(), clusterv1connect.ClusterServiceClient.DeleteConfig, func(ctx context.Context) (*connect.Response[clusterv1.DeleteConfigResponse], error) {
		res, err := h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{
			DeleteConfig: &fsmv1.DeleteConfig{Key: req.Msg.GetKey(), CasRevision: req.Msg.CasRevision},
		}})
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&clusterv1.DeleteConfigResponse{Index: res.Index}), nil
	})
}

// ConfigHistory implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) ConfigHistory(ctx context.Context, req *connect.Request[clusterv1.ConfigHistoryRequest]) (*connect.Response[clusterv1.ConfigHistoryResponse], error) {
	if err := checkConfigKey(req.Msg.GetKey()); err != nil {
		return nil, toConnect(err)
	}
	return read(ctx, h, req, req.Msg.GetRead(), clusterv1connect.ClusterServiceClient.ConfigHistory, configKeyIndex(req.Msg.GetKey()),
		func(ctx context.Context) (*clusterv1.ConfigHistoryResponse, uint64, error) {
			list, err := h.state.State().ConfigHistory(req.Msg.GetKey())
			if err != nil {
				return nil, 0, err // names the key
			}
			var index uint64
			if len(list) > 0 {
				index = list[0].GetRevision()
			}
			return &clusterv1.ConfigHistoryResponse{Entries: list, Meta: h.queryMeta(index)}, index, nil
		})
}
