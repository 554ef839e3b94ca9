package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"testing"
	"time"
)

func startGossip(t *testing.T, name string) *Gossip {
	t.Helper()
	cfg := DefaultGossipConfig()
	cfg.NodeName = name
	cfg.BindAddr = "127.0.0.1:0"
	cfg.Profile = "local"
	cfg.DeadNodeReclaimTime = time.Second
	cfg.ReconnectInterval = time.Second
	// Periodic full exchanges would eventually carry a new address too;
	// without them only the node's own offers can.
	cfg.PushPullInterval = time.Hour
	cfg.Meta = NodeMeta{Cluster: "test", ID: name + "-id"}
	g, err := NewGossip(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Shutdown() })
	return g
}

// waitMember polls until every ring in gs reports member name with the
// given status and address (or deadline).
func waitMember(t *testing.T, gs []*Gossip, name string, status MemberStatus, addr string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var err error
		for _, g := range gs {
			m, ok := g.MemberByID(name + "-id")
			switch {
			case !ok:
				err = fmt.Errorf("%s does not know %s", g.cfg.NodeName, name)
			case m.Status != status || (addr != "" && m.Addr != addr):
				err = fmt.Errorf("%s sees %s %s at %s, want %s at %s", g.cfg.NodeName, name, m.Status, m.Addr, status, addr)
			}
			if err != nil {
				break
			}
		}
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A member killed and started again on a new address right away is still
// alive (or suspect) at its old address in the others' view, so memberlist
// refuses its new alive message as a conflict. The node keeps offering its
// address until they take it, without waiting for a periodic push/pull.
func TestRestartedMemberReclaimsItsNameOnANewAddress(t *testing.T) {
	a, b, c := startGossip(t, "a"), startGossip(t, "b"), startGossip(t, "c")
	for _, g := range []*Gossip{b, c} {
		if _, err := g.Join([]string{a.LocalAddr()}); err != nil {
			t.Fatal(err)
		}
	}
	waitMember(t, []*Gossip{a, b, c}, "c", StatusAlive, c.LocalAddr())
	waitMember(t, []*Gossip{a, b, c}, "b", StatusAlive, b.LocalAddr())

	old := c.LocalAddr()
	if err := c.Shutdown(); err != nil {
		t.Fatal(err)
	}
	c2 := startGossip(t, "c")
	if c2.LocalAddr() == old {
		t.Fatalf("restart kept address %s; the test needs a new one", old)
	}
	if _, err := c2.Join([]string{a.LocalAddr()}); err != nil {
		t.Fatal(err)
	}
	waitMember(t, []*Gossip{a, b}, "c", StatusAlive, c2.LocalAddr())
	waitMember(t, []*Gossip{c2}, "a", StatusAlive, a.LocalAddr())
	waitMember(t, []*Gossip{c2}, "b", StatusAlive, b.LocalAddr())
}

// TestGossipLogLinesKeyOnTheEvent: memberlist's lines about many senders
// become one message with the addresses as attributes, so that log
// sampling (which keys on the message) collapses a flood of junk packets.
func TestGossipLogLinesKeyOnTheEvent(t *testing.T) {
	var buf bytes.Buffer
	w := &slogWriter{logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	for port := 40000; port < 40050; port++ {
		fmt.Fprintf(w, "[ERR] memberlist: Decrypt packet failed: cipher: message authentication failed from=10.1.2.3:%d\n", port)
		fmt.Fprintf(w, "[WARN] memberlist: Failed to connect to [fd00::1]:%d: dial tcp [fd00::1]:%d: i/o timeout\n", port, port)
		// Text the sender chooses cannot replace the source address.
		fmt.Fprintf(w, "[ERR] memberlist: discarding stream with unacceptable label %q: from=6.6.6.6:%d\n", fmt.Sprintf("x%d from=1.2.3.4:5", port), port)
		// A byte dump is one elision, not one per byte.
		fmt.Fprintf(w, "[WARN] memberlist: Refuting an alive message for 'n%d' (10.1.2.3:%d) meta:([123 34 %d] VS [123 35]), vsn:([1 5 2] VS [1 5 2]) from=10.1.2.3:%d\n", port, port, port%200, port)
	}
	msgs := map[string]int{}
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var rec struct {
			Msg  string `json:"msg"`
			From string `json:"from"`
			Text string `json:"text"`
		}
		if err := dec.Decode(&rec); err != nil {
			t.Fatal(err)
		}
		msgs[rec.Msg]++
		if rec.From == "" && !strings.Contains(rec.Text, "fd00::1") {
			t.Errorf("%q lost its address", rec.Msg)
		}
		if strings.Contains(rec.Msg, "label") && !strings.HasPrefix(rec.From, "6.6.6.6:") {
			t.Errorf("the sender's label replaced the source address: from=%q", rec.From)
		}
	}
	want := map[string]int{
		"Decrypt packet failed: cipher: message authentication failed":            50,
		"Failed to connect to …: dial tcp …: i/o timeout":                         50,
		"discarding stream with unacceptable label …:":                            50,
		"Refuting an alive message for … (…) meta:([…] VS […]), vsn:([…] VS […])": 50,
	}
	if !maps.Equal(msgs, want) {
		t.Errorf("messages %v, want %v", msgs, want)
	}
}

// TestReapForgetsUnprovenMembersSooner: a failed member that never proved
// its identity is forgotten after ForgetUnprovenAfter; one that did, or
// failed more recently, is kept (until ForgetAfter).
func TestReapForgetsUnprovenMembersSooner(t *testing.T) {
	g := startGossip(t, "a")
	now := time.Now()
	g.mu.Lock()
	for name, since := range map[string]time.Time{
		"fake":   now.Add(-20 * time.Minute),
		"real":   now.Add(-20 * time.Minute),
		"recent": now.Add(-time.Minute),
		"old":    now.Add(-73 * time.Hour),
	} {
		g.members[name] = &Member{Name: name, Status: StatusFailed, Since: since, Meta: NodeMeta{Cluster: "test", ID: name + "-id"}}
	}
	g.mu.Unlock()
	g.reap(now) // no SetProven yet: only ForgetAfter applies
	if _, ok := g.MemberByID("fake-id"); !ok {
		t.Fatal("fake forgotten before anything said it is unproven")
	}
	g.SetProven(func(m Member) bool { return m.Name == "real" || m.Name == "old" })
	g.reap(now)
	for name, want := range map[string]bool{"fake": false, "real": true, "recent": true, "old": false} {
		if _, ok := g.MemberByID(name + "-id"); ok != want {
			t.Errorf("%s known after the reap: %v, want %v", name, ok, want)
		}
	}
}
