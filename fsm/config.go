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
	// InitialVersion is the cluster version of the empty state. An agent
	// leaves it at 0.0: its empty state may be about to apply the log of a
	// cluster of agents that predate cluster versions, from its start, and
	// a new cluster's first leader raises it (DESIGN.md, "Cluster
	// version"). Tools and tests that build a state of their own set
	// Latest: the empty state then holds the version record.
	InitialVersion Version
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

// LatestConfig is DefaultConfig for a state that starts at the latest
// cluster version: one that is not a replica of a log that may predate it
// (tools, scratch states, tests).
func LatestConfig() Config {
	c := DefaultConfig()
	c.InitialVersion = Latest
	return c
}

// Validate reports the first field that is out of range.
func (c Config) Validate() error {
	if c.ConfigHistoryLimit < 1 {
		return fmt.Errorf("%w: ConfigHistoryLimit is %d, must be at least 1", ErrInvalidConfig, c.ConfigHistoryLimit)
	}
	if c.DedupeWindow <= 0 {
		return fmt.Errorf("%w: DedupeWindow is %s, must be positive", ErrInvalidConfig, c.DedupeWindow)
	}
	if !c.InitialVersion.Known() {
		return fmt.Errorf("%w: InitialVersion is %s, this release knows %v", ErrInvalidConfig, c.InitialVersion, knownVersions)
	}
	if c.MaxRunHistory < 1 {
		return fmt.Errorf("%w: MaxRunHistory is %d, must be at least 1", ErrInvalidConfig, c.MaxRunHistory)
	}
	return nil
}
