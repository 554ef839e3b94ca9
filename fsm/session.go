package fsm

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// maxOutcomesPerSession bounds the outcomes one session keeps, so that a
// single client writing fast (an agent's own client ID) cannot grow its
// session past what a snapshot record holds. At 8,000 writes/s through one
// agent it still covers 16 s, more than any retry waits.
const maxOutcomesPerSession = 1 << 17

// maxSessionBytes bounds the encoded size of a session's outcomes (their
// records and error messages): a session is one snapshot record, which a
// restore refuses beyond 64 MiB. Past it the oldest outcomes are dropped.
const maxSessionBytes = 32 << 20

// maxSessionPrunePerApply bounds the idle sessions one entry deletes.
const maxSessionPrunePerApply = 256

// session is the in-memory record of TableSessions (fsmv1.Session in
// snapshots). Like every record it is immutable once stored: a write makes
// a new session. The outcomes of successive versions share one backing
// array: a new version appends after the outcomes its predecessor holds and
// drops outcomes by slicing them off the front, so a version never sees
// (and a write never changes) an element inside another committed
// version's slice. Appending is amortised O(1) and drops cost nothing,
// where a copy of the list per write would cost its length.
type session struct {
	clientID string
	// highest is the highest sequence applied.
	highest uint64
	// droppedThrough is the highest sequence whose outcome was dropped.
	droppedThrough uint64
	// lastUsed is the leader time (Unix nanoseconds) of the last write.
	lastUsed int64
	// outcomes in apply order.
	outcomes []outcome
	// bytes is the sum of the outcomes' sizes (outcome.size): not
	// persisted, a function of the outcomes kept.
	bytes int
}

// outcome is the outcome of one applied write: 64 bytes, where a dedupe
// record took some 570.
type outcome struct {
	seq, index uint64
	// maxSeq is the highest sequence of this outcome and of every one
	// appended before it to the same array (dropped ones included): find
	// stops at an outcome whose maxSeq is below what it looks for. Not
	// persisted; a restore computes it from the kept outcomes.
	maxSeq uint64
	time   int64  // leader time, Unix nanoseconds
	digest uint64 // the first 8 bytes of opDigest; 0 for none (a refusal)
	value  proto.Message
	err    *outcomeErr // nil on success
}

// size is what o adds to its session's snapshot record, about: the
// encoded size of the record it keeps and of its error, and 64 bytes for
// the rest. It depends on nothing but o, so every node counts the same.
func (o *outcome) size() int {
	n := 64
	if o.value != nil {
		n += proto.Size(o.value)
	}
	if o.err != nil {
		n += len(o.err.code) + len(o.err.msg)
	}
	return n
}

// outcomeErr is a failed write's persisted error code and message.
type outcomeErr struct{ code, msg string }

// find returns the outcome of sequence seq, or nil. Writes of one client
// are mostly applied in sequence order, so it searches from the newest,
// and stops where no older outcome can hold seq (maxSeq): a sequence
// applied out of order, or a new one below the highest, costs the
// distance to where it belongs, not the whole list.
func (s *session) find(seq uint64) *outcome {
	for i := len(s.outcomes) - 1; i >= 0; i-- {
		o := &s.outcomes[i]
		if o.seq == seq {
			return o
		}
		if o.maxSeq < seq {
			return nil
		}
	}
	return nil
}

// appendOutcome appends o to outcomes, setting its maxSeq.
func appendOutcome(outcomes []outcome, o outcome) []outcome {
	o.maxSeq = o.seq
	if n := len(outcomes); n > 0 {
		o.maxSeq = max(o.seq, outcomes[n-1].maxSeq)
	}
	return append(outcomes, o)
}

// sessionExpired reports whether s saw no write within the window before
// now: it is then as good as gone (pruning deletes it), and a write of its
// client starts a new one.
func (f *FSM) sessionExpired(s *session, now time.Time) bool {
	return s.lastUsed < now.UnixNano()-int64(f.cfg.DedupeWindow)
}

// withOutcome returns the next version of s (nil: a new session of
// clientID) after a write at now with outcome o: older outcomes than the
// window are dropped, and the oldest beyond maxOutcomesPerSession.
func (f *FSM) withOutcome(s *session, clientID string, now time.Time, o outcome) *session {
	n := &session{clientID: clientID}
	if s != nil {
		*n = *s
	}
	cutoff := now.UnixNano() - int64(f.cfg.DedupeWindow)
	size := o.size()
	drop := 0
	for drop < len(n.outcomes) && (n.outcomes[drop].time < cutoff || len(n.outcomes)-drop >= maxOutcomesPerSession ||
		n.bytes+size > maxSessionBytes) {
		n.droppedThrough = max(n.droppedThrough, n.outcomes[drop].seq)
		n.bytes -= n.outcomes[drop].size()
		drop++
	}
	if drop == len(n.outcomes) {
		// Start a new array: the old one holds only dropped outcomes.
		n.outcomes = nil
	} else {
		n.outcomes = n.outcomes[drop:]
	}
	n.outcomes = appendOutcome(n.outcomes, o)
	n.bytes += size
	n.highest = max(n.highest, o.seq)
	if s == nil {
		n.lastUsed = o.time
	} else {
		// Never back (leader clocks may differ a little): the session
		// queue's entries must never be later than their session.
		n.lastUsed = max(n.lastUsed, o.time)
	}
	return n
}

// newOutcome is the outcome of a write of cmd: its index, its error, and
// the record it wrote (value, shared with the table it is stored in).
func newOutcome(cmd *fsmv1.Command, index uint64, now time.Time, digest uint64, value proto.Message, opErr error) outcome {
	o := outcome{seq: cmd.GetSequence(), index: index, time: now.UnixNano(), digest: digest}
	if opErr != nil {
		o.err = &outcomeErr{code: errorCode(opErr), msg: opErr.Error()}
		return o
	}
	o.value = keptValue(value)
	return o
}

// keptValue is what an outcome keeps of the record a write wrote.
func keptValue(value proto.Message) proto.Message {
	switch v := value.(type) {
	case *clusterv1.ServiceInstance, *schedulev1.Schedule, *schedulev1.Run:
		return v
	case *clusterv1.ConfigEntry:
		// Without the value, which may be large (512 KiB) and which every
		// repeat carries itself (the digest matched): replay puts it back.
		e := proto.CloneOf(v)
		e.Value = ""
		return e
	}
	return nil
}

// replay is the Result of a repeat of the write o records; cmd is the
// repeat, nil when there is none (WriteOutcome): a config entry's value is
// taken from it.
func (o *outcome) replay(cmd *fsmv1.Command) *Result {
	res := &Result{Index: o.index, Value: o.value, Duplicate: true}
	if o.err != nil {
		res.Err = replayError(o.err.code, o.err.msg)
	}
	if e, ok := res.Value.(*clusterv1.ConfigEntry); ok && cmd.GetSetConfig() != nil {
		e = proto.CloneOf(e)
		e.Value = cmd.GetSetConfig().GetValue()
		res.Value = e
	}
	return res
}

// digest64 shortens a SHA-256 digest (0 when there is none).
func digest64(d []byte) uint64 {
	if len(d) < 8 {
		return 0
	}
	return binary.BigEndian.Uint64(d)
}

// sessionID is the primary key of TableSessions.
var sessionID = keyIndex(strField(func(s *session) string { return s.clientID }))

// sessionCodec encodes sessions as fsmv1.Session.
var sessionCodec = recordCodec{
	encode: func(b []byte, obj any) ([]byte, error) {
		s, ok := obj.(*session)
		if !ok {
			return nil, fmt.Errorf("encode record: object of type %T", obj)
		}
		var e sessionEncoder
		b, err := e.appendHeader(b, s)
		for i := 0; err == nil && i < len(s.outcomes); i++ {
			b, err = e.appendOutcome(b, &s.outcomes[i])
		}
		return b, err
	},
	decode: func(b []byte) (any, error) {
		m := new(fsmv1.Session)
		if err := proto.Unmarshal(b, m); err != nil {
			return nil, err
		}
		return sessionFromProto(m), nil
	},
}

func unixNanos(ts *timestamppb.Timestamp) int64 { return ts.AsTime().UnixNano() }

func nanosTime(n int64) *timestamppb.Timestamp { return timestamppb.New(time.Unix(0, n).UTC()) }

// sessionToProto is the snapshot form of s.
func sessionToProto(s *session) *fsmv1.Session {
	m := &fsmv1.Session{
		ClientId:        s.clientID,
		HighestSequence: s.highest,
		DroppedThrough:  s.droppedThrough,
		LastUsed:        nanosTime(s.lastUsed),
		Outcomes:        make([]*fsmv1.Outcome, len(s.outcomes)),
	}
	for i := range s.outcomes {
		o := &s.outcomes[i]
		p := &fsmv1.Outcome{Sequence: o.seq, Index: o.index, Time: nanosTime(o.time), OpDigest: o.digest}
		if o.err != nil {
			p.ErrorCode, p.ErrorMessage = o.err.code, o.err.msg
		}
		switch v := o.value.(type) {
		case *clusterv1.ServiceInstance:
			p.Value = &fsmv1.Outcome_Instance{Instance: v}
		case *clusterv1.ConfigEntry:
			p.Value = &fsmv1.Outcome_ConfigEntry{ConfigEntry: v}
		case *schedulev1.Schedule:
			p.Value = &fsmv1.Outcome_Schedule{Schedule: v}
		case *schedulev1.Run:
			p.Value = &fsmv1.Outcome_Run{Run: v}
		}
		m.Outcomes[i] = p
	}
	return m
}

// sessionFromProto is the in-memory form of a snapshot's session.
func sessionFromProto(m *fsmv1.Session) *session {
	s := &session{
		clientID:       m.GetClientId(),
		highest:        m.GetHighestSequence(),
		droppedThrough: m.GetDroppedThrough(),
		lastUsed:       unixNanos(m.GetLastUsed()),
		outcomes:       make([]outcome, 0, len(m.GetOutcomes())),
	}
	for _, p := range m.GetOutcomes() {
		o := outcome{seq: p.GetSequence(), index: p.GetIndex(), time: unixNanos(p.GetTime()), digest: p.GetOpDigest()}
		if p.GetErrorCode() != "" {
			o.err = &outcomeErr{code: p.GetErrorCode(), msg: p.GetErrorMessage()}
		}
		switch v := p.GetValue().(type) {
		case *fsmv1.Outcome_Instance:
			o.value = v.Instance
		case *fsmv1.Outcome_ConfigEntry:
			o.value = v.ConfigEntry
		case *fsmv1.Outcome_Schedule:
			o.value = v.Schedule
		case *fsmv1.Outcome_Run:
			o.value = v.Run
		}
		s.outcomes = appendOutcome(s.outcomes, o)
		s.bytes += o.size()
	}
	return s
}

// sessionsFromDedupe converts dedupe records (a snapshot of an older
// version) into the sessions applying the same writes makes now: per
// client, the outcomes in apply (index) order, the highest sequence, and
// the time of the last write.
func sessionsFromDedupe(recs []*fsmv1.DedupeRecord) []*session {
	slices.SortFunc(recs, func(a, b *fsmv1.DedupeRecord) int {
		if c := cmp.Compare(a.GetClientId(), b.GetClientId()); c != 0 {
			return c
		}
		return cmp.Compare(a.GetIndex(), b.GetIndex())
	})
	var out []*session
	for _, r := range recs {
		if len(out) == 0 || out[len(out)-1].clientID != r.GetClientId() {
			out = append(out, &session{clientID: r.GetClientId()})
		}
		s := out[len(out)-1]
		o := outcome{seq: r.GetSequence(), index: r.GetIndex(), time: unixNanos(r.GetTime()), digest: digest64(r.GetOpDigest()), value: dedupeValue(r)}
		if r.GetErrorCode() != "" {
			o.err = &outcomeErr{code: r.GetErrorCode(), msg: r.GetErrorMessage()}
		}
		s.outcomes = appendOutcome(s.outcomes, o)
		s.bytes += o.size()
		s.highest = max(s.highest, o.seq)
		if len(s.outcomes) == 1 {
			s.lastUsed = o.time
		} else {
			s.lastUsed = max(s.lastUsed, o.time)
		}
	}
	return out
}

// sessionQueue finds idle sessions without an index on last_used: it
// holds one entry per session, ordered by (time, client ID), whose time is
// at most the session's last_used (a write does not move its entry).
// Pruning looks at the front: an entry older than the cutoff whose session
// was used since is moved to the session's last_used; one whose session
// was not is deleted with it. Entries are never later than their session,
// so the sessions deleted, and their order, are those of a walk of a
// last_used index: every node deletes the same, whether its queue was
// built entry by entry or rebuilt from the table (after a restore or a
// discarded transaction).
type sessionQueue struct {
	valid   bool
	entries []sessionUse
}

type sessionUse struct {
	time     int64
	clientID string
}

func compareUse(a, b sessionUse) int {
	if c := cmp.Compare(a.time, b.time); c != 0 {
		return c
	}
	return cmp.Compare(a.clientID, b.clientID)
}

// load rebuilds the queue from the sessions table of t.
func (q *sessionQueue) load(t *writeTxn) error {
	it, err := tget(t.txn, TableSessions, indexID)
	if err != nil {
		return fmt.Errorf("read %s: %w", TableSessions, err)
	}
	entries := q.entries[:0]
	for obj := it.Next(); obj != nil; obj = it.Next() {
		s, ok := obj.(*session)
		if !ok {
			return fmt.Errorf("read %s: record of type %T", TableSessions, obj)
		}
		entries = append(entries, sessionUse{time: s.lastUsed, clientID: s.clientID})
	}
	slices.SortFunc(entries, compareUse)
	*q = sessionQueue{valid: true, entries: entries}
	return nil
}

// add puts an entry for a new session.
func (q *sessionQueue) add(u sessionUse) {
	if !q.valid {
		return
	}
	if n := len(q.entries); n == 0 || compareUse(q.entries[n-1], u) < 0 {
		q.entries = append(q.entries, u)
		return
	}
	i, _ := slices.BinarySearchFunc(q.entries, u, compareUse)
	q.entries = slices.Insert(q.entries, i, u)
}

func (q *sessionQueue) invalidate() {
	*q = sessionQueue{entries: q.entries[:0]}
}

// pruneSessions deletes up to maxSessionPrunePerApply sessions that saw no
// write within the window before now, oldest first.
func (f *FSM) pruneSessions(t *writeTxn, now time.Time) error {
	q := &f.sessions
	if !q.valid {
		if err := q.load(t); err != nil {
			return fmt.Errorf("prune sessions: %w", err)
		}
	}
	cutoff := now.UnixNano() - int64(f.cfg.DedupeWindow)
	deleted := 0
	for len(q.entries) > 0 && q.entries[0].time < cutoff && deleted < maxSessionPrunePerApply {
		u := q.entries[0]
		q.entries = q.entries[1:]
		s, err := lookup[*session](t, TableSessions, u.clientID)
		if err != nil {
			return fmt.Errorf("prune sessions: %w", err)
		}
		if s == nil {
			continue // impossible: every session has one entry
		}
		if s.lastUsed >= cutoff || s.lastUsed != u.time {
			// Used since the entry was made: it moves to its last use.
			q.add(sessionUse{time: s.lastUsed, clientID: s.clientID})
			continue
		}
		if err := t.delete(TableSessions, s); err != nil {
			return err
		}
		deleted++
	}
	return nil
}

// lookupSession returns the session of clientID in a read transaction.
func lookupSession(txn *memdb.Txn, clientID string) (*session, error) {
	return first[*session](txn, TableSessions, indexID, clientID)
}
