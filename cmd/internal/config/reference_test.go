package config

import (
	"os"
	"strings"
	"testing"
)

// TestReadmeReference: the README's configuration reference and its table
// of cluster settings are generated from the Config type, Default() and
// Settings (UPDATE_README=1 go test ./cmd/internal/config -run
// TestReadmeReference writes them).
func TestReadmeReference(t *testing.T) {
	const path = "../../../README.md"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	for _, block := range []struct{ name, want string }{
		{"cluster-settings", SettingsMarkdown()},
	} {
		begin, end := "<!-- "+block.name+":begin -->\n", "<!-- "+block.name+":end -->"
		i, j := strings.Index(readme, begin), strings.Index(readme, end)
		if i < 0 || j < i {
			t.Fatalf("README.md has no %q ... %q block", begin, end)
		}
		got := readme[i+len(begin) : j]
		if got == block.want {
			continue
		}
		if os.Getenv("UPDATE_README") != "" {
			readme = readme[:i+len(begin)] + block.want + readme[j:]
			continue
		}
		t.Errorf("README.md's %s block is stale; run UPDATE_README=1 go test ./cmd/internal/config -run TestReadmeReference. Want:\n%s", block.name, block.want)
	}
	if os.Getenv("UPDATE_README") != "" {
		if err := os.WriteFile(path, []byte(readme), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDocsConfigurationReference: docs/configuration.md is the reference
// of every key as the code defines it (make docs rewrites it).
func TestDocsConfigurationReference(t *testing.T) {
	const path = "../../../docs/configuration.md"
	want := ConfigurationDoc()
	got, err := os.ReadFile(path)
	if err == nil && string(got) == want {
		return
	}
	if os.Getenv("UPDATE_DOCS") != "" {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s is stale (%v); run make docs and commit docs/", path, err)
}
