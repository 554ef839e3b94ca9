package store

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
