#!/usr/bin/env bash
# The mla-verify gate as a Slurm job array: one shard per array task, one GPU each, then one
# merge job once every task has ended (failing or not). Submit it once:
#
#     sbatch examples/ci/slurm-gate.sh            # SEED=7 SHARDS=16 sbatch ... to choose
#
# Run without SLURM_ARRAY_TASK_ID it submits the array of SHARDS tasks (SHARDS is named here
# only) and the merge, which depends on it; inside the array `--shard auto` reads the task's
# index and count (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT).
#SBATCH --job-name=mla-verify-gate
#SBATCH --gpus=1
#SBATCH --time=02:00:00
#SBATCH --output=runs/slurm-%A_%a.log
set -euo pipefail

SHARDS=${SHARDS:-8}
SEED=${SEED:-$(date +%Y%m%d)}     # one seed for every shard of the run
RUN=${RUN:-runs/gate-$SEED}
KEPT=${KEPT:-runs/kept}           # each op's seconds, kept from run to run: the shards are sized by them
export SHARDS SEED RUN KEPT

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then
  mkdir -p runs
  array=$(sbatch --parsable --array="0-$((SHARDS - 1))" "$0")
  array=${array%%;*}               # --parsable prints JOBID[;CLUSTER]
  sbatch --dependency="afterany:$array" --job-name=mla-verify-merge --output=runs/slurm-%j.log \
    --wrap "mla-verify merge $RUN/shard-* --out $RUN/merged; mkdir -p $KEPT; cp $RUN/merged/durations.json $KEPT/"
  echo "submitted shards $array and their merge: $RUN/merged/report.html"
  exit 0
fi

mla-verify gate --seed "$SEED" --shard auto --durations "$KEPT/durations.json" --out "$RUN/shard-$SLURM_ARRAY_TASK_ID"
