package access

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/gateway/mesh"
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
	c := call{procedure: fullMethod, tls: g.connState(ctx)}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("authorization"); len(v) > 0 {
			c.authorization = v[0]
		}
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		c.remote = p.Addr.String()
	}
	return c
}

// UnaryServerInterceptor guards the unary methods a grpc-go server serves
// itself.
func (g *Guard) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		c := g.grpcCall(ctx, info.FullMethod)
		ctx, gr, err := g.admit(ctx, c)
		if err != nil {
			return nil, grpcError(err)
		}
		if gr.checksRequest() {
			m, ok := req.(proto.Message)
			if !ok {
				return nil, status.Errorf(codes.Internal, "request of %s is not a protobuf message", info.FullMethod)
			}
			if err := g.checkRequest(ctx, c, gr, m.ProtoReflect()); err != nil {
				return nil, grpcError(err)
			}
		}
		resp, err := handler(ctx, req)
		if err == nil && gr.filters() {
			if m, ok := resp.(proto.Message); !ok || !gr.filter(m.ProtoReflect()) {
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
		ctx, gr, err := g.admit(ss.Context(), c)
		if err != nil {
			return grpcError(err)
		}
		w := &guardedStream{ServerStream: ss, ctx: ctx, gr: gr}
		if gr.checksRequest() {
			// The first request message names the object: read and check
			// it before the handler (or the backend) sees anything.
			f := new(mesh.Frame)
			if err := ss.RecvMsg(f); err != nil {
				return err
			}
			req := newMessage(gr.m.md.Input())
			if err := proto.Unmarshal(f.Bytes(), req.Interface()); err != nil {
				f.Free()
				return status.Errorf(codes.InvalidArgument, "request of %s: %v", info.FullMethod, err)
			}
			if err := g.checkRequest(ctx, c, gr, req); err != nil {
				f.Free()
				return grpcError(err)
			}
			w.first = f
		}
		err = handler(srv, w)
		if w.first != nil {
			w.first.Free()
		}
		return err
	}
}

// guardedStream carries the principal in its context, hands the handler
// the message read for the check, and filters responses.
type guardedStream struct {
	grpc.ServerStream
	ctx   context.Context
	gr    *grant
	first *mesh.Frame
}

func (s *guardedStream) Context() context.Context { return s.ctx }

func (s *guardedStream) RecvMsg(m any) error {
	f := s.first
	if f == nil {
		return s.ServerStream.RecvMsg(m)
	}
	s.first = nil
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
		if !s.gr.filter(resp) {
			return nil
		}
		b, err := proto.Marshal(resp.Interface())
		if err != nil {
			return status.Errorf(codes.Internal, "response of %s: %v", s.gr.m.full, err)
		}
		return s.ServerStream.SendMsg(mesh.NewFrame(b))
	case proto.Message:
		if !s.gr.filter(v.ProtoReflect()) {
			return nil
		}
	}
	return s.ServerStream.SendMsg(m)
}

// ConnectInterceptor guards Connect handlers.
func (g *Guard) ConnectInterceptor() connect.Interceptor { return connectGuard{g} }

type connectGuard struct{ g *Guard }

func (i connectGuard) call(ctx context.Context, spec connect.Spec, p connect.Peer, authorization string) call {
	return call{procedure: spec.Procedure, authorization: authorization, tls: i.g.connState(ctx), remote: p.Addr}
}

func (i connectGuard) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		c := i.call(ctx, req.Spec(), req.Peer(), req.Header().Get("Authorization"))
		ctx, gr, err := i.g.admit(ctx, c)
		if err != nil {
			return nil, connectError(err)
		}
		if gr.checksRequest() {
			m, ok := req.Any().(proto.Message)
			if !ok {
				return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("request of %s is not a protobuf message", c.procedure))
			}
			if err := i.g.checkRequest(ctx, c, gr, m.ProtoReflect()); err != nil {
				return nil, connectError(err)
			}
		}
		resp, err := next(ctx, req)
		if err == nil && gr.filters() {
			if m, ok := resp.Any().(proto.Message); !ok || !gr.filter(m.ProtoReflect()) {
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
		ctx, gr, err := i.g.admit(ctx, c)
		if err != nil {
			return connectError(err)
		}
		if gr.checksRequest() || gr.filters() {
			conn = &guardedConn{StreamingHandlerConn: conn, ctx: ctx, g: i.g, c: c, gr: gr}
		}
		return next(ctx, conn)
	}
}

// guardedConn checks a Connect stream's first request and filters its
// responses.
type guardedConn struct {
	connect.StreamingHandlerConn
	ctx     context.Context
	g       *Guard
	c       call
	gr      *grant
	checked bool
}

func (s *guardedConn) Receive(m any) error {
	if err := s.StreamingHandlerConn.Receive(m); err != nil || s.checked || !s.gr.checksRequest() {
		return err
	}
	s.checked = true
	pm, ok := m.(proto.Message)
	if !ok {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("request of %s is not a protobuf message", s.c.procedure))
	}
	return connectError(s.g.checkRequest(s.ctx, s.c, s.gr, pm.ProtoReflect()))
}

func (s *guardedConn) Send(m any) error {
	if pm, ok := m.(proto.Message); ok && s.gr.filters() && !s.gr.filter(pm.ProtoReflect()) {
		return nil
	}
	return s.StreamingHandlerConn.Send(m)
}
