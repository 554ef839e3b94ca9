package gateway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// RBACPolicyKey is the config key of the cluster-wide RBAC policy, guarded
// as the resource RBACResource rather than config.
const (
	RBACPolicyKey = "auth.rbac_policy"
	RBACResource  = "rbac"
)

// restorePlan is what restoring an archive changes: the archive's state as
// it would be restored — every record checked by the rules of the write
// path, this cluster's CA and cluster.id kept — written out as a snapshot
// stream, and what it changes against the current state.
type restorePlan struct {
	plan *clusterv1.RestorePlan
	// state is the snapshot stream to restore, in a temporary file, and
	// its size; close removes it.
	state *os.File
	size  int64
	index uint64
	meta  archive.Meta
}

func (p *restorePlan) close() {
	if p != nil && p.state != nil {
		p.state.Close()
		os.Remove(p.state.Name())
	}
}

// ErrRestoreRefused: the archive's state does not pass the write path's
// checks.
var ErrRestoreRefused = errors.New("snapshot restore refused")

// planRestore builds the state an archive's state stream would restore
// and compares it with current. The archive's framing and checksums were
// verified (archive.Open); its state is decoded here, once, and refused as
// archive.Verify would refuse it. The state is built in a fork of this
// node's (SnapshotServiceConfig.Fork) and the final state replaces it in
// place, so a record the archive has as the state holds it is neither
// copied nor checked again: memory grows with what the restore changes.
func (s *SnapshotService) planRestore(ctx context.Context, archived io.Reader, current *fsm.State) (*restorePlan, error) {
	var (
		scratch *fsm.FSM
		err     error
	)
	if s.cfg.Fork != nil {
		scratch, err = s.cfg.Fork()
	} else {
		scratch, err = fsm.New(fsm.LatestConfig())
	}
	if err != nil {
		return nil, err
	}
	if err := scratch.Restore(io.NopCloser(archived)); err != nil {
		return nil, archive.StateError(err)
	}
	next := scratch.State()
	out := &clusterv1.RestorePlan{}

	// The archive's records, checked as writes are; this cluster's CA and
	// cluster.id instead of the archive's, and its own tables as they are.
	var records []fsm.TableRecord
	var errs []error
	held := make(map[string][]proto.Message) // current's records, listed once
	caRecords, err := next.Len(fsm.TableCA)
	if err != nil {
		return nil, err
	}
	out.CaIgnored = caRecords > 0
	for _, table := range fsm.Tables() {
		if table == fsm.TableIndex || slices.Contains(ownTables, table) {
			continue
		}
		recs, err := next.Records(table)
		if err != nil {
			return nil, err
		}
		cur, err := current.Records(table)
		if err != nil {
			return nil, err
		}
		held[table] = cur
		if table == fsm.TableConfig || table == fsm.TableConfigHistory {
			// This cluster's cluster.id and downgrade, and their
			// history, stay.
			for _, r := range cur {
				if k := r.(*clusterv1.ConfigEntry).GetKey(); k == ClusterIDKey || k == DowngradeKey {
					records = append(records, fsm.TableRecord{Table: table, Record: r})
				}
			}
		}
		records = slices.Grow(records, len(recs)) // one allocation per table, not a doubling per 2^k records
		err = joinByKey(table, recs, cur, func(r, held proto.Message) error {
			if r == nil {
				return nil
			}
			if r == held && table != fsm.TableConfig && table != fsm.TableConfigHistory {
				// Held by this cluster already, unchanged: the upload
				// brings nothing new to check.
				records = append(records, fsm.TableRecord{Table: table, Record: r})
				return nil
			}
			keep, err := s.checkRestored(ctx, table, r, current, out)
			if err != nil {
				errs = append(errs, err)
				return nil
			}
			if keep {
				records = append(records, fsm.TableRecord{Table: table, Record: r})
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	if len(errs) > 0 {
		if len(errs) > 10 {
			errs = append(errs[:10], fmt.Errorf("and %d more", len(errs)-10))
		}
		return nil, fmt.Errorf("%w: the archive's state does not pass the checks of the write path: %w", ErrRestoreRefused, errors.Join(errs...))
	}
	index := next.AppliedIndex()
	if err := scratch.ReplaceKeeping(index, records, current, ownTables...); err != nil {
		return nil, err
	}
	final := scratch.State()
	if err := diffStates(held, final, out); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	p := &restorePlan{plan: out, index: index}
	if p.state, err = os.CreateTemp(s.cfg.TempDir, RestoreTempPattern); err != nil {
		return nil, fmt.Errorf("snapshot restore: %w", err)
	}
	if err := final.WriteSnapshot(p.state); err != nil {
		p.close()
		return nil, fmt.Errorf("snapshot restore: write the state to restore: %w", err)
	}
	if p.size, err = p.state.Seek(0, io.SeekCurrent); err == nil {
		_, err = p.state.Seek(0, io.SeekStart)
	}
	if err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

// ownTables are the tables a restore keeps as this cluster has them: a CA
// is never taken from an upload, a made-up dedupe record or session would
// answer a later write as done without applying it, the placement catalog
// says what the nodes' backends hold now, which a restore does not change
// (the nodes' next listings correct any entry that moves meanwhile), and
// the cluster version is what the cluster's agents run (an archive of
// another version's cluster restores into this one's). They are neither
// listed nor compared: the final state holds the very records the current
// one does.
var ownTables = []string{fsm.TableCA, fsm.TableDedupe, fsm.TableSessions, fsm.TablePlacements, fsm.TableClusterVersion}

// joinByKey calls fn for every primary key of table in a or b (records in
// key order, as State.Records returns them) with the record of each list
// under it, nil where a list has none. Records the two lists share (the
// same pointer) pair up without their keys being computed.
func joinByKey(table string, a, b []proto.Message, fn func(ra, rb proto.Message) error) error {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		c := 0
		switch {
		case i >= len(a):
			c = 1
		case j >= len(b):
			c = -1
		case a[i] != b[j]:
			ka, err := fsm.PrimaryKey(table, a[i])
			if err != nil {
				return err
			}
			kb, err := fsm.PrimaryKey(table, b[j])
			if err != nil {
				return err
			}
			c = bytes.Compare(ka, kb)
		}
		var ra, rb proto.Message
		if c <= 0 {
			ra, i = a[i], i+1
		}
		if c >= 0 {
			rb, j = b[j], j+1
		}
		if err := fn(ra, rb); err != nil {
			return err
		}
	}
	return nil
}

// checkRestored checks one restored record with the write path's rules
// and says whether it is kept (the archive's cluster.id is not).
func (s *SnapshotService) checkRestored(ctx context.Context, table string, r proto.Message, current *fsm.State, out *clusterv1.RestorePlan) (bool, error) {
	switch v := r.(type) {
	case *clusterv1.ServiceInstance:
		if err := s.cs.validateInstance(proto.Clone(v).(*clusterv1.ServiceInstance)); err != nil {
			return false, fmt.Errorf("service %s/%s: %w", v.GetService(), v.GetInstanceId(), err)
		}
	case *schedulev1.Schedule:
		if err := validateSchedule(v, "schedule "+v.GetId()); err != nil {
			return false, err
		}
	case *clusterv1.ConfigEntry:
		key := v.GetKey()
		if err := checkConfigKey(key); err != nil {
			return false, fmt.Errorf("config %q: %w", key, err)
		}
		if len(v.GetValue()) > MaxConfigValueBytes {
			return false, fmt.Errorf("config %s: %d bytes is over the %d-byte limit", key, len(v.GetValue()), MaxConfigValueBytes)
		}
		if key == ClusterIDKey {
			if table == fsm.TableConfig {
				if cur, err := current.ConfigEntry(ClusterIDKey); err != nil || cur.GetValue() != v.GetValue() {
					out.ArchiveClusterId = v.GetValue()
				}
			}
			return false, nil // this cluster's is kept
		}
		if key == DowngradeKey {
			return false, nil // this cluster's downgrade, if any, is kept
		}
		if table == fsm.TableConfig && s.cs.cfg.ValidateConfig != nil {
			if err := s.cs.cfg.ValidateConfig(ctx, ConfigChange{Key: key, Value: v.GetValue(), Restore: true}); err != nil {
				return false, fmt.Errorf("config %s: %w", key, err)
			}
		}
	}
	return true, nil
}

// SecurityKeys are the config keys that decide who may do what: changing
// them needs the rights on the resource RBACResource, not on config.
var SecurityKeys = []string{RBACPolicyKey, "auth.certificate_roles", "auth.network_policy"}

// IsSecurityKey reports whether key is one of SecurityKeys.
func IsSecurityKey(key string) bool { return slices.Contains(SecurityKeys, key) }

// resourceOf is the RBAC resource guarding a table's records.
func resourceOf(table string) string {
	switch table {
	case fsm.TableServices:
		return "services"
	case fsm.TableConfig, fsm.TableConfigHistory:
		return "config"
	case fsm.TableSchedules, fsm.TableScheduleRuns:
		return "schedules"
	}
	return ""
}

// diffStates counts, per table, the records final adds, removes and
// changes against current (the current state's records of every table
// but ownTables, listed), and names the config keys and resources.
func diffStates(current map[string][]proto.Message, final *fsm.State, out *clusterv1.RestorePlan) error {
	resources := map[string]bool{}
	for _, table := range fsm.Tables() {
		if table == fsm.TableIndex {
			continue
		}
		if slices.Contains(ownTables, table) {
			// Kept as they are (ReplaceKeeping): only their size.
			n, err := final.Len(table)
			if err != nil {
				return err
			}
			out.Tables = append(out.Tables, &clusterv1.TableChange{Table: table, Records: uint64(n)})
			continue
		}
		before := current[table]
		after, err := final.Records(table)
		if err != nil {
			return err
		}
		ch := &clusterv1.TableChange{Table: table, Records: uint64(len(after))}
		changedKey := func(rec proto.Message) {
			if e, ok := rec.(*clusterv1.ConfigEntry); ok {
				if table == fsm.TableConfig {
					out.ConfigKeys = append(out.ConfigKeys, e.GetKey())
				}
				if IsSecurityKey(e.GetKey()) {
					if e.GetKey() == RBACPolicyKey {
						out.RbacPolicyChanged = out.RbacPolicyChanged || table == fsm.TableConfig
					}
					resources[RBACResource] = true
					return
				}
			}
			if r := resourceOf(table); r != "" {
				resources[r] = true
			}
		}
		err = joinByKey(table, after, before, func(a, b proto.Message) error {
			switch {
			case b == nil:
				ch.Added++
				changedKey(a)
			case a == nil:
				ch.Removed++
				changedKey(b)
			case a != b && !proto.Equal(a, b):
				ch.Changed++
				changedKey(a)
			}
			return nil
		})
		if err != nil {
			return err
		}
		out.Tables = append(out.Tables, ch)
	}
	slices.Sort(out.ConfigKeys)
	for r := range resources {
		out.Resources = append(out.Resources, r)
	}
	slices.Sort(out.Resources)
	return nil
}
