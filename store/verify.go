package store

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/hashicorp/raft-wal/verifier"
)

// Log verification, as Consul's raft_logstore.verification: the leader
// appends a checkpoint entry every LogVerificationInterval; raft-wal's
// verifier, wrapped around whichever log store the node uses, writes the
// checksum of every entry since the previous checkpoint into the
// checkpoint's Extensions before the entry is stored (so it replicates with
// it); every node, the leader included, then reads the range back from its
// own disk and compares both sums, its written one and its read one, with
// the leader's. A mismatch is logged as an error and counted
// (Store.LogVerification, pivirt_raft_log_verification_failures_total):
// the disk or the log store changed an entry after it was handed over.

// checkpointData is a checkpoint entry's data. Its first byte is not the
// fsm's CommandVersion (1), so no FSM decodes it as a command; the store
// hands it to the FSM as a no-op (checkpointFilter).
var checkpointData = []byte("\xffpivirt log verification checkpoint")

// isCheckpoint is verifier.IsCheckpointFn.
func isCheckpoint(l *raft.Log) (bool, error) {
	return l.Type == raft.LogCommand && bytes.Equal(l.Data, checkpointData), nil
}

// noopFor returns l, or, for a checkpoint, a no-op entry with l's index and
// term: the FSM's applied index still moves over it (ReadIndex waits for
// it), but no FSM sees data it does not know.
func noopFor(l *raft.Log) *raft.Log {
	if ok, _ := isCheckpoint(l); !ok {
		return l
	}
	return &raft.Log{Index: l.Index, Term: l.Term, Type: raft.LogNoop, AppendedAt: l.AppendedAt}
}

// checkpointFilter is the FSM as Raft sees it: checkpoints become no-ops.
type checkpointFilter struct{ raft.FSM }

func (f checkpointFilter) Apply(l *raft.Log) any { return f.FSM.Apply(noopFor(l)) }

// batchingCheckpointFilter keeps a raft.BatchingFSM batching.
type batchingCheckpointFilter struct {
	checkpointFilter
	batch raft.BatchingFSM
}

func (f batchingCheckpointFilter) ApplyBatch(logs []*raft.Log) []any {
	for i, l := range logs {
		if n := noopFor(l); n != l {
			// Raft keeps its own slice; the FSM gets a copy with no-ops.
			cp := make([]*raft.Log, len(logs))
			copy(cp, logs)
			for j := i; j < len(cp); j++ {
				cp[j] = noopFor(cp[j])
			}
			return f.batch.ApplyBatch(cp)
		}
	}
	return f.batch.ApplyBatch(logs)
}

// filterCheckpoints wraps fsm in the checkpoint filter of its kind.
func filterCheckpoints(fsm raft.FSM) raft.FSM {
	if b, ok := fsm.(raft.BatchingFSM); ok {
		return batchingCheckpointFilter{checkpointFilter{fsm}, b}
	}
	return checkpointFilter{fsm}
}

// LogVerification counts this node's log verification reports.
type LogVerification struct {
	Passed uint64 // ranges whose sums all matched the leader's
	// Failed are ranges whose written or read sum did not match the
	// leader's, or that could not be read back: damage.
	Failed uint64
	// Skipped are ranges this node could not check: it did not hold the
	// whole range (it started, or its log was compacted, since the range
	// began) or the verifier was still busy with the previous one.
	Skipped uint64
}

// verification is the report side of log verification.
type verification struct {
	log                     *slog.Logger
	passed, failed, skipped atomic.Uint64
}

// report is verifier.ReportFn: called by the verifier's goroutine, one
// report at a time.
func (v *verification) report(r verifier.VerificationReport) {
	attrs := []any{"range", r.Range.String(), "expected_sum", r.ExpectedSum, "read_sum", r.ReadSum, "elapsed", r.Elapsed.String()}
	if r.WrittenSum != 0 {
		attrs = append(attrs, "written_sum", r.WrittenSum)
	}
	if r.SkippedRange != nil {
		v.skipped.Add(1)
		v.log.Warn("log verification skipped a range: the previous one was still being read; lengthen cluster.raft.log_verification.interval if this repeats",
			"skipped_range", r.SkippedRange.String())
	}
	switch {
	case r.Err == nil:
		v.passed.Add(1)
		v.log.Debug("log verification passed", attrs...)
	case errors.Is(r.Err, verifier.ErrRangeMismatch):
		v.skipped.Add(1)
		v.log.Info("log verification skipped: this node does not hold every entry of the range (it started, or compacted its log, since the range began)", attrs...)
	default:
		v.failed.Add(1)
		v.log.Error("log verification FAILED: an entry on this node's disk differs from what the leader wrote; the disk or the log store is damaging data. Replace this node's data dir (see docs/backup.md, \"Log verification\")",
			append(attrs, "error", r.Err.Error())...)
	}
}

// LogVerification returns this node's verification counts since it started.
func (s *Store) LogVerification() LogVerification {
	if s.verify == nil {
		return LogVerification{}
	}
	return LogVerification{Passed: s.verify.passed.Load(), Failed: s.verify.failed.Load(), Skipped: s.verify.skipped.Load()}
}

// runCheckpoints appends a checkpoint every interval while this server
// leads and allowed (nil: always) says so, until Close.
func (s *Store) runCheckpoints(interval time.Duration, allowed func() bool) {
	ch, cancel := s.SubscribeLeadership()
	defer cancel()
	var tick <-chan time.Time
	var t *time.Ticker
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		select {
		case <-s.closing:
			return
		case leader, ok := <-ch:
			if !ok {
				return
			}
			if t != nil {
				t.Stop()
				t, tick = nil, nil
			}
			if leader {
				t = time.NewTicker(interval)
				tick = t.C
			}
		case <-tick:
			if allowed != nil && !allowed() {
				continue
			}
			ctx, cancelApply := context.WithTimeout(context.Background(), interval)
			err := s.wait(ctx, s.raft.Apply(checkpointData, interval))
			cancelApply()
			if err != nil {
				s.log.Debug("log verification checkpoint not appended", "error", err)
			}
		}
	}
}
