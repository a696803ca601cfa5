#!/usr/bin/env bash
# DeepSeek V4 / V4.1 on a CUDA machine in one call (~240 s on an H100): FlashMLA's legacy V4
# decode fuzzed against the reference at --profile gpu, our Triton V4 / V4.1 decode on cuda, the V4
# properties for every implementation, then scripts/gpu_v4_probe.py (what the kernel accepts and
# refuses, timings). Each step logs to $OUT/<name>.log; a table of exit codes, seconds and verdicts
# (with the least headroom) is printed last.
#   scripts/gpu_v4.sh [STEP ...]      steps: fuzz triton properties probe (default: all)
#   EXAMPLES=200 SEED=1 scripts/gpu_v4.sh
set -uo pipefail
EXAMPLES=${EXAMPLES:-200}
SEED=${SEED:-1}
. "$(dirname "$0")/device_env.sh" runs/gpu-v4
summary=()
run() {
  local name=$1 limit=$2 start=$SECONDS code; shift 2
  timeout -k 10 "$limit" python3 -m mla_verify.cli "$@" --device cuda --seed "$SEED" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  code=$?
  summary+=("$(printf '%-30s exit %-4s %5ss  %s' "$name" "$code" "$((SECONDS - start))" "$(grep -E '^(PASS|DISCREPANCY|FLAKY|NO VERDICT)' "$OUT/$name.log" | tail -n 1 | cut -c1-110)")")
}
for STEP in fuzz triton properties probe; do
  want "$@" || continue
  case $STEP in
    fuzz) run fuzz-v4-flash_mla 110 fuzz --op sparse_decode_v4 --profile gpu --examples "$EXAMPLES" ;;
    triton)
      run fuzz-v4-triton 50 fuzz --op sparse_decode_v4 --impl triton --profile gpu --examples 24
      run fuzz-v41-triton 40 fuzz --op sparse_decode_v41 --impl triton --profile gpu --examples 16 ;;
    properties)
      for prop in v4_union_merge v4_extra_empty v4_zero_rope v4_row_alone; do
        for impl in flash_mla triton; do
          run "property-$prop-$impl" 25 fuzz --op "property:$prop" --impl "sparse_decode_v4=$impl" --profile gpu --examples 8
        done
      done ;;
    probe)
      start=$SECONDS
      timeout -k 10 120 python3 scripts/gpu_v4_probe.py "$OUT" > "$OUT/probe.log" 2>&1
      summary+=("$(printf '%-30s exit %-4s %5ss  %s' probe $? "$((SECONDS - start))" "see probe.log, gpu_v4_probe.json")") ;;
  esac
done
tar czf "$OUT/runs.tgz" -C "$OUT" --exclude runs.tgz $(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d) 2>/dev/null
find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
tail -n 25 "$OUT/probe.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
