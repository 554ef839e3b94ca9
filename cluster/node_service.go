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

// NodeService is the internal agent-to-agent service on port 9000.
type NodeService struct {
	src StatusSource
}

var _ nodev1connect.NodeServiceHandler = (*NodeService)(nil)

// NewNodeService returns the handler.
func NewNodeService(src StatusSource) *NodeService {
	return &NodeService{src: src}
}

// Status implements nodev1connect.NodeServiceHandler.
func (s *NodeService) Status(context.Context, *connect.Request[nodev1.StatusRequest]) (*connect.Response[nodev1.StatusResponse], error) {
	return connect.NewResponse(s.src.NodeStatus()), nil
}
