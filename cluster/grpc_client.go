package cluster

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
)

// The Connect client interfaces over grpc-go clients: request headers go
// out as metadata, response headers and trailers come back as the Connect
// response's, and a gRPC status becomes a *connect.Error with the same
// code, message and details, its metadata (headers and trailers) in Meta.
// One line per method; the interface assertions make the compiler reject a
// missing one.

var (
	_ clusterv1connect.ClusterServiceClient = grpcCluster{}
	_ nodev1connect.NodeServiceClient       = grpcNode{}
)

type grpcCluster struct {
	c clusterv1.ClusterServiceClient
}

func (g grpcCluster) Members(ctx context.Context, r *connect.Request[clusterv1.MembersRequest]) (*connect.Response[clusterv1.MembersResponse], error) {
	return callGRPC(ctx, r, g.c.Members)
}

func (g grpcCluster) Peers(ctx context.Context, r *connect.Request[clusterv1.PeersRequest]) (*connect.Response[clusterv1.PeersResponse], error) {
	return callGRPC(ctx, r, g.c.Peers)
}

func (g grpcCluster) Leader(ctx context.Context, r *connect.Request[clusterv1.LeaderRequest]) (*connect.Response[clusterv1.LeaderResponse], error) {
	return callGRPC(ctx, r, g.c.Leader)
}

// WatchStatus is not carried over gRPC between agents: each agent's
// stream is its own view, served on the API port only.
func (g grpcCluster) WatchStatus(context.Context, *connect.Request[clusterv1.WatchStatusRequest]) (*connect.ServerStreamForClient[clusterv1.WatchStatusResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("WatchStatus is served on the API port, not relayed between agents"))
}

func (g grpcCluster) Join(ctx context.Context, r *connect.Request[clusterv1.JoinRequest]) (*connect.Response[clusterv1.JoinResponse], error) {
	return callGRPC(ctx, r, g.c.Join)
}

func (g grpcCluster) Leave(ctx context.Context, r *connect.Request[clusterv1.LeaveRequest]) (*connect.Response[clusterv1.LeaveResponse], error) {
	return callGRPC(ctx, r, g.c.Leave)
}

func (g grpcCluster) RemovePeer(ctx context.Context, r *connect.Request[clusterv1.RemovePeerRequest]) (*connect.Response[clusterv1.RemovePeerResponse], error) {
	return callGRPC(ctx, r, g.c.RemovePeer)
}

func (g grpcCluster) TransferLeader(ctx context.Context, r *connect.Request[clusterv1.TransferLeaderRequest]) (*connect.Response[clusterv1.TransferLeaderResponse], error) {
	return callGRPC(ctx, r, g.c.TransferLeader)
}

func (g grpcCluster) RegisterService(ctx context.Context, r *connect.Request[clusterv1.RegisterServiceRequest]) (*connect.Response[clusterv1.RegisterServiceResponse], error) {
	return callGRPC(ctx, r, g.c.RegisterService)
}

func (g grpcCluster) DeregisterService(ctx context.Context, r *connect.Request[clusterv1.DeregisterServiceRequest]) (*connect.Response[clusterv1.DeregisterServiceResponse], error) {
	return callGRPC(ctx, r, g.c.DeregisterService)
}

func (g grpcCluster) Heartbeat(ctx context.Context, r *connect.Request[clusterv1.HeartbeatRequest]) (*connect.Response[clusterv1.HeartbeatResponse], error) {
	return callGRPC(ctx, r, g.c.Heartbeat)
}

func (g grpcCluster) ListServices(ctx context.Context, r *connect.Request[clusterv1.ListServicesRequest]) (*connect.Response[clusterv1.ListServicesResponse], error) {
	return callGRPC(ctx, r, g.c.ListServices)
}

func (g grpcCluster) GetService(ctx context.Context, r *connect.Request[clusterv1.GetServiceRequest]) (*connect.Response[clusterv1.GetServiceResponse], error) {
	return callGRPC(ctx, r, g.c.GetService)
}

func (g grpcCluster) GetConfig(ctx context.Context, r *connect.Request[clusterv1.GetConfigRequest]) (*connect.Response[clusterv1.GetConfigResponse], error) {
	return callGRPC(ctx, r, g.c.GetConfig)
}

func (g grpcCluster) ListConfig(ctx context.Context, r *connect.Request[clusterv1.ListConfigRequest]) (*connect.Response[clusterv1.ListConfigResponse], error) {
	return callGRPC(ctx, r, g.c.ListConfig)
}

func (g grpcCluster) SetConfig(ctx context.Context, r *connect.Request[clusterv1.SetConfigRequest]) (*connect.Response[clusterv1.SetConfigResponse], error) {
	return callGRPC(ctx, r, g.c.SetConfig)
}

func (g grpcCluster) DeleteConfig(ctx context.Context, r *connect.Request[clusterv1.DeleteConfigRequest]) (*connect.Response[clusterv1.DeleteConfigResponse], error) {
	return callGRPC(ctx, r, g.c.DeleteConfig)
}

func (g grpcCluster) ConfigHistory(ctx context.Context, r *connect.Request[clusterv1.ConfigHistoryRequest]) (*connect.Response[clusterv1.ConfigHistoryResponse], error) {
	return callGRPC(ctx, r, g.c.ConfigHistory)
}

func (g grpcCluster) ForceLeave(ctx context.Context, r *connect.Request[clusterv1.ForceLeaveRequest]) (*connect.Response[clusterv1.ForceLeaveResponse], error) {
	return callGRPC(ctx, r, g.c.ForceLeave)
}

func (g grpcCluster) AutopilotState(ctx context.Context, r *connect.Request[clusterv1.AutopilotStateRequest]) (*connect.Response[clusterv1.AutopilotStateResponse], error) {
	return callGRPC(ctx, r, g.c.AutopilotState)
}

func (g grpcCluster) Keyring(ctx context.Context, r *connect.Request[clusterv1.KeyringRequest]) (*connect.Response[clusterv1.KeyringResponse], error) {
	return callGRPC(ctx, r, g.c.Keyring)
}

type grpcNode struct {
	c nodev1.NodeServiceClient
}

func (g grpcNode) Status(ctx context.Context, r *connect.Request[nodev1.StatusRequest]) (*connect.Response[nodev1.StatusResponse], error) {
	return callGRPC(ctx, r, g.c.Status)
}

func (g grpcNode) ReadIndex(ctx context.Context, r *connect.Request[nodev1.ReadIndexRequest]) (*connect.Response[nodev1.ReadIndexResponse], error) {
	return callGRPC(ctx, r, g.c.ReadIndex)
}

func (g grpcNode) RenewCertificate(ctx context.Context, r *connect.Request[nodev1.RenewCertificateRequest]) (*connect.Response[nodev1.RenewCertificateResponse], error) {
	return callGRPC(ctx, r, g.c.RenewCertificate)
}

func (g grpcNode) ReportPlacements(ctx context.Context, r *connect.Request[nodev1.ReportPlacementsRequest]) (*connect.Response[nodev1.ReportPlacementsResponse], error) {
	return callGRPC(ctx, r, g.c.ReportPlacements)
}

func (g grpcNode) ConfigStatus(ctx context.Context, r *connect.Request[nodev1.ConfigStatusRequest]) (*connect.Response[nodev1.ConfigStatusResponse], error) {
	return callGRPC(ctx, r, g.c.ConfigStatus)
}

func (g grpcCluster) CheckAccess(ctx context.Context, r *connect.Request[clusterv1.CheckAccessRequest]) (*connect.Response[clusterv1.CheckAccessResponse], error) {
	return callGRPC(ctx, r, g.c.CheckAccess)
}

func (g grpcCluster) WhoAmI(ctx context.Context, r *connect.Request[clusterv1.WhoAmIRequest]) (*connect.Response[clusterv1.WhoAmIResponse], error) {
	return callGRPC(ctx, r, g.c.WhoAmI)
}

func (g grpcCluster) CheckNetworkPolicy(ctx context.Context, r *connect.Request[clusterv1.CheckNetworkPolicyRequest]) (*connect.Response[clusterv1.CheckNetworkPolicyResponse], error) {
	return callGRPC(ctx, r, g.c.CheckNetworkPolicy)
}

func (g grpcCluster) ConfigStatus(ctx context.Context, r *connect.Request[clusterv1.ConfigStatusRequest]) (*connect.Response[clusterv1.ConfigStatusResponse], error) {
	return callGRPC(ctx, r, g.c.ConfigStatus)
}

func (g grpcNode) ForceLeave(ctx context.Context, r *connect.Request[nodev1.ForceLeaveRequest]) (*connect.Response[nodev1.ForceLeaveResponse], error) {
	return callGRPC(ctx, r, g.c.ForceLeave)
}

func (g grpcNode) Keyring(ctx context.Context, r *connect.Request[nodev1.KeyringRequest]) (*connect.Response[nodev1.KeyringResponse], error) {
	return callGRPC(ctx, r, g.c.Keyring)
}

// callGRPC makes one unary gRPC call for a Connect request.
func callGRPC[Req, Res any](ctx context.Context, req *connect.Request[Req], call func(context.Context, *Req, ...grpc.CallOption) (*Res, error)) (*connect.Response[Res], error) {
	if h := req.Header(); len(h) > 0 {
		md := make(metadata.MD, len(h))
		for k, vs := range h {
			k = strings.ToLower(k)
			if !strings.HasSuffix(k, "-bin") {
				// grpc-go refuses a call whose metadata holds anything
				// but printable ASCII (net/http accepts more): such a
				// header is dropped rather than failing the forward.
				for _, v := range vs {
					if printableASCII(v) {
						md[k] = append(md[k], v)
					}
				}
				continue
			}
			// Connect holds binary values base64-encoded; grpc-go wants
			// the bytes and encodes them itself.
			for _, v := range vs {
				if b, err := connect.DecodeBinaryHeader(v); err == nil {
					md[k] = append(md[k], string(b))
				}
			}
		}
		ctx = metadata.NewOutgoingContext(ctx, md)
	}
	var hdr, trl metadata.MD
	res, err := call(ctx, req.Msg, grpc.Header(&hdr), grpc.Trailer(&trl))
	if err != nil {
		return nil, connectError(err, hdr, trl)
	}
	out := connect.NewResponse(res)
	copyMetadata(out.Header(), hdr)
	copyMetadata(out.Trailer(), trl)
	return out, nil
}

// connectError converts a gRPC call error. Errors that are not a gRPC
// status (none are expected from grpc-go) become Unknown.
func connectError(err error, hdr, trl metadata.MD) error {
	st, ok := status.FromError(err)
	if !ok {
		return connect.NewError(connect.CodeUnknown, err)
	}
	ce := connect.NewError(connect.Code(st.Code()), errors.New(st.Message()))
	for _, d := range st.Proto().GetDetails() {
		// An *anypb.Any is taken as it is, whatever its type.
		if cd, err := connect.NewErrorDetail(d); err == nil {
			ce.AddDetail(cd)
		}
	}
	copyMetadata(ce.Meta(), hdr)
	copyMetadata(ce.Meta(), trl)
	return ce
}

// copyMetadata adds gRPC metadata to HTTP headers, leaving out the
// protocol's own keys.
func copyMetadata(h http.Header, md metadata.MD) {
	for k, vs := range md {
		if strings.HasPrefix(k, ":") || strings.HasPrefix(k, "grpc-") || k == "content-type" {
			continue
		}
		for _, v := range vs {
			if strings.HasSuffix(k, "-bin") {
				v = connect.EncodeBinaryHeader([]byte(v))
			}
			h.Add(k, v)
		}
	}
}

// printableASCII reports whether v is a valid gRPC metadata value.
func printableASCII(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
}

// StreamError converts an error of a streaming gRPC call into a
// *connect.Error with the same code, message and details, and md (the
// stream's trailer, when the call ended) in its metadata; nil and io.EOF
// pass through.
func StreamError(err error, md ...metadata.MD) error {
	if err == nil || errors.Is(err, io.EOF) {
		return err
	}
	return connectError(err, nil, metadata.Join(md...))
}

// CallGRPC makes a gRPC call with a Connect request and answers as a
// Connect client would: headers become metadata, and a gRPC status error
// a *connect.Error with the same code, message and details.
func CallGRPC[Req, Res any](ctx context.Context, req *connect.Request[Req], call func(context.Context, *Req, ...grpc.CallOption) (*Res, error)) (*connect.Response[Res], error) {
	return callGRPC(ctx, req, call)
}

func (g grpcCluster) ClusterVersion(ctx context.Context, r *connect.Request[clusterv1.ClusterVersionRequest]) (*connect.Response[clusterv1.ClusterVersionResponse], error) {
	return callGRPC(ctx, r, g.c.ClusterVersion)
}

func (g grpcCluster) VerifyReplicas(ctx context.Context, r *connect.Request[clusterv1.VerifyReplicasRequest]) (*connect.Response[clusterv1.VerifyReplicasResponse], error) {
	return callGRPC(ctx, r, g.c.VerifyReplicas)
}

func (g grpcCluster) Downgrade(ctx context.Context, r *connect.Request[clusterv1.DowngradeRequest]) (*connect.Response[clusterv1.DowngradeResponse], error) {
	return callGRPC(ctx, r, g.c.Downgrade)
}

func (g grpcNode) StateHash(ctx context.Context, r *connect.Request[nodev1.StateHashRequest]) (*connect.Response[nodev1.StateHashResponse], error) {
	return callGRPC(ctx, r, g.c.StateHash)
}
