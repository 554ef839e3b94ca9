package fsm

import (
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// Table names. [Tables] lists them in snapshot order.
const (
	// TableServices holds *clusterv1.ServiceInstance, keyed by (service, instance_id).
	TableServices = "services"
	// TableConfig holds the current *clusterv1.ConfigEntry of each key.
	TableConfig = "config"
	// TableConfigHistory holds the last versions of each config key, keyed by (key, revision).
	TableConfigHistory = "config_history"
	// TableSchedules holds *schedulev1.Schedule, keyed by id.
	TableSchedules = "schedules"
	// TableScheduleRuns holds *schedulev1.Run, keyed by (schedule_id, slot).
	TableScheduleRuns = "schedule_runs"
	// TableCA holds the cluster CA, *fsmv1.ClusterCA: at most one record.
	TableCA = "ca"
	// TablePlacements is the placement catalog: *fsmv1.Placement, keyed by
	// (kind, id), the node whose backend holds each object.
	TablePlacements = "placements"
	// TableDedupe holds *fsmv1.DedupeRecord, keyed by (client_id, sequence):
	// the outcome of each write in etcd mode (Raft mode keeps sessions).
	TableDedupe = "dedupe"
	// TableSessions holds the session of each client (fsmv1.Session in
	// snapshots, an unexported type in memory), keyed by client_id: the
	// outcomes of its recent writes (Raft mode).
	TableSessions = "sessions"
	// TableClusterVersion holds the cluster version, *fsmv1.ClusterVersion:
	// at most one record; none at version 0.0.
	TableClusterVersion = "cluster_version"
	// TableIndex records, per table, the last Raft index that changed it.
	TableIndex = "index"
)

// Index names used inside the package.
const (
	indexID = "id"
	// indexIDPrefix looks up the records whose primary key starts with
	// the given leading fields (memdb's "_prefix" form of the id index):
	// the instances of a service, the history of a config key, the runs
	// of a schedule. A secondary index would cost an insert into a second
	// radix tree on every write.
	indexIDPrefix = indexID + "_prefix"
	indexVM       = "vm_id"
	indexNode     = "node"
)

// tableServiceIndex is derived state, not replicated and not in
// snapshots (so not in tableDefs): per service, the index of the last change
// to its instances, kept after its last instance is gone, so that a blocking
// query on one service wakes for that service only. The row of
// serviceIndexBase holds the index every service has at least: the index of
// the last restore (or of a command that touched the whole services table),
// since a restored state carries no history of the services it replaced.
const tableServiceIndex = "service_index"

// serviceIndexBase is the key of the base row of tableServiceIndex; no
// service name contains NUL.
const serviceIndexBase = "\x00"

// serviceIndexEntry is a row of tableServiceIndex.
type serviceIndexEntry struct {
	Service string
	Value   uint64
}

// tableServiceCounts is derived state, not replicated and not in
// snapshots: the number of instances of each (service, health), kept by
// every write to the services table (writeTxn) and rebuilt on a restore, so
// that the instance-count metrics read one row per (service, health), not
// every instance. A row whose count falls to zero is deleted.
const tableServiceCounts = "service_counts"

// ServiceCount is a row of tableServiceCounts: the instances of a service
// in one health state.
type ServiceCount struct {
	Service   string
	Health    clusterv1.Health
	Instances int
}

var serviceCountID = keyIndex(
	strField(func(c *ServiceCount) string { return c.Service }),
	uintField(func(c *ServiceCount) uint64 { return uint64(c.Health) }),
)

// tableServiceDeadlines is derived state, not replicated and not in
// snapshots: a row per instance deadline, kept by every write to the
// services table (writeTxn) and rebuilt on a restore, ordered by kind
// then time, so that the leader's reapers read only the instances due, not
// every instance each second. Kinds: deadlineTTL, when a passing instance's
// TTL runs out (last heartbeat plus TTL); deadlineCritical, when a critical
// instance with a deregister_critical_after is due for deregistration. An
// instance with neither has no row and costs its writes nothing here (a
// secondary index of the services table would cost every write of every
// instance an update of its radix tree).
const tableServiceDeadlines = "service_deadlines"

// The kinds of tableServiceDeadlines rows.
const (
	deadlineTTL      = "ttl"
	deadlineCritical = "critical"
)

// deadlineEntry is a row of tableServiceDeadlines.
type deadlineEntry struct {
	Kind     string
	At       *timestamppb.Timestamp
	Service  string
	Instance string
}

var deadlineID = keyIndex(
	strField(func(e *deadlineEntry) string { return e.Kind }),
	timeField(func(e *deadlineEntry) *timestamppb.Timestamp { return e.At }),
	strField(func(e *deadlineEntry) string { return e.Service }),
	strField(func(e *deadlineEntry) string { return e.Instance }),
)

// tableServiceChecks is derived state, not replicated and not in
// snapshots: a row per instance with a health check, keyed by its node,
// kept by every write to the services table (writeTxn) and rebuilt on a
// restore, so that the agent running its node's checks reads and watches
// the rows of its node only, not every instance on every write anywhere.
const tableServiceChecks = "service_checks"

// CheckEntry is a row of tableServiceChecks: the health check of an
// instance registered with Node.
type CheckEntry struct {
	Node     string
	Service  string
	Instance string
	Check    *clusterv1.HealthCheck
}

var checkRowID = keyIndex(
	strField(func(e *CheckEntry) string { return e.Node }),
	strField(func(e *CheckEntry) string { return e.Service }),
	strField(func(e *CheckEntry) string { return e.Instance }),
)

// checkEntry is the row of tableServiceChecks of inst, or nil when it has
// no check (or no node).
func checkEntry(inst *clusterv1.ServiceInstance) *CheckEntry {
	if inst == nil || inst.GetCheck() == nil || inst.GetNode() == "" {
		return nil
	}
	return &CheckEntry{Node: inst.GetNode(), Service: inst.GetService(), Instance: inst.GetInstanceId(), Check: inst.GetCheck()}
}

// deadlines is each kind of deadline and how an instance's is found.
var deadlines = []struct {
	kind string
	of   func(*clusterv1.ServiceInstance) (time.Time, bool)
}{{deadlineTTL, ttlDeadline}, {deadlineCritical, criticalDeadline}}

// indexEntry is a row of TableIndex.
type indexEntry struct {
	Table string
	Value uint64
}

// tableDef describes one table: its memdb schema and its snapshot codec.
type tableDef struct {
	name    string
	indexes map[string]*memdb.IndexSchema
	codec   recordCodec
}

// recordCodec encodes a table's records for snapshots.
type recordCodec struct {
	// encode appends the encoding of obj to b.
	encode func(b []byte, obj any) ([]byte, error)
	// decode parses one record.
	decode func(b []byte) (any, error)
}

// Primary-key indexers. Non-unique indexes of the same table name them as
// pk, so that their keys have room for the primary key memdb appends.
var (
	serviceID = keyIndex(
		strField((*clusterv1.ServiceInstance).GetService),
		strField((*clusterv1.ServiceInstance).GetInstanceId),
	)
	configHistoryID = keyIndex(
		strField((*clusterv1.ConfigEntry).GetKey),
		uintField((*clusterv1.ConfigEntry).GetRevision),
	)
	scheduleID = keyIndex(strField((*schedulev1.Schedule).GetId))
	runID      = keyIndex(
		strField((*schedulev1.Run).GetScheduleId),
		timeField((*schedulev1.Run).GetSlot),
	)
	placementID = keyIndex(
		strField((*fsmv1.Placement).GetKind),
		strField((*fsmv1.Placement).GetId),
	)
	dedupeID = keyIndex(
		strField((*fsmv1.DedupeRecord).GetClientId),
		uintField((*fsmv1.DedupeRecord).GetSequence),
	)
)

// tableDefs is the registry of tables, in snapshot order. Adding a table here
// adds it to the schema, to Tables() and to snapshots.
var tableDefs = []tableDef{
	{
		name: TableServices,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: serviceID},
		),
		codec: protoCodec[*clusterv1.ServiceInstance](),
	},
	{
		name: TableConfig,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField((*clusterv1.ConfigEntry).GetKey))},
		),
		codec: protoCodec[*clusterv1.ConfigEntry](),
	},
	{
		name: TableConfigHistory,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: configHistoryID},
		),
		codec: protoCodec[*clusterv1.ConfigEntry](),
	},
	{
		name: TableSchedules,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: scheduleID},
			&memdb.IndexSchema{Name: indexVM, Indexer: scheduleID.secondary(strField((*schedulev1.Schedule).GetVmId))},
		),
		codec: protoCodec[*schedulev1.Schedule](),
	},
	{
		name: TableScheduleRuns,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: runID},
		),
		codec: protoCodec[*schedulev1.Run](),
	},
	{
		name: TableCA,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField(func(*fsmv1.ClusterCA) string { return clusterCAKey }))},
		),
		codec: protoCodec[*fsmv1.ClusterCA](),
	},
	{
		name: TablePlacements,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: placementID},
			&memdb.IndexSchema{Name: indexNode, Indexer: placementID.secondary(strField((*fsmv1.Placement).GetNode))},
		),
		codec: protoCodec[*fsmv1.Placement](),
	},
	{
		name: TableDedupe,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: dedupeID},
		),
		codec: protoCodec[*fsmv1.DedupeRecord](),
	},
	{
		name: TableSessions,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: sessionID},
		),
		codec: sessionCodec,
	},
	{
		name: TableClusterVersion,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField(func(*fsmv1.ClusterVersion) string { return clusterVersionKey }))},
		),
		codec: protoCodec[*fsmv1.ClusterVersion](),
	},
	{
		name: TableIndex,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField(func(e *indexEntry) string { return e.Table }))},
		),
		codec: recordCodec{encode: encodeIndexEntry, decode: decodeIndexEntry},
	},
}

// tableSince is the snapshot format that added a table; the others exist
// since format 1.
var tableSince = map[string]uint32{TableCA: 2, TablePlacements: 3, TableSessions: 4, TableClusterVersion: 5}

// tableVersion is the cluster version that added a table; the others exist
// at 0.0. A state at an older version holds no record and no index row of
// the table (a downgrade drops them), so that it is written in a snapshot
// format that version reads.
var tableVersion = map[string]Version{TablePlacements: Version0_1, TableSessions: Version0_1, TableClusterVersion: Version0_1}

// tableAt reports whether a state at cluster version v has the table.
func tableAt(table string, v Version) bool {
	since, ok := tableVersion[table]
	return !ok || !v.Less(since)
}

// formatFor is the oldest snapshot format that can hold the given
// non-empty tables: a snapshot is written in it, so that agents of an
// older version still read it while no newer table is in use (a rolling
// upgrade).
func formatFor(nonEmpty []string) uint32 {
	v := uint32(1)
	for _, t := range nonEmpty {
		v = max(v, tableSince[t])
	}
	return v
}

// Tables returns the name of every table of the state, in snapshot order.
func Tables() []string {
	names := make([]string, len(tableDefs))
	for i, t := range tableDefs {
		names[i] = t.name
	}
	return names
}

// tableDefByName returns the definition of a table.
func tableDefByName(name string) (tableDef, bool) {
	i := slices.IndexFunc(tableDefs, func(t tableDef) bool { return t.name == name })
	if i < 0 {
		return tableDef{}, false
	}
	return tableDefs[i], true
}

// schema is the memdb schema built from tableDefs (the compact tables
// have a row of tableCompact instead of tables of their own).
var schema = func() *memdb.DBSchema {
	s := &memdb.DBSchema{Tables: make(map[string]*memdb.TableSchema, len(tableDefs))}
	for _, t := range tableDefs {
		if !isCompact(t.name) {
			s.Tables[t.name] = &memdb.TableSchema{Name: t.name, Indexes: t.indexes}
		}
	}
	s.Tables[tableCompact] = &memdb.TableSchema{Name: tableCompact, Indexes: indexes(
		&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField(func(r *compactRow) string { return r.Table }))},
	)}
	s.Tables[tableServiceIndex] = &memdb.TableSchema{Name: tableServiceIndex, Indexes: indexes(
		&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: keyIndex(strField(func(e *serviceIndexEntry) string { return e.Service }))},
	)}
	s.Tables[tableServiceChecks] = &memdb.TableSchema{Name: tableServiceChecks, Indexes: indexes(
		&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: checkRowID},
	)}
	s.Tables[tableServiceDeadlines] = &memdb.TableSchema{Name: tableServiceDeadlines, Indexes: indexes(
		&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: deadlineID},
	)}
	s.Tables[tableServiceCounts] = &memdb.TableSchema{Name: tableServiceCounts, Indexes: indexes(
		&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: serviceCountID},
	)}
	if err := s.Validate(); err != nil {
		panic(fmt.Sprintf("fsm: invalid memdb schema: %v", err))
	}
	return s
}()

// newMemDB returns an empty database with the FSM schema.
func newMemDB() *memdb.MemDB {
	db, err := memdb.NewMemDB(schema)
	if err != nil {
		// The schema is validated at package init: this cannot happen.
		panic(fmt.Sprintf("fsm: create memdb: %v", err))
	}
	return db
}

func indexes(list ...*memdb.IndexSchema) map[string]*memdb.IndexSchema {
	m := make(map[string]*memdb.IndexSchema, len(list))
	for _, ix := range list {
		m[ix.Name] = ix
	}
	return m
}

// keyField is one field of an index key. Exactly one getter is set:
//
//   - str: the bytes followed by NUL, so that an exact lookup of "web" never
//     matches "webapp" and compound keys sort by their first field, then
//     the next; "" is a missing value;
//   - u64: 8 bytes, big endian, so that keys sort numerically;
//   - ts: 12 bytes that sort chronologically (timeKey); nil is a missing
//     value.
type keyField[T any] struct {
	str func(T) string
	u64 func(T) uint64
	ts  func(T) *timestamppb.Timestamp
}

func strField[T any](get func(T) string) keyField[T] { return keyField[T]{str: get} }

func uintField[T any](get func(T) uint64) keyField[T] { return keyField[T]{u64: get} }

func timeField[T any](get func(T) *timestamppb.Timestamp) keyField[T] {
	return keyField[T]{ts: get}
}

// keyIndexer indexes records of type T by the concatenation of the
// encodings of its fields; a record with a missing field is not indexed. It
// builds a key with one allocation (memdb's CompoundIndex makes one per
// field and more to concatenate).
type keyIndexer[T any] struct {
	fields []keyField[T]
	// pk is the primary-key indexer of the table when this index is not
	// unique: memdb appends the primary key to the key, and FromObject
	// leaves room for it.
	pk *keyIndexer[T]
}

func keyIndex[T any](fields ...keyField[T]) *keyIndexer[T] {
	return &keyIndexer[T]{fields: fields}
}

// secondary returns a non-unique index of the same table as the primary
// key indexer x.
func (x *keyIndexer[T]) secondary(fields ...keyField[T]) *keyIndexer[T] {
	return &keyIndexer[T]{fields: fields, pk: x}
}

// size returns the length of the key of o, or false when a field is
// missing.
func (x *keyIndexer[T]) size(o T) (int, bool) {
	n := 0
	for _, f := range x.fields {
		switch {
		case f.str != nil:
			s := f.str(o)
			if s == "" {
				return 0, false
			}
			n += len(s) + 1
		case f.u64 != nil:
			n += 8
		default:
			if f.ts(o) == nil {
				return 0, false
			}
			n += 12
		}
	}
	return n, true
}

func (x *keyIndexer[T]) appendKey(b []byte, o T) []byte {
	for _, f := range x.fields {
		switch {
		case f.str != nil:
			b = append(append(b, f.str(o)...), 0)
		case f.u64 != nil:
			b = binary.BigEndian.AppendUint64(b, f.u64(o))
		default:
			ts := f.ts(o)
			b = appendTimeKey(b, ts.GetSeconds(), ts.GetNanos())
		}
	}
	return b
}

func (x *keyIndexer[T]) FromObject(obj any) (bool, []byte, error) {
	o, ok := obj.(T)
	if !ok {
		return false, nil, fmt.Errorf("index: object of type %T", obj)
	}
	n, ok := x.size(o)
	if !ok {
		return false, nil, nil
	}
	if x.pk != nil {
		if m, ok := x.pk.size(o); ok {
			n += m
		}
	}
	return true, x.appendKey(make([]byte, 0, n), o), nil
}

// PrefixFromArgs builds the key prefix of the records whose leading fields
// equal args (fewer arguments than fields; none matches every record).
// String fields keep their terminator, so "web" never matches "webapp".
func (x *keyIndexer[T]) PrefixFromArgs(args ...any) ([]byte, error) {
	if len(args) > len(x.fields) {
		return nil, fmt.Errorf("index: %d prefix arguments, at most %d", len(args), len(x.fields))
	}
	if len(args) == len(x.fields) {
		return x.FromArgs(args...)
	}
	lead := &keyIndexer[T]{fields: x.fields[:len(args)]}
	return lead.FromArgs(args...)
}

// FromArgs builds the key of an exact lookup: one argument per field, a
// string, a uint64, and a *timestamppb.Timestamp or a time.Time.
func (x *keyIndexer[T]) FromArgs(args ...any) ([]byte, error) {
	if len(args) != len(x.fields) {
		return nil, fmt.Errorf("index: %d arguments, want %d", len(args), len(x.fields))
	}
	n := 0
	for i, f := range x.fields {
		switch {
		case f.str != nil:
			s, ok := args[i].(string)
			if !ok {
				return nil, fmt.Errorf("index: argument %d of type %T, want string", i, args[i])
			}
			n += len(s) + 1
		case f.u64 != nil:
			if _, ok := args[i].(uint64); !ok {
				return nil, fmt.Errorf("index: argument %d of type %T, want uint64", i, args[i])
			}
			n += 8
		default:
			switch args[i].(type) {
			case *timestamppb.Timestamp, time.Time:
			default:
				return nil, fmt.Errorf("index: argument %d of type %T, want *timestamppb.Timestamp or time.Time", i, args[i])
			}
			n += 12
		}
	}
	b := make([]byte, 0, n)
	for i, f := range x.fields {
		switch {
		case f.str != nil:
			b = append(append(b, args[i].(string)...), 0)
		case f.u64 != nil:
			b = binary.BigEndian.AppendUint64(b, args[i].(uint64))
		default:
			switch v := args[i].(type) {
			case *timestamppb.Timestamp:
				b = appendTimeKey(b, v.GetSeconds(), v.GetNanos())
			case time.Time:
				b = appendTimeKey(b, v.Unix(), int32(v.Nanosecond()))
			}
		}
	}
	return b, nil
}

// appendTimeKey appends the 12-byte key of a timestamp, which sorts
// chronologically: seconds with the sign bit flipped, then nanos, big
// endian.
func appendTimeKey(b []byte, seconds int64, nanos int32) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(seconds)^(1<<63))
	return binary.BigEndian.AppendUint32(b, uint32(nanos))
}

// protoCodec encodes records of a table that stores one proto message type.
func protoCodec[T proto.Message]() recordCodec {
	return recordCodec{
		encode: func(b []byte, obj any) ([]byte, error) {
			m, ok := obj.(T)
			if !ok {
				return nil, fmt.Errorf("encode record: object of type %T", obj)
			}
			return recordOpts(m, false).MarshalAppend(b, m)
		},
		decode: func(b []byte) (any, error) {
			var zero T
			m := zero.ProtoReflect().New().Interface()
			if err := proto.Unmarshal(b, m); err != nil {
				return nil, err
			}
			return m, nil
		},
	}
}

// encodeIndexEntry writes an index table row as uvarint(len(table)), table,
// uvarint(index). There is no proto message for it; see DESIGN.md.
func encodeIndexEntry(b []byte, obj any) ([]byte, error) {
	e, ok := obj.(*indexEntry)
	if !ok {
		return nil, fmt.Errorf("encode index entry: object of type %T", obj)
	}
	b = binary.AppendUvarint(b, uint64(len(e.Table)))
	b = append(b, e.Table...)
	return binary.AppendUvarint(b, e.Value), nil
}

func decodeIndexEntry(b []byte) (any, error) {
	n, k := binary.Uvarint(b)
	if k <= 0 || n > uint64(len(b)-k) {
		return nil, fmt.Errorf("index entry: bad table name length")
	}
	b = b[k:]
	name := string(b[:n])
	b = b[n:]
	v, k := binary.Uvarint(b)
	if k <= 0 || k != len(b) {
		return nil, fmt.Errorf("index entry %q: bad index value", name)
	}
	return &indexEntry{Table: name, Value: v}, nil
}

// ttlDeadline is when a passing instance with a TTL runs out of it: its
// last heartbeat plus its TTL. Other instances have none.
func ttlDeadline(inst *clusterv1.ServiceInstance) (time.Time, bool) {
	ttl := inst.GetTtl().AsDuration()
	if inst.GetHealth() != clusterv1.Health_HEALTH_PASSING || inst.GetTtl() == nil || ttl <= 0 {
		return time.Time{}, false
	}
	return inst.GetLastHeartbeat().AsTime().Add(ttl), true
}

// criticalDeadline is when a critical instance with a positive
// deregister_critical_after has been critical for that long. Other
// instances have none.
func criticalDeadline(inst *clusterv1.ServiceInstance) (time.Time, bool) {
	after := inst.GetDeregisterCriticalAfter().AsDuration()
	if inst.GetHealth() != clusterv1.Health_HEALTH_CRITICAL || after <= 0 {
		return time.Time{}, false
	}
	since := HealthSince(inst)
	if since == nil {
		return time.Time{}, false
	}
	return since.AsTime().Add(after), true
}
