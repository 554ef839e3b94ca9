package mesh

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// echoService is a backend service no schema of which is linked into the
// gateway: test.echo.v1.Echo, whose messages are google.protobuf.
// StringValue. It answers in the codec it was called with (proto or
// JSON), echoes the caller's x-echo header as a header and a trailer,
// and records what it saw.
const echoService = "test.echo.v1.Echo"

type echoSeen struct {
	contentType, encoding, userAgent, forwardedUserAgent string
}

// jsonCodec is the backend's JSON codec (gRPC's content subtype "json").
type jsonCodec struct{}

func (jsonCodec) Marshal(v any) ([]byte, error)   { return protojson.Marshal(v.(proto.Message)) }
func (jsonCodec) Unmarshal(b []byte, v any) error { return protojson.Unmarshal(b, v.(proto.Message)) }
func (jsonCodec) Name() string                    { return "json" }
func (jsonCodec) String() string                  { return "json" }
func init()                                       { encoding.RegisterCodec(jsonCodec{}) }
func echoValue(s grpc.ServerStream) (string, error) {
	m := new(wrapperspb.StringValue)
	err := s.RecvMsg(m)
	return m.GetValue(), err
}

func startEcho(t *testing.T) (string, chan echoSeen) {
	t.Helper()
	return startEchoWith(t, nil)
}

// startEchoWith starts the echo backend with more services (register).
func startEchoWith(t *testing.T, register func(*grpc.Server)) (string, chan echoSeen) {
	t.Helper()
	seen := make(chan echoSeen, 100)
	record := func(ctx context.Context) {
		md, _ := metadata.FromIncomingContext(ctx)
		st := grpc.ServerTransportStreamFromContext(ctx).(interface{ RecvCompress() string })
		seen <- echoSeen{contentType: strings.Join(md.Get("content-type"), ","), encoding: st.RecvCompress(), userAgent: strings.Join(md.Get("user-agent"), ","),
			forwardedUserAgent: strings.Join(md.Get(ForwardedUserAgentHeader), ",")}
		// As connect-go servers do (grpc-go's do not): the gateway
		// compresses calls to a backend that says it takes them.
		_ = grpc.SetHeader(ctx, metadata.Pairs("grpc-accept-encoding", "gzip"))
		if v := md.Get("x-echo"); len(v) > 0 {
			_ = grpc.SetHeader(ctx, metadata.Pairs("x-echo", v[0]))
			grpc.SetTrailer(ctx, metadata.Pairs("x-echo-trailer", v[0]))
		}
	}
	answer := func(s grpc.ServerStream, v string) error {
		if msg, ok := strings.CutPrefix(v, "error:"); ok {
			st, _ := status.New(codes.FailedPrecondition, msg).WithDetails(&errdetails.ErrorInfo{Reason: "ECHO", Domain: "test"})
			return st.Err()
		}
		return s.SendMsg(wrapperspb.String(v))
	}
	unary := func(_ any, s grpc.ServerStream) error {
		record(s.Context())
		v, err := echoValue(s)
		if err != nil {
			return err
		}
		if d, ok := strings.CutPrefix(v, "sleep:"); ok {
			dd, _ := time.ParseDuration(d)
			select {
			case <-time.After(dd):
			case <-s.Context().Done():
				return status.FromContextError(s.Context().Err()).Err()
			}
		}
		return answer(s, v)
	}
	sd := grpc.ServiceDesc{
		ServiceName: echoService,
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{
			{StreamName: "Unary", Handler: unary},
			{StreamName: "Put", Handler: unary},
			{StreamName: "Count", ServerStreams: true, Handler: func(_ any, s grpc.ServerStream) error {
				record(s.Context())
				v, err := echoValue(s)
				if err != nil {
					return err
				}
				for i := range 3 {
					if err := s.SendMsg(wrapperspb.String(fmt.Sprintf("%s-%d", v, i))); err != nil {
						return err
					}
				}
				if v == "ok" {
					return nil
				}
				return answer(s, "error:"+v)
			}},
			{StreamName: "Join", ClientStreams: true, Handler: func(_ any, s grpc.ServerStream) error {
				record(s.Context())
				var parts []string
				for {
					v, err := echoValue(s)
					if errors.Is(err, io.EOF) {
						return s.SendMsg(wrapperspb.String(strings.Join(parts, "+")))
					}
					if err != nil {
						return err
					}
					parts = append(parts, v)
				}
			}},
			{StreamName: "Chat", ClientStreams: true, ServerStreams: true, Handler: func(_ any, s grpc.ServerStream) error {
				record(s.Context())
				for {
					v, err := echoValue(s)
					if errors.Is(err, io.EOF) {
						return nil
					}
					if err != nil {
						return err
					}
					if err := s.SendMsg(wrapperspb.String("re:" + v)); err != nil {
						return err
					}
				}
			}},
		},
	}
	gs := grpc.NewServer()
	gs.RegisterService(&sd, nil)
	if register != nil {
		register(gs)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return ln.Addr().String(), seen
}

// startBridge serves the bridge and gRPC (for native callers) on one
// h2c server, as the API port does, with a proxy routing the echo
// service to its backend.
func startBridge(t *testing.T, backendAddr string) string {
	t.Helper()
	return startBridgeWith(t, backendAddr, nil)
}

func startBridgeWith(t *testing.T, backendAddr string, schema *Schema) string {
	t.Helper()
	return startBridgeRoute(t, backendAddr, func(b *Backend) Route {
		return Route{Prefix: "/" + echoService, Backend: b, Schema: schema}
	})
}

// startBridgeRoute is startBridge with the echo service's route as route
// makes it.
func startBridgeRoute(t *testing.T, backendAddr string, route func(*Backend) Route) string {
	t.Helper()
	b, err := NewBackend(BackendConfig{Name: "echo", Endpoint: backendAddr, MaxMessageBytes: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	p := NewProxy(nil, nil)
	p.SetRoutes([]Route{route(b)})
	gs := grpc.NewServer(grpc.UnknownServiceHandler(p.Handle), grpc.ForceServerCodecV2(Codec()), grpc.ChainStreamInterceptor(p.TranscodeJSON))
	t.Cleanup(gs.Stop)
	bridge := NewBridge(gs, 1<<20, p)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") && !strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc-web") {
			gs.ServeHTTP(w, r)
			return
		}
		if !IsRPCPath(r.URL.Path) {
			http.NotFound(w, r)
			return
		}
		bridge.ServeHTTP(w, r)
	})
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

func h2cClient() *http.Client {
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: tr}
}

// TestBridgeProtocols calls a service the gateway has no schema of in
// every protocol and codec the bridge speaks, over HTTP/1.1 and HTTP/2:
// the backend sees its caller's codec and compression, and the answer
// (message, headers, trailers, error code, message and details) is the
// backend's.
func TestBridgeProtocols(t *testing.T) {
	backend, seen := startEcho(t)
	base := startBridge(t, backend)
	type variant struct {
		name   string
		client *http.Client
		opts   []connect.ClientOption
		ct     string // the content type the backend must see
		gzip   bool
	}
	var variants []variant
	for _, hv := range []struct {
		name   string
		client *http.Client
	}{{"http1", http.DefaultClient}, {"h2c", h2cClient()}} {
		for _, proto := range []struct {
			name string
			opts []connect.ClientOption
		}{{"connect", nil}, {"grpc-web", []connect.ClientOption{connect.WithGRPCWeb()}}, {"grpc", []connect.ClientOption{connect.WithGRPC()}}} {
			if proto.name == "grpc" && hv.name == "http1" {
				continue
			}
			for _, codec := range []string{"proto", "json"} {
				for _, gz := range []bool{false, true} {
					opts := append([]connect.ClientOption(nil), proto.opts...)
					if codec == "json" {
						opts = append(opts, connect.WithProtoJSON())
					}
					if gz {
						opts = append(opts, connect.WithSendGzip())
					}
					variants = append(variants, variant{
						name: fmt.Sprintf("%s/%s/%s/gzip=%t", hv.name, proto.name, codec, gz), client: hv.client, opts: opts,
						ct: "application/grpc+" + codec, gzip: gz,
					})
				}
			}
		}
	}
	ctx := context.Background()
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			drain(seen)
			unary := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](v.client, base+"/"+echoService+"/Unary", v.opts...)
			req := connect.NewRequest(wrapperspb.String("hello " + strings.Repeat("x", 2000)))
			req.Header().Set("x-echo", "e1")
			resp, err := unary.CallUnary(ctx, req)
			if err != nil {
				t.Fatalf("unary: %v", err)
			}
			if got := resp.Msg.GetValue(); !strings.HasPrefix(got, "hello x") || resp.Header().Get("x-echo") != "e1" || resp.Trailer().Get("x-echo-trailer") != "e1" {
				t.Errorf("unary answered %.20q, header %q, trailer %q", got, resp.Header().Get("x-echo"), resp.Trailer().Get("x-echo-trailer"))
			}
			s := <-seen
			if s.contentType != v.ct || (s.encoding == "gzip") != v.gzip {
				t.Errorf("the backend saw content type %q, compression %q; want %q, gzip %t", s.contentType, s.encoding, v.ct, v.gzip)
			}

			// An error: code, message and details pass.
			_, err = unary.CallUnary(ctx, connect.NewRequest(wrapperspb.String("error:not now")))
			var ce *connect.Error
			if !errors.As(err, &ce) || ce.Code() != connect.CodeFailedPrecondition || ce.Message() != "not now" || len(ce.Details()) != 1 {
				t.Fatalf("error: %v", err)
			}
			if d, err := ce.Details()[0].Value(); err != nil || d.(*errdetails.ErrorInfo).GetReason() != "ECHO" {
				t.Errorf("error detail %v %v", d, err)
			}

			// A server stream that ends with an error after its messages.
			count := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](v.client, base+"/"+echoService+"/Count", v.opts...)
			stream, err := count.CallServerStream(ctx, connect.NewRequest(wrapperspb.String("n")))
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for stream.Receive() {
				got = append(got, stream.Msg().GetValue())
			}
			if strings.Join(got, ",") != "n-0,n-1,n-2" || connect.CodeOf(stream.Err()) != connect.CodeFailedPrecondition {
				t.Errorf("server stream: %v, %v", got, stream.Err())
			}
			stream.Close()

			// A client stream (Connect streaming, gRPC-Web).
			join := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](v.client, base+"/"+echoService+"/Join", v.opts...)
			cs := join.CallClientStream(ctx)
			for _, p := range []string{"a", "b", "c"} {
				if err := cs.Send(wrapperspb.String(p)); err != nil {
					t.Fatal(err)
				}
			}
			if r, err := cs.CloseAndReceive(); err != nil || r.Msg.GetValue() != "a+b+c" {
				t.Errorf("client stream: %v %v", r, err)
			}

			// A bidi stream, full duplex (HTTP/2 only).
			if !strings.HasPrefix(v.name, "http1") {
				chat := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](v.client, base+"/"+echoService+"/Chat", v.opts...)
				bs := chat.CallBidiStream(ctx)
				for _, p := range []string{"x", "y"} {
					if err := bs.Send(wrapperspb.String(p)); err != nil {
						t.Fatal(err)
					}
					if r, err := bs.Receive(); err != nil || r.GetValue() != "re:"+p {
						t.Fatalf("bidi: %v %v", r, err)
					}
				}
				_ = bs.CloseRequest()
				if _, err := bs.Receive(); !errors.Is(err, io.EOF) {
					t.Errorf("bidi end: %v", err)
				}
				_ = bs.CloseResponse()
			}
		})
	}
}

func drain(c chan echoSeen) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}

// TestBridgeConnectGetAndTimeout: a Connect GET is refused without the
// method's schema; a Connect timeout reaches the backend as its deadline.
func TestBridgeConnectGetAndTimeout(t *testing.T) {
	backend, _ := startEcho(t)
	base := startBridge(t, backend)
	ctx := context.Background()
	// Without a schema no method is known to be safe to call by GET (a
	// cross-site link makes one): 405, as Connect answers a GET of a
	// method with side effects; the backend sees nothing.
	get := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](http.DefaultClient, base+"/"+echoService+"/Unary",
		connect.WithHTTPGet(), connect.WithIdempotency(connect.IdempotencyNoSideEffects))
	if _, err := get.CallUnary(ctx, connect.NewRequest(wrapperspb.String("by get"))); err == nil || !strings.Contains(err.Error(), "405") {
		t.Fatalf("a GET without a schema: %v, want 405", err)
	}
	unary := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](http.DefaultClient, base+"/"+echoService+"/Unary")
	tctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err := unary.CallUnary(tctx, connect.NewRequest(wrapperspb.String("sleep:20s")))
	if connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Fatalf("a call past its Connect timeout: %v", err)
	}
}

// TestBridgeRefusals: what is no call of a protocol the bridge speaks is
// answered with the HTTP status Connect clients expect and a message that
// names what is served; an unrouted method is Connect's 404.
func TestBridgeRefusals(t *testing.T) {
	backend, _ := startEcho(t)
	base := startBridge(t, backend)
	for _, tc := range []struct {
		method, path, ct string
		want             int
		body             string
	}{
		{"POST", "/" + echoService + "/Unary", "image/jpeg", http.StatusUnsupportedMediaType, "application/connect+proto"},
		{"POST", "/" + echoService + "/Unary", "application/foo", http.StatusUnsupportedMediaType, "application/grpc-web+proto"},
		{"POST", "/" + echoService + "/Unary", "application/grpc-web+foo", http.StatusUnsupportedMediaType, "gRPC-Web"},
		{"DELETE", "/" + echoService + "/Unary", "application/proto", http.StatusMethodNotAllowed, "POST"},
		{"POST", "/test.other.v1.Nope/Call", "application/proto", http.StatusNotFound, "no routing rule"},
		{"POST", "/not-a-method", "application/proto", http.StatusNotFound, ""},
	} {
		req, _ := http.NewRequest(tc.method, base+tc.path, strings.NewReader(""))
		req.Header.Set("Content-Type", tc.ct)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want || !strings.Contains(string(b), tc.body) {
			t.Errorf("%s %s (%s): %d %q, want %d with %q", tc.method, tc.path, tc.ct, resp.StatusCode, b, tc.want, tc.body)
		}
	}
	// A Connect unary body over the limit: resource_exhausted, unread.
	req, _ := http.NewRequest("POST", base+"/"+echoService+"/Unary", bytes.NewReader(make([]byte, 2<<20)))
	req.Header.Set("Content-Type", "application/proto")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(b), "resource_exhausted") {
		t.Errorf("an oversized unary body: %d %s", resp.StatusCode, b)
	}
}

// TestBridgeGRPCWebText: gRPC-Web's text form (base64, as browsers'
// grpc-web clients send it) in both directions.
func TestBridgeGRPCWebText(t *testing.T) {
	backend, _ := startEcho(t)
	base := startBridge(t, backend)
	msg, _ := proto.Marshal(wrapperspb.String("in text"))
	env := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(env[1:], uint32(len(msg)))
	env = append(env, msg...)
	// Two chunks, each with its own padding, as a streaming encoder sends.
	body := base64.StdEncoding.EncodeToString(env[:4]) + base64.StdEncoding.EncodeToString(env[4:])
	req, _ := http.NewRequest("POST", base+"/"+echoService+"/Unary", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/grpc-web-text+proto")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	dec, err := (&base64Reader{r: bytes.NewReader(raw)}).readAll()
	if err != nil {
		t.Fatalf("answer %q: %v", raw, err)
	}
	if len(dec) < 5 {
		t.Fatalf("answer %q", dec)
	}
	n := binary.BigEndian.Uint32(dec[1:5])
	var got wrapperspb.StringValue
	if err := proto.Unmarshal(dec[5:5+n], &got); err != nil || got.GetValue() != "in text" {
		t.Fatalf("message %v %v", &got, err)
	}
	trailer := dec[5+n:]
	if len(trailer) < 5 || trailer[0] != flagGRPCWebTrailers || !strings.Contains(string(trailer[5:]), "grpc-status: 0") {
		t.Errorf("trailer frame %q", trailer)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/grpc-web-text+proto" {
		t.Errorf("content type %q", ct)
	}
}

func (d *base64Reader) readAll() ([]byte, error) { return io.ReadAll(d) }

// echoSchema writes a descriptor set of the echo service (Unary marked
// idempotent) and loads it for its route.
func echoSchema(t *testing.T) *Schema {
	t.Helper()
	sv := ".google.protobuf.StringValue"
	m := func(name string, cs, ss bool) *descriptorpb.MethodDescriptorProto {
		return &descriptorpb.MethodDescriptorProto{Name: proto.String(name), InputType: proto.String(sv), OutputType: proto.String(sv),
			ClientStreaming: proto.Bool(cs), ServerStreaming: proto.Bool(ss)}
	}
	unary := m("Unary", false, false)
	unary.Options = &descriptorpb.MethodOptions{IdempotencyLevel: descriptorpb.MethodOptions_NO_SIDE_EFFECTS.Enum()}
	fdp := &descriptorpb.FileDescriptorProto{
		Name: proto.String("test/echo/v1/echo.proto"), Package: proto.String("test.echo.v1"), Syntax: proto.String("proto3"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String("Echo"), Method: []*descriptorpb.MethodDescriptorProto{
			unary, m("Put", false, false), m("Count", false, true), m("Join", true, false), m("Chat", true, true),
		}}},
	}
	set := &descriptorpb.FileDescriptorSet{File: []*descriptorpb.FileDescriptorProto{protodesc.ToFileDescriptorProto(wrapperspb.File_google_protobuf_wrappers_proto), fdp}}
	b, err := proto.Marshal(set)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "echo.binpb")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := LoadSchema(path, "/"+echoService)
	if err != nil {
		t.Fatal(err)
	}
	// A set without the file it imports, or a prefix it has no service
	// of, is refused naming what is wrong.
	noWrappers, _ := proto.Marshal(&descriptorpb.FileDescriptorSet{File: []*descriptorpb.FileDescriptorProto{fdp}})
	bad := filepath.Join(t.TempDir(), "bad.binpb")
	if err := os.WriteFile(bad, noWrappers, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadSchema(bad, "/"+echoService); err != nil {
		// wrappers.proto is linked into the program: found there.
		t.Errorf("a set importing a linked proto: %v", err)
	}
	if _, err := LoadSchema(path, "/test.other.v1.Svc"); err == nil || !strings.Contains(err.Error(), "test.echo.v1.Echo") {
		t.Errorf("a prefix the set has no service of: %v", err)
	}
	if _, err := LoadSchema(filepath.Join(t.TempDir(), "none.binpb"), "/x.Y"); err == nil {
		t.Error("a missing file was loaded")
	}
	return s
}

// TestBridgeWithSchema: with the descriptor set its route names, a
// routed service's JSON callers (Connect, gRPC-Web, gRPC) reach the
// backend in proto, and Connect GET is served for its idempotent methods
// only.
func TestBridgeWithSchema(t *testing.T) {
	schema := echoSchema(t)
	t.Run("descriptor set", func(t *testing.T) {
		backend, seen := startEcho(t)
		testBridgeWithSchema(t, startBridgeWith(t, backend, schema), seen)
	})
	t.Run("server reflection", func(t *testing.T) {
		backend, seen := startEchoWith(t, func(gs *grpc.Server) {
			reflectionv1.RegisterServerReflectionServer(gs, reflection.NewServerV1(reflection.ServerOptions{
				Services: gs, DescriptorResolver: chainResolver{schema.Files(), protoregistry.GlobalFiles}, ExtensionResolver: protoregistry.GlobalTypes,
			}))
		})
		var r *Reflector
		base := startBridgeRoute(t, backend, func(b *Backend) Route {
			r = NewReflector(b, "/"+echoService, nil)
			return Route{Prefix: "/" + echoService, Backend: b, Reflector: r}
		})
		testBridgeWithSchema(t, base, seen)
		if s := r.Cached(); s == nil || s.Path() != "reflection of backends.echo" || strings.Join(s.Services(), ",") != echoService {
			t.Errorf("learned schema: %v", s)
		}
	})
	t.Run("a backend without reflection", func(t *testing.T) {
		backend, seen := startEcho(t)
		var r *Reflector
		base := startBridgeRoute(t, backend, func(b *Backend) Route {
			r = NewReflector(b, "/"+echoService, nil)
			return Route{Prefix: "/" + echoService, Backend: b, Reflector: r}
		})
		// No schema: JSON reaches the backend as JSON, and Connect GET
		// is refused.
		c := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](h2cClient(), base+"/"+echoService+"/Unary", connect.WithProtoJSON())
		if resp, err := c.CallUnary(context.Background(), connect.NewRequest(wrapperspb.String("x"))); err != nil || resp.Msg.GetValue() != "x" {
			t.Errorf("a JSON call without a schema: %v %v", resp, err)
		}
		if s := <-seen; s.contentType != "application/grpc+json" {
			t.Errorf("the backend saw %q, want JSON", s.contentType)
		}
		r.wait()
		if r.Cached() != nil {
			t.Error("a schema from a backend without reflection")
		}
		get := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](http.DefaultClient, base+"/"+echoService+"/Unary",
			connect.WithHTTPGet(), connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithProtoJSON())
		if _, err := get.CallUnary(context.Background(), connect.NewRequest(wrapperspb.String("x"))); err == nil || !strings.Contains(err.Error(), "405") {
			t.Errorf("Connect GET without a schema: %v, want HTTP 405", err)
		}
	})
}

func testBridgeWithSchema(t *testing.T, base string, seen chan echoSeen) {
	ctx := context.Background()
	for name, opts := range map[string][]connect.ClientOption{
		"connect":  {connect.WithProtoJSON()},
		"grpc-web": {connect.WithGRPCWeb(), connect.WithProtoJSON()},
		"grpc":     {connect.WithGRPC(), connect.WithProtoJSON()},
		"proto":    nil,
		// Compressed JSON is decompressed, transcoded and sent on
		// compressed.
		"connect gzip":  {connect.WithProtoJSON(), connect.WithSendGzip()},
		"grpc-web gzip": {connect.WithGRPCWeb(), connect.WithProtoJSON(), connect.WithSendGzip()},
		"grpc gzip":     {connect.WithGRPC(), connect.WithProtoJSON(), connect.WithSendGzip()},
	} {
		drain(seen)
		c := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](h2cClient(), base+"/"+echoService+"/Unary", opts...)
		resp, err := c.CallUnary(ctx, connect.NewRequest(wrapperspb.String("json in")))
		if err != nil || resp.Msg.GetValue() != "json in" {
			t.Fatalf("%s: %v %v", name, resp, err)
		}
		s := <-seen
		if s.contentType != "application/grpc+proto" {
			t.Errorf("%s: the backend saw %q, want proto", name, s.contentType)
		}
		if !strings.Contains(s.forwardedUserAgent, "connect/1.") && !strings.HasPrefix(s.forwardedUserAgent, "connect-go/") {
			t.Errorf("%s: the backend saw the caller's user agent %q, want connect-go's", name, s.forwardedUserAgent)
		}
		count := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](h2cClient(), base+"/"+echoService+"/Count", opts...)
		st, err := count.CallServerStream(ctx, connect.NewRequest(wrapperspb.String("j")))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for st.Receive() {
			n++
		}
		if n != 3 || connect.CodeOf(st.Err()) != connect.CodeFailedPrecondition {
			t.Errorf("%s: server stream: %d messages, %v", name, n, st.Err())
		}
		st.Close()
	}
	get := func(method string) (*connect.Response[wrapperspb.StringValue], error) {
		c := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](http.DefaultClient, base+"/"+echoService+"/"+method,
			connect.WithHTTPGet(), connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithProtoJSON())
		return c.CallUnary(ctx, connect.NewRequest(wrapperspb.String("by get")))
	}
	if resp, err := get("Unary"); err != nil || resp.Msg.GetValue() != "by get" {
		t.Errorf("GET of an idempotent method: %v %v", resp, err)
	}
	if _, err := get("Put"); err == nil {
		t.Error("GET of a method with side effects was served")
	}
}

// TestBridgeBadRequests: what grpc-go would refuse with a bare HTTP error
// (a bad grpc-timeout, binary metadata that is not base64) is answered
// in the caller's protocol; a Connect unary call of a streaming method is
// Unimplemented.
func TestBridgeBadRequests(t *testing.T) {
	backend, _ := startEcho(t)
	base := startBridge(t, backend)
	ctx := context.Background()
	post := func(path, ct string, hdr map[string]string, body io.Reader) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "POST", base+path, body)
		req.Header.Set("Content-Type", ct)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, b
	}
	msg, _ := proto.Marshal(wrapperspb.String("x"))
	env := append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)
	resp, _ := post("/"+echoService+"/Unary", "application/grpc-web+proto", map[string]string{"Grpc-Timeout": "soon"}, bytes.NewReader(env))
	if resp.Header.Get("Grpc-Status") != "3" || !strings.Contains(resp.Header.Get("Grpc-Message"), "grpc-timeout") {
		t.Errorf("a bad grpc-timeout: status %q %q, want 3 naming grpc-timeout", resp.Header.Get("Grpc-Status"), resp.Header.Get("Grpc-Message"))
	}
	resp, b := post("/"+echoService+"/Unary", "application/proto", map[string]string{"X-Thing-Bin": "%%%"}, bytes.NewReader(msg))
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "invalid_argument") {
		t.Errorf("binary metadata that is not base64: %d %s, want 400 invalid_argument", resp.StatusCode, b)
	}
	okMsg, _ := proto.Marshal(wrapperspb.String("ok"))
	resp, b = post("/"+echoService+"/Count", "application/proto", nil, bytes.NewReader(okMsg))
	if resp.StatusCode != http.StatusNotImplemented || !strings.Contains(string(b), "more than one") {
		t.Errorf("a Connect unary call of a server stream: %d %s, want 501", resp.StatusCode, b)
	}

}
