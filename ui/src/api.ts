// The typed clients of the agent's APIs, generated from the repository's
// protos (ui/src/gen, by buf): the UI calls exactly what pvcli calls.
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { Code, ConnectError, createClient, type Client, type Interceptor, type Transport } from "@connectrpc/connect";
import { createTransport } from "@connectrpc/connect/protocol-connect";
import type { UniversalClientFn } from "@connectrpc/connect/protocol";
import { createConnectTransport } from "@connectrpc/connect-web";
import type { DescService } from "@bufbuild/protobuf";
import { bearer, forget } from "./auth";

const withToken: Interceptor = (next) => async (req) => {
  const t = bearer();
  if (t) {
    req.header.set("Authorization", `Bearer ${t}`);
  }
  try {
    return await next(req);
  } catch (e) {
    if (t && ConnectError.from(e).code === Code.Unauthenticated) {
      forget(); // the agent refused the token (expired, revoked): log in again
    }
    throw e;
  }
};

/** Unary and server-streaming calls (fetch, binary Connect). */
const transport: Transport = createConnectTransport({
  baseUrl: location.origin,
  useBinaryFormat: true,
  interceptors: [withToken],
});

/**
 * bufferedFetch is an HTTP client for client-streaming calls: fetch cannot
 * stream a request body, so the messages are gathered first and sent as
 * one Connect streaming body (the snapshot upload of PlanRestore and
 * RestoreSnapshot, sent whole by pvcli too). The answer streams.
 */
const bufferedFetch: UniversalClientFn = async (req) => {
  const parts: Uint8Array[] = [];
  if (req.body) {
    for await (const p of req.body) parts.push(p);
  }
  const body = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let off = 0;
  for (const p of parts) {
    body.set(p, off);
    off += p.length;
  }
  const res = await fetch(req.url, { method: req.method, headers: req.header, body, signal: req.signal });
  const reader = res.body?.getReader();
  return {
    status: res.status,
    header: res.headers,
    trailer: new Headers(),
    body: {
      async *[Symbol.asyncIterator]() {
        if (!reader) return;
        for (;;) {
          const { done, value } = await reader.read();
          if (done) return;
          yield value;
        }
      },
    },
  };
};

const uploadTransport: Transport = createTransport({
  httpClient: bufferedFetch,
  baseUrl: location.origin,
  useBinaryFormat: true,
  interceptors: [withToken],
  acceptCompression: [],
  sendCompression: null,
  compressMinBytes: Number.MAX_SAFE_INTEGER,
  readMaxBytes: 64 << 20,
  writeMaxBytes: 1 << 30,
});

const clients = new Map<DescService, Client<DescService>>();

/** The client of a service; created once. */
export function client<T extends DescService>(service: T): Client<T> {
  let c = clients.get(service);
  if (!c) {
    c = createClient(service, transport);
    clients.set(service, c);
  }
  return c as Client<T>;
}

/** A client whose client-streaming methods send their messages in one body. */
export function uploadClient<T extends DescService>(service: T): Client<T> {
  return createClient(service, uploadTransport);
}

// The hints pvcli prints under an error (cmd/pvcli/run.go): the UI shows
// the same words; a test in cmd/pvcli keeps them equal. (pvcli's hint for
// refused credentials names its flags; the UI's says to log in.)
export const hints = {
  unauthenticated:
    "The agent did not accept the credentials: log in again (a token expires; a client certificate must be of the PiTrust chain).",
  permissionDenied:
    "The agent's RBAC policy does not allow this call for your identity (the message names the resource and verb); ask for a role that does.",
  noLeader:
    "The cluster has no leader: writes and default or consistent reads wait for one. A read with --consistency stale is answered by the agent asked, from its own copy of the state (--max-stale bounds how old). A leader is elected once a majority of the voters reach each other again: start the stopped agents or mend the network.",
};

/** A failed call as the UI shows it: the agent's message and pvcli's hint. */
export interface Problem {
  code: Code;
  message: string;
  hint?: string;
  noLeader: boolean;
}

export function problem(e: unknown): Problem {
  const ce = ConnectError.from(e);
  const noLeader = isNoLeader(ce);
  if (unreachable(ce)) {
    // The agent serving the page is down or cut off: the browser got no
    // answer at all (pvcli says so in the same terms).
    return {
      code: Code.Unavailable,
      message: `Cannot connect to the agent (${location.host})`,
      hint: "Is the agent running? The console keeps retrying; the console of any other agent works meanwhile.",
      noLeader: false,
    };
  }
  let hint: string | undefined;
  switch (ce.code) {
    case Code.Unauthenticated:
      hint = hints.unauthenticated;
      break;
    case Code.PermissionDenied:
      hint = hints.permissionDenied;
      break;
    case Code.Unavailable:
      hint = noLeader ? hints.noLeader : undefined;
      break;
  }
  return { code: ce.code, message: ce.rawMessage || ce.message, hint, noLeader };
}

/** unreachable: the request got no HTTP answer (fetch failed). */
function unreachable(ce: ConnectError): boolean {
  return (ce.code === Code.Unknown || ce.code === Code.Unavailable) && /failed to fetch|networkerror|network error|load failed/i.test(ce.rawMessage);
}

/** The agent's google.rpc.ErrorInfo of a call that found no leader (reason NO_LEADER). */
function isNoLeader(ce: ConnectError): boolean {
  for (const d of ce.details) {
    if ("type" in d && d.type === "google.rpc.ErrorInfo") {
      try {
        const r = new BinaryReader(d.value);
        while (r.pos < r.len) {
          const [field, wire] = r.tag();
          if (field === 1) return r.string() === "NO_LEADER";
          r.skip(wire);
        }
      } catch {
        return false;
      }
    }
  }
  return false;
}

export { Code, ConnectError };
