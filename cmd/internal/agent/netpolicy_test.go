package agent_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// TestNetworkPolicy: with auth.network_policy, agents whose certificates
// name the service agent.pivirt.internal form a cluster over the internal
// and Raft ports, while an agent identity of another service, or one with
// no service name, is refused on the internal port; the agent reaches the
// backend a policy allows (the spec's allow-agent-to-pivirtd, on the
// backend's port) and is refused by one on a port no policy lists. Every
// refusal is logged.
func TestNetworkPolicy(t *testing.T) {
	dir := testPKI(t, 3)
	chain := filepath.Join(dir, identity.ChainFile)
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
	for i := 1; i <= 3; i++ {
		issue(identity.LeafRequest{Kind: identity.KindClient, Name: fmt.Sprintf("pivirt-agent-node%d", i), DNS: agentSvc})
		issue(identity.LeafRequest{Kind: identity.KindServer, Name: fmt.Sprintf("node%d-server", i), DNS: agentSvc, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	}
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

func withName(b config.BackendTLSConfig, name string) config.BackendTLSConfig {
	b.ServerName = name
	return b
}
