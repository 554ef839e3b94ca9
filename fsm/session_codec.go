package fsm

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// A session is one snapshot record however many outcomes it keeps: an
// agent's own client ID writes through one session, which holds up to
// maxOutcomesPerSession outcomes and maxSessionBytes of them, tens of
// megabytes. sessionEncoder writes that record piece by piece — the
// session's fields (an fsmv1.Session without outcomes), then each outcome
// as a field 5 of its own — with the same bytes as a deterministic marshal
// of sessionToProto, which builds three messages per outcome and the whole
// record in one buffer. Field 5 is Session's last field, and a repeated
// message field is encoded as one tag-length-value per element, so the
// concatenation is exactly that marshal (TestSessionEncoderMatchesProto).
// The messages are reused: nothing is allocated per outcome but what the
// marshal of its value allocates.
type sessionEncoder struct {
	hdr      fsmv1.Session
	out      fsmv1.Outcome
	lastUsed timestamppb.Timestamp
	time     timestamppb.Timestamp
	inst     fsmv1.Outcome_Instance
	config   fsmv1.Outcome_ConfigEntry
	schedule fsmv1.Outcome_Schedule
	run      fsmv1.Outcome_Run
	buf      []byte
}

// sessionOutcomesTag is the tag of Session.outcomes (field 5, length
// delimited).
var sessionOutcomesTag = protowire.AppendTag(nil, 5, protowire.BytesType)

// setTime sets ts to the Unix nanoseconds n, as nanosTime does.
func setTime(ts *timestamppb.Timestamp, n int64) *timestamppb.Timestamp {
	t := time.Unix(0, n)
	ts.Seconds, ts.Nanos = t.Unix(), int32(t.Nanosecond())
	return ts
}

// header is s without its outcomes, as sessionToProto makes it.
func (e *sessionEncoder) header(s *session) *fsmv1.Session {
	e.hdr.ClientId = s.clientID
	e.hdr.HighestSequence = s.highest
	e.hdr.DroppedThrough = s.droppedThrough
	e.hdr.LastUsed = setTime(&e.lastUsed, s.lastUsed)
	return &e.hdr
}

// outcome is o as sessionToProto makes it.
func (e *sessionEncoder) outcome(o *outcome) *fsmv1.Outcome {
	p := &e.out
	p.Sequence, p.Index, p.OpDigest = o.seq, o.index, o.digest
	p.Time = setTime(&e.time, o.time)
	p.ErrorCode, p.ErrorMessage = "", ""
	if o.err != nil {
		p.ErrorCode, p.ErrorMessage = o.err.code, o.err.msg
	}
	p.Value = nil
	switch v := o.value.(type) {
	case *clusterv1.ServiceInstance:
		e.inst.Instance = v
		p.Value = &e.inst
	case *clusterv1.ConfigEntry:
		e.config.ConfigEntry = v
		p.Value = &e.config
	case *schedulev1.Schedule:
		e.schedule.Schedule = v
		p.Value = &e.schedule
	case *schedulev1.Run:
		e.run.Run = v
		p.Value = &e.run
	}
	return p
}

// size is the length of s's record.
func (e *sessionEncoder) size(s *session) int {
	n := marshalOpts.Size(e.header(s))
	for i := range s.outcomes {
		on := marshalOpts.Size(e.outcome(&s.outcomes[i]))
		n += len(sessionOutcomesTag) + protowire.SizeBytes(on)
	}
	return n
}

// appendHeader appends the encoding of s's fields but its outcomes.
func (e *sessionEncoder) appendHeader(b []byte, s *session) ([]byte, error) {
	return marshalOpts.MarshalAppend(b, e.header(s))
}

// appendOutcome appends o as one element of Session.outcomes: its tag,
// its length and its encoding.
func (e *sessionEncoder) appendOutcome(b []byte, o *outcome) ([]byte, error) {
	p := e.outcome(o)
	b = append(b, sessionOutcomesTag...)
	b = protowire.AppendVarint(b, uint64(marshalOpts.Size(p)))
	return recordOpts(p, true).MarshalAppend(b, p)
}

// pieces calls fn with the record of s in pieces (the fields, then one
// outcome each) until fn returns false; the slice is valid during the
// call.
func (e *sessionEncoder) pieces(s *session, fn func([]byte) bool) error {
	var err error
	if e.buf, err = e.appendHeader(e.buf[:0], s); err != nil {
		return err
	}
	if !fn(e.buf) {
		return nil
	}
	for i := range s.outcomes {
		if e.buf, err = e.appendOutcome(e.buf[:0], &s.outcomes[i]); err != nil {
			return err
		}
		if !fn(e.buf) {
			return nil
		}
	}
	return nil
}

// writeRecord writes s's record, size bytes (sessionEncoder.size), with
// its length prefix, a piece at a time.
func (e *sessionEncoder) writeRecord(w *bufio.Writer, s *session, size int) error {
	if _, err := w.Write(protowire.AppendVarint(e.buf[:0], uint64(size))); err != nil {
		return err
	}
	var (
		n    int
		werr error
	)
	err := e.pieces(s, func(p []byte) bool {
		n += len(p)
		_, werr = w.Write(p)
		return werr == nil
	})
	switch {
	case err != nil:
		return err
	case werr != nil:
		return werr
	case n != size:
		return fmt.Errorf("session %q: wrote %d bytes, sized %d", s.clientID, n, size)
	}
	return nil
}

// readSame reads a session record of n bytes from r, comparing it piece by
// piece with the encoding of cur as it goes, so that a record equal to the
// session held — the common case of a restore, and the one of a session
// of tens of megabytes — is never held in memory: it reports true then.
// Otherwise it returns the whole record (the pieces that matched are
// encoded again): the caller decodes it.
func (e *sessionEncoder) readSame(r io.Reader, n uint64, cur *session) (bool, []byte, error) {
	var (
		read    uint64
		chunk   []byte
		matched int  // pieces that matched
		pending bool // chunk holds a piece read that did not match
		rerr    error
	)
	same := true
	err := e.pieces(cur, func(p []byte) bool {
		if read+uint64(len(p)) > n {
			same = false
			return false
		}
		chunk = growTo(chunk, len(p))
		if _, rerr = io.ReadFull(r, chunk); rerr != nil {
			return false
		}
		read += uint64(len(p))
		if !bytes.Equal(chunk, p) {
			same, pending = false, true
			return false
		}
		matched++
		return true
	})
	switch {
	case err != nil:
		return false, nil, err
	case rerr != nil:
		return false, nil, fmt.Errorf("%w: read record: %w", ErrCorruptSnapshot, noEOF(rerr))
	case same && read == n:
		return true, nil, nil
	}
	// The record as read so far: the pieces that matched, and the one
	// that did not, if any; then the rest of it.
	rec := make([]byte, 0, n)
	k := 0
	if err := e.pieces(cur, func(p []byte) bool {
		if k == matched {
			return false
		}
		rec = append(rec, p...)
		k++
		return true
	}); err != nil {
		return false, nil, err
	}
	if pending {
		rec = append(rec, chunk...)
	}
	rest := int(n) - len(rec)
	rec = rec[:n]
	if _, err := io.ReadFull(r, rec[len(rec)-rest:]); err != nil {
		return false, nil, fmt.Errorf("%w: read record: %w", ErrCorruptSnapshot, noEOF(err))
	}
	return false, rec, nil
}

// growTo returns b resized to n bytes, reallocated only when too small.
func growTo(b []byte, n int) []byte {
	if cap(b) < n {
		return make([]byte, n, max(n, 2*cap(b)))
	}
	return b[:n]
}
