#!/usr/bin/env bash
# DeepSeek V4 / V4.1 on a CUDA machine in one call (<= 240 s on an H100): FlashMLA's legacy V4
# decode fuzzed against the reference at --profile gpu, our Triton V4 / V4.1 decode on cuda, the V4
# properties for every implementation, then scripts/gpu_v4_probe.py (what the kernel accepts and
# refuses, timings). Each step logs to $OUT/<name>.log; a table of exit codes, seconds and verdicts
# (with the least headroom) is printed last.
#   scripts/gpu_v4.sh [STEP ...]      steps: fuzz triton properties probe pipeline (default: all but pipeline)
#   EXAMPLES=64 SEED=1 PROBE_S=45 scripts/gpu_v4.sh
# Limits (s): fuzz 60, triton 30 + 25, properties 70 (the pinned production shape and 2 drawn cases
# a property, implementation and target, in one process), probe 45 (FlashMLA's acceptances and
# refusals, then timings; its riskiest raw calls last): 230 in all besides the install.
set -uo pipefail
EXAMPLES=${EXAMPLES:-64}
SEED=${SEED:-1}
. "$(dirname "$0")/device_env.sh" runs/gpu-v4
summary=()
run() {
  local name=$1 limit=$2 start=$SECONDS code; shift 2
  timeout -k 10 "$limit" python3 -m mla_verify.cli "$@" --device cuda --seed "$SEED" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  code=$?
  summary+=("$(printf '%-30s exit %-4s %5ss  %s' "$name" "$code" "$((SECONDS - start))" "$(grep -E '^(PASS|DISCREPANCY|FLAKY|NO VERDICT)' "$OUT/$name.log" | tail -n 1 | cut -c1-110)")")
}
for STEP in fuzz triton properties probe pipeline; do
  want "$@" || continue
  [ $# -eq 0 ] && [ "$STEP" = pipeline ] && continue  # the decode step with FlashMLA and with ours: asked for by name
  case $STEP in
    fuzz) run fuzz-v4-flash_mla 60 fuzz --op sparse_decode_v4 --profile gpu --examples "$EXAMPLES" ;;
    triton)
      run fuzz-v4-triton 30 fuzz --op sparse_decode_v4 --impl triton --profile gpu --examples 16
      run fuzz-v41-triton 25 fuzz --op sparse_decode_v41 --impl triton --profile gpu --examples 8 ;;
    properties)
      start=$SECONDS
      timeout -k 10 70 python3 scripts/gpu_properties.py --property v4_union_merge --property v4_extra_empty \
        --property v4_zero_rope --property v4_row_alone --examples 2 --seed "$SEED" --out "$OUT/properties" \
        > "$OUT/properties.log" 2>&1
      summary+=("$(printf '%-30s exit %-4s %5ss  %s' properties $? "$((SECONDS - start))" "$(tail -n 1 "$OUT/properties.log" | cut -c1-80)")") ;;
    pipeline) run fuzz-v4_decode 60 fuzz --op v4_decode --profile gpu --examples 16 ;;
    probe)
      start=$SECONDS
      timeout -k 10 "${PROBE_S:-45}" python3 scripts/gpu_v4_probe.py "$OUT" > "$OUT/probe.log" 2>&1
      summary+=("$(printf '%-30s exit %-4s %5ss  %s' probe $? "$((SECONDS - start))" "see probe.log, gpu_v4_probe.json")") ;;
  esac
done
tar czf "$OUT/runs.tgz" -C "$OUT" --exclude runs.tgz $(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d) 2>/dev/null
find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
tail -n 25 "$OUT/probe.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
