package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore"
)

// BenchmarkEtcdModeBreakdown says where one registration's time and etcd
// requests go in etcd mode, at 1 client, one layer at a time on the same
// 3-member etcd: a plain Put of the instance; bare transactions of one and
// two keys outside the agents' root, and of one instance under it (which
// every mirror receives and decodes); etcdstore.Store.Apply of the
// registration (evaluation, one transaction, the wait for the store's own
// watch), its transaction timed alone at the client; and RegisterService
// through an agent's API (the gRPC hop and the gateway on top). For each it
// prints the median latency and, per operation, the etcd requests the
// members served (by method, from etcd's gRPC server metrics) and the keys
// etcd wrote and watch events it sent (etcd's mvcc metrics, summed over
// the three members and divided by three). Rounds interleave the layers;
// nothing is asserted.
func BenchmarkEtcdModeBreakdown(b *testing.B) {
	set := knobs(b)
	out := os.Stdout
	ctx := b.Context()
	ec, etcd, pc := startEtcdMode(b)
	cc, err := grpc.NewClient(pc.Nodes()[0].APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cc.Close() })
	api := clusterv1.NewClusterServiceClient(cc)

	// A Store of the bench's own, its etcd client timing each request.
	timer := &rpcTimer{byMethod: map[string]*rpcStat{}}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   ec.Endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(timer.intercept)},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cli.Close() })
	f, err := fsm.New(fsm.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	s, err := etcdstore.Open(ctx, etcdstore.Config{Client: cli, NodeID: "bench", FSM: f})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })

	val, err := proto.Marshal(instance("bench", "x"))
	if err != nil {
		b.Fatal(err)
	}
	var seq, seq2 uint64
	watched := make([]string, 1000)
	for i := range watched {
		v, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(instance("bench", fmt.Sprintf("t-%d", i)))
		if err != nil {
			b.Fatal(err)
		}
		watched[i] = string(v)
	}
	lease, err := etcd.Grant(ctx, 600)
	if err != nil {
		b.Fatal(err)
	}
	layers := []struct {
		name string
		run  op
	}{
		{"etcd Put", func(ctx context.Context, _, i int) error {
			_, err := etcd.Put(ctx, fmt.Sprintf("/bench/ref/0/%d", i%1000), string(val))
			return err
		}},
		{"Txn 1 put", func(ctx context.Context, _, i int) error {
			_, err := etcd.Txn(ctx).Then(clientv3.OpPut(fmt.Sprintf("/bench/txn1/%d", i%1000), string(val))).Commit()
			return err
		}},
		{"Txn 2 puts 2 cmps", func(ctx context.Context, _, i int) error {
			seq2++
			k, d := fmt.Sprintf("/bench/txn2/%d", i%1000), fmt.Sprintf("/bench/txn2d/%d", seq2)
			_, err := etcd.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k), "<", 1<<62), clientv3.Compare(clientv3.ModRevision(d), "=", 0)).
				Then(clientv3.OpPut(k, string(val)), clientv3.OpPut(d, string(val), clientv3.WithLease(lease.ID))).Commit()
			return err
		}},
		{"Txn 1 put watched", func(ctx context.Context, _, i int) error {
			// An instance put from outside: every mirror decodes it.
			id := fmt.Sprintf("t-%d", i%1000)
			_, err := etcd.Txn(ctx).Then(clientv3.OpPut("/pivirt/services/bench/"+id, watched[i%1000])).Commit()
			return err
		}},
		{"Store.Apply", func(ctx context.Context, _, i int) error {
			seq++
			inst := instance("bench", fmt.Sprintf("s-%d", i%1000))
			inst.Node = "bench"
			data, err := fsm.Encode(&fsmv1.Command{
				ClientId: "bench-store", Sequence: seq, Time: timestamppb.Now(),
				Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: inst}},
			})
			if err != nil {
				return err
			}
			res, _, err := s.Apply(ctx, data)
			if err != nil {
				return err
			}
			return res.(*fsm.Result).Err
		}},
		{"RegisterService", func(ctx context.Context, _, i int) error {
			_, err := api.RegisterService(ctx, &clusterv1.RegisterServiceRequest{
				Instance: instance("bench", fmt.Sprintf("a-%d", i%1000)),
			})
			return err
		}},
	}
	for _, l := range layers {
		if s := runLoad(ctx, 1, time.Second, maxOpsPerRun, l.run); s.ops == 0 {
			b.Fatalf("warm-up of %s: no request succeeded: %v", l.name, s.firstErr)
		}
	}
	type result struct {
		lat    []time.Duration
		ops    int
		counts map[string]float64
		txn    rpcStat
	}
	results := make([]result, len(layers))
	for r := range set.rounds {
		for k := range layers {
			if r%2 == 1 {
				k = len(layers) - 1 - k
			}
			before := etcdCounters(b)
			timer.reset()

			smp := runLoad(ctx, 1, set.dur, maxOpsPerRun, layers[k].run)
			after := etcdCounters(b)
			res := &results[k]
			res.lat = append(res.lat, smp.lat...)
			res.ops += smp.ops
			if res.counts == nil {
				res.counts = map[string]float64{}
			}
			for name, v := range after {
				res.counts[name] += v - before[name]
			}
			t := timer.get("/etcdserverpb.KV/Txn")
			res.txn.n += t.n
			res.txn.total += t.total
			res.txn.lat = append(res.txn.lat, t.lat...)
		}
	}
	fmt.Fprintf(out, "\netcd mode, one registration at 1 client, layer by layer (%s per run, %d rounds; etcd's counts per operation)\n", set.dur, set.rounds)
	for k, l := range layers {
		res := results[k]
		slices.Sort(res.lat)
		med := time.Duration(0)
		if len(res.lat) > 0 {
			med = res.lat[len(res.lat)/2]
		}
		var parts []string
		names := make([]string, 0, len(res.counts))
		for n := range res.counts {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			if per := res.counts[n] / float64(max(res.ops, 1)); per >= 0.005 {
				parts = append(parts, fmt.Sprintf("%s %.2f", n, per))
			}
		}
		fmt.Fprintf(out, "  %-16s p50 %6.3f ms  %6d ops | %s\n", l.name, float64(med.Microseconds())/1000, res.ops, strings.Join(parts, ", "))
		if l.name == "Store.Apply" && res.txn.n > 0 {
			slices.Sort(res.txn.lat)
			fmt.Fprintf(out, "  %-16s its Txn at the client: %.2f per op, p50 %.3f ms\n", "", float64(res.txn.n)/float64(max(res.ops, 1)), float64(res.txn.lat[len(res.txn.lat)/2].Microseconds())/1000)
		}
	}
}

// etcdCounters reads the embedded members' metrics: the requests their
// gRPC server handled, by method, and the mvcc operations and watch events,
// summed over the members of the process and divided by three (each member
// applies every write).
func etcdCounters(b *testing.B) map[string]float64 {
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		b.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		name := mf.GetName()
		switch name {
		case "grpc_server_handled_total":
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "grpc_method" {
						out["rpc "+l.GetValue()] += m.GetCounter().GetValue()
					}
				}
			}
		case "etcd_mvcc_put_total", "etcd_mvcc_txn_total", "etcd_mvcc_delete_total", "etcd_debugging_mvcc_events_total":
			for _, m := range mf.GetMetric() {
				out[strings.TrimPrefix(strings.TrimPrefix(name, "etcd_debugging_"), "etcd_")] += m.GetCounter().GetValue() / 3
			}
		}
	}
	return out
}

// rpcTimer counts and times the unary requests of an etcd client.
type rpcTimer struct {
	mu       sync.Mutex
	byMethod map[string]*rpcStat
}

type rpcStat struct {
	n     int
	total time.Duration
	lat   []time.Duration
}

func (t *rpcTimer) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	t0 := time.Now()
	err := invoker(ctx, method, req, reply, cc, opts...)
	d := time.Since(t0)
	t.mu.Lock()
	st := t.byMethod[method]
	if st == nil {
		st = &rpcStat{}
		t.byMethod[method] = st
	}
	st.n++
	st.total += d
	st.lat = append(st.lat, d)
	t.mu.Unlock()
	return err
}

func (t *rpcTimer) reset() {
	t.mu.Lock()
	clear(t.byMethod)
	t.mu.Unlock()
}

func (t *rpcTimer) get(method string) rpcStat {
	t.mu.Lock()
	defer t.mu.Unlock()
	if st := t.byMethod[method]; st != nil {
		c := *st
		c.lat = slices.Clone(st.lat)
		return c
	}
	return rpcStat{}
}
