package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
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

// Prove asks the agent at addr for its status with an identity proof over
// nonce (AdmissionConfig.Ask).
func (p PoolStatus) Prove(ctx context.Context, addr string, nonce []byte) (*nodev1.StatusResponse, error) {
	ctx, cancel := withStatusTimeout(ctx)
	defer cancel()
	resp, err := p.Pool.Node(addr).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{Nonce: nonce}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// BootstrapView is the set of servers this node would bootstrap with right
// now; it is reported to other servers in the node status, so that all
// candidates can confirm they agree before any of them bootstraps.
type BootstrapView struct {
	mu  sync.Mutex
	ids []string
}

// Candidates returns the sorted node IDs of the current view.
func (v *BootstrapView) Candidates() []string {
	if v == nil {
		return nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.ids)
}

func (v *BootstrapView) set(ids []string) {
	v.mu.Lock()
	v.ids = ids
	v.mu.Unlock()
}

// BootstrapConfig configures bootstrap-expect.
type BootstrapConfig struct {
	SelfID string
	// SelfName is this node's gossip name: the one member Admission does
	// not ask (another member claiming SelfID is asked like any other).
	SelfName string
	Expect   int
	Voters   int
	// Interval between attempts when nothing changes in gossip.
	Interval time.Duration
	Logger   *slog.Logger
	// Admission, when set, counts only servers that proved their agent
	// identity (TLS on); nil counts every server gossip shows.
	Admission Admitter
}

// ErrBootstrapSkipped means another server already has Raft state, so this
// one must be added by the leader instead of bootstrapping.
var ErrBootstrapSkipped = errors.New("bootstrap skipped: a server already has raft state")

// RunBootstrapExpect waits until exactly Expect servers with the same expect
// value are alive in gossip, none of them has Raft state, and every one of
// them reports the same candidate set; then it bootstraps them all with one
// configuration. These are Consul's rules (empty log only, everybody
// agrees on the count, nobody already has peers) plus the candidate-set
// agreement, which keeps two servers with different views from writing
// different first configurations. It returns nil once bootstrapped, or
// ErrBootstrapSkipped, and logs why it waits whenever the reason changes.
func RunBootstrapExpect(ctx context.Context, cfg BootstrapConfig, raft Bootstrapper, members Membership, peers PeerStatus, view *BootstrapView) error {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", "bootstrap")
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if view == nil {
		view = &BootstrapView{}
	}
	defer view.set(nil)
	changes, cancel := members.Subscribe()
	defer cancel()
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	lastReason := ""
	for {
		if raft.HasExistingState() {
			logger.Info("not bootstrapping: this server already has raft state")
			return ErrBootstrapSkipped
		}
		servers, reason, err := bootstrapCandidates(ctx, cfg, members, peers, view)
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
func bootstrapCandidates(ctx context.Context, cfg BootstrapConfig, members Membership, peers PeerStatus, view *BootstrapView) ([]RaftServer, string, error) {
	var servers, others, claimed []Member
	mismatch := ""
	for _, m := range members.Members() {
		if m.Status == StatusAlive && m.Meta.Role == RoleServer {
			claimed = append(claimed, m)
		}
	}
	// Members that do not prove their identity are not counted, neither as
	// candidates nor as servers with state (which would stop this one).
	var unproven []string
	if cfg.Admission != nil {
		var asked []Member
		for _, m := range claimed {
			if m.Name != cfg.SelfName {
				asked = append(asked, m)
			}
		}
		refused := admitAll(ctx, cfg.Admission, asked)
		claimed = slices.DeleteFunc(claimed, func(m Member) bool {
			i := slices.IndexFunc(asked, func(o Member) bool { return o.Name == m.Name })
			if i < 0 || refused[i] == nil {
				return false
			}
			unproven = append(unproven, m.Name)
			return true
		})
	}
	for _, m := range claimed {
		switch m.Meta.BootstrapExpect {
		case cfg.Expect:
			servers = append(servers, m)
		default:
			others = append(others, m)
			if m.Meta.BootstrapExpect != 0 && mismatch == "" {
				mismatch = fmt.Sprintf("member %s expects %d servers, this one %d; every server must use the same bootstrap_expect", m.Name, m.Meta.BootstrapExpect, cfg.Expect)
			}
		}
	}
	sort.Slice(servers, func(i, j int) bool { return servers[i].Meta.ID < servers[j].Meta.ID })
	ids := make([]string, len(servers))
	for i, m := range servers {
		ids[i] = m.Meta.ID
	}
	view.set(ids)

	// A server that already has state (one started with --join, say) means
	// the cluster exists: never bootstrap a second one beside it.
	for _, m := range others {
		if st, err := peers.Status(ctx, m.Meta.InternalAddr); err == nil && (st.GetHasState() || st.GetPeers() > 0) {
			return nil, fmt.Sprintf("server %s already has raft state; this server will be added by the leader", m.Name), ErrBootstrapSkipped
		}
	}
	if mismatch != "" {
		return nil, mismatch, nil
	}
	switch {
	case len(servers) < cfg.Expect && len(unproven) > 0:
		return nil, fmt.Sprintf("%d of %d expected servers seen in gossip; not counted, their agent identity is not proven: %s",
			len(servers), cfg.Expect, strings.Join(unproven, ", ")), nil
	case len(servers) < cfg.Expect:
		return nil, fmt.Sprintf("%d of %d expected servers seen in gossip", len(servers), cfg.Expect), nil
	case len(servers) > cfg.Expect:
		return nil, fmt.Sprintf("%d servers with bootstrap_expect %d seen in gossip, more than expected; start exactly %d, or join the others to a bootstrapped cluster", len(servers), cfg.Expect, cfg.Expect), nil
	}
	if !slices.Contains(ids, cfg.SelfID) {
		return nil, "this server is not among the servers seen in gossip yet", nil
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
		if !slices.Equal(st.GetBootstrapCandidates(), ids) {
			return nil, fmt.Sprintf("server %s sees other bootstrap candidates (%v) than this one (%v)", m.Name, st.GetBootstrapCandidates(), ids), nil
		}
	}
	out := make([]RaftServer, 0, len(servers))
	for i, m := range servers {
		out = append(out, RaftServer{ID: m.Meta.ID, Address: m.Meta.RaftAddr, Voter: i < cfg.Voters})
	}
	return out, "", nil
}
