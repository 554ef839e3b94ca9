package access

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/observe"
)

// Credential is what authenticated a caller: the bearer token, or the
// client certificate chain (DER, leaf first), and the method the caller
// called at the agent it reached first.
type Credential struct {
	Token     string
	Certs     [][]byte
	Procedure string
}

type credentialKey struct{}

// withCredential records the credential of the caller of ctx, unless one
// is recorded already (a relayed call keeps its caller's).
func withCredential(ctx context.Context, c call) context.Context {
	if _, ok := ctx.Value(credentialKey{}).(Credential); ok {
		return ctx
	}
	cred := Credential{Procedure: c.procedure}
	if _, tok, ok := strings.Cut(c.authorization, " "); ok && c.authorization != "" {
		cred.Token = strings.TrimSpace(tok)
	} else if c.tls != nil {
		for _, cert := range c.tls.PeerCertificates {
			cred.Certs = append(cred.Certs, cert.Raw)
		}
	}
	return context.WithValue(ctx, credentialKey{}, cred)
}

// CredentialFrom returns the credential of the caller of ctx.
func CredentialFrom(ctx context.Context) (Credential, bool) {
	c, ok := ctx.Value(credentialKey{}).(Credential)
	return c, ok
}

// relayContext adds the caller's credential of ctx, if any, to the
// outgoing metadata of a call to another agent, in place of any such
// header already there.
func relayContext(ctx context.Context) context.Context {
	cred, ok := CredentialFrom(ctx)
	if !ok || cred.Token == "" && len(cred.Certs) == 0 {
		return ctx
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	if md == nil {
		md = metadata.MD{}
	}
	for _, h := range authz.RelayHeaders {
		delete(md, h)
	}
	if cred.Token != "" {
		md.Set(authz.CallerTokenHeader, cred.Token)
	} else {
		for _, c := range cred.Certs {
			md.Append(authz.CallerCertHeader, base64.StdEncoding.EncodeToString(c))
		}
	}
	md.Set(authz.CallerMethodHeader, cred.Procedure)
	return metadata.NewOutgoingContext(ctx, md)
}

// RelayUnaryClientInterceptor and RelayStreamClientInterceptor are the
// interceptors of the connections to other agents: a call made for a
// caller carries the caller's credential (a call the agent makes for
// itself carries none).
func RelayUnaryClientInterceptor(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return invoker(relayContext(ctx), method, req, reply, cc, opts...)
}

// RelayStreamClientInterceptor: see RelayUnaryClientInterceptor.
func RelayStreamClientInterceptor(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return streamer(relayContext(ctx), desc, cc, method, opts...)
}

// viaKey holds the identity of the agent that relayed the call of a
// context.
type viaKey struct{}

// ViaFrom returns the identity (certificate CN) of the agent that relayed
// the call of ctx, "" for a call that came from its caller directly.
func ViaFrom(ctx context.Context) string {
	v, _ := ctx.Value(viaKey{}).(string)
	return v
}

// ErrNoCaller is Relayed's answer for a call that carries no caller: the
// relaying agent calls for itself.
var ErrNoCaller = status.Error(codes.PermissionDenied, "the call carries no caller")

// relayedCacheTTL bounds how long a verified credential is taken as
// verified without checking it again (a token's own expiry comes first).
const relayedCacheTTL = 30 * time.Second

// relayedCacheMax bounds the verified credentials remembered.
const relayedCacheMax = 4096

// relayedCache remembers credentials verified recently: the certificate
// chains that verified (the roles of their CN are looked up every time)
// and the tokens with their principals.
type relayedCache struct {
	mu sync.Mutex
	m  map[[32]byte]relayedEntry
}

type relayedEntry struct {
	until time.Time
	who   authz.Principal // tokens only
}

func (c *relayedCache) get(key [32]byte, now time.Time) (relayedEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[key]
	if !ok || !now.Before(e.until) {
		return relayedEntry{}, false
	}
	return e, true
}

func (c *relayedCache) put(key [32]byte, e relayedEntry, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= relayedCacheMax {
		next := make(map[[32]byte]relayedEntry, len(c.m))
		for k, v := range c.m {
			if now.Before(v.until) && len(next) < relayedCacheMax/2 {
				next[k] = v
			}
		}
		c.m = next
	}
	c.m[key] = e
}

// Relayed authenticates the caller of a call another agent relayed to
// this one: via is the relaying agent's identity (its certificate's CN),
// header the call's metadata. It returns ctx with the caller as the
// call's authenticated principal (the guard's interceptors then apply the
// RBAC policy to it as to a caller of the API port, without a second
// rate limit or stream bound) and its credential for any further relay,
// ErrNoCaller when the call carries none, or the reason it does not
// authenticate (Unauthenticated, audit-logged naming the relaying agent).
func (g *Guard) Relayed(ctx context.Context, procedure, via, remote string, header metadata.MD) (context.Context, error) {
	tokens, certs := header.Get(authz.CallerTokenHeader), header.Get(authz.CallerCertHeader)
	if len(tokens) == 0 && len(certs) == 0 {
		return ctx, ErrNoCaller
	}
	entry := ""
	if v := header.Get(authz.CallerMethodHeader); len(v) == 1 {
		entry = v[0]
	}
	cred := Credential{Procedure: entry}
	who, err := g.relayedPrincipal(ctx, tokens, certs, &cred)
	if err != nil {
		g.denied.WithLabelValues("unauthenticated").Inc()
		observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: relayed call refused: its caller does not authenticate", "decision", "deny",
			"method", procedure, "caller_method", entry, "via", via, "remote", remote, "reason", err.Error())
		return ctx, status.Errorf(codes.Unauthenticated, "the caller %s relayed does not authenticate here: %v", via, err)
	}
	ctx = context.WithValue(ctx, credentialKey{}, cred)
	ctx = context.WithValue(ctx, viaKey{}, via)
	ctx = withPreAuth(ctx, procedure, who)
	if r, ok := observe.RequestFrom(ctx); ok {
		r.Identity = who.Identity
	}
	return authz.WithPrincipal(ctx, who), nil
}

// relayedPrincipal verifies a relayed caller's token or certificate
// chain (against the CAs of the API port's client certificates, and
// revocation) and names it as the API port would.
func (g *Guard) relayedPrincipal(ctx context.Context, tokens, certs []string, cred *Credential) (authz.Principal, error) {
	now := time.Now()
	switch {
	case len(tokens) > 1 || len(tokens) == 1 && len(certs) > 0:
		return authz.Principal{}, fmt.Errorf("the call carries more than one credential")
	case len(tokens) == 1:
		cred.Token = tokens[0]
		key := sha256.Sum256([]byte("token\x00" + tokens[0]))
		if e, ok := g.relayed.get(key, now); ok {
			return e.who, nil
		}
		who, err := g.cfg.Authenticator.Authenticate(ctx, "Bearer "+tokens[0], nil)
		if err != nil {
			return authz.Principal{}, err
		}
		until := now.Add(relayedCacheTTL)
		if !who.Expiry.IsZero() && who.Expiry.Before(until) {
			until = who.Expiry
		}
		g.relayed.put(key, relayedEntry{until: until, who: who}, now)
		return who, nil
	}
	if len(certs) > 8 {
		return authz.Principal{}, fmt.Errorf("a certificate chain of %d certificates", len(certs))
	}
	h := sha256.New()
	chain := make([]*x509.Certificate, 0, len(certs))
	for i, s := range certs {
		der, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return authz.Principal{}, fmt.Errorf("certificate %d of the chain: %w", i, err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return authz.Principal{}, fmt.Errorf("certificate %d of the chain: %w", i, err)
		}
		cred.Certs = append(cred.Certs, der)
		chain = append(chain, c)
		h.Write(der)
	}
	var key [32]byte
	h.Sum(key[:0])
	if _, ok := g.relayed.get(key, now); !ok {
		if g.cfg.VerifyClientChain == nil {
			return authz.Principal{}, fmt.Errorf("this agent does not accept client certificates")
		}
		if err := g.cfg.VerifyClientChain(chain); err != nil {
			return authz.Principal{}, fmt.Errorf("certificate %q: %w", chain[0].Subject.CommonName, err)
		}
		until := now.Add(relayedCacheTTL)
		if chain[0].NotAfter.Before(until) {
			until = chain[0].NotAfter
		}
		g.relayed.put(key, relayedEntry{until: until}, now)
	}
	return g.cfg.Authenticator.Authenticate(ctx, "", chain)
}

// AuthorizeRelayedAs checks that the caller of ctx (authenticated by
// Relayed) may call the API method procedure, the one whose work the
// relayed call does on this node (a keyring change on each node for
// ClusterService.Keyring): the policy's unconditional decision, audited.
func (g *Guard) AuthorizeRelayedAs(ctx context.Context, procedure string) error {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return status.Errorf(codes.PermissionDenied, "%s: no authenticated caller to check", procedure)
	}
	c := call{procedure: procedure, via: ViaFrom(ctx)}
	if r, ok := observe.RequestFrom(ctx); ok {
		c.requestID = r.ID
	}
	gr, err := g.decide(ctx, c, who, g.lookup(procedure), nil)
	if err == nil && gr.conditional() {
		err = g.denyGrant(c, gr, "", "the rules that allow it have conditions, which a relayed %s cannot check", procedure)
	}
	return grpcError(err)
}
