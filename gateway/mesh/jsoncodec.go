package mesh

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// forwardProtoKey marks a call transcoded to proto (TranscodeJSON): it
// reaches backends in proto, whatever its caller's codec.
type forwardProtoKey struct{}

// TranscodeJSON is the first stream interceptor of a gRPC server that
// runs the proxy. A call in JSON (application/grpc+json) of a method whose
// schema the proxy has (linked into the program: the VM, storage and
// network APIs; or its route's descriptor set) is turned into proto for the rest of
// the chain — access control reads its fields — and for the backend,
// whose answers go back to the caller in JSON. Calls in proto, and calls
// of services the program has no schema of (which reach their backend in
// their own codec, untouched), are left as they are.
func (p *Proxy) TranscodeJSON(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if CallCodec(ss.Context()) != "json" {
		return handler(srv, ss)
	}
	mi := p.lookup(info.FullMethod)
	if !mi.known {
		return handler(srv, ss)
	}
	ctx := context.WithValue(ss.Context(), forwardProtoKey{}, true)
	js := &jsonStream{ServerStream: ss, ctx: ctx, in: mi.input, out: mi.output}
	if mi.types != nil {
		js.unmarshal.Resolver, js.marshal.Resolver = mi.types, mi.types
	}
	return handler(srv, js)
}

// jsonStream is a JSON caller's stream seen in proto.
type jsonStream struct {
	grpc.ServerStream
	ctx       context.Context
	in, out   protoreflect.MessageDescriptor
	unmarshal protojson.UnmarshalOptions
	marshal   protojson.MarshalOptions
}

func (s *jsonStream) Context() context.Context { return s.ctx }

// RecvMsg reads the caller's next message (JSON) as proto: a Frame of
// proto bytes, or a message of the method's type.
func (s *jsonStream) RecvMsg(m any) error {
	raw := new(Frame)
	if err := s.ServerStream.RecvMsg(raw); err != nil {
		return err
	}
	defer raw.Free()
	var msg proto.Message
	f, isFrame := m.(*Frame)
	if isFrame {
		msg = dynamicpb.NewMessage(s.in)
	} else if pm, ok := m.(proto.Message); ok {
		msg = pm
	} else {
		return status.Errorf(codes.Internal, "transcoding JSON: cannot decode into %T", m)
	}
	if err := s.unmarshal.Unmarshal(raw.Bytes(), msg); err != nil {
		return status.Errorf(codes.InvalidArgument, "the request is not JSON of %s: %v", s.in.FullName(), err)
	}
	if isFrame {
		b, err := proto.Marshal(msg)
		if err != nil {
			return status.Errorf(codes.Internal, "transcoding JSON: %v", err)
		}
		f.Set(NewFrame(b))
	}
	return nil
}

// SendMsg answers the caller in JSON.
func (s *jsonStream) SendMsg(m any) error {
	var msg proto.Message
	switch v := m.(type) {
	case *Frame:
		dm := dynamicpb.NewMessage(s.out)
		if err := proto.Unmarshal(v.Bytes(), dm); err != nil {
			return status.Errorf(codes.Internal, "transcoding the backend's answer to JSON: %v", err)
		}
		msg = dm
	case proto.Message:
		msg = v
	default:
		return status.Errorf(codes.Internal, "transcoding JSON: cannot encode %T", m)
	}
	b, err := s.marshal.Marshal(msg)
	if err != nil {
		return status.Errorf(codes.Internal, "transcoding the answer to JSON: %v", err)
	}
	return s.ServerStream.SendMsg(NewFrame(b))
}
