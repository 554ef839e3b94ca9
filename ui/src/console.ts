// A VM's serial console over the agent's WebSocket bridge to
// VMService.Console (/ws/pivirt.vm.v1.VMService/Console on the page's own
// origin). Keystrokes go as binary frames and the window's size as JSON
// text frames; the console's output comes back as binary frames, and its
// end as one JSON text frame (closed: the VM's side ended the session;
// error: the call failed). A connection lost without either (close 1006:
// a network blip, the agent restarting) is opened again after a bounded
// backoff. The browser cannot read why an upgrade was refused, so after a
// connection that never opened the same URL is asked with a plain GET,
// which runs the same checks and answers the agent's error (or 426 when
// the console would open).
import { Code, ConnectError } from "@connectrpc/connect";
import { codeFromString } from "@connectrpc/connect/protocol-connect";
import { bearer, forget } from "./auth";
import { problem, type Problem } from "./api";

/** The subprotocol the agent selects. */
export const subprotocol = "pivirt.console.v1";

/** The largest keystroke frame the agent takes. */
export const maxFrame = 64 << 10;

/** Reconnection after a lost connection: 1 s doubling to 15 s, 8 tries. */
export const backoff = { first: 1000, max: 15_000, attempts: 8 };

export interface Size {
  cols: number;
  rows: number;
}

export type ConsoleState =
  | { kind: "connecting" }
  | { kind: "open" }
  /** the connection was lost; the next try is in delay ms */
  | { kind: "reconnecting"; attempt: number; delay: number; why: string }
  /** the VM's side ended the session */
  | { kind: "closed"; reason: string; exitStatus: number }
  /** the session ended without a word from the VM (the agent stopping, the page closing it) */
  | { kind: "ended"; why: string }
  /** the console could not open, or failed */
  | { kind: "failed"; problem: Problem };

/** base64url without padding, of the UTF-8 bytes of s. */
export function base64url(s: string): string {
  let bin = "";
  new TextEncoder().encode(s).forEach((b) => (bin += String.fromCharCode(b)));
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** The subprotocols offered: the console's, and the bearer token when the session has one. */
export function protocols(token: string | undefined): string[] {
  return token ? [subprotocol, `bearer.${base64url(token)}`] : [subprotocol];
}

/** The console's path and query on the page's origin. */
export function consolePath(id: string, size?: Size): string {
  const q = new URLSearchParams({ id });
  if (size && valid(size)) {
    q.set("cols", String(size.cols));
    q.set("rows", String(size.rows));
  }
  return `/ws/pivirt.vm.v1.VMService/Console?${q}`;
}

/** The WebSocket URL of a console: wss:// for an https page. */
export function consoleURL(loc: { protocol: string; host: string }, id: string, size?: Size): string {
  return `${loc.protocol === "https:" ? "wss" : "ws"}://${loc.host}${consolePath(id, size)}`;
}

function valid(s: Size): boolean {
  const ok = (n: number) => Number.isInteger(n) && n >= 1 && n <= 10000;
  return ok(s.cols) && ok(s.rows);
}

/** What a close with this code and no closed or error frame before it means. */
export function classifyClose(code: number, opened: boolean): "retry" | "ended" | "refused" | "probe" {
  switch (code) {
    case 1000:
      return "ended";
    case 1008:
    case 1009:
      return "refused";
    case 1001: // the agent is stopping: another one comes back in its place
    case 1006: // no close frame: the connection was lost
    case 1011:
    case 1012:
    case 1013:
    case 1014:
      // An upgrade that never happened is also 1006: ask the agent why.
      return opened ? "retry" : "probe";
  }
  return code >= 4000 && code < 5000 ? "refused" : opened ? "retry" : "probe";
}

/**
 * closeProblem words a close that ended the call with no error frame
 * before it: 4000 + a gRPC code as that code (its numbers are Connect's),
 * 1008 and 1009 (a frame the agent refused) as what they are.
 */
export function closeProblem(code: number, reason: string): Problem {
  if (code > 4000 && code <= 4016) {
    return problem(new ConnectError(reason || "the console's call failed", (code - 4000) as Code));
  }
  const what = code === 1009 ? "a frame too big" : code === 1008 ? "a frame it does not take" : "no reason";
  return { code: Code.Internal, message: `the agent closed the console (${code}: ${reason || what})`, noLeader: false };
}

/**
 * transient: a refusal that may pass by itself — the caller's bound on
 * open streams (a session cut off by a network blip counts until the
 * agent notices it gone), a backend or a leader unavailable. The console
 * is tried again, saying why.
 */
export function transient(p: Problem): boolean {
  return p.code === Code.ResourceExhausted || p.code === Code.Unavailable;
}

/** The delay before reconnection attempt n (1-based), or undefined past the last. */
export function retryDelay(attempt: number): number | undefined {
  if (attempt > backoff.attempts) return undefined;
  return Math.min(backoff.first * 2 ** (attempt - 1), backoff.max);
}

/** Splits UTF-8 bytes into frames the agent takes. */
export function frames(b: Uint8Array<ArrayBuffer>): Uint8Array<ArrayBuffer>[] {
  const out: Uint8Array<ArrayBuffer>[] = [];
  for (let off = 0; off < b.length; off += maxFrame) out.push(b.subarray(off, off + maxFrame));
  return out;
}

/** A text frame of the agent: the session's end or the call's failure. */
export function parseControl(text: string): ConsoleState | undefined {
  let m: { closed?: { reason?: string; exitStatus?: number }; error?: { code?: string; message?: string } };
  try {
    m = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (m.closed) {
    return { kind: "closed", reason: m.closed.reason || "the console ended", exitStatus: m.closed.exitStatus ?? 0 };
  }
  if (m.error) {
    return { kind: "failed", problem: connectProblem(m.error.code, m.error.message) };
  }
  return undefined;
}

/** A Connect-style error ({code, message}) as the UI words it. */
export function connectProblem(code: string | undefined, message: string | undefined): Problem {
  return problem(new ConnectError(message ?? "", codeFromString(code ?? "") ?? Code.Unknown));
}

/**
 * probe asks the agent why a console did not open: the same URL with a
 * plain GET runs the upgrade's checks. Answers the refusal, or undefined
 * when the console would open now (426) or the agent cannot be reached
 * (both mean: try again).
 */
export async function probe(id: string, size: Size | undefined, signal: AbortSignal): Promise<Problem | undefined> {
  const headers = new Headers();
  const t = bearer();
  if (t) headers.set("Authorization", `Bearer ${t}`);
  let res: Response;
  try {
    res = await fetch(consolePath(id, size), { headers, signal, cache: "no-store" });
  } catch {
    return undefined;
  }
  if (res.status === 426) return undefined;
  let body: { code?: string; message?: string } = {};
  try {
    body = await res.json();
  } catch {
    // not the agent's JSON (a proxy's page): the status says it
  }
  if (!body.code) {
    return { code: res.status >= 500 ? Code.Unavailable : Code.Unknown, message: `the console's address answered HTTP ${res.status} ${res.statusText}`.trim(), noLeader: false };
  }
  return connectProblem(body.code, body.message);
}

export interface SessionOptions {
  id: string;
  /** the terminal's size now, sent in the URL and after every (re)open */
  size: () => Size | undefined;
  output: (b: Uint8Array) => void;
  state: (s: ConsoleState) => void;
}

/**
 * ConsoleSession keeps one console open: it connects, reconnects after a
 * lost connection, and ends on the VM's closed, an error, or close().
 */
export class ConsoleSession {
  private ws?: WebSocket;
  private timer?: ReturnType<typeof setTimeout>;
  private attempt = 0;
  private done = false;
  private readonly ac = new AbortController();
  private readonly enc = new TextEncoder();

  constructor(private readonly o: SessionOptions) {
    this.connect();
  }

  /** Sends keystrokes (xterm's onData: UTF-8), in frames of at most 64 KiB. */
  send(data: string | Uint8Array<ArrayBuffer>): void {
    const ws = this.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    for (const f of frames(typeof data === "string" ? this.enc.encode(data) : data)) ws.send(f);
  }

  /** Sends the terminal's new size. */
  resize(s: Size): void {
    const ws = this.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN || !valid(s)) return;
    ws.send(JSON.stringify({ resize: { cols: s.cols, rows: s.rows } }));
  }

  /** Ends the session from this side (the view closes). */
  close(): void {
    this.finish({ kind: "ended", why: "the console was closed" }, false);
  }

  private connect(): void {
    if (this.done) return;
    this.o.state({ kind: "connecting" });
    const size = this.o.size();
    let ws: WebSocket;
    try {
      ws = new WebSocket(consoleURL(location, this.o.id, size), protocols(bearer()));
    } catch (e) {
      this.finish({ kind: "failed", problem: { code: Code.Internal, message: `cannot open the console: ${e instanceof Error ? e.message : e}`, noLeader: false } });
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    let opened = false;
    let last: ConsoleState | undefined; // a closed or error frame
    ws.onopen = () => {
      if (ws.protocol !== subprotocol) {
        last = { kind: "failed", problem: { code: Code.Unimplemented, message: `the agent did not speak the console's protocol ${subprotocol}`, noLeader: false } };
        ws.close(1000);
        return;
      }
      opened = true;
      this.attempt = 0;
      this.o.state({ kind: "open" });
      const s = this.o.size();
      if (s) this.resize(s);
    };
    ws.onmessage = (ev) => {
      if (ev.data instanceof ArrayBuffer) {
        this.o.output(new Uint8Array(ev.data));
      } else if (typeof ev.data === "string") {
        last = parseControl(ev.data) ?? last;
      }
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws || this.done) return;
      this.ws = undefined;
      if (last) {
        this.finish(last);
        return;
      }
      switch (classifyClose(ev.code, opened)) {
        case "ended":
          this.finish({ kind: "ended", why: ev.reason || "the agent ended the console" });
          return;
        case "refused":
          this.finish({ kind: "failed", problem: closeProblem(ev.code, ev.reason) });
          return;
        case "retry":
          this.retry(`the connection to the agent was lost (${ev.code})`);
          return;
        case "probe":
          probe(this.o.id, size, this.ac.signal).then((p) => {
            if (this.done) return;
            if (!p) this.retry("the agent could not be reached");
            else if (transient(p)) this.retry(p.message, p);
            else this.finish({ kind: "failed", problem: p });
          });
      }
    };
  }

  /** retry connects again after the backoff; past the last try the session fails with last (or why). */
  private retry(why: string, last?: Problem): void {
    this.attempt++;
    const delay = retryDelay(this.attempt);
    if (delay === undefined) {
      this.finish({
        kind: "failed",
        problem: last ?? { code: Code.Unavailable, message: `${why}, and ${backoff.attempts} attempts to connect again failed`, noLeader: false },
      });
      return;
    }
    this.o.state({ kind: "reconnecting", attempt: this.attempt, delay, why });
    this.timer = setTimeout(() => this.connect(), delay);
  }

  private finish(s: ConsoleState, report = true): void {
    if (this.done) return;
    this.done = true;
    clearTimeout(this.timer);
    this.ac.abort();
    const ws = this.ws;
    this.ws = undefined;
    if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000);
    if (s.kind === "failed" && s.problem.code === Code.Unauthenticated) {
      forget(); // the token expired or was refused: log in again
    }
    if (report) this.o.state(s);
  }
}
