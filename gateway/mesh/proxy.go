package mesh

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/observe"
)

// Route sends the methods whose full name ("/pkg.Service/Method") starts
// with Prefix to Backend.
type Route struct {
	Prefix  string
	Backend *Backend
	// Schema, when set, is the schema of the services the route serves
	// that the program does not link (routing.rules[].route.descriptor_set).
	Schema *Schema
	// Reflector, when set (and Schema is not), learns that schema from
	// the backend's gRPC server reflection.
	Reflector *Reflector
}

// Proxy forwards gRPC calls to backend clusters by route, without decoding
// messages: every call shape (unary, client, server and bidi streaming),
// headers, trailers, deadlines and status (code, message, details) pass
// through.
type Proxy struct {
	mu     sync.RWMutex
	routes []Route
	logger *slog.Logger
	stats  *Stats
	// placement routes the calls of node-scoped backends by object
	// (SetPlacement); nil: every call goes to this node's backend.
	placement atomic.Pointer[Placement]
	// local is set on the internal port's proxy (SetLocal): this node's
	// name.
	local string
	// cursors keep what cluster-wide lists read for their next pages.
	cursors listCursors
}

// NewProxy returns a proxy with no routes. stats may be nil.
func NewProxy(logger *slog.Logger, stats *Stats) *Proxy {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Proxy{logger: logger, stats: stats}
}

// SetRoutes replaces the routes; the first route whose prefix matches a
// method wins. Calls in flight keep their backend.
func (p *Proxy) SetRoutes(routes []Route) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.routes = append([]Route(nil), routes...)
}

// Route returns the backend of a method, nil when no route matches.
func (p *Proxy) Route(method string) *Backend {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, r := range p.routes {
		if matchPrefix(method, r.Prefix) {
			return r.Backend
		}
	}
	return nil
}

// RoutedServices are the services the routes name whole: the prefixes
// that are a service's full name ("/pkg.v1.Service", with or without
// the final "/"), with their backends.
func (p *Proxy) RoutedServices() map[string]*Backend {
	p.mu.RLock()
	defer p.mu.RUnlock()
	out := make(map[string]*Backend)
	for _, r := range p.routes {
		name := strings.TrimSuffix(strings.TrimPrefix(r.Prefix, "/"), "/")
		if name == "" || strings.ContainsAny(name, "/") || !strings.Contains(name, ".") || strings.HasSuffix(name, ".") {
			continue
		}
		if _, seen := out[name]; !seen {
			out[name] = r.Backend
		}
	}
	return out
}

// Schemas are the schemas the routes name, each once.
func (p *Proxy) Schemas() []*Schema {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var out []*Schema
	for _, r := range p.routes {
		if r.Schema != nil && !slices.Contains(out, r.Schema) {
			out = append(out, r.Schema)
		}
	}
	return out
}

// routeOf is the route of a method, nil when none matches. The Route
// stays valid after a SetRoutes (which replaces the slice).
func (p *Proxy) routeOf(method string) *Route {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for i := range p.routes {
		if matchPrefix(method, p.routes[i].Prefix) {
			return &p.routes[i]
		}
	}
	return nil
}

// Schema returns the schema the route of a method names, nil when the
// route names none (or no route matches).
func (p *Proxy) Schema(method string) *Schema {
	route := p.routeOf(method)
	switch {
	case route == nil:
		return nil
	case route.Schema != nil:
		if route.Schema.method(method) != nil {
			return route.Schema
		}
	case route.Reflector != nil:
		// Outside the lock: the first call may wait for the backend.
		return route.Reflector.Schema(method)
	}
	return nil
}

// lookup is what the proxy knows of a method: from the protos linked into
// the program, else from its route's schema.
func (p *Proxy) lookup(method string) methodInfo {
	if info := lookupMethod(method); info.known {
		return info
	}
	if s := p.Schema(method); s != nil {
		return s.info(method)
	}
	return methodInfo{}
}

// HasSchema reports whether the proxy has the schema of a method: linked
// into the program, from its route's descriptor set, or learned from its
// backend's server reflection (the first call of a route may wait for it).
func (p *Proxy) HasSchema(method string) bool { return p.lookup(method).known }

// HasFixedSchema reports whether a method's schema is linked into the
// program or in its route's descriptor set: what is known before any call,
// without asking a backend.
func (p *Proxy) HasFixedSchema(method string) bool {
	if lookupMethod(method).known {
		return true
	}
	route := p.routeOf(method)
	return route != nil && route.Schema != nil && route.Schema.method(method) != nil
}

// DescriptorSetMethod is the descriptor of a method from its route's
// descriptor set (routing.rules[].route.descriptor_set), nil when the
// route names none or the set lacks the method, and for a method linked
// into the program (which wins over a descriptor set). A schema learned
// from the backend's server reflection is never one: what the operator
// supplied is known before any call, and is not the backend's word.
func (p *Proxy) DescriptorSetMethod(method string) protoreflect.MethodDescriptor {
	if lookupMethod(method).known {
		return nil
	}
	route := p.routeOf(method)
	if route == nil || route.Schema == nil {
		return nil
	}
	return route.Schema.method(method)
}

// matchPrefix matches a route prefix on name boundaries: the prefix
// "/pivirt.vm.v1.VMService" covers "/pivirt.vm.v1.VMService/GetVM", not
// "/pivirt.vm.v1.VMServiceAdmin/..."; a prefix ending in "/" or "."
// ("/pivirt.") covers what follows it.
func matchPrefix(method, prefix string) bool {
	if !strings.HasPrefix(method, prefix) {
		return false
	}
	rest := method[len(prefix):]
	return rest == "" || strings.HasSuffix(prefix, "/") || strings.HasSuffix(prefix, ".") || strings.HasPrefix(rest, "/")
}

// bidi describes every call as bidi streaming: the proxy does not need the
// shape to forward it.
var bidi = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// Handle is a grpc.StreamHandler for grpc.UnknownServiceHandler: it
// forwards the call to the backend its route names, or fails it with
// Unimplemented.
func (p *Proxy) Handle(_ any, ss grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(ss)
	if !ok {
		return status.Error(codes.Internal, "no method name on the stream")
	}
	b := p.Route(method)
	if b == nil {
		return status.Errorf(codes.Unimplemented, "unknown method %s: no routing rule matches it", method)
	}
	start := time.Now()
	var err error
	switch pl := p.placement.Load(); {
	case p.local != "":
		err = p.serveForPeer(ss, method, b)
	case pl != nil && b.NodeScoped():
		err = p.place(ss, method, b, *pl)
	default:
		err = p.forward(ss, method, b, nil)
	}
	if p.stats != nil {
		p.stats.observe(b.Name(), status.Code(err), time.Since(start))
	}
	return err
}

// forward sends the call to b. A call with one request message (unary or
// server streaming, known from the schema) is read first and, when
// idempotent, may be tried again (Retry); any other call makes one attempt
// relayed as a stream in both directions. first, when set, is the call's
// first request message, already read (the placement routing reads it to
// find the object); forward owns it.
func (p *Proxy) forward(ss grpc.ServerStream, method string, b *Backend, first *Frame) error {
	b.inflight.Add(1)
	defer b.inflight.Add(-1)
	if p.stats != nil {
		defer p.stats.active(b.Name())()
	}
	ctx := outgoingContext(ss.Context())
	info := p.lookup(method)
	// The per-try timeout bounds unary calls only: a stream (a watch, a
	// console, an upload) lives as long as its caller wants.
	unary := info.known && !info.clientStreams && !info.serverStreams
	if info.known && !info.clientStreams {
		// One request message: read it first (no goroutine to pump the
		// client's side), which also makes the call retryable.
		attempts := 1
		if info.idempotent {
			attempts = max(1, b.cfg.Retry.MaxAttempts)
		}
		return p.forwardRetrying(ctx, ss, method, b, attempts, unary, first)
	}
	if first != nil {
		defer first.Free()
	}
	ep, err := b.pick(nil)
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	res := p.attempt(ctx, ss, method, b, ep, nil, first, false)
	return res.finish(ss)
}

// forwardRetrying reads the single request message, then makes attempts
// (at most maxAttempts) until one succeeds, sends anything to the client,
// fails with a code not worth retrying, or attempts, budget or deadline
// run out.
func (p *Proxy) forwardRetrying(ctx context.Context, ss grpc.ServerStream, method string, b *Backend, maxAttempts int, unary bool, req *Frame) error {
	if req == nil {
		var err error
		if req, err = recvFirst(ss); err != nil {
			return err
		}
	}
	defer req.Free()
	var (
		tried []*Endpoint
		res   attemptResult
	)
	for n := 1; ; n++ {
		ep, err := b.pick(tried)
		if err != nil {
			if res.err != nil {
				return res.finish(ss) // the last attempt's answer says more
			}
			return status.Error(codes.Unavailable, err.Error())
		}
		tried = append(tried, ep)
		if n == 1 {
			res = p.attempt(ctx, ss, method, b, ep, req, nil, unary)
		} else {
			// A retry holds a slot of the budget while it runs.
			release, ok := b.retryAllowed()
			if !ok {
				p.logger.DebugContext(ctx, "retry budget exhausted", "backend", b.Name(), "method", method)
				return res.finish(ss)
			}
			if p.stats != nil {
				p.stats.retry(b.Name())
			}
			res = p.attempt(ctx, ss, method, b, ep, req, nil, unary)
			release()
		}
		if res.err == nil || res.sent || res.clientGone || n >= maxAttempts || !res.retryable() {
			return res.finish(ss)
		}
		wait := backoff(b.cfg.Retry.Backoff, n)
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= wait {
			return res.finish(ss) // no time left for another attempt
		}
		if !b.retryPossible() {
			p.logger.DebugContext(ctx, "retry budget exhausted", "backend", b.Name(), "method", method)
			return res.finish(ss) // no need to wait for a retry the budget refuses
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
	}
}

// backoff is the wait before attempt n+1: full jitter over base×2^(n-1),
// at most ten times base.
func backoff(base time.Duration, n int) time.Duration {
	if base <= 0 {
		return 0
	}
	ceil := min(base<<min(n-1, 16), 10*base)
	return time.Duration(rand.Int64N(int64(ceil) + 1))
}

// attemptResult is how one attempt ended.
type attemptResult struct {
	err error
	// sent: something reached the client (headers or a message), so the
	// call cannot be tried again.
	sent bool
	// perTryTimeout: the attempt's own timeout fired (not the caller's).
	perTryTimeout bool
	// clientGone: sending to the client failed; says nothing of the
	// backend.
	clientGone bool
	// trailer of the backend, for the client when this is the final
	// attempt.
	trailer metadata.MD
}

// retryable reports whether the failure is worth another attempt.
func (r attemptResult) retryable() bool {
	code := status.Code(r.err)
	return code == codes.Unavailable || (code == codes.DeadlineExceeded && r.perTryTimeout)
}

// finish answers the client with the attempt's outcome and trailer.
func (r attemptResult) finish(ss grpc.ServerStream) error {
	ss.SetTrailer(r.trailer)
	return r.err
}

// recvOne reads a call's first request message (of any method: the rest
// of a client stream is relayed after it).
func recvOne(ss grpc.ServerStream) (*Frame, error) {
	req := new(Frame)
	if err := ss.RecvMsg(req); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, status.Error(codes.Unimplemented, "the call sent no request message: the method needs one")
		}
		return nil, err
	}
	return req, nil
}

// recvFirst reads the one request message of a call of a method that is
// not client-streaming, and the end of the caller's stream after it (as
// grpc-go's server does). No message or more than one is Unimplemented,
// a gRPC server's answer to a call of the wrong cardinality (what
// connect-go answers and the Connect conformance suite expects).
func recvFirst(ss grpc.ServerStream) (*Frame, error) {
	req, err := recvOne(ss)
	if err != nil {
		return nil, err
	}
	extra := new(Frame)
	switch err := ss.RecvMsg(extra); {
	case err == nil:
		extra.Free()
		req.Free()
		return nil, status.Error(codes.Unimplemented, "the method takes one request message: the call sent more")
	case !errors.Is(err, io.EOF):
		req.Free()
		return nil, err
	}
	return req, nil
}

// attempt makes one call on ep. With req set it sends that message and
// closes the request side; otherwise it relays the client's messages as
// they come (first, when set, before them: the first message, already
// read). The backend's header goes to the client as soon as it arrives
// (after that the call is the backend's: no retry), its messages as they
// come. With timeout set, backends.<name>.timeout bounds the attempt.
func (p *Proxy) attempt(ctx context.Context, ss grpc.ServerStream, method string, b *Backend, ep *Endpoint, req, first *Frame, timeout bool) (res attemptResult) {
	ep.active.Add(1)
	defer ep.active.Add(-1)
	defer func() {
		if !res.clientGone {
			b.report(ep, status.Code(res.err), res.perTryTimeout)
		}
	}()

	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	tctx := actx
	var tryDeadline time.Time
	if timeout && b.cfg.Timeout > 0 {
		tryDeadline = time.Now().Add(b.cfg.Timeout)
		if dl, ok := ctx.Deadline(); !ok || tryDeadline.Before(dl) {
			var tcancel context.CancelFunc
			tctx, tcancel = context.WithDeadline(actx, tryDeadline)
			defer tcancel()
		} else {
			tryDeadline = time.Time{} // the caller's deadline binds first
		}
	}
	// perTry tells an attempt timeout from the caller's deadline by which
	// deadline bound the attempt, not by which context noticed first.
	// A backend's own DeadlineExceeded, returned before the attempt's
	// deadline, is the backend's answer. (grpc-go rounds grpc-timeout
	// up, so the backend's deadline is never before ours.)
	perTry := func(err error) bool {
		return !tryDeadline.IsZero() && status.Code(err) == codes.DeadlineExceeded && !time.Now().Before(tryDeadline)
	}
	cs, err := ep.conn.NewStream(tctx, bidi, method, wireOptions(ss.Context(), ep.acceptsCompression)...)
	if err != nil {
		return attemptResult{err: err, perTryTimeout: perTry(err)}
	}
	info := p.lookup(method)
	unary := info.known && !info.clientStreams && !info.serverStreams
	res = relay(cancel, ss, cs, req, first, unary, func(hdr metadata.MD) {
		if v := hdr.Get("grpc-accept-encoding"); len(v) > 0 {
			a := strings.Join(v, ",")
			ep.accepts.Store(&a)
		}
	})
	if res.err != nil && !res.clientGone && perTry(res.err) {
		res.perTryTimeout = true
		res.err = status.Errorf(codes.DeadlineExceeded, "backend %s: attempt timed out after %s (backends.%s.timeout)", b.Name(), b.cfg.Timeout, b.Name())
	}
	return res
}

// relay runs a call on cs for the client's stream ss: req (one message,
// then the request side closes), or the client's messages as they come
// (first before them when set); the answer's header, messages and trailer
// back. cancel ends cs's call. unary says the method answers one
// message.
func relay(cancel context.CancelFunc, ss grpc.ServerStream, cs grpc.ClientStream, req, first *Frame, unary bool, onHeader func(metadata.MD)) (res attemptResult) {
	// refused is the status that ended the client's side of a stream
	// other than by going away: the guard refused a later message (it
	// names another object), or it was too large. The call ends with it,
	// not as cancelled.
	var refused atomic.Pointer[error]
	if req != nil {
		if err := cs.SendMsg(req); err == nil {
			_ = cs.CloseSend()
		}
	} else {
		// Client to backend.
		go func() {
			if first != nil {
				if err := cs.SendMsg(first); err != nil {
					return
				}
			}
			for {
				f := new(Frame)
				if err := ss.RecvMsg(f); err != nil {
					if errors.Is(err, io.EOF) {
						_ = cs.CloseSend()
						return
					}
					if st, ok := status.FromError(err); ok && st.Code() != codes.Canceled && st.Code() != codes.DeadlineExceeded {
						refused.Store(&err)
					}
					cancel() // the client's side ended: so does the backend call
					return
				}
				err := cs.SendMsg(f)
				f.Free()
				if err != nil {
					// The backend call ended; RecvMsg below reports how.
					return
				}
			}
		}()
	}

	// Backend to client. A backend answering with trailers only (an
	// error before any header) is answered with trailers only too: its
	// Header is nil.
	hdr, _ := cs.Header()
	if hdr != nil && onHeader != nil {
		onHeader(hdr)
	}
	// A unary answer's header waits for its message, so both leave in
	// one write instead of a frame (and a flush) each; an answer without
	// a message sends it on its own before the trailer, as a stream's
	// header is sent at once.
	pending := false
	if hdr != nil {
		var err error
		if unary {
			err, pending = ss.SetHeader(responseMetadata(hdr)), true
		} else {
			err = ss.SendHeader(responseMetadata(hdr))
		}
		if err != nil {
			res.err, res.clientGone = err, true
			return res
		}
		res.sent = true
	}
	for {
		f := new(Frame)
		err := cs.RecvMsg(f)
		if err != nil {
			if r := refused.Load(); r != nil {
				// The client's stream was refused; the backend's answer
				// (cancelled) says nothing of the backend.
				res.err, res.clientGone = *r, true
				return res
			}
			if pending {
				if err := ss.SendHeader(nil); err != nil {
					res.err, res.clientGone = err, true
					return res
				}
			}
			res.trailer = responseMetadata(cs.Trailer())
			if !errors.Is(err, io.EOF) {
				res.err = err
			}
			return res
		}
		err = ss.SendMsg(f)
		f.Free()
		if err != nil {
			res.err, res.clientGone = err, true
			return res
		}
		res.sent, pending = true, false
	}
}

// hopHeaders are not forwarded: transport and protocol headers that the
// next hop sets itself.
var hopHeaders = map[string]bool{
	":authority": true, "content-type": true, "user-agent": true, "te": true, "host": true,
	"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true, "upgrade": true,
	"grpc-timeout": true, "grpc-encoding": true, "grpc-accept-encoding": true,
	"grpc-status": true, "grpc-message": true, "grpc-status-details-bin": true,
	"content-length": true, "accept-encoding": true, "content-encoding": true,
	// The caller's credentials are for the gateway, which authenticates
	// it; backends see the agent's own identity (mutual TLS).
	"authorization": true, "proxy-authorization": true, "cookie": true,
	// The caller's identity as the gateway authenticated it: set by the
	// gateway only, never passed on from a client.
	IdentityHeader: true, RolesHeader: true,
	// A relayed caller's credential: set for calls to other agents only
	// (access.RelayHeaders), never passed on from a client.
	authz.CallerTokenHeader: true, authz.CallerCertHeader: true, authz.CallerMethodHeader: true,
}

// The headers that tell a backend on whose behalf the agent calls: the
// authenticated principal's identity and roles (comma-separated), each
// percent-encoded UTF-8 (url.PathEscape: "józsef" is "j%C3%B3zsef"). A
// backend may use them (pivirtd makes the identity the owner of what it
// creates without one); it trusts them because the call comes over mutual
// TLS from an agent.
const (
	IdentityHeader = "x-pivirt-identity"
	RolesHeader    = "x-pivirt-roles"
)

// ForwardedUserAgentHeader carries the user agents of a forwarded call's
// callers, the first caller's first (one value each, as x-forwarded-for
// lists addresses): grpc-go writes the connection's user agent (the
// agent's, "pivirt-agent/VERSION grpc-go/…") on every call and cannot
// send a call's own, as gRPC proxies built on it cannot (grpc-gateway
// sends grpcgateway-user-agent for the same reason).
const ForwardedUserAgentHeader = "x-forwarded-user-agent"

// requestIDHeader is observe.HeaderRequestID as gRPC metadata keys are
// written (lower case).
var requestIDHeader = strings.ToLower(observe.HeaderRequestID)

// outgoingContext carries the caller's metadata (without hop headers) to
// the backend, adding the caller's address to x-forwarded-for and the
// call's request ID (observe.RequestFrom) as x-request-id. The deadline
// travels with the context.
func outgoingContext(ctx context.Context) context.Context {
	// FromIncomingContext returns a copy of its own: the hop headers are
	// dropped from it rather than copying it once more.
	out, _ := metadata.FromIncomingContext(ctx)
	if out == nil {
		out = metadata.MD{}
	}
	ua := out["user-agent"]
	for k := range out {
		if hopHeaders[k] {
			delete(out, k)
		}
	}
	if pr, ok := peer.FromContext(ctx); ok && pr.Addr != nil {
		var host string
		if ta, ok := pr.Addr.(*net.TCPAddr); ok {
			host = ta.IP.String()
		} else {
			host = pr.Addr.String()
			if h, _, err := net.SplitHostPort(host); err == nil {
				host = h
			}
		}
		if prev := out.Get("x-forwarded-for"); len(prev) > 0 {
			host = strings.Join(prev, ", ") + ", " + host
		}
		out.Set("x-forwarded-for", host)
	}
	if len(ua) > 0 {
		// grpc-go sends one user agent per connection (the agent's) and
		// drops a call's own: the caller's travels on beside it, after
		// those of the gateways before this one.
		out[ForwardedUserAgentHeader] = append(slices.Clone(out.Get(ForwardedUserAgentHeader)), ua...)
	}
	if r, ok := observe.RequestFrom(ctx); ok {
		// The call's ID, the caller's or the one the gateway made.
		out.Set(requestIDHeader, r.ID)
	}
	if p, ok := authz.PrincipalFrom(ctx); ok {
		out.Set(IdentityHeader, url.PathEscape(p.Identity))
		if len(p.Roles) > 0 {
			roles := make([]string, len(p.Roles))
			for i, r := range p.Roles {
				roles[i] = url.PathEscape(r)
			}
			out.Set(RolesHeader, strings.Join(roles, ","))
		}
	}
	return metadata.NewOutgoingContext(ctx, out)
}

// responseMetadata drops hop headers from a backend's headers or trailers.
func responseMetadata(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		if !hopHeaders[k] {
			out[k] = v
		}
	}
	return out
}
