"""property:stress needs a CUDA device (its GPU run: tests/test_properties.py's GPU tests, the GPU
lane); here what a CPU can hold of it: it says why it does not run, and its interleaving."""

import pytest

from mla_verify.equivalence.catalog import get_spec
from mla_verify.equivalence.properties.stress import RUNS, interleaving
from mla_verify.equivalence.errors import UsageError


def test_stress_is_skipped_on_cpu_with_its_reason():
    spec = get_spec("property:stress")
    assert spec.subjects("cpu") == {}
    assert "runs on a CUDA device only" in spec.facts("cpu")[-1]
    with pytest.raises(UsageError, match="CUDA device only, not cpu"):
        spec.subject([], "cpu")


def test_the_interleaving_is_the_seeds_and_calls_each_problem_runs_times():
    order = interleaving(5)
    assert order == interleaving(5) and order != interleaving(6)
    assert order.count(0) == order.count(1) == RUNS and order != sorted(order)
