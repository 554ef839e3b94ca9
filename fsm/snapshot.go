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
	// SnapshotFormatVersion is the snapshot format this version writes, and
	// the newest it restores. Format 2 added the ca table, format 3 the
	// placements table, format 4 the sessions table; older snapshots
	// restore with them empty (and their dedupe records as sessions).
	SnapshotFormatVersion uint32 = 4

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
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.applyMu.Lock()
	defer f.applyMu.Unlock()
	f.mu.RLock()
	defer f.mu.RUnlock()
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
	counts := make(map[string]uint64, len(tableDefs))
	var nonEmpty []string
	for _, t := range tableDefs {
		it, err := txn.Get(t.name, indexID)
		if err != nil {
			return fmt.Errorf("snapshot: count %s: %w", t.name, err)
		}
		var n uint64
		for obj := it.Next(); obj != nil; obj = it.Next() {
			n++
		}
		counts[t.name] = n
		if n > 0 {
			nonEmpty = append(nonEmpty, t.name)
		}
	}
	// A table named by an index row is in use too, even when empty (a
	// Restored command touches every table): an older reader would
	// refuse the row.
	it, err := txn.Get(TableIndex, indexID)
	if err != nil {
		return fmt.Errorf("snapshot: read %s: %w", TableIndex, err)
	}
	for obj := it.Next(); obj != nil; obj = it.Next() {
		nonEmpty = append(nonEmpty, obj.(*indexEntry).Table)
	}
	// The oldest format that holds the state: tables newer than it are
	// empty and left out.
	version := formatFor(nonEmpty)
	hdr := &fsmv1.SnapshotHeader{FormatVersion: version, LastIndex: lastIndex}
	var tables []tableDef
	for _, t := range tableDefs {
		if tableSince[t.name] <= version {
			tables = append(tables, t)
			hdr.Tables = append(hdr.Tables, &fsmv1.TableHeader{Name: t.name, Records: counts[t.name]})
		}
	}

	bw := bufio.NewWriterSize(w, 64<<10)
	buf, err := writeHeader(bw, hdr)
	if err != nil {
		return err
	}
	for i, t := range tables {
		it, err := txn.Get(t.name, indexID)
		if err != nil {
			return fmt.Errorf("snapshot: read %s: %w", t.name, err)
		}
		var n uint64
		for obj := it.Next(); obj != nil; obj = it.Next() {
			if buf, err = t.codec.encode(buf[:0], obj); err != nil {
				return fmt.Errorf("snapshot: encode %s record: %w", t.name, err)
			}
			if err := writeRecord(bw, buf); err != nil {
				return fmt.Errorf("snapshot: write %s: %w", t.name, err)
			}
			n++
		}
		if n != hdr.Tables[i].Records {
			// Impossible with a read transaction; checked so that a bug
			// cannot write a snapshot that does not restore.
			return fmt.Errorf("snapshot: %s changed while writing: %d records, header says %d", t.name, n, hdr.Tables[i].Records)
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("snapshot: flush: %w", err)
	}
	return nil
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
	out := &fsmv1.SnapshotHeader{FormatVersion: version, LastIndex: in.GetLastIndex()}
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
// The snapshot is read completely into a new database first: on any error
// (ErrCorruptSnapshot for truncated or malformed input,
// ErrUnsupportedSnapshot for a newer format) the current state is left as
// it was. On success the swap is atomic for readers, the applied index
// becomes the snapshot's last index (or stays, if it was higher) and the old
// state's abandon channel is closed so that watchers re-list.
func (f *FSM) Restore(rc io.ReadCloser) error {
	if rc == nil {
		return fmt.Errorf("%w: nil snapshot reader", ErrCorruptSnapshot)
	}
	defer rc.Close()
	f.applyMu.Lock()
	defer f.applyMu.Unlock()

	db, hdr, _, err := readSnapshot(rc, true)
	if err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	// The applied index never goes back: a snapshot restored by an
	// operator carries the index of the cluster it came from, and reads
	// waiting for an index this node already passed must not wait for
	// entries that will never come. (The leader follows such a restore
	// with a Restored command, which moves it on everywhere.)
	txn := db.Txn(true)
	if err := dedupeToSessions(txn); err != nil {
		txn.Abort()
		return fmt.Errorf("restore: %w", err)
	}
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

// ReadSnapshotHeader reads the preamble and header of a snapshot stream
// without reading the records, e.g. to show per-table counts.
func ReadSnapshotHeader(r io.Reader) (*fsmv1.SnapshotHeader, error) {
	sr := newSnapshotReader(r)
	return sr.header()
}

// VerifySnapshot reads a whole snapshot stream into a throwaway state and
// reports whether Restore would accept it.
func VerifySnapshot(r io.Reader) (*fsmv1.SnapshotHeader, error) {
	_, hdr, _, err := readSnapshot(r, true)
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
	_, hdr, sizes, err := readSnapshot(r, build)
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
	buf bytes.Buffer
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
	n, err := binary.ReadUvarint(sr.br)
	if err != nil {
		return nil, fmt.Errorf("%w: read record length: %w", ErrCorruptSnapshot, noEOF(err))
	}
	if n > limit {
		return nil, corruptf("record of %d bytes, at most %d allowed", n, limit)
	}
	sr.buf.Reset()
	if _, err := io.CopyN(&sr.buf, sr.br, int64(n)); err != nil {
		return nil, fmt.Errorf("%w: read record: %w", ErrCorruptSnapshot, noEOF(err))
	}
	return sr.buf.Bytes(), nil
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

// readSnapshot reads a whole snapshot stream into a new database and
// returns it with the header and the record bytes of each table of the
// header. Tables the snapshot does not list are empty. With full false it
// only decodes and checks every record, one at a time, and returns no
// database: memory stays flat, but duplicate keys and records memdb cannot
// index go unnoticed.
func readSnapshot(r io.Reader, full bool) (*memdb.MemDB, *fsmv1.SnapshotHeader, []uint64, error) {
	sr := newSnapshotReader(r)
	hdr, err := sr.header()
	if err != nil {
		return nil, nil, nil, err
	}
	sizes := make([]uint64, len(hdr.GetTables()))
	var (
		db  *memdb.MemDB
		txn *memdb.Txn
	)
	if full {
		db = newMemDB()
		txn = db.Txn(true)
		defer txn.Abort()
	}
	for ti, th := range hdr.GetTables() {
		t, _ := tableDefByName(th.GetName())
		for i := uint64(0); i < th.GetRecords(); i++ {
			b, err := sr.record(maxRecordSize)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("%s record %d: %w", t.name, i, err)
			}
			sizes[ti] += uint64(len(b))
			obj, err := t.codec.decode(b)
			if err != nil {
				return nil, nil, nil, fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, t.name, i, err)
			}
			if e, ok := obj.(*indexEntry); ok {
				if _, known := tableDefByName(e.Table); !known {
					return nil, nil, nil, fmt.Errorf("%w: %s record %d: unknown table %q", ErrCorruptSnapshot, t.name, i, e.Table)
				}
			}
			if !full {
				continue
			}
			if err := txn.Insert(t.name, obj); err != nil {
				return nil, nil, nil, fmt.Errorf("%w: %s record %d: %w", ErrCorruptSnapshot, t.name, i, err)
			}
		}
		if !full {
			continue
		}
		it, err := txn.Get(t.name, indexID)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("read %s: %w", t.name, err)
		}
		var n uint64
		for obj := it.Next(); obj != nil; obj = it.Next() {
			n++
		}
		if n != th.GetRecords() {
			return nil, nil, nil, corruptf("%s: %d distinct records, header says %d", t.name, n, th.GetRecords())
		}
	}
	if _, err := sr.br.ReadByte(); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%w: after last record: %w", ErrCorruptSnapshot, err)
		}
		return nil, nil, nil, corruptf("trailing data after the last record")
	}
	if full {
		txn.Commit()
	}
	return db, hdr, sizes, nil
}

// replaceDB commits txn, the whole new state db as of index, with the base
// row of tableServiceIndex and the derived rows of the services table, and makes it the state: the applied index never
// goes back, and the old state's watchers are woken to re-list. On error
// txn is aborted and nothing changes.
func (f *FSM) replaceDB(txn *memdb.Txn, db *memdb.MemDB, index uint64) error {
	applied := max(f.AppliedIndex(), index)
	if err := setServiceIndex(txn, serviceIndexBase, applied); err != nil {
		txn.Abort()
		return err
	}
	if err := deriveServices(txn); err != nil {
		txn.Abort()
		return err
	}
	txn.Commit()
	f.mu.Lock()
	old := f.abandonCh
	f.sessions.invalidate()
	f.db = db
	f.setAppliedLocked(applied)
	f.abandonCh = make(chan struct{})
	f.mu.Unlock()
	close(old)
	return nil
}
