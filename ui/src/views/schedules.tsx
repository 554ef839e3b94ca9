// Power schedules with their next slots, and a schedule's runs as a table
// and a timeline (ok, error, skipped with its reason, outcome unknown),
// followed with blocking queries on ListSchedules and ListRuns. A create
// form previews the next runs of its expression (NextSlots with no id);
// a schedule's page edits, pauses, resumes and deletes it.
import { useEffect, useMemo, useState } from "preact/hooks";
import type uPlot from "uplot";
import { client } from "../api";
import { Chart } from "../chart";
import { ActionBar, Badge, Empty, ErrorBox, FormDialog, Input, Link, Loading, Outcome, PageHeader, Select, Table, fmtTime, durationMs, fmtDuration, useAction, type ActionDef, type Tone } from "../components";
import { useBlocking, useOnce } from "../live";
import { Consistency } from "../gen/pivirt/cluster/v1/cluster_pb";
import { Action, RunOutcome, type Run, type Schedule } from "../gen/pivirt/schedule/v1/schedule_pb";
import { ScheduleService } from "../gen/pivirt/schedule/v1/service_pb";
import { href } from "../router";
import { can, useSession } from "../session";
import { durationFromMs, timestampDate } from "@bufbuild/protobuf/wkt";

const blocking = (waitIndex: bigint) => ({ consistency: Consistency.STALE, waitIndex, waitTime: durationFromMs(60_000) });

export function actionName(a: Action): string {
  return (Action[a] ?? "unknown").toLowerCase().replace(/_/g, "-");
}

type Kind = "ok" | "error" | "skipped" | "unknown" | "running";
const kinds: Kind[] = ["ok", "error", "skipped", "unknown", "running"];
const kindLabel: Record<Kind, string> = { ok: "ok", error: "error", skipped: "skipped", unknown: "outcome unknown", running: "running" };
const kindTone: Record<Kind, Tone> = { ok: "ok", error: "bad", skipped: "muted", unknown: "warn", running: "info" };
const kindColor: Record<Kind, string> = { ok: "#17a35c", error: "#d64545", skipped: "#8a94a3", unknown: "#d98b00", running: "#2f7ed8" };

/** runKind classifies a run as pvcli and the scheduler do: an error of unknown outcome is a lost leader's claim. */
export function runKind(r: Run): Kind {
  switch (r.outcome) {
    case RunOutcome.OK:
      return "ok";
    case RunOutcome.SKIPPED:
      return "skipped";
    case RunOutcome.STARTED:
      return "running";
    default:
      return r.error.startsWith("outcome unknown") ? "unknown" : "error";
  }
}

export function Schedules(props: { id?: string }) {
  return props.id ? <ScheduleDetail id={props.id} /> : <ScheduleList />;
}

function ScheduleList() {
  const vm = new URLSearchParams(location.search).get("vm") ?? "";
  const q = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ScheduleService).listSchedules({ vmId: vm, read: blocking(waitIndex) }, { signal, timeoutMs: 90_000 });
      return { data: r.schedules, index: r.meta?.index ?? 0n };
    },
    [vm],
  );
  const rows = [...(q.data ?? [])].sort((a, b) => a.id.localeCompare(b.id));
  return (
    <section>
      <PageHeader title={vm ? `Schedules of VM ${vm}` : "Schedules"} />
      {vm && <Link href={href("schedules")}>← All schedules</Link>}
      <CreateSchedule vm={vm} />
      {q.error && <ErrorBox problem={q.error} what="schedules" stale={!!q.data} />}
      {q.loading && !q.data ? (
        <Loading what="schedules" />
      ) : rows.length === 0 ? (
        <Empty>No power schedules{vm ? ` for VM ${vm}` : ""}. pvcli schedule create adds one.</Empty>
      ) : (
        <Table<Schedule>
          caption="Schedules"
          rows={rows}
          rowKey={(s) => s.id}
          columns={[
            { title: "Schedule", cell: (s) => <Link href={href("schedules", s.id)}>{s.id}</Link> },
            { title: "VM", cell: (s) => <Link href={href("vms", s.vmId)}>{s.vmId}</Link> },
            { title: "Action", cell: (s) => actionName(s.action) },
            { title: "When", cell: (s) => <code>{s.cron}</code> },
            { title: "Zone", cell: (s) => s.timeZone || "UTC" },
            { title: "State", cell: (s) => (s.enabled ? <Badge tone="ok">enabled</Badge> : <Badge tone="muted">paused</Badge>) },
            { title: "Last slot", cell: (s) => fmtTime(s.lastSlot) },
          ]}
        />
      )}
    </section>
  );
}

function ScheduleDetail(props: { id: string }) {
  const sched = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ScheduleService).getSchedule({ id: props.id, read: blocking(waitIndex) }, { signal, timeoutMs: 90_000 });
      return { data: r.schedule, index: r.meta?.index ?? 0n };
    },
    [props.id],
  );
  const runs = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ScheduleService).listRuns({ scheduleId: props.id, read: blocking(waitIndex) }, { signal, timeoutMs: 90_000 });
      return { data: r.runs, index: r.meta?.index ?? 0n };
    },
    [props.id],
  );
  const s = sched.data;
  const act = useAction();
  return (
    <section>
      <PageHeader title={`Schedule ${props.id}`} />
      <Link href={href("schedules")}>← All schedules</Link>
      <Outcome state={act} />
      {sched.error && <ErrorBox problem={sched.error} what="the schedule" stale={!!s} />}
      {!s ? (
        sched.error ? null : <Loading what="the schedule" />
      ) : (
        <>
          <dl class="fields">
            <dt>VM</dt>
            <dd>
              <Link href={href("vms", s.vmId)}>{s.vmId}</Link>
            </dd>
            <dt>Action</dt>
            <dd>{actionName(s.action)}</dd>
            <dt>When</dt>
            <dd>
              <code>{s.cron}</code> ({s.timeZone || "UTC"})
            </dd>
            <dt>State</dt>
            <dd>{s.enabled ? "enabled" : "paused"}</dd>
            <dt>Runs kept</dt>
            <dd>{s.historyLimit || 50}</dd>
          </dl>
          <ScheduleActions schedule={s} act={act} />
          <NextSlots schedule={s} />
        </>
      )}
      <h2>Runs</h2>
      {runs.error && <ErrorBox problem={runs.error} what="runs" stale={!!runs.data} />}
      {runs.loading && !runs.data ? <Loading what="runs" /> : <RunsView runs={runs.data ?? []} />}
    </section>
  );
}

function NextSlots(props: { schedule: Schedule }) {
  const [gen, setGen] = useState(0);
  const q = useOnce((signal) => client(ScheduleService).nextSlots({ id: props.schedule.id, count: 5 }, { signal }), [props.schedule.id, props.schedule.modifyIndex, gen]);
  // When the first slot passes, ask again (one call per slot, not a loop).
  useEffect(() => {
    const first = q.data?.slots[0];
    if (!first) return;
    const t = setTimeout(() => setGen((g) => g + 1), Math.max(timestampDate(first).getTime() - Date.now(), 0) + 1000);
    return () => clearTimeout(t);
  }, [q.data]);
  if (!props.schedule.enabled) return <p class="sub">Paused: no slots run until it is resumed.</p>;
  if (q.error) return <ErrorBox problem={q.error} what="next slots" />;
  if (!q.data) return <Loading what="next slots" />;
  return (
    <>
      <h2>Next slots</h2>
      <ol class="slots" data-testid="next-slots">
        {q.data.slots.map((t) => (
          <li>{timestampDate(t).toLocaleString(undefined, { timeZone: q.data!.timeZone || "UTC", timeZoneName: "short" })}</li>
        ))}
      </ol>
    </>
  );
}

function RunsView(props: { runs: Run[] }) {
  const runs = [...props.runs].sort((a, b) => (a.slot && b.slot ? Number(b.slot.seconds - a.slot.seconds) : 0));
  const chart = useMemo(() => timeline(runs), [props.runs]);
  if (runs.length === 0) return <Empty>No runs yet: the first runs at the next slot.</Empty>;
  return (
    <>
      <Chart label="Run timeline: each slot's outcome" yLabel="outcome" height={180} data={chart.data} series={chart.series} categories={kinds.map((k) => kindLabel[k])} summary={chart.summary} xRange={chart.xRange} />
      <Table<Run>
        caption="Runs"
        rows={runs}
        rowKey={(r) => `${r.slot?.seconds}`}
        columns={[
          { title: "Slot", cell: (r) => fmtTime(r.slot) },
          {
            title: "Outcome",
            cell: (r) => (
              <span data-testid="run-outcome">
                <Badge tone={kindTone[runKind(r)]}>{kindLabel[runKind(r)]}</Badge>
              </span>
            ),
          },
          { title: "Reason", cell: (r) => r.error || "—" },
          { title: "Host", cell: (r) => r.host || "—" },
          { title: "Attempts", cell: (r) => r.attempts, class: "num" },
          { title: "Latency", cell: (r) => (r.latency ? fmtDuration(durationMs(r.latency)) : "—"), class: "num" },
        ]}
      />
    </>
  );
}

/** timeline puts each run at its slot in the lane of its outcome: one point series per outcome. */
function timeline(runs: Run[]) {
  const sorted = [...runs].filter((r) => r.slot).sort((a, b) => Number(a.slot!.seconds - b.slot!.seconds));
  const xs = sorted.map((r) => Number(r.slot!.seconds));
  const ys = kinds.map((k, i) => sorted.map((r) => (runKind(r) === k ? i : null)));
  const counts = kinds.map((k) => `${sorted.filter((r) => runKind(r) === k).length} ${kindLabel[k]}`).join(", ");
  // From the first kept run to now, at least ten minutes.
  const now = Date.now() / 1000;
  const from = Math.min(xs[0] ?? now, now - 600);
  return {
    data: [xs, ...ys] as uPlot.AlignedData,
    series: kinds.map((k) => ({ label: kindLabel[k], color: kindColor[k], points: true })),
    summary: `${sorted.length} runs: ${counts}`,
    xRange: [from - 5, Math.max(now, xs[xs.length - 1] ?? now) + 5] as [number, number],
  };
}

const actionOptions: [string, string][] = [
  [String(Action.POWER_ON), "power-on"],
  [String(Action.POWER_OFF), "power-off"],
  [String(Action.REBOOT), "reboot"],
];

/** Preview shows the next runs of an expression before it is saved (NextSlots with no id). */
function Preview(props: { cron: string; timeZone: string }) {
  const q = useOnce(
    async (signal) => {
      if (!props.cron.trim()) return undefined;
      // Typing settles first: one call per pause, not per key.
      await new Promise<void>((resolve, reject) => {
        const t = setTimeout(resolve, 300);
        signal.addEventListener("abort", () => (clearTimeout(t), reject(new Error("aborted"))));
      });
      return client(ScheduleService).nextSlots({ cron: props.cron.trim(), timeZone: props.timeZone.trim(), count: 5 }, { signal });
    },
    [props.cron, props.timeZone],
  );
  return (
    <div class="preview" aria-live="polite" data-testid="preview">
      <strong>Next runs</strong>
      {!props.cron.trim() ? (
        <p class="sub">Give an expression to see its next runs.</p>
      ) : q.error ? (
        <p class="error-text">{q.error.message}</p>
      ) : !q.data ? (
        <p class="sub">…</p>
      ) : (
        <ol class="slots">
          {q.data.slots.map((t) => (
            <li>{timestampDate(t).toLocaleString(undefined, { timeZone: q.data!.timeZone || "UTC", timeZoneName: "short" })}</li>
          ))}
        </ol>
      )}
    </div>
  );
}

/** ScheduleFields are the fields a create and an edit share. */
function ScheduleFields(props: { f: Record<string, string>; set: (k: string) => (v: string) => void }) {
  const v = (k: string) => props.f[k] ?? "";
  return (
    <>
      <Select label="Action" name="action" value={v("action")} onChange={props.set("action")} options={actionOptions} />
      <Input label="When" name="cron" value={v("cron")} onInput={props.set("cron")} required placeholder="0 7 * * 1-5" hint="Five cron fields, @daily and the like, or @every 10m." />
      <Input label="Time zone" name="zone" value={v("zone")} onInput={props.set("zone")} placeholder="UTC" hint="An IANA zone name (Europe/Budapest); empty: UTC." />
      <Preview cron={v("cron")} timeZone={v("zone")} />
    </>
  );
}

/** CreateSchedule is the list's create button and form (pvcli schedule create). */
function CreateSchedule(props: { vm: string }) {
  const s = useSession();
  const act = useAction();
  const [open, setOpen] = useState(false);
  const [f, setF] = useState<Record<string, string>>({});
  if (!can(s, "ScheduleService/CreateSchedule")) return null;
  const set = (k: string) => (v: string) => setF((x) => ({ ...x, [k]: v }));
  const submit = async () => {
    const r = await client(ScheduleService).createSchedule({
      schedule: { id: (f.id ?? "").trim(), vmId: (f.vm ?? "").trim(), action: Number(f.action) as Action, cron: (f.cron ?? "").trim(), timeZone: (f.zone ?? "").trim(), enabled: true },
    });
    act.say(`Created schedule ${r.schedule?.id}.`);
  };
  return (
    <div class="actions">
      <button
        type="button"
        class="primary"
        onClick={() => {
          setF({ vm: props.vm, action: String(Action.POWER_ON) });
          setOpen(true);
        }}
      >
        Create a schedule
      </button>
      <Outcome state={act} />
      <FormDialog open={open} title="Create a schedule" action="Create" submit={submit} onClose={() => setOpen(false)}>
        <Input label="VM" name="vm" value={f.vm ?? ""} onInput={set("vm")} required hint="The VM's ID." />
        <Input label="ID" name="id" value={f.id ?? ""} onInput={set("id")} hint="Empty: one is made up." />
        <ScheduleFields f={f} set={set} />
      </FormDialog>
    </div>
  );
}

/** ScheduleActions: edit, pause or resume, delete (pvcli schedule update|pause|resume|delete). */
function ScheduleActions(props: { schedule: Schedule; act: ReturnType<typeof useAction> }) {
  const s = useSession();
  const sc = props.schedule;
  const [editing, setEditing] = useState(false);
  const [f, setF] = useState<Record<string, string>>({});
  const set = (k: string) => (v: string) => setF((x) => ({ ...x, [k]: v }));
  const list: ActionDef[] = [];
  if (sc.enabled && can(s, "ScheduleService/PauseSchedule")) list.push({ label: "Pause", run: () => client(ScheduleService).pauseSchedule({ id: sc.id }) });
  if (!sc.enabled && can(s, "ScheduleService/ResumeSchedule")) list.push({ label: "Resume", run: () => client(ScheduleService).resumeSchedule({ id: sc.id }) });
  if (can(s, "ScheduleService/DeleteSchedule"))
    list.push({
      label: "Delete",
      danger: true,
      confirm: <p>This deletes the schedule {sc.id} and the record of its runs; the VM stays as it is.</p>,
      run: () => client(ScheduleService).deleteSchedule({ id: sc.id }),
    });
  const edit = can(s, "ScheduleService/UpdateSchedule");
  if (list.length === 0 && !edit) return <p class="sub">Your roles may not change this schedule.</p>;
  const submit = async () => {
    const paths: string[] = [];
    const next = { id: sc.id, action: Number(f.action) as Action, cron: (f.cron ?? "").trim(), timeZone: (f.zone ?? "").trim() };
    if (next.action !== sc.action) paths.push("action");
    if (next.cron !== sc.cron) paths.push("cron");
    if (next.timeZone !== sc.timeZone) paths.push("time_zone");
    if (paths.length === 0) {
      props.act.say(`Edit schedule ${sc.id}: nothing changed.`);
      return;
    }
    await client(ScheduleService).updateSchedule({ schedule: next, updateMask: { paths }, expectedRevision: sc.modifyIndex });
    props.act.say(`Edit schedule ${sc.id}: saved (${paths.join(", ")}).`);
  };
  return (
    <ActionBar target={`schedule ${sc.id}`} act={props.act} actions={list}>
      {edit && (
        <>
          <button
            type="button"
            onClick={() => {
              setF({ action: String(sc.action), cron: sc.cron, zone: sc.timeZone });
              setEditing(true);
            }}
          >
            Edit
          </button>
          <FormDialog open={editing} title={`Edit schedule ${sc.id}`} action="Save" submit={submit} onClose={() => setEditing(false)}>
            <ScheduleFields f={f} set={set} />
          </FormDialog>
        </>
      )}
    </ActionBar>
  );
}
