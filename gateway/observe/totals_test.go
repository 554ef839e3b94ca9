package observe

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Totals sums the API port's request counter: every call, and those with
// a code other than ok as errors.
func TestMetricsTotals(t *testing.T) {
	m := New(prometheus.NewRegistry(), nil)
	m.requests.WithLabelValues("pivirt.cluster.v1.ClusterService", "Members", "ok").Add(3)
	m.requests.WithLabelValues("pivirt.cluster.v1.ClusterService", "Peers", "unavailable").Add(2)
	m.requests.WithLabelValues("unknown", "unknown", "unimplemented").Inc()
	if requests, failed := m.Totals(); requests != 6 || failed != 3 {
		t.Fatalf("totals %d calls, %d failed; want 6 and 3", requests, failed)
	}
}
