package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/release"
	"pilab.hu/pivirt-agent/cmd/internal/version"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// upgradeConfig makes the leaders snapshot and compact their logs after a
// few dozen entries, so that a follower that was down needs the leader's
// snapshot; both releases read it.
const upgradeConfig = `cluster:
  raft:
    snapshot_threshold: 64
    snapshot_interval: 1s
    trailing_logs: 16
`

// TestUpgradeAndDowngrade runs the previous release (built from the commit
// CHANGELOG.md names) on three agents with a backend each, writes through
// every agent all along, and upgrades them one at a time to this release,
// with the leadership on old and new agents and a snapshot installed by an
// old leader on a new follower and by a new leader on an old follower; it
// restarts everything, then enables a downgrade and runs the previous
// release again on one agent. After every step: every agent is ready and
// applied the same index; every replica's state is the same, table by
// table (pvcli operator raft verify where the leader runs this release, and
// pvcli snapshot inspect --hash of each agent's own snapshot, which covers
// the previous release too); every write acknowledged is read back through
// every agent; what this release added is refused until the cluster
// version allows it.
func TestUpgradeAndDowngrade(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the previous release and runs two releases for minutes")
	}
	bins := buildBinaries(t)
	root, err := release.Root()
	if err != nil {
		t.Fatal(err)
	}
	prev, err := release.Previous(filepath.Join(root, "CHANGELOG.md"), version.Version)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	dir, err := release.Build(ctx, root, prev.Commit, []string{"./cmd/pivirt-agent"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(dir, "pivirt-agent")
	start := time.Now()
	step := func(what string) { t.Logf("%6.1fs %s", time.Since(start).Seconds(), what) }

	c := startClusterOn(t, &cluster{bins: bins, dir: t.TempDir(), compat: true, agents: []string{old, old, old}, extra: upgradeConfig})
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]
	w := newUpgradeWriters(t, c)
	defer w.stop()
	step(fmt.Sprintf("3 agents of release %s (%s) with a backend each; writing through every agent", prev.Version, prev.Commit[:12]))
	c.checkReplicas(t, w, "release "+prev.Version+" only")

	c.upgradeNode(t, n3, c.bins.agent)
	step("node3 runs " + version.Version)
	c.checkReplicas(t, w, "node3 upgraded")
	c.refusesNewFeatures(t, n3, "0.0")

	c.transferLeader(t, n3)
	step("leadership on node3 (new); node1 needs the new leader's snapshot")
	c.needsSnapshot(t, w, n1)
	c.checkReplicas(t, w, "a new leader's snapshot installed on an old follower")

	c.upgradeNode(t, n2, c.bins.agent)
	step("node2 runs " + version.Version)
	c.transferLeader(t, n1)
	step("leadership on node1 (old); node2 needs the old leader's snapshot")
	c.needsSnapshot(t, w, n2)
	c.checkReplicas(t, w, "an old leader's snapshot installed on a new follower")
	c.refusesNewFeatures(t, n2, "0.0")

	c.upgradeNode(t, n1, c.bins.agent)
	step("every agent runs " + version.Version)
	c.waitClusterVersion(t, n2, "0.1")
	c.checkReplicas(t, w, "every agent upgraded")
	c.ok(t, n3, "vm", "create", "up-vm", "--host", "node1", "--memory-mib", "256", "--vcpus", "1")

	w.pause()
	for _, n := range c.nodes {
		c.stop(t, n)
	}
	for _, n := range c.nodes {
		c.mustStart(t, n, false)
	}
	w.resume()
	step("every agent restarted at once")
	c.waitClusterVersion(t, n1, "0.1")
	c.checkReplicas(t, w, "a full restart")

	// Rolled back without a downgrade, the previous release finds no
	// snapshot it can restore, and stops with the data dir unchanged.
	// node1 is the one whose upgrade let the version rise.
	c.stop(t, n1)
	c.refusedStart(t, n1, old, "failed to load any existing snapshots")
	c.startAs(t, n1, c.bins.agent)
	step("release " + prev.Version + " refused node1's data dir without a downgrade; node1 runs " + version.Version + " again")
	c.checkReplicas(t, w, "a refused rollback")

	r := c.ok(t, n1, "operator", "downgrade", "enable", "0.0")
	step("downgrade enabled: " + strings.TrimSpace(r.stdout))
	c.waitClusterVersion(t, n1, "0.0")
	c.checkReplicas(t, w, "downgrade enabled")
	c.refusesNewFeatures(t, n3, "0.0")
	c.upgradeNode(t, n2, old)
	step("node2 runs release " + prev.Version + " again")
	c.checkReplicas(t, w, "node2 downgraded")
	w.stop()
	step(fmt.Sprintf("done: %d writes acknowledged", w.count()))
}

// upgradeNode stops n and starts bin on its data dir and configuration.
func (c *cluster) upgradeNode(t *testing.T, n *node, bin string) {
	t.Helper()
	c.stop(t, n)
	c.startAs(t, n, bin)
}

// startAs starts bin on n's data dir and configuration (n is stopped) and
// waits until it is ready.
func (c *cluster) startAs(t *testing.T, n *node, bin string) {
	t.Helper()
	n.bin = bin
	c.restart(t, n)
	c.eventually(t, 60*time.Second, n.name+" ready after its restart", func() error {
		ready, _, err := readyOf(n)
		if err == nil && !ready {
			err = fmt.Errorf("%s is not ready", n.name)
		}
		return err
	})
}

// refusedStart starts bin on n's data dir (n is stopped) and checks that
// it exits with an error its log names (want), within a minute.
func (c *cluster) refusedStart(t *testing.T, n *node, bin, want string) {
	t.Helper()
	offset := fileSize(n.log)
	n.bin = bin
	c.mustStart(t, n, false)
	p := n.proc
	select {
	case <-p.done:
	case <-time.After(time.Minute):
		c.stop(t, n)
		t.Fatalf("%s started on a data dir it must refuse; log tail:\n%s", n.name, tail(n.log, 30))
	}
	n.proc = nil
	b, _ := os.ReadFile(n.log)
	if p.cmd.ProcessState.ExitCode() == 0 || !strings.Contains(string(b[min(offset, int64(len(b))):]), want) {
		t.Fatalf("%s: %s, want a failure saying %q; log tail:\n%s", n.name, p.state(), want, tail(n.log, 30))
	}
}

// transferLeader makes to the leader.
func (c *cluster) transferLeader(t *testing.T, to *node) {
	t.Helper()
	c.eventually(t, 60*time.Second, "leadership moved to "+to.name, func() error {
		if l, err := c.agreedLeader(t, c.nodes...); err == nil && l.Name == to.name {
			return nil
		}
		if r := c.pvcli(t, to, "cluster", "transfer-leader", to.name); r.code != 0 {
			return fmt.Errorf("%s", r)
		}
		return fmt.Errorf("not yet")
	})
}

// needsSnapshot stops follower f, writes until the leader compacted its
// log past f's last entry, and starts f again: it can catch up only by
// installing the leader's snapshot, which its log says it did.
func (c *cluster) needsSnapshot(t *testing.T, w *upgradeWriters, f *node) {
	t.Helper()
	_, before, err := readyOf(f)
	if err != nil {
		t.Fatal(err)
	}
	c.stop(t, f)
	var leader *node
	for _, n := range c.nodes {
		if n != f {
			leader = n
			break
		}
	}
	for i := range 300 {
		w.writeOne(leader, fmt.Sprintf("kv/fill-%s-%d", f.name, i))
	}
	logSize := fileSize(f.log)
	c.restart(t, f)
	c.eventually(t, 90*time.Second, f.name+" caught up", func() error {
		ready, applied, err := readyOf(f)
		switch {
		case err != nil:
			return err
		case !ready || applied <= before+300:
			return fmt.Errorf("%s: ready %v at index %d", f.name, ready, applied)
		}
		return nil
	})
	b, _ := os.ReadFile(f.log)
	if !strings.Contains(string(b[min(logSize, int64(len(b))):]), "nstalled remote snapshot") {
		t.Fatalf("%s caught up without installing the leader's snapshot; log tail:\n%s", f.name, tail(f.log, 30))
	}
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// refusesNewFeatures: through n (this release), at cluster version v,
// what 0.1 added is refused with a FailedPrecondition that says so.
func (c *cluster) refusesNewFeatures(t *testing.T, n *node, v string) {
	t.Helper()
	r := c.pvcli(t, n, "vm", "create", "early-vm", "--host", c.others(n)[0].name, "--memory-mib", "256", "--vcpus", "1")
	if r.code == 0 || !strings.Contains(r.stderr, "needs cluster version 0.1") || !strings.Contains(r.stderr, "is at "+v) {
		t.Errorf("a create on another node at cluster version %s: %s\nwant it refused as needing cluster version 0.1", v, r)
	}
	var cv struct {
		ClusterVersion string `json:"clusterVersion"`
	}
	c.okJSON(t, n, &cv, "cluster", "version")
	if cv.ClusterVersion != v {
		t.Errorf("pvcli cluster version through %s = %s, want %s", n.name, cv.ClusterVersion, v)
	}
}

// waitClusterVersion waits until the cluster version n reports is v.
func (c *cluster) waitClusterVersion(t *testing.T, n *node, v string) {
	t.Helper()
	c.eventually(t, 60*time.Second, "cluster version "+v, func() error {
		var cv struct {
			ClusterVersion string `json:"clusterVersion"`
		}
		if err := c.tryJSON(t, n, &cv, "cluster", "version"); err != nil {
			return err
		}
		if cv.ClusterVersion != v {
			return fmt.Errorf("cluster version %s", cv.ClusterVersion)
		}
		return nil
	})
}

// readyOf is n's /ready: whether it is ready, and its applied index.
func readyOf(n *node) (bool, uint64, error) {
	resp, err := http.Get("http://" + n.metrics + "/ready")
	if err != nil {
		return false, 0, err
	}
	defer resp.Body.Close()
	var body struct {
		Status  string         `json:"status"`
		Applied uint64         `json:"applied_index"`
		Checks  map[string]any `json:"checks"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return false, 0, fmt.Errorf("%s /ready: %w", n.name, err)
	}
	return body.Status == "ready", body.Applied, nil
}

// checkReplicas pauses the writers and checks, after step: every agent is
// ready at the same applied index (no follower ready while behind); the
// states agree table by table; every acknowledged write reads back
// through every agent.
func (c *cluster) checkReplicas(t *testing.T, w *upgradeWriters, step string) {
	t.Helper()
	w.pause()
	defer w.resume()
	// The state of each agent as a snapshot archive of it (the cluster CA
	// is never in one), hashed table by table, at one index: the agents
	// may still append entries of their own (a log verification
	// checkpoint), so this is tried again until every snapshot is at the
	// same index.
	var (
		index uint64
		sums  map[string]map[string]string
	)
	for attempt := 1; ; attempt++ {
		c.eventually(t, 90*time.Second, step+": every agent ready at one applied index", func() error {
			seen := map[uint64][]string{}
			for _, n := range c.nodes {
				ready, applied, err := readyOf(n)
				if err != nil {
					return err
				}
				if !ready {
					return fmt.Errorf("%s is not ready", n.name)
				}
				seen[applied] = append(seen[applied], n.name)
			}
			if len(seen) != 1 {
				return fmt.Errorf("applied indexes %v", seen)
			}
			for i := range seen {
				index = i
			}
			return nil
		})
		sums = map[string]map[string]string{}
		at := map[string]string{}
		for _, n := range c.nodes {
			file := filepath.Join(c.dir, fmt.Sprintf("%s-%d.snap", n.name, index))
			c.ok(t, n, "snapshot", "save", "--stale", file)
			var in struct {
				Index  string `json:"index"`
				Tables []struct {
					Name   string `json:"name"`
					SHA256 string `json:"sha256"`
				} `json:"tables"`
			}
			c.okJSON(t, n, &in, "snapshot", "inspect", "--hash", file)
			at[n.name] = in.Index
			sums[n.name] = map[string]string{}
			for _, tb := range in.Tables {
				sums[n.name][tb.Name] = tb.SHA256
			}
		}
		if len(slices.Compact(slices.Sorted(maps.Values(at)))) == 1 {
			break
		}
		if attempt == 5 {
			t.Fatalf("%s: the agents' snapshots are at indexes %v five times over", step, at)
		}
	}
	ref := sums[c.nodes[0].name]
	for _, n := range c.nodes[1:] {
		for _, table := range slices.Sorted(maps.Keys(ref)) {
			if sums[n.name][table] != ref[table] {
				t.Errorf("%s: at index %d %s's %s table differs from %s's", step, index, n.name, table, c.nodes[0].name)
			}
		}
		if len(sums[n.name]) != len(ref) {
			t.Errorf("%s: %s's snapshot has tables %v, %s's %v", step, n.name, slices.Sorted(maps.Keys(sums[n.name])), c.nodes[0].name, slices.Sorted(maps.Keys(ref)))
		}
	}
	// Where the leader runs this release, its own comparison agrees too.
	if l, err := c.agreedLeader(t, c.nodes...); err == nil {
		leader := c.byName(t, l.Name)
		if leader.bin == c.bins.agent {
			r := c.pvcli(t, leader, "operator", "raft", "verify", "-o", "json")
			var v struct {
				Nodes []struct {
					Name   string   `json:"name"`
					Differ []string `json:"differ"`
					Error  string   `json:"error"`
				} `json:"nodes"`
			}
			if err := json.Unmarshal([]byte(r.stdout), &v); err != nil {
				t.Fatalf("%s: %s\n%v", step, r, err)
			}
			for _, nv := range v.Nodes {
				n := c.byName(t, nv.Name)
				switch {
				case len(nv.Differ) > 0:
					t.Errorf("%s: pvcli operator raft verify: %s differs in %v", step, nv.Name, nv.Differ)
				case nv.Error != "" && n.bin == c.bins.agent:
					t.Errorf("%s: pvcli operator raft verify did not check %s, which runs this release: %s", step, nv.Name, nv.Error)
				}
			}
		}
	}
	// Every acknowledged write, through every agent.
	acked := w.snapshot()
	for _, n := range c.nodes {
		var list struct {
			Entries []struct {
				Key   string `json:"key"`
				Value string `json:"value"`
			} `json:"entries"`
		}
		c.okJSON(t, n, &list, "config", "list", "--consistency", "stale")
		have := map[string]string{}
		for _, e := range list.Entries {
			have[e.Key] = e.Value
		}
		missing := 0
		for k, v := range acked {
			if have[k] != v {
				missing++
			}
		}
		if missing > 0 {
			t.Errorf("%s: %d of %d acknowledged writes are not read back through %s", step, missing, len(acked), n.name)
		}
	}
	t.Logf("%s: %d agents agree at index %d on every table; %d acknowledged writes read back through each", step, len(c.nodes), index, len(acked))
}

// upgradeWriters write config keys through every agent, one writer each,
// until stopped, and keep what was acknowledged.
type upgradeWriters struct {
	hc    *http.Client
	mu    sync.Mutex
	acked map[string]string
	// gate is held for reading by each write, and for writing while the
	// writes are paused.
	gate    sync.RWMutex
	done    chan struct{}
	wg      sync.WaitGroup
	stopped atomic.Bool
}

func newUpgradeWriters(t *testing.T, c *cluster) *upgradeWriters {
	w := &upgradeWriters{hc: c.httpClient(t), acked: map[string]string{}, done: make(chan struct{})}
	for _, n := range c.nodes {
		api := "https://" + n.api // n's fields change as it restarts; its address does not
		w.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-w.done:
					return
				case <-time.After(20 * time.Millisecond):
				}
				w.write(api, fmt.Sprintf("kv/up-%s-%d", n.name, i))
			}
		})
	}
	return w
}

// writeOne sets key through n, keeping it when acknowledged.
func (w *upgradeWriters) writeOne(n *node, key string) { w.write("https://"+n.api, key) }

func (w *upgradeWriters) write(url, key string) {
	w.gate.RLock()
	defer w.gate.RUnlock()
	api := clusterv1connect.NewClusterServiceClient(w.hc, url)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	value := "v-" + key
	if _, err := api.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: key, Value: value})); err == nil {
		w.mu.Lock()
		w.acked[key] = value
		w.mu.Unlock()
	}
}

// pause waits for the writes in flight and holds the next ones until
// resume.
func (w *upgradeWriters) pause() { w.gate.Lock() }

func (w *upgradeWriters) resume() { w.gate.Unlock() }

func (w *upgradeWriters) stop() {
	if w.stopped.Swap(true) {
		return
	}
	close(w.done)
	w.wg.Wait()
}

func (w *upgradeWriters) snapshot() map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.acked)
}

func (w *upgradeWriters) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.acked)
}
