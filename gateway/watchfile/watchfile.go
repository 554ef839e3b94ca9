// Package watchfile keeps a parsed configuration file in use while it
// changes: a new version replaces the one in use only if it parses and
// validates; otherwise the old one stays, and the error is logged once and
// kept for Err. The RBAC policy (auth.rbac_policy) and the network policy
// (auth.network_policy) are such files.
package watchfile

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"
)

// File is a file parsed into a T.
type File[T any] struct {
	key    string // the config key naming the file, for errors
	path   string
	parse  func(io.Reader) (T, error)
	logger *slog.Logger

	mu      sync.RWMutex
	value   T
	stamp   stamp
	lastErr error
}

type stamp struct {
	size  int64
	mtime time.Time
}

// Load reads and parses the file at path; an error here is fatal to the
// caller (there is nothing to fall back to). key is the config key naming
// the file, used in errors.
func Load[T any](key, path string, parse func(io.Reader) (T, error), logger *slog.Logger) (*File[T], error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	f := &File[T]{key: key, path: path, parse: parse, logger: logger}
	v, st, err := f.read()
	if err != nil {
		return nil, err
	}
	f.value, f.stamp = v, st
	return f, nil
}

func (f *File[T]) read() (T, stamp, error) {
	var zero T
	fh, err := os.Open(f.path)
	if err != nil {
		return zero, stamp{}, fmt.Errorf("%s: %w", f.key, err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return zero, stamp{}, fmt.Errorf("%s: %w", f.key, err)
	}
	v, err := f.parse(fh)
	if err != nil {
		return zero, stamp{}, fmt.Errorf("%s %s: %w", f.key, f.path, err)
	}
	return v, stamp{size: st.Size(), mtime: st.ModTime()}, nil
}

// Value is the version in use.
func (f *File[T]) Value() T {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.value
}

// Err is the error of the last reload, nil when it succeeded.
func (f *File[T]) Err() error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.lastErr
}

// Reload reads the file again (SIGHUP, POST /reload); on error the version
// in use stays.
func (f *File[T]) Reload() error {
	v, st, err := f.read()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastErr = err
	if err != nil {
		f.logger.Error(f.key+" not reloaded; keeping the version in use", "error", err)
		return err
	}
	f.value, f.stamp = v, st
	f.logger.Info(f.key+" loaded", "path", f.path)
	return nil
}

// Watch reloads the file when its size or modification time changes,
// checked every interval, until ctx ends; a broken version is reported
// once, not at every check.
func (f *File[T]) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var failed stamp
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		st, err := os.Stat(f.path)
		if err != nil {
			continue
		}
		now := stamp{size: st.Size(), mtime: st.ModTime()}
		f.mu.RLock()
		same := now == f.stamp
		f.mu.RUnlock()
		if same || now == failed {
			continue
		}
		if f.Reload() != nil {
			failed = now
		}
	}
}
