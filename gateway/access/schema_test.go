package access

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/mesh"
	"pilab.hu/pivirt-agent/gateway/mesh/schematest"
)

// loadWidgets is the widget service's schema as a routing rule's
// descriptor set gives it (mesh.LoadSchema).
func loadWidgets(t *testing.T) *mesh.Schema {
	t.Helper()
	s, err := mesh.LoadSchema(schematest.WriteSet(t), "/"+schematest.Service)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// widgetGuard is a guard whose Config.Schema is the schema *schema holds
// (nil: none, as without a descriptor set).
func widgetGuard(t *testing.T, schema *atomic.Pointer[mesh.Schema]) *Guard {
	t.Helper()
	p, err := authz.Parse(strings.NewReader(schematest.Policy), []string{"widgets"})
	if err != nil {
		t.Fatal(err)
	}
	g, err := New(Config{
		Authenticator: &authn.Authenticator{CertRoles: map[string][]string{
			"alice": {"widget-owner"}, "root": {"admin"}, "pinger": {"pinger"}, "reader": {"widget-reader"},
		}},
		Policy: func() *authz.Policy { return p },
		Routed: func(m string) bool { return strings.HasPrefix(m, "/"+schematest.Service+"/") },
		Schema: func(m string) protoreflect.MethodDescriptor {
			if s := schema.Load(); s != nil {
				return s.Method(m)
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// widget is a dynamic widget of the schema's type.
func widget(md protoreflect.MessageDescriptor, id, owner string) *dynamicpb.Message {
	w := dynamicpb.NewMessage(md)
	w.Set(md.Fields().ByName("id"), protoreflect.ValueOfString(id))
	if owner != "" {
		meta := w.Mutable(md.Fields().ByName("metadata")).Message()
		meta.Set(meta.Descriptor().Fields().ByName("owner"), protoreflect.ValueOfString(owner))
	}
	return w
}

// TestDescriptorSetAnnotationIsParsed: a descriptor set's
// (pivirt.api.v1.authz) options are read as the extension the program
// links, not left as unknown fields.
func TestDescriptorSetAnnotationIsParsed(t *testing.T) {
	s := loadWidgets(t)
	md := s.Method("/" + schematest.Service + "/GetWidget")
	if md == nil {
		t.Fatal("no GetWidget in the schema")
	}
	r, err := authz.MethodRule(md)
	if err != nil || r.GetResource() != schematest.Resource || r.GetVerb() != "get" || r.GetIdField() != "id" {
		t.Fatalf("GetWidget's annotation: %v %v", r, err)
	}
	if _, err := authz.MethodRule(s.Method("/" + schematest.Service + "/Ping")); err == nil {
		t.Error("Ping has an annotation")
	}
}

// TestDescriptorSetAccess: a routed service whose descriptor set carries
// the annotation is decided by it — resource and verb, conditions on the
// object read with its get method, on the object a create carries and on
// an update's result, filtered lists — while its unannotated method, and
// every method without the descriptor set, stay the service's resource
// with the verb call. A self annotation is not taken from a descriptor
// set. A new descriptor set (a reload) is read again.
func TestDescriptorSetAccess(t *testing.T) {
	var schema atomic.Pointer[mesh.Schema]
	schema.Store(loadWidgets(t))
	g := widgetGuard(t, &schema)
	svc := "/" + schematest.Service + "/"
	objType := schema.Load().Method(svc + "GetWidget").Output().Fields().ByName("widget").Message()
	var asked []string
	g.cfg.Fetch = func(_ context.Context, get protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error) {
		m := req.ProtoReflect()
		id := m.Get(m.Descriptor().Fields().ByName("id")).String()
		asked = append(asked, string(get.FullName())+" "+id)
		owner, ok := map[string]string{"a1": "alice", "b1": "bob"}[id]
		if !ok {
			return nil, status.Error(codes.NotFound, "not found")
		}
		resp := dynamicpb.NewMessage(get.Output())
		resp.Set(get.Output().Fields().ByName("widget"), protoreflect.ValueOfMessage(widget(objType, id, owner)))
		return resp, nil
	}
	ctx := context.Background()

	for _, tc := range []struct {
		name, method, who string
		want              codes.Code
	}{
		{"a conditional get: decided on the object", "GetWidget", "alice", codes.OK},
		{"a get of a role with no condition", "GetWidget", "reader", codes.OK},
		{"a verb the role lacks", "ListWidgets", "reader", codes.PermissionDenied},
		{"the service's call rule does not name widgets", "GetWidget", "pinger", codes.PermissionDenied},
		{"admin", "UpdateWidget", "root", codes.OK},
		{"the unannotated method: the service with verb call", "Ping", "pinger", codes.OK},
		{"the unannotated method, no rule on the service", "Ping", "alice", codes.PermissionDenied},
		{"a self annotation of a descriptor set", "WhoAmI", "root", codes.PermissionDenied},
	} {
		_, gr, err := g.admit(ctx, certCall(svc+tc.method, tc.who), nil)
		if code(err) != tc.want {
			t.Errorf("%s (%s by %s): %v, want %s", tc.name, tc.method, tc.who, err, tc.want)
		}
		if err == nil && tc.method == "GetWidget" && tc.who == "alice" && !gr.checksRequest() {
			t.Errorf("%s: the grant does not check the request", tc.name)
		}
	}
	if _, _, err := g.admit(ctx, certCall(svc+"GetWidget", "reader"), nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := g.admit(ctx, certCall(svc+"ListWidgets", "reader"), nil); err == nil || !strings.Contains(err.Error(), "may not list widgets") {
		t.Errorf("the denial names the annotation's resource and verb: %v", err)
	}

	// Conditions, checked on dynamic messages of the schema.
	req := func(method string, set func(m protoreflect.Message)) protoreflect.Message {
		m := dynamicpb.NewMessage(schema.Load().Method(svc + method).Input())
		set(m)
		return m
	}
	field := func(m protoreflect.Message, name string) protoreflect.FieldDescriptor {
		return m.Descriptor().Fields().ByName(protoreflect.Name(name))
	}
	get := func(id string) protoreflect.Message {
		return req("GetWidget", func(m protoreflect.Message) { m.Set(field(m, "id"), protoreflect.ValueOfString(id)) })
	}
	withWidget := func(method, id, owner string, mask ...string) protoreflect.Message {
		return req(method, func(m protoreflect.Message) {
			m.Set(field(m, "widget"), protoreflect.ValueOfMessage(widget(objType, id, owner)))
			if len(mask) > 0 {
				paths := m.Mutable(field(m, "update_mask")).Message()
				l := paths.Mutable(field(paths, "paths")).List()
				for _, p := range mask {
					l.Append(protoreflect.ValueOfString(p))
				}
			}
		})
	}
	for _, tc := range []struct {
		name, method string
		req          protoreflect.Message
		want         codes.Code
	}{
		{"her widget", "GetWidget", get("a1"), codes.OK},
		{"bob's widget", "GetWidget", get("b1"), codes.PermissionDenied},
		{"a missing widget", "GetWidget", get("gone"), codes.PermissionDenied},
		{"no ID", "GetWidget", get(""), codes.InvalidArgument},
		{"a create of hers", "CreateWidget", withWidget("CreateWidget", "n1", "alice"), codes.OK},
		{"a create for bob", "CreateWidget", withWidget("CreateWidget", "n2", "bob"), codes.PermissionDenied},
		{"an update of hers", "UpdateWidget", withWidget("UpdateWidget", "a1", ""), codes.OK},
		{"an update of bob's", "UpdateWidget", withWidget("UpdateWidget", "b1", "alice"), codes.PermissionDenied},
		{"an update handing hers to bob", "UpdateWidget", withWidget("UpdateWidget", "a1", "bob"), codes.PermissionDenied},
		{"an update whose mask leaves the owner alone", "UpdateWidget", withWidget("UpdateWidget", "a1", "bob", "color"), codes.OK},
		{"an update whose mask sets the owner", "UpdateWidget", withWidget("UpdateWidget", "a1", "bob", "metadata.owner"), codes.PermissionDenied},
	} {
		c := certCall(svc+tc.method, "alice")
		ctx, gr, err := g.admit(ctx, c, nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !gr.checksRequest() {
			t.Fatalf("%s: the grant does not check the request", tc.name)
		}
		if err := g.checkRequest(ctx, c, gr, tc.req); code(err) != tc.want {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.want)
		}
	}
	if len(asked) == 0 || asked[0] != schematest.Service+".GetWidget a1" {
		t.Errorf("objects read: %v", asked)
	}

	// A list is filtered.
	_, list, err := g.admit(ctx, certCall(svc+"ListWidgets", "alice"), nil)
	if err != nil || !list.filters() {
		t.Fatalf("ListWidgets as a widget-owner: %v (filters %v)", err, list.filters())
	}
	out := schema.Load().Method(svc + "ListWidgets").Output()
	resp := dynamicpb.NewMessage(out)
	items := resp.Mutable(out.Fields().ByName("widgets")).List()
	for _, w := range []*dynamicpb.Message{widget(objType, "1", "alice"), widget(objType, "2", "bob"), widget(objType, "3", ""), widget(objType, "4", "alice")} {
		items.Append(protoreflect.ValueOfMessage(w))
	}
	if !list.filter(resp) || items.Len() != 2 || items.Get(0).Message().Get(objType.Fields().ByName("id")).String() != "1" || items.Get(1).Message().Get(objType.Fields().ByName("id")).String() != "4" {
		t.Errorf("filtered list: %v", resp)
	}

	// Explain (CheckAccess, WhoAmI) answers as the guard decides.
	e, err := g.Explain(authz.Principal{Identity: "alice", Roles: []string{"widget-owner"}}, svc+"GetWidget", `{"id": "b1", "metadata": {"owner": "bob"}}`)
	if err != nil || e.Resource != schematest.Resource || e.Verb != "get" || e.Decision != "conditional" || e.Allowed {
		t.Errorf("Explain of GetWidget on bob's widget for alice: %+v %v", e, err)
	}
	if e, err := g.Explain(authz.Principal{Identity: "pete", Roles: []string{"pinger"}}, svc+"Ping", ""); err != nil || e.Resource != schematest.Service || e.Verb != authz.VerbCall || !e.Allowed {
		t.Errorf("Explain of Ping for a pinger: %+v %v", e, err)
	}

	// Without the descriptor set (a reload that removed it) the service
	// is unschemed again; a new one is read again.
	schema.Store(nil)
	if _, _, err := g.admit(ctx, certCall(svc+"GetWidget", "reader"), nil); code(err) != codes.PermissionDenied {
		t.Errorf("GetWidget without the descriptor set, by a widgets reader: %v, want PermissionDenied (call on the service)", err)
	}
	if _, _, err := g.admit(ctx, certCall(svc+"GetWidget", "pinger"), nil); err != nil {
		t.Errorf("GetWidget without the descriptor set, by the service's caller: %v", err)
	}
	before := g.lookup(svc + "ListWidgets")
	schema.Store(loadWidgets(t))
	after := g.lookup(svc + "ListWidgets")
	if after.unschemed || after.md == nil || after.md == before.md || after.rule.GetResource() != schematest.Resource {
		t.Errorf("after a new descriptor set: %+v", after)
	}
	if _, _, err := g.admit(ctx, certCall(svc+"GetWidget", "reader"), nil); err != nil {
		t.Errorf("GetWidget with the new descriptor set, by a widgets reader: %v", err)
	}
}
