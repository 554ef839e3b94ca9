package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// walSegments returns node i's WAL segment files, oldest first.
func walSegments(t *testing.T, c *storetest.Cluster, i int) []string {
	t.Helper()
	segs, err := filepath.Glob(filepath.Join(c.DataDir(i), "raft", "wal", "*.wal"))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(segs)
	return segs
}

// A new data dir gets a WAL; a data dir made with boltdb keeps it, whatever
// the configuration says, and a WAL data dir keeps its WAL.
func TestLogStoreChoice(t *testing.T) {
	for _, tc := range []struct{ first, then, want string }{
		{"", "", store.LogStoreWAL},
		{store.LogStoreBoltDB, "", store.LogStoreBoltDB},
		{store.LogStoreBoltDB, store.LogStoreWAL, store.LogStoreBoltDB},
		{store.LogStoreWAL, store.LogStoreBoltDB, store.LogStoreWAL},
	} {
		t.Run(fmt.Sprintf("%q then %q", tc.first, tc.then), func(t *testing.T) {
			kind := tc.first
			c := storetest.NewCluster(t, 1, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) { cfg.LogStore = kind }))
			c.WaitLeader(t, leaderTimeout)
			c.Apply(t, storetest.Set("a", "1"))
			c.Stop(0)
			kind = tc.then
			c.Restart(0)
			c.WaitLeader(t, leaderTimeout)
			c.Apply(t, storetest.Set("b", "2"))
			waitValue(t, c, 0, "a", "1")
			_, err := os.Stat(filepath.Join(c.DataDir(0), "raft", "wal"))
			if got := err == nil; got != (tc.want == store.LogStoreWAL) {
				t.Fatalf("wal directory present = %v, want log store %s", got, tc.want)
			}
		})
	}
}

// TestDamagedWALRefused damages a WAL the ways a disk can — garbage over
// a sealed segment, a segment file gone, the metadata database zeroed —
// and starts the node again: it refuses with ErrCorruptLog naming the WAL.
// (A torn tail, what a crash in the middle of an append leaves, is not
// damage: raft-wal keeps the entries before it, as etcd's WAL does.)
func TestDamagedWALRefused(t *testing.T) {
	damage := map[string]func(t *testing.T, c *storetest.Cluster){
		"garbage over a sealed segment": func(t *testing.T, c *storetest.Cluster) {
			seg := walSegments(t, c, 0)[0]
			b, err := os.ReadFile(seg)
			if err != nil {
				t.Fatal(err)
			}
			for i := 64 << 10; i < 128<<10; i++ {
				b[i] = 0xa5
			}
			if err := os.WriteFile(seg, b, 0o600); err != nil {
				t.Fatal(err)
			}
		},
		"a sealed segment gone": func(t *testing.T, c *storetest.Cluster) {
			segs := walSegments(t, c, 0)
			if err := os.Remove(segs[len(segs)-2]); err != nil {
				t.Fatal(err)
			}
		},
		"metadata zeroed": func(t *testing.T, c *storetest.Cluster) {
			path := filepath.Join(c.DataDir(0), "raft", "wal", "wal-meta.db")
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			clear(b[:2*4096])
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
		},
	}
	for name, f := range damage {
		t.Run(name, func(t *testing.T) {
			c := storetest.NewCluster(t, 1, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) {
				cfg.WALSegmentSize = 1 << 20
			}))
			c.WaitLeader(t, leaderTimeout)
			for i := range 3000 {
				c.Apply(t, storetest.Set(fmt.Sprint("k", i%100), strings.Repeat("v", 1000)))
			}
			c.Stop(0)
			if n := len(walSegments(t, c, 0)); n < 3 {
				t.Fatalf("%d segments, want at least 3 (two sealed)", n)
			}
			f(t, c)
			_, err := startAgain(t, c, 0)
			if !errors.Is(err, store.ErrCorruptLog) || !strings.Contains(err.Error(), filepath.Join(c.DataDir(0), "raft", "wal")) {
				t.Fatalf("start on a WAL with %s = %v, want ErrCorruptLog naming the WAL", name, err)
			}
			t.Log(err)
		})
	}
}

// TestMigrateLogStore converts a node's log from boltdb to WAL and back
// with the node stopped, restarting it in between: it keeps every write,
// takes new ones, and still rejoins the two other nodes. A running node's
// data dir is refused, and a leftover of an interrupted migration is
// harmless.
func TestMigrateLogStore(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM, withLogStore(store.LogStoreBoltDB))
	c.WaitLeader(t, leaderTimeout)
	for i := range 50 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	n := c.Index(c.Followers()[0])
	ctx := t.Context()

	if _, err := store.MigrateLogStore(ctx, c.DataDir(n), store.LogStoreWAL, 0); !errors.Is(err, store.ErrDataDirLocked) {
		t.Fatalf("migrate a running node's data dir = %v, want ErrDataDirLocked", err)
	}
	if _, err := store.MigrateLogStore(ctx, c.DataDir(n), "sqlite", 0); err == nil || !strings.Contains(err.Error(), `--to "sqlite": must be wal or boltdb`) {
		t.Fatalf("migrate to sqlite = %v", err)
	}
	if _, err := store.MigrateLogStore(ctx, t.TempDir(), store.LogStoreWAL, 0); err == nil || !strings.Contains(err.Error(), "holds no raft state") {
		t.Fatalf("migrate an empty dir = %v", err)
	}

	step := 0
	for _, to := range []string{store.LogStoreWAL, store.LogStoreBoltDB, store.LogStoreWAL} {
		c.Stop(n)
		// The leftover of a migration that was interrupted.
		if err := os.MkdirAll(filepath.Join(c.DataDir(n), "raft", "wal.migrating"), 0o700); err != nil {
			t.Fatal(err)
		}
		res, err := store.MigrateLogStore(ctx, c.DataDir(n), to, 1<<20)
		if err != nil {
			t.Fatalf("migrate to %s: %v", to, err)
		}
		if res.To != to || res.From == to || res.Last == 0 || res.Unchanged {
			t.Fatalf("migrate to %s = %+v", to, res)
		}
		again, err := store.MigrateLogStore(ctx, c.DataDir(n), to, 1<<20)
		if err != nil || !again.Unchanged {
			t.Fatalf("migrate to %s twice = %+v, %v; want unchanged", to, again, err)
		}
		_, err = os.Stat(filepath.Join(c.DataDir(n), "raft", "wal"))
		if (err == nil) != (to == store.LogStoreWAL) {
			t.Fatalf("after migrating to %s: wal directory: %v", to, err)
		}
		// The configured store does not matter any more.
		c.Restart(n)
		for i := range 50 {
			waitValue(t, c, n, fmt.Sprint("k", i), "v")
		}
		step++
		c.Apply(t, storetest.Set(fmt.Sprint("step", step), to))
		waitValue(t, c, n, fmt.Sprint("step", step), to)
	}
	// The migrated node can lead.
	c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		if l.ID() == c.ID(n) {
			return nil
		}
		_, err := l.TransferLeadership(ctx, c.ID(n))
		return err
	})
	storetest.WaitFor(t, waitTimeout, "the migrated node leading", func() bool { return c.Store(n).IsLeader() })
	c.Apply(t, storetest.Set("led", "yes"))
	for i := range c.N() {
		waitValue(t, c, i, "led", "yes")
	}
}

// corruptReads returns entries' data with one byte flipped when read back
// from the log (as a disk that damages data at rest would), for entries
// at or above from.
type corruptReads struct {
	raft.LogStore
	from uint64
}

func (c corruptReads) GetLog(i uint64, l *raft.Log) error {
	if err := c.LogStore.GetLog(i, l); err != nil {
		return err
	}
	if i >= c.from && l.Type == raft.LogCommand && len(l.Data) > 1 {
		l.Data = slices.Clone(l.Data)
		l.Data[len(l.Data)-1] ^= 0xff
	}
	return nil
}

// TestLogVerification runs log verification on a 3-node cluster, on both
// log stores (node 0 on boltdb, the others on WAL): every node passes the
// leader's checkpoints; then one follower's disk starts returning damaged
// entries, and that follower, and only it, counts failures.
func TestLogVerification(t *testing.T) {
	var damaged string // the raft directory whose reads are damaged
	var from uint64
	undo := store.SetLogWrapper(func(dir string, l raft.LogStore) raft.LogStore {
		if dir != damaged {
			return l
		}
		return corruptReads{l, from}
	})
	t.Cleanup(undo)
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM, storetest.WithConfig(func(i int, cfg *store.Config) {
		cfg.LogVerificationInterval = time.Second
		if i == 0 {
			cfg.LogStore = store.LogStoreBoltDB
		}
	}))
	c.WaitLeader(t, leaderTimeout)
	write := func(prefix string) {
		for i := range 20 {
			c.Apply(t, storetest.Set(fmt.Sprint(prefix, i), "v"))
		}
	}
	write("a")
	storetest.WaitFor(t, 30*time.Second, "every node passing two verifications", func() bool {
		write("b")
		for i := range c.N() {
			if v := c.Store(i).LogVerification(); v.Passed < 2 || v.Failed > 0 {
				return false
			}
		}
		return true
	})

	f := c.Index(c.Followers()[0])
	c.Stop(f)
	damaged, from = filepath.Join(c.DataDir(f), "raft"), c.WaitLeader(t, leaderTimeout).Status().LastIndex+1
	c.Restart(f)
	storetest.WaitFor(t, 30*time.Second, "the damaged node failing a verification", func() bool {
		write("c")
		return c.Store(f).LogVerification().Failed > 0
	})
	for i := range c.N() {
		if v := c.Store(i).LogVerification(); i != f && v.Failed > 0 {
			t.Errorf("node %d, whose disk is sound, failed %d verifications", i, v.Failed)
		}
	}
	// The checkpoints never reached the FSM as commands, and reads wait
	// for nothing that never comes.
	waitValue(t, c, f, "c0", "v")
}
