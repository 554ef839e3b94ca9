package storetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"sync"

	"github.com/hashicorp/raft"
)

// KV is a tiny deterministic key-value raft.FSM for tests. Commands are made
// with Set and Fail. Apply returns the entry's log index (uint64) for a set,
// and an error value for a fail command, which Store.Apply passes through.
type KV struct {
	mu      sync.Mutex
	data    map[string]string
	applied uint64
}

var _ raft.FSM = (*KV)(nil)

// NewKV returns an empty KV.
func NewKV() *KV { return &KV{data: make(map[string]string)} }

// NewKVFSM is NewKV as the FSM constructor NewCluster takes.
func NewKVFSM() raft.FSM { return NewKV() }

type kvCommand struct {
	Op    string `json:"op"`
	Key   string `json:"key,omitempty"`
	Value string `json:"value,omitempty"`
}

// Set is the command that sets key to value.
func Set(key, value string) []byte {
	b, _ := json.Marshal(kvCommand{Op: "set", Key: key, Value: value})
	return b
}

// Fail is the command whose FSM response is an error with message msg; it
// changes no state.
func Fail(msg string) []byte {
	b, _ := json.Marshal(kvCommand{Op: "fail", Value: msg})
	return b
}

// Apply implements raft.FSM.
func (k *KV) Apply(l *raft.Log) any {
	var c kvCommand
	if err := json.Unmarshal(l.Data, &c); err != nil {
		return fmt.Errorf("decode command at %d: %w", l.Index, err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.applied = l.Index
	switch c.Op {
	case "set":
		k.data[c.Key] = c.Value
		return l.Index
	case "fail":
		return errors.New(c.Value)
	default:
		return fmt.Errorf("unknown op %q", c.Op)
	}
}

// Get returns the value of key.
func (k *KV) Get(key string) (string, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	v, ok := k.data[key]
	return v, ok
}

// Len is the number of keys.
func (k *KV) Len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.data)
}

// AppliedIndex is the index of the last command the FSM applied (or of the
// snapshot it was restored from).
func (k *KV) AppliedIndex() uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.applied
}

type kvState struct {
	Applied uint64            `json:"applied"`
	Data    map[string]string `json:"data"`
}

// Snapshot implements raft.FSM: it captures a copy; Persist does the I/O.
func (k *KV) Snapshot() (raft.FSMSnapshot, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return &kvSnapshot{state: kvState{Applied: k.applied, Data: maps.Clone(k.data)}}, nil
}

// Restore implements raft.FSM.
func (k *KV) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	var st kvState
	if err := json.NewDecoder(rc).Decode(&st); err != nil {
		return fmt.Errorf("decode kv snapshot: %w", err)
	}
	if st.Data == nil {
		st.Data = make(map[string]string)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.data, k.applied = st.Data, st.Applied
	return nil
}

// EncodeState returns the bytes a KV snapshot of data holds, for
// Store.Restore in tests.
func EncodeState(data map[string]string) []byte {
	b, _ := json.Marshal(kvState{Data: data})
	return b
}

type kvSnapshot struct{ state kvState }

func (s *kvSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := json.NewEncoder(sink).Encode(s.state); err != nil {
		sink.Cancel()
		return fmt.Errorf("write kv snapshot: %w", err)
	}
	return sink.Close()
}

func (s *kvSnapshot) Release() {}
