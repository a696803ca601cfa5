#!/usr/bin/env bash
# Issue 45 on the GPU in one call (about 200 s on an H100): what a CUDA isolation worker stands
# behind on this host (the sandbox's layers, each held or why not), the boundary's own tests
# there, the hostile kernels that reach outside their worker and the boundary's in a CUDA worker
# plus a kernel that kills its parent (the judge itself on CUDA), then what the sandbox costs
# (`mla-verify bench --device cuda --only guards`: per case, a worker's start, the case after a
# crash, auto against off). Logs in $OUT; a short table last.
#   scripts/gpu_sandbox.sh [layers] [hostile] [bench]      (default: all three)
set -uo pipefail
. "$(dirname "$0")/device_env.sh" runs/gpu-sandbox
summary=()
step() {
  local name=$1 limit=$2 start=$SECONDS; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  summary+=("$(printf '%-8s exit %-3s %4ss  %s' "$name" "$?" "$((SECONDS - start))" \
    "$(grep -E 'sandbox (auto|strict|off)|passed|failed|error' "$OUT/$name.log" | tail -n 1 | cut -c1-110)")")
}
STEP=layers; if want "$@"; then
step layers 60 python3 -c "
from mla_verify.equivalence.blocks import Judging
with Judging('cuda', isolate=True, timeout=30.0) as j:
    j.start()
    print('cuda worker:', j.summary())"
step boundary 60 python3 -m pytest -q -rs -p no:cacheprovider tests/test_sandbox.py
fi
STEP=hostile; if want "$@"; then
step hostile 150 python3 -m pytest -m gpu -q -rs -s -p no:cacheprovider tests/test_hostile_gpu.py \
  -k "sandbox or kills_its_parent"
fi
STEP=bench; if want "$@"; then
step bench 150 python3 -m mla_verify.cli bench --device cuda --only guards --quick --out "$OUT/guards.json"
python3 - "$OUT/guards.json" >> "$OUT/bench.log" 2>&1 <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
for r in rows:
    if str(r.get("impl", "")).startswith(("sandbox", "isolation")):
        print(f"{r['impl']:16s} {r['shape'][:40]:40s} {r['ms']:9.2f} ms  {r.get('ops_note', '')}")
EOF
fi
printf '%s\n' "${summary[@]}"
grep -hs -E "^(sandbox|isolation)" "$OUT/bench.log"
