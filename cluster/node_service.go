package cluster

import (
	"context"

	"connectrpc.com/connect"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
)

// StatusSource reports this node's Raft status.
type StatusSource interface {
	NodeStatus() *nodev1.StatusResponse
}

// ReadIndexSource answers ReadIndex on the leader: an index at least as
// high as every write the leader acknowledged, after confirming its
// leadership with a quorum. Its errors are already Connect errors.
type ReadIndexSource interface {
	LeaderReadIndex(ctx context.Context) (uint64, error)
}

// NodeService is the internal agent-to-agent service on port 9000.
type NodeService struct {
	src       StatusSource
	readIndex ReadIndexSource
}

var _ nodev1connect.NodeServiceHandler = (*NodeService)(nil)

// NewNodeService returns the handler.
func NewNodeService(src StatusSource, ri ReadIndexSource) *NodeService {
	return &NodeService{src: src, readIndex: ri}
}

// ReadIndex implements nodev1connect.NodeServiceHandler.
func (s *NodeService) ReadIndex(ctx context.Context, _ *connect.Request[nodev1.ReadIndexRequest]) (*connect.Response[nodev1.ReadIndexResponse], error) {
	idx, err := s.readIndex.LeaderReadIndex(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.ReadIndexResponse{Index: idx}), nil
}

// Status implements nodev1connect.NodeServiceHandler.
func (s *NodeService) Status(context.Context, *connect.Request[nodev1.StatusRequest]) (*connect.Response[nodev1.StatusResponse], error) {
	return connect.NewResponse(s.src.NodeStatus()), nil
}
