package cluster

import (
	"context"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
)

// MaxMessageBytes bounds every message exchanged between agents.
const MaxMessageBytes = 16 << 20

// CompressMinBytes is the size below which messages are not compressed.
const CompressMinBytes = 1024

// Pool holds the clients this node uses to reach other agents' internal
// ports, one HTTP/2 connection per peer, shared by all calls.
type Pool struct {
	http *http.Client

	mu      sync.Mutex
	cluster map[string]clusterv1connect.ClusterServiceClient
	node    map[string]nodev1connect.NodeServiceClient
}

// NewPool builds a pool speaking HTTP/2 without TLS. (mTLS between agents
// replaces the transport, not the pool.)
func NewPool() *Pool {
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols:           &protos,
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     90 * time.Second,
	}
	tr.HTTP2 = &http.HTTP2Config{
		PingTimeout:     5 * time.Second,
		SendPingTimeout: 10 * time.Second,
	}
	return &Pool{
		http:    &http.Client{Transport: tr},
		cluster: make(map[string]clusterv1connect.ClusterServiceClient),
		node:    make(map[string]nodev1connect.NodeServiceClient),
	}
}

func clientOptions() []connect.ClientOption {
	return []connect.ClientOption{
		connect.WithGRPC(),
		connect.WithReadMaxBytes(MaxMessageBytes),
		connect.WithSendMaxBytes(MaxMessageBytes),
		connect.WithCompressMinBytes(CompressMinBytes),
	}
}

// Cluster returns a ClusterService client for an agent's internal address.
func (p *Pool) Cluster(addr string) clusterv1connect.ClusterServiceClient {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.cluster[addr]
	if !ok {
		c = clusterv1connect.NewClusterServiceClient(p.http, "http://"+addr, clientOptions()...)
		p.cluster[addr] = c
	}
	return c
}

// Node returns a NodeService client for an agent's internal address.
func (p *Pool) Node(addr string) nodev1connect.NodeServiceClient {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.node[addr]
	if !ok {
		c = nodev1connect.NewNodeServiceClient(p.http, "http://"+addr, clientOptions()...)
		p.node[addr] = c
	}
	return c
}

// Close drops idle connections.
func (p *Pool) Close() {
	p.http.CloseIdleConnections()
}

// statusTimeout bounds one peer status query.
const statusTimeout = 2 * time.Second

func withStatusTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, statusTimeout)
}
