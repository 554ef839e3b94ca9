package cluster

import (
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// TLSStreamLayer is the Raft stream layer between agents when TLS is on:
// mutual TLS on the Raft port. Accepted connections are TLS servers with
// server (which requires and checks an agent's client certificate); dialled
// ones are TLS clients with client. The handshake of an accepted connection
// runs on its first read, in Raft's per-connection goroutine, so a slow or
// hostile peer never holds up the accept loop; its failure ends that
// connection and is logged by Raft's transport with the reason.
type TLSStreamLayer struct {
	ln        net.Listener
	advertise net.Addr
	server    *tls.Config
	client    func(host string) *tls.Config
	track     Tracker
}

var _ raft.StreamLayer = (*TLSStreamLayer)(nil)

// NewTLSStreamLayer returns a stream layer accepting on ln and advertising
// advertise (ln.Addr() when nil). client returns the configuration that
// verifies a peer dialled at host (the server certificate must hold it).
// Closing it closes ln.
func NewTLSStreamLayer(ln net.Listener, advertise net.Addr, server *tls.Config, client func(host string) *tls.Config) *TLSStreamLayer {
	return &TLSStreamLayer{ln: ln, advertise: advertise, server: server, client: client}
}

// Dial connects and completes the TLS handshake within timeout.
func (t *TLSStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	host, _, err := net.SplitHostPort(string(address))
	if err != nil {
		return nil, fmt.Errorf("raft address %q: %w", address, err)
	}
	d := &tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: t.client(host)}
	c, err := d.Dial("tcp", string(address))
	if err != nil || t.track == nil {
		return c, err
	}
	if peers := c.(*tls.Conn).ConnectionState().PeerCertificates; len(peers) > 0 {
		return t.track(c, peers[0]), nil
	}
	return c, nil
}

// WithTracker hands every connection the layer dials, with the peer's
// certificate, to track (identity.Source.TrackDialed: closed once that
// certificate is revoked); it returns the layer. Call it before use.
func (t *TLSStreamLayer) WithTracker(track Tracker) *TLSStreamLayer {
	t.track = track
	return t
}

// handshakeTimeout bounds the TLS handshake of an accepted connection.
const handshakeTimeout = 10 * time.Second

// Accept waits for the next inbound connection.
func (t *TLSStreamLayer) Accept() (net.Conn, error) {
	c, err := t.ln.Accept()
	if err != nil {
		return nil, err
	}
	return &handshakeConn{Conn: tls.Server(c, t.server)}, nil
}

// handshakeConn completes the TLS handshake on the first read, within
// handshakeTimeout, so that a peer that never finishes it cannot hold the
// connection and its goroutine.
type handshakeConn struct {
	*tls.Conn
	once sync.Once
	err  error
}

func (c *handshakeConn) Read(p []byte) (int, error) {
	c.once.Do(func() {
		_ = c.Conn.SetDeadline(time.Now().Add(handshakeTimeout))
		c.err = c.Conn.Handshake()
		_ = c.Conn.SetDeadline(time.Time{})
	})
	if c.err != nil {
		return 0, c.err
	}
	return c.Conn.Read(p)
}

// Close closes the listener.
func (t *TLSStreamLayer) Close() error { return t.ln.Close() }

// Addr is the advertised address, or the listener's.
func (t *TLSStreamLayer) Addr() net.Addr {
	if t.advertise != nil {
		return t.advertise
	}
	return t.ln.Addr()
}
