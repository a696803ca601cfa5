"""`--shard auto`: the shard a scheduler's own variables name, so that the shard count is written
in one place (the CI matrix, the array, the job's completions) and never again on the command line.

Looked for in this order, the first whose index is set wins:

    MLA_VERIFY_SHARD_INDEX / MLA_VERIFY_SHARD_COUNT    any scheduler; GitHub Actions sets neither, so a
                                                       workflow passes ${{ strategy.job-index }} and
                                                       ${{ strategy.job-total }} as these
    SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT       a Slurm job array (its first index and step:
                                                       SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_STEP)
    JOB_COMPLETION_INDEX / MLA_VERIFY_SHARD_COUNT      a Kubernetes Indexed Job (the count is its
                                                       completions, which no variable carries)
    BUILDKITE_PARALLEL_JOB / BUILDKITE_PARALLEL_JOB_COUNT   a Buildkite step's parallelism
    CI_NODE_INDEX / CI_NODE_TOTAL                      GitLab's `parallel:` (1-based)
    CIRCLE_NODE_INDEX / CIRCLE_NODE_TOTAL              CircleCI's parallelism
"""

from __future__ import annotations

from collections.abc import Mapping

COUNT = "MLA_VERIFY_SHARD_COUNT"
# (index variable, count variable, the index of the first shard)
SCHEDULERS = (
    ("MLA_VERIFY_SHARD_INDEX", COUNT, 0),
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", 0),
    ("JOB_COMPLETION_INDEX", COUNT, 0),
    ("BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT", 0),
    ("CI_NODE_INDEX", "CI_NODE_TOTAL", 1),
    ("CIRCLE_NODE_INDEX", "CIRCLE_NODE_TOTAL", 0),
)


def _number(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not value.isdigit():
        raise ValueError(f"--shard auto: {name}={env[name]!r} is not a whole number")
    return int(value)


def from_environment(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(index, count, the variables they came from) of the first scheduler in SCHEDULERS whose index
    variable is set; ValueError naming what is missing or wrong."""
    for index_name, count_name, first in SCHEDULERS:
        if not env.get(index_name, "").strip():
            continue
        if not env.get(count_name, "").strip():
            raise ValueError(f"--shard auto: {index_name} is set but {count_name} is not (the number of shards)")
        index, count = _number(env, index_name) - first, _number(env, count_name)
        if index_name.startswith("SLURM_"):   # --array=MIN-MAX[:STEP]: the task's place among the tasks
            low = _number(env, "SLURM_ARRAY_TASK_MIN") if env.get("SLURM_ARRAY_TASK_MIN") else 0
            step = _number(env, "SLURM_ARRAY_TASK_STEP") if env.get("SLURM_ARRAY_TASK_STEP") else 1
            index = (index + first - low) // max(step, 1)
        if not 0 <= index < count:
            raise ValueError(f"--shard auto: {index_name}={env[index_name]} is not one of {count} shards "
                             f"({count_name}={env[count_name]})")
        return index, count, f"{index_name}={env[index_name]} of {count_name}={env[count_name]}"
    names = ", ".join(f"{i}/{c}" for i, c, _ in SCHEDULERS)
    raise ValueError(f"--shard auto: no scheduler's shard index is set (looked for {names}); "
                     "give --shard I/N, or set MLA_VERIFY_SHARD_INDEX and MLA_VERIFY_SHARD_COUNT")
