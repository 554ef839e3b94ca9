package archive_test

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

var update = flag.Bool("update", false, "write the archive of the current format version into testdata (only when a new format version is released)")

// released lists every (archive format, state format) pair released; each
// has testdata/<dir>/snapshot.tar.gz, which this version must keep
// restoring. The last is the current one.
var released = []struct {
	archive, state uint32
	dir            string
}{
	{1, 1, "v1"},
	{1, 2, "v1-state2"},
	{1, 3, "v1-state3"},
	{1, 4, "v1-state4"},
	{1, 5, "v1-state5"},
}

// tableSince is the state format that added a table (those not listed
// exist since format 1).
var tableSince = map[string]uint32{fsm.TableCA: 2, fsm.TablePlacements: 3, fsm.TableSessions: 4, fsm.TableClusterVersion: 5}

// stateVersion is the cluster version whose states a state format holds:
// formats 1 and 2 are those of 0.0; 3 and 4 were written by builds before
// the first release, whose commands are those of the latest version; 5 is
// the latest version's.
func stateVersion(stateFormat uint32) fsm.Version {
	if stateFormat <= 2 {
		return fsm.Version0_0
	}
	return fsm.Latest
}

// compatState is the state every compatibility archive of a state format
// holds: a record in every table of that format.
func compatState(t *testing.T, stateFormat uint32) *fsm.FSM {
	t.Helper()
	cfg := fsm.DefaultConfig()
	cfg.InitialVersion = stateVersion(stateFormat)
	f, err := fsm.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	ts := func(sec int) *timestamppb.Timestamp { return timestamppb.New(t0.Add(time.Duration(sec) * time.Second)) }
	cmds := []*fsmv1.Command{
		{ClientId: "pvcli-1", Sequence: 1, Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: &clusterv1.ServiceInstance{
			Service: "web", InstanceId: "web-1", Node: "node1", Address: "10.0.0.1", Port: 8080,
			Tags: []string{"blue"}, Meta: map[string]string{"owner": "ops"}, Ttl: durationpb.New(30 * time.Second),
		}}}},
		{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: "log.level", Value: "debug"}}},
		{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: "log.level", Value: "info"}}},
		{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: &schedulev1.Schedule{
			Id: "s1", VmId: "vm-1", Action: schedulev1.Action_ACTION_POWER_ON, Cron: "0 7 * * 1-5", TimeZone: "Europe/Budapest",
			Enabled: true, CatchUp: schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, CatchUpWindow: durationpb.New(time.Hour),
			Overlap: schedulev1.Overlap_OVERLAP_FORBID, HistoryLimit: 10,
		}}}},
		{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{ScheduleId: "s1", Slot: ts(3600), Node: "node1"}}},
		{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: &schedulev1.Run{
			ScheduleId: "s1", Slot: ts(3600), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK, Attempts: 1, FinishedAt: ts(3601),
		}}}},
	}
	if stateFormat >= 2 {
		certPEM, keyPEM := fsmtest.CA()
		cmds = append(cmds, &fsmv1.Command{Op: &fsmv1.Command_SetClusterCa{SetClusterCa: &fsmv1.SetClusterCA{CertPem: certPEM, KeyPem: keyPEM}}})
	}
	if stateFormat >= 3 {
		cmds = append(cmds, &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{
			Node: "node1", FullKinds: []string{"virtualmachines"},
			Upsert: []*fsmv1.Placement{{Kind: "virtualmachines", Id: "vm-1"}, {Kind: "volumes", Id: "pool/vm-1-disk0"}},
		}}})
	}
	for i, cmd := range cmds {
		cmd.Time = ts(i)
		data, err := fsm.Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			t.Fatalf("command %d: %v", i, res.Err)
		}
	}
	return f
}

// TestCompatibleArchives restores the archive of every released format
// version and checks what it holds. With -update it first writes the
// archive of the current version.
func TestCompatibleArchives(t *testing.T) {
	cur := released[len(released)-1]
	if *update {
		f := compatState(t, fsm.SnapshotFormatVersion)
		var st bytes.Buffer
		if err := f.WriteSnapshot(&st); err != nil {
			t.Fatal(err)
		}
		meta := archive.Meta{
			ID: "1-6-1796040000000", Index: 6, Term: 1, ClusterID: "3f0c6a52-5d0e-4c53-9a53-2a4f7c1d9e10",
			AgentVersion: "0.1.0", Size: int64(st.Len()), CreatedAt: time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC),
		}
		path := filepath.Join("testdata", cur.dir, "snapshot.tar.gz")
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := archive.Write(out, meta, &st); err != nil {
			t.Fatal(err)
		}
		if err := out.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if cur.archive != archive.FormatVersion || cur.state != fsm.SnapshotFormatVersion {
		t.Fatalf("archive format %d with state format %d is not the last of released: add it and its testdata (go test -run Compatible -update)",
			archive.FormatVersion, fsm.SnapshotFormatVersion)
	}
	for _, rel := range released {
		t.Run(rel.dir, func(t *testing.T) {
			want := compatState(t, rel.state)
			file, err := os.ReadFile(filepath.Join("testdata", rel.dir, "snapshot.tar.gz"))
			if err != nil {
				t.Fatal(err)
			}
			info, err := archive.Verify(bytes.NewReader(file))
			if err != nil {
				t.Fatalf("Verify: %v", err)
			}
			if info.Meta.FormatVersion != rel.archive || info.Meta.StateFormatVersion != rel.state {
				t.Errorf("format versions %d/%d, want %d/%d", info.Meta.FormatVersion, info.Meta.StateFormatVersion, rel.archive, rel.state)
			}
			rd, err := archive.NewReader(bytes.NewReader(file))
			if err != nil {
				t.Fatal(err)
			}
			st, err := rd.State()
			if err != nil {
				t.Fatal(err)
			}
			f, err := fsm.New(fsm.LatestConfig())
			if err != nil {
				t.Fatal(err)
			}
			if err := f.Restore(readCloser{st}); err != nil {
				t.Fatalf("Restore: %v", err)
			}
			if err := rd.Close(); err != nil {
				t.Fatal(err)
			}
			for _, tb := range info.State.Tables {
				// From state format 4 on, Raft mode keeps sessions, and
				// dedupe records only come from etcd mode.
				if tb.Records == 0 && (tb.Name != fsm.TableDedupe || rel.state < 4) && (tb.Name != fsm.TableSessions || rel.state >= 5) {
					t.Errorf("table %s is empty in the archive: the compatibility state should fill every table", tb.Name)
				}
			}
			var tables int
			for _, name := range fsm.Tables() {
				if tableSince[name] <= rel.state {
					tables++
				}
			}
			if len(info.State.Tables) != tables {
				t.Errorf("archive holds %d tables, state format %d has %d", len(info.State.Tables), rel.state, tables)
			}
			// The restored state is what the commands build today, the
			// dedupe records (an older state's, which become sessions) and
			// sessions apart: the operation digest they keep may change
			// definition (fsm DESIGN.md "Dedupe"); the outcome of the one
			// identified write must be there.
			var got, exp bytes.Buffer
			if err := f.WriteSnapshot(&got); err != nil {
				t.Fatal(err)
			}
			if err := want.WriteSnapshot(&exp); err != nil {
				t.Fatal(err)
			}
			// A state of a format no release writes (3, 4) holds dedupe
			// records or sessions where the latest version has the
			// version record too: the index rows differ as well.
			drop := []string{fsm.TableDedupe, fsm.TableSessions}
			if rel.state == 3 || rel.state == 4 {
				drop = append(drop, fsm.TableClusterVersion, fsm.TableIndex)
			}
			gotH, err := fsm.HashSnapshot(&got)
			if err != nil {
				t.Fatal(err)
			}
			expH, err := fsm.HashSnapshot(&exp)
			if err != nil {
				t.Fatal(err)
			}
			if d := gotH.Differ(expH, drop...); len(d) > 0 {
				t.Errorf("the restored %s state differs from the state its commands build now in %v", rel.dir, d)
			}
			if res, err := f.State().WriteOutcome("pvcli-1", 1); res == nil || res.Err != nil || err != nil {
				t.Errorf("the restored %s state's dedupe record of pvcli-1/1: %+v (%v); want a success", rel.dir, res, err)
			}
			inst, err := f.State().Service("web", "web-1")
			if err != nil || inst.GetMeta()["owner"] != "ops" {
				t.Errorf("restored instance web/web-1 = %v, %v", inst, err)
			}
			if _, err := f.State().Service("web", "missing"); !errors.Is(err, fsm.ErrNotFound) {
				t.Errorf("lookup of a missing instance: %v", err)
			}
		})
	}
}

type readCloser struct {
	r interface{ Read([]byte) (int, error) }
}

func (r readCloser) Read(p []byte) (int, error) { return r.r.Read(p) }
func (readCloser) Close() error                 { return nil }
