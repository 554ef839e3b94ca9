package store

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// newTestTransport is raft's NetworkTransport on a TCP listener on
// 127.0.0.1, pipelining at raft's default depth, closed at the end of the
// test.
func newTestTransport(t *testing.T, timeout time.Duration, logger hclog.Logger) *raft.NetworkTransport {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if logger == nil {
		logger = hclog.NewNullLogger()
	}
	tr := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:          NewTCPStreamLayer(ln, nil),
		MaxPool:         3,
		Timeout:         timeout,
		Logger:          logger,
		MaxRPCsInFlight: raft.DefaultMaxRPCsInFlight,
	})
	t.Cleanup(func() { tr.Close() })
	return tr
}

// within runs f and fails the test when it has not returned after d.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: still blocked after %v", what, d)
	}
}

// answer takes the next AppendEntries from a follower transport and answers
// it with success, or not.
func answer(t *testing.T, follower *raft.NetworkTransport, success bool) {
	t.Helper()
	select {
	case rpc := <-follower.Consumer():
		req, ok := rpc.Command.(*raft.AppendEntriesRequest)
		if !ok {
			t.Fatalf("follower got %T, want an AppendEntriesRequest", rpc.Command)
		}
		rpc.Respond(&raft.AppendEntriesResponse{Term: req.Term, Success: success}, nil)
	case <-time.After(10 * time.Second):
		t.Fatal("follower: no AppendEntries within 10s")
	}
}

func appendReq(term uint64) *raft.AppendEntriesRequest {
	return &raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax}, Term: term}
}

// The pipeline ends itself on a rejection, after handing it over, so the
// send that follows returns instead of parking for good. Without the
// wrapper raft's own pipeline parks that send: its decoder holds the next
// answer for a reader that stopped at the rejection (hashicorp/raft#612).
func TestEndingPipelineClosesOnRejection(t *testing.T) {
	leader := newTestTransport(t, 10*time.Second, nil)
	follower := newTestTransport(t, 10*time.Second, nil)
	p, err := endingPipelines{leader}.AppendEntriesPipeline("f", follower.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	// First a success, passed on as it is, then a rejection with one more
	// request behind it — as raft's send loop keeps sending while the
	// answers come.
	within(t, 10*time.Second, "first send", func() {
		if _, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse)); err != nil {
			t.Error(err)
		}
	})
	answer(t, follower, true)
	select {
	case f := <-p.Consumer():
		if !f.Response().Success || f.Error() != nil {
			t.Fatalf("first answer: success %v, error %v; want a success", f.Response().Success, f.Error())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("first answer not passed on within 10s")
	}

	within(t, 10*time.Second, "second send", func() {
		if _, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse)); err != nil {
			t.Error(err)
		}
	})
	// The third send returns once the decoder took the second request,
	// which it does after decoding the rejection below.
	third := make(chan error, 1)
	go func() {
		_, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse))
		third <- err
	}()
	answer(t, follower, false)
	answer(t, follower, true)
	select {
	case f := <-p.Consumer():
		if f.Response().Success {
			t.Fatal("second answer passed on as a success, want the rejection")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("rejection not passed on within 10s")
	}
	// Like raft's pipelineDecode, read nothing more after the rejection.
	// The third send raced the close: taken before it, or refused as
	// closed (its goroutine may run only after the rejection was
	// decoded), but never parked.
	select {
	case err := <-third:
		if err != nil && !errors.Is(err, raft.ErrPipelineShutdown) {
			t.Fatalf("third send (racing the close): %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("third send still blocked after 10s")
	}
	// The send after the rejection returns an error, not parks: raft's
	// pipeline answers ErrPipelineShutdown, or the closed connection's
	// error when the write comes first (raft takes either as the end of
	// the pipeline).
	within(t, 10*time.Second, "the send after a rejection", func() {
		if _, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse)); err == nil {
			t.Errorf("send after the rejection: no error, want the pipeline closed")
		}
	})
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// An answer that does not come (a read timeout) ends the pipeline the same
// way, and reaches raft as no success.
func TestEndingPipelineClosesOnError(t *testing.T) {
	leader := newTestTransport(t, 300*time.Millisecond, nil)
	follower := newTestTransport(t, 10*time.Second, nil)
	p, err := endingPipelines{leader}.AppendEntriesPipeline("f", follower.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	within(t, 10*time.Second, "first send", func() {
		if _, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse)); err != nil {
			t.Error(err)
		}
	})
	// The follower takes the request and never answers.
	select {
	case <-follower.Consumer():
	case <-time.After(10 * time.Second):
		t.Fatal("follower: no AppendEntries within 10s")
	}
	select {
	case f := <-p.Consumer():
		if f.Error() == nil || f.Response().Success {
			t.Fatalf("unanswered request: error %v, success %v; want an error and no success", f.Error(), f.Response().Success)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("read timeout not passed on within 10s")
	}
	within(t, 10*time.Second, "the send after an error", func() {
		if _, err := p.AppendEntries(appendReq(1), new(raft.AppendEntriesResponse)); !errors.Is(err, raft.ErrPipelineShutdown) {
			t.Errorf("send after the error: %v, want %v", err, raft.ErrPipelineShutdown)
		}
	})
}

// failingLogs is a real bbolt log store that refuses to store entries while
// full is set, as on a full disk, after refuseAfter: a disk takes its time
// to refuse a write (it tries first). That time lets the leader prepare its
// next batches while the rejection is on its way, as it does against a real
// disk, and so gives raft's send loop the chance to race the pipeline's end
// that hashicorp/raft#612 is about.
type failingLogs struct {
	raft.LogStore
	refuseAfter time.Duration
	full        atomic.Bool
	refused     atomic.Int64
}

func (l *failingLogs) StoreLog(log *raft.Log) error { return l.StoreLogs([]*raft.Log{log}) }

func (l *failingLogs) StoreLogs(logs []*raft.Log) error {
	if l.full.Load() {
		l.refused.Add(1)
		time.Sleep(l.refuseAfter)
		return errors.New("write raft.db: no space left on device (injected)")
	}
	return l.LogStore.StoreLogs(logs)
}

// countingPipelines counts the pipelines raft has open to each follower.
type countingPipelines struct {
	endingPipelines
	mu   *sync.Mutex
	open map[raft.ServerAddress]int
}

func (t countingPipelines) AppendEntriesPipeline(id raft.ServerID, target raft.ServerAddress) (raft.AppendPipeline, error) {
	p, err := t.endingPipelines.AppendEntriesPipeline(id, target)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.open[target]++
	t.mu.Unlock()
	return &countedPipeline{AppendPipeline: p, closed: sync.OnceFunc(func() {
		t.mu.Lock()
		t.open[target]--
		t.mu.Unlock()
	})}, nil
}

func (t countingPipelines) openTo(target raft.ServerAddress) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.open[target]
}

type countedPipeline struct {
	raft.AppendPipeline
	closed func()
}

func (p *countedPipeline) Close() error {
	p.closed()
	return p.AppendPipeline.Close()
}

// syncBuffer collects raft's log lines for a failing test.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	lines := strings.Split(b.buf.String(), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// With pipelined replication on, a follower that rejects appends (its log
// store refusing writes) gets every entry once it takes them again, in each
// of several episodes, raft opens a fresh pipeline after each, and every
// node's Shutdown returns. Without endingPipelines the leader stops sending
// the follower entries after a rejection within a few episodes and its
// Shutdown hangs (hashicorp/raft#612).
func TestPipelineRecoversFromRejectedAppends(t *testing.T) {
	var logs syncBuffer
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("raft log, last lines:\n%s", logs.tail(60))
		}
	})
	type node struct {
		raft  *raft.Raft
		logs  *failingLogs
		trans *raft.NetworkTransport
	}
	nodes := make([]*node, 3)
	var servers []raft.Server
	trs := make([]countingPipelines, len(nodes))
	for i := range nodes {
		name := fmt.Sprintf("n%d", i)
		logger := hclog.New(&hclog.LoggerOptions{Name: name, Output: &logs, Level: hclog.Info})
		dir := t.TempDir()
		bolt, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, boltFile)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { bolt.Close() })
		trans := newTestTransport(t, 2*time.Second, logger)
		nodes[i] = &node{logs: &failingLogs{LogStore: bolt, refuseAfter: 5 * time.Millisecond}, trans: trans}
		servers = append(servers, raft.Server{ID: raft.ServerID(name), Address: trans.LocalAddr()})
	}
	for i, n := range nodes {
		cfg := raft.DefaultConfig()
		cfg.LocalID = servers[i].ID
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: string(servers[i].ID), Output: &logs, Level: hclog.Info})
		// No election while a follower refuses entries (heartbeats carry
		// none and still pass).
		cfg.HeartbeatTimeout = time.Second
		cfg.ElectionTimeout = time.Second
		cfg.LeaderLeaseTimeout = 500 * time.Millisecond
		cfg.BatchApplyCh = true
		trs[i] = countingPipelines{endingPipelines{n.trans}, new(sync.Mutex), map[raft.ServerAddress]int{}}
		snaps, err := raft.NewFileSnapshotStoreWithLogger(t.TempDir(), 1, cfg.Logger)
		if err != nil {
			t.Fatal(err)
		}
		// The bbolt store is both the log (behind the failing wrapper)
		// and the stable store.
		stable := n.logs.LogStore.(*raftboltdb.BoltStore)
		r, err := raft.NewRaft(cfg, nopFSM{}, n.logs, stable, snaps, trs[i])
		if err != nil {
			t.Fatal(err)
		}
		n.raft = r
		shutdown := sync.OnceFunc(func() { r.Shutdown() })
		t.Cleanup(shutdown)
	}
	if err := nodes[0].raft.BootstrapCluster(raft.Configuration{Servers: servers}).Error(); err != nil {
		t.Fatal(err)
	}

	waitFor := func(d time.Duration, what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(d)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %v", what, d)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	li := -1
	waitFor(10*time.Second, "a leader", func() bool {
		for i, n := range nodes {
			if n.raft.State() == raft.Leader {
				li = i
				return true
			}
		}
		return false
	})
	leader, follower := nodes[li], nodes[(li+1)%len(nodes)]

	const episodes = 10
	for ep := range episodes {
		// Replication to the follower is healthy again: raft pipelines, so
		// the rejections below meet a pipeline.
		waitFor(15*time.Second, fmt.Sprintf("episode %d: a pipeline to the follower", ep), func() bool {
			return trs[li].openTo(follower.trans.LocalAddr()) == 1
		})
		follower.logs.full.Store(true)
		refused := follower.logs.refused.Load()
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 64 {
					if err := leader.raft.Apply(bytes.Repeat([]byte("v"), 512), 10*time.Second).Error(); err != nil {
						t.Errorf("episode %d: apply: %v", ep, err)
						return
					}
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		if follower.logs.refused.Load() == refused {
			t.Fatalf("episode %d: the follower refused no entries", ep)
		}
		follower.logs.full.Store(false)
		marker := leader.raft.Apply([]byte("marker"), 10*time.Second)
		if err := marker.Error(); err != nil {
			t.Fatalf("episode %d: apply the marker: %v", ep, err)
		}
		// Up to raft's longest retry backoff (10 s) after the rejections.
		waitFor(30*time.Second, fmt.Sprintf("episode %d: the follower catching up", ep), func() bool {
			return follower.raft.AppliedIndex() >= marker.Index()
		})
	}
	if leader.raft.State() != raft.Leader {
		t.Fatal("leadership changed during the test")
	}
	for i, n := range nodes {
		within(t, 30*time.Second, fmt.Sprintf("Shutdown of n%d", i), func() {
			if err := n.raft.Shutdown().Error(); err != nil {
				t.Errorf("Shutdown of n%d: %v", i, err)
			}
		})
	}
}
