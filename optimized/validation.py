"""Input checks that run before any kernel launch.

A kernel handed a wrong dtype reads garbage; one handed an out-of-range index can fault and poison
the whole CUDA context (the FP8 decode kernel has no upper-bound check at all). Every optimized
entry point validates its inputs here first and raises `InputError` (a ValueError) that names the
argument, what was expected and what was found.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class InputError(ValueError):
    """A contract violation in the arguments of an optimized op, found before launch."""


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype],
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; `None` in `shape` matches any size."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InputError(f"{name}: expected dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                expect = tuple("*" if s is None else s for s in shape)
                raise InputError(
                    f"{name}: expected shape {expect}, got {tuple(t.shape)} (dim {axis})"
                )
    if device is not None and t.device != torch.device(device):
        raise InputError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise InputError(f"{name}: must be contiguous (strides {t.stride()}, shape {tuple(t.shape)})")
    if last_dim_contiguous and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputError(f"{name}: last dim must be contiguous (strides {t.stride()})")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise InputError(f"all tensors must be on one device: {listing}")
    return next(iter(devices.values()))


def check_index_range(
    name: str,
    idx: torch.Tensor,
    upper: int,
    *,
    lower: int = 0,
    sentinels: Sequence[int] = (),
) -> None:
    """Every entry must be in [lower, upper) or one of `sentinels`; names the first offender.

    This costs one device->host sync; it is the price of never launching on a bad index.
    """
    if idx.numel() == 0:
        return
    floor = lower - 1 if lower - 1 in sentinels else lower
    if all(s == floor or lower <= s < upper for s in sentinels):  # one range: its ends decide (one op)
        least, most = torch.stack(idx.aminmax()).tolist()
        if floor <= least and most < upper:
            return
    ok = (idx >= lower) & (idx < upper)
    for s in sentinels:
        ok |= idx == s
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()[0].tolist()
    value = int(idx[tuple(bad)])
    allowed = f"[{lower}, {upper})" + "".join(f" or {s}" for s in sentinels)
    raise InputError(
        f"{name}: entry {tuple(bad)} is {value}, outside {allowed}; "
        f"{int((~ok).sum())} of {idx.numel()} entries are out of range"
    )


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    if value % multiple:
        raise InputError(f"{name}={value} must be a multiple of {multiple} ({why})")


def check_choice(name: str, value: object, allowed: Sequence[object], why: str = "") -> None:
    if value not in allowed:
        suffix = f" ({why})" if why else ""
        raise InputError(f"{name}={value!r} is not one of {list(allowed)}{suffix}")


def check_sm_scale(sm_scale: object) -> float:
    """The softmax scale of the attention kernels: finite and > 0.

    Both FlashMLA and our kernels take the row max of raw scores and scale after, which picks
    the wrong extreme for a negative scale; 0 turns masked -inf * 0 into NaN.
    """
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise InputError(f"sm_scale: expected a number, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise InputError(f"sm_scale: must be finite and > 0, got {sm_scale!r}")
    return float(sm_scale)
