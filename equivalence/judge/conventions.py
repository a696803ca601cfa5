"""Conventions the kernels of this family disagree on without being wrong, declared for the kernel
under test (`--convention KEY=VALUE`, `conventions=` in `check()`) and converted once, at the
kernel's boundary, into the reference's: the oracle holds every kernel to one contract.

    lse_base=2          the LSE is log2 sum_j 2^(s_j log2 e) = lse / ln 2 (FlashMLA before its PR #150,
                        SGLang's older copy: softmax in exp2); the reference's is natural-log (e)
    empty_lse=-inf      a row with no valid key has LSE -inf (FlashInfer; vLLM's DCP neutralization);
                        the reference's is +inf
    max_logits_base=2   max_logits in log2 units, max_j s_j * log2 e; the reference's is natural (e)

The conversion wraps the user's callable (an op's, a stage's inside forward_mqa or a property, or a
whole forward_mqa) so each LSE and max_logits it returns is the reference's convention before any
later stage or the oracle reads it. A convention left undeclared keeps failing, and the failure
names the convention it looks like (`equivalence.judge.mismatch`). Case files record the declaration, so
a replay converts the same way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

# key -> (the values a kernel may declare, the reference's own)
CONVENTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "lse_base": (("e", "2"), "e"),
    "empty_lse": (("+inf", "-inf"), "+inf"),
    "max_logits_base": (("e", "2"), "e"),
}

# What the kernels with an LSE of their own return, in order (equivalence.contracts).
RETURNS: dict[str, tuple[str, ...]] = {
    "sparse_prefill": ("out", "lse", "max_logits"),
    "sparse_decode_fp8": ("out", "lse"),
    "forward_mqa": ("out", "lse"),
    "sparse_decode_v4": ("out", "lse"), "sparse_decode_v41": ("out", "lse"), "v4_decode": ("out", "lse"),
}


@dataclass(frozen=True)
class Declared:
    """A kernel's conventions, each the reference's unless declared."""

    lse_base: str = "e"
    empty_lse: str = "+inf"
    max_logits_base: str = "e"

    def declarations(self) -> tuple[str, ...]:
        """"KEY=VALUE" for each convention that differs from the reference's, as the CLI takes them."""
        return tuple(f"{k}={getattr(self, k)}" for k, (_, own) in CONVENTIONS.items() if getattr(self, k) != own)


def parse(declared: Sequence[str] | Mapping[str, Any] | None) -> Declared:
    """["lse_base=2", ...] or {"lse_base": 2, ...} -> Declared; ValueError naming what is wrong."""
    pairs = declared.items() if isinstance(declared, Mapping) else [_split(s) for s in declared or ()]
    values: dict[str, str] = {}
    for key, value in pairs:
        if key not in CONVENTIONS:
            known = ", ".join(f"{k}={'|'.join(v)}" for k, (v, _) in CONVENTIONS.items())
            raise ValueError(f"unknown convention {key!r}; known: {known}")
        text = _text(value)
        if text not in CONVENTIONS[key][0]:
            raise ValueError(f"convention {key}={value}: one of {', '.join(CONVENTIONS[key][0])}")
        if values.get(key, text) != text:
            raise ValueError(f"convention {key} declared twice, as {values[key]} and {text}")
        values[key] = text
    return Declared(**values)


def _split(s: str) -> tuple[str, str]:
    key, sep, value = str(s).partition("=")
    if not sep:
        raise ValueError(f"convention {s!r}: expected KEY=VALUE (e.g. lse_base=2)")
    return key.strip(), value.strip()


def _text(value: Any) -> str:
    """2, 2.0, "2" -> "2"; math.e -> "e"; -math.inf, "-inf" -> "-inf"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value == math.e:
            return "e"
        return "+inf" if value == math.inf else "-inf" if value == -math.inf else f"{value:g}"
    text = str(value).strip()
    return "+inf" if text in ("inf", "+inf") else text


def to_reference(result: Any, names: Sequence[str], declared: Declared) -> Any:
    """The kernel's `result` (a tuple named `names`) with its LSE and max_logits in the reference's
    conventions; anything not a tuple of tensors passes unchanged, for the contract check to judge."""
    if not isinstance(result, tuple):
        return result
    converted = []
    for name, x in zip(names, result):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            if name == "lse":
                if declared.lse_base == "2":
                    x = x * math.log(2.0)
                if declared.empty_lse == "-inf":
                    x = x.masked_fill(x == -math.inf, math.inf)
            elif name == "max_logits" and declared.max_logits_base == "2":
                x = x * math.log(2.0)
        converted.append(x)
    return (*converted, *result[len(converted):])


def converting(fn: Callable, returns: Sequence[str], declared: Declared) -> Callable:
    """`fn` with its results converted (`to_reference`)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return to_reference(fn(*args, **kwargs), returns, declared)

    return call


def apply(subject, op: str, declared: Declared):
    """`subject` (equivalence.subject.Subject) of `op` with each user's callable among it that
    returns an LSE converted; ValueError when none does (a declaration that would change nothing)."""
    if declared == Declared():
        return subject
    op_returns = RETURNS.get(op)
    fn, overrides = subject.fn, dict(subject.overrides)
    if fn is not None and op_returns and any(":" in s for s in subject.specs):
        fn = converting(fn, op_returns, declared)
    for stage, impl in overrides.items():
        if ":" in impl.name and stage in RETURNS:
            overrides[stage] = replace(impl, fn=converting(impl.fn, RETURNS[stage], declared))
    if fn is subject.fn and overrides == subject.overrides:
        raise ValueError(f"--convention {' '.join(declared.declarations())}: declares the conventions of a user's "
                         f"--impl [STAGE=]MODULE:CALLABLE of {', '.join(RETURNS)} (kernels that return an LSE); "
                         "registered implementations follow the reference's")
    return replace(subject, fn=fn, overrides=overrides, conventions=declared.declarations())
