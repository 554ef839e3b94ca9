package fsm

import (
	"fmt"
	"strings"
	"sync"

	"github.com/google/btree"
	"github.com/hashicorp/go-memdb"

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

// isCompact reports whether table is kept in a compact table.
func isCompact(table string) bool { return table == TablePlacements }

// compactRow holds a compact table's trees as of one transaction: the
// placement catalog by (kind, ID), and by (node, kind, ID) for the
// records that have a node.
type compactRow struct {
	Table string
	// owner is the write transaction that made this row and may change
	// its trees; nil (or any other transaction) means read-only.
	owner *memdb.Txn
	// mu serializes clones: google/btree's Clone resets the original's
	// copy-on-write context, and writers of two databases sharing these
	// trees (a database and its memdb snapshot) may clone at once. Reads
	// never touch that context.
	mu           *sync.Mutex
	byID, byNode *btree.BTreeG[*fsmv1.Placement]
}

// compactDegree is the B-trees' degree: nodes of 15–31 records; a write
// copies one node per level.
const compactDegree = 16

func placementLessID(a, b *fsmv1.Placement) bool {
	if a.Kind != b.Kind {
		return a.Kind < b.Kind
	}
	return a.Id < b.Id
}

func placementLessNode(a, b *fsmv1.Placement) bool {
	if a.Node != b.Node {
		return a.Node < b.Node
	}
	return placementLessID(a, b)
}

func newCompactRow(table string) *compactRow {
	return &compactRow{
		Table:  table,
		mu:     new(sync.Mutex),
		byID:   btree.NewG(compactDegree, placementLessID),
		byNode: btree.NewG(compactDegree, placementLessNode),
	}
}

// emptyCompact is the row of a compact table that has none yet. It is only
// read: a writer starts from a new row.
var emptyCompact = newCompactRow(TablePlacements)

// clone returns a copy of r's trees that shares their nodes.
func (r *compactRow) clone() *compactRow {
	if r == emptyCompact {
		return newCompactRow(r.Table)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return &compactRow{Table: r.Table, mu: new(sync.Mutex), byID: r.byID.Clone(), byNode: r.byNode.Clone()}
}

// compactRead returns the row of a compact table as txn sees it, and the
// channel that fires when it changes.
func compactRead(txn *memdb.Txn, table string) (*compactRow, <-chan struct{}, error) {
	ch, obj, err := txn.FirstWatch(tableCompact, indexID, table)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", table, err)
	}
	if obj == nil {
		return emptyCompact, ch, nil
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

// placementArg returns the record to look up by the key fields args (kind,
// then ID, then nothing) and how many were given.
func placementArgs(index string, args []any) (*fsmv1.Placement, int, error) {
	var fields []*string
	p := &fsmv1.Placement{}
	switch index {
	case indexID, indexIDPrefix:
		fields = []*string{&p.Kind, &p.Id}
	case indexNode:
		fields = []*string{&p.Node}
	default:
		return nil, 0, fmt.Errorf("read %s: no index %q", TablePlacements, index)
	}
	if len(args) > len(fields) {
		return nil, 0, fmt.Errorf("read %s: index %s: %d arguments, at most %d", TablePlacements, index, len(args), len(fields))
	}
	for i, a := range args {
		s, ok := a.(string)
		if !ok {
			return nil, 0, fmt.Errorf("read %s: index %s: argument %d of type %T, want string", TablePlacements, index, i, a)
		}
		*fields[i] = s
	}
	return p, len(args), nil
}

// query returns the records of an index lookup: by ID (every record, one
// kind's, or one record), by ID prefix (the same) or by node.
func (r *compactRow) query(index string, args []any) ([]any, error) {
	p, n, err := placementArgs(index, args)
	if err != nil {
		return nil, err
	}
	var out []any
	switch {
	case index == indexNode && n == 1:
		r.byNode.AscendGreaterOrEqual(&fsmv1.Placement{Node: p.Node}, func(e *fsmv1.Placement) bool {
			if e.Node != p.Node {
				return false
			}
			out = append(out, e)
			return true
		})
	case index == indexNode:
		r.byNode.Ascend(func(e *fsmv1.Placement) bool {
			out = append(out, e)
			return true
		})
	case n == 2:
		if e, ok := r.byID.Get(p); ok {
			out = append(out, e)
		}
	case n == 1:
		r.byID.AscendGreaterOrEqual(&fsmv1.Placement{Kind: p.Kind}, func(e *fsmv1.Placement) bool {
			if e.Kind != p.Kind {
				return false
			}
			out = append(out, e)
			return true
		})
	default:
		out = make([]any, 0, r.byID.Len())
		r.byID.Ascend(func(e *fsmv1.Placement) bool {
			out = append(out, e)
			return true
		})
	}
	return out, nil
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
	recs, err := r.query(index, args)
	if err != nil {
		return nil, err
	}
	return &sliceIterator{recs: recs, ch: ch}, nil
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
	if p, n, err := placementArgs(index, args); err != nil {
		return nil, err
	} else if index != indexNode && n == 2 {
		if e, ok := r.byID.Get(p); ok {
			return e, nil
		}
		return nil, nil
	}
	recs, err := r.query(index, args)
	if err != nil || len(recs) == 0 {
		return nil, err
	}
	return recs[0], nil
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
	p, ok := obj.(*fsmv1.Placement)
	switch {
	case !ok:
		return fmt.Errorf("object of type %T", obj)
	case p.Kind == "" || p.Id == "":
		return fmt.Errorf("missing unique index: the record has no kind or ID")
	case strings.IndexByte(p.Kind, 0) >= 0 || strings.IndexByte(p.Id, 0) >= 0 || strings.IndexByte(p.Node, 0) >= 0:
		return fmt.Errorf("a key field holds a NUL byte")
	}
	w, err := compactWrite(txn, table)
	if err != nil {
		return err
	}
	if old, had := w.byID.ReplaceOrInsert(p); had && old.Node != "" {
		w.byNode.Delete(old)
	}
	if p.Node != "" {
		w.byNode.ReplaceOrInsert(p)
	}
	return nil
}

// tdelete is txn.Delete for every table: memdb.ErrNotFound when no record
// has obj's key.
func tdelete(txn *memdb.Txn, table string, obj any) error {
	if !isCompact(table) {
		return txn.Delete(table, obj)
	}
	p, ok := obj.(*fsmv1.Placement)
	if !ok {
		return fmt.Errorf("object of type %T", obj)
	}
	r, _, err := compactRead(txn, table)
	if err != nil {
		return err
	}
	if _, had := r.byID.Get(p); !had {
		return memdb.ErrNotFound
	}
	w, err := compactWrite(txn, table)
	if err != nil {
		return err
	}
	if old, had := w.byID.Delete(p); had && old.Node != "" {
		w.byNode.Delete(old)
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
	w := newCompactRow(table)
	w.owner = txn
	if err := txn.Insert(tableCompact, w); err != nil {
		return 0, fmt.Errorf("delete from %s: %w", table, err)
	}
	return n, nil
}
