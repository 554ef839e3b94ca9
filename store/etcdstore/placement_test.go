package etcdstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

func setPlacementsCmd(node string, full []string, upsert ...*fsmv1.Placement) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{
		Node: node, Upsert: upsert, FullKinds: full,
	}}}
}

func placement(kind, id string) *fsmv1.Placement { return &fsmv1.Placement{Kind: kind, Id: id} }

// TestPlacements: set_placements through the etcd store lands in every
// mirror and under <root>/placements/<kind>/<id>, one key per entry; a
// move rewrites the key, a full listing deletes the keys it drops, a
// listing that changes nothing writes no key, and a retry is a duplicate.
func TestPlacements(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	stores := openStores(t, ec, 2)
	cli := ec.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// keys returns the placement keys in etcd and the node in each value.
	keys := func() map[string]string {
		t.Helper()
		resp, err := cli.Get(ctx, "/pivirt/placements/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, kv := range resp.Kvs {
			var v map[string]any
			if err := json.Unmarshal(kv.Value, &v); err != nil {
				t.Fatalf("value of %s is not JSON: %v\n%s", kv.Key, err, kv.Value)
			}
			out[string(kv.Key)] = fmt.Sprint(v["node"])
		}
		return out
	}
	// nodeOf is where store i's mirror places an object, once it has
	// etcd's current state.
	nodeOf := func(i int, kind, id string) string {
		t.Helper()
		idx, err := stores[i].ReadIndex(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stores[i].WaitApplied(ctx, idx); err != nil {
			t.Fatal(err)
		}
		p, err := stores[i].State().Placement(kind, id)
		if err != nil {
			t.Fatal(err)
		}
		return p.GetNode()
	}

	mustApply(t, stores[0], setPlacementsCmd("node-0", []string{"virtualmachines"},
		placement("virtualmachines", "vm-1"), placement("volumes", "pool/disk 1")))
	want := map[string]string{
		"/pivirt/placements/virtualmachines/vm-1":    "node-0",
		"/pivirt/placements/volumes/pool%2Fdisk%201": "node-0",
	}
	if got := keys(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("etcd keys %v, want %v", got, want)
	}
	// The store that wrote has it on return; the other one follows.
	if p, _ := stores[0].State().Placement("volumes", "pool/disk 1"); p.GetNode() != "node-0" {
		t.Fatalf("the writing store's mirror: %v", p)
	}
	for i := range stores {
		if n := nodeOf(i, "virtualmachines", "vm-1"); n != "node-0" {
			t.Fatalf("store %d places vm-1 on %q, want node-0", i, n)
		}
	}

	// vm-1 migrates: node-1 reports it, through the other store.
	mustApply(t, stores[1], setPlacementsCmd("node-1", nil, placement("virtualmachines", "vm-1")))
	want["/pivirt/placements/virtualmachines/vm-1"] = "node-1"
	if got := keys(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after the move: etcd keys %v, want %v", got, want)
	}
	if n := nodeOf(0, "virtualmachines", "vm-1"); n != "node-1" {
		t.Fatalf("store 0 places the moved vm-1 on %q, want node-1", n)
	}
	// node-0's full listing of volumes without the disk deletes its key.
	mustApply(t, stores[0], setPlacementsCmd("node-0", []string{"volumes"}))
	delete(want, "/pivirt/placements/volumes/pool%2Fdisk%201")
	if got := keys(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after the full listing: etcd keys %v, want %v", got, want)
	}
	if n := nodeOf(1, "volumes", "pool/disk 1"); n != "" {
		t.Fatalf("store 1 still places the dropped disk on %q", n)
	}

	// An unchanged listing writes no key; with a client ID its dedupe
	// record only, and its retry is a duplicate.
	before, err := cli.Get(ctx, "/pivirt/placements/virtualmachines/vm-1")
	if err != nil || len(before.Kvs) != 1 {
		t.Fatal(before, err)
	}
	mustApply(t, stores[0], setPlacementsCmd("node-1", []string{"virtualmachines"}, placement("virtualmachines", "vm-1")))
	same := setPlacementsCmd("node-1", []string{"virtualmachines"}, placement("virtualmachines", "vm-1"))
	same.ClientId, same.Sequence, same.Time = "agent-node-1", 1, timestamppb.Now()
	first := mustApply(t, stores[1], same)
	if again := mustApply(t, stores[0], same); !again.Duplicate || again.Index != first.Index {
		t.Fatalf("retry: %+v, want a duplicate of index %d", again, first.Index)
	}
	after, err := cli.Get(ctx, "/pivirt/placements/virtualmachines/vm-1")
	if err != nil || len(after.Kvs) != 1 || after.Kvs[0].ModRevision != before.Kvs[0].ModRevision {
		t.Fatalf("unchanged listings rewrote the key: %v (was %v), %v", after.Kvs, before.Kvs, err)
	}

	// A rejected command writes nothing.
	res, err := apply(ctx, t, stores[0], setPlacementsCmd("node-0", nil, placement("pods", "p")))
	if err != nil || !errors.Is(res.Err, fsm.ErrInvalidCommand) {
		t.Fatalf("an unknown kind: %v %v, want ErrInvalidCommand", res, err)
	}
	if got := keys(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after a rejected command: etcd keys %v, want %v", got, want)
	}
}

// TestPlacementsBeyondTxnOps: one key per entry, so a command that writes
// or reads more entries than etcd's --max-txn-ops (128 by default) is
// refused as too large and writes nothing (DESIGN.md, "Layout in etcd");
// the same entries in commands of at most 100 are stored.
func TestPlacementsBeyondTxnOps(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var all []*fsmv1.Placement
	for i := range 200 {
		all = append(all, placement("virtualmachines", fmt.Sprint("vm-", i)))
	}
	res, err := apply(ctx, t, s, setPlacementsCmd("node-0", nil, all...))
	if err != nil || !errors.Is(res.Err, fsm.ErrInvalidCommand) {
		t.Fatalf("200 upserts in one command: %v %v, want ErrInvalidCommand (too large for etcd)", res, err)
	}
	if _, list, _ := s.State().Placements("", nil); len(list) != 0 {
		t.Fatalf("a refused command stored %d placements", len(list))
	}
	mustApply(t, s, setPlacementsCmd("node-0", nil, all[:100]...))
	mustApply(t, s, setPlacementsCmd("node-0", nil, all[100:]...))
	if _, list, _ := s.State().Placements("virtualmachines", nil); len(list) != 200 {
		t.Fatalf("%d placements, want 200", len(list))
	}
}
