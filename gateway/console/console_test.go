package console

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// echoVM's console echoes input, says the window size on "size", ends
// on "bye" with status 2, and refuses VM "off".
type echoVM struct {
	vmv1.UnimplementedVMServiceServer
}

func (echoVM) Console(s grpc.BidiStreamingServer[vmv1.ConsoleRequest, vmv1.ConsoleResponse]) error {
	first, err := s.Recv()
	if err != nil {
		return err
	}
	if first.GetId() == "off" {
		return status.Error(codes.FailedPrecondition, `vm "off" is stopped`)
	}
	size := first.GetSize()
	if err := s.Send(&vmv1.ConsoleResponse{Output: []byte("hello " + first.GetId() + "\r\n")}); err != nil {
		return err
	}
	for {
		m, err := s.Recv()
		if err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		if m.GetSize() != nil {
			size = m.GetSize()
		}
		switch in := string(m.GetInput()); in {
		case "":
		case "size":
			err = s.Send(&vmv1.ConsoleResponse{Output: []byte(sizeText(size))})
		case "bye":
			err = s.Send(&vmv1.ConsoleResponse{Output: []byte("bye\r\n"), Closed: &vmv1.ConsoleClosed{Reason: "the shell exited", ExitStatus: 2}})
			if err == nil {
				return nil
			}
		default:
			err = s.Send(&vmv1.ConsoleResponse{Output: m.GetInput()})
		}
		if err != nil {
			return err
		}
	}
}

func sizeText(s *vmv1.ConsoleSize) string {
	if s == nil {
		return "none"
	}
	b, _ := json.Marshal(s)
	return string(b)
}

// serve runs the bridge in front of a gRPC server with echoVM.
func serve(t *testing.T, h *Handler) string {
	t.Helper()
	gs := grpc.NewServer()
	vmv1.RegisterVMServiceServer(gs, echoVM{})
	h.GRPC = gs
	mux := http.NewServeMux()
	mux.Handle("GET "+Path, h)
	srv := httptest.NewServer(mux)
	t.Cleanup(func() { srv.Close(); gs.Stop() })
	return strings.TrimPrefix(srv.URL, "http://")
}

func dial(t *testing.T, ctx context.Context, addr, query string) *websocket.Conn {
	t.Helper()
	conn, resp, err := websocket.Dial(ctx, "ws://"+addr+Path+"?"+query, &websocket.DialOptions{Subprotocols: []string{Subprotocol}})
	if err != nil {
		b := []byte{}
		if resp != nil {
			b, _ = io.ReadAll(resp.Body)
		}
		t.Fatalf("dial: %v %s", err, b)
	}
	return conn
}

func read(t *testing.T, ctx context.Context, conn *websocket.Conn) (websocket.MessageType, string) {
	t.Helper()
	typ, b, err := conn.Read(ctx)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return typ, string(b)
}

func TestBridge(t *testing.T) {
	stopping := make(chan struct{})
	addr := serve(t, &Handler{Stopping: stopping, PingInterval: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	// Output, input, resizes and the session's end.
	conn := dial(t, ctx, addr, "id=vm-1&cols=80&rows=24")
	if _, s := read(t, ctx, conn); s != "hello vm-1\r\n" {
		t.Fatalf("first output %q", s)
	}
	for _, step := range []struct {
		typ       websocket.MessageType
		send, get string
	}{
		{websocket.MessageBinary, "size", `{"cols":80,"rows":24}`},
		{websocket.MessageText, `{"resize":{"cols":132,"rows":43}}`, ""},
		{websocket.MessageBinary, "size", `{"cols":132,"rows":43}`},
		{websocket.MessageBinary, "é\x03", "é\x03"},
		{websocket.MessageBinary, "bye", "bye\r\n"},
	} {
		if err := conn.Write(ctx, step.typ, []byte(step.send)); err != nil {
			t.Fatal(err)
		}
		if step.get == "" {
			continue
		}
		if typ, s := read(t, ctx, conn); typ != websocket.MessageBinary || s != step.get {
			t.Fatalf("after %q: %v %q, want %q", step.send, typ, s, step.get)
		}
	}
	if typ, s := read(t, ctx, conn); typ != websocket.MessageText || s != `{"closed":{"exitStatus":2,"reason":"the shell exited"}}` {
		t.Fatalf("closed frame %v %q", typ, s)
	}
	if _, _, err := conn.Read(ctx); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		t.Fatalf("after closed: %v, want 1000", err)
	}

	// An idle session outlives many pings (the client answers them while
	// it reads).
	conn = dial(t, ctx, addr, "id=vm-2")
	read(t, ctx, conn)
	idle, idleCancel := context.WithTimeout(ctx, 500*time.Millisecond)
	_, _, err := conn.Read(idle)
	idleCancel()
	if err == nil || websocket.CloseStatus(err) != -1 {
		t.Fatalf("idle session: %v, want only the reader's own timeout", err)
	}
	conn = dial(t, ctx, addr, "id=vm-3")
	read(t, ctx, conn)

	// A bad text frame: 1008. A frame over the limit: 1009.
	if err := conn.Write(ctx, websocket.MessageText, []byte(`{"resize":{"cols":0}}`)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := conn.Read(ctx); websocket.CloseStatus(err) != websocket.StatusPolicyViolation {
		t.Errorf("bad text frame: %v, want 1008", err)
	}
	conn = dial(t, ctx, addr, "id=vm-4")
	read(t, ctx, conn)
	_ = conn.Write(ctx, websocket.MessageBinary, make([]byte, MaxInput+1))
	if _, _, err := conn.Read(ctx); websocket.CloseStatus(err) != websocket.StatusMessageTooBig {
		t.Errorf("a frame over %d bytes: %v, want 1009", MaxInput, err)
	}

	// The agent stopping: 1001.
	conn = dial(t, ctx, addr, "id=vm-5")
	read(t, ctx, conn)
	close(stopping)
	if _, _, err := conn.Read(ctx); websocket.CloseStatus(err) != websocket.StatusGoingAway {
		t.Errorf("the agent stopping: %v, want 1001", err)
	}
}

func TestBridgeRefusals(t *testing.T) {
	addr := serve(t, &Handler{Origins: func() []string { return []string{"https://console.example"} }})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	get := func(query string, h http.Header) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+Path+"?"+query, nil)
		for k, v := range h {
			req.Header[k] = v
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	upgrade := http.Header{"Connection": {"Upgrade"}, "Upgrade": {"websocket"}, "Sec-Websocket-Version": {"13"}, "Sec-Websocket-Key": {"dGhlIHNhbXBsZSBub25jZQ=="}}
	for _, x := range []struct {
		name, query string
		h           http.Header
		status      int
		says        string
	}{
		{"a running VM, no Upgrade", "id=vm-1", nil, http.StatusUpgradeRequired, "opens"},
		{"a stopped VM", "id=off", nil, http.StatusBadRequest, `"code":"failed_precondition"`},
		{"no VM", "", nil, http.StatusBadRequest, "query parameter id"},
		{"half a size", "id=vm-1&cols=80", nil, http.StatusBadRequest, "both"},
		{"another site", "id=vm-1", http.Header{"Origin": {"https://evil.example"}}, http.StatusForbidden, "origin https://evil.example"},
		{"a configured origin", "id=vm-1", http.Header{"Origin": {"https://console.example"}}, http.StatusUpgradeRequired, "opens"},
		{"the page's own origin", "id=vm-1", http.Header{"Origin": {"http://" + addr}}, http.StatusUpgradeRequired, "opens"},
		{"an upgrade without the subprotocol", "id=vm-1", upgrade, http.StatusBadRequest, Subprotocol},
		{"a bearer subprotocol that is not base64url", "id=vm-1", http.Header{"Sec-Websocket-Protocol": {Subprotocol + ", bearer.!!"}}, http.StatusUnauthorized, "base64url"},
	} {
		status, body := get(x.query, x.h)
		if status != x.status || !strings.Contains(body, x.says) {
			t.Errorf("%s: HTTP %d %s, want %d saying %q", x.name, status, body, x.status, x.says)
		}
	}
}
