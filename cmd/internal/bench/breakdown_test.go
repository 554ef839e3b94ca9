package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metrics "github.com/hashicorp/go-metrics/compat"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// stageSink keeps hashicorp/raft's own timers (it reports them through
// go-metrics) per key while on, for the breakdown of one write by stage. Every agent of the process reports into it: the leader's
// stages and the followers' have keys of their own.
type stageSink struct {
	mu   sync.Mutex
	on   bool
	sums map[string][]float32 // milliseconds, go-metrics' timer unit
}

// maxStageSamples bounds what a key keeps.
const maxStageSamples = 1 << 20

func (s *stageSink) add(key []string, v float32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.on {
		return
	}
	k := strings.Join(key, ".")
	if len(s.sums[k]) < maxStageSamples {
		s.sums[k] = append(s.sums[k], v)
	}
}

func (s *stageSink) SetGauge([]string, float32)                               {}
func (s *stageSink) SetGaugeWithLabels([]string, float32, []metrics.Label)    {}
func (s *stageSink) EmitKey([]string, float32)                                {}
func (s *stageSink) IncrCounter([]string, float32)                            {}
func (s *stageSink) IncrCounterWithLabels([]string, float32, []metrics.Label) {}
func (s *stageSink) AddSample(key []string, v float32)                        { s.add(key, v) }
func (s *stageSink) AddSampleWithLabels(key []string, v float32, _ []metrics.Label) {
	s.add(key, v)
}

// start clears the sums and starts keeping samples.
func (s *stageSink) start() {
	s.mu.Lock()
	s.on, s.sums = true, map[string][]float32{}
	s.mu.Unlock()
}

// stop stops keeping samples and returns the p50 of each key.
func (s *stageSink) stop() map[string]time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.on = false
	out := map[string]time.Duration{}
	for k, v := range s.sums {
		slices.Sort(v)
		out[k] = time.Duration(float64(v[(len(v)-1)/2]) * float64(time.Millisecond))
	}
	return out
}

// installStageSink makes a stageSink go-metrics' global sink, which
// hashicorp/raft reports to; the agents set none of their own.
func installStageSink(b *testing.B) *stageSink {
	s := &stageSink{sums: map[string][]float32{}}
	cfg := metrics.DefaultConfig("")
	cfg.EnableHostname, cfg.EnableRuntimeMetrics = false, false
	if _, err := metrics.NewGlobal(cfg, s); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = metrics.NewGlobal(cfg, &metrics.BlackholeSink{}) })
	return s
}

// histogramMean is the mean of a histogram of the process's default
// Prometheus registry (where the embedded etcd members register theirs,
// summed over the members) between two calls: start returns the function
// that reads it.
func histogramMean(name string) func() time.Duration {
	read := func() (float64, uint64) {
		mfs, err := prometheus.DefaultGatherer.Gather()
		if err != nil {
			return 0, 0
		}
		for _, mf := range mfs {
			if mf.GetName() != name || mf.GetType() != dto.MetricType_HISTOGRAM {
				continue
			}
			var sum float64
			var n uint64
			for _, m := range mf.GetMetric() {
				sum += m.GetHistogram().GetSampleSum()
				n += m.GetHistogram().GetSampleCount()
			}
			return sum, n
		}
		return 0, 0
	}
	s0, n0 := read()
	return func() time.Duration {
		s1, n1 := read()
		if n1 <= n0 {
			return 0
		}
		return time.Duration((s1 - s0) / float64(n1-n0) * float64(time.Second))
	}
}

// fsyncFloor appends 4 KiB blocks with an fdatasync each to a file in dir
// for d and returns the p50 of one append: what one durable log append
// costs on this disk at best.
func fsyncFloor(dir string, d time.Duration) (time.Duration, error) {
	f, err := os.CreateTemp(dir, "fsync-floor-*")
	if err != nil {
		return 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	block := make([]byte, 4096)
	var lat []time.Duration
	for start := time.Now(); time.Since(start) < d && len(lat) < 100000; {
		t0 := time.Now()
		if _, err := f.Write(block); err != nil {
			return 0, err
		}
		if err := fdatasync(f); err != nil {
			return 0, err
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	return merged{sorted: lat}.pct(0.5), nil
}

// grpcFloor is the p50 of a unary gRPC call to a server that does nothing
// (the standard health service) over loopback TCP, one caller: the
// round trip any API call pays before it does anything.
func grpcFloor(ctx context.Context, d time.Duration) (time.Duration, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go func() { _ = gs.Serve(ln) }()
	defer gs.Stop()
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer cc.Close()
	hc := healthpb.NewHealthClient(cc)
	s := runLoad(ctx, 1, d, maxOpsPerRun, func(ctx context.Context, _, _ int) error {
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	})
	if s.ops == 0 {
		return 0, fmt.Errorf("loopback gRPC: no call succeeded: %v", s.firstErr)
	}
	return merge([]sample{s}).pct(0.5), nil
}

// breakdown measures one write and one consistent read at one client by
// stage, beside etcd's and the floor of this machine, and prints it: where
// a write's and a read's latency goes.
func breakdown(b *testing.B, out io.Writer, sink *stageSink, pc *agenttest.Cluster, leader int, groups []group, d time.Duration) {
	ctx := b.Context()
	p50 := func(w workload) time.Duration {
		s := runLoad(ctx, 1, d, maxOpsPerRun, w.run)
		if s.ops == 0 {
			b.Errorf("breakdown %s: no request succeeded: %v", w.name, s.firstErr)
		}
		return merge([]sample{s}).pct(0.5)
	}
	find := func(g, name string) workload {
		for _, gr := range groups {
			if gr.name != g {
				continue
			}
			if gr.ref.name == name {
				return gr.ref
			}
			for _, w := range gr.rows {
				if w.name == name {
					return w
				}
			}
		}
		b.Fatalf("no workload %s/%s", g, name)
		return workload{}
	}
	st := pc.Node(leader).Store()
	inProcessApply := workload{name: "Store.Apply", run: func(ctx context.Context, w, i int) error {
		data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_RegisterService{
			RegisterService: &fsmv1.RegisterService{Instance: instance(writeService, fmt.Sprintf("i-%05d", i%keySpace))},
		}})
		if err != nil {
			return err
		}
		_, _, err = st.Apply(ctx, data)
		return err
	}}
	inProcessReadIndex := workload{name: "Store.ReadIndex", run: func(ctx context.Context, w, i int) error {
		_, err := st.ReadIndex(ctx)
		return err
	}}

	fsyncP50, err := fsyncFloor(b.TempDir(), min(d, 2*time.Second))
	if err != nil {
		b.Fatalf("fsync floor: %v", err)
	}
	rttP50, err := grpcFloor(ctx, min(d, 2*time.Second))
	if err != nil {
		b.Fatalf("gRPC floor: %v", err)
	}

	sink.start()
	apiWrite := p50(find("write", "register@leader"))
	stages := sink.stop()
	storeWrite := p50(inProcessApply)
	walFsync := histogramMean("etcd_disk_wal_fsync_duration_seconds")
	backendCommit := histogramMean("etcd_disk_backend_commit_duration_seconds")
	etcdPut := p50(find("write", "etcd-put"))
	etcdFsync, etcdCommit := walFsync(), backendCommit()

	apiRead := p50(find("read", "get-consistent@leader"))
	defaultRead := p50(find("read", "get-default@leader"))
	readIndex := p50(inProcessReadIndex)
	etcdGet := p50(find("read", "etcd-get"))

	msf := func(d time.Duration) string { return fmt.Sprintf("%6.3f ms", float64(d)/float64(time.Millisecond)) }
	stage := func(k string) string {
		if v, ok := stages[k]; ok {
			return msf(v)
		}
		return "     - ms"
	}
	fmt.Fprintf(out, "\nlatency by stage, 1 client (%s each; p50s: of the calls, and of hashicorp/raft's own timers for its stages; etcd's stages are means):\n", d)
	fmt.Fprintf(out, "  floor of this machine: 4 KiB write + fdatasync %s; loopback gRPC unary round trip %s\n", msf(fsyncP50), msf(rttP50))
	fmt.Fprintf(out, "  write  register@leader (API)                                %s   etcd put %s\n", msf(apiWrite), msf(etcdPut))
	fmt.Fprintf(out, "         Store.Apply on the leader, in process                  %s   (API, gRPC and handler: %s)\n", msf(storeWrite), msf(apiWrite-storeWrite))
	fmt.Fprintf(out, "         leader: log append + fsync (raft.leader.dispatchLog)    %s   etcd WAL fdatasync mean %s\n", stage("raft.leader.dispatchLog"), msf(etcdFsync))
	fmt.Fprintf(out, "         leader → follower AppendEntries (…appendEntries.rpc)    %s   etcd backend commit mean %s\n", stage("raft.replication.appendEntries.rpc"), msf(etcdCommit))
	fmt.Fprintf(out, "           follower: log append + fsync (…storeLogs)             %s\n", stage("raft.rpc.appendEntries.storeLogs"))
	fmt.Fprintf(out, "         leader: dispatch → commit (raft.commitTime)             %s\n", stage("raft.commitTime"))
	fmt.Fprintf(out, "         FSM: enqueue, apply batch (raft.fsm.enqueue, .applyBatch) %s, %s\n", stage("raft.fsm.enqueue"), stage("raft.fsm.applyBatch"))
	fmt.Fprintf(out, "  read   get-consistent@leader (API)                          %s   etcd get (linearizable) %s\n", msf(apiRead), msf(etcdGet))
	fmt.Fprintf(out, "         get-default@leader (API, no quorum round)            %s\n", msf(defaultRead))
	fmt.Fprintf(out, "         Store.ReadIndex on the leader, in process              %s\n", msf(readIndex))
	for k, v := range map[string]time.Duration{
		"floor_fsync_us": fsyncP50, "floor_grpc_us": rttP50, "write_api_us": apiWrite, "write_store_us": storeWrite,
		"write_dispatch_us": stages["raft.leader.dispatchLog"], "write_replicate_us": stages["raft.replication.appendEntries.rpc"],
		"write_commit_us": stages["raft.commitTime"], "read_api_us": apiRead, "read_index_us": readIndex,
	} {
		b.ReportMetric(float64(v)/float64(time.Microsecond), "stage_"+k)
	}
}
