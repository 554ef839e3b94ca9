package agent

import (
	"context"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// replicationTimeout bounds the status queries of one sample (a server
// that does not answer within it is reported unreachable).
const replicationTimeout = 2 * time.Second

// runMetricsHistory samples this node's metrics into its history every
// gateway.MetricsInterval until the agent stops (WatchMetrics streams
// them).
func (a *Agent) runMetricsHistory() error {
	t := time.NewTicker(gateway.MetricsInterval)
	a.wg.Go(func() {
		defer t.Stop()
		a.history.Run(a.ctx, t.C, time.Now, a.metricsSample)
	})
	return nil
}

// metricsSample reads the sample at: the replication progress of the Raft
// servers (on the leader), the mesh's counters per backend cluster and the
// API port's.
func (a *Agent) metricsSample(ctx context.Context, at time.Time) *clusterv1.MetricsSample {
	s := &clusterv1.MetricsSample{Time: timestamppb.New(at)}
	rctx, cancel := context.WithTimeout(ctx, replicationTimeout)
	peers, leader, err := a.api.Replication(rctx)
	cancel()
	if err != nil && ctx.Err() == nil {
		a.logger.Debug("metrics sample: replication progress", "err", err)
	}
	s.Leader, s.Peers = leader, peers
	if a.meshStats != nil {
		totals := a.meshStats.Totals()
		for name, t := range totals {
			s.Backends = append(s.Backends, &clusterv1.BackendCounters{Cluster: name, Requests: t.Requests, Errors: t.Errors})
		}
		slices.SortFunc(s.Backends, func(x, y *clusterv1.BackendCounters) int { return strings.Compare(x.Cluster, y.Cluster) })
	}
	if a.apiMetrics != nil {
		s.ApiRequests, s.ApiErrors = a.apiMetrics.Totals()
	}
	return s
}
