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
		{"config-reference", ReferenceMarkdown()},
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
