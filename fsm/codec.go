package fsm

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// CommandVersion is the first byte of every encoded command. It names the
// envelope format: the rest of the entry is a deterministic fsmv1.Command.
const CommandVersion byte = 1

// marshalOpts is used for every persisted encoding (commands, snapshots):
// deterministic so that two nodes with the same state write the same bytes.
var marshalOpts = proto.MarshalOptions{Deterministic: true}

// Encode returns the Raft log entry data for cmd: [CommandVersion] followed
// by the protobuf encoding of cmd. It does not validate cmd; Apply does.
// Fields this release does not know (a newer caller's, kept by decoding)
// are left out (from a copy: cmd is not changed): a state machine of this
// release would stop at them.
func Encode(cmd *fsmv1.Command) ([]byte, error) {
	if cmd == nil {
		return nil, errors.New("encode command: nil command")
	}
	if unknownField(cmd.ProtoReflect(), "") != "" {
		cmd = proto.CloneOf(cmd)
		DiscardUnknown(cmd)
	}
	b, err := marshalOpts.MarshalAppend([]byte{CommandVersion}, cmd)
	if err != nil {
		return nil, fmt.Errorf("encode command: %w", err)
	}
	return b, nil
}

// Decode parses Raft log entry data written by [Encode]. Empty data and
// undecodable bytes give [ErrInvalidCommand]; an unknown version byte gives
// [ErrUnknownCommand].
func Decode(b []byte) (*fsmv1.Command, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: empty log entry", ErrInvalidCommand)
	}
	if b[0] != CommandVersion {
		return nil, fmt.Errorf("%w: command version %d, this version reads %d", ErrUnknownCommand, b[0], CommandVersion)
	}
	cmd := new(fsmv1.Command)
	if err := proto.Unmarshal(b[1:], cmd); err != nil {
		return nil, fmt.Errorf("%w: decode command: %w", ErrInvalidCommand, err)
	}
	return cmd, nil
}
