// Package fsmtest is the test kit of package fsm for the tests of fsm and
// of the packages that store, move or translate its state (etcd mode,
// archives, the gateway's error table): a state with records in every
// table, the committed test cluster CA, and the check that a package's
// list of sentinel errors is complete. It imports no package of the
// repository but the protos, so fsm's own tests can use it.
package fsmtest

import (
	_ "embed"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

var (
	//go:embed cluster-ca/ca.pem
	caCert []byte
	//go:embed cluster-ca/ca.key
	caKey []byte
)

// CA returns the PEM of the committed test cluster CA: a CA certificate
// and its key, as SetClusterCA takes them.
func CA() (certPEM, keyPEM []byte) {
	return append([]byte(nil), caCert...), append([]byte(nil), caKey...)
}

// T0 is the leader time the steps of FullState count from.
var T0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// At returns T0 plus sec seconds.
func At(sec int) *timestamppb.Timestamp {
	return timestamppb.New(T0.Add(time.Duration(sec) * time.Second))
}

// Step is one command of a test state and its expected outcome: the
// persisted error code of the result ("" for success; see fsm.ErrorCode).
type Step struct {
	Cmd     *fsmv1.Command
	WantErr string
}

// FormatSteps[v] is how many of the first steps of FullState fill the
// tables of snapshot format v: its golden state. Format 1: services,
// config, config_history, schedules, schedule_runs, dedupe, index; format 2
// added ca, format 3 placements, format 4 sessions (which the writes with
// client IDs of the earlier steps fill at cluster version 0.1; at 0.0 they
// leave dedupe records there instead), format 5 the cluster version (which
// a state at 0.1 holds from its start). The last entry is the current
// format: every step. A new format appends its steps to FullState and an
// entry here.
var FormatSteps = []int{1: 14, 2: 15, 3: 17, 4: 17, 5: 17}

// FullState returns the steps that put records in every table of the
// state: applied in order at consecutive indexes from 1, step i at leader
// time T0 + (i+1) s (stamped in the command). Every call returns new
// commands. fsm's snapshot tests check that they leave no table empty,
// and the golden snapshots of each format are built from them.
func FullState() []Step {
	inst := func(service, id string) *clusterv1.ServiceInstance {
		return &clusterv1.ServiceInstance{
			Service: service, InstanceId: id, Node: "node-1", Address: "10.0.0.1", Port: 8080,
			Tags: []string{"a", "b"}, Meta: map[string]string{"k1": "v1", "k2": "v2", "k3": "v3"},
		}
	}
	register := func(in *clusterv1.ServiceInstance) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: in}}}
	}
	setConfig := func(key, value string) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: value}}}
	}
	schedule := func(id string) *schedulev1.Schedule {
		return &schedulev1.Schedule{
			Id: id, VmId: "vm-" + id, Action: schedulev1.Action_ACTION_POWER_ON, Cron: "0 7 * * 1-5",
			TimeZone: "Europe/Budapest", Enabled: true, CatchUp: schedulev1.CatchUp_CATCH_UP_LATEST_ONCE,
			CatchUpWindow: durationpb.New(time.Hour), Overlap: schedulev1.Overlap_OVERLAP_FORBID,
		}
	}
	putSchedule := func(s *schedulev1.Schedule) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: s}}}
	}
	claim := func(slot *timestamppb.Timestamp, skipped ...*timestamppb.Timestamp) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{
			ScheduleId: "s1", Slot: slot, Node: "node-2", Skipped: skipped,
		}}}
	}
	placement := func(kind, id string) *fsmv1.Placement { return &fsmv1.Placement{Kind: kind, Id: id} }
	setPlacements := func(node string, full []string, upsert ...*fsmv1.Placement) *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{
			Node: node, Upsert: upsert, FullKinds: full,
		}}}
	}
	client := func(cmd *fsmv1.Command, id string, seq uint64) *fsmv1.Command {
		cmd.ClientId, cmd.Sequence = id, seq
		return cmd
	}

	webA := inst("web", "a")
	webA.Ttl = durationpb.New(10 * time.Second)
	api := inst("api", "x")
	api.Node, api.Meta, api.Tags = "node-3", map[string]string{"z": "1", "a": "2", "m": "3", "owner": "ops"}, nil
	s1 := schedule("s1")
	s1.HistoryLimit = 3
	certPEM, keyPEM := CA()
	steps := []Step{
		{Cmd: client(register(webA), "client-1", 1)},
		{Cmd: register(inst("web", "b"))},
		{Cmd: register(api)},
		{Cmd: client(&fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: "web", InstanceId: "a"}}}, "client-1", 2)},
		{Cmd: &fsmv1.Command{Op: &fsmv1.Command_SetServiceHealth{SetServiceHealth: &fsmv1.SetServiceHealth{
			Service: "web", InstanceId: "a", Health: clusterv1.Health_HEALTH_CRITICAL, LastHeartbeat: At(4),
		}}}},
		{Cmd: setConfig("routing.rules", `{"rules":[]}`)},
		{Cmd: client(setConfig("routing.rules", `{"rules":[{"prefix":"/"}]}`), "client-2", 1)},
		{Cmd: setConfig("log.level", "debug")},
		{Cmd: putSchedule(s1)},
		{Cmd: claim(At(100))},
		{Cmd: claim(At(400), At(200), At(300))},
		{Cmd: &fsmv1.Command{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: &schedulev1.Run{
			ScheduleId: "s1", Slot: At(400), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK, Attempts: 1, FinishedAt: At(20),
		}}}}},
		{Cmd: putSchedule(schedule("s2"))},
		// A rejected write leaves its outcome in its client's session.
		{Cmd: client(&fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: "missing"}}}, "client-3", 1), WantErr: "not_found"},
		// Format 2.
		{Cmd: &fsmv1.Command{Op: &fsmv1.Command_SetClusterCa{SetClusterCa: &fsmv1.SetClusterCA{CertPem: certPEM, KeyPem: keyPEM}}}},
		// Format 3: node-1's full listing of VMs, then node-2 takes one of
		// them (a migration) and reports a volume and a network.
		{Cmd: client(setPlacements("node-1", []string{"virtualmachines"},
			placement("virtualmachines", "vm-a"), placement("virtualmachines", "vm-b"), placement("volumes", "pool/disk 1")), "client-4", 1)},
		{Cmd: setPlacements("node-2", nil,
			placement("virtualmachines", "vm-b"), placement("volumes", "pool/disk 2"), placement("networks", "br0"))},
	}
	for i := range steps {
		steps[i].Cmd.Time = At(i + 1)
	}
	return steps
}
