#!/usr/bin/env bash
# make conformance: the ConnectRPC conformance suite (connectrpc.com/conformance,
# pinned in conformance/go.mod) in server mode against a real pivirt-agent,
# built with the race detector, whose routing rule sends the suite's service to
# the suite's reference server as a plain gRPC backend; then again through a
# second agent of a 2-agent cluster, which finds the backend in the replicated
# services registry where the first agent registered it; each without the
# service's schema and with it (a descriptor set), conformance/README.md.
#
# The features declared are conformance/config.yaml. The cases of TLS without a
# client certificate are skipped: the API port serves no caller without a
# credential once TLS is on, and the suite can send no token (its TLS Client
# Certs cases, and every case in plaintext, run).
set -euo pipefail
cd "$(dirname "$0")/.."

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GO=${GO:-go}
$GO build -race -o "$bin/" ./cmd/pivirt-agent
$GO build -o "$bin/" ./cmd/pitrust
(cd conformance && $GO build -o "$bin/" ./sut ./descset connectrpc.com/conformance/cmd/connectconformance connectrpc.com/conformance/cmd/referenceserver)

logs=${CONFORMANCE_LOGS:-}
args=(--agent "$bin/pivirt-agent" --pitrust "$bin/pitrust" --backend "$bin/referenceserver")
if [[ -n "$logs" ]]; then
	mkdir -p "$logs"
	args+=(--log-dir "$logs")
fi
# CONFORMANCE_ARGS holds more flags of connectconformance, quoted as in a
# shell: CONFORMANCE_ARGS="--run 'TLS Client Certs/**'".
eval "extra=(${CONFORMANCE_ARGS:-})"
# Without a schema (the agent translates the framing only; Connect GET is
# refused), then with the service's descriptor set (compiled from the suite's
# .proto files) named in the routing rule, Connect GET declared.
"$bin/descset" -proto "$(cd conformance && $GO list -m -f '{{.Dir}}' connectrpc.com/conformance)/proto" -o "$bin/conformance.binpb"
for schema in none descriptor-set; do
	conf=conformance/config.yaml
	more=()
	if [[ $schema == descriptor-set ]]; then
		conf=conformance/config-schema.yaml
		more=(--descriptor-set "$bin/conformance.binpb")
	fi
	for agents in 1 2; do
		echo "== the suite through $agents agent(s), schema: $schema"
		# At most two servers under test at a time (one of 2 agents): the suite gives
		# each 10 s to answer with its address, which four 2-agent clusters starting
		# at once on two busy cores did not always manage; and its client's own
		# deadline races the answer of a Timeouts case, which the delays of an
		# overloaded machine make likelier (conformance/README.md).
		servers=$((agents == 1 ? 2 : 1))
		GORACE=halt_on_error=1 "$bin/connectconformance" --mode server --conf "$conf" --max-servers "$servers" \
			--skip '**/TLS:true/**' "${extra[@]}" -- "$bin/sut" --agents "$agents" "${more[@]}" "${args[@]}"
	done
done
