package docgen

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// MetricsMode is what the registry of one running agent holds: each
// metric as its collector describes it (name, help, labels) and, from the
// samples the collector gave, its type and buckets. DescribeMetrics makes
// one per configuration; MetricsReference merges them into the page.
type MetricsMode struct {
	// Keys are the configuration keys the agent was started with beyond
	// the base configuration (none for the base one).
	Keys    []string
	metrics map[string]*metricDoc
}

// metricDoc is one metric of the reference.
type metricDoc struct {
	name, help string
	// kind is counter, gauge, histogram, summary or untyped: what a sample
	// says, since a descriptor has no type; "" until a sample shows it.
	kind string
	// labels are the variable labels as declared, then the constant ones.
	labels   []string
	variable int // how many of labels are variable
	// buckets are a histogram's upper bounds (+Inf left out); quantiles a
	// summary's objectives.
	buckets, quantiles []float64
}

// DescribeMetrics describes the collectors of a running agent's registry,
// started with keys set beyond the base configuration. A collector
// describes its metrics but not their types, so each is also collected:
// a vector that has no child yet is given one for that (and it is removed
// again); a metric that shows no sample keeps an empty type, for another
// configuration's agent to show (MetricsReference fails if none does).
func DescribeMetrics(keys []string, collectors []prometheus.Collector) (MetricsMode, error) {
	mode := MetricsMode{Keys: slices.Clone(keys), metrics: map[string]*metricDoc{}}
	for _, c := range collectors {
		if err := mode.add(c); err != nil {
			return MetricsMode{}, err
		}
	}
	return mode, nil
}

// add describes c's metrics and takes their types from its samples.
func (mode MetricsMode) add(c prometheus.Collector) error {
	byDesc := map[*prometheus.Desc]*metricDoc{}
	for _, d := range describe(c) {
		m, err := parseDesc(d)
		if err != nil {
			return err
		}
		if _, dup := mode.metrics[m.name]; dup {
			return fmt.Errorf("metric %s is described by two collectors", m.name)
		}
		mode.metrics[m.name], byDesc[d] = m, m
	}
	if err := sample(c, byDesc); err != nil {
		return err
	}
	vec := metricVec(c)
	if vec == nil {
		return nil
	}
	for _, m := range byDesc {
		if m.kind == "" {
			if err := sampleChild(c, vec, m, byDesc); err != nil {
				return err
			}
		}
	}
	return nil
}

func describe(c prometheus.Collector) []*prometheus.Desc {
	ch := make(chan *prometheus.Desc)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	var out []*prometheus.Desc
	for d := range ch {
		out = append(out, d)
	}
	return out
}

// descRE reads Desc.String(), the only way to a Desc's fields from outside
// client_golang: the name and help are Go-quoted; the variable labels
// are names, c(name) when constrained. client_golang 1.24 added the unit
// (empty for every metric here).
var descRE = regexp.MustCompile(`^Desc\{fqName: ("(?:[^"\\]|\\.)*"), help: ("(?:[^"\\]|\\.)*"), (?:unit: "[^"]*", )?constLabels: \{(.*)\}, variableLabels: \{([^{}]*)\}\}$`)

// parseDesc is the name, help and labels of d.
func parseDesc(d *prometheus.Desc) (*metricDoc, error) {
	parts := descRE.FindStringSubmatch(d.String())
	if parts == nil {
		return nil, fmt.Errorf("a metric descriptor of unknown form: %s", d)
	}
	name, err := strconv.Unquote(parts[1])
	if err == nil && name == "" {
		err = errors.New("no name (an invalid descriptor)")
	}
	if err != nil {
		return nil, fmt.Errorf("metric descriptor %s: %w", d, err)
	}
	help, err := strconv.Unquote(parts[2])
	if err != nil {
		return nil, fmt.Errorf("help of metric %s: %w", name, err)
	}
	m := &metricDoc{name: name, help: help}
	if parts[4] != "" {
		for _, l := range strings.Split(parts[4], ",") {
			m.labels = append(m.labels, strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"))
		}
	}
	m.variable = len(m.labels)
	constant, err := constLabelNames(parts[3])
	if err != nil {
		return nil, fmt.Errorf("constant labels of metric %s: %w", name, err)
	}
	m.labels = append(m.labels, constant...)
	return m, nil
}

var constLabelRE = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"(,|$)`)

// constLabelNames are the names of Desc.String()'s name="value",… list
// (a value may hold commas and quotes, so the list is read pair by pair).
func constLabelNames(list string) ([]string, error) {
	var names []string
	for list != "" {
		m := constLabelRE.FindStringSubmatch(list)
		if m == nil {
			return nil, fmt.Errorf("cannot read %q", list)
		}
		names = append(names, m[1])
		list = list[len(m[0]):]
	}
	return names, nil
}

// sample collects c once and sets the type (and buckets or quantiles) of
// each metric of byDesc that gave a sample.
func sample(c prometheus.Collector, byDesc map[*prometheus.Desc]*metricDoc) error {
	ch := make(chan prometheus.Metric)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	var errs []error
	for s := range ch { // drained to the end, whatever fails
		m, ok := byDesc[s.Desc()]
		if !ok {
			errs = append(errs, fmt.Errorf("a collector gave a sample of %s, which it does not describe", s.Desc()))
			continue
		}
		var pb dto.Metric
		if err := s.Write(&pb); err != nil {
			errs = append(errs, fmt.Errorf("a sample of %s: %w", m.name, err))
			continue
		}
		if err := m.setKind(&pb); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// setKind takes m's type, and its buckets or quantiles, from a sample.
func (m *metricDoc) setKind(pb *dto.Metric) error {
	kind := "untyped"
	var buckets, quantiles []float64
	switch {
	case pb.GetCounter() != nil:
		kind = "counter"
	case pb.GetGauge() != nil:
		kind = "gauge"
	case pb.GetHistogram() != nil:
		kind = "histogram"
		for _, b := range pb.GetHistogram().GetBucket() {
			buckets = append(buckets, b.GetUpperBound())
		}
	case pb.GetSummary() != nil:
		kind = "summary"
		for _, q := range pb.GetSummary().GetQuantile() {
			quantiles = append(quantiles, q.GetQuantile())
		}
	}
	if m.kind != "" && (m.kind != kind || !slices.Equal(m.buckets, buckets) || !slices.Equal(m.quantiles, quantiles)) {
		return fmt.Errorf("metric %s: samples of two shapes (%s %v, %s %v)", m.name, m.kind, m.buckets, kind, buckets)
	}
	m.kind, m.buckets, m.quantiles = kind, buckets, quantiles
	return nil
}

// metricVec is the vector c is, or nil: client_golang's four kinds.
func metricVec(c prometheus.Collector) *prometheus.MetricVec {
	switch v := c.(type) {
	case *prometheus.CounterVec:
		return v.MetricVec
	case *prometheus.GaugeVec:
		return v.MetricVec
	case *prometheus.HistogramVec:
		return v.MetricVec
	case *prometheus.SummaryVec:
		return v.MetricVec
	}
	return nil
}

// sampleChild gives vec, which has no child yet, one with empty label
// values, samples c, and removes the child again: the registry serves no
// series that the agent did not make.
func sampleChild(c prometheus.Collector, vec *prometheus.MetricVec, m *metricDoc, byDesc map[*prometheus.Desc]*metricDoc) error {
	values := make([]string, m.variable)
	if _, err := vec.GetMetricWithLabelValues(values...); err != nil {
		return fmt.Errorf("metric %s: a child to sample: %w", m.name, err)
	}
	defer vec.DeleteLabelValues(values...)
	return sample(c, byDesc)
}

// metricEntry is a metric of the page: merged over the configurations it
// was registered in.
type metricEntry struct {
	*metricDoc
	// in are the indexes of the modes that registered it; helps its help
	// in each of them.
	in    []int
	helps []string
}

// MetricsReference renders docs/metrics.md from the modes: the first is
// the base configuration, each other one an agent started with more keys.
// A metric must have the same type, labels and buckets wherever it is
// registered, and some mode must have shown its type.
func MetricsReference(modes ...MetricsMode) ([]byte, error) {
	entries, err := mergeModes(modes)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	writeMetricsIntro(&b, modes)
	groups := map[string][]*metricEntry{}
	for _, e := range entries {
		g := metricGroup(e.name)
		groups[g.prefix] = append(groups[g.prefix], e)
	}
	for _, g := range orderedGroups(groups) {
		fmt.Fprintf(&b, "\n## %s (`%s*`)\n\n", g.title, g.prefix)
		b.WriteString("| metric | type | labels | description |\n|---|---|---|---|\n")
		for _, e := range groups[g.prefix] {
			desc, err := describeEntry(e, modes)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", e.name, e.kind, keyList(e.labels, ", "), desc)
		}
	}
	return b.Bytes(), nil
}

// mergeModes are the metrics of every mode, sorted by name.
func mergeModes(modes []MetricsMode) ([]*metricEntry, error) {
	byName := map[string]*metricEntry{}
	for i, mode := range modes {
		for _, name := range slices.Sorted(maps.Keys(mode.metrics)) {
			m := mode.metrics[name]
			e, ok := byName[name]
			if !ok {
				e = &metricEntry{metricDoc: &metricDoc{name: m.name, labels: m.labels, variable: m.variable}}
				byName[name] = e
			}
			if !slices.Equal(e.labels, m.labels) {
				return nil, fmt.Errorf("metric %s has labels %v in one configuration and %v in another", name, e.labels, m.labels)
			}
			if m.kind != "" {
				if err := e.merge(m); err != nil {
					return nil, err
				}
			}
			e.in, e.helps = append(e.in, i), append(e.helps, m.help)
		}
	}
	var out []*metricEntry
	for _, name := range slices.Sorted(maps.Keys(byName)) {
		e := byName[name]
		if e.kind == "" {
			return nil, fmt.Errorf("metric %s gave no sample in any configuration, so its type is unknown: have the reference's agents make one", name)
		}
		out = append(out, e)
	}
	return out, nil
}

// merge takes m's type, buckets and quantiles, which must agree with those
// another mode showed.
func (e *metricEntry) merge(m *metricDoc) error {
	if e.kind != "" && (e.kind != m.kind || !slices.Equal(e.buckets, m.buckets) || !slices.Equal(e.quantiles, m.quantiles)) {
		return fmt.Errorf("metric %s is a %s %v in one configuration and a %s %v in another", m.name, e.kind, e.buckets, m.kind, m.buckets)
	}
	e.kind, e.buckets, e.quantiles = m.kind, m.buckets, m.quantiles
	return nil
}

func writeMetricsIntro(b *bytes.Buffer, modes []MetricsMode) {
	b.WriteString(`# Metrics reference

Every metric pivirt-agent serves on its metrics port (` + "`server.metrics.addr`" + `, at
` + "`server.metrics.path`" + `), in the Prometheus text format. This page is generated from the
registries of agents started for it (` + "`make docs`" + `): each registered collector describes its
metrics, and a sample of each gives its type and buckets; the tests fail when the page is
stale. pitrust serve and pivirtd-sim serve no metrics.

- **labels**: the label names; there is a series per combination of values in use.
- **Only with**: the metric is registered only when the agent runs with those keys set (one
  of the sets joined by "or"): the fewest keys that tell the agents below that registered it
  from those that did not.
- Buckets are a histogram's upper bounds (` + "`le`" + `), ` + "`+Inf`" + ` left out.

The agents the page is made from: one in the base configuration (TLS off, no access control,
a backend, a registered service instance), and one with each of:

`)
	for _, m := range modes[1:] {
		b.WriteString("- " + keyList(m.Keys, " and ") + "\n")
	}
}

// describeEntry is the description cell of e: its help (each mode's when
// they differ), when it is registered, its buckets or quantiles.
func describeEntry(e *metricEntry, modes []MetricsMode) (string, error) {
	conds, err := registeredWhen(e.in, modes)
	if err != nil {
		return "", fmt.Errorf("metric %s: %w", e.name, err)
	}
	var parts []string
	if allSame(e.helps) {
		parts = append(parts, mdText(e.helps[0]))
	} else {
		for k, i := range e.in {
			parts = append(parts, "With "+keyList(conds[i], " and ")+": "+mdText(e.helps[k]))
		}
	}
	if len(e.in) < len(modes) {
		var alternatives []string
		for _, c := range uniqueConditions(e.in, conds) {
			alternatives = append(alternatives, keyList(c, " and "))
		}
		parts = append(parts, "*Only with "+joinAlternatives(alternatives)+".*")
	}
	if len(e.buckets) > 0 {
		parts = append(parts, "Buckets: "+floatList(e.buckets)+".")
	}
	if len(e.quantiles) > 0 {
		parts = append(parts, "Quantiles: "+floatList(e.quantiles)+".")
	}
	return strings.Join(parts, "<br>"), nil
}

// registeredWhen says, for each mode that registered a metric (in), the
// fewest of its keys that every mode setting them registered it too: the
// condition the metric is registered on, as far as the modes tell. A
// metric that a mode did not register although it sets all the keys of a
// mode that did has no such condition: an error.
func registeredWhen(in []int, modes []MetricsMode) (map[int][]string, error) {
	conds := map[int][]string{}
	for _, i := range in {
		c, ok := smallestCondition(modes[i].Keys, in, modes)
		if !ok {
			return nil, fmt.Errorf("registered with %s but not in every configuration that sets those keys", keyList(modes[i].Keys, " and "))
		}
		conds[i] = c
	}
	return conds, nil
}

// smallestCondition is the smallest subset of keys (the first of its size,
// in their order) that no mode outside in sets all of.
func smallestCondition(keys []string, in []int, modes []MetricsMode) ([]string, bool) {
	for size := 0; size <= len(keys); size++ {
		for _, subset := range subsets(keys, size) {
			if !slices.ContainsFunc(outside(in, len(modes)), func(j int) bool { return setsAll(modes[j].Keys, subset) }) {
				return subset, true
			}
		}
	}
	return nil, false
}

// subsets are the subsets of keys of size n, in their order.
func subsets(keys []string, n int) [][]string {
	if n == 0 {
		return [][]string{nil}
	}
	var out [][]string
	for i := range keys {
		for _, rest := range subsets(keys[i+1:], n-1) {
			out = append(out, append([]string{keys[i]}, rest...))
		}
	}
	return out
}

// outside are the indexes below n that are not in in.
func outside(in []int, n int) []int {
	var out []int
	for j := range n {
		if !slices.Contains(in, j) {
			out = append(out, j)
		}
	}
	return out
}

func setsAll(keys, want []string) bool {
	return !slices.ContainsFunc(want, func(k string) bool { return !slices.Contains(keys, k) })
}

// uniqueConditions are the conditions of the modes in, each once, without
// those that another one's keys already imply.
func uniqueConditions(in []int, conds map[int][]string) [][]string {
	var out [][]string
	for _, i := range in {
		c := conds[i]
		implied := slices.ContainsFunc(in, func(j int) bool {
			d := conds[j]
			return setsAll(c, d) && (len(d) < len(c) || j < i && len(d) == len(c))
		})
		if !implied {
			out = append(out, c)
		}
	}
	return out
}

// joinAlternatives is "a", "a or b", "a, b or c".
func joinAlternatives(s []string) string {
	if len(s) <= 1 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " or " + s[len(s)-1]
}

// keyList is keys (configuration keys, label names) in backticks joined
// by sep; "—" for none.
func keyList(keys []string, sep string) string {
	if len(keys) == 0 {
		return "—"
	}
	quoted := make([]string, len(keys))
	for i, k := range keys {
		quoted[i] = "`" + k + "`"
	}
	return strings.Join(quoted, sep)
}

func allSame(s []string) bool {
	for _, v := range s[1:] {
		if v != s[0] {
			return false
		}
	}
	return true
}

func floatList(fs []float64) string {
	s := make([]string, len(fs))
	for i, f := range fs {
		s[i] = strconv.FormatFloat(f, 'g', -1, 64)
	}
	return strings.Join(s, ", ")
}

// metricGroups title the subsystems of the page, in their order; a metric
// of another prefix gets a group of its own (pivirt_<subsystem>_ or its
// first word), after these.
var metricGroups = []metricGroupName{
	{"pivirt_api_", "API port"},
	{"pivirt_mesh_", "Backend proxy"},
	{"service_discovery_", "Service registry"},
	{"pivirt_raft_", "Raft"},
	{"pivirt_gossip_", "Gossip"},
	{"pivirt_config_", "Cluster settings"},
	{"pivirt_schedule_", "Power schedules"},
	{"pivirt_snapshot_", "Snapshots"},
	{"pivirt_tls_", "TLS and certificates"},
	{"go_", "Go runtime"},
	{"process_", "Process"},
}

type metricGroupName struct{ prefix, title string }

// metricGroup is the group of a metric name.
func metricGroup(name string) metricGroupName {
	for _, g := range metricGroups {
		if strings.HasPrefix(name, g.prefix) {
			return g
		}
	}
	words := strings.SplitN(name, "_", 3)
	prefix := words[0] + "_"
	if words[0] == "pivirt" && len(words) == 3 {
		prefix += words[1] + "_"
	}
	return metricGroupName{prefix: prefix, title: strings.TrimSuffix(prefix, "_")}
}

// orderedGroups are the groups of the page: metricGroups' first, then the
// others by prefix.
func orderedGroups(groups map[string][]*metricEntry) []metricGroupName {
	var out []metricGroupName
	for _, g := range metricGroups {
		if groups[g.prefix] != nil {
			out = append(out, g)
		}
	}
	for _, prefix := range slices.Sorted(maps.Keys(groups)) {
		if !slices.ContainsFunc(metricGroups, func(g metricGroupName) bool { return g.prefix == prefix }) {
			out = append(out, metricGroup(groups[prefix][0].name))
		}
	}
	return out
}
