package gateway

import (
	"context"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

func sampleAt(i int) *clusterv1.MetricsSample {
	return &clusterv1.MetricsSample{Time: timestamppb.New(time.Unix(int64(i), 0)), ApiRequests: uint64(i)}
}

// The ring keeps the newest MetricsSamples, oldest first, once it wrapped.
func TestMetricsHistoryWraps(t *testing.T) {
	h := NewMetricsHistory(0)
	for i := range 50 {
		h.Add(sampleAt(i))
	}
	if got := h.Samples(); len(got) != 50 || got[0].GetApiRequests() != 0 || got[49].GetApiRequests() != 49 {
		t.Fatalf("before wrapping: %d samples from %d to %d, want 50 from 0 to 49", len(got), got[0].GetApiRequests(), got[len(got)-1].GetApiRequests())
	}
	for i := 50; i < 130; i++ {
		h.Add(sampleAt(i))
	}
	got := h.Samples()
	if len(got) != MetricsSamples {
		t.Fatalf("after 130 samples: %d kept, want %d", len(got), MetricsSamples)
	}
	for i, s := range got {
		if want := uint64(130 - MetricsSamples + i); s.GetApiRequests() != want {
			t.Fatalf("sample %d is #%d, want #%d (oldest first)", i, s.GetApiRequests(), want)
		}
	}
}

// WatchMetrics sends the history first, then each sample the sampler
// takes on its ticks.
func TestWatchMetricsHistoryThenLive(t *testing.T) {
	h := NewMetricsHistory(4)
	tick := make(chan time.Time)
	taken := make(chan struct{}, 16)
	var n int
	sample := func(_ context.Context, at time.Time) *clusterv1.MetricsSample {
		n++
		defer func() { taken <- struct{}{} }()
		return &clusterv1.MetricsSample{Time: timestamppb.New(at), ApiRequests: uint64(n)}
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		h.Run(ctx, tick, func() time.Time { return time.Unix(1000, 0) }, sample)
	}()
	t.Cleanup(func() { cancel(); <-ran })
	wait := func() {
		t.Helper()
		select {
		case <-taken:
		case <-time.After(5 * time.Second):
			t.Fatal("no sample taken within 5s")
		}
	}
	wait() // the one at once
	// Wrap the ring: samples 1..6, of which 3..6 are kept.
	for i := range 5 {
		tick <- time.Unix(int64(1001+i), 0)
		wait()
	}

	s := NewAgentService(AgentServiceConfig{NodeName: "n1", History: h}, nil, nil)
	out := make(chan *clusterv1.WatchMetricsResponse, 16)
	sctx, scancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- s.watchMetrics(sctx, &clusterv1.WatchMetricsRequest{}, func(m *clusterv1.WatchMetricsResponse) error {
			out <- m
			return nil
		})
	}()
	recv := func() *clusterv1.WatchMetricsResponse {
		t.Helper()
		select {
		case m := <-out:
			return m
		case <-time.After(5 * time.Second):
			t.Fatal("no message within 5s")
			return nil
		}
	}
	first := recv()
	if first.GetNode() != "n1" || first.GetSample() != nil || first.GetInterval().AsDuration() != MetricsInterval {
		t.Fatalf("first message %v, want node n1, the interval and the history alone", first)
	}
	var got []uint64
	for _, x := range first.GetHistory() {
		got = append(got, x.GetApiRequests())
	}
	if len(got) != 4 || got[0] != 3 || got[3] != 6 {
		t.Fatalf("history %v, want samples 3 to 6", got)
	}
	tick <- time.Unix(2000, 0)
	live := recv()
	if len(live.GetHistory()) != 0 || live.GetSample().GetApiRequests() != 7 || !live.GetSample().GetTime().AsTime().Equal(time.Unix(2000, 0)) {
		t.Fatalf("live message %v, want sample 7 of the tick's time alone", live)
	}
	scancel()
	if err := <-done; err != nil {
		t.Fatalf("stream ended with %v, want nil when its client went away", err)
	}
}

// A watcher that stops reading is cut off after metricsSubBuffer samples
// instead of holding the sampler up; its stream ends with an error that
// says to reconnect.
func TestMetricsHistorySlowWatcherCutOff(t *testing.T) {
	h := NewMetricsHistory(0)
	_, next, stop := h.Subscribe()
	defer stop()
	for i := range metricsSubBuffer + 1 {
		h.Add(sampleAt(i))
	}
	var got int
	for range next {
		got++
	}
	if got != metricsSubBuffer {
		t.Fatalf("%d samples before the channel closed, want %d", got, metricsSubBuffer)
	}

	s := NewAgentService(AgentServiceConfig{NodeName: "n1", History: h}, nil, nil)
	block := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		first := true
		done <- s.watchMetrics(context.Background(), &clusterv1.WatchMetricsRequest{}, func(*clusterv1.WatchMetricsResponse) error {
			if first {
				first = false
				<-block // the client stops reading
			}
			return nil
		})
	}()
	// The stream subscribed before its first send: fill its buffer and
	// one more while it is stuck.
	deadline := time.Now().Add(5 * time.Second)
	for {
		h.mu.Lock()
		subs := len(h.subs)
		h.mu.Unlock()
		if subs == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the stream did not subscribe within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for i := range metricsSubBuffer + 1 {
		h.Add(sampleAt(100 + i))
	}
	close(block)
	select {
	case err := <-done:
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("stuck stream ended with %v, want ResourceExhausted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stuck stream did not end within 5s")
	}
}

// A node without a history answers Unimplemented; an unknown node is
// NotFound (the relay's lookup, as Monitor's).
func TestWatchMetricsRefusals(t *testing.T) {
	s := NewAgentService(AgentServiceConfig{NodeName: "n1"}, newWatchCluster(), nil)
	send := func(*clusterv1.WatchMetricsResponse) error { return errors.New("nothing should be sent") }
	if err := s.watchMetrics(context.Background(), &clusterv1.WatchMetricsRequest{}, send); connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("no history: got %v, want Unimplemented", err)
	}
	if err := s.watchMetrics(context.Background(), &clusterv1.WatchMetricsRequest{Node: "nope"}, send); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("unknown node: got %v, want NotFound", err)
	}
}

// replicationOf leaves the leader out and reports an unreachable server
// without numbers.
func TestReplicationOf(t *testing.T) {
	got := replicationOf([]*clusterv1.Peer{
		{NodeId: "n1", State: clusterv1.RaftState_RAFT_STATE_LEADER, Voter: true},
		{NodeId: "n2", Name: "b", State: clusterv1.RaftState_RAFT_STATE_FOLLOWER, Voter: true, Trailing: 12, LastContact: durationpb.New(1500 * time.Millisecond)},
		{NodeId: "n3", State: clusterv1.RaftState_RAFT_STATE_UNREACHABLE, Trailing: 99},
	}, "n1")
	if len(got) != 2 {
		t.Fatalf("%d peers, want 2 (the leader left out)", len(got))
	}
	if p := got[0]; p.GetNodeId() != "n2" || p.GetName() != "b" || !p.GetReachable() || !p.GetVoter() || p.GetLag() != 12 || p.GetLastContactMs() != 1500 {
		t.Errorf("n2: %v, want reachable voter b, lag 12, last contact 1500ms", p)
	}
	if p := got[1]; p.GetReachable() || p.GetLag() != 0 {
		t.Errorf("n3: %v, want unreachable with no lag", p)
	}
}
