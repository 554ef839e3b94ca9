package mesh

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// Route sends the methods whose full name ("/pkg.Service/Method") starts
// with Prefix to Backend.
type Route struct {
	Prefix  string
	Backend *Backend
}

// Proxy forwards gRPC calls to backend clusters by route, without decoding
// messages: every call shape (unary, client, server and bidi streaming),
// headers, trailers, deadlines and status (code, message, details) pass
// through.
type Proxy struct {
	mu     sync.RWMutex
	routes []Route
	logger *slog.Logger
	stats  *Stats
}

// NewProxy returns a proxy with no routes. stats may be nil.
func NewProxy(logger *slog.Logger, stats *Stats) *Proxy {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Proxy{logger: logger, stats: stats}
}

// SetRoutes replaces the routes; the first route whose prefix matches a
// method wins. Calls in flight keep their backend.
func (p *Proxy) SetRoutes(routes []Route) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.routes = append([]Route(nil), routes...)
}

// Route returns the backend of a method, nil when no route matches.
func (p *Proxy) Route(method string) *Backend {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, r := range p.routes {
		if strings.HasPrefix(method, r.Prefix) {
			return r.Backend
		}
	}
	return nil
}

// bidi describes every call as bidi streaming: the proxy does not need the
// shape to forward it.
var bidi = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// Handle is a grpc.StreamHandler for grpc.UnknownServiceHandler: it
// forwards the call to the backend its route names, or fails it with
// Unimplemented.
func (p *Proxy) Handle(_ any, ss grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(ss)
	if !ok {
		return status.Error(codes.Internal, "no method name on the stream")
	}
	b := p.Route(method)
	if b == nil {
		return status.Errorf(codes.Unimplemented, "unknown method %s: no routing rule matches it", method)
	}
	start := time.Now()
	err := p.forward(ss, method, b)
	if p.stats != nil {
		p.stats.observe(b.Name(), status.Code(err), time.Since(start))
	}
	return err
}

// forward makes one attempt on one endpoint of b.
func (p *Proxy) forward(ss grpc.ServerStream, method string, b *Backend) error {
	ep, err := b.pick(nil)
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	ep.active.Add(1)
	defer ep.active.Add(-1)
	if p.stats != nil {
		done := p.stats.active(b.Name())
		defer done()
	}

	ctx, cancel := context.WithCancel(outgoingContext(ss.Context()))
	defer cancel()
	if b.cfg.Timeout > 0 {
		var tcancel context.CancelFunc
		ctx, tcancel = context.WithTimeout(ctx, b.cfg.Timeout)
		defer tcancel()
	}
	cs, err := ep.conn.NewStream(ctx, bidi, method)
	if err != nil {
		return err
	}

	// Client to backend.
	go func() {
		for {
			f := new(Frame)
			if err := ss.RecvMsg(f); err != nil {
				if errors.Is(err, io.EOF) {
					_ = cs.CloseSend()
				} else {
					cancel() // the client went away: so does the backend call
				}
				return
			}
			err := cs.SendMsg(f)
			f.Free()
			if err != nil {
				// The backend call ended; RecvMsg below reports how.
				return
			}
		}
	}()

	// Backend to client. A backend answering with trailers only (an
	// error before any message) is answered with trailers only too.
	hdr, _ := cs.Header()
	hdr = responseMetadata(hdr)
	sent := false
	for {
		f := new(Frame)
		err := cs.RecvMsg(f)
		if err != nil {
			ss.SetTrailer(responseMetadata(cs.Trailer()))
			if !sent && len(hdr) > 0 {
				_ = ss.SetHeader(hdr)
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if !sent {
			if err := ss.SendHeader(hdr); err != nil {
				f.Free()
				return err
			}
			sent = true
		}
		err = ss.SendMsg(f)
		f.Free()
		if err != nil {
			return err
		}
	}
}

// hopHeaders are not forwarded: transport and protocol headers that the
// next hop sets itself.
var hopHeaders = map[string]bool{
	":authority": true, "content-type": true, "user-agent": true, "te": true, "host": true,
	"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true, "upgrade": true,
	"grpc-timeout": true, "grpc-encoding": true, "grpc-accept-encoding": true,
	"grpc-status": true, "grpc-message": true, "grpc-status-details-bin": true,
	"content-length": true, "accept-encoding": true, "content-encoding": true,
}

// outgoingContext carries the caller's metadata (without hop headers) to
// the backend, adding the caller's address to x-forwarded-for. The
// deadline travels with the context.
func outgoingContext(ctx context.Context) context.Context {
	in, _ := metadata.FromIncomingContext(ctx)
	out := make(metadata.MD, len(in)+1)
	for k, v := range in {
		if !hopHeaders[k] {
			out[k] = v
		}
	}
	if pr, ok := peer.FromContext(ctx); ok && pr.Addr != nil {
		host := pr.Addr.String()
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		if prev := out.Get("x-forwarded-for"); len(prev) > 0 {
			host = strings.Join(prev, ", ") + ", " + host
		}
		out.Set("x-forwarded-for", host)
	}
	return metadata.NewOutgoingContext(ctx, out)
}

// responseMetadata drops hop headers from a backend's headers or trailers.
func responseMetadata(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		if !hopHeaders[k] {
			out[k] = v
		}
	}
	return out
}
