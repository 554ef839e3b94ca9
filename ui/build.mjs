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

// xterm.js applies part of its CSS in ways the page's
// Content-Security-Policy (style-src 'self') refuses: <style> elements it
// creates (its calls go to ui/src/inertstyle.ts instead, which applies the
// same CSS through constructed stylesheets) and a style attribute it
// appends to (the colours of some characters: set through the CSSOM here,
// element.style, which the policy allows). A release of xterm written
// otherwise fails the build here, to be looked at.
const xtermCSP = {
  name: "xterm-csp",
  setup(build) {
    build.onLoad({ filter: /[\\/]@xterm[\\/]xterm[\\/]lib[\\/]xterm\.mjs$/ }, (args) => {
      let src = readFileSync(args.path, "utf8");
      let styles = 0;
      src = src.replace(/([\w$]+(?:\.[\w$]+)*)\.createElement\("style"\)/g, (_, doc) => {
        styles++;
        return `__inertStyle(${doc})`;
      });
      let attrs = 0;
      src = src.replace(/([\w$]+)\.setAttribute\("style",`\$\{\1\.getAttribute\("style"\)\|\|""\}\$\{([\w$]+)\};`\)/g, (_, el, css) => {
        attrs++;
        return `${el}.style.cssText+=${css}+";"`;
      });
      if (styles !== 3 || attrs !== 1 || /createElement\(['"`]style|setAttribute\(['"`]style|\.innerHTML\b/.test(src)) {
        throw new Error(`build: xterm sets styles in other places (${styles} <style> elements, ${attrs} style attributes) than ui/build.mjs and ui/src/inertstyle.ts were written for`);
      }
      return { contents: `import { inertStyle as __inertStyle } from "./inertstyle.ts";\n${src}`, loader: "js", resolveDir: join(root, "src") };
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
  plugins: [xtermCSP],
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
