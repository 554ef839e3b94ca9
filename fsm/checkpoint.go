package fsm

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/hashicorp/go-memdb"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// Replicas are compared by a hash of their state at the same log index
// (DESIGN.md, "Replicas checked against each other"). The index is a
// checkpoint: an entry the leader proposes for it (CheckpointCommand).
// Every node commits its state right after the checkpoint, keeps the
// memdb read transaction of that state (O(1)) and hashes it in the
// background, table by table, so that the comparison holds under
// continuous writes and costs the apply path nothing.

// ErrNoCheckpoint: this node holds no hash of its state at the index asked
// (it installed a snapshot past the checkpoint, or the checkpoint is older
// than the ones it keeps).
var ErrNoCheckpoint = errors.New("no state hash at that index")

// keptCheckpoints is how many checkpoint hashes a node keeps.
const keptCheckpoints = 8

// CheckpointCommand is the command of a checkpoint entry: a delete_config
// with an empty key and the checkpoint flag, no client ID. Every version
// refuses it as a delete without writing anything, the versions that
// predate the flag included, so a checkpoint is proposed whatever the
// cluster version and never makes an older node log an error.
func CheckpointCommand() *fsmv1.Command {
	return &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Checkpoint: true}}}
}

// isCheckpoint reports whether cmd is CheckpointCommand's.
func isCheckpoint(cmd *fsmv1.Command) bool {
	dc := cmd.GetDeleteConfig()
	return dc.GetCheckpoint() && dc.GetKey() == "" && cmd.GetClientId() == ""
}

// StateHash is the hash of a state: per table, its records' count and the
// SHA-256 of their encodings in key order (each with its uvarint length,
// as a snapshot stream holds them), at a log index.
type StateHash struct {
	Index   uint64
	Version Version
	Tables  []TableHash
}

// TableHash is one table of a StateHash.
type TableHash struct {
	Name    string
	Records uint64
	Sum     [sha256.Size]byte
}

// Table returns the hash of the named table; false when h has none.
func (h *StateHash) Table(name string) (TableHash, bool) {
	for _, t := range h.Tables {
		if t.Name == name {
			return t, true
		}
	}
	return TableHash{}, false
}

// Differ names the tables whose hashes differ between h and o, leaving out
// the tables in skip (a table one side did not hash counts as empty).
func (h *StateHash) Differ(o *StateHash, skip ...string) []string {
	var out []string
	for _, name := range Tables() {
		if slices.Contains(skip, name) {
			continue
		}
		a, _ := h.Table(name)
		b, _ := o.Table(name)
		if a.Sum != b.Sum || a.Records != b.Records {
			out = append(out, name)
		}
	}
	return out
}

// hashState hashes every table of txn.
func hashState(txn *memdb.Txn, index uint64, v Version) (*StateHash, error) {
	out := &StateHash{Index: index, Version: v}
	var (
		buf []byte
		lb  [binary.MaxVarintLen64]byte
	)
	for _, t := range tableDefs {
		th := TableHash{Name: t.name}
		it, err := tget(txn, t.name, indexID)
		if err != nil {
			return nil, fmt.Errorf("hash %s: %w", t.name, err)
		}
		h := sha256.New()
		for obj := it.Next(); obj != nil; obj = it.Next() {
			if buf, err = t.codec.encode(buf[:0], obj); err != nil {
				return nil, fmt.Errorf("hash %s: %w", t.name, err)
			}
			h.Write(lb[:binary.PutUvarint(lb[:], uint64(len(buf)))])
			h.Write(buf)
			th.Records++
		}
		h.Sum(th.Sum[:0])
		out.Tables = append(out.Tables, th)
	}
	return out, nil
}

// HashSnapshot hashes the state a snapshot stream holds, as StateHash does
// for a live state: a snapshot of any format this release reads, an
// archive's state of another node or version included. Tables the
// snapshot does not hold hash as empty. Records are decoded and encoded
// again, so the hash does not depend on the encoder that wrote them.
func HashSnapshot(r io.Reader) (*StateHash, error) {
	db := newMemDB()
	txn, hdr, _, err := readSnapshot(r, db)
	if err != nil {
		return nil, err
	}
	txn.Commit()
	state := db.Txn(false)
	v := Version0_0
	if rec, err := first[*fsmv1.ClusterVersion](state, TableClusterVersion, indexID, clusterVersionKey); err == nil && rec != nil {
		v = Version{rec.GetMajor(), rec.GetMinor()}
	}
	return hashState(state, hdr.GetLastIndex(), v)
}

// HashState hashes the current state (at its applied index).
func (f *FSM) HashState() (*StateHash, error) {
	f.applyMu.Lock()
	f.mu.RLock()
	txn, index, v := f.db.Txn(false), f.applied, f.version
	f.mu.RUnlock()
	f.applyMu.Unlock()
	return hashState(txn, index, v)
}

// captures holds the hashes of the last checkpoints, newest last.
type captures struct {
	mu   sync.Mutex
	list []*capture
	// sem lets one hash run at a time.
	sem chan struct{}
}

type capture struct {
	index uint64
	done  chan struct{}
	// dropped is closed when the capture leaves the list before its hash
	// started: it is not computed, and its state is let go.
	dropped chan struct{}
	hash    *StateHash
	err     error
}

// captureCheckpoint keeps the committed state (the checkpoint's) and
// hashes it in the background. applyMu is held.
func (f *FSM) captureCheckpoint() {
	f.mu.RLock()
	txn, index, v := f.db.Txn(false), f.applied, f.version
	f.mu.RUnlock()
	c := &capture{index: index, done: make(chan struct{}), dropped: make(chan struct{})}
	f.capture.mu.Lock()
	if f.capture.sem == nil {
		f.capture.sem = make(chan struct{}, 1)
	}
	sem := f.capture.sem
	f.capture.list = append(f.capture.list, c)
	if n := len(f.capture.list); n > keptCheckpoints {
		for _, old := range f.capture.list[:n-keptCheckpoints] {
			close(old.dropped)
		}
		f.capture.list = append(f.capture.list[:0], f.capture.list[n-keptCheckpoints:]...)
	}
	f.capture.mu.Unlock()
	go func() {
		defer close(c.done)
		select {
		case sem <- struct{}{}:
		case <-c.dropped:
			c.err = fmt.Errorf("%w: the checkpoint at index %d was dropped for newer ones before its hash was computed", ErrNoCheckpoint, index)
			return
		}
		defer func() { <-sem }()
		c.hash, c.err = hashState(txn, index, v)
	}()
}

// CheckpointHash returns the hash of this node's state at the checkpoint
// of the given index: it waits until the node applied it and the hash is
// computed, or ctx ends. ErrNoCheckpoint when the node holds none for that
// index.
func (f *FSM) CheckpointHash(ctx context.Context, index uint64) (*StateHash, error) {
	if err := f.WaitApplied(ctx, index); err != nil {
		if h := f.Halted(); h != nil {
			return nil, h
		}
		return nil, err
	}
	f.capture.mu.Lock()
	var c *capture
	for _, x := range f.capture.list {
		if x.index == index {
			c = x
		}
	}
	f.capture.mu.Unlock()
	if c == nil {
		return nil, fmt.Errorf("%w: index %d (this node keeps the last %d checkpoints, and none it installed a snapshot past)", ErrNoCheckpoint, index, keptCheckpoints)
	}
	select {
	case <-c.done:
		return c.hash, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// SumString is a table sum in hex, shortened for people (16 digits).
func (t TableHash) SumString() string { return fmt.Sprintf("%x", t.Sum[:8]) }
