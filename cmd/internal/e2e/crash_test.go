package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// crashConfig makes Raft snapshot every 64 entries (checked every 200 ms)
// and keep only 32 entries behind a snapshot, so that under load a node is
// almost always snapshotting or compacting its log when it is killed.
const crashConfig = `cluster:
  raft:
    snapshot_threshold: 64
    snapshot_interval: 200ms
    trailing_logs: 32
`

// TestCrashDuringSnapshots SIGKILLs agents (leader or not, chosen at
// random) at random moments while they snapshot and compact their logs
// under a stream of registrations, and restarts each from its data dir:
// every restart opens its data dir (the damaged-log check included),
// catches up, and at the end every acknowledged registration is on every
// node.
func TestCrashDuringSnapshots(t *testing.T) {
	if testing.Short() {
		t.Skip("kills real processes for a minute")
	}
	bins := buildBinaries(t)
	c := startClusterWith(t, bins, crashConfig)
	hc := c.httpClient(t)
	api := make([]clusterv1connect.ClusterServiceClient, len(c.nodes))
	for i, n := range c.nodes {
		api[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
	}
	st := newSoakStats()
	var reg registry
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() { reg.run(ctx, api, w, st) })
	}
	const kills = 8
	for k := range kills {
		time.Sleep(time.Duration(200+rand.IntN(1800)) * time.Millisecond) // a random point of the snapshot cycle
		n := c.nodes[rand.IntN(len(c.nodes))]
		c.kill(t, n)
		c.restart(t, n)
		// Caught up: a consistent read through it answers.
		i := c.index(n)
		c.eventually(t, 60*time.Second, n.name+" serving consistent reads after the crash", func() error {
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := api[i].ListServices(rctx, connect.NewRequest(&clusterv1.ListServicesRequest{Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			return err
		})
		t.Logf("crash %d: %s killed and back", k+1, n.name)
	}
	stop()
	wg.Wait()
	failed := st.report(t)
	reg.verify(t, c, api)
	snapshots, compactions := 0, 0
	for _, n := range c.nodes {
		b, err := os.ReadFile(n.log)
		if err != nil {
			t.Fatal(err)
		}
		snapshots += strings.Count(string(b), "snapshot complete up to")
		compactions += strings.Count(string(b), "compacting logs")
	}
	t.Logf("%d crashes; %d snapshots and %d log compactions completed meanwhile", kills, snapshots, compactions)
	c.agreeReplicas(t, "after the crashes")
	if snapshots < kills {
		t.Errorf("only %d snapshots: the crashes did not meet snapshotting", snapshots)
	}
	if failed {
		t.Fatal("unexpected errors (above)")
	}
}

// index returns n's position in c.nodes.
func (c *cluster) index(n *node) int {
	for i, m := range c.nodes {
		if m == n {
			return i
		}
	}
	return -1
}

// TestCrashDuringRestore SIGKILLs the leader and a follower at random
// moments of a restore of a 10,000-service archive — while the archive is
// uploaded, verified, installed or committed — and starts them again:
// every agent must start, and the cluster must hold exactly the state from
// before the restore or exactly the restored one, on every agent, never a
// mix; a restore afterwards must work.
func TestCrashDuringRestore(t *testing.T) {
	if testing.Short() {
		t.Skip("kills real processes during restores")
	}
	bins := buildBinaries(t)
	c := startCluster(t, bins)
	dir := t.TempDir()
	small, big := filepath.Join(dir, "small.tar.gz"), filepath.Join(dir, "big.tar.gz")
	states := map[string][]string{
		small: writeServiceArchive(t, small, "old", 50),
		big:   writeServiceArchive(t, big, "big", 10000),
	}
	hc := c.httpClient(t)
	api := make([]clusterv1connect.ClusterServiceClient, len(c.nodes))
	for i, n := range c.nodes {
		api[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
	}
	// holds reports which archive's state the cluster holds through every
	// agent. A consistent read that answers is the cluster's state: one
	// that is neither archive's, or agents that disagree, fail the test at
	// once; only a read that fails is tried again.
	holds := func() (string, error) {
		var got string
		for i, n := range c.nodes {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			resp, err := api[i].ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{
				Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			cancel()
			if err != nil {
				return "", fmt.Errorf("via %s: %w", n.name, err)
			}
			fail := func(format string, args ...any) (string, error) {
				t.Fatalf(format, args...)
				return "", nil
			}
			var ids []string
			for _, in := range resp.Msg.GetInstances() {
				ids = append(ids, in.GetService()+"/"+in.GetInstanceId())
			}
			slices.Sort(ids)
			which := ""
			for file, want := range states {
				if slices.Equal(ids, want) {
					which = file
				}
			}
			if which == "" {
				return fail("%s holds %d instances, neither archive's state (%d or %d): a mix", n.name, len(ids), len(states[small]), len(states[big]))
			}
			if got != "" && got != which {
				return fail("agents answer consistent reads with different states")
			}
			got = which
		}
		return got, nil
	}
	restore := func(n *node, file string) {
		c.ok(t, n, "--timeout", "60s", "snapshot", "restore", file)
	}

	// A clean restore of the big archive, timed: the kills fall within it.
	restore(c.nodes[0], small)
	began := time.Now()
	restore(c.nodes[1], big)
	took := time.Since(began)
	t.Logf("a restore of %d services took %s", len(states[big]), took.Round(time.Millisecond))
	cur := big
	const rounds = 6
	outcomes := map[string]int{}
	for round := range rounds {
		target := small
		if cur == small {
			target = big
		}
		l := c.byAPI(t, c.waitAgreedLeader(t).APIAddr)
		f := c.others(l)[rand.IntN(2)]
		via := c.nodes[rand.IntN(len(c.nodes))]
		done := make(chan result, 1)
		go func() {
			// The outcome of a restore cut short is whatever it is: the
			// state says what happened.
			done <- c.pvcli(t, via, "--timeout", "30s", "snapshot", "restore", target)
		}()
		delay := time.Duration(rand.Int64N(int64(took + 500*time.Millisecond)))
		time.Sleep(delay) // a random point of the restore
		c.kill(t, l)
		c.kill(t, f)
		r := <-done
		c.restart(t, l)
		c.restart(t, f)
		var got string
		c.eventually(t, 90*time.Second, "one state on every agent after the crash", func() error {
			var err error
			got, err = holds()
			return err
		})
		what := "the old state"
		if got == target {
			what = "the restored state"
		} else if r.code == 0 {
			t.Fatalf("round %d: the restore was acknowledged (%s), but the cluster holds the old state", round+1, strings.TrimSpace(r.stdout))
		}
		outcomes[what]++
		t.Logf("round %d: %s and %s killed %s into a restore through %s (pvcli exit %d): the cluster holds %s",
			round+1, l.name, f.name, delay.Round(time.Millisecond), via.name, r.code, what)
		// A restore afterwards works, through any agent.
		restore(c.nodes[rand.IntN(len(c.nodes))], target)
		c.eventually(t, 60*time.Second, "the restored state on every agent", func() error {
			got, err := holds()
			if err == nil && got != target {
				err = errors.New("the restore did not take")
			}
			return err
		})
		cur = target
	}
	t.Logf("after %d crashes: %v", rounds, outcomes)
	c.agreeReplicas(t, "after the crashes")
}

// writeServiceArchive writes an archive holding n service instances named
// prefix-NNNNN and returns their "service/instance" IDs, sorted.
func writeServiceArchive(t *testing.T, path, prefix string, n int) []string {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	var ids []string
	for i := range n {
		in := &clusterv1.ServiceInstance{Service: fmt.Sprintf("%s-%02d", prefix, i%50), InstanceId: fmt.Sprintf("%s-%05d", prefix, i),
			Node: "node1", Address: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), Port: 8080, Tags: []string{"archived"}}
		data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.New(now), Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: in}}})
		if err != nil {
			t.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			t.Fatal(res.Err)
		}
		ids = append(ids, in.GetService()+"/"+in.GetInstanceId())
	}
	writeArchive(t, path, f, fmt.Sprintf("1-%d-0", n), uint64(n))
	slices.Sort(ids)
	return ids
}

// waitAgreedLeader waits until every running agent names the same leader.
func (c *cluster) waitAgreedLeader(t *testing.T) leaderOut {
	t.Helper()
	var l leaderOut
	c.eventually(t, 60*time.Second, "an agreed leader", func() error {
		var err error
		l, err = c.agreedLeader(t, c.nodes...)
		return err
	})
	return l
}
