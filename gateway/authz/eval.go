package authz

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// fieldPath is a dotted path of field names.
var fieldPath = regexp.MustCompile(`^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$`)

// Principal is an authenticated caller.
type Principal struct {
	// Identity is the caller's name: a token's subject (or configured
	// claim), or a client certificate's CN.
	Identity string
	Roles    []string
	// Certificate: authenticated by a client certificate, whose roles come
	// from auth.certificate_roles.
	Certificate bool
	// Expiry is when a bearer token expires (its exp claim); zero for a
	// certificate.
	Expiry time.Time
}

// Decision is what a policy says of a principal, a resource and a verb.
type Decision struct {
	// Allowed: some rule grants the verb on every object.
	Allowed bool
	// Conditional: no rule grants it on every object, but some grant it on
	// objects that pass their conditions; Object checks one.
	Conditional bool
	// conds holds, per conditional rule, its conditions with the values
	// rendered for the principal.
	conds [][]resolved
}

type resolved struct {
	field, op, value string
	// list is the value of In and NotIn, item by item.
	list []string
}

// Denied reports whether no object at all may be touched.
func (d Decision) Denied() bool { return !d.Allowed && !d.Conditional }

// Decide evaluates the policy: the rules whose roles include one of the
// principal's, whose resources include resource and whose verbs include
// verb.
func (p *Policy) Decide(who Principal, resource, verb string) (Decision, error) {
	var d Decision
	for _, r := range p.Rules {
		if !matchAny(r.Roles, who.Roles) || !match(r.Resources, resource) || !match(r.Verbs, verb) {
			continue
		}
		if len(r.Conditions) == 0 {
			return Decision{Allowed: true}, nil
		}
		var conds []resolved
		for _, c := range r.Conditions {
			rc := resolved{field: c.Field, op: c.Operator}
			var err error
			if c.Operator == OpIn || c.Operator == OpNotIn {
				rc.list, err = c.values(who)
			} else {
				rc.value, err = c.value(who)
			}
			if err != nil {
				return Decision{}, fmt.Errorf("condition on %s: %w", c.Field, err)
			}
			conds = append(conds, rc)
		}
		d.Conditional = true
		d.conds = append(d.conds, conds)
	}
	return d, nil
}

// Grants reports whether some rule allows verb on resource without
// conditions to some role (a policy that lets nobody change the config
// could never be replaced through it).
func (p *Policy) Grants(resource, verb string) bool {
	for _, r := range p.Rules {
		if len(r.Conditions) == 0 && len(r.Roles) > 0 && match(r.Resources, resource) && match(r.Verbs, verb) {
			return true
		}
	}
	return false
}

// Object reports whether the decision allows the verb on obj: always when
// Allowed; when Conditional, if every condition of some rule holds for
// obj's fields.
func (d Decision) Object(obj protoreflect.Message) bool {
	if d.Allowed {
		return true
	}
	for _, conds := range d.conds {
		if slices.IndexFunc(conds, func(c resolved) bool { return !c.holds(obj) }) < 0 {
			return true
		}
	}
	return false
}

func (c resolved) holds(obj protoreflect.Message) bool {
	got, ok := FieldString(obj, c.field)
	switch c.op {
	case OpEquals:
		return ok && got == c.value
	case OpNotEquals:
		return !ok || got != c.value
	case OpIn:
		return ok && slices.Contains(c.list, got)
	case OpNotIn:
		return !ok || !slices.Contains(c.list, got)
	}
	return false
}

func splitList(s string) []string {
	parts := strings.Split(s, ",")
	for i := range parts {
		parts[i] = strings.TrimSpace(parts[i])
	}
	return parts
}

func match(list []string, v string) bool {
	return slices.Contains(list, Wildcard) || slices.Contains(list, v)
}

// matchAny: a rule's "*" role is every authenticated principal.
func matchAny(list, vs []string) bool {
	if slices.Contains(list, Wildcard) {
		return true
	}
	return slices.ContainsFunc(vs, func(v string) bool { return slices.Contains(list, v) })
}

// FieldString returns the value of a scalar field at a dotted path of
// proto field names (metadata.owner) as a string; false when a message on
// the way is unset, or the path does not name a scalar field.
func FieldString(m protoreflect.Message, path string) (string, bool) {
	if m == nil || !m.IsValid() {
		return "", false
	}
	parts := strings.Split(path, ".")
	for i, name := range parts {
		fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
		if fd == nil || fd.IsList() || fd.IsMap() {
			return "", false
		}
		v := m.Get(fd)
		if i < len(parts)-1 {
			if fd.Message() == nil || !m.Has(fd) {
				return "", false
			}
			m = v.Message()
			continue
		}
		if fd.Message() != nil {
			return "", false
		}
		if fd.Enum() != nil {
			if ev := fd.Enum().Values().ByNumber(v.Enum()); ev != nil {
				return string(ev.Name()), true
			}
		}
		return v.String(), true
	}
	return "", false
}

type principalKey struct{}

// WithPrincipal records the authenticated caller of a request in ctx.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// PrincipalFrom returns the caller WithPrincipal recorded.
func PrincipalFrom(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok
}

// Matching lists the rules that grant verb on resource to who, each as
// "rules[N]: roles [...] resources [...] verbs [...]" with its conditions
// (rendered for who): what decides Decide's answer.
func (p *Policy) Matching(who Principal, resource, verb string) []string {
	var out []string
	for i, r := range p.Rules {
		if !matchAny(r.Roles, who.Roles) || !match(r.Resources, resource) || !match(r.Verbs, verb) {
			continue
		}
		s := fmt.Sprintf("rules[%d]: roles [%s] resources [%s] verbs [%s]", i, strings.Join(r.Roles, ", "), strings.Join(r.Resources, ", "), strings.Join(r.Verbs, ", "))
		for _, c := range r.Conditions {
			v, err := c.value(who)
			if err != nil {
				v = c.Value
			}
			s += fmt.Sprintf(" if %s %s %q", c.Field, c.Operator, v)
		}
		out = append(out, s)
	}
	return out
}
