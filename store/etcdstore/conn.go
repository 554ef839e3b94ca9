package etcdstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// Conns makes the etcd client's connections and keeps why the last attempt
// to each endpoint failed. etcd's client retries a request that cannot
// connect until the request's deadline and then returns only the deadline;
// with Conns in its dial options (Config.Conns) the Store's errors, Status
// and log name the cause: a refused dial, a certificate this agent or etcd
// refused.
type Conns struct {
	tls    bool // set by DialOptions: a connection counts once its TLS is up
	mu     sync.Mutex
	failed map[string]string // endpoint address (host:port) -> why its last attempt failed
}

// DialOptions returns the etcd client's dial options that report to c.
// With tlsConfig the connections use TLS: tlsConfig(serverName) makes the
// configuration of one handshake, serverName being the endpoint's host
// (etcd's client shares one tls.Config between endpoints, and crypto/tls
// does not tell a VerifyConnection which IP address it dialed).
func (c *Conns) DialOptions(tlsConfig func(serverName string) *tls.Config) []grpc.DialOption {
	// A dialer of our own bypasses gRPC's proxy resolver: etcd is dialed
	// directly, whatever HTTPS_PROXY says.
	opts := []grpc.DialOption{grpc.WithContextDialer(c.dial)}
	if tlsConfig != nil {
		c.tls = true
		// After etcd's own credentials in the client's options: this one
		// counts.
		opts = append(opts, grpc.WithTransportCredentials(&connCreds{conns: c, config: tlsConfig}))
	}
	return opts
}

// Err describes the endpoints whose last connection attempt failed, nil
// when none did.
func (c *Conns) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.failed) == 0 {
		return nil
	}
	addrs := make([]string, 0, len(c.failed))
	for a := range c.failed {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)
	msgs := make([]string, len(addrs))
	for i, a := range addrs {
		msgs[i] = a + ": " + c.failed[a]
	}
	return errors.New(strings.Join(msgs, "; "))
}

func (c *Conns) record(addr string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil {
		delete(c.failed, addr)
		return
	}
	if c.failed == nil {
		c.failed = make(map[string]string)
	}
	c.failed[addr] = err.Error()
}

// dial connects over TCP: the configuration accepts http(s) URLs and
// host:port, no unix sockets. addr is the endpoint's host:port, as the
// authority of the TLS handshake is. The connection is returned as it is
// (gRPC sets TCP_USER_TIMEOUT on a *net.TCPConn).
func (c *Conns) dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if !errors.Is(ctx.Err(), context.Canceled) { // not the client closing
			c.record(addr, err)
		}
		return nil, err
	}
	if !c.tls {
		c.record(addr, nil)
	}
	return conn, nil
}

// connCreds are TLS credentials that make a tls.Config per handshake and
// report failures to conns.
type connCreds struct {
	conns  *Conns
	config func(serverName string) *tls.Config
}

func (cc *connCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	// The authority is the endpoint's host:port (etcd's resolver sets it
	// per address), the key dial records under.
	host := authority
	if h, _, err := net.SplitHostPort(authority); err == nil {
		host = h
	}
	conn, info, err := credentials.NewTLS(cc.config(host)).ClientHandshake(ctx, authority, raw)
	if err != nil {
		if !errors.Is(ctx.Err(), context.Canceled) {
			cc.conns.record(authority, fmt.Errorf("TLS handshake: %w", err))
		}
		return nil, nil, err
	}
	// With TLS 1.3 the client's handshake ends before etcd has checked the
	// client certificate: a refusal is the first read's error.
	return &firstRead{Conn: conn, done: func(err error) {
		if err != nil {
			err = fmt.Errorf("TLS: etcd closed the connection: %w", err)
		}
		cc.conns.record(authority, err)
	}}, info, nil
}

func (cc *connCreds) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("etcdstore: client credentials only")
}

func (cc *connCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

func (cc *connCreds) Clone() credentials.TransportCredentials {
	return &connCreds{conns: cc.conns, config: cc.config}
}

func (cc *connCreds) OverrideServerName(string) error { return nil }

// firstRead reports the outcome of the connection's first read: data
// (nil) or the error that ended it (io.EOF: closed by etcd).
type firstRead struct {
	net.Conn
	done     func(error)
	reported atomic.Bool
}

func (f *firstRead) Read(p []byte) (int, error) {
	n, err := f.Conn.Read(p)
	if f.done != nil && !f.reported.Load() {
		switch {
		case n > 0:
			f.reported.Store(true)
			f.done(nil)
		case err != nil && !errors.Is(err, net.ErrClosed):
			f.reported.Store(true)
			if errors.Is(err, io.EOF) {
				err = errors.New("closed by the server")
			}
			f.done(err)
		}
	}
	return n, err
}

// NetConn returns the wrapped connection, as tls.Conn.NetConn does.
func (f *firstRead) NetConn() net.Conn { return f.Conn }
