package authz

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

var resources = []string{"virtualmachines", "volumes", "networks"}

func specPolicy(t *testing.T) *Policy {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p, err := Parse(f, resources)
	if err != nil {
		t.Fatalf("the spec's example policy: %v", err)
	}
	return p
}

func vmOf(owner string) *vmv1.VM {
	return &vmv1.VM{Id: "vm-1", Metadata: &apiv1.ObjectMeta{Owner: owner}}
}

// TestSpecPolicy checks every role of the spec's example policy on every
// resource and verb: allowed, denied or conditional exactly as written.
func TestSpecPolicy(t *testing.T) {
	p := specPolicy(t)
	type want int
	const (
		deny want = iota
		allow
		own // allowed on the principal's own objects only
	)
	expect := func(role, resource, verb string) want {
		switch role {
		case "admin":
			return allow
		case "operator":
			if oneOf(resource, "virtualmachines", "volumes", "networks") && oneOf(verb, "get", "list", "create", "update", "patch") {
				return allow
			}
		case "viewer":
			if oneOf(verb, "get", "list") {
				return allow
			}
		case "vm-owner":
			if resource == "virtualmachines" && oneOf(verb, "get", "list", "update", "patch", "start", "stop", "console") {
				return own
			}
		}
		return deny
	}
	for _, role := range []string{"admin", "operator", "viewer", "vm-owner", "nobody"} {
		who := Principal{Identity: "alice", Roles: []string{role}}
		for _, resource := range resources {
			for _, verb := range Verbs {
				d, err := p.Decide(who, resource, verb)
				if err != nil {
					t.Fatal(err)
				}
				mine, theirs := d.Object(vmOf("alice").ProtoReflect()), d.Object(vmOf("bob").ProtoReflect())
				var got want
				switch {
				case d.Allowed && mine && theirs:
					got = allow
				case !d.Allowed && d.Conditional && mine && !theirs:
					got = own
				case d.Denied() && !mine && !theirs:
					got = deny
				default:
					t.Fatalf("%s %s %s: inconsistent decision %+v (mine %v, theirs %v)", role, verb, resource, d, mine, theirs)
				}
				if w := expect(role, resource, verb); got != w {
					t.Errorf("%s %s %s = %v, want %v", role, verb, resource, got, w)
				}
			}
		}
	}
	// Roles add up: a vm-owner who is also a viewer may get anyone's VM.
	d, _ := p.Decide(Principal{Identity: "alice", Roles: []string{"vm-owner", "viewer"}}, "virtualmachines", "get")
	if !d.Allowed {
		t.Error("vm-owner+viewer cannot get every VM")
	}
	// No roles: nothing.
	if d, _ := p.Decide(Principal{Identity: "alice"}, "virtualmachines", "get"); !d.Denied() {
		t.Error("a principal without roles was allowed")
	}
}

func oneOf(v string, set ...string) bool {
	for _, s := range set {
		if s == v {
			return true
		}
	}
	return false
}

func TestParseRefuses(t *testing.T) {
	for name, tc := range map[string]struct {
		yaml string
		want []string
	}{
		"empty":            {"", []string{"the file is empty"}},
		"unknown key":      {"apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules: []\nextra: 1\n", []string{"field extra not found"}},
		"header and rules": {"apiVersion: v2\nkind: Rules\n", []string{`apiVersion: "v2"`, `kind: "Rules"`, "rules: none"}},
		"everything wrong in a rule": {`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: []
    resources: ["virtualmachines", "disks"]
    verbs: ["get", "reboot"]
    conditions:
      - field: "Metadata.Owner"
        operator: "Is"
        value: "{{.user.email}}"
`, []string{
			"rules[0].roles: empty",
			`rules[0].resources[1]: unknown "disks" (resources: virtualmachines, volumes, networks; or a routed gRPC service's full name, pkg.v1.Service)`,
			`rules[0].verbs[1]: unknown "reboot"`,
			`rules[0].conditions[0].field: "Metadata.Owner" is not a dotted field path`,
			`rules[0].conditions[0].operator: unknown "Is" (operators: Equals, NotEquals, In, NotIn)`,
			`rules[0].conditions[0].value: bad template "{{.user.email}}"`,
		}},
		"unparsable template": {`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["a"]
    resources: ["*"]
    verbs: ["*"]
    conditions: [{field: metadata.owner, operator: Equals, value: "{{.user.identity"}]
`, []string{"rules[0].conditions[0].value: bad template"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Parse(strings.NewReader(tc.yaml), resources)
			if !errors.Is(err, ErrInvalidPolicy) {
				t.Fatalf("Parse = %v, want ErrInvalidPolicy", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

// TestRoutedServiceRules: a rule may name a routed gRPC service by its
// full name with the verb call; a name that is no service name is still
// an unknown resource.
func TestRoutedServiceRules(t *testing.T) {
	p, err := Parse(strings.NewReader(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["dev"]
    resources: ["acme.billing.v1.Invoices"]
    verbs: ["call"]
`), resources)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		roles          []string
		resource, verb string
		want           bool
	}{
		{[]string{"dev"}, "acme.billing.v1.Invoices", VerbCall, true},
		{[]string{"dev"}, "acme.billing.v1.Other", VerbCall, false},
		{[]string{"ops"}, "acme.billing.v1.Invoices", VerbCall, false},
		{[]string{"dev"}, "virtualmachines", "get", false},
	} {
		d, err := p.Decide(Principal{Identity: "x", Roles: tc.roles}, tc.resource, tc.verb)
		if err != nil || d.Allowed != tc.want {
			t.Errorf("%v %s %s: %+v %v, want allowed %t", tc.roles, tc.resource, tc.verb, d, err, tc.want)
		}
	}
	_, err = Parse(strings.NewReader(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["dev"]
    resources: ["billing"]
    verbs: ["call"]
`), resources)
	if err == nil || !strings.Contains(err.Error(), `unknown "billing"`) {
		t.Errorf("a resource that is no service name: %v", err)
	}
}

func TestConditionOperators(t *testing.T) {
	p, err := Parse(strings.NewReader(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["team"]
    resources: ["virtualmachines"]
    verbs: ["get"]
    conditions:
      - {field: metadata.owner, operator: In, value: "{{.user.identity}}, shared"}
      - {field: power_state, operator: NotEquals, value: POWER_STATE_RUNNING}
  - roles: ["*"]
    resources: ["virtualmachines"]
    verbs: ["list"]
    conditions:
      - {field: metadata.owner, operator: NotIn, value: "root, system"}
`), resources)
	if err != nil {
		t.Fatal(err)
	}
	alice := Principal{Identity: "alice", Roles: []string{"team"}}
	d, _ := p.Decide(alice, "virtualmachines", "get")
	for _, c := range []struct {
		vm   *vmv1.VM
		want bool
	}{
		{&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "alice"}}, true},
		{&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "shared"}}, true},
		{&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "bob"}}, false},
		{&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "alice"}, PowerState: vmv1.PowerState_POWER_STATE_RUNNING}, false},
		{&vmv1.VM{}, false}, // no metadata: no owner to match
	} {
		if got := d.Object(c.vm.ProtoReflect()); got != c.want {
			t.Errorf("get %v = %v, want %v", c.vm, got, c.want)
		}
	}
	// "*" roles: every principal, even one without roles.
	d, _ = p.Decide(Principal{Identity: "carol"}, "virtualmachines", "list")
	if !d.Object((&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "carol"}}).ProtoReflect()) || d.Object((&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: "root"}}).ProtoReflect()) {
		t.Error("NotIn condition of a \"*\" rule")
	}
}

// TestListConditionsTakeTheIdentityWhole: an identity (or a role) with a
// comma is one item of an In/NotIn list, never several: a subject
// "mallory,bob" does not match bob's objects, nor escape a NotIn of
// mallory; {{.user.roles}} alone in an item stands for each role.
func TestListConditionsTakeTheIdentityWhole(t *testing.T) {
	p, err := Parse(strings.NewReader(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["team"]
    resources: ["virtualmachines"]
    verbs: ["get"]
    conditions:
      - {field: metadata.owner, operator: In, value: "{{.user.identity}}, shared"}
  - roles: ["team"]
    resources: ["virtualmachines"]
    verbs: ["update"]
    conditions:
      - {field: metadata.owner, operator: NotIn, value: "{{.user.identity}}"}
  - roles: ["team"]
    resources: ["virtualmachines"]
    verbs: ["delete"]
    conditions:
      - {field: metadata.owner, operator: In, value: "{{.user.roles}}"}
`), resources)
	if err != nil {
		t.Fatal(err)
	}
	owned := func(owner string) protoreflect.Message {
		return (&vmv1.VM{Metadata: &apiv1.ObjectMeta{Owner: owner}}).ProtoReflect()
	}
	mallory := Principal{Identity: "mallory,bob", Roles: []string{"team", "ops,admin"}}
	get, _ := p.Decide(mallory, "virtualmachines", "get")
	if get.Object(owned("bob")) || get.Object(owned("mallory")) || !get.Object(owned("mallory,bob")) || !get.Object(owned("shared")) {
		t.Error("In: the identity was split at its comma")
	}
	update, _ := p.Decide(mallory, "virtualmachines", "update")
	if !update.Object(owned("bob")) || update.Object(owned("mallory,bob")) {
		t.Error("NotIn: the identity was split at its comma")
	}
	del, _ := p.Decide(mallory, "virtualmachines", "delete")
	if !del.Object(owned("team")) || !del.Object(owned("ops,admin")) || del.Object(owned("ops")) {
		t.Error("In {{.user.roles}}: want each role whole")
	}
	// Text around {{.user.roles}} applies to the first and last roles, as
	// the commas between the roles split the value (as before).
	q, err := Parse(strings.NewReader(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["*"]
    resources: ["virtualmachines"]
    verbs: ["get"]
    conditions:
      - {field: metadata.owner, operator: In, value: "team-{{.user.roles}}"}
`), resources)
	if err != nil {
		t.Fatal(err)
	}
	d, _ := q.Decide(Principal{Identity: "x", Roles: []string{"a", "b"}}, "virtualmachines", "get")
	if !d.Object(owned("team-a")) || !d.Object(owned("b")) || d.Object(owned("team-b")) {
		t.Error("In team-{{.user.roles}}: want team-a and b")
	}
}

func TestFieldString(t *testing.T) {
	vm := &vmv1.VM{Id: "vm-1", Vcpus: 4, PowerState: vmv1.PowerState_POWER_STATE_RUNNING, Metadata: &apiv1.ObjectMeta{Owner: "alice"}}
	for path, want := range map[string]string{"metadata.owner": "alice", "id": "vm-1", "vcpus": "4", "power_state": "POWER_STATE_RUNNING"} {
		if got, ok := FieldString(vm.ProtoReflect(), path); !ok || got != want {
			t.Errorf("FieldString(%s) = %q, %v; want %q", path, got, ok, want)
		}
	}
	for _, path := range []string{"metadata", "disks", "metadata.labels", "nope", "metadata.owner.x"} {
		if got, ok := FieldString(vm.ProtoReflect(), path); ok {
			t.Errorf("FieldString(%s) = %q, want no value", path, got)
		}
	}
	if _, ok := FieldString((&vmv1.VM{}).ProtoReflect(), "metadata.owner"); ok {
		t.Error("an unset metadata has an owner")
	}
}
