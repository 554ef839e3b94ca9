// Services and their instances with health and TTLs, followed with
// blocking queries on ClusterService.ListServices (stale reads: any agent
// answers from its own copy, so the view works without a leader). An
// instance may be deregistered from its service's page (confirmed).
import { client } from "../api";
import { ActionBar, Badge, Empty, ErrorBox, Link, Loading, Outcome, PageHeader, Table, ago, durationMs, fmtDuration, useAction, type ActionState, type Column } from "../components";
import { can, useSession } from "../session";
import { useBlocking } from "../live";
import { ClusterService, Consistency, Health, type ServiceInstance } from "../gen/pivirt/cluster/v1/cluster_pb";
import { href } from "../router";
import { durationFromMs } from "@bufbuild/protobuf/wkt";

function healthBadge(h: Health) {
  return h === Health.PASSING ? <Badge tone="ok">passing</Badge> : h === Health.CRITICAL ? <Badge tone="bad">critical</Badge> : <Badge tone="muted">unknown</Badge>;
}

export function Services(props: { name?: string }) {
  const q = useBlocking(
    async (waitIndex, signal) => {
      const r = await client(ClusterService).listServices(
        { service: props.name ?? "", read: { consistency: Consistency.STALE, waitIndex, waitTime: durationFromMs(60_000) } },
        { signal, timeoutMs: 90_000 },
      );
      return { data: r.instances, index: r.meta?.index ?? 0n };
    },
    [props.name],
  );
  const title = props.name ? `Service ${props.name}` : "Services";
  const instances = q.data ?? [];
  const act = useAction();
  return (
    <section>
      <PageHeader title={title} />
      {props.name && <Link href={href("services")}>← All services</Link>}
      <Outcome state={act} />
      {q.error && <ErrorBox problem={q.error} what="services" stale={!!q.data} />}
      {q.loading && !q.data ? (
        <Loading what="services" />
      ) : instances.length === 0 ? (
        <Empty>{props.name ? `No instances of ${props.name} are registered.` : "No services are registered. pvcli service register adds one."}</Empty>
      ) : props.name ? (
        <InstanceTable rows={instances} act={act} />
      ) : (
        <ServiceTable rows={instances} />
      )}
    </section>
  );
}

function ServiceTable(props: { rows: ServiceInstance[] }) {
  const by = new Map<string, ServiceInstance[]>();
  for (const i of props.rows) by.set(i.service, [...(by.get(i.service) ?? []), i]);
  const rows = [...by.entries()].sort(([a], [b]) => a.localeCompare(b));
  return (
    <Table<[string, ServiceInstance[]]>
      caption="Services"
      rows={rows}
      rowKey={([n]) => n}
      columns={[
        { title: "Service", cell: ([n]) => <Link href={href("services", n)}>{n}</Link> },
        { title: "Instances", cell: ([, is]) => is.length, class: "num" },
        {
          title: "Health",
          cell: ([, is]) => {
            const bad = is.filter((i) => i.health !== Health.PASSING).length;
            return bad === 0 ? <Badge tone="ok">all passing</Badge> : <Badge tone="bad">{bad} critical</Badge>;
          },
        },
        { title: "Nodes", cell: ([, is]) => [...new Set(is.map((i) => i.node))].sort().join(", ") },
      ]}
    />
  );
}

function InstanceTable(props: { rows: ServiceInstance[]; act: ActionState }) {
  const deregister = can(useSession(), "ClusterService/DeregisterService");
  const actions: Column<ServiceInstance>[] = deregister
    ? [
        {
          title: "Actions",
          cell: (i) => (
            <ActionBar
              target={`instance ${i.instanceId}`}
              act={props.act}
              actions={[
                {
                  label: "Deregister",
                  danger: true,
                  confirm: (
                    <p>
                      This removes the instance {i.instanceId} of {i.service} at {i.address}:{i.port} from the catalog; the service itself keeps running, and registers again if it is set to.
                    </p>
                  ),
                  run: () => client(ClusterService).deregisterService({ service: i.service, instanceId: i.instanceId }),
                },
              ]}
            />
          ),
        },
      ]
    : [];
  return (
    <Table<ServiceInstance>
      caption="Instances"
      rows={props.rows}
      rowKey={(i) => i.instanceId}
      rowClass={(i) => (i.health === Health.CRITICAL ? "row-bad" : "")}
      columns={[
        { title: "Instance", cell: (i) => i.instanceId },
        { title: "Health", cell: (i) => healthBadge(i.health) },
        { title: "Node", cell: (i) => i.node },
        { title: "Address", cell: (i) => <code>{`${i.address}:${i.port}`}</code> },
        { title: "Tags", cell: (i) => i.tags.join(", ") },
        { title: "TTL", cell: (i) => (i.ttl ? fmtDuration(durationMs(i.ttl)) : i.check ? "check" : "—") },
        { title: "Last heartbeat", cell: (i) => ago(i.lastHeartbeat) },
        ...actions,
      ]}
    />
  );
}
