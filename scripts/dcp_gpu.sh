#!/usr/bin/env bash
# Multi-rank DCP on this machine's GPUs, one call: world sizes 2, 4 and 8, both combines drawn,
# every rank's worst error (merged heads and pre-combine partial) printed per world size.
#   1 GPU    every rank shares it; collectives over gloo through host memory (kernels compiled)
#   N GPUs   nccl, one process per GPU, for world sizes up to N; gloo sharing GPUs above N
# NVLink multicast stays off (the ranks set NCCL_NVLS_ENABLE=0 themselves; exported here too).
# Usage: scripts/dcp_gpu.sh [EXAMPLES [SEED]]   (defaults 20, 1); exits 1 if any world size failed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
examples=${1:-20}
seed=${2:-1}
status=0
python3 -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s)")'
for world in 2 4 8; do
    python3 -m mla_verify.cli fuzz --op dcp --world-size "$world" --device cuda --profile gpu \
        --examples "$examples" --seed "$seed" --out "runs/dcp-gpu-$world" --no-shrink || status=1
done
exit $status
