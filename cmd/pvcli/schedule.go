package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

var (
	scheduleActions = map[string]schedulev1.Action{"power-on": schedulev1.Action_ACTION_POWER_ON, "power-off": schedulev1.Action_ACTION_POWER_OFF, "reboot": schedulev1.Action_ACTION_REBOOT}
	catchUpPolicies = map[string]schedulev1.CatchUp{"skip": schedulev1.CatchUp_CATCH_UP_SKIP, "latest_once": schedulev1.CatchUp_CATCH_UP_LATEST_ONCE, "all": schedulev1.CatchUp_CATCH_UP_ALL}
	overlapPolicies = map[string]schedulev1.Overlap{"forbid": schedulev1.Overlap_OVERLAP_FORBID, "allow": schedulev1.Overlap_OVERLAP_ALLOW}
)

// scheduleFlags are the fields of a schedule as flags.
type scheduleFlags struct {
	id, vm, cron, zone string
	action             enumFlag
	catchUp, overlap   enumFlag
	window             time.Duration
	historyLimit       uint32
	paused             bool
}

func (f *scheduleFlags) register(c *cobra.Command, create bool) {
	f.action = enumFlag{allowed: []string{"power-on", "power-off", "reboot"}}
	f.catchUp = enumFlag{value: "skip", allowed: []string{"skip", "latest_once", "all"}}
	f.overlap = enumFlag{value: "forbid", allowed: []string{"forbid", "allow"}}
	fl := c.Flags()
	fl.StringVar(&f.vm, "vm", "", "ID of the VM")
	fl.Var(&f.action, "action", "what to do at each slot: power-on|power-off (guest shutdown)|reboot")
	fl.StringVar(&f.cron, "cron", "", `when: "minute hour day-of-month month weekday" (e.g. "0 7 * * 1-5"), @daily-style, or "@every 30m"`)
	fl.StringVar(&f.zone, "time-zone", "", "IANA time zone of the cron expression, e.g. Europe/Budapest (default UTC)")
	fl.Var(&f.catchUp, "catch-up", "slots missed while no leader ran them: skip|latest_once|all")
	fl.DurationVar(&f.window, "catch-up-window", 0, "how far back missed slots are considered (default 1h, at most 168h)")
	fl.Var(&f.overlap, "overlap", "a slot while the previous run is in flight: forbid (skip it)|allow")
	fl.Uint32Var(&f.historyLimit, "history-limit", 0, "runs kept (default 50, at most 1000)")
	if create {
		fl.StringVar(&f.id, "id", "", "schedule ID (default: generated)")
		fl.BoolVar(&f.paused, "paused", false, "create it paused (resume with pvcli schedule resume)")
	}
}

func (f *scheduleFlags) schedule() *schedulev1.Schedule {
	s := &schedulev1.Schedule{
		Id: f.id, VmId: f.vm, Action: scheduleActions[f.action.value], Cron: f.cron, TimeZone: f.zone, Enabled: !f.paused,
		CatchUp: catchUpPolicies[f.catchUp.value], Overlap: overlapPolicies[f.overlap.value], HistoryLimit: f.historyLimit,
	}
	if f.window > 0 {
		s.CatchUpWindow = durationpb.New(f.window)
	}
	return s
}

func (a *app) newScheduleCmd() *cobra.Command {
	var create scheduleFlags
	createCmd := &cobra.Command{
		Use:   "create --vm ID --action power-on|power-off|reboot --cron EXPR [--time-zone ZONE]",
		Short: "Create a power schedule",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			for _, req := range []string{"vm", "action", "cron"} {
				if !cmd.Flags().Changed(req) {
					return usagef("--%s is required", req)
				}
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.schedule.CreateSchedule(ctx, connect.NewRequest(&schedulev1.CreateScheduleRequest{Schedule: create.schedule(), Write: a.writeOptions()}))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, scheduleTable(resp.Msg.GetSchedule()))
			})
		}),
	}
	create.register(createCmd, true)

	var update scheduleFlags
	var revision uint64
	updateCmd := &cobra.Command{
		Use:   "update ID [--vm ID] [--action A] [--cron EXPR] [--time-zone Z] [--catch-up P] [--catch-up-window D] [--overlap P] [--history-limit N]",
		Short: "Change the fields given as flags (slots before the change are not caught up)",
		Args:  positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			mask := changedMask(cmd, map[string]string{"vm": "vm_id", "action": "action", "cron": "cron", "time-zone": "time_zone", "catch-up": "catch_up",
				"catch-up-window": "catch_up_window", "overlap": "overlap", "history-limit": "history_limit"})
			if len(mask.GetPaths()) == 0 {
				return usagef("nothing to update: give at least one of --vm, --action, --cron, --time-zone, --catch-up, --catch-up-window, --overlap, --history-limit")
			}
			s := update.schedule()
			s.Id = args[0]
			req := &schedulev1.UpdateScheduleRequest{Schedule: s, UpdateMask: mask, Write: a.writeOptions()}
			if cmd.Flags().Changed("expected-revision") {
				req.ExpectedRevision = &revision
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.schedule.UpdateSchedule(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, scheduleTable(resp.Msg.GetSchedule()))
			})
		}),
	}
	update.register(updateCmd, false)
	updateCmd.Flags().Uint64Var(&revision, "expected-revision", 0, "fail with aborted unless the schedule's revision (modify index) is this")

	byID := func(use, short string, call func(ctx context.Context, cmd *cobra.Command, c *clientConn, id string) (*schedulev1.Schedule, error)) *cobra.Command {
		return &cobra.Command{
			Use:   use + " ID",
			Short: short,
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					s, err := call(ctx, cmd, c, args[0])
					if err != nil {
						return err
					}
					return a.render(s, scheduleTable(s))
				})
			}),
		}
	}

	var vm string
	list := &cobra.Command{
		Use:   "list [--vm ID]",
		Short: "List power schedules",
		Long: `list prints the power schedules, of every VM or of one (--vm).

Without --consistency, --max-stale or --wait-index the read is consistent (the
agent asked gets a read index from the leader). With them it is read like the
other lists: --wait-index makes it a blocking query that answers once the
schedules index (meta.index with -o json, Pivirt-Index with --verbose) is above
it; any change to a schedule moves that index, a run starting included.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.schedule.ListSchedules(ctx, connect.NewRequest(&schedulev1.ListSchedulesRequest{VmId: vm, Read: a.readOptionsIfSet(cmd)}))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, scheduleTable(resp.Msg.GetSchedules()...))
			})
		}),
	}
	list.Flags().StringVar(&vm, "vm", "", "only the schedules of this VM")

	var (
		count            int32
		nextCron, nextTZ string
	)
	next := &cobra.Command{
		Use:   "next ID [--count N] | next --cron EXPR [--time-zone ZONE] [--count N]",
		Short: "Show the coming slots of a schedule, or of an expression before a create, in its time zone",
		Args: func(cmd *cobra.Command, args []string) error {
			if cmd.Flags().Changed("cron") {
				if len(args) > 0 {
					return usagef("give either ID or --cron, not both")
				}
				return nil
			}
			return positional("ID")(cmd, args)
		},
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > 100 {
				return usagef("--count %d: 1 to 100", count)
			}
			req := &schedulev1.NextSlotsRequest{Count: count, Cron: nextCron, TimeZone: nextTZ}
			if len(args) > 0 {
				if cmd.Flags().Changed("time-zone") {
					return usagef("--time-zone goes with --cron; a schedule's slots are in its own zone")
				}
				req = &schedulev1.NextSlotsRequest{Id: args[0], Count: count}
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.schedule.NextSlots(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				loc, err := time.LoadLocation(resp.Msg.GetTimeZone())
				if err != nil {
					loc = time.UTC
				}
				return a.render(resp.Msg, func(w io.Writer) {
					row(w, "SLOT", "UTC")
					for _, s := range resp.Msg.GetSlots() {
						row(w, s.AsTime().In(loc).Format("2006-01-02 15:04:05 MST"), s.AsTime().UTC().Format(time.RFC3339))
					}
				})
			})
		}),
	}
	next.Flags().Int32Var(&count, "count", 5, "how many slots")
	next.Flags().StringVar(&nextCron, "cron", "", "preview this expression instead of a schedule's (as create would take it, from now)")
	next.Flags().StringVar(&nextTZ, "time-zone", "", "IANA time zone of --cron (default UTC)")

	runs := &cobra.Command{
		Use:   "runs ID",
		Short: "Show a schedule's kept runs, newest first",
		Long: `runs prints the kept runs of schedule ID, newest slot first.

Without --consistency, --max-stale or --wait-index the read is consistent (the
agent asked gets a read index from the leader). With them it is read like the
other lists: --wait-index makes it a blocking query that answers once the index
of this schedule's runs (meta.index with -o json, Pivirt-Index with --verbose)
is above it: a run starts or ends, or the schedule changes. Other schedules do
not wake it.`,
		Args: positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.schedule.ListRuns(ctx, connect.NewRequest(&schedulev1.ListRunsRequest{ScheduleId: args[0], Read: a.readOptionsIfSet(cmd)}))
				if err != nil {
					return err
				}
				names := map[string]string{}
				if a.opts.output.value == "table" {
					names = memberNames(ctx, c.api)
				}
				return a.render(resp.Msg, func(w io.Writer) {
					row(w, "SLOT", "OUTCOME", "LEADER", "HOST", "ATTEMPTS", "LATENCY", "ERROR")
					for _, r := range resp.Msg.GetRuns() {
						lat := ""
						if r.GetLatency() != nil {
							lat = r.GetLatency().AsDuration().Round(time.Millisecond).String()
						}
						row(w, r.GetSlot().AsTime().UTC().Format(time.RFC3339), enumName(r.GetOutcome()), cmp.Or(names[r.GetNode()], r.GetNode()), r.GetHost(), strconv.Itoa(int(r.GetAttempts())), lat, r.GetError())
					}
				})
			})
		}),
	}

	return groupCmd("schedule", "Manage VM power schedules (run by the Raft leader)",
		createCmd,
		byID("get", "Show a schedule", func(ctx context.Context, cmd *cobra.Command, c *clientConn, id string) (*schedulev1.Schedule, error) {
			r, err := c.schedule.GetSchedule(ctx, connect.NewRequest(&schedulev1.GetScheduleRequest{Id: id, Read: a.readOptionsIfSet(cmd)}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetSchedule(), nil
		}),
		list,
		updateCmd,
		&cobra.Command{
			Use:   "delete ID",
			Short: "Delete a schedule and its runs",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.schedule.DeleteSchedule(ctx, connect.NewRequest(&schedulev1.DeleteScheduleRequest{Id: args[0], Write: a.writeOptions()}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, func(w io.Writer) { fmt.Fprintf(w, "Deleted schedule %s and its runs\n", args[0]) })
				})
			}),
		},
		byID("pause", "Pause a schedule (its slots are not run, nor caught up on resume)", func(ctx context.Context, _ *cobra.Command, c *clientConn, id string) (*schedulev1.Schedule, error) {
			r, err := c.schedule.PauseSchedule(ctx, connect.NewRequest(&schedulev1.PauseScheduleRequest{Id: id, Write: a.writeOptions()}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetSchedule(), nil
		}),
		byID("resume", "Resume a paused schedule from now", func(ctx context.Context, _ *cobra.Command, c *clientConn, id string) (*schedulev1.Schedule, error) {
			r, err := c.schedule.ResumeSchedule(ctx, connect.NewRequest(&schedulev1.ResumeScheduleRequest{Id: id, Write: a.writeOptions()}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetSchedule(), nil
		}),
		runs,
		next,
	)
}

// memberNames maps the node IDs of the cluster's members to their names,
// for tables that would show a node ID; empty when the members cannot be
// read (the caller may not be allowed to), and the IDs are shown.
func memberNames(ctx context.Context, api clusterv1connect.ClusterServiceClient) map[string]string {
	names := map[string]string{}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := api.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
	if err != nil {
		return names
	}
	for _, m := range resp.Msg.GetMembers() {
		names[m.GetNodeId()] = m.GetName()
	}
	return names
}

func scheduleTable(list ...*schedulev1.Schedule) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "ID", "VM", "ACTION", "CRON", "TIME_ZONE", "ENABLED", "LAST_SLOT", "REVISION")
		for _, s := range list {
			if s == nil {
				continue
			}
			last := ""
			if s.GetLastSlot() != nil {
				last = s.GetLastSlot().AsTime().UTC().Format(time.RFC3339)
			}
			zone := s.GetTimeZone()
			if zone == "" {
				zone = "UTC"
			}
			row(w, s.GetId(), s.GetVmId(), actionName(s.GetAction()), s.GetCron(), zone, strconv.FormatBool(s.GetEnabled()), last, formatUint(s.GetModifyIndex()))
		}
	}
}

func actionName(a schedulev1.Action) string {
	for k, v := range scheduleActions {
		if v == a {
			return k
		}
	}
	return enumName(a)
}
