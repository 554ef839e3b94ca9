package gateway

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	hv1 "google.golang.org/grpc/health/grpc_health_v1"
)

// healthGRPC answers SERVING: the answer of the grpc-go side of the mux.
type healthGRPC struct{ hv1.UnimplementedHealthServer }

func (healthGRPC) Check(context.Context, *hv1.HealthCheckRequest) (*hv1.HealthCheckResponse, error) {
	return &hv1.HealthCheckResponse{Status: hv1.HealthCheckResponse_SERVING}, nil
}

const healthCheck = "/grpc.health.v1.Health/Check"

// startMux serves a ProtocolMux on 127.0.0.1: grpc-go answers health
// checks with SERVING, net/http (Connect) with NOT_SERVING, and GET /plain
// with "plain".
func startMux(t *testing.T) string {
	t.Helper()
	return startMuxTimeout(t, 5*time.Second)
}

// startMuxTimeout is startMux with the mux's classification timeout.
func startMuxTimeout(t *testing.T, readTimeout time.Duration) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pm := NewProtocolMux(ln, readTimeout)
	gs := grpc.NewServer()
	hv1.RegisterHealthServer(gs, healthGRPC{})
	mux := http.NewServeMux()
	mux.Handle(healthCheck, connect.NewUnaryHandler(healthCheck,
		func(context.Context, *connect.Request[hv1.HealthCheckRequest]) (*connect.Response[hv1.HealthCheckResponse], error) {
			return connect.NewResponse(&hv1.HealthCheckResponse{Status: hv1.HealthCheckResponse_NOT_SERVING}), nil
		}))
	mux.HandleFunc("GET /plain", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "plain") })
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	hs := &http.Server{Handler: SplitGRPC(mux, gs), Protocols: &protos, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{}, 3)
	go func() { _ = gs.Serve(pm.GRPC); done <- struct{}{} }()
	go func() { _ = hs.Serve(pm.HTTP); done <- struct{}{} }()
	go func() {
		if err := pm.Serve(); err != nil {
			t.Errorf("mux: %v", err)
		}
		done <- struct{}{}
	}()
	t.Cleanup(func() {
		gs.Stop()
		_ = hs.Close()
		_ = ln.Close()
		for range 3 {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Error("servers did not stop")
				return
			}
		}
	})
	return ln.Addr().String()
}

func TestProtocolMuxRoutesByProtocol(t *testing.T) {
	addr := startMux(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// A connection is classified by its first request, so each protocol
	// gets its own client (connection pool), as a real client has.
	var h2c, h1 http.Protocols
	h2c.SetUnencryptedHTTP2(true)
	h1.SetHTTP1(true)
	newClient := func(p *http.Protocols) *http.Client {
		c := &http.Client{Transport: &http.Transport{Protocols: p}}
		t.Cleanup(c.CloseIdleConnections)
		return c
	}
	h1Client := newClient(&h1)
	url := "http://" + addr + healthCheck

	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	grpcGo := hv1.NewHealthClient(cc)

	cases := []struct {
		name string
		call func() (hv1.HealthCheckResponse_ServingStatus, error)
		want hv1.HealthCheckResponse_ServingStatus
	}{
		{"grpc-go client reaches grpc-go", func() (hv1.HealthCheckResponse_ServingStatus, error) {
			r, err := grpcGo.Check(ctx, &hv1.HealthCheckRequest{})
			return r.GetStatus(), err
		}, hv1.HealthCheckResponse_SERVING},
		{"connect gRPC protocol over h2c reaches grpc-go", connectCall(ctx, newClient(&h2c), url, connect.WithGRPC()), hv1.HealthCheckResponse_SERVING},
		{"connect protocol over h2c reaches net/http", connectCall(ctx, newClient(&h2c), url), hv1.HealthCheckResponse_NOT_SERVING},
		{"connect protocol over HTTP/1.1 reaches net/http", connectCall(ctx, newClient(&h1), url), hv1.HealthCheckResponse_NOT_SERVING},
		{"gRPC-Web over h2c reaches net/http", connectCall(ctx, newClient(&h2c), url, connect.WithGRPCWeb()), hv1.HealthCheckResponse_NOT_SERVING},
		{"gRPC-Web over HTTP/1.1 reaches net/http", connectCall(ctx, newClient(&h1), url, connect.WithGRPCWeb()), hv1.HealthCheckResponse_NOT_SERVING},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Several calls: they share one connection, which must stay
			// healthy after the first.
			for i := range 5 {
				got, err := tc.call()
				if err != nil {
					t.Fatalf("call %d: %v", i, err)
				}
				if got != tc.want {
					t.Fatalf("call %d: answered by the wrong server: %v, want %v", i, got, tc.want)
				}
			}
		})
	}

	resp, err := h1Client.Get("http://" + addr + "/plain")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "plain" {
		t.Fatalf("GET /plain = %q", body)
	}
}

// A client that opens its connection and makes its first call only after
// the mux's classification timeout (a pooled or reconnected channel) is
// served in its own protocol: the connection went to net/http, which hands
// gRPC requests to the gRPC server.
func TestProtocolMuxFirstCallAfterIdle(t *testing.T) {
	const readTimeout = 200 * time.Millisecond
	addr := startMuxTimeout(t, readTimeout)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	cc.Connect()
	for s := cc.GetState(); s != connectivity.Ready; s = cc.GetState() {
		if !cc.WaitForStateChange(ctx, s) {
			t.Fatalf("the gRPC connection did not become ready: %v", s)
		}
	}
	grpcGo := hv1.NewHealthClient(cc)

	// HTTP/2 clients of net/http, with a connection opened by a first
	// request that the mux classified as HTTP (GET /plain).
	var h2c http.Protocols
	h2c.SetUnencryptedHTTP2(true)
	opened := func() *http.Client {
		c := &http.Client{Transport: &http.Transport{Protocols: &h2c}}
		t.Cleanup(c.CloseIdleConnections)
		resp, err := c.Get("http://" + addr + "/plain")
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return c
	}
	url := "http://" + addr + healthCheck
	connectH2, grpcH2, webH2 := opened(), opened(), opened()

	// The idle time is the subject of the test: longer than the mux's
	// classification timeout, with nothing sent.
	time.Sleep(3 * readTimeout)

	cases := []struct {
		name string
		call func() (hv1.HealthCheckResponse_ServingStatus, error)
		want hv1.HealthCheckResponse_ServingStatus
	}{
		{"grpc-go client", func() (hv1.HealthCheckResponse_ServingStatus, error) {
			r, err := grpcGo.Check(ctx, &hv1.HealthCheckRequest{})
			return r.GetStatus(), err
		}, hv1.HealthCheckResponse_SERVING},
		{"connect gRPC protocol over h2c", connectCall(ctx, grpcH2, url, connect.WithGRPC()), hv1.HealthCheckResponse_SERVING},
		{"connect protocol over h2c", connectCall(ctx, connectH2, url), hv1.HealthCheckResponse_NOT_SERVING},
		{"gRPC-Web over h2c", connectCall(ctx, webH2, url, connect.WithGRPCWeb()), hv1.HealthCheckResponse_NOT_SERVING},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for i := range 3 {
				got, err := tc.call()
				if err != nil {
					t.Fatalf("call %d: %v", i, err)
				}
				if got != tc.want {
					t.Fatalf("call %d: answered by the wrong server: %v, want %v", i, got, tc.want)
				}
			}
		})
	}
}

func connectCall(ctx context.Context, hc *http.Client, url string, opts ...connect.ClientOption) func() (hv1.HealthCheckResponse_ServingStatus, error) {
	c := connect.NewClient[hv1.HealthCheckRequest, hv1.HealthCheckResponse](hc, url, opts...)
	return func() (hv1.HealthCheckResponse_ServingStatus, error) {
		r, err := c.CallUnary(ctx, connect.NewRequest(&hv1.HealthCheckRequest{}))
		if err != nil {
			return 0, err
		}
		return r.Msg.GetStatus(), nil
	}
}

// An HTTP/2 connection to net/http through the mux sees exactly the
// frames a direct connection would: a raw client acknowledges both SETTINGS
// frames (the mux's and the server's) and keeps a working connection with
// no GOAWAY.
func TestProtocolMuxRawHTTP2ConnectionStaysHealthy(t *testing.T) {
	addr := startMux(t)
	c := dialAndSend(t, addr, 10*time.Second, http2.ClientPreface)
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var hdr bytes.Buffer
	enc := newHPACK(&hdr)
	enc(":method", "GET")
	enc(":scheme", "http")
	enc(":authority", addr)
	enc(":path", "/plain")
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	settings, gotData := 0, false
	for !gotData {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read frame: %v (settings frames seen %d)", err, settings)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				settings++
				if err := fr.WriteSettingsAck(); err != nil {
					t.Fatal(err)
				}
			}
		case *http2.GoAwayFrame:
			t.Fatalf("server sent GOAWAY %v: %s", f.ErrCode, f.DebugData())
		case *http2.DataFrame:
			if string(f.Data()) != "plain" {
				t.Fatalf("data %q", f.Data())
			}
			gotData = true
		}
	}
	if settings != 2 {
		t.Fatalf("%d SETTINGS frames, want 2 (the mux's and net/http's)", settings)
	}
	// A PING answered proves the connection survived the acknowledgements.
	if err := fr.WritePing(false, [8]byte{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read frame after ack: %v", err)
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			t.Fatalf("server sent GOAWAY %v: %s", g.ErrCode, g.DebugData())
		}
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() {
			return
		}
	}
}

// frame returns an HTTP/2 frame.
func frame(typ, flags byte, payload []byte) []byte {
	b := make([]byte, 9, 9+len(payload))
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], uint32(len(payload)))
	copy(b[:3], l[1:])
	b[3], b[4] = typ, flags
	binary.BigEndian.PutUint32(b[5:], 1)
	return append(b, payload...)
}

// oneByteConn returns its data one byte per Read: every split point of
// the stream is exercised.
type oneByteConn struct {
	net.Conn
	r io.Reader
}

func (c oneByteConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	return c.r.Read(p[:1])
}

func TestSettingsAckConnRemovesOnlyTheFirstAck(t *testing.T) {
	ack := frame(frameTypeSettings, flagSettingsAck, nil)
	// A DATA frame whose payload looks like a SETTINGS ack must pass.
	lookalike := frame(0x0, 0, ack)
	settings := frame(frameTypeSettings, 0, []byte{0, 3, 0, 0, 0, 100})
	headers := frame(0x1, 0x4, []byte("hpack block"))
	pre := []byte(http2.ClientPreface)
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

	cases := []struct {
		name    string
		in, out []byte
	}{
		{"http2: first ack removed, second kept",
			cat(pre, settings, lookalike, headers, ack, headers, ack),
			cat(pre, settings, lookalike, headers, headers, ack)},
		{"http2 without any ack", cat(pre, settings, headers), cat(pre, settings, headers)},
		{"http/1.1 untouched", []byte("POST /x HTTP/1.1\r\nHost: a\r\n\r\n" + string(ack)), []byte("POST /x HTTP/1.1\r\nHost: a\r\n\r\n" + string(ack))},
		{"short non-preface", []byte("PRI"), []byte("PRI")},
		{"truncated frame header handed over", cat(pre, settings, ack[:4]), cat(pre, settings, ack[:4])},
	}
	for _, tc := range cases {
		for _, split := range []bool{false, true} {
			var r io.Reader = bytes.NewReader(tc.in)
			var conn net.Conn = fakeConn{r: r}
			if split {
				conn = oneByteConn{r: r}
			}
			got, err := io.ReadAll(&settingsAckConn{Conn: conn})
			if err != nil {
				t.Fatalf("%s (split %v): %v", tc.name, split, err)
			}
			if !bytes.Equal(got, tc.out) {
				t.Errorf("%s (split %v):\n got %q\nwant %q", tc.name, split, got, tc.out)
			}
		}
	}
}

type fakeConn struct {
	net.Conn
	r io.Reader
}

func (c fakeConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func TestIsGRPCContentType(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc":               true,
		"application/grpc+proto":         true,
		"application/grpc+json":          true,
		"application/grpc;charset=utf-8": true,
		"application/grpc-web":           false,
		"application/grpc-web+proto":     false,
		"application/grpc-web-text":      false,
		"application/proto":              false,
		"application/connect+proto":      false,
		"":                               false,
		"application/grpcx":              false,
	} {
		if got := isGRPCContentType(ct); got != want {
			t.Errorf("isGRPCContentType(%q) = %v, want %v", ct, got, want)
		}
	}
}

// newHPACK returns a function that appends one encoded header field to w.
func newHPACK(w *bytes.Buffer) func(name, value string) {
	e := hpack.NewEncoder(w)
	return func(name, value string) { _ = e.WriteField(hpack.HeaderField{Name: name, Value: value}) }
}

// A request shorter than the HTTP/2 preface is classified at its first
// byte, not after the classifier's read timeout.
func TestProtocolMuxShortHTTP10Request(t *testing.T) {
	addr := startMux(t)
	c := dialAndSend(t, addr, 3*time.Second, "GET /plain HTTP/1.0\r\n\r\n") // well below the mux's 5 s read timeout
	body, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read answer: %v (got %q)", err, body)
	}
	if !bytes.Contains(body, []byte("200 OK")) || !bytes.HasSuffix(body, []byte("plain")) {
		t.Fatalf("answer %q", body)
	}
}

// A client that sends huge frames instead of a request cannot make the
// classifier buffer them: the connection is handed to net/http after at
// most sniffLimit bytes, which rejects it.
func TestProtocolMuxBoundsWhatItBuffers(t *testing.T) {
	addr := startMux(t)
	c := dialAndSend(t, addr, 10*time.Second, http2.ClientPreface)
	// A frame of an unknown type announcing 1 MB; keep writing until the
	// server closes the connection or 8 MB went out.
	hdr := frame(0xfa, 0, nil)
	hdr[0], hdr[1], hdr[2] = 0x10, 0, 0 // length 1 MB
	chunk := make([]byte, 64<<10)
	written := 0
	if _, err := c.Write(hdr); err == nil {
		for written < 8<<20 {
			n, err := c.Write(chunk)
			written += n
			if err != nil {
				break
			}
		}
	}
	if written >= 8<<20 {
		t.Fatalf("the server kept reading %d bytes of a frame above the maximum size", written)
	}
}

// Closing the listener ends the classification of idle connections at once
// (cmux's Serve would otherwise wait for each until the read timeout), and
// Serve reports a closed listener as a normal stop.
func TestProtocolMuxStopsWithoutWaitingForIdleConnections(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const readTimeout = 30 * time.Second
	pm := NewProtocolMux(ln, readTimeout)
	served := make(chan error, 1)
	go func() { served <- pm.Serve() }()
	var idle []net.Conn
	for range 3 {
		c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
		defer c.Close()
	}
	// Wait until the mux holds them (accepted, being classified).
	track := pm.GRPC.(handoff).t
	deadline := time.Now().Add(5 * time.Second)
	for {
		track.mu.Lock()
		n := len(track.conns)
		track.mu.Unlock()
		if n == len(idle) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d connections accepted", n, len(idle))
		}
		time.Sleep(time.Millisecond)
	}
	if err := pm.HTTP.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("Serve after Close: %v, want nil", err)
		}
	case <-time.After(readTimeout / 2):
		t.Fatal("Serve still waits for idle connections after the listener was closed")
	}
	for _, c := range idle {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Error("an idle connection was left open")
		}
	}
}

// dialAndSend connects to addr, gives the connection a deadline and sends
// first; the connection is closed at the end of the test.
func dialAndSend(t *testing.T, addr string, deadline time.Duration, first string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(deadline))
	if _, err := io.WriteString(c, first); err != nil {
		t.Fatal(err)
	}
	return c
}
