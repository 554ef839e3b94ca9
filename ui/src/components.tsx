// Shared pieces of every view: states (loading, empty, error), tables,
// badges, the confirmation and form dialogs, the outcome of an action and
// links.
import type { ComponentChildren } from "preact";
import { useEffect, useId, useRef, useState } from "preact/hooks";
import { problem, type Problem } from "./api";
import { follow } from "./router";
import { timestampDate, type Timestamp, type Duration } from "@bufbuild/protobuf/wkt";

export function Link(props: { href: string; children: ComponentChildren; class?: string; "aria-current"?: "page" | undefined }) {
  return (
    <a href={props.href} onClick={follow} class={props.class} aria-current={props["aria-current"]}>
      {props.children}
    </a>
  );
}

export function Loading(props: { what: string }) {
  return (
    <p class="state loading" role="status" aria-live="polite">
      Loading {props.what}…
    </p>
  );
}

export function Empty(props: { children: ComponentChildren }) {
  return <p class="state empty">{props.children}</p>;
}

/** ErrorBox shows a failed call as pvcli would: the agent's message, then the hint. */
export function ErrorBox(props: { problem: Problem; what?: string; stale?: boolean }) {
  const p = props.problem;
  return (
    <div class="state error" role="alert">
      <p>
        <strong>{props.what ? `${props.what}: ` : ""}</strong>
        {p.message}
      </p>
      {p.hint && <p class="hint">{p.hint}</p>}
      {props.stale && <p class="hint">What is shown is the last answer; the view follows again when the agent answers.</p>}
    </div>
  );
}

/** Live tells whether a view's stream is open. */
export function Live(props: { connected: boolean }) {
  return (
    <span class={`live ${props.connected ? "on" : "off"}`} role="status">
      {props.connected ? "live" : "reconnecting…"}
    </span>
  );
}

export type Tone = "ok" | "warn" | "bad" | "muted" | "info";

export function Badge(props: { tone: Tone; children: ComponentChildren; title?: string }) {
  return (
    <span class={`badge ${props.tone}`} title={props.title}>
      {props.children}
    </span>
  );
}

export interface Column<T> {
  title: string;
  cell: (row: T) => ComponentChildren;
  class?: string;
}

/** Table with a caption for screen readers; rows keyed. */
export function Table<T>(props: { caption: string; columns: Column<T>[]; rows: T[]; rowKey: (row: T) => string; rowClass?: (row: T) => string }) {
  return (
    <div class="table-wrap" tabIndex={0} role="region" aria-label={props.caption}>
      <table>
        <caption class="sr-only">{props.caption}</caption>
        <thead>
          <tr>
            {props.columns.map((c) => (
              <th scope="col" class={c.class}>
                {c.title}
              </th>
            ))}
          </tr>
        </thead>
        <tbody>
          {props.rows.map((r) => (
            <tr key={props.rowKey(r)} class={props.rowClass?.(r)}>
              {props.columns.map((c) => (
                <td class={c.class} data-label={c.title}>
                  {c.cell(r)}
                </td>
              ))}
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

/** Modal is a native modal <dialog>: focus is kept inside, Escape cancels. */
function Modal(props: { open: boolean; title: string; onCancel: () => void; children: ComponentChildren }) {
  const ref = useRef<HTMLDialogElement>(null);
  const id = useId();
  useEffect(() => {
    const d = ref.current;
    if (!d) return;
    if (props.open && !d.open) d.showModal();
    if (!props.open && d.open) d.close();
  }, [props.open]);
  return (
    <dialog ref={ref} aria-labelledby={id} onCancel={(e: Event) => (e.preventDefault(), props.onCancel())}>
      <h2 id={id}>{props.title}</h2>
      {props.open && props.children}
    </dialog>
  );
}

/**
 * Confirm asks before an action: a modal <dialog> (focus is kept inside,
 * Escape cancels), the action named on its button.
 */
export function Confirm(props: { open: boolean; title: string; children: ComponentChildren; action: string; danger?: boolean; onConfirm: () => void; onCancel: () => void }) {
  return (
    <Modal open={props.open} title={props.title} onCancel={props.onCancel}>
      <div class="dialog-body">{props.children}</div>
      <div class="dialog-actions">
        <button type="button" onClick={props.onCancel}>
          Cancel
        </button>
        <button type="button" class={props.danger ? "danger" : "primary"} onClick={props.onConfirm}>
          {props.action}
        </button>
      </div>
    </Modal>
  );
}

/**
 * FormDialog is a form in a modal <dialog>: the first field has the focus,
 * Enter submits, Escape cancels. submit runs the call; its failure is shown
 * in the dialog (pvcli's words), its success closes it.
 */
export function FormDialog(props: { open: boolean; title: string; action: string; danger?: boolean; children: ComponentChildren; submit: () => Promise<void | "stay">; onClose: () => void }) {
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState<Problem | undefined>();
  useEffect(() => {
    if (props.open) setErr(undefined);
  }, [props.open]);
  const onSubmit = async (e: Event) => {
    e.preventDefault();
    setBusy(true);
    setErr(undefined);
    try {
      if ((await props.submit()) !== "stay") props.onClose();
    } catch (x) {
      setErr(problem(x));
    } finally {
      setBusy(false);
    }
  };
  return (
    <Modal open={props.open} title={props.title} onCancel={props.onClose}>
      <form class="form" onSubmit={onSubmit} noValidate>
        {props.children}
        {err && <ErrorBox problem={err} what={`${props.action} failed`} />}
        <div class="dialog-actions">
          <button type="button" onClick={props.onClose}>
            Cancel
          </button>
          <button type="submit" class={props.danger ? "danger" : "primary"} disabled={busy}>
            {busy ? `${props.action}…` : props.action}
          </button>
        </div>
      </form>
    </Modal>
  );
}

/** Input is a labelled form field; hint is read with it (aria-describedby). */
export function Input(props: { label: string; value: string; onInput: (v: string) => void; name?: string; type?: "text" | "number"; required?: boolean; min?: number; max?: number; placeholder?: string; hint?: string; list?: string[] }) {
  const id = useId();
  return (
    <div class="field">
      <label for={id}>{props.label}</label>
      <input
        id={id}
        name={props.name}
        type={props.type ?? "text"}
        value={props.value}
        required={props.required}
        min={props.min}
        max={props.max}
        placeholder={props.placeholder}
        list={props.list?.length ? id + "-list" : undefined}
        aria-describedby={props.hint ? id + "-hint" : undefined}
        onInput={(e) => props.onInput((e.target as HTMLInputElement).value)}
      />
      {props.list && props.list.length > 0 && (
        <datalist id={id + "-list"}>
          {props.list.map((v) => (
            <option value={v} />
          ))}
        </datalist>
      )}
      {props.hint && (
        <small id={id + "-hint"} class="hint">
          {props.hint}
        </small>
      )}
    </div>
  );
}

/** TextArea is a labelled multi-line field (a YAML value). */
export function TextArea(props: { label: string; value: string; onInput: (v: string) => void; name?: string; rows?: number; hint?: string }) {
  const id = useId();
  return (
    <div class="field">
      <label for={id}>{props.label}</label>
      <textarea id={id} name={props.name} rows={props.rows ?? 6} value={props.value} spellcheck={false} aria-describedby={props.hint ? id + "-hint" : undefined} onInput={(e) => props.onInput((e.target as HTMLTextAreaElement).value)} />
      {props.hint && (
        <small id={id + "-hint"} class="hint">
          {props.hint}
        </small>
      )}
    </div>
  );
}

/** Select is a labelled choice among options (value, label). */
export function Select(props: { label: string; value: string; onChange: (v: string) => void; name?: string; options: [string, string][]; hint?: string }) {
  const id = useId();
  return (
    <div class="field">
      <label for={id}>{props.label}</label>
      <select id={id} name={props.name} value={props.value} aria-describedby={props.hint ? id + "-hint" : undefined} onChange={(e) => props.onChange((e.target as HTMLSelectElement).value)}>
        {props.options.map(([v, l]) => (
          <option value={v}>{l}</option>
        ))}
      </select>
      {props.hint && (
        <small id={id + "-hint"} class="hint">
          {props.hint}
        </small>
      )}
    </div>
  );
}

/** One button of an ActionBar. */
export interface ActionDef {
  label: string;
  danger?: boolean;
  disabled?: boolean;
  /** what the confirmation says; none: the action runs at once */
  confirm?: ComponentChildren;
  run: () => Promise<unknown>;
}

/**
 * ActionBar is the buttons of an object's actions (only those the caller
 * may call are given), each destructive one confirmed; act shows the
 * outcome. children are more controls (an edit button).
 */
export function ActionBar(props: { target: string; act: ActionState; actions: ActionDef[]; children?: ComponentChildren }) {
  const [pending, setPending] = useState<ActionDef | undefined>();
  const go = (a: ActionDef) => {
    setPending(undefined);
    props.act.run(`${a.label} ${props.target}: done.`, a.run);
  };
  return (
    <div class="actions" role="group" aria-label={`Actions on ${props.target}`}>
      {props.actions.map((a) => (
        <button type="button" class={a.danger ? "danger" : "primary"} disabled={props.act.busy || a.disabled} onClick={() => (a.confirm ? setPending(a) : go(a))}>
          {a.label}
        </button>
      ))}
      {props.children}
      <Confirm open={!!pending} title={pending ? `${pending.label} ${props.target}?` : ""} action={pending?.label ?? ""} danger={pending?.danger} onCancel={() => setPending(undefined)} onConfirm={() => pending && go(pending)}>
        {pending?.confirm}
      </Confirm>
    </div>
  );
}

/** An action's state: running, its outcome or its failure. */
export interface ActionState {
  busy: boolean;
  done?: string;
  error?: Problem;
  /** run calls fn; done is what is said when it succeeds. */
  run: (done: string, fn: () => Promise<unknown>) => Promise<boolean>;
  /** say reports an outcome reached elsewhere (a form dialog). */
  say: (done: string) => void;
}

export function useAction(): ActionState {
  const [busy, setBusy] = useState(false);
  const [done, setDone] = useState<string | undefined>();
  const [error, setError] = useState<Problem | undefined>();
  return {
    busy,
    done,
    error,
    say: (d) => {
      setError(undefined);
      setDone(d);
    },
    run: async (d, fn) => {
      setBusy(true);
      setError(undefined);
      setDone(undefined);
      try {
        await fn();
        setDone(d);
        return true;
      } catch (e) {
        setError(problem(e));
        return false;
      } finally {
        setBusy(false);
      }
    },
  };
}

/** Outcome shows what the last action did, or why it failed (pvcli's words). */
export function Outcome(props: { state: ActionState }) {
  const a = props.state;
  return (
    <div class="outcome">
      <p role="status" class="ok-text" data-testid="outcome">
        {a.done ?? ""}
      </p>
      {a.error && <ErrorBox problem={a.error} what="the action failed" />}
    </div>
  );
}

export function PageHeader(props: { title: string; children?: ComponentChildren }) {
  useEffect(() => {
    document.title = `${props.title} · PiVirt`;
  }, [props.title]);
  return (
    <header class="page-header">
      <h1>{props.title}</h1>
      <div class="page-tools">{props.children}</div>
    </header>
  );
}

// Formatting.

export function fmtTime(ts?: Timestamp): string {
  if (!ts) return "—";
  return timestampDate(ts).toLocaleString();
}

export function ago(ts?: Timestamp, now = Date.now()): string {
  if (!ts) return "—";
  return fmtDuration(now - timestampDate(ts).getTime()) + " ago";
}

export function durationMs(d?: Duration): number {
  if (!d) return 0;
  return Number(d.seconds) * 1000 + d.nanos / 1e6;
}

export function fmtDuration(ms: number): string {
  if (ms < 0) ms = 0;
  if (ms < 1000) return `${Math.round(ms)}ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${Math.floor(s % 60)}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h${m % 60}m`;
  return `${Math.floor(h / 24)}d${h % 24}h`;
}

export function fmtBytes(n: bigint | number): string {
  let v = Number(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}
