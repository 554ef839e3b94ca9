package access

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	_ "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	_ "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// certCall is a call of procedure by the holder of a client certificate
// with CN cn.
func certCall(procedure, cn string) call {
	return call{procedure: procedure, tls: &tls.ConnectionState{PeerCertificates: []*x509.Certificate{{Subject: pkix.Name{CommonName: cn}}}}}
}

func code(err error) codes.Code {
	var d *denial
	if errors.As(err, &d) {
		return d.code
	}
	if err == nil {
		return codes.OK
	}
	return codes.Unknown
}

func newGuard(t *testing.T, policy string, limits Limits, now func() time.Time) *Guard {
	t.Helper()
	var p *authz.Policy
	if policy != "" {
		var err error
		if p, err = authz.Parse(strings.NewReader(policy), []string{"cluster", "config", "keyring", "networks", "services", "snapshots", "virtualmachines", "volumes"}); err != nil {
			t.Fatal(err)
		}
	}
	g, err := New(Config{
		Authenticator: &authn.Authenticator{CertRoles: map[string][]string{"alice": {"vm-owner"}, "root": {"admin"}, "cond-*": {"cond"}}},
		Policy:        func() *authz.Policy { return p },
		Routed: func(m string) bool {
			return strings.HasPrefix(m, "/test.echo.v1.") || strings.HasPrefix(m, "/no.Such/")
		},
		Limits: limits,
		Now:    now,
	})
	if err != nil {
		t.Fatal(err)
	}
	return g
}

const ownerPolicy = `apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["admin"]
    resources: ["*"]
    verbs: ["*"]
  - roles: ["vm-owner"]
    resources: ["virtualmachines"]
    verbs: ["get", "list", "update", "start", "stop", "console"]
    conditions:
      - field: "metadata.owner"
        operator: "Equals"
        value: "{{.user.identity}}"
  - roles: ["cond"]
    resources: ["cluster"]
    verbs: ["get"]
    conditions:
      - field: "name"
        operator: "Equals"
        value: "x"
`

// TestAdmit: open and unannotated methods; a conditional rule on a method
// with no object to check is a denial.
func TestAdmit(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		c    call
		want codes.Code
	}{
		{"health without credentials", call{procedure: "/grpc.health.v1.Health/Check"}, codes.OK},
		{"reflection without credentials", call{procedure: "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"}, codes.OK},
		{"reflection v1alpha without credentials", call{procedure: "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}, codes.OK},
		{"reflection of a caller without roles", certCall("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "nobody"), codes.OK},
		{"another method of reflection's service", call{procedure: "/grpc.reflection.v1.ServerReflection/Other"}, codes.Unauthenticated},
		{"another method of health's service", call{procedure: "/grpc.health.v1.Health/Other"}, codes.Unauthenticated},
		{"an unannotated method, even for admin", certCall("/pivirt.sim.v1.SimulatorService/SetFault", "root"), codes.PermissionDenied},
		{"an unknown method of a known service", certCall("/pivirt.cluster.v1.ClusterService/NoSuch", "root"), codes.PermissionDenied},
		{"a routed service of no schema: its resource is the service, for admin's *", certCall("/no.Such/Method", "root"), codes.OK},
		{"a routed service of no schema, no rule", certCall("/no.Such/Method", "alice"), codes.PermissionDenied},
		{"admin", certCall("/pivirt.cluster.v1.ClusterService/SetConfig", "root"), codes.OK},
		{"no rule", certCall("/pivirt.cluster.v1.ClusterService/Leader", "alice"), codes.PermissionDenied},
		{"a condition with no object", certCall("/pivirt.cluster.v1.ClusterService/Leader", "cond-1"), codes.PermissionDenied},
		{"a condition on a get: decided on the object", certCall("/pivirt.vm.v1.VMService/GetVM", "alice"), codes.OK},
		{"a bad Authorization header", call{procedure: "/pivirt.vm.v1.VMService/GetVM", authorization: "Basic abc"}, codes.Unauthenticated},
	} {
		_, gr, err := g.admit(ctx, tc.c, nil)
		if code(err) != tc.want {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.want)
		}
		if tc.name == "a condition on a get: decided on the object" && !gr.checksRequest() {
			t.Errorf("%s: the grant does not check the request", tc.name)
		}
	}
	_, _, err := g.admit(ctx, certCall("/pivirt.cluster.v1.ClusterService/Leader", "cond-1"), nil)
	if !strings.Contains(err.Error(), "may not get cluster") || !strings.Contains(err.Error(), "names no object") {
		t.Errorf("denial message %q", err)
	}
	// A certificate without a role is told where its roles come from; one
	// with roles is not.
	_, _, err = g.admit(ctx, certCall("/pivirt.cluster.v1.ClusterService/Leader", "operator"), nil)
	if want := `operator (roles none) may not get cluster: no rule of the RBAC policy allows it (a client certificate's roles come from auth.certificate_roles, which gives "operator" none`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a certificate without a role: %v, want %q", err, want)
	}
	if _, _, err = g.admit(ctx, certCall("/pivirt.cluster.v1.ClusterService/Leader", "alice"), nil); err == nil || strings.Contains(err.Error(), "auth.certificate_roles") {
		t.Errorf("a certificate with a role: %v, want a denial without the hint", err)
	}
}

// TestAdmitUnschemedMethods: a method of a service no schema of which is
// linked into the agent (a routed service the gateway only relays) is the
// resource named by the service's full name with the verb call: open to
// every authenticated caller while no policy is in force, as every method
// is; under a policy, granted by a rule that names the service (or *), and
// never on conditions (nothing to check them on). A method whose schema
// is linked in but carries no annotation stays denied either way, and
// credentials are always needed.
func TestAdmitUnschemedMethods(t *testing.T) {
	const servicePolicy = `apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["vm-owner"]
    resources: ["test.echo.v1.Echo"]
    verbs: ["call"]
  - roles: ["cond"]
    resources: ["test.echo.v1.Other"]
    verbs: ["call"]
    conditions:
      - field: "owner"
        operator: "Equals"
        value: "{{.user.identity}}"
`
	ctx := context.Background()
	for _, tc := range []struct {
		policy string
		c      call
		want   codes.Code
	}{
		{"", certCall("/test.echo.v1.Echo/Unary", "nobody"), codes.OK},
		{"", call{procedure: "/test.echo.v1.Echo/Unary"}, codes.Unauthenticated},
		{"", certCall("/pivirt.sim.v1.SimulatorService/SetFault", "root"), codes.PermissionDenied},
		{ownerPolicy, certCall("/test.echo.v1.Echo/Unary", "root"), codes.OK},
		{ownerPolicy, certCall("/test.echo.v1.Echo/Unary", "alice"), codes.PermissionDenied},
		{servicePolicy, certCall("/test.echo.v1.Echo/Unary", "alice"), codes.OK},
		{servicePolicy, certCall("/test.echo.v1.Echo2/Unary", "alice"), codes.PermissionDenied},
		{servicePolicy, certCall("/test.echo.v1.Other/Unary", "cond-1"), codes.PermissionDenied},
		{servicePolicy, certCall("/test.echo.v1.Echo/Unary", "root"), codes.PermissionDenied},
		{"", certCall("/test.unrouted.v1.Echo/Unary", "root"), codes.PermissionDenied},
	} {
		g := newGuard(t, tc.policy, Limits{}, nil)
		if _, _, err := g.admit(ctx, tc.c, nil); code(err) != tc.want {
			t.Errorf("policy %.20q, %s as %q: %v, want %s", tc.policy, tc.c.procedure, tc.c.authorization, err, tc.want)
		}
	}
	g := newGuard(t, servicePolicy, Limits{}, nil)
	e, err := g.Explain(authz.Principal{Identity: "alice", Roles: []string{"vm-owner"}}, "/test.echo.v1.Echo/Unary", "")
	if err != nil || !e.Allowed || e.Resource != "test.echo.v1.Echo" || e.Verb != authz.VerbCall {
		t.Errorf("Explain of a routed service's method: %+v, %v", e, err)
	}
}

// TestFilter: a vm-owner's list keeps their objects only; a watch event
// of another owner's object is not sent.
func TestFilter(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	_, list, err := g.admit(context.Background(), certCall("/pivirt.vm.v1.VMService/ListVMs", "alice"), nil)
	if err != nil || !list.filters() {
		t.Fatalf("ListVMs as a vm-owner: %v (filters %v)", err, list.filters())
	}
	vm := func(id, owner string) *vmv1.VM { return &vmv1.VM{Id: id, Metadata: &apiv1.ObjectMeta{Owner: owner}} }
	resp := &vmv1.ListVMsResponse{Vms: []*vmv1.VM{vm("1", "alice"), vm("2", "bob"), vm("3", ""), vm("4", "alice"), {Id: "5"}}, NextPageToken: "t"}
	if !list.filter(resp.ProtoReflect()) || len(resp.GetVms()) != 2 || resp.GetVms()[0].GetId() != "1" || resp.GetVms()[1].GetId() != "4" || resp.GetNextPageToken() != "t" {
		t.Errorf("filtered list: %v", resp)
	}
	_, watch, err := g.admit(context.Background(), certCall("/pivirt.vm.v1.VMService/WatchVMs", "alice"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !watch.filter((&vmv1.WatchVMsResponse{Vm: vm("1", "alice")}).ProtoReflect()) || watch.filter((&vmv1.WatchVMsResponse{Vm: vm("2", "bob")}).ProtoReflect()) {
		t.Error("watch filter: alice's event dropped or bob's sent")
	}
	_, admin, _ := g.admit(context.Background(), certCall("/pivirt.vm.v1.VMService/ListVMs", "root"), nil)
	if admin.filters() {
		t.Error("admin's list is filtered")
	}
}

// TestCheckRequest: the object is read with the service's get method and
// checked; a missing object is NotFound; a request without an ID is
// InvalidArgument.
func TestCheckRequest(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	var asked []string
	g.cfg.Fetch = func(_ context.Context, get protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error) {
		id := req.(*vmv1.GetVMRequest).GetId()
		asked = append(asked, string(get.FullName())+" "+id)
		if id == "gone" {
			return nil, status.Error(codes.NotFound, "vm gone: not found")
		}
		owner := map[string]string{"a1": "alice", "b1": "bob"}[id]
		return &vmv1.GetVMResponse{Vm: &vmv1.VM{Id: id, Metadata: &apiv1.ObjectMeta{Owner: owner}}}, nil
	}
	ctx := context.Background()
	for _, tc := range []struct {
		method string
		req    protoreflect.ProtoMessage
		want   codes.Code
	}{
		{"PowerOn", &vmv1.PowerOnRequest{Id: "a1"}, codes.OK},
		{"PowerOn", &vmv1.PowerOnRequest{Id: "b1"}, codes.PermissionDenied},
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "a1"}}, codes.OK},
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "b1", Metadata: &apiv1.ObjectMeta{Owner: "alice"}}}, codes.PermissionDenied},
		// Not found and not allowed look the same to a caller limited to
		// some objects.
		{"GetVM", &vmv1.GetVMRequest{Id: "gone"}, codes.PermissionDenied},
		// An update is checked on the result too: alice may not hand
		// her VM to bob, unless the mask leaves the owner alone.
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "a1", Metadata: &apiv1.ObjectMeta{Owner: "bob"}}}, codes.PermissionDenied},
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "a1", Vcpus: 4, Metadata: &apiv1.ObjectMeta{Owner: "bob"}}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}}, codes.OK},
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "a1", Metadata: &apiv1.ObjectMeta{Owner: "bob"}}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"metadata.owner"}}}, codes.PermissionDenied},
		{"UpdateVM", &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "a1"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"metadata"}}}, codes.PermissionDenied},
		{"GetVM", &vmv1.GetVMRequest{}, codes.InvalidArgument},
	} {
		c := certCall("/pivirt.vm.v1.VMService/"+tc.method, "alice")
		ctx, gr, err := g.admit(ctx, c, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := g.checkRequest(ctx, c, gr, tc.req.ProtoReflect()); code(err) != tc.want {
			t.Errorf("%s %v: %v, want %s", tc.method, tc.req, err, tc.want)
		}
	}
	if len(asked) != 9 || asked[0] != "pivirt.vm.v1.VMService.GetVM a1" {
		t.Errorf("objects read: %v", asked)
	}
}

// TestRateLimitAtConfiguredRate: over ten seconds of a controlled clock, a
// principal calling every 10 ms gets exactly burst + rate×10 s calls; a
// route's own bucket (the longest matching prefix) and other principals
// are separate; a refusal carries the wait until the next token.
func TestRateLimitAtConfiguredRate(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { return now }
	g := newGuard(t, "", Limits{
		Default: Limit{PerSecond: 5, Burst: 10},
		Routes: []RouteLimit{
			{Prefix: "/pivirt.vm.v1.VMService/", Limit: Limit{PerSecond: 100, Burst: 1}},
			{Prefix: "/pivirt.vm.v1.VMService/PowerOn", Limit: Limit{PerSecond: 1, Burst: 2}},
		},
	}, clock)
	ctx := context.Background()
	counts := map[string]int{}
	var lastRefusal error
	for range 1000 { // 10 s in 10 ms steps
		for _, c := range []struct{ key, method, who string }{
			{"alice default", "/pivirt.cluster.v1.ClusterService/Leader", "alice"},
			{"root default", "/pivirt.cluster.v1.ClusterService/Members", "root"},
			{"alice vm", "/pivirt.vm.v1.VMService/ListVMs", "alice"},
			{"alice poweron", "/pivirt.vm.v1.VMService/PowerOn", "alice"},
		} {
			_, _, err := g.admit(ctx, certCall(c.method, c.who), nil)
			switch code(err) {
			case codes.OK, codes.PermissionDenied:
				counts[c.key]++
			case codes.ResourceExhausted:
				if c.key == "alice default" {
					lastRefusal = err
				}
			default:
				t.Fatalf("%s: %v", c.key, err)
			}
		}
		now = now.Add(10 * time.Millisecond)
	}
	for key, want := range map[string]int{"alice default": 10 + 5*10, "root default": 10 + 5*10, "alice vm": 1000, "alice poweron": 2 + 1*10} {
		if got := counts[key]; got < want-1 || got > want+1 {
			t.Errorf("%s: %d calls in 10 s, want %d", key, got, want)
		}
	}
	var d *denial
	if !errors.As(lastRefusal, &d) || d.retry <= 0 || d.retry > 200*time.Millisecond || !strings.Contains(d.msg, "5 requests/s, burst 10") {
		t.Errorf("refusal %v (retry %v), want a wait of at most 200ms and the limit named", lastRefusal, d)
	}
	if got := testutil.ToFloat64(g.rateLimited.WithLabelValues("*")); got == 0 {
		t.Error("pivirt_api_rate_limited_total did not count the refusals")
	}
}

// TestPageTokens: a filtered list's next page token is sealed for the
// caller and method; it opens back into the backend's for them only.
func TestPageTokens(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	_, alice, _ := g.admit(context.Background(), certCall("/pivirt.vm.v1.VMService/ListVMs", "alice"), nil)
	resp := &vmv1.ListVMsResponse{NextPageToken: "vm-of-bob"}
	if !g.filterResponse(alice, resp.ProtoReflect()) || strings.Contains(resp.GetNextPageToken(), "bob") || !strings.HasPrefix(resp.GetNextPageToken(), tokenPrefix) {
		t.Fatalf("sealed token %q", resp.GetNextPageToken())
	}
	req := &vmv1.ListVMsRequest{PageToken: resp.GetNextPageToken()}
	if err := g.openPageToken(alice, req.ProtoReflect()); err != nil || req.GetPageToken() != "vm-of-bob" {
		t.Errorf("opened token %q, %v", req.GetPageToken(), err)
	}
	carol := *alice
	carol.who = authz.Principal{Identity: "carol", Roles: alice.who.Roles}
	for name, tc := range map[string]struct {
		gr    *grant
		token string
	}{
		"another principal": {&carol, resp.GetNextPageToken()},
		"a backend token":   {alice, "vm-of-bob"},
		"tampered":          {alice, resp.GetNextPageToken()[:len(resp.GetNextPageToken())-2] + "AA"},
	} {
		req := &vmv1.ListVMsRequest{PageToken: tc.token}
		if err := g.openPageToken(tc.gr, req.ProtoReflect()); code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
}

// TestFailedAuthenticationFlood: a source that keeps failing to
// authenticate is refused before its credentials are checked, with one log
// line for the episode instead of one per call; other sources are not
// affected, and the source gets through again once its budget refills.
func TestFailedAuthenticationFlood(t *testing.T) {
	var logs bytes.Buffer
	clock := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	g, err := New(Config{
		Authenticator: &authn.Authenticator{CertRoles: map[string][]string{"root": {"admin"}}},
		Logger:        slog.New(slog.NewTextHandler(&logs, nil)),
		Now:           func() time.Time { return clock },
	})
	if err != nil {
		t.Fatal(err)
	}
	forged := func(remote string) call {
		return call{procedure: "/pivirt.vm.v1.VMService/GetVM", authorization: "Basic forged", remote: remote}
	}
	codesSeen := map[codes.Code]int{}
	for range 5000 {
		_, _, err := g.admit(context.Background(), forged("10.0.0.66:4000"), nil)
		codesSeen[code(err)]++
	}
	if codesSeen[codes.Unauthenticated] != failedAuthBurst || codesSeen[codes.ResourceExhausted] != 5000-failedAuthBurst {
		t.Errorf("refusals %v, want %d Unauthenticated then ResourceExhausted", codesSeen, failedAuthBurst)
	}
	if n := strings.Count(logs.String(), "\n"); n > failedAuthBurst+1 {
		t.Errorf("%d log lines for 5000 forged calls, want at most %d", n, failedAuthBurst+1)
	}
	if !strings.Contains(logs.String(), "too many failed authentications") {
		t.Error("the flood is not logged")
	}
	// Another source, and a good certificate from it, are not affected.
	if _, _, err := g.admit(context.Background(), forged("10.0.0.7:4000"), nil); code(err) != codes.Unauthenticated {
		t.Errorf("another source: %v, want Unauthenticated", err)
	}
	good := certCall("/pivirt.vm.v1.VMService/GetVM", "root")
	good.remote = "10.0.0.7:4001"
	if _, _, err := g.admit(context.Background(), good, nil); err != nil {
		t.Errorf("a good certificate from another source: %v", err)
	}
	// Once a token is back, the flooding source is heard again.
	clock = clock.Add(time.Second)
	if _, _, err := g.admit(context.Background(), forged("10.0.0.66:4001"), nil); code(err) != codes.Unauthenticated {
		t.Errorf("the source after its budget refilled: %v, want Unauthenticated", err)
	}
	// An IPv6 source is its /64: other addresses of it share the budget.
	for i := range failedAuthBurst {
		g.admit(context.Background(), forged(fmt.Sprintf("[2001:db8:1:2::%x]:4000", i+1)), nil)
	}
	if _, _, err := g.admit(context.Background(), forged("[2001:db8:1:2:ffff::1]:4000"), nil); code(err) != codes.ResourceExhausted {
		t.Errorf("another address of the /64: %v, want ResourceExhausted", err)
	}
	if _, _, err := g.admit(context.Background(), forged("[2001:db8:1:3::1]:4000"), nil); code(err) != codes.Unauthenticated {
		t.Errorf("another /64: %v, want Unauthenticated", err)
	}
}

// TestFailedAuthenticationConcurrent: calls in flight at the same time
// each hold a token of the budget, so a burst of concurrent forged calls
// gets no more credential checks than the burst; good calls give their
// token back and are never limited.
func TestFailedAuthenticationConcurrent(t *testing.T) {
	g := newGuard(t, "", Limits{}, nil)
	var wg sync.WaitGroup
	var checked atomic.Int32
	for range 200 {
		wg.Go(func() {
			_, _, err := g.admit(context.Background(), call{procedure: "/pivirt.vm.v1.VMService/GetVM", authorization: "Basic forged", remote: "10.0.0.66:4000"}, nil)
			if code(err) == codes.Unauthenticated {
				checked.Add(1)
			}
		})
	}
	wg.Wait()
	if n := checked.Load(); n > failedAuthBurst {
		t.Errorf("%d credential checks for 200 concurrent forged calls, want at most %d", n, failedAuthBurst)
	}
	good := certCall("/pivirt.vm.v1.VMService/GetVM", "root")
	good.remote = "10.0.0.8:4000"
	for range 1000 {
		if _, _, err := g.admit(context.Background(), good, nil); err != nil {
			t.Fatalf("a good certificate, called often: %v", err)
		}
	}
}
