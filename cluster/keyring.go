package cluster

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/hashicorp/memberlist"

	"pilab.hu/pivirt-agent/identity"
)

// ErrGossipNotEncrypted: a keyring operation on a node whose gossip is not
// encrypted (cluster.gossip.encrypt_key_file unset at its first start).
var ErrGossipNotEncrypted = errors.New("gossip encryption is off on this node (cluster.gossip.encrypt_key_file)")

// ErrBadGossipKey: a key that is not base64 of 16, 24 or 32 bytes.
var ErrBadGossipKey = errors.New("invalid gossip key")

// ParseGossipKey decodes a base64 gossip key of 16, 24 or 32 bytes.
func ParseGossipKey(s string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: not base64: %v", ErrBadGossipKey, err)
	}
	switch len(key) {
	case 16, 24, 32:
		return key, nil
	}
	return nil, fmt.Errorf("%w: %d bytes, want 16, 24 or 32", ErrBadGossipKey, len(key))
}

// KeyFingerprint names a key without revealing it: the first 8 bytes of
// its SHA-256, hex.
func KeyFingerprint(key []byte) string {
	sum := sha256.Sum256(key)
	return hex.EncodeToString(sum[:8])
}

// IsKeyFingerprint reports whether s has the form of a KeyFingerprint (16
// hex digits); a gossip key never has (base64 of 16 bytes or more).
func IsKeyFingerprint(s string) bool {
	if len(s) != 16 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// KeyByFingerprint is the installed key whose KeyFingerprint is fp.
func (g *Gossip) KeyByFingerprint(fp string) ([]byte, error) {
	kr := g.keyring
	if kr == nil {
		return nil, ErrGossipNotEncrypted
	}
	var have []string
	for _, k := range kr.GetKeys() {
		if KeyFingerprint(k) == fp {
			return k, nil
		}
		have = append(have, KeyFingerprint(k))
	}
	return nil, fmt.Errorf("no installed gossip key has the fingerprint %s (installed: %s)", fp, strings.Join(have, ", "))
}

// keyringFile is the on-disk keyring: the keys in base64, primary first.
type keyringFile struct {
	Keys []string `json:"keys"`
}

// loadKeyring reads a keyring file; ok is false when there is none.
func loadKeyring(path string) (keys [][]byte, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	var f keyringFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, false, fmt.Errorf("gossip keyring %s: %w", path, err)
	}
	if len(f.Keys) == 0 {
		return nil, false, fmt.Errorf("gossip keyring %s: no keys", path)
	}
	for i, s := range f.Keys {
		k, err := ParseGossipKey(s)
		if err != nil {
			return nil, false, fmt.Errorf("gossip keyring %s: key %d: %w", path, i, err)
		}
		keys = append(keys, k)
	}
	return keys, true, nil
}

// saveKeyring writes the keyring (primary first) atomically, 0600.
func saveKeyring(path string, kr *memberlist.Keyring) error {
	var f keyringFile
	for _, k := range kr.GetKeys() { // primary first
		f.Keys = append(f.Keys, base64.StdEncoding.EncodeToString(k))
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	return identity.WriteFileAtomic(path, b, 0o600)
}

// KeyringState is a node's keyring by fingerprint.
type KeyringState struct {
	Primary string
	Keys    []string
}

// Keyring returns this node's gossip keyring.
func (g *Gossip) Keyring() (KeyringState, error) {
	kr := g.keyring
	if kr == nil {
		return KeyringState{}, ErrGossipNotEncrypted
	}
	st := KeyringState{Primary: KeyFingerprint(kr.GetPrimaryKey())}
	for _, k := range kr.GetKeys() {
		st.Keys = append(st.Keys, KeyFingerprint(k))
	}
	return st, nil
}

// Keyring operations.
const (
	KeyringInstall = "install"
	KeyringUse     = "use"
	KeyringRemove  = "remove"
)

// ChangeKeyring installs a key, makes an installed key primary (the one
// gossip encrypts with; all installed keys decrypt), or removes a key that
// is not primary; the keyring file is rewritten.
func (g *Gossip) ChangeKeyring(op string, key []byte) (KeyringState, error) {
	kr := g.keyring
	if kr == nil {
		return KeyringState{}, ErrGossipNotEncrypted
	}
	g.keyringMu.Lock()
	defer g.keyringMu.Unlock()
	var err error
	switch op {
	case KeyringInstall:
		err = kr.AddKey(key)
	case KeyringUse:
		err = kr.UseKey(key)
	case KeyringRemove:
		err = kr.RemoveKey(key)
	default:
		err = fmt.Errorf("unknown keyring operation %q", op)
	}
	if err != nil {
		return KeyringState{}, fmt.Errorf("gossip keyring %s %s: %w", op, KeyFingerprint(key), err)
	}
	if g.keyringFile != "" {
		if err := saveKeyring(g.keyringFile, kr); err != nil {
			return KeyringState{}, fmt.Errorf("gossip keyring %s %s: applied, but saving %s failed: %w", op, KeyFingerprint(key), g.keyringFile, err)
		}
	}
	g.logger.Info("gossip keyring changed", "op", op, "key", KeyFingerprint(key), "primary", KeyFingerprint(kr.GetPrimaryKey()))
	return g.Keyring()
}
