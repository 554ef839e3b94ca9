package authn

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"strings"
	"testing"

	"github.com/go-jose/go-jose/v4"
)

func cert(cn string) []*x509.Certificate {
	return []*x509.Certificate{{Subject: pkix.Name{CommonName: cn}}}
}

func TestAuthenticate(t *testing.T) {
	is := newIssuer(t)
	k := is.NewKey(t, "k1", jose.RS256, true)
	a := &Authenticator{OIDC: newOIDC(t, is, nil), CertRoles: map[string][]string{
		"operator": {"admin"}, "pivirt-agent-*": {"agent"}, "pivirt-agent-node1": {"viewer", "agent"},
	}}
	ctx := t.Context()

	p, err := a.Authenticate(ctx, "Bearer "+k.Sign(t, is.Claims("alice", nil)), cert("operator"))
	if err != nil || p.Identity != "alice" || strings.Join(p.Roles, ",") != "admin" {
		t.Errorf("a token wins over the certificate: %+v, %v", p, err)
	}
	for cn, want := range map[string]string{"operator": "admin", "pivirt-agent-node1": "agent,viewer", "pivirt-agent-node2": "agent", "someone": ""} {
		p, err := a.Authenticate(ctx, "", cert(cn))
		if err != nil || p.Identity != cn || strings.Join(p.Roles, ",") != want {
			t.Errorf("certificate %s: %+v, %v; want roles %q", cn, p, err, want)
		}
	}
	for name, tc := range map[string]struct {
		auth string
		a    *Authenticator
		want string
	}{
		"nothing":            {"", a, "no credentials"},
		"basic auth":         {"Basic YWxpY2U6cHc=", a, `must be "Bearer <token>"`},
		"empty bearer":       {"Bearer ", a, `must be "Bearer <token>"`},
		"bad token":          {"Bearer x.y.z", a, "bearer token"},
		"tokens not enabled": {"Bearer x.y.z", &Authenticator{}, "auth.oidc is not configured"},
	} {
		t.Run(name, func(t *testing.T) {
			// A bad token is refused even with a good certificate.
			peer := cert("operator")
			if tc.want == "no credentials" {
				peer = nil
			}
			_, err := tc.a.Authenticate(ctx, tc.auth, peer)
			if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Authenticate = %v, want ErrUnauthenticated containing %q", err, tc.want)
			}
		})
	}
}
