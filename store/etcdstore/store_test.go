package etcdstore_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/conformance"
	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

func apply(ctx context.Context, t *testing.T, s *etcdstore.Store, cmd *fsmv1.Command) (*fsm.Result, error) {
	t.Helper()
	resp, _, err := s.Apply(ctx, conformance.Encode(t, cmd))
	if err != nil {
		return nil, err
	}
	return resp.(*fsm.Result), nil
}

func mustApply(t *testing.T, s *etcdstore.Store, cmd *fsmv1.Command) *fsm.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := apply(ctx, t, s, cmd)
	if err != nil {
		t.Fatalf("apply: %v", err)
	}
	if res.Err != nil {
		t.Fatalf("apply: outcome %v", res.Err)
	}
	return res
}

func registerCmd(svc, id string, ttl time.Duration) *fsmv1.Command {
	inst := &clusterv1.ServiceInstance{Service: svc, InstanceId: id, Node: "n1", Address: "127.0.0.1", Port: 9001, Meta: map[string]string{"owner": "józsef"}}
	if ttl > 0 {
		inst.Ttl = durationpb.New(ttl)
	}
	return &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: inst}}}
}

func heartbeatCmd(svc, id string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: svc, InstanceId: id}}}
}

func setConfigCmd(key, value string) *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: value}}}
}

// eventually polls cond every 20ms until it returns nil, failing after d.
func eventually(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s: %v", what, d, err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}

// TestLeaseTTL: a TTL instance is held by an etcd lease that every write of
// it (a heartbeat) renews; without heartbeats etcd removes it everywhere.
func TestLeaseTTL(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	stores := openStores(t, ec, 2)
	cli := ec.Client(t)
	mustApply(t, stores[0], registerCmd("web", "a", 2*time.Second))
	mustApply(t, stores[0], registerCmd("web", "forever", 0))
	resp, err := cli.Get(context.Background(), "/pivirt/services/web/a")
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("the TTL instance's key: %v %v, want one key with a lease", resp, err)
	}
	lease := resp.Kvs[0].Lease
	ttl, err := cli.TimeToLive(context.Background(), clientv3.LeaseID(lease))
	if err != nil || ttl.GrantedTTL != 2 {
		t.Fatalf("lease TTL %v %v, want 2s", ttl, err)
	}
	// Heartbeats through either store keep it for three TTLs.
	end := time.Now().Add(6 * time.Second)
	for i := 0; time.Now().Before(end); i++ {
		mustApply(t, stores[i%2], heartbeatCmd("web", "a"))
		if s, _ := stores[i%2].State().Service("web", "a"); s == nil {
			t.Fatal("instance gone while heartbeating")
		}
		time.Sleep(500 * time.Millisecond) // the client's heartbeat interval
	}
	resp, _ = cli.Get(context.Background(), "/pivirt/services/web/a")
	if len(resp.Kvs) != 1 || resp.Kvs[0].Lease != lease {
		t.Fatalf("after heartbeats: %v, want the same lease %d", resp.Kvs, lease)
	}
	// Without heartbeats: gone from etcd and from every mirror.
	for i, s := range stores {
		eventually(t, 10*time.Second, "the expired instance leaves the mirror", func() error {
			if inst, _ := s.State().Service("web", "a"); inst != nil {
				return errors.New("still there")
			}
			return nil
		})
		if inst, _ := s.State().Service("web", "forever"); inst == nil {
			t.Fatalf("store %d lost the instance without TTL", i)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if res, err := apply(ctx, t, stores[0], heartbeatCmd("web", "a")); err != nil || !errors.Is(res.Err, fsm.ErrNotFound) {
		t.Fatalf("heartbeat after expiry: %v %v, want ErrNotFound (the client registers again)", res, err)
	}
}

// TestReadableKeys runs the spec's troubleshooting command, `etcdctl get
// /pivirt/services --prefix`, and reads the registrations it prints.
func TestReadableKeys(t *testing.T) {
	etcdctl, err := exec.LookPath("etcdctl")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("etcdctl is not installed (.ci/run installs Debian's etcd-client package)")
		}
		t.Skip("etcdctl is not installed")
	}
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	mustApply(t, s, registerCmd("pivirtd", "node-1", 30*time.Second))
	mustApply(t, s, registerCmd("iscsi/man", "node 2", 0))
	mustApply(t, s, setConfigCmd("routing.rules", "[]"))
	cmd := exec.Command(etcdctl, "--endpoints", ec.Endpoints[0], "get", "/pivirt/services", "--prefix")
	cmd.Env = append(os.Environ(), "ETCDCTL_API=3")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("etcdctl: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	want := []string{"/pivirt/services/iscsi%2Fman/node%202", "", "/pivirt/services/pivirtd/node-1", ""}
	if len(lines) != 4 {
		t.Fatalf("etcdctl printed:\n%s\nwant two keys and their values", out)
	}
	for i := 0; i < 4; i += 2 {
		if lines[i] != want[i] {
			t.Errorf("key %q, want %q", lines[i], want[i])
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(lines[i+1]), &v); err != nil {
			t.Fatalf("value of %s is not JSON: %v\n%s", lines[i], err, lines[i+1])
		}
		if v["address"] != "127.0.0.1" || v["port"] != float64(9001) || v["node"] != "n1" || v["health"] != "HEALTH_PASSING" ||
			v["meta"].(map[string]any)["owner"] != "józsef" || v["registered_at"] == nil {
			t.Errorf("value of %s: %s", lines[i], lines[i+1])
		}
		if _, ok := v["create_index"]; ok {
			t.Errorf("value of %s carries an index (it is the key's revision): %s", lines[i], lines[i+1])
		}
	}
}

// TestEtcdUnreachable stops the only etcd member: the store serves its
// last state (stale reads), is not ready, refuses writes with
// ErrUnavailable in bounded time, and recovers when etcd returns, with
// the writes other agents made meanwhile... none, as etcd was down; then
// with everything written after.
func TestEtcdUnreachable(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	stores := openStores(t, ec, 2)
	mustApply(t, stores[0], setConfigCmd("k", "before"))
	eventually(t, 10*time.Second, "store 1 sees the write", func() error {
		if e, _ := stores[1].State().ConfigEntry("k"); e.GetValue() != "before" {
			return errors.New("not yet")
		}
		return nil
	})
	ec.Stop(0)
	for _, s := range stores {
		eventually(t, 15*time.Second, "the store reports not ready", func() error {
			if s.Ready() {
				return errors.New("still ready")
			}
			return nil
		})
		if e, _ := s.State().ConfigEntry("k"); e.GetValue() != "before" {
			t.Fatalf("stale read: %v, want the last state", e)
		}
		if st := s.Status(); st.LastError == "" || st.Healthy {
			t.Fatalf("status while etcd is down: %+v", st)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	start := time.Now()
	_, err := apply(ctx, t, stores[0], setConfigCmd("k", "during"))
	cancel()
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("write while etcd is down: %v, want store.ErrUnavailable", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the write took %s to fail", d)
	}
	if _, err := stores[1].ReadIndex(context.Background()); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("read index while etcd is down: %v", err)
	}

	ec.Restart(0)
	for _, s := range stores {
		eventually(t, 30*time.Second, "the store is ready again", func() error {
			if !s.Ready() {
				return errors.New("not ready")
			}
			return nil
		})
	}
	mustApply(t, stores[1], setConfigCmd("k", "after"))
	eventually(t, 10*time.Second, "store 0 follows etcd again", func() error {
		if e, _ := stores[0].State().ConfigEntry("k"); e.GetValue() != "after" {
			return errors.New("not yet")
		}
		return nil
	})
}

// TestMemberFailover stops etcd members one at a time under writes from
// three stores: with a quorum left, every write succeeds (the clients move
// to a member that serves), and every store ends with every write.
func TestMemberFailover(t *testing.T) {
	ec := etcdtest.Start(t, 3)
	stores := openStores(t, ec, 3)
	n := 0
	write := func() {
		t.Helper()
		n++
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// A write whose outcome is unknown (the member died under it) is
		// retried with the same identity, as the gateway does.
		cmd := setConfigCmd("counter", "v")
		cmd.ClientId, cmd.Sequence, cmd.Time = "failover", uint64(n), timestamppb.Now()
		cmd.GetSetConfig().Value = strings.Repeat("x", n%7) + "v"
		for {
			res, err := apply(ctx, t, stores[n%3], cmd)
			if err == nil {
				if res.Err != nil {
					t.Fatalf("write %d: %v", n, res.Err)
				}
				return
			}
			if !errors.Is(err, store.ErrUnavailable) || ctx.Err() != nil {
				t.Fatalf("write %d: %v", n, err)
			}
			time.Sleep(50 * time.Millisecond) // retry interval
		}
	}
	for m := range 3 {
		for range 10 {
			write()
		}
		ec.Stop(m)
		for range 10 {
			write()
		}
		ec.Restart(m)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var revs []uint64
	for _, s := range stores {
		idx, err := s.ReadIndex(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.WaitApplied(ctx, idx); err != nil {
			t.Fatal(err)
		}
		hist, _ := s.State().ConfigHistory("counter")
		e, _ := s.State().ConfigEntry("counter")
		revs = append(revs, e.GetRevision())
		if len(hist) != fsm.DefaultConfig().ConfigHistoryLimit {
			t.Fatalf("history of %d versions, want the last %d", len(hist), fsm.DefaultConfig().ConfigHistoryLimit)
		}
	}
	if revs[0] != revs[1] || revs[1] != revs[2] {
		t.Fatalf("stores disagree on the revision: %v", revs)
	}
}

// TestRestart: a store opened on an etcd that already holds state loads it
// (as an agent restarting), and one that follows through an etcd restart
// reloads it.
func TestRestart(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	first := openStore(t, ec, "a")
	mustApply(t, first, registerCmd("web", "x", 0))
	mustApply(t, first, setConfigCmd("k", "v1"))
	mustApply(t, first, setConfigCmd("k", "v2"))
	_ = first.Close()
	second := openStore(t, ec, "a")
	if s, _ := second.State().Service("web", "x"); s == nil {
		t.Fatal("the reopened store lacks the instance")
	}
	if h, _ := second.State().ConfigHistory("k"); len(h) != 2 || h[0].GetValue() != "v2" || h[0].GetRevision() <= h[1].GetRevision() {
		t.Fatalf("history after reopening: %v", h)
	}
	ec.Stop(0)
	ec.Restart(0)
	eventually(t, 30*time.Second, "ready after the etcd restart", func() error {
		if !second.Ready() {
			return errors.New("not ready")
		}
		return nil
	})
	mustApply(t, second, setConfigCmd("k", "v3"))
	if e, _ := second.State().ConfigEntry("k"); e.GetValue() != "v3" {
		t.Fatalf("after the restart: %v", e)
	}
}

// TestRestoreAcrossModes moves a state with records in every table
// (fsmtest.FullState) from the Raft FSM into etcd and back: every record
// arrives, indexes restart in etcd's revisions with the config history in
// order, and the state taken from etcd restores into an FSM with the same
// records.
func TestRestoreAcrossModes(t *testing.T) {
	src, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range fsmtest.FullState() {
		res := src.Apply(&raft.Log{Index: uint64(1001 + i), Type: raft.LogCommand, Data: conformance.Encode(t, st.Cmd)}).(*fsm.Result)
		if fsm.ErrorCode(res.Err) != st.WantErr {
			t.Fatalf("step %d: %v, want %q", i, res.Err, st.WantErr)
		}
	}
	var snap bytes.Buffer
	if err := src.WriteSnapshot(&snap); err != nil {
		t.Fatal(err)
	}

	ec := etcdtest.Start(t, 1)
	stores := openStores(t, ec, 2)
	// Something to be replaced.
	mustApply(t, stores[0], setConfigCmd("stale", "x"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := stores[0].Restore(ctx, 0, int64(snap.Len()), bytes.NewReader(snap.Bytes())); err != nil {
		t.Fatal(err)
	}
	const key = "routing.rules" // two versions in the full state
	for i, s := range stores {
		idx, _ := s.ReadIndex(ctx)
		if err := s.WaitApplied(ctx, idx); err != nil {
			t.Fatal(err)
		}
		st := s.State()
		sameRecords(t, src.State(), st)
		if e, _ := st.ConfigEntry("stale"); e != nil {
			t.Fatalf("store %d kept a key the snapshot lacks", i)
		}
		h, _ := st.ConfigHistory(key)
		e, _ := st.ConfigEntry(key)
		if len(h) != 2 || h[0].GetValue() != e.GetValue() || h[0].GetRevision() != e.GetRevision() || h[1].GetRevision() >= h[0].GetRevision() {
			t.Fatalf("store %d: history %v, current %v: want the current version first (its revision), then the older one", i, h, e)
		}
		if e.GetRevision() > idx {
			t.Fatalf("store %d: revision %d beyond etcd's %d", i, e.GetRevision(), idx)
		}
	}
	// The TTL instance got a lease.
	resp, _ := ec.Client(t).Get(ctx, "/pivirt/services/web/a")
	if len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("restored TTL instance without a lease: %v", resp.Kvs)
	}
	// Writes go on from the restored state: a CAS on the restored revision.
	e, _ := stores[1].State().ConfigEntry(key)
	rev := e.GetRevision()
	res, err := apply(ctx, t, stores[1], &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: &fsmv1.SetConfig{Key: key, Value: "v4", CasRevision: &rev}}})
	if err != nil || res.Err != nil {
		t.Fatalf("cas on the restored revision: %v %v", res, err)
	}

	// And back: etcd's state into a fresh FSM (the Raft side of a restore).
	_, rc, err := stores[1].Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	back, _ := fsm.New(fsm.LatestConfig())
	if err := back.Restore(rc); err != nil {
		t.Fatal(err)
	}
	sameRecords(t, stores[1].State(), back.State())
}

// notRestored are the tables a restore into etcd does not carry over, and
// why; sameRecords compares every other table.
var notRestored = map[string]string{
	fsm.TableIndex:    "etcd's revisions are the indexes",
	fsm.TableDedupe:   "etcd mode restores no dedupe records (store/etcdstore DESIGN.md \"Snapshots and migration\")",
	fsm.TableSessions: "etcd mode keeps no sessions: a dedupe record per write instead (fsm DESIGN.md \"Dedupe\")",
}

// sameRecords compares every table a restore carries (notRestored aside)
// of two states, index fields aside (etcd renumbers them, the config
// history included).
func sameRecords(t *testing.T, want, got *fsm.State) {
	t.Helper()
	for _, table := range fsm.Tables() {
		if _, ok := notRestored[table]; ok {
			continue
		}
		w, err := want.Records(table)
		if err != nil {
			t.Fatal(err)
		}
		g, err := got.Records(table)
		if err != nil {
			t.Fatal(err)
		}
		if len(w) != len(g) {
			t.Fatalf("%s: %d records, want %d", table, len(g), len(w))
		}
		for i := range w {
			a, b := proto.Clone(w[i]), proto.Clone(g[i])
			fsm.ClearIndexFields(a)
			fsm.ClearIndexFields(b)
			if !proto.Equal(a, b) {
				t.Fatalf("%s record %d:\n got %v\nwant %v", table, i, b, a)
			}
		}
	}
}

// TestLostAnswerKeepsTheInstance: writes of TTL instances whose answer is
// lost (the caller's deadline passes mid-write) and are then retried with
// the same identity, as the gateway does: whenever the retry reports the
// write done, the instance is there (its lease was not revoked under a
// write that committed).
func TestLostAnswerKeepsTheInstance(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	lost, committed := 0, 0
	for i := range 150 {
		cmd := registerCmd("ttl", fmt.Sprintf("i%d", i), time.Minute)
		cmd.ClientId, cmd.Sequence, cmd.Time = "lossy", uint64(i+1), timestamppb.Now()
		// Deadlines from 0.5 to 15 ms: some end before the write, some
		// while it commits, some after.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(1+i%30)*500*time.Microsecond)
		_, applyErr := apply(ctx, t, s, cmd)
		cancel()
		if applyErr != nil {
			lost++
			if mustApply(t, s, cmd).Duplicate {
				committed++
			}
		}
		idx, err := s.ReadIndex(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if err := s.WaitApplied(context.Background(), idx); err != nil {
			t.Fatal(err)
		}
		if inst, _ := s.State().Service("ttl", fmt.Sprintf("i%d", i)); inst == nil {
			t.Fatalf("write %d reported done (answer lost first: %v) but the instance is gone", i, applyErr != nil)
		}
	}
	t.Logf("%d of 150 answers lost and retried; %d of those writes had committed", lost, committed)
	if !s.Ready() {
		t.Fatalf("callers' deadlines made the store not ready: %+v", s.Status())
	}
}

// TestLargeConfigHistory: config values near the size limit are written
// again and again; etcd mode keeps as many versions as fit in one etcd
// request instead of failing the writes.
func TestLargeConfigHistory(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	for i := range 8 {
		v := strings.Repeat(string(rune('a'+i)), fsm.MaxConfigValueSize)
		mustApply(t, s, setConfigCmd("big", v))
	}
	e, _ := s.State().ConfigEntry("big")
	h, _ := s.State().ConfigHistory("big")
	if len(e.GetValue()) != fsm.MaxConfigValueSize || e.GetValue()[0] != 'h' || len(h) == 0 || h[0].GetValue() != e.GetValue() {
		t.Fatalf("current %d bytes of %q, %d versions", len(e.GetValue()), e.GetValue()[:1], len(h))
	}
	t.Logf("%d versions of %d bytes kept", len(h), fsm.MaxConfigValueSize)
}

// TestCancelledCallerKeepsReady: a caller giving up says nothing about etcd.
func TestCancelledCallerKeepsReady(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.ReadIndex(ctx); err == nil {
		t.Fatal("read index with a cancelled context succeeded")
	}
	if _, err := apply(ctx, t, s, setConfigCmd("k", "v")); err == nil {
		t.Fatal("apply with a cancelled context succeeded")
	}
	if !s.Ready() {
		t.Fatalf("not ready after cancelled calls: %+v", s.Status())
	}
}

// TestResignAlone: the only candidate resigns and wins again; Resign
// returns once it resigned.
func TestResignAlone(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	eventually(t, 10*time.Second, "leadership", func() error {
		if !s.IsLeader() {
			return errors.New("not leader")
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Resign(ctx); err != nil {
		t.Fatalf("resign: %v", err)
	}
	eventually(t, 10*time.Second, "leadership again", func() error {
		if !s.IsLeader() {
			return errors.New("not leader")
		}
		return nil
	})
}

// TestRestoreFencesTheDispatcher: while a restore's marker exists the
// schedule leader's claims are refused, and accepted again after.
func TestRestoreFencesTheDispatcher(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	s := openStores(t, ec, 1)[0]
	cli := ec.Client(t)
	eventually(t, 10*time.Second, "leadership", func() error {
		if !s.IsLeader() {
			return errors.New("not leader")
		}
		return nil
	})
	mustApply(t, s, &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: &schedulev1.Schedule{
		Id: "s", VmId: "vm", Action: schedulev1.Action_ACTION_REBOOT, Cron: "@every 1m", Enabled: true,
	}}}})
	claim := func(slot time.Time) (*fsm.Result, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return apply(ctx, t, s, &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{ScheduleId: "s", Slot: timestamppb.New(slot), Node: "n"}}})
	}
	if _, err := cli.Put(context.Background(), "/pivirt/meta/restoring", "other-node"); err != nil {
		t.Fatal(err)
	}
	slot := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	if _, err := claim(slot); !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "restore") {
		t.Fatalf("claim during a restore: %v, want ErrUnavailable naming the restore", err)
	}
	if _, err := cli.Delete(context.Background(), "/pivirt/meta/restoring"); err != nil {
		t.Fatal(err)
	}
	if res, err := claim(slot); err != nil || res.Err != nil {
		t.Fatalf("claim after the restore: %v %v", res, err)
	}
}
