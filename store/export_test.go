package store

import (
	"io"

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
