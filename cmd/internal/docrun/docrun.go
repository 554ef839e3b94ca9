// Package docrun reads the shell examples of the repository's documents
// (README.md and docs/) so that they can be run against a real cluster:
// every ```sh block is a step, the ```text block right after it (blank
// lines between allowed) is the output it shows, and an HTML comment on
// the line before a block's fence says how to run it:
//
//	<!-- not run: the reason -->   the block is not run; the reason is required
//	<!-- exit: 1 -->               the block is run and must exit with that status
//	<!-- stops after: 3s -->       the block runs until interrupted (a watch): it
//	                               gets SIGINT after that long and must still be running
//	<!-- file: NAME -->            before any block: its text is written to NAME in the
//	                               directory the blocks run in (a file the reader saves)
//
// The runner itself is TestDocsRun (run_test.go, `make docs-run`); the
// rules a page must follow are checked by TestDocsBlocksAreWellFormed on
// every `make test`. See the DESIGN.md beside this file.
package docrun

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Block is one fenced code block of a document.
type Block struct {
	File string // the document, as given to Parse
	Line int    // 1-based line of the opening fence
	Lang string // the fence's info string, first word ("sh", "yaml", "text", "")
	Code string // the block's lines, the fence's indentation removed

	// NotRun is the reason of a <!-- not run: ... --> marker ("" when
	// the block is to be run).
	NotRun string
	// Exit is the exit status a <!-- exit: N --> marker asks for (0
	// without one).
	Exit int
	// StopsAfter is how long a block that streams until interrupted runs
	// before it gets SIGINT (<!-- stops after: D -->; 0: it must end by
	// itself).
	StopsAfter time.Duration
	// SaveAs is the file name of a <!-- file: NAME --> marker: the
	// block's text is that file.
	SaveAs string
	// Output is the ```text block that follows a sh block, when one does
	// (HasOutput).
	Output    string
	HasOutput bool
}

// Where names the block for messages: file:line.
func (b Block) Where() string { return fmt.Sprintf("%s:%d", b.File, b.Line) }

var (
	fenceRE  = regexp.MustCompile("^([ \t]*)(```+|~~~+)[ \t]*([^ \t`]*)")
	markerRE = regexp.MustCompile(`^[ \t]*<!--[ \t]*(not run|exit|stops after|file)[ \t]*:?(.*?)-->[ \t]*$`)
)

// Parse returns the fenced blocks of a markdown document in order, with
// their markers and, for sh blocks, the output block after them. A marker
// that is not on the line right before a fence, a "not run" without its
// reason, an exit status that is not a number, or a fence that does not
// close is an error naming its line.
func Parse(file, md string) ([]Block, error) {
	lines := strings.Split(md, "\n")
	var blocks []Block
	type pending struct {
		line int
		kind string // not run, exit, stops after, file
		arg  string
	}
	var marker *pending
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		if m := markerRE.FindStringSubmatch(line); m != nil {
			if marker != nil {
				return nil, fmt.Errorf("%s:%d: a second marker before the block of the one on line %d", file, i+1, marker.line)
			}
			marker = &pending{line: i + 1, kind: m[1], arg: strings.TrimSpace(m[2])}
			if marker.kind == "not run" && marker.arg == "" {
				return nil, fmt.Errorf("%s:%d: <!-- not run: --> needs its reason (<!-- not run: needs systemd -->)", file, i+1)
			}
			continue
		}
		m := fenceRE.FindStringSubmatch(line)
		if m == nil {
			if marker != nil {
				return nil, fmt.Errorf("%s:%d: the marker is not on the line right before a code block's fence", file, marker.line)
			}
			continue
		}
		indent, fence, lang := m[1], m[2], m[3]
		b := Block{File: file, Line: i + 1, Lang: lang}
		var code []string
		closed := false
		for i++; i < len(lines); i++ {
			l := lines[i]
			if t := strings.TrimLeft(l, " \t"); strings.HasPrefix(t, fence) && strings.TrimSpace(strings.TrimLeft(t, fence[:1])) == "" {
				closed = true
				break
			}
			code = append(code, strings.TrimPrefix(l, indent))
		}
		if !closed {
			return nil, fmt.Errorf("%s:%d: the code block does not close", file, b.Line)
		}
		b.Code = strings.Join(code, "\n")
		if len(code) > 0 {
			b.Code += "\n"
		}
		if marker != nil {
			if err := b.apply(marker.kind, marker.arg); err != nil {
				return nil, fmt.Errorf("%s:%d: %w", file, marker.line, err)
			}
			marker = nil
		}
		blocks = append(blocks, b)
	}
	if marker != nil {
		return nil, fmt.Errorf("%s:%d: the marker is not followed by a code block", file, marker.line)
	}
	// A text block right after a sh block (nothing but blank lines
	// between) is the output the sh block shows.
	for k := 0; k+1 < len(blocks); k++ {
		if blocks[k].Lang != "sh" || blocks[k+1].Lang != "text" {
			continue
		}
		end := blocks[k].Line + strings.Count(blocks[k].Code, "\n") + 1 // the closing fence
		between := lines[end : blocks[k+1].Line-1]
		if strings.TrimSpace(strings.Join(between, "")) == "" {
			blocks[k].Output, blocks[k].HasOutput = blocks[k+1].Code, true
		}
	}
	return blocks, nil
}

// apply sets what a marker says of the block.
func (b *Block) apply(kind, arg string) error {
	if kind != "file" && b.Lang != "sh" {
		return fmt.Errorf("a marker before a %q block: only sh blocks are run", b.Lang)
	}
	switch kind {
	case "not run":
		b.NotRun = arg
	case "exit":
		n, err := strconv.Atoi(arg)
		if err != nil || n < 0 || n > 255 {
			return fmt.Errorf("<!-- exit: %s -->: want an exit status, 0 to 255", arg)
		}
		b.Exit = n
	case "stops after":
		d, err := time.ParseDuration(arg)
		if err != nil || d <= 0 || d > time.Minute {
			return fmt.Errorf("<!-- stops after: %s -->: want a duration up to 1m, such as 3s", arg)
		}
		b.StopsAfter = d
	case "file":
		if arg == "" || strings.Contains(arg, "/") || strings.HasPrefix(arg, ".") {
			return fmt.Errorf("<!-- file: %s -->: want a plain file name, such as web.yaml", arg)
		}
		b.SaveAs = arg
	}
	return nil
}

// placeholderRE is what stands for a value that differs from run to run
// in a shown output: <anything> and ... (or …).
var placeholderRE = regexp.MustCompile(`<[^<>]+>|\.\.\.|…`)

// lineMatcher turns a shown output line into a pattern: whitespace runs
// match any whitespace run, placeholders any text.
func lineMatcher(want string) *regexp.Regexp {
	var b strings.Builder
	b.WriteString("^")
	rest := strings.Join(strings.Fields(want), " ")
	for rest != "" {
		loc := placeholderRE.FindStringIndex(rest)
		lit := rest
		if loc != nil {
			lit = rest[:loc[0]]
		}
		for k, part := range strings.Split(lit, " ") {
			if k > 0 {
				b.WriteString(`\s+`)
			}
			b.WriteString(regexp.QuoteMeta(part))
		}
		if loc == nil {
			break
		}
		b.WriteString(`.*?`)
		rest = rest[loc[1]:]
	}
	b.WriteString(`\s*$`)
	return regexp.MustCompile(b.String())
}

// MatchOutput checks that got holds the lines of want, in order (other
// lines may come between them: log lines, progress). In want, a line that
// is only "..." stands for any lines, and <placeholders> and "..." within a
// line for any text. The error names the first line not found.
func MatchOutput(want, got string) error {
	gotLines := strings.Split(strings.TrimRight(got, "\n"), "\n")
	next := 0
	for _, w := range strings.Split(strings.TrimRight(want, "\n"), "\n") {
		t := strings.TrimSpace(w)
		if t == "" || t == "..." || t == "…" {
			continue
		}
		re := lineMatcher(t)
		found := false
		for ; next < len(gotLines); next++ {
			if re.MatchString(strings.TrimSpace(gotLines[next])) {
				found, next = true, next+1
				break
			}
		}
		if !found {
			return fmt.Errorf("the output lacks the line %q (after the lines before it in the document)", t)
		}
	}
	return nil
}

// Pages lists the documents whose blocks are run, relative to the
// repository root: README.md, docs/getting-started.md, then every other
// markdown file under docs/ in name order.
func Pages(root string) ([]string, error) {
	pages := []string{filepath.Join(root, "README.md")}
	first := filepath.Join(root, "docs", "getting-started.md")
	var rest []string
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") && p != first {
			rest = append(rest, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(first); err == nil {
		pages = append(pages, first)
	}
	slices.Sort(rest)
	return append(pages, rest...), nil
}
