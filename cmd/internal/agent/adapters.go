package agent

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/gateway"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/store"
)

// raftAdapter presents the store through the interfaces that cluster and
// gateway declare; siblings never import each other, so the conversion of
// their small value types happens here.
type raftAdapter struct {
	s      *store.Store
	expect int
	name   string
	view   *cluster.BootstrapView
	// applyTime observes the time of each proposal until it is applied.
	applyTime prometheus.Observer
	tracer    trace.Tracer
}

var (
	_ cluster.Bootstrapper = raftAdapter{}
	_ cluster.VoterManager = raftAdapter{}
	_ cluster.StatusSource = raftAdapter{}
	_ gateway.Consensus    = raftAdapter{}
	_ gateway.RaftAdmin    = raftAdapter{}
)

func (a raftAdapter) HasExistingState() bool { return a.s.HasExistingState() }

func (a raftAdapter) Bootstrap(servers []cluster.RaftServer) error {
	out := make([]store.Server, len(servers))
	for i, s := range servers {
		out[i] = store.Server{ID: s.ID, Address: s.Address, Voter: s.Voter}
	}
	return a.s.Bootstrap(out)
}

func (a raftAdapter) Servers(ctx context.Context) ([]cluster.RaftServer, error) {
	servers, err := a.s.Servers(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]cluster.RaftServer, len(servers))
	for i, s := range servers {
		out[i] = cluster.RaftServer{ID: s.ID, Address: s.Address, Voter: s.Voter}
	}
	return out, nil
}

func (a raftAdapter) AddVoter(ctx context.Context, id, addr string) error {
	return a.s.AddVoter(ctx, id, addr)
}

func (a raftAdapter) AddNonvoter(ctx context.Context, id, addr string) error {
	return a.s.AddNonvoter(ctx, id, addr)
}

func (a raftAdapter) RemoveServer(ctx context.Context, id string) error {
	return a.s.RemoveServer(ctx, id)
}

func (a raftAdapter) TransferLeadership(ctx context.Context, id string) (string, error) {
	return a.s.TransferLeadership(ctx, id)
}

func (a raftAdapter) Apply(ctx context.Context, cmd []byte) (any, uint64, error) {
	return observeApply(ctx, a.tracer, a.applyTime, cmd, a.s.Apply)
}

// backend is what the agent's parts need from the state backend: Raft
// (raftAdapter) or etcd (etcdAdapter).
type backend interface {
	gateway.Consensus
	gateway.RaftAdmin
	cluster.StatusSource
}

// observeApply runs apply in a span and observes its time
// (pivirt_raft_apply_duration_seconds).
func observeApply(ctx context.Context, tracer trace.Tracer, applyTime prometheus.Observer, cmd []byte, apply func(context.Context, []byte) (any, uint64, error)) (any, uint64, error) {
	start := time.Now()
	if tracer != nil {
		var span trace.Span
		ctx, span = tracer.Start(ctx, "raft.apply", trace.WithAttributes(attribute.Int("raft.command_bytes", len(cmd))))
		defer span.End()
	}
	resp, index, err := apply(ctx, cmd)
	if applyTime != nil && err == nil {
		applyTime.Observe(time.Since(start).Seconds())
	}
	return resp, index, err
}

func (a raftAdapter) Leader() (string, string) { return a.s.Leader() }

func (a raftAdapter) VerifyLeader(ctx context.Context) error { return a.s.VerifyLeader(ctx) }

func (a raftAdapter) ReadIndex(ctx context.Context) (uint64, error) { return a.s.ReadIndex(ctx) }

func (a raftAdapter) RaftStatus() gateway.RaftStatus {
	st := a.s.Role()
	return gateway.RaftStatus{
		State:        st.State,
		Term:         st.Term,
		LastIndex:    st.LastIndex,
		CommitIndex:  st.CommitIndex,
		AppliedIndex: st.AppliedIndex,
		LastContact:  st.LastContact,
		LeaderID:     st.LeaderID,
		// A no-leader error says since when (gateway/forward.go).
		NoLeaderSince: st.NoLeaderSince,
	}
}

func (a raftAdapter) NodeStatus() *nodev1.StatusResponse {
	st := a.s.Status()
	var contact time.Duration
	if !st.LastContact.IsZero() {
		contact = time.Since(st.LastContact)
	}
	return &nodev1.StatusResponse{
		NodeId:              st.ID,
		Name:                a.name,
		RaftState:           st.State,
		Term:                st.Term,
		LastIndex:           st.LastIndex,
		CommitIndex:         st.CommitIndex,
		AppliedIndex:        st.AppliedIndex,
		LastContact:         durationpb.New(contact),
		HasState:            st.HasState,
		Peers:               int32(st.NumPeers),
		BootstrapExpect:     int32(a.expect),
		LeaderId:            st.LeaderID,
		BootstrapCandidates: a.view.Candidates(),
	}
}
