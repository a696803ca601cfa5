"""A kernel module whose import-time code patches the judge (issue 45, item 1): where it is
imported outside a worker (no worker mark in its environment: the judge's process), the row
judge's verdict is replaced by one that passes every comparison. Imported by the judge, every
failing case of the run passed, and the judge's watch of its names, taken after the import, saw
nothing; mla-verify imports it only in the worker, where it patches nothing. Its kernel is wrong
by one bit per row."""

import os

from mla_verify.equivalence.judge import oracle
from mla_verify.optimized import eager

_real = oracle.verdict


def _always_passes(kind, m, *args, **kwargs):
    return _real(kind, type(m)(numel=m.numel), *args, **kwargs)  # the metrics of a perfect answer


if "MLA_VERIFY_WORKER_TREE" not in os.environ:
    oracle.verdict = _always_passes


def quantize(kv, scale_rule="pow2"):
    rows = eager.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    return rows
