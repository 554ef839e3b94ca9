package access

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/mesh"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// fakeStream is a server stream of a client certificate holder: it
// receives the given requests (encoded), then io.EOF, and records what is
// sent.
type fakeStream struct {
	ctx context.Context
	mu  sync.Mutex
	in  [][]byte
	out []*mesh.Frame
}

func newFakeStream(cn string, reqs ...proto.Message) *fakeStream {
	st := tls.ConnectionState{PeerCertificates: []*x509.Certificate{{Subject: pkix.Name{CommonName: cn}}}}
	ctx := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: st}})
	s := &fakeStream{ctx: ctx}
	for _, r := range reqs {
		b, _ := proto.Marshal(r)
		s.in = append(s.in, b)
	}
	return s
}

func (s *fakeStream) Context() context.Context     { return s.ctx }
func (s *fakeStream) SetHeader(metadata.MD) error  { return nil }
func (s *fakeStream) SendHeader(metadata.MD) error { return nil }
func (s *fakeStream) SetTrailer(metadata.MD)       {}
func (s *fakeStream) SendMsg(m any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.out = append(s.out, mesh.NewFrame(append([]byte(nil), m.(*mesh.Frame).Bytes()...)))
	return nil
}

func (s *fakeStream) RecvMsg(m any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.in) == 0 {
		return io.EOF
	}
	m.(*mesh.Frame).Set(mesh.NewFrame(s.in[0]))
	s.in = s.in[1:]
	return nil
}

var _ grpc.ServerStream = (*fakeStream)(nil)

// ownerFetch answers get requests: a1 is alice's, b1 bob's.
func ownerFetch(g *Guard) {
	g.cfg.Fetch = func(_ context.Context, _ protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error) {
		id := req.(*vmv1.GetVMRequest).GetId()
		owner := map[string]string{"a1": "alice", "b1": "bob"}[id]
		return &vmv1.GetVMResponse{Vm: &vmv1.VM{Id: id, Metadata: &apiv1.ObjectMeta{Owner: owner}}}, nil
	}
}

// relay is a handler that reads the client's messages as the proxy does,
// in a goroutine it does not wait for, and reports their errors.
func relay(errs chan<- error) grpc.StreamHandler {
	return func(_ any, ss grpc.ServerStream) error {
		go func() {
			for {
				f := new(mesh.Frame)
				err := ss.RecvMsg(f)
				f.Free()
				if err != nil {
					errs <- err
					return
				}
			}
		}()
		return nil
	}
}

// TestStreamChecks: a console stream is checked on its first message
// before the handler runs, and refused when a later message names another
// VM; a stream without a first message is InvalidArgument. The handler
// returns while its relay still reads (run with -race).
func TestStreamChecks(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	ownerFetch(g)
	interceptor := g.StreamServerInterceptor()
	info := &grpc.StreamServerInfo{FullMethod: "/pivirt.vm.v1.VMService/Console", IsClientStream: true, IsServerStream: true}

	errs := make(chan error, 1)
	s := newFakeStream("alice", &vmv1.ConsoleRequest{Id: "a1"}, &vmv1.ConsoleRequest{Input: []byte("ls\n")}, &vmv1.ConsoleRequest{Id: "b1"})
	if err := interceptor(nil, s, info, relay(errs)); err != nil {
		t.Fatalf("alice's console on her VM: %v", err)
	}
	if err := <-errs; status.Code(err) != codes.PermissionDenied {
		t.Errorf("a later message naming bob's VM: %v, want PermissionDenied", err)
	}

	called := false
	s = newFakeStream("alice", &vmv1.ConsoleRequest{Id: "b1"})
	err := interceptor(nil, s, info, func(any, grpc.ServerStream) error { called = true; return nil })
	if status.Code(err) != codes.PermissionDenied || called {
		t.Errorf("alice's console on bob's VM: %v (handler called %v), want PermissionDenied before the handler", err, called)
	}
	s = newFakeStream("alice")
	if err := interceptor(nil, s, info, relay(errs)); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a console stream without a message: %v, want InvalidArgument", err)
	}
}

// TestStreamFilter: a watch sends alice the events of her VMs only.
func TestStreamFilter(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	info := &grpc.StreamServerInfo{FullMethod: "/pivirt.vm.v1.VMService/WatchVMs", IsServerStream: true}
	s := newFakeStream("alice", &vmv1.WatchVMsRequest{})
	err := g.StreamServerInterceptor()(nil, s, info, func(_ any, ss grpc.ServerStream) error {
		if err := ss.RecvMsg(new(mesh.Frame)); err != nil {
			return err
		}
		for _, owner := range []string{"alice", "bob", "alice"} {
			b, _ := proto.Marshal(&vmv1.WatchVMsResponse{Vm: &vmv1.VM{Id: owner, Metadata: &apiv1.ObjectMeta{Owner: owner}}})
			if err := ss.SendMsg(mesh.NewFrame(b)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.out) != 2 {
		t.Errorf("%d events sent, want alice's 2", len(s.out))
	}
	for _, f := range s.out {
		var ev vmv1.WatchVMsResponse
		if err := proto.Unmarshal(f.Bytes(), &ev); err != nil || ev.GetVm().GetMetadata().GetOwner() != "alice" {
			t.Errorf("event %v (%v)", &ev, err)
		}
	}
}
