// Cluster settings (the replicated config keys) with each key's history
// and a diff between two revisions, followed with blocking queries on
// ListConfig and ConfigHistory. A setting is set after a dry run shows
// the change (pvcli config set --dry-run), and rolled back to an earlier
// revision (pvcli config rollback), each only if the key is still at the
// revision the diff was made from.
import { useEffect, useState } from "preact/hooks";
import { diffLines } from "diff";
import { client } from "../api";
import { ActionBar, Empty, ErrorBox, FormDialog, Input, Link, Loading, Outcome, PageHeader, Table, TextArea, fmtTime, useAction, type ActionState } from "../components";
import { can, useSession } from "../session";
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
      <SetButton />
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
  const act = useAction();
  return (
    <section>
      <PageHeader title={`Setting ${props.name}`} />
      <Link href={href("settings")}>← All settings</Link>
      <Outcome state={act} />
      {revs.length > 0 && <KeyActions name={props.name} current={revs[0]} target={older} act={act} />}
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

/** SetButton opens the set form for a new or existing key. */
function SetButton() {
  const act = useAction();
  const [open, setOpen] = useState(false);
  if (!useCanSet()) return null;
  return (
    <div class="actions">
      <button type="button" class="primary" onClick={() => setOpen(true)}>
        Set a setting
      </button>
      <Outcome state={act} />
      <SetForm open={open} onClose={() => setOpen(false)} act={act} />
    </div>
  );
}

function useCanSet(): boolean {
  return can(useSession(), "ClusterService/SetConfig");
}

/**
 * SetForm sets a key in two steps: Check runs the write as a dry run and
 * shows the diff from the value stored now; Set writes it, only if the key
 * is still at the revision the diff was made from.
 */
function SetForm(props: { open: boolean; name?: string; value?: string; onClose: () => void; act: ActionState }) {
  const [key, setKey] = useState(props.name ?? "");
  const [value, setValue] = useState(props.value ?? "");
  const [checked, setChecked] = useState<{ key: string; value: string; before: string; revision: bigint } | undefined>();
  useEffect(() => {
    if (!props.open) return;
    setKey(props.name ?? "");
    setValue(props.value ?? "");
    setChecked(undefined);
  }, [props.open]);
  const fresh = checked && checked.key === key.trim() && checked.value === value;
  const submit = async (): Promise<void | "stay"> => {
    const k = key.trim();
    if (!k) throw new Error("Key: give the setting's key (logging.level) or a kv/ key");
    if (!fresh) {
      const r = await client(ClusterService).setConfig({ key: k, value, dryRun: true });
      setChecked({ key: k, value, before: r.entry?.value ?? "", revision: r.entry?.revision ?? 0n });
      return "stay";
    }
    const r = await client(ClusterService).setConfig({ key: k, value, casRevision: checked.revision });
    props.act.say(`Set ${k}: revision ${r.entry?.revision ?? "?"}.`);
  };
  return (
    <FormDialog open={props.open} title={props.name ? `Set ${props.name}` : "Set a setting"} action={fresh ? "Set" : "Check"} submit={submit} onClose={props.onClose}>
      {!props.name && <Input label="Key" name="key" value={key} onInput={setKey} required placeholder="logging.level" />}
      <TextArea label="Value" name="value" value={value} onInput={setValue} hint="The key's YAML as in the agent's configuration file. Check shows the change; nothing is stored until Set." />
      {fresh && (
        <div data-testid="dry-run">
          <p role="status">
            The value is valid. {checked.revision ? `The change from revision ${checked.revision}:` : "The key is not set yet:"}
          </p>
          <Diff a={checked.before} b={checked.value} />
        </div>
      )}
    </FormDialog>
  );
}

/** KeyActions: set a new value, roll back to the revision chosen as "from" in the diff. */
function KeyActions(props: { name: string; current: ConfigEntry; target?: ConfigEntry; act: ActionState }) {
  const [editing, setEditing] = useState(false);
  const set = useCanSet();
  if (!set) return <p class="sub">Your roles may not change this setting.</p>;
  const t = props.target;
  return (
    <ActionBar
      target={props.name}
      act={props.act}
      actions={
        t && t.revision !== props.current.revision
          ? [
              {
                label: `Roll back to revision ${t.revision}`,
                danger: true,
                confirm: (
                  <>
                    <p>
                      This sets {props.name} back to its value of revision {t.revision.toString()}, if it is still at revision {props.current.revision.toString()}:
                    </p>
                    <Diff a={props.current.value} b={t.value} />
                  </>
                ),
                run: () => client(ClusterService).setConfig({ key: props.name, value: t.value, casRevision: props.current.revision }),
              },
            ]
          : []
      }
    >
      <button type="button" onClick={() => setEditing(true)}>
        Set a new value
      </button>
      <SetForm open={editing} name={props.name} value={props.current.value} onClose={() => setEditing(false)} act={props.act} />
    </ActionBar>
  );
}
