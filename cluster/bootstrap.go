package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"connectrpc.com/connect"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// RaftServer is one entry of the Raft configuration.
type RaftServer struct {
	ID      string
	Address string
	Voter   bool
}

// Bootstrapper is what bootstrap needs of the Raft store.
type Bootstrapper interface {
	HasExistingState() bool
	Bootstrap(servers []RaftServer) error
}

// Membership is the gossip view used by bootstrap and voter management.
type Membership interface {
	Members() []Member
	Subscribe() (<-chan struct{}, func())
}

// PeerStatus asks another agent for its Raft status over the internal port.
type PeerStatus interface {
	Status(ctx context.Context, internalAddr string) (*nodev1.StatusResponse, error)
}

// PoolStatus implements PeerStatus over a Pool.
type PoolStatus struct{ Pool *Pool }

// Status implements PeerStatus.
func (p PoolStatus) Status(ctx context.Context, addr string) (*nodev1.StatusResponse, error) {
	ctx, cancel := withStatusTimeout(ctx)
	defer cancel()
	resp, err := p.Pool.Node(addr).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// BootstrapConfig configures bootstrap-expect.
type BootstrapConfig struct {
	SelfID string
	Expect int
	Voters int
	// Interval between attempts when nothing changes in gossip.
	Interval time.Duration
	Logger   *slog.Logger
}

// ErrBootstrapSkipped means another server already has Raft state, so this
// one must be added by the leader instead of bootstrapping.
var ErrBootstrapSkipped = errors.New("bootstrap skipped: a server already has raft state")

// RunBootstrapExpect waits until Expect servers with the same expect value
// are alive in gossip and none of them has Raft state, then bootstraps them
// all with one configuration. It follows Consul's rules: only on an empty log,
// only when every server agrees on the expected count, and never when any
// server already has peers. It returns nil once bootstrapped, or
// ErrBootstrapSkipped, and logs why it waits whenever the reason changes.
func RunBootstrapExpect(ctx context.Context, cfg BootstrapConfig, raft Bootstrapper, members Membership, peers PeerStatus) error {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", "bootstrap")
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if raft.HasExistingState() {
		logger.Info("not bootstrapping: this server already has raft state")
		return ErrBootstrapSkipped
	}
	changes, cancel := members.Subscribe()
	defer cancel()
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	lastReason := ""
	for {
		servers, reason, err := bootstrapCandidates(ctx, cfg, members, peers)
		switch {
		case errors.Is(err, ErrBootstrapSkipped):
			logger.Info("not bootstrapping", "reason", reason)
			return err
		case err != nil:
			return err
		case servers != nil:
			if err := raft.Bootstrap(servers); err != nil {
				return fmt.Errorf("bootstrap raft: %w", err)
			}
			logger.Info("bootstrapped raft cluster", "servers", len(servers), "expect", cfg.Expect)
			return nil
		}
		if reason != lastReason {
			logger.Info("waiting to bootstrap", "reason", reason, "expect", cfg.Expect)
			lastReason = reason
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changes:
		case <-t.C:
		}
	}
}

// bootstrapCandidates returns the configuration to bootstrap, or nil and the
// reason for waiting.
func bootstrapCandidates(ctx context.Context, cfg BootstrapConfig, members Membership, peers PeerStatus) ([]RaftServer, string, error) {
	var servers []Member
	for _, m := range members.Members() {
		if m.Status != StatusAlive || m.Meta.Role != RoleServer {
			continue
		}
		if m.Meta.BootstrapExpect != cfg.Expect {
			if m.Meta.BootstrapExpect == 0 {
				// A server started with --join only: it will be added later.
				continue
			}
			return nil, fmt.Sprintf("member %s expects %d servers, this one %d; every server must use the same bootstrap_expect", m.Name, m.Meta.BootstrapExpect, cfg.Expect), nil
		}
		servers = append(servers, m)
	}
	if len(servers) < cfg.Expect {
		return nil, fmt.Sprintf("%d of %d expected servers seen in gossip", len(servers), cfg.Expect), nil
	}
	for _, m := range servers {
		if m.Meta.ID == cfg.SelfID {
			continue
		}
		st, err := peers.Status(ctx, m.Meta.InternalAddr)
		if err != nil {
			return nil, fmt.Sprintf("cannot ask %s (%s) for its raft state: %v", m.Name, m.Meta.InternalAddr, err), nil
		}
		if st.GetHasState() || st.GetPeers() > 0 {
			return nil, fmt.Sprintf("server %s already has raft state; this server will be added by the leader", m.Name), ErrBootstrapSkipped
		}
	}
	sort.Slice(servers, func(i, j int) bool { return servers[i].Meta.ID < servers[j].Meta.ID })
	out := make([]RaftServer, 0, len(servers))
	self := false
	for i, m := range servers {
		out = append(out, RaftServer{ID: m.Meta.ID, Address: m.Meta.RaftAddr, Voter: i < cfg.Voters})
		self = self || m.Meta.ID == cfg.SelfID
	}
	if !self {
		return nil, "this server is not among the servers seen in gossip yet", nil
	}
	return out, "", nil
}
