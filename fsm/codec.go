package fsm

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
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

// recordOpts returns the options that encode the record m as marshalOpts
// does, with cached sizes when sized (the sizes were just computed, and
// records are never changed in place). Deterministic marshalling differs
// from the plain one only in the order of map entries, and it sorts the
// keys of every map through reflection, which allocates several objects
// per map even for one entry; a record whose maps have one entry at most
// (mapsInOrder) is encoded the plain way, to the same bytes.
func recordOpts(m proto.Message, sized bool) proto.MarshalOptions {
	return proto.MarshalOptions{Deterministic: !mapsInOrder(m), UseCachedSize: sized}
}

// mapsInOrder reports whether every map in m has at most one entry, so
// that any order of its entries is the sorted one. Only the records that
// hold a ServiceInstance have maps (its meta); for any other message it
// reports whether its type has none (TestMapsInOrderKnowsEveryMap).
func mapsInOrder(m proto.Message) bool {
	switch v := m.(type) {
	case *clusterv1.ServiceInstance:
		return len(v.GetMeta()) < 2
	case *fsmv1.DedupeRecord:
		return len(v.GetInstance().GetMeta()) < 2
	case *fsmv1.Outcome:
		return len(v.GetInstance().GetMeta()) < 2
	}
	return !hasMaps(m.ProtoReflect().Descriptor())
}

// mapFree caches hasMaps by message type.
var mapFree sync.Map // protoreflect.FullName → bool (has maps)

// hasMaps reports whether messages of md can hold a map: a map field of
// its own or of a message field, at any depth.
func hasMaps(md protoreflect.MessageDescriptor) bool {
	if v, ok := mapFree.Load(md.FullName()); ok {
		return v.(bool)
	}
	has := len(mapFields(md, "", nil)) > 0
	mapFree.Store(md.FullName(), has)
	return has
}

// mapFields lists the paths of the map fields messages of md can hold.
func mapFields(md protoreflect.MessageDescriptor, path string, seen []protoreflect.FullName) []string {
	if slices.Contains(seen, md.FullName()) {
		return nil
	}
	seen = append(seen, md.FullName())
	var out []string
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsMap():
			out = append(out, path+string(fd.Name()))
		case fd.Message() != nil:
			out = append(out, mapFields(fd.Message(), path+string(fd.Name())+".", seen)...)
		}
	}
	return out
}
