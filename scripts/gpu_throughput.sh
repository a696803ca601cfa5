#!/usr/bin/env bash
# Issue 28 on the GPU in one call: `mla-verify bench --only harness` (overhead at decode B=64 s_q=2
# H=128 before/after blocks, the reference's TFLOP/s, fuzz throughput in-process, isolated and
# 4 campaigns sharing the GPU), where a campaign's time goes (scripts/profile_fuzz.py), and the
# CLI as users run it: `fuzz --parallel 4` on the one GPU, isolated and in-process, 4000 cases,
# timed whole (process start-up included). Logs in $OUT; a short table last.
#   [PREV=DIR] scripts/gpu_throughput.sh [bench] [profile] [cli] [compare]     (default: all)
set -uo pipefail
. "$(dirname "$0")/device_env.sh" runs/gpu-throughput
summary=()
STEP=bench; if want "$@"; then
  timeout -k 5 400 python3 -m mla_verify.cli bench --device cuda --only harness --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  summary+=("bench exit $?")
fi
STEP=profile; if want "$@"; then
  timeout -k 5 200 python3 scripts/profile_fuzz.py --device cuda --examples 400 --out /tmp/profile > "$OUT/profile.log" 2>&1
  summary+=("profile exit $?")
fi
STEP=cli; if want "$@"; then
  for how in isolated --no-isolate; do
    start=$SECONDS
    timeout -k 5 200 python3 -m mla_verify.cli fuzz --op sparse_decode_fp8 --device cuda --profile gpu --examples 4000 \
      --parallel 4 --seed 1 $([ "$how" = isolated ] || echo "$how") --out "/tmp/cli-$how" > "$OUT/cli-$how.log" 2>&1
    code=$?
    summary+=("fuzz --parallel 4 ($how): exit $code, 4000 cases in $((SECONDS - start)) s with start-up: $(grep -E '^(PASS|FAIL)' "$OUT/cli-$how.log" | head -n 1 | cut -c1-90)")
    [ $code = 0 ] || tail -n 4 /tmp/cli-$how/part-*/fuzz.log >> "$OUT/cli-$how.log" 2>&1
  done
fi
# The same campaigns, in process and isolated, on the tree in $PREV (a checkout of an earlier commit,
# carried as an ignored folder), alternating with this one, each in a fresh process: before and
# after on one machine.
STEP=compare; if [ -n "${PREV:-}" ] && want "$@"; then
  for tree in "$PREV" . "$PREV" .; do
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -k 5 150 python3 -c "
from mla_verify.bench.bench import _throughput
from mla_verify.equivalence.catalog import resolve_subject
from mla_verify.equivalence.cases.profiles import get_profile
subject, profile = resolve_subject('sparse_decode_fp8', [], 'cuda'), get_profile('gpu')
_throughput(subject, 'cuda', profile, 16, 8)
for isolated in (False, True):
    r = _throughput(subject, 'cuda', profile, 400, 8, isolated)
    print(f'{\"$tree\":8s} {r[\"impl\"]}: {r[\"cases_per_s\"]:.1f} cases/s; {r[\"ops_note\"]}')" 2>&1 | tail -n 2) >> "$OUT/compare.log"
  done
fi
grep -E "^(harness|fuzz) " "$OUT/bench.log" 2>/dev/null | cut -c1-230
grep -E "^(host|timers|  )" "$OUT/profile.log" 2>/dev/null
cat "$OUT/compare.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
