package gateway

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/store"
)

// Errors of the gateway itself.
var (
	// ErrNoLeader: no leader was known within the hold timeout.
	ErrNoLeader = errors.New("no cluster leader")
	// ErrLeaderNotReady: this node just became leader and has not yet
	// applied everything committed before its term.
	ErrLeaderNotReady = errors.New("leader is not ready yet")
	// ErrStopping: this agent is shutting down.
	ErrStopping = errors.New("agent is shutting down")
	// errNotLeaderHere is returned by the internal (leader-only) handler
	// when this node is not the leader; the forwarding node retries.
	errNotLeaderHere = errors.New("this node is not the leader")
)

// invalidArgument names the request field that was wrong.
type invalidArgument struct {
	field string
	msg   string
}

func (e *invalidArgument) Error() string { return e.field + ": " + e.msg }

func invalid(field, format string, args ...any) error {
	return &invalidArgument{field: field, msg: fmt.Sprintf(format, args...)}
}

// codeTable is the one place where errors from the packages below become
// Connect codes. The first match wins.
var codeTable = []struct {
	err  error
	code connect.Code
}{
	{context.DeadlineExceeded, connect.CodeDeadlineExceeded},
	{context.Canceled, connect.CodeCanceled},
	{fsm.ErrNotFound, connect.CodeNotFound},
	{fsm.ErrCASConflict, connect.CodeAborted},
	{fsm.ErrSlotNotAfterLast, connect.CodeFailedPrecondition},
	{fsm.ErrInvalidCommand, connect.CodeInvalidArgument},
	{fsm.ErrUnknownCommand, connect.CodeInternal},
	{fsm.ErrStale, connect.CodeAborted},
	// A retry too late to be told its outcome: the client must read the
	// state, not send it again.
	{fsm.ErrTooOldToReplay, connect.CodeFailedPrecondition},
	// A node that stopped applying the log until it is upgraded.
	{fsm.ErrNeedsNewerVersion, connect.CodeFailedPrecondition},
	{fsm.ErrNoCheckpoint, connect.CodeNotFound},
	{fsm.ErrCannotConvert, connect.CodeFailedPrecondition},
	{store.ErrNewerData, connect.CodeFailedPrecondition},
	{fsm.ErrInvalidConfig, connect.CodeInvalidArgument},
	{fsm.ErrUnsupportedSnapshot, connect.CodeFailedPrecondition},
	{fsm.ErrCorruptSnapshot, connect.CodeInvalidArgument},
	{store.ErrNotLeader, connect.CodeUnavailable},
	{store.ErrLeadershipLost, connect.CodeUnavailable},
	{store.ErrShutdown, connect.CodeUnavailable},
	{store.ErrTimeout, connect.CodeUnavailable},
	{store.ErrUnknownServer, connect.CodeNotFound},
	{store.ErrNotVoter, connect.CodeFailedPrecondition},
	{store.ErrLeadershipTransferInProgress, connect.CodeUnavailable},
	{store.ErrAlreadyBootstrapped, connect.CodeAlreadyExists},
	{store.ErrAbortedByRestore, connect.CodeAborted},
	{store.ErrAddressInUse, connect.CodeAlreadyExists},
	{store.ErrNothingToSnapshot, connect.CodeFailedPrecondition},
	{store.ErrUnavailable, connect.CodeUnavailable},
	{store.ErrUnsupported, connect.CodeFailedPrecondition},
	{archive.ErrInvalid, connect.CodeInvalidArgument},
	{ErrRestoreInProgress, connect.CodeFailedPrecondition},
	{ErrRestoreRefused, connect.CodeInvalidArgument},
	{archive.ErrUnsupported, connect.CodeFailedPrecondition},
	{ErrNoLeader, connect.CodeUnavailable},
	{ErrStopping, connect.CodeUnavailable},
	{ErrLeaderNotReady, connect.CodeUnavailable},
	{errNotLeaderHere, connect.CodeUnavailable},
}

// toConnect translates err to a *connect.Error exactly once.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	var ia *invalidArgument
	if errors.As(err, &ia) {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	for _, e := range codeTable {
		if errors.Is(err, e.err) {
			return connect.NewError(e.code, err)
		}
	}
	return connect.NewError(connect.CodeInternal, err)
}

// retryable reports whether a call to the leader may be retried on the
// current or a new leader: only Unavailable, which covers "not leader",
// "no leader" and connection failures. Writes carry a client ID and
// sequence, so a retry of a write that did apply is answered from the
// FSM's dedupe table instead of applying twice.
func retryable(err error) bool {
	if errors.Is(err, store.ErrNotLeader) || errors.Is(err, store.ErrLeadershipLost) || errors.Is(err, store.ErrUnavailable) ||
		errors.Is(err, ErrLeaderNotReady) || errors.Is(err, errNotLeaderHere) {
		return true
	}
	return connect.CodeOf(err) == connect.CodeUnavailable
}

// ConnectError translates err with the gateway's table (toConnect), for
// the handlers the agent supplies (ClusterServiceConfig's hooks).
func ConnectError(err error) error { return toConnect(err) }
