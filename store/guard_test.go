package store

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// A heartbeat handled after Close must neither panic Raft (its term write
// fails) nor reach the file.
func TestGuardedBoltAfterClose(t *testing.T) {
	path := filepath.Join(t.TempDir(), "raft.db")
	raw, err := raftboltdb.NewBoltStore(path)
	if err != nil {
		t.Fatal(err)
	}
	g := &guardedBolt{bolt: raw}
	key := []byte("CurrentTerm")
	if err := g.SetUint64(key, 3); err != nil {
		t.Fatal(err)
	}
	if err := g.StoreLog(&raft.Log{Index: 1, Term: 3, Data: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}

	if err := g.SetUint64(key, 4); err != nil {
		t.Errorf("SetUint64 after Close = %v, want nil (dropped)", err)
	}
	if err := g.Set(key, []byte("y")); err != nil {
		t.Errorf("Set after Close = %v, want nil (dropped)", err)
	}
	var l raft.Log
	for name, err := range map[string]error{
		"GetLog":    g.GetLog(1, &l),
		"StoreLog":  g.StoreLog(&raft.Log{Index: 2, Term: 4}),
		"StoreLogs": g.StoreLogs([]*raft.Log{{Index: 2, Term: 4}}),
		"DeleteRange": func() error {
			return g.DeleteRange(1, 1)
		}(),
		"GetUint64": func() error { _, err := g.GetUint64(key); return err }(),
		"Get":       func() error { _, err := g.Get(key); return err }(),
		"LastIndex": func() error { _, err := g.LastIndex(); return err }(),
	} {
		if !errors.Is(err, errLogClosed) {
			t.Errorf("%s after Close = %v, want %v", name, err, errLogClosed)
		}
	}

	// Nothing dropped reached the file; what was written before is there.
	raw, err = raftboltdb.NewBoltStore(path)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	if term, err := raw.GetUint64(key); err != nil || term != 3 {
		t.Errorf("term on disk = %d, %v; want 3", term, err)
	}
	if err := raw.GetLog(1, &l); err != nil || string(l.Data) != "x" {
		t.Errorf("entry 1 on disk = %q, %v; want \"x\"", l.Data, err)
	}
}
