package gateway

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/go-memdb"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
	"pilab.hu/pivirt-agent/scheduler"
)

// Schedule limits.
const (
	MaxHistoryLimit = 1000
	MaxNextSlots    = 100
)

// ScheduleService serves the power schedules: writes run on the leader
// (forwarded to its internal port from other nodes). GetSchedule,
// ListSchedules and ListRuns take ReadOptions like the cluster's other
// reads (readVia: default on the leader, consistent, stale, blocking
// queries); without them they are linearizable (a read index from the
// leader, then the local state), as are the reads of NextSlots and of
// updates.
type ScheduleService struct {
	h *ClusterService
	// remote is the ScheduleService of an agent's internal port.
	remote func(internalAddr string) schedulev1.ScheduleServiceClient
	// authorize, when set, checks that the caller may itself make the
	// call a schedule's action makes (VMService PowerOn for power-on,
	// ShutdownDefault and Reboot for the others) on its VM: a schedule
	// is not a way around RBAC.
	authorize func(ctx context.Context, procedure string, req proto.Message) error
	// vmExists, when set, checks that a schedule's VM exists (on any
	// node) before the schedule is written.
	vmExists func(ctx context.Context, vmID string) error
}

// SetVMCheck sets the check that a schedule's VM exists (the API port's
// instance). check returns a Connect error: NotFound when no node holds
// the VM.
func (s *ScheduleService) SetVMCheck(check func(ctx context.Context, vmID string) error) {
	s.vmExists = check
}

// checkVM refuses a schedule for a VM that does not exist.
func (s *ScheduleService) checkVM(ctx context.Context, vmID string) error {
	if s.vmExists == nil {
		return nil
	}
	err := s.vmExists(ctx, vmID)
	if connect.CodeOf(err) == connect.CodeNotFound {
		return toConnect(invalid("schedule.vm_id", "%q: no node holds this VM (pvcli vm list shows the VMs of every node)", vmID))
	}
	return err
}

// SetAuthorize sets the check of the VM calls a schedule will make (the
// API port's instance; the internal port's takes forwarded writes
// already checked).
func (s *ScheduleService) SetAuthorize(f func(ctx context.Context, procedure string, req proto.Message) error) {
	s.authorize = f
}

// authorizeVM checks the caller against the schedule's action on its VM.
func (s *ScheduleService) authorizeVM(ctx context.Context, sc *schedulev1.Schedule) error {
	if s.authorize == nil {
		return nil
	}
	procedure, req := scheduler.ActionCall(sc.GetAction(), sc.GetVmId())
	return s.authorize(ctx, procedure, req)
}

var _ schedulev1connect.ScheduleServiceHandler = (*ScheduleService)(nil)

// NewScheduleService serves schedules next to h (the API port's cluster
// service, or the internal port's leader-only one).
func NewScheduleService(h *ClusterService, remote func(internalAddr string) schedulev1.ScheduleServiceClient) *ScheduleService {
	return &ScheduleService{h: h, remote: remote}
}

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`)

// validateSchedule checks what a client may set, each problem naming its
// field (under prefix).
func validateSchedule(s *schedulev1.Schedule, prefix string) error {
	if s == nil {
		return invalid(prefix, "is required")
	}
	if s.GetId() != "" && !idPattern.MatchString(s.GetId()) {
		return invalid(prefix+".id", "%q: 1-128 letters, digits, '.', '_', ':' or '-'", s.GetId())
	}
	if !idPattern.MatchString(s.GetVmId()) {
		return invalid(prefix+".vm_id", "%q: the ID of a VM is required", s.GetVmId())
	}
	if _, ok := schedulev1.Action_name[int32(s.GetAction())]; !ok || s.GetAction() == schedulev1.Action_ACTION_UNSPECIFIED {
		return invalid(prefix+".action", "required: power-on, power-off or reboot (ACTION_POWER_ON, ACTION_POWER_OFF, ACTION_REBOOT)")
	}
	if _, err := scheduler.ParseSpec("@hourly", s.GetTimeZone()); err != nil {
		return invalid(prefix+".time_zone", "%q is not an IANA time zone such as Europe/Budapest", s.GetTimeZone())
	}
	if _, err := scheduler.ParseSpec(s.GetCron(), s.GetTimeZone()); err != nil {
		return invalid(prefix+".cron", "%s", strings.TrimPrefix(err.Error(), scheduler.ErrInvalidSpec.Error()+": "))
	}
	if _, ok := schedulev1.CatchUp_name[int32(s.GetCatchUp())]; !ok {
		return invalid(prefix+".catch_up", "%d: skip, latest_once or all", s.GetCatchUp())
	}
	if _, ok := schedulev1.Overlap_name[int32(s.GetOverlap())]; !ok {
		return invalid(prefix+".overlap", "%d: forbid or allow", s.GetOverlap())
	}
	if w := s.GetCatchUpWindow(); w != nil {
		if err := w.CheckValid(); err != nil || w.AsDuration() < 0 || w.AsDuration() > scheduler.MaxCatchUpWindow {
			return invalid(prefix+".catch_up_window", "%s: between 0 (the default, %s) and %s", w.AsDuration(), scheduler.DefaultCatchUpWindow, scheduler.MaxCatchUpWindow)
		}
	}
	if s.GetHistoryLimit() > MaxHistoryLimit {
		return invalid(prefix+".history_limit", "%d: at most %d (0: the default)", s.GetHistoryLimit(), MaxHistoryLimit)
	}
	return nil
}

// clientFields keeps the fields a client may set.
func clientFields(s *schedulev1.Schedule) *schedulev1.Schedule {
	return &schedulev1.Schedule{
		Id: s.GetId(), VmId: s.GetVmId(), Action: s.GetAction(), Cron: strings.TrimSpace(s.GetCron()), TimeZone: s.GetTimeZone(),
		Enabled: s.GetEnabled(), CatchUp: s.GetCatchUp(), CatchUpWindow: s.GetCatchUpWindow(), Overlap: s.GetOverlap(),
		HistoryLimit: s.GetHistoryLimit(),
	}
}

// onLeaderSchedules runs local on the leader, or the call on the leader's
// internal port.
func onLeaderSchedules[Req, Res any](ctx context.Context, s *ScheduleService, req *connect.Request[Req],
	call func(schedulev1.ScheduleServiceClient) func(context.Context, *Req, ...grpc.CallOption) (*Res, error),
	local func(context.Context) (*Res, error),
) (*connect.Response[Res], error) {
	return viaLeader(ctx, s.h, func(ctx context.Context) (*connect.Response[Res], error) {
		res, err := local(ctx)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(res), nil
	}, func(ctx context.Context, addr string) (*connect.Response[Res], error) {
		resp, err := cluster.CallGRPC(ctx, forwardRequest(req), call(s.remote(addr)))
		if err != nil {
			return nil, err
		}
		return cleanResponse(resp), nil
	})
}

// put proposes a schedule; cas is the modify index it must have (0: must
// not exist).
func (s *ScheduleService) put(ctx context.Context, w *clusterv1.WriteOptions, sc *schedulev1.Schedule, cas uint64) (*schedulev1.Schedule, error) {
	res, err := s.h.propose(ctx, w, &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: sc, CasRevision: &cas}}})
	if err != nil {
		return nil, err
	}
	return written(res, func() (*schedulev1.Schedule, error) { return s.h.state.State().Schedule(sc.GetId()) },
		(*schedulev1.Schedule).GetModifyIndex), nil
}

// CreateSchedule implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) CreateSchedule(ctx context.Context, req *connect.Request[schedulev1.CreateScheduleRequest]) (*connect.Response[schedulev1.CreateScheduleResponse], error) {
	if err := validateSchedule(req.Msg.GetSchedule(), "schedule"); err != nil {
		return nil, toConnect(err)
	}
	if err := s.h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	// The ID follows from the write's identity, so that a retry of the
	// same write (through any node) names the same schedule.
	if req.Msg.Schedule.GetId() == "" {
		sum := sha256.Sum256(fmt.Appendf(nil, "%s/%d", req.Msg.GetWrite().GetClientId(), req.Msg.GetWrite().GetSequence()))
		req.Msg.Schedule.Id = "sched-" + hex.EncodeToString(sum[:6])
	}
	if err := s.authorizeVM(ctx, req.Msg.GetSchedule()); err != nil {
		return nil, err
	}
	if err := s.checkVM(ctx, req.Msg.GetSchedule().GetVmId()); err != nil {
		return nil, err
	}
	return onLeaderSchedules(ctx, s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.CreateScheduleRequest, ...grpc.CallOption) (*schedulev1.CreateScheduleResponse, error) {
		return c.CreateSchedule
	}, func(ctx context.Context) (*schedulev1.CreateScheduleResponse, error) {
		out, err := s.put(ctx, req.Msg.GetWrite(), clientFields(req.Msg.GetSchedule()), 0)
		if errors.Is(err, fsm.ErrCASConflict) {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("schedule %q exists", req.Msg.GetSchedule().GetId()))
		}
		if err != nil {
			return nil, err
		}
		return &schedulev1.CreateScheduleResponse{Schedule: out}, nil
	})
}

// updatable are the fields of an update mask.
var updatable = []string{"vm_id", "action", "cron", "time_zone", "enabled", "catch_up", "catch_up_window", "overlap", "history_limit"}

// maxModifyAttempts bounds the proposals of one update that lose to slot
// claims.
const maxModifyAttempts = 10

// modify runs an update of schedule id on the leader: change applies to a
// copy of the stored schedule, which is checked and proposed if the
// schedule did not change meanwhile (expected, when given; otherwise the
// version read). Without expected, a proposal that loses to a slot claim
// (a claim moves the schedule's revision) is made again on the new
// version, each attempt under an identity of its own derived from the
// write's (modifyAttempt): the FSM keeps the outcome of each, the conflict
// included, so a retry of the same request walks those outcomes and
// answers as the attempt that settled the update. An update the leader
// refuses itself (no such schedule, not the expected revision) is
// recorded as refused under the attempt's identity, so that a retry gets
// that answer too instead of updating a schedule created since.
func (s *ScheduleService) modify(ctx context.Context, w *clusterv1.WriteOptions, id string, expected *uint64, change func(*schedulev1.Schedule) error) (*schedulev1.Schedule, error) {
	// The update is rebuilt from the state, and a refusal is kept for
	// every retry: read a state that holds every write committed before
	// this call — a retry's earlier attempt included, which a new leader
	// before its barrier, or another agent's mirror in etcd mode, may not
	// have applied yet (rebuilt from an older state, the retry would be a
	// different write under the same identity).
	if err := s.barrier(ctx); err != nil {
		return nil, err
	}
	for attempt := 0; attempt < maxModifyAttempts; {
		wa := modifyAttempt(w, attempt)
		st := s.h.state.State()
		done, err := st.WriteOutcome(wa.GetClientId(), wa.GetSequence())
		if err != nil {
			return nil, err
		}
		if done == nil {
			cur, err := st.Schedule(id)
			var refusal error
			switch {
			case errors.Is(err, fsm.ErrNotFound):
				refusal = err
			case err != nil:
				return nil, err
			case expected != nil && *expected != cur.GetModifyIndex():
				refusal = fmt.Errorf("%w: schedule %q: expected revision %d, current %d", fsm.ErrCASConflict, id, *expected, cur.GetModifyIndex())
			}
			if refusal == nil {
				next := clientFields(cur)
				if err := change(next); err != nil {
					return nil, err
				}
				if err := validateSchedule(next, "schedule"); err != nil {
					return nil, err
				}
				out, err := s.put(ctx, wa, next, cur.GetModifyIndex())
				if errors.Is(err, fsm.ErrCASConflict) && expected == nil {
					attempt++
					continue // a run claimed a slot in between
				}
				return out, err
			}
			if done, err = s.refuse(ctx, wa, refusal); err != nil {
				return nil, err
			}
		}
		// The attempt's outcome: recorded before, or the refusal's (which
		// is the write's own when the write was applied meanwhile).
		if done.Err == nil {
			return written(done, func() (*schedulev1.Schedule, error) { return s.h.state.State().Schedule(id) },
				(*schedulev1.Schedule).GetModifyIndex), nil
		}
		if errors.Is(done.Err, fsm.ErrCASConflict) && expected == nil {
			attempt++
			continue // this attempt lost to a claim; the next one tells
		}
		return nil, done.Err
	}
	return nil, fmt.Errorf("%w: schedule %q: slots were claimed during each of %d attempts to update it", fsm.ErrCASConflict, id, maxModifyAttempts)
}

// refuse records, through Raft, that the leader refused the write w with
// outcome (fsm RefuseWrite), and returns the recorded outcome: the
// refusal, or, when w was applied in the meantime, w's own.
func (s *ScheduleService) refuse(ctx context.Context, w *clusterv1.WriteOptions, outcome error) (*fsm.Result, error) {
	if s.h.require(fsm.FeatureRefuseWrite, "recording a refusal") != nil {
		// The agents that predate refuse_write answer the refusal
		// without recording it.
		return &fsm.Result{Err: outcome}, nil
	}
	res, err := s.h.propose(ctx, w, &fsmv1.Command{Op: &fsmv1.Command_RefuseWrite{RefuseWrite: &fsmv1.RefuseWrite{
		ErrorCode: fsm.ErrorCode(outcome), ErrorMessage: outcome.Error(),
	}}})
	if res == nil {
		return nil, err
	}
	return res, nil
}

// modifyAttempt is the identity of attempt n of an update written as w:
// w itself first, then w's client ID with "/cas<n>" and w's sequence.
func modifyAttempt(w *clusterv1.WriteOptions, n int) *clusterv1.WriteOptions {
	if n == 0 {
		return w
	}
	return &clusterv1.WriteOptions{ClientId: fmt.Sprintf("%s/cas%d", w.GetClientId(), n), Sequence: w.GetSequence()}
}

// UpdateSchedule implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) UpdateSchedule(ctx context.Context, req *connect.Request[schedulev1.UpdateScheduleRequest]) (*connect.Response[schedulev1.UpdateScheduleResponse], error) {
	in := req.Msg.GetSchedule()
	if !idPattern.MatchString(in.GetId()) {
		return nil, toConnect(invalid("schedule.id", "%q: the ID of a schedule is required", in.GetId()))
	}
	paths := req.Msg.GetUpdateMask().GetPaths()
	for i, p := range paths {
		if !slices.Contains(updatable, p) {
			return nil, toConnect(invalid(fmt.Sprintf("update_mask.paths[%d]", i), "%q is not updatable (%s)", p, strings.Join(updatable, ", ")))
		}
	}
	if len(paths) == 0 {
		if err := validateSchedule(in, "schedule"); err != nil {
			return nil, toConnect(err)
		}
	}
	if err := s.h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	if s.authorize != nil && (len(paths) == 0 || slices.Contains(paths, "vm_id") || slices.Contains(paths, "action")) {
		// The schedule as the update leaves it must not act beyond the
		// caller's rights on the VM.
		cur, err := s.read(ctx, in.GetId(), "schedule.id")
		if err != nil {
			return nil, err
		}
		after := proto.CloneOf(cur)
		if len(paths) == 0 || slices.Contains(paths, "vm_id") {
			after.VmId = in.GetVmId()
		}
		if len(paths) == 0 || slices.Contains(paths, "action") {
			after.Action = in.GetAction()
		}
		if err := s.authorizeVM(ctx, after); err != nil {
			return nil, err
		}
	}
	if len(paths) == 0 || slices.Contains(paths, "vm_id") {
		if err := s.checkVM(ctx, in.GetVmId()); err != nil {
			return nil, err
		}
	}
	return onLeaderSchedules(ctx, s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.UpdateScheduleRequest, ...grpc.CallOption) (*schedulev1.UpdateScheduleResponse, error) {
		return c.UpdateSchedule
	}, func(ctx context.Context) (*schedulev1.UpdateScheduleResponse, error) {
		out, err := s.modify(ctx, req.Msg.GetWrite(), in.GetId(), req.Msg.ExpectedRevision, func(next *schedulev1.Schedule) error {
			if len(paths) == 0 {
				id := next.GetId()
				proto.Reset(next)
				proto.Merge(next, clientFields(in))
				next.Id = id
				return nil
			}
			src, dst := in.ProtoReflect(), next.ProtoReflect()
			for _, p := range paths {
				fd := dst.Descriptor().Fields().ByName(protoreflect.Name(p))
				if src.Has(fd) {
					dst.Set(fd, src.Get(fd))
				} else {
					dst.Clear(fd)
				}
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		return &schedulev1.UpdateScheduleResponse{Schedule: out}, nil
	})
}

// PauseSchedule implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) PauseSchedule(ctx context.Context, req *connect.Request[schedulev1.PauseScheduleRequest]) (*connect.Response[schedulev1.PauseScheduleResponse], error) {
	out, err := s.setEnabled(ctx, req.Msg.GetId(), &req.Msg.Write, false, func(c schedulev1.ScheduleServiceClient, ctx context.Context) (*schedulev1.Schedule, error) {
		r, err := cluster.CallGRPC(ctx, forwardRequest(req), c.PauseSchedule)
		if err != nil {
			return nil, err
		}
		return r.Msg.GetSchedule(), nil
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&schedulev1.PauseScheduleResponse{Schedule: out}), nil
}

// ResumeSchedule implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) ResumeSchedule(ctx context.Context, req *connect.Request[schedulev1.ResumeScheduleRequest]) (*connect.Response[schedulev1.ResumeScheduleResponse], error) {
	out, err := s.setEnabled(ctx, req.Msg.GetId(), &req.Msg.Write, true, func(c schedulev1.ScheduleServiceClient, ctx context.Context) (*schedulev1.Schedule, error) {
		r, err := cluster.CallGRPC(ctx, forwardRequest(req), c.ResumeSchedule)
		if err != nil {
			return nil, err
		}
		return r.Msg.GetSchedule(), nil
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&schedulev1.ResumeScheduleResponse{Schedule: out}), nil
}

func (s *ScheduleService) setEnabled(ctx context.Context, id string, w **clusterv1.WriteOptions, enabled bool, remote func(schedulev1.ScheduleServiceClient, context.Context) (*schedulev1.Schedule, error)) (*schedulev1.Schedule, error) {
	if !idPattern.MatchString(id) {
		return nil, toConnect(invalid("id", "%q: the ID of a schedule is required", id))
	}
	if err := s.h.fillWrite(w); err != nil {
		return nil, toConnect(err)
	}
	return viaLeader(ctx, s.h, func(ctx context.Context) (*schedulev1.Schedule, error) {
		return s.modify(ctx, *w, id, nil, func(next *schedulev1.Schedule) error {
			next.Enabled = enabled
			return nil
		})
	}, func(ctx context.Context, addr string) (*schedulev1.Schedule, error) {
		return remote(s.remote(addr), ctx)
	})
}

// DeleteSchedule implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) DeleteSchedule(ctx context.Context, req *connect.Request[schedulev1.DeleteScheduleRequest]) (*connect.Response[schedulev1.DeleteScheduleResponse], error) {
	if !idPattern.MatchString(req.Msg.GetId()) {
		return nil, toConnect(invalid("id", "%q: the ID of a schedule is required", req.Msg.GetId()))
	}
	if err := s.h.fillWrite(&req.Msg.Write); err != nil {
		return nil, toConnect(err)
	}
	return onLeaderSchedules(ctx, s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.DeleteScheduleRequest, ...grpc.CallOption) (*schedulev1.DeleteScheduleResponse, error) {
		return c.DeleteSchedule
	}, func(ctx context.Context) (*schedulev1.DeleteScheduleResponse, error) {
		if _, err := s.h.propose(ctx, req.Msg.GetWrite(), &fsmv1.Command{Op: &fsmv1.Command_DeleteSchedule{DeleteSchedule: &fsmv1.DeleteSchedule{Id: req.Msg.GetId()}}}); err != nil {
			return nil, err
		}
		return &schedulev1.DeleteScheduleResponse{}, nil
	})
}

// barrier makes the local state at least as new as what the leader had
// committed when it was called (a linearizable read follows).
func (s *ScheduleService) barrier(ctx context.Context) error {
	_, err := viaLeader(ctx, s.h, func(ctx context.Context) (struct{}, error) {
		if !s.h.leaderReady() {
			return struct{}{}, s.h.notReady()
		}
		idx, err := s.h.raft.ReadIndex(ctx)
		if err != nil {
			return struct{}{}, err
		}
		return struct{}{}, s.h.waitReadIndex(ctx, idx)
	}, func(ctx context.Context, addr string) (struct{}, error) {
		idx, err := s.h.readIndex.readIndex(ctx, addr)
		if err != nil {
			return struct{}{}, err
		}
		return struct{}{}, toConnect(s.h.waitReadIndex(ctx, idx))
	})
	return err
}

// scheduleReadOptions are the read options of a schedule read: a request
// without any is read consistently, as schedule reads always were (a read
// index from the leader, then the local state); with them it is read like
// every other read of the cluster (readMode), a blocking query included.
func scheduleReadOptions(ro *clusterv1.ReadOptions) *clusterv1.ReadOptions {
	if ro == nil {
		return &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}
	}
	return ro
}

// forwardSchedules sends a read to the ScheduleService of the leader's
// internal port (readVia's forward).
func forwardSchedules[Req, Res any](s *ScheduleService, req *connect.Request[Req],
	call func(schedulev1.ScheduleServiceClient) func(context.Context, *Req, ...grpc.CallOption) (*Res, error),
) func(ctx context.Context, internalAddr string) (*connect.Response[Res], error) {
	return func(ctx context.Context, addr string) (*connect.Response[Res], error) {
		resp, err := cluster.CallGRPC(ctx, forwardRequest(req), call(s.remote(addr)))
		if err != nil {
			return nil, err
		}
		return cleanResponse(resp), nil
	}
}

// runsIndex is the blockIndex of a schedule's runs (fsm.State.WatchRuns):
// a blocking ListRuns wakes for changes to that schedule and its runs
// only. The index is built from replicated records, so the answer carries
// it as it is: a wait index from any node compares right.
func runsIndex(scheduleID string) blockIndex {
	return func(st *fsm.State, ws memdb.WatchSet) (uint64, error) { return st.WatchRuns(ws, scheduleID) }
}

// GetSchedule implements schedulev1connect.ScheduleServiceHandler. A
// blocking query waits for the schedules index.
func (s *ScheduleService) GetSchedule(ctx context.Context, req *connect.Request[schedulev1.GetScheduleRequest]) (*connect.Response[schedulev1.GetScheduleResponse], error) {
	id := req.Msg.GetId()
	if !idPattern.MatchString(id) {
		return nil, toConnect(invalid("id", "%q: the ID of a schedule is required", id))
	}
	return readVia(ctx, s.h, scheduleReadOptions(req.Msg.GetRead()), forwardSchedules(s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.GetScheduleRequest, ...grpc.CallOption) (*schedulev1.GetScheduleResponse, error) {
		return c.GetSchedule
	}), tablesIndex(fsm.TableSchedules), func(ctx context.Context) (*schedulev1.GetScheduleResponse, uint64, error) {
		st := s.h.state.State()
		sc, err := st.Schedule(id)
		if err != nil {
			return nil, 0, err // names the schedule
		}
		index := max(st.Index(fsm.TableSchedules), 1)
		return &schedulev1.GetScheduleResponse{Schedule: sc, Meta: s.h.queryMeta(index)}, index, nil
	})
}

// read returns schedule id as the leader had it when read was called.
func (s *ScheduleService) read(ctx context.Context, id, field string) (*schedulev1.Schedule, error) {
	if !idPattern.MatchString(id) {
		return nil, toConnect(invalid(field, "%q: the ID of a schedule is required", id))
	}
	if err := s.barrier(ctx); err != nil {
		return nil, toConnect(err)
	}
	sc, err := s.h.state.State().Schedule(id)
	return sc, toConnect(err)
}

// ListSchedules implements schedulev1connect.ScheduleServiceHandler. A
// blocking query waits for the schedules index (with vm_id too: a
// schedule's VM may change).
func (s *ScheduleService) ListSchedules(ctx context.Context, req *connect.Request[schedulev1.ListSchedulesRequest]) (*connect.Response[schedulev1.ListSchedulesResponse], error) {
	vm := req.Msg.GetVmId()
	if vm != "" && !idPattern.MatchString(vm) {
		return nil, toConnect(invalid("vm_id", "%q is not a VM ID", vm))
	}
	return readVia(ctx, s.h, scheduleReadOptions(req.Msg.GetRead()), forwardSchedules(s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.ListSchedulesRequest, ...grpc.CallOption) (*schedulev1.ListSchedulesResponse, error) {
		return c.ListSchedules
	}), tablesIndex(fsm.TableSchedules), func(ctx context.Context) (*schedulev1.ListSchedulesResponse, uint64, error) {
		var (
			index uint64
			list  []*schedulev1.Schedule
			err   error
		)
		if vm != "" {
			index, list, err = s.h.state.State().SchedulesByVM(vm, nil)
		} else {
			index, list, err = s.h.state.State().Schedules(nil)
		}
		if err != nil {
			return nil, 0, err
		}
		// Never 0, which would make a watcher's next query answer at once
		// (wait_index 0 does not block) until the first schedule.
		index = max(index, 1)
		return &schedulev1.ListSchedulesResponse{Schedules: list, Meta: s.h.queryMeta(index)}, index, nil
	})
}

// ListRuns implements schedulev1connect.ScheduleServiceHandler. A blocking
// query waits for the index of the schedule's runs (runsIndex).
func (s *ScheduleService) ListRuns(ctx context.Context, req *connect.Request[schedulev1.ListRunsRequest]) (*connect.Response[schedulev1.ListRunsResponse], error) {
	id := req.Msg.GetScheduleId()
	if !idPattern.MatchString(id) {
		return nil, toConnect(invalid("schedule_id", "%q: the ID of a schedule is required", id))
	}
	return readVia(ctx, s.h, scheduleReadOptions(req.Msg.GetRead()), forwardSchedules(s, req, func(c schedulev1.ScheduleServiceClient) func(context.Context, *schedulev1.ListRunsRequest, ...grpc.CallOption) (*schedulev1.ListRunsResponse, error) {
		return c.ListRuns
	}), runsIndex(id), func(ctx context.Context) (*schedulev1.ListRunsResponse, uint64, error) {
		st := s.h.state.State()
		runs, err := st.Runs(id)
		if err != nil {
			return nil, 0, err // names the schedule
		}
		index, err := st.WatchRuns(nil, id)
		if err != nil {
			return nil, 0, err
		}
		return &schedulev1.ListRunsResponse{Runs: runs, Meta: s.h.queryMeta(index)}, index, nil
	})
}

// NextSlots implements schedulev1connect.ScheduleServiceHandler.
func (s *ScheduleService) NextSlots(ctx context.Context, req *connect.Request[schedulev1.NextSlotsRequest]) (*connect.Response[schedulev1.NextSlotsResponse], error) {
	n := int(req.Msg.GetCount())
	if n < 0 || n > MaxNextSlots {
		return nil, toConnect(invalid("count", "%d: 1 to %d (0: 5)", n, MaxNextSlots))
	}
	if n == 0 {
		n = 5
	}
	now := time.Now()
	if req.Msg.GetId() == "" && req.Msg.GetCron() != "" {
		// A preview: the schedule as CreateSchedule would make it now.
		spec, err := scheduler.ParseSpec(req.Msg.GetCron(), req.Msg.GetTimeZone())
		if err != nil {
			return nil, toConnect(invalid("cron", "%v", err))
		}
		sc := &schedulev1.Schedule{Cron: req.Msg.GetCron(), TimeZone: req.Msg.GetTimeZone(), UpdatedAt: timestamppb.New(now)}
		return connect.NewResponse(nextSlots(spec, sc, now, n)), nil
	}
	sc, err := s.read(ctx, req.Msg.GetId(), "id")
	if err != nil {
		return nil, err
	}
	spec, err := scheduler.ParseSpec(sc.GetCron(), sc.GetTimeZone())
	if err != nil {
		return nil, toConnect(fmt.Errorf("schedule %q: %w", sc.GetId(), err))
	}
	return connect.NewResponse(nextSlots(spec, sc, now, n)), nil
}

// nextSlots is the answer of NextSlots: the first n slots of sc after now.
func nextSlots(spec *scheduler.Spec, sc *schedulev1.Schedule, now time.Time, n int) *schedulev1.NextSlotsResponse {
	out := &schedulev1.NextSlotsResponse{TimeZone: spec.Location().String()}
	for _, t := range scheduler.Upcoming(spec, sc, now, n) {
		out.Slots = append(out.Slots, timestamppb.New(t))
	}
	return out
}
