// Package sim is pivirtd-sim: a simulated pivirtd and iscsiman. It serves
// the VM, network and storage APIs as a real gRPC server with its state in
// bbolt, grpc.health.v1, reflection, and a control API
// (pivirt.sim.v1.SimulatorService) that makes calls fail, slow down or
// report unhealthy, for tests and demos. It is not a hypervisor.
package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// Roles a simulator plays.
const (
	// RolePivirtd serves pivirt.vm.v1.VMService and
	// pivirt.network.v1.NetworkService.
	RolePivirtd = "pivirtd"
	// RoleIscsiman serves pivirt.storage.v1.StorageService.
	RoleIscsiman = "iscsiman"
)

// Config configures a Simulator.
type Config struct {
	// DataDir holds the bbolt file (sim.db).
	DataDir string
	// Roles lists what to serve (RolePivirtd, RoleIscsiman); empty: both.
	Roles []string
	// Host is the node name VMs report; empty: the host name.
	Host   string
	Logger *slog.Logger
}

// Simulator is the simulated backend.
type Simulator struct {
	db       *bolt.DB
	logger   *slog.Logger
	services []string
	vm       *vmService
	storage  *storageService
	network  *networkService
	health   *health.Server
	faults   faults
}

// Open opens (or creates) the simulator's state in cfg.DataDir.
func Open(cfg Config) (*Simulator, error) {
	if cfg.DataDir == "" {
		return nil, errors.New("data dir: required")
	}
	roles := cfg.Roles
	if len(roles) == 0 {
		roles = []string{RolePivirtd, RoleIscsiman}
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	host := cfg.Host
	if host == "" {
		host, _ = os.Hostname()
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	db, err := bolt.Open(filepath.Join(cfg.DataDir, "sim.db"), 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w (is another pivirtd-sim using this data dir?)", filepath.Join(cfg.DataDir, "sim.db"), err)
	}
	// Updates go through db.Batch (table.update): concurrent ones share a
	// commit, as a hypervisor runs many power changes at once rather than
	// one fsync after another; a lone update waits this long for others.
	db.MaxBatchDelay = 500 * time.Microsecond
	s := &Simulator{db: db, logger: logger, health: health.NewServer()}
	s.faults.stats = stats{calls: map[string]uint64{}, failed: map[string]uint64{}, active: map[string]uint64{}}
	for _, r := range roles {
		switch r {
		case RolePivirtd:
			vms := &table[*vmv1.VM]{db: db, bucket: []byte("vms"), kind: "vm", validate: validateVM, newT: func() *vmv1.VM { return new(vmv1.VM) }, now: now,
				mutable: []string{"name", "labels", "vcpus", "memory_mib", "disks", "networks"}}
			nets := &table[*networkv1.Network]{db: db, bucket: []byte("networks"), kind: "network", validate: validateNetwork, newT: func() *networkv1.Network { return new(networkv1.Network) }, now: now,
				mutable: []string{"name", "labels", "mtu"}}
			if err := errors.Join(vms.init(), nets.init()); err != nil {
				db.Close()
				return nil, err
			}
			s.vm = &vmService{vms: vms, host: host, watch: newHub[*vmv1.VM]()}
			s.network = &networkService{networks: nets, host: host, watch: newHub[*networkv1.Network]()}
			s.services = append(s.services, vmv1.VMService_ServiceDesc.ServiceName, networkv1.NetworkService_ServiceDesc.ServiceName)
		case RoleIscsiman:
			vols := &table[*storagev1.Volume]{db: db, bucket: []byte("volumes"), kind: "volume", validate: validateVolume, newT: func() *storagev1.Volume { return new(storagev1.Volume) }, now: now,
				mutable: []string{"name", "labels", "size_bytes"}}
			if err := vols.init(); err != nil {
				db.Close()
				return nil, err
			}
			s.storage = &storageService{volumes: vols, host: host, watch: newHub[*storagev1.Volume]()}
			s.services = append(s.services, storagev1.StorageService_ServiceDesc.ServiceName)
		default:
			db.Close()
			return nil, fmt.Errorf("role %q: want %s or %s", r, RolePivirtd, RoleIscsiman)
		}
	}
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	for _, name := range s.services {
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	return s, nil
}

// Services lists the API services this simulator serves.
func (s *Simulator) Services() []string { return s.services }

// ServerOptions are the interceptors that apply faults and count calls;
// pass them to grpc.NewServer.
func (s *Simulator) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			echo(ctx, func(md metadata.MD) { _ = grpc.SetHeader(ctx, md) }, func(md metadata.MD) { _ = grpc.SetTrailer(ctx, md) })
			if err := s.faults.apply(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			defer s.faults.running(info.FullMethod)()
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			echo(ss.Context(), func(md metadata.MD) { _ = ss.SetHeader(md) }, ss.SetTrailer)
			if err := s.faults.apply(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			defer s.faults.running(info.FullMethod)()
			return h(srv, ss)
		}),
	}
}

// Register registers the API services, grpc.health.v1, reflection and
// the control API on gs.
func (s *Simulator) Register(gs *grpc.Server) {
	if s.vm != nil {
		vmv1.RegisterVMServiceServer(gs, s.vm)
		networkv1.RegisterNetworkServiceServer(gs, s.network)
	}
	if s.storage != nil {
		storagev1.RegisterStorageServiceServer(gs, s.storage)
	}
	healthpb.RegisterHealthServer(gs, s.health)
	simv1.RegisterSimulatorServiceServer(gs, &control{s: s})
	reflection.Register(gs)
}

// Close ends watches and closes the state.
func (s *Simulator) Close() error {
	s.health.Shutdown()
	if s.vm != nil {
		s.vm.watch.close()
		s.network.watch.close()
	}
	if s.storage != nil {
		s.storage.watch.close()
	}
	return s.db.Close()
}

// EchoHeader is a request header the simulator returns, for tests of
// metadata forwarding: its values come back in the response header of the
// same name and in the trailer EchoHeader+"-trailer", on success and error.
const EchoHeader = "x-sim-echo"

func echo(ctx context.Context, header, trailer func(metadata.MD)) {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(EchoHeader); len(v) > 0 {
		h := metadata.MD{EchoHeader: v, KeysHeader: []string{strings.Join(slices.Sorted(maps.Keys(md)), ",")}}
		if id := md.Get("x-request-id"); len(id) > 0 {
			h.Set(RequestIDHeader, id...)
		}
		if dl, ok := ctx.Deadline(); ok {
			// The deadline the call arrived with, for tests of its
			// propagation.
			h.Set(DeadlineHeader, strconv.FormatInt(time.Until(dl).Milliseconds(), 10))
		}
		header(h)
		trailer(metadata.MD{EchoHeader + "-trailer": v})
	}
}

// KeysHeader lists, with EchoHeader, the request's metadata keys (what a
// proxy forwarded).
const KeysHeader = "x-sim-keys"

// RequestIDHeader carries, with EchoHeader, the x-request-id the call
// arrived with (a gateway relays the backend's own x-request-id to no
// caller).
const RequestIDHeader = "x-sim-request-id"

// DeadlineHeader carries, with EchoHeader, the milliseconds left of the
// call's deadline when it arrived.
const DeadlineHeader = "x-sim-deadline-ms"

// faults holds the installed faults and the call counters.
type faults struct {
	mu    sync.Mutex
	list  []*fault
	stats stats
}

type fault struct {
	spec *simv1.Fault
	// left is how many more calls it applies to; -1: unlimited.
	left int64
}

type stats struct {
	calls, failed, active map[string]uint64
}

// matches reports whether a fault's method pattern covers method.
func matches(pattern, method string) bool {
	switch {
	case pattern == "*":
		return true
	case strings.HasSuffix(pattern, "/"):
		return strings.HasPrefix(method, pattern)
	default:
		return pattern == method
	}
}

// running counts a call in progress until the returned func is called.
func (f *faults) running(method string) func() {
	f.mu.Lock()
	f.stats.active[method]++
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		if f.stats.active[method]--; f.stats.active[method] == 0 {
			delete(f.stats.active, method)
		}
		f.mu.Unlock()
	}
}

// apply counts the call, then delays and/or fails it as the first
// matching fault says. The control API itself is never faulted.
func (f *faults) apply(ctx context.Context, method string) error {
	if strings.HasPrefix(method, "/"+simv1.SimulatorService_ServiceDesc.ServiceName+"/") {
		return nil
	}
	f.mu.Lock()
	f.stats.calls[method]++
	var hit *simv1.Fault
	for _, ft := range f.list {
		if !matches(ft.spec.GetMethod(), method) || ft.left == 0 {
			continue
		}
		if p := ft.spec.GetPercent(); p != 0 && p < 100 && rand.UintN(100) >= uint(p) {
			continue
		}
		if ft.left > 0 {
			ft.left--
		}
		hit = ft.spec
		break
	}
	if hit != nil && hit.GetCode() != 0 {
		f.stats.failed[method]++
	}
	f.mu.Unlock()
	if hit == nil {
		return nil
	}
	if d := hit.GetDelay().AsDuration(); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
	}
	if hit.GetCode() != 0 {
		msg := hit.GetMessage()
		if msg == "" {
			msg = "fault injected by pivirtd-sim"
		}
		return status.Error(codes.Code(hit.GetCode()), msg)
	}
	return nil
}

// control serves pivirt.sim.v1.SimulatorService.
type control struct {
	s *Simulator
}

func (c *control) SetFault(_ context.Context, r *simv1.SetFaultRequest) (*simv1.SetFaultResponse, error) {
	return c.s.SetFault(r.GetFault())
}

// SetFault installs (or replaces, by method) a fault.
func (s *Simulator) SetFault(ft *simv1.Fault) (*simv1.SetFaultResponse, error) {
	if err := ValidateFault(ft); err != nil {
		return nil, err
	}
	f := &s.faults
	f.mu.Lock()
	defer f.mu.Unlock()
	left := int64(ft.GetCount())
	if left == 0 {
		left = -1
	}
	nf := &fault{spec: ft, left: left}
	if i := slices.IndexFunc(f.list, func(old *fault) bool { return old.spec.GetMethod() == ft.GetMethod() }); i >= 0 {
		f.list[i] = nf
	} else {
		f.list = append(f.list, nf)
	}
	s.logger.Info("fault set", "method", ft.GetMethod(), "code", codes.Code(ft.GetCode()).String(), "delay", ft.GetDelay().AsDuration(), "count", ft.GetCount(), "percent", ft.GetPercent())
	return &simv1.SetFaultResponse{}, nil
}

// ValidateFault checks a fault, naming the bad field.
func ValidateFault(ft *simv1.Fault) error {
	switch {
	case ft == nil:
		return invalid("fault: required")
	case ft.GetMethod() != "*" && !strings.HasPrefix(ft.GetMethod(), "/"):
		return invalid("fault.method: %q: a full method (/pkg.Service/Method), a service prefix ending in '/' or \"*\"", ft.GetMethod())
	case ft.GetCode() > uint32(codes.Unauthenticated):
		return invalid("fault.code: %d is not a gRPC status code (0-16)", ft.GetCode())
	case ft.GetDelay() != nil && (ft.GetDelay().CheckValid() != nil || ft.GetDelay().AsDuration() < 0):
		return invalid("fault.delay: not a valid non-negative duration")
	case ft.GetPercent() > 100:
		return invalid("fault.percent: %d, want 0 to 100", ft.GetPercent())
	case ft.GetCode() == 0 && ft.GetDelay().AsDuration() == 0:
		return invalid("fault: neither a code nor a delay: it would do nothing")
	}
	return nil
}

func (c *control) ClearFaults(context.Context, *simv1.ClearFaultsRequest) (*simv1.ClearFaultsResponse, error) {
	f := &c.s.faults
	f.mu.Lock()
	f.list = nil
	f.mu.Unlock()
	c.s.logger.Info("faults cleared")
	return &simv1.ClearFaultsResponse{}, nil
}

func (c *control) SetServing(_ context.Context, r *simv1.SetServingRequest) (*simv1.SetServingResponse, error) {
	if r.GetService() != "" && !slices.Contains(c.s.services, r.GetService()) {
		return nil, status.Errorf(codes.NotFound, "service %q is not served here (%s)", r.GetService(), strings.Join(c.s.services, ", "))
	}
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if r.GetServing() {
		st = healthpb.HealthCheckResponse_SERVING
	}
	c.s.health.SetServingStatus(r.GetService(), st)
	c.s.logger.Info("health set", "service", r.GetService(), "status", st.String())
	return &simv1.SetServingResponse{}, nil
}

func (c *control) Stats(context.Context, *simv1.StatsRequest) (*simv1.StatsResponse, error) {
	f := &c.s.faults
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &simv1.StatsResponse{Calls: map[string]uint64{}, Failed: map[string]uint64{}, Active: map[string]uint64{}}
	maps.Copy(out.Calls, f.stats.calls)
	maps.Copy(out.Failed, f.stats.failed)
	maps.Copy(out.Active, f.stats.active)
	return out, nil
}
