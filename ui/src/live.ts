// Live data: every view follows the agent's server streams or blocking
// queries, never a polling loop. A stream or query that fails is opened
// again after a backoff (1 s doubling to 30 s), and the view shows the
// error with the data it last had.
import { useEffect, useRef, useState } from "preact/hooks";
import { Code } from "@connectrpc/connect";
import { problem, type Problem } from "./api";

const minBackoff = 1000;
const maxBackoff = 30_000;

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(t);
      resolve();
    });
  });
}

/** Errors a retry cannot mend: the view shows them and stops. */
function final(p: Problem): boolean {
  return [Code.PermissionDenied, Code.Unauthenticated, Code.InvalidArgument, Code.NotFound, Code.Unimplemented].includes(p.code);
}

export interface StreamState {
  error?: Problem;
  /** connected: the stream is open and its first message arrived. */
  connected: boolean;
}

/**
 * useStream follows a server stream: open is called again (after a
 * backoff) whenever the stream ends or fails; onMessage sees every message;
 * onOpen runs before each (re)open, to reset what a new stream replays.
 */
export function useStream<T>(
  open: (signal: AbortSignal) => AsyncIterable<T>,
  onMessage: (m: T) => void,
  deps: unknown[],
  onOpen?: () => void,
): StreamState {
  const [state, setState] = useState<StreamState>({ connected: false });
  const handler = useRef(onMessage);
  handler.current = onMessage;
  const opener = useRef(onOpen);
  opener.current = onOpen;
  useEffect(() => {
    const ac = new AbortController();
    (async () => {
      let backoff = minBackoff;
      while (!ac.signal.aborted) {
        opener.current?.();
        try {
          let first = true;
          for await (const m of open(ac.signal)) {
            if (first) {
              first = false;
              backoff = minBackoff;
              setState({ connected: true });
            }
            handler.current(m);
          }
          if (ac.signal.aborted) return;
          setState((s) => ({ ...s, connected: false }));
        } catch (e) {
          if (ac.signal.aborted) return;
          const p = problem(e);
          setState({ connected: false, error: p });
          if (final(p)) return;
        }
        await sleep(backoff, ac.signal);
        backoff = Math.min(backoff * 2, maxBackoff);
      }
    })();
    return () => ac.abort();
  }, deps);
  return state;
}

export interface QueryState<T> {
  data?: T;
  error?: Problem;
  loading: boolean;
}

/**
 * useBlocking follows a read with blocking queries: query is called with
 * the index of the last answer (0 the first time) and answers the data and
 * its index; the agent holds the call until the state moves past it.
 */
export function useBlocking<T>(query: (waitIndex: bigint, signal: AbortSignal) => Promise<{ data: T; index: bigint }>, deps: unknown[]): QueryState<T> {
  const [state, setState] = useState<QueryState<T>>({ loading: true });
  useEffect(() => {
    const ac = new AbortController();
    setState({ loading: true });
    (async () => {
      let index = 0n;
      let backoff = minBackoff;
      while (!ac.signal.aborted) {
        try {
          const r = await query(index, ac.signal);
          if (ac.signal.aborted) return;
          // Consul's rules for blocking queries: an index that went back
          // (a restore) reads once more at once; an index of 0 (nothing
          // written yet) waits past 1, which the first write passes.
          index = r.index < index ? 0n : r.index > 0n ? r.index : 1n;
          backoff = minBackoff;
          setState({ data: r.data, loading: false });
        } catch (e) {
          if (ac.signal.aborted) return;
          const p = problem(e);
          setState((s) => ({ data: s.data, error: p, loading: false }));
          if (final(p)) return;
          await sleep(backoff, ac.signal);
          backoff = Math.min(backoff * 2, maxBackoff);
          index = 0n;
        }
      }
    })();
    return () => ac.abort();
  }, deps);
  return state;
}

/** useOnce runs a call once per deps and keeps its answer. */
export function useOnce<T>(call: (signal: AbortSignal) => Promise<T>, deps: unknown[]): QueryState<T> & { reload: () => void } {
  const [state, setState] = useState<QueryState<T>>({ loading: true });
  const [n, setN] = useState(0);
  useEffect(() => {
    const ac = new AbortController();
    setState((s) => ({ data: s.data, loading: true }));
    call(ac.signal).then(
      (data) => !ac.signal.aborted && setState({ data, loading: false }),
      (e) => !ac.signal.aborted && setState({ error: problem(e), loading: false }),
    );
    return () => ac.abort();
  }, [...deps, n]);
  return { ...state, reload: () => setN((x) => x + 1) };
}
