package e2e_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/lincheck"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
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
	c := startCluster(t, bins)
	hc := c.httpClient(t)
	apis := make([]clusterv1connect.ClusterServiceClient, len(c.nodes))
	for i, n := range c.nodes {
		apis[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
	}

	hist := lincheck.NewHistory()
	stop := make(chan struct{})
	var budget atomic.Int64
	budget.Store(50000)
	var wg sync.WaitGroup
	stopClients := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	defer stopClients()
	seed := rand.Uint64()
	t.Logf("client seed %d", seed)
	for id := range lincheck.Clients {
		cl := lincheck.NewClient(id, fmt.Sprintf("faults-%d-%x", id, seed), rand.New(rand.NewPCG(seed, uint64(id))), apis, hist)
		wg.Go(func() { cl.Run(t.Context(), stop, &budget) })
	}
	pause := func(d time.Duration) {
		select {
		case <-time.After(d):
		case <-t.Context().Done():
		}
	}
	// healed: one leader all agree on, and every node answers a
	// consistent read (it has caught up with the leader).
	healed := func(what string) {
		t.Helper()
		c.eventually(t, 90*time.Second, "healed after "+what, func() error {
			if _, err := c.agreedLeader(t, c.nodes...); err != nil {
				return err
			}
			for i, a := range apis {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err := a.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: lincheck.Service,
					Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
				cancel()
				if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
					return fmt.Errorf("%s: %w", c.nodes[i].name, err)
				}
			}
			return nil
		})
		hist.Event(t, "healed after %s", what)
	}
	leader := func() *node {
		t.Helper()
		var l leaderOut
		c.eventually(t, 60*time.Second, "an agreed leader", func() error {
			var err error
			l, err = c.agreedLeader(t, c.nodes...)
			return err
		})
		return c.byAPI(t, l.APIAddr)
	}
	follower := func() *node {
		l := leader()
		for _, n := range c.nodes {
			if n != l {
				return n
			}
		}
		return nil
	}

	pause(3 * time.Second)

	// 1. A paused leader.
	l := leader()
	hist.Event(t, "SIGSTOP leader %s", l.name)
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
	hist.Event(t, "new leader elected; SIGCONT %s", l.name)
	pause(2 * time.Second)
	if err := l.proc.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	healed("a stopped leader")

	// 2, 3. Killed during writes: the leader, then a follower.
	for _, pick := range []struct {
		what string
		node func() *node
	}{{"the leader", leader}, {"a follower", follower}} {
		pause(2 * time.Second)
		n := pick.node()
		hist.Event(t, "SIGKILL %s %s", pick.what, n.name)
		c.kill(t, n)
		pause(2 * time.Second)
		c.restart(t, n)
		hist.Event(t, "restarted %s", n.name)
		healed("killing " + pick.what)
	}

	// 4. A follower's disk full.
	if f, ok := fullDisk(t, c, follower(), hist); ok {
		c.eventually(t, 30*time.Second, f.name+" meeting its full disk", func() error {
			b, err := os.ReadFile(f.log)
			if err != nil {
				return err
			}
			if n := bytes.Count(b, []byte("no space left on device")); n < 3 {
				return fmt.Errorf("%d writes refused so far", n)
			}
			return nil
		})
		pause(3 * time.Second)
		if err := os.Remove(filepath.Join(f.dataDir, "filler")); err != nil {
			t.Fatal(err)
		}
		hist.Event(t, "space freed on %s", f.name)
		healed("a full disk")
	}

	pause(3 * time.Second)
	stopClients()
	hist.Event(t, "clients stopped")
	for i, a := range apis {
		for k := range lincheck.Keys {
			key := fmt.Sprintf("i%d", k)
			c.eventually(t, 30*time.Second, "final read of "+key+" through "+c.nodes[i].name, func() error {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				return lincheck.FinalGet(ctx, hist, a, key)
			})
		}
	}
	lincheck.Check(t, hist, 100)
}

// fullDisk moves n's data dir onto a 64 MiB tmpfs the test mounts (n is
// stopped and restarted for it) and fills it. It returns false where the
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
