// Cluster overview: members (gossip), Raft peers with replication progress,
// the leader and autopilot's health, quorum at risk highlighted; charts of
// the replication lag per peer and the backend clusters' request and error
// rates. Follows ClusterService.WatchStatus and AgentService.WatchMetrics.
import { useMemo, useState } from "preact/hooks";
import type uPlot from "uplot";
import { client } from "../api";
import { Chart } from "../chart";
import { Badge, Empty, ErrorBox, Live, Loading, PageHeader, Table, durationMs, fmtDuration, Link, type Tone } from "../components";
import { useStream } from "../live";
import { AgentService, type MetricsSample } from "../gen/pivirt/cluster/v1/agent_pb";
import { ClusterService, MemberStatus, RaftState, type Member, type Peer, type WatchStatusResponse } from "../gen/pivirt/cluster/v1/cluster_pb";
import { href } from "../router";
import { useCan } from "../session";

export function memberTone(s: MemberStatus): Tone {
  switch (s) {
    case MemberStatus.ALIVE:
      return "ok";
    case MemberStatus.SUSPECT:
      return "warn";
    case MemberStatus.FAILED:
      return "bad";
    default:
      return "muted";
  }
}

export function memberStatus(s: MemberStatus): string {
  return MemberStatus[s]?.toLowerCase() ?? "unknown";
}

function raftState(s: RaftState): string {
  return RaftState[s]?.toLowerCase() ?? "unknown";
}

function raftTone(s: RaftState): Tone {
  switch (s) {
    case RaftState.LEADER:
      return "info";
    case RaftState.FOLLOWER:
      return "ok";
    case RaftState.CANDIDATE:
      return "warn";
    case RaftState.UNREACHABLE:
    case RaftState.SHUTDOWN:
      return "bad";
    default:
      return "muted";
  }
}

/** Quorum reports whether the cluster can lose a voter, and why not. */
function quorum(st: WatchStatusResponse): { tone: Tone; text: string } {
  const voters = st.peers.filter((p) => p.voter);
  const reachable = voters.filter((p) => p.state !== RaftState.UNREACHABLE && p.state !== RaftState.SHUTDOWN);
  const need = Math.floor(voters.length / 2) + 1;
  const leader = st.leader?.name;
  if (!leader) {
    return { tone: "bad", text: `No leader: ${reachable.length} of ${voters.length} voters reachable, ${need} needed to elect one.` };
  }
  const ap = st.autopilot;
  if (ap && ap.failureTolerance <= 0 && voters.length > 0) {
    return { tone: "bad", text: `Quorum at risk: losing one more voter stops writes (${reachable.length} of ${voters.length} voters reachable, ${need} needed).` };
  }
  if (ap && !ap.healthy) {
    return { tone: "warn", text: `Unhealthy: a server is failed or trailing; the cluster can lose ${ap.failureTolerance} voter(s).` };
  }
  return { tone: "ok", text: `Healthy: leader ${leader}; the cluster can lose ${ap?.failureTolerance ?? "?"} voter(s).` };
}

export function Overview() {
  const [st, setSt] = useState<WatchStatusResponse | undefined>();
  const stream = useStream((signal) => client(ClusterService).watchStatus({}, { signal }), setSt, []);
  const canMetrics = useCan("AgentService/WatchMetrics");

  if (!st) {
    return (
      <section>
        <PageHeader title="Overview" />
        {stream.error ? <ErrorBox problem={stream.error} what="cluster status" /> : <Loading what="the cluster's status" />}
      </section>
    );
  }
  const q = quorum(st);
  const ap = new Map((st.autopilot?.servers ?? []).map((s) => [s.nodeId, s]));
  return (
    <section>
      <PageHeader title="Overview">
        <Live connected={stream.connected} />
      </PageHeader>
      {stream.error && <ErrorBox problem={stream.error} what="cluster status" stale />}
      <p class={`banner ${q.tone}`} role="status" data-testid="quorum">
        {q.text}
        {st.leaderError && <span class="hint"> Leader: {st.leaderError}</span>}
        {st.autopilotError && <span class="hint"> Autopilot: {st.autopilotError}</span>}
      </p>

      <h2>Members</h2>
      <p class="sub">The gossip view of {st.node}.</p>
      {st.members.length === 0 ? (
        <Empty>No members known.</Empty>
      ) : (
        <Table<Member>
          caption="Members"
          rows={[...st.members].sort((a, b) => a.name.localeCompare(b.name))}
          rowKey={(m) => m.name}
          rowClass={(m) => (m.status === MemberStatus.FAILED ? "row-bad" : "")}
          columns={[
            { title: "Name", cell: (m) => m.name },
            {
              title: "Status",
              cell: (m) => (
                <span data-testid={`member-${m.name}`}>
                  <Badge tone={memberTone(m.status)}>{memberStatus(m.status)}</Badge>
                </span>
              ),
            },
            { title: "Role", cell: (m) => m.role },
            { title: "Version", cell: (m) => m.version },
            { title: "API", cell: (m) => <code>{m.apiAddr}</code> },
            { title: "Logs", cell: (m) => <Link href={href("logs", m.name)}>log</Link> },
          ]}
        />
      )}

      <h2>Raft</h2>
      {st.peersError && <p class="state error" role="alert">Raft peers: {st.peersError}</p>}
      <Table<Peer>
        caption="Raft peers"
        rows={[...st.peers].sort((a, b) => (a.name || a.nodeId).localeCompare(b.name || b.nodeId))}
        rowKey={(p) => p.nodeId}
        rowClass={(p) => (p.state === RaftState.UNREACHABLE ? "row-bad" : "")}
        columns={[
          { title: "Name", cell: (p) => p.name || p.nodeId },
          { title: "State", cell: (p) => <Badge tone={raftTone(p.state)}>{raftState(p.state)}</Badge> },
          { title: "Voter", cell: (p) => (p.voter ? "voter" : "non-voter") },
          { title: "Commit", cell: (p) => p.commitIndex.toString(), class: "num" },
          { title: "Trailing", cell: (p) => p.trailing.toString(), class: "num" },
          { title: "Last contact", cell: (p) => (p.lastContact ? fmtDuration(durationMs(p.lastContact)) : "—"), class: "num" },
          {
            title: "Autopilot",
            cell: (p) => {
              const s = ap.get(p.nodeId);
              if (!s) return "—";
              return (
                <Badge tone={s.healthy ? "ok" : "bad"} title={s.status}>
                  {s.healthy ? "healthy" : "unhealthy"}
                  {s.status && s.status !== "voter" ? `: ${s.status}` : ""}
                </Badge>
              );
            },
          },
        ]}
      />
      {canMetrics && <Metrics leader={st.leader?.name} node={st.node} />}
    </section>
  );
}

const historyLimit = 120;

/** Metrics charts the Raft lag from the leader's samples and the backend rates from the node asked. */
function Metrics(props: { leader?: string; node: string }) {
  const [leaderSamples, setLeaderSamples] = useState<MetricsSample[]>([]);
  const [nodeSamples, setNodeSamples] = useState<MetricsSample[]>([]);
  const follow = (set: (f: (s: MetricsSample[]) => MetricsSample[]) => void) => (m: { history: MetricsSample[]; sample?: MetricsSample }) =>
    set((old) => [...old, ...m.history, ...(m.sample ? [m.sample] : [])].slice(-historyLimit));
  const lag = useStream(
    (signal) => client(AgentService).watchMetrics({ node: props.leader ?? "" }, { signal }),
    follow(setLeaderSamples),
    [props.leader],
    () => setLeaderSamples([]),
  );
  const rates = useStream(
    (signal) => client(AgentService).watchMetrics({ node: "" }, { signal }),
    follow(setNodeSamples),
    [],
    () => setNodeSamples([]),
  );
  const lagChart = useMemo(() => lagData(leaderSamples), [leaderSamples]);
  const rateChart = useMemo(() => rateData(nodeSamples), [nodeSamples]);
  return (
    <>
      <h2>Replication lag</h2>
      {lag.error && <ErrorBox problem={lag.error} what="the leader's metrics" stale />}
      {lagChart.series.length === 0 ? (
        <Empty>No followers to replicate to{props.leader ? "" : " (no leader)"}.</Empty>
      ) : (
        <Chart label={`Raft replication lag per peer (log entries behind ${props.leader}), last 10 minutes`} yLabel="entries behind" data={lagChart.data} series={lagChart.series} summary={lagChart.summary} />
      )}
      <h2>Backend clusters</h2>
      {rates.error && <ErrorBox problem={rates.error} what="this node's metrics" stale />}
      {rateChart.series.length === 0 ? (
        <Empty>No backend calls through {props.node} yet.</Empty>
      ) : (
        <div class="charts">
          <Chart label={`Requests per second per backend cluster through ${props.node}`} yLabel="requests/s" data={rateChart.requests} series={rateChart.series} summary={rateChart.summaryRequests} />
          <Chart label={`Errors per second per backend cluster through ${props.node}`} yLabel="errors/s" data={rateChart.errors} series={rateChart.series} summary={rateChart.summaryErrors} />
        </div>
      )}
    </>
  );
}

function seconds(s: MetricsSample): number {
  return s.time ? Number(s.time.seconds) + s.time.nanos / 1e9 : 0;
}

function lagData(samples: MetricsSample[]) {
  const names = [...new Set(samples.flatMap((s) => s.peers.map((p) => p.name || p.nodeId)))].sort();
  const xs = samples.map(seconds);
  const ys = names.map((n) => samples.map((s) => {
    const p = s.peers.find((p) => (p.name || p.nodeId) === n);
    return p ? Number(p.lag) : null;
  }));
  const last = samples[samples.length - 1];
  const summary = last ? last.peers.map((p) => `${p.name || p.nodeId} ${p.lag} behind`).join(", ") : "no samples";
  return { data: [xs, ...ys] as uPlot.AlignedData, series: names.map((n) => ({ label: n })), summary };
}

function rateData(samples: MetricsSample[]) {
  const names = [...new Set(samples.flatMap((s) => s.backends.map((b) => b.cluster)))].sort();
  const xs: number[] = [];
  const req: (number | null)[][] = names.map(() => []);
  const err: (number | null)[][] = names.map(() => []);
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1];
    const b = samples[i];
    const dt = seconds(b) - seconds(a);
    if (dt <= 0) continue;
    xs.push(seconds(b));
    names.forEach((n, j) => {
      const pa = a.backends.find((x) => x.cluster === n);
      const pb = b.backends.find((x) => x.cluster === n);
      // A counter that went back is a restarted agent: no rate for that step.
      const ok = pa && pb && pb.requests >= pa.requests && pb.errors >= pa.errors;
      req[j].push(ok ? Number(pb.requests - pa.requests) / dt : null);
      err[j].push(ok ? Number(pb.errors - pa.errors) / dt : null);
    });
  }
  const lastRate = (rows: (number | null)[][]) => names.map((n, j) => `${n} ${(rows[j][rows[j].length - 1] ?? 0).toFixed(1)}/s`).join(", ") || "no samples";
  return {
    requests: [xs, ...req] as uPlot.AlignedData,
    errors: [xs, ...err] as uPlot.AlignedData,
    series: names.map((n) => ({ label: n })),
    summaryRequests: lastRate(req),
    summaryErrors: lastRate(err),
  };
}
