package gateway

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// ForceLeave implements clusterv1connect.ClusterServiceHandler: the member
// must be failed in this node's view; every live member (this one
// included) is then told, and the answer holds each one's result.
func (h *ClusterService) ForceLeave(ctx context.Context, req *connect.Request[clusterv1.ForceLeaveRequest]) (*connect.Response[clusterv1.ForceLeaveResponse], error) {
	name := req.Msg.GetNode()
	if name == "" {
		return nil, toConnect(invalid("node", "is required: the gossip name of a failed member (pvcli cluster members)"))
	}
	if h.cfg.ForceLeave == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("force-leave is not available on this port"))
	}
	members := h.members.Members()
	var target *cluster.Member
	var names []string
	for i, m := range members {
		names = append(names, m.Name)
		if m.Name == name {
			target = &members[i]
		}
	}
	switch {
	case target == nil:
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no gossip member named %q on %s (members: %v)", name, h.cfg.NodeName, names))
	case target.Status == cluster.StatusAlive || target.Status == cluster.StatusSuspect:
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s is %s: force-leave is for failed members; to remove a live agent run pvcli cluster leave against it", name, target.Status))
	}
	out := eachMember(ctx, members, func(ctx context.Context, m cluster.Member) *clusterv1.NodeForceLeave {
		r := &clusterv1.NodeForceLeave{Node: m.Name, NodeId: m.Meta.ID}
		pending, err := h.cfg.ForceLeave(ctx, m.Meta.InternalAddr, name, req.Msg.GetPrune())
		switch {
		case connect.CodeOf(err) == connect.CodeNotFound:
			// That member forgot it already (it left long ago, or was
			// pruned): nothing left to tell it.
		case err != nil:
			r.Error = nodeError(m, err, "forgets the member when its own failure detection reaps it")
		}
		r.Pending = pending
		return r
	})
	h.logger.InfoContext(ctx, "forced a failed member to leave", "member", name, "node_id", target.Meta.ID, "told", len(out), "pruned", req.Msg.GetPrune())
	if req.Msg.GetPrune() {
		// A pruned member is gone from every member table: the leader's
		// reconciler no longer sees it leave, so its Raft server goes now.
		rreq := connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: target.Meta.ID})
		if _, err := h.RemovePeer(ctx, rreq); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			h.logger.WarnContext(ctx, "force-leave --prune: the node's Raft server is removed later (dead_server_cleanup)", "member", name, "error", err)
		}
	}
	if h.cfg.Retire != nil {
		if err := h.cfg.Retire(ctx, name); err != nil {
			// The leader retries on its own (the member is left).
			h.logger.WarnContext(ctx, "force-leave: the node's entries stay in the placement catalog for now", "member", name, "error", err)
		}
	}
	return connect.NewResponse(&clusterv1.ForceLeaveResponse{Nodes: out}), nil
}

// AutopilotState implements clusterv1connect.ClusterServiceHandler: on the
// leader, the Raft view of Peers joined with the reconciler's last pass.
func (h *ClusterService) AutopilotState(ctx context.Context, req *connect.Request[clusterv1.AutopilotStateRequest]) (*connect.Response[clusterv1.AutopilotStateResponse], error) {
	if h.cfg.Autopilot == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("autopilot state is kept by the Raft leader's reconciler; this agent runs none (etcd mode)"))
	}
	return onLeader(ctx, h, req, clusterv1connect.ClusterServiceClient.AutopilotState, func(ctx context.Context) (*connect.Response[clusterv1.AutopilotStateResponse], error) {
		rep, ok := h.cfg.Autopilot()
		if !ok {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("the leader's reconciler has not run its first pass yet; retry"))
		}
		peers, _, err := h.peerList(ctx)
		if err != nil {
			return nil, err
		}
		out := &clusterv1.AutopilotStateResponse{
			VotersTarget: int32(rep.Voters), Stabilization: durationpb.New(rep.Stabilization),
			MaxTrailingLogs: rep.MaxTrailingLogs, DeadServerCleanup: durationpb.New(rep.DeadServerCleanup),
			Healthy: true,
		}
		voters, healthyVoters := 0, 0
		for _, p := range peers {
			s := &clusterv1.AutopilotServer{
				NodeId: p.GetNodeId(), Name: p.GetName(), Address: p.GetAddress(), Voter: p.GetVoter(),
				Leader: p.GetState() == clusterv1.RaftState_RAFT_STATE_LEADER, Trailing: p.GetTrailing(), LastContact: p.GetLastContact(),
				GossipStatus: clusterv1.MemberStatus_MEMBER_STATUS_UNSPECIFIED,
			}
			if s.Leader {
				out.Leader = s.Name
			}
			if m, ok := h.members.ServerByID(p.GetNodeId(), p.GetAddress()); ok {
				s.GossipStatus = memberProto(m).GetStatus()
			}
			reachable := p.GetState() != clusterv1.RaftState_RAFT_STATE_UNREACHABLE && p.GetState() != clusterv1.RaftState_RAFT_STATE_UNSPECIFIED
			s.Healthy = reachable && (s.Leader || s.GossipStatus == clusterv1.MemberStatus_MEMBER_STATUS_ALIVE) && p.GetTrailing() <= rep.MaxTrailingLogs
			sr, known := rep.Servers[p.GetNodeId()]
			switch {
			case known:
				s.Status = sr.Status
				if !sr.HealthySince.IsZero() {
					s.StableSince = timestamppb.New(sr.HealthySince)
				}
			case s.Voter:
				s.Status = "voter"
			default:
				s.Status = "non-voter, not yet seen by the reconciler"
			}
			if s.Leader {
				s.Status = "leader"
			}
			if s.Voter {
				voters++
				if s.Healthy {
					healthyVoters++
				} else {
					out.Healthy = false
				}
			}
			out.Servers = append(out.Servers, s)
		}
		// Servers the reconciler found in gossip but did not add.
		for id, sr := range rep.Servers {
			found := false
			for _, s := range out.Servers {
				found = found || s.NodeId == id
			}
			if !found {
				s := &clusterv1.AutopilotServer{NodeId: id, Status: sr.Status}
				if m, ok := h.members.MemberByID(id); ok {
					s.Name, s.GossipStatus = m.Name, memberProto(m).GetStatus()
				}
				out.Servers = append(out.Servers, s)
			}
		}
		if ft := healthyVoters - (voters/2 + 1); ft > 0 {
			out.FailureTolerance = int32(ft)
		}
		return connect.NewResponse(out), nil
	})
}
