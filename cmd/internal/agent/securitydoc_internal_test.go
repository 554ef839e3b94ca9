package agent

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/gateway"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// accessTable is docs/security.md's table of what each method needs, as rows
// "resource | verb | methods", methods sorted.
func accessTable(t *testing.T) []string {
	t.Helper()
	byGrant := map[[2]string][]string{}
	for _, sd := range apiDescriptors() {
		for i := range sd.Methods().Len() {
			md := sd.Methods().Get(i)
			rule, err := authz.MethodRule(md)
			if err != nil {
				t.Fatal(err)
			}
			if rule == nil || rule.GetSelf() {
				continue // any authenticated caller may call it: in the page's text, not the table
			}
			k := [2]string{rule.GetResource(), rule.GetVerb()}
			byGrant[k] = append(byGrant[k], fmt.Sprintf("`%s/%s`", sd.Name(), md.Name()))
		}
	}
	// The keys that decide who may do what are guarded as their own
	// resource.
	keys := make([]string, len(gateway.SecurityKeys))
	for i, k := range gateway.SecurityKeys {
		keys[i] = "`" + k + "`"
	}
	for verb, method := range map[string]string{"update": "SetConfig", "delete": "DeleteConfig"} {
		k := [2]string{RBACResource, verb}
		byGrant[k] = append(byGrant[k], fmt.Sprintf("`ClusterService/%s` of %s", method, strings.Join(keys, ", ")))
	}
	var rows []string
	for k, methods := range byGrant {
		slices.Sort(methods)
		rows = append(rows, fmt.Sprintf("| `%s` | `%s` | %s |", k[0], k[1], strings.Join(methods, ", ")))
	}
	slices.Sort(rows)
	return rows
}

// TestSecurityDocAccessTable: docs/security.md's table of the resource and
// verb each method needs is the one the protos' annotations give (run with
// PIVIRT_PRINT_ACCESS_TABLE=1 to print the table to paste).
func TestSecurityDocAccessTable(t *testing.T) {
	want := accessTable(t)
	if os.Getenv("PIVIRT_PRINT_ACCESS_TABLE") != "" {
		fmt.Println(strings.Join(want, "\n"))
	}
	f, err := os.Open("../../../docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	row := regexp.MustCompile("^\\| `[a-z]+` \\| `[a-z]+` \\| ")
	var got []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if row.MatchString(sc.Text()) {
			got = append(got, sc.Text())
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	for _, r := range want {
		if !slices.Contains(got, r) {
			t.Errorf("docs/security.md lacks the row\n%s", r)
		}
	}
	for _, r := range got {
		if !slices.Contains(want, r) {
			t.Errorf("docs/security.md has the row\n%s\nwhich the protos do not give", r)
		}
	}
}
