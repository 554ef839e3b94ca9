package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// envSnapshotRecords sets the records of BenchmarkSnapshot (default
// 100,000).
const envSnapshotRecords = "PIVIRT_BENCH_SNAPSHOT_RECORDS"

// envSnapshotProfiles names a directory where BenchmarkSnapshot writes the
// process's allocation profile before and after each step (save.before,
// save.after, restore.before, ...): `go tool pprof -base X.before
// X.after` shows what the step allocated, with -memprofilerate setting
// the sampling.
const envSnapshotProfiles = "PIVIRT_BENCH_SNAPSHOT_PROFILES"

// profileStep writes the allocation profile to <dir>/<step>.<when> when
// envSnapshotProfiles names a directory.
func profileStep(b *testing.B, step, when string) {
	dir := os.Getenv(envSnapshotProfiles)
	if dir == "" {
		return
	}
	runtime.GC() // the profile is as of the last collection
	f, err := os.Create(filepath.Join(dir, step+"."+when))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSnapshot loads the same records into a 3-node pivirt-agent
// cluster and a 3-member etcd, then times a snapshot save through each
// one's API (pvcli snapshot save's RPC; etcd's Maintenance.Snapshot, what
// etcdctl snapshot save calls) and a restore of pivirt's archive into the
// running cluster. etcd has no online restore, so the restore is compared
// with loading the same records through the API. The peak growth of the
// process's heap during each step is its memory cost (both clusters and
// the client live in the process; nothing else runs meanwhile).
func BenchmarkSnapshot(b *testing.B) {
	records := 100_000
	if v := os.Getenv(envSnapshotRecords); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1_000_000 {
			b.Fatalf("%s=%q: want a record count from 1 to 1000000", envSnapshotRecords, v)
		}
		records = n
	}
	ctx := b.Context()
	out := os.Stdout
	dir := b.TempDir()

	ec := etcdtest.Start(b, 3)
	etcd := ec.Client(b)
	etcdtest.WaitWritable(b, etcd)
	pc := agenttest.NewExpect(b, 3, nil)
	leaderNode := pc.WaitLeader(60 * time.Second)
	conn := func(n *agenttest.Node) *grpc.ClientConn {
		cc, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cc.Close() })
		return cc
	}
	leaderConn := conn(leaderNode)
	api := clusterv1.NewClusterServiceClient(leaderConn)

	// Load: the same instances on both sides, 64 clients each.
	load := func(f op) (time.Duration, error) {
		var next atomic.Int64
		s := runLoad(ctx, 64, 10*time.Minute, records, func(ctx context.Context, w, i int) error {
			return f(ctx, w, int(next.Add(1)-1))
		})
		if s.errs > 0 {
			return 0, fmt.Errorf("%d of %d writes failed: %w", s.errs, records, s.firstErr)
		}
		return s.elapsed, nil
	}
	id := func(i int) string { return fmt.Sprintf("i-%07d", i) }
	pivirtLoad, err := load(func(ctx context.Context, _, i int) error {
		_, err := api.RegisterService(ctx, &clusterv1.RegisterServiceRequest{Instance: instance(writeService, id(i))})
		return err
	})
	if err != nil {
		b.Fatalf("load pivirt-agent: %v", err)
	}
	etcdLoad, err := load(func(ctx context.Context, _, i int) error {
		v, err := proto.Marshal(instance(writeService, id(i)))
		if err != nil {
			return err
		}
		_, err = etcd.Put(ctx, etcdKey(writeService, id(i)), string(v))
		return err
	})
	if err != nil {
		b.Fatalf("load etcd: %v", err)
	}

	// Save, each side through its API into a file.
	archivePath := filepath.Join(dir, "pivirt.tar.gz")
	var meta *clusterv1.SnapshotMeta
	profileStep(b, "save", "before")
	pivirtSave, pivirtSaveHeap, err := measured(func() error {
		stream, err := clusterv1.NewSnapshotServiceClient(leaderConn).SaveSnapshot(ctx, &clusterv1.SaveSnapshotRequest{})
		if err != nil {
			return err
		}
		return writeFile(archivePath, func(w io.Writer) error {
			for {
				m, err := stream.Recv()
				if errors.Is(err, io.EOF) {
					return nil
				}
				if err != nil {
					return err
				}
				if m.GetMeta() != nil {
					meta = m.GetMeta()
				}
				if _, err := w.Write(m.GetData()); err != nil {
					return err
				}
			}
		})
	})
	profileStep(b, "save", "after")
	if err != nil {
		b.Fatalf("pivirt-agent snapshot save: %v", err)
	}
	etcdPath := filepath.Join(dir, "etcd.db")
	etcdSave, etcdSaveHeap, err := measured(func() error {
		rc, err := etcd.Snapshot(ctx)
		if err != nil {
			return err
		}
		defer rc.Close()
		return writeFile(etcdPath, func(w io.Writer) error {
			_, err := io.Copy(w, rc)
			return err
		})
	})
	if err != nil {
		b.Fatalf("etcd snapshot save: %v", err)
	}

	// Restore pivirt's archive through a follower (relayed to the leader),
	// then until every node holds it: into the cluster it was saved from
	// (its records are the ones each node holds), and into a new, empty
	// cluster, where every record is new to every node.
	restore := func(c *agenttest.Cluster, step string) (toAnswer, allNodes time.Duration, heap uint64, err error) {
		cc := conn(c.Follower())
		var restoreIndex uint64
		profileStep(b, step, "before")
		defer profileStep(b, step, "after")
		toAnswer, heap, err = measured(func() error {
			f, err := os.Open(archivePath)
			if err != nil {
				return err
			}
			defer f.Close()
			stream, err := clusterv1.NewSnapshotServiceClient(cc).RestoreSnapshot(ctx)
			if err != nil {
				return err
			}
			buf := make([]byte, 256<<10)
			for {
				n, rerr := io.ReadFull(f, buf)
				if n > 0 {
					if err := stream.Send(&clusterv1.RestoreSnapshotRequest{Data: append([]byte(nil), buf[:n]...)}); err != nil {
						return err
					}
				}
				if rerr != nil {
					break
				}
			}
			resp, err := stream.CloseAndRecv()
			if err != nil {
				return err
			}
			restoreIndex = resp.GetIndex()
			return nil
		})
		if err != nil {
			return 0, 0, 0, err
		}
		start := time.Now()
		agenttest.Eventually(b, 2*time.Minute, "every node holds the restored state", func() error {
			for _, n := range c.Nodes() {
				if got := n.FSM().AppliedIndex(); got < restoreIndex {
					return fmt.Errorf("%s applied %d, restore at %d", n.Name, got, restoreIndex)
				}
			}
			return nil
		})
		return toAnswer, toAnswer + time.Since(start), heap, nil
	}
	pivirtRestore, allNodes, pivirtRestoreHeap, err := restore(pc, "restore")
	if err != nil {
		b.Fatalf("pivirt-agent snapshot restore: %v", err)
	}
	fresh := agenttest.NewExpect(b, 3, nil)
	fresh.WaitLeader(60 * time.Second)
	freshRestore, freshAllNodes, freshHeap, err := restore(fresh, "restore-new")
	if err != nil {
		b.Fatalf("pivirt-agent snapshot restore into a new cluster: %v", err)
	}

	size := func(p string) int64 {
		st, err := os.Stat(p)
		if err != nil {
			b.Fatal(err)
		}
		return st.Size()
	}
	mib := func(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
	fmt.Fprintf(out, "\nsnapshot benchmark: %d service instances (~100-byte records), pivirt-agent (3 nodes) and etcd (3 members) in one process\n", records)
	fmt.Fprintf(out, "  load through the API, 64 clients: pivirt %s, etcd %s\n", pivirtLoad.Round(time.Millisecond), etcdLoad.Round(time.Millisecond))
	fmt.Fprintf(out, "  save:    pivirt %s (archive %d bytes, state %d bytes, heap peak +%s); etcd %s (db %d bytes, heap peak +%s); time ratio pivirt/etcd %.2f\n",
		pivirtSave.Round(time.Millisecond), size(archivePath), meta.GetSize(), mib(pivirtSaveHeap),
		etcdSave.Round(time.Millisecond), size(etcdPath), mib(etcdSaveHeap), ratio(pivirtSave.Seconds(), etcdSave.Seconds()))
	fmt.Fprintf(out, "  restore: pivirt %s to the answer, %s until all 3 nodes hold it (heap peak +%s); ratio to loading the same records through the API %.2f\n",
		pivirtRestore.Round(time.Millisecond), allNodes.Round(time.Millisecond), mib(pivirtRestoreHeap), ratio(allNodes.Seconds(), pivirtLoad.Seconds()))
	fmt.Fprintf(out, "  restore into a new, empty 3-node cluster (every record new to every node): %s to the answer, %s until all 3 nodes hold it (heap peak +%s, %.1f× the state)\n",
		freshRestore.Round(time.Millisecond), freshAllNodes.Round(time.Millisecond), mib(freshHeap), ratio(float64(freshHeap), float64(meta.GetSize())))
	fmt.Fprintf(out, "  process peak RSS (everything above): %s\n", mib(peakRSS()))
	saveRatio, heapRatio := ratio(pivirtSave.Seconds(), etcdSave.Seconds()), ratio(float64(pivirtRestoreHeap), float64(meta.GetSize()))
	fmt.Fprintf(out, "targets — a report, never a test failure:\n")
	reportTarget(out, target{bench: "BenchmarkSnapshot", what: fmt.Sprintf("snapshot save of %d instances ÷ etcd's", records), got: saveRatio, want: 2, le: true})
	reportTarget(out, target{bench: "BenchmarkSnapshot", what: "restore heap peak growth ÷ state size", got: heapRatio, want: 3, le: true})
	b.ReportMetric(ratio(pivirtSave.Seconds(), etcdSave.Seconds()), "save_time_ratio")
	b.ReportMetric(ratio(allNodes.Seconds(), pivirtLoad.Seconds()), "restore_to_load_ratio")
	b.ReportMetric(pivirtSave.Seconds(), "save_s")
	b.ReportMetric(allNodes.Seconds(), "restore_s")
	b.ReportMetric(float64(pivirtSaveHeap)/(1<<20), "save_heap_MiB")
	b.ReportMetric(float64(pivirtRestoreHeap)/(1<<20), "restore_heap_MiB")
	b.ReportMetric(heapRatio, "restore_heap_state_ratio")
	b.ReportMetric(float64(freshHeap)/(1<<20), "restore_new_cluster_heap_MiB")
}

// writeFile writes path through a buffered writer and syncs it.
func writeFile(path string, fill func(w io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if err := fill(w); err != nil {
		f.Close()
		return err
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// measured runs f and returns how long it took and how far the heap grew
// above where it stood when f started (sampled every 2 ms).
func measured(f func() error) (time.Duration, uint64, error) {
	runtime.GC()
	base := heapBytes()
	var peak atomic.Uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			if h := heapBytes(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	start := time.Now()
	err := f()
	took := time.Since(start)
	close(stop)
	<-done
	if p := peak.Load(); p > base {
		return took, p - base, err
	}
	return took, 0, err
}

// heapBytes is the bytes of heap objects, live or not yet swept.
func heapBytes() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
