package agent_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/console"
	"pilab.hu/pivirt-agent/identity"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// wsClient is a WebSocket client of the console bridge on one agent.
type wsClient struct {
	e    *accessEnv
	addr string
}

func (c wsClient) httpClient() *http.Client {
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: mustPool(c.e.t, filepath.Join(c.e.dir, identity.ChainFile)), MinVersion: tls.VersionTLS12,
	}}}
}

// dial opens the console of id with token (none when empty), from a page
// of origin (none when empty).
func (c wsClient) dial(ctx context.Context, id, token, origin, query string) (*websocket.Conn, *http.Response, error) {
	protos := []string{console.Subprotocol}
	if token != "" {
		protos = append(protos, console.BearerPrefix+base64.RawURLEncoding.EncodeToString([]byte(token)))
	}
	h := http.Header{}
	if origin != "" {
		h.Set("Origin", origin)
	}
	return websocket.Dial(ctx, "wss://"+c.addr+console.Path+"?id="+id+query, &websocket.DialOptions{
		HTTPClient: c.httpClient(), Subprotocols: protos, HTTPHeader: h,
	})
}

// refusal is the Connect error of a refused handshake.
func refusal(resp *http.Response) (int, string, string) {
	if resp == nil {
		return 0, "", ""
	}
	b, _ := io.ReadAll(resp.Body)
	var e struct{ Code, Message string }
	_ = json.Unmarshal(b, &e)
	return resp.StatusCode, e.Code, e.Message
}

// readUntil reads frames until the output so far contains want; a text
// frame is returned as it comes.
func readUntil(ctx context.Context, t *testing.T, conn *websocket.Conn, want string) (text []byte) {
	t.Helper()
	var out bytes.Buffer
	for !strings.Contains(out.String(), want) {
		typ, b, err := conn.Read(ctx)
		if err != nil {
			t.Fatalf("console read, waiting for %q in %q: %v", want, out.String(), err)
		}
		if typ == websocket.MessageText {
			return b
		}
		out.Write(b)
	}
	return nil
}

// TestConsoleWebSocket: the browser's console, through each node: the
// checks before the upgrade (origin, credentials, RBAC with the owner
// condition, the VM running) answer HTTP errors; a GET without Upgrade
// says why or 426; keystrokes, resizes, the shell's end; a token's
// session ends at its expiry.
func TestConsoleWebSocket(t *testing.T) {
	e := newAccessEnv(t, 2, func(cfg *config.Config) { cfg.Server.ConnectRPC.MaxStreamsPerCaller = 2 })
	e.c.WaitPeers(60*time.Second, 2, 0)
	mine, theirs := e.createVM("alice"), e.createVM("bob")
	admin := e.token("root", "admin")
	if _, err := e.vm.PowerOn(as(e.ctx(), admin), &vmv1.PowerOnRequest{Id: mine}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.vm.PowerOn(as(e.ctx(), admin), &vmv1.PowerOnRequest{Id: theirs}); err != nil {
		t.Fatal(err)
	}
	alice := e.token("alice", "vm-owner")

	for _, n := range e.c.Nodes() {
		c := wsClient{e, n.APIAddr()}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		conn, resp, err := c.dial(ctx, mine, alice, "https://"+n.APIAddr(), "&cols=100&rows=30")
		if err != nil {
			code, ecode, msg := refusal(resp)
			t.Fatalf("alice's console through %s: %v (HTTP %d %s %s)", n.APIAddr(), err, code, ecode, msg)
		}
		if conn.Subprotocol() != console.Subprotocol {
			t.Errorf("subprotocol %q, want %q", conn.Subprotocol(), console.Subprotocol)
		}
		readUntil(ctx, t, conn, ":~# ")
		if err := conn.Write(ctx, websocket.MessageBinary, []byte("stty size\r")); err != nil {
			t.Fatal(err)
		}
		readUntil(ctx, t, conn, "30 100\r\n")
		if err := conn.Write(ctx, websocket.MessageText, []byte(`{"resize":{"cols":120,"rows":40}}`)); err != nil {
			t.Fatal(err)
		}
		if err := conn.Write(ctx, websocket.MessageBinary, []byte("stty size\r")); err != nil {
			t.Fatal(err)
		}
		readUntil(ctx, t, conn, "40 120\r\n")
		if err := conn.Write(ctx, websocket.MessageBinary, []byte("exit 3\r")); err != nil {
			t.Fatal(err)
		}
		text := readUntil(ctx, t, conn, "\x00never")
		if string(text) != `{"closed":{"exitStatus":3,"reason":"the shell exited"}}` {
			t.Errorf("closed frame %s", text)
		}
		if _, _, err := conn.Read(ctx); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
			t.Errorf("after the shell's end: %v, want a normal closure", err)
		}
		cancel()
	}

	c := wsClient{e, e.n.APIAddr()}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for _, x := range []struct {
		name, id, token, origin, query string
		status                         int
		code, says                     string
	}{
		{"bob's VM", theirs, alice, "", "", http.StatusForbidden, "permission_denied", theirs},
		{"no credentials", mine, "", "", "", http.StatusUnauthorized, "unauthenticated", ""},
		{"another site's page", mine, alice, "https://evil.example", "", http.StatusForbidden, "permission_denied", "origin https://evil.example"},
		{"no VM named", "", alice, "", "", http.StatusBadRequest, "invalid_argument", "query parameter id"},
		{"a bad size", mine, alice, "", "&cols=0&rows=5", http.StatusBadRequest, "invalid_argument", "cols"},
		{"a VM that does not exist", "vm-nope", admin, "", "", http.StatusNotFound, "not_found", "vm-nope"},
	} {
		_, resp, err := c.dial(ctx, x.id, x.token, x.origin, x.query)
		status, code, msg := refusal(resp)
		if err == nil || status != x.status || code != x.code || !strings.Contains(msg, x.says) {
			t.Errorf("%s: %v: HTTP %d %s %q, want %d %s saying %q", x.name, err, status, code, msg, x.status, x.code, x.says)
		}
	}

	// Consoles count among a caller's streams: past the bound
	// (server.connectrpc.max_streams_per_caller, 2 here), refused.
	var held []*websocket.Conn
	for range 2 {
		conn, resp, err := c.dial(ctx, mine, alice, "", "")
		if err != nil {
			status, code, msg := refusal(resp)
			t.Fatalf("alice's console: %v (HTTP %d %s %s)", err, status, code, msg)
		}
		held = append(held, conn)
	}
	if _, resp, err := c.dial(ctx, mine, alice, "", ""); err == nil {
		t.Error("a third console of alice's: opened, want refused")
	} else if status, code, msg := refusal(resp); status != http.StatusTooManyRequests || code != "resource_exhausted" || !strings.Contains(msg, "max_streams_per_caller") {
		t.Errorf("a third console of alice's: HTTP %d %s %q, want resource_exhausted", status, code, msg)
	}
	for _, conn := range held {
		_ = conn.Close(websocket.StatusNormalClosure, "")
	}
	agenttest.Eventually(t, 10*time.Second, "a console again once alice closed hers", func() error {
		conn, resp, err := c.dial(ctx, mine, alice, "", "")
		if err != nil {
			status, code, msg := refusal(resp)
			return fmt.Errorf("HTTP %d %s %s", status, code, msg)
		}
		return conn.Close(websocket.StatusNormalClosure, "")
	})

	// A plain GET runs the checks: 426 where the console would open, the
	// reason where not (a browser cannot read a refused handshake).
	probe := func(id, token string) (int, string, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+e.n.APIAddr()+console.Path+"?id="+id, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := c.httpClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return refusal(resp)
	}
	if status, _, _ := probe(mine, alice); status != http.StatusUpgradeRequired {
		t.Errorf("GET of alice's running VM's console: HTTP %d, want 426", status)
	}
	if _, err := e.vm.PowerOff(as(e.ctx(), admin), &vmv1.PowerOffRequest{Id: mine}); err != nil {
		t.Fatal(err)
	}
	if status, code, msg := probe(mine, alice); status != http.StatusBadRequest || code != "failed_precondition" || !strings.Contains(msg, "needs it running") {
		t.Errorf("GET of a stopped VM's console: HTTP %d %s %q, want failed_precondition", status, code, msg)
	}

	// A session opened with a token ends at its expiry: an error frame,
	// then close code 4000 + Unauthenticated (16).
	soon := e.key.Sign(t, e.is.Claims("root", func(c map[string]any) {
		c["roles"] = []string{"admin"}
		c["exp"] = time.Now().Add(3 * time.Second).Unix()
	}))
	conn, resp, err := c.dial(ctx, theirs, soon, "", "")
	if err != nil {
		status, code, msg := refusal(resp)
		t.Fatalf("console with a short token: %v (HTTP %d %s %s)", err, status, code, msg)
	}
	var last error
	agenttest.Eventually(t, 20*time.Second, "the session's end at the token's expiry", func() error {
		typ, b, err := conn.Read(ctx)
		switch {
		case err != nil:
			last = err
			return nil
		case typ == websocket.MessageText && !bytes.Contains(b, []byte(`"code":"unauthenticated"`)):
			return fmt.Errorf("text frame %s, want the unauthenticated error", b)
		}
		return errors.New("still open")
	})
	if websocket.CloseStatus(last) != 4016 {
		t.Errorf("the session's end at the token's expiry: %v, want close code 4016", last)
	}
}
