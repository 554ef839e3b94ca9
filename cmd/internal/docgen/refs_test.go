package docgen

import (
	"bufio"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestDocsCiteWhatExists: every path a document of the repository cites
// in backticks (`cluster/reconcile.go`, `docs/operations.md`) exists, and
// every Go-style identifier a DESIGN.md cites (`Reconcile`,
// `mesh.Proxy.Invoke`, `fsm.Tables`) is a word of the repository's source
// (one qualified by a package that is not the repository's, as
// `raft.LogCache`, is another module's and not checked).
// A renamed file or function then fails here instead of leaving a design
// note that sends its reader nowhere. Fenced code blocks are examples and
// are not checked; CHANGELOG.md is history.
func TestDocsCiteWhatExists(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	words := map[string]bool{}
	pkgDirs := map[string]bool{} // names of directories holding Go files
	var docs []string
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			if p != root && strings.HasPrefix(d.Name(), ".") || slices.Contains(skipDirs, d.Name()) {
				return filepath.SkipDir
			}
			return nil
		}
		switch ext := filepath.Ext(p); {
		case strings.HasSuffix(p, ".md"):
			if rel != "CHANGELOG.md" && !strings.HasPrefix(rel, filepath.Join("docs", "cli")+string(filepath.Separator)) {
				docs = append(docs, rel)
			}
		case slices.Contains([]string{".go", ".proto", ".ts", ".tsx", ".mjs", ".sh", ".yaml", ".yml", ".service"}, ext) || filepath.Base(p) == "Makefile":
			if ext == ".go" {
				pkgDirs[filepath.Base(filepath.Dir(p))] = true
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, w := range wordRE.FindAllString(string(b), -1) {
				words[w] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	topDirs := map[string]bool{}
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		// As the walk: not hidden, build or run-time directories, whose
		// paths exist only after a build or a make cluster.
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") && !slices.Contains(skipDirs, e.Name()) {
			topDirs[e.Name()] = true
		}
	}
	checked := 0
	for _, doc := range docs {
		design := filepath.Base(doc) == "DESIGN.md"
		for _, c := range citations(t, filepath.Join(root, doc)) {
			switch {
			case pathRE.MatchString(c.text) && topDirs[strings.SplitN(strings.TrimPrefix(c.text, "./"), "/", 2)[0]]:
				checked++
				p := strings.TrimSuffix(strings.TrimPrefix(c.text, "./"), "/")
				if _, err := os.Stat(filepath.Join(root, p)); err != nil {
					if _, err := os.Stat(filepath.Join(root, filepath.Dir(doc), p)); err != nil {
						t.Errorf("%s:%d cites `%s`, which does not exist", doc, c.line, c.text)
					}
				}
			case design && identRE.MatchString(c.text):
				checked++
				parts := strings.Split(strings.TrimSuffix(c.text, "()"), ".")
				if first := parts[0]; len(parts) > 1 && first == strings.ToLower(first) && !pkgDirs[first] {
					continue // another module's (raft.LogCache, concurrency.Election)
				}
				for _, part := range parts {
					if !words[part] && !topDirs[part] && !pkgDirs[part] {
						t.Errorf("%s:%d cites `%s`: %q is not a word of the repository's source", doc, c.line, c.text, part)
						break
					}
				}
			}
		}
	}
	if checked < 100 {
		t.Errorf("only %d citations checked in %d documents: the check does not see the documents", checked, len(docs))
	}
}

var (
	// skipDirs are not the repository's sources: dependencies and build
	// output.
	skipDirs = []string{"node_modules", "bin", "dist"}
	wordRE   = regexp.MustCompile(`[A-Za-z_][A-Za-z0-9_]*`)
	// A path of the repository: a/b, a/b.go, a/b/ (no spaces, globs or
	// placeholders).
	pathRE = regexp.MustCompile(`^(\./)?[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+/?$`)
	// A Go identifier as design notes cite them: Exported, pkg.Exported,
	// Type.Method, pkg.Type.Method, with or without "()". An unexported
	// name alone is too often an ordinary word.
	identRE = regexp.MustCompile(`^([a-z][a-z0-9]*\.)?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(\.[A-Za-z][A-Za-z0-9]*)?(\(\))?$`)
)

// citation is a backticked span of a document, outside fenced code.
type citation struct {
	text string
	line int
}

func citations(t *testing.T, file string) []citation {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []citation
	fence := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fence = !fence
			continue
		}
		if fence {
			continue
		}
		for _, m := range spanRE.FindAllStringSubmatch(line, -1) {
			out = append(out, citation{text: m[1], line: n})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

var spanRE = regexp.MustCompile("`([^`]+)`")
