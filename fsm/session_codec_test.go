package fsm

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// testSession returns a session of n outcomes of every kind: values of
// each table, a refusal, and times before and after 1970.
func testSession(client string, n int) *session {
	s := &session{clientID: client, highest: uint64(n + 7), droppedThrough: 3, lastUsed: 1_700_000_000_123_456_789}
	for i := range n {
		o := outcome{seq: uint64(i + 4), index: uint64(100 + i), time: int64(i)*1_000_000_007 - 5_000_000_000, digest: uint64(i) * 0x9e3779b97f4a7c15}
		switch i % 5 {
		case 0:
			o.value = &clusterv1.ServiceInstance{Service: "web", InstanceId: fmt.Sprintf("i-%d", i), Port: 80,
				Meta: map[string]string{"b": "2", "a": "1", "c": fmt.Sprint(i)}, Tags: []string{"x"}}
		case 1:
			o.value = &clusterv1.ConfigEntry{Key: "k", Value: fmt.Sprint(i)}
		case 2:
			o.value = &schedulev1.Schedule{Id: fmt.Sprintf("s-%d", i)}
		case 3:
			o.value = &schedulev1.Run{ScheduleId: "s", Node: fmt.Sprint(i), Attempts: uint32(i)}
		case 4:
			o.err = &outcomeErr{code: "not_found", msg: fmt.Sprintf("no %d", i)}
		}
		s.outcomes = appendOutcome(s.outcomes, o)
	}
	return s
}

// TestSessionEncoderMatchesProto: the piecewise encoding of a session is
// the deterministic marshal of sessionToProto, byte for byte, and its size
// is that length; writeRecord writes it with its length prefix.
func TestSessionEncoderMatchesProto(t *testing.T) {
	for _, s := range []*session{
		testSession("c-1", 0),
		testSession("c-2", 1),
		testSession("c-3", 57),
		{clientID: "zero"},
	} {
		want, err := marshalOpts.Marshal(sessionToProto(s))
		if err != nil {
			t.Fatal(err)
		}
		got, err := sessionCodec.encode(nil, s)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("session %q: encoder wrote %x\nproto marshals  %x", s.clientID, got, want)
		}
		var e sessionEncoder
		if n := e.size(s); n != len(want) {
			t.Fatalf("session %q: size %d, encoding is %d bytes", s.clientID, n, len(want))
		}
		var buf bytes.Buffer
		bw := bufio.NewWriter(&buf)
		if err := e.writeRecord(bw, s, e.size(s)); err != nil {
			t.Fatal(err)
		}
		if err := bw.Flush(); err != nil {
			t.Fatal(err)
		}
		prefixed := append(binaryUvarint(len(want)), want...)
		if !bytes.Equal(buf.Bytes(), prefixed) {
			t.Fatalf("session %q: writeRecord wrote %x, want %x", s.clientID, buf.Bytes(), prefixed)
		}
		back, err := sessionCodec.decode(got)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(sessionToProto(back.(*session)), sessionToProto(s)) {
			t.Fatalf("session %q does not decode to itself", s.clientID)
		}
	}
}

func binaryUvarint(n int) []byte {
	var b []byte
	for x := uint64(n); ; x >>= 7 {
		if x < 0x80 {
			return append(b, byte(x))
		}
		b = append(b, byte(x)|0x80)
	}
}

// TestSessionReadSame: a session record equal to the session held is
// recognised while it is read; any other record — another session, one
// that differs in its fields, in an outcome, by an outcome more or less —
// comes back whole, with the bytes read, so that it decodes to what it
// holds; a record cut short is ErrCorruptSnapshot.
func TestSessionReadSame(t *testing.T) {
	held := testSession("c-1", 40)
	enc := func(s *session) []byte {
		b, err := sessionCodec.encode(nil, s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	changedOutcome := testSession("c-1", 40)
	changedOutcome.outcomes[17].index++
	fewer := testSession("c-1", 39)
	fewer.highest = held.highest
	more := testSession("c-1", 41)
	more.highest = held.highest
	otherFields := testSession("c-1", 40)
	otherFields.droppedThrough++
	for _, tc := range []struct {
		name string
		rec  []byte
		same bool
	}{
		{"same", enc(held), true},
		{"another client", enc(testSession("c-0", 40)), false},
		{"other fields", enc(otherFields), false},
		{"an outcome differs", enc(changedOutcome), false},
		{"an outcome fewer", enc(fewer), false},
		{"an outcome more", enc(more), false},
		{"trailing bytes", append(enc(held), 0x08, 0x01), false},
		{"empty", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := bytes.NewReader(append(append([]byte(nil), tc.rec...), "next"...))
			var e sessionEncoder
			same, rec, err := e.readSame(r, uint64(len(tc.rec)), held)
			if err != nil {
				t.Fatal(err)
			}
			if same != tc.same {
				t.Fatalf("same = %v, want %v", same, tc.same)
			}
			if !same && !bytes.Equal(rec, tc.rec) {
				t.Fatalf("record read back as %x, want %x", rec, tc.rec)
			}
			if rest, _ := io.ReadAll(r); string(rest) != "next" {
				t.Fatalf("left %q after the record, want %q", rest, "next")
			}
		})
	}
	t.Run("truncated", func(t *testing.T) {
		for _, cut := range []int{0, 5, len(enc(held)) / 2, len(enc(held)) - 1} {
			var e sessionEncoder
			_, _, err := e.readSame(bytes.NewReader(enc(held)[:cut]), uint64(len(enc(held))), held)
			if !errors.Is(err, ErrCorruptSnapshot) || !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("cut at %d: %v, want ErrCorruptSnapshot and io.ErrUnexpectedEOF", cut, err)
			}
		}
	})
}

// TestRecordBody: a record body is read whole however long, into a buffer
// grown with the data that arrives: a length prefix claiming more than the
// stream holds is ErrCorruptSnapshot, with at most recordChunk more
// allocated than the stream held.
func TestRecordBody(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 3*recordChunk/16+5)
	for _, n := range []int{0, 1, 100, recordChunk, len(big)} {
		sr := newSnapshotReader(bytes.NewReader(append(append(binaryUvarint(n), big[:n]...), 0x2a)))
		b, err := sr.record(maxRecordSize)
		if err != nil || !bytes.Equal(b, big[:n]) {
			t.Fatalf("record of %d bytes: read %d bytes, %v", n, len(b), err)
		}
		if next, err := sr.br.ReadByte(); err != nil || next != 0x2a {
			t.Fatalf("record of %d bytes: next byte %x, %v", n, next, err)
		}
	}
	sr := newSnapshotReader(bytes.NewReader(append(binaryUvarint(maxRecordSize), big[:10]...)))
	if _, err := sr.record(maxRecordSize); !errors.Is(err, ErrCorruptSnapshot) || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("a record cut short: %v, want ErrCorruptSnapshot and io.ErrUnexpectedEOF", err)
	}
	if cap(sr.buf) > recordChunk {
		t.Fatalf("a 10-byte stream claiming %d bytes grew the buffer to %d", maxRecordSize, cap(sr.buf))
	}
}

// TestMapsInOrderKnowsEveryMap: mapsInOrder checks the maps of the record
// types that have any by their fields; a map added to one of them (or to
// a message they hold) must be checked there too, or their encoding would
// depend on the order of its entries.
func TestMapsInOrderKnowsEveryMap(t *testing.T) {
	checked := map[string][]string{
		"pivirt.cluster.v1.ServiceInstance": {"meta"},
		"pivirt.fsm.v1.DedupeRecord":        {"instance.meta"},
		"pivirt.fsm.v1.Outcome":             {"instance.meta"},
	}
	var types []proto.Message
	for _, td := range tableDefs {
		if obj, err := td.codec.decode(nil); err == nil {
			if m, ok := obj.(proto.Message); ok {
				types = append(types, m)
			}
		}
	}
	for _, m := range append(types, &fsmv1.Outcome{}) {
		md := m.ProtoReflect().Descriptor()
		got := mapFields(md, "", nil)
		want, isChecked := checked[string(md.FullName())]
		switch {
		case isChecked && !slices.Equal(got, want):
			t.Errorf("%s holds the maps %q, mapsInOrder checks %q: extend it", md.FullName(), got, want)
		case !isChecked && len(got) > 0 && mapsInOrder(m):
			t.Errorf("%s holds the maps %q, mapsInOrder says they are in order", md.FullName(), got)
		}
	}
}

// TestRecordOptsEncodeDeterministically: a record encodes to the bytes of
// marshalOpts whatever its maps hold.
func TestRecordOptsEncodeDeterministically(t *testing.T) {
	inst := func(meta map[string]string) *clusterv1.ServiceInstance {
		return &clusterv1.ServiceInstance{Service: "web", InstanceId: "i", Port: 80, Meta: meta, Tags: []string{"a", "b"}}
	}
	metas := []map[string]string{nil, {"a": "1"}, {"z": "1", "a": "2", "m": "3", "b": "4", "y": "5", "c": "6"}}
	for _, meta := range metas {
		for _, m := range []proto.Message{
			inst(meta),
			&fsmv1.DedupeRecord{ClientId: "c", Value: &fsmv1.DedupeRecord_Instance{Instance: inst(meta)}},
			&fsmv1.Outcome{Sequence: 1, Value: &fsmv1.Outcome_Instance{Instance: inst(meta)}},
			&clusterv1.ConfigEntry{Key: "k", Value: "v"},
		} {
			want, err := marshalOpts.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			for range 20 { // map order is random per iteration
				for _, sized := range []bool{false, true} {
					proto.Size(m)
					got, err := recordOpts(m, sized).Marshal(m)
					if err != nil || !bytes.Equal(got, want) {
						t.Fatalf("%T with meta %v (sized %v): %x, %v; want %x", m, meta, sized, got, err, want)
					}
				}
			}
		}
	}
}

// sessionPointers returns the sessions f holds.
func sessionPointers(t *testing.T, f *FSM) []*session {
	t.Helper()
	it, err := tget(f.State().txn, TableSessions, indexID)
	if err != nil {
		t.Fatal(err)
	}
	var out []*session
	for obj := it.Next(); obj != nil; obj = it.Next() {
		out = append(out, obj.(*session))
	}
	return out
}

// TestRestoreKeepsTheSessionHeld: restoring a snapshot whose sessions are
// the ones held keeps them (compared as they are read, not decoded); one
// whose session differs gets the snapshot's.
func TestRestoreKeepsTheSessionHeld(t *testing.T) {
	h := newHarness(t)
	populate(h)
	snap := h.snapshot()
	before := sessionPointers(t, h.f)
	if len(before) == 0 {
		t.Fatal("populate made no session")
	}
	if err := h.f.Restore(readCloser(snap)); err != nil {
		t.Fatal(err)
	}
	if after := sessionPointers(t, h.f); !slices.Equal(after, before) {
		t.Fatalf("restoring the state's own snapshot replaced its sessions")
	}

	other := newHarness(t)
	populate(other)
	other.mustApply(withClient(register(instance("web", "late")), before[0].clientID, before[0].highest+1))
	want := dumpTables(t, other.f)[TableSessions]
	if err := h.f.Restore(readCloser(other.snapshot())); err != nil {
		t.Fatal(err)
	}
	if got := dumpTables(t, h.f)[TableSessions]; !slices.Equal(got, want) {
		t.Fatalf("sessions after restoring a changed one:\n got %v\nwant %v", got, want)
	}
	if after := sessionPointers(t, h.f); after[0] == before[0] {
		t.Fatal("a changed session was kept as held")
	}
}

// TestReplaceKeeping: ReplaceKeeping leaves the kept tables holding the
// very records of the state they are kept from, and refuses records
// listed for them.
func TestReplaceKeeping(t *testing.T) {
	h := newHarness(t)
	populate(h)
	cur := h.f.State()
	want := dumpTables(t, h.f)
	fork, err := h.f.Fork(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	other := newHarness(t)
	populate(other)
	other.mustApply(withClient(register(instance("web", "late")), "another", 1))
	if err := fork.Restore(readCloser(other.snapshot())); err != nil {
		t.Fatal(err)
	}
	if err := fork.ReplaceKeeping(h.f.AppliedIndex()+1, nil, cur, TableSessions, TableCA); err != nil {
		t.Fatal(err)
	}
	got := dumpTables(t, fork)
	for _, table := range []string{TableSessions, TableCA} {
		if !slices.Equal(got[table], want[table]) {
			t.Errorf("kept table %s:\n got %v\nwant %v", table, got[table], want[table])
		}
	}
	if len(got[TableServices]) != 0 {
		t.Errorf("services not listed nor kept hold %v", got[TableServices])
	}
	if !slices.Equal(sessionPointers(t, fork), sessionPointers(t, h.f)) {
		t.Error("kept sessions are copies, not the records held")
	}
	err = fork.ReplaceKeeping(1, []TableRecord{{Table: TableCA, Record: &fsmv1.ClusterCA{}}}, cur, TableCA)
	if err == nil || !strings.Contains(err.Error(), "kept") {
		t.Errorf("ReplaceKeeping with a record of a kept table = %v, want a refusal", err)
	}
}
