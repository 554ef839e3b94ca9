package store

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/hashicorp/raft"
)

// mountTmpfs mounts a tmpfs of size on a new directory, or skips the test
// where mounting is not allowed (it must run in CI, which runs as root).
func mountTmpfs(t *testing.T, size string) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("mount a tmpfs: %v: %s", err, out)
		}
		t.Skipf("cannot mount a tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() })
	return dir
}

// fill writes a file into dir until the file system refuses more.
func fill(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for range 1 << 14 {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill: %v", err)
			}
			return path
		}
	}
	t.Fatal("fill: the file system never ran out of space")
	return ""
}

// The Raft log on a full disk refuses appends with the disk's error and
// takes them again, with everything written before intact, once space is
// back (a follower whose data dir filled up catches up).
func TestLogStoreFullDisk(t *testing.T) {
	dir := mountTmpfs(t, "8m")
	cfg := DefaultConfig()
	bolt, logs, _, err := openStores(cfg, dir, newHCLogAdapter(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer bolt.Close()

	data := bytes.Repeat([]byte("x"), 1024)
	next := uint64(1)
	appendBatch := func(n int) error {
		batch := make([]*raft.Log, n)
		for i := range batch {
			batch[i] = &raft.Log{Index: next + uint64(i), Term: 1, Type: raft.LogCommand, Data: data}
		}
		if err := logs.StoreLogs(batch); err != nil {
			return err
		}
		next += uint64(n)
		return nil
	}
	for range 20 {
		if err := appendBatch(16); err != nil {
			t.Fatal(err)
		}
	}
	filler := fill(t, dir)

	// Appends fail once the file must grow; a few rounds make sure the
	// failures are met, in bbolt's commit and in its file growth.
	var failed error
	for range 64 {
		if err := appendBatch(64); err != nil {
			failed = err
			break
		}
	}
	// (raft's log cache quotes the error rather than wrapping it)
	if failed == nil || !strings.Contains(failed.Error(), syscall.ENOSPC.Error()) {
		t.Fatalf("appends on a full disk: %v, want %v", failed, syscall.ENOSPC)
	}
	for range 3 {
		if err := appendBatch(64); err == nil {
			t.Fatal("an append succeeded on the full disk")
		}
	}
	if err := bolt.SetUint64([]byte("CurrentTerm"), 2); err != nil && !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("term write on a full disk: %v", err)
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := appendBatch(64); err != nil {
			t.Fatalf("append %d after space came back: %v", i, err)
		}
	}
	if err := bolt.SetUint64([]byte("CurrentTerm"), 3); err != nil {
		t.Fatal(err)
	}
	check := func(what string, s raft.LogStore) {
		t.Helper()
		first, _ := s.FirstIndex()
		last, err := s.LastIndex()
		if err != nil || first != 1 || last != next-1 {
			t.Fatalf("%s: log %d..%d (%v), want 1..%d", what, first, last, err, next-1)
		}
		for i := uint64(1); i < next; i++ {
			var l raft.Log
			if err := s.GetLog(i, &l); err != nil || l.Index != i || !bytes.Equal(l.Data, data) {
				t.Fatalf("%s: entry %d: %v (index %d, %d bytes)", what, i, err, l.Index, len(l.Data))
			}
		}
	}
	check("after space came back", logs)

	// And the file is sound: it opens again and passes the integrity checks.
	if err := bolt.Close(); err != nil {
		t.Fatal(err)
	}
	bolt2, logs2, _, err := openStores(cfg, dir, newHCLogAdapter(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatalf("reopen after a full disk: %v", err)
	}
	defer bolt2.Close()
	check("reopened", logs2)
	if v, err := bolt2.GetUint64([]byte("CurrentTerm")); err != nil || v != 3 {
		t.Fatal(fmt.Errorf("term after reopen: %d, %v", v, err))
	}
}
