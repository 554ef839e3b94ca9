package store

import (
	"io"
	"strconv"
	"time"

	"github.com/hashicorp/raft"
)

// SetLogWrapper makes every store opened until the returned func is called
// put wrap(dir, log) under its verifier and log cache, dir being the
// store's raft directory.
func SetLogWrapper(wrap func(dir string, log raft.LogStore) raft.LogStore) (undo func()) {
	wrapLog.Store(&wrap)
	return func() { wrapLog.Store(nil) }
}

// SetBeforeVerify sets the hook a ReadIndex round calls after it read the
// commit index and before it asks for VerifyLeader (nil: none).
func SetBeforeVerify(s *Store, fn func()) {
	s.reads.mu.Lock()
	s.reads.beforeVerify = fn
	s.reads.mu.Unlock()
}

// ReadRounds reports how many ReadIndex rounds s started and how many calls
// wait for the next one.
func ReadRounds(s *Store) (started uint64, waiting int) {
	s.reads.mu.Lock()
	defer s.reads.mu.Unlock()
	return s.reads.started, s.reads.waiting
}

// SnapshotIDs lists the IDs of the snapshots s holds, newest first.
func SnapshotIDs(s *Store) ([]string, error) {
	list, err := s.snaps.List()
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(list))
	for i, m := range list {
		ids[i] = m.ID
	}
	return ids, nil
}

// CreateCheckedSnapshot opens a sink of s's snapshot store as Raft does
// for an installed snapshot, with s's configured check.
func CreateCheckedSnapshot(s *Store, check func(io.Reader) error, index uint64) (raft.SnapshotSink, error) {
	cs := checkedSnapshots{FileSnapshotStore: s.snaps, check: check, log: s.log}
	return cs.Create(raft.SnapshotVersionMax, index, 1, raft.Configuration{}, 1, nil)
}

// SetSnapshotIndexCheck sets how often the stores opened from now on
// check raft's record of its last snapshot; undo restores the default.
func SetSnapshotIndexCheck(d time.Duration) (undo func()) {
	old := snapshotIndexCheck.Swap(int64(d))
	return func() { snapshotIndexCheck.Store(old) }
}

// StoreSnapshotAt stores data as a snapshot at index (of the current term
// and configuration), as a snapshot that ended after a restore leaves one
// newer than raft's record of its last snapshot.
func StoreSnapshotAt(s *Store, index uint64, data []byte) error {
	cf := s.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return err
	}
	term, _ := strconv.ParseUint(s.raft.Stats()["term"], 10, 64)
	sink, err := s.snaps.Create(raft.SnapshotVersionMax, index, term, cf.Configuration(), 1, s.transport)
	if err != nil {
		return err
	}
	if _, err := sink.Write(data); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

// RecordedSnapshotIndex is raft's record of its last snapshot.
func RecordedSnapshotIndex(s *Store) uint64 {
	v, _ := strconv.ParseUint(s.raft.Stats()["last_snapshot_index"], 10, 64)
	return v
}
