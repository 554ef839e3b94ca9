package fsm

import (
	"bytes"
	"encoding/hex"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// t0 is the leader time of the first command in tests.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// at returns t0 plus sec seconds as a timestamp.
func at(sec int) *timestamppb.Timestamp {
	return timestamppb.New(t0.Add(time.Duration(sec) * time.Second))
}

// harness applies commands to an FSM with increasing indexes and a
// controllable leader clock.
type harness struct {
	t     testing.TB
	f     *FSM
	index uint64
	now   time.Time
}

func newHarness(t testing.TB, mods ...func(*Config)) *harness {
	t.Helper()
	cfg := testConfig()
	for _, m := range mods {
		m(&cfg)
	}
	f, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return &harness{t: t, f: f, now: t0}
}

// raw applies raw log data at the next index.
func (h *harness) raw(data []byte) *Result {
	h.t.Helper()
	h.index++
	out := h.f.Apply(&raft.Log{Index: h.index, Term: 1, Type: raft.LogCommand, Data: data})
	res, ok := out.(*Result)
	if !ok || res == nil {
		h.t.Fatalf("Apply returned %T (%v), want *Result", out, out)
	}
	return res
}

// apply stamps cmd with the harness time when it has none, encodes and
// applies it at the next index.
func (h *harness) apply(cmd *fsmv1.Command) *Result {
	h.t.Helper()
	if cmd.Time == nil {
		cmd.Time = timestamppb.New(h.now)
	}
	data, err := Encode(cmd)
	if err != nil {
		h.t.Fatalf("Encode: %v", err)
	}
	return h.raw(data)
}

// mustApply applies cmd and fails the test on an error outcome.
func (h *harness) mustApply(cmd *fsmv1.Command) *Result {
	h.t.Helper()
	res := h.apply(cmd)
	if res.Err != nil {
		h.t.Fatalf("apply %v: %v", cmd, res.Err)
	}
	return res
}

// snapshot returns the snapshot bytes of the harness FSM.
func (h *harness) snapshot() []byte {
	h.t.Helper()
	return snapshotBytes(h.t, h.f)
}

func snapshotBytes(t testing.TB, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	defer snap.Release()
	sink := &memSink{}
	if err := snap.Persist(sink); err != nil {
		t.Fatalf("Persist: %v", err)
	}
	if !sink.closed || sink.cancelled {
		t.Fatalf("Persist: sink closed=%v cancelled=%v, want closed only", sink.closed, sink.cancelled)
	}
	return sink.Bytes()
}

// dumpTables returns every table's records, encoded, in index order.
func dumpTables(t testing.TB, f *FSM) map[string][]string {
	t.Helper()
	return dumpTablesWith(t, f, false)
}

// dumpTablesWith is dumpTables; with noDigests the dedupe records' operation
// digests and values are left out (the digest's definition may change, fsm
// DESIGN.md "Dedupe", and records of older versions keep no value).
func dumpTablesWith(t testing.TB, f *FSM, noDigests bool) map[string][]string {
	t.Helper()
	txn := f.State().txn
	out := make(map[string][]string)
	for _, td := range tableDefs {
		it, err := tget(txn, td.name, indexID)
		if err != nil {
			t.Fatalf("read %s: %v", td.name, err)
		}
		out[td.name] = []string{}
		for obj := it.Next(); obj != nil; obj = it.Next() {
			if rec, ok := obj.(*fsmv1.DedupeRecord); ok && noDigests {
				rec = proto.CloneOf(rec)
				rec.OpDigest = nil
				rec.Value = nil
				obj = rec
			}
			if s, ok := obj.(*session); ok && noDigests {
				c := *s
				c.outcomes = slices.Clone(s.outcomes)
				for i := range c.outcomes {
					c.outcomes[i].digest, c.outcomes[i].value = 0, nil
				}
				obj = &c
			}
			b, err := td.codec.encode(nil, obj)
			if err != nil {
				t.Fatalf("encode %s: %v", td.name, err)
			}
			out[td.name] = append(out[td.name], hex.EncodeToString(b))
		}
	}
	return out
}

// memSink is an in-memory raft.SnapshotSink.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
	failWrites        bool
}

var _ raft.SnapshotSink = (*memSink)(nil)

func (s *memSink) Write(p []byte) (int, error) {
	if s.failWrites {
		return 0, errors.New("disk full")
	}
	return s.Buffer.Write(p)
}
func (s *memSink) ID() string    { return "test" }
func (s *memSink) Close() error  { s.closed = true; return nil }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }

// Command builders.

func instance(service, id string) *clusterv1.ServiceInstance {
	return &clusterv1.ServiceInstance{
		Service:    service,
		InstanceId: id,
		Node:       "node-1",
		Address:    "10.0.0.1",
		Port:       8080,
		Tags:       []string{"a", "b"},
		Meta:       map[string]string{"k1": "v1", "k2": "v2", "k3": "v3"},
	}
}

func register(inst *clusterv1.ServiceInstance) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: inst}}}
}

func registerTTL(service, id string, ttl time.Duration) *fsmv1.Command {
	in := instance(service, id)
	in.Ttl = durationpb.New(ttl)
	return register(in)
}

func deregister(service, id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{DeregisterService: &fsmv1.DeregisterService{Service: service, InstanceId: id}}}
}

func heartbeat(service, id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: service, InstanceId: id}}}
}

func setHealth(service, id string, h clusterv1.Health, last *timestamppb.Timestamp) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetServiceHealth{SetServiceHealth: &fsmv1.SetServiceHealth{
		Service: service, InstanceId: id, Health: h, LastHeartbeat: last,
	}}}
}

func setConfig(key, value string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: value}}}
}

func setConfigCAS(key, value string, cas uint64) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: value, CasRevision: &cas}}}
}

func deleteConfig(key string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: key}}}
}

func deleteConfigCAS(key string, cas uint64) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: key, CasRevision: &cas}}}
}

func schedule(id string) *schedulev1.Schedule {
	return &schedulev1.Schedule{
		Id:            id,
		VmId:          "vm-" + id,
		Action:        schedulev1.Action_ACTION_POWER_ON,
		Cron:          "0 7 * * 1-5",
		TimeZone:      "Europe/Budapest",
		Enabled:       true,
		CatchUp:       schedulev1.CatchUp_CATCH_UP_LATEST_ONCE,
		CatchUpWindow: durationpb.New(time.Hour),
		Overlap:       schedulev1.Overlap_OVERLAP_FORBID,
	}
}

func putSchedule(s *schedulev1.Schedule) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: s}}}
}

func putScheduleCAS(s *schedulev1.Schedule, cas uint64) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: s, CasRevision: &cas}}}
}

func deleteSchedule(id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeleteSchedule{DeleteSchedule: &fsmv1.DeleteSchedule{Id: id}}}
}

func claim(id string, slot *timestamppb.Timestamp, skipped ...*timestamppb.Timestamp) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{
		ScheduleId: id, Slot: slot, Node: "node-2", Skipped: skipped,
	}}}
}

func recordRun(r *schedulev1.Run) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: r}}}
}

// withClient sets the dedupe identity of cmd.
func withClient(cmd *fsmv1.Command, client string, seq uint64) *fsmv1.Command {
	cmd.ClientId = client
	cmd.Sequence = seq
	return cmd
}

// testCA returns the PEM of the committed test CA (fsmtest.CA).
func testCA(testing.TB) (certPEM, keyPEM []byte) { return fsmtest.CA() }

func setClusterCA(certPEM, keyPEM []byte) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetClusterCa{SetClusterCa: &fsmv1.SetClusterCA{CertPem: certPEM, KeyPem: keyPEM}}}
}

// testConfig is DefaultConfig with a state that starts at the latest
// cluster version, as a new cluster's is once its leader set it.
func testConfig() Config {
	c := DefaultConfig()
	c.InitialVersion = Latest
	return c
}
