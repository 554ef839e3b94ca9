package scheduler

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// testTaker returns a SnapshotTaker over a real FSM state with one
// instance; index counts the snapshots taken. fail makes it fail.
func testTaker(t *testing.T, fail *atomic.Bool) (SnapshotTaker, *atomic.Uint64) {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	l := &localLog{fsm: f}
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{
		Instance: &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Node: "n1", Address: "10.0.0.1", Port: 80},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Apply(context.Background(), data); err != nil {
		t.Fatal(err)
	}
	var st bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		t.Fatal(err)
	}
	var n atomic.Uint64
	return func(ctx context.Context) (archive.Meta, io.ReadCloser, error) {
		if fail != nil && fail.Load() {
			return archive.Meta{}, nil, errors.New("injected failure")
		}
		i := n.Add(1)
		return archive.Meta{
			ID: fmt.Sprintf("1-%d-0", i), Index: i, Term: 1, FormatVersion: archive.FormatVersion,
			Size: int64(st.Len()), // the state format comes from the state's preamble
			// Distinct seconds, so that names sort like creation.
			CreatedAt: time.Date(2026, 11, 30, 0, 0, int(i), 0, time.UTC),
		}, io.NopCloser(bytes.NewReader(st.Bytes())), nil
	}, &n
}

func TestWriteArchive(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "backups")
	take, _ := testTaker(t, nil)
	path, size, err := WriteArchive(context.Background(), dir, take, time.Now)
	if err != nil {
		t.Fatalf("WriteArchive: %v", err)
	}
	if want := filepath.Join(dir, "pivirt-snapshot-20261130T000001Z-1.tar.gz"); path != want {
		t.Errorf("path = %s, want %s", path, want)
	}
	st, err := os.Stat(path)
	if err != nil || st.Size() != size || st.Mode().Perm() != 0o600 {
		t.Fatalf("archive file: %v, %v; want %d bytes, mode 0600", st, err, size)
	}
	if err := verifyFile(context.Background(), path); err != nil {
		t.Errorf("the archive does not verify: %v", err)
	}

	// A state that ends early leaves nothing behind.
	short := func(ctx context.Context) (archive.Meta, io.ReadCloser, error) {
		m, rc, err := take(ctx)
		m.Size += 100
		return m, rc, err
	}
	if _, _, err := WriteArchive(context.Background(), dir, short, time.Now); err == nil {
		t.Error("WriteArchive of a short state succeeded")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("dir holds %d files after a failed write, want only the first archive", len(entries))
	}
}

func TestPruneArchives(t *testing.T) {
	dir := t.TempDir()
	touch := func(name string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		touch(fmt.Sprintf("pivirt-snapshot-2026113%dT000000Z-%d.tar.gz", i, i))
	}
	touch("pivirt-snapshot-20261129T000000Z-9.tar.gz.tmp")
	touch("notes.txt")
	if err := PruneArchives(dir, 2); err != nil {
		t.Fatal(err)
	}
	var left []string
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		left = append(left, e.Name())
	}
	want := "notes.txt pivirt-snapshot-20261133T000000Z-3.tar.gz pivirt-snapshot-20261134T000000Z-4.tar.gz"
	if strings.Join(left, " ") != want {
		t.Errorf("left %v, want %s", left, want)
	}
	newest, ok := newestArchive(t.TempDir())
	if ok {
		t.Errorf("newestArchive(empty dir) = %v, true", newest)
	}
}

// TestRunSnapshotter runs the loop with a short interval: archives appear,
// only the newest Retain stay, metrics follow, and failures are counted.
func TestRunSnapshotter(t *testing.T) {
	dir := t.TempDir()
	var fail atomic.Bool
	take, taken := testTaker(t, &fail)
	reg := prometheus.NewRegistry()
	m := NewSnapshotMetrics(reg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		// A timeout of its own: the interval's 10ms would fail a write
		// slowed down by a loaded machine.
		RunSnapshotter(ctx, SnapshotterConfig{Interval: 10 * time.Millisecond, Timeout: 10 * time.Second, Dir: dir, Retain: 2, Metrics: m}, take)
	}()
	defer func() {
		cancel()
		<-done
	}()

	// taken counts the snapshots started; an archive is there once written.
	waitFor(t, "4 archives written", func() bool {
		newest, ok := newestArchive(dir)
		return taken.Load() >= 4 && ok && !newest.Before(time.Date(2026, 11, 30, 0, 0, 4, 0, time.UTC))
	})
	waitFor(t, "old archives pruned", func() bool {
		names, _ := archives(dir)
		return len(names) == 2
	})
	if testutil.ToFloat64(m.LastSuccess) == 0 || testutil.ToFloat64(m.LastBytes) == 0 {
		t.Errorf("success metrics not set: last success %v, bytes %v", testutil.ToFloat64(m.LastSuccess), testutil.ToFloat64(m.LastBytes))
	}

	fail.Store(true)
	waitFor(t, "a failure counted", func() bool { return testutil.ToFloat64(m.Failures) >= 1 })
	if testutil.ToFloat64(m.LastFailure) == 0 {
		t.Error("pivirt_snapshot_last_failure_timestamp_seconds not set")
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 5 {
		t.Errorf("registry holds %d metrics (%v), want 5", n, err)
	}
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
