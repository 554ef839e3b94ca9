package fsm

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// Snapshot stream format (see DESIGN.md):
//
//	"PVSN"                       4 bytes, magic
//	format version               uint32, big endian
//	uvarint length, SnapshotHeader
//	for each table of the header, in order, header.records times:
//	    uvarint length, record
//
// and nothing after the last record.
const (
	snapshotMagic = "PVSN"
	// SnapshotFormatVersion is the newest snapshot format this version
	// writes, and the newest it restores. Format 2 added the ca table,
	// format 3 the placements table, format 4 the sessions table, format 5
	// the cluster_version table; older snapshots restore with them empty.
	// A state is written in the oldest format that holds it, which is one
	// its cluster version's release reads (formatFor).
	SnapshotFormatVersion uint32 = 5

	// maxHeaderSize and maxRecordSize bound what a restore allocates for one
	// length prefix, so garbage cannot ask for gigabytes.
	maxHeaderSize = 1 << 20
	maxRecordSize = 64 << 20
)

var _ raft.FSMSnapshot = (*fsmSnapshot)(nil)

// fsmSnapshot is a point-in-time capture of the state: a memdb read
// transaction. Capturing is O(1); Persist does the I/O while Apply goes on.
type fsmSnapshot struct {
	txn       *memdb.Txn
	lastIndex uint64
}

// Snapshot captures the current state for raft. It does no I/O.
// A halted FSM takes none: Raft would record the snapshot at its own
// applied index, past the entries this state never applied, and compact
// them out of the log.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.halt != nil {
		return nil, f.halt
	}
	return &fsmSnapshot{txn: f.db.Txn(false), lastIndex: f.applied}, nil
}

// Persist streams the captured state to sink, closing it on success and
// cancelling it on failure.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := writeSnapshot(sink, s.txn, s.lastIndex); err != nil {
		// The write error is what matters; Cancel only discards the sink.
		_ = sink.Cancel()
		return err
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("close snapshot sink: %w", err)
	}
	return nil
}

// Release does nothing: a memdb read transaction holds no resources.
func (s *fsmSnapshot) Release() {}

// WriteSnapshot writes the current state to w in the snapshot format, as
// Persist would. It is meant for tools and tests; raft uses Snapshot.
func (f *FSM) WriteSnapshot(w io.Writer) error {
	f.mu.RLock()
	txn, index := f.db.Txn(false), f.applied
	f.mu.RUnlock()
	return writeSnapshot(w, txn, index)
}

// writeSnapshot streams the state of txn to w through a buffer.
func writeSnapshot(w io.Writer, txn *memdb.Txn, lastIndex uint64) error {
	s, err := planSnapshot(txn, lastIndex, false)
	if err != nil {
		return err
	}
	_, err = s.WriteTo(w)
	return err
}

// StateSnapshot is a point-in-time capture of the state (a memdb read
// transaction) with the size of its snapshot stream, for writers that
// must know the size before the stream (an archive's headers).
type StateSnapshot struct {
	txn    *memdb.Txn
	hdr    *fsmv1.SnapshotHeader
	tables []tableDef
	// records holds the records of each of tables when sized, as the
	// sizing pass found them: WriteTo walks this list instead of the
	// radix trees again (16 bytes per record, where a walk of the tree
	// loads a node, its edges and its leaf for each).
	records [][]any
	// sessionSizes holds the record size of each session, when sized:
	// sizing a session walks all its outcomes, and WriteTo needs the size
	// again for its length prefix.
	sessionSizes map[*session]int
	size         int64
}

// CaptureSnapshot captures the current state, as Snapshot does, without
// the records of the tables named in drop (they restore empty, as with
// FilterSnapshot), and sizes its snapshot stream: one pass over the
// records that computes their encoded sizes and keeps nothing. WriteTo
// then encodes the records straight from the capture, so a snapshot that
// leaves the node needs no Raft snapshot, no copy on disk and no decoding.
func (f *FSM) CaptureSnapshot(drop ...string) (*StateSnapshot, error) {
	f.applyMu.Lock()
	f.mu.RLock()
	txn, index := f.db.Txn(false), f.applied
	f.mu.RUnlock()
	f.applyMu.Unlock()
	return planSnapshot(txn, index, true, drop...)
}

// Index is the applied index the captured state is as of.
func (s *StateSnapshot) Index() uint64 { return s.hdr.GetLastIndex() }

// FormatVersion is the snapshot format of the stream.
func (s *StateSnapshot) FormatVersion() uint32 { return s.hdr.GetFormatVersion() }

// Size is the length of the stream WriteTo writes.
func (s *StateSnapshot) Size() int64 { return s.size }

// planSnapshot counts the records of txn, picks the oldest format that
// holds them and builds the header; with sized it also computes the
// stream's length. Tables named in drop are left out of the header (the
// format is still the one the whole state needs, as FilterSnapshot keeps
// its input's).
func planSnapshot(txn *memdb.Txn, lastIndex uint64, sized bool, drop ...string) (*StateSnapshot, error) {
	counts := make(map[string]uint64, len(tableDefs))
	sizes := make(map[string]int64, len(tableDefs))
	kept := make(map[string][]any, len(tableDefs))
	var sessionSizes map[*session]int
	var nonEmpty []string
	for _, t := range tableDefs {
		it, err := tget(txn, t.name, indexID)
		if err != nil {
			return nil, fmt.Errorf("snapshot: count %s: %w", t.name, err)
		}
		size := sized && !slices.Contains(drop, t.name)
		var n uint64
		var bytes int64
		var recs []any
		for obj := it.Next(); obj != nil; obj = it.Next() {
			n++
			if size {
				rn, err := recordSize(obj)
				if err != nil {
					return nil, fmt.Errorf("snapshot: size %s record: %w", t.name, err)
				}
				if sess, ok := obj.(*session); ok {
					if sessionSizes == nil {
						sessionSizes = make(map[*session]int)
					}
					sessionSizes[sess] = rn
				}
				bytes += int64(uvarintLen(uint64(rn)) + rn)
				recs = append(recs, obj)
			}
		}
		counts[t.name], sizes[t.name], kept[t.name] = n, bytes, recs
		if n > 0 {
			nonEmpty = append(nonEmpty, t.name)
		}
	}
	// A table named by an index row is in use too, even when empty (a
	// Restored command touches every table): an older reader would
	// refuse the row.
	it, err := tget(txn, TableIndex, indexID)
	if err != nil {
		return nil, fmt.Errorf("snapshot: read %s: %w", TableIndex, err)
	}
	for obj := it.Next(); obj != nil; obj = it.Next() {
		nonEmpty = append(nonEmpty, obj.(*indexEntry).Table)
	}
	// The oldest format that holds the state: tables newer than it are
	// empty and left out.
	version := formatFor(nonEmpty)
	s := &StateSnapshot{txn: txn, hdr: &fsmv1.SnapshotHeader{FormatVersion: version, LastIndex: lastIndex}, sessionSizes: sessionSizes}
	if version >= 5 {
		if rec, err := first[*fsmv1.ClusterVersion](txn, TableClusterVersion, indexID, clusterVersionKey); err == nil && rec != nil {
			s.hdr.ClusterVersion = &fsmv1.ClusterVersion{Major: rec.GetMajor(), Minor: rec.GetMinor()}
		}
	}
	for _, t := range tableDefs {
		if tableSince[t.name] <= version && !slices.Contains(drop, t.name) {
			s.tables = append(s.tables, t)
			s.hdr.Tables = append(s.hdr.Tables, &fsmv1.TableHeader{Name: t.name, Records: counts[t.name]})
			s.size += sizes[t.name]
			if sized {
				s.records = append(s.records, kept[t.name])
			}
		}
	}
	if sized {
		hn := marshalOpts.Size(s.hdr)
		s.size += int64(8 + uvarintLen(uint64(hn)) + hn)
	}
	return s, nil
}

// anyOrderOpts marshals without sorting map keys: for comparisons only,
// never for what is written.
var anyOrderOpts = proto.MarshalOptions{}

// recordSize is the length of the encoding of obj by its table's codec.
func recordSize(obj any) (int, error) {
	switch v := obj.(type) {
	case *indexEntry:
		return uvarintLen(uint64(len(v.Table))) + len(v.Table) + uvarintLen(v.Value), nil
	case proto.Message:
		return marshalOpts.Size(v), nil
	case *session:
		return new(sessionEncoder).size(v), nil
	}
	return 0, fmt.Errorf("record of type %T", obj)
}

func uvarintLen(x uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], x)
}

// WriteTo writes the snapshot stream of the captured state to w through a
// buffer, one record at a time. A capture can be written more than once.
func (s *StateSnapshot) WriteTo(w io.Writer) (int64, error) {
	cw := &countingWriter{w: w}
	bw := bufio.NewWriterSize(cw, 64<<10)
	buf, err := writeHeader(bw, s.hdr)
	if err != nil {
		return cw.n, err
	}
	var senc sessionEncoder
	for i, t := range s.tables {
		var it memdb.ResultIterator
		if s.records != nil {
			it = &sliceIterator{recs: s.records[i]}
		} else if it, err = tget(s.txn, t.name, indexID); err != nil {
			return cw.n, fmt.Errorf("snapshot: read %s: %w", t.name, err)
		}
		var n uint64
		for obj := it.Next(); obj != nil; obj = it.Next() {
			if sess, ok := obj.(*session); ok {
				// Written a piece at a time: a session can be tens of
				// megabytes.
				size, ok := s.sessionSizes[sess]
				if !ok {
					size = senc.size(sess)
				}
				if err := senc.writeRecord(bw, sess, size); err != nil {
					return cw.n, fmt.Errorf("snapshot: write %s: %w", t.name, err)
				}
				n++
				continue
			}
			if m, ok := obj.(proto.Message); ok && s.size > 0 {
				// Sized: the size pass left every message's size in its
				// cache (records are never changed in place).
				buf, err = recordOpts(m, true).MarshalAppend(buf[:0], m)
			} else {
				buf, err = t.codec.encode(buf[:0], obj)
			}
			if err != nil {
				return cw.n, fmt.Errorf("snapshot: encode %s record: %w", t.name, err)
			}
			if err := writeRecord(bw, buf); err != nil {
				return cw.n, fmt.Errorf("snapshot: write %s: %w", t.name, err)
			}
			n++
		}
		if n != s.hdr.Tables[i].Records {
			// Impossible with a read transaction; checked so that a bug
			// cannot write a snapshot that does not restore.
			return cw.n, fmt.Errorf("snapshot: %s changed while writing: %d records, header says %d", t.name, n, s.hdr.Tables[i].Records)
		}
	}
	if err := bw.Flush(); err != nil {
		return cw.n, fmt.Errorf("snapshot: flush: %w", err)
	}
	if s.size > 0 && cw.n != s.size {
		// Equally impossible: recordSize disagrees with a codec.
		return cw.n, fmt.Errorf("snapshot: wrote %d bytes, sized %d", cw.n, s.size)
	}
	return cw.n, nil
}

// sliceIterator iterates over records kept in a list.
type sliceIterator struct {
	recs []any
	next int
}

func (it *sliceIterator) WatchCh() <-chan struct{} { return nil }

func (it *sliceIterator) Next() any {
	if it.next == len(it.recs) {
		return nil
	}
	it.next++
	return it.recs[it.next-1]
}

// writeHeader writes the preamble and the header; it returns the header's
// encoding buffer for reuse.
func writeHeader(bw *bufio.Writer, hdr *fsmv1.SnapshotHeader) ([]byte, error) {
	var pre [8]byte
	copy(pre[:4], snapshotMagic)
	binary.BigEndian.PutUint32(pre[4:], hdr.GetFormatVersion())
	if _, err := bw.Write(pre[:]); err != nil {
		return nil, fmt.Errorf("snapshot: write preamble: %w", err)
	}
	buf, err := marshalOpts.Marshal(hdr)
	if err != nil {
		return nil, fmt.Errorf("snapshot: encode header: %w", err)
	}
	if err := writeRecord(bw, buf); err != nil {
		return nil, fmt.Errorf("snapshot: write header: %w", err)
	}
	return buf, nil
}

// FilterSnapshot copies the snapshot stream r to w without the records of
// the tables named in drop (they restore empty), in constant memory, and
// reports the format version (the input's) and the bytes written. Every
// record is checked to decode. Snapshots that leave the cluster (archives)
// go through it without TableCA, which holds the cluster CA's key.
func FilterSnapshot(r io.Reader, w io.Writer, drop ...string) (uint32, int64, error) {
	sr := newSnapshotReader(r)
	in, err := sr.header()
	if err != nil {
		return 0, 0, err
	}
	version := in.GetFormatVersion()
	out := &fsmv1.SnapshotHeader{FormatVersion: version, LastIndex: in.GetLastIndex(), ClusterVersion: in.GetClusterVersion()}
	for _, t := range in.GetTables() {
		if !slices.Contains(drop, t.GetName()) {
			out.Tables = append(out.Tables, &fsmv1.TableHeader{Name: t.GetName(), Records: t.GetRecords()})
		}
	}
	cw := &countingWriter{w: w}
	bw := bufio.NewWriterSize(cw, 64<<10)
	if _, err := writeHeader(bw, out); err != nil {
		return 0, 0, err
	}
	for _, th := range in.GetTables() {
		t, _ := tableDefByName(th.GetName())
		keep := slices.ContainsFunc(out.Tables, func(o *fsmv1.TableHeader) bool { return o.GetName() == t.name })
		for i := uint64(0); i < th.GetRecords(); i++ {
			b, err := sr.record(maxRecordSize)
			if err != nil {
				return 0, 0, fmt.Errorf("%s record %d: %w", t.name, i, err)
			}
			if _, err := t.codec.decode(b); err != nil {
				return 0, 0, fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, t.name, i, err)
			}
			if keep {
				if err := writeRecord(bw, b); err != nil {
					return 0, 0, fmt.Errorf("snapshot: write %s: %w", t.name, err)
				}
			}
		}
	}
	if _, err := sr.br.ReadByte(); !errors.Is(err, io.EOF) {
		return 0, 0, corruptf("data after the last record")
	}
	if err := bw.Flush(); err != nil {
		return 0, 0, fmt.Errorf("snapshot: flush: %w", err)
	}
	return version, cw.n, nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// writeRecord writes b with a uvarint length prefix.
func writeRecord(w *bufio.Writer, b []byte) error {
	var lb [binary.MaxVarintLen64]byte
	n := binary.PutUvarint(lb[:], uint64(len(b)))
	if _, err := w.Write(lb[:n]); err != nil {
		return err
	}
	_, err := w.Write(b)
	return err
}

// Restore replaces the state with the snapshot read from rc, and closes rc.
// The snapshot is merged, record by record, into the current database in
// one write transaction, reading the state as it was from a read
// transaction: a record whose encoding equals the current one stays as it
// is, others are decoded and inserted, and records the snapshot does not
// hold are deleted. So a restore allocates in proportion to what it
// changes, and at most one copy of the state (memdb copies only the paths
// it changes; readers keep the old tree). On any error
// (ErrCorruptSnapshot for truncated or malformed input,
// ErrUnsupportedSnapshot for a newer format) the transaction is aborted
// and the current state is left as it was. On success the commit is
// atomic for readers, the applied index becomes the snapshot's last index
// (or stays, if it was higher) and the old state's abandon channel is
// closed so that watchers re-list. (The transaction is on the database
// itself, not on a memdb snapshot of it: writes to a snapshot never fire
// watches, now or later.)
func (f *FSM) Restore(rc io.ReadCloser) error {
	if rc == nil {
		return fmt.Errorf("%w: nil snapshot reader", ErrCorruptSnapshot)
	}
	defer rc.Close()
	f.applyMu.Lock()
	defer f.applyMu.Unlock()

	db := f.database()
	txn, hdr, _, err := readSnapshot(rc, db)
	if err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	// The applied index never goes back: a snapshot restored by an
	// operator carries the index of the cluster it came from, and reads
	// waiting for an index this node already passed must not wait for
	// entries that will never come. (The leader follows such a restore
	// with a Restored command, which moves it on everywhere.)
	if err := f.replaceDB(txn, db, hdr.GetLastIndex()); err != nil {
		return fmt.Errorf("restore: %w", err)
	}

	var records []any
	for _, t := range hdr.GetTables() {
		records = append(records, slog.Uint64(t.GetName(), t.GetRecords()))
	}
	f.logger.Info("state restored from snapshot", "index", hdr.GetLastIndex(), slog.Group("records", records...))
	return nil
}

// Fork returns a new FSM, configured by cfg, whose state starts as this
// one's: a memdb snapshot (O(1)) that shares every record, so that what
// is then restored or replaced into the fork costs memory only for what
// it changes. The fork is independent: nothing it applies reaches f. It
// is scratch space (a restore's plan): memdb never fires the watches of a
// snapshot's state.
func (f *FSM) Fork(cfg Config) (*FSM, error) {
	g, err := New(cfg)
	if err != nil {
		return nil, err
	}
	f.applyMu.Lock()
	f.mu.RLock()
	db, applied := f.db.Snapshot(), f.applied
	f.mu.RUnlock()
	f.applyMu.Unlock()
	if err := g.replaceDB(db.Txn(true), db, applied); err != nil {
		return nil, fmt.Errorf("fork: %w", err)
	}
	return g, nil
}

// ReadSnapshotHeader reads the preamble and header of a snapshot stream
// without reading the records, e.g. to show per-table counts.
func ReadSnapshotHeader(r io.Reader) (*fsmv1.SnapshotHeader, error) {
	sr := newSnapshotReader(r)
	return sr.header()
}

// VerifySnapshot reads a whole snapshot stream into a throwaway state and
// reports whether Restore would accept it.
func VerifySnapshot(r io.Reader) (*fsmv1.SnapshotHeader, error) {
	txn, hdr, _, err := readSnapshot(r, newMemDB())
	if txn != nil {
		txn.Abort()
	}
	return hdr, err
}

// SnapshotInfo describes a verified snapshot stream.
type SnapshotInfo struct {
	FormatVersion uint32
	LastIndex     uint64
	// Tables lists every table the snapshot holds, in stream order.
	Tables []TableInfo
}

// TableInfo is one table of a snapshot: its record count and the bytes of
// its records (without length prefixes).
type TableInfo struct {
	Name    string
	Records uint64
	Bytes   uint64
}

// InspectSnapshot verifies a whole snapshot stream, as VerifySnapshot does,
// and reports what it holds per table.
func InspectSnapshot(r io.Reader) (*SnapshotInfo, error) {
	return inspect(r, true)
}

// ScanSnapshot reads a whole snapshot stream one record at a time and
// reports what it holds per table. It checks the framing, the header and
// that every record decodes, in constant memory; unlike InspectSnapshot it
// does not build the state, so it cannot tell whether Restore would accept
// it (duplicate keys).
func ScanSnapshot(r io.Reader) (*SnapshotInfo, error) {
	return inspect(r, false)
}

func inspect(r io.Reader, build bool) (*SnapshotInfo, error) {
	var db *memdb.MemDB
	if build {
		db = newMemDB()
	}
	txn, hdr, sizes, err := readSnapshot(r, db)
	if txn != nil {
		txn.Abort()
	}
	if err != nil {
		return nil, err
	}
	info := &SnapshotInfo{FormatVersion: hdr.GetFormatVersion(), LastIndex: hdr.GetLastIndex()}
	for i, t := range hdr.GetTables() {
		info.Tables = append(info.Tables, TableInfo{Name: t.GetName(), Records: t.GetRecords(), Bytes: sizes[i]})
	}
	return info, nil
}

// snapshotReader reads the length-prefixed records of a snapshot stream.
type snapshotReader struct {
	br  *bufio.Reader
	buf []byte
}

func newSnapshotReader(r io.Reader) *snapshotReader {
	return &snapshotReader{br: bufio.NewReaderSize(r, 64<<10)}
}

func corruptf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorruptSnapshot, fmt.Sprintf(format, args...))
}

// noEOF turns an end of stream inside a structure into ErrUnexpectedEOF.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// record returns the next record; the slice is valid until the next call.
func (sr *snapshotReader) record(limit uint64) ([]byte, error) {
	n, err := sr.length(limit)
	if err != nil {
		return nil, err
	}
	return sr.body(n)
}

// length reads the length prefix of the next record.
func (sr *snapshotReader) length(limit uint64) (uint64, error) {
	n, err := binary.ReadUvarint(sr.br)
	if err != nil {
		return 0, fmt.Errorf("%w: read record length: %w", ErrCorruptSnapshot, noEOF(err))
	}
	if n > limit {
		return 0, corruptf("record of %d bytes, at most %d allowed", n, limit)
	}
	return n, nil
}

// recordChunk is how much of a record body is read before the buffer grows
// further: a length prefix alone cannot make a reader allocate more than
// the data that follows it, and more than this.
const recordChunk = 1 << 20

// body reads a record body of n bytes into the reused buffer.
func (sr *snapshotReader) body(n uint64) ([]byte, error) {
	buf := sr.buf[:0]
	for uint64(len(buf)) < n {
		from := len(buf)
		next := min(n, uint64(from)+max(recordChunk, uint64(from)))
		if uint64(cap(buf)) < next {
			buf = append(buf[:cap(buf)], make([]byte, int(next)-cap(buf))...)
		}
		buf = buf[:next]
		if _, err := io.ReadFull(sr.br, buf[from:]); err != nil {
			sr.buf = buf[:0]
			return nil, fmt.Errorf("%w: read record: %w", ErrCorruptSnapshot, noEOF(err))
		}
	}
	sr.buf = buf[:0]
	return buf, nil
}

// header reads and checks the preamble and the header.
func (sr *snapshotReader) header() (*fsmv1.SnapshotHeader, error) {
	var pre [8]byte
	if _, err := io.ReadFull(sr.br, pre[:]); err != nil {
		return nil, fmt.Errorf("%w: read preamble: %w", ErrCorruptSnapshot, noEOF(err))
	}
	if string(pre[:4]) != snapshotMagic {
		return nil, corruptf("not an FSM snapshot (magic %q, want %q)", pre[:4], snapshotMagic)
	}
	version := binary.BigEndian.Uint32(pre[4:])
	if version > SnapshotFormatVersion {
		return nil, fmt.Errorf("%w: format version %d, this version reads up to %d", ErrUnsupportedSnapshot, version, SnapshotFormatVersion)
	}
	if version == 0 {
		return nil, corruptf("format version 0")
	}
	b, err := sr.record(maxHeaderSize)
	if err != nil {
		return nil, err
	}
	hdr := new(fsmv1.SnapshotHeader)
	if err := proto.Unmarshal(b, hdr); err != nil {
		return nil, fmt.Errorf("%w: decode header: %w", ErrCorruptSnapshot, err)
	}
	if hdr.GetFormatVersion() != version {
		return nil, corruptf("header format version %d, preamble says %d", hdr.GetFormatVersion(), version)
	}
	if cv := hdr.GetClusterVersion(); cv != nil {
		if v := (Version{cv.GetMajor(), cv.GetMinor()}); !v.Known() {
			return nil, fmt.Errorf("%w: the state is at cluster version %s; this release runs up to %s", ErrUnsupportedSnapshot, v, Latest)
		}
	}
	seen := make(map[string]bool)
	for _, t := range hdr.GetTables() {
		if _, ok := tableDefByName(t.GetName()); !ok {
			return nil, fmt.Errorf("%w: unknown table %q", ErrUnsupportedSnapshot, t.GetName())
		}
		if seen[t.GetName()] {
			return nil, corruptf("table %q listed twice", t.GetName())
		}
		seen[t.GetName()] = true
	}
	return hdr, nil
}

// readSnapshot merges a whole snapshot stream into base and returns the
// write transaction that holds the result, uncommitted, with the header
// and the record bytes of each table of the header. Every table ends with
// exactly the snapshot's records (tables it does not list, and the
// derived service index, empty); a record whose encoding equals the one
// base holds under the same key is left as it is, without decoding, so
// the merge allocates only for what differs. Records must be in
// primary-key order, as every writer writes them (memdb's order), which
// also rules out repeated keys. With base nil it only decodes and checks
// every record, one at a time: memory stays flat, but records memdb
// cannot index go unnoticed. On error the transaction is aborted.
func readSnapshot(r io.Reader, base *memdb.MemDB) (txn *memdb.Txn, hdr *fsmv1.SnapshotHeader, sizes []uint64, err error) {
	sr := newSnapshotReader(r)
	if hdr, err = sr.header(); err != nil {
		return nil, nil, nil, err
	}
	sizes = make([]uint64, len(hdr.GetTables()))
	var old, wtxn *memdb.Txn
	if base != nil {
		old, wtxn = base.Txn(false), base.Txn(true)
		defer func() {
			if err != nil {
				wtxn.Abort()
			}
		}()
	}
	listed := make(map[string]bool, len(hdr.GetTables()))
	var (
		enc  []byte
		senc sessionEncoder
	)
	for ti, th := range hdr.GetTables() {
		t, _ := tableDefByName(th.GetName())
		listed[t.name] = true
		m := tableMerge{table: t, ix: idIndexers[tableNum(t.name)], txn: wtxn}
		if base != nil {
			if m.it, err = tget(old, t.name, indexID); err != nil {
				return nil, nil, nil, fmt.Errorf("read %s: %w", t.name, err)
			}
			if err = m.advance(); err != nil {
				return nil, nil, nil, err
			}
		}
		for i := uint64(0); i < th.GetRecords(); i++ {
			var b []byte
			cur, isSession := m.cur.(*session)
			if isSession {
				// A session is compared with the one held as it is
				// read, never held whole when it is the same.
				n, err := sr.length(maxRecordSize)
				if err != nil {
					return nil, nil, nil, fmt.Errorf("%s record %d: %w", t.name, i, err)
				}
				sizes[ti] += n
				same, rec, err := senc.readSame(sr.br, n, cur)
				if err != nil {
					return nil, nil, nil, fmt.Errorf("%s record %d: %w", t.name, i, err)
				}
				if same {
					m.prev, m.prevObj = m.curKey, m.cur
					if err := m.advance(); err != nil {
						return nil, nil, nil, err
					}
					continue
				}
				b = rec
			} else {
				if b, err = sr.record(maxRecordSize); err != nil {
					return nil, nil, nil, fmt.Errorf("%s record %d: %w", t.name, i, err)
				}
				sizes[ti] += uint64(len(b))
			}
			if m.cur != nil && !isSession {
				// The same record as the current one: it stays. (Its key
				// is above the previous record's: every key up to that
				// one was passed already.)
				if m.same(b, &enc) {
					m.prev, m.prevObj = m.curKey, m.cur
					if err := m.advance(); err != nil {
						return nil, nil, nil, err
					}
					continue
				}
			}
			obj, err := t.codec.decode(b)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, t.name, i, err)
			}
			if e, ok := obj.(*indexEntry); ok {
				if _, known := tableDefByName(e.Table); !known {
					return nil, nil, nil, fmt.Errorf("%w: %s record %d: unknown table %q", ErrCorruptSnapshot, t.name, i, e.Table)
				}
			}
			if err := m.put(obj, i); err != nil {
				return nil, nil, nil, err
			}
		}
		if err := m.rest(); err != nil {
			return nil, nil, nil, err
		}
	}
	if _, err := sr.br.ReadByte(); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%w: after last record: %w", ErrCorruptSnapshot, err)
		}
		return nil, nil, nil, corruptf("trailing data after the last record")
	}
	if base == nil {
		return nil, hdr, sizes, nil
	}
	// Tables the snapshot does not list restore empty; the service index
	// is derived, and replaceDB sets its base row.
	for _, t := range append(Tables(), tableServiceIndex) {
		if !listed[t] {
			if _, err := tdeleteAll(wtxn, t, indexID); err != nil {
				return nil, nil, nil, fmt.Errorf("clear %s: %w", t, err)
			}
		}
	}
	return wtxn, hdr, sizes, nil
}

// tableMerge merges the records of one table, in primary-key order, into
// a write transaction (txn nil: it only checks their keys and order). cur
// is the next record the table held before, from a read transaction. Keys
// are computed only when compared: a merge that keeps every record
// computes none.
type tableMerge struct {
	table   tableDef
	ix      primaryIndexer
	txn     *memdb.Txn
	it      memdb.ResultIterator
	cur     any
	curKey  []byte // cur's key, once computed
	prev    []byte // the key of the last record merged, once computed
	prevObj any    // the last record merged, when it was kept as held
}

func (m *tableMerge) key(obj any) ([]byte, bool, error) {
	ok, key, err := m.ix.FromObject(obj)
	return key, ok, err
}

// same reports whether b encodes cur. The encoding without sorted map
// keys is tried first: it is the same bytes whenever no map has two
// entries, and sorting map keys allocates for every record.
func (m *tableMerge) same(b []byte, enc *[]byte) bool {
	var err error
	if msg, ok := m.cur.(proto.Message); ok {
		if *enc, err = anyOrderOpts.MarshalAppend((*enc)[:0], msg); err == nil && bytes.Equal(*enc, b) {
			return true
		}
		if len(*enc) != len(b) {
			return false
		}
	}
	*enc, err = m.table.codec.encode((*enc)[:0], m.cur)
	return err == nil && bytes.Equal(*enc, b)
}

// curK returns cur's key.
func (m *tableMerge) curK() ([]byte, error) {
	if m.curKey == nil && m.cur != nil {
		key, ok, err := m.key(m.cur)
		if err != nil || !ok {
			return nil, fmt.Errorf("read %s: a record without its key (%v)", m.table.name, err)
		}
		m.curKey = key
	}
	return m.curKey, nil
}

// advance moves cur to the next record held before.
func (m *tableMerge) advance() error {
	m.cur, m.curKey = nil, nil
	if m.it == nil {
		return nil
	}
	if obj := m.it.Next(); obj != nil {
		m.cur = obj
	}
	return nil
}

// put merges the decoded record obj, the i-th of the table: the records
// held before with lower keys are deleted, one with the same key replaced.
func (m *tableMerge) put(obj any, i uint64) error {
	key, ok, err := m.key(obj)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, m.table.name, i, err)
	case !ok:
		return corruptf("%s record %d: the record has no key", m.table.name, i)
	}
	if m.prev == nil && m.prevObj != nil {
		if m.prev, _, err = m.key(m.prevObj); err != nil {
			return fmt.Errorf("read %s: %w", m.table.name, err)
		}
	}
	if i > 0 && bytes.Compare(key, m.prev) <= 0 {
		return corruptf("%s record %d: key %q repeats or is out of order (after %q); records are written once each, in key order", m.table.name, i, key, m.prev)
	}
	m.prev, m.prevObj = key, nil
	if m.txn == nil {
		return nil
	}
	for m.cur != nil {
		ck, err := m.curK()
		if err != nil {
			return err
		}
		c := bytes.Compare(ck, key)
		if c > 0 {
			break
		}
		if c < 0 {
			if err := tdelete(m.txn, m.table.name, m.cur); err != nil {
				return fmt.Errorf("delete from %s: %w", m.table.name, err)
			}
		}
		if err := m.advance(); err != nil {
			return err
		}
	}
	if err := tinsert(m.txn, m.table.name, obj); err != nil {
		return fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, m.table.name, i, err)
	}
	return nil
}

// rest deletes the records held before that the snapshot does not have.
func (m *tableMerge) rest() error {
	for m.cur != nil {
		if err := tdelete(m.txn, m.table.name, m.cur); err != nil {
			return fmt.Errorf("delete from %s: %w", m.table.name, err)
		}
		if err := m.advance(); err != nil {
			return err
		}
	}
	return nil
}

// replaceRecords is Replace, with applyMu held: the records are sorted by
// primary key per table (of two with the same key the later one wins, as
// inserting them in turn would) and merged into the state in one write
// transaction, as Restore merges, after which each table holds exactly
// them. A record that is the
// one the table holds, or equal to it, is left in place.
func (f *FSM) replaceRecords(index uint64, records []TableRecord, keep *kept) error {
	type keyed struct {
		key []byte
		rec any // as the state stores it (storedRecord)
	}
	byTable := make([][]any, len(tableDefs)) // as the state stores them (storedRecord)
	add := func(table string, n int, obj any) error {
		byTable[n] = append(byTable[n], obj)
		return nil
	}
	for _, r := range records {
		n := tableNum(r.Table)
		if n < 0 || r.Table == TableIndex {
			return fmt.Errorf("replace: unknown table %q", r.Table)
		}
		if keep != nil && slices.Contains(keep.tables, r.Table) {
			return fmt.Errorf("replace: a record of %s, a table kept as it is", r.Table)
		}
		if err := add(r.Table, n, storedRecord(r.Record)); err != nil {
			return err
		}
	}
	if keep != nil {
		for _, table := range keep.tables {
			n := tableNum(table)
			if n < 0 || table == TableIndex {
				return fmt.Errorf("replace: unknown table %q", table)
			}
			it, err := tget(keep.from.txn, table, indexID)
			if err != nil {
				return fmt.Errorf("replace: read %s: %w", table, err)
			}
			for obj := it.Next(); obj != nil; obj = it.Next() {
				if err := add(table, n, obj); err != nil {
					return err
				}
			}
		}
	}
	db := f.database()
	old, txn := db.Txn(false), db.Txn(true)
	fail := func(err error) error {
		txn.Abort()
		return fmt.Errorf("replace: %w", err)
	}
	for n, t := range tableDefs {
		if t.name == TableIndex {
			continue
		}
		// The very records the table holds, in its order (a restore's
		// plan of an unchanged table): nothing to do, no key to compute.
		held, herr := holdsExactly(old, t.name, byTable[n])
		if herr != nil {
			return fail(herr)
		}
		if held {
			continue
		}
		recs := make([]keyed, len(byTable[n]))
		for i, obj := range byTable[n] {
			ok, key, err := idIndexers[n].FromObject(obj)
			if err != nil || !ok {
				return fail(fmt.Errorf("insert into %s: a record without its key (%v)", t.name, err))
			}
			recs[i] = keyed{key, obj}
		}
		slices.SortStableFunc(recs, func(a, b keyed) int { return bytes.Compare(a.key, b.key) })
		m := tableMerge{table: t, ix: idIndexers[n], txn: txn}
		var err error
		if m.it, err = tget(old, t.name, indexID); err != nil {
			return fail(err)
		}
		if err := m.advance(); err != nil {
			return fail(err)
		}
		for i, r := range recs {
			if i+1 < len(recs) && bytes.Equal(recs[i+1].key, r.key) {
				continue // a later record with the same key wins
			}
			if m.cur != nil && m.cur == any(r.rec) {
				// The record held, so under this key: it stays.
				if err := m.advance(); err != nil {
					return fail(err)
				}
				continue
			}
			for m.cur != nil {
				ck, err := m.curK()
				if err != nil {
					return fail(err)
				}
				if bytes.Compare(ck, r.key) >= 0 {
					break
				}
				if err := tdelete(txn, t.name, m.cur); err != nil {
					return fail(err)
				}
				if err := m.advance(); err != nil {
					return fail(err)
				}
			}
			if ck, err := m.curK(); err != nil {
				return fail(err)
			} else if m.cur != nil && bytes.Equal(ck, r.key) {
				same := m.cur == any(r.rec)
				if !same {
					cur, ok := m.cur.(proto.Message)
					rec, isMsg := r.rec.(proto.Message)
					same = ok && isMsg && proto.Equal(cur, rec)
				}
				if err := m.advance(); err != nil {
					return fail(err)
				}
				if same {
					continue
				}
			}
			if err := tinsert(txn, t.name, r.rec); err != nil {
				return fail(fmt.Errorf("insert into %s: %w", t.name, err))
			}
		}
		if err := m.rest(); err != nil {
			return fail(err)
		}
	}
	if _, err := tdeleteAll(txn, TableIndex, indexID); err != nil {
		return fail(err)
	}
	// Index rows only for the tables the state's version has (or that got
	// records): a table of a newer version in use makes the snapshot a
	// format the agents of the state's version cannot read.
	v := Version0_0
	for _, r := range byTable[tableNum(TableClusterVersion)] {
		if rec, ok := r.(*fsmv1.ClusterVersion); ok {
			v = Version{rec.GetMajor(), rec.GetMinor()}
		}
	}
	for n, t := range tableDefs {
		if t.name == TableIndex || (!tableAt(t.name, v) && len(byTable[n]) == 0) {
			continue
		}
		if err := tinsert(txn, TableIndex, &indexEntry{Table: t.name, Value: index}); err != nil {
			return fail(err)
		}
	}
	if _, err := tdeleteAll(txn, tableServiceIndex, indexID); err != nil {
		return fail(err)
	}
	return f.replaceDB(txn, db, index)
}

// holdsExactly reports whether table holds exactly recs, the same
// objects in the same order, as txn reads it.
func holdsExactly(txn *memdb.Txn, table string, recs []any) (bool, error) {
	it, err := tget(txn, table, indexID)
	if err != nil {
		return false, err
	}
	i := 0
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if i == len(recs) || recs[i] != obj {
			return false, nil
		}
		i++
	}
	return i == len(recs), nil
}

// replaceDB commits txn, the whole new state db as of index (a new
// database, or the current one, merged into in place), with the base row
// of tableServiceIndex and the derived rows of the services table
// (rebuilt), and makes it the state: the applied index never
// goes back, and the old state's watchers are woken to re-list. On error
// txn is aborted and nothing changes.
//
// The state's cluster version must be one this release runs: a newer
// one is refused (ErrUnsupportedSnapshot) and nothing changes. A state
// this release reads ends a halt: the entries it could not apply are
// behind it.
func (f *FSM) replaceDB(txn *memdb.Txn, db *memdb.MemDB, index uint64) error {
	v := Version0_0
	if rec, err := first[*fsmv1.ClusterVersion](txn, TableClusterVersion, indexID, clusterVersionKey); err != nil {
		txn.Abort()
		return err
	} else if rec != nil {
		v = Version{rec.GetMajor(), rec.GetMinor()}
	}
	if !v.Known() {
		txn.Abort()
		return fmt.Errorf("%w: the state is at cluster version %s; this release runs up to %s", ErrUnsupportedSnapshot, v, Latest)
	}
	applied := max(f.AppliedIndex(), index)
	if err := setServiceIndex(txn, serviceIndexBase, applied); err != nil {
		txn.Abort()
		return err
	}
	// A restore merged in place leaves the derived rows of the state it
	// replaced: they are rebuilt from the services table.
	for _, t := range []string{tableServiceCounts, tableServiceDeadlines, tableServiceChecks} {
		if _, err := tdeleteAll(txn, t, indexID); err != nil {
			txn.Abort()
			return fmt.Errorf("clear %s: %w", t, err)
		}
	}
	if err := deriveServices(txn, applied); err != nil {
		txn.Abort()
		return err
	}
	f.mu.Lock()
	// Under mu: when txn is a write transaction of the current database
	// (a restore merged in place), readers see its records and the new
	// applied index together.
	txn.Commit()
	old := f.abandonCh
	f.invalidateQueues()
	if f.version != v {
		f.versionMoves++
	}
	f.version = v
	f.halt = nil
	f.db = db
	f.setAppliedLocked(applied)
	f.abandonCh = make(chan struct{})
	f.mu.Unlock()
	close(old)
	return nil
}

// CheckSnapshotHeader reads the preamble and header at the start of a
// snapshot stream and reports whether this release can restore it: nil,
// or an error wrapping ErrUnsupportedSnapshot (a newer format, an unknown
// table, a newer cluster version) or ErrCorruptSnapshot. It reads no
// record: the store asks it before it keeps a snapshot a leader sends.
func CheckSnapshotHeader(r io.Reader) error {
	_, err := newSnapshotReader(r).header()
	return err
}
