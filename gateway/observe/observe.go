// Package observe measures the calls of the API port:
// pivirt_api_requests_total{service,method,code} and
// pivirt_api_request_duration_seconds{service,method}, for every protocol
// (Connect handlers, grpc-go handlers and the proxy). Method names a
// caller chooses are bounded: a method the schema does not know is
// counted as "unknown".
package observe

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Metrics are the API port's request metrics, request IDs and access log.
type Metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	// access, when set, gets a line per call (logging.access_log).
	access *slog.Logger
}

// New registers the metrics with reg; access, when not nil, receives the
// access log.
func New(reg prometheus.Registerer, access *slog.Logger) *Metrics {
	m := &Metrics{
		access: access,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_api_requests_total",
			Help: "Calls on the API port by service, method and result code (Connect/gRPC code names).",
		}, []string{"service", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pivirt_api_request_duration_seconds",
			Help:    "Duration of calls on the API port (for streams: their whole life).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 14),
		}, []string{"service", "method"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration)
	}
	return m
}

// labels splits "/pkg.Service/Method" into bounded labels.
func labels(procedure string) (service, method string) {
	svc, name, ok := strings.Cut(strings.TrimPrefix(procedure, "/"), "/")
	if !ok {
		return "unknown", "unknown"
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return "unknown", "unknown"
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return "unknown", "unknown"
	}
	if sd.Methods().ByName(protoreflect.Name(name)) == nil {
		return svc, "unknown"
	}
	return svc, name
}

func codeName(c connect.Code) string {
	if c == 0 {
		return "ok"
	}
	return c.String()
}

func (m *Metrics) observe(ctx context.Context, procedure, remote, protocol string, code connect.Code, d time.Duration) {
	svc, method := labels(procedure)
	m.requests.WithLabelValues(svc, method, codeName(code)).Inc()
	m.duration.WithLabelValues(svc, method).Observe(d.Seconds())
	if m.access != nil {
		identity := ""
		if r, ok := RequestFrom(ctx); ok {
			identity = r.Identity
		}
		m.access.LogAttrs(ctx, slog.LevelInfo, "access", slog.String("method", procedure), slog.String("protocol", protocol),
			slog.String("code", codeName(code)), slog.Duration("duration", d), slog.String("remote", remote), slog.String("identity", identity))
	}
}

// grpcBegin takes or makes the request ID of a grpc-go call, in the
// context (RequestFrom); the response headers get it from the
// interceptors. The incoming metadata is left as it came: what the call
// passes on (the proxy's backend call, a forwarded cluster call) sets
// x-request-id from the context, so a call without an ID does not copy
// its metadata to add one.
func grpcBegin(ctx context.Context) (context.Context, string) {
	var given string
	if v := metadata.ValueFromIncomingContext(ctx, "x-request-id"); len(v) > 0 {
		given = v[0]
	}
	remote := ""
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		remote = p.Addr.String()
	}
	return WithRequest(ctx, &Request{ID: requestID(given)}), remote
}

// grpcCode is the code of a grpc-go handler's error (a status, or a
// Connect error from an adapter).
func grpcCode(err error) connect.Code {
	if err == nil {
		return 0
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.Code(status.Code(err))
}

// UnaryServerInterceptor measures grpc-go unary calls.
func (m *Metrics) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		ctx, remote := grpcBegin(ctx)
		r, _ := RequestFrom(ctx)
		_ = grpc.SetHeader(ctx, metadata.Pairs(HeaderRequestID, r.ID))
		resp, err := handler(ctx, req)
		m.observe(ctx, info.FullMethod, remote, "grpc", grpcCode(err), time.Since(start))
		return resp, err
	}
}

// StreamServerInterceptor measures grpc-go streams and proxied calls.
func (m *Metrics) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		start := time.Now()
		ctx, remote := grpcBegin(ss.Context())
		r, _ := RequestFrom(ctx)
		w := &ctxStream{ServerStream: ss, ctx: ctx, id: r.ID}
		err := handler(srv, w)
		if !w.headerSent {
			// No header went out (a trailers-only answer stays one): the
			// ID goes with the trailer.
			ss.SetTrailer(metadata.Pairs(HeaderRequestID, r.ID))
		}
		m.observe(ctx, info.FullMethod, remote, "grpc", grpcCode(err), time.Since(start))
		return err
	}
}

// ctxStream is a server stream with the call's context, which returns
// the request ID exactly once: with the header when one is sent (a
// backend's own x-request-id is dropped from the headers it relays),
// else with the trailer.
type ctxStream struct {
	grpc.ServerStream
	ctx        context.Context
	id         string
	headerSent bool
}

func (s *ctxStream) Context() context.Context { return s.ctx }

func withoutID(md metadata.MD) metadata.MD {
	if len(md.Get(HeaderRequestID)) == 0 {
		return md
	}
	md = md.Copy()
	md.Delete(HeaderRequestID)
	return md
}

func (s *ctxStream) SetHeader(md metadata.MD) error { return s.ServerStream.SetHeader(withoutID(md)) }

func (s *ctxStream) SendHeader(md metadata.MD) error {
	s.addID()
	return s.ServerStream.SendHeader(withoutID(md))
}

func (s *ctxStream) SendMsg(m any) error {
	s.addID()
	return s.ServerStream.SendMsg(m)
}

func (s *ctxStream) SetTrailer(md metadata.MD) { s.ServerStream.SetTrailer(withoutID(md)) }

// addID puts the ID into the header about to be sent, once.
func (s *ctxStream) addID() {
	if !s.headerSent {
		s.headerSent = true
		_ = s.ServerStream.SetHeader(metadata.Pairs(HeaderRequestID, s.id))
	}
}

// connectBegin takes or makes the request ID of a Connect call; it is
// set on the request (forwarded calls carry it) and the response.
func connectBegin(ctx context.Context, hdr http.Header) context.Context {
	r := &Request{ID: requestID(hdr.Get(HeaderRequestID))}
	hdr.Set(HeaderRequestID, r.ID)
	return WithRequest(ctx, r)
}

// ConnectInterceptor measures Connect handlers.
func (m *Metrics) ConnectInterceptor() connect.Interceptor { return connectMetrics{m} }

type connectMetrics struct{ m *Metrics }

func (c connectMetrics) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		start := time.Now()
		ctx = connectBegin(ctx, req.Header())
		r, _ := RequestFrom(ctx)
		resp, err := next(ctx, req)
		if err != nil {
			var ce *connect.Error
			if errors.As(err, &ce) {
				ce.Meta().Set(HeaderRequestID, r.ID)
			}
		} else {
			resp.Header().Set(HeaderRequestID, r.ID)
		}
		c.m.observe(ctx, req.Spec().Procedure, req.Peer().Addr, req.Peer().Protocol, codeOf(err), time.Since(start))
		return resp, err
	}
}

func (connectMetrics) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (c connectMetrics) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		ctx = connectBegin(ctx, conn.RequestHeader())
		r, _ := RequestFrom(ctx)
		conn.ResponseHeader().Set(HeaderRequestID, r.ID)
		err := next(ctx, conn)
		c.m.observe(ctx, conn.Spec().Procedure, conn.Peer().Addr, conn.Peer().Protocol, codeOf(err), time.Since(start))
		return err
	}
}

func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.CodeOf(err)
}

// RequestIDServerOptions take the request ID of calls from other agents
// (a forwarded write carries the caller's) into their context, so that
// what is logged for them carries it too.
func RequestIDServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			ctx, _ = grpcBegin(ctx)
			return handler(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			ctx, _ := grpcBegin(ss.Context())
			return handler(srv, &ctxStream{ServerStream: ss, ctx: ctx, headerSent: true})
		}),
	}
}

// Totals reads pivirt_api_requests_total back: every call on the API port
// since the agent started, and those whose code was not ok.
func (m *Metrics) Totals() (requests, failed uint64) {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		m.requests.Collect(ch)
		close(ch)
	}()
	for metric := range ch {
		var d dto.Metric
		if metric.Write(&d) != nil || d.GetCounter() == nil {
			continue
		}
		n := uint64(d.GetCounter().GetValue())
		requests += n
		for _, l := range d.GetLabel() {
			if l.GetName() == "code" && l.GetValue() != "ok" {
				failed += n
			}
		}
	}
	return requests, failed
}
