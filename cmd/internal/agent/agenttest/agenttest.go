// Package agenttest starts whole agents in process — real Raft over TCP on
// 127.0.0.1, real bbolt, real gossip — for cluster tests and benchmarks.
package agenttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway/observe"
	"pilab.hu/pivirt-agent/internal/freeport"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// ClusterName is the cluster.name of every agent this test process starts:
// its own, so that gossip refuses the agents of other test processes (the
// other packages' tests run at the same time, e2e's agents among them)
// instead of merging with them when an address a node still knows (its
// peers file after a restart) has been taken by one of theirs. The tests of
// one process never run clusters at the same time.
var ClusterName = fmt.Sprintf("test-%d-%04x", os.Getpid(), rand.Uint32()&0xffff)

// Config returns a configuration for a test node: every port a free one of
// 127.0.0.1 below the kernel's ephemeral range (listenAddr), TLS off, Raft
// timeouts at the library defaults, the process's ClusterName.
func Config(name, dataDir string) *config.Config {
	cfg := config.Default()
	cfg.NodeName = name
	cfg.DataDir = dataDir
	cfg.Cluster.Name = ClusterName
	cfg.TLS.Enabled = false
	cfg.Server.ConnectRPC.Addr = listenAddr(false)
	cfg.Server.GRPCInternal.Addr = listenAddr(false)
	cfg.Server.Metrics.Addr = listenAddr(false)
	cfg.Cluster.Gossip.BindAddr = listenAddr(true)
	cfg.Cluster.Raft.Addr = listenAddr(false)
	cfg.Cluster.Raft.DeadServerCleanup = config.Duration(0)
	cfg.Cluster.ForwardHoldTimeout = config.Duration(7 * time.Second)
	cfg.Logging.Level = "debug"
	return cfg
}

// Test ports come from [portLow, portHigh), below Linux's ephemeral range
// (32768-60999): a node restarted on its ports (Restart without newPorts)
// then never finds one taken by an outgoing connection's local port or by
// another listener on :0, which the kernel hands out from that range.
const (
	portLow  = 20000
	portHigh = 32768
)

// handedOut are the ports listenAddr gave this process: a node's ports are
// chosen before it listens, so a port free now may be another node's.
var handedOut struct {
	sync.Mutex
	ports map[int]bool
}

// listenAddr is 127.0.0.1 with a port of the test range that is free now
// (for TCP, and for UDP too with udp: gossip binds both) and not given out
// before in this process; 127.0.0.1:0 after 100 taken ones.
func listenAddr(udp bool) string {
	handedOut.Lock()
	defer handedOut.Unlock()
	if handedOut.ports == nil {
		handedOut.ports = make(map[int]bool)
	}
	for range 100 {
		port := portLow + rand.IntN(portHigh-portLow)
		if handedOut.ports[port] {
			continue
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		ok := true
		if udp {
			pc, err := net.ListenPacket("udp", addr)
			if err == nil {
				pc.Close()
			}
			ok = err == nil
		}
		ln.Close()
		if ok {
			handedOut.ports[port] = true
			return addr
		}
	}
	return "127.0.0.1:0"
}

// Options returns agent options for tests: fast gossip failure detection and
// reconciliation.
func Options(logger *slog.Logger) agent.Options {
	return agent.Options{
		Logger:                     logger,
		GossipProfile:              "local",
		ReconcileInterval:          500 * time.Millisecond,
		DeadNodeReclaimTime:        time.Second,
		LeaveTimeout:               5 * time.Second,
		TTLInterval:                200 * time.Millisecond,
		MinCheckInterval:           100 * time.Millisecond,
		MinDeregisterCriticalAfter: 500 * time.Millisecond,
		Stabilization:              500 * time.Millisecond,
		GossipReconnectInterval:    time.Second,
		TraceBatchTimeout:          200 * time.Millisecond,
		EtcdSessionTTL:             2 * time.Second,
	}
}

// Node is one in-process agent.
type Node struct {
	*agent.Agent
	Name string
	Cfg  *config.Config
	API  clusterv1connect.ClusterServiceClient
	http *http.Client
}

// Cluster is a set of in-process agents.
type Cluster struct {
	tb    testing.TB
	logs  *LogBuffer
	mu    sync.Mutex
	nodes []*Node
	dirs  []string
	// opts, when set, changes the options of every agent started.
	opts func(*agent.Options)
}

// LogBuffer collects the agents' logs and prints their tail when the test
// fails.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf.Len() > 32<<20 {
		b.buf.Reset()
	}
	return b.buf.Write(p)
}

// Len is how much the buffer holds: a mark for Since.
func (b *LogBuffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Len()
}

// Since returns what was written after mark (everything after a reset).
func (b *LogBuffer) Since(mark int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if mark > b.buf.Len() {
		mark = 0
	}
	return b.buf.String()[mark:]
}

// Tail returns the last n lines.
func (b *LogBuffer) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	lines := strings.Split(b.buf.String(), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// New returns an empty cluster; nodes are added with Start.
func New(tb testing.TB) *Cluster {
	tb.Helper()
	// The test's temporary directory is created, and its removal
	// registered, before the shutdown below: cleanups run last-registered
	// first, so every t.TempDir() of the test (the agents' data dirs) is
	// removed only after the agents stopped writing into it.
	_ = tb.TempDir()
	c := &Cluster{tb: tb, logs: &LogBuffer{}}
	tb.Cleanup(func() {
		c.mu.Lock()
		nodes := append([]*Node(nil), c.nodes...)
		c.mu.Unlock()
		for _, n := range nodes {
			if n != nil {
				_ = n.Shutdown()
				n.http.CloseIdleConnections()
			}
		}
		if tb.Failed() {
			tb.Logf("last agent log lines:\n%s", c.logs.Tail(200))
		}
	})
	return c
}

// Logs returns the buffer all the cluster's agents log into.
func (c *Cluster) Logs() *LogBuffer { return c.logs }

// Logger returns a logger writing into the cluster's log buffer.
func (c *Cluster) Logger(name string) *slog.Logger {
	return c.logger(name, nil)
}

// logger is Logger at levels the agent may change (nil: debug).
func (c *Cluster) logger(name string, levels *observe.Levels) *slog.Logger {
	h := slog.Handler(slog.NewTextHandler(c.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if levels != nil {
		h = levels.Handler(h)
	}
	return slog.New(h).With("node", name)
}

// Start starts node i (a new slot when i == len(nodes)) with cfg.
func (c *Cluster) Start(i int, cfg *config.Config) *Node {
	c.tb.Helper()
	// The agent sets its logger's levels (logging.level, live).
	levels := new(observe.Levels)
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.Logging.Level)); err != nil {
		c.tb.Fatalf("agent %s: logging.level: %v", cfg.NodeName, err)
	}
	levels.SetLevel(level)
	opts := Options(c.logger(cfg.NodeName, levels))
	opts.Levels = levels
	if c.opts != nil {
		c.opts(&opts)
	}
	a, err := agent.New(cfg, opts)
	if err != nil {
		c.tb.Fatalf("new agent %s: %v", cfg.NodeName, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Start(ctx); err != nil {
		c.tb.Fatalf("start agent %s: %v", cfg.NodeName, err)
	}
	hc := NewHTTPClient()
	n := &Node{Agent: a, Name: cfg.NodeName, Cfg: cfg, http: hc, API: NewClient(hc, a.APIAddr())}
	c.mu.Lock()
	defer c.mu.Unlock()
	if i == len(c.nodes) {
		c.nodes = append(c.nodes, n)
		c.dirs = append(c.dirs, cfg.DataDir)
	} else {
		c.nodes[i] = n
	}
	return n
}

// NewHTTPClient returns an HTTP/2 cleartext client.
func NewHTTPClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// NewClient returns a ClusterService client for an API address.
func NewClient(hc *http.Client, addr string) clusterv1connect.ClusterServiceClient {
	return clusterv1connect.NewClusterServiceClient(hc, "http://"+addr)
}

// Dir returns the data dir of node i.
func (c *Cluster) Dir(i int) string { return c.dirs[i] }

// Node returns node i.
func (c *Cluster) Node(i int) *Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i]
}

// Nodes returns the running nodes.
func (c *Cluster) Nodes() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*Node
	for _, n := range c.nodes {
		if n != nil && !n.stopped() {
			out = append(out, n)
		}
	}
	return out
}

func (n *Node) stopped() bool {
	select {
	case <-n.Done():
		return true
	default:
		return false
	}
}

// NewExpect starts n nodes with bootstrap_expect n; every node after the
// first joins the first one's gossip address. mutate may adjust each
// node's configuration.
func NewExpect(tb testing.TB, n int, mutate func(i int, cfg *config.Config)) *Cluster {
	tb.Helper()
	return NewExpectOptions(tb, n, mutate, nil)
}

// NewExpectOptions is NewExpect with opts changing every agent's options.
func NewExpectOptions(tb testing.TB, n int, mutate func(i int, cfg *config.Config), opts func(*agent.Options)) *Cluster {
	tb.Helper()
	c := New(tb)
	c.opts = opts
	var seed string
	for i := range n {
		cfg := Config(fmt.Sprintf("node%d", i+1), filepath.Join(tb.TempDir(), fmt.Sprintf("node%d", i+1)))
		cfg.Cluster.Raft.BootstrapExpect = n
		if seed != "" {
			cfg.Cluster.Join = []string{seed}
		}
		if mutate != nil {
			mutate(i, cfg)
		}
		node := c.Start(i, cfg)
		if seed == "" {
			seed = node.GossipAddr()
		}
	}
	return c
}

// NewEtcd starts n nodes in etcd mode (service_discovery.type etcd) on the
// etcd at endpoints; every node after the first joins the first one's
// gossip address. mutate may adjust each node's configuration.
func NewEtcd(tb testing.TB, n int, endpoints []string, mutate func(i int, cfg *config.Config)) *Cluster {
	tb.Helper()
	// bootstrap_expect, which NewExpect sets, does nothing in etcd mode.
	return NewExpect(tb, n, func(i int, cfg *config.Config) {
		cfg.ServiceDiscovery.Type = config.DiscoveryEtcd
		cfg.ServiceDiscovery.Etcd.Endpoints = endpoints
		if mutate != nil {
			mutate(i, cfg)
		}
	})
}

// Kill stops node i without leaving (as a crash would, minus the lost
// in-flight writes).
func (c *Cluster) Kill(i int) {
	c.tb.Helper()
	n := c.Node(i)
	if err := n.Shutdown(); err != nil {
		c.tb.Logf("shutdown %s: %v", n.Name, err)
	}
	n.http.CloseIdleConnections()
}

// Restart starts node i again on its data dir. With newPorts it listens on
// fresh ports, else on the ones it had. It joins the given gossip address.
func (c *Cluster) Restart(i int, newPorts bool, join string) *Node {
	c.tb.Helper()
	old := c.Node(i)
	cfg := *old.Cfg
	if newPorts {
		cfg.Server.ConnectRPC.Addr = listenAddr(false)
		cfg.Server.GRPCInternal.Addr = listenAddr(false)
		cfg.Server.Metrics.Addr = listenAddr(false)
		if old.RaftAddr() != "" {
			cfg.Cluster.Raft.Addr = listenAddr(false)
		}
		cfg.Cluster.Gossip.BindAddr = listenAddr(true)
	} else {
		cfg.Server.ConnectRPC.Addr = old.APIAddr()
		cfg.Server.GRPCInternal.Addr = old.InternalAddr()
		cfg.Server.Metrics.Addr = old.MetricsAddr()
		if addr := old.RaftAddr(); addr != "" { // none in etcd mode
			cfg.Cluster.Raft.Addr = addr
		}
		cfg.Cluster.Gossip.BindAddr = old.GossipAddr()
	}
	cfg.Cluster.Join = nil
	if join != "" {
		cfg.Cluster.Join = []string{join}
	}
	cfg.Cluster.Raft.BootstrapExpect = 0
	cfg.Cluster.Raft.Bootstrap = false
	return c.Start(i, &cfg)
}

// Eventually polls f until it returns nil or timeout passes.
func Eventually(tb testing.TB, timeout time.Duration, what string, f func() error) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for {
		if err = f(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%s: not true after %s: %v", what, timeout, err)
		}
		time.Sleep(50 * time.Millisecond) // polling interval, not synchronisation
	}
}

// WaitLeader waits until every running node knows the same leader, which has
// established its leadership, and applied the latest cluster version, and
// returns the leader.
func (c *Cluster) WaitLeader(timeout time.Duration) *Node {
	c.tb.Helper()
	var leader *Node
	Eventually(c.tb, timeout, "a leader known to every node", func() error {
		leader = nil
		nodes := c.Nodes()
		for _, n := range nodes {
			if n.IsLeader() {
				leader = n
			}
		}
		if leader == nil {
			return errors.New("no leader")
		}
		for _, n := range nodes {
			if id := n.LeaderID(); id != leader.NodeID() {
				return fmt.Errorf("%s sees leader %q, want %s", n.Name, id, leader.Name)
			}
		}
		// Every node runs this release: the leader raises the cluster
		// version to it right after the cluster forms.
		for _, n := range nodes {
			if v := n.ClusterVersion(); v != fsm.Latest {
				return fmt.Errorf("%s applied cluster version %s, want %s", n.Name, v, fsm.Latest)
			}
		}
		return nil
	})
	return leader
}

// WaitPeers waits until the leader's Raft configuration has want voters
// and wantNonvoters non-voters.
func (c *Cluster) WaitPeers(timeout time.Duration, voters, nonvoters int) {
	c.tb.Helper()
	Eventually(c.tb, timeout, fmt.Sprintf("%d voters and %d non-voters", voters, nonvoters), func() error {
		var leader *Node
		for _, n := range c.Nodes() {
			if n.IsLeader() {
				leader = n
			}
		}
		if leader == nil {
			return errors.New("no leader")
		}
		servers, err := leader.Store().Servers(context.Background())
		if err != nil {
			return err
		}
		v, nv := 0, 0
		for _, s := range servers {
			if s.Voter {
				v++
			} else {
				nv++
			}
		}
		if v != voters || nv != nonvoters {
			return fmt.Errorf("have %d voters and %d non-voters: %+v", v, nv, servers)
		}
		return nil
	})
}

// Follower returns a running node that is not the leader.
func (c *Cluster) Follower() *Node {
	c.tb.Helper()
	for _, n := range c.Nodes() {
		if !n.IsLeader() {
			return n
		}
	}
	c.tb.Fatal("no follower running")
	return nil
}

// Index returns the slot of n.
func (c *Cluster) Index(n *Node) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, m := range c.nodes {
		if m == n {
			return i
		}
	}
	return -1
}

// Register registers one service instance through node n.
func Register(ctx context.Context, n *Node, service, id, addr string, port uint32) (*clusterv1.RegisterServiceResponse, error) {
	resp, err := n.API.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: service, InstanceId: id, Address: addr, Port: port},
	}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// FreePort returns a port of 127.0.0.1 that was free for TCP and UDP when
// picked, outside the range the kernel gives outgoing connections (so that
// no connection takes it before the process it is meant for binds it).
func FreePort(tb testing.TB) int {
	tb.Helper()
	ports, err := freeport.Pick(1)
	if err != nil {
		tb.Fatal(err)
	}
	return ports[0]
}

// Contains reports whether any log line holds s.
func (b *LogBuffer) Contains(s string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Contains(b.buf.String(), s)
}
