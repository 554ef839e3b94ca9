package gateway

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/store"
)

func TestToConnect(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want connect.Code
	}{
		{"not found", fmt.Errorf("config key %q: %w", "x", fsm.ErrNotFound), connect.CodeNotFound},
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

func TestCodeTableCoversSentinels(t *testing.T) {
	// Every sentinel a handler can see must have a deliberate code; a new
	// sentinel added to fsm or store without an entry here shows up as
	// Internal, which this test rejects.
	for _, err := range []error{
		fsm.ErrNotFound, fsm.ErrCASConflict, fsm.ErrSlotNotAfterLast, fsm.ErrStale, fsm.ErrInvalidCommand,
		fsm.ErrInvalidConfig, fsm.ErrUnsupportedSnapshot, fsm.ErrCorruptSnapshot,
		store.ErrNotLeader, store.ErrLeadershipLost, store.ErrShutdown, store.ErrTimeout, store.ErrAlreadyBootstrapped,
		store.ErrUnknownServer, store.ErrNotVoter, store.ErrLeadershipTransferInProgress, store.ErrAbortedByRestore,
		store.ErrAddressInUse,
	} {
		if connect.CodeOf(toConnect(err)) == connect.CodeInternal {
			t.Errorf("%v maps to Internal", err)
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
