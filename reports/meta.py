"""Run metadata: what ran, where, with which versions; enough to tell two runs apart in a drift
report. Collecting it never fails: a package that does not import is recorded as None, a missing
git as None, so a gate never dies over its own paperwork.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mla_verify.equivalence.sandbox.device import is_cuda
from mla_verify.reports.fmt import MISSING, number
from mla_verify.reports.store import RUN_FORMAT

# module name -> distribution names that may provide it (flash_mla ships as sgl-flash-mla)
_VERSIONED_MODULES = {
    "torch": ("torch",),
    "triton": ("triton",),
    "flash_mla": ("sgl-flash-mla", "flash-mla", "flash_mla"),
    "pandas": ("pandas",),
    "numpy": ("numpy",),
}
_REPO_ROOT = Path(__file__).resolve().parent.parent


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def module_version(module: str) -> str | None:
    """Version of an importable module, else None. The import itself is the test (a wheel that
    is installed but cannot load its CUDA library is not usable), then `__version__` or the
    version of the distribution that provides it."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    version = getattr(mod, "__version__", None)
    if isinstance(version, str):
        return version
    for dist in _VERSIONED_MODULES.get(module, (module,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: str) -> str:
    """The GPU's name for a cuda device torch can see, else the CPU model."""
    if is_cuda(device):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(torch.device(device))
        except Exception:  # noqa: BLE001 - no usable CUDA: report the host CPU instead
            pass
    return _cpu_name()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_state() -> dict[str, Any]:
    """{"revision": HEAD or None, "dirty": tracked files modified (None without git)}. A tree
    copied without .git (a GPU machine's copy) names its revision in MLA_VERIFY_REVISION."""
    revision = _git("rev-parse", "HEAD")
    if revision is None:
        return {"revision": os.environ.get("MLA_VERIFY_REVISION") or None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"revision": revision, "dirty": None if status is None else bool(status)}


def collect_meta(profile: str, seeds: int | Iterable[int], device: str,
                 command: str | Iterable[str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Metadata of a run that starts now; `finish_meta` stamps its end."""
    return {
        "format": RUN_FORMAT,
        "profile": profile,
        "seeds": [int(seeds)] if isinstance(seeds, int) else [int(s) for s in seeds],
        "device": str(device),
        "device_name": device_name(str(device)),
        "command": command if command is None or isinstance(command, str) else " ".join(command),
        "versions": {"python": platform.python_version(),
                     **{m: module_version(m) for m in _VERSIONED_MODULES}},
        "platform": platform.platform(),
        "git": git_state(),
        "started_at": now(),
        "finished_at": None,
        **({"extra": dict(extra)} if extra else {}),
    }


def finish_meta(meta: Mapping[str, Any], finished_at: str | None = None) -> dict[str, Any]:
    """A copy of `meta` with its end time and the duration in seconds."""
    end = finished_at or now()
    started = meta.get("started_at")
    duration = ((datetime.fromisoformat(end) - datetime.fromisoformat(started)).total_seconds()
                if started else None)
    return {**meta, "finished_at": end, "duration_s": duration}


def describe(meta: Mapping[str, Any]) -> dict[str, str]:
    """Label -> text of a run's metadata, as the report headers and the side-by-side table print
    it (missing entries as a dash: runs written by older versions lack some)."""
    git = meta.get("git") or {}
    seeds = [str(s) for s in meta.get("seeds") or []]
    shown = ", ".join(seeds[:12]) + (f", … ({len(seeds)} seeds)" if seeds[12:] else "")
    versions = meta.get("versions") or {}
    described = {
        "profile": str(meta.get("profile") or MISSING),
        "command": str(meta.get("command") or MISSING),
        "device": f"{meta.get('device') or MISSING} ({meta.get('device_name') or MISSING})",
        "git": f"{git.get('revision') or MISSING}{' (dirty)' if git.get('dirty') else ''}",
        "versions": " · ".join(f"{k} {v or MISSING}" for k, v in versions.items()) or MISSING,
        "seeds": shown or MISSING,
        "started": str(meta.get("started_at") or MISSING),
        "finished": f"{meta.get('finished_at') or MISSING} ({number(meta.get('duration_s'))} s)",
        "platform": str(meta.get("platform") or MISSING),
    }
    # What the run recorded to draw its cases again (op, path, examples, ops), those it has.
    for key, value in (meta.get("extra") or {}).items():
        if value is not None and value != []:
            described.setdefault(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
    return described


# What a PASS judged in the implementation's own process says (--no-isolate, a callable object).
IN_PROCESS = "in-process: judged in the kernel's own process; run isolated for a verdict it cannot reach"


def judged_where(meta: Mapping[str, Any]) -> str:
    """Why a run's PASS is qualified: '' where every case was judged out of the kernel's reach
    (recorded "isolated": true), else that it was not, or may not have been (a run that did not
    record it)."""
    isolated = (meta.get("extra") or {}).get("isolated")
    if isolated is True:
        return ""
    return IN_PROCESS if isolated is False else "isolation not recorded: maybe judged in the kernel's own process"


def rerun_settings(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What re-draws a run's cases: its first seed, profile, campaign count (parallel parts run
    seeds S, S+1, ...) and what it recorded in "extra" (examples, ops and --impl strings, or op and
    path, whether a fuzz run skipped its covering set). Missing entries are None: a caller keeps its
    own default there."""
    extra = meta.get("extra") or {}
    seeds = meta.get("seeds") or []
    return {"seed": seeds[0] if seeds else None, "profile": meta.get("profile"),
            "campaigns": len(seeds) or None, "examples": extra.get("examples"), "ops": extra.get("ops"),
            "op": extra.get("op"), "path": extra.get("path"), "impls": extra.get("impls"),
            "covering": extra.get("covering_set")}


def _gated(meta: Mapping[str, Any]) -> str:
    """Which implementations a gate run gated, as a sentence part."""
    extra = meta.get("extra") or {}
    if "impls" not in extra:
        return "recorded no --impl (a run from before gates recorded it)"
    return f"gated --impl {' '.join(extra['impls'])}" if extra["impls"] else "gated every implementation (no --impl)"


def impls_differ(meta: Mapping[str, Any], baseline: Mapping[str, Any]) -> str | None:
    """What a comparison of two gate runs says first when they gated different implementations
    (--impl): the drift then compares kernels, not one kernel's runs (None: the same, or not two gates)."""
    if not all("ops" in (m.get("extra") or {}) for m in (meta, baseline)):  # a gate records its ops
        return None
    ours, theirs = (sorted((m.get("extra") or {}).get("impls") or ()) for m in (meta, baseline))
    if ours == theirs:  # a run that recorded none gated every implementation, or ran before --impl was
        return None
    return (f"different implementations: this run {_gated(meta)}, the baseline {_gated(baseline)}: what is compared "
            "with the baseline is another kernel's rows")
