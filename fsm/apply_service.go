package fsm

import (
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// getService returns the stored instance, or nil.
func getService(t *writeTxn, service, instanceID string) (*clusterv1.ServiceInstance, error) {
	return lookup[*clusterv1.ServiceInstance](t, TableServices, service, instanceID)
}

// mustGetService returns the stored instance or ErrNotFound.
func mustGetService(t *writeTxn, service, instanceID string) (*clusterv1.ServiceInstance, error) {
	inst, err := getService(t, service, instanceID)
	if err != nil {
		return nil, err
	}
	if inst == nil {
		return nil, fmt.Errorf("%w: service %q instance %q", ErrNotFound, service, instanceID)
	}
	return inst, nil
}

// HealthSince returns when inst's health last changed: its health_since;
// when unset, for a TTL instance the reaper marked critical its last
// heartbeat plus its TTL, else its registration.
func HealthSince(inst *clusterv1.ServiceInstance) *timestamppb.Timestamp {
	switch {
	case inst.GetHealthSince() != nil:
		return inst.GetHealthSince()
	case inst.GetHealth() == clusterv1.Health_HEALTH_CRITICAL && inst.GetTtl().AsDuration() > 0 && inst.GetLastHeartbeat() != nil:
		return timestamppb.New(inst.GetLastHeartbeat().AsTime().Add(inst.GetTtl().AsDuration()))
	default:
		return inst.GetRegisteredAt()
	}
}

// applyRegisterService inserts or replaces an instance. A re-registration of
// the same (service, instance_id) keeps registered_at and create_index. The
// instance of the command becomes the stored record: the command was
// decoded for this apply alone.
func (f *FSM) applyRegisterService(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	in := cmd.GetRegisterService().GetInstance()
	const p = "register_service.instance"
	if in == nil {
		return nil, invalidf("%s: required", p)
	}
	if err := checkID(p+".service", in.GetService()); err != nil {
		return nil, err
	}
	if err := checkID(p+".instance_id", in.GetInstanceId()); err != nil {
		return nil, err
	}
	if err := checkOptionalID(p+".node", in.GetNode()); err != nil {
		return nil, err
	}
	if in.GetAddress() == "" {
		return nil, invalidf("%s.address: required", p)
	}
	if in.GetPort() > MaxPort {
		return nil, invalidf("%s.port: %d, must be 0-%d", p, in.GetPort(), MaxPort)
	}
	if err := checkDuration(p+".ttl", in.GetTtl()); err != nil {
		return nil, err
	}
	if !t.legacy() {
		if err := checkDuration(p+".deregister_critical_after", in.GetDeregisterCriticalAfter()); err != nil {
			return nil, err
		}
		if err := checkDuration(p+".check.interval", in.GetCheck().GetInterval()); err != nil {
			return nil, err
		}
		if err := checkDuration(p+".check.timeout", in.GetCheck().GetTimeout()); err != nil {
			return nil, err
		}
	}
	old, err := getService(t, in.GetService(), in.GetInstanceId())
	if err != nil {
		return nil, err
	}
	inst := in
	if t.legacy() {
		// 0.0 knows no checks and no health history: passing, the rest
		// as the command carries it.
		inst.Health = clusterv1.Health_HEALTH_PASSING
		return f.storeRegistration(t, cmd, inst, old)
	}
	// An instance with a check is critical until its check passes; a
	// registration that keeps the check keeps its result.
	inst.Health, inst.Output = clusterv1.Health_HEALTH_PASSING, ""
	if in.GetCheck() != nil {
		inst.Health, inst.Output = clusterv1.Health_HEALTH_CRITICAL, "not checked yet"
		if old != nil && proto.Equal(old.GetCheck(), in.GetCheck()) {
			inst.Health, inst.Output = old.GetHealth(), old.GetOutput()
		}
	}
	switch {
	case old != nil && old.GetHealth() == inst.GetHealth():
		inst.HealthSince = old.GetHealthSince()
	case old == nil && inst.GetHealth() == clusterv1.Health_HEALTH_PASSING:
		inst.HealthSince = nil // passing since registered_at
	default:
		inst.HealthSince = cmd.GetTime()
	}
	return f.storeRegistration(t, cmd, inst, old)
}

// storeRegistration stores a registered instance, replacing old (nil: a
// new instance).
func (f *FSM) storeRegistration(t *writeTxn, cmd *fsmv1.Command, inst, old *clusterv1.ServiceInstance) (proto.Message, error) {
	inst.LastHeartbeat = cmd.GetTime()
	inst.ModifyIndex = t.index
	if old != nil {
		inst.RegisteredAt = old.GetRegisteredAt()
		inst.CreateIndex = old.GetCreateIndex()
	} else {
		inst.RegisteredAt = cmd.GetTime()
		inst.CreateIndex = t.index
	}
	if err := t.insert(TableServices, inst); err != nil {
		return nil, err
	}
	return inst, nil
}

func (f *FSM) applyDeregisterService(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetDeregisterService()
	if err := checkID("deregister_service.service", op.GetService()); err != nil {
		return nil, err
	}
	if err := checkID("deregister_service.instance_id", op.GetInstanceId()); err != nil {
		return nil, err
	}
	since := op.GetCriticalSince()
	if t.legacy() {
		since = nil // 0.0 deregisters unconditionally
	}
	if err := checkTime("deregister_service.critical_since", since, false); err != nil {
		return nil, err
	}
	inst, err := mustGetService(t, op.GetService(), op.GetInstanceId())
	if err != nil {
		return nil, err
	}
	if since != nil && (inst.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || compareTime(HealthSince(inst), since) != 0) {
		return nil, fmt.Errorf("%w: service %q instance %q: %s since %s, command expected critical since %s",
			ErrStale, op.GetService(), op.GetInstanceId(), inst.GetHealth(), formatTime(HealthSince(inst)), formatTime(since))
	}
	return nil, t.delete(TableServices, inst)
}

// applyHeartbeat sets last_heartbeat to the command time, health to the
// command's (unset: passing) and output to the command's.
func (f *FSM) applyHeartbeat(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetHeartbeat()
	if err := checkID("heartbeat.service", op.GetService()); err != nil {
		return nil, err
	}
	if err := checkID("heartbeat.instance_id", op.GetInstanceId()); err != nil {
		return nil, err
	}
	if t.legacy() {
		// 0.0: a heartbeat is a passing heartbeat, whatever it carries.
		old, err := mustGetService(t, op.GetService(), op.GetInstanceId())
		if err != nil {
			return nil, err
		}
		inst := proto.CloneOf(old)
		inst.LastHeartbeat = cmd.GetTime()
		inst.Health = clusterv1.Health_HEALTH_PASSING
		inst.ModifyIndex = t.index
		if err := t.insert(TableServices, inst); err != nil {
			return nil, err
		}
		return inst, nil
	}
	health := op.GetHealth()
	switch health {
	case clusterv1.Health_HEALTH_UNSPECIFIED:
		health = clusterv1.Health_HEALTH_PASSING
	case clusterv1.Health_HEALTH_PASSING, clusterv1.Health_HEALTH_CRITICAL:
	default:
		return nil, invalidf("heartbeat.health: %s, must be HEALTH_PASSING or HEALTH_CRITICAL", health)
	}
	if len(op.GetOutput()) > MaxOutputSize {
		return nil, invalidf("heartbeat.output: %d bytes, at most %d", len(op.GetOutput()), MaxOutputSize)
	}
	old, err := mustGetService(t, op.GetService(), op.GetInstanceId())
	if err != nil {
		return nil, err
	}
	inst := proto.CloneOf(old)
	inst.LastHeartbeat = cmd.GetTime()
	if old.GetHealth() != health {
		inst.HealthSince = cmd.GetTime()
	}
	inst.Health = health
	inst.Output = op.GetOutput()
	inst.ModifyIndex = t.index
	if err := t.insert(TableServices, inst); err != nil {
		return nil, err
	}
	return inst, nil
}

// applySetServiceHealth changes an instance's health only if its last
// heartbeat is still the one the command was based on; otherwise it returns
// ErrStale and changes nothing. Setting the health the instance already has
// is a successful no-op that writes nothing.
func (f *FSM) applySetServiceHealth(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetSetServiceHealth()
	const p = "set_service_health"
	if err := checkID(p+".service", op.GetService()); err != nil {
		return nil, err
	}
	if err := checkID(p+".instance_id", op.GetInstanceId()); err != nil {
		return nil, err
	}
	switch op.GetHealth() {
	case clusterv1.Health_HEALTH_PASSING, clusterv1.Health_HEALTH_CRITICAL:
	default:
		return nil, invalidf("%s.health: %s, must be HEALTH_PASSING or HEALTH_CRITICAL", p, op.GetHealth())
	}
	if err := checkTime(p+".last_heartbeat", op.GetLastHeartbeat(), true); err != nil {
		return nil, err
	}
	old, err := mustGetService(t, op.GetService(), op.GetInstanceId())
	if err != nil {
		return nil, err
	}
	if compareTime(old.GetLastHeartbeat(), op.GetLastHeartbeat()) != 0 {
		return nil, fmt.Errorf("%w: service %q instance %q: last heartbeat is %s, command expected %s",
			ErrStale, op.GetService(), op.GetInstanceId(), formatTime(old.GetLastHeartbeat()), formatTime(op.GetLastHeartbeat()))
	}
	if old.GetHealth() == op.GetHealth() {
		return old, nil
	}
	inst := proto.CloneOf(old)
	inst.Health = op.GetHealth()
	// Unset: HealthSince works it out from the TTL, as the reaper's
	// decision did (snapshots of earlier versions hold no other value).
	if !t.legacy() {
		inst.HealthSince = nil
	}
	inst.ModifyIndex = t.index
	if err := t.insert(TableServices, inst); err != nil {
		return nil, err
	}
	return inst, nil
}
