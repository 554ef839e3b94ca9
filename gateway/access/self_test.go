package access

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/gateway/authz"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

const whoAmI = "/pivirt.cluster.v1.ClusterService/WhoAmI"

// TestSelfMethodNeedsAuthenticationNoRule: a self method (WhoAmI) is
// refused to an anonymous caller as any method is, and allowed — handler
// called, with the caller in its context — to a caller whose roles the
// policy grants nothing; the guard's explanation says so too.
func TestSelfMethodNeedsAuthenticationNoRule(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	ctx := context.Background()

	if _, _, err := g.admit(ctx, call{procedure: whoAmI}, nil); code(err) != codes.Unauthenticated {
		t.Errorf("anonymous WhoAmI: %v, want Unauthenticated", err)
	}
	if _, _, err := g.admit(ctx, call{procedure: whoAmI, authorization: "Basic abc"}, nil); code(err) != codes.Unauthenticated {
		t.Errorf("WhoAmI with a bad Authorization header: %v, want Unauthenticated", err)
	}
	// A sibling method of the same service still needs its rule.
	if _, _, err := g.admit(ctx, certCall("/pivirt.cluster.v1.ClusterService/CheckAccess", "nobody"), nil); code(err) != codes.PermissionDenied {
		t.Errorf("CheckAccess of a caller without roles: %v, want PermissionDenied", err)
	}
	actx, gr, err := g.admit(ctx, certCall(whoAmI, "nobody"), nil)
	if err != nil {
		t.Fatalf("WhoAmI of a caller without roles: %v, want it allowed", err)
	}
	if gr == nil || gr.conditional() || gr.checksRequest() || gr.filters() {
		t.Errorf("WhoAmI grant %+v: want an unconditional grant", gr)
	}
	if who, ok := authz.PrincipalFrom(actx); !ok || who.Identity != "nobody" || !who.Certificate {
		t.Errorf("principal in the handler's context: %+v %v", who, ok)
	}

	// Through the gRPC interceptor: the handler answers, and sees the caller.
	interceptor := g.UnaryServerInterceptor()
	info := &grpc.UnaryServerInfo{FullMethod: whoAmI}
	var seen authz.Principal
	handler := func(ctx context.Context, _ any) (any, error) {
		seen, _ = authz.PrincipalFrom(ctx)
		return &clusterv1.WhoAmIResponse{Identity: seen.Identity}, nil
	}
	st := tls.ConnectionState{PeerCertificates: []*x509.Certificate{{Subject: pkix.Name{CommonName: "nobody"}}}}
	pctx := peer.NewContext(ctx, &peer.Peer{AuthInfo: credentials.TLSInfo{State: st}})
	resp, err := interceptor(pctx, &clusterv1.WhoAmIRequest{}, info, handler)
	if err != nil || resp.(*clusterv1.WhoAmIResponse).GetIdentity() != "nobody" || seen.Identity != "nobody" {
		t.Errorf("WhoAmI through the interceptor: %v %v (handler saw %+v)", resp, err, seen)
	}
	seen = authz.Principal{}
	if _, err := interceptor(ctx, &clusterv1.WhoAmIRequest{}, info, handler); status.Code(err) != codes.Unauthenticated || seen.Identity != "" {
		t.Errorf("anonymous WhoAmI through the interceptor: %v (handler saw %+v), want Unauthenticated before the handler", err, seen)
	}

	e, err := g.Explain(authz.Principal{Identity: "nobody"}, whoAmI, "")
	if err != nil || e.Decision != "allowed" || !e.Allowed || e.Resource != "" || e.Verb != "" {
		t.Errorf("Explain of WhoAmI: %+v %v, want allowed with no resource or verb", e, err)
	}
	if _, err := g.Explain(authz.Principal{Identity: "nobody"}, "/pivirt.cluster.v1.ClusterService/NoSuch", ""); !errors.Is(err, ErrUnknownMethod) || !errors.Is(err, ErrCheck) {
		t.Errorf("Explain of an unknown method: %v, want ErrUnknownMethod and ErrCheck", err)
	}
}

// TestSelfMethodRateLimitedAndReady: a self method takes the caller's
// rate-limit tokens and waits for the policy in force like any other.
func TestSelfMethodRateLimitedAndReady(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{Routes: []RouteLimit{{Prefix: whoAmI, Limit: Limit{PerSecond: 0.001, Burst: 1}}}}, nil)
	ctx := context.Background()
	if _, _, err := g.admit(ctx, certCall(whoAmI, "nobody"), nil); err != nil {
		t.Fatalf("first WhoAmI: %v", err)
	}
	if _, _, err := g.admit(ctx, certCall(whoAmI, "nobody"), nil); code(err) != codes.ResourceExhausted {
		t.Errorf("second WhoAmI past the burst: %v, want ResourceExhausted", err)
	}
	g = newGuard(t, ownerPolicy, Limits{}, nil)
	g.cfg.Ready = func(context.Context) error { return errors.New("the policy in force is not known yet") }
	if _, _, err := g.admit(ctx, certCall(whoAmI, "nobody"), nil); code(err) != codes.Unavailable {
		t.Errorf("WhoAmI before the policy is known: %v, want Unavailable", err)
	}
}

// TestExplainMatchesTheGuard: a conditional grant on a method that names no
// object to check the conditions on is denied by the guard, and Explain
// (what CheckAccess and WhoAmI answer) says so; one it can check is
// conditional.
func TestExplainMatchesTheGuard(t *testing.T) {
	g := newGuard(t, ownerPolicy, Limits{}, nil)
	who := authz.Principal{Identity: "cond-1", Roles: []string{"cond"}}
	const leader = "/pivirt.cluster.v1.ClusterService/Leader"
	if _, _, err := g.admit(context.Background(), certCall(leader, "cond-1"), nil); code(err) != codes.PermissionDenied {
		t.Fatalf("the guard: %v, want PermissionDenied", err)
	}
	if e, err := g.Explain(who, leader, ""); err != nil || e.Decision != "denied" || e.Allowed || !strings.Contains(e.Detail, "names no object") {
		t.Errorf("Explain: %+v %v, want denied as the guard does", e, err)
	}
	alice := authz.Principal{Identity: "alice", Roles: []string{"vm-owner"}}
	if e, err := g.Explain(alice, "/pivirt.vm.v1.VMService/PowerOn", ""); err != nil || e.Decision != "conditional" {
		t.Errorf("Explain of alice's PowerOn: %+v %v, want conditional", e, err)
	}
}

// TestStreamEndsWhenTokenExpires: a stream opened with a bearer token ends
// when the token expires; a certificate caller's stream has no such end.
func TestStreamEndsWhenTokenExpires(t *testing.T) {
	exp := time.Now().Add(100 * time.Millisecond)
	ctx, cancel := untilExpiry(authz.WithPrincipal(t.Context(), authz.Principal{Identity: "alice", Expiry: exp}))
	defer cancel()
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stream outlived its token by 10s")
	}
	if !errors.Is(context.Cause(ctx), ErrTokenExpired) {
		t.Fatalf("cause %v, want ErrTokenExpired", context.Cause(ctx))
	}
	if time.Now().Before(exp) {
		t.Fatal("ended before the token expired")
	}
	ctx, cancel = untilExpiry(authz.WithPrincipal(t.Context(), authz.Principal{Identity: "node1-client"}))
	defer cancel()
	if _, ok := ctx.Deadline(); ok {
		t.Fatal("a certificate caller's stream got a deadline")
	}
}
