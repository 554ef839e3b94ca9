// A browser's globals for the UI's modules under Node: the page's
// location, and fakes of WebSocket, fetch and the timers that a test
// drives by hand.
type Timer = { id: number; fn: () => void; at: number };

let queue: Timer[] = [];
let nextID = 1;

export const timers = {
  pending: () => queue.length,
  /** runNext runs the earliest timer. */
  runNext(): void {
    queue.sort((a, b) => a.at - b.at);
    const t = queue.shift();
    if (!t) throw new Error("no timer pending");
    t.fn();
  },
};

export class FakeWebSocket {
  static readonly CONNECTING = 0;
  static readonly OPEN = 1;
  static readonly CLOSING = 2;
  static readonly CLOSED = 3;
  static all: FakeWebSocket[] = [];
  static get count(): number {
    return FakeWebSocket.all.length;
  }
  static last(): FakeWebSocket {
    return FakeWebSocket.all[FakeWebSocket.all.length - 1];
  }
  static reset(): void {
    FakeWebSocket.all = [];
    queue = [];
    fakeFetch.calls = [];
    fakeFetch.answer = { status: 426, body: "" };
  }

  readyState = FakeWebSocket.CONNECTING;
  protocol = "";
  binaryType = "blob";
  sent: (string | Uint8Array)[] = [];
  onopen: (() => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: { code: number; reason: string }) => void) | null = null;

  constructor(
    readonly url: string,
    readonly protocols: string[],
  ) {
    FakeWebSocket.all.push(this);
  }
  send(d: string | Uint8Array): void {
    if (this.readyState !== FakeWebSocket.OPEN) throw new Error("send on a socket that is not open");
    this.sent.push(typeof d === "string" ? d : new Uint8Array(d));
  }
  close(): void {
    this.readyState = FakeWebSocket.CLOSED;
  }
  /** The agent accepts the upgrade, selecting the console's protocol. */
  open(): void {
    this.readyState = FakeWebSocket.OPEN;
    this.protocol = this.protocols[0];
    this.onopen?.();
  }
  receive(data: string | ArrayBuffer): void {
    this.onmessage?.({ data });
  }
  serverClose(code: number): void {
    this.readyState = FakeWebSocket.CLOSED;
    this.onclose?.({ code, reason: "" });
  }
}

export const fakeFetch = {
  calls: [] as string[],
  answer: { status: 426, body: "" },
};

/** flush lets promises settle (a probe's fetch and its body). */
export function flush(): Promise<void> {
  return new Promise((r) => setImmediate(r));
}

const g = globalThis as Record<string, unknown>;
g.location = { origin: "https://agent:8443", host: "agent:8443", protocol: "https:", pathname: "/ui/vms/vm-1/console", search: "" };
g.WebSocket = FakeWebSocket;
g.fetch = async (url: string) => {
  fakeFetch.calls.push(url);
  return new Response(fakeFetch.answer.body || null, { status: fakeFetch.answer.status });
};
g.setTimeout = (fn: () => void, ms: number) => {
  const t = { id: nextID++, fn, at: ms };
  queue.push(t);
  return t.id;
};
g.clearTimeout = (id: number) => {
  queue = queue.filter((t) => t.id !== id);
};
