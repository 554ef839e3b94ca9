package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// verifyReplicas answers ClusterService.VerifyReplicas on the leader: it
// appends a checkpoint, then compares every server's state hash at its
// index with its own (DESIGN.md, "Replicas checked against each other").
func (a *Agent) verifyReplicas(ctx context.Context) (*clusterv1.VerifyReplicasResponse, error) {
	// A server that installed a snapshot past the checkpoint holds no
	// hash at its index: a new checkpoint is tried (a few times).
	for attempt := 1; ; attempt++ {
		resp, err := a.verifyOnce(ctx)
		if err != nil || attempt == 3 || !missedCheckpoint(resp) {
			return resp, err
		}
	}
}

// missedCheckpoint reports whether a server of resp could not be checked
// only because it holds no hash at the checkpoint.
func missedCheckpoint(resp *clusterv1.VerifyReplicasResponse) bool {
	for _, n := range resp.GetNodes() {
		if strings.Contains(n.GetError(), fsm.ErrNoCheckpoint.Error()) {
			return true
		}
	}
	return false
}

func (a *Agent) verifyOnce(ctx context.Context) (*clusterv1.VerifyReplicasResponse, error) {
	if a.etcdMode() {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("etcd mode keeps the state in etcd, not in replicas of the agents: compare etcd's members with etcdctl endpoint hashkv"))
	}
	cmd := fsm.CheckpointCommand()
	cmd.Time = timestamppb.Now()
	data, err := fsm.Encode(cmd)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	resp, _, err := a.cons.Apply(actx, data)
	cancel()
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("append the checkpoint: %w", err))
	}
	res, ok := resp.(*fsm.Result)
	if !ok || res.Index == 0 {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("append the checkpoint: result %T", resp))
	}
	index := res.Index
	hctx, cancel := context.WithTimeout(ctx, stateHashTimeout)
	defer cancel()
	own, err := a.fsm.CheckpointHash(hctx, index)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("hash this node's state at %d: %w", index, err))
	}
	servers, err := a.work.VersionServers(ctx)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("read the servers: %w", err))
	}
	out := &clusterv1.VerifyReplicasResponse{Index: index, ClusterVersion: own.Version.String(), Agree: true}
	out.Nodes = make([]*clusterv1.ReplicaState, len(servers))
	var wg sync.WaitGroup
	for i, s := range servers {
		rs := &clusterv1.ReplicaState{NodeId: s.ID, Name: s.Name}
		out.Nodes[i] = rs
		if s.ID == a.nodeID {
			rs.Leader, rs.Name, rs.Tables = true, a.cfg.NodeName, tableHashes(own)
			continue
		}
		wg.Go(func() { a.compareReplica(hctx, s, rs, own) })
	}
	wg.Wait()
	for _, rs := range out.Nodes {
		if len(rs.GetDiffer()) > 0 || rs.GetError() != "" {
			out.Agree = false
		}
	}
	return out, nil
}

// compareReplica asks server s for its state hash at own's index and
// names the tables that differ from own.
func (a *Agent) compareReplica(ctx context.Context, s cluster.ServerVersion, rs *clusterv1.ReplicaState, own *fsm.StateHash) {
	switch {
	case !s.Known:
		rs.Error = "not in gossip: not checked"
		return
	case s.Version.Less(fsm.Version0_1):
		rs.Error = fmt.Sprintf("not checked: it runs release %q, which keeps no state hashes (compare its snapshot: pvcli --endpoint … snapshot save --stale, pvcli snapshot inspect --hash)", s.Release)
		return
	}
	m, ok := a.gossip.ServerByID(s.ID, s.Address)
	if !ok || m.Meta.InternalAddr == "" {
		rs.Error = "no internal address in gossip: not checked"
		return
	}
	resp, err := a.pool.Node(m.Meta.InternalAddr).StateHash(ctx, connect.NewRequest(&nodev1.StateHashRequest{Index: own.Index}))
	if err != nil {
		rs.Error = "not checked: " + connect.CodeOf(err).String() + ": " + oneLine(errMessage(err))
		return
	}
	rs.Tables = resp.Msg.GetTables()
	mine := tableHashes(own)
	for _, t := range mine {
		var theirs *clusterv1.TableHash
		for _, x := range rs.Tables {
			if x.GetName() == t.GetName() {
				theirs = x
			}
		}
		if theirs == nil || theirs.GetSum() != t.GetSum() || theirs.GetRecords() != t.GetRecords() {
			rs.Differ = append(rs.Differ, t.GetName())
		}
	}
}

func errMessage(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// oneLine joins the lines of s.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// replicaCheck is the result of the leader's last periodic check.
type replicaCheck struct {
	mu     sync.Mutex
	at     time.Time
	index  uint64
	differ []string // "node: table, table"
	errors []string // "node: why it was not checked"
}

// startReplicaCheck starts the periodic replica check
// (cluster.raft.replica_check) and the snapshot of a downgrade, in Raft
// mode.
func (a *Agent) startReplicaCheck() error {
	if !a.etcdMode() {
		a.wg.Go(a.runSnapshotOnVersionChange)
	}
	rc := a.cfg.Cluster.Raft.ReplicaCheck
	if a.etcdMode() || !rc.Enabled {
		return nil
	}
	a.wg.Go(func() { a.runReplicaCheck(rc.Interval.Std()) })
	return nil
}

// runReplicaCheck compares the replicas every interval while this node
// leads (cluster.raft.replica_check).
func (a *Agent) runReplicaCheck(interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		if !a.leaderReady() {
			continue
		}
		ctx, cancel := context.WithTimeout(a.ctx, interval)
		resp, err := a.verifyReplicas(ctx)
		cancel()
		if err != nil {
			if a.ctx.Err() == nil {
				a.logger.Warn("replica check: could not compare the replicas; trying again at the next interval", "error", err)
			}
			continue
		}
		a.recordReplicaCheck(resp)
	}
}

// recordReplicaCheck keeps a check's result for /ready and the metrics,
// and logs what differs.
func (a *Agent) recordReplicaCheck(resp *clusterv1.VerifyReplicasResponse) {
	var differ, unchecked []string
	pairs := 0
	for _, n := range resp.GetNodes() {
		if len(n.GetDiffer()) > 0 {
			pairs += len(n.GetDiffer())
			differ = append(differ, n.GetName()+": "+strings.Join(n.GetDiffer(), ", "))
			a.logger.Error("replica check: a server's replicated state differs from the leader's: it diverged; replace its data dir (docs/backup.md, \"A damaged data dir\")",
				"node", n.GetName(), "node_id", n.GetNodeId(), "tables", strings.Join(n.GetDiffer(), ","), "index", resp.GetIndex())
		}
		if n.GetError() != "" {
			unchecked = append(unchecked, n.GetName()+": "+n.GetError())
		}
	}
	a.replicaMetrics.mismatches.Set(float64(pairs))
	result := "agree"
	switch {
	case len(differ) > 0:
		result = "differ"
	case len(unchecked) > 0:
		result = "incomplete"
	}
	a.replicaMetrics.checks.WithLabelValues(result).Inc()
	if result == "agree" {
		a.logger.Debug("replica check: every server holds the leader's state", "index", resp.GetIndex())
	}
	a.replicas.mu.Lock()
	a.replicas.at, a.replicas.index, a.replicas.differ, a.replicas.errors = time.Now(), resp.GetIndex(), differ, unchecked
	a.replicas.mu.Unlock()
}

// replicaReadiness is the /ready check of the last replica check, on the
// leader: a warning, never a failure (the leader itself is fine).
func (a *Agent) replicaReadiness() (string, bool) {
	a.replicas.mu.Lock()
	defer a.replicas.mu.Unlock()
	switch {
	case a.replicas.at.IsZero():
		return "", false
	case len(a.replicas.differ) > 0:
		return fmt.Sprintf("degraded: at index %d the replicated state of %s differs from the leader's (checked %s)",
			a.replicas.index, strings.Join(a.replicas.differ, "; "), a.replicas.at.UTC().Format(time.RFC3339)), true
	case len(a.replicas.errors) > 0:
		return fmt.Sprintf("ok: the servers checked agree at index %d; not checked: %s", a.replicas.index, strings.Join(a.replicas.errors, "; ")), true
	}
	return fmt.Sprintf("ok: every server holds the leader's state at index %d (checked %s)", a.replicas.index, a.replicas.at.UTC().Format(time.RFC3339)), true
}

// replicaMetrics are the metrics of the leader's replica checks.
type replicaMetrics struct {
	mismatches prometheus.Gauge
	checks     *prometheus.CounterVec
}

func newReplicaMetrics(reg prometheus.Registerer) replicaMetrics {
	m := replicaMetrics{
		mismatches: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_raft_replica_mismatches",
			Help: "Tables, summed over the servers, whose replicated state differed from the leader's at the leader's last replica check (0: every server checked agrees). Set on the leader only.",
		}),
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_raft_replica_checks_total",
			Help: "The leader's replica checks, by result: agree, differ (a server's state differs), incomplete (a server could not be checked).",
		}, []string{"result"}),
	}
	reg.MustRegister(m.mismatches, m.checks)
	return m
}

// lagCheck caches behindLeader's verdict: /ready may be asked often, and
// each verdict costs the leader a read index. One ask runs at a time.
type lagCheck struct {
	mu sync.Mutex
	// at is when verdict was reached.
	at      time.Time
	verdict string
	// running is closed when the ask under way ends; nil when none is.
	running chan struct{}
}

// lagCacheFor is how long a verdict of behindLeader is reused.
const lagCacheFor = time.Second

// Bounds of behindLeader: asking the leader for its commit index, then
// waiting for this node to apply it.
const (
	lagAskTimeout  = time.Second
	lagWaitTimeout = 3 * time.Second
)

// behindLeader is "" when this follower applies what the leader committed
// (it reaches the leader's commit index of now within lagWaitTimeout),
// else what is wrong: a follower that cannot follow (it cannot install the
// leader's snapshot, its log lacks entries) has a recent leader contact
// and a commit index of its own that it applied, and would look ready.
//
// A verdict younger than lagCacheFor is reused; else callers share one ask
// (at most lagAskTimeout+lagWaitTimeout), and one whose ctx ends first
// gets the last verdict: probes never queue behind each other.
func (a *Agent) behindLeader(ctx context.Context) string {
	a.lag.mu.Lock()
	if time.Since(a.lag.at) < lagCacheFor {
		defer a.lag.mu.Unlock()
		return a.lag.verdict
	}
	done := a.lag.running
	if done == nil {
		done = make(chan struct{})
		a.lag.running = done
		go func() {
			v := a.askLeaderLag()
			a.lag.mu.Lock()
			a.lag.at, a.lag.verdict, a.lag.running = time.Now(), v, nil
			a.lag.mu.Unlock()
			close(done)
		}()
	}
	last := a.lag.verdict
	a.lag.mu.Unlock()
	select {
	case <-done:
		a.lag.mu.Lock()
		defer a.lag.mu.Unlock()
		return a.lag.verdict
	case <-ctx.Done():
		return last
	}
}

func (a *Agent) askLeaderLag() string {
	id, addr := a.cons.Leader()
	m, ok := a.gossip.ServerByID(id, addr)
	if !ok || m.Meta.InternalAddr == "" {
		return "" // no way to ask: the other checks decide
	}
	ctx, cancel := context.WithTimeout(a.ctx, lagAskTimeout)
	resp, err := a.pool.Node(m.Meta.InternalAddr).ReadIndex(ctx, connect.NewRequest(&nodev1.ReadIndexRequest{}))
	cancel()
	if err != nil {
		return "" // the leader is busy or changing: the other checks decide
	}
	want := resp.Msg.GetIndex()
	wctx, wcancel := context.WithTimeout(a.ctx, lagWaitTimeout)
	defer wcancel()
	if err := a.fsm.WaitApplied(wctx, want); err != nil {
		return fmt.Sprintf("behind the leader: it had committed index %d, this node applied %d and did not reach it within %s (it cannot install the leader's snapshot, or cannot keep up)",
			want, a.fsm.AppliedIndex(), lagWaitTimeout)
	}
	return ""
}
