// Package docgen writes the generated references of docs/ and checks that
// the committed pages are current: the CLI reference from the cobra
// command trees of the binaries — markdown pages (docs/cli) and man pages
// (docs/man) —, the metrics reference from the registries of running
// agents (docs/metrics.md) and the API reference from the .proto files
// (docs/api.md). The tests of the packages that own what a page describes
// call Check or CheckFile, so a change that makes a page stale without
// `make docs` fails the tests (and CI). DESIGN.md says how each is made.
package docgen

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// Date is the date the man pages carry: fixed, so that the pages change
// only when the commands do. Raise it with a release.
var Date = time.Date(2026, time.December, 1, 0, 0, 0, 0, time.UTC)

// UpdateEnv names the environment variable that makes Check rewrite the
// pages instead of comparing them (make docs sets it).
const UpdateEnv = "UPDATE_DOCS"

// Pages renders root's reference: file name (relative to docs/) → content.
func Pages(root *cobra.Command) (map[string][]byte, error) {
	root.DisableAutoGenTag = true
	pages := make(map[string][]byte)
	var walk func(c *cobra.Command) error
	walk = func(c *cobra.Command) error {
		if !c.IsAvailableCommand() && c != root || c.IsAdditionalHelpTopicCommand() {
			return nil
		}
		c.DisableAutoGenTag = true
		base := strings.ReplaceAll(c.CommandPath(), " ", "_")
		var md bytes.Buffer
		if err := doc.GenMarkdownCustom(c, &md, func(name string) string { return name }); err != nil {
			return fmt.Errorf("markdown of %s: %w", c.CommandPath(), err)
		}
		pages[filepath.Join("cli", base+".md")] = md.Bytes()
		var man bytes.Buffer
		date := Date
		if err := doc.GenMan(c, &doc.GenManHeader{Section: "1", Source: "PiVirt", Manual: "PiVirt Manual", Date: &date}, &man); err != nil {
			return fmt.Errorf("man page of %s: %w", c.CommandPath(), err)
		}
		pages[filepath.Join("man", base+".1")] = man.Bytes()
		for _, sub := range c.Commands() {
			if err := walk(sub); err != nil {
				return err
			}
		}
		return nil
	}
	return pages, walk(root)
}

// Check compares root's pages with those under docsDir, or rewrites them
// (removing pages of commands that are gone) when UPDATE_DOCS is set. The
// error lists what differs and says how to refresh.
func Check(root *cobra.Command, docsDir string) error {
	pages, err := Pages(root)
	if err != nil {
		return err
	}
	prefix := strings.ReplaceAll(root.Name(), " ", "_")
	var existing []string
	for _, sub := range []string{"cli", "man"} {
		matches, _ := filepath.Glob(filepath.Join(docsDir, sub, prefix+"*"))
		for _, m := range matches {
			rel, _ := filepath.Rel(docsDir, m)
			// pvcli_* must not take pvclifoo_*: the root page or a sub page.
			name := filepath.Base(rel)
			if strings.HasPrefix(name, prefix+"_") || strings.HasPrefix(name, prefix+".") {
				existing = append(existing, rel)
			}
		}
	}
	update := os.Getenv(UpdateEnv) != ""
	var stale []string
	for name, want := range pages {
		path := filepath.Join(docsDir, name)
		got, err := os.ReadFile(path)
		if err == nil && bytes.Equal(got, want) {
			continue
		}
		if update {
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(path, want, 0o644); err != nil {
				return err
			}
			continue
		}
		stale = append(stale, name)
	}
	for _, rel := range existing {
		if _, ok := pages[rel]; ok {
			continue
		}
		if update {
			if err := os.Remove(filepath.Join(docsDir, rel)); err != nil {
				return err
			}
			continue
		}
		stale = append(stale, rel+" (no such command)")
	}
	if len(stale) > 0 {
		slices.Sort(stale)
		return fmt.Errorf("the CLI reference in %s is stale for %d pages (%s); run make docs and commit docs/",
			docsDir, len(stale), strings.Join(stale, ", "))
	}
	return nil
}
