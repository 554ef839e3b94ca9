package archive_test

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// benchFSM returns an FSM holding n instances registered as
// cmd/internal/bench's BenchmarkSnapshot loads them through one agent:
// ~100-byte instances with a one-entry meta map, and the outcome of each
// write (holding the instance too) in the one session of the agent's
// client ID, all within the dedupe window.
func benchFSM(b *testing.B, n int) *fsm.FSM {
	b.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		b.Fatal(err)
	}
	payload := strings.Repeat("0123456789abcdef", 4)
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for i := range n {
		cmd := &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{
			Instance: &clusterv1.ServiceInstance{
				Service: "bench-write", InstanceId: fmt.Sprintf("i-%07d", i), Address: "10.20.30.40", Port: 8080,
				Tags: []string{"bench"}, Meta: map[string]string{"payload": payload},
			},
		}}, ClientId: "gw-node1", Sequence: uint64(i + 1), Time: timestamppb.New(now)}
		data, err := fsm.Encode(cmd)
		if err != nil {
			b.Fatal(err)
		}
		if res := f.Apply(&raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data}).(*fsm.Result); res.Err != nil {
			b.Fatal(res.Err)
		}
	}
	return f
}

// benchRecords is the state's size in the save and restore benchmarks
// (BenchmarkSnapshot's default).
const benchRecords = 100_000

// BenchmarkSave times the steps of an archive of the state of
// BenchmarkSnapshot: the capture (its sizing pass), the encoding of the
// stream, and the whole archive (capture, encoding, compression, hashing).
// MB/s is of the state stream.
func BenchmarkSave(b *testing.B) {
	f := benchFSM(b, benchRecords)
	snap, err := f.CaptureSnapshot(fsm.TableCA)
	if err != nil {
		b.Fatal(err)
	}
	size := snap.Size()
	b.Run("capture", func(b *testing.B) {
		b.SetBytes(size)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := f.CaptureSnapshot(fsm.TableCA); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encode", func(b *testing.B) {
		b.SetBytes(size)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := snap.WriteTo(io.Discard); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("archive", func(b *testing.B) {
		b.SetBytes(size)
		b.ReportAllocs()
		var out int64
		for b.Loop() {
			snap, err := f.CaptureSnapshot(fsm.TableCA)
			if err != nil {
				b.Fatal(err)
			}
			pr, pw := io.Pipe()
			go func() {
				_, err := snap.WriteTo(pw)
				pw.CloseWithError(err)
			}()
			cw := &countWriter{}
			if err := archive.Write(cw, archive.Meta{ID: "1-1-1", Index: snap.Index(), Size: snap.Size()}, pr); err != nil {
				b.Fatal(err)
			}
			out = cw.n
		}
		b.ReportMetric(float64(out), "archive-bytes")
	})
}

type countWriter struct{ n int64 }

func (c *countWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

// BenchmarkCompression compresses and decompresses the state stream of
// BenchmarkSave with the candidate codecs: MB/s is of the state, the
// ratio is state ÷ compressed.
func BenchmarkCompression(b *testing.B) {
	f := benchFSM(b, benchRecords)
	var st bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		b.Fatal(err)
	}
	type codec struct {
		name string
		w    func(io.Writer) io.WriteCloser
		r    func(io.Reader) io.Reader
	}
	gz := func(level int) codec {
		return codec{fmt.Sprintf("gzip-%d", level), func(w io.Writer) io.WriteCloser {
			zw, err := gzip.NewWriterLevel(w, level)
			if err != nil {
				b.Fatal(err)
			}
			return zw
		}, func(r io.Reader) io.Reader {
			zr, err := gzip.NewReader(r)
			if err != nil {
				b.Fatal(err)
			}
			return zr
		}}
	}
	zs := func(name string, level zstd.EncoderLevel, conc int) codec {
		return codec{name, func(w io.Writer) io.WriteCloser {
			zw, err := zstd.NewWriter(w, zstd.WithEncoderLevel(level), zstd.WithEncoderConcurrency(conc))
			if err != nil {
				b.Fatal(err)
			}
			return zw
		}, func(r io.Reader) io.Reader {
			zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1))
			if err != nil {
				b.Fatal(err)
			}
			return zr
		}}
	}
	codecs := []codec{
		{"none", func(w io.Writer) io.WriteCloser { return nopCloser{w} }, func(r io.Reader) io.Reader { return r }},
		gz(gzip.HuffmanOnly), gz(1), gz(2), gz(3), gz(6),
		zs("zstd-fastest", zstd.SpeedFastest, 1), zs("zstd-default", zstd.SpeedDefault, 1),
		zs("zstd-fastest-conc2", zstd.SpeedFastest, 2),
	}
	for _, c := range codecs {
		var comp bytes.Buffer
		zw := c.w(&comp)
		if _, err := zw.Write(st.Bytes()); err != nil {
			b.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			b.Fatal(err)
		}
		b.Run(c.name+"/write", func(b *testing.B) {
			b.SetBytes(int64(st.Len()))
			b.ReportAllocs()
			for b.Loop() {
				zw := c.w(io.Discard)
				if _, err := zw.Write(st.Bytes()); err != nil {
					b.Fatal(err)
				}
				if err := zw.Close(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(st.Len())/float64(comp.Len()), "ratio")
		})
		b.Run(c.name+"/read", func(b *testing.B) {
			b.SetBytes(int64(st.Len()))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := io.Copy(io.Discard, c.r(bytes.NewReader(comp.Bytes()))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

// BenchmarkRestore restores an archive of the state of BenchmarkSave
// through archive.Open (as the leader's restore reads an upload) into an
// FSM holding the same state (fork: every record kept) and into an empty
// one. B/op is what one restore allocates.
func BenchmarkRestore(b *testing.B) {
	f := benchFSM(b, benchRecords)
	snap, err := f.CaptureSnapshot(fsm.TableCA)
	if err != nil {
		b.Fatal(err)
	}
	var st bytes.Buffer
	if _, err := snap.WriteTo(&st); err != nil {
		b.Fatal(err)
	}
	var file bytes.Buffer
	if err := archive.Write(&file, archive.Meta{ID: "1-1-1", Index: snap.Index(), Size: snap.Size()}, bytes.NewReader(st.Bytes())); err != nil {
		b.Fatal(err)
	}
	restore := func(b *testing.B, into func() *fsm.FSM) {
		b.SetBytes(int64(st.Len()))
		b.ReportAllocs()
		for b.Loop() {
			b.StopTimer()
			g := into()
			b.StartTimer()
			rd, _, err := archive.Open(bytes.NewReader(file.Bytes()), 0)
			if err != nil {
				b.Fatal(err)
			}
			state, err := rd.State()
			if err != nil {
				b.Fatal(err)
			}
			if err := g.Restore(io.NopCloser(state)); err != nil {
				b.Fatal(err)
			}
			if err := rd.Close(); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("same", func(b *testing.B) {
		restore(b, func() *fsm.FSM {
			g, err := f.Fork(fsm.LatestConfig())
			if err != nil {
				b.Fatal(err)
			}
			return g
		})
	})
	b.Run("empty", func(b *testing.B) {
		restore(b, func() *fsm.FSM {
			g, err := fsm.New(fsm.LatestConfig())
			if err != nil {
				b.Fatal(err)
			}
			return g
		})
	})
}
