package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// Server is one member of the Raft configuration.
type Server struct {
	ID      string // Raft server ID (the node ID)
	Address string // Raft address
	Voter   bool   // votes in elections and counts towards commit quorum
}

// Bootstrap writes the initial configuration to this server's empty state.
// Several servers may be bootstrapped with the same list (as with
// --bootstrap-expect); they then elect a leader among themselves. A server
// that already has state returns ErrAlreadyBootstrapped, which is safe to
// ignore.
func (s *Store) Bootstrap(servers []Server) error {
	if len(servers) == 0 {
		return errors.New("bootstrap: no servers given")
	}
	cfg := raft.Configuration{Servers: make([]raft.Server, 0, len(servers))}
	ids := make(map[string]bool, len(servers))
	addrs := make(map[string]bool, len(servers))
	voters := 0
	for i, srv := range servers {
		if srv.ID == "" || srv.Address == "" {
			return fmt.Errorf("bootstrap: servers[%d]: ID and Address are required", i)
		}
		if ids[srv.ID] || addrs[srv.Address] {
			return fmt.Errorf("bootstrap: servers[%d]: duplicate ID %q or address %q", i, srv.ID, srv.Address)
		}
		ids[srv.ID], addrs[srv.Address] = true, true
		suffrage := raft.Nonvoter
		if srv.Voter {
			suffrage = raft.Voter
			voters++
		}
		cfg.Servers = append(cfg.Servers, raft.Server{
			ID:       raft.ServerID(srv.ID),
			Address:  raft.ServerAddress(srv.Address),
			Suffrage: suffrage,
		})
	}
	if voters == 0 {
		return errors.New("bootstrap: at least one server must be a voter")
	}
	if s.HasExistingState() {
		return fmt.Errorf("bootstrap: %w", ErrAlreadyBootstrapped)
	}
	if err := s.raft.BootstrapCluster(cfg).Error(); err != nil {
		return fmt.Errorf("bootstrap: %w", mapRaftError(err))
	}
	s.log.Info("bootstrapped raft cluster", "servers", len(servers), "voters", voters)
	return nil
}

// configuration returns the latest (possibly uncommitted) Raft
// configuration. In hashicorp/raft v1.7 this is answered without waiting on
// raft's main loop.
func (s *Store) configuration() ([]raft.Server, error) {
	f := s.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, mapRaftError(err)
	}
	return f.Configuration().Servers, nil
}

// Servers returns the latest Raft configuration as known to this server
// (the leader's view is authoritative; a follower's may lag).
func (s *Store) Servers(ctx context.Context) ([]Server, error) {
	if err := ctx.Err(); err != nil {
		return nil, contextError(ctx)
	}
	cfg, err := s.configuration()
	if err != nil {
		return nil, fmt.Errorf("get configuration: %w", err)
	}
	out := make([]Server, len(cfg))
	for i, srv := range cfg {
		out[i] = Server{ID: string(srv.ID), Address: string(srv.Address), Voter: srv.Suffrage == raft.Voter}
	}
	return out, nil
}

// AddVoter makes id a voter at addr. Leader only. It is idempotent: a voter
// with the same ID and address is left alone; a server with the same ID but
// another address is removed and added again at addr (two configuration
// changes: raft's change in place races, see DESIGN.md); a non-voter is
// promoted. Another
// server that holds addr under a different ID is a stale entry (its node
// came back with a new identity) and is removed first.
func (s *Store) AddVoter(ctx context.Context, id, addr string) error {
	if err := s.addServer(ctx, id, addr, true); err != nil {
		return fmt.Errorf("add voter %s at %s: %w", id, addr, err)
	}
	return nil
}

// AddNonvoter adds id at addr as a non-voter, which receives the log but does
// not vote. Leader only. It is idempotent and never demotes: an existing
// server with the same ID keeps its suffrage, and is removed and added
// again at addr if its address differs. A stale entry holding addr under another ID is
// removed first, as in AddVoter.
func (s *Store) AddNonvoter(ctx context.Context, id, addr string) error {
	if err := s.addServer(ctx, id, addr, false); err != nil {
		return fmt.Errorf("add nonvoter %s at %s: %w", id, addr, err)
	}
	return nil
}

func (s *Store) addServer(ctx context.Context, id, addr string, voter bool) error {
	if id == "" || addr == "" {
		return errors.New("ID and address are required")
	}
	if !s.IsLeader() {
		return ErrNotLeader
	}
	cfg, err := s.configuration()
	if err != nil {
		return err
	}
	var stale []raft.Server
	for _, srv := range cfg {
		switch {
		case string(srv.ID) == id:
			if string(srv.Address) == addr && (srv.Suffrage == raft.Voter || !voter) {
				return nil // already as asked
			}
			if string(srv.Address) != addr && id != s.id {
				// A new address for another server is a removal and an
				// addition, not a change in place (DESIGN.md, "Invariants":
				// address changes), while the voters left without it can commit
				// the removal. Its suffrage stays (or is raised).
				voter = voter || srv.Suffrage == raft.Voter
				if srv.Suffrage == raft.Voter {
					if err := s.reach.settle(ctx); err != nil {
						return err
					}
				}
				if srv.Suffrage == raft.Voter && !s.reach.quorumWithout(cfg, raft.ServerID(s.id), srv.ID) {
					s.log.Warn("voter has a new address; the other voters reached are no quorum without it, so it is changed in place",
						"id", id, "old_address", srv.Address, "address", addr)
					continue
				}
				s.log.Info("server has a new address: removing it and adding it again", "id", id, "old_address", srv.Address, "address", addr, "voter", voter)
				stale = append(stale, srv)
			}
		case string(srv.Address) == addr:
			if string(srv.ID) == s.id {
				return ErrAddressInUse
			}
			stale = append(stale, srv)
		}
	}
	for _, srv := range stale {
		if string(srv.ID) != id {
			s.log.Warn("removing server whose address is claimed by another ID", "removed_id", srv.ID, "address", addr, "new_id", id)
		}
		if err := s.changeConfig(ctx, func(timeout time.Duration) raft.Future {
			return s.raft.RemoveServer(srv.ID, 0, timeout)
		}); err != nil {
			return fmt.Errorf("remove %s at its old address %s: %w", srv.ID, srv.Address, err)
		}
	}
	err = s.changeConfig(ctx, func(timeout time.Duration) raft.Future {
		if voter {
			return s.raft.AddVoter(raft.ServerID(id), raft.ServerAddress(addr), 0, timeout)
		}
		return s.raft.AddNonvoter(raft.ServerID(id), raft.ServerAddress(addr), 0, timeout)
	})
	if err != nil {
		return err
	}
	s.log.Info("added server", "id", id, "address", addr, "voter", voter)
	return nil
}

// DemoteVoter turns voter id into a non-voter. Leader only. A non-voter is
// left alone; an ID not in the configuration is ErrUnknownServer.
func (s *Store) DemoteVoter(ctx context.Context, id string) error {
	srv, err := s.leaderLookup(id)
	if err != nil {
		return fmt.Errorf("demote voter %s: %w", id, err)
	}
	if srv.Suffrage != raft.Voter {
		return nil
	}
	if err := s.changeConfig(ctx, func(timeout time.Duration) raft.Future {
		return s.raft.DemoteVoter(raft.ServerID(id), 0, timeout)
	}); err != nil {
		return fmt.Errorf("demote voter %s: %w", id, err)
	}
	s.log.Info("demoted voter", "id", id)
	return nil
}

// RemoveServer removes id from the configuration. Leader only. An ID not in
// the configuration is a no-op. Removing the leader itself makes it step
// down once the change is committed.
func (s *Store) RemoveServer(ctx context.Context, id string) error {
	if _, err := s.leaderLookup(id); err != nil {
		if errors.Is(err, ErrUnknownServer) {
			return nil
		}
		return fmt.Errorf("remove server %s: %w", id, err)
	}
	if err := s.changeConfig(ctx, func(timeout time.Duration) raft.Future {
		return s.raft.RemoveServer(raft.ServerID(id), 0, timeout)
	}); err != nil {
		return fmt.Errorf("remove server %s: %w", id, err)
	}
	s.log.Info("removed server", "id", id)
	return nil
}

// leaderLookup checks that this server is the leader and returns id's entry
// in the latest configuration, or ErrUnknownServer.
func (s *Store) leaderLookup(id string) (raft.Server, error) {
	if !s.IsLeader() {
		return raft.Server{}, ErrNotLeader
	}
	cfg, err := s.configuration()
	if err != nil {
		return raft.Server{}, err
	}
	for _, srv := range cfg {
		if string(srv.ID) == id {
			return srv, nil
		}
	}
	return raft.Server{}, ErrUnknownServer
}

// changeConfig proposes one configuration change with ctx's deadline as the
// enqueue timeout and waits for it to be committed.
func (s *Store) changeConfig(ctx context.Context, change func(timeout time.Duration) raft.Future) error {
	timeout, err := enqueueTimeout(ctx)
	if err != nil {
		return err
	}
	return s.wait(ctx, change(timeout))
}

// TransferLeadership hands leadership to voter id, or to the most up-to-date
// voter when id is "". Leader only. It returns once this server has stepped
// down, with the new leader's ID when it becomes known within an election
// timeout (or "" otherwise). Transferring to this server itself is a no-op.
// While a transfer runs the leader rejects writes with
// ErrLeadershipTransferInProgress.
func (s *Store) TransferLeadership(ctx context.Context, id string) (newLeader string, err error) {
	if err := ctx.Err(); err != nil {
		return "", contextError(ctx)
	}
	var target raft.Server
	if id != "" {
		if target, err = s.leaderLookup(id); err != nil {
			return "", fmt.Errorf("transfer leadership to %s: %w", id, err)
		}
		if id == s.id {
			return s.id, nil
		}
		if target.Suffrage != raft.Voter {
			return "", fmt.Errorf("transfer leadership to %s: %w", id, ErrNotVoter)
		}
	} else if !s.IsLeader() {
		return "", fmt.Errorf("transfer leadership: %w", ErrNotLeader)
	}

	// Watch leader changes from before the transfer starts, so the new
	// leader's first heartbeat is not missed.
	obsCh := make(chan raft.Observation, 4)
	obs := raft.NewObserver(obsCh, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	s.raft.RegisterObserver(obs)
	defer s.raft.DeregisterObserver(obs)

	var f raft.Future
	if id == "" {
		f = s.raft.LeadershipTransfer()
	} else {
		f = s.raft.LeadershipTransferToServer(target.ID, target.Address)
	}
	if err := s.wait(ctx, f); err != nil {
		return "", fmt.Errorf("transfer leadership: %w", err)
	}
	s.log.Info("transferred leadership", "target", id)

	timer := time.NewTimer(s.electionTimeout)
	defer timer.Stop()
	for {
		if leader, _ := s.Leader(); leader != "" && leader != s.id {
			return leader, nil
		}
		select {
		case <-obsCh:
		case <-timer.C:
			return "", nil
		case <-ctx.Done():
			return "", nil
		case <-s.closing:
			return "", nil
		}
	}
}
