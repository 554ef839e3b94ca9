package sim

import (
	"context"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Event kinds: the EventType numbers every watch API shares.
const (
	eventExisting int32 = 1
	eventCreated  int32 = 2
	eventUpdated  int32 = 3
	eventDeleted  int32 = 4
)

// change is one event of a table.
type change[T object] struct {
	kind int32
	obj  T
}

// hub fans a table's changes out to its watchers.
type hub[T object] struct {
	mu     sync.Mutex
	subs   map[*subscriber[T]]struct{}
	closed bool
}

type subscriber[T object] struct {
	ch       chan change[T]
	overflow bool
}

func newHub[T object]() *hub[T] {
	return &hub[T]{subs: make(map[*subscriber[T]]struct{})}
}

func (h *hub[T]) subscribe() *subscriber[T] {
	s := &subscriber[T]{ch: make(chan change[T], watchBuffer)}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		close(s.ch)
		return s
	}
	h.subs[s] = struct{}{}
	return s
}

func (h *hub[T]) unsubscribe(s *subscriber[T]) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.subs[s]; ok {
		delete(h.subs, s)
		close(s.ch)
	}
}

// publish offers an event to every watcher; one that is full is dropped
// (its stream ends with ResourceExhausted).
func (h *hub[T]) publish(kind int32, obj T) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		select {
		case s.ch <- change[T]{kind, obj}:
		default:
			s.overflow = true
			delete(h.subs, s)
			close(s.ch)
		}
	}
}

func (h *hub[T]) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for s := range h.subs {
		delete(h.subs, s)
		close(s.ch)
	}
}

// watch sends every object of t (of owner, when set) as existing, then
// every change, until ctx ends or the watcher falls behind. It subscribes
// before listing, so no change is missed; a change the listing already
// shows is not sent again.
func watch[T object](ctx context.Context, t *table[T], h *hub[T], owner string, send func(kind int32, obj T) error) error {
	sub := h.subscribe()
	defer h.unsubscribe(sub)
	listed := make(map[string]uint64)
	for token := ""; ; {
		objs, next, err := t.list(maxPageSize, token, owner)
		if err != nil {
			return err
		}
		for _, o := range objs {
			listed[o.GetId()] = o.GetMetadata().GetRevision()
			if err := send(eventExisting, o); err != nil {
				return err
			}
		}
		if token = next; token == "" {
			break
		}
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev, ok := <-sub.ch:
			if !ok {
				if sub.overflow {
					return status.Errorf(codes.ResourceExhausted, "watch fell more than %d events behind: watch again", watchBuffer)
				}
				return status.Error(codes.Unavailable, errStopped.Error())
			}
			if owner != "" && ev.obj.GetMetadata().GetOwner() != owner {
				continue
			}
			if rev, ok := listed[ev.obj.GetId()]; ok && ev.kind != eventDeleted && ev.obj.GetMetadata().GetRevision() <= rev {
				continue
			}
			if err := send(ev.kind, ev.obj); err != nil {
				return err
			}
		}
	}
}
