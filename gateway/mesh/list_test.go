package mesh

import (
	"context"
	"encoding/base64"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/authz"
	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// listNode is one node's VM backend for the cluster-wide list tests: its
// VMs in ID order, pages of at most 1,000 with a token naming the page's
// last ID and an epoch (a later epoch refuses earlier tokens), and the
// VMs it served counted.
type listNode struct {
	vmv1.UnimplementedVMServiceServer
	addr string

	mu  sync.Mutex
	vms []*vmv1.VM
	// reversed answers every page in descending ID order.
	reversed bool
	// down answers every call Unavailable.
	down  bool
	epoch int

	served, calls atomic.Int64
}

func (n *listNode) ListVMs(_ context.Context, r *vmv1.ListVMsRequest) (*vmv1.ListVMsResponse, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.calls.Add(1)
	if n.down {
		return nil, status.Error(codes.Unavailable, "backend down")
	}
	size := int(r.GetPageSize())
	switch {
	case size < 0 || size > 1000:
		return nil, status.Errorf(codes.InvalidArgument, "page_size %d", size)
	case size == 0:
		size = 100
	}
	var after string
	if tok := r.GetPageToken(); tok != "" {
		epoch, id, ok := strings.Cut(tok, "/")
		if !ok || epoch != fmt.Sprint(n.epoch) {
			return nil, status.Errorf(codes.InvalidArgument, "page_token %q: expired", tok)
		}
		after = id
	}
	resp := &vmv1.ListVMsResponse{}
	for _, vm := range n.vms {
		if vm.GetId() <= after || r.GetOwner() != "" && vm.GetMetadata().GetOwner() != r.GetOwner() {
			continue
		}
		if len(resp.Vms) == size {
			resp.NextPageToken = fmt.Sprintf("%d/%s", n.epoch, resp.Vms[size-1].GetId())
			break
		}
		resp.Vms = append(resp.Vms, vm)
	}
	n.served.Add(int64(len(resp.Vms)))
	if n.reversed {
		resp.Vms = slices.Clone(resp.Vms)
		slices.Reverse(resp.Vms)
	}
	return resp, nil
}

// listCluster is nodes with their backends and a proxy per node.
type listCluster struct {
	nodes []string
	back  map[string]*listNode
	// all are every VM's ID, sorted; owners their owners.
	all    []string
	owners map[string]string
}

// startListCluster starts k nodes' backends with perNode VMs each (random
// IDs; node k's backend leaves host empty, the others fill it), owned by
// alice and bob in turn.
func startListCluster(t *testing.T, k, perNode int) *listCluster {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, uint64(k*perNode)))
	lc := &listCluster{back: map[string]*listNode{}, owners: map[string]string{}}
	for i := range k {
		node := fmt.Sprintf("node%d", i+1)
		n := &listNode{}
		for j := range perNode {
			id := fmt.Sprintf("vm-%016x", rng.Uint64())
			owner := []string{"alice", "bob"}[j%2]
			vm := &vmv1.VM{Id: id, Name: fmt.Sprintf("%s-%d", node, j), Metadata: &apiv1.ObjectMeta{Owner: owner}}
			if i < k-1 {
				vm.Host = node
			}
			n.vms = append(n.vms, vm)
			lc.all = append(lc.all, id)
			lc.owners[id] = owner
		}
		slices.SortFunc(n.vms, func(a, b *vmv1.VM) int { return strings.Compare(a.GetId(), b.GetId()) })
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gs := grpc.NewServer()
		vmv1.RegisterVMServiceServer(gs, n)
		go func() { _ = gs.Serve(ln) }()
		t.Cleanup(gs.Stop)
		n.addr = ln.Addr().String()
		lc.nodes = append(lc.nodes, node)
		lc.back[node] = n
	}
	slices.Sort(lc.all)
	return lc
}

// served is the VMs the backends answered so far.
func (lc *listCluster) served() int64 {
	var total int64
	for _, n := range lc.back {
		total += n.served.Load()
	}
	return total
}

// listPlacement is the placement of a listCluster as one node sees it:
// the other nodes' backends are its peers (an agent's internal port relays
// a peer's call to its backend unchanged).
type listPlacement struct {
	self  string
	nodes []string
	peers map[string]*grpc.ClientConn
}

func (p *listPlacement) Self() string { return p.self }
func (p *listPlacement) Locate(string, string) (string, bool) {
	return "", false
}
func (p *listPlacement) Nodes() []string { return p.nodes }
func (p *listPlacement) Routing() error  { return nil }
func (p *listPlacement) Peer(node string) (grpc.ClientConnInterface, error) {
	if c, ok := p.peers[node]; ok {
		return c, nil
	}
	return nil, fmt.Errorf("no node %s", node)
}

// proxy serves the VM API through node self's proxy; the caller's
// identity comes from the metadata "who" (alice, with the item filter of
// her own VMs, or anyone else, unfiltered).
func (lc *listCluster) proxy(t *testing.T, self string) vmv1.VMServiceClient {
	t.Helper()
	b, err := NewBackend(BackendConfig{Name: "pivirtd", Endpoint: lc.back[self].addr, NodeScoped: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	pl := &listPlacement{self: self, nodes: lc.nodes, peers: map[string]*grpc.ClientConn{}}
	for _, node := range lc.nodes {
		if node == self {
			continue
		}
		c, err := grpc.NewClient(lc.back[node].addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		pl.peers[node] = c
	}
	p := NewProxy(nil, nil)
	p.SetRoutes([]Route{{Prefix: "/pivirt.vm.v1.VMService", Backend: b}})
	p.SetPlacement(pl)
	who := func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := ss.Context()
		md, _ := metadata.FromIncomingContext(ctx)
		if w := md.Get("who"); len(w) == 1 {
			ctx = authz.WithPrincipal(ctx, authz.Principal{Identity: w[0]})
			if w[0] == "alice" {
				ctx = WithItemFilter(ctx, func(m protoreflect.Message) bool {
					return m.Interface().(*vmv1.VM).GetMetadata().GetOwner() == "alice"
				})
			}
		}
		return handler(srv, WithStreamContext(ss, ctx))
	}
	gs := grpc.NewServer(grpc.UnknownServiceHandler(p.Handle), grpc.ForceServerCodecV2(Codec()), grpc.ChainStreamInterceptor(who))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	c, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return vmv1.NewVMServiceClient(c)
}

func ctxTimeout(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// listPages reads every page of a list, page k through via[k%len(via)],
// and checks that every page but the last is full and carries a token.
func listPages(t *testing.T, ctx context.Context, via []vmv1.VMServiceClient, req *vmv1.ListVMsRequest) (ids []string, vms []*vmv1.VM, tokens []string) {
	t.Helper()
	for k := 0; ; k++ {
		if k > 10_000 {
			t.Fatal("the list does not end")
		}
		r, err := via[k%len(via)].ListVMs(ctx, req)
		if err != nil {
			t.Fatalf("page %d: %v", k, err)
		}
		for _, vm := range r.GetVms() {
			ids = append(ids, vm.GetId())
			vms = append(vms, vm)
		}
		if r.GetNextPageToken() == "" {
			return ids, vms, tokens
		}
		if size := int(req.GetPageSize()); len(r.GetVms()) != size {
			t.Fatalf("page %d holds %d VMs and a next page token, want a full page of %d", k, len(r.GetVms()), size)
		}
		tokens = append(tokens, r.GetNextPageToken())
		req = &vmv1.ListVMsRequest{PageSize: req.GetPageSize(), Owner: req.GetOwner(), Host: req.GetHost(), PageToken: r.GetNextPageToken()}
	}
}

// TestClusterListReadsEachObjectOnce: every page of a list through one
// node holds the next VMs of every node in ID order, with hosts filled in,
// and the backends serve each VM once over the whole list (the next page
// merges what the previous one read), where listing every node for each
// page served each VM once per page.
func TestClusterListReadsEachObjectOnce(t *testing.T) {
	lc := startListCluster(t, 3, 300)
	api := lc.proxy(t, "node1")
	ctx := ctxTimeout(t)
	for _, size := range []int32{100, 1000, 7, 1} {
		t.Run(fmt.Sprint("page size ", size), func(t *testing.T) {
			before := lc.served()
			ids, vms, _ := listPages(t, ctx, []vmv1.VMServiceClient{api}, &vmv1.ListVMsRequest{PageSize: size})
			if !slices.Equal(ids, lc.all) {
				t.Fatalf("listed %d VMs, want the %d of every node in ID order", len(ids), len(lc.all))
			}
			for _, vm := range vms {
				if want, _, _ := strings.Cut(vm.GetName(), "-"); vm.GetHost() != want {
					t.Fatalf("%s: host %q, want %q", vm.GetId(), vm.GetHost(), want)
				}
			}
			// The last page of each node may be read while a page is
			// answered and not returned: at most one page of the page
			// size per node more than the list.
			served := lc.served() - before
			if limit := int64(len(lc.all)) + 3*int64(size); served > limit {
				t.Errorf("the backends served %d VMs for a list of %d, want at most %d", served, len(lc.all), limit)
			}
		})
	}
	t.Run("one page of a node", func(t *testing.T) {
		ids, vms, _ := listPages(t, ctx, []vmv1.VMServiceClient{api}, &vmv1.ListVMsRequest{PageSize: 50, Host: "node3"})
		if len(ids) != 300 || !slices.IsSorted(ids) || vms[0].GetHost() != "node3" {
			t.Fatalf("host node3: %d VMs, sorted %v, host %q", len(ids), slices.IsSorted(ids), vms[0].GetHost())
		}
	})
}

// TestClusterListTokensWorkEverywhere: a list paged through a different
// node each page (which reads each node from the page its token names),
// a page asked twice, a token of the earlier format ("after:" and an ID
// alone) and a backend that expired its own tokens all give the same
// list; and an agent that knows only the earlier format reads the tokens
// as the same position.
func TestClusterListTokensWorkEverywhere(t *testing.T) {
	lc := startListCluster(t, 3, 200)
	via := []vmv1.VMServiceClient{lc.proxy(t, "node1"), lc.proxy(t, "node2"), lc.proxy(t, "node3")}
	ctx := ctxTimeout(t)

	before := lc.served()
	ids, _, tokens := listPages(t, ctx, via, &vmv1.ListVMsRequest{PageSize: 50})
	if !slices.Equal(ids, lc.all) {
		t.Fatalf("paged through every node: %d VMs, want the %d in ID order", len(ids), len(lc.all))
	}
	// A page asked of another node reads each node's page holding its
	// next VM again, not its whole list.
	pages := int64(len(tokens) + 1)
	if served, limit := lc.served()-before, int64(len(lc.all))+pages*3*50; served > limit {
		t.Errorf("the backends served %d VMs for a list of %d in %d pages, want at most %d", served, len(lc.all), pages, limit)
	}

	for i, tok := range tokens {
		// The earlier format's reading: everything after the bytes
		// that follow "after:".
		raw, err := base64.RawURLEncoding.DecodeString(tok)
		if err != nil || !strings.HasPrefix(string(raw), "after:") {
			t.Fatalf("token %d: %q, %v", i, raw, err)
		}
		old := strings.TrimPrefix(string(raw), "after:")
		rest := lc.all[(i+1)*50:]
		for _, id := range lc.all {
			if (id > old) != slices.Contains(rest, id) {
				t.Fatalf("token %d read as the ID %q: %s is on the wrong side", i, old, id)
			}
		}
	}

	// The same page twice, through the node that issued the token (its
	// kept VMs are taken by the first) and through another.
	r1, err := via[0].ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 50})
	if err != nil {
		t.Fatal(err)
	}
	var again [][]string
	for _, api := range []vmv1.VMServiceClient{via[0], via[0], via[1]} {
		r, err := api.ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 50, PageToken: r1.GetNextPageToken()})
		if err != nil {
			t.Fatal(err)
		}
		var page []string
		for _, vm := range r.GetVms() {
			page = append(page, vm.GetId())
		}
		again = append(again, page)
	}
	for i, page := range again {
		if !slices.Equal(page, lc.all[50:100]) {
			t.Errorf("the second page asked again (%d): %v, want %v", i, page, lc.all[50:100])
		}
	}

	// The earlier format.
	ids, _, _ = listPages(t, ctx, via, &vmv1.ListVMsRequest{PageSize: 80, PageToken: encodePageToken(lc.all[99])})
	if !slices.Equal(ids, lc.all[100:]) {
		t.Errorf("from after:%s: %d VMs, want the %d after it", lc.all[99], len(ids), len(lc.all[100:]))
	}

	// Backends that no longer take their tokens: each node is read
	// again from its start.
	r1, err = via[0].ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 120})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range lc.back {
		n.mu.Lock()
		n.epoch++
		n.mu.Unlock()
	}
	ids, _, _ = listPages(t, ctx, via[1:], &vmv1.ListVMsRequest{PageSize: 120, PageToken: r1.GetNextPageToken()})
	if !slices.Equal(ids, lc.all[120:]) {
		t.Errorf("after the backends' tokens expired: %d VMs, want %d", len(ids), len(lc.all[120:]))
	}

	// A token used with another request (another owner) is a position
	// in the list by ID, as it always was.
	ids, _, _ = listPages(t, ctx, via, &vmv1.ListVMsRequest{PageSize: 30, Owner: "bob", PageToken: r1.GetNextPageToken()})
	var want []string
	for _, id := range lc.all[120:] {
		if lc.owners[id] == "bob" {
			want = append(want, id)
		}
	}
	if !slices.Equal(ids, want) {
		t.Errorf("owner bob after the first page of all: %d VMs, want %d", len(ids), len(want))
	}
}

// TestClusterListFilteredCaller: a caller whose rights cover some VMs
// gets pages of those alone, the last without a token, and another
// caller's token does not give it what the first one's list kept.
func TestClusterListFilteredCaller(t *testing.T) {
	lc := startListCluster(t, 3, 120)
	api := lc.proxy(t, "node1")
	ctx := ctxTimeout(t)
	var mine []string
	for _, id := range lc.all {
		if lc.owners[id] == "alice" {
			mine = append(mine, id)
		}
	}
	alice := metadata.AppendToOutgoingContext(ctx, "who", "alice")
	for _, size := range []int32{1, 9, 180} {
		ids, _, _ := listPages(t, alice, []vmv1.VMServiceClient{api}, &vmv1.ListVMsRequest{PageSize: size})
		if !slices.Equal(ids, mine) {
			t.Errorf("page size %d: alice listed %d VMs, want her %d", size, len(ids), len(mine))
		}
	}
	// Bob's first page, continued by alice: her own VMs after it.
	bob := metadata.AppendToOutgoingContext(ctx, "who", "bob")
	r, err := api.ListVMs(bob, &vmv1.ListVMsRequest{PageSize: 100})
	if err != nil {
		t.Fatal(err)
	}
	ids, _, _ := listPages(t, alice, []vmv1.VMServiceClient{api}, &vmv1.ListVMsRequest{PageSize: 100, PageToken: r.GetNextPageToken()})
	want := slices.DeleteFunc(slices.Clone(mine), func(id string) bool { return id <= lc.all[99] })
	if !slices.Equal(ids, want) {
		t.Errorf("alice from bob's token: %d VMs, want her %d after it", len(ids), len(want))
	}
}

// TestClusterListUnorderedNode: a node whose backend does not list in ID
// order is read whole and sorted; the list is the same.
func TestClusterListUnorderedNode(t *testing.T) {
	lc := startListCluster(t, 3, 150)
	lc.back["node2"].reversed = true
	via := []vmv1.VMServiceClient{lc.proxy(t, "node1"), lc.proxy(t, "node2")}
	ctx := ctxTimeout(t)
	for _, size := range []int32{40, 1000} {
		ids, _, _ := listPages(t, ctx, via, &vmv1.ListVMsRequest{PageSize: size})
		if !slices.Equal(ids, lc.all) {
			t.Errorf("page size %d: %d VMs, want the %d in ID order", size, len(ids), len(lc.all))
		}
	}
}

// TestClusterListNodeDown: a node that does not answer is named in the
// header and left out of the page; its VMs come again once it answers.
func TestClusterListNodeDown(t *testing.T) {
	lc := startListCluster(t, 3, 100)
	api, other := lc.proxy(t, "node1"), lc.proxy(t, "node3")
	ctx := ctxTimeout(t)
	r, err := api.ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 60})
	if err != nil {
		t.Fatal(err)
	}
	lc.back["node2"].mu.Lock()
	lc.back["node2"].down = true
	lc.back["node2"].mu.Unlock()
	// Through another node: node1 would answer from what it kept.
	var hdr metadata.MD
	r2, err := other.ListVMs(ctx, &vmv1.ListVMsRequest{PageSize: 60, PageToken: r.GetNextPageToken()}, grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if u := hdr.Get(UnavailableNodesHeader); len(u) != 1 || !strings.HasPrefix(u[0], "node2: ") {
		t.Errorf("%s = %q, want node2's", UnavailableNodesHeader, u)
	}
	for _, vm := range r2.GetVms() {
		if vm.GetHost() == "node2" {
			t.Fatalf("a VM of node2 (%s) while node2 is down", vm.GetId())
		}
	}
	lc.back["node2"].mu.Lock()
	lc.back["node2"].down = false
	lc.back["node2"].mu.Unlock()
	ids, _, _ := listPages(t, ctx, []vmv1.VMServiceClient{api}, &vmv1.ListVMsRequest{PageSize: 60, PageToken: r2.GetNextPageToken()})
	last := r2.GetVms()[len(r2.GetVms())-1].GetId()
	want := slices.DeleteFunc(slices.Clone(lc.all), func(id string) bool { return id <= last })
	if !slices.Equal(ids, want) {
		t.Errorf("after node2 answered again: %d VMs, want the %d after %s", len(ids), len(want), last)
	}

	for _, n := range lc.back {
		n.mu.Lock()
		n.down = true
		n.mu.Unlock()
	}
	if _, err := api.ListVMs(ctx, &vmv1.ListVMsRequest{}); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no node answered") {
		t.Errorf("every node down: %v, want Unavailable: no node answered", err)
	}
}

// TestListCursorsBounds: kept lists expire, are taken once, only by the
// same request and caller, and stay within their bytes.
func TestListCursorsBounds(t *testing.T) {
	p := NewProxy(nil, nil)
	keep := func(bytes int) tokenState {
		n := &nodeList{node: "node1", items: []listItem{{id: []byte("b")}}, page: "p1", next: "p2", bytes: bytes}
		return p.keepCursor("/m", "req", "alice", "a", []*nodeList{n, {node: "node2", done: true}})
	}
	st := keep(100)
	if st.Cursor == "" || !slices.Equal(st.Nodes, []tokenNode{{Node: "node1", Page: "p1"}, {Node: "node2", Done: true}}) {
		t.Fatalf("state %+v", st)
	}
	for _, wrong := range [][4]string{{"/other", "req", "alice", "a"}, {"/m", "other", "alice", "a"}, {"/m", "req", "bob", "a"}, {"/m", "req", "alice", "b"}} {
		if c := p.takeCursor(st.Cursor, wrong[0], wrong[1], wrong[2], wrong[3]); c != nil {
			t.Errorf("taken by %v", wrong)
		}
	}
	if c := p.takeCursor(st.Cursor, "/m", "req", "alice", "a"); c == nil || len(c.nodes["node1"].items) != 1 {
		t.Fatalf("not taken by its request: %+v", c)
	}
	if c := p.takeCursor(st.Cursor, "/m", "req", "alice", "a"); c != nil {
		t.Error("taken twice")
	}
	if st := keep(listCursorMaxBytes + 1); st.Cursor != "" || len(st.Nodes) != 2 {
		t.Errorf("a list over %d bytes kept: %+v", listCursorMaxBytes, st)
	}
	var ids []string
	for range listCursorsBytes / (4 << 20) * 2 {
		ids = append(ids, keep(4<<20).Cursor)
	}
	if p.cursors.bytes > listCursorsBytes || p.takeCursor(ids[0], "/m", "req", "alice", "a") != nil || p.takeCursor(ids[len(ids)-1], "/m", "req", "alice", "a") == nil {
		t.Errorf("%d bytes kept (at most %d), the oldest dropped and the newest kept", p.cursors.bytes, listCursorsBytes)
	}
	old := keep(100)
	p.cursors.mu.Lock()
	v, _ := p.cursors.lru.Peek(old.Cursor)
	v.(*listCursor).made = time.Now().Add(-listCursorTTL - time.Second)
	p.cursors.mu.Unlock()
	if p.takeCursor(old.Cursor, "/m", "req", "alice", "a") != nil {
		t.Error("an expired list taken")
	}
}
