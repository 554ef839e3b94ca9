package store

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	wal "github.com/hashicorp/raft-wal"
)

// fuzzTemplates are a raft directory per log store, each holding the same
// 1,500 entries (several WAL segments), built once per process.
var fuzzTemplates = sync.OnceValues(func() (map[string]string, error) {
	root, err := os.MkdirTemp("", "store-fuzz-")
	if err != nil {
		return nil, err
	}
	fuzzRoot = root
	logs := make([]*raft.Log, 1500)
	for i := range logs {
		logs[i] = &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: fmt.Appendf(nil, "entry %d %0800d", i+1, i)}
	}
	out := map[string]string{}
	for _, kind := range []string{LogStoreWAL, LogStoreBoltDB} {
		dir := filepath.Join(root, kind)
		if err := os.MkdirAll(filepath.Join(dir, walDir), 0o700); err != nil {
			return nil, err
		}
		var ls interface {
			raft.LogStore
			Close() error
		}
		if kind == LogStoreWAL {
			ls, err = wal.Open(filepath.Join(dir, walDir), wal.WithSegmentSize(minWALSegmentSize), wal.WithLogger(newHCLogAdapter(nil)))
		} else {
			os.Remove(filepath.Join(dir, walDir))
			ls, err = raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, boltFile)})
		}
		if err != nil {
			return nil, err
		}
		for i := 0; i < len(logs); i += 100 {
			if err := ls.StoreLogs(logs[i : i+100]); err != nil {
				return nil, err
			}
		}
		if err := ls.Close(); err != nil {
			return nil, err
		}
		out[kind] = dir
	}
	return out, nil
})

// fuzzRoot holds the templates once built; FuzzDamagedLog removes it.
var fuzzRoot string

// FuzzDamagedLog overwrites bytes of a log file — a WAL segment or its
// metadata, or raft.db — at an offset and opens the stores as a start
// does: whatever the damage, the open returns (never panics), and a log it
// accepts reads back every entry from its first to its last index under
// its own index, as Raft will read them.
func FuzzDamagedLog(f *testing.F) {
	f.Add(false, uint8(0), uint32(4096), []byte{0xa5, 0xa5, 0xa5, 0xa5})
	f.Add(true, uint8(1), uint32(40), []byte{0xff})
	f.Add(false, uint8(2), uint32(0), make([]byte, 64))
	f.Add(true, uint8(0), uint32(100000), []byte("garbage"))
	f.Cleanup(func() {
		if fuzzRoot != "" {
			os.RemoveAll(fuzzRoot)
		}
	})
	f.Fuzz(func(t *testing.T, bolt bool, file uint8, offset uint32, data []byte) {
		templates, err := fuzzTemplates()
		if err != nil {
			t.Fatal(err)
		}
		kind := LogStoreWAL
		if bolt {
			kind = LogStoreBoltDB
		}
		dir := filepath.Join(t.TempDir(), "raft")
		if out, err := exec.Command("cp", "-a", templates[kind], dir).CombinedOutput(); err != nil {
			t.Fatalf("copy the template: %v: %s", err, out)
		}
		var files []string
		if bolt {
			files = []string{filepath.Join(dir, boltFile)}
		} else {
			files, _ = filepath.Glob(filepath.Join(dir, walDir, "*"))
		}
		if len(files) == 0 {
			t.Fatal("no files in the template")
		}
		target := files[int(file)%len(files)]
		fh, err := os.OpenFile(target, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := fh.Stat()
		if st.Size() > 0 {
			if _, err := fh.WriteAt(data, int64(offset)%st.Size()); err != nil {
				t.Fatal(err)
			}
		}
		fh.Close()

		cfg := DefaultConfig()
		cfg.LogCacheSize, cfg.LogVerificationInterval = 0, 0
		stores, err := openStores(cfg, dir, newHCLogAdapter(nil), slog.New(slog.DiscardHandler))
		if err != nil {
			return // refused: fine, as long as it returned
		}
		defer stores.Close()
		if stores.choice.Kind != kind {
			t.Fatalf("opened as %s, built as %s", stores.choice.Kind, kind)
		}
		first, err1 := stores.logs.FirstIndex()
		last, err2 := stores.logs.LastIndex()
		if err := errors.Join(err1, err2); err != nil {
			t.Fatalf("accepted log: indexes: %v", err)
		}
		var l raft.Log
		for i := first; i <= last && last > 0; i++ {
			if err := stores.logs.GetLog(i, &l); err != nil || l.Index != i {
				t.Fatalf("accepted log %d..%d: entry %d: index %d, %v", first, last, i, l.Index, err)
			}
		}
	})
}
