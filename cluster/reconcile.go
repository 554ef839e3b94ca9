package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"
)

// VoterManager is what the reconciler needs of the Raft store. Every
// method is idempotent and only works on the leader.
type VoterManager interface {
	Servers(ctx context.Context) ([]RaftServer, error)
	AddVoter(ctx context.Context, id, addr string) error
	AddNonvoter(ctx context.Context, id, addr string) error
	RemoveServer(ctx context.Context, id string) error
}

// ReconcileConfig configures the leader's membership reconciliation.
type ReconcileConfig struct {
	SelfID string
	// Voters is the target number of voters (1, 3 or 5); servers beyond it
	// are non-voters and are promoted when a voter goes away.
	Voters int
	// DeadServerCleanup removes a server that has been failed (or unknown
	// to gossip) this long. Zero disables it; servers that left gracefully
	// are always removed.
	DeadServerCleanup time.Duration
	// Interval between reconciliations when gossip is quiet.
	Interval time.Duration
	Logger   *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Reconciler keeps the Raft configuration in line with gossip membership.
// It runs only on the leader, for one leadership term.
type Reconciler struct {
	cfg     ReconcileConfig
	raft    VoterManager
	members Membership
	logger  *slog.Logger
	// unknownSince records when a Raft server was first found missing from
	// gossip, so servers gossip has forgotten are also cleaned up.
	unknownSince map[string]time.Time
}

// NewReconciler returns a reconciler for one leadership term.
func NewReconciler(cfg ReconcileConfig, raft VoterManager, members Membership) *Reconciler {
	if cfg.Interval <= 0 {
		cfg.Interval = 5 * time.Second
	}
	if cfg.Voters <= 0 {
		cfg.Voters = 3
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Reconciler{
		cfg:          cfg,
		raft:         raft,
		members:      members,
		logger:       logger.With("component", "reconcile"),
		unknownSince: make(map[string]time.Time),
	}
}

// Run reconciles on every gossip change and every Interval until ctx ends.
func (r *Reconciler) Run(ctx context.Context) {
	changes, cancel := r.members.Subscribe()
	defer cancel()
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		if err := r.Reconcile(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn("reconcile raft membership", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-changes:
		case <-t.C:
		}
	}
}

// Reconcile makes one pass: add alive servers (as voters up to the target,
// then as non-voters), follow address changes, remove servers that left or
// have been failed past the threshold without breaking quorum, and promote
// non-voters while voters are below the target.
func (r *Reconciler) Reconcile(ctx context.Context) error {
	servers, err := r.raft.Servers(ctx)
	if err != nil {
		return fmt.Errorf("read raft configuration: %w", err)
	}
	now := r.cfg.Now()
	byID := make(map[string]Member)
	for _, m := range r.members.Members() {
		if m.Meta.Role != RoleServer || m.Meta.ID == "" {
			continue
		}
		if old, ok := byID[m.Meta.ID]; ok && old.Status == StatusAlive {
			continue // a live entry wins over a stale one of a renamed node
		}
		byID[m.Meta.ID] = m
	}
	inRaft := make(map[string]RaftServer, len(servers))
	voters := 0
	for _, s := range servers {
		inRaft[s.ID] = s
		if s.Voter {
			voters++
		}
	}
	var errs []error

	// Removals first, so a dead voter's seat can go to a non-voter.
	for _, s := range servers {
		if s.ID == r.cfg.SelfID {
			continue
		}
		m, known := byID[s.ID]
		reason := ""
		switch {
		case known && m.Status == StatusLeft:
			reason = "left the cluster"
		case known && m.Status == StatusFailed:
			if r.cfg.DeadServerCleanup > 0 && now.Sub(m.Since) >= r.cfg.DeadServerCleanup {
				reason = fmt.Sprintf("failed for %s", now.Sub(m.Since).Round(time.Second))
			}
		case !known:
			first, ok := r.unknownSince[s.ID]
			if !ok {
				r.unknownSince[s.ID] = now
				first = now
			}
			if r.cfg.DeadServerCleanup > 0 && now.Sub(first) >= r.cfg.DeadServerCleanup {
				reason = fmt.Sprintf("unknown to gossip for %s", now.Sub(first).Round(time.Second))
			}
		}
		if known {
			delete(r.unknownSince, s.ID)
		}
		if reason == "" {
			continue
		}
		if s.Voter && !r.canRemoveVoter(servers, byID) {
			r.logger.Warn("not removing failed voter: too many voters are failed, removal could break quorum",
				"node_id", s.ID, "reason", reason)
			continue
		}
		if err := r.raft.RemoveServer(ctx, s.ID); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", s.ID, err))
			continue
		}
		r.logger.Info("removed server from raft", "node_id", s.ID, "name", m.Name, "reason", reason)
		delete(inRaft, s.ID)
		delete(r.unknownSince, s.ID)
		if s.Voter {
			voters--
		}
	}

	// Additions and address changes, in a stable order.
	alive := make([]Member, 0, len(byID))
	for _, m := range byID {
		if m.Status == StatusAlive {
			alive = append(alive, m)
		}
	}
	sort.Slice(alive, func(i, j int) bool { return alive[i].Meta.ID < alive[j].Meta.ID })
	for _, m := range alive {
		s, ok := inRaft[m.Meta.ID]
		switch {
		case !ok && voters < r.cfg.Voters:
			if err := r.raft.AddVoter(ctx, m.Meta.ID, m.Meta.RaftAddr); err != nil {
				errs = append(errs, fmt.Errorf("add voter %s: %w", m.Name, err))
				continue
			}
			voters++
			inRaft[m.Meta.ID] = RaftServer{ID: m.Meta.ID, Address: m.Meta.RaftAddr, Voter: true}
			r.logger.Info("added voter", "node_id", m.Meta.ID, "name", m.Name, "raft_addr", m.Meta.RaftAddr)
		case !ok:
			if err := r.raft.AddNonvoter(ctx, m.Meta.ID, m.Meta.RaftAddr); err != nil {
				errs = append(errs, fmt.Errorf("add non-voter %s: %w", m.Name, err))
				continue
			}
			inRaft[m.Meta.ID] = RaftServer{ID: m.Meta.ID, Address: m.Meta.RaftAddr}
			r.logger.Info("added non-voter", "node_id", m.Meta.ID, "name", m.Name, "raft_addr", m.Meta.RaftAddr)
		case s.Address != m.Meta.RaftAddr && m.Meta.ID != r.cfg.SelfID:
			add := r.raft.AddNonvoter
			if s.Voter {
				add = r.raft.AddVoter
			}
			if err := add(ctx, m.Meta.ID, m.Meta.RaftAddr); err != nil {
				errs = append(errs, fmt.Errorf("update address of %s: %w", m.Name, err))
				continue
			}
			s.Address = m.Meta.RaftAddr
			inRaft[m.Meta.ID] = s
			r.logger.Info("server address changed", "node_id", m.Meta.ID, "name", m.Name, "raft_addr", m.Meta.RaftAddr)
		}
	}

	// Promotions.
	for _, m := range alive {
		if voters >= r.cfg.Voters {
			break
		}
		s, ok := inRaft[m.Meta.ID]
		if !ok || s.Voter {
			continue
		}
		if err := r.raft.AddVoter(ctx, s.ID, s.Address); err != nil {
			errs = append(errs, fmt.Errorf("promote %s: %w", m.Name, err))
			continue
		}
		voters++
		r.logger.Info("promoted non-voter", "node_id", s.ID, "name", m.Name)
	}
	return errors.Join(errs...)
}

// canRemoveVoter applies Consul autopilot's rule: remove a failed voter only
// while fewer than half of the voters are failed, so cleanup can never take
// the cluster below quorum.
func (r *Reconciler) canRemoveVoter(servers []RaftServer, byID map[string]Member) bool {
	voters, failed := 0, 0
	for _, s := range servers {
		if !s.Voter {
			continue
		}
		voters++
		if s.ID == r.cfg.SelfID {
			continue
		}
		if m, ok := byID[s.ID]; !ok || m.Status != StatusAlive && m.Status != StatusSuspect {
			failed++
		}
	}
	return failed*2 < voters
}
