package main

import (
	"strings"
	"testing"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// cluster members --watch prints the members of the status stream each
// time they change, and not again for a snapshot with the same members.
func TestClusterMembersWatch(t *testing.T) {
	f := newFakeCluster()
	alive := &clusterv1.Member{Name: "n2", NodeId: "id-2", Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE}
	failed := &clusterv1.Member{Name: "n2", NodeId: "id-2", Status: clusterv1.MemberStatus_MEMBER_STATUS_FAILED}
	self := &clusterv1.Member{Name: "n1", NodeId: "id-1", Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE}
	f.watch = []*clusterv1.WatchStatusResponse{
		{Node: "n1", Members: []*clusterv1.Member{self, alive}},
		{Node: "n1", Members: []*clusterv1.Member{self, alive}, AutopilotError: "unavailable: no cluster leader"},
		{Node: "n1", Members: []*clusterv1.Member{self, failed}},
	}
	url := f.start(t)

	out := runCLI(t, url, "cluster", "members", "--watch").mustSucceed(t).stdout
	tables := strings.Split(strings.TrimSpace(out), "\n\n")
	if len(tables) != 2 {
		t.Fatalf("%d tables, want 2 (the repeated snapshot not printed):\n%s", len(tables), out)
	}
	if strings.Contains(tables[0], "failed") || !strings.Contains(tables[1], "failed") {
		t.Errorf("tables:\n%s\nwant n2 alive, then failed", out)
	}
	calls := f.recorded()
	if len(calls) != 1 || calls[0].procedure != "/pivirt.cluster.v1.ClusterService/WatchStatus" {
		t.Errorf("calls %v, want one WatchStatus", calls)
	}

	out = runCLI(t, url, "-o", "json", "cluster", "members", "--watch").mustSucceed(t).stdout
	if n := strings.Count(out, `"members"`); n != 2 {
		t.Errorf("-o json: %d objects, want 2:\n%s", n, out)
	}
	out = runCLI(t, url, "-o", "yaml", "cluster", "members", "--watch").mustSucceed(t).stdout
	if n := strings.Count(out, "\n---\n"); n != 1 {
		t.Errorf("-o yaml: %d document markers, want 1 between 2 documents:\n%s", n, out)
	}
}
