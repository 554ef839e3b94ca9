package mesh

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// Schema is the schema of a routed service that is not linked into the
// program, from a descriptor set a routing rule names
// (routing.rules[].route.descriptor_set): with it the gateway transcodes
// JSON callers to proto (Proxy.TranscodeJSON) and serves Connect GET for
// the methods free of side effects (Bridge).
type Schema struct {
	path     string
	files    *protoregistry.Files
	services []protoreflect.ServiceDescriptor

	// types resolves the schema's messages (dynamic) and the program's,
	// for JSON's google.protobuf.Any.
	types typeChain
	infos sync.Map // full method name → methodInfo
}

// LoadSchema reads a FileDescriptorSet (binary; every import included,
// except the protos linked into the program, such as the well-known
// types) and keeps the services a route of prefix serves.
func LoadSchema(path, prefix string) (*Schema, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("descriptor set: %w", err)
	}
	var set descriptorpb.FileDescriptorSet
	if err := proto.Unmarshal(b, &set); err != nil {
		return nil, fmt.Errorf("descriptor set %s: not a binary FileDescriptorSet (buf build -o FILE.binpb, or protoc --include_imports --descriptor_set_out=FILE): %v", path, err)
	}
	files := new(protoregistry.Files)
	resolver := chainResolver{files, protoregistry.GlobalFiles}
	pending := set.GetFile()
	for len(pending) > 0 {
		var next []*descriptorpb.FileDescriptorProto
		for _, fd := range pending {
			if _, err := protoregistry.GlobalFiles.FindFileByPath(fd.GetName()); err == nil {
				continue // linked in already: the program's own descriptor
			}
			ready := true
			for _, dep := range fd.GetDependency() {
				if _, err := resolver.FindFileByPath(dep); err != nil {
					ready = false
				}
			}
			if !ready {
				next = append(next, fd)
				continue
			}
			f, err := protodesc.NewFile(fd, resolver)
			if err != nil {
				return nil, fmt.Errorf("descriptor set %s: %s: %v", path, fd.GetName(), err)
			}
			if err := files.RegisterFile(f); err != nil {
				return nil, fmt.Errorf("descriptor set %s: %s: %v", path, fd.GetName(), err)
			}
		}
		if len(next) == len(pending) {
			var missing []string
			for _, fd := range next {
				for _, dep := range fd.GetDependency() {
					if _, err := resolver.FindFileByPath(dep); err != nil && !slices.Contains(missing, dep) {
						missing = append(missing, dep)
					}
				}
			}
			return nil, fmt.Errorf("descriptor set %s: imports %s, which the set does not hold (build it with every import: buf build, or protoc --include_imports)", path, strings.Join(missing, ", "))
		}
		pending = next
	}
	s, err := newSchema(path, files, prefix)
	if err != nil {
		return nil, fmt.Errorf("descriptor set %s: %w", path, err)
	}
	return s, nil
}

// newSchema is the schema of the services in files that a route of prefix
// serves; source says where files came from (Path).
func newSchema(source string, files *protoregistry.Files, prefix string) (*Schema, error) {
	s := &Schema{path: source, files: files, types: typeChain{dynamicpb.NewTypes(files), protoregistry.GlobalTypes}}
	var all []string
	files.RangeFiles(func(f protoreflect.FileDescriptor) bool {
		for i := range f.Services().Len() {
			sd := f.Services().Get(i)
			all = append(all, string(sd.FullName()))
			if routesService(prefix, string(sd.FullName())) {
				s.services = append(s.services, sd)
			}
		}
		return true
	})
	if len(s.services) == 0 {
		return nil, fmt.Errorf("no service the prefix %s routes (services: %s)", prefix, strings.Join(all, ", "))
	}
	return s, nil
}

// routesService reports whether a route of prefix serves methods of the
// service (a full name).
func routesService(prefix, service string) bool {
	return matchPrefix("/"+service+"/", prefix) || matchPrefix("/"+service, prefix)
}

// Files are the schema's files (those the program links excepted).
func (s *Schema) Files() *protoregistry.Files { return s.files }

// ServiceDescriptors are the services of the schema the route serves.
func (s *Schema) ServiceDescriptors() []protoreflect.ServiceDescriptor { return s.services }

// Path is the file the schema was read from ("reflection of
// backends.NAME" for a schema learned from the backend).
func (s *Schema) Path() string { return s.path }

// Services are the full names of the services of the schema the route
// serves.
func (s *Schema) Services() []string {
	out := make([]string, len(s.services))
	for i, sd := range s.services {
		out[i] = string(sd.FullName())
	}
	return out
}

// Method is the descriptor of a method ("/pkg.Service/Method") of the
// schema's services the route serves, nil when it has none.
func (s *Schema) Method(full string) protoreflect.MethodDescriptor { return s.method(full) }

// method is the descriptor of a method ("/pkg.Service/Method") of the
// schema, nil when it has none.
func (s *Schema) method(full string) protoreflect.MethodDescriptor {
	svc, name, ok := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	if !ok {
		return nil
	}
	for _, sd := range s.services {
		if string(sd.FullName()) == svc {
			return sd.Methods().ByName(protoreflect.Name(name))
		}
	}
	return nil
}

// info is what the proxy knows of a method of the schema.
func (s *Schema) info(full string) methodInfo {
	if v, ok := s.infos.Load(full); ok {
		return v.(methodInfo)
	}
	md := s.method(full)
	if md == nil {
		return methodInfo{}
	}
	info := infoOf(md)
	info.types = s.types
	s.infos.Store(full, info)
	return info
}

// typeChain finds message and extension types in each resolver in turn:
// the schema's own (dynamic messages), then the program's.
type typeChain []interface {
	protoregistry.MessageTypeResolver
	protoregistry.ExtensionTypeResolver
}

func (c typeChain) FindMessageByName(name protoreflect.FullName) (protoreflect.MessageType, error) {
	for _, r := range c {
		if t, err := r.FindMessageByName(name); err == nil {
			return t, nil
		}
	}
	return nil, protoregistry.NotFound
}

func (c typeChain) FindMessageByURL(url string) (protoreflect.MessageType, error) {
	for _, r := range c {
		if t, err := r.FindMessageByURL(url); err == nil {
			return t, nil
		}
	}
	return nil, protoregistry.NotFound
}

func (c typeChain) FindExtensionByName(name protoreflect.FullName) (protoreflect.ExtensionType, error) {
	for _, r := range c {
		if t, err := r.FindExtensionByName(name); err == nil {
			return t, nil
		}
	}
	return nil, protoregistry.NotFound
}

func (c typeChain) FindExtensionByNumber(message protoreflect.FullName, field protoreflect.FieldNumber) (protoreflect.ExtensionType, error) {
	for _, r := range c {
		if t, err := r.FindExtensionByNumber(message, field); err == nil {
			return t, nil
		}
	}
	return nil, protoregistry.NotFound
}

// chainResolver finds files and descriptors in each resolver in turn.
type chainResolver []*protoregistry.Files

func (c chainResolver) FindFileByPath(path string) (protoreflect.FileDescriptor, error) {
	for _, r := range c {
		if f, err := r.FindFileByPath(path); err == nil {
			return f, nil
		}
	}
	return nil, protoregistry.NotFound
}

func (c chainResolver) FindDescriptorByName(name protoreflect.FullName) (protoreflect.Descriptor, error) {
	for _, r := range c {
		if d, err := r.FindDescriptorByName(name); err == nil {
			return d, nil
		}
	}
	return nil, protoregistry.NotFound
}
