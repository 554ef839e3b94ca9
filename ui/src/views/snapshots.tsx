// Snapshots: save the cluster's state to a download (SaveSnapshot),
// inspect an archive before restoring it (PlanRestore: what it would
// change, checked as a restore would), then restore it, confirmed.
import { useState } from "preact/hooks";
import { client, problem, uploadClient, type Problem } from "../api";
import { Confirm, ErrorBox, PageHeader, Table, fmtBytes, fmtTime } from "../components";
import { SnapshotService, type PlanRestoreResponse, type TableChange } from "../gen/pivirt/cluster/v1/snapshot_pb";
import { useCan } from "../session";

const chunk = 1 << 20;

export function Snapshots() {
  const canSave = useCan("SnapshotService/SaveSnapshot");
  const canPlan = useCan("SnapshotService/PlanRestore");
  return (
    <section>
      <PageHeader title="Snapshots" />
      {canSave && <Save />}
      {canPlan && <Inspect />}
    </section>
  );
}

function Save() {
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState<Problem | undefined>();
  const [saved, setSaved] = useState<{ url: string; name: string; size: number; index: bigint } | undefined>();
  const save = async () => {
    setBusy(true);
    setErr(undefined);
    try {
      const parts: Uint8Array[] = [];
      let id = "";
      let index = 0n;
      for await (const m of client(SnapshotService).saveSnapshot({})) {
        if (m.meta) {
          id = m.meta.id;
          index = m.meta.index;
        }
        parts.push(m.data);
      }
      const blob = new Blob(parts as BlobPart[], { type: "application/octet-stream" });
      if (saved) URL.revokeObjectURL(saved.url);
      setSaved({ url: URL.createObjectURL(blob), name: `pivirt-${id || "snapshot"}.snap`, size: blob.size, index });
    } catch (e) {
      setErr(problem(e));
    } finally {
      setBusy(false);
    }
  };
  return (
    <>
      <h2>Save</h2>
      <p class="sub">An archive of the whole cluster state, taken on the leader (pvcli snapshot save).</p>
      <button type="button" class="primary" onClick={save} disabled={busy}>
        {busy ? "Taking the snapshot…" : "Take a snapshot"}
      </button>
      {err && <ErrorBox problem={err} what="snapshot" />}
      {saved && (
        <p role="status">
          Snapshot at index {saved.index.toString()}, {fmtBytes(saved.size)}:{" "}
          <a href={saved.url} download={saved.name}>
            download {saved.name}
          </a>
        </p>
      )}
    </>
  );
}

async function* chunks(data: Uint8Array) {
  for (let off = 0; off < data.length || off === 0; off += chunk) {
    yield { data: data.subarray(off, off + chunk) };
    if (data.length === 0) return;
  }
}

function Inspect() {
  const canRestore = useCan("SnapshotService/RestoreSnapshot");
  const [file, setFile] = useState<{ name: string; data: Uint8Array } | undefined>();
  const [plan, setPlan] = useState<PlanRestoreResponse | undefined>();
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState<Problem | undefined>();
  const [confirm, setConfirm] = useState(false);
  const [restored, setRestored] = useState<string | undefined>();

  const pick = async (e: Event) => {
    const f = (e.target as HTMLInputElement).files?.[0];
    setPlan(undefined);
    setErr(undefined);
    setRestored(undefined);
    if (!f) return;
    const data = new Uint8Array(await f.arrayBuffer());
    setFile({ name: f.name, data });
    setBusy(true);
    try {
      setPlan(await uploadClient(SnapshotService).planRestore(chunks(data)));
    } catch (e) {
      setErr(problem(e));
    } finally {
      setBusy(false);
    }
  };
  const restore = async () => {
    setConfirm(false);
    if (!file) return;
    setBusy(true);
    setErr(undefined);
    try {
      const r = await uploadClient(SnapshotService).restoreSnapshot(chunks(file.data));
      setRestored(`Restored ${file.name}: the cluster holds its state from index ${r.index}.`);
    } catch (e) {
      setErr(problem(e));
    } finally {
      setBusy(false);
    }
  };
  return (
    <>
      <h2>Inspect and restore</h2>
      <p class="sub">Nothing changes until you restore: the archive is checked as a restore would check it (pvcli snapshot restore --dry-run).</p>
      <label class="file">
        Archive <input type="file" accept=".snap,application/octet-stream" onChange={pick} disabled={busy} />
      </label>
      {busy && <p role="status">Checking {file?.name}…</p>}
      {err && <ErrorBox problem={err} what={file ? file.name : "archive"} />}
      {plan && (
        <div data-testid="plan">
          <dl class="fields">
            <dt>Snapshot</dt>
            <dd>{plan.meta?.id}</dd>
            <dt>Index / term</dt>
            <dd>
              {plan.meta?.index.toString()} / {plan.meta?.term.toString()}
            </dd>
            <dt>Taken</dt>
            <dd>{fmtTime(plan.meta?.createdAt)}</dd>
            <dt>By agent</dt>
            <dd>{plan.meta?.agentVersion}</dd>
            <dt>Cluster</dt>
            <dd>
              {plan.meta?.clusterId}
              {plan.plan?.archiveClusterId && " (another cluster's: this cluster's ID is kept)"}
            </dd>
          </dl>
          <Table<TableChange>
            caption="What the restore changes"
            rows={plan.plan?.tables ?? []}
            rowKey={(t) => t.table}
            columns={[
              { title: "Table", cell: (t) => t.table },
              { title: "Added", cell: (t) => t.added.toString(), class: "num" },
              { title: "Removed", cell: (t) => t.removed.toString(), class: "num" },
              { title: "Changed", cell: (t) => t.changed.toString(), class: "num" },
              { title: "After", cell: (t) => t.records.toString(), class: "num" },
            ]}
          />
          {(plan.plan?.configKeys.length ?? 0) > 0 && <p>Settings changed: {plan.plan!.configKeys.join(", ")}</p>}
          {plan.plan?.rbacPolicyChanged && <p class="banner warn">The cluster-wide RBAC policy changes.</p>}
          {canRestore && (
            <button type="button" class="danger" onClick={() => setConfirm(true)} disabled={busy}>
              Restore this archive
            </button>
          )}
        </div>
      )}
      {restored && <p role="status">{restored}</p>}
      <Confirm open={confirm} title={`Restore ${file?.name}?`} action="Restore" danger onCancel={() => setConfirm(false)} onConfirm={restore}>
        <p>The state of the whole cluster is replaced with the archive's. The Raft membership and this cluster's CA and ID are kept.</p>
      </Confirm>
    </>
  );
}
