package authz

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// File is a policy file reloaded when it changes: a new version is used
// only if it parses and validates; otherwise the policy in use stays and
// the error is logged and kept for Err.
type File struct {
	path      string
	resources []string
	logger    *slog.Logger

	mu      sync.RWMutex
	policy  *Policy
	stamp   fileStamp
	lastErr error
}

type fileStamp struct {
	size  int64
	mtime time.Time
}

// LoadFile reads and validates the policy at path; an invalid file is an
// error here (nothing to fall back to).
func LoadFile(path string, resources []string, logger *slog.Logger) (*File, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	f := &File{path: path, resources: resources, logger: logger}
	p, st, err := f.read()
	if err != nil {
		return nil, err
	}
	f.policy, f.stamp = p, st
	return f, nil
}

func (f *File) read() (*Policy, fileStamp, error) {
	fh, err := os.Open(f.path)
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("auth.rbac_policy: %w", err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("auth.rbac_policy: %w", err)
	}
	p, err := Parse(fh, f.resources)
	if err != nil {
		return nil, fileStamp{}, fmt.Errorf("auth.rbac_policy %s: %w", f.path, err)
	}
	return p, fileStamp{size: st.Size(), mtime: st.ModTime()}, nil
}

// Policy is the policy in use.
func (f *File) Policy() *Policy {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.policy
}

// Err is the error of the last reload, nil when it succeeded.
func (f *File) Err() error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.lastErr
}

// Reload reads the file again (SIGHUP, POST /reload); on error the policy
// in use stays.
func (f *File) Reload() error {
	p, st, err := f.read()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastErr = err
	if err != nil {
		f.logger.Error("RBAC policy not reloaded; keeping the policy in use", "error", err)
		return err
	}
	f.policy, f.stamp = p, st
	f.logger.Info("RBAC policy loaded", "path", f.path, "rules", len(p.Rules))
	return nil
}

// Watch reloads the file when its size or modification time changes,
// checked every interval, until ctx ends; a broken version is reported
// once, not at every check.
func (f *File) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var failed fileStamp
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
		now := fileStamp{size: st.Size(), mtime: st.ModTime()}
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
