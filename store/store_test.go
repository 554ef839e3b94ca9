package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/fsm/fsmtest"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

const (
	leaderTimeout = 10 * time.Second
	waitTimeout   = 10 * time.Second
)

func opCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func kv(c *storetest.Cluster, i int) *storetest.KV { return c.FSM(i).(*storetest.KV) }

// waitValue waits until node i's KV has key=want.
func waitValue(t *testing.T, c *storetest.Cluster, i int, key, want string) {
	t.Helper()
	storetest.WaitFor(t, waitTimeout, fmt.Sprintf("node %d to have %s=%s", i, key, want), func() bool {
		got, ok := kv(c, i).Get(key)
		return ok && got == want
	})
}

func servers(t *testing.T, s *store.Store) map[string]store.Server {
	t.Helper()
	list, err := s.Servers(opCtx(t))
	if err != nil {
		t.Fatalf("Servers: %v", err)
	}
	m := make(map[string]store.Server, len(list))
	for _, srv := range list {
		m[srv.ID] = srv
	}
	return m
}

func TestApplyReplicates(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)

	var (
		resp  any
		index uint64
	)
	leader := c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) (err error) {
		resp, index, err = l.Apply(ctx, storetest.Set("a", "1"))
		return err
	})
	if index == 0 || resp != index {
		t.Errorf("Apply = (%v, %d), want the FSM's response (the entry index) and a non-zero index", resp, index)
	}
	li := c.Index(leader)
	if got, _ := kv(c, li).Get("a"); got != "1" {
		t.Errorf("leader KV a = %q right after Apply, want 1", got)
	}
	for i := range c.N() {
		waitValue(t, c, i, "a", "1")
	}

	st := leader.Status()
	if st.State != "Leader" || st.LeaderID != leader.ID() || !st.LastContact.IsZero() || st.NumPeers != 2 || !st.Voter || st.AppliedIndex < index {
		t.Errorf("leader Status = %+v, want Leader, itself as leader, zero LastContact, 2 peers, voter, applied >= %d", st, index)
	}
	for _, f := range c.Followers() {
		st := f.Status()
		if st.State != "Follower" || st.LeaderID != leader.ID() || st.LeaderAddr != leader.LocalAddr() || st.LastContact.IsZero() || !st.HasState {
			t.Errorf("follower Status = %+v, want Follower knowing leader %s at %s, with a last contact", st, leader.ID(), leader.LocalAddr())
		}
	}
}

func TestApplyPassesFSMErrorThrough(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
	leader := c.WaitLeader(t, leaderTimeout)
	resp, index, err := leader.Apply(opCtx(t), storetest.Fail("bad request"))
	if err != nil {
		t.Fatalf("Apply returned error %v, want nil (the FSM's error is a response)", err)
	}
	respErr, ok := resp.(error)
	if !ok || respErr.Error() != "bad request" || index == 0 {
		t.Errorf("Apply = (%#v, %d), want error response %q and an index", resp, index, "bad request")
	}
}

func TestFollowerRejectsLeaderOnlyCalls(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	leader := c.WaitLeader(t, leaderTimeout)
	storetest.WaitFor(t, waitTimeout, "followers to know the leader", func() bool {
		for _, f := range c.Followers() {
			if id, _ := f.Leader(); id != leader.ID() {
				return false
			}
		}
		return true
	})
	f := c.Followers()[0]
	ctx := opCtx(t)
	calls := []struct {
		name string
		call func() error
	}{
		{"Apply", func() error { _, _, err := f.Apply(ctx, storetest.Set("k", "v")); return err }},
		{"Barrier", func() error { return f.Barrier(ctx) }},
		{"VerifyLeader", func() error { return f.VerifyLeader(ctx) }},
		{"ReadIndex", func() error { _, err := f.ReadIndex(ctx); return err }},
		{"AddVoter", func() error { return f.AddVoter(ctx, "x", "127.0.0.1:1") }},
		{"AddVoter existing", func() error { return f.AddVoter(ctx, leader.ID(), leader.LocalAddr()) }},
		{"AddNonvoter", func() error { return f.AddNonvoter(ctx, "x", "127.0.0.1:1") }},
		{"DemoteVoter", func() error { return f.DemoteVoter(ctx, leader.ID()) }},
		{"RemoveServer", func() error { return f.RemoveServer(ctx, leader.ID()) }},
		{"TransferLeadership", func() error { _, err := f.TransferLeadership(ctx, ""); return err }},
		{"Restore", func() error { return f.Restore(ctx, 0, 2, bytes.NewReader([]byte("{}"))) }},
	}
	for _, tt := range calls {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if !errors.Is(err, store.ErrNotLeader) {
				t.Errorf("%s on a follower = %v, want ErrNotLeader", tt.name, err)
			}
		})
	}
	// Errors mapped from raft still match raft's own sentinel.
	if _, _, err := f.Apply(ctx, storetest.Set("k", "v")); !errors.Is(err, raft.ErrNotLeader) {
		t.Errorf("Apply on follower = %v, want it to also match raft.ErrNotLeader", err)
	}
	if f.IsLeader() {
		t.Error("follower IsLeader() = true")
	}
}

func TestBarrierAndVerifyLeader(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	_, index := c.Apply(t, storetest.Set("a", "1"))
	leader := c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		if err := l.Barrier(ctx); err != nil {
			return err
		}
		if got := kv(c, c.Index(l)).AppliedIndex(); got < index {
			t.Errorf("after Barrier FSM applied index = %d, want >= %d", got, index)
		}
		if err := l.VerifyLeader(ctx); err != nil {
			return err
		}
		ri, err := l.ReadIndex(ctx)
		if err == nil && ri < index {
			t.Errorf("ReadIndex = %d, want >= %d (the last write)", ri, index)
		}
		return err
	})
	var err error

	// A leader cut off from its quorum soon cannot verify its leadership (a
	// heartbeat answered just before the followers stopped may still count
	// for a verification started right after).
	for _, f := range c.Followers() {
		c.Stop(c.Index(f))
	}
	storetest.WaitFor(t, waitTimeout, "VerifyLeader to fail without a quorum", func() bool {
		err = leader.VerifyLeader(opCtx(t))
		return err != nil
	})
	if !errors.Is(err, store.ErrNotLeader) && !errors.Is(err, store.ErrLeadershipLost) {
		t.Errorf("VerifyLeader without quorum = %v, want ErrNotLeader or ErrLeadershipLost", err)
	}
}

func TestApplyContext(t *testing.T) {
	t.Run("cancelled before", func(t *testing.T) {
		c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
		leader := c.WaitLeader(t, leaderTimeout)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		_, _, err := leader.Apply(ctx, storetest.Set("a", "1"))
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Apply(cancelled ctx) = %v, want context.Canceled", err)
		}
		ctx, cancel = context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
		defer cancel()
		_, _, err = leader.Apply(ctx, storetest.Set("a", "1"))
		if !errors.Is(err, store.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Apply(expired ctx) = %v, want ErrTimeout and context.DeadlineExceeded", err)
		}
		if _, ok := kv(c, 0).Get("a"); ok {
			t.Error("a command whose ctx had ended before Apply was applied")
		}
	})

	t.Run("cancelled in flight", func(t *testing.T) {
		gate := newGatedKV()
		c := storetest.NewCluster(t, 1, func() raft.FSM { return gate })
		leader := c.WaitLeader(t, leaderTimeout)
		ctx, cancel := context.WithCancel(t.Context())
		errc := make(chan error, 1)
		go func() {
			_, _, err := leader.Apply(ctx, storetest.Set("slow", "1"))
			errc <- err
		}()
		<-gate.entered // the FSM is applying the command and blocks there
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Errorf("Apply cancelled in flight = %v, want context.Canceled", err)
		}
		// The write was committed and is applied after all: retries must be
		// deduplicated by the FSM.
		close(gate.release)
		storetest.WaitFor(t, waitTimeout, "the cancelled write to be applied", func() bool {
			v, ok := gate.Get("slow")
			return ok && v == "1"
		})
	})
}

// gatedKV blocks in Apply until release is closed, after signalling entered
// for the first command.
type gatedKV struct {
	*storetest.KV
	entered chan struct{}
	release chan struct{}
	first   bool
}

func newGatedKV() *gatedKV {
	return &gatedKV{KV: storetest.NewKV(), entered: make(chan struct{}), release: make(chan struct{}), first: true}
}

func (g *gatedKV) Apply(l *raft.Log) any {
	if g.first { // only raft's FSM goroutine calls Apply
		g.first = false
		close(g.entered)
		<-g.release
	}
	return g.KV.Apply(l)
}

func TestLeadershipSubscription(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	leader := c.WaitLeader(t, leaderTimeout)
	li := c.Index(leader)

	subs := make([]<-chan bool, c.N())
	for i := range c.N() {
		ch, cancel := c.Store(i).SubscribeLeadership()
		t.Cleanup(cancel)
		subs[i] = ch
	}
	// The current value comes first. raft reports the leader state a moment
	// before it notifies, so the leader's may still be false, then true.
	waitLeadership(t, subs[li], true)
	for i := range c.N() {
		if i == li {
			continue
		}
		if v := <-subs[i]; v {
			t.Fatalf("follower %d's first leadership value = true, want false", i)
		}
	}

	// Two subscribers on one store both see the value; the latest comes
	// first.
	extra, cancelExtra := leader.SubscribeLeadership()
	if v := <-extra; !v {
		t.Errorf("second subscriber's first value = false, want true")
	}
	cancelExtra()
	cancelExtra() // idempotent
	if _, ok := <-extra; ok {
		t.Error("channel still open after cancel")
	}

	// Stopping the leader ends its subscription with false, and another
	// node's subscription turns true.
	c.Stop(li)
	var got []bool
	for v := range subs[li] {
		got = append(got, v)
	}
	if len(got) == 0 || got[len(got)-1] {
		t.Errorf("stopped leader's subscription delivered %v, want it to end with false", got)
	}
	newLeader := c.WaitLeader(t, leaderTimeout)
	ni := c.Index(newLeader)
	waitLeadership(t, subs[ni], true)

	// Subscribing to a closed store yields false and a closed channel.
	ch, cancel := c.Store(ni).SubscribeLeadership()
	defer cancel()
	c.Stop(ni)
	if v, ok := <-ch; ok && v {
		t.Errorf("after Close got %v, want false", v)
	}
}

// waitLeadership reads ch until it delivers want.
func waitLeadership(t *testing.T, ch <-chan bool, want bool) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case v, ok := <-ch:
			if !ok {
				t.Fatalf("subscription closed while waiting for %v", want)
			}
			if v == want {
				return
			}
		case <-deadline:
			t.Fatalf("subscription did not deliver %v", want)
		}
	}
}

func TestLeadershipSubscriptionCoalesces(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	leader := c.WaitLeader(t, leaderTimeout)
	ch, cancel := leader.SubscribeLeadership()
	defer cancel()
	// Never read ch while leadership moves: raft must not block on it.
	for range 2 {
		transfer(t, c, "")
	}
	c.Apply(t, storetest.Set("k", "v"))
	// The one buffered value is the latest: it may only be replaced by a
	// publish still on its way, never be an older one.
	waitLeadership(t, ch, leader.IsLeader())
}

// transfer moves leadership away from the current leader (to id, or to any
// voter), retrying while the cluster is busy electing, and returns the old
// leader and what TransferLeadership reported.
func transfer(t *testing.T, c *storetest.Cluster, id string) (from *store.Store, to string) {
	t.Helper()
	var lastErr error
	storetest.WaitFor(t, waitTimeout, "a leadership transfer to succeed", func() bool {
		from = c.WaitLeader(t, leaderTimeout)
		if from.ID() == id {
			return false // wait for the cluster to settle elsewhere
		}
		to, lastErr = from.TransferLeadership(opCtx(t), id)
		if lastErr != nil {
			t.Logf("TransferLeadership(%q) from %s: %v (retrying)", id, from.ID(), lastErr)
		}
		return lastErr == nil
	})
	return from, to
}

func TestTransferLeadership(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		if got, err := l.TransferLeadership(ctx, l.ID()); err != nil || got != l.ID() {
			t.Errorf("TransferLeadership(self) = %q, %v; want %q, nil", got, err, l.ID())
		}
		if _, err := l.TransferLeadership(ctx, "nobody"); !errors.Is(err, store.ErrUnknownServer) && !storetest.Retryable(err) {
			t.Errorf("TransferLeadership(unknown) = %v, want ErrUnknownServer", err)
		}
		return nil
	})

	from, newID := transfer(t, c, "")
	if newID == "" || newID == from.ID() {
		t.Fatalf("TransferLeadership(any) from %s = %q, want another server's ID", from.ID(), newID)
	}
	if l := c.WaitLeader(t, leaderTimeout); l.ID() != newID {
		t.Logf("leader after transfer = %s, TransferLeadership said %s (another election since?)", l.ID(), newID)
	}

	// Hand it to a chosen server by ID.
	target := c.ID(0)
	if c.WaitLeader(t, leaderTimeout).ID() == target {
		target = c.ID(1)
	}
	_, got := transfer(t, c, target)
	if got != target {
		t.Errorf("TransferLeadership(%s) returned %q", target, got)
	}
	storetest.WaitFor(t, waitTimeout, target+" to lead", func() bool {
		l := c.Leader()
		return l != nil && l.ID() == target
	})
}

func TestMembership(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	c.Apply(t, storetest.Set("before", "join"))

	// on runs a membership change on the leader; they are idempotent, so
	// retrying after a leader change is safe.
	on := func(name string, op func(ctx context.Context, l *store.Store) error) {
		t.Helper()
		t.Logf("%s", name)
		c.OnLeader(t, waitTimeout, op)
	}
	// noChange runs op on the leader and checks it appended nothing to the
	// log (unless an election in between appended its own entry).
	noChange := func(name string, op func(ctx context.Context, l *store.Store) error) {
		t.Helper()
		on(name, func(ctx context.Context, l *store.Store) error {
			before := l.Status()
			if err := op(ctx, l); err != nil {
				return err
			}
			after := l.Status()
			if after.Term == before.Term && after.LastIndex != before.LastIndex {
				t.Errorf("%s appended to the log (last index %d -> %d), want a no-op", name, before.LastIndex, after.LastIndex)
			}
			return nil
		})
	}
	want := func(id string, wantVoter, present bool, addr string) {
		t.Helper()
		srv, ok := servers(t, c.WaitLeader(t, leaderTimeout))[id]
		if ok != present {
			t.Fatalf("server %s present = %v, want %v", id, ok, present)
		}
		if present && (srv.Voter != wantVoter || (addr != "" && srv.Address != addr)) {
			t.Errorf("server %s = %+v, want voter=%v address=%s", id, srv, wantVoter, addr)
		}
	}

	// A new voter.
	v := c.AddNode()
	vID, vAddr := c.ID(v), c.Addr(v)
	if c.Store(v).HasExistingState() {
		t.Errorf("new node HasExistingState = true, want false")
	}
	on("AddVoter", func(ctx context.Context, l *store.Store) error { return l.AddVoter(ctx, vID, vAddr) })
	want(vID, true, true, vAddr)
	waitValue(t, c, v, "before", "join")
	if !c.Store(v).HasExistingState() {
		t.Errorf("joined node HasExistingState = false, want true")
	}
	noChange("repeated AddVoter", func(ctx context.Context, l *store.Store) error { return l.AddVoter(ctx, vID, vAddr) })
	noChange("AddNonvoter of a voter", func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, vID, vAddr) })
	want(vID, true, true, vAddr)

	// A new address replaces the old one and keeps the suffrage.
	on("AddNonvoter with a new address", func(ctx context.Context, l *store.Store) error {
		return l.AddNonvoter(ctx, vID, "127.0.0.1:1")
	})
	want(vID, true, true, "127.0.0.1:1")
	on("AddVoter with the real address", func(ctx context.Context, l *store.Store) error { return l.AddVoter(ctx, vID, vAddr) })
	want(vID, true, true, vAddr)

	// A non-voter, promoted, demoted, removed.
	n := c.AddNode()
	nID, nAddr := c.ID(n), c.Addr(n)
	on("AddNonvoter", func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, nID, nAddr) })
	want(nID, false, true, nAddr)
	waitValue(t, c, n, "before", "join")
	noChange("repeated AddNonvoter", func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, nID, nAddr) })
	on("AddVoter of a non-voter", func(ctx context.Context, l *store.Store) error { return l.AddVoter(ctx, nID, nAddr) })
	want(nID, true, true, nAddr)
	on("DemoteVoter", func(ctx context.Context, l *store.Store) error { return l.DemoteVoter(ctx, nID) })
	want(nID, false, true, nAddr)
	noChange("repeated DemoteVoter", func(ctx context.Context, l *store.Store) error { return l.DemoteVoter(ctx, nID) })
	on("DemoteVoter(unknown)", func(ctx context.Context, l *store.Store) error {
		if err := l.DemoteVoter(ctx, "nobody"); !errors.Is(err, store.ErrUnknownServer) {
			t.Errorf("DemoteVoter(unknown) = %v, want ErrUnknownServer", err)
		}
		return nil
	})
	on("RemoveServer", func(ctx context.Context, l *store.Store) error { return l.RemoveServer(ctx, nID) })
	want(nID, false, false, "")
	noChange("repeated RemoveServer", func(ctx context.Context, l *store.Store) error { return l.RemoveServer(ctx, nID) })

	// A stale entry holding an address under another ID is replaced.
	on("AddNonvoter(ghost)", func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, "ghost", nAddr) })
	want("ghost", false, true, nAddr)
	on("AddNonvoter over a stale address", func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, nID, nAddr) })
	want("ghost", false, false, "")
	want(nID, false, true, nAddr)
	on("AddVoter with the leader's address", func(ctx context.Context, l *store.Store) error {
		if err := l.AddVoter(ctx, "impostor", l.LocalAddr()); !errors.Is(err, store.ErrAddressInUse) {
			t.Errorf("AddVoter with the leader's address = %v, want ErrAddressInUse", err)
		}
		if err := l.AddVoter(ctx, "", "127.0.0.1:1"); err == nil || errors.Is(err, store.ErrNotLeader) {
			t.Errorf("AddVoter with an empty ID = %v, want an error", err)
		}
		return nil
	})

	leader := c.WaitLeader(t, leaderTimeout)
	if st := leader.Status(); st.NumPeers != 3 {
		t.Errorf("leader NumPeers = %d, want 3 (4 voters)", st.NumPeers)
	}
	list, err := leader.Servers(opCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, 0, len(list))
	for _, s := range list {
		ids = append(ids, s.ID)
	}
	slices.Sort(ids)
	if wantIDs := []string{"node0", "node1", "node2", "node3", "node4"}; !slices.Equal(ids, wantIDs) {
		t.Errorf("servers = %v, want %v", ids, wantIDs)
	}
}

func TestRestartKeepsState(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	for i := range 20 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), fmt.Sprint(i)))
	}
	for i := range c.N() {
		c.Stop(i)
	}
	for i := range c.N() {
		s := c.Restart(i)
		if !s.HasExistingState() {
			t.Errorf("restarted node %d HasExistingState = false, want true", i)
		}
		if err := s.Bootstrap([]store.Server{{ID: s.ID(), Address: s.LocalAddr(), Voter: true}}); !errors.Is(err, store.ErrAlreadyBootstrapped) {
			t.Errorf("Bootstrap after restart = %v, want ErrAlreadyBootstrapped", err)
		}
	}
	c.WaitLeader(t, leaderTimeout)
	c.Apply(t, storetest.Set("after", "restart"))
	for i := range c.N() {
		waitValue(t, c, i, "after", "restart")
		if got, _ := kv(c, i).Get("k19"); got != "19" || kv(c, i).Len() != 21 {
			t.Errorf("node %d after restart: k19=%q, %d keys; want 19 and 21 keys", i, got, kv(c, i).Len())
		}
	}
}

func TestRestartOnNewPort(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	f := c.Index(c.Followers()[0])
	old := c.Addr(f)
	c.Stop(f)
	// Take the stopped node's port so it must come back elsewhere.
	ln, err := net.Listen("tcp", old)
	if err != nil {
		t.Skipf("cannot take the stopped node's port: %v", err)
	}
	defer ln.Close()
	c.Restart(f)
	if c.Addr(f) == old {
		t.Fatalf("restarted on the taken address %s", old)
	}
	leader := c.WaitLeader(t, leaderTimeout)
	if srv := servers(t, leader)[c.ID(f)]; srv.Address != c.Addr(f) {
		t.Errorf("configuration has %s at %s, want %s", c.ID(f), srv.Address, c.Addr(f))
	}
	c.Apply(t, storetest.Set("moved", "yes"))
	waitValue(t, c, f, "moved", "yes")
}

func TestBootstrap(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM, storetest.WithoutBootstrap())
	s := c.Store(0)
	if s.HasExistingState() || s.Status().HasState {
		t.Fatal("fresh store reports existing state")
	}
	self := store.Server{ID: s.ID(), Address: s.LocalAddr(), Voter: true}
	bad := []struct {
		name    string
		servers []store.Server
	}{
		{"none", nil},
		{"no voter", []store.Server{{ID: s.ID(), Address: s.LocalAddr()}}},
		{"empty id", []store.Server{{Address: s.LocalAddr(), Voter: true}}},
		{"duplicate id", []store.Server{self, {ID: s.ID(), Address: "127.0.0.1:1", Voter: true}}},
		{"duplicate address", []store.Server{self, {ID: "other", Address: s.LocalAddr()}}},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.Bootstrap(tt.servers); err == nil || errors.Is(err, store.ErrAlreadyBootstrapped) {
				t.Errorf("Bootstrap(%v) = %v, want a validation error", tt.servers, err)
			}
		})
	}
	if s.HasExistingState() {
		t.Fatal("a rejected Bootstrap left state behind")
	}
	if err := s.Bootstrap([]store.Server{self}); err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	if err := s.Bootstrap([]store.Server{self}); !errors.Is(err, store.ErrAlreadyBootstrapped) {
		t.Errorf("second Bootstrap = %v, want ErrAlreadyBootstrapped", err)
	}
	c.WaitLeader(t, leaderTimeout)
	c.Apply(t, storetest.Set("a", "1"))
	if !s.HasExistingState() {
		t.Error("bootstrapped store HasExistingState = false")
	}
}

func TestSnapshotAndRestore(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	var last uint64
	for i := range 10 {
		_, last = c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	leader := c.WaitLeader(t, leaderTimeout)
	meta, rc, err := leader.Snapshot(opCtx(t))
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	data, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	if meta.Index < last || meta.Size != int64(len(data)) || !bytes.Contains(data, []byte(`"k9":"v"`)) {
		t.Errorf("Snapshot meta %+v, %d bytes %q; want index >= %d and the FSM's data", meta, len(data), data, last)
	}
	// Nothing applied since: a snapshot of the same index.
	meta2, rc2, err := leader.Snapshot(opCtx(t))
	if err != nil {
		t.Fatalf("second Snapshot: %v", err)
	}
	rc2.Close()
	if meta2.Index != meta.Index {
		t.Errorf("second Snapshot index = %d, want the unchanged %d", meta2.Index, meta.Index)
	}

	state := storetest.EncodeState(map[string]string{"restored": "yes"})
	leader = c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		return l.Restore(ctx, 0, int64(len(state)), bytes.NewReader(state))
	})
	for i := range c.N() {
		waitValue(t, c, i, "restored", "yes")
		if _, ok := kv(c, i).Get("k0"); ok {
			t.Errorf("node %d still has k0 after restore", i)
		}
	}
	if idx := leader.Status().LastIndex; idx <= last {
		t.Errorf("last index after restore = %d, want above %d", idx, last)
	}
	c.Apply(t, storetest.Set("after", "restore"))
}

func TestLaggingFollowerGetsSnapshot(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) {
		cfg.TrailingLogs = 5
		cfg.SnapshotThreshold = 10
	}))
	c.WaitLeader(t, leaderTimeout)
	f := c.Index(c.Followers()[0])
	c.Stop(f)
	for i := range 40 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	// Compact the leader's log past what the stopped follower has.
	c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		_, rc, err := l.Snapshot(ctx)
		if err == nil {
			rc.Close()
		}
		return err
	})
	c.Restart(f)
	waitValue(t, c, f, "k39", "v")
	if got := kv(c, f).Len(); got != 40 {
		t.Errorf("follower has %d keys after catching up, want 40", got)
	}
}

func TestClose(t *testing.T) {
	c := storetest.NewCluster(t, 1, storetest.NewKVFSM)
	s := c.WaitLeader(t, leaderTimeout)
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, _, err := s.Apply(opCtx(t), storetest.Set("a", "1")); !errors.Is(err, store.ErrShutdown) {
		t.Errorf("Apply after Close = %v, want ErrShutdown", err)
	}
	if err := s.Barrier(opCtx(t)); !errors.Is(err, store.ErrShutdown) {
		t.Errorf("Barrier after Close = %v, want ErrShutdown", err)
	}
	if s.IsLeader() {
		t.Error("IsLeader after Close = true")
	}
	if st := s.Status().State; st != "Shutdown" {
		t.Errorf("State after Close = %s, want Shutdown", st)
	}
}

func TestNewRejectsUnadvertisableAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := storetest.TestConfig()
	cfg.NodeID = "n1"
	cfg.DataDir = t.TempDir()
	cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil)
	cfg.FSM = storetest.NewKV()
	_, err = store.New(cfg)
	var ce *store.ConfigError
	if !errors.As(err, &ce) || ce.Field != "StreamLayer" {
		t.Fatalf("New with 0.0.0.0 = %v, want a StreamLayer ConfigError", err)
	}
	// New closed the listener it was given.
	if _, err := ln.Accept(); err == nil {
		t.Error("listener still open after New failed")
	}
}

func TestSecondStoreOnSameDataDirFails(t *testing.T) {
	dir := t.TempDir()
	open := func() (*store.Store, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		cfg := storetest.TestConfig()
		cfg.NodeID = "n1"
		cfg.DataDir = dir
		cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil)
		cfg.FSM = storetest.NewKV()
		return store.New(cfg)
	}
	s, err := open()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s2, err := open(); err == nil {
		s2.Close()
		t.Fatal("a second store opened the same data directory")
	}
}

func TestRecoverCluster(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	for i := range 5 {
		c.Apply(t, storetest.Set(fmt.Sprint("k", i), "v"))
	}
	// A commit needs two of three: node 0 may not have the last writes
	// yet (a follower lagging under load), and it alone survives.
	waitValue(t, c, 0, "k4", "v")
	for i := range c.N() {
		c.Stop(i)
	}
	// Nodes 1 and 2 are lost; node 0 is recovered as a cluster of one.
	cfg := storetest.TestConfig()
	cfg.NodeID = c.ID(0)
	cfg.DataDir = c.DataDir(0)
	cfg.FSM = storetest.NewKV()
	if err := store.RecoverCluster(cfg, []store.Server{{ID: c.ID(0), Address: c.Addr(0), Voter: true}}); err != nil {
		t.Fatalf("RecoverCluster: %v", err)
	}
	s := c.Restart(0)
	if l := c.WaitLeader(t, leaderTimeout); l != s {
		t.Fatalf("leader = %s, want the recovered %s", l.ID(), s.ID())
	}
	c.Apply(t, storetest.Set("after", "recovery"))
	waitValue(t, c, 0, "k4", "v")
	if got := servers(t, s); len(got) != 1 {
		t.Errorf("servers after recovery = %v, want only %s", got, s.ID())
	}

	empty := storetest.TestConfig()
	empty.NodeID, empty.DataDir, empty.FSM = "n9", t.TempDir(), storetest.NewKV()
	if err := store.RecoverCluster(empty, []store.Server{{ID: "n9", Address: "127.0.0.1:1", Voter: true}}); err == nil {
		t.Error("RecoverCluster on an empty data dir succeeded, want a refusal")
	}
}

// ReadIndex never points at a no-op or barrier entry, which raft does not
// hand to the FSM: right after an election (the new leader's no-op) and
// after a Barrier, it is the last command's index, which the FSM reaches.
func TestReadIndexSkipsEntriesTheFSMNeverSees(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	_, index := c.Apply(t, storetest.Set("a", "1"))
	c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error {
		if err := l.Barrier(ctx); err != nil {
			return err
		}
		if err := l.Barrier(ctx); err != nil {
			return err
		}
		ri, err := l.ReadIndex(ctx)
		if err != nil {
			return err
		}
		if ri != index {
			t.Errorf("ReadIndex after two barriers = %d, want %d (the last command; commit index %d)", ri, index, l.Status().CommitIndex)
		}
		if applied := kv(c, c.Index(l)).AppliedIndex(); applied < ri {
			t.Errorf("FSM applied %d < read index %d: a read waiting for it would hang", applied, ri)
		}
		return nil
	})
}

// TestAddressChangeUnderLoad moves a follower's address back and forth
// while the leader replicates to it. Changing a server's address in place
// races with its replication goroutine inside hashicorp/raft (#471, #682:
// updateLastAppended reads the peer that startStopReplication replaces);
// under -race this test failed with the in-place change. The store removes
// and adds the server instead, and the follower still gets every entry.
func TestAddressChangeUnderLoad(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	c.WaitLeader(t, leaderTimeout)
	n := c.AddNode()
	id, addr := c.ID(n), c.Addr(n)
	c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, id, addr) })

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written atomic.Int64
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				l := c.Leader()
				if l == nil {
					time.Sleep(5 * time.Millisecond) // between two leaders
					continue
				}
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
				if _, _, err := l.Apply(ctx, storetest.Set(fmt.Sprintf("w%d-%d", w, i), "v")); err == nil {
					written.Add(1)
				}
				cancel()
			}
		})
	}
	for i := range 16 { // ends on the real address
		next := addr
		if i%2 == 0 {
			next = "127.0.0.1:1" // a closed port
		}
		c.OnLeader(t, waitTimeout, func(ctx context.Context, l *store.Store) error { return l.AddNonvoter(ctx, id, next) })
		srv := servers(t, c.WaitLeader(t, leaderTimeout))[id]
		if srv.Address != next || srv.Voter {
			t.Fatalf("after moving to %s: %+v, want a non-voter at %s", next, srv, next)
		}
	}
	close(stop)
	wg.Wait()
	c.Apply(t, storetest.Set("last", "v"))
	waitValue(t, c, n, "last", "v")
	if got, want := kv(c, n).Len(), int(written.Load())+1; got < want {
		t.Errorf("the moved follower holds %d keys, want at least %d", got, want)
	}
}

func TestSentinels(t *testing.T) { fsmtest.CheckSentinels(t, ".", store.Sentinels) }
