#!/usr/bin/env bash
# Installs what `make bench` compares the gateway with, when missing:
# HAProxy (Debian package haproxy) and nginx (nginx-light). It uses apt-get
# as root, or through `sudo -n` (never asking for a password). Where it
# cannot install them it says so and exits 0: BenchmarkGateway then skips
# the haproxy and nginx rows with a message naming the reason, and the rest
# of the benchmarks run.
#
# Note: on a host with an init system, the Debian packages enable and start
# their services (nginx on port 80, haproxy); the benchmark does not use
# them, it runs its own instances with configurations of its own.
set -uo pipefail

have() {
	command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/local/sbin/$1" ] || [ -x "/sbin/$1" ]
}

missing=()
have haproxy || missing+=(haproxy)
have nginx || missing+=(nginx-light)
if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi

skip() {
	echo "bench-deps: cannot install ${missing[*]}: $1." >&2
	echo "bench-deps: BenchmarkGateway will skip their rows; install them (Debian: apt-get install ${missing[*]}) to compare the gateway with them." >&2
	exit 0
}

command -v apt-get >/dev/null 2>&1 || skip "no apt-get on this host"
if [ "$(id -u)" -eq 0 ]; then
	run=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
	run=(sudo -n)
else
	skip "not root and sudo needs a password (or is missing)"
fi

echo "bench-deps: installing ${missing[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${run[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
	# A stale package list: refresh it once and try again.
	"${run[@]}" apt-get update || skip "apt-get update failed"
	"${run[@]}" apt-get install -y --no-install-recommends "${missing[@]}" || skip "apt-get install failed"
fi
