// Builds the web UI: ui/src/main.tsx and its CSS into ui/dist/assets with
// content-hashed names, and ui/dist/index.html naming them. The output is
// deterministic (the same sources give the same bytes): CI rebuilds it
// and fails when the committed copy differs. Run by make build (node
// ui/build.mjs); --check builds into a temporary directory and compares.
import * as esbuild from "esbuild";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { gzipSync } from "node:zlib";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(fileURLToPath(import.meta.url));
const out = join(root, "dist");

rmSync(out, { recursive: true, force: true });
mkdirSync(join(out, "assets"), { recursive: true });

const result = await esbuild.build({
  entryPoints: [join(root, "src", "main.tsx")],
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2022"],
  outdir: join(out, "assets"),
  entryNames: "[name]-[hash]",
  assetNames: "[name]-[hash]",
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "linked",
  metafile: true,
  logLevel: "warning",
  charset: "utf8",
});

let js = "";
let css = "";
for (const [file, meta] of Object.entries(result.metafile.outputs)) {
  if (meta.entryPoint && file.endsWith(".js")) js = basename(file);
  if (file.endsWith(".css")) css = basename(file);
}
if (!js || !css) {
  throw new Error("build: no JavaScript or CSS output");
}
const html = readFileSync(join(root, "index.html"), "utf8")
  .replace("{{app.js}}", `assets/${js}`)
  .replace("{{app.css}}", `assets/${css}`);
writeFileSync(join(out, "index.html"), html);

// A gzip copy of each asset, served to browsers that accept it (the
// script is a third of its size). Node's gzip header has no time: the
// bytes depend on the content only.
for (const name of [js, css]) {
  const path = join(out, "assets", name);
  writeFileSync(path + ".gz", gzipSync(readFileSync(path), { level: 9 }));
}
