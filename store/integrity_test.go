package store_test

import (
	"bytes"
	"context"
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
			c := storetest.NewCluster(t, 1, storetest.NewKVFSM, withLogStore(store.LogStoreBoltDB))
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
			_, err = startAgain(t, c, 0)
			if err == nil {
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
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM, withLogStore(store.LogStoreBoltDB))
	c.WaitLeader(t, 10*time.Second)
	for i := range 50 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	c.Stop(0)
	var last uint64
	storetest.EditLog(t, c.DataDir(0), func(b *bbolt.Bucket, newest uint64) error {
		last = newest
		return b.Put(storetest.LogKey(newest), []byte{0xc1, 0xff, 0x00, 0x13})
	})
	_, err := startAgain(t, c, 0)
	if err == nil {
		t.Fatal("a log with a garbled entry opened")
	}
	if !errors.Is(err, store.ErrCorruptLog) || !strings.Contains(err.Error(), fmt.Sprintf("entry %d", last)) {
		t.Fatalf("error %v: want ErrCorruptLog naming entry %d", err, last)
	}
	t.Log(err)
}

// TestRestartAfterLogOperations does what leaves gaps in a node's log — a
// user restore, a snapshot install on a lagging follower, compaction after
// automatic snapshots — then writes, stops every node and starts them all
// again: every node must start and hold every write, and the next write
// must succeed. Then the offline recovery must work on that data dir too.
func TestRestartAfterLogOperations(t *testing.T) {
	snapshot := func(t *testing.T, c *storetest.Cluster) {
		c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
			_, rc, err := l.Snapshot(ctx)
			if err == nil {
				rc.Close()
			}
			return err
		})
	}
	ops := map[string]struct {
		opts []storetest.Option
		// op runs between the writes k0..k39 and "after"; it returns the
		// keys that must be there (with value "v") and those that must not.
		op func(t *testing.T, c *storetest.Cluster) (have, gone []string)
	}{
		"user restore": {
			op: func(t *testing.T, c *storetest.Cluster) ([]string, []string) {
				state := storetest.EncodeState(map[string]string{"restored": "v"})
				c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
					return l.Restore(ctx, 0, int64(len(state)), bytes.NewReader(state))
				})
				return []string{"restored"}, []string{"k0", "k39"}
			},
		},
		"user restore of an archive from far ahead": {
			op: func(t *testing.T, c *storetest.Cluster) ([]string, []string) {
				state := storetest.EncodeState(map[string]string{"restored": "v"})
				c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
					return l.Restore(ctx, 5_000_000, int64(len(state)), bytes.NewReader(state))
				})
				return []string{"restored"}, []string{"k0"}
			},
		},
		"snapshot install on a lagging follower": {
			opts: []storetest.Option{storetest.WithConfig(func(_ int, cfg *store.Config) {
				cfg.TrailingLogs, cfg.SnapshotThreshold = 5, 10
			})},
			op: func(t *testing.T, c *storetest.Cluster) ([]string, []string) {
				f := c.Index(c.Followers()[0])
				c.Stop(f)
				for i := range 30 {
					c.Apply(t, storetest.Set(fmt.Sprint("lag", i), "v"))
				}
				snapshot(t, c)
				c.Restart(f)
				waitValue(t, c, f, "lag29", "v")
				return []string{"k0", "k39", "lag29"}, nil
			},
		},
		"compaction after automatic snapshots": {
			opts: []storetest.Option{storetest.WithConfig(func(_ int, cfg *store.Config) {
				cfg.TrailingLogs, cfg.SnapshotThreshold, cfg.SnapshotInterval = 3, 8, 20*time.Millisecond
			})},
			op: func(t *testing.T, c *storetest.Cluster) ([]string, []string) {
				for i := range 60 {
					c.Apply(t, storetest.Set(fmt.Sprint("more", i), "v"))
				}
				storetest.WaitFor(t, waitTimeout, "a snapshot on every node", func() bool {
					for i := range c.N() {
						if n, _ := filepath.Glob(filepath.Join(c.DataDir(i), "raft", "snapshots", "*", "meta.json")); len(n) == 0 {
							return false
						}
					}
					return true
				})
				return []string{"k0", "more59"}, nil
			},
		},
	}
	for _, logStore := range logStores {
		for name, tc := range ops {
			t.Run(logStore+"/"+name, func(t *testing.T) {
				restartAfter(t, name, storetest.NewCluster(t, 3, storetest.NewKVFSM, append(tc.opts, withLogStore(logStore))...), tc.op)
			})
		}
	}
}

// restartAfter is one case of TestRestartAfterLogOperations.
func restartAfter(t *testing.T, name string, c *storetest.Cluster, op func(t *testing.T, c *storetest.Cluster) (have, gone []string)) {
	c.WaitLeader(t, leaderTimeout)
	for i := range 40 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	have, gone := op(t, c)
	c.Apply(t, storetest.Set("after", "v"))
	have = append(have, "after")
	check := func(nodes ...int) {
		t.Helper()
		for _, i := range nodes {
			for _, k := range have {
				waitValue(t, c, i, k, "v")
			}
			for _, k := range gone {
				if _, ok := kv(c, i).Get(k); ok {
					t.Errorf("node %d has %s, which the operation removed", i, k)
				}
			}
		}
	}
	check(0, 1, 2)

	// Every node stops; every node starts again from its data dir.
	for i := range c.N() {
		c.Stop(i)
	}
	for i := range c.N() {
		c.Restart(i)
	}
	c.WaitLeader(t, leaderTimeout)
	c.Apply(t, storetest.Set("restarted", "v"))
	have = append(have, "restarted")
	check(0, 1, 2)

	// The offline recovery of that data dir: node 0 alone.
	for i := range c.N() {
		c.Stop(i)
	}
	cfg := storetest.TestConfig()
	cfg.NodeID, cfg.DataDir, cfg.FSM = c.ID(0), c.DataDir(0), storetest.NewKV()
	if err := store.RecoverCluster(cfg, []store.Server{{ID: c.ID(0), Address: c.Addr(0), Voter: true}}); err != nil {
		t.Fatalf("RecoverCluster after %s: %v", name, err)
	}
	s := c.Restart(0)
	if l := c.WaitLeader(t, leaderTimeout); l != s {
		t.Fatalf("leader = %s, want the recovered %s", l.ID(), s.ID())
	}
	c.Apply(t, storetest.Set("recovered", "v"))
	have = append(have, "recovered")
	check(0)
}

// TestRecoverRefusesDamage: the offline recovery refuses a damaged log
// with the same error as a start.
func TestRecoverRefusesDamage(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM, withLogStore(store.LogStoreBoltDB))
	c.WaitLeader(t, leaderTimeout)
	for i := range 20 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	c.Stop(0)
	path := filepath.Join(c.DataDir(0), "raft", "raft.db")
	var gap uint64
	storetest.EditLog(t, c.DataDir(0), func(b *bbolt.Bucket, last uint64) error {
		gap = last - 2
		return b.Delete(storetest.LogKey(gap))
	})
	cfg := storetest.TestConfig()
	cfg.NodeID, cfg.DataDir, cfg.FSM = c.ID(0), c.DataDir(0), storetest.NewKV()
	err := store.RecoverCluster(cfg, []store.Server{{ID: c.ID(0), Address: c.Addr(0), Voter: true}})
	if !errors.Is(err, store.ErrCorruptLog) || !strings.Contains(err.Error(), fmt.Sprintf("entry %d of", gap)) || !strings.Contains(err.Error(), path) {
		t.Fatalf("RecoverCluster on a log with entry %d missing = %v, want ErrCorruptLog naming %s and the entry", gap, err, path)
	}
}

// logStores are the log stores every test of a data dir's life runs on.
var logStores = []string{store.LogStoreWAL, store.LogStoreBoltDB}

// withLogStore gives every node of a cluster the log store kind.
func withLogStore(kind string) storetest.Option {
	return storetest.WithConfig(func(_ int, cfg *store.Config) { cfg.LogStore = kind })
}

// startAgain starts stopped node i of c outside the cluster, on its data
// dir, and returns the store or New's error.
func startAgain(t *testing.T, c *storetest.Cluster, i int) (*store.Store, error) {
	t.Helper()
	return startWith(t, c, i, nil)
}

// startWith is startAgain with the config changed by mod.
func startWith(t *testing.T, c *storetest.Cluster, i int, mod func(*store.Config)) (*store.Store, error) {
	t.Helper()
	cfg := storetest.TestConfig()
	cfg.NodeID, cfg.DataDir, cfg.FSM = c.ID(i), c.DataDir(i), storetest.NewKV()
	if mod != nil {
		mod(&cfg)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil) // closed by New on failure
	s, err := store.New(cfg)
	if err == nil {
		t.Cleanup(func() { s.Close() })
	}
	return s, err
}
