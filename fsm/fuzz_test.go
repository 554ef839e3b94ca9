package fsm

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// seedCommands returns one encoded command of every kind, valid and not.
func seedCommands(f *testing.F) [][]byte {
	cmds := []*fsmv1.Command{
		withClient(register(instance("web", "a")), "c", 1),
		deregister("web", "a"),
		heartbeat("web", "a"),
		setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)),
		setConfigCAS("k", "v", 3),
		deleteConfigCAS("k", 3),
		putSchedule(schedule("s1")),
		deleteSchedule("s1"),
		claim("s1", at(900), at(800)),
		recordRun(&schedulev1.Run{ScheduleId: "s1", Slot: at(100), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK}),
		{},
	}
	var out [][]byte
	for _, c := range cmds {
		c.Time = at(60)
		b, err := Encode(c)
		if err != nil {
			f.Fatal(err)
		}
		out = append(out, b)
	}
	return append(out, nil, []byte{CommandVersion}, []byte{2, 1})
}

func FuzzDecode(f *testing.F) {
	for _, b := range seedCommands(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cmd, err := Decode(data)
		if err != nil {
			if !errors.Is(err, ErrInvalidCommand) && !errors.Is(err, ErrUnknownCommand) {
				t.Fatalf("Decode error %v wraps no sentinel", err)
			}
			return
		}
		decoded := proto.CloneOf(cmd)
		again, err := Encode(cmd)
		if err != nil {
			t.Fatalf("Encode(Decode(data)): %v", err)
		}
		if !proto.Equal(cmd, decoded) {
			t.Fatalf("Encode changed its argument: %v, was %v", cmd, decoded)
		}
		// Encode drops fields this version does not know (a newer
		// release's), so the round trip gives the known fields only.
		want := proto.CloneOf(cmd)
		DiscardUnknown(want)
		cmd2, err := Decode(again)
		if err != nil || !proto.Equal(want, cmd2) {
			t.Fatalf("Decode(Encode(cmd)) = %v, %v; want %v", cmd2, err, want)
		}
	})
}

// FuzzApply feeds arbitrary bytes as a log entry to a populated FSM: Apply
// must return a *Result, and the state must stay snapshot-able and
// restorable.
func FuzzApply(f *testing.F) {
	for _, b := range seedCommands(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		h := newHarness(t)
		populate(h)
		before, applied := h.snapshot(), h.f.AppliedIndex()
		res := h.raw(data)
		if errors.Is(res.Err, ErrNeedsNewerVersion) {
			// Not understood: the FSM stops before the entry.
			if h.f.Halted() == nil || h.f.AppliedIndex() != applied {
				t.Fatalf("%x: %v, but the FSM did not stop (applied index %d, was %d)", data, res.Err, h.f.AppliedIndex(), applied)
			}
			var b bytes.Buffer
			if err := h.f.WriteSnapshot(&b); err != nil || !bytes.Equal(b.Bytes(), before) {
				t.Fatalf("%x: the FSM stopped, but its state changed (%v)", data, err)
			}
			return
		}
		if res.Index != h.index && !res.Duplicate {
			t.Fatalf("Result.Index = %d, want %d", res.Index, h.index)
		}
		if res.Err != nil && res.Value != nil {
			t.Fatalf("Result has both an error and a value: %+v", res)
		}
		snap := h.snapshot()
		if _, err := VerifySnapshot(bytes.NewReader(snap)); err != nil {
			t.Fatalf("state after applying %x does not snapshot cleanly: %v", data, err)
		}
	})
}

// FuzzRestore feeds arbitrary bytes to Restore: it must not panic, and a
// failed restore must leave the state alone.
func FuzzRestore(f *testing.F) {
	h := newHarness(f)
	populate(h)
	valid := h.snapshot()
	f.Add(valid)
	f.Add(valid[:len(valid)/2])
	f.Add(buildSnapshot(1, header(1, table(TableIndex, 1)), []byte{3, 'f', 'o', 'o', 1}))
	f.Add([]byte("PVSN\x00\x00\x00\x01\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		fh := newHarness(t)
		fh.mustApply(register(instance("keep", "me")))
		before := fh.snapshot()
		if err := fh.f.Restore(readCloser(data)); err != nil {
			if !errors.Is(err, ErrCorruptSnapshot) && !errors.Is(err, ErrUnsupportedSnapshot) {
				t.Fatalf("Restore error %v wraps no sentinel", err)
			}
			if after := fh.snapshot(); !bytes.Equal(before, after) {
				t.Fatalf("a failed restore changed the state")
			}
			return
		}
		// Whatever was accepted must snapshot and restore again.
		snap := fh.snapshot()
		if _, err := VerifySnapshot(bytes.NewReader(snap)); err != nil {
			t.Fatalf("restored state does not snapshot cleanly: %v", err)
		}
	})
}
