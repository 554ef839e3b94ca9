package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/hashicorp/raft"
	wal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/migrate"
)

// MigrateResult says what MigrateLogStore did.
type MigrateResult struct {
	From, To    string
	First, Last uint64 // the entries copied; 0, 0 for an empty log
	// Unchanged is true when the data dir already used To.
	Unchanged bool
}

// migratingDir is where the new WAL is built before it replaces the log:
// a leftover of an interrupted migration is removed by the next one.
const migratingDir = walDir + ".migrating"

// MigrateLogStore converts the Raft log of a stopped node's data dir to the
// log store to (LogStoreWAL or LogStoreBoltDB), as Nomad's `operator raft
// migrate-backend` does: the stores are opened and checked as a start
// would (so a damaged log is refused and a running agent's data dir is
// ErrDataDirLocked), every entry Raft still needs is copied into the new
// store, and only then does the new store replace the old one. The stable
// store (term, vote) stays in raft.db either way; snapshots are untouched.
//
// A crash at any point leaves a data dir that starts, on the old store or
// on the new one, and the migration can be run again: the new WAL is built
// in raft/wal.migrating and renamed into place in one step; entries left
// behind in raft.db by a migration to WAL are never read and are cleared by
// the next migration to boltdb.
func MigrateLogStore(ctx context.Context, dataDir, to string, segmentSize int) (res MigrateResult, err error) {
	res.To = to
	if to != LogStoreWAL && to != LogStoreBoltDB {
		return res, fmt.Errorf("migrate raft log: --to %q: must be %s or %s", to, LogStoreWAL, LogStoreBoltDB)
	}
	if segmentSize == 0 {
		segmentSize = DefaultWALSegmentSize
	}
	dir := filepath.Join(dataDir, raftDir)
	if _, err := os.Stat(filepath.Join(dir, boltFile)); err != nil {
		return res, fmt.Errorf("migrate raft log: %s holds no raft state (no %s): %w", dataDir, filepath.Join(dir, boltFile), err)
	}
	// A leftover of an interrupted migration to WAL: never in use.
	if err := os.RemoveAll(filepath.Join(dir, migratingDir)); err != nil {
		return res, fmt.Errorf("migrate raft log: remove the leftover of an interrupted migration: %w", err)
	}
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "migrate", dataDir
	cfg.LogCacheSize, cfg.LogVerificationInterval, cfg.WALSegmentSize = 0, 0, segmentSize
	st, err := openStores(cfg, dir, newHCLogAdapter(nil), slog.New(slog.DiscardHandler))
	if err != nil {
		return res, fmt.Errorf("migrate raft log: %w", err)
	}
	defer func() {
		if st != nil {
			if cerr := st.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("migrate raft log: close: %w", cerr)
			}
		}
	}()
	res.From = st.choice.Kind
	if res.From == to {
		res.Unchanged = true
		return res, nil
	}
	src := &neededLog{LogStore: st.logs}
	if res.First, res.Last, err = src.bounds(); err != nil {
		return res, fmt.Errorf("migrate raft log: %w", err)
	}

	switch to {
	case LogStoreWAL:
		tmp := filepath.Join(dir, migratingDir)
		if err := os.Mkdir(tmp, 0o700); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		w, err := wal.Open(tmp, wal.WithSegmentSize(segmentSize), wal.WithLogger(newHCLogAdapter(nil)))
		if err != nil {
			return res, fmt.Errorf("migrate raft log: create the WAL: %w", err)
		}
		if res.Last > 0 {
			err = migrate.CopyLogs(ctx, w, src, 4<<20, nil)
		}
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return res, fmt.Errorf("migrate raft log: copy entries %d..%d into the WAL: %w", res.First, res.Last, err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, walDir)); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		if err := syncDir(dir); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		// The data dir is a WAL one from here; raft.db's entries are dead.
		if res.Last > 0 {
			if err := st.stable.bolt.DeleteRange(res.First, res.Last); err != nil {
				return res, fmt.Errorf("migrate raft log: the WAL is in place, but clearing the old entries from %s failed (they are never read): %w", boltFile, err)
			}
		}
	case LogStoreBoltDB:
		// Entries a migration to WAL left behind would sit beside (or
		// under) the copied ones.
		bolt := st.stable.bolt
		if first, err := bolt.FirstIndex(); err == nil && first > 0 {
			last, err := bolt.LastIndex()
			if err == nil {
				err = bolt.DeleteRange(first, last)
			}
			if err != nil {
				return res, fmt.Errorf("migrate raft log: clear stale entries from %s: %w", boltFile, err)
			}
		}
		if res.Last == 0 {
			// Nothing to copy.
		} else if err := migrate.CopyLogs(ctx, bolt, src, 4<<20, nil); err != nil {
			return res, fmt.Errorf("migrate raft log: copy entries %d..%d into %s: %w", res.First, res.Last, boltFile, err)
		}
		if err := st.closeLog(); err != nil {
			return res, fmt.Errorf("migrate raft log: close the WAL: %w", err)
		}
		st.closeLog = func() error { return nil }
		// Renamed first, so that no crash leaves a half-removed WAL that a
		// start would take for the log.
		gone := filepath.Join(dir, walDir+".removed")
		if err := os.RemoveAll(gone); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		if err := os.Rename(filepath.Join(dir, walDir), gone); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		if err := syncDir(dir); err != nil {
			return res, fmt.Errorf("migrate raft log: %w", err)
		}
		if err := os.RemoveAll(gone); err != nil {
			return res, fmt.Errorf("migrate raft log: remove the old WAL %s: %w", gone, err)
		}
	}
	return res, nil
}

// neededLog is a log store seen from its last contiguous run of entries:
// the ones Raft needs (entries below a gap are at or below a snapshot, see
// DESIGN.md, "Damaged files"; a WAL cannot hold gaps).
type neededLog struct {
	raft.LogStore
	first uint64
}

// bounds finds the run and returns its first and last index.
func (n *neededLog) bounds() (first, last uint64, err error) {
	if last, err = n.LogStore.LastIndex(); err != nil || last == 0 {
		return 0, 0, err
	}
	lo, err := n.LogStore.FirstIndex()
	if err != nil {
		return 0, 0, err
	}
	var l raft.Log
	first = last
	for first > lo {
		if err := n.LogStore.GetLog(first-1, &l); errors.Is(err, raft.ErrLogNotFound) {
			break
		} else if err != nil {
			return 0, 0, fmt.Errorf("read entry %d: %w", first-1, err)
		}
		first--
	}
	n.first = first
	return first, last, nil
}

// FirstIndex is the start of the run.
func (n *neededLog) FirstIndex() (uint64, error) { return n.first, nil }

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	return errors.Join(err, f.Close())
}
