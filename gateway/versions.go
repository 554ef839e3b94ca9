package gateway

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// ClusterVersion implements clusterv1connect.ClusterServiceHandler: the
// cluster version and every server's release, as the node asked sees
// them. It is answered by that node, not the leader, so that it works
// during an upgrade whose leader runs a release without it.
func (h *ClusterService) ClusterVersion(ctx context.Context, _ *connect.Request[clusterv1.ClusterVersionRequest]) (*connect.Response[clusterv1.ClusterVersionResponse], error) {
	if h.cfg.ClusterVersion == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("the cluster version is not available on this port"))
	}
	resp, err := h.cfg.ClusterVersion(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// VerifyReplicas implements clusterv1connect.ClusterServiceHandler: run on
// the leader, which appends the checkpoint and compares every server's
// state hash with its own.
func (h *ClusterService) VerifyReplicas(ctx context.Context, req *connect.Request[clusterv1.VerifyReplicasRequest]) (*connect.Response[clusterv1.VerifyReplicasResponse], error) {
	if h.cfg.VerifyReplicas == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("replica verification is not available on this port"))
	}
	return onLeader(ctx, h, req, clusterv1connect.ClusterServiceClient.VerifyReplicas, func(ctx context.Context) (*connect.Response[clusterv1.VerifyReplicasResponse], error) {
		resp, err := h.cfg.VerifyReplicas(ctx)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	})
}

// Downgrade implements clusterv1connect.ClusterServiceHandler: run on the
// leader.
func (h *ClusterService) Downgrade(ctx context.Context, req *connect.Request[clusterv1.DowngradeRequest]) (*connect.Response[clusterv1.DowngradeResponse], error) {
	if h.cfg.Downgrade == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("downgrades are not available on this port"))
	}
	switch req.Msg.GetAction() {
	case clusterv1.DowngradeAction_DOWNGRADE_ACTION_VALIDATE, clusterv1.DowngradeAction_DOWNGRADE_ACTION_ENABLE:
		if req.Msg.GetVersion() == "" {
			return nil, toConnect(invalid("version", "is required: the release to downgrade to, as MAJOR.MINOR (pvcli operator upgrade status shows the cluster version)"))
		}
	case clusterv1.DowngradeAction_DOWNGRADE_ACTION_CANCEL:
	default:
		return nil, toConnect(invalid("action", "%s: must be DOWNGRADE_ACTION_VALIDATE, DOWNGRADE_ACTION_ENABLE or DOWNGRADE_ACTION_CANCEL", req.Msg.GetAction()))
	}
	return onLeader(ctx, h, req, clusterv1connect.ClusterServiceClient.Downgrade, func(ctx context.Context) (*connect.Response[clusterv1.DowngradeResponse], error) {
		resp, err := h.cfg.Downgrade(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	})
}
