package sim

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

const (
	maxVCPUs     = 256
	maxMemoryMiB = 4 << 20 // 4 TiB
	// watchBuffer is how many events a watcher may fall behind before
	// its stream ends with ResourceExhausted.
	watchBuffer = 256
	// maxConsoleInput bounds one console message.
	maxConsoleInput = 64 << 10
)

// vmService plays pivirtd's VM API.
type vmService struct {
	vms   *table[*vmv1.VM]
	host  string
	watch *hub[*vmv1.VM]
}

func validateVM(vm *vmv1.VM) error {
	if err := checkName("vm", vm.GetName()); err != nil {
		return err
	}
	if vm.GetVcpus() < 1 || vm.GetVcpus() > maxVCPUs {
		return invalid("vm.vcpus: %d, want 1 to %d", vm.GetVcpus(), maxVCPUs)
	}
	if vm.GetMemoryMib() < 64 || vm.GetMemoryMib() > maxMemoryMiB {
		return invalid("vm.memory_mib: %d, want 64 to %d", vm.GetMemoryMib(), maxMemoryMiB)
	}
	for i, d := range vm.GetDisks() {
		if d == "" {
			return invalid("vm.disks[%d]: empty volume ID", i)
		}
	}
	for i, n := range vm.GetNetworks() {
		if n == "" {
			return invalid("vm.networks[%d]: empty network ID", i)
		}
	}
	return nil
}

func (s *vmService) ListVMs(_ context.Context, r *vmv1.ListVMsRequest) (*vmv1.ListVMsResponse, error) {
	vms, next, err := s.vms.list(r.GetPageSize(), r.GetPageToken(), r.GetOwner())
	if err != nil {
		return nil, err
	}
	return &vmv1.ListVMsResponse{Vms: vms, NextPageToken: next}, nil
}

func (s *vmService) GetVM(_ context.Context, r *vmv1.GetVMRequest) (*vmv1.GetVMResponse, error) {
	vm, err := s.vms.get(r.GetId())
	if err != nil {
		return nil, err
	}
	return &vmv1.GetVMResponse{Vm: vm}, nil
}

func (s *vmService) CreateVM(ctx context.Context, r *vmv1.CreateVMRequest) (*vmv1.CreateVMResponse, error) {
	in := proto.Clone(r.GetVm()).(*vmv1.VM)
	if r.GetVm() != nil {
		in.PowerState, in.Host = vmv1.PowerState_POWER_STATE_STOPPED, s.host
	}
	vm, err := s.vms.create(ctx, in)
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventCreated, vm)
	return &vmv1.CreateVMResponse{Vm: vm}, nil
}

func (s *vmService) UpdateVM(_ context.Context, r *vmv1.UpdateVMRequest) (*vmv1.UpdateVMResponse, error) {
	vm, err := s.vms.update(r.GetVm().GetId(), r.ExpectedRevision, func(cur *vmv1.VM) error {
		return s.vms.patch(cur, r.GetVm(), r.GetUpdateMask())
	})
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventUpdated, vm)
	return &vmv1.UpdateVMResponse{Vm: vm}, nil
}

func (s *vmService) DeleteVM(_ context.Context, r *vmv1.DeleteVMRequest) (*vmv1.DeleteVMResponse, error) {
	vm, err := s.vms.get(r.GetId())
	if err != nil {
		return nil, err
	}
	if vm.GetPowerState() == vmv1.PowerState_POWER_STATE_RUNNING {
		return nil, status.Errorf(codes.FailedPrecondition, "vm %q is running: power it off first", r.GetId())
	}
	if vm, err = s.vms.delete(r.GetId()); err != nil {
		return nil, err
	}
	s.watch.publish(eventDeleted, vm)
	return &vmv1.DeleteVMResponse{}, nil
}

// power moves a VM from one of the states in from to state to.
func (s *vmService) power(id, action string, to vmv1.PowerState, from ...vmv1.PowerState) (*vmv1.VM, error) {
	vm, err := s.vms.update(id, nil, func(vm *vmv1.VM) error {
		for _, f := range from {
			if vm.GetPowerState() == f {
				vm.PowerState = to
				return nil
			}
		}
		return status.Errorf(codes.FailedPrecondition, "vm %q is %s: cannot %s", id, vm.GetPowerState(), action)
	})
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventUpdated, vm)
	return vm, nil
}

var (
	stopped = vmv1.PowerState_POWER_STATE_STOPPED
	running = vmv1.PowerState_POWER_STATE_RUNNING
)

func (s *vmService) PowerOn(_ context.Context, r *vmv1.PowerOnRequest) (*vmv1.PowerOnResponse, error) {
	vm, err := s.power(r.GetId(), "power on", running, stopped)
	if err != nil {
		return nil, err
	}
	return &vmv1.PowerOnResponse{Vm: vm}, nil
}

func (s *vmService) ShutdownDefault(_ context.Context, r *vmv1.ShutdownDefaultRequest) (*vmv1.ShutdownDefaultResponse, error) {
	if d := r.GetTimeout(); d != nil && (d.CheckValid() != nil || d.AsDuration() < 0) {
		return nil, invalid("timeout: %v is not a valid non-negative duration", d)
	}
	// The simulated guest shuts down at once.
	vm, err := s.power(r.GetId(), "shut down", stopped, running)
	if err != nil {
		return nil, err
	}
	return &vmv1.ShutdownDefaultResponse{Vm: vm}, nil
}

func (s *vmService) PowerOff(_ context.Context, r *vmv1.PowerOffRequest) (*vmv1.PowerOffResponse, error) {
	vm, err := s.power(r.GetId(), "power off", stopped, running)
	if err != nil {
		return nil, err
	}
	return &vmv1.PowerOffResponse{Vm: vm}, nil
}

func (s *vmService) Reboot(_ context.Context, r *vmv1.RebootRequest) (*vmv1.RebootResponse, error) {
	vm, err := s.power(r.GetId(), "reboot", running, running)
	if err != nil {
		return nil, err
	}
	return &vmv1.RebootResponse{Vm: vm}, nil
}

// WatchVMs sends every VM (of the owner, when set) as EXISTING, then
// every change, until the client leaves or falls behind.
func (s *vmService) WatchVMs(r *vmv1.WatchVMsRequest, stream grpc.ServerStreamingServer[vmv1.WatchVMsResponse]) error {
	return watch(stream.Context(), s.vms, s.watch, r.GetOwner(), func(kind int32, vm *vmv1.VM) error {
		return stream.Send(&vmv1.WatchVMsResponse{Type: vmv1.EventType(kind), Vm: vm})
	})
}

// now is the simulator's clock.
func now() time.Time { return time.Now() }
