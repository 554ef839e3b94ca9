// A VM's serial console in xterm.js: the terminal follows its box's size
// (the fit addon, on every resize of the box or window) and sends it to
// the VM; selection copies (Ctrl+Shift+C, or the browser's Copy), and the
// browser's paste (Ctrl+V, Ctrl+Shift+V, Shift+Insert, the context menu)
// types the text. A lost connection is opened again after a backoff, said
// in the terminal; the session's end says why. Loaded when a console
// opens (a chunk of its own); xterm's CSS is in the app's stylesheet
// (main.tsx), never a <style> of the page (inertstyle.ts).
import { useEffect, useRef, useState } from "preact/hooks";
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { ErrorBox, Link, Loading } from "../components";
import { backoff, ConsoleSession, type ConsoleState } from "../console";
import { adopt } from "../inertstyle";
import { href } from "../router";
import { PowerState, type VM } from "../gen/pivirt/vm/v1/vm_pb";

const theme = {
  background: "#0f1318",
  foreground: "#e6eaf0",
  cursor: "#ff9f1c",
  cursorAccent: "#0f1318",
  selectionBackground: "#3d5a80",
};

/** notice: a line of the console's own, set apart from the VM's output. */
function notice(text: string): string {
  return `\r\n\x1b[1;33m[${text}]\x1b[0m\r\n`;
}

function describe(s: ConsoleState, opened: boolean): string {
  switch (s.kind) {
    case "connecting":
      return "Connecting…";
    case "open":
      return "Connected.";
    case "reconnecting":
      return `Connecting again in ${Math.round(s.delay / 1000)} s (attempt ${s.attempt} of ${backoff.attempts}): ${s.why}.`;
    case "closed":
      return `The session ended: ${s.reason}${s.exitStatus ? ` (exit status ${s.exitStatus})` : ""}.`;
    case "ended":
      return `The session ended: ${s.why}.`;
    case "failed":
      return opened ? "The console failed." : "The console did not open.";
  }
}

/**
 * ConsoleView opens the console of VM id. vm is the VM as the watch has
 * it (undefined when the caller's watch does not show it: the agent
 * then answers why the console does not open).
 */
export function ConsoleView(props: { id: string; vm?: VM; loaded: boolean }) {
  const box = useRef<HTMLDivElement>(null);
  const [state, setState] = useState<ConsoleState>({ kind: "connecting" });
  const [generation, setGeneration] = useState(0);
  const stopped = props.vm !== undefined && props.vm.powerState !== PowerState.RUNNING;
  // The VM's power decides whether a console starts, not when it ends: a
  // VM that stops ends its session from its side, which says so.
  const [started, setStarted] = useState(false);
  useEffect(() => {
    if (props.loaded && !stopped) setStarted(true);
  }, [props.loaded, stopped]);
  const opened = useRef(false);
  const name = props.vm?.name || props.id;
  // xterm's screen reader mode: the rows as an accessible tree, new
  // output announced (off by default: it costs a second copy of the rows).
  const [reader, setReader] = useState(false);
  const readerRef = useRef(reader);
  readerRef.current = reader;
  const termRef = useRef<Terminal | undefined>(undefined);
  useEffect(() => {
    if (termRef.current) termRef.current.options.screenReaderMode = reader;
  }, [reader]);

  useEffect(() => {
    const el = box.current;
    if (!started || !el) return;
    opened.current = false;
    const term = new Terminal({
      theme,
      fontFamily: 'ui-monospace, "SFMono-Regular", Menlo, Consolas, "DejaVu Sans Mono", monospace',
      fontSize: 14,
      lineHeight: 1.2, // room below the baseline: an underscore is not cut off
      cursorBlink: true,
      scrollback: 5000,
      screenReaderMode: readerRef.current,
    });
    termRef.current = term;
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(el);
    const textarea = el.querySelector("textarea");
    textarea?.setAttribute("aria-label", `Console of ${name}: type here`);
    const fitNow = () => {
      try {
        fit.fit();
      } catch {
        // not laid out (the view is going away)
      }
    };
    fitNow();

    const session = new ConsoleSession({
      id: props.id,
      size: () => ({ cols: term.cols, rows: term.rows }),
      output: (b) => term.write(b),
      state: (s) => {
        setState(s);
        switch (s.kind) {
          case "open":
            opened.current = true;
            term.focus();
            break;
          case "reconnecting":
            term.write(notice(describe(s, true)));
            break;
          case "closed":
          case "ended":
            term.write(notice(describe(s, true)));
            break;
          case "failed":
            // A console that never opened has only the error above it.
            if (opened.current) term.write(notice(s.problem.message));
            break;
        }
      },
    });
    const subs = [
      term.onData((d) => session.send(d)),
      // xterm's binary input (some mouse reports): one byte per char.
      term.onBinary((d) => session.send(Uint8Array.from(d, (c) => c.charCodeAt(0)))),
      term.onResize((s) => session.resize(s)),
    ];
    // Ctrl+Shift+C copies the selection (Ctrl+C is the VM's interrupt);
    // Ctrl+V and Ctrl+Shift+V are left to the browser, whose paste event
    // xterm types.
    term.attachCustomKeyEventHandler((e) => {
      if (e.type !== "keydown") return true;
      const key = e.key.toLowerCase();
      if (e.ctrlKey && e.shiftKey && key === "c" && term.hasSelection()) {
        e.preventDefault();
        navigator.clipboard?.writeText(term.getSelection()).catch(() => document.execCommand("copy"));
        return false;
      }
      if (e.ctrlKey && !e.altKey && key === "v") return false;
      return true;
    });
    let frame = 0;
    const ro = new ResizeObserver(() => {
      cancelAnimationFrame(frame);
      frame = requestAnimationFrame(fitNow);
    });
    ro.observe(el);
    return () => {
      ro.disconnect();
      cancelAnimationFrame(frame);
      session.close();
      subs.forEach((s) => s.dispose());
      termRef.current = undefined;
      term.dispose();
      adopt();
    };
  }, [props.id, started, generation]);

  const over = state.kind === "closed" || state.kind === "ended" || state.kind === "failed";
  // A console that never opened shows the agent's refusal, not an empty terminal.
  const refused = state.kind === "failed" && !opened.current;
  return (
    <section class="console-view">
      <h1>Console of {name}</h1>
      <Link href={href("vms", props.id)}>← VM {name}</Link>
      {!started && !props.loaded ? (
        <Loading what="the VM" />
      ) : !started && stopped ? (
        <p class="state empty">The VM is {PowerState[props.vm!.powerState].toLowerCase().replace(/_/g, " ")}: its console opens when it runs.</p>
      ) : (
        <>
          <p class={`console-state ${state.kind}`} role="status" data-testid="console-state">
            {describe(state, opened.current)}
          </p>
          {state.kind === "failed" && <ErrorBox problem={state.problem} what={opened.current ? "the console failed" : "the console did not open"} />}
          <div class={refused ? "console refused" : "console"} ref={box} data-testid="console" />
          <div class="actions">
            {over && (
              <button
                type="button"
                class="primary"
                onClick={() => {
                  setState({ kind: "connecting" });
                  setGeneration((g) => g + 1);
                }}
              >
                Connect again
              </button>
            )}
            <label>
              <input type="checkbox" checked={reader} onChange={(e) => setReader((e.target as HTMLInputElement).checked)} /> Screen reader mode
            </label>
            <p class="hint">Ctrl+Shift+C copies the selection; Ctrl+V pastes. Ctrl+C is sent to the VM.</p>
          </div>
        </>
      )}
    </section>
  );
}
