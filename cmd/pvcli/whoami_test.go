package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// TestWhoAmI: pvcli whoami prints the caller's identity, roles, how it
// authenticated and its token's expiry; --access adds the decision of
// every method, --method asks for some; -o json is the API's answer
// (without the decisions unless asked).
func TestWhoAmI(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	fake.respond(clusterv1connect.ClusterServiceWhoAmIProcedure, &clusterv1.WhoAmIResponse{
		Identity: "alice", Roles: []string{"vm-owner"}, AuthenticatedBy: "token",
		TokenExpiry: timestamppb.New(time.Date(2026, 3, 1, 13, 30, 0, 0, time.UTC)), Node: "node1", Source: "file",
		Access: []*clusterv1.MethodAccess{
			{Method: "/pivirt.cluster.v1.ClusterService/SetConfig", Resource: "config", Verb: "update", Decision: "denied"},
			{Method: "/pivirt.cluster.v1.ClusterService/WhoAmI", Decision: "allowed"},
			{Method: "/pivirt.vm.v1.VMService/PowerOn", Resource: "virtualmachines", Verb: "start", Decision: "conditional"},
		},
	})
	url := fake.start(t)

	r := runCLI(t, url, "whoami").mustSucceed(t)
	for _, want := range []string{"IDENTITY:", "alice", "vm-owner", "AUTHENTICATED BY:", "token", "2026-03-01T13:30:00Z", "the file's RBAC policy on node1"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("whoami output lacks %q:\n%s", want, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "PowerOn") {
		t.Errorf("whoami without --access prints the decisions:\n%s", r.stdout)
	}

	r = runCLI(t, url, "whoami", "--access").mustSucceed(t)
	for _, want := range []string{"METHOD", "DECISION", "/pivirt.vm.v1.VMService/PowerOn", "conditional", "/pivirt.cluster.v1.ClusterService/SetConfig", "denied"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("whoami --access output lacks %q:\n%s", want, r.stdout)
		}
	}

	r = runCLI(t, url, "-o", "json", "whoami").mustSucceed(t)
	var doc map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("whoami -o json: %v\n%s", err, r.stdout)
	}
	if doc["identity"] != "alice" || doc["authenticatedBy"] != "token" || doc["tokenExpiry"] != "2026-03-01T13:30:00Z" || doc["access"] != nil {
		t.Errorf("whoami -o json: %v", doc)
	}
	r = runCLI(t, url, "-o", "json", "whoami", "--method", "VMService/PowerOn", "--method", "ClusterService/SetConfig").mustSucceed(t)
	doc = nil
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || len(doc["access"].([]any)) != 3 {
		t.Errorf("whoami --method -o json: %v %v", doc, err)
	}

	var asked [][]string
	for _, c := range fake.recorded() {
		if c.procedure == clusterv1connect.ClusterServiceWhoAmIProcedure {
			asked = append(asked, c.msg.(*clusterv1.WhoAmIRequest).GetMethods())
		}
	}
	if len(asked) != 4 || len(asked[0]) != 0 || !slices.Equal(asked[3], []string{"VMService/PowerOn", "ClusterService/SetConfig"}) {
		t.Errorf("requests: %q", asked)
	}
}
