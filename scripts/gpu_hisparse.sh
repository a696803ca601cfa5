#!/usr/bin/env bash
# The HiSparse paths on a CUDA machine in one call: fuzz both HiSparse forward_mqa paths with the
# default (flash_mla) stages, then the hisparse_equals_plain property for every implementation,
# each run logging to $OUT/<name>.log; a table of exit codes and verdicts is printed last.
#   scripts/gpu_hisparse.sh [EXAMPLES] [SEED]          (or: scripts/gpu_lane.sh hisparse)
set -uo pipefail
EXAMPLES=${1:-100}
SEED=${2:-1}
. "$(dirname "$0")/device_env.sh" runs/gpu-hisparse
summary=()
run() {
  local name=$1 start=$SECONDS code; shift
  timeout -k 10 "${LIMIT:-240}" python3 -m mla_verify.cli "$@" --device cuda --seed "$SEED" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  code=$?
  summary+=("$(printf '%-34s exit %-4s %5ss  %s' "$name" "$code" "$((SECONDS - start))" "$(grep -E '^(PASS|DISCREPANCY|FLAKY)' "$OUT/$name.log" | tail -n 1 | cut -c1-80)")")
}
run fuzz-bf16_hisparse fuzz --op forward_mqa --path bf16_hisparse --examples "$EXAMPLES"
run fuzz-fp8_separate_hisparse fuzz --op forward_mqa --path fp8_separate_hisparse --examples "$EXAMPLES"
for impl in flash_mla triton torch-fp32; do
  run "property-$impl" fuzz --op property:hisparse_equals_plain --impl "$impl" --examples "$((EXAMPLES / 4 + 1))"
done
# What comes back from a device call is a few files: the logs, and the run directories (rows,
# failing cases, harness-error.txt) packed into one archive.
tar czf "$OUT/runs.tgz" -C "$OUT" --exclude runs.tgz $(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d) 2>/dev/null
find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
printf '%s\n' "${summary[@]}"
