// Command descset writes the binary FileDescriptorSet of the conformance
// suite's service (connectrpc/conformance/v1/service.proto and its imports,
// the well-known types included), compiled from the .proto files of the
// connectrpc.com/conformance module this module pins. make conformance hands
// it to the agent as a routing rule's descriptor_set: the run that gives the
// agent the service's schema (JSON transcoding, Connect GET).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
)

func main() {
	protoDir := flag.String("proto", "", "the proto directory of the connectrpc.com/conformance module")
	out := flag.String("o", "", "the file to write the descriptor set to")
	flag.Parse()
	if *protoDir == "" || *out == "" {
		fmt.Fprintln(os.Stderr, "descset: -proto <dir> and -o <file> are required")
		os.Exit(2)
	}
	if err := run(*protoDir, *out); err != nil {
		fmt.Fprintf(os.Stderr, "descset: %v\n", err)
		os.Exit(1)
	}
}

func run(protoDir, out string) error {
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{protoDir}})}
	files, err := c.Compile(context.Background(), "connectrpc/conformance/v1/service.proto")
	if err != nil {
		return fmt.Errorf("compile %s: %w", filepath.Join(protoDir, "connectrpc/conformance/v1/service.proto"), err)
	}
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		imports := fd.Imports()
		for i := range imports.Len() {
			add(imports.Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(fd))
	}
	for _, f := range files {
		add(f)
	}
	b, err := proto.Marshal(set)
	if err != nil {
		return err
	}
	return os.WriteFile(out, b, 0o644)
}
