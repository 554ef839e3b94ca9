package agent_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestNetworkPolicy: with auth.network_policy, agents whose certificates
// name the service agent.pivirt.internal form a cluster over the internal
// and Raft ports, while an agent identity of another service, or one with
// no service name, is refused on the internal port; the agent reaches the
// backend a policy allows (the spec's allow-agent-to-pivirtd, on the
// backend's port) and is refused by one on a port no policy lists. Every
// refusal is logged.
func TestNetworkPolicy(t *testing.T) {
	dir, issue := agentServicePKI(t, 3)
	chain := filepath.Join(dir, identity.ChainFile)
	backend := func(name string) *simServer {
		f := issue(identity.LeafRequest{Kind: identity.KindServer, Name: name, DNS: []string{name}})
		src, err := identity.NewSource(identity.SourceConfig{CertFile: f.Cert, KeyFile: f.Key, CAFile: chain})
		if err != nil {
			t.Fatal(err)
		}
		return startSimAt(t, "127.0.0.1:0", grpc.Creds(credentials.NewTLS(src.ServerConfig(tls.RequireAndVerifyClientCert, nil))))
	}
	pivirtd, iscsiman := backend("pivirtd.pivirt.internal"), backend("iscsiman.pivirt.internal")
	_, pivirtdPort, _ := net.SplitHostPort(pivirtd.addr)
	policy := filepath.Join(t.TempDir(), "network-policy.yaml")
	if err := os.WriteFile(policy, []byte(`apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata:
  name: agents
spec:
  ingress:
    - from:
        - service: "agent.pivirt.internal"
      to:
        - service: "agent.pivirt.internal"
---
apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata:
  name: allow-agent-to-pivirtd
spec:
  ingress:
    - from:
        - service: "agent.pivirt.internal"
      to:
        - service: "pivirtd.pivirt.internal"
      ports:
        - protocol: TCP
          port: `+pivirtdPort+`
    - from:
        - service: "agent.pivirt.internal"
      to:
        - service: "iscsiman.pivirt.internal"
      ports:
        - protocol: TCP
          port: 9002
`), 0o600); err != nil {
		t.Fatal(err)
	}
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		cfg.Auth.NetworkPolicy = policy
		tlsOn := config.BackendTLSConfig{Enabled: true}
		cfg.Backends = map[string]config.BackendConfig{
			"pivirtd":  {Endpoint: pivirtd.addr, Timeout: config.Duration(10 * time.Second), TLS: withName(tlsOn, "pivirtd.pivirt.internal")},
			"iscsiman": {Endpoint: iscsiman.addr, Timeout: config.Duration(10 * time.Second), TLS: withName(tlsOn, "iscsiman.pivirt.internal")},
		}
		cfg.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}},
			{Match: config.RouteMatch{Prefix: "/pivirt.storage.v1.StorageService"}, Route: config.RouteTarget{Cluster: "iscsiman"}},
		}
	})
	c.WaitLeader(60 * time.Second)
	c.WaitPeers(60*time.Second, 3, 0)
	n := c.Follower()

	// The internal port: agent identities of other services are refused.
	for name, req := range map[string]identity.LeafRequest{
		"another service":  {Kind: identity.KindClient, Name: "pivirt-agent-rogue", DNS: []string{"rogue.pivirt.internal"}},
		"no service names": {Kind: identity.KindClient, Name: "pivirt-agent-nameless"},
	} {
		f := issue(req)
		src, err := identity.NewSource(identity.SourceConfig{CertFile: f.Cert, KeyFile: f.Key, CAFile: chain})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		_, err = cluster.NewPoolTLS(src.ClientConfig).Node(n.InternalAddr()).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{}))
		cancel()
		if err == nil {
			t.Errorf("%s: an agent identity no policy allows was answered on the internal port", name)
		}
	}
	agenttest.Eventually(t, 10*time.Second, "the refusals logged", func() error {
		for _, want := range []string{`from=[rogue.pivirt.internal] from_cn=pivirt-agent-rogue`, `from=[] from_cn=pivirt-agent-nameless`, `what="internal port"`} {
			if !c.Logs().Contains(want) {
				return fmt.Errorf("no log line with %s", want)
			}
		}
		return nil
	})

	// Backends: pivirtd's port is allowed, iscsiman's is not.
	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*apiClientCert(t, dir)},
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	if _, err := vmv1.NewVMServiceClient(conn).ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
		t.Errorf("ListVMs to the backend the policy allows: %v", err)
	}
	_, err = storagev1.NewStorageServiceClient(conn).ListVolumes(ctx, &storagev1.ListVolumesRequest{})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("ListVolumes to a backend on a port no policy lists: %v, want Unavailable", err)
	}
	agenttest.Eventually(t, 10*time.Second, "the backend refusal logged", func() error {
		if !c.Logs().Contains(`to=[iscsiman.pivirt.internal]`) || !c.Logs().Contains(`what="backend iscsiman"`) {
			return fmt.Errorf("no log line names iscsiman's refusal")
		}
		return nil
	})
	if c.Logs().Contains(`to=[pivirtd.pivirt.internal]`) {
		t.Error("the allowed backend was refused at some point")
	}
}

// agentServicePKI is a test PKI whose nodes' agent and server certificates
// name the service agent.pivirt.internal (what network policies match),
// and a function that issues more leaves of it.
func agentServicePKI(t *testing.T, nodes int) (string, func(identity.LeafRequest) identity.LeafFiles) {
	t.Helper()
	dir := testPKI(t, nodes)
	issue := func(req identity.LeafRequest) identity.LeafFiles {
		t.Helper()
		req.Force = true
		f, err := identity.Issue(dir, req)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	agentSvc := []string{"agent.pivirt.internal"}
	for i := 1; i <= nodes; i++ {
		issue(identity.LeafRequest{Kind: identity.KindClient, Name: fmt.Sprintf("pivirt-agent-node%d", i), DNS: agentSvc})
		issue(identity.LeafRequest{Kind: identity.KindServer, Name: fmt.Sprintf("node%d-server", i), DNS: agentSvc, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	}
	return dir, issue
}

func portOf(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return port
}

func withName(b config.BackendTLSConfig, name string) config.BackendTLSConfig {
	b.ServerName = name
	return b
}

// TestClusterNetworkPolicy: auth.network_policy as a cluster setting is
// validated at write, enforced by every node on new handshakes and on the
// connections already open (closed, with a log line naming both
// identities), and its removal lets the refused peer in again.
func TestClusterNetworkPolicy(t *testing.T) { testClusterNetworkPolicy(t, nil) }

// TestEtcdClusterNetworkPolicy is TestClusterNetworkPolicy in etcd mode
// (the internal port only: no Raft port).
func TestEtcdClusterNetworkPolicy(t *testing.T) {
	testClusterNetworkPolicy(t, etcdtest.Start(t, 1).Endpoints)
}

func testClusterNetworkPolicy(t *testing.T, etcd []string) {
	dir, issue := agentServicePKI(t, 3)
	chain := filepath.Join(dir, identity.ChainFile)
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		if etcd != nil {
			cfg.ServiceDiscovery.Type = config.DiscoveryEtcd
			cfg.ServiceDiscovery.Etcd.Endpoints = etcd
		}
	})
	c.WaitLeader(60 * time.Second)
	if etcd == nil {
		c.WaitPeers(60*time.Second, 3, 0)
	}
	n := c.Follower()

	// A monitor with an agent identity of another service keeps a
	// connection open to n's internal port.
	f := issue(identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-monitor", DNS: []string{"monitor.pivirt.internal"}})
	src, err := identity.NewSource(identity.SourceConfig{CertFile: f.Cert, KeyFile: f.Key, CAFile: chain})
	if err != nil {
		t.Fatal(err)
	}
	monitor := cluster.NewPoolTLS(src.ClientConfig).Node(n.InternalAddr())
	ask := func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err := monitor.Status(ctx, connect.NewRequest(&nodev1.StatusRequest{}))
		return err
	}
	if err := ask(); err != nil {
		t.Fatalf("the monitor without a network policy: %v", err)
	}

	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*apiClientCert(t, dir)},
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	api := clusterv1.NewClusterServiceClient(conn)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := api.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: agent.NetworkPolicyKey, Value: "kind: NetworkPolicy\nspec: {ingress: [{from: [{service: x}], ports: [{port: 70000}]}]}\n"}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "70000") {
		t.Errorf("an invalid network policy: %v, want InvalidArgument naming the port", err)
	}
	// A policy that would cut the agents off from each other is refused.
	if _, err := api.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: agent.NetworkPolicyKey, Value: `apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata:
  name: monitor-only
spec:
  ingress:
    - from:
        - service: "monitor.pivirt.internal"
`}); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "would cut the agents off from each other: no NetworkPolicy allows agent.pivirt.internal to connect to agent.pivirt.internal on the ") ||
		!strings.Contains(err.Error(), "internal port "+portOf(n.InternalAddr())) || etcd == nil && !strings.Contains(err.Error(), "raft port "+portOf(n.RaftAddr())) ||
		!strings.Contains(err.Error(), `e.g. add to spec.ingress: {from: [{service: "agent.pivirt.internal"}], ports: [`) {
		t.Errorf("a policy that cuts the agents apart: %v", err)
	}
	set, err := api.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: agent.NetworkPolicyKey, Value: `apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata:
  name: agents
spec:
  ingress:
    - from:
        - service: "agent.pivirt.internal"
      to:
        - service: "agent.pivirt.internal"
`})
	if err != nil {
		t.Fatal(err)
	}
	// The check answers as the connections are treated.
	check := func(from, to string, port uint32) *clusterv1.CheckNetworkPolicyResponse {
		t.Helper()
		r, err := api.CheckNetworkPolicy(ctx, &clusterv1.CheckNetworkPolicyRequest{From: from, To: to, Port: port})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	agenttest.Eventually(t, 5*time.Second, "the cluster's policy in force on "+n.Name, func() error {
		if r := check("monitor.pivirt.internal", "agent.pivirt.internal", 9000); r.GetAllowed() || r.GetSource() != "cluster" {
			return fmt.Errorf("monitor -> agent: %v", r)
		}
		return nil
	})
	if r := check("agent.pivirt.internal", "agent.pivirt.internal", 8300); !r.GetAllowed() || r.GetPolicy() != "agents" {
		t.Errorf("agent -> agent: %v", r)
	}
	if _, err := api.CheckNetworkPolicy(ctx, &clusterv1.CheckNetworkPolicyRequest{From: "a", To: "b", Port: 70000}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("port 70000: %v", err)
	}
	agenttest.Eventually(t, 10*time.Second, "the monitor's open connection closed", func() error {
		if !c.Logs().Contains(`msg="closing a connection the network policy no longer allows" node=` + n.Name) {
			return fmt.Errorf("no log line of the closed connection on %s", n.Name)
		}
		return nil
	})
	if !c.Logs().Contains(`from=[monitor.pivirt.internal] from_cn=pivirt-agent-monitor to=[agent.pivirt.internal]`) {
		t.Error("the closed connection's log line does not name both identities")
	}
	if err := ask(); err == nil {
		t.Error("the monitor is answered under a policy that does not allow it")
	}
	// The agents still form a cluster: a write through n, on every node.
	for _, node := range c.Nodes() {
		if st := node.SettingsStatus(); st.Error != "" || st.Revision < set.GetEntry().GetRevision() {
			agenttest.Eventually(t, 5*time.Second, node.Name+" applies the policy", func() error {
				if st := node.SettingsStatus(); st.Error != "" || st.Revision < set.GetEntry().GetRevision() {
					return fmt.Errorf("%+v", st)
				}
				return nil
			})
		}
	}
	if _, err := api.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: "kv/after-policy", Value: "1"}); err != nil {
		t.Errorf("a write under the agents' policy: %v", err)
	}

	// Removed: the monitor is let in again.
	if _, err := api.DeleteConfig(ctx, &clusterv1.DeleteConfigRequest{Key: agent.NetworkPolicyKey}); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, 10*time.Second, "the monitor let in again", ask)
	if r := check("monitor.pivirt.internal", "agent.pivirt.internal", 9000); !r.GetAllowed() || r.GetSource() != "none" {
		t.Errorf("monitor -> agent without a policy: %v", r)
	}
}
