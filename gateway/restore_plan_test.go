package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// TestRestorePlanKeepsPlacements: the placement catalog of a restored
// archive is not taken from it; the cluster keeps its own (what its
// nodes' backends hold now), and the plan reports no change of it and no
// resource for it.
func TestRestorePlanKeepsPlacements(t *testing.T) {
	state := func(node string, ids ...string) *fsm.FSM {
		f, err := fsm.New(fsm.LatestConfig())
		if err != nil {
			t.Fatal(err)
		}
		op := &fsmv1.SetPlacements{Node: node}
		for _, id := range ids {
			op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: "virtualmachines", Id: id})
		}
		data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.New(time.Unix(1_800_000_000, 0)), Op: &fsmv1.Command_SetPlacements{SetPlacements: op}})
		if err != nil {
			t.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			t.Fatal(res.Err)
		}
		return f
	}
	catalog := func(st *fsm.State) string {
		_, list, err := st.Placements("", nil)
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(list)
	}
	current := state("n1", "vm-a", "vm-b")
	archived := state("n9", "vm-z")
	var snap bytes.Buffer
	if err := archived.WriteSnapshot(&snap); err != nil {
		t.Fatal(err)
	}

	s := &SnapshotService{cfg: SnapshotServiceConfig{TempDir: t.TempDir()}}
	p, err := s.planRestore(context.Background(), &snap, current.State())
	if err != nil {
		t.Fatalf("planRestore: %v", err)
	}
	defer p.close()
	restored, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.Restore(io.NopCloser(p.state)); err != nil {
		t.Fatal(err)
	}
	if got, want := catalog(restored.State()), catalog(current.State()); got != want {
		t.Errorf("the restored catalog is %s, want the cluster's %s", got, want)
	}
	var found bool
	for _, ch := range p.plan.GetTables() {
		if ch.GetTable() != fsm.TablePlacements {
			continue
		}
		found = true
		if ch.GetRecords() != 2 || ch.GetAdded()+ch.GetRemoved()+ch.GetChanged() != 0 {
			t.Errorf("plan for %s: %v, want 2 records and no change", fsm.TablePlacements, ch)
		}
	}
	if !found {
		t.Errorf("the plan lists no change of %s", fsm.TablePlacements)
	}
	if len(p.plan.GetResources()) != 0 {
		t.Errorf("the plan names resources %v, want none", p.plan.GetResources())
	}
}
