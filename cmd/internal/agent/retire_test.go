package agent_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/mesh"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// TestRetiredNodesLeaveEveryList: a node that leaves (cluster leave) and
// one that died and is forced to leave with --prune are retired: their
// objects leave the placement catalog, a call for one is NotFound, lists
// and watches through every other node name no node as unavailable, the
// members forget the pruned one, and force-leave succeeds on a dead node
// whatever each member remembers of it.
func TestRetiredNodesLeaveEveryList(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	pc := startPlacedClusterWith(t, 5, func(mutate func(int, *config.Config)) *agenttest.Cluster {
		return agenttest.NewExpect(t, 5, func(i int, cfg *config.Config) {
			mutate(i, cfg)
			cfg.Cluster.Raft.Voters = 5
		})
	})
	onNode := map[string]string{}
	for _, host := range []string{"node4", "node5"} {
		r, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-" + host, Vcpus: 1, MemoryMib: 256}, Host: host})
		if err != nil {
			t.Fatal(err)
		}
		onNode[host] = r.GetVm().GetId()
	}
	if _, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-node2", Vcpus: 1, MemoryMib: 256}, Host: "node2"}); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "the catalog holds node4's and node5's VMs", func() error {
		for host, id := range onNode {
			if p, err := pc.c.Node(0).FSM().State().Placement("virtualmachines", id); err != nil || p.GetNode() != host {
				return fmt.Errorf("%s: %v, %v", id, p, err)
			}
		}
		return nil
	})

	// node4 leaves gracefully.
	n4 := pc.c.Node(3)
	if _, err := n4.API.Leave(ctx, connect.NewRequest(&clusterv1.LeaveRequest{})); err != nil {
		t.Fatalf("leave: %v", err)
	}
	select {
	case <-n4.Done():
	case <-time.After(waitFor):
		t.Fatal("node4 did not stop after leave")
	}
	// node5 dies, and is forced to leave with --prune once every member
	// sees it failed.
	pc.c.Kill(4)
	// node1 tells every member it sees alive: wait for its view to have
	// node4 gone too — left, or failed when node1's failure detector
	// caught node4 stopping before the leave's broadcast reached it (on a
	// loaded machine; memberlist then keeps it failed).
	agenttest.Eventually(t, waitFor, "node5 failed and node4 gone in node1's view", func() error {
		members, err := pc.c.Node(0).API.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
		if err != nil {
			return err
		}
		for _, m := range members.Msg.GetMembers() {
			if m.GetName() == "node5" && m.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
				return fmt.Errorf("node1 sees node5 %v", m.GetStatus())
			}
			if m.GetName() == "node4" && m.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_LEFT && m.GetStatus() != clusterv1.MemberStatus_MEMBER_STATUS_FAILED {
				return fmt.Errorf("node1 sees node4 %v", m.GetStatus())
			}
		}
		return nil
	})
	resp, err := pc.c.Node(0).API.ForceLeave(ctx, connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: "node5", Prune: true}))
	if err != nil {
		t.Fatalf("force-leave --prune node5: %v", err)
	}
	for _, n := range resp.Msg.GetNodes() {
		if n.GetError() != "" {
			t.Errorf("force-leave on %s: %s", n.GetNode(), n.GetError())
		}
	}
	// Again, with node5 forgotten everywhere: refused as unknown, not as
	// members that could not be told.
	if _, err := pc.c.Node(0).API.ForceLeave(ctx, connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: "node5", Prune: true})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a second force-leave of node5: %v, want NotFound", err)
	}

	for via := range 3 {
		agenttest.Eventually(t, waitFor, fmt.Sprintf("node%d's lists without the retired nodes", via+1), func() error {
			var hdr metadata.MD
			list, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{}, grpc.Header(&hdr))
			if err != nil {
				return err
			}
			if u := hdr.Get(mesh.UnavailableNodesHeader); len(u) > 0 {
				return fmt.Errorf("the list names unavailable nodes: %s", strings.Join(u, "; "))
			}
			if len(list.GetVms()) != 1 {
				return fmt.Errorf("%d VMs listed, want node2's only", len(list.GetVms()))
			}
			for host, id := range onNode {
				if p, err := pc.c.Node(via).FSM().State().Placement("virtualmachines", id); err != nil || p != nil {
					return fmt.Errorf("the catalog still places %s on %s: %v, %v", id, host, p, err)
				}
				if _, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id}); toStatus(err).Code() != codes.NotFound {
					return fmt.Errorf("get %s (on %s): %v, want NotFound", id, host, err)
				}
			}
			members, err := pc.c.Node(via).API.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
			if err != nil {
				return err
			}
			for _, m := range members.Msg.GetMembers() {
				if m.GetName() == "node5" {
					return fmt.Errorf("node%d still lists node5 (%v) after --prune", via+1, m.GetStatus())
				}
			}
			return nil
		})
	}
	pc.c.WaitPeers(waitFor, 3, 0)
}
