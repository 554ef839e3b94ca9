package fsm

import (
	"fmt"
	"log/slog"
	"time"
)

// Config configures an [FSM].
//
// ConfigHistoryLimit, DedupeWindow and MaxRunHistory shape the replicated
// state: every node of a cluster must run with the same values, or their
// states diverge.
type Config struct {
	// Logger receives the FSM's logs; nil discards them.
	Logger *slog.Logger
	// ConfigHistoryLimit is how many versions of each config key are kept in
	// config_history (the current one included). At least 1.
	ConfigHistoryLimit int
	// DedupeWindow is how long, in leader-stamped command time, the outcome of
	// a write with a client ID is remembered so that a retry is not applied
	// again. Must be positive.
	DedupeWindow time.Duration
	// MaxRunHistory is how many runs are kept per schedule whose
	// history_limit is 0. At least 1.
	MaxRunHistory uint32
}

// DefaultConfig returns the configuration every node should use unless the
// whole cluster agrees on other values.
func DefaultConfig() Config {
	return Config{
		Logger:             slog.New(slog.DiscardHandler),
		ConfigHistoryLimit: 16,
		DedupeWindow:       2 * time.Minute,
		MaxRunHistory:      50,
	}
}

// Validate reports the first field that is out of range.
func (c Config) Validate() error {
	if c.ConfigHistoryLimit < 1 {
		return fmt.Errorf("%w: ConfigHistoryLimit is %d, must be at least 1", ErrInvalidConfig, c.ConfigHistoryLimit)
	}
	if c.DedupeWindow <= 0 {
		return fmt.Errorf("%w: DedupeWindow is %s, must be positive", ErrInvalidConfig, c.DedupeWindow)
	}
	if c.MaxRunHistory < 1 {
		return fmt.Errorf("%w: MaxRunHistory is %d, must be at least 1", ErrInvalidConfig, c.MaxRunHistory)
	}
	return nil
}
