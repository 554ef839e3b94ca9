package bench

import (
	"context"
	"fmt"
	"math"
	"runtime/metrics"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// op is one request of a workload, issued by worker w as its i-th request.
type op func(ctx context.Context, w, i int) error

// sample is what one timed run of a workload measured.
type sample struct {
	ops      int             // successful requests
	errs     int             // failed requests (not in lat)
	elapsed  time.Duration   // start to the last worker's return
	cpu      time.Duration   // CPU time of the whole process meanwhile
	allocs   uint64          // heap allocations of the whole process meanwhile
	lat      []time.Duration // latency of each successful request
	firstErr error
}

func (s sample) rate() float64 {
	if s.elapsed <= 0 {
		return 0
	}
	return float64(s.ops) / s.elapsed.Seconds()
}

// opGrace bounds how long a request still running at the end of a run may
// take before the run's context cancels it.
const opGrace = 15 * time.Second

// runLoad runs op from clients concurrent workers, each issuing requests
// back to back (closed loop), until dur has passed or maxOps requests were
// started. Bounded in time (dur + opGrace) and in count (maxOps).
func runLoad(ctx context.Context, clients int, dur time.Duration, maxOps int, f op) sample {
	ctx, cancel := context.WithTimeout(ctx, dur+opGrace)
	defer cancel()
	lats := make([][]time.Duration, clients)
	errs := make([]int, clients)
	var (
		budget   atomic.Int64
		errMu    sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	budget.Store(int64(maxOps))
	cpu0, allocs0 := processCPU(), heapAllocs()
	start := time.Now()
	deadline := start.Add(dur)
	for w := range clients {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 4096)
			for i := 0; ; i++ {
				t0 := time.Now()
				if !t0.Before(deadline) || budget.Add(-1) < 0 || ctx.Err() != nil {
					break
				}
				err := f(ctx, w, i)
				d := time.Since(t0)
				if err != nil {
					errs[w]++
					errMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
					continue
				}
				lat = append(lat, d)
			}
			lats[w] = lat
		})
	}
	wg.Wait()
	s := sample{elapsed: time.Since(start), cpu: processCPU() - cpu0, allocs: heapAllocs() - allocs0, firstErr: firstErr}
	for w := range clients {
		s.ops += len(lats[w])
		s.errs += errs[w]
		s.lat = append(s.lat, lats[w]...)
	}
	return s
}

// merged is a workload's samples of every round taken together.
type merged struct {
	ops, errs    int
	elapsed, cpu time.Duration
	allocs       uint64
	sorted       []time.Duration
	rounds       []float64       // ops/s of each round
	roundP50     []time.Duration // p50 latency of each round
	firstErr     error
}

func merge(samples []sample) merged {
	var m merged
	for _, s := range samples {
		m.ops += s.ops
		m.errs += s.errs
		m.elapsed += s.elapsed
		m.cpu += s.cpu
		m.allocs += s.allocs
		m.sorted = append(m.sorted, s.lat...)
		m.rounds = append(m.rounds, s.rate())
		m.roundP50 = append(m.roundP50, merged{sorted: slices.Sorted(slices.Values(s.lat))}.pct(0.5))
		if m.firstErr == nil {
			m.firstErr = s.firstErr
		}
	}
	slices.Sort(m.sorted)
	return m
}

// rate is the throughput over all rounds: total requests / total time.
func (m merged) rate() float64 {
	if m.elapsed <= 0 {
		return 0
	}
	return float64(m.ops) / m.elapsed.Seconds()
}

// cpuPerOp is the process CPU time per successful request (servers and
// load generator) after taking off idle CPU seconds per second.
func (m merged) cpuPerOp(idle float64) time.Duration {
	if m.ops == 0 {
		return 0
	}
	net := m.cpu - time.Duration(idle*float64(m.elapsed))
	return max(net, 0) / time.Duration(m.ops)
}

// allocsPerOp is the process's heap allocations per successful request
// (servers and load generator; the idle cluster's few are not taken off).
func (m merged) allocsPerOp() float64 {
	if m.ops == 0 {
		return 0
	}
	return float64(m.allocs) / float64(m.ops)
}

// heapAllocs is the number of heap objects the process has allocated
// (runtime/metrics: no stop-the-world, unlike runtime.ReadMemStats).
func heapAllocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// pct returns the p-quantile (0 < p <= 1) of the latencies, nearest rank.
func (m merged) pct(p float64) time.Duration {
	if len(m.sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(m.sorted)))) - 1
	return m.sorted[max(i, 0)]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond)) }

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
