package authn

import (
	"context"
	"crypto/x509"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// Authenticator names the caller of a request: a bearer token when the
// request carries one (verified by OIDC; a bad token is refused, never
// passed over for the certificate), else the client certificate the TLS
// layer verified against the PiTrust chain.
type Authenticator struct {
	// OIDC verifies bearer tokens; nil: tokens are refused.
	OIDC Verifier
	// CertRoles gives client certificates their roles by CN: an exact
	// name, or a prefix ending in "*" ("pivirt-agent-*"). A certificate
	// matching several entries gets the roles of all.
	CertRoles map[string][]string
	// live replaces CertRoles once SetCertRoles was called.
	live atomic.Pointer[map[string][]string]
}

// SetCertRoles replaces CertRoles for the requests authenticated from now
// on (auth.certificate_roles changed live).
func (a *Authenticator) SetCertRoles(m map[string][]string) { a.live.Store(&m) }

// Authenticate returns the principal of a request from its Authorization
// header value and its verified peer certificates (leaf first).
func (a *Authenticator) Authenticate(ctx context.Context, authorization string, peer []*x509.Certificate) (authz.Principal, error) {
	if authorization != "" {
		scheme, token, ok := strings.Cut(authorization, " ")
		if !ok || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(token) == "" {
			return authz.Principal{}, fmt.Errorf("%w: the Authorization header must be \"Bearer <token>\"", ErrUnauthenticated)
		}
		if a.OIDC == nil {
			return authz.Principal{}, fmt.Errorf("%w: bearer tokens are not accepted here (auth.oidc is not configured); use a client certificate", ErrUnauthenticated)
		}
		return a.OIDC.Verify(ctx, strings.TrimSpace(token))
	}
	if len(peer) > 0 && peer[0].Subject.CommonName != "" {
		cn := peer[0].Subject.CommonName
		return authz.Principal{Identity: cn, Roles: a.certRoles(cn), Certificate: true}, nil
	}
	return authz.Principal{}, fmt.Errorf("%w: no credentials: send a bearer token (Authorization: Bearer …) or a client certificate of the PiTrust chain", ErrUnauthenticated)
}

func (a *Authenticator) certRoles(cn string) []string {
	table := a.CertRoles
	if m := a.live.Load(); m != nil {
		table = *m
	}
	return RolesFor(table, cn)
}

// RolesFor are the roles a certificate roles table (auth.certificate_roles:
// CN or CN prefix ending in "*" → roles) gives the certificate CN cn.
func RolesFor(table map[string][]string, cn string) []string {
	var out []string
	for pattern, roles := range table {
		prefix, wild := strings.CutSuffix(pattern, "*")
		if pattern == cn || wild && strings.HasPrefix(cn, prefix) {
			for _, r := range roles {
				if !slices.Contains(out, r) {
					out = append(out, r)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}
