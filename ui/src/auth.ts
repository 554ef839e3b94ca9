// Login: the OIDC authorization code flow with PKCE (RFC 7636) against the
// agent's auth.oidc issuer, as a public client. The access token lives in
// this module's memory only: a reload logs in again (the issuer's own
// session makes that one redirect). Only the PKCE verifier and state
// survive the redirect, in sessionStorage, and are deleted on return.
import type { UIConfig } from "./config";

const pendingKey = "pivirt.login";
export const callbackPath = "/ui/callback";

interface Pending {
  state: string;
  verifier: string;
  returnTo: string;
  nonce: string;
}

interface Discovery {
  authorization_endpoint?: string;
  token_endpoint?: string;
  pivirt_dev_issuer?: boolean;
}

let token: string | undefined;
let tokenExpiry = 0; // ms since the epoch
const listeners = new Set<() => void>();

/** The bearer token of the session, if logged in and not expired. */
export function bearer(): string | undefined {
  if (token && Date.now() < tokenExpiry) {
    return token;
  }
  if (token) {
    // Expired: drop it, which shows the login (listeners run after the
    // caller's work, never inside a render).
    queueMicrotask(forget);
  }
  return undefined;
}

/** When the session's token expires (ms since the epoch), 0 without one. */
export function expiry(): number {
  return token ? tokenExpiry : 0;
}

/** Forget the token (log out, or the agent refused it). */
export function forget(): void {
  token = undefined;
  tokenExpiry = 0;
  listeners.forEach((l) => l());
}

export function onChange(l: () => void): () => void {
  listeners.add(l);
  return () => listeners.delete(l);
}

/** The UI logs in with OIDC; without an issuer the browser's client certificate is the login. */
export function usesOIDC(cfg: UIConfig): boolean {
  return !!cfg.issuer_url;
}

function base64url(bytes: Uint8Array): string {
  let s = "";
  bytes.forEach((b) => (s += String.fromCharCode(b)));
  return btoa(s).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function random(n: number): string {
  return base64url(crypto.getRandomValues(new Uint8Array(n)));
}

async function discover(cfg: UIConfig): Promise<Discovery> {
  const url = cfg.issuer_url!.replace(/\/$/, "") + "/.well-known/openid-configuration";
  let res: Response;
  try {
    res = await fetch(url, { cache: "no-store" });
  } catch (e) {
    throw new Error(`the OIDC issuer ${cfg.issuer_url} cannot be reached (${e}); is it running, and does it allow this page's origin (CORS)?`);
  }
  if (!res.ok) {
    throw new Error(`the OIDC issuer answered ${res.status} for ${url}`);
  }
  const d = (await res.json()) as Discovery;
  if (!d.authorization_endpoint || !d.token_endpoint) {
    throw new Error(`the OIDC issuer ${cfg.issuer_url} offers no authorization code login (no authorization_endpoint)`);
  }
  return d;
}

/** devIssuer: the issuer is the development one (pitrust dev-issuer, --dev). */
export async function devIssuer(cfg: UIConfig): Promise<boolean> {
  try {
    return !!(await discover(cfg)).pivirt_dev_issuer;
  } catch {
    return false;
  }
}

/** Start a login: go to the issuer, to come back to returnTo. */
export async function login(cfg: UIConfig, returnTo: string): Promise<void> {
  const d = await discover(cfg);
  const verifier = random(48);
  const challenge = base64url(new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier))));
  const pending: Pending = { state: random(24), verifier, returnTo, nonce: random(24) };
  sessionStorage.setItem(pendingKey, JSON.stringify(pending));
  const u = new URL(d.authorization_endpoint!);
  u.searchParams.set("response_type", "code");
  u.searchParams.set("client_id", cfg.client_id ?? "");
  u.searchParams.set("redirect_uri", location.origin + callbackPath);
  u.searchParams.set("scope", (cfg.scopes ?? ["openid"]).join(" "));
  u.searchParams.set("state", pending.state);
  u.searchParams.set("nonce", pending.nonce);
  u.searchParams.set("code_challenge", challenge);
  u.searchParams.set("code_challenge_method", "S256");
  location.assign(u.toString());
}

/**
 * Finish a login on the callback path: exchange the code for a token.
 * Answers the path to go to, or throws with what went wrong.
 */
export async function completeLogin(cfg: UIConfig): Promise<string> {
  const q = new URLSearchParams(location.search);
  const raw = sessionStorage.getItem(pendingKey);
  sessionStorage.removeItem(pendingKey);
  if (q.get("error")) {
    throw new Error(`the OIDC issuer refused the login: ${q.get("error")}${q.get("error_description") ? ": " + q.get("error_description") : ""}`);
  }
  if (!raw) {
    throw new Error("this login was not started here (or was already completed): log in again");
  }
  const pending = JSON.parse(raw) as Pending;
  if (q.get("state") !== pending.state) {
    throw new Error("the login's state does not match the one sent: log in again");
  }
  const d = await discover(cfg);
  const body = new URLSearchParams({
    grant_type: "authorization_code",
    code: q.get("code") ?? "",
    redirect_uri: location.origin + callbackPath,
    client_id: cfg.client_id ?? "",
    code_verifier: pending.verifier,
  });
  const res = await fetch(d.token_endpoint!, { method: "POST", body, headers: { "Content-Type": "application/x-www-form-urlencoded" } });
  const out = (await res.json().catch(() => ({}))) as { access_token?: string; expires_in?: number; error?: string; error_description?: string };
  if (!res.ok || !out.access_token) {
    throw new Error(`the OIDC issuer refused the code: ${out.error ?? res.status}${out.error_description ? ": " + out.error_description : ""}`);
  }
  token = out.access_token;
  tokenExpiry = Date.now() + (out.expires_in ?? 3600) * 1000 - 10_000;
  listeners.forEach((l) => l());
  return pending.returnTo.startsWith("/ui/") ? pending.returnTo : "/ui/";
}
