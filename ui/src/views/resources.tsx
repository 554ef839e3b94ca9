// VMs, volumes and networks across every node, with their host and owner,
// followed with the Watch streams (the agent merges every node's). Each
// list offers a create form and each object's page the actions the
// caller's role allows (a VM's power, edit, delete), the destructive ones
// confirmed; the outcome, or the agent's refusal in pvcli's words, is shown.
// A running VM's page links to its serial console (views/console.tsx,
// loaded when it opens).
import { useEffect, useRef, useState } from "preact/hooks";
import type { ComponentChildren } from "preact";
import { client, problem, type Problem } from "../api";
import { ClusterService } from "../gen/pivirt/cluster/v1/cluster_pb";
import { ActionBar, Badge, Empty, ErrorBox, FormDialog, Input, Link, Live, Loading, Outcome, PageHeader, Select, Table, fmtBytes, fmtTime, useAction, type ActionState, type Column, type Tone } from "../components";
import { useStream } from "../live";
import { PowerState, VMService, EventType as VMEvent, type VM } from "../gen/pivirt/vm/v1/vm_pb";
import { StorageService, EventType as VolumeEvent, type Volume } from "../gen/pivirt/storage/v1/storage_pb";
import { NetworkService, EventType as NetworkEvent, type Network } from "../gen/pivirt/network/v1/network_pb";
import type { ObjectMeta } from "../gen/pivirt/api/v1/api_pb";
import { href } from "../router";
import { can, decision, useSession } from "../session";

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
/** noun: the singular inside a sentence; article: with its article */
const noun: Record<Kind, string> = { vms: "VM", volumes: "volume", networks: "network" };
const article: Record<Kind, string> = { vms: "a VM", volumes: "a volume", networks: "a network" };

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
  const act = useAction();
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
        <Outcome state={act} />
        {!w.objs ? <Loading what={singular} /> : !o ? <Empty>No {singular} {props.id} (it may have been deleted, or your role may not see it).</Empty> : <Detail kind={props.kind} obj={o} act={act} />}
      </section>
    );
  }
  const rows = [...(w.objs?.values() ?? [])].sort((a, b) => (a.name || a.id).localeCompare(b.name || b.id));
  return (
    <section>
      <PageHeader title={plural}>
        <Live connected={w.connected} />
      </PageHeader>
      <Create kind={props.kind} />
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

function Detail(props: { kind: Kind; obj: Obj; act: ActionState }) {
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
      <Actions kind={props.kind} obj={o} act={props.act} />
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
  /** what the confirmation says the action does */
  verb: string;
  danger: boolean;
  when: (o: Obj) => boolean;
  run: (id: string) => Promise<unknown>;
}

const always = () => true;
const power = (f: (s: PowerState) => boolean) => (o: Obj) => f((o as VM).powerState);

const actions: Record<Kind, Action[]> = {
  vms: [
    { method: "VMService/PowerOn", label: "Start", verb: "start", danger: false, when: power((s) => s !== PowerState.RUNNING), run: (id) => client(VMService).powerOn({ id }) },
    { method: "VMService/ShutdownDefault", label: "Stop", verb: "shut down (the guest is asked, then the power is cut after 60 s)", danger: true, when: power((s) => s === PowerState.RUNNING), run: (id) => client(VMService).shutdownDefault({ id }) },
    { method: "VMService/Reboot", label: "Reboot", verb: "reboot", danger: true, when: power((s) => s === PowerState.RUNNING), run: (id) => client(VMService).reboot({ id }) },
    { method: "VMService/PowerOff", label: "Power off", verb: "power off (the power is cut at once)", danger: true, when: power((s) => s !== PowerState.STOPPED), run: (id) => client(VMService).powerOff({ id }) },
    { method: "VMService/DeleteVM", label: "Delete", verb: "delete (its disks and networks stay)", danger: true, when: power((s) => s === PowerState.STOPPED), run: (id) => client(VMService).deleteVM({ id }) },
  ],
  volumes: [{ method: "StorageService/DeleteVolume", label: "Delete", verb: "delete, with its data,", danger: true, when: always, run: (id) => client(StorageService).deleteVolume({ id }) }],
  networks: [{ method: "NetworkService/DeleteNetwork", label: "Delete", verb: "delete", danger: true, when: always, run: (id) => client(NetworkService).deleteNetwork({ id }) }],
};

/** Actions are the buttons of an object's page, each confirmed. */
function Actions(props: { kind: Kind; obj: Obj; act: ActionState }) {
  const s = useSession();
  const [editing, setEditing] = useState(false);
  const o = props.obj;
  const name = o.name || o.id;
  const singular = noun[props.kind];
  const allowed = actions[props.kind].filter((a) => decision(s, a.method) !== "denied");
  const edit = props.kind === "vms" && can(s, "VMService/UpdateVM");
  if (allowed.length === 0 && !edit) {
    return <p class="sub">Your roles may not change this {singular}.</p>;
  }
  return (
    <ActionBar
      target={`${singular} ${name}`}
      act={props.act}
      actions={allowed.map((a) => ({
        label: a.label,
        danger: a.danger,
        disabled: !a.when(o),
        run: () => a.run(o.id),
        confirm: (
          <p>
            This will {a.verb} the {singular} <strong>{name}</strong> on {o.host || "its node"}.
          </p>
        ),
      }))}
    >
      {edit && (
        <>
          <button type="button" onClick={() => setEditing(true)}>
            Edit
          </button>
          <EditVM open={editing} vm={o as VM} onClose={() => setEditing(false)} onDone={(m) => props.act.say(m)} />
        </>
      )}
    </ActionBar>
  );
}

/** EditVM changes a VM's name, vCPUs and memory (pvcli vm update). */
function EditVM(props: { open: boolean; vm: VM; onClose: () => void; onDone: (m: string) => void }) {
  const [name, setName] = useState("");
  const [vcpus, setVcpus] = useState("");
  const [mem, setMem] = useState("");
  useEffect(() => {
    if (!props.open) return;
    setName(props.vm.name);
    setVcpus(String(props.vm.vcpus));
    setMem(String(props.vm.memoryMib));
  }, [props.open]);
  const submit = async () => {
    const paths: string[] = [];
    if (name !== props.vm.name) paths.push("name");
    if (vcpus !== String(props.vm.vcpus)) paths.push("vcpus");
    if (mem !== String(props.vm.memoryMib)) paths.push("memory_mib");
    if (paths.length === 0) {
      props.onDone(`Edit VM ${props.vm.name || props.vm.id}: nothing changed.`);
      return;
    }
    await client(VMService).updateVM({
      vm: { id: props.vm.id, name, vcpus: number("vCPUs", vcpus), memoryMib: BigInt(number("Memory (MiB)", mem)) },
      updateMask: { paths },
      expectedRevision: props.vm.metadata?.revision,
    });
    props.onDone(`Edit VM ${name || props.vm.id}: saved (${paths.join(", ")}).`);
  };
  return (
    <FormDialog open={props.open} title={`Edit VM ${props.vm.name || props.vm.id}`} action="Save" submit={submit} onClose={props.onClose}>
      <Input label="Name" name="name" value={name} onInput={setName} required />
      <Input label="vCPUs" name="vcpus" type="number" min={1} max={256} value={vcpus} onInput={setVcpus} hint="1 to 256" />
      <Input label="Memory (MiB)" name="memory" type="number" min={64} value={mem} onInput={setMem} hint="64 or more" />
    </FormDialog>
  );
}

/** number parses a whole number field, or throws naming it. */
function number(field: string, v: string): number {
  const n = Number(v.trim());
  if (v.trim() === "" || !Number.isInteger(n) || n < 0) {
    throw new Error(`${field}: ${JSON.stringify(v)} is not a whole number`);
  }
  return n;
}

const createMethod: Record<Kind, string> = { vms: "VMService/CreateVM", volumes: "StorageService/CreateVolume", networks: "NetworkService/CreateNetwork" };

/** useHosts lists the cluster's nodes for a host field, when the caller may read them. */
function useHosts(open: boolean): string[] {
  const s = useSession();
  const [hosts, setHosts] = useState<string[]>([]);
  useEffect(() => {
    if (!open || !can(s, "ClusterService/Members")) return;
    client(ClusterService)
      .members({})
      .then((r) => setHosts(r.members.map((m) => m.name).sort()))
      .catch(() => setHosts([]));
  }, [open]);
  return hosts;
}

/** Create is a list's create button and form (pvcli vm|volume|network create). */
function Create(props: { kind: Kind }) {
  const s = useSession();
  const act = useAction();
  const [open, setOpen] = useState(false);
  const [f, setF] = useState<Record<string, string>>({});
  const hosts = useHosts(open);
  if (!can(s, createMethod[props.kind])) return null;
  const singular = noun[props.kind];
  const set = (k: string) => (v: string) => setF((x) => ({ ...x, [k]: v }));
  const v = (k: string, d = "") => f[k] ?? d;
  const host = v("host");
  const begin = () => {
    setF({});
    setOpen(true);
  };
  const submit = async () => {
    const name = v("name").trim();
    if (!name) throw new Error("Name: give the new object a name");
    let id = "";
    switch (props.kind) {
      case "vms": {
        const r = await client(VMService).createVM({
          vm: { name, vcpus: number("vCPUs", v("vcpus", "1")), memoryMib: BigInt(number("Memory (MiB)", v("memory", "1024"))), metadata: { owner: v("owner").trim() } },
          host,
        });
        id = r.vm?.id ?? "";
        break;
      }
      case "volumes": {
        const r = await client(StorageService).createVolume({ volume: { name, sizeBytes: BigInt(number("Size (MiB)", v("size", "1024"))) * 1048576n }, host });
        id = r.volume?.id ?? "";
        break;
      }
      case "networks": {
        const r = await client(NetworkService).createNetwork({ network: { name, cidr: v("cidr").trim(), vlan: number("VLAN", v("vlan", "0")) }, host });
        id = r.network?.id ?? "";
        break;
      }
    }
    act.say(`Created ${singular} ${name} (${id})${host ? ` on ${host}` : ""}.`);
  };
  return (
    <div class="actions">
      <button type="button" class="primary" onClick={begin}>
        Create {article[props.kind]}
      </button>
      <Outcome state={act} />
      <FormDialog open={open} title={`Create ${article[props.kind]}`} action="Create" submit={submit} onClose={() => setOpen(false)}>
        <Input label="Name" name="name" value={v("name")} onInput={set("name")} required />
        {hosts.length > 0 ? (
          <Select label="Host" name="host" value={host} onChange={set("host")} options={[["", "the node serving this page"], ...hosts.map((h): [string, string] => [h, h])]} />
        ) : (
          <Input label="Host" name="host" value={host} onInput={set("host")} hint="A node's name; empty: the node serving this page." />
        )}
        {props.kind === "vms" && (
          <>
            <Input label="vCPUs" name="vcpus" type="number" min={1} max={256} value={v("vcpus", "1")} onInput={set("vcpus")} hint="1 to 256" />
            <Input label="Memory (MiB)" name="memory" type="number" min={64} value={v("memory", "1024")} onInput={set("memory")} hint="64 or more" />
            <Input label="Owner" name="owner" value={v("owner")} onInput={set("owner")} hint="The identity the VM belongs to (metadata.owner); may be empty." />
          </>
        )}
        {props.kind === "volumes" && <Input label="Size (MiB)" name="size" type="number" min={1} value={v("size", "1024")} onInput={set("size")} />}
        {props.kind === "networks" && (
          <>
            <Input label="CIDR" name="cidr" value={v("cidr")} onInput={set("cidr")} placeholder="10.10.0.0/24" required />
            <Input label="VLAN" name="vlan" type="number" min={0} max={4094} value={v("vlan", "0")} onInput={set("vlan")} hint="1 to 4094, or 0 for untagged" />
          </>
        )}
      </FormDialog>
    </div>
  );
}
