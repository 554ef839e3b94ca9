package agent_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// archiveOf writes records as the whole state of a snapshot archive.
func archiveOf(t *testing.T, records ...fsm.TableRecord) []byte {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Replace(500, records); err != nil {
		t.Fatal(err)
	}
	var st, out bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		t.Fatal(err)
	}
	if err := archive.Write(&out, archive.Meta{ID: "1-500-0", Index: 500, Term: 1, ClusterID: "another-cluster", Size: int64(st.Len())}, &st); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

func configRecord(key, value string) fsm.TableRecord {
	return fsm.TableRecord{Table: fsm.TableConfig, Record: &clusterv1.ConfigEntry{Key: key, Value: value, Revision: 400, CreateIndex: 400, UpdatedAt: timestamppb.Now()}}
}

func serviceRecord(service, id string) fsm.TableRecord {
	return fsm.TableRecord{Table: fsm.TableServices, Record: &clusterv1.ServiceInstance{Service: service, InstanceId: id, Address: "10.0.0.9", Port: 80,
		Health: clusterv1.Health_HEALTH_PASSING, CreateIndex: 400, ModifyIndex: 400, RegisteredAt: timestamppb.Now()}}
}

// restoreArchive uploads data through the API port (gRPC) as the caller
// of ctx; a dry run plans the restore (PlanRestore).
func (e *accessEnv) restoreArchive(ctx context.Context, data []byte, dryRun bool) (*clusterv1.RestoreSnapshotResponse, error) {
	client := clusterv1.NewSnapshotServiceClient(e.conn)
	if dryRun {
		stream, err := client.PlanRestore(ctx)
		if err != nil {
			return nil, err
		}
		if err := stream.Send(&clusterv1.PlanRestoreRequest{Data: data}); err != nil {
			_, err = stream.CloseAndRecv()
			return nil, err
		}
		r, err := stream.CloseAndRecv()
		if err != nil {
			return nil, err
		}
		return &clusterv1.RestoreSnapshotResponse{Meta: r.GetMeta(), Plan: r.GetPlan()}, nil
	}
	stream, err := client.RestoreSnapshot(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&clusterv1.RestoreSnapshotRequest{Data: data}); err != nil {
		_, err = stream.CloseAndRecv()
		return nil, err
	}
	return stream.CloseAndRecv()
}

// TestRestoreObeysTheWritePath is the attack of a caller who may restore
// snapshots and uploads an archive that carries what its writes could
// never make: a policy that grants everyone everything (without the
// rights on rbac), a policy that does not parse, an oversized config value,
// another cluster's CA with its key and another cluster.id. Each is
// refused or dropped, and nothing of a refused archive is applied; a dry
// run shows the plan and changes nothing.
func TestRestoreObeysTheWritePath(t *testing.T) {
	spec, err := os.ReadFile(filepath.Join("..", "..", "..", "gateway", "authz", "testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy := filepath.Join(t.TempDir(), "rbac.yaml")
	backupRule := "\n  - roles: [\"backup\"]\n    resources: [\"snapshots\", \"services\", \"config\", \"schedules\"]\n    verbs: [\"*\"]\n"
	if err := os.WriteFile(policy, append(spec, backupRule...), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newAccessEnv(t, 3, func(cfg *config.Config) { cfg.Auth.RBACPolicy = policy })
	admin := as(e.ctx(), e.token("root", "admin"))
	backup := as(e.ctx(), e.token("bob", "backup"))
	leader := e.c.WaitLeader(30 * time.Second)
	e.conn = e.dialAt(e.c.Follower().APIAddr(), nil) // relayed to the leader: the rights are checked on the follower
	state := func() (clusterID string, ca []proto.Message, policySet bool) {
		st := leader.FSM().State()
		if id, err := st.ConfigEntry(gateway.ClusterIDKey); err == nil {
			clusterID = id.GetValue()
		}
		ca, err := st.Records(fsm.TableCA)
		if err != nil {
			t.Fatal(err)
		}
		_, err = st.ConfigEntry(agent.RBACPolicyKey)
		return clusterID, ca, err == nil
	}
	// The first leader sets cluster.id just after its term starts.
	var idBefore string
	var caBefore []proto.Message
	agenttest.Eventually(t, 30*time.Second, "the cluster has a cluster.id", func() error {
		if idBefore, caBefore, _ = state(); idBefore == "" {
			return errors.New("no cluster.id yet")
		}
		return nil
	})
	unchanged := func(what string) {
		t.Helper()
		id, ca, policySet := state()
		if id != idBefore || len(ca) != len(caBefore) || policySet {
			t.Fatalf("%s: the state changed (cluster.id %s, %d CA records, policy set %v)", what, id, len(ca), policySet)
		}
	}

	permissive := "apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules:\n  - roles: [\"*\"]\n    resources: [\"*\"]\n    verbs: [\"*\"]\n"
	for _, tc := range []struct {
		name   string
		ctx    context.Context
		data   []byte
		code   codes.Code
		reason string
	}{
		{"a policy for everyone, without rights on rbac", backup, archiveOf(t, configRecord(agent.RBACPolicyKey, permissive), serviceRecord("web", "w1")),
			codes.PermissionDenied, "bob (roles backup) may not update rbac"},
		{"a policy that does not parse", admin, archiveOf(t, configRecord(agent.RBACPolicyKey, "rules: [")),
			codes.InvalidArgument, "config auth.rbac_policy"},
		{"a policy nobody could change again", admin, archiveOf(t, configRecord(agent.RBACPolicyKey, strings.Replace(permissive, `resources: ["*"]`, `resources: ["services"]`, 1))),
			codes.InvalidArgument, "could never be changed or removed again"},
		{"a 600 KiB config value", admin, archiveOf(t, configRecord("big", strings.Repeat("x", 600<<10))),
			codes.InvalidArgument, "over the 524288-byte limit"},
		{"a service no write could register", admin, archiveOf(t, serviceRecord("web", "bad id")),
			codes.InvalidArgument, "service web/bad id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.restoreArchive(tc.ctx, tc.data, false)
			if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.reason) {
				t.Fatalf("got %v, want %s saying %q", err, tc.code, tc.reason)
			}
			unchanged(tc.name)
		})
	}

	// A caller field sent on the API port (it is for agents relaying over
	// the internal port) changes nothing: bob stays bob.
	forged := archiveOf(t, configRecord(agent.RBACPolicyKey, permissive))
	stream, err := clusterv1.NewSnapshotServiceClient(e.conn).RestoreSnapshot(backup)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&clusterv1.RestoreSnapshotRequest{Data: forged, Caller: &clusterv1.RestoreCaller{Identity: "root", Roles: []string{"admin"}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.CloseAndRecv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a restore with a forged caller field: %v, want PermissionDenied", err)
	}
	unchanged("forged caller field")

	// Another cluster's archive with its CA and key: restored, with this
	// cluster's CA and cluster.id kept. A dry run first changes nothing.
	certPEM, keyPEM := fsmtest.CA()
	foreign := archiveOf(t, serviceRecord("web", "w1"), configRecord("cluster.id", "another-cluster"),
		fsm.TableRecord{Table: fsm.TableCA, Record: &fsmv1.ClusterCA{CertPem: certPEM, KeyPem: keyPEM, Index: 300}},
		fsm.TableRecord{Table: fsm.TableDedupe, Record: &fsmv1.DedupeRecord{ClientId: "planted", Sequence: 1, Time: timestamppb.New(time.Now().Add(24 * time.Hour))}})
	dry, err := e.restoreArchive(backup, foreign, true)
	if err != nil {
		t.Fatalf("dry run: %v", err)
	}
	p := dry.GetPlan()
	if !p.GetCaIgnored() || p.GetArchiveClusterId() != "another-cluster" || !slices.Equal(p.GetResources(), []string{"services"}) || dry.GetIndex() != 0 {
		t.Fatalf("dry-run plan %v", p)
	}
	if _, err := leader.FSM().State().Service("web", "w1"); err == nil {
		t.Fatal("the dry run restored the archive")
	}
	unchanged("dry run")
	if _, err := e.restoreArchive(backup, foreign, false); err != nil {
		t.Fatalf("restore: %v", err)
	}
	if _, err := leader.FSM().State().Service("web", "w1"); err != nil {
		t.Fatalf("the restored service: %v", err)
	}
	id, ca, _ := state()
	if id != idBefore || len(ca) != len(caBefore) {
		t.Fatalf("after the restore: cluster.id %s (was %s), %d CA records (were %d)", id, idBefore, len(ca), len(caBefore))
	}
	for i := range ca {
		if !proto.Equal(ca[i], caBefore[i]) {
			t.Fatal("the archive's CA replaced the cluster's")
		}
	}
	dedupe, err := leader.FSM().State().Records(fsm.TableDedupe)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range dedupe {
		if r.(*fsmv1.DedupeRecord).GetClientId() == "planted" {
			t.Fatal("the archive's dedupe record was restored")
		}
	}
	// Raft mode turns restored dedupe records into sessions.
	if res, err := leader.FSM().State().WriteOutcome("planted", 1); err != nil || res != nil {
		t.Fatalf("the archive's dedupe record answers as an outcome: %+v, %v", res, err)
	}
}

// TestPlanRestoreRefusesABomb: an archive of a few KiB whose state.bin
// declares 64 MiB (with valid checksums: a genuine gzip bomb), planned by a
// caller who may only read snapshots, through a follower, is refused on the
// declared sizes before the leader decodes it; a genuine archive is still
// decoded and planned (and the plan refused for the rights it needs).
func TestPlanRestoreRefusesABomb(t *testing.T) {
	e := newAccessEnv(t, 3, nil)
	e.c.WaitLeader(30 * time.Second)
	e.conn = e.dialAt(e.c.Follower().APIAddr(), nil)
	reader := as(e.ctx(), e.token("carol", "viewer"))

	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Replace(500, []fsm.TableRecord{serviceRecord("web", "web-1")}); err != nil {
		t.Fatal(err)
	}
	var st bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		t.Fatal(err)
	}
	state := append(st.Bytes(), make([]byte, 64<<20)...)
	var bomb bytes.Buffer
	if err := archive.Write(&bomb, archive.Meta{ID: "1-500-0", Index: 500, Term: 1, ClusterID: "another-cluster", Size: int64(len(state))}, bytes.NewReader(state)); err != nil {
		t.Fatal(err)
	}
	if bomb.Len() > 1<<20 {
		t.Fatalf("the archive is %d bytes: not a bomb", bomb.Len())
	}
	_, err = e.restoreArchive(reader, bomb.Bytes(), true)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "times the archive") {
		t.Fatalf("plan of a %d-byte archive declaring %d bytes of state: %v, want InvalidArgument refusing it on its sizes", bomb.Len(), len(state), err)
	}
	// A genuine archive is decoded and planned: the plan's rights check
	// refuses the viewer on what it would change.
	_, err = e.restoreArchive(reader, archiveOf(t, serviceRecord("web", "web-1")), true)
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "update services") {
		t.Fatalf("plan of a genuine archive by a viewer: %v, want PermissionDenied for the services it changes", err)
	}
}
