package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// testIdentities makes a CA and agent certificates for names, and returns
// a chain verifier of that CA and each name's certificate.
func testIdentities(t *testing.T, names ...string) (identity.ChainVerifier, map[string]*tls.Certificate) {
	t.Helper()
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	certs := make(map[string]*tls.Certificate)
	for _, n := range append(names, "leader") {
		f, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: identity.AgentPrefix + n})
		if err != nil {
			t.Fatal(err)
		}
		c, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			t.Fatal(err)
		}
		certs[n] = &c
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: filepath.Join(dir, identity.AgentPrefix+"leader.crt"),
		KeyFile: filepath.Join(dir, identity.AgentPrefix+"leader.key"), CAFile: filepath.Join(dir, identity.ChainFile)})
	if err != nil {
		t.Fatal(err)
	}
	return src.VerifyChain, certs
}

// provingPeer answers status queries at an internal address as a node
// would: with its ID and a proof of the claim it makes, signed by cert.
type provingPeer struct {
	claim identity.NodeClaim
	cert  *tls.Certificate
	asked atomic.Int32
}

func (p *provingPeer) answer(nonce []byte) (*nodev1.StatusResponse, error) {
	p.asked.Add(1)
	pr, err := identity.ProveNodeClaim(p.cert, p.claim, nonce)
	if err != nil {
		return nil, err
	}
	return &nodev1.StatusResponse{NodeId: p.claim.NodeID, Proof: &nodev1.IdentityProof{Chain: pr.Chain, Signature: pr.Signature}}, nil
}

type provingPeers map[string]*provingPeer

func (p provingPeers) ask(_ context.Context, addr string, nonce []byte) (*nodev1.StatusResponse, error) {
	peer, ok := p[addr]
	if !ok {
		return nil, errors.New("connection refused")
	}
	return peer.answer(nonce)
}

func claimMember(c identity.NodeClaim) Member {
	return Member{Name: c.Name, Status: StatusAlive, Meta: NodeMeta{Cluster: c.Cluster, ID: c.NodeID, Role: RoleServer, RaftAddr: c.RaftAddr, InternalAddr: c.InternalAddr}}
}

func TestAdmission(t *testing.T) {
	verify, certs := testIdentities(t, "node2", "node3")
	node2 := identity.NodeClaim{Cluster: "pivirt", NodeID: "id-2", Name: "node2", RaftAddr: "raft-2", InternalAddr: "int-2"}
	// An impostor holding node3's certificate claims node2's name; another
	// relays the nonce to node2's real address.
	stolen := identity.NodeClaim{Cluster: "pivirt", NodeID: "id-2", Name: "node2", RaftAddr: "raft-x", InternalAddr: "int-x"}
	peers := provingPeers{
		"int-2": {claim: node2, cert: certs["node2"]},
		"int-x": {claim: stolen, cert: certs["node3"]},
	}
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := now
	adm := NewAdmission(AdmissionConfig{Ask: peers.ask, Verify: verify, TTL: time.Hour, MinBackoff: time.Second, MaxBackoff: 8 * time.Second, Now: func() time.Time { return clock }})
	ctx := context.Background()

	if err := adm.Admit(ctx, claimMember(node2)); err != nil {
		t.Fatalf("node2 with its own certificate: %v", err)
	}
	if err := adm.Admit(ctx, claimMember(node2)); err != nil || peers["int-2"].asked.Load() != 1 {
		t.Fatalf("a proven claim is asked again within its TTL (%d queries, %v)", peers["int-2"].asked.Load(), err)
	}
	clock = now.Add(2 * time.Hour)
	if err := adm.Admit(ctx, claimMember(node2)); err != nil || peers["int-2"].asked.Load() != 2 {
		t.Fatalf("a proven claim is not asked again after its TTL (%d queries, %v)", peers["int-2"].asked.Load(), err)
	}

	for name, tc := range map[string]struct {
		m    Member
		want string
	}{
		"another node's certificate": {claimMember(stolen), `names node "node3", the claim is for "node2"`},
		"a relayed answer": {claimMember(identity.NodeClaim{Cluster: "pivirt", NodeID: "id-2", Name: "node2", RaftAddr: "raft-y", InternalAddr: "int-2"}),
			"not signed by the certificate's key"},
		"another node id at the address": {claimMember(identity.NodeClaim{Cluster: "pivirt", NodeID: "id-9", Name: "node2", RaftAddr: "raft-2", InternalAddr: "int-2"}),
			`int-2 answers as node id "id-2"`},
		"nothing at the address": {claimMember(identity.NodeClaim{Cluster: "pivirt", NodeID: "id-7", Name: "node7", RaftAddr: "raft-7", InternalAddr: "int-7"}),
			"connection refused"},
		"no internal address": {claimMember(identity.NodeClaim{Cluster: "pivirt", NodeID: "id-7", Name: "node7"}), "no node id or internal address"},
	} {
		t.Run(name, func(t *testing.T) {
			err := adm.Admit(ctx, tc.m)
			if !errors.Is(err, ErrNotAdmitted) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrNotAdmitted saying %q", err, tc.want)
			}
		})
	}

	// A failed claim waits out its backoff (1 s, doubling up to 8 s)
	// before it costs another query.
	impostor := peers["int-x"]
	before := impostor.asked.Load()
	for _, step := range []struct {
		after time.Duration
		asks  int32
	}{{0, 0}, {999 * time.Millisecond, 0}, {time.Second, 1}, {2 * time.Second, 1}, {3 * time.Second, 2}, {60 * time.Second, 3}, {67 * time.Second, 3}, {68 * time.Second, 4}} {
		clock = now.Add(2*time.Hour + step.after)
		if err := adm.Admit(ctx, claimMember(stolen)); err == nil {
			t.Fatal("the impostor was admitted")
		}
		if got := impostor.asked.Load() - before; got != step.asks {
			t.Fatalf("after %s: %d queries, want %d", step.after, got, step.asks)
		}
	}

	// A member that restarted within its backoff (its gossip entry changed
	// after the last query, with no change of status) is asked at once.
	restarted := claimMember(stolen)
	restarted.Changed = clock.Add(time.Millisecond)
	clock = clock.Add(2 * time.Millisecond)
	before = impostor.asked.Load()
	if err := adm.Admit(ctx, restarted); err == nil || impostor.asked.Load()-before != 1 {
		t.Fatalf("a member that changed since its last query is not asked again (%d queries, %v)", impostor.asked.Load()-before, err)
	}
	if err := adm.Admit(ctx, restarted); err == nil || impostor.asked.Load()-before != 1 {
		t.Fatalf("an unchanged member is asked again within its backoff (%d queries)", impostor.asked.Load()-before)
	}
}

func TestAdmissionForgetsAFlood(t *testing.T) {
	clock := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	adm := NewAdmission(AdmissionConfig{Ask: provingPeers{}.ask, Verify: func([]*x509.Certificate, x509.ExtKeyUsage) error { return nil }, Now: func() time.Time { return clock }})
	for i := range 3 * maxAdmissionEntries {
		clock = clock.Add(time.Millisecond)
		_ = adm.Admit(context.Background(), claimMember(identity.NodeClaim{NodeID: "x", Name: "n", InternalAddr: fmt.Sprint("int-", i)}))
	}
	if n := len(adm.claims); n > maxAdmissionEntries {
		t.Fatalf("%d claims remembered, bound %d", n, maxAdmissionEntries)
	}
}

// fakeAdmitter admits the members named in proven.
type fakeAdmitter map[string]bool

func (f fakeAdmitter) Admit(_ context.Context, m Member) error {
	if f[m.Name] {
		return nil
	}
	return ErrNotAdmitted
}

func (f fakeAdmitter) Proven(m Member) bool          { return f[m.Name] }
func (f fakeAdmitter) Refused(m Member) (bool, bool) { return !f[m.Name], false }

func TestReconcileAdmitsOnlyProvenServers(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	long := now.Add(-time.Hour)
	v := func(id, addr string) RaftServer { return RaftServer{ID: id, Address: addr, Voter: true} }
	nv := func(id string) RaftServer { return RaftServer{ID: id, Address: "addr-" + id} }
	impostor := func(name, id, raftAddr string, st MemberStatus) Member {
		return Member{Name: name, Status: st, Since: long, Meta: NodeMeta{ID: id, Role: RoleServer, RaftAddr: raftAddr, InternalAddr: "int-" + name}}
	}
	for _, tc := range []struct {
		name     string
		raft     []RaftServer
		members  []Member
		proven   fakeAdmitter
		maxNV    int
		want     string
		cleanup  time.Duration
		peersFor []string
	}{
		{
			name:    "an unproven server is not added",
			raft:    []RaftServer{v("a", "addr-a")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), impostor("evil", "e", "10.0.0.66:8300", StatusAlive)},
			proven:  fakeAdmitter{"n-b": true},
			want:    "a:v@addr-a b:n@addr-b ",
		},
		{
			name:    "an unproven claim of a failed voter's id does not move its address or keep it from cleanup",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "addr-b"), v("c", "addr-c"), v("d", "addr-d")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("d", StatusAlive, long), member("c", StatusFailed, long), impostor("n-c2", "c", "10.0.0.66:8300", StatusAlive)},
			proven:  fakeAdmitter{"n-b": true, "n-c": true, "n-d": true},
			cleanup: time.Minute,
			want:    "a:v@addr-a b:v@addr-b d:v@addr-d ",
		},
		{
			name:    "an unproven claim of a live voter's id is no conflict",
			raft:    []RaftServer{v("a", "addr-a"), {ID: "b", Address: "old"}},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), impostor("evil", "b", "10.0.0.66:8300", StatusAlive)},
			proven:  fakeAdmitter{"n-b": true},
			want:    "a:v@addr-a b:v@addr-b ", peersFor: []string{"b"},
		},
		{
			name:    "a proven address change is followed",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "old")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long)},
			proven:  fakeAdmitter{"n-b": true},
			want:    "a:v@addr-a b:v@addr-b ",
		},
		{
			name:    "an unproven address change is not followed",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "old")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long)},
			proven:  fakeAdmitter{},
			want:    "a:v@addr-a b:v@old ",
		},
		{
			name:    "a left member counts only when its claim was proven (a made-up one copying the address too)",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "addr-b"), v("c", "addr-c")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), impostor("evil", "c", "addr-c", StatusLeft)},
			proven:  fakeAdmitter{"n-b": true},
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c ",
		},
		{
			name:    "a proven server that left is removed",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "addr-b"), v("c", "addr-c")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusLeft, long)},
			proven:  fakeAdmitter{"n-b": true, "n-c": true},
			want:    "a:v@addr-a b:v@addr-b ",
		},
		{
			name:    "an alive server that cannot prove itself (an older version) keeps its place, unpromoted",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "addr-b"), nv("c")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusAlive, long)},
			proven:  fakeAdmitter{"n-b": true},
			cleanup: time.Minute, peersFor: []string{"c"},
			want: "a:v@addr-a b:v@addr-b c:n@addr-c ",
		},
		{
			name:    "the non-voter cap holds newcomers back",
			raft:    []RaftServer{v("a", "addr-a"), v("b", "addr-b"), v("c", "addr-c")},
			members: []Member{member("a", StatusAlive, long), member("b", StatusAlive, long), member("c", StatusAlive, long), member("d", StatusAlive, long), member("e", StatusAlive, long)},
			proven:  fakeAdmitter{"n-b": true, "n-c": true, "n-d": true, "n-e": true},
			maxNV:   1,
			want:    "a:v@addr-a b:v@addr-b c:v@addr-c d:n@addr-d ",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raft := newFakeRaft(tc.raft...)
			r := NewReconciler(ReconcileConfig{SelfID: "a", SelfName: "n-a", Voters: 3, DeadServerCleanup: tc.cleanup, MaxNonvoters: tc.maxNV,
				Admission: tc.proven, Now: func() time.Time { return now }}, raft, fakeMembers(tc.members), healthyPeers(tc.peersFor...))
			if err := r.Reconcile(context.Background()); err != nil {
				t.Fatalf("reconcile: %v", err)
			}
			if got := raft.summary(); got != tc.want {
				t.Fatalf("configuration:\n got %s\nwant %s\ncalls %v", got, tc.want, raft.calls)
			}
		})
	}
}

func TestBootstrapCountsOnlyProvenServers(t *testing.T) {
	members := fakeMembers{expectMember("a", 3), expectMember("b", 3), expectMember("evil", 3)}
	view := &BootstrapView{}
	_, reason, err := bootstrapCandidates(context.Background(), BootstrapConfig{SelfID: "a", SelfName: "n-a", Expect: 3, Voters: 3,
		Admission: fakeAdmitter{"n-b": true}}, members, fakePeers{}, view)
	if err != nil || !strings.Contains(reason, "2 of 3 expected servers seen in gossip; not counted, their agent identity is not proven: n-evil") {
		t.Fatalf("got %q, %v", reason, err)
	}
	// An unproven member claiming raft state does not stop a bootstrap.
	members = fakeMembers{expectMember("a", 2), expectMember("b", 2), expectMember("evil", 0)}
	servers, reason, err := bootstrapCandidates(context.Background(), BootstrapConfig{SelfID: "a", SelfName: "n-a", Expect: 2, Voters: 3,
		Admission: fakeAdmitter{"n-b": true}}, members, fakePeers{"int-b": {NodeId: "b", BootstrapCandidates: []string{"a", "b"}}, "int-evil": {NodeId: "evil", HasState: true}}, view)
	if err != nil || len(servers) != 2 {
		t.Fatalf("got %v, %q, %v", servers, reason, err)
	}
}

// TestServerByID: a member claiming a server's ID at another Raft address
// does not receive the calls meant for the server while the server lives.
func TestServerByID(t *testing.T) {
	node2 := Member{Name: "node2", Status: StatusAlive, Meta: NodeMeta{ID: "id-2", RaftAddr: "raft-2", InternalAddr: "int-2"}}
	fake := Member{Name: "evil", Status: StatusAlive, Meta: NodeMeta{ID: "id-2", RaftAddr: "raft-x", InternalAddr: "int-x"}}
	for range 20 { // map order varies
		g := &Gossip{members: map[string]*Member{"node2": &node2, "evil": &fake}}
		if m, _ := g.ServerByID("id-2", "raft-2"); m.Name != "node2" {
			t.Fatalf("got %s for the configuration's address", m.Name)
		}
	}
	down := node2
	down.Status = StatusFailed
	g := &Gossip{members: map[string]*Member{"node2": &down, "evil": &fake}}
	if m, _ := g.ServerByID("id-2", "raft-2"); m.Name != "evil" {
		t.Fatalf("got %s: an alive member is preferred over a failed one", m.Name)
	}
	if _, ok := g.ServerByID("id-3", "raft-3"); ok {
		t.Fatal("found a member for an unknown id")
	}
}

// TestUnprovenLiveServerIsNotCleanedUp: a live server of the configuration
// that cannot prove itself (an older version during an upgrade) is never
// taken for gone, however long it stays unproven.
func TestUnprovenLiveServerIsNotCleanedUp(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := now
	raft := newFakeRaft(RaftServer{ID: "a", Address: "addr-a", Voter: true}, RaftServer{ID: "b", Address: "addr-b", Voter: true},
		RaftServer{ID: "c", Address: "addr-c", Voter: true}, RaftServer{ID: "d", Address: "addr-d"})
	members := fakeMembers{member("a", StatusAlive, now), member("b", StatusAlive, now), member("c", StatusAlive, now), member("d", StatusAlive, now)}
	r := NewReconciler(ReconcileConfig{SelfID: "a", SelfName: "n-a", Voters: 3, DeadServerCleanup: time.Minute, Admission: fakeAdmitter{"n-b": true},
		Now: func() time.Time { return clock }}, raft, members, healthyPeers("b", "c", "d"))
	for _, after := range []time.Duration{0, 2 * time.Minute, time.Hour} {
		clock = now.Add(after)
		if err := r.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := raft.summary(); got != "a:v@addr-a b:v@addr-b c:v@addr-c d:n@addr-d " {
			t.Fatalf("after %s: %s", after, got)
		}
	}
}

// slowAdmitter answers every member when the pass's time is up.
type slowAdmitter struct{}

func (slowAdmitter) Admit(ctx context.Context, m Member) error {
	<-ctx.Done()
	return fmt.Errorf("%s: %w", m.Name, ctx.Err())
}

func (slowAdmitter) Proven(Member) bool          { return false }
func (slowAdmitter) Refused(Member) (bool, bool) { return false, false }

// TestAdmitAllPassRunsOut: members not asked before the pass's time ran
// out are refused as not asked, while the checks in flight end at the same
// moment (under -race: they share the result map safely).
func TestAdmitAllPassRunsOut(t *testing.T) {
	ms := make([]Member, 3*admitParallel)
	for i := range ms {
		ms[i] = Member{Name: fmt.Sprintf("m%d", i)}
	}
	out := admitAll(t.Context(), slowAdmitter{}, ms)
	if len(out) != len(ms) {
		t.Fatalf("%d members refused, want all %d", len(out), len(ms))
	}
	notAsked := 0
	for _, err := range out {
		if errors.Is(err, ErrNotAdmitted) {
			notAsked++
		}
	}
	if notAsked == 0 {
		t.Error("no member was left unasked when the pass ran out")
	}
}
