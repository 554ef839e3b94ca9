package fsm

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// unknownField returns the path of the first field of m (or of a message
// inside it) that this release does not know, "" when there is none. A
// command with one was proposed by a newer release: applying it without
// the field would diverge from the nodes that know it.
func unknownField(m protoreflect.Message, path string) string {
	if len(m.GetUnknown()) > 0 {
		if path == "" {
			return string(m.Descriptor().FullName())
		}
		return path
	}
	var found string
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := string(fd.Name())
		if path != "" {
			p = path + "." + p
		}
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := range l.Len() {
				if found = unknownField(l.Get(i).Message(), p); found != "" {
					return false
				}
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				found = unknownField(mv.Message(), p)
				return found == ""
			})
		case fd.Message() != nil && !fd.IsList() && !fd.IsMap():
			found = unknownField(v.Message(), p)
		}
		return found == ""
	})
	return found
}

// DiscardUnknown drops every field of m (and of the messages inside it)
// that this release does not know, as the leader does to what callers send
// before it proposes a command: a state machine at this version would stop
// at a field it does not know (unknownField).
func DiscardUnknown(m proto.Message) {
	discardUnknown(m.ProtoReflect())
}

func discardUnknown(m protoreflect.Message) {
	if len(m.GetUnknown()) > 0 {
		m.SetUnknown(nil)
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := range l.Len() {
				discardUnknown(l.Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				discardUnknown(mv.Message())
				return true
			})
		case fd.Message() != nil && !fd.IsList() && !fd.IsMap():
			discardUnknown(v.Message())
		}
		return true
	})
}
