package access

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/gateway/observe"
)

// The codes a guard answers with (gRPC and Connect share the numbers).
const (
	codeUnauthenticated   = codes.Unauthenticated
	codePermissionDenied  = codes.PermissionDenied
	codeResourceExhausted = codes.ResourceExhausted
	codeInvalidArgument   = codes.InvalidArgument
)

// denial is a refused call; retry, when set, is the hint of a rate limit.
type denial struct {
	code  codes.Code
	msg   string
	retry time.Duration
}

func (d *denial) Error() string { return d.msg }

func (d *denial) retryInfo() *errdetails.RetryInfo {
	if d.retry <= 0 {
		return nil
	}
	return &errdetails.RetryInfo{RetryDelay: durationpb.New(d.retry)}
}

// grpcError is err as a gRPC status.
func grpcError(err error) error {
	var d *denial
	if !errors.As(err, &d) {
		return err
	}
	st := status.New(d.code, d.msg)
	if ri := d.retryInfo(); ri != nil {
		if withInfo, err := st.WithDetails(ri); err == nil {
			st = withInfo
		}
	}
	return st.Err()
}

// withheld is the error a caller whose access is limited by conditions
// gets for a backend's err: the code stays, but the message and details of
// the codes whose text may describe objects of others (an update that
// renames a VM to a name taken: `vm named "x" already exists (vm-…)`)
// are replaced. The codes about the request itself, the object's own state
// (FailedPrecondition: "it is stopped"), the transport and the guard's own
// refusals pass unchanged.
func withheld(gr *grant, err error) error {
	if err == nil || gr == nil || !gr.conditional() {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	switch st.Code() {
	case codes.AlreadyExists, codes.NotFound, codes.Aborted, codes.Internal, codes.Unknown, codes.DataLoss:
		return status.Errorf(st.Code(), "the backend refused the call (%s); its message is withheld from callers whose access the RBAC policy limits to some objects (it may describe others')", st.Code())
	}
	return err
}

// connectError is err as a Connect error.
func connectError(err error) error {
	var d *denial
	if !errors.As(err, &d) {
		return err
	}
	ce := connect.NewError(connect.Code(d.code), errors.New(d.msg))
	if ri := d.retryInfo(); ri != nil {
		if detail, err := connect.NewErrorDetail(ri); err == nil {
			ce.AddDetail(detail)
		}
		ce.Meta().Set("Retry-After", fmt.Sprint(max(1, int((d.retry+time.Second-1)/time.Second))))
	}
	return ce
}

// fetchError is the answer when the object a request names cannot be read.
func fetchError(err error, resource, id string) error {
	switch c := status.Code(err); c {
	case codes.NotFound, codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated:
		return &denial{code: c, msg: fmt.Sprintf("%s %s: %s", resource, id, status.Convert(err).Message())}
	case codes.Canceled, codes.DeadlineExceeded:
		return &denial{code: c, msg: fmt.Sprintf("reading %s %s to check the RBAC conditions: %s", resource, id, status.Convert(err).Message())}
	}
	return &denial{code: codes.Unavailable, msg: fmt.Sprintf("cannot read %s %s to check the RBAC conditions: %s", resource, id, status.Convert(err).Message())}
}

// noRequest is the answer to a stream that ends before its first message.
func noRequest(gr *grant) error {
	if f := gr.m.rule.GetIdField(); f != "" {
		return &denial{code: codeInvalidArgument, msg: fmt.Sprintf("no request message (%s is required)", f)}
	}
	return &denial{code: codeInvalidArgument, msg: "no request message"}
}

// TapHandle authenticates a grpc-go call from its headers and the
// connection's TLS state before anything of its body is read or decoded
// (grpc.InTapHandle): a call without valid credentials is answered
// Unauthenticated (or ResourceExhausted past the source's
// failed-authentication budget) and its stream reset, whatever it was
// about to send. The interceptors then take the caller from the context.
// grpc-go runs the tap in the connection's reader with its lock held: a
// verification that must fetch the issuer's keys (an unknown key ID, at
// most once per 30 s) holds that one connection meanwhile.
func (g *Guard) TapHandle(ctx context.Context, info *tap.Info) (context.Context, error) {
	m := g.lookup(info.FullMethodName)
	c := call{procedure: info.FullMethodName, tls: g.connState(ctx)}
	if v := info.Header["authorization"]; len(v) > 0 {
		c.authorization = v[0]
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		c.remote = p.Addr.String()
	}
	if !m.open {
		who, err := g.authenticate(ctx, c)
		if err != nil {
			return nil, grpcError(err)
		}
		ctx = withPreAuth(ctx, c.procedure, who)
	}
	return g.armBodyTimer(ctx, c, m), nil
}

// Authenticated authenticates the calls h serves (Connect, gRPC-Web and
// the transcoded proxied APIs on the API port's HTTP side) from their
// headers and the connection's TLS state before anything of their body is
// read: a call without valid credentials gets its protocol's error and
// its body stays unread. The interceptors then take the caller from the
// request's context.
func (g *Guard) Authenticated(h http.Handler) http.Handler {
	errs := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		procedure := r.URL.Path
		m := g.lookup(procedure)
		c := call{procedure: procedure, authorization: r.Header.Get("Authorization"), tls: g.connState(r.Context()), remote: r.RemoteAddr}
		if rq, ok := observe.RequestFrom(r.Context()); ok {
			c.requestID = rq.ID
		}
		r = g.setBodyDeadline(w, r, c, m)
		if m.open {
			h.ServeHTTP(w, r)
			return
		}
		who, err := g.authenticate(r.Context(), c)
		if err != nil {
			if r.ProtoMajor == 1 {
				// Else net/http reads up to 256 KiB of the body before it
				// answers, for the next request on the connection.
				w.Header().Set("Connection", "close")
			}
			_ = errs.Write(w, r, connectError(err))
			return
		}
		h.ServeHTTP(w, r.WithContext(withPreAuth(r.Context(), procedure, who)))
	})
}

// connState is the TLS state of the connection of a request.
func (g *Guard) connState(ctx context.Context) *tls.ConnectionState {
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok {
			return &info.State
		}
	}
	if g.cfg.ConnState != nil {
		if st, ok := g.cfg.ConnState(ctx); ok {
			return st
		}
	}
	return nil
}

// grpcCall describes the start of a grpc-go call.
func (g *Guard) grpcCall(ctx context.Context, fullMethod string) call {
	c := call{procedure: fullMethod, tls: g.connState(ctx), via: ViaFrom(ctx)}
	if r, ok := observe.RequestFrom(ctx); ok {
		c.requestID = r.ID
	}
	if v := metadata.ValueFromIncomingContext(ctx, "authorization"); len(v) > 0 {
		c.authorization = v[0]
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		c.remote = p.Addr.String()
	}
	return c
}

// checkUnary checks a unary request before the handler runs.
func (g *Guard) checkUnary(ctx context.Context, c call, gr *grant, req protoreflect.Message) error {
	switch {
	case gr.checksRequest():
		return g.checkRequest(ctx, c, gr, req)
	case gr.filters():
		return g.openPageToken(gr, req)
	}
	return nil
}

func protoOf(v any) protoreflect.Message {
	if m, ok := v.(proto.Message); ok {
		return m.ProtoReflect()
	}
	return nil
}

// UnaryServerInterceptor guards the unary methods a grpc-go server serves
// itself.
func (g *Guard) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		bodyArrived(ctx) // grpc-go decoded the request before calling us
		c := g.grpcCall(ctx, info.FullMethod)
		msg := protoOf(req)
		ctx, gr, err := g.admit(ctx, c, msg)
		if err != nil {
			return nil, grpcError(err)
		}
		if gr.checksRequest() || gr.filters() {
			if msg == nil {
				return nil, status.Errorf(codes.Internal, "request of %s is not a protobuf message", info.FullMethod)
			}
			if err := g.checkUnary(ctx, c, gr, msg); err != nil {
				return nil, grpcError(err)
			}
		}
		resp, err := handler(ctx, req)
		if err == nil && gr.filters() {
			if m := protoOf(resp); m == nil || !g.filterResponse(gr, m) {
				return nil, status.Errorf(codes.PermissionDenied, "%s: the response does not meet the RBAC policy's conditions", info.FullMethod)
			}
		}
		return resp, err
	}
}

// StreamServerInterceptor guards the streaming methods of a grpc-go server
// and every call of its UnknownServiceHandler (the proxy).
func (g *Guard) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		c := g.grpcCall(ss.Context(), info.FullMethod)
		c.readsFirst = true
		ctx, gr, err := g.admit(ss.Context(), c, nil)
		if err != nil {
			return grpcError(err)
		}
		release, err := g.holdStream(ctx, c)
		if err != nil {
			return grpcError(err)
		}
		defer release()
		ctx, cancel := untilExpiry(ctx)
		defer cancel()
		if gr.filters() {
			// A list merged from every node is paged over the caller's
			// objects alone.
			ctx = mesh.WithItemFilter(ctx, gr.d.Object)
		}
		w := &guardedStream{ServerStream: ss, ctx: ctx, g: g, c: c, gr: gr}
		// The method's own shape, not info's: grpc-go reports every call of
		// the UnknownServiceHandler (the proxy) as a bidi stream, so a
		// proxied list would skip its page token's check.
		if gr.checksRequest() || (gr.filters() && !gr.m.md.IsStreamingClient()) || (gr != nil && gr.auditPending) {
			// The first request message names the object (or carries the
			// page token): read and check it before the handler (or the
			// backend) sees anything.
			f := new(mesh.Frame)
			if err := ss.RecvMsg(f); err != nil {
				if errors.Is(err, io.EOF) {
					return grpcError(noRequest(gr))
				}
				return err
			}
			bodyArrived(ctx)
			req := newMessage(gr.m.md.Input())
			err := proto.Unmarshal(f.Bytes(), req.Interface())
			f.Free()
			if err != nil {
				return status.Errorf(codes.InvalidArgument, "request of %s: %v", info.FullMethod, err)
			}
			if err := g.checkUnary(ctx, c, gr, req); err != nil {
				return grpcError(err)
			}
			if gr.auditPending {
				g.allowed(c, gr, objectName(gr.m, req))
			}
			b, err := proto.Marshal(req.Interface())
			if err != nil {
				return status.Errorf(codes.Internal, "request of %s: %v", info.FullMethod, err)
			}
			w.firstID, _ = authz.FieldString(req, gr.m.rule.GetIdField())
			w.first.Store(mesh.NewFrame(b))
		}
		err = handler(srv, w)
		// The proxy may still be relaying client messages in a goroutine
		// of its own: take the frame, never free it twice.
		if f := w.first.Swap(nil); f != nil {
			f.Free()
		}
		if tokenExpired(ctx) {
			return status.Error(codes.Unauthenticated, ErrTokenExpired.Error())
		}
		return withheld(gr, err)
	}
}

// guardedStream carries the principal in its context, hands the handler
// the first message (checked), checks that later messages of a stream
// name the same object, and filters responses.
type guardedStream struct {
	grpc.ServerStream
	ctx     context.Context
	g       *Guard
	c       call
	gr      *grant
	first   atomic.Pointer[mesh.Frame]
	firstID string
}

func (s *guardedStream) Context() context.Context { return s.ctx }

func (s *guardedStream) RecvMsg(m any) error {
	if f := s.first.Swap(nil); f != nil {
		switch v := m.(type) {
		case *mesh.Frame:
			v.Set(f)
			return nil
		case proto.Message:
			defer f.Free()
			return proto.Unmarshal(f.Bytes(), v)
		}
		f.Free()
		return status.Errorf(codes.Internal, "cannot receive a request into %T", m)
	}
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	bodyArrived(s.ctx)
	if s.gr.checksRequest() && s.gr.m.md.IsStreamingClient() {
		return grpcError(s.sameObject(m))
	}
	return nil
}

// sameObject refuses a later message of a client stream that names
// another object than the first (checked) one.
func (s *guardedStream) sameObject(m any) error {
	var msg protoreflect.Message
	switch v := m.(type) {
	case *mesh.Frame:
		msg = newMessage(s.gr.m.md.Input())
		if err := proto.Unmarshal(v.Bytes(), msg.Interface()); err != nil {
			return &denial{code: codeInvalidArgument, msg: fmt.Sprintf("request of %s: %v", s.gr.m.full, err)}
		}
	case proto.Message:
		msg = v.ProtoReflect()
	default:
		return nil
	}
	return s.g.sameID(s.c, s.gr, s.firstID, msg)
}

// sameID refuses msg when it names an object other than first.
func (g *Guard) sameID(c call, gr *grant, first string, msg protoreflect.Message) error {
	if id, _ := authz.FieldString(msg, gr.m.rule.GetIdField()); id != "" && id != first {
		return g.denyGrant(c, gr, id, "a stream on %s may not name another object", first)
	}
	return nil
}

func (s *guardedStream) SendMsg(m any) error {
	if !s.gr.filters() {
		return s.ServerStream.SendMsg(m)
	}
	switch v := m.(type) {
	case *mesh.Frame:
		resp := newMessage(s.gr.m.md.Output())
		if err := proto.Unmarshal(v.Bytes(), resp.Interface()); err != nil {
			return status.Errorf(codes.Internal, "response of %s: %v", s.gr.m.full, err)
		}
		if !s.g.filterResponse(s.gr, resp) {
			return nil
		}
		b, err := proto.Marshal(resp.Interface())
		if err != nil {
			return status.Errorf(codes.Internal, "response of %s: %v", s.gr.m.full, err)
		}
		return s.ServerStream.SendMsg(mesh.NewFrame(b))
	case proto.Message:
		if !s.g.filterResponse(s.gr, v.ProtoReflect()) {
			return nil
		}
	}
	return s.ServerStream.SendMsg(m)
}

// ConnectInterceptor guards Connect handlers.
func (g *Guard) ConnectInterceptor() connect.Interceptor { return connectGuard{g} }

type connectGuard struct{ g *Guard }

func (i connectGuard) call(ctx context.Context, spec connect.Spec, p connect.Peer, authorization string) call {
	c := call{procedure: spec.Procedure, authorization: authorization, tls: i.g.connState(ctx), remote: p.Addr, via: ViaFrom(ctx)}
	if r, ok := observe.RequestFrom(ctx); ok {
		c.requestID = r.ID
	}
	return c
}

func (i connectGuard) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		bodyArrived(ctx) // connect-go read the request before calling us
		c := i.call(ctx, req.Spec(), req.Peer(), req.Header().Get("Authorization"))
		msg := protoOf(req.Any())
		ctx, gr, err := i.g.admit(ctx, c, msg)
		if err != nil {
			return nil, connectError(err)
		}
		if gr.checksRequest() || gr.filters() {
			if msg == nil {
				return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("request of %s is not a protobuf message", c.procedure))
			}
			if err := i.g.checkUnary(ctx, c, gr, msg); err != nil {
				return nil, connectError(err)
			}
		}
		resp, err := next(ctx, req)
		if err == nil && gr.filters() {
			if m := protoOf(resp.Any()); m == nil || !i.g.filterResponse(gr, m) {
				return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s: the response does not meet the RBAC policy's conditions", c.procedure))
			}
		}
		return resp, err
	}
}

func (connectGuard) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i connectGuard) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		c := i.call(ctx, conn.Spec(), conn.Peer(), conn.RequestHeader().Get("Authorization"))
		ctx, gr, err := i.g.admit(ctx, c, nil)
		if err != nil {
			return connectError(err)
		}
		release, err := i.g.holdStream(ctx, c)
		if err != nil {
			return connectError(err)
		}
		defer release()
		ctx, cancel := untilExpiry(ctx)
		defer cancel()
		if gr.checksRequest() || gr.filters() {
			conn = &guardedConn{StreamingHandlerConn: conn, ctx: ctx, g: i.g, c: c, gr: gr}
		}
		err = next(ctx, conn)
		if tokenExpired(ctx) {
			return connect.NewError(connect.CodeUnauthenticated, ErrTokenExpired)
		}
		return err
	}
}

// guardedConn checks a Connect stream's requests (the first before
// anything is sent, later ones for naming the same object) and filters
// its responses. A failed check stays failed.
type guardedConn struct {
	connect.StreamingHandlerConn
	ctx     context.Context
	g       *Guard
	c       call
	gr      *grant
	checked bool
	firstID string
	err     error
	pending any // the first request, read by Send before the handler asked
}

// checkFirst receives and checks the first request into m.
func (s *guardedConn) checkFirst(m any) error {
	s.checked = true
	if err := s.StreamingHandlerConn.Receive(m); err != nil {
		if errors.Is(err, io.EOF) {
			s.err = connectError(noRequest(s.gr))
			return s.err
		}
		return err
	}
	msg := protoOf(m)
	if msg == nil {
		s.err = connect.NewError(connect.CodeInternal, fmt.Errorf("request of %s is not a protobuf message", s.c.procedure))
		return s.err
	}
	if err := s.g.checkUnary(s.ctx, s.c, s.gr, msg); err != nil {
		s.err = connectError(err)
		return s.err
	}
	s.firstID, _ = authz.FieldString(msg, s.gr.m.rule.GetIdField())
	return nil
}

func (s *guardedConn) Receive(m any) error {
	if s.err != nil {
		return s.err
	}
	if p := s.pending; p != nil {
		s.pending = nil
		pm, ok := m.(proto.Message)
		if !ok {
			return connect.NewError(connect.CodeInternal, fmt.Errorf("cannot receive a request into %T", m))
		}
		proto.Reset(pm)
		proto.Merge(pm, p.(proto.Message))
		return nil
	}
	if !s.checked {
		return s.checkFirst(m)
	}
	if err := s.StreamingHandlerConn.Receive(m); err != nil {
		return err
	}
	if s.gr.checksRequest() {
		if msg := protoOf(m); msg != nil {
			if err := s.g.sameID(s.c, s.gr, s.firstID, msg); err != nil {
				s.err = connectError(err)
				return s.err
			}
		}
	}
	return nil
}

func (s *guardedConn) Send(m any) error {
	if s.err != nil {
		return s.err
	}
	if !s.checked && (s.gr.checksRequest() || s.gr.filters()) && s.gr.m.md != nil {
		// Nothing goes out before the request is checked.
		first := newMessage(s.gr.m.md.Input()).Interface()
		if err := s.checkFirst(first); err != nil {
			return err
		}
		s.pending = first
	}
	if pm := protoOf(m); pm != nil && s.gr.filters() && !s.g.filterResponse(s.gr, pm) {
		return nil
	}
	return s.StreamingHandlerConn.Send(m)
}

// HTTPHandler guards a plain HTTP handler of the API port (/metrics):
// the caller must be authenticated; no rule applies.
func (g *Guard) HTTPHandler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var certs []*x509.Certificate
		if st := g.connState(r.Context()); st != nil {
			certs = st.PeerCertificates
		}
		src := sourceOf(r.RemoteAddr)
		if err := g.takeAuthToken(src); err != nil {
			http.Error(w, err.(*denial).msg, http.StatusTooManyRequests)
			return
		}
		if _, err := g.cfg.Authenticator.Authenticate(r.Context(), r.Header.Get("Authorization"), certs); err != nil {
			g.denied.WithLabelValues("unauthenticated").Inc()
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		g.failures.GiveBack(src)
		h.ServeHTTP(w, r)
	})
}
