"""DeepSeek V4's serving index builders (exact): the decode window's slots, vLLM's prefill rows
over the gathered buffer, FlashInfer's combined decode table. Positions gather at the window's
edges (pos + 1 below, at and past the window) and at the compress ratio's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge.policy import EXACT

from ..cases.profiles import Profile
from ..cases.schema import BLOCK, Flag, Int, Ints, OneOf, Params, param
from ..spec import register
from .base import Check, OpSpec
from .common import generator, host_values, knobs, rand, randint, single

WINDOWS = (1, 4, 128)  # 128: DeepSeek V4's window


@dataclass(frozen=True)
class WindowParams(Params):
    """T query tokens of R requests at `positions` (given, or drawn around the window's edges)."""

    requests: int = param(Int(1, 4096))
    positions: tuple[int, ...] = param(Ints(0, 2**20, 4096))  # one per token; token t is request t % requests
    window: int = param(OneOf(*WINDOWS))
    block_size: int = param(BLOCK)
    compressed_topk: int = param(Int(0, 2**14), 0)   # flashinfer_decode_table: the compressed list's width
    compressed_lens: bool = param(Flag(), True)      # ... with lengths per token (else all count)

    def elements(self) -> int:
        tokens = len(self.positions)
        return tokens * (2 * self.window + 2 * self.compressed_topk + 8) + self.requests * (max(self.positions) // self.block_size + 2)


def _edge_positions(window: int, longest: int) -> st.SearchStrategy[int]:
    """A position whose window is short, just full (pos + 1 = window), or past it, or any."""
    edges = [max(0, window + d) for d in (-2, -1, 0, 1)]
    return st.one_of(st.sampled_from(edges), st.integers(0, max(1, longest)))


def _window_params(p: Profile, compressed: bool) -> st.SearchStrategy[dict]:
    @st.composite
    def params(draw):
        window = draw(st.sampled_from(WINDOWS))
        tokens = draw(st.integers(1, 2 * p.max_tokens))
        return {"requests": draw(st.integers(1, p.max_requests)),
                "positions": [draw(_edge_positions(window, p.max_context)) for _ in range(tokens)],
                "window": window, "block_size": draw(st.sampled_from((1, 5, 61) + p.block_sizes)),
                "compressed_topk": draw(st.sampled_from((0, 1, 13) + p.decode_topk)) if compressed else 0,
                "compressed_lens": draw(st.booleans())}

    return params()


def _table(g, p: WindowParams, device: str) -> torch.Tensor:
    """Each request's block table: distinct random physical blocks, enough for its last position."""
    width = max(p.positions) // p.block_size + 1
    return torch.randperm(p.requests * width + 3, generator=g, device=device)[: p.requests * width].view(
        p.requests, width).to(torch.int32)


def _window_inputs(p: WindowParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    positions = host_values(list(p.positions), device)
    return {"positions": positions, "req_of_token": torch.arange(len(p.positions), device=device) % p.requests,
            "block_table": _table(g, p, device), "block_size": p.block_size, "window": p.window}


register(OpSpec(
    name="window_indices", stage="window_indices", params=WindowParams, draw=lambda p: _window_params(p, False),
    inputs=_window_inputs,
    reference=lambda kw, p: dict(zip(("indices", "lengths"), reference.window_indices(**kw))),
    call=single(lambda out: dict(zip(("indices", "lengths"), out))),
    checks=(Check("indices", EXACT), Check("lengths", EXACT)),
    knobs=lambda p: knobs(p, num_tokens=len(p.positions), block_size=p.block_size),
    doc="each token's sliding window as cache slots through its request's block table, -1 past min(pos + 1, window)",
), priority=0)


def _table_inputs(p: WindowParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    window, _ = reference.window_indices(**_window_inputs(p, seed, device))
    tokens, k = window.shape[0], p.compressed_topk
    slots = randint(g, 0, 1 << 20, tokens, k)
    lens = randint(g, 0, k + 1, tokens)
    slots = torch.where(torch.arange(k, device=device)[None, :] < lens[:, None], slots, -1)
    slots = slots.masked_fill(rand(g, tokens, k) < 0.1, -1)
    return {"window_slots": window, "compressed_slots": slots.to(torch.int32),
            "compressed_lens": lens.to(torch.int32) if p.compressed_lens else None}


register(OpSpec(
    name="flashinfer_decode_table", stage="flashinfer_decode_table", params=WindowParams,
    draw=lambda p: _window_params(p, True), inputs=_table_inputs,
    reference=lambda kw, p: dict(zip(("table", "lengths"), reference.flashinfer_decode_table(**kw))),
    call=single(lambda out: dict(zip(("table", "lengths"), out))),
    checks=(Check("table", EXACT), Check("lengths", EXACT)),
    knobs=lambda p: knobs(p, num_tokens=len(p.positions), topk=p.compressed_topk),
    doc="FlashInfer's DSv4 decode table: the window's slots, then the compressed ones; lengths count the whole window",
), priority=0)


@dataclass(frozen=True)
class PrefillRowsParams(Params):
    """R prefill requests: query_lens[r] new tokens ending a sequence of seq_lens[r]."""

    query_lens: tuple[int, ...] = param(Ints(0, 2**16, 4096))
    seq_lens: tuple[int, ...] = param(Ints(1, 2**22, 4096))
    window: int = param(OneOf(*WINDOWS))
    compress_ratio: int = param(OneOf(4, 128))
    topk: int = param(Int(0, 2**14))
    picks_width: int = param(Int(0, 2**14))        # topk_indices' width (>= topk)
    start: int = param(Int(0, 2**20), 0)           # query_start_loc's first entry (a chunk of a larger batch)

    def elements(self) -> int:
        tokens = sum(self.query_lens)
        return tokens * (self.picks_width + self.topk + self.window + 256)

    def problem(self) -> str | None:
        if len(self.query_lens) != len(self.seq_lens) or not self.query_lens:
            return "query_lens and seq_lens hold one length per request"
        if any(q > s for q, s in zip(self.query_lens, self.seq_lens)):
            return "a request has more query tokens than tokens"
        return None if self.picks_width >= self.topk else "picks_width below topk"


def _prefill_rows_params(p: Profile) -> st.SearchStrategy[dict]:
    @st.composite
    def params(draw):
        window = draw(st.sampled_from(WINDOWS))
        reqs = draw(st.integers(1, p.max_requests))
        seqs = [draw(_edge_positions(window, p.max_context)) + 1 for _ in range(reqs)]
        queries = [draw(st.integers(0, min(s, p.max_query))) for s in seqs]
        topk = draw(st.sampled_from((0, 5) + p.decode_topk))
        return {"query_lens": queries, "seq_lens": seqs, "window": window,
                "compress_ratio": draw(st.sampled_from((4, 128))), "topk": topk,
                "picks_width": topk + draw(st.sampled_from((0, 3))), "start": draw(st.sampled_from((0, 7)))}

    return params()


def _prefill_rows_inputs(p: PrefillRowsParams, seed: int, device: str) -> dict:
    """The indexer's picks within each token's k (past it -1 or junk), the gather lengths vLLM
    computes (query_len + min(prefix, window - 1)), M and N sized for the largest request."""
    g = generator(seed, device)
    tokens = sum(p.query_lens)
    qsl = [p.start]
    for q in p.query_lens:
        qsl.append(qsl[-1] + q)
    seq = host_values(list(p.seq_lens), device)
    queries = host_values(list(p.query_lens), device)
    gather = queries + torch.clamp(seq - queries, max=p.window - 1)
    n = max(s // p.compress_ratio for s in p.seq_lens) + 1
    req = torch.repeat_interleave(torch.arange(len(p.seq_lens), device=device), queries, output_size=tokens)
    pos = seq[req] - queries[req] + torch.arange(tokens, device=device) - (host_values(qsl[:-1], device) - p.start)[req]
    seen = torch.clamp((pos + 1) // p.compress_ratio, max=p.topk)
    picks = (rand(g, tokens, p.picks_width) * seen.clamp(min=1)[:, None]).long()
    junk = torch.where(rand(g, tokens, p.picks_width) < 0.5, -1, randint(g, 0, 1 << 20, tokens, p.picks_width))
    picks = torch.where(torch.arange(p.picks_width, device=device)[None, :] < seen[:, None], picks, junk)
    return {"topk_indices": picks.to(torch.int32), "query_start_loc": host_values(qsl, device).to(torch.int32),
            "seq_lens": seq.to(torch.int32), "gather_lens": gather.to(torch.int32), "window": p.window,
            "compress_ratio": p.compress_ratio, "topk": p.topk, "m": n + int(gather.max()), "n": n}


register(OpSpec(
    name="v4_prefill_indices", stage="v4_prefill_indices", params=PrefillRowsParams, draw=_prefill_rows_params,
    inputs=_prefill_rows_inputs,
    reference=lambda kw, p: dict(zip(("rows", "lengths"), reference.v4_prefill_indices(**kw))),
    call=single(lambda out: dict(zip(("rows", "lengths"), out))),
    checks=(Check("rows", EXACT), Check("lengths", EXACT)),
    knobs=lambda p: knobs(p, num_tokens=sum(p.query_lens)),
    doc="vLLM's DeepSeek V4 prefill rows: each token's compressed picks + M r, then its window over the gathered "
        "buffer, -1 to a multiple of 128",
), priority=0)
