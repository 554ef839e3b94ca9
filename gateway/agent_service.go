package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/gateway/observe"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// MaxDebugDuration bounds the CPU profile of a support bundle.
const MaxDebugDuration = 5 * time.Minute

// debugChunk is the most data one DebugResponse carries.
const debugChunk = 256 << 10

// AgentPeers opens AgentService streams to other agents' internal ports.
type AgentPeers interface {
	Agents(internalAddr string) clusterv1.AgentServiceClient
}

// DebugFile is one file of a node's support bundle.
type DebugFile struct {
	Name string
	// Collect produces the file; the CPU profile takes the request's
	// duration.
	Collect func(ctx context.Context) ([]byte, error)
}

// AgentServiceConfig configures an AgentService.
type AgentServiceConfig struct {
	NodeName string
	// Local marks the instance on the internal port: it answers for this
	// node only and never relays (the relaying agent checked the caller).
	Local bool
	// Tee carries the agent's log records (Monitor, and the last lines
	// of a bundle).
	Tee *observe.Tee
	// DebugFiles lists the files of this node's bundle for a request (its
	// duration already bounded).
	DebugFiles func(req *clusterv1.DebugRequest) []DebugFile
	// History is this node's metrics history (WatchMetrics); nil:
	// WatchMetrics answers Unimplemented for this node.
	History *MetricsHistory
	// Stopping is closed when the agent begins to shut down: Monitor and
	// WatchMetrics end then with Unavailable (watch another agent), not
	// when the listener is cut.
	Stopping <-chan struct{}
	Logger   *slog.Logger
}

// AgentService implements pivirt.cluster.v1.AgentService over Connect (it
// is the handler) and gRPC (NewAgentGRPC): a request for another node is
// relayed to that node's internal port, found by name in gossip.
type AgentService struct {
	cfg     AgentServiceConfig
	members Membership
	peers   AgentPeers
	logger  *slog.Logger
}

var _ clusterv1connect.AgentServiceHandler = (*AgentService)(nil)

// NewAgentService returns the handler.
func NewAgentService(cfg AgentServiceConfig, members Membership, peers AgentPeers) *AgentService {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &AgentService{cfg: cfg, members: members, peers: peers, logger: logger.With("component", "agent-api")}
}

// ParseMonitorLevel reads a monitor's level: trace, debug, info, warn or
// error (empty: info).
func ParseMonitorLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "":
		return slog.LevelInfo, nil
	case "trace":
		return slog.LevelDebug - 4, nil
	case "debug":
		return slog.LevelDebug, nil
	case "info":
		return slog.LevelInfo, nil
	case "warn":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, invalid("level", "%q: want trace, debug, info, warn or error", s)
}

// relayTo returns the internal address of node when the request is for
// another node than this one ("" when it is for this one).
func (s *AgentService) relayTo(node string) (string, error) {
	if node == "" || node == s.cfg.NodeName {
		return "", nil
	}
	if s.cfg.Local {
		return "", connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("this is node %s, not %s", s.cfg.NodeName, node))
	}
	for _, m := range s.members.Members() {
		if m.Name != node {
			continue
		}
		if m.Status != cluster.StatusAlive || m.Meta.InternalAddr == "" {
			return "", connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s is %s", node, m.Status))
		}
		return m.Meta.InternalAddr, nil
	}
	return "", connect.NewError(connect.CodeNotFound, fmt.Errorf("no member named %s", node))
}

// Monitor implements clusterv1connect.AgentServiceHandler.
func (s *AgentService) Monitor(ctx context.Context, req *connect.Request[clusterv1.MonitorRequest], stream *connect.ServerStream[clusterv1.MonitorResponse]) error {
	return s.monitor(ctx, req.Msg, stream.Send)
}

func (s *AgentService) monitor(ctx context.Context, req *clusterv1.MonitorRequest, send func(*clusterv1.MonitorResponse) error) error {
	level, err := ParseMonitorLevel(req.GetLevel())
	if err != nil {
		return toConnect(err)
	}
	addr, err := s.relayTo(req.GetNode())
	if err != nil {
		return err
	}
	if addr != "" {
		return relay(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[clusterv1.MonitorResponse], error) {
			return s.peers.Agents(addr).Monitor(ctx, req)
		}, send)
	}
	if s.cfg.Tee == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("this agent keeps no log for monitors"))
	}
	sub := s.cfg.Tee.Subscribe(level)
	defer sub.Close()
	if err := send(&clusterv1.MonitorResponse{Node: s.cfg.NodeName}); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.cfg.Stopping:
			return s.stopping()
		case e := <-sub.C():
			line := e.Text()
			if req.GetJson() {
				line = e.JSON()
			}
			if err := send(&clusterv1.MonitorResponse{Node: s.cfg.NodeName, Line: line, Dropped: sub.Dropped()}); err != nil {
				return err
			}
		}
	}
}

// Debug implements clusterv1connect.AgentServiceHandler.
func (s *AgentService) Debug(ctx context.Context, req *connect.Request[clusterv1.DebugRequest], stream *connect.ServerStream[clusterv1.DebugResponse]) error {
	return s.debug(ctx, req.Msg, stream.Send)
}

func (s *AgentService) debug(ctx context.Context, req *clusterv1.DebugRequest, send func(*clusterv1.DebugResponse) error) error {
	if d := req.GetDuration(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() < 0 || d.AsDuration() > MaxDebugDuration {
			return toConnect(invalid("duration", "%v: want 0 to %v", d.AsDuration(), MaxDebugDuration))
		}
	}
	if req.GetLogLines() < 0 {
		return toConnect(invalid("log_lines", "%d: want 0 or more", req.GetLogLines()))
	}
	addr, err := s.relayTo(req.GetNode())
	if err != nil {
		return err
	}
	if addr != "" {
		return relay(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[clusterv1.DebugResponse], error) {
			return s.peers.Agents(addr).Debug(ctx, req)
		}, send)
	}
	if s.cfg.DebugFiles == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("this agent collects no support bundle"))
	}
	node := s.cfg.NodeName
	s.logger.InfoContext(ctx, "collecting a support bundle", "cpu_profile", req.GetDuration().AsDuration())
	for _, f := range s.cfg.DebugFiles(req) {
		if err := send(&clusterv1.DebugResponse{Node: node, File: f.Name, Started: true}); err != nil {
			return err
		}
		data, err := f.Collect(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			if err := send(&clusterv1.DebugResponse{Node: node, File: f.Name, Done: true, Error: err.Error()}); err != nil {
				return err
			}
			continue
		}
		for len(data) > 0 {
			n := min(len(data), debugChunk)
			if err := send(&clusterv1.DebugResponse{Node: node, File: f.Name, Data: data[:n]}); err != nil {
				return err
			}
			data = data[n:]
		}
		if err := send(&clusterv1.DebugResponse{Node: node, File: f.Name, Done: true}); err != nil {
			return err
		}
	}
	return nil
}

// WatchMetrics implements clusterv1connect.AgentServiceHandler.
func (s *AgentService) WatchMetrics(ctx context.Context, req *connect.Request[clusterv1.WatchMetricsRequest], stream *connect.ServerStream[clusterv1.WatchMetricsResponse]) error {
	return s.watchMetrics(ctx, req.Msg, stream.Send)
}

// watchMetrics sends the history kept, then each new sample. The
// subscription hands over the history as a copy of the ring and each
// sample through a buffered channel, so nothing is locked while sending.
func (s *AgentService) watchMetrics(ctx context.Context, req *clusterv1.WatchMetricsRequest, send func(*clusterv1.WatchMetricsResponse) error) error {
	addr, err := s.relayTo(req.GetNode())
	if err != nil {
		return err
	}
	if addr != "" {
		return relay(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[clusterv1.WatchMetricsResponse], error) {
			return s.peers.Agents(addr).WatchMetrics(ctx, req)
		}, send)
	}
	if s.cfg.History == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("this agent keeps no metrics history"))
	}
	history, next, stop := s.cfg.History.Subscribe()
	defer stop()
	interval := durationpb.New(MetricsInterval)
	if err := send(&clusterv1.WatchMetricsResponse{Node: s.cfg.NodeName, History: history, Interval: interval}); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.cfg.Stopping:
			return s.stopping()
		case m, ok := <-next:
			if !ok {
				return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("this stream fell more than %d samples behind the metrics of %s; reconnect to get the history again", metricsSubBuffer, s.cfg.NodeName))
			}
			if err := send(&clusterv1.WatchMetricsResponse{Node: s.cfg.NodeName, Sample: m, Interval: interval}); err != nil {
				return err
			}
		}
	}
}

// stopping is the end of a stream when the agent shuts down.
func (s *AgentService) stopping() error {
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s is shutting down; watch another agent", s.cfg.NodeName))
}

// relay copies another agent's stream to send.
func relay[T any](ctx context.Context, open func(context.Context) (grpc.ServerStreamingClient[T], error), send func(*T) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := open(ctx)
	if err != nil {
		return cluster.StreamError(err)
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return cluster.StreamError(err)
		}
		if err := send(m); err != nil {
			return err
		}
	}
}

// NewAgentGRPC serves s over gRPC.
func NewAgentGRPC(s *AgentService) clusterv1.AgentServiceServer { return agentGRPC{s} }

type agentGRPC struct{ s *AgentService }

func (g agentGRPC) Monitor(req *clusterv1.MonitorRequest, stream grpc.ServerStreamingServer[clusterv1.MonitorResponse]) error {
	if err := g.s.monitor(stream.Context(), req, stream.Send); err != nil {
		return grpcError(stream.Context(), err)
	}
	return nil
}

func (g agentGRPC) Debug(req *clusterv1.DebugRequest, stream grpc.ServerStreamingServer[clusterv1.DebugResponse]) error {
	if err := g.s.debug(stream.Context(), req, stream.Send); err != nil {
		return grpcError(stream.Context(), err)
	}
	return nil
}

func (g agentGRPC) WatchMetrics(req *clusterv1.WatchMetricsRequest, stream grpc.ServerStreamingServer[clusterv1.WatchMetricsResponse]) error {
	if err := g.s.watchMetrics(stream.Context(), req, stream.Send); err != nil {
		return grpcError(stream.Context(), err)
	}
	return nil
}
