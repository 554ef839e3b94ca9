package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"pilab.hu/pivirt-agent/fsm"
)

// VoterManager is what the reconciler needs of the Raft store. Every
// method is idempotent and only works on the leader.
type VoterManager interface {
	Servers(ctx context.Context) ([]RaftServer, error)
	AddVoter(ctx context.Context, id, addr string) error
	AddNonvoter(ctx context.Context, id, addr string) error
	RemoveServer(ctx context.Context, id string) error
}

// ReconcileConfig configures the leader's membership reconciliation.
type ReconcileConfig struct {
	SelfID string
	// SelfName is this node's gossip name (the leader's own member is never
	// asked to prove itself).
	SelfName string
	// Admission, when set, lets only members that proved their agent
	// identity speak for a node ID: be added, have their address followed,
	// be promoted, or keep a server from cleanup. Failed and left members
	// count only for the address the configuration already holds. Nil
	// trusts gossip (TLS off).
	Admission Admitter
	// MaxNonvoters caps the non-voters in the configuration (0: no cap);
	// a server past it waits in gossip until a seat frees.
	MaxNonvoters int
	// Voters is the target number of voters (1, 3 or 5); servers beyond it
	// are non-voters and are promoted when a voter goes away.
	Voters int
	// DeadServerCleanup removes a server that has been failed (or unknown
	// to gossip) this long. Zero disables it; servers that left gracefully
	// are always removed.
	DeadServerCleanup time.Duration
	// Stabilization is how long a non-voter must be healthy (reachable and
	// caught up) before it is promoted. New servers always join as
	// non-voters first, so an unreachable newcomer can never cost quorum.
	Stabilization time.Duration
	// MaxTrailingLogs is how far behind the leader's log a healthy server
	// may be.
	MaxTrailingLogs uint64
	// LeaderLastIndex reports the leader's last log index.
	LeaderLastIndex func() uint64
	// Interval between reconciliations when gossip is quiet.
	Interval time.Duration
	Logger   *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// ClusterVersion, when set, is the state's cluster version: a member
	// that announces an older one (AnnouncedVersion) is neither added nor
	// promoted, as it could not apply the log.
	ClusterVersion func() fsm.Version
}

// Reconciler keeps the Raft configuration in line with gossip membership.
// It runs only on the leader, for one leadership term.
type Reconciler struct {
	cfg     ReconcileConfig
	raft    VoterManager
	members Membership
	peers   PeerStatus
	logger  *slog.Logger
	// unknownSince records when a Raft server was first found missing from
	// gossip, so servers gossip has forgotten are also cleaned up.
	unknownSince map[string]time.Time
	// healthySince records since when a non-voter has been healthy.
	healthySince map[string]time.Time
	// capped records the servers told they wait for a non-voter seat, so
	// that is logged once per server.
	capped map[string]bool
	// tooOld are the IDs already warned about as older than the cluster
	// version (tooOldFor).
	tooOld map[string]bool
	// unproven are the IDs of this pass spoken for by an alive member that
	// did not prove its identity (serverMembers): not promoted.
	unproven map[string]bool
	// lastServers are the IDs the configuration held at the end of the
	// last pass (nil before the first). A server gone from it that this
	// reconciler did not remove was removed by an operator (remove-peer,
	// force-leave --prune).
	lastServers map[string]bool
	// lastChanged is each of those servers' gossip member's Changed then.
	lastChanged map[string]time.Time
	// removed records, for each server removed by an operator, its gossip
	// member's Changed at the last pass before the removal (zero if gossip
	// did not know it). The server is not added back while its member is
	// unchanged since: a member killed moments before its removal still
	// looks alive until the failure detector catches up, and adding it
	// back would leave a dead non-voter until dead_server_cleanup. An
	// answer on its internal port (answers: the agent runs), a restart (a
	// new start time), a new address, or the member seen failed or left (a
	// new Changed) lifts it. It is kept for the leadership term:
	// a new leader adds the server back.
	removed map[string]removal

	// report is what the last pass found of each server (Report).
	reportMu sync.Mutex
	report   map[string]ServerReport
}

// removal is an operator's removal of a server, as the reconciler saw it.
type removal struct {
	seen    time.Time // when the reconciler noticed it
	changed time.Time // the member's Changed then
}

// ServerReport is what the reconciler's last pass found of one server
// (autopilot state).
type ServerReport struct {
	// Status says where the server stands: "voter", "promoted", or why a
	// non-voter was not promoted, or why a server was not added or removed.
	Status string
	// HealthySince is when a non-voter was first seen reachable and caught
	// up (zero when it is not, and for voters).
	HealthySince time.Time
}

// ReconcileReport is the reconciler's settings and the last pass's
// findings, by node ID.
type ReconcileReport struct {
	Voters            int
	Stabilization     time.Duration
	MaxTrailingLogs   uint64
	DeadServerCleanup time.Duration
	MaxNonvoters      int
	Servers           map[string]ServerReport
}

// Report is the settings and what the last pass found (Servers nil before
// the first pass).
func (r *Reconciler) Report() ReconcileReport {
	r.reportMu.Lock()
	defer r.reportMu.Unlock()
	out := ReconcileReport{Voters: r.cfg.Voters, Stabilization: r.cfg.Stabilization, MaxTrailingLogs: r.cfg.MaxTrailingLogs,
		DeadServerCleanup: r.cfg.DeadServerCleanup, MaxNonvoters: r.cfg.MaxNonvoters}
	if r.report == nil {
		return out // no pass yet
	}
	out.Servers = make(map[string]ServerReport, len(r.report))
	for id, s := range r.report {
		out.Servers[id] = s
	}
	return out
}

// NewReconciler returns a reconciler for one leadership term.
func NewReconciler(cfg ReconcileConfig, raft VoterManager, members Membership, peers PeerStatus) *Reconciler {
	if cfg.Interval <= 0 {
		cfg.Interval = 5 * time.Second
	}
	if cfg.Voters <= 0 {
		cfg.Voters = 3
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.MaxTrailingLogs == 0 {
		cfg.MaxTrailingLogs = 250
	}
	if cfg.LeaderLastIndex == nil {
		cfg.LeaderLastIndex = func() uint64 { return 0 }
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Reconciler{
		cfg:          cfg,
		raft:         raft,
		members:      members,
		peers:        peers,
		logger:       logger.With("component", "reconcile"),
		unknownSince: make(map[string]time.Time),
		healthySince: make(map[string]time.Time),
		capped:       make(map[string]bool),
		tooOld:       make(map[string]bool),
		removed:      make(map[string]removal),
	}
}

// Run reconciles on every gossip change and every Interval until ctx ends.
func (r *Reconciler) Run(ctx context.Context) {
	changes, cancel := r.members.Subscribe()
	defer cancel()
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		if err := r.Reconcile(ctx); err != nil && ctx.Err() == nil {
			r.logger.Warn("reconcile raft membership", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-changes:
		case <-t.C:
		}
	}
}

// serverMembers maps node IDs to the gossip member that speaks for each.
// With Admission, an alive member must have proved its identity, and a
// failed or left one counts only when it names the address the
// configuration holds for its ID (it is the server the configuration
// means); the rest is ignored, as if gossip had never shown it. An ID
// claimed by two alive members that qualify (a cloned disk image) is
// reported in conflicts and left alone.
func (r *Reconciler) serverMembers(ctx context.Context, inRaft map[string]RaftServer) (byID map[string]Member, conflicts map[string]bool) {
	var claims, ask []Member
	for _, m := range r.members.Members() {
		if m.Meta.Role != RoleServer || m.Meta.ID == "" {
			continue
		}
		switch {
		case r.cfg.Admission == nil || m.Name == r.cfg.SelfName:
			claims = append(claims, m)
		case m.Status == StatusAlive:
			ask = append(ask, m)
		case r.cfg.Admission.Proven(m):
			claims = append(claims, m)
		}
	}
	refused := admitAll(ctx, r.cfg.Admission, ask)
	proven := make(map[string]bool)
	for i, m := range ask {
		if refused[i] == nil {
			claims = append(claims, m)
			proven[m.Meta.ID] = true
		}
	}
	// An alive member that has not proven itself but names the address the
	// configuration holds for its ID (a server of an older version, or one
	// whose proof fails for now) keeps its server from cleanup, unless a
	// proven member speaks for that ID; it never changes the configuration
	// (r.unproven).
	r.unproven = make(map[string]bool)
	for i, m := range ask {
		if s, ok := inRaft[m.Meta.ID]; ok && refused[i] != nil && !proven[m.Meta.ID] && s.Address == m.Meta.RaftAddr {
			claims = append(claims, m)
			r.unproven[m.Meta.ID] = true
		}
	}

	byID = make(map[string]Member)
	conflicts = make(map[string]bool)
	for _, m := range claims {
		old, ok := byID[m.Meta.ID]
		switch {
		case !ok:
			byID[m.Meta.ID] = m
		case old.Status == StatusAlive && m.Status == StatusAlive:
			if !conflicts[m.Meta.ID] {
				r.logger.Error("two live members claim the same node id; leaving it alone (was a data dir copied?)",
					"node_id", m.Meta.ID, "members", old.Name+","+m.Name)
			}
			conflicts[m.Meta.ID] = true
		case m.Status == StatusAlive:
			byID[m.Meta.ID] = m // a live entry wins over a stale one of a renamed node
		}
	}
	return byID, conflicts
}

// Reconcile makes one pass: remove servers that left, or have been failed
// past the threshold, without breaking quorum; add alive servers as
// non-voters and follow address changes; promote healthy non-voters while
// voters are below the target.
func (r *Reconciler) Reconcile(ctx context.Context) error {
	servers, err := r.raft.Servers(ctx)
	if err != nil {
		return fmt.Errorf("read raft configuration: %w", err)
	}
	now := r.cfg.Now()
	inRaft := make(map[string]RaftServer, len(servers))
	voters := make(map[string]bool)
	for _, s := range servers {
		inRaft[s.ID] = s
		if s.Voter {
			voters[s.ID] = true
		}
	}
	byID, conflicts := r.serverMembers(ctx, inRaft)
	var errs []error
	report := make(map[string]ServerReport)
	defer func() {
		for id, s := range inRaft {
			if _, ok := report[id]; !ok && s.Voter {
				report[id] = ServerReport{Status: "voter"}
			}
		}
		r.reportMu.Lock()
		r.report = report
		r.reportMu.Unlock()
	}()
	for id := range conflicts {
		report[id] = ServerReport{Status: "left alone: two live members claim this node ID (was a data dir copied?)"}
	}
	r.noteRemovals(inRaft, byID, now)
	defer func() {
		r.lastServers = make(map[string]bool, len(inRaft))
		r.lastChanged = make(map[string]time.Time, len(inRaft))
		for id := range inRaft {
			r.lastServers[id] = true
			if m, ok := byID[id]; ok {
				r.lastChanged[id] = m.Changed
			}
		}
	}()

	// Removals first, so a dead voter's seat can go to a non-voter.
	for _, s := range servers {
		if s.ID == r.cfg.SelfID || conflicts[s.ID] {
			continue
		}
		m, known := byID[s.ID]
		reason := ""
		switch {
		case known && m.Status == StatusLeft:
			reason = "left the cluster"
		case known && m.Status == StatusFailed:
			if r.cfg.DeadServerCleanup > 0 && now.Sub(m.Since) >= r.cfg.DeadServerCleanup {
				reason = fmt.Sprintf("failed for %s", now.Sub(m.Since).Round(time.Second))
			}
		case !known:
			first, ok := r.unknownSince[s.ID]
			if !ok {
				r.unknownSince[s.ID] = now
				first = now
			}
			if r.cfg.DeadServerCleanup > 0 && now.Sub(first) >= r.cfg.DeadServerCleanup {
				reason = fmt.Sprintf("unknown to gossip for %s", now.Sub(first).Round(time.Second))
			}
		}
		if known {
			delete(r.unknownSince, s.ID)
		}
		if reason == "" {
			continue
		}
		if s.Voter && !r.safeToRemoveVoter(voters, byID, s.ID) {
			r.logger.Warn("not removing voter: the remaining live voters would not form a quorum",
				"node_id", s.ID, "reason", reason)
			report[s.ID] = ServerReport{Status: "voter, " + reason + "; not removed: the remaining live voters would not form a quorum"}
			continue
		}
		if err := r.raft.RemoveServer(ctx, s.ID); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", s.ID, err))
			continue
		}
		r.logger.Info("removed server from raft", "node_id", s.ID, "name", m.Name, "reason", reason)
		delete(inRaft, s.ID)
		delete(voters, s.ID)
		delete(r.unknownSince, s.ID)
		delete(r.healthySince, s.ID)
	}

	// Additions (always as non-voters) and address changes.
	alive := make([]Member, 0, len(byID))
	for id, m := range byID {
		if m.Status == StatusAlive && !conflicts[id] {
			alive = append(alive, m)
		}
	}
	sort.Slice(alive, func(i, j int) bool { return alive[i].Meta.ID < alive[j].Meta.ID })
	for _, m := range alive {
		s, ok := inRaft[m.Meta.ID]
		switch {
		case !ok && m.Meta.Leaving:
			// On its way out (cluster leave): it asked to be removed, and
			// would come back as a dead non-voter.
			report[m.Meta.ID] = ServerReport{Status: "not added: leaving"}
			continue
		case !ok && r.removedAndUnchanged(m) && !r.answers(ctx, m):
			rm := r.removed[m.Meta.ID]
			report[m.Meta.ID] = ServerReport{Status: fmt.Sprintf("not added: removed from raft by an operator %s ago and not answering on its internal port %s; added back when the agent answers again or restarts", now.Sub(rm.seen).Round(time.Second), m.Meta.InternalAddr)}
			continue
		case !ok && r.tooOldFor(m) != "":
			report[m.Meta.ID] = ServerReport{Status: "not added: " + r.tooOldFor(m)}
			r.warnTooOld(m, "not adding server")
			continue
		case !ok:
			if n := len(inRaft) - len(voters); r.cfg.MaxNonvoters > 0 && n >= r.cfg.MaxNonvoters {
				report[m.Meta.ID] = ServerReport{Status: fmt.Sprintf("not added: waits in gossip, the non-voter cap of %d is reached (cluster.raft.max_non_voters)", r.cfg.MaxNonvoters)}
				if !r.capped[m.Meta.ID] {
					r.logger.Warn("not adding server: the non-voter cap is reached; it waits in gossip until a seat frees (cluster.raft.max_non_voters)",
						"node_id", m.Meta.ID, "name", m.Name, "non_voters", n, "max_non_voters", r.cfg.MaxNonvoters)
					r.capped[m.Meta.ID] = true
				}
				continue
			}
			delete(r.capped, m.Meta.ID)
			if err := r.raft.AddNonvoter(ctx, m.Meta.ID, m.Meta.RaftAddr); err != nil {
				errs = append(errs, fmt.Errorf("add non-voter %s: %w", m.Name, err))
				continue
			}
			inRaft[m.Meta.ID] = RaftServer{ID: m.Meta.ID, Address: m.Meta.RaftAddr}
			r.logger.Info("added non-voter", "node_id", m.Meta.ID, "name", m.Name, "raft_addr", m.Meta.RaftAddr)
		case s.Address != m.Meta.RaftAddr && m.Meta.ID != r.cfg.SelfID:
			add := r.raft.AddNonvoter
			if s.Voter {
				add = r.raft.AddVoter
			}
			if err := add(ctx, m.Meta.ID, m.Meta.RaftAddr); err != nil {
				errs = append(errs, fmt.Errorf("update address of %s: %w", m.Name, err))
				continue
			}
			s.Address = m.Meta.RaftAddr
			inRaft[m.Meta.ID] = s
			r.logger.Info("server address changed", "node_id", m.Meta.ID, "name", m.Name, "raft_addr", m.Meta.RaftAddr)
		}
	}

	// Promotions of healthy non-voters.
	for _, m := range alive {
		s, ok := inRaft[m.Meta.ID]
		if !ok || s.Voter {
			continue
		}
		if r.unproven[m.Meta.ID] {
			report[s.ID] = ServerReport{Status: "non-voter, not promoted: its member has not proven its agent identity"}
			continue
		}
		if why := r.tooOldFor(m); why != "" {
			report[s.ID] = ServerReport{Status: "non-voter, not promoted: " + why}
			r.warnTooOld(m, "not promoting server")
			continue
		}
		ok, why := r.healthy(ctx, m, now)
		rep := ServerReport{HealthySince: r.healthySince[m.Meta.ID]}
		if !ok {
			rep.Status = "non-voter, not promoted: " + why
			report[s.ID] = rep
			continue
		}
		if len(voters) >= r.cfg.Voters {
			rep.Status = fmt.Sprintf("non-voter, healthy: the cluster has its %d voters (cluster.raft.voters); promoted when a voter goes", r.cfg.Voters)
			report[s.ID] = rep
			continue
		}
		if err := r.raft.AddVoter(ctx, s.ID, s.Address); err != nil {
			errs = append(errs, fmt.Errorf("promote %s: %w", m.Name, err))
			rep.Status = fmt.Sprintf("non-voter, promotion failed: %v", err)
			report[s.ID] = rep
			continue
		}
		voters[s.ID] = true
		delete(r.healthySince, s.ID)
		report[s.ID] = ServerReport{Status: "voter (promoted in the last pass)"}
		r.logger.Info("promoted non-voter", "node_id", s.ID, "name", m.Name)
	}
	for id, s := range inRaft {
		if _, done := report[id]; !done && !s.Voter {
			if m, ok := byID[id]; ok {
				report[id] = ServerReport{Status: "non-voter, not promoted: its member is " + m.Status.String()}
			} else {
				report[id] = ServerReport{Status: "non-voter, not promoted: unknown to gossip"}
			}
		}
	}
	return errors.Join(errs...)
}

// noteRemovals records the servers removed since the last pass by someone
// else than this reconciler (whose removals leave lastServers at once),
// and forgets removals whose member has changed since or is gone.
func (r *Reconciler) noteRemovals(inRaft map[string]RaftServer, byID map[string]Member, now time.Time) {
	for id := range r.lastServers {
		if _, ok := inRaft[id]; ok {
			continue
		}
		// The member as the last pass saw it, while the server was still
		// in the configuration: a restart since the removal (before this
		// pass) is a change, and lifts the block.
		rm := removal{seen: now, changed: r.lastChanged[id]}
		r.removed[id] = rm
		r.logger.Info("server removed from raft by an operator: added back only once its agent answers on its internal port or restarts", "node_id", id)
	}
	for id := range r.removed {
		_, back := inRaft[id]
		if _, known := byID[id]; back || !known || !r.removedAndUnchanged(byID[id]) {
			delete(r.removed, id)
		}
	}
}

// answers reports whether m's agent answers a status query on its
// internal port as m's node: alive, whatever gossip still believes. A
// server removed by an operator that answers is added back (it runs, and
// would otherwise be stranded without a leader until it restarts).
func (r *Reconciler) answers(ctx context.Context, m Member) bool {
	if r.peers == nil {
		return true
	}
	st, err := r.peers.Status(ctx, m.Meta.InternalAddr)
	return err == nil && st.GetNodeId() == m.Meta.ID
}

// removedAndUnchanged reports whether m's server was removed by an
// operator and its member has not changed since.
func (r *Reconciler) removedAndUnchanged(m Member) bool {
	rm, ok := r.removed[m.Meta.ID]
	return ok && !m.Changed.After(rm.changed)
}

// tooOldFor says why m cannot apply the log at the cluster version ("" when
// it can, or when the version is not known here).
func (r *Reconciler) tooOldFor(m Member) string {
	if r.cfg.ClusterVersion == nil {
		return ""
	}
	cur, v := r.cfg.ClusterVersion(), AnnouncedVersion(m.Meta)
	if !v.Less(cur) {
		delete(r.tooOld, m.Meta.ID)
		return ""
	}
	return fmt.Sprintf("it runs release %s (cluster version %s), older than the cluster version %s, and could not apply the log; upgrade it", m.Meta.Version, v, cur)
}

// warnTooOld logs, once per server, that it is kept out for its version.
func (r *Reconciler) warnTooOld(m Member, what string) {
	if r.tooOld[m.Meta.ID] {
		return
	}
	r.tooOld[m.Meta.ID] = true
	r.logger.Warn(what+": "+r.tooOldFor(m), "node_id", m.Meta.ID, "name", m.Name)
}

// healthy reports whether a non-voter has answered its status query caught
// up with the leader for at least the stabilization time, and why not.
func (r *Reconciler) healthy(ctx context.Context, m Member, now time.Time) (bool, string) {
	if r.peers == nil {
		return true, ""
	}
	st, err := r.peers.Status(ctx, m.Meta.InternalAddr)
	why := ""
	switch {
	case err != nil:
		why = fmt.Sprintf("unreachable on its internal port %s: %v", m.Meta.InternalAddr, err)
	case st.GetNodeId() != m.Meta.ID:
		why = fmt.Sprintf("its internal port %s answers as node %s", m.Meta.InternalAddr, st.GetNodeId())
	default:
		if last := r.cfg.LeaderLastIndex(); last > st.GetLastIndex() && last-st.GetLastIndex() > r.cfg.MaxTrailingLogs {
			why = fmt.Sprintf("behind the leader by %d log entries (at most %d)", last-st.GetLastIndex(), r.cfg.MaxTrailingLogs)
		}
	}
	if why != "" {
		delete(r.healthySince, m.Meta.ID)
		return false, why
	}
	since, seen := r.healthySince[m.Meta.ID]
	if !seen {
		r.healthySince[m.Meta.ID] = now
		since = now
	}
	if stable := now.Sub(since); stable < r.cfg.Stabilization {
		return false, fmt.Sprintf("stabilizing: healthy for %s of the %s needed", stable.Round(time.Second), r.cfg.Stabilization)
	}
	return true, ""
}

// safeToRemoveVoter reports whether the voters left after removing victim
// still have a quorum of live members among them. A server that left
// gracefully counts as live: it keeps replicating until it shuts down.
// The leader never removes itself, and counts as live.
func (r *Reconciler) safeToRemoveVoter(voters map[string]bool, byID map[string]Member, victim string) bool {
	remaining, live := 0, 0
	for id := range voters {
		if id == victim {
			continue
		}
		remaining++
		if id == r.cfg.SelfID {
			live++
			continue
		}
		if m, ok := byID[id]; ok && (m.Status == StatusAlive || m.Status == StatusLeft) {
			live++
		}
	}
	return remaining > 0 && live >= remaining/2+1
}
