package fsm

import (
	"errors"
)

// Errors returned by Apply (in [Result.Err]), by the [State] queries and by
// Restore. Apply errors are wrapped with a message that names the offending
// field or record; test them with errors.Is.
var (
	// ErrNotFound: the record the command or query names does not exist.
	ErrNotFound = errors.New("not found")
	// ErrCASConflict: a compare-and-set revision did not match the stored one.
	ErrCASConflict = errors.New("compare-and-set conflict")
	// ErrSlotNotAfterLast: a claimed schedule slot is at or before the last
	// claimed slot of the schedule.
	ErrSlotNotAfterLast = errors.New("slot is not after the last claimed slot")
	// ErrStale: a set_service_health command was based on a heartbeat that is
	// no longer the instance's last one (a heartbeat raced the TTL reaper and
	// won). Nothing was changed.
	ErrStale = errors.New("stale health update")
	// ErrInvalidCommand: the command is malformed or a field is missing or out
	// of range. The wrapping message names the field.
	ErrInvalidCommand = errors.New("invalid command")
	// ErrUnknownCommand: the command has no operation this version knows, or
	// its encoding version is unknown.
	ErrUnknownCommand = errors.New("unknown command")
	// ErrUnsupportedSnapshot: the snapshot was written by a newer format
	// version, or holds a table this version does not know.
	ErrUnsupportedSnapshot = errors.New("unsupported snapshot")
	// ErrCorruptSnapshot: the snapshot stream is truncated or not a valid
	// FSM snapshot.
	ErrCorruptSnapshot = errors.New("corrupt snapshot")
	// ErrTooOldToReplay: a write repeats a client's sequence whose outcome
	// its session no longer keeps (older than the dedupe window, or beyond
	// the outcomes kept): it may have been applied, so it is not applied
	// again, and its outcome cannot be told. Nothing was changed.
	ErrTooOldToReplay = errors.New("write too old to replay")
	// ErrInvalidConfig: a [Config] field is out of range.
	ErrInvalidConfig = errors.New("invalid fsm config")
	// ErrCannotConvert: the state holds what the cluster version asked
	// for cannot express (set_cluster_version); nothing was changed.
	ErrCannotConvert = errors.New("the state cannot be converted to that cluster version")
)

// Sentinels lists every sentinel error above, for the translations of the
// packages that report them (the gateway's error→code table);
// TestSentinels checks that it is complete.
var Sentinels = []error{
	ErrNotFound, ErrCASConflict, ErrSlotNotAfterLast, ErrStale, ErrInvalidCommand,
	ErrUnknownCommand, ErrUnsupportedSnapshot, ErrCorruptSnapshot, ErrInvalidConfig, ErrTooOldToReplay,
	ErrNeedsNewerVersion, ErrNoCheckpoint, ErrCannotConvert,
}

// errorCodes maps the outcome errors stored in dedupe records to their
// persisted codes (fsmv1.DedupeRecord.error_code). The codes are part of the
// snapshot format: never change or reuse one.
var errorCodes = []struct {
	code string
	err  error
}{
	{"not_found", ErrNotFound},
	{"cas_conflict", ErrCASConflict},
	{"slot_not_after_last", ErrSlotNotAfterLast},
	{"stale", ErrStale},
	{"invalid_command", ErrInvalidCommand},
	{"unknown_command", ErrUnknownCommand},
}

// knownErrorCode reports whether code is one of errorCodes.
func knownErrorCode(code string) bool {
	for _, c := range errorCodes {
		if c.code == code {
			return true
		}
	}
	return false
}

// ErrorCode returns the persisted outcome code of err, as RefuseWrite
// takes it: "" for nil, "internal" for an error that is no outcome
// sentinel.
func ErrorCode(err error) string { return errorCode(err) }

// codeInternal marks an outcome error that matches no sentinel.
const codeInternal = "internal"

// errorCode returns the persisted code of an apply outcome ("" for nil).
func errorCode(err error) string {
	if err == nil {
		return ""
	}
	for _, c := range errorCodes {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return codeInternal
}

// replayedError is the outcome error of a deduplicated command: it carries
// the original message and unwraps to the original sentinel.
type replayedError struct {
	msg      string
	sentinel error
}

func (e *replayedError) Error() string { return e.msg }
func (e *replayedError) Unwrap() error { return e.sentinel }

// replayError rebuilds the outcome error stored in a dedupe record.
func replayError(code, msg string) error {
	if code == "" {
		return nil
	}
	for _, c := range errorCodes {
		if c.code == code {
			return &replayedError{msg: msg, sentinel: c.err}
		}
	}
	return &replayedError{msg: msg}
}
