package main

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
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

// waitingAgent answers ListServices with its error after waiting wait, as
// an agent answers after its hold timeout, and counts the calls.
type waitingAgent struct {
	clusterv1connect.UnimplementedClusterServiceHandler
	wait  time.Duration
	err   error
	calls atomic.Int32
}

func (w *waitingAgent) ListServices(ctx context.Context, _ *connect.Request[clusterv1.ListServicesRequest]) (*connect.Response[clusterv1.ListServicesResponse], error) {
	w.calls.Add(1)
	t := time.NewTimer(w.wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil, w.err
	case <-ctx.Done():
		return nil, connect.NewError(connect.CodeDeadlineExceeded, ctx.Err())
	}
}

// TestWaitedAnswerNotRetriedPastTheDeadline: an agent's answer after its
// whole wait — no leader, or in etcd mode etcd unavailable — is asked again
// only while another wait as long fits in --timeout: the answer printed
// is a whole wait's, not a cut one ("after waiting 0s").
func TestWaitedAnswerNotRetriedPastTheDeadline(t *testing.T) {
	t.Parallel()
	for _, reason := range []string{reasonNoLeader, reasonStoreUnavailable} {
		t.Run(reason, func(t *testing.T) {
			t.Parallel()
			ce := connect.NewError(connect.CodeUnavailable, errors.New("after waiting 2s: store: etcd unavailable"))
			d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: reason, Domain: "pivirt.pilab.hu"})
			if err != nil {
				t.Fatal(err)
			}
			ce.AddDetail(d)
			agent := &waitingAgent{wait: 2 * time.Second, err: ce}
			mux := http.NewServeMux()
			mux.Handle(clusterv1connect.NewClusterServiceHandler(agent))
			url := serveH2C(t, mux)
			r := runCLI(t, url, "--timeout", "3s", "service", "list")
			if n := agent.calls.Load(); n != 1 {
				t.Errorf("%d calls, want 1: a second wait of 2s does not fit in the 1s left", n)
			}
			if !strings.Contains(r.stderr, "after waiting 2s: store: etcd unavailable") {
				t.Errorf("stderr:\n%s\nwant the whole wait's answer", r.stderr)
			}
		})
	}
}
