"""Value regimes: the numbers a case is filled with, drawn from a seeded generator.

Each regime stresses something different in the kernels and the cache formats:
    normal      q ~ N(0, 1), kv ~ N(0, 1): logits of a few units, a broad softmax
    saturation  every kv tile near its fp8 scale's top (|x| / scale in (380, 448]), at powers of
                two from 2**-4 to 2**4: rounding near e4m3's max and the satfinite path
    outliers    a few channels 30-100x larger in q and kv: a peaked softmax, large logits
    zero_tiles  whole 128-element kv tiles zero (scale floor 2**-13 under pow2)
    tiny        kv ~ N(0, 1e-6): fp8 subnormals after scaling, the scale floor
    peaked      q scaled 8x: one or two keys dominate each softmax
Nothing is ever all zero: a zero tensor hides unwritten outputs and wrong indexing.

Values are drawn on the generator's device: a case's tensors are a deterministic function of
(case, device type), and building them where they are used keeps the harness's own cost small.
"""

from __future__ import annotations

import torch

REGIMES = ("normal", "saturation", "outliers", "zero_tiles", "tiny", "peaked")
NOPE, TILE = 512, 128


def _normal(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device)


def _uniform(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device)


def kv_values(gen: torch.Generator, n: int, regime: str) -> torch.Tensor:
    """[n, 576] bf16 latent rows (512 NoPE + 64 RoPE) in `regime`."""
    x = _normal(gen, (n, 576))
    if regime == "saturation":
        power = torch.randint(-4, 5, (n, NOPE // TILE, 1), generator=gen, device=gen.device).float()
        magnitude = 380 + 68 * _uniform(gen, (n, NOPE // TILE, TILE))
        x[:, :NOPE] = (torch.sign(x[:, :NOPE]).view(n, NOPE // TILE, TILE) * magnitude * 2.0**power).view(n, NOPE)
    elif regime == "outliers":
        channels = torch.randperm(576, generator=gen, device=gen.device)[:4]
        x[:, channels] *= 30 + 70 * _uniform(gen, (4,))
    elif regime == "zero_tiles":
        zero = _uniform(gen, (n, NOPE // TILE)) < 0.5
        x[:, :NOPE] = (x[:, :NOPE].view(n, NOPE // TILE, TILE) * ~zero[..., None]).view(n, NOPE)
    elif regime == "tiny":
        x[:, :NOPE] *= 1e-6
    elif regime not in ("normal", "peaked"):
        raise ValueError(f"unknown value regime {regime!r}; known: {REGIMES}")
    return x.to(torch.bfloat16)


def q_values(gen: torch.Generator, shape: tuple[int, ...], regime: str) -> torch.Tensor:
    """Query rows (last dim 576) in `regime`, bf16."""
    q = _normal(gen, shape)
    if regime == "outliers":
        channels = torch.randperm(576, generator=gen, device=gen.device)[:4]
        q[..., channels] *= 10
    elif regime == "peaked":
        q *= 8
    elif regime == "saturation":
        q *= 0.01  # kv is ~400x larger: keep logits in a range where the softmax still mixes
    return q.to(torch.bfloat16)
