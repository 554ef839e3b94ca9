package gateway

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/fsm"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// Response headers describing the state a read was served from.
const (
	HeaderIndex       = "Pivirt-Index"
	HeaderLastContact = "Pivirt-Last-Contact"
	HeaderKnownLeader = "Pivirt-Known-Leader"
	HeaderServedBy    = "Pivirt-Served-By"
	// HeaderClientID and HeaderSequence return the identity of a write, so
	// a client that let the server assign it can retry the same write.
	HeaderClientID = "Pivirt-Client-Id"
	HeaderSequence = "Pivirt-Sequence"
)

// write runs a write on the leader and returns the write's identity in
// the response headers, or in the error's metadata when the outcome is
// unknown, so that the client can retry the very same write.
func write[Req, Res any](ctx context.Context, h *ClusterService, req *connect.Request[Req], w *clusterv1.WriteOptions, remote remoteCall[Req, Res], local func(context.Context) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	resp, err := onLeader(ctx, h, req, remote, local)
	set := func(hdr http.Header) {
		hdr.Set(HeaderClientID, w.GetClientId())
		hdr.Set(HeaderSequence, strconv.FormatUint(w.GetSequence(), 10))
	}
	if err != nil {
		var ce *connect.Error
		if errors.As(err, &ce) {
			set(ce.Meta())
		}
		return nil, err
	}
	set(resp.Header())
	return resp, nil
}

// remoteCall is a ClusterService method expression, e.g.
// clusterv1connect.ClusterServiceClient.RegisterService.
type remoteCall[Req, Res any] func(clusterv1connect.ClusterServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Res], error)

// onLeader runs local on the leader. A node that is not the leader forwards
// the request to the leader's internal port; without a known leader it waits
// up to the hold timeout, or until shortly before the call's deadline
// (polling with jitter), and then fails with Unavailable saying what this
// node knows of the cluster (noleader.go). The leader-only handler of the
// internal port never forwards.
func onLeader[Req, Res any](ctx context.Context, h *ClusterService, req *connect.Request[Req], remote remoteCall[Req, Res], local func(context.Context) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	return viaLeader(ctx, h, local, func(ctx context.Context, internalAddr string) (*connect.Response[Res], error) {
		resp, err := remote(h.peers.Cluster(internalAddr), ctx, forwardRequest(req))
		if err != nil {
			return nil, err
		}
		return cleanResponse(resp), nil
	})
}

// onElected is onLeader through viaElected.
func onElected[Req, Res any](ctx context.Context, h *ClusterService, req *connect.Request[Req], remote remoteCall[Req, Res], local func(context.Context) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	return viaElected(ctx, h, local, func(ctx context.Context, internalAddr string) (*connect.Response[Res], error) {
		resp, err := remote(h.peers.Cluster(internalAddr), ctx, forwardRequest(req))
		if err != nil {
			return nil, err
		}
		return cleanResponse(resp), nil
	})
}

// viaLeader runs local when this node is the leader, else remote with the
// leader's internal address, retrying Unavailable answers (not the leader,
// no leader, connection failures) on whichever node leads next, up to the
// hold timeout.
func viaLeader[T any](ctx context.Context, h *ClusterService, local func(context.Context) (T, error), remote func(ctx context.Context, internalAddr string) (T, error)) (T, error) {
	return routeToLeader(ctx, h, h.cfg.Direct, local, remote)
}

// viaElected is viaLeader for what only the leader can do even in Direct
// mode (handing the schedule leadership over).
func viaElected[T any](ctx context.Context, h *ClusterService, local func(context.Context) (T, error), remote func(ctx context.Context, internalAddr string) (T, error)) (T, error) {
	return routeToLeader(ctx, h, false, local, remote)
}

func routeToLeader[T any](ctx context.Context, h *ClusterService, direct bool, local func(context.Context) (T, error), remote func(ctx context.Context, internalAddr string) (T, error)) (T, error) {
	var zero T
	start := time.Now()
	// The wait ends at the hold timeout, or earlier so that the caller
	// gets the reason before its own deadline.
	giveUp, cut := start.Add(h.cfg.HoldTimeout), false
	if d, ok := ctx.Deadline(); ok && d.Add(-leaderWaitMargin).Before(giveUp) {
		giveUp, cut = d.Add(-leaderWaitMargin), true
	}
	var lastErr error
	for attempt := 0; ; attempt++ {
		id, leaderAddr := h.raft.Leader()
		switch {
		case id == h.cfg.NodeID || direct:
			resp, err := local(ctx)
			if err == nil {
				return resp, nil
			}
			if h.cfg.LeaderOnly || !retryable(err) {
				return zero, toConnect(err)
			}
			lastErr = err
		case h.cfg.LeaderOnly:
			return zero, toConnect(errNotLeaderHere)
		case id == "":
			lastErr = ErrNoLeader
		default:
			m, ok := h.members.ServerByID(id, leaderAddr)
			if !ok || m.Meta.InternalAddr == "" {
				lastErr = fmt.Errorf("%w: leader %s is not known to gossip yet", ErrNoLeader, id)
				break
			}
			resp, err := remote(ctx, m.Meta.InternalAddr)
			if err == nil {
				return resp, nil
			}
			if !retryable(err) {
				return zero, err
			}
			lastErr = err
		}
		if ctx.Err() != nil {
			return zero, toConnect(ctx.Err())
		}
		select {
		case <-h.cfg.Stopping:
			return zero, toConnect(fmt.Errorf("%w: %v", ErrStopping, lastErr))
		default:
		}
		if time.Now().After(giveUp) {
			return zero, h.gaveUp(time.Since(start), cut, direct, lastErr)
		}
		wait := time.Duration(25+rand.IntN(50)) * time.Millisecond
		if attempt > 10 {
			wait *= 2
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return zero, toConnect(ctx.Err())
		case <-h.cfg.Stopping:
			t.Stop()
			return zero, toConnect(fmt.Errorf("%w: %v", ErrStopping, lastErr))
		case <-t.C:
		}
	}
}

// forwardRequest copies the message and the caller's identifying headers.
func forwardRequest[Req any](in *connect.Request[Req]) *connect.Request[Req] {
	out := connect.NewRequest(in.Msg)
	for _, k := range []string{"X-Request-Id", "Traceparent", "Tracestate"} {
		if v := in.Header().Get(k); v != "" {
			out.Header().Set(k, v)
		}
	}
	return out
}

// cleanResponse keeps only the agent's own headers of a forwarded response.
func cleanResponse[Res any](in *connect.Response[Res]) *connect.Response[Res] {
	out := connect.NewResponse(in.Msg)
	for k, v := range in.Header() {
		if strings.HasPrefix(k, "Pivirt-") {
			out.Header()[k] = v
		}
	}
	return out
}

// Blocking queries (ReadOptions.wait_index).
const (
	defaultWaitTime = 5 * time.Minute
	maxWaitTime     = 10 * time.Minute
	// blockMargin is how long before the call's deadline a blocking query
	// answers, so that the answer arrives before the caller gives up.
	blockMargin = 250 * time.Millisecond
)

// blockIndex returns the index a blocking read compares with wait_index (the
// same index the read answers with), adding to ws channels that fire when it
// may have changed.
type blockIndex func(st *fsm.State, ws memdb.WatchSet) (uint64, error)

// tablesIndex is the blockIndex of a read of whole tables.
func tablesIndex(tables ...string) blockIndex {
	return func(st *fsm.State, ws memdb.WatchSet) (uint64, error) { return st.WatchTables(ws, tables...) }
}

// serviceIndex is the blockIndex of one service: a blocking query on it
// wakes for changes to that service only. Its index is this node's
// (fsm.State.WatchService: at least the service's last change, at most the
// applied index); the answer carries the services table's index, which is
// the same on every node, so a wait index from any node compares right.
func serviceIndex(service string) blockIndex {
	return func(st *fsm.State, ws memdb.WatchSet) (uint64, error) { return st.WatchService(ws, service) }
}

// waitTime resolves the wait of a blocking query.
func waitTime(ro *clusterv1.ReadOptions) (time.Duration, error) {
	if ro.GetWaitTime() == nil {
		return defaultWaitTime, nil
	}
	if err := ro.GetWaitTime().CheckValid(); err != nil {
		return 0, invalid("read.wait_time", "%v", err)
	}
	d := ro.GetWaitTime().AsDuration()
	if d <= 0 {
		return 0, invalid("read.wait_time", "must be positive")
	}
	return min(d, maxWaitTime), nil
}

// block waits until the index of block moves above waitIndex, the wait
// (plus up to 1/16 jitter, which spreads the wake-ups of many watchers)
// runs out, a restore replaces the state, or the agent stops; only the end
// of ctx is an error. The caller then reads the current state.
func (h *ClusterService) block(ctx context.Context, waitIndex uint64, wait time.Duration, index blockIndex) error {
	deadline := time.Now().Add(wait + rand.N(wait/16+1))
	if d, ok := ctx.Deadline(); ok && d.Add(-blockMargin).Before(deadline) {
		deadline = d.Add(-blockMargin)
	}
	for {
		st := h.state.State()
		ws := memdb.NewWatchSet()
		idx, err := index(st, ws)
		if err != nil || idx > waitIndex || !time.Now().Before(deadline) {
			return err
		}
		if h.cfg.Stopping != nil {
			ws.Add(h.cfg.Stopping)
		}
		wctx, cancel := context.WithDeadline(ctx, deadline)
		err = ws.WatchCtx(wctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			return nil // the wait ran out: answer with what there is
		}
		select {
		case <-st.AbandonCh():
			return nil // restored: the watcher must start over
		case <-h.cfg.Stopping:
			return nil
		default:
		}
	}
}

// readMode resolves the read options of a request.
func readMode(ro *clusterv1.ReadOptions) (clusterv1.Consistency, time.Duration, error) {
	mode := ro.GetConsistency()
	if mode == clusterv1.Consistency_CONSISTENCY_UNSPECIFIED {
		mode = clusterv1.Consistency_CONSISTENCY_DEFAULT
	}
	if _, ok := clusterv1.Consistency_name[int32(mode)]; !ok {
		return 0, 0, invalid("read.consistency", "unknown value %d (want default, consistent or stale)", mode)
	}
	var maxStale time.Duration
	if ro.GetMaxStale() != nil {
		if err := ro.GetMaxStale().CheckValid(); err != nil {
			return 0, 0, invalid("read.max_stale", "%v", err)
		}
		maxStale = ro.GetMaxStale().AsDuration()
		if maxStale < 0 {
			return 0, 0, invalid("read.max_stale", "must not be negative")
		}
	}
	return mode, maxStale, nil
}

// read serves a read RPC in the requested consistency mode, blocking first
// when the request has a wait_index. local returns the response and the
// index of the state it read, which blockOn also returns (with watches) for
// a blocking query; nil blockOn refuses wait_index.
func read[Req, Res any](ctx context.Context, h *ClusterService, req *connect.Request[Req], ro *clusterv1.ReadOptions, remote remoteCall[Req, Res], blockOn blockIndex, local func(context.Context) (*Res, uint64, error)) (*connect.Response[Res], error) {
	return readVia(ctx, h, ro, func(ctx context.Context, internalAddr string) (*connect.Response[Res], error) {
		resp, err := remote(h.peers.Cluster(internalAddr), ctx, forwardRequest(req))
		if err != nil {
			return nil, err
		}
		return cleanResponse(resp), nil
	}, blockOn, local)
}

// readVia is read for any service of the internal port: forward sends the
// request to the leader's internal port (a default read, or a consistent
// one when the leader has no ReadIndex) and returns its answer with the
// agent's headers only.
func readVia[Res any](ctx context.Context, h *ClusterService, ro *clusterv1.ReadOptions, forward func(ctx context.Context, internalAddr string) (*connect.Response[Res], error), blockOn blockIndex, local func(context.Context) (*Res, uint64, error)) (*connect.Response[Res], error) {
	mode, maxStale, err := readMode(ro)
	if err != nil {
		return nil, toConnect(err)
	}
	var wait time.Duration
	if ro.GetWaitIndex() > 0 {
		if blockOn == nil {
			return nil, toConnect(invalid("read.wait_index", "this read does not support blocking queries"))
		}
		if wait, err = waitTime(ro); err != nil {
			return nil, toConnect(err)
		}
	}
	serve := func(ctx context.Context) (*connect.Response[Res], error) {
		if ro.GetWaitIndex() > 0 {
			if err := h.block(ctx, ro.GetWaitIndex(), wait, blockOn); err != nil {
				return nil, err
			}
		}
		msg, index, err := local(ctx)
		if err != nil {
			return nil, err
		}
		resp := connect.NewResponse(msg)
		h.setQueryHeaders(resp.Header(), index)
		return resp, nil
	}
	if mode == clusterv1.Consistency_CONSISTENCY_STALE && !h.cfg.LeaderOnly {
		st := h.raft.RaftStatus()
		fresh := maxStale == 0 || st.State == "Leader" ||
			(!st.LastContact.IsZero() && time.Since(st.LastContact) <= maxStale)
		if fresh {
			resp, err := serve(ctx)
			return resp, toConnect(err)
		}
	}
	verified := func(ctx context.Context) (*connect.Response[Res], error) {
		if !h.leaderReady() {
			return nil, h.notReady()
		}
		if mode == clusterv1.Consistency_CONSISTENCY_CONSISTENT {
			// The leader's FSM may lag its commit index, where a follower
			// may already have read (and answered) from: wait for the read
			// index here too.
			idx, err := h.raft.ReadIndex(ctx)
			if err != nil {
				return nil, err
			}
			if err := h.waitReadIndex(ctx, idx); err != nil {
				return nil, err
			}
		}
		return serve(ctx)
	}
	if mode == clusterv1.Consistency_CONSISTENCY_CONSISTENT && !h.cfg.LeaderOnly {
		// A follower serves a consistent read itself once it has applied
		// the leader's read index: one small round trip to the leader
		// instead of forwarding the request and its answer, and the
		// reading is spread over every node (as etcd's ReadIndex).
		return viaLeader(ctx, h, verified, func(ctx context.Context, internalAddr string) (*connect.Response[Res], error) {
			idx, err := h.readIndex.readIndex(ctx, internalAddr)
			if connect.CodeOf(err) == connect.CodeUnimplemented {
				// A leader on an older binary: forward the read.
				return forward(ctx, internalAddr)
			}
			if err != nil {
				return nil, err
			}
			if err := h.waitReadIndex(ctx, idx); err != nil {
				return nil, toConnect(err)
			}
			resp, err := serve(ctx)
			return resp, toConnect(err)
		})
	}
	return viaLeader(ctx, h, verified, forward)
}

// LeaderReadIndex answers a follower's ReadIndex: this node must be the
// leader with its term's state established (the barrier: everything
// committed in earlier terms is applied here); the index is the Raft read
// index (store.Store.ReadIndex), at least every write this leader
// acknowledged and everything any node may already have applied.
func (h *ClusterService) LeaderReadIndex(ctx context.Context) (uint64, error) {
	if id, _ := h.raft.Leader(); id != h.cfg.NodeID && !h.cfg.Direct {
		return 0, toConnect(errNotLeaderHere)
	}
	if !h.leaderReady() {
		return 0, toConnect(h.notReady())
	}
	idx, err := h.raft.ReadIndex(ctx)
	if err != nil {
		return 0, toConnect(err)
	}
	return idx, nil
}

// waitReadIndex waits until the local state has applied a read index.
func (h *ClusterService) waitReadIndex(ctx context.Context, idx uint64) error {
	if err := h.state.WaitApplied(ctx, idx); err != nil {
		return fmt.Errorf("wait for read index %d (applied %d): %w", idx, h.state.AppliedIndex(), err)
	}
	return nil
}

// setQueryHeaders describes the local state a read was served from.
func (h *ClusterService) setQueryHeaders(hdr http.Header, index uint64) {
	st := h.raft.RaftStatus()
	var contact time.Duration
	if st.State != "Leader" && !st.LastContact.IsZero() {
		contact = time.Since(st.LastContact)
	}
	hdr.Set(HeaderIndex, strconv.FormatUint(index, 10))
	hdr.Set(HeaderLastContact, strconv.FormatInt(contact.Milliseconds(), 10))
	hdr.Set(HeaderKnownLeader, strconv.FormatBool(st.LeaderID != ""))
	hdr.Set(HeaderServedBy, h.cfg.NodeName)
}

// queryMeta is the body form of the query headers.
func (h *ClusterService) queryMeta(index uint64) *clusterv1.QueryMeta {
	st := h.raft.RaftStatus()
	var contact time.Duration
	if st.State != "Leader" && !st.LastContact.IsZero() {
		contact = time.Since(st.LastContact)
	}
	return &clusterv1.QueryMeta{
		Index:       index,
		LastContact: durationpb.New(contact),
		KnownLeader: st.LeaderID != "",
		ServedBy:    h.cfg.NodeName,
	}
}
