package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// Targets of the gateway issue (point 9): the gateway against a direct call.
const (
	targetAddedP50   = 100 * time.Microsecond // gateway p50 minus direct p50, at most
	targetAddedP99   = time.Millisecond       // gateway p99 minus direct p99, at most
	targetGatewayTpt = 0.70                   // gateway ops/s ÷ direct ops/s, at least
)

// Targets of issue 25 (point 4): the gateway against the proxies a user
// would put there.
const (
	targetVsRelayTpt = 0.90 // gateway ops/s ÷ bare relay ops/s at the most callers, at least
	// gateway CPU per call ÷ HAProxy's (its own processes' included) at
	// the most callers, at most
	targetVsHAProxyCPU = 1.3
)

// gwPath is one way to the simulator: a client and, for a proxy running
// as a process of its own, that process's CPU time.
type gwPath struct {
	name string
	api  vmv1.VMServiceClient
	cpu  func() time.Duration // CPU outside this process; nil: none
}

// gwMode is one set of paths to the same simulator: all in plaintext, or
// all with mutual TLS on both legs.
type gwMode struct {
	name    string
	paths   []gwPath
	skipped []string // why a proxy's rows are missing
}

// BenchmarkGateway measures the gateway hop against the proxies a user
// would put in its place: the same calls to one pivirtd-sim on a unix
// socket made directly with grpc-go, through an agent's API port (gRPC in,
// the proxy, gRPC out), through a bare typed grpc-go relay, through
// HAProxy and through nginx, interleaved in the same process, for a unary
// call (GetVM) and a message round trip on a bidi stream (Console), at 1
// and 64 concurrent callers, in plaintext and with mutual TLS on both legs.
// It reports the added latency and the throughput ratios against the
// targets.
func BenchmarkGateway(b *testing.B) {
	set := knobs(b)
	ctx := b.Context()
	out := os.Stdout
	// Every hop gets the same number of threads: the agent runs in this
	// process, whose GOMAXPROCS it shares with the clients and the
	// simulator; HAProxy gets as many threads (nbthread), nginx as many
	// worker processes.
	threads := runtime.GOMAXPROCS(0)
	pki := newBenchPKI(b)

	s, err := sim.Open(sim.Config{DataDir: b.TempDir(), Host: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })
	sockDir := b.TempDir()
	// One simulator behind two unix sockets: plaintext, and mutual TLS.
	serve := func(name string, tlsOn bool) string {
		path := filepath.Join(sockDir, name)
		ln, err := sim.Listen("unix://" + path)
		if err != nil {
			b.Fatal(err)
		}
		opts := s.ServerOptions()
		if tlsOn {
			opts = append(opts, grpc.Creds(credentials.NewTLS(pki.serverTLS())))
		}
		gs := grpc.NewServer(opts...)
		s.Register(gs)
		go func() { _ = gs.Serve(ln) }()
		b.Cleanup(gs.Stop)
		return path
	}
	plainSock, tlsSock := serve("pivirtd.sock", false), serve("pivirtd-tls.sock", true)

	created, err := dialVM(b, "unix://"+plainSock, nil).CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "bench", Vcpus: 2, MemoryMib: 2048}})
	if err != nil {
		b.Fatal(err)
	}
	id := created.GetVm().GetId()
	if _, err := dialVM(b, "unix://"+plainSock, nil).PowerOn(ctx, &vmv1.PowerOnRequest{Id: id}); err != nil {
		b.Fatal(err)
	}

	var modes []gwMode
	for _, m := range []struct {
		name string
		sock string
		pki  *benchPKI
	}{{"plaintext", plainSock, nil}, {"mtls", tlsSock, pki}} {
		mode := gwMode{name: m.name}
		// PIVIRT_BENCH_ONLY matches <mode>/<path>/<call>, such as
		// plaintext/gateway/unary.
		keep := func(path string) bool {
			return set.keep(m.name+"/"+path+"/unary") || set.keep(m.name+"/"+path+"/stream")
		}
		if keep("direct") {
			mode.paths = append(mode.paths, gwPath{name: "direct", api: dialVM(b, "unix://"+m.sock, m.pki)})
		}
		if keep("gateway") {
			c := agenttest.NewExpect(b, 1, func(_ int, cfg *config.Config) {
				cfg.Logging.Level = "warn"
				cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: "unix://" + m.sock}}
				cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}}}
				if m.pki != nil {
					// The deployment's mutual TLS: the API port asks for a
					// client certificate of the CA (and so runs access
					// control), the backend leg presents the agent's.
					cfg.TLS = config.TLSConfig{Enabled: true, VerifyPeer: true, CAFile: m.pki.Chain, CertFile: m.pki.AgentCert, KeyFile: m.pki.AgentKey}
					cfg.Server.ConnectRPC.TLS = config.ServerTLSConfig{CertFile: m.pki.ServerCert, KeyFile: m.pki.ServerKey, CAFile: m.pki.Chain, ClientCAFile: m.pki.Chain}
					cfg.Backends["pivirtd"] = config.BackendConfig{Endpoint: "unix://" + m.sock, TLS: config.BackendTLSConfig{Enabled: true}}
				}
			})
			node := c.WaitLeader(60 * time.Second)
			mode.paths = append(mode.paths, gwPath{name: "gateway", api: dialVM(b, node.APIAddr(), m.pki)})
		}
		if keep("relay") {
			// The floor of any gRPC-terminating hop: a hand-written relay,
			// typed GetVM and Console with grpc-go on both sides and
			// nothing else.
			rln, err := sim.Listen("127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			var opts []grpc.ServerOption
			if m.pki != nil {
				opts = append(opts, grpc.Creds(credentials.NewTLS(m.pki.serverTLS())))
			}
			rs := grpc.NewServer(opts...)
			vmv1.RegisterVMServiceServer(rs, relay{next: dialVM(b, "unix://"+m.sock, m.pki)})
			go func() { _ = rs.Serve(rln) }()
			b.Cleanup(rs.Stop)
			mode.paths = append(mode.paths, gwPath{name: "relay", api: dialVM(b, rln.Addr().String(), m.pki)})
		}
		for _, name := range []string{"haproxy", "nginx"} {
			if !keep(name) {
				continue
			}
			p, err := startProxy(b, name, threads, m.sock, m.pki, id)
			if err != nil {
				mode.skipped = append(mode.skipped, fmt.Sprintf("%s (%s): rows skipped: %v", name, m.name, err))
				continue
			}
			mode.paths = append(mode.paths, gwPath{name: name, api: dialVM(b, p.addr, m.pki), cpu: p.cpu})
		}
		if len(mode.paths) > 0 {
			modes = append(modes, mode)
		}
	}
	for _, m := range modes {
		for _, msg := range m.skipped {
			fmt.Fprintln(out, "SKIPPED:", msg)
		}
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
	type call struct {
		name, tag string
		mk        func(vmv1.VMServiceClient) func(int) (op, func())
	}
	calls := []call{{"GetVM (unary)", "unary", unary}, {"Console (bidi message)", "stream", stream}}

	// Warm-up, discarded: connections, TLS sessions, the proxies' pools.
	for _, m := range modes {
		for _, p := range m.paths {
			f, done := unary(p.api)(16)
			runLoad(ctx, 16, 500*time.Millisecond, maxOpsPerRun, f)
			done()
		}
	}

	type res struct {
		mode    string
		call    call
		clients int
		by      map[string]merged
		paths   []string
	}
	idle := measureIdle(ctx, time.Second)
	var results []res
	for _, m := range modes {
		for _, c := range calls {
			for _, clients := range set.clients {
				acc := make([][]sample, len(m.paths))
				for round := range set.rounds {
					// Interleaved, and reversed every other round so that
					// a drift hits every path alike.
					order := make([]int, len(m.paths))
					for i := range order {
						order[i] = i
					}
					if round%2 == 1 {
						slices.Reverse(order)
					}
					for _, i := range order {
						p := m.paths[i]
						if !set.keep(m.name + "/" + p.name + "/" + c.tag) {
							continue
						}
						f, done := c.mk(p.api)(clients)
						var c0 time.Duration
						if p.cpu != nil {
							c0 = p.cpu()
						}
						smp := runLoad(ctx, clients, set.dur, maxOpsPerRun, f)
						if p.cpu != nil {
							smp.cpu += p.cpu() - c0
						}
						done()
						acc[i] = append(acc[i], smp)
					}
				}
				r := res{mode: m.name, call: c, clients: clients, by: map[string]merged{}}
				for i, p := range m.paths {
					if len(acc[i]) == 0 {
						continue
					}
					r.by[p.name] = merge(acc[i])
					r.paths = append(r.paths, p.name)
				}
				if len(r.paths) > 0 {
					results = append(results, r)
				}
			}
		}
	}

	us := func(d time.Duration) string { return fmt.Sprintf("%.0f", float64(d)/float64(time.Microsecond)) }
	fmt.Fprintf(out, "\n%-9s %-22s %7s %-8s %10s %7s %15s %15s %10s %10s\n", "mode", "call", "clients", "path", "ops/s", "×direct", "p50/p99 µs", "added p50/p99", "CPU µs/op", "allocs/op")
	for _, r := range results {
		d, hasDirect := r.by["direct"]
		for _, name := range r.paths {
			m := r.by[name]
			if m.ops == 0 || m.errs > 0 {
				b.Errorf("%s %s at %d clients via %s: %d ok/%d errors (%v)", r.mode, r.call.name, r.clients, name, m.ops, m.errs, m.firstErr)
			}
			tpt, added := "-", "-"
			if hasDirect {
				tpt = fmt.Sprintf("%.2f", ratio(m.rate(), d.rate()))
				added = us(m.pct(0.5)-d.pct(0.5)) + "/" + us(m.pct(0.99)-d.pct(0.99))
			}
			fmt.Fprintf(out, "%-9s %-22s %7d %-8s %10.0f %7s %15s %15s %10s %10.0f\n", r.mode, r.call.name, r.clients, name, m.rate(), tpt,
				us(m.pct(0.5))+"/"+us(m.pct(0.99)), added, us(m.cpuPerOp(idle)), m.allocsPerOp())
			if hasDirect && name != "direct" {
				tag := fmt.Sprintf("%s_%s_%s_%d", name, r.mode, r.call.tag, r.clients)
				b.ReportMetric(float64(m.pct(0.5)-d.pct(0.5))/float64(time.Microsecond), "added_p50_us_"+tag)
				b.ReportMetric(ratio(m.rate(), d.rate()), "ratio_"+tag)
			}
		}
	}

	// Verdicts: a report, never a test failure. Throughput ratios carry
	// each round's own; latencies are of every round's calls together.
	var verdicts []target
	check := func(r res, what string, got, want float64, le bool, unit string, rounds []float64) {
		verdicts = append(verdicts, target{bench: "BenchmarkGateway",
			what: fmt.Sprintf("%s %s c=%d: %s", r.mode, r.call.tag, r.clients, what),
			got:  got, want: want, le: le, unit: unit, round: rounds})
	}
	perRound := func(a, b merged) []float64 {
		var out []float64
		for i := range min(len(a.rounds), len(b.rounds)) {
			out = append(out, ratio(a.rounds[i], b.rounds[i]))
		}
		return out
	}
	usf := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	lo, hi := slices.Min(set.clients), slices.Max(set.clients)
	for _, r := range results {
		d, okD := r.by["direct"]
		g, okG := r.by["gateway"]
		if !okG {
			continue
		}
		if okD {
			check(r, "added p50", usf(g.pct(0.5)-d.pct(0.5)), usf(targetAddedP50), true, "µs", nil)
			check(r, "added p99", usf(g.pct(0.99)-d.pct(0.99)), usf(targetAddedP99), true, "µs", nil)
			check(r, "ops/s gateway ÷ direct", ratio(g.rate(), d.rate()), targetGatewayTpt, false, "", perRound(g, d))
		}
		h, okH := r.by["haproxy"]
		if !okH && (r.clients == lo || r.clients == hi) {
			verdicts = append(verdicts, target{bench: "BenchmarkGateway", what: fmt.Sprintf("%s %s c=%d: gateway vs haproxy", r.mode, r.call.tag, r.clients),
				skip: "no haproxy rows in this run"})
		}
		if okH && r.clients == lo && okD {
			check(r, "added p50 gateway − haproxy", usf(g.pct(0.5)-d.pct(0.5))-usf(h.pct(0.5)-d.pct(0.5)), 0, true, "µs", nil)
		}
		if okH && r.clients == hi {
			check(r, "ops/s gateway ÷ haproxy", ratio(g.rate(), h.rate()), 1, false, "", perRound(g, h))
			check(r, "CPU/call gateway ÷ haproxy", ratio(float64(g.cpuPerOp(idle)), float64(h.cpuPerOp(idle))), targetVsHAProxyCPU, true, "", nil)
		}
		if rl, ok := r.by["relay"]; ok && r.clients == hi {
			check(r, "ops/s gateway ÷ relay", ratio(g.rate(), rl.rate()), targetVsRelayTpt, false, "", perRound(g, rl))
		}
	}
	fmt.Fprintf(out, "\nadded = path − direct latency (same calls to the same pivirtd-sim on a unix socket, same process, interleaved rounds of %s);\n", set.dur)
	fmt.Fprintf(out, "×direct = ops/s ÷ direct ops/s; CPU µs/op = CPU of this process (clients, agent, relay, simulator) plus, for haproxy and nginx,\n")
	fmt.Fprintf(out, "  of their processes, per call. Every process shares the same %d cores; the agent has GOMAXPROCS=%d (shared with the\n", runtime.NumCPU(), threads)
	fmt.Fprintf(out, "  clients and the simulator), haproxy nbthread %d, nginx worker_processes %d.\n", threads, threads)
	fmt.Fprintf(out, "allocs/op = heap allocations of this process per call (the proxies' own processes not counted).\n")
	fmt.Fprintf(out, "relay = a hand-written typed grpc-go relay (no routing, balancing, metrics): the floor of any gRPC-terminating hop.\n")
	fmt.Fprintf(out, "mtls = mutual TLS on both legs (client → hop, hop → simulator), one CA, client certificates required.\n")
	for _, m := range modes {
		for _, msg := range m.skipped {
			fmt.Fprintln(out, "SKIPPED:", msg)
		}
	}
	fmt.Fprintf(out, "Targets at %d and %d callers — a report, never a test failure:\n", lo, hi)
	for _, v := range verdicts {
		reportTarget(out, v)
	}
	fmt.Fprintln(out, strings.Repeat("-", 40))
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
