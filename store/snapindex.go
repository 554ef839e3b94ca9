package store

import (
	"strconv"
	"sync/atomic"
	"time"
)

// snapshotIndexCheck is how often watchSnapshotIndex looks (tests shorten
// it).
var snapshotIndexCheck atomic.Int64

func init() { snapshotIndexCheck.Store(int64(2 * time.Second)) }

// watchSnapshotIndex repairs hashicorp/raft's record of its last snapshot
// when it has gone back (hashicorp/raft#248): a snapshot the snapshot
// thread started before a restore — an archive restored on the leader, a
// snapshot installed from the leader — ends after it and records its
// older index over the restore's. The newest snapshot in the store is
// then above the recorded one, and the log below it is gone: as leader,
// Raft sends a follower that newest snapshot, then looks for the log
// entry at its index to go on from, finds none and sends the snapshot
// again, forever (the restore's no-op never commits). A new snapshot, of
// the state the restore left, records an index at or above the newest
// again. The condition must hold at two checks in a row, with the state
// machine at or past the newest snapshot: while a snapshot is taken or
// restored it holds for a moment (the file is stored before the index is
// recorded).
func (s *Store) watchSnapshotIndex(every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	var seen [2]uint64 // the newest stored and the recorded index last time
	for {
		select {
		case <-s.closing:
			return
		case <-t.C:
		}
		list, err := s.snaps.List()
		if err != nil || len(list) == 0 {
			seen = [2]uint64{}
			continue
		}
		stats := s.raft.Stats()
		recorded, err1 := strconv.ParseUint(stats["last_snapshot_index"], 10, 64)
		applied, err2 := strconv.ParseUint(stats["applied_index"], 10, 64)
		// applied below the newest: a snapshot being restored (its
		// index is recorded when the state machine has it).
		if err1 != nil || err2 != nil || list[0].Index <= recorded || applied < list[0].Index {
			seen = [2]uint64{}
			continue
		}
		now := [2]uint64{list[0].Index, recorded}
		if now != seen {
			seen = now
			continue
		}
		seen = [2]uint64{}
		s.log.Warn("raft's record of its last snapshot went back below the newest stored one (a snapshot that ended after a restore); taking a snapshot to repair it",
			"newest_stored", now[0], "recorded", now[1])
		if err := s.raft.Snapshot().Error(); err != nil {
			s.log.Error("the repairing snapshot failed; trying again", "error", err)
		}
	}
}
