package authz

import (
	"io"
	"log/slog"

	"pilab.hu/pivirt-agent/gateway/watchfile"
)

// File is a policy file reloaded when it changes (watchfile): a new
// version is used only if it parses and validates; otherwise the policy in
// use stays and the error is logged and kept for Err.
type File struct {
	*watchfile.File[*Policy]
}

// LoadFile reads and validates the policy at path; an invalid file is an
// error here (nothing to fall back to).
func LoadFile(path string, resources []string, logger *slog.Logger) (*File, error) {
	return LoadFileFunc(path, func() []string { return resources }, logger)
}

// LoadFileFunc is LoadFile with the resources a policy may name asked at
// each read of the file (they may change while it is watched).
func LoadFileFunc(path string, resources func() []string, logger *slog.Logger) (*File, error) {
	f, err := watchfile.Load("auth.rbac_policy", path, func(r io.Reader) (*Policy, error) { return Parse(r, resources()) }, logger)
	if err != nil {
		return nil, err
	}
	return &File{f}, nil
}

// Policy is the policy in use.
func (f *File) Policy() *Policy { return f.Value() }
