package cluster

import (
	"encoding/json"
	"fmt"
)

// Role of a gossip member. Only servers take part in Raft.
const (
	RoleServer = "server"
)

// NodeMeta is what every member advertises through gossip. It must fit
// memberlist's 512-byte meta limit, so keys are short.
type NodeMeta struct {
	// Cluster is the cluster name; members of another cluster are refused.
	Cluster      string `json:"c"`
	ID           string `json:"id"`
	Role         string `json:"r"`
	RaftAddr     string `json:"ra"`
	APIAddr      string `json:"aa"`
	InternalAddr string `json:"ia"`
	Version      string `json:"v"`
	// Protocol is the agent protocol version (absent from agents that
	// predate it).
	Protocol        int `json:"p,omitempty"`
	BootstrapExpect int `json:"be,omitempty"`
	// Leaving is set just before a graceful leave, so that members can tell
	// a departure from a failure (memberlist reports both as "leave").
	Leaving bool `json:"l,omitempty"`
	// Started is when the agent process started (Unix milliseconds), so
	// that members tell a restart from a member that stayed up even when
	// it came back before anyone declared it failed.
	Started int64 `json:"st,omitempty"`
	// ClusterVersion is the newest cluster version the agent applies
	// (fsm.Latest), announced as such rather than derived from a release
	// string packaging may stamp; absent from agents before 0.1.
	ClusterVersion string `json:"cv,omitempty"`
}

// metaLimit is memberlist's MetaMaxSize.
const metaLimit = 512

func (m NodeMeta) encode() ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode node meta: %w", err)
	}
	if len(b) > metaLimit {
		return nil, fmt.Errorf("node meta is %d bytes, over the %d-byte gossip limit", len(b), metaLimit)
	}
	return b, nil
}

func decodeMeta(b []byte) (NodeMeta, error) {
	var m NodeMeta
	if len(b) == 0 {
		return m, fmt.Errorf("empty node meta")
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("decode node meta: %w", err)
	}
	return m, nil
}
