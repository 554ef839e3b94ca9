package cluster

import (
	"context"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
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
	// https are independent clients, each with its own HTTP/2 connection
	// per peer: calls are spread over them, because one Go HTTP/2 client
	// connection serialises its streams on its own locks under load.
	https []*http.Client
	next  atomic.Uint64

	mu      sync.Mutex
	cluster map[string][]clusterv1connect.ClusterServiceClient
	node    map[string]nodev1connect.NodeServiceClient
}

// connsPerPeer is how many HTTP/2 connections the pool keeps per peer.
const connsPerPeer = 3

// NewPool builds a pool speaking HTTP/2 without TLS. (mTLS between agents
// replaces the transport, not the pool.)
func NewPool() *Pool {
	p := &Pool{
		cluster: make(map[string][]clusterv1connect.ClusterServiceClient),
		node:    make(map[string]nodev1connect.NodeServiceClient),
	}
	for range connsPerPeer {
		p.https = append(p.https, newHTTPClient())
	}
	return p
}

func newHTTPClient() *http.Client {
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
	return &http.Client{Transport: tr}
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
	cs, ok := p.cluster[addr]
	if !ok {
		for _, hc := range p.https {
			cs = append(cs, clusterv1connect.NewClusterServiceClient(hc, "http://"+addr, clientOptions()...))
		}
		p.cluster[addr] = cs
	}
	return cs[p.next.Add(1)%uint64(len(cs))]
}

// Node returns a NodeService client for an agent's internal address.
func (p *Pool) Node(addr string) nodev1connect.NodeServiceClient {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.node[addr]
	if !ok {
		c = nodev1connect.NewNodeServiceClient(p.https[0], "http://"+addr, clientOptions()...)
		p.node[addr] = c
	}
	return c
}

// Close drops idle connections.
func (p *Pool) Close() {
	for _, hc := range p.https {
		hc.CloseIdleConnections()
	}
}

// statusTimeout bounds one peer status query.
const statusTimeout = 2 * time.Second

func withStatusTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, statusTimeout)
}
