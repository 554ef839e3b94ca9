package fsm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

func TestParseVersion(t *testing.T) {
	cases := []struct {
		in      string
		want    Version
		wantErr bool
	}{
		{"0.1", Version0_1, false},
		{"0.1.0", Version0_1, false},
		{"v0.1.7", Version0_1, false},
		{"0.1.0-rc.1+abc", Version0_1, false},
		{"1.12.3", Version{1, 12}, false},
		{"0.1.0-dev", Version0_1, false},
		{"1", Version{}, true},
		{"1.x", Version{}, true},
		{"", Version{}, true},
		{"1.2.3.4", Version{}, true},
	}
	for _, tc := range cases {
		got, err := ParseVersion(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseVersion(%q) = %v, %v; want %v (error %v)", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
	if !Version0_0.Less(Version0_1) || Version0_1.Less(Version0_0) || (Version{1, 0}).Less(Version{0, 9}) {
		t.Error("Less orders versions wrongly")
	}
	if !Version0_1.Enabled(FeatureSessions) || Version0_0.Enabled(FeatureSessions) || Latest.Enabled("no-such-feature") {
		t.Error("Enabled is wrong")
	}
	for _, f := range Features {
		if !f.Since.Known() || Latest.Less(f.Since) {
			t.Errorf("feature %s since %s: not a version this release runs", f.Name, f.Since)
		}
	}
}

// withUnknownField appends field 999 to encoded command data: a newer
// release's field.
func withUnknownField(data []byte) []byte {
	return protowire.AppendString(protowire.AppendTag(append([]byte(nil), data...), 999, protowire.BytesType), "new")
}

// TestHalt: an entry this release cannot apply stops the FSM before it,
// in a batch as one by one: nothing of it or after it is applied, the
// applied index stays at the entry before, no snapshot is taken, and the
// state is kept; a snapshot it reads ends the halt.
func TestHalt(t *testing.T) {
	encode := func(cmd *fsmv1.Command) []byte {
		cmd.Time = at(1)
		b, err := marshalOpts.MarshalAppend([]byte{CommandVersion}, cmd)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	unknownInInstance := func() []byte {
		in := instance("web", "z")
		in.ProtoReflect().SetUnknown(protowire.AppendString(protowire.AppendTag(nil, 999, protowire.BytesType), "x"))
		return encode(register(in))
	}
	cases := []struct {
		name  string
		data  []byte
		needs string
	}{
		{"empty entry", nil, "not understood"},
		{"another envelope version", []byte{2, 1, 2, 3}, "not understood"},
		{"not a protobuf", []byte{CommandVersion, 0xff, 0xff}, "not understood"},
		{"an operation this release does not know", withUnknownField(encode(&fsmv1.Command{})), "does not know"},
		{"a field this release does not know", withUnknownField(encode(setConfig("k", "v"))), "Command"},
		{"a field inside the operation", unknownInInstance(), "register_service.instance"},
		{"a newer cluster version", encode(&fsmv1.Command{Op: &fsmv1.Command_SetClusterVersion{SetClusterVersion: &fsmv1.SetClusterVersion{Major: 0, Minor: 9}}}), "0.9"},
	}
	for _, tc := range cases {
		for _, batched := range []bool{false, true} {
			name := tc.name + "/one by one"
			if batched {
				name = tc.name + "/batch"
			}
			t.Run(name, func(t *testing.T) {
				h := newHarness(t)
				first := &raft.Log{Index: 1, Type: raft.LogCommand, Data: encode(setConfig("a", "1"))}
				bad := &raft.Log{Index: 2, Type: raft.LogCommand, Data: tc.data}
				next := &raft.Log{Index: 3, Type: raft.LogCommand, Data: encode(setConfig("b", "2"))}
				var out []any
				if batched {
					out = h.f.ApplyBatch([]*raft.Log{first, bad, next})
				} else {
					for _, l := range []*raft.Log{first, bad, next} {
						out = append(out, h.f.Apply(l))
					}
				}
				if err := out[0].(*Result).Err; err != nil {
					t.Fatalf("entry 1: %v", err)
				}
				for i, o := range out[1:] {
					if err := o.(*Result).Err; !errors.Is(err, ErrNeedsNewerVersion) {
						t.Errorf("entry %d: %v, want %v", i+2, err, ErrNeedsNewerVersion)
					}
				}
				halt := h.f.Halted()
				if halt == nil || halt.Index != 2 || !strings.Contains(halt.Error(), tc.needs) {
					t.Fatalf("Halted() = %v, want a halt at index 2 naming %q", halt, tc.needs)
				}
				if h.f.AppliedIndex() != 1 {
					t.Errorf("AppliedIndex = %d, want 1", h.f.AppliedIndex())
				}
				if _, err := h.f.Snapshot(); !errors.Is(err, ErrNeedsNewerVersion) {
					t.Errorf("Snapshot of a halted FSM = %v, want %v", err, ErrNeedsNewerVersion)
				}
				if e, _ := h.f.State().ConfigEntry("b"); e != nil {
					t.Error("an entry after the halt was applied")
				}
				// A snapshot this release reads ends the halt.
				src := newHarness(t)
				src.mustApply(setConfig("c", "3"))
				if err := h.f.Restore(readCloser(src.snapshot())); err != nil {
					t.Fatal(err)
				}
				if h.f.Halted() != nil {
					t.Error("still halted after a restore")
				}
				if res := h.f.Apply(&raft.Log{Index: 4, Type: raft.LogCommand, Data: encode(setConfig("d", "4"))}).(*Result); res.Err != nil {
					t.Errorf("apply after the restore: %v", res.Err)
				}
			})
		}
	}
	t.Run("a field 0.0 does not know, at 0.0", func(t *testing.T) {
		// The release before cluster versions keeps what it does not
		// know: so does a state at 0.0.
		h := newHarness(t, func(c *Config) { c.InitialVersion = Version0_0 })
		res := h.raw(unknownInInstance())
		if res.Err != nil || h.f.Halted() != nil {
			t.Fatalf("%v (halted %v)", res.Err, h.f.Halted())
		}
		inst, err := h.f.State().Service("web", "z")
		if err != nil || len(inst.ProtoReflect().GetUnknown()) == 0 {
			t.Errorf("instance %v (%v): the unknown field was not kept", inst, err)
		}
	})
}

// TestRestoreRefusesANewerVersion: a state at a cluster version this
// release does not run is refused, and the running state is kept.
func TestRestoreRefusesANewerVersion(t *testing.T) {
	src := newHarness(t)
	src.mustApply(setConfig("k", "v"))
	newer := newHarness(t)
	txn := newer.f.db.Txn(true)
	if err := txn.Insert(TableClusterVersion, &fsmv1.ClusterVersion{Major: 0, Minor: 9}); err != nil {
		t.Fatal(err)
	}
	txn.Commit()
	h := newHarness(t)
	h.mustApply(setConfig("keep", "me"))
	before := h.snapshot()
	err := h.f.Restore(readCloser(newer.snapshot()))
	if !errors.Is(err, ErrUnsupportedSnapshot) || !strings.Contains(err.Error(), "0.9") {
		t.Fatalf("Restore of a state at 0.9 = %v, want %v naming 0.9", err, ErrUnsupportedSnapshot)
	}
	if !bytes.Equal(h.snapshot(), before) {
		t.Error("a refused restore changed the state")
	}
}

// TestCheckpointHash: FSMs applying the same log in different batches
// keep the same hash at every checkpoint; it is the hash of the state as
// of the checkpoint (HashState, HashSnapshot of its snapshot); Differ
// names a table that differs.
func TestCheckpointHash(t *testing.T) {
	log := genLog(7, 600, 2*time.Minute, 5, 0)
	var checkpoints []uint64
	for _, l := range log {
		if cmd, err := Decode(l.Data); err == nil && l.Type == raft.LogCommand && isCheckpoint(cmd) {
			checkpoints = append(checkpoints, l.Index)
		}
	}
	if len(checkpoints) < 3 {
		t.Fatalf("the log holds %d checkpoints", len(checkpoints))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	apply := func(size int) *FSM {
		f := newHarness(t).f
		for start := 0; start < len(log); start += size {
			f.ApplyBatch(log[start:min(len(log), start+size)])
		}
		return f
	}
	one, many := apply(1), apply(37)
	// The last checkpoints only: each node keeps a few.
	for _, idx := range checkpoints[max(0, len(checkpoints)-keptCheckpoints):] {
		a, err := one.CheckpointHash(ctx, idx)
		if err != nil {
			t.Fatal(err)
		}
		b, err := many.CheckpointHash(ctx, idx)
		if err != nil {
			t.Fatal(err)
		}
		if d := a.Differ(b); len(d) > 0 || a.Index != idx {
			t.Errorf("checkpoint %d: the states differ in %v (index %d)", idx, d, a.Index)
		}
	}
	if _, err := one.CheckpointHash(ctx, checkpoints[0]-1); !errors.Is(err, ErrNoCheckpoint) && len(checkpoints) <= keptCheckpoints {
		t.Errorf("CheckpointHash of an index without a checkpoint = %v, want %v", err, ErrNoCheckpoint)
	}
	live, err := one.HashState()
	if err != nil {
		t.Fatal(err)
	}
	fromSnap, err := HashSnapshot(bytes.NewReader(snapshotBytes(t, one)))
	if err != nil {
		t.Fatal(err)
	}
	if d := live.Differ(fromSnap); len(d) > 0 {
		t.Errorf("HashSnapshot differs from HashState in %v", d)
	}
	h := &harness{t: t, f: many, index: many.AppliedIndex(), now: time.Now()}
	h.mustApply(setConfig("only-here", "x"))
	changed, err := many.HashState()
	if err != nil {
		t.Fatal(err)
	}
	if d := live.Differ(changed, TableIndex, TableDedupe, TableSessions); len(d) != 2 || d[0] != TableConfig || d[1] != TableConfigHistory {
		t.Errorf("Differ = %v, want [config config_history]", d)
	}
}

// TestEncodeDropsUnknownFields: what a newer caller sent and this release
// does not know is not proposed (a state machine of this release would
// stop at it).
func TestEncodeDropsUnknownFields(t *testing.T) {
	in := instance("web", "a")
	in.ProtoReflect().SetUnknown(protowire.AppendString(protowire.AppendTag(nil, 999, protowire.BytesType), "x"))
	in.Meta = map[string]string{"k": "v"}
	cmd := register(in)
	cmd.Time = timestamppb.New(t0)
	cmd.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 998, protowire.VarintType), 1))
	data, err := Encode(cmd)
	if err != nil {
		t.Fatal(err)
	}
	back, err := Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	if p := unknownField(back.ProtoReflect(), ""); p != "" {
		t.Errorf("encoded command keeps an unknown field at %s", p)
	}
	known := proto.CloneOf(in)
	DiscardUnknown(known)
	if !proto.Equal(back.GetRegisterService().GetInstance(), known) {
		t.Error("Encode changed the known fields")
	}
	if unknownField(cmd.ProtoReflect(), "") == "" || len(in.ProtoReflect().GetUnknown()) == 0 {
		t.Error("Encode changed the caller's command")
	}
}

// TestReplaceKeepsTheStateFormat: a state replaced as a whole (the etcd
// mirror's reload, a restore's plan) is written in the snapshot format of
// its own cluster version: at 0.0 one the release before cluster versions
// reads, not one that names the tables of a newer version.
func TestReplaceKeepsTheStateFormat(t *testing.T) {
	cfg := func(v Version) func(*Config) { return func(c *Config) { c.InitialVersion = v } }
	for _, tc := range []struct {
		name    string
		version Version
		records []TableRecord
		format  uint32
	}{
		{"0.0", Version0_0, []TableRecord{{TableConfig, &clusterv1.ConfigEntry{Key: "k", Value: "v", Revision: 3}}}, 2}, // the ca table has its index row at 0.0 too, as the release before wrote it
		{"latest", Latest, []TableRecord{
			{TableConfig, &clusterv1.ConfigEntry{Key: "k", Value: "v", Revision: 3}},
			{TableClusterVersion, &fsmv1.ClusterVersion{Major: Latest.Major, Minor: Latest.Minor, Index: 2}},
		}, SnapshotFormatVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, cfg(tc.version))
			if err := h.f.Replace(10, tc.records); err != nil {
				t.Fatal(err)
			}
			hdr, err := ReadSnapshotHeader(bytes.NewReader(h.snapshot()))
			if err != nil {
				t.Fatal(err)
			}
			if hdr.GetFormatVersion() != tc.format {
				t.Fatalf("a state at %s replaced as a whole is written in format %d, want %d", tc.name, hdr.GetFormatVersion(), tc.format)
			}
			if v, _, _ := h.f.State().ClusterVersion(); v != tc.version {
				t.Fatalf("replaced state at %s, want %s", v, tc.version)
			}
		})
	}
}

// TestIngestRefusesANewerVersion: an external store holding a cluster
// version this release does not know is not mirrored: the state stays as
// it was and the error names the version.
func TestIngestRefusesANewerVersion(t *testing.T) {
	h := newHarness(t)
	h.mustApply(setConfig("keep", "me"))
	before := h.snapshot()
	err := h.f.Ingest(50, []Ingested{{Table: TableClusterVersion, Record: &fsmv1.ClusterVersion{Major: 0, Minor: 9, Index: 50}}})
	if !errors.Is(err, ErrNeedsNewerVersion) || !strings.Contains(err.Error(), "0.9") {
		t.Fatalf("Ingest of version 0.9 = %v, want %v naming 0.9", err, ErrNeedsNewerVersion)
	}
	if !bytes.Equal(h.snapshot(), before) {
		t.Error("a refused ingest changed the state")
	}
}

// TestLoweringRefusesWhatTheOlderVersionCannotHold: a state holding an
// instance with a health check is not lowered to 0.0 (agents of 0.0 never
// run checks); the refusal names it and changes nothing, on every replica
// alike. Without it the state goes down.
func TestLoweringRefusesWhatTheOlderVersionCannotHold(t *testing.T) {
	h := newHarness(t)
	in := instance("web", "w1")
	in.DeregisterCriticalAfter = durationpb.New(time.Minute)
	h.mustApply(register(in))
	h.mustApply(withClient(setConfig("k", "v"), "c1", 1))
	before := dumpTables(t, h.f)
	res := h.apply(SetClusterVersionCommand(Version0_0))
	if !errors.Is(res.Err, ErrCannotConvert) || !strings.Contains(res.Err.Error(), "web/w1") {
		t.Fatalf("lowering with an instance with deregister_critical_after: %v, want %v naming web/w1", res.Err, ErrCannotConvert)
	}
	if h.f.Version() != Latest {
		t.Fatalf("the refused entry moved the version to %s", h.f.Version())
	}
	after := dumpTables(t, h.f)
	delete(before, TableIndex)
	delete(after, TableIndex)
	if fmt.Sprint(before) != fmt.Sprint(after) {
		t.Fatalf("the refused entry changed the state:\n%v\n%v", before, after)
	}
	h.mustApply(deregister("web", "w1"))
	h.mustApply(SetClusterVersionCommand(Version0_0))
	if h.f.Version() != Version0_0 {
		t.Fatalf("at %s after the instance went", h.f.Version())
	}
}
