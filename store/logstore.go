package store

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"syscall"

	"github.com/hashicorp/raft"
	wal "github.com/hashicorp/raft-wal"
)

// The Raft log stores a data directory can hold.
const (
	// LogStoreWAL is hashicorp/raft-wal: segment files in raft/wal/, one
	// write and one fdatasync per append. The default for new data dirs.
	LogStoreWAL = "wal"
	// LogStoreBoltDB is raft-boltdb/v2: the log in raft/raft.db beside the
	// stable store, a bbolt commit (two fdatasyncs) per append. Kept by data
	// dirs that were created with it.
	LogStoreBoltDB = "boltdb"
)

const (
	// walDir is the subdirectory of raftDir that holds raft-wal's segments
	// and its wal-meta.db. Its presence is what makes a data dir a WAL one.
	walDir = "wal"
	// DefaultWALSegmentSize is raft-wal's own default segment size (64 MiB).
	DefaultWALSegmentSize = 64 << 20
)

// LogStoreChoice is the log store a data directory uses and why.
type LogStoreChoice struct {
	Kind string // LogStoreWAL or LogStoreBoltDB
	// Existing is true when the data dir already held a log of this kind,
	// which then wins over the configured one.
	Existing bool
	// Configured is what Config.LogStore asked for ("" for the default).
	Configured string
}

// chooseLogStore decides which log store the raft directory dir uses: the
// one it already holds (a wal/ directory, else a raft.db, which older data
// dirs hold their log in), else the configured one, else WAL. A log is never
// switched silently: changing a data dir's store is MigrateLogStore's job.
func chooseLogStore(dir, configured string) (LogStoreChoice, error) {
	c := LogStoreChoice{Configured: configured}
	switch _, err := os.Stat(filepath.Join(dir, walDir)); {
	case err == nil:
		c.Kind, c.Existing = LogStoreWAL, true
		return c, nil
	case !errors.Is(err, fs.ErrNotExist):
		return c, fmt.Errorf("look for the raft log: %w", err)
	}
	switch _, err := os.Stat(filepath.Join(dir, boltFile)); {
	case err == nil:
		c.Kind, c.Existing = LogStoreBoltDB, true
		return c, nil
	case !errors.Is(err, fs.ErrNotExist):
		return c, fmt.Errorf("look for the raft log: %w", err)
	}
	c.Kind = configured
	if c.Kind == "" {
		c.Kind = LogStoreWAL
	}
	return c, nil
}

// openWAL opens (or creates) the raft-wal log in dir/wal, with its segments
// of segmentSize bytes, and checks it like checkLogs checks bbolt's: raft-wal
// recovers its tail segment at open (entries past the last complete, CRC-
// checked one are discarded, as an interrupted append leaves them) and then
// every entry Raft will read is read back here. The caller holds raft.db's
// lock, which keeps a second agent out: raft-wal's own wal-meta.db is
// opened without a lock timeout.
func openWAL(dir string, segmentSize int, logger *hclogAdapter, snap uint64) (w *wal.WAL, err error) {
	path := filepath.Join(dir, walDir)
	if err := os.MkdirAll(path, 0o700); err != nil {
		return nil, fmt.Errorf("create raft log directory: %w", err)
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			w, err = nil, fmt.Errorf("%w: %s: reading it failed: %v", ErrCorruptLog, path, r)
		}
	}()
	w, err = wal.Open(path, wal.WithSegmentSize(segmentSize), wal.WithLogger(logger.Named("wal")))
	if err != nil {
		// Out of space, no permission, a read-only file system: the
		// node's surroundings, not its data. Anything else, a file raft-
		// wal's metadata lists missing among them, is damage.
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EROFS) || errors.Is(err, fs.ErrPermission) {
			return nil, fmt.Errorf("open raft log %s: %w", path, err)
		}
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	first, ferr := w.FirstIndex()
	last, lerr := w.LastIndex()
	if err := errors.Join(ferr, lerr); err != nil {
		w.Close()
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptLog, path, err)
	}
	var present []span
	if last > 0 {
		present = []span{{first, last}}
	}
	if err := checkLogs(path, w, present, snap); err != nil {
		w.Close()
		return nil, err
	}
	if last > 0 && snap > last {
		// Every entry is at or below the newest snapshot: a crash after
		// Raft stored a snapshot it installed or restored, before it
		// removed the log below it (what Raft does for a monotonic store
		// such as this, instead of leaving a gap). Raft would resume after
		// the snapshot's index and the WAL, which takes no gaps, would
		// refuse every append: remove the log as Raft was about to.
		if err := w.DeleteRange(first, last); err != nil {
			w.Close()
			return nil, fmt.Errorf("open raft log %s: remove entries %d..%d below the snapshot at %d: %w", path, first, last, snap, err)
		}
		logger.Info("removed the log entries a snapshot replaced", "first", first, "last", last, "snapshot_index", snap)
	}
	return w, nil
}

// walLog is raft-wal as Raft's log store. raft-wal answers calls after
// Close with ErrClosed itself, so unlike raft.db (guardedBolt) it needs no
// guard; it is monotonic, so Raft deletes the whole log when it installs a
// snapshot. What it lacks is the LogStore contract after a compaction: its
// tail segment still returns entries below the first index until the
// segment is deleted, so a leader would replicate compacted entries to a
// follower that lags past its snapshot instead of sending the snapshot, as
// it does on raft.db. GetLog here answers ErrLogNotFound below the first
// index.
type walLog struct{ *wal.WAL }

var (
	_ raft.LogStore          = walLog{}
	_ raft.MonotonicLogStore = walLog{}
)

// GetLog is wal.WAL.GetLog for the entries from the first index on.
func (w walLog) GetLog(index uint64, l *raft.Log) error {
	first, err := w.WAL.FirstIndex()
	if err != nil {
		return err
	}
	if index < first || first == 0 {
		return raft.ErrLogNotFound
	}
	return w.WAL.GetLog(index, l)
}

// logStoreChosen says at start when the data dir keeps a log store other
// than the one configured for new data dirs (empty: wal).
func logStoreChosen(log *slog.Logger, c LogStoreChoice) {
	want := c.Configured
	if want == "" {
		want = LogStoreWAL
	}
	if !c.Existing || c.Kind == want {
		return
	}
	log.Warn(fmt.Sprintf("this data dir holds a %s raft log and keeps it: the configured log store (%s) applies to new data dirs. To convert this one, stop the agent and run: pivirt-agent raft migrate-log-store --data-dir DIR --to %s", c.Kind, want, want),
		"log_store", c.Kind, "configured", want)
}
