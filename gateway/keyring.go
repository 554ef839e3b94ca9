package gateway

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// keyringTimeout bounds the keyring call to one member.
const keyringTimeout = 10 * time.Second

// Keyring implements clusterv1connect.ClusterServiceHandler: the operation
// runs on every live member (through its internal port, this node's
// included) at once, and the answer holds each member's keyring or error.
// Rotation is install (everywhere), use, then remove of the old key; a
// member that was down during a step must be given the step again.
func (h *ClusterService) Keyring(ctx context.Context, req *connect.Request[clusterv1.KeyringRequest]) (*connect.Response[clusterv1.KeyringResponse], error) {
	op := req.Msg.GetOp()
	switch op {
	case clusterv1.KeyringOp_KEYRING_OP_LIST:
	case clusterv1.KeyringOp_KEYRING_OP_USE, clusterv1.KeyringOp_KEYRING_OP_REMOVE:
		if cluster.IsKeyFingerprint(req.Msg.GetKey()) {
			break // an installed key, as keyring list shows it
		}
		if _, err := cluster.ParseGossipKey(req.Msg.GetKey()); err != nil {
			return nil, toConnect(invalid("key", "%v; use and remove take the key or its fingerprint (pvcli cluster keyring list)", err))
		}
	case clusterv1.KeyringOp_KEYRING_OP_INSTALL:
		if _, err := cluster.ParseGossipKey(req.Msg.GetKey()); err != nil {
			return nil, toConnect(invalid("key", "%v", err))
		}
	default:
		return nil, toConnect(invalid("op", "%v is not a keyring operation", op))
	}
	if h.cfg.Keyring == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("this agent does not manage a gossip keyring"))
	}
	out := eachMember(ctx, h.members.Members(), func(ctx context.Context, m cluster.Member) *clusterv1.NodeKeyring {
		nk, err := h.cfg.Keyring(ctx, m.Meta.InternalAddr, op, req.Msg.GetKey())
		if nk == nil {
			nk = &clusterv1.NodeKeyring{}
		}
		nk.Node, nk.NodeId = m.Name, m.Meta.ID
		if err != nil {
			nk.Error = connect.CodeOf(err).String() + ": " + errorMessage(err)
		}
		return nk
	})
	if op != clusterv1.KeyringOp_KEYRING_OP_LIST {
		failed := 0
		for _, nk := range out {
			if nk.GetError() != "" {
				failed++
			}
		}
		h.logger.InfoContext(ctx, "gossip keyring operation", "op", op.String(), "members", len(out), "failed", failed)
	}
	return connect.NewResponse(&clusterv1.KeyringResponse{Nodes: out}), nil
}

// ConfigStatus implements clusterv1connect.ClusterServiceHandler: every
// live member is asked (through its internal port, this node's included)
// at once.
func (h *ClusterService) ConfigStatus(ctx context.Context, _ *connect.Request[clusterv1.ConfigStatusRequest]) (*connect.Response[clusterv1.ConfigStatusResponse], error) {
	if h.cfg.ConfigStatus == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("this agent does not follow the cluster settings"))
	}
	out := eachMember(ctx, h.members.Members(), func(ctx context.Context, m cluster.Member) *clusterv1.NodeConfigStatus {
		st, err := h.cfg.ConfigStatus(ctx, m.Meta.InternalAddr)
		if st == nil {
			st = &clusterv1.NodeConfigStatus{}
		}
		st.Node, st.NodeId = m.Name, m.Meta.ID
		if err != nil {
			st.Error = nodeError(m, err, "reports no state of the cluster settings")
		}
		return st
	})
	return connect.NewResponse(&clusterv1.ConfigStatusResponse{Nodes: out}), nil
}

// CheckAccess implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) CheckAccess(ctx context.Context, req *connect.Request[clusterv1.CheckAccessRequest]) (*connect.Response[clusterv1.CheckAccessResponse], error) {
	if h.cfg.CheckAccess == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("this agent has no access control to check"))
	}
	if req.Msg.GetMethod() == "" {
		return nil, toConnect(invalid("method", "is required (\"/pivirt.vm.v1.VMService/DeleteVM\" or \"VMService/DeleteVM\")"))
	}
	resp, err := h.cfg.CheckAccess(ctx, req.Msg)
	if err != nil {
		return nil, toConnect(err)
	}
	resp.Node = h.cfg.NodeName
	return connect.NewResponse(resp), nil
}

// CheckNetworkPolicy implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) CheckNetworkPolicy(ctx context.Context, req *connect.Request[clusterv1.CheckNetworkPolicyRequest]) (*connect.Response[clusterv1.CheckNetworkPolicyResponse], error) {
	if h.cfg.CheckNetworkPolicy == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, fmt.Errorf("this agent has no network policy to check"))
	}
	switch {
	case req.Msg.GetFrom() == "" || req.Msg.GetTo() == "":
		return nil, toConnect(invalid("from", "from and to are required: service identities, as the DNS or URI names of certificates"))
	case req.Msg.GetPort() == 0 || req.Msg.GetPort() > 65535:
		return nil, toConnect(invalid("port", "%d: want 1 to 65535", req.Msg.GetPort()))
	}
	resp, err := h.cfg.CheckNetworkPolicy(ctx, req.Msg)
	if err != nil {
		return nil, toConnect(err)
	}
	resp.Node = h.cfg.NodeName
	return connect.NewResponse(resp), nil
}

// eachMember runs ask on every live member (through its internal port,
// this node's included) at once, each within keyringTimeout, and returns
// the answers by node name.
func eachMember[T interface{ GetNode() string }](ctx context.Context, members []cluster.Member, ask func(context.Context, cluster.Member) T) []T {
	var (
		mu  sync.Mutex
		out []T
		wg  sync.WaitGroup
	)
	for _, m := range members {
		if m.Status != cluster.StatusAlive || m.Meta.InternalAddr == "" {
			continue
		}
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, keyringTimeout)
			defer cancel()
			r := ask(cctx, m)
			mu.Lock()
			out = append(out, r)
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b T) int { return strings.Compare(a.GetNode(), b.GetNode()) })
	return out
}

// nodeError is a member's answer to a call made on every member: the
// error's code and message, or, for a call its release does not serve
// (Unimplemented from an agent that announces a release before cluster
// versions), what that release does instead.
func nodeError(m cluster.Member, err error, older string) string {
	if connect.CodeOf(err) == connect.CodeUnimplemented && m.Meta.Protocol < cluster.MinVersionProtocol {
		return fmt.Sprintf("runs release %q, which predates this call: it %s", m.Meta.Version, older)
	}
	return connect.CodeOf(err).String() + ": " + errorMessage(err)
}

// errorMessage is a Connect error's message, or the error's text.
func errorMessage(err error) string {
	if ce, ok := err.(*connect.Error); ok {
		return ce.Message()
	}
	return err.Error()
}
