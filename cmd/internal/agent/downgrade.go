package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/leader"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// downgrade answers ClusterService.Downgrade on the leader (DESIGN.md,
// "Downgrade"): validate says whether the state can be expressed at the
// older version and what changes; enable holds the cluster at it
// (gateway.DowngradeKey) and lowers the cluster version, which converts
// the state on every node at one log index; cancel ends the hold.
func (a *Agent) downgrade(ctx context.Context, req *clusterv1.DowngradeRequest) (*clusterv1.DowngradeResponse, error) {
	st := a.fsm.State()
	cur, _, err := st.ClusterVersion()
	if err != nil {
		return nil, gateway.ConnectError(err)
	}
	out := &clusterv1.DowngradeResponse{ClusterVersion: cur.String()}
	pin, rev, pinned := leader.DowngradeTarget(st)
	if pinned {
		out.Downgrade = pin.String()
	}
	if req.GetAction() == clusterv1.DowngradeAction_DOWNGRADE_ACTION_CANCEL {
		if !pinned {
			out.Next = "no downgrade was under way"
			return out, nil
		}
		if err := a.proposeLeader(ctx, &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: gateway.DowngradeKey, CasRevision: rev}}}); err != nil && !errors.Is(err, fsm.ErrNotFound) {
			return nil, gateway.ConnectError(err)
		}
		out.Downgrade = ""
		out.Next = "the downgrade is cancelled: the leader raises the cluster version again once every server runs a newer release (pvcli operator upgrade status)"
		return out, nil
	}
	target, err := fsm.ParseVersion(req.GetVersion())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("version: %w", err))
	}
	changes, err := a.validateDowngrade(ctx, cur, target, pin, pinned)
	if err != nil {
		return nil, err
	}
	out.Changes = changes
	out.Next = downgradeNext(target)
	if req.GetAction() == clusterv1.DowngradeAction_DOWNGRADE_ACTION_VALIDATE {
		return out, nil
	}
	if !pinned || pin != target {
		absent := uint64(0)
		var cas *uint64 = &absent
		if pinned {
			cas = rev
		}
		if err := a.proposeLeader(ctx, &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{
			Key: gateway.DowngradeKey, Value: target.String(), CasRevision: cas,
		}}}); err != nil {
			return nil, gateway.ConnectError(fmt.Errorf("hold the cluster at %s: %w", target, err))
		}
	}
	if target.Less(cur) {
		if err := a.proposeLeader(ctx, fsm.SetClusterVersionCommand(target)); err != nil {
			if errors.Is(err, fsm.ErrCannotConvert) {
				// Refused by the state (a registration raced the
				// validation): the hold goes back to what it was.
				if _, rev, ok := leader.DowngradeTarget(a.fsm.State()); ok {
					back := &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: gateway.DowngradeKey, CasRevision: rev}}}
					if pinned {
						back = &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: gateway.DowngradeKey, Value: pin.String(), CasRevision: rev}}}
					}
					_ = a.proposeLeader(ctx, back)
				}
			}
			return nil, gateway.ConnectError(fmt.Errorf("lower the cluster version to %s: %w", target, err))
		}
	}
	a.logger.Warn("downgrade enabled: the cluster version is lowered and held; the older release may now start on this data", "from", cur.String(), "to", target.String())
	out.ClusterVersion, out.Downgrade = target.String(), target.String()
	return out, nil
}

// validateDowngrade checks that the cluster can go down to target and
// says what changes; a refusal is a FailedPrecondition with the reason.
func (a *Agent) validateDowngrade(ctx context.Context, cur, target, pin fsm.Version, pinned bool) ([]string, error) {
	refuse := func(format string, args ...any) error {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("cannot downgrade to %s: "+format, append([]any{target}, args...)...))
	}
	switch {
	case !target.Known():
		return nil, refuse("this release knows no such version (it runs %s down to 0.0)", fsm.Latest)
	case cur.Less(target):
		return nil, refuse("the cluster version is %s, older already", cur)
	case pinned && pin != target && !pin.Less(cur):
		return nil, refuse("a downgrade to %s is under way; pvcli operator downgrade cancel first", pin)
	}
	if a.etcdMode() {
		return nil, refuse("etcd mode keeps its state in etcd; an older release reads the keys its version wrote, and the agents themselves are downgraded one at a time")
	}
	servers, err := a.work.VersionServers(ctx)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("read the servers: %w", err))
	}
	var behind []string
	for _, s := range servers {
		if !s.Known {
			behind = append(behind, s.ID+" (not in gossip)")
		}
	}
	if len(behind) > 0 {
		return nil, refuse("servers of unknown version: %s; every server must be seen before the state is converted", strings.Join(behind, ", "))
	}
	st := a.fsm.State()
	var changes []string
	if target.Less(fsm.Version0_1) {
		// What 0.0 cannot express: an instance's check or
		// deregister_critical_after, which its agents would keep but never
		// act on (the health it has would stay until it is registered
		// again).
		_, insts, err := st.Services("", nil)
		if err != nil {
			return nil, gateway.ConnectError(err)
		}
		if names := fsm.CheckedInstances(insts); names != "" {
			return nil, refuse("service instances have a health check or deregister_critical_after, which agents of %s never run: %s; register them again without one (or deregister them) first",
				target, names)
		}
		_, placements, err := st.Placements("", nil)
		if err == nil && len(placements) > 0 {
			changes = append(changes, fmt.Sprintf("the placement catalog (%d objects) is dropped: each agent serves its own node's VMs, volumes and networks, and a call for another node's object answers NotFound, as agents of %s do", len(placements), target))
		}
		changes = append(changes,
			"the outcomes of recent writes are kept as one record per write (their digests are not: a retry of a write made before the downgrade is not told it reused an identity)",
			"health checks stop, deregister_critical_after stops, runs record no host and no skip reason, refused schedule updates are not recorded",
			fmt.Sprintf("snapshots are written in format 2, which agents of %s read", target))
	}
	return changes, nil
}

// downgradeNext is what the operator does after enabling a downgrade to
// target.
func downgradeNext(target fsm.Version) string {
	steps := "stop one agent at a time (SIGTERM) and start the older release on the same data dir; pvcli operator upgrade status shows each server's release; pvcli operator raft verify compares the replicas after each step"
	if target == fsm.Version0_0 {
		steps += "; an agent whose Raft log is in raft-wal (a data dir with raft/wal) runs `pivirt-agent raft migrate-log-store --to boltdb` with this release while stopped, before the older one starts (that release reads raft.db only)"
	}
	return steps
}

// proposeLeader proposes a command of the leader's own (no client ID) and
// returns its outcome.
func (a *Agent) proposeLeader(ctx context.Context, cmd *fsmv1.Command) error {
	cmd.Time = timestamppb.Now()
	data, err := fsm.Encode(cmd)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, _, err := a.cons.Apply(ctx, data)
	if err != nil {
		return err
	}
	if r, ok := resp.(*fsm.Result); ok && r.Err != nil {
		return r.Err
	}
	return nil
}

// runSnapshotOnVersionChange keeps the newest Raft snapshot of this node at
// its state's cluster version. Raft mode only.
//
// Down (a downgrade was enabled): the newest snapshot in the data dir is
// then written in the format the older release reads, which it restores
// when it starts here.
//
// Up: the snapshot holds the version, and the snapshots kept from before
// are removed (dropSnapshotsBelowNewest). An older release started on this
// data dir then finds no snapshot it can restore, and no log of its own to
// replay from the start, so it refuses to start: it would otherwise take
// the older snapshot (Raft falls back to it) and replay the entries after
// it, skipping the ones it does not know (a release before cluster
// versions does not stop at them).
//
// It compares the state with the newest snapshot rather than watching the
// version move, so a move applied before it started (a restart right after
// a raise, an install while joining) is caught too; and it counts the
// moves, so a raise and a lower between two looks end in a snapshot.
func (a *Agent) runSnapshotOnVersionChange() {
	var (
		moves    uint64
		seen     bool
		newestID string
		newestAt fsm.Version
		failed   string
	)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		v, m := a.fsm.VersionMoves()
		id, err := a.store.NewestSnapshotID()
		if err == nil && id != newestID {
			// A new snapshot (this loop's, a threshold one, an install):
			// the ones below it go.
			var rank int64
			rank, err = a.dropSnapshotsBelowNewest()
			if err == nil {
				newestID, newestAt = id, fsm.Version{Major: uint32(rank >> 32), Minor: uint32(rank)}
			}
		}
		want := err == nil && ((seen && m != moves) || (id != "" && newestAt != v) || (id == "" && v != fsm.Version0_0))
		if want && a.fsm.Halted() == nil {
			ctx, cancel := context.WithTimeout(a.ctx, time.Minute)
			var rc io.ReadCloser
			_, rc, err = a.store.Snapshot(ctx)
			cancel()
			if err == nil {
				rc.Close()
				a.logger.Info("cluster version "+v.String()+": a snapshot of the state at that version was taken; snapshots of an older version go, so that an older release refuses this data dir, and a newer one's are kept", "version", v.String())
			}
		}
		switch {
		case err != nil && a.ctx.Err() == nil && err.Error() != failed:
			a.logger.Warn("keeping the newest snapshot at the cluster version failed; trying again", "version", v.String(), "error", err)
			failed = err.Error()
		case err == nil:
			failed = ""
			moves, seen = m, true
		}
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// dropSnapshotsBelowNewest removes the snapshots of this data dir whose
// state is at an older cluster version than the newest snapshot's, and
// returns the newest's version as a rank (major<<32 | minor).
func (a *Agent) dropSnapshotsBelowNewest() (int64, error) {
	newest, dropped, err := a.store.DropOlderSnapshots(func(r io.Reader) (int64, error) {
		hdr, err := fsm.ReadSnapshotHeader(r)
		if err != nil {
			return 0, err
		}
		cv := hdr.GetClusterVersion()
		return int64(cv.GetMajor())<<32 | int64(cv.GetMinor()), nil
	})
	if len(dropped) > 0 {
		a.logger.Info("snapshots of an older cluster version removed", "snapshots", dropped)
	}
	if err != nil {
		return newest, fmt.Errorf("removing the snapshots of an older cluster version (an older release could start on this data dir from one of them): %w", err)
	}
	return newest, nil
}
