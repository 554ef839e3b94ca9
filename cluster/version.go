package cluster

import (
	"pilab.hu/pivirt-agent/fsm"
)

// MinVersionProtocol is the lowest agent protocol whose announced version
// counts: an agent announcing less (or no protocol) predates cluster
// versions and runs version 0.0, whatever release string it announces.
const MinVersionProtocol = 2

// AnnouncedVersion is the cluster version an agent's gossip metadata
// announces: its ClusterVersion, else the major.minor of its release, or
// 0.0 for an agent that predates cluster versions (or announces nothing
// that parses).
func AnnouncedVersion(m NodeMeta) fsm.Version {
	if m.Protocol < MinVersionProtocol {
		return fsm.Version0_0
	}
	if m.ClusterVersion != "" {
		if v, err := fsm.ParseVersion(m.ClusterVersion); err == nil {
			return v
		}
	}
	v, err := fsm.ParseVersion(m.Version)
	if err != nil {
		return fsm.Version0_0
	}
	return v
}

// ServerVersion is what a Raft server announces in gossip.
type ServerVersion struct {
	RaftServer
	// Name is the server's gossip name; empty when no member has its ID.
	Name string
	// Release and Protocol are what it announces; Version the cluster
	// version they make (AnnouncedVersion).
	Release  string
	Protocol int
	Version  fsm.Version
	// Known is false when gossip has no member with the server's ID: its
	// version is unknown, and counts as the oldest.
	Known bool
	// Status is the member's gossip status.
	Status MemberStatus
}

// ServerVersions matches every Raft server with its gossip member (by ID,
// preferring an alive member at the server's Raft address, then any alive
// member, then the one seen first, as Gossip.ServerByID does) and reads
// its announced version.
func ServerVersions(servers []RaftServer, members []Member) []ServerVersion {
	out := make([]ServerVersion, 0, len(servers))
	for _, s := range servers {
		sv := ServerVersion{RaftServer: s, Version: fsm.Version0_0}
		var best *Member
		rank := func(m *Member) int {
			switch {
			case m.Status == StatusAlive && m.Meta.RaftAddr == s.Address:
				return 2
			case m.Status == StatusAlive:
				return 1
			}
			return 0
		}
		for i := range members {
			m := &members[i]
			if m.Meta.ID != s.ID {
				continue
			}
			if best == nil || rank(m) > rank(best) || (rank(m) == rank(best) && m.Since.Before(best.Since)) {
				best = m
			}
		}
		if best != nil {
			sv.Known, sv.Name, sv.Status = true, best.Name, best.Status
			sv.Release, sv.Protocol = best.Meta.Version, best.Meta.Protocol
			sv.Version = AnnouncedVersion(best.Meta)
		}
		out = append(out, sv)
	}
	return out
}

// LowestVersion is the lowest version among servers (a server of unknown
// version counts as 0.0), with the servers that run it; Latest when there
// are none.
func LowestVersion(servers []ServerVersion) (fsm.Version, []ServerVersion) {
	if len(servers) == 0 {
		return fsm.Latest, nil
	}
	low := servers[0].Version
	for _, s := range servers[1:] {
		if s.Version.Less(low) {
			low = s.Version
		}
	}
	var at []ServerVersion
	for _, s := range servers {
		if s.Version == low {
			at = append(at, s)
		}
	}
	return low, at
}
