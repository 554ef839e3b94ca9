// Package identity holds what makes a node itself: its stable node ID, the
// PiTrust PKI material (CA, leaves, renewals) and the reloadable TLS
// sources every port and client of the agent is built from.
package identity

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
)

// NodeIDFile is the name of the file in the data dir that holds the node ID.
const NodeIDFile = "node-id"

// ErrBadNodeID is returned when the node-id file exists but does not hold a
// valid ID. The file is never overwritten in that case: an operator must
// look at it, because a new ID would make the node a stranger to its cluster.
var ErrBadNodeID = errors.New("invalid node id")

var nodeIDPattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// ValidNodeID reports whether id has the form of a node ID (a lowercase UUID).
func ValidNodeID(id string) bool { return nodeIDPattern.MatchString(id) }

// LoadOrCreateNodeID returns the node ID stored in dataDir, creating it the
// first time. The ID is random, never derived from an address, so a node that
// moves keeps its identity. Creation is atomic: the ID is written to a
// temporary file, synced and renamed into place.
func LoadOrCreateNodeID(dataDir string) (string, error) {
	path := filepath.Join(dataDir, NodeIDFile)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		id := string(bytes.TrimSpace(b))
		if !ValidNodeID(id) {
			return "", fmt.Errorf("%s: %w %q (expected a lowercase UUID)", path, ErrBadNodeID, id)
		}
		return id, nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("read node id: %w", err)
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return "", fmt.Errorf("create data dir: %w", err)
	}
	id, err := newUUID()
	if err != nil {
		return "", err
	}
	if err := WriteFileAtomic(path, []byte(id+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write node id: %w", err)
	}
	return id, nil
}

func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate node id: %w", err)
	}
	b[6] = (b[6] & 0x0f) | 0x40 // version 4
	b[8] = (b[8] & 0x3f) | 0x80 // RFC 4122 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// WriteFileAtomic writes data to path with perm through a synced temporary
// file in the same directory and a rename, then syncs the directory: a
// reader sees the old file or the whole new one, never a part.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}
