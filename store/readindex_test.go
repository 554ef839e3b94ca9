package store_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// A ReadIndex call that arrives while a round is in flight does not share
// that round: the round read the commit index before the call, so a write
// acknowledged in between would be missing from the answer. It waits for
// the next round, which every call that arrived meanwhile shares.
func TestReadIndexWaitsForARoundStartedAfterIt(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	l := c.WaitLeader(t, leaderTimeout)
	ctx := opCtx(t)

	entered := make(chan struct{}, 1)
	hold := make(chan struct{})
	var calls atomic.Int32
	store.SetBeforeVerify(l, func() {
		if calls.Add(1) == 1 {
			entered <- struct{}{}
			<-hold
		}
	})
	t.Cleanup(func() { store.SetBeforeVerify(l, nil) })

	type answer struct {
		index uint64
		err   error
	}
	first := make(chan answer, 1)
	go func() {
		i, err := l.ReadIndex(ctx)
		first <- answer{i, err}
	}()
	select {
	case <-entered:
	case <-time.After(waitTimeout):
		close(hold)
		t.Fatal("the first ReadIndex round did not start")
	}
	startRounds, _ := store.ReadRounds(l)

	// Acknowledged after the first round read the commit index.
	_, written, err := l.Apply(ctx, storetest.Set("k", "v"))
	if err != nil {
		close(hold)
		t.Fatalf("Apply on the leader: %v", err)
	}

	const later = 8
	answers := make(chan answer, later)
	for range later {
		go func() {
			i, err := l.ReadIndex(ctx)
			answers <- answer{i, err}
		}()
	}
	storetest.WaitFor(t, waitTimeout, fmt.Sprintf("%d calls waiting for the next round", later), func() bool {
		_, waiting := store.ReadRounds(l)
		return waiting == later
	})
	close(hold)

	if a := <-first; a.err != nil {
		t.Errorf("first ReadIndex: %v", a.err)
	} else if a.index >= written {
		t.Errorf("first ReadIndex = %d, want below the write %d acknowledged after its round started", a.index, written)
	}
	for range later {
		a := <-answers
		if a.err != nil {
			t.Errorf("later ReadIndex: %v", a.err)
			continue
		}
		if a.index < written {
			t.Errorf("ReadIndex called after the write at %d was acknowledged = %d", written, a.index)
		}
	}
	if end, _ := store.ReadRounds(l); end-startRounds != 1 {
		t.Errorf("the %d later calls took %d rounds, want 1", later, end-startRounds)
	}
}

// Concurrent reads share rounds, and each still covers every write
// acknowledged before it was called.
func TestReadIndexConcurrentCallsShareRounds(t *testing.T) {
	c := storetest.NewCluster(t, 3, storetest.NewKVFSM)
	l := c.WaitLeader(t, leaderTimeout)
	ctx := opCtx(t)
	before, _ := store.ReadRounds(l)

	var acked atomic.Uint64 // the highest write index acknowledged
	stop := make(chan struct{})
	writerDone := make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				writerDone <- nil
				return
			default:
			}
			_, idx, err := l.Apply(ctx, storetest.Set("k", fmt.Sprint(i)))
			if err != nil {
				writerDone <- err
				return
			}
			for {
				cur := acked.Load()
				if idx <= cur || acked.CompareAndSwap(cur, idx) {
					break
				}
			}
		}
	}()

	const readers, each = 32, 20
	var wg sync.WaitGroup
	errs := make(chan error, readers*each)
	for range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				floor := acked.Load()
				i, err := l.ReadIndex(ctx)
				if err != nil {
					errs <- err
					return
				}
				if i < floor {
					errs <- fmt.Errorf("ReadIndex = %d, below the write at %d acknowledged before the call", i, floor)
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	if err := <-writerDone; err != nil {
		t.Fatalf("writer: %v", err)
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	after, _ := store.ReadRounds(l)
	if rounds := after - before; rounds == 0 || rounds >= readers*each {
		t.Errorf("%d reads took %d rounds, want fewer rounds than reads", readers*each, rounds)
	}
	t.Logf("%d reads in %d rounds", readers*each, after-before)
}
