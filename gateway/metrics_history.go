package gateway

import (
	"context"
	"sync"
	"time"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// The agent's metrics history (WatchMetrics): a sample every
// MetricsInterval, MetricsSamples of them kept (10 minutes).
const (
	MetricsInterval = 5 * time.Second
	MetricsSamples  = 120
)

// metricsSubBuffer is how many samples a watcher may fall behind before
// its stream is ended (40 seconds' worth: a watcher that slow is stuck;
// it reconnects and gets the history again).
const metricsSubBuffer = 8

// MetricsHistory is a ring of the newest samples and the streams that
// follow it. Samples are never changed once added: the streams send the
// same messages without copying them.
type MetricsHistory struct {
	mu   sync.Mutex
	ring []*clusterv1.MetricsSample
	// next is where the next sample goes; full once it wrapped.
	next int
	full bool
	subs map[*metricsSub]struct{}
}

type metricsSub struct {
	ch chan *clusterv1.MetricsSample
	// closed: ch was closed because the watcher fell behind (mu).
	closed bool
}

// NewMetricsHistory returns an empty history keeping size samples (<= 0:
// MetricsSamples).
func NewMetricsHistory(size int) *MetricsHistory {
	if size <= 0 {
		size = MetricsSamples
	}
	return &MetricsHistory{ring: make([]*clusterv1.MetricsSample, size), subs: map[*metricsSub]struct{}{}}
}

// Add appends a sample, dropping the oldest when the ring is full, and
// hands it to every watcher without waiting: a watcher whose buffer is
// full is cut off (its channel closed).
func (h *MetricsHistory) Add(s *clusterv1.MetricsSample) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ring[h.next] = s
	h.next++
	if h.next == len(h.ring) {
		h.next, h.full = 0, true
	}
	for sub := range h.subs {
		select {
		case sub.ch <- s:
		default:
			close(sub.ch)
			sub.closed = true
			delete(h.subs, sub)
		}
	}
}

// Samples returns the samples kept, oldest first.
func (h *MetricsHistory) Samples() []*clusterv1.MetricsSample {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.samplesLocked()
}

func (h *MetricsHistory) samplesLocked() []*clusterv1.MetricsSample {
	if !h.full {
		return append([]*clusterv1.MetricsSample(nil), h.ring[:h.next]...)
	}
	out := make([]*clusterv1.MetricsSample, 0, len(h.ring))
	out = append(out, h.ring[h.next:]...)
	return append(out, h.ring[:h.next]...)
}

// Subscribe returns the samples kept and a channel of every sample added
// after them (none missed, none repeated); the channel is closed when the
// watcher falls behind by more than a few samples. stop ends the
// subscription.
func (h *MetricsHistory) Subscribe() (history []*clusterv1.MetricsSample, next <-chan *clusterv1.MetricsSample, stop func()) {
	sub := &metricsSub{ch: make(chan *clusterv1.MetricsSample, metricsSubBuffer)}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.subs[sub] = struct{}{}
	return h.samplesLocked(), sub.ch, func() {
		h.mu.Lock()
		delete(h.subs, sub)
		h.mu.Unlock()
	}
}

// Run takes a sample at once and then at every tick until ctx ends;
// sample gets the tick's time. One goroutine per agent runs it.
func (h *MetricsHistory) Run(ctx context.Context, tick <-chan time.Time, now func() time.Time, sample func(ctx context.Context, at time.Time) *clusterv1.MetricsSample) {
	at := now()
	for {
		if s := sample(ctx, at); s != nil && ctx.Err() == nil {
			h.Add(s)
		}
		select {
		case <-ctx.Done():
			return
		case at = <-tick:
		}
	}
}

// Replication is, on the Raft leader, the replication progress of every
// other server of the configuration, from the same view as Peers (each
// server's status over its internal port); leader is false, with no
// peers, on any other node and in etcd mode (no Raft). A server's lag is
// Peer.trailing: the leader's last log index minus the server's, which is
// its match index once the leader's entries reached it.
func (h *ClusterService) Replication(ctx context.Context) (peers []*clusterv1.PeerReplication, leader bool, err error) {
	if h.cfg.Direct {
		return nil, false, nil
	}
	if id, _ := h.raft.Leader(); id != h.cfg.NodeID {
		return nil, false, nil
	}
	list, _, err := h.peerList(ctx)
	if err != nil {
		return nil, true, err
	}
	return replicationOf(list, h.cfg.NodeID), true, nil
}

// replicationOf turns a Peers view into the samples' form, leaving out
// the server self.
func replicationOf(list []*clusterv1.Peer, self string) []*clusterv1.PeerReplication {
	out := make([]*clusterv1.PeerReplication, 0, len(list))
	for _, p := range list {
		if p.GetNodeId() == self {
			continue
		}
		r := &clusterv1.PeerReplication{NodeId: p.GetNodeId(), Name: p.GetName(), Voter: p.GetVoter()}
		if st := p.GetState(); st != clusterv1.RaftState_RAFT_STATE_UNREACHABLE && st != clusterv1.RaftState_RAFT_STATE_UNSPECIFIED {
			r.Reachable = true
			r.Lag = p.GetTrailing()
			r.LastContactMs = p.GetLastContact().AsDuration().Milliseconds()
		}
		out = append(out, r)
	}
	return out
}
