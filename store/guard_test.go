package store

import (
	"errors"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

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

// closeAccepted cuts the connections Raft's transport still serves, so an
// answer written after Close never leaves the node.
func TestTrackedStreamCloseAccepted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := &trackedStream{StreamLayer: NewTCPStreamLayer(ln, nil), conns: make(map[net.Conn]struct{})}
	defer ts.Close()

	dial := func() net.Conn {
		t.Helper()
		c, err := ts.Dial(raft.ServerAddress(ln.Addr().String()), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	c1, c2 := dial(), dial()
	s1, err := ts.Accept()
	if err != nil {
		t.Fatal(err)
	}
	s2, err := ts.Accept()
	if err != nil {
		t.Fatal(err)
	}
	// A connection closed by its handler leaves the set.
	s2.Close()
	ts.mu.Lock()
	n := len(ts.conns)
	ts.mu.Unlock()
	if n != 1 {
		t.Errorf("%d connections tracked after one closed, want 1", n)
	}
	if _, err := c2.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read from a closed connection's peer = %v, want EOF", err)
	}

	ts.closeAccepted()
	c1.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c1.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read after closeAccepted = %v, want EOF", err)
	}
	if _, err := s1.Write([]byte("answer")); err == nil {
		t.Error("write on a connection cut by closeAccepted succeeded")
	}
	// One accepted afterwards is closed at once.
	c3 := dial()
	if _, err := ts.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after closeAccepted = %v, want net.ErrClosed", err)
	}
	c3.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c3.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("read from a connection accepted after closeAccepted = %v, want EOF", err)
	}
}
