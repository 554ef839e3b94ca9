package agent_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"mime"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// receiver is an OTLP/gRPC trace collector on 127.0.0.1 that keeps the
// spans it is sent.
type receiver struct {
	coltracepb.UnimplementedTraceServiceServer
	addr  string
	mu    sync.Mutex
	spans []*tracepb.Span
}

func (r *receiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (r *receiver) all() []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*tracepb.Span(nil), r.spans...)
}

func startReceiver(t *testing.T) *receiver {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &receiver{addr: ln.Addr().String()}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, r)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return r
}

// TestTracing: with tracing on, a proxied call's trace reaches an OTLP
// collector as a tree: the API port's server span, the backend attempt
// (client span, its child) of the same trace; a write's trace has the
// raft.apply span; the caller's traceparent is continued.
func TestTracing(t *testing.T) {
	rcv := startReceiver(t)
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		cfg.Tracing = config.TracingConfig{Enabled: true, Endpoint: "http://" + rcv.addr, SamplingRate: 1}
	})
	n := c.WaitLeader(20 * time.Second)
	vm := vmv1.NewVMServiceClient(dialPlain(t, n.APIAddr()))
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := vm.ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
		t.Fatal(err)
	}
	// A caller's trace is continued (W3C traceparent).
	const parentTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	if _, err := vm.ListVMs(metadata.AppendToOutgoingContext(ctx, "traceparent", "00-"+parentTrace+"-00f067aa0ba902b7-01"), &vmv1.ListVMsRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/trace.test", Value: "1"})); err != nil {
		t.Fatal(err)
	}
	const method = "pivirt.vm.v1.VMService/ListVMs"
	agenttest.Eventually(t, 30*time.Second, "the spans of a proxied call", func() error {
		spans := rcv.all()
		var server, client *tracepb.Span
		for _, sp := range spans {
			if sp.GetName() == method && sp.GetKind() == tracepb.Span_SPAN_KIND_SERVER && client == nil {
				for _, cl := range spans {
					if cl.GetName() == method && cl.GetKind() == tracepb.Span_SPAN_KIND_CLIENT && string(cl.GetParentSpanId()) == string(sp.GetSpanId()) {
						server, client = sp, cl
					}
				}
			}
		}
		if server == nil || client == nil {
			return fmt.Errorf("no server span with a backend-attempt child among %d spans: %s", len(spans), names(spans))
		}
		if string(server.GetTraceId()) != string(client.GetTraceId()) {
			return fmt.Errorf("the backend attempt is in another trace")
		}
		continued, applied := false, false
		for _, sp := range spans {
			continued = continued || (sp.GetName() == method && hex.EncodeToString(sp.GetTraceId()) == parentTrace)
			applied = applied || sp.GetName() == "raft.apply"
		}
		if !continued {
			return fmt.Errorf("the caller's trace %s was not continued", parentTrace)
		}
		if !applied {
			return fmt.Errorf("no raft.apply span for the write: %s", names(spans))
		}
		return nil
	})
}

func names(spans []*tracepb.Span) string {
	var out []string
	for _, s := range spans {
		out = append(out, fmt.Sprintf("%s(%s)", s.GetName(), s.GetKind()))
	}
	return strings.Join(out, " ")
}

// zipkinSpan is a span of Zipkin's v2 JSON API, the fields checked.
type zipkinSpan struct {
	TraceID       string `json:"traceId"`
	ID            string `json:"id"`
	ParentID      string `json:"parentId"`
	Name          string `json:"name"`
	Kind          string `json:"kind"`
	LocalEndpoint struct {
		ServiceName string `json:"serviceName"`
	} `json:"localEndpoint"`
}

// zipkinReceiver is a Zipkin v2 collector on 127.0.0.1: POST
// /api/v2/spans with a JSON array of spans, answered 202 as Zipkin does;
// anything else is refused and recorded.
type zipkinReceiver struct {
	url   string
	mu    sync.Mutex
	spans []zipkinSpan
	bad   []string
}

func startZipkin(t *testing.T) *zipkinReceiver {
	t.Helper()
	r := &zipkinReceiver{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var spans []zipkinSpan
		ct, _, _ := mime.ParseMediaType(req.Header.Get("Content-Type"))
		err := json.NewDecoder(req.Body).Decode(&spans)
		r.mu.Lock()
		defer r.mu.Unlock()
		switch {
		case req.Method != http.MethodPost || req.URL.Path != "/api/v2/spans":
			r.bad = append(r.bad, req.Method+" "+req.URL.Path)
			http.NotFound(w, req)
		case ct != "application/json" || err != nil:
			r.bad = append(r.bad, fmt.Sprintf("content type %q, body: %v", ct, err))
			http.Error(w, "want a JSON array of spans", http.StatusBadRequest)
		default:
			r.spans = append(r.spans, spans...)
			w.WriteHeader(http.StatusAccepted)
		}
	}))
	t.Cleanup(srv.Close)
	r.url = srv.URL + "/api/v2/spans"
	return r
}

func (r *zipkinReceiver) all() ([]zipkinSpan, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]zipkinSpan(nil), r.spans...), append([]string(nil), r.bad...)
}

// TestTracingZipkin: with tracing.exporter zipkin, the spans of a real
// proxied call through a real agent reach a Zipkin v2 collector as JSON,
// with the agent's service name: the API port's server span and its
// backend attempt (a client span, its child, of the same trace), the
// caller's traceparent continued, and a write's raft.apply.
func TestTracingZipkin(t *testing.T) {
	zk := startZipkin(t)
	s := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(s.addr)(i, cfg)
		cfg.Tracing = config.TracingConfig{Enabled: true, Exporter: "zipkin", Endpoint: zk.url, SamplingRate: 1}
	})
	n := c.WaitLeader(20 * time.Second)
	vm := vmv1.NewVMServiceClient(dialPlain(t, n.APIAddr()))
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := vm.ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
		t.Fatal(err)
	}
	const parentTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	if _, err := vm.ListVMs(metadata.AppendToOutgoingContext(ctx, "traceparent", "00-"+parentTrace+"-00f067aa0ba902b7-01"), &vmv1.ListVMsRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/trace.zipkin", Value: "1"})); err != nil {
		t.Fatal(err)
	}
	// Zipkin's span names are lower case.
	method := strings.ToLower("pivirt.vm.v1.VMService/ListVMs")
	agenttest.Eventually(t, 30*time.Second, "the spans of a proxied call at the Zipkin collector", func() error {
		spans, bad := zk.all()
		if len(bad) > 0 {
			return fmt.Errorf("the collector refused requests: %s", strings.Join(bad, "; "))
		}
		var list []string
		for _, sp := range spans {
			list = append(list, sp.Name+"("+sp.Kind+")")
			if sp.LocalEndpoint.ServiceName != "pivirt-agent" {
				return fmt.Errorf("span %s has service name %q, want pivirt-agent", sp.Name, sp.LocalEndpoint.ServiceName)
			}
		}
		var server, client *zipkinSpan
		for i, sp := range spans {
			if sp.Name == method && sp.Kind == "SERVER" {
				for j, cl := range spans {
					if cl.Name == method && cl.Kind == "CLIENT" && cl.ParentID == sp.ID {
						server, client = &spans[i], &spans[j]
					}
				}
			}
		}
		if server == nil || client == nil {
			return fmt.Errorf("no server span with a backend-attempt child among %d spans: %s", len(spans), strings.Join(list, " "))
		}
		if server.TraceID != client.TraceID {
			return fmt.Errorf("the backend attempt is in another trace")
		}
		continued, applied := false, false
		for _, sp := range spans {
			continued = continued || (sp.Name == method && sp.TraceID == parentTrace)
			applied = applied || sp.Name == "raft.apply"
		}
		if !continued {
			return fmt.Errorf("the caller's trace %s was not continued", parentTrace)
		}
		if !applied {
			return fmt.Errorf("no raft.apply span for the write: %s", strings.Join(list, " "))
		}
		return nil
	})
}
