package archive_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// state returns the snapshot stream of an FSM holding n instances and a
// config document.
func state(t testing.TB, n int) []byte {
	t.Helper()
	f, err := fsm.New(fsm.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	apply := func(i int, cmd *fsmv1.Command) {
		cmd.Time = timestamppb.New(now)
		data, err := fsm.Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	for i := range n {
		apply(i, &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{
			Instance: &clusterv1.ServiceInstance{Service: "web", InstanceId: fmt.Sprintf("i-%05d", i), Node: "node-1", Address: "10.0.0.1", Port: 8080},
		}}})
	}
	apply(n, &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: "log.level", Value: "debug"}}})
	var buf bytes.Buffer
	if err := f.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func testMeta(size int) archive.Meta {
	return archive.Meta{
		ID: "2-11-1700000000000", Index: 11, Term: 2, ClusterID: "c-1", AgentVersion: "test",
		Size: int64(size), CreatedAt: time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC),
	}
}

func writeArchive(t testing.TB, meta archive.Meta, st []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := archive.Write(&buf, meta, bytes.NewReader(st)); err != nil {
		t.Fatalf("Write: %v", err)
	}
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	st := state(t, 50)
	meta := testMeta(len(st))
	file := writeArchive(t, meta, st)

	info, err := archive.Verify(bytes.NewReader(file))
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	// A state without a cluster CA is written in format 1, the oldest
	// that holds it; Write takes the version from the state's preamble.
	meta.FormatVersion, meta.StateFormatVersion = archive.FormatVersion, 1
	if info.Meta != meta {
		t.Errorf("meta = %+v, want %+v", info.Meta, meta)
	}
	counts := map[string]uint64{}
	for _, ti := range info.State.Tables {
		counts[ti.Name] = ti.Records
	}
	if counts[fsm.TableServices] != 50 || counts[fsm.TableConfig] != 1 {
		t.Errorf("table counts = %v, want 50 services and 1 config", counts)
	}
	if want := fmt.Sprintf("%x", sha256.Sum256(st)); info.SHA256[archive.StateFile] != want {
		t.Errorf("state checksum = %s, want %s", info.SHA256[archive.StateFile], want)
	}

	// The files are what sha256sum(1) and tar(1) would see.
	entries := untar(t, file)
	if names := entryNames(entries); names != "meta.json,state.bin,SHA256SUMS" {
		t.Errorf("entries = %s", names)
	}
	if !bytes.Equal(entries[1].data, st) {
		t.Errorf("state.bin differs from the state written")
	}
	sums := string(entries[2].data)
	for _, e := range entries[:2] {
		line := fmt.Sprintf("%x  %s\n", sha256.Sum256(e.data), e.name)
		if !strings.Contains(sums, line) {
			t.Errorf("SHA256SUMS %q lacks %q", sums, line)
		}
	}

	rd, err := archive.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatalf("NewReader: %v", err)
	}
	if rd.Meta != meta {
		t.Errorf("Reader.Meta = %+v, want %+v", rd.Meta, meta)
	}
	sr, err := rd.State()
	if err != nil {
		t.Fatalf("State: %v", err)
	}
	got, err := io.ReadAll(sr)
	if err != nil || !bytes.Equal(got, st) {
		t.Fatalf("State read %d bytes, %v; want the %d bytes written", len(got), err, len(st))
	}
	if err := rd.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

func TestWriteShortState(t *testing.T) {
	st := state(t, 3)
	meta := testMeta(len(st) + 10)
	if err := archive.Write(io.Discard, meta, bytes.NewReader(st)); err == nil || !strings.Contains(err.Error(), "ended after") {
		t.Errorf("Write with a short state = %v, want an error saying it ended early", err)
	}
}

type entry struct {
	name string
	data []byte
	typ  byte
}

func untar(t testing.TB, file []byte) []entry {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out []entry
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, entry{name: hdr.Name, data: b, typ: hdr.Typeflag})
	}
}

func entryNames(es []entry) string {
	var names []string
	for _, e := range es {
		names = append(names, e.name)
	}
	return strings.Join(names, ",")
}

// build writes entries as a gzip'd tar.
func build(t testing.TB, es []entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, e := range es {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		size := int64(len(e.data))
		if typ != tar.TypeReg {
			size = 0
		}
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o600, Size: size, Typeflag: typ}); err != nil {
			t.Fatal(err)
		}
		if typ == tar.TypeReg {
			if _, err := tw.Write(e.data); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func sumsOf(es ...entry) []byte {
	var b strings.Builder
	for _, e := range es {
		fmt.Fprintf(&b, "%x  %s\n", sha256.Sum256(e.data), e.name)
	}
	return []byte(b.String())
}

func gz(t testing.TB, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestVerifyRefuses feeds every kind of bad file to Verify and NewReader.
func TestVerifyRefuses(t *testing.T) {
	st := state(t, 20)
	other := state(t, 21)
	good := writeArchive(t, testMeta(len(st)), st)
	es := untar(t, good)
	meta, stEntry, sums := es[0], es[1], es[2]

	metaWith := func(change func(m map[string]any)) entry {
		var m map[string]any
		if err := json.Unmarshal(meta.data, &m); err != nil {
			t.Fatal(err)
		}
		change(m)
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return entry{name: archive.MetaFile, data: b}
	}
	// withSums rebuilds an archive around a changed entry with checksums
	// that match it, so that only the intended problem is left.
	withSums := func(m, s entry) []byte {
		return build(t, []entry{m, s, {name: archive.SumsFile, data: sumsOf(m, s)}})
	}
	otherState := entry{name: archive.StateFile, data: other}
	bigger := metaWith(func(m map[string]any) { m["size"] = len(other) })

	tests := []struct {
		name string
		file []byte
		want error
		msg  string
	}{
		{"empty file", nil, archive.ErrInvalid, "empty file"},
		{"not gzip", []byte("hello, this is not a snapshot\n"), archive.ErrInvalid, "not a gzip"},
		{"gzip of text", gz(t, []byte("hello")), archive.ErrInvalid, "truncated"},
		{"tar of other files", build(t, []entry{{name: "etc/passwd", data: []byte("root:x:0:0")}}), archive.ErrInvalid, `unknown archive entry "etc/passwd"`},
		{"raw state", st, archive.ErrInvalid, "not a gzip"},
		{"wrong state checksum", build(t, []entry{bigger, otherState, {name: archive.SumsFile, data: sumsOf(bigger, stEntry)}}), archive.ErrInvalid, "state.bin checksum mismatch"},
		{"wrong meta checksum", build(t, []entry{bigger, otherState, {name: archive.SumsFile, data: sumsOf(meta, otherState)}}), archive.ErrInvalid, "meta.json checksum mismatch"},
		{"unknown entry first", build(t, []entry{{name: "README", data: []byte("x")}, meta, stEntry, sums}), archive.ErrInvalid, `unknown archive entry "README"`},
		{"unknown entry last", build(t, []entry{meta, stEntry, sums, {name: "notes.txt", data: []byte("x")}}), archive.ErrInvalid, `unknown archive entry "notes.txt"`},
		{"entries out of order", build(t, []entry{stEntry, meta, sums}), archive.ErrInvalid, "where meta.json belongs"},
		{"no checksums", build(t, []entry{meta, stEntry}), archive.ErrInvalid, "SHA256SUMS missing"},
		{"duplicate entry", build(t, []entry{meta, stEntry, sums, sums}), archive.ErrInvalid, `unknown archive entry "SHA256SUMS"`},
		{"state is a directory", build(t, []entry{meta, {name: archive.StateFile, typ: tar.TypeDir}, sums}), archive.ErrInvalid, "not a regular file"},
		{"trailing bytes", append(bytes.Clone(good), "extra"...), archive.ErrInvalid, "trailing bytes"},
		{"second gzip member", append(bytes.Clone(good), gz(t, []byte("more"))...), archive.ErrInvalid, "trailing bytes"},
		{"newer archive format", withSums(metaWith(func(m map[string]any) { m["format_version"] = 2 }), stEntry), archive.ErrUnsupported, "archive format version 2"},
		{"newer format with new fields", withSums(metaWith(func(m map[string]any) { m["format_version"] = 2; m["encryption"] = "aes" }), stEntry), archive.ErrUnsupported, "archive format version 2"},
		{"newer state format", withSums(metaWith(func(m map[string]any) { m["state_format_version"] = 9 }), stEntry), archive.ErrUnsupported, "state format version 9"},
		{"no format version", withSums(metaWith(func(m map[string]any) { delete(m, "format_version") }), stEntry), archive.ErrInvalid, "format_version missing"},
		{"unknown meta field", withSums(metaWith(func(m map[string]any) { m["colour"] = "red" }), stEntry), archive.ErrInvalid, `unknown field "colour"`},
		{"meta not json", withSums(entry{name: archive.MetaFile, data: []byte("{")}, stEntry), archive.ErrInvalid, "meta.json"},
		{"size mismatch", withSums(metaWith(func(m map[string]any) { m["size"] = len(st) + 1 }), stEntry), archive.ErrInvalid, "meta.json says"},
		{"state not a snapshot", withSums(metaWith(func(m map[string]any) { m["size"] = 5 }), entry{name: archive.StateFile, data: []byte("hello")}), archive.ErrInvalid, "state.bin"},
		{"bad checksum line", build(t, []entry{meta, stEntry, {name: archive.SumsFile, data: []byte("abc  meta.json\n")}}), archive.ErrInvalid, "is not"},
		{"checksum of unknown entry", build(t, []entry{meta, stEntry, {name: archive.SumsFile, data: append(bytes.Clone(sums.data), sumsOf(entry{name: "x", data: nil})...)}}), archive.ErrInvalid, `unknown entry "x"`},
	}
	checkers := map[string]func(io.ReadSeeker) (*archive.Info, error){
		"Verify": archive.Verify,
		"Check":  func(r io.ReadSeeker) (*archive.Info, error) { return archive.Check(r) },
		// A restore's path: Open, the state decoded once into an FSM,
		// Close.
		"Open+Restore": func(r io.ReadSeeker) (*archive.Info, error) {
			rd, info, err := archive.Open(r, 0)
			if err != nil {
				return info, err
			}
			sr, err := rd.State()
			if err != nil {
				return info, err
			}
			f, err := fsm.New(fsm.LatestConfig())
			if err != nil {
				return info, err
			}
			if err := f.Restore(io.NopCloser(sr)); err != nil {
				return info, archive.StateError(err)
			}
			return info, rd.Close()
		},
	}
	for name, check := range checkers {
		for _, tt := range tests {
			t.Run(name+"/"+tt.name, func(t *testing.T) {
				_, err := check(bytes.NewReader(tt.file))
				if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.msg) {
					t.Errorf("%s = %v, want %v containing %q", name, err, tt.want, tt.msg)
				}
			})
		}
		if _, err := check(bytes.NewReader(good)); err != nil {
			t.Errorf("%s(good archive) = %v", name, err)
		}
		// Every truncation of a good archive is refused.
		for n := 0; n < len(good); n += max(1, len(good)/97) {
			if _, err := check(bytes.NewReader(good[:n])); !errors.Is(err, archive.ErrInvalid) {
				t.Fatalf("%s(first %d of %d bytes) = %v, want ErrInvalid", name, n, len(good), err)
			}
		}
		// Every flipped byte too (gzip's CRC, deflate or the checksums
		// catch it).
		for i := 0; i < len(good); i += max(1, len(good)/61) {
			bad := bytes.Clone(good)
			bad[i] ^= 0x40
			if _, err := check(bytes.NewReader(bad)); err == nil {
				t.Fatalf("%s accepted the archive with byte %d of %d flipped", name, i, len(good))
			}
		}
	}
}

// TestVerifyChecksSumsFirst: Verify compares the checksums before it
// decodes anything, so a state.bin that is not what SHA256SUMS lists is
// refused for that, whatever it holds (Check, in one pass, finds the
// garbage first).
func TestVerifyChecksSumsFirst(t *testing.T) {
	st := state(t, 5)
	good := untar(t, writeArchive(t, testMeta(len(st)), st))
	meta := good[0]
	var m map[string]any
	if err := json.Unmarshal(meta.data, &m); err != nil {
		t.Fatal(err)
	}
	m["size"] = 5
	b, _ := json.Marshal(m)
	meta = entry{name: archive.MetaFile, data: b}
	garbage := entry{name: archive.StateFile, data: []byte("hello")}
	file := build(t, []entry{meta, garbage, {name: archive.SumsFile, data: sumsOf(meta, good[1])}})
	if _, err := archive.Verify(bytes.NewReader(file)); !errors.Is(err, archive.ErrInvalid) || !strings.Contains(err.Error(), "state.bin checksum mismatch") {
		t.Errorf("Verify = %v, want the checksum mismatch before any decoding", err)
	}
	if _, err := archive.Check(bytes.NewReader(file)); !errors.Is(err, archive.ErrInvalid) || strings.Contains(err.Error(), "checksum") {
		t.Errorf("Check = %v, want the decoding error", err)
	}
}

// TestVerifyWithinRefusesABomb: a 64 MiB state that compresses to a few
// hundred KiB, with valid checksums, is refused on its declared size before
// it is decompressed, and passes without the bound.
func TestVerifyWithinRefusesABomb(t *testing.T) {
	st := append(state(t, 5), make([]byte, 64<<20)...) // zeros compress well; the decoder never gets there
	file := writeArchive(t, testMeta(len(st)), st)
	if len(file) > 1<<20 {
		t.Fatalf("the archive is %d bytes, not a bomb", len(file))
	}
	_, err := archive.VerifyWithin(bytes.NewReader(file), 1<<20)
	if !errors.Is(err, archive.ErrInvalid) || !strings.Contains(err.Error(), "more than the 1048576 this reader accepts") {
		t.Fatalf("VerifyWithin = %v, want a refusal on the declared size", err)
	}
	// Without a bound of the reader's, the archive's own size bounds it:
	// Verify (pvcli snapshot inspect) and Open (a restore, a plan) refuse
	// it having read little more than meta.json.
	for name, check := range map[string]func(io.ReadSeeker) error{
		"Verify": func(r io.ReadSeeker) error { _, err := archive.Verify(r); return err },
		"Open":   func(r io.ReadSeeker) error { _, _, err := archive.Open(r, 0); return err },
	} {
		r := &countingSeeker{ReadSeeker: bytes.NewReader(file)}
		err := check(r)
		if !errors.Is(err, archive.ErrInvalid) || !strings.Contains(err.Error(), "times the archive") {
			t.Fatalf("%s = %v, want a refusal on the declared size against the archive's", name, err)
		}
		if r.n > 256<<10 {
			t.Errorf("%s read %d bytes of a %d-byte archive before refusing it", name, r.n, len(file))
		}
	}
	// A genuine archive passes: the agents' states compress a few times.
	st = state(t, 2000)
	genuine := writeArchive(t, testMeta(len(st)), st)
	ratio := float64(len(st)) / float64(len(genuine))
	t.Logf("a state of 2000 instances: %d bytes in an archive of %d (%.1f times)", len(st), len(genuine), ratio)
	if ratio > archive.MaxExpansion/4 {
		t.Errorf("a state of 2000 instances compresses %.1f times, near the bound of %d", ratio, archive.MaxExpansion)
	}
	if _, err := archive.Verify(bytes.NewReader(genuine)); err != nil {
		t.Fatalf("Verify of a genuine archive: %v", err)
	}
}

// countingSeeker counts the bytes read.
type countingSeeker struct {
	io.ReadSeeker
	n int
}

func (c *countingSeeker) Read(p []byte) (int, error) {
	n, err := c.ReadSeeker.Read(p)
	c.n += n
	return n, err
}

// TestReaderChecksState: a Reader whose state was tampered with fails on
// Close.
func TestReaderChecksState(t *testing.T) {
	st := state(t, 5)
	es := untar(t, writeArchive(t, testMeta(len(st)), st))
	bad := bytes.Clone(st)
	bad[len(bad)-1] ^= 1
	file := build(t, []entry{es[0], {name: archive.StateFile, data: bad}, es[2]})
	rd, err := archive.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	sr, err := rd.State()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, sr); err != nil {
		t.Fatal(err)
	}
	if err := rd.Close(); !errors.Is(err, archive.ErrInvalid) || !strings.Contains(err.Error(), "checksum mismatch") {
		t.Errorf("Close = %v, want a checksum mismatch", err)
	}
}

// TestInspectDir reads a snapshot directory written by Raft's file
// snapshot store, and refuses it once state.bin is damaged.
func TestInspectDir(t *testing.T) {
	st := state(t, 7)
	root := t.TempDir()
	store, err := raft.NewFileSnapshotStore(root, 1, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("a")
	sink, err := store.Create(raft.SnapshotVersionMax, 42, 3, raft.Configuration{}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write(st); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "snapshots", sink.ID())
	info, err := archive.InspectDir(dir)
	if err != nil {
		t.Fatalf("InspectDir: %v", err)
	}
	if info.Meta.ID != sink.ID() || info.Meta.Index != 42 || info.Meta.Term != 3 || info.Meta.Size != int64(len(st)) {
		t.Errorf("meta = %+v", info.Meta)
	}
	if info.State == nil || len(info.State.Tables) == 0 {
		t.Fatalf("no state info: %+v", info)
	}

	path := filepath.Join(dir, archive.StateFile)
	bad := bytes.Clone(st)
	bad[len(bad)-1] ^= 1
	if err := os.WriteFile(path, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := archive.InspectDir(dir); !errors.Is(err, archive.ErrInvalid) {
		t.Errorf("InspectDir(damaged state.bin) = %v, want ErrInvalid", err)
	}
	if _, err := archive.InspectDir(root); !errors.Is(err, archive.ErrInvalid) || !strings.Contains(err.Error(), "not a snapshot directory") {
		t.Errorf("InspectDir(not a snapshot dir) = %v", err)
	}
}

// TestInspectDirRefusesHostileFiles: a meta.json that is a link to
// /dev/zero, or a state.bin that is a FIFO or a link, is refused at once
// (reading /dev/zero grows without end; opening a FIFO blocks until a
// writer comes).
func TestInspectDirRefusesHostileFiles(t *testing.T) {
	for name, setup := range map[string]func(dir string) error{
		"meta.json linked to /dev/zero": func(dir string) error {
			return os.Symlink("/dev/zero", filepath.Join(dir, archive.MetaFile))
		},
		"state.bin a FIFO": func(dir string) error {
			if err := os.WriteFile(filepath.Join(dir, archive.MetaFile), []byte(`{"ID":"x","Index":1,"Term":1,"Size":10,"CRC":"AAAAAAAAAAA="}`), 0o600); err != nil {
				return err
			}
			return syscall.Mkfifo(filepath.Join(dir, archive.StateFile), 0o600)
		},
		"state.bin linked to /dev/zero": func(dir string) error {
			if err := os.WriteFile(filepath.Join(dir, archive.MetaFile), []byte(`{"ID":"x","Index":1,"Term":1,"Size":10,"CRC":"AAAAAAAAAAA="}`), 0o600); err != nil {
				return err
			}
			return os.Symlink("/dev/zero", filepath.Join(dir, archive.StateFile))
		},
		"meta.json larger than its limit": func(dir string) error {
			return os.WriteFile(filepath.Join(dir, archive.MetaFile), bytes.Repeat([]byte(" "), 1<<20), 0o600)
		},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := setup(dir); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				_, err := archive.InspectDir(dir)
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, archive.ErrInvalid) {
					t.Errorf("InspectDir = %v, want ErrInvalid", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("InspectDir did not return")
			}
		})
	}
}

func TestSentinels(t *testing.T) { fsmtest.CheckSentinels(t, ".", archive.Sentinels) }
