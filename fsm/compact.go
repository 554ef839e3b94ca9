package fsm

import (
	"fmt"
	"strings"
	"sync"

	"github.com/google/btree"
	"github.com/hashicorp/go-memdb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// Compact tables.
//
// memdb keeps every index of a table in an immutable radix tree whose
// leaves and nodes each carry a watch channel: an index entry costs
// 300–400 bytes before the record, so a table of small records with two
// indexes (the placement catalog: kind, ID and node) pays ~850 bytes per
// record for its indexes. A compact table keeps its records in copy-on-write
// B-trees instead (google/btree: a clone is O(1), a write copies the nodes
// on its path), ~40 bytes per record for both indexes, with one watch
// channel for the whole table.
//
// The trees live in one memdb row per table (tableCompact), so that they
// are part of memdb's transactions: a read transaction sees the trees of
// its snapshot, a write transaction clones them on its first write,
// inserts the clone as the table's row and changes it in place until it
// commits (or aborts, dropping the clone). Committed trees are never
// changed again. Records are kept and iterated in primary-key order, the
// order memdb's ID index has (key strings hold no NUL: validate refuses
// them, and insert checks), so snapshots and state hashes are the same
// bytes as before.
//
// Every read and write of a table goes through tget, tfirst, tinsert,
// tdelete and tdeleteAll, which send the compact tables here and the
// others to memdb.

// tableCompact is the internal table holding the trees of each compact
// table, one compactRow per table. It is not part of snapshots.
const tableCompact = "compact"

// compactTable describes a compact table: its primary key, string fields
// only, and at most one secondary index, a string field followed by the
// primary key.
type compactTable struct {
	name string
	// fields is the number of fields of the primary key.
	fields int
	// key returns the primary key of a record, false for a record of
	// another type.
	key func(obj any) (compactKey, bool)
	// second names the secondary index ("": none) and secondKey returns
	// its field ("": the record is not in it, as memdb leaves a record
	// with a missing field out of an index).
	second    string
	secondKey func(obj any) string
}

// compactKey holds the fields of a primary key.
type compactKey [2]string

// compactProbe is the key a lookup searches by: its leading fields set.
type compactProbe struct {
	key    compactKey
	second string
}

// compactTables are the compact tables by name: the two big ones.
var compactTables = map[string]*compactTable{
	TablePlacements: {
		name:   TablePlacements,
		fields: 2,
		key: func(obj any) (compactKey, bool) {
			p, ok := obj.(*fsmv1.Placement)
			if !ok {
				return compactKey{}, false
			}
			return compactKey{p.Kind, p.Id}, true
		},
		second: indexNode,
		secondKey: func(obj any) string {
			if p, ok := obj.(*fsmv1.Placement); ok {
				return p.Node
			}
			return ""
		},
	},
	TableServices: {
		name:   TableServices,
		fields: 2,
		key: func(obj any) (compactKey, bool) {
			inst, ok := obj.(*clusterv1.ServiceInstance)
			if !ok {
				return compactKey{}, false
			}
			return compactKey{inst.Service, inst.InstanceId}, true
		},
	},
}

// isCompact reports whether table is kept in a compact table.
func isCompact(table string) bool { return compactTables[table] != nil }

// keyOf returns the primary key of a record or probe.
func (c *compactTable) keyOf(obj any) compactKey {
	if p, ok := obj.(*compactProbe); ok {
		return p.key
	}
	k, _ := c.key(obj)
	return k
}

func (c *compactTable) secondOf(obj any) string {
	if p, ok := obj.(*compactProbe); ok {
		return p.second
	}
	return c.secondKey(obj)
}

func (c *compactTable) less(a, b any) bool {
	ka, kb := c.keyOf(a), c.keyOf(b)
	for i := range c.fields {
		if ka[i] != kb[i] {
			return ka[i] < kb[i]
		}
	}
	return false
}

func (c *compactTable) lessSecond(a, b any) bool {
	if sa, sb := c.secondOf(a), c.secondOf(b); sa != sb {
		return sa < sb
	}
	return c.less(a, b)
}

// compactRow holds a compact table's trees as of one transaction: the
// records by primary key, and by the secondary index's field then the
// primary key for the records that have it.
type compactRow struct {
	Table string
	def   *compactTable
	// owner is the write transaction that made this row and may change
	// its trees; nil (or any other transaction) means read-only.
	owner *memdb.Txn
	// mu serializes clones: google/btree's Clone resets the original's
	// copy-on-write context, and writers of two databases sharing these
	// trees (a database and its memdb snapshot) may clone at once. Reads
	// never touch that context.
	mu             *sync.Mutex
	byID, bySecond *btree.BTreeG[any]
}

// compactDegree is the B-trees' degree: nodes of 15–31 records; a write
// copies one node per level.
const compactDegree = 16

func newCompactRow(def *compactTable) *compactRow {
	r := &compactRow{Table: def.name, def: def, mu: new(sync.Mutex), byID: btree.NewG(compactDegree, def.less)}
	if def.second != "" {
		r.bySecond = btree.NewG(compactDegree, def.lessSecond)
	}
	return r
}

// emptyCompact holds the row of each compact table that has none yet.
// They are only read: a writer starts from a new row.
var emptyCompact = func() map[string]*compactRow {
	m := make(map[string]*compactRow, len(compactTables))
	for name, def := range compactTables {
		m[name] = newCompactRow(def)
	}
	return m
}()

// clone returns a copy of r's trees that shares their nodes.
func (r *compactRow) clone() *compactRow {
	if r == emptyCompact[r.Table] {
		return newCompactRow(r.def)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	c := &compactRow{Table: r.Table, def: r.def, mu: new(sync.Mutex), byID: r.byID.Clone()}
	if r.bySecond != nil {
		c.bySecond = r.bySecond.Clone()
	}
	return c
}

// compactRead returns the row of a compact table as txn sees it, and the
// channel that fires when it changes.
func compactRead(txn *memdb.Txn, table string) (*compactRow, <-chan struct{}, error) {
	ch, obj, err := txn.FirstWatch(tableCompact, indexID, table)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", table, err)
	}
	if obj == nil {
		return emptyCompact[table], ch, nil
	}
	return obj.(*compactRow), ch, nil
}

// compactWrite returns the row of a compact table that txn, a write
// transaction, may change: the one it made, or a clone of the one it sees,
// made its row.
func compactWrite(txn *memdb.Txn, table string) (*compactRow, error) {
	r, _, err := compactRead(txn, table)
	if err != nil {
		return nil, err
	}
	if r.owner == txn {
		return r, nil
	}
	w := r.clone()
	w.owner = txn
	if err := txn.Insert(tableCompact, w); err != nil {
		return nil, fmt.Errorf("write %s: %w", table, err)
	}
	return w, nil
}

// probe returns the probe of a lookup by index with the leading key
// fields args, and how many were given.
func (c *compactTable) probe(index string, args []any) (*compactProbe, int, error) {
	limit, second := c.fields, false
	switch {
	case index == indexID || index == indexIDPrefix:
	case index == c.second && c.second != "":
		limit, second = 1, true
	default:
		return nil, 0, fmt.Errorf("read %s: no index %q", c.name, index)
	}
	if len(args) > limit {
		return nil, 0, fmt.Errorf("read %s: index %s: %d arguments, at most %d", c.name, index, len(args), limit)
	}
	p := &compactProbe{}
	for i, a := range args {
		s, ok := a.(string)
		if !ok {
			return nil, 0, fmt.Errorf("read %s: index %s: argument %d of type %T, want string", c.name, index, i, a)
		}
		if second {
			p.second = s
		} else {
			p.key[i] = s
		}
	}
	return p, len(args), nil
}

// scan returns the tree an index lookup walks, the record or probe it
// starts at (nil: the first) and the test of the records that belong to
// it: the walk stops at the first that does not. A lookup is by primary
// key or its leading fields (every record, those of the leading fields,
// one record), or by the secondary index.
func (r *compactRow) scan(index string, args []any) (*btree.BTreeG[any], any, func(any) bool, error) {
	c := r.def
	p, n, err := c.probe(index, args)
	if err != nil {
		return nil, nil, nil, err
	}
	all := func(any) bool { return true }
	switch {
	case index == c.second && n == 1:
		return r.bySecond, p, func(e any) bool { return c.secondOf(e) == p.second }, nil
	case index == c.second:
		return r.bySecond, nil, all, nil
	case n > 0:
		return r.byID, p, func(e any) bool {
			k := c.keyOf(e)
			for i := range n {
				if k[i] != p.key[i] {
					return false
				}
			}
			return true
		}, nil
	}
	return r.byID, nil, all, nil
}

// compactChunk is how many records an iterator takes from its tree at a
// time: a walk of a whole table holds this many, not the table.
const compactChunk = 256

// compactIterator walks the records of a lookup in a tree no one changes,
// a chunk at a time: each chunk resumes after the last record of the one
// before.
type compactIterator struct {
	tree *btree.BTreeG[any]
	less func(a, b any) bool
	from any // the first record or probe, then the last record taken
	in   func(any) bool
	ch   <-chan struct{}

	buf    []any
	next   int
	resume bool // from is a record already returned
	done   bool
}

func (it *compactIterator) WatchCh() <-chan struct{} { return it.ch }

func (it *compactIterator) Next() any {
	if it.next == len(it.buf) {
		if it.done {
			return nil
		}
		it.fill()
		if len(it.buf) == 0 {
			return nil
		}
	}
	it.next++
	return it.buf[it.next-1]
}

func (it *compactIterator) fill() {
	// The buffer grows as append grows it: a lookup of a few records
	// allocates for a few.
	it.buf, it.next = it.buf[:0], 0
	full := false
	visit := func(e any) bool {
		if it.resume && !it.less(it.from, e) {
			return true // the last record of the chunk before
		}
		if !it.in(e) {
			it.done = true
			return false
		}
		it.buf = append(it.buf, e)
		full = len(it.buf) == compactChunk
		return !full
	}
	if it.from == nil {
		it.tree.Ascend(visit)
	} else {
		it.tree.AscendGreaterOrEqual(it.from, visit)
	}
	if !full {
		it.done = true
	}
	if n := len(it.buf); n > 0 {
		it.from, it.resume = it.buf[n-1], true
	}
}

// iterator returns the iterator of a lookup. A row txn may change (its
// own) is walked in a clone of its tree, so that the walk sees the
// records as of the lookup, as memdb's iterators do.
func (r *compactRow) iterator(txn *memdb.Txn, index string, args []any, ch <-chan struct{}) (*compactIterator, error) {
	tree, from, in, err := r.scan(index, args)
	if err != nil {
		return nil, err
	}
	less := r.def.less
	if tree == r.bySecond {
		less = r.def.lessSecond
	}
	if r.owner == txn {
		r.mu.Lock()
		tree = tree.Clone()
		r.mu.Unlock()
	}
	return &compactIterator{tree: tree, less: less, from: from, in: in, ch: ch}, nil
}

// tget is txn.Get for every table.
func tget(txn *memdb.Txn, table, index string, args ...any) (memdb.ResultIterator, error) {
	if !isCompact(table) {
		return txn.Get(table, index, args...)
	}
	r, ch, err := compactRead(txn, table)
	if err != nil {
		return nil, err
	}
	return r.iterator(txn, index, args, ch)
}

// tfirst is txn.First for every table.
func tfirst(txn *memdb.Txn, table, index string, args ...any) (any, error) {
	if !isCompact(table) {
		return txn.First(table, index, args...)
	}
	r, _, err := compactRead(txn, table)
	if err != nil {
		return nil, err
	}
	if p, n, err := r.def.probe(index, args); err != nil {
		return nil, err
	} else if index != r.def.second && n == r.def.fields {
		if e, ok := r.byID.Get(p); ok {
			return e, nil
		}
		return nil, nil
	}
	it, err := r.iterator(txn, index, args, nil)
	if err != nil {
		return nil, err
	}
	return it.Next(), nil
}

// tlen returns the number of records of table.
func tlen(txn *memdb.Txn, table string) (int, error) {
	if !isCompact(table) {
		it, err := txn.Get(table, indexID)
		if err != nil {
			return 0, err
		}
		n := 0
		for obj := it.Next(); obj != nil; obj = it.Next() {
			n++
		}
		return n, nil
	}
	r, _, err := compactRead(txn, table)
	if err != nil {
		return 0, err
	}
	return r.byID.Len(), nil
}

// tinsert is txn.Insert for every table.
func tinsert(txn *memdb.Txn, table string, obj any) error {
	if !isCompact(table) {
		return txn.Insert(table, obj)
	}
	c := compactTables[table]
	k, ok := c.key(obj)
	if !ok {
		return fmt.Errorf("object of type %T", obj)
	}
	for i := range c.fields {
		switch {
		case k[i] == "":
			return fmt.Errorf("missing unique index: key field %d is empty", i+1)
		case strings.IndexByte(k[i], 0) >= 0:
			return fmt.Errorf("key field %d holds a NUL byte", i+1)
		}
	}
	second := ""
	if c.second != "" {
		if second = c.secondKey(obj); strings.IndexByte(second, 0) >= 0 {
			return fmt.Errorf("the %s field holds a NUL byte", c.second)
		}
	}
	w, err := compactWrite(txn, table)
	if err != nil {
		return err
	}
	old, had := w.byID.ReplaceOrInsert(obj)
	if w.bySecond != nil {
		if had && c.secondKey(old) != "" {
			w.bySecond.Delete(old)
		}
		if second != "" {
			w.bySecond.ReplaceOrInsert(obj)
		}
	}
	return nil
}

// tdelete is txn.Delete for every table: memdb.ErrNotFound when no record
// has obj's key.
func tdelete(txn *memdb.Txn, table string, obj any) error {
	if !isCompact(table) {
		return txn.Delete(table, obj)
	}
	c := compactTables[table]
	if _, ok := c.key(obj); !ok {
		return fmt.Errorf("object of type %T", obj)
	}
	r, _, err := compactRead(txn, table)
	if err != nil {
		return err
	}
	if _, had := r.byID.Get(obj); !had {
		return memdb.ErrNotFound
	}
	w, err := compactWrite(txn, table)
	if err != nil {
		return err
	}
	if old, had := w.byID.Delete(obj); had && w.bySecond != nil && c.secondKey(old) != "" {
		w.bySecond.Delete(old)
	}
	return nil
}

// tdeleteAll is txn.DeleteAll for every table; a compact table supports
// deleting every record only.
func tdeleteAll(txn *memdb.Txn, table, index string, args ...any) (int, error) {
	if !isCompact(table) {
		return txn.DeleteAll(table, index, args...)
	}
	if index != indexID || len(args) != 0 {
		return 0, fmt.Errorf("delete from %s: only all records at once", table)
	}
	r, _, err := compactRead(txn, table)
	if err != nil {
		return 0, err
	}
	n := r.byID.Len()
	if n == 0 {
		return 0, nil
	}
	w := newCompactRow(r.def)
	w.owner = txn
	if err := txn.Insert(tableCompact, w); err != nil {
		return 0, fmt.Errorf("delete from %s: %w", table, err)
	}
	return n, nil
}
