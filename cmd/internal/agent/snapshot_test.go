package agent_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func snapshotClient(n *agenttest.Node) clusterv1connect.SnapshotServiceClient {
	return clusterv1connect.NewSnapshotServiceClient(agenttest.NewHTTPClient(), "http://"+n.APIAddr())
}

// saveSnapshot streams an archive from n over Connect.
func saveSnapshot(ctx context.Context, n *agenttest.Node, stale bool) (*clusterv1.SnapshotMeta, []byte, error) {
	return saveSnapshotWith(ctx, snapshotClient(n), stale)
}

// saveSnapshotWith streams an archive through client.
func saveSnapshotWith(ctx context.Context, client clusterv1connect.SnapshotServiceClient, stale bool) (*clusterv1.SnapshotMeta, []byte, error) {
	stream, err := client.SaveSnapshot(ctx, connect.NewRequest(&clusterv1.SaveSnapshotRequest{Stale: stale}))
	if err != nil {
		return nil, nil, err
	}
	defer stream.Close()
	var (
		meta *clusterv1.SnapshotMeta
		buf  bytes.Buffer
	)
	for stream.Receive() {
		if m := stream.Msg().GetMeta(); m != nil {
			if meta != nil {
				return nil, nil, errors.New("meta sent twice")
			}
			meta = m
		}
		buf.Write(stream.Msg().GetData())
	}
	return meta, buf.Bytes(), stream.Err()
}

// restoreSnapshot uploads file to n over Connect, in small chunks.
func restoreSnapshot(ctx context.Context, n *agenttest.Node, file []byte) (*clusterv1.RestoreSnapshotResponse, error) {
	stream := snapshotClient(n).RestoreSnapshot(ctx)
	for chunk := range slices.Chunk(file, 4096) {
		if err := stream.Send(&clusterv1.RestoreSnapshotRequest{Data: chunk}); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, err
		}
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// nodeState is what a node's state holds: records and table indexes.
type nodeState struct {
	services []string
	config   map[string]string
	indexes  map[string]uint64
}

func stateOf(t *testing.T, n *agenttest.Node) nodeState {
	t.Helper()
	services, cfg := records(t, n)
	idx := map[string]uint64{}
	for _, table := range fsm.Tables() {
		idx[table] = n.FSM().State().Index(table)
	}
	return nodeState{services: services, config: cfg, indexes: idx}
}

// records lists the services and config of a node's state, read locally.
func records(t *testing.T, n *agenttest.Node) (services []string, config map[string]string) {
	t.Helper()
	st := n.FSM().State()
	_, list, err := st.Services("", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list {
		services = append(services, fmt.Sprintf("%s/%s %s:%d %v", s.GetService(), s.GetInstanceId(), s.GetAddress(), s.GetPort(), s.GetMeta()))
	}
	_, entries, err := st.ConfigEntries(nil)
	if err != nil {
		t.Fatal(err)
	}
	config = map[string]string{}
	for _, e := range entries {
		config[e.GetKey()] = e.GetValue()
	}
	return services, config
}

// TestSnapshotSaveRestoreAcrossClusters saves a snapshot of one cluster
// through a follower (forwarded to the leader), over Connect and gRPC, and
// with --stale; refuses damaged archives on another cluster without
// touching it; then restores the archive into that cluster through a
// follower and finds every record on every node (cluster B keeps its own
// cluster.id), with indexes that moved forward and consistent reads and
// writes that work.
func TestSnapshotSaveRestoreAcrossClusters(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	a := agenttest.NewExpect(t, 3, nil)
	leaderA := a.WaitLeader(30 * time.Second)
	for i := range 200 {
		if _, err := agenttest.Register(ctx, leaderA, "web", fmt.Sprintf("w-%03d", i), "10.0.0.1", uint32(1000+i)); err != nil {
			t.Fatal(err)
		}
	}
	// An instance with a TTL: its last heartbeat in the archive will be
	// older than the TTL when the archive is restored.
	if _, err := leaderA.API.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
		Service: "ttl", InstanceId: "t-1", Address: "10.0.0.3", Port: 3, Ttl: durationProto(2 * time.Second),
	}})); err != nil {
		t.Fatal(err)
	}
	for _, kv := range [][2]string{{"kv/log.level", "debug"}, {"routing.rules", `[]`}} {
		if _, err := leaderA.API.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: kv[0], Value: kv[1]})); err != nil {
			t.Fatal(err)
		}
	}
	var clusterA string
	agenttest.Eventually(t, 10*time.Second, "cluster A has an id", func() error {
		e, err := leaderA.FSM().State().ConfigEntry(gateway.ClusterIDKey)
		clusterA = e.GetValue()
		return err
	})
	wantServices, wantConfig := records(t, leaderA)

	// Automatic snapshots: the first archive is due at once when the
	// leader's snapshot dir holds none, and /metrics reports it.
	backups := filepath.Join(a.Dir(a.Index(leaderA)), "backups")
	agenttest.Eventually(t, 20*time.Second, "an automatic archive on the leader", func() error {
		entries, err := os.ReadDir(backups)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if strings.HasSuffix(e.Name(), ".tar.gz") {
				f, err := os.Open(filepath.Join(backups, e.Name()))
				if err != nil {
					return err
				}
				defer f.Close()
				_, err = archive.Verify(f)
				return err
			}
		}
		return fmt.Errorf("no archive in %s yet", backups)
	})
	agenttest.Eventually(t, 10*time.Second, "snapshot metrics", func() error {
		resp, err := http.Get("http://" + leaderA.MetricsAddr() + "/metrics")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(body), "\n") {
			if v, ok := strings.CutPrefix(line, "pivirt_snapshot_last_success_timestamp_seconds "); ok && v != "0" {
				return nil
			}
		}
		return errors.New("pivirt_snapshot_last_success_timestamp_seconds not set")
	})

	followerA := a.Follower()
	meta, file, err := saveSnapshot(ctx, followerA, false)
	if err != nil {
		t.Fatalf("save through a follower: %v", err)
	}
	info, err := archive.Verify(bytes.NewReader(file))
	if err != nil {
		t.Fatalf("the saved archive does not verify: %v", err)
	}
	if info.Meta.ID != meta.GetId() || info.Meta.Index != meta.GetIndex() || info.Meta.ClusterID != clusterA || meta.GetClusterId() != clusterA {
		t.Errorf("stream meta %v, archive meta %+v; want the same, cluster %s", meta, info.Meta, clusterA)
	}
	if idx := leaderA.FSM().AppliedIndex(); info.Meta.Index == 0 || info.Meta.Index > idx+1 {
		t.Errorf("archive index %d; the leader applied %d", info.Meta.Index, idx)
	}
	for _, tb := range info.State.Tables {
		if tb.Name == fsm.TableServices && tb.Records != 201 {
			t.Errorf("archive holds %d services, want 201", tb.Records)
		}
	}

	// --stale is served by the follower itself, from its own state.
	if _, stale, err := saveSnapshot(ctx, followerA, true); err != nil {
		t.Errorf("save --stale: %v", err)
	} else if _, err := archive.Verify(bytes.NewReader(stale)); err != nil {
		t.Errorf("the --stale archive does not verify: %v", err)
	}

	// gRPC clients get the same stream from the same port.
	conn, err := grpc.NewClient("passthrough:///"+followerA.APIAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	gs, err := clusterv1.NewSnapshotServiceClient(conn).SaveSnapshot(ctx, &clusterv1.SaveSnapshotRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var viaGRPC bytes.Buffer
	for {
		m, err := gs.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("gRPC save: %v", err)
		}
		viaGRPC.Write(m.GetData())
	}
	if _, err := archive.Verify(bytes.NewReader(viaGRPC.Bytes())); err != nil {
		t.Errorf("the archive saved over gRPC does not verify: %v", err)
	}

	// Cluster B, with state of its own.
	b := agenttest.NewExpect(t, 3, nil)
	leaderB := b.WaitLeader(30 * time.Second)
	// Cluster B keeps its own cluster.id through the restore.
	agenttest.Eventually(t, 10*time.Second, "cluster B has an id", func() error {
		e, err := leaderB.FSM().State().ConfigEntry(gateway.ClusterIDKey)
		wantConfig[gateway.ClusterIDKey] = e.GetValue()
		return err
	})
	if _, err := agenttest.Register(ctx, leaderB, "other", "o-1", "10.9.9.9", 9); err != nil {
		t.Fatal(err)
	}
	followerB := b.Follower()
	before := stateOf(t, leaderB)
	beforeIndex := leaderB.FSM().State().Index(fsm.TableServices)

	// Damaged archives are refused with InvalidArgument, or
	// FailedPrecondition for a newer format, and change nothing.
	flipped := bytes.Clone(file)
	flipped[len(flipped)/2] ^= 0x10
	for name, bad := range map[string][]byte{
		"truncated":      file[:len(file)-20],
		"trailing bytes": append(bytes.Clone(file), "junk"...),
		"flipped byte":   flipped,
		"not a snapshot": []byte("#!/bin/sh\necho hello\n"),
		"unknown entry":  withExtraEntry(t, file),
		"empty":          nil,
	} {
		_, err := restoreSnapshot(ctx, followerB, bad)
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("restore of a %s archive: %v, want InvalidArgument", name, err)
		}
	}
	if after := stateOf(t, leaderB); !reflect.DeepEqual(after, before) {
		t.Fatalf("a refused restore changed cluster B:\n%v\nwas\n%v", after, before)
	}

	// A blocking query waiting on cluster B's services is woken by the
	// restore, with an index above the one it waited on.
	type blocked struct {
		index uint64
		err   error
	}
	woken := make(chan blocked, 1)
	go func() {
		r, err := followerB.API.ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{
			Read: &clusterv1.ReadOptions{WaitIndex: beforeIndex, WaitTime: durationProto(time.Minute)},
		}))
		if err != nil {
			woken <- blocked{err: err}
			return
		}
		woken <- blocked{index: r.Msg.GetMeta().GetIndex()}
	}()

	resp, err := restoreSnapshot(ctx, followerB, file)
	if err != nil {
		t.Fatalf("restore through a follower of cluster B: %v", err)
	}
	select {
	case w := <-woken:
		if w.err != nil || w.index <= beforeIndex {
			t.Errorf("blocking query after the restore: index %d, %v; want an index above %d", w.index, w.err, beforeIndex)
		}
	case <-time.After(30 * time.Second):
		t.Error("a blocking query on cluster B was not woken by the restore")
	}
	if p := resp.GetPlan(); p.GetArchiveClusterId() != clusterA || p.GetTables() == nil {
		t.Errorf("restore plan %v; want cluster A's id %s named as the archive's", p, clusterA)
	}
	if resp.GetMeta().GetId() != info.Meta.ID || resp.GetIndex() <= max(beforeIndex, info.Meta.Index) {
		t.Errorf("restore response %v; want archive %s at an index above cluster B's %d and the archive's %d", resp, info.Meta.ID, beforeIndex, info.Meta.Index)
	}
	// Leader state was rebuilt from the restored state: the TTL instance,
	// whose restored heartbeat is past its TTL, gets a full TTL from the
	// restore before the reaper marks it critical, and then it does.
	if inst, err := leaderB.FSM().State().Service("ttl", "t-1"); err != nil || inst.GetHealth() != clusterv1.Health_HEALTH_PASSING {
		t.Errorf("TTL instance right after the restore: %v, %v; want passing", inst, err)
	}
	agenttest.Eventually(t, 20*time.Second, "the rebuilt TTL reaper marks the restored instance critical", func() error {
		inst, err := leaderB.FSM().State().Service("ttl", "t-1")
		if err != nil {
			return err
		}
		if inst.GetHealth() != clusterv1.Health_HEALTH_CRITICAL {
			return fmt.Errorf("health %v", inst.GetHealth())
		}
		return nil
	})
	for _, n := range b.Nodes() {
		agenttest.Eventually(t, 20*time.Second, n.Name+" holds the restored state", func() error {
			if n.FSM().AppliedIndex() < resp.GetIndex() {
				return fmt.Errorf("applied %d, restore at %d", n.FSM().AppliedIndex(), resp.GetIndex())
			}
			return nil
		})
		services, cfg := records(t, n)
		if !slices.Equal(services, wantServices) {
			t.Errorf("%s: %d services after the restore, want the %d of cluster A", n.Name, len(services), len(wantServices))
		}
		for k, v := range wantConfig {
			if cfg[k] != v {
				t.Errorf("%s: config %s = %q, want %q", n.Name, k, cfg[k], v)
			}
		}
		for _, table := range []string{fsm.TableServices, fsm.TableConfig, fsm.TableSchedules} {
			if idx := n.FSM().State().Index(table); idx < resp.GetIndex() || idx <= info.Meta.Index {
				t.Errorf("%s: %s index %d after the restore, want at least %d, above the archive's %d", n.Name, table, idx, resp.GetIndex(), info.Meta.Index)
			}
		}
		if applied := n.FSM().AppliedIndex(); applied > n.Store().Status().AppliedIndex {
			t.Errorf("%s: the FSM claims index %d, raft applied only %d", n.Name, applied, n.Store().Status().AppliedIndex)
		}
	}

	// Reads and writes go on: a consistent read through a follower sees
	// the restored state, and a new write applies after it.
	got, err := followerB.API.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{
		Service: "web", InstanceId: "w-007", Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}))
	if err != nil || len(got.Msg.GetInstances()) != 1 || got.Msg.GetInstances()[0].GetPort() != 1007 {
		t.Errorf("consistent read after the restore: %v, %v", got, err)
	}
	if _, err := followerB.API.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{Service: "other", InstanceId: "o-1"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("cluster B's own instance after the restore: %v, want NotFound", err)
	}
	reg, err := agenttest.Register(ctx, followerB, "web", "w-new", "10.0.0.2", 1)
	if err != nil || reg.GetIndex() <= resp.GetIndex() {
		t.Errorf("write after the restore: %v, %v", reg, err)
	}
}

// withExtraEntry returns file with one more tar entry at the end.
func withExtraEntry(t *testing.T, file []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	tw := tar.NewWriter(zw)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.WriteHeader(&tar.Header{Name: "notes.txt", Mode: 0o600, Size: 2, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	tw.Close()
	zw.Close()
	return out.Bytes()
}
