package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// Knobs of TestScale (make scale AGENTS=100 INSTANCES=100000).
const (
	envScaleAgents    = "PIVIRT_SCALE_AGENTS"
	envScaleInstances = "PIVIRT_SCALE_INSTANCES"
	// envScaleHeapProfile names a file for a heap profile taken once every
	// agent holds every instance (go tool pprof -sample_index=inuse_space).
	envScaleHeapProfile = "PIVIRT_SCALE_HEAPPROFILE"
)

// The memory budget TestScale holds the agents to: live Go heap per agent
// after the registrations, a base plus a cost per instance held. An
// instance costs about 440 bytes in the state and each write of the last
// dedupe window (2 minutes) 64 more for its outcome in its client's
// session (fsm.BenchmarkStateMemory; a dedupe record per write cost about
// 570); when every write is that recent, both count.
const (
	budgetPerAgent    = 8 << 20
	budgetPerInstance = 1536
)

// TestScale starts PIVIRT_SCALE_AGENTS agents in this process (5 Raft
// voters, the rest non-voters; gossip on loopback ports), waits until
// membership has converged everywhere, registers PIVIRT_SCALE_INSTANCES
// service instances through them while blocking queries (watches) on the
// services wait on every agent (each on one service), waits until every agent holds them all and
// every watch has woken, then stops a voter and waits until a non-voter is
// promoted in its place. It reports the convergence times and the
// process's memory per agent. Skipped unless PIVIRT_SCALE_AGENTS is set;
// run without the race detector, whose memory overhead would swamp the
// figures.
func TestScale(t *testing.T) {
	agents := scaleKnob(t, envScaleAgents, 0, 3, 200)
	if agents == 0 {
		t.Skip("set " + envScaleAgents + " (make scale)")
	}
	instances := scaleKnob(t, envScaleInstances, 100000, 1, 1000000)
	// A hundred agents' states share one heap: without a limit the
	// collector lets it grow to twice what is live.
	if os.Getenv("GOMEMLIMIT") == "" {
		limit := memTotal(t) / 10 * 7
		debug.SetMemoryLimit(limit)
		t.Logf("Go memory limit %d MiB (70%% of the machine's; set GOMEMLIMIT to change)", limit>>20)
	}
	rss0 := rssMiB(t)
	var heap0 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&heap0)
	start := time.Now()

	// Five voters bootstrap together; the others join them.
	voters := min(5, agents)
	c := agenttest.New(t)
	var seed string
	for i := range agents {
		cfg := agenttest.Config(fmt.Sprintf("node%03d", i+1), filepath.Join(t.TempDir(), fmt.Sprintf("node%03d", i+1)))
		cfg.Cluster.Raft.Voters = voters
		cfg.Cluster.Raft.DeadServerCleanup = config.Duration(5 * time.Second)
		cfg.Logging.Level = "warn"
		if i < voters {
			cfg.Cluster.Raft.BootstrapExpect = voters
		}
		if seed != "" {
			cfg.Cluster.Join = []string{seed}
		}
		n := c.Start(i, cfg)
		if seed == "" {
			seed = n.GossipAddr()
		}
	}
	started := time.Since(start)
	nodes := c.Nodes()
	agenttest.Eventually(t, 5*time.Minute, fmt.Sprintf("every agent sees %d alive members", agents), func() error {
		for _, n := range nodes {
			alive := 0
			for _, m := range n.Gossip().Members() {
				if m.Status == cluster.StatusAlive {
					alive++
				}
			}
			if alive != agents {
				return fmt.Errorf("%s sees %d alive", n.Name, alive)
			}
		}
		return nil
	})
	gossipConverged := time.Since(start)
	c.WaitPeers(5*time.Minute, voters, agents-voters)
	raftConverged := time.Since(start)
	rss1 := rssMiB(t)
	t.Logf("%d agents started in %s; gossip converged (every agent sees all alive) after %s; Raft %d voters + %d non-voters after %s; RSS %d MiB (%.1f MiB per agent)",
		agents, started.Round(time.Millisecond), gossipConverged.Round(time.Millisecond), voters, agents-voters, raftConverged.Round(time.Millisecond),
		rss1, float64(rss1-rss0)/float64(agents))

	// A blocking query per agent on one service, renewed as it wakes: the
	// watches (a backend's discovery watches its own service).
	wctx, stopWatches := context.WithCancel(context.Background())
	defer stopWatches()
	var woke atomic.Int64
	seen := make([]atomic.Uint64, len(nodes)) // the index each watch last returned
	var watchers sync.WaitGroup
	for i, n := range nodes {
		watchers.Go(func() {
			var index uint64
			for wctx.Err() == nil {
				resp, err := n.API.GetService(wctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: fmt.Sprintf("svc-%03d", i%200), Read: &clusterv1.ReadOptions{
					Consistency: clusterv1.Consistency_CONSISTENCY_STALE, WaitIndex: index, WaitTime: durationpb.New(10 * time.Minute),
				}}))
				if err != nil {
					if wctx.Err() == nil {
						time.Sleep(100 * time.Millisecond) // an agent stopped: retry paced
					}
					continue
				}
				if idx := resp.Msg.GetMeta().GetIndex(); idx > index {
					if index != 0 {
						woke.Add(1)
					}
					index = idx
					seen[i].Store(idx)
				}
			}
		})
	}

	// The registrations, through every agent, 64 at a time.
	regStart := time.Now()
	var next atomic.Int64
	var failed, retried atomic.Int64
	var firstErr atomic.Pointer[error]
	var wg sync.WaitGroup
	lat := make([][]time.Duration, 64) // per client
	for w := range 64 {
		wg.Go(func() {
			n := nodes[w%len(nodes)]
			for {
				i := next.Add(1) - 1
				if i >= int64(instances) {
					return
				}
				req := &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
					Service: fmt.Sprintf("svc-%03d", i%200), InstanceId: fmt.Sprintf("i-%07d", i),
					Address: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), Port: 8080, Tags: []string{"scale"},
				}}
				t0 := time.Now()
				var err error
				// As a client does, a write refused while the cluster has
				// no leader is sent again (a registration repeats safely);
				// the retries are counted and reported.
				for attempt := range 10 {
					if attempt > 0 {
						retried.Add(1)
						time.Sleep(time.Second) // paced: the cluster is electing
					}
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					_, err = n.API.RegisterService(ctx, connect.NewRequest(req))
					cancel()
					if connect.CodeOf(err) != connect.CodeUnavailable {
						break
					}
				}
				lat[w] = append(lat[w], time.Since(t0))
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, &err)
				}
			}
		})
	}
	progressDone := make(chan struct{})
	go func() {
		tick := time.NewTicker(30 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-progressDone:
				return
			case <-tick.C:
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				live := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
				metrics.Read(live)
				done := min(next.Load(), int64(instances))
				t.Logf("… %d registered after %s (%.0f/s); RSS %d MiB, Go heap in use %d MiB, live at the last GC %d MiB",
					done, time.Since(regStart).Round(time.Second), float64(done)/time.Since(regStart).Seconds(), rssMiB(t), ms.HeapInuse>>20, live[0].Value.Uint64()>>20)
			}
		}
	}()
	wg.Wait()
	close(progressDone)
	registered := time.Since(regStart)
	if f := failed.Load(); f > 0 {
		t.Fatalf("%d registrations failed, the first: %v", f, *firstErr.Load())
	}
	agenttest.Eventually(t, 10*time.Minute, fmt.Sprintf("every agent holds %d instances", instances), func() error {
		for _, n := range nodes {
			_, insts, err := n.FSM().State().Services("", nil)
			if err != nil {
				return err
			}
			if len(insts) != instances {
				return fmt.Errorf("%s holds %d", n.Name, len(insts))
			}
		}
		return nil
	})
	applied := time.Since(regStart)
	// Every watch has returned its service's last change, woken by it: the
	// watches wait up to 10 minutes, this check 30 seconds.
	agenttest.Eventually(t, 30*time.Second, "every watch returns its service's last change", func() error {
		for i, n := range nodes {
			svc := fmt.Sprintf("svc-%03d", i%200)
			_, insts, err := n.FSM().State().Services(svc, nil)
			if err != nil {
				return err
			}
			var last uint64
			for _, in := range insts {
				last = max(last, in.GetModifyIndex())
			}
			if got := seen[i].Load(); got < last {
				return fmt.Errorf("the watch on %s through %s returned index %d, the service changed at %d", svc, n.Name, got, last)
			}
		}
		return nil
	})
	all := slices.Sorted(slices.Values(slices.Concat(lat...)))
	q := func(f float64) time.Duration { return all[int(f*float64(len(all)-1))].Round(time.Millisecond) }
	t.Logf("registration latency p50 %s, p99 %s, max %s (retries included); %d retries after Unavailable", q(0.5), q(0.99), q(1), retried.Load())
	// Garbage collected and returned to the system: RSS is then what the
	// agents hold, plus the heap's fragmentation.
	debug.FreeOSMemory()
	if path := os.Getenv(envScaleHeapProfile); path != "" {
		writeHeapProfile(t, path)
	}
	rss2 := rssMiB(t)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	live := float64(ms.HeapAlloc-heap0.HeapAlloc) / float64(agents)
	t.Logf("%d instances registered in %s (%.0f/s) through %d agents; every agent held them all after %s; %d watch wake-ups",
		instances, registered.Round(time.Millisecond), float64(instances)/registered.Seconds(), agents, applied.Round(time.Millisecond), woke.Load())
	t.Logf("memory: RSS %d MiB (%.1f MiB per agent), Go heap in use %d MiB, live %.1f MiB per agent (%.0f bytes per instance per agent)",
		rss2, float64(rss2-rss0)/float64(agents), ms.HeapInuse>>20, live/(1<<20), live/float64(instances))
	if budget := float64(budgetPerAgent + budgetPerInstance*instances); live > budget {
		t.Errorf("live Go heap per agent %.1f MiB exceeds the budget of %.1f MiB (%d MiB + %d bytes per instance)",
			live/(1<<20), budget/(1<<20), budgetPerAgent>>20, budgetPerInstance)
	}

	// A voter fails: a non-voter is promoted in its place.
	if agents > voters {
		var victim *agenttest.Node
		for _, n := range nodes {
			if !n.IsLeader() && isVoter(t, c, n) {
				victim = n
				break
			}
		}
		failStart := time.Now()
		c.Kill(c.Index(victim))
		c.WaitPeers(5*time.Minute, voters, agents-voters-1)
		t.Logf("voter %s stopped: removed and a non-voter promoted (%d voters again) after %s", victim.Name, voters, time.Since(failStart).Round(time.Millisecond))
	}
	stopWatches()
	watchers.Wait()
}

func scaleKnob(t *testing.T, env string, def, lo, hi int) int {
	t.Helper()
	v := os.Getenv(env)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		t.Fatalf("%s=%q: want a number from %d to %d", env, v, lo, hi)
	}
	return n
}

// isVoter reports whether n is a voter in the leader's configuration.
func isVoter(t *testing.T, c *agenttest.Cluster, n *agenttest.Node) bool {
	t.Helper()
	leader := c.WaitLeader(time.Minute)
	servers, err := leader.Store().Servers(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range servers {
		if s.ID == n.NodeID() {
			return s.Voter
		}
	}
	return false
}

func writeHeapProfile(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// memTotal is the machine's memory in bytes.
func memTotal(t *testing.T) int64 {
	t.Helper()
	return procKiB(t, "/proc/meminfo", "MemTotal:") << 10
}

// rssMiB is this process's resident memory.
func rssMiB(t *testing.T) int64 {
	t.Helper()
	return procKiB(t, "/proc/self/status", "VmRSS:") >> 10
}

// procKiB reads the "field: N kB" line of a /proc file.
func procKiB(t *testing.T, file, field string) int64 {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("%s: %s %v", file, field, err)
			}
			return kb
		}
	}
	t.Fatalf("%s: no %s", file, field)
	return 0
}
