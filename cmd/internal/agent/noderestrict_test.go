package agent_test

import (
	"crypto/tls"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/identity"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// dialInternal connects to an agent's internal port with the client
// certificate files (cert, key), as another agent would, without the
// agents' own interceptors: what the test sends is what arrives.
func dialInternal(t *testing.T, dir, addr string, files [2]string) *grpc.ClientConn {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(files[0], files[1])
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{RootCAs: mustPool(t, filepath.Join(dir, identity.ChainFile)), Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// chainHeader is a certificate file as the values of a relayed caller's
// certificate header.
func chainHeader(t *testing.T, file string) []string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return out
		}
		out = append(out, base64.StdEncoding.EncodeToString(blk.Bytes))
	}
}

// TestAgentCertificateActsOnlyAsItsNode makes, with one agent's
// certificate, the calls on the leader's internal port that an attacker
// holding it would: everything beyond what a node does for itself is
// refused and audited naming the agent; a relayed caller's credential is
// authenticated again and held to the RBAC policy; and a call through a
// follower's API port still works, audited on the leader with its caller
// and the agent that relayed it.
func TestAgentCertificateActsOnlyAsItsNode(t *testing.T) {
	e := newAccessEnv(t, 3, nil)
	leader := e.n
	follower := e.c.Follower()
	fi := e.c.Index(follower)
	agentName := fmt.Sprintf("pivirt-agent-node%d", fi+1)
	ownNode := fmt.Sprintf("node%d", fi+1)
	agentFiles := [2]string{filepath.Join(e.dir, agentName+".crt"), filepath.Join(e.dir, agentName+".key")}
	conn := dialInternal(t, e.dir, leader.InternalAddr(), agentFiles)
	cl := clusterv1.NewClusterServiceClient(conn)
	node := nodev1.NewNodeServiceClient(conn)
	sched := schedulev1.NewScheduleServiceClient(conn)
	agents := clusterv1.NewAgentServiceClient(conn)
	vms := vmv1.NewVMServiceClient(conn)
	snaps := clusterv1.NewSnapshotServiceClient(conn)
	ctx := e.ctx()

	denied := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "acts only as its node") {
			t.Errorf("%s with an agent's certificate alone: %v, want PermissionDenied (an agent's certificate acts only as its node)", what, err)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if c := status.Code(err); c == codes.PermissionDenied || c == codes.Unauthenticated {
			t.Errorf("%s: %v, want it allowed", what, err)
		}
	}

	// The cluster version turns the restriction on once every server
	// runs this release.
	agenttest.Eventually(t, 30*time.Second, "the internal port refuses a node's config write", func() error {
		_, err := cl.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: "kv/probe", Value: "x"})
		if status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("SetConfig: %v", err)
		}
		return nil
	})
	mark := e.c.Logs().Len()
	policy := "rules:\n  - roles: [\"*\"]\n    resources: [\"*\"]\n    verbs: [\"*\"]\n"
	_, err := cl.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: policy})
	denied("SetConfig auth.rbac_policy", err)
	_, err = cl.DeleteConfig(ctx, &clusterv1.DeleteConfigRequest{Key: "kv/x"})
	denied("DeleteConfig", err)
	_, err = sched.CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{Id: "s1", VmId: "vm-x", Cron: "0 * * * *", Action: schedulev1.Action_ACTION_POWER_ON}})
	denied("CreateSchedule", err)
	_, err = node.Keyring(ctx, &nodev1.KeyringRequest{Op: clusterv1.KeyringOp_KEYRING_OP_LIST})
	denied("NodeService.Keyring", err)
	if s, err := agents.Monitor(ctx, &clusterv1.MonitorRequest{}); err == nil {
		_, err = s.Recv()
		denied("AgentService.Monitor", err)
	} else {
		denied("AgentService.Monitor", err)
	}
	bob := metadata.AppendToOutgoingContext(ctx, "x-pivirt-identity", "bob", "x-pivirt-roles", "admin")
	_, err = vms.CreateVM(bob, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "mallory", Vcpus: 1, MemoryMib: 64, Metadata: &apiv1.ObjectMeta{Owner: "bob"}}})
	denied("CreateVM as bob", err)
	_, err = node.ReportPlacements(ctx, &nodev1.ReportPlacementsRequest{Placements: &fsmv1.SetPlacements{Node: "ghost"}})
	denied("ReportPlacements of another node", err)
	_, err = cl.RegisterService(ctx, &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{Service: "web", InstanceId: "w1", Node: "node-other", Address: "127.0.0.1", Port: 1}})
	denied("RegisterService on another node", err)
	if rs, err := snaps.RestoreSnapshot(ctx); err == nil {
		_ = rs.Send(&clusterv1.RestoreSnapshotRequest{Caller: &clusterv1.RestoreCaller{Identity: "root", Roles: []string{"admin"}}, Data: []byte("x")})
		_, err = rs.CloseAndRecv()
		denied("RestoreSnapshot naming its caller", err)
	}
	agenttest.Eventually(t, 10*time.Second, "the audit line of the refusals", func() error {
		logs := e.c.Logs().Since(mark)
		if !strings.Contains(logs, "audit: internal call denied") || !strings.Contains(logs, agentName) {
			return fmt.Errorf("no audit line naming %s", agentName)
		}
		return nil
	})

	// What a node does for itself.
	_, err = cl.RegisterService(ctx, &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{Service: "web", InstanceId: "w1", Node: ownNode, Address: "127.0.0.1", Port: 1}})
	allowed("RegisterService on its own node", err)
	_, err = cl.Heartbeat(ctx, &clusterv1.HeartbeatRequest{Service: "web", InstanceId: "w1"})
	allowed("Heartbeat of its own instance", err)
	_, err = cl.ListServices(ctx, &clusterv1.ListServicesRequest{})
	allowed("ListServices", err)
	_, err = cl.GetConfig(ctx, &clusterv1.GetConfigRequest{Key: "kv/none"})
	allowed("GetConfig", err)
	_, err = node.Status(ctx, &nodev1.StatusRequest{})
	allowed("NodeService.Status", err)

	// A forged caller does not authenticate; a relayed one is held to the
	// policy.
	forged := metadata.AppendToOutgoingContext(ctx, authz.CallerTokenHeader, "not-a-token")
	if _, err := cl.SetConfig(forged, &clusterv1.SetConfigRequest{Key: "kv/x", Value: "1"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a forged caller token: %v, want Unauthenticated", err)
	}
	viewer := metadata.AppendToOutgoingContext(ctx, authz.CallerTokenHeader, e.token("victor", "viewer"))
	if _, err := cl.SetConfig(viewer, &clusterv1.SetConfigRequest{Key: "kv/x", Value: "1"}); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "victor") {
		t.Errorf("a relayed viewer's write: %v, want PermissionDenied naming victor", err)
	}
	opsViewer := issueClient(t, e.dir, "ops-viewer")
	certViewer := metadata.MD{authz.CallerCertHeader: chainHeader(t, opsViewer[0])}
	if _, err := cl.SetConfig(metadata.NewOutgoingContext(ctx, certViewer), &clusterv1.SetConfigRequest{Key: "kv/x", Value: "1"}); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "ops-viewer") {
		t.Errorf("a relayed viewer certificate's write: %v, want PermissionDenied naming ops-viewer", err)
	}
	other := testPKI(t, 1)
	foreign := metadata.MD{authz.CallerCertHeader: chainHeader(t, filepath.Join(other, "pivirt-agent-node1.crt"))}
	if _, err := cl.GetConfig(metadata.NewOutgoingContext(ctx, foreign), &clusterv1.GetConfigRequest{Key: "kv/x"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a relayed certificate of another CA: %v, want Unauthenticated", err)
	}
	admin := metadata.AppendToOutgoingContext(ctx, authz.CallerTokenHeader, e.token("alice", "admin"))
	if _, err := cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: "kv/relayed", Value: "1"}); err != nil {
		t.Errorf("a relayed admin's write: %v", err)
	}

	// Through a follower's API port: the caller's token travels to the
	// leader, which audits the caller and the agent that relayed it.
	mark = e.c.Logs().Len()
	api := clusterv1.NewClusterServiceClient(e.dialAt(follower.APIAddr(), nil))
	if _, err := api.SetConfig(as(ctx, e.token("carol", "admin")), &clusterv1.SetConfigRequest{Key: "kv/through-follower", Value: "1"}); err != nil {
		t.Fatalf("a write through a follower: %v", err)
	}
	agenttest.Eventually(t, 10*time.Second, "the leader's audit line of the relayed write", func() error {
		for _, l := range strings.Split(e.c.Logs().Since(mark), "\n") {
			if strings.Contains(l, "audit: call allowed") && strings.Contains(l, "carol") && strings.Contains(l, "via="+agentName) {
				return nil
			}
		}
		return fmt.Errorf("no audit line naming carol and via=%s", agentName)
	})
	if _, err := api.SetConfig(as(ctx, e.token("victor", "viewer")), &clusterv1.SetConfigRequest{Key: "kv/x", Value: "1"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a viewer's write through a follower: %v, want PermissionDenied", err)
	}
}

// TestAnotherClusterOnTheSameCAIsRefused: an agent certificate of the same
// CA but of another cluster, or of none while this cluster's name its
// cluster, is refused in the handshakes of the internal and Raft ports.
func TestAnotherClusterOnTheSameCAIsRefused(t *testing.T) {
	dir := testPKI(t, 1)
	c := agenttest.NewExpect(t, 1, withTLS(dir))
	n := c.WaitLeader(60 * time.Second)
	issue := func(file, cluster string) [2]string {
		f, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node9", File: file, Cluster: cluster})
		if err != nil {
			t.Fatal(err)
		}
		return [2]string{f.Cert, f.Key}
	}
	chain := mustPool(t, filepath.Join(dir, identity.ChainFile))
	for name, files := range map[string][2]string{
		"another cluster's agent": issue("node9-other", "other-cluster"),
		"an agent of no cluster":  issue("node9-none", ""),
	} {
		cert, err := tls.LoadX509KeyPair(files[0], files[1])
		if err != nil {
			t.Fatal(err)
		}
		for port, addr := range map[string]string{"internal": n.InternalAddr(), "raft": n.RaftAddr()} {
			conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: chain, Certificates: []tls.Certificate{cert}, ServerName: "localhost", MinVersion: tls.VersionTLS13})
			if err == nil {
				// TLS 1.3: the server's verdict on the client certificate
				// arrives with the first read.
				_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
				_, err = conn.Read(make([]byte, 1))
				conn.Close()
			}
			if err == nil || strings.Contains(err.Error(), "timeout") {
				t.Errorf("%s on the %s port: %v, want the handshake refused", name, port, err)
			}
		}
	}
	agenttest.Eventually(t, 10*time.Second, "the refusals logged", func() error {
		if !c.Logs().Contains(`is an agent certificate of cluster \"other-cluster\"`) || !c.Logs().Contains("names no cluster") {
			return fmt.Errorf("no log line of the refusals")
		}
		return nil
	})
}
