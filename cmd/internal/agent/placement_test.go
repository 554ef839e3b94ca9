package agent_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	"pilab.hu/pivirt-agent/gateway/mesh"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/network/v1/networkv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/storage/v1/storagev1connect"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// placedCluster is n agents, each with its own pivirtd-sim (pivirtd and
// iscsiman) on a unix socket, as the spec deploys them: node-scoped
// backends by default, the default routes (no routing block).
type placedCluster struct {
	c *agenttest.Cluster
	// direct are gRPC connections to each node's simulator, bypassing the
	// agents.
	direct []*grpc.ClientConn
	// api are gRPC connections to each node's API port.
	api []*grpc.ClientConn
}

func startPlacedCluster(t *testing.T, n int) *placedCluster {
	t.Helper()
	return startPlacedClusterWith(t, n, func(mutate func(int, *config.Config)) *agenttest.Cluster {
		return agenttest.NewExpect(t, n, mutate)
	})
}

// startPlacedClusterWith is startPlacedCluster with the cluster newCluster
// starts (Raft or etcd mode).
func startPlacedClusterWith(t *testing.T, n int, newCluster func(mutate func(int, *config.Config)) *agenttest.Cluster) *placedCluster {
	t.Helper()
	pc := &placedCluster{}
	socks := make([]string, n)
	for i := range n {
		socks[i] = startNodeSim(t, fmt.Sprintf("node%d", i+1))
		conn, err := grpc.NewClient(socks[i], grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		pc.direct = append(pc.direct, conn)
	}
	pc.c = newCluster(func(i int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{
			"pivirtd":  {Endpoint: socks[i], Timeout: config.Duration(10 * time.Second)},
			"iscsiman": {Endpoint: socks[i], Timeout: config.Duration(10 * time.Second)},
		}
	})
	pc.c.WaitLeader(30 * time.Second)
	if pc.c.Node(0).Cfg.ServiceDiscovery.Type != config.DiscoveryEtcd {
		pc.c.WaitPeers(30*time.Second, n, 0)
	}
	for _, node := range pc.c.Nodes() {
		conn, err := grpc.NewClient(node.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		pc.api = append(pc.api, conn)
	}
	return pc
}

func (pc *placedCluster) vm(i int) vmv1.VMServiceClient { return vmv1.NewVMServiceClient(pc.api[i]) }

// TestPlacementRoutesByObject: VMs, volumes and networks on every node,
// reached through every node, over gRPC and Connect (binary and JSON).
func TestPlacementRoutesByObject(t *testing.T) {
	pc := startPlacedCluster(t, 3)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	// One VM, volume and network on each node, each created through the
	// next node with host naming its node.
	var vms, vols, nets []string
	for i := range 3 {
		host := fmt.Sprintf("node%d", i+1)
		via := (i + 1) % 3
		r, err := pc.vm(via).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-" + host, Vcpus: 1, MemoryMib: 512}, Host: host})
		if err != nil {
			t.Fatalf("create a VM on %s through node%d: %v", host, via+1, err)
		}
		if r.GetVm().GetHost() != host {
			t.Fatalf("VM created on %s, want %s", r.GetVm().GetHost(), host)
		}
		vms = append(vms, r.GetVm().GetId())
		v, err := storagev1.NewStorageServiceClient(pc.api[via]).CreateVolume(ctx, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "vol-" + host, SizeBytes: 1 << 30}, Host: host})
		if err != nil || v.GetVolume().GetHost() != host {
			t.Fatalf("create a volume on %s through node%d: %v, %v", host, via+1, v, err)
		}
		vols = append(vols, v.GetVolume().GetId())
		nw, err := networkv1.NewNetworkServiceClient(pc.api[via]).CreateNetwork(ctx, &networkv1.CreateNetworkRequest{Network: &networkv1.Network{Name: "net-" + host, Cidr: fmt.Sprintf("10.%d.0.0/24", i)}, Host: host})
		if err != nil || nw.GetNetwork().GetHost() != host {
			t.Fatalf("create a network on %s through node%d: %v, %v", host, via+1, nw, err)
		}
		nets = append(nets, nw.GetNetwork().GetId())
	}
	// An unknown host is refused, naming the nodes.
	if _, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-x", Vcpus: 1, MemoryMib: 512}, Host: "node9"}); toStatus(err).Code() != codes.InvalidArgument || !strings.Contains(err.Error(), "node1, node2, node3") {
		t.Errorf("create on node9: %v, want InvalidArgument naming the nodes", err)
	}

	// Every object through every node, over gRPC, Connect and Connect JSON.
	for via := range 3 {
		base := "http://" + pc.c.Node(via).APIAddr()
		hc := agenttest.NewHTTPClient()
		clients := map[string]vmv1connect.VMServiceClient{
			"connect":      vmv1connect.NewVMServiceClient(hc, base),
			"connect-json": vmv1connect.NewVMServiceClient(hc, base, connect.WithProtoJSON()),
		}
		for i, id := range vms {
			want := fmt.Sprintf("node%d", i+1)
			var hdr metadata.MD
			r, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id}, grpc.Header(&hdr))
			if err != nil || r.GetVm().GetHost() != want {
				t.Fatalf("GetVM %s (on %s) through node%d: %v, %v", id, want, via+1, r, err)
			}
			if via != i && !slices.Contains(hdr.Get(mesh.NodeHeader), want) {
				t.Errorf("GetVM %s through node%d: header %s = %v, want %s", id, via+1, mesh.NodeHeader, hdr.Get(mesh.NodeHeader), want)
			}
			if _, err := pc.vm(via).PowerOn(ctx, &vmv1.PowerOnRequest{Id: id}); err != nil {
				t.Fatalf("PowerOn %s through node%d: %v", id, via+1, err)
			}
			// A bidi stream across the hop.
			out, err := grpcVM{pc.vm(via)}.console(ctx, id, []string{"uptime"})
			if err != nil || len(out) < 2 {
				t.Fatalf("console of %s through node%d: %v %v", id, via+1, out, err)
			}
			if _, err := pc.vm(via).Reboot(ctx, &vmv1.RebootRequest{Id: id}); err != nil {
				t.Fatalf("Reboot %s through node%d: %v", id, via+1, err)
			}
			if _, err := pc.vm(via).PowerOff(ctx, &vmv1.PowerOffRequest{Id: id}); err != nil {
				t.Fatalf("PowerOff %s through node%d: %v", id, via+1, err)
			}
			if r, err := pc.vm(via).UpdateVM(ctx, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: id, Vcpus: uint32(via + 2)}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}}); err != nil || r.GetVm().GetVcpus() != uint32(via+2) {
				t.Fatalf("UpdateVM %s through node%d: %v, %v", id, via+1, r, err)
			}
			if _, err := clients["connect-json"].PowerOn(ctx, connect.NewRequest(&vmv1.PowerOnRequest{Id: id})); err != nil {
				t.Fatalf("connect-json PowerOn %s through node%d: %v", id, via+1, err)
			}
			if _, err := clients["connect"].ShutdownDefault(ctx, connect.NewRequest(&vmv1.ShutdownDefaultRequest{Id: id})); err != nil {
				t.Fatalf("connect ShutdownDefault %s through node%d: %v", id, via+1, err)
			}
			for name, cl := range clients {
				r, err := cl.GetVM(ctx, connect.NewRequest(&vmv1.GetVMRequest{Id: id}))
				if err != nil || r.Msg.GetVm().GetHost() != want {
					t.Fatalf("%s GetVM %s through node%d: %v", name, id, via+1, err)
				}
			}
		}
		for i, id := range vols {
			r, err := storagev1.NewStorageServiceClient(pc.api[via]).GetVolume(ctx, &storagev1.GetVolumeRequest{Id: id})
			if err != nil || r.GetVolume().GetHost() != fmt.Sprintf("node%d", i+1) {
				t.Fatalf("GetVolume %s through node%d: %v, %v", id, via+1, r, err)
			}
			// A client stream across the hop.
			up, err := storagev1.NewStorageServiceClient(pc.api[via]).UploadVolume(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for k := range 3 {
				req := &storagev1.UploadVolumeRequest{Chunk: []byte("chunk")}
				if k == 0 {
					req.Id = id
				}
				if err := up.Send(req); err != nil {
					t.Fatalf("upload to %s through node%d: %v", id, via+1, err)
				}
			}
			if r, err := up.CloseAndRecv(); err != nil || r.GetVolume().GetWrittenBytes() == 0 {
				t.Fatalf("upload to %s through node%d: %v, %v", id, via+1, r, err)
			}
		}
		for i, id := range vols {
			r, err := storagev1connect.NewStorageServiceClient(hc, base, connect.WithProtoJSON()).GetVolume(ctx, connect.NewRequest(&storagev1.GetVolumeRequest{Id: id}))
			if err != nil || r.Msg.GetVolume().GetHost() != fmt.Sprintf("node%d", i+1) {
				t.Fatalf("connect-json GetVolume %s through node%d: %v", id, via+1, err)
			}
		}
		for i, id := range nets {
			r, err := networkv1connect.NewNetworkServiceClient(hc, base).GetNetwork(ctx, connect.NewRequest(&networkv1.GetNetworkRequest{Id: id}))
			if err != nil || r.Msg.GetNetwork().GetHost() != fmt.Sprintf("node%d", i+1) {
				t.Fatalf("connect GetNetwork %s through node%d: %v", id, via+1, err)
			}
		}
		if r, err := storagev1connect.NewStorageServiceClient(hc, base, connect.WithProtoJSON()).ListVolumes(ctx, connect.NewRequest(&storagev1.ListVolumesRequest{})); err != nil || len(r.Msg.GetVolumes()) != 3 {
			t.Fatalf("connect-json ListVolumes through node%d: %v", via+1, err)
		}
		for i, id := range vols {
			r, err := storagev1.NewStorageServiceClient(pc.api[via]).UpdateVolume(ctx, &storagev1.UpdateVolumeRequest{Volume: &storagev1.Volume{Id: id, SizeBytes: uint64(2+via) << 30}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"size_bytes"}}})
			if err != nil || r.GetVolume().GetHost() != fmt.Sprintf("node%d", i+1) {
				t.Fatalf("UpdateVolume %s through node%d: %v, %v", id, via+1, r, err)
			}
		}
		for i, id := range nets {
			r, err := networkv1.NewNetworkServiceClient(pc.api[via]).GetNetwork(ctx, &networkv1.GetNetworkRequest{Id: id})
			if err != nil || r.GetNetwork().GetHost() != fmt.Sprintf("node%d", i+1) {
				t.Fatalf("GetNetwork %s through node%d: %v, %v", id, via+1, r, err)
			}
			u, err := networkv1.NewNetworkServiceClient(pc.api[via]).UpdateNetwork(ctx, &networkv1.UpdateNetworkRequest{Network: &networkv1.Network{Id: id, Mtu: uint32(1400 + via)}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"mtu"}}})
			if err != nil || u.GetNetwork().GetMtu() != uint32(1400+via) {
				t.Fatalf("UpdateNetwork %s through node%d: %v, %v", id, via+1, u, err)
			}
		}

		// Lists hold every node's objects, ordered by ID; pages continue
		// through any node.
		all, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{})
		if err != nil || len(all.GetVms()) != 3 {
			t.Fatalf("ListVMs through node%d: %v, %v", via+1, all, err)
		}
		got := []string{}
		for _, v := range all.GetVms() {
			got = append(got, v.GetId())
		}
		if !slices.IsSorted(got) || !slices.Equal(slices.Sorted(slices.Values(vms)), got) {
			t.Errorf("ListVMs through node%d: %v, want %v ordered", via+1, got, vms)
		}
		var paged []string
		tok := ""
		for k := range 4 {
			r, err := pc.vm((via+k)%3).ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 1, PageToken: tok})
			if err != nil {
				t.Fatalf("page %d: %v", k, err)
			}
			for _, v := range r.GetVms() {
				paged = append(paged, v.GetId())
			}
			if tok = r.GetNextPageToken(); tok == "" {
				break
			}
		}
		if !slices.Equal(paged, got) {
			t.Errorf("paged through every node: %v, want %v", paged, got)
		}
		one, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{Host: "node2"})
		if err != nil || len(one.GetVms()) != 1 || one.GetVms()[0].GetHost() != "node2" {
			t.Errorf("ListVMs host node2 through node%d: %v, %v", via+1, one, err)
		}
		vl, err := storagev1.NewStorageServiceClient(pc.api[via]).ListVolumes(ctx, &storagev1.ListVolumesRequest{})
		if err != nil || len(vl.GetVolumes()) != 3 {
			t.Errorf("ListVolumes through node%d: %v, %v", via+1, vl, err)
		}
		nl, err := networkv1.NewNetworkServiceClient(pc.api[via]).ListNetworks(ctx, &networkv1.ListNetworksRequest{})
		if err != nil || len(nl.GetNetworks()) != 3 {
			t.Errorf("ListNetworks through node%d: %v, %v", via+1, nl, err)
		}
	}

	// The catalog learns every object on every node.
	agenttest.Eventually(t, 30*time.Second, "the placement catalog holds every object", func() error {
		for _, n := range pc.c.Nodes() {
			for i, id := range vms {
				p, err := n.FSM().State().Placement("virtualmachines", id)
				if err != nil || p.GetNode() != fmt.Sprintf("node%d", i+1) {
					return fmt.Errorf("%s: placement of %s = %v, %v", n.Name, id, p, err)
				}
			}
			for i, id := range vols {
				p, err := n.FSM().State().Placement("volumes", id)
				if err != nil || p.GetNode() != fmt.Sprintf("node%d", i+1) {
					return fmt.Errorf("%s: placement of %s = %v, %v", n.Name, id, p, err)
				}
			}
		}
		return nil
	})

	// A VM made behind the agents' backs, on node3's simulator, is found
	// through node1.
	hidden, err := vmv1.NewVMServiceClient(pc.direct[2]).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-hidden", Vcpus: 1, MemoryMib: 256}})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := pc.vm(0).GetVM(ctx, &vmv1.GetVMRequest{Id: hidden.GetVm().GetId()}); err != nil || r.GetVm().GetHost() != "node3" {
		t.Errorf("GetVM of a VM made on node3's backend directly, through node1: %v, %v", r, err)
	}
	if _, err := pc.vm(0).GetVM(ctx, &vmv1.GetVMRequest{Id: "vm-nowhere"}); toStatus(err).Code() != codes.NotFound {
		t.Errorf("GetVM of an unknown VM: %v, want NotFound", err)
	}

	// A watch through node1 sees changes on every node.
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	w, err := pc.vm(0).WatchVMs(wctx, &vmv1.WatchVMsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	existing := 0
	for existing < 4 {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("watch: %v", err)
		}
		if ev.GetType() == vmv1.EventType_EVENT_TYPE_EXISTING {
			existing++
		}
	}
	if _, err := pc.vm(1).DeleteVM(ctx, &vmv1.DeleteVMRequest{Id: vms[2]}); err != nil {
		t.Fatalf("delete a node3 VM through node2: %v", err)
	}
	if _, err := storagev1.NewStorageServiceClient(pc.api[0]).DeleteVolume(ctx, &storagev1.DeleteVolumeRequest{Id: vols[1]}); err != nil {
		t.Fatalf("delete a node2 volume through node1: %v", err)
	}
	if _, err := networkv1.NewNetworkServiceClient(pc.api[2]).DeleteNetwork(ctx, &networkv1.DeleteNetworkRequest{Id: nets[0]}); err != nil {
		t.Fatalf("delete a node1 network through node3: %v", err)
	}
	for {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("watch: %v", err)
		}
		if ev.GetType() == vmv1.EventType_EVENT_TYPE_DELETED && ev.GetVm().GetId() == vms[2] {
			break
		}
	}
	wcancel()

	// node3 stops: its objects answer Unavailable naming it; the others
	// keep working; lists name the missing node.
	pc.c.Kill(2)
	for via := range 2 {
		if _, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: hidden.GetVm().GetId()}); toStatus(err).Code() != codes.Unavailable || !strings.Contains(err.Error(), "node3") {
			t.Errorf("GetVM of a node3 VM through node%d with node3 down: %v, want Unavailable naming node3", via+1, err)
		}
		for i := range 2 {
			if _, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: vms[i]}); err != nil {
				t.Errorf("GetVM of a node%d VM through node%d with node3 down: %v", i+1, via+1, err)
			}
		}
		var hdr metadata.MD
		r, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{}, grpc.Header(&hdr))
		if err != nil || len(r.GetVms()) != 2 {
			t.Errorf("ListVMs through node%d with node3 down: %v, %v", via+1, r, err)
		}
		if u := hdr.Get(mesh.UnavailableNodesHeader); len(u) != 1 || !strings.HasPrefix(u[0], "node3") {
			t.Errorf("ListVMs through node%d with node3 down: %s = %v, want node3", via+1, mesh.UnavailableNodesHeader, u)
		}
	}

	// While node3's agent is down its backend changes (the drift a
	// partition leaves): a VM deleted, one made. Back, node3 repairs the
	// catalog at start.
	sim3 := vmv1.NewVMServiceClient(pc.direct[2])
	if _, err := sim3.DeleteVM(ctx, &vmv1.DeleteVMRequest{Id: hidden.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	late, err := sim3.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-late", Vcpus: 1, MemoryMib: 256}})
	if err != nil {
		t.Fatal(err)
	}
	pc.c.Restart(2, false, pc.c.Node(0).GossipAddr())
	agenttest.Eventually(t, 30*time.Second, "node3's drift repaired in the catalog", func() error {
		st := pc.c.Node(0).FSM().State()
		if p, err := st.Placement("virtualmachines", hidden.GetVm().GetId()); err != nil || p != nil {
			return fmt.Errorf("the VM deleted on node3 is still placed: %v, %v", p, err)
		}
		if p, err := st.Placement("virtualmachines", late.GetVm().GetId()); err != nil || p.GetNode() != "node3" {
			return fmt.Errorf("the VM made on node3 is placed %v, %v", p, err)
		}
		return nil
	})

	// A volume watch through node2 sees a volume made on node1.
	vctx, vcancel := context.WithCancel(ctx)
	defer vcancel()
	vw, err := storagev1.NewStorageServiceClient(pc.api[1]).WatchVolumes(vctx, &storagev1.WatchVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	nv, err := storagev1.NewStorageServiceClient(pc.api[2]).CreateVolume(ctx, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "vol-watched", SizeBytes: 1 << 20}, Host: "node1"})
	if err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := vw.Recv()
		if err != nil {
			t.Fatalf("volume watch through node2: %v", err)
		}
		// CREATED, or EXISTING when node1's watch started after the create.
		if ev.GetType() != storagev1.EventType_EVENT_TYPE_DELETED && ev.GetVolume().GetId() == nv.GetVolume().GetId() {
			if ev.GetVolume().GetHost() != "node1" {
				t.Errorf("watched volume on %q, want node1", ev.GetVolume().GetHost())
			}
			break
		}
	}
}

// TestProxiedConnectJSONWithoutProtocolHeader: a plain JSON POST (no
// Connect-Protocol-Version header) works on the proxied APIs as on the
// cluster APIs.
func TestProxiedConnectJSONWithoutProtocolHeader(t *testing.T) {
	pc := startPlacedCluster(t, 1)
	url := "http://" + pc.c.Node(0).APIAddr() + "/pivirt.vm.v1.VMService/ListVMs"
	resp, err := http.Post(url, "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s without Connect-Protocol-Version: %s", url, resp.Status)
	}
	// Another protocol: 415 naming what is supported, not a bare 404.
	bad, err := http.Post(url, "text/plain", strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(bad.Body)
	bad.Body.Close()
	if bad.StatusCode != http.StatusUnsupportedMediaType || !strings.Contains(string(body), "application/json") {
		t.Errorf("POST text/plain: %s %s, want 415 naming the supported content types", bad.Status, body)
	}
}

// TestSchedulesActOnTheVMsNode: a schedule for a VM on each of three
// nodes, across three leader changes: every slot once, run by the VM's
// node, never "not found". A schedule for a VM no node holds is refused.
func TestSchedulesActOnTheVMsNode(t *testing.T) {
	pc := startPlacedCluster(t, 3)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	sc := func(n *agenttest.Node) schedulev1.ScheduleServiceClient {
		return schedulev1.NewScheduleServiceClient(dialPlain(t, n.APIAddr()))
	}
	leader := pc.c.WaitLeader(30 * time.Second)
	if _, err := sc(leader).CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		VmId: "vm-nowhere", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@daily", Enabled: true,
	}}); toStatus(err).Code() != codes.InvalidArgument || !strings.Contains(err.Error(), "schedule.vm_id") {
		t.Errorf("a schedule for a VM no node holds: %v, want InvalidArgument naming schedule.vm_id", err)
	}
	var ids []string
	for i := range 3 {
		host := fmt.Sprintf("node%d", i+1)
		r, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "sched-" + host, Vcpus: 1, MemoryMib: 256}, Host: host})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pc.vm(0).PowerOn(ctx, &vmv1.PowerOnRequest{Id: r.GetVm().GetId()}); err != nil {
			t.Fatal(err)
		}
		id := "every-second-" + host
		if _, err := sc(pc.c.Node((i+1)%3)).CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
			Id: id, VmId: r.GetVm().GetId(), Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
			CatchUp: schedulev1.CatchUp_CATCH_UP_ALL, HistoryLimit: 1000,
		}}); err != nil {
			t.Fatalf("create the schedule of %s's VM: %v", host, err)
		}
		ids = append(ids, id)
	}
	okRuns := func(c schedulev1.ScheduleServiceClient, id string) int {
		r, err := c.ListRuns(ctx, &schedulev1.ListRunsRequest{ScheduleId: id})
		if err != nil {
			return 0
		}
		return runOutcomes(r.GetRuns())[schedulev1.RunOutcome_RUN_OUTCOME_OK]
	}
	want := 0
	for round := range 3 {
		want += 2
		agenttest.Eventually(t, 60*time.Second, fmt.Sprintf("%d ok runs of every schedule", want), func() error {
			for _, id := range ids {
				if n := okRuns(sc(leader), id); n < want {
					return fmt.Errorf("%s: %d ok runs", id, n)
				}
			}
			return nil
		})
		i := pc.c.Index(leader)
		pc.c.Kill(i)
		leader = pc.c.WaitLeader(30 * time.Second)
		pc.c.Restart(i, false, leader.GossipAddr())
		t.Logf("round %d: leader %s stopped and restarted; new leader %s", round, pc.c.Node(i).Name, leader.Name)
	}
	want += 2
	agenttest.Eventually(t, 60*time.Second, "ok runs after the last leader change", func() error {
		for _, id := range ids {
			if n := okRuns(sc(leader), id); n < want {
				return fmt.Errorf("%s: %d ok runs", id, n)
			}
		}
		return nil
	})
	for _, id := range ids {
		if _, err := sc(leader).PauseSchedule(ctx, &schedulev1.PauseScheduleRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	for i, id := range ids {
		host := fmt.Sprintf("node%d", i+1)
		runs := settledRuns(t, ctx, sc(leader), id)
		slots := map[time.Time]bool{}
		unknown := 0
		for _, r := range runs {
			if slots[r.GetSlot().AsTime()] {
				t.Errorf("%s: slot %s recorded twice", id, r.GetSlot().AsTime())
			}
			slots[r.GetSlot().AsTime()] = true
			switch {
			case strings.Contains(r.GetError(), "not found"):
				t.Errorf("%s: run at %s: %s", id, r.GetSlot().AsTime(), r.GetError())
			case strings.Contains(r.GetError(), "outcome unknown"):
				unknown++
			case r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_ERROR:
				// Only while the VM's node was down.
				if !strings.Contains(r.GetError(), "is on "+host+", which is unreachable") {
					t.Errorf("%s: run at %s failed: %s", id, r.GetSlot().AsTime(), r.GetError())
				}
			case r.GetOutcome() == schedulev1.RunOutcome_RUN_OUTCOME_OK && r.GetHost() != host:
				t.Errorf("%s: run at %s recorded host %q, want %s", id, r.GetSlot().AsTime(), r.GetHost(), host)
			}
		}
		st, err := simv1.NewSimulatorServiceClient(pc.direct[i]).Stats(ctx, &simv1.StatsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		calls, ok := int(st.GetCalls()[rebootMethod]), runOutcomes(runs)[schedulev1.RunOutcome_RUN_OUTCOME_OK]
		if calls < ok || calls > ok+unknown {
			t.Errorf("%s: %d reboots on %s's backend for %d ok runs and %d of unknown outcome", id, calls, host, ok, unknown)
		}
		t.Logf("%s: %d slots: %v (%d of unknown outcome); %d reboots on %s", id, len(runs), runOutcomes(runs), unknown, calls, host)
	}
}

// TestPlacementKeepsAccessControl: with TLS, OIDC and the spec's RBAC
// policy, a vm-owner's conditions hold for VMs on other nodes (read where
// the VM lives), lists through any node are filtered, and the hop between
// agents runs over mutual TLS to members that proved their names.
func TestPlacementKeepsAccessControl(t *testing.T) {
	socks := make([]string, 3)
	for i := range 3 {
		socks[i] = startNodeSim(t, fmt.Sprintf("node%d", i+1))
	}
	e := newAccessEnvWith(t, 3, func(i int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{
			"pivirtd": {Endpoint: socks[i], Timeout: config.Duration(10 * time.Second)},
		}
	}, nil)
	e.c.WaitPeers(30*time.Second, 3, 0)
	admin := as(e.ctx(), e.token("root", "admin"))
	mine := map[string]bool{}
	var theirs []string
	for i := range 3 {
		for _, owner := range []string{"alice", "bob"} {
			r, err := e.vm.CreateVM(admin, &vmv1.CreateVMRequest{Vm: &vmv1.VM{
				Name: fmt.Sprintf("%s-node%d", owner, i+1), Vcpus: 1, MemoryMib: 256, Metadata: &apiv1.ObjectMeta{Owner: owner},
			}, Host: fmt.Sprintf("node%d", i+1)})
			if err != nil {
				t.Fatalf("create %s's VM on node%d: %v", owner, i+1, err)
			}
			if owner == "alice" {
				mine[r.GetVm().GetId()] = true
			} else {
				theirs = append(theirs, r.GetVm().GetId())
			}
		}
	}
	alice := e.token("alice", "vm-owner")
	for _, n := range e.c.Nodes() {
		vm := vmv1.NewVMServiceClient(e.dialAt(n.APIAddr(), nil))
		for id := range mine {
			if r, err := vm.GetVM(as(e.ctx(), alice), &vmv1.GetVMRequest{Id: id}); err != nil || r.GetVm().GetMetadata().GetOwner() != "alice" {
				t.Errorf("alice reads her VM %s through %s: %v, %v", id, n.Name, r, err)
			}
			if _, err := vm.PowerOn(as(e.ctx(), alice), &vmv1.PowerOnRequest{Id: id}); err != nil && toStatus(err).Code() != codes.FailedPrecondition {
				t.Errorf("alice starts her VM %s through %s: %v", id, n.Name, err) // FailedPrecondition: running already
			}
		}
		for _, id := range theirs {
			if _, err := vm.PowerOn(as(e.ctx(), alice), &vmv1.PowerOnRequest{Id: id}); toStatus(err).Code() != codes.PermissionDenied {
				t.Errorf("alice starts bob's VM %s through %s: %v, want PermissionDenied", id, n.Name, err)
			}
		}
		r, err := vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{})
		if err != nil {
			t.Fatalf("alice lists through %s: %v", n.Name, err)
		}
		got := map[string]bool{}
		for _, v := range r.GetVms() {
			got[v.GetId()] = true
		}
		if len(got) != len(mine) {
			t.Errorf("alice lists through %s: %v, want her %d VMs on every node", n.Name, got, len(mine))
		}
		for id := range mine {
			if !got[id] {
				t.Errorf("alice lists through %s: %s missing", n.Name, id)
			}
		}
		// A page at a time, filtered by bob's name or not: her objects
		// alone, one per page, and no token past the last of them, so
		// that walking the tokens counts nothing of bob's.
		for _, owner := range []string{"", "bob"} {
			pages, items, token := 0, 0, ""
			for range 20 {
				r, err := vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{PageSize: 1, PageToken: token, Owner: owner})
				if err != nil {
					t.Fatalf("alice pages through %s (owner %q): %v", n.Name, owner, err)
				}
				pages++
				items += len(r.GetVms())
				if token = r.GetNextPageToken(); token == "" {
					break
				}
			}
			want := len(mine)
			if owner == "bob" {
				want = 0
			}
			if items != want || pages != max(want, 1) {
				t.Errorf("alice pages through %s (owner %q): %d items on %d pages, want %d on %d", n.Name, owner, items, pages, want, max(want, 1))
			}
		}
	}

	// node1's agent certificate reports bob's VM on node2 as its own: the
	// report is taken (it is node1's), the VM stays on node2, which is
	// alive and lists it.
	bobs := theirs[1] // created on node2
	leader := e.c.WaitLeader(30 * time.Second)
	agenttest.Eventually(t, 30*time.Second, "the catalog places bob's VM on node2", func() error {
		if p, err := leader.FSM().State().Placement("virtualmachines", bobs); err != nil || p.GetNode() != "node2" {
			return fmt.Errorf("placement of %s: %v, %v", bobs, p, err)
		}
		return nil
	})
	conn := dialInternal(t, e.dir, leader.InternalAddr(), [2]string{filepath.Join(e.dir, "pivirt-agent-node1.crt"), filepath.Join(e.dir, "pivirt-agent-node1.key")})
	if _, err := nodev1.NewNodeServiceClient(conn).ReportPlacements(e.ctx(), &nodev1.ReportPlacementsRequest{Placements: &fsmv1.SetPlacements{
		Node: "node1", Upsert: []*fsmv1.Placement{{Kind: "virtualmachines", Id: bobs}},
	}}); err != nil {
		t.Fatalf("node1 reports its placements: %v", err)
	}
	if p, err := leader.FSM().State().Placement("virtualmachines", bobs); err != nil || p.GetNode() != "node2" {
		t.Errorf("after node1 claimed bob's VM %s on node2: placed %v, %v; want it left on node2", bobs, p, err)
	}
}

// startNodeSim serves a pivirtd-sim for node name on a unix socket; it
// returns the endpoint.
func startNodeSim(t *testing.T, name string) string {
	t.Helper()
	s, err := sim.Open(sim.Config{DataDir: t.TempDir(), Host: name})
	if err != nil {
		t.Fatal(err)
	}
	addr := "unix://" + filepath.Join(t.TempDir(), "sim.sock")
	ln, err := sim.Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(s.ServerOptions()...)
	s.Register(gs)
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	t.Cleanup(func() {
		gs.Stop()
		<-served
		_ = s.Close()
	})
	return addr
}

// waitPlaced waits until every node's catalog places each VM of want on
// its node.
func (pc *placedCluster) waitPlaced(t *testing.T, want map[string]string) {
	t.Helper()
	agenttest.Eventually(t, 30*time.Second, "the catalog places every VM on every node", func() error {
		for _, n := range pc.c.Nodes() {
			for id, node := range want {
				p, err := n.FSM().State().Placement("virtualmachines", id)
				if err != nil || p.GetNode() != node {
					return fmt.Errorf("%s: placement of %s = %v, %v; want %s", n.Name, id, p, err, node)
				}
			}
		}
		return nil
	})
}

// TestPlacementSurvivesRestoreAndRestarts: a restore keeps the cluster's
// catalog (it describes what the backends hold now, not what the archive
// held), and after every agent restarts the catalog and routing by object
// still hold.
func TestPlacementSurvivesRestoreAndRestarts(t *testing.T) {
	pc := startPlacedCluster(t, 3)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	create := func(host string) string {
		r, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-" + host, Vcpus: 1, MemoryMib: 256}, Host: host})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetVm().GetId()
	}
	want := map[string]string{create("node2"): "node2"}
	pc.waitPlaced(t, want)
	_, archive, err := saveSnapshot(ctx, pc.c.Node(0), false)
	if err != nil {
		t.Fatal(err)
	}
	want[create("node3")] = "node3"
	pc.waitPlaced(t, want)
	if _, err := restoreSnapshot(ctx, pc.c.Node(1), archive); err != nil {
		t.Fatalf("restore: %v", err)
	}
	pc.waitPlaced(t, want)
	for i := range 3 {
		pc.c.Kill(i)
		pc.c.Restart(i, false, pc.c.Node((i+1)%3).GossipAddr())
	}
	pc.c.WaitLeader(30 * time.Second)
	pc.waitPlaced(t, want)
	for via := range 3 {
		for id, node := range want {
			r, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id})
			if err != nil || r.GetVm().GetHost() != node {
				t.Errorf("GetVM %s through node%d after the restarts: %v, %v", id, via+1, r, err)
			}
		}
	}
}

// TestPlacementInEtcdMode: the catalog is kept in etcd, and routing by
// object works as in Raft mode.
func TestPlacementInEtcdMode(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	pc := startPlacedClusterWith(t, 3, func(mutate func(int, *config.Config)) *agenttest.Cluster {
		return agenttest.NewEtcd(t, 3, ec.Endpoints, mutate)
	})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	want := map[string]string{}
	for i := range 3 {
		host := fmt.Sprintf("node%d", i+1)
		r, err := pc.vm((i+1)%3).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "vm-" + host, Vcpus: 1, MemoryMib: 256}, Host: host})
		if err != nil {
			t.Fatalf("create on %s: %v", host, err)
		}
		want[r.GetVm().GetId()] = host
	}
	pc.waitPlaced(t, want)
	for via := range 3 {
		for id, node := range want {
			r, err := pc.vm(via).GetVM(ctx, &vmv1.GetVMRequest{Id: id})
			if err != nil || r.GetVm().GetHost() != node {
				t.Errorf("GetVM %s through node%d: %v, %v", id, via+1, r, err)
			}
		}
		l, err := pc.vm(via).ListVMs(ctx, &vmv1.ListVMsRequest{})
		if err != nil || len(l.GetVms()) != 3 {
			t.Errorf("ListVMs through node%d: %v, %v", via+1, l, err)
		}
	}
}

// TestPlacementHopKeepsDeadlines: the caller's deadline crosses the hop to
// the node that holds the object, and a cancelled watch ends on that
// node's backend too.
func TestPlacementHopKeepsDeadlines(t *testing.T) {
	pc := startPlacedCluster(t, 2)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	r, err := pc.vm(0).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "slow", Vcpus: 1, MemoryMib: 256}, Host: "node2"})
	if err != nil {
		t.Fatal(err)
	}
	pc.waitPlaced(t, map[string]string{r.GetVm().GetId(): "node2"})
	ctl := simv1.NewSimulatorServiceClient(pc.direct[1])
	if _, err := ctl.SetFault(ctx, &simv1.SetFaultRequest{Fault: &simv1.Fault{Method: "/pivirt.vm.v1.VMService/GetVM", Delay: durationpb.New(20 * time.Second)}}); err != nil {
		t.Fatal(err)
	}
	dctx, dcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer dcancel()
	start := time.Now()
	var hdr metadata.MD
	_, err = pc.vm(0).GetVM(dctx, &vmv1.GetVMRequest{Id: r.GetVm().GetId()}, grpc.Header(&hdr))
	if toStatus(err).Code() != codes.DeadlineExceeded || time.Since(start) > 5*time.Second {
		t.Errorf("GetVM of a node2 VM through node1 with a 500 ms deadline, node2's backend taking 20 s: %v after %s", err, time.Since(start))
	}
	// A VM made behind the agents' backs (not in the catalog): the
	// lookup on the nodes stops at the caller's deadline too.
	hidden, err := vmv1.NewVMServiceClient(pc.direct[1]).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "hidden", Vcpus: 1, MemoryMib: 256}})
	if err != nil {
		t.Fatal(err)
	}
	lctx, lcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer lcancel()
	start = time.Now()
	if _, err := pc.vm(0).GetVM(lctx, &vmv1.GetVMRequest{Id: hidden.GetVm().GetId()}); toStatus(err).Code() != codes.DeadlineExceeded || time.Since(start) > 5*time.Second {
		t.Errorf("GetVM of a VM the catalog may not know, node2's backend taking 20 s, 500 ms deadline: %v after %s", err, time.Since(start))
	}
	if _, err := ctl.ClearFaults(ctx, &simv1.ClearFaultsRequest{}); err != nil {
		t.Fatal(err)
	}

	// A watch through node1 cancelled by its caller leaves no watch open
	// on node2's backend: node2's agent keeps one (the catalog's), the
	// cancelled one is gone.
	openWatches := func() int {
		st, err := ctl.Stats(ctx, &simv1.StatsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return int(st.GetActive()["/pivirt.vm.v1.VMService/WatchVMs"])
	}
	agenttest.Eventually(t, 10*time.Second, "node2's catalog watch open", func() error {
		if n := openWatches(); n != 1 {
			return fmt.Errorf("%d watches open on node2's backend", n)
		}
		return nil
	})
	wctx, wcancel := context.WithCancel(ctx)
	w, err := pc.vm(0).WatchVMs(wctx, &vmv1.WatchVMsRequest{Host: "node2"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Recv(); err != nil {
		t.Fatal(err)
	}
	if n := openWatches(); n != 2 {
		t.Errorf("%d watches open on node2's backend during the watch, want 2", n)
	}
	wcancel()
	agenttest.Eventually(t, 10*time.Second, "the cancelled watch ended on node2's backend", func() error {
		if n := openWatches(); n != 1 {
			return fmt.Errorf("%d watches open on node2's backend", n)
		}
		return nil
	})
}
