package gateway

import (
	"context"
	"crypto/tls"
	"net"

	"github.com/soheilhy/cmux"
	"google.golang.org/grpc/credentials"
)

// ConnTLS returns the TLS state of a connection accepted through a TLS
// listener and the ProtocolMux (which wrap it), false for a plaintext one.
// The API port terminates TLS before the mux sniffs the protocol, so
// neither net/http nor grpc-go sees a *tls.Conn of its own.
func ConnTLS(c net.Conn) (*tls.ConnectionState, bool) {
	for range 8 { // the wrappers are at most three deep; bounded all the same
		switch v := c.(type) {
		case *tls.Conn:
			st := v.ConnectionState()
			return &st, true
		case *cmux.MuxConn:
			c = v.Conn
		case *trackedConn:
			c = v.Conn
		case *settingsAckConn:
			c = v.Conn
		default:
			return nil, false
		}
	}
	return nil, false
}

// PeerTLSCredentials are grpc-go transport credentials for a server
// whose connections are already TLS (the API port): no handshake, but the
// connection's TLS state as the peer's AuthInfo (credentials.TLSInfo), so
// handlers and interceptors see the client certificate.
type PeerTLSCredentials struct{}

var _ credentials.TransportCredentials = PeerTLSCredentials{}

// ServerHandshake implements credentials.TransportCredentials.
func (PeerTLSCredentials) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	st, ok := ConnTLS(c)
	if !ok {
		return c, nil, nil
	}
	return c, credentials.TLSInfo{State: *st, CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
}

// ClientHandshake implements credentials.TransportCredentials; these
// credentials are for servers only.
func (PeerTLSCredentials) ClientHandshake(_ context.Context, _ string, c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return c, nil, nil
}

// Info implements credentials.TransportCredentials.
func (PeerTLSCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

// Clone implements credentials.TransportCredentials.
func (PeerTLSCredentials) Clone() credentials.TransportCredentials { return PeerTLSCredentials{} }

// OverrideServerName implements credentials.TransportCredentials.
func (PeerTLSCredentials) OverrideServerName(string) error { return nil }

// connTLSKey carries a connection's TLS state in the contexts of its
// requests (net/http's ConnContext).
type connTLSKey struct{}

// WithConnTLS is an http.Server ConnContext: it records the connection's
// TLS state for ConnTLSFromContext.
func WithConnTLS(ctx context.Context, c net.Conn) context.Context {
	if st, ok := ConnTLS(c); ok {
		return context.WithValue(ctx, connTLSKey{}, st)
	}
	return ctx
}

// ConnTLSFromContext returns the TLS state WithConnTLS recorded.
func ConnTLSFromContext(ctx context.Context) (*tls.ConnectionState, bool) {
	st, ok := ctx.Value(connTLSKey{}).(*tls.ConnectionState)
	return st, ok
}
