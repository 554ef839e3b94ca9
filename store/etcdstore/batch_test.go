package etcdstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestConcurrentWritesBatched: concurrent writes through one store go to
// etcd together (writes linearized at one revision), and each keeps its
// own outcome: registrations succeed beside compare-and-set writes that
// lose, and writes of the same key are never combined (each CAS on the
// key sees the one before it).
func TestConcurrentWritesBatched(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	cli := ec.Client(t)
	first := mustApply(t, s, setConfigCmd("k", "v0"))
	shared := false
	for round := 0; round < 5 && !shared; round++ {
		const regs, cas = 24, 8
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			revs    = map[uint64][]string{}
			casWins int
		)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for i := range regs + cas {
			wg.Go(func() {
				if i >= regs {
					// A compare-and-set with the key's first revision:
					// only the first of a round can win, and only in round 0.
					rev := first.Index
					res, err := apply(ctx, t, s, &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{
						Key: "k", Value: fmt.Sprint("v", round, i), CasRevision: &rev}}})
					switch {
					case err != nil:
						t.Errorf("cas %d: %v", i, err)
					case res.Err == nil:
						mu.Lock()
						casWins++
						mu.Unlock()
					case !errors.Is(res.Err, fsm.ErrCASConflict):
						t.Errorf("cas %d: outcome %v, want a conflict", i, res.Err)
					}
					return
				}
				id := fmt.Sprintf("r%d-%d", round, i)
				res, err := apply(ctx, t, s, registerCmd("web", id, 0))
				if err != nil {
					t.Errorf("register %s: %v", id, err)
					return
				}
				if res.Err != nil {
					t.Errorf("register %s: outcome %v", id, res.Err)
					return
				}
				mu.Lock()
				revs[res.Index] = append(revs[res.Index], id)
				mu.Unlock()
			})
		}
		wg.Wait()
		cancel()
		if t.Failed() {
			t.FailNow()
		}
		if want := map[bool]int{true: 1, false: 0}[round == 0]; casWins != want {
			t.Fatalf("round %d: %d compare-and-set writes won, want %d", round, casWins, want)
		}
		for rev, ids := range revs {
			// Each registration is in etcd at the revision it was answered
			// with, and in the mirror.
			for _, id := range ids {
				resp, err := cli.Get(context.Background(), "/pivirt/services/web/"+id)
				if err != nil || len(resp.Kvs) != 1 || uint64(resp.Kvs[0].ModRevision) != rev {
					t.Fatalf("%s: etcd holds %v (%v), want it at revision %d", id, resp, err, rev)
				}
				if inst, err := s.State().Service("web", id); err != nil || inst.GetModifyIndex() != rev {
					t.Fatalf("%s: the mirror holds %v (%v), want it at revision %d", id, inst, err, rev)
				}
			}
			shared = shared || len(ids) > 1
		}
	}
	if !shared {
		t.Fatal("in 5 rounds of 32 concurrent writes, no two were committed in one transaction")
	}
}
