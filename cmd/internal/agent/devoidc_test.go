package agent_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity/devoidc"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// startDevIssuer serves a development OIDC issuer of a new directory on
// 127.0.0.1 until the test ends, as pitrust dev-issuer does; it returns the
// directory's key and the issuer's URL.
func startDevIssuer(t *testing.T) (devoidc.Key, string) {
	t.Helper()
	dir := t.TempDir()
	is, ln, err := devoidc.Listen(dir, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: is.Handler(), ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("dev issuer: %v", err)
		}
	})
	key, err := devoidc.LoadKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	return key, is.URL
}

// TestDevIssuerTokens: an agent whose auth.oidc names a development OIDC
// issuer (client ID devoidc.Audience, roles from the default claim) takes
// the tokens pitrust dev-token mints with the issuer's key, their roles
// deciding under the spec's RBAC policy: an admin creates, a vm-owner reads
// its own VM and neither creates nor reads another's; an expired token, a
// token of another key and one naming another issuer are refused.
func TestDevIssuerTokens(t *testing.T) {
	key, issuer := startDevIssuer(t)
	e := newAccessEnv(t, 1, func(cfg *config.Config) {
		cfg.Auth.OIDC = config.OIDCConfig{IssuerURL: issuer, ClientID: devoidc.Audience, AllowHTTPIssuer: true}
	})
	mint := func(k devoidc.Key, r devoidc.Request) string {
		t.Helper()
		if r.Issuer == "" {
			r.Issuer = issuer
		}
		raw, _, err := k.Mint(r)
		if err != nil {
			t.Fatal(err)
		}
		return raw
	}
	admin := mint(key, devoidc.Request{User: "root", Roles: []string{"admin"}})
	alice := mint(key, devoidc.Request{User: "alice", Roles: devoidc.ParseRoles("vm-owner")})

	create := func(token, owner string) (string, error) {
		r, err := e.vm.CreateVM(as(e.ctx(), token), &vmv1.CreateVMRequest{Vm: &vmv1.VM{
			Name: owner + "-vm", Vcpus: 1, MemoryMib: 256, Metadata: &apiv1.ObjectMeta{Owner: owner},
		}})
		return r.GetVm().GetId(), err
	}
	// Discovery may still be under way when the agent first answers.
	var alicesVM string
	deadline := time.Now().Add(30 * time.Second)
	for {
		var err error
		if alicesVM, err = create(admin, "alice"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("an admin's dev token: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // poll, bounded by the deadline
	}
	bobsVM, err := create(admin, "bob")
	if err != nil {
		t.Fatal(err)
	}

	if _, err := e.vm.GetVM(as(e.ctx(), alice), &vmv1.GetVMRequest{Id: alicesVM}); err != nil {
		t.Errorf("a vm-owner's dev token, GetVM of its own VM: %v", err)
	}
	if _, err := e.vm.GetVM(as(e.ctx(), alice), &vmv1.GetVMRequest{Id: bobsVM}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a vm-owner's dev token, GetVM of bob's VM: %v, want PermissionDenied", err)
	}
	if _, err := create(alice, "alice"); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "alice (roles vm-owner) may not create virtualmachines") {
		t.Errorf("a vm-owner's dev token, CreateVM: %v, want PermissionDenied naming alice and her role", err)
	}
	list, err := e.vm.ListVMs(as(e.ctx(), alice), &vmv1.ListVMsRequest{})
	if err != nil || len(list.GetVms()) != 1 || list.GetVms()[0].GetId() != alicesVM {
		t.Errorf("a vm-owner's dev token, ListVMs: %v, %v; want alice's VM alone", list.GetVms(), err)
	}

	other, _ := startDevIssuer(t)
	for name, tok := range map[string]string{
		"expired":        mint(key, devoidc.Request{User: "root", Roles: []string{"admin"}, TTL: time.Minute, Now: time.Now().Add(-time.Hour)}),
		"another key":    mint(other, devoidc.Request{User: "root", Roles: []string{"admin"}}),
		"another issuer": mint(key, devoidc.Request{Issuer: "http://127.0.0.1:1", User: "root", Roles: []string{"admin"}}),
	} {
		if _, err := e.vm.ListVMs(as(e.ctx(), tok), &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s token: %v, want Unauthenticated", name, err)
		}
	}
}
