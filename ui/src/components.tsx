// Shared pieces of every view: states (loading, empty, error), tables,
// badges, the confirmation dialog and links.
import type { ComponentChildren } from "preact";
import { useEffect, useRef } from "preact/hooks";
import type { Problem } from "./api";
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

/**
 * Confirm asks before an action: a modal <dialog> (focus is kept inside,
 * Escape cancels), the action named on its button.
 */
export function Confirm(props: { open: boolean; title: string; children: ComponentChildren; action: string; danger?: boolean; onConfirm: () => void; onCancel: () => void }) {
  const ref = useRef<HTMLDialogElement>(null);
  useEffect(() => {
    const d = ref.current;
    if (!d) return;
    if (props.open && !d.open) d.showModal();
    if (!props.open && d.open) d.close();
  }, [props.open]);
  return (
    <dialog ref={ref} aria-labelledby="confirm-title" onCancel={(e: Event) => (e.preventDefault(), props.onCancel())}>
      <h2 id="confirm-title">{props.title}</h2>
      <div class="dialog-body">{props.children}</div>
      <div class="dialog-actions">
        <button type="button" onClick={props.onCancel}>
          Cancel
        </button>
        <button type="button" class={props.danger ? "danger" : "primary"} onClick={props.onConfirm}>
          {props.action}
        </button>
      </div>
    </dialog>
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
