package mesh

import (
	"fmt"
	"net/http"

	"connectrpc.com/vanguard"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// NewTranscoder serves Connect (binary and JSON) and gRPC-Web calls of the
// given services by transcoding them, with vanguard, to gRPC calls of
// grpcHandler (the grpc.Server whose unknown-service handler is the
// proxy, through its ServeHTTP). Native gRPC clients reach that server
// directly. Messages are limited to maxMessageBytes by grpcHandler; the
// transcoder buffers up to twice that, so that a message over the limit
// is read whole and refused by the gRPC server with ResourceExhausted
// (vanguard's own refusal stops reading the request, which clients report
// as a broken connection).
func NewTranscoder(services []protoreflect.ServiceDescriptor, grpcHandler http.Handler, maxMessageBytes uint32) (http.Handler, error) {
	buffer := 2 * maxMessageBytes
	svcs := make([]*vanguard.Service, 0, len(services))
	for _, sd := range services {
		svcs = append(svcs, vanguard.NewServiceWithSchema(sd, grpcHandler,
			vanguard.WithTargetProtocols(vanguard.ProtocolGRPC),
			vanguard.WithTargetCodecs(vanguard.CodecProto),
			vanguard.WithMaxMessageBufferBytes(buffer),
		))
	}
	t, err := vanguard.NewTranscoder(svcs)
	if err != nil {
		return nil, fmt.Errorf("transcoder: %w", err)
	}
	return t, nil
}
