"""examples/ci/: the GitHub Actions workflows are valid workflows (checked against the subset of
GitHub's workflow syntax they use: actionlint cannot be installed here) and their own steps, run
as their jobs run them (`Actions`: every step in order, the actions they use done to files), shard
and merge the gate into the unsharded gate case for case; the kernel repository's workflow, as
written, gates a plain folder of kernel modules (no package, nothing installed but mla-verify),
keeps its finding and each op's seconds, and the next run replays the finding first with its shards
sized by those seconds; the Slurm script runs its array task's shard and submits the array and the
merge."""

import os
import re
import shutil
import subprocess
import sys
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


def test_the_workflow_is_valid_and_its_matrix_is_the_one_place_that_counts_shards():
    data = workflow()
    assert problems(data) == []
    gate = step(data["jobs"]["shard"], "gate")
    assert "--shard auto" in gate["run"] and "SHARDS" not in WORKFLOW.read_text()
    assert gate["env"] == {"MLA_VERIFY_SHARD_INDEX": "${{ strategy.job-index }}",
                           "MLA_VERIFY_SHARD_COUNT": "${{ strategy.job-total }}"}
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


def expand(text: str, contexts: dict) -> str:
    """`${{ context.key }}` replaced by its value (the expressions these workflows use)."""
    def value(m: re.Match) -> str:
        context, _, key = m.group(1).partition(".")
        return str(contexts[context][key])

    return EXPRESSION.sub(value, text)


class Actions:
    """A workflow's jobs run here as GitHub runs them: every step in order (after a failing one, only
    those `if: always()`), `run` steps through `bash -e` with their expressions and env, and the
    actions they use done to files: checkout copies `repo`, the cache and the artifacts are folders
    under `store`, setup-python is this interpreter, and `pip` (the Install step) records what it
    was asked to install instead of installing it."""

    def __init__(self, data: dict, repo: Path, store: Path, env: dict, run_number: int, **edits: str):
        """`edits`: the workflow's env values a user changed (GATE_ARGS: fewer cases on this machine)."""
        self.data, self.repo, self.store = data, repo, store
        self.env = {**env, **{k: str(v) for k, v in data["env"].items()}, **edits}
        self.github = {"run_number": run_number, "run_id": 1000 + run_number, "event_name": "push"}
        self.env = {k: expand(v, {"github": self.github}) for k, v in self.env.items()}
        fake = store / "bin"
        fake.mkdir(parents=True, exist_ok=True)
        (fake / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> "{store}/pip-calls"\n')
        (fake / "pip").chmod(0o755)
        self.env["PATH"] = f"{fake}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        self.output: dict[str, subprocess.CompletedProcess] = {}

    def job(self, name: str, workdir: Path, index: int = 0, **env: str) -> list[str]:
        """Run job `name` (matrix entry `index`) in `workdir`; the ids of the steps that failed."""
        job = self.data["jobs"][name]
        matrix = job.get("strategy", {}).get("matrix", {})
        key = next(iter(matrix), None)
        contexts = {"github": self.github, "env": {**self.env, **env},
                    "matrix": {key: matrix[key][index]} if key else {},
                    "strategy": {"job-index": index, "job-total": len(matrix[key]) if key else 1}}
        workdir.mkdir(parents=True)
        failed = []
        for s in job["steps"]:
            if failed and s.get("if") != "always()":
                continue
            if "run" in s:
                step_env = {k: expand(str(v), contexts) for k, v in (s.get("env") or {}).items()}
                done = subprocess.run(["bash", "-e", "-c", expand(s["run"], contexts)], cwd=workdir,
                                      env={**contexts["env"], **step_env}, capture_output=True, text=True)
                self.output[f"{name}-{index}-{s.get('id')}"] = done
                if done.returncode:
                    failed.append(s.get("id"))
            else:
                self._action(s["uses"].split("@")[0], {k: expand(str(v), contexts) for k, v in (s.get("with") or {}).items()},
                             workdir)
        return failed

    def _action(self, action: str, given: dict, workdir: Path) -> None:
        cache, artifacts = self.store / "cache", self.store / f"artifacts-{self.github['run_id']}"  # a run's own
        if action == "actions/checkout":
            shutil.copytree(self.repo, workdir, dirs_exist_ok=True, symlinks=True)
        elif action == "actions/cache/restore":
            hits = sorted(cache.glob(given["key"])) or sorted(cache.glob(given["restore-keys"] + "*"),
                                                              key=lambda p: p.stat().st_mtime)
            if hits:
                shutil.copytree(hits[-1], workdir / given["path"], dirs_exist_ok=True)
        elif action == "actions/cache/save" and (workdir / given["path"]).exists():
            if not (cache / given["key"]).exists():                  # a cache entry is never overwritten
                shutil.copytree(workdir / given["path"], cache / given["key"])
        elif action == "actions/upload-artifact" and (workdir / given["path"]).exists():
            source = workdir / given["path"]
            if source.is_dir():
                shutil.copytree(source, artifacts / given["name"])
            else:
                (artifacts / given["name"]).mkdir(parents=True)
                shutil.copy2(source, artifacts / given["name"])
        elif action == "actions/download-artifact":
            for artifact in sorted(artifacts.glob(given["pattern"])):
                target = workdir / given["path"] / ("" if given.get("merge-multiple") == "True" else artifact.name)
                shutil.copytree(artifact, target, dirs_exist_ok=True)


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"), **extra}
    env.pop("PYTHONPATH", None)   # mla-verify as installed; the kernels from the working directory
    for name in ("MLA_VERIFY_SHARD_INDEX", "MLA_VERIFY_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX",
                 "BUILDKITE_PARALLEL_JOB", "CI_NODE_INDEX", "CIRCLE_NODE_INDEX"):
        env.pop(name, None)
    return env


def test_the_workflows_jobs_shard_and_merge_into_the_unsharded_gate(tmp_path):
    from mla_verify import reports

    data = workflow()
    (tmp_path / "repo").mkdir()
    actions = Actions(data, tmp_path / "repo", tmp_path / "store", _env(tmp_path), 4, GATE_ARGS=GATE_ARGS)
    shards = data["jobs"]["shard"]["strategy"]["matrix"]["shard"]
    for i in range(len(shards)):
        assert actions.job("shard", tmp_path / f"job-{i}", i) == [], actions.output[f"shard-{i}-gate"].stderr[-3000:]
        assert f"shard {i}/{len(shards)} (MLA_VERIFY_SHARD_INDEX={i} of MLA_VERIFY_SHARD_COUNT={len(shards)})" in \
            actions.output[f"shard-{i}-gate"].stdout
    assert actions.job("merge", tmp_path / "merge") == []
    assert "convert_index" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "store" / "artifacts-1004" / "mla-verify-report" / "report.html").exists()
    whole = tmp_path / "whole"
    subprocess.run([Path(sys.executable).parent / "mla-verify", "gate", "--device", "cpu", "--seed", "4",
                    *GATE_ARGS.split(), "--out", str(whole)], env=_env(tmp_path), check=True, capture_output=True)
    assert verdicts(reports.load_run(tmp_path / "merge" / "merged")[0]) == verdicts(reports.load_run(whole)[0])


def test_a_failing_or_missing_shard_fails_the_merge_job_and_still_writes_the_summary(tmp_path):
    (tmp_path / "repo").mkdir()
    actions = Actions(workflow(), tmp_path / "repo", tmp_path / "store", _env(tmp_path), 1)
    assert actions.job("merge", tmp_path / "merge") == ["merge"]  # no shard reached the merge job
    assert actions.output["merge-0-merge"].returncode == 2 and not (tmp_path / "summary.md").exists()


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
            "--wrap mla-verify merge runs/gate-9/shard-* --out runs/gate-9/merged; mkdir -p runs/kept; "
            "cp runs/gate-9/merged/durations.json runs/kept/")
    else:   # the index and count from the array's own variables (tests/test_shards.py: --shard auto)
        assert calls == ["mla-verify gate --seed 9 --shard auto --durations runs/kept/durations.json "
                         "--out runs/gate-9/shard-2"]


def test_the_kernel_workflow_is_valid_installs_only_mla_verify_and_counts_shards_in_one_place():
    data = workflow(KERNEL_WORKFLOW)
    assert problems(data) == []
    text = KERNEL_WORKFLOW.read_text()
    assert "your-org" not in text and "-e ." not in text and "SHARDS" not in text
    jobs = data["jobs"]
    assert jobs["merge"]["needs"] == "shard" and jobs["merge"]["if"] == "always()"
    for job in jobs.values():
        assert step(job, "install")["run"].splitlines()[-1] == 'pip install "$MLA_VERIFY"'
        assert job["steps"][0]["with"] == {"submodules": True}      # mla-verify pinned as a submodule
    uses = {name: [s.get("uses", "").split("@")[0] for s in job["steps"]] for name, job in jobs.items()}
    assert "actions/cache/restore" in uses["shard"] and "actions/cache/save" in uses["merge"]
    assert "actions/cache/restore" in uses["gpu"] and "actions/cache/save" in uses["gpu"]
    gpu = step(jobs["gpu"], "gate")["run"]
    assert "--device cuda" in gpu and '--corpus "$KEPT/corpus"' in gpu and '"${impls[@]}"' in gpu
    assert "GITHUB_STEP_SUMMARY" in step(jobs["merge"], "merge")["run"]


def _kernel_repository(root: Path) -> Path:
    """A kernel repository as a team keeps one: a plain folder of modules (no package, no
    pyproject), the KERNELS the workflow names as written (`mykernels.attention`: the walkthrough's
    draft prefill, topk_length ignored, and a float32 decode), mla-verify as its submodule."""
    kernels = root / "mykernels"
    kernels.mkdir(parents=True)
    shutil.copy(EXAMPLES / "my_kernel.py", kernels / "prefill.py")
    shutil.copy(Path(__file__).parent / "impls" / "decode_versions.py", kernels / "decode.py")
    (kernels / "attention.py").write_text("from mykernels.decode import v1 as sparse_decode\n"
                                          "from mykernels.prefill import sparse_prefill_v0 as sparse_prefill\n")
    (root / "mla-verify").symlink_to(CI.parent.parent)
    return root


def test_the_kernel_workflow_as_written_gates_a_folder_of_modules_and_sizes_the_next_runs_shards(tmp_path):
    """Issue 50 item 4: every step of the shard and merge jobs as written, twice."""
    from mla_verify.runs import durations
    from mla_verify.runs.parts import Shard

    data = workflow(KERNEL_WORKFLOW)
    # three units whose campaigns take seconds: prefill's finding and two properties over both kernels
    # (the decode op's covering set, production sizes included, took most of a shard's time)
    env, edits = _env(tmp_path), {"GATE_ARGS": "--profile ci --examples 2 --op sparse_prefill --op property:dcp_size_one "
                                               "--op property:determinism"}
    repo = _kernel_repository(tmp_path / "repo")
    first = Actions(data, repo, tmp_path / "store", env, 1, **edits)
    count = len(data["jobs"]["shard"]["strategy"]["matrix"]["shard"])
    failed = [first.job("shard", tmp_path / "run1" / f"shard-{i}", i) for i in range(count)]
    gates = [first.output[f"shard-{i}-gate"] for i in range(count)]
    assert sorted(map(bool, failed)) == [False, True], [g.stderr[-2000:] for g in gates]  # prefill's shard fails
    assert all("dealt by count (no unit's seconds kept yet)" in g.stdout for g in gates)
    assert (tmp_path / "store" / "pip-calls").read_text().splitlines()[1] == "pip install ./mla-verify[test]"
    assert (repo / "mla-verify" / "pyproject.toml").exists()          # what the Install step names is there
    assert first.job("merge", tmp_path / "run1" / "merge") == ["merge"]   # the finding fails the merge job
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("## mla-verify report: merged") and "sparse_prefill" in summary
    kept = next((tmp_path / "store" / "cache").iterdir())
    findings = [p.name.split("-")[0] for p in (kept / "corpus").iterdir()]
    assert findings and set(findings) == {"sparse_prefill"}
    seconds = durations.read(kept / "durations.json")
    assert len(seconds) == 3 and all(s > 0 for s in seconds.values())
    # the next run restores the kept corpus and seconds: another seed, the finding first, shards by time
    keys = sorted(seconds)
    by_time = [Shard(i, count).deal(keys, weights=[seconds[k] for k in keys]) for i in range(count)]
    failing = next(i for i, mine in enumerate(by_time) if any(k.startswith("sparse_prefill ") for k in mine))
    second = Actions(data, repo, tmp_path / "store", env, 2, **edits)
    assert second.job("shard", tmp_path / "run2" / f"shard-{failing}", failing) == ["gate"]
    gate = second.output[f"shard-{failing}-gate"].stdout
    assert f"shard {failing}/{count} (MLA_VERIFY_SHARD_INDEX={failing} of MLA_VERIFY_SHARD_COUNT={count}), sized by " \
           "3 units' seconds last time" in gate and f"from the corpus: {len(findings)} still fail" in gate, gate[-3000:]
    ran = reports_of(tmp_path / "run2" / f"shard-{failing}" / f"shard-{failing}")
    assert ran == {k.split(" ")[0] for k in by_time[failing]}
    assert "<title>mla-verify report: shard-" in (tmp_path / "run2" / f"shard-{failing}" / f"shard-{failing}" /
                                                 "report.html").read_text()


def reports_of(run: Path) -> set[str]:
    """The ops (and properties) a run's rows hold."""
    from mla_verify import reports

    rows, _ = reports.load_run(run)
    return {op if op != "property" else f"property:{path}" for op, path in zip(rows["op"], rows["path"])}
