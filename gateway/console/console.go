// Package console serves a VM's serial console to browsers: a WebSocket on
// the API port, bridged to the VM API's bidirectional Console stream,
// which a browser cannot open itself (fetch has no full-duplex streams).
//
// The WebSocket is a caller of the API port's gRPC server like any other:
// the bridge makes the Console call in process, with the caller's
// credentials and connection, through the same access control (the
// caller authenticated from its headers first, then RBAC with the
// console verb and its conditions on the VM, rate limits and stream
// bounds by the gRPC server's interceptors), and routed like any call to
// the node whose backend has the VM. Everything is checked before the
// upgrade: the origin, the credentials, the policy, and that the console
// opens (its first answer arrived); a refusal is an HTTP error with a
// Connect error as JSON. A GET without an Upgrade header runs the same
// checks and answers 426 where the console would open: a browser cannot
// read a refused WebSocket handshake, so a page asks that way why.
//
// DESIGN.md has the protocol on the WebSocket.
package console

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

const (
	// Path is the WebSocket's path on the API port.
	Path = "/ws" + method
	// Subprotocol is the protocol of the WebSocket, which a client must
	// offer (and the server selects).
	Subprotocol = "pivirt.console.v1"
	// BearerPrefix starts the subprotocol that carries a bearer token
	// (base64url, unpadded): a browser cannot set the Authorization
	// header of a WebSocket.
	BearerPrefix = "bearer."

	method = "/pivirt.vm.v1.VMService/Console"
	// MaxInput is the most bytes one frame of keystrokes may carry (the
	// VM API's limit of one console message).
	MaxInput = 64 << 10
	// maxOutput bounds one console message from the backend.
	maxOutput = 4 << 20
	// maxTermSize bounds a window dimension.
	maxTermSize = 10000
	// openTimeout bounds the wait for the console's first answer.
	openTimeout = 30 * time.Second
)

// Close codes past the standard ones: 4000 + the gRPC code of a call
// that failed after the console opened (4016: the token expired).
const closeCodeBase = 4000

// Handler serves Path.
type Handler struct {
	// GRPC is the API port's gRPC server (its ServeHTTP), whose
	// interceptors apply access control and whose proxy routes the call.
	GRPC http.Handler
	// Authenticate authenticates a call from its headers and connection
	// before anything is read (the guard's Authenticated), or is nil
	// where access control is off.
	Authenticate func(http.Handler) http.Handler
	// Origins are the origins besides the agent's own whose pages may
	// open a console (server.ui.connect_origins, read per request).
	Origins func() []string
	// Stopping ends every session (close 1001) when it is closed.
	Stopping <-chan struct{}
	// PingInterval is how often the bridge pings the client (30 s when
	// zero): a session idle for hours keeps its connection through
	// proxies and NATs, and a client that went away is noticed.
	PingInterval time.Duration
	Logger       *slog.Logger
}

// apiError is a Connect error, as JSON.
type apiError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeError(w http.ResponseWriter, code connect.Code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(httpStatus(code))
	_ = json.NewEncoder(w).Encode(apiError{Code: code.String(), Message: msg})
}

// httpStatus is Connect's HTTP status of an error code.
func httpStatus(c connect.Code) int {
	switch c {
	case connect.CodeCanceled:
		return 499
	case connect.CodeInvalidArgument, connect.CodeFailedPrecondition, connect.CodeOutOfRange:
		return http.StatusBadRequest
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeAborted:
		return http.StatusConflict
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnimplemented:
		return http.StatusNotImplemented
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	default:
		return http.StatusInternalServerError
	}
}

// ServeHTTP checks the request's form and origin, takes a bearer token
// from the subprotocols, and has the call authenticated.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if origin := r.Header.Get("Origin"); origin != "" && !h.originAllowed(origin, r) {
		writeError(w, connect.CodePermissionDenied, fmt.Sprintf("origin %s may not open a console here: only pages of the agent's own origin and of server.ui.connect_origins may", origin))
		return
	}
	upgrade := headerHas(r.Header, "Connection", "upgrade") && headerHas(r.Header, "Upgrade", "websocket")
	offered := false
	for _, p := range headerList(r.Header, "Sec-WebSocket-Protocol") {
		switch {
		case p == Subprotocol:
			offered = true
		case strings.HasPrefix(p, BearerPrefix):
			tok, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(strings.TrimPrefix(p, BearerPrefix), "="))
			if err != nil || len(tok) == 0 {
				writeError(w, connect.CodeUnauthenticated, "the subprotocol "+BearerPrefix+"… holds no token: it is "+BearerPrefix+" and the token in base64url")
				return
			}
			if r.Header.Get("Authorization") == "" {
				r.Header.Set("Authorization", "Bearer "+string(tok))
			}
		}
	}
	if upgrade && !offered {
		writeError(w, connect.CodeInvalidArgument, "offer the WebSocket subprotocol "+Subprotocol)
		return
	}
	q := r.URL.Query()
	id := q.Get("id")
	if id == "" {
		writeError(w, connect.CodeInvalidArgument, "query parameter id: the VM's ID is required ("+Path+"?id=<vm>)")
		return
	}
	size, err := parseSize(q.Get("cols"), q.Get("rows"))
	if err != nil {
		writeError(w, connect.CodeInvalidArgument, err.Error())
		return
	}
	s := &session{h: h, id: id, size: size, upgrade: upgrade}
	// The call is the Console method's, for access control.
	r2 := r.Clone(r.Context())
	r2.URL = &url.URL{Path: method}
	var next http.Handler = http.HandlerFunc(s.serve)
	if h.Authenticate != nil {
		next = h.Authenticate(next)
	}
	next.ServeHTTP(w, r2)
}

// originAllowed: the agent's own origin, or one of Origins.
func (h *Handler) originAllowed(origin string, r *http.Request) bool {
	// The page's own origin: this host and port (which serve one scheme).
	if u, err := url.Parse(origin); err == nil && (u.Scheme == "https" || u.Scheme == "http") && strings.EqualFold(u.Host, r.Host) {
		return true
	}
	if h.Origins != nil {
		for _, o := range h.Origins() {
			if strings.EqualFold(strings.TrimRight(o, "/"), origin) {
				return true
			}
		}
	}
	return false
}

func parseSize(cols, rows string) (*vmv1.ConsoleSize, error) {
	if cols == "" && rows == "" {
		return nil, nil
	}
	c, err1 := strconv.ParseUint(cols, 10, 32)
	r, err2 := strconv.ParseUint(rows, 10, 32)
	if err1 != nil || err2 != nil || c < 1 || r < 1 || c > maxTermSize || r > maxTermSize {
		return nil, fmt.Errorf("query parameters cols=%q and rows=%q: both, each 1 to %d", cols, rows, maxTermSize)
	}
	return &vmv1.ConsoleSize{Cols: uint32(c), Rows: uint32(r)}, nil
}

// headerList is the comma-separated values of a header, trimmed.
func headerList(h http.Header, key string) []string {
	var out []string
	for _, v := range h.Values(key) {
		for _, p := range strings.Split(v, ",") {
			if p = strings.TrimSpace(p); p != "" {
				out = append(out, p)
			}
		}
	}
	return out
}

func headerHas(h http.Header, key, token string) bool {
	for _, p := range headerList(h, key) {
		if strings.EqualFold(p, token) {
			return true
		}
	}
	return false
}

// session is one console.
type session struct {
	h       *Handler
	id      string
	size    *vmv1.ConsoleSize
	upgrade bool
}

// dropHeaders are the browser's and the WebSocket's headers that do not
// become the call's metadata.
var dropHeaders = map[string]bool{
	"Connection": true, "Upgrade": true, "Sec-Websocket-Key": true, "Sec-Websocket-Version": true,
	"Sec-Websocket-Protocol": true, "Sec-Websocket-Extensions": true, "Origin": true, "Cookie": true,
	"Content-Length": true, "Content-Type": true, "Te": true, "Keep-Alive": true, "Transfer-Encoding": true,
	"Accept-Encoding": true, "Grpc-Timeout": true,
}

// serve opens the console, answers a refusal, and upgrades.
func (s *session) serve(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	call := s.start(ctx, r)
	defer call.stop()

	var first []byte
	select {
	case m, ok := <-call.msgs:
		if !ok { // the call ended without an answer
			<-call.done
			if code, msg := call.status(); code != codes.OK {
				writeError(w, connect.Code(code), msg)
			} else {
				writeError(w, connect.CodeUnavailable, "the console of "+s.id+" closed as it opened")
			}
			return
		}
		first = m
	case <-time.After(openTimeout):
		writeError(w, connect.CodeDeadlineExceeded, fmt.Sprintf("the console of %s did not open within %s", s.id, openTimeout))
		return
	case <-ctx.Done():
		return
	}
	if !s.upgrade {
		w.Header().Set("Upgrade", "websocket")
		writeErrorStatus(w, http.StatusUpgradeRequired, apiError{Code: "ok", Message: "the console of " + s.id + " opens: connect with a WebSocket (Upgrade: websocket, subprotocol " + Subprotocol + ")"})
		return
	}
	conn, err := websocket.Accept(w, r, &websocket.AcceptOptions{
		Subprotocols: []string{Subprotocol},
		// The origin was checked against the agent's own and
		// server.ui.connect_origins.
		InsecureSkipVerify: true,
		CompressionMode:    websocket.CompressionDisabled,
	})
	if err != nil {
		return // Accept answered the client
	}
	conn.SetReadLimit(MaxInput)
	s.pump(ctx, cancel, conn, call, first)
}

func writeErrorStatus(w http.ResponseWriter, status int, e apiError) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(e)
}

// pump carries keystrokes and resizes to the call and output to the
// client until either side ends.
func (s *session) pump(ctx context.Context, cancel context.CancelFunc, conn *websocket.Conn, call *grpcCall, first []byte) {
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	// Client to console.
	wg.Go(func() {
		defer call.closeSend()
		for {
			typ, data, err := conn.Read(ctx)
			if err != nil {
				return // closed by the client, or by us
			}
			req := &vmv1.ConsoleRequest{}
			if typ == websocket.MessageBinary {
				req.Input = data
			} else {
				var m struct {
					Resize *struct {
						Cols uint32 `json:"cols"`
						Rows uint32 `json:"rows"`
					} `json:"resize"`
				}
				if err := json.Unmarshal(data, &m); err != nil || m.Resize == nil ||
					m.Resize.Cols < 1 || m.Resize.Rows < 1 || m.Resize.Cols > maxTermSize || m.Resize.Rows > maxTermSize {
					_ = conn.Close(websocket.StatusPolicyViolation, fmt.Sprintf(`a text frame is {"resize":{"cols":N,"rows":M}}, each 1 to %d`, maxTermSize))
					cancel()
					return
				}
				req.Size = &vmv1.ConsoleSize{Cols: m.Resize.Cols, Rows: m.Resize.Rows}
			}
			if !call.send(ctx, req) {
				return
			}
		}
	})
	// Keepalive.
	wg.Go(func() {
		every := cmpDuration(s.h.PingInterval, 30*time.Second)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				pctx, pcancel := context.WithTimeout(ctx, every)
				err := conn.Ping(pctx)
				pcancel()
				if err != nil {
					cancel()
					return
				}
			}
		}
	})
	// Console to client.
	send := func(raw []byte) error {
		var resp vmv1.ConsoleResponse
		if err := proto.Unmarshal(raw, &resp); err != nil {
			return err
		}
		if len(resp.GetOutput()) > 0 {
			if err := conn.Write(ctx, websocket.MessageBinary, resp.GetOutput()); err != nil {
				return err
			}
		}
		if c := resp.GetClosed(); c != nil {
			b, _ := json.Marshal(map[string]any{"closed": map[string]any{"reason": c.GetReason(), "exitStatus": c.GetExitStatus()}})
			return conn.Write(ctx, websocket.MessageText, b)
		}
		return nil
	}
	if err := send(first); err != nil {
		_ = conn.CloseNow()
		return
	}
	for {
		select {
		case raw, ok := <-call.msgs:
			if !ok {
				s.end(ctx, conn, call)
				return
			}
			if err := send(raw); err != nil {
				_ = conn.CloseNow()
				return
			}
		case <-s.h.Stopping:
			_ = conn.Close(websocket.StatusGoingAway, "the agent is stopping")
			return
		case <-ctx.Done():
			_ = conn.CloseNow()
			return
		}
	}
}

// end closes the WebSocket as the call ended: normally, or with an error
// frame and a close code of 4000 + its gRPC code.
func (s *session) end(ctx context.Context, conn *websocket.Conn, call *grpcCall) {
	<-call.done
	code, msg := call.status()
	if code == codes.OK {
		_ = conn.Close(websocket.StatusNormalClosure, "")
		return
	}
	b, _ := json.Marshal(map[string]apiError{"error": {Code: connect.Code(code).String(), Message: msg}})
	_ = conn.Write(ctx, websocket.MessageText, b)
	reason := msg
	if len(reason) > 120 { // a close frame's reason is at most 123 bytes
		reason = reason[:120]
	}
	_ = conn.Close(websocket.StatusCode(closeCodeBase+int(code)), reason)
}

func cmpDuration(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// grpcCall is the Console call made in process on the gRPC server.
type grpcCall struct {
	body *io.PipeWriter
	mu   sync.Mutex // serializes writes of body
	// msgs are the response messages (closed at the end); done is
	// closed when the call ended, with its status in header.
	msgs chan []byte
	done chan struct{}
	w    *responseWriter
	stop func()
}

// start makes the call with the request's credentials and connection
// and sends the first request (the VM and the window size).
func (s *session) start(ctx context.Context, r *http.Request) *grpcCall {
	pr, pw := io.Pipe()
	req := r.Clone(ctx)
	req.Method = http.MethodPost
	req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/2.0", 2, 0
	req.Header = make(http.Header, len(r.Header)+2)
	for k, v := range r.Header {
		if !dropHeaders[textproto.CanonicalMIMEHeaderKey(k)] {
			req.Header[k] = v
		}
	}
	req.Header.Set("Content-Type", "application/grpc+proto")
	req.Header.Set("Te", "trailers")
	req.Body, req.ContentLength = pr, -1
	req.URL = &url.URL{Path: method}
	req.RequestURI = method
	c := &grpcCall{body: pw, msgs: make(chan []byte, 16), done: make(chan struct{})}
	c.w = &responseWriter{h: make(http.Header), msgs: c.msgs, ctx: ctx}
	go func() {
		defer close(c.done)
		s.h.GRPC.ServeHTTP(c.w, req)
		c.w.finish()
		_ = pr.CloseWithError(errEnded)
	}()
	c.stop = func() { _ = pw.CloseWithError(errEnded) }
	go c.send(ctx, &vmv1.ConsoleRequest{Id: s.id, Size: s.size})
	return c
}

var errEnded = errors.New("the console ended")

// send writes one request message; false once the call no longer reads.
func (c *grpcCall) send(_ context.Context, req *vmv1.ConsoleRequest) bool {
	b, err := proto.Marshal(req)
	if err != nil {
		return false
	}
	env := make([]byte, 5, 5+len(b))
	binary.BigEndian.PutUint32(env[1:], uint32(len(b)))
	c.mu.Lock()
	defer c.mu.Unlock()
	_, err = c.body.Write(append(env, b...))
	return err == nil
}

// closeSend ends the request stream (the client closed its side).
func (c *grpcCall) closeSend() {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.body.Close()
}

// status is the call's gRPC status, once done.
func (c *grpcCall) status() (codes.Code, string) {
	get := func(k string) string {
		if v := c.w.h.Get(k); v != "" {
			return v
		}
		return c.w.h.Get(http.TrailerPrefix + k)
	}
	if c.w.httpStatus != 0 {
		return codes.Unavailable, fmt.Sprintf("the console call was refused with HTTP %d: %s", c.w.httpStatus, strings.TrimSpace(string(c.w.httpText)))
	}
	if c.w.overflow {
		return codes.ResourceExhausted, fmt.Sprintf("a console message of more than %d bytes", maxOutput)
	}
	n, err := strconv.Atoi(get("Grpc-Status"))
	if err != nil {
		return codes.Unknown, "the console call ended without a status"
	}
	msg, _ := url.PathUnescape(get("Grpc-Message"))
	return codes.Code(n), msg
}

// responseWriter takes the gRPC server's answer: it cuts the body into
// messages (a 5-byte envelope and the message) and keeps the header and
// trailers, where the status is.
type responseWriter struct {
	ctx        context.Context // the session's: its end stops a blocked Write
	h          http.Header
	buf        []byte
	msgs       chan []byte
	overflow   bool
	httpStatus int
	httpText   []byte
	wroteOK    bool
}

func (w *responseWriter) Header() http.Header { return w.h }

func (w *responseWriter) WriteHeader(code int) {
	if code != http.StatusOK && !w.wroteOK {
		w.httpStatus = code
		return
	}
	w.wroteOK = true
}

func (w *responseWriter) Write(p []byte) (int, error) {
	if w.httpStatus != 0 {
		w.httpText = append(w.httpText, p[:min(len(p), 512-len(w.httpText))]...)
		return len(p), nil
	}
	w.wroteOK = true
	if w.overflow {
		return 0, errEnded
	}
	w.buf = append(w.buf, p...)
	for len(w.buf) >= 5 {
		n := int(binary.BigEndian.Uint32(w.buf[1:5]))
		if n > maxOutput {
			w.overflow = true
			return 0, errEnded
		}
		if len(w.buf) < 5+n {
			break
		}
		select {
		case w.msgs <- append([]byte(nil), w.buf[5:5+n]...):
		case <-w.ctx.Done():
			return 0, w.ctx.Err()
		}
		w.buf = w.buf[5+n:]
	}
	return len(p), nil
}

func (w *responseWriter) Flush() {}

// finish: no more messages.
func (w *responseWriter) finish() { close(w.msgs) }
