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
	// TableDedupe holds *fsmv1.DedupeRecord, keyed by (client_id, sequence).
	TableDedupe = "dedupe"
	// TableIndex records, per table, the last Raft index that changed it.
	TableIndex = "index"
)

// Index names used inside the package.
const (
	indexID       = "id"
	indexService  = "service"
	indexNode     = "node"
	indexKey      = "key"
	indexVM       = "vm_id"
	indexSchedule = "schedule"
	indexTime     = "time"
)

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

// tableDefs is the registry of tables, in snapshot order. Adding a table here
// adds it to the schema, to Tables() and to snapshots.
var tableDefs = []tableDef{
	{
		name: TableServices,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: &memdb.CompoundIndex{Indexes: []memdb.Indexer{
				stringIndex[*clusterv1.ServiceInstance]((*clusterv1.ServiceInstance).GetService),
				stringIndex[*clusterv1.ServiceInstance]((*clusterv1.ServiceInstance).GetInstanceId),
			}}},
			&memdb.IndexSchema{Name: indexService, Indexer: stringIndex[*clusterv1.ServiceInstance]((*clusterv1.ServiceInstance).GetService)},
			&memdb.IndexSchema{Name: indexNode, AllowMissing: true, Indexer: stringIndex[*clusterv1.ServiceInstance]((*clusterv1.ServiceInstance).GetNode)},
		),
		codec: protoCodec[*clusterv1.ServiceInstance](),
	},
	{
		name: TableConfig,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: stringIndex[*clusterv1.ConfigEntry]((*clusterv1.ConfigEntry).GetKey)},
		),
		codec: protoCodec[*clusterv1.ConfigEntry](),
	},
	{
		name: TableConfigHistory,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: &memdb.CompoundIndex{Indexes: []memdb.Indexer{
				stringIndex[*clusterv1.ConfigEntry]((*clusterv1.ConfigEntry).GetKey),
				uintIndex[*clusterv1.ConfigEntry]((*clusterv1.ConfigEntry).GetRevision),
			}}},
			&memdb.IndexSchema{Name: indexKey, Indexer: stringIndex[*clusterv1.ConfigEntry]((*clusterv1.ConfigEntry).GetKey)},
		),
		codec: protoCodec[*clusterv1.ConfigEntry](),
	},
	{
		name: TableSchedules,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: stringIndex[*schedulev1.Schedule]((*schedulev1.Schedule).GetId)},
			&memdb.IndexSchema{Name: indexVM, Indexer: stringIndex[*schedulev1.Schedule]((*schedulev1.Schedule).GetVmId)},
		),
		codec: protoCodec[*schedulev1.Schedule](),
	},
	{
		name: TableScheduleRuns,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: &memdb.CompoundIndex{Indexes: []memdb.Indexer{
				stringIndex[*schedulev1.Run]((*schedulev1.Run).GetScheduleId),
				timeIndex[*schedulev1.Run]((*schedulev1.Run).GetSlot),
			}}},
			&memdb.IndexSchema{Name: indexSchedule, Indexer: stringIndex[*schedulev1.Run]((*schedulev1.Run).GetScheduleId)},
		),
		codec: protoCodec[*schedulev1.Run](),
	},
	{
		name: TableDedupe,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: &memdb.CompoundIndex{Indexes: []memdb.Indexer{
				stringIndex[*fsmv1.DedupeRecord]((*fsmv1.DedupeRecord).GetClientId),
				uintIndex[*fsmv1.DedupeRecord]((*fsmv1.DedupeRecord).GetSequence),
			}}},
			&memdb.IndexSchema{Name: indexTime, Indexer: timeIndex[*fsmv1.DedupeRecord]((*fsmv1.DedupeRecord).GetTime)},
		),
		codec: protoCodec[*fsmv1.DedupeRecord](),
	},
	{
		name: TableIndex,
		indexes: indexes(
			&memdb.IndexSchema{Name: indexID, Unique: true, Indexer: stringIndex[*indexEntry](func(e *indexEntry) string { return e.Table })},
		),
		codec: recordCodec{encode: encodeIndexEntry, decode: decodeIndexEntry},
	},
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

// schema is the memdb schema built from tableDefs.
var schema = func() *memdb.DBSchema {
	s := &memdb.DBSchema{Tables: make(map[string]*memdb.TableSchema, len(tableDefs))}
	for _, t := range tableDefs {
		s.Tables[t.name] = &memdb.TableSchema{Name: t.name, Indexes: t.indexes}
	}
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

// stringIndexer indexes a string field of T. Values are NUL terminated, so an
// exact lookup of "web" never matches "webapp" and compound keys sort by
// their first field, then the next. An empty string is a missing value.
type stringIndexer[T any] struct{ get func(T) string }

func stringIndex[T any](get func(T) string) *stringIndexer[T] {
	return &stringIndexer[T]{get: get}
}

func (x *stringIndexer[T]) FromObject(obj any) (bool, []byte, error) {
	o, ok := obj.(T)
	if !ok {
		return false, nil, fmt.Errorf("string index: object of type %T", obj)
	}
	s := x.get(o)
	if s == "" {
		return false, nil, nil
	}
	return true, append([]byte(s), 0), nil
}

func (x *stringIndexer[T]) FromArgs(args ...any) ([]byte, error) {
	b, err := x.PrefixFromArgs(args...)
	if err != nil {
		return nil, err
	}
	return append(b, 0), nil
}

func (x *stringIndexer[T]) PrefixFromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("string index: %d arguments, want 1", len(args))
	}
	s, ok := args[0].(string)
	if !ok {
		return nil, fmt.Errorf("string index: argument of type %T, want string", args[0])
	}
	return []byte(s), nil
}

// uintIndexer indexes a uint64 field of T, big endian so that keys sort
// numerically.
type uintIndexer[T any] struct{ get func(T) uint64 }

func uintIndex[T any](get func(T) uint64) *uintIndexer[T] {
	return &uintIndexer[T]{get: get}
}

func (x *uintIndexer[T]) FromObject(obj any) (bool, []byte, error) {
	o, ok := obj.(T)
	if !ok {
		return false, nil, fmt.Errorf("uint index: object of type %T", obj)
	}
	return true, binary.BigEndian.AppendUint64(nil, x.get(o)), nil
}

func (x *uintIndexer[T]) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("uint index: %d arguments, want 1", len(args))
	}
	v, ok := args[0].(uint64)
	if !ok {
		return nil, fmt.Errorf("uint index: argument of type %T, want uint64", args[0])
	}
	return binary.BigEndian.AppendUint64(nil, v), nil
}

// timeIndexer indexes a timestamp field of T with a 12-byte key that sorts
// chronologically: seconds with the sign bit flipped, then nanos, big endian.
// A nil timestamp is a missing value.
type timeIndexer[T any] struct {
	get func(T) *timestamppb.Timestamp
}

func timeIndex[T any](get func(T) *timestamppb.Timestamp) *timeIndexer[T] {
	return &timeIndexer[T]{get: get}
}

func timeKey(seconds int64, nanos int32) []byte {
	b := binary.BigEndian.AppendUint64(make([]byte, 0, 12), uint64(seconds)^(1<<63))
	return binary.BigEndian.AppendUint32(b, uint32(nanos))
}

func (x *timeIndexer[T]) FromObject(obj any) (bool, []byte, error) {
	o, ok := obj.(T)
	if !ok {
		return false, nil, fmt.Errorf("time index: object of type %T", obj)
	}
	ts := x.get(o)
	if ts == nil {
		return false, nil, nil
	}
	return true, timeKey(ts.GetSeconds(), ts.GetNanos()), nil
}

func (x *timeIndexer[T]) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("time index: %d arguments, want 1", len(args))
	}
	switch v := args[0].(type) {
	case *timestamppb.Timestamp:
		return timeKey(v.GetSeconds(), v.GetNanos()), nil
	case time.Time:
		return timeKey(v.Unix(), int32(v.Nanosecond())), nil
	default:
		return nil, fmt.Errorf("time index: argument of type %T, want *timestamppb.Timestamp or time.Time", args[0])
	}
}

// protoCodec encodes records of a table that stores one proto message type.
func protoCodec[T proto.Message]() recordCodec {
	return recordCodec{
		encode: func(b []byte, obj any) ([]byte, error) {
			m, ok := obj.(T)
			if !ok {
				return nil, fmt.Errorf("encode record: object of type %T", obj)
			}
			return marshalOpts.MarshalAppend(b, m)
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
