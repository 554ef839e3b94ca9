package e2e_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

const (
	e2eServices  = 10000
	e2eSchedules = 1000
)

// TestSnapshotSaveWipeRestore: a cluster holding 10,000 service instances
// and 1,000 schedules is saved with pvcli, wiped, and restored with pvcli
// into a fresh cluster on other ports; every record comes back. Damaged
// archives are refused and leave the fresh cluster untouched.
func TestSnapshotSaveWipeRestore(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 10,000 records through real processes")
	}
	bins := buildBinaries(t)
	work := t.TempDir()

	// Schedules have no API yet: they enter the first cluster through a
	// restore of an archive built here.
	seed := filepath.Join(work, "schedules.tar.gz")
	schedules := writeScheduleArchive(t, seed, e2eSchedules)

	c1 := startCluster(t, bins)
	c1.ok(t, c1.nodes[1], "snapshot", "restore", seed)
	registerMany(t, c1, e2eServices)
	before := listServices(t, c1, c1.nodes[2])
	if len(before) != e2eServices {
		t.Fatalf("cluster 1 lists %d instances, want %d", len(before), e2eServices)
	}

	saved := filepath.Join(work, "cluster1.tar.gz")
	start := time.Now()
	c1.ok(t, c1.nodes[0], "snapshot", "save", saved)
	saveTook := time.Since(start)
	info, err := archive.Verify(mustOpen(t, saved))
	if err != nil {
		t.Fatalf("saved archive: %v", err)
	}
	st, _ := os.Stat(saved)
	t.Logf("saved %d services and %d schedules in %s: %d bytes (state %d bytes)", e2eServices, e2eSchedules, saveTook.Round(time.Millisecond), st.Size(), info.Meta.Size)

	// Inspect, offline: the archive, and a raw snapshot directory of a
	// data dir.
	var insp struct {
		Index  uint64 `json:"index,string"` // 64-bit integers are strings
		Tables []struct {
			Name    string `json:"name"`
			Records uint64 `json:"records,string"`
		} `json:"tables"`
		Verification string `json:"verification"`
	}
	r := c1.ok(t, c1.nodes[0], "snapshot", "inspect", saved, "-o", "json")
	if err := json.Unmarshal([]byte(r.stdout), &insp); err != nil {
		t.Fatalf("%s\n%v", r, err)
	}
	counts := map[string]uint64{}
	for _, tb := range insp.Tables {
		counts[tb.Name] = tb.Records
	}
	if insp.Verification != "ok" || insp.Index != info.Meta.Index || counts["services"] != e2eServices || counts["schedules"] != e2eSchedules {
		t.Errorf("inspect: %+v; want verification ok, index %d, %d services, %d schedules", insp, info.Meta.Index, e2eServices, e2eSchedules)
	}
	raw, err := filepath.Glob(filepath.Join(c1.nodes[0].dataDir, "raft", "snapshots", "*"))
	if err != nil || len(raw) == 0 {
		t.Fatalf("no raft snapshot directory in %s: %v", c1.nodes[0].dataDir, err)
	}
	if r := c1.ok(t, c1.nodes[0], "snapshot", "inspect", raw[len(raw)-1]); !strings.Contains(r.stdout, "Verification") || !strings.Contains(r.stdout, "ok") {
		t.Errorf("inspect of a raw snapshot directory: %s", r)
	}

	// Wipe the first cluster.
	c1.stopAll()
	for _, n := range c1.nodes {
		if err := os.RemoveAll(n.dataDir); err != nil {
			t.Fatal(err)
		}
	}

	c2 := startCluster(t, bins)
	target := c2.nodes[1]
	c2.ok(t, target, "service", "register", "fresh", "--address", "10.1.1.1", "--port", "1", "--id", "f-1")

	file, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range corruptions(t, file) {
		path := filepath.Join(work, strings.ReplaceAll(name, " ", "-")+".tar.gz")
		if err := os.WriteFile(path, c.data, 0o600); err != nil {
			t.Fatal(err)
		}
		r := c2.pvcli(t, target, "snapshot", "restore", path)
		if r.code == 0 || !strings.Contains(r.stderr, c.msg) {
			t.Errorf("restore of an archive with %s: %s\nwant a failure saying %q", name, r, c.msg)
		}
		if r := c2.pvcli(t, target, "snapshot", "inspect", path); r.code == 0 || !strings.Contains(r.stdout+r.stderr, "FAILED") {
			t.Errorf("inspect of an archive with %s: %s\nwant a failed verification", name, r)
		}
	}
	// The agents refuse them too when a client skips pvcli's check.
	snapClient := clusterv1connect.NewSnapshotServiceClient(c2.httpClient(t), "https://"+target.api)
	for name, c := range corruptions(t, file) {
		stream := snapClient.RestoreSnapshot(context.Background())
		for i := 0; i < len(c.data); i += 64 << 10 {
			if err := stream.Send(&clusterv1.RestoreSnapshotRequest{Data: c.data[i:min(len(c.data), i+64<<10)]}); err != nil {
				break
			}
		}
		_, err := stream.CloseAndReceive()
		if code := connect.CodeOf(err); (code != connect.CodeInvalidArgument && code != connect.CodeFailedPrecondition) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("agent restore of an archive with %s: %v; want InvalidArgument or FailedPrecondition saying %q", name, err, c.msg)
		}
	}
	if got := listServices(t, c2, target); len(got) != 1 {
		t.Fatalf("after refused restores cluster 2 lists %d instances, want its own 1", len(got))
	}

	start = time.Now()
	c2.ok(t, target, "snapshot", "restore", saved)
	t.Logf("restored in %s", time.Since(start).Round(time.Millisecond))
	for _, n := range c2.nodes {
		after := listServices(t, c2, n)
		if !reflect.DeepEqual(after, before) {
			t.Errorf("via %s: %d instances after the restore differ from the %d saved", n.name, len(after), len(before))
		}
	}

	// Schedules: saved again from cluster 2 and compared record by record.
	again := filepath.Join(work, "cluster2.tar.gz")
	c2.ok(t, c2.nodes[2], "snapshot", "save", again)
	restored := archiveState(t, again)
	_, got, err := restored.State().Schedules(nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(schedules) {
		t.Fatalf("cluster 2 holds %d schedules, want %d", len(got), len(schedules))
	}
	// The leader runs the enabled ones when they are due (07:xx in
	// Budapest on weekdays): the slot claimed and the modify index are
	// the dispatcher's, the rest must be as saved.
	definition := func(s *schedulev1.Schedule) *schedulev1.Schedule {
		c := proto.CloneOf(s)
		c.LastSlot, c.ModifyIndex = nil, 0
		return c
	}
	for i := range got {
		if !proto.Equal(definition(got[i]), definition(schedules[i])) {
			t.Fatalf("schedule %d = %v, want %v", i, got[i], schedules[i])
		}
	}
}

// writeScheduleArchive writes an archive holding n schedules and returns
// them as stored.
func writeScheduleArchive(t *testing.T, path string, n int) []*schedulev1.Schedule {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	for i := range n {
		data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.New(now), Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: &schedulev1.Schedule{
			Id: fmt.Sprintf("s-%04d", i), VmId: fmt.Sprintf("vm-%04d", i), Action: schedulev1.Action(1 + i%3),
			Cron: fmt.Sprintf("%d 7 * * 1-5", i%60), TimeZone: "Europe/Budapest", Enabled: i%2 == 0,
			CatchUp: schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, CatchUpWindow: durationpb.New(time.Hour),
			Overlap: schedulev1.Overlap_OVERLAP_FORBID, HistoryLimit: 10,
		}}}})
		if err != nil {
			t.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	writeArchive(t, path, f, "1-1000-0", uint64(n))
	_, list, err := f.State().Schedules(nil)
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// writeArchive writes f's state to path as an archive with the given
// snapshot ID and index.
func writeArchive(t *testing.T, path string, f *fsm.FSM, id string, index uint64) {
	t.Helper()
	var st bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := archive.Write(out, archive.Meta{ID: id, Index: index, Term: 1, Size: int64(st.Len())}, &st); err != nil {
		t.Fatal(err)
	}
}

// archiveState restores an archive file into a fresh FSM.
func archiveState(t *testing.T, path string) *fsm.FSM {
	t.Helper()
	rd, err := archive.NewReader(mustOpen(t, path))
	if err != nil {
		t.Fatal(err)
	}
	st, err := rd.State()
	if err != nil {
		t.Fatal(err)
	}
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Restore(readCloser{st}); err != nil {
		t.Fatal(err)
	}
	if err := rd.Close(); err != nil {
		t.Fatal(err)
	}
	return f
}

type readCloser struct {
	r interface{ Read([]byte) (int, error) }
}

func (r readCloser) Read(p []byte) (int, error) { return r.r.Read(p) }
func (readCloser) Close() error                 { return nil }

func mustOpen(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// registerMany registers n instances through every node of c, with 32
// concurrent Connect clients.
func registerMany(t *testing.T, c *cluster, n int) {
	t.Helper()
	hc := c.httpClient(t)
	var clients []clusterv1connect.ClusterServiceClient
	for _, nd := range c.nodes {
		clients = append(clients, clusterv1connect.NewClusterServiceClient(hc, "https://"+nd.api))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	start := time.Now()
	for w := range 32 {
		wg.Go(func() {
			api := clients[w%len(clients)]
			for {
				i := next.Add(1) - 1
				if i >= int64(n) || ctx.Err() != nil {
					return
				}
				_, err := api.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
					Service: fmt.Sprintf("svc-%02d", i%50), InstanceId: fmt.Sprintf("i-%05d", i),
					Address: fmt.Sprintf("10.%d.%d.%d", i/65536%256, i/256%256, i%256), Port: uint32(1024 + i%60000),
					Tags: []string{"e2e"}, Meta: map[string]string{"n": fmt.Sprint(i)},
				}}))
				if err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("register %d: %w", i, err)
					}
					mu.Unlock()
					cancel()
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		t.Fatal(first)
	}
	t.Logf("registered %d instances in %s", n, time.Since(start).Round(time.Millisecond))
}

// listServices lists every instance through n with a consistent read, as
// decoded JSON objects (every field pvcli prints).
func listServices(t *testing.T, c *cluster, n *node) []map[string]any {
	t.Helper()
	var out struct {
		Instances []map[string]any `json:"instances"`
	}
	c.okJSON(t, n, &out, "--timeout", "60s", "service", "list", "--consistency", "consistent")
	return out.Instances
}

type corruption struct {
	data []byte
	msg  string
}

// corruptions returns damaged copies of an archive, each with what pvcli
// must say about it.
func corruptions(t *testing.T, file []byte) map[string]corruption {
	t.Helper()
	newer := rewriteMeta(t, file, func(m map[string]any) { m["format_version"] = 99 })
	return map[string]corruption{
		"wrong checksum":    {rewriteMeta(t, file, func(m map[string]any) {}), "checksum mismatch"},
		"truncated file":    {file[:len(file)*2/3], "truncated"},
		"unknown entry":     {appendEntry(t, file), `unknown archive entry "extra.txt"`},
		"trailing bytes":    {append(bytes.Clone(file), "tail"...), "trailing bytes"},
		"newer format":      {newer, "archive format version 99"},
		"non-snapshot file": {[]byte("this is not a snapshot\n"), "not a gzip"},
	}
}

// rewriteMeta re-packs file with meta.json changed by change and written
// in a new layout, keeping the original SHA256SUMS (so that an unchanged
// meta.json still fails its checksum: its bytes differ).
func rewriteMeta(t *testing.T, file []byte, change func(map[string]any)) []byte {
	t.Helper()
	entries := untar(t, file)
	var m map[string]any
	if err := json.Unmarshal(entries[0].data, &m); err != nil {
		t.Fatal(err)
	}
	change(m)
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	entries[0].data = b
	return retar(t, entries)
}

func appendEntry(t *testing.T, file []byte) []byte {
	t.Helper()
	return retar(t, append(untar(t, file), tarEntry{name: "extra.txt", data: []byte("x")}))
}

type tarEntry struct {
	name string
	data []byte
}

func untar(t *testing.T, file []byte) []tarEntry {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out []tarEntry
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, tarEntry{name: hdr.Name, data: b})
	}
}

func retar(t *testing.T, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	for _, e := range entries {
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o600, Size: int64(len(e.data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
