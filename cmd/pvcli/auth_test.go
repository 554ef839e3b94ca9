package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestToken: --token and PVCLI_TOKEN go out as Authorization: Bearer, and
// never in clear text to a host that is not loopback.
func TestToken(t *testing.T) {
	fake := newFakeCluster()
	url := fake.start(t)
	runCLI(t, url, "--token", "tok-flag", "cluster", "leader").mustSucceed(t)
	cliRun{env: map[string]string{envToken: "tok-env"}}.run(t, "--endpoint", url, "cluster", "leader").mustSucceed(t)
	fake.mu.Lock()
	got := strings.Join(fake.auth, "|")
	fake.mu.Unlock()
	if got != "Bearer tok-flag|Bearer tok-env" {
		t.Errorf("Authorization headers %q", got)
	}
	r := runCLI(t, "http://pivirt.example:8443", "--token", "secret", "cluster", "leader")
	if exitCode(r.err) != 2 || !strings.Contains(r.stderr, "--token needs an https:// endpoint") {
		t.Errorf("a token in clear text to another host: exit %d, %q", exitCode(r.err), r.stderr)
	}
}

// TestDefaultClientCertificate: without --cert-file, the files of
// ~/.config/pvcli are presented to https:// endpoints (a broken pair is
// reported naming them) and ignored for http://.
func TestDefaultClientCertificate(t *testing.T) {
	home := t.TempDir()
	dir := filepath.Join(home, ".config", "pvcli")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"client.crt", "client.key"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("not PEM"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env := map[string]string{"HOME": home}
	r := cliRun{env: env}.run(t, "--endpoint", "https://127.0.0.1:1", "cluster", "leader")
	if exitCode(r.err) != 2 || !strings.Contains(r.stderr, "the default client certificate "+filepath.Join(dir, "client.crt")) {
		t.Errorf("a broken default certificate: exit %d, %q", exitCode(r.err), r.stderr)
	}
	fake := newFakeCluster()
	url := fake.start(t)
	cliRun{env: env}.run(t, "--endpoint", url, "cluster", "leader").mustSucceed(t)
}
