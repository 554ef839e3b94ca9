package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/docgen"
)

// TestCLIReference: docs/cli and docs/man hold the reference of every
// command as the code defines it (make docs rewrites them).
func TestCLIReference(t *testing.T) {
	if err := docgen.Check((&app{getenv: func(string) string { return "" }, stdout: io.Discard, stderr: io.Discard}).newRootCmd(), filepath.Join("..", "..", "docs")); err != nil {
		t.Fatal(err)
	}
}

// TestDocumentedCommandsParse: every pvcli command line of README.md and
// docs/ (in sh blocks, continuation lines joined, comments cut) names a
// command that exists, with flags it takes and the arguments it wants.
var shellVar = regexp.MustCompile(`^\$\{?[A-Za-z_][A-Za-z0-9_]*\}?$`)

func TestDocumentedCommandsParse(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join("..", "..", "docs", "*.md"))
	files = append(files, filepath.Join("..", "..", "README.md"))
	checked := 0
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range shellLines(string(b)) {
			for _, part := range splitCommands(line) {
				args := dropRedirects(splitShell(strings.TrimSpace(part)))
				if len(args) < 2 || args[0] != "pvcli" {
					continue
				}
				// A shell variable the page set (an ID, an index) stands
				// for a value: any word, and a number where one is wanted.
				for i, a := range args {
					if shellVar.MatchString(a) {
						args[i] = "1"
					}
				}
				checked++
				root := (&app{getenv: func(string) string { return "" }, stdout: io.Discard, stderr: io.Discard}).newRootCmd()
				cmd, rest, err := root.Find(args[1:])
				if err == nil {
					err = cmd.ParseFlags(rest)
				}
				if err == nil && cmd.Args != nil && !cmd.Flags().Changed("help") {
					err = cmd.Args(cmd, cmd.Flags().Args())
				}
				if err == nil && !cmd.Runnable() {
					err = fmt.Errorf("%s is a group, not a command", cmd.CommandPath())
				}
				if err != nil {
					t.Errorf("%s: %s: %v", filepath.Base(file), strings.Join(args, " "), err)
				}
			}
		}
	}
	if checked < 50 {
		t.Errorf("only %d pvcli command lines found in the documents", checked)
	}
}

// shellLines are the lines of the sh code blocks of a markdown document,
// continuation lines joined and comments cut.
func shellLines(doc string) []string {
	var out []string
	in := false
	cur := ""
	for _, l := range strings.Split(doc, "\n") {
		trimmed := strings.TrimSpace(l)
		if strings.HasPrefix(trimmed, "```") {
			in = trimmed == "```sh" || trimmed == "```bash"
			continue
		}
		if !in {
			continue
		}
		if i := strings.Index(l, " #"); i >= 0 {
			l = l[:i]
		}
		l = strings.TrimSpace(l)
		if strings.HasSuffix(l, "\\") {
			cur += strings.TrimSuffix(l, "\\") + " "
			continue
		}
		out = append(out, cur+l)
		cur = ""
	}
	return out
}

// splitShell splits a command line into words, keeping quoted strings
// ('…' and "…") whole.
func splitShell(s string) []string {
	var words []string
	var cur strings.Builder
	quote := rune(0)
	inWord := false
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words
}

// dropRedirects removes the shell's redirections (> file, 2>&1, <file)
// from a command's words; a <placeholder> stays.
func dropRedirects(words []string) []string {
	var out []string
	for i := 0; i < len(words); i++ {
		w := strings.TrimLeft(words[i], "0123456789")
		switch {
		case w == ">" || w == ">>" || w == "<":
			i++ // and its file
		case strings.HasPrefix(w, ">") || strings.HasPrefix(w, "<") && !strings.HasSuffix(w, ">"): // not a <placeholder>
		default:
			out = append(out, words[i])
		}
	}
	return out
}

// splitCommands cuts a shell line at the unquoted ;, | and & that separate
// its commands (pipelines, lists).
func splitCommands(line string) []string {
	var out []string
	var cur strings.Builder
	quote := rune(0)
	for _, r := range line {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote = r
			cur.WriteRune(r)
		case r == ';' || r == '|' || r == '&':
			out = append(out, cur.String())
			cur.Reset()
		default:
			cur.WriteRune(r)
		}
	}
	return append(out, cur.String())
}
