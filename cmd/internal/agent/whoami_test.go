package agent_test

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// TestAccessWhoAmI: through a real agent enforcing the reference policy, a
// vm-owner's token caller — who may not ask CheckAccess — learns its
// identity, roles and token expiry and what it may call, over gRPC and
// over Connect with JSON (a browser's way); a certificate caller is
// answered with the roles auth.certificate_roles gives it (ops-viewer: operator and viewer); a caller
// without credentials is refused.
func TestAccessWhoAmI(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	exp := time.Now().Add(30 * time.Minute).Truncate(time.Second)
	alice := e.key.Sign(t, e.is.Claims("alice", func(c map[string]any) { c["roles"] = []string{"vm-owner"}; c["exp"] = exp.Unix() }))
	methods := []string{"VMService/PowerOn", "ClusterService/SetConfig", "ClusterService/WhoAmI", "NetworkService/ListNetworks"}
	wantAccess := map[string]string{
		"/pivirt.vm.v1.VMService/PowerOn":                "conditional",
		"/pivirt.cluster.v1.ClusterService/SetConfig":    "denied",
		"/pivirt.cluster.v1.ClusterService/WhoAmI":       "allowed",
		"/pivirt.network.v1.NetworkService/ListNetworks": "denied",
	}
	checkAlice := func(how string, r *clusterv1.WhoAmIResponse) {
		t.Helper()
		if r.GetIdentity() != "alice" || !slices.Equal(r.GetRoles(), []string{"vm-owner"}) || r.GetAuthenticatedBy() != "token" ||
			!r.GetTokenExpiry().AsTime().Equal(exp) || r.GetNode() != e.n.Name || r.GetSource() != "file" {
			t.Errorf("%s: %v", how, r)
		}
		got := map[string]string{}
		for _, a := range r.GetAccess() {
			got[a.GetMethod()] = a.GetDecision()
		}
		for m, want := range wantAccess {
			if got[m] != want {
				t.Errorf("%s: %s is %q, want %q", how, m, got[m], want)
			}
		}
	}

	if _, err := e.cl.CheckAccess(as(e.ctx(), alice), &clusterv1.CheckAccessRequest{Identity: "alice", Roles: []string{"vm-owner"}, Method: "VMService/PowerOn"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("alice's CheckAccess: %v, want PermissionDenied (it needs get on rbac)", err)
	}
	r, err := e.cl.WhoAmI(as(e.ctx(), alice), &clusterv1.WhoAmIRequest{Methods: methods})
	if err != nil {
		t.Fatalf("alice's WhoAmI over gRPC: %v", err)
	}
	checkAlice("gRPC", r)
	all, err := e.cl.WhoAmI(as(e.ctx(), alice), &clusterv1.WhoAmIRequest{})
	if err != nil || len(all.GetAccess()) < 60 {
		t.Errorf("alice's WhoAmI of every method: %d answered, %v", len(all.GetAccess()), err)
	}

	chain := filepath.Join(e.dir, identity.ChainFile)
	web := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, nil), "https://"+e.n.APIAddr(), connect.WithProtoJSON())
	req := connect.NewRequest(&clusterv1.WhoAmIRequest{Methods: methods})
	req.Header().Set("Authorization", "Bearer "+alice)
	cr, err := web.WhoAmI(e.ctx(), req)
	if err != nil {
		t.Fatalf("alice's WhoAmI over Connect JSON: %v", err)
	}
	checkAlice("Connect JSON", cr.Msg)
	if _, err := web.WhoAmI(e.ctx(), connect.NewRequest(&clusterv1.WhoAmIRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("WhoAmI without credentials: %v, want Unauthenticated", err)
	}
	req = connect.NewRequest(&clusterv1.WhoAmIRequest{Methods: []string{"VMService/NoSuch"}})
	req.Header().Set("Authorization", "Bearer "+alice)
	if _, err := web.WhoAmI(e.ctx(), req); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("WhoAmI of an unknown method: %v, want InvalidArgument", err)
	}

	viewer := clusterv1.NewClusterServiceClient(e.dial(e.clientCert("ops-viewer")))
	r, err = viewer.WhoAmI(e.ctx(), &clusterv1.WhoAmIRequest{Methods: []string{"VMService/ListVMs", "VMService/DeleteVM"}})
	if err != nil {
		t.Fatalf("certificate WhoAmI: %v", err)
	}
	if r.GetIdentity() != "ops-viewer" || !slices.Equal(r.GetRoles(), []string{"operator", "viewer"}) || r.GetAuthenticatedBy() != "certificate" || r.GetTokenExpiry() != nil ||
		len(r.GetAccess()) != 2 || r.GetAccess()[0].GetDecision() != "allowed" || r.GetAccess()[1].GetDecision() != "denied" {
		t.Errorf("certificate WhoAmI: %v", r)
	}
}
