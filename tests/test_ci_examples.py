"""examples/ci/: the GitHub Actions workflows are valid workflows (checked against the subset of
GitHub's workflow syntax they use: actionlint cannot be installed here) and their own commands, run
as their jobs run them, shard and merge the gate into the unsharded gate case for case; the kernel
repository's workflow gates a kernel of the examples with --impl, keeps its finding in the corpus
its jobs pass on and replays it first in the next run; the Slurm script runs its array task's shard
and submits the array and the merge."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.test_shards import verdicts

yaml = pytest.importorskip("yaml", reason="pyyaml is a test extra (pip install -e '.[test]'); the GPU lane has none")

CI = Path(__file__).resolve().parent.parent / "examples" / "ci"
WORKFLOW = CI / "github-actions.yml"
KERNEL_WORKFLOW = CI / "kernel-repo.yml"
EXAMPLES = CI.parent
# A few cheap ops keep the three shards, the merge and the unsharded gate within seconds on CPU.
GATE_ARGS = "--op concat_mla_q --op split_prefill_chunks --op convert_index --examples 2"

# The workflow syntax the example may use (docs.github.com, "Workflow syntax for GitHub Actions").
TOP = {"name", "run-name", "on", "env", "jobs", "permissions", "concurrency", "defaults"}
EVENTS = {"push", "pull_request", "schedule", "workflow_dispatch", "workflow_call", "release"}
JOB = {"name", "runs-on", "needs", "if", "strategy", "steps", "env", "timeout-minutes", "permissions",
       "outputs", "container", "services", "defaults", "continue-on-error", "concurrency", "environment"}
STRATEGY = {"matrix", "fail-fast", "max-parallel"}
STEP = {"name", "id", "uses", "run", "with", "env", "if", "shell", "working-directory", "continue-on-error",
        "timeout-minutes"}
CONTEXTS = {"github", "env", "matrix", "needs", "steps", "runner", "secrets", "inputs", "vars", "strategy", "job"}
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def workflow(path: Path = WORKFLOW) -> dict:
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def step(job: dict, step_id: str) -> dict:
    return next(s for s in job["steps"] if s.get("id") == step_id)


def problems(data: dict) -> list[str]:
    """What GitHub (or actionlint) would reject in the workflow, one line each."""
    found = [f"top-level key {k!r}" for k in data if k not in TOP]
    found += [f"event {e!r}" for e in data["on"] if e not in EVENTS]
    found += [f"cron {c['cron']!r}" for c in data["on"].get("schedule") or [] if len(c["cron"].split()) != 5]
    for name, job in data["jobs"].items():
        found += [f"{name}: key {k!r}" for k in job if k not in JOB]
        needs = job.get("needs") or []
        found += [f"{name}: needs unknown job {n!r}" for n in ([needs] if isinstance(needs, str) else needs)
                  if n not in data["jobs"]]
        if "runs-on" not in job or not job.get("steps"):
            found.append(f"{name}: no runs-on or no steps")
        strategy = job.get("strategy") or {}
        found += [f"{name}: strategy key {k!r}" for k in strategy if k not in STRATEGY]
        matrix = strategy.get("matrix") or {}
        ids = [s["id"] for s in job["steps"] if "id" in s]
        if len(ids) != len(set(ids)):
            found.append(f"{name}: step ids repeat")
        for s in job["steps"]:
            found += [f"{name}: step key {k!r}" for k in s if k not in STEP]
            if ("uses" in s) == ("run" in s):
                found.append(f"{name}: a step needs exactly one of uses and run: {s}")
            if "uses" in s and not re.fullmatch(r"[\w.-]+/[\w./-]+@[\w.-]+", s["uses"]):
                found.append(f"{name}: {s['uses']!r} is not OWNER/REPO@REF")
            for text in map(str, [s.get("run", ""), *(s.get("with") or {}).values()]):
                for expr in EXPRESSION.findall(text):
                    context, _, key = expr.partition(".")
                    if context not in CONTEXTS:
                        found.append(f"{name}: unknown context in ${{{{ {expr} }}}}")
                    elif context == "matrix" and key not in matrix:
                        found.append(f"{name}: matrix has no {key!r}")
            if "run" in s:
                script = EXPRESSION.sub("X", s["run"])
                done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
                if done.returncode:
                    found.append(f"{name}: bash -n: {done.stderr.strip()}")
    return found


def test_the_workflow_is_valid_and_its_matrix_is_every_shard():
    data = workflow()
    assert problems(data) == []
    shards = int(data["env"]["SHARDS"])
    assert data["jobs"]["shard"]["strategy"]["matrix"]["shard"] == list(range(shards))
    assert data["jobs"]["merge"]["needs"] == "shard" and data["jobs"]["merge"]["if"] == "always()"
    # the checker finds what it looks for
    broken = workflow()
    broken["jobs"]["merge"]["needs"] = "shards"
    broken["jobs"]["shard"]["steps"][0] |= {"run": "echo ${{ matrix.index }}", "uses": "checkout"}
    broken["jobs"]["shard"]["steps"][1]["run"] = "if then"
    broken["on"]["schedule"][0]["cron"] = "0 3 * *"
    found = "\n".join(problems(broken))
    for says in ("needs unknown job 'shards'", "exactly one of uses and run", "'checkout' is not OWNER/REPO@REF",
                 "matrix has no 'index'", "bash -n", "cron '0 3 * *'"):
        assert says in found


def start_step(job: dict, step_id: str, cwd: Path, env: dict, **matrix) -> subprocess.Popen:
    """A step's script started as GitHub runs it (bash -e), its ${{ matrix.* }} replaced. A matrix's
    jobs run side by side, on GitHub as here (CI's second core)."""
    script = EXPRESSION.sub(lambda m: str(matrix[m.group(1).removeprefix("matrix.")]), step(job, step_id)["run"])
    return started(["bash", "-e", "-c", script], cwd=cwd, env=env)


def started(argv: list, **kwargs) -> subprocess.Popen:
    """argv started, its output into files (not pipes: a process waiting for its turn to be read
    never blocks on a full pipe)."""
    files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
    proc = subprocess.Popen(argv, stdout=files[0], stderr=files[1], text=True, **kwargs)
    proc.files = files
    return proc


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """The ended process's exit code and output."""
    proc.wait()
    outputs = []
    for f in proc.files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, *outputs)


def run_step(job: dict, step_id: str, cwd: Path, env: dict, **matrix) -> subprocess.CompletedProcess:
    """A step's script run to its end (`start_step`)."""
    return finished(start_step(job, step_id, cwd, env, **matrix))


def test_the_workflows_commands_shard_and_merge_into_the_unsharded_gate(tmp_path):
    from mla_verify import reports

    data = workflow()
    env = {**os.environ, **{k: str(v) for k, v in data["env"].items()}, "SEED": "4", "GATE_ARGS": GATE_ARGS,
           "OMP_NUM_THREADS": "1", "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    whole = tmp_path / "whole"
    unsharded = started([Path(sys.executable).parent / "mla-verify", "gate", "--device", "cpu", "--seed", "4",
                         *GATE_ARGS.split(), "--out", str(whole)], env=env)
    shards = data["jobs"]["shard"]["strategy"]["matrix"]["shard"]
    for shard in shards:
        (tmp_path / f"job-{shard}").mkdir()
    jobs = {shard: start_step(data["jobs"]["shard"], "gate", tmp_path / f"job-{shard}", env, shard=shard)
            for shard in shards}
    for shard, job in jobs.items():
        done = finished(job)
        assert done.returncode == 0, done.stdout + done.stderr
        # upload-artifact shard-N, then download-artifact pattern shard-* path shards
        shutil.copytree(tmp_path / f"job-{shard}" / f"shard-{shard}", tmp_path / "merge" / "shards" / f"shard-{shard}")
    done = run_step(data["jobs"]["merge"], "merge", tmp_path / "merge", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "convert_index" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "merge" / "merged" / "report.html").exists()
    done = finished(unsharded)
    assert done.returncode == 0, done.stderr
    assert verdicts(reports.load_run(tmp_path / "merge" / "merged")[0]) == verdicts(reports.load_run(whole)[0])


def test_a_failing_or_missing_shard_fails_the_merge_job_and_still_writes_the_summary(tmp_path):
    data = workflow()
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    (tmp_path / "shards").mkdir()
    done = run_step(data["jobs"]["merge"], "merge", tmp_path, env)  # no shard reached the merge job
    assert done.returncode == 2 and not (tmp_path / "summary.md").exists()


@pytest.mark.parametrize("task", [None, "2"])
def test_the_slurm_script_runs_its_tasks_shard_or_submits_the_array_and_the_merge(tmp_path, task):
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("sbatch", "mla-verify"):  # each records its arguments
        (fake / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/calls"\necho 41\n')
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "SHARDS": "4", "SEED": "9"}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = task
    subprocess.run(["bash", str(CI / "slurm-gate.sh")], cwd=tmp_path, env=env, check=True, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    if task is None:
        assert calls[0] == f"sbatch --parsable --array=0-3 {CI / 'slurm-gate.sh'}"
        assert calls[1].startswith("sbatch --dependency=afterany:41 ") and calls[1].endswith(
            "--wrap mla-verify merge runs/gate-9/shard-* --out runs/gate-9/merged")
    else:
        assert calls == ["mla-verify gate --seed 9 --shard 2/4 --out runs/gate-9/shard-2"]


def test_the_kernel_workflow_is_valid_with_a_shard_matrix_a_kept_corpus_and_a_gpu_job():
    data = workflow(KERNEL_WORKFLOW)
    assert problems(data) == []
    jobs = data["jobs"]
    assert jobs["shard"]["strategy"]["matrix"]["shard"] == list(range(int(data["env"]["SHARDS"])))
    assert jobs["merge"]["needs"] == "shard" and jobs["merge"]["if"] == "always()"
    uses = {name: [s.get("uses", "").split("@")[0] for s in job["steps"]] for name, job in jobs.items()}
    assert "actions/cache/restore" in uses["shard"] and "actions/cache/save" in uses["merge"]
    assert "actions/cache/restore" in uses["gpu"] and "actions/cache/save" in uses["gpu"]
    gpu = step(jobs["gpu"], "gate")["run"]
    assert "--device cuda" in gpu and '--corpus "$CORPUS"' in gpu and '"${impls[@]}"' in gpu
    assert "GITHUB_STEP_SUMMARY" in step(jobs["merge"], "merge")["run"]


def test_the_kernel_workflows_steps_gate_a_kernel_keep_its_finding_and_replay_it_first(tmp_path):
    data = workflow(KERNEL_WORKFLOW)
    env = {**os.environ, **{k: str(v) for k, v in data["env"].items()}, "SEED": "1", "OMP_NUM_THREADS": "1",
           "KERNELS": "sparse_prefill=my_kernel:sparse_prefill_v0",  # the walkthrough's draft: topk_length ignored
           "GATE_ARGS": "--profile ci --op sparse_prefill --op property:determinism --examples 2",
           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    corpus = tmp_path / "merge" / data["env"]["CORPUS"]
    codes, jobs = [], {}
    for shard in data["jobs"]["shard"]["strategy"]["matrix"]["shard"]:
        job_dir = tmp_path / f"job-{shard}"
        job_dir.mkdir()
        shutil.copy(EXAMPLES / "my_kernel.py", job_dir)
        jobs[shard] = start_step(data["jobs"]["shard"], "gate", job_dir, env, shard=shard)
    for shard, job in jobs.items():
        job_dir, done = tmp_path / f"job-{shard}", finished(job)
        codes.append(done.returncode)
        assert done.returncode in (0, 1), done.stdout + done.stderr
        # upload-artifact shard-N and corpus-N, then download-artifact into the merge job
        shutil.copytree(job_dir / f"shard-{shard}", tmp_path / "merge" / "shards" / f"shard-{shard}")
        if (job_dir / data["env"]["CORPUS"]).exists():
            shutil.copytree(job_dir / data["env"]["CORPUS"], corpus, dirs_exist_ok=True)
    assert sorted(codes) == [0, 1]  # the shard of sparse_prefill fails, the property's passes
    kept = sorted(corpus.iterdir())
    assert kept and all(p.name.startswith("sparse_prefill-") for p in kept)
    done = run_step(data["jobs"]["merge"], "merge", tmp_path / "merge", env)
    assert done.returncode == 1 and "sparse_prefill" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "merge" / "merged" / "report.html").exists()
    # the next run restores the corpus the merge job saved: another seed, the kept case first
    failing = codes.index(1)
    job_dir = tmp_path / "next"
    job_dir.mkdir()
    shutil.copy(EXAMPLES / "my_kernel.py", job_dir)
    shutil.copytree(corpus, job_dir / data["env"]["CORPUS"])
    done = run_step(data["jobs"]["shard"], "gate", job_dir, {**env, "SEED": "2"}, shard=failing)
    assert done.returncode == 1 and f"from the corpus: {len(kept)} still fail" in done.stdout, done.stdout[-3000:]
