// VMs, volumes and networks across every node, with their host and owner,
// followed with the Watch streams (the agent merges every node's). A VM's
// page offers the power actions the caller's role allows, each confirmed.
import { useEffect, useRef, useState } from "preact/hooks";
import type { ComponentChildren } from "preact";
import { client, problem, type Problem } from "../api";
import { Badge, Confirm, Empty, ErrorBox, Link, Live, Loading, PageHeader, Table, fmtBytes, fmtTime, type Column, type Tone } from "../components";
import { useStream } from "../live";
import { PowerState, VMService, EventType as VMEvent, type VM } from "../gen/pivirt/vm/v1/vm_pb";
import { StorageService, EventType as VolumeEvent, type Volume } from "../gen/pivirt/storage/v1/storage_pb";
import { NetworkService, EventType as NetworkEvent, type Network } from "../gen/pivirt/network/v1/network_pb";
import type { ObjectMeta } from "../gen/pivirt/api/v1/api_pb";
import { href } from "../router";
import { decision, useSession } from "../session";

type Kind = "vms" | "volumes" | "networks";

interface Obj {
  id: string;
  name: string;
  host: string;
  metadata?: ObjectMeta;
}

const titles: Record<Kind, [string, string]> = { vms: ["VMs", "VM"], volumes: ["Volumes", "Volume"], networks: ["Networks", "Network"] };
/** lower: the plural inside a sentence */
const lower: Record<Kind, string> = { vms: "VMs", volumes: "volumes", networks: "networks" };

function powerTone(s: PowerState): Tone {
  return s === PowerState.RUNNING ? "ok" : s === PowerState.SHUTTING_DOWN ? "warn" : "muted";
}

export function powerState(s: PowerState): string {
  return (PowerState[s] ?? "unknown").toLowerCase().replace(/_/g, " ");
}

/** useWatch keeps the objects of a watch: the existing ones, then every change. */
function useWatch(kind: Kind) {
  const [objs, setObjs] = useState<Map<string, Obj> | undefined>();
  const apply = (deleted: boolean, o: Obj | undefined) => {
    if (!o) return;
    setObjs((m) => {
      const n = new Map(m ?? []);
      if (deleted) n.delete(o.id);
      else n.set(o.id, o);
      return n;
    });
  };
  const open = (signal: AbortSignal): AsyncIterable<{ deleted: boolean; obj?: Obj }> => {
    switch (kind) {
      case "vms":
        return map(client(VMService).watchVMs({}, { signal }), (m) => ({ deleted: m.type === VMEvent.DELETED, obj: m.vm }));
      case "volumes":
        return map(client(StorageService).watchVolumes({}, { signal }), (m) => ({ deleted: m.type === VolumeEvent.DELETED, obj: m.volume }));
      case "networks":
        return map(client(NetworkService).watchNetworks({}, { signal }), (m) => ({ deleted: m.type === NetworkEvent.DELETED, obj: m.network }));
    }
  };
  // A new stream replays what exists: start from an empty set, keeping the
  // old one on screen until the first message.
  const fresh = useRef(false);
  const state = useStream(
    open,
    (m) => {
      if (fresh.current) {
        fresh.current = false;
        setObjs(new Map());
      }
      apply(m.deleted, m.obj);
    },
    [kind],
    () => {
      fresh.current = true;
    },
  );
  return { objs, ...state };
}

async function* map<A, B>(src: AsyncIterable<A>, f: (a: A) => B): AsyncIterable<B> {
  for await (const a of src) yield f(a);
}

function columns(kind: Kind): Column<Obj>[] {
  const name: Column<Obj> = { title: "Name", cell: (o) => <Link href={href(kind, o.id)}>{o.name || o.id}</Link> };
  const host: Column<Obj> = { title: "Host", cell: (o) => o.host || "—" };
  const owner: Column<Obj> = { title: "Owner", cell: (o) => o.metadata?.owner || "—" };
  switch (kind) {
    case "vms":
      return [
        name,
        { title: "Power", cell: (o) => <span data-testid={`power-${o.id}`}><Badge tone={powerTone((o as VM).powerState)}>{powerState((o as VM).powerState)}</Badge></span> },
        host,
        owner,
        { title: "vCPUs", cell: (o) => (o as VM).vcpus, class: "num" },
        { title: "Memory", cell: (o) => fmtBytes(BigInt((o as VM).memoryMib) * 1048576n), class: "num" },
      ];
    case "volumes":
      return [name, host, owner, { title: "Size", cell: (o) => fmtBytes((o as Volume).sizeBytes), class: "num" }, { title: "IQN", cell: (o) => <code>{(o as Volume).iqn}</code> }];
    case "networks":
      return [name, host, owner, { title: "CIDR", cell: (o) => <code>{(o as Network).cidr}</code> }, { title: "VLAN", cell: (o) => (o as Network).vlan || "untagged", class: "num" }];
  }
}

export function Resources(props: { kind: Kind; id?: string; sub?: string }) {
  const w = useWatch(props.kind);
  const [plural, singular] = titles[props.kind];
  if (props.kind === "vms" && props.id && props.sub === "console") {
    // Opened also when the watch does not show the VM: the agent says why
    // its console does not open (another owner's VM, a VM that is gone).
    return <LazyConsole id={props.id} vm={w.objs?.get(props.id) as VM | undefined} loaded={!!w.objs} />;
  }
  if (props.id) {
    const o = w.objs?.get(props.id);
    return (
      <section>
        <PageHeader title={`${singular} ${o?.name || props.id}`}>
          <Live connected={w.connected} />
        </PageHeader>
        <Link href={href(props.kind)}>← All {lower[props.kind]}</Link>
        {w.error && <ErrorBox problem={w.error} what={lower[props.kind]} stale={!!w.objs} />}
        {!w.objs ? <Loading what={singular} /> : !o ? <Empty>No {singular} {props.id} (it may have been deleted, or your role may not see it).</Empty> : <Detail kind={props.kind} obj={o} />}
      </section>
    );
  }
  const rows = [...(w.objs?.values() ?? [])].sort((a, b) => (a.name || a.id).localeCompare(b.name || b.id));
  return (
    <section>
      <PageHeader title={plural}>
        <Live connected={w.connected} />
      </PageHeader>
      {w.error && <ErrorBox problem={w.error} what={lower[props.kind]} stale={!!w.objs} />}
      {!w.objs ? (
        w.error ? null : <Loading what={lower[props.kind]} />
      ) : rows.length === 0 ? (
        <Empty>No {lower[props.kind]} on any node{w.error ? " that answered" : ""}.</Empty>
      ) : (
        <Table<Obj> caption={plural} rows={rows} rowKey={(o) => o.id} columns={columns(props.kind)} />
      )}
    </section>
  );
}

function Field(props: { name: string; children: ComponentChildren }) {
  return (
    <>
      <dt>{props.name}</dt>
      <dd>{props.children}</dd>
    </>
  );
}

function Detail(props: { kind: Kind; obj: Obj }) {
  const o = props.obj;
  return (
    <>
      <dl class="fields">
        <Field name="ID">
          <code>{o.id}</code>
        </Field>
        <Field name="Host">{o.host || "—"}</Field>
        <Field name="Owner">{o.metadata?.owner || "—"}</Field>
        <Field name="Created">{fmtTime(o.metadata?.createTime)}</Field>
        <Field name="Updated">{fmtTime(o.metadata?.updateTime)}</Field>
        {props.kind === "vms" && (
          <>
            <Field name="Power">
              <span data-testid="power">
                <Badge tone={powerTone((o as VM).powerState)}>{powerState((o as VM).powerState)}</Badge>
              </span>
            </Field>
            <Field name="vCPUs">{(o as VM).vcpus}</Field>
            <Field name="Memory">{fmtBytes(BigInt((o as VM).memoryMib) * 1048576n)}</Field>
            <Field name="Disks">{(o as VM).disks.length ? (o as VM).disks.map((d) => <Link href={href("volumes", d)}>{d}</Link>) : "—"}</Field>
            <Field name="Networks">{(o as VM).networks.length ? (o as VM).networks.map((n) => <Link href={href("networks", n)}>{n}</Link>) : "—"}</Field>
          </>
        )}
        {props.kind === "volumes" && (
          <>
            <Field name="Size">{fmtBytes((o as Volume).sizeBytes)}</Field>
            <Field name="IQN">
              <code>{(o as Volume).iqn}</code>
            </Field>
            <Field name="Uploaded">{fmtBytes((o as Volume).writtenBytes)}</Field>
          </>
        )}
        {props.kind === "networks" && (
          <>
            <Field name="CIDR">
              <code>{(o as Network).cidr}</code>
            </Field>
            <Field name="VLAN">{(o as Network).vlan || "untagged"}</Field>
            <Field name="MTU">{(o as Network).mtu || 1500}</Field>
          </>
        )}
      </dl>
      {props.kind === "vms" && <Actions vm={o as VM} />}
      {props.kind === "vms" && <ConsoleLink vm={o as VM} />}
      {props.kind === "vms" && (
        <p>
          <Link href={`${href("schedules")}?vm=${encodeURIComponent(o.id)}`}>Power schedules of this VM</Link>
        </p>
      )}
    </>
  );
}

type ConsoleModule = typeof import("./console");

/** LazyConsole loads the console's code (xterm.js) when a console opens. */
function LazyConsole(props: { id: string; vm?: VM; loaded: boolean }) {
  const [mod, setMod] = useState<ConsoleModule | undefined>();
  const [err, setErr] = useState<Problem | undefined>();
  useEffect(() => {
    import("./console").then(setMod, (e) => setErr(problem(e)));
  }, []);
  if (err) return <ErrorBox problem={err} what="the console's code did not load" />;
  if (!mod) return <Loading what="the console" />;
  return <mod.ConsoleView {...props} />;
}

/** ConsoleLink opens the VM's console: offered when the caller may use it and the VM runs. */
function ConsoleLink(props: { vm: VM }) {
  const s = useSession();
  if (decision(s, "VMService/Console") === "denied" || props.vm.powerState !== PowerState.RUNNING) return null;
  return (
    <p>
      <Link href={href("vms", props.vm.id, "console")} class="button">
        Console
      </Link>
    </p>
  );
}

interface Action {
  method: string;
  label: string;
  verb: string;
  danger: boolean;
  when: (s: PowerState) => boolean;
  run: (id: string) => Promise<unknown>;
}

const actions: Action[] = [
  { method: "VMService/PowerOn", label: "Start", verb: "start", danger: false, when: (s) => s !== PowerState.RUNNING, run: (id) => client(VMService).powerOn({ id }) },
  { method: "VMService/ShutdownDefault", label: "Stop", verb: "shut down (the guest is asked, then the power is cut after 60 s)", danger: true, when: (s) => s === PowerState.RUNNING, run: (id) => client(VMService).shutdownDefault({ id }) },
  { method: "VMService/Reboot", label: "Reboot", verb: "reboot", danger: true, when: (s) => s === PowerState.RUNNING, run: (id) => client(VMService).reboot({ id }) },
  { method: "VMService/PowerOff", label: "Power off", verb: "power off (the power is cut at once)", danger: true, when: (s) => s !== PowerState.STOPPED, run: (id) => client(VMService).powerOff({ id }) },
];

function Actions(props: { vm: VM }) {
  const s = useSession();
  const [pending, setPending] = useState<Action | undefined>();
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState<Problem | undefined>();
  const [done, setDone] = useState<string | undefined>();
  const allowed = actions.filter((a) => decision(s, a.method) !== "denied");
  if (allowed.length === 0) {
    return <p class="sub">Your roles may not change this VM's power.</p>;
  }
  const go = async (a: Action) => {
    setPending(undefined);
    setBusy(true);
    setErr(undefined);
    setDone(undefined);
    try {
      await a.run(props.vm.id);
      setDone(`${a.label}: done.`);
    } catch (e) {
      setErr(problem(e));
    } finally {
      setBusy(false);
    }
  };
  return (
    <div class="actions" role="group" aria-label="Power actions">
      {allowed.map((a) => (
        <button type="button" class={a.danger ? "danger" : "primary"} disabled={busy || !a.when(props.vm.powerState)} onClick={() => setPending(a)}>
          {a.label}
        </button>
      ))}
      {done && (
        <p role="status" class="ok-text">
          {done}
        </p>
      )}
      {err && <ErrorBox problem={err} what="the action failed" />}
      <Confirm
        open={!!pending}
        title={pending ? `${pending.label} ${props.vm.name || props.vm.id}?` : ""}
        action={pending?.label ?? ""}
        danger={pending?.danger}
        onCancel={() => setPending(undefined)}
        onConfirm={() => pending && go(pending)}
      >
        <p>
          This will {pending?.verb} the VM <strong>{props.vm.name || props.vm.id}</strong> on {props.vm.host || "its node"}.
        </p>
      </Confirm>
    </div>
  );
}
