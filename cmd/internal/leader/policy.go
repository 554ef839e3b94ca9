package leader

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/go-memdb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/identity"
)

// PolicyFile keeps, in the data dir, the last cluster-wide RBAC policy this
// agent saw: after a restart it is enforced until the agent has caught up
// with the cluster (which, without a quorum, may be long).
const PolicyFile = "rbac-cluster-policy.yaml"

// PolicyConfig wires a [ClusterPolicy].
type PolicyConfig struct {
	// Key is the config key of the cluster-wide policy.
	Key string
	// Resources are the resources a policy may name, asked at each parse
	// (the routes' descriptor sets may name more after a reload).
	Resources func() []string
	// DataDir keeps the copy of the policy (PolicyFile).
	DataDir string
	// FSM is the local state.
	FSM *fsm.FSM
	// ReadConsistent reads Key with a consistent read through the cluster
	// (after it the local state holds everything committed before the
	// call); a connect NotFound counts as read.
	ReadConsistent func(ctx context.Context) error
	// HoldTimeout is how long a call waits for the catch-up before it is
	// refused (cluster.forward_hold_timeout).
	HoldTimeout time.Duration
	// FallbackFile names the auth.rbac_policy file in log lines ("": none).
	FallbackFile string
	Logger       *slog.Logger
}

// ClusterPolicy keeps the cluster-wide RBAC policy (the replicated config
// key) in force on this node as it changes, and a copy of it in the data
// dir. It runs on every node, leader or not.
type ClusterPolicy struct {
	cfg     PolicyConfig
	current atomic.Pointer[authz.Policy]
	// mu serialises sync; revision is the revision it last applied.
	mu       sync.Mutex
	revision uint64
	// caughtUp is closed once the agent has read the policy consistently;
	// usable: calls need not wait for that.
	caughtUp chan struct{}
	usable   atomic.Bool
}

// NewClusterPolicy returns the policy follower of cfg; Run runs it.
func NewClusterPolicy(cfg PolicyConfig) *ClusterPolicy {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &ClusterPolicy{cfg: cfg, caughtUp: make(chan struct{})}
}

// Policy is the cluster-wide policy in force; nil when none is set.
func (p *ClusterPolicy) Policy() *authz.Policy { return p.current.Load() }

// LoadPersisted puts the kept cluster-wide policy in force; false when
// there is none (or it no longer parses).
func (p *ClusterPolicy) LoadPersisted() bool {
	path := filepath.Join(p.cfg.DataDir, PolicyFile)
	b, err := os.ReadFile(path)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			p.cfg.Logger.Error("reading the kept cluster RBAC policy failed", "path", path, "error", err)
		}
		return false
	}
	pol, err := authz.Parse(bytes.NewReader(b), p.cfg.Resources())
	if err != nil {
		p.cfg.Logger.Error("the kept cluster RBAC policy does not parse; calls wait until the agent has caught up with the cluster", "path", path, "error", err)
		return false
	}
	p.current.Store(pol)
	p.cfg.Logger.Info("cluster-wide RBAC policy in force from the data dir until the agent catches up", "rules", len(pol.Rules))
	return true
}

// SetUsable lets calls through before the catch-up: the node has a policy
// of its own to enforce meanwhile (the file, or the kept copy).
func (p *ClusterPolicy) SetUsable() { p.usable.Store(true) }

// Ready holds a call until the agent knows which policy is in force: it
// has caught up with the cluster once, or has a policy of its own (the
// auth.rbac_policy file, or the kept cluster-wide one) to enforce
// meanwhile. A fresh agent that cannot reach a leader within HoldTimeout
// answers with an error rather than guess.
func (p *ClusterPolicy) Ready(ctx context.Context) error {
	if p.usable.Load() {
		return nil
	}
	t := time.NewTimer(p.cfg.HoldTimeout)
	defer t.Stop()
	select {
	case <-p.caughtUp:
		return nil
	case <-ctx.Done():
	case <-t.C:
	}
	return errors.New("this agent has not caught up with the cluster yet, so it does not know which RBAC policy is in force; retry shortly")
}

// Run catches up with the cluster (a consistent read, then the policy of
// the local state in force, then calls let through) and keeps the policy
// in force as the key changes, until ctx ends.
func (p *ClusterPolicy) Run(ctx context.Context) {
	if !p.catchUp(ctx) {
		return
	}
	for ctx.Err() == nil {
		ws := memdb.NewWatchSet()
		if _, err := p.cfg.FSM.State().WatchConfigKey(ws, p.cfg.Key); err != nil {
			p.cfg.Logger.Error("watching the cluster RBAC policy failed; retrying", "error", err)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		p.sync()
		if err := ws.WatchCtx(ctx); err != nil {
			return
		}
	}
}

// catchUp makes a consistent read of the policy key (the local state then
// holds everything committed before it), brings the policy in force up to
// date and lets calls through; false when ctx ended first.
func (p *ClusterPolicy) catchUp(ctx context.Context) bool {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := p.cfg.ReadConsistent(rctx)
		cancel()
		if err == nil || connect.CodeOf(err) == connect.CodeNotFound {
			p.sync()
			p.usable.Store(true)
			close(p.caughtUp)
			return true
		}
		if !sleepCtx(ctx, wait) {
			return false
		}
		wait = min(2*wait, 2*time.Second)
	}
	return false
}

// sync puts the cluster-wide policy of the local state in force and keeps
// a copy in the data dir. A version that does not parse here (written by a
// newer agent) is logged; the cluster policy in use stays, and without one
// every call is denied until it is fixed.
func (p *ClusterPolicy) sync() {
	p.mu.Lock()
	defer p.mu.Unlock()
	path := filepath.Join(p.cfg.DataDir, PolicyFile)
	e, err := p.cfg.FSM.State().ConfigEntry(p.cfg.Key)
	switch {
	case errors.Is(err, fsm.ErrNotFound):
		if p.current.Swap(nil) != nil {
			p.cfg.Logger.Info("cluster-wide RBAC policy removed; the auth.rbac_policy file applies", "file", p.cfg.FallbackFile)
		}
		p.revision = 0
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			p.cfg.Logger.Error("removing the kept cluster RBAC policy failed", "path", path, "error", err)
		}
	case err != nil:
		p.cfg.Logger.Error("reading the cluster RBAC policy failed", "error", err)
	case e.GetRevision() != p.revision:
		p.revision = e.GetRevision()
		pol, err := authz.Parse(strings.NewReader(e.GetValue()), p.cfg.Resources())
		if err != nil {
			if p.current.Load() == nil {
				p.current.Store(&authz.Policy{}) // no rules: every call denied
				p.cfg.Logger.Error("cluster-wide RBAC policy does not parse on this agent; denying every call until it is fixed", "revision", e.GetRevision(), "error", err)
			} else {
				p.cfg.Logger.Error("cluster-wide RBAC policy not applied; keeping the policy in use", "revision", e.GetRevision(), "error", err)
			}
			return
		}
		p.current.Store(pol)
		p.cfg.Logger.Info("cluster-wide RBAC policy in force", "revision", e.GetRevision(), "rules", len(pol.Rules))
		if err := identity.WriteFileAtomic(path, []byte(e.GetValue()), 0o600); err != nil {
			p.cfg.Logger.Error("keeping a copy of the cluster RBAC policy failed", "path", path, "error", err)
		}
	}
}
