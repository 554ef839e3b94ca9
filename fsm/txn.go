package fsm

import (
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

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
	case TableClusterVersion:
		return 9
	case TableIndex:
		return 10
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
	// counts holds the changes of this transaction to the instance counts
	// (tableServiceCounts), written once per transaction by updateIndexes.
	counts map[serviceHealth]int

	// track makes get remember its lookups in reads (Evaluate), and
	// noPrune marks the external mode (Evaluate): a write's outcome goes
	// into a dedupe record of its own, which the external store expires
	// itself, instead of its client's session.
	track, noPrune bool
	reads          []Read

	// version is the cluster version the entry being applied runs at: the
	// state's as the batch began (startVersion), moved by a
	// set_cluster_version entry of the batch.
	version, startVersion Version
	// halt is set by an entry this release cannot apply: nothing of it was
	// written, and nothing after it may be applied.
	halt *HaltError
	// checkpoint is set by a checkpoint entry: the state as of it is
	// captured before the next entry.
	checkpoint bool
}

func newWriteTxn() *writeTxn {
	n := len(tableDefs)
	t := &writeTxn{
		changed:   make([]uint64, n),
		overlay:   make([]map[string]any, n),
		noOverlay: make([]bool, n),
		counts:    make(map[serviceHealth]int),
	}
	for i := range t.overlay {
		t.overlay[i] = make(map[string]any)
	}
	return t
}

// begin starts a write transaction on db, whose cluster version is v.
func (t *writeTxn) begin(db *memdb.MemDB, v Version) {
	t.version, t.startVersion = v, v
	t.halt, t.checkpoint = nil, false
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
	clear(t.counts)
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

// legacy reports whether the entry being applied runs at version 0.0 in
// Raft mode: as the agents that predate cluster versions apply it.
func (t *writeTxn) legacy() bool { return !t.noPrune && t.version == Version0_0 }

// abort discards the transaction.
func (t *writeTxn) abort() {
	t.txn.Abort()
	t.txn, t.base = nil, nil
}

// reset discards everything written and starts again from the same state.
func (t *writeTxn) reset() {
	db, index := t.db, t.index
	track, noPrune, reads := t.track, t.noPrune, t.reads
	v := t.startVersion
	t.abort()
	t.begin(db, v)
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
	if n == servicesNum {
		if err := t.serviceReplaced(t.currentService(obj), obj); err != nil {
			return err
		}
	}
	if err := tinsert(t.txn, table, obj); err != nil {
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
	if n == servicesNum {
		if err := t.serviceReplaced(t.currentService(obj), nil); err != nil {
			return err
		}
	}
	if err := tdelete(t.txn, table, obj); err != nil {
		return fmt.Errorf("delete from %s: %w", table, err)
	}
	t.changed[n] = t.index
	t.remember(n, obj, nil)
	return t.serviceChanged(obj)
}

// servicesNum is the tableNum of TableServices.
const servicesNum = 0

// serviceHealth is a key of tableServiceCounts.
type serviceHealth struct {
	service string
	health  clusterv1.Health
}

// currentService returns the instance with obj's primary key as this
// transaction sees it, nil when there is none. Unlike get, it is not a
// read of the command (Evaluate does not track it).
func (t *writeTxn) currentService(obj any) *clusterv1.ServiceInstance {
	inst, ok := obj.(*clusterv1.ServiceInstance)
	if !ok {
		return nil
	}
	var v any
	if ok, key, err := idIndexers[servicesNum].FromObject(inst); err == nil && ok && !t.noOverlay[servicesNum] {
		if w, found := t.overlay[servicesNum][string(key)]; found {
			v = w
		} else {
			v, _ = tfirst(t.base, TableServices, indexID, inst.GetService(), inst.GetInstanceId())
		}
	} else {
		v, _ = tfirst(t.txn, TableServices, indexID, inst.GetService(), inst.GetInstanceId())
	}
	cur, _ := v.(*clusterv1.ServiceInstance)
	return cur
}

// serviceReplaced keeps the derived state of the services table as old
// (nil: none) becomes new (nil: deleted): the instance counts, in t.counts
// until updateIndexes, and the rows of tableServiceChecks and
// tableServiceDeadlines.
func (t *writeTxn) serviceReplaced(o *clusterv1.ServiceInstance, new any) error {
	w, _ := new.(*clusterv1.ServiceInstance)
	if o == nil || w == nil || o.GetHealth() != w.GetHealth() {
		// A heartbeat or a re-registration moves no count.
		if o != nil {
			t.counts[serviceHealth{o.GetService(), o.GetHealth()}]--
		}
		if w != nil {
			t.counts[serviceHealth{w.GetService(), w.GetHealth()}]++
		}
	}
	if oc, wc := o.GetCheck(), w.GetCheck(); oc != nil || wc != nil {
		if oc == nil || wc == nil || o.GetNode() != w.GetNode() || !proto.Equal(oc, wc) {
			if old := checkEntry(o); old != nil {
				if _, err := tdeleteAll(t.txn, tableServiceChecks, indexID, old.Node, old.Service, old.Instance); err != nil {
					return fmt.Errorf("update the check of %s/%s: %w", o.GetService(), o.GetInstanceId(), err)
				}
			}
			if row := checkEntry(w); row != nil {
				if err := tinsert(t.txn, tableServiceChecks, row); err != nil {
					return fmt.Errorf("update the check of %s/%s: %w", w.GetService(), w.GetInstanceId(), err)
				}
			}
		}
	}
	for _, d := range deadlines {
		var (
			was, is        time.Time
			hadOne, hasOne bool
		)
		if o != nil {
			was, hadOne = d.of(o)
		}
		if w != nil {
			is, hasOne = d.of(w)
		}
		if hadOne == hasOne && was.Equal(is) {
			continue
		}
		if hadOne {
			if _, err := tdeleteAll(t.txn, tableServiceDeadlines, indexID, d.kind, was, o.GetService(), o.GetInstanceId()); err != nil {
				return fmt.Errorf("update the %s deadline of %s/%s: %w", d.kind, o.GetService(), o.GetInstanceId(), err)
			}
		}
		if hasOne {
			if err := tinsert(t.txn, tableServiceDeadlines, &deadlineEntry{Kind: d.kind, At: timestamppb.New(is), Service: w.GetService(), Instance: w.GetInstanceId()}); err != nil {
				return fmt.Errorf("update the %s deadline of %s/%s: %w", d.kind, w.GetService(), w.GetInstanceId(), err)
			}
		}
	}
	return nil
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

// putServiceCount writes a row of tableServiceCounts, deleting it when
// its count is zero.
func putServiceCount(txn *memdb.Txn, c *ServiceCount) error {
	var err error
	if c.Instances > 0 {
		err = tinsert(txn, tableServiceCounts, c)
	} else {
		_, err = tdeleteAll(txn, tableServiceCounts, indexID, c.Service, uint64(c.Health))
	}
	if err != nil {
		return fmt.Errorf("update the instance count of service %q: %w", c.Service, err)
	}
	return nil
}

// deriveServices builds tableServiceCounts, tableServiceChecks and
// tableServiceDeadlines from the services table of txn, whose derived rows
// are empty (a restored or replaced state), and gives every service it
// holds its row of tableServiceIndex at index.
func deriveServices(txn *memdb.Txn, index uint64) error {
	it, err := tget(txn, TableServices, indexID)
	if err != nil {
		return fmt.Errorf("read %s: %w", TableServices, err)
	}
	counts := map[serviceHealth]int{}
	last := ""
	for obj := it.Next(); obj != nil; obj = it.Next() {
		inst, ok := obj.(*clusterv1.ServiceInstance)
		if !ok {
			continue
		}
		if svc := inst.GetService(); svc != last {
			// Every service held gets its row of the service index (as
			// the base row says, index): a watch of one service then
			// holds its own row's channel, which no other service's
			// write closes, not the channel of the radix node a missing
			// key is watched by.
			if err := setServiceIndex(txn, svc, index); err != nil {
				return err
			}
			last = svc
		}
		counts[serviceHealth{inst.GetService(), inst.GetHealth()}]++
		if row := checkEntry(inst); row != nil {
			if err := tinsert(txn, tableServiceChecks, row); err != nil {
				return fmt.Errorf("add the check of %s/%s: %w", inst.GetService(), inst.GetInstanceId(), err)
			}
		}
		for _, d := range deadlines {
			if at, ok := d.of(inst); ok {
				if err := tinsert(txn, tableServiceDeadlines, &deadlineEntry{Kind: d.kind, At: timestamppb.New(at), Service: inst.GetService(), Instance: inst.GetInstanceId()}); err != nil {
					return fmt.Errorf("add the %s deadline of %s/%s: %w", d.kind, inst.GetService(), inst.GetInstanceId(), err)
				}
			}
		}
	}
	for k, n := range counts {
		if err := putServiceCount(txn, &ServiceCount{Service: k.service, Health: k.health, Instances: n}); err != nil {
			return err
		}
	}
	return nil
}

// setServiceIndex writes a row of tableServiceIndex.
func setServiceIndex(txn *memdb.Txn, service string, index uint64) error {
	if err := tinsert(txn, tableServiceIndex, &serviceIndexEntry{Service: service, Value: index}); err != nil {
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
		return tfirst(t.txn, table, indexID, args...)
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
	return tfirst(t.base, table, indexID, args...)
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
	it, err := tget(t.txn, table, index, args...)
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
// of the last entry that changed it, and the instance counts that moved.
func (t *writeTxn) updateIndexes() error {
	for k, d := range t.counts {
		if d == 0 {
			continue
		}
		// Count rows are written here only, once per key: the state the
		// transaction started from holds the count before it.
		n := d
		if obj, err := tfirst(t.base, tableServiceCounts, indexID, k.service, uint64(k.health)); err == nil && obj != nil {
			n += obj.(*ServiceCount).Instances
		}
		if err := putServiceCount(t.txn, &ServiceCount{Service: k.service, Health: k.health, Instances: n}); err != nil {
			return err
		}
	}
	for n, index := range t.changed {
		if index == 0 {
			continue
		}
		name := tableDefs[n].name
		if err := tinsert(t.txn, TableIndex, &indexEntry{Table: name, Value: index}); err != nil {
			return fmt.Errorf("update index of %s: %w", name, err)
		}
	}
	return nil
}
