// Routing under /ui/: every view has a URL that can be shared (a VM's
// page, a schedule's runs); the agent answers index.html for any of them.
import { useEffect, useState } from "preact/hooks";

const event = "pivirt:navigate";

/** The path below /ui/, split: /ui/vms/web-1 → ["vms", "web-1"]. */
export function currentRoute(): string[] {
  return location.pathname
    .replace(/^\/ui\/?/, "")
    .split("/")
    .filter((s) => s !== "")
    .map(decodeURIComponent);
}

export function useRoute(): string[] {
  const [route, setRoute] = useState(currentRoute());
  useEffect(() => {
    const update = () => setRoute(currentRoute());
    addEventListener("popstate", update);
    addEventListener(event, update);
    // A child's effect may have navigated before this listener was added
    // (effects run children first).
    update();
    return () => {
      removeEventListener("popstate", update);
      removeEventListener(event, update);
    };
  }, []);
  return route;
}

/** The URL of a view: href("vms", id) → /ui/vms/<id>. */
export function href(...parts: string[]): string {
  return "/ui/" + parts.map(encodeURIComponent).join("/");
}

export function navigate(to: string, replace = false): void {
  if (replace) {
    history.replaceState(null, "", to);
  } else {
    history.pushState(null, "", to);
  }
  dispatchEvent(new Event(event));
  scrollTo(0, 0);
}

/** onClick of an in-app link: navigate without reloading, unless a modifier asks for a new tab. */
export function follow(e: MouseEvent): void {
  const a = (e.currentTarget as HTMLAnchorElement | null) ?? null;
  if (!a || e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) {
    return;
  }
  e.preventDefault();
  navigate(a.pathname + a.search);
}
