package gateway

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"pilab.hu/pivirt-agent/gateway/observe"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
)

// The gRPC adapters serve the agent's own services to grpc-go clients by
// calling the same Connect handler methods that net/http serves: one
// implementation, two transports. Each method is one line; the generated
// server interface (built without the Unimplemented embedding) makes the
// compiler reject an adapter that misses a method.

// NewClusterGRPC serves h over gRPC.
func NewClusterGRPC(h clusterv1connect.ClusterServiceHandler) clusterv1.ClusterServiceServer {
	return clusterGRPC{h}
}

type clusterGRPC struct {
	h clusterv1connect.ClusterServiceHandler
}

func (g clusterGRPC) Members(ctx context.Context, r *clusterv1.MembersRequest) (*clusterv1.MembersResponse, error) {
	return unary(ctx, r, g.h.Members)
}

func (g clusterGRPC) Peers(ctx context.Context, r *clusterv1.PeersRequest) (*clusterv1.PeersResponse, error) {
	return unary(ctx, r, g.h.Peers)
}

func (g clusterGRPC) Leader(ctx context.Context, r *clusterv1.LeaderRequest) (*clusterv1.LeaderResponse, error) {
	return unary(ctx, r, g.h.Leader)
}

func (g clusterGRPC) Join(ctx context.Context, r *clusterv1.JoinRequest) (*clusterv1.JoinResponse, error) {
	return unary(ctx, r, g.h.Join)
}

func (g clusterGRPC) Leave(ctx context.Context, r *clusterv1.LeaveRequest) (*clusterv1.LeaveResponse, error) {
	return unary(ctx, r, g.h.Leave)
}

func (g clusterGRPC) RemovePeer(ctx context.Context, r *clusterv1.RemovePeerRequest) (*clusterv1.RemovePeerResponse, error) {
	return unary(ctx, r, g.h.RemovePeer)
}

func (g clusterGRPC) TransferLeader(ctx context.Context, r *clusterv1.TransferLeaderRequest) (*clusterv1.TransferLeaderResponse, error) {
	return unary(ctx, r, g.h.TransferLeader)
}

func (g clusterGRPC) RegisterService(ctx context.Context, r *clusterv1.RegisterServiceRequest) (*clusterv1.RegisterServiceResponse, error) {
	return unary(ctx, r, g.h.RegisterService)
}

func (g clusterGRPC) DeregisterService(ctx context.Context, r *clusterv1.DeregisterServiceRequest) (*clusterv1.DeregisterServiceResponse, error) {
	return unary(ctx, r, g.h.DeregisterService)
}

func (g clusterGRPC) Heartbeat(ctx context.Context, r *clusterv1.HeartbeatRequest) (*clusterv1.HeartbeatResponse, error) {
	return unary(ctx, r, g.h.Heartbeat)
}

func (g clusterGRPC) ListServices(ctx context.Context, r *clusterv1.ListServicesRequest) (*clusterv1.ListServicesResponse, error) {
	return unary(ctx, r, g.h.ListServices)
}

func (g clusterGRPC) GetService(ctx context.Context, r *clusterv1.GetServiceRequest) (*clusterv1.GetServiceResponse, error) {
	return unary(ctx, r, g.h.GetService)
}

func (g clusterGRPC) GetConfig(ctx context.Context, r *clusterv1.GetConfigRequest) (*clusterv1.GetConfigResponse, error) {
	return unary(ctx, r, g.h.GetConfig)
}

func (g clusterGRPC) ListConfig(ctx context.Context, r *clusterv1.ListConfigRequest) (*clusterv1.ListConfigResponse, error) {
	return unary(ctx, r, g.h.ListConfig)
}

func (g clusterGRPC) SetConfig(ctx context.Context, r *clusterv1.SetConfigRequest) (*clusterv1.SetConfigResponse, error) {
	return unary(ctx, r, g.h.SetConfig)
}

func (g clusterGRPC) DeleteConfig(ctx context.Context, r *clusterv1.DeleteConfigRequest) (*clusterv1.DeleteConfigResponse, error) {
	return unary(ctx, r, g.h.DeleteConfig)
}

func (g clusterGRPC) ForceLeave(ctx context.Context, r *clusterv1.ForceLeaveRequest) (*clusterv1.ForceLeaveResponse, error) {
	return unary(ctx, r, g.h.ForceLeave)
}

func (g clusterGRPC) AutopilotState(ctx context.Context, r *clusterv1.AutopilotStateRequest) (*clusterv1.AutopilotStateResponse, error) {
	return unary(ctx, r, g.h.AutopilotState)
}

func (g clusterGRPC) Keyring(ctx context.Context, r *clusterv1.KeyringRequest) (*clusterv1.KeyringResponse, error) {
	return unary(ctx, r, g.h.Keyring)
}

func (g clusterGRPC) ConfigHistory(ctx context.Context, r *clusterv1.ConfigHistoryRequest) (*clusterv1.ConfigHistoryResponse, error) {
	return unary(ctx, r, g.h.ConfigHistory)
}

// NewNodeGRPC serves h over gRPC.
func NewNodeGRPC(h nodev1connect.NodeServiceHandler) nodev1.NodeServiceServer {
	return nodeGRPC{h}
}

type nodeGRPC struct {
	h nodev1connect.NodeServiceHandler
}

func (g nodeGRPC) Status(ctx context.Context, r *nodev1.StatusRequest) (*nodev1.StatusResponse, error) {
	return unary(ctx, r, g.h.Status)
}

func (g nodeGRPC) ConfigStatus(ctx context.Context, r *nodev1.ConfigStatusRequest) (*nodev1.ConfigStatusResponse, error) {
	return unary(ctx, r, g.h.ConfigStatus)
}

func (g clusterGRPC) CheckAccess(ctx context.Context, r *clusterv1.CheckAccessRequest) (*clusterv1.CheckAccessResponse, error) {
	return unary(ctx, r, g.h.CheckAccess)
}

func (g clusterGRPC) WhoAmI(ctx context.Context, r *clusterv1.WhoAmIRequest) (*clusterv1.WhoAmIResponse, error) {
	return unary(ctx, r, g.h.WhoAmI)
}

func (g clusterGRPC) CheckNetworkPolicy(ctx context.Context, r *clusterv1.CheckNetworkPolicyRequest) (*clusterv1.CheckNetworkPolicyResponse, error) {
	return unary(ctx, r, g.h.CheckNetworkPolicy)
}

func (g clusterGRPC) ConfigStatus(ctx context.Context, r *clusterv1.ConfigStatusRequest) (*clusterv1.ConfigStatusResponse, error) {
	return unary(ctx, r, g.h.ConfigStatus)
}

func (g nodeGRPC) ForceLeave(ctx context.Context, r *nodev1.ForceLeaveRequest) (*nodev1.ForceLeaveResponse, error) {
	return unary(ctx, r, g.h.ForceLeave)
}

func (g nodeGRPC) Keyring(ctx context.Context, r *nodev1.KeyringRequest) (*nodev1.KeyringResponse, error) {
	return unary(ctx, r, g.h.Keyring)
}

func (g nodeGRPC) ReportPlacements(ctx context.Context, r *nodev1.ReportPlacementsRequest) (*nodev1.ReportPlacementsResponse, error) {
	return unary(ctx, r, g.h.ReportPlacements)
}

func (g nodeGRPC) RenewCertificate(ctx context.Context, r *nodev1.RenewCertificateRequest) (*nodev1.RenewCertificateResponse, error) {
	return unary(ctx, r, g.h.RenewCertificate)
}

func (g nodeGRPC) ReadIndex(ctx context.Context, r *nodev1.ReadIndexRequest) (*nodev1.ReadIndexResponse, error) {
	return unary(ctx, r, g.h.ReadIndex)
}

// incomingHeader is the gRPC request metadata as Connect headers.
func incomingHeader(ctx context.Context) http.Header {
	hdr := http.Header{}
	copyIncoming(ctx, hdr)
	return hdr
}

// copyIncoming adds the gRPC request metadata to hdr, binary values
// encoded as Connect encodes them.
func copyIncoming(ctx context.Context, hdr http.Header) {
	md, _ := metadata.FromIncomingContext(ctx)
	for k, vs := range md {
		if skipMetadata(k) {
			continue
		}
		binary := strings.HasSuffix(k, "-bin")
		for _, v := range vs {
			if binary {
				v = connect.EncodeBinaryHeader([]byte(v))
			}
			hdr.Add(k, v)
		}
	}
	if r, ok := observe.RequestFrom(ctx); ok {
		// The call's ID, the caller's or the one the API port made (the
		// incoming metadata holds the caller's only).
		hdr.Set(observe.HeaderRequestID, r.ID)
	}
}

// unary calls a Connect handler method for a gRPC request: the request
// metadata becomes the Connect request's headers, the response headers
// and trailers become gRPC headers and trailers, and a Connect error
// becomes the gRPC status with the same code, message and details, its
// metadata sent as trailers (as connect-go does on its own gRPC path).
func unary[Req, Res any](ctx context.Context, msg *Req, call func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*Res, error) {
	req := connect.NewRequest(msg)
	copyIncoming(ctx, req.Header())
	res, err := call(ctx, req)
	if err != nil {
		return nil, grpcError(ctx, err)
	}
	if md := toMetadata(res.Header()); len(md) > 0 {
		if err := grpc.SetHeader(ctx, md); err != nil {
			return nil, status.Error(status.Code(err), err.Error())
		}
	}
	if md := toMetadata(res.Trailer()); len(md) > 0 {
		if err := grpc.SetTrailer(ctx, md); err != nil {
			return nil, status.Error(status.Code(err), err.Error())
		}
	}
	return res.Msg, nil
}

// skipMetadata reports whether a request metadata key is transport
// detail that grpc-go has already acted on (the handlers read the deadline
// from the context), not something to hand to a handler as a header.
func skipMetadata(k string) bool {
	switch k {
	case "content-type", "user-agent", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding":
		return true
	}
	return strings.HasPrefix(k, ":")
}

// grpcError converts a handler error into a gRPC status error.
func grpcError(ctx context.Context, err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		ce = toConnect(err).(*connect.Error)
	}
	if md := toMetadata(ce.Meta()); len(md) > 0 {
		_ = grpc.SetTrailer(ctx, md)
	}
	st := &spb.Status{Code: int32(ce.Code()), Message: ce.Message()}
	for _, d := range ce.Details() {
		st.Details = append(st.Details, &anypb.Any{
			TypeUrl: "type.googleapis.com/" + d.Type(),
			Value:   d.Bytes(),
		})
	}
	return status.ErrorProto(st)
}

// toMetadata converts HTTP headers to gRPC metadata. Binary ("-bin")
// values, base64 in Connect headers, are decoded: grpc-go encodes them
// again on the wire.
func toMetadata(h http.Header) metadata.MD {
	if len(h) == 0 {
		return nil
	}
	md := make(metadata.MD, len(h))
	for k, vs := range h {
		k = strings.ToLower(k)
		for _, v := range vs {
			if strings.HasSuffix(k, "-bin") {
				b, err := connect.DecodeBinaryHeader(v)
				if err != nil {
					continue
				}
				v = string(b)
			}
			md[k] = append(md[k], v)
		}
	}
	return md
}

// NewScheduleGRPC serves h over gRPC.
func NewScheduleGRPC(h schedulev1connect.ScheduleServiceHandler) schedulev1.ScheduleServiceServer {
	return scheduleGRPC{h}
}

type scheduleGRPC struct {
	h schedulev1connect.ScheduleServiceHandler
}

func (g scheduleGRPC) CreateSchedule(ctx context.Context, r *schedulev1.CreateScheduleRequest) (*schedulev1.CreateScheduleResponse, error) {
	return unary(ctx, r, g.h.CreateSchedule)
}

func (g scheduleGRPC) GetSchedule(ctx context.Context, r *schedulev1.GetScheduleRequest) (*schedulev1.GetScheduleResponse, error) {
	return unary(ctx, r, g.h.GetSchedule)
}

func (g scheduleGRPC) ListSchedules(ctx context.Context, r *schedulev1.ListSchedulesRequest) (*schedulev1.ListSchedulesResponse, error) {
	return unary(ctx, r, g.h.ListSchedules)
}

func (g scheduleGRPC) UpdateSchedule(ctx context.Context, r *schedulev1.UpdateScheduleRequest) (*schedulev1.UpdateScheduleResponse, error) {
	return unary(ctx, r, g.h.UpdateSchedule)
}

func (g scheduleGRPC) DeleteSchedule(ctx context.Context, r *schedulev1.DeleteScheduleRequest) (*schedulev1.DeleteScheduleResponse, error) {
	return unary(ctx, r, g.h.DeleteSchedule)
}

func (g scheduleGRPC) PauseSchedule(ctx context.Context, r *schedulev1.PauseScheduleRequest) (*schedulev1.PauseScheduleResponse, error) {
	return unary(ctx, r, g.h.PauseSchedule)
}

func (g scheduleGRPC) ResumeSchedule(ctx context.Context, r *schedulev1.ResumeScheduleRequest) (*schedulev1.ResumeScheduleResponse, error) {
	return unary(ctx, r, g.h.ResumeSchedule)
}

func (g scheduleGRPC) ListRuns(ctx context.Context, r *schedulev1.ListRunsRequest) (*schedulev1.ListRunsResponse, error) {
	return unary(ctx, r, g.h.ListRuns)
}

func (g scheduleGRPC) NextSlots(ctx context.Context, r *schedulev1.NextSlotsRequest) (*schedulev1.NextSlotsResponse, error) {
	return unary(ctx, r, g.h.NextSlots)
}

func (g clusterGRPC) ClusterVersion(ctx context.Context, r *clusterv1.ClusterVersionRequest) (*clusterv1.ClusterVersionResponse, error) {
	return unary(ctx, r, g.h.ClusterVersion)
}

func (g clusterGRPC) VerifyReplicas(ctx context.Context, r *clusterv1.VerifyReplicasRequest) (*clusterv1.VerifyReplicasResponse, error) {
	return unary(ctx, r, g.h.VerifyReplicas)
}

func (g clusterGRPC) Downgrade(ctx context.Context, r *clusterv1.DowngradeRequest) (*clusterv1.DowngradeResponse, error) {
	return unary(ctx, r, g.h.Downgrade)
}

func (g nodeGRPC) StateHash(ctx context.Context, r *nodev1.StateHashRequest) (*nodev1.StateHashResponse, error) {
	return unary(ctx, r, g.h.StateHash)
}
