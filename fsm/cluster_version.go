package fsm

import (
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// clusterVersionKey is the primary key of the only record of
// TableClusterVersion.
const clusterVersionKey = "cluster"

// opVersion is the cluster version that added an operation; the others
// exist at 0.0. A state at an older version records it as unknown, as the
// agents of that version do. (set_cluster_version is applied at every
// version: it is how a state leaves 0.0, and the leader proposes it only
// once every server knows it.)
var opVersion = map[protoreflect.Name]Version{
	"refuse_write":   Version0_1,
	"set_placements": Version0_1,
}

// opAt reports whether a state at version v applies the operation.
func opAt(op protoreflect.Name, v Version) bool {
	since, ok := opVersion[op]
	return !ok || !v.Less(since)
}

// versionSteps are the conversions between consecutive versions: up runs
// when the state moves from the version before to this one, down when it
// moves back below it.
var versionSteps = []struct {
	to       Version
	up, down func(f *FSM, t *writeTxn) error
}{
	{Version0_1, (*FSM).sessionsFromDedupeRecords, (*FSM).downTo0_0},
}

// applySetClusterVersion moves the state to another cluster version,
// converting it on the way (versionSteps). A version this release does not
// know is refused here when it is older than Latest (a newer one halts
// before dispatch).
func (f *FSM) applySetClusterVersion(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetSetClusterVersion()
	to := Version{op.GetMajor(), op.GetMinor()}
	if !to.Known() {
		return nil, invalidf("set_cluster_version: %s is not a version this release knows (%v)", to, knownVersions)
	}
	if cmd.GetClientId() != "" {
		// The outcome of a write is kept the way its version keeps it:
		// one that moves the version would have none to go by.
		return nil, invalidf("set_cluster_version: proposed by the leader, without a client_id")
	}
	from := t.version
	if to == from {
		return nil, nil
	}
	for _, s := range versionSteps {
		if from.Less(s.to) && !to.Less(s.to) {
			if err := s.up(f, t); err != nil {
				return nil, err
			}
		}
	}
	for i := len(versionSteps) - 1; i >= 0; i-- {
		if s := versionSteps[i]; to.Less(s.to) && !from.Less(s.to) {
			if err := s.down(f, t); err != nil {
				return nil, err
			}
		}
	}
	if to != Version0_0 {
		rec := &fsmv1.ClusterVersion{Major: to.Major, Minor: to.Minor, Index: t.index, SetAt: cmd.GetTime()}
		if err := t.insert(TableClusterVersion, rec); err != nil {
			return nil, err
		}
	}
	t.version = to
	f.invalidateQueues()
	return nil, nil
}

// sessionsFromDedupeRecords is the step up from 0.0: each client's dedupe
// records become its session (sessionsFromDedupe), with the outcomes the
// records hold.
func (f *FSM) sessionsFromDedupeRecords(t *writeTxn) error {
	if t.noPrune {
		// External mode (etcd) keeps per-write dedupe records whatever the
		// version: leased keys that expire by themselves.
		return nil
	}
	recs, err := scan[*fsmv1.DedupeRecord](t, TableDedupe, indexID)
	if err != nil {
		return err
	}
	for _, rec := range recs {
		if err := t.delete(TableDedupe, rec); err != nil {
			return err
		}
	}
	for _, s := range sessionsFromDedupe(recs) {
		old, err := lookup[*session](t, TableSessions, s.clientID)
		if err != nil {
			return err
		}
		if old != nil {
			continue
		}
		if err := t.insert(TableSessions, s); err != nil {
			return err
		}
	}
	return nil
}

// downTo0_0 is the step down to 0.0: each session becomes a dedupe record
// per outcome kept (without the record the write wrote, and without a
// digest: 0.0 keeps full digests, a session the first 8 bytes, so a
// repeat's digest is not compared), and what 0.0 cannot hold goes: the
// placement catalog (agents at 0.0 do not route by it) and the version
// record, with their index rows.
func (f *FSM) downTo0_0(t *writeTxn) error {
	// What 0.0 cannot express, refused before anything changes: an
	// instance's check or deregister_critical_after, which agents of 0.0
	// keep but never act on (its health would freeze). The leader's
	// validation says so first; this holds against a registration that
	// raced it.
	insts, err := scan[*clusterv1.ServiceInstance](t, TableServices, indexID)
	if err != nil {
		return err
	}
	if names := CheckedInstances(insts); names != "" {
		return fmt.Errorf("%w: set_cluster_version 0.0: service instances have a health check or deregister_critical_after, which 0.0 never runs: %s; register them again without one first",
			ErrCannotConvert, names)
	}
	sessions, err := scan[*session](t, TableSessions, indexID)
	if err != nil {
		return err
	}
	for _, s := range sessions {
		for i := range s.outcomes {
			o := &s.outcomes[i]
			rec := &fsmv1.DedupeRecord{ClientId: s.clientID, Sequence: o.seq, Index: o.index, Time: nanosTime(o.time)}
			if o.err != nil {
				rec.ErrorCode, rec.ErrorMessage = o.err.code, o.err.msg
			}
			if err := t.insert(TableDedupe, rec); err != nil {
				return err
			}
		}
		if err := t.delete(TableSessions, s); err != nil {
			return err
		}
	}
	placements, err := scan[*fsmv1.Placement](t, TablePlacements, indexID)
	if err != nil {
		return err
	}
	for _, p := range placements {
		if err := t.delete(TablePlacements, p); err != nil {
			return err
		}
	}
	if v, err := lookup[*fsmv1.ClusterVersion](t, TableClusterVersion, clusterVersionKey); err != nil {
		return err
	} else if v != nil {
		if err := t.delete(TableClusterVersion, v); err != nil {
			return err
		}
	}
	// The dedupe table holds the sessions now: it changed here, which
	// also makes the entry commit when nothing else is left to write.
	if err := t.touch(TableDedupe); err != nil {
		return err
	}
	return t.dropTablesAbove(Version0_0)
}

// CheckedInstances names the instances with a check or
// deregister_critical_after, which a state at 0.0 cannot express (the
// first five, then how many more); "" when there is none.
func CheckedInstances(insts []*clusterv1.ServiceInstance) string {
	var checked []string
	for _, in := range insts {
		if in.GetCheck() != nil || in.GetDeregisterCriticalAfter() != nil {
			checked = append(checked, in.GetService()+"/"+in.GetInstanceId())
		}
	}
	if len(checked) <= 5 {
		return strings.Join(checked, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(checked[:5], ", "), len(checked)-5)
}

// dropTablesAbove deletes the index rows of the tables a state at v does
// not have (their records are gone already), so that the state is written
// in a snapshot format v reads.
func (t *writeTxn) dropTablesAbove(v Version) error {
	for _, name := range Tables() {
		if tableAt(name, v) {
			continue
		}
		n := tableNum(name)
		t.changed[n] = 0
		row, err := tfirst(t.txn, TableIndex, indexID, name)
		if err != nil {
			return fmt.Errorf("read %s: %w", TableIndex, err)
		}
		if row == nil {
			continue
		}
		t.writes++
		if err := tdelete(t.txn, TableIndex, row); err != nil {
			return fmt.Errorf("delete from %s: %w", TableIndex, err)
		}
	}
	return nil
}

// ClusterVersion returns the state's cluster version and its record (nil
// at 0.0, which has none).
func (s *State) ClusterVersion() (Version, *fsmv1.ClusterVersion, error) {
	rec, err := first[*fsmv1.ClusterVersion](s.txn, TableClusterVersion, indexID, clusterVersionKey)
	if err != nil || rec == nil {
		return Version0_0, nil, err
	}
	return Version{rec.GetMajor(), rec.GetMinor()}, rec, nil
}

// SetClusterVersionCommand is the command that moves the cluster version
// to v.
func SetClusterVersionCommand(v Version) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetClusterVersion{SetClusterVersion: &fsmv1.SetClusterVersion{Major: v.Major, Minor: v.Minor}}}
}
