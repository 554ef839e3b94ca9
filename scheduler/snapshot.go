package scheduler

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pilab.hu/pivirt-agent/fsm/archive"
)

// SnapshotTaker opens a snapshot of the replicated state: the meta of its
// archive and the state stream (exactly Meta.Size bytes), which the caller
// closes.
type SnapshotTaker func(ctx context.Context) (archive.Meta, io.ReadCloser, error)

// Archive file names: archivePrefix, the UTC time (so that names sort by
// age), the index, archiveSuffix.
const (
	archivePrefix = "pivirt-snapshot-"
	archiveSuffix = ".tar.gz"
	archiveTime   = "20060102T150405Z"
)

// SnapshotterConfig configures automatic snapshots.
type SnapshotterConfig struct {
	// Interval between two archives.
	Interval time.Duration
	// Dir receives the archives; it is created if missing.
	Dir string
	// Retain is how many archives are kept.
	Retain int
	// Timeout bounds writing one archive (default: Interval).
	Timeout time.Duration
	Logger  *slog.Logger
	Metrics *SnapshotMetrics
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// SnapshotMetrics are the automatic snapshot metrics.
type SnapshotMetrics struct {
	LastSuccess  prometheus.Gauge
	LastFailure  prometheus.Gauge
	Failures     prometheus.Counter
	LastBytes    prometheus.Gauge
	LastDuration prometheus.Gauge
}

// NewSnapshotMetrics creates the metrics and registers them with reg.
func NewSnapshotMetrics(reg prometheus.Registerer) *SnapshotMetrics {
	m := &SnapshotMetrics{
		LastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_snapshot_last_success_timestamp_seconds",
			Help: "Unix time of the last automatic snapshot archive written, 0 if none.",
		}),
		LastFailure: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_snapshot_last_failure_timestamp_seconds",
			Help: "Unix time of the last automatic snapshot that failed, 0 if none.",
		}),
		Failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "pivirt_snapshot_failures_total",
			Help: "Automatic snapshots that failed.",
		}),
		LastBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_snapshot_last_size_bytes",
			Help: "Size of the last automatic snapshot archive written.",
		}),
		LastDuration: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_snapshot_last_duration_seconds",
			Help: "How long writing the last automatic snapshot archive took.",
		}),
	}
	reg.MustRegister(m.LastSuccess, m.LastFailure, m.Failures, m.LastBytes, m.LastDuration)
	return m
}

// RunSnapshotter writes an archive into cfg.Dir every cfg.Interval until ctx
// ends, keeping the cfg.Retain newest. The first one is due one interval
// after the newest archive already in the directory, so that leader changes
// neither skip archives nor write one each.
func RunSnapshotter(ctx context.Context, cfg SnapshotterConfig, take SnapshotTaker) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = cfg.Interval
	}
	logger := cfg.Logger.With("component", "snapshotter")
	due := cfg.Now()
	if newest, ok := newestArchive(cfg.Dir); ok {
		due = newest.Add(cfg.Interval)
	}
	for {
		timer := time.NewTimer(max(0, due.Sub(cfg.Now())))
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
		start := cfg.Now()
		tctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
		path, size, err := WriteArchive(tctx, cfg.Dir, take, cfg.Now)
		cancel()
		if ctx.Err() != nil {
			return
		}
		took := cfg.Now().Sub(start)
		if err != nil {
			logger.Error("automatic snapshot failed", "error", err, "dir", cfg.Dir)
			if cfg.Metrics != nil {
				cfg.Metrics.Failures.Inc()
				cfg.Metrics.LastFailure.Set(float64(cfg.Now().Unix()))
			}
			// Try again sooner than a whole interval, but not in a loop.
			due = cfg.Now().Add(min(cfg.Interval, time.Minute))
			continue
		}
		logger.Info("automatic snapshot written", "path", path, "bytes", size, "took", took)
		if cfg.Metrics != nil {
			cfg.Metrics.LastSuccess.Set(float64(cfg.Now().Unix()))
			cfg.Metrics.LastBytes.Set(float64(size))
			cfg.Metrics.LastDuration.Set(took.Seconds())
		}
		if err := PruneArchives(cfg.Dir, cfg.Retain); err != nil {
			logger.Warn("pruning old snapshot archives failed", "error", err, "dir", cfg.Dir)
		}
		due = start.Add(cfg.Interval)
	}
}

// WriteArchive writes one archive into dir: to a temporary file, synced
// and verified, then renamed, so that dir never holds a partial archive
// under an archive name. It returns the archive's path and size.
func WriteArchive(ctx context.Context, dir string, take SnapshotTaker, now func() time.Time) (string, int64, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", 0, fmt.Errorf("snapshot dir: %w", err)
	}
	meta, rc, err := take(ctx)
	if err != nil {
		return "", 0, err
	}
	defer rc.Close()
	if meta.CreatedAt.IsZero() {
		meta.CreatedAt = now().UTC()
	}
	name := fmt.Sprintf("%s%s-%d%s", archivePrefix, meta.CreatedAt.UTC().Format(archiveTime), meta.Index, archiveSuffix)
	path := filepath.Join(dir, name)
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", 0, fmt.Errorf("snapshot archive: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	w := bufio.NewWriterSize(f, 1<<20)
	cw := &countWriter{w: w}
	if err := archive.Write(cw, meta, &ctxReader{ctx: ctx, r: rc}); err != nil {
		return "", 0, err
	}
	if err := w.Flush(); err != nil {
		return "", 0, fmt.Errorf("snapshot archive: %w", err)
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("snapshot archive: %w", err)
	}
	if err := f.Close(); err != nil {
		return "", 0, fmt.Errorf("snapshot archive: %w", err)
	}
	if err := verifyFile(ctx, tmp); err != nil {
		return "", 0, fmt.Errorf("the archive written does not verify: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", 0, fmt.Errorf("snapshot archive: %w", err)
	}
	ok = true
	syncDir(dir)
	return path, cw.n, nil
}

func verifyFile(ctx context.Context, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = archive.Check(bufio.NewReaderSize(&ctxReader{ctx: ctx, r: f}, 1<<20))
	return err
}

// syncDir makes a rename in dir durable; failures only cost durability of
// the name, so they are ignored.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
}

// archives returns the archive names in dir, oldest first.
func archives(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		n := e.Name()
		if e.Type().IsRegular() && strings.HasPrefix(n, archivePrefix) && strings.HasSuffix(n, archiveSuffix) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names, nil
}

// newestArchive returns the time in the name of the newest archive in dir.
func newestArchive(dir string) (time.Time, bool) {
	names, err := archives(dir)
	if err != nil {
		return time.Time{}, false
	}
	for i := len(names) - 1; i >= 0; i-- {
		stamp, _, _ := strings.Cut(strings.TrimPrefix(names[i], archivePrefix), "-")
		if t, err := time.Parse(archiveTime, stamp); err == nil {
			return t, true
		}
	}
	return time.Time{}, false
}

// PruneArchives deletes all but the retain newest archives in dir, and
// temporary files an interrupted write left behind. Other files are left
// alone.
func PruneArchives(dir string, retain int) error {
	names, err := archives(dir)
	if err != nil {
		return err
	}
	var errs []error
	if len(names) > retain {
		for _, n := range names[:len(names)-retain] {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, e := range entries {
		if n := e.Name(); strings.HasPrefix(n, archivePrefix) && strings.HasSuffix(n, archiveSuffix+".tmp") {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// countWriter counts the bytes written through it.
type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// ctxReader stops a copy when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
