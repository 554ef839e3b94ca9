package mesh

import (
	"context"
	"errors"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// Placement tells the proxy where the objects of node-scoped backends live
// and how to reach the other nodes' agents (the agent implements it with
// the replicated placement catalog, gossip and its connection pool).
type Placement interface {
	// Self is this node's name.
	Self() string
	// Locate names the node holding an object of a kind (the object's
	// RBAC resource: "virtualmachines", "volumes", "networks"); ok is
	// false when the catalog does not know the object.
	Locate(kind, id string) (node string, ok bool)
	// Nodes are the names of the cluster's nodes, this one included,
	// sorted.
	Nodes() []string
	// Peer is the connection to a node's agent (its internal port), or an
	// error saying why the node cannot be reached (unknown, not alive).
	Peer(node string) (grpc.ClientConnInterface, error)
	// Routing is nil while calls are routed by object, else why they are
	// not (the cluster version does not allow it yet): every call then
	// goes to this node's backend, as before routing by object existed,
	// and a call that names another node is refused with the error.
	Routing() error
}

// Headers of placement routing.
const (
	// NodeHeader names the node whose backend answered a call that a peer
	// agent served for this one (response header).
	NodeHeader = "pivirt-node"
	// UnavailableNodesHeader lists the nodes ("node: reason", one value
	// each) that a cluster-wide list or watch could not reach: the
	// answer holds the objects of every other node (response header).
	UnavailableNodesHeader = "pivirt-unavailable-nodes"
)

// Bounds of cluster-wide calls.
const (
	// lookupTimeout bounds asking the nodes for an object the catalog
	// does not know.
	lookupTimeout = 5 * time.Second
	// listTimeout bounds each call a cluster-wide list makes to a node,
	// within the caller's deadline.
	listTimeout = 10 * time.Second
	// Page sizes of a cluster-wide list: as the APIs document.
	defaultPageSize, maxPageSize = 100, 1000
)

// SetPlacement turns on routing by object for node-scoped backends: a
// call naming an object goes to the node the catalog names, lists and
// watches span every node, a create goes to the node it names. nil turns
// it off (every call goes to this node's backend).
func (p *Proxy) SetPlacement(pl Placement) {
	if pl == nil {
		p.placement.Store(nil)
		return
	}
	p.placement.Store(&pl)
}

// SetLocal makes p the proxy of the internal port: it serves calls that
// other agents route to this node (self), on node-scoped backends only,
// without routing them further. The caller is the one the internal port's
// interceptors authenticated from the credential the calling agent relayed;
// a call with none (a power schedule's action, or an agent of a release
// that relays no caller, which the interceptors let through only while the
// cluster version allows it) is on behalf of the identity headers.
func (p *Proxy) SetLocal(self string) { p.local = self }

// serveForPeer serves a call another agent routed here.
func (p *Proxy) serveForPeer(ss grpc.ServerStream, method string, b *Backend) error {
	if !b.NodeScoped() {
		return status.Errorf(codes.Unimplemented, "%s: backend %s is not node-scoped; the calling agent reaches it itself", method, b.Name())
	}
	ctx := ss.Context()
	if _, ok := authz.PrincipalFrom(ctx); !ok {
		ctx = headerPrincipal(ctx)
	}
	if err := ss.SetHeader(metadata.Pairs(NodeHeader, p.local)); err != nil {
		return err
	}
	return p.forward(&ctxStream{ServerStream: ss, ctx: ctx}, method, b, nil)
}

// headerPrincipal records the caller the identity headers name.
func headerPrincipal(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	ids := md.Get(IdentityHeader)
	if len(ids) != 1 {
		return ctx
	}
	who := authz.Principal{}
	who.Identity, _ = url.PathUnescape(ids[0])
	if roles := md.Get(RolesHeader); len(roles) == 1 && roles[0] != "" {
		for r := range strings.SplitSeq(roles[0], ",") {
			role, _ := url.PathUnescape(r)
			who.Roles = append(who.Roles, role)
		}
	}
	return authz.WithPrincipal(ctx, who)
}

// WithStreamContext is ss with ctx as its context (an interceptor's
// additions to the call's context, for the handler).
func WithStreamContext(ss grpc.ServerStream, ctx context.Context) grpc.ServerStream {
	return &ctxStream{ServerStream: ss, ctx: ctx}
}

// ctxStream is a server stream with another context.
type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *ctxStream) Context() context.Context { return s.ctx }

// place routes a call of a node-scoped backend by the object it names.
func (p *Proxy) place(ss grpc.ServerStream, method string, b *Backend, pl Placement) error {
	info := p.lookup(method)
	r := info.rule
	if !info.known || r == nil {
		return p.forward(ss, method, b, nil)
	}
	if off := pl.Routing(); off != nil {
		return p.localOnly(ss, method, b, pl, info, off)
	}
	switch {
	case r.GetIdField() != "":
		first, req, err := recvRequest(ss, info)
		if err != nil {
			return err
		}
		id := stringAt(req, r.GetIdField())
		if id == "" {
			return p.forward(ss, method, b, first) // the backend names what is missing
		}
		node, err := p.locate(ss.Context(), pl, b, info, id)
		if err != nil {
			first.Free()
			return err
		}
		return p.toNode(ss, method, b, pl, node, first, info.object(id))
	case r.GetVerb() == "create":
		first, req, err := recvRequest(ss, info)
		if err != nil {
			return err
		}
		host := stringAt(req, "host")
		if host == "" && r.GetObjectField() != "" {
			host = stringAt(req, r.GetObjectField()+".host")
		}
		if host != "" && host != pl.Self() && !slices.Contains(pl.Nodes(), host) {
			first.Free()
			return status.Errorf(codes.InvalidArgument, "host %q: no such node (nodes: %s)", host, strings.Join(pl.Nodes(), ", "))
		}
		return p.toNode(ss, method, b, pl, host, first, "the new "+info.singular())
	case r.GetVerb() == "list" && info.serverStreams && !info.clientStreams:
		return p.watchAll(ss, method, b, pl, info)
	case r.GetVerb() == "list" && !info.serverStreams && !info.clientStreams && r.GetListField() != "":
		return p.listAll(ss, method, b, pl, info)
	}
	return p.forward(ss, method, b, nil)
}

// toNode sends the call to node's backend: this node's own, or another
// node's through its agent. what names the object for errors.
func (p *Proxy) toNode(ss grpc.ServerStream, method string, b *Backend, pl Placement, node string, first *Frame, what string) error {
	if node == "" || node == pl.Self() {
		return p.forward(ss, method, b, first)
	}
	defer first.Free()
	conn, err := pl.Peer(node)
	if err != nil {
		return unreachable(what, node, err)
	}
	ctx, cancel := context.WithCancel(outgoingContext(ss.Context()))
	defer cancel()
	info := p.lookup(method)
	var req *Frame
	if info.known && !info.clientStreams {
		req, first = first, nil
	}
	cs, err := conn.NewStream(ctx, bidi, method, append([]grpc.CallOption{grpc.ForceCodecV2(Codec())}, wireOptions(ss.Context(), nil)...)...)
	if err != nil {
		return unreachable(what, node, err)
	}
	res := relay(cancel, ss, cs, req, first, info.known && !info.clientStreams && !info.serverStreams, nil)
	if !res.sent && !res.clientGone && status.Code(res.err) == codes.Unavailable {
		// No header came: the node's agent did not answer (its
		// answers always carry NodeHeader).
		return unreachable(what, node, res.err)
	}
	return res.finish(ss)
}

// locate finds the node holding an object: the catalog's answer, else
// the nodes are asked (an object made behind the agents' backs, or so
// recently that the catalog has not heard of it yet). "" means this node:
// its backend answers NotFound when no node holds the object.
func (p *Proxy) locate(ctx context.Context, pl Placement, b *Backend, info methodInfo, id string) (string, error) {
	if node, ok := pl.Locate(info.rule.GetResource(), id); ok {
		return node, nil
	}
	if info.getter == "" {
		return "", nil
	}
	caller := ctx
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	// callerBound: the caller's deadline comes before the lookup's own,
	// so a node's Canceled or DeadlineExceeded is the caller's deadline
	// (the node may notice it first: grpc-timeout rounds), not the node's
	// fault.
	lookupDeadline, _ := ctx.Deadline()
	callerDeadline, callerBound := caller.Deadline()
	callerBound = callerBound && !callerDeadline.After(lookupDeadline)
	type answer struct {
		node string
		err  error
	}
	nodes := pl.Nodes()
	answers := make(chan answer, len(nodes))
	for _, node := range nodes {
		go func() {
			req := newMessage(info.getterIn)
			setString(req, "id", id)
			resp := newMessage(info.getterOut)
			answers <- answer{node, p.invokeOn(ctx, pl, b, node, info.getter, req.Interface(), resp.Interface())}
		}()
	}
	var (
		unreachable []string
		interrupted bool
	)
	for range nodes {
		a := <-answers
		switch code := status.Code(a.err); {
		case code == codes.OK, code == codes.PermissionDenied:
			// PermissionDenied: the node holds the object and checked
			// the caller's rights on it (only a node holding it can).
			return a.node, nil
		case code == codes.NotFound:
		case callerBound && (code == codes.Canceled || code == codes.DeadlineExceeded):
			interrupted = true
		default:
			unreachable = append(unreachable, a.node+": "+status.Convert(a.err).Message())
		}
	}
	if err := caller.Err(); err != nil || interrupted {
		// The caller's deadline or cancellation ended the lookup: that
		// is the answer, not the nodes it interrupted.
		if errors.Is(err, context.Canceled) {
			return "", status.FromContextError(err).Err()
		}
		return "", status.Errorf(codes.DeadlineExceeded, "the deadline passed while the nodes were asked for %s (it is not in the placement catalog yet)", info.object(id))
	}
	if len(unreachable) > 0 {
		slices.Sort(unreachable)
		return "", status.Errorf(codes.Unavailable, "%s is not in the placement catalog and not on the nodes that answered; not every node could be asked (%s)", info.object(id), strings.Join(unreachable, "; "))
	}
	return "", nil
}

// invokeOn makes a unary call on node's backend.
func (p *Proxy) invokeOn(ctx context.Context, pl Placement, b *Backend, node, method string, req, resp proto.Message) error {
	if node == pl.Self() {
		return b.Invoke(ctx, method, req, resp)
	}
	conn, err := pl.Peer(node)
	if err != nil {
		return status.Errorf(codes.Unavailable, "node %s is unreachable: %v", node, err)
	}
	return conn.Invoke(outgoingContext(ctx), method, req, resp)
}

// Invoke makes a unary call for the agent itself (the power schedules'
// actions, the objects RBAC conditions are checked against) where the
// call's object lives, as a client's call would go. It returns the node
// that served it.
func (p *Proxy) Invoke(ctx context.Context, method string, req, resp proto.Message) (node string, err error) {
	b := p.Route(method)
	if b == nil {
		return "", status.Errorf(codes.Unimplemented, "no routing rule matches %s", method)
	}
	plp := p.placement.Load()
	info := p.lookup(method)
	if plp == nil || !b.NodeScoped() || info.rule == nil || info.rule.GetIdField() == "" || (*plp).Routing() != nil {
		return "", b.Invoke(ctx, method, req, resp)
	}
	pl := *plp
	id := stringAt(req.ProtoReflect(), info.rule.GetIdField())
	node = pl.Self()
	if id != "" {
		found, err := p.locate(ctx, pl, b, info, id)
		if err != nil {
			return "", err
		}
		if found != "" {
			node = found
		}
	}
	err = p.invokeOn(ctx, pl, b, node, method, req, resp)
	if node != pl.Self() && status.Code(err) == codes.Unavailable {
		err = unreachable(info.object(id), node, err)
	}
	return node, err
}

// InvokeHere makes a unary call on this node's backend for the method,
// without locating its object: for a call another agent routed here (its
// object is here, or nowhere), whose RBAC conditions are checked against
// the object where the call executes. Asking the other nodes from there
// would route the check back and forth between the agents.
func (p *Proxy) InvokeHere(ctx context.Context, method string, req, resp proto.Message) error {
	b := p.Route(method)
	if b == nil {
		return status.Errorf(codes.Unimplemented, "no routing rule matches %s", method)
	}
	return b.Invoke(ctx, method, req, resp)
}

// unreachable is the error of a call whose object is on a node that
// cannot be reached: Unavailable, naming the object and the node, never
// NotFound.
func unreachable(what, node string, err error) error {
	msg := err.Error()
	if st, ok := status.FromError(err); ok {
		msg = st.Message()
	}
	return status.Errorf(codes.Unavailable, "%s is on %s, which is unreachable: %s", what, node, msg)
}

// localOnly serves a call on this node's backend while routing by object
// is off: a call that names another node (a create's host, a list's or
// watch's host filter) is refused with off, since this node cannot take
// it there.
func (p *Proxy) localOnly(ss grpc.ServerStream, method string, b *Backend, pl Placement, info methodInfo, off error) error {
	r := info.rule
	if r.GetVerb() != "create" && r.GetVerb() != "list" {
		return p.forward(ss, method, b, nil)
	}
	if info.clientStreams {
		return p.forward(ss, method, b, nil)
	}
	first, req, err := recvRequest(ss, info)
	if err != nil {
		return err
	}
	host := stringAt(req, "host")
	if host == "" && r.GetVerb() == "create" && r.GetObjectField() != "" {
		host = stringAt(req, r.GetObjectField()+".host")
	}
	if host != "" && host != pl.Self() {
		first.Free()
		return status.Errorf(codes.FailedPrecondition, "host %q: %v", host, off)
	}
	return p.forward(ss, method, b, first)
}

// maxUnavailableReason bounds the reason given for one node in
// UnavailableNodesHeader.
const maxUnavailableReason = 300

// unavailableNode is one value of UnavailableNodesHeader: "node: reason".
// A header value must be printable ASCII (gRPC refuses the whole answer
// otherwise), and an error's text may hold anything (a backend's
// multi-line message, a node name in another script): whitespace runs
// become one space, other characters outside printable ASCII a '?', and
// the reason is cut at maxUnavailableReason bytes.
func unavailableNode(node string, err error) string {
	v := strings.Join(strings.Fields(node+": "+status.Convert(err).Message()), " ")
	b := []byte(v)
	out := b[:0]
	for _, r := range v {
		if r < 0x20 || r > 0x7e {
			r = '?'
		}
		out = append(out, byte(r))
	}
	if len(out) > maxUnavailableReason {
		out = append(out[:maxUnavailableReason-3], "..."...)
	}
	return string(out)
}

// watchAll streams the changes of every node (or of the node the
// request's host names): a watch on each node, their events relayed as
// they come. A node's watch that fails is opened again (its existing
// objects come again); the call ends when the caller ends it. Nodes that
// could not be watched at the start are named in UnavailableNodesHeader.
func (p *Proxy) watchAll(ss grpc.ServerStream, method string, b *Backend, pl Placement, info methodInfo) error {
	first, req, err := recvRequest(ss, info)
	if err != nil {
		return err
	}
	first.Free()
	nodes, err := hostFilter(pl, stringAt(req, "host"))
	if err != nil {
		return err
	}
	clearField(req, "host")
	body, err := proto.Marshal(req.Interface())
	if err != nil {
		return status.Errorf(codes.Internal, "encode the watch request: %v", err)
	}
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()

	type opened struct {
		node string
		cs   grpc.ClientStream
		err  error
	}
	open := func(node string) (grpc.ClientStream, error) {
		var conn grpc.ClientConnInterface
		if node == pl.Self() {
			ep, err := b.pick(nil)
			if err != nil {
				return nil, status.Error(codes.Unavailable, err.Error())
			}
			conn = ep.conn
		} else {
			c, err := pl.Peer(node)
			if err != nil {
				return nil, status.Errorf(codes.Unavailable, "node %s is unreachable: %v", node, err)
			}
			conn = c
		}
		cs, err := conn.NewStream(outgoingContext(ctx), bidi, method, grpc.ForceCodecV2(Codec()))
		if err != nil {
			return nil, err
		}
		if err := cs.SendMsg(NewFrame(body)); err != nil {
			return nil, err
		}
		if err := cs.CloseSend(); err != nil {
			return nil, err
		}
		// Not waiting for the header: a backend sends it with its first
		// event, which an empty node never has.
		return cs, nil
	}
	results := make(chan opened, len(nodes))
	for _, node := range nodes {
		go func() {
			cs, err := open(node)
			results <- opened{node, cs, err}
		}()
	}
	var (
		streams []opened
		missing []string
	)
	for range nodes {
		o := <-results
		if o.err != nil {
			missing = append(missing, unavailableNode(o.node, o.err))
		}
		streams = append(streams, o)
	}
	if len(missing) == len(nodes) {
		return status.Errorf(codes.Unavailable, "no node could be watched: %s", strings.Join(missing, "; "))
	}
	md := metadata.MD{}
	if len(missing) > 0 {
		slices.Sort(missing)
		md.Set(UnavailableNodesHeader, missing...)
	}
	if err := ss.SendHeader(md); err != nil {
		return err
	}
	var (
		sendMu  sync.Mutex
		sendErr = make(chan error, 1)
		wg      sync.WaitGroup
	)
	for _, o := range streams {
		wg.Go(func() {
			cs := o.cs
			wait := time.Second
			for ctx.Err() == nil {
				if cs == nil {
					t := time.NewTimer(wait)
					select {
					case <-ctx.Done():
						t.Stop()
						return
					case <-t.C:
					}
					wait = min(2*wait, 30*time.Second)
					var err error
					if cs, err = open(o.node); err != nil {
						p.logger.DebugContext(ctx, "watch of a node failed; trying again", "node", o.node, "error", err)
						continue
					}
					wait = time.Second
				}
				for {
					f := new(Frame)
					if err := cs.RecvMsg(f); err != nil {
						if ctx.Err() == nil {
							p.logger.InfoContext(ctx, "watch of a node ended; opening it again", "node", o.node, "error", err)
						}
						cs = nil
						break
					}
					sendMu.Lock()
					err := ss.SendMsg(f)
					sendMu.Unlock()
					f.Free()
					if err != nil {
						select {
						case sendErr <- err:
						default:
						}
						cancel()
						return
					}
				}
			}
		})
	}
	wg.Wait()
	select {
	case err := <-sendErr:
		return err
	default:
	}
	return status.FromContextError(ss.Context().Err()).Err()
}

// hostFilter is the nodes a list or watch covers: every node, or the one
// host names.
func hostFilter(pl Placement, host string) ([]string, error) {
	nodes := pl.Nodes()
	if host == "" {
		return nodes, nil
	}
	if host != pl.Self() && !slices.Contains(nodes, host) {
		return nil, status.Errorf(codes.InvalidArgument, "host %q: no such node (nodes: %s)", host, strings.Join(nodes, ", "))
	}
	return []string{host}, nil
}

// recvRequest reads and decodes a call's first request message. The frame
// is the caller's to forward or free.
func recvRequest(ss grpc.ServerStream, info methodInfo) (*Frame, protoreflect.Message, error) {
	recv := recvFirst
	if info.clientStreams {
		recv = recvOne // the first of a stream (it names the object)
	}
	first, err := recv(ss)
	if err != nil {
		return nil, nil, err
	}
	req, err := info.decodeRequest(first)
	if err != nil {
		first.Free()
		return nil, nil, err
	}
	return first, req, nil
}

// decodeRequest decodes a request message of the method.
func (m methodInfo) decodeRequest(f *Frame) (protoreflect.Message, error) {
	msg := newMessage(m.input)
	if err := proto.Unmarshal(f.Bytes(), msg.Interface()); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "request of %s: %v", m.input.FullName(), err)
	}
	return msg, nil
}

// object names an object of the method's resource for errors ("vm vm-1").
func (m methodInfo) object(id string) string {
	return m.singular() + " " + id
}

// singular is the resource's object, as errors name it.
func (m methodInfo) singular() string {
	switch r := m.rule.GetResource(); r {
	case "virtualmachines":
		return "vm"
	default:
		return strings.TrimSuffix(r, "s")
	}
}

// stringAt is the string at a dotted field path of m ("" when a field
// is missing or not a string).
func stringAt(m protoreflect.Message, path string) string {
	for {
		name, rest, more := strings.Cut(path, ".")
		fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
		if fd == nil {
			return ""
		}
		if !more {
			if fd.Kind() != protoreflect.StringKind || fd.IsList() {
				return ""
			}
			return m.Get(fd).String()
		}
		if fd.Message() == nil || fd.IsList() || fd.IsMap() || !m.Has(fd) {
			return ""
		}
		m, path = m.Get(fd).Message(), rest
	}
}

func intAt(m protoreflect.Message, name string) int64 {
	fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
	if fd == nil || fd.Kind() != protoreflect.Int32Kind {
		return 0
	}
	return m.Get(fd).Int()
}

func setString(m protoreflect.Message, name, v string) {
	if fd := m.Descriptor().Fields().ByName(protoreflect.Name(name)); fd != nil && fd.Kind() == protoreflect.StringKind {
		m.Set(fd, protoreflect.ValueOfString(v))
	}
}

func setInt(m protoreflect.Message, name string, v int32) {
	if fd := m.Descriptor().Fields().ByName(protoreflect.Name(name)); fd != nil && fd.Kind() == protoreflect.Int32Kind {
		m.Set(fd, protoreflect.ValueOfInt32(v))
	}
}

func clearField(m protoreflect.Message, name string) {
	if fd := m.Descriptor().Fields().ByName(protoreflect.Name(name)); fd != nil {
		m.Clear(fd)
	}
}
