package leader

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// The leader keeps the cluster version at the lowest version of the
// servers (Raft mode: every voter and non-voter; etcd mode: every agent not
// gone), raising it once every server runs a newer release, as etcd's
// leader does. It never lowers it: a server older than the cluster version
// cannot apply the log, and is reported; lowering is a downgrade, which an
// operator enables (gateway.DowngradeKey holds the version the cluster
// stays at meanwhile).

// versionInterval is how often the leader looks at the servers' versions
// (also after every membership change).
const versionInterval = 2 * time.Second

// VersionServers returns every server whose version decides the cluster
// version, with what it announces.
func (w *Work) VersionServers(ctx context.Context) ([]cluster.ServerVersion, error) {
	members := w.cfg.Members.Members()
	if w.cfg.Etcd != nil {
		var out []cluster.ServerVersion
		for _, m := range members {
			if m.Status == cluster.StatusLeft {
				continue
			}
			out = append(out, cluster.ServerVersion{
				RaftServer: cluster.RaftServer{ID: m.Meta.ID}, Name: m.Name, Known: true, Status: m.Status,
				Release: m.Meta.Version, Protocol: m.Meta.Protocol, Version: cluster.AnnouncedVersion(m.Meta),
			})
		}
		return out, nil
	}
	servers, err := w.cfg.Voters.Servers(ctx)
	if err != nil {
		return nil, err
	}
	return cluster.ServerVersions(servers, members), nil
}

// DowngradeTarget is the version a downgrade under way keeps the cluster
// at, false when none is.
func DowngradeTarget(st *fsm.State) (fsm.Version, *uint64, bool) {
	e, err := st.ConfigEntry(gateway.DowngradeKey)
	if err != nil || e == nil {
		return fsm.Version{}, nil, false
	}
	rev := e.GetRevision()
	v, err := fsm.ParseVersion(e.GetValue())
	if err != nil {
		// Not a version: it holds nothing back, and is removed.
		return fsm.Latest, &rev, true
	}
	return v, &rev, true
}

// runClusterVersion moves the cluster version while this node leads.
func (w *Work) runClusterVersion(ctx context.Context) {
	changes, stop := w.cfg.Members.Subscribe()
	defer stop()
	t := time.NewTicker(versionInterval)
	defer t.Stop()
	var lastWarning string
	for {
		if warning := w.versionPass(ctx); warning != lastWarning {
			if warning != "" {
				w.cfg.Logger.Warn(warning)
			}
			lastWarning = warning
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-changes:
		}
	}
}

// versionPass is one look at the servers: it raises the cluster version
// when they all run a newer release, removes a downgrade's hold once a
// server runs the downgrade's version, and returns a warning about servers
// older than the cluster version ("" when none is).
func (w *Work) versionPass(ctx context.Context) string {
	st := w.cfg.FSM.State()
	cur, _, err := st.ClusterVersion()
	if err != nil {
		return ""
	}
	servers, err := w.VersionServers(ctx)
	if err != nil || len(servers) == 0 {
		return ""
	}
	low, at := cluster.LowestVersion(servers)
	target := low
	if fsm.Latest.Less(target) {
		target = fsm.Latest // never past what this release applies
	}
	if pin, rev, ok := DowngradeTarget(st); ok {
		if s := knownAtOrBelow(servers, pin); s != nil {
			// A server runs the downgrade's version (or an older one): the
			// downgrade is under way, and the lowest version holds the
			// cluster from now on. (A server gossip does not know yet
			// counts as the oldest, but says nothing of a downgrade.)
			w.clearDowngrade(ctx, rev, low, s)
		} else if pin.Less(target) {
			target = pin
		}
	}
	if cur.Less(target) {
		w.proposeVersion(ctx, cur, target, servers)
	}
	if low.Less(cur) {
		return fmt.Sprintf("servers run a release older than the cluster version %s and cannot apply its log: %s; upgrade them (pvcli operator upgrade status)", cur, describeServers(at))
	}
	return ""
}

// proposeVersion raises the cluster version from cur to target.
func (w *Work) proposeVersion(ctx context.Context, cur, target fsm.Version, servers []cluster.ServerVersion) {
	cmd := fsm.SetClusterVersionCommand(target)
	cmd.Time = timestamppb.Now()
	data, err := fsm.Encode(cmd)
	if err != nil {
		w.cfg.Logger.Error("encode the cluster version", "error", err)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := resultErr(w.cfg.Proposer.Apply(ctx, data)); err != nil {
		if ctx.Err() == nil {
			w.cfg.Logger.Warn("could not raise the cluster version; trying again", "from", cur.String(), "to", target.String(), "error", err)
		}
		return
	}
	w.cfg.Logger.Info("cluster version raised: every server runs this release or a later one", "from", cur.String(), "to", target.String(),
		"servers", len(servers), "features", strings.Join(fsm.FeaturesAt(target), ","))
}

// knownAtOrBelow returns a server gossip knows that announces pin or an
// older version, nil when there is none.
func knownAtOrBelow(servers []cluster.ServerVersion, pin fsm.Version) *cluster.ServerVersion {
	for i := range servers {
		if servers[i].Known && !pin.Less(servers[i].Version) {
			return &servers[i]
		}
	}
	return nil
}

// clearDowngrade removes a downgrade's hold (compare-and-set on its
// revision): server runs the version it holds the cluster at.
func (w *Work) clearDowngrade(ctx context.Context, rev *uint64, low fsm.Version, server *cluster.ServerVersion) {
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{
		Key: gateway.DowngradeKey, CasRevision: rev,
	}}})
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := resultErr(w.cfg.Proposer.Apply(ctx, data)); err != nil && !errors.Is(err, fsm.ErrCASConflict) && !errors.Is(err, fsm.ErrNotFound) {
		if ctx.Err() == nil {
			w.cfg.Logger.Warn("could not end the downgrade's hold on the cluster version; trying again", "error", err)
		}
		return
	}
	w.cfg.Logger.Info("downgrade under way: a server runs the version it keeps the cluster at; the lowest version of the servers holds the cluster version from now on",
		"lowest", low.String(), "server", server.Name, "release", server.Release)
}

// describeServers names servers with their releases.
func describeServers(servers []cluster.ServerVersion) string {
	parts := make([]string, 0, len(servers))
	for _, s := range servers {
		name := s.Name
		if name == "" {
			name = s.ID
		}
		switch {
		case !s.Known:
			parts = append(parts, name+" (not in gossip: version unknown)")
		case s.Protocol < cluster.MinVersionProtocol:
			parts = append(parts, fmt.Sprintf("%s (release %q, before cluster versions: 0.0)", name, s.Release))
		default:
			parts = append(parts, fmt.Sprintf("%s (release %s)", name, s.Release))
		}
	}
	return strings.Join(parts, ", ")
}
