#!/usr/bin/env bash
# Checks the import direction of the top-level DESIGN.md, "Layout and import
# direction": the table between <!-- imports:begin --> and <!-- imports:end -->
# lists, per top-level package, the repository's top-level packages it may
# import. Every package is checked with its test files (in-package and
# external tests); a top-level package the table does not list fails.
set -euo pipefail
cd "$(dirname "$0")/.."
mod=$(go list -m)

# allowed[pkg]="space-separated top-level packages it may import", or "*".
declare -A allowed=()
in_table=0
while IFS= read -r line; do
  case $line in
    '<!-- imports:begin -->') in_table=1; continue ;;
    '<!-- imports:end -->') in_table=0; continue ;;
  esac
  ((in_table)) || continue
  [[ $line =~ ^\|\ \`([a-z]+)\`\ \|\ (.*)\ \|$ ]] || continue
  pkg=${BASH_REMATCH[1]} rule=${BASH_REMATCH[2]}
  case $rule in
    anything) allowed[$pkg]="*" ;;
    —) allowed[$pkg]="" ;;
    *) allowed[$pkg]=$(tr -d '`' <<<"$rule") ;;
  esac
done <DESIGN.md
if ((${#allowed[@]} == 0)); then
  echo "import check: no import table between <!-- imports:begin --> and <!-- imports:end --> in DESIGN.md"
  exit 1
fi

fail=0
while read -r pkg imports; do
  rel=${pkg#"$mod"/}
  top=${rel%%/*}
  if [[ -z ${allowed[$top]+x} ]]; then
    echo "import check: top-level package $top is not in DESIGN.md's import table (add a row to \"Layout and import direction\")"
    fail=1
    continue
  fi
  [[ ${allowed[$top]} == "*" ]] && continue
  for imp in $imports; do
    [[ $imp == "$mod"/* ]] || continue
    irel=${imp#"$mod"/}
    itop=${irel%%/*}
    [[ $itop == "$top" ]] && continue
    if [[ " ${allowed[$top]} " != *" $itop "* ]]; then
      echo "import check: $rel imports $irel, but $top may import only: ${allowed[$top]:-nothing internal} (DESIGN.md, \"Layout and import direction\")"
      fail=1
    fi
  done
done < <(go list -f '{{.ImportPath}} {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}' ./...)

if [[ $fail -ne 0 ]]; then
  exit 1
fi
echo "import check: ok"
