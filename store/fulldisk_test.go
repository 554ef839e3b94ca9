package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// mountTmpfs mounts a tmpfs of size on a new directory, or skips the test
// where mounting is not allowed (CI runs as root and must not skip).
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

// A follower whose disk fills up rejects the entries it cannot store and
// takes them once space is back, each time, and its data dir opens again
// with everything in it. Replication is pipelined: raft's own pipeline
// stopped sending entries to such a follower for good after a rejection
// (hashicorp/raft#612), the store's transport ends it instead
// (endingPipelines); the episodes repeat to meet that race.
func TestFollowerOnAFullDiskCatchesUp(t *testing.T) {
	for _, kind := range logStores {
		t.Run(kind, func(t *testing.T) { followerOnAFullDisk(t, kind) })
	}
}

func followerOnAFullDisk(t *testing.T, logStore string) {
	dirs := make([]string, 3)
	for i := range dirs {
		dirs[i] = mountTmpfs(t, "64m")
	}
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM, storetest.WithConfig(func(i int, cfg *store.Config) {
		cfg.DataDir = filepath.Join(dirs[i], "raft")
		cfg.LogStore = logStore
		// Segments smaller than the 2 MiB an episode writes: a WAL
		// preallocates each, so only a new segment meets the full disk.
		cfg.WALSegmentSize = 1 << 20
		// No election while the follower's disk is full: a term it cannot
		// persist stops Raft (by design), which is not what is tested.
		cfg.HeartbeatTimeout = time.Second
		cfg.ElectionTimeout = time.Second
		cfg.LeaderLeaseTimeout = 500 * time.Millisecond
	}))
	c.WaitLeader(t, leaderTimeout)
	fi := c.Index(c.Followers()[0])
	value := strings.Repeat("v", 1024)

	const episodes = 5
	for ep := range episodes {
		filler := fill(t, dirs[fi])
		// 2 MiB of entries: more than the follower's bbolt file has room
		// for without growing, or its WAL segment.
		leader := c.WaitLeader(t, leaderTimeout)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := range 8 {
			wg.Go(func() {
				for k := w; k < 2048; k += 8 {
					ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
					_, _, err := leader.Apply(ctx, storetest.Set(fmt.Sprintf("k%d", k), value))
					cancel()
					if err != nil {
						errs <- fmt.Errorf("episode %d: write k%d: %w", ep, k, err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if st := c.Store(fi).Status(); st.LastIndex >= leader.Status().LastIndex {
			t.Fatalf("episode %d: the follower stored every entry on a full disk (last index %d)", ep, st.LastIndex)
		}
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
		c.Apply(t, storetest.Set("episode", strconv.Itoa(ep)))
		// Up to raft's longest retry backoff (10 s) after the rejections.
		storetest.WaitFor(t, 30*time.Second, fmt.Sprintf("episode %d: the follower catching up once space is back", ep), func() bool {
			got, ok := kv(c, fi).Get("episode")
			return ok && got == strconv.Itoa(ep)
		})
	}

	// The follower's data dir is sound: it passes the integrity checks of
	// a restart and holds everything.
	c.Stop(fi)
	c.Restart(fi)
	waitValue(t, c, fi, "episode", strconv.Itoa(episodes-1))
	waitValue(t, c, fi, "k2047", value)
}
