package agent_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

func readOpts(mode clusterv1.Consistency) *clusterv1.ReadOptions {
	return &clusterv1.ReadOptions{Consistency: mode}
}

func instances(ctx context.Context, n *agenttest.Node, service string, mode clusterv1.Consistency) ([]*clusterv1.ServiceInstance, error) {
	resp, err := n.API.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: service, Read: readOpts(mode)}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetInstances(), nil
}

// TestEtcdMode: three agents in etcd mode over a three-member etcd that
// requires client certificates over HTTPS (the spec's etcd block: https
// endpoints, ca_file, cert_file, key_file) serve the cluster API from any
// node, writes and reads alike; one holds the schedule leadership; /ready
// follows etcd; Raft-only calls say why not.
func TestEtcdMode(t *testing.T) {
	pki := agenttest.EtcdPKI(t, t.TempDir())
	ec := etcdtest.StartTLS(t, 3, pki)
	c := agenttest.NewEtcd(t, 3, ec.Endpoints, func(_ int, cfg *config.Config) {
		cfg.ServiceDiscovery.Etcd.CAFile = pki.CAFile
		cfg.ServiceDiscovery.Etcd.CertFile = pki.ClientCertFile
		cfg.ServiceDiscovery.Etcd.KeyFile = pki.ClientKeyFile
	})
	leader := c.WaitLeader(60 * time.Second)
	nodes := c.Nodes()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// Written through one agent, read consistently through each other.
	for i, n := range nodes {
		if _, err := agenttest.Register(ctx, n, "web", fmt.Sprintf("i%d", i), "127.0.0.1", uint32(8080+i)); err != nil {
			t.Fatalf("register through %s: %v", n.Name, err)
		}
	}
	for _, n := range nodes {
		got, err := instances(ctx, n, "web", clusterv1.Consistency_CONSISTENCY_CONSISTENT)
		if err != nil || len(got) != 3 {
			t.Fatalf("consistent read on %s: %v (%v), want 3 instances", n.Name, got, err)
		}
		agenttest.Eventually(t, 10*time.Second, "default read on "+n.Name, func() error {
			got, err := instances(ctx, n, "web", clusterv1.Consistency_CONSISTENCY_DEFAULT)
			if err != nil || len(got) != 3 {
				return fmt.Errorf("%d instances (%v)", len(got), err)
			}
			return nil
		})
	}

	retryThroughAnotherNode(t, nodes[0], nodes[1])

	// Config compare-and-set across agents.
	zero := uint64(0)
	set, err := nodes[0].API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/log_level", Value: "info", CasRevision: &zero}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = nodes[1].API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/log_level", Value: "debug", CasRevision: &zero}))
	if connect.CodeOf(err) != connect.CodeAborted {
		t.Fatalf("a second create through another agent: %v, want Aborted", err)
	}
	rev := set.Msg.GetEntry().GetRevision()
	if _, err := nodes[2].API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "kv/log_level", Value: "debug", CasRevision: &rev})); err != nil {
		t.Fatalf("set with the current revision through a third agent: %v", err)
	}

	// The leader every agent names is the holder of the schedule
	// leadership.
	for _, n := range nodes {
		resp, err := n.API.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
		if err != nil || resp.Msg.GetNodeId() != leader.NodeID() {
			t.Fatalf("leader seen by %s: %v (%v), want %s", n.Name, resp, err, leader.NodeID())
		}
		code, body := get(t, "http://"+n.MetricsAddr()+"/ready")
		if code != 200 || !strings.Contains(body, `"etcd":"ok: revision`) || !strings.Contains(body, `"leader":"ok: `+leader.NodeID()) {
			t.Fatalf("/ready of %s: %d %s", n.Name, code, body)
		}
		if _, body := get(t, "http://"+n.MetricsAddr()+"/health"); !strings.Contains(body, `"raft_state":"etcd"`) {
			t.Fatalf("/health of %s: %s", n.Name, body)
		}
	}
	_, err = nodes[0].API.Peers(ctx, connect.NewRequest(&clusterv1.PeersRequest{}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("raft peers in etcd mode: %v, want FailedPrecondition naming etcd", err)
	}

	// Handing the schedule leadership over.
	to, err := leader.API.TransferLeader(ctx, connect.NewRequest(&clusterv1.TransferLeaderRequest{}))
	if err != nil || to.Msg.GetNodeId() == leader.NodeID() || to.Msg.GetNodeId() == "" {
		t.Fatalf("transfer: %v (%v)", to, err)
	}
	next := c.WaitLeader(30 * time.Second)
	if next.NodeID() != to.Msg.GetNodeId() {
		t.Fatalf("leader %s after a transfer to %s", next.NodeID(), to.Msg.GetNodeId())
	}
}

// TestEtcdOutage stops etcd under two agents: they report not ready,
// serve stale reads from their last state, refuse default reads and
// writes with Unavailable naming etcd, and recover when etcd returns.
func TestEtcdOutage(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	c := agenttest.NewEtcd(t, 2, ec.Endpoints, nil)
	c.WaitLeader(60 * time.Second)
	a, b := c.Node(0), c.Node(1)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if _, err := agenttest.Register(ctx, a, "web", "x", "127.0.0.1", 80); err != nil {
		t.Fatal(err)
	}
	if got, err := instances(ctx, b, "web", clusterv1.Consistency_CONSISTENCY_CONSISTENT); err != nil || len(got) != 1 {
		t.Fatalf("before the outage: %v %v", got, err)
	}

	ec.Stop(0)
	for _, n := range []*agenttest.Node{a, b} {
		agenttest.Eventually(t, 20*time.Second, n.Name+" not ready", func() error {
			code, body := get(t, "http://"+n.MetricsAddr()+"/ready")
			// The cause, not only the requests' deadline.
			if code != 503 || !strings.Contains(body, `"etcd":"unreachable`) || !strings.Contains(body, "connection refused") {
				return fmt.Errorf("%d %s", code, body)
			}
			return nil
		})
		got, err := instances(ctx, n, "web", clusterv1.Consistency_CONSISTENCY_STALE)
		if err != nil || len(got) != 1 {
			t.Fatalf("stale read on %s during the outage: %v (%v), want the last state", n.Name, got, err)
		}
	}
	start := time.Now()
	_, err := instances(ctx, b, "web", clusterv1.Consistency_CONSISTENCY_DEFAULT)
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("default read during the outage: %v, want Unavailable naming etcd", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("the refused read took %s", d)
	}
	// Said in an ErrorInfo, so that pvcli asks again only while another
	// whole wait fits in its timeout.
	if !hasErrorReason(err, gateway.ReasonStoreUnavailable) {
		t.Errorf("default read during the outage: %v, want the ErrorInfo reason %s", err, gateway.ReasonStoreUnavailable)
	}
	_, err = agenttest.Register(ctx, a, "web", "y", "127.0.0.1", 81)
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeUnavailable || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("write during the outage: %v, want Unavailable naming etcd", err)
	}

	ec.Restart(0)
	for _, n := range []*agenttest.Node{a, b} {
		agenttest.Eventually(t, 45*time.Second, n.Name+" ready again", func() error {
			if code, body := get(t, "http://"+n.MetricsAddr()+"/ready"); code != 200 {
				return fmt.Errorf("%d %s", code, body)
			}
			return nil
		})
	}
	if _, err := agenttest.Register(ctx, a, "web", "y", "127.0.0.1", 81); err != nil {
		t.Fatalf("write after the outage: %v", err)
	}
	if got, err := instances(ctx, b, "web", clusterv1.Consistency_CONSISTENCY_CONSISTENT); err != nil || len(got) != 2 {
		t.Fatalf("after the outage: %v %v, want 2 instances", got, err)
	}
}

// TestEtcdTLSRefused: an agent whose client certificate etcd does not
// accept and one that does not trust etcd's certificate start, report not
// ready naming the TLS failure, and follow etcd without a restart once
// their files are right.
func TestEtcdTLSRefused(t *testing.T) {
	pki := agenttest.EtcdPKI(t, t.TempDir())
	other := agenttest.EtcdPKI(t, t.TempDir()) // a CA etcd does not know
	ec := etcdtest.StartTLS(t, 1, pki)
	type files struct{ ca, cert, key string }
	good := files{pki.CAFile, pki.ClientCertFile, pki.ClientKeyFile}
	bad := []files{
		{pki.CAFile, other.ClientCertFile, other.ClientKeyFile}, // etcd refuses the agent
		{other.CAFile, pki.ClientCertFile, pki.ClientKeyFile},   // the agent refuses etcd
	}
	want := []string{"etcd closed the connection", "certificate signed by unknown authority"}
	copyFile := func(from, to string) {
		t.Helper()
		b, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		if err := identity.WriteFileAtomic(to, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	use := make([]files, len(bad))
	for i, f := range bad {
		dir := t.TempDir()
		use[i] = files{filepath.Join(dir, "ca.crt"), filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")}
		copyFile(f.ca, use[i].ca)
		copyFile(f.cert, use[i].cert)
		copyFile(f.key, use[i].key)
	}
	c := agenttest.NewEtcd(t, 2, ec.Endpoints, func(i int, cfg *config.Config) {
		cfg.ServiceDiscovery.Etcd.CAFile = use[i].ca
		cfg.ServiceDiscovery.Etcd.CertFile = use[i].cert
		cfg.ServiceDiscovery.Etcd.KeyFile = use[i].key
	})
	for i, n := range c.Nodes() {
		agenttest.Eventually(t, 20*time.Second, n.Name+" not ready, naming the TLS failure", func() error {
			code, body := get(t, "http://"+n.MetricsAddr()+"/ready")
			if code != 503 || !strings.Contains(body, `"etcd":"unreachable`) || !strings.Contains(body, want[i]) {
				return fmt.Errorf("%d %s", code, body)
			}
			t.Logf("%s: %s", n.Name, body)
			return nil
		})
	}
	for i := range use {
		copyFile(good.ca, use[i].ca)
		copyFile(good.cert, use[i].cert)
		copyFile(good.key, use[i].key)
	}
	for _, n := range c.Nodes() {
		agenttest.Eventually(t, 45*time.Second, n.Name+" ready with the right files", func() error {
			if code, body := get(t, "http://"+n.MetricsAddr()+"/ready"); code != 200 {
				return fmt.Errorf("%d %s", code, body)
			}
			return nil
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := agenttest.Register(ctx, c.Node(0), "web", "x", "127.0.0.1", 80); err != nil {
		t.Fatalf("write once the files are right: %v", err)
	}
}

// TestEtcdConns: the agent's etcd connections (etcdstore.Conns, with
// identity's TLS as openEtcd builds them, or plaintext) to an endpoint
// named by host name: a refused dial is named as the endpoint is, and the
// connection made once etcd is back clears it.
func TestEtcdConns(t *testing.T) {
	t.Run("plaintext", func(t *testing.T) {
		ec := etcdtest.Start(t, 1)
		testConns(t, ec, "http", nil)
	})
	t.Run("tls", func(t *testing.T) {
		pki := agenttest.EtcdPKI(t, t.TempDir())
		ec := etcdtest.StartTLS(t, 1, pki)
		src, err := identity.NewSource(identity.SourceConfig{CertFile: pki.ClientCertFile, KeyFile: pki.ClientKeyFile, CAFile: pki.CAFile})
		if err != nil {
			t.Fatal(err)
		}
		testConns(t, ec, "https", src.ClientConfig)
	})
}

func testConns(t *testing.T, ec *etcdtest.Cluster, scheme string, tlsFor func(string) *tls.Config) {
	_, port, err := net.SplitHostPort(strings.TrimPrefix(ec.Endpoints[0], scheme+"://"))
	if err != nil {
		t.Fatal(err)
	}
	conns := new(etcdstore.Conns)
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{scheme + "://localhost:" + port},
		DialOptions: conns.DialOptions(tlsFor),
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	get := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := cli.Get(ctx, "k")
		return err
	}
	connected := func() error {
		if err := get(); err != nil {
			return err
		}
		return conns.Err()
	}
	agenttest.Eventually(t, 10*time.Second, "connected", connected)
	ec.Stop(0)
	agenttest.Eventually(t, 20*time.Second, "the refused dial named", func() error {
		if get() == nil {
			return errors.New("a get succeeded with etcd stopped")
		}
		if e := conns.Err(); e == nil || !strings.HasPrefix(e.Error(), "localhost:"+port+": dial tcp") || !strings.Contains(e.Error(), "connection refused") {
			return fmt.Errorf("conns: %v", e)
		}
		return nil
	})
	ec.Restart(0)
	agenttest.Eventually(t, 30*time.Second, "connected again, nothing left", connected)
}

// TestEtcdScheduleLeaderKills: the schedule leadership moves through the
// etcd election while the leading agent is stopped and restarted three
// times; every slot runs exactly once, as in Raft mode.
func TestEtcdScheduleLeaderKills(t *testing.T) {
	if testing.Short() {
		t.Skip("kills leaders; skipped with -short")
	}
	ec := etcdtest.Start(t, 3)
	s := startSim(t)
	leaderKills(t, newScheduleEnvOn(t, s, agenttest.NewEtcd(t, 3, ec.Endpoints, withBackends(s.addr))))
}

// hasErrorReason reports whether err carries a google.rpc.ErrorInfo with
// reason.
func hasErrorReason(err error, reason string) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return false
	}
	for _, d := range ce.Details() {
		if v, err := d.Value(); err == nil {
			if ei, ok := v.(*errdetails.ErrorInfo); ok && ei.GetReason() == reason {
				return true
			}
		}
	}
	return false
}
