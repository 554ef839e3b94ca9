package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/go-memdb"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// compactKeys lists the records of a compact table lookup with their memdb
// key (the primary-key indexer's).
func compactKeys(t *testing.T, txn *memdb.Txn, index string, args ...any) (keys []string, recs []*fsmv1.Placement) {
	t.Helper()
	it, err := tget(txn, TablePlacements, index, args...)
	if err != nil {
		t.Fatalf("tget %s %v: %v", index, args, err)
	}
	for obj := it.Next(); obj != nil; obj = it.Next() {
		p := obj.(*fsmv1.Placement)
		ok, key, err := placementID.FromObject(p)
		if !ok || err != nil {
			t.Fatalf("key of %v: %v", p, err)
		}
		keys, recs = append(keys, string(key)), append(recs, p)
	}
	return keys, recs
}

// TestCompactOrder: a compact table iterates in the byte order of the keys
// memdb's ID index had (snapshots and hashes depend on it), prefixes of
// one another included, and its node and kind lookups hold exactly the
// records they name.
func TestCompactOrder(t *testing.T) {
	db := newMemDB()
	txn := db.Txn(true)
	r := rand.New(rand.NewPCG(1, 2))
	kinds := []string{"v", "vm", "vms", "virtualmachines", "volumes", "networks"}
	ids := []string{"a", "ab", "a-b", "a.b", "b", "aa", "a~", "A", "z9", "0"}
	nodes := []string{"", "n", "n1", "n10", "n2"}
	want := map[string]*fsmv1.Placement{}
	for range 500 {
		p := &fsmv1.Placement{Kind: kinds[r.IntN(len(kinds))], Id: ids[r.IntN(len(ids))] + fmt.Sprint(r.IntN(30)), Node: nodes[r.IntN(len(nodes))]}
		if err := tinsert(txn, TablePlacements, p); err != nil {
			t.Fatal(err)
		}
		want[p.Kind+"/"+p.Id] = p
	}
	keys, recs := compactKeys(t, txn, indexID)
	if len(recs) != len(want) {
		t.Fatalf("%d records, want %d", len(recs), len(want))
	}
	if !slices.IsSorted(keys) || len(slices.Compact(slices.Clone(keys))) != len(keys) {
		t.Fatalf("records not in strictly increasing key order: %q", keys)
	}
	for _, p := range recs {
		if want[p.Kind+"/"+p.Id] != p {
			t.Fatalf("%v is not the record last inserted under its key", p)
		}
	}
	for _, node := range nodes[1:] {
		_, got := compactKeys(t, txn, indexNode, node)
		var exp []*fsmv1.Placement
		for _, p := range recs {
			if p.Node == node {
				exp = append(exp, p)
			}
		}
		if !slices.Equal(got, exp) {
			t.Fatalf("node %q: %d records, want %d in key order", node, len(got), len(exp))
		}
	}
	for _, kind := range kinds {
		_, got := compactKeys(t, txn, indexIDPrefix, kind)
		var exp []*fsmv1.Placement
		for _, p := range recs {
			if p.Kind == kind {
				exp = append(exp, p)
			}
		}
		if !slices.Equal(got, exp) {
			t.Fatalf("kind %q: %d records, want %d", kind, len(got), len(exp))
		}
	}
	// Deletes, and a record that moves to another node or loses it.
	for i, p := range recs {
		switch i % 3 {
		case 0:
			if err := tdelete(txn, TablePlacements, p); err != nil {
				t.Fatal(err)
			}
			delete(want, p.Kind+"/"+p.Id)
		case 1:
			q := &fsmv1.Placement{Kind: p.Kind, Id: p.Id, Node: nodes[(slices.Index(nodes, p.Node)+1)%len(nodes)]}
			if err := tinsert(txn, TablePlacements, q); err != nil {
				t.Fatal(err)
			}
			want[q.Kind+"/"+q.Id] = q
		}
	}
	_, recs = compactKeys(t, txn, indexID)
	_, all := compactKeys(t, txn, indexNode)
	var withNode int
	for _, p := range recs {
		if want[p.Kind+"/"+p.Id] != p {
			t.Fatalf("after the changes: %v is not the record last written under its key", p)
		}
		if p.Node != "" {
			withNode++
		}
	}
	if len(recs) != len(want) || len(all) != withNode {
		t.Fatalf("after the changes: %d records (want %d), %d by node (want %d)", len(recs), len(want), len(all), withNode)
	}
	if n, err := tlen(txn, TablePlacements); err != nil || n != len(want) {
		t.Fatalf("tlen = %d, %v; want %d", n, err, len(want))
	}
	txn.Commit()
}

// TestCompactErrors: what memdb refuses, a compact table refuses, and a
// refused or aborted write leaves the committed records as they were.
func TestCompactErrors(t *testing.T) {
	db := newMemDB()
	txn := db.Txn(true)
	if err := tinsert(txn, TablePlacements, &fsmv1.Placement{Kind: "volumes", Id: "v1", Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	txn.Commit()
	txn = db.Txn(true)
	for _, bad := range []any{
		&fsmv1.Placement{Kind: "volumes"},
		&fsmv1.Placement{Id: "x"},
		&fsmv1.Placement{Kind: "volumes", Id: "a\x00b"},
		&fsmv1.ClusterCA{},
	} {
		if err := tinsert(txn, TablePlacements, bad); err == nil {
			t.Errorf("insert %v: no error", bad)
		}
	}
	if err := tdelete(txn, TablePlacements, &fsmv1.Placement{Kind: "volumes", Id: "v2"}); !errors.Is(err, memdb.ErrNotFound) {
		t.Errorf("delete of a missing record: %v, want memdb.ErrNotFound", err)
	}
	if _, err := tget(txn, TablePlacements, "nope"); err == nil {
		t.Error("lookup by an unknown index: no error")
	}
	if _, err := tget(txn, TablePlacements, indexID, "volumes", "v1", "x"); err == nil {
		t.Error("lookup with too many arguments: no error")
	}
	if _, err := tdeleteAll(txn, TablePlacements, indexNode, "n1"); err == nil {
		t.Error("delete by node: no error")
	}
	// Writes of an aborted transaction disappear.
	if err := tinsert(txn, TablePlacements, &fsmv1.Placement{Kind: "volumes", Id: "v2", Node: "n1"}); err != nil {
		t.Fatal(err)
	}
	if n, err := tdeleteAll(txn, TablePlacements, indexID); err != nil || n != 2 {
		t.Fatalf("delete all = %d, %v; want 2", n, err)
	}
	txn.Abort()
	_, recs := compactKeys(t, db.Txn(false), indexID)
	if len(recs) != 1 || recs[0].Id != "v1" {
		t.Fatalf("after an aborted write: %v, want v1 alone", recs)
	}
}

// TestCompactIsolation: readers keep the records of their snapshot while
// writers of the database and of a memdb snapshot of it (a restore builds
// on one) change the same trees; run with -race.
func TestCompactIsolation(t *testing.T) {
	h := newHarness(t)
	for i := range 200 {
		h.mustApply(setPlacements("n1", nil, placement(kindVM, fmt.Sprintf("vm%03d", i))))
	}
	before := h.f.State()
	want := catalog(t, before)
	snapDB := h.f.database().Snapshot()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		// A writer of the snapshot database: its changes stay there.
		defer wg.Done()
		for i := range 200 {
			txn := snapDB.Txn(true)
			if err := tinsert(txn, TablePlacements, &fsmv1.Placement{Kind: kindVol, Id: fmt.Sprintf("s%03d", i), Node: "n9"}); err != nil {
				t.Error(err)
				txn.Abort()
				return
			}
			txn.Commit()
		}
	}()
	go func() {
		defer wg.Done()
		for range 200 {
			if got := catalog(t, before); !slices.Equal(got, want) {
				t.Error("a reader's snapshot changed under it")
				return
			}
		}
	}()
	for i := range 200 {
		h.mustApply(setPlacements("n2", nil, placement(kindVM, fmt.Sprintf("vm%03d", i))))
	}
	wg.Wait()
	if got := catalog(t, before); !slices.Equal(got, want) {
		t.Fatal("the first snapshot changed")
	}
	after := catalog(t, h.f.State())
	if len(after) != 200 || after[0] != kindVM+"/vm000@n2" {
		t.Fatalf("after the moves: %d entries, first %q", len(after), after[0])
	}
	_, onSnap := compactKeys(t, snapDB.Txn(false), indexNode, "n9")
	if len(onSnap) != 200 {
		t.Fatalf("snapshot database: %d records of its writer, want 200", len(onSnap))
	}
	if list, err := h.f.State().PlacementsByNode("n9"); err != nil || len(list) != 0 {
		t.Fatalf("the snapshot database's writes reached the state: %d, %v", len(list), err)
	}
	// The two databases now hold different trees; a snapshot of each
	// says so.
	a := h.snapshot()
	if !bytes.Contains(a, []byte("vm199")) || bytes.Contains(a, []byte("s199")) {
		t.Fatal("snapshot of the state: wrong records")
	}
}

// TestCompactServices: the services table looks up one service by its
// name's key prefix without its longer namesakes, in instance order, and
// a watch of one service ignores the others.
func TestCompactServices(t *testing.T) {
	h := newHarness(t)
	for _, k := range [][2]string{{"webapp", "1"}, {"web", "b"}, {"we", "z"}, {"web", "a"}, {"web-1", "a"}, {"web", "a-1"}} {
		h.mustApply(register(instance(k[0], k[1])))
	}
	ws := memdb.NewWatchSet()
	_, list, err := h.f.State().Services("web", ws)
	if err != nil {
		t.Fatal(err)
	}
	if got := instanceKeys(list); !slices.Equal(got, []string{"web/a", "web/a-1", "web/b"}) {
		t.Fatalf("Services(web) = %v", got)
	}
	_, all, _ := h.f.State().Services("", nil)
	if got := instanceKeys(all); !slices.Equal(got, []string{"we/z", "web/a", "web/a-1", "web/b", "web-1/a", "webapp/1"}) {
		t.Fatalf("Services() = %v, want key order", got)
	}
	h.mustApply(register(instance("webapp", "2")))
	h.mustApply(register(instance("db", "1")))
	if fired(ws) {
		t.Fatal("the watch of web fired on changes to webapp and db")
	}
	h.mustApply(deregister("web", "a-1"))
	waitFired(t, ws)
	if inst, err := h.f.State().Service("web", "a-1"); err == nil {
		t.Fatalf("deregistered instance still there: %v", inst)
	}
	if inst, err := h.f.State().Service("web", "a"); err != nil || inst.GetInstanceId() != "a" {
		t.Fatalf("Service(web, a) = %v, %v", inst, err)
	}
}

// TestCompactIterator: a walk longer than a chunk returns every record
// once, in order, and sees the records as of the lookup when its own
// transaction writes while it walks.
func TestCompactIterator(t *testing.T) {
	db := newMemDB()
	txn := db.Txn(true)
	const n = compactChunk*3 + 7
	for i := range n {
		if err := tinsert(txn, TablePlacements, &fsmv1.Placement{Kind: kindVM, Id: fmt.Sprintf("vm%05d", i), Node: fmt.Sprintf("n%d", i%2)}); err != nil {
			t.Fatal(err)
		}
	}
	it, err := tget(txn, TablePlacements, indexID)
	if err != nil {
		t.Fatal(err)
	}
	byNode, err := tget(txn, TablePlacements, indexNode, "n1")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for obj := it.Next(); obj != nil && len(ids) <= 2*n; obj = it.Next() {
		p := obj.(*fsmv1.Placement)
		ids = append(ids, p.Id)
		// Writes of the walking transaction: not in the walk.
		if err := tdelete(txn, TablePlacements, p); err != nil {
			t.Fatal(err)
		}
		if err := tinsert(txn, TablePlacements, &fsmv1.Placement{Kind: kindVM, Id: p.Id + "x", Node: "n1"}); err != nil {
			t.Fatal(err)
		}
	}
	if len(ids) != n || !slices.IsSorted(ids) || len(slices.Compact(slices.Clone(ids))) != n {
		t.Fatalf("walk: %d records (want %d), sorted %v", len(ids), n, slices.IsSorted(ids))
	}
	var odd int
	for obj := byNode.Next(); obj != nil; obj = byNode.Next() {
		if p := obj.(*fsmv1.Placement); p.Node != "n1" || strings.HasSuffix(p.Id, "x") {
			t.Fatalf("node walk returned %v", p)
		}
		odd++
	}
	if odd != n/2 {
		t.Fatalf("node walk: %d records, want %d", odd, n/2)
	}
	if got, _ := tlen(txn, TablePlacements); got != n {
		t.Fatalf("after the writes: %d records, want %d", got, n)
	}
	txn.Commit()
}

// TestServiceWatchAfterRestore: after a restore, the watch of one service
// still ignores the writes of the others (each restored service has its
// row of the service index again).
func TestServiceWatchAfterRestore(t *testing.T) {
	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	h.mustApply(register(instance("api", "a")))
	snap := h.snapshot()
	g := newHarness(t)
	if err := g.f.Restore(readCloser(snap)); err != nil {
		t.Fatal(err)
	}
	g.index = g.f.AppliedIndex()
	ws := memdb.NewWatchSet()
	if _, list, err := g.f.State().Services("web", ws); err != nil || len(list) != 1 {
		t.Fatalf("Services(web) after the restore: %d, %v", len(list), err)
	}
	g.mustApply(register(instance("api", "b")))
	g.mustApply(register(instance("zzz", "b")))
	if fired(ws) {
		t.Fatal("web's watch fired on writes to api and zzz after a restore")
	}
	g.mustApply(heartbeat("web", "a"))
	waitFired(t, ws)
}
