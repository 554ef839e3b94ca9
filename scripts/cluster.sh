#!/usr/bin/env bash
# Starts (or stops) a local three-agent cluster on 127.0.0.1 with the binaries
# in bin/. Data and logs go to .cluster/ in the repository.
#
#   scripts/cluster.sh start    start node1..node3, wait for a leader, print commands to try
#   scripts/cluster.sh stop     stop them (SIGTERM, then SIGKILL after 10s)
#   scripts/cluster.sh status   show which are running
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

running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  [[ -x "$bin/pivirt-agent" && -x "$bin/pvcli" ]] || { echo "build first: make build"; exit 1; }
  mkdir -p "$dir"
  for spec in "${nodes[@]}"; do
    read -r name api internal metrics gossip raft <<<"$spec"
    if running "$dir/$name.pid"; then
      echo "$name already running (pid $(cat "$dir/$name.pid"))"
      continue
    fi
    # TLS arrives with the PiTrust identity work; until then the local
    # cluster runs plaintext on loopback, which the agent warns about.
    cat >"$dir/$name.yaml" <<YAML
tls:
  enabled: false
logging:
  format: text
YAML
    "$bin/pivirt-agent" --config "$dir/$name.yaml" \
      --node-name "$name" --data-dir "$dir/$name" \
      --api-addr "127.0.0.1:$api" --internal-addr "127.0.0.1:$internal" \
      --metrics-addr "127.0.0.1:$metrics" --gossip-addr "127.0.0.1:$gossip" \
      --raft-addr "127.0.0.1:$raft" \
      --bootstrap-expect 3 --retry-join 127.0.0.1:7946 --retry-join 127.0.0.1:7956 --retry-interval 1s \
      >"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
    echo "started $name (pid $!): api 127.0.0.1:$api, log $dir/$name.log"
  done
  echo -n "waiting for a leader"
  for _ in $(seq 1 60); do
    if "$bin/pvcli" --endpoint 127.0.0.1:8443 --timeout 2s cluster leader >/dev/null 2>&1; then
      echo " ok"
      "$bin/pvcli" --endpoint 127.0.0.1:8443 cluster peers
      cat <<MSG

The cluster is up. Try, against any node (8443, 8453, 8463):
  export PATH="$bin:\$PATH"
  pvcli --endpoint 127.0.0.1:8453 cluster members
  pvcli --endpoint 127.0.0.1:8463 service register web --address 10.0.0.5 --port 8080 --tag v1
  pvcli --endpoint 127.0.0.1:8443 service list --consistency consistent
  pvcli --endpoint 127.0.0.1:8453 config set log_level debug
  pvcli --endpoint 127.0.0.1:8463 config history log_level
  kill \$(cat $dir/node1.pid)      # kill a node, then keep using the others
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
  for spec in "${nodes[@]}"; do
    read -r name _ <<<"$spec"
    pidf="$dir/$name.pid"
    if running "$pidf"; then
      pid=$(cat "$pidf")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      echo "stopped $name"
    fi
    rm -f "$pidf"
  done
}

status() {
  for spec in "${nodes[@]}"; do
    read -r name api _ <<<"$spec"
    if running "$dir/$name.pid"; then echo "$name running (pid $(cat "$dir/$name.pid")), api 127.0.0.1:$api"; else echo "$name stopped"; fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status"; exit 2 ;;
esac
