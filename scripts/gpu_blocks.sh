#!/usr/bin/env bash
# Issue 28 on the GPU in one call: the tests the fuzz blocks and the reference's one-pass
# magnitudes touch (pytest -m gpu), the CLI campaign of sparse_decode_fp8 at the gpu profile as
# users run it (isolated, blocks of 8) and the same with --no-isolate, then the gate. Logs in $OUT.
#   scripts/gpu_blocks.sh [pytest] [fuzz] [gate]     (default: all three; a device call has 600 s)
set -uo pipefail
. "$(dirname "$0")/device_env.sh" runs/gpu-blocks
summary=()
step() {
  local name=$1 limit=$2 start=$SECONDS; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  summary+=("$(printf '%-10s exit %-3s %4ss  %s' "$name" "$?" "$((SECONDS - start))" "$(grep -E 'cases/s|passed|failed|PASS|FAIL' "$OUT/$name.log" | tail -n 1 | cut -c1-100)")")
}
STEP=pytest; if want "$@"; then
step pytest 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_triton_attention.py tests/test_hostile_gpu.py tests/test_reference_attention.py
fi
STEP=fuzz; if want "$@"; then
step fuzz 150 python3 -m mla_verify.cli fuzz --op sparse_decode_fp8 --device cuda --profile gpu --examples 400 --seed 1 --out "$OUT/fuzz"
step in_proc 100 python3 -m mla_verify.cli fuzz --op sparse_decode_fp8 --device cuda --profile gpu --examples 400 --seed 1 --no-isolate --out "$OUT/fuzz-in-process"
# cases/s from each campaign's own clock (its meta.json), past the process's start-up
rate() { python3 -c "import json, sys, datetime as d; m = json.load(open(sys.argv[1] + '/meta.json')); t = lambda k: d.datetime.fromisoformat(m[k]); import pandas as pd; n = pd.read_parquet(sys.argv[1] + '/rows.parquet').case_id.nunique(); s = (t('finished_at') - t('started_at')).total_seconds(); print(f'{sys.argv[1]}: {n} cases in {s:.1f} s: {n / s:.1f} cases/s')" "$1" >> "$2" 2>&1; }
rate "$OUT/fuzz" "$OUT/fuzz.log"; rate "$OUT/fuzz-in-process" "$OUT/in_proc.log"
fi
STEP=gate; if want "$@"; then
step gate 200 python3 -m mla_verify.cli gate --device cuda --examples 3 --seed 1 --out "$OUT/gate"
fi
find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
printf '%s\n' "${summary[@]}"
grep -hs " cases/s" "$OUT/fuzz.log" "$OUT/in_proc.log"
