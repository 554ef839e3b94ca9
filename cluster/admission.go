package cluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"time"

	"pilab.hu/pivirt-agent/identity"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// Admitter decides whether a gossip member that claims to be a server may
// take part in Raft: be counted for bootstrap, be added to the
// configuration, have its address followed, or speak for its node ID at
// all. Gossip alone (anyone with the gossip key) never suffices.
type Admitter interface {
	Admit(ctx context.Context, m Member) error
	// Proven reports whether m's exact claim (its name included) proved
	// itself to this node before, without asking: what a member that is
	// no longer alive is judged by.
	Proven(m Member) bool
	// Refused reports whether m's claim was asked and never proved, and
	// whether it may be asked again now.
	Refused(m Member) (refused, due bool)
}

// AdmissionConfig configures an Admission.
type AdmissionConfig struct {
	// Ask sends a status query carrying nonce to a member's internal
	// address (PoolStatus.Prove); Forget, when set, drops what Ask keeps
	// for an address that failed (the pool's connection), so made-up
	// addresses leave nothing behind.
	Ask    func(ctx context.Context, internalAddr string, nonce []byte) (*nodev1.StatusResponse, error)
	Forget func(internalAddr string)
	// Verify checks a certificate chain against the cluster's CAs of the
	// moment (identity.Source.VerifyChain of tls.ca_file).
	Verify identity.ChainVerifier
	// TTL is how long a proven claim is trusted before it is asked again
	// (default 1h). A claim that changes (another address) is asked at once.
	TTL time.Duration
	// MinBackoff and MaxBackoff space the attempts for a claim that failed
	// (defaults 1 s and 1 min), so members that cannot prove anything cost
	// one dial each per MaxBackoff at most.
	MinBackoff, MaxBackoff time.Duration
	Logger                 *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Admission admits a server once it proved, over the internal port's
// mutual TLS, that it holds the agent certificate for the node name it
// claims in gossip: the leader (or a bootstrapping server) sends a fresh
// nonce in a status query, and the member answers with its agent
// certificate chain and a signature over its whole claim (cluster, node
// ID, name, Raft and internal addresses) and the nonce. Results are kept
// per claim: a proof for TTL, a failure until its backoff ends.
type Admission struct {
	cfg    AdmissionConfig
	logger *slog.Logger

	mu     sync.Mutex
	claims map[string]*admissionEntry
}

type admissionEntry struct {
	proven bool
	known  bool // proven at some point

	until   time.Time // proven: trusted until; failed: next attempt
	backoff time.Duration
	err     error
	seen    time.Time
	// asked is when the claim was last asked.
	asked time.Time
}

// maxAdmissionEntries bounds the claims remembered; past it, expired ones
// and then failed ones are forgotten (a flood of made-up members cannot
// grow the map without bound).
const maxAdmissionEntries = 4096

// NewAdmission returns an Admission.
func NewAdmission(cfg AdmissionConfig) *Admission {
	if cfg.TTL <= 0 {
		cfg.TTL = time.Hour
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = time.Second
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(time.Minute, cfg.MinBackoff)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Admission{cfg: cfg, logger: logger.With("component", "admission"), claims: make(map[string]*admissionEntry)}
}

// ErrNotAdmitted wraps every refusal of Admit.
var ErrNotAdmitted = errors.New("server not admitted")

// Claim is the identity claim a member makes through gossip.
func (m Member) Claim() identity.NodeClaim {
	return identity.NodeClaim{Cluster: m.Meta.Cluster, NodeID: m.Meta.ID, Name: m.Name,
		RaftAddr: m.Meta.RaftAddr, InternalAddr: m.Meta.InternalAddr}
}

func claimKey(c identity.NodeClaim) string {
	return strings.Join([]string{c.Cluster, c.NodeID, c.Name, c.RaftAddr, c.InternalAddr}, "\x00")
}

// Admit implements Admitter: nil once m proved its claim (kept for TTL),
// else an error wrapping ErrNotAdmitted that says why. A failed claim is
// not asked again before its backoff ends.
func (a *Admission) Admit(ctx context.Context, m Member) error {
	claim := m.Claim()
	key := claimKey(claim)
	now := a.cfg.Now()
	a.mu.Lock()
	e := a.claims[key]
	// A failure is not asked again before its backoff ends, unless the
	// member changed since (it restarted: on a new release, say).
	if e != nil && now.Before(e.until) && (e.proven || !m.changedSince(e.asked)) {
		e.seen = now
		err := e.err
		a.mu.Unlock()
		return err
	}
	a.mu.Unlock()

	err := a.prove(ctx, claim)
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("%w: %v", ErrNotAdmitted, ctx.Err()) // our own cancellation says nothing of the member
	}

	a.mu.Lock()
	defer a.mu.Unlock()
	e = a.claims[key]
	if e == nil {
		a.pruneLocked(now)
		e = &admissionEntry{}
		a.claims[key] = e
	}
	e.seen = now
	if err == nil {
		if !e.proven {
			a.logger.Info("server proved its agent identity", "name", m.Name, "node_id", claim.NodeID,
				"raft_addr", claim.RaftAddr, "internal_addr", claim.InternalAddr)
		}
		*e = admissionEntry{proven: true, known: true, until: now.Add(a.cfg.TTL), seen: now}
		return nil
	}
	e.proven = false
	if a.cfg.Forget != nil {
		a.cfg.Forget(claim.InternalAddr)
	}
	err = fmt.Errorf("%w: %s (node id %s) %v", ErrNotAdmitted, m.Name, claim.NodeID, err)
	if e.err == nil || e.err.Error() != err.Error() {
		a.logger.Warn("server not admitted into raft: it did not prove the agent identity it claims in gossip",
			"name", m.Name, "node_id", claim.NodeID, "gossip_addr", m.Addr, "raft_addr", claim.RaftAddr,
			"internal_addr", claim.InternalAddr, "error", err)
	}
	e.backoff = min(max(2*e.backoff, a.cfg.MinBackoff), a.cfg.MaxBackoff)
	e.err, e.until, e.asked = err, now.Add(e.backoff), now
	return err
}

// changedSince reports whether m's status, address or start time changed
// after t.
func (m Member) changedSince(t time.Time) bool {
	return m.Since.After(t) || m.Changed.After(t)
}

// Proven implements Admitter.
func (a *Admission) Proven(m Member) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.claims[claimKey(m.Claim())]
	return e != nil && e.known
}

// Refused reports whether m's claim was asked and never proved (a member
// that once proved it is not refused here), and whether its backoff has
// ended, so that it may be asked again.
func (a *Admission) Refused(m Member) (refused, due bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.claims[claimKey(m.Claim())]
	if e == nil || e.known {
		return false, false
	}
	return true, !a.cfg.Now().Before(e.until) || m.changedSince(e.asked)
}

// prove asks the member at its claimed internal address to sign the claim
// with a fresh nonce and checks the answer.
func (a *Admission) prove(ctx context.Context, claim identity.NodeClaim) error {
	if claim.InternalAddr == "" || claim.NodeID == "" {
		return errors.New("the claim has no node id or internal address")
	}
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		return err
	}
	st, err := a.cfg.Ask(ctx, claim.InternalAddr, nonce)
	if err != nil {
		return fmt.Errorf("identity query to %s: %v", claim.InternalAddr, err)
	}
	if st.GetNodeId() != claim.NodeID {
		return fmt.Errorf("%s answers as node id %q", claim.InternalAddr, st.GetNodeId())
	}
	p := st.GetProof()
	return identity.CheckNodeProof(a.cfg.Verify, claim, nonce, identity.NodeProof{Chain: p.GetChain(), Signature: p.GetSignature()})
}

// pruneLocked forgets claims past their time that were not asked about for
// a while, and failed ones beyond the bound.
func (a *Admission) pruneLocked(now time.Time) {
	if len(a.claims) < maxAdmissionEntries {
		return
	}
	stale := now.Add(-2 * max(a.cfg.TTL, a.cfg.MaxBackoff))
	for k, e := range a.claims {
		if e.seen.Before(stale) || (!e.known && !now.Before(e.until)) {
			delete(a.claims, k)
		}
	}
	for k, e := range a.claims {
		if len(a.claims) < maxAdmissionEntries {
			return
		}
		if !e.known {
			delete(a.claims, k)
		}
	}
}

// admitAll checks members concurrently, at most admitParallel at a time,
// within admitPassTime (members not reached meanwhile are refused this
// time and asked on a later pass, in another order), and returns the
// error of each that was not admitted, by index.
func admitAll(ctx context.Context, adm Admitter, ms []Member) map[int]error {
	out := make(map[int]error)
	if adm == nil || len(ms) == 0 {
		return out
	}
	ctx, cancel := context.WithTimeout(ctx, admitPassTime)
	defer cancel()
	var (
		mu  sync.Mutex
		wg  sync.WaitGroup
		sem = make(chan struct{}, admitParallel)
	)
	for _, i := range mrand.Perm(len(ms)) {
		m := ms[i]
		if ctx.Err() != nil {
			// Checks already running write out too.
			mu.Lock()
			out[i] = fmt.Errorf("%w: %s not asked in this pass", ErrNotAdmitted, m.Name)
			mu.Unlock()
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := adm.Admit(ctx, m); err != nil {
				mu.Lock()
				out[i] = err
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return out
}

// admitParallel bounds the identity queries one pass sends at once, and
// admitPassTime the time a pass spends on them, so members that cannot
// prove anything cannot stall the reconciler.
const (
	admitParallel = 8
	admitPassTime = 3 * time.Second
)
