// Runs the UI's unit tests (ui/test/*.test.ts) with Node's test runner:
// esbuild bundles each for Node into a temporary directory (types are
// stripped; tsc checks ui/src, which the tests exercise). Run by
// make check-ui (node ui/test.mjs).
import * as esbuild from "esbuild";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const tests = readdirSync(join(root, "test")).filter((f) => f.endsWith(".test.ts"));
const out = mkdtempSync(join(tmpdir(), "pivirt-ui-test-"));
try {
  await esbuild.build({
    entryPoints: tests.map((f) => join(root, "test", f)),
    bundle: true,
    platform: "node",
    format: "esm",
    target: ["node18"],
    outdir: out,
    outExtension: { ".js": ".mjs" },
    logLevel: "warning",
  });
  const r = spawnSync(process.execPath, ["--test", ...readdirSync(out).map((f) => join(out, f))], { stdio: "inherit" });
  process.exitCode = r.status ?? 1;
} finally {
  rmSync(out, { recursive: true, force: true });
}
