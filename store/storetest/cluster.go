// Package storetest runs in-process Raft clusters of store.Store over real
// TCP on 127.0.0.1, with real bbolt files in temporary directories, for the
// tests of store and of the packages built on it.
package storetest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"go.etcd.io/bbolt"

	"pilab.hu/pivirt-agent/store"
)

// pollInterval is how often the Wait helpers check their condition.
const pollInterval = 5 * time.Millisecond

// Option changes how NewCluster builds its nodes.
type Option func(*options)

type options struct {
	configure func(i int, c *store.Config)
	bootstrap bool
	logger    *slog.Logger
}

// WithConfig lets fn adjust node i's Config after the test defaults are set
// and before the store is opened (also on Restart and AddNode). Several
// run in the order given.
func WithConfig(fn func(i int, c *store.Config)) Option {
	return func(o *options) {
		prev := o.configure
		o.configure = func(i int, c *store.Config) {
			if prev != nil {
				prev(i, c)
			}
			fn(i, c)
		}
	}
}

// WithoutBootstrap starts the nodes with empty state and bootstraps nothing.
func WithoutBootstrap() Option {
	return func(o *options) { o.bootstrap = false }
}

// WithLogger sends every node's logs to l (discarded by default).
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// TestConfig returns the Config a cluster node starts with: fast timeouts
// for loopback (heartbeat and election 300ms, lease 250ms: fast failover,
// yet few spurious elections on a busy 2-core machine running -race), no
// logs.
func TestConfig() store.Config {
	c := store.DefaultConfig()
	c.HeartbeatTimeout = 300 * time.Millisecond
	c.ElectionTimeout = 300 * time.Millisecond
	c.LeaderLeaseTimeout = 250 * time.Millisecond
	c.CommitTimeout = 5 * time.Millisecond
	c.TransportTimeout = 2 * time.Second
	return c
}

type node struct {
	id    string
	dir   string
	addr  string
	store *store.Store // nil while stopped
	fsm   raft.FSM
}

// Cluster is a set of store.Store nodes. Its methods may be called from any
// goroutine; the *store.Store values they return stay valid until that node
// is stopped.
type Cluster struct {
	tb     testing.TB
	newFSM func() raft.FSM
	opts   options

	base string // parent of the nodes' data directories

	mu    sync.Mutex
	nodes []*node
}

// NewCluster starts n nodes on 127.0.0.1:0 and, unless WithoutBootstrap is
// given, bootstraps them all as voters of one cluster. Every node is stopped
// and every directory removed when the test ends.
func NewCluster(tb testing.TB, n int, newFSM func() raft.FSM, opts ...Option) *Cluster {
	tb.Helper()
	// The directory is created before Close is registered, so that it is
	// removed only after every store is closed.
	c := &Cluster{tb: tb, newFSM: newFSM, opts: options{bootstrap: true}, base: tb.TempDir()}
	for _, o := range opts {
		o(&c.opts)
	}
	tb.Cleanup(c.Close)
	for range n {
		c.AddNode()
	}
	if c.opts.bootstrap {
		servers := make([]store.Server, n)
		for i, nd := range c.nodes {
			servers[i] = store.Server{ID: nd.id, Address: nd.addr, Voter: true}
		}
		for i, nd := range c.nodes {
			// A node may already have been reached by a leader elected among
			// the nodes bootstrapped before it: that is the documented,
			// harmless ErrAlreadyBootstrapped.
			if err := nd.store.Bootstrap(servers); err != nil && !errors.Is(err, store.ErrAlreadyBootstrapped) {
				tb.Fatalf("bootstrap node %d: %v", i, err)
			}
		}
	}
	return c
}

// start opens node i on ln. It does not hold c.mu while opening.
func (c *Cluster) start(i int, ln net.Listener) error {
	c.mu.Lock()
	nd := c.nodes[i]
	c.mu.Unlock()
	cfg := TestConfig()
	cfg.NodeID = nd.id
	cfg.DataDir = nd.dir
	cfg.StreamLayer = store.NewTCPStreamLayer(ln, nil)
	cfg.FSM = c.newFSM()
	cfg.Logger = c.opts.logger
	if c.opts.configure != nil {
		c.opts.configure(i, &cfg)
	}
	s, err := store.New(cfg)
	if err != nil {
		return err
	}
	c.mu.Lock()
	nd.store, nd.fsm, nd.addr = s, cfg.FSM, s.LocalAddr()
	c.mu.Unlock()
	return nil
}

// N is the number of nodes, stopped ones included.
func (c *Cluster) N() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.nodes)
}

// Store returns node i's store, or nil while it is stopped.
func (c *Cluster) Store(i int) *store.Store {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].store
}

// FSM returns the FSM node i runs (or last ran, while stopped).
func (c *Cluster) FSM(i int) raft.FSM {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].fsm
}

// ID returns node i's server ID.
func (c *Cluster) ID(i int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].id
}

// Addr returns node i's Raft address (the latest, after a Restart).
func (c *Cluster) Addr(i int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].addr
}

// DataDir returns node i's data directory (Config.DataDir).
func (c *Cluster) DataDir(i int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].dir
}

// Index returns the index of the node running s, or -1.
func (c *Cluster) Index(s *store.Store) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, nd := range c.nodes {
		if nd.store != nil && nd.store == s {
			return i
		}
	}
	return -1
}

// running returns the running stores with their indexes.
func (c *Cluster) running() (idx []int, stores []*store.Store) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, nd := range c.nodes {
		if nd.store != nil {
			idx = append(idx, i)
			stores = append(stores, nd.store)
		}
	}
	return idx, stores
}

// Leader returns the running store that is the leader, or nil when there is
// none or more than one claims it (a deposed leader that has not noticed
// yet).
func (c *Cluster) Leader() *store.Store {
	_, stores := c.running()
	var leader *store.Store
	for _, s := range stores {
		if s.IsLeader() {
			if leader != nil {
				return nil
			}
			leader = s
		}
	}
	return leader
}

// Followers returns the running stores that are not the leader.
func (c *Cluster) Followers() []*store.Store {
	_, stores := c.running()
	var out []*store.Store
	for _, s := range stores {
		if !s.IsLeader() {
			out = append(out, s)
		}
	}
	return out
}

// WaitLeader waits until exactly one running store is the leader and
// returns it; it fails the test after timeout.
func (c *Cluster) WaitLeader(tb testing.TB, timeout time.Duration) *store.Store {
	tb.Helper()
	var leader *store.Store
	WaitFor(tb, timeout, "a single leader", func() bool {
		leader = c.Leader()
		return leader != nil
	})
	return leader
}

// Retryable reports whether err means the operation should be retried on
// the current leader: no leader, leadership lost or moving.
func Retryable(err error) bool {
	return errors.Is(err, store.ErrNotLeader) || errors.Is(err, store.ErrLeadershipLost) ||
		errors.Is(err, store.ErrLeadershipTransferInProgress)
}

// OnLeader runs op on the current leader, again on whichever is the leader
// then while op fails with a Retryable error, for up to timeout; it fails the
// test on another error or at the deadline. It returns the store op succeeded
// on. op must be safe to repeat, as every idempotent store operation is.
func (c *Cluster) OnLeader(tb testing.TB, timeout time.Duration, op func(ctx context.Context, leader *store.Store) error) *store.Store {
	tb.Helper()
	var (
		last error
		done *store.Store
	)
	WaitFor(tb, timeout, "an operation on the leader to succeed", func() bool {
		l := c.Leader()
		if l == nil {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), min(timeout, 5*time.Second))
		defer cancel()
		last = op(ctx, l)
		if last == nil {
			done = l
			return true
		}
		if !Retryable(last) {
			tb.Fatalf("operation on leader %s: %v", l.ID(), last)
		}
		return false
	})
	return done
}

// Apply applies cmd on the leader, retrying across leader changes as
// OnLeader does (so cmd must be safe to apply twice), and returns the FSM's
// response and the entry's index.
func (c *Cluster) Apply(tb testing.TB, cmd []byte) (resp any, index uint64) {
	tb.Helper()
	c.OnLeader(tb, 10*time.Second, func(ctx context.Context, l *store.Store) error {
		var err error
		resp, index, err = l.Apply(ctx, cmd)
		return err
	})
	return resp, index
}

// WaitFor polls cond until it returns true, and fails the test with what
// after timeout.
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// Stop closes node i's store, keeping its data directory and address.
// Stopping a stopped node does nothing.
func (c *Cluster) Stop(i int) {
	c.tb.Helper()
	c.mu.Lock()
	s := c.nodes[i].store
	c.nodes[i].store = nil
	c.mu.Unlock()
	if s == nil {
		return
	}
	if err := s.Close(); err != nil {
		c.tb.Errorf("stop node %d: %v", i, err)
	}
}

// Restart starts stopped node i again from its data directory, with a new
// FSM from the cluster's constructor, on its old address if that is still
// free and on a new port otherwise. When the port changed, it waits (up to
// 10s) for a leader and has it record the new address.
func (c *Cluster) Restart(i int) *store.Store {
	c.tb.Helper()
	if c.Store(i) != nil {
		c.tb.Fatalf("restart node %d: still running", i)
	}
	old := c.Addr(i)
	ln, err := net.Listen("tcp", old)
	if err != nil {
		ln = c.listen()
	}
	if err := c.start(i, ln); err != nil {
		c.tb.Fatalf("restart node %d: %v", i, err)
	}
	if addr := c.Addr(i); addr != old {
		c.updateAddress(i, addr)
	}
	return c.Store(i)
}

// updateAddress has the leader replace node i's address in the
// configuration, retrying across elections for up to 10s.
func (c *Cluster) updateAddress(i int, addr string) {
	c.tb.Helper()
	id := c.ID(i)
	c.OnLeader(c.tb, 10*time.Second, func(ctx context.Context, l *store.Store) error {
		return l.AddVoter(ctx, id, addr)
	})
}

// AddNode starts a new node with empty state and returns its index. It takes
// no part in the cluster until the leader adds it (AddVoter, AddNonvoter).
func (c *Cluster) AddNode() int {
	c.tb.Helper()
	c.mu.Lock()
	i := len(c.nodes)
	id := fmt.Sprintf("node%d", i)
	c.nodes = append(c.nodes, &node{id: id, dir: filepath.Join(c.base, id)})
	c.mu.Unlock()
	if err := c.start(i, c.listen()); err != nil {
		c.tb.Fatalf("start node %d: %v", i, err)
	}
	return i
}

// listen opens a listener on a free loopback port.
func (c *Cluster) listen() net.Listener {
	c.tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		c.tb.Fatalf("listen: %v", err)
	}
	return ln
}

// Close stops every node. It runs at test cleanup; calling it earlier is
// allowed.
func (c *Cluster) Close() {
	idx, stores := c.running()
	var wg sync.WaitGroup
	errs := make([]error, len(stores))
	for k, s := range stores {
		wg.Go(func() { errs[k] = s.Close() })
	}
	wg.Wait()
	c.mu.Lock()
	for _, i := range idx {
		c.nodes[i].store = nil
	}
	c.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		c.tb.Errorf("close cluster: %v", err)
	}
}

// EditLog opens the raft.db of a stopped node's data dir and runs edit on
// its log bucket (raft-boltdb's "logs": 8-byte big-endian indexes to
// entries), with the newest index stored: tests damage a log with it.
func EditLog(tb testing.TB, dataDir string, edit func(logs *bbolt.Bucket, last uint64) error) {
	tb.Helper()
	db, err := bbolt.Open(filepath.Join(dataDir, "raft", "raft.db"), 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		tb.Fatal(err)
	}
	err = db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket([]byte("logs"))
		if b == nil {
			return errors.New("no logs bucket")
		}
		k, _ := b.Cursor().Last()
		if k == nil {
			return errors.New("the log is empty")
		}
		return edit(b, binary.BigEndian.Uint64(k))
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		tb.Fatalf("edit the raft log in %s: %v", dataDir, err)
	}
}

// LogKey is the key of log index i in the log bucket.
func LogKey(i uint64) []byte { return binary.BigEndian.AppendUint64(nil, i) }
