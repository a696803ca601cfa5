"""Value regimes: the numbers a case is filled with, drawn from a seeded generator.

Each regime stresses something different in the kernels and the cache formats:
    normal      q ~ N(0, 1), kv ~ N(0, 1): logits of a few units, a broad softmax
    saturation  every kv tile near its fp8 scale's top (|x| / scale in (380, 448]), at powers of
                two from 2**-4 to 2**4: rounding near e4m3's max and the satfinite path
    outliers    a few channels 30-100x larger in q and kv: a peaked softmax, large logits
    zero_tiles  whole 128-element kv tiles zero (scale floor 2**-13 under pow2)
    tiny        kv ~ N(0, 1e-6): fp8 subnormals after scaling, the scale floor
    peaked      q scaled 8x: one or two keys dominate each softmax
    degenerate  normal, but about a quarter of the q rows (a token's head) exactly zero, never all of
                them: every logit of such a row is 0, a tied softmax whose exact answer is the mean of
                the selected V rows with lse = ln(k valid). Only the covering sets ask for it
                (COVERING_REGIMES): the random draws keep drawing REGIMES as pinned.
    flat        every kv row near one shared row (2% noise around it): hundreds of near-equal
                logits, a flat softmax whose output is about that row, of order 1. Every p of a
                row sits just below 1 where the others give one p of 1 and tiny ones, so a bias
                in how p is rounded before P.V (toward zero: the output 2^-9 small) shows only
                here, as a mean error. Covering sets only, as degenerate.
Nothing is ever all zero: a zero tensor hides unwritten outputs and wrong indexing.

Values are drawn on the generator's device: a case's tensors are a deterministic function of
(case, device type), and building them where they are used keeps the harness's own cost small.
"""

from __future__ import annotations

import collections
import zlib

import torch

from mla_verify import reference

from .builders import permutation

REGIMES = ("normal", "saturation", "outliers", "zero_tiles", "tiny", "peaked")
COVERING_REGIMES = ("degenerate", "flat")  # accepted by every value_regime param, never drawn at random
FLAT_NOISE = 0.02
ZERO_Q_SHARE = 0.25
NOPE, TILE = 512, 128


def _normal(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device)


def _uniform(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device)


def kv_values(gen: torch.Generator, n: int, regime: str, version: int = 1) -> torch.Tensor:
    """[n, 576] bf16 latent rows (512 NoPE + 64 RoPE) in `regime`, by input builder `version`
    (equivalence.cases.builders)."""
    x = _normal(gen, (n, 576))
    if regime == "saturation":
        power = torch.randint(-4, 5, (n, NOPE // TILE, 1), generator=gen, device=gen.device).float()
        magnitude = 380 + 68 * _uniform(gen, (n, NOPE // TILE, TILE))
        x[:, :NOPE] = (torch.sign(x[:, :NOPE]).view(n, NOPE // TILE, TILE) * magnitude * 2.0**power).view(n, NOPE)
    elif regime == "outliers":
        channels = permutation(gen, 576, version)[:4]
        x[:, channels] *= 30 + 70 * _uniform(gen, (4,))
    elif regime == "zero_tiles":
        zero = _uniform(gen, (n, NOPE // TILE)) < 0.5
        x[:, :NOPE] = (x[:, :NOPE].view(n, NOPE // TILE, TILE) * ~zero[..., None]).view(n, NOPE)
    elif regime == "tiny":
        x[:, :NOPE] *= 1e-6
    elif regime == "flat":
        x = _normal(gen, (1, 576)) + FLAT_NOISE * x
    elif regime not in ("normal", "peaked", "degenerate"):
        raise ValueError(f"unknown value regime {regime!r}; known: {REGIMES + COVERING_REGIMES}")
    return x.to(torch.bfloat16)


def q_values(gen: torch.Generator, shape: tuple[int, ...], regime: str, version: int = 1) -> torch.Tensor:
    """Query rows (last dim 576) in `regime`, bf16, by input builder `version` (equivalence.cases.builders)."""
    q = _normal(gen, shape)
    if regime == "outliers":
        channels = permutation(gen, 576, version)[:4]
        q[..., channels] *= 10
    elif regime == "peaked":
        q *= 8
    elif regime == "saturation":
        q *= 0.01  # kv is ~400x larger: keep logits in a range where the softmax still mixes
    elif regime == "degenerate":
        q = _zero_some_rows(gen, q)
    return q.to(torch.bfloat16)


def _zero_some_rows(gen: torch.Generator, q: torch.Tensor) -> torch.Tensor:
    """q with about ZERO_Q_SHARE of its rows (last dim) zero: the first row always (where there are
    two or more), the last never, so a case mixes tied rows with random ones and is never all zero."""
    rows = q.reshape(-1, q.shape[-1])
    zero = _uniform(gen, (rows.shape[0],)) < ZERO_Q_SHARE
    zero[0] = rows.shape[0] > 1
    zero[-1] = False
    return (rows * ~zero[:, None]).view(q.shape)


# Row pools: quantizing a large cache costs far more than the attention a case checks, so caches
# are filled from pools of rows quantized once per (regime, format, scale rule, device) and drawn
# per case with the case's generator. A pool is seeded by its regime alone: still a deterministic
# function of the case. The pools are the same for every input builder version.
POOL_ROWS = {"cuda": 1 << 18, "cpu": 1 << 15}
# Rows a pool packs on the spot for the cases that ask before it is packed whole (the same bytes:
# every format packs a row from that row alone). A CPU packs at a cost per row: up to a pool's
# worth, at most twice the packing a campaign needs, and a campaign of small cases never packs a
# pool per (regime, format, scale rule) it meets. A GPU pays per launch: it packs the pool at once.
ON_THE_SPOT_ROWS = {"cuda": 0, "cpu": POOL_ROWS["cpu"]}


# Pools kept per device type, in bytes: what is packed again from its seed when evicted (the same
# bytes). A GPU's are 302 MB a source pool and 172 MB an fp8 one: kept all (up to 16 regimes times
# formats) they filled the 5 GiB share of a worker among 4 parts on an 80 GB card (H100, `fuzz
# --parallel 4`: torch.OutOfMemoryError building a case's inputs).
POOL_BYTES = {"cuda": 2 << 30, "cpu": 1 << 30}
_POOLS: collections.OrderedDict[tuple[str, ...], torch.Tensor] = collections.OrderedDict()  # least recent first


def _kept(key: tuple[str, ...], make) -> torch.Tensor:
    """The pool `key` (its device last), made by `make()` when not kept; the least recently used
    pools of its device type go first once they hold more than POOL_BYTES."""
    if key in _POOLS:
        _POOLS.move_to_end(key)
        return _POOLS[key]
    pool = _POOLS[key] = make()
    kind = torch.device(key[-1]).type
    same = [k for k in _POOLS if torch.device(k[-1]).type == kind]
    while len(same) > 1 and sum(_POOLS[k].nbytes for k in same) > POOL_BYTES[kind]:
        del _POOLS[same.pop(0)]
    return pool


def release_pools() -> None:
    """Every kept pool given back (a process short of device memory: they are packed again on use)."""
    _POOLS.clear()


def _source_pool(regime: str, device: str) -> torch.Tensor:
    def make() -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(regime.encode()))
        return kv_values(gen, POOL_ROWS[torch.device(device).type], regime)

    return _kept(("source", regime, device), make)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes with each row as 8-byte words (every row format here is a multiple of 8
    bytes): an indexing op moves one element per 8 bytes, not per byte of a 656-byte row."""
    return rows.view(torch.int64)


def _gather(table: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """table[pick] for a table of rows, gathered as words."""
    return _words(table)[pick].view(table.dtype)


def _pack(rows: torch.Tensor, cache_dtype: str, scale_rule: str) -> torch.Tensor:
    if cache_dtype == "fp8_ds_mla":
        return reference.quantize_fp8_ds_mla(rows, scale_rule)
    if cache_dtype == "nvfp4_ds_mla":
        return reference.quantize_nvfp4_ds_mla(rows)
    return rows


_PACKED_ON_THE_SPOT: dict[tuple[str, str, str, str], int] = {}  # rows packed so far without the whole pool


def _packed_rows(pick: torch.Tensor, regime: str, cache_dtype: str, scale_rule: str) -> torch.Tensor:
    """The packed pool's rows `pick`: packed on the spot while the pool lends (ON_THE_SPOT_ROWS),
    else gathered from the whole pool, packed once (again once evicted)."""
    device = str(pick.device)
    key = ("packed", regime, cache_dtype, scale_rule, device)
    if key not in _POOLS:
        spot = _PACKED_ON_THE_SPOT.get(key, 0) + pick.numel()
        if spot <= ON_THE_SPOT_ROWS[pick.device.type]:
            _PACKED_ON_THE_SPOT[key] = spot
            return _pack(_gather(_source_pool(regime, device), pick), cache_dtype, scale_rule)
    return _gather(_kept(key, lambda: _pack(_source_pool(regime, device), cache_dtype, scale_rule)), pick)


def pooled_rows(
    gen: torch.Generator, n: int, regime: str, cache_dtype: str, scale_rule: str = "pow2"
) -> tuple[torch.Tensor, torch.Tensor]:
    """n (source rows [n, 576] bf16, cache rows [n, W]) drawn from the pools with `gen`: a run of
    consecutive pool rows from a random start, so no row repeats within a case below the pool size."""
    device = str(gen.device)
    size = POOL_ROWS[gen.device.type]
    start = torch.randint(0, size, (1,), generator=gen, device=gen.device)
    pick = (start + torch.arange(n, device=gen.device)) % size
    return _gather(_source_pool(regime, device), pick), _packed_rows(pick, regime, cache_dtype, scale_rule)


def fill_selected_slots(
    gen: torch.Generator, storage: torch.Tensor, block_size: int, slots: torch.Tensor, regime: str,
    cache_dtype: str, scale_rule: str = "pow2",
) -> None:
    """Write pool rows into the cache `storage[:-1, :block_size]` at every distinct slot of `slots`
    (int64, -1 = none, the only negative), the rows `pooled_rows` would give the sorted distinct
    slots, in a fixed number of device ops and no read back: a slot's row is found by its rank among the selected
    slots (a cumsum over the cache), and the -1 entries write into the last block of `storage`, a
    scratch block outside the cache, poisoned again afterwards."""
    capacity = (storage.shape[0] - 1) * block_size
    target = slots.remainder(capacity + 1).reshape(-1)  # -1 -> capacity, the scratch slot; the rest unchanged
    selected = torch.zeros(capacity + 1, dtype=torch.bool, device=storage.device)
    selected[target] = True
    rank = selected.cumsum(0) - 1
    size = POOL_ROWS[gen.device.type]
    start = torch.randint(0, size, (1,), generator=gen, device=gen.device)
    rows = _packed_rows((start + rank[target]) % size, regime, cache_dtype, scale_rule)
    _words(storage)[target // block_size, target % block_size] = _words(rows)
    storage[-1].fill_(0xFF)
