package e2e_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestMigrateBetweenModes moves a cluster's state from the embedded Raft
// mode into etcd mode and back with `pvcli snapshot save` and `pvcli
// snapshot restore`, as docs/etcd.md tells an operator to: three
// agent processes per cluster, a real three-member etcd, every service
// instance, config key (with its history) and schedule (with its runs)
// arriving at each step. On the way the spec's troubleshooting command
// `etcdctl get /pivirt/services --prefix` lists the registrations.
func TestMigrateBetweenModes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs three clusters of real processes and an etcd")
	}
	etcdctl, err := exec.LookPath("etcdctl")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("etcdctl is not installed (.ci/run installs Debian's etcd-client package)")
		}
		t.Skip("etcdctl is not installed")
	}
	const services = 300
	bins := buildBinaries(t)
	work := t.TempDir()

	// The Raft cluster and its state.
	raft1 := startCluster(t, bins)
	n := raft1.nodes[0]
	registerMany(t, raft1, services)
	raft1.ok(t, n, "config", "set", "kv/routing.note", "first")
	raft1.ok(t, n, "config", "set", "kv/routing.note", "second")
	var vm struct {
		VM vmOut `json:"vm"`
	}
	raft1.okJSON(t, n, &vm, "vm", "create", "migrated", "--vcpus", "1", "--memory-mib", "256")
	raft1.ok(t, n, "vm", "start", vm.VM.ID)
	var sched struct {
		Schedule struct {
			ID string `json:"id"`
		} `json:"schedule"`
	}
	raft1.okJSON(t, n, &sched, "schedule", "create", "--vm", vm.VM.ID, "--action", "reboot", "--cron", "@every 1s")
	raft1.eventually(t, 30e9, "a run of the schedule", func() error {
		var runs runsOut
		if err := raft1.tryJSON(t, n, &runs, "schedule", "runs", sched.Schedule.ID); err != nil {
			return err
		}
		if len(runs.Runs) < 2 {
			return fmt.Errorf("%d runs", len(runs.Runs))
		}
		return nil
	})
	raft1.ok(t, n, "schedule", "pause", sched.Schedule.ID)
	raft1.okJSON(t, n, new(any), "schedule", "create", "--vm", vm.VM.ID, "--action", "power-off", "--cron", "0 22 * * 1-5", "--time-zone", "Europe/Budapest")
	want := captureState(t, raft1, n, sched.Schedule.ID)
	if len(want.services) != services || len(want.schedules) != 2 || len(want.runs) < 2 || len(want.history) != 2 {
		t.Fatalf("the Raft cluster's state: %d services, %d schedules, %d runs, %d versions", len(want.services), len(want.schedules), len(want.runs), len(want.history))
	}
	fromRaft := filepath.Join(work, "from-raft.tar.gz")
	raft1.ok(t, n, "snapshot", "save", fromRaft)
	raft1.stopAll()

	// Into etcd mode, on an etcd that wants client certificates over
	// HTTPS: the spec's etcd block.
	pki := agenttest.EtcdPKI(t, filepath.Join(work, "etcd-pki"))
	ec := etcdtest.StartTLS(t, 3, pki)
	etcdYAML := fmt.Sprintf("service_discovery:\n  type: etcd\n  etcd:\n    prefix: /pivirt/services\n    ca_file: %s\n    cert_file: %s\n    key_file: %s\n    endpoints:\n",
		pki.CAFile, pki.ClientCertFile, pki.ClientKeyFile)
	for _, ep := range ec.Endpoints {
		etcdYAML += "      - " + ep + "\n"
	}
	etcd1 := startClusterWith(t, bins, etcdYAML)
	etcd1.ok(t, etcd1.nodes[1], "snapshot", "restore", fromRaft)
	for _, nd := range etcd1.nodes {
		sameState(t, "etcd mode via "+nd.name, want, captureState(t, etcd1, nd, sched.Schedule.ID))
	}
	// The spec's troubleshooting command.
	out, err := exec.Command(etcdctl, "--endpoints="+strings.Join(ec.Endpoints, ","),
		"--cacert="+pki.CAFile, "--cert="+pki.ClientCertFile, "--key="+pki.ClientKeyFile,
		"get", "/pivirt/services", "--prefix").CombinedOutput()
	if err != nil {
		t.Fatalf("etcdctl: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 2*services || !strings.HasPrefix(lines[0], "/pivirt/services/svc-00/i-") || !strings.Contains(lines[1], `"address":"10.`) {
		t.Fatalf("etcdctl get /pivirt/services --prefix printed %d lines, want a key and a JSON value for each of %d instances; first: %q", len(lines), services, lines[:min(2, len(lines))])
	}
	// The state is live in etcd mode: a write, then saved again.
	etcd1.ok(t, etcd1.nodes[2], "config", "set", "kv/routing.note", "third")
	want.history = append([]string{"third"}, want.history...)
	want.config["kv/routing.note"] = "third"
	fromEtcd := filepath.Join(work, "from-etcd.tar.gz")
	etcd1.ok(t, etcd1.nodes[0], "snapshot", "save", fromEtcd)
	etcd1.stopAll()

	// And back into a fresh Raft cluster.
	raft2 := startCluster(t, bins)
	raft2.ok(t, raft2.nodes[2], "snapshot", "restore", fromEtcd)
	for _, nd := range raft2.nodes {
		sameState(t, "back in Raft mode via "+nd.name, want, captureState(t, raft2, nd, sched.Schedule.ID))
	}
}

// clusterState is what a migration must carry, index fields aside.
type clusterState struct {
	services  []map[string]any
	schedules []map[string]any
	runs      []map[string]any
	config    map[string]string
	history   []string
}

// indexFields change with the mode: they are the index of the write that
// stored a record, Raft's or etcd's.
var indexFields = []string{"create_index", "modify_index", "revision", "createIndex", "modifyIndex"}

func withoutIndexes(recs []map[string]any) []map[string]any {
	out := make([]map[string]any, len(recs))
	for i, r := range recs {
		c := maps.Clone(r)
		for _, f := range indexFields {
			delete(c, f)
		}
		out[i] = c
	}
	return out
}

// captureState reads the state through n with consistent reads.
func captureState(t *testing.T, c *cluster, n *node, scheduleID string) clusterState {
	t.Helper()
	var st clusterState
	st.services = withoutIndexes(listServices(t, c, n))
	var scheds struct {
		Schedules []map[string]any `json:"schedules"`
	}
	c.okJSON(t, n, &scheds, "schedule", "list", "--consistency", "consistent")
	st.schedules = withoutIndexes(scheds.Schedules)
	var runs struct {
		Runs []map[string]any `json:"runs"`
	}
	c.okJSON(t, n, &runs, "schedule", "runs", scheduleID, "--consistency", "consistent")
	st.runs = withoutIndexes(runs.Runs)
	st.config = map[string]string{}
	var entries struct {
		Entries []struct {
			Key   string `json:"key"`
			Value string `json:"value"`
		} `json:"entries"`
	}
	c.okJSON(t, n, &entries, "config", "list", "--consistency", "consistent")
	for _, e := range entries.Entries {
		if e.Key != "cluster.id" {
			st.config[e.Key] = e.Value
		}
	}
	var hist struct {
		Entries []struct {
			Value string `json:"value"`
		} `json:"entries"`
	}
	c.okJSON(t, n, &hist, "config", "history", "kv/routing.note", "--consistency", "consistent")
	for _, e := range hist.Entries {
		st.history = append(st.history, e.Value)
	}
	return st
}

func sameState(t *testing.T, where string, want, got clusterState) {
	t.Helper()
	check := func(what string, w, g any) {
		t.Helper()
		if !reflect.DeepEqual(w, g) {
			wb, _ := json.Marshal(w)
			gb, _ := json.Marshal(g)
			t.Errorf("%s: %s differ:\n got %.600s\nwant %.600s", where, what, gb, wb)
		}
	}
	check("services", want.services, got.services)
	check("schedules", want.schedules, got.schedules)
	check("runs", want.runs, got.runs)
	check("config", want.config, got.config)
	check("config history", want.history, got.history)
}
