"""Test inputs drawn through the op specs (equivalence.ops): one place that builds a spec's
inputs from its params (validated as a case file is), so the tests and the CLI exercise the same cases."""

from __future__ import annotations

from typing import Any


def spec_inputs(op: str, seed: int, device: str = "cpu", **params: Any) -> dict[str, Any]:
    """The keyword arguments `op`'s spec builds from `params` (its params dataclass's fields) and `seed`."""
    from mla_verify.equivalence import catalog

    spec = catalog.get_spec(op)
    spec.validate(params)
    return spec.inputs(spec.params_of(params), seed, device)
