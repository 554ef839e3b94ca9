package e2e_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// docsExamples runs docs/security.md's curl and openssl commands against node n:
// the JSON call of the API with a client certificate, and s_client on the
// internal port with an agent certificate (verified) and without one
// (refused). CI installs curl and openssl; elsewhere the step is skipped
// when they are missing.
func (c *cluster) docsExamples(t *testing.T, n *node) {
	needTools(t, "curl", "openssl")
	chain := filepath.Join(c.certs, identity.ChainFile)
	run := func(stdin string, name string, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Stdin = strings.NewReader(stdin)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	// curl --cacert ca-chain.pem --cert admin.crt --key admin.key ... /Leader
	out, err := run("", "curl", "-sS", "--fail-with-body", "--cacert", chain,
		"--cert", filepath.Join(c.certs, "operator.crt"), "--key", filepath.Join(c.certs, "operator.key"),
		"-H", "Content-Type: application/json", "-d", "{}", "https://"+n.api+"/pivirt.cluster.v1.ClusterService/Leader")
	if err != nil {
		t.Fatalf("curl: %v\n%s", err, out)
	}
	var leader struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal([]byte(out), &leader); err != nil || leader.Name == "" {
		t.Errorf("curl Leader answered %q (%v); want the leader as JSON", out, err)
	}

	// openssl s_client -connect ...:9000 -CAfile ca-chain.pem -cert pivirt-agent-<node>.crt ...
	out, err = run("Q\n", "openssl", "s_client", "-connect", n.intern, "-CAfile", chain,
		"-cert", filepath.Join(c.certs, "pivirt-agent-"+n.name+".crt"),
		"-key", filepath.Join(c.certs, "pivirt-agent-"+n.name+".key"), "-verify_return_error")
	if err != nil || !strings.Contains(out, "Verify return code: 0 (ok)") {
		t.Errorf("openssl s_client with an agent certificate: %v; want \"Verify return code: 0 (ok)\" in:\n%s", err, out)
	}
	// Without a client certificate the internal port refuses. With TLS 1.2
	// the refusal is part of the handshake (TLS 1.3 sends it after the
	// client's Finished, which s_client may not wait for).
	out, err = run("", "openssl", "s_client", "-tls1_2", "-connect", n.intern, "-CAfile", chain)
	if err == nil || !strings.Contains(out, "alert handshake failure") && !strings.Contains(out, "alert bad certificate") {
		t.Errorf("openssl s_client without a client certificate was not refused (%v):\n%s", err, out)
	}
}
