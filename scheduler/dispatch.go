package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// Invoker calls a backend method: the gateway's backend clusters, so that
// health checks, ejection and load balancing apply, on the node that holds
// the VM. It returns that node's name ("" when none was reached).
type Invoker func(ctx context.Context, method string, req, resp proto.Message) (host string, err error)

// The VM API methods of the actions.
var actionMethods = map[schedulev1.Action]string{
	schedulev1.Action_ACTION_POWER_ON:  "/pivirt.vm.v1.VMService/PowerOn",
	schedulev1.Action_ACTION_POWER_OFF: "/pivirt.vm.v1.VMService/ShutdownDefault",
	schedulev1.Action_ACTION_REBOOT:    "/pivirt.vm.v1.VMService/Reboot",
}

// IsActionMethod reports whether procedure is the VM API method of an
// action.
func IsActionMethod(procedure string) bool {
	for _, m := range actionMethods {
		if m == procedure {
			return true
		}
	}
	return false
}

// ActionName is an action as the API and metrics spell it.
func ActionName(a schedulev1.Action) string {
	switch a {
	case schedulev1.Action_ACTION_POWER_ON:
		return "power-on"
	case schedulev1.Action_ACTION_POWER_OFF:
		return "power-off"
	case schedulev1.Action_ACTION_REBOOT:
		return "reboot"
	}
	return "unknown"
}

// ActionCall is the VM API call of an action on a VM.
func ActionCall(a schedulev1.Action, vm string) (procedure string, req proto.Message) {
	req, _ = actionRequest(a, vm)
	return actionMethods[a], req
}

func actionRequest(a schedulev1.Action, vm string) (req, resp proto.Message) {
	switch a {
	case schedulev1.Action_ACTION_POWER_ON:
		return &vmv1.PowerOnRequest{Id: vm}, &vmv1.PowerOnResponse{}
	case schedulev1.Action_ACTION_POWER_OFF:
		return &vmv1.ShutdownDefaultRequest{Id: vm}, &vmv1.ShutdownDefaultResponse{}
	default:
		return &vmv1.RebootRequest{Id: vm}, &vmv1.RebootResponse{}
	}
}

// ScheduleMetrics are the dispatcher's metrics.
type ScheduleMetrics struct {
	runs     *prometheus.CounterVec
	lateness prometheus.Histogram
}

// NewScheduleMetrics registers pivirt_schedule_runs_total{action,result}
// and pivirt_schedule_lateness_seconds with reg.
func NewScheduleMetrics(reg prometheus.Registerer) *ScheduleMetrics {
	m := &ScheduleMetrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_schedule_runs_total",
			Help: "Power schedule slots by action and result (ok, error, skipped).",
		}, []string{"action", "result"}),
		lateness: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "pivirt_schedule_lateness_seconds",
			Help:    "Time from a schedule slot to the backend call of its action.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}),
	}
	if reg != nil {
		reg.MustRegister(m.runs, m.lateness)
	}
	return m
}

// ErrNoBackend is what an Invoker returns when no backend endpoint could
// take the call: nothing was sent, so the action is tried again (other
// errors are not: a reboot must not run twice).
var ErrNoBackend = errors.New("no backend endpoint available")

// DispatcherConfig configures RunDispatcher.
type DispatcherConfig struct {
	// NodeID is recorded in each run: which node ran it.
	NodeID string
	// ActionTimeout bounds an action, its attempts included (default 30 s).
	ActionTimeout time.Duration
	// MaxAttempts of an action that found no backend endpoint (default 3).
	MaxAttempts int
	// MaxConcurrent bounds the actions in flight (default 64).
	MaxConcurrent int
	// MaxClaimed bounds the runs claimed and not finished, those waiting
	// for a place among the MaxConcurrent included (default 1024). Claims
	// do not wait for an action's place: the claims of slots due together
	// are committed together (Raft groups concurrent proposals into one
	// write), and the actions follow as places free up.
	MaxClaimed int
	// Grace: a slot found later than this is missed (DefaultGrace).
	Grace time.Duration
	// ApplyTimeout bounds one Raft proposal (default 10 s).
	ApplyTimeout time.Duration
	// RetryAfter is how long a schedule whose claim failed waits before
	// it is planned again (default 1 s).
	RetryAfter time.Duration
	Logger     *slog.Logger
	Metrics    *ScheduleMetrics
	// Tracer makes a span per run (nil: none).
	Tracer trace.Tracer
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// dispatcher is one leadership term's dispatcher.
type dispatcher struct {
	cfg    DispatcherConfig
	state  StateReader
	raft   Proposer
	invoke Invoker
	logger *slog.Logger
	sem    chan struct{} // places of the actions in flight
	claims chan struct{} // places of the runs claimed and not finished
	wg     sync.WaitGroup
	wake   chan struct{} // a worker finished

	mu      sync.Mutex
	entries map[string]*entry
	specs   map[[2]string]*Spec // parsed (cron, zone)
}

// entry is what the dispatcher knows of a schedule.
type entry struct {
	modify uint64 // the schedule's modify index when seen
	sched  *schedulev1.Schedule
	spec   *Spec
	next   time.Time
	// busy: a worker has the schedule's plan; nothing else plans it
	// until the worker is done, and its claims are in the state.
	busy bool
	// retryAt holds the schedule back after a failed claim.
	retryAt time.Time
	badSpec string // the parse error, logged once
}

// anchor is the instant after which the schedule's slots are open: its
// last claimed slot, or its last change (slots before an update or a
// resume are not caught up).
func anchor(s *schedulev1.Schedule) time.Time {
	a := s.GetUpdatedAt().AsTime()
	if ls := s.GetLastSlot(); ls != nil && ls.AsTime().After(a) {
		a = ls.AsTime()
	}
	return a
}

// Upcoming lists the first n slots later than now (and than its anchor)
// of schedule s, whose spec is spec: the slots the dispatcher runs, an
// "@every" schedule's on its own phase (its anchor's first slot plus
// whole intervals), not now plus the interval.
func Upcoming(spec *Spec, s *schedulev1.Schedule, now time.Time, n int) []time.Time {
	a := anchor(s)
	from := now
	if a.After(from) {
		from = a
	}
	var out []time.Time
	for t := spec.After(a, from); !t.IsZero() && len(out) < n; t = spec.After(a, t) {
		out = append(out, t)
	}
	return out
}

// RunDispatcher runs the power schedules until ctx ends (leadership lost):
// it computes each enabled schedule's next slot from its previous slot in
// its time zone, claims each slot through Raft before acting (the FSM
// refuses a slot at or before the last one, so no slot runs twice, across
// leaders too), applies the catch-up policy to slots a leader change left
// behind (recording what it skips), calls the action through invoke, and
// commits the outcome to the run history. One worker at a time handles a
// schedule, claiming its slots in order.
func RunDispatcher(ctx context.Context, cfg DispatcherConfig, state StateReader, raft Proposer, invoke Invoker) {
	if cfg.ActionTimeout <= 0 {
		cfg.ActionTimeout = 30 * time.Second
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 3
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 64
	}
	if cfg.MaxClaimed <= 0 {
		cfg.MaxClaimed = 1024
	}
	if cfg.ApplyTimeout <= 0 {
		cfg.ApplyTimeout = 10 * time.Second
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewScheduleMetrics(nil)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	d := &dispatcher{
		cfg: cfg, state: state, raft: raft, invoke: invoke,
		logger:  logger.With("component", "schedule-dispatcher"),
		sem:     make(chan struct{}, cfg.MaxConcurrent),
		claims:  make(chan struct{}, cfg.MaxClaimed),
		wake:    make(chan struct{}, 1),
		entries: make(map[string]*entry),
		specs:   make(map[[2]string]*Spec),
	}
	defer d.wg.Wait()
	d.closeOrphans(ctx)
	for ctx.Err() == nil {
		ws := memdb.NewWatchSet()
		_, scheds, err := state.State().Schedules(ws)
		if err != nil {
			d.logger.Error("reading schedules failed; retrying", "error", err)
			if !sleep(ctx, time.Second) {
				return
			}
			continue
		}
		now := d.cfg.Now()
		next := d.sync(scheds)
		if !next.IsZero() && !next.After(now) {
			d.dispatchDue(ctx, now)
			continue
		}
		wait := time.Hour
		if !next.IsZero() {
			wait = next.Sub(now)
		}
		t := time.NewTimer(wait)
		wctx, cancel := context.WithCancel(ctx)
		select {
		case <-ctx.Done():
		case <-ws.WatchCh(wctx):
		case <-d.wake:
		case <-t.C:
		}
		cancel()
		t.Stop()
	}
}

// spec parses (and caches) a schedule's expression.
func (d *dispatcher) spec(s *schedulev1.Schedule) (*Spec, error) {
	k := [2]string{s.GetCron(), s.GetTimeZone()}
	if sp, ok := d.specs[k]; ok {
		return sp, nil
	}
	sp, err := ParseSpec(s.GetCron(), s.GetTimeZone())
	if err == nil {
		d.specs[k] = sp
	}
	return sp, err
}

// sync brings the entries up to date with the schedules and returns the
// earliest time one needs planning. Only schedules that changed are
// computed again.
func (d *dispatcher) sync(scheds []*schedulev1.Schedule) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	seen := make(map[string]bool, len(scheds))
	var earliest time.Time
	for _, s := range scheds {
		seen[s.GetId()] = true
		e := d.entries[s.GetId()]
		if e == nil {
			e = &entry{}
			d.entries[s.GetId()] = e
		}
		if e.busy {
			continue // its worker says when it is done
		}
		if e.sched == nil || e.modify != s.GetModifyIndex() {
			e.modify, e.sched = s.GetModifyIndex(), s
			spec, err := d.spec(s)
			e.spec = spec
			if err != nil {
				if e.badSpec != err.Error() {
					d.logger.Error("schedule not run: its spec does not parse on this agent", "schedule", s.GetId(), "error", err)
				}
				e.badSpec = err.Error()
			}
			e.next = time.Time{}
			if e.spec != nil && s.GetEnabled() {
				e.next = e.spec.After(anchor(s), anchor(s))
			}
		}
		due := e.next
		if !due.IsZero() && e.retryAt.After(due) {
			due = e.retryAt
		}
		if !due.IsZero() && (earliest.IsZero() || due.Before(earliest)) {
			earliest = due
		}
	}
	for id, e := range d.entries {
		if !seen[id] && !e.busy {
			delete(d.entries, id)
		}
	}
	return earliest
}

// dispatchDue hands every schedule whose next slot has come (and is not
// held back) to a worker.
func (d *dispatcher) dispatchDue(ctx context.Context, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.entries {
		if e.busy || e.next.IsZero() || e.next.After(now) || e.retryAt.After(now) {
			continue
		}
		s, spec := e.sched, e.spec
		p := PlanSlots(spec, anchor(s), now, s.GetCatchUp(), s.GetCatchUpWindow().AsDuration(), d.cfg.Grace)
		if p.Last().IsZero() {
			// Nothing to do after all (the clock stepped back): look
			// again from now.
			e.next = spec.After(anchor(s), now)
			continue
		}
		e.busy = true
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			ok := d.execute(ctx, s, spec, p)
			d.mu.Lock()
			e.busy = false
			e.sched = nil // computed again from the state, which holds the claims
			if !ok {
				e.retryAt = d.cfg.Now().Add(d.cfg.RetryAfter)
			}
			d.mu.Unlock()
			select {
			case d.wake <- struct{}{}:
			default:
			}
		}()
	}
}

// current re-reads a schedule before a claim: a plan stops when the
// schedule was deleted, paused or changed since it was planned.
func (d *dispatcher) current(planned *schedulev1.Schedule) bool {
	s, err := d.state.State().Schedule(planned.GetId())
	return err == nil && s.GetEnabled() && s.GetUpdatedAt().AsTime().Equal(planned.GetUpdatedAt().AsTime())
}

// execute claims and runs a plan's slots in order; false when a claim
// failed in a way worth trying again soon.
func (d *dispatcher) execute(ctx context.Context, s *schedulev1.Schedule, spec *Spec, p Plan) bool {
	limit := int(s.GetHistoryLimit())
	if limit <= 0 {
		limit = int(fsm.DefaultConfig().MaxRunHistory)
	}
	skipped := p.Skipped
	if len(skipped) > 0 {
		d.count(s, "skipped", len(skipped))
		d.logger.Info("schedule slots skipped by the catch-up policy", "schedule", s.GetId(), "slots", len(skipped), "older_not_listed", p.MoreSkipped)
	}
	if len(p.Run) == 0 {
		// Nothing runs: the newest skipped slot is claimed and recorded
		// as skipped, the others with it.
		last := skipped[len(skipped)-1]
		if !d.current(s) {
			return true
		}
		if err := d.claim(ctx, s, last, newest(skipped[:len(skipped)-1], limit-1), reasonCatchUp); err != nil {
			return d.claimFailed(s, last, err)
		}
		d.record(ctx, &schedulev1.Run{ScheduleId: s.GetId(), Slot: timestamppb.New(last), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED,
			Error: reasonCatchUp, FinishedAt: timestamppb.New(d.cfg.Now())})
		return true
	}
	for i, slot := range p.Run {
		var sk []time.Time
		if i == 0 {
			sk = newest(skipped, limit-1)
		}
		// The claim takes a place among the runs claimed and not
		// finished, not among the actions in flight: the claims of the
		// slots due together commit together, and each action then waits
		// only for a place to act, not for the claims queued before it.
		select {
		case d.claims <- struct{}{}:
		case <-ctx.Done():
			return true
		}
		if !d.current(s) {
			<-d.claims
			return true
		}
		if err := d.claim(ctx, s, slot, sk, reasonCatchUp); err != nil {
			<-d.claims
			return d.claimFailed(s, slot, err)
		}
		select {
		case d.sem <- struct{}{}:
		case <-ctx.Done():
			// Leadership lost between the claim and the action: the run
			// stays STARTED and the next leader records that its outcome
			// is unknown (it is never repeated).
			<-d.claims
			return true
		}
		d.act(ctx, s, slot) // gives the action's place back
		<-d.claims
		if ctx.Err() != nil {
			return true
		}
	}
	if s.GetOverlap() != schedulev1.Overlap_OVERLAP_ALLOW {
		// Slots that came due while the last run was in flight are
		// skipped, with that reason.
		last := p.Run[len(p.Run)-1]
		over, more := lastSlots(spec, last, last, d.cfg.Now(), MaxListedSkips)
		if len(over) > 0 && d.current(s) {
			newestOver := over[len(over)-1]
			if err := d.claim(ctx, s, newestOver, newest(over[:len(over)-1], limit-1), reasonOverlap); err != nil {
				return d.claimFailed(s, newestOver, err)
			}
			d.record(ctx, &schedulev1.Run{ScheduleId: s.GetId(), Slot: timestamppb.New(newestOver), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED,
				Error: reasonOverlap, FinishedAt: timestamppb.New(d.cfg.Now())})
			d.count(s, "skipped", len(over))
			d.logger.Info("schedule slots skipped: the previous run was still in progress", "schedule", s.GetId(), "slots", len(over), "older_not_listed", more)
		}
	}
	return true
}

// newest is the last n of ts.
func newest(ts []time.Time, n int) []time.Time {
	if n <= 0 {
		return nil
	}
	return ts[max(0, len(ts)-n):]
}

func (d *dispatcher) count(s *schedulev1.Schedule, result string, n int) {
	d.cfg.Metrics.runs.WithLabelValues(ActionName(s.GetAction()), result).Add(float64(n))
}

// claimFailed logs a claim the FSM or Raft refused; false when the
// schedule should be planned again soon.
func (d *dispatcher) claimFailed(s *schedulev1.Schedule, slot time.Time, err error) bool {
	switch {
	case errors.Is(err, fsm.ErrSlotNotAfterLast):
		// One worker claims a schedule's slots, in order: the state holds
		// a newer slot (an earlier leader's), and the next plan starts
		// from it.
		d.logger.Info("slot claimed already by an earlier leader", "schedule", s.GetId(), "slot", slot)
		return true
	case errors.Is(err, fsm.ErrNotFound):
		d.logger.Info("schedule deleted before its slot ran", "schedule", s.GetId(), "slot", slot)
		return true
	default:
		d.logger.Warn("claiming a schedule slot failed; planning it again", "schedule", s.GetId(), "slot", slot, "error", err)
		return false
	}
}

// Why a slot is skipped: the error its run is recorded with.
const (
	reasonCatchUp = "missed: the catch-up policy skips it"
	reasonOverlap = "the previous run was still in progress (overlap forbid)"
)

// allows reports whether the cluster version of the state allows a
// feature.
func (d *dispatcher) allows(feature string) bool {
	v, _, err := d.state.State().ClusterVersion()
	return err == nil && v.Enabled(feature)
}

// claim commits (schedule, slot) through Raft, with the earlier slots it
// skips, recorded as skipped for reason.
func (d *dispatcher) claim(ctx context.Context, s *schedulev1.Schedule, slot time.Time, skipped []time.Time, reason string) error {
	op := &fsmv1.ClaimSlot{ScheduleId: s.GetId(), Slot: timestamppb.New(slot), Node: d.cfg.NodeID}
	if len(skipped) > 0 && d.allows(fsm.FeatureRunDetails) {
		op.SkipReason = reason
	}
	for _, t := range skipped {
		op.Skipped = append(op.Skipped, timestamppb.New(t))
	}
	return d.apply(ctx, &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: op}})
}

// record commits a run's outcome.
func (d *dispatcher) record(ctx context.Context, run *schedulev1.Run) {
	err := d.apply(ctx, &fsmv1.Command{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: run}}})
	if err != nil && !errors.Is(err, fsm.ErrNotFound) {
		d.logger.Warn("recording a schedule run failed", "schedule", run.GetScheduleId(), "slot", run.GetSlot().AsTime(), "error", err)
	}
}

func (d *dispatcher) apply(ctx context.Context, cmd *fsmv1.Command) error {
	cmd.Time = timestamppb.New(d.cfg.Now())
	data, err := fsm.Encode(cmd)
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.ApplyTimeout)
	defer cancel()
	resp, _, err := d.raft.Apply(ctx, data)
	if err != nil {
		return err
	}
	if r, ok := resp.(*fsm.Result); ok && r.Err != nil {
		return r.Err
	}
	return nil
}

// act runs a claimed slot's action and records the outcome. An attempt
// that found no backend endpoint (nothing was sent) is tried again within
// the action timeout; no other failure is, so an action never runs twice.
// The caller holds a place among the actions in flight (d.sem); act gives
// it back when the backend call is done, before the outcome is committed.
func (d *dispatcher) act(ctx context.Context, s *schedulev1.Schedule, slot time.Time) {
	held := true
	release := func() {
		if held {
			held = false
			<-d.sem
		}
	}
	defer release()
	if d.cfg.Tracer != nil {
		var span trace.Span
		ctx, span = d.cfg.Tracer.Start(ctx, "schedule.run", trace.WithAttributes(
			attribute.String("schedule.id", s.GetId()), attribute.String("schedule.action", ActionName(s.GetAction())),
			attribute.String("vm.id", s.GetVmId()), attribute.String("schedule.slot", slot.UTC().Format(time.RFC3339))))
		defer span.End()
	}
	started := d.cfg.Now()
	d.cfg.Metrics.lateness.Observe(started.Sub(slot).Seconds())
	actx, cancel := context.WithTimeout(ctx, d.cfg.ActionTimeout)
	defer cancel()
	method := actionMethods[s.GetAction()]
	var (
		err  error
		host string
	)
	attempts := 0
	for attempts < d.cfg.MaxAttempts {
		attempts++
		req, resp := actionRequest(s.GetAction(), s.GetVmId())
		host, err = d.invoke(actx, method, req, resp)
		if !errors.Is(err, ErrNoBackend) || actx.Err() != nil {
			break
		}
		if !sleep(actx, time.Duration(attempts)*200*time.Millisecond) {
			break
		}
	}
	release()
	if ctx.Err() != nil {
		// Leadership lost mid-action: the run stays STARTED; the next
		// leader records that its outcome is unknown.
		return
	}
	finished := d.cfg.Now()
	run := &schedulev1.Run{
		ScheduleId: s.GetId(), Slot: timestamppb.New(slot), Attempts: uint32(attempts),
		Latency: durationpb.New(finished.Sub(started)), FinishedAt: timestamppb.New(finished),
		Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK,
	}
	if d.allows(fsm.FeatureRunDetails) {
		run.Host = host
	}
	result := "ok"
	if err != nil {
		msg := err.Error()
		if st, ok := status.FromError(err); ok {
			msg = st.Message()
		}
		run.Outcome, run.Error, result = schedulev1.RunOutcome_RUN_OUTCOME_ERROR, msg, "error"
		d.logger.Warn("schedule action failed", "schedule", s.GetId(), "vm", s.GetVmId(), "action", ActionName(s.GetAction()), "slot", slot, "attempts", attempts, "error", err)
	} else {
		d.logger.Info("schedule action done", "schedule", s.GetId(), "vm", s.GetVmId(), "action", ActionName(s.GetAction()), "slot", slot, "lateness", started.Sub(slot), "latency", finished.Sub(started))
	}
	d.count(s, result, 1)
	d.record(context.WithoutCancel(ctx), run)
}

// closeOrphans records the runs an earlier leader claimed and never
// finished (it lost leadership or crashed mid-action) as errors whose
// outcome is unknown: the action may or may not have happened, and is not
// repeated.
func (d *dispatcher) closeOrphans(ctx context.Context) {
	st := d.state.State()
	_, scheds, err := st.Schedules(nil)
	if err != nil {
		return
	}
	for _, s := range scheds {
		runs, err := st.Runs(s.GetId())
		if err != nil {
			continue
		}
		for _, r := range runs {
			if r.GetOutcome() != schedulev1.RunOutcome_RUN_OUTCOME_STARTED {
				continue
			}
			d.record(ctx, &schedulev1.Run{
				ScheduleId: s.GetId(), Slot: r.GetSlot(), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_ERROR,
				Error:      fmt.Sprintf("outcome unknown: the leader running it (%s) was lost; the action may or may not have happened, and is not repeated", r.GetNode()),
				FinishedAt: timestamppb.New(d.cfg.Now()),
			})
			d.count(s, "error", 1)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
