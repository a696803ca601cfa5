"""How `--parallel` deals its parts: GPUs round-robin (several parts to a GPU share its memory),
and each part its share of the host's cores as torch threads."""

from types import SimpleNamespace

from mla_verify.runs import parts as parallel
from mla_verify.equivalence.sandbox.device import GPU_SHARE_ENV


def _env(monkeypatch, parts, gpus, user_threads=None, device="cuda"):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 16)
    if user_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user_threads)
    monkeypatch.delenv(GPU_SHARE_ENV, raising=False)
    run = SimpleNamespace(device_type=device)
    return [parallel.child_env(run, i, parts, pin=True) for i in range(parts)]


def test_more_parts_than_gpus_share_them_round_robin(monkeypatch):
    envs = _env(monkeypatch, 4, ["3", "5"])  # the user's CUDA_VISIBLE_DEVICES=3,5
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5", "3", "5"]
    assert {e[GPU_SHARE_ENV] for e in envs} == {"0.500000"}
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"4"}


def test_a_part_alone_on_its_gpu_takes_all_of_it(monkeypatch):
    envs = _env(monkeypatch, 3, ["0", "1", "2", "3"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2"]
    assert all(GPU_SHARE_ENV not in e for e in envs)


def test_uneven_parts_share_by_how_many_a_gpu_holds(monkeypatch):
    envs = _env(monkeypatch, 3, ["0", "1"])
    assert [e.get(GPU_SHARE_ENV) for e in envs] == ["0.500000", None, "0.500000"]


def test_a_users_thread_count_stands_and_cpu_parts_see_no_gpu_pin(monkeypatch):
    envs = _env(monkeypatch, 8, [], user_threads="3", device="cpu")
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"3"}
    assert all(e.get("CUDA_VISIBLE_DEVICES") == parallel.os.environ.get("CUDA_VISIBLE_DEVICES") for e in envs)
