package docgen

import (
	"bytes"
	"fmt"
	"os"
	"strings"
)

// CheckFile compares a generated page with the file at path, or writes it
// when UPDATE_DOCS is set (make docs). The error names the first line that
// differs and says how to refresh.
func CheckFile(path string, want []byte) error {
	got, err := os.ReadFile(path)
	if err == nil && bytes.Equal(got, want) {
		return nil
	}
	if os.Getenv(UpdateEnv) != "" {
		return os.WriteFile(path, want, 0o644)
	}
	if err != nil {
		return fmt.Errorf("%w; run make docs and commit docs/", err)
	}
	n, gotLine, wantLine := firstDifference(string(got), string(want))
	return fmt.Errorf("%s is stale: line %d is %q, the code gives %q; run make docs and commit docs/", path, n, gotLine, wantLine)
}

// firstDifference is the first line (1-based) where got and want differ,
// and that line of each ("" past the end).
func firstDifference(got, want string) (int, string, string) {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; ; i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl || i >= len(g) || i >= len(w) {
			return i + 1, gl, wl
		}
	}
}

// mdText escapes what markdown would take for markup in text copied from
// the code (help strings, .proto comments): emphasis, HTML tags
// ("<duration>" would vanish), and the cell separator of tables.
func mdText(s string) string {
	return strings.NewReplacer(`\`, `\\`, `*`, `\*`, `<`, `&lt;`, `>`, `&gt;`, `|`, `\|`).Replace(s)
}
