package store

import (
	"errors"
	"strconv"
	"sync/atomic"

	"github.com/hashicorp/raft"
)

// snapshotEntryLog answers a follower's read of the log entry at the index
// of its last snapshot, when the log has none there, with the snapshot's
// term (a no-op entry: it is never applied, the state machine is at or past
// it). hashicorp/raft's follower looks for the leader's previous entry in
// its log only, unless it is its last entry: a follower that holds the
// snapshot at S and an entry above S from an older leader that was never
// committed (S itself is missing: compacted, or the hole a snapshot install
// leaves) refuses every AppendEntries whose previous entry is S; the leader
// then sends the snapshot again, which does not remove the entry above it,
// and again, forever (seen in the e2e restart matrix after "snapshot
// install on a lagging follower" and a SIGKILL; the family of
// hashicorp/raft#704). With the snapshot's term at S the follower accepts
// S as the previous entry, finds the conflict above it and truncates, as
// Raft says. A leader never gets the answer (its replication reads entries
// to send, and S must go as the snapshot, not as a no-op); nor does a
// server whose log holds S-1 (a leader stepping down still replicates for
// a moment, and it reads S only after S-1).
type snapshotEntryLog struct {
	raft.LogStore
	raft *atomic.Pointer[raft.Raft]
}

func (s *snapshotEntryLog) GetLog(index uint64, l *raft.Log) error {
	err := s.LogStore.GetLog(index, l)
	if !errors.Is(err, raft.ErrLogNotFound) {
		return err
	}
	r := s.raft.Load()
	if r == nil || r.State() == raft.Leader {
		return err
	}
	stats := r.Stats()
	snapIndex, err1 := strconv.ParseUint(stats["last_snapshot_index"], 10, 64)
	snapTerm, err2 := strconv.ParseUint(stats["last_snapshot_term"], 10, 64)
	applied, err3 := strconv.ParseUint(stats["applied_index"], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil || snapIndex == 0 || index != snapIndex || applied < snapIndex {
		return err
	}
	// The entry below must be missing too. Then no reader walking the
	// log up to S gets past S-1 — a leader that has just stepped down
	// and whose replication still runs must send S as the snapshot — and
	// the answer is only ever the previous entry of an AppendEntries.
	if index > 1 {
		var below raft.Log
		if err := s.LogStore.GetLog(index-1, &below); !errors.Is(err, raft.ErrLogNotFound) {
			return raft.ErrLogNotFound
		}
	}
	*l = raft.Log{Index: index, Term: snapTerm, Type: raft.LogNoop}
	return nil
}

// IsMonotonic keeps the wrapped store's answer (raft removes a WAL's whole
// log after a snapshot install).
func (s *snapshotEntryLog) IsMonotonic() bool {
	m, ok := s.LogStore.(raft.MonotonicLogStore)
	return ok && m.IsMonotonic()
}
