package store_test

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// refuseNewer is a SnapshotCheck that refuses the snapshots whose data
// starts with "NEWER" (a newer release's, for these tests).
func refuseNewer(r io.Reader) error {
	var b [5]byte
	n, err := io.ReadFull(r, b[:])
	switch {
	case n < len(b) && string(b[:n]) == "NEWER"[:n]:
		return io.ErrUnexpectedEOF
	case string(b[:]) == "NEWER":
		return fmt.Errorf("%w: written by release 9.9", store.ErrNewerData)
	case err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF):
		return err
	}
	return nil
}

// dirSums hashes every file under dir.
func dirSums(t *testing.T, dir string) map[string][32]byte {
	t.Helper()
	out := map[string][32]byte{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		out[path] = sha256.Sum256(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestNewerSnapshotRefusedAtStart: a data dir whose newest snapshot a newer
// release wrote (a downgrade without its preparation) is refused at start
// with ErrNewerData, and not one of its files changes, raft.db included.
func TestNewerSnapshotRefusedAtStart(t *testing.T) {
	for _, kind := range logStores {
		t.Run(kind, func(t *testing.T) {
			c := storetest.NewCluster(t, 1, storetest.NewKVFSM, withLogStore(kind))
			c.WaitLeader(t, 10*time.Second)
			for i := range 50 {
				c.Apply(t, storetest.Set("k", strings.Repeat("v", i)))
			}
			c.Stop(0)
			dir := filepath.Join(c.DataDir(0), "raft")
			snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, 2, hclog.NewNullLogger())
			if err != nil {
				t.Fatal(err)
			}
			sink, err := snaps.Create(raft.SnapshotVersionMax, 1000, 5, raft.Configuration{}, 1, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sink.Write([]byte("NEWER state")); err != nil {
				t.Fatal(err)
			}
			if err := sink.Close(); err != nil {
				t.Fatal(err)
			}
			before := dirSums(t, dir)
			for range 2 {
				_, err = startWith(t, c, 0, func(cfg *store.Config) { cfg.SnapshotCheck = refuseNewer; cfg.LogStore = kind })
				if !errors.Is(err, store.ErrNewerData) || !strings.Contains(err.Error(), "9.9") {
					t.Fatalf("start = %v, want %v naming the release", err, store.ErrNewerData)
				}
			}
			after := dirSums(t, dir)
			for path, sum := range before {
				if after[path] != sum {
					t.Errorf("%s changed during the refused starts", path)
				}
			}
			for path := range after {
				if _, ok := before[path]; !ok {
					t.Errorf("%s was created during the refused starts", path)
				}
			}
		})
	}
}

// TestSnapshotSinkRefusesNewer: a snapshot the check refuses (as a leader
// of a newer release sends it) is not kept, and the snapshots the node
// holds stay; one whose header arrives a byte at a time is kept whole.
func TestSnapshotSinkRefusesNewer(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) {
		cfg.SnapshotCheck = refuseNewer
	}))
	s := c.WaitLeader(t, 10*time.Second)
	c.Apply(t, storetest.Set("k", "v"))
	_, rc, err := s.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	rc.Close()
	held, err := store.SnapshotIDs(s)
	if err != nil {
		t.Fatal(err)
	}
	if len(held) != 1 {
		t.Fatalf("%d snapshots after one was taken", len(held))
	}
	for _, tc := range []struct {
		data      string
		kept      bool
		wantNewer bool
	}{{"NEWER state", false, true}, {"OLDER state", true, false}, {"NEW", false, false}} {
		sink, err := store.CreateCheckedSnapshot(s, refuseNewer, 1000)
		if err != nil {
			t.Fatal(err)
		}
		var werr error
		for _, b := range []byte(tc.data) { // the header a byte at a time
			if _, werr = sink.Write([]byte{b}); werr != nil {
				break
			}
		}
		if werr == nil {
			werr = sink.Close()
		} else {
			_ = sink.Cancel()
		}
		if (werr == nil) != tc.kept || errors.Is(werr, store.ErrNewerData) != tc.wantNewer {
			t.Errorf("%q: %v; want kept %v, a newer release's %v", tc.data, werr, tc.kept, tc.wantNewer)
		}
	}
	ids, err := store.SnapshotIDs(s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains([]byte(strings.Join(ids, ",")), []byte(held[0])) {
		t.Errorf("snapshots %v: the one held before (%s) is gone", ids, held[0])
	}
}

// TestDropOlderSnapshots: the kept snapshots that rank below the newest are
// removed, those that rank as high stay, the newest always stays.
func TestDropOlderSnapshots(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
	s := c.WaitLeader(t, 10*time.Second)
	for i := range 2 {
		c.Apply(t, storetest.Set(fmt.Sprintf("k%d", i), strings.Repeat("v", 100*(i+1))))
		_, rc, err := s.Snapshot(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		rc.Close()
	}
	held, err := store.SnapshotIDs(s)
	if err != nil || len(held) != 2 {
		t.Fatalf("snapshots %v, %v; want 2", held, err)
	}
	same := func(io.Reader) (int64, error) { return 1, nil }
	if newest, dropped, err := s.DropOlderSnapshots(same); err != nil || len(dropped) != 0 || newest != 1 {
		t.Fatalf("equal ranks: dropped %v (newest %d), %v; want none", dropped, newest, err)
	}
	bySize := func(r io.Reader) (int64, error) { return io.Copy(io.Discard, r) }
	_, dropped, err := s.DropOlderSnapshots(bySize)
	if err != nil || len(dropped) != 1 || dropped[0] != held[1] {
		t.Fatalf("dropped %v, %v; want the older snapshot %s", dropped, err, held[1])
	}
	if left, _ := store.SnapshotIDs(s); len(left) != 1 || left[0] != held[0] {
		t.Fatalf("left %v, want the newest %s only", left, held[0])
	}
	if id, err := s.NewestSnapshotID(); err != nil || id != held[0] {
		t.Fatalf("newest %q, %v; want %s", id, err, held[0])
	}
}

// TestSnapshotIndexRepaired: when the newest stored snapshot is above
// raft's record of its last one (a snapshot that ended after a restore,
// hashicorp/raft#248 — a leader then sends followers that snapshot
// forever), the store takes a snapshot that records an index at or above
// it again.
func TestSnapshotIndexRepaired(t *testing.T) {
	defer store.SetSnapshotIndexCheck(20 * time.Millisecond)()
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
	s := c.WaitLeader(t, 10*time.Second)
	c.Apply(t, storetest.Set("a", "1"))
	_, data := snapshotBytes(t, s)
	recorded := store.RecordedSnapshotIndex(s)
	_, applied := c.Apply(t, storetest.Set("b", "2"))
	if err := store.StoreSnapshotAt(s, applied, data); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for store.RecordedSnapshotIndex(s) < applied {
		if time.Now().After(deadline) {
			t.Fatalf("raft's last snapshot is still recorded at %d (was %d), below the stored %d", store.RecordedSnapshotIndex(s), recorded, applied)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestFollowerWithAnEntryAboveItsSnapshotCatchesUp: a follower that holds
// the leader's snapshot at S and, above it, an entry of an older term that
// was never committed (S itself not in its log) — as a lagging follower is
// left by a snapshot install, an entry from a leader that then died, and a
// SIGKILL — catches up: it takes S as the leader's previous entry (the
// snapshot's term) and truncates the conflicting entry, instead of
// refusing every AppendEntries and being sent the snapshot forever.
func TestFollowerWithAnEntryAboveItsSnapshotCatchesUp(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) {
		cfg.LogStore = store.LogStoreBoltDB
		cfg.TrailingLogs = 2
	}))
	leader := c.WaitLeader(t, 10*time.Second)
	for i := range 5 {
		c.Apply(t, storetest.Set(fmt.Sprint("a", i), "v"))
	}
	v := c.Index(c.Followers()[0])
	c.Stop(v)
	for i := range 10 {
		c.Apply(t, storetest.Set(fmt.Sprint("b", i), "v"))
	}
	meta, data := snapshotBytes(t, leader)
	servers, err := leader.Servers(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var conf raft.Configuration
	for _, s := range servers {
		conf.Servers = append(conf.Servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(s.ID), Address: raft.ServerAddress(s.Address)})
	}
	for i := range 3 {
		c.Apply(t, storetest.Set(fmt.Sprint("c", i), "v"))
	}

	// The stopped follower's data dir: the snapshot at S, and in its log
	// one entry at S+1 of term 1, which the leader (a later term) does not
	// hold.
	dir := filepath.Join(c.DataDir(v), "raft")
	snaps, err := raft.NewFileSnapshotStore(dir, 3, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("")
	sink, err := snaps.Create(raft.SnapshotVersionMax, meta.Index, meta.Term, conf, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	bolt, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, "raft.db")})
	if err != nil {
		t.Fatal(err)
	}
	first, _ := bolt.FirstIndex()
	last, _ := bolt.LastIndex()
	if last > 0 {
		if err := bolt.DeleteRange(first, last); err != nil {
			t.Fatal(err)
		}
	}
	if err := bolt.StoreLog(&raft.Log{Index: meta.Index + 1, Term: 1, Type: raft.LogNoop}); err != nil {
		t.Fatal(err)
	}
	if err := bolt.Close(); err != nil {
		t.Fatal(err)
	}

	follower := c.Restart(v)
	_, want := c.Apply(t, storetest.Set("d", "v"))
	deadline := time.Now().Add(15 * time.Second)
	for follower.Status().AppliedIndex < want {
		if time.Now().After(deadline) {
			t.Fatalf("the follower applied %d after 15s, want %d (it is sent the snapshot again and again)", follower.Status().AppliedIndex, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// snapshotBytes takes a snapshot of s and reads it whole.
func snapshotBytes(t *testing.T, s *store.Store) (store.SnapshotMeta, []byte) {
	t.Helper()
	meta, rc, err := s.Snapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return meta, data
}
