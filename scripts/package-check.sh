#!/usr/bin/env bash
# make package-check: builds the Debian packages (scripts/package.sh), checks
# them with lintian and the units with systemd-analyze verify, installs them
# with dpkg -i on this machine, starts the installed agent as its system
# user with the installed configuration (not under systemd, which need not
# be PID 1 here; on 127.0.0.1, with certificates issued by the installed
# pitrust), checks that it serves, then purges the packages and checks that
# nothing of theirs is left (but the system user, which a purge keeps, as
# Debian does; the check removes it when it made it). Runs as root (dpkg);
# installs lintian when missing. Refuses to run where the packages or their
# files already are.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "package-check: run as root (it installs and purges packages): sudo make package-check" >&2
  exit 1
fi
pkgs=(pivirt-agent pvcli pitrust)
owned=(/usr/bin/pivirt-agent /usr/bin/pvcli /usr/bin/pitrust /etc/pivirt-agent /etc/pitrust /etc/pivirt
  /var/lib/pivirt-agent /var/log/pivirt-agent /var/lib/pitrust /usr/lib/systemd/system/pivirt-agent.service
  /usr/lib/systemd/system/pitrust.service /usr/share/doc/pivirt-agent /usr/share/doc/pvcli /usr/share/doc/pitrust)
for p in "${pkgs[@]}"; do
  if dpkg -s "$p" >/dev/null 2>&1; then
    echo "package-check: $p is installed on this machine; remove it first (dpkg --purge $p)" >&2
    exit 1
  fi
done
for f in "${owned[@]}"; do
  if [ -e "$f" ]; then
    echo "package-check: $f exists on this machine; the check installs and purges the packages and would take it" >&2
    exit 1
  fi
done
user_before=""
getent passwd pivirt-agent >/dev/null && user_before=1
command -v lintian >/dev/null || { apt-get update -q && apt-get install -y -q --no-install-recommends lintian; }

scripts/package.sh
debs=()
for p in "${pkgs[@]}"; do debs+=(dist/"$p"_*.deb); done

echo "== lintian"
# Errors fail; the packages' own overrides say why a tag does not apply.
lintian --fail-on error,warning "${debs[@]}"

agent_pid=""
log=""
cleanup() {
  if [ -n "$agent_pid" ]; then kill "$agent_pid" 2>/dev/null || true; wait "$agent_pid" 2>/dev/null || true; fi
  for p in "${pkgs[@]}"; do dpkg --purge "$p" >/dev/null 2>&1 || true; done
  rm -rf /etc/pivirt/certs/* 2>/dev/null || true
  rmdir /etc/pivirt/certs /etc/pivirt 2>/dev/null || true
  if [ -z "$user_before" ]; then
    userdel pivirt-agent >/dev/null 2>&1 || true
    groupdel pivirt-agent >/dev/null 2>&1 || true
  fi
  [ -z "$log" ] || rm -f "$log"
}
trap cleanup EXIT

echo "== dpkg -i"
dpkg -i "${debs[@]}"
getent passwd pivirt-agent >/dev/null || { echo "package-check: no system user pivirt-agent after the install" >&2; exit 1; }
want_mode() { # path mode owner:group
  local got
  got=$(stat -c '%a %U:%G' "$1")
  [ "$got" = "$2 $3" ] || { echo "package-check: $1 is $got, want $2 $3" >&2; exit 1; }
}
want_mode /var/lib/pivirt-agent 700 pivirt-agent:pivirt-agent
want_mode /var/log/pivirt-agent 750 pivirt-agent:pivirt-agent
want_mode /etc/pivirt 755 root:root
want_mode /etc/pivirt/certs 750 root:pivirt-agent
want_mode /var/lib/pitrust 700 root:root
[ -f /usr/share/man/man1/pvcli.1.gz ] && [ -f /usr/share/bash-completion/completions/pvcli ] ||
  { echo "package-check: man page or completion of pvcli missing" >&2; exit 1; }

echo "== systemd-analyze verify"
systemd-analyze verify /usr/lib/systemd/system/pivirt-agent.service /usr/lib/systemd/system/pitrust.service

echo "== the installed agent, with the installed configuration"
certs=/etc/pivirt/certs
node=$(hostname) # the installed configuration names no node: the host name
pitrust init --dir "$certs" >/dev/null
pitrust issue-mtls-server --dir "$certs" --name "$node" --dns localhost --ip 127.0.0.1 --out agent-server >/dev/null
pitrust issue-mtls-client --dir "$certs" --name "pivirt-agent-$node" --cluster pivirt --out agent-client >/dev/null
chgrp pivirt-agent "$certs"/agent-*.key
chmod 640 "$certs"/agent-*.key
pivirt-agent validate --config /etc/pivirt-agent/config.yaml
# Five distinct ports, free for TCP and UDP (gossip is both), below the
# kernel's ephemeral range: no outgoing connection takes one before the
# agent binds it.
read -r api metrics internal raft gossip < <(python3 - <<'PY'
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
held, ports = [], []
for _ in range(500):
    if len(ports) == 5:
        break
    p = random.randrange(max(lo // 2, 10000), lo)
    try:
        t = socket.socket(); t.bind(("127.0.0.1", p))
        u = socket.socket(type=socket.SOCK_DGRAM); u.bind(("127.0.0.1", p))
    except OSError:
        continue
    held += [t, u]; ports.append(p)
print(*ports)
PY
)
[ -n "$gossip" ] || { echo "package-check: no five free ports on 127.0.0.1" >&2; exit 1; }
log=$(mktemp)
# setpriv replaces itself with the agent: $! is the agent's PID.
setpriv --reuid=pivirt-agent --regid=pivirt-agent --init-groups /usr/bin/pivirt-agent --config /etc/pivirt-agent/config.yaml \
  --node-name "$node" --bootstrap --voters 1 --api-addr "127.0.0.1:$api" --metrics-addr "127.0.0.1:$metrics" \
  --internal-addr "127.0.0.1:$internal" --raft-addr "127.0.0.1:$raft" --gossip-addr "127.0.0.1:$gossip" >"$log" 2>&1 &
agent_pid=$!
ready=""
for _ in $(seq 1 120); do
  if curl -fsS -m 2 "http://127.0.0.1:$metrics/ready" >/dev/null 2>&1; then ready=1; break; fi
  kill -0 "$agent_pid" 2>/dev/null || break
  sleep 0.5
done
if [ -z "$ready" ]; then
  echo "package-check: the installed agent is not ready within 60s; its log:" >&2
  tail -40 "$log" >&2
  exit 1
fi
pvcli --endpoint "https://127.0.0.1:$api" --ca-file "$certs/ca-chain.pem" \
  --cert-file "$certs/agent-client.crt" --key-file "$certs/agent-client.key" cluster leader
kill "$agent_pid"
wait "$agent_pid" || true
agent_pid=""

echo "== dpkg --purge"
rm -f "$certs"/* # the operator's certificates, not the packages'
for p in "${pkgs[@]}"; do dpkg --purge "$p"; done
left=()
for f in "${owned[@]}"; do [ -e "$f" ] && left+=("$f"); done
if ((${#left[@]})); then
  echo "package-check: left after the purge: ${left[*]}" >&2
  exit 1
fi
echo "package-check: ok (${debs[*]})"
