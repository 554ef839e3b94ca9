// The console's session logic (ui/src/console.ts) under Node's test
// runner, with a fake WebSocket and fetch: what each way a session ends
// leads to. The browser test (cmd/internal/e2e TestWebUI) runs it against
// real agents.
import "./env";
import { test } from "node:test";
import assert from "node:assert/strict";
import { Code } from "@connectrpc/connect";
import {
  backoff,
  base64url,
  classifyClose,
  closeProblem,
  ConsoleSession,
  consoleURL,
  frames,
  maxFrame,
  parseControl,
  protocols,
  retryDelay,
  subprotocol,
  type ConsoleState,
} from "../src/console";
import { FakeWebSocket, fakeFetch, flush, timers } from "./env";

test("base64url has no padding and no + or /", () => {
  assert.equal(base64url("a"), "YQ");
  assert.equal(base64url("\u00ff\u00fe"), "w7_Dvg");
  assert.equal(base64url("ab?"), "YWI_");
});

test("protocols offer the token only when there is one", () => {
  assert.deepEqual(protocols(undefined), [subprotocol]);
  assert.deepEqual(protocols("t.k"), [subprotocol, "bearer.dC5r"]);
});

test("consoleURL follows the page's scheme and leaves out a size out of bounds", () => {
  const cases: { name: string; protocol: string; size?: { cols: number; rows: number }; want: string }[] = [
    { name: "https", protocol: "https:", size: { cols: 80, rows: 24 }, want: "wss://h:1/ws/pivirt.vm.v1.VMService/Console?id=vm+1&cols=80&rows=24" },
    { name: "http", protocol: "http:", want: "ws://h:1/ws/pivirt.vm.v1.VMService/Console?id=vm+1" },
    { name: "zero", protocol: "https:", size: { cols: 0, rows: 24 }, want: "wss://h:1/ws/pivirt.vm.v1.VMService/Console?id=vm+1" },
    { name: "too big", protocol: "https:", size: { cols: 80, rows: 10001 }, want: "wss://h:1/ws/pivirt.vm.v1.VMService/Console?id=vm+1" },
  ];
  for (const c of cases) {
    assert.equal(consoleURL({ protocol: c.protocol, host: "h:1" }, "vm 1", c.size), c.want, c.name);
  }
});

test("classifyClose", () => {
  const cases: [number, boolean, string][] = [
    [1000, true, "ended"],
    [1000, false, "ended"],
    [1001, true, "retry"],
    [1006, true, "retry"],
    [1006, false, "probe"],
    [1008, true, "refused"],
    [1009, true, "refused"],
    [4016, true, "refused"],
    [1011, true, "retry"],
  ];
  for (const [code, opened, want] of cases) {
    assert.equal(classifyClose(code, opened), want, `${code} opened=${opened}`);
  }
});

test("closeProblem", () => {
  const p = closeProblem(4016, "");
  assert.equal(p.code, Code.Unauthenticated);
  assert.match(p.hint ?? "", /log in again/);
  assert.equal(closeProblem(4014, "the backend went away").message, "the backend went away");
  assert.equal(closeProblem(1009, "").message, "the agent closed the console (1009: a frame too big)");
  assert.equal(closeProblem(4999, "x").code, Code.Internal);
});

test("retryDelay doubles to its bound and stops", () => {
  const got: (number | undefined)[] = [];
  for (let n = 1; n <= backoff.attempts + 1; n++) got.push(retryDelay(n));
  assert.deepEqual(got, [1000, 2000, 4000, 8000, 15000, 15000, 15000, 15000, undefined]);
});

test("frames split at 64 KiB", () => {
  assert.deepEqual(
    frames(new Uint8Array(2 * maxFrame + 1)).map((f) => f.length),
    [maxFrame, maxFrame, 1],
  );
  assert.deepEqual(frames(new Uint8Array(0)), []);
});

test("parseControl", () => {
  assert.deepEqual(parseControl('{"closed":{"reason":"the shell exited","exitStatus":3}}'), { kind: "closed", reason: "the shell exited", exitStatus: 3 });
  assert.deepEqual(parseControl('{"closed":{}}'), { kind: "closed", reason: "the console ended", exitStatus: 0 });
  const e = parseControl('{"error":{"code":"permission_denied","message":"no"}}');
  assert.equal(e?.kind, "failed");
  assert.equal(e?.kind === "failed" && e.problem.code, Code.PermissionDenied);
  assert.equal(parseControl("not json"), undefined);
  assert.equal(parseControl('{"other":1}'), undefined);
});

function session(): { states: ConsoleState[]; output: Uint8Array[]; s: ConsoleSession } {
  const states: ConsoleState[] = [];
  const output: Uint8Array[] = [];
  const s = new ConsoleSession({ id: "vm-1", size: () => ({ cols: 80, rows: 24 }), output: (b) => output.push(b), state: (x) => states.push(x) });
  return { states, output, s };
}

test("a session sends keys and sizes, writes output, and ends with the VM's closed", async () => {
  FakeWebSocket.reset();
  const { states, output, s } = session();
  const ws = FakeWebSocket.last();
  assert.deepEqual(ws.protocols, [subprotocol]);
  assert.match(ws.url, /^wss:\/\/agent:8443\/ws\/pivirt\.vm\.v1\.VMService\/Console\?id=vm-1&cols=80&rows=24$/);
  ws.open();
  assert.deepEqual(ws.sent.shift(), '{"resize":{"cols":80,"rows":24}}');
  s.send("é");
  assert.deepEqual([...(ws.sent.shift() as Uint8Array)], [0xc3, 0xa9]);
  s.resize({ cols: 100, rows: 30 });
  assert.equal(ws.sent.shift(), '{"resize":{"cols":100,"rows":30}}');
  ws.receive(new Uint8Array([104, 105]).buffer);
  assert.deepEqual([...output[0]], [104, 105]);
  ws.receive('{"closed":{"reason":"the shell exited","exitStatus":3}}');
  ws.serverClose(1000);
  assert.deepEqual(
    states.map((x) => x.kind),
    ["connecting", "open", "closed"],
  );
  assert.deepEqual(states[2], { kind: "closed", reason: "the shell exited", exitStatus: 3 });
  assert.equal(timers.pending(), 0, "no reconnection after the VM's closed");
});

test("a lost connection is opened again after the backoff, which starts over once open", async () => {
  FakeWebSocket.reset();
  const { states } = session();
  FakeWebSocket.last().open();
  FakeWebSocket.last().serverClose(1006);
  assert.deepEqual(states.at(-1), { kind: "reconnecting", attempt: 1, delay: 1000, why: "the connection to the agent was lost (1006)" });
  assert.equal(FakeWebSocket.count, 1);
  timers.runNext();
  assert.equal(FakeWebSocket.count, 2);
  FakeWebSocket.last().open();
  assert.equal(states.at(-1)?.kind, "open");
  FakeWebSocket.last().serverClose(1006);
  assert.deepEqual(states.at(-1), { kind: "reconnecting", attempt: 1, delay: 1000, why: "the connection to the agent was lost (1006)" });
});

test("an error frame ends the session without a retry", async () => {
  FakeWebSocket.reset();
  const { states } = session();
  FakeWebSocket.last().open();
  FakeWebSocket.last().receive('{"error":{"code":"unavailable","message":"the backend went away"}}');
  FakeWebSocket.last().serverClose(4014);
  const last = states.at(-1);
  assert.equal(last?.kind, "failed");
  assert.equal(last?.kind === "failed" && last.problem.message, "the backend went away");
  assert.equal(timers.pending(), 0);
});

test("a refused upgrade is explained by the GET probe, in the UI's words", async () => {
  FakeWebSocket.reset();
  fakeFetch.answer = { status: 403, body: '{"code":"permission_denied","message":"alice may not console virtualmachines vm-1"}' };
  const { states } = session();
  FakeWebSocket.last().serverClose(1006);
  await flush();
  const last = states.at(-1);
  assert.equal(last?.kind, "failed");
  if (last?.kind !== "failed") return;
  assert.equal(last.problem.code, Code.PermissionDenied);
  assert.equal(last.problem.message, "alice may not console virtualmachines vm-1");
  assert.match(last.problem.hint ?? "", /RBAC policy does not allow/);
  assert.equal(fakeFetch.calls.at(-1), "/ws/pivirt.vm.v1.VMService/Console?id=vm-1&cols=80&rows=24");
  assert.equal(timers.pending(), 0);
});

test("a refusal that may pass (too many streams) is tried again, saying why", async () => {
  FakeWebSocket.reset();
  fakeFetch.answer = { status: 429, body: '{"code":"resource_exhausted","message":"alice has 64 streams open (server.connectrpc.max_streams_per_caller)"}' };
  const { states } = session();
  for (let n = 1; n <= backoff.attempts; n++) {
    FakeWebSocket.last().serverClose(1006);
    await flush();
    assert.deepEqual(states.at(-1), { kind: "reconnecting", attempt: n, delay: retryDelay(n), why: "alice has 64 streams open (server.connectrpc.max_streams_per_caller)" });
    timers.runNext();
  }
  FakeWebSocket.last().serverClose(1006);
  await flush();
  const last = states.at(-1);
  assert.equal(last?.kind === "failed" && last.problem.code, Code.ResourceExhausted);
});

test("a probe answering 426 (the console would open) tries again; past the last try the session fails", async () => {
  FakeWebSocket.reset();
  fakeFetch.answer = { status: 426, body: "" };
  const { states } = session();
  for (let n = 1; n <= backoff.attempts; n++) {
    FakeWebSocket.last().serverClose(1006);
    await flush();
    assert.deepEqual(states.at(-1), { kind: "reconnecting", attempt: n, delay: retryDelay(n), why: "the agent could not be reached" });
    timers.runNext();
  }
  FakeWebSocket.last().serverClose(1006);
  await flush();
  const last = states.at(-1);
  assert.equal(last?.kind === "failed" && last.problem.code, Code.Unavailable);
});

test("close() ends the session quietly and stops a pending retry", async () => {
  FakeWebSocket.reset();
  const { states, s } = session();
  FakeWebSocket.last().open();
  FakeWebSocket.last().serverClose(1006);
  const n = states.length;
  s.close();
  assert.equal(timers.pending(), 0);
  assert.equal(states.length, n);
});
