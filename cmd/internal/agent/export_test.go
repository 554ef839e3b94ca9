package agent

import "github.com/prometheus/client_golang/prometheus"

// MetricCollectors are the collectors a's /metrics serves, for the tests
// of package agent_test (the metrics reference).
func MetricCollectors(a *Agent) []prometheus.Collector { return a.metrics.Collectors() }
