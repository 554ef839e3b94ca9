#!/usr/bin/env bash
# Installs Node.js and npm from Debian when missing: the pinned tools of
# package-lock.json (buf, protoc-gen-es, esbuild, TypeScript) run on them.
set -euo pipefail
command -v node >/dev/null && command -v npm >/dev/null && exit 0
if ! command -v apt-get >/dev/null; then
  echo "node-deps: Node.js and npm are needed (18 or newer); install them with your package manager" >&2
  exit 1
fi
sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
missing=()
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
echo "node-deps: installing ${missing[*]} from Debian"
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
