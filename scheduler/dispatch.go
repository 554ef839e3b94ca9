package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
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
// health checks, ejection and load balancing apply.
type Invoker func(ctx context.Context, method string, req, resp proto.Message) error

// The VM API methods of the actions.
var actionMethods = map[schedulev1.Action]string{
	schedulev1.Action_ACTION_POWER_ON:  "/pivirt.vm.v1.VMService/PowerOn",
	schedulev1.Action_ACTION_POWER_OFF: "/pivirt.vm.v1.VMService/ShutdownDefault",
	schedulev1.Action_ACTION_REBOOT:    "/pivirt.vm.v1.VMService/Reboot",
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

// DispatcherConfig configures RunDispatcher.
type DispatcherConfig struct {
	// NodeID is recorded in each run: which node ran it.
	NodeID string
	// ActionTimeout bounds an action, its attempts included (default 30 s).
	ActionTimeout time.Duration
	// MaxAttempts of an action whose backend was unavailable (default 3).
	MaxAttempts int
	// MaxConcurrent bounds the actions in flight (default 64).
	MaxConcurrent int
	// Grace: a slot found later than this is missed (DefaultGrace).
	Grace time.Duration
	// ApplyTimeout bounds one Raft proposal (default 10 s).
	ApplyTimeout time.Duration
	Logger       *slog.Logger
	Metrics      *ScheduleMetrics
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
	sem    chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	entries map[string]*entry
}

// entry is what the dispatcher knows of a schedule.
type entry struct {
	modify uint64 // the schedule's modify index when seen
	sched  *schedulev1.Schedule
	spec   *Spec
	// dispatched is the newest slot handed to a run (claims may still be
	// in flight): never planned again.
	dispatched time.Time
	running    int
	next       time.Time
	badSpec    string // the parse error, logged once
}

// anchor is the instant after which the schedule's slots are still open:
// its last claimed slot, its last change (slots before an update or a
// resume are not caught up), or a slot already handed out.
func (e *entry) anchor() time.Time {
	a := e.sched.GetUpdatedAt().AsTime()
	if ls := e.sched.GetLastSlot(); ls != nil && ls.AsTime().After(a) {
		a = ls.AsTime()
	}
	if e.dispatched.After(a) {
		a = e.dispatched
	}
	return a
}

// RunDispatcher runs the power schedules until ctx ends (leadership lost):
// it computes each enabled schedule's next slot from its previous slot in
// its time zone, claims each slot through Raft before acting (the FSM
// refuses a slot at or before the last one, so no slot runs twice, across
// leaders too), applies the catch-up policy to slots a leader change left
// behind (recording what it skips), calls the action through invoke, and
// commits the outcome to the run history.
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
	if cfg.ApplyTimeout <= 0 {
		cfg.ApplyTimeout = 10 * time.Second
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
		entries: make(map[string]*entry),
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
		next := d.sync(scheds)
		now := d.cfg.Now()
		if !next.IsZero() && !next.After(now) {
			d.dispatchDue(ctx, now)
			continue
		}
		wait := time.Hour
		if !next.IsZero() {
			wait = next.Sub(now)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-ws.WatchCh(ctx):
		case <-t.C:
		}
		t.Stop()
	}
}

// sync brings the entries up to date with the schedules and returns the
// earliest next slot.
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
		if e.sched == nil || e.modify != s.GetModifyIndex() {
			e.modify, e.sched = s.GetModifyIndex(), s
			spec, err := ParseSpec(s.GetCron(), s.GetTimeZone())
			e.spec = spec
			if err != nil {
				if e.badSpec != err.Error() {
					d.logger.Error("schedule not run: its spec does not parse", "schedule", s.GetId(), "error", err)
				}
				e.badSpec = err.Error()
			}
		}
		e.next = time.Time{}
		if e.spec != nil && s.GetEnabled() {
			e.next = e.spec.Next(e.anchor())
		}
		if !e.next.IsZero() && (earliest.IsZero() || e.next.Before(earliest)) {
			earliest = e.next
		}
	}
	for id, e := range d.entries {
		if !seen[id] && e.running == 0 {
			delete(d.entries, id)
		}
	}
	return earliest
}

// dispatchDue plans every schedule whose next slot has come and hands its
// runs to a goroutine each.
func (d *dispatcher) dispatchDue(ctx context.Context, now time.Time) {
	d.mu.Lock()
	type job struct {
		e       *entry
		plan    Plan
		overlap bool
	}
	var jobs []job
	for _, e := range d.entries {
		if e.next.IsZero() || e.next.After(now) {
			continue
		}
		s := e.sched
		p := PlanSlots(e.spec, e.anchor(), now, s.GetCatchUp(), s.GetCatchUpWindow().AsDuration(), d.cfg.Grace)
		if p.Last().IsZero() {
			continue
		}
		overlap := false
		if e.running > 0 && s.GetOverlap() != schedulev1.Overlap_OVERLAP_ALLOW && len(p.Run) > 0 {
			// The previous run is still in flight: these slots are skipped.
			p.Skipped = append(p.Skipped, p.Run...)
			slices.SortFunc(p.Skipped, func(a, b time.Time) int { return a.Compare(b) })
			p.Run = nil
			overlap = true
		}
		e.dispatched = p.Last()
		e.next = time.Time{}
		if len(p.Run) > 0 {
			e.running++
		}
		jobs = append(jobs, job{e, p, overlap})
	}
	d.mu.Unlock()
	for _, j := range jobs {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.execute(ctx, j.e, j.plan, j.overlap)
		}()
	}
}

// execute claims and runs a plan's slots in order.
func (d *dispatcher) execute(ctx context.Context, e *entry, p Plan, overlap bool) {
	s := e.sched
	if len(p.Run) > 0 {
		defer func() {
			d.mu.Lock()
			e.running--
			d.mu.Unlock()
		}()
	}
	limit := int(s.GetHistoryLimit())
	if limit <= 0 {
		limit = int(fsm.DefaultConfig().MaxRunHistory)
	}
	skipped := p.Skipped
	if len(p.Run) == 0 {
		// Nothing runs: the newest skipped slot is claimed and recorded
		// as skipped, the others with it.
		last := skipped[len(skipped)-1]
		if err := d.claim(ctx, s, last, newest(skipped[:len(skipped)-1], limit-1)); err != nil {
			d.claimFailed(s, last, err)
			return
		}
		reason := "missed: the catch-up policy skips it"
		if overlap {
			reason = "the previous run is still in progress (overlap forbid)"
		}
		d.record(ctx, &schedulev1.Run{ScheduleId: s.GetId(), Slot: timestamppb.New(last), Outcome: schedulev1.RunOutcome_RUN_OUTCOME_SKIPPED, Error: reason, FinishedAt: timestamppb.New(d.cfg.Now())})
		d.count(s, "skipped", len(skipped))
		d.logger.Info("schedule slots skipped", "schedule", s.GetId(), "slots", len(skipped), "newest", last, "reason", reason, "more_not_listed", p.Dropped)
		return
	}
	if len(skipped) > 0 {
		d.count(s, "skipped", len(skipped))
		d.logger.Info("schedule slots skipped by the catch-up policy", "schedule", s.GetId(), "slots", len(skipped), "more_not_listed", p.Dropped)
	}
	for i, slot := range p.Run {
		var sk []time.Time
		if i == 0 {
			sk = newest(skipped, limit-1)
		}
		if err := d.claim(ctx, s, slot, sk); err != nil {
			d.claimFailed(s, slot, err)
			return
		}
		d.act(ctx, s, slot)
	}
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

// claimFailed logs a claim the FSM or Raft refused.
func (d *dispatcher) claimFailed(s *schedulev1.Schedule, slot time.Time, err error) {
	switch {
	case errors.Is(err, fsm.ErrSlotNotAfterLast):
		// Claimed already (by an earlier leader, or a concurrent plan):
		// it ran, or was skipped, once.
		d.logger.Debug("slot claimed already", "schedule", s.GetId(), "slot", slot)
	case errors.Is(err, fsm.ErrNotFound):
		d.logger.Info("schedule deleted before its slot ran", "schedule", s.GetId(), "slot", slot)
	default:
		d.logger.Warn("claiming a schedule slot failed; the next leader catches it up", "schedule", s.GetId(), "slot", slot, "error", err)
	}
}

// claim commits (schedule, slot) through Raft.
func (d *dispatcher) claim(ctx context.Context, s *schedulev1.Schedule, slot time.Time, skipped []time.Time) error {
	op := &fsmv1.ClaimSlot{ScheduleId: s.GetId(), Slot: timestamppb.New(slot), Node: d.cfg.NodeID}
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

// act runs a claimed slot's action and records the outcome. Attempts
// whose backend was unavailable (the call reached no endpoint) are tried
// again within the action timeout.
func (d *dispatcher) act(ctx context.Context, s *schedulev1.Schedule, slot time.Time) {
	select {
	case d.sem <- struct{}{}:
	case <-ctx.Done():
		return
	}
	defer func() { <-d.sem }()
	started := d.cfg.Now()
	d.cfg.Metrics.lateness.Observe(started.Sub(slot).Seconds())
	actx, cancel := context.WithTimeout(ctx, d.cfg.ActionTimeout)
	defer cancel()
	method := actionMethods[s.GetAction()]
	var err error
	attempts := 0
	for attempts < d.cfg.MaxAttempts {
		attempts++
		req, resp := actionRequest(s.GetAction(), s.GetVmId())
		err = d.invoke(actx, method, req, resp)
		if status.Code(err) != codes.Unavailable || actx.Err() != nil {
			break
		}
		if !sleep(actx, time.Duration(attempts)*200*time.Millisecond) {
			break
		}
	}
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
	result := "ok"
	if err != nil {
		run.Outcome, run.Error, result = schedulev1.RunOutcome_RUN_OUTCOME_ERROR, status.Convert(err).Message(), "error"
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
