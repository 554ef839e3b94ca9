package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/time/rate"
)

// Bounds of the answer to a plaintext client on a TLS port: how long the
// exchange may take in all (an h2c client must send its first request's
// headers within it), and how much of what the client still sends is read
// and dropped before the connection is closed.
const (
	plaintextAnswerTime = 5 * time.Second
	plaintextDrainTime  = time.Second
	plaintextDrainLimit = 64 << 10
	// A port logs at most plaintextLogBurst lines at once and one a
	// second after that.
	plaintextLogBurst = 10
)

// errPlaintext is what the TLS layer reads from a connection whose client
// spoke plaintext HTTP; the client has had its answer.
var errPlaintext = errors.New("the client spoke plaintext HTTP to a TLS port")

// RefusePlaintext wraps the raw listener of a TLS port, to go under
// tls.NewListener. A client that speaks plaintext HTTP there — an HTTP/1
// request (curl http://), or HTTP/2 with prior knowledge (h2c: grpcurl
// -plaintext, a gRPC client without TLS) — would otherwise see its
// connection closed or wait for a server preface that never comes; it gets
// an answer in its own protocol saying that the port speaks TLS: HTTP/1 a
// 400, h2c a gRPC Unavailable (or, for other content types, a 400) and a
// GOAWAY carrying the same text. The connection is then closed and a line
// names the client's address (a burst of 10, then at most one a second;
// the others are counted). The bytes of a TLS client are passed through untouched: only
// its first bytes are looked at.
func RefusePlaintext(ln net.Listener, logger *slog.Logger) net.Listener {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &plaintextListener{Listener: ln, logger: logger, logs: rate.NewLimiter(1, plaintextLogBurst)}
}

type plaintextListener struct {
	net.Listener
	logger *slog.Logger
	logs   *rate.Limiter

	suppressed atomic.Int64 // lines not logged since the last one
}

func (l *plaintextListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &plaintextConn{Conn: c, l: l}, nil
}

// log reports a refused client, rate-limited.
func (l *plaintextListener) log(remote net.Addr, protocol string) {
	if !l.logs.Allow() {
		l.suppressed.Add(1)
		return
	}
	suppressed := l.suppressed.Swap(0)
	args := []any{"remote", remote.String(), "protocol", protocol, "port", l.Addr().String()}
	if suppressed > 0 {
		args = append(args, "not_logged_since_last", suppressed)
	}
	l.logger.Info("a client spoke plaintext to the TLS port; it was told to use TLS", args...)
}

// plaintextConn classifies its first bytes on the first Read.
type plaintextConn struct {
	net.Conn
	l       *plaintextListener
	checked bool
	pending []byte // bytes read while classifying, not yet returned
}

// Kinds of the first bytes of a connection.
const (
	firstUndecided = iota
	firstOther     // TLS, or anything that is not plaintext HTTP
	firstHTTP1
	firstH2C
)

// classifyFirst tells a connection's kind from its first bytes.
func classifyFirst(b []byte) int {
	if len(b) == 0 {
		return firstUndecided
	}
	pre := http2.ClientPreface
	if n := min(len(b), len(pre)); string(b[:n]) == pre[:n] {
		if n == len(pre) {
			return firstH2C
		}
		return firstUndecided
	}
	// An HTTP/1 request line starts with a method: uppercase letters and
	// a space. A TLS record starts with a content type byte (0x14-0x18).
	for i, ch := range b {
		switch {
		case ch == ' ' && i > 0:
			return firstHTTP1
		case ch < 'A' || ch > 'Z' || i >= 10:
			return firstOther
		}
	}
	return firstUndecided
}

func (c *plaintextConn) Read(p []byte) (int, error) {
	if !c.checked {
		if err := c.classify(); err != nil {
			return 0, err
		}
	}
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// classify reads until the first bytes tell the connection's kind, and
// answers a plaintext client (then errPlaintext).
func (c *plaintextConn) classify() error {
	var buf [64]byte
	for {
		kind := classifyFirst(c.pending)
		switch kind {
		case firstUndecided:
			n, err := c.Conn.Read(buf[:])
			c.pending = append(c.pending, buf[:n]...)
			if err != nil && n == 0 {
				c.checked = true
				if len(c.pending) > 0 {
					return nil // handed over; the next Read has the error again
				}
				return err
			}
			continue
		case firstOther:
			c.checked = true
			return nil
		}
		c.checked = true
		protocol := "HTTP/1"
		if kind == firstH2C {
			protocol = "HTTP/2 without TLS (h2c)"
		}
		c.l.log(c.RemoteAddr(), protocol)
		_ = c.SetDeadline(time.Now().Add(plaintextAnswerTime))
		if kind == firstH2C {
			c.answerH2C(c.pending[len(http2.ClientPreface):])
		} else {
			c.answerHTTP1()
		}
		c.pending = nil
		c.linger()
		return &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: errPlaintext}
	}
}

// plaintextMessage says what a plaintext client must do instead.
func plaintextMessage(protocol string) string {
	return fmt.Sprintf("this port speaks TLS only and the client sent %s in plaintext: connect with TLS "+
		"(https:// for HTTP and Connect; grpcurl without -plaintext, with -cacert or -insecure)", protocol)
}

func (c *plaintextConn) answerHTTP1() {
	body := "Client sent an HTTP request to an HTTPS server: " + plaintextMessage("HTTP") + ".\n"
	_, _ = io.WriteString(c.Conn, "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"+
		"Content-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body)
}

// answerH2C speaks just enough HTTP/2 to answer the client's first
// request: the server preface, the answer (trailers-only Unavailable for
// gRPC, else a 400), and a GOAWAY with the message. rest is what followed
// the client preface in the bytes already read.
func (c *plaintextConn) answerH2C(rest []byte) {
	msg := plaintextMessage("HTTP/2")
	fr := http2.NewFramer(c.Conn, io.LimitReader(io.MultiReader(bytes.NewReader(rest), c.Conn), sniffLimit))
	fr.SetMaxReadFrameSize(defaultMaxFrameSize)
	if err := fr.WriteSettings(); err != nil {
		return
	}
	var contentType string
	dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == "content-type" {
			contentType = f.Value
		}
	})
	dec.SetMaxStringLength(sniffLimit)
	var stream uint32
	for range maxSniffFrames {
		f, err := fr.ReadFrame()
		if err != nil {
			break
		}
		var block []byte
		ended := false
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = fr.WriteSettingsAck()
			}
			continue
		case *http2.HeadersFrame:
			stream = f.StreamID
			block, ended = f.HeaderBlockFragment(), f.HeadersEnded()
		case *http2.ContinuationFrame:
			block, ended = f.HeaderBlockFragment(), f.HeadersEnded()
		default:
			continue
		}
		if _, err := dec.Write(block); err != nil {
			stream = 0
			break
		}
		if ended {
			break
		}
	}
	if stream != 0 {
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		field := func(name, value string) { _ = enc.WriteField(hpack.HeaderField{Name: name, Value: value}) }
		if isGRPCContentType(contentType) {
			field(":status", "200")
			field("content-type", contentType)
			field("grpc-status", "14") // Unavailable
			field("grpc-message", grpcMessageEncode(msg))
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true})
		} else {
			body := msg + "\n"
			field(":status", "400")
			field("content-type", "text/plain; charset=utf-8")
			field("content-length", strconv.Itoa(len(body)))
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: hb.Bytes(), EndHeaders: true})
			_ = fr.WriteData(stream, true, []byte(body))
		}
	}
	_ = fr.WriteGoAway(stream, http2.ErrCodeNo, []byte(msg))
}

// grpcMessageEncode percent-encodes a grpc-message value (the gRPC over
// HTTP/2 protocol: bytes outside printable ASCII, and '%').
func grpcMessageEncode(s string) string {
	var b bytes.Buffer
	for i := 0; i < len(s); i++ {
		ch := s[i]
		if ch < ' ' || ch > '~' || ch == '%' {
			fmt.Fprintf(&b, "%%%02X", ch)
			continue
		}
		b.WriteByte(ch)
	}
	return b.String()
}

// linger closes the connection after the client has read the answer: the
// writing side first, then what the client still sends is read and
// dropped for a while, so that the answer is not lost to a reset from
// closing with unread bytes.
func (c *plaintextConn) linger() {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(plaintextDrainTime))
		_, _ = io.Copy(io.Discard, io.LimitReader(c.Conn, plaintextDrainLimit))
	}
	_ = c.Conn.Close()
}
