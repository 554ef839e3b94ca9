package authz

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// ErrNoAnnotation: a method declares no (pivirt.api.v1.authz) option; the
// gateway denies it.
var ErrNoAnnotation = errors.New("no authorization annotation")

// MethodRule returns a method's (pivirt.api.v1.authz) annotation, checked:
// a resource, a known verb, and the request and response fields it names
// exist (id_field and object_field in the request, list_field in the
// response). A self method (any authenticated caller may call it; it
// answers only about the caller) names nothing else: no RBAC rule
// applies to it, and its resource and verb are empty.
func MethodRule(md protoreflect.MethodDescriptor) (*apiv1.Authorization, error) {
	a, ok := proto.GetExtension(md.Options(), apiv1.E_Authz).(*apiv1.Authorization)
	if ok && a != nil && a.GetSelf() {
		if a.GetResource() != "" || a.GetVerb() != "" || a.GetIdField() != "" || a.GetObjectField() != "" || a.GetListField() != "" {
			return nil, fmt.Errorf("%s: a self method names no resource, verb or field: no RBAC rule applies to it", md.FullName())
		}
		return a, nil
	}
	if !ok || a == nil || a.GetResource() == "" {
		return nil, fmt.Errorf("%s: %w", md.FullName(), ErrNoAnnotation)
	}
	if !slices.Contains(Verbs, a.GetVerb()) {
		return nil, fmt.Errorf("%s: verb %q is not one of %s", md.FullName(), a.GetVerb(), strings.Join(Verbs, ", "))
	}
	for _, f := range []struct {
		kind, path string
		msg        protoreflect.MessageDescriptor
	}{
		{"id_field", a.GetIdField(), md.Input()},
		{"object_field", a.GetObjectField(), md.Input()},
		{"list_field", a.GetListField(), md.Output()},
	} {
		if f.path != "" && !hasPath(f.msg, f.path) {
			return nil, fmt.Errorf("%s: %s %q is not a field of %s", md.FullName(), f.kind, f.path, f.msg.FullName())
		}
	}
	return a, nil
}

// hasPath reports whether a dotted path of field names exists in md.
func hasPath(md protoreflect.MessageDescriptor, path string) bool {
	parts := strings.Split(path, ".")
	for i, name := range parts {
		fd := md.Fields().ByName(protoreflect.Name(name))
		if fd == nil {
			return false
		}
		if i < len(parts)-1 {
			if fd.Message() == nil {
				return false
			}
			md = fd.Message()
		}
	}
	return true
}

// Resources lists, sorted, the resources the methods of services name: the
// resources a policy may use.
func Resources(services ...protoreflect.ServiceDescriptor) []string {
	var out []string
	for _, sd := range services {
		for i := range sd.Methods().Len() {
			if a, err := MethodRule(sd.Methods().Get(i)); err == nil && !a.GetSelf() && !slices.Contains(out, a.GetResource()) {
				out = append(out, a.GetResource())
			}
		}
	}
	slices.Sort(out)
	return out
}
