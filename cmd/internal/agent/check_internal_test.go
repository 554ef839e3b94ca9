package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/mesh/schematest"
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

// TestCheckPolicyNamesDescriptorSetResources: a policy may name the
// resource a routing rule's descriptor set declares in its annotations,
// and only with that rule.
func TestCheckPolicyNamesDescriptorSetResources(t *testing.T) {
	policy := filepath.Join(t.TempDir(), "rbac.yaml")
	if err := os.WriteFile(policy, []byte("apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules:\n  - roles: [\"widget-reader\"]\n    resources: [\"widgets\"]\n    verbs: [\"get\"]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	set := schematest.WriteSet(t)
	for _, withSet := range []bool{true, false} {
		cfg := config.Default()
		config.ApplyDev(cfg)
		cfg.DataDir = t.TempDir()
		cfg.Auth.RBACPolicy = policy
		cfg.Backends = map[string]config.BackendConfig{"widgets": {Endpoint: "127.0.0.1:1"}}
		rule := config.RouteRule{Match: config.RouteMatch{Prefix: "/" + schematest.Service}, Route: config.RouteTarget{Cluster: "widgets"}}
		if withSet {
			rule.Route.DescriptorSet = set
		}
		cfg.Routing.Rules = []config.RouteRule{rule}
		err := Check(cfg)
		switch {
		case withSet && err != nil:
			t.Errorf("with the descriptor set: %v", err)
		case !withSet && (err == nil || !strings.Contains(err.Error(), `unknown "widgets"`)):
			t.Errorf("without the descriptor set: %v, want widgets unknown", err)
		}
	}
}
