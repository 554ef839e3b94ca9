package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/singleflight"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// The bounds of WatchStatusRequest.interval.
const (
	DefaultWatchInterval = time.Second
	MinWatchInterval     = 250 * time.Millisecond
	MaxWatchInterval     = time.Minute
)

// watchCallBudget bounds the calls of one snapshot that go to the leader
// (Peers, AutopilotState): at least this long, so that a forwarded call
// completes on a slow network, at most watchCallBudgetMax, so that a
// cluster without a leader still gets a snapshot (with the reason) this
// often.
const (
	watchCallBudget    = time.Second
	watchCallBudgetMax = 5 * time.Second
)

// memberChanges is what of the gossip ring WatchStatus follows when the
// Membership offers it (cluster.Gossip does): a coalesced wake-up after
// every change.
type memberChanges interface {
	Subscribe() (<-chan struct{}, func())
}

// WatchStatusInterval reads a WatchStatusRequest's interval: unset is
// DefaultWatchInterval; out of [MinWatchInterval, MaxWatchInterval] is
// InvalidArgument naming the field.
func WatchStatusInterval(req *clusterv1.WatchStatusRequest) (time.Duration, error) {
	d := req.GetInterval()
	if d == nil {
		return DefaultWatchInterval, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, invalid("interval", "%v", err)
	}
	if v := d.AsDuration(); v < MinWatchInterval || v > MaxWatchInterval {
		return 0, invalid("interval", "%v: want %v to %v (unset: %v)", v, MinWatchInterval, MaxWatchInterval, DefaultWatchInterval)
	}
	return d.AsDuration(), nil
}

// WatchStatus implements clusterv1connect.ClusterServiceHandler.
func (h *ClusterService) WatchStatus(ctx context.Context, req *connect.Request[clusterv1.WatchStatusRequest], stream *connect.ServerStream[clusterv1.WatchStatusResponse]) error {
	return h.watchStatus(ctx, req.Msg, req.Header(), stream.Send)
}

// watchStatus sends a snapshot at once, then after every interval and
// after every change of the gossip membership, no two closer than
// MinWatchInterval, until the client goes away or the agent stops. Each
// snapshot is built by the handlers of Members, Leader, Peers and
// AutopilotState (Peers and AutopilotState forwarded to the leader as
// they are for any caller) before it is sent: one snapshot at a time per
// stream, nothing held while sending.
func (h *ClusterService) watchStatus(ctx context.Context, req *clusterv1.WatchStatusRequest, hdr http.Header, send func(*clusterv1.WatchStatusResponse) error) error {
	interval, err := WatchStatusInterval(req)
	if err != nil {
		return toConnect(err)
	}
	if h.cfg.LeaderOnly {
		return connect.NewError(connect.CodeUnimplemented, errors.New("WatchStatus is served on the API port"))
	}
	var changed <-chan struct{}
	if mc, ok := h.members.(memberChanges); ok {
		ch, stop := mc.Subscribe()
		defer stop()
		changed = ch
	}
	budget := min(max(interval, watchCallBudget), watchCallBudgetMax)
	stopping := func() error {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s is shutting down; watch another agent", h.cfg.NodeName))
	}
	// Timers of Go 1.23 on: Reset discards an expiry nobody received, so
	// the timer is reused without draining.
	timer := time.NewTimer(interval)
	defer timer.Stop()
	// notBefore: the snapshot sent must be built after it (a gossip
	// change must show; a tick takes one of the last MinWatchInterval).
	notBefore := time.Now().Add(-MinWatchInterval)
	for {
		if err := send(h.sharedSnapshot(ctx, hdr, budget, notBefore)); err != nil {
			return err
		}
		sent := time.Now()
		timer.Reset(interval)
		select {
		case <-ctx.Done():
			return nil
		case <-h.cfg.Stopping:
			return stopping()
		case <-timer.C:
			notBefore = time.Now().Add(-MinWatchInterval)
		case <-changed:
			notBefore = time.Now()
			// A burst of gossip changes: at most one snapshot per
			// MinWatchInterval.
			if wait := MinWatchInterval - time.Since(sent); wait > 0 {
				timer.Reset(wait)
				select {
				case <-ctx.Done():
					return nil
				case <-h.cfg.Stopping:
					return stopping()
				case <-timer.C:
				}
			}
		}
	}
}

// statusCache holds the node's last snapshot: the streams of every caller
// share it, so that the leader's work (Peers and AutopilotState each ask
// every server for its status) does not grow with the streams open on a
// node: at most one snapshot per MinWatchInterval is built, whatever the
// number of streams and their intervals.
type statusCache struct {
	group singleflight.Group
	mu    sync.Mutex
	at    time.Time
	snap  *clusterv1.WatchStatusResponse
}

// sharedSnapshot answers the cached snapshot when it was built after
// notBefore, else builds one (streams asking at once share the build,
// which no single caller's end cancels).
func (h *ClusterService) sharedSnapshot(ctx context.Context, hdr http.Header, budget time.Duration, notBefore time.Time) *clusterv1.WatchStatusResponse {
	c := &h.status
	c.mu.Lock()
	if c.snap != nil && c.at.After(notBefore) {
		snap := c.snap
		c.mu.Unlock()
		return snap
	}
	c.mu.Unlock()
	v, _, _ := c.group.Do("status", func() (any, error) {
		at := time.Now()
		snap := h.statusSnapshot(context.WithoutCancel(ctx), hdr, budget)
		c.mu.Lock()
		c.snap, c.at = snap, at
		c.mu.Unlock()
		return snap, nil
	})
	return v.(*clusterv1.WatchStatusResponse)
}

// statusSnapshot is the node's view of the cluster now, through the
// handlers of the unary reads. The calls that go to the leader run
// concurrently within budget; a failure is reported in the snapshot.
func (h *ClusterService) statusSnapshot(ctx context.Context, hdr http.Header, budget time.Duration) *clusterv1.WatchStatusResponse {
	out := &clusterv1.WatchStatusResponse{Node: h.cfg.NodeName, Time: timestamppb.Now()}
	if resp, err := h.Members(ctx, childRequest(hdr, &clusterv1.MembersRequest{})); err == nil {
		out.Members = resp.Msg.GetMembers()
	}
	if resp, err := h.Leader(ctx, childRequest(hdr, &clusterv1.LeaderRequest{})); err != nil {
		out.LeaderError = watchError(err)
	} else {
		out.Leader = resp.Msg
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		resp, err := h.Peers(ctx, childRequest(hdr, &clusterv1.PeersRequest{}))
		if err != nil {
			out.PeersError = watchError(err)
			return
		}
		out.Peers = resp.Msg.GetPeers()
	})
	wg.Go(func() {
		resp, err := h.AutopilotState(ctx, childRequest(hdr, &clusterv1.AutopilotStateRequest{}))
		if err != nil {
			out.AutopilotError = watchError(err)
			return
		}
		out.Autopilot = resp.Msg
	})
	wg.Wait()
	return out
}

// childRequest is a request of a snapshot's call with the identifying
// headers of the stream's request, which forwarding passes on.
func childRequest[T any](hdr http.Header, msg *T) *connect.Request[T] {
	req := connect.NewRequest(msg)
	for _, k := range []string{"X-Request-Id", "Traceparent", "Tracestate"} {
		if v := hdr.Get(k); v != "" {
			req.Header().Set(k, v)
		}
	}
	return req
}

// watchError is the text of a snapshot call's error as pvcli prints it:
// the code, then the message.
func watchError(err error) string {
	return toConnect(err).Error()
}

// watchStatusServer is the part of *ClusterService the gRPC adapter needs
// for the stream.
type watchStatusServer interface {
	watchStatus(ctx context.Context, req *clusterv1.WatchStatusRequest, hdr http.Header, send func(*clusterv1.WatchStatusResponse) error) error
}

func (g clusterGRPC) WatchStatus(req *clusterv1.WatchStatusRequest, stream grpc.ServerStreamingServer[clusterv1.WatchStatusResponse]) error {
	ws, ok := g.h.(watchStatusServer)
	if !ok {
		return grpcError(stream.Context(), connect.NewError(connect.CodeUnimplemented, errors.New("WatchStatus is not served here")))
	}
	if err := ws.watchStatus(stream.Context(), req, incomingHeader(stream.Context()), stream.Send); err != nil {
		return grpcError(stream.Context(), err)
	}
	return nil
}
