package observe

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/zipkin" //lint:ignore SA1019 deprecated upstream (removal planned for 2027); tracing.exporter: zipkin is built on it until then
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
)

// TraceConfig is the tracing block: enabled, the collector's endpoint,
// the exporter it speaks, the ratio of traces sampled.
type TraceConfig struct {
	Enabled      bool
	Exporter     string // "", "otlp", "jaeger" or "zipkin"
	Endpoint     string
	SamplingRate float64
	Service      string // service.name
	NodeID       string
	// BatchTimeout is how long spans wait to be exported (default 5 s).
	BatchTimeout time.Duration
}

// Tracing is the agent's tracer provider and what instruments its calls.
// Disabled, every part is a no-op.
type Tracing struct {
	provider   trace.TracerProvider
	sdk        *sdktrace.TracerProvider
	propagator propagation.TextMapPropagator
}

// JaegerOTLPPort is where a Jaeger collector takes OTLP over gRPC.
const JaegerOTLPPort = "4317"

// collectorTarget is the host:port (and whether TLS) of an OTLP/gRPC
// collector for an endpoint: "host:port", "http(s)://host:port", or the
// spec's Jaeger form "http://jaeger:14268/api/traces", which names a
// Jaeger collector: Jaeger takes OTLP on 4317, which is used.
func collectorTarget(exporter, endpoint string) (addr string, secure bool, err error) {
	if !strings.Contains(endpoint, "://") {
		return endpoint, false, nil
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return "", false, fmt.Errorf("tracing.endpoint %q: not a URL or host:port", endpoint)
	}
	secure = u.Scheme == "https"
	host, port := u.Hostname(), u.Port()
	if exporter == "jaeger" || strings.HasSuffix(u.Path, "/api/traces") {
		port = JaegerOTLPPort
	}
	if port == "" {
		port = "4317"
	}
	return net.JoinHostPort(host, port), secure, nil
}

// ZipkinSpansPath is the path of a Zipkin collector's v2 span API, used
// when a zipkin endpoint names none.
const ZipkinSpansPath = "/api/v2/spans"

// zipkinExportTimeout bounds one POST of spans to a Zipkin collector.
const zipkinExportTimeout = 10 * time.Second

// IsZipkinEndpoint reports whether endpoint names a Zipkin collector's v2
// span API (…/api/v2/spans): the exporter chosen for it when none is set.
func IsZipkinEndpoint(endpoint string) bool {
	u, err := url.Parse(endpoint)
	return err == nil && strings.Contains(endpoint, "://") && strings.HasSuffix(strings.TrimSuffix(u.Path, "/"), ZipkinSpansPath)
}

// ZipkinURL is the URL spans are posted to for a zipkin endpoint: an
// http(s) URL, its path ZipkinSpansPath when it has none.
func ZipkinURL(endpoint string) (string, error) {
	u, err := url.Parse(endpoint)
	if err != nil || !strings.Contains(endpoint, "://") {
		return "", fmt.Errorf("tracing.endpoint %q: the zipkin exporter posts spans over HTTP: give a URL, e.g. http://zipkin:9411%s", endpoint, ZipkinSpansPath)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("tracing.endpoint %q: scheme %q: the zipkin exporter needs http or https, e.g. http://zipkin:9411%s", endpoint, u.Scheme, ZipkinSpansPath)
	}
	if u.Host == "" {
		return "", fmt.Errorf("tracing.endpoint %q: the host is missing, e.g. http://zipkin:9411%s", endpoint, ZipkinSpansPath)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = ZipkinSpansPath
	}
	return u.String(), nil
}

// newExporter is cfg's span exporter: Zipkin's JSON v2 over HTTP for
// exporter zipkin (or an endpoint ending in /api/v2/spans), else OTLP over
// gRPC.
func newExporter(ctx context.Context, cfg TraceConfig) (sdktrace.SpanExporter, error) {
	if cfg.Exporter == "zipkin" || (cfg.Exporter == "" && IsZipkinEndpoint(cfg.Endpoint)) {
		target, err := ZipkinURL(cfg.Endpoint)
		if err != nil {
			return nil, err
		}
		exp, err := zipkin.New(target, zipkin.WithClient(&http.Client{Timeout: zipkinExportTimeout}))
		if err != nil {
			return nil, fmt.Errorf("tracing: %w", err)
		}
		return exp, nil
	}
	addr, secure, err := collectorTarget(cfg.Exporter, cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(addr)}
	if !secure {
		opts = append(opts, otlptracegrpc.WithInsecure())
	}
	exp, err := otlptracegrpc.New(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	return exp, nil
}

// NewTracing starts the exporter of cfg (nothing when disabled).
func NewTracing(ctx context.Context, cfg TraceConfig) (*Tracing, error) {
	t := &Tracing{provider: noop.NewTracerProvider(), propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})}
	if !cfg.Enabled {
		return t, nil
	}
	exp, err := newExporter(ctx, cfg)
	if err != nil {
		return nil, err
	}
	batch := cfg.BatchTimeout
	if batch <= 0 {
		batch = 5 * time.Second
	}
	res := resource.NewSchemaless(semconv.ServiceName(cfg.Service), semconv.ServiceInstanceID(cfg.NodeID))
	t.sdk = sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(batch)),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.SamplingRate))),
		sdktrace.WithResource(res),
	)
	t.provider = t.sdk
	return t, nil
}

// Tracer is the agent's tracer.
func (t *Tracing) Tracer() trace.Tracer { return t.provider.Tracer("pilab.hu/pivirt-agent") }

// Shutdown exports what is left.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t.sdk == nil {
		return nil
	}
	return t.sdk.Shutdown(ctx)
}

// ServerHandler instruments a grpc-go server: a span per call (the API
// port's, the internal port's), its parent taken from the caller.
func (t *Tracing) ServerHandler() stats.Handler {
	return otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(t.provider), otelgrpc.WithPropagators(t.propagator))
}

// ClientOption instruments a grpc-go client (backend attempts, calls to
// other agents): a span per attempt, whose context goes with the call.
func (t *Tracing) ClientOption() grpc.DialOption {
	return grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(t.provider), otelgrpc.WithPropagators(t.propagator)))
}

// ConnectInterceptor makes a server span for each Connect call, its parent
// taken from the caller's traceparent.
func (t *Tracing) ConnectInterceptor() connect.Interceptor { return connectTracing{t} }

type connectTracing struct{ t *Tracing }

func (c connectTracing) start(ctx context.Context, spec connect.Spec, hdr http.Header) (context.Context, trace.Span) {
	ctx = c.t.propagator.Extract(ctx, propagation.HeaderCarrier(hdr))
	name := strings.TrimPrefix(spec.Procedure, "/")
	ctx, span := c.t.Tracer().Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("rpc.system", "connect_rpc"), attribute.String("rpc.method", name)))
	// A call forwarded from here (to the leader) carries this span.
	c.t.propagator.Inject(ctx, propagation.HeaderCarrier(hdr))
	return ctx, span
}

func end(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(attribute.String("rpc.connect_rpc.error_code", connect.CodeOf(err).String()))
	}
	span.End()
}

func (c connectTracing) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, span := c.start(ctx, req.Spec(), req.Header())
		resp, err := next(ctx, req)
		end(span, err)
		return resp, err
	}
}

func (connectTracing) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (c connectTracing) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, span := c.start(ctx, conn.Spec(), conn.RequestHeader())
		err := next(ctx, conn)
		end(span, err)
		return err
	}
}
