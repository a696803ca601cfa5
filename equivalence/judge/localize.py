"""Where a failing tensor's error sits: its differing elements summarized along the op's named
axes, in one line, only where a pattern holds.

A tensor's dimensions are named by its op's contract (`equivalence.contracts`: T tokens, H heads,
B batch entries, S query positions, N kv rows, a number or D: columns). A token axis is also read
through the request each token belongs to (with its kind, decode or prefill, where the path splits
them) and, where the op has one, each token's topk_length; a column axis through the four
128-column scale tiles of the latent part and its 64 RoPE columns. A claim names the part of an
axis every differing element lies in: "all 48 differing rows belong to prefill requests 1-2 of 3;
request 0 matches", "errors in columns 384-511 only (scale tile 3)", "only batch entries >= 1".

Noise must not read as a pattern. A tensor compared bit for bit differs only where it is wrong,
so where it differs is a fact. A float tensor's differing elements (outside their allowed
difference) make a claim only when they are past rounding (their median error at least ROUNDED of
their own size), among the live elements (of a nonzero reference, as large as the differing ones:
rounding's largest errors sit on the largest values), when elements spread at
random would land all in the named part with a chance below CHANCE (n differing rows, or columns
for the column axis, in a part holding a share f of the live ones: f**n, times the number of parts
of that size), and, for tiles, when most of the named tiles' columns differ. Measured with the
correct implementations over the gate's cases (corpus and `ci` draws, reseeded: 350 cases, 780
float tensors, their 1% of elements nearest their bounds taken as differing): no pattern line;
11 (tiles, batch entries, tokens, requests) with ROUNDED at 0; tests/test_localize.py repeats a
smaller run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from mla_verify.reference.forward import select_path
from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills

from .. import contracts

CHANCE = 1e-3
ROUNDED = 2.0**-6  # relative error of a float element within 4 bf16 rounding steps (2**-8) of its own size
TILE, LATENT = 128, 512  # an fp8_ds_mla row's scale tiles; past the latent part, the RoPE columns
AXES = {"T": "token", "H": "head", "B": "batch entry", "S": "query position", "s": "query position",
        "N": "kv row", "K": "top-k position", "P": "prefill request", "R": "request", "num_rows": "workspace row"}
RANK_OPS = ("dcp_merge",)  # ops whose N is the ranks (the contracts' docstring), not kv rows
SHOWN = frozenset({"token", "head", "batch entry", "query position", "rank"})  # the row axes a claim may name


def dims_of(op: str, tensor: str, names: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The dimension names `op`'s contract gives its returned `tensor` ("out[T,H,512]"); a return
    the contract does not name takes the bracketed shapes in the order of `names` (the op's
    checked tensors). None where the contract says nothing of it."""
    if op not in contracts.CONTRACTS:
        return None
    text = contracts.returns(op)
    named = dict(re.findall(r"([A-Za-z_]\w*)\[([\w,]+)\]", text))
    if tensor in named:
        return tuple(named[tensor].split(","))
    bare = list(dict.fromkeys(re.findall(r"(?<![\w\]])\[([\w,]+)\]", text)))
    if tensor in names and names.index(tensor) < len(bare):
        return tuple(bare[names.index(tensor)].split(","))
    return None


@dataclass(frozen=True)
class Axes:
    """What names the dimensions of one compared tensor: its contract's letters, the request of
    each token and each request's kind, each token's topk_length."""

    dims: tuple[str, ...]
    requests: torch.Tensor | None = None   # [T] the request of each token
    kinds: tuple[str, ...] = ()            # per request: "decode" | "prefill" ("" unknown)
    lengths: torch.Tensor | None = None    # [T] topk_length
    ranks: bool = False                    # N names the ranks (dcp_merge's partials)

    def label(self, i: int) -> str:
        d = self.dims[i]
        if d == "N" and self.ranks:
            return "rank"
        return AXES.get(d, "column" if d.isdigit() or d == "D" else d)


def axes_for(op: str, tensor: str, names: Sequence[str], kwargs: Mapping[str, Any]) -> Axes | None:
    """The axes of `op`'s returned `tensor` for a call with `kwargs`: a forward_mqa batch's or a
    stage's own (req_id, prefill_request_ids, topk_length)."""
    dims = dims_of(op, tensor, names)
    if dims is None:
        return None
    lengths = kwargs.get("topk_length")
    requests, kinds = _batch_requests(kwargs["batch"]) if "batch" in kwargs else _stage_requests(kwargs)
    return Axes(dims, requests, kinds, lengths if isinstance(lengths, torch.Tensor) else None, op in RANK_OPS)


def _batch_requests(batch: Any) -> tuple[torch.Tensor | None, tuple[str, ...]]:
    """A forward_mqa batch's request of each token, and each request's kind on the fp8_separate
    path (elsewhere every token takes the same kernel: no kind)."""
    qsl, config = getattr(batch, "query_start_loc", None), getattr(batch, "config", {})
    if qsl is None or "num_heads" not in config:
        return None, ()
    lens = torch.tensor([b - a for a, b in zip(qsl, qsl[1:])])
    requests = torch.repeat_interleave(torch.arange(len(lens)), lens)
    if select_path(config["kv_cache_dtype"], config["num_heads"]) != "fp8_separate":
        return requests, ()
    threshold = reorder_batch_threshold(config["num_heads"], config.get("arch", "sm90"),
                                        max_decode_query_len=config.get("max_decode_query_len", 1))
    decodes = split_decodes_and_prefills(qsl, threshold).num_decodes
    return requests, ("decode",) * decodes + ("prefill",) * (len(lens) - decodes)


def _stage_requests(kwargs: Mapping[str, Any]) -> tuple[torch.Tensor | None, tuple[str, ...]]:
    """An index stage's request of each token (req_id) and, with prefill_request_ids, which
    requests are prefills."""
    req_id = kwargs.get("req_id")
    if not isinstance(req_id, torch.Tensor):
        return None, ()
    requests = req_id.long().cpu()
    pids = kwargs.get("prefill_request_ids")
    if not isinstance(pids, torch.Tensor) or not requests.numel():
        return requests, ()
    prefill = torch.zeros(int(requests.max()) + 1, dtype=torch.bool)
    prefill[requests[pids[: len(requests)].cpu() >= 0]] = True
    return requests, tuple("prefill" if p else "decode" for p in prefill.tolist())


def where(axes: Axes | None, differ: torch.Tensor, exact: bool, live: torch.Tensor | None = None,
          magnitude: torch.Tensor | None = None, error: torch.Tensor | None = None) -> str:
    """The one line that says where the True elements of `differ` (the tensor's shape) lie, or ""
    where no pattern holds; `exact`: a bit-for-bit comparison (no noise to rule out). `live`: the
    elements that could differ at all (a float tensor's: those of a nonzero reference or not equal
    to it; an empty row's exact zeros say nothing of where an error goes); None: every element.
    `magnitude`: a float tensor's |reference|: a part matches only by holding elements as large
    as the differing ones (the median of theirs), since rounding's largest errors sit on the
    largest values (a saturated tile), and a part of small values could not have shown them.
    `error`: with `magnitude`, |impl - reference|: differing elements off by less than
    ROUNDED of their own size (in the median) are rounding, wherever they sit: no claim."""
    if axes is None or differ.dim() != len(axes.dims) or differ.dim() == 0 or not bool(differ.any()):
        return ""
    # Reduced where the tensors live; only rows and columns come to the host (a failing GPU
    # tensor's float64 magnitudes would be gigabytes).
    live = (differ | live.to(differ.device)) if live is not None else torch.ones_like(differ)
    if magnitude is not None:
        magnitude = magnitude.to(differ.device)
        if error is not None and float((error.to(differ.device) / magnitude)[differ].median()) < ROUNDED:
            return ""
        live = differ | (live & (magnitude >= magnitude[differ].median()))
    columns = axes.label(differ.dim() - 1) == "column"
    rows, live_rows = (differ.any(-1).cpu(), live.any(-1).cpu()) if columns else (differ.cpu(), live.cpu())
    unit = "rows" if columns else "elements"
    claims = [_rows_claim(axes, _Split.along(rows, live_rows, i), exact, unit, i) for i in range(rows.dim())]
    if columns:
        claims.append(_columns_claim(differ.reshape(-1, differ.shape[-1]).any(0).cpu(),
                                     live.reshape(-1, live.shape[-1]).any(0).cpu(), exact))
    return "; ".join(filter(None, claims))


@dataclass(frozen=True)
class _Split:
    """Units (rows, or elements) along one axis: which indices hold a differing one, and how many
    live ones each index holds."""

    hit: torch.Tensor     # [size] bool
    live: torch.Tensor    # [size] live units at each index
    n: int                # differing units

    @classmethod
    def along(cls, rows: torch.Tensor, live_rows: torch.Tensor, i: int) -> "_Split":
        size = rows.shape[i]
        return cls(rows.movedim(i, 0).reshape(size, -1).any(-1), live_rows.movedim(i, 0).reshape(size, -1).sum(-1),
                   int(rows.sum()))

    def share(self, part: torch.Tensor) -> float:
        """The share of the live units that indices `part` (bool [size]) hold."""
        total = int(self.live.sum())
        return int(self.live[part].sum()) / total if total else 1.0


def named_at(axes: Axes | None, at: tuple[int, ...]) -> str:
    """A position (4, 0) as its axes name it, " (token 4 of request 2, top-k position 0)"; "" where
    the axes are unknown."""
    if axes is None or not at or len(at) != len(axes.dims):
        return ""
    parts = []
    for i, c in enumerate(at):
        label = axes.label(i)
        if label == "column":
            parts.append(f"column {c} in {f'scale tile {c // TILE}' if c < LATENT else 'the RoPE columns'}")
        elif label == "token" and axes.requests is not None and c < len(axes.requests):
            parts.append(f"token {c} of request {int(axes.requests[c])}")
        else:
            parts.append(f"{label} {c}")
    return f" ({', '.join(parts)})"


def _holds(exact: bool, n: int, share: float, parts: int, hit: int) -> bool:
    """Whether n differing units all in parts holding `share` of them is a pattern: always for an
    exact comparison (a strict part), else when chance would put them there below CHANCE."""
    if hit >= parts or share >= 1.0:
        return False
    return exact or math.comb(parts, hit) * share**n < CHANCE


def _rows_claim(axes: Axes, split: _Split, exact: bool, unit: str, i: int) -> str:
    label = axes.label(i)
    if label == "token" and axes.requests is not None and len(axes.requests) >= len(split.hit):
        return _requests_claim(axes, split, exact, unit) or _lengths_claim(axes, split, exact)
    if label == "token":
        return _lengths_claim(axes, split, exact) or _range_claim("tokens", split, exact)
    if label in SHOWN:
        return _range_claim(f"{label}s" if not label.endswith("y") else label[:-1] + "ies", split, exact)
    return ""


def _requests_claim(axes: Axes, split: _Split, exact: bool, unit: str) -> str:
    requests = axes.requests[: len(split.hit)].cpu().long()
    count = int(requests.max()) + 1 if requests.numel() else 0
    live = torch.bincount(requests, weights=split.live.double(), minlength=count) > 0
    hit_requests = torch.zeros(count, dtype=torch.bool)
    hit_requests[requests[split.hit]] = True
    if not _holds(exact, split.n, split.share(hit_requests[requests]), int(live.sum()), int(hit_requests.sum())):
        return ""
    kinds = {axes.kinds[r] for r in hit_requests.nonzero().flatten().tolist() if r < len(axes.kinds)}
    kind = f"{kinds.pop()} " if len(kinds) == 1 and len(axes.kinds) == count else ""
    matching = (live & ~hit_requests).nonzero().flatten().tolist()
    matches = f"request {matching[0]} matches" if len(matching) == 1 else f"requests {_ranges(matching)} match"
    named = hit_requests.nonzero().flatten().tolist()
    which = f"{kind}request{'s' if len(named) > 1 else ''} {_ranges(named)} of {count}"
    who = f"the one differing {unit[:-1]} belongs" if split.n == 1 else f"all {split.n} differing {unit} belong"
    return f"{who} to {which}; {matches}"


def _lengths_claim(axes: Axes, split: _Split, exact: bool) -> str:
    """Every differing token has one topk_length, which other live tokens do not have."""
    if axes.lengths is None or len(axes.lengths) != len(split.hit) or int(split.hit.sum()) < 2:
        return ""
    lengths = axes.lengths.cpu()
    values = lengths[split.hit].unique()
    if len(values) != 1:
        return ""
    if not _holds(exact, split.n, split.share(lengths == values[0]), len(lengths[split.live > 0].unique()), 1):
        return ""
    return f"only tokens with topk_length {int(values[0])}"


def _range_claim(what: str, split: _Split, exact: bool) -> str:
    size, at = len(split.hit), split.hit.nonzero().flatten().tolist()
    if not _holds(exact, split.n, split.share(split.hit), int((split.live > 0).sum()), len(at)):
        return ""
    if at == list(range(at[0], size)) and at[0] > 0:
        return f"only {what} >= {at[0]}"
    return f"only {what} {_ranges(at)} of {size}"


def _columns_claim(hit: torch.Tensor, live: torch.Tensor, exact: bool) -> str:
    """The scale tiles (and RoPE columns) the differing columns lie in, where that is a strict part."""
    width = len(hit)
    if width < LATENT:
        return ""
    parts: list[tuple[int | None, int, int]] = [(t, t * TILE, (t + 1) * TILE) for t in range(LATENT // TILE)]
    if width > LATENT:
        parts.append((None, LATENT, width))  # the RoPE columns: no scale tile
    parts = [p for p in parts if bool(live[p[1]:p[2]].any())]
    touched = [p for p in parts if bool(hit[p[1]:p[2]].any())]
    held = sum(int(live[a:b].sum()) for _, a, b in touched)
    # Rounding's largest errors gather in a row's largest tiles: a float claim also needs most of
    # the named tiles' columns to differ (a wrong scale spoils every column of its tile).
    dense = exact or int(hit.sum()) >= held / 2
    if not dense or not _holds(exact, int(hit.sum()), held / max(1, int(live.sum())), len(parts), len(touched)):
        return ""
    spans = ", ".join(f"{a}-{b - 1}" for _, a, b in _merged(touched))
    tiles = [str(tile) for tile, _, _ in touched if tile is not None]
    named = [f"scale tile{'s' if len(tiles) > 1 else ''} {', '.join(tiles)}"] if tiles else []
    named += ["the RoPE columns" for tile, _, _ in touched if tile is None]
    return f"errors in columns {spans} only ({'; '.join(named)})"


def _merged(parts: list[tuple[int | None, int, int]]) -> list[tuple[int | None, int, int]]:
    out: list[tuple[int | None, int, int]] = []
    for tile, a, b in parts:
        if out and out[-1][2] == a:
            out[-1] = (out[-1][0], out[-1][1], b)
        else:
            out.append((tile, a, b))
    return out


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
