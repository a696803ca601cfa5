#!/usr/bin/env bash
# Issue 48's figures on one GPU in one call (~400 s on an H100 with PREV set), before and after on
# the same machine: PREV=DIR is a checkout of the earlier commit (main 5fb709e for issue 48), carried
# as an ignored folder; each step runs that tree and this one alternately, each in fresh processes.
#   [PREV=DIR] scripts/gpu_throughput.sh [STEP ...]
#     reference  the float64 reference: 5fb709e's formula against today's, bit for bit, ms and TFLOP/s
#                at decode B=64 s_q=2 H=128 (this tree only: tests/reference_5fb709e.py is its before)
#     compare    sparse_decode_fp8 fuzz, profile gpu, block 8, 400 cases in process and isolated (cases/s)
#     parallel   `fuzz --parallel 4` on the one GPU, isolated, 400 cases, timed whole (exit 0 = every part judged)
#     hisparse   `fuzz --op forward_mqa --path fp8_separate_hisparse`, 40 cases in process, timed whole
#     lane       `pytest -m gpu` of what issue 48 changed: the padded capture (and property:cuda_graph's gpu
#                draws, which pose it), the CUDA hand-over, property:singleton's underflow floor
#     gate       `gate --device cuda --examples ${GATE_EXAMPLES:-5} --parallel ${GATE_PARALLEL:-4}` (not in the default)
#     bench      `mla-verify bench --only harness` (this tree; ~400 s alone, not in the default)
#     profile    scripts/profile_fuzz.py (this tree; not in the default)
# Logs in $OUT; a short table last.
set -uo pipefail
. "$(dirname "$0")/device_env.sh" runs/gpu-throughput
[ $# -gt 0 ] || set -- reference compare parallel hisparse lane
trees=(.); [ -n "${PREV:-}" ] && trees=("$PREV" .)
table=()
row() { table+=("$(printf '%-9s %-10s %s' "$1" "$2" "$3")"); }
name() { [ "$1" = . ] && echo after || echo before; }
# Runs "$@" in tree $1 with its own package on the path.
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH=/tmp/site:$PWD "$@"); }

STEP=reference; if want "$@"; then
  timeout -k 5 90 python3 scripts/reference_gpu.py > "$OUT/reference.log" 2>&1
  row reference after "exit $?; $(grep -E '^decode|^  (5fb709e|today)|^prefill' "$OUT/reference.log" | tr -s ' ' | paste -sd';' | cut -c1-300)"
fi

STEP=compare; if want "$@"; then
  for tree in "${trees[@]}" "${trees[@]}"; do
    in_tree "$tree" timeout -k 5 100 python3 -c "
from mla_verify.bench.bench import _throughput
from mla_verify.equivalence.catalog import resolve_subject
try:
    from mla_verify.equivalence.cases.profiles import get_profile
except ImportError:  # before issue 49's wings
    from mla_verify.equivalence.profiles import get_profile
subject, profile = resolve_subject('sparse_decode_fp8', [], 'cuda'), get_profile('gpu')
_throughput(subject, 'cuda', profile, 16, 8)
for isolated in (False, True):
    r = _throughput(subject, 'cuda', profile, 400, 8, isolated)
    print(f'{r[\"impl\"]}: {r[\"cases_per_s\"]:.1f} cases/s; {r[\"ops_note\"]}')" > "$OUT/compare-$(name "$tree").log" 2>&1
    row compare "$(name "$tree")" "$(grep -E 'cases/s' "$OUT/compare-$(name "$tree").log" | cut -d';' -f1 | paste -sd'|')"
  done
fi

STEP=parallel; if want "$@"; then
  for tree in "${trees[@]}"; do
    start=$SECONDS
    in_tree "$tree" timeout -k 5 150 python3 -m mla_verify.cli fuzz --op sparse_decode_fp8 --device cuda --profile gpu \
      --examples 400 --parallel 4 --seed 1 --out "/tmp/parallel-$(name "$tree")" > "$OUT/parallel-$(name "$tree").log" 2>&1
    code=$?
    tail -n 3 /tmp/parallel-$(name "$tree")/part-*/fuzz.log >> "$OUT/parallel-$(name "$tree").log" 2>&1
    row parallel "$(name "$tree")" "exit $code in $((SECONDS - start)) s: $(grep -E '^(PASS|FAIL|DISCREPANCY)|left no result|not judged' "$OUT/parallel-$(name "$tree").log" | head -n 2 | cut -c1-120 | paste -sd'|')"
  done
fi

STEP=hisparse; if want "$@"; then
  for tree in "${trees[@]}"; do
    start=$SECONDS
    in_tree "$tree" timeout -k 5 90 python3 -m mla_verify.cli fuzz --op forward_mqa --path fp8_separate_hisparse --device cuda \
      --profile gpu --examples 40 --seed 1 --no-isolate --out "/tmp/hisparse-$(name "$tree")" > "$OUT/hisparse-$(name "$tree").log" 2>&1
    row hisparse "$(name "$tree")" "exit $? in $((SECONDS - start)) s (40 cases, start-up included)"
  done
fi

STEP=lane; if want "$@"; then
  timeout -k 5 150 python3 -m pytest -m gpu -q -rs tests/test_cuda_graph.py tests/test_segment.py tests/test_properties.py \
    -k "padded or handed or (holds_on_gpu and (singleton or cuda_graph))" > "$OUT/lane.log" 2>&1
  row lane after "exit $?: $(tail -n 1 "$OUT/lane.log" | cut -c1-150)"
fi

STEP=gate; if want "$@"; then
  for tree in "${trees[@]}"; do
    start=$SECONDS
    in_tree "$tree" timeout -k 5 "${GATE_LIMIT:-240}" python3 -m mla_verify.cli gate --device cuda --seed 1 \
      --examples "${GATE_EXAMPLES:-5}" --parallel "${GATE_PARALLEL:-4}" --out "/tmp/gate-$(name "$tree")" > "$OUT/gate-$(name "$tree").log" 2>&1
    code=$?
    cat /tmp/gate-$(name "$tree")/part-*/*.log >> "$OUT/gate-$(name "$tree").log" 2>/dev/null
    row gate "$(name "$tree")" "exit $code in $((SECONDS - start)) s: $(grep -E '^gate |not judged' "$OUT/gate-$(name "$tree").log" | head -n 2 | cut -c1-120 | paste -sd'|')"
  done
fi

STEP=bench; if want "$@"; then
  timeout -k 5 400 python3 -m mla_verify.cli bench --device cuda --only harness --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  row bench after "exit $?"
  grep -E "^(harness|fuzz) " "$OUT/bench.log" | cut -c1-230
fi

STEP=profile; if want "$@"; then
  timeout -k 5 200 python3 scripts/profile_fuzz.py --device cuda --examples 400 --out /tmp/profile > "$OUT/profile.log" 2>&1
  row profile after "exit $?"
  grep -E "^(host|timers|  )" "$OUT/profile.log"
fi

printf '%s\n' "step      tree       result" "${table[@]}"
