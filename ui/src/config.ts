// The agent's /ui/config.json: how to log in (public: nothing else).
export interface UIConfig {
  issuer_url?: string;
  client_id?: string;
  scopes?: string[];
  /** the API port admits every caller without credentials: no login */
  access_control_off?: boolean;
}

export async function loadConfig(): Promise<UIConfig> {
  const res = await fetch("/ui/config.json", { cache: "no-store" });
  if (!res.ok) {
    throw new Error(`the agent answered ${res.status} for /ui/config.json`);
  }
  return (await res.json()) as UIConfig;
}
