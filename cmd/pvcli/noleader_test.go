package main

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// TestNoLeaderHint: an agent's answer that the cluster has no leader (its
// ErrorInfo reason) is printed whole, with a hint that names stale reads.
func TestNoLeaderHint(t *testing.T) {
	t.Parallel()
	msg := "no cluster leader after waiting 7s: none since 2026-01-02T03:04:05Z (9s ago); 1 of 3 voters reachable from node3 (unreachable: node1, node2), electing a leader needs 2; reads with consistency stale are still served by every agent (pvcli --consistency stale)"
	ce := connect.NewError(connect.CodeUnavailable, errors.New(msg))
	d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: reasonNoLeader, Domain: "pivirt.pilab.hu", Metadata: map[string]string{"voters": "3", "voters_reachable": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	ce.AddDetail(d)
	fake := newFakeCluster()
	url := fake.start(t)
	fake.failAlways(clusterv1connect.ClusterServiceListServicesProcedure, ce)

	r := runCLI(t, url, "--timeout", "700ms", "service", "list")
	if got := exitCode(r.err); got != 1 {
		t.Errorf("exit code %d, want 1 (%v)", got, r.err)
	}
	for _, want := range []string{"Error: unavailable: " + msg + "\n", "The cluster has no leader", "--consistency stale"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr does not say %q:\n%s", want, r.stderr)
		}
	}
}

// TestRetryKeepsReasonWhenAgentAnswersDeadline: when the agent answers
// "deadline exceeded" to a retry (its copy of the deadline ran out first),
// pvcli reports why it was retrying.
func TestRetryKeepsReasonWhenAgentAnswersDeadline(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	fake.failNext(clusterv1connect.ClusterServiceListServicesProcedure, errNoLeader,
		connect.NewError(connect.CodeDeadlineExceeded, errors.New("context deadline exceeded")))

	r := runCLI(t, url, "service", "list")
	if want := "Error: unavailable: no cluster leader\n"; r.stderr != want {
		t.Errorf("stderr = %q, want %q", r.stderr, want)
	}
}
