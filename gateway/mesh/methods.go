package mesh

import (
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// methodInfo is what the proxy knows of a method from its schema.
type methodInfo struct {
	known                        bool
	clientStreams, serverStreams bool
	// idempotent: the method's authorization verb is get or list, so it
	// may be tried again.
	idempotent bool
	// rule is the method's authz annotation (nil: none); input and
	// output its message types.
	rule          *apiv1.Authorization
	input, output protoreflect.MessageDescriptor
	// listField holds a list method's objects.
	listField protoreflect.FieldDescriptor
	// getter reads one object of the method's resource by ID
	// ("/pkg.Service/GetX"; "" when the service has none), with its
	// request and response types.
	getter              string
	getterIn, getterOut protoreflect.MessageDescriptor
	// types resolves the messages of a JSON google.protobuf.Any (nil: the
	// program's, protoregistry.GlobalTypes).
	types typeResolver
}

// typeResolver finds message and extension types by name and URL.
type typeResolver interface {
	protoregistry.MessageTypeResolver
	protoregistry.ExtensionTypeResolver
}

var methodCache sync.Map // full method name → methodInfo

// lookupMethod finds a method ("/pkg.Service/Method") in the protos linked
// into the program (protoregistry.GlobalFiles: the agent links the VM,
// storage and network APIs); a method it does not know is forwarded but
// never retried.
func lookupMethod(fullMethod string) methodInfo {
	if v, ok := methodCache.Load(fullMethod); ok {
		return v.(methodInfo)
	}
	var info methodInfo
	svc, method, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if ok {
		if d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc)); err == nil {
			if sd, ok := d.(protoreflect.ServiceDescriptor); ok {
				if md := sd.Methods().ByName(protoreflect.Name(method)); md != nil {
					info = infoOf(md)
				}
			}
		}
	}
	if info.known {
		// Only schema methods are cached: callers choose the names.
		methodCache.Store(fullMethod, info)
	}
	return info
}

// infoOf is what a method's descriptor tells the proxy.
func infoOf(md protoreflect.MethodDescriptor) methodInfo {
	sd := md.Parent().(protoreflect.ServiceDescriptor)
	info := methodInfo{known: true, clientStreams: md.IsStreamingClient(), serverStreams: md.IsStreamingServer(),
		input: md.Input(), output: md.Output()}
	if a := authzOf(md); a != nil {
		info.rule = a
		info.idempotent = a.GetVerb() == "get" || a.GetVerb() == "list"
		if a.GetListField() != "" {
			info.listField = md.Output().Fields().ByName(protoreflect.Name(a.GetListField()))
			if info.listField != nil && (!info.listField.IsList() || info.listField.Message() == nil) {
				info.listField = nil
			}
		}
		if g := getterOf(sd, a.GetResource()); g != nil {
			info.getter = "/" + string(sd.FullName()) + "/" + string(g.Name())
			info.getterIn, info.getterOut = g.Input(), g.Output()
		}
	} else if opts, ok := md.Options().(*descriptorpb.MethodOptions); ok && opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS {
		// A schema of a routed service: retried as its author says.
		info.idempotent = true
	}
	return info
}

// authzOf is a method's authz annotation, nil when it has none.
func authzOf(md protoreflect.MethodDescriptor) *apiv1.Authorization {
	a, ok := proto.GetExtension(md.Options(), apiv1.E_Authz).(*apiv1.Authorization)
	if !ok || a == nil || a.GetResource() == "" {
		return nil
	}
	return a
}

// getterOf is the unary method of sd that reads one object of resource
// by its "id" field.
func getterOf(sd protoreflect.ServiceDescriptor, resource string) protoreflect.MethodDescriptor {
	for i := range sd.Methods().Len() {
		md := sd.Methods().Get(i)
		a := authzOf(md)
		if a == nil || a.GetResource() != resource || a.GetVerb() != "get" || a.GetIdField() != "id" || md.IsStreamingClient() || md.IsStreamingServer() {
			continue
		}
		return md
	}
	return nil
}

// newMessage makes an empty message of md: the generated type when the
// program links it, else a dynamic one.
func newMessage(md protoreflect.MessageDescriptor) protoreflect.Message {
	if mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName()); err == nil {
		return mt.New()
	}
	return dynamicpb.NewMessage(md)
}
