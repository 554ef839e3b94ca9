package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/store"
)

// PeerEntry is one server of a peers file, the input of `pivirt-agent
// recover`: the Raft configuration the cluster restarts with.
type PeerEntry struct {
	// ID is the server's node ID (<data_dir>/node-id, `pvcli cluster peers`).
	ID string `json:"id"`
	// Address is its Raft address, host:port.
	Address string `json:"address"`
	// NonVoter makes it a non-voting member.
	NonVoter bool `json:"non_voter,omitempty"`
}

// ReadPeersFile reads and checks a peers file: a JSON array of PeerEntry
// with at least one voter, no repeated ID or address, every address a
// host:port.
func ReadPeersFile(path string) ([]store.Server, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("peers file: %w", err)
	}
	return parsePeers(path, b)
}

func parsePeers(path string, b []byte) ([]store.Server, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var entries []PeerEntry
	if err := dec.Decode(&entries); err != nil {
		return nil, fmt.Errorf("peers file %s: want a JSON array of {\"id\", \"address\", \"non_voter\"}: %w", path, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("peers file %s: trailing data after the JSON array", path)
	}
	if len(entries) == 0 {
		return nil, fmt.Errorf("peers file %s: no servers listed", path)
	}
	var (
		out    []store.Server
		ids    = map[string]int{}
		addrs  = map[string]int{}
		voters int
	)
	for i, e := range entries {
		where := fmt.Sprintf("peers file %s: entry %d", path, i)
		if e.ID == "" {
			return nil, fmt.Errorf("%s: id is required", where)
		}
		if j, dup := ids[e.ID]; dup {
			return nil, fmt.Errorf("%s: id %q is also entry %d", where, e.ID, j)
		}
		host, port, err := net.SplitHostPort(e.Address)
		if err != nil || host == "" {
			return nil, fmt.Errorf("%s: address %q is not host:port", where, e.Address)
		}
		if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			return nil, fmt.Errorf("%s: address %q has no valid port", where, e.Address)
		}
		if j, dup := addrs[e.Address]; dup {
			return nil, fmt.Errorf("%s: address %q is also entry %d", where, e.Address, j)
		}
		ids[e.ID], addrs[e.Address] = i, i
		if !e.NonVoter {
			voters++
		}
		out = append(out, store.Server{ID: e.ID, Address: e.Address, Voter: !e.NonVoter})
	}
	if voters == 0 {
		return nil, fmt.Errorf("peers file %s: no voter listed; a cluster needs at least one", path)
	}
	return out, nil
}

// Recover rewrites the Raft state in dataDir so that the agent, on its
// next start, uses servers as the cluster's configuration: the offline
// disaster-recovery step for a cluster that lost quorum (see
// docs/backup.md, "Disaster recovery"). The agent must not be running on dataDir, and its
// own node ID must be one of servers. Every entry in its log counts as
// committed afterwards.
func Recover(dataDir string, servers []store.Server, logger *slog.Logger) error {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if _, err := os.Stat(filepath.Join(dataDir, "node-id")); err != nil {
		return fmt.Errorf("data dir %s: no node-id here, so no agent state to recover: %w", dataDir, err)
	}
	id, err := identity.LoadOrCreateNodeID(dataDir)
	if err != nil {
		return err
	}
	found := false
	for _, s := range servers {
		found = found || s.ID == id
	}
	if !found {
		return fmt.Errorf("this data dir belongs to node %s, which the peers file does not list: it could never lead the recovered cluster", id)
	}
	// The same FSM configuration as the agent's (Start): the log is
	// replayed into a snapshot with it.
	fcfg := fsm.DefaultConfig()
	fcfg.Logger = logger
	f, err := fsm.New(fcfg)
	if err != nil {
		return err
	}
	cfg := store.DefaultConfig()
	cfg.NodeID = id
	cfg.DataDir = dataDir
	cfg.FSM = f
	cfg.Logger = logger
	if err := store.RecoverCluster(cfg, servers); err != nil {
		if errors.Is(err, store.ErrDataDirLocked) {
			return fmt.Errorf("%w: stop the agent first", err)
		}
		return err
	}
	return nil
}

// PrintPeers writes the servers of a recovery for the operator.
func PrintPeers(w io.Writer, servers []store.Server) {
	for _, s := range servers {
		role := "voter"
		if !s.Voter {
			role = "non-voter"
		}
		fmt.Fprintf(w, "  %s  %s  %s\n", s.ID, s.Address, role)
	}
}
