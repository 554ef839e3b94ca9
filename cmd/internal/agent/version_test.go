package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// TestClusterVersionAndDowngrade: a new cluster runs at the latest
// version; a downgrade the older version cannot express is refused with
// the reason; an enabled one lowers the version on every node, turns the
// newer features off (refused, naming what to upgrade) and holds until
// cancelled; after each step every replica agrees with the leader.
func TestClusterVersionAndDowngrade(t *testing.T) {
	pc := startPlacedCluster(t, 3)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	api := pc.c.Node(1).API // a follower or the leader: every call works through any node
	agree := func(step string) {
		t.Helper()
		resp, err := api.VerifyReplicas(ctx, connect.NewRequest(&clusterv1.VerifyReplicasRequest{}))
		if err != nil {
			t.Fatalf("%s: verify: %v", step, err)
		}
		if !resp.Msg.GetAgree() || len(resp.Msg.GetNodes()) != 3 {
			t.Fatalf("%s: the replicas do not agree: %v", step, resp.Msg)
		}
	}
	cv, err := api.ClusterVersion(ctx, connect.NewRequest(&clusterv1.ClusterVersionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if cv.Msg.GetClusterVersion() != fsm.Latest.String() || len(cv.Msg.GetServers()) != 3 || cv.Msg.GetLeader() == "" {
		t.Fatalf("cluster version of a new cluster: %v", cv.Msg)
	}
	for _, s := range cv.Msg.GetServers() {
		if !s.GetCaughtUp() || s.GetHalted() != "" || s.GetVersion() != fsm.Latest.String() || len(s.GetFeatures()) == 0 {
			t.Errorf("server %s: %v", s.GetName(), s)
		}
	}
	agree("a new cluster")

	// An instance with a check cannot be expressed at 0.0.
	if _, err := api.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
		Service: "web", InstanceId: "w1", Address: "127.0.0.1", Port: 1,
		Check: &clusterv1.HealthCheck{Tcp: "127.0.0.1:1", Interval: durationpb.New(10 * time.Second), Timeout: durationpb.New(time.Second)},
	}})); err != nil {
		t.Fatal(err)
	}
	_, err = api.Downgrade(ctx, connect.NewRequest(&clusterv1.DowngradeRequest{Action: clusterv1.DowngradeAction_DOWNGRADE_ACTION_VALIDATE, Version: "0.0"}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "web/w1") {
		t.Fatalf("validate with an instance with a check: %v, want FailedPrecondition naming web/w1", err)
	}
	if _, err := api.DeregisterService(ctx, connect.NewRequest(&clusterv1.DeregisterServiceRequest{Service: "web", InstanceId: "w1"})); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "before", Vcpus: 1, MemoryMib: 256}, Host: "node2"}); err != nil {
		t.Fatal(err)
	}
	v, err := api.Downgrade(ctx, connect.NewRequest(&clusterv1.DowngradeRequest{Action: clusterv1.DowngradeAction_DOWNGRADE_ACTION_VALIDATE, Version: "0.0"}))
	if err != nil || len(v.Msg.GetChanges()) == 0 || v.Msg.GetClusterVersion() != fsm.Latest.String() {
		t.Fatalf("validate: %v, %v", v, err)
	}
	if _, err := api.Downgrade(ctx, connect.NewRequest(&clusterv1.DowngradeRequest{Action: clusterv1.DowngradeAction_DOWNGRADE_ACTION_ENABLE, Version: "0.0"})); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "every node at 0.0", func() error {
		for _, n := range pc.c.Nodes() {
			if got := n.ClusterVersion(); got != fsm.Version0_0 {
				return fmt.Errorf("%s at %s", n.Name, got)
			}
		}
		return nil
	})
	agree("a downgrade enabled")
	// Each node's newest snapshot is one the older release restores.
	agenttest.Eventually(t, waitFor, "a snapshot at 0.0 on every node", func() error {
		for i, n := range pc.c.Nodes() {
			if vs := snapshotVersions(t, pc.c.Dir(i)); len(vs) == 0 || vs[0] != fsm.Version0_0 {
				return fmt.Errorf("%s: snapshots at %v (newest first)", n.Name, vs)
			}
		}
		return nil
	})
	// The newer features are off, and say what to do.
	_, err = pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "after", Vcpus: 1, MemoryMib: 256}, Host: "node3"})
	if toStatus(err).Code() != codes.FailedPrecondition || !strings.Contains(err.Error(), "needs cluster version "+fsm.Latest.String()) {
		t.Errorf("a create on another node at 0.0: %v, want FailedPrecondition", err)
	}
	_, err = api.Heartbeat(ctx, connect.NewRequest(&clusterv1.HeartbeatRequest{Service: "web", InstanceId: "w2", Health: clusterv1.Health_HEALTH_CRITICAL}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("a heartbeat with a health at 0.0: %v, want FailedPrecondition", err)
	}
	// The hold keeps the version down although every server runs the
	// latest release; cancel ends it.
	time.Sleep(3 * time.Second) // longer than the leader's version interval: nothing raises it
	if got := pc.c.Node(0).ClusterVersion(); got != fsm.Version0_0 {
		t.Fatalf("the downgrade did not hold: %s", got)
	}
	if _, err := api.Downgrade(ctx, connect.NewRequest(&clusterv1.DowngradeRequest{Action: clusterv1.DowngradeAction_DOWNGRADE_ACTION_CANCEL})); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "every node back at the latest version", func() error {
		for _, n := range pc.c.Nodes() {
			if got := n.ClusterVersion(); got != fsm.Latest {
				return fmt.Errorf("%s at %s", n.Name, got)
			}
		}
		return nil
	})
	agree("a downgrade cancelled")
	// Raised again, no node keeps a snapshot the older release could
	// restore (and then replay entries it does not know).
	agenttest.Eventually(t, waitFor, "only snapshots at the latest version on every node", func() error {
		for i, n := range pc.c.Nodes() {
			vs := snapshotVersions(t, pc.c.Dir(i))
			if len(vs) == 0 {
				return fmt.Errorf("%s: no snapshot", n.Name)
			}
			for _, v := range vs {
				if v != fsm.Latest {
					return fmt.Errorf("%s: snapshots at %v (newest first)", n.Name, vs)
				}
			}
		}
		return nil
	})
	if _, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "after", Vcpus: 1, MemoryMib: 256}, Host: "node3"}); err != nil {
		t.Errorf("a create on another node after the cancel: %v", err)
	}
}

// TestStoppedStateMachine: an entry this release cannot apply (a cluster
// version newer than it knows) stops every node's state machine; /ready
// fails naming the release needed, no snapshot is taken, and a restart
// stops at the same entry, with the data kept.
func TestStoppedStateMachine(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	leader := c.WaitLeader(waitFor)
	cmd := &fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_SetClusterVersion{SetClusterVersion: &fsmv1.SetClusterVersion{Major: 0, Minor: 99}}}
	data, err := fsm.Encode(cmd)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	if _, _, err := leader.Store().Apply(ctx, data); err != nil && !errors.Is(err, fsm.ErrNeedsNewerVersion) {
		t.Fatalf("propose: %v", err)
	}
	ready := func(n *agenttest.Node) (string, map[string]string) {
		resp, err := http.Get("http://" + n.MetricsAddr() + "/ready")
		if err != nil {
			return "", nil
		}
		defer resp.Body.Close()
		var body struct {
			Status string            `json:"status"`
			Checks map[string]string `json:"checks"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return body.Status, body.Checks
	}
	agenttest.Eventually(t, waitFor, "every node stopped and not ready", func() error {
		for _, n := range c.Nodes() {
			if n.FSM().Halted() == nil {
				return fmt.Errorf("%s applies on", n.Name)
			}
			status, checks := ready(n)
			if status != "not ready" || !strings.Contains(checks["fsm"], "0.99") {
				return fmt.Errorf("%s: /ready %s %v", n.Name, status, checks)
			}
		}
		return nil
	})
	for _, n := range c.Nodes() {
		if _, _, err := n.Store().Snapshot(ctx); err == nil {
			t.Errorf("%s took a snapshot while stopped", n.Name)
		}
	}
	f := c.Follower()
	i := c.Index(f)
	c.Kill(i)
	r := c.Restart(i, false, c.Node((i+1)%3).GossipAddr())
	agenttest.Eventually(t, waitFor, r.Name+" stopped again after its restart", func() error {
		if h := r.FSM().Halted(); h == nil || !strings.Contains(h.Error(), "0.99") {
			return fmt.Errorf("halted: %v", h)
		}
		return nil
	})
}

// snapshotVersions is the cluster version of each Raft snapshot kept in
// the data dir, newest first.
func snapshotVersions(t *testing.T, dataDir string) []fsm.Version {
	t.Helper()
	snaps, err := raft.NewFileSnapshotStore(filepath.Join(dataDir, "raft"), 10, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	list, err := snaps.List()
	if err != nil {
		t.Fatal(err)
	}
	var out []fsm.Version
	for _, m := range list {
		_, rc, err := snaps.Open(m.ID)
		if err != nil {
			continue // removed meanwhile
		}
		hdr, err := fsm.ReadSnapshotHeader(rc)
		rc.Close()
		if err != nil {
			t.Fatalf("snapshot %s: %v", m.ID, err)
		}
		out = append(out, fsm.Version{Major: hdr.GetClusterVersion().GetMajor(), Minor: hdr.GetClusterVersion().GetMinor()})
	}
	return out
}
