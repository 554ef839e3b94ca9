// The PiVirt console: the application shell (login, navigation, the view
// of the URL). Every view is in views/.
import "uplot/dist/uPlot.min.css";
import "@xterm/xterm/css/xterm.css"; // the console's (views/console.tsx, loaded when used)
import "./app.css";
import { render } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { bearer, callbackPath, completeLogin, devIssuer, expiry, forget, login, onChange, usesOIDC } from "./auth";
import { client, problem, type Problem } from "./api";
import { loadConfig, type UIConfig } from "./config";
import { create } from "@bufbuild/protobuf";
import { ClusterService, WhoAmIResponseSchema } from "./gen/pivirt/cluster/v1/cluster_pb";
import { currentRoute, href, navigate, useRoute } from "./router";
import { can, SessionContext, type Session } from "./session";
import { ErrorBox, Link } from "./components";
import { Overview } from "./views/overview";
import { Services } from "./views/services";
import { Resources } from "./views/resources";
import { Schedules } from "./views/schedules";
import { Settings } from "./views/settings";
import { Snapshots } from "./views/snapshots";
import { Logs } from "./views/logs";

interface ViewDef {
  path: string;
  title: string;
  /** method the caller must be able to call to see the view */
  needs: string;
}

const views: ViewDef[] = [
  { path: "", title: "Overview", needs: "ClusterService/Members" },
  { path: "services", title: "Services", needs: "ClusterService/ListServices" },
  { path: "vms", title: "VMs", needs: "VMService/WatchVMs" },
  { path: "volumes", title: "Volumes", needs: "StorageService/WatchVolumes" },
  { path: "networks", title: "Networks", needs: "NetworkService/WatchNetworks" },
  { path: "schedules", title: "Schedules", needs: "ScheduleService/ListSchedules" },
  { path: "settings", title: "Settings", needs: "ClusterService/ListConfig" },
  { path: "snapshots", title: "Snapshots", needs: "SnapshotService/SaveSnapshot" },
  { path: "logs", title: "Logs", needs: "AgentService/Monitor" },
];

function Nav(props: { session: Session; route: string[] }) {
  const [open, setOpen] = useState(false);
  const top = props.route[0] ?? "";
  return (
    <nav aria-label="Views" class={open ? "open" : ""}>
      <button type="button" class="menu" aria-expanded={open} aria-controls="nav-list" onClick={() => setOpen(!open)}>
        Menu
      </button>
      <ul id="nav-list" onClick={() => setOpen(false)}>
        {views
          .filter((v) => can(props.session, v.needs))
          .map((v) => (
            <li>
              <Link href={href(...(v.path ? [v.path] : []))} aria-current={top === v.path ? "page" : undefined}>
                {v.title}
              </Link>
            </li>
          ))}
      </ul>
    </nav>
  );
}

function View(props: { session: Session; route: string[] }) {
  const [top, ...rest] = props.route;
  // The landing page is the first view the caller may read (a vm-owner's
  // is its VMs).
  const first = views.find((d) => can(props.session, d.needs));
  useEffect(() => {
    // The route as it is now, not as it was at the render: a navigation
    // made meanwhile (a link followed while the session loaded) wins over
    // the landing page.
    if (top === undefined && currentRoute().length === 0 && first && first.path !== "") navigate(href(first.path), true);
  }, [top, first]);
  if (top === undefined && !first) {
    return (
      <section>
        <h1>Nothing to show</h1>
        <p>Your roles ({props.session.who.roles.join(", ") || "none"}) may read none of the console's views; ask for a role that does.</p>
      </section>
    );
  }
  const v = views.find((d) => d.path === (top ?? ""));
  if (!v) {
    return (
      <section>
        <h1>Not found</h1>
        <p>
          There is no view at {location.pathname}. <Link href={href()}>Go to the overview.</Link>
        </p>
      </section>
    );
  }
  if (!can(props.session, v.needs)) {
    return (
      <section>
        <h1>{v.title}</h1>
        <ErrorBox
          problem={{ code: 7, message: `your roles (${props.session.who.roles.join(", ") || "none"}) may not read this view`, hint: "The agent's RBAC policy does not allow this call for your identity (the message names the resource and verb); ask for a role that does.", noLeader: false }}
        />
      </section>
    );
  }
  switch (v.path) {
    case "":
      return <Overview />;
    case "services":
      return <Services name={rest[0]} />;
    case "vms":
      return <Resources kind="vms" id={rest[0]} sub={rest[1]} />;
    case "volumes":
      return <Resources kind="volumes" id={rest[0]} />;
    case "networks":
      return <Resources kind="networks" id={rest[0]} />;
    case "schedules":
      return <Schedules id={rest[0]} />;
    case "settings":
      return <Settings keyName={rest[0]} />;
    case "snapshots":
      return <Snapshots />;
    case "logs":
      return <Logs node={rest[0]} />;
  }
  return null;
}

/** Expiry shows the login when the session's token expires. */
function Expiry() {
  useEffect(() => {
    const e = expiry();
    if (!e) return;
    const t = setTimeout(() => bearer(), Math.max(e - Date.now(), 0) + 100);
    return () => clearTimeout(t);
  }, [expiry()]);
  return null;
}

function Shell(props: { session: Session; onLogout: () => void }) {
  const route = useRoute();
  const s = props.session;
  // After a navigation the focus moves to the new view (its <main>), as a
  // page load would put it at the top: a keyboard or screen-reader user
  // goes on from there, not from the link that was followed.
  const path = route.join("/");
  const first = useRef(true);
  useEffect(() => {
    if (first.current) {
      first.current = false;
      return;
    }
    document.getElementById("main")?.focus({ preventScroll: true });
  }, [path]);
  return (
    <SessionContext.Provider value={s}>
      <a class="skip" href="#main">
        Skip to content
      </a>
      <header class="top">
        <Link href={href()} class="brand">
          PiVirt
        </Link>
        <span class="node" title="the agent serving this page">
          via {s.who.node}
        </span>
        {s.open && (
          <span class="open-access" role="note" data-testid="access-off">
            Access control is off: anyone who reaches this port may act
          </span>
        )}
        <span class="who">
          <span class="sr-only">Signed in as </span>
          <strong data-testid="identity">{s.who.identity}</strong>
          {s.who.roles.length > 0 && <span class="roles"> ({s.who.roles.join(", ")})</span>}
          {usesOIDC(s.cfg) && (
            <button type="button" class="link" onClick={props.onLogout}>
              Log out
            </button>
          )}
        </span>
      </header>
      <Expiry />
      <div class="layout">
        <Nav session={s} route={route} />
        <main id="main" tabIndex={-1}>
          <View session={s} route={route} />
        </main>
      </div>
    </SessionContext.Provider>
  );
}

function LoginScreen(props: { cfg: UIConfig; error?: Problem | string }) {
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState<string | undefined>(typeof props.error === "string" ? props.error : undefined);
  const [dev, setDev] = useState(false);
  useEffect(() => {
    if (usesOIDC(props.cfg)) devIssuer(props.cfg).then(setDev);
  }, []);
  const start = () => {
    setBusy(true);
    login(props.cfg, location.pathname + location.search).catch((e) => {
      setErr(String(e instanceof Error ? e.message : e));
      setBusy(false);
    });
  };
  const p = typeof props.error === "object" ? props.error : undefined;
  return (
    <main class="login" id="main">
      <h1>PiVirt</h1>
      <p>Log in to the cluster through {location.host}.</p>
      {p && <ErrorBox problem={p} />}
      {err && (
        <div class="state error" role="alert">
          <p>{err}</p>
        </div>
      )}
      {usesOIDC(props.cfg) ? (
        <button type="button" class="primary" onClick={start} disabled={busy}>
          {busy ? "Going to the identity provider…" : "Log in"}
        </button>
      ) : (
        <p>This agent takes no OIDC login: the browser's client certificate of the PiTrust chain is the login. Import one (a .p12) into the browser and reload.</p>
      )}
      {dev && <p class="hint">The development issuer asks for its password: the content of dev-oidc.secret in the dev PKI directory (.cluster/certs for make cluster).</p>}
    </main>
  );
}

function App(props: { cfg: UIConfig }) {
  const cfg = props.cfg;
  const [session, setSession] = useState<Session | null>(null);
  const [error, setError] = useState<Problem | string | undefined>();
  const [phase, setPhase] = useState<"starting" | "login" | "ready">("starting");

  const whoami = async () => {
    try {
      const who = await client(ClusterService).whoAmI({});
      setSession({ cfg, who });
      setPhase("ready");
    } catch (e) {
      const p = problem(e);
      setError(p);
      setPhase("login");
    }
  };

  useEffect(() => {
    (async () => {
      if (location.pathname === callbackPath) {
        try {
          navigate(await completeLogin(cfg), true);
        } catch (e) {
          navigate(href(), true);
          setError(String(e instanceof Error ? e.message : e));
          setPhase("login");
          return;
        }
      }
      if (cfg.access_control_off) {
        // No credentials are checked (no TLS, no auth configured): there
        // is no one to log in as, and every call is allowed. WhoAmI would
        // answer that the call has no authenticated caller.
        setSession({ cfg, who: create(WhoAmIResponseSchema, { identity: "anonymous", node: location.host, authenticatedBy: "none", source: "none" }), open: true });
        setPhase("ready");
        return;
      }
      if (usesOIDC(cfg) && !bearer()) {
        setPhase("login");
        return;
      }
      await whoami();
    })();
    return onChange(() => {
      if (!bearer() && usesOIDC(cfg)) {
        setSession(null);
        setPhase("login");
      }
    });
  }, []);

  if (phase === "starting") {
    return <p class="boot">Connecting to {location.host}…</p>;
  }
  if (phase === "login" || !session) {
    return <LoginScreen cfg={cfg} error={error} />;
  }
  return (
    <Shell
      session={session}
      onLogout={() => {
        forget();
        setError(undefined);
      }}
    />
  );
}

loadConfig().then(
  (cfg) => render(<App cfg={cfg} />, document.getElementById("app")!),
  (e) => {
    document.getElementById("app")!.textContent = `The console cannot start: ${e instanceof Error ? e.message : e}`;
  },
);
