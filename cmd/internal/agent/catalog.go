package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway/mesh"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// The placement catalog: each agent tells the cluster which objects its
// node-scoped backends hold (cmd/internal/agent/DESIGN.md, "Placement
// catalog"). A full listing at start, after each reconnect of a backend's
// watch and every catalogSync (anti-entropy); a watch event that creates
// or deletes an object starts one at once. Only the difference against
// the catalog is proposed.

// catalogList is a placed kind and how to list its IDs.
type catalogList struct {
	kind   string
	method string
	ids    func(ctx context.Context, b *mesh.Backend, method string) ([]string, error)
}

var catalogLists = []catalogList{
	{"virtualmachines", "/pivirt.vm.v1.VMService/ListVMs", func(ctx context.Context, b *mesh.Backend, method string) ([]string, error) {
		return listIDs(ctx, b, method, func(tok string) proto.Message { return &vmv1.ListVMsRequest{PageSize: 1000, PageToken: tok} },
			func() proto.Message { return &vmv1.ListVMsResponse{} },
			func(m proto.Message) ([]string, string) {
				r := m.(*vmv1.ListVMsResponse)
				ids := make([]string, len(r.GetVms()))
				for i, v := range r.GetVms() {
					ids[i] = v.GetId()
				}
				return ids, r.GetNextPageToken()
			})
	}},
	{"volumes", "/pivirt.storage.v1.StorageService/ListVolumes", func(ctx context.Context, b *mesh.Backend, method string) ([]string, error) {
		return listIDs(ctx, b, method, func(tok string) proto.Message { return &storagev1.ListVolumesRequest{PageSize: 1000, PageToken: tok} },
			func() proto.Message { return &storagev1.ListVolumesResponse{} },
			func(m proto.Message) ([]string, string) {
				r := m.(*storagev1.ListVolumesResponse)
				ids := make([]string, len(r.GetVolumes()))
				for i, v := range r.GetVolumes() {
					ids[i] = v.GetId()
				}
				return ids, r.GetNextPageToken()
			})
	}},
	{"networks", "/pivirt.network.v1.NetworkService/ListNetworks", func(ctx context.Context, b *mesh.Backend, method string) ([]string, error) {
		return listIDs(ctx, b, method, func(tok string) proto.Message { return &networkv1.ListNetworksRequest{PageSize: 1000, PageToken: tok} },
			func() proto.Message { return &networkv1.ListNetworksResponse{} },
			func(m proto.Message) ([]string, string) {
				r := m.(*networkv1.ListNetworksResponse)
				ids := make([]string, len(r.GetNetworks()))
				for i, v := range r.GetNetworks() {
					ids[i] = v.GetId()
				}
				return ids, r.GetNextPageToken()
			})
	}},
}

// listIDs reads every page of a list from b.
func listIDs(ctx context.Context, b *mesh.Backend, method string, req func(token string) proto.Message, resp func() proto.Message, ids func(proto.Message) ([]string, string)) ([]string, error) {
	var out []string
	tok := ""
	for range 10_000 {
		r := resp()
		if err := b.Invoke(ctx, method, req(tok), r); err != nil {
			return nil, err
		}
		page, next := ids(r)
		out = append(out, page...)
		if next == "" {
			return out, nil
		}
		tok = next
	}
	return nil, fmt.Errorf("%s: the list did not end after 10000 pages", method)
}

// Catalog timing.
const (
	// catalogSync is the anti-entropy period: a full listing compared
	// with the catalog.
	catalogSync = 30 * time.Second
	// catalogDebounce gathers the events of a burst into one listing.
	catalogDebounce = 200 * time.Millisecond
	// catalogBatch bounds the entries of one proposal: in etcd mode each
	// entry is a key of the command's transaction, and etcd allows 128
	// operations per transaction by default.
	catalogBatch     = 5000
	catalogBatchEtcd = 100
)

// runCatalog keeps this node's entries of the placement catalog in step
// with its node-scoped backends until the agent stops.
func (a *Agent) runCatalog() error {
	trigger := make(chan struct{}, 1)
	poke := func() {
		select {
		case trigger <- struct{}{}:
		default:
		}
	}
	for _, w := range catalogWatches {
		a.wg.Go(func() { a.watchForCatalog(a.ctx, w, poke) })
	}
	a.wg.Go(a.runCatalogRetire)
	a.wg.Go(func() {
		interval := a.opts.CatalogSync
		if interval <= 0 {
			interval = catalogSync
		}
		t := time.NewTicker(interval)
		defer t.Stop()
		poke()
		// A sync that could not record everything (no leader yet, a
		// backend down) is tried again soon, backing off to interval.
		var (
			retry  time.Duration
			retryT = time.NewTimer(time.Hour)
		)
		retryT.Stop()
		defer retryT.Stop()
		for {
			select {
			case <-a.ctx.Done():
				return
			case <-t.C:
			case <-retryT.C:
			case <-trigger:
				if !sleepCtx(a.ctx, catalogDebounce) {
					return
				}
			}
			retryT.Stop()
			if a.syncCatalog(a.ctx) {
				retry = 0
				continue
			}
			retry = min(max(2*retry, time.Second), interval)
			retryT.Reset(retry)
		}
	})
	return nil
}

// catalogWatch is a placed kind's watch: open starts it on a backend
// connection; recv reports whether the next event created or deleted an
// object.
type catalogWatch struct {
	method string
	open   func(ctx context.Context, conn grpc.ClientConnInterface) (recv func() (bool, error), err error)
}

var catalogWatches = []catalogWatch{
	{"/pivirt.vm.v1.VMService/WatchVMs", func(ctx context.Context, conn grpc.ClientConnInterface) (func() (bool, error), error) {
		st, err := vmv1.NewVMServiceClient(conn).WatchVMs(ctx, &vmv1.WatchVMsRequest{})
		if err != nil {
			return nil, err
		}
		return func() (bool, error) {
			ev, err := st.Recv()
			t := ev.GetType()
			return t == vmv1.EventType_EVENT_TYPE_CREATED || t == vmv1.EventType_EVENT_TYPE_DELETED, err
		}, nil
	}},
	{"/pivirt.storage.v1.StorageService/WatchVolumes", func(ctx context.Context, conn grpc.ClientConnInterface) (func() (bool, error), error) {
		st, err := storagev1.NewStorageServiceClient(conn).WatchVolumes(ctx, &storagev1.WatchVolumesRequest{})
		if err != nil {
			return nil, err
		}
		return func() (bool, error) {
			ev, err := st.Recv()
			t := ev.GetType()
			return t == storagev1.EventType_EVENT_TYPE_CREATED || t == storagev1.EventType_EVENT_TYPE_DELETED, err
		}, nil
	}},
	{"/pivirt.network.v1.NetworkService/WatchNetworks", func(ctx context.Context, conn grpc.ClientConnInterface) (func() (bool, error), error) {
		st, err := networkv1.NewNetworkServiceClient(conn).WatchNetworks(ctx, &networkv1.WatchNetworksRequest{})
		if err != nil {
			return nil, err
		}
		return func() (bool, error) {
			ev, err := st.Recv()
			t := ev.GetType()
			return t == networkv1.EventType_EVENT_TYPE_CREATED || t == networkv1.EventType_EVENT_TYPE_DELETED, err
		}, nil
	}},
}

// watchForCatalog pokes the catalog on every object its node-scoped
// backend reports created or deleted, and after every (re)connect of the
// watch. A backend without the watch (Unimplemented) is left to the
// periodic listing.
func (a *Agent) watchForCatalog(ctx context.Context, w catalogWatch, poke func()) {
	wait := time.Second
	for ctx.Err() == nil {
		b := a.proxy.Route(w.method)
		if b == nil || !b.NodeScoped() {
			if !sleepCtx(ctx, catalogSync) {
				return
			}
			continue
		}
		err := func() error {
			conn, err := b.Conn()
			if err != nil {
				return err
			}
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			recv, err := w.open(wctx, conn)
			if err != nil {
				return err
			}
			first := true
			for {
				changed, err := recv()
				if err != nil {
					return err
				}
				if first {
					poke() // (re)connected: list again
					first = false
				}
				wait = time.Second
				if changed {
					poke()
				}
			}
		}()
		if ctx.Err() != nil {
			return
		}
		if status.Code(err) == codes.Unimplemented {
			wait = catalogSync
		}
		a.logger.Debug("placement catalog: watch ended; opening it again", "method", w.method, "error", err, "in", wait)
		if !sleepCtx(ctx, wait) {
			return
		}
		wait = min(2*wait, catalogSync)
	}
}

// syncCatalog lists each placed kind on this node's backend and proposes
// the difference against the catalog. A kind whose backend cannot be
// listed is left as it is. It reports whether everything was listed and
// recorded.
func (a *Agent) syncCatalog(ctx context.Context) (done bool) {
	if !a.allows(fsm.FeaturePlacements) {
		// Not yet: agents that predate the catalog do not know its
		// command. Looked at again soon (the retry backs off).
		return false
	}
	self := a.cfg.NodeName
	held, err := a.fsm.State().PlacementsByNode(self)
	if err != nil {
		a.logger.Warn("placement catalog: reading it failed", "error", err)
		return false
	}
	done = true
	for _, cl := range catalogLists {
		b := a.proxy.Route(cl.method)
		if b == nil || !b.NodeScoped() {
			continue
		}
		lctx, cancel := context.WithTimeout(ctx, time.Minute)
		ids, err := cl.ids(lctx, b, cl.method)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				a.logger.Debug("placement catalog: listing the backend failed; the catalog stays as it is", "kind", cl.kind, "backend", b.Name(), "error", err)
			}
			done = false
			continue
		}
		have := map[string]bool{}
		for _, p := range held {
			if p.GetKind() == cl.kind {
				have[p.GetId()] = true
			}
		}
		op := &fsmv1.SetPlacements{Node: self}
		state := a.fsm.State()
		for _, id := range ids {
			if have[id] {
				delete(have, id)
				continue
			}
			if p, err := state.Placement(cl.kind, id); err == nil && p != nil && p.GetNode() == self {
				continue
			}
			op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: cl.kind, Id: id, Node: self})
		}
		for _, id := range slices.Sorted(maps.Keys(have)) {
			op.Delete = append(op.Delete, &fsmv1.Placement{Kind: cl.kind, Id: id})
		}
		size := catalogBatch
		if a.cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
			size = catalogBatchEtcd
		} else if len(op.Upsert)+len(op.Delete) > 0 && len(ids) <= catalogBatch {
			// In Raft mode a change is recorded as the node's whole
			// listing of the kind: the leader removes what the listing
			// lacks even when this node's state is behind (just
			// restarted) and the difference above missed it. Unchanged
			// entries cost nothing to apply.
			op.Upsert, op.Delete = op.Upsert[:0], nil
			for _, id := range ids {
				op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: cl.kind, Id: id, Node: self})
			}
			op.FullKinds = []string{cl.kind}
		}
		for len(op.Upsert)+len(op.Delete) > 0 || len(op.FullKinds) > 0 {
			batch := &fsmv1.SetPlacements{Node: self, FullKinds: op.FullKinds}
			op.FullKinds = nil
			n := min(len(op.Upsert), size)
			batch.Upsert, op.Upsert = op.Upsert[:n], op.Upsert[n:]
			m := min(len(op.Delete), size-n)
			batch.Delete, op.Delete = op.Delete[:m], op.Delete[m:]
			if err := a.reportPlacements(ctx, batch); err != nil {
				if ctx.Err() == nil {
					a.logger.Info("placement catalog: recording this node's objects failed; trying again soon", "kind", cl.kind, "error", err)
				}
				done = false
				break
			}
			a.logger.Debug("placement catalog updated", "kind", cl.kind, "upserted", len(batch.Upsert), "removed", len(batch.Delete), "whole_listing", len(batch.FullKinds) > 0)
		}
	}
	return done
}

// reportPlacements records op: proposed here on the leader (and in etcd
// mode, where every agent writes), else sent to the leader's internal port.
func (a *Agent) reportPlacements(ctx context.Context, op *fsmv1.SetPlacements) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	id, addr := a.cons.Leader()
	if a.cfg.ServiceDiscovery.Type == config.DiscoveryEtcd || id == a.nodeID {
		return a.proposePlacements(ctx, op)
	}
	if id == "" {
		return errors.New("no cluster leader")
	}
	m, ok := a.gossip.ServerByID(id, addr)
	if !ok || m.Meta.InternalAddr == "" {
		return fmt.Errorf("leader %s is not known to gossip yet", id)
	}
	_, err := a.pool.Node(m.Meta.InternalAddr).ReportPlacements(ctx, connect.NewRequest(&nodev1.ReportPlacementsRequest{Placements: op}))
	return err
}

// proposePlacements is ReportPlacements on this node: a Raft proposal on
// the leader (in etcd mode, a write of this agent).
func (a *Agent) proposePlacements(ctx context.Context, op *fsmv1.SetPlacements) error {
	if err := a.requireFeature(fsm.FeaturePlacements, "the placement catalog"); err != nil {
		return err
	}
	if id, _ := a.cons.Leader(); a.cfg.ServiceDiscovery.Type != config.DiscoveryEtcd && id != a.nodeID {
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("not the leader"))
	}
	op = a.heldElsewhere(op)
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_SetPlacements{SetPlacements: op}})
	if err != nil {
		return connect.NewError(connect.CodeInternal, err)
	}
	resp, _, err := a.cons.Apply(ctx, data)
	if err != nil {
		return connect.NewError(connect.CodeUnavailable, err)
	}
	if r, ok := resp.(*fsm.Result); ok && r.Err != nil {
		return connect.NewError(connect.CodeInvalidArgument, r.Err)
	}
	return nil
}

// heldElsewhere leaves out of a node's report the objects the catalog
// places on another node that is alive: a node reports what its own
// backends hold, and cannot take another live node's objects by naming
// them. A migration completes when the old node's listing no longer has
// the object (its entry goes) and the new node's next report places it.
func (a *Agent) heldElsewhere(op *fsmv1.SetPlacements) *fsmv1.SetPlacements {
	if a.gossip == nil || len(op.GetUpsert()) == 0 {
		return op
	}
	st := a.fsm.State()
	var keep []*fsmv1.Placement
	held := 0
	for i, e := range op.GetUpsert() {
		p, err := st.Placement(e.GetKind(), e.GetId())
		taken := err == nil && p != nil && p.GetNode() != op.GetNode() && a.memberAlive(p.GetNode())
		if taken && keep == nil {
			keep = append(make([]*fsmv1.Placement, 0, len(op.GetUpsert())), op.GetUpsert()[:i]...)
		}
		switch {
		case taken:
			held++
		case keep != nil:
			keep = append(keep, e)
		}
	}
	if held == 0 {
		return op
	}
	a.logger.Debug("placement catalog: objects another live node holds are left where they are until it stops listing them", "node", op.GetNode(), "objects", held)
	out := proto.Clone(op).(*fsmv1.SetPlacements)
	out.Upsert = keep
	return out
}

// memberAlive reports whether the gossip ring sees node alive.
func (a *Agent) memberAlive(node string) bool {
	for _, m := range a.gossip.Members() {
		if m.Name == node {
			return m.Status == cluster.StatusAlive
		}
	}
	return false
}

// retireFromCatalog removes every entry of node from the placement
// catalog: a node that left the cluster holds nothing any more (its
// objects are gone with it, or were handed over to the node whose
// listing now has them, which moved them already).
func (a *Agent) retireFromCatalog(ctx context.Context, node string) error {
	if !a.allows(fsm.FeaturePlacements) {
		return nil
	}
	held, err := a.fsm.State().PlacementsByNode(node)
	if err != nil || len(held) == 0 {
		return err
	}
	if err := a.reportPlacements(ctx, &fsmv1.SetPlacements{Node: node, FullKinds: fsm.PlacementKinds()}); err != nil {
		return err
	}
	a.logger.Info("placement catalog: a node that left holds nothing any more", "node", node, "entries", len(held))
	return nil
}

// runCatalogRetire removes from the catalog, on the leader, the entries
// of every node that left the gossip ring (cluster leave, force-leave),
// after each membership change and every catalogSync.
func (a *Agent) runCatalogRetire() {
	changes, stop := a.gossip.Subscribe()
	defer stop()
	t := time.NewTicker(catalogSync)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-changes:
		case <-t.C:
		}
		if !a.leaderReady() || !a.allows(fsm.FeaturePlacements) {
			continue
		}
		for _, node := range a.retiredNodes() {
			ctx, cancel := context.WithTimeout(a.ctx, 10*time.Second)
			if err := a.retireFromCatalog(ctx, node); err != nil && a.ctx.Err() == nil {
				a.logger.Info("placement catalog: removing the entries of a node that left failed; trying again", "node", node, "error", err)
			}
			cancel()
		}
	}
}

// retiredNodes are the nodes the catalog names that left the cluster:
// left in gossip, failed and no longer a Raft server (a leave this node
// missed, a removal), or forgotten by gossip (force-leave --prune) — the
// last only once this agent has run long enough to know every member.
func (a *Agent) retiredNodes() []string {
	_, all, err := a.fsm.State().Placements("", nil)
	if err != nil {
		return nil
	}
	named := map[string]bool{}
	for _, p := range all {
		named[p.GetNode()] = true
	}
	delete(named, a.cfg.NodeName)
	if len(named) == 0 {
		return nil
	}
	members := map[string]cluster.Member{}
	for _, m := range a.gossip.Members() {
		members[m.Name] = m
	}
	var servers map[string]bool
	if !a.etcdMode() {
		ctx, cancel := context.WithTimeout(a.ctx, time.Second)
		list, err := a.raft.Servers(ctx)
		cancel()
		if err != nil {
			return nil
		}
		servers = make(map[string]bool, len(list))
		for _, s := range list {
			servers[s.ID] = true
		}
	}
	var out []string
	for node := range named {
		m, known := members[node]
		switch {
		case !known && time.Since(a.startedAt) > forgottenAfter:
		case known && m.Status == cluster.StatusLeft:
		case known && m.Status == cluster.StatusFailed && servers != nil && !servers[m.Meta.ID]:
		default:
			continue
		}
		out = append(out, node)
	}
	slices.Sort(out)
	return out
}

// forgottenAfter is how long an agent runs before a node the catalog names
// and gossip does not know counts as retired: long enough for a restarted
// agent's gossip to have met every member.
const forgottenAfter = 2 * time.Minute
