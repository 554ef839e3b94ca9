package observe

import (
	"strings"
	"testing"
)

// TestZipkinURL: a zipkin endpoint is an http(s) URL, completed with
// Zipkin's span path when it has none; an endpoint ending in that path
// picks Zipkin without tracing.exporter.
func TestZipkinURL(t *testing.T) {
	for _, tt := range []struct {
		endpoint, want, err string
	}{
		{"http://127.0.0.1:9411/api/v2/spans", "http://127.0.0.1:9411/api/v2/spans", ""},
		{"https://zipkin.pilab.hu", "https://zipkin.pilab.hu/api/v2/spans", ""},
		{"http://zipkin:9411/", "http://zipkin:9411/api/v2/spans", ""},
		{"http://zipkin:9411/collector/spans", "http://zipkin:9411/collector/spans", ""},
		{"zipkin:9411", "", "give a URL, e.g. http://zipkin:9411/api/v2/spans"},
		{"grpc://zipkin:9411", "", `scheme "grpc": the zipkin exporter needs http or https`},
		{"http:///api/v2/spans", "", "the host is missing"},
	} {
		got, err := ZipkinURL(tt.endpoint)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) || !strings.Contains(err.Error(), tt.endpoint) {
				t.Errorf("ZipkinURL(%q) = %q, %v; want an error naming it and containing %q", tt.endpoint, got, err, tt.err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ZipkinURL(%q) = %q, %v; want %q", tt.endpoint, got, err, tt.want)
		}
	}
	for endpoint, want := range map[string]bool{
		"http://zipkin:9411/api/v2/spans":   true,
		"https://zipkin:9411/api/v2/spans/": true,
		"http://jaeger:14268/api/traces":    false,
		"otel-collector:4317":               false,
		"http://otel-collector:4317":        false,
	} {
		if got := IsZipkinEndpoint(endpoint); got != want {
			t.Errorf("IsZipkinEndpoint(%q) = %v, want %v", endpoint, got, want)
		}
	}
}
