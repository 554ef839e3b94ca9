package store

import "github.com/hashicorp/raft"

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
