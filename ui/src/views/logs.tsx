// A node's log as it is written (AgentService.Monitor; the agent asked
// relays another node's stream).
import { useRef, useState } from "preact/hooks";
import { client } from "../api";
import { ErrorBox, Live, PageHeader } from "../components";
import { useStream } from "../live";
import { AgentService } from "../gen/pivirt/cluster/v1/agent_pb";
import { href, navigate } from "../router";
import { useSession } from "../session";

const keep = 1000;
const levels = ["trace", "debug", "info", "warn", "error"];

export function Logs(props: { node?: string }) {
  const s = useSession();
  const node = props.node ?? s.who.node;
  const [level, setLevel] = useState("info");
  const [lines, setLines] = useState<string[]>([]);
  const [dropped, setDropped] = useState(0n);
  const [paused, setPaused] = useState(false);
  const pausedRef = useRef(false);
  pausedRef.current = paused;
  const stream = useStream(
    (signal) => client(AgentService).monitor({ node, level }, { signal }),
    (m) => {
      if (m.dropped) setDropped((d) => d + m.dropped);
      if (!m.line || pausedRef.current) return;
      setLines((ls) => [...ls, m.line].slice(-keep));
    },
    [node, level],
    () => setLines([]),
  );
  const [nodeInput, setNodeInput] = useState(node);
  return (
    <section>
      <PageHeader title={`Log of ${node}`}>
        <Live connected={stream.connected} />
      </PageHeader>
      <form
        class="toolbar"
        onSubmit={(e) => {
          e.preventDefault();
          navigate(href("logs", nodeInput));
        }}
      >
        <label>
          Node <input value={nodeInput} onInput={(e) => setNodeInput((e.target as HTMLInputElement).value)} />
        </label>
        <button type="submit">Show</button>
        <label>
          Level{" "}
          <select value={level} onChange={(e) => setLevel((e.target as HTMLSelectElement).value)}>
            {levels.map((l) => (
              <option value={l}>{l}</option>
            ))}
          </select>
        </label>
        <button type="button" onClick={() => setPaused(!paused)} aria-pressed={paused}>
          {paused ? "Resume" : "Pause"}
        </button>
      </form>
      {stream.error && <ErrorBox problem={stream.error} what={`the log of ${node}`} />}
      {dropped > 0n && <p class="hint">{dropped.toString()} lines were dropped: the stream was read too slowly.</p>}
      <pre class="log" role="log" tabIndex={0} aria-label={`Log lines of ${node}`} aria-live="off" data-testid="log">
        {lines.join("\n")}
      </pre>
    </section>
  );
}
