package mesh

import (
	"testing"

	"pilab.hu/pivirt-agent/gateway/mesh/schematest"
)

// TestDescriptorSetMethod: the descriptors access control reads are a
// route's descriptor set's only: not a method the program links (which
// wins), not a route without a set (whose schema, if any, is learned from
// the backend), not a method the set lacks, not an unrouted one.
func TestDescriptorSetMethod(t *testing.T) {
	s, err := LoadSchema(schematest.WriteSet(t), "/"+schematest.Service)
	if err != nil {
		t.Fatal(err)
	}
	p := NewProxy(nil, nil)
	p.SetRoutes([]Route{
		{Prefix: "/" + schematest.Service, Schema: s},
		{Prefix: "/pivirt.vm.v1.VMService", Schema: s},
		{Prefix: "/acme.other.v1.Other"},
	})
	get := "/" + schematest.Service + "/GetWidget"
	if md := p.DescriptorSetMethod(get); md == nil || md != s.Method(get) || md.Input().FullName() != "acme.widget.v1.GetWidgetRequest" {
		t.Errorf("GetWidget: %v", md)
	}
	for _, m := range []string{
		"/pivirt.vm.v1.VMService/GetVM",        // linked in
		"/acme.other.v1.Other/Call",            // no descriptor set
		"/" + schematest.Service + "/NoSuch",   // not in the set
		"/acme.unrouted.v1.Unrouted/GetWidget", // no route
	} {
		if md := p.DescriptorSetMethod(m); md != nil {
			t.Errorf("%s: %v, want none", m, md.FullName())
		}
	}
	// A reload's new set is a new descriptor (the guard's cache follows it).
	s2, err := LoadSchema(schematest.WriteSet(t), "/"+schematest.Service)
	if err != nil {
		t.Fatal(err)
	}
	p.SetRoutes([]Route{{Prefix: "/" + schematest.Service, Schema: s2}})
	if md := p.DescriptorSetMethod(get); md == nil || md == s.Method(get) {
		t.Errorf("after new routes: %v, want the new set's descriptor", md)
	}
}
