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
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Metrics are the API port's request metrics.
type Metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// New registers the metrics with reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
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

func (m *Metrics) observe(procedure string, code connect.Code, d time.Duration) {
	svc, method := labels(procedure)
	m.requests.WithLabelValues(svc, method, codeName(code)).Inc()
	m.duration.WithLabelValues(svc, method).Observe(d.Seconds())
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
		resp, err := handler(ctx, req)
		m.observe(info.FullMethod, grpcCode(err), time.Since(start))
		return resp, err
	}
}

// StreamServerInterceptor measures grpc-go streams and proxied calls.
func (m *Metrics) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		start := time.Now()
		err := handler(srv, ss)
		m.observe(info.FullMethod, grpcCode(err), time.Since(start))
		return err
	}
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
		resp, err := next(ctx, req)
		c.m.observe(req.Spec().Procedure, codeOf(err), time.Since(start))
		return resp, err
	}
}

func (connectMetrics) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (c connectMetrics) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		err := next(ctx, conn)
		c.m.observe(conn.Spec().Procedure, codeOf(err), time.Since(start))
		return err
	}
}

func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.CodeOf(err)
}
