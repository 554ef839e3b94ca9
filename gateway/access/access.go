// Package access is the API port's access control, in the order of
// DESIGN.md: authenticate the call (gateway/authn), limit its rate per
// principal and route (gateway/ratelimit), authorize it with the RBAC
// policy and the method's (pivirt.api.v1.authz) annotation
// (gateway/authz) — checking conditional rules against the target object
// and filtering list and watch results — and audit-log the decisions. One
// Guard serves the three ways into the port: Connect handlers (an
// interceptor), grpc-go handlers and the proxy (server interceptors).
package access

import (
	"context"
	"crypto/cipher"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/observe"
	"pilab.hu/pivirt-agent/gateway/ratelimit"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// Config is what a Guard enforces.
type Config struct {
	// Authenticator names callers; required.
	Authenticator *authn.Authenticator
	// Policy returns the RBAC policy in force. Without one (nil func or
	// nil policy) every authenticated caller may call every annotated
	// method.
	Policy func() *authz.Policy
	// Limits are the rate limits; the zero value limits nothing.
	Limits Limits
	// Routed tells whether a routing rule serves a method: a routed
	// method of a service no schema of which is linked in is the
	// resource named by the service with the verb authz.VerbCall; any
	// other method without a schema is denied. Nil: none is routed.
	Routed func(fullMethod string) bool
	// Schema, when set, returns the descriptor of a routed method that is
	// not linked in from the schema the operator gave its route (a
	// routing rule's descriptor set), nil when there is none. A method
	// annotated there (pivirt.api.v1.authz) is decided by its annotation,
	// as a linked-in one, conditions included; one without the annotation
	// is an unschemed method (see Routed). A schema learned from the
	// backend (server reflection) must never be given here: what
	// protects a backend must not come from that backend. The descriptor
	// may change (a reload): the guard keeps what it derived from one
	// only while Schema returns that same descriptor.
	Schema func(fullMethod string) protoreflect.MethodDescriptor
	// Fetch reads the object a request names by ID, by calling get (the
	// service's method with verb "get") with req; conditional rules on
	// methods with an id_field need it.
	Fetch func(ctx context.Context, get protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error)
	// ConnState returns the TLS state of the connection a request came
	// on when the transport does not say (net/http behind a TLS listener
	// that ends before the protocol mux).
	ConnState func(ctx context.Context) (*tls.ConnectionState, bool)
	// Ready, when set and failing, refuses every call that needs a rule
	// with Unavailable and its message: the agent does not know yet which
	// policy is in force (it has not caught up with the cluster).
	Ready func(ctx context.Context) error
	// Resource, when set, may name another resource for a unary request
	// than its method's annotation (a config key guarded on its own, such
	// as the cluster-wide RBAC policy).
	Resource func(procedure string, req protoreflect.Message) (string, bool)
	// BreakGlass, when set and true for a unary request and its caller,
	// allows the call whatever the RBAC policy says; it is audit-logged as
	// break-glass (the way out of a policy that locks everyone out).
	// via is the agent that relayed the call ("" for a call of this port).
	BreakGlass func(procedure string, req protoreflect.Message, who authz.Principal, via string) bool
	// VerifyClientChain verifies a client certificate chain (leaf first)
	// that another agent relayed as its caller's credential, as the API
	// port's TLS handshake verifies one: the CAs, expiry, revocation. nil:
	// relayed certificate callers are refused.
	VerifyClientChain func(chain []*x509.Certificate) error
	// Logger receives the audit log: every denial, and every allowed
	// call that changes something.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Now is the clock of the rate limits (nil: time.Now).
	Now func() time.Time
	// MaxStreams bounds the streaming calls one caller may hold open at
	// once (0: DefaultMaxStreams; negative: no bound).
	MaxStreams int
	// BodyTimeout bounds how long a one-message request body may take to
	// arrive (0: DefaultBodyTimeout; negative: no bound).
	BodyTimeout time.Duration
}

// Limits are token buckets per principal: one per route prefix listed
// (the longest matching prefix), and Default for every other method.
type Limits struct {
	Default Limit
	Routes  []RouteLimit
}

// Limit is a token bucket's refill rate and size; a zero rate is no limit.
type Limit struct {
	PerSecond float64
	Burst     int
}

// RouteLimit limits the methods under Prefix ("/pivirt.vm.v1.VMService/",
// "/pivirt.vm.v1.VMService/PowerOn").
type RouteLimit struct {
	Prefix string
	Limit
}

// Guard enforces a Config.
type Guard struct {
	cfg Config
	// tokens seals the page tokens of filtered lists (pagetoken.go).
	tokens  cipher.AEAD
	limits  atomic.Pointer[limiters]
	methods sync.Map // full method → *method
	// schemed are the methods of Config.Schema, by full method name; an
	// entry holds while Config.Schema returns its descriptor.
	schemed sync.Map // full method → *method

	rateLimited *prometheus.CounterVec
	denied      *prometheus.CounterVec
	// failures is the budget of failed authentications per source
	// address: a call takes a token before its credentials are checked
	// and gives it back when they pass; floodLogged allows one log line
	// per source and second while its budget is spent.
	failures    *ratelimit.Budget
	floodLogged *ratelimit.Budget
	// streams counts each caller's open streaming calls; authenticating
	// each source's calls between their headers and their verdict.
	streams        counters
	authenticating counters
	// relayed remembers the relayed credentials verified recently.
	relayed relayedCache
}

// Failed authentications a source may make: failedAuthPerSecond on
// average, failedAuthBurst at once (calls in flight count until they
// passed). Past that its calls are refused with ResourceExhausted, before
// any credential is checked, until a token is back; each refused call is
// counted, and at most one line a second is logged per source.
const (
	failedAuthPerSecond = 5
	failedAuthBurst     = 20
)

// limiters are the token buckets of a Limits.
type limiters struct {
	cfg      Limits
	defaults *ratelimit.Limiter
	routes   []routeLimiter
}

type routeLimiter struct {
	prefix string
	l      *ratelimit.Limiter
	Limit
}

// New returns a Guard for cfg.
func New(cfg Config) (g *Guard, err error) {
	if cfg.Authenticator == nil {
		return nil, errors.New("access: no authenticator")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Policy == nil {
		cfg.Policy = func() *authz.Policy { return nil }
	}
	if cfg.MaxStreams == 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	if cfg.BodyTimeout == 0 {
		cfg.BodyTimeout = DefaultBodyTimeout
	}
	g = &Guard{
		cfg: cfg,
		rateLimited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_api_rate_limited_total",
			Help: "Calls on the API port refused by a rate limit (ResourceExhausted), by route.",
		}, []string{"route"}),
		denied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_api_access_denied_total",
			Help: "Calls on the API port refused, by reason: unauthenticated, permission_denied, auth_flood (a source's failed authentications), streams (a caller's open streams), slow_body (a request that did not arrive in time).",
		}, []string{"reason"}),
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	g.failures = ratelimit.NewBudget(failedAuthPerSecond, failedAuthBurst, 0, now)
	g.floodLogged = ratelimit.NewBudget(1, 1, 0, now)
	if g.tokens, err = newTokenCipher(); err != nil {
		return nil, fmt.Errorf("access: %w", err)
	}
	if err := g.SetLimits(cfg.Limits); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{g.rateLimited, g.denied} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("access: %w", err)
			}
		}
	}
	return g, nil
}

// SetLimits replaces the rate limits (a configuration reload); the
// buckets start full.
func (g *Guard) SetLimits(l Limits) error {
	set := &limiters{cfg: l}
	if d := l.Default; d.PerSecond > 0 {
		set.defaults = ratelimit.New(d.PerSecond, max(d.Burst, 1), 0, g.cfg.Now)
	}
	for _, r := range l.Routes {
		if r.PerSecond <= 0 {
			return fmt.Errorf("access: rate limit of %s: rate must be positive", r.Prefix)
		}
		set.routes = append(set.routes, routeLimiter{prefix: r.Prefix, l: ratelimit.New(r.PerSecond, max(r.Burst, 1), 0, g.cfg.Now), Limit: r.Limit})
	}
	g.limits.Store(set)
	return nil
}

// openMethods need neither credentials nor an authorization rule: health
// checks (load balancers, Kubernetes probes and grpc-health-probe carry no
// credentials) and server reflection, which grpcurl asks before any call
// (the health check included) and which describes the API's types and the
// names of the routed APIs, nothing stored. Exact names: grpc-go hands an
// unknown method of a known service to the proxy, so a prefix would open the
// proxy to any name under it.
var openMethods = []string{
	"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
	"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}

// method is what the guard knows of a method.
type method struct {
	full string
	open bool // no credentials needed, no rule
	md   protoreflect.MethodDescriptor
	rule *apiv1.Authorization
	err  error // no (valid) annotation: denied
	// get reads the object of an id_field method; object is the
	// object's type (the list method's items), found in get's response.
	get    protoreflect.MethodDescriptor
	object protoreflect.MessageDescriptor
	// unschemed: a method of a service no schema of which is linked in
	// (a routed service the gateway relays without knowing it); rule
	// is then its service as the resource, authz.VerbCall as the verb.
	unschemed bool
}

// lookup resolves a full method name ("/pkg.Service/Method") against the
// protos linked into the program.
func (g *Guard) lookup(full string) *method {
	if v, ok := g.methods.Load(full); ok {
		return v.(*method)
	}
	m := &method{full: full}
	switch {
	case slices.Contains(openMethods, full):
		m.open = true
	default:
		m.md = findMethod(full)
		if m.md == nil && g.cfg.Schema != nil {
			if md := g.cfg.Schema(full); md != nil {
				if sm := g.lookupSchema(full, md); sm != nil {
					return sm
				}
			}
		}
		if svc, ok := unschemedService(full); m.md == nil && ok && g.cfg.Routed != nil && g.cfg.Routed(full) {
			// Not cached: callers choose the names.
			return &method{full: full, unschemed: true, rule: &apiv1.Authorization{Resource: svc, Verb: authz.VerbCall}}
		}
		if m.md == nil {
			// Not cached: callers choose the names.
			return &method{full: full, err: fmt.Errorf("%s: %w", full, authz.ErrNoAnnotation)}
		}
		m.rule, m.err = authz.MethodRule(m.md)
		m.resolve()
	}
	v, _ := g.methods.LoadOrStore(full, m)
	return v.(*method)
}

// resolve finds the object type and the get method of an annotated
// method.
func (m *method) resolve() {
	if m.err == nil && !m.rule.GetSelf() {
		sd := m.md.Parent().(protoreflect.ServiceDescriptor)
		m.object = objectType(sd, m.rule.GetResource())
		if m.rule.GetIdField() != "" {
			m.get = getter(sd, m.rule.GetResource(), m.object)
		}
	}
}

// lookupSchema is the method md of a routing rule's descriptor set
// (Config.Schema) when md carries the annotation, decided as a linked-in
// method; nil when it has none (an unschemed method, as before the
// descriptor set). Cached while Config.Schema returns md: a reload that
// replaces the descriptor set replaces md.
func (g *Guard) lookupSchema(full string, md protoreflect.MethodDescriptor) *method {
	if v, ok := g.schemed.Load(full); ok && v.(*method).md == md {
		return v.(*method)
	}
	m := &method{full: full, md: md}
	m.rule, m.err = authz.MethodRule(md)
	switch {
	case errors.Is(m.err, authz.ErrNoAnnotation):
		return nil
	case m.err == nil && m.rule.GetSelf():
		// A self method skips the RBAC decision on the program's word
		// that it answers only about its caller; a backend's method
		// cannot be vouched for.
		m.rule, m.err = nil, fmt.Errorf("%s: self is for the agent's own methods, not a descriptor set's", md.FullName())
	}
	m.resolve()
	g.schemed.Store(full, m)
	return m
}

// unschemedService is the service of a method ("/pkg.Service/Method")
// when no schema of that service is linked into the program: a service
// the gateway relays without knowing it, when routed. An unknown method
// of a service the program knows is not one.
func unschemedService(full string) (string, bool) {
	svc, name, ok := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	if !ok || name == "" || strings.Contains(name, "/") || !authz.IsServiceName(svc) {
		return "", false
	}
	_, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	return svc, err != nil
}

func findMethod(full string) protoreflect.MethodDescriptor {
	svc, name, ok := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	if !ok {
		return nil
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return nil
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil
	}
	return sd.Methods().ByName(protoreflect.Name(name))
}

// objectType is the message type of a resource's objects: the items of
// its list method's list_field.
func objectType(sd protoreflect.ServiceDescriptor, resource string) protoreflect.MessageDescriptor {
	for i := range sd.Methods().Len() {
		md := sd.Methods().Get(i)
		r, err := authz.MethodRule(md)
		if err != nil || r.GetResource() != resource || r.GetVerb() != "list" || r.GetListField() == "" || md.IsStreamingServer() {
			continue
		}
		if fd := fieldAt(md.Output(), r.GetListField()); fd != nil && fd.Message() != nil {
			return fd.Message()
		}
	}
	return nil
}

// getter is the unary method reading one object of the resource by ID: verb
// get, an id_field, and a response holding an object.
func getter(sd protoreflect.ServiceDescriptor, resource string, object protoreflect.MessageDescriptor) protoreflect.MethodDescriptor {
	if object == nil {
		return nil
	}
	for i := range sd.Methods().Len() {
		md := sd.Methods().Get(i)
		r, err := authz.MethodRule(md)
		if err != nil || r.GetResource() != resource || r.GetVerb() != "get" || r.GetIdField() == "" || md.IsStreamingClient() || md.IsStreamingServer() {
			continue
		}
		if objectField(md.Output(), object) != nil {
			return md
		}
	}
	return nil
}

// objectField is the singular field of msg holding an object.
func objectField(msg, object protoreflect.MessageDescriptor) protoreflect.FieldDescriptor {
	fields := msg.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if !fd.IsList() && !fd.IsMap() && fd.Message() != nil && fd.Message().FullName() == object.FullName() {
			return fd
		}
	}
	return nil
}

// fieldAt is the field at a dotted path of md.
func fieldAt(md protoreflect.MessageDescriptor, path string) protoreflect.FieldDescriptor {
	var fd protoreflect.FieldDescriptor
	for name := range strings.SplitSeq(path, ".") {
		if md == nil {
			return nil
		}
		fd = md.Fields().ByName(protoreflect.Name(name))
		if fd == nil {
			return nil
		}
		md = fd.Message()
	}
	return fd
}

// newMessage makes an empty message of md: the generated type when the
// program links it, else a dynamic one.
func newMessage(md protoreflect.MessageDescriptor) protoreflect.Message {
	if mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName()); err == nil {
		return mt.New()
	}
	return dynamicpb.NewMessage(md)
}

// grant is an admitted call.
type grant struct {
	m        *method
	who      authz.Principal
	d        authz.Decision
	resource string // the annotation's, unless Config.Resource names another
	// auditPending: the allowed call's audit line waits for the first
	// request message, which names the object (call.readsFirst).
	auditPending bool
}

// conditional: the call is allowed only on objects its conditions accept.
func (gr *grant) conditional() bool { return gr != nil && !gr.d.Allowed && gr.d.Conditional }

// checksRequest: the request names or carries the object to check.
func (gr *grant) checksRequest() bool {
	return gr.conditional() && gr.m.rule.GetListField() == "" && (gr.m.rule.GetIdField() != "" || gr.m.rule.GetObjectField() != "")
}

// uncheckable is why a conditional grant cannot be used — the method
// gives no object to check the conditions on — or "" when it can (or is
// not conditional): such a call is denied.
func (gr *grant) uncheckable() string {
	switch {
	case gr.conditional() && !gr.checksRequest() && !gr.filters():
		return "the rules that allow it have conditions, and the method names no object to check them on"
	case gr.conditional() && gr.m.rule.GetIdField() != "" && gr.m.get == nil:
		return "the rules that allow it have conditions, and the service has no get method to read the object with"
	}
	return ""
}

// filters: the responses are filtered.
func (gr *grant) filters() bool { return gr.conditional() && gr.m.rule.GetListField() != "" }

// call is the start of a call, as any transport sees it.
type call struct {
	procedure     string
	authorization string
	tls           *tls.ConnectionState
	remote        string
	requestID     string
	// readsFirst: the caller reads a stream's first message before the
	// handler runs when the grant asks for it (auditPending), so that an
	// allowed call's audit line can name its object.
	readsFirst bool
	// via is the agent that relayed the call (Relayed), "" for a call of
	// the API port: its caller was rate-limited and its streams counted
	// there.
	via string
}

// admit authenticates the caller, applies the rate limits and decides
// whether the method may be called; req is the request of a unary call
// (nil for streams). A nil grant with a nil error is an open method.
func (g *Guard) admit(ctx context.Context, c call, req protoreflect.Message) (context.Context, *grant, error) {
	m := g.lookup(c.procedure)
	if m.open {
		return ctx, nil, nil
	}
	who, ok := preAuthenticated(ctx, c.procedure)
	if !ok {
		var err error
		if who, err = g.authenticate(ctx, c); err != nil {
			return ctx, nil, err
		}
	}
	ctx = authz.WithPrincipal(ctx, who)
	ctx = withCredential(ctx, c)
	if r, ok := observe.RequestFrom(ctx); ok {
		r.Identity = who.Identity // for the access log
	}
	if c.via == "" {
		if err := g.limit(who, c.procedure); err != nil {
			return ctx, nil, err
		}
	}
	gr, err := g.decide(ctx, c, who, m, req)
	return ctx, gr, err
}

// ErrTokenExpired ends a stream whose bearer token expired while it was
// open.
var ErrTokenExpired = errors.New("the bearer token of the stream expired: open it again with a new one")

// untilExpiry ends a stream when the bearer token that opened it expires:
// the token is checked once, when the stream opens, and a watch must not
// go on sending to a caller whose credentials are no longer valid. A
// certificate's caller (no expiry here: the handshake checked it, and
// revocation closes the connection) is not bounded.
func untilExpiry(ctx context.Context) (context.Context, context.CancelFunc) {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok || who.Expiry.IsZero() {
		return ctx, func() {}
	}
	return context.WithDeadlineCause(ctx, who.Expiry, ErrTokenExpired)
}

// tokenExpired reports whether ctx (of untilExpiry) ended because its
// token expired: the stream's caller is told Unauthenticated, as a new
// call with that token would be, whatever the handler answered to the
// cancellation (a proxied call's backend sees a cancelled stream). The
// expiry counts once it has passed, whether or not ctx's timer has fired
// yet: the backend of a proxied stream has the same deadline, and its
// end can reach the handler first.
func tokenExpired(ctx context.Context) bool {
	if ctx.Err() != nil {
		return errors.Is(context.Cause(ctx), ErrTokenExpired)
	}
	who, ok := authz.PrincipalFrom(ctx)
	return ok && !who.Expiry.IsZero() && !time.Now().Before(who.Expiry)
}

// authenticate names the caller of c from its credentials alone (the
// authorization header, the connection's client certificate), after taking
// a token of the source's failed-authentication budget.
func (g *Guard) authenticate(ctx context.Context, c call) (authz.Principal, error) {
	var certs []*x509.Certificate
	if c.tls != nil {
		certs = c.tls.PeerCertificates
	}
	src := sourceOf(c.remote)
	if err := g.takeAuthToken(src); err != nil {
		return authz.Principal{}, err
	}
	release, err := g.authInFlight(src)
	if err != nil {
		g.failures.GiveBack(src) // not a failed authentication
		return authz.Principal{}, err
	}
	who, err := g.cfg.Authenticator.Authenticate(ctx, c.authorization, certs)
	release()
	if err != nil {
		g.denied.WithLabelValues("unauthenticated").Inc()
		observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: call refused: not authenticated", "method", c.procedure, "remote", c.remote, "request_id", c.requestID, "reason", err.Error())
		// The code says "unauthenticated" already.
		return authz.Principal{}, &denial{code: codeUnauthenticated, msg: strings.TrimPrefix(err.Error(), authn.ErrUnauthenticated.Error()+": ")}
	}
	g.failures.GiveBack(src)
	return who, nil
}

// preAuth is the caller a transport authenticated from a call's headers
// before reading its body (TapHandle, Authenticated), for admit.
type preAuth struct {
	procedure string
	who       authz.Principal
}

type preAuthKey struct{}

// withPreAuth records who as the authenticated caller of procedure.
func withPreAuth(ctx context.Context, procedure string, who authz.Principal) context.Context {
	return context.WithValue(ctx, preAuthKey{}, preAuth{procedure: procedure, who: who})
}

// preAuthenticated returns the caller authenticated before the body of
// the call procedure was read, if any.
func preAuthenticated(ctx context.Context, procedure string) (authz.Principal, bool) {
	p, ok := ctx.Value(preAuthKey{}).(preAuth)
	if !ok || p.procedure != procedure {
		return authz.Principal{}, false
	}
	return p.who, true
}

// decide is the policy's answer for who calling m (req: the request of a
// unary call, for Config.Resource).
func (g *Guard) decide(ctx context.Context, c call, who authz.Principal, m *method, req protoreflect.Message) (*grant, error) {
	if m.err != nil {
		return nil, g.deny(c, who, m, "", "the method has no authorization rule (%v); methods without one are denied", m.err)
	}
	if g.cfg.Ready != nil {
		if err := g.cfg.Ready(ctx); err != nil {
			return nil, &denial{code: codes.Unavailable, msg: err.Error()}
		}
	}
	gr := &grant{m: m, who: who, d: authz.Decision{Allowed: true}, resource: m.rule.GetResource()}
	if m.rule.GetSelf() {
		// It answers only about the caller, authenticated above: no rule
		// applies, and none is checked.
		g.allowed(c, gr, "")
		return gr, nil
	}
	if g.cfg.Resource != nil && req != nil {
		if r, ok := g.cfg.Resource(c.procedure, req); ok {
			gr.resource = r
		}
	}
	if g.cfg.BreakGlass != nil && req != nil && g.cfg.BreakGlass(c.procedure, req, who, c.via) {
		observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: break-glass: call allowed whatever the RBAC policy", "decision", "allow",
			"identity", who.Identity, "method", c.procedure, "resource", gr.resource, "verb", m.rule.GetVerb(), "remote", c.remote, "via", c.via, "request_id", c.requestID)
		return gr, nil
	}
	if p := g.cfg.Policy(); p != nil {
		var err error
		if gr.d, err = p.Decide(who, gr.resource, m.rule.GetVerb()); err != nil {
			return nil, g.deny(c, who, m, "", "the policy's conditions cannot be evaluated: %v", err)
		}
	}
	object := objectName(m, req)
	switch {
	case gr.d.Denied():
		return nil, g.denyGrant(c, gr, object, "no rule of the RBAC policy allows it%s", noRolesHint(who))
	case gr.uncheckable() != "":
		return nil, g.denyGrant(c, gr, object, "%s", gr.uncheckable())
	}
	if !gr.conditional() {
		if req == nil && c.readsFirst && m.rule.GetIdField() != "" && m.md != nil && !m.md.IsStreamingClient() {
			gr.auditPending = true
		} else {
			g.allowed(c, gr, object)
		}
	}
	return gr, nil
}

// objectFields are the request fields that name the object of a method
// without an id_field, in the order tried.
var objectFields = []string{"key", "id", "name", "node_id", "node", "instance.instance_id", "schedule.id"}

// objectName is what the audit log names as the object of a call: the
// method's id_field, else a field that names one (a config key, a
// service instance, a node), "" when the request names none.
func objectName(m *method, req protoreflect.Message) string {
	if req == nil || m.rule == nil {
		return ""
	}
	if f := m.rule.GetIdField(); f != "" {
		id, _ := authz.FieldString(req, f)
		return id
	}
	if svc, _ := authz.FieldString(req, "service"); svc != "" {
		if id, _ := authz.FieldString(req, "instance_id"); id != "" {
			return svc + "/" + id
		}
		return svc
	}
	if svc, _ := authz.FieldString(req, "instance.service"); svc != "" {
		id, _ := authz.FieldString(req, "instance.instance_id")
		return strings.TrimSuffix(svc+"/"+id, "/")
	}
	for _, f := range objectFields {
		if v, _ := authz.FieldString(req, f); v != "" {
			return v
		}
	}
	return ""
}

// Authorize checks that the caller of ctx (the principal the guard
// authenticated for the call in progress) may make the call procedure
// with req themselves: the policy, and its conditions on the object.
// Something done later on the caller's behalf (a power schedule's action)
// is checked with it when it is set up. The error is a Connect error.
func (g *Guard) Authorize(ctx context.Context, procedure string, req proto.Message) error {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s: no authenticated caller to check", procedure))
	}
	c := call{procedure: procedure, remote: "on behalf of " + who.Identity}
	m := g.lookup(procedure)
	gr, err := g.decide(ctx, c, who, m, req.ProtoReflect())
	if err == nil && gr.checksRequest() {
		err = g.checkRequest(ctx, c, gr, req.ProtoReflect())
	}
	return connectError(err)
}

// AuthorizeResource checks that the caller of ctx may do verb on every
// object of resource: what a snapshot restore needs for each resource
// whose records it replaces (a grant limited by conditions covers some
// objects, not a table). The error is a Connect error.
func (g *Guard) AuthorizeResource(ctx context.Context, resource, verb string) error {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s %s: no authenticated caller to check", verb, resource))
	}
	p := g.cfg.Policy()
	if p == nil {
		return nil
	}
	d, err := p.Decide(who, resource, verb)
	reason := ""
	switch {
	case err != nil:
		reason = fmt.Sprintf("the policy's conditions cannot be evaluated: %v", err)
	case d.Conditional:
		reason = "the rules that allow it have conditions, and a snapshot restore replaces every object"
	case !d.Allowed:
		reason = "no rule of the RBAC policy allows it" + noRolesHint(who)
	}
	if reason == "" {
		return nil
	}
	g.denied.WithLabelValues("permission_denied").Inc()
	observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: call denied", "decision", "deny", "identity", who.Identity, "roles", who.Roles,
		"resource", resource, "verb", verb, "reason", "a snapshot restore changes its records: "+reason)
	return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s (roles %s) may not %s %s, which the snapshot restore changes: %s",
		who.Identity, rolesString(who.Roles), verb, resource, reason))
}

// limit takes a token of the caller's bucket of the route.
func (g *Guard) limit(who authz.Principal, procedure string) error {
	set := g.limits.Load()
	l, route := set.defaults, "*"
	var lim Limit
	if l != nil {
		lim = set.cfg.Default
	}
	best := -1
	for _, r := range set.routes {
		if strings.HasPrefix(procedure, r.prefix) && len(r.prefix) > best {
			l, route, lim, best = r.l, r.prefix, r.Limit, len(r.prefix)
		}
	}
	if l == nil {
		return nil
	}
	ok, wait := l.Allow(who.Identity)
	if ok {
		return nil
	}
	g.rateLimited.WithLabelValues(route).Inc()
	g.cfg.Logger.Info("call refused: rate limit", "identity", who.Identity, "method", procedure, "route", route, "retry_after", wait)
	return &denial{
		code:  codeResourceExhausted,
		msg:   fmt.Sprintf("rate limit exceeded for %s on %s (%g requests/s, burst %d); retry after %s", who.Identity, route, lim.PerSecond, max(lim.Burst, 1), wait.Round(time.Millisecond)),
		retry: wait,
	}
}

// deny audit-logs and returns a PermissionDenied naming the resource and
// verb (and object, when one was checked).
func (g *Guard) deny(c call, who authz.Principal, m *method, object, format string, args ...any) error {
	return g.denyGrant(c, &grant{m: m, who: who, resource: m.rule.GetResource()}, object, format, args...)
}

func (g *Guard) denyGrant(c call, gr *grant, object, format string, args ...any) error {
	g.denied.WithLabelValues("permission_denied").Inc()
	reason := fmt.Sprintf(format, args...)
	what := gr.m.full
	attrs := []any{"decision", "deny", "identity", gr.who.Identity, "roles", gr.who.Roles, "method", gr.m.full, "remote", c.remote, "request_id", c.requestID, "reason", reason}
	if c.via != "" {
		attrs = append(attrs, "via", c.via)
	}
	if gr.m.rule != nil {
		what = fmt.Sprintf("%s %s", gr.m.rule.GetVerb(), gr.resource)
		attrs = append(attrs, "resource", gr.resource, "verb", gr.m.rule.GetVerb())
	}
	if object != "" {
		what += " " + object
		attrs = append(attrs, "object", object)
	}
	observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: call denied", attrs...)
	return &denial{code: codePermissionDenied, msg: fmt.Sprintf("%s (roles %s) may not %s: %s", gr.who.Identity, rolesString(gr.who.Roles), what, reason)}
}

// allowed audit-logs an allowed call that changes something (reads are
// logged at debug level).
func (g *Guard) allowed(c call, gr *grant, object string) {
	procedure, remote := c.procedure, c.remote
	level := slog.LevelInfo
	if v := gr.m.rule.GetVerb(); v == "get" || v == "list" || gr.m.rule.GetSelf() {
		level = slog.LevelDebug
	}
	if !observe.AuditEnabled(g.cfg.Logger, level) {
		return
	}
	attrs := []any{"decision", "allow",
		"identity", gr.who.Identity, "roles", gr.who.Roles, "method", procedure, "resource", gr.resource,
		"verb", gr.m.rule.GetVerb(), "object", object, "remote", remote, "request_id", c.requestID}
	if c.via != "" {
		attrs = append(attrs, "via", c.via)
	}
	observe.Audit(g.cfg.Logger, level, "audit: call allowed", attrs...)
}

// noRolesHint says, for a caller authenticated by a client certificate
// that has no role, where a certificate's roles come from: a policy's
// rules never allow it anything otherwise.
func noRolesHint(who authz.Principal) string {
	if !who.Certificate || len(who.Roles) > 0 {
		return ""
	}
	return fmt.Sprintf(" (a client certificate's roles come from auth.certificate_roles, which gives %q none: map the name to roles there, e.g. certificate_roles: {%s: [viewer]})", who.Identity, who.Identity)
}

func rolesString(roles []string) string {
	if len(roles) == 0 {
		return "none"
	}
	return strings.Join(roles, ", ")
}

// checkRequest checks a conditional grant against the object the request
// names (id_field: read with the service's get method) and the object it
// carries (object_field, or the message holding the id_field of an
// update): a create is checked on what it creates, an update on the
// object as stored and as it would be after the update, so that neither
// a foreign object nor a change out of the conditions (handing a VM to
// someone else) passes.
func (g *Guard) checkRequest(ctx context.Context, c call, gr *grant, req protoreflect.Message) error {
	rule := gr.m.rule
	carried := ""
	switch {
	case rule.GetObjectField() != "":
		carried = rule.GetObjectField()
	case strings.Contains(rule.GetIdField(), "."):
		parent := rule.GetIdField()[:strings.LastIndexByte(rule.GetIdField(), '.')]
		if fd := fieldAt(req.Descriptor(), parent); fd != nil && gr.m.object != nil && fd.Message() != nil && fd.Message().FullName() == gr.m.object.FullName() {
			carried = parent
		}
	}
	if rule.GetIdField() == "" {
		obj := messageAt(req, carried)
		if obj == nil || !gr.d.Object(obj) {
			return g.denyGrant(c, gr, "", "the %s in the request does not meet the conditions of the rules that allow it", carried)
		}
		g.allowed(c, gr, "")
		return nil
	}
	id, _ := authz.FieldString(req, rule.GetIdField())
	if id == "" {
		return &denial{code: codeInvalidArgument, msg: fmt.Sprintf("%s is required", rule.GetIdField())}
	}
	stored, err := g.fetch(ctx, gr, id)
	if err != nil {
		if d, ok := err.(*denial); ok && d.code == codes.NotFound && c.via != "" {
			// Relayed: the entry agent asks the nodes where an object
			// lives, and "not here" is an answer it needs; the caller
			// gets the entry agent's own answer, the same for a missing
			// object as for someone else's.
			return &denial{code: codes.NotFound, msg: fmt.Sprintf("%s %s is not on this node", gr.resource, id)}
		}
		if d, ok := err.(*denial); ok && (d.code == codes.NotFound || d.code == codes.PermissionDenied) {
			// The same answer as for someone else's object (the node
			// holding it refused the read): a caller limited to some
			// objects learns nothing of the others.
			return g.denyGrant(c, gr, id, "it does not exist or does not meet the conditions of the rules that allow it")
		}
		return err
	}
	if stored == nil || !gr.d.Object(stored) {
		return g.denyGrant(c, gr, id, "it does not exist or does not meet the conditions of the rules that allow it")
	}
	if carried != "" {
		if after := applyUpdate(stored, req, carried); !gr.d.Object(after) {
			return g.denyGrant(c, gr, id, "after the update it would no longer meet the conditions of the rules that allow it")
		}
	}
	g.allowed(c, gr, id)
	return nil
}

// fetch reads the object id with the service's get method; nil when the
// response holds none.
func (g *Guard) fetch(ctx context.Context, gr *grant, id string) (protoreflect.Message, error) {
	if g.cfg.Fetch == nil {
		return nil, &denial{code: codes.Unavailable, msg: "the object cannot be read to check the rules' conditions"}
	}
	getReq := newMessage(gr.m.get.Input())
	getRule, _ := authz.MethodRule(gr.m.get) // checked by getter
	if err := setString(getReq, getRule.GetIdField(), id); err != nil {
		return nil, &denial{code: codes.Internal, msg: err.Error()}
	}
	resp, err := g.cfg.Fetch(ctx, gr.m.get, getReq.Interface())
	if err != nil {
		return nil, fetchError(err, gr.resource, id)
	}
	obj := resp.ProtoReflect()
	if fd := objectField(obj.Descriptor(), gr.m.object); fd != nil && obj.Has(fd) {
		return obj.Get(fd).Message(), nil
	}
	return nil, nil
}

// applyUpdate is stored as an update request would leave it: the fields
// of the request's update_mask copied from the object the request
// carries at path, or, without a mask, every field the request sets.
func applyUpdate(stored, req protoreflect.Message, path string) protoreflect.Message {
	after := proto.Clone(stored.Interface()).ProtoReflect()
	in := messageAt(req, path)
	if in == nil {
		return after
	}
	var paths []string
	if fd := req.Descriptor().Fields().ByName("update_mask"); fd != nil && fd.Message() != nil && req.Has(fd) {
		mask := req.Get(fd).Message()
		if pf := mask.Descriptor().Fields().ByName("paths"); mask.Descriptor().FullName() == updateMaskType && pf != nil && pf.IsList() {
			// By reflection: a descriptor set's request holds a dynamic
			// FieldMask.
			for i, l := 0, mask.Get(pf).List(); i < l.Len(); i++ {
				paths = append(paths, l.Get(i).String())
			}
		}
	}
	if len(paths) == 0 {
		proto.Merge(after.Interface(), in.Interface())
		return after
	}
	for _, p := range paths {
		copyPath(after, in, p)
	}
	return after
}

// updateMaskType is the type of an update's update_mask.
var updateMaskType = (&fieldmaskpb.FieldMask{}).ProtoReflect().Descriptor().FullName()

// copyPath sets the field at a dotted path of dst to src's.
func copyPath(dst, src protoreflect.Message, path string) {
	parts := strings.Split(path, ".")
	for i, name := range parts {
		fd := dst.Descriptor().Fields().ByName(protoreflect.Name(name))
		if fd == nil {
			return
		}
		if i == len(parts)-1 {
			if src.Has(fd) {
				dst.Set(fd, src.Get(fd))
			} else {
				dst.Clear(fd)
			}
			return
		}
		if fd.Message() == nil || fd.IsList() || fd.IsMap() {
			return
		}
		if !src.Has(fd) {
			dst.Clear(fd)
			return
		}
		dst, src = dst.Mutable(fd).Message(), src.Get(fd).Message()
	}
}

// setString sets the string field at a dotted path of m.
func setString(m protoreflect.Message, path, v string) error {
	parts := strings.Split(path, ".")
	for i, name := range parts {
		fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
		if fd == nil {
			return fmt.Errorf("%s has no field %s", m.Descriptor().FullName(), path)
		}
		if i < len(parts)-1 {
			if fd.Message() == nil || fd.IsList() || fd.IsMap() {
				return fmt.Errorf("%s.%s is not a message", m.Descriptor().FullName(), name)
			}
			m = m.Mutable(fd).Message()
			continue
		}
		if fd.Kind() != protoreflect.StringKind || fd.IsList() {
			return fmt.Errorf("%s.%s is not a string", m.Descriptor().FullName(), name)
		}
		m.Set(fd, protoreflect.ValueOfString(v))
	}
	return nil
}

// messageAt is the message at a dotted path, nil when unset.
func messageAt(m protoreflect.Message, path string) protoreflect.Message {
	for name := range strings.SplitSeq(path, ".") {
		fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
		if fd == nil || fd.Message() == nil || fd.IsList() || fd.IsMap() || !m.Has(fd) {
			return nil
		}
		m = m.Get(fd).Message()
	}
	return m
}

// filter removes the items of a list response that the grant's conditions
// exclude; for a watch (a singular list_field) it reports whether the
// response may be sent at all.
func (gr *grant) filter(resp protoreflect.Message) bool {
	path := gr.m.rule.GetListField()
	parent := resp
	if i := strings.LastIndexByte(path, '.'); i >= 0 {
		if parent = messageAt(resp, path[:i]); parent == nil {
			return true
		}
		path = path[i+1:]
	}
	fd := parent.Descriptor().Fields().ByName(protoreflect.Name(path))
	if fd == nil || fd.Message() == nil || fd.IsMap() {
		return false
	}
	if !fd.IsList() {
		return !parent.Has(fd) || gr.d.Object(parent.Get(fd).Message())
	}
	if !parent.Has(fd) {
		return true
	}
	list := parent.Mutable(fd).List()
	n := 0
	for i := range list.Len() {
		if gr.d.Object(list.Get(i).Message()) {
			list.Set(n, list.Get(i))
			n++
		}
	}
	list.Truncate(n)
	return true
}

// sourceOf is the source a remote "host:port" counts as for the
// failed-authentication budget: its address, an IPv6 one by its /64 (one
// host can use a whole /64).
func sourceOf(remote string) string {
	host := remote
	if h, _, err := net.SplitHostPort(remote); err == nil {
		host = h
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	a = a.Unmap().WithZone("")
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.String()
	}
	return a.String()
}

// takeAuthToken takes a token of src's failed-authentication budget for a
// call about to be authenticated (given back when it passes); without one
// the call is refused before its credentials are looked at.
func (g *Guard) takeAuthToken(src string) error {
	ok, wait := g.failures.Take(src)
	if ok {
		return nil
	}
	g.denied.WithLabelValues("auth_flood").Inc()
	if logged, _ := g.floodLogged.Take(src); logged {
		observe.Audit(g.cfg.Logger, slog.LevelWarn, "audit: refusing calls from a source: too many failed authentications",
			"remote", src, "per_second", failedAuthPerSecond, "burst", failedAuthBurst, "retry_after", wait)
	}
	return &denial{code: codeResourceExhausted, retry: wait,
		msg: fmt.Sprintf("too many failed authentications from %s; retry after %s", src, wait.Round(time.Millisecond))}
}
