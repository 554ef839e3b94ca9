package cluster

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/identity"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
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

// CertificateSigner signs certificate renewals with the cluster CA, on the
// leader. Its errors are Connect errors.
type CertificateSigner interface {
	SignRenewal(ctx context.Context, req identity.RenewalRequest) ([]byte, error)
}

// NodeService is the internal agent-to-agent service on port 9000.
type NodeService struct {
	src       StatusSource
	readIndex ReadIndexSource
	gossip    *Gossip
	signer    CertificateSigner
	prove     func(nonce []byte) (*nodev1.IdentityProof, error)
	place     func(ctx context.Context, op *fsmv1.SetPlacements) error
	config    func() *clusterv1.NodeConfigStatus
	hash      func(ctx context.Context, index uint64) (*nodev1.StateHashResponse, error)
}

// SetStateHash makes StateHash answer with hash (this node's state hash
// at a checkpoint; its errors are Connect errors). Without it, StateHash
// fails with Unimplemented.
func (s *NodeService) SetStateHash(hash func(ctx context.Context, index uint64) (*nodev1.StateHashResponse, error)) {
	s.hash = hash
}

// StateHash implements nodev1connect.NodeServiceHandler.
func (s *NodeService) StateHash(ctx context.Context, req *connect.Request[nodev1.StateHashRequest]) (*connect.Response[nodev1.StateHashResponse], error) {
	if s.hash == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this node keeps no state hashes"))
	}
	if req.Msg.GetIndex() == 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("index: required (a checkpoint's log index)"))
	}
	resp, err := s.hash(ctx, req.Msg.GetIndex())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// SetConfigStatus makes ConfigStatus answer with status (this node's state
// of the cluster settings). Without it, ConfigStatus fails with
// Unimplemented.
func (s *NodeService) SetConfigStatus(status func() *clusterv1.NodeConfigStatus) {
	s.config = status
}

// ConfigStatus implements nodev1connect.NodeServiceHandler.
func (s *NodeService) ConfigStatus(context.Context, *connect.Request[nodev1.ConfigStatusRequest]) (*connect.Response[nodev1.ConfigStatusResponse], error) {
	if s.config == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this node does not follow the cluster settings"))
	}
	return connect.NewResponse(&nodev1.ConfigStatusResponse{Status: s.config()}), nil
}

// SetPlacementSink makes ReportPlacements record a node's report with
// place (on the leader: a Raft proposal; its errors are Connect errors).
// Without one, ReportPlacements fails with Unimplemented.
func (s *NodeService) SetPlacementSink(place func(ctx context.Context, op *fsmv1.SetPlacements) error) {
	s.place = place
}

// ReportPlacements implements nodev1connect.NodeServiceHandler.
func (s *NodeService) ReportPlacements(ctx context.Context, req *connect.Request[nodev1.ReportPlacementsRequest]) (*connect.Response[nodev1.ReportPlacementsResponse], error) {
	if s.place == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this node keeps no placement catalog"))
	}
	op := req.Msg.GetPlacements()
	if op == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("placements: required"))
	}
	if err := s.place(ctx, op); err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.ReportPlacementsResponse{}), nil
}

// SetProver makes Status answer a nonce with an identity proof made by
// prove (TLS on; without it a nonce gets no proof, which Admission
// refuses).
func (s *NodeService) SetProver(prove func(nonce []byte) (*nodev1.IdentityProof, error)) {
	s.prove = prove
}

var _ nodev1connect.NodeServiceHandler = (*NodeService)(nil)

// NewNodeService returns the handler. signer may be nil (the cluster CA is
// off): RenewCertificate then fails with FailedPrecondition.
func NewNodeService(src StatusSource, ri ReadIndexSource, gossip *Gossip, signer CertificateSigner) *NodeService {
	return &NodeService{src: src, readIndex: ri, gossip: gossip, signer: signer}
}

// RenewCertificate implements nodev1connect.NodeServiceHandler.
func (s *NodeService) RenewCertificate(ctx context.Context, req *connect.Request[nodev1.RenewCertificateRequest]) (*connect.Response[nodev1.RenewCertificateResponse], error) {
	if s.signer == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("the cluster CA is not enabled on this node (tls.cluster_ca.enabled)"))
	}
	certPEM, err := s.signer.SignRenewal(ctx, identity.RenewalRequest{CSR: req.Msg.GetCsr(), Current: req.Msg.GetCurrent(), Proof: req.Msg.GetProof()})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&nodev1.RenewCertificateResponse{CertPem: certPEM}), nil
}

// ForceLeave implements nodev1connect.NodeServiceHandler: the failed
// member is marked left in this node's member table.
func (s *NodeService) ForceLeave(_ context.Context, req *connect.Request[nodev1.ForceLeaveRequest]) (*connect.Response[nodev1.ForceLeaveResponse], error) {
	pending, err := s.gossip.ForceLeave(req.Msg.GetNode(), req.Msg.GetPrune())
	if err != nil {
		return nil, connect.NewError(connect.CodeNotFound, err)
	}
	return connect.NewResponse(&nodev1.ForceLeaveResponse{Pending: pending}), nil
}

// Keyring implements nodev1connect.NodeServiceHandler: one keyring
// operation on this node.
func (s *NodeService) Keyring(_ context.Context, req *connect.Request[nodev1.KeyringRequest]) (*connect.Response[nodev1.KeyringResponse], error) {
	var (
		st  KeyringState
		err error
	)
	op := req.Msg.GetOp()
	if op == clusterv1.KeyringOp_KEYRING_OP_LIST {
		st, err = s.gossip.Keyring()
	} else {
		var key []byte
		var perr error
		if IsKeyFingerprint(req.Msg.GetKey()) && op != clusterv1.KeyringOp_KEYRING_OP_INSTALL {
			// use and remove name an installed key by its fingerprint.
			if key, perr = s.gossip.KeyByFingerprint(req.Msg.GetKey()); perr != nil {
				return nil, connect.NewError(connect.CodeFailedPrecondition, perr)
			}
		} else if key, perr = ParseGossipKey(req.Msg.GetKey()); perr != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("key: %w", perr))
		}
		name, ok := map[clusterv1.KeyringOp]string{
			clusterv1.KeyringOp_KEYRING_OP_INSTALL: KeyringInstall,
			clusterv1.KeyringOp_KEYRING_OP_USE:     KeyringUse,
			clusterv1.KeyringOp_KEYRING_OP_REMOVE:  KeyringRemove,
		}[op]
		if !ok {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("op: %v is not a keyring operation", op))
		}
		st, err = s.gossip.ChangeKeyring(name, key)
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, err)
	}
	return connect.NewResponse(&nodev1.KeyringResponse{Keyring: &clusterv1.NodeKeyring{Primary: st.Primary, Keys: st.Keys}}), nil
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
func (s *NodeService) Status(_ context.Context, req *connect.Request[nodev1.StatusRequest]) (*connect.Response[nodev1.StatusResponse], error) {
	st := s.src.NodeStatus()
	if nonce := req.Msg.GetNonce(); len(nonce) > 0 {
		if len(nonce) < identity.MinNonce || len(nonce) > identity.MaxNonce {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("nonce: %d bytes, want %d to %d", len(nonce), identity.MinNonce, identity.MaxNonce))
		}
		if s.prove != nil {
			p, err := s.prove(nonce)
			if err != nil {
				return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("identity proof: %w", err))
			}
			st.Proof = p
		}
	}
	return connect.NewResponse(st), nil
}
