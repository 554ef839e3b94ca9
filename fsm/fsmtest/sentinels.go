package fsmtest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// CheckSentinels fails t unless list holds exactly the sentinel errors
// that the package in dir declares: every exported package-level variable
// named Err… whose value is errors.New("…"), matched by message. It guards
// a package's exported list (fsm.Sentinels, store.Sentinels) against a new
// sentinel that its users' translations (the gateway's error→code table)
// would not know.
func CheckSentinels(t testing.TB, dir string, list []error) {
	t.Helper()
	declared := map[string]string{} // message → name
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, path, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if !name.IsExported() || !strings.HasPrefix(name.Name, "Err") || i >= len(vs.Values) {
						continue
					}
					if msg, ok := errorsNew(vs.Values[i]); ok {
						declared[msg] = name.Name
					}
				}
			}
		}
	}
	listed := map[string]bool{}
	for _, e := range list {
		listed[e.Error()] = true
		if _, ok := declared[e.Error()]; !ok {
			t.Errorf("the list holds %q, which %s does not declare", e.Error(), dir)
		}
	}
	var missing []string
	for msg, name := range declared {
		if !listed[msg] {
			missing = append(missing, name)
		}
	}
	slices.Sort(missing)
	for _, name := range missing {
		t.Errorf("%s declares %s, which the package's sentinel list lacks: add it (and a code to the gateway's error table)", dir, name)
	}
}

// errorsNew returns the message of an errors.New("…") expression.
func errorsNew(e ast.Expr) (string, bool) {
	call, ok := e.(*ast.CallExpr)
	if !ok || len(call.Args) != 1 {
		return "", false
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != "New" {
		return "", false
	}
	if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "errors" {
		return "", false
	}
	lit, ok := call.Args[0].(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return "", false
	}
	msg, err := strconv.Unquote(lit.Value)
	return msg, err == nil
}
