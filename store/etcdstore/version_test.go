package etcdstore_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestClusterVersionMoves: a store of a cluster that began at 0.0 (an
// upgrade from the release before cluster versions) moves to the latest
// version and back while etcd holds per-write dedupe records, which etcd
// mode keeps at every version; a repeated write is still answered from
// them on every store, at each version.
func TestClusterVersionMoves(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	a := openStoreWith(t, ec, "node-a", fsm.DefaultConfig())
	b := openStoreWith(t, ec, "node-b", fsm.DefaultConfig())

	seq := uint64(0)
	write := func(id string) *fsmv1.Command {
		seq++
		cmd := registerCmd("web", id, 0)
		cmd.ClientId, cmd.Sequence, cmd.Time = "client-1", seq, timestamppb.Now()
		return cmd
	}
	versionOf := func(s *etcdstore.Store) fsm.Version {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		idx, err := s.ReadIndex(ctx)
		if err == nil {
			err = s.WaitApplied(ctx, idx)
		}
		if err != nil {
			t.Fatal(err)
		}
		v, _, err := s.State().ClusterVersion()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	repeat := func(s *etcdstore.Store, cmd *fsmv1.Command, step string) {
		t.Helper()
		if res := mustApply(t, s, cmd); !res.Duplicate {
			t.Fatalf("%s: a repeated write was applied again: %+v", step, res)
		}
	}

	before := write("i1")
	mustApply(t, a, before)
	for _, step := range []struct {
		name string
		to   fsm.Version
	}{{"raise", fsm.Latest}, {"downgrade", fsm.Version0_0}, {"raise again", fsm.Latest}} {
		res, err := apply(context.Background(), t, a, fsm.SetClusterVersionCommand(step.to))
		if err == nil {
			err = res.Err
		}
		if err != nil {
			t.Fatalf("%s to %s with dedupe records in etcd: %v", step.name, step.to, err)
		}
		for name, s := range map[string]*etcdstore.Store{"a": a, "b": b} {
			if got := versionOf(s); got != step.to {
				t.Fatalf("%s: store %s is at %s, want %s", step.name, name, got, step.to)
			}
			repeat(s, before, step.name)
		}
		before = write("i-" + step.name)
		mustApply(t, b, before)
		repeat(a, before, step.name)
	}
}
