package identity

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestLoadOrCreateNodeIDIsStable(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	first, err := LoadOrCreateNodeID(dir)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if !ValidNodeID(first) {
		t.Fatalf("created id %q is not a valid node id", first)
	}
	second, err := LoadOrCreateNodeID(dir)
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	if first != second {
		t.Fatalf("node id changed across loads: got %q, want %q", second, first)
	}
	fi, err := os.Stat(filepath.Join(dir, NodeIDFile))
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != 0o600 {
		t.Fatalf("node-id mode = %o, want 600", got)
	}
}

func TestLoadOrCreateNodeIDRejectsGarbage(t *testing.T) {
	for _, tc := range []struct{ name, content string }{
		{"empty", ""},
		{"text", "node-1"},
		{"uppercase", "ABCDEF01-2345-4678-9abc-def012345678"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, NodeIDFile)
			if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := LoadOrCreateNodeID(dir)
			if !errors.Is(err, ErrBadNodeID) {
				t.Fatalf("got %v, want ErrBadNodeID", err)
			}
			b, _ := os.ReadFile(path)
			if string(b) != tc.content {
				t.Fatalf("node-id file was modified: got %q, want %q", b, tc.content)
			}
		})
	}
}
