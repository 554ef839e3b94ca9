package agent_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	"pilab.hu/pivirt-agent/identity"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/network/v1/networkv1connect"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

// simServer is an in-process pivirtd-sim on a unix socket.
type simServer struct {
	sim  *sim.Simulator
	addr string // unix:///...
	ctl  simv1.SimulatorServiceClient
}

func startSim(t *testing.T, opts ...grpc.ServerOption) *simServer {
	t.Helper()
	return startSimAt(t, "unix://"+filepath.Join(t.TempDir(), "sim.sock"), opts...)
}

// startSimAt serves a simulator at addr (unix:///path or 127.0.0.1:0; the
// returned addr is the one bound).
func startSimAt(t *testing.T, addr string, opts ...grpc.ServerOption) *simServer {
	t.Helper()
	s, err := sim.Open(sim.Config{DataDir: t.TempDir(), Host: "sim-host"})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := sim.Listen(addr)
	if !strings.HasPrefix(addr, "unix://") && err == nil {
		addr = ln.Addr().String()
	}
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(append(s.ServerOptions(), opts...)...)
	s.Register(gs)
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		gs.Stop()
		<-served
		_ = s.Close()
	})
	return &simServer{sim: s, addr: addr, ctl: simv1.NewSimulatorServiceClient(conn)}
}

// withBackends routes the VM API to pivirtd and volumes to iscsiman, both
// served by one simulator at addr that every node shares (scope cluster);
// networks are not routed.
func withBackends(addr string) func(int, *config.Config) {
	return func(_ int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{
			"pivirtd":  {Endpoint: addr, Timeout: config.Duration(10 * time.Second), Scope: config.ScopeCluster},
			"iscsiman": {Endpoint: addr, Scope: config.ScopeCluster},
		}
		cfg.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}},
			{Match: config.RouteMatch{Prefix: "/pivirt.storage.v1.StorageService"}, Route: config.RouteTarget{Cluster: "iscsiman"}},
		}
	}
}

// vmAPI is the VM API through one protocol: the generated gRPC client or a
// Connect client (Connect, JSON or gRPC-Web), behind one interface.
type vmAPI interface {
	create(ctx context.Context, vm *vmv1.VM) (*vmv1.VM, error)
	get(ctx context.Context, id, echo string) (vm *vmv1.VM, header, trailer http.Header, err error)
	watch(ctx context.Context) (recv func() (*vmv1.WatchVMsResponse, error), err error)
	console(ctx context.Context, id string, inputs []string) ([]string, error)
	// consoleOpen opens a console, sends its first request and returns
	// the first answer, the sending side still open (as a terminal's).
	consoleOpen(ctx context.Context, id string) error
}

func (g grpcVM) consoleOpen(ctx context.Context, id string) error {
	s, err := g.c.Console(ctx)
	if err != nil {
		return err
	}
	if err := s.Send(&vmv1.ConsoleRequest{Id: id}); err != nil {
		return err
	}
	_, err = s.Recv()
	return err
}

func (c connectVM) consoleOpen(ctx context.Context, id string) error {
	s := c.c.Console(ctx)
	if err := s.Send(&vmv1.ConsoleRequest{Id: id}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_, err := s.Receive()
	return err
}

type grpcVM struct{ c vmv1.VMServiceClient }

func (g grpcVM) create(ctx context.Context, vm *vmv1.VM) (*vmv1.VM, error) {
	r, err := g.c.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: vm})
	return r.GetVm(), err
}

func (g grpcVM) get(ctx context.Context, id, echo string) (*vmv1.VM, http.Header, http.Header, error) {
	var hdr, trl metadata.MD
	ctx = metadata.AppendToOutgoingContext(ctx, sim.EchoHeader, echo, "authorization", "Bearer secret", "cookie", "session=1")
	r, err := g.c.GetVM(ctx, &vmv1.GetVMRequest{Id: id}, grpc.Header(&hdr), grpc.Trailer(&trl))
	return r.GetVm(), mdHeader(hdr), mdHeader(trl), err
}

func mdHeader(md metadata.MD) http.Header {
	h := http.Header{}
	for k, vs := range md {
		for _, v := range vs {
			h.Add(k, v)
		}
	}
	return h
}

func (g grpcVM) watch(ctx context.Context) (func() (*vmv1.WatchVMsResponse, error), error) {
	s, err := g.c.WatchVMs(ctx, &vmv1.WatchVMsRequest{})
	if err != nil {
		return nil, err
	}
	return s.Recv, nil
}

func (g grpcVM) console(ctx context.Context, id string, inputs []string) ([]string, error) {
	s, err := g.c.Console(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for i, in := range inputs {
		req := &vmv1.ConsoleRequest{Input: []byte(in)}
		if i == 0 {
			req.Id = id
		}
		if err := s.Send(req); err != nil {
			return nil, err
		}
		// The banner comes before the first echo.
		for range 1 + boolInt(i == 0) {
			r, err := s.Recv()
			if err != nil {
				return nil, err
			}
			out = append(out, string(r.GetOutput()))
		}
	}
	return out, s.CloseSend()
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

type connectVM struct{ c vmv1connect.VMServiceClient }

func (c connectVM) create(ctx context.Context, vm *vmv1.VM) (*vmv1.VM, error) {
	r, err := c.c.CreateVM(ctx, connect.NewRequest(&vmv1.CreateVMRequest{Vm: vm}))
	if err != nil {
		return nil, err
	}
	return r.Msg.GetVm(), nil
}

func (c connectVM) get(ctx context.Context, id, echo string) (*vmv1.VM, http.Header, http.Header, error) {
	req := connect.NewRequest(&vmv1.GetVMRequest{Id: id})
	req.Header().Set(sim.EchoHeader, echo)
	req.Header().Set("Authorization", "Bearer secret")
	req.Header().Set("Cookie", "session=1")
	r, err := c.c.GetVM(ctx, req)
	if err != nil {
		var ce *connect.Error
		if errors.As(err, &ce) {
			return nil, ce.Meta(), ce.Meta(), err
		}
		return nil, nil, nil, err
	}
	return r.Msg.GetVm(), r.Header(), r.Trailer(), nil
}

func (c connectVM) watch(ctx context.Context) (func() (*vmv1.WatchVMsResponse, error), error) {
	s, err := c.c.WatchVMs(ctx, connect.NewRequest(&vmv1.WatchVMsRequest{}))
	if err != nil {
		return nil, err
	}
	return func() (*vmv1.WatchVMsResponse, error) {
		if s.Receive() {
			return s.Msg(), nil
		}
		if err := s.Err(); err != nil {
			return nil, err
		}
		return nil, errors.New("watch ended")
	}, nil
}

func (c connectVM) console(ctx context.Context, id string, inputs []string) ([]string, error) {
	s := c.c.Console(ctx)
	var out []string
	for i, in := range inputs {
		req := &vmv1.ConsoleRequest{Input: []byte(in)}
		if i == 0 {
			req.Id = id
		}
		if err := s.Send(req); err != nil {
			return nil, err
		}
		for range 1 + boolInt(i == 0) {
			r, err := s.Receive()
			if err != nil {
				return nil, err
			}
			out = append(out, string(r.GetOutput()))
		}
	}
	if err := s.CloseRequest(); err != nil {
		return nil, err
	}
	return out, s.CloseResponse()
}

// TestGatewayProtocols drives the VM API through an agent to a simulated
// pivirtd with every client protocol: gRPC, Connect (binary and JSON) and
// gRPC-Web; unary, server- and bidi-streaming calls; errors with details,
// headers and trailers; deadlines; unknown services.
func TestGatewayProtocols(t *testing.T) {
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, withBackends(s.addr))
	n := c.WaitLeader(20 * time.Second)
	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// gRPC with the JSON codec: transcoded to proto for the backend.
	jsonConn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(jsonCodec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer jsonConn.Close()
	h2 := agenttest.NewHTTPClient()
	base := "http://" + n.APIAddr()
	protocols := map[string]vmAPI{
		"grpc":             grpcVM{vmv1.NewVMServiceClient(conn)},
		"grpc-json":        grpcVM{vmv1.NewVMServiceClient(jsonConn)},
		"connect":          connectVM{vmv1connect.NewVMServiceClient(h2, base)},
		"connect-json":     connectVM{vmv1connect.NewVMServiceClient(h2, base, connect.WithProtoJSON())},
		"grpc-web":         connectVM{vmv1connect.NewVMServiceClient(h2, base, connect.WithGRPCWeb())},
		"connect-http1.1":  connectVM{vmv1connect.NewVMServiceClient(&http.Client{}, base)},
		"grpc-web-http1.1": connectVM{vmv1connect.NewVMServiceClient(&http.Client{}, base, connect.WithGRPCWeb())},
	}
	for name, api := range protocols {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			vm, err := api.create(ctx, &vmv1.VM{Name: "vm-" + name, Vcpus: 2, MemoryMib: 1024, Metadata: &apiv1.ObjectMeta{Owner: "alice"}})
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			if vm.GetHost() != "sim-host" || vm.GetMetadata().GetOwner() != "alice" {
				t.Errorf("created %v", vm)
			}
			got, hdr, trl, err := api.get(ctx, vm.GetId(), "req-"+name)
			if err != nil || got.GetName() != "vm-"+name {
				t.Fatalf("get: %v, %v", got, err)
			}
			if hdr.Get(sim.EchoHeader) != "req-"+name || trl.Get(sim.EchoHeader+"-trailer") != "req-"+name {
				t.Errorf("header %v, trailer %v: want the echo of the request header in both", hdr, trl)
			}
			// The caller's credentials did not reach the backend.
			keys := strings.Split(hdr.Get(sim.KeysHeader), ",")
			if !slices.Contains(keys, sim.EchoHeader) || slices.Contains(keys, "authorization") || slices.Contains(keys, "cookie") {
				t.Errorf("the backend received the metadata keys %v: want %s, without authorization and cookie", keys, sim.EchoHeader)
			}
			// The caller's deadline (30 s) reached the backend.
			if ms, err := strconv.Atoi(hdr.Get(sim.DeadlineHeader)); err != nil || ms <= 0 || ms > 30_000 {
				t.Errorf("the backend saw deadline %q ms; want the caller's, at most 30000", hdr.Get(sim.DeadlineHeader))
			}

			// An error with details; the trailer comes back too.
			_, _, trl, err = api.get(ctx, "vm-missing", "err-"+name)
			st := toStatus(err)
			if st.Code() != codes.NotFound || !strings.Contains(st.Message(), `vm "vm-missing" not found`) {
				t.Errorf("get missing: %v, want NotFound naming the VM", err)
			}
			if ri := resourceInfo(err); ri == nil || ri.GetResourceName() != "vm-missing" {
				t.Errorf("get missing: details %v, want a ResourceInfo naming vm-missing", st.Details())
			}
			if trl.Get(sim.EchoHeader+"-trailer") != "err-"+name {
				t.Errorf("error trailer %v: want the echo", trl)
			}
			_, err = api.create(ctx, &vmv1.VM{Name: "x", MemoryMib: 1024})
			if st := toStatus(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "vm.vcpus") {
				t.Errorf("invalid create: %v", err)
			}

			// Server streaming.
			wctx, wcancel := context.WithCancel(ctx)
			recv, err := api.watch(wctx)
			if err != nil {
				t.Fatal(err)
			}
			for {
				ev, err := recv()
				if err != nil {
					t.Fatalf("watch: %v", err)
				}
				if ev.GetType() == vmv1.EventType_EVENT_TYPE_EXISTING && ev.GetVm().GetId() == vm.GetId() {
					break
				}
			}
			created, err := api.create(ctx, &vmv1.VM{Name: "watched-" + name, Vcpus: 1, MemoryMib: 64})
			if err != nil {
				t.Fatal(err)
			}
			for {
				ev, err := recv()
				if err != nil {
					t.Fatalf("watch: %v", err)
				}
				if ev.GetType() == vmv1.EventType_EVENT_TYPE_CREATED && ev.GetVm().GetId() == created.GetId() {
					break
				}
			}
			wcancel()

			// Bidi streaming (Connect and gRPC-Web need HTTP/2 for it).
			if strings.HasSuffix(name, "http1.1") {
				return
			}
			// A console the backend refuses at once (the VM is off) is
			// answered while the caller still sends, as a terminal does.
			octx, ocancel := context.WithTimeout(ctx, 10*time.Second)
			err = api.consoleOpen(octx, vm.GetId())
			ocancel()
			if st := toStatus(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "needs it running") {
				t.Errorf("console of a stopped VM, the sending side open: %v, want FailedPrecondition at once", err)
			}
			if _, err := vmv1.NewVMServiceClient(conn).PowerOn(ctx, &vmv1.PowerOnRequest{Id: vm.GetId()}); err != nil {
				t.Fatal(err)
			}
			out, err := api.console(ctx, vm.GetId(), []string{"ls\n", "exit\n"})
			if err != nil {
				t.Fatalf("console: %v", err)
			}
			if len(out) != 3 || !strings.Contains(out[0], "serial console of vm-"+name) || out[1] != "ls\r\nroot@vm-"+name+":~# " || out[2] != "exit\r\nlogout\r\n" {
				t.Errorf("console output %q", out)
			}
		})
	}

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	t.Run("client streaming", func(t *testing.T) {
		vol, err := storagev1.NewStorageServiceClient(conn).CreateVolume(ctx, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "disk", SizeBytes: 1 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		up, err := storagev1.NewStorageServiceClient(conn).UploadVolume(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 4 {
			msg := &storagev1.UploadVolumeRequest{Chunk: make([]byte, 1000)}
			if i == 0 {
				msg.Id = vol.GetVolume().GetId()
			}
			if err := up.Send(msg); err != nil {
				t.Fatal(err)
			}
		}
		res, err := up.CloseAndRecv()
		if err != nil || res.GetVolume().GetWrittenBytes() != 4000 {
			t.Errorf("upload: %v, %v", res, err)
		}
	})

	t.Run("deadline", func(t *testing.T) {
		if _, err := s.ctl.SetFault(ctx, &simv1.SetFaultRequest{Fault: &simv1.Fault{Method: "/pivirt.vm.v1.VMService/ListVMs", Delay: durationpb.New(time.Minute)}}); err != nil {
			t.Fatal(err)
		}
		defer s.ctl.ClearFaults(ctx, &simv1.ClearFaultsRequest{})
		for name, call := range map[string]func(context.Context) error{
			"grpc": func(ctx context.Context) error {
				_, err := vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{})
				return err
			},
			"connect": func(ctx context.Context) error {
				_, err := vmv1connect.NewVMServiceClient(h2, base).ListVMs(ctx, connect.NewRequest(&vmv1.ListVMsRequest{}))
				return err
			},
		} {
			dctx, dcancel := context.WithTimeout(ctx, 300*time.Millisecond)
			start := time.Now()
			err := call(dctx)
			dcancel()
			if toStatus(err).Code() != codes.DeadlineExceeded {
				t.Errorf("%s: %v after %s, want DeadlineExceeded", name, err, time.Since(start))
			}
		}
	})

	t.Run("json to the agent's own API", func(t *testing.T) {
		_, err := clusterv1.NewClusterServiceClient(jsonConn).Leader(ctx, &clusterv1.LeaderRequest{})
		if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "Connect") {
			t.Errorf("the cluster API over gRPC with JSON: %v, want Unimplemented pointing to Connect", err)
		}
		err = conn.Invoke(ctx, "/pivirt.vm.v1.VMService/ListVMs", &vmv1.ListVMsRequest{}, &vmv1.ListVMsResponse{}, grpc.ForceCodecV2(jsonCodec{name: "cbor"}))
		if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "application/grpc+json") {
			t.Errorf("the VM API over gRPC with another codec: %v, want Unimplemented naming the codecs", err)
		}
	})

	t.Run("unrouted", func(t *testing.T) {
		err := conn.Invoke(ctx, "/pivirt.nope.v1.Nope/Call", &vmv1.GetVMRequest{}, &vmv1.GetVMResponse{})
		if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "no routing rule") {
			t.Errorf("unknown service over gRPC: %v", err)
		}
		_, err = networkv1.NewNetworkServiceClient(conn).ListNetworks(ctx, &networkv1.ListNetworksRequest{})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("unrouted NetworkService over gRPC: %v", err)
		}
		_, err = networkv1connect.NewNetworkServiceClient(h2, base).ListNetworks(ctx, connect.NewRequest(&networkv1.ListNetworksRequest{}))
		if connect.CodeOf(err) != connect.CodeUnimplemented {
			t.Errorf("unrouted NetworkService over Connect: %v", err)
		}
	})

	t.Run("health and reflection", func(t *testing.T) {
		h := healthpb.NewHealthClient(conn)
		// The statuses follow the node's state within healthInterval (1 s).
		agenttest.Eventually(t, 10*time.Second, "health statuses", func() error {
			for svc, want := range map[string]codes.Code{"": codes.OK, "pivirt.vm.v1.VMService": codes.OK, "pivirt.cluster.v1.ClusterService": codes.OK, "pivirt.network.v1.NetworkService": codes.NotFound} {
				r, err := h.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
				if status.Code(err) != want || (want == codes.OK && r.GetStatus() != healthpb.HealthCheckResponse_SERVING) {
					return fmt.Errorf("health of %q: %v, %v; want %v (SERVING)", svc, r, err, want)
				}
			}
			return nil
		})
		for name, list := range map[string]func() ([]string, error){
			"v1": func() ([]string, error) {
				s, err := reflectionv1.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
				if err != nil {
					return nil, err
				}
				if err := s.Send(&reflectionv1.ServerReflectionRequest{MessageRequest: &reflectionv1.ServerReflectionRequest_ListServices{}}); err != nil {
					return nil, err
				}
				r, err := s.Recv()
				var out []string
				for _, svc := range r.GetListServicesResponse().GetService() {
					out = append(out, svc.GetName())
				}
				if err == nil {
					err = s.Send(&reflectionv1.ServerReflectionRequest{MessageRequest: &reflectionv1.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "pivirt.vm.v1.VMService"}})
				}
				if err == nil {
					r, err = s.Recv()
					if err == nil && len(r.GetFileDescriptorResponse().GetFileDescriptorProto()) == 0 {
						err = fmt.Errorf("no descriptor for pivirt.vm.v1.VMService: %v", r)
					}
				}
				return out, err
			},
			"v1alpha": func() ([]string, error) { return listServicesV1alpha(ctx, conn) },
		} {
			got, err := list()
			if err != nil {
				t.Fatalf("reflection %s: %v", name, err)
			}
			for _, want := range []string{"pivirt.vm.v1.VMService", "pivirt.storage.v1.StorageService", "pivirt.cluster.v1.ClusterService", "grpc.health.v1.Health"} {
				if !slices.Contains(got, want) {
					t.Errorf("reflection %s lists %v, without %s", name, got, want)
				}
			}
			if slices.Contains(got, "pivirt.network.v1.NetworkService") {
				t.Errorf("reflection %s lists the unrouted NetworkService", name)
			}
		}
	})

	t.Run("message size", func(t *testing.T) {
		big := &vmv1.VM{Name: "big", Vcpus: 1, MemoryMib: 64, Metadata: &apiv1.ObjectMeta{Labels: map[string]string{"blob": strings.Repeat("x", 17<<20)}}}
		_, err := vmv1.NewVMServiceClient(conn).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: big}, grpc.MaxCallSendMsgSize(64<<20))
		if status.Code(err) != codes.ResourceExhausted {
			t.Errorf("a 17 MiB message over gRPC: %v, want ResourceExhausted", err)
		}
		_, err = vmv1connect.NewVMServiceClient(h2, base).CreateVM(ctx, connect.NewRequest(&vmv1.CreateVMRequest{Vm: big}))
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Errorf("a 17 MiB message over Connect: %v, want ResourceExhausted", err)
		}
	})
}

// jsonCodec is a gRPC client codec of protojson, named "json" (the
// content subtype application/grpc+json) unless name is set.
type jsonCodec struct{ name string }

func (c jsonCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, err := protojson.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}

func (c jsonCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return protojson.Unmarshal(data.Materialize(), v.(proto.Message))
}

func (c jsonCodec) Name() string {
	if c.name != "" {
		return c.name
	}
	return "json"
}

// toStatus converts a gRPC or Connect error to a gRPC status.
func toStatus(err error) *status.Status {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return status.New(codes.Code(ce.Code()), ce.Message())
	}
	return status.Convert(err)
}

// resourceInfo returns the ResourceInfo detail of a gRPC or Connect error.
func resourceInfo(err error) *errdetails.ResourceInfo {
	var ce *connect.Error
	if errors.As(err, &ce) {
		for _, d := range ce.Details() {
			if v, err := d.Value(); err == nil {
				if ri, ok := v.(*errdetails.ResourceInfo); ok {
					return ri
				}
			}
		}
		return nil
	}
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.ResourceInfo); ok {
			return ri
		}
	}
	return nil
}

// TestGatewayBackendMTLS: the agent calls a backend that requires client
// certificates with its own agent identity, verifying the backend's
// certificate against backends.<name>.tls.server_name; a wrong name is
// refused and logged.
func TestGatewayBackendMTLS(t *testing.T) {
	dir := testPKI(t, 1)
	chain := filepath.Join(dir, identity.ChainFile)
	backendCert, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "pivirtd.pivirt.internal"})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: backendCert.Cert, KeyFile: backendCert.Key, CAFile: chain})
	if err != nil {
		t.Fatal(err)
	}
	s := startSim(t, grpc.Creds(credentials.NewTLS(src.ServerConfig(tls.RequireAndVerifyClientCert, nil))))

	for name, tc := range map[string]struct {
		serverName string
		ok         bool
	}{
		"right server name": {"pivirtd.pivirt.internal", true},
		"wrong server name": {"iscsiman.pivirt.internal", false},
	} {
		t.Run(name, func(t *testing.T) {
			c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
				withTLS(dir)(i, cfg)
				withBackends(s.addr)(i, cfg)
				b := cfg.Backends["pivirtd"]
				b.TLS = config.BackendTLSConfig{Enabled: true, ServerName: tc.serverName}
				cfg.Backends["pivirtd"] = b
			})
			n := c.WaitLeader(20 * time.Second)
			conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*apiClientCert(t, dir)}})))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			_, err = vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{})
			if tc.ok {
				if err != nil {
					t.Fatalf("ListVMs through mTLS to the backend: %v", err)
				}
				return
			}
			if status.Code(err) != codes.Unavailable {
				t.Errorf("ListVMs to a backend with another name: %v, want Unavailable", err)
			}
			agenttest.Eventually(t, 10*time.Second, "the refusal logged", func() error {
				if !c.Logs().Contains(`not valid for \"iscsiman.pivirt.internal\"`) && !c.Logs().Contains(`not valid for "iscsiman.pivirt.internal"`) {
					return errors.New("no log line names the server name the certificate is not valid for")
				}
				return nil
			})
		})
	}
}

// TestGatewayHTTPSBackendSystemRoots: an https:// backend without a tls
// block (the specification's osinfodb) is reached over TLS verified
// against the system's trust store, without a client certificate: trusted
// when the store holds its CA, refused when it does not. The store is
// SSL_CERT_FILE's, read once per process: each case runs in a child
// process of this test binary.
func TestGatewayHTTPSBackendSystemRoots(t *testing.T) {
	if dir := os.Getenv("PIVIRT_SYSTEM_ROOTS_PKI"); dir != "" {
		httpsBackendChild(t, dir, os.Getenv("PIVIRT_SYSTEM_ROOTS_WANT") == "ok")
		return
	}
	dir := testPKI(t, 1)
	other := testPKI(t, 1) // a CA the backend's certificate does not chain to
	for name, tc := range map[string]struct{ roots, want string }{
		"its CA in the system's store":     {filepath.Join(dir, identity.ChainFile), "ok"},
		"its CA not in the system's store": {filepath.Join(other, identity.ChainFile), "refused"},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestGatewayHTTPSBackendSystemRoots$", "-test.v")
			cmd.Env = append(os.Environ(), "SSL_CERT_FILE="+tc.roots, "SSL_CERT_DIR="+t.TempDir(),
				"PIVIRT_SYSTEM_ROOTS_PKI="+dir, "PIVIRT_SYSTEM_ROOTS_WANT="+tc.want)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("child: %v\n%s", err, out)
			}
		})
	}
}

// httpsBackendChild is a case of TestGatewayHTTPSBackendSystemRoots.
func httpsBackendChild(t *testing.T, dir string, wantOK bool) {
	backendCert, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "osinfodb", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Force: true})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: backendCert.Cert, KeyFile: backendCert.Key, CAFile: filepath.Join(dir, identity.ChainFile)})
	if err != nil {
		t.Fatal(err)
	}
	s := startSimAt(t, "127.0.0.1:0", grpc.Creds(credentials.NewTLS(src.ServerConfig(tls.NoClientCert, nil))))
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		b := cfg.Backends["pivirtd"]
		b.Endpoint = "https://" + s.addr
		cfg.Backends["pivirtd"] = b
	})
	n := c.WaitLeader(20 * time.Second)
	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{})
	switch {
	case wantOK && err != nil:
		t.Fatalf("ListVMs to an https:// backend whose CA the system trusts: %v", err)
	case !wantOK && status.Code(err) != codes.Unavailable:
		t.Fatalf("ListVMs to an https:// backend whose CA the system does not trust: %v, want Unavailable", err)
	}
}

// stats returns how many calls of method the simulator answered and how
// many a fault failed.
func (s *simServer) stats(t *testing.T, method string) (calls, failed uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	st, err := s.ctl.Stats(ctx, &simv1.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return st.GetCalls()[method], st.GetFailed()[method]
}

func (s *simServer) fault(t *testing.T, f *simv1.Fault) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if f == nil {
		if _, err := s.ctl.ClearFaults(ctx, &simv1.ClearFaultsRequest{}); err != nil {
			t.Fatal(err)
		}
		return
	}
	if _, err := s.ctl.SetFault(ctx, &simv1.SetFaultRequest{Fault: f}); err != nil {
		t.Fatal(err)
	}
}

const listVMs = "/pivirt.vm.v1.VMService/ListVMs"

// meshCluster is one agent whose pivirtd backend is registry:///pivirtd-sim,
// fed by three simulators registered in its services registry.
type meshCluster struct {
	node *agenttest.Node
	sims []*simServer
	vm   vmv1.VMServiceClient
}

func startMeshCluster(t *testing.T, mutate func(*config.Config)) *meshCluster {
	t.Helper()
	m := &meshCluster{}
	for range 3 {
		m.sims = append(m.sims, startSimAt(t, "127.0.0.1:0"))
	}
	c := agenttest.NewExpect(t, 1, func(_ int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: "registry:///pivirtd-sim"}}
		cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}}}
		cfg.LoadBalancing.HealthCheck.Enabled = false
		cfg.CircuitBreaking.Enabled = false
		if mutate != nil {
			mutate(cfg)
		}
	})
	m.node = c.WaitLeader(20 * time.Second)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for i, s := range m.sims {
		host, port, _ := strings.Cut(s.addr, ":")
		p, _ := strconv.Atoi(port)
		if _, err := agenttest.Register(ctx, m.node, "pivirtd-sim", fmt.Sprintf("sim-%d", i), host, uint32(p)); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := grpc.NewClient(m.node.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	m.vm = vmv1.NewVMServiceClient(conn)
	agenttest.Eventually(t, 10*time.Second, "calls reach every simulator", func() error {
		m.list(t, 6)
		for i, s := range m.sims {
			if calls, _ := s.stats(t, listVMs); calls == 0 {
				return fmt.Errorf("simulator %d has no calls yet", i)
			}
		}
		return nil
	})
	return m
}

// list makes n ListVMs calls and returns how many failed.
func (m *meshCluster) list(t *testing.T, n int) (failed int) {
	t.Helper()
	for range n {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		if _, err := m.vm.ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
			failed++
		}
		cancel()
	}
	return failed
}

func (m *meshCluster) calls(t *testing.T) []uint64 {
	var out []uint64
	for _, s := range m.sims {
		c, _ := s.stats(t, listVMs)
		out = append(out, c)
	}
	return out
}

func (m *meshCluster) metric(t *testing.T, line string) bool {
	return strings.Contains(httpGet(t, "http://"+m.node.MetricsAddr()+"/metrics"), line)
}

// TestGatewayRegistryEndpoints: a registry:/// backend follows the
// registry live; round robin spreads calls evenly; a deregistered instance
// stops receiving calls.
func TestGatewayRegistryEndpoints(t *testing.T) {
	m := startMeshCluster(t, nil)
	before := m.calls(t)
	if failed := m.list(t, 30); failed != 0 {
		t.Fatalf("%d calls failed", failed)
	}
	after := m.calls(t)
	for i := range m.sims {
		if d := after[i] - before[i]; d != 10 {
			t.Errorf("round robin: simulator %d got %d of 30 calls, want 10 (%v → %v)", i, d, before, after)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := m.node.API.DeregisterService(ctx, connect.NewRequest(&clusterv1.DeregisterServiceRequest{Service: "pivirtd-sim", InstanceId: "sim-2"})); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, 10*time.Second, "the deregistered simulator gets no calls", func() error {
		before := m.calls(t)
		m.list(t, 10)
		if after := m.calls(t); after[2] != before[2] {
			return fmt.Errorf("simulator 2 still got %d calls", after[2]-before[2])
		}
		return nil
	})
}

// TestGatewayOutlierEjection: an endpoint failing consecutive_5xx times in
// a row is ejected for base_ejection_time and comes back; with every
// endpoint failing, max_ejection_percent stops ejections.
func TestGatewayOutlierEjection(t *testing.T) {
	m := startMeshCluster(t, func(cfg *config.Config) {
		cfg.CircuitBreaking.Enabled = true
		cfg.CircuitBreaking.Thresholds = config.CircuitBreakerThresholds{
			Consecutive5xx: 3, Interval: config.Duration(100 * time.Millisecond),
			BaseEjectionTime: config.Duration(2 * time.Second), MaxEjectionPercent: 50,
		}
	})
	m.sims[0].fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Internal), Message: "disk on fire"})
	// Round robin sends every third call to the failing simulator: after
	// its third failure it is out, and calls stop failing.
	m.list(t, 9)
	if !m.metric(t, `pivirt_mesh_endpoints{service="pivirtd",status="ejected"} 1`) {
		t.Fatalf("simulator 0 not ejected after three failures in a row:\n%s", grepLines(httpGet(t, "http://"+m.node.MetricsAddr()+"/metrics"), "pivirt_mesh_endpoints"))
	}
	before := m.calls(t)
	if failed := m.list(t, 20); failed != 0 {
		t.Errorf("%d of 20 calls failed with the failing endpoint ejected", failed)
	}
	if after := m.calls(t); after[0] != before[0] {
		t.Errorf("the ejected simulator got %d calls", after[0]-before[0])
	}
	m.sims[0].fault(t, nil)
	agenttest.Eventually(t, 10*time.Second, "the ejected endpoint back after base_ejection_time", func() error {
		before := m.calls(t)
		m.list(t, 6)
		if after := m.calls(t); after[0] == before[0] {
			return errors.New("simulator 0 still gets no calls")
		}
		return nil
	})

	// Everything fails: no ejection may leave more than half the
	// endpoints out, so with 3 endpoints at most 1 is ejected.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Unavailable)})
	}
	m.list(t, 30)
	if !m.metric(t, `pivirt_mesh_endpoints{service="pivirtd",status="ejected"} 1`) {
		t.Errorf("with every endpoint failing, want exactly 1 of 3 ejected (50%% max):\n%s", grepLines(httpGet(t, "http://"+m.node.MetricsAddr()+"/metrics"), "pivirt_mesh_endpoints"))
	}
}

// TestGatewayStreamsOutliveTheTimeout: backends.<name>.timeout bounds
// unary attempts only; a watch stays open past it, and ending it counts
// nothing against the endpoint.
func TestGatewayStreamsOutliveTheTimeout(t *testing.T) {
	m := startMeshCluster(t, func(cfg *config.Config) {
		b := cfg.Backends["pivirtd"]
		b.Timeout = config.Duration(300 * time.Millisecond)
		cfg.Backends["pivirtd"] = b
		cfg.CircuitBreaking.Enabled = true
		cfg.CircuitBreaking.Thresholds = config.CircuitBreakerThresholds{Consecutive5xx: 1, Interval: config.Duration(time.Second),
			BaseEjectionTime: config.Duration(time.Minute), MaxEjectionPercent: 100}
	})
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	w, err := m.vm.WatchVMs(ctx, &vmv1.WatchVMsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var last error
	for {
		if _, last = w.Recv(); last != nil {
			break
		}
	}
	// The caller's own deadline (1 s) ended the watch, not the 300 ms
	// per-try timeout.
	if st := status.Convert(last); st.Code() != codes.DeadlineExceeded || strings.Contains(st.Message(), "attempt timed out") {
		t.Errorf("watch ended with %v, want the caller's deadline", last)
	}
	if m.metric(t, `pivirt_mesh_endpoints{service="pivirtd",status="ejected"} 1`) {
		t.Error("a watch ended by its caller ejected the endpoint")
	}
}

// TestGatewayRetries: idempotent calls are tried again on another endpoint
// after Unavailable or a per-try timeout, up to max_attempts; others are
// not; the retry budget bounds retries under load.
func TestGatewayRetries(t *testing.T) {
	m := startMeshCluster(t, func(cfg *config.Config) {
		b := cfg.Backends["pivirtd"]
		b.Retry = config.RetryConfig{MaxAttempts: 3, Backoff: config.Duration(5 * time.Millisecond)}
		b.Timeout = config.Duration(300 * time.Millisecond)
		cfg.Backends["pivirtd"] = b
	})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()

	// One endpoint unavailable: every call succeeds.
	m.sims[0].fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Unavailable)})
	if failed := m.list(t, 12); failed != 0 {
		t.Errorf("%d of 12 idempotent calls failed with one endpoint unavailable", failed)
	}
	if _, failed := m.sims[0].stats(t, listVMs); failed == 0 {
		t.Error("the unavailable simulator was never tried")
	}
	m.sims[0].fault(t, nil)

	// A per-try timeout: the slow endpoint's attempt is abandoned.
	m.sims[1].fault(t, &simv1.Fault{Method: listVMs, Delay: durationpb.New(5 * time.Second)})
	if failed := m.list(t, 6); failed != 0 {
		t.Errorf("%d of 6 calls failed with one slow endpoint and a per-try timeout", failed)
	}
	m.sims[1].fault(t, nil)

	// Every endpoint unavailable: exactly max_attempts attempts.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Unavailable)})
	}
	failedBefore := uint64(0)
	for _, s := range m.sims {
		_, f := s.stats(t, listVMs)
		failedBefore += f
	}
	_, err := m.vm.ListVMs(ctx, &vmv1.ListVMsRequest{})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("with every endpoint unavailable: %v", err)
	}
	failedAfter := uint64(0)
	for _, s := range m.sims {
		_, f := s.stats(t, listVMs)
		failedAfter += f
	}
	if d := failedAfter - failedBefore; d != 3 {
		t.Errorf("%d attempts, want max_attempts (3)", d)
	}

	// The caller's deadline ends retrying: an attempt slower than it is
	// the only one.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: listVMs, Delay: durationpb.New(5 * time.Second)})
	}
	before := m.calls(t)
	dctx, dcancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = m.vm.ListVMs(dctx, &vmv1.ListVMsRequest{})
	dcancel()
	attempts := uint64(0)
	for i, c := range m.calls(t) {
		attempts += c - before[i]
	}
	if status.Code(err) != codes.DeadlineExceeded || attempts != 1 {
		t.Errorf("a call whose deadline ends during its first attempt: %v after %d attempts, want DeadlineExceeded after 1", err, attempts)
	}

	// A backend's own DeadlineExceeded is its answer: not retried, its
	// message kept.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.DeadlineExceeded), Message: "libvirt: domain lock wait timed out"})
	}
	before = m.calls(t)
	_, err = m.vm.ListVMs(ctx, &vmv1.ListVMsRequest{})
	attempts = 0
	for i, c := range m.calls(t) {
		attempts += c - before[i]
	}
	if st := status.Convert(err); st.Code() != codes.DeadlineExceeded || st.Message() != "libvirt: domain lock wait timed out" || attempts != 1 {
		t.Errorf("a backend's own DeadlineExceeded: %v after %d attempts, want it unchanged after 1", err, attempts)
	}

	// A create is not idempotent: one attempt.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: "/pivirt.vm.v1.VMService/CreateVM", Code: uint32(codes.Unavailable)})
	}
	_, err = m.vm.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "x", Vcpus: 1, MemoryMib: 64}})
	var creates uint64
	for _, s := range m.sims {
		c, _ := s.stats(t, "/pivirt.vm.v1.VMService/CreateVM")
		creates += c
	}
	if status.Code(err) != codes.Unavailable || creates != 1 {
		t.Errorf("CreateVM with every endpoint unavailable: %v after %d attempts, want Unavailable after 1", err, creates)
	}

	// The budget: 20 concurrent calls that all fail slowly may retry at
	// most max(3, 20%% of 20) at once; without it they would make 60
	// attempts.
	for _, s := range m.sims {
		s.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Unavailable), Delay: durationpb.New(200 * time.Millisecond)})
	}
	var total uint64
	for _, s := range m.sims {
		c, _ := s.stats(t, listVMs)
		total += c
	}
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() { _, _ = m.vm.ListVMs(ctx, &vmv1.ListVMsRequest{}) })
	}
	wg.Wait()
	after := uint64(0)
	for _, s := range m.sims {
		c, _ := s.stats(t, listVMs)
		after += c
	}
	if d := after - total; d < 20 || d > 30 {
		t.Errorf("20 failing calls made %d attempts, want 20 plus a budget-bound few (at most 30)", d)
	}
}

// TestGatewayLeastConnections: with least_connections an endpoint busy with
// a long call gets no new calls while the others are idle.
func TestGatewayLeastConnections(t *testing.T) {
	m := startMeshCluster(t, func(cfg *config.Config) { cfg.LoadBalancing.Policy = "least_connections" })
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// Two watches stay open on two endpoints.
	for range 2 {
		w, err := m.vm.WatchVMs(ctx, &vmv1.WatchVMsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for {
				if _, err := w.Recv(); err != nil {
					return
				}
			}
		}()
	}
	var idle = -1
	agenttest.Eventually(t, 10*time.Second, "two watches open", func() error {
		open := 0
		for i, s := range m.sims {
			if c, _ := s.stats(t, "/pivirt.vm.v1.VMService/WatchVMs"); c > 0 {
				open++
			} else {
				idle = i
			}
		}
		if open != 2 {
			return fmt.Errorf("%d watches reached the simulators", open)
		}
		return nil
	})
	before := m.calls(t)
	if failed := m.list(t, 10); failed != 0 {
		t.Fatalf("%d calls failed", failed)
	}
	after := m.calls(t)
	for i := range m.sims {
		d := after[i] - before[i]
		if i == idle && d != 10 || i != idle && d != 0 {
			t.Errorf("simulator %d (idle: %v) got %d of 10 calls; least_connections sends all to the idle one", i, i == idle, d)
		}
	}
}

// TestGatewayHealthChecks: an endpoint reporting NOT_SERVING for
// unhealthy_threshold checks gets no calls until healthy_threshold checks
// pass again.
func TestGatewayHealthChecks(t *testing.T) {
	m := startMeshCluster(t, func(cfg *config.Config) {
		cfg.LoadBalancing.HealthCheck = config.HealthCheckConfig{Enabled: true, Interval: config.Duration(100 * time.Millisecond),
			Timeout: config.Duration(100 * time.Millisecond), HealthyThreshold: 2, UnhealthyThreshold: 2}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := m.sims[1].ctl.SetServing(ctx, &simv1.SetServingRequest{Serving: false}); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, 10*time.Second, "the NOT_SERVING endpoint out of rotation", func() error {
		if !m.metric(t, `pivirt_mesh_endpoints{service="pivirtd",status="unhealthy"} 1`) {
			return errors.New("no endpoint unhealthy yet")
		}
		return nil
	})
	before := m.calls(t)
	if failed := m.list(t, 10); failed != 0 {
		t.Errorf("%d calls failed", failed)
	}
	if after := m.calls(t); after[1] != before[1] {
		t.Errorf("the unhealthy simulator got %d calls", after[1]-before[1])
	}
	// Every endpoint unhealthy: the VM API reports NOT_SERVING on 8443.
	for _, s := range m.sims {
		if _, err := s.ctl.SetServing(ctx, &simv1.SetServingRequest{Serving: false}); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := grpc.NewClient(m.node.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	agenttest.Eventually(t, 10*time.Second, "VMService NOT_SERVING", func() error {
		r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "pivirt.vm.v1.VMService"})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
			return fmt.Errorf("health %v, %v", r, err)
		}
		return nil
	})
	for _, s := range m.sims {
		if _, err := s.ctl.SetServing(ctx, &simv1.SetServingRequest{Serving: true}); err != nil {
			t.Fatal(err)
		}
	}
	agenttest.Eventually(t, 10*time.Second, "the endpoint back in rotation", func() error {
		before := m.calls(t)
		m.list(t, 6)
		if after := m.calls(t); after[1] == before[1] {
			return errors.New("simulator 1 still gets no calls")
		}
		return nil
	})
}

// TestDescriptorSetRefused: a routing rule's descriptor set that is no
// FileDescriptorSet, or has no service the rule routes, stops the start
// with an error naming the key and what to do.
func TestDescriptorSetRefused(t *testing.T) {
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.binpb")
	if err := os.WriteFile(garbage, []byte("not a descriptor set"), 0o600); err != nil {
		t.Fatal(err)
	}
	wrappers, err := proto.Marshal(&descriptorpb.FileDescriptorSet{File: []*descriptorpb.FileDescriptorProto{protodesc.ToFileDescriptorProto(wrapperspb.File_google_protobuf_wrappers_proto)}})
	if err != nil {
		t.Fatal(err)
	}
	noService := filepath.Join(dir, "wrappers.binpb")
	if err := os.WriteFile(noService, wrappers, 0o600); err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		garbage:   "not a binary FileDescriptorSet (buf build -o FILE.binpb",
		noService: "no service the prefix /acme.echo.v1.Echo routes",
	} {
		cfg := agenttest.Config("node1", filepath.Join(t.TempDir(), "data"))
		cfg.Cluster.Raft.BootstrapExpect = 1
		cfg.Backends = map[string]config.BackendConfig{"echo": {Endpoint: "127.0.0.1:1"}}
		cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/acme.echo.v1.Echo"}, Route: config.RouteTarget{Cluster: "echo", DescriptorSet: file}}}
		a, err := agent.New(cfg, agenttest.Options(nil))
		if err == nil {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			err = a.Start(ctx)
			cancel()
			if err == nil {
				_ = a.Shutdown()
			}
		}
		if err == nil || !strings.Contains(err.Error(), "routing.rules[0].route.descriptor_set") || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming the key and saying %q", filepath.Base(file), err, want)
		}
	}
}

// TestRoutedServiceHealth: a service a rule routes whole, of which the
// agent has no schema, has a grpc.health.v1 status like the built-in
// APIs: SERVING while its backend has an available endpoint; a service
// no rule routes is unknown (NotFound). Server reflection lists and
// describes a routed service whose rule names a descriptor set.
func TestRoutedServiceHealth(t *testing.T) {
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		cfg.Backends["echo"] = config.BackendConfig{Endpoint: s.addr}
		cfg.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}},
			{Match: config.RouteMatch{Prefix: "/acme.echo.v1.Echo"}, Route: config.RouteTarget{Cluster: "echo"}},
			{Match: config.RouteMatch{Prefix: "/acme.echo.v1.Described"}, Route: config.RouteTarget{Cluster: "echo", DescriptorSet: descriptorSet(t, "Described")}},
		}
	})
	n := c.WaitLeader(20 * time.Second)
	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h := healthpb.NewHealthClient(conn)
	agenttest.Eventually(t, 10*time.Second, "the routed service's health", func() error {
		r, err := h.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "acme.echo.v1.Echo"})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return fmt.Errorf("acme.echo.v1.Echo: %v %v, want SERVING", r, err)
		}
		return nil
	})
	if _, err := h.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "acme.other.v1.Nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("an unrouted service: %v, want NotFound", err)
	}
	// Reflection lists and describes the service whose route has a
	// descriptor set (grpcurl list / describe), not the other.
	got, err := listServicesV1alpha(t.Context(), conn)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(got, "acme.echo.v1.Described") || slices.Contains(got, "acme.echo.v1.Echo") {
		t.Errorf("reflection lists %v: want acme.echo.v1.Described, not acme.echo.v1.Echo", got)
	}
	rs, err := reflectionv1.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Send(&reflectionv1.ServerReflectionRequest{MessageRequest: &reflectionv1.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "acme.echo.v1.Described"}}); err != nil {
		t.Fatal(err)
	}
	if r, err := rs.Recv(); err != nil || len(r.GetFileDescriptorResponse().GetFileDescriptorProto()) == 0 {
		t.Errorf("reflection's file of acme.echo.v1.Described: %v %v", r, err)
	}
}

// descriptorSet writes a descriptor set of a service acme.echo.v1.<name>
// of one unary method Call (google.protobuf.StringValue both ways) and
// returns its path.
func descriptorSet(t *testing.T, name string) string {
	t.Helper()
	sv := ".google.protobuf.StringValue"
	fdp := &descriptorpb.FileDescriptorProto{
		Name: proto.String("acme/echo/v1/" + strings.ToLower(name) + ".proto"), Package: proto.String("acme.echo.v1"), Syntax: proto.String("proto3"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String(name), Method: []*descriptorpb.MethodDescriptorProto{
			{Name: proto.String("Call"), InputType: proto.String(sv), OutputType: proto.String(sv)},
		}}},
	}
	b, err := proto.Marshal(&descriptorpb.FileDescriptorSet{File: []*descriptorpb.FileDescriptorProto{fdp}})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), name+".binpb")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
