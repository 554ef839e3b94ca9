package store_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.etcd.io/bbolt"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// TestDamagedLogRefused damages a node's raft.db in the ways a disk or a
// crash can (a file cut short, garbage over pages in use, lost meta pages)
// and starts it again: the store refuses to open with an error that
// names the file, and the process survives to say so.
func TestDamagedLogRefused(t *testing.T) {
	damage := map[string]func(b []byte) []byte{
		"torn tail (file cut short)": func(b []byte) []byte { return b[:len(b)/2] },
		"garbage middle": func(b []byte) []byte {
			for i := 4 * 4096; i < 6*4096 && i < len(b); i++ {
				b[i] = 0xa5
			}
			return b
		},
		"meta pages zeroed": func(b []byte) []byte {
			clear(b[:2*4096])
			return b
		},
	}
	for name, f := range damage {
		t.Run(name, func(t *testing.T) {
			c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
			c.WaitLeader(t, 10*time.Second)
			for i := range 2000 {
				c.Apply(t, storetest.Set("k"+strings.Repeat("x", i%50), strings.Repeat("v", 100)))
			}
			c.Stop(0)
			path := filepath.Join(c.DataDir(0), "raft", "raft.db")
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, f(b), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := storetest.TestConfig()
			cfg.NodeID = c.ID(0)
			cfg.DataDir = c.DataDir(0)
			cfg.FSM = storetest.NewKV()
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil) // closed by New on failure
			s, err := store.New(cfg)
			if err == nil {
				s.Close()
				t.Fatalf("a raft.db with %s opened", name)
			}
			if !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q does not name %s", err, path)
			}
			if !errors.Is(err, store.ErrCorruptLog) && !strings.Contains(err.Error(), "open raft log") {
				t.Fatalf("error %v is neither ErrCorruptLog nor an open failure", err)
			}
			t.Logf("%s: %v", name, err)
		})
	}
}

// TestGarbledLogEntryRefused garbles the newest entries of the log inside
// a well-formed bbolt file (a tail of bad data, not of bad pages): the
// store refuses to open, naming the entry, instead of handing it to Raft.
func TestGarbledLogEntryRefused(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
	c.WaitLeader(t, 10*time.Second)
	for i := range 50 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	c.Stop(0)
	path := filepath.Join(c.DataDir(0), "raft", "raft.db")
	db, err := bbolt.Open(path, 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	err = db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket([]byte("logs"))
		if b == nil {
			return errors.New("no logs bucket")
		}
		k, _ := b.Cursor().Last()
		last = binary.BigEndian.Uint64(k)
		return b.Put(k, []byte{0xc1, 0xff, 0x00, 0x13})
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	cfg := storetest.TestConfig()
	cfg.NodeID, cfg.DataDir, cfg.FSM = c.ID(0), c.DataDir(0), storetest.NewKV()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil)
	s, err := store.New(cfg)
	if err == nil {
		s.Close()
		t.Fatal("a log with a garbled entry opened")
	}
	if !errors.Is(err, store.ErrCorruptLog) || !strings.Contains(err.Error(), fmt.Sprintf("entry %d", last)) {
		t.Fatalf("error %v: want ErrCorruptLog naming entry %d", err, last)
	}
	t.Log(err)
}
