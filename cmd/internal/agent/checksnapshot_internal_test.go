package agent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"pilab.hu/pivirt-agent/store"
)

// TestCheckSnapshot: the store's snapshot check tells a snapshot of a newer
// release (store.ErrNewerData) from one that does not read as a snapshot
// at all, and takes this release's own.
func TestCheckSnapshot(t *testing.T) {
	own, err := os.ReadFile(filepath.Join("..", "..", "..", "fsm", "testdata", "snapshot", "v5", "state.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkSnapshot(bytes.NewReader(own)); err != nil {
		t.Fatalf("this release's snapshot: %v", err)
	}
	newer := bytes.Clone(own)
	binary.BigEndian.PutUint32(newer[4:8], 99) // the format version after the magic
	if err := checkSnapshot(bytes.NewReader(newer)); !errors.Is(err, store.ErrNewerData) {
		t.Fatalf("a newer format: %v, want %v", err, store.ErrNewerData)
	}
	damaged := append([]byte("PVSN\x00\x00\x00\x05"), 0x7f, 0xff, 0xff)
	if err := checkSnapshot(bytes.NewReader(damaged)); err == nil || errors.Is(err, store.ErrNewerData) {
		t.Fatalf("a damaged header: %v, want an error that is not %v", err, store.ErrNewerData)
	}
}
