package agent

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/leader"
	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// allows reports whether the cluster version allows a feature: what a
// release added is used only once every server runs it (DESIGN.md,
// "Cluster version").
func (a *Agent) allows(feature string) bool {
	return a.fsm.Version().Enabled(feature)
}

// requireFeature is nil when the cluster version allows feature, else a
// FailedPrecondition that says what the caller asked for and which
// servers must be upgraded first.
func (a *Agent) requireFeature(feature, what string) error {
	v := a.fsm.Version()
	if v.Enabled(feature) {
		return nil
	}
	since, _ := fsm.FeatureSince(feature)
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s needs cluster version %s, and the cluster is at %s: %s; pvcli operator upgrade status shows each server",
		what, since, v, a.olderServers(since)))
}

// olderServers names the servers whose release is older than v, as this
// node sees them in gossip.
func (a *Agent) olderServers(v fsm.Version) string {
	var names []string
	for _, m := range a.gossip.Members() {
		if m.Status == cluster.StatusLeft || m.Meta.Role != cluster.RoleServer {
			continue
		}
		if mv := cluster.AnnouncedVersion(m.Meta); mv.Less(v) {
			rel := m.Meta.Version
			if m.Meta.Protocol < cluster.MinVersionProtocol {
				rel += ", before cluster versions"
			}
			names = append(names, fmt.Sprintf("%s (%s)", m.Name, rel))
		}
	}
	if len(names) == 0 {
		return "every server runs it; the leader raises the cluster version within seconds"
	}
	return "upgrade " + strings.Join(names, ", ")
}

// versionedStatus adds this node's release, the features it knows, its
// state's cluster version and a halt to the Raft status it answers with.
type versionedStatus struct {
	cluster.StatusSource
	a *Agent
}

func (s versionedStatus) NodeStatus() *nodev1.StatusResponse {
	st := s.StatusSource.NodeStatus()
	st.Release = version.Version
	for _, f := range fsm.Features {
		st.Features = append(st.Features, f.Name)
	}
	st.ClusterVersion = s.a.fsm.Version().String()
	if h := s.a.fsm.Halted(); h != nil {
		st.Halted = h.Error()
	}
	return st
}

// stateHash answers NodeService.StateHash: this node's state hash at a
// checkpoint.
func (a *Agent) stateHash(ctx context.Context, index uint64) (*nodev1.StateHashResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, stateHashTimeout)
	defer cancel()
	h, err := a.fsm.CheckpointHash(ctx, index)
	if err != nil {
		if ctx.Err() != nil {
			return nil, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("this node has not applied index %d yet (applied %d)", index, a.fsm.AppliedIndex()))
		}
		return nil, gateway.ConnectError(err)
	}
	return &nodev1.StateHashResponse{Index: h.Index, ClusterVersion: h.Version.String(), Tables: tableHashes(h)}, nil
}

// stateHashTimeout bounds waiting for a checkpoint to be applied and
// hashed.
const stateHashTimeout = 20 * time.Second

func tableHashes(h *fsm.StateHash) []*clusterv1.TableHash {
	out := make([]*clusterv1.TableHash, 0, len(h.Tables))
	for _, t := range h.Tables {
		out = append(out, &clusterv1.TableHash{Name: t.Name, Records: t.Records, Sum: hex.EncodeToString(t.Sum[:])})
	}
	return out
}

// clusterVersion answers ClusterService.ClusterVersion, on any node.
func (a *Agent) clusterVersion(ctx context.Context) (*clusterv1.ClusterVersionResponse, error) {
	st := a.fsm.State()
	cur, rec, err := st.ClusterVersion()
	if err != nil {
		return nil, gateway.ConnectError(err)
	}
	out := &clusterv1.ClusterVersionResponse{
		ClusterVersion: cur.String(), SetIndex: rec.GetIndex(), SetAt: rec.GetSetAt(),
		Features: fsm.FeaturesAt(cur), Release: version.Version, Latest: fsm.Latest.String(),
	}
	if pin, _, ok := leader.DowngradeTarget(st); ok {
		out.Downgrade = pin.String()
	}
	servers, err := a.work.VersionServers(ctx)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("read the servers: %w", err))
	}
	low, _ := cluster.LowestVersion(servers)
	out.Lowest = low.String()
	out.Servers = make([]*clusterv1.ServerVersion, len(servers))
	states := make([]*nodev1.StatusResponse, len(servers))
	var wg sync.WaitGroup
	for i, s := range servers {
		sv := &clusterv1.ServerVersion{
			NodeId: s.ID, Name: s.Name, Release: s.Release, Protocol: int32(s.Protocol), Version: s.Version.String(),
			Voter: s.Voter, GossipStatus: memberStatus(s.Status),
		}
		out.Servers[i] = sv
		if !s.Known {
			sv.Error = "not in gossip: its version is unknown (counts as the oldest)"
			continue
		}
		wg.Go(func() { states[i] = a.askServer(ctx, s, sv) })
	}
	wg.Wait()
	leaderID, _ := a.cons.Leader()
	for i, st := range states {
		if st != nil && servers[i].ID == leaderID {
			out.Leader, out.LeaderAppliedIndex = servers[i].Name, st.GetAppliedIndex()
		}
	}
	for i, sv := range out.Servers {
		st := states[i]
		if st == nil || sv.Halted != "" {
			continue
		}
		// A server within caughtUpSlack entries of the leader, at the
		// moments they answered, is caught up.
		sv.CaughtUp = out.LeaderAppliedIndex > 0 && sv.AppliedIndex+caughtUpSlack >= out.LeaderAppliedIndex
	}
	return out, nil
}

// askServer fills in what a server says of itself: its applied index,
// the features it knows, a halt; it returns the server's status (nil when
// it did not answer).
func (a *Agent) askServer(ctx context.Context, s cluster.ServerVersion, sv *clusterv1.ServerVersion) *nodev1.StatusResponse {
	var st *nodev1.StatusResponse
	if s.ID == a.nodeID {
		st = a.nodeStatus().NodeStatus()
	} else {
		m, ok := a.gossip.ServerByID(s.ID, s.Address)
		if !ok || m.Meta.InternalAddr == "" {
			sv.Error = "no internal address in gossip"
			return nil
		}
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		resp, err := a.pool.Node(m.Meta.InternalAddr).Status(cctx, connect.NewRequest(&nodev1.StatusRequest{}))
		cancel()
		if err != nil {
			sv.Error = "not answering: " + connect.CodeOf(err).String()
			return nil
		}
		st = resp.Msg
	}
	sv.AppliedIndex = st.GetAppliedIndex()
	sv.Features = st.GetFeatures()
	sv.Halted = st.GetHalted()
	return st
}

// caughtUpSlack is how many entries behind the leader's applied index a
// server may be, at the moment it answers, and still count as caught up.
const caughtUpSlack = 1000

// nodeStatus is the status source of this node's NodeService.
func (a *Agent) nodeStatus() versionedStatus { return versionedStatus{StatusSource: a.cons, a: a} }

// memberStatus is the API form of a gossip status.
func memberStatus(s cluster.MemberStatus) clusterv1.MemberStatus {
	switch s {
	case cluster.StatusAlive:
		return clusterv1.MemberStatus_MEMBER_STATUS_ALIVE
	case cluster.StatusSuspect:
		return clusterv1.MemberStatus_MEMBER_STATUS_SUSPECT
	case cluster.StatusFailed:
		return clusterv1.MemberStatus_MEMBER_STATUS_FAILED
	case cluster.StatusLeft:
		return clusterv1.MemberStatus_MEMBER_STATUS_LEFT
	}
	return clusterv1.MemberStatus_MEMBER_STATUS_UNSPECIFIED
}

// ClusterVersion is the cluster version of this agent's applied state.
func (a *Agent) ClusterVersion() fsm.Version { return a.fsm.Version() }

// versionReadiness: the state is at the cluster version its servers run.
// Right after a new cluster forms, or after the last server of an upgrade
// restarted, the leader raises it within moments; until this node applied
// that, what the release added is refused, so the node is not ready.
func (a *Agent) versionReadiness(checks map[string]string, fail func(name, format string, args ...any)) {
	if a.work == nil {
		return
	}
	st := a.fsm.State()
	cur, _, err := st.ClusterVersion()
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(a.ctx, time.Second)
	defer cancel()
	servers, err := a.work.VersionServers(ctx)
	if err != nil || len(servers) == 0 {
		checks["cluster_version"] = "ok: " + cur.String()
		return
	}
	low, _ := cluster.LowestVersion(servers)
	if fsm.Latest.Less(low) {
		low = fsm.Latest
	}
	if pin, _, pinned := leader.DowngradeTarget(st); pinned && pin.Less(low) {
		checks["cluster_version"] = fmt.Sprintf("ok: %s, held by a downgrade to %s", cur, pin)
		return
	}
	if cur.Less(low) {
		fail("cluster_version", "%s while every server runs %s or later: the leader raises it (pvcli operator upgrade status)", cur, low)
		return
	}
	checks["cluster_version"] = "ok: " + cur.String()
}
