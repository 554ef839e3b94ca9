package fsm

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// This file lets a store other than Raft keep the state: the etcd-backed
// store (store/etcdstore) holds the records in etcd, mirrors them into an
// FSM (Ingest, Replace) and computes the effect of a command with the same
// apply functions Raft uses (Evaluate), so both modes share one semantics.

// PendingIndex is the index Evaluate applies a command at: the index of a
// write is known only once the external store has committed it. Every
// index field a command sets (create_index, modify_index, revision, index)
// holds PendingIndex in the evaluated records; ResolvePending replaces it.
const PendingIndex uint64 = 1 << 62

// Read is a point lookup an apply function made: the record of Table whose
// primary key is Args (found or not). The outcome of the command depends on
// it.
type Read struct {
	Table string
	Args  []any
}

// Change is a record a command wrote: Record is the new record, nil when
// the record with primary key Key was deleted.
type Change struct {
	Table  string
	Key    []byte
	Record proto.Message
}

// Evaluation is the effect of a command on the state at index Applied.
type Evaluation struct {
	// Result is what Apply would return, at PendingIndex.
	Result *Result
	// Changes are the writes, in table order then key order.
	Changes []Change
	// Reads are the lookups made, in order (repeats included).
	Reads []Read
	// Applied is the index of the state the command was evaluated on.
	Applied uint64
}

// Evaluate computes what applying the encoded command data would do to the
// current state, without changing it: the result and the records written.
// The dedupe records are not pruned: the external store expires them.
func (f *FSM) Evaluate(data []byte) (Evaluation, error) {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	t := newWriteTxn()
	db, applied := f.dbApplied()
	t.begin(db, f.version)
	defer t.abort()
	t.track, t.noPrune = true, true
	// The queue is derived from the committed table; an evaluation must
	// not move it.
	f.sessions.invalidate()
	res, _ := f.applyEntry(t, &raft.Log{Index: PendingIndex, Type: raft.LogCommand, Data: data}, true)
	f.sessions.invalidate()
	ev := Evaluation{Result: res, Reads: slices.Clone(t.reads), Applied: applied}
	for n, m := range t.overlay {
		name := tableDefs[n].name
		if name == TableIndex || len(m) == 0 {
			continue
		}
		if t.noOverlay[n] {
			return Evaluation{}, fmt.Errorf("evaluate: the keys written to %s are unknown", name)
		}
		start := len(ev.Changes)
		for key, obj := range m {
			c := Change{Table: name, Key: []byte(key)}
			if obj != nil {
				rec, ok := obj.(proto.Message)
				if !ok {
					return Evaluation{}, fmt.Errorf("evaluate: %s record of type %T", name, obj)
				}
				c.Record = rec
			}
			ev.Changes = append(ev.Changes, c)
		}
		slices.SortFunc(ev.Changes[start:], func(a, b Change) int { return bytes.Compare(a.Key, b.Key) })
	}
	return ev, nil
}

func (f *FSM) dbApplied() (*memdb.MemDB, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.db, f.applied
}

// Ingested is one record change of an external store: Record is the new
// record; Delete, when Record is nil, the record to delete.
type Ingested struct {
	Table  string
	Record proto.Message
	Delete proto.Message
}

// Ingest applies the record changes an external store committed at index,
// in one transaction, and makes index the applied index. The records must
// have their index fields resolved (ResolvePending). It fails, changing
// nothing, if a change does not fit the state (a delete of a missing
// record, an unknown table): the store must then Replace the state.
func (f *FSM) Ingest(index uint64, changes []Ingested) error {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	f.sessions.invalidate()
	if len(changes) == 0 {
		f.setApplied(max(index, f.AppliedIndex()))
		return nil
	}
	t := f.txn
	t.begin(f.database(), f.version)
	t.index = index
	for _, c := range changes {
		if n := tableNum(c.Table); n < 0 || c.Table == TableIndex {
			f.discard(t)
			return fmt.Errorf("ingest: unknown table %q", c.Table)
		}
		var err error
		if c.Record != nil {
			err = t.insert(c.Table, storedRecord(c.Record))
		} else {
			err = t.delete(c.Table, storedRecord(c.Delete))
		}
		if c.Table == TableClusterVersion {
			// The version the external store now holds.
			t.version = Version0_0
			if v, ok := c.Record.(*fsmv1.ClusterVersion); ok {
				t.version = Version{v.GetMajor(), v.GetMinor()}
			}
			if !t.version.Known() {
				v := t.version
				f.discard(t)
				return fmt.Errorf("ingest at %d: %w: the store is at cluster version %s; this release runs up to %s", index, ErrNeedsNewerVersion, v, Latest)
			}
		}
		if err != nil {
			f.discard(t)
			return fmt.Errorf("ingest at %d: %w", index, err)
		}
	}
	if err := t.updateIndexes(); err != nil {
		f.discard(t)
		return err
	}
	f.commit(t, index)
	return nil
}

// TableRecord is a record of a table.
type TableRecord struct {
	Table  string
	Record proto.Message
}

// Replace makes records, as of index, the whole state: like Restore, the
// swap is atomic for readers and wakes every watcher to re-list. Every
// table's index becomes index. Like Restore it merges into the state, so
// a record the state already holds (the same or an equal message) costs
// nothing (replaceRecords).
func (f *FSM) Replace(index uint64, records []TableRecord) error {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	return f.replaceRecords(index, records, nil)
}

// ReplaceKeeping is Replace, except that each table named in keep ends up
// holding exactly the records it holds in from, and records lists none of
// them: a caller that keeps tables as another state has them (a restore's
// plan keeps this cluster's sessions, dedupe records, placements, cluster
// version and CA) does not list them — Records encodes every session anew
// — and a record from holds that the state holds too stays in place.
func (f *FSM) ReplaceKeeping(index uint64, records []TableRecord, from *State, keep ...string) error {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	return f.replaceRecords(index, records, &kept{from: from, tables: keep})
}

// kept names the tables of a replace taken as a state has them.
type kept struct {
	from   *State
	tables []string
}

// Len returns the number of records of table (not TableIndex).
func (s *State) Len(table string) (int, error) {
	if n := tableNum(table); n < 0 || table == TableIndex {
		return 0, fmt.Errorf("unknown table %q", table)
	}
	n, err := tlen(s.txn, table)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", table, err)
	}
	return n, nil
}

// Records returns every record of table (not TableIndex), in key order.
func (s *State) Records(table string) ([]proto.Message, error) {
	if n := tableNum(table); n < 0 || table == TableIndex {
		return nil, fmt.Errorf("unknown table %q", table)
	}
	it, err := tget(s.txn, table, indexID)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", table, err)
	}
	var out []proto.Message
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if sess, ok := obj.(*session); ok {
			out = append(out, sessionToProto(sess))
			continue
		}
		rec, ok := obj.(proto.Message)
		if !ok {
			return nil, fmt.Errorf("read %s: record of type %T", table, obj)
		}
		out = append(out, rec)
	}
	return out, nil
}

// NewRecord returns an empty record of table's type, nil for an unknown
// table (or TableIndex).
func NewRecord(table string) proto.Message {
	switch table {
	case TableServices:
		return &clusterv1.ServiceInstance{}
	case TableConfig, TableConfigHistory:
		return &clusterv1.ConfigEntry{}
	case TableSchedules:
		return &schedulev1.Schedule{}
	case TableScheduleRuns:
		return &schedulev1.Run{}
	case TableCA:
		return &fsmv1.ClusterCA{}
	case TablePlacements:
		return &fsmv1.Placement{}
	case TableDedupe:
		return &fsmv1.DedupeRecord{}
	case TableSessions:
		return &fsmv1.Session{}
	case TableClusterVersion:
		return &fsmv1.ClusterVersion{}
	}
	return nil
}

// storedRecord is the form the state stores rec in: a session's
// in-memory record for an *fsmv1.Session (Records returns sessions as
// those), rec itself otherwise.
func storedRecord(rec proto.Message) any {
	if m, ok := rec.(*fsmv1.Session); ok {
		return sessionFromProto(m)
	}
	return rec
}

// KeyRecord returns a record of table with only its primary-key fields,
// set from args as a lookup takes them (Read.Args).
func KeyRecord(table string, args ...any) (proto.Message, error) {
	str := func(i int) (string, error) {
		if i >= len(args) {
			return "", fmt.Errorf("key of %s: %d arguments", table, len(args))
		}
		s, ok := args[i].(string)
		if !ok {
			return "", fmt.Errorf("key of %s: argument %d of type %T, want string", table, i, args[i])
		}
		return s, nil
	}
	u64 := func(i int) (uint64, error) {
		if i >= len(args) {
			return 0, fmt.Errorf("key of %s: %d arguments", table, len(args))
		}
		v, ok := args[i].(uint64)
		if !ok {
			return 0, fmt.Errorf("key of %s: argument %d of type %T, want uint64", table, i, args[i])
		}
		return v, nil
	}
	switch table {
	case TableServices:
		svc, err := str(0)
		if err != nil {
			return nil, err
		}
		id, err := str(1)
		return &clusterv1.ServiceInstance{Service: svc, InstanceId: id}, err
	case TableConfig:
		key, err := str(0)
		return &clusterv1.ConfigEntry{Key: key}, err
	case TableConfigHistory:
		key, err := str(0)
		if err != nil {
			return nil, err
		}
		rev, err := u64(1)
		return &clusterv1.ConfigEntry{Key: key, Revision: rev}, err
	case TableSchedules:
		id, err := str(0)
		return &schedulev1.Schedule{Id: id}, err
	case TableScheduleRuns:
		id, err := str(0)
		if err != nil {
			return nil, err
		}
		if len(args) != 2 {
			return nil, fmt.Errorf("key of %s: %d arguments", table, len(args))
		}
		var slot *timestamppb.Timestamp
		switch v := args[1].(type) {
		case *timestamppb.Timestamp:
			slot = v
		case time.Time:
			slot = timestamppb.New(v)
		default:
			return nil, fmt.Errorf("key of %s: argument 1 of type %T", table, args[1])
		}
		return &schedulev1.Run{ScheduleId: id, Slot: slot}, nil
	case TableCA:
		return &fsmv1.ClusterCA{}, nil
	case TableClusterVersion:
		return &fsmv1.ClusterVersion{}, nil
	case TablePlacements:
		kind, err := str(0)
		if err != nil {
			return nil, err
		}
		id, err := str(1)
		return &fsmv1.Placement{Kind: kind, Id: id}, err
	case TableDedupe:
		id, err := str(0)
		if err != nil {
			return nil, err
		}
		seq, err := u64(1)
		return &fsmv1.DedupeRecord{ClientId: id, Sequence: seq}, err
	case TableSessions:
		id, err := str(0)
		return &fsmv1.Session{ClientId: id}, err
	}
	return nil, fmt.Errorf("key of unknown table %q", table)
}

// PrimaryKey returns the primary key of a record of table, as Change.Key
// holds it.
func PrimaryKey(table string, rec proto.Message) ([]byte, error) {
	n := tableNum(table)
	if n < 0 || table == TableIndex {
		return nil, fmt.Errorf("unknown table %q", table)
	}
	ok, key, err := idIndexers[n].FromObject(storedRecord(rec))
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("%s record without its key fields", table)
	}
	return key, nil
}

// indexFields are the names of the fields that hold the index of the write
// that set them.
var indexFields = []protoreflect.Name{"create_index", "modify_index", "revision", "index"}

// SetIndexFields replaces, in the top-level index fields of rec
// (create_index, modify_index, revision, index) and in those of the record
// a dedupe record keeps, every value equal to from with to. It returns
// whether any changed.
func SetIndexFields(rec proto.Message, from, to uint64) bool {
	changed := setIndexFields(rec, from, to)
	if d, ok := rec.(*fsmv1.DedupeRecord); ok {
		if v := dedupeValue(d); v != nil {
			changed = setIndexFields(v, from, to) || changed
		}
	}
	return changed
}

func setIndexFields(rec proto.Message, from, to uint64) bool {
	m := rec.ProtoReflect()
	fields := m.Descriptor().Fields()
	changed := false
	for _, name := range indexFields {
		fd := fields.ByName(name)
		if fd == nil || fd.Kind() != protoreflect.Uint64Kind || fd.Cardinality() == protoreflect.Repeated {
			continue
		}
		if m.Get(fd).Uint() == from {
			if to == 0 {
				m.Clear(fd)
			} else {
				m.Set(fd, protoreflect.ValueOfUint64(to))
			}
			changed = true
		}
	}
	return changed
}

// ClearIndexFields clears the top-level index fields of rec.
func ClearIndexFields(rec proto.Message) {
	m := rec.ProtoReflect()
	fields := m.Descriptor().Fields()
	for _, name := range indexFields {
		if fd := fields.ByName(name); fd != nil {
			m.Clear(fd)
		}
	}
}

// WriteSnapshot writes the state to w in the snapshot format, as of its
// applied index.
func (s *State) WriteSnapshot(w io.Writer) error {
	return writeSnapshot(w, s.txn, s.applied)
}

// CompareRecords orders records of one table by primary key.
func CompareRecords(table string, a, b proto.Message) int {
	ka, _ := PrimaryKey(table, a)
	kb, _ := PrimaryKey(table, b)
	return cmp.Compare(string(ka), string(kb))
}
