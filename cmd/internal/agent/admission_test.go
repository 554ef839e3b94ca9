package agent_test

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	"pilab.hu/pivirt-agent/store"
)

// impostor is a plain gossip member that holds the cluster's gossip key and
// no certificate, and claims to be a server. Its internal address is a
// listener that counts the connections made to it: each is an attempt to
// make it prove an identity it does not have.
type impostor struct {
	g     *cluster.Gossip
	dials atomic.Int32
}

func startImpostor(t *testing.T, name, id, join string, key []byte) *impostor {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	imp := &impostor{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			imp.dials.Add(1)
			c.Close()
		}
	}()
	gcfg := cluster.DefaultGossipConfig()
	gcfg.NodeName = name
	gcfg.BindAddr = "127.0.0.1:0"
	gcfg.Profile = "local"
	gcfg.SecretKey = key
	gcfg.Meta = cluster.NodeMeta{Cluster: agenttest.ClusterName, ID: id, Role: cluster.RoleServer,
		RaftAddr: fmt.Sprintf("127.0.0.1:%d", agenttest.FreePort(t)), InternalAddr: ln.Addr().String(), Version: "0.0.0"}
	if imp.g, err = cluster.NewGossip(gcfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = imp.g.Shutdown() })
	// The local profile's join times out after 1 s: on loaded cores (the
	// race detector, 20 members of this process) it may, as a real
	// agent's retry_join would, try again.
	agenttest.Eventually(t, 30*time.Second, "impostor "+name+" joins", func() error {
		_, err := imp.g.Join([]string{join})
		return err
	})
	return imp
}

func serverSet(t *testing.T, n *agenttest.Node) map[string]store.Server {
	t.Helper()
	servers, err := n.Store().Servers(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]store.Server)
	for _, s := range servers {
		out[s.ID] = s
	}
	return out
}

// TestGossipKeyAloneAdmitsNoServer is the attack of a gossip key holder
// without a certificate: members that claim to be servers — new ones, and
// one claiming a stopped server's node ID at another address — are asked to
// prove their agent identity and never enter the Raft configuration, and
// the stopped server comes back into its place. A server with its agent
// certificate still joins.
func TestGossipKeyAloneAdmitsNoServer(t *testing.T) {
	dir := testPKI(t, 4)
	keyText, keyFile := gossipKey(t)
	key, err := cluster.ParseGossipKey(keyText)
	if err != nil {
		t.Fatal(err)
	}
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		cfg.Cluster.Gossip.EncryptKeyFile = keyFile
	})
	leader := c.WaitLeader(60 * time.Second)
	c.WaitPeers(60*time.Second, 3, 0)
	before := serverSet(t, leader)

	var imps []*impostor
	for i := range 20 {
		imps = append(imps, startImpostor(t, fmt.Sprintf("evil-%d", i), newNodeID(t), leader.GossipAddr(), key))
	}
	// One claims a stopped follower's node ID at its own addresses.
	victim := c.Follower()
	vi := c.Index(victim)
	victimID := victim.NodeID()
	c.Kill(vi)
	imps = append(imps, startImpostor(t, victim.Name+"-again", victimID, leader.GossipAddr(), key))
	// Failure detection is not slowed by the crowd: the stopped server is
	// seen failed as soon as without it (the local profile: seconds).
	agenttest.Eventually(t, 30*time.Second, "the stopped server seen failed", func() error {
		for _, m := range leader.Gossip().Members() {
			if m.Name == victim.Name && m.Status != cluster.StatusFailed && m.Status != cluster.StatusLeft {
				return fmt.Errorf("%s is %v", m.Name, m.Status)
			}
		}
		return nil
	})

	// Every impostor is asked (its internal address dialled) at least twice:
	// two reconciliations looked at it. (Unless the configuration changed,
	// which fails below.)
	agenttest.Eventually(t, 60*time.Second, "every impostor asked for proof twice", func() error {
		if l := c.WaitLeader(30 * time.Second); len(serverSet(t, l)) != len(before) {
			return nil
		}
		for i, imp := range imps {
			if n := imp.dials.Load(); n < 2 {
				return fmt.Errorf("impostor %d asked %d times", i, n)
			}
		}
		return nil
	})
	leader = c.WaitLeader(30 * time.Second)
	after := serverSet(t, leader)
	if len(after) != len(before) {
		t.Fatalf("raft configuration changed: before %v, after %v", before, after)
	}
	for id, s := range before {
		if after[id] != s {
			t.Fatalf("server %s changed: %+v -> %+v", id, s, after[id])
		}
	}
	if c.Logs().Contains("added non-voter") || c.Logs().Contains("server address changed") {
		t.Fatal("the leader logged a membership change for an impostor")
	}
	if !c.Logs().Contains("did not prove the agent identity it claims in gossip") {
		t.Fatal("no log line names the refused members")
	}

	// The stopped server restarts on its addresses while the impostor still
	// claims its ID, and catches up with the leader.
	back := c.Restart(vi, false, leader.GossipAddr())
	api := clusterv1connect.NewClusterServiceClient(httpsClient(t, filepath.Join(dir, identity.ChainFile), apiClientCert(t, dir)), "https://"+leader.APIAddr())
	if _, err := api.RegisterService(context.Background(), connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
		Service: "web", InstanceId: "w-1", Address: "10.0.0.1", Port: 80,
	}})); err != nil {
		t.Fatal(err)
	}
	want := leader.Store().Status().CommitIndex
	agenttest.Eventually(t, 60*time.Second, "the restarted server caught up", func() error {
		st := back.Store().Status()
		if st.LeaderID == "" || st.AppliedIndex < want {
			return fmt.Errorf("leader %q, applied %d of %d", st.LeaderID, st.AppliedIndex, want)
		}
		return nil
	})

	// A server with its agent certificate is admitted as before (voters
	// are at the target: it stays a non-voter).
	cfg := agenttest.Config("node4", filepath.Join(t.TempDir(), "node4"))
	withTLS(dir)(3, cfg)
	cfg.Cluster.Gossip.EncryptKeyFile = keyFile
	cfg.Cluster.Join = []string{leader.GossipAddr()}
	c.Start(3, cfg)
	c.WaitPeers(60*time.Second, 3, 1)
}

// newNodeID makes a node ID of the agents' form.
func newNodeID(t *testing.T) string {
	t.Helper()
	id, err := identity.LoadOrCreateNodeID(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return id
}
