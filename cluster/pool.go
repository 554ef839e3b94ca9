package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// MaxMessageBytes bounds every message exchanged between agents.
const MaxMessageBytes = 16 << 20

// CompressMinBytes is the size below which messages are not compressed.
const CompressMinBytes = 1024

// Pool holds the clients this node uses to reach other agents' internal
// ports: one gRPC connection (grpc-go) per peer, shared by all calls. The
// clients implement the Connect client interfaces, so the forwarding code
// is the same whichever transport carries it; grpc-go's client costs about
// a third of the CPU of a Connect client on net/http per call, and
// multiplexes many concurrent calls on one connection without the locks a
// Go HTTP/2 client connection serialises its streams on.
type Pool struct {
	creds  credentials.TransportCredentials
	extra  []grpc.DialOption
	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	closed bool
}

// NewPool builds a pool speaking HTTP/2 without TLS.
func NewPool() *Pool {
	return NewPoolTLS(nil)
}

// NewPoolTLS builds a pool speaking TLS: client returns the configuration
// for a peer dialled at host (identity.Source.ClientConfig: it presents this
// agent's certificate and verifies that the peer's holds host); nil means
// no TLS.
func NewPoolTLS(client func(host string) *tls.Config) *Pool {
	var creds credentials.TransportCredentials = insecure.NewCredentials()
	if client != nil {
		creds = hostCredentials{client: client}
	}
	return &Pool{creds: creds, conns: make(map[string]*grpc.ClientConn)}
}

// WithDialOptions adds options to the connections the pool makes from
// now on (tracing); it returns the pool.
func (p *Pool) WithDialOptions(opts ...grpc.DialOption) *Pool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.extra = append(p.extra, opts...)
	return p
}

// WithTracker hands every connection the pool dials from now on, with the
// peer's certificate, to track (identity.Source.TrackDialed: closed once
// that certificate is revoked); it returns the pool.
func (p *Pool) WithTracker(track Tracker) *Pool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.creds = TrackedCredentials(p.creds, track)
	return p
}

// Tracker remembers a connection this side dialled, whose server
// authenticated with the certificate leaf, and returns the connection to
// use in its place (identity.Source.TrackDialed).
type Tracker func(c net.Conn, leaf *x509.Certificate) net.Conn

// TrackedCredentials wraps TLS client credentials so that every
// connection they complete is given to track; nil track: creds as they are.
func TrackedCredentials(creds credentials.TransportCredentials, track Tracker) credentials.TransportCredentials {
	if track == nil {
		return creds
	}
	return trackedCredentials{TransportCredentials: creds, track: track}
}

type trackedCredentials struct {
	credentials.TransportCredentials
	track Tracker
}

func (c trackedCredentials) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return conn, info, err
	}
	if ti, ok := info.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
		conn = c.track(conn, ti.State.PeerCertificates[0])
	}
	return conn, info, nil
}

func (c trackedCredentials) Clone() credentials.TransportCredentials {
	return trackedCredentials{TransportCredentials: c.TransportCredentials.Clone(), track: c.track}
}

// hostCredentials are TLS client credentials whose configuration names the
// host dialled, so that the server's certificate is checked against it.
type hostCredentials struct {
	client func(host string) *tls.Config
}

func (c hostCredentials) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	host, _, err := net.SplitHostPort(authority)
	if err != nil {
		host = authority
	}
	return credentials.NewTLS(c.client(host)).ClientHandshake(ctx, authority, raw)
}

func (c hostCredentials) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("hostCredentials are client credentials")
}

func (c hostCredentials) Info() credentials.ProtocolInfo {
	return credentials.NewTLS(c.client("")).Info()
}

func (c hostCredentials) Clone() credentials.TransportCredentials { return c }

func (c hostCredentials) OverrideServerName(string) error { return nil }

// dialOptions are the options of every connection to a peer. A peer that
// restarts is redialled within at most a couple of seconds (grpc's default
// backoff grows to two minutes, far longer than a leader takes to come back).
func dialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(MaxMessageBytes),
			grpc.MaxCallSendMsgSize(MaxMessageBytes),
		),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 3 * time.Second,
		}),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
	}
}

// conn returns the connection to addr, creating it (lazily connected) on
// first use. When that is impossible (the pool is closed, the address does
// not parse) every call on the returned connection fails with Unavailable.
func (p *Pool) conn(addr string) grpc.ClientConnInterface {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return failedConn{status.Errorf(codes.Unavailable, "peer %s: the connection pool is closed (agent stopping)", addr)}
	}
	if c, ok := p.conns[addr]; ok {
		return c
	}
	c, err := grpc.NewClient("passthrough:///"+addr, append(dialOptions(p.creds), p.extra...)...)
	if err != nil {
		return failedConn{status.Errorf(codes.Unavailable, "peer %s: %v", addr, err)}
	}
	p.conns[addr] = c
	return c
}

// Conn is the connection to an agent's internal address (the placement
// routing relays calls to other nodes' backends over it, with its own
// codec per call).
func (p *Pool) Conn(addr string) grpc.ClientConnInterface { return p.conn(addr) }

// Forget closes and drops the connection to addr, if any (an address a
// member claimed and could not back); the next use dials again.
func (p *Pool) Forget(addr string) {
	p.mu.Lock()
	c, ok := p.conns[addr]
	delete(p.conns, addr)
	p.mu.Unlock()
	if ok {
		_ = c.Close()
	}
}

// failedConn fails every call with err.
type failedConn struct{ err error }

func (f failedConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return f.err
}

func (f failedConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, f.err
}

// Cluster returns a ClusterService client for an agent's internal address.
func (p *Pool) Cluster(addr string) clusterv1connect.ClusterServiceClient {
	return grpcCluster{c: clusterv1.NewClusterServiceClient(p.conn(addr))}
}

// Node returns a NodeService client for an agent's internal address.
func (p *Pool) Node(addr string) nodev1connect.NodeServiceClient {
	return grpcNode{c: nodev1.NewNodeServiceClient(p.conn(addr))}
}

// Close closes every connection; later calls fail with Unavailable.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for addr, c := range p.conns {
		_ = c.Close()
		delete(p.conns, addr)
	}
}

// statusTimeout bounds one peer status query.
const statusTimeout = 2 * time.Second

func withStatusTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, statusTimeout)
}

// Snapshots returns a SnapshotService client (grpc-go, streaming) for an
// agent's internal address. Its errors are gRPC statuses; StreamError
// converts them.
func (p *Pool) Snapshots(addr string) clusterv1.SnapshotServiceClient {
	return clusterv1.NewSnapshotServiceClient(p.conn(addr))
}

// Agents returns an AgentService client (grpc-go, streaming) for an
// agent's internal address. Its errors are gRPC statuses; StreamError
// converts them.
func (p *Pool) Agents(addr string) clusterv1.AgentServiceClient {
	return clusterv1.NewAgentServiceClient(p.conn(addr))
}

// Schedules returns a ScheduleService client for an agent's internal
// address.
func (p *Pool) Schedules(addr string) schedulev1.ScheduleServiceClient {
	return schedulev1.NewScheduleServiceClient(p.conn(addr))
}
