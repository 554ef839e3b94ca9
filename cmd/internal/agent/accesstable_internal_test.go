package agent

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/gateway"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// accessTable is the index of docs/api.md by RBAC grant (what each method
// needs, from the protos' annotations), as rows "resource | verb |
// methods", methods sorted.
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
				continue // any authenticated caller may call it: "self" in the method tables
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
