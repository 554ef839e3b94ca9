package docrun

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	md := strings.Join([]string{
		"# A page",
		"```sh",
		"pvcli version",
		"```",
		"",
		"```text",
		"pvcli <version>",
		"```",
		"<!-- not run: needs systemd -->",
		"```sh",
		"systemctl start pivirt-agent",
		"```",
		"- a list item:",
		"  <!-- exit: 1 -->",
		"  ```sh",
		"  pvcli vm get nonexistent",
		"  ```",
		"<!-- file: web.yaml -->",
		"```yaml",
		"key: value",
		"```",
		"",
		"```text",
		"not an output: after a yaml block",
		"```",
	}, "\n")
	blocks, err := Parse("page.md", md)
	if err != nil {
		t.Fatal(err)
	}
	if len(blocks) != 6 {
		t.Fatalf("%d blocks, want 6: %+v", len(blocks), blocks)
	}
	b := blocks[0]
	if b.Lang != "sh" || b.Code != "pvcli version\n" || !b.HasOutput || b.Output != "pvcli <version>\n" || b.Line != 2 {
		t.Errorf("first block %+v", b)
	}
	if b := blocks[2]; b.NotRun != "needs systemd" || b.Code != "systemctl start pivirt-agent\n" {
		t.Errorf("not run block %+v", b)
	}
	if b := blocks[3]; b.Exit != 1 || b.Code != "pvcli vm get nonexistent\n" || b.Where() != "page.md:15" {
		t.Errorf("indented exit block %+v", b)
	}
	if b := blocks[4]; b.HasOutput || b.SaveAs != "web.yaml" || b.Code != "key: value\n" {
		t.Errorf("a yaml block got an output, or lost its file name: %+v", b)
	}
}

func TestParseRefuses(t *testing.T) {
	for name, tc := range map[string]struct{ md, want string }{
		"reason missing":    {"<!-- not run: -->\n```sh\nx\n```\n", "page.md:1: <!-- not run: --> needs its reason"},
		"marker not before": {"<!-- not run: x -->\n\n```sh\nx\n```\n", "page.md:1: the marker is not on the line right before"},
		"marker at the end": {"```sh\nx\n```\n<!-- exit: 1 -->", "page.md:4: the marker is not followed by a code block"},
		"exit not a number": {"<!-- exit: one -->\n```sh\nx\n```\n", "page.md:1: <!-- exit: one -->: want an exit status"},
		"stops after what":  {"<!-- stops after: soon -->\n```sh\nx\n```\n", "page.md:1: <!-- stops after: soon -->: want a duration"},
		"file with a path":  {"<!-- file: /etc/x.yaml -->\n```yaml\nx: 1\n```\n", "page.md:1: <!-- file: /etc/x.yaml -->: want a plain file name"},
		"marker on yaml":    {"<!-- exit: 1 -->\n```yaml\nx: 1\n```\n", `page.md:1: a marker before a "yaml" block`},
		"unclosed":          {"text\n```sh\nx\n", "page.md:2: the code block does not close"},
	} {
		_, err := Parse("page.md", tc.md)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
}

func TestMatchOutput(t *testing.T) {
	got := "level=INFO msg=noise\nID        NAME   STATE\nvm-7f3a   web-1  POWER_STATE_RUNNING\nrevision 42 at 2026-12-07T03:00:00Z\n"
	for _, tc := range []struct {
		want string
		ok   bool
	}{
		{"ID NAME STATE\n<ID> web-1 POWER_STATE_RUNNING\n", true},
		{"ID NAME STATE\n...\nrevision <n> at <time>\n", true},
		{"revision … at …\n", true},
		{"web-1\n", false},                                // a whole line, not a part of one
		{"revision 42 at <time>\nID NAME STATE\n", false}, // order
		{"ID NAME STATE\n<ID> web-2 POWER_STATE_RUNNING\n", false},
	} {
		err := MatchOutput(tc.want, got)
		if (err == nil) != tc.ok {
			t.Errorf("MatchOutput(%q) = %v, want ok %v", tc.want, err, tc.ok)
		}
	}
}

// TestDocsBlocksAreWellFormed: every document the runner reads parses:
// markers in place, with their reasons, and every fence closed.
func TestDocsBlocksAreWellFormed(t *testing.T) {
	pages, err := Pages(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if len(pages) < 2 {
		t.Fatalf("only %d documents found: %v", len(pages), pages)
	}
	run, skipped := 0, 0
	for _, p := range pages {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		blocks, err := Parse(p, string(b))
		if err != nil {
			t.Error(err)
			continue
		}
		for _, bl := range blocks {
			switch {
			case bl.Lang == "bash" || bl.Lang == "shell" || bl.Lang == "console":
				t.Errorf("%s: a %q block: shell examples are sh blocks (the runner runs those)", bl.Where(), bl.Lang)
			case bl.Lang != "sh":
			case bl.NotRun != "":
				skipped++
			default:
				run++
			}
		}
	}
	t.Logf("%d documents: %d sh blocks to run, %d not run", len(pages), run, skipped)
}
