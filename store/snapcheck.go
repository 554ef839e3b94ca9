package store

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/hashicorp/raft"
)

// checkedSnapshots is the snapshot store Raft writes through when
// Config.SnapshotCheck is set: a snapshot whose start the check refuses is
// cancelled before it is stored. So a follower that is sent a snapshot
// this release cannot restore keeps the snapshots it can (the file store
// deletes the oldest ones only when a new one is kept), and reports the
// failure to the leader instead of storing the snapshot and failing to
// restore it, then again at every start.
type checkedSnapshots struct {
	*raft.FileSnapshotStore
	check func(io.Reader) error
	log   *slog.Logger
}

// maxCheckedPrefix bounds what a sink buffers before the check decides:
// the FSM's preamble and header (at most 1 MiB) with room for framing.
const maxCheckedPrefix = 2 << 20

func (s checkedSnapshots) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	sink, err := s.FileSnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		return nil, err
	}
	return &checkingSink{SnapshotSink: sink, check: s.check, log: s.log, index: index}, nil
}

// checkingSink holds back the start of a snapshot until the check decides
// on it, then passes everything through; a refused snapshot fails every
// write, and Raft cancels the sink.
type checkingSink struct {
	raft.SnapshotSink
	check   func(io.Reader) error
	log     *slog.Logger
	index   uint64
	prefix  []byte
	checked bool
	err     error
}

func (s *checkingSink) Write(p []byte) (int, error) {
	if s.err != nil {
		return 0, s.err
	}
	if s.checked {
		return s.SnapshotSink.Write(p)
	}
	s.prefix = append(s.prefix, p...)
	switch err := s.check(bytes.NewReader(s.prefix)); {
	case err == nil:
		return len(p), s.release()
	case errors.Is(err, io.ErrUnexpectedEOF) && len(s.prefix) < maxCheckedPrefix:
		return len(p), nil // the header is not whole yet
	default:
		return 0, s.refuse(err)
	}
}

// release writes the prefix held back, once checked.
func (s *checkingSink) release() error {
	s.checked = true
	_, err := s.SnapshotSink.Write(s.prefix)
	s.prefix = nil
	return err
}

func (s *checkingSink) refuse(err error) error {
	s.err = fmt.Errorf("snapshot at index %d: %w", s.index, err)
	if errors.Is(err, ErrNewerData) {
		s.log.Error("a snapshot this release cannot restore was not kept: this node cannot follow the leader until it runs the release that wrote it",
			"index", s.index, "error", err.Error())
	} else {
		s.log.Error("a snapshot that does not read as one of this state machine was not kept", "index", s.index, "error", err.Error())
	}
	return s.err
}

func (s *checkingSink) Close() error {
	if s.err == nil && !s.checked {
		// A stream shorter than its header: the check decides on all of it.
		if err := s.check(bytes.NewReader(s.prefix)); err != nil {
			_ = s.SnapshotSink.Cancel()
			if errors.Is(err, io.ErrUnexpectedEOF) {
				return fmt.Errorf("snapshot at index %d: %d bytes, cut short before the end of its header: not kept", s.index, len(s.prefix))
			}
			return s.refuse(err)
		}
		if err := s.release(); err != nil {
			_ = s.SnapshotSink.Cancel()
			return err
		}
	}
	if s.err != nil {
		_ = s.SnapshotSink.Cancel()
		return s.err
	}
	return s.SnapshotSink.Close()
}
