package gateway

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
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
	m := cmux.New(ln)
	m.SetReadTimeout(readTimeout)
	// A connection the classifier cannot read (closed, timed out) is
	// dropped; that is the client's problem, not a reason to stop.
	m.HandleError(func(error) bool { return true })
	g := m.MatchWithWriters(matchGRPC)
	h := m.Match(cmux.Any())
	return &ProtocolMux{m: m, GRPC: g, HTTP: settingsAckListener{h}}
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

// maxSniffFrames bounds how many frames before the first HEADERS the
// classifier reads (a client sends SETTINGS, perhaps WINDOW_UPDATE and
// PING first).
const maxSniffFrames = 16

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
	fr := http2.NewFramer(w, r)
	if err := fr.WriteSettings(); err != nil {
		return false
	}
	var contentType string
	dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == "content-type" {
			contentType = f.Value
		}
	})
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
