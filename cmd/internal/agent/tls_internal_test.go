package agent

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// TestKeyPermissions: every configured key file that others may read or
// group may write is refused, naming its key, and one that group may read
// unless root owns it; tls.insecure_key_permissions turns the refusal into
// a warning.
func TestKeyPermissions(t *testing.T) {
	dir := t.TempDir()
	file := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("secret"), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg := config.Default()
	cfg.TLS.KeyFile = file("agent.key", 0o600)
	cfg.Server.ConnectRPC.TLS.KeyFile = file("server.key", 0o640) // group read: allowed when root owns it
	cfg.Cluster.Gossip.EncryptKeyFile = file("gossip.key", 0o604)
	cfg.Backends = map[string]config.BackendConfig{"pivirtd": {TLS: config.BackendTLSConfig{KeyFile: file("backend.key", 0o660)}}}
	err := checkKeyPermissions(cfg, slog.New(slog.DiscardHandler))
	for _, want := range []string{"cluster.gossip.encrypt_key_file", "backends.pivirtd.tls.key_file"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not name %s", err, want)
		}
	}
	byRoot := os.Getuid() == 0
	if named := err != nil && strings.Contains(err.Error(), "server.connectrpc.tls.key_file"); named == byRoot {
		t.Errorf("a group-readable key owned by uid %d: refused %v, want %v", os.Getuid(), named, !byRoot)
	}
	if err != nil && strings.Contains(err.Error(), "tls.key_file: "+cfg.TLS.KeyFile) {
		t.Errorf("the 0600 key is refused: %v", err)
	}
	wantWarnings := 2
	if !byRoot {
		wantWarnings = 3
	}

	var logs bytes.Buffer
	cfg.TLS.InsecureKeyPermissions = true
	if err := checkKeyPermissions(cfg, slog.New(slog.NewTextHandler(&logs, nil))); err != nil {
		t.Errorf("with tls.insecure_key_permissions: %v", err)
	}
	if n := strings.Count(logs.String(), "readable by group or others"); n != wantWarnings {
		t.Errorf("%d warnings, want %d:\n%s", n, wantWarnings, logs.String())
	}
}
