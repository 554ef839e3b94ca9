package gateway

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A read that arrives while a round trip is in flight is answered by the
// next round, never by the one in flight; all reads that arrive meanwhile
// share that next round.
func TestReadIndexBatcherNeverAnswersFromAnEarlierRound(t *testing.T) {
	var calls atomic.Uint64
	release := make(chan struct{})
	started := make(chan struct{}, 10)
	b := newReadIndexBatcher(func(ctx context.Context, addr string) (uint64, error) {
		n := calls.Add(1)
		started <- struct{}{}
		if n == 1 {
			<-release
		}
		return n * 100, nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	first := make(chan uint64, 1)
	go func() {
		idx, err := b.readIndex(ctx, "leader:9000")
		if err != nil {
			t.Error(err)
		}
		first <- idx
	}()
	<-started // round 1 is in flight
	const n = 50
	var wg sync.WaitGroup
	got := make([]uint64, n)
	for i := range n {
		wg.Go(func() {
			idx, err := b.readIndex(ctx, "leader:9000")
			if err != nil {
				t.Error(err)
			}
			got[i] = idx
		})
	}
	// Every late reader must be queued while round 1 is in flight.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.mu.Lock()
		q := b.addrs["leader:9000"]
		queued := 0
		if q != nil && q.next != nil {
			queued = q.next.waiters
		}
		b.mu.Unlock()
		if queued == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d reads queued", queued, n)
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	if idx := <-first; idx != 100 {
		t.Fatalf("first read: index %d, want 100 (round 1)", idx)
	}
	wg.Wait()
	for i, idx := range got {
		if idx < 200 {
			t.Fatalf("read %d answered with index %d from a round that began before it", i, idx)
		}
	}
	if c := calls.Load(); c != 2 {
		t.Fatalf("%d round trips for %d reads, want 2", c, n+1)
	}
}

func TestReadIndexBatcherErrorsAndCancellation(t *testing.T) {
	boom := errors.New("not the leader")
	block := make(chan struct{})
	b := newReadIndexBatcher(func(ctx context.Context, addr string) (uint64, error) {
		if addr == "slow:9000" {
			<-block
		}
		return 0, boom
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.readIndex(ctx, "a:9000"); !errors.Is(err, boom) {
		t.Fatalf("error %v, want %v", err, boom)
	}
	short, cancelShort := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancelShort()
	if _, err := b.readIndex(short, "slow:9000"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a read whose context ends: %v, want the context's error", err)
	}
	close(block)
	// Idle addresses are forgotten.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.mu.Lock()
		n := len(b.addrs)
		b.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d idle addresses kept", n)
		}
		time.Sleep(time.Millisecond)
	}
}
