package gateway

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/soheilhy/cmux"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// ProtocolMux splits one listener by protocol: connections whose first
// HTTP/2 request is gRPC go to GRPC, served by grpc-go, and everything else
// (Connect over HTTP/1.1 or HTTP/2, gRPC-Web, plain HTTP) goes to HTTP,
// served by net/http. grpc-go's transport costs about a third of the CPU of
// net/http's HTTP/2 server per unary call, so gRPC clients, the agents'
// own included, take the cheaper path; Connect clients keep working.
//
// The split happens once per connection: every later stream on it goes to
// the same server, which is how gRPC and Connect clients use connections.
// The split is a fast path, not what decides the protocol: a connection
// whose first request did not come within the read timeout (a client that
// connected, then waited) goes to HTTP, whose handler must serve the gRPC
// requests that come on it later (SplitGRPC), so every request is served
// by its own protocol whatever the connection did first.
type ProtocolMux struct {
	m cmux.CMux
	// GRPC accepts the gRPC connections.
	GRPC net.Listener
	// HTTP accepts every other connection.
	HTTP net.Listener
}

// NewProtocolMux wraps ln. A connection must show its first request
// within readTimeout, or it is closed. Serve must run for either listener
// to accept anything; closing either listener closes ln.
func NewProtocolMux(ln net.Listener, readTimeout time.Duration) *ProtocolMux {
	t := &sniffTracker{Listener: ln, conns: make(map[*trackedConn]struct{})}
	m := cmux.New(t)
	m.SetReadTimeout(readTimeout)
	m.HandleError(handleAcceptError)
	g := m.MatchWithWriters(matchGRPC)
	h := m.Match(cmux.Any())
	return &ProtocolMux{m: m, GRPC: handoff{g, t}, HTTP: settingsAckListener{handoff{h, t}}}
}

// handleAcceptError keeps the mux serving: a connection the classifier
// could not read (closed, timed out) is the client's problem, and a
// temporary accept error (out of file descriptors) gets a pause, as
// net/http's server does, instead of a spin. Anything else stops Serve.
func handleAcceptError(err error) bool {
	var nm cmux.ErrNotMatched
	if errors.As(err, &nm) {
		return true
	}
	var te interface{ Temporary() bool }
	if errors.As(err, &te) && te.Temporary() {
		time.Sleep(50 * time.Millisecond)
		return true
	}
	return false
}

// sniffTracker is the mux's root listener. It remembers the connections
// accepted and not yet handed to a server, so that closing the listener
// also ends their classification: cmux's Serve waits for every classifier,
// which would otherwise sit in a read until the read timeout.
type sniffTracker struct {
	net.Listener
	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
	closed bool
}

type trackedConn struct {
	net.Conn
	t *sniffTracker
}

func (c *trackedConn) Close() error {
	c.t.forget(c)
	return c.Conn.Close()
}

func (t *sniffTracker) Accept() (net.Conn, error) {
	c, err := t.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, t: t}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		_ = c.Close()
		return nil, net.ErrClosed
	}
	t.conns[tc] = struct{}{}
	return tc, nil
}

func (t *sniffTracker) forget(c *trackedConn) {
	t.mu.Lock()
	delete(t.conns, c)
	t.mu.Unlock()
}

// Close closes the listener and every connection still being classified.
func (t *sniffTracker) Close() error {
	err := t.Listener.Close()
	t.mu.Lock()
	conns := t.conns
	t.conns, t.closed = nil, true
	t.mu.Unlock()
	for c := range conns {
		_ = c.Conn.Close()
	}
	return err
}

// handoff is a listener of the mux's servers: a connection it returns is
// classified, so the tracker forgets it.
type handoff struct {
	net.Listener
	t *sniffTracker
}

func (l handoff) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if mc, ok := c.(*cmux.MuxConn); ok {
		if tc, ok := mc.Conn.(*trackedConn); ok {
			l.t.forget(tc)
		}
	}
	return c, nil
}

// Serve accepts connections until the listener is closed. It returns nil
// when the listener was closed.
func (p *ProtocolMux) Serve() error {
	err := p.m.Serve()
	if err == nil || errors.Is(err, net.ErrClosed) || errors.Is(err, cmux.ErrListenerClosed) || errors.Is(err, cmux.ErrServerClosed) {
		return nil
	}
	return err
}

// IsClosed reports whether err is what a ProtocolMux listener's Accept
// returns once the mux has stopped.
func IsClosed(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, cmux.ErrListenerClosed) || errors.Is(err, cmux.ErrServerClosed)
}

// Bounds of the classification of one connection: how many frames before
// the first HEADERS it reads (a client sends SETTINGS, perhaps WINDOW_UPDATE
// and PING first), how many bytes in all, and the largest frame accepted
// (HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which a client must respect
// until the server raises it).
const (
	maxSniffFrames      = 16
	sniffLimit          = 64 << 10
	defaultMaxFrameSize = 16 << 10
)

// matchGRPC reports whether the connection is HTTP/2 with prior knowledge
// and its first request has a gRPC content type ("application/grpc" or
// "application/grpc+<codec>", not gRPC-Web).
//
// Right after the client preface it writes an empty SETTINGS frame, the
// server preface: gRPC and Go HTTP/2 clients wait for it before sending a
// request, so without it neither side would move. The client acknowledges
// that frame; settingsAckListener removes the acknowledgement from
// connections that go to net/http, whose server would otherwise take it
// for an acknowledgement of settings it never sent. grpc-go ignores it.
func matchGRPC(w io.Writer, r io.Reader) bool {
	// Compare as bytes arrive: a short HTTP/1.0 request that then waits
	// for its answer must not wait for 24 bytes that never come.
	preface := make([]byte, len(http2.ClientPreface))
	for n := 0; n < len(preface); {
		m, err := r.Read(preface[n:])
		n += m
		if string(preface[:n]) != http2.ClientPreface[:n] || (err != nil && n < len(preface)) {
			return false
		}
	}
	// Everything read here is kept by cmux to replay to the server chosen:
	// bound it. A client must not send frames above the default maximum
	// size before it has our settings, and the first request's headers fit
	// well within sniffLimit.
	fr := http2.NewFramer(w, io.LimitReader(r, sniffLimit))
	fr.SetMaxReadFrameSize(defaultMaxFrameSize)
	if err := fr.WriteSettings(); err != nil {
		return false
	}
	var contentType string
	dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == "content-type" {
			contentType = f.Value
		}
	})
	dec.SetMaxStringLength(sniffLimit)
	for range maxSniffFrames {
		f, err := fr.ReadFrame()
		if err != nil {
			return false
		}
		var (
			block []byte
			ended bool
		)
		switch f := f.(type) {
		case *http2.HeadersFrame:
			block, ended = f.HeaderBlockFragment(), f.HeadersEnded()
		case *http2.ContinuationFrame:
			block, ended = f.HeaderBlockFragment(), f.HeadersEnded()
		default:
			continue
		}
		if _, err := dec.Write(block); err != nil {
			return false
		}
		if ended {
			return isGRPCContentType(contentType)
		}
	}
	return false
}

// SplitGRPC returns the handler of a ProtocolMux's HTTP side: gRPC
// requests (HTTP/2 with a gRPC content type) go to grpcHandler (the
// grpc.Server of the GRPC side, through its ServeHTTP), every other
// request to next. gRPC requests reach it on connections the mux could not
// classify in time: a client that opened its connection and made its first
// call later, as a pooled or reconnected channel does.
func SplitGRPC(next, grpcHandler http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && r.Method == http.MethodPost && isGRPCContentType(r.Header.Get("Content-Type")) {
			grpcHandler.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func isGRPCContentType(ct string) bool {
	rest, ok := strings.CutPrefix(ct, "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// settingsAckListener wraps the HTTP connections of a ProtocolMux.
type settingsAckListener struct{ net.Listener }

func (l settingsAckListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &settingsAckConn{Conn: c}, nil
}

// HTTP/2 frame header: length (24 bits), type, flags, stream (32 bits).
const (
	frameHeaderLen    = 9
	frameTypeSettings = 0x4
	flagSettingsAck   = 0x1
)

// settingsAckConn passes the client's bytes through, except the first
// SETTINGS acknowledgement of an HTTP/2 connection: it acknowledges the
// SETTINGS frame matchGRPC wrote, which the server behind never sent. A
// connection that does not start with the HTTP/2 client preface (HTTP/1.x)
// is passed through untouched.
type settingsAckConn struct {
	net.Conn
	state   int    // one of the sa* states
	pending []byte // bytes read but not yet classified
	out     []byte // bytes ready to return
	skip    int    // payload bytes of the current frame still to pass
	buf     [4096]byte
}

const (
	saPreface = iota // comparing the first bytes with the client preface
	saFrames         // walking frames up to the first SETTINGS ack
	saPass           // passing everything through
)

func (c *settingsAckConn) Read(p []byte) (int, error) {
	for {
		if len(c.out) > 0 {
			n := copy(p, c.out)
			c.out = c.out[n:]
			return n, nil
		}
		if c.state == saPass && len(c.pending) == 0 {
			return c.Conn.Read(p)
		}
		n, err := c.Conn.Read(c.buf[:])
		if n > 0 {
			c.pending = append(c.pending, c.buf[:n]...)
			c.process()
			continue
		}
		if err != nil {
			// Whatever is pending is an incomplete frame header or
			// preface: hand it over so the server reports it.
			if len(c.pending) > 0 {
				c.out, c.pending = c.pending, nil
				c.state = saPass
				continue
			}
			return 0, err
		}
	}
}

// process moves classified bytes from pending to out.
func (c *settingsAckConn) process() {
	for len(c.pending) > 0 {
		switch c.state {
		case saPreface:
			pre := http2.ClientPreface
			n := min(len(c.pending), len(pre))
			if !bytes.Equal(c.pending[:n], []byte(pre[:n])) {
				c.state = saPass
				continue
			}
			if n < len(pre) {
				return
			}
			c.out = append(c.out, c.pending[:n]...)
			c.pending = c.pending[n:]
			c.state = saFrames
		case saFrames:
			if c.skip > 0 {
				n := min(c.skip, len(c.pending))
				c.out = append(c.out, c.pending[:n]...)
				c.pending = c.pending[n:]
				c.skip -= n
				continue
			}
			if len(c.pending) < frameHeaderLen {
				return
			}
			h := c.pending[:frameHeaderLen]
			length := int(binary.BigEndian.Uint32(append([]byte{0}, h[:3]...)))
			if h[3] == frameTypeSettings && h[4]&flagSettingsAck != 0 && length == 0 {
				c.pending = c.pending[frameHeaderLen:]
				c.state = saPass
				continue
			}
			c.out = append(c.out, h...)
			c.pending = c.pending[frameHeaderLen:]
			c.skip = length
		case saPass:
			c.out = append(c.out, c.pending...)
			c.pending = nil
		}
	}
}
