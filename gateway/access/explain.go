package access

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// ErrCheck is the cause of a check the guard cannot answer: an unknown
// method, an object that does not parse.
var ErrCheck = errors.New("cannot check")

// ErrUnknownMethod is the cause of a check of a name that is no method of
// the API; it comes wrapped with ErrCheck.
var ErrUnknownMethod = errors.New("not a method of the API")

// Explanation is the guard's answer for a principal calling a method,
// without calling it.
type Explanation struct {
	Resource, Verb string
	// Decision: "allowed", "denied", "conditional" or "open".
	Decision string
	// Allowed: the call is allowed (on the object given, for a conditional
	// decision).
	Allowed bool
	// Rules are the rules of the policy that grant it.
	Rules  []string
	Detail string
}

// Explain says whether who may call procedure ("/pkg.Service/Method")
// under the policy in force — for rules with conditions, on the object
// objectJSON holds (the JSON of the resource's message: a VM, a volume) —
// and which rules decide. Nothing is called, counted or logged.
func (g *Guard) Explain(who authz.Principal, procedure, objectJSON string) (Explanation, error) {
	m := g.lookup(procedure)
	switch {
	case m.open:
		return Explanation{Decision: "open", Allowed: true, Detail: "no credentials are needed"}, nil
	case m.md == nil && !m.unschemed:
		return Explanation{}, fmt.Errorf("%w: %s is %w", ErrCheck, procedure, ErrUnknownMethod)
	case m.err != nil:
		return Explanation{Decision: "denied", Detail: fmt.Sprintf("the method has no authorization rule (%v); methods without one are denied", m.err)}, nil
	case m.rule.GetSelf():
		return Explanation{Decision: "allowed", Allowed: true, Detail: "any authenticated caller may call it: it answers only about the caller, and no RBAC rule applies"}, nil
	}
	e := Explanation{Resource: m.rule.GetResource(), Verb: m.rule.GetVerb()}
	p := g.cfg.Policy()
	if p == nil {
		e.Decision, e.Allowed, e.Detail = "allowed", true, "no RBAC policy is in force: every authenticated caller may call every method"
		return e, nil
	}
	d, err := p.Decide(who, e.Resource, e.Verb)
	if err != nil {
		return e, fmt.Errorf("%w: the policy's conditions cannot be evaluated: %w", ErrCheck, err)
	}
	e.Rules = p.Matching(who, e.Resource, e.Verb)
	// The guard denies a conditional grant it cannot check (uncheckable).
	uncheckable := (&grant{m: m, d: d}).uncheckable()
	switch {
	case d.Allowed:
		e.Decision, e.Allowed = "allowed", true
	case uncheckable != "":
		e.Decision, e.Detail = "denied", uncheckable
	case d.Conditional:
		e.Decision = "conditional"
		if objectJSON == "" {
			e.Detail = "allowed on the objects that meet the conditions of the rules above; give the object to check one"
			break
		}
		if m.object == nil {
			return e, fmt.Errorf("%w: the resource %s has no object type to read the object as", ErrCheck, e.Resource)
		}
		obj := newMessage(m.object)
		if err := (protojson.UnmarshalOptions{}).Unmarshal([]byte(objectJSON), obj.Interface()); err != nil {
			return e, fmt.Errorf("%w: the object is not the JSON of a %s: %w", ErrCheck, m.object.FullName(), err)
		}
		e.Allowed = d.Object(obj)
		if e.Allowed {
			e.Detail = "the object meets the conditions of a rule above"
		} else {
			e.Detail = "the object does not meet the conditions of any rule above"
		}
	default:
		e.Decision, e.Detail = "denied", "no rule of the RBAC policy allows it"
	}
	return e, nil
}
