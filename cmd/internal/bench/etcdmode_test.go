package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// etcdModeTarget is the rate of agent registrations, as a share of plain
// puts, that etcd mode should reach at 1 and at 16 clients.
const etcdModeTarget = 0.8

// BenchmarkEtcdMode measures service registrations through three agents in
// etcd mode (service_discovery.type etcd) against the reference of the same
// run: plain puts of the same record straight into the same 3-member etcd.
// An agent's write is an etcd transaction (the record, its dedupe record,
// compares on both; concurrent writes of an agent share one transaction)
// plus the wait for its own watch to deliver it, so the
// ratio shows what the agent adds on top of etcd. Rounds interleave the two;
// the ratios are printed and reported with a verdict against
// etcdModeTarget, never asserted.
func BenchmarkEtcdMode(b *testing.B) {
	set := knobs(b)
	out := os.Stdout
	ctx := b.Context()
	_, etcd, pc := startEtcdMode(b)
	var api []clusterv1.ClusterServiceClient
	for _, n := range pc.Nodes() {
		cc, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cc.Close() })
		api = append(api, clusterv1.NewClusterServiceClient(cc))
	}
	val, err := proto.Marshal(instance("bench", "x"))
	if err != nil {
		b.Fatal(err)
	}
	ref := func(ctx context.Context, w, i int) error {
		_, err := etcd.Put(ctx, fmt.Sprintf("/bench/ref/%d/%d", w, i%1000), string(val))
		return err
	}
	agentWrite := func(ctx context.Context, w, i int) error {
		_, err := api[w%len(api)].RegisterService(ctx, &clusterv1.RegisterServiceRequest{
			Instance: instance("bench", fmt.Sprintf("w%d-%d", w, i%1000)),
		})
		return err
	}
	fmt.Fprintf(out, "\netcd mode: service registrations through 3 agents vs plain puts into the same 3-member etcd, %s per run, %d rounds\n", set.dur, set.rounds)
	for _, w := range []op{ref, agentWrite} {
		if s := runLoad(ctx, 16, time.Second, maxOpsPerRun, w); s.ops == 0 {
			b.Fatalf("warm-up: no request succeeded: %v", s.firstErr)
		}
	}
	for _, clients := range []int{1, 16} {
		var refS, agS []sample
		for r := range set.rounds {
			// Odd rounds run the agent first.
			for k := range 2 {
				if (k == 0) == (r%2 == 0) {
					refS = append(refS, runLoad(ctx, clients, set.dur, maxOpsPerRun, ref))
				} else {
					s := runLoad(ctx, clients, set.dur, maxOpsPerRun, agentWrite)
					if s.errs > 0 {
						b.Logf("%d clients: %d failed registrations, the first: %v", clients, s.errs, s.firstErr)
					}
					agS = append(agS, s)
				}
			}
		}
		rr, ar := medianRate(refS), medianRate(agS)
		fmt.Fprintf(out, "  %2d clients: etcd put %7.0f/s p99 %6.2f ms | agent register %7.0f/s p99 %6.2f ms | ratio %.2f\n",
			clients, rr, p99ms(refS), ar, p99ms(agS), ar/rr)
		var rounds []float64
		for i := range min(len(refS), len(agS)) {
			rounds = append(rounds, ratio(agS[i].rate(), refS[i].rate()))
		}
		reportTarget(out, target{bench: "BenchmarkEtcdMode", what: fmt.Sprintf("etcd mode register c=%d ÷ plain put", clients),
			got: ar / rr, want: etcdModeTarget, round: rounds})
		b.ReportMetric(ar/rr, fmt.Sprintf("etcdmode-write-ratio-c%d", clients))
	}
}

func medianRate(s []sample) float64 {
	r := make([]float64, len(s))
	for i, x := range s {
		r[i] = x.rate()
	}
	slices.Sort(r)
	return r[len(r)/2]
}

func p99ms(s []sample) float64 {
	var all []time.Duration
	for _, x := range s {
		all = append(all, x.lat...)
	}
	if len(all) == 0 {
		return 0
	}
	slices.Sort(all)
	return float64(all[len(all)*99/100].Microseconds()) / 1000
}

// startEtcdMode starts a 3-member etcd and 3 agents in etcd mode on it,
// with a leader elected.
func startEtcdMode(b *testing.B) (*etcdtest.Cluster, *clientv3.Client, *agenttest.Cluster) {
	ec := etcdtest.Start(b, 3)
	etcd := ec.Client(b)
	etcdtest.WaitWritable(b, etcd)
	pc := agenttest.NewEtcd(b, 3, ec.Endpoints, nil)
	pc.WaitLeader(60 * time.Second)
	return ec, etcd, pc
}
