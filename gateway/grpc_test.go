package gateway

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
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// fakeCluster answers GetService with headers taken from the request and
// fails RegisterService with a detailed error.
type fakeCluster struct {
	clusterv1connect.UnimplementedClusterServiceHandler
	deadline chan time.Time
}

func (f fakeCluster) GetService(ctx context.Context, r *connect.Request[clusterv1.GetServiceRequest]) (*connect.Response[clusterv1.GetServiceResponse], error) {
	if d, ok := ctx.Deadline(); ok {
		f.deadline <- d
	}
	res := connect.NewResponse(&clusterv1.GetServiceResponse{Instances: []*clusterv1.ServiceInstance{{Service: r.Msg.GetService(), InstanceId: "i-1"}}})
	res.Header().Set(HeaderServedBy, "node-a")
	res.Header().Set("Echo-Request-Id", r.Header().Get("X-Request-Id"))
	res.Header().Set("Echo-Blob-Bin", r.Header().Get("Blob-Bin"))
	res.Trailer().Set("Pivirt-Trailer", "t")
	return res, nil
}

func (fakeCluster) RegisterService(context.Context, *connect.Request[clusterv1.RegisterServiceRequest]) (*connect.Response[clusterv1.RegisterServiceResponse], error) {
	ce := connect.NewError(connect.CodeUnavailable, errors.New("no leader"))
	d, err := connect.NewErrorDetail(&errdetails.RetryInfo{RetryDelay: durationpb.New(250 * time.Millisecond)})
	if err != nil {
		return nil, err
	}
	ce.AddDetail(d)
	ce.Meta().Set(HeaderClientID, "client-1")
	return nil, ce
}

func (fakeCluster) Heartbeat(context.Context, *connect.Request[clusterv1.HeartbeatRequest]) (*connect.Response[clusterv1.HeartbeatResponse], error) {
	// A plain error, not a Connect one: converted by the error table.
	return nil, ErrNoLeader
}

func TestClusterGRPCAdapter(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fake := fakeCluster{deadline: make(chan time.Time, 1)}
	gs := grpc.NewServer()
	clusterv1.RegisterClusterServiceServer(gs, NewClusterGRPC(fake))
	served := make(chan error, 1)
	go func() { served <- gs.Serve(ln) }()
	t.Cleanup(func() {
		gs.Stop()
		<-served
	})
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	client := clusterv1.NewClusterServiceClient(cc)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	want, _ := ctx.Deadline()

	t.Run("headers, trailers, deadline", func(t *testing.T) {
		octx := metadata.AppendToOutgoingContext(ctx, "x-request-id", "req-42", "blob-bin", "\x00\x01raw")
		var hdr, trl metadata.MD
		res, err := client.GetService(octx, &clusterv1.GetServiceRequest{Service: "web"}, grpc.Header(&hdr), grpc.Trailer(&trl))
		if err != nil {
			t.Fatal(err)
		}
		if got := res.GetInstances(); len(got) != 1 || got[0].GetService() != "web" {
			t.Fatalf("instances %v", got)
		}
		for k, v := range map[string]string{"pivirt-served-by": "node-a", "echo-request-id": "req-42"} {
			if got := hdr.Get(k); len(got) != 1 || got[0] != v {
				t.Errorf("header %s = %q, want %q (all: %v)", k, got, v, hdr)
			}
		}
		// The binary header reached the handler base64-encoded, as
		// connect-go presents it, and came back decoded.
		if got := hdr.Get("echo-blob-bin"); len(got) != 1 || got[0] != "\x00\x01raw" {
			t.Errorf("binary header round trip: %q", got)
		}
		if got := trl.Get("pivirt-trailer"); len(got) != 1 || got[0] != "t" {
			t.Errorf("trailer pivirt-trailer = %q (all: %v)", got, trl)
		}
		select {
		case d := <-fake.deadline:
			if diff := d.Sub(want); diff > time.Second || diff < -time.Second {
				t.Errorf("handler deadline %v, client's %v", d, want)
			}
		default:
			t.Error("the handler saw no deadline")
		}
	})

	t.Run("connect error with details and metadata", func(t *testing.T) {
		var trl metadata.MD
		_, err := client.RegisterService(ctx, &clusterv1.RegisterServiceRequest{}, grpc.Trailer(&trl))
		st := status.Convert(err)
		if st.Code() != codes.Unavailable || st.Message() != "no leader" {
			t.Fatalf("status %v %q, want Unavailable \"no leader\"", st.Code(), st.Message())
		}
		details := st.Details()
		if len(details) != 1 {
			t.Fatalf("details %v", details)
		}
		ri, ok := details[0].(*errdetails.RetryInfo)
		if !ok || ri.GetRetryDelay().AsDuration() != 250*time.Millisecond {
			t.Fatalf("detail %T %v", details[0], details[0])
		}
		if got := trl.Get("pivirt-client-id"); len(got) != 1 || got[0] != "client-1" {
			t.Errorf("error metadata as trailer: %v", trl)
		}
	})

	t.Run("plain error goes through the code table", func(t *testing.T) {
		_, err := client.Heartbeat(ctx, &clusterv1.HeartbeatRequest{})
		if got := status.Code(err); got != codes.Unavailable {
			t.Fatalf("code %v (%v), want Unavailable", got, err)
		}
	})

	t.Run("unimplemented method", func(t *testing.T) {
		_, err := client.Members(ctx, &clusterv1.MembersRequest{})
		if got := status.Code(err); got != codes.Unimplemented {
			t.Fatalf("code %v (%v), want Unimplemented", got, err)
		}
	})
}
