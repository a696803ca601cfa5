"""Each gate unit's seconds, kept for the next run: its shards are then sized by time, not by count.

A gate writes RUN/durations.json (`write`): per unit (op and implementation, `units.Unit.key`) the
seconds its corpus and campaigns took, for the units it finished; `--parallel` parts and `merge`
join their parts' and shards' files (`joined`). `gate --durations FILE` (a durations.json, or a run
directory holding one) reads them back, and `Shard.deal` gives each unit, longest first, to the
slot with the fewest seconds so far. A unit the file does not know (a new op, a new kernel) counts
as the mean of those it knows; with no file yet, every unit counts the same: the deal by count.
Every shard must read the same file (`merge` refuses shards of other durations: `digest`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz.casefile import write_atomic

DURATIONS_JSON = "durations.json"
FORMAT = "mla-verify-durations/1"


def read(path: str | Path) -> dict[str, float]:
    """The seconds a durations.json holds (`path`: the file, or a run directory holding one); {} where
    there is none yet. UsageError for a file that is not one."""
    path = Path(path)
    path = path / DURATIONS_JSON if path.is_dir() else path
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        seconds = data["seconds"] if data.get("format") == FORMAT else None
        if not isinstance(seconds, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in seconds.values()):
            raise ValueError(f"expected {{'format': {FORMAT!r}, 'seconds': {{unit: seconds}}}}")
    except (OSError, ValueError, AttributeError, KeyError) as exc:
        raise UsageError(f"--durations {path}: not a durations file ({exc})") from None
    return {str(k): float(v) for k, v in seconds.items()}


def write(directory: str | Path, seconds: Mapping[str, float]) -> None:
    """DIRECTORY/durations.json of `seconds` (nothing where there are none)."""
    if seconds:
        text = json.dumps({"format": FORMAT, "seconds": dict(sorted(seconds.items()))}, indent=1)
        write_atomic(Path(directory) / DURATIONS_JSON, text + "\n")


def joined(directories: Iterable[str | Path]) -> dict[str, float]:
    """The seconds of every directory's durations.json together (parts and shards run disjoint units)."""
    out: dict[str, float] = {}
    for directory in directories:
        out |= read(Path(directory) / DURATIONS_JSON)
    return out


def weights(keys: Sequence[str], seconds: Mapping[str, float] | None) -> list[float] | None:
    """Each unit's seconds for `Shard.deal` (unknown: the mean of the known); None where none is known."""
    known = [seconds[k] for k in keys if seconds and k in seconds]
    if not known:
        return None
    mean = sum(known) / len(known)
    return [seconds.get(k, mean) for k in keys]


def digest(seconds: Mapping[str, float] | None) -> str | None:
    """A short digest of the seconds a shard dealt by (None: by count), for `merge` to compare."""
    if not seconds:
        return None
    return hashlib.sha256(json.dumps(sorted(seconds.items())).encode()).hexdigest()[:12]
