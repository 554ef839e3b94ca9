package fsm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

var update = flag.Bool("update", false, "rewrite the golden snapshot in testdata")

func readCloser(b []byte) io.ReadCloser { return io.NopCloser(bytes.NewReader(b)) }

// populate fills every table: fsmtest.FullState.
func populate(h *harness) {
	h.t.Helper()
	applySteps(h, fsmtest.FullState())
}

// populateFormat applies the steps of fsmtest.FullState whose records
// snapshot format v holds.
func populateFormat(h *harness, v uint32) {
	h.t.Helper()
	applySteps(h, fsmtest.FullState()[:fsmtest.FormatSteps[v]])
}

// applySteps applies steps at the harness's next indexes (from 1 on a new
// harness), each with its own leader time, which becomes the harness's.
func applySteps(h *harness, steps []fsmtest.Step) {
	h.t.Helper()
	for i, st := range steps {
		h.now = st.Cmd.GetTime().AsTime()
		if res := h.apply(st.Cmd); errorCode(res.Err) != st.WantErr {
			h.t.Fatalf("populate: step %d (%T): outcome %v, want %q", i, st.Cmd.GetOp(), res.Err, st.WantErr)
		}
	}
}

func TestSnapshotRoundTripAllTables(t *testing.T) {
	src := newHarness(t)
	populate(src)
	want := dumpTables(t, src.f)
	for _, table := range Tables() {
		// Dedupe records are etcd mode's: applying writes in Raft mode
		// fills sessions (TestRestoreConvertsDedupeRecords covers them).
		if len(want[table]) == 0 && table != TableDedupe {
			t.Errorf("populate leaves table %q empty: extend it so the round trip covers the table", table)
		}
	}
	if len(want) != len(Tables()) {
		t.Errorf("dumped %d tables, Tables() has %d", len(want), len(Tables()))
	}

	snap := src.snapshot()
	hdr, err := ReadSnapshotHeader(bytes.NewReader(snap))
	if err != nil {
		t.Fatalf("ReadSnapshotHeader: %v", err)
	}
	if hdr.GetFormatVersion() != SnapshotFormatVersion || hdr.GetLastIndex() != src.f.AppliedIndex() {
		t.Errorf("header = %v, want version %d, last index %d", hdr, SnapshotFormatVersion, src.f.AppliedIndex())
	}
	var names []string
	for _, th := range hdr.GetTables() {
		names = append(names, th.GetName())
		if got := th.GetRecords(); got != uint64(len(want[th.GetName()])) {
			t.Errorf("header says %d records in %s, state has %d", got, th.GetName(), len(want[th.GetName()]))
		}
	}
	if !reflect.DeepEqual(names, Tables()) {
		t.Errorf("snapshot tables = %v, want Tables() = %v", names, Tables())
	}
	if _, err := VerifySnapshot(bytes.NewReader(snap)); err != nil {
		t.Errorf("VerifySnapshot: %v", err)
	}

	dst := newHarness(t)
	dst.mustApply(register(instance("old", "state")))
	if err := dst.f.Restore(readCloser(snap)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	got := dumpTables(t, dst.f)
	for _, table := range Tables() {
		if !reflect.DeepEqual(got[table], want[table]) {
			t.Errorf("table %s after restore:\n got %v\nwant %v", table, got[table], want[table])
		}
	}
	if dst.f.AppliedIndex() != src.f.AppliedIndex() {
		t.Errorf("AppliedIndex = %d, want %d", dst.f.AppliedIndex(), src.f.AppliedIndex())
	}
	if again := dst.snapshot(); !bytes.Equal(again, snap) {
		t.Errorf("snapshot of the restored state differs from the original")
	}

	// The restored FSM keeps working: dedupe records came along.
	dst.index = dst.f.AppliedIndex()
	dst.now = src.now
	if res := dst.apply(withClient(heartbeat("web", "a"), "client-1", 2)); !res.Duplicate {
		t.Errorf("retry after restore = %+v, want Duplicate", res)
	}
}

// TestDeterminism applies the same log to FSMs, one of which snapshots and
// restores half-way, and expects byte-identical snapshots.
func TestDeterminism(t *testing.T) {
	rec := newHarness(t)
	var log []*raft.Log
	record := func(cmd *fsmv1.Command) {
		rec.now = rec.now.Add(1500 * time.Millisecond)
		cmd.Time = timestamppb.New(rec.now)
		data, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		log = append(log, &raft.Log{Index: uint64(len(log) + 1), Term: 1, Type: raft.LogCommand, Data: data})
	}
	for i := range 40 {
		id := string(rune('a' + i%7))
		record(withClient(register(instance("svc", id)), "c", uint64(i+1)))
		record(withClient(register(instance("svc", id)), "c", uint64(i+1))) // duplicate
		record(heartbeat("svc", id))
		record(setConfig("key", id))
		record(setConfigCAS("key", id, 1)) // mostly conflicts
		record(putSchedule(schedule(id)))
		record(claim(id, at(100*i+100), at(100*i+50)))
		if i%5 == 0 {
			record(deleteSchedule(id))
			record(deregister("svc", id))
		}
	}
	log = append(log, &raft.Log{Index: uint64(len(log) + 1), Term: 2, Type: raft.LogNoop})
	record(CheckpointCommand())

	run := func(restoreAt int) []byte {
		h := newHarness(t)
		for i, l := range log {
			h.f.Apply(l)
			if i == restoreAt {
				snap := h.snapshot()
				fresh := newHarness(t)
				if err := fresh.f.Restore(readCloser(snap)); err != nil {
					t.Fatalf("Restore: %v", err)
				}
				h = fresh
			}
		}
		return h.snapshot()
	}
	a, b, c := run(-1), run(-1), run(len(log)/2)
	if !bytes.Equal(a, b) {
		t.Errorf("two FSMs applying the same log have different snapshots")
	}
	if !bytes.Equal(a, c) {
		t.Errorf("an FSM restored half-way has a different snapshot than one that applied the whole log")
	}
}

// buildSnapshot writes a snapshot stream from parts, for malformed inputs.
func buildSnapshot(version uint32, hdr *fsmv1.SnapshotHeader, records ...[]byte) []byte {
	var b []byte
	b = append(b, snapshotMagic...)
	b = binary.BigEndian.AppendUint32(b, version)
	hb, _ := proto.Marshal(hdr)
	b = binary.AppendUvarint(b, uint64(len(hb)))
	b = append(b, hb...)
	for _, r := range records {
		b = binary.AppendUvarint(b, uint64(len(r)))
		b = append(b, r...)
	}
	return b
}

func header(version uint32, tables ...*fsmv1.TableHeader) *fsmv1.SnapshotHeader {
	return &fsmv1.SnapshotHeader{FormatVersion: version, Tables: tables, LastIndex: 42}
}

func table(name string, n uint64) *fsmv1.TableHeader {
	return &fsmv1.TableHeader{Name: name, Records: n}
}

func marshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRestoreFailuresLeaveStateIntact(t *testing.T) {
	src := newHarness(t)
	populate(src)
	valid := src.snapshot()

	svc := marshal(t, &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Address: "x"})
	idxUnknown, _ := encodeIndexEntry(nil, &indexEntry{Table: "nope", Value: 1})
	withTrailer := func(b []byte) []byte { return append(bytes.Clone(b), 0) }
	flipped := bytes.Clone(valid)
	flipped[len(flipped)/2] ^= 0xff

	type restoreCase struct {
		name    string
		data    []byte
		wantErr error
	}
	cases := []restoreCase{
		{"empty", nil, ErrCorruptSnapshot},
		{"garbage", []byte("this is not a snapshot at all"), ErrCorruptSnapshot},
		{"bad magic", append([]byte("PVSX"), valid[4:]...), ErrCorruptSnapshot},
		{"newer version", buildSnapshot(SnapshotFormatVersion+1, header(SnapshotFormatVersion+1)), ErrUnsupportedSnapshot},
		{"version 0", buildSnapshot(0, header(0)), ErrCorruptSnapshot},
		{"header version mismatch", buildSnapshot(1, header(3)), ErrCorruptSnapshot},
		{"unknown table", buildSnapshot(1, header(1, table("nodes", 0))), ErrUnsupportedSnapshot},
		{"table listed twice", buildSnapshot(1, header(1, table(TableServices, 0), table(TableServices, 0))), ErrCorruptSnapshot},
		{"duplicate records", buildSnapshot(1, header(1, table(TableServices, 2)), svc, svc), ErrCorruptSnapshot},
		{"record missing its key", buildSnapshot(1, header(1, table(TableServices, 1)), marshal(t, &clusterv1.ServiceInstance{Address: "x"})), ErrCorruptSnapshot},
		{"record of another type", buildSnapshot(1, header(1, table(TableServices, 1)), []byte{0xff, 0xff}), ErrCorruptSnapshot},
		{"index entry of unknown table", buildSnapshot(1, header(1, table(TableIndex, 1)), idxUnknown), ErrCorruptSnapshot},
		{"index entry with trailing bytes", buildSnapshot(1, header(1, table(TableIndex, 1)), append(bytes.Clone(idxUnknown), 1)), ErrCorruptSnapshot},
		{"huge record length", append(buildSnapshot(1, header(1, table(TableServices, 1))), binary.AppendUvarint(nil, 1<<40)...), ErrCorruptSnapshot},
		{"huge header length", append([]byte("PVSN\x00\x00\x00\x01"), binary.AppendUvarint(nil, 1<<30)...), ErrCorruptSnapshot},
		{"trailing data", withTrailer(valid), ErrCorruptSnapshot},
		{"flipped byte", flipped, nil},
	}
	for n := range len(valid) {
		cases = append(cases, restoreCase{"truncated", valid[:n], ErrCorruptSnapshot})
	}

	h := newHarness(t)
	h.mustApply(register(instance("keep", "me")))
	h.mustApply(setConfig("keep", "me"))
	before, beforeSnap, beforeIndex := dumpTables(t, h.f), h.snapshot(), h.f.AppliedIndex()
	abandon := h.f.AbandonCh()
	for _, tc := range cases {
		err := h.f.Restore(readCloser(tc.data))
		if err == nil {
			if tc.wantErr != nil || tc.name != "flipped byte" {
				t.Fatalf("%s (%d bytes): Restore succeeded, want %v", tc.name, len(tc.data), tc.wantErr)
			}
			// A flipped byte may happen to decode; that is the archive
			// checksum's job. Put the state back for the next cases.
			t.Logf("flipped byte decoded as a valid snapshot")
			h = newHarness(t)
			h.mustApply(register(instance("keep", "me")))
			h.mustApply(setConfig("keep", "me"))
			abandon = h.f.AbandonCh()
			continue
		}
		if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
			t.Errorf("%s (%d bytes): Restore = %v, want %v", tc.name, len(tc.data), err, tc.wantErr)
		}
		if _, verr := VerifySnapshot(bytes.NewReader(tc.data)); verr == nil {
			t.Errorf("%s: VerifySnapshot accepted what Restore rejected", tc.name)
		}
		// Only what needs the built state may pass the constant-memory
		// scan.
		_, serr := ScanSnapshot(bytes.NewReader(tc.data))
		switch needsState := tc.name == "duplicate records" || tc.name == "record missing its key"; {
		case serr == nil && !needsState:
			t.Errorf("%s: ScanSnapshot accepted what Restore rejected", tc.name)
		case serr != nil && tc.wantErr != nil && !errors.Is(serr, tc.wantErr):
			t.Errorf("%s: ScanSnapshot = %v, want %v", tc.name, serr, tc.wantErr)
		}
		if got := dumpTables(t, h.f); !reflect.DeepEqual(got, before) {
			t.Fatalf("%s: a failed restore changed the state", tc.name)
		}
		if h.f.AppliedIndex() != beforeIndex {
			t.Fatalf("%s: a failed restore changed AppliedIndex to %d", tc.name, h.f.AppliedIndex())
		}
		select {
		case <-abandon:
			t.Fatalf("%s: a failed restore closed the abandon channel", tc.name)
		default:
		}
	}
	if got := h.snapshot(); !bytes.Equal(got, beforeSnap) {
		t.Errorf("snapshot after failed restores differs")
	}
	if err := h.f.Restore(nil); !errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("Restore(nil) = %v, want ErrCorruptSnapshot", err)
	}
}

// TestRestoreOlderTableSet restores a snapshot that lists fewer tables, as
// an older writer would: the missing tables are empty.
func TestRestoreOlderTableSet(t *testing.T) {
	svc := marshal(t, &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Address: "x"})
	data := buildSnapshot(1, header(1, table(TableServices, 1)), svc)
	h := newHarness(t)
	h.mustApply(setConfig("k", "v"))
	if err := h.f.Restore(readCloser(data)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	st := h.f.State()
	if _, err := st.Service("web", "a"); err != nil {
		t.Errorf("Service: %v", err)
	}
	if _, list, _ := st.ConfigEntries(nil); len(list) != 0 {
		t.Errorf("config = %v, want empty", list)
	}
	if st.AppliedIndex() != 42 {
		t.Errorf("AppliedIndex = %d, want 42", st.AppliedIndex())
	}
}

func TestPersistCancelsOnWriteError(t *testing.T) {
	h := newHarness(t)
	populate(h)
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	sink := &memSink{failWrites: true}
	if err := snap.Persist(sink); err == nil {
		t.Fatalf("Persist to a failing sink succeeded")
	}
	if !sink.cancelled || sink.closed {
		t.Errorf("sink cancelled=%v closed=%v, want cancelled only", sink.cancelled, sink.closed)
	}
}

// TestSnapshotIsPointInTime persists a snapshot after more applies and
// expects the state of when Snapshot was called.
func TestSnapshotIsPointInTime(t *testing.T) {
	h := newHarness(t)
	populate(h)
	want := h.snapshot()
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	h.mustApply(register(instance("late", "x")))
	sink := &memSink{}
	if err := snap.Persist(sink); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sink.Bytes(), want) {
		t.Errorf("snapshot includes changes applied after Snapshot()")
	}
	var buf bytes.Buffer
	if err := h.f.WriteSnapshot(&buf); err != nil {
		t.Fatalf("WriteSnapshot: %v", err)
	}
	if bytes.Equal(buf.Bytes(), want) {
		t.Errorf("WriteSnapshot did not include the late change")
	}
}

// TestSnapshotFormatGolden restores the committed snapshot of every format
// version and checks that it holds the state populate built in that
// version, and that this version still writes the same bytes as its own
// golden file for the same state. Run with -update after a deliberate
// change of populate.
func TestSnapshotFormatGolden(t *testing.T) {
	if last := len(fsmtest.FormatSteps) - 1; last != int(SnapshotFormatVersion) || fsmtest.FormatSteps[last] != len(fsmtest.FullState()) {
		t.Fatalf("fsmtest.FormatSteps ends at format %d with %d steps; want format %d with all %d steps of FullState: add the new format's steps and entry, and its golden file",
			last, fsmtest.FormatSteps[last], SnapshotFormatVersion, len(fsmtest.FullState()))
	}
	for v := uint32(1); v <= SnapshotFormatVersion; v++ {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			path := filepath.Join("testdata", "snapshot", fmt.Sprintf("v%d", v), "state.bin")
			// The state of the format's steps at the version that writes
			// it (formatVersion); a format no version writes any more is
			// only read (an older build's), against the state of its steps
			// at the latest version, tables that hold writes' outcomes
			// apart.
			at, written := formatVersion(v)
			h := newHarness(t, func(c *Config) { c.InitialVersion = at })
			populateFormat(h, v)
			current := h.snapshot()
			if *update && written {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, current, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			golden, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("read golden snapshot (run go test -run Golden -update to create it): %v", err)
			}
			r := newHarness(t, func(c *Config) { c.InitialVersion = Version0_0 })
			if err := r.f.Restore(readCloser(golden)); err != nil {
				t.Fatalf("restore the format-%d golden snapshot: %v", v, err)
			}
			if written {
				if !bytes.Equal(current, golden) {
					t.Errorf("snapshot bytes differ from %s: the format changed; bump SnapshotFormatVersion and keep reading the older ones", path)
				}
				if !reflect.DeepEqual(dumpTables(t, r.f), dumpTables(t, h.f)) {
					t.Errorf("golden snapshot restores to a different state than its builder makes")
				}
				if got := r.f.Version(); got != at {
					t.Errorf("golden snapshot restores at version %s, want %s", got, at)
				}
				return
			}
			got, want := dumpTables(t, r.f), dumpTables(t, h.f)
			for _, table := range []string{TableDedupe, TableSessions, TableClusterVersion, TableIndex} {
				delete(got, table)
				delete(want, table)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("golden snapshot restores to a different state than its steps make")
			}
		})
	}
}

// formatVersion is the cluster version whose states are written in
// snapshot format v, and whether any still is: formats 1 and 2 are those
// of 0.0 (the release before cluster versions writes them, and so does a
// state at 0.0 here), 5 that of 0.1; 3 and 4 were written by builds before
// the first release only.
func formatVersion(v uint32) (Version, bool) {
	switch v {
	case 1, 2:
		return Version0_0, true
	case SnapshotFormatVersion:
		return Latest, true
	}
	return Latest, false
}

// TestFilterSnapshot: the cluster CA is left out of a filtered copy, which
// restores to the same state without it; every other table is kept.
func TestFilterSnapshot(t *testing.T) {
	h := newHarness(t)
	populate(h)
	var out bytes.Buffer
	version, n, err := FilterSnapshot(bytes.NewReader(h.snapshot()), &out, TableCA)
	if err != nil {
		t.Fatal(err)
	}
	if version != SnapshotFormatVersion || n != int64(out.Len()) {
		t.Errorf("FilterSnapshot = version %d, %d bytes; want %d, %d", version, n, SnapshotFormatVersion, out.Len())
	}
	r := newHarness(t)
	if err := r.f.Restore(readCloser(out.Bytes())); err != nil {
		t.Fatalf("restore the filtered snapshot: %v", err)
	}
	if ca, err := r.f.State().ClusterCA(); ca != nil || err != nil {
		t.Errorf("the filtered snapshot holds the cluster CA: %v, %v", ca != nil, err)
	}
	want, got := dumpTables(t, h.f), dumpTables(t, r.f)
	delete(want, TableCA)
	delete(got, TableCA)
	if !reflect.DeepEqual(got, want) {
		t.Error("the filtered snapshot restores other tables differently")
	}
	if _, _, err := FilterSnapshot(bytes.NewReader(h.snapshot()[:100]), io.Discard, TableCA); !errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("FilterSnapshot(truncated) = %v, want ErrCorruptSnapshot", err)
	}
}

// TestCaptureSnapshot: a capture sizes its stream exactly, writes what
// Persist writes (or, with tables dropped, what FilterSnapshot makes of
// it), stays as of its capture while the state moves on, and can be
// written twice.
func TestCaptureSnapshot(t *testing.T) {
	h := newHarness(t)
	populate(h)
	full := h.snapshot()
	for _, drop := range [][]string{nil, {TableCA}, {TableCA, TableDedupe}} {
		snap, err := h.f.CaptureSnapshot(drop...)
		if err != nil {
			t.Fatal(err)
		}
		var want bytes.Buffer
		if _, _, err := FilterSnapshot(bytes.NewReader(full), &want, drop...); err != nil {
			t.Fatal(err)
		}
		// The state moves on after the capture.
		h.mustApply(register(instance("after-capture", fmt.Sprint(len(drop)))))
		for range 2 {
			var got bytes.Buffer
			n, err := snap.WriteTo(&got)
			if err != nil {
				t.Fatalf("drop %v: WriteTo: %v", drop, err)
			}
			if n != int64(got.Len()) || n != snap.Size() {
				t.Errorf("drop %v: WriteTo wrote %d bytes (returned %d), Size says %d", drop, got.Len(), n, snap.Size())
			}
			if !bytes.Equal(got.Bytes(), want.Bytes()) {
				t.Errorf("drop %v: the capture's stream differs from the filtered snapshot", drop)
			}
		}
		if snap.FormatVersion() != binary.BigEndian.Uint32(full[4:8]) || snap.Index() == 0 {
			t.Errorf("drop %v: capture format %d, index %d", drop, snap.FormatVersion(), snap.Index())
		}
		full = h.snapshot()
	}
	if err := h.f.WriteSnapshot(errWriter{}); err == nil {
		t.Error("WriteSnapshot into a failing writer succeeded")
	}
}

type errWriter struct{}

func (errWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

// TestSnapshotFormatFollowsUse: a state at 0.0 is written in the oldest
// format that holds it, as the release before cluster versions writes it:
// format 1 without a cluster CA, format 2 with one (or after a Restored
// command, which touches its table), whatever it applies (the operations it
// does not know included). A
// state at a later version holds its version record: the newest format.
func TestSnapshotFormatFollowsUse(t *testing.T) {
	format := func(h *harness) uint32 { return binary.BigEndian.Uint32(h.snapshot()[4:8]) }
	legacy := func(c *Config) { c.InitialVersion = Version0_0 }
	h := newHarness(t, legacy)
	populateFormat(h, 1)
	if v := format(h); v != 1 {
		t.Errorf("format %d without a cluster CA, want 1", v)
	}
	// Restored touches every table of 0.0, ca included, as 0.0 does.
	h.mustApply(&fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{SnapshotId: "x", SnapshotIndex: 1}}})
	if v := format(h); v != 2 {
		t.Errorf("format %d after a Restored command at 0.0, want 2", v)
	}

	h = newHarness(t, legacy)
	populateFormat(h, 2)
	if v := format(h); v != 2 {
		t.Errorf("format %d with a cluster CA, want 2", v)
	}
	if res := h.apply(setPlacements("n1", nil, placement("volumes", "v1"))); !errors.Is(res.Err, ErrUnknownCommand) {
		t.Errorf("set_placements at 0.0 = %v, want %v (0.0 does not know it)", res.Err, ErrUnknownCommand)
	}
	h.mustApply(withClient(setConfig("k", "v"), "c", 1))
	if v := format(h); v != 2 {
		t.Errorf("format %d after operations 0.0 does not know and a write with a client, want 2", v)
	}

	h.mustApply(SetClusterVersionCommand(Latest))
	if v := format(h); v != SnapshotFormatVersion {
		t.Errorf("format %d at %s, want %d", v, Latest, SnapshotFormatVersion)
	}
	h.mustApply(SetClusterVersionCommand(Version0_0))
	if v := format(h); v != 2 {
		t.Errorf("format %d after a downgrade to 0.0, want 2", v)
	}
}

// TestInspectSnapshot checks the per-table counts and sizes against the
// state, and that InspectSnapshot refuses what Restore refuses.
func TestInspectSnapshot(t *testing.T) {
	h := newHarness(t)
	populate(h)
	snap := h.snapshot()
	info, err := InspectSnapshot(bytes.NewReader(snap))
	if err != nil {
		t.Fatalf("InspectSnapshot: %v", err)
	}
	if info.FormatVersion != SnapshotFormatVersion || info.LastIndex != h.index {
		t.Errorf("version %d, index %d; want %d, %d", info.FormatVersion, info.LastIndex, SnapshotFormatVersion, h.index)
	}
	st := h.f.State()
	var total uint64
	for _, ti := range info.Tables {
		it, err := tget(st.txn, ti.Name, indexID)
		if err != nil {
			t.Fatal(err)
		}
		var n, size uint64
		for obj := it.Next(); obj != nil; obj = it.Next() {
			td, _ := tableDefByName(ti.Name)
			b, err := td.codec.encode(nil, obj)
			if err != nil {
				t.Fatal(err)
			}
			n++
			size += uint64(len(b))
		}
		if ti.Records != n || ti.Bytes != size {
			t.Errorf("table %s: %d records, %d bytes; want %d, %d", ti.Name, ti.Records, ti.Bytes, n, size)
		}
		total += ti.Records
	}
	if len(info.Tables) != len(Tables()) || total == 0 {
		t.Errorf("inspected %d tables with %d records, want all %d tables and some records", len(info.Tables), total, len(Tables()))
	}
	if _, err := InspectSnapshot(bytes.NewReader(snap[:len(snap)-1])); !errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("InspectSnapshot(truncated) = %v, want ErrCorruptSnapshot", err)
	}
}

// TestRestoredCommand: the command a leader proposes after restoring an
// archive moves every table's index to its own and changes no record.
func TestRestoredCommand(t *testing.T) {
	h := newHarness(t)
	populate(h)
	before := h.f.State()
	res := h.mustApply(&fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{SnapshotId: "1-5-1", SnapshotIndex: 5}}})
	st := h.f.State()
	for _, table := range Tables() {
		if table == TableIndex {
			continue
		}
		if got := st.Index(table); got != res.Index {
			t.Errorf("index of %s = %d, want %d", table, got, res.Index)
		}
		a, _ := tget(before.txn, table, indexID)
		b, _ := tget(st.txn, table, indexID)
		for x, y := a.Next(), b.Next(); x != nil || y != nil; x, y = a.Next(), b.Next() {
			if x != y {
				t.Fatalf("table %s changed", table)
			}
		}
	}
}

// TestRestoreKeepsAppliedIndex: restoring a snapshot taken at a lower index
// (an archive from another cluster) does not move the applied index back.
func TestRestoreKeepsAppliedIndex(t *testing.T) {
	small := newHarness(t)
	small.mustApply(register(instance("web", "a")))
	snap := small.snapshot()

	h := newHarness(t)
	populate(h)
	applied := h.f.AppliedIndex()
	if applied <= 1 {
		t.Fatalf("populate applied only %d entries", applied)
	}
	if err := h.f.Restore(readCloser(snap)); err != nil {
		t.Fatal(err)
	}
	if got := h.f.AppliedIndex(); got != applied {
		t.Errorf("AppliedIndex after restoring an index-1 snapshot = %d, want %d", got, applied)
	}
	if _, err := h.f.State().Service("web", "a"); err != nil {
		t.Errorf("restored state: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := h.f.WaitApplied(ctx, applied); err != nil {
		t.Errorf("WaitApplied(%d) after the restore: %v", applied, err)
	}
}

// TestRestoreConvertsDedupeRecords: a snapshot of an older version keeps
// one dedupe record per write; restored, they become the sessions of
// their clients, and a repeat of such a write gets its outcome.
func TestRaiseConvertsDedupeRecords(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("testdata", "snapshot", "v2", "state.bin"))
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(c *Config) { c.InitialVersion = Version0_0 })
	if err := h.f.Restore(readCloser(golden)); err != nil {
		t.Fatal(err)
	}
	if n := len(dumpTables(t, h.f)[TableDedupe]); n == 0 {
		t.Fatal("the format-2 golden state holds no dedupe records")
	}
	steps := fsmtest.FullState()
	h.index, h.now = h.f.AppliedIndex(), steps[len(steps)-1].Cmd.GetTime().AsTime()
	h.mustApply(SetClusterVersionCommand(Latest))
	tables := dumpTables(t, h.f)
	if n := len(tables[TableDedupe]); n != 0 {
		t.Errorf("%d dedupe records left after the raise, want 0", n)
	}
	if n := len(tables[TableSessions]); n != 3 {
		t.Errorf("%d sessions after the raise, want 3 (client-1 to client-3)", n)
	}
	res := h.apply(steps[3].Cmd) // client-1's heartbeat, sequence 2, at index 4
	if !res.Duplicate || res.Err != nil || res.Index != 4 {
		t.Errorf("repeat of a write of the state at 0.0 = %+v, want its outcome (index 4)", res)
	}
	res = h.apply(steps[13].Cmd) // client-3's failed delete
	if !res.Duplicate || !errors.Is(res.Err, ErrNotFound) || res.Index != 14 {
		t.Errorf("repeat of a failed write of the state at 0.0 = %+v, want not_found at 14", res)
	}
	if got := h.f.State().Index(TableSessions); got == 0 {
		t.Error("sessions table has no index row after the conversion")
	}
	if v, rec, err := h.f.State().ClusterVersion(); err != nil || v != Latest || rec.GetIndex() != h.index-2 {
		t.Errorf("ClusterVersion = %s, %v, %v; want %s set at index %d", v, rec, err, Latest, h.index-2)
	}
}

// TestDowngradeConvertsSessions: moving a state to 0.0 turns each session
// into dedupe records, drops what 0.0 cannot hold, writes format 2, and
// the outcomes of the writes before the downgrade still answer their
// repeats; moving it up again gives the sessions back.
func TestDowngradeConvertsSessions(t *testing.T) {
	h := newHarness(t)
	populate(h)
	h.mustApply(SetClusterVersionCommand(Version0_0))
	if v := h.f.Version(); v != Version0_0 {
		t.Fatalf("version %s after the downgrade", v)
	}
	tables := dumpTables(t, h.f)
	for _, table := range []string{TableSessions, TablePlacements, TableClusterVersion} {
		if n := len(tables[table]); n != 0 {
			t.Errorf("%s: %d records at 0.0, want none", table, n)
		}
	}
	if len(tables[TableDedupe]) == 0 {
		t.Error("no dedupe records after the downgrade")
	}
	snap := h.snapshot()
	if v := binary.BigEndian.Uint32(snap[4:8]); v != 2 {
		t.Errorf("snapshot format %d at 0.0, want 2", v)
	}
	steps := fsmtest.FullState()
	res := h.apply(steps[3].Cmd)
	if !res.Duplicate || res.Err != nil || res.Index != 4 {
		t.Errorf("repeat of a write made at %s = %+v, want its outcome (index 4)", Latest, res)
	}
	r := newHarness(t, func(c *Config) { c.InitialVersion = Version0_0 })
	if err := r.f.Restore(readCloser(snap)); err != nil {
		t.Fatal(err)
	}
	if r.f.Version() != Version0_0 {
		t.Errorf("restored at %s, want 0.0", r.f.Version())
	}
	h.mustApply(SetClusterVersionCommand(Latest))
	if n := len(dumpTables(t, h.f)[TableSessions]); n == 0 {
		t.Error("no sessions after moving up again")
	}
}

// recordPointers lists the records of every table (not the index table,
// nor the sessions, which State.Records converts to new messages).
func recordPointers(t *testing.T, f *FSM) map[string][]proto.Message {
	t.Helper()
	out := make(map[string][]proto.Message)
	st := f.State()
	for _, table := range Tables() {
		if table == TableIndex || table == TableSessions {
			continue
		}
		recs, err := st.Records(table)
		if err != nil {
			t.Fatal(err)
		}
		out[table] = recs
	}
	return out
}

// samePointers reports how many records of a are the very records of b.
func samePointers(a, b map[string][]proto.Message) (same, total int) {
	for table, recs := range a {
		for i, r := range recs {
			total++
			if i < len(b[table]) && r == b[table][i] {
				same++
			}
		}
	}
	return same, total
}

// TestRestoreMergesIntoTheState: a restore onto a state that differs in
// every way (records added, changed, deleted, tables emptied) ends with
// exactly the snapshot's state; a restore of the state's own snapshot
// keeps every record as it is (nothing is decoded or copied) and still
// wakes watchers; records out of key order are refused.
func TestRestoreMergesIntoTheState(t *testing.T) {
	src := newHarness(t)
	populate(src)
	snap, want := src.snapshot(), dumpTables(t, src.f)

	dst := newHarness(t)
	populate(dst)
	dst.mustApply(register(instance("extra", "1")))
	dst.mustApply(register(instance("web", "a")))
	dst.mustApply(deregister("web", "b"))
	dst.mustApply(setConfig("only-here", "x"))
	if err := dst.f.Restore(readCloser(snap)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	got := dumpTables(t, dst.f)
	for _, table := range Tables() {
		if table != TableIndex && !reflect.DeepEqual(got[table], want[table]) {
			t.Errorf("table %s after restore:\n got %v\nwant %v", table, got[table], want[table])
		}
	}

	before := recordPointers(t, src.f)
	abandon := src.f.AbandonCh()
	if err := src.f.Restore(readCloser(snap)); err != nil {
		t.Fatalf("Restore of its own snapshot: %v", err)
	}
	if same, total := samePointers(recordPointers(t, src.f), before); same != total || total == 0 {
		t.Errorf("restoring the state's own snapshot kept %d of %d records", same, total)
	}
	select {
	case <-abandon:
	default:
		t.Error("a restore did not close the abandon channel")
	}
	if !bytes.Equal(src.snapshot(), snap) {
		t.Error("the state's own snapshot restored to another state")
	}

	a := marshal(t, &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Address: "x"})
	b := marshal(t, &clusterv1.ServiceInstance{Service: "web", InstanceId: "b", Address: "x"})
	unordered := buildSnapshot(1, header(1, table(TableServices, 2)), b, a)
	if err := dst.f.Restore(readCloser(unordered)); !errors.Is(err, ErrCorruptSnapshot) || !strings.Contains(err.Error(), "out of order") {
		t.Errorf("Restore(records out of order) = %v, want ErrCorruptSnapshot naming the order", err)
	}
	if _, err := ScanSnapshot(bytes.NewReader(unordered)); !errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("ScanSnapshot(records out of order) = %v, want ErrCorruptSnapshot", err)
	}
	if _, err := VerifySnapshot(bytes.NewReader(buildSnapshot(1, header(1, table(TableServices, 2)), a, b))); err != nil {
		t.Errorf("VerifySnapshot(records in order) = %v", err)
	}
}

// TestReplaceKeepsWhatItHolds: Replace with the records the state holds
// (or equal ones) keeps them in place; with changes, the state is exactly
// the records given, the later of two with one key winning; a fork is a
// copy that goes its own way.
func TestReplaceKeepsWhatItHolds(t *testing.T) {
	h := newHarness(t)
	populate(h)
	var records []TableRecord
	before := recordPointers(t, h.f)
	for table, recs := range before {
		for _, r := range recs {
			records = append(records, TableRecord{Table: table, Record: r})
		}
	}
	sessions, err := h.f.State().Records(TableSessions)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range sessions {
		records = append(records, TableRecord{Table: TableSessions, Record: r})
	}
	// An equal copy of a record (not the same pointer) changes nothing.
	records = append(records, TableRecord{Table: TableServices, Record: proto.Clone(before[TableServices][0])})
	want := dumpTables(t, h.f)
	index := h.f.AppliedIndex() + 10
	if err := h.f.Replace(index, records); err != nil {
		t.Fatal(err)
	}
	if same, total := samePointers(recordPointers(t, h.f), before); same != total {
		t.Errorf("Replace with the state's own records kept %d of %d", same, total)
	}
	got := dumpTables(t, h.f)
	for _, table := range Tables() {
		if table != TableIndex && !reflect.DeepEqual(got[table], want[table]) {
			t.Errorf("table %s changed:\n got %v\nwant %v", table, got[table], want[table])
		}
	}
	if idx := h.f.State().Index(TableServices); idx != index {
		t.Errorf("services index %d, want %d", idx, index)
	}

	fork, err := h.f.Fork(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	changed := instance("web", "a")
	changed.Address = "10.9.9.9"
	later := instance("web", "a")
	later.Address = "10.8.8.8"
	if err := fork.Replace(index+1, []TableRecord{
		{Table: TableServices, Record: changed},
		{Table: TableServices, Record: later},
		{Table: TableServices, Record: instance("new", "1")},
	}); err != nil {
		t.Fatal(err)
	}
	_, insts, err := fork.State().Services("", nil)
	if err != nil || len(insts) != 2 || insts[0].GetService() != "new" || insts[1].GetAddress() != "10.8.8.8" {
		t.Errorf("fork after Replace: %v, %v; want new/1 and web/a at 10.8.8.8", insts, err)
	}
	if cfg, err := fork.State().Records(TableConfig); err != nil || len(cfg) != 0 {
		t.Errorf("fork after Replace holds %d config entries (%v), want none", len(cfg), err)
	}
	if got := dumpTables(t, h.f); !reflect.DeepEqual(got[TableServices], want[TableServices]) || !reflect.DeepEqual(got[TableConfig], want[TableConfig]) {
		t.Error("replacing the fork's state changed the original")
	}
	if err := h.f.Replace(index, []TableRecord{{Table: TableServices, Record: &clusterv1.ServiceInstance{}}}); err == nil {
		t.Error("Replace with a record without its key succeeded")
	}
}

// TestWatchesAfterRestore: a restore wakes the watchers of the state it
// replaces, and the restored state's watches fire on the next write, as
// after Replace.
func TestWatchesAfterRestore(t *testing.T) {
	src := newHarness(t)
	populate(src)
	snap := src.snapshot()
	h := newHarness(t)
	populate(h)
	h.mustApply(register(instance("extra", "1")))
	for i, replace := range []func() error{
		func() error { return h.f.Restore(readCloser(snap)) },
		func() error { return h.f.Replace(h.f.AppliedIndex()+1, nil) },
	} {
		ws := memdb.NewWatchSet()
		if _, err := h.f.State().WatchTables(ws, TableServices); err != nil {
			t.Fatal(err)
		}
		if err := replace(); err != nil {
			t.Fatal(err)
		}
		if ws.Watch(time.After(10 * time.Second)) {
			t.Fatalf("step %d: the replaced state's watch did not fire", i)
		}
		ws = memdb.NewWatchSet()
		if _, err := h.f.State().WatchTables(ws, TableServices); err != nil {
			t.Fatal(err)
		}
		h.index = h.f.AppliedIndex()
		h.mustApply(register(instance("after", fmt.Sprint(i))))
		if ws.Watch(time.After(10 * time.Second)) {
			t.Fatalf("step %d: a write after the restore did not fire the restored state's watch", i)
		}
	}
}
