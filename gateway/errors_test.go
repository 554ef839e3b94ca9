package gateway

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/store"
)

func TestToConnect(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want connect.Code
	}{
		{"not found", fmt.Errorf("%w: config %q", fsm.ErrNotFound, "x"), connect.CodeNotFound},
		{"cas", fsm.ErrCASConflict, connect.CodeAborted},
		{"invalid command", fsm.ErrInvalidCommand, connect.CodeInvalidArgument},
		{"not leader", fmt.Errorf("apply: %w", store.ErrNotLeader), connect.CodeUnavailable},
		{"no leader", ErrNoLeader, connect.CodeUnavailable},
		{"deadline", context.DeadlineExceeded, connect.CodeDeadlineExceeded},
		{"invalid field", invalid("instance.port", "out of range"), connect.CodeInvalidArgument},
		{"already a connect error", connect.NewError(connect.CodePermissionDenied, errors.New("no")), connect.CodePermissionDenied},
		{"anything else", errors.New("boom"), connect.CodeInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := connect.CodeOf(toConnect(tc.err)); got != tc.want {
				t.Fatalf("code = %s, want %s", got, tc.want)
			}
		})
	}
	if toConnect(nil) != nil {
		t.Fatal("toConnect(nil) != nil")
	}
}

// notInCalls are the sentinels no call can see: they stop an agent (or
// pivirt-agent recover) from starting.
var notInCalls = map[error]string{
	store.ErrCorruptLog:    "refuses the start",
	store.ErrDataDirLocked: "refuses the start",
}

// TestCodeTableCoversSentinels: every sentinel a handler can see (the
// exported lists of fsm, store and archive, and the gateway's own) has an
// entry of its own in the code table, a deliberate code; a new sentinel
// fails here until it gets one.
func TestCodeTableCoversSentinels(t *testing.T) {
	lists := map[string][]error{
		"fsm": fsm.Sentinels, "store": store.Sentinels, "archive": archive.Sentinels,
		"gateway": {ErrNoLeader, ErrLeaderNotReady, ErrStopping, errNotLeaderHere, ErrRestoreInProgress, ErrRestoreRefused},
	}
	for pkg, list := range lists {
		for _, err := range list {
			if _, ok := notInCalls[err]; ok {
				continue
			}
			found := false
			for _, e := range codeTable {
				found = found || e.err == err
			}
			if !found {
				t.Errorf("%s: %v has no entry in the code table: give it a deliberate code", pkg, err)
			}
		}
	}
}

func TestRetryable(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{store.ErrNotLeader, true},
		{ErrLeaderNotReady, true},
		{connect.NewError(connect.CodeUnavailable, errors.New("dial")), true},
		{connect.NewError(connect.CodeAborted, errors.New("cas")), false},
		{fsm.ErrNotFound, false},
	} {
		if got := retryable(tc.err); got != tc.want {
			t.Errorf("retryable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
