package e2e_test

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/lincheck"
)

// TestFaults runs lincheck's clients (register, deregister and consistent
// get on a few instances, each write with its own client ID and sequence)
// through three real agents while faults hit them one after the other,
// each healed before the next:
//
//  1. the leader SIGSTOPped past the election timeout, then SIGCONTed;
//  2. the leader SIGKILLed during writes, then restarted;
//  3. a follower SIGKILLed during writes, then restarted;
//  4. a follower's data dir full (a tmpfs the test mounts and fills), then
//     space freed (skipped where mounting is not allowed, never in CI).
//
// After every fault the cluster must heal on its own (one leader, every
// node answering consistent reads); at the end final reads through every
// node and porcupine's check of the whole history must pass.
func TestFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("faults real processes")
	}
	bins := buildBinaries(t)
	// WAL segments that a data dir copied onto the 64 MiB tmpfs of the
	// full-disk fault leave room in: a segment is preallocated whole.
	c := startClusterWith(t, bins, "cluster:\n  raft:\n    wal_segment_size_mb: 4\n")
	r := startLinRun(t, c, "faults")
	r.pause(3 * time.Second)

	// 1. A paused leader.
	l := r.leader()
	r.event("SIGSTOP leader %s", l.name)
	if err := l.proc.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	c.eventually(t, 60*time.Second, "a new leader while "+l.name+" is stopped", func() error {
		next, err := c.agreedLeader(t, c.others(l)...)
		if err == nil && next.Name == l.name {
			return errors.New("the stopped node is still named leader")
		}
		return err
	})
	r.event("new leader elected; SIGCONT %s", l.name)
	r.pause(2 * time.Second)
	if err := l.proc.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	r.healed("a stopped leader")

	// 2, 3. Killed during writes: the leader, then a follower.
	for _, pick := range []struct {
		what string
		node func() *node
	}{{"the leader", func() *node { return r.leader() }}, {"a follower", r.follower}} {
		r.pause(2 * time.Second)
		n := pick.node()
		r.event("SIGKILL %s %s", pick.what, n.name)
		c.kill(t, n)
		r.pause(2 * time.Second)
		c.restart(t, n)
		r.event("restarted %s", n.name)
		r.healed("killing " + pick.what)
	}

	// 4. A follower's disk full.
	if f, ok := fullDisk(t, c, r.follower(), r.hist); ok {
		c.eventually(t, 30*time.Second, f.name+" meeting its full disk", func() error {
			b, err := os.ReadFile(f.log)
			if err != nil {
				return err
			}
			if !bytes.Contains(b, []byte("no space left on device")) {
				return errors.New("no write refused yet")
			}
			return nil
		})
		r.pause(3 * time.Second)
		if err := os.Remove(filepath.Join(f.dataDir, "filler")); err != nil {
			t.Fatal(err)
		}
		r.event("space freed on %s", f.name)
		r.healed("a full disk")
	}
	r.finish()
}

// fullDisk moves n's data dir onto a 64 MiB tmpfs the test mounts (n is
// stopped and restarted for it) and fills it. A WAL's next segment then
// cannot be created; the preallocated tail segment still takes entries
// until it is full. It returns false where the
// test may not mount (not root, no CI).
func fullDisk(t *testing.T, c *cluster, n *node, hist *lincheck.History) (*node, bool) {
	t.Helper()
	probe := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe).CombinedOutput(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("mount a tmpfs for the full-disk fault: %v: %s", err, out)
		}
		t.Logf("full-disk fault skipped: cannot mount a tmpfs: %v: %s", err, out)
		return nil, false
	}
	_ = exec.Command("umount", probe).Run()
	c.stop(t, n)
	orig := n.dataDir + ".orig"
	if err := os.Rename(n.dataDir, orig); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(n.dataDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", n.dataDir).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v: %s", err, out)
	}
	// Lazy: the agent may still hold files when the cleanup runs.
	t.Cleanup(func() { _ = exec.Command("umount", "-l", n.dataDir).Run() })
	if out, err := exec.Command("cp", "-a", orig+"/.", n.dataDir+"/").CombinedOutput(); err != nil {
		t.Fatalf("copy the data dir: %v: %s", err, out)
	}
	c.restart(t, n)
	hist.Event(t, "%s restarted on a 64 MiB tmpfs", n.name)
	// Fill it.
	f, err := os.Create(filepath.Join(n.dataDir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for i := 0; i < 128; i++ {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill: %v", err)
			}
			break
		}
	}
	_ = f.Close()
	hist.Event(t, "data dir of %s full", n.name)
	return n, true
}
