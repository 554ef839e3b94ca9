package mesh

import (
	"context"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"connectrpc.com/vanguard"
	"google.golang.org/grpc"
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
func NewTranscoder(services []protoreflect.ServiceDescriptor, grpcHandler http.Handler, maxMessageBytes uint32, opts ...vanguard.ServiceOption) (http.Handler, error) {
	buffer := 2 * maxMessageBytes
	svcs := make([]*vanguard.Service, 0, len(services))
	for _, sd := range services {
		svcs = append(svcs, vanguard.NewServiceWithSchema(sd, grpcHandler, append([]vanguard.ServiceOption{
			vanguard.WithTargetProtocols(vanguard.ProtocolGRPC),
			vanguard.WithTargetCodecs(vanguard.CodecProto),
			vanguard.WithMaxMessageBufferBytes(buffer),
		}, opts...)...))
	}
	t, err := vanguard.NewTranscoder(svcs)
	if err != nil {
		return nil, fmt.Errorf("transcoder: %w", err)
	}
	return connectDefaults(t, int64(buffer)), nil
}

// supportedContentTypes are the content types of the protocols the
// transcoder serves (Connect unary and streaming, gRPC-Web; gRPC goes to
// the gRPC server directly).
var supportedContentTypes = []string{
	"application/proto", "application/json",
	"application/connect+proto", "application/connect+json",
	"application/grpc-web", "application/grpc-web+proto", "application/grpc-web+json", "application/grpc-web-text",
}

// connectDefaults accepts what connect-go accepts on the agent's own
// services: a Connect unary POST (application/proto or application/json)
// without the optional Connect-Protocol-Version header, which vanguard
// would not recognise (it answers a bare 404). A request in no supported
// protocol gets 415 naming the supported content types.
//
// A unary request whose declared length is more than the transcoder
// buffers (maxBody) is refused with resource_exhausted before any of it is
// read, in the protocol's own form: vanguard would stop reading it and
// answer unavailable.
func connectDefaults(next http.Handler, maxBody int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			next.ServeHTTP(w, r) // Connect GET: ?encoding=…&message=…
			return
		}
		ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if r.Method != http.MethodPost || !slices.Contains(supportedContentTypes, ct) {
			w.Header().Set("Accept-Post", strings.Join(supportedContentTypes, ", "))
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnsupportedMediaType)
			_, _ = fmt.Fprintf(w, `{"code":"unimplemented","message":%q}`,
				fmt.Sprintf("%s %s with content type %q: this endpoint speaks Connect (POST with %s; GET for idempotent methods), gRPC-Web and gRPC", r.Method, r.URL.Path, r.Header.Get("Content-Type"), strings.Join(supportedContentTypes[:4], ", ")))
			return
		}
		if r.ContentLength > maxBody {
			msg := fmt.Sprintf("a request body of %d bytes: more than the %d this API reads (a message is at most %d bytes)", r.ContentLength, maxBody, maxBody/2)
			if strings.HasPrefix(ct, "application/grpc-web") {
				w.Header().Set("Content-Type", ct)
				w.Header().Set("Grpc-Status", "8") // RESOURCE_EXHAUSTED
				w.Header().Set("Grpc-Message", url.PathEscape(msg))
				w.WriteHeader(http.StatusOK)
				return
			}
			if ct == "application/proto" || ct == "application/json" {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusTooManyRequests) // Connect's resource_exhausted
				_, _ = fmt.Fprintf(w, `{"code":"resource_exhausted","message":%q}`, msg)
				return
			}
		}
		if (ct == "application/proto" || ct == "application/json") && r.Header.Get("Connect-Protocol-Version") == "" {
			r.Header.Set("Connect-Protocol-Version", "1")
		}
		if ct != "application/proto" && ct != "application/json" {
			body, release := newStreamBody(r.Body)
			defer release()
			r = r.WithContext(context.WithValue(r.Context(), releaseBodyKey{}, release))
			r.Body = body
		}
		next.ServeHTTP(w, r)
	})
}

// A stream's request body, as the transcoder reads it, is released when
// the call's handler returns. vanguard (v0.4.0) reads the body under a
// lock that its Close takes too, and gRPC closes the body when a call
// ends: a call that ends while its caller still sends and waits for an
// answer (a console whose VM is off, refused at once) waited for the
// caller's next message before its answer went out, forever for a
// terminal. The body is read by a goroutine into a pipe, whose reading
// writing side is closed when the handler returns (ReleaseStreamBody),
// which ends vanguard's read as an end of stream; the goroutine ends with
// the caller's next message or the request.

// releaseBodyKey is the context key of a transcoded stream's release.
type releaseBodyKey struct{}

// newStreamBody returns a body that reads body through a pipe, and the
// function that ends it.
func newStreamBody(body io.ReadCloser) (io.ReadCloser, func()) {
	pr, pw := io.Pipe()
	go func() {
		_, err := io.Copy(pw, body)
		_ = pw.CloseWithError(err) // nil: EOF
	}()
	// The release ends the body as the caller's end of stream would:
	// vanguard answers a read error of the body as the call's failure
	// (unavailable), in place of the status the call ended with.
	return pr, func() { _ = pw.CloseWithError(io.EOF) }
}

// ReleaseStreamBody is a stream interceptor (the first of the API port's
// gRPC server) that releases the request body of a call that came through
// the transcoder when the call's handler returns.
func ReleaseStreamBody(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	err := handler(srv, ss)
	if release, ok := ss.Context().Value(releaseBodyKey{}).(func()); ok {
		release()
	}
	return err
}
