"""Kernels that behave one way where the judge would import them and another in the worker
(issue 45, items 2 and 6): each is right, and misbehaves only where the harness's worker mark is in
its environment. The judge reads their module as source and never runs it."""

import os

from mla_verify.optimized import eager

IN_A_WORKER = "MLA_VERIFY_WORKER_TREE" in os.environ


def quantize(kv, scale_rule="pow2"):
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def declares_only_in_the_worker(kv, scale_rule="pow2"):
    """Declares a deviation in the worker only, where the judge would take the bounds it chose."""
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def declares_in_its_source(kv, scale_rule="pow2"):
    """Declares a deviation as a literal of its module's source, which the judge reads."""
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


declares_in_its_source.__mla_verify_deviations__ = ("bf16_dequant",)

if IN_A_WORKER:
    declares_only_in_the_worker.__mla_verify_deviations__ = ("bf16_cache_scale",)


class _SignatureRaises:
    """A callable whose signature raises where the harness reads it."""

    @property
    def __signature__(self):
        raise RuntimeError("the signature of a kernel that raises")

    def __call__(self, kv, scale_rule="pow2"):
        return eager.quantize_fp8_ds_mla(kv, scale_rule)


class _DeviationsRaise:
    """A callable whose declared deviations raise where the harness reads them."""

    @property
    def __mla_verify_deviations__(self):
        raise RuntimeError("the deviations of a kernel that raises")

    def __call__(self, kv, scale_rule="pow2"):
        return eager.quantize_fp8_ds_mla(kv, scale_rule)


signature_raises = _SignatureRaises()
deviations_raise = _DeviationsRaise()
