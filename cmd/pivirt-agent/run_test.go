package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRecoverCommandRefuses checks the recover subcommand's input errors:
// each names what is wrong and touches nothing.
func TestRecoverCommandRefuses(t *testing.T) {
	dir := t.TempDir()
	peers := filepath.Join(dir, "peers.json")
	if err := os.WriteFile(peers, []byte(`[{"id":"n1","address":"127.0.0.1:8300"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"recover"}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty, "--peers", filepath.Join(dir, "missing.json")}, "peers file"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers}, "no node-id here"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers, "extra"}, "unknown command"},
	} {
		var out, errOut bytes.Buffer
		err := Run(context.Background(), tt.args, &out, &errOut)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("pivirt-agent %s = %v, want an error containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Errorf("a refused recover wrote into the data dir: %v", entries)
	}
}
