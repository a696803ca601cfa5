#!/usr/bin/env bash
# Multi-rank DCP on this machine's GPUs in one call: for each world size, fuzz cases drawn with
# either combine at production shapes (profile gpu), then every rank's worst error printed for its
# merged heads and its pre-combine partial.
#   1 GPU    every rank shares it; collectives over gloo through host memory (kernels compiled)
#   N GPUs   nccl, one process per GPU, for world sizes up to N; gloo, GPUs shared, above N
# NVLink multicast stays off (the ranks set NCCL_NVLS_ENABLE=0 and friends themselves; exported
# here for anything else this starts).
# Usage: scripts/dcp_gpu.sh [EXAMPLES [SEED [WORLD_SIZE ...]]]   defaults: 8, 1, "2 4 8".
# Exits 1 if any world size found a discrepancy (the failing case is saved under runs/ as found,
# unshrunk: shrinking would multiply the run time).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
examples=${1:-8}
seed=${2:-1}
shift $(( $# < 2 ? $# : 2 ))
worlds=${*:-2 4 8}
status=0
python3 -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s)")'
for world in $worlds; do
    python3 -m mla_verify.cli fuzz --op dcp --world-size "$world" --device cuda --profile gpu \
        --examples "$examples" --seed "$seed" --out "runs/dcp-gpu-$world" --no-shrink || status=1
done
exit $status
