package e2e_test

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/identity"
)

// toolkitExamples runs the operator's conveniences against the real
// cluster: the quick start's exports with several endpoints of which the
// first is down (no scheme: https:// because a CA file is given), a
// context of the configuration file, and pvcli version.
func (c *cluster) toolkitExamples(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close()
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]

	env := append(c.operatorEnv(), "PVCLI_ENDPOINT="+down+","+n1.api)
	if r := c.pvcliEnv(t, env, "cluster", "members"); r.code != 0 {
		t.Errorf("%s\nwant the members through %s after %s refused", r, n1.api, down)
	}
	r := c.pvcliEnv(t, env, "version")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "pvcli ") || !strings.Contains(r.stdout, "agent pivirt-agent ") ||
		!strings.Contains(r.stdout, "(protocol 1) on "+n1.name+" at https://"+n1.api) {
		t.Errorf("%s\nwant the client's and %s's versions", r, n1.name)
	}

	// A context saved once, then used with no flag or variable.
	cfg := []string{"PVCLI_CONFIG=" + filepath.Join(t.TempDir(), "config.yaml")}
	set := c.pvcliEnv(t, cfg, "context", "set", "e2e", "--endpoint", n2.api+","+n3.api,
		"--ca-file", filepath.Join(c.certs, identity.ChainFile),
		"--cert-file", filepath.Join(c.certs, "operator.crt"), "--key-file", filepath.Join(c.certs, "operator.key"))
	if set.code != 0 {
		t.Fatalf("%s", set)
	}
	if r := c.pvcliEnv(t, cfg, "-o", "json", "service", "list", "--consistency", "consistent"); r.code != 0 || !strings.Contains(r.stdout, "instances") {
		t.Errorf("%s\nwant the services through the context's endpoints", r)
	}
	if _, err := os.Stat(strings.TrimPrefix(cfg[0], "PVCLI_CONFIG=")); err != nil {
		t.Error(err)
	}
}
