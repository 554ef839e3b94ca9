#!/usr/bin/env bash
# Starts (or stops) a local three-agent cluster on 127.0.0.1 with the binaries
# in bin/, with TLS on every port and encrypted gossip: a development
# PiTrust PKI and a gossip key are made in .cluster/ on first start. Each
# agent proxies the VM, storage and network APIs to its own pivirtd-sim (a
# simulated pivirtd and iscsiman) on a unix socket. A development OIDC issuer
# (pitrust dev-issuer, its key in .cluster/certs/) serves on 127.0.0.1:8440 and
# the agents take its tokens (auth.oidc), with the reference RBAC policy.
# Data and logs go to .cluster/ in the repository; a start appends to each
# process's log after a line "=== <date>: starting ...", so the log of an
# earlier run stays above it.
#
#   scripts/cluster.sh start    start the issuer and node1..node3, wait for a leader, print commands to try
#   scripts/cluster.sh stop     stop them (SIGTERM, then SIGKILL after 10s)
#   scripts/cluster.sh status   show which are running: the agents, their simulators, the issuer
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dir="$root/.cluster"
bin="$root/bin"

# node  api   internal metrics gossip raft
nodes=(
  "node1 8443 9000 8444 7946 8300"
  "node2 8453 9010 8454 7956 8310"
  "node3 8463 9020 8464 7966 8320"
)

certs="$dir/certs"
issuer_addr=127.0.0.1:8440

running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
# The processes run in sessions of their own (setsid; not a fork: $! is
# the process): a Ctrl-C or the end of the shell that ran make cluster does
# not stop them, make cluster-stop does.

# mark LOG WHAT... appends the line that begins a start to a log.
mark() { local log=$1; shift; echo "=== $(date '+%Y-%m-%d %H:%M:%S %z'): starting $*" >>"$log"; }

# pki makes the development PKI once: the PiTrust CA, a server and an agent
# client certificate per node, an operator certificate for pvcli, and a
# gossip key.
pki() {
  if [[ ! -s "$dir/gossip.key" ]]; then
    (umask 077 && "$bin/pvcli" cluster keyring generate >"$dir/gossip.key")
  fi
  [[ -f "$certs/operator.key" ]] && return 0
  rm -rf "$certs"
  "$bin/pitrust" init --dir "$certs" >/dev/null
  for spec in "${nodes[@]}"; do
    read -r name _ <<<"$spec"
    # agent.pivirt.internal: the service name network policies give agents
    # (the specification's NetworkPolicy example).
    "$bin/pitrust" issue-mtls-server --dir "$certs" --name "$name-server" --dns localhost --dns agent.pivirt.internal --ip 127.0.0.1 --days 90 >/dev/null
    "$bin/pitrust" issue-mtls-client --dir "$certs" --name "pivirt-agent-$name" --dns agent.pivirt.internal --cluster pivirt --days 90 >/dev/null
  done
  "$bin/pitrust" issue-mtls-client --dir "$certs" --name operator --days 90 >/dev/null
  echo "made a development PKI in $certs and a gossip key in $dir/gossip.key"
}

# pvcli runs pvcli with the operator certificate.
pvcli() {
  PVCLI_CA_FILE="$certs/ca-chain.pem" PVCLI_CERT_FILE="$certs/operator.crt" PVCLI_KEY_FILE="$certs/operator.key" "$bin/pvcli" "$@"
}

# issuer starts the development OIDC issuer (its key and client secret are
# made in $certs on first start) and waits until it has recorded its URL.
issuer() {
  if running "$dir/dev-issuer.pid"; then
    echo "dev-issuer already running (pid $(cat "$dir/dev-issuer.pid"))"
    return 0
  fi
  rm -f "$certs/dev-oidc.issuer"
  mark "$dir/dev-issuer.log" "dev-issuer on $issuer_addr"
  setsid "$bin/pitrust" dev-issuer --dir "$certs" --addr "$issuer_addr" >>"$dir/dev-issuer.log" 2>&1 &
  echo $! >"$dir/dev-issuer.pid"
  for _ in $(seq 1 50); do
    [[ -s "$certs/dev-oidc.issuer" ]] && { echo "started dev-issuer (pid $(cat "$dir/dev-issuer.pid")): http://$issuer_addr"; return 0; }
    running "$dir/dev-issuer.pid" || break
    sleep 0.1
  done
  echo "dev-issuer did not start:"; tail -20 "$dir/dev-issuer.log"; exit 1
}

# policy writes the reference RBAC policy, which the agents enforce:
# the operator certificate has admin (auth.certificate_roles), a token the
# roles it names.
policy() {
  cat >"$dir/rbac.yaml" <<'YAML'
apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["admin"]
    resources: ["*"]
    verbs: ["*"]
  - roles: ["operator"]
    resources: ["virtualmachines", "volumes", "networks"]
    verbs: ["get", "list", "create", "update", "patch"]
  - roles: ["viewer"]
    resources: ["*"]
    verbs: ["get", "list"]
  - roles: ["vm-owner"]
    resources: ["virtualmachines"]
    verbs: ["get", "list", "update", "patch", "start", "stop", "console"]
    conditions:
      - field: "metadata.owner"
        operator: "Equals"
        value: "{{.user.identity}}"
YAML
}

start() {
  [[ -x "$bin/pivirt-agent" && -x "$bin/pvcli" && -x "$bin/pitrust" && -x "$bin/pivirtd-sim" ]] || { echo "build first: make build"; exit 1; }
  mkdir -p "$dir"
  pki
  issuer
  policy
  for spec in "${nodes[@]}"; do
    read -r name api internal metrics gossip raft <<<"$spec"
    if running "$dir/$name.pid"; then
      echo "$name already running (pid $(cat "$dir/$name.pid"))"
      continue
    fi
    sock="$dir/$name-sim.sock"
    if ! running "$dir/$name-sim.pid"; then
      mark "$dir/$name-sim.log" "pivirtd-sim for $name on unix://$sock"
      setsid "$bin/pivirtd-sim" --listen "unix://$sock" --data-dir "$dir/$name-sim" --host "$name" --log-format text \
        >>"$dir/$name-sim.log" 2>&1 &
      echo $! >"$dir/$name-sim.pid"
    fi
    cat >"$dir/$name.yaml" <<YAML
node_name: $name   # the node its agent certificate names
tls:
  enabled: true
  ca_file: $certs/ca-chain.pem
  cert_file: $certs/pivirt-agent-$name.crt
  key_file: $certs/pivirt-agent-$name.key
  verify_peer: true
  require_client_cert: false   # 8443 also takes a bearer token alone; every call still needs a token or a certificate
server:
  connectrpc:
    tls:
      cert_file: $certs/$name-server.crt
      key_file: $certs/$name-server.key
      ca_file: $certs/ca-chain.pem
      client_ca_file: $certs/ca-chain.pem
cluster:
  gossip:
    encrypt_key_file: $dir/gossip.key
auth:
  oidc:                 # the development issuer of pitrust dev-issuer: never for a real deployment
    issuer_url: http://$issuer_addr
    allow_http_issuer: true   # http:// on loopback: development only
    client_id: pivirt-agent
  rbac_policy: $dir/rbac.yaml
  certificate_roles:
    operator: [admin]   # the operator certificate of pvcli: keeps its rights under any RBAC policy that grants admin
logging:
  format: text
backends:
  pivirtd:
    endpoint: unix://$sock
    timeout: 30s
    retry:
      max_attempts: 3
      backoff: 100ms
  iscsiman:
    endpoint: unix://$sock
    timeout: 10s
YAML
    mark "$dir/$name.log" "pivirt-agent $name: api 127.0.0.1:$api"
    setsid "$bin/pivirt-agent" --config "$dir/$name.yaml" \
      --node-name "$name" --data-dir "$dir/$name" \
      --api-addr "127.0.0.1:$api" --internal-addr "127.0.0.1:$internal" \
      --metrics-addr "127.0.0.1:$metrics" --gossip-addr "127.0.0.1:$gossip" \
      --raft-addr "127.0.0.1:$raft" \
      --bootstrap-expect 3 --retry-join 127.0.0.1:7946 --retry-join 127.0.0.1:7956 --retry-interval 1s \
      >>"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
    echo "started $name (pid $!): api 127.0.0.1:$api, log $dir/$name.log"
  done
  echo -n "waiting for a leader"
  for _ in $(seq 1 60); do
    if pvcli --endpoint https://127.0.0.1:8443 --timeout 2s cluster leader >/dev/null 2>&1; then
      echo " ok"
      # A node that was removed (force-leave, remove-peer) comes back as a
      # non-voter, promoted after 10s of health: wait for three voters.
      for _ in $(seq 1 60); do
        voters=$(pvcli --endpoint https://127.0.0.1:8443 --timeout 2s -o json cluster peers 2>/dev/null | grep -c '"voter": true' || true)
        ((voters >= ${#nodes[@]})) && break
        [[ -n "${waiting:-}" ]] || { echo -n "waiting for ${#nodes[@]} voters (a returning node is promoted after 10s)"; waiting=1; }
        echo -n "."
        sleep 1
      done
      if ((voters < ${#nodes[@]})); then
        echo " only $voters voters after 60s; see pvcli operator autopilot state and the logs in $dir"
      elif [[ -n "${waiting:-}" ]]; then
        echo " ok"
      fi
      # Every agent sees every other alive (a restarted agent's gossip view
      # fills in a few seconds after the leader is back): a command naming
      # another node (pvcli monitor --node) works through any of them.
      for spec in "${nodes[@]}"; do
        read -r _ api _ <<<"$spec"
        for _ in $(seq 1 30); do
          alive=$(pvcli --endpoint "https://127.0.0.1:$api" --timeout 2s -o json cluster members 2>/dev/null | grep -c '"status": "MEMBER_STATUS_ALIVE"' || true)
          ((alive >= ${#nodes[@]})) && break
          sleep 1
        done
      done
      pvcli --endpoint https://127.0.0.1:8443 cluster peers
      cat <<MSG

The cluster is up, with TLS on every port and encrypted gossip. Try, against
any node (8443, 8453, 8463):
  export PATH="$bin:\$PATH"
  export PVCLI_CA_FILE=$certs/ca-chain.pem PVCLI_CERT_FILE=$certs/operator.crt PVCLI_KEY_FILE=$certs/operator.key
  export PVCLI_ENDPOINT=127.0.0.1:8443,127.0.0.1:8453,127.0.0.1:8463   # the next when one is down
  pvcli version
  pvcli --endpoint https://127.0.0.1:8453 cluster members
  pvcli --endpoint https://127.0.0.1:8463 service register web --address 10.0.0.5 --port 8080 --tag v1
  pvcli --endpoint https://127.0.0.1:8443 service list --consistency consistent
  pvcli --endpoint https://127.0.0.1:8453 config set logging.level debug   # every agent logs at debug within a second
  pvcli --endpoint https://127.0.0.1:8463 config status                     # which settings each node applied
  pvcli --endpoint https://127.0.0.1:8453 config set kv/maintenance.window "Sun 02:00-04:00"
  pvcli --endpoint https://127.0.0.1:8463 config history kv/maintenance.window
  pvcli --endpoint https://127.0.0.1:8443 snapshot save backup.tar.gz
  pvcli --endpoint https://127.0.0.1:8453 vm create web-1 --vcpus 2 --memory-mib 2048 --owner alice
  pvcli --endpoint https://127.0.0.1:8443 vm create db-1 --host node3   # on node3's (simulated) hypervisor
  pvcli --endpoint https://127.0.0.1:8463 vm list       # the VMs of every node, through any node
  go tool grpcurl -cacert $certs/ca-chain.pem -cert $certs/operator.crt -key $certs/operator.key 127.0.0.1:8443 list
  pitrust inspect $certs/node1-server.crt
  kill \$(cat $dir/node1.pid)      # kill a node, then keep using the others

Or with a bearer token of the development OIDC issuer (http://$issuer_addr, its key in
$certs), whose roles the reference RBAC policy in $dir/rbac.yaml judges:
  export TOKEN=\$(pitrust dev-token --dir $certs --user alice --roles vm-owner)   # --ttl 1h by default
  pvcli login --dir $certs --user alice --roles vm-owner   # or save one in the current pvcli context (--print: print it)
  pvcli --endpoint https://127.0.0.1:8443 --token "\$TOKEN" vm list   # alice's VMs only (with PVCLI_CA_FILE set)
  pvcli --endpoint https://127.0.0.1:8443 --token "\$TOKEN" whoami --access   # who alice is to the agent, and what she may call
  curl --cacert $certs/ca-chain.pem -H "authorization: Bearer \$TOKEN" -H "content-type: application/json" \\
    -d '{}' https://127.0.0.1:8443/pivirt.vm.v1.VMService/ListVMs

The web console is on every agent: https://127.0.0.1:8443/ui/ (also :8453, :8463). The
browser warns about the development CA ($certs/ca-chain.pem: import it, or accept once).
"Log in" goes to the development issuer: any user name, roles such as admin, viewer or
vm-owner, and its password, the content of $certs/dev-oidc.secret.
Stop everything with: make cluster-stop
MSG
      return 0
    fi
    for spec in "${nodes[@]}"; do
      read -r name _ <<<"$spec"
      running "$dir/$name.pid" || { echo " $name exited:"; tail -5 "$dir/$name.log"; exit 1; }
    done
    echo -n "."
    sleep 1
  done
  echo " no leader after 60s; see the logs in $dir"
  exit 1
}

stop() {
  # Every process at once (SIGTERM), then whatever still runs after 10s
  # (SIGKILL): one after the other took a few seconds each.
  local pids=() procs=()
  for spec in "${nodes[@]}" dev-issuer; do
    read -r name _ <<<"$spec"
    for proc in "$name" "$name-sim"; do
      pidf="$dir/$proc.pid"
      if running "$pidf"; then
        pid=$(cat "$pidf")
        kill "$pid" 2>/dev/null || true
        pids+=("$pid")
        procs+=("$proc")
      fi
      rm -f "$pidf"
    done
  done
  ((${#pids[@]})) || return 0
  for _ in $(seq 1 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    kill -9 "${pids[$i]}" 2>/dev/null || true
    echo "stopped ${procs[$i]}"
  done
}

status() {
  for spec in "${nodes[@]}"; do
    read -r name api _ <<<"$spec"
    if running "$dir/$name.pid"; then echo "$name running (pid $(cat "$dir/$name.pid")), api 127.0.0.1:$api"; else echo "$name stopped"; fi
    if running "$dir/$name-sim.pid"; then echo "$name-sim running (pid $(cat "$dir/$name-sim.pid")), unix://$dir/$name-sim.sock"; else echo "$name-sim stopped"; fi
  done
  if running "$dir/dev-issuer.pid"; then echo "dev-issuer running (pid $(cat "$dir/dev-issuer.pid")), http://$issuer_addr"; else echo "dev-issuer stopped"; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status"; exit 2 ;;
esac
