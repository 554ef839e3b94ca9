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

// xterm.js creates <style> elements for part of its CSS, which the page's
// Content-Security-Policy (style-src 'self') refuses: its calls go to
// ui/src/inertstyle.ts instead, which applies the same CSS through
// constructed stylesheets. A release of xterm with other calls fails the
// build here, to be looked at.
const inertStyle = {
  name: "xterm-inert-style",
  setup(build) {
    build.onLoad({ filter: /[\\/]@xterm[\\/]xterm[\\/]lib[\\/]xterm\.mjs$/ }, (args) => {
      const src = readFileSync(args.path, "utf8");
      let n = 0;
      const patched = src.replace(/([\w$]+(?:\.[\w$]+)*)\.createElement\("style"\)/g, (_, doc) => {
        n++;
        return `__inertStyle(${doc})`;
      });
      if (n !== 3 || /createElement\(['"`]style/.test(patched)) {
        throw new Error(`build: xterm creates <style> elements in ${n} places, not the 3 ui/src/inertstyle.ts was written for`);
      }
      return { contents: `import { inertStyle as __inertStyle } from "./inertstyle.ts";\n${patched}`, loader: "js", resolveDir: join(root, "src") };
    });
  },
};

const result = await esbuild.build({
  entryPoints: [join(root, "src", "main.tsx")],
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2022"],
  outdir: join(out, "assets"),
  // The console (xterm.js, twice the rest's size) is a chunk of its own,
  // loaded when a console opens; its CSS is in the app's stylesheet.
  splitting: true,
  entryNames: "[name]-[hash]",
  chunkNames: "[name]-[hash]",
  assetNames: "[name]-[hash]",
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "linked",
  metafile: true,
  logLevel: "warning",
  charset: "utf8",
  plugins: [inertStyle],
});

let js = "";
let css = "";
for (const [file, meta] of Object.entries(result.metafile.outputs)) {
  if (meta.entryPoint && basename(meta.entryPoint) === "main.tsx" && file.endsWith(".js")) js = basename(file);
  if (file.endsWith(".css")) css = basename(file);
}
if (!js || !css) {
  throw new Error("build: no JavaScript or CSS output");
}
const html = readFileSync(join(root, "index.html"), "utf8")
  .replace("{{app.js}}", `assets/${js}`)
  .replace("{{app.css}}", `assets/${css}`);
writeFileSync(join(out, "index.html"), html);

// A gzip copy of each script and stylesheet, served to browsers that
// accept it (a script is a third of its size). Node's gzip header has no
// time: the bytes depend on the content only.
for (const file of Object.keys(result.metafile.outputs)) {
  if (!file.endsWith(".js") && !file.endsWith(".css")) continue;
  const path = join(out, "assets", basename(file));
  writeFileSync(path + ".gz", gzipSync(readFileSync(path), { level: 9 }));
}
