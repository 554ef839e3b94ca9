#!/usr/bin/env bash
# Runs every fuzz target of the repository (each `func FuzzX` in a _test.go
# file) for FUZZTIME (default 30s) each, one after the other, and prints the
# executions per target. A failing input is written by go test to the
# package's testdata/fuzz/FuzzX/ (commit it: plain `go test` then replays
# it) and fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${FUZZTIME:-30s}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
total=0
status=0
while read -r file; do
  pkg=./$(dirname "$file")
  for name in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$file" | sed 's/^func //'); do
    result=FAILED
    for attempt in 1 2; do
      if go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "$pkg" >"$log" 2>&1; then
        result=ok
        break
      fi
      # Go's fuzzing coordinator (before Go 1.27, go.dev/issue/75804) may
      # report its own -fuzztime deadline as "context deadline exceeded"
      # when a worker is mid-input at that moment. With no failing input
      # written that is no finding: run the target once more.
      if [ "$attempt" = 1 ] && grep -q 'context deadline exceeded' "$log" &&
        ! grep -q 'Failing input written to' "$log"; then
        echo "$pkg $name: fuzzing coordinator reported its deadline as a failure (no failing input); running it again"
        continue
      fi
      break
    done
    if [ "$result" = FAILED ]; then
      status=1
      cat "$log"
    fi
    execs=$(grep -o 'execs: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
    total=$((total + execs))
    printf '%-8s %-28s %-22s %10s executions\n' "$result" "$pkg" "$name" "$execs"
  done
done < <(git ls-files '*_test.go' | xargs grep -l '^func Fuzz' | sort)
printf 'fuzz: %s executions in total, %s per target\n' "$total" "$fuzztime"
exit $status
