package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestEndpointFailover: of several endpoints, one that cannot be
// connected to is skipped for the next, a write included, and a stopped
// agent is reported at once instead of in silence until --timeout.
func TestEndpointFailover(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	closed := "127.0.0.1:" + strconv.Itoa(closedPort(t))

	r := runCLI(t, closed+","+url, "--verbose", "config", "set", "kv/a", "1")
	if r.err != nil {
		t.Fatalf("write through %s,%s: %v\n%s", closed, url, r.err, r.stderr)
	}
	if !strings.Contains(r.stderr, "cannot connect to "+closed) || !strings.Contains(r.stderr, "trying "+strings.TrimPrefix(url, "http://")) {
		t.Errorf("--verbose does not tell of the failover:\n%s", r.stderr)
	}
	cliRun{env: map[string]string{envEndpoint: closed + "," + url}}.run(t, "cluster", "members").mustSucceed(t)
	if n := len(fake.recorded()); n != 2 {
		t.Errorf("%d calls reached the live agent, want 2 (one write, one read)", n)
	}

	// Every endpoint down: said at once, with each one's reason, once.
	closed2 := "127.0.0.1:" + strconv.Itoa(closedPort(t))
	r = runCLI(t, closed+","+closed2, "--timeout", "1s", "config", "set", "kv/a", "2")
	if r.err == nil {
		t.Fatal("a write with every agent down succeeded")
	}
	if strings.Count(r.stderr, "Cannot connect to any of the 2 agents") != 1 || !strings.Contains(r.stderr, closed+": connection refused") ||
		!strings.Contains(r.stderr, closed2+": connection refused") || !strings.Contains(r.stderr, "retrying until --timeout 1s") {
		t.Errorf("stderr with every agent down:\n%s", r.stderr)
	}
	if n := len(fake.recorded()); n != 2 {
		t.Errorf("%d calls reached the live agent, want still 2", n)
	}

	r = runCLI(t, url+",https://127.0.0.1:1", "cluster", "members")
	if exitCode(r.err) != 2 || !strings.Contains(r.stderr, "mix http:// and https://") {
		t.Errorf("mixed schemes: exit %d, %q", exitCode(r.err), r.stderr)
	}
}

// TestHTTPSByDefaultWithCredentials: HOST:PORT means https:// when a CA
// file is given (the quick start's exports), http:// otherwise.
func TestHTTPSByDefaultWithCredentials(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	hostPort, ca := fake.startTLS(t)
	cliRun{env: map[string]string{envCAFile: ca, envEndpoint: hostPort}}.run(t, "cluster", "members").mustSucceed(t)
	runCLI(t, hostPort, "--ca-file", ca, "cluster", "members").mustSucceed(t)
	// The default endpoint is 127.0.0.1:8443 with the same rule.
	r := cliRun{env: map[string]string{envCAFile: ca}}.run(t, "--timeout", "1s", "cluster", "members")
	if r.err == nil || !strings.Contains(r.stderr, "127.0.0.1:8443") || strings.Contains(r.stderr, "need an https:// endpoint") {
		t.Errorf("default endpoint with a CA file: %v\n%s", r.err, r.stderr)
	}
	r = runCLI(t, "http://"+hostPort, "--ca-file", ca, "cluster", "members")
	if exitCode(r.err) != 2 || !strings.Contains(r.stderr, "need an https:// endpoint") {
		t.Errorf("an explicit http:// endpoint with a CA file: exit %d, %q", exitCode(r.err), r.stderr)
	}
}

// TestContexts: contexts of the configuration file give endpoints and
// credentials; flags and environment variables override them; the file
// is 0600 and list never shows a token.
func TestContexts(t *testing.T) {
	t.Parallel()
	prod := newFakeCluster()
	prodAddr, ca := prod.startTLS(t)
	dev := newFakeCluster()
	devURL := dev.start(t)
	home := t.TempDir()
	env := map[string]string{"HOME": home}
	cli := cliRun{env: env}

	cli.run(t, "context", "set", "prod", "--endpoint", "127.0.0.1:1,"+prodAddr, "--ca-file", ca, "--token", "s3cret").mustSucceed(t)
	cli.run(t, "context", "set", "dev", "--endpoint", devURL).mustSucceed(t)
	path := filepath.Join(home, ".config", "pvcli", "config.yaml")
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("config file: %v, mode %v; want 0600", err, st)
	}

	// The first context set became current: prod, over https with its
	// token, failing over past its dead first endpoint.
	cli.run(t, "cluster", "members").mustSucceed(t)
	prod.mu.Lock()
	auth := strings.Join(prod.auth, "|")
	prod.mu.Unlock()
	if auth != "Bearer s3cret" {
		t.Fatalf("prod got Authorization %q, want the context's token once", auth)
	}
	list := cli.run(t, "context", "list").mustSucceed(t).stdout
	if !regexp.MustCompile(`(?m)^\*\s+prod\s`).MatchString(list) || strings.Contains(list, "s3cret") {
		t.Errorf("context list:\n%s", list)
	}

	cli.run(t, "context", "use", "dev").mustSucceed(t)
	cli.run(t, "service", "list").mustSucceed(t)
	if len(dev.recorded()) != 1 {
		t.Errorf("dev got %d calls after context use dev, want 1", len(dev.recorded()))
	}
	// --context and PVCLI_CONTEXT pick another context; --endpoint wins
	// over any context.
	cli.run(t, "--context", "prod", "cluster", "members").mustSucceed(t)
	cliRun{env: map[string]string{"HOME": home, envContext: "prod"}}.run(t, "cluster", "members").mustSucceed(t)
	cli.run(t, "--context", "prod", "--endpoint", devURL, "--ca-file", "", "--token", "", "cluster", "members").mustSucceed(t)
	if len(prod.recorded()) != 3 || len(dev.recorded()) != 2 {
		t.Errorf("calls prod %d, dev %d; want 3 and 2", len(prod.recorded()), len(dev.recorded()))
	}

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"context", "use", "nope"}, `no context "nope"`},
		{[]string{"--context", "nope", "cluster", "members"}, `--context "nope": no such context`},
	} {
		r := cli.run(t, tt.args...)
		if exitCode(r.err) != 2 || !strings.Contains(r.stderr, tt.want) {
			t.Errorf("pvcli %v: exit %d, %q; want %q", tt.args, exitCode(r.err), r.stderr, tt.want)
		}
	}
	if err := os.WriteFile(path, []byte("contexts:\n  x:\n    endpoint: a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := cli.run(t, "cluster", "members")
	if exitCode(r.err) != 2 || !strings.Contains(r.stderr, path) || !strings.Contains(r.stderr, "endpoint") {
		t.Errorf("a bad configuration file: exit %d, %q", exitCode(r.err), r.stderr)
	}
	cli.run(t, "version", "--client").mustSucceed(t) // needs no configuration
}
