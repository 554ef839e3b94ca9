package cluster

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// peerServer answers GetService echoing request metadata in its headers
// and fails RegisterService with a detailed status.
type peerServer struct {
	clusterv1.ClusterServiceServer // nil: unimplemented methods panic if called
}

func (peerServer) GetService(ctx context.Context, r *clusterv1.GetServiceRequest) (*clusterv1.GetServiceResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	_ = grpc.SetHeader(ctx, metadata.Pairs("pivirt-index", "42", "echo-request-id", first(md.Get("x-request-id")), "echo-bin", first(md.Get("blob-bin"))))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("pivirt-trailer", "t"))
	return &clusterv1.GetServiceResponse{Instances: []*clusterv1.ServiceInstance{{Service: r.GetService()}}}, nil
}

func (peerServer) RegisterService(ctx context.Context, _ *clusterv1.RegisterServiceRequest) (*clusterv1.RegisterServiceResponse, error) {
	_ = grpc.SetTrailer(ctx, metadata.Pairs("pivirt-client-id", "c-1"))
	st, err := status.New(codes.Unavailable, "not the leader").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Second)})
	if err != nil {
		return nil, err
	}
	return nil, st.Err()
}

type nodeServer struct{}

func (nodeServer) ReadIndex(context.Context, *nodev1.ReadIndexRequest) (*nodev1.ReadIndexResponse, error) {
	return &nodev1.ReadIndexResponse{Index: 99}, nil
}

func (nodeServer) Status(context.Context, *nodev1.StatusRequest) (*nodev1.StatusResponse, error) {
	return &nodev1.StatusResponse{NodeId: "n-1"}, nil
}

func (nodeServer) Keyring(context.Context, *nodev1.KeyringRequest) (*nodev1.KeyringResponse, error) {
	return &nodev1.KeyringResponse{}, nil
}

func (nodeServer) ForceLeave(context.Context, *nodev1.ForceLeaveRequest) (*nodev1.ForceLeaveResponse, error) {
	return nil, status.Error(codes.Unimplemented, "test")
}

func (nodeServer) RenewCertificate(context.Context, *nodev1.RenewCertificateRequest) (*nodev1.RenewCertificateResponse, error) {
	return &nodev1.RenewCertificateResponse{CertPem: []byte("pem")}, nil
}

func (nodeServer) ReportPlacements(context.Context, *nodev1.ReportPlacementsRequest) (*nodev1.ReportPlacementsResponse, error) {
	return &nodev1.ReportPlacementsResponse{}, nil
}

func (nodeServer) ConfigStatus(context.Context, *nodev1.ConfigStatusRequest) (*nodev1.ConfigStatusResponse, error) {
	return nil, status.Error(codes.Unimplemented, "test")
}

func (nodeServer) StateHash(_ context.Context, r *nodev1.StateHashRequest) (*nodev1.StateHashResponse, error) {
	return &nodev1.StateHashResponse{Index: r.GetIndex()}, nil
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

func TestPoolSpeaksGRPCThroughConnectInterfaces(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	clusterv1.RegisterClusterServiceServer(gs, peerServer{})
	nodev1.RegisterNodeServiceServer(gs, nodeServer{})
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	t.Cleanup(func() { gs.Stop(); <-served })

	p := NewPool()
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr := ln.Addr().String()

	req := connect.NewRequest(&clusterv1.GetServiceRequest{Service: "web"})
	req.Header().Set("X-Request-Id", "req-7")
	req.Header().Set("Traceparent", "caf\xc3\xa9") // not ASCII: dropped, the call still goes through
	req.Header().Set("Blob-Bin", connect.EncodeBinaryHeader([]byte{0, 1, 2}))
	res, err := p.Cluster(addr).GetService(ctx, req)
	if err != nil {
		t.Fatalf("GetService: %v", err)
	}
	if got := res.Msg.GetInstances(); len(got) != 1 || got[0].GetService() != "web" {
		t.Fatalf("instances %v", got)
	}
	for k, want := range map[string]string{
		"Pivirt-Index":    "42",
		"Echo-Request-Id": "req-7",
		"Echo-Bin":        connect.EncodeBinaryHeader([]byte{0, 1, 2}),
	} {
		if got := res.Header().Get(k); got != want {
			t.Errorf("header %s = %q, want %q (all %v)", k, got, want, res.Header())
		}
	}
	if got := res.Trailer().Get("Pivirt-Trailer"); got != "t" {
		t.Errorf("trailer = %q (all %v)", got, res.Trailer())
	}

	_, err = p.Cluster(addr).RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{}))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeUnavailable || ce.Message() != "not the leader" {
		t.Fatalf("RegisterService error %v, want Unavailable \"not the leader\"", err)
	}
	if ds := ce.Details(); len(ds) != 1 {
		t.Errorf("details %v", ds)
	} else if v, err := ds[0].Value(); err != nil {
		t.Errorf("detail value: %v", err)
	} else if ri, ok := v.(*errdetails.RetryInfo); !ok || ri.GetRetryDelay().AsDuration() != time.Second {
		t.Errorf("detail %T %v", v, v)
	}
	if got := ce.Meta().Get("Pivirt-Client-Id"); got != "c-1" {
		t.Errorf("error meta %v, want the trailer Pivirt-Client-Id", ce.Meta())
	}

	st, err := p.Node(addr).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{}))
	if err != nil || st.Msg.GetNodeId() != "n-1" {
		t.Fatalf("Status = %v, %v", st, err)
	}
	ri, err := p.Node(addr).ReadIndex(ctx, connect.NewRequest(&nodev1.ReadIndexRequest{}))
	if err != nil || ri.Msg.GetIndex() != 99 {
		t.Fatalf("ReadIndex = %v, %v", ri, err)
	}

	// A peer that is not there: Unavailable, promptly.
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	_ = dead.Close()
	if _, err := p.Node(deadAddr).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{})); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("unreachable peer: %v, want Unavailable", err)
	}

	p.Close()
	if _, err := p.Cluster(addr).GetService(ctx, req); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("after Close: %v, want Unavailable", err)
	}
}
