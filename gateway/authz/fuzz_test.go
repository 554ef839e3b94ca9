package authz

import (
	"errors"
	"os"
	"strings"
	"testing"
)

// FuzzParse feeds arbitrary policy files to Parse: it must not panic, must
// refuse with ErrInvalidPolicy, and a policy it accepts must decide every
// resource and verb for any principal without failing or panicking.
func FuzzParse(f *testing.F) {
	spec, err := os.ReadFile("testdata/spec-rbac.yaml")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(spec, "alice", "vm-owner,viewer")
	f.Add([]byte("rules:\n  - roles: [a]\n    resources: ['*']\n    verbs: ['*']\n"), "bob", "a")
	f.Add([]byte("rules:\n  - roles: [a]\n    resources: [virtualmachines]\n    verbs: [get]\n    conditions:\n      - field: metadata.owner\n        operator: In\n        value: '{{.user.roles}}'\n"), "x", "a")
	f.Add([]byte("rules: [{roles: [a], resources: [x], verbs: [get], conditions: [{field: a, operator: Equals, value: '{{.user.identity'}]}]"), "", "")
	f.Add([]byte(""), "", "")
	resources := []string{"virtualmachines", "volumes", "networks", "services", "config", "cluster", "schedules", "rbac"}
	verbs := []string{"get", "list", "create", "update", "delete", "start", "stop", "console", "watch", "x"}
	f.Fuzz(func(t *testing.T, data []byte, identity, roles string) {
		p, err := Parse(strings.NewReader(string(data)), resources)
		if err != nil {
			if !errors.Is(err, ErrInvalidPolicy) {
				t.Fatalf("Parse error %v is not an ErrInvalidPolicy", err)
			}
			return
		}
		who := Principal{Identity: identity, Roles: strings.Split(roles, ",")}
		for _, r := range append(resources, "unknown") {
			for _, v := range verbs {
				if _, err := p.Decide(who, r, v); err != nil && !strings.Contains(err.Error(), "template") {
					t.Fatalf("Decide(%s, %s): %v", r, v, err)
				}
				_ = p.Grants(r, v)
			}
		}
	})
}
