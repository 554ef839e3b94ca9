package fsm

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// benchInstances is how many instances the benchmarks keep in the services
// table: every write re-registers one of them, as the replicated-write
// benchmark of cmd/internal/bench does.
const benchInstances = 10_000

// benchStep is the leader time between two benchmark writes (8k writes/s).
// With benchWindow as the dedupe window, the dedupe table holds about
// benchWindow/benchStep records in steady state, and every write prunes.
const (
	benchStep   = 125 * time.Microsecond
	benchWindow = time.Second
)

// benchLog produces encoded register_service entries with client IDs,
// increasing indexes, sequences and times.
type benchLog struct {
	b     *testing.B
	index uint64
	now   time.Time
}

func (g *benchLog) next() *raft.Log {
	g.index++
	g.now = g.now.Add(benchStep)
	in := instance("bench", fmt.Sprintf("instance-%05d", g.index%benchInstances))
	cmd := withClient(register(in), fmt.Sprintf("client-%d", g.index%8), g.index)
	cmd.Time = timestamppb.New(g.now)
	data, err := Encode(cmd)
	if err != nil {
		g.b.Fatal(err)
	}
	return &raft.Log{Index: g.index, Term: 1, Type: raft.LogCommand, Data: data}
}

// logs returns the next n entries.
func (g *benchLog) logs(n int) []*raft.Log {
	out := make([]*raft.Log, n)
	for i := range out {
		out[i] = g.next()
	}
	return out
}

// newBenchFSM returns an FSM holding benchInstances instances and a
// steady-state dedupe table, and the generator of the following entries.
func newBenchFSM(b *testing.B) (*FSM, *benchLog) {
	b.Helper()
	cfg := testConfig()
	cfg.DedupeWindow = benchWindow
	f, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	g := &benchLog{b: b, now: t0}
	for range 2 * benchInstances {
		if res := f.Apply(g.next()).(*Result); res.Err != nil {
			b.Fatal(res.Err)
		}
	}
	return f, g
}

// benchApply applies b.N entries in batches of batch entries (one Apply per
// entry when batch is 1): ns/op and allocs/op are per entry. Entries are
// encoded in chunks outside the timer.
func benchApply(b *testing.B, batch int) {
	f, g := newBenchFSM(b)
	const chunk = 64 * 64
	b.ReportAllocs()
	b.ResetTimer()
	for done := 0; done < b.N; {
		b.StopTimer()
		logs := g.logs(min(chunk, b.N-done))
		b.StartTimer()
		for i := 0; i < len(logs); i += batch {
			part := logs[i:min(i+batch, len(logs))]
			if batch == 1 {
				if res := f.Apply(part[0]).(*Result); res.Err != nil {
					b.Fatal(res.Err)
				}
				continue
			}
			for _, r := range applyBatch(f, part) {
				if res := r.(*Result); res.Err != nil {
					b.Fatal(res.Err)
				}
			}
		}
		done += len(logs)
	}
}

// applyBatch applies logs with ApplyBatch when the FSM has it, else one at
// a time as raft does for an FSM without batching.
func applyBatch(f raft.FSM, logs []*raft.Log) []any {
	if bf, ok := f.(raft.BatchingFSM); ok {
		return bf.ApplyBatch(logs)
	}
	out := make([]any, len(logs))
	for i, l := range logs {
		out[i] = f.Apply(l)
	}
	return out
}

// BenchmarkApply applies register_service commands with client IDs one
// entry at a time. ns/op is per entry.
func BenchmarkApply(b *testing.B) { benchApply(b, 1) }

// BenchmarkApplyBatch64 applies the same commands in batches of 64 entries,
// as raft's FSM goroutine hands them over under load. ns/op is per entry.
func BenchmarkApplyBatch64(b *testing.B) { benchApply(b, 64) }

// BenchmarkApplyBatch8 is the same with batches of 8 entries, closer to
// what raft hands over under moderate load.
func BenchmarkApplyBatch8(b *testing.B) { benchApply(b, 8) }

// BenchmarkStateMemory measures what the state costs in memory: the Go heap
// held by 100,000 registered instances (without client IDs) and, on top of
// them, by the dedupe records of 100,000 writes with client IDs that are all
// within the dedupe window. It reports bytes per instance and per dedupe
// record, and the instance figure as a ratio to the instances' encoded size
// (the reference: what a snapshot stores).
func BenchmarkStateMemory(b *testing.B) {
	const n = 100_000
	entries := func(clientIDs bool, first uint64) []*raft.Log {
		out := make([]*raft.Log, n)
		now := t0.Add(time.Duration(first) * time.Millisecond)
		for i := range n {
			now = now.Add(time.Millisecond)
			cmd := register(&clusterv1.ServiceInstance{
				Service: fmt.Sprintf("svc-%03d", i%200), InstanceId: fmt.Sprintf("i-%07d", i), Node: "node-042",
				Address: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), Port: 8080, Tags: []string{"scale"},
			})
			if clientIDs {
				cmd = withClient(cmd, fmt.Sprintf("gw-node%03d-%08x", i%100, i%100), uint64(i+1))
			}
			cmd.Time = timestamppb.New(now)
			data, err := Encode(cmd)
			if err != nil {
				b.Fatal(err)
			}
			out[i] = &raft.Log{Index: first + uint64(i), Term: 1, Type: raft.LogCommand, Data: data}
		}
		return out
	}
	heap := func() uint64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	var perInstance, perDedupe, encoded float64
	for b.Loop() {
		b.StopTimer()
		plain, withIDs := entries(false, 1), entries(true, n+1)
		b.StartTimer()
		h0 := heap()
		f, err := New(testConfig())
		if err != nil {
			b.Fatal(err)
		}
		for _, l := range plain {
			if res := f.Apply(l).(*Result); res.Err != nil {
				b.Fatal(res.Err)
			}
		}
		h1 := heap()
		runtime.KeepAlive(plain) // the entries count in h0, h1 and h2 alike
		// The same instances again, now with client IDs: the records are
		// replaced one for one, the dedupe records are added.
		for _, l := range withIDs {
			if res := f.Apply(l).(*Result); res.Err != nil {
				b.Fatal(res.Err)
			}
		}
		h2 := heap()
		runtime.KeepAlive(withIDs)
		_, insts, err := f.State().Services("", nil)
		if err != nil || len(insts) != n {
			b.Fatalf("%d instances, %v", len(insts), err)
		}
		size := 0
		for _, in := range insts {
			size += proto.Size(in)
		}
		perInstance = float64(h1-h0) / n
		perDedupe = (float64(h2) - float64(h1)) / n
		encoded = float64(size) / n
		runtime.KeepAlive(f)
	}
	b.ReportMetric(perInstance, "heap-B/instance")
	b.ReportMetric(perDedupe, "heap-B/dedupe-record")
	b.ReportMetric(perInstance/encoded, "x-encoded-size")
}
