package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// whoAmIServices are the services of the API port, as the agent gives
// them.
var whoAmIServices = []protoreflect.ServiceDescriptor{
	clusterv1.File_pivirt_cluster_v1_cluster_proto.Services().ByName("ClusterService"),
	clusterv1.File_pivirt_cluster_v1_snapshot_proto.Services().ByName("SnapshotService"),
	schedulev1.File_pivirt_schedule_v1_service_proto.Services().ByName("ScheduleService"),
	clusterv1.File_pivirt_cluster_v1_agent_proto.Services().ByName("AgentService"),
	vmv1.File_pivirt_vm_v1_vm_proto.Services().ByName("VMService"),
	storagev1.File_pivirt_storage_v1_storage_proto.Services().ByName("StorageService"),
	networkv1.File_pivirt_network_v1_network_proto.Services().ByName("NetworkService"),
}

// newWhoAmIService is the ClusterService of node "node1" answering WhoAmI
// from a guard enforcing the reference RBAC policy (admin, operator,
// viewer, vm-owner); the certificate CN "ops" has the role admin.
func newWhoAmIService(t *testing.T) (*ClusterService, *access.Guard) {
	t.Helper()
	f, err := os.Open(filepath.Join("authz", "testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p, err := authz.Parse(f, append(authz.Resources(whoAmIServices...), RBACResource))
	if err != nil {
		t.Fatal(err)
	}
	g, err := access.New(access.Config{
		Authenticator: &authn.Authenticator{CertRoles: map[string][]string{"ops": {"admin"}}},
		Policy:        func() *authz.Policy { return p },
		ConnState:     ConnTLSFromContext,
	})
	if err != nil {
		t.Fatal(err)
	}
	h, _ := newTestService(t, "node1", followerRaft{}, nil, &followerView{})
	h.cfg.Explain, h.cfg.APIServices = g.Explain, whoAmIServices
	h.cfg.PolicySource = func() string { return "file" }
	return h, g
}

func whoAmI(ctx context.Context, h *ClusterService, methods ...string) (*clusterv1.WhoAmIResponse, error) {
	resp, err := h.WhoAmI(ctx, connect.NewRequest(&clusterv1.WhoAmIRequest{Methods: methods}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// decisions maps the full method names of an answer to their decisions.
func decisions(r *clusterv1.WhoAmIResponse) map[string]string {
	out := map[string]string{}
	for _, a := range r.GetAccess() {
		out[a.GetMethod()] = a.GetDecision()
	}
	return out
}

// TestWhoAmIDecisions: a vm-owner's token caller learns who it is and the
// guard's decisions (conditional on its VMs, denied elsewhere, allowed for
// WhoAmI itself); an admin is allowed everything; without a name every
// method of the API is answered, sorted.
func TestWhoAmIDecisions(t *testing.T) {
	h, _ := newWhoAmIService(t)
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	alice := authz.WithPrincipal(t.Context(), authz.Principal{Identity: "alice", Roles: []string{"vm-owner"}, Expiry: exp})

	r, err := whoAmI(alice, h, "VMService/PowerOn", "/pivirt.cluster.v1.ClusterService/SetConfig", "pivirt.cluster.v1.ClusterService/WhoAmI", "VMService/GetVM")
	if err != nil {
		t.Fatal(err)
	}
	if r.GetIdentity() != "alice" || !slices.Equal(r.GetRoles(), []string{"vm-owner"}) || r.GetAuthenticatedBy() != "token" ||
		!r.GetTokenExpiry().AsTime().Equal(exp) || r.GetNode() != "node1" || r.GetSource() != "file" {
		t.Errorf("alice's answer: %v", r)
	}
	want := []*clusterv1.MethodAccess{
		{Method: "/pivirt.vm.v1.VMService/PowerOn", Resource: "virtualmachines", Verb: "start", Decision: "conditional"},
		{Method: "/pivirt.cluster.v1.ClusterService/SetConfig", Resource: "config", Verb: "update", Decision: "denied"},
		{Method: "/pivirt.cluster.v1.ClusterService/WhoAmI", Decision: "allowed"},
		{Method: "/pivirt.vm.v1.VMService/GetVM", Resource: "virtualmachines", Verb: "get", Decision: "conditional"},
	}
	if len(r.GetAccess()) != len(want) {
		t.Fatalf("alice's access: %v, want %v", r.GetAccess(), want)
	}
	for i, w := range want {
		if got := r.GetAccess()[i]; got.GetMethod() != w.GetMethod() || got.GetResource() != w.GetResource() || got.GetVerb() != w.GetVerb() || got.GetDecision() != w.GetDecision() {
			t.Errorf("alice's access[%d] = %v, want %v", i, got, w)
		}
	}

	all, err := whoAmI(alice, h)
	if err != nil {
		t.Fatal(err)
	}
	names := MethodNames(whoAmIServices)
	got := make([]string, 0, len(all.GetAccess()))
	for _, a := range all.GetAccess() {
		got = append(got, a.GetMethod())
	}
	if len(names) < 60 || !slices.Equal(got, names) || !slices.IsSorted(got) {
		t.Errorf("every method: %d answered, want the %d of the API, sorted", len(got), len(names))
	}
	d := decisions(all)
	for m, want := range map[string]string{
		"/pivirt.vm.v1.VMService/PowerOn":                "conditional",
		"/pivirt.vm.v1.VMService/CreateVM":               "denied",
		"/pivirt.network.v1.NetworkService/ListNetworks": "denied",
		"/pivirt.cluster.v1.ClusterService/SetConfig":    "denied",
		"/pivirt.cluster.v1.ClusterService/CheckAccess":  "denied",
		"/pivirt.cluster.v1.ClusterService/WhoAmI":       "allowed",
	} {
		if d[m] != want {
			t.Errorf("alice: %s is %q, want %q", m, d[m], want)
		}
	}

	admin := authz.WithPrincipal(t.Context(), authz.Principal{Identity: "root", Roles: []string{"admin"}})
	r, err = whoAmI(admin, h)
	if err != nil {
		t.Fatal(err)
	}
	for m, dec := range decisions(r) {
		if dec != "allowed" {
			t.Errorf("admin: %s is %q, want allowed", m, dec)
		}
	}
	if r.GetTokenExpiry() != nil || r.GetAuthenticatedBy() != "token" {
		t.Errorf("a token without exp: %v", r)
	}

	viewer := authz.WithPrincipal(t.Context(), authz.Principal{Identity: "vera", Roles: []string{"viewer"}})
	if r, err = whoAmI(viewer, h, "VMService/ListVMs", "VMService/DeleteVM"); err != nil || decisions(r)["/pivirt.vm.v1.VMService/ListVMs"] != "allowed" || decisions(r)["/pivirt.vm.v1.VMService/DeleteVM"] != "denied" {
		t.Errorf("viewer: %v %v", r, err)
	}
}

// TestWhoAmIRefuses: an unknown method or service is InvalidArgument
// naming it; a call without an authenticated caller is Unauthenticated.
func TestWhoAmIRefuses(t *testing.T) {
	h, _ := newWhoAmIService(t)
	alice := authz.WithPrincipal(t.Context(), authz.Principal{Identity: "alice", Roles: []string{"vm-owner"}})
	for name, methods := range map[string][]string{
		"VMService/Reboot2":                   {"VMService/PowerOn", "VMService/Reboot2"},
		"NoSuchService":                       {"NoSuchService/Get"},
		"pivirt.nope.v1.NopeService/Get":      {"pivirt.nope.v1.NopeService/Get"},
		"want Service/Method":                 {"PowerOn"},
		`methods[0]: "": want Service/Method`: {""},
	} {
		_, err := whoAmI(alice, h, methods...)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), name) {
			t.Errorf("methods %q: %v, want InvalidArgument naming %s", methods, err, name)
		}
	}
	many := make([]string, len(MethodNames(h.cfg.APIServices))+1)
	for i := range many {
		many[i] = "VMService/PowerOn"
	}
	if _, err := whoAmI(alice, h, many...); connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "at most") {
		t.Errorf("%d names: %v, want InvalidArgument: at most the API's methods", len(many), err)
	}
	if _, err := whoAmI(t.Context(), h); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("no caller: %v, want Unauthenticated", err)
	}
	h.cfg.Explain = nil
	if _, err := whoAmI(alice, h); connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("no access control: %v, want Unimplemented", err)
	}
}

// TestWhoAmICertificateCaller: over real TLS, through the guard on both
// Connect and gRPC, a client certificate's holder is answered with its CN,
// the roles auth.certificate_roles gives it and no token expiry; a caller
// without credentials is refused by the guard.
func TestWhoAmICertificateCaller(t *testing.T) {
	h, g := newWhoAmIService(t)
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "api", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	ops, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: srv.Cert, KeyFile: srv.Key, CAFile: filepath.Join(dir, identity.ChainFile)})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pm := NewProtocolMux(tls.NewListener(raw, src.ServerConfig(tls.VerifyClientCertIfGiven, nil)), 5*time.Second)
	gs := grpc.NewServer(grpc.Creds(PeerTLSCredentials{}), grpc.UnaryInterceptor(g.UnaryServerInterceptor()))
	clusterv1.RegisterClusterServiceServer(gs, NewClusterGRPC(h))
	mux := http.NewServeMux()
	mux.Handle(clusterv1connect.NewClusterServiceHandler(h, connect.WithInterceptors(g.ConnectInterceptor())))
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	hs := &http.Server{Protocols: &protos, ReadHeaderTimeout: 5 * time.Second, ConnContext: WithConnTLS, Handler: mux}
	go func() { _ = gs.Serve(pm.GRPC) }()
	go func() { _ = hs.Serve(pm.HTTP) }()
	go func() { _ = pm.Serve() }()
	defer func() { gs.Stop(); _ = hs.Close(); _ = raw.Close() }()

	roots := x509.NewCertPool()
	cas, err := identity.ReadCertificates(filepath.Join(dir, identity.ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cas {
		roots.AddCert(c)
	}
	pair, err := tls.LoadX509KeyPair(ops.Cert, ops.Key)
	if err != nil {
		t.Fatal(err)
	}
	withCert := &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	anonymous := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	check := func(how string, r *clusterv1.WhoAmIResponse, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if r.GetIdentity() != "ops" || !slices.Equal(r.GetRoles(), []string{"admin"}) || r.GetAuthenticatedBy() != "certificate" || r.GetTokenExpiry() != nil || r.GetNode() != "node1" {
			t.Errorf("%s: %v", how, r)
		}
		if d := decisions(r); len(d) != 1 || d["/pivirt.cluster.v1.ClusterService/SetConfig"] != "allowed" {
			t.Errorf("%s: access %v", how, r.GetAccess())
		}
	}
	req := &clusterv1.WhoAmIRequest{Methods: []string{"ClusterService/SetConfig"}}

	for name, cfg := range map[string]*tls.Config{"certificate": withCert, "anonymous": anonymous} {
		tr := &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
		cl := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: tr}, "https://"+raw.Addr().String())
		resp, err := cl.WhoAmI(ctx, connect.NewRequest(req))
		if name == "anonymous" {
			if connect.CodeOf(err) != connect.CodeUnauthenticated {
				t.Errorf("Connect without credentials: %v, want Unauthenticated", err)
			}
		} else if err != nil {
			t.Fatalf("Connect: %v", err)
		} else {
			check("Connect", resp.Msg, nil)
		}

		conn, err := grpc.NewClient(raw.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		r, err := clusterv1.NewClusterServiceClient(conn).WhoAmI(ctx, req)
		if name == "anonymous" {
			if status.Code(err) != codes.Unauthenticated {
				t.Errorf("gRPC without credentials: %v, want Unauthenticated", err)
			}
			continue
		}
		check("gRPC", r, err)
	}
}
