// Package scheduler runs the leader-only loops: the power-schedule
// dispatcher (RunDispatcher), the TTL reaper of service registrations
// (RunTTLReaper), the reaper of instances critical for too long
// (RunCriticalReaper) and automatic snapshot archives (RunSnapshotter). Each
// loop is started once per leadership term, after the leader's barrier
// (cmd/internal/leader), and stops when its context is cancelled on
// leadership loss or around a snapshot restore. See DESIGN.md.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// Proposer applies a command through Raft.
type Proposer interface {
	Apply(ctx context.Context, cmd []byte) (resp any, index uint64, err error)
}

// StateReader reads the local replicated state.
type StateReader interface {
	State() *fsm.State
}

// TTLReaperConfig configures the TTL reaper.
type TTLReaperConfig struct {
	// Interval between scans.
	Interval time.Duration
	// ApplyTimeout bounds one proposal.
	ApplyTimeout time.Duration
	Logger       *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// TermStart is when this leadership term began. No instance expires
	// before TermStart+TTL: while there was no leader nobody could
	// heartbeat, and the last heartbeat was stamped by another leader's
	// clock (Consul resets TTL timers on leadership for the same reasons).
	TermStart time.Time
}

// DefaultTTLReaperConfig returns the defaults.
func DefaultTTLReaperConfig() TTLReaperConfig {
	return TTLReaperConfig{Interval: time.Second, ApplyTimeout: 5 * time.Second}
}

// RunTTLReaper marks service instances whose TTL passed without a heartbeat
// as critical, until ctx ends. The command names the heartbeat it saw, so a
// heartbeat committed in between wins and the instance stays passing.
func RunTTLReaper(ctx context.Context, cfg TTLReaperConfig, state StateReader, raft Proposer) {
	cfg = cfg.withDefaults()
	reap(ctx, cfg, "ttl-reaper", func(now time.Time, logger *slog.Logger) bool {
		for _, inst := range state.State().ExpiredTTL(now) {
			if !cfg.TermStart.IsZero() && now.Before(cfg.TermStart.Add(inst.GetTtl().AsDuration())) {
				continue
			}
			if err := expire(ctx, cfg, raft, inst); err != nil {
				if ctx.Err() != nil {
					return false
				}
				if errors.Is(err, fsm.ErrStale) {
					// A heartbeat was committed after the scan: the instance lives.
					continue
				}
				logger.Warn("mark service instance critical", "service", inst.GetService(), "instance", inst.GetInstanceId(), "error", err)
				continue
			}
			logger.Info("service instance missed its TTL", "service", inst.GetService(), "instance", inst.GetInstanceId(), "ttl", inst.GetTtl().AsDuration())
		}
		return true
	})
}

// withDefaults fills in the zero fields of cfg.
func (cfg TTLReaperConfig) withDefaults() TTLReaperConfig {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.ApplyTimeout <= 0 {
		cfg.ApplyTimeout = 5 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return cfg
}

// reap runs pass every cfg.Interval until ctx ends or pass returns false,
// with a logger naming component; cfg has its defaults (withDefaults).
func reap(ctx context.Context, cfg TTLReaperConfig, component string, pass func(now time.Time, logger *slog.Logger) bool) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("component", component)
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !pass(cfg.Now(), logger) {
			return
		}
	}
}

func expire(ctx context.Context, cfg TTLReaperConfig, raft Proposer, inst *clusterv1.ServiceInstance) error {
	return apply(ctx, cfg, raft, &fsmv1.Command{
		Time: timestamppb.New(cfg.Now()),
		Op: &fsmv1.Command_SetServiceHealth{SetServiceHealth: &fsmv1.SetServiceHealth{
			Service:       inst.GetService(),
			InstanceId:    inst.GetInstanceId(),
			Health:        clusterv1.Health_HEALTH_CRITICAL,
			LastHeartbeat: inst.GetLastHeartbeat(),
		}},
	})
}

// apply proposes cmd within cfg.ApplyTimeout and returns its outcome.
func apply(ctx context.Context, cfg TTLReaperConfig, raft Proposer, cmd *fsmv1.Command) error {
	data, err := fsm.Encode(cmd)
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.ApplyTimeout)
	defer cancel()
	resp, _, err := raft.Apply(ctx, data)
	if err != nil {
		return err
	}
	if r, ok := resp.(*fsm.Result); ok && r.Err != nil {
		return r.Err
	}
	return nil
}

// RunCriticalReaper deregisters service instances that have been critical
// for longer than their deregister_critical_after, until ctx ends. It runs
// on the leader in both modes, so an instance whose node is gone goes too.
// The command names the critical spell it saw (fsm.HealthSince), so a check
// that passed in between wins (fsm.ErrStale). cfg is the TTL reaper's:
// TermStart holds deregistrations back for deregister_critical_after from
// the term's start, as the TTL reaper does.
func RunCriticalReaper(ctx context.Context, cfg TTLReaperConfig, state StateReader, raft Proposer) {
	cfg = cfg.withDefaults()
	reap(ctx, cfg, "critical-reaper", func(now time.Time, logger *slog.Logger) bool {
		st := state.State()
		if v, _, err := st.ClusterVersion(); err != nil || !v.Enabled(fsm.FeatureHealthChecks) {
			// Agents that predate deregister_critical_after would
			// deregister unconditionally: not before every server knows it.
			return true
		}
		for _, inst := range st.CriticalExpired(now) {
			after := inst.GetDeregisterCriticalAfter().AsDuration()
			if !cfg.TermStart.IsZero() && now.Before(cfg.TermStart.Add(after)) {
				continue
			}
			since := fsm.HealthSince(inst)
			err := apply(ctx, cfg, raft, &fsmv1.Command{
				Time: timestamppb.New(now),
				Op: &fsmv1.Command_DeregisterService{DeregisterService: &fsmv1.DeregisterService{
					Service: inst.GetService(), InstanceId: inst.GetInstanceId(), CriticalSince: since,
				}},
			})
			if err != nil {
				if ctx.Err() != nil {
					return false
				}
				if errors.Is(err, fsm.ErrStale) || errors.Is(err, fsm.ErrNotFound) {
					continue // it passed, or went, after the scan
				}
				logger.Warn("deregister critical service instance", "service", inst.GetService(), "instance", inst.GetInstanceId(), "error", err)
				continue
			}
			logger.Info("deregistered a service instance critical for longer than its deregister_critical_after",
				"service", inst.GetService(), "instance", inst.GetInstanceId(), "node", inst.GetNode(),
				"critical_since", since.AsTime(), "deregister_critical_after", after)
		}
		return true
	})
}
