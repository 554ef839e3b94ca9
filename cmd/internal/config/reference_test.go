package config

import (
	"os"
	"testing"
)

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
