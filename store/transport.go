package store

import (
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// TCPStreamLayer is a raft.StreamLayer over plain TCP: it accepts on a
// listener and dials peers directly. It is the development and test
// transport; production nodes use the mTLS stream layer of the cluster
// package.
type TCPStreamLayer struct {
	ln        net.Listener
	advertise net.Addr
}

var _ raft.StreamLayer = (*TCPStreamLayer)(nil)

// NewTCPStreamLayer returns a stream layer that accepts on ln and advertises
// advertise to peers, or ln.Addr() when advertise is nil. Closing the stream
// layer closes ln.
func NewTCPStreamLayer(ln net.Listener, advertise net.Addr) *TCPStreamLayer {
	return &TCPStreamLayer{ln: ln, advertise: advertise}
}

// Dial connects to a peer's Raft address within timeout.
func (t *TCPStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	return d.Dial("tcp", string(address))
}

// Accept waits for the next inbound connection.
func (t *TCPStreamLayer) Accept() (net.Conn, error) { return t.ln.Accept() }

// Close closes the listener.
func (t *TCPStreamLayer) Close() error { return t.ln.Close() }

// Addr is the advertised address, or the listener's when none was given.
func (t *TCPStreamLayer) Addr() net.Addr {
	if t.advertise != nil {
		return t.advertise
	}
	return t.ln.Addr()
}
