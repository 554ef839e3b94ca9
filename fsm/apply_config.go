package fsm

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// checkConfigCAS compares a compare-and-set revision with the stored entry
// (nil when the key does not exist, which has revision 0).
func checkConfigCAS(key string, cas *uint64, cur *clusterv1.ConfigEntry) error {
	if cas == nil {
		return nil
	}
	if *cas != cur.GetRevision() {
		return fmt.Errorf("%w: config %q: cas_revision %d, current revision %d",
			ErrCASConflict, key, *cas, cur.GetRevision())
	}
	return nil
}

// applySetConfig writes a new version of a config key. Its revision is the
// log index; the version is appended to the key's history, which keeps the
// newest ConfigHistoryLimit versions.
func (f *FSM) applySetConfig(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetSetConfig()
	if err := checkConfigKey("set_config.key", op.GetKey()); err != nil {
		return nil, err
	}
	if n := len(op.GetValue()); n > MaxConfigValueSize {
		return nil, invalidf("set_config.value: %d bytes, at most %d allowed", n, MaxConfigValueSize)
	}
	old, err := lookup[*clusterv1.ConfigEntry](t, TableConfig, op.GetKey())
	if err != nil {
		return nil, err
	}
	if err := checkConfigCAS(op.GetKey(), op.CasRevision, old); err != nil {
		return nil, err
	}
	// The new version's revision is the largest, so the versions to trim
	// are the oldest stored ones.
	history, err := scan[*clusterv1.ConfigEntry](t, TableConfigHistory, indexIDPrefix, op.GetKey()) // oldest first
	if err != nil {
		return nil, err
	}
	trim := history[:max(0, len(history)+1-f.cfg.ConfigHistoryLimit)]

	entry := &clusterv1.ConfigEntry{
		Key:         op.GetKey(),
		Value:       op.GetValue(),
		Revision:    t.index,
		CreateIndex: t.index,
		UpdatedAt:   cmd.GetTime(),
	}
	if old != nil {
		entry.CreateIndex = old.GetCreateIndex()
	}
	if err := t.insert(TableConfig, entry); err != nil {
		return nil, err
	}
	if err := t.insert(TableConfigHistory, entry); err != nil {
		return nil, err
	}
	for _, e := range trim {
		if err := t.delete(TableConfigHistory, e); err != nil {
			return nil, err
		}
	}
	return entry, nil
}

// applyDeleteConfig deletes a key and its history.
func (f *FSM) applyDeleteConfig(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetDeleteConfig()
	if err := checkConfigKey("delete_config.key", op.GetKey()); err != nil {
		return nil, err
	}
	old, err := lookup[*clusterv1.ConfigEntry](t, TableConfig, op.GetKey())
	if err != nil {
		return nil, err
	}
	if old == nil {
		return nil, fmt.Errorf("%w: config %q", ErrNotFound, op.GetKey())
	}
	if err := checkConfigCAS(op.GetKey(), op.CasRevision, old); err != nil {
		return nil, err
	}
	history, err := scan[*clusterv1.ConfigEntry](t, TableConfigHistory, indexIDPrefix, op.GetKey())
	if err != nil {
		return nil, err
	}
	if err := t.delete(TableConfig, old); err != nil {
		return nil, err
	}
	for _, e := range history {
		if err := t.delete(TableConfigHistory, e); err != nil {
			return nil, err
		}
	}
	return nil, nil
}
