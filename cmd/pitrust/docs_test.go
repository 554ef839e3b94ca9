package main

import (
	"io"
	"path/filepath"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/docgen"
)

// TestCLIReference: docs/cli and docs/man hold the reference of every
// command as the code defines it (make docs rewrites them).
func TestCLIReference(t *testing.T) {
	if err := docgen.Check(newRootCmd(io.Discard, io.Discard), filepath.Join("..", "..", "docs")); err != nil {
		t.Fatal(err)
	}
}
