package store

import (
	"errors"
	"fmt"
	"os"
	"runtime/debug"

	"github.com/hashicorp/raft"
	"go.etcd.io/bbolt"
	bberrors "go.etcd.io/bbolt/errors"
)

// ErrCorruptLog: the Raft log on disk is damaged. The node's state cannot
// be trusted: it does not start (see README, "Snapshots and disaster
// recovery", for what to do).
var ErrCorruptLog = errors.New("store: the raft log is damaged")

// checkBolt verifies the bbolt file at path before Raft uses it: it opens
// it read-only and walks every bucket and every key and value with a
// cursor, which reads every page in use. A missing file is fine (a new
// node). Damage is ErrCorruptLog naming the file and what was wrong.
//
// The walk runs in this goroutine on purpose: bbolt panics on damaged
// pages, and its own Check and free-page scan run in goroutines of their
// own, where a panic cannot be recovered and ends the process. Here the
// panic (and a fault past the end of the file) is recovered. Once this walk
// passed, the writable open's free-page scan reads the same pages.
func checkBolt(path string, opts *bbolt.Options) (err error) {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	ro := *opts
	ro.ReadOnly = true
	ro.PreLoadFreelist = false
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s: reading it failed: %v", ErrCorruptLog, path, r)
		}
	}()
	db, err := bbolt.Open(path, 0o600, &ro)
	if err != nil {
		if errors.Is(err, bberrors.ErrTimeout) {
			return err
		}
		return fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	defer db.Close()
	err = db.View(func(tx *bbolt.Tx) error {
		return tx.ForEach(func(name []byte, b *bbolt.Bucket) error {
			return walkBucket(b)
		})
	})
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	return nil
}

// walkBucket reads every key and value of b and of its nested buckets.
func walkBucket(b *bbolt.Bucket) error {
	c := b.Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if v == nil {
			nb := b.Bucket(k)
			if nb == nil {
				return fmt.Errorf("key %x has no value and is no bucket", k)
			}
			if err := walkBucket(nb); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkLogs reads every entry of the log, first to last: each must be
// there (no gap) and decode, with the index it is stored under. Raft would
// otherwise meet a damaged entry only when it replicates or applies it.
func checkLogs(path string, logs raft.LogStore) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s: reading the log failed: %v", ErrCorruptLog, path, r)
		}
	}()
	first, err := logs.FirstIndex()
	if err != nil {
		return fmt.Errorf("%w: %s: first index: %v", ErrCorruptLog, path, err)
	}
	last, err := logs.LastIndex()
	if err != nil {
		return fmt.Errorf("%w: %s: last index: %v", ErrCorruptLog, path, err)
	}
	if last == 0 {
		return nil
	}
	var l raft.Log
	for i := first; i <= last; i++ {
		if err := logs.GetLog(i, &l); err != nil {
			return fmt.Errorf("%w: %s: entry %d of %d..%d: %v", ErrCorruptLog, path, i, first, last, err)
		}
		if l.Index != i {
			return fmt.Errorf("%w: %s: entry stored under %d holds index %d", ErrCorruptLog, path, i, l.Index)
		}
	}
	return nil
}
