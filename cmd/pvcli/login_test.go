package main

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/gateway/authn/oidctest"
	"pilab.hu/pivirt-agent/identity/devoidc"
)

// TestLogin: pvcli login gets a token of the development issuer served
// from a directory (as pitrust dev-issuer serves it on 127.0.0.1) and saves
// it in the context in force, or prints it alone with no context or with
// --print; the token verifies against the issuer's keys with the user and
// roles asked for. Another issuer (one without the development marker) is
// refused, saying to use --token; so is a wrong secret.
func TestLogin(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	is, ln, err := devoidc.Listen(dir, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: is.Handler(), ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("dev issuer: %v", err)
		}
	})
	provider, err := oidc.NewProvider(t.Context(), is.URL)
	if err != nil {
		t.Fatal(err)
	}
	verify := func(raw, user string, roles ...string) {
		t.Helper()
		tok, err := provider.Verifier(&oidc.Config{ClientID: devoidc.Audience}).Verify(t.Context(), raw)
		if err != nil {
			t.Fatalf("the login token does not verify: %v", err)
		}
		var c struct {
			Sub   string   `json:"sub"`
			Roles []string `json:"roles"`
		}
		if err := tok.Claims(&c); err != nil || c.Sub != user || !slices.Equal(c.Roles, roles) {
			t.Errorf("claims %+v (%v), want sub %s, roles %v", c, err, user, roles)
		}
	}

	// No context: the token alone on stdout.
	cfgFile := filepath.Join(t.TempDir(), "config.yaml")
	env := map[string]string{envConfig: cfgFile}
	r := cliRun{env: env}.run(t, "login", "--dir", dir, "--user", "alice", "--roles", "vm-owner")
	if r.err != nil {
		t.Fatalf("login: %v\n%s", r.err, r.stderr)
	}
	verify(strings.TrimSuffix(r.stdout, "\n"), "alice", "vm-owner")
	if !strings.Contains(r.stderr, "not saved") || !strings.Contains(r.stderr, envToken) {
		t.Errorf("login without a context says on stderr:\n%s\nwant that the token is not saved and how to send it", r.stderr)
	}

	// A context in force: saved there, not printed.
	cliRun{env: env}.run(t, "--endpoint", "https://127.0.0.1:8443", "context", "set", "dev").mustSucceed(t)
	r = cliRun{env: env}.run(t, "login", "--dir", dir, "--user", "bob", "--roles", "admin,viewer", "--ttl", "10m")
	if r.err != nil || !strings.Contains(r.stdout, "Logged in as bob (roles admin, viewer)") || !strings.Contains(r.stdout, "context dev") {
		t.Fatalf("login with a context: %v\n%s%s", r.err, r.stdout, r.stderr)
	}
	b, err := os.ReadFile(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	var saved cliConfig
	if err := yaml.Unmarshal(b, &saved); err != nil || saved.Contexts["dev"] == nil {
		t.Fatalf("config %s: %v\n%s", cfgFile, err, b)
	}
	verify(saved.Contexts["dev"].Token, "bob", "admin", "viewer")
	r = cliRun{env: env}.run(t, "login", "--dir", dir, "--user", "carol", "--print")
	if r.err != nil || strings.Count(r.stdout, ".") != 2 || strings.Contains(r.stdout, " ") {
		t.Errorf("login --print: %v, %q, want the token alone", r.err, r.stdout)
	}

	// Not the development issuer; a wrong secret.
	other := oidctest.New(t)
	r = cliRun{env: env}.run(t, "login", "--dir", dir, "--issuer", other.URL, "--user", "alice")
	if r.err == nil || !strings.Contains(r.stderr, "not a PiVirt development OIDC issuer") || !strings.Contains(r.stderr, "--token") {
		t.Errorf("login against another issuer: %v\n%s", r.err, r.stderr)
	}
	wrong := t.TempDir()
	if err := os.WriteFile(filepath.Join(wrong, devoidc.SecretFile), []byte("nope\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = cliRun{env: env}.run(t, "login", "--dir", wrong, "--issuer", is.URL, "--user", "alice")
	if r.err == nil || !strings.Contains(r.stderr, "invalid_client") {
		t.Errorf("login with a wrong secret: %v\n%s", r.err, r.stderr)
	}
	if r := (cliRun{env: env}).run(t, "login", "--dir", dir); exitCode(r.err) != 2 {
		t.Errorf("login without --user: exit %d, want 2", exitCode(r.err))
	}
}
