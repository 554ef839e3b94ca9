package cluster

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/fsm"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// fakeRaft is an in-memory Raft configuration that applies the same
// idempotent semantics as store: AddVoter promotes or re-addresses,
// AddNonvoter never demotes, RemoveServer of an absent server is a no-op.
type fakeRaft struct {
	servers map[string]RaftServer
	calls   []string
}

func newFakeRaft(servers ...RaftServer) *fakeRaft {
	f := &fakeRaft{servers: map[string]RaftServer{}}
	for _, s := range servers {
		f.servers[s.ID] = s
	}
	return f
}

func (f *fakeRaft) Servers(context.Context) ([]RaftServer, error) {
	out := make([]RaftServer, 0, len(f.servers))
	for _, s := range f.servers {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func (f *fakeRaft) AddVoter(_ context.Context, id, addr string) error {
	f.calls = append(f.calls, "voter "+id)
	f.servers[id] = RaftServer{ID: id, Address: addr, Voter: true}
	return nil
}

func (f *fakeRaft) AddNonvoter(_ context.Context, id, addr string) error {
	f.calls = append(f.calls, "nonvoter "+id)
	s, ok := f.servers[id]
	if ok && s.Voter {
		s.Address = addr
		f.servers[id] = s
		return nil
	}
	f.servers[id] = RaftServer{ID: id, Address: addr}
	return nil
}

func (f *fakeRaft) RemoveServer(_ context.Context, id string) error {
	f.calls = append(f.calls, "remove "+id)
	delete(f.servers, id)
	return nil
}

func (f *fakeRaft) summary() string {
	s, _ := f.Servers(context.Background())
	out := ""
	for _, srv := range s {
		kind := "n"
		if srv.Voter {
			kind = "v"
		}
		out += fmt.Sprintf("%s:%s@%s ", srv.ID, kind, srv.Address)
	}
	return out
}

type fakeMembers []Member

func (m fakeMembers) Members() []Member { return m }
func (m fakeMembers) Subscribe() (<-chan struct{}, func()) {
	return make(chan struct{}), func() {}
}

func member(id string, st MemberStatus, since time.Time) Member {
	return Member{Name: "n-" + id, Status: st, Since: since, Meta: NodeMeta{ID: id, Role: RoleServer, RaftAddr: "addr-" + id, InternalAddr: "int-" + id}}
}

// healthyPeers answers status queries for the given node IDs, caught up.
func healthyPeers(ids ...string) fakePeers {
	p := fakePeers{}
	for _, id := range ids {
		p["int-"+id] = &nodev1.StatusResponse{NodeId: id}
	}
	return p
}

func TestReconcile(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	long := now.Add(-time.Hour)
	fresh := now.Add(-time.Second)
	v := func(id string) RaftServer { return RaftServer{ID: id, Address: "addr-" + id, Voter: true} }
	nv := func(id string) RaftServer { return RaftServer{ID: id, Address: "addr-" + id} }
	for _, tc := range []struct {
		name    string
		voters  int
		cleanup time.Duration
		raft    []RaftServer
		members []Member
		peers   fakePeers
		want    string
	}{
		{
			name: "adds alive servers as non-voters and promotes healthy ones up to the target",
			raft: []RaftServer{v("a")}, voters: 3,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusAlive, long), member("d", StatusAlive, long)},
			peers:   healthyPeers("b", "c", "d"),
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c d:n@addr-d ",
		},
		{
			name: "an unreachable newcomer stays a non-voter",
			raft: []RaftServer{v("a")}, voters: 3,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long)},
			want:    "a:v@addr-a b:n@addr-b ",
		},
		{
			name: "a server that left is removed even from a two-voter cluster",
			raft: []RaftServer{v("a"), v("b")}, voters: 3,
			members: []Member{member("a", StatusAlive, long), member("b", StatusLeft, fresh)},
			want:    "a:v@addr-a ",
		},
		{
			name: "follows an address change under the same id",
			raft: []RaftServer{v("a"), {ID: "b", Address: "old", Voter: true}}, voters: 3,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long)},
			want:    "a:v@addr-a b:v@addr-b ",
		},
		{
			name: "removes a server that left, at once",
			raft: []RaftServer{v("a"), v("b"), v("c")}, voters: 3, cleanup: 0,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusLeft, fresh)},
			want:    "a:v@addr-a b:v@addr-b ",
		},
		{
			name: "keeps a failed server before the threshold",
			raft: []RaftServer{v("a"), v("b"), v("c")}, voters: 3, cleanup: time.Minute,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusFailed, fresh)},
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c ",
		},
		{
			name: "removes a failed voter past the threshold and promotes a non-voter",
			raft: []RaftServer{v("a"), v("b"), v("c"), nv("d")}, voters: 3, cleanup: time.Minute,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusFailed, long), member("d", StatusAlive, long)},
			peers:   healthyPeers("d"),
			want:    "a:v@addr-a b:v@addr-b d:v@addr-d ",
		},
		{
			name: "removes failed voters while the live ones keep a quorum",
			raft: []RaftServer{v("a"), v("b"), v("c"), v("d")}, voters: 5, cleanup: time.Minute,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusFailed, long), member("d", StatusFailed, long)},
			want:    "a:v@addr-a b:v@addr-b ",
		},
		{
			name: "never removes a voter when the rest would lack a quorum",
			raft: []RaftServer{v("a"), v("b"), v("c")}, voters: 3, cleanup: time.Minute,
			members: []Member{member("a", StatusAlive, long), member("b", StatusFailed, long), member("c", StatusFailed, long)},
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c ",
		},
		{
			name: "leaves an id claimed by two live members alone",
			raft: []RaftServer{v("a")}, voters: 3,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), {Name: "clone", Status: StatusAlive, Meta: NodeMeta{ID: "b", Role: RoleServer, RaftAddr: "other"}}},
			peers:   healthyPeers("b"),
			want:    "a:v@addr-a ",
		},
		{
			name: "cleanup disabled keeps failed servers",
			raft: []RaftServer{v("a"), v("b"), v("c")}, voters: 3, cleanup: 0,
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusFailed, long)},
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c ",
		},
		{
			name: "ignores non-server members and never removes itself",
			raft: []RaftServer{v("a")}, voters: 3, cleanup: time.Second,
			members: []Member{member("a", StatusFailed, long), {Name: "client", Status: StatusAlive, Meta: NodeMeta{ID: "x", Role: "client"}}},
			want:    "a:v@addr-a ",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raft := newFakeRaft(tc.raft...)
			r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: tc.voters, DeadServerCleanup: tc.cleanup, Now: func() time.Time { return now }},
				raft, fakeMembers(tc.members), tc.peers)
			if err := r.Reconcile(context.Background()); err != nil {
				t.Fatalf("reconcile: %v", err)
			}
			if got := raft.summary(); got != tc.want {
				t.Fatalf("configuration:\n got %s\nwant %s\ncalls %v", got, tc.want, raft.calls)
			}
			// A second pass changes nothing: reconciliation is idempotent.
			calls := len(raft.calls)
			if err := r.Reconcile(context.Background()); err != nil {
				t.Fatalf("second reconcile: %v", err)
			}
			if len(raft.calls) != calls {
				t.Fatalf("second pass made calls %v", raft.calls[calls:])
			}
		})
	}
}

func TestReconcileRemovesServersUnknownToGossip(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := now
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true}, RaftServer{ID: "b", Address: "addr-b", Voter: true}, RaftServer{ID: "gone", Address: "x", Voter: true})
	members := fakeMembers{member("a", StatusAlive, now), member("b", StatusAlive, now)}
	r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: 3, DeadServerCleanup: time.Minute, Now: func() time.Time { return clock }}, raft, members, fakePeers{})
	if err := r.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, ok := raft.servers["gone"]; !ok {
		t.Fatal("removed a server unknown to gossip before the threshold")
	}
	clock = now.Add(2 * time.Minute)
	if err := r.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, ok := raft.servers["gone"]; ok {
		t.Fatal("server unknown to gossip past the threshold was not removed")
	}
}

func TestPromotionWaitsForStabilization(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := now
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true})
	members := fakeMembers{member("a", StatusAlive, now), member("b", StatusAlive, now)}
	peers := healthyPeers("b")
	r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: 3, Stabilization: 10 * time.Second, Now: func() time.Time { return clock }}, raft, members, peers)
	for _, step := range []struct {
		after time.Duration
		want  string
	}{
		{0, "a:v@addr-a b:n@addr-b "},
		{5 * time.Second, "a:v@addr-a b:n@addr-b "},
		{11 * time.Second, "a:v@addr-a b:v@addr-b "},
	} {
		clock = now.Add(step.after)
		if err := r.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := raft.summary(); got != step.want {
			t.Fatalf("after %s: got %s, want %s", step.after, got, step.want)
		}
	}
}

func TestLaggingNonVoterIsNotPromoted(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true})
	members := fakeMembers{member("a", StatusAlive, now), member("b", StatusAlive, now)}
	peers := fakePeers{"int-b": &nodev1.StatusResponse{NodeId: "b", LastIndex: 10}}
	r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: 3, MaxTrailingLogs: 100, LeaderLastIndex: func() uint64 { return 5000 }, Now: func() time.Time { return now }}, raft, members, peers)
	if err := r.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := raft.summary(); got != "a:v@addr-a b:n@addr-b " {
		t.Fatalf("got %s: a non-voter 4990 entries behind was promoted", got)
	}
}

// TestServersOlderThanTheClusterVersion: a member that announces a version
// older than the cluster version (a release before cluster versions, or an
// older minor) is not added, and one already a non-voter is not promoted,
// with the reason in the report; once it announces the cluster version it
// is, as any other.
func TestServersOlderThanTheClusterVersion(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(id, release, cv string, protocol int) Member {
		m := member(id, StatusAlive, now)
		m.Meta.Version, m.Meta.ClusterVersion, m.Meta.Protocol = release, cv, protocol
		return m
	}
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true}, RaftServer{ID: "c", Address: "addr-c"})
	members := fakeMembers{
		at("a", "0.1.0", "0.1", 2),
		at("b", "0.0.0", "", 0),           // before cluster versions
		at("c", "0.0.0", "", 0),           // upgraded in place back to 0.0.0: a non-voter already
		at("d", "9.9.9-custom", "0.1", 2), // a release string of its own; the version it announces counts
	}
	r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: 3, ClusterVersion: func() fsm.Version { return fsm.Version0_1 },
		Now: func() time.Time { return now }}, raft, members, healthyPeers("b", "c", "d"))
	if err := r.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := raft.summary(), "a:v@addr-a c:n@addr-c d:v@addr-d "; got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
	rep := r.Report().Servers
	for id, want := range map[string]string{"b": "not added: it runs release 0.0.0 (cluster version 0.0), older than the cluster version 0.1",
		"c": "non-voter, not promoted: it runs release 0.0.0"} {
		if !strings.HasPrefix(rep[id].Status, want) {
			t.Errorf("report of %s: %q, want it to start with %q", id, rep[id].Status, want)
		}
	}
	members[1], members[2] = at("b", "0.1.0", "0.1", 2), at("c", "0.1.0", "0.1", 2)
	if err := r.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := raft.summary(), "a:v@addr-a b:v@addr-b c:n@addr-c d:v@addr-d "; got != want {
		t.Fatalf("upgraded: got %s, want %s", got, want)
	}
	if st := r.Report().Servers["c"].Status; strings.Contains(st, "older than the cluster version") {
		t.Errorf("c upgraded, still reported as too old: %q", st)
	}
}

// A server an operator removed (remove-peer) while gossip still shows its
// member alive — killed moments before, not yet detected — is not added
// back; once its member changes (it restarted, rejoined) it is.
func TestOperatorRemovalIsNotUndone(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true}, RaftServer{ID: "b", Address: "addr-b", Voter: true}, RaftServer{ID: "c", Address: "addr-c", Voter: true})
	members := fakeMembers{member("a", StatusAlive, now), member("b", StatusAlive, now), member("c", StatusAlive, now)}
	for i := range members {
		members[i].Changed = now
	}
	peers := healthyPeers("a", "b", "c")
	r := NewReconciler(ReconcileConfig{SelfID: "a", Voters: 3, Now: func() time.Time { return now }}, raft, members, peers)
	pass := func() {
		t.Helper()
		if err := r.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	pass()
	// c was killed and removed before gossip noticed: it still looks alive
	// but does not answer.
	delete(peers, "int-c")
	if err := raft.RemoveServer(context.Background(), "c"); err != nil { // the operator's remove-peer
		t.Fatal(err)
	}
	pass()
	pass()
	if _, ok := raft.servers["c"]; ok {
		t.Fatalf("a server removed by an operator was added back while its member is unchanged and it does not answer: %s", raft.summary())
	}
	if st := r.Report().Servers["c"].Status; !strings.Contains(st, "removed from raft by an operator") {
		t.Fatalf("report for c: %q", st)
	}
	members[2].Changed = now.Add(time.Minute) // restarted
	pass()
	if !strings.Contains(strings.Join(raft.calls, ","), "nonvoter c") {
		t.Fatalf("restarted server not added back: %s (calls %v)", raft.summary(), raft.calls)
	}
	// A server the reconciler itself adds is no operator removal.
	if len(r.removed) != 0 {
		t.Fatalf("removals still recorded: %v", r.removed)
	}

	// A live server removed by an operator answers on its internal port:
	// added back at once, not stranded without a leader until it restarts.
	peers["int-c"] = &nodev1.StatusResponse{NodeId: "c"}
	raft.calls = nil
	if err := raft.RemoveServer(context.Background(), "c"); err != nil {
		t.Fatal(err)
	}
	pass()
	if _, ok := raft.servers["c"]; !ok {
		t.Fatalf("a live server removed by an operator was not added back: %s (report %q)", raft.summary(), r.Report().Servers["c"].Status)
	}
}
