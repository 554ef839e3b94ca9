// Cluster settings (the replicated config keys) with each key's history
// and a diff between two revisions, followed with blocking queries on
// ListConfig and ConfigHistory.
import { useState } from "preact/hooks";
import { diffLines } from "diff";
import { client } from "../api";
import { Empty, ErrorBox, Link, Loading, PageHeader, Table, fmtTime } from "../components";
import { useBlocking } from "../live";
import { ClusterService, Consistency, type ConfigEntry } from "../gen/pivirt/cluster/v1/cluster_pb";
import { href } from "../router";
import { durationFromMs } from "@bufbuild/protobuf/wkt";

const blocking = (waitIndex: bigint) => ({ consistency: Consistency.STALE, waitIndex, waitTime: durationFromMs(60_000) });

export function Settings(props: { keyName?: string }) {
  return props.keyName ? <KeyHistory name={props.keyName} /> : <KeyList />;
}

function KeyList() {
  const q = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ClusterService).listConfig({ read: blocking(waitIndex) }, { signal, timeoutMs: 90_000 });
      return { data: r.entries, index: r.meta?.index ?? 0n };
    },
    [],
  );
  const rows = [...(q.data ?? [])].sort((a, b) => a.key.localeCompare(b.key));
  return (
    <section>
      <PageHeader title="Settings" />
      <p class="sub">Settings every agent applies over its own file (pvcli config set).</p>
      {q.error && <ErrorBox problem={q.error} what="settings" stale={!!q.data} />}
      {q.loading && !q.data ? (
        <Loading what="settings" />
      ) : rows.length === 0 ? (
        <Empty>No cluster settings: every agent runs on its own file.</Empty>
      ) : (
        <Table<ConfigEntry>
          caption="Settings"
          rows={rows}
          rowKey={(e) => e.key}
          columns={[
            { title: "Key", cell: (e) => <Link href={href("settings", e.key)}>{e.key}</Link> },
            { title: "Value", cell: (e) => <code class="value">{e.value}</code> },
            { title: "Revision", cell: (e) => e.revision.toString(), class: "num" },
            { title: "Updated", cell: (e) => fmtTime(e.updatedAt) },
          ]}
        />
      )}
    </section>
  );
}

function KeyHistory(props: { name: string }) {
  const q = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ClusterService).configHistory({ key: props.name, read: blocking(waitIndex) }, { signal, timeoutMs: 90_000 });
      return { data: r.entries, index: r.meta?.index ?? 0n };
    },
    [props.name],
  );
  const revs = [...(q.data ?? [])].sort((a, b) => Number(b.revision - a.revision));
  const [from, setFrom] = useState<string>("");
  const [to, setTo] = useState<string>("");
  const newer = revs.find((r) => r.revision.toString() === to) ?? revs[0];
  const older = revs.find((r) => r.revision.toString() === from) ?? revs[1];
  return (
    <section>
      <PageHeader title={`Setting ${props.name}`} />
      <Link href={href("settings")}>← All settings</Link>
      {q.error && <ErrorBox problem={q.error} what="history" stale={!!q.data} />}
      {q.loading && !q.data ? (
        <Loading what="the history" />
      ) : revs.length === 0 ? (
        <Empty>No history of {props.name}.</Empty>
      ) : (
        <>
          <h2>History</h2>
          <Table<ConfigEntry>
            caption={`History of ${props.name}`}
            rows={revs}
            rowKey={(e) => e.revision.toString()}
            columns={[
              { title: "Revision", cell: (e) => e.revision.toString(), class: "num" },
              { title: "Value", cell: (e) => <code class="value">{e.value}</code> },
              { title: "Updated", cell: (e) => fmtTime(e.updatedAt) },
            ]}
          />
          {revs.length > 1 && (
            <>
              <h2>Diff</h2>
              <div class="diff-pick">
                <label>
                  From revision{" "}
                  <select value={older?.revision.toString()} onChange={(e) => setFrom((e.target as HTMLSelectElement).value)}>
                    {revs.map((r) => (
                      <option value={r.revision.toString()}>{r.revision.toString()}</option>
                    ))}
                  </select>
                </label>
                <label>
                  to revision{" "}
                  <select value={newer?.revision.toString()} onChange={(e) => setTo((e.target as HTMLSelectElement).value)}>
                    {revs.map((r) => (
                      <option value={r.revision.toString()}>{r.revision.toString()}</option>
                    ))}
                  </select>
                </label>
              </div>
              {older && newer && <Diff a={older.value} b={newer.value} />}
            </>
          )}
        </>
      )}
    </section>
  );
}

function Diff(props: { a: string; b: string }) {
  const parts = diffLines(props.a.endsWith("\n") ? props.a : props.a + "\n", props.b.endsWith("\n") ? props.b : props.b + "\n");
  return (
    <pre class="diff" aria-label="Differences between the two revisions">
      {parts.map((p) => (
        <span class={p.added ? "add" : p.removed ? "del" : "same"}>
          {p.value
            .replace(/\n$/, "")
            .split("\n")
            .map((l) => `${p.added ? "+ " : p.removed ? "- " : "  "}${l}\n`)
            .join("")}
        </span>
      ))}
    </pre>
  );
}
