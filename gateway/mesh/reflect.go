package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jhump/protoreflect/v2/grpcreflect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Reflector learns the schema of a route's services from its backend's
// gRPC server reflection (grpc.reflection.v1, or v1alpha for older
// servers), for a route that names no descriptor set. The schema is
// cached; it is asked again when a call names a method it does not have
// (at most every ReflectMinInterval: a new release of the backend), and
// every ReflectInterval (a backend replaced behind the same address). A
// backend without reflection is asked again every ReflectInterval, one
// that could not be asked (no endpoint yet, unreachable) every
// ReflectMinInterval; its calls go without a schema meanwhile.
type Reflector struct {
	backend *Backend
	prefix  string
	logger  *slog.Logger
	now     func() time.Time

	mu      sync.Mutex
	schema  *Schema
	asked   time.Time     // when the last fetch started (zero: never)
	running chan struct{} // closed when the fetch under way ends; nil when none
	first   chan struct{} // closed when the first fetch has ended
	lastErr string        // the last failure logged, logged again only when it changes
	// noReflection: the last fetch found no reflection service (asked
	// again every ReflectInterval; other failures, such as no endpoint
	// yet, every ReflectMinInterval).
	noReflection bool
}

// How often a route's schema is asked of its backend.
const (
	ReflectInterval    = time.Minute
	ReflectMinInterval = 10 * time.Second
	// reflectFirstWait bounds how long the first call of a route waits
	// for the first answer (later calls never wait).
	reflectFirstWait = 2 * time.Second
	reflectTimeout   = 5 * time.Second
)

// errNoReflection: the backend answers Unimplemented to reflection.
var errNoReflection = errors.New("the backend does not serve gRPC server reflection (grpc.reflection.v1 or v1alpha)")

// NewReflector returns the reflector of the route of prefix to backend.
// Nothing is asked before the first call that needs a schema.
func NewReflector(backend *Backend, prefix string, logger *slog.Logger) *Reflector {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Reflector{backend: backend, prefix: prefix, logger: logger, now: time.Now, first: make(chan struct{})}
}

// Schema is the learned schema when it has method ("/pkg.Service/M"),
// else nil. The first call waits (at most reflectFirstWait) for the first
// answer; a miss or an old schema starts a fetch in the background.
func (r *Reflector) Schema(method string) *Schema {
	r.mu.Lock()
	s := r.schema
	has := s != nil && s.method(method) != nil
	age := r.now().Sub(r.asked)
	firstDone := r.firstDone()
	retry := (s != nil && !has) || (s == nil && !r.noReflection)
	if r.running == nil && (r.asked.IsZero() || age >= ReflectInterval || (retry && age >= ReflectMinInterval)) {
		r.startLocked()
	}
	r.mu.Unlock()
	if !firstDone {
		t := time.NewTimer(reflectFirstWait)
		defer t.Stop()
		select {
		case <-r.first:
		case <-t.C:
		}
		r.mu.Lock()
		s = r.schema
		r.mu.Unlock()
		has = s != nil && s.method(method) != nil
	}
	if !has {
		return nil
	}
	return s
}

// Cached is the schema learned last (nil: none yet, or the backend has no
// reflection); it asks nothing.
func (r *Reflector) Cached() *Schema {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.schema
}

func (r *Reflector) firstDone() bool {
	select {
	case <-r.first:
		return true
	default:
		return false
	}
}

func (r *Reflector) startLocked() {
	r.asked = r.now()
	done := make(chan struct{})
	r.running = done
	go func() {
		defer close(done)
		s, err := r.fetch()
		r.mu.Lock()
		defer r.mu.Unlock()
		r.running = nil
		if !r.firstDone() {
			close(r.first)
		}
		src := "reflection of backends." + r.backend.Name()
		r.noReflection = errors.Is(err, errNoReflection)
		switch {
		case err != nil:
			// The last schema stays: a backend restarting, or
			// unreachable for a moment, still serves what it served.
			if msg := err.Error(); msg != r.lastErr {
				r.lastErr = msg
				r.logger.Info("routed calls go without a schema learned from the backend's server reflection", "backend", r.backend.Name(), "prefix", r.prefix, "reason", msg)
			}
		case r.schema == nil || !sameServices(r.schema, s):
			r.lastErr = ""
			r.logger.Info("schema learned from the backend's server reflection", "backend", r.backend.Name(), "prefix", r.prefix, "services", s.Services(), "source", src)
			r.schema = s
		default:
			r.schema = s
		}
	}()
}

// wait blocks until the fetch under way, if any, has ended (tests).
func (r *Reflector) wait() {
	r.mu.Lock()
	done := r.running
	r.mu.Unlock()
	if done != nil {
		<-done
	}
}

// fetch asks the backend for the files of every service the route serves.
func (r *Reflector) fetch() (*Schema, error) {
	ctx, cancel := context.WithTimeout(context.Background(), reflectTimeout)
	defer cancel()
	conn, err := r.backend.Conn()
	if err != nil {
		return nil, err
	}
	client := grpcreflect.NewClientAuto(ctx, conn)
	defer client.Reset()
	names, err := client.ListServices()
	if err != nil {
		if status.Code(err) == codes.Unimplemented {
			return nil, errNoReflection
		}
		return nil, fmt.Errorf("server reflection: %w", err)
	}
	files := new(protoregistry.Files)
	var routed []string
	for _, name := range names {
		if !routesService(r.prefix, string(name)) {
			continue
		}
		fd, err := client.FileContainingSymbol(name)
		if err != nil {
			return nil, fmt.Errorf("server reflection: the file of %s: %w", name, err)
		}
		if err := registerWithImports(files, fd); err != nil {
			return nil, fmt.Errorf("server reflection: %s: %w", fd.Path(), err)
		}
		routed = append(routed, string(name))
	}
	if len(routed) == 0 {
		return nil, fmt.Errorf("the backend's server reflection lists no service the prefix %s routes", r.prefix)
	}
	return newSchema("reflection of backends."+r.backend.Name(), files, r.prefix)
}

// registerWithImports registers fd and the files it imports (those the
// program links excepted), each once.
func registerWithImports(files *protoregistry.Files, fd protoreflect.FileDescriptor) error {
	if _, err := files.FindFileByPath(fd.Path()); err == nil {
		return nil
	}
	if _, err := protoregistry.GlobalFiles.FindFileByPath(fd.Path()); err == nil {
		return nil
	}
	imports := fd.Imports()
	for i := range imports.Len() {
		if err := registerWithImports(files, imports.Get(i).FileDescriptor); err != nil {
			return err
		}
	}
	return files.RegisterFile(fd)
}

// sameServices reports whether two schemas hold the same services.
func sameServices(a, b *Schema) bool {
	x, y := a.Services(), b.Services()
	if len(x) != len(y) {
		return false
	}
	for i := range x {
		if x[i] != y[i] {
			return false
		}
	}
	return true
}
