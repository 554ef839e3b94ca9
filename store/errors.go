package store

import (
	"context"
	"errors"

	"github.com/hashicorp/raft"
)

// Sentinel errors. Every error a Store method returns that has one of these
// causes matches it with errors.Is; errors that came from hashicorp/raft also
// still match the raft error they were translated from.
var (
	// ErrNotLeader: the operation needs the leader and this server is not
	// the leader. Forward to Leader() or retry once one is known.
	ErrNotLeader = errors.New("store: not the leader")

	// ErrLeadershipLost: this server lost leadership while the command was in
	// flight. The command may or may not be committed: a retry is safe only
	// because every write carries a client ID and sequence number that the
	// FSM deduplicates.
	ErrLeadershipLost = errors.New("store: leadership lost while committing")

	// ErrShutdown: the Store is closed or closing.
	ErrShutdown = errors.New("store: shut down")

	// ErrTimeout: the operation did not complete before its deadline (the
	// context's, or raft's enqueue timeout derived from it). A write may
	// still be applied later.
	ErrTimeout = errors.New("store: timed out")

	// ErrAlreadyBootstrapped: Bootstrap was called on a server that already
	// has Raft state (a log, a term or a snapshot).
	ErrAlreadyBootstrapped = errors.New("store: already bootstrapped")

	// ErrUnknownServer: the server ID is not in the Raft configuration.
	ErrUnknownServer = errors.New("store: unknown server")

	// ErrNotVoter: the operation needs a voter and the server is not one.
	ErrNotVoter = errors.New("store: not a voter")

	// ErrLeadershipTransferInProgress: the leader is handing over leadership
	// and rejects writes until the transfer ends; retry against the new
	// leader.
	ErrLeadershipTransferInProgress = errors.New("store: leadership transfer in progress")

	// ErrAbortedByRestore: a snapshot restore superseded the command while it
	// was in flight; its effects are not in the restored state.
	ErrAbortedByRestore = errors.New("store: aborted by snapshot restore")

	// ErrAddressInUse: a membership change names an address that belongs to
	// this server under another ID.
	ErrAddressInUse = errors.New("store: address in use by the local server")

	// ErrDataDirLocked: another process (an agent) has the Raft log open.
	ErrDataDirLocked = errors.New("store: the raft log is locked by another process (is an agent running on this data dir?)")

	// ErrNewerData: the data dir holds a snapshot this release cannot
	// restore (a newer release wrote it): the agent is refused at start,
	// with nothing written.
	ErrNewerData = errors.New("store: the data dir was written by a newer release")

	// ErrNothingToSnapshot: the state has no applied entry yet, so there
	// is no snapshot to take.
	ErrNothingToSnapshot = errors.New("store: nothing to snapshot yet")

	// ErrUnavailable: the external store (etcd) could not be reached or
	// answered with an error. A write may or may not have been committed:
	// a retry is safe for the same reason as after ErrLeadershipLost.
	ErrUnavailable = errors.New("store: etcd unavailable")

	// ErrUnsupported: the operation does not exist in this store's mode
	// (a Raft membership change in etcd mode).
	ErrUnsupported = errors.New("store: not supported in this mode")
)

// raftErrors is the one table from hashicorp/raft's errors to ours.
var raftErrors = [...]struct{ from, to error }{
	{raft.ErrNotLeader, ErrNotLeader},
	{raft.ErrLeadershipLost, ErrLeadershipLost},
	{raft.ErrRaftShutdown, ErrShutdown},
	{raft.ErrEnqueueTimeout, ErrTimeout},
	{raft.ErrCantBootstrap, ErrAlreadyBootstrapped},
	{raft.ErrNotVoter, ErrNotVoter},
	{raft.ErrLeadershipTransferInProgress, ErrLeadershipTransferInProgress},
	{raft.ErrAbortedByRestore, ErrAbortedByRestore},
	{raft.ErrNothingNewToSnapshot, ErrNothingToSnapshot},
}

// mappedError carries one of our sentinels and the cause it was mapped from;
// errors.Is matches both.
type mappedError struct {
	sentinel, cause error
}

func (e *mappedError) Error() string   { return e.sentinel.Error() }
func (e *mappedError) Unwrap() []error { return []error{e.sentinel, e.cause} }

// mapRaftError translates an error returned by hashicorp/raft. Errors without
// a sentinel (for example "configuration changed since ...") pass through.
func mapRaftError(err error) error {
	if err == nil {
		return nil
	}
	for _, m := range raftErrors {
		if errors.Is(err, m.from) {
			return &mappedError{sentinel: m.to, cause: err}
		}
	}
	return err
}

// contextError translates the end of ctx: a passed deadline is ErrTimeout
// (and context.DeadlineExceeded); a cancellation is returned as it is.
func contextError(ctx context.Context) error {
	err := ctx.Err()
	if errors.Is(err, context.DeadlineExceeded) {
		return &timeoutError{cause: err}
	}
	return err
}

// timeoutError is ErrTimeout caused by a context deadline.
type timeoutError struct{ cause error }

func (e *timeoutError) Error() string   { return ErrTimeout.Error() + ": " + e.cause.Error() }
func (e *timeoutError) Unwrap() []error { return []error{ErrTimeout, e.cause} }

// Sentinels lists every sentinel error of the package (those above and
// ErrCorruptLog), for the translations of the packages that report them
// (the gateway's error→code table); TestSentinels checks that it is
// complete.
var Sentinels = []error{
	ErrNotLeader, ErrLeadershipLost, ErrShutdown, ErrTimeout, ErrAlreadyBootstrapped,
	ErrUnknownServer, ErrNotVoter, ErrLeadershipTransferInProgress, ErrAbortedByRestore,
	ErrAddressInUse, ErrDataDirLocked, ErrNothingToSnapshot, ErrUnavailable, ErrUnsupported,
	ErrCorruptLog, ErrNewerData,
}
