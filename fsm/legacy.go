package fsm

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"time"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// A state at cluster version 0.0 in Raft mode is applied as the agents
// that predate cluster versions apply it, byte for byte, so that a cluster
// mixing them with this release keeps identical replicas (DESIGN.md,
// "Cluster version"): one dedupe record per write with a client ID, without
// the record the write wrote, pruned 256 at most per entry, oldest first,
// before the entry's own outcome is recorded. The apply functions follow
// the same rule where their behaviour changed (t.legacy()).

// maxPrunePerApply bounds the dedupe records one entry deletes at 0.0, so
// that a leader clock jump cannot make a single entry expensive.
const maxPrunePerApply = 256

// finishLegacy prunes expired dedupe records and records the outcome of a
// write with a client ID in a dedupe record of its own (version 0.0).
func (f *FSM) finishLegacy(t *writeTxn, cmd *fsmv1.Command, id identity, opErr error) error {
	if err := f.pruneDedupe(t, cmd.GetTime().AsTime()); err != nil {
		return err
	}
	if cmd.GetClientId() == "" {
		return nil
	}
	rec := &fsmv1.DedupeRecord{
		ClientId:  cmd.GetClientId(),
		Sequence:  cmd.GetSequence(),
		Index:     t.index,
		ErrorCode: errorCode(opErr),
		Time:      cmd.GetTime(),
		OpDigest:  id.digest,
	}
	if opErr != nil {
		rec.ErrorMessage = opErr.Error()
	}
	if err := t.insert(TableDedupe, rec); err != nil {
		return err
	}
	f.head.inserted(rec, id.replaced)
	return nil
}

// pruneDedupe deletes up to maxPrunePerApply dedupe records older than the
// window, oldest first (in the order of the dedupe queue).
func (f *FSM) pruneDedupe(t *writeTxn, now time.Time) error {
	cutoff := now.Add(-f.cfg.DedupeWindow)
	for range maxPrunePerApply {
		rec, err := f.head.first(t)
		if err != nil {
			return fmt.Errorf("prune dedupe records: %w", err)
		}
		if rec == nil || !rec.GetTime().AsTime().Before(cutoff) {
			return nil
		}
		if err := t.delete(TableDedupe, rec); err != nil {
			return err
		}
		f.head.pop()
	}
	return nil
}

// dedupeQueue holds every dedupe record of a state at 0.0 in pruning
// order (compareDedupe: time, then key), so that pruning pops the oldest
// without an index.
//
// It is derived state, never part of the replicated state: when it may
// not describe the committed table (a transaction that wrote was discarded,
// the version moved, or a snapshot was restored) it is invalidated and
// rebuilt from the table on next use. Every node holding the same table
// builds the same queue, so pruning stays deterministic.
type dedupeQueue struct {
	valid bool
	recs  []*fsmv1.DedupeRecord
}

// load rebuilds the queue from the dedupe table of t.
func (q *dedupeQueue) load(t *writeTxn) error {
	it, err := tget(t.txn, TableDedupe, indexID)
	if err != nil {
		return fmt.Errorf("read %s: %w", TableDedupe, err)
	}
	clear(q.recs)
	recs := q.recs[:0]
	for obj := it.Next(); obj != nil; obj = it.Next() {
		rec, ok := obj.(*fsmv1.DedupeRecord)
		if !ok {
			return fmt.Errorf("read %s: record of type %T", TableDedupe, obj)
		}
		recs = append(recs, rec)
	}
	slices.SortFunc(recs, compareDedupe)
	*q = dedupeQueue{valid: true, recs: recs}
	return nil
}

// first returns the oldest dedupe record, or nil when there is none.
func (q *dedupeQueue) first(t *writeTxn) (*fsmv1.DedupeRecord, error) {
	if !q.valid {
		if err := q.load(t); err != nil {
			return nil, err
		}
	}
	if len(q.recs) == 0 {
		return nil, nil
	}
	return q.recs[0], nil
}

// pop forgets the oldest record, which was just deleted.
func (q *dedupeQueue) pop() {
	q.recs[0] = nil
	q.recs = q.recs[1:]
}

// inserted accounts for a dedupe record just inserted; old is the record
// with the same key it replaced, if any (an expired one not pruned yet).
func (q *dedupeQueue) inserted(rec, old *fsmv1.DedupeRecord) {
	if !q.valid {
		return
	}
	if old != nil {
		if i, found := slices.BinarySearchFunc(q.recs, old, compareDedupe); found && q.recs[i] == old {
			q.recs = slices.Delete(q.recs, i, i+1)
		}
		// Not found: pruning removed it earlier in the same entry.
	}
	// Leader time rarely goes backwards, so the new record is almost
	// always the last.
	if n := len(q.recs); n == 0 || compareDedupe(q.recs[n-1], rec) < 0 {
		q.recs = append(q.recs, rec)
		return
	}
	i, _ := slices.BinarySearchFunc(q.recs, rec, compareDedupe)
	q.recs = slices.Insert(q.recs, i, rec)
}

func (q *dedupeQueue) invalidate() {
	clear(q.recs)
	*q = dedupeQueue{recs: q.recs[:0]}
}

// compareDedupe orders dedupe records by time, then by the bytes of their
// primary key (client_id NUL-terminated, then the big-endian sequence): the
// order of the 12-byte time key followed by the primary key.
func compareDedupe(a, b *fsmv1.DedupeRecord) int {
	at, bt := a.GetTime(), b.GetTime()
	if c := cmp.Compare(uint64(at.GetSeconds())^(1<<63), uint64(bt.GetSeconds())^(1<<63)); c != 0 {
		return c
	}
	if c := cmp.Compare(uint32(at.GetNanos()), uint32(bt.GetNanos())); c != 0 {
		return c
	}
	ac, bc := a.GetClientId(), b.GetClientId()
	if strings.IndexByte(ac, 0) < 0 && strings.IndexByte(bc, 0) < 0 {
		// Without NUL inside, the terminator makes the byte order of the
		// client IDs the string order.
		if c := strings.Compare(ac, bc); c != 0 {
			return c
		}
		return cmp.Compare(a.GetSequence(), b.GetSequence())
	}
	ak := binary.BigEndian.AppendUint64(append([]byte(ac), 0), a.GetSequence())
	bk := binary.BigEndian.AppendUint64(append([]byte(bc), 0), b.GetSequence())
	return bytes.Compare(ak, bk)
}
