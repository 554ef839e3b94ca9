package fsm

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-memdb"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

const (
	kindVM  = "virtualmachines"
	kindVol = "volumes"
	kindNet = "networks"
)

func placement(kind, id string) *fsmv1.Placement { return &fsmv1.Placement{Kind: kind, Id: id} }

// setPlacements is node's set_placements with the given upserts, a full
// listing of the kinds of full.
func setPlacements(node string, full []string, upsert ...*fsmv1.Placement) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{
		Node: node, Upsert: upsert, FullKinds: full,
	}}}
}

// deletePlacements is node's set_placements deleting the given entries.
func deletePlacements(node string, del ...*fsmv1.Placement) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{Node: node, Delete: del}}}
}

// catalog renders the whole placement catalog as "kind/id@node", in key
// order.
func catalog(t *testing.T, st *State) []string {
	t.Helper()
	_, list, err := st.Placements("", nil)
	if err != nil {
		t.Fatalf("Placements: %v", err)
	}
	out := []string{}
	for _, p := range list {
		out = append(out, p.GetKind()+"/"+p.GetId()+"@"+p.GetNode())
	}
	return out
}

// wantCatalog checks the catalog after the command, and that the table's
// index is the command's when it changed the catalog (moved, else it stays
// at the index of the last setup command that changed it: pass it).
func wantCatalog(moved bool, want ...string) func(t *testing.T, h *harness, res *Result) {
	return func(t *testing.T, h *harness, res *Result) {
		t.Helper()
		if want == nil {
			want = []string{}
		}
		st := h.f.State()
		if got := catalog(t, st); !reflect.DeepEqual(got, want) {
			t.Errorf("catalog = %q, want %q", got, want)
		}
		if res.Value != nil {
			t.Errorf("Result.Value = %v, want nil", res.Value)
		}
		if got := st.Index(TablePlacements); (got == res.Index) != moved {
			t.Errorf("index of %s = %d with the command at %d: moved %v, want %v", TablePlacements, got, res.Index, got == res.Index, moved)
		}
	}
}

func TestSetPlacements(t *testing.T) {
	// n1 holds VMs a and b and volume x; n2 holds VM c.
	base := []*fsmv1.Command{
		setPlacements("n1", nil, placement(kindVM, "a"), placement(kindVM, "b"), placement(kindVol, "x")),
		setPlacements("n2", nil, placement(kindVM, "c")),
	}
	many := make([]*fsmv1.Placement, MaxPlacementsPerCommand+1)
	for i := range many {
		many[i] = placement(kindVM, fmt.Sprint("vm-", i))
	}
	withDelete := func(cmd *fsmv1.Command, del ...*fsmv1.Placement) *fsmv1.Command {
		cmd.GetSetPlacements().Delete = del
		return cmd
	}
	runApplyCases(t, []applyCase{
		{name: "upsert into an empty catalog", cmd: setPlacements("n1", nil, placement(kindVM, "a"), placement(kindNet, "br0"), placement(kindVol, "pool/disk 1")),
			check: wantCatalog(true, "networks/br0@n1", "virtualmachines/a@n1", "volumes/pool/disk 1@n1")},
		{name: "the upsert's own node is ignored", cmd: setPlacements("n1", nil, &fsmv1.Placement{Kind: kindVM, Id: "a", Node: "elsewhere"}),
			check: wantCatalog(true, "virtualmachines/a@n1")},
		{name: "upsert adds to what the node holds", setup: base, cmd: setPlacements("n1", nil, placement(kindVM, "d")),
			check: wantCatalog(true, "virtualmachines/a@n1", "virtualmachines/b@n1", "virtualmachines/c@n2", "virtualmachines/d@n1", "volumes/x@n1")},
		{name: "an object moves to the node that reports it", setup: base, cmd: setPlacements("n2", nil, placement(kindVM, "a")),
			check: func(t *testing.T, h *harness, res *Result) {
				wantCatalog(true, "virtualmachines/a@n2", "virtualmachines/b@n1", "virtualmachines/c@n2", "volumes/x@n1")(t, h, res)
				n1, err := h.f.State().PlacementsByNode("n1")
				if err != nil || len(n1) != 2 || n1[0].GetId() != "b" || n1[1].GetId() != "x" {
					t.Errorf("PlacementsByNode(n1) = %v, %v; want VM b and volume x", n1, err)
				}
			}},
		{name: "a full listing removes only the node's entries of that kind", setup: base, cmd: setPlacements("n1", []string{kindVM}, placement(kindVM, "a")),
			check: wantCatalog(true, "virtualmachines/a@n1", "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "an empty full listing empties the node's kind", setup: base, cmd: setPlacements("n1", []string{kindVM, kindNet}),
			check: wantCatalog(true, "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "a full listing takes over another node's object", setup: base, cmd: setPlacements("n2", []string{kindVM}, placement(kindVM, "a")),
			check: wantCatalog(true, "virtualmachines/a@n2", "virtualmachines/b@n1", "volumes/x@n1")},
		{name: "a full listing with a delete of the same kind", setup: base, cmd: withDelete(setPlacements("n1", []string{kindVM}, placement(kindVM, "a")), placement(kindVM, "b")),
			check: wantCatalog(true, "virtualmachines/a@n1", "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "delete by the holder", setup: base, cmd: deletePlacements("n1", placement(kindVM, "a"), placement(kindVol, "x")),
			check: wantCatalog(true, "virtualmachines/b@n1", "virtualmachines/c@n2")},
		{name: "delete of another node's object or a missing one is ignored", setup: base, cmd: deletePlacements("n1", placement(kindVM, "c"), placement(kindVM, "missing"), placement(kindNet, "x")),
			check: wantCatalog(false, "virtualmachines/a@n1", "virtualmachines/b@n1", "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "delete after the object moved away", setup: append(base, setPlacements("n2", nil, placement(kindVM, "a"))), cmd: deletePlacements("n1", placement(kindVM, "a")),
			check: wantCatalog(false, "virtualmachines/a@n2", "virtualmachines/b@n1", "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "a repeat in a list counts once", setup: base, cmd: withDelete(setPlacements("n1", []string{kindVM}, placement(kindVM, "d"), placement(kindVM, "a"), placement(kindVM, "d")), placement(kindVol, "x"), placement(kindVol, "x")),
			check: wantCatalog(true, "virtualmachines/a@n1", "virtualmachines/c@n2", "virtualmachines/d@n1")},
		{name: "a repeated delete of a listed kind", setup: base, cmd: withDelete(setPlacements("n1", []string{kindVM}), placement(kindVM, "b"), placement(kindVM, "b")),
			check: wantCatalog(true, "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "an unchanged listing writes nothing", setup: base, cmd: setPlacements("n1", []string{kindVM, kindVol}, placement(kindVol, "x"), placement(kindVM, "b"), placement(kindVM, "a")),
			check: wantCatalog(false, "virtualmachines/a@n1", "virtualmachines/b@n1", "virtualmachines/c@n2", "volumes/x@n1")},
		{name: "the maximum", cmd: setPlacements("n1", nil, many[:MaxPlacementsPerCommand]...), check: func(t *testing.T, h *harness, res *Result) {
			if n := len(catalog(t, h.f.State())); n != MaxPlacementsPerCommand {
				t.Errorf("%d entries, want %d", n, MaxPlacementsPerCommand)
			}
		}},

		{name: "no node", setup: base, cmd: setPlacements("", nil, placement(kindVM, "a")), wantErr: ErrInvalidCommand, check: wantField("set_placements.node")},
		{name: "node with a control character", setup: base, cmd: setPlacements("n\x001", nil), wantErr: ErrInvalidCommand, check: wantField("set_placements.node")},
		{name: "node too long", setup: base, cmd: setPlacements(strings.Repeat("n", MaxIDLength+1), nil), wantErr: ErrInvalidCommand, check: wantField("set_placements.node")},
		{name: "unknown kind", setup: base, cmd: setPlacements("n1", []string{kindVM}, placement(kindVM, "a"), placement("pods", "p")), wantErr: ErrInvalidCommand, check: wantField("set_placements.upsert[1].kind")},
		{name: "no kind", setup: base, cmd: deletePlacements("n1", placement("", "a")), wantErr: ErrInvalidCommand, check: wantField("set_placements.delete[0].kind")},
		{name: "no id", setup: base, cmd: setPlacements("n1", []string{kindVM}, placement(kindVM, "")), wantErr: ErrInvalidCommand, check: wantField("set_placements.upsert[0].id")},
		{name: "id with a NUL", setup: base, cmd: deletePlacements("n1", placement(kindVM, "a"), placement(kindVM, "b\x00")), wantErr: ErrInvalidCommand, check: wantField("set_placements.delete[1].id")},
		{name: "id too long", setup: base, cmd: setPlacements("n1", nil, placement(kindVM, strings.Repeat("x", MaxIDLength+1))), wantErr: ErrInvalidCommand, check: wantField("set_placements.upsert[0].id")},
		{name: "too many", setup: base, cmd: withDelete(setPlacements("n1", []string{kindVM}, many[:MaxPlacementsPerCommand]...), placement(kindVM, "a")), wantErr: ErrInvalidCommand, check: wantField("at most 10000")},
		{name: "unknown full kind", setup: base, cmd: setPlacements("n1", []string{kindVM, "pods"}), wantErr: ErrInvalidCommand, check: wantField("set_placements.full_kinds[1]")},
		{name: "full kind twice", setup: base, cmd: setPlacements("n1", []string{kindVol, kindVM, kindVol}), wantErr: ErrInvalidCommand, check: wantField("set_placements.full_kinds[2]")},
		{name: "upserted and deleted", setup: base, cmd: withDelete(setPlacements("n1", nil, placement(kindVM, "d")), placement(kindVM, "d")), wantErr: ErrInvalidCommand, check: wantField("set_placements.delete[0]")},
		{name: "upserted and deleted, in another kind too", setup: base, cmd: withDelete(setPlacements("n1", nil, placement(kindVol, "d"), placement(kindVM, "d")), placement(kindNet, "d"), placement(kindVM, "d")), wantErr: ErrInvalidCommand, check: wantField("set_placements.delete[1]")},
		{name: "an invalid entry after a repeat", setup: base, cmd: setPlacements("n1", nil, placement(kindVM, "d"), placement(kindVM, "d"), placement(kindVM, "")), wantErr: ErrInvalidCommand, check: wantField("set_placements.upsert[2].id")},
	})
}

// TestSetPlacementsUnchangedIsCheap: a listing that matches the catalog
// commits nothing (no watcher wakes, no index moves); with a client ID
// only its dedupe record is written.
func TestSetPlacementsUnchangedIsCheap(t *testing.T) {
	h := newHarness(t)
	listing := func() *fsmv1.Command {
		return setPlacements("n1", []string{kindVM, kindVol}, placement(kindVM, "a"), placement(kindVol, "x"))
	}
	h.mustApply(listing())
	h.mustApply(setPlacements("n2", nil, placement(kindVM, "b")))
	st := h.f.State()
	wantIndex := st.Index(TablePlacements)
	if wantIndex != 2 {
		t.Fatalf("index of %s = %d, want 2", TablePlacements, wantIndex)
	}
	ws := memdb.NewWatchSet()
	if _, err := st.WatchTables(ws, TablePlacements); err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Placements("", ws); err != nil {
		t.Fatal(err)
	}
	before := h.snapshot()

	h.now = h.now.Add(time.Second)
	h.mustApply(listing())
	if !bytes.Equal(h.snapshot()[8:], before[8:]) {
		// Only the header's last index may differ.
		hdrBefore, _ := ReadSnapshotHeader(bytes.NewReader(before))
		hdrAfter, _ := ReadSnapshotHeader(bytes.NewReader(h.snapshot()))
		if !reflect.DeepEqual(hdrBefore.GetTables(), hdrAfter.GetTables()) {
			t.Errorf("an unchanged listing changed the state")
		}
	}
	if h.f.State() == nil || h.f.AppliedIndex() != 3 {
		t.Errorf("AppliedIndex = %d, want 3", h.f.AppliedIndex())
	}
	h.mustApply(withClient(listing(), "agent-n1", 1))
	if got := h.f.State().Index(TablePlacements); got != wantIndex {
		t.Errorf("index of %s = %d after unchanged listings, want %d", TablePlacements, got, wantIndex)
	}
	if got := h.f.State().Index(TableSessions); got != 4 {
		t.Errorf("index of %s = %d, want 4 (the identified listing's outcome)", TableSessions, got)
	}
	if !ws.Watch(time.After(20 * time.Millisecond)) {
		t.Errorf("a watcher of the placements woke on unchanged listings")
	}
	// A change wakes it.
	h.mustApply(setPlacements("n1", nil, placement(kindNet, "br0")))
	if ws.Watch(time.After(5 * time.Second)) {
		t.Errorf("a watcher of the placements did not wake on a change")
	}
}

func TestPlacementQueries(t *testing.T) {
	h := newHarness(t)
	h.mustApply(setPlacements("n1", nil, placement(kindVM, "a"), placement(kindVol, "v"), placement(kindNet, "br0")))
	h.mustApply(setPlacements("n2", nil, placement(kindVM, "b"), placement(kindVM, "a0")))
	h.mustApply(setPlacements("n10", nil, placement(kindVM, "c")))
	st := h.f.State()

	p, err := st.Placement(kindVM, "a")
	if err != nil || p.GetNode() != "n1" || p.GetKind() != kindVM || p.GetId() != "a" {
		t.Errorf("Placement(vm a) = %v, %v", p, err)
	}
	for _, miss := range [][2]string{{kindVM, "missing"}, {kindVol, "a"}, {"", "a"}, {kindVM, ""}} {
		if p, err := st.Placement(miss[0], miss[1]); p != nil || err != nil {
			t.Errorf("Placement(%q, %q) = %v, %v; want nil, nil", miss[0], miss[1], p, err)
		}
	}
	ids := func(list []*fsmv1.Placement) []string {
		out := []string{}
		for _, p := range list {
			out = append(out, p.GetKind()+"/"+p.GetId())
		}
		return out
	}
	idx, vms, err := st.Placements(kindVM, nil)
	if err != nil || idx != 3 || !reflect.DeepEqual(ids(vms), []string{"virtualmachines/a", "virtualmachines/a0", "virtualmachines/b", "virtualmachines/c"}) {
		t.Errorf("Placements(vms) = %d, %q, %v", idx, ids(vms), err)
	}
	if _, list, err := st.Placements("volume", nil); err != nil || len(list) != 0 {
		t.Errorf("Placements of a kind's prefix = %v, %v; want none", list, err)
	}
	if _, all, err := st.Placements("", nil); err != nil || len(all) != 6 {
		t.Errorf("Placements(\"\") = %d entries, %v; want 6", len(all), err)
	}
	for node, want := range map[string][]string{
		"n1":  {"networks/br0", "virtualmachines/a", "volumes/v"},
		"n2":  {"virtualmachines/a0", "virtualmachines/b"},
		"n10": {"virtualmachines/c"},
		"n":   {},
		"":    {},
	} {
		got, err := st.PlacementsByNode(node)
		if err != nil || !reflect.DeepEqual(ids(got), want) {
			t.Errorf("PlacementsByNode(%q) = %q, %v; want %q", node, ids(got), err, want)
		}
	}
}

// TestPlacementsSnapshotRoundTrip: the catalog, its node index and its
// table index survive a snapshot and restore, and the restored catalog
// keeps working (a full listing there removes the same entries).
func TestPlacementsSnapshotRoundTrip(t *testing.T) {
	src := newHarness(t)
	src.mustApply(setPlacements("n1", nil, placement(kindVM, "a"), placement(kindVM, "b"), placement(kindVol, "x")))
	src.mustApply(setPlacements("n2", nil, placement(kindVM, "b"), placement(kindNet, "br0")))
	src.mustApply(register(instance("web", "a")))
	snap := src.snapshot()
	if v, _ := ReadSnapshotHeader(bytes.NewReader(snap)); v.GetFormatVersion() != SnapshotFormatVersion {
		t.Fatalf("format %d, want %d", v.GetFormatVersion(), SnapshotFormatVersion)
	}

	dst := newHarness(t)
	dst.mustApply(setPlacements("n3", nil, placement(kindVM, "old")))
	if err := dst.f.Restore(readCloser(snap)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	st := dst.f.State()
	want := []string{"networks/br0@n2", "virtualmachines/a@n1", "virtualmachines/b@n2", "volumes/x@n1"}
	if got := catalog(t, st); !reflect.DeepEqual(got, want) {
		t.Errorf("restored catalog = %q, want %q", got, want)
	}
	if got := st.Index(TablePlacements); got != 2 {
		t.Errorf("restored index of %s = %d, want 2", TablePlacements, got)
	}
	if n3, _ := st.PlacementsByNode("n3"); len(n3) != 0 {
		t.Errorf("the replaced state's entries are still indexed by node: %v", n3)
	}
	if n1, _ := st.PlacementsByNode("n1"); len(n1) != 2 {
		t.Errorf("restored PlacementsByNode(n1) = %v, want VM a and volume x", n1)
	}
	if !bytes.Equal(dst.snapshot(), snap) {
		t.Errorf("the restored state's snapshot differs")
	}
	for _, h := range []*harness{src, dst} {
		h.index = max(h.index, h.f.AppliedIndex())
		h.mustApply(setPlacements("n1", []string{kindVM}))
	}
	if a, b := catalog(t, src.f.State()), catalog(t, dst.f.State()); !reflect.DeepEqual(a, b) || len(a) != 3 {
		t.Errorf("after a full listing: original %q, restored %q", a, b)
	}
}
