package config

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestDevKeysCoverApplyDev: every key ApplyDev changes is among DevKeys,
// for the defaults and for the reference configuration (which sets most
// of them), so that --dev refuses every file value it would ignore.
func TestDevKeysCoverApplyDev(t *testing.T) {
	spec, err := Load(filepath.Join("testdata", "spec-agent.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	odd := Default()
	odd.TLS.InsecureKeyPermissions, odd.TLS.ClusterCA.Enabled = true, true
	odd.Cluster.Gossip.AdvertiseAddr, odd.Cluster.Raft.AdvertiseAddr = "10.0.0.9:7946", "10.0.0.9:8300"
	odd.Cluster.Join, odd.Cluster.RetryJoin = []string{"10.0.0.2:7946"}, []string{"10.0.0.3:7946"}
	odd.Cluster.Raft.BootstrapExpect = 3
	for name, c := range map[string]*Config{"defaults": Default(), "spec-agent.yaml": spec, "every dev key set": odd} {
		dev := *c
		ApplyDev(&dev)
		for _, k := range Diff(c, &dev) {
			if !slices.ContainsFunc(DevKeys, func(d string) bool { return Under(k, d) }) {
				t.Errorf("%s: ApplyDev changes %s, which DevKeys does not list", name, k)
			}
		}
	}
}

// TestDevRefusesOverriddenFileKeys: --dev with a --config file that sets
// keys dev mode sets itself is refused, naming each key and its line and
// what to do; keys dev mode leaves alone, null sections and keys whose
// flag is given pass.
func TestDevRefusesOverriddenFileKeys(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	overriding := write("overriding.yaml", "logging:\n  level: debug\ntls:\n  cert_file: /etc/pivirt/certs/a.crt\n"+
		"server:\n  connectrpc:\n    addr: 0.0.0.0:8443\ncluster:\n  join: [\"10.0.0.2:7946\"]\n  raft:\n    voters: 3\n")
	own := write("own.yaml", "logging:\n  level: debug\n  format: text\nsnapshot:\n  retain: 3\ntls:\ncluster:\n  leave_on_terminate: true\n")
	flagged := write("flagged.yaml", "node_name: n7\nserver:\n  connectrpc:\n    addr: 127.0.0.1:28443\n")

	_, err := parseFlags(t, "--dev", "--config", overriding).Resolve()
	if err == nil {
		t.Fatal("--dev with a file setting tls.cert_file, server.connectrpc.addr, cluster.join and cluster.raft.voters was accepted")
	}
	for _, want := range []string{
		"--dev with --config " + overriding + ": dev mode sets these keys itself and would ignore the file's values: " +
			"tls.cert_file (line 4), server.connectrpc.addr (line 7), cluster.join (line 9), cluster.raft.voters (line 11); ",
		"remove them from the file", "or run without --dev",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q, want it to contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "logging.level") {
		t.Errorf("error %q names a key dev mode leaves alone", err)
	}
	// Without --dev the same file is the operator's to use.
	if _, err := parseFlags(t, "--config", overriding, "--data-dir", dir).Resolve(); err != nil && strings.Contains(err.Error(), "dev mode") {
		t.Errorf("without --dev: %v", err)
	}

	cfg, err := parseFlags(t, "--dev", "--config", own).Resolve()
	if err != nil {
		t.Fatalf("--dev with a file of keys dev mode leaves alone: %v", err)
	}
	if !cfg.Dev || cfg.Logging.Level != "debug" || cfg.Snapshot.Retain != 3 || !cfg.Cluster.LeaveOnTerminate {
		t.Errorf("--dev with %s: dev %v, logging.level %q, snapshot.retain %d, leave_on_terminate %v", own, cfg.Dev, cfg.Logging.Level, cfg.Snapshot.Retain, cfg.Cluster.LeaveOnTerminate)
	}
	cfg, err = parseFlags(t, "--dev", "--config", flagged, "--node-name", "n8", "--api-addr", "127.0.0.1:38443").Resolve()
	if err != nil {
		t.Fatalf("--dev with file keys whose flags are given: %v", err)
	}
	if cfg.NodeName != "n8" || cfg.Server.ConnectRPC.Addr != "127.0.0.1:38443" {
		t.Errorf("node_name %q, server.connectrpc.addr %q: want the flags' values", cfg.NodeName, cfg.Server.ConnectRPC.Addr)
	}
	if _, err := parseFlags(t, "--dev", "--config", flagged, "--node-name", "n8").Resolve(); err == nil || !strings.Contains(err.Error(), "server.connectrpc.addr (line 4)") ||
		strings.Contains(err.Error(), "node_name") {
		t.Errorf("--dev --node-name with a file setting node_name and server.connectrpc.addr = %v, want server.connectrpc.addr named alone", err)
	}
}
