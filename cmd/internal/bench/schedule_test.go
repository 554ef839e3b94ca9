package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// scheduleCount is how many schedules share one slot.
const scheduleCount = 1000

// scheduleTarget is the p99 lateness the 1,000 at once should stay within.
const scheduleTarget = time.Second

// BenchmarkScheduleLateness measures, on a 3-node cluster with a
// simulated pivirtd, how late power-schedule actions reach the backend
// when 1,000 schedules (one VM each, reboot) are due at the same minute:
// lateness is from the slot to the backend call (a run's finish minus its
// latency). The reference, in the same process, is one schedule alone
// (@every 1s, ten slots). It reports p50 and p99 of both and the ratio of
// the p99s, and a verdict against the target: p99 of the 1,000 at most
// scheduleTarget (printed, never asserted). One run takes about two
// minutes whatever b.N.
func BenchmarkScheduleLateness(b *testing.B) {
	ctx := b.Context()
	simAddr := startSim(b)

	c := agenttest.NewExpect(b, 3, func(_ int, cfg *config.Config) {
		cfg.Logging.Level = "warn"
		cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: simAddr, Timeout: config.Duration(30 * time.Second)}}
		cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}}}
	})
	leader := c.WaitLeader(60 * time.Second)
	cc, err := grpc.NewClient(leader.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cc.Close() })
	vms, scheds := vmv1.NewVMServiceClient(cc), schedulev1.NewScheduleServiceClient(cc)

	// 1,000 running VMs, made in parallel.
	ids := make([]string, scheduleCount)
	parallel(b, scheduleCount, func(i int) error {
		r, err := vms.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: fmt.Sprintf("vm-%04d", i), Vcpus: 1, MemoryMib: 256}})
		if err != nil {
			return err
		}
		ids[i] = r.GetVm().GetId()
		_, err = vms.PowerOn(ctx, &vmv1.PowerOnRequest{Id: ids[i]})
		return err
	})

	// Reference: one schedule alone.
	if _, err := scheds.CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
		Id: "reference", VmId: ids[0], Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1s", Enabled: true,
	}}); err != nil {
		b.Fatal(err)
	}
	ref := waitLateness(b, scheds, []string{"reference"}, 10, time.Minute)
	if _, err := scheds.DeleteSchedule(ctx, &schedulev1.DeleteScheduleRequest{Id: "reference"}); err != nil {
		b.Fatal(err)
	}

	// 1,000 schedules due at the first minute at least 40 s away.
	slot := time.Now().Add(40 * time.Second).Truncate(time.Minute).Add(time.Minute)
	cron := fmt.Sprintf("%d %d * * *", slot.UTC().Minute(), slot.UTC().Hour())
	names := make([]string, scheduleCount)
	parallel(b, scheduleCount, func(i int) error {
		names[i] = fmt.Sprintf("at-once-%04d", i)
		_, err := scheds.CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
			Id: names[i], VmId: ids[i], Action: schedulev1.Action_ACTION_REBOOT, Cron: cron, Enabled: true,
		}})
		return err
	})
	if time.Now().After(slot) {
		b.Fatalf("creating %d schedules took past their slot %s", scheduleCount, slot)
	}
	all := waitLateness(b, scheds, names, 1, time.Until(slot)+2*time.Minute)

	p := func(d []time.Duration, q float64) time.Duration { return d[min(len(d)-1, int(q*float64(len(d))))] }
	ratio := float64(p(all, .99)) / float64(max(p(ref, .99), time.Microsecond))
	b.ReportMetric(float64(p(all, .5).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p(all, .99).Microseconds())/1000, "p99-ms")
	b.ReportMetric(ratio, "p99-ratio")
	fmt.Fprintf(os.Stdout, "schedule lateness, slot to backend call, 3 nodes: %d schedules at once p50 %s p99 %s max %s; one schedule alone p50 %s p99 %s; p99 ratio %.1f\n",
		scheduleCount, p(all, .5).Round(time.Millisecond), p(all, .99).Round(time.Millisecond), all[len(all)-1].Round(time.Millisecond),
		p(ref, .5).Round(time.Millisecond), p(ref, .99).Round(time.Millisecond), ratio)
	reportTarget(os.Stdout, target{bench: "BenchmarkScheduleLateness", what: fmt.Sprintf("%d schedules due at once: p99 lateness", scheduleCount),
		got: float64(p(all, .99).Milliseconds()), want: float64(scheduleTarget.Milliseconds()), le: true, unit: " ms"})
}

// parallel runs f(0..n-1) on 32 workers, failing b on the first error.
func parallel(b *testing.B, n int, f func(i int) error) {
	b.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	next := make(chan int)
	for range 32 {
		wg.Go(func() {
			for i := range next {
				if err := f(i); err != nil {
					mu.Lock()
					first = cmpOr(first, err)
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		b.Fatal(first)
	}
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// waitLateness waits until each schedule has runs ok runs (within limit),
// and returns their lateness (backend call minus slot), sorted.
func waitLateness(b *testing.B, scheds schedulev1.ScheduleServiceClient, ids []string, runs int, limit time.Duration) []time.Duration {
	b.Helper()
	var out []time.Duration
	deadline := time.Now().Add(limit)
	for _, id := range ids {
		for {
			ctx, cancel := context.WithTimeout(b.Context(), 10*time.Second)
			r, err := scheds.ListRuns(ctx, &schedulev1.ListRunsRequest{ScheduleId: id})
			cancel()
			if err != nil {
				b.Fatal(err)
			}
			var ok []*schedulev1.Run
			for _, run := range r.GetRuns() {
				switch run.GetOutcome() {
				case schedulev1.RunOutcome_RUN_OUTCOME_OK:
					ok = append(ok, run)
				case schedulev1.RunOutcome_RUN_OUTCOME_ERROR, schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED:
					b.Fatalf("schedule %s: run %v", id, run)
				}
			}
			if len(ok) >= runs {
				for _, run := range ok {
					call := run.GetFinishedAt().AsTime().Add(-run.GetLatency().AsDuration())
					out = append(out, call.Sub(run.GetSlot().AsTime()))
				}
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("schedule %s: %d of %d runs by the deadline", id, len(ok), runs)
			}
			time.Sleep(200 * time.Millisecond) // poll, bounded by the deadline
		}
	}
	slices.Sort(out)
	return out
}

// startSim serves a simulated pivirtd on 127.0.0.1 until the benchmark
// ends and returns its address.
func startSim(b *testing.B) string {
	b.Helper()
	s, err := sim.Open(sim.Config{DataDir: b.TempDir(), Host: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	ln, err := sim.Listen("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	gs := grpc.NewServer(s.ServerOptions()...)
	s.Register(gs)
	go func() { _ = gs.Serve(ln) }()
	b.Cleanup(func() { gs.Stop(); _ = s.Close() })
	return ln.Addr().String()
}
