// Who the caller is and what the policy lets it do (ClusterService.WhoAmI,
// the same decision the agent makes on every call): a view the caller
// cannot read is not offered, an action it cannot take has no button.
import { createContext } from "preact";
import { useContext } from "preact/hooks";
import type { UIConfig } from "./config";
import type { WhoAmIResponse } from "./gen/pivirt/cluster/v1/cluster_pb";

export type Decision = "allowed" | "conditional" | "denied" | "open";

export interface Session {
  cfg: UIConfig;
  who: WhoAmIResponse;
  /** access control is off on the agent: every call is allowed, no login */
  open?: boolean;
}

export const SessionContext = createContext<Session | null>(null);

export function useSession(): Session {
  const s = useContext(SessionContext);
  if (!s) throw new Error("no session");
  return s;
}

/** The decision for a method, "Service/Method" (package omitted) or full. */
export function decision(s: Session, method: string): Decision {
  if (s.open) return "allowed";
  for (const a of s.who.access) {
    if (a.method === method || a.method.endsWith("." + method) || a.method.endsWith("/" + method)) {
      return a.decision as Decision;
    }
  }
  return "denied";
}

/** can: the caller may call the method, on some objects at least. */
export function can(s: Session, method: string): boolean {
  return decision(s, method) !== "denied";
}

export function useCan(method: string): boolean {
  return can(useSession(), method);
}
