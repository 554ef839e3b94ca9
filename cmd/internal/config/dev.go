package config

import (
	"bytes"
	"fmt"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
)

// DevKeys are the keys (and key prefixes) ApplyDev sets, whatever the file says: with --dev
// a file may not set them (Flags.Resolve refuses it, naming them), except through the flag
// of the key (--node-name, --data-dir, the address flags), which wins over dev mode.
var DevKeys = []string{
	"node_name", "data_dir",
	"server.connectrpc.addr", "server.connectrpc.tls", "server.grpc_internal.addr", "server.metrics.addr",
	"tls",
	"service_discovery.type",
	"cluster.advertise_addr", "cluster.gossip.bind_addr", "cluster.gossip.advertise_addr",
	"cluster.raft.addr", "cluster.raft.advertise_addr", "cluster.raft.voters", "cluster.raft.bootstrap", "cluster.raft.bootstrap_expect",
	"cluster.join", "cluster.retry_join",
}

// flagKeys are the keys the flags set (each flag one key).
var flagKeys = map[string]string{
	FlagNodeName:         "node_name",
	FlagDataDir:          "data_dir",
	FlagGossipAddr:       "cluster.gossip.bind_addr",
	FlagAdvertiseAddr:    "cluster.advertise_addr",
	FlagAPIAddr:          "server.connectrpc.addr",
	FlagInternalAddr:     "server.grpc_internal.addr",
	FlagMetricsAddr:      "server.metrics.addr",
	FlagRaftAddr:         "cluster.raft.addr",
	FlagJoin:             "cluster.join",
	FlagRetryJoin:        "cluster.retry_join",
	FlagRetryInterval:    "cluster.retry_interval",
	FlagRetryMax:         "cluster.retry_max",
	FlagBootstrapExpect:  "cluster.raft.bootstrap_expect",
	FlagBootstrap:        "cluster.raft.bootstrap",
	FlagVoters:           "cluster.raft.voters",
	FlagLeaveOnTerminate: "cluster.leave_on_terminate",
	FlagLogLevel:         "logging.level",
	FlagLogFormat:        "logging.format",
}

// fileKey is a key a configuration file sets, with its line.
type fileKey struct {
	path string
	line int
}

// fileKeys lists the keys data sets, in the order they appear: the paths of its scalar
// values and lists (a list is one value), as Load names them. A null value sets nothing
// (a section whose keys are all commented out). data must be a file Parse accepts.
func fileKeys(data []byte) []fileKey {
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil || doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		return nil
	}
	var out []fileKey
	budget := maxNodes
	var walk func(n *yaml.Node, path string, line int)
	walk = func(n *yaml.Node, path string, line int) {
		for i := 0; n.Kind == yaml.AliasNode && n.Alias != nil && i < 100; i++ {
			n = n.Alias
		}
		if budget--; budget < 0 {
			return
		}
		switch {
		case n.Kind == yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k := n.Content[i]
				walk(n.Content[i+1], joinKey(path, k.Value), k.Line)
			}
		case n.Kind == yaml.ScalarNode && n.ShortTag() == nullTag:
		case path != "":
			out = append(out, fileKey{path, line})
		}
	}
	walk(doc.Content[0], "", 0)
	return out
}

// devConflicts is the error for a --config file that sets keys --dev sets itself (DevKeys)
// and no flag sets: each named with its line. set reports whether a flag was given.
func devConflicts(file string, data []byte, set func(flag string) bool) error {
	var flagged []string
	for flag, key := range flagKeys {
		if set(flag) {
			flagged = append(flagged, key)
		}
	}
	var conflicts []string
	for _, k := range fileKeys(data) {
		dev := slices.ContainsFunc(DevKeys, func(d string) bool { return Under(k.path, d) })
		byFlag := slices.ContainsFunc(flagged, func(f string) bool { return Under(k.path, f) })
		if dev && !byFlag {
			conflicts = append(conflicts, fmt.Sprintf("%s (line %d)", k.path, k.line))
		}
	}
	if len(conflicts) == 0 {
		return nil
	}
	return fmt.Errorf("--%s with --%s %s: dev mode sets these keys itself and would ignore the file's values: %s; "+
		"remove them from the file to run it in dev mode (one node on 127.0.0.1, TLS with a throw-away PKI; "+
		"--node-name, --data-dir and the address flags still set their keys), or run without --%s to use them",
		FlagDev, FlagConfig, file, strings.Join(conflicts, ", "), FlagDev)
}
