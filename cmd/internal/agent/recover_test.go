package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store"
)

// TestDisasterRecovery: a 3-node cluster loses two nodes for good. The
// survivor cannot elect itself; after the offline recover step with itself
// as the only server it leads again, two new nodes join it, and every
// record committed before the loss is on all three.
func TestDisasterRecovery(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(30 * time.Second)
	for i := range 100 {
		if _, err := agenttest.Register(ctx, leader, "web", fmt.Sprintf("w-%03d", i), "10.0.0.1", uint32(2000+i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := leader.API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/log.level", Value: "warn"})); err != nil {
		t.Fatal(err)
	}
	wantIndex := leader.FSM().AppliedIndex()
	survivor := c.Node(0)
	agenttest.Eventually(t, 20*time.Second, "the survivor applied every write", func() error {
		if got := survivor.FSM().AppliedIndex(); got < wantIndex {
			return fmt.Errorf("applied %d of %d", got, wantIndex)
		}
		return nil
	})
	wantServices, wantConfig := records(t, survivor)
	if len(wantServices) != 100 {
		t.Fatalf("%d services before the loss, want 100", len(wantServices))
	}

	c.Kill(1)
	c.Kill(2)
	// Alone, the survivor cannot take a write.
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := agenttest.Register(wctx, survivor, "web", "lost", "10.0.0.9", 9)
	wcancel()
	if err == nil {
		t.Fatal("a write succeeded without quorum")
	}

	// While the agent runs, recover refuses to touch its data dir.
	id, raftAddr := survivor.NodeID(), survivor.RaftAddr()
	peers := []store.Server{{ID: id, Address: raftAddr, Voter: true}}
	if err := agent.Recover(c.Dir(0), peers, nil); !errors.Is(err, store.ErrDataDirLocked) {
		t.Fatalf("Recover on a running agent's data dir = %v, want ErrDataDirLocked", err)
	}
	c.Kill(0)
	if err := agent.Recover(c.Dir(0), []store.Server{{ID: "someone-else", Address: "127.0.0.1:1", Voter: true}}, nil); err == nil || !strings.Contains(err.Error(), id) {
		t.Errorf("Recover with a peers list without this node = %v, want an error naming %s", err, id)
	}
	if err := agent.Recover(c.Dir(0), peers, nil); err != nil {
		t.Fatalf("Recover: %v", err)
	}

	survivor = c.Restart(0, false, "")
	leader = c.WaitLeader(30 * time.Second)
	if leader != survivor {
		t.Fatalf("leader %s after recovery, want the survivor", leader.Name)
	}
	for i := range 2 {
		cfg := agenttest.Config(fmt.Sprintf("new%d", i+1), filepath.Join(t.TempDir(), fmt.Sprintf("new%d", i+1)))
		cfg.Cluster.Join = []string{survivor.GossipAddr()}
		c.Start(3+i, cfg)
	}
	c.WaitPeers(60*time.Second, 3, 0)
	for _, n := range c.Nodes() {
		agenttest.Eventually(t, 30*time.Second, n.Name+" caught up", func() error {
			if got := n.FSM().AppliedIndex(); got < wantIndex {
				return fmt.Errorf("applied %d, want at least %d", got, wantIndex)
			}
			return nil
		})
		services, cfg := records(t, n)
		// The write tried without a quorum timed out: its outcome is
		// unknown, and the survivor may hold it in its log, uncommitted,
		// when it led at the time; a recovery to the survivor alone
		// commits what its log holds, so it may be there.
		services = slices.DeleteFunc(services, func(s string) bool { return strings.Contains(s, "lost") })
		if !slices.Equal(services, wantServices) {
			t.Errorf("%s: %d services after recovery, want the %d committed before", n.Name, len(services), len(wantServices))
		}
		for k, v := range wantConfig {
			if cfg[k] != v {
				t.Errorf("%s: config %s = %q, want %q", n.Name, k, cfg[k], v)
			}
		}
	}
	if _, err := agenttest.Register(ctx, c.Node(3), "web", "after", "10.0.0.2", 1); err != nil {
		t.Errorf("write through a new node after recovery: %v", err)
	}
}

func TestReadPeersFile(t *testing.T) {
	dir := t.TempDir()
	files := 0
	write := func(content string) string {
		files++
		p := filepath.Join(dir, fmt.Sprintf("peers-%d.json", files))
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	got, err := agent.ReadPeersFile(write(`[{"id":"a","address":"10.0.0.1:8300"},{"id":"b","address":"10.0.0.2:8300","non_voter":true}]`))
	if err != nil {
		t.Fatal(err)
	}
	want := []store.Server{{ID: "a", Address: "10.0.0.1:8300", Voter: true}, {ID: "b", Address: "10.0.0.2:8300"}}
	if !slices.Equal(got, want) {
		t.Errorf("ReadPeersFile = %+v, want %+v", got, want)
	}
	for content, msg := range map[string]string{
		`{}`:                           "JSON array",
		`[]`:                           "no servers",
		`[{"id":"a"}]`:                 `address "" is not host:port`,
		`[{"address":"h:1"}]`:          "entry 0: id is required",
		`[{"id":"a","address":"h:0"}]`: "no valid port",
		`[{"id":"a","address":"h:1"},{"id":"a","address":"h:2"}]`: `id "a" is also entry 0`,
		`[{"id":"a","address":"h:1"},{"id":"b","address":"h:1"}]`: `address "h:1" is also entry 0`,
		`[{"id":"a","address":"h:1","non_voter":true}]`:           "no voter",
		`[{"id":"a","address":"h:1","voter":true}]`:               `unknown field "voter"`,
		`[{"id":"a","address":"h:1"}] x`:                          "trailing data",
		`[{"id":"a","address":"h:1"}]]`:                           "trailing data",
	} {
		if _, err := agent.ReadPeersFile(write(content)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("ReadPeersFile(%s) = %v, want an error containing %q", content, err, msg)
		}
	}
	if _, err := agent.ReadPeersFile(filepath.Join(dir, "missing.json")); err == nil {
		t.Error("ReadPeersFile(missing file) succeeded")
	}
}
