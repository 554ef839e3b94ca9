package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/hashicorp/raft"
)

// SnapshotMeta describes a Raft snapshot of the FSM.
type SnapshotMeta struct {
	ID    string // snapshot store ID
	Index uint64 // last log index included
	Term  uint64 // term of that index
	Size  int64  // bytes of FSM data (what the ReadCloser yields)
}

// Snapshot takes a snapshot of the local FSM now, or finds the latest one when
// nothing was applied since, and opens it. The reader yields exactly what the
// FSM's Persist wrote; the caller must close it. It works on any server: the
// leader's is the freshest, a follower's may be stale.
func (s *Store) Snapshot(ctx context.Context) (SnapshotMeta, io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return SnapshotMeta{}, nil, contextError(ctx)
	}
	f := s.raft.Snapshot()
	err := s.wait(ctx, f)
	var (
		meta *raft.SnapshotMeta
		rc   io.ReadCloser
	)
	switch {
	case err == nil:
		meta, rc, err = f.Open()
	case errors.Is(err, raft.ErrNothingNewToSnapshot):
		meta, rc, err = s.openLatestSnapshot()
	}
	if err != nil {
		return SnapshotMeta{}, nil, fmt.Errorf("snapshot: %w", mapRaftError(err))
	}
	return SnapshotMeta{ID: meta.ID, Index: meta.Index, Term: meta.Term, Size: meta.Size}, rc, nil
}

func (s *Store) openLatestSnapshot() (*raft.SnapshotMeta, io.ReadCloser, error) {
	list, err := s.snaps.List()
	if err != nil {
		return nil, nil, fmt.Errorf("list snapshots: %w", err)
	}
	if len(list) == 0 {
		return nil, nil, raft.ErrNothingNewToSnapshot
	}
	return s.snaps.Open(list[0].ID) // List is newest first
}

// NewestSnapshotID is the ID of the newest snapshot kept on this server,
// "" when there is none.
func (s *Store) NewestSnapshotID() (string, error) {
	list, err := s.snaps.List()
	if err != nil || len(list) == 0 {
		return "", err
	}
	return list[0].ID, nil
}

// DropOlderSnapshots removes the snapshots kept on this server that rank
// below the newest (rank reads a snapshot's FSM data from its start), and
// returns the newest's rank and the IDs removed. Raft falls back to an
// older snapshot when it cannot restore the newest: once the state moved
// on to something an older release must not start from, the agent removes
// the snapshots written before, so that such a release finds none it can
// read and refuses to start, rather than restore one and skip the entries
// after it. A snapshot Raft removed meanwhile is skipped; any other error
// is returned after the others were looked at.
func (s *Store) DropOlderSnapshots(rank func(io.Reader) (int64, error)) (int64, []string, error) {
	list, err := s.snaps.List()
	if err != nil {
		return 0, nil, fmt.Errorf("list snapshots: %w", err)
	}
	var (
		newest  int64
		dropped []string
		errs    []error
	)
	for i, meta := range list { // newest first
		r, err := s.rankSnapshot(meta.ID, rank)
		switch {
		case errors.Is(err, os.ErrNotExist) && i > 0:
			continue // reaped by Raft meanwhile
		case err != nil && i == 0:
			return 0, nil, err // nothing to compare the others with
		case err != nil:
			errs = append(errs, err)
			continue
		case i == 0:
			newest = r
			continue
		case r >= newest:
			continue
		}
		// The file store keeps each snapshot in a directory named by its ID.
		if err := os.RemoveAll(filepath.Join(s.snapDir, meta.ID)); err != nil {
			errs = append(errs, fmt.Errorf("remove snapshot %s: %w", meta.ID, err))
			continue
		}
		dropped = append(dropped, meta.ID)
	}
	return newest, dropped, errors.Join(errs...)
}

func (s *Store) rankSnapshot(id string, rank func(io.Reader) (int64, error)) (int64, error) {
	_, rc, err := s.snaps.Open(id)
	if err != nil {
		return 0, fmt.Errorf("snapshot %s: %w", id, err)
	}
	defer rc.Close()
	r, err := rank(rc)
	if err != nil {
		return 0, fmt.Errorf("snapshot %s: %w", id, err)
	}
	return r, nil
}

// Restore replaces the FSM state of the whole cluster with the size bytes read
// from r, in the format the FSM's Persist writes. Leader only. The current
// membership is kept; the restored state gets an index above every existing
// one and above index (the snapshot's index in the cluster it came from, so
// that no index recorded in the state is above the restore's), and is sent
// to the followers as a snapshot install. Commands in flight fail with
// ErrAbortedByRestore.
//
// The data must be validated before the call: if the FSM's Restore fails,
// hashicorp/raft panics, because the node is then in an undefined state.
// ctx's deadline is raft's timeout for queueing the restore and, after it,
// the no-op raft appends to wait for the followers: an error can come after
// the state was restored (the FSM's abandon channel tells).
func (s *Store) Restore(ctx context.Context, index uint64, size int64, r io.Reader) error {
	timeout, err := enqueueTimeout(ctx)
	if err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	if !s.IsLeader() {
		return fmt.Errorf("restore: %w", ErrNotLeader)
	}
	meta := &raft.SnapshotMeta{Version: raft.SnapshotVersionMax, Index: index, Size: size}
	if err := s.raft.Restore(meta, r, timeout); err != nil {
		return fmt.Errorf("restore: %w", mapRaftError(err))
	}
	s.log.Info("restored snapshot", "bytes", size, "index", s.raft.LastIndex())
	return nil
}

// LogTerm returns the term of the log entry at index: from the log, or,
// for an entry compacted away, from the snapshot taken at it. It reports
// false when neither holds it (an index the FSM reached by restoring an
// archive of another cluster, before the next entry).
func (s *Store) LogTerm(index uint64) (uint64, bool) {
	if index == 0 {
		return 0, false
	}
	var l raft.Log
	if err := s.logs.GetLog(index, &l); err == nil {
		return l.Term, true
	}
	list, err := s.snaps.List()
	if err != nil {
		return 0, false
	}
	for _, m := range list {
		if m.Index == index {
			return m.Term, true
		}
	}
	return 0, false
}
