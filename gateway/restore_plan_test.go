package gateway

import (
	"bytes"
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
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

// TestRestorePlanDecidesEveryTable: the restore plan has a decision for
// every table of the state, so that no table is changed by a restore
// without a right and a check. Each table (but the index table, the FSM's
// own bookkeeping) is probed: the cluster holds the table's records of
// fsmtest.FullState and the archive none. Either the cluster keeps its own
// (planRestore's list of this cluster's tables: nothing changes, and no
// resource guards it), or the restore takes the archive's and then the
// caller needs a resource on it (resourceOf, the plan's resources) and
// each record is checked by its write path's rules (checkRestored refuses
// a record with no fields), unless unchecked says why not. Every table
// restore_plan.go names is a table of the state.
func TestRestorePlanDecidesEveryTable(t *testing.T) {
	// Tables a restore takes from the archive without a write path's check.
	unchecked := map[string]string{
		fsm.TableScheduleRuns: "no API writes runs, only the scheduler (ClaimSlot, RecordRun, checked by the FSM); a restore needs the rights on schedules",
	}

	full, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range fsmtest.FullState() {
		data, err := fsm.Encode(st.Cmd)
		if err != nil {
			t.Fatal(err)
		}
		if res := full.Apply(&raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil && st.WantErr == "" {
			t.Fatalf("FullState step %d: %v", i, res.Err)
		}
	}
	samples := map[string][]proto.Message{
		// Raft mode keeps sessions; etcd mode's dedupe records are not
		// in FullState at the latest version.
		fsm.TableDedupe: {&fsmv1.DedupeRecord{ClientId: "c1", Sequence: 1, Time: timestamppb.New(time.Unix(1_800_000_000, 0))}},
	}
	stateOf := func(table string, recs []proto.Message) *fsm.FSM {
		t.Helper()
		f, err := fsm.New(fsm.LatestConfig())
		if err != nil {
			t.Fatal(err)
		}
		var trs []fsm.TableRecord
		for _, r := range recs {
			trs = append(trs, fsm.TableRecord{Table: table, Record: r})
		}
		if err := f.Replace(100, trs); err != nil {
			t.Fatal(err)
		}
		return f
	}
	var empty bytes.Buffer
	if err := stateOf("", nil).WriteSnapshot(&empty); err != nil {
		t.Fatal(err)
	}
	s := &SnapshotService{cs: &ClusterService{}, cfg: SnapshotServiceConfig{TempDir: t.TempDir()}}

	for _, table := range fsm.Tables() {
		if table == fsm.TableIndex {
			continue // the FSM's own: planRestore skips it, every restore moves it on
		}
		t.Run(table, func(t *testing.T) {
			recs := samples[table]
			if recs == nil {
				var err error
				if recs, err = full.State().Records(table); err != nil {
					t.Fatal(err)
				}
			}
			if len(recs) == 0 {
				t.Fatalf("no record of %s in fsmtest.FullState to probe the restore plan with", table)
			}
			current := stateOf(table, recs)
			p, err := s.planRestore(t.Context(), bytes.NewReader(empty.Bytes()), current.State())
			if err != nil {
				t.Fatalf("planRestore: %v", err)
			}
			defer p.close()
			var ch *clusterv1.TableChange
			for _, c := range p.plan.GetTables() {
				if c.GetTable() == table {
					ch = c
				}
			}
			if ch == nil {
				t.Fatalf("the plan has no entry of %s", table)
			}
			_, exempt := unchecked[table]
			switch {
			case ch.GetAdded()+ch.GetRemoved()+ch.GetChanged() == 0:
				// Kept: the cluster's own records, whatever the archive holds.
				if r := resourceOf(table); r != "" {
					t.Errorf("kept by a restore, yet guarded as %q: one decision, not two", r)
				}
				if exempt {
					t.Errorf("kept by a restore, yet listed as restored unchecked")
				}
			case ch.GetRemoved() == uint64(len(recs)):
				// Taken from the archive: a right and a check.
				if r := resourceOf(table); r == "" || len(p.plan.GetResources()) == 0 {
					t.Errorf("a restore changes %s with no right needed (resourceOf %q, plan resources %v): name its resource in resourceOf, or keep the cluster's own in planRestore", table, r, p.plan.GetResources())
				}
				zero := recs[0].ProtoReflect().New().Interface()
				_, err := s.checkRestored(t.Context(), table, zero, current.State(), &clusterv1.RestorePlan{})
				switch {
				case err == nil && !exempt:
					t.Errorf("a restore takes %s unchecked (checkRestored passes a %T with no fields): check it by its write path's rules in checkRestored, or keep the cluster's own in planRestore", table, zero)
				case err != nil && exempt:
					t.Errorf("checked (%v), yet listed as unchecked: remove it from the list", err)
				}
			default:
				t.Errorf("plan %v: the restore neither keeps the cluster's %d records nor takes the archive's", ch, len(recs))
			}
		})
	}
	for table := range unchecked {
		if !slices.Contains(fsm.Tables(), table) {
			t.Errorf("unchecked names %q, no table of the state", table)
		}
	}

	// The tables restore_plan.go names (fsm.Table… constants) are tables
	// of the state.
	fset := token.NewFileSet()
	consts := map[string]string{}
	files, err := filepath.Glob(filepath.Join("..", "fsm", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.CONST {
				for _, spec := range g.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, id := range vs.Names {
						if lit, ok := valueAt(vs, i).(*ast.BasicLit); ok && lit.Kind == token.STRING && strings.HasPrefix(id.Name, "Table") {
							consts[id.Name], _ = strconv.Unquote(lit.Value)
						}
					}
				}
			}
		}
	}
	if len(consts) == 0 {
		t.Fatal("no fsm.Table… constants found")
	}
	plan, err := parser.ParseFile(fset, "restore_plan.go", nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	named := 0
	ast.Inspect(plan, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "fsm" {
			return true
		}
		value, ok := consts[sel.Sel.Name]
		if !ok {
			return true
		}
		named++
		if !slices.Contains(fsm.Tables(), value) {
			t.Errorf("%s: fsm.%s (%q) is no table of the state (fsm.Tables: %v)", fset.Position(sel.Pos()), sel.Sel.Name, value, fsm.Tables())
		}
		return true
	})
	if named == 0 {
		t.Error("restore_plan.go names no fsm.Table… constant: is the plan elsewhere?")
	}
}

// valueAt is the i-th value of a const spec (nil when it has none).
func valueAt(vs *ast.ValueSpec, i int) ast.Expr {
	if i < len(vs.Values) {
		return vs.Values[i]
	}
	return nil
}
