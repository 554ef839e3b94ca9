package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestClusterSettings: each cluster setting set through one node is applied
// on every node within a bounded time, seen in what the nodes do (debug
// lines, where VM calls go, a rate limit, certificate roles); invalid values
// are refused with nothing stored; a node that cannot apply a setting keeps
// serving with the last good ones and says so; a restarted node serves
// with the stored settings from its first call; a file pins a key.
func TestClusterSettings(t *testing.T) { testClusterSettings(t, nil) }

// TestEtcdClusterSettings is TestClusterSettings in etcd mode.
func TestEtcdClusterSettings(t *testing.T) {
	testClusterSettings(t, etcdtest.Start(t, 1).Endpoints)
}

func testClusterSettings(t *testing.T, etcd []string) {
	simA, simB := startSim(t), startSim(t)
	e := newAccessEnvWith(t, 3, func(i int, cfg *config.Config) {
		withBackends(simA.addr)(i, cfg)
		// Every node but node3 also has the backend "other" (a second
		// simulator); node3 cannot apply a route to it.
		if i != 2 {
			cfg.Backends["other"] = config.BackendConfig{Endpoint: simB.addr, Scope: config.ScopeCluster}
		}
		cfg.Logging.Level = "info"
		if etcd != nil {
			cfg.ServiceDiscovery.Type = config.DiscoveryEtcd
			cfg.ServiceDiscovery.Etcd.Endpoints = etcd
		}
		if i == 1 {
			cfg.PinnedSettings = []string{"backends.<name>.timeout"}
		}
	}, nil)
	admin := func() context.Context { return as(e.ctx(), e.token("root", "admin")) }
	nodes := e.c.Nodes()
	set := func(key, value string) *clusterv1.ConfigEntry {
		t.Helper()
		resp, err := clusterv1.NewClusterServiceClient(e.dialAt(nodes[2].APIAddr(), nil)).SetConfig(admin(), &clusterv1.SetConfigRequest{Key: key, Value: value})
		if err != nil {
			t.Fatalf("set %s: %v", key, err)
		}
		return resp.GetEntry()
	}
	applied := func(what string, rev uint64, check func(n *agenttest.Node) error) {
		t.Helper()
		agenttest.Eventually(t, 5*time.Second, what+" on every node", func() error {
			for _, n := range e.c.Nodes() {
				if st := n.SettingsStatus(); st.Revision < rev && st.FailedRevision < rev {
					return fmt.Errorf("%s at revision %d, want %d", n.Name, st.Revision, rev)
				}
				if check != nil {
					if err := check(n); err != nil {
						return fmt.Errorf("%s: %w", n.Name, err)
					}
				}
			}
			return nil
		})
	}

	// logging.level: debug lines appear on every node (reads are audited at
	// debug level).
	read := func(n *agenttest.Node) {
		t.Helper()
		if _, err := clusterv1.NewClusterServiceClient(e.dialAt(n.APIAddr(), nil)).ListServices(admin(), &clusterv1.ListServicesRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	debugOf := func(mark int, n *agenttest.Node) bool {
		for _, line := range strings.Split(e.c.Logs().Since(mark), "\n") {
			if strings.Contains(line, "level=DEBUG") && strings.Contains(line, "node="+n.Name+" ") {
				return true
			}
		}
		return false
	}
	mark := e.c.Logs().Len()
	for _, n := range nodes {
		read(n)
	}
	for _, n := range nodes {
		if debugOf(0, n) {
			t.Fatalf("%s logs debug lines at logging.level info", n.Name)
		}
	}
	began := time.Now()
	rev := set("logging.level", "debug").GetRevision()
	applied("logging.level revision", rev, nil)
	t.Logf("logging.level applied on every node %s after the write returned", time.Since(began).Round(time.Millisecond))
	applied("logging.level debug", rev, func(n *agenttest.Node) error {
		read(n)
		if !debugOf(mark, n) {
			return fmt.Errorf("no debug line")
		}
		return nil
	})

	// logging.components: the access component back at info on every node
	// (its audit lines of reads are debug), the rest stays at debug.
	applied("logging.components", set("logging.components", "{access: info}").GetRevision(), nil)
	mark = e.c.Logs().Len()
	for _, n := range nodes {
		read(n)
	}
	if strings.Contains(e.c.Logs().Since(mark), "audit: call allowed") {
		t.Errorf("reads audited at debug after logging.components {access: info}:\n%s", e.c.Logs().Since(mark))
	}
	if _, err := e.cl.SetConfig(admin(), &clusterv1.SetConfigRequest{Key: "logging.components", Value: "{access: loud}"}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `logging.components.access: invalid value "loud" (allowed: debug, info, warn, error)`) {
		t.Errorf("a component at a level that does not exist: %v", err)
	}

	// Refused at write, nothing stored.
	for _, tc := range []struct{ key, value, want string }{
		{"logging.level", "verbose", `logging.level: invalid value "verbose" (allowed: debug, info, warn, error)`},
		{"log_level", "debug", `key: log_level: unknown key: cluster settings: logging.level, logging.components, routing.rules`},
		{"rate_limiting", "{enabled: true, requests_per_second: 0, burst: 1}", "rate_limiting.requests_per_second: invalid value 0: must be positive"},
		{"routing.rules", "[{match: {prefix: /x}, route: {clustre: other}}]", "routing.rules[0].route.clustre: unknown key (known: cluster, descriptor_set)"},
		{"backends.pivirtd.endpoint", "unix:///elsewhere", "not a cluster setting (a key of each node's file, set there)"},
	} {
		_, err := e.cl.SetConfig(admin(), &clusterv1.SetConfigRequest{Key: tc.key, Value: tc.value})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("set %s %q: %v, want InvalidArgument with %q", tc.key, tc.value, err, tc.want)
		}
	}
	if h, err := e.cl.ConfigHistory(admin(), &clusterv1.ConfigHistoryRequest{Key: "logging.level"}); err != nil || len(h.GetEntries()) != 1 || h.GetEntries()[0].GetValue() != "debug" {
		t.Errorf("logging.level history after refused writes: %v %v", h.GetEntries(), err)
	}
	for _, key := range []string{"log_level", "rate_limiting"} {
		if _, err := e.cl.GetConfig(admin(), &clusterv1.GetConfigRequest{Key: key}); status.Code(err) != codes.NotFound {
			t.Errorf("a refused %s was stored: %v", key, err)
		}
	}
	// A dry run validates and stores nothing.
	if resp, err := e.cl.SetConfig(admin(), &clusterv1.SetConfigRequest{Key: "logging.level", Value: "warn", DryRun: true}); err != nil || !resp.GetDryRun() || resp.GetEntry().GetValue() != "debug" {
		t.Errorf("dry run: %v %v, want the stored version (debug)", resp, err)
	}
	if _, err := e.cl.SetConfig(admin(), &clusterv1.SetConfigRequest{Key: "logging.level", Value: "loud", DryRun: true}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("dry run of an invalid value: %v", err)
	}
	if r, err := e.cl.GetConfig(admin(), &clusterv1.GetConfigRequest{Key: "logging.level"}); err != nil || r.GetEntry().GetRevision() != rev {
		t.Errorf("after dry runs: %v %v, want revision %d", r.GetEntry(), err, rev)
	}

	// routing.rules: VM calls move to the other backend on node1 and node2;
	// node3 has no backend "other", keeps its routes and reports it.
	vmClient := func(n *agenttest.Node) vmv1.VMServiceClient {
		return vmv1.NewVMServiceClient(e.dialAt(n.APIAddr(), nil))
	}
	e.createVM("alice") // on simA, through the file's routes
	countVMs := func(n *agenttest.Node) (int, error) {
		r, err := vmClient(n).ListVMs(admin(), &vmv1.ListVMsRequest{})
		return len(r.GetVms()), err
	}
	for _, n := range nodes {
		if got, err := countVMs(n); err != nil || got != 1 {
			t.Fatalf("%s lists %d VMs (%v) before the route moves, want 1", n.Name, got, err)
		}
	}
	rules := "- match: {prefix: /pivirt.vm.v1.VMService}\n  route: {cluster: other}\n- match: {prefix: /pivirt.storage.v1.StorageService}\n  route: {cluster: iscsiman}\n"
	rev = set("routing.rules", rules).GetRevision()
	applied("routing.rules", rev, func(n *agenttest.Node) error {
		want := 0 // simB has none
		if n.Name == "node3" {
			want = 1
		}
		if got, err := countVMs(n); err != nil || got != want {
			return fmt.Errorf("lists %d VMs (%v), want %d", got, err, want)
		}
		return nil
	})
	st := nodes[2].SettingsStatus()
	if st.FailedRevision != rev || !strings.Contains(st.Error, `routing.rules[0].route.cluster: invalid value "other": not a backend (backends: iscsiman, pivirtd)`) {
		t.Errorf("node3's status: %+v", st)
	}
	cs, err := e.cl.ConfigStatus(admin(), &clusterv1.ConfigStatusRequest{})
	if err != nil || len(cs.GetNodes()) != 3 {
		t.Fatalf("config status: %v %v", cs, err)
	}
	for _, n := range cs.GetNodes() {
		failing := n.GetApplyError() != ""
		pinned := strings.Join(n.GetPinned(), ",") == "backends.<name>.timeout"
		if n.GetError() != "" || failing != (n.GetNode() == "node3") || n.GetRevision() == 0 || pinned != (n.GetNode() == "node2") {
			t.Errorf("config status of %s: %v", n.GetNode(), n)
		}
	}
	ready := httpGet(t, "http://"+nodes[2].MetricsAddr()+"/ready")
	if !strings.Contains(ready, "degraded: cluster settings of revision") || !strings.Contains(ready, `\"ready\"`) && !strings.Contains(ready, `"status":"ready"`) {
		t.Errorf("node3 /ready: %s", ready)
	}
	if m := httpGet(t, "http://"+nodes[2].MetricsAddr()+"/metrics"); !strings.Contains(m, "pivirt_config_settings_failing 1") {
		t.Error("node3 does not report pivirt_config_settings_failing 1")
	}
	if m := httpGet(t, "http://"+nodes[0].MetricsAddr()+"/metrics"); !strings.Contains(m, "pivirt_config_settings_failing 0") || !strings.Contains(m, fmt.Sprintf("pivirt_config_settings_revision %d", rev)) {
		t.Error("node1 does not report the revision applied")
	}

	// A node that fails keeps the other settings it had, and retries on the
	// next change: deleting routing.rules applies everywhere again.
	del, err := clusterv1.NewClusterServiceClient(e.dialAt(nodes[0].APIAddr(), nil)).DeleteConfig(admin(), &clusterv1.DeleteConfigRequest{Key: "routing.rules"})
	if err != nil {
		t.Fatal(err)
	}
	applied("routing.rules deleted", del.GetIndex(), func(n *agenttest.Node) error {
		if st := n.SettingsStatus(); st.Error != "" {
			return fmt.Errorf("still failing: %s", st.Error)
		}
		if got, err := countVMs(n); err != nil || got != 1 {
			return fmt.Errorf("lists %d VMs (%v), want 1", got, err)
		}
		return nil
	})

	// rate_limiting: a limit set once refuses on every node.
	set("rate_limiting", "{enabled: true, requests_per_second: 1000, burst: 1000, routes: [{prefix: /pivirt.cluster.v1.ClusterService/Members, requests_per_second: 0.01, burst: 2}]}")
	for _, n := range nodes {
		cl := clusterv1.NewClusterServiceClient(e.dialAt(n.APIAddr(), nil))
		viewer := as(e.ctx(), e.token("rate-"+n.Name, "viewer"))
		agenttest.Eventually(t, 5*time.Second, "the rate limit on "+n.Name, func() error {
			for range 3 {
				if _, err := cl.Members(viewer, &clusterv1.MembersRequest{}); status.Code(err) == codes.ResourceExhausted {
					return nil
				}
			}
			return fmt.Errorf("3 calls passed")
		})
	}

	// auth.certificate_roles: a certificate's roles change on every node.
	cert := e.clientCert("ops-carol")
	agenttest.Eventually(t, 5*time.Second, "the file's certificate roles", func() error {
		_, err := vmv1.NewVMServiceClient(e.dialAt(nodes[1].APIAddr(), cert)).DeleteVM(e.ctx(), &vmv1.DeleteVMRequest{Id: "none"})
		if status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("an operator deletes: %v", err)
		}
		return nil
	})
	set("auth.certificate_roles", "{'ops-*': [admin]}")
	for _, n := range nodes {
		vms := vmv1.NewVMServiceClient(e.dialAt(n.APIAddr(), cert))
		agenttest.Eventually(t, 5*time.Second, "admin by certificate on "+n.Name, func() error {
			if _, err := vms.DeleteVM(e.ctx(), &vmv1.DeleteVMRequest{Id: "none"}); status.Code(err) != codes.NotFound {
				return fmt.Errorf("delete: %v, want NotFound (allowed)", err)
			}
			return nil
		})
	}

	// backends.<name>.timeout and retry, seen in the calls: node2 pins the
	// timeout (its file's 10s stays), the others time a slow backend out.
	rev = set("backends.pivirtd.timeout", "300ms").GetRevision()
	applied("backends.pivirtd.timeout", rev, nil)
	for _, n := range nodes {
		pinned := n.Name == "node2"
		if st := n.SettingsStatus(); st.Error != "" || slices.Contains(st.Keys, "backends.pivirtd.timeout") == pinned {
			t.Errorf("%s: %+v", n.Name, st)
		}
	}
	simA.fault(t, &simv1.Fault{Method: listVMs, Delay: durationpb.New(time.Second)})
	for _, n := range nodes {
		_, err := vmClient(n).ListVMs(admin(), &vmv1.ListVMsRequest{})
		if pinned := n.Name == "node2"; (err == nil) != pinned {
			t.Errorf("ListVMs through %s with a backend 1s slow: %v (the timeout is pinned there: %v)", n.Name, err, pinned)
		}
	}
	simA.fault(t, nil)
	rev = set("backends.pivirtd.retry", "{max_attempts: 4, backoff: 1ms}").GetRevision()
	applied("backends.pivirtd.retry", rev, nil)
	simA.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Unavailable)})
	for _, n := range nodes {
		_, before := simA.stats(t, listVMs)
		if _, err := vmClient(n).ListVMs(admin(), &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unavailable {
			t.Errorf("ListVMs through %s with the backend unavailable: %v", n.Name, err)
		}
		if _, after := simA.stats(t, listVMs); after-before != 4 {
			t.Errorf("ListVMs through %s: %d attempts, want the 4 of backends.pivirtd.retry", n.Name, after-before)
		}
	}
	simA.fault(t, nil)

	// circuit_breaking: two failures in a row eject the only endpoint, on
	// every node.
	rev = set("circuit_breaking", "{enabled: true, thresholds: {consecutive_5xx: 2, interval: 100ms, base_ejection_time: 30s, max_ejection_percent: 100}}").GetRevision()
	applied("circuit_breaking", rev, nil)
	simA.fault(t, &simv1.Fault{Method: listVMs, Code: uint32(codes.Internal), Message: "disk on fire"})
	for _, n := range nodes {
		for range 2 {
			_, _ = vmClient(n).ListVMs(admin(), &vmv1.ListVMsRequest{})
		}
		if m := httpGet(t, "http://"+n.MetricsAddr()+"/metrics"); !strings.Contains(m, `pivirt_mesh_endpoints{service="pivirtd",status="ejected"} 1`) {
			t.Errorf("%s did not eject the failing endpoint under the cluster's circuit_breaking", n.Name)
		}
	}
	simA.fault(t, nil)

	// load_balancing: fast health checks mark a NOT_SERVING backend
	// unhealthy on every node; without health checks it is used again.
	if _, err := simA.ctl.SetServing(e.ctx(), &simv1.SetServingRequest{Serving: false}); err != nil {
		t.Fatal(err)
	}
	set("load_balancing", "{policy: round_robin, health_check: {enabled: true, interval: 100ms, timeout: 100ms, healthy_threshold: 1, unhealthy_threshold: 1}}")
	endpoints := func(status string) func(n *agenttest.Node) error {
		return func(n *agenttest.Node) error {
			if m := httpGet(t, "http://"+n.MetricsAddr()+"/metrics"); !strings.Contains(m, `pivirt_mesh_endpoints{service="pivirtd",status="`+status+`"} 1`) {
				return fmt.Errorf("pivirtd's endpoint not %s", status)
			}
			return nil
		}
	}
	applied("load_balancing with health checks", 0, endpoints("unhealthy"))
	set("load_balancing", "{policy: round_robin, health_check: {enabled: false}}")
	applied("load_balancing without health checks", 0, endpoints("healthy"))
	if _, err := simA.ctl.SetServing(e.ctx(), &simv1.SetServingRequest{Serving: true}); err != nil {
		t.Fatal(err)
	}

	// A restart serves with the stored settings from its first call, before
	// it has caught up: node1 is restarted with the cluster down to it alone
	// (no quorum), and its rate limit and routes hold at once.
	if _, err := os.Stat(filepath.Join(nodes[0].DataDir(), agent.SettingsFile)); err != nil {
		t.Fatal(err)
	}
	e.c.Kill(1)
	e.c.Kill(2)
	e.c.Kill(0)
	n1 := e.c.Restart(0, false, "")
	if st := n1.SettingsStatus(); st.Revision < rev || len(st.Keys) != 8 {
		t.Errorf("restarted node1's settings: %+v, want revision %d and 8 keys", st, rev)
	}
	cl := clusterv1.NewClusterServiceClient(e.dialAt(n1.APIAddr(), nil))
	viewer := as(e.ctx(), e.token("after-restart", "viewer"))
	var errs []error
	for range 3 {
		_, err := cl.Members(viewer, &clusterv1.MembersRequest{})
		if errs = append(errs, err); status.Code(err) == codes.ResourceExhausted {
			break
		}
	}
	if status.Code(errs[len(errs)-1]) != codes.ResourceExhausted {
		t.Errorf("the restarted node does not apply the stored rate limit: %v", errs)
	}
	if !strings.Contains(e.c.Logs().Since(mark), "cluster settings in force from the data dir") {
		t.Error("no log line of the kept settings")
	}
}

// TestRBACLockOut: a cluster RBAC policy that would take away the caller's
// own right to change it is refused, naming the rights lost, unless
// forced; the break-glass path on the operations port removes it, audited.
func TestRBACLockOut(t *testing.T) { testRBACLockOut(t, nil) }

// TestEtcdRBACLockOut is TestRBACLockOut in etcd mode.
func TestEtcdRBACLockOut(t *testing.T) { testRBACLockOut(t, etcdtest.Start(t, 1).Endpoints) }

func testRBACLockOut(t *testing.T, etcd []string) {
	e := newAccessEnv(t, 1, func(cfg *config.Config) {
		cfg.Auth.RBACPolicy = "" // the quick start: every authenticated caller may do everything
		if etcd != nil {
			cfg.ServiceDiscovery.Type = config.DiscoveryEtcd
			cfg.ServiceDiscovery.Etcd.Endpoints = etcd
		}
	})
	spec, err := os.ReadFile(filepath.Join("..", "..", "..", "gateway", "authz", "testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	operator := clusterv1.NewClusterServiceClient(e.dial(e.clientCert("operator"))) // no roles
	_, err = operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec)})
	for _, want := range []string{"this policy would lock you out: operator (roles none) could no longer update rbac", "you would lose: ", "you would lose: every verb on every resource", "pass --force"} {
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), want) {
			t.Errorf("the spec's policy set by a caller without roles: %v, want FailedPrecondition with %q", err, want)
		}
	}
	if _, err := operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec), DryRun: true}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("dry run of the lock-out: %v", err)
	}
	if _, err := e.cl.GetConfig(as(e.ctx(), e.token("root", "admin")), &clusterv1.GetConfigRequest{Key: agent.RBACPolicyKey}); status.Code(err) != codes.NotFound {
		t.Errorf("a refused policy was stored: %v", err)
	}
	// An admin keeps its rights under the spec's policy.
	admin := as(e.ctx(), e.token("root", "admin"))
	if _, err := e.cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec), DryRun: true}); err != nil {
		t.Errorf("an admin's dry run: %v", err)
	}
	// Forced, the operator locks itself out: it can no longer delete it.
	if _, err := operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec), Force: true}); err != nil {
		t.Fatal(err)
	}
	// A read probes for the policy in force (a delete tried before it is
	// would succeed).
	agenttest.Eventually(t, 5*time.Second, "the operator locked out", func() error {
		if _, err := operator.ListConfig(e.ctx(), &clusterv1.ListConfigRequest{}); status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("list: %v", err)
		}
		return nil
	})
	if _, err := operator.DeleteConfig(e.ctx(), &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("the locked-out operator deletes the policy: %v", err)
	}
	// Break-glass with the node's own agent certificate: it may delete the
	// cluster policy (and nothing else the policy does not allow); another
	// node's agent certificate may not.
	self := clusterv1.NewClusterServiceClient(e.dial(e.clientCert("pivirt-agent-" + e.n.Name)))
	other := clusterv1.NewClusterServiceClient(e.dial(e.clientCert("pivirt-agent-elsewhere")))
	if _, err := other.DeleteConfig(e.ctx(), &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("another node's agent certificate deletes the cluster policy: %v", err)
	}
	if _, err := self.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: "kv/x", Value: "1"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("the node's agent certificate writes another key: %v", err)
	}
	mark := e.c.Logs().Len()
	if _, err := self.DeleteConfig(e.ctx(), &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey}); err != nil {
		t.Fatalf("break-glass with the node's agent certificate: %v", err)
	}
	if !strings.Contains(e.c.Logs().Since(mark), "audit: break-glass: call allowed whatever the RBAC policy") {
		t.Error("the break-glass deletion is not audited")
	}
	agenttest.Eventually(t, 5*time.Second, "the operator back in", func() error {
		_, err := operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: "kv/back", Value: "in"})
		return err
	})
	if _, err := operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec), Force: true}); err != nil {
		t.Fatal(err)
	}
	// A read probes for the policy in force (a delete tried before it is
	// would succeed).
	agenttest.Eventually(t, 5*time.Second, "the operator locked out again", func() error {
		if _, err := operator.ListConfig(e.ctx(), &clusterv1.ListConfigRequest{}); status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("list: %v", err)
		}
		return nil
	})
	if _, err := operator.DeleteConfig(e.ctx(), &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("the locked-out operator deletes the policy: %v", err)
	}

	// Break-glass on the operations port, from this host only.
	mark = e.c.Logs().Len()
	code, body := httpPost(t, "http://"+e.n.MetricsAddr()+"/rbac/reset")
	if code != 200 || !strings.Contains(body, `"removed":true`) {
		t.Fatalf("POST /rbac/reset: %d %s", code, body)
	}
	if !strings.Contains(e.c.Logs().Since(mark), "audit: break-glass: cluster-wide RBAC policy removed") {
		t.Error("the break-glass removal is not audited")
	}
	agenttest.Eventually(t, 5*time.Second, "the operator back in", func() error {
		_, err := operator.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: "kv/back", Value: "in"})
		return err
	})
	if code, body := httpPost(t, "http://"+e.n.MetricsAddr()+"/rbac/reset"); code != 200 || !strings.Contains(body, `"removed":false`) {
		t.Errorf("POST /rbac/reset without a policy: %d %s", code, body)
	}

	// auth.certificate_roles decides who may do what too: it needs rights
	// on rbac, and a change that takes the caller's own right to change the
	// policy away is refused.
	if _, err := e.cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec)}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: "auth.certificate_roles", Value: "{'ops-*': [admin]}"}); err != nil {
		t.Fatal(err)
	}
	carol := clusterv1.NewClusterServiceClient(e.dial(e.clientCert("ops-carol")))
	agenttest.Eventually(t, 5*time.Second, "ops-carol an admin by certificate", func() error {
		_, err := carol.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: "kv/carol", Value: "admin"})
		return err
	})
	_, err = carol.SetConfig(e.ctx(), &clusterv1.SetConfigRequest{Key: "auth.certificate_roles", Value: "{'ops-*': [viewer]}"})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "these certificate roles would lock you out: ops-carol (roles admin, then viewer) could no longer update rbac") {
		t.Errorf("certificate roles that demote their writer: %v", err)
	}
	if _, err := e.cl.SetConfig(as(e.ctx(), e.token("olga", "operator")), &clusterv1.SetConfigRequest{Key: "auth.certificate_roles", Value: "{'olga': [admin]}"}); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "may not update rbac") {
		t.Errorf("an operator sets certificate roles: %v, want PermissionDenied on rbac", err)
	}
	if r, err := e.cl.CheckAccess(admin, &clusterv1.CheckAccessRequest{Identity: "x", Roles: []string{"admin"}, Method: "ClusterService/SetConfig"}); err != nil || !strings.Contains(r.GetDetail(), "the resource is rbac, not config") {
		t.Errorf("CheckAccess of SetConfig: %v %v", r, err)
	}
}

// TestAccessChecks: CheckAccess answers what the RBAC policy in force
// decides for a principal and a method (and an object, for rules with
// conditions), naming the rules; nothing is called.
func TestAccessChecks(t *testing.T) {
	e := newAccessEnv(t, 1, nil) // the spec's policy, in the file
	admin := as(e.ctx(), e.token("root", "admin"))
	for _, tc := range []struct {
		identity, method, object string
		roles                    []string
		allowed                  bool
		decision, rule           string
	}{
		{"root", "VMService/DeleteVM", "", []string{"admin"}, true, "allowed", "rules[0]: roles [admin] resources [*] verbs [*]"},
		{"olga", "pivirt.vm.v1.VMService/DeleteVM", "", []string{"operator"}, false, "denied", ""},
		{"olga", "/pivirt.vm.v1.VMService/CreateVM", "", []string{"operator"}, true, "allowed", "rules[1]: roles [operator]"},
		{"alice", "VMService/UpdateVM", "", []string{"vm-owner"}, false, "conditional", `if metadata.owner Equals "alice"`},
		{"alice", "VMService/UpdateVM", `{"metadata": {"owner": "alice"}}`, []string{"vm-owner"}, true, "conditional", "rules[3]"},
		{"alice", "VMService/UpdateVM", `{"metadata": {"owner": "bob"}}`, []string{"vm-owner"}, false, "conditional", "rules[3]"},
		{"", "grpc.health.v1.Health/Check", "", nil, true, "open", ""},
	} {
		r, err := e.cl.CheckAccess(admin, &clusterv1.CheckAccessRequest{Identity: tc.identity, Roles: tc.roles, Method: tc.method, ObjectJson: tc.object})
		if err != nil {
			t.Errorf("%s %v %s: %v", tc.identity, tc.roles, tc.method, err)
			continue
		}
		if r.GetAllowed() != tc.allowed || r.GetDecision() != tc.decision || r.GetSource() != "file" && tc.decision != "open" || !strings.Contains(strings.Join(r.GetRules(), "\n"), tc.rule) {
			t.Errorf("%s %v %s %s: %v", tc.identity, tc.roles, tc.method, tc.object, r)
		}
	}
	for method, want := range map[string]string{
		"VMService/Reboot2":   "not a method of the API",
		"NoService/DeleteVM":  "no service of the API is named NoService",
		"DeleteVM":            "want Service/Method",
		"VMService/UpdateVM ": "not a method of the API",
	} {
		if _, err := e.cl.CheckAccess(admin, &clusterv1.CheckAccessRequest{Identity: "x", Method: method}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), want) {
			t.Errorf("method %q: %v, want InvalidArgument with %q", method, err, want)
		}
	}
	if _, err := e.cl.CheckAccess(admin, &clusterv1.CheckAccessRequest{Identity: "alice", Roles: []string{"vm-owner"}, Method: "VMService/UpdateVM", ObjectJson: "{owner"}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "not the JSON of a pivirt.vm.v1.VM") {
		t.Errorf("a bad object: %v", err)
	}
	// It needs get on rbac.
	if _, err := e.cl.CheckAccess(as(e.ctx(), e.token("olga", "operator")), &clusterv1.CheckAccessRequest{Identity: "x", Method: "VMService/GetVM"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("an operator checks access: %v, want PermissionDenied", err)
	}
}

// TestKeptSettingsOfAnotherCluster: settings kept in a data dir that came
// from another cluster (another cluster.id) do not hold the node back:
// their revisions mean nothing here.
func TestKeptSettingsOfAnotherCluster(t *testing.T) {
	c := agenttest.NewExpect(t, 1, nil)
	n := c.WaitLeader(20 * time.Second)
	set, err := n.API.SetConfig(t.Context(), connect.NewRequest(&clusterv1.SetConfigRequest{Key: "logging.level", Value: "warn"}))
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, 5*time.Second, "logging.level applied", func() error {
		if st := n.SettingsStatus(); st.Revision < set.Msg.GetEntry().GetRevision() {
			return fmt.Errorf("%+v", st)
		}
		return nil
	})
	c.Kill(0)
	kept := `{"revision": 1000000000, "settings": {"logging.level": "debug"}, "cluster_id": "another-cluster"}`
	if err := os.WriteFile(filepath.Join(c.Dir(0), agent.SettingsFile), []byte(kept), 0o600); err != nil {
		t.Fatal(err)
	}
	n = c.Restart(0, false, "")
	agenttest.Eventually(t, 20*time.Second, "this cluster's settings applied", func() error {
		if st := n.SettingsStatus(); st.Revision >= 1000000000 || st.Revision < set.Msg.GetEntry().GetRevision() {
			return fmt.Errorf("%+v", st)
		}
		return nil
	})
	if !c.Logs().Contains("the kept cluster settings are another cluster's") {
		t.Error("no log line of the other cluster's settings")
	}
}

// TestEverySettingAppliesLive: every cluster setting has a live-apply path
// on a running agent (access control on, backends configured). Put on top
// of the node's file, each setting reloads with its keys applied and none
// needing a restart, and so does going back to the file. A setting that
// applyConfig has no case for lands among the keys that need a restart,
// which the settings' loop never puts in force (syncSettings reports it
// as not applied, TestSettingNotLiveHereIsNotReported): a setting must
// never be such a key. A document setting is skipped by ApplySettings and
// must be one the agent applies by code of its own.
func TestEverySettingAppliesLive(t *testing.T) {
	// A value of each setting that differs from the node's file below.
	samples := map[string]string{
		"logging.level":           "warn",
		"logging.components":      "{raft: warn}",
		"routing.rules":           "[{match: {prefix: /pivirt.vm.v1.VMService}, route: {cluster: pivirtd}}]",
		"load_balancing":          "{policy: least_connections}",
		"circuit_breaking":        "{thresholds: {consecutive_5xx: 7}}",
		"rate_limiting":           "{enabled: true, requests_per_second: 5, burst: 2}",
		"backends.<name>.timeout": "3s",
		"backends.<name>.retry":   "{max_attempts: 2, backoff: 50ms}",
		"auth.certificate_roles":  "{operator: [admin]}",
	}
	// The document settings the agent applies itself: the cluster RBAC
	// policy (leader.ClusterPolicy, startAccess) and the network policy
	// (settingsNetPolicy, setClusterNetPolicy).
	documents := []string{agent.RBACPolicyKey, agent.NetworkPolicyKey}

	spec, err := os.ReadFile(filepath.Join("..", "..", "..", "gateway", "authz", "testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy := filepath.Join(t.TempDir(), "rbac.yaml")
	if err := os.WriteFile(policy, spec, 0o600); err != nil {
		t.Fatal(err)
	}
	sim := startSim(t)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withBackends(sim.addr)(i, cfg)
		cfg.Auth.RBACPolicy = policy // access control on: the guard and authenticator exist
	})
	n := c.WaitLeader(20 * time.Second)
	file := n.Cfg

	for _, s := range config.Settings {
		t.Run(s.Key, func(t *testing.T) {
			if s.Document {
				if !slices.Contains(documents, s.Key) {
					t.Fatalf("document setting %s: ApplySettings skips documents and the agent applies only %v; give it an apply path of its own", s.Key, documents)
				}
				return
			}
			value, ok := samples[s.Key]
			if !ok {
				t.Fatalf("no sample value of setting %s in this test: add one, and a case in applyConfig (reload.go) that puts it in force live", s.Key)
			}
			key := strings.ReplaceAll(s.Key, "<name>", "pivirtd")
			next, keys, err := config.ApplySettings(file, map[string]string{key: value})
			if err != nil || !slices.Equal(keys, []string{key}) {
				t.Fatalf("ApplySettings(%s: %s) = %v, %v", key, value, keys, err)
			}
			if len(config.Diff(file, next)) == 0 {
				t.Fatalf("the sample value of %s is the file's", key)
			}
			for _, step := range []struct {
				what string
				cfg  *config.Config
			}{{"set", next}, {"back to the file", file}} {
				applied, restart, err := n.ReloadConfig(step.cfg)
				if err != nil {
					t.Fatalf("%s: %v", step.what, err)
				}
				if len(restart) > 0 {
					t.Errorf("%s: %v need a restart: no live-apply path in applyConfig (reload.go), so the cluster setting would change nothing", step.what, restart)
				}
				if len(applied) == 0 {
					t.Errorf("%s: nothing applied", step.what)
				}
				for _, k := range applied {
					if !config.Under(k, key) && !config.Under(key, k) {
						t.Errorf("%s: applied %s, not a key of %s", step.what, k, key)
					}
				}
			}
		})
	}
	for k := range samples {
		if !slices.ContainsFunc(config.Settings, func(s config.Setting) bool { return s.Key == k && !s.Document }) {
			t.Errorf("sample value of %s, which is no cluster setting", k)
		}
	}
}

// TestSettingNotLiveHereIsNotReported: a setting this node cannot put in
// force while it runs (rate_limiting with access control off: there is no
// guard to limit rates) is not reported as applied, in SettingsStatus
// (pvcli config status, /ready) or the log; the others of the set are.
func TestSettingNotLiveHereIsNotReported(t *testing.T) {
	c := agenttest.NewExpect(t, 1, nil) // TLS off, no OIDC, no RBAC policy: access control off
	n := c.WaitLeader(20 * time.Second)
	var rev uint64
	for _, kv := range [][2]string{{"rate_limiting", "{enabled: true, requests_per_second: 5, burst: 2}"}, {"logging.level", "warn"}} {
		set, err := n.API.SetConfig(t.Context(), connect.NewRequest(&clusterv1.SetConfigRequest{Key: kv[0], Value: kv[1]}))
		if err != nil {
			t.Fatal(err)
		}
		rev = set.Msg.GetEntry().GetRevision()
	}
	agenttest.Eventually(t, 5*time.Second, "the settings synced", func() error {
		if st := n.SettingsStatus(); st.Revision < rev && st.FailedRevision < rev {
			return fmt.Errorf("%+v", st)
		}
		return nil
	})
	if st := n.SettingsStatus(); st.FailedRevision != 0 || !slices.Equal(st.Keys, []string{"logging.level"}) {
		t.Errorf("status %+v, want logging.level alone applied", st)
	}
	if !c.Logs().Contains("cluster settings not in force on this node") {
		t.Error("no log line naming the setting not in force")
	}
}
