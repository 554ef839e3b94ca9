package netpolicy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSpecPolicy: the reference example, verbatim.
func TestSpecPolicy(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "spec-networkpolicy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, err := Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	agent, pivirtd := []string{"agent.pivirt.internal"}, []string{"pivirtd.pivirt.internal"}
	for _, tc := range []struct {
		name     string
		from, to []string
		port     int
		want     bool
	}{
		{"agent to pivirtd on 9001", agent, pivirtd, 9001, true},
		{"agent to pivirtd on another port", agent, pivirtd, 9002, false},
		{"another service to pivirtd", []string{"iscsiman.pivirt.internal"}, pivirtd, 9001, false},
		{"agent to another service", agent, []string{"iscsiman.pivirt.internal"}, 9001, false},
		{"no identity", nil, pivirtd, 9001, false},
		{"case-insensitive names", []string{"Agent.Pivirt.Internal"}, pivirtd, 9001, true},
		{"one of several names", []string{"node1.pivirt.internal", "agent.pivirt.internal"}, pivirtd, 9001, true},
	} {
		got, by := s.Allows(tc.from, tc.to, tc.port)
		if got != tc.want || (got && by != "allow-agent-to-pivirtd") {
			t.Errorf("%s: Allows = %v (%q), want %v", tc.name, got, by, tc.want)
		}
	}
}

func TestWildcardsAndDocuments(t *testing.T) {
	s, err := Parse(strings.NewReader(`apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata: {name: agents}
spec:
  ingress:
    - from: [{service: "*.agents.pivirt.internal"}]
---
apiVersion: pivirt.pilab.hu/v1
kind: NetworkPolicy
metadata: {name: monitoring}
spec:
  ingress:
    - from: [{service: "*"}]
      ports: [{port: 8444}]
`))
	if err != nil {
		t.Fatal(err)
	}
	if ok, by := s.Allows([]string{"n1.agents.pivirt.internal"}, nil, 9000); !ok || by != "agents" {
		t.Errorf("wildcard from, any to and port: %v %q", ok, by)
	}
	if ok, _ := s.Allows([]string{"agents.pivirt.internal.evil"}, nil, 9000); ok {
		t.Error("a name that only contains the suffix matched")
	}
	if ok, by := s.Allows([]string{"anyone"}, nil, 8444); !ok || by != "monitoring" {
		t.Errorf("\"*\" on 8444: %v %q", ok, by)
	}
	if ok, _ := s.Allows([]string{"anyone"}, nil, 9000); ok {
		t.Error("\"*\" allowed a port it does not list")
	}
}

func TestParseErrors(t *testing.T) {
	for name, tc := range map[string]struct{ doc, want string }{
		"empty":       {"", "holds no policy"},
		"unknown key": {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {egress: []}\n", "field egress not found"},
		"kind":        {"apiVersion: pivirt.pilab.hu/v1\nkind: Policy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: x}]}]}\n", `a: kind: "Policy", want "NetworkPolicy"`},
		"no name":     {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nspec: {ingress: [{from: [{service: x}]}]}\n", "document 1: metadata.name: required"},
		"no from":     {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{to: [{service: x}]}]}\n", "a: spec.ingress[0].from: required"},
		"bad service": {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: 'a b'}]}]}\n", `spec.ingress[0].from[0].service: "a b" is not a service name`},
		"bad port":    {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: x}], ports: [{port: 70000}]}]}\n", "spec.ingress[0].ports[0].port: 70000: want 1 to 65535"},
		"udp":         {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: x}], ports: [{protocol: UDP, port: 53}]}]}\n", `spec.ingress[0].ports[0].protocol: "UDP": only TCP`},
		"no rules":    {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {}\n", "a: spec.ingress: no rules"},
		"same name":   {"apiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: x}]}]}\n---\napiVersion: pivirt.pilab.hu/v1\nkind: NetworkPolicy\nmetadata: {name: a}\nspec: {ingress: [{from: [{service: x}]}]}\n", `"a" is used by another policy`},
	} {
		_, err := Parse(strings.NewReader(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, tc.want)
		}
	}
}
