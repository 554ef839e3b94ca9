package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/docgen"
)

// TestDocsMetricsReference: docs/metrics.md lists every metric of the
// agent's registry as running agents hold it — one in the base
// configuration, one for each configuration that registers more (make
// docs rewrites it).
func TestDocsMetricsReference(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the reference describes the agent on Linux, whose process metrics other systems do not have")
	}
	// Each agent sets the keys that register more metrics, alone or with
	// those they need: then the page can say which keys register which.
	dir := testPKI(t, 1)
	policy := filepath.Join(t.TempDir(), "rbac.yaml")
	if err := os.WriteFile(policy, []byte(minimalPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	modes := []docgen.MetricsMode{
		baseMetrics(t),
		metricsWith(t, []string{"tls.enabled"}, withTLS(dir)),
		metricsWith(t, []string{"tls.enabled", "tls.cluster_ca.enabled"}, withClusterCA(dir, dir, time.Hour, 100, 100)),
		// Nothing is asked of the (absent) CA server before a certificate
		// is due.
		metricsWith(t, []string{"tls.enabled", "tls.ca_server.url"}, func(i int, cfg *config.Config) {
			withTLS(dir)(i, cfg)
			cfg.TLS.CAServer = config.CAServerConfig{URL: "https://127.0.0.1:1", RenewBefore: config.Duration(config.DefaultRenewBefore)}
		}),
		// An issuer that does not answer: discovery goes on in the
		// background.
		metricsWith(t, []string{"auth.oidc.issuer_url"}, func(_ int, cfg *config.Config) {
			cfg.Auth.OIDC = config.OIDCConfig{IssuerURL: "http://127.0.0.1:1", ClientID: "pivirt", AllowHTTPIssuer: true}
		}),
		metricsWith(t, []string{"auth.rbac_policy"}, func(_ int, cfg *config.Config) { cfg.Auth.RBACPolicy = policy }),
	}
	page, err := docgen.MetricsReference(modes...)
	if err != nil {
		t.Fatal(err)
	}
	if err := docgen.CheckFile("../../../docs/metrics.md", page); err != nil {
		t.Error(err)
	}
}

// minimalPolicy is an RBAC policy file: one rule.
const minimalPolicy = `apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["admin"]
    resources: ["*"]
    verbs: ["*"]
`

// baseMetrics describes the registry of a leader with a backend and a
// registered service instance: then the collectors that read state at
// scrape time (the registry, the backends' endpoints, Raft) give a sample
// of each of their metrics, which their types are read from.
func baseMetrics(t *testing.T) docgen.MetricsMode {
	t.Helper()
	s := startSim(t)
	n := agenttest.NewExpect(t, 1, withBackends(s.addr)).WaitLeader(20 * time.Second)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := agenttest.Register(ctx, n, "web", "web-1", "10.0.0.1", 80); err != nil {
		t.Fatal(err)
	}
	mode, err := docgen.DescribeMetrics(nil, agent.MetricCollectors(n.Agent))
	if err != nil {
		t.Fatal(err)
	}
	return mode
}

// metricsWith describes the registry of an agent started with keys set by
// mutate.
func metricsWith(t *testing.T, keys []string, mutate func(int, *config.Config)) docgen.MetricsMode {
	t.Helper()
	n := agenttest.NewExpect(t, 1, mutate).Node(0)
	mode, err := docgen.DescribeMetrics(keys, agent.MetricCollectors(n.Agent))
	if err != nil {
		t.Fatal(err)
	}
	return mode
}
