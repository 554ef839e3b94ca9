package fsm

import (
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// dedupeCount is the number of outcomes the sessions keep.
func dedupeCount(t *testing.T, h *harness) int {
	t.Helper()
	it, err := tget(h.f.State().txn, TableSessions, indexID)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, s := range collect[*session](it) {
		n += len(s.outcomes)
	}
	return n
}

// sessionCount is the number of sessions.
func sessionCount(t *testing.T, h *harness) int {
	t.Helper()
	return len(dumpTables(t, h.f)[TableSessions])
}

func TestDedupeRepeatSuccess(t *testing.T) {
	h := newHarness(t)
	first := h.mustApply(withClient(register(instance("web", "a")), "client-1", 1))
	before := dumpTables(t, h.f)
	h.now = h.now.Add(time.Minute)
	again := h.apply(withClient(register(instance("web", "a")), "client-1", 1))
	if !again.Duplicate || again.Index != first.Index || again.Err != nil || !proto.Equal(again.Value, first.Value) {
		t.Errorf("repeat = %+v, want Duplicate, Index %d, no error, the first write's value %v", again, first.Index, first.Value)
	}
	if after := dumpTables(t, h.f); !reflect.DeepEqual(before, after) {
		t.Errorf("a duplicate changed the state:\nbefore %v\nafter  %v", before, after)
	}
	if got := h.f.AppliedIndex(); got != 2 {
		t.Errorf("AppliedIndex() = %d, want 2", got)
	}
	if got := h.f.State().Index(Tables()...); got != 1 {
		t.Errorf("table index = %d, want 1 (a duplicate must not bump it)", got)
	}
}

func TestDedupeRepeatError(t *testing.T) {
	h := newHarness(t)
	h.mustApply(setConfig("k", "v1")) // revision 1
	conflict := h.apply(withClient(setConfigCAS("k", "v2", 7), "client-1", 1))
	if !errors.Is(conflict.Err, ErrCASConflict) {
		t.Fatalf("first apply: %v, want ErrCASConflict", conflict.Err)
	}
	if got := h.f.State().Index(TableConfig); got != 1 {
		t.Errorf("config index after a rejected write = %d, want 1", got)
	}
	// The retry of the same write gets the stored outcome.
	again := h.apply(withClient(setConfigCAS("k", "v2", 7), "client-1", 1))
	if !again.Duplicate || again.Index != conflict.Index || !errors.Is(again.Err, ErrCASConflict) {
		t.Fatalf("repeat = %+v, want Duplicate with ErrCASConflict at index %d", again, conflict.Index)
	}
	if again.Err.Error() != conflict.Err.Error() {
		t.Errorf("repeat error %q, want the original message %q", again.Err, conflict.Err)
	}
}

func TestDedupeIdentity(t *testing.T) {
	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	tests := []struct {
		name string
		cmd  *fsmv1.Command
		dup  bool
	}{
		{"first", withClient(heartbeat("web", "a"), "c1", 1), false},
		{"same client and sequence", withClient(heartbeat("web", "a"), "c1", 1), true},
		{"next sequence", withClient(heartbeat("web", "a"), "c1", 2), false},
		{"other client", withClient(heartbeat("web", "a"), "c2", 1), false},
		{"no client id", heartbeat("web", "a"), false},
		{"no client id again", heartbeat("web", "a"), false},
		{"sequence without client id", withClient(heartbeat("web", "a"), "", 1), false},
		{"sequence without client id again", withClient(heartbeat("web", "a"), "", 1), false},
	}
	for _, tt := range tests {
		res := h.apply(tt.cmd)
		if res.Err != nil || res.Duplicate != tt.dup {
			t.Errorf("%s: Result %+v, want Duplicate=%v and no error", tt.name, res, tt.dup)
		}
	}
	if n := dedupeCount(t, h); n != 3 {
		t.Errorf("dedupe records = %d, want 3", n)
	}
}

// TestDedupeWindow: within the window a repeat gets its outcome; after
// it, a session still in use refuses the repeat as too old to replay
// (never applies it twice), and a session that saw no write for the
// window is gone, so the repeat is a new client's first write.
func TestDedupeWindow(t *testing.T) {
	const window = 10 * time.Minute
	tests := []struct {
		name    string
		after   time.Duration
		keepUp  bool // the client writes again just before the repeat
		wantDup bool
		wantErr error
		wantRev uint64
	}{
		{"immediately", 0, false, true, nil, 1},
		{"inside the window", window - time.Second, false, true, nil, 1},
		{"at the window", window, false, true, nil, 1},
		{"after the window, session idle", window + time.Nanosecond, false, false, nil, 2},
		{"after the window, session in use", window + time.Nanosecond, true, false, ErrTooOldToReplay, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, func(c *Config) { c.DedupeWindow = window })
			h.mustApply(withClient(setConfig("k", "v1"), "c", 1))
			if tt.keepUp {
				h.now = t0.Add(window / 2)
				h.mustApply(withClient(setConfig("k", "v1"), "c", 2))
			}
			h.now = t0.Add(tt.after)
			res := h.apply(withClient(setConfig("k", "v1"), "c", 1))
			if res.Duplicate != tt.wantDup || !errors.Is(res.Err, tt.wantErr) || (tt.wantErr == nil) != (res.Err == nil) {
				t.Fatalf("Result %+v, want Duplicate=%v, error %v", res, tt.wantDup, tt.wantErr)
			}
			e, _ := h.f.State().ConfigEntry("k")
			if e.GetRevision() != tt.wantRev {
				t.Errorf("revision = %d, want %d", e.GetRevision(), tt.wantRev)
			}
			if n := sessionCount(t, h); n != 1 {
				t.Errorf("sessions = %d, want 1", n)
			}
		})
	}
}

// TestSessionOutcomes: outcomes older than the window leave the session
// when its client writes again, and a repeat of one of them is refused as
// too old; writes applied out of order (concurrent requests of one
// client) each apply once, and an idle session is pruned by any write.
func TestSessionOutcomes(t *testing.T) {
	h := newHarness(t)
	window := DefaultConfig().DedupeWindow
	for i := range 10 {
		h.now = t0.Add(time.Duration(i) * time.Second)
		h.mustApply(withClient(setConfig("k", "v"), "c", uint64(2*i+2))) // even sequences
	}
	// The odd sequences arrive late, out of order: new writes, applied.
	for i := range 10 {
		res := h.apply(withClient(setConfig("k", "v"), "c", uint64(2*i+1)))
		if res.Err != nil || res.Duplicate {
			t.Fatalf("late sequence %d: %+v, want applied", 2*i+1, res)
		}
	}
	if n := dedupeCount(t, h); n != 20 {
		t.Fatalf("outcomes = %d, want 20", n)
	}
	// Past the window of the first five writes: the next write drops them.
	h.now = t0.Add(window + 4*time.Second + time.Millisecond)
	h.mustApply(withClient(setConfig("k", "v"), "c", 100))
	if res := h.apply(withClient(setConfig("k", "v"), "c", 2)); !errors.Is(res.Err, ErrTooOldToReplay) || res.Duplicate {
		t.Fatalf("repeat of a dropped outcome: %+v, want ErrTooOldToReplay", res)
	}
	if res := h.apply(withClient(setConfig("k", "v"), "c", 12)); res.Err != nil || !res.Duplicate {
		t.Fatalf("repeat of a kept outcome: %+v, want a duplicate", res)
	}
	// Sequence 3, below the dropped ones but applied late, is kept.
	if res := h.apply(withClient(setConfig("k", "v"), "c", 3)); res.Err != nil || !res.Duplicate {
		t.Fatalf("repeat of sequence 3: %+v, want a duplicate", res)
	}
	// Another client's session, idle for the window, goes with any write.
	h.mustApply(withClient(setConfig("k", "v"), "other", 1))
	h.now = h.now.Add(window + time.Second)
	h.mustApply(setConfig("k", "v"))
	if n := sessionCount(t, h); n != 0 {
		t.Errorf("sessions after the window = %d, want 0", n)
	}
}

func TestDedupeRejectsReusedIdentityForAnotherWrite(t *testing.T) {
	h := newHarness(t)
	h.mustApply(withClient(setConfig("k", "v1"), "c", 1))
	res := h.apply(withClient(setConfig("k", "v2"), "c", 1))
	if !errors.Is(res.Err, ErrInvalidCommand) || res.Duplicate {
		t.Fatalf("Result %+v, want ErrInvalidCommand for a reused client_id/sequence", res)
	}
	e, _ := h.f.State().ConfigEntry("k")
	if e.GetValue() != "v1" {
		t.Errorf("value = %q, want v1 (the second write must not apply)", e.GetValue())
	}
}

// TestDedupeRegisterThroughAnotherNode: a registration's node defaults to
// the agent the write came through, so a retry through another agent
// differs in the node alone; it is answered as the same write. Another
// address is another write.
func TestDedupeRegisterThroughAnotherNode(t *testing.T) {
	h := newHarness(t)
	first := instance("web", "a")
	first.Node = "node1"
	h.mustApply(withClient(register(first), "c", 1))
	retry := instance("web", "a")
	retry.Node = "node2"
	res := h.apply(withClient(register(retry), "c", 1))
	if res.Err != nil || !res.Duplicate {
		t.Fatalf("retry through another node: %+v, want a duplicate", res)
	}
	if got, _ := h.f.State().Service("web", "a"); got.GetNode() != "node1" {
		t.Fatalf("node %q after the retry, want node1 (the first write's)", got.GetNode())
	}
	other := instance("web", "a")
	other.Node, other.Address = "node2", "10.9.9.9"
	if res := h.apply(withClient(register(other), "c", 1)); !errors.Is(res.Err, ErrInvalidCommand) {
		t.Fatalf("another address under the same identity: %+v, want ErrInvalidCommand", res)
	}
}

func TestDedupeRecordContents(t *testing.T) {
	h := newHarness(t)
	cmd := withClient(deregister("web", "a"), "c", 9)
	h.apply(cmd)
	s, err := lookupSession(h.f.State().txn, "c")
	if err != nil || s == nil {
		t.Fatalf("session: %v, %v", s, err)
	}
	o := s.find(9)
	if o == nil {
		t.Fatal("no outcome of sequence 9")
	}
	if o.digest == 0 {
		t.Error("op digest is 0")
	}
	want := outcome{seq: 9, maxSeq: 9, index: 1, time: t0.UnixNano(), digest: o.digest,
		err: &outcomeErr{code: "not_found", msg: `not found: service "web" instance "a"`}}
	if !reflect.DeepEqual(*o, want) {
		t.Errorf("outcome = %+v, want %+v", *o, want)
	}
	if s.highest != 9 || s.droppedThrough != 0 || s.lastUsed != t0.UnixNano() {
		t.Errorf("session = %+v", s)
	}
}

func TestErrorCodesRoundTrip(t *testing.T) {
	for _, c := range errorCodes {
		err := replayError(errorCode(c.err), "msg")
		if !errors.Is(err, c.err) || err.Error() != "msg" {
			t.Errorf("replay of %v = %v, want it to wrap the sentinel", c.err, err)
		}
	}
	if err := replayError(errorCode(errors.New("boom")), "boom"); err == nil || err.Error() != "boom" {
		t.Errorf("replay of an internal error = %v", err)
	}
	if err := replayError("", ""); err != nil {
		t.Errorf("replay of success = %v, want nil", err)
	}
}

// TestDedupeRepeatAnswersItsOwnOutcome: a repeat of each kind of write is
// answered with what that write did, not with the state as it is now
// (another client changed the record in between), also after a snapshot
// and restore, and through WriteOutcome.
func TestDedupeRepeatAnswersItsOwnOutcome(t *testing.T) {
	moved := instance("web", "a")
	moved.Address = "10.9.9.9"
	paused := schedule("s1")
	paused.Enabled = false
	tests := []struct {
		name   string
		setup  []*fsmv1.Command
		write  *fsmv1.Command
		after  []*fsmv1.Command // other clients' writes before the repeat
		nilVal bool             // a delete: no value
		errIs  error
	}{
		{name: "register, then deregistered", write: register(instance("web", "a")),
			after: []*fsmv1.Command{deregister("web", "a")}},
		{name: "register, then registered again by another client", write: register(instance("web", "a")),
			after: []*fsmv1.Command{deregister("web", "a"), register(moved)}},
		{name: "heartbeat, then the instance replaced", setup: []*fsmv1.Command{register(instance("web", "a"))},
			write: heartbeat("web", "a"), after: []*fsmv1.Command{register(moved), heartbeat("web", "a")}},
		{name: "deregister, then registered again", setup: []*fsmv1.Command{register(instance("web", "a"))},
			write: deregister("web", "a"), after: []*fsmv1.Command{register(moved)}, nilVal: true},
		{name: "deregister of nothing", write: deregister("web", "a"), after: []*fsmv1.Command{register(moved)},
			nilVal: true, errIs: ErrNotFound},
		{name: "set config, then set again", write: setConfig("k", "mine"),
			after: []*fsmv1.Command{setConfig("k", "theirs")}},
		{name: "set config by CAS, then set again", setup: []*fsmv1.Command{setConfig("k", "v0")},
			write: setConfigCAS("k", "mine", 1), after: []*fsmv1.Command{setConfig("k", "theirs")}},
		{name: "put schedule, then paused", write: putSchedule(schedule("s1")),
			after: []*fsmv1.Command{putSchedule(paused)}},
		{name: "claim slot, then the next", setup: []*fsmv1.Command{putSchedule(schedule("s1"))},
			write: claim("s1", at(100)), after: []*fsmv1.Command{claim("s1", at(200))}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			for _, c := range tt.setup {
				h.mustApply(c)
			}
			first := h.apply(withClient(proto.CloneOf(tt.write), "client-1", 1))
			if !errors.Is(first.Err, tt.errIs) || (first.Err == nil && tt.errIs != nil) {
				t.Fatalf("first = %+v, want error %v", first, tt.errIs)
			}
			if (first.Value == nil) != (tt.nilVal || tt.errIs != nil) {
				t.Fatalf("first value = %v", first.Value)
			}
			want := proto.Clone(first.Value)
			for i, c := range tt.after {
				h.now = h.now.Add(time.Second)
				h.mustApply(withClient(c, "other", uint64(i+1)))
			}
			check := func(where string, got *Result) {
				t.Helper()
				if got == nil || !got.Duplicate || got.Index != first.Index || !errors.Is(got.Err, tt.errIs) || (got.Err == nil) != (first.Err == nil) {
					t.Fatalf("%s: %+v, want the first write's index %d and error %v", where, got, first.Index, first.Err)
				}
				if (want == nil) != (got.Value == nil) || (want != nil && !proto.Equal(got.Value, want)) {
					t.Errorf("%s: value %v, want the first write's %v", where, got.Value, want)
				}
			}
			h.now = h.now.Add(time.Second)
			check("repeat", h.apply(withClient(proto.CloneOf(tt.write), "client-1", 1)))
			res, err := h.f.State().WriteOutcome("client-1", 1)
			if err != nil {
				t.Fatal(err)
			}
			if e, ok := res.Value.(*clusterv1.ConfigEntry); ok {
				// Kept without the value, which a repeat carries.
				if e.GetValue() != "" {
					t.Errorf("WriteOutcome keeps the config value %q", e.GetValue())
				}
				e = proto.CloneOf(e)
				e.Value = tt.write.GetSetConfig().GetValue()
				res.Value = e
			}
			check("WriteOutcome", res)

			r := newHarness(t)
			if err := r.f.Restore(readCloser(h.snapshot())); err != nil {
				t.Fatal(err)
			}
			r.now = h.now
			check("repeat after a restore", r.apply(withClient(proto.CloneOf(tt.write), "client-1", 1)))
		})
	}
}

// TestRefuseWrite: a refusal records its error under the write's identity
// and changes nothing else; any repeat of the write, whatever operation it
// carries, gets that error; a refusal of a write already applied gets the
// write's outcome; a refusal needs an identity and a known code.
func TestRefuseWrite(t *testing.T) {
	refuse := func(code string) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_RefuseWrite{RefuseWrite: &fsmv1.RefuseWrite{ErrorCode: code, ErrorMessage: "schedule \"s1\" not found"}}}
	}
	h := newHarness(t)
	before := dumpTables(t, h.f)
	res := h.apply(withClient(refuse("not_found"), "c1", 1))
	if !errors.Is(res.Err, ErrNotFound) || res.Err.Error() != `schedule "s1" not found` || res.Duplicate {
		t.Fatalf("refusal = %+v, want ErrNotFound with its message", res)
	}
	after := dumpTables(t, h.f)
	if len(after[TableSessions]) != 1 {
		t.Errorf("sessions after a refusal: %d, want 1", len(after[TableSessions]))
	}
	delete(before, TableSessions)
	delete(after, TableSessions)
	delete(before, TableIndex)
	delete(after, TableIndex)
	if !reflect.DeepEqual(before, after) {
		t.Error("a refusal changed a table other than dedupe")
	}
	// The write, arriving after all, is answered as refused.
	again := h.apply(withClient(putSchedule(schedule("s1")), "c1", 1))
	if !again.Duplicate || !errors.Is(again.Err, ErrNotFound) || again.Index != res.Index {
		t.Errorf("repeat after the refusal = %+v, want the refusal's outcome", again)
	}
	if _, err := h.f.State().Schedule("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("the refused write was applied: %v", err)
	}
	// A refusal of a write that was applied gets the write's outcome.
	ok := h.mustApply(withClient(putSchedule(schedule("s2")), "c1", 2))
	late := h.apply(withClient(refuse("not_found"), "c1", 2))
	if !late.Duplicate || late.Err != nil || late.Index != ok.Index || late.Value == nil {
		t.Errorf("refusal of an applied write = %+v, want that write's outcome", late)
	}
	for name, cmd := range map[string]*fsmv1.Command{
		"no client id": refuse("not_found"),
		"unknown code": withClient(refuse("bogus"), "c1", 3),
		"no code":      withClient(refuse(""), "c1", 4),
	} {
		if r := h.apply(cmd); !errors.Is(r.Err, ErrInvalidCommand) {
			t.Errorf("%s: %v, want ErrInvalidCommand", name, r.Err)
		}
	}
}

// TestSessionReadersWhileApplying reads a session's outcomes (a State's
// WriteOutcome, a snapshot) while batches append to the array they share
// with the next versions, and drop outcomes off its front: under -race, a
// reader never sees an element a write changes.
func TestSessionReadersWhileApplying(t *testing.T) {
	f, err := New(func() Config { c := testConfig(); c.DedupeWindow = 50 * time.Millisecond; return c }())
	if err != nil {
		t.Fatal(err)
	}
	const n = 4000
	var log []*raft.Log
	for i := range n {
		cmd := withClient(setConfig("k", "v"), "c", uint64(i+1))
		cmd.Time = timestamppb.New(t0.Add(time.Duration(i) * time.Millisecond))
		data, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		log = append(log, &raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: data})
	}
	done := make(chan struct{})
	readErr := make(chan error, 1)
	go func() {
		defer close(readErr)
		for {
			select {
			case <-done:
				return
			default:
			}
			st := f.State()
			applied := st.applied
			if applied == 0 {
				continue
			}
			res, err := st.WriteOutcome("c", applied)
			if err != nil || res == nil || res.Index != applied {
				readErr <- fmt.Errorf("outcome of the last applied write %d: %+v, %v", applied, res, err)
				return
			}
			if err := st.WriteSnapshot(io.Discard); err != nil {
				readErr <- err
				return
			}
		}
	}()
	for i := 0; i < n; i += 8 {
		for _, r := range f.ApplyBatch(log[i:min(i+8, n)]) {
			if err := r.(*Result).Err; err != nil {
				t.Fatal(err)
			}
		}
	}
	close(done)
	if err := <-readErr; err != nil {
		t.Fatal(err)
	}
	s, err := lookupSession(f.State().txn, "c")
	if err != nil || s == nil {
		t.Fatal(s, err)
	}
	// 50 ms of writes 1 ms apart are kept; the rest were dropped.
	if len(s.outcomes) > 52 || s.droppedThrough < n-52 {
		t.Errorf("%d outcomes kept, dropped through %d", len(s.outcomes), s.droppedThrough)
	}
}

// TestSessionBytesBound: a session keeps its outcomes' records under
// maxSessionBytes (a snapshot record has to hold them); past it the
// oldest go, and a repeat of one of them is too old to replay. A restore
// counts the same bytes.
func TestSessionBytesBound(t *testing.T) {
	h := newHarness(t)
	big := strings.Repeat("x", 256<<10)
	const n = 200 // 50 MiB of records
	for i := range n {
		in := instance("web", fmt.Sprintf("i%03d", i))
		in.Meta = map[string]string{"blob": big}
		h.mustApply(withClient(register(in), "c", uint64(i+1)))
	}
	s, err := lookupSession(h.f.State().txn, "c")
	if err != nil || s == nil {
		t.Fatal(s, err)
	}
	if s.bytes > maxSessionBytes || len(s.outcomes) >= n || s.droppedThrough == 0 {
		t.Fatalf("session: %d bytes, %d outcomes, dropped through %d; want at most %d bytes", s.bytes, len(s.outcomes), s.droppedThrough, maxSessionBytes)
	}
	if res := h.apply(withClient(register(instance("web", "i000")), "c", 1)); !errors.Is(res.Err, ErrTooOldToReplay) {
		t.Errorf("repeat of a dropped outcome: %+v, want ErrTooOldToReplay", res)
	}
	last := instance("web", fmt.Sprintf("i%03d", n-1))
	last.Meta = map[string]string{"blob": big}
	if res := h.apply(withClient(register(last), "c", n)); res.Err != nil || !res.Duplicate {
		t.Errorf("repeat of the last write: %+v, want a duplicate", res)
	}
	r := newHarness(t)
	if err := r.f.Restore(readCloser(h.snapshot())); err != nil {
		t.Fatal(err)
	}
	rs, err := lookupSession(r.f.State().txn, "c")
	if err != nil || rs == nil || rs.bytes != s.bytes || len(rs.outcomes) != len(s.outcomes) {
		t.Fatalf("restored session: %d bytes, %d outcomes; want %d, %d", rs.bytes, len(rs.outcomes), s.bytes, len(s.outcomes))
	}
}
