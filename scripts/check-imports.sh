#!/usr/bin/env bash
# Checks the import direction of DESIGN.md "Layout and import direction":
# cmd/ wires everything; gateway sits on top; scheduler, store and cluster
# are siblings that never import each other; fsm, proto and identity are
# leaves.
set -euo pipefail
cd "$(dirname "$0")/.."
mod=$(go list -m)

# allowed[pkg]="space-separated internal top-level packages it may import"
declare -A allowed=(
  [proto]="proto"
  [identity]=""
  [fsm]="proto"
  [store]="fsm proto"
  [cluster]="fsm proto identity"
  [scheduler]="fsm proto"
  [gateway]="store cluster scheduler fsm proto identity"
)

fail=0
while read -r pkg imports; do
  rel=${pkg#"$mod"/}
  top=${rel%%/*}
  [[ $top == cmd ]] && continue
  if [[ -z ${allowed[$top]+x} ]]; then
    echo "import check: top-level package $top is not in DESIGN.md's layout (add it to scripts/check-imports.sh and DESIGN.md)"
    fail=1
    continue
  fi
  for imp in $imports; do
    [[ $imp == "$mod"/* ]] || continue
    irel=${imp#"$mod"/}
    itop=${irel%%/*}
    [[ $itop == "$top" ]] && continue
    if [[ " ${allowed[$top]} " != *" $itop "* ]]; then
      echo "import check: $rel imports $irel, but $top may import only: ${allowed[$top]:-nothing internal}"
      fail=1
    fi
  done
done < <(go list -f '{{.ImportPath}} {{join .Imports " "}}' ./... && go list -test -f '{{.ImportPath}} {{join .Imports " "}}' ./... | grep -v '\.test ' | grep -v '\[' || true)

if [[ $fail -ne 0 ]]; then
  exit 1
fi
echo "import check: ok"
