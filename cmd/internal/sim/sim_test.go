package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// env is a simulator served on a unix socket and a client connection.
type env struct {
	sim  *Simulator
	conn *grpc.ClientConn
	vm   vmv1.VMServiceClient
	vol  storagev1.StorageServiceClient
	net  networkv1.NetworkServiceClient
	ctl  simv1.SimulatorServiceClient
}

func start(t *testing.T, dataDir string) *env {
	t.Helper()
	s, err := Open(Config{DataDir: dataDir, Host: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "sim.sock")
	ln, err := Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(s.ServerOptions()...)
	s.Register(gs)
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		gs.Stop()
		<-served
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return &env{sim: s, conn: conn, vm: vmv1.NewVMServiceClient(conn), vol: storagev1.NewStorageServiceClient(conn),
		net: networkv1.NewNetworkServiceClient(conn), ctl: simv1.NewSimulatorServiceClient(conn)}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

// wantCode checks err's status code and that its message contains want.
func wantCode(t *testing.T, what string, err error, code codes.Code, want string) {
	t.Helper()
	if s := status.Convert(err); s.Code() != code || !strings.Contains(s.Message(), want) {
		t.Errorf("%s: %v, want %s containing %q", what, err, code, want)
	}
}

func newVM(name, owner string) *vmv1.VM {
	return &vmv1.VM{Name: name, Vcpus: 2, MemoryMib: 2048, Metadata: &apiv1.ObjectMeta{Owner: owner}}
}

func TestVMLifecycle(t *testing.T) {
	e := start(t, t.TempDir())
	c := ctx(t)
	created, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("web-1", "alice")})
	if err != nil {
		t.Fatal(err)
	}
	vm := created.GetVm()
	if !strings.HasPrefix(vm.GetId(), "vm-") || vm.GetPowerState() != vmv1.PowerState_POWER_STATE_STOPPED || vm.GetHost() != "node-a" ||
		vm.GetMetadata().GetOwner() != "alice" || vm.GetMetadata().GetRevision() == 0 || vm.GetMetadata().GetCreateTime() == nil {
		t.Errorf("created %v", vm)
	}
	_, err = e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("web-1", "bob")})
	wantCode(t, "duplicate name", err, codes.AlreadyExists, `vm named "web-1" already exists`)

	for name, tc := range map[string]struct {
		vm   *vmv1.VM
		want string
	}{
		"no vm":      {nil, "vm: required"},
		"bad name":   {&vmv1.VM{Name: "-x", Vcpus: 1, MemoryMib: 64}, "vm.name"},
		"no vcpus":   {&vmv1.VM{Name: "x", MemoryMib: 64}, "vm.vcpus: 0, want 1 to 256"},
		"tiny mem":   {&vmv1.VM{Name: "x", Vcpus: 1, MemoryMib: 1}, "vm.memory_mib: 1"},
		"empty disk": {&vmv1.VM{Name: "x", Vcpus: 1, MemoryMib: 64, Disks: []string{""}}, "vm.disks[0]"},
	} {
		_, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: tc.vm})
		wantCode(t, name, err, codes.InvalidArgument, tc.want)
	}

	// Update with a mask; a stale revision and an unknown path are refused.
	upd, err := e.vm.UpdateVM(c, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: vm.GetId(), Vcpus: 4, Name: "ignored"},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}, ExpectedRevision: &vm.Metadata.Revision})
	if err != nil || upd.GetVm().GetVcpus() != 4 || upd.GetVm().GetName() != "web-1" || upd.GetVm().GetMetadata().GetRevision() <= vm.GetMetadata().GetRevision() {
		t.Fatalf("update vcpus: %v, %v", upd, err)
	}
	_, err = e.vm.UpdateVM(c, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: vm.GetId(), Vcpus: 8}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}},
		ExpectedRevision: &vm.Metadata.Revision})
	wantCode(t, "stale revision", err, codes.Aborted, "expected_revision")
	_, err = e.vm.UpdateVM(c, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: vm.GetId()}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"power_state"}}})
	wantCode(t, "immutable field", err, codes.InvalidArgument, `"power_state" cannot be updated`)
	_, err = e.vm.UpdateVM(c, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: vm.GetId(), Vcpus: 999}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}})
	wantCode(t, "invalid update", err, codes.InvalidArgument, "vm.vcpus: 999")
	if got, _ := e.vm.GetVM(c, &vmv1.GetVMRequest{Id: vm.GetId()}); got.GetVm().GetVcpus() != 4 {
		t.Errorf("a refused update changed the VM: %v", got)
	}

	// Power.
	if r, err := e.vm.PowerOn(c, &vmv1.PowerOnRequest{Id: vm.GetId()}); err != nil || r.GetVm().GetPowerState() != running {
		t.Fatalf("power on: %v, %v", r, err)
	}
	_, err = e.vm.PowerOn(c, &vmv1.PowerOnRequest{Id: vm.GetId()})
	wantCode(t, "power on twice", err, codes.FailedPrecondition, "cannot power on")
	_, err = e.vm.DeleteVM(c, &vmv1.DeleteVMRequest{Id: vm.GetId()})
	wantCode(t, "delete running", err, codes.FailedPrecondition, "power it off first")
	if _, err := e.vm.Reboot(c, &vmv1.RebootRequest{Id: vm.GetId()}); err != nil {
		t.Fatal(err)
	}
	if r, err := e.vm.ShutdownDefault(c, &vmv1.ShutdownDefaultRequest{Id: vm.GetId(), Timeout: durationpb.New(time.Second)}); err != nil || r.GetVm().GetPowerState() != stopped {
		t.Fatalf("shutdown: %v, %v", r, err)
	}
	_, err = e.vm.PowerOff(c, &vmv1.PowerOffRequest{Id: vm.GetId()})
	wantCode(t, "power off stopped", err, codes.FailedPrecondition, "cannot power off")
	_, err = e.vm.Reboot(c, &vmv1.RebootRequest{Id: vm.GetId()})
	wantCode(t, "reboot stopped", err, codes.FailedPrecondition, "cannot reboot")
	if _, err := e.vm.DeleteVM(c, &vmv1.DeleteVMRequest{Id: vm.GetId()}); err != nil {
		t.Fatal(err)
	}
	_, err = e.vm.GetVM(c, &vmv1.GetVMRequest{Id: vm.GetId()})
	wantCode(t, "get deleted", err, codes.NotFound, vm.GetId())
	_, err = e.vm.GetVM(c, &vmv1.GetVMRequest{})
	wantCode(t, "get without id", err, codes.InvalidArgument, "id: required")
}

func TestListPagesAndPersistence(t *testing.T) {
	dir := t.TempDir()
	e := start(t, dir)
	c := ctx(t)
	for i := range 25 {
		owner := "alice"
		if i%5 == 0 {
			owner = "bob"
		}
		if _, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("vm"+string(rune('a'+i)), owner)}); err != nil {
			t.Fatal(err)
		}
	}
	var all []*vmv1.VM
	pages := 0
	for token := ""; ; {
		r, err := e.vm.ListVMs(c, &vmv1.ListVMsRequest{PageSize: 10, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		all = append(all, r.GetVms()...)
		if token = r.GetNextPageToken(); token == "" {
			break
		}
	}
	if len(all) != 25 || pages != 3 {
		t.Errorf("listed %d VMs in %d pages, want 25 in 3", len(all), pages)
	}
	bob, err := e.vm.ListVMs(c, &vmv1.ListVMsRequest{Owner: "bob"})
	if err != nil || len(bob.GetVms()) != 5 {
		t.Errorf("bob's VMs: %d, %v; want 5", len(bob.GetVms()), err)
	}
	_, err = e.vm.ListVMs(c, &vmv1.ListVMsRequest{PageSize: 5000})
	wantCode(t, "page size", err, codes.InvalidArgument, "page_size: 5000")
	_, err = e.vm.ListVMs(c, &vmv1.ListVMsRequest{PageToken: "!!"})
	wantCode(t, "page token", err, codes.InvalidArgument, "page_token")

	// Another simulator cannot open the same state; after a restart the
	// VMs are still there.
	if _, err := Open(Config{DataDir: dir}); err == nil || !strings.Contains(err.Error(), "another pivirtd-sim") {
		t.Errorf("second Open of a data dir in use: %v", err)
	}
	e.conn.Close()
	if err := e.sim.Close(); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	vms, _, err := s2.vm.vms.list(0, "", "")
	if err != nil || len(vms) != 25 {
		t.Errorf("after reopening: %d VMs, %v; want 25", len(vms), err)
	}
}

func TestWatchAndConsole(t *testing.T) {
	e := start(t, t.TempDir())
	c := ctx(t)
	a, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("a", "alice")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("b", "bob")}); err != nil {
		t.Fatal(err)
	}
	w, err := e.vm.WatchVMs(c, &vmv1.WatchVMsRequest{Owner: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	recv := func(want vmv1.EventType, name string) {
		t.Helper()
		ev, err := w.Recv()
		if err != nil || ev.GetType() != want || ev.GetVm().GetName() != name {
			t.Fatalf("watch event %v, %v; want %s of %s", ev, err, want, name)
		}
	}
	recv(vmv1.EventType_EVENT_TYPE_EXISTING, "a")
	if _, err := e.vm.CreateVM(c, &vmv1.CreateVMRequest{Vm: newVM("c", "bob")}); err != nil { // filtered out
		t.Fatal(err)
	}
	if _, err := e.vm.PowerOn(c, &vmv1.PowerOnRequest{Id: a.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	recv(vmv1.EventType_EVENT_TYPE_UPDATED, "a")

	con, err := e.vm.Console(c)
	if err != nil {
		t.Fatal(err)
	}
	if err := con.Send(&vmv1.ConsoleRequest{Id: a.GetVm().GetId(), Input: []byte("ls\n"), Size: &vmv1.ConsoleSize{Cols: 100, Rows: 30}}); err != nil {
		t.Fatal(err)
	}
	banner, err := con.Recv()
	if err != nil || !strings.Contains(string(banner.GetOutput()), "serial console of a") || !strings.HasSuffix(string(banner.GetOutput()), "root@a:~# ") {
		t.Fatalf("console banner %q, %v", banner.GetOutput(), err)
	}
	// One response per input: the echo, the output and the prompt.
	answer := func(in, want string) *vmv1.ConsoleResponse {
		t.Helper()
		out, err := con.Recv()
		if err != nil || string(out.GetOutput()) != want {
			t.Fatalf("console answer to %q: %q, %v; want %q", in, out.GetOutput(), err, want)
		}
		return out
	}
	answer("ls\n", "ls\r\nroot@a:~# ")
	for _, x := range []struct{ in, out string }{
		{"stty size\r", "stty size\r\n30 100\r\nroot@a:~# "},
		{"cat x\r\n", "cat x\r\n-sh: cat: command not found\r\nroot@a:~# "},
		{"echo $?\n", "echo $?\r\n127\r\nroot@a:~# "},
		{"exit 3\n", "exit 3\r\nlogout\r\n"},
	} {
		if err := con.Send(&vmv1.ConsoleRequest{Input: []byte(x.in)}); err != nil {
			t.Fatal(err)
		}
		if out := answer(x.in, x.out); (out.GetClosed() != nil) != (x.in == "exit 3\n") {
			t.Fatalf("console answer to %q: closed %v", x.in, out.GetClosed())
		} else if c := out.GetClosed(); c != nil && (c.GetExitStatus() != 3 || c.GetReason() != "the shell exited") {
			t.Fatalf("console closed %v, want exit status 3", c)
		}
	}
	if _, err := con.Recv(); err != io.EOF {
		t.Errorf("console after exit: %v, want EOF", err)
	}

	// A session open when the VM is powered off ends, saying so.
	con, err = e.vm.Console(c)
	if err != nil {
		t.Fatal(err)
	}
	if err := con.Send(&vmv1.ConsoleRequest{Id: a.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := con.Recv(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.vm.PowerOff(c, &vmv1.PowerOffRequest{Id: a.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	recv(vmv1.EventType_EVENT_TYPE_UPDATED, "a")
	if out, err := con.Recv(); err != nil || out.GetClosed().GetReason() != "the VM is POWER_STATE_STOPPED" {
		t.Fatalf("console of a VM powered off: %v, %v", out, err)
	}
	if _, err := con.Recv(); err != io.EOF {
		t.Errorf("console after power-off: %v, want EOF", err)
	}
	con2, err := e.vm.Console(c)
	if err != nil {
		t.Fatal(err)
	}
	_ = con2.Send(&vmv1.ConsoleRequest{Id: a.GetVm().GetId()})
	_, err = con2.Recv()
	wantCode(t, "console of a stopped VM", err, codes.FailedPrecondition, "needs it running")
	if _, err := e.vm.DeleteVM(c, &vmv1.DeleteVMRequest{Id: a.GetVm().GetId()}); err != nil {
		t.Fatal(err)
	}
	recv(vmv1.EventType_EVENT_TYPE_DELETED, "a")
}

func TestConsoleLineDiscipline(t *testing.T) {
	for _, x := range []struct{ in, out string }{
		{"ab\x7fc\r", "ab\b \bc\r\n-sh: ac: command not found\r\nroot@v:~# "},
		{"é\x7f\r", "é\b \b\r\nroot@v:~# "},
		{"xyz\x15\r", "xyz\b \b\b \b\b \b\r\nroot@v:~# "},
		{"ec\x1b[Aho hi\r", "echo hi\r\nhi\r\nroot@v:~# "},
		{"sleep\x03", "sleep^C\r\nroot@v:~# "},
		{"uname -a\r", "uname -a\r\nLinux v 6.1.0-pivirt-sim #1 SMP x86_64 GNU/Linux\r\nroot@v:~# "},
		{"exit x\r", "exit x\r\n-sh: exit: Illegal number: x\r\nroot@v:~# "},
		{"\x04", "logout\r\n"},
	} {
		sh := &shell{name: "v", cols: 80, rows: 24}
		out, closed := sh.feed([]byte(x.in))
		if string(out) != x.out {
			t.Errorf("feed(%q) = %q, want %q", x.in, out, x.out)
		}
		if (closed != nil) != (x.in == "\x04") {
			t.Errorf("feed(%q): closed %v", x.in, closed)
		}
	}
}

func TestVolumesAndNetworks(t *testing.T) {
	e := start(t, t.TempDir())
	c := ctx(t)
	v, err := e.vol.CreateVolume(c, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "disk1", SizeBytes: 10}})
	if err != nil || !strings.HasPrefix(v.GetVolume().GetIqn(), "iqn.") {
		t.Fatalf("create volume: %v, %v", v, err)
	}
	id := v.GetVolume().GetId()
	up, err := e.vol.UploadVolume(c)
	if err != nil {
		t.Fatal(err)
	}
	for i, chunk := range []string{"hello", " wor"} {
		msg := &storagev1.UploadVolumeRequest{Chunk: []byte(chunk)}
		if i == 0 {
			msg.Id = id
		}
		if err := up.Send(msg); err != nil {
			t.Fatal(err)
		}
	}
	res, err := up.CloseAndRecv()
	sum := sha256.Sum256([]byte("hello wor"))
	if err != nil || res.GetVolume().GetWrittenBytes() != 9 || res.GetVolume().GetSha256() != hex.EncodeToString(sum[:]) {
		t.Fatalf("upload: %v, %v", res, err)
	}
	up, err = e.vol.UploadVolume(c)
	if err != nil {
		t.Fatal(err)
	}
	_ = up.Send(&storagev1.UploadVolumeRequest{Id: id, Chunk: []byte("0123456789abc")})
	_, err = up.CloseAndRecv()
	wantCode(t, "upload past the size", err, codes.OutOfRange, "of 10 bytes")
	_, err = e.vol.UpdateVolume(c, &storagev1.UpdateVolumeRequest{Volume: &storagev1.Volume{Id: id, SizeBytes: 5}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"size_bytes"}}})
	wantCode(t, "shrink", err, codes.InvalidArgument, "volumes only grow")
	if r, err := e.vol.UpdateVolume(c, &storagev1.UpdateVolumeRequest{Volume: &storagev1.Volume{Id: id, SizeBytes: 20}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"size_bytes"}}}); err != nil || r.GetVolume().GetSizeBytes() != 20 {
		t.Errorf("grow: %v, %v", r, err)
	}

	for cidr, want := range map[string]string{"10.0.0.1/24": "host bits set", "nope": "not an IP prefix"} {
		_, err := e.net.CreateNetwork(c, &networkv1.CreateNetworkRequest{Network: &networkv1.Network{Name: "n", Cidr: cidr}})
		wantCode(t, "cidr "+cidr, err, codes.InvalidArgument, want)
	}
	_, err = e.net.CreateNetwork(c, &networkv1.CreateNetworkRequest{Network: &networkv1.Network{Name: "n", Cidr: "10.0.0.0/24", Vlan: 5000}})
	wantCode(t, "vlan", err, codes.InvalidArgument, "network.vlan: 5000")
	n, err := e.net.CreateNetwork(c, &networkv1.CreateNetworkRequest{Network: &networkv1.Network{Name: "n", Cidr: "10.0.0.0/24", Vlan: 10, Mtu: 9000}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.net.DeleteNetwork(c, &networkv1.DeleteNetworkRequest{Id: n.GetNetwork().GetId()}); err != nil {
		t.Fatal(err)
	}
}

// TestWatchVolumesAndNetworks: the storage and network watches send what
// exists, then every change, with the node's name in host.
func TestWatchVolumesAndNetworks(t *testing.T) {
	e := start(t, t.TempDir())
	c := ctx(t)
	old, err := e.vol.CreateVolume(c, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "old", SizeBytes: 10}})
	if err != nil {
		t.Fatal(err)
	}
	vw, err := e.vol.WatchVolumes(c, &storagev1.WatchVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	nw, err := e.net.WatchNetworks(c, &networkv1.WatchNetworksRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := vw.Recv(); err != nil || ev.GetType() != storagev1.EventType_EVENT_TYPE_EXISTING || ev.GetVolume().GetId() != old.GetVolume().GetId() || ev.GetVolume().GetHost() != "node-a" {
		t.Fatalf("first volume event: %v, %v", ev, err)
	}
	v, err := e.vol.CreateVolume(c, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "new", SizeBytes: 10}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.vol.DeleteVolume(c, &storagev1.DeleteVolumeRequest{Id: v.GetVolume().GetId()}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []storagev1.EventType{storagev1.EventType_EVENT_TYPE_CREATED, storagev1.EventType_EVENT_TYPE_DELETED} {
		if ev, err := vw.Recv(); err != nil || ev.GetType() != want || ev.GetVolume().GetId() != v.GetVolume().GetId() {
			t.Fatalf("volume event: %v, %v, want %s of %s", ev, err, want, v.GetVolume().GetId())
		}
	}
	n, err := e.net.CreateNetwork(c, &networkv1.CreateNetworkRequest{Network: &networkv1.Network{Name: "n", Cidr: "10.0.0.0/24"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.net.DeleteNetwork(c, &networkv1.DeleteNetworkRequest{Id: n.GetNetwork().GetId()}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []networkv1.EventType{networkv1.EventType_EVENT_TYPE_CREATED, networkv1.EventType_EVENT_TYPE_DELETED} {
		if ev, err := nw.Recv(); err != nil || ev.GetType() != want || ev.GetNetwork().GetId() != n.GetNetwork().GetId() || ev.GetNetwork().GetHost() != "node-a" {
			t.Fatalf("network event: %v, %v, want %s of %s", ev, err, want, n.GetNetwork().GetId())
		}
	}
}

func TestFaultsHealthAndStats(t *testing.T) {
	e := start(t, t.TempDir())
	c := ctx(t)
	get := "/pivirt.vm.v1.VMService/ListVMs"
	if _, err := e.ctl.SetFault(c, &simv1.SetFaultRequest{Fault: &simv1.Fault{Method: get, Code: uint32(codes.Unavailable), Message: "boom", Count: 2}}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		_, err := e.vm.ListVMs(c, &vmv1.ListVMsRequest{})
		if i < 2 {
			wantCode(t, "faulted call", err, codes.Unavailable, "boom")
		} else if err != nil {
			t.Errorf("call after the fault's count: %v", err)
		}
	}
	// A delay longer than the caller's deadline.
	if _, err := e.ctl.SetFault(c, &simv1.SetFaultRequest{Fault: &simv1.Fault{Method: "/pivirt.vm.v1.VMService/", Delay: durationpb.New(time.Minute)}}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(c, 200*time.Millisecond)
	_, err := e.vm.GetVM(short, &vmv1.GetVMRequest{Id: "x"})
	cancel()
	wantCode(t, "delayed call", err, codes.DeadlineExceeded, "")
	// "*" does not reach the control API.
	if _, err := e.ctl.SetFault(c, &simv1.SetFaultRequest{Fault: &simv1.Fault{Method: "*", Code: uint32(codes.Internal)}}); err != nil {
		t.Fatal(err)
	}
	_, err = e.net.ListNetworks(c, &networkv1.ListNetworksRequest{})
	wantCode(t, "every method", err, codes.Internal, "fault injected by pivirtd-sim")
	st, err := e.ctl.Stats(c, &simv1.StatsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.GetCalls()[get] != 3 || st.GetFailed()[get] != 2 {
		t.Errorf("stats of %s: %d calls, %d failed; want 3, 2", get, st.GetCalls()[get], st.GetFailed()[get])
	}
	if _, err := e.ctl.ClearFaults(c, &simv1.ClearFaultsRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.net.ListNetworks(c, &networkv1.ListNetworksRequest{}); err != nil {
		t.Errorf("after ClearFaults: %v", err)
	}
	for want, ft := range map[string]*simv1.Fault{
		"fault.method":     {Method: "ListVMs", Code: 14},
		"fault.code":       {Method: "*", Code: 99},
		"fault.percent":    {Method: "*", Code: 14, Percent: 101},
		"would do nothing": {Method: "*"},
		"fault: required":  nil,
	} {
		_, err := e.ctl.SetFault(c, &simv1.SetFaultRequest{Fault: ft})
		wantCode(t, want, err, codes.InvalidArgument, want)
	}

	h := healthpb.NewHealthClient(e.conn)
	svc := vmv1.VMService_ServiceDesc.ServiceName
	if r, err := h.Check(c, &healthpb.HealthCheckRequest{Service: svc}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of %s: %v, %v", svc, r, err)
	}
	if _, err := e.ctl.SetServing(c, &simv1.SetServingRequest{Service: svc, Serving: false}); err != nil {
		t.Fatal(err)
	}
	if r, err := h.Check(c, &healthpb.HealthCheckRequest{Service: svc}); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health of %s after SetServing false: %v, %v", svc, r, err)
	}
	_, err = e.ctl.SetServing(c, &simv1.SetServingRequest{Service: "pivirt.nope.v1.Nope"})
	wantCode(t, "unknown service", err, codes.NotFound, "not served here")
}

func TestListen(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]string{
		"unix://relative.sock": "must be absolute",
		"unix://" + file:       "is not a socket",
		"http://127.0.0.1:1":   "want unix:///abs/path or host:port",
	} {
		if _, err := Listen(addr); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Listen(%q) = %v, want an error containing %q", addr, err, want)
		}
	}
	// A stale socket (a crashed simulator's) is replaced.
	sock := filepath.Join(dir, "s.sock")
	stale, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	ln, err := Listen("unix://" + sock)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	ln.Close()
	ln, err = Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
}
