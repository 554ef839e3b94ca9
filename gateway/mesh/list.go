package mesh

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/simplelru"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// Bounds of the objects a cluster-wide list keeps between pages.
const (
	// listCursorTTL is how long the objects read for a page and not yet
	// returned are kept for the next page.
	listCursorTTL = 30 * time.Second
	// listCursorsMax and listCursorsBytes bound the lists kept at once,
	// in number and in the bytes of the objects they hold; the least
	// recently made goes first.
	listCursorsMax   = 256
	listCursorsBytes = 32 << 20
	// listCursorMaxBytes: a list holding more is not kept (its next page
	// reads the nodes again from where the page token says).
	listCursorMaxBytes = 8 << 20
	// maxTokenStateBytes bounds the nodes' positions a page token carries;
	// beyond it a token names the kept objects and the last ID alone.
	maxTokenStateBytes = 4096
)

// listAll answers a list with the objects of every node (or of the node
// the request's host names), merged by ID, a page at a time.
//
// Each node's backend lists its objects in ascending ID order, a page at
// a time, so the merge is a k-way merge of the nodes' pages: each node is
// asked for a page of the caller's page size (in parallel), a node whose
// objects run out before the page is full is asked for its next page, and
// the objects read and not returned are kept (listCursors) for the next
// page, which then asks no node that still has some. The page token holds
// the last ID returned and each node's position (its backend's token of
// the page holding its next object), so that a page asked of another
// agent, or after the kept objects expired, reads each node from there
// and skips what was returned, rather than listing every node from the
// start. A node whose list turns out not to be in ID order is read whole
// and the objects sorted (the page token then holds the last ID alone).
//
// Nodes that did not answer are named in UnavailableNodesHeader; their
// objects come on a later page again from the start of their list.
func (p *Proxy) listAll(ss grpc.ServerStream, method string, b *Backend, pl Placement, info methodInfo) error {
	first, req, err := recvRequest(ss, info)
	if err != nil {
		return err
	}
	first.Free()
	size := int(intAt(req, "page_size"))
	switch {
	case size < 0:
		return status.Errorf(codes.InvalidArgument, "page_size %d: must not be negative", size)
	case size == 0:
		size = defaultPageSize
	case size > maxPageSize:
		size = maxPageSize
	}
	tok, err := decodePageToken(stringAt(req, "page_token"))
	if err != nil {
		return err
	}
	nodes, err := hostFilter(pl, stringAt(req, "host"))
	if err != nil {
		return err
	}
	sub := proto.Clone(req.Interface()).ProtoReflect()
	clearField(sub, "page_token")
	clearField(sub, "host")
	clearField(sub, "page_size")
	fp, err := requestPrint(sub)
	if err != nil {
		return err
	}
	setInt(sub, "page_size", int32(size))

	ctx := ss.Context()
	l, err := newLister(p, pl, b, method, info, ctx, sub, tok.after)
	if err != nil {
		return err
	}
	l.size = size
	who := principalKey(ctx)
	keep := itemFilter(ctx)
	srcs := l.sources(nodes, tok, fp, who)
	sorted := l.idNum == 0
	var (
		page []listItem
		more bool
	)
	if !sorted {
		page, more, err = l.merge(srcs, size, keep)
		if errors.Is(err, errUnordered) {
			sorted = true
		}
	}
	if sorted {
		for i, n := range srcs {
			srcs[i] = &nodeList{node: n.node}
		}
		page, more, err = l.sorted(srcs, size, keep)
	}
	if err != nil {
		return err
	}
	var (
		missing []string
		lastErr error
	)
	for _, n := range srcs {
		if n.err != nil {
			missing = append(missing, unavailableNode(n.node, n.err))
			lastErr = n.err
		}
	}
	if len(missing) == len(srcs) && lastErr != nil {
		return status.Errorf(status.Code(lastErr), "no node answered the list: %s", strings.Join(missing, "; "))
	}
	var next string
	if more {
		last := string(page[len(page)-1].id)
		if sorted {
			next = encodePageToken(last)
		} else {
			next = encodePageTokenState(last, p.keepCursor(method, fp, who, last, srcs))
		}
	}
	if len(missing) > 0 {
		if err := ss.SetHeader(metadata.MD{UnavailableNodesHeader: missing}); err != nil {
			return err
		}
	}
	return ss.SendMsg(NewFrame(l.response(page, next)))
}

// errUnordered: a node's list is not in ascending ID order.
var errUnordered = errors.New("the list is not ordered by ID")

// listItem is one object of a node's list, as its backend encoded it (with
// the node's name filled in as its host).
type listItem struct {
	id, raw []byte // id: a slice of raw
}

// nodeList is one node's part of a cluster-wide list: the objects read
// from it and not yet returned, in ascending ID order, and where its list
// goes on.
type nodeList struct {
	node  string
	items []listItem
	// page is the backend's token of the page items came from ("": the
	// first), next the one after it; done: there is none after it.
	page, next string
	done       bool
	// resumed: next came from the caller's page token (a backend may no
	// longer take it).
	resumed bool
	// last is the last ID read, for the order check; bytes the size of
	// the buffer items are in.
	last  []byte
	bytes int
	// err: the node did not answer (it is named in the answer's header).
	err error
}

// position is where a later page reads the node from: the backend page
// holding its next object ("" and done: the node has no more).
func (n *nodeList) position() (page string, done bool) {
	if len(n.items) > 0 {
		return n.page, false
	}
	return n.next, n.done
}

// lister reads one cluster-wide list.
type lister struct {
	p      *Proxy
	pl     Placement
	b      *Backend
	method string
	ctx    context.Context
	// base is the request to each node without its page_token, whose
	// field number is tokenNum (0: the request has none).
	base     []byte
	tokenNum protowire.Number
	// after: objects up to this ID were returned already.
	after string
	// size is the page size asked of each node.
	size int
	// Field numbers: the response's list and next_page_token, an item's
	// id and host (0: none of that name and type).
	listNum, nextNum, idNum, hostNum protowire.Number
	item                             protoreflect.MessageDescriptor
}

func newLister(p *Proxy, pl Placement, b *Backend, method string, info methodInfo, ctx context.Context, sub protoreflect.Message, after string) (*lister, error) {
	base, err := proto.Marshal(sub.Interface())
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode the list request: %v", err)
	}
	l := &lister{p: p, pl: pl, b: b, method: method, ctx: ctx, base: base, after: after,
		listNum: info.listField.Number(), item: info.listField.Message()}
	if fd := stringField(sub.Descriptor(), "page_token"); fd != nil {
		l.tokenNum = fd.Number()
	}
	if fd := stringField(info.output, "next_page_token"); fd != nil {
		l.nextNum = fd.Number()
	}
	if fd := stringField(l.item, "id"); fd != nil {
		l.idNum = fd.Number()
	}
	if fd := stringField(l.item, "host"); fd != nil {
		l.hostNum = fd.Number()
	}
	return l, nil
}

// stringField is md's singular string field of that name, nil when it has
// none.
func stringField(md protoreflect.MessageDescriptor, name string) protoreflect.FieldDescriptor {
	fd := md.Fields().ByName(protoreflect.Name(name))
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() {
		return nil
	}
	return fd
}

// sources are the nodes' parts of the list: the objects kept from the
// previous page (its cursor), else where the page token says each node
// is, else each node's first page.
func (l *lister) sources(nodes []string, tok pageToken, fp, who string) []*nodeList {
	srcs := make([]*nodeList, len(nodes))
	var kept map[string]*nodeList
	if c := l.p.takeCursor(tok.state.Cursor, l.method, fp, who, tok.after); c != nil {
		kept = c.nodes
	}
	var pos map[string]tokenNode
	if kept == nil && tok.state.Request == fp {
		pos = make(map[string]tokenNode, len(tok.state.Nodes))
		for _, n := range tok.state.Nodes {
			pos[n.Node] = n
		}
	}
	for i, node := range nodes {
		if n, ok := kept[node]; ok {
			srcs[i] = n
			continue
		}
		n := &nodeList{node: node}
		if at, ok := pos[node]; ok {
			n.next, n.done, n.resumed = at.Page, at.Done, at.Page != ""
		}
		srcs[i] = n
	}
	return srcs
}

// merge answers a page of the merged list from the nodes' parts in ID
// order: up to size objects that keep (when set) accepts, and whether
// another follows. errUnordered: a node's list is not in ID order.
func (l *lister) merge(srcs []*nodeList, size int, keep func(protoreflect.Message) bool) ([]listItem, bool, error) {
	page := make([]listItem, 0, size)
	for {
		if err := l.refill(srcs); err != nil {
			return nil, false, err
		}
		var best *nodeList
		for _, n := range srcs {
			if n.err == nil && len(n.items) > 0 && (best == nil || bytes.Compare(n.items[0].id, best.items[0].id) < 0) {
				best = n
			}
		}
		if best == nil {
			return page, false, nil
		}
		it := best.items[0]
		if keep != nil {
			ok, err := l.keeps(keep, it)
			if err != nil {
				return nil, false, err
			}
			if !ok {
				best.items = best.items[1:]
				continue
			}
		}
		if len(page) == size {
			return page, true, nil // it stays for the next page
		}
		best.items = best.items[1:]
		page = append(page, it)
	}
}

// refill reads the next page of every node that answered so far, has no
// object left and is not done, in parallel. A node that fails is left out
// (its err set); the error returned is one that ends the list: errUnordered,
// or the request's own fault.
func (l *lister) refill(srcs []*nodeList) error {
	var need []*nodeList
	for _, n := range srcs {
		if n.err == nil && len(n.items) == 0 && !n.done {
			need = append(need, n)
		}
	}
	if len(need) == 1 {
		need[0].err = l.fetch(need[0], true)
	} else {
		var wg sync.WaitGroup
		for _, n := range need {
			wg.Go(func() { n.err = l.fetch(n, true) })
		}
		wg.Wait()
	}
	for _, n := range need {
		if errors.Is(n.err, errUnordered) {
			return errUnordered
		}
		if c := status.Code(n.err); c == codes.InvalidArgument || c == codes.PermissionDenied {
			return n.err // the request's own fault: every node would say so
		}
	}
	return nil
}

// fetch reads the node's next page that holds an object after l.after
// (ordered: its IDs checked for order and those up to l.after skipped).
func (l *lister) fetch(n *nodeList, ordered bool) error {
	for range 10_000 { // bound: 10 million objects
		req := l.request(n.next)
		ctx, cancel := context.WithTimeout(l.ctx, listTimeout)
		data, err := l.p.invokeRaw(ctx, l.pl, l.b, n.node, l.method, req)
		cancel()
		if err != nil {
			if n.resumed && status.Code(err) == codes.InvalidArgument {
				// The backend no longer takes the token it gave: the
				// node's list is read again from its first page (what
				// was returned is skipped).
				n.resumed, n.next = false, ""
				continue
			}
			return err
		}
		n.resumed = false
		items, next, size, err := l.parse(n, data, ordered)
		if err != nil {
			return err
		}
		n.items, n.bytes = items, size
		n.page, n.next, n.done = n.next, next, next == ""
		if len(items) > 0 || n.done {
			return nil
		}
	}
	return status.Errorf(codes.ResourceExhausted, "node %s: the list did not end after 10000 pages", n.node)
}

// request is the request to a node for its page at token: the base
// request with the page_token field appended.
func (l *lister) request(token string) []byte {
	if token == "" || l.tokenNum == 0 {
		return l.base
	}
	b := make([]byte, 0, len(l.base)+len(token)+8)
	b = protowire.AppendTag(append(b, l.base...), l.tokenNum, protowire.BytesType)
	return protowire.AppendString(b, token)
}

// parse reads a node's answer: its objects (each with its ID, and the
// node's name as its host when the backend left it empty) and its next
// page token, without decoding the objects. ordered: the IDs must not
// go down, and those up to l.after are left out. size is the bytes the
// objects are in.
func (l *lister) parse(n *nodeList, data []byte, ordered bool) ([]listItem, string, int, error) {
	var (
		items = make([]listItem, 0, l.size)
		fill  []int // items whose host is empty
		next  string
	)
	bad := func() ([]listItem, string, int, error) {
		return nil, "", 0, status.Errorf(codes.Internal, "node %s answered the list with a message that is not a %s", n.node, l.item.FullName())
	}
	for b := data; len(b) > 0; {
		num, typ, k := protowire.ConsumeTag(b)
		if k < 0 {
			return bad()
		}
		b = b[k:]
		if typ == protowire.BytesType && (num == l.listNum || num == l.nextNum) {
			v, k := protowire.ConsumeBytes(b)
			if k < 0 {
				return bad()
			}
			b = b[k:]
			if num == l.nextNum {
				next = string(v)
				continue
			}
			id, host, ok := l.fields(v)
			if !ok {
				return bad()
			}
			if ordered {
				if bytes.Compare(id, n.last) < 0 {
					return nil, "", 0, errUnordered
				}
				n.last = id
				if l.after != "" && string(id) <= l.after {
					continue
				}
			}
			if len(host) == 0 && l.hostNum != 0 {
				fill = append(fill, len(items))
			}
			items = append(items, listItem{id: id, raw: v})
			continue
		}
		k = protowire.ConsumeFieldValue(num, typ, b)
		if k < 0 {
			return bad()
		}
		b = b[k:]
	}
	size := len(data)
	if len(fill) > 0 {
		// The host field appended: of a field that occurs more than
		// once, the last counts.
		field := protowire.AppendString(protowire.AppendTag(nil, l.hostNum, protowire.BytesType), n.node)
		buf := make([]byte, 0, len(fill)*len(field)+size)
		for _, i := range fill {
			start := len(buf)
			buf = append(append(buf, items[i].raw...), field...)
			items[i].raw = buf[start:len(buf):len(buf)]
		}
		size += len(buf)
	}
	return items, next, size, nil
}

// fields reads an object's id and host (the last of each, as a decoder
// would).
func (l *lister) fields(b []byte) (id, host []byte, ok bool) {
	for len(b) > 0 {
		num, typ, k := protowire.ConsumeTag(b)
		if k < 0 {
			return nil, nil, false
		}
		b = b[k:]
		if typ == protowire.BytesType && (num == l.idNum || num == l.hostNum) {
			v, k := protowire.ConsumeBytes(b)
			if k < 0 {
				return nil, nil, false
			}
			b = b[k:]
			if num == l.idNum {
				id = v
			} else {
				host = v
			}
			continue
		}
		k = protowire.ConsumeFieldValue(num, typ, b)
		if k < 0 {
			return nil, nil, false
		}
		b = b[k:]
	}
	return id, host, true
}

// keeps decodes an object for the caller's filter.
func (l *lister) keeps(keep func(protoreflect.Message) bool, it listItem) (bool, error) {
	m := newMessage(l.item)
	if err := proto.Unmarshal(it.raw, m.Interface()); err != nil {
		return false, status.Errorf(codes.Internal, "decode %s %s of the list: %v", l.item.FullName(), it.id, err)
	}
	return keep(m), nil
}

// sorted answers a page when a node's list is not in ID order (or its
// objects have no ID): every node's whole list is read, and the objects
// sorted by ID (those of one ID in node order).
func (l *lister) sorted(srcs []*nodeList, size int, keep func(protoreflect.Message) bool) ([]listItem, bool, error) {
	var wg sync.WaitGroup
	all := make([][]listItem, len(srcs))
	for i, n := range srcs {
		wg.Go(func() {
			for !n.done {
				if n.err = l.fetch(n, false); n.err != nil {
					return
				}
				all[i] = append(all[i], n.items...)
			}
		})
	}
	wg.Wait()
	var items []listItem
	for i, n := range srcs {
		if c := status.Code(n.err); c == codes.InvalidArgument || c == codes.PermissionDenied {
			return nil, false, n.err
		}
		items = append(items, all[i]...)
	}
	slices.SortStableFunc(items, func(x, y listItem) int { return bytes.Compare(x.id, y.id) })
	if l.after != "" {
		start, _ := slices.BinarySearchFunc(items, l.after, func(it listItem, id string) int {
			if string(it.id) <= id {
				return -1
			}
			return 1
		})
		items = items[start:]
	}
	page := make([]listItem, 0, size)
	for _, it := range items {
		if keep != nil {
			ok, err := l.keeps(keep, it)
			if err != nil {
				return nil, false, err
			}
			if !ok {
				continue
			}
		}
		if len(page) == size {
			return page, true, nil
		}
		page = append(page, it)
	}
	return page, false, nil
}

// response encodes the merged page.
func (l *lister) response(page []listItem, next string) []byte {
	n := len(next) + 8
	for _, it := range page {
		n += len(it.raw) + 8
	}
	out := make([]byte, 0, n)
	for _, it := range page {
		out = protowire.AppendTag(out, l.listNum, protowire.BytesType)
		out = protowire.AppendBytes(out, it.raw)
	}
	if next != "" && l.nextNum != 0 {
		out = protowire.AppendTag(out, l.nextNum, protowire.BytesType)
		out = protowire.AppendString(out, next)
	}
	return out
}

// invokeRaw makes a unary call on node's backend with an encoded request,
// and returns the encoded answer.
func (p *Proxy) invokeRaw(ctx context.Context, pl Placement, b *Backend, node, method string, req []byte) ([]byte, error) {
	in, out := NewFrame(req), new(Frame)
	defer out.Free()
	if node == pl.Self() {
		if err := b.Invoke(ctx, method, in, out); err != nil {
			return nil, err
		}
	} else {
		conn, err := pl.Peer(node)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "node %s is unreachable: %v", node, err)
		}
		if err := conn.Invoke(outgoingContext(ctx), method, in, out, grpc.ForceCodecV2(Codec())); err != nil {
			return nil, err
		}
	}
	return out.data.Materialize(), nil
}

// requestPrint identifies a list's request without its paging: a page
// token's positions are used only for the same request.
func requestPrint(sub protoreflect.Message) (string, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(sub.Interface())
	if err != nil {
		return "", status.Errorf(codes.Internal, "encode the list request: %v", err)
	}
	sum := sha256.Sum256(b)
	return base64.RawURLEncoding.EncodeToString(sum[:12]), nil
}

// principalKey is the caller a kept list belongs to.
func principalKey(ctx context.Context) string {
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return ""
	}
	return who.Identity + "\x00" + strings.Join(who.Roles, "\x00")
}

// Page tokens of cluster-wide lists: base64url of "after:" and the last
// ID returned, then, after a NUL, the state of the list as JSON (tokenState).
// An agent of a release that knew only "after:<id>" takes the whole rest as
// the ID; no ID holds a NUL, so the objects after it are the same.
const pageTokenPrefix = "after:"

// pageToken is a decoded page token.
type pageToken struct {
	after string
	state tokenState
}

// tokenState is where a list stands after a page.
type tokenState struct {
	// Cursor names the objects read and not returned, kept by the agent
	// that answered the page.
	Cursor string `json:"c,omitempty"`
	// Request identifies the list's request (requestPrint).
	Request string `json:"r,omitempty"`
	// Nodes are the nodes' positions.
	Nodes []tokenNode `json:"n,omitempty"`
}

// tokenNode is one node's position: its backend's token of the page that
// holds its next object ("": the first), or done.
type tokenNode struct {
	Node string `json:"node"`
	Page string `json:"p,omitempty"`
	Done bool   `json:"d,omitempty"`
}

func encodePageToken(lastID string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(pageTokenPrefix + lastID))
}

// encodePageTokenState is the page token after lastID with the list's
// state (the last ID alone when it holds a NUL).
func encodePageTokenState(lastID string, st tokenState) string {
	if strings.IndexByte(lastID, 0) >= 0 {
		return encodePageToken(lastID)
	}
	js, err := json.Marshal(st)
	if err != nil {
		return encodePageToken(lastID)
	}
	return base64.RawURLEncoding.EncodeToString(slices.Concat([]byte(pageTokenPrefix+lastID+"\x00"), js))
}

func decodePageToken(tok string) (pageToken, error) {
	if tok == "" {
		return pageToken{}, nil
	}
	bad := status.Errorf(codes.InvalidArgument, "page_token %q: not a token of this API (use the next_page_token of the previous page)", tok)
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return pageToken{}, bad
	}
	rest, ok := bytes.CutPrefix(b, []byte(pageTokenPrefix))
	after, state, withState := bytes.Cut(rest, []byte{0})
	if !ok || len(after) == 0 {
		return pageToken{}, bad
	}
	t := pageToken{after: string(after)}
	if withState && json.Unmarshal(state, &t.state) != nil {
		return pageToken{}, bad
	}
	return t, nil
}

// listCursor is what a cluster-wide list read and did not return, kept
// for its next page.
type listCursor struct {
	method, request, who, after string
	made                        time.Time
	nodes                       map[string]*nodeList
	bytes                       int
}

// listCursors are the lists kept between pages (least recently made
// first out), within listCursorsMax and listCursorsBytes.
type listCursors struct {
	mu    sync.Mutex
	lru   *simplelru.LRU
	bytes int
}

// keepCursor keeps the nodes' parts of a list after its page ending at
// after, and returns the state its page token carries.
func (p *Proxy) keepCursor(method, request, who, after string, srcs []*nodeList) tokenState {
	st := tokenState{Request: request}
	c := &listCursor{method: method, request: request, who: who, after: after, made: time.Now(), nodes: make(map[string]*nodeList, len(srcs))}
	size := 0
	for _, n := range srcs {
		if n.err != nil {
			continue // read again from its start
		}
		page, done := n.position()
		st.Nodes = append(st.Nodes, tokenNode{Node: n.node, Page: page, Done: done})
		size += len(n.node) + len(page) + 24
		if len(n.items) > 0 {
			c.bytes += n.bytes
		}
		c.nodes[n.node] = n
	}
	if size > maxTokenStateBytes {
		st.Nodes = nil
	}
	if c.bytes > listCursorMaxBytes {
		return st
	}
	var id [16]byte
	if _, err := rand.Read(id[:]); err != nil {
		return st
	}
	st.Cursor = base64.RawURLEncoding.EncodeToString(id[:])
	cs := &p.cursors
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.lru == nil {
		cs.lru, _ = simplelru.NewLRU(listCursorsMax, func(_, v any) { cs.bytes -= v.(*listCursor).bytes })
	}
	for {
		_, v, ok := cs.lru.GetOldest()
		if !ok || time.Since(v.(*listCursor).made) <= listCursorTTL {
			break
		}
		cs.lru.RemoveOldest()
	}
	cs.lru.Add(st.Cursor, c)
	cs.bytes += c.bytes
	for cs.bytes > listCursorsBytes && cs.lru.Len() > 1 {
		cs.lru.RemoveOldest()
	}
	return st
}

// takeCursor takes the list kept under id for its next page: nil when
// none is (expired, dropped, kept by another agent), or when it was not
// this request's, this caller's, or kept after another ID.
func (p *Proxy) takeCursor(id, method, request, who, after string) *listCursor {
	if id == "" {
		return nil
	}
	cs := &p.cursors
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.lru == nil {
		return nil
	}
	v, ok := cs.lru.Peek(id)
	if !ok {
		return nil
	}
	c := v.(*listCursor)
	if c.method != method || c.request != request || c.who != who || c.after != after {
		return nil
	}
	cs.lru.Remove(id)
	if time.Since(c.made) > listCursorTTL {
		return nil
	}
	return c
}

type itemFilterKey struct{}

// WithItemFilter makes the lists the proxy merges from every node keep
// only the objects keep accepts, before they are cut into pages: a caller
// whose rights cover some objects gets pages, page tokens and counts of
// those alone (access control sets it for a conditional list).
func WithItemFilter(ctx context.Context, keep func(protoreflect.Message) bool) context.Context {
	return context.WithValue(ctx, itemFilterKey{}, keep)
}

func itemFilter(ctx context.Context) func(protoreflect.Message) bool {
	keep, _ := ctx.Value(itemFilterKey{}).(func(protoreflect.Message) bool)
	return keep
}
