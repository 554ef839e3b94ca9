package mesh

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/textproto"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
)

// The bridge serves Connect (unary POST and GET, streaming) and gRPC-Web
// (binary and text) calls of any routed service, without its schema, by
// turning each into a gRPC call of the API port's grpc.Server (through its
// ServeHTTP, as the transcoder does): the messages keep their codec and
// their bytes; only the framing, the headers and the status change. The
// stream type comes from the content type: Connect unary is one message
// each way, every other form is a stream of enveloped messages, which is
// what gRPC carries for every stream type. See DESIGN.md "Protocols in,
// gRPC out".

// bridgeProtocol is the protocol of a bridged call.
type bridgeProtocol int

const (
	connectUnary bridgeProtocol = iota
	connectStream
	grpcWeb
	grpcWebText
)

// Envelope flags: compressed (every protocol), Connect's end of stream,
// gRPC-Web's trailers.
const (
	flagCompressed      = 0x01
	flagConnectEnd      = 0x02
	flagGRPCWebTrailers = 0x80
)

// bridgeCall is what the caller's request says of the call.
type bridgeCall struct {
	protocol bridgeProtocol
	// codec is the message codec ("proto", "json", …); contentType the
	// caller's, answered back for streams.
	codec, contentType string
	// compression of the request's messages; acceptCompression what the
	// caller takes back.
	compression, acceptCompression string
	// timeout is the gRPC form of the caller's timeout ("" for none).
	timeout string
	// get: a Connect GET, whose message is in the query.
	get bool
}

// Bridge serves Connect and gRPC-Web calls through grpcHandler (a
// grpc.Server's ServeHTTP). maxMessageBytes bounds a Connect unary
// request's body, which is read whole to frame it.
type Bridge struct {
	grpc            http.Handler
	maxMessageBytes int64
	proxy           *Proxy
}

// NewBridge returns the bridge to grpcHandler, for the routes of proxy: a
// Connect unary call of a method no route serves is answered 404, as
// Connect servers answer an unknown procedure. A Connect GET is served for
// the methods whose route's schema (a descriptor set) marks them free of
// side effects; with a schema, JSON callers are transcoded to proto by the
// gRPC server's first interceptor (Proxy.TranscodeJSON).
func NewBridge(grpcHandler http.Handler, maxMessageBytes int64, proxy *Proxy) *Bridge {
	return &Bridge{grpc: grpcHandler, maxMessageBytes: maxMessageBytes, proxy: proxy}
}

// IsRPCPath reports whether path names a method of a service
// (/package.Service/Method), which the bridge serves.
func IsRPCPath(path string) bool {
	svc, m, ok := strings.Cut(strings.TrimPrefix(path, "/"), "/")
	return ok && svc != "" && m != "" && !strings.Contains(m, "/") && strings.Contains(svc, ".") && path[0] == '/'
}

// grpcTimeoutValue is a valid grpc-timeout.
var grpcTimeoutValue = regexp.MustCompile(`^[0-9]{1,8}[HMSmun]$`)

// The requests that are no call of the protocols the bridge speaks.
var (
	errBadMethod      = errors.New("not a call: Connect and gRPC-Web calls are POST (Connect GET for idempotent methods)")
	errBadContentType = errors.New("not a call of a protocol and codec this port speaks")
)

// parseBridgeCall reads the protocol, codec, compression and timeout of
// a call from its method, content type and headers.
func parseBridgeCall(r *http.Request) (bridgeCall, error) {
	var c bridgeCall
	if r.Method == http.MethodGet {
		q := r.URL.Query()
		if q.Get("message") == "" && !q.Has("message") || q.Get("encoding") == "" {
			return c, fmt.Errorf("a Connect GET needs the query parameters encoding and message")
		}
		c.protocol, c.get, c.codec = connectUnary, true, q.Get("encoding")
		c.compression = q.Get("compression")
		c.acceptCompression = r.Header.Get("Accept-Encoding")
		c.contentType = "application/" + c.codec
		return c, c.parseConnectTimeout(r)
	}
	if r.Method != http.MethodPost {
		return c, errBadMethod
	}
	ct, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return c, errBadContentType
	}
	switch {
	case ct == "application/grpc-web" || strings.HasPrefix(ct, "application/grpc-web+"):
		c.protocol, c.codec = grpcWeb, cmpOr(strings.TrimPrefix(strings.TrimPrefix(ct, "application/grpc-web"), "+"), "proto")
	case ct == "application/grpc-web-text" || strings.HasPrefix(ct, "application/grpc-web-text+"):
		c.protocol, c.codec = grpcWebText, cmpOr(strings.TrimPrefix(strings.TrimPrefix(ct, "application/grpc-web-text"), "+"), "proto")
	case strings.HasPrefix(ct, "application/connect+"):
		c.protocol, c.codec = connectStream, strings.TrimPrefix(ct, "application/connect+")
	case strings.HasPrefix(ct, "application/") && !strings.HasPrefix(ct, "application/grpc"):
		c.protocol, c.codec = connectUnary, strings.TrimPrefix(ct, "application/")
	default:
		return c, errBadContentType
	}
	if c.codec != "proto" && c.codec != "json" {
		return bridgeCall{}, errBadContentType
	}
	c.contentType = r.Header.Get("Content-Type")
	switch c.protocol {
	case connectUnary:
		c.compression, c.acceptCompression = r.Header.Get("Content-Encoding"), r.Header.Get("Accept-Encoding")
		return c, c.parseConnectTimeout(r)
	case connectStream:
		c.compression, c.acceptCompression = r.Header.Get("Connect-Content-Encoding"), r.Header.Get("Connect-Accept-Encoding")
		return c, c.parseConnectTimeout(r)
	default:
		c.compression, c.acceptCompression, c.timeout = r.Header.Get("Grpc-Encoding"), r.Header.Get("Grpc-Accept-Encoding"), r.Header.Get("Grpc-Timeout")
		if c.timeout != "" && !grpcTimeoutValue.MatchString(c.timeout) {
			return c, fmt.Errorf("grpc-timeout %q: not 1 to 8 digits and a unit (H, M, S, m, u, n)", c.timeout)
		}
	}
	return c, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// parseConnectTimeout turns Connect-Timeout-Ms into a grpc-timeout.
func (c *bridgeCall) parseConnectTimeout(r *http.Request) error {
	v := r.Header.Get("Connect-Timeout-Ms")
	if v == "" {
		return nil
	}
	ms, err := strconv.ParseUint(v, 10, 64)
	if err != nil || len(v) > 10 {
		return fmt.Errorf("Connect-Timeout-Ms %q: not a positive integer of at most 10 digits", v)
	}
	c.timeout = grpcTimeout(time.Duration(ms) * time.Millisecond)
	return nil
}

// grpcTimeout encodes d as a grpc-timeout value (at most 8 digits).
func grpcTimeout(d time.Duration) string {
	if d <= 0 {
		return "0n"
	}
	for _, u := range []struct {
		unit string
		d    time.Duration
	}{{"m", time.Millisecond}, {"S", time.Second}, {"M", time.Minute}, {"H", time.Hour}} {
		if n := (d + u.d - 1) / u.d; n <= 99999999 {
			return strconv.FormatInt(int64(n), 10) + u.unit
		}
	}
	return "99999999H"
}

// bridgeDropRequest are the caller's headers that do not become gRPC
// metadata: the caller's protocol's own, and transport headers.
var bridgeDropRequest = map[string]bool{
	"Content-Type": true, "Content-Length": true, "Content-Encoding": true, "Accept-Encoding": true,
	"Connect-Protocol-Version": true, "Connect-Timeout-Ms": true, "Connect-Content-Encoding": true, "Connect-Accept-Encoding": true,
	"Grpc-Timeout": true, "Grpc-Encoding": true, "Grpc-Accept-Encoding": true, "X-Grpc-Web": true,
	"Te": true, "Connection": true, "Keep-Alive": true, "Transfer-Encoding": true, "Upgrade": true, "Trailer": true,
	"Http2-Settings": true, "Proxy-Connection": true,
}

// bridgeContentTypes are the content types of the protocols and codecs
// the bridge serves.
var bridgeContentTypes = []string{
	"application/proto", "application/json", "application/connect+proto", "application/connect+json",
	"application/grpc-web+proto", "application/grpc-web+json", "application/grpc-web-text+proto", "application/grpc-web-text+json",
}

// bridgePlainError answers a request that is no call: an HTTP status and
// a message in plain text (a Connect client maps the status to a code).
func bridgePlainError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = io.WriteString(w, msg+"\n")
}

// ServeHTTP bridges one call.
func (b *Bridge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	call, err := parseBridgeCall(r)
	switch {
	case errors.Is(err, errBadMethod):
		w.Header().Set("Allow", "GET, POST")
		bridgePlainError(w, http.StatusMethodNotAllowed, fmt.Sprintf("%s %s: %v", r.Method, r.URL.Path, err))
		return
	case errors.Is(err, errBadContentType):
		w.Header().Set("Accept-Post", strings.Join(bridgeContentTypes, ", "))
		bridgePlainError(w, http.StatusUnsupportedMediaType, fmt.Sprintf("POST %s with content type %q: %v: Connect (%s; GET with ?encoding=proto|json&message=…), gRPC-Web (%s) and gRPC (application/grpc, application/grpc+json)",
			r.URL.Path, r.Header.Get("Content-Type"), err, strings.Join(bridgeContentTypes[:4], ", "), strings.Join(bridgeContentTypes[4:], ", ")))
		return
	case err != nil:
		writeBridgeError(w, call, codes.InvalidArgument, err.Error())
		return
	}
	if call.get && !b.getAllowed(r.URL.Path) {
		// Without the method's schema the gateway cannot tell a method
		// that is safe to call by GET (a cross-site link makes one) from
		// one that changes something: Connect's answer for the latter.
		w.Header().Set("Allow", "POST")
		bridgePlainError(w, http.StatusMethodNotAllowed, fmt.Sprintf("GET %s: Connect GET is served for the methods a descriptor set marks free of side effects (routing.rules[].route.descriptor_set, idempotency_level NO_SIDE_EFFECTS); call it with POST", r.URL.Path))
		return
	}
	if b.proxy.Route(r.URL.Path) == nil && call.protocol == connectUnary {
		// Connect's answer for a procedure the server does not have.
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		m, _ := json.Marshal(connectError{Code: "unimplemented", Message: fmt.Sprintf("unknown method %s: no routing rule matches it", r.URL.Path)})
		_, _ = w.Write(m)
		return
	}
	body, err := b.requestBody(r, call)
	if err != nil {
		code := codes.InvalidArgument
		if errorsIsTooLarge(err) {
			code = codes.ResourceExhausted
		}
		writeBridgeError(w, call, code, err.Error())
		return
	}
	if call.protocol != connectUnary {
		// HTTP/1.1 callers of streams send while they read.
		_ = http.NewResponseController(w).EnableFullDuplex()
	}

	req := r.Clone(r.Context())
	req.Method = http.MethodPost
	req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2.0", 2, 0
	req.Header = make(http.Header, len(r.Header)+4)
	for k, v := range r.Header {
		if !bridgeDropRequest[k] {
			req.Header[k] = v
		}
	}
	req.Header.Set("Content-Type", "application/grpc+"+call.codec)
	req.Header.Set("Te", "trailers")
	if call.compression != "" && call.compression != "identity" {
		req.Header.Set("Grpc-Encoding", call.compression)
	}
	if call.acceptCompression != "" {
		req.Header.Set("Grpc-Accept-Encoding", call.acceptCompression)
	}
	if call.timeout != "" {
		req.Header.Set("Grpc-Timeout", call.timeout)
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	req = req.WithContext(ctx)
	req.Body, req.ContentLength = body, -1
	req.URL = &url.URL{Path: r.URL.Path}
	req.RequestURI = r.URL.Path

	bw := &bridgeWriter{w: w, call: call, cancel: cancel, maxUnary: int(b.maxMessageBytes) + 5}
	b.grpc.ServeHTTP(bw, req)
	bw.finish()
}

// getAllowed reports whether a Connect GET of method is served: its
// route's schema marks it free of side effects, as connect-go requires.
func (b *Bridge) getAllowed(method string) bool {
	s := b.proxy.Schema(method)
	if s == nil {
		return false
	}
	md := s.method(method)
	if md == nil || md.IsStreamingClient() || md.IsStreamingServer() {
		return false
	}
	opts, ok := md.Options().(*descriptorpb.MethodOptions)
	return ok && opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS
}

// errTooLarge is a Connect unary body over the limit.
type errTooLarge struct{ n, max int64 }

func (e errTooLarge) Error() string {
	return fmt.Sprintf("a request message of more than %d bytes: at most %d", e.n, e.max)
}

func errorsIsTooLarge(err error) bool { _, ok := err.(errTooLarge); return ok }

// requestBody is the gRPC request body of the call: the caller's envelopes
// as they are (Connect streaming, gRPC-Web), decoded from base64
// (gRPC-Web text), or the one message of a Connect unary call in an
// envelope.
func (b *Bridge) requestBody(r *http.Request, call bridgeCall) (io.ReadCloser, error) {
	switch call.protocol {
	case connectStream, grpcWeb:
		return r.Body, nil
	case grpcWebText:
		return struct {
			io.Reader
			io.Closer
		}{&base64Reader{r: r.Body}, r.Body}, nil
	}
	flags := byte(0)
	if call.compression != "" && call.compression != "identity" {
		flags = flagCompressed
	}
	env := make([]byte, 5)
	env[0] = flags
	if !call.get && r.ContentLength >= 0 {
		// The length is known: the body follows its envelope as it
		// comes, uncopied.
		if r.ContentLength > b.maxMessageBytes {
			return nil, errTooLarge{r.ContentLength, b.maxMessageBytes}
		}
		binary.BigEndian.PutUint32(env[1:], uint32(r.ContentLength))
		return struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(env), io.LimitReader(r.Body, r.ContentLength)), r.Body}, nil
	}
	var msg []byte
	if call.get {
		q := r.URL.Query()
		m := q.Get("message")
		if q.Get("base64") == "1" {
			var err error
			if msg, err = base64.RawURLEncoding.DecodeString(strings.TrimRight(m, "=")); err != nil {
				return nil, fmt.Errorf("query parameter message: not base64url: %v", err)
			}
		} else {
			msg = []byte(m)
		}
		if int64(len(msg)) > b.maxMessageBytes {
			return nil, errTooLarge{int64(len(msg)), b.maxMessageBytes}
		}
	} else {
		var err error
		msg, err = io.ReadAll(io.LimitReader(r.Body, b.maxMessageBytes+1))
		if err != nil {
			return nil, fmt.Errorf("read the request: %v", err)
		}
		if int64(len(msg)) > b.maxMessageBytes {
			return nil, errTooLarge{int64(len(msg)), b.maxMessageBytes}
		}
	}
	binary.BigEndian.PutUint32(env[1:], uint32(len(msg)))
	return io.NopCloser(io.MultiReader(bytes.NewReader(env), bytes.NewReader(msg))), nil
}

// base64Reader decodes gRPC-Web text: base64 in which every chunk may
// end with its own padding.
type base64Reader struct {
	r   io.Reader
	in  []byte
	out []byte
	err error
}

func (d *base64Reader) Read(p []byte) (int, error) {
	for len(d.out) == 0 {
		if d.err != nil {
			if d.err == io.EOF && len(d.in) > 0 {
				return 0, fmt.Errorf("grpc-web-text: %d bytes of base64 left over", len(d.in))
			}
			return 0, d.err
		}
		buf := make([]byte, 4096)
		n, err := d.r.Read(buf)
		for _, c := range buf[:n] {
			if c != '\r' && c != '\n' {
				d.in = append(d.in, c)
			}
		}
		d.err = err
		for len(d.in) >= 4 {
			n := len(d.in) - len(d.in)%4
			if i := bytes.IndexByte(d.in[:n], '='); i >= 0 {
				n = (i/4 + 1) * 4
			}
			dec := make([]byte, base64.StdEncoding.DecodedLen(n))
			m, err := base64.StdEncoding.Decode(dec, d.in[:n])
			if err != nil {
				d.err = fmt.Errorf("grpc-web-text: not base64: %v", err)
				break
			}
			d.out = append(d.out, dec[:m]...)
			d.in = d.in[n:]
		}
	}
	n := copy(p, d.out)
	d.out = d.out[n:]
	return n, nil
}

// bridgeWriter is the http.ResponseWriter the gRPC server answers into: it
// answers the caller in its own protocol. grpc-go writes (from one
// goroutine) the header when the handler sends it (WriteHeader), each
// message as a 5-byte prefix and the message, flushing after each, and at
// the end the status and trailers in the header map (the trailers under
// http.TrailerPrefix), after a Flush.
type bridgeWriter struct {
	w    http.ResponseWriter
	call bridgeCall
	h    http.Header
	// committed: the gRPC header was sent (the caller's header with it,
	// for streams); inHeader the keys it had then.
	committed bool
	inHeader  map[string]bool
	// pending holds the bytes of gRPC-Web text written since the last
	// flush (encoded at the flush); unary the one message of a Connect
	// unary answer, with its envelope. The binary streams' bytes go
	// straight to the caller.
	pending []byte
	unary   []byte
	// maxUnary bounds unary; past it (the backend streams, or answers
	// more than a message may be) the call is cancelled and overflow set.
	maxUnary int
	overflow bool
	cancel   context.CancelFunc
	// httpStatus is an HTTP error grpc-go answered instead of a call
	// (a header it refused), with its text in httpText.
	httpStatus int
	httpText   []byte
}

func (bw *bridgeWriter) Header() http.Header {
	if bw.h == nil {
		bw.h = make(http.Header)
	}
	return bw.h
}

// WriteHeader: grpc-go sends the gRPC header (200), or, before a call
// starts, an HTTP error for a request it refuses (http.Error).
func (bw *bridgeWriter) WriteHeader(code int) {
	if code != http.StatusOK && !bw.committed {
		bw.httpStatus = code
		return
	}
	bw.commit()
}

func (bw *bridgeWriter) Write(p []byte) (int, error) {
	if bw.httpStatus != 0 {
		bw.httpText = append(bw.httpText, p[:min(len(p), 1024-len(bw.httpText))]...)
		return len(p), nil
	}
	bw.commit()
	switch bw.call.protocol {
	case connectUnary:
		if bw.overflow {
			return len(p), nil
		}
		if len(bw.unary)+len(p) > bw.maxUnary {
			bw.overflow, bw.unary = true, nil
			if bw.cancel != nil {
				bw.cancel()
			}
			return len(p), nil
		}
		bw.unary = append(bw.unary, p...)
		return len(p), nil
	case grpcWebText:
		bw.pending = append(bw.pending, p...)
		return len(p), nil
	}
	return bw.w.Write(p)
}

// Flush sends what was written. A flush before any header or message is
// grpc-go ending a call that answered nothing (trailers only): the
// caller's header waits for finish, as does all of a Connect unary
// answer.
func (bw *bridgeWriter) Flush() {
	if !bw.committed || bw.call.protocol == connectUnary || bw.httpStatus != 0 {
		return
	}
	if len(bw.pending) > 0 {
		_, _ = io.WriteString(bw.w, base64.StdEncoding.EncodeToString(bw.pending))
		bw.pending = bw.pending[:0]
	}
	if f, ok := bw.w.(http.Flusher); ok {
		f.Flush()
	}
}

// commit sends the caller the header of a stream (Connect streaming,
// gRPC-Web) when gRPC's comes; a Connect unary answer waits for the end.
func (bw *bridgeWriter) commit() {
	if bw.committed {
		return
	}
	bw.committed = true
	h := bw.Header()
	bw.inHeader = make(map[string]bool, len(h))
	for k := range h {
		bw.inHeader[k] = true
	}
	if bw.call.protocol == connectUnary {
		return
	}
	out := bw.w.Header()
	copyResponseHeaders(out, h)
	out.Set("Content-Type", bw.call.contentType)
	if enc := h.Get("Grpc-Encoding"); enc != "" {
		if bw.call.protocol == connectStream {
			out.Set("Connect-Content-Encoding", enc)
		} else {
			out.Set("Grpc-Encoding", enc)
		}
	}
	bw.w.WriteHeader(http.StatusOK)
}

// copyResponseHeaders copies a gRPC answer's metadata headers.
func copyResponseHeaders(dst, src http.Header) {
	for k, v := range src {
		switch k {
		case "Content-Type", "Trailer", "Grpc-Encoding", "Grpc-Accept-Encoding", "Date", "Content-Length",
			"Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin":
			continue
		}
		if strings.HasPrefix(k, http.TrailerPrefix) {
			continue
		}
		dst[k] = v
	}
}

// status is the call's gRPC status and trailers, from the header map at
// the end.
func (bw *bridgeWriter) status() (code codes.Code, msg string, details []byte, trailers http.Header) {
	h := bw.Header()
	code = codes.Unknown
	if v := h.Get("Grpc-Status"); v != "" {
		if n, err := strconv.ParseUint(v, 10, 32); err == nil {
			code = codes.Code(n)
		}
	} else {
		msg = "the gRPC server ended the call without a status"
		code = codes.Internal
	}
	if m := h.Get("Grpc-Message"); m != "" {
		if d, err := url.PathUnescape(m); err == nil {
			msg = d
		} else {
			msg = m
		}
	}
	if d := h.Get("Grpc-Status-Details-Bin"); d != "" {
		details, _ = decodeBinHeader(d)
	}
	trailers = make(http.Header)
	for k, v := range h {
		if t, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			trailers[textproto.CanonicalMIMEHeaderKey(t)] = v
		} else if !bw.inHeader[k] && bw.committed {
			switch k {
			case "Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin":
			default:
				trailers[k] = v
			}
		}
	}
	return code, msg, details, trailers
}

func decodeBinHeader(v string) ([]byte, error) {
	if len(v)%4 == 0 {
		return base64.StdEncoding.DecodeString(v)
	}
	return base64.RawStdEncoding.DecodeString(v)
}

// finish answers the end of the call in the caller's protocol.
func (bw *bridgeWriter) finish() {
	if bw.httpStatus != 0 {
		code := codes.Internal
		if bw.httpStatus == http.StatusBadRequest {
			code = codes.InvalidArgument
		}
		h := bw.Header()
		clear(h)
		h.Set("Grpc-Status", strconv.Itoa(int(code)))
		h.Set("Grpc-Message", encodeGRPCMessage(strings.TrimSpace(string(bw.httpText))))
		bw.httpStatus = 0
	}
	if bw.overflow {
		h := bw.Header()
		h.Set("Grpc-Status", strconv.Itoa(int(codes.Unimplemented)))
		h.Set("Grpc-Message", encodeGRPCMessage(fmt.Sprintf("the backend answered a unary call with more than %d bytes (is the method a stream? call it with application/connect+proto|json)", bw.maxUnary-5)))
	}
	code, msg, details, trailers := bw.status()
	switch bw.call.protocol {
	case connectUnary:
		bw.finishConnectUnary(code, msg, details, trailers)
	case connectStream:
		if !bw.committed {
			bw.commit()
		}
		bw.Flush()
		end := connectEndStream{Metadata: map[string][]string{}}
		for k, v := range trailers {
			end.Metadata[k] = v
		}
		if code != codes.OK {
			end.Error = connectErrorOf(code, msg, details)
		}
		b, _ := json.Marshal(end)
		bw.writeEnvelope(flagConnectEnd, b)
	default: // gRPC-Web
		var block bytes.Buffer
		fmt.Fprintf(&block, "grpc-status: %d\r\n", code)
		if msg != "" {
			fmt.Fprintf(&block, "grpc-message: %s\r\n", encodeGRPCMessage(msg))
		}
		if len(details) > 0 {
			fmt.Fprintf(&block, "grpc-status-details-bin: %s\r\n", base64.RawStdEncoding.EncodeToString(details))
		}
		for k, vs := range trailers {
			for _, v := range vs {
				fmt.Fprintf(&block, "%s: %s\r\n", strings.ToLower(k), v)
			}
		}
		if !bw.committed {
			// Trailers only: the status in the header, no body.
			out := bw.w.Header()
			copyResponseHeaders(out, bw.Header())
			out.Set("Content-Type", bw.call.contentType)
			out.Set("Grpc-Status", strconv.Itoa(int(code)))
			if msg != "" {
				out.Set("Grpc-Message", encodeGRPCMessage(msg))
			}
			if len(details) > 0 {
				out.Set("Grpc-Status-Details-Bin", base64.RawStdEncoding.EncodeToString(details))
			}
			for k, v := range trailers {
				out[k] = v
			}
			bw.w.WriteHeader(http.StatusOK)
			return
		}
		bw.Flush()
		bw.writeEnvelope(flagGRPCWebTrailers, block.Bytes())
	}
}

// writeEnvelope writes one enveloped message to the caller.
func (bw *bridgeWriter) writeEnvelope(flags byte, b []byte) {
	env := make([]byte, 5, 5+len(b))
	env[0] = flags
	binary.BigEndian.PutUint32(env[1:], uint32(len(b)))
	out := append(env, b...)
	if bw.call.protocol == grpcWebText {
		out = []byte(base64.StdEncoding.EncodeToString(out))
	}
	_, _ = bw.w.Write(out)
}

// finishConnectUnary answers a Connect unary call: the message as the
// body, or the error as JSON with its HTTP status; the gRPC trailers as
// Trailer- headers.
func (bw *bridgeWriter) finishConnectUnary(code codes.Code, msg string, details []byte, trailers http.Header) {
	out := bw.w.Header()
	copyResponseHeaders(out, bw.Header())
	for k, v := range trailers {
		out["Trailer-"+k] = v
	}
	var body []byte
	if code == codes.OK {
		switch b := bw.unary; {
		case len(b) < 5 || len(b) != 5+int(binary.BigEndian.Uint32(b[1:5])):
			code, msg = codes.Unimplemented, "the backend answered a unary call with no message or more than one (is the method a stream?)"
		default:
			body = b[5:]
			if b[0]&flagCompressed != 0 {
				out.Set("Content-Encoding", bw.Header().Get("Grpc-Encoding"))
			}
		}
	}
	if code != codes.OK {
		out.Del("Content-Encoding")
		out.Set("Content-Type", "application/json")
		b, _ := json.Marshal(connectErrorOf(code, msg, details))
		out.Set("Content-Length", strconv.Itoa(len(b)))
		bw.w.WriteHeader(connectHTTPStatus(code))
		_, _ = bw.w.Write(b)
		return
	}
	out.Set("Content-Type", bw.call.contentType)
	out.Set("Content-Length", strconv.Itoa(len(body)))
	bw.w.WriteHeader(http.StatusOK)
	_, _ = bw.w.Write(body)
}

// connectError is the JSON of a Connect error.
type connectError struct {
	Code    string          `json:"code"`
	Message string          `json:"message,omitempty"`
	Details []connectDetail `json:"details,omitempty"`
}

type connectDetail struct {
	Type  string `json:"type"`
	Value string `json:"value"`
}

type connectEndStream struct {
	Error    *connectError       `json:"error,omitempty"`
	Metadata map[string][]string `json:"metadata,omitempty"`
}

// connectErrorOf is the Connect error of a gRPC status; details is the
// google.rpc.Status of grpc-status-details-bin, whose details are the
// error's.
func connectErrorOf(code codes.Code, msg string, details []byte) *connectError {
	e := &connectError{Code: connectCodeName(code), Message: msg}
	if len(details) > 0 {
		var st spb.Status
		if proto.Unmarshal(details, &st) == nil {
			for _, d := range st.GetDetails() {
				t := d.GetTypeUrl()
				if i := strings.LastIndexByte(t, '/'); i >= 0 {
					t = t[i+1:]
				}
				e.Details = append(e.Details, connectDetail{Type: t, Value: base64.RawStdEncoding.EncodeToString(d.GetValue())})
			}
		}
	}
	return e
}

// connectCodeName is a code's name in Connect ("invalid_argument").
func connectCodeName(c codes.Code) string {
	switch c {
	case codes.Canceled:
		return "canceled"
	case codes.Unknown:
		return "unknown"
	case codes.InvalidArgument:
		return "invalid_argument"
	case codes.DeadlineExceeded:
		return "deadline_exceeded"
	case codes.NotFound:
		return "not_found"
	case codes.AlreadyExists:
		return "already_exists"
	case codes.PermissionDenied:
		return "permission_denied"
	case codes.ResourceExhausted:
		return "resource_exhausted"
	case codes.FailedPrecondition:
		return "failed_precondition"
	case codes.Aborted:
		return "aborted"
	case codes.OutOfRange:
		return "out_of_range"
	case codes.Unimplemented:
		return "unimplemented"
	case codes.Internal:
		return "internal"
	case codes.Unavailable:
		return "unavailable"
	case codes.DataLoss:
		return "data_loss"
	case codes.Unauthenticated:
		return "unauthenticated"
	}
	return "unknown"
}

// connectHTTPStatus is the HTTP status of a Connect unary error.
func connectHTTPStatus(c codes.Code) int {
	switch c {
	case codes.Canceled:
		return 499
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	}
	return http.StatusInternalServerError
}

// encodeGRPCMessage percent-encodes a grpc-message value.
func encodeGRPCMessage(m string) string {
	var b strings.Builder
	for i := 0; i < len(m); i++ {
		c := m[i]
		if c >= 0x20 && c <= 0x7e && c != '%' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// writeBridgeError answers a call the bridge could not make, in the
// caller's protocol.
func writeBridgeError(w http.ResponseWriter, call bridgeCall, code codes.Code, msg string) {
	bw := &bridgeWriter{w: w, call: call}
	if call.contentType == "" {
		bw.call.protocol = connectUnary
	}
	h := bw.Header()
	h.Set("Grpc-Status", strconv.Itoa(int(code)))
	h.Set("Grpc-Message", encodeGRPCMessage(msg))
	bw.finish()
}
