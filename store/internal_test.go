package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

func TestMapRaftError(t *testing.T) {
	tests := []struct {
		name string
		in   error
		want error
	}{
		{"not leader", raft.ErrNotLeader, ErrNotLeader},
		{"leadership lost", raft.ErrLeadershipLost, ErrLeadershipLost},
		{"shutdown", raft.ErrRaftShutdown, ErrShutdown},
		{"enqueue timeout", raft.ErrEnqueueTimeout, ErrTimeout},
		{"cant bootstrap", raft.ErrCantBootstrap, ErrAlreadyBootstrapped},
		{"not voter", raft.ErrNotVoter, ErrNotVoter},
		{"transfer in progress", raft.ErrLeadershipTransferInProgress, ErrLeadershipTransferInProgress},
		{"aborted by restore", raft.ErrAbortedByRestore, ErrAbortedByRestore},
		{"wrapped", fmt.Errorf("ctx: %w", raft.ErrNotLeader), ErrNotLeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := mapRaftError(tt.in)
			if !errors.Is(got, tt.want) {
				t.Errorf("mapRaftError(%v) = %v, want errors.Is %v", tt.in, got, tt.want)
			}
			if !errors.Is(got, tt.in) {
				t.Errorf("mapRaftError(%v) = %v, lost the raft cause", tt.in, got)
			}
			if got.Error() != tt.want.Error() {
				t.Errorf("message = %q, want %q", got.Error(), tt.want.Error())
			}
		})
	}
	if got := mapRaftError(nil); got != nil {
		t.Errorf("mapRaftError(nil) = %v, want nil", got)
	}
	other := errors.New("configuration changed since 3 (latest is 4)")
	if got := mapRaftError(other); got != other {
		t.Errorf("mapRaftError(unmapped) = %v, want it unchanged", got)
	}
}

func TestContextError(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := contextError(ctx); !errors.Is(err, context.Canceled) || errors.Is(err, ErrTimeout) {
		t.Errorf("cancelled: got %v, want context.Canceled and not ErrTimeout", err)
	}
	ctx, cancel = context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	err := contextError(ctx)
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("deadline: got %v, want ErrTimeout and context.DeadlineExceeded", err)
	}
	if _, err := enqueueTimeout(ctx); !errors.Is(err, ErrTimeout) {
		t.Errorf("enqueueTimeout(expired) = %v, want ErrTimeout", err)
	}
	ctx2, cancel2 := context.WithTimeout(t.Context(), time.Hour)
	defer cancel2()
	if d, err := enqueueTimeout(ctx2); err != nil || d <= 0 || d > time.Hour {
		t.Errorf("enqueueTimeout(1h) = %v, %v; want (0,1h], nil", d, err)
	}
	if d, err := enqueueTimeout(t.Context()); err != nil || d != 0 {
		t.Errorf("enqueueTimeout(no deadline) = %v, %v; want 0, nil", d, err)
	}
}

func decodeRecords(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("decode %q: %v", line, err)
		}
		out = append(out, m)
	}
	buf.Reset()
	return out
}

func TestHCLogAdapter(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var a hclog.Logger = newHCLogAdapter(l)

	a.Trace("hidden")
	a.Debug("dbg", "k", 1)
	a.Named("transport").With("peer", "n2").Warn("slow", "error", errors.New("boom"), "cmd", hclog.Fmt("%d-%s", 7, "x"))
	a.Log(hclog.Off, "never")
	recs := decodeRecords(t, &buf)
	if len(recs) != 2 {
		t.Fatalf("got %d records, want 2: %v", len(recs), recs)
	}
	tests := []struct {
		rec  map[string]any
		want map[string]any
	}{
		{recs[0], map[string]any{"msg": "dbg", "level": "DEBUG", "component": "raft", "k": float64(1)}},
		{recs[1], map[string]any{"msg": "slow", "level": "WARN", "component": "raft", "logger": "transport", "peer": "n2", "error": "boom", "cmd": "7-x"}},
	}
	for _, tt := range tests {
		for k, v := range tt.want {
			if tt.rec[k] != v {
				t.Errorf("record %v: %s = %v, want %v", tt.rec, k, tt.rec[k], v)
			}
		}
	}

	if a.IsTrace() || !a.IsDebug() || !a.IsError() {
		t.Errorf("IsTrace/IsDebug/IsError = %v/%v/%v, want false/true/true", a.IsTrace(), a.IsDebug(), a.IsError())
	}
	if got := a.GetLevel(); got != hclog.Debug {
		t.Errorf("GetLevel = %v, want Debug", got)
	}
	if got := a.Named("a").Named("b").Name(); got != "a.b" {
		t.Errorf("Named(a).Named(b).Name() = %q, want a.b", got)
	}
	if got := a.Named("a").ResetNamed("c").Name(); got != "c" {
		t.Errorf("ResetNamed = %q, want c", got)
	}

	std := a.StandardLogger(&hclog.StandardLoggerOptions{InferLevels: true})
	std.Print("[ERR] broken pipe")
	std.Print("plain line")
	recs = decodeRecords(t, &buf)
	if len(recs) != 2 || recs[0]["level"] != "ERROR" || recs[0]["msg"] != "broken pipe" || recs[1]["level"] != "INFO" {
		t.Errorf("standard logger records = %v, want ERROR 'broken pipe' then INFO", recs)
	}

	var nilAdapter hclog.Logger = newHCLogAdapter(nil)
	nilAdapter.Error("discarded")
	if nilAdapter.IsError() {
		t.Error("nil logger adapter reports IsError, want everything discarded")
	}
}

func TestConfigValidate(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	valid := DefaultConfig()
	valid.NodeID = "n1"
	valid.DataDir = t.TempDir()
	valid.StreamLayer = NewTCPStreamLayer(ln, nil)
	valid.FSM = nopFSM{}
	if err := valid.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}

	tests := []struct {
		name   string
		mutate func(c *Config)
		field  string
	}{
		{"no node id", func(c *Config) { c.NodeID = "" }, "NodeID"},
		{"no data dir", func(c *Config) { c.DataDir = "" }, "DataDir"},
		{"no stream layer", func(c *Config) { c.StreamLayer = nil }, "StreamLayer"},
		{"no fsm", func(c *Config) { c.FSM = nil }, "FSM"},
		{"retain 0", func(c *Config) { c.SnapshotRetain = 0 }, "SnapshotRetain"},
		{"threshold 0", func(c *Config) { c.SnapshotThreshold = 0 }, "SnapshotThreshold"},
		{"interval tiny", func(c *Config) { c.SnapshotInterval = time.Millisecond }, "SnapshotInterval"},
		{"heartbeat tiny", func(c *Config) { c.HeartbeatTimeout = time.Millisecond }, "HeartbeatTimeout"},
		{"election below heartbeat", func(c *Config) { c.ElectionTimeout = c.HeartbeatTimeout / 2 }, "ElectionTimeout"},
		{"lease above heartbeat", func(c *Config) { c.LeaderLeaseTimeout = 2 * c.HeartbeatTimeout }, "LeaderLeaseTimeout"},
		{"commit timeout 0", func(c *Config) { c.CommitTimeout = 0 }, "CommitTimeout"},
		{"max append 0", func(c *Config) { c.MaxAppendEntries = 0 }, "MaxAppendEntries"},
		{"max append too big", func(c *Config) { c.MaxAppendEntries = 2048 }, "MaxAppendEntries"},
		{"negative cache", func(c *Config) { c.LogCacheSize = -1 }, "LogCacheSize"},
		{"pool 0", func(c *Config) { c.TransportMaxPool = 0 }, "TransportMaxPool"},
		{"transport timeout 0", func(c *Config) { c.TransportTimeout = 0 }, "TransportTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid
			tt.mutate(&c)
			err := c.Validate()
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("Validate() = %v, want a *ConfigError", err)
			}
			if ce.Field != tt.field {
				t.Errorf("Field = %q, want %q (error: %v)", ce.Field, tt.field, err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("message %q does not name %s", err.Error(), tt.field)
			}
		})
	}

	var empty Config
	err = empty.Validate()
	for _, f := range []string{"NodeID", "DataDir", "StreamLayer", "FSM"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("zero Config: error %q does not name %s", err, f)
		}
	}
}

func TestTCPStreamLayer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sl := NewTCPStreamLayer(ln, nil)
	defer sl.Close()
	if sl.Addr().String() != ln.Addr().String() {
		t.Errorf("Addr() = %v, want the listener's %v", sl.Addr(), ln.Addr())
	}
	adv := &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 9000}
	if got := NewTCPStreamLayer(ln, adv).Addr(); got != adv {
		t.Errorf("Addr() with advertise = %v, want %v", got, adv)
	}

	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := sl.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := sl.Dial(raft.ServerAddress(ln.Addr().String()), time.Second)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer c.Close()
	sc, ok := <-accepted
	if !ok {
		t.Fatal("Accept failed")
	}
	sc.Close()
}

type nopFSM struct{}

func (nopFSM) Apply(*raft.Log) any                 { return nil }
func (nopFSM) Snapshot() (raft.FSMSnapshot, error) { return nil, errors.New("nop") }
func (nopFSM) Restore(rc io.ReadCloser) error      { return rc.Close() }
