package bench

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// Targets of the gateway issue (point 9).
const (
	targetAddedP50   = 100 * time.Microsecond // gateway p50 minus direct p50, at most
	targetAddedP99   = time.Millisecond       // gateway p99 minus direct p99, at most
	targetGatewayTpt = 0.70                   // gateway ops/s ÷ direct ops/s, at least
)

// BenchmarkGateway measures the gateway hop: the same calls to a
// pivirtd-sim made directly with grpc-go and through an agent's API port
// (gRPC in, gRPC out), interleaved in the same process, for a unary call
// (GetVM) and a message round trip on a bidi stream (Console), at 1 and 64
// concurrent callers. It reports the added latency and the throughput
// ratio against the targets.
func BenchmarkGateway(b *testing.B) {
	set := knobs(b)
	ctx := b.Context()
	out := os.Stdout

	simAddr := startSim(b)

	c := agenttest.NewExpect(b, 1, func(_ int, cfg *config.Config) {
		cfg.Logging.Level = "warn"
		cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: simAddr}}
		cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}}}
	})
	node := c.WaitLeader(60 * time.Second)
	dial := func(addr string) vmv1.VMServiceClient {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cc.Close() })
		return vmv1.NewVMServiceClient(cc)
	}
	direct, gateway := dial(simAddr), dial(node.APIAddr())
	// The floor of any gRPC-terminating hop: a hand-written relay, typed
	// GetVM and Console with grpc-go on both sides and nothing else.
	rln, err := sim.Listen("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	rs := grpc.NewServer()
	vmv1.RegisterVMServiceServer(rs, relay{next: direct})
	go func() { _ = rs.Serve(rln) }()
	b.Cleanup(rs.Stop)
	relayed := dial(rln.Addr().String())
	created, err := direct.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "bench", Vcpus: 2, MemoryMib: 2048}})
	if err != nil {
		b.Fatal(err)
	}
	id := created.GetVm().GetId()
	if _, err := direct.PowerOn(ctx, &vmv1.PowerOnRequest{Id: id}); err != nil {
		b.Fatal(err)
	}

	unary := func(api vmv1.VMServiceClient) func(int) (op, func()) {
		return func(int) (op, func()) {
			return func(ctx context.Context, _, _ int) error {
				_, err := api.GetVM(ctx, &vmv1.GetVMRequest{Id: id})
				return err
			}, func() {}
		}
	}
	// One console stream per worker, opened before the timed run; an op
	// is one input echoed back.
	stream := func(api vmv1.VMServiceClient) func(int) (op, func()) {
		return func(clients int) (op, func()) {
			sctx, cancel := context.WithCancel(ctx)
			streams := make([]grpc.BidiStreamingClient[vmv1.ConsoleRequest, vmv1.ConsoleResponse], clients)
			for w := range clients {
				st, err := api.Console(sctx)
				if err == nil {
					err = st.Send(&vmv1.ConsoleRequest{Id: id})
				}
				if err == nil {
					_, err = st.Recv() // the banner
				}
				if err != nil {
					b.Fatalf("open console stream: %v", err)
				}
				streams[w] = st
			}
			input := []byte("echo hello\n")
			return func(_ context.Context, w, _ int) error {
				if err := streams[w].Send(&vmv1.ConsoleRequest{Input: input}); err != nil {
					return err
				}
				_, err := streams[w].Recv()
				return err
			}, cancel
		}
	}

	type row struct {
		name                   string
		direct, gateway, relay func(int) (op, func())
	}
	rows := []row{
		{"GetVM (unary)", unary(direct), unary(gateway), unary(relayed)},
		{"Console (bidi message)", stream(direct), stream(gateway), stream(relayed)},
	}
	type res struct {
		name                  string
		clients               int
		direct, viaAPI, relay merged
	}
	idle := measureIdle(ctx, time.Second)
	var results []res
	for _, r := range rows {
		for _, clients := range set.clients {
			var ds, gws, rls []sample
			// Interleaved: direct, gateway, relay, direct, gateway, ...
			for range set.rounds {
				for _, side := range []struct {
					mk  func(int) (op, func())
					acc *[]sample
				}{{r.direct, &ds}, {r.gateway, &gws}, {r.relay, &rls}} {
					f, done := side.mk(clients)
					*side.acc = append(*side.acc, runLoad(ctx, clients, set.dur, maxOpsPerRun, f))
					done()
				}
			}
			results = append(results, res{name: r.name, clients: clients, direct: merge(ds), viaAPI: merge(gws), relay: merge(rls)})
		}
	}

	fmt.Fprintf(out, "\n%-24s %7s %12s %12s %6s %17s %17s %17s %14s %18s\n", "call", "clients", "direct ops/s", "gateway ops/s", "ratio", "direct p50/p99", "gateway p50/p99", "added p50/p99", "CPU µs/op d/g", "relay ratio/added")
	us := func(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Microsecond)) }
	var verdicts []string
	for _, r := range results {
		if r.direct.ops == 0 || r.viaAPI.ops == 0 || r.direct.errs+r.viaAPI.errs > 0 {
			b.Errorf("%s at %d clients: direct %d ok/%d errors (%v), gateway %d ok/%d errors (%v)", r.name, r.clients,
				r.direct.ops, r.direct.errs, r.direct.firstErr, r.viaAPI.ops, r.viaAPI.errs, r.viaAPI.firstErr)
		}
		addP50 := r.viaAPI.pct(0.5) - r.direct.pct(0.5)
		addP99 := r.viaAPI.pct(0.99) - r.direct.pct(0.99)
		tpt := ratio(r.viaAPI.rate(), r.direct.rate())
		fmt.Fprintf(out, "%-24s %7d %12.0f %12.0f %6.2f %17s %17s %17s %14s %18s\n", r.name, r.clients, r.direct.rate(), r.viaAPI.rate(), tpt,
			us(r.direct.pct(0.5))+"/"+us(r.direct.pct(0.99))+"µs", us(r.viaAPI.pct(0.5))+"/"+us(r.viaAPI.pct(0.99))+"µs",
			us(addP50)+"/"+us(addP99)+"µs", us(r.direct.cpuPerOp(idle))+"/"+us(r.viaAPI.cpuPerOp(idle)),
			fmt.Sprintf("%.2f/%sµs", ratio(r.relay.rate(), r.direct.rate()), us(r.relay.pct(0.5)-r.direct.pct(0.5))))
		tag := fmt.Sprintf("%s_%d", map[string]string{"GetVM (unary)": "unary", "Console (bidi message)": "stream"}[r.name], r.clients)
		b.ReportMetric(float64(addP50)/float64(time.Microsecond), "added_p50_us_"+tag)
		b.ReportMetric(float64(addP99)/float64(time.Microsecond), "added_p99_us_"+tag)
		b.ReportMetric(tpt, "ratio_"+tag)
		check := func(what string, pass bool, got, want string) {
			v := "PASS"
			if !pass {
				v = "BELOW TARGET"
			}
			verdicts = append(verdicts, fmt.Sprintf("  %-13s %-24s clients=%-2d %-26s %s (want %s)", v, r.name, r.clients, what, got, want))
		}
		check("added p50", addP50 <= targetAddedP50, us(addP50)+"µs", "<= "+us(targetAddedP50)+"µs")
		check("added p99", addP99 <= targetAddedP99, us(addP99)+"µs", "<= "+us(targetAddedP99)+"µs")
		check("throughput gateway/direct", tpt >= targetGatewayTpt, fmt.Sprintf("%.2f", tpt), fmt.Sprintf(">= %.2f", targetGatewayTpt))
	}
	fmt.Fprintf(out, "\nadded = gateway − direct latency (same calls, same process, interleaved rounds of %s);\n", set.dur)
	fmt.Fprintf(out, "ratio = gateway ops/s ÷ direct ops/s; CPU µs/op = process CPU (client, agent and simulator) per call, direct/gateway:\n")
	fmt.Fprintf(out, "  with every process on the same %d cores, the throughput ratio at saturation is about direct CPU ÷ gateway CPU.\n", runtime.NumCPU())
	fmt.Fprintf(out, "relay = a hand-written typed grpc-go relay (no routing, balancing, metrics): the floor of any gRPC-terminating hop.\n")
	fmt.Fprintf(out, "Targets (gateway issue, point 9) — a report, never a test failure:\n")
	for _, v := range verdicts {
		fmt.Fprintln(out, v)
	}
	fmt.Fprintln(out)
}

// relay is the reference hop: GetVM and Console forwarded by typed grpc-go
// code.
type relay struct {
	vmv1.UnimplementedVMServiceServer
	next vmv1.VMServiceClient
}

func (r relay) GetVM(ctx context.Context, req *vmv1.GetVMRequest) (*vmv1.GetVMResponse, error) {
	return r.next.GetVM(ctx, req)
}

func (r relay) Console(in grpc.BidiStreamingServer[vmv1.ConsoleRequest, vmv1.ConsoleResponse]) error {
	out, err := r.next.Console(in.Context())
	if err != nil {
		return err
	}
	go func() {
		for {
			m, err := in.Recv()
			if err != nil {
				_ = out.CloseSend()
				return
			}
			if out.Send(m) != nil {
				return
			}
		}
	}()
	for {
		m, err := out.Recv()
		if err != nil {
			return err
		}
		if err := in.Send(m); err != nil {
			return err
		}
	}
}
