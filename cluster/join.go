package cluster

import (
	"context"
	"log/slog"
	"time"
)

// Joiner joins the gossip ring.
type Joiner interface {
	Join(addrs []string) (int, error)
}

// RetryJoinConfig configures RetryJoin.
type RetryJoinConfig struct {
	Addrs    []string
	Interval time.Duration
	// MaxAttempts bounds the attempts; 0 retries until ctx ends.
	MaxAttempts int
	Logger      *slog.Logger
}

// RetryJoin joins the ring through any of Addrs, retrying every Interval,
// and returns the last error once MaxAttempts attempts failed.
func RetryJoin(ctx context.Context, cfg RetryJoinConfig, j Joiner) error {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 30 * time.Second
	}
	logger = logger.With("component", "retry-join")
	for attempt := 1; ; attempt++ {
		n, err := j.Join(cfg.Addrs)
		if err == nil {
			logger.Info("joined cluster", "contacted", n, "attempt", attempt)
			return nil
		}
		if cfg.MaxAttempts > 0 && attempt >= cfg.MaxAttempts {
			logger.Error("giving up joining the cluster", "attempts", attempt, "error", err)
			return err
		}
		logger.Warn("join failed, will retry", "attempt", attempt, "retry_in", cfg.Interval, "error", err)
		t := time.NewTimer(cfg.Interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}
