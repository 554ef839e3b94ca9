package agent_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/go-jose/go-jose/v4"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/authn/oidctest"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/identity"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

// accessEnv is one agent with TLS, a local OIDC issuer, the spec's example
// RBAC policy and a simulated pivirtd behind it.
type accessEnv struct {
	t      *testing.T
	c      *agenttest.Cluster
	n      *agenttest.Node
	dir    string
	policy string
	is     *oidctest.Issuer
	key    oidctest.Key
	conn   *grpc.ClientConn // TLS, no client certificate
	vm     vmv1.VMServiceClient
	vol    storagev1.StorageServiceClient
	cl     clusterv1.ClusterServiceClient
	seq    atomic.Int64
}

func newAccessEnv(t *testing.T, nodes int, mutate func(*config.Config)) *accessEnv {
	t.Helper()
	s := startSim(t)
	return newAccessEnvWith(t, nodes, withBackends(s.addr), mutate)
}

// newAccessEnvWith is newAccessEnv with the backends backends gives each
// node.
func newAccessEnvWith(t *testing.T, nodes int, backends func(int, *config.Config), mutate func(*config.Config)) *accessEnv {
	t.Helper()
	e := &accessEnv{t: t, dir: testPKI(t, nodes), is: oidctest.New(t)}
	e.key = e.is.NewKey(t, "k1", jose.RS256, true)
	spec, err := os.ReadFile(filepath.Join("..", "..", "..", "gateway", "authz", "testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	e.policy = filepath.Join(t.TempDir(), "rbac.yaml")
	if err := os.WriteFile(e.policy, spec, 0o600); err != nil {
		t.Fatal(err)
	}
	e.c = agenttest.NewExpect(t, nodes, func(i int, cfg *config.Config) {
		withTLS(e.dir)(i, cfg)
		backends(i, cfg)
		cfg.Auth.OIDC = config.OIDCConfig{IssuerURL: e.is.URL, ClientID: oidctest.Audience, AllowHTTPIssuer: true}
		cfg.Auth.RBACPolicy = e.policy
		cfg.Auth.CertificateRoles = map[string][]string{"ops-viewer": {"viewer"}, "ops-*": {"operator"}}
		if mutate != nil {
			mutate(cfg)
		}
	})
	e.n = e.c.WaitLeader(60 * time.Second)
	e.conn = e.dial(nil)
	e.vm = vmv1.NewVMServiceClient(e.conn)
	e.vol = storagev1.NewStorageServiceClient(e.conn)
	e.cl = clusterv1.NewClusterServiceClient(e.conn)
	return e
}

// dial connects to the API port over TLS, with a client certificate when
// cert is set.
func (e *accessEnv) dial(cert *tls.Certificate) *grpc.ClientConn {
	return e.dialAt(e.n.APIAddr(), cert)
}

// dialAt connects to the API port at addr.
func (e *accessEnv) dialAt(addr string, cert *tls.Certificate) *grpc.ClientConn {
	cfg := &tls.Config{RootCAs: mustPool(e.t, filepath.Join(e.dir, identity.ChainFile)), MinVersion: tls.VersionTLS12}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close() })
	return conn
}

func (e *accessEnv) clientCert(name string) *tls.Certificate {
	f := issueClient(e.t, e.dir, name)
	cert, err := tls.LoadX509KeyPair(f[0], f[1])
	if err != nil {
		e.t.Fatal(err)
	}
	return &cert
}

// token is a valid bearer token of sub with roles.
func (e *accessEnv) token(sub string, roles ...string) string {
	return e.key.Sign(e.t, e.is.Claims(sub, func(c map[string]any) { c["roles"] = roles }))
}

// as is a context carrying a bearer token.
func as(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

func (e *accessEnv) ctx() context.Context {
	ctx, cancel := context.WithTimeout(e.t.Context(), 15*time.Second)
	e.t.Cleanup(cancel)
	return ctx
}

// createVM creates a VM of owner as admin.
func (e *accessEnv) createVM(owner string) string {
	e.t.Helper()
	r, err := e.vm.CreateVM(as(e.ctx(), e.token("root", "admin")), &vmv1.CreateVMRequest{Vm: &vmv1.VM{
		Name: fmt.Sprintf("%s-vm-%d", owner, e.seq.Add(1)), Vcpus: 1, MemoryMib: 512, Metadata: &apiv1.ObjectMeta{Owner: owner},
	}})
	if err != nil {
		e.t.Fatalf("create a VM of %s as admin: %v", owner, err)
	}
	return r.GetVm().GetId()
}

func (e *accessEnv) createVolume() string {
	e.t.Helper()
	r, err := e.vol.CreateVolume(as(e.ctx(), e.token("root", "admin")), &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{
		Name: fmt.Sprintf("vol-%d", e.seq.Add(1)), SizeBytes: 1 << 20,
	}})
	if err != nil {
		e.t.Fatalf("create a volume as admin: %v", err)
	}
	return r.GetVolume().GetId()
}

func (e *accessEnv) console(ctx context.Context, id string) error {
	s, err := e.vm.Console(ctx)
	if err != nil {
		return err
	}
	if err := s.Send(&vmv1.ConsoleRequest{Id: id, Input: []byte("hello\n")}); err != nil {
		_, err = s.Recv()
		return err
	}
	_, err = s.Recv()
	_ = s.CloseSend()
	return err
}

// ops are calls of every kind, on VM target (owned by alice) where one is
// named; each reports the call's error.
func (e *accessEnv) ops(target string) map[string]func(ctx context.Context) error {
	return map[string]func(ctx context.Context) error{
		"virtualmachines get": func(ctx context.Context) error {
			_, err := e.vm.GetVM(ctx, &vmv1.GetVMRequest{Id: target})
			return err
		},
		"virtualmachines list": func(ctx context.Context) error {
			_, err := e.vm.ListVMs(ctx, &vmv1.ListVMsRequest{})
			return err
		},
		"virtualmachines create": func(ctx context.Context) error {
			_, err := e.vm.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: fmt.Sprintf("new-%d", e.seq.Add(1)), Vcpus: 1, MemoryMib: 256, Metadata: &apiv1.ObjectMeta{Owner: "alice"}}})
			return err
		},
		"virtualmachines update": func(ctx context.Context) error {
			_, err := e.vm.UpdateVM(ctx, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: target, Vcpus: 2}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}})
			return err
		},
		"virtualmachines delete": func(ctx context.Context) error {
			_, err := e.vm.DeleteVM(ctx, &vmv1.DeleteVMRequest{Id: e.createVM("alice")})
			return err
		},
		"virtualmachines start": func(ctx context.Context) error {
			_, err := e.vm.PowerOn(ctx, &vmv1.PowerOnRequest{Id: target})
			return err
		},
		"virtualmachines stop": func(ctx context.Context) error {
			_, err := e.vm.PowerOff(ctx, &vmv1.PowerOffRequest{Id: target})
			return err
		},
		"virtualmachines console": func(ctx context.Context) error { return e.console(ctx, target) },
		"volumes list": func(ctx context.Context) error {
			_, err := e.vol.ListVolumes(ctx, &storagev1.ListVolumesRequest{})
			return err
		},
		"volumes create": func(ctx context.Context) error {
			_, err := e.vol.CreateVolume(ctx, &storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: fmt.Sprintf("v-%d", e.seq.Add(1)), SizeBytes: 1 << 20}})
			return err
		},
		"volumes delete": func(ctx context.Context) error {
			_, err := e.vol.DeleteVolume(ctx, &storagev1.DeleteVolumeRequest{Id: e.createVolume()})
			return err
		},
		"cluster get": func(ctx context.Context) error {
			_, err := e.cl.Leader(ctx, &clusterv1.LeaderRequest{})
			return err
		},
		"services list": func(ctx context.Context) error {
			_, err := e.cl.ListServices(ctx, &clusterv1.ListServicesRequest{})
			return err
		},
		"config update": func(ctx context.Context) error {
			_, err := e.cl.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: "kv/test.access", Value: "x"})
			return err
		},
		"config list": func(ctx context.Context) error {
			_, err := e.cl.ListConfig(ctx, &clusterv1.ListConfigRequest{})
			return err
		},
		// docs/security.md: keyring changes (and the listing, one RPC) need
		// update on keyring.
		"keyring update": func(ctx context.Context) error {
			_, err := e.cl.Keyring(ctx, &clusterv1.KeyringRequest{Op: clusterv1.KeyringOp_KEYRING_OP_LIST})
			return err
		},
	}
}

// denied reports whether err is the gateway's refusal; anything else
// (success, or the backend's own answer) means the call was let through.
func denied(err error) bool {
	c := status.Code(err)
	return c == codes.PermissionDenied || c == codes.Unauthenticated
}

// TestAccessRoles calls every kind of method as each role of the reference
// policy (gateway/authz/testdata/spec-rbac.yaml) and as a caller
// without roles: each is allowed and denied exactly as the policy is
// written, by hand below.
func TestAccessRoles(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	target := e.createVM("alice")
	all := slices.Sorted(func(yield func(string) bool) {
		for k := range e.ops(target) {
			if !yield(k) {
				return
			}
		}
	})
	allowed := map[string][]string{
		"admin": all,
		// Operator: VM lifecycle, no delete (resources virtualmachines,
		// volumes, networks; verbs get, list, create, update, patch).
		"operator": {"virtualmachines get", "virtualmachines list", "virtualmachines create", "virtualmachines update", "volumes list", "volumes create"},
		// Viewer: read-only on every resource.
		"viewer": {"virtualmachines get", "virtualmachines list", "volumes list", "cluster get", "services list", "config list"},
		// VM owner (alice owns the target): get, list, update, patch,
		// start, stop, console of virtualmachines, when metadata.owner is
		// the caller.
		"vm-owner": {"virtualmachines get", "virtualmachines list", "virtualmachines update", "virtualmachines start", "virtualmachines stop", "virtualmachines console"},
		"":         nil,
	}
	ops := e.ops(target)
	for _, role := range []string{"admin", "operator", "viewer", "vm-owner", ""} {
		var roles []string
		if role != "" {
			roles = []string{role}
		}
		tok := e.token("alice", roles...)
		for _, name := range all {
			err := ops[name](as(e.ctx(), tok))
			want := slices.Contains(allowed[role], name)
			if denied(err) == want {
				t.Errorf("role %q, %s: error %v; want allowed=%v", role, name, err, want)
			}
			resource, verb, _ := strings.Cut(name, " ")
			if !want && status.Code(err) == codes.PermissionDenied && !strings.Contains(status.Convert(err).Message(), "may not "+verb+" "+resource) {
				t.Errorf("role %q, %s: denial %q does not name the verb and resource", role, name, status.Convert(err).Message())
			}
		}
	}
	if !e.c.Logs().Contains("audit: call denied") {
		t.Error("no denial in the audit log")
	}
	// The audit lines of allowed calls name the object of calls that
	// name one: the admin's stop (allowed without conditions) too.
	stops := 0
	for _, l := range strings.Split(e.c.Logs().Since(0), "\n") {
		if strings.Contains(l, "audit: call allowed") && strings.Contains(l, "VMService/PowerOff") {
			stops++
			if !strings.Contains(l, "object="+target) {
				t.Errorf("audit line of a stop does not name the VM %s: %s", target, l)
			}
		}
	}
	if stops == 0 {
		t.Error("no audit line of a stop")
	}
}

// TestAccessAuthentication: no credentials, bad tokens and certificates
// of the chain on every protocol; health checks need none.
func TestAccessAuthentication(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	ctx := e.ctx()
	if _, err := e.vm.ListVMs(ctx, &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "no credentials") {
		t.Errorf("ListVMs without credentials: %v, want Unauthenticated saying no credentials", err)
	}
	if _, err := e.cl.SetConfig(ctx, &clusterv1.SetConfigRequest{Key: "kv/a", Value: "b"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("SetConfig without credentials: %v, want Unauthenticated", err)
	}
	agenttest.Eventually(t, 10*time.Second, "a health check without credentials", func() error {
		r, err := healthpb.NewHealthClient(e.conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return fmt.Errorf("%v %v, want SERVING", r, err)
		}
		return nil
	})
	expired := e.key.Sign(t, e.is.Claims("alice", func(c map[string]any) { c["exp"] = time.Now().Add(-time.Hour).Unix() }))
	otherAud := e.key.Sign(t, e.is.Claims("alice", func(c map[string]any) { c["aud"] = "someone-else" }))
	for name, tok := range map[string]string{"expired": expired, "wrong audience": otherAud, "garbage": "not.a.token"} {
		if _, err := e.vm.ListVMs(as(ctx, tok), &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s token: %v, want Unauthenticated", name, err)
		}
	}
	// A bad token is refused even with a good certificate beside it.
	viewer := vmv1.NewVMServiceClient(e.dial(e.clientCert("ops-viewer")))
	if _, err := viewer.ListVMs(as(ctx, expired), &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("expired token with a client certificate: %v, want Unauthenticated", err)
	}
	// Certificates: the CN's roles from auth.certificate_roles.
	if _, err := viewer.ListVMs(ctx, &vmv1.ListVMsRequest{}); err != nil {
		t.Errorf("viewer certificate, ListVMs: %v", err)
	}
	if _, err := viewer.DeleteVM(ctx, &vmv1.DeleteVMRequest{Id: e.createVM("alice")}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("viewer certificate, DeleteVM: %v, want PermissionDenied", err)
	}
	ops := vmv1.NewVMServiceClient(e.dial(e.clientCert("ops-7")))
	if _, err := ops.CreateVM(ctx, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "by-ops-7", Vcpus: 1, MemoryMib: 256}}); err != nil {
		t.Errorf("operator certificate (ops-* pattern), CreateVM: %v", err)
	}

	// The caller's identity reaches the backend (percent-encoded UTF-8),
	// which makes it the owner of what it creates without one; a client's
	// own identity header is dropped.
	spoofed := metadata.AppendToOutgoingContext(as(ctx, e.token("józsef", "admin")), "x-pivirt-identity", "root")
	created, err := e.vm.CreateVM(spoofed, &vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "by-jozsef", Vcpus: 1, MemoryMib: 256}})
	if err != nil || created.GetVm().GetMetadata().GetOwner() != "józsef" {
		t.Errorf("CreateVM by józsef: %v %v, want a VM owned by józsef", created, err)
	}

	// /metrics on the API port: authenticated callers only.
	chainFile := filepath.Join(e.dir, identity.ChainFile)
	for name, tc := range map[string]struct {
		cert *tls.Certificate
		want int
	}{"without credentials": {nil, http.StatusUnauthorized}, "with a certificate": {e.clientCert("ops-viewer"), http.StatusOK}} {
		resp, err := httpsClient(t, chainFile, tc.cert).Get("https://" + e.n.APIAddr() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want || (tc.want == http.StatusOK && !strings.Contains(string(body), "pivirt_api_access_denied_total")) {
			t.Errorf("GET /metrics on the API port %s: %d, want %d", name, resp.StatusCode, tc.want)
		}
	}

	// Connect and gRPC-Web go through the transcoder: the same checks,
	// with the certificate of the TLS connection and the bearer header.
	for _, proto := range []string{"connect", "grpcweb"} {
		var opts []connect.ClientOption
		if proto == "grpcweb" {
			opts = append(opts, connect.WithGRPCWeb())
		}
		chain := filepath.Join(e.dir, identity.ChainFile)
		anon := vmv1connect.NewVMServiceClient(httpsClient(t, chain, nil), "https://"+e.n.APIAddr(), opts...)
		if _, err := anon.ListVMs(ctx, connect.NewRequest(&vmv1.ListVMsRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s without credentials: %v, want unauthenticated", proto, err)
		}
		withCert := vmv1connect.NewVMServiceClient(httpsClient(t, chain, e.clientCert("ops-viewer")), "https://"+e.n.APIAddr(), opts...)
		if _, err := withCert.ListVMs(ctx, connect.NewRequest(&vmv1.ListVMsRequest{})); err != nil {
			t.Errorf("%s with the viewer certificate, ListVMs: %v", proto, err)
		}
		req := connect.NewRequest(&vmv1.DeleteVMRequest{Id: "vm-x"})
		if _, err := withCert.DeleteVM(ctx, req); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("%s with the viewer certificate, DeleteVM: %v, want permission_denied", proto, err)
		}
		req = connect.NewRequest(&vmv1.DeleteVMRequest{Id: "vm-x"})
		req.Header().Set("Authorization", "Bearer "+expired)
		if _, err := withCert.DeleteVM(ctx, req); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s with an expired token: %v, want unauthenticated", proto, err)
		}
	}
}

// TestAccessOwnerCondition: a vm-owner gets, updates, starts, stops,
// opens the console of, lists and watches only the VMs whose
// metadata.owner is their identity, through gRPC and Connect.
func TestAccessOwnerCondition(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	mine, theirs := e.createVM("alice"), e.createVM("bob")
	alice := e.token("alice", "vm-owner")
	ops := map[string]func(ctx context.Context, id string) error{
		"get": func(ctx context.Context, id string) error {
			_, err := e.vm.GetVM(ctx, &vmv1.GetVMRequest{Id: id})
			return err
		},
		"update": func(ctx context.Context, id string) error {
			_, err := e.vm.UpdateVM(ctx, &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: id, Vcpus: 3}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vcpus"}}})
			return err
		},
		"start": func(ctx context.Context, id string) error {
			_, err := e.vm.PowerOn(ctx, &vmv1.PowerOnRequest{Id: id})
			return err
		},
		"stop": func(ctx context.Context, id string) error {
			_, err := e.vm.ShutdownDefault(ctx, &vmv1.ShutdownDefaultRequest{Id: id})
			return err
		},
		"console": e.console,
	}
	for _, name := range []string{"get", "update", "start", "stop", "console"} {
		if err := ops[name](as(e.ctx(), alice), mine); denied(err) {
			t.Errorf("alice %s of her VM: %v", name, err)
		}
		err := ops[name](as(e.ctx(), alice), theirs)
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), theirs) {
			t.Errorf("alice %s of bob's VM: %v, want PermissionDenied naming the VM", name, err)
		}
	}
	// A console opened on her VM that then names bob's is refused with
	// PermissionDenied naming it (not cancelled).
	if _, err := e.vm.PowerOn(as(e.ctx(), alice), &vmv1.PowerOnRequest{Id: mine}); err != nil {
		t.Fatal(err)
	}
	s, err := e.vm.Console(as(e.ctx(), alice))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&vmv1.ConsoleRequest{Id: mine, Input: []byte("hello\n")}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != nil {
		t.Fatalf("alice's console on her VM: %v", err)
	}
	_ = s.Send(&vmv1.ConsoleRequest{Id: theirs, Input: []byte("ls\n")})
	for {
		if _, err = s.Recv(); err != nil {
			break
		}
	}
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), theirs) {
		t.Errorf("alice's console naming bob's VM later: %v, want PermissionDenied naming it", err)
	}

	// Renaming her VM to the name of bob's fails, without the backend's
	// text, which names bob's VM.
	theirsVM, err := e.vm.GetVM(as(e.ctx(), e.token("root", "admin")), &vmv1.GetVMRequest{Id: theirs})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.vm.UpdateVM(as(e.ctx(), alice), &vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: mine, Name: theirsVM.GetVm().GetName()}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"name"}}})
	if status.Code(err) != codes.AlreadyExists || strings.Contains(err.Error(), theirs) {
		t.Errorf("alice renaming her VM to bob's name: %v, want AlreadyExists without bob's VM", err)
	}

	// A VM that does not exist looks like someone else's: alice learns
	// nothing of other owners' VMs.
	if _, err := e.vm.GetVM(as(e.ctx(), alice), &vmv1.GetVMRequest{Id: "vm-missing"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("alice get of a VM that does not exist: %v, want PermissionDenied", err)
	}
	// bob's VM is unchanged.
	got, err := e.vm.GetVM(as(e.ctx(), e.token("root", "admin")), &vmv1.GetVMRequest{Id: theirs})
	if err != nil || got.GetVm().GetVcpus() != 1 {
		t.Errorf("bob's VM after alice's attempts: %v %v", got, err)
	}

	// Lists and watches show alice her VMs only.
	for range 3 {
		e.createVM("bob")
	}
	e.createVM("alice")
	list, err := e.vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetVms()) != 2 || slices.ContainsFunc(list.GetVms(), func(v *vmv1.VM) bool { return v.GetMetadata().GetOwner() != "alice" }) {
		t.Errorf("alice's ListVMs: %v, want her 2 VMs", list.GetVms())
	}
	all, err := e.vm.ListVMs(as(e.ctx(), e.token("carol", "viewer", "vm-owner")), &vmv1.ListVMsRequest{})
	if err != nil || len(all.GetVms()) != 6 {
		t.Errorf("a viewer (and vm-owner) lists every VM: %d %v, want 6", len(all.GetVms()), err)
	}
	// Through the proxy, page by page: alice gets each of her VMs once
	// and nothing else; a backend's own page token (which would tell her
	// where other owners' VMs are) is refused.
	var paged []string
	token := ""
	for page := 0; page < 10; page++ {
		resp, err := e.vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{PageSize: 1, PageToken: token})
		if err != nil {
			t.Fatalf("alice's ListVMs page %d: %v", page, err)
		}
		for _, v := range resp.GetVms() {
			paged = append(paged, v.GetId())
			if v.GetMetadata().GetOwner() != "alice" {
				t.Errorf("page %d holds %s's VM", page, v.GetMetadata().GetOwner())
			}
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	if len(paged) != 2 {
		t.Errorf("alice paged through %v, want her 2 VMs", paged)
	}
	raw, err := e.vm.ListVMs(as(e.ctx(), e.token("root", "admin")), &vmv1.ListVMsRequest{PageSize: 1})
	if err != nil || raw.GetNextPageToken() == "" {
		t.Fatalf("admin's first page: %v %v", raw, err)
	}
	if _, err := e.vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{PageSize: 1, PageToken: raw.GetNextPageToken()}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("alice with a backend's page token: %v, want InvalidArgument", err)
	}
	connectVMs := vmv1connect.NewVMServiceClient(httpsClient(t, filepath.Join(e.dir, identity.ChainFile), nil), "https://"+e.n.APIAddr())
	req := connect.NewRequest(&vmv1.ListVMsRequest{})
	req.Header().Set("Authorization", "Bearer "+alice)
	cl, err := connectVMs.ListVMs(e.ctx(), req)
	if err != nil || len(cl.Msg.GetVms()) != 2 {
		t.Errorf("alice's ListVMs over Connect: %v %v, want her 2 VMs", cl, err)
	}
	greq := connect.NewRequest(&vmv1.GetVMRequest{Id: theirs})
	greq.Header().Set("Authorization", "Bearer "+alice)
	if _, err := connectVMs.GetVM(e.ctx(), greq); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("alice's GetVM of bob's VM over Connect: %v, want permission_denied", err)
	}

	wctx, cancel := context.WithCancel(as(e.ctx(), alice))
	defer cancel()
	w, err := e.vm.WatchVMs(wctx, &vmv1.WatchVMsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	newest := e.createVM("alice")
	e.createVM("bob")
	var seen []string
	for !slices.Contains(seen, newest) {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("alice's watch: %v (seen %v)", err, seen)
		}
		if ev.GetVm().GetMetadata().GetOwner() != "alice" {
			t.Fatalf("alice's watch shows %s of %s", ev.GetVm().GetId(), ev.GetVm().GetMetadata().GetOwner())
		}
		seen = append(seen, ev.GetVm().GetId())
	}
}

// TestAccessRateLimit: calls beyond a principal's bucket of a route fail
// with ResourceExhausted and a retry hint, counted by the metric; another
// principal and another route are not affected; the hint's wait is enough.
func TestAccessRateLimit(t *testing.T) {
	e := newAccessEnv(t, 1, func(cfg *config.Config) {
		cfg.RateLimiting = config.RateLimitingConfig{Enabled: true, RequestsPerSecond: 1000, Burst: 1000, Routes: []config.RateLimitRoute{
			{Prefix: "/pivirt.cluster.v1.ClusterService/Leader", RequestsPerSecond: 2, Burst: 3},
		}}
	})
	viewer := as(e.ctx(), e.token("victor", "viewer"))
	var ok int
	var limited error
	for range 10 {
		_, err := e.cl.Leader(viewer, &clusterv1.LeaderRequest{})
		if err != nil {
			limited = err
			break
		}
		ok++
	}
	// The burst is 3; at 2/s at most one more token can arrive while the
	// calls run.
	if ok < 3 || ok > 5 || status.Code(limited) != codes.ResourceExhausted {
		t.Fatalf("%d calls passed, then %v; want 3 to 5, then ResourceExhausted", ok, limited)
	}
	var hint time.Duration
	for _, d := range status.Convert(limited).Details() {
		if ri, isRI := d.(*errdetails.RetryInfo); isRI {
			hint = ri.GetRetryDelay().AsDuration()
		}
	}
	if hint <= 0 || hint > time.Second || !strings.Contains(limited.Error(), "retry after") {
		t.Errorf("retry hint %s in %v, want a RetryInfo of at most 500ms and a message saying when", hint, limited)
	}
	if _, err := e.cl.Leader(as(e.ctx(), e.token("wendy", "viewer")), &clusterv1.LeaderRequest{}); err != nil {
		t.Errorf("another principal on the same route: %v", err)
	}
	if _, err := e.cl.ListServices(viewer, &clusterv1.ListServicesRequest{}); err != nil {
		t.Errorf("the same principal on another route: %v", err)
	}
	agenttest.Eventually(t, 5*time.Second, "a call after the retry hint", func() error {
		_, err := e.cl.Leader(viewer, &clusterv1.LeaderRequest{})
		return err
	})
	if !strings.Contains(httpGet(t, "http://"+e.n.MetricsAddr()+"/metrics"), `pivirt_api_rate_limited_total{route="/pivirt.cluster.v1.ClusterService/Leader"}`) {
		t.Error("no pivirt_api_rate_limited_total for the route")
	}
}

// TestAccessPolicyReload: a broken policy file is refused with the old
// policy kept; a valid one takes effect on reload; a cluster-wide policy
// set through the replicated config takes precedence, is validated before
// it is stored, and its removal brings the file's back.
func TestAccessPolicyReload(t *testing.T) {
	e := newAccessEnv(t, 3, nil)
	operator := e.token("olga", "operator")
	deleteVM := func() error {
		_, err := e.vm.DeleteVM(as(e.ctx(), operator), &vmv1.DeleteVMRequest{Id: e.createVM("alice")})
		return err
	}
	if err := deleteVM(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("operator delete under the spec's policy: %v", err)
	}
	spec, err := os.ReadFile(e.policy)
	if err != nil {
		t.Fatal(err)
	}
	broken := strings.Replace(string(spec), `verbs: ["get", "list", "create", "update", "patch"]`, `verbs: ["get", "list", "create", "update", "reboot"]`, 1)
	if err := os.WriteFile(e.policy, []byte(broken), 0o600); err != nil {
		t.Fatal(err)
	}
	code, body := httpPost(t, "http://"+e.n.MetricsAddr()+"/reload")
	if code != 422 || !strings.Contains(body, `rules[1].verbs[4]: unknown \"reboot\"`) {
		t.Errorf("POST /reload with a broken policy: %d %s, want 422 naming rules[1].verbs[4]", code, body)
	}
	if err := deleteVM(); status.Code(err) != codes.PermissionDenied {
		t.Errorf("operator delete after a broken reload: %v, want the old policy's PermissionDenied", err)
	}
	lenient := strings.Replace(string(spec), `verbs: ["get", "list", "create", "update", "patch"]`, `verbs: ["get", "list", "create", "update", "patch", "delete"]`, 1)
	if err := os.WriteFile(e.policy, []byte(lenient), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, body := httpPost(t, "http://"+e.n.MetricsAddr()+"/reload"); code != 200 || !strings.Contains(body, "auth.rbac_policy") {
		t.Fatalf("POST /reload with a valid policy: %d %s", code, body)
	}
	if err := deleteVM(); err != nil {
		t.Errorf("operator delete after the policy allows it: %v", err)
	}

	// Cluster-wide: validated before it is stored.
	admin := as(e.ctx(), e.token("root", "admin"))
	for name, tc := range map[string]struct{ policy, want string }{
		"unknown verb": {strings.Replace(string(spec), `"patch"]`, `"reboot"]`, 1), `rules[1].verbs[4]: unknown "reboot"`},
		"bad template": {strings.Replace(string(spec), `{{.user.identity}}`, `{{.user.email}}`, 1), `rules[3].conditions[0].value: bad template`},
		"lockout":      {"apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules:\n  - roles: [viewer]\n    resources: [\"*\"]\n    verbs: [get]\n", "no rule lets any role update rbac"},
	} {
		_, err := e.cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: tc.policy})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("cluster policy with %s: %v, want InvalidArgument with %q", name, err, tc.want)
		}
	}
	if _, err := e.cl.GetConfig(admin, &clusterv1.GetConfigRequest{Key: agent.RBACPolicyKey}); status.Code(err) != codes.NotFound {
		t.Errorf("a refused cluster policy was stored: %v", err)
	}
	// A valid one applies on every node in place of the file (which all
	// three read, and which now lets the operator delete but not start):
	// the cluster policy lets the operator start but not delete, on the
	// leader and on a follower alike.
	other := vmv1.NewVMServiceClient(e.dialAt(e.c.Follower().APIAddr(), nil))
	lenientCluster := strings.Replace(string(spec), `verbs: ["get", "list", "create", "update", "patch"]`, `verbs: ["get", "list", "create", "update", "patch", "start"]`, 1) +
		"  - roles: [\"config-editor\"]\n    resources: [\"config\"]\n    verbs: [\"update\", \"delete\"]\n"
	if _, err := e.cl.SetConfig(admin, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: lenientCluster}); err != nil {
		t.Fatal(err)
	}
	target := e.createVM("alice")
	agenttest.Eventually(t, 10*time.Second, "the cluster policy in force on every node", func() error {
		if err := deleteVM(); status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("operator delete on the leader under the cluster policy: %v", err)
		}
		if _, err := other.PowerOn(as(e.ctx(), operator), &vmv1.PowerOnRequest{Id: target}); denied(err) {
			return fmt.Errorf("operator start on a follower under the cluster policy: %v", err)
		}
		return nil
	})
	// Updating the config is not updating the policy: that is resource
	// rbac.
	editor := as(e.ctx(), e.token("eve", "config-editor"))
	if _, err := e.cl.SetConfig(editor, &clusterv1.SetConfigRequest{Key: "kv/app.x", Value: "1"}); err != nil {
		t.Errorf("config-editor sets a config key: %v", err)
	}
	for name, err := range map[string]error{
		"set": func() error {
			_, err := e.cl.SetConfig(editor, &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: lenientCluster})
			return err
		}(),
		"delete": func() error {
			_, err := e.cl.DeleteConfig(editor, &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey})
			return err
		}(),
	} {
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), " rbac auth.rbac_policy:") {
			t.Errorf("config-editor %ss the cluster policy: %v, want PermissionDenied on rbac", name, err)
		}
	}
	if _, err := e.cl.DeleteConfig(admin, &clusterv1.DeleteConfigRequest{Key: agent.RBACPolicyKey}); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, 10*time.Second, "the file's policy back", func() error {
		return deleteVM()
	})
}

// TestEveryServedMethodHasARule lists, through server reflection, every
// service the API port serves or routes, and checks that each method
// carries an authorization annotation, except health checks and
// reflection (built in, not RBAC resources), whose methods are the only
// open ones: the guard decides "open" for exactly those.
func TestEveryServedMethodHasARule(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	stream, err := reflectionpb.NewServerReflectionClient(e.conn).ServerReflectionInfo(as(e.ctx(), e.token("root", "viewer")))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	builtIn := []string{"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
	admin := as(e.ctx(), e.token("root", "admin"))
	var methods int
	for _, s := range resp.GetListServicesResponse().GetService() {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(s.GetName()))
		if err != nil {
			t.Errorf("service %s: %v", s.GetName(), err)
			continue
		}
		sd := d.(protoreflect.ServiceDescriptor)
		for i := range sd.Methods().Len() {
			md := sd.Methods().Get(i)
			r, err := e.cl.CheckAccess(admin, &clusterv1.CheckAccessRequest{Identity: "nobody", Method: "/" + string(md.FullName().Parent()) + "/" + string(md.Name())})
			if err != nil {
				t.Errorf("check %s: %v", md.FullName(), err)
				continue
			}
			if open := r.GetDecision() == "open"; open != slices.Contains(builtIn, s.GetName()) {
				t.Errorf("%s: decision %q; only the methods of %v are open", md.FullName(), r.GetDecision(), builtIn)
			}
			if slices.Contains(builtIn, s.GetName()) {
				continue
			}
			methods++
			if _, err := authz.MethodRule(md); err != nil {
				t.Error(err)
			}
		}
	}
	// Cluster 26 + snapshots 2 + schedules 9 + agent 3 + VMs 11 + volumes 7
	// (networks are not routed here).
	if methods != 61 {
		t.Errorf("%d methods served, want 61", methods)
	}
}

// TestAccessClusterPolicyAfterRestart: agents without a policy file of
// their own enforce the cluster-wide policy from the moment they restart,
// even without a quorum (from the copy in their data dir); an agent that
// has neither holds calls and answers Unavailable rather than let them
// through, until it has caught up.
func TestAccessClusterPolicyAfterRestart(t *testing.T) {
	e := newAccessEnv(t, 3, func(cfg *config.Config) {
		cfg.Auth.RBACPolicy = ""
		cfg.Cluster.ForwardHoldTimeout = config.Duration(time.Second)
	})
	spec, err := os.ReadFile(e.policy)
	if err != nil {
		t.Fatal(err)
	}
	nobody := e.token("mallory")
	if _, err := e.vm.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{}); err != nil {
		t.Fatalf("without any policy an authenticated caller may list: %v", err)
	}
	if _, err := e.cl.SetConfig(as(e.ctx(), e.token("root", "admin")), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: string(spec)}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		conn := vmv1.NewVMServiceClient(e.dialAt(e.c.Node(i).APIAddr(), nil))
		agenttest.Eventually(t, 10*time.Second, "the cluster policy on every node", func() error {
			if _, err := conn.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{}); status.Code(err) != codes.PermissionDenied {
				return fmt.Errorf("node %d: %v", i, err)
			}
			return nil
		})
	}
	for i := range 3 {
		e.c.Kill(i)
	}
	// Node 1 alone, without a quorum: the kept copy is enforced.
	n := e.c.Restart(1, false, "")
	conn := vmv1.NewVMServiceClient(e.dialAt(n.APIAddr(), nil))
	for range 20 {
		_, err := conn.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{})
		if status.Code(err) == codes.OK {
			t.Fatal("a caller without roles was let through after a restart without a quorum")
		}
		if status.Code(err) != codes.PermissionDenied {
			// The port may not be up for the very first call.
			continue
		}
	}
	if _, err := conn.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("restarted without a quorum: %v, want PermissionDenied from the kept policy", err)
	}
	// Without the copy (a node that never saw the policy) it answers
	// Unavailable.
	e.c.Kill(1)
	if err := os.Remove(filepath.Join(e.c.Node(1).DataDir(), "rbac-cluster-policy.yaml")); err != nil {
		t.Fatal(err)
	}
	n = e.c.Restart(1, false, "")
	conn = vmv1.NewVMServiceClient(e.dialAt(n.APIAddr(), nil))
	agenttest.Eventually(t, 10*time.Second, "Unavailable without a policy or a quorum", func() error {
		_, err := conn.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{})
		if status.Code(err) == codes.OK {
			t.Fatal("a caller without roles was let through by a node that does not know the policy")
		}
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "caught up") {
			return fmt.Errorf("%v, want Unavailable saying the agent has not caught up", err)
		}
		return nil
	})
	// With the others back it catches up and enforces the policy.
	e.c.Restart(0, false, n.GossipAddr())
	e.c.Restart(2, false, n.GossipAddr())
	agenttest.Eventually(t, 30*time.Second, "the policy after catching up", func() error {
		if _, err := conn.ListVMs(as(e.ctx(), nobody), &vmv1.ListVMsRequest{}); status.Code(err) != codes.PermissionDenied {
			return fmt.Errorf("%v, want PermissionDenied", err)
		}
		return nil
	})
}

// TestAccessSchedulesActAsTheirCreator: creating or changing a power
// schedule needs, besides the schedules resource, the right to make the
// schedule's VM call yourself: a vm-owner schedules her own VMs only, a
// role without start cannot schedule a power-on.
func TestAccessSchedulesActAsTheirCreator(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	spec, err := os.ReadFile(e.policy)
	if err != nil {
		t.Fatal(err)
	}
	policy := string(spec) + `  - roles: ["vm-owner", "operator"]
    resources: ["schedules"]
    verbs: ["create", "get", "list", "update"]
`
	if _, err := e.cl.SetConfig(as(e.ctx(), e.token("root", "admin")), &clusterv1.SetConfigRequest{Key: agent.RBACPolicyKey, Value: policy}); err != nil {
		t.Fatal(err)
	}
	mine, theirs := e.createVM("alice"), e.createVM("bob")
	sc := schedulev1.NewScheduleServiceClient(e.conn)
	create := func(who, vm string, action schedulev1.Action) error {
		_, err := sc.CreateSchedule(as(e.ctx(), who), &schedulev1.CreateScheduleRequest{Schedule: &schedulev1.Schedule{
			VmId: vm, Action: action, Cron: "0 7 * * *", Enabled: true}})
		return err
	}
	alice, olga := e.token("alice", "vm-owner"), e.token("olga", "operator")
	agenttest.Eventually(t, 10*time.Second, "the policy with schedules in force", func() error {
		return create(alice, mine, schedulev1.Action_ACTION_POWER_ON)
	})
	if err := create(alice, theirs, schedulev1.Action_ACTION_POWER_ON); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "start virtualmachines") {
		t.Errorf("alice schedules bob's VM: %v, want PermissionDenied on start virtualmachines", err)
	}
	if err := create(olga, mine, schedulev1.Action_ACTION_REBOOT); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "stop virtualmachines") {
		t.Errorf("an operator schedules a reboot: %v, want PermissionDenied on stop virtualmachines", err)
	}
	// Moving a schedule to someone else's VM is checked too.
	l, err := sc.ListSchedules(as(e.ctx(), alice), &schedulev1.ListSchedulesRequest{VmId: mine})
	if err != nil || len(l.GetSchedules()) != 1 {
		t.Fatalf("alice's schedules: %v %v", l, err)
	}
	_, err = sc.UpdateSchedule(as(e.ctx(), alice), &schedulev1.UpdateScheduleRequest{
		Schedule: &schedulev1.Schedule{Id: l.GetSchedules()[0].GetId(), VmId: theirs}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vm_id"}}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("alice moves her schedule to bob's VM: %v, want PermissionDenied", err)
	}
}

// TestConfigWarnings: an RBAC policy with TLS on and no
// auth.certificate_roles leaves certificate callers without a role (the
// specification's example configuration): said at start and by validate.
func TestConfigWarnings(t *testing.T) {
	cfg := config.Default()
	cfg.TLS.Enabled = true
	cfg.Auth.RBACPolicy = "/etc/pivirt-agent/rbac.yaml"
	if w := agent.ConfigWarnings(cfg); len(w) != 1 || !strings.Contains(w[0], "auth.certificate_roles is empty") || !strings.Contains(w[0], "certificate_roles: {operator: [admin]}") {
		t.Errorf("warnings %q, want the certificate callers without a role and the fix", w)
	}
	cfg.Auth.CertificateRoles = map[string][]string{"operator": {"admin"}}
	if w := agent.ConfigWarnings(cfg); len(w) != 0 {
		t.Errorf("with certificate_roles: warnings %q, want none", w)
	}
	// A backend's tls block with files but not enabled: not used.
	b := config.BackendConfig{Endpoint: "https://osinfodb.pilab.hu"}
	b.TLS.CAFile = "/etc/pivirt/certs/ca-chain.pem"
	cfg.Backends = map[string]config.BackendConfig{"osinfodb": b}
	if w := agent.ConfigWarnings(cfg); len(w) != 1 || !strings.Contains(w[0], "backends.osinfodb.tls names files") {
		t.Errorf("a backend's tls files without enabled: warnings %q", w)
	}
	// OIDC with client certificates required (the specification's
	// example): a token alone never gets past the handshake.
	cfg.Backends = nil
	cfg.Auth.OIDC.IssuerURL = "https://auth.pilab.hu/realms/pivirt"
	if w := agent.ConfigWarnings(cfg); len(w) != 1 || !strings.Contains(w[0], "auth.oidc is set, but tls.require_client_cert is true") ||
		!strings.Contains(w[0], "set tls.require_client_cert: false") {
		t.Errorf("auth.oidc with client certificates required: warnings %q, want the tokens refused and the fix", w)
	}
	cfg.TLS.RequireClientCert = false
	if w := agent.ConfigWarnings(cfg); len(w) != 0 {
		t.Errorf("auth.oidc with client certificates optional: warnings %q, want none", w)
	}
}
