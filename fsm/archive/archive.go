// Package archive reads and writes snapshot archives: the file that
// `pvcli snapshot save` writes and `pvcli snapshot restore` reads, and that
// the leader writes on its snapshot interval. An archive is a gzip'd tar of
// exactly three entries, in this order:
//
//	meta.json    what the snapshot is (Meta)
//	state.bin    the FSM snapshot stream (fsm.FSM.Snapshot's format)
//	SHA256SUMS   the SHA-256 of the two, in sha256sum(1) format
//
// Everything is streamed: neither writing nor verifying holds the state in
// memory beyond what verifying the FSM stream needs.
package archive

import (
	"archive/tar"
	"bufio"
	"bytes"

	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"hash/crc64"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
	"github.com/klauspost/compress/gzip"

	"pilab.hu/pivirt-agent/fsm"
)

// FormatVersion is the archive layout this version writes, and the newest
// it reads.
const FormatVersion uint32 = 1

// Entry names, in archive order.
const (
	MetaFile  = "meta.json"
	StateFile = "state.bin"
	SumsFile  = "SHA256SUMS"
)

// Limits on the small entries, so that garbage cannot make a reader
// allocate much.
const (
	maxMetaSize = 64 << 10
	maxSumsSize = 4 << 10
)

var (
	// ErrInvalid: the file is not a snapshot archive, or it is damaged
	// (truncated, wrong checksum, unknown or missing entry, trailing bytes,
	// a state that does not verify).
	ErrInvalid = errors.New("invalid snapshot archive")
	// ErrUnsupported: the archive, or its state, was written by a newer
	// format version than this agent reads.
	ErrUnsupported = errors.New("unsupported snapshot archive")
)

// Sentinels lists the package's sentinel errors, for the gateway's
// error→code table; TestSentinels checks that it is complete.
var Sentinels = []error{ErrInvalid, ErrUnsupported}

// Meta is meta.json.
type Meta struct {
	// ID is the Raft snapshot's ID.
	ID string `json:"id"`
	// Index and Term are those of the last log entry the state includes.
	Index uint64 `json:"index"`
	Term  uint64 `json:"term"`
	// FormatVersion is the archive layout's version; StateFormatVersion
	// that of state.bin (fsm.SnapshotFormatVersion).
	FormatVersion      uint32 `json:"format_version"`
	StateFormatVersion uint32 `json:"state_format_version"`
	// ClusterID identifies the cluster the snapshot was taken from.
	ClusterID string `json:"cluster_id"`
	// AgentVersion is the version of the agent that wrote the archive.
	AgentVersion string `json:"agent_version"`
	// Size is the length of state.bin in bytes.
	Size int64 `json:"size"`
	// CreatedAt is when the archive was written.
	CreatedAt time.Time `json:"created_at"`
}

// Info is what Verify learns about an archive.
type Info struct {
	Meta Meta
	// State describes state.bin, per table.
	State *fsm.SnapshotInfo
	// SHA256 holds the checksums listed in SHA256SUMS, by entry name.
	SHA256 map[string]string
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// Write writes an archive of meta and state to w. state must yield exactly
// meta.Size bytes. FormatVersion is set by Write; StateFormatVersion and
// CreatedAt are filled in when zero.
func Write(w io.Writer, meta Meta, state io.Reader) error {
	if meta.Size < 0 {
		return fmt.Errorf("write snapshot archive: negative state size %d", meta.Size)
	}
	meta.FormatVersion = FormatVersion
	if meta.StateFormatVersion == 0 {
		// The state's own preamble says which format it is in (the
		// oldest that holds it, fsm.SnapshotFormatVersion at most).
		br := bufio.NewReader(state)
		pre, err := br.Peek(8)
		if err != nil {
			return fmt.Errorf("write snapshot archive: read the state's preamble: %w", err)
		}
		meta.StateFormatVersion = binary.BigEndian.Uint32(pre[4:])
		state = br
	}
	if meta.CreatedAt.IsZero() {
		meta.CreatedAt = time.Now().UTC()
	}
	mb, err := json.MarshalIndent(meta, "", "  ")
	if err != nil {
		return fmt.Errorf("write snapshot archive: encode %s: %w", MetaFile, err)
	}
	mb = append(mb, '\n')

	// Fastest compression: the state is mostly small protobuf records,
	// which it still shrinks about 4×, at several times the speed of the
	// default level; the archive is written while the leader serves.
	zw, err := gzip.NewWriterLevel(w, gzip.BestSpeed)
	if err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	tw := tar.NewWriter(zw)
	header := func(name string, size int64) *tar.Header {
		return &tar.Header{Name: name, Mode: 0o600, Size: size, ModTime: meta.CreatedAt, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
	}
	metaSum := sha256.Sum256(mb)
	if err := tw.WriteHeader(header(MetaFile, int64(len(mb)))); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	if _, err := tw.Write(mb); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	if err := tw.WriteHeader(header(StateFile, meta.Size)); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tw, h), io.LimitReader(state, meta.Size))
	if err != nil {
		return fmt.Errorf("write snapshot archive: %s: %w", StateFile, err)
	}
	if n != meta.Size {
		return fmt.Errorf("write snapshot archive: %s: the state ended after %d of %d bytes", StateFile, n, meta.Size)
	}
	sums := fmt.Sprintf("%x  %s\n%x  %s\n", metaSum, MetaFile, h.Sum(nil), StateFile)
	if err := tw.WriteHeader(header(SumsFile, int64(len(sums)))); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	if _, err := io.WriteString(tw, sums); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	if err := zw.Close(); err != nil {
		return fmt.Errorf("write snapshot archive: %w", err)
	}
	return nil
}

// Verify reads a whole archive from r and checks everything a restore
// relies on: the layout (exactly the three entries, in order, and nothing
// after them), the versions, the checksums, and state.bin as the FSM would
// restore it. It reads r twice: first the framing, the sizes and both
// checksums in one streaming pass that keeps nothing (so a damaged or
// forged file is refused before anything is decoded from it), then, from
// the start again, state.bin as the FSM restores it. On error the Info
// holds what was read before the problem (Meta once meta.json was read),
// for display.
func Verify(r io.ReadSeeker) (*Info, error) { return VerifyWithin(r, 0) }

// VerifyWithin is Verify for an archive whose state.bin may hold at most
// maxState bytes (0: no bound): a larger one — a small archive that
// decompresses to more than the reader can hold — is refused on the
// sizes its headers declare, before any of it is decompressed.
func VerifyWithin(r io.ReadSeeker, maxState int64) (*Info, error) {
	if info, err := checkSize(r, maxState); err != nil {
		return info, err
	}
	info, err := verify(bufio.NewReaderSize(r, 64<<10), nil)
	if err != nil {
		return info, err
	}
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		return info, fmt.Errorf("snapshot archive: %w", err)
	}
	full, err := verify(bufio.NewReaderSize(r, 64<<10), fsm.InspectSnapshot)
	if err == nil && full.SHA256[StateFile] != info.SHA256[StateFile] {
		err = invalidf("the archive changed while it was read")
	}
	return full, err
}

// Open is Verify for a reader that decodes state.bin itself, once: it
// checks everything but the state's records (the layout, the versions,
// the sizes against maxState as VerifyWithin does, both checksums) in one
// streaming pass that keeps nothing, then returns a Reader from the start
// of r. The caller reads the state from Reader.State, passes any error of
// its decoding through StateError, and calls Reader.Close, which checks
// the checksums again (the file may have changed since). A restore that
// builds the state anyway needs no second build to verify it.
func Open(r io.ReadSeeker, maxState int64) (*Reader, *Info, error) {
	if info, err := checkSize(r, maxState); err != nil {
		return nil, info, err
	}
	info, err := verify(bufio.NewReaderSize(r, 64<<10), nil)
	if err != nil {
		return nil, info, err
	}
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		return nil, info, fmt.Errorf("snapshot archive: %w", err)
	}
	rd, err := NewReader(bufio.NewReaderSize(r, 64<<10))
	if err != nil {
		return nil, info, err
	}
	return rd, info, nil
}

// MaxExpansion and ExpansionSlack bound state.bin's size by the size of
// the archive that carries it: at most MaxExpansion times the archive's
// bytes plus ExpansionSlack. The agents' archives are gzip'd protobuf
// records with IDs, which compress a few times, never near a hundred; a
// small archive that claims a state many times larger (a gzip bomb) is
// refused on the sizes it declares, before any of it is decompressed, so
// that no reader spends memory or time on it.
const (
	MaxExpansion   = 100
	ExpansionSlack = 16 << 20
)

// checkSize reads meta.json from the start of r and refuses a state.bin
// that would be larger than maxState bytes (0: no such bound) or larger
// than the archive's size allows (MaxExpansion); r is left at its start.
func checkSize(r io.ReadSeeker, maxState int64) (*Info, error) {
	info := &Info{}
	archiveSize, err := r.Seek(0, io.SeekEnd)
	if err != nil {
		return info, fmt.Errorf("snapshot archive: %w", err)
	}
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		return info, fmt.Errorf("snapshot archive: %w", err)
	}
	if _, err := open(bufio.NewReaderSize(r, 64<<10), &info.Meta); err != nil {
		return info, err
	}
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		return info, fmt.Errorf("snapshot archive: %w", err)
	}
	if maxState > 0 && info.Meta.Size > maxState {
		return info, invalidf("%s is %d bytes uncompressed, more than the %d this reader accepts", StateFile, info.Meta.Size, maxState)
	}
	if limit := MaxExpansion*archiveSize + ExpansionSlack; info.Meta.Size > limit {
		return info, invalidf("%s is %d bytes uncompressed in an archive of %d bytes: more than %d times the archive (+%d MiB), which no agent writes; refused before decompressing it",
			StateFile, info.Meta.Size, archiveSize, MaxExpansion, ExpansionSlack>>20)
	}
	return info, nil
}

// StateError describes an error of decoding state.bin (fsm.Restore's, or
// fsm.InspectSnapshot's) as Verify does: ErrUnsupported for a newer
// state format, ErrInvalid otherwise.
func StateError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnsupported):
		return err
	case errors.Is(err, fsm.ErrUnsupportedSnapshot):
		return fmt.Errorf("%w: %s: %w", ErrUnsupported, StateFile, err)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return invalidf("%s is truncated: %v", StateFile, err)
	}
	return fmt.Errorf("%w: %s: %w", ErrInvalid, StateFile, err)
}

// Check is Verify in one pass and constant memory: state.bin is read one
// record at a time (fsm.ScanSnapshot) instead of being built, so a
// duplicate key that Restore would refuse goes unnoticed. It is the check
// of a file just written from a live state; a restore uses Verify.
func Check(r io.Reader) (*Info, error) {
	return verify(r, fsm.ScanSnapshot)
}

// verify checks an archive in one pass; inspect reads state.bin (nil: it
// is only hashed).
func verify(r io.Reader, inspect func(io.Reader) (*fsm.SnapshotInfo, error)) (*Info, error) {
	info := &Info{}
	ar, err := open(r, &info.Meta)
	if err != nil {
		return info, err
	}
	stateSum := sha256.New()
	state, err := ar.state()
	if err != nil {
		return info, err
	}
	if inspect == nil {
		if _, err := io.Copy(stateSum, state); err != nil {
			return info, ar.framing("reading "+StateFile, err)
		}
		if ar.short() {
			return info, invalidf("%s is truncated", StateFile)
		}
		return finishSums(info, ar, stateSum)
	}
	st, err := inspect(io.TeeReader(state, stateSum))
	if err != nil {
		if errors.Is(err, fsm.ErrUnsupportedSnapshot) {
			return info, fmt.Errorf("%w: %s: %w", ErrUnsupported, StateFile, err)
		}
		if errors.Is(err, io.ErrUnexpectedEOF) || ar.short() {
			return info, invalidf("%s is truncated: %v", StateFile, err)
		}
		return info, fmt.Errorf("%w: %s: %w", ErrInvalid, StateFile, err)
	}
	info.State = st
	if st.FormatVersion != info.Meta.StateFormatVersion {
		return info, invalidf("%s has state format version %d, %s says %d", StateFile, st.FormatVersion, MetaFile, info.Meta.StateFormatVersion)
	}
	return finishSums(info, ar, stateSum)
}

// finishSums reads the rest of the archive and compares state.bin's
// checksum (stateSum, after reading it) with the one listed.
func finishSums(info *Info, ar *reader, stateSum hash.Hash) (*Info, error) {
	sums, err := ar.finish()
	info.SHA256 = sums
	if err != nil {
		return info, err
	}
	if got := hex.EncodeToString(stateSum.Sum(nil)); got != sums[StateFile] {
		return info, invalidf("%s checksum mismatch: the archive lists %s, the content hashes to %s", StateFile, sums[StateFile], got)
	}
	return info, nil
}

// Reader reads an archive for a restore: Meta first, then State, then
// Close checks the checksums and the end of the archive. It trusts
// state.bin to be valid: call it on an archive Verify accepted.
type Reader struct {
	Meta Meta
	ar   *reader
	sumF func() string
}

// NewReader opens an archive and reads its meta.json.
func NewReader(r io.Reader) (*Reader, error) {
	rd := &Reader{}
	ar, err := open(r, &rd.Meta)
	if err != nil {
		return nil, err
	}
	rd.ar = ar
	return rd, nil
}

// State returns state.bin's content: Meta.Size bytes. A state whose
// preamble names another format version than meta.json is refused here.
func (rd *Reader) State() (io.Reader, error) {
	state, err := rd.ar.state()
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	rd.sumF = func() string { return hex.EncodeToString(h.Sum(nil)) }
	br := bufio.NewReaderSize(io.TeeReader(state, h), 64<<10)
	if pre, err := br.Peek(8); err == nil && string(pre[:4]) == "PVSN" {
		if v := binary.BigEndian.Uint32(pre[4:]); v != rd.Meta.StateFormatVersion {
			return nil, invalidf("%s has state format version %d, %s says %d", StateFile, v, MetaFile, rd.Meta.StateFormatVersion)
		}
	}
	return br, nil
}

// Close reads the rest of the archive after state.bin was read to its end,
// and checks the checksums and that nothing follows.
func (rd *Reader) Close() error {
	if rd.sumF == nil {
		return errors.New("snapshot archive: closed before its state was read")
	}
	sums, err := rd.ar.finish()
	if err != nil {
		return err
	}
	if got := rd.sumF(); got != sums[StateFile] {
		return invalidf("%s checksum mismatch: the archive lists %s, the content hashes to %s", StateFile, sums[StateFile], got)
	}
	return nil
}

// reader walks the entries of an archive.
type reader struct {
	br       *bufio.Reader
	zr       *gzip.Reader
	tr       *tar.Reader
	metaSum  string
	metaSize int64 // state.bin's size according to meta.json
	stateN   *countingReader
	size     int64
}

// open checks the gzip and tar framing and reads meta.json into meta.
func open(r io.Reader, meta *Meta) (*reader, error) {
	br := bufio.NewReader(r)
	zr, err := gzip.NewReader(br)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, invalidf("empty file")
		}
		return nil, invalidf("not a gzip'd snapshot archive: %v", err)
	}
	zr.Multistream(false)
	ar := &reader{br: br, zr: zr, tr: tar.NewReader(zr)}
	mb, err := ar.small(MetaFile, maxMetaSize)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(mb)
	ar.metaSum = hex.EncodeToString(sum[:])
	// The versions first, leniently: a newer format may have fields this
	// version does not know, and must be reported as newer, not as damaged.
	var versions struct {
		FormatVersion      uint32 `json:"format_version"`
		StateFormatVersion uint32 `json:"state_format_version"`
	}
	if err := json.Unmarshal(mb, &versions); err != nil {
		return nil, invalidf("%s: %v", MetaFile, err)
	}
	switch {
	case versions.FormatVersion > FormatVersion:
		return nil, fmt.Errorf("%w: archive format version %d, this agent reads up to %d", ErrUnsupported, versions.FormatVersion, FormatVersion)
	case versions.FormatVersion == 0:
		return nil, invalidf("%s: format_version missing", MetaFile)
	case versions.StateFormatVersion > fsm.SnapshotFormatVersion:
		return nil, fmt.Errorf("%w: state format version %d, this agent reads up to %d", ErrUnsupported, versions.StateFormatVersion, fsm.SnapshotFormatVersion)
	case versions.StateFormatVersion == 0:
		return nil, invalidf("%s: state_format_version missing", MetaFile)
	}
	dec := json.NewDecoder(bytes.NewReader(mb))
	dec.DisallowUnknownFields()
	if err := dec.Decode(meta); err != nil {
		return nil, invalidf("%s: %v", MetaFile, err)
	}
	switch {
	case meta.Size < 0:
		return nil, invalidf("%s: negative size %d", MetaFile, meta.Size)
	}
	ar.metaSize = meta.Size
	return ar, nil
}

// next returns the header of the next entry, which must be want.
func (ar *reader) next(want string) (*tar.Header, error) {
	hdr, err := ar.tr.Next()
	switch {
	case errors.Is(err, io.EOF):
		return nil, invalidf("%s missing: the archive ends before it", want)
	case err != nil:
		return nil, ar.framing(fmt.Sprintf("reading the entry before %s", want), err)
	}
	if hdr.Name != want {
		if hdr.Name == MetaFile || hdr.Name == StateFile || hdr.Name == SumsFile {
			return nil, invalidf("entry %s where %s belongs (entries must be %s, %s, %s in that order)", hdr.Name, want, MetaFile, StateFile, SumsFile)
		}
		return nil, invalidf("unknown archive entry %q (an archive holds exactly %s, %s and %s)", hdr.Name, MetaFile, StateFile, SumsFile)
	}
	if hdr.Typeflag != tar.TypeReg {
		return nil, invalidf("%s is not a regular file", want)
	}
	return hdr, nil
}

// framing describes an error of the gzip or tar layer.
func (ar *reader) framing(where string, err error) error {
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return invalidf("truncated file (%s)", where)
	}
	return invalidf("%s: %v", where, err)
}

// small reads a whole small entry.
func (ar *reader) small(name string, limit int64) ([]byte, error) {
	hdr, err := ar.next(name)
	if err != nil {
		return nil, err
	}
	if hdr.Size > limit {
		return nil, invalidf("%s is %d bytes, at most %d allowed", name, hdr.Size, limit)
	}
	b, err := io.ReadAll(ar.tr)
	if err != nil {
		return nil, ar.framing("reading "+name, err)
	}
	return b, nil
}

// state positions the reader on state.bin.
func (ar *reader) state() (io.Reader, error) {
	hdr, err := ar.next(StateFile)
	if err != nil {
		return nil, err
	}
	if hdr.Size != ar.metaSize {
		return nil, invalidf("%s is %d bytes, %s says %d", StateFile, hdr.Size, MetaFile, ar.metaSize)
	}
	ar.size = hdr.Size
	ar.stateN = &countingReader{r: ar.tr}
	return ar.stateN, nil
}

// short reports whether state.bin ended before its declared size.
func (ar *reader) short() bool { return ar.stateN != nil && ar.stateN.n < ar.size }

// finish checks that state.bin was read to its end, reads SHA256SUMS and
// the end of the archive, and returns the listed checksums after checking
// meta.json's.
func (ar *reader) finish() (map[string]string, error) {
	// The rest of state.bin: a reader that stopped early left bytes.
	rest, err := io.Copy(io.Discard, ar.tr)
	if err != nil {
		return nil, ar.framing("reading "+StateFile, err)
	}
	if rest > 0 {
		return nil, invalidf("%s has %d bytes after the end of the state", StateFile, rest)
	}
	b, err := ar.small(SumsFile, maxSumsSize)
	if err != nil {
		return nil, err
	}
	sums, err := parseSums(b)
	if err != nil {
		return nil, err
	}
	if sums[MetaFile] != ar.metaSum {
		return sums, invalidf("%s checksum mismatch: the archive lists %s, the content hashes to %s", MetaFile, sums[MetaFile], ar.metaSum)
	}
	switch hdr, err := ar.tr.Next(); {
	case err == nil:
		return sums, invalidf("unknown archive entry %q after %s (an archive holds exactly %s, %s and %s)", hdr.Name, SumsFile, MetaFile, StateFile, SumsFile)
	case !errors.Is(err, io.EOF):
		return sums, ar.framing("reading the end of the archive", err)
	}
	// After the tar end marker only zero padding may follow, then the end
	// of the gzip member, then the end of the file.
	pad, err := io.ReadAll(ar.zr)
	if err != nil {
		return sums, ar.framing("reading the end of the archive", err)
	}
	if len(bytes.Trim(pad, "\x00")) > 0 {
		return sums, invalidf("trailing data after the end of the tar archive")
	}
	if _, err := ar.br.Peek(1); !errors.Is(err, io.EOF) {
		if err != nil {
			return sums, invalidf("reading after the archive: %v", err)
		}
		return sums, invalidf("trailing bytes after the end of the gzip stream")
	}
	return sums, nil
}

// parseSums parses SHA256SUMS: exactly one line per checksummed entry.
func parseSums(b []byte) (map[string]string, error) {
	sums := make(map[string]string)
	for i, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		sum, name, ok := strings.Cut(line, "  ")
		if !ok || len(sum) != sha256.Size*2 || strings.Trim(sum, "0123456789abcdef") != "" {
			return nil, invalidf("%s line %d is not \"<sha256>  <name>\": %q", SumsFile, i+1, line)
		}
		if name != MetaFile && name != StateFile {
			return nil, invalidf("%s line %d names unknown entry %q", SumsFile, i+1, name)
		}
		if _, dup := sums[name]; dup {
			return nil, invalidf("%s lists %s twice", SumsFile, name)
		}
		sums[name] = sum
	}
	for _, name := range []string{MetaFile, StateFile} {
		if _, ok := sums[name]; !ok {
			return nil, invalidf("%s has no checksum for %s", SumsFile, name)
		}
	}
	return sums, nil
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// raftSnapshotMeta is the meta.json of a snapshot directory of Raft's file
// snapshot store (<data_dir>/raft/snapshots/<id>/).
type raftSnapshotMeta struct {
	raft.SnapshotMeta
	CRC []byte
}

// InspectDir verifies a snapshot directory from an agent's data dir (the
// Raft snapshot store's meta.json and state.bin) as Verify verifies an
// archive: both must be regular files (not links, FIFOs or devices), and
// the size and the CRC-64 that Raft recorded are checked in a streaming
// pass before state.bin is read as the FSM would restore it. The returned
// Meta has the fields Raft records; the SHA256 map holds state.bin's
// checksum.
func InspectDir(dir string) (*Info, error) {
	info := &Info{}
	mf, err := openRegular(filepath.Join(dir, MetaFile))
	if err != nil {
		return info, invalidf("not a snapshot directory: %v", err)
	}
	mb, err := io.ReadAll(io.LimitReader(mf, maxMetaSize+1))
	mf.Close()
	switch {
	case err != nil:
		return info, invalidf("%v", err)
	case len(mb) > maxMetaSize:
		return info, invalidf("%s is larger than %d bytes", filepath.Join(dir, MetaFile), maxMetaSize)
	}
	var rm raftSnapshotMeta
	if err := json.Unmarshal(mb, &rm); err != nil {
		return info, invalidf("%s: %v", filepath.Join(dir, MetaFile), err)
	}
	info.Meta = Meta{ID: rm.ID, Index: rm.Index, Term: rm.Term, Size: rm.Size}
	f, err := openRegular(filepath.Join(dir, StateFile))
	if err != nil {
		return info, invalidf("%v", err)
	}
	defer f.Close()
	// First the size and the CRC, keeping nothing.
	crc := crc64.New(crc64.MakeTable(crc64.ECMA))
	sum := sha256.New()
	n, err := io.Copy(io.MultiWriter(crc, sum), io.LimitReader(f, rm.Size+1))
	switch {
	case err != nil:
		return info, invalidf("%s: %v", StateFile, err)
	case n != rm.Size:
		return info, invalidf("%s is %d bytes or more, %s says %d", StateFile, n, MetaFile, rm.Size)
	case !bytes.Equal(crc.Sum(nil), rm.CRC):
		return info, invalidf("%s CRC-64 mismatch: %s lists %x, the content has %x", StateFile, MetaFile, rm.CRC, crc.Sum(nil))
	}
	info.SHA256 = map[string]string{StateFile: hex.EncodeToString(sum.Sum(nil))}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return info, invalidf("%s: %v", StateFile, err)
	}
	st, err := fsm.InspectSnapshot(io.LimitReader(f, rm.Size))
	if err != nil {
		if errors.Is(err, fsm.ErrUnsupportedSnapshot) {
			return info, fmt.Errorf("%w: %s: %w", ErrUnsupported, StateFile, err)
		}
		return info, fmt.Errorf("%w: %s: %w", ErrInvalid, StateFile, err)
	}
	info.State = st
	info.Meta.StateFormatVersion = st.FormatVersion
	return info, nil
}

// openRegular opens a file of a snapshot directory only if it is a
// regular file itself, not a symbolic link (openFile).
func openRegular(path string) (*os.File, error) { return openFile(path, syscall.O_NOFOLLOW) }

// OpenRegular opens path for reading only if it is (or links to) a
// regular file: not a FIFO, whose open would block until a writer comes,
// nor a device, which never ends. The file is opened without blocking and
// checked after the open, so it cannot be swapped in between.
func OpenRegular(path string) (*os.File, error) { return openFile(path, 0) }

func openFile(path string, flags int) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|flags, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s is not a regular file (a symbolic link)", path)
		}
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file (%s)", path, st.Mode().Type())
	}
	return f, nil
}
