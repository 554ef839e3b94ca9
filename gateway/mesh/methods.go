package mesh

import (
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// methodInfo is what the proxy knows of a method from its schema.
type methodInfo struct {
	known                        bool
	clientStreams, serverStreams bool
	// idempotent: the method's authorization verb is get or list, so it
	// may be tried again.
	idempotent bool
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
					info = methodInfo{known: true, clientStreams: md.IsStreamingClient(), serverStreams: md.IsStreamingServer()}
					if a, ok := proto.GetExtension(md.Options(), apiv1.E_Authz).(*apiv1.Authorization); ok && a != nil {
						info.idempotent = a.GetVerb() == "get" || a.GetVerb() == "list"
					}
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
