package docgen

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// constCollector describes desc and, when kind is set, gives one sample of
// it: as the agent's collectors that read their state at scrape time.
type constCollector struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value []string
}

func (c constCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c constCollector) Collect(ch chan<- prometheus.Metric) {
	if c.kind != 0 {
		ch <- prometheus.MustNewConstMetric(c.desc, c.kind, 1, c.value...)
	}
}

// TestMetricsReferenceFromCollectors: names, help, labels (variable, then
// constant), types and buckets come from the collectors; a vector without
// children is sampled through a child that is gone afterwards.
func TestMetricsReferenceFromCollectors(t *testing.T) {
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pivirt_test_calls_total", Help: "Calls | by *code*."}, []string{"code"})
	hist := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "pivirt_test_seconds", Help: "Time.", Buckets: []float64{0.5, 1}})
	state := constCollector{
		desc: prometheus.NewDesc("pivirt_test_state", `State "now", <as> seen.`, []string{"node"}, prometheus.Labels{"zone": `a,b="c"`}),
		kind: prometheus.GaugeValue, value: []string{"n1"},
	}
	mode, err := DescribeMetrics(nil, []prometheus.Collector{vec, hist, state})
	if err != nil {
		t.Fatal(err)
	}
	if n := testCollected(vec); n != 0 {
		t.Errorf("the vector has %d children after it was described, want none", n)
	}
	page, err := MetricsReference(mode)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| `pivirt_test_calls_total` | counter | `code` | Calls \\| by \\*code\\*. |",
		"| `pivirt_test_seconds` | histogram | — | Time.<br>Buckets: 0.5, 1. |",
		"| `pivirt_test_state` | gauge | `node`, `zone` | State \"now\", &lt;as&gt; seen. |",
	} {
		if !strings.Contains(string(page), want) {
			t.Errorf("the page lacks\n%s\n%s", want, page)
		}
	}
}

func testCollected(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 16)
	c.Collect(ch)
	close(ch)
	return len(ch)
}

// TestMetricsReferenceNeedsASample: a metric whose collector gave no
// sample in any configuration has no known type: an error naming it.
func TestMetricsReferenceNeedsASample(t *testing.T) {
	silent := constCollector{desc: prometheus.NewDesc("pivirt_test_silent", "Nothing yet.", nil, nil)}
	mode, err := DescribeMetrics(nil, []prometheus.Collector{silent})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := MetricsReference(mode); err == nil || !strings.Contains(err.Error(), "pivirt_test_silent") {
		t.Fatalf("MetricsReference: %v, want an error naming pivirt_test_silent", err)
	}
	// Another configuration's sample gives the type.
	sampled := constCollector{desc: prometheus.NewDesc("pivirt_test_silent", "Nothing yet.", nil, nil), kind: prometheus.CounterValue}
	other, err := DescribeMetrics([]string{"x.enabled"}, []prometheus.Collector{sampled})
	if err != nil {
		t.Fatal(err)
	}
	if page, err := MetricsReference(mode, other); err != nil || !strings.Contains(string(page), "| `pivirt_test_silent` | counter |") {
		t.Fatalf("MetricsReference: %v\n%s", err, page)
	}
}

// TestRegisteredWhen: a metric registered by some of the agents is marked
// with the fewest keys that tell them from the others, per agent.
func TestRegisteredWhen(t *testing.T) {
	modes := []MetricsMode{
		{},
		{Keys: []string{"tls.enabled"}},
		{Keys: []string{"tls.enabled", "tls.cluster_ca.enabled"}},
		{Keys: []string{"tls.enabled", "tls.ca_server.url"}},
		{Keys: []string{"auth.rbac_policy"}},
	}
	for _, c := range []struct {
		in   []int
		want string
	}{
		{[]int{1, 2, 3}, "`tls.enabled`"},
		{[]int{2}, "`tls.cluster_ca.enabled`"},
		{[]int{2, 3}, "`tls.cluster_ca.enabled` or `tls.ca_server.url`"},
		{[]int{1, 2, 3, 4}, "`tls.enabled` or `auth.rbac_policy`"},
	} {
		conds, err := registeredWhen(c.in, modes)
		if err != nil {
			t.Errorf("%v: %v", c.in, err)
			continue
		}
		var alternatives []string
		for _, k := range uniqueConditions(c.in, conds) {
			alternatives = append(alternatives, keyList(k, " and "))
		}
		if got := joinAlternatives(alternatives); got != c.want {
			t.Errorf("registered by %v: %q, want %q", c.in, got, c.want)
		}
	}
	// Registered with tls.enabled alone but not with tls.enabled and
	// more: no set of keys says when.
	if _, err := registeredWhen([]int{1}, modes); err == nil {
		t.Error("registered by the tls.enabled agent only: no error")
	}
}
