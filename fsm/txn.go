package fsm

import (
	"fmt"
	"slices"

	"github.com/hashicorp/go-memdb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// tableNum returns the position of a table in tableDefs, or -1.
// TestTableNum checks it against tableDefs.
func tableNum(name string) int {
	switch name {
	case TableServices:
		return 0
	case TableConfig:
		return 1
	case TableConfigHistory:
		return 2
	case TableSchedules:
		return 3
	case TableScheduleRuns:
		return 4
	case TableCA:
		return 5
	case TablePlacements:
		return 6
	case TableDedupe:
		return 7
	case TableSessions:
		return 8
	case TableIndex:
		return 9
	}
	return -1
}

// primaryIndexer is the indexer of a primary key: one value per record.
type primaryIndexer interface {
	memdb.Indexer
	memdb.SingleIndexer
}

// idIndexers holds the primary-key indexer of each table, by tableNum.
var idIndexers = func() []primaryIndexer {
	out := make([]primaryIndexer, len(tableDefs))
	for i, t := range tableDefs {
		out[i] = t.indexes[indexID].Indexer.(primaryIndexer)
	}
	return out
}()

// writeTxn is the memdb write transaction of one batch of log entries (one
// entry when applied on its own). It remembers, per table, the index of the
// last entry that changed it, so that the index table is written once per
// batch with the values one-by-one application would leave.
//
// Point lookups by primary key (get) do not read through the write
// transaction: memdb answers a read of an index modified in the transaction
// from a clone, and cloning drops the radix tree's cache of nodes already
// copied by the transaction, so every later write would copy its whole path
// again. Instead, get reads the records this transaction wrote (overlay)
// and otherwise the state the transaction started from (base). Every write
// goes through insert and delete, which keep the overlay complete. Range
// reads (runs of a schedule, history of a key, expired dedupe records) go
// through txn: they are rare, or once per prune.
//
// A writeTxn is reused from batch to batch (begin), so that its maps and
// slices are allocated once.
type writeTxn struct {
	db    *memdb.MemDB
	txn   *memdb.Txn
	base  *memdb.Txn
	index uint64 // log index of the entry being applied

	// writes counts the write calls made, failed ones included: an entry
	// that returns an error must not have moved it (see applyEntry).
	writes uint64
	// changed[n] is the index of the last entry that changed table n, 0 if
	// none did.
	changed []uint64
	// overlay[n] maps the primary key of each record of table n that this
	// transaction wrote to the record, or to nil when it deleted it.
	overlay []map[string]any
	// noOverlay[n] is set if a written record's key could not be computed:
	// get then reads table n through txn.
	noOverlay []bool

	// track makes get remember its lookups in reads (Evaluate), and
	// noPrune marks the external mode (Evaluate): a write's outcome goes
	// into a dedupe record of its own, which the external store expires
	// itself, instead of its client's session.
	track, noPrune bool
	reads          []Read
}

func newWriteTxn() *writeTxn {
	n := len(tableDefs)
	t := &writeTxn{
		changed:   make([]uint64, n),
		overlay:   make([]map[string]any, n),
		noOverlay: make([]bool, n),
	}
	for i := range t.overlay {
		t.overlay[i] = make(map[string]any)
	}
	return t
}

// begin starts a write transaction on db.
func (t *writeTxn) begin(db *memdb.MemDB) {
	t.db = db
	t.txn = db.Txn(true)
	// Taken under the writer lock: the state txn starts from.
	t.base = db.Txn(false)
	t.index = 0
	t.writes = 0
	t.track, t.noPrune = false, false
	t.reads = t.reads[:0]
	clear(t.changed)
	clear(t.noOverlay)
	for i, m := range t.overlay {
		if len(m) > maxKeptOverlay {
			// Clearing costs the map's capacity, which never shrinks:
			// after a large delete, start small again.
			t.overlay[i] = make(map[string]any)
			continue
		}
		clear(m)
	}
}

// maxKeptOverlay is the largest overlay map begin clears for reuse.
const maxKeptOverlay = 1024

// abort discards the transaction.
func (t *writeTxn) abort() {
	t.txn.Abort()
	t.txn, t.base = nil, nil
}

// reset discards everything written and starts again from the same state.
func (t *writeTxn) reset() {
	db, index := t.db, t.index
	track, noPrune, reads := t.track, t.noPrune, t.reads
	t.abort()
	t.begin(db)
	t.index = index
	// The reads made before the reset still decided the outcome.
	t.track, t.noPrune, t.reads = track, noPrune, reads
}

// hasChanges reports whether any table changed.
func (t *writeTxn) hasChanges() bool {
	for _, c := range t.changed {
		if c != 0 {
			return true
		}
	}
	return false
}

func (t *writeTxn) num(table string) (int, error) {
	n := tableNum(table)
	if n < 0 {
		return 0, fmt.Errorf("unknown table %q", table)
	}
	return n, nil
}

func (t *writeTxn) insert(table string, obj any) error {
	n, err := t.num(table)
	if err != nil {
		return err
	}
	t.writes++
	if err := t.txn.Insert(table, obj); err != nil {
		return fmt.Errorf("insert into %s: %w", table, err)
	}
	t.changed[n] = t.index
	t.remember(n, obj, obj)
	return t.serviceChanged(obj)
}

func (t *writeTxn) delete(table string, obj any) error {
	n, err := t.num(table)
	if err != nil {
		return err
	}
	t.writes++
	if err := t.txn.Delete(table, obj); err != nil {
		return fmt.Errorf("delete from %s: %w", table, err)
	}
	t.changed[n] = t.index
	t.remember(n, obj, nil)
	return t.serviceChanged(obj)
}

// serviceChanged records in tableServiceIndex that the service of obj, if
// obj is a service instance, changed at the entry being applied.
func (t *writeTxn) serviceChanged(obj any) error {
	inst, ok := obj.(*clusterv1.ServiceInstance)
	if !ok {
		return nil
	}
	return setServiceIndex(t.txn, inst.GetService(), t.index)
}

// setServiceIndex writes a row of tableServiceIndex.
func setServiceIndex(txn *memdb.Txn, service string, index uint64) error {
	if err := txn.Insert(tableServiceIndex, &serviceIndexEntry{Service: service, Value: index}); err != nil {
		return fmt.Errorf("update index of service %q: %w", service, err)
	}
	return nil
}

// touch marks a table changed without writing to it. Touching the services
// table moves the index of every service.
func (t *writeTxn) touch(table string) error {
	if n := tableNum(table); n >= 0 {
		t.changed[n] = t.index
	}
	if table == TableServices {
		t.writes++
		return setServiceIndex(t.txn, serviceIndexBase, t.index)
	}
	return nil
}

// remember records in the overlay that the record with obj's primary key
// is now val (nil: deleted).
func (t *writeTxn) remember(n int, obj, val any) {
	ok, key, err := idIndexers[n].FromObject(obj)
	if err != nil || !ok {
		// Impossible: memdb just indexed obj with the same indexer.
		t.noOverlay[n] = true
		return
	}
	t.overlay[n][string(key)] = val
}

// get returns the record of table whose primary key is args, or nil.
func (t *writeTxn) get(table string, args ...any) (any, error) {
	n, err := t.num(table)
	if err != nil {
		return nil, err
	}
	if t.track {
		t.reads = append(t.reads, Read{Table: table, Args: slices.Clone(args)})
	}
	if t.noOverlay[n] {
		return t.txn.First(table, indexID, args...)
	}
	if m := t.overlay[n]; len(m) > 0 {
		key, err := idIndexers[n].FromArgs(args...)
		if err != nil {
			return nil, err
		}
		if obj, ok := m[string(key)]; ok {
			return obj, nil
		}
	}
	return t.base.First(table, indexID, args...)
}

// lookup returns the record of table whose primary key is args, or the zero
// T.
func lookup[T any](t *writeTxn, table string, args ...any) (T, error) {
	obj, err := t.get(table, args...)
	return asRecord[T](table, obj, err)
}

// scan returns the records of an index range, read through the write
// transaction.
func scan[T any](t *writeTxn, table, index string, args ...any) ([]T, error) {
	it, err := t.txn.Get(table, index, args...)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", table, err)
	}
	out := make([]T, 0, 4)
	for obj := it.Next(); obj != nil; obj = it.Next() {
		v, ok := obj.(T)
		if !ok {
			return nil, fmt.Errorf("read %s: record of type %T", table, obj)
		}
		out = append(out, v)
	}
	return out, nil
}

// updateIndexes writes, for every table the transaction changed, the index
// of the last entry that changed it.
func (t *writeTxn) updateIndexes() error {
	for n, index := range t.changed {
		if index == 0 {
			continue
		}
		name := tableDefs[n].name
		if err := t.txn.Insert(TableIndex, &indexEntry{Table: name, Value: index}); err != nil {
			return fmt.Errorf("update index of %s: %w", name, err)
		}
	}
	return nil
}
