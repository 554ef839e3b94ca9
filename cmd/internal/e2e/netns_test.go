package e2e_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// netnsEnv is n network namespaces the test creates, each with a veth pair
// to a bridge in the test's own namespace: agent i runs in names[i] on
// ips[i]; the test reaches every one through the bridge. Traffic between
// two namespaces is cut with blackhole routes inside them.
type netnsEnv struct {
	names  []string
	ips    []string
	bridge string
	mu     sync.Mutex
	cut    map[[2]int]bool
}

// ipRun runs ip with args, failing t with its output.
func ipRun(t testing.TB, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// newNetns creates n namespaces and the bridge, removed at cleanup. Where
// the test may not (not root), it skips, except in CI.
func newNetns(t *testing.T, n int) *netnsEnv {
	t.Helper()
	tag := fmt.Sprintf("pv%04x", rand.IntN(1<<16))
	probe := tag + "-probe"
	if out, err := exec.Command("ip", "netns", "add", probe).CombinedOutput(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("network namespaces: %v: %s", err, out)
		}
		t.Skipf("network namespaces unavailable: %v: %s", err, out)
	}
	_ = exec.Command("ip", "netns", "del", probe).Run()
	subnet := fmt.Sprintf("10.%d.%d", 100+rand.IntN(100), rand.IntN(250))
	e := &netnsEnv{bridge: tag + "br", cut: map[[2]int]bool{}}
	t.Cleanup(func() {
		for _, ns := range e.names {
			_ = exec.Command("ip", "netns", "del", ns).Run()
		}
		_ = exec.Command("ip", "link", "del", e.bridge).Run()
	})
	ipRun(t, "link", "add", e.bridge, "type", "bridge")
	ipRun(t, "addr", "add", subnet+".254/24", "dev", e.bridge)
	ipRun(t, "link", "set", e.bridge, "up")
	for i := range n {
		ns := fmt.Sprintf("%s-%d", tag, i+1)
		host := fmt.Sprintf("%sv%d", tag, i+1)
		ip := fmt.Sprintf("%s.%d", subnet, i+1)
		ipRun(t, "netns", "add", ns)
		e.names = append(e.names, ns)
		e.ips = append(e.ips, ip)
		ipRun(t, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
		ipRun(t, "link", "set", host, "master", e.bridge, "up")
		ipRun(t, "-n", ns, "addr", "add", ip+"/24", "dev", "eth0")
		ipRun(t, "-n", ns, "link", "set", "eth0", "up")
		ipRun(t, "-n", ns, "link", "set", "lo", "up")
	}
	return e
}

// block makes namespace from drop what it sends to to (one direction).
func (e *netnsEnv) block(t testing.TB, from, to int) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cut[[2]int{from, to}] {
		return
	}
	ipRun(t, "-n", e.names[from], "route", "add", "blackhole", e.ips[to]+"/32")
	e.cut[[2]int{from, to}] = true
}

// heal removes every cut.
func (e *netnsEnv) heal(t testing.TB) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	for k := range e.cut {
		ipRun(t, "-n", e.names[k[0]], "route", "del", "blackhole", e.ips[k[1]]+"/32")
		delete(e.cut, k)
	}
}

// TestPartitions runs lincheck's clients through three agents in network
// namespaces of their own while the network between them is cut:
//
//  1. the leader isolated from both followers (both directions), then
//     healed;
//  2. an asymmetric cut: the followers' packets to the leader dropped,
//     the leader's to them delivered, then healed;
//  3. one follower isolated, then healed.
//
// The clients (in the test's namespace) still reach every agent. Each
// partition heals on its own once the network is back; final reads and
// porcupine's check of the history must pass.
func TestPartitions(t *testing.T) {
	if testing.Short() {
		t.Skip("partitions real processes")
	}
	env := newNetns(t, 3)
	bins := buildBinaries(t)
	c := startClusterIn(t, bins, env)
	t.Logf("namespaces %v on %v", env.names, env.ips)
	r := startLinRun(t, c, "part")
	isolate := func(n *node) {
		for _, o := range c.others(n) {
			env.block(t, c.index(n), c.index(o))
			env.block(t, c.index(o), c.index(n))
		}
	}
	survived := 0
	r.pause(3 * time.Second)

	// 1. The leader cut off.
	l := r.leader()
	isolate(l)
	r.event("partition: leader %s isolated from the others", l.name)
	c.eventually(t, 60*time.Second, "a leader in the majority", func() error {
		next, err := c.agreedLeader(t, c.others(l)...)
		if err == nil && next.Name == l.name {
			return errors.New("the majority still names the isolated leader")
		}
		return err
	})
	r.event("the majority elected a leader")
	r.pause(3 * time.Second)
	env.heal(t)
	r.event("network healed")
	r.healed("isolating the leader")
	survived++

	// 2. Asymmetric: the followers' packets to the leader dropped.
	r.pause(2 * time.Second)
	l = r.leader()
	for _, o := range c.others(l) {
		env.block(t, c.index(o), c.index(l))
	}
	r.event("asymmetric partition: packets from the followers to leader %s dropped", l.name)
	r.pause(8 * time.Second)
	env.heal(t)
	r.event("network healed")
	r.healed("an asymmetric partition")
	survived++

	// 3. A follower cut off.
	r.pause(2 * time.Second)
	f := r.follower()
	isolate(f)
	r.event("partition: follower %s isolated", f.name)
	r.pause(6 * time.Second)
	env.heal(t)
	r.event("network healed")
	r.healed("isolating a follower")
	survived++

	t.Logf("%d partitions survived", survived)
	r.finish()
}
