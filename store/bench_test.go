package store_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/storetest"
)

// BenchmarkApply measures replicated, durable writes on a 3-node loopback
// cluster with production Raft settings, from 64 concurrent clients (the
// shape of the etcd comparison in make bench).
func BenchmarkApply(b *testing.B) {
	for _, clients := range []int{1, 64} {
		b.Run(fmt.Sprintf("nodes=3/clients=%d", clients), func(b *testing.B) {
			c := storetest.NewCluster(b, 3, storetest.NewKVFSM, storetest.WithConfig(func(_ int, cfg *store.Config) {
				d := store.DefaultConfig()
				cfg.HeartbeatTimeout = d.HeartbeatTimeout
				cfg.ElectionTimeout = d.ElectionTimeout
				cfg.LeaderLeaseTimeout = d.LeaderLeaseTimeout
				cfg.CommitTimeout = d.CommitTimeout
			}))
			leader := c.WaitLeader(b, 20*time.Second)
			cmd := storetest.Set("key", "a value of some thirty-two bytes")
			var next atomic.Int64
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for range clients {
				wg.Go(func() {
					for next.Add(1) <= int64(b.N) {
						ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
						_, _, err := leader.Apply(ctx, cmd)
						cancel()
						if err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "writes/s")
		})
	}
}
