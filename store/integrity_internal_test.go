package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	wal "github.com/hashicorp/raft-wal"
	"go.etcd.io/bbolt"
)

// logShape is a Raft data dir as Raft (or damage) can leave it: the log
// entries present, the snapshots, and what was done to them afterwards.
type logShape struct {
	// runs are the stored log indexes, first to last inclusive.
	runs []span
	// snaps are the indexes of the snapshots, oldest first.
	snaps []uint64
	// damage, when set, changes the files once written.
	damage func(t *testing.T, dir string)
	// want is "" for a log Raft can start from, else a part of the error.
	want string
	// wal stores the runs (one run at most) in a WAL instead of raft.db.
	wal bool
}

// TestLogShapes builds every shape of log the start-up check must accept
// (what Raft itself leaves behind) and every damaged one it must refuse,
// and checks the verdict. See DESIGN.md, "Damaged files".
func TestLogShapes(t *testing.T) {
	shapes := map[string]logShape{
		// Accepted.
		"contiguous, no snapshot": {runs: []span{{1, 100}}},
		"compacted: first index moved up to the snapshot": {
			runs: []span{{61, 120}}, snaps: []uint64{60},
		},
		"compacted: a snapshot older than the trailing entries": {
			runs: []span{{41, 120}}, snaps: []uint64{60},
		},
		"crash between a snapshot and the compaction": {
			runs: []span{{1, 100}}, snaps: []uint64{80},
		},
		"user restore on the leader: the snapshot's index is a hole": {
			runs: []span{{1, 100}, {102, 110}}, snaps: []uint64{101},
		},
		"user restore of an archive from a cluster far ahead": {
			runs: []span{{1, 10}, {10_000_001, 10_000_005}}, snaps: []uint64{10_000_000},
		},
		"install snapshot on a lagging follower, old entries kept": {
			runs: []span{{1, 20}, {501, 510}}, snaps: []uint64{500},
		},
		"install snapshot after a compaction of the old entries": {
			runs: []span{{15, 20}, {501, 510}}, snaps: []uint64{10, 500},
		},
		"restore, then install snapshot, then compaction": {
			runs: []span{{300, 400}, {402, 450}, {701, 720}}, snaps: []uint64{401, 700},
		},
		"snapshot beyond the whole log":                 {runs: []span{{1, 50}}, snaps: []uint64{100}},
		"no log at all after recovery, only a snapshot": {snaps: []uint64{90}},
		"newest snapshot damaged, the older one covers the log": {
			runs: []span{{41, 120}}, snaps: []uint64{50, 100},
			damage: func(t *testing.T, dir string) { garbleSnapshot(t, dir, 100) },
		},

		"wal: contiguous, no snapshot":                {runs: []span{{1, 100}}, wal: true},
		"wal: compacted, the snapshot inside the log": {runs: []span{{41, 120}}, snaps: []uint64{60}, wal: true},
		"wal: crash after a restore's snapshot, before the log was removed": {
			runs: []span{{1, 100}}, snaps: []uint64{101}, wal: true,
		},
		"wal: crash after a snapshot install from far ahead": {
			runs: []span{{1, 100}}, snaps: []uint64{5000}, wal: true,
		},

		// Refused.
		"wal: first index above the snapshot": {
			runs: []span{{70, 100}}, snaps: []uint64{50}, wal: true,
			want: "entry 51 of 70..100: log not found",
		},
		"a gap above the newest snapshot": {
			runs: []span{{1, 89}, {91, 100}}, snaps: []uint64{50},
			want: "entry 90 of 1..100: log not found",
		},
		"a gap and no snapshot": {
			runs: []span{{1, 49}, {51, 100}},
			want: "entry 50 of 1..100: log not found",
		},
		"a gap that starts below the snapshot and ends above it": {
			runs: []span{{1, 40}, {61, 100}}, snaps: []uint64{50},
			want: "entry 51 of 1..100: log not found",
		},
		"first index above the snapshot": {
			runs: []span{{70, 100}}, snaps: []uint64{50},
			want: "entry 51 of 70..100: log not found",
		},
		"first index above 1 and no snapshot": {
			runs: []span{{5, 100}},
			want: "entry 1 of 5..100: log not found",
		},
		"an entry that does not decode, above the snapshot": {
			runs: []span{{1, 100}}, snaps: []uint64{50},
			damage: func(t *testing.T, dir string) { putRaw(t, dir, 77, []byte{0xc1, 0xff, 0x00, 0x13}) },
			want:   "entry 77 of 1..100",
		},
		"an entry that does not decode, below the snapshot": {
			runs: []span{{1, 100}}, snaps: []uint64{50},
			damage: func(t *testing.T, dir string) { putRaw(t, dir, 10, []byte{0xc1, 0xff}) },
			want:   "entry 10 of 1..100",
		},
		"an entry stored under the wrong index": {
			runs: []span{{1, 100}}, snaps: []uint64{50},
			damage: func(t *testing.T, dir string) { moveEntry(t, dir, 43, 42) },
			want:   "entry stored under 42 holds index 43",
		},
		"a key of the log that is no index": {
			runs: []span{{1, 10}},
			damage: func(t *testing.T, dir string) {
				withBolt(t, dir, func(b *bbolt.Bucket) error { return b.Put([]byte("bad"), []byte{1}) })
			},
			want: `key 626164 of the log is not an 8-byte index`,
		},
		"newest snapshot damaged, the older one leaves a gap": {
			runs: []span{{41, 50}, {101, 120}}, snaps: []uint64{50, 100},
			damage: func(t *testing.T, dir string) { garbleSnapshot(t, dir, 100) },
			want:   "entry 51 of 41..120: log not found",
		},
		"every snapshot damaged": {
			runs: []span{{101, 120}}, snaps: []uint64{100},
			damage: func(t *testing.T, dir string) { garbleSnapshot(t, dir, 100) },
			want:   "no snapshot can be read",
		},
	}
	for name, sh := range shapes {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), raftDir)
			buildShape(t, dir, sh)
			if sh.damage != nil {
				sh.damage(t, dir)
			}
			cfg := DefaultConfig()
			st, err := openStores(cfg, dir, newHCLogAdapter(nil), slog.New(slog.DiscardHandler))
			if err == nil {
				// Raft's next entry after the newest snapshot, or after the
				// log, must be storable.
				next, _ := st.logs.LastIndex()
				if n := len(sh.snaps); n > 0 && sh.snaps[n-1] > next {
					next = sh.snaps[n-1]
				}
				next++
				if err := st.logs.StoreLogs([]*raft.Log{{Index: next, Term: 2, Type: raft.LogCommand, Data: []byte("next")}}); err != nil {
					t.Errorf("the entry after the log and the snapshots (%d) cannot be stored: %v", next, err)
				}
				st.Close()
			}
			path := filepath.Join(dir, boltFile)
			if sh.wal {
				path = filepath.Join(dir, walDir)
			}
			switch {
			case sh.want == "" && err != nil:
				t.Fatalf("refused a log Raft can leave behind: %v", err)
			case sh.want == "":
			case err == nil:
				t.Fatalf("accepted a damaged log; want an error containing %q", sh.want)
			case !errors.Is(err, ErrCorruptLog):
				t.Fatalf("error %v is not ErrCorruptLog", err)
			case !strings.Contains(err.Error(), sh.want):
				t.Fatalf("error %q does not say %q", err, sh.want)
			case !strings.Contains(err.Error(), path) && !strings.Contains(err.Error(), filepath.Join(dir, "snapshots")):
				t.Fatalf("error %q names neither %s nor the snapshot directory", err, path)
			default:
				t.Log(err)
			}
		})
	}
}

// buildShape writes the log entries and snapshots of sh into dir.
func buildShape(t *testing.T, dir string, sh logShape) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	var db interface {
		StoreLogs([]*raft.Log) error
		Close() error
	}
	var err error
	if sh.wal {
		if err := os.MkdirAll(filepath.Join(dir, walDir), 0o700); err != nil {
			t.Fatal(err)
		}
		db, err = wal.Open(filepath.Join(dir, walDir), wal.WithSegmentSize(minWALSegmentSize), wal.WithLogger(newHCLogAdapter(nil)))
	} else {
		db, err = raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, boltFile)})
	}
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, run := range sh.runs {
		var batch []*raft.Log
		for i := run.first; i <= run.last; i++ {
			batch = append(batch, &raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: fmt.Appendf(nil, "entry %d", i)})
		}
		if err := db.StoreLogs(batch); err != nil {
			t.Fatal(err)
		}
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, len(sh.snaps)+1, newHCLogAdapter(nil))
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("n1")
	defer trans.Close()
	conf := raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: "n1", Suffrage: raft.Voter}}}
	for _, idx := range sh.snaps {
		sink, err := snaps.Create(raft.SnapshotVersionMax, idx, 1, conf, 1, trans)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fmt.Fprintf(sink, "state at %d", idx); err != nil {
			t.Fatal(err)
		}
		if err := sink.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// garbleSnapshot changes the data of the snapshot at index, so that its
// checksum fails.
func garbleSnapshot(t *testing.T, dir string, index uint64) {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(dir, "snapshots", fmt.Sprintf("*-%d-*", index), "state.bin"))
	if err != nil || len(matches) != 1 {
		t.Fatalf("snapshot at %d: %v %v", index, matches, err)
	}
	if err := os.WriteFile(matches[0], []byte("garbled"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// withBolt runs f on the logs bucket of the data dir's raft.db.
func withBolt(t *testing.T, dir string, f func(b *bbolt.Bucket) error) {
	t.Helper()
	db, err := bbolt.Open(filepath.Join(dir, boltFile), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bbolt.Tx) error { return f(tx.Bucket([]byte(logsBucket))) }); err != nil {
		t.Fatal(err)
	}
}

func indexKey(i uint64) []byte { return binary.BigEndian.AppendUint64(nil, i) }

// putRaw stores value under log index i.
func putRaw(t *testing.T, dir string, i uint64, value []byte) {
	t.Helper()
	withBolt(t, dir, func(b *bbolt.Bucket) error { return b.Put(indexKey(i), value) })
}

// moveEntry stores the entry of index from under index to as well.
func moveEntry(t *testing.T, dir string, from, to uint64) {
	t.Helper()
	withBolt(t, dir, func(b *bbolt.Bucket) error {
		return b.Put(indexKey(to), append([]byte(nil), b.Get(indexKey(from))...))
	})
}

// A compacted WAL answers ErrLogNotFound below its first index, as raft.db
// does: raft-wal's tail segment would still return those entries, and a
// leader would then replicate compacted entries instead of its snapshot.
func TestCompactedWALForgets(t *testing.T) {
	dir := filepath.Join(t.TempDir(), raftDir)
	buildShape(t, dir, logShape{runs: []span{{1, 100}}, wal: true})
	cfg := DefaultConfig()
	st, err := openStores(cfg, dir, newHCLogAdapter(nil), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.logs.DeleteRange(1, 60); err != nil {
		t.Fatal(err)
	}
	var l raft.Log
	for _, i := range []uint64{1, 30, 60} {
		if err := st.logs.GetLog(i, &l); !errors.Is(err, raft.ErrLogNotFound) {
			t.Errorf("GetLog(%d) after compacting 1..60 = %v (index %d), want ErrLogNotFound", i, err, l.Index)
		}
	}
	if err := st.logs.GetLog(61, &l); err != nil || l.Index != 61 {
		t.Errorf("GetLog(61) = %v (index %d)", err, l.Index)
	}
}
