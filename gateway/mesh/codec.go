package mesh

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// Frame is one gRPC message forwarded without decoding. It holds a
// reference to grpc-go's buffers; Free releases it.
type Frame struct {
	data mem.BufferSlice
}

// Len is the message's size in bytes.
func (f *Frame) Len() int { return f.data.Len() }

// Free releases the frame's buffers; the frame is empty afterwards.
func (f *Frame) Free() {
	if f.data != nil {
		f.data.Free()
		f.data = nil
	}
}

// codec passes Frames through as raw bytes and encodes every other message
// with the proto codec, so one gRPC server serves both the proxy and the
// agent's own services. Its name is "proto" (on the wire nothing changes)
// unless the call it forwards came in another codec (name: the content
// subtype, as in application/grpc+json): Frames carry any codec's bytes.
type codec struct {
	proto encoding.CodecV2
	name  string
}

// Codec is the gRPC codec of the proxy, for grpc.ForceServerCodecV2 on the
// server that runs Proxy.Handle and for the calls to backends.
func Codec() encoding.CodecV2 {
	return codec{proto: encoding.GetCodecV2(proto.Name)}
}

// wireOptions keep a forwarded call's wire format as its caller chose it
// (nil for proto, uncompressed: a backend connection's defaults, whose
// codec is the proxy's; a call on another connection sets Codec() first).
// The compression is kept only where accepts (nil: every compression the
// program has) says the other side takes it — gRPC has no negotiation of
// a request's compression, and a backend without gzip would refuse the
// call; otherwise the backend gets the call uncompressed:
// the codec (application/grpc+json reaches the backend as grpc+json, its
// bytes untouched) and the compression of the request (grpc-go
// decompressed it; it is compressed again the same way). The server's
// stream knows both (grpc-go's transport stream, in the call's context).
func wireOptions(ctx context.Context, accepts func(compressor string) bool) []grpc.CallOption {
	st := grpc.ServerTransportStreamFromContext(ctx)
	var name, compressor string
	if s, ok := st.(interface{ ContentSubtype() string }); ok {
		if sub := s.ContentSubtype(); sub != "" && sub != proto.Name && ctx.Value(forwardProtoKey{}) == nil {
			name = sub
		}
	}
	if s, ok := st.(interface{ RecvCompress() string }); ok {
		if c := s.RecvCompress(); c != "" && c != "identity" && encoding.GetCompressor(c) != nil && (accepts == nil || accepts(c)) {
			compressor = c
		}
	}
	if name == "" && compressor == "" {
		return nil // proto, uncompressed: the defaults (the proxy's codec)
	}
	opts := []grpc.CallOption{grpc.ForceCodecV2(codec{proto: encoding.GetCodecV2(proto.Name), name: name})}
	if compressor != "" {
		opts = append(opts, grpc.UseCompressor(compressor))
	}
	return opts
}

// CodecName is the codec of a gRPC content subtype: "" is proto.
func CodecName(subtype string) string {
	if subtype == "" {
		return proto.Name
	}
	return subtype
}

// CallCodec is the codec the caller of a gRPC server call chose ("proto",
// "json", …), from grpc-go's stream in ctx; "proto" when unknown.
func CallCodec(ctx context.Context) string {
	if s, ok := grpc.ServerTransportStreamFromContext(ctx).(interface{ ContentSubtype() string }); ok {
		return CodecName(s.ContentSubtype())
	}
	return proto.Name
}

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		// grpc-go frees what Marshal returns once written; the frame
		// keeps its own reference (a retry sends it again).
		f.data.Ref()
		return f.data, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*Frame); ok {
		// grpc-go frees data after Unmarshal returns; the frame keeps it.
		data.Ref()
		f.data = data
		return nil
	}
	return c.proto.Unmarshal(data, v)
}

func (c codec) Name() string {
	if c.name != "" {
		return c.name
	}
	return proto.Name
}

// NewFrame wraps an encoded message (the gateway's access checks re-encode
// a filtered response).
func NewFrame(b []byte) *Frame {
	return &Frame{data: mem.BufferSlice{mem.SliceBuffer(b)}}
}

// Bytes returns the message's bytes (a copy when the frame spans several
// buffers).
func (f *Frame) Bytes() []byte {
	if len(f.data) == 1 {
		return f.data[0].ReadOnlyData()
	}
	return f.data.Materialize()
}

// Set moves src's buffers into f (releasing f's own); src is empty
// afterwards.
func (f *Frame) Set(src *Frame) {
	f.Free()
	f.data, src.data = src.data, nil
}
