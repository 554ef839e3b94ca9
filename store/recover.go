package store

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/hashicorp/raft"
)

// RecoverCluster rewrites the Raft state in cfg.DataDir so that, on its next
// start, the server uses servers as its configuration. It is the offline
// disaster-recovery step for a cluster that has lost quorum: stop every
// surviving agent, run it on each of them with the same list (or on one of
// them with itself as the only voter, then join the others afresh), and start
// them again.
//
// The agent must not be running on cfg.DataDir. cfg.FSM is used to replay
// the log into a snapshot and must be discarded afterwards. StreamLayer is
// not needed. WARNING: every entry in the log is treated as committed, so an
// entry that was still being replicated when quorum was lost becomes
// committed.
func RecoverCluster(cfg Config, servers []Server) (err error) {
	if err := cfg.validate(false); err != nil {
		return err
	}
	if len(servers) == 0 {
		return errors.New("recover cluster: no servers given")
	}
	conf := raft.Configuration{Servers: make([]raft.Server, len(servers))}
	for i, srv := range servers {
		suffrage := raft.Nonvoter
		if srv.Voter {
			suffrage = raft.Voter
		}
		conf.Servers[i] = raft.Server{ID: raft.ServerID(srv.ID), Address: raft.ServerAddress(srv.Address), Suffrage: suffrage}
	}

	logger := newHCLogAdapter(cfg.Logger).With("node_id", cfg.NodeID).(*hclogAdapter)
	cfg.LogVerificationInterval = 0 // nothing is appended
	stores, err := openStores(cfg, filepath.Join(cfg.DataDir, raftDir), logger, slog.New(slog.DiscardHandler))
	if err != nil {
		return fmt.Errorf("recover cluster: %w", err)
	}
	defer func() {
		if cerr := stores.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("recover cluster: close raft log: %w", cerr)
		}
	}()
	// The transport only encodes peers into the new snapshot's metadata.
	_, trans := raft.NewInmemTransport(raft.ServerAddress(cfg.NodeID))
	defer trans.Close()
	if err := raft.RecoverCluster(cfg.raftConfig(logger, nil), filterCheckpoints(cfg.FSM), stores.logs, stores.stable, stores.snaps, trans, conf); err != nil {
		return fmt.Errorf("recover cluster: %w", err)
	}
	return nil
}
