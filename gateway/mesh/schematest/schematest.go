// Package schematest is a routed service the program does not link, for
// tests: acme.widget.v1.WidgetService, whose methods carry the
// (pivirt.api.v1.authz) annotation (resource "widgets") but for Ping, as
// a binary FileDescriptorSet a routing rule can name, and a backend that
// serves it with dynamic messages.
package schematest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/bufbuild/protocompile"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// Service is the full name of the service; Resource the annotations'
// resource.
const (
	Service  = "acme.widget.v1.WidgetService"
	Resource = "widgets"
)

// Proto is the service's source.
const Proto = `syntax = "proto3";
package acme.widget.v1;

import "google/protobuf/field_mask.proto";
import "pivirt/api/v1/api.proto";

message Widget {
  string id = 1;
  pivirt.api.v1.ObjectMeta metadata = 2;
  string color = 3;
}
message GetWidgetRequest { string id = 1; }
message GetWidgetResponse { Widget widget = 1; }
message ListWidgetsRequest {
  int32 page_size = 1;
  string page_token = 2;
}
message ListWidgetsResponse {
  repeated Widget widgets = 1;
  string next_page_token = 2;
}
message CreateWidgetRequest { Widget widget = 1; }
message UpdateWidgetRequest {
  Widget widget = 1;
  google.protobuf.FieldMask update_mask = 2;
}
message PingRequest { string text = 1; }
message PingResponse { string text = 1; }

service WidgetService {
  rpc GetWidget(GetWidgetRequest) returns (GetWidgetResponse) {
    option (pivirt.api.v1.authz) = {resource: "widgets", verb: "get", id_field: "id"};
  }
  rpc ListWidgets(ListWidgetsRequest) returns (ListWidgetsResponse) {
    option (pivirt.api.v1.authz) = {resource: "widgets", verb: "list", list_field: "widgets"};
  }
  rpc CreateWidget(CreateWidgetRequest) returns (Widget) {
    option (pivirt.api.v1.authz) = {resource: "widgets", verb: "create", object_field: "widget"};
  }
  rpc UpdateWidget(UpdateWidgetRequest) returns (Widget) {
    option (pivirt.api.v1.authz) = {resource: "widgets", verb: "update", id_field: "widget.id"};
  }
  rpc WhoAmI(PingRequest) returns (PingResponse) {
    option (pivirt.api.v1.authz) = {self: true};
  }
  rpc Ping(PingRequest) returns (PingResponse);
}
`

// Set is the binary FileDescriptorSet of Proto with its imports (those the
// program links included, as protoc --include_imports writes them).
func Set(t testing.TB) []byte {
	t.Helper()
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(protocompile.CompositeResolver{
		&protocompile.SourceResolver{Accessor: protocompile.SourceAccessorFromMap(map[string]string{"acme/widget/v1/widget.proto": Proto})},
		protocompile.ResolverFunc(func(path string) (protocompile.SearchResult, error) {
			if path == apiv1.File_pivirt_api_v1_api_proto.Path() {
				return protocompile.SearchResult{Desc: apiv1.File_pivirt_api_v1_api_proto}, nil
			}
			return protocompile.SearchResult{}, os.ErrNotExist
		}),
	})}
	files, err := c.Compile(context.Background(), "acme/widget/v1/widget.proto")
	if err != nil {
		t.Fatal(err)
	}
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		for i := range fd.Imports().Len() {
			add(fd.Imports().Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(fd))
	}
	for _, f := range files {
		add(f)
	}
	b, err := proto.Marshal(set)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// WriteSet writes Set to a file of t's and returns its path.
func WriteSet(t testing.TB) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "widget.binpb")
	if err := os.WriteFile(path, Set(t), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// File is the service's file of Set, resolved against the program's
// protos.
func File(t testing.TB) protoreflect.FileDescriptor {
	t.Helper()
	var set descriptorpb.FileDescriptorSet
	if err := proto.Unmarshal(Set(t), &set); err != nil {
		t.Fatal(err)
	}
	for _, fdp := range set.GetFile() {
		if fdp.GetName() == "acme/widget/v1/widget.proto" {
			f, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatal("no acme/widget/v1/widget.proto in the set")
	return nil
}

// Backend serves the service from memory; Objects are its widgets (id →
// owner), Calls the methods it was called with.
type Backend struct {
	mu      sync.Mutex
	sd      protoreflect.ServiceDescriptor
	objects map[string]string
	calls   []string
}

// Register serves the service on s with the widgets of owners (id →
// owner).
func Register(s *grpc.Server, f protoreflect.FileDescriptor, owners map[string]string) *Backend {
	b := &Backend{sd: f.Services().ByName("WidgetService"), objects: map[string]string{}}
	for id, o := range owners {
		b.objects[id] = o
	}
	desc := grpc.ServiceDesc{ServiceName: Service, HandlerType: (*any)(nil), Metadata: f.Path()}
	for i := range b.sd.Methods().Len() {
		md := b.sd.Methods().Get(i)
		desc.Methods = append(desc.Methods, grpc.MethodDesc{MethodName: string(md.Name()), Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			req := dynamicpb.NewMessage(md.Input())
			if err := dec(req); err != nil {
				return nil, err
			}
			return b.serve(md, req)
		}})
	}
	s.RegisterService(&desc, b)
	return b
}

// Calls are the methods called so far, by name.
func (b *Backend) Calls() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.calls)
}

func (b *Backend) serve(md protoreflect.MethodDescriptor, req *dynamicpb.Message) (proto.Message, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls = append(b.calls, string(md.Name()))
	resp := dynamicpb.NewMessage(md.Output())
	widgetType := b.sd.ParentFile().Messages().ByName("Widget")
	widget := func(id, owner string) protoreflect.Message {
		w := dynamicpb.NewMessage(widgetType)
		w.Set(widgetType.Fields().ByName("id"), protoreflect.ValueOfString(id))
		meta := w.Mutable(widgetType.Fields().ByName("metadata")).Message()
		meta.Set(meta.Descriptor().Fields().ByName("owner"), protoreflect.ValueOfString(owner))
		return w
	}
	str := func(m protoreflect.Message, name string) string {
		return m.Get(m.Descriptor().Fields().ByName(protoreflect.Name(name))).String()
	}
	switch md.Name() {
	case "GetWidget":
		id := str(req, "id")
		owner, ok := b.objects[id]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "widget %s: not found", id)
		}
		resp.Set(md.Output().Fields().ByName("widget"), protoreflect.ValueOfMessage(widget(id, owner)))
	case "ListWidgets":
		list := resp.Mutable(md.Output().Fields().ByName("widgets")).List()
		for _, id := range slices.Sorted(func(yield func(string) bool) {
			for id := range b.objects {
				if !yield(id) {
					return
				}
			}
		}) {
			list.Append(protoreflect.ValueOfMessage(widget(id, b.objects[id])))
		}
	case "CreateWidget", "UpdateWidget":
		w := req.Get(md.Input().Fields().ByName("widget")).Message()
		id := str(w, "id")
		if md.Name() == "CreateWidget" {
			if _, ok := b.objects[id]; ok {
				return nil, status.Errorf(codes.AlreadyExists, "widget %s exists", id)
			}
		}
		owner, _ := authzOwner(w)
		b.objects[id] = owner
		return widget(id, owner).Interface(), nil
	case "WhoAmI", "Ping":
		resp.Set(md.Output().Fields().ByName("text"), protoreflect.ValueOfString(fmt.Sprintf("pong %s", str(req, "text"))))
	}
	return resp, nil
}

// authzOwner is a widget's metadata.owner.
func authzOwner(w protoreflect.Message) (string, bool) {
	fd := w.Descriptor().Fields().ByName("metadata")
	if !w.Has(fd) {
		return "", false
	}
	m := w.Get(fd).Message()
	return m.Get(m.Descriptor().Fields().ByName("owner")).String(), true
}

// Policy is an RBAC policy for the widget service: admins may do
// everything, widget owners get, list, create and update their own
// widgets, widget readers get any, and pingers call the methods that
// have no annotation.
const Policy = `apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["admin"]
    resources: ["*"]
    verbs: ["*"]
  - roles: ["widget-owner"]
    resources: ["widgets"]
    verbs: ["get", "list", "create", "update"]
    conditions:
      - field: "metadata.owner"
        operator: "Equals"
        value: "{{.user.identity}}"
  - roles: ["pinger"]
    resources: ["acme.widget.v1.WidgetService"]
    verbs: ["call"]
  - roles: ["widget-reader"]
    resources: ["widgets"]
    verbs: ["get"]
`
