package store

import (
	"errors"
	"sync"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// errLogClosed answers a read of the Raft log after Close.
var errLogClosed = errors.New("raft log closed")

// guardedBolt is the bbolt log and stable store as Raft sees it, safe to
// close while a heartbeat is still being handled.
//
// Raft answers heartbeats on the transport's connection goroutines
// (processHeartbeat), outside the goroutines Shutdown waits for: one that
// passed its shutdown check before Shutdown began can reach the stable store
// after Shutdown returned, and Raft panics when that write fails
// ("failed to save current term: database not open", hashicorp/raft#717).
// Close therefore waits for the calls in progress, and a term write arriving
// after it is dropped: the server is gone. The heartbeat's answer may still
// reach the leader, which is safe: a heartbeat commits nothing, and the
// votes that make a leader unique per term are cast and persisted by the
// run loop, which Shutdown has stopped, never on this path.
type guardedBolt struct {
	mu     sync.RWMutex
	closed bool
	bolt   *raftboltdb.BoltStore
}

var (
	_ raft.LogStore    = (*guardedBolt)(nil)
	_ raft.StableStore = (*guardedBolt)(nil)
)

// Close waits for the calls in progress and closes the file.
func (g *guardedBolt) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	return g.bolt.Close()
}

// read runs f unless the store is closed.
func (g *guardedBolt) read(f func() error) error {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.closed {
		return errLogClosed
	}
	return f()
}

// write runs f unless the store is closed, when the write is dropped (see
// the type's comment).
func (g *guardedBolt) write(f func() error) error {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.closed {
		return nil
	}
	return f()
}

func (g *guardedBolt) FirstIndex() (i uint64, err error) {
	err = g.read(func() (e error) { i, e = g.bolt.FirstIndex(); return })
	return i, err
}

func (g *guardedBolt) LastIndex() (i uint64, err error) {
	err = g.read(func() (e error) { i, e = g.bolt.LastIndex(); return })
	return i, err
}

func (g *guardedBolt) GetLog(idx uint64, l *raft.Log) error {
	return g.read(func() error { return g.bolt.GetLog(idx, l) })
}

// Log writes after Close fail: only Raft's own goroutines append or delete
// entries, and Shutdown has stopped them.
func (g *guardedBolt) StoreLog(l *raft.Log) error {
	return g.read(func() error { return g.bolt.StoreLog(l) })
}

func (g *guardedBolt) StoreLogs(ls []*raft.Log) error {
	return g.read(func() error { return g.bolt.StoreLogs(ls) })
}

func (g *guardedBolt) DeleteRange(lo, hi uint64) error {
	return g.read(func() error { return g.bolt.DeleteRange(lo, hi) })
}

func (g *guardedBolt) Set(k, v []byte) error {
	return g.write(func() error { return g.bolt.Set(k, v) })
}

func (g *guardedBolt) Get(k []byte) (v []byte, err error) {
	err = g.read(func() (e error) { v, e = g.bolt.Get(k); return })
	return v, err
}

func (g *guardedBolt) SetUint64(k []byte, v uint64) error {
	return g.write(func() error { return g.bolt.SetUint64(k, v) })
}

func (g *guardedBolt) GetUint64(k []byte) (v uint64, err error) {
	err = g.read(func() (e error) { v, e = g.bolt.GetUint64(k); return })
	return v, err
}
