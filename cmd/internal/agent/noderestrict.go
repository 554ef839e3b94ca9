package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/gateway/observe"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
	"pilab.hu/pivirt-agent/scheduler"
)

// The internal port's node restriction (Kubernetes' Node authorizer): an
// agent's certificate proves which node calls, nothing more. A call made
// for a caller carries the caller's credential (access.Relayed), which
// this agent authenticates again and checks against its RBAC policy with
// the same guard as the API port. A call with no caller behind it is the
// node acting as itself, and may only do what a node does: read the
// replicated state it holds a copy of anyway, answer the leader's
// questions (status, read index, state hash, config status), report its
// own placements, register and heartbeat its own service instances, leave
// the Raft configuration itself, renew its own certificate (proved by its
// current key), delete the cluster-wide RBAC policy from its operations
// port (break-glass), and, as the Raft leader, run the power schedules'
// actions. Everything else is PermissionDenied and audited.

// relayedAs names, for the internal methods that do on this node part of
// an API method's work (a keyring change on every node), the API method
// whose rule the relayed caller must meet.
var relayedAs = map[string]string{
	nodev1connect.NodeServiceKeyringProcedure:    clusterv1connect.ClusterServiceKeyringProcedure,
	nodev1connect.NodeServiceForceLeaveProcedure: clusterv1connect.ClusterServiceForceLeaveProcedure,
}

// nodeMethods are the node service's methods a node calls as itself; the
// caller of the call that made it ask, if any, is not what they check.
var nodeMethods = map[string]bool{
	nodev1connect.NodeServiceStatusProcedure:           true,
	nodev1connect.NodeServiceReadIndexProcedure:        true,
	nodev1connect.NodeServiceStateHashProcedure:        true,
	nodev1connect.NodeServiceConfigStatusProcedure:     true,
	nodev1connect.NodeServiceRenewCertificateProcedure: true,
	nodev1connect.NodeServiceReportPlacementsProcedure: true,
}

// replicatedServices hold what every server agent has a replica of: a
// node may read them as itself.
var replicatedServices = map[protoreflect.FullName]bool{
	"pivirt.cluster.v1.ClusterService":   true,
	"pivirt.schedule.v1.ScheduleService": true,
}

// internalCall is what the internal port knows of a call before its
// handler runs.
type internalCall struct {
	method string
	node   string // the calling agent's node name
	via    string // its certificate's CN
	remote string
	md     metadata.MD
	req    any // the request of a unary call; nil for streams
}

// internalServerOptions are the internal port's node restriction (TLS on):
// the peer's certificate for the interceptors, which authenticate a
// relayed caller and run the API port's guard for it, or hold a call
// without one to what its node may do.
func (a *Agent) internalServerOptions() []grpc.ServerOption {
	if a.tls == nil {
		return nil
	}
	return []grpc.ServerOption{
		grpc.Creds(gateway.PeerTLSCredentials{}),
		grpc.ChainUnaryInterceptor(a.internalUnary),
		grpc.ChainStreamInterceptor(a.internalStream),
	}
}

func (a *Agent) internalUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, relayed, err := a.admitInternal(ctx, info.FullMethod, req)
	if err != nil {
		return nil, err
	}
	if relayed {
		return a.guard.UnaryServerInterceptor()(ctx, req, info, handler)
	}
	return handler(ctx, req)
}

func (a *Agent) internalStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, relayed, err := a.admitInternal(ss.Context(), info.FullMethod, nil)
	if err != nil {
		return err
	}
	ss = mesh.WithStreamContext(ss, ctx)
	if relayed {
		return a.guard.StreamServerInterceptor()(srv, ss, info, handler)
	}
	return handler(srv, ss)
}

// admitInternal decides a call of the internal port: relayed is true when
// it carries a caller, authenticated into ctx, whose RBAC check the
// guard's interceptor makes next; false with a nil error when the calling
// node may make it as itself (or a relayed caller's check is done).
func (a *Agent) admitInternal(ctx context.Context, method string, req any) (context.Context, bool, error) {
	if a.guard == nil {
		return ctx, false, nil // access control off: nothing to restrict by
	}
	leaf := peerLeaf(ctx)
	if leaf == nil {
		return ctx, false, status.Errorf(codes.PermissionDenied, "%s: the connection shows no agent certificate", method)
	}
	node, err := identity.AgentName(leaf)
	if err != nil {
		return ctx, false, status.Error(codes.PermissionDenied, err.Error())
	}
	c := internalCall{method: method, node: node, via: leaf.Subject.CommonName, req: req}
	c.md, _ = metadata.FromIncomingContext(ctx)
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		c.remote = p.Addr.String()
	}
	if nodeMethods[method] {
		return ctx, false, a.nodeCall(ctx, c)
	}
	rctx, err := a.guard.Relayed(ctx, method, c.via, c.remote, c.md)
	switch {
	case errors.Is(err, access.ErrNoCaller):
		return ctx, false, a.nodeCall(ctx, c)
	case err != nil:
		return ctx, false, err
	}
	if api, ok := relayedAs[method]; ok {
		if v := c.md.Get(authz.CallerMethodHeader); len(v) != 1 || v[0] != api {
			return ctx, false, a.refuseNodeCall(c, fmt.Sprintf("it is relayed only for %s", api))
		}
		return rctx, false, a.guard.AuthorizeRelayedAs(rctx, api)
	}
	return rctx, true, nil
}

// peerLeaf is the client certificate of the connection of ctx: from
// grpc-go's transport, or, for a call that net/http handed to grpc-go
// (gateway.SplitGRPC), from the connection's TLS state in the request's
// context.
func peerLeaf(ctx context.Context) *x509.Certificate {
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
			return info.State.PeerCertificates[0]
		}
	}
	if st, ok := gateway.ConnTLSFromContext(ctx); ok && len(st.PeerCertificates) > 0 {
		return st.PeerCertificates[0]
	}
	return nil
}

// internalNotGRPC answers what is not gRPC on the internal port: agents
// call each other over gRPC only, and every call goes through the node
// restriction of the gRPC server.
func internalNotGRPC() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusUnsupportedMediaType)
		_, _ = io.WriteString(w, "the internal port serves agents over gRPC only (HTTP/2, application/grpc); clients use the API port\n")
	})
}

// nodeCall decides a call a node makes as itself.
func (a *Agent) nodeCall(ctx context.Context, c internalCall) error {
	reason := a.nodeMay(c)
	if reason == "" {
		return nil
	}
	if !a.allows(fsm.FeatureNodeRestriction) {
		// A server of a release that relays no caller is still in the
		// cluster: its calls are taken as before.
		a.logger.Debug("internal call without a caller taken: the cluster version does not restrict nodes yet", "method", c.method, "via", c.via)
		return nil
	}
	return a.refuseNodeCall(c, reason)
}

// refuseNodeCall audits and refuses a call of the internal port.
func (a *Agent) refuseNodeCall(c internalCall, reason string) error {
	observe.Audit(a.logger, slog.LevelWarn, "audit: internal call denied: an agent's certificate acts only as its node", "decision", "deny",
		"identity", c.via, "node", c.node, "method", c.method, "remote", c.remote, "reason", reason)
	return status.Errorf(codes.PermissionDenied, "%s may not call %s as itself: %s; an agent's certificate acts only as its node, and a call made for someone carries that caller's credential", c.via, c.method, reason)
}

// nodeMay is "" when node may make the call as itself, else why not.
func (a *Agent) nodeMay(c internalCall) string {
	switch c.method {
	case nodev1connect.NodeServiceReportPlacementsProcedure:
		r, _ := c.req.(*nodev1.ReportPlacementsRequest)
		if n := r.GetPlacements().GetNode(); n != c.node {
			return fmt.Sprintf("it reports the placements of node %q, not its own (%s)", n, c.node)
		}
		return ""
	case clusterv1connect.ClusterServiceRegisterServiceProcedure:
		r, _ := c.req.(*clusterv1.RegisterServiceRequest)
		if n := r.GetInstance().GetNode(); n != c.node {
			return fmt.Sprintf("it registers an instance of node %q, not of its own (%s)", n, c.node)
		}
		return ""
	case clusterv1connect.ClusterServiceDeregisterServiceProcedure:
		r, _ := c.req.(*clusterv1.DeregisterServiceRequest)
		return a.ownInstance(c.node, r.GetService(), r.GetInstanceId())
	case clusterv1connect.ClusterServiceHeartbeatProcedure:
		r, _ := c.req.(*clusterv1.HeartbeatRequest)
		return a.ownInstance(c.node, r.GetService(), r.GetInstanceId())
	case clusterv1connect.ClusterServiceRemovePeerProcedure:
		r, _ := c.req.(*clusterv1.RemovePeerRequest)
		if m, ok := a.memberByID(r.GetNodeId()); !ok || m.Name != c.node {
			return fmt.Sprintf("it removes server %q, not itself", r.GetNodeId())
		}
		return ""
	case clusterv1connect.ClusterServiceDeleteConfigProcedure:
		r, _ := c.req.(*clusterv1.DeleteConfigRequest)
		if r.GetKey() == RBACPolicyKey {
			observe.Audit(a.logger, slog.LevelWarn, "audit: break-glass: a node removes the cluster-wide RBAC policy from its operations port",
				"decision", "allow", "identity", c.via, "node", c.node, "method", c.method, "remote", c.remote)
			return ""
		}
		return "a node deletes no config key but the cluster-wide RBAC policy (break-glass)"
	}
	if nodeMethods[c.method] {
		return "" // status, read index, state hash, config status; a renewal proves the current key
	}
	if md := findMethod(c.method); md != nil && replicatedServices[md.Parent().FullName()] {
		if rule, err := authz.MethodRule(md); err == nil && (rule.GetVerb() == "get" || rule.GetVerb() == "list") {
			return "" // it holds a replica of what it reads
		}
	}
	if a.proxy != nil && a.proxy.Route(c.method) != nil {
		return a.scheduledAction(c)
	}
	return "it carries no caller, and a node makes no such call for itself"
}

// ownInstance is "" when the stored service instance is node's (or there
// is none: the write answers that), else why not.
func (a *Agent) ownInstance(node, service, id string) string {
	inst, err := a.fsm.State().Service(service, id)
	if err != nil || inst.GetNode() == node {
		return ""
	}
	return fmt.Sprintf("instance %s/%s is node %q's, not its own (%s)", service, id, inst.GetNode(), node)
}

// scheduledAction is "" for a power schedule's action that the Raft
// leader (which runs the schedules) sends to the node holding the VM.
func (a *Agent) scheduledAction(c internalCall) string {
	ids := c.md.Get(mesh.IdentityHeader)
	who := ""
	if len(ids) == 1 {
		who, _ = url.PathUnescape(ids[0])
	}
	if who != SchedulerIdentity || !scheduler.IsActionMethod(c.method) {
		return "it carries no caller, and a node makes no such call for itself"
	}
	id, _ := a.raft.Leader()
	if m, ok := a.memberByID(string(id)); !ok || m.Name != c.node {
		return "power schedules' actions come from the Raft leader only"
	}
	return ""
}

// memberByID is the gossip member of a node ID.
func (a *Agent) memberByID(id string) (cluster.Member, bool) {
	if a.gossip == nil || id == "" {
		return cluster.Member{}, false
	}
	return a.gossip.MemberByID(id)
}

// findMethod is the descriptor of a full method name
// ("/pkg.Service/Method").
func findMethod(full string) protoreflect.MethodDescriptor {
	if len(full) < 2 || full[0] != '/' {
		return nil
	}
	for i := len(full) - 1; i > 0; i-- {
		if full[i] == '/' {
			d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(full[1:i]))
			if err != nil {
				return nil
			}
			sd, ok := d.(protoreflect.ServiceDescriptor)
			if !ok {
				return nil
			}
			return sd.Methods().ByName(protoreflect.Name(full[i+1:]))
		}
	}
	return nil
}
