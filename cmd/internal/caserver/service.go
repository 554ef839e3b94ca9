package caserver

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// maxLimiters bounds the table of per-caller rate limiters; when full, the
// limiters of callers that are back to a full bucket are dropped.
const maxLimiters = 10000

// caller is who sent a request, as the TLS layer authenticated it.
type caller struct {
	// cn is the verified client certificate's CN; empty without one.
	cn string
	// ip is the client's address.
	ip string
	// serial is the client certificate's serial; nil without one.
	serial *big.Int
}

func (c caller) String() string {
	if c.cn != "" {
		return c.cn
	}
	return "ip " + c.ip
}

type callerKey struct{}

// withCaller puts the request's caller into its context: the CN of the
// client certificate (verified by the TLS layer against the CA chain, if
// one was given) and the client's IP.
func withCaller(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var c caller
		c.ip, _, _ = net.SplitHostPort(r.RemoteAddr)
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			c.cn = r.TLS.PeerCertificates[0].Subject.CommonName
			c.serial = r.TLS.PeerCertificates[0].SerialNumber
		}
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, c)))
	})
}

func callerOf(ctx context.Context) caller {
	c, _ := ctx.Value(callerKey{}).(caller)
	return c
}

// service implements pitrustv1connect.CertificateServiceHandler over a CA.
type service struct {
	ca     *castore.CA
	roles  map[string][]string
	policy PolicyConfig
	logger *slog.Logger
	limit  rate.Limit
	burst  int

	mu       sync.Mutex
	limiters map[string]*rate.Limiter
	// overflow is shared by the callers that find limiters full.
	overflow *rate.Limiter
}

var _ pitrustv1connect.CertificateServiceHandler = (*service)(nil)

func newService(ca *castore.CA, cfg *Config, logger *slog.Logger) *service {
	return &service{
		ca: ca, roles: cfg.Auth.CertificateRoles, policy: cfg.Policy, logger: logger,
		limit: rate.Limit(float64(cfg.RateLimit.IssuePerMinute) / 60), burst: cfg.RateLimit.Burst,
		limiters: map[string]*rate.Limiter{},
	}
}

// limiter is the rate limiter of one caller key.
func (s *service) limiter(key string) *rate.Limiter {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.limiters[key]
	if l == nil {
		if len(s.limiters) >= maxLimiters {
			for k, old := range s.limiters {
				if old.Tokens() >= float64(s.burst) {
					delete(s.limiters, k)
				}
			}
		}
		if len(s.limiters) >= maxLimiters {
			// Still full (a flood of addresses): the newcomers share one
			// limiter, so the table stays bounded and they stay limited.
			if s.overflow == nil {
				s.overflow = rate.NewLimiter(s.limit, s.burst)
			}
			return s.overflow
		}
		l = rate.NewLimiter(s.limit, s.burst)
		s.limiters[key] = l
	}
	return l
}

// refuse logs an audit line for a refusal and returns err.
func (s *service) refuse(ctx context.Context, method string, err *connect.Error) *connect.Error {
	s.logger.Info("audit", "event", "refuse", "caller", callerOf(ctx).String(), "method", method,
		"code", err.Code().String(), "reason", err.Message())
	return err
}

// isAdmin reports whether the caller's certificate has the admin role.
func (s *service) isAdmin(c caller) bool {
	return c.cn != "" && slices.Contains(authn.RolesFor(s.roles, c.cn), AdminRole)
}

// requireAdmin refuses a caller without the admin role.
func (s *service) requireAdmin(ctx context.Context, method string) *connect.Error {
	c := callerOf(ctx)
	if c.cn == "" {
		return s.refuse(ctx, method, connect.NewError(connect.CodeUnauthenticated,
			fmt.Errorf("%s needs a client certificate with the %s role (auth.certificate_roles)", method, AdminRole)))
	}
	if !s.isAdmin(c) {
		return s.refuse(ctx, method, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("certificate %q does not have the %s role (auth.certificate_roles)", c.cn, AdminRole)))
	}
	// The inventory decides at once, before any CRL is fetched: a revoked
	// operator certificate has no power here from the moment of its
	// revocation.
	if revoked, at, reason := s.ca.IsRevoked(c.serial); revoked {
		return s.refuse(ctx, method, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("certificate %q (serial %s) was revoked at %s (%s): ask an operator for a new one",
				c.cn, identity.SerialHex(c.serial), at.UTC().Format(time.RFC3339), reason)))
	}
	if _, err := s.ca.Get(identity.SerialHex(c.serial)); errors.Is(err, castore.ErrNotFound) {
		s.logger.Warn("an admin certificate not in the inventory: it cannot be revoked; issue admin certificates through the server or with pitrust issue-mtls-client --db",
			"caller", c.cn, "serial", identity.SerialHex(c.serial))
	}
	return nil
}

// codeOf maps an error of the CA to a Connect error.
func (s *service) codeOf(ctx context.Context, method string, err error, refused connect.Code) *connect.Error {
	var code connect.Code
	switch {
	case errors.Is(err, castore.ErrTokenInvalid):
		code = connect.CodeUnauthenticated
	case errors.Is(err, castore.ErrNotFound):
		code = connect.CodeNotFound
	case errors.Is(err, identity.ErrRenewalRefused):
		code = connect.CodePermissionDenied
	case errors.Is(err, identity.ErrInvalidRequest), errors.Is(err, castore.ErrRefused):
		code = refused
	default:
		s.logger.Error("request failed", "method", method, "caller", callerOf(ctx).String(), "error", err)
		return connect.NewError(connect.CodeInternal, fmt.Errorf("%s failed: %w", method, err))
	}
	return s.refuse(ctx, method, connect.NewError(code, err))
}

// IssueCertificate signs a CSR for an operator or a bootstrap token holder.
func (s *service) IssueCertificate(ctx context.Context, req *connect.Request[pitrustv1.IssueCertificateRequest]) (*connect.Response[pitrustv1.IssueCertificateResponse], error) {
	const method = "IssueCertificate"
	m := req.Msg
	c := callerOf(ctx)
	want, err := grantOf(m.GetKind(), m.GetUsages(), m.GetName(), m.GetDnsNames(), m.GetIpAddresses(), m.GetDays(), m.GetCluster())
	if err == nil && m.GetLifetime() != nil {
		want.Validity, err = lifetimeOf(m.GetLifetime())
	}
	if err != nil {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument, err))
	}
	// A request that cannot succeed is refused before a token is used.
	if _, err := castore.ParseCSR(m.GetCsr()); err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
	}
	var g castore.Grant
	var issuedBy string
	if m.GetBootstrapToken() != "" {
		// Only failed attempts count against a client address: a token
		// holder gets one certificate anyway, a guesser is slowed down.
		lim := s.limiter("ip " + c.ip)
		if lim.Tokens() < 1 {
			return nil, s.refuse(ctx, method, connect.NewError(connect.CodeResourceExhausted,
				errors.New("too many failed token attempts from this address: wait a minute")))
		}
		g, issuedBy, err = s.redeem(m.GetBootstrapToken(), want)
		if err != nil {
			lim.Allow()
			if errors.Is(err, errWider) {
				return nil, s.refuse(ctx, method, connect.NewError(connect.CodePermissionDenied, err))
			}
			return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
		}
	} else {
		if err := s.requireAdmin(ctx, method); err != nil {
			return nil, err
		}
		if !s.limiter("cn " + c.cn).Allow() {
			return nil, s.refuse(ctx, method, connect.NewError(connect.CodeResourceExhausted,
				fmt.Errorf("rate limit: more than %d issuances at once or above the rate limit (rate_limit)", s.burst)))
		}
		if want.Name == "" {
			return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument, errors.New("name is required: the certificate's CN")))
		}
		if want.Kind == "" {
			want.Kind = identity.KindClient
		}
		g, issuedBy = want, c.cn
	}
	certPEM, rec, err := s.ca.Issue(m.GetCsr(), g, issuedBy)
	if err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
	}
	return connect.NewResponse(&pitrustv1.IssueCertificateResponse{
		CertPem: certPEM, CaChainPem: s.ca.CAChainPEM(), Certificate: CertificateOf(rec),
	}), nil
}

// errWider: a token request names something its token does not grant.
var errWider = errors.New("the request asks for more than the bootstrap token grants")

// redeem checks want against the token's grant and uses the token: the
// grant with want's narrowing. A request that asks more than its token
// grants is refused before the token is used, so that the holder can try
// again with a correct request.
func (s *service) redeem(secret string, want castore.Grant) (castore.Grant, string, error) {
	g, _, err := s.ca.LookupToken(secret)
	if err != nil {
		return castore.Grant{}, "", err
	}
	if _, err := narrow(g, want, s.policy.DefaultDays); err != nil {
		return castore.Grant{}, "", err
	}
	g, id, err := s.ca.RedeemToken(secret)
	if err != nil {
		return castore.Grant{}, "", err
	}
	out, err := narrow(g, want, s.policy.DefaultDays)
	if err != nil {
		return castore.Grant{}, "", err
	}
	return out, "token " + id, nil
}

// narrow is the grant g restricted to what want asks: want's empty parts
// take g's, and anything want names must be within g.
func narrow(g, want castore.Grant, defaultDays int) (castore.Grant, error) {
	out := g
	if want.Kind != "" && want.Kind != g.Kind {
		return out, fmt.Errorf("%w: kind %s (the token grants %s)", errWider, want.Kind, g.Kind)
	}
	if want.Name != "" && want.Name != g.Name {
		return out, fmt.Errorf("%w: name %q (the token grants %q)", errWider, want.Name, g.Name)
	}
	if want.Cluster != "" && want.Cluster != g.Cluster {
		return out, fmt.Errorf("%w: cluster %q (the token grants %q)", errWider, want.Cluster, g.Cluster)
	}
	if len(want.DNS) > 0 {
		for _, d := range want.DNS {
			if !slices.Contains(g.DNS, d) {
				return out, fmt.Errorf("%w: dns name %q (the token grants %v)", errWider, d, g.DNS)
			}
		}
		out.DNS = want.DNS
	}
	if len(want.IPs) > 0 {
		for _, ip := range want.IPs {
			if !slices.ContainsFunc(g.IPs, ip.Equal) {
				return out, fmt.Errorf("%w: ip address %s (the token grants %v)", errWider, ip, g.IPs)
			}
		}
		out.IPs = want.IPs
	}
	if len(want.Usages) > 0 {
		granted := g.Usages
		if len(granted) == 0 {
			granted = []identity.Usage{kindUsage(g.Kind)}
		}
		for _, u := range want.Usages {
			if !slices.Contains(granted, u) {
				return out, fmt.Errorf("%w: usage %s (the token grants %v)", errWider, u, granted)
			}
		}
		out.Usages = want.Usages
	}
	if want.Days > 0 {
		limit := g.Days
		if limit == 0 {
			limit = defaultDays
		}
		if want.Days > limit {
			return out, fmt.Errorf("%w: %d days (the token grants %d)", errWider, want.Days, limit)
		}
		out.Days = want.Days
	}
	if want.Validity > 0 {
		limit := g.Days
		if limit == 0 {
			limit = defaultDays
		}
		if g.Validity > 0 {
			if want.Validity > g.Validity {
				return out, fmt.Errorf("%w: lifetime %s (the token grants %s)", errWider, want.Validity, g.Validity)
			}
		} else if want.Validity > time.Duration(limit)*24*time.Hour {
			return out, fmt.Errorf("%w: lifetime %s (the token grants %d days)", errWider, want.Validity, limit)
		}
		out.Validity = want.Validity
	}
	return out, nil
}

// lifetimeOf checks a request's lifetime.
func lifetimeOf(d *durationpb.Duration) (time.Duration, error) {
	if err := d.CheckValid(); err != nil {
		return 0, fmt.Errorf("lifetime: %w", err)
	}
	v := d.AsDuration()
	if v < time.Minute {
		return 0, fmt.Errorf("lifetime %s: at least 1m (or leave it out and give days)", v)
	}
	return v, nil
}

func kindUsage(k identity.Kind) identity.Usage {
	if k == identity.KindClient {
		return identity.UsageClient
	}
	return identity.UsageServer
}

// grantOf parses a request's names, kind and usages.
func grantOf(kind string, usages []string, name string, dns, ips []string, days int32, cluster string) (castore.Grant, error) {
	g := castore.Grant{Name: name, DNS: dns, Days: int(days), Cluster: cluster}
	switch identity.Kind(kind) {
	case "", identity.KindServer, identity.KindClient:
		g.Kind = identity.Kind(kind)
	default:
		return g, fmt.Errorf("kind %q: want %s or %s", kind, identity.KindServer, identity.KindClient)
	}
	for _, u := range usages {
		if u != string(identity.UsageServer) && u != string(identity.UsageClient) {
			return g, fmt.Errorf("usage %q: want server or client", u)
		}
		g.Usages = append(g.Usages, identity.Usage(u))
	}
	for _, s := range ips {
		ip := net.ParseIP(s)
		if ip == nil {
			return g, fmt.Errorf("ip address %q is not an IP address", s)
		}
		g.IPs = append(g.IPs, ip)
	}
	if days < 0 {
		return g, fmt.Errorf("days %d: must not be negative (0: the server's default)", days)
	}
	return g, nil
}

// RenewCertificate renews a certificate whose key the caller proves to
// hold; no role is needed.
func (s *service) RenewCertificate(ctx context.Context, req *connect.Request[pitrustv1.RenewCertificateRequest]) (*connect.Response[pitrustv1.RenewCertificateResponse], error) {
	const method = "RenewCertificate"
	c := callerOf(ctx)
	key := "ip " + c.ip
	if c.cn != "" {
		key = "cn " + c.cn
	}
	if !s.limiter(key).Allow() {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeResourceExhausted,
			errors.New("rate limit: too many renewals: wait a minute")))
	}
	m := req.Msg
	certPEM, rec, err := s.ca.Renew(identity.RenewalRequest{CSR: m.GetCsr(), Current: m.GetCurrent(), Proof: m.GetProof()})
	if err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodePermissionDenied)
	}
	return connect.NewResponse(&pitrustv1.RenewCertificateResponse{CertPem: certPEM, Certificate: CertificateOf(rec)}), nil
}

// RevokeCertificate revokes by serial or name.
func (s *service) RevokeCertificate(ctx context.Context, req *connect.Request[pitrustv1.RevokeCertificateRequest]) (*connect.Response[pitrustv1.RevokeCertificateResponse], error) {
	const method = "RevokeCertificate"
	if err := s.requireAdmin(ctx, method); err != nil {
		return nil, err
	}
	m := req.Msg
	if (m.GetSerial() == "") == (m.GetName() == "") {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument, errors.New("give a serial or a name, not both")))
	}
	recs, err := s.ca.Revoke(m.GetSerial(), m.GetName(), m.GetReason())
	if err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
	}
	s.logger.Info("audit", "event", "revoke-request", "caller", callerOf(ctx).String(), "serial", m.GetSerial(),
		"name", m.GetName(), "reason", m.GetReason(), "revoked", len(recs))
	out := &pitrustv1.RevokeCertificateResponse{}
	for _, r := range recs {
		out.Revoked = append(out.Revoked, CertificateOf(r))
	}
	return connect.NewResponse(out), nil
}

// ListCertificates lists the inventory.
func (s *service) ListCertificates(ctx context.Context, req *connect.Request[pitrustv1.ListCertificatesRequest]) (*connect.Response[pitrustv1.ListCertificatesResponse], error) {
	const method = "ListCertificates"
	if err := s.requireAdmin(ctx, method); err != nil {
		return nil, err
	}
	switch st := req.Msg.GetStatus(); st {
	case "", "valid", "revoked", "expired":
	default:
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument,
			fmt.Errorf("status %q: want valid, revoked or expired (or nothing for all)", st)))
	}
	recs, err := s.ca.List(req.Msg.GetStatus(), req.Msg.GetName())
	if err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
	}
	out := &pitrustv1.ListCertificatesResponse{}
	for _, r := range recs {
		out.Certificates = append(out.Certificates, CertificateOf(r))
	}
	return connect.NewResponse(out), nil
}

// CreateBootstrapToken makes a one-time token.
func (s *service) CreateBootstrapToken(ctx context.Context, req *connect.Request[pitrustv1.CreateBootstrapTokenRequest]) (*connect.Response[pitrustv1.CreateBootstrapTokenResponse], error) {
	const method = "CreateBootstrapToken"
	if err := s.requireAdmin(ctx, method); err != nil {
		return nil, err
	}
	m := req.Msg
	g, err := grantOf(m.GetKind(), m.GetUsages(), m.GetName(), m.GetDnsNames(), m.GetIpAddresses(), m.GetDays(), m.GetCluster())
	if err != nil {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument, err))
	}
	if g.Name == "" {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument, errors.New("name is required: the CN the token grants")))
	}
	if g.Kind == "" {
		g.Kind = identity.KindClient
		if len(g.DNS) > 0 || len(g.IPs) > 0 {
			g.Kind = identity.KindServer
		}
	}
	ttl := castore.DefaultTokenTTL
	if m.GetTtl() != nil {
		ttl = m.GetTtl().AsDuration()
	}
	if ttl <= 0 || ttl > castore.MaxTokenTTL {
		return nil, s.refuse(ctx, method, connect.NewError(connect.CodeInvalidArgument,
			fmt.Errorf("ttl %s: want more than 0 and at most %s", ttl, castore.MaxTokenTTL)))
	}
	secret, id, expires, err := s.ca.CreateToken(g, ttl)
	if err != nil {
		return nil, s.codeOf(ctx, method, err, connect.CodeInvalidArgument)
	}
	s.logger.Info("audit", "event", "token-request", "caller", callerOf(ctx).String(), "id", id, "name", g.Name,
		"expires", expires.UTC().Format(time.RFC3339))
	return connect.NewResponse(&pitrustv1.CreateBootstrapTokenResponse{Token: secret, Id: id, ExpiresAt: timestamppb.New(expires)}), nil
}

// CertificateOf is an inventory record as the API answers it.
func CertificateOf(r castore.Record) *pitrustv1.Certificate {
	c := &pitrustv1.Certificate{
		Serial: r.Serial, Subject: r.Subject, Name: r.Name, Kind: string(r.Kind),
		DnsNames: r.DNSNames, IpAddresses: r.IPs,
		NotBefore: timestamppb.New(r.NotBefore), NotAfter: timestamppb.New(r.NotAfter),
		Status: r.StatusAt(time.Now()), RevocationReason: r.Reason, IssuedBy: r.IssuedBy, CertPem: r.CertPEM,
	}
	for _, u := range r.Usages {
		c.Usages = append(c.Usages, string(u))
	}
	if !r.RevokedAt.IsZero() {
		c.RevokedAt = timestamppb.New(r.RevokedAt)
	}
	if b, _ := pem.Decode(r.CertPEM); b != nil {
		if cert, err := x509.ParseCertificate(b.Bytes); err == nil {
			c.Cluster, _ = identity.AgentCluster(cert)
		}
	}
	return c
}
