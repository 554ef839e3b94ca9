package observe

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// headerStream records what a handler sends.
type headerStream struct {
	grpc.ServerStream
	ctx             context.Context
	header, trailer metadata.MD
	sent            bool
}

func (s *headerStream) Context() context.Context { return s.ctx }
func (s *headerStream) SetHeader(md metadata.MD) error {
	s.header = metadata.Join(s.header, md)
	return nil
}
func (s *headerStream) SendHeader(md metadata.MD) error {
	s.header = metadata.Join(s.header, md)
	s.sent = true
	return nil
}
func (s *headerStream) SetTrailer(md metadata.MD) { s.trailer = metadata.Join(s.trailer, md) }
func (s *headerStream) SendMsg(any) error {
	s.sent = true
	return nil
}

// TestRequestIDOnce: a proxied call returns the request ID once, in the
// header when one is sent (a backend's own echo dropped), else in the
// trailer (a trailers-only answer stays one).
func TestRequestIDOnce(t *testing.T) {
	m := New(nil, nil)
	in := metadata.NewIncomingContext(context.Background(), metadata.Pairs(HeaderRequestID, "abc"))
	info := &grpc.StreamServerInfo{FullMethod: "/pivirt.vm.v1.VMService/GetVM"}

	s := &headerStream{ctx: in}
	err := m.StreamServerInterceptor()(nil, s, info, func(_ any, ss grpc.ServerStream) error {
		if err := ss.SendHeader(metadata.Pairs(HeaderRequestID, "abc", "x-backend", "1")); err != nil {
			return err
		}
		return ss.SendMsg(nil)
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.header.Get(HeaderRequestID); len(got) != 1 || got[0] != "abc" || len(s.header.Get("x-backend")) != 1 {
		t.Errorf("header %v: want one x-request-id and the backend's header", s.header)
	}
	if len(s.trailer.Get(HeaderRequestID)) != 0 {
		t.Errorf("trailer %v: the ID went with the header already", s.trailer)
	}

	s = &headerStream{ctx: in}
	_ = m.StreamServerInterceptor()(nil, s, info, func(_ any, ss grpc.ServerStream) error {
		ss.SetTrailer(metadata.Pairs("grpc-status-details-bin", "x"))
		return errors.New("backend failed")
	})
	if s.sent || len(s.header) != 0 || len(s.trailer.Get(HeaderRequestID)) != 1 {
		t.Errorf("trailers-only answer: header %v (sent %v), trailer %v", s.header, s.sent, s.trailer)
	}
}

// TestAuditNotSampled: audit lines and the access log pass the sampling.
func TestAuditNotSampled(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(NewHandler(slog.NewTextHandler(&buf, nil), Sampling{Initial: 1, Thereafter: 1000}, func() time.Time { return time.Unix(1, 0) }))
	for range 50 {
		logger.Warn("audit: call denied", "audit", true)
		logger.Info("access")
		logger.Info("noise")
	}
	if n := strings.Count(buf.String(), "audit: call denied"); n != 50 {
		t.Errorf("%d of 50 audit lines kept", n)
	}
	if n := strings.Count(buf.String(), "msg=access"); n != 50 {
		t.Errorf("%d of 50 access lines kept", n)
	}
	if n := strings.Count(buf.String(), "msg=noise"); n != 1 {
		t.Errorf("%d noise lines kept, want 1", n)
	}
}
