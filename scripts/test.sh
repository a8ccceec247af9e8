#!/usr/bin/env bash
# Runs every test of the workspace, as `cargo test --workspace --all-targets` would, but with
# several test binaries at once: the end-to-end binaries spend most of their time waiting on
# real control planes (a node going NotReady, a toleration running out), so on 2 cores three
# of them side by side take about half the time one after another does. Each binary still
# runs its own tests as cargo runs them (one process, tests on threads, a shared bed).
#
#   TEST_JOBS   binaries at once (default 3); 1 runs them one after another
#   extra arguments go to every test binary (for example a name filter, or --nocapture)
#
# Each binary's output is printed whole when it ends, behind cargo's `Running` line; the last
# line says how many tests passed and failed. Exits non-zero when any binary failed.
set -uo pipefail
cd "$(dirname "$0")/.."

JOBS=${TEST_JOBS:-3}
LOGS=target/test-logs
rm -rf "$LOGS"
mkdir -p "$LOGS"

# Build every test binary; list them with the package directory cargo runs each in.
list=$(cargo test --workspace --all-targets --no-run --message-format=json-render-diagnostics \
  | python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"] + "\t" + os.path.dirname(m["manifest_path"]) + "\t" + m["target"]["name"])
') || {
  echo "test.sh: building the tests failed; disk free under target/: $(df -h --output=avail target | tail -1 | tr -d ' ')" >&2
  exit 101
}

# The slowest binaries first, so that the lanes end together.
slow=(pod_contract descheduler virtual_node clusters chart copies failback isolation multi_scheduler demo runtime rebalance overrides exec deploy_docs webhook testbed)
ordered=()
for name in "${slow[@]}"; do
  while IFS=$'\t' read -r exe dir target; do
    [ "$target" = "$name" ] && [[ "$dir" == */e2e ]] && ordered+=("$exe"$'\t'"$dir"$'\t'"$target")
  done <<<"$list"
done
while IFS=$'\t' read -r exe dir target; do
  [ -n "$exe" ] || continue
  printf '%s\n' "${ordered[@]}" | grep -qxF "$exe"$'\t'"$dir"$'\t'"$target" || ordered+=("$exe"$'\t'"$dir"$'\t'"$target")
done <<<"$list"

started=$(date +%s)
pids=()
declare -A names
run() {
  local exe=$1 dir=$2 log=$3
  (cd "$dir" && "$exe" "${@:4}") >"$log" 2>&1
}
report() {
  local pid=$1 status=$2
  local log=${names[$pid]}
  echo "     Running $(basename "${log%.log}")"
  cat "$log"
  [ "$status" = 0 ] || echo "test.sh: $(basename "${log%.log}") exited with $status"
}
failed_bins=0
wait_one() {
  local pid status
  wait -n -p pid "${pids[@]}"
  status=$?
  report "$pid" "$status"
  [ "$status" = 0 ] || failed_bins=$((failed_bins + 1))
  local rest=()
  for p in "${pids[@]}"; do [ "$p" != "$pid" ] && rest+=("$p"); done
  pids=("${rest[@]}")
}
for entry in "${ordered[@]}"; do
  IFS=$'\t' read -r exe dir target <<<"$entry"
  while [ "${#pids[@]}" -ge "$JOBS" ]; do wait_one; done
  log="$LOGS/$(basename "$exe").log"
  run "$exe" "$dir" "$log" "$@" &
  pids+=($!)
  names[$!]=$log
done
while [ "${#pids[@]}" -gt 0 ]; do wait_one; done

passed=0
failed=0
while read -r p f; do
  passed=$((passed + p))
  failed=$((failed + f))
done < <(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1 \2/p' "$LOGS"/*.log)
echo "test.sh: $(ls "$LOGS" | wc -l) test binaries, $JOBS at once, in $(($(date +%s) - started)) s"
echo "$passed passed, $failed failed"
[ "$failed_bins" = 0 ] && [ "$failed" = 0 ]
