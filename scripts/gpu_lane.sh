#!/usr/bin/env bash
# The GPU lane in one call on a machine without registry access (the carried wheel in .whl/,
# see scripts/fetch_gpu_wheel.sh): install flash_mla, then run the named steps, each under its own
# time limit, logging to $OUT/<step>.log; everything is packed into $OUT/results.tgz and a short
# table of step exit codes is printed last.
#   scripts/gpu_lane.sh [STEP ...]     steps: env pytest gate bench throughput properties dcp adapters hostile hisparse
#                                      hostile_default bias (default: env pytest gate bench, more than one call holds)
# throughput: the reference under its memory budget (T = 4k/16k/64k), harness overhead by stage and
# fuzz cases/s (`mla-verify bench --only reference --only harness`), without the kernel sweep.
# hostile: fuzz a kernel with a device-side assert on >= 3 tokens with --timeout 10 (exit 1, a case
# minimized to tokens = 3 that replays to the same crash, no correct case reported hung), then the
# other CUDA hostile kernels; hostile_default: the same campaign with the default timeout.
# bias: flash_mla, Triton and torch-fp32 on sparse_prefill and sparse_decode_fp8, the measured bias
# per path against the exact reference (scripts/bias_gpu.py; the table is the log's end).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-lane}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OUT GATE_EXAMPLES=${GATE_EXAMPLES:-20}
# Seconds each step may take (override one with e.g. LIMIT_gate=120); the call has 600 in all. On the
# H200 at 0735e4d `pytest -m gpu` needed ~490 s and the gate (20 examples) ~250 s: one call each.
declare -A LIMIT=([env]=60 [pytest]=560 [gate]=360 [bench]=150 [throughput]=240 [properties]=180 [dcp]=150
                  [adapters]=180 [hostile]=540 [hostile_default]=400 [hisparse]=560 [bias]=300)
summary=()

declare -A CMD=(
  [env]='nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv && python3 -c "import torch, triton, flash_mla; print(torch.__version__, triton.__version__, flash_mla.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"'
  [pytest]='python3 -m pytest -m gpu -q -rs tests'
  [gate]='python3 -m mla_verify.cli gate --device cuda --examples $GATE_EXAMPLES --seed ${SEED:-1} --out $OUT/gate --junit $OUT/gate/junit.xml'
  [bench]='python3 -m mla_verify.cli bench --device cuda ${BENCH_ARGS:---quick} --out $OUT/bench.json'
  [throughput]='python3 -m mla_verify.cli bench --device cuda --only reference --only harness --out $OUT/throughput.json'
  [properties]='python3 scripts/gpu_properties.py --out $OUT/properties'
  [dcp]='python3 -m mla_verify.cli fuzz --op dcp --device cuda --examples 10 --out $OUT/dcp'
  [adapters]='python3 -m pytest -m gpu -q -rs -s tests/test_adapters.py'
  [hostile]='python3 scripts/hostile_gpu.py --out $OUT/hostile --timeouts 10 --others --seed ${SEED:-1}'
  [hostile_default]='python3 scripts/hostile_gpu.py --out $OUT/hostile-default --timeouts default --seed ${SEED:-1}'
  [hisparse]='OUT=$OUT/hisparse LIMIT=100 scripts/gpu_hisparse.sh ${HISPARSE_EXAMPLES:-100} ${SEED:-1}'
  [bias]='python3 scripts/bias_gpu.py --out $OUT/bias --examples ${BIAS_EXAMPLES:-120} --seed ${SEED:-1}'
)

run_step() {
  local name=$1 start=$SECONDS code
  if [ -z "${CMD[$name]:-}" ]; then summary+=("$name: unknown step"); return; fi
  local limit_var="LIMIT_$name"
  OUT=$OUT GATE_EXAMPLES=$GATE_EXAMPLES timeout -k 10 "${!limit_var:-${LIMIT[$name]}}" bash -c "${CMD[$name]}" > "$OUT/$name.log" 2>&1
  code=$?
  summary+=("$(printf '%-11s exit %-4s %5ss  %s' "$name" "$code" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
}

for step in "${@:-env pytest gate bench}"; do
  for s in $step; do run_step "$s"; done
done
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
# What comes back from a device call is a few files: keep the logs and the archive.
find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
printf '%s\n' "${summary[@]}"
