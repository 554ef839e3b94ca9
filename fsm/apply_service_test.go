package fsm

import (
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// storedInstance returns the stored instance or fails.
func storedInstance(t *testing.T, h *harness, service, id string) *clusterv1.ServiceInstance {
	t.Helper()
	inst, err := h.f.State().Service(service, id)
	if err != nil {
		t.Fatalf("Service(%q, %q): %v", service, id, err)
	}
	return inst
}

func TestRegisterService(t *testing.T) {
	withPort := func(p uint32) *clusterv1.ServiceInstance { in := instance("web", "a"); in.Port = p; return in }
	mod := func(f func(*clusterv1.ServiceInstance)) *clusterv1.ServiceInstance {
		in := instance("web", "a")
		f(in)
		return in
	}
	runApplyCases(t, []applyCase{
		{
			name: "new instance",
			cmd:  register(mod(func(in *clusterv1.ServiceInstance) { in.Health = clusterv1.Health_HEALTH_CRITICAL })),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				want := instance("web", "a")
				want.Health = clusterv1.Health_HEALTH_PASSING
				want.RegisteredAt = at(1)
				want.LastHeartbeat = at(1)
				want.CreateIndex, want.ModifyIndex = 1, 1
				if !proto.Equal(got, want) {
					t.Errorf("stored = %v\nwant     %v", got, want)
				}
				if !proto.Equal(res.Value, want) {
					t.Errorf("Result.Value = %v, want %v", res.Value, want)
				}
				if idx := h.f.State().Index(TableServices); idx != 1 {
					t.Errorf("services index = %d, want 1", idx)
				}
			},
		},
		{
			name:  "re-register keeps registered_at and create_index",
			setup: []*fsmv1.Command{register(instance("web", "a")), register(instance("web", "b"))},
			cmd:   register(withPort(9090)),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetPort() != 9090 || got.GetCreateIndex() != 1 || got.GetModifyIndex() != 3 ||
					!proto.Equal(got.GetRegisteredAt(), at(1)) || !proto.Equal(got.GetLastHeartbeat(), at(3)) {
					t.Errorf("stored = %v, want port 9090, create 1, modify 3, registered at(1), heartbeat at(3)", got)
				}
			},
		},
		{name: "port 65535", cmd: register(withPort(65535))},
		{name: "port 0", cmd: register(withPort(0))},
		{name: "ttl", cmd: registerTTL("web", "a", 10*time.Second)},
		{name: "missing instance", cmd: register(nil), wantErr: ErrInvalidCommand, check: wantField("register_service.instance")},
		{name: "missing service", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Service = "" })), wantErr: ErrInvalidCommand, check: wantField("instance.service")},
		{name: "missing instance_id", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.InstanceId = "" })), wantErr: ErrInvalidCommand, check: wantField("instance.instance_id")},
		{name: "missing address", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Address = "" })), wantErr: ErrInvalidCommand, check: wantField("instance.address")},
		{name: "port too large", cmd: register(withPort(65536)), wantErr: ErrInvalidCommand, check: wantField("instance.port")},
		{name: "negative ttl", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Ttl = durationpb.New(-time.Second) })), wantErr: ErrInvalidCommand, check: wantField("instance.ttl")},
		{name: "NUL in service", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Service = "we\x00b" })), wantErr: ErrInvalidCommand, check: wantField("instance.service")},
		{name: "service too long", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Service = strings.Repeat("s", MaxIDLength+1) })), wantErr: ErrInvalidCommand, check: wantField("instance.service")},
		{name: "control character in node", cmd: register(mod(func(in *clusterv1.ServiceInstance) { in.Node = "n\n1" })), wantErr: ErrInvalidCommand, check: wantField("instance.node")},
	})
}

func TestDeregisterService(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name:  "registered",
			setup: []*fsmv1.Command{register(instance("web", "a")), register(instance("web", "b"))},
			cmd:   deregister("web", "a"),
			check: func(t *testing.T, h *harness, res *Result) {
				if _, err := h.f.State().Service("web", "a"); !errors.Is(err, ErrNotFound) {
					t.Errorf("Service after deregister: %v, want ErrNotFound", err)
				}
				storedInstance(t, h, "web", "b")
				if res.Value != nil {
					t.Errorf("Result.Value = %v, want nil", res.Value)
				}
				if idx := h.f.State().Index(TableServices); idx != 3 {
					t.Errorf("services index = %d, want 3", idx)
				}
			},
		},
		{name: "absent", setup: []*fsmv1.Command{register(instance("web", "a"))}, cmd: deregister("web", "b"), wantErr: ErrNotFound},
		{name: "missing service", cmd: deregister("", "a"), wantErr: ErrInvalidCommand, check: wantField("deregister_service.service")},
		{name: "missing instance_id", cmd: deregister("web", ""), wantErr: ErrInvalidCommand, check: wantField("deregister_service.instance_id")},
	})
}

func TestHeartbeat(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name: "critical becomes passing",
			setup: []*fsmv1.Command{
				registerTTL("web", "a", time.Second),
				setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)),
			},
			cmd: heartbeat("web", "a"),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_PASSING || !proto.Equal(got.GetLastHeartbeat(), at(3)) ||
					got.GetModifyIndex() != 3 || !proto.Equal(got.GetRegisteredAt(), at(1)) {
					t.Errorf("stored = %v, want passing, heartbeat at(3), modify 3, registered at(1)", got)
				}
				if !proto.Equal(res.Value, got) {
					t.Errorf("Result.Value = %v, want %v", res.Value, got)
				}
			},
		},
		{name: "absent", cmd: heartbeat("web", "a"), wantErr: ErrNotFound},
		{name: "missing service", cmd: heartbeat("", "a"), wantErr: ErrInvalidCommand, check: wantField("heartbeat.service")},
		{name: "missing instance_id", cmd: heartbeat("web", ""), wantErr: ErrInvalidCommand, check: wantField("heartbeat.instance_id")},
	})
}

func TestSetServiceHealth(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name:  "matching heartbeat",
			setup: []*fsmv1.Command{registerTTL("web", "a", time.Second)},
			cmd:   setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || got.GetModifyIndex() != 2 || !proto.Equal(got.GetLastHeartbeat(), at(1)) {
					t.Errorf("stored = %v, want critical, modify 2, heartbeat at(1)", got)
				}
			},
		},
		{
			name:  "same health is a no-op",
			setup: []*fsmv1.Command{registerTTL("web", "a", time.Second)},
			cmd:   setHealth("web", "a", clusterv1.Health_HEALTH_PASSING, at(1)),
			check: func(t *testing.T, h *harness, res *Result) {
				if got := storedInstance(t, h, "web", "a"); got.GetModifyIndex() != 1 {
					t.Errorf("modify index = %d, want 1", got.GetModifyIndex())
				}
				if idx := h.f.State().Index(TableServices); idx != 1 {
					t.Errorf("services index = %d, want 1", idx)
				}
			},
		},
		{
			name:    "heartbeat raced the reaper",
			setup:   []*fsmv1.Command{registerTTL("web", "a", time.Second), heartbeat("web", "a")},
			cmd:     setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)),
			wantErr: ErrStale,
		},
		{name: "absent", cmd: setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)), wantErr: ErrNotFound},
		{name: "unspecified health", setup: []*fsmv1.Command{register(instance("web", "a"))}, cmd: setHealth("web", "a", clusterv1.Health_HEALTH_UNSPECIFIED, at(1)), wantErr: ErrInvalidCommand, check: wantField("set_service_health.health")},
		{name: "missing last_heartbeat", setup: []*fsmv1.Command{register(instance("web", "a"))}, cmd: setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, nil), wantErr: ErrInvalidCommand, check: wantField("set_service_health.last_heartbeat")},
		{name: "missing service", cmd: setHealth("", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)), wantErr: ErrInvalidCommand, check: wantField("set_service_health.service")},
		{name: "missing instance_id", cmd: setHealth("web", "", clusterv1.Health_HEALTH_CRITICAL, at(1)), wantErr: ErrInvalidCommand, check: wantField("set_service_health.instance_id")},
	})
}

// withCheck is instance(service, id) with a TCP check and
// deregister_critical_after.
func withCheck(service, id, target string) *clusterv1.ServiceInstance {
	in := instance(service, id)
	in.Check = &clusterv1.HealthCheck{Tcp: target, Interval: durationpb.New(time.Second)}
	in.DeregisterCriticalAfter = durationpb.New(time.Minute)
	return in
}

func checkResult(service, id string, health clusterv1.Health, output string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: service, InstanceId: id, Health: health, Output: output}}}
}

func deregisterIfCritical(service, id string, since *timestamppb.Timestamp) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{DeregisterService: &fsmv1.DeregisterService{Service: service, InstanceId: id, CriticalSince: since}}}
}

// TestServiceCheckHealth: an instance with a check starts critical, check
// results (heartbeats with a health) move it and its health_since, a
// registration that keeps the check keeps its result, and a conditional
// deregistration applies only to the critical spell it names.
func TestServiceCheckHealth(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name: "a check starts critical",
			cmd:  register(withCheck("web", "a", "127.0.0.1:1")),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || got.GetOutput() == "" || !proto.Equal(got.GetHealthSince(), at(1)) {
					t.Errorf("stored = %v, want critical since at(1) with an output", got)
				}
			},
		},
		{
			name:  "a passing result",
			setup: []*fsmv1.Command{register(withCheck("web", "a", "127.0.0.1:1"))},
			cmd:   checkResult("web", "a", clusterv1.Health_HEALTH_PASSING, "connected"),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_PASSING || got.GetOutput() != "connected" || !proto.Equal(got.GetHealthSince(), at(2)) {
					t.Errorf("stored = %v, want passing since at(2), output connected", got)
				}
			},
		},
		{
			name: "the same check registered again keeps the result",
			setup: []*fsmv1.Command{
				register(withCheck("web", "a", "127.0.0.1:1")),
				checkResult("web", "a", clusterv1.Health_HEALTH_PASSING, "connected"),
			},
			cmd: register(withCheck("web", "a", "127.0.0.1:1")),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_PASSING || got.GetOutput() != "connected" || !proto.Equal(got.GetHealthSince(), at(2)) {
					t.Errorf("stored = %v, want passing since at(2), output connected", got)
				}
			},
		},
		{
			name: "another check starts critical again",
			setup: []*fsmv1.Command{
				register(withCheck("web", "a", "127.0.0.1:1")),
				checkResult("web", "a", clusterv1.Health_HEALTH_PASSING, "connected"),
			},
			cmd: register(withCheck("web", "a", "127.0.0.1:2")),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || !proto.Equal(got.GetHealthSince(), at(3)) {
					t.Errorf("stored = %v, want critical since at(3)", got)
				}
			},
		},
		{
			name: "a critical result keeps health_since of the spell",
			setup: []*fsmv1.Command{
				register(withCheck("web", "a", "127.0.0.1:1")),
			},
			cmd: checkResult("web", "a", clusterv1.Health_HEALTH_CRITICAL, "refused"),
			check: func(t *testing.T, h *harness, res *Result) {
				got := storedInstance(t, h, "web", "a")
				if got.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || got.GetOutput() != "refused" || !proto.Equal(got.GetHealthSince(), at(1)) {
					t.Errorf("stored = %v, want critical since at(1), output refused", got)
				}
				if got := h.f.State().CriticalExpired(at(1).AsTime().Add(time.Minute + time.Nanosecond)); len(got) != 1 {
					t.Errorf("CriticalExpired a minute later = %v, want the instance", got)
				}
				if got := h.f.State().CriticalExpired(at(1).AsTime().Add(time.Minute)); len(got) != 0 {
					t.Errorf("CriticalExpired at the minute = %v, want none", got)
				}
			},
		},
		{
			name:  "deregister if critical since",
			setup: []*fsmv1.Command{register(withCheck("web", "a", "127.0.0.1:1"))},
			cmd:   deregisterIfCritical("web", "a", at(1)),
			check: func(t *testing.T, h *harness, res *Result) {
				if _, err := h.f.State().Service("web", "a"); !errors.Is(err, ErrNotFound) {
					t.Errorf("Service after deregister: %v, want ErrNotFound", err)
				}
			},
		},
		{
			name: "deregister if critical since: it passed in between",
			setup: []*fsmv1.Command{
				register(withCheck("web", "a", "127.0.0.1:1")),
				checkResult("web", "a", clusterv1.Health_HEALTH_PASSING, ""),
			},
			cmd:     deregisterIfCritical("web", "a", at(1)),
			wantErr: ErrStale,
		},
		{
			name: "deregister if critical since: another spell",
			setup: []*fsmv1.Command{
				register(withCheck("web", "a", "127.0.0.1:1")),
				checkResult("web", "a", clusterv1.Health_HEALTH_PASSING, ""),
				checkResult("web", "a", clusterv1.Health_HEALTH_CRITICAL, ""),
			},
			cmd:     deregisterIfCritical("web", "a", at(1)),
			wantErr: ErrStale,
		},
		{
			name: "deregister if critical since: a TTL instance the reaper marked",
			setup: []*fsmv1.Command{
				registerTTL("web", "a", time.Second),
				setHealth("web", "a", clusterv1.Health_HEALTH_CRITICAL, at(1)),
			},
			cmd: deregisterIfCritical("web", "a", timestamppb.New(at(1).AsTime().Add(time.Second))),
			check: func(t *testing.T, h *harness, res *Result) {
				if _, err := h.f.State().Service("web", "a"); !errors.Is(err, ErrNotFound) {
					t.Errorf("Service after deregister: %v, want ErrNotFound", err)
				}
			},
		},
		{name: "unknown health", setup: []*fsmv1.Command{register(instance("web", "a"))}, cmd: checkResult("web", "a", clusterv1.Health(7), ""), wantErr: ErrInvalidCommand, check: wantField("heartbeat.health")},
		{name: "output too long", setup: []*fsmv1.Command{register(instance("web", "a"))}, cmd: checkResult("web", "a", clusterv1.Health_HEALTH_CRITICAL, strings.Repeat("x", MaxOutputSize+1)), wantErr: ErrInvalidCommand, check: wantField("heartbeat.output")},
		{name: "negative deregister_critical_after", cmd: register(func() *clusterv1.ServiceInstance {
			in := instance("web", "a")
			in.DeregisterCriticalAfter = durationpb.New(-time.Second)
			return in
		}()), wantErr: ErrInvalidCommand, check: wantField("instance.deregister_critical_after")},
	})
}
