package agent

import (
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// TestCheckLeavesDevFilesToTheStart: with --dev, a backend whose TLS takes
// the agent's own files is not checked before the start makes them (the
// development PKI).
func TestCheckLeavesDevFilesToTheStart(t *testing.T) {
	cfg := config.Default()
	config.ApplyDev(cfg)
	cfg.DataDir = t.TempDir()
	cfg.Backends = map[string]config.BackendConfig{"osinfodb": {Endpoint: "https://127.0.0.1:1", TLS: config.BackendTLSConfig{Enabled: true}}}
	if err := Check(cfg); err != nil {
		t.Errorf("Check of a dev configuration whose backend takes the dev PKI: %v", err)
	}
}
