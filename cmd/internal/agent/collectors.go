package agent

import (
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pilab.hu/pivirt-agent/cluster"
)

// registry is the registry /metrics serves. It remembers the collectors
// registered with it, so that the metrics reference (docs/metrics.md) is
// made from the collectors a running agent really holds: a metric added
// anywhere the agent registers one is in the reference without a list to
// keep by hand.
type registry struct {
	*prometheus.Registry
	mu         sync.Mutex
	collectors []prometheus.Collector
}

func newRegistry() *registry {
	return &registry{Registry: prometheus.NewRegistry()}
}

// Register registers c and remembers it.
func (r *registry) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.collectors = append(r.collectors, c)
	return nil
}

// MustRegister is Register of each of cs, panicking on an error as
// prometheus.Registry.MustRegister does. Registry's own would register
// past Register and forget them.
func (r *registry) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// Collectors are the collectors registered so far, in their order.
func (r *registry) Collectors() []prometheus.Collector {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.collectors)
}

// stateCollector exposes, at each scrape, the replicated service registry,
// the gossip view and the Raft state of this node:
// service_discovery_services, service_discovery_instances{service,health},
// pivirt_gossip_members{state}, pivirt_raft_leader, _term, _commit_index,
// _applied_index and _last_contact_seconds.
type stateCollector struct {
	a                           *Agent
	services, instances, gossip *prometheus.Desc
	leader, term, commit, apply *prometheus.Desc
	lastContact                 *prometheus.Desc
	verifyFailed, verifyPassed  *prometheus.Desc
}

func newStateCollector(a *Agent) *stateCollector {
	return &stateCollector{
		a:         a,
		services:  prometheus.NewDesc("service_discovery_services", "Services registered in the replicated registry (this node's state).", nil, nil),
		instances: prometheus.NewDesc("service_discovery_instances", "Service instances registered, by service and health (this node's state).", []string{"service", "health"}, nil),
		gossip:    prometheus.NewDesc("pivirt_gossip_members", "Members of the gossip ring by state, as this node sees them.", []string{"state"}, nil),
		leader:    prometheus.NewDesc("pivirt_raft_leader", "1 when this node is the Raft leader.", nil, nil),
		term:      prometheus.NewDesc("pivirt_raft_term", "This node's current Raft term.", nil, nil),
		commit:    prometheus.NewDesc("pivirt_raft_commit_index", "The highest Raft index this node knows committed.", nil, nil),
		apply:     prometheus.NewDesc("pivirt_raft_applied_index", "The highest Raft index applied to this node's state.", nil, nil),
		lastContact: prometheus.NewDesc("pivirt_raft_last_contact_seconds",
			"Seconds since this follower last heard from the leader (0 on the leader).", nil, nil),
		verifyFailed: prometheus.NewDesc("pivirt_raft_log_verification_failures_total",
			"Raft log ranges whose checksum on this node's disk differed from the leader's (cluster.raft.log_verification): storage damage.", nil, nil),
		verifyPassed: prometheus.NewDesc("pivirt_raft_log_verifications_total",
			"Raft log ranges this node verified against the leader's checksums, by result (passed, failed, skipped).", []string{"result"}, nil),
	}
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.services
	ch <- c.instances
	ch <- c.gossip
	for _, d := range []*prometheus.Desc{c.leader, c.term, c.commit, c.apply, c.lastContact, c.verifyFailed, c.verifyPassed} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	if s := c.a.store; s != nil {
		st := s.Status()
		leader := 0.0
		if st.State == "Leader" {
			leader = 1
		}
		since := 0.0
		if st.State != "Leader" {
			// A follower that never heard from a leader has no sample
			// (0 would look fresh).
			since = -1
			if !st.LastContact.IsZero() {
				since = time.Since(st.LastContact).Seconds()
			}
		}
		ch <- prometheus.MustNewConstMetric(c.leader, prometheus.GaugeValue, leader)
		ch <- prometheus.MustNewConstMetric(c.term, prometheus.GaugeValue, float64(st.Term))
		ch <- prometheus.MustNewConstMetric(c.commit, prometheus.GaugeValue, float64(st.CommitIndex))
		ch <- prometheus.MustNewConstMetric(c.apply, prometheus.GaugeValue, float64(st.AppliedIndex))
		if since >= 0 {
			ch <- prometheus.MustNewConstMetric(c.lastContact, prometheus.GaugeValue, since)
		}
		lv := s.LogVerification()
		ch <- prometheus.MustNewConstMetric(c.verifyFailed, prometheus.CounterValue, float64(lv.Failed))
		ch <- prometheus.MustNewConstMetric(c.verifyPassed, prometheus.CounterValue, float64(lv.Passed), "passed")
		ch <- prometheus.MustNewConstMetric(c.verifyPassed, prometheus.CounterValue, float64(lv.Failed), "failed")
		ch <- prometheus.MustNewConstMetric(c.verifyPassed, prometheus.CounterValue, float64(lv.Skipped), "skipped")
	}
	if f := c.a.fsm; f != nil {
		// The counts the FSM keeps per (service, health): one row each,
		// not a scan of every instance per scrape.
		counts := f.State().ServiceCounts()
		services := 0
		for i, k := range counts {
			if i == 0 || counts[i-1].Service != k.Service {
				services++
			}
			ch <- prometheus.MustNewConstMetric(c.instances, prometheus.GaugeValue, float64(k.Instances), k.Service, healthName(k.Health.String()))
		}
		ch <- prometheus.MustNewConstMetric(c.services, prometheus.GaugeValue, float64(services))
	}
	if g := c.a.gossip; g != nil {
		states := map[string]int{}
		for _, s := range []cluster.MemberStatus{cluster.StatusAlive, cluster.StatusSuspect, cluster.StatusFailed, cluster.StatusLeft} {
			states[s.String()] = 0
		}
		for _, m := range g.Members() {
			states[m.Status.String()]++
		}
		for s, n := range states {
			ch <- prometheus.MustNewConstMetric(c.gossip, prometheus.GaugeValue, float64(n), s)
		}
	}
}

// healthName is HEALTH_PASSING as "passing".
func healthName(enum string) string {
	const prefix = "HEALTH_"
	if len(enum) > len(prefix) && enum[:len(prefix)] == prefix {
		enum = enum[len(prefix):]
	}
	out := []byte(enum)
	for i, b := range out {
		if b >= 'A' && b <= 'Z' {
			out[i] = b + 'a' - 'A'
		}
	}
	return string(out)
}
