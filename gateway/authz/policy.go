// Package authz is the gateway's role-based access control: the policy
// file (rbac.yaml; the reference policy is testdata/spec-rbac.yaml), checked
// before use, and the decision for a principal, a resource and a verb,
// with conditions on the target object's fields.
package authz

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"text/template"

	"gopkg.in/yaml.v3"
)

// The policy file's header.
const (
	APIVersion = "rbac.pivirt.pilab.hu/v1"
	Kind       = "Policy"
)

// Wildcard matches every role, resource or verb.
const Wildcard = "*"

// Verbs are the verbs of the API's method annotations; a rule may name
// them, VerbCall and Wildcard.
var Verbs = []string{"get", "list", "create", "update", "patch", "delete", "start", "stop", "console", "monitor", "debug"}

// VerbCall is the verb of every method of a routed service the agent has
// no schema of; the resource is the service's full name
// (pkg.v1.Service), which a rule names as it names a resource.
const VerbCall = "call"

// serviceName is a gRPC service's full name: a package and a name.
var serviceName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$`)

// IsServiceName reports whether s is a gRPC service's full name
// (pkg.v1.Service), which a rule may name as a resource.
func IsServiceName(s string) bool { return serviceName.MatchString(s) }

// Operators of conditions.
const (
	OpEquals    = "Equals"
	OpNotEquals = "NotEquals"
	OpIn        = "In"
	OpNotIn     = "NotIn"
)

// Operators lists the condition operators.
var Operators = []string{OpEquals, OpNotEquals, OpIn, OpNotIn}

// ErrInvalidPolicy wraps every problem of a policy file.
var ErrInvalidPolicy = errors.New("invalid RBAC policy")

// Policy is a parsed and validated rbac.yaml.
type Policy struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Rules      []Rule `yaml:"rules"`
}

// Rule grants verbs on resources to roles, on the objects its conditions
// accept (all of them; none: every object).
type Rule struct {
	Roles      []string    `yaml:"roles"`
	Resources  []string    `yaml:"resources"`
	Verbs      []string    `yaml:"verbs"`
	Conditions []Condition `yaml:"conditions"`
}

// Condition compares a field of the target object (a dotted path such as
// metadata.owner) with a value, which may use the template {{.user.identity}}
// (and {{.user.roles}}). In and NotIn take a comma-separated list.
type Condition struct {
	Field    string `yaml:"field"`
	Operator string `yaml:"operator"`
	Value    string `yaml:"value"`

	tmpl *template.Template
}

// Parse reads a policy and checks it against the resources the API knows
// (from the methods' authorization options); every problem is reported,
// each naming its place (rules[2].verbs[1]).
func Parse(r io.Reader, resources []string) (*Policy, error) {
	dec := yaml.NewDecoder(r)
	dec.KnownFields(true)
	var p Policy
	if err := dec.Decode(&p); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: the file is empty", ErrInvalidPolicy)
		}
		return nil, fmt.Errorf("%w: %v", ErrInvalidPolicy, err)
	}
	if err := p.validate(resources); err != nil {
		return nil, err
	}
	return &p, nil
}

func (p *Policy) validate(resources []string) error {
	var errs []error
	add := func(path, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: %s: %s", ErrInvalidPolicy, path, fmt.Sprintf(format, args...)))
	}
	if p.APIVersion != APIVersion {
		add("apiVersion", "%q, want %q", p.APIVersion, APIVersion)
	}
	if p.Kind != Kind {
		add("kind", "%q, want %q", p.Kind, Kind)
	}
	if len(p.Rules) == 0 {
		add("rules", "none: a policy without rules denies everything")
	}
	list := func(path string, vals, allowed []string, also func(string) bool, alsoHint string) {
		if len(vals) == 0 {
			add(path, "empty (use %q for all)", Wildcard)
		}
		for i, v := range vals {
			switch {
			case v == Wildcard:
			case strings.TrimSpace(v) == "":
				add(fmt.Sprintf("%s[%d]", path, i), "empty")
			case allowed != nil && !slices.Contains(allowed, v) && (also == nil || !also(v)):
				add(fmt.Sprintf("%s[%d]", path, i), "unknown %q (%s: %s%s)", v, path[strings.LastIndex(path, ".")+1:], strings.Join(allowed, ", "), alsoHint)
			}
		}
	}
	for i := range p.Rules {
		r := &p.Rules[i]
		at := fmt.Sprintf("rules[%d]", i)
		list(at+".roles", r.Roles, nil, nil, "")
		list(at+".resources", r.Resources, resources, IsServiceName, "; or a routed gRPC service's full name, pkg.v1.Service")
		list(at+".verbs", r.Verbs, Verbs, func(v string) bool { return v == VerbCall }, "; "+VerbCall+" for the methods of a routed gRPC service")
		for j := range r.Conditions {
			c := &r.Conditions[j]
			cat := fmt.Sprintf("%s.conditions[%d]", at, j)
			if !fieldPath.MatchString(c.Field) {
				add(cat+".field", "%q is not a dotted field path such as metadata.owner", c.Field)
			}
			if !slices.Contains(Operators, c.Operator) {
				add(cat+".operator", "unknown %q (operators: %s)", c.Operator, strings.Join(Operators, ", "))
			}
			t, err := template.New(cat).Option("missingkey=error").Parse(c.Value)
			if err == nil {
				// Executed once with a sample principal: a template naming
				// anything but .user.identity and .user.roles fails here.
				err = t.Execute(io.Discard, templateData(Principal{Identity: "sample", Roles: []string{"sample"}}))
			}
			if err != nil {
				add(cat+".value", "bad template %q: %v", c.Value, err)
				continue
			}
			c.tmpl = t
		}
	}
	return errors.Join(errs...)
}

// templateData is what a condition's value template sees.
func templateData(p Principal) map[string]any {
	return map[string]any{"user": map[string]any{"identity": p.Identity, "roles": strings.Join(p.Roles, ",")}}
}

// value renders the condition's value for p.
func (c *Condition) value(p Principal) (string, error) {
	return render(c.tmpl, p)
}

func render(t *template.Template, p Principal) (string, error) {
	var b bytes.Buffer
	if err := t.Execute(&b, templateData(p)); err != nil {
		return "", err
	}
	return b.String(), nil
}

// values renders the list of an In or NotIn condition for p: the value is
// rendered with a placeholder for each principal value (the identity, each
// role), split at its commas, and the placeholders replaced afterwards. So
// a comma inside the identity or a role never makes two items — a subject
// "mallory,bob" is never the item "bob" — while the commas of the value,
// including those {{.user.roles}} puts between roles, split it as before.
func (c *Condition) values(p Principal) ([]string, error) {
	ph := Principal{Identity: placeholder(0)}
	for i := range p.Roles {
		ph.Roles = append(ph.Roles, placeholder(i+1))
	}
	rendered, err := render(c.tmpl, ph)
	if err != nil {
		return nil, err
	}
	pairs := []string{placeholder(0), p.Identity}
	for i, r := range p.Roles {
		pairs = append(pairs, placeholder(i+1), r)
	}
	sub := strings.NewReplacer(pairs...)
	items := splitList(rendered)
	for i := range items {
		items[i] = sub.Replace(items[i])
	}
	return items, nil
}

// placeholderMark makes the placeholders of values: NUL and a per-process
// random tag, which no rendered value template holds on its own.
var placeholderMark = fmt.Sprintf("\x00%016x", rand.Uint64())

func placeholder(i int) string { return fmt.Sprintf("%s:%d\x00", placeholderMark, i) }
