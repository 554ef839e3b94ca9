package fsm

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

var _ raft.FSM = (*FSM)(nil)

// maxPrunePerApply bounds the dedupe records one Apply deletes, so that a
// leader clock jump cannot make a single entry expensive.
const maxPrunePerApply = 256

// FSM is the replicated state machine. Raft calls Apply, Snapshot and Restore
// from its FSM goroutine; State, AppliedIndex and AbandonCh may be called from
// any goroutine at any time.
type FSM struct {
	cfg    Config
	logger *slog.Logger

	// applyMu serialises Apply, Snapshot and Restore. Raft already calls them
	// from one goroutine; the lock keeps direct callers (tests, tools) safe.
	applyMu sync.Mutex

	// mu guards the fields below. Apply holds it only to commit, so a State
	// always sees a committed transaction together with its applied index.
	mu        sync.RWMutex
	db        *memdb.MemDB
	applied   uint64
	abandonCh chan struct{}
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
	// Value is a copy of the record the command wrote (ServiceInstance for
	// register_service, heartbeat and set_service_health, ConfigEntry for
	// set_config, Schedule for put_schedule, Run for claim_slot (the started
	// run) and record_run), nil for deletes, errors and duplicates.
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
	return &FSM{
		cfg:       cfg,
		logger:    logger.With("component", "fsm"),
		db:        newMemDB(),
		abandonCh: make(chan struct{}),
	}, nil
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
	return f.apply(l)
}

// apply does the work of Apply and always advances the applied index.
func (f *FSM) apply(l *raft.Log) *Result {
	if l.Type != raft.LogCommand {
		f.setApplied(l.Index)
		return &Result{Index: l.Index}
	}
	cmd, err := Decode(l.Data)
	if err != nil {
		// Only the leader's proposer sees the Result, and the leader encoded
		// the entry: an entry that does not decode is a bug or a newer
		// binary's format, and the state may diverge from nodes that
		// understand it. Log it on every node.
		f.logger.Error("log entry not understood", "index", l.Index, "term", l.Term, "error", err)
		f.setApplied(l.Index)
		return &Result{Index: l.Index, Err: err}
	}
	if err := validateEnvelope(cmd); err != nil {
		f.setApplied(l.Index)
		return &Result{Index: l.Index, Err: err}
	}
	now := cmd.GetTime().AsTime()
	db := f.database()

	// A retry of a write already applied returns the stored outcome.
	if cmd.GetClientId() != "" {
		rec, err := lookupDedupe(db.Txn(false), cmd.GetClientId(), cmd.GetSequence())
		if err != nil {
			f.setApplied(l.Index)
			return &Result{Index: l.Index, Err: err}
		}
		if rec != nil && !f.dedupeExpired(rec, now) {
			f.setApplied(l.Index)
			if d := rec.GetOpDigest(); len(d) > 0 && !bytes.Equal(d, opDigest(cmd)) {
				return &Result{Index: l.Index, Err: fmt.Errorf("%w: client_id %q sequence %d was already used for a different write",
					ErrInvalidCommand, cmd.GetClientId(), cmd.GetSequence())}
			}
			return &Result{
				Index:     rec.GetIndex(),
				Err:       replayError(rec.GetErrorCode(), rec.GetErrorMessage()),
				Duplicate: true,
			}
		}
	}

	t := newWriteTxn(db, l.Index)
	value, opErr := dispatch(f, t, cmd)
	if opErr != nil {
		// Throw away whatever the operation wrote: a rejected command changes
		// nothing but its dedupe record.
		t.abort()
		t = newWriteTxn(db, l.Index)
		value = nil
	}
	if err := f.finishWrite(t, cmd, now, opErr); err != nil {
		t.abort()
		f.setApplied(l.Index)
		return &Result{Index: l.Index, Err: err}
	}
	if len(t.changed) == 0 {
		// Nothing to write (a rejected command without a client ID):
		// release the writer without waking anyone.
		t.abort()
		f.setApplied(l.Index)
	} else {
		f.commit(t)
	}
	if value != nil {
		value = proto.Clone(value)
	}
	return &Result{Index: l.Index, Err: opErr, Value: value}
}

// finishWrite prunes expired dedupe records, records the outcome of a write
// with a client ID and updates the index table.
func (f *FSM) finishWrite(t *writeTxn, cmd *fsmv1.Command, now time.Time, opErr error) error {
	if err := f.pruneDedupe(t, now); err != nil {
		return err
	}
	if cmd.GetClientId() != "" {
		rec := &fsmv1.DedupeRecord{
			ClientId:  cmd.GetClientId(),
			Sequence:  cmd.GetSequence(),
			Index:     t.index,
			ErrorCode: errorCode(opErr),
			Time:      cmd.GetTime(),
			OpDigest:  opDigest(cmd),
		}
		if opErr != nil {
			rec.ErrorMessage = opErr.Error()
		}
		if err := t.insert(TableDedupe, rec); err != nil {
			return err
		}
	}
	return t.updateIndexes()
}

// opDigest hashes the operation of cmd (not its identity or time), with
// deterministic marshalling so that every node computes the same digest.
func opDigest(cmd *fsmv1.Command) []byte {
	op := &fsmv1.Command{}
	proto.Merge(op, cmd)
	op.ClientId, op.Sequence, op.Time = "", 0, nil
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(op)
	if err != nil {
		return nil
	}
	sum := sha256.Sum256(b)
	return sum[:]
}

// database returns the current memdb.
func (f *FSM) database() *memdb.MemDB {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.db
}

func (f *FSM) setApplied(index uint64) {
	f.mu.Lock()
	f.applied = index
	f.mu.Unlock()
}

// commit makes a write transaction visible together with its index.
func (f *FSM) commit(t *writeTxn) {
	f.mu.Lock()
	t.txn.Commit()
	f.applied = t.index
	f.mu.Unlock()
}

// applyFunc applies one operation. It returns the record written (nil for
// deletes) or an outcome error; on error, the caller discards its writes.
type applyFunc func(f *FSM, t *writeTxn, cmd *fsmv1.Command) (proto.Message, error)

// appliers is the dispatch table, keyed by the name of the field of the
// Command.op oneof. A test checks that every field has an entry.
var appliers = map[protoreflect.Name]applyFunc{
	"register_service":   (*FSM).applyRegisterService,
	"deregister_service": (*FSM).applyDeregisterService,
	"heartbeat":          (*FSM).applyHeartbeat,
	"set_service_health": (*FSM).applySetServiceHealth,
	"set_config":         (*FSM).applySetConfig,
	"delete_config":      (*FSM).applyDeleteConfig,
	"put_schedule":       (*FSM).applyPutSchedule,
	"delete_schedule":    (*FSM).applyDeleteSchedule,
	"claim_slot":         (*FSM).applyClaimSlot,
	"record_run":         (*FSM).applyRecordRun,
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

// pruneDedupe deletes up to maxPrunePerApply dedupe records older than the
// window, oldest first.
func (f *FSM) pruneDedupe(t *writeTxn, now time.Time) error {
	it, err := t.txn.Get(TableDedupe, indexTime)
	if err != nil {
		return fmt.Errorf("prune dedupe records: %w", err)
	}
	var expired []*fsmv1.DedupeRecord
	for obj := it.Next(); obj != nil && len(expired) < maxPrunePerApply; obj = it.Next() {
		rec := obj.(*fsmv1.DedupeRecord)
		if !f.dedupeExpired(rec, now) {
			break
		}
		expired = append(expired, rec)
	}
	for _, rec := range expired {
		if err := t.delete(TableDedupe, rec); err != nil {
			return err
		}
	}
	return nil
}

// writeTxn is a memdb write transaction that remembers which tables it
// changed, so that the index table can record t.index for them.
type writeTxn struct {
	txn     *memdb.Txn
	index   uint64
	changed map[string]bool
}

func newWriteTxn(db *memdb.MemDB, index uint64) *writeTxn {
	return &writeTxn{txn: db.Txn(true), index: index, changed: make(map[string]bool)}
}

func (t *writeTxn) insert(table string, obj any) error {
	if err := t.txn.Insert(table, obj); err != nil {
		return fmt.Errorf("insert into %s: %w", table, err)
	}
	t.changed[table] = true
	return nil
}

func (t *writeTxn) delete(table string, obj any) error {
	if err := t.txn.Delete(table, obj); err != nil {
		return fmt.Errorf("delete from %s: %w", table, err)
	}
	t.changed[table] = true
	return nil
}

func (t *writeTxn) deleteAll(table, index string, args ...any) error {
	n, err := t.txn.DeleteAll(table, index, args...)
	if err != nil {
		return fmt.Errorf("delete from %s: %w", table, err)
	}
	if n > 0 {
		t.changed[table] = true
	}
	return nil
}

func (t *writeTxn) abort() { t.txn.Abort() }

// updateIndexes records t.index in the index table for every changed table.
func (t *writeTxn) updateIndexes() error {
	tables := make([]string, 0, len(t.changed))
	for table := range t.changed {
		tables = append(tables, table)
	}
	slices.Sort(tables)
	for _, table := range tables {
		if err := t.txn.Insert(TableIndex, &indexEntry{Table: table, Value: t.index}); err != nil {
			return fmt.Errorf("update index of %s: %w", table, err)
		}
	}
	return nil
}

// first returns the first record of an index lookup, or the zero T.
func first[T any](txn *memdb.Txn, table, index string, args ...any) (T, error) {
	var zero T
	obj, err := txn.First(table, index, args...)
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
