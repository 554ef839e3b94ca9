package agent_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/mesh"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

// Timeouts of the connections' path, shortened so that the test idles past
// every one of them: the protocol mux's wait for a first request and the
// servers' idle timeout (the clients' keepalives are longer: gRPC's is 30 s,
// and they ping only with calls in flight).
const (
	idleFirstRequest = 300 * time.Millisecond
	idleConn         = 2 * time.Second
)

// TestConnectionsIdlePastEveryTimeout: clients of every protocol that
// connect and wait longer than every timeout on their path — before their
// first call, and between calls — are served in their own protocol, over
// the API port and, for a call the agent relays to the node holding the
// object, over the internal port; after a peer restarts, the other agents'
// calls to it work again within seconds, and lists name no node as
// unavailable.
func TestConnectionsIdlePastEveryTimeout(t *testing.T) {
	pc := startPlacedClusterWith(t, 3, func(mutate func(int, *config.Config)) *agenttest.Cluster {
		return agenttest.NewExpectOptions(t, 3, mutate, func(o *agent.Options) {
			o.FirstRequestTimeout, o.ConnIdleTimeout = idleFirstRequest, idleConn
		})
	})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	created, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "idle-vm", Vcpus: 1, MemoryMib: 256}, Host: "node3"})
	if err != nil {
		t.Fatal(err)
	}
	id := created.GetVm().GetId()

	// A gRPC channel to node1 that connects and makes its first call only
	// after the idle time, and clients of net/http (Connect, gRPC-Web,
	// Connect's gRPC) that call once, then wait.
	cc, err := grpc.NewClient(pc.c.Node(0).APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	cc.Connect()
	for s := cc.GetState(); s != connectivity.Ready; s = cc.GetState() {
		if !cc.WaitForStateChange(ctx, s) {
			t.Fatalf("gRPC channel to node1: %v", s)
		}
	}
	base := "http://" + pc.c.Node(0).APIAddr()
	hc := agenttest.NewHTTPClient()
	var h1 http.Protocols
	h1.SetHTTP1(true)
	h1c := &http.Client{Transport: &http.Transport{Protocols: &h1}}
	clients := map[string]vmv1connect.VMServiceClient{
		"connect over h2c":       vmv1connect.NewVMServiceClient(hc, base),
		"grpc over h2c":          vmv1connect.NewVMServiceClient(agenttest.NewHTTPClient(), base, connect.WithGRPC()),
		"grpc-web over http/1.1": vmv1connect.NewVMServiceClient(h1c, base, connect.WithGRPCWeb()),
	}
	get := func(name string, c vmv1connect.VMServiceClient) error {
		resp, err := c.GetVM(ctx, connect.NewRequest(&vmv1.GetVMRequest{Id: id}))
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if resp.Msg.GetVm().GetHost() != "node3" {
			return fmt.Errorf("%s: VM on %q, want node3", name, resp.Msg.GetVm().GetHost())
		}
		return nil
	}
	for name, c := range clients {
		if err := get(name, c); err != nil {
			t.Fatal(err)
		}
	}
	// Waiting is the subject of the test: first past the mux's wait for a
	// first request only (the gRPC channel's connection is open and has
	// made no call yet), then past the servers' idle timeout too, on the
	// clients' connections to node1 and on node1's pooled connection to
	// node3.
	for _, idle := range []time.Duration{3 * idleFirstRequest, idleConn + idleConn/2} {
		time.Sleep(idle)
		if _, err := vmv1.NewVMServiceClient(cc).GetVM(ctx, &vmv1.GetVMRequest{Id: id}); err != nil {
			t.Fatalf("a gRPC call after %s idle: %v", idle, err)
		}
		for name, c := range clients {
			if err := get(name, c); err != nil {
				t.Fatalf("after %s idle: %v", idle, err)
			}
		}
	}

	// node3 restarts while node1 and node2 keep their pooled connections to
	// it; a call while it is down leaves them redialling, so they connect
	// again as it comes back, and their first call comes only later.
	pc.c.Kill(2)
	for via := range 2 {
		if _, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id}); err == nil {
			t.Fatalf("the VM on node3 through node%d while node3 is down: no error", via+1)
		}
	}
	pc.c.Restart(2, false, pc.c.Node(0).GossipAddr())
	pc.c.WaitLeader(30 * time.Second)
	time.Sleep(3 * idleFirstRequest) // the redialled connections wait
	start := time.Now()
	for via := range 2 {
		agenttest.Eventually(t, 15*time.Second, fmt.Sprintf("the VM on node3 through node%d after node3 restarted", via+1), func() error {
			var hdr metadata.MD
			_, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id})
			if err != nil {
				return err
			}
			if _, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{}, grpc.Header(&hdr)); err != nil {
				return err
			}
			if u := hdr.Get(mesh.UnavailableNodesHeader); len(u) > 0 {
				return fmt.Errorf("the list names unavailable nodes: %s", strings.Join(u, "; "))
			}
			return nil
		})
	}
	t.Logf("calls through the other agents reached node3 %s after its restart", time.Since(start).Round(10*time.Millisecond))
}
