package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"

	"github.com/hashicorp/raft"
	"go.etcd.io/bbolt"
	bberrors "go.etcd.io/bbolt/errors"
)

// ErrCorruptLog: the Raft log on disk is damaged. The node's state cannot
// be trusted: it does not start (see docs/backup.md, "A damaged data
// dir", for what to do).
var ErrCorruptLog = errors.New("store: the raft log is damaged")

// logsBucket is the bucket raft-boltdb keeps the log in: 8-byte big-endian
// indexes to encoded entries.
const logsBucket = "logs"

// span is a run of consecutive log indexes, first to last inclusive.
type span struct{ first, last uint64 }

// checkBolt verifies the bbolt file at path before Raft uses it: it opens
// it read-only and walks every bucket and every key and value with a
// cursor, which reads every page in use. It returns the runs of log indexes
// present in the logs bucket, in order. A missing file is fine (a new
// node). Damage is ErrCorruptLog naming the file and what was wrong.
//
// The walk runs in this goroutine on purpose: bbolt panics on damaged
// pages, and its own Check and free-page scan run in goroutines of their
// own, where a panic cannot be recovered and ends the process. Here the
// panic (and a fault past the end of the file) is recovered. Once this walk
// passed, the writable open's free-page scan reads the same pages.
func checkBolt(path string, opts *bbolt.Options) (present []span, err error) {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	ro := *opts
	ro.ReadOnly = true
	ro.PreLoadFreelist = false
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			present, err = nil, fmt.Errorf("%w: %s: reading it failed: %v", ErrCorruptLog, path, r)
		}
	}()
	db, err := bbolt.Open(path, 0o600, &ro)
	if err != nil {
		if errors.Is(err, bberrors.ErrTimeout) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	defer db.Close()
	err = db.View(func(tx *bbolt.Tx) error {
		return tx.ForEach(func(name []byte, b *bbolt.Bucket) error {
			if string(name) != logsBucket {
				return walkBucket(b, nil)
			}
			return walkBucket(b, func(k []byte) error {
				if len(k) != 8 {
					return fmt.Errorf("key %x of the log is not an 8-byte index", k)
				}
				i := binary.BigEndian.Uint64(k)
				if n := len(present); n > 0 && present[n-1].last+1 == i {
					present[n-1].last = i
				} else {
					present = append(present, span{i, i})
				}
				return nil
			})
		})
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	return present, nil
}

// walkBucket reads every key and value of b and of its nested buckets,
// calling key, when set, with each key of b that holds a value (bbolt
// yields them in byte order).
func walkBucket(b *bbolt.Bucket, key func(k []byte) error) error {
	c := b.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if v == nil {
			nb := b.Bucket(k)
			if nb == nil {
				return fmt.Errorf("key %x has no value and is no bucket", k)
			}
			if err := walkBucket(nb, nil); err != nil {
				return err
			}
			continue
		}
		if key != nil {
			if err := key(k); err != nil {
				return err
			}
		}
	}
	return nil
}

// restorableSnapshot returns the index of the newest snapshot that Raft will
// restore at start: the newest one of the store whose data passes its
// checksum (Raft skips one that does not and tries the next), 0 when there
// is none. Snapshots that exist but none of which reads are ErrCorruptLog:
// Raft would refuse to start without a word on which.
//
// With check, the snapshot Raft would restore must also be one this
// release can restore: one of a newer release is ErrNewerData, which says
// what is needed (Raft would go back to an older snapshot and replay
// entries this release cannot apply either).
func restorableSnapshot(dir string, snaps raft.SnapshotStore, check func(io.Reader) error) (uint64, error) {
	list, err := snaps.List()
	if err != nil {
		// Unreadable, not damaged (permissions, a missing directory).
		return 0, fmt.Errorf("list raft snapshots in %s: %w", dir, err)
	}
	var errs []error
	for _, meta := range list { // newest first
		_, rc, err := snaps.Open(meta.ID)
		if err != nil {
			errs = append(errs, fmt.Errorf("snapshot %s: %v", meta.ID, err))
			continue
		}
		if check != nil {
			err = check(rc)
		}
		rc.Close()
		switch {
		case errors.Is(err, ErrNewerData):
			return 0, fmt.Errorf("snapshot %s in %s: %w", meta.ID, dir, err)
		case err != nil:
			return 0, fmt.Errorf("%w: snapshot %s in %s: its start does not read as a snapshot of this state machine (its checksum holds): %w", ErrCorruptLog, meta.ID, dir, err)
		}
		return meta.Index, nil
	}
	if len(errs) > 0 {
		return 0, fmt.Errorf("%w: %s: no snapshot can be read: %w", ErrCorruptLog, dir, errors.Join(errs...))
	}
	return 0, nil
}

// checkLogs checks the log against the rule of DESIGN.md ("Damaged files"):
// every entry after the newest snapshot (index snap) must be there, up to
// the last one; entries at or below it may be missing, as Raft leaves them
// (compaction, a user restore, a snapshot install); every entry that is
// there, at any index, must decode and hold the index it is stored under.
// present are the runs of stored indexes (checkBolt). Raft would otherwise
// meet a missing or damaged entry only when it replicates or applies it,
// and panic.
func checkLogs(path string, logs raft.LogStore, present []span, snap uint64) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s: reading the log failed: %v", ErrCorruptLog, path, r)
		}
	}()
	if len(present) == 0 {
		return nil
	}
	first, last := present[0].first, present[len(present)-1].last
	var next uint64 = 1 // the lowest index not accounted for yet
	for _, run := range present {
		if run.first > next && run.first-1 > snap {
			// A gap that reaches above the snapshot.
			missing := max(next, snap+1)
			why := fmt.Sprintf("no snapshot holds entries %d..%d", missing, run.first-1)
			if snap > 0 {
				why = fmt.Sprintf("entries %d..%d are missing after the newest snapshot Raft can restore (index %d)", missing, run.first-1, snap)
			}
			return fmt.Errorf("%w: %s: entry %d of %d..%d: log not found: %s", ErrCorruptLog, path, missing, first, last, why)
		}
		var l raft.Log
		for i := run.first; i <= run.last; i++ {
			if err := logs.GetLog(i, &l); err != nil {
				return fmt.Errorf("%w: %s: entry %d of %d..%d: %v", ErrCorruptLog, path, i, first, last, err)
			}
			if l.Index != i {
				return fmt.Errorf("%w: %s: entry stored under %d holds index %d", ErrCorruptLog, path, i, l.Index)
			}
		}
		next = run.last + 1
	}
	return nil
}
