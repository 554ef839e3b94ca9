package archive_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
)

// FuzzVerify feeds arbitrary bytes to the archive reader, as pvcli snapshot
// inspect and an agent's restore read an uploaded file: it must not panic,
// must refuse with a sentinel, and what it accepts must be readable to the
// end (state included) by the streaming reader with the same verdict.
func FuzzVerify(f *testing.F) {
	st := state(f, 3)
	valid := writeArchive(f, testMeta(len(st)), st)
	f.Add(valid)
	f.Add(valid[:len(valid)/2])
	f.Add(append(append([]byte{}, valid...), 0))
	f.Add([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		info, err := archive.Verify(bytes.NewReader(data))
		if err != nil {
			if !errors.Is(err, archive.ErrInvalid) && !errors.Is(err, archive.ErrUnsupported) {
				t.Fatalf("Verify error %v wraps no sentinel", err)
			}
			return
		}
		rd, err := archive.NewReader(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("Verify accepted the archive, NewReader refused it: %v", err)
		}
		if rd.Meta != info.Meta {
			t.Fatalf("meta differs: %+v vs %+v", rd.Meta, info.Meta)
		}
		s, err := rd.State()
		if err != nil {
			t.Fatal(err)
		}
		f, err := fsm.New(fsm.LatestConfig())
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Restore(io.NopCloser(s)); err != nil {
			t.Fatalf("a verified archive's state does not restore: %v", err)
		}
		if err := rd.Close(); err != nil {
			t.Fatalf("a verified archive fails at its end: %v", err)
		}
	})
}
