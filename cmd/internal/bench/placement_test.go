package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// placementVMs is the VMs on each of the three nodes.
const placementVMs = 1000

// BenchmarkPlacement measures routing by object on three agents, each
// with its own pivirtd-sim on a unix socket (node-scoped, as the spec
// deploys them), 1,000 VMs on each, in the same process and interleaved:
// GetVM through node1 of a VM on node2 against one on node1 (the added
// hop), and a whole ListVMs through node1 (3,000 VMs from three nodes)
// against node1's own list (host node1: 1,000 VMs). It also reports the
// memory of the placement catalog per object.
func BenchmarkPlacement(b *testing.B) {
	set := knobs(b)
	ctx := b.Context()
	out := os.Stdout

	socks := make([]string, 3)
	direct := make([]vmv1.VMServiceClient, 3)
	for i := range 3 {
		s, err := sim.Open(sim.Config{DataDir: b.TempDir(), Host: fmt.Sprintf("node%d", i+1)})
		if err != nil {
			b.Fatal(err)
		}
		socks[i] = "unix://" + filepath.Join(b.TempDir(), "sim.sock")
		ln, err := sim.Listen(socks[i])
		if err != nil {
			b.Fatal(err)
		}
		gs := grpc.NewServer(s.ServerOptions()...)
		s.Register(gs)
		go func() { _ = gs.Serve(ln) }()
		b.Cleanup(func() { gs.Stop(); _ = s.Close() })
		direct[i] = dialVM(b, socks[i], nil)
	}
	c := agenttest.NewExpect(b, 3, func(i int, cfg *config.Config) {
		cfg.Logging.Level = "warn"
		cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: socks[i], Timeout: config.Duration(30 * time.Second)}}
	})
	c.WaitLeader(60 * time.Second)
	c.WaitPeers(60*time.Second, 3, 0)
	var local, remote string
	for i := range 3 {
		for k := range placementVMs {
			r, err := direct[i].CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: fmt.Sprintf("vm-%d-%d", i, k), Vcpus: 1, MemoryMib: 256}})
			if err != nil {
				b.Fatal(err)
			}
			switch {
			case i == 0 && k == 0:
				local = r.GetVm().GetId()
			case i == 1 && k == 0:
				remote = r.GetVm().GetId()
			}
		}
	}
	node1 := c.Node(0)
	agenttest.Eventually(b, 2*time.Minute, "the catalog holds every VM", func() error {
		_, all, err := node1.FSM().State().Placements("virtualmachines", nil)
		if err != nil || len(all) != 3*placementVMs {
			return fmt.Errorf("%d placements, %v", len(all), err)
		}
		return nil
	})
	api := dialVM(b, node1.APIAddr(), nil)

	get := func(id string) func(int) (op, func()) {
		return func(int) (op, func()) {
			return func(ctx context.Context, _, _ int) error {
				_, err := api.GetVM(ctx, &vmv1.GetVMRequest{Id: id})
				return err
			}, func() {}
		}
	}
	list := func(host string, want int) func(int) (op, func()) {
		return func(int) (op, func()) {
			return func(ctx context.Context, _, _ int) error {
				n, tok := 0, ""
				for {
					r, err := api.ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 1000, PageToken: tok, Host: host})
					if err != nil {
						return err
					}
					n += len(r.GetVms())
					if tok = r.GetNextPageToken(); tok == "" {
						break
					}
				}
				if n != want {
					return fmt.Errorf("listed %d VMs, want %d", n, want)
				}
				return nil
			}, func() {}
		}
	}
	// PIVIRT_BENCH_ONLY picks rows by tag: "get", "list".
	rows := []struct {
		name, refName, tag string
		ref, pv            func(int) (op, func())
		clients            []int
	}{
		{"GetVM", "VM on node1", "get", get(local), get(remote), set.clients},
		{"ListVMs (all pages)", "node1's own 1,000", "list", list("node1", placementVMs), list("", 3*placementVMs), []int{1, 4}},
	}
	var targetsHere []target
	idle := measureIdle(ctx, time.Second)
	fmt.Fprintf(out, "\n%-20s %-18s %7s %10s %10s %6s %17s %17s %17s %14s\n", "call", "reference", "clients", "ref ops/s", "ops/s", "ratio", "ref p50/p99", "p50/p99", "added p50/p99", "CPU µs/op r/c")
	us := func(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Microsecond)) }
	for _, r := range rows {
		if !set.keep(r.tag) {
			continue
		}
		for _, clients := range r.clients {
			var refs, pvs []sample
			for range set.rounds {
				for _, side := range []struct {
					mk  func(int) (op, func())
					acc *[]sample
				}{{r.ref, &refs}, {r.pv, &pvs}} {
					f, done := side.mk(clients)
					*side.acc = append(*side.acc, runLoad(ctx, clients, set.dur, maxOpsPerRun, f))
					done()
				}
			}
			ref, pv := merge(refs), merge(pvs)
			if ref.ops == 0 || pv.ops == 0 || ref.errs+pv.errs > 0 {
				b.Errorf("%s at %d clients: reference %d ok/%d errors (%v), measured %d ok/%d errors (%v)", r.name, clients,
					ref.ops, ref.errs, ref.firstErr, pv.ops, pv.errs, pv.firstErr)
			}
			addP50, addP99 := pv.pct(0.5)-ref.pct(0.5), pv.pct(0.99)-ref.pct(0.99)
			fmt.Fprintf(out, "%-20s %-18s %7d %10.0f %10.0f %6.2f %17s %17s %17s %14s\n", r.name, r.refName, clients, ref.rate(), pv.rate(), ratio(pv.rate(), ref.rate()),
				us(ref.pct(0.5))+"/"+us(ref.pct(0.99))+"µs", us(pv.pct(0.5))+"/"+us(pv.pct(0.99))+"µs", us(addP50)+"/"+us(addP99)+"µs",
				us(ref.cpuPerOp(idle))+"/"+us(pv.cpuPerOp(idle)))
			tag := fmt.Sprintf("%s_%d", r.tag, clients)
			b.ReportMetric(float64(addP50)/float64(time.Microsecond), "added_p50_us_"+tag)
			b.ReportMetric(float64(addP99)/float64(time.Microsecond), "added_p99_us_"+tag)
			b.ReportMetric(ratio(pv.rate(), ref.rate()), "ratio_"+tag)
			if r.tag == "list" {
				var rounds []float64
				for i := range min(len(refs), len(pvs)) {
					rounds = append(rounds, ratio(pvs[i].rate(), refs[i].rate()))
				}
				targetsHere = append(targetsHere, target{bench: "BenchmarkPlacement", what: fmt.Sprintf("ListVMs 3 nodes ÷ one node's own, c=%d", clients),
					got: ratio(pv.rate(), ref.rate()), want: targetClusterList, round: rounds})
			}
		}
	}
	perObject := catalogBytesPerObject(b)
	b.ReportMetric(perObject, "catalog_bytes_per_object")
	targetsHere = append(targetsHere, target{bench: "BenchmarkPlacement", what: "placement catalog heap per object",
		got: perObject, want: targetCatalogBytes, le: true, unit: " B"})
	fmt.Fprintf(out, "\nGetVM: through node1, of a VM on node2 (node1 → node2's agent over the internal port → node2's pivirtd) against one on node1.\n")
	fmt.Fprintf(out, "ListVMs: every page of a list through node1 over 3 nodes × %d VMs against node1's own %d (host node1); ratio = ops/s ÷ reference ops/s.\n", placementVMs, placementVMs)
	fmt.Fprintf(out, "Placement catalog: %.0f bytes of heap per object (100,000 placements in the replicated state). %d cores, interleaved rounds of %s.\n", perObject, runtime.NumCPU(), set.dur)
	fmt.Fprintf(out, "Targets — a report, never a test failure:\n")
	for _, t := range targetsHere {
		reportTarget(out, t)
	}
	fmt.Fprintln(out)
}

// Targets of BenchmarkPlacement.
const (
	targetClusterList  = 0.5 // a 3-node list's ops/s ÷ one node's own list's, at least
	targetCatalogBytes = 400 // placement catalog heap per object, at most
)

// catalogBytesPerObject is the heap the replicated state holds per
// placement, measured over 100,000 of them.
func catalogBytesPerObject(b *testing.B) float64 {
	const n, batch = 100_000, 5_000
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		b.Fatal(err)
	}
	runtime.GC()
	before := heapBytes()
	for start := 0; start < n; start += batch {
		op := &fsmv1.SetPlacements{Node: fmt.Sprintf("node%d", start%3+1)}
		for k := start; k < start+batch; k++ {
			op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: "virtualmachines", Id: fmt.Sprintf("vm-%08x", k)})
		}
		data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_SetPlacements{SetPlacements: op}})
		if err != nil {
			b.Fatal(err)
		}
		if r, ok := f.Apply(&raft.Log{Index: uint64(start/batch + 1), Type: raft.LogCommand, Data: data}).(*fsm.Result); ok && r.Err != nil {
			b.Fatal(r.Err)
		}
	}
	runtime.GC()
	after := heapBytes()
	if _, all, err := f.State().Placements("virtualmachines", nil); err != nil || len(all) != n {
		b.Fatalf("%d placements, %v", len(all), err)
	}
	return float64(after-before) / n
}
