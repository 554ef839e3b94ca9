package store

import (
	"net"
	"sync"
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

// endingPipelines is raft's NetworkTransport with one change: a pipeline it
// hands to Raft ends itself on the first answer that is not a success (a
// rejection, a newer term, or an error such as a read timeout), right after
// Raft has taken that answer.
//
// Raft's pipelined replication stops decoding answers on a rejection but
// keeps its pipeline open until its send loop notices, and that loop can
// first start one more send that waits for a decoder that waits in turn for
// Raft to take an answer nobody takes any more: the follower never gets
// another entry and Raft's Shutdown hangs on the stuck goroutine
// (hashicorp/raft#612). Once the pipeline is closed that send returns
// raft.ErrPipelineShutdown, Raft falls back to one AppendEntries at a time
// (which walks back and retries the rejected entries) and opens a fresh
// pipeline after the next success. See DESIGN.md, "Throughput and
// batching".
type endingPipelines struct {
	*raft.NetworkTransport
}

var (
	_ raft.Transport   = endingPipelines{}
	_ raft.WithClose   = endingPipelines{}
	_ raft.WithPreVote = endingPipelines{}
)

// AppendEntriesPipeline opens raft's pipeline to target and wraps it.
func (t endingPipelines) AppendEntriesPipeline(id raft.ServerID, target raft.ServerAddress) (raft.AppendPipeline, error) {
	p, err := t.NetworkTransport.AppendEntriesPipeline(id, target)
	if err != nil {
		return nil, err
	}
	return newEndingPipeline(p), nil
}

// endingPipeline passes answers from inner to Raft in order and closes inner
// after the first one that is not a success.
type endingPipeline struct {
	inner     raft.AppendPipeline
	out       chan raft.AppendFuture
	closed    chan struct{}
	closeOnce sync.Once
	closeErr  error
}

func newEndingPipeline(inner raft.AppendPipeline) *endingPipeline {
	p := &endingPipeline{
		inner:  inner,
		out:    make(chan raft.AppendFuture),
		closed: make(chan struct{}),
	}
	go p.forward()
	return p
}

func (p *endingPipeline) forward() {
	in := p.inner.Consumer()
	for {
		var f raft.AppendFuture
		select {
		case f = <-in:
		case <-p.closed:
			return
		}
		// An answer that came with an error is no success, whatever was
		// decoded of it (Raft reads the response without the error).
		failed := f.Error() != nil
		if failed {
			f.Response().Success = false
		}
		failed = failed || !f.Response().Success
		select {
		case p.out <- f:
		case <-p.closed:
			return
		}
		if failed {
			p.Close()
			return
		}
	}
}

// AppendEntries sends one request down the pipeline; after Close it
// returns raft.ErrPipelineShutdown.
func (p *endingPipeline) AppendEntries(args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) (raft.AppendFuture, error) {
	select {
	case <-p.closed:
		return nil, raft.ErrPipelineShutdown
	default:
	}
	return p.inner.AppendEntries(args, resp)
}

// Consumer yields the answers in the order of the requests.
func (p *endingPipeline) Consumer() <-chan raft.AppendFuture { return p.out }

// Close closes the pipeline and its connection; it may be called more than
// once.
func (p *endingPipeline) Close() error {
	p.closeOnce.Do(func() {
		close(p.closed)
		p.closeErr = p.inner.Close()
	})
	return p.closeErr
}
