package fsm

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm/fsmtest"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// applyCase is one command applied after setup commands. Setup command i is
// applied at index i+1 and time at(i+1); the command under test at the next
// index and second.
type applyCase struct {
	name    string
	mods    []func(*Config)
	setup   []*fsmv1.Command
	cmd     *fsmv1.Command
	wantErr error
	check   func(t *testing.T, h *harness, res *Result)
}

func runApplyCases(t *testing.T, cases []applyCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.mods...)
			for _, c := range tc.setup {
				h.now = h.now.Add(time.Second)
				h.mustApply(c)
			}
			h.now = h.now.Add(time.Second)
			before := dumpTables(t, h.f)
			res := h.apply(tc.cmd)
			if res.Index != h.index {
				t.Errorf("Result.Index = %d, want %d", res.Index, h.index)
			}
			if got := h.f.AppliedIndex(); got != h.index {
				t.Errorf("AppliedIndex() = %d, want %d", got, h.index)
			}
			if res.Duplicate {
				t.Errorf("Result.Duplicate = true, want false")
			}
			switch {
			case tc.wantErr == nil && res.Err != nil:
				t.Fatalf("Result.Err = %v, want nil", res.Err)
			case tc.wantErr != nil && !errors.Is(res.Err, tc.wantErr):
				t.Fatalf("Result.Err = %v, want %v", res.Err, tc.wantErr)
			}
			if tc.wantErr != nil {
				if res.Value != nil {
					t.Errorf("Result.Value = %v, want nil on error", res.Value)
				}
				if after := dumpTables(t, h.f); !reflect.DeepEqual(before, after) {
					t.Errorf("rejected command changed the state:\nbefore %v\nafter  %v", before, after)
				}
			}
			if tc.check != nil {
				tc.check(t, h, res)
			}
		})
	}
}

// wantFieldErr checks that an ErrInvalidCommand names the field.
func wantField(field string) func(t *testing.T, h *harness, res *Result) {
	return func(t *testing.T, h *harness, res *Result) {
		t.Helper()
		if !strings.Contains(res.Err.Error(), field) {
			t.Errorf("error %q does not name the field %q", res.Err, field)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		mod     func(*Config)
		wantErr bool
	}{
		{"default", func(*Config) {}, false},
		{"nil logger", func(c *Config) { c.Logger = nil }, false},
		{"history limit 0", func(c *Config) { c.ConfigHistoryLimit = 0 }, true},
		{"dedupe window 0", func(c *Config) { c.DedupeWindow = 0 }, true},
		{"dedupe window negative", func(c *Config) { c.DedupeWindow = -time.Second }, true},
		{"max run history 0", func(c *Config) { c.MaxRunHistory = 0 }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			tt.mod(&cfg)
			err := cfg.Validate()
			if (err != nil) != tt.wantErr {
				t.Fatalf("Validate() = %v, want error %v", err, tt.wantErr)
			}
			if err != nil && !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("Validate() = %v, want ErrInvalidConfig", err)
			}
			if _, nerr := New(cfg); (nerr != nil) != tt.wantErr {
				t.Errorf("New() = %v, want error %v", nerr, tt.wantErr)
			}
		})
	}
}

func TestEncodeDecode(t *testing.T) {
	cmd := withClient(register(instance("web", "a")), "client-1", 7)
	cmd.Time = at(0)
	b, err := Encode(cmd)
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	if b[0] != CommandVersion {
		t.Errorf("version byte = %d, want %d", b[0], CommandVersion)
	}
	got, err := Decode(b)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if !proto.Equal(got, cmd) {
		t.Errorf("Decode(Encode(cmd)) = %v, want %v", got, cmd)
	}
	if _, err := Encode(nil); err == nil {
		t.Errorf("Encode(nil) = nil error, want an error")
	}

	tests := []struct {
		name    string
		data    []byte
		wantErr error
	}{
		{"nil", nil, ErrInvalidCommand},
		{"empty", []byte{}, ErrInvalidCommand},
		{"unknown version", append([]byte{2}, b[1:]...), ErrUnknownCommand},
		{"version zero", append([]byte{0}, b[1:]...), ErrUnknownCommand},
		{"garbage", []byte{CommandVersion, 0xff, 0xff, 0xff}, ErrInvalidCommand},
		{"truncated", b[:len(b)-3], ErrInvalidCommand},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Decode(tt.data); !errors.Is(err, tt.wantErr) {
				t.Errorf("Decode() = %v, want %v", err, tt.wantErr)
			}
		})
	}
}

// TestDispatchTableComplete fails when a Command.op field has no apply
// function.
func TestDispatchTableComplete(t *testing.T) {
	fields := opOneof.Fields()
	for i := range fields.Len() {
		name := fields.Get(i).Name()
		if appliers[name] == nil {
			t.Errorf("Command.op field %s has no entry in appliers", name)
		}
	}
	if len(appliers) != fields.Len() {
		t.Errorf("appliers has %d entries, Command.op has %d fields", len(appliers), fields.Len())
	}
}

func TestApplyEnvelope(t *testing.T) {
	noTime := register(instance("web", "a"))
	badTime := register(instance("web", "a"))
	badTime.Time = &timestamppb.Timestamp{Seconds: 1, Nanos: -1}
	noSeq := withClient(register(instance("web", "a")), "c", 0)
	longClient := withClient(register(instance("web", "a")), strings.Repeat("c", MaxIDLength+1), 1)

	tests := []struct {
		name    string
		cmd     *fsmv1.Command
		stamp   bool
		wantErr error
		field   string
	}{
		{"missing time", noTime, false, ErrInvalidCommand, "time"},
		{"invalid time", badTime, false, ErrInvalidCommand, "time"},
		{"client without sequence", noSeq, true, ErrInvalidCommand, "sequence"},
		{"client id too long", longClient, true, ErrInvalidCommand, "client_id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			if tt.stamp {
				tt.cmd.Time = at(0)
			}
			data, err := Encode(tt.cmd)
			if err != nil {
				t.Fatalf("Encode: %v", err)
			}
			res := h.raw(data)
			if !errors.Is(res.Err, tt.wantErr) {
				t.Fatalf("Result.Err = %v, want %v", res.Err, tt.wantErr)
			}
			if !strings.Contains(res.Err.Error(), tt.field) {
				t.Errorf("error %q does not name %q", res.Err, tt.field)
			}
			if res.Index != 1 || h.f.AppliedIndex() != 1 {
				t.Errorf("Result.Index = %d, AppliedIndex = %d, want 1", res.Index, h.f.AppliedIndex())
			}
			if _, list, _ := h.f.State().Services("", nil); len(list) != 0 {
				t.Errorf("services = %v, want none", list)
			}
		})
	}
}

func TestApplyNonCommandEntries(t *testing.T) {
	h := newHarness(t)
	for i, typ := range []raft.LogType{raft.LogNoop, raft.LogBarrier, raft.LogConfiguration} {
		idx := uint64(i + 1)
		out := h.f.Apply(&raft.Log{Index: idx, Term: 1, Type: typ, Data: []byte("not a command")})
		res, ok := out.(*Result)
		if !ok || res.Err != nil || res.Index != idx {
			t.Errorf("Apply(%v) = %#v, want *Result{Index: %d}", typ, out, idx)
		}
		if got := h.f.AppliedIndex(); got != idx {
			t.Errorf("AppliedIndex() = %d, want %d", got, idx)
		}
	}
	if res, ok := h.f.Apply(nil).(*Result); !ok || !errors.Is(res.Err, ErrInvalidCommand) {
		t.Errorf("Apply(nil) = %#v, want ErrInvalidCommand", res)
	}
}

func TestApplyDecodeFailure(t *testing.T) {
	h := newHarness(t)
	for _, data := range [][]byte{nil, {9, 1, 2}, {CommandVersion, 0xff}} {
		res := h.raw(data)
		if res.Err == nil || res.Index != h.index {
			t.Errorf("Apply(%x) = %+v, want an error at index %d", data, res, h.index)
		}
	}
	if got := h.f.State().Index(Tables()...); got != 0 {
		t.Errorf("table index after bad entries = %d, want 0", got)
	}
}

// Result.Value is the stored record itself (no copy per entry on every
// node): what a reader of the state sees, under the same do-not-modify
// rule.
func TestResultValueIsTheStoredRecord(t *testing.T) {
	h := newHarness(t)
	res := h.mustApply(register(instance("web", "a")))
	got, err := h.f.State().Service("web", "a")
	if err != nil {
		t.Fatalf("Service: %v", err)
	}
	if res.Value != proto.Message(got) {
		t.Errorf("Result.Value %p is not the stored record %p", res.Value, got)
	}
}

func TestWaitApplied(t *testing.T) {
	h := newHarness(t)
	h.mustApply(register(instance("web", "a")))
	at := h.f.AppliedIndex()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.f.WaitApplied(ctx, at); err != nil {
		t.Fatalf("WaitApplied(applied) = %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- h.f.WaitApplied(ctx, at+2) }()
	h.mustApply(register(instance("web", "b")))
	select {
	case err := <-done:
		t.Fatalf("WaitApplied(%d) returned %v at index %d", at+2, err, h.f.AppliedIndex())
	default:
	}
	h.mustApply(register(instance("web", "c")))
	if err := <-done; err != nil {
		t.Fatalf("WaitApplied after the index was applied: %v", err)
	}
	short, cancelShort := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancelShort()
	if err := h.f.WaitApplied(short, at+100); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitApplied past the end = %v, want the context's deadline", err)
	}
}

func TestSentinels(t *testing.T) { fsmtest.CheckSentinels(t, ".", Sentinels) }
