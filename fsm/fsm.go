package fsm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"log/slog"
	"sync"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

var (
	_ raft.FSM         = (*FSM)(nil)
	_ raft.BatchingFSM = (*FSM)(nil)
)

// FSM is the replicated state machine. Raft calls Apply, Snapshot and Restore
// from its FSM goroutine; State, AppliedIndex and AbandonCh may be called from
// any goroutine at any time.
type FSM struct {
	cfg    Config
	logger *slog.Logger

	// applyMu serialises Apply, ApplyBatch, Snapshot and Restore. Raft
	// already calls them from one goroutine; the lock keeps direct callers
	// (tests, tools) safe. It also guards the fields up to mu.
	applyMu sync.Mutex
	// txn is the write transaction, reused by every batch.
	txn *writeTxn
	// digest computes operation digests.
	digest *digester
	// sessions finds the idle sessions to prune.
	sessions sessionQueue
	// head holds the dedupe records of a state at version 0.0 in pruning
	// order (legacy.go).
	head dedupeQueue
	// version is the cluster version of the committed state: written
	// with applyMu and mu held, read with either.
	version Version
	// versionMoves counts the changes of version since New (under the same
	// locks): a move and its reverse between two looks are seen.
	versionMoves uint64
	// halt, once set, is why the FSM stopped applying the log: nothing is
	// applied any more until a snapshot this release reads replaces the
	// state (DESIGN.md, "Stop, never skip").
	halt *HaltError
	// capture keeps the hashes of the state at the last checkpoints.
	capture captures

	// mu guards the fields below. Apply holds it only to commit, so a State
	// always sees a committed transaction together with its applied index.
	mu        sync.RWMutex
	db        *memdb.MemDB
	applied   uint64
	abandonCh chan struct{}
	// appliedCh is closed when applied moves; nil until WaitApplied needs
	// it, so that commits nobody waits for allocate nothing.
	appliedCh chan struct{}
}

// Result is what Apply returns for every log entry (the Raft ApplyFuture's
// Response). It is never nil.
type Result struct {
	// Index is the Raft index that produced the outcome: the entry's own index,
	// or for a duplicate the index of the original write.
	Index uint64
	// Err is the outcome: nil on success, else wraps one of the package
	// sentinels (ErrNotFound, ErrCASConflict, ...). A failed command changes no
	// record other than its dedupe record.
	Err error
	// Value is the record the command wrote (ServiceInstance for
	// register_service, heartbeat and set_service_health, ConfigEntry for
	// set_config, Schedule for put_schedule, Run for claim_slot (the started
	// run) and record_run), nil for deletes and errors. For a duplicate it
	// is the record the original write wrote, kept with its dedupe record
	// (nil when an older version recorded it). It is the stored record
	// itself, shared with readers of the state: like everything State
	// returns, it must not be modified.
	Value proto.Message
	// Duplicate reports that the command's (client_id, sequence) was already
	// applied: Index and Err are the stored outcome and nothing changed.
	Duplicate bool
}

// New returns an FSM with an empty state.
func New(cfg Config) (*FSM, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	f := &FSM{
		cfg:       cfg,
		logger:    logger.With("component", "fsm"),
		db:        newMemDB(),
		abandonCh: make(chan struct{}),
		txn:       newWriteTxn(),
		digest:    newDigester(),
		sessions:  sessionQueue{valid: true},
		head:      dedupeQueue{valid: true},
	}
	txn := f.db.Txn(true)
	// The base row of the service index exists from the start, so that
	// a watch of one service holds its leaf's channel, which the first
	// registration of another service does not close.
	if err := setServiceIndex(txn, serviceIndexBase, 0); err != nil {
		txn.Abort()
		return nil, err
	}
	if cfg.InitialVersion != Version0_0 {
		if err := tinsert(txn, TableClusterVersion, &fsmv1.ClusterVersion{Major: cfg.InitialVersion.Major, Minor: cfg.InitialVersion.Minor}); err != nil {
			txn.Abort()
			return nil, fmt.Errorf("initial version: %w", err)
		}
		f.version = cfg.InitialVersion
	}
	txn.Commit()
	return f, nil
}

// Version returns the cluster version of the applied state.
func (f *FSM) Version() Version {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.version
}

// VersionMoves returns the cluster version of the applied state and how
// many times it changed since New: a caller that looks now and then sees
// that it moved even when it came back to the same version meanwhile.
func (f *FSM) VersionMoves() (Version, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.version, f.versionMoves
}

// Halted returns why the FSM stopped applying the log, nil while it
// applies it.
func (f *FSM) Halted() *HaltError {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.halt
}

// AppliedIndex returns the index of the last log entry applied (or of the
// snapshot last restored).
func (f *FSM) AppliedIndex() uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.applied
}

// State returns a read-only view of the current state: one memdb read
// transaction, consistent and unaffected by later applies.
func (f *FSM) State() *State {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return &State{txn: f.db.Txn(false), applied: f.applied, abandonCh: f.abandonCh}
}

// AbandonCh returns a channel that is closed when a Restore replaces the
// current state. Watchers add it to their watch set and re-list when it
// fires. Every State query that takes a watch set adds it already.
func (f *FSM) AbandonCh() <-chan struct{} {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.abandonCh
}

// Apply applies one committed log entry and returns its *Result. It never
// panics on bad input: undecodable or invalid commands give a Result with
// ErrInvalidCommand or ErrUnknownCommand. Entries other than
// raft.LogCommand carry no command and only advance the applied index.
func (f *FSM) Apply(l *raft.Log) any {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	if l == nil {
		return &Result{Err: fmt.Errorf("%w: nil log entry", ErrInvalidCommand)}
	}
	if h := f.Halted(); h != nil {
		return &Result{Index: l.Index, Err: h}
	}
	return f.applyIsolated(l)
}

// ApplyBatch implements raft.BatchingFSM: it applies consecutive committed
// log entries in one memdb write transaction and one commit, and returns
// for each the *Result that Apply would have returned. The state it leaves
// is the one Apply leaves after the same entries one at a time, byte for
// byte; readers see it only once the whole batch is applied.
func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	out := make([]any, len(logs))
	if h := f.Halted(); h != nil {
		for i, l := range logs {
			out[i] = &Result{Index: indexOf(l), Err: h}
		}
		return out
	}
	for rest, res := logs, out; len(rest) > 0; {
		n := f.applyLogs(rest, res)
		if h := f.Halted(); h != nil {
			for i := n; i < len(rest); i++ {
				res[i] = &Result{Index: indexOf(rest[i]), Err: h}
			}
			break
		}
		rest, res = rest[n:], res[n:]
	}
	return out
}

func indexOf(l *raft.Log) uint64 {
	if l == nil {
		return 0
	}
	return l.Index
}

// writeThenFail, when set, is called when an entry fails after it wrote to
// the transaction: a bug in an apply function, which must check everything
// before its first write (see DESIGN.md, "Atomicity"). Tests set it to fail
// loudly; in production the batch falls back to one transaction per entry.
var writeThenFail func(index uint64, err error)

// applyLogs applies logs in one write transaction and stores their results
// in out. If an entry fails after writing, the shared transaction cannot
// take back that entry's writes alone: the whole transaction is discarded
// and every entry is applied again in a transaction of its own. A single
// entry gets a transaction of its own from the start.
//
// It returns how many of logs it applied: all of them, or fewer when an
// entry is a checkpoint (the transaction is committed after it and its
// state captured; the caller goes on with the rest) or cannot be applied
// (the FSM halts before it: it and every later entry are left).
func (f *FSM) applyLogs(logs []*raft.Log, out []any) int {
	if len(logs) == 1 {
		out[0] = f.applyIsolated(logs[0])
		return 1
	}
	t := f.txn
	t.begin(f.database(), f.version)
	n := len(logs)
	for i, l := range logs {
		res, ok := f.applyEntry(t, l, false)
		if !ok {
			f.discard(t)
			f.logger.Error("an entry failed after writing: applying the batch one entry at a time",
				"index", l.Index, "entries", len(logs))
			for j, l := range logs {
				if f.Halted() != nil {
					return j
				}
				out[j] = f.applyIsolated(l)
			}
			return len(logs)
		}
		out[i] = res
		if t.halt != nil {
			// Nothing of the entry was written: the batch ends before it.
			n = i
			break
		}
		if t.checkpoint {
			n = i + 1
			break
		}
	}
	halt, checkpoint := t.halt, t.checkpoint
	last, ok := lastIndex(logs[:n])
	if !t.hasChanges() {
		// Nothing written: release the writer without waking anyone.
		t.abort()
		if ok {
			f.setApplied(last)
		}
	} else if err := t.updateIndexes(); err != nil {
		f.discard(t)
		f.logger.Error("index table update failed: applying the batch one entry at a time", "error", err)
		for j, l := range logs[:n] {
			out[j] = f.applyIsolated(l)
		}
		return n
	} else {
		f.commit(t, last)
	}
	switch {
	case halt != nil:
		f.stop(halt)
	case checkpoint:
		f.captureCheckpoint()
	}
	return n
}

// applyIsolated applies one entry in a transaction of its own. An entry
// that fails after writing is rolled back here: its operation's writes are
// discarded and only its outcome is recorded, or, when recording the
// outcome fails, nothing is.
func (f *FSM) applyIsolated(l *raft.Log) *Result {
	t := f.txn
	t.begin(f.database(), f.version)
	res, _ := f.applyEntry(t, l, true)
	halt, checkpoint := t.halt, t.checkpoint
	switch {
	case halt != nil:
		t.abort()
		f.stop(halt)
		return res
	case l == nil || !t.hasChanges():
		t.abort()
		if l != nil {
			f.setApplied(l.Index)
		}
	default:
		if err := t.updateIndexes(); err != nil {
			f.discard(t)
			f.setApplied(l.Index)
			return &Result{Index: l.Index, Err: err}
		}
		f.commit(t, l.Index)
	}
	if checkpoint {
		f.captureCheckpoint()
	}
	return res
}

// stop halts the FSM: it applies nothing more (DESIGN.md, "Stop, never
// skip").
func (f *FSM) stop(h *HaltError) {
	f.logger.Error("this agent cannot apply the replicated log any further: it stopped applying, keeps its data as it is and is not ready; upgrade it",
		"index", h.Index, "needs", h.Error())
	f.mu.Lock()
	f.halt = h
	f.mu.Unlock()
}

// lastIndex returns the index of the last non-nil entry.
func lastIndex(logs []*raft.Log) (uint64, bool) {
	for i := len(logs) - 1; i >= 0; i-- {
		if logs[i] != nil {
			return logs[i].Index, true
		}
	}
	return 0, false
}

// applyEntry applies one entry in t and returns its result. It returns
// false when the entry failed after writing to t and t is not isolated:
// the caller must then discard t. An isolated t holds only this entry, so
// applyEntry rolls it back itself.
func (f *FSM) applyEntry(t *writeTxn, l *raft.Log, isolated bool) (*Result, bool) {
	if l == nil {
		return &Result{Err: fmt.Errorf("%w: nil log entry", ErrInvalidCommand)}, true
	}
	if l.Type != raft.LogCommand {
		return &Result{Index: l.Index}, true
	}
	cmd, err := Decode(l.Data)
	if err != nil {
		// The leader encoded the entry: one that does not decode is a
		// newer release's format (or a bug). Skipping it would leave this
		// state different from the nodes that understand it: stop here.
		return f.halting(t, l, Version{}, fmt.Sprintf("the log entry is not understood (%v)", err)), true
	}
	if !t.legacy() && !t.noPrune {
		// A field this release does not know has a meaning it would not
		// apply (the leader drops the unknown fields of what callers send).
		if path := unknownField(cmd.ProtoReflect(), ""); path != "" {
			return f.halting(t, l, Version{}, fmt.Sprintf("the command has a field this release does not know (%s)", path)), true
		}
	}
	if err := validateEnvelope(cmd); err != nil {
		return &Result{Index: l.Index, Err: err}, true
	}
	if fd := cmd.ProtoReflect().WhichOneof(opOneof); fd == nil {
		// A newer release's operation: it decodes as an unknown field.
		return f.halting(t, l, Version{}, "the command has an operation this release does not know"), true
	}
	if v := cmd.GetSetClusterVersion(); v != nil {
		if to := (Version{v.GetMajor(), v.GetMinor()}); !to.Known() && Latest.Less(to) {
			return f.halting(t, l, to, "the cluster version moves to "+to.String()), true
		}
	}
	now := cmd.GetTime().AsTime()

	// The digest is taken before dispatch: an apply function may store
	// parts of the decoded command.
	var id identity
	if cmd.GetClientId() != "" {
		var res *Result
		if t.noPrune || t.legacy() {
			id, res = f.checkDedupe(t, l, cmd, now)
		} else {
			id, res = f.checkSession(t, l, cmd, now)
		}
		if res != nil {
			return res, true
		}
	}
	t.checkpoint = isCheckpoint(cmd)

	t.index = l.Index
	mark := t.writes
	value, opErr := dispatch(f, t, cmd)
	if opErr != nil {
		value = nil
		if t.writes != mark {
			// A rejected command must change nothing but its dedupe record.
			if writeThenFail != nil {
				writeThenFail(l.Index, opErr)
			}
			if !isolated {
				return nil, false
			}
			f.invalidateQueues()
			t.reset()
			mark = t.writes
		}
	}
	if err := f.finishEntry(t, cmd, now, id, value, opErr); err != nil {
		if t.writes != mark {
			if writeThenFail != nil {
				writeThenFail(l.Index, err)
			}
			if !isolated {
				return nil, false
			}
			f.invalidateQueues()
			t.reset()
		}
		return &Result{Index: l.Index, Err: err}, true
	}
	return &Result{Index: l.Index, Err: opErr, Value: value}, true
}

// halting records in t that the entry l cannot be applied by this
// release, and returns its Result: the FSM stops before it.
func (f *FSM) halting(t *writeTxn, l *raft.Log, needs Version, reason string) *Result {
	t.halt = &HaltError{Index: l.Index, Needs: needs, Reason: reason}
	return &Result{Index: l.Index, Err: t.halt}
}

// invalidateQueues drops the derived pruning queues (sessions, and the
// dedupe records of a state at 0.0): a transaction they may describe was
// discarded, or the state was replaced.
func (f *FSM) invalidateQueues() {
	f.sessions.invalidate()
	f.head.invalidate()
}

// identity is what applyEntry learnt of a write's client before applying
// it, for finishEntry to record its outcome.
type identity struct {
	// Raft mode: the digest of the operation (0 for a refusal), the
	// client's session (nil: none, or expired), and whether the table
	// held a session for the client (expired included).
	digest64 uint64
	session  *session
	stored   bool
	// External mode: the digest and the expired dedupe record the new
	// one replaces.
	digest   []byte
	replaced *fsmv1.DedupeRecord
}

// checkSession looks up the session of a write's client: a Result when
// the write must not be applied (a repeat, answered with its outcome; an
// identity reused for another write; a sequence whose outcome is no
// longer kept), else what finishEntry needs.
func (f *FSM) checkSession(t *writeTxn, l *raft.Log, cmd *fsmv1.Command, now time.Time) (identity, *Result) {
	var id identity
	// A refusal stands for whatever the write was: no digest to store or
	// compare.
	refusal := cmd.GetRefuseWrite() != nil
	if !refusal {
		id.digest64 = f.digest.digest64(l.Data)
	}
	s, err := lookup[*session](t, TableSessions, cmd.GetClientId())
	if err != nil {
		return id, &Result{Index: l.Index, Err: err}
	}
	id.stored = s != nil
	if s == nil || f.sessionExpired(s, now) {
		return id, nil
	}
	seq := cmd.GetSequence()
	if seq <= s.highest || seq <= s.droppedThrough {
		o := s.find(seq)
		cutoff := now.UnixNano() - int64(f.cfg.DedupeWindow)
		switch {
		case o != nil && o.time >= cutoff:
			if o.digest != 0 && !refusal && o.digest != id.digest64 {
				return id, &Result{Index: l.Index, Err: fmt.Errorf("%w: client_id %q sequence %d was already used for a different write",
					ErrInvalidCommand, cmd.GetClientId(), seq)}
			}
			return id, o.replay(cmd)
		case o != nil || seq <= s.droppedThrough:
			return id, &Result{Index: l.Index, Err: fmt.Errorf("%w: client_id %q sequence %d: the outcome of this write, if it was applied, is no longer kept (the session keeps the writes of the last %s); read the state to see whether it took effect, and send new writes with new sequences",
				ErrTooOldToReplay, cmd.GetClientId(), seq, f.cfg.DedupeWindow)}
		}
	}
	id.session = s
	return id, nil
}

// checkDedupe is checkSession of the external mode, which keeps a dedupe
// record per write.
//
// A state at 0.0 (legacy) keeps dedupe records too, as the agents that
// predate cluster versions do: refuse_write is an operation they do not
// know, so its digest is taken like any other.
func (f *FSM) checkDedupe(t *writeTxn, l *raft.Log, cmd *fsmv1.Command, now time.Time) (identity, *Result) {
	var id identity
	refusal := cmd.GetRefuseWrite() != nil && !t.legacy()
	if !refusal {
		id.digest = opDigest(l.Data)
	}
	// A retry of a write already applied returns the stored outcome.
	rec, err := lookup[*fsmv1.DedupeRecord](t, TableDedupe, cmd.GetClientId(), cmd.GetSequence())
	if err != nil {
		return id, &Result{Index: l.Index, Err: err}
	}
	if rec != nil && !f.dedupeExpired(rec, now) {
		if d := rec.GetOpDigest(); len(d) > 0 && !refusal && !bytes.Equal(d, id.digest) {
			return id, &Result{Index: l.Index, Err: fmt.Errorf("%w: client_id %q sequence %d was already used for a different write",
				ErrInvalidCommand, cmd.GetClientId(), cmd.GetSequence())}
		}
		return id, replayResult(rec, cmd)
	}
	id.replaced = rec
	return id, nil
}

// finishEntry prunes idle sessions and records the outcome of a write
// with a client ID in its client's session (in external mode: in a dedupe
// record of its own): its index, its error, and the record it wrote
// (value, shared with the table it is stored in: records are immutable).
func (f *FSM) finishEntry(t *writeTxn, cmd *fsmv1.Command, now time.Time, id identity, value proto.Message, opErr error) error {
	if t.legacy() {
		return f.finishLegacy(t, cmd, id, opErr)
	}
	if t.noPrune {
		if cmd.GetClientId() == "" {
			return nil
		}
		return f.recordDedupe(t, cmd, id, value, opErr)
	}
	if err := f.pruneSessions(t, now); err != nil {
		return err
	}
	if cmd.GetClientId() == "" {
		return nil
	}
	stored := id.stored
	if stored && id.session == nil {
		// The client's session had expired: pruning may just have
		// deleted it.
		s, err := lookup[*session](t, TableSessions, cmd.GetClientId())
		if err != nil {
			return err
		}
		stored = s != nil
	}
	s := f.withOutcome(id.session, cmd.GetClientId(), now, newOutcome(cmd, t.index, now, id.digest64, value, opErr))
	if err := t.insert(TableSessions, s); err != nil {
		return err
	}
	if !stored {
		f.sessions.add(sessionUse{time: s.lastUsed, clientID: s.clientID})
	}
	return nil
}

// recordDedupe stores the dedupe record of a write (external mode).
func (f *FSM) recordDedupe(t *writeTxn, cmd *fsmv1.Command, id identity, value proto.Message, opErr error) error {
	rec := &fsmv1.DedupeRecord{
		ClientId:  cmd.GetClientId(),
		Sequence:  cmd.GetSequence(),
		Index:     t.index,
		ErrorCode: errorCode(opErr),
		Time:      cmd.GetTime(),
		OpDigest:  id.digest,
	}
	if opErr != nil {
		rec.ErrorMessage = opErr.Error()
	} else {
		setDedupeValue(rec, value)
	}
	return t.insert(TableDedupe, rec)
}

// setDedupeValue keeps the record a write wrote in its dedupe record.
func setDedupeValue(rec *fsmv1.DedupeRecord, value proto.Message) {
	switch v := value.(type) {
	case *clusterv1.ServiceInstance:
		rec.Value = &fsmv1.DedupeRecord_Instance{Instance: v}
	case *clusterv1.ConfigEntry:
		// Without the value, which may be large (512 KiB) and which every
		// repeat carries itself (the digest matched): replayResult puts it
		// back.
		e := proto.CloneOf(v)
		e.Value = ""
		rec.Value = &fsmv1.DedupeRecord_ConfigEntry{ConfigEntry: e}
	case *schedulev1.Schedule:
		rec.Value = &fsmv1.DedupeRecord_Schedule{Schedule: v}
	case *schedulev1.Run:
		rec.Value = &fsmv1.DedupeRecord_Run{Run: v}
	}
}

// replayResult is the Result of a repeat of the write rec records. cmd is
// the repeat, nil when there is none (WriteOutcome): a config entry's value
// is taken from it (setDedupeValue leaves it out).
func replayResult(rec *fsmv1.DedupeRecord, cmd *fsmv1.Command) *Result {
	res := &Result{
		Index:     rec.GetIndex(),
		Err:       replayError(rec.GetErrorCode(), rec.GetErrorMessage()),
		Value:     dedupeValue(rec),
		Duplicate: true,
	}
	if e, ok := res.Value.(*clusterv1.ConfigEntry); ok && cmd.GetSetConfig() != nil {
		e = proto.CloneOf(e)
		e.Value = cmd.GetSetConfig().GetValue()
		res.Value = e
	}
	return res
}

// dedupeValue is the record a dedupe record keeps, nil when none (a
// delete, an error, a record of an older version).
func dedupeValue(rec *fsmv1.DedupeRecord) proto.Message {
	switch v := rec.GetValue().(type) {
	case *fsmv1.DedupeRecord_Instance:
		return v.Instance
	case *fsmv1.DedupeRecord_ConfigEntry:
		return v.ConfigEntry
	case *fsmv1.DedupeRecord_Schedule:
		return v.Schedule
	case *fsmv1.DedupeRecord_Run:
		return v.Run
	}
	return nil
}

// opDigest hashes the operation of an encoded command (not its identity or
// time): the SHA-256 of the wire bytes of every top-level field of the
// Command other than client_id, sequence and time, in order, with a
// register_service's instance.node left out. Commands are encoded
// deterministically (fields in number order), so this equals the SHA-256
// of the deterministic encoding of the command with those fields cleared,
// and every node computes it from the same log bytes without decoding or
// marshalling anything. data has passed Decode, so it parses.
//
// The node of a registration defaults to the agent the write came through
// (the gateway fills it in), so a client's retry through another agent
// differs there alone: it is the same write, as it is at another time.
func opDigest(data []byte) []byte {
	d := newDigester()
	d.write(data)
	return d.h.Sum(make([]byte, 0, sha256.Size))
}

// digester computes opDigest without allocating: the hash and its scratch
// space are reused from entry to entry (the FSM's is guarded by applyMu).
type digester struct {
	h   hash.Hash
	buf [binary.MaxVarintLen64]byte
	sum [sha256.Size]byte
}

func newDigester() *digester { return &digester{h: sha256.New()} }

// digest64 is opDigest64 of data.
func (d *digester) digest64(data []byte) uint64 {
	d.h.Reset()
	d.write(data)
	return binary.BigEndian.Uint64(d.h.Sum(d.sum[:0]))
}

// write hashes the fields of the encoded command data that opDigest
// covers.
func (d *digester) write(data []byte) {
	b := data[1:]
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			break
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			break
		}
		switch num {
		case fieldClientID, fieldSequence, fieldTime:
		case fieldRegisterService:
			d.writeWithout(b[:n+m], fieldInstance, fieldNode)
		default:
			d.h.Write(b[:n+m])
		}
		b = b[n+m:]
	}
}

// writeWithout hashes field (the wire bytes of one length-delimited field,
// tag included) without the field path names inside it: path[0] of its
// message, path[1] of that field's message, and so on, the lengths around
// it written again; field as it is when the path is not there (or does
// not parse). It builds nothing: it hashes the tag, the new length, and
// the pieces of the body that stay.
func (d *digester) writeWithout(field []byte, path ...protowire.Number) {
	_, typ, n := protowire.ConsumeTag(field)
	if n < 0 || typ != protowire.BytesType {
		d.h.Write(field)
		return
	}
	body, m := protowire.ConsumeBytes(field[n:])
	if m < 0 {
		d.h.Write(field)
		return
	}
	size, ok := bodySizeWithout(body, path)
	if !ok || size == len(body) {
		d.h.Write(field)
		return
	}
	d.h.Write(field[:n])
	d.h.Write(protowire.AppendVarint(d.buf[:0], uint64(size)))
	for rest := body; len(rest) > 0; {
		fnum, ftyp, tn := protowire.ConsumeTag(rest)
		vn := protowire.ConsumeFieldValue(fnum, ftyp, rest[tn:])
		f := rest[:tn+vn]
		switch {
		case fnum != path[0]:
			d.h.Write(f)
		case len(path) == 1:
		default:
			d.writeWithout(f, path[1:]...)
		}
		rest = rest[tn+vn:]
	}
}

// bodySizeWithout is the length of body (a message's fields) without the
// field path names, as writeWithout hashes it; false when it does not
// parse (writeWithout then keeps it whole).
func bodySizeWithout(body []byte, path []protowire.Number) (int, bool) {
	size := 0
	for rest := body; len(rest) > 0; {
		fnum, ftyp, tn := protowire.ConsumeTag(rest)
		if tn < 0 {
			return 0, false
		}
		vn := protowire.ConsumeFieldValue(fnum, ftyp, rest[tn:])
		if vn < 0 {
			return 0, false
		}
		switch {
		case fnum != path[0]:
			size += tn + vn
		case len(path) == 1:
		default:
			size += fieldSizeWithout(rest[:tn+vn], path[1:])
		}
		rest = rest[tn+vn:]
	}
	return size, true
}

// fieldSizeWithout is the length of what writeWithout hashes of field.
func fieldSizeWithout(field []byte, path []protowire.Number) int {
	_, typ, n := protowire.ConsumeTag(field)
	if n < 0 || typ != protowire.BytesType {
		return len(field)
	}
	body, m := protowire.ConsumeBytes(field[n:])
	if m < 0 {
		return len(field)
	}
	size, ok := bodySizeWithout(body, path)
	if !ok || size == len(body) {
		return len(field)
	}
	return n + protowire.SizeVarint(uint64(size)) + size
}

// Field numbers of the Command envelope, which opDigest leaves out, and of
// a registration's instance.node.
const (
	fieldClientID        = 1
	fieldSequence        = 2
	fieldTime            = 3
	fieldRegisterService = 10
	fieldInstance        = 1 // RegisterService.instance
	fieldNode            = 3 // ServiceInstance.node
)

// database returns the current memdb.
func (f *FSM) database() *memdb.MemDB {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.db
}

func (f *FSM) setApplied(index uint64) {
	f.mu.Lock()
	f.setAppliedLocked(index)
	f.mu.Unlock()
}

// setAppliedLocked sets the applied index and wakes WaitApplied callers.
// mu must be held for writing.
func (f *FSM) setAppliedLocked(index uint64) {
	f.applied = index
	if f.appliedCh != nil {
		close(f.appliedCh)
		f.appliedCh = nil
	}
}

// WaitApplied returns once the FSM has applied index (or a snapshot at or
// after it), or with ctx's error. A follower serving a consistent read
// waits here for the leader's read index.
func (f *FSM) WaitApplied(ctx context.Context, index uint64) error {
	for {
		f.mu.Lock()
		if f.applied >= index {
			f.mu.Unlock()
			return nil
		}
		if f.appliedCh == nil {
			f.appliedCh = make(chan struct{})
		}
		ch := f.appliedCh
		f.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// commit makes a write transaction visible together with the applied
// index.
func (f *FSM) commit(t *writeTxn, applied uint64) {
	f.mu.Lock()
	t.txn.Commit()
	f.setAppliedLocked(applied)
	if f.version != t.version {
		f.versionMoves++
	}
	f.version = t.version
	f.mu.Unlock()
	t.txn, t.base = nil, nil
}

// discard aborts a transaction that may have written: the pruning queues
// may describe its writes, so they are dropped too.
func (f *FSM) discard(t *writeTxn) {
	t.abort()
	f.invalidateQueues()
}

// applyFunc applies one operation. It returns the record written (nil for
// deletes) or an outcome error. It validates and looks up everything before
// its first write, so that a rejected command has written nothing: its
// transaction is shared with the other entries of the batch (see DESIGN.md,
// "Atomicity"). It owns cmd, decoded for this apply alone, and may store
// parts of it.
type applyFunc func(f *FSM, t *writeTxn, cmd *fsmv1.Command) (proto.Message, error)

// appliers is the dispatch table, keyed by the name of the field of the
// Command.op oneof. A test checks that every field has an entry.
var appliers = map[protoreflect.Name]applyFunc{
	"register_service":    (*FSM).applyRegisterService,
	"deregister_service":  (*FSM).applyDeregisterService,
	"heartbeat":           (*FSM).applyHeartbeat,
	"set_service_health":  (*FSM).applySetServiceHealth,
	"set_config":          (*FSM).applySetConfig,
	"delete_config":       (*FSM).applyDeleteConfig,
	"put_schedule":        (*FSM).applyPutSchedule,
	"delete_schedule":     (*FSM).applyDeleteSchedule,
	"claim_slot":          (*FSM).applyClaimSlot,
	"record_run":          (*FSM).applyRecordRun,
	"restored":            (*FSM).applyRestored,
	"set_cluster_ca":      (*FSM).applySetClusterCA,
	"refuse_write":        (*FSM).applyRefuseWrite,
	"set_placements":      (*FSM).applySetPlacements,
	"set_cluster_version": (*FSM).applySetClusterVersion,
}

// applyRefuseWrite records a write the leader refused: its outcome is the
// error it names, kept in its dedupe record (finishEntry) like any other
// outcome. It needs the write's identity and a persisted error code.
func (f *FSM) applyRefuseWrite(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetRefuseWrite()
	if cmd.GetClientId() == "" {
		return nil, invalidf("refuse_write: client_id is required")
	}
	if !knownErrorCode(op.GetErrorCode()) {
		return nil, invalidf("refuse_write.error_code: %q is not an outcome code", op.GetErrorCode())
	}
	return nil, replayError(op.GetErrorCode(), op.GetErrorMessage())
}

// applyRestored marks a restore: every table's index becomes this entry's
// (the index table itself only records the others; a table the state's
// version does not have is left alone).
func (f *FSM) applyRestored(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	for _, name := range Tables() {
		if name == TableIndex || !tableAt(name, t.version) {
			continue
		}
		if err := t.touch(name); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// opOneof is the descriptor of Command.op.
var opOneof = (&fsmv1.Command{}).ProtoReflect().Descriptor().Oneofs().ByName("op")

func dispatch(f *FSM, t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	fd := cmd.ProtoReflect().WhichOneof(opOneof)
	if fd == nil {
		// Either the proposer set no operation, or a newer binary proposed
		// one this version does not know (it decodes as an unknown field).
		f.logger.Error("command has no operation this version knows",
			"index", t.index, "client_id", cmd.GetClientId(), "sequence", cmd.GetSequence())
		return nil, fmt.Errorf("%w: no operation this version knows", ErrUnknownCommand)
	}
	if t.legacy() && !opAt(fd.Name(), t.version) {
		// An operation the agents of version 0.0 do not know: they record
		// it as unknown, and so does a state at 0.0 here (the leader
		// proposes none of them while the cluster is at 0.0).
		f.logger.Error("command has no operation this version knows",
			"index", t.index, "client_id", cmd.GetClientId(), "sequence", cmd.GetSequence(), "op", string(fd.Name()), "cluster_version", t.version.String())
		return nil, fmt.Errorf("%w: no operation this version knows", ErrUnknownCommand)
	}
	fn, ok := appliers[fd.Name()]
	if !ok {
		// Unreachable while TestDispatchTableComplete passes.
		return nil, fmt.Errorf("%w: operation %s", ErrUnknownCommand, fd.Name())
	}
	return fn(f, t, cmd)
}

// validateEnvelope checks the fields every command needs.
func validateEnvelope(cmd *fsmv1.Command) error {
	if err := checkTime("time", cmd.GetTime(), true); err != nil {
		return err
	}
	if err := checkOptionalID("client_id", cmd.GetClientId()); err != nil {
		return err
	}
	if cmd.GetClientId() != "" && cmd.GetSequence() == 0 {
		return invalidf("sequence: required when client_id is set")
	}
	return nil
}

// lookupDedupe returns the dedupe record of (clientID, sequence), or nil.
func lookupDedupe(txn *memdb.Txn, clientID string, sequence uint64) (*fsmv1.DedupeRecord, error) {
	return first[*fsmv1.DedupeRecord](txn, TableDedupe, indexID, clientID, sequence)
}

// dedupeExpired reports whether rec is older than the dedupe window at now.
func (f *FSM) dedupeExpired(rec *fsmv1.DedupeRecord, now time.Time) bool {
	return rec.GetTime().AsTime().Before(now.Add(-f.cfg.DedupeWindow))
}

// first returns the first record of an index lookup, or the zero T.
func first[T any](txn *memdb.Txn, table, index string, args ...any) (T, error) {
	obj, err := tfirst(txn, table, index, args...)
	return asRecord[T](table, obj, err)
}

// asRecord converts the result of a point lookup: the zero T when nothing
// was found, an error naming the table when the read failed or the record
// has another type.
func asRecord[T any](table string, obj any, err error) (T, error) {
	var zero T
	if err != nil {
		return zero, fmt.Errorf("read %s: %w", table, err)
	}
	if obj == nil {
		return zero, nil
	}
	v, ok := obj.(T)
	if !ok {
		return zero, fmt.Errorf("read %s: record of type %T", table, obj)
	}
	return v, nil
}

// collect drains an iterator into a slice.
func collect[T any](it memdb.ResultIterator) []T {
	var out []T
	for obj := it.Next(); obj != nil; obj = it.Next() {
		out = append(out, obj.(T))
	}
	return out
}
