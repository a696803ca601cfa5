"""Metadata invariants: what a pipeline stage's output must keep whatever the batch, checked after
every call (`call_guards.guard`) and reported with the stage's name.

A stage's fault often never reaches the pipeline's outputs: a converter writing -2 for an invalid
entry is read as invalid by the BF16 prefill kernel, which skips every negative, so forward_mqa
answers right while the converter broke its contract (invalid entries exactly -1), and a decode
kernel handed the same rows would read out of bounds. SGLang's mutation journal closed 6 of its 7
mutants that outputs could not show by checks like these:

    convert_index, dcp_convert_index, hisparse_place
                 every entry -1 or a row (never another negative); with valid counts (or
                 compaction: the DCP filter's at two ranks or more) each count within [0, K]
                 and the row's valid entries exactly its first count ones, -1 after them
    split_prefill_chunks
                 chunks ascending, contiguous, non-empty, covering every request once, each
                 within the workspace unless one request alone (the contract refuses that)

Each check reads only the call's own keywords and result: it holds for every implementation and
every input the contract allows, so a violation is the stage's fault.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch


def _entries(rows: torch.Tensor, counts: torch.Tensor | None, compacted: bool) -> str | None:
    """The first broken rule of index rows [N, K] (with their valid counts, or compacted)."""
    bad = rows < -1
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        return f"entry {list(at)} is {int(rows[at])}: an invalid entry is exactly -1"
    if counts is None and not compacted:
        return None
    valid = rows >= 0
    have = valid.sum(-1)
    if counts is not None:
        counts = counts.to(rows.device).long().reshape(have.shape)
        off = (counts < 0) | (counts > rows.shape[-1]) | (counts != have)
        if bool(off.any()):
            r = int(off.nonzero()[0][0])
            return (f"row {r} has valid count {int(counts[r])} for {int(have[r])} valid entries of {rows.shape[-1]}: "
                    f"a count is its row's valid entries")
    first = torch.arange(rows.shape[-1], device=rows.device)[None, :] < have[:, None]
    if bool((valid != first).any()):
        r = int((valid != first).any(-1).nonzero()[0][0])
        return f"row {r}'s valid entries are not its first {int(have[r])}: a compacted row holds -1 only after them"
    return None


def _converted(kw: Mapping[str, Any], result: Any) -> str | None:
    counted = bool(kw.get("return_valid_counts"))
    rows, counts = (result[0], result[1]) if counted else (result, None)
    return _entries(rows.reshape(-1, rows.shape[-1]), counts, counted)


def _dcp_converted(kw: Mapping[str, Any], result: Any) -> str | None:
    """Compacted only where asked and ranks are several (at one rank the plain converter runs,
    which ignores the flag, as upstream)."""
    return _entries(result.reshape(-1, result.shape[-1]), None,
                    bool(kw.get("compact_valid_to_front")) and int(kw.get("dcp_size", 1)) > 1)


def _placed(kw: Mapping[str, Any], result: Any) -> str | None:
    rows, counts = result[0], result[1]
    counted = bool(kw.get("return_valid_counts"))
    return _entries(rows.reshape(-1, rows.shape[-1]), counts if counted else None, counted)


def _chunked(kw: Mapping[str, Any], result: Any) -> str | None:
    lens, workspace = [int(n) for n in kw["seq_lens"]], int(kw["workspace_size"])
    chunks = [(int(a), int(b)) for a, b in result]
    ends = [0] + [b for _, b in chunks]
    if [a for a, _ in chunks] != ends[:-1] or ends[-1] != len(lens) or any(b <= a for a, b in chunks):
        return f"chunks {chunks} do not cover requests 0-{len(lens) - 1} once each, in order"
    over = [(a, b) for a, b in chunks if b - a > 1 and sum(lens[a:b]) > workspace]
    if over:
        return f"chunk {over[0]} holds {sum(lens[slice(*over[0])])} rows, past the workspace's {workspace}"
    return None


INVARIANTS: dict[str, Callable[[Mapping[str, Any], Any], str | None]] = {
    "convert_index": _converted, "dcp_convert_index": _dcp_converted, "hisparse_place": _placed,
    "split_prefill_chunks": _chunked,
}


def broken(stage: str, kwargs: Mapping[str, Any], result: Any) -> str | None:
    """Why `result` of a call of `stage` with `kwargs` breaks the stage's metadata invariant, or
    None (None too for a stage with none, or a result not of the contract's form: its own check
    says so)."""
    check = INVARIANTS.get(stage)
    if check is None:
        return None
    try:
        why = check(kwargs, result)
    except (TypeError, ValueError, IndexError, AttributeError, KeyError, RuntimeError):
        return None
    return f"metadata invariant: {why}" if why else None
