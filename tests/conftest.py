"""Test-session setup: Triton's interpreter on CPU-only machines, Hypothesis profiles, GPU skips."""

import os

import pytest
import torch

# Triton reads this when kernels are decorated, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=20, **_COMMON)
settings.register_profile("dev", max_examples=40, **_COMMON)
settings.register_profile("nightly", max_examples=400, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_report_header(config):
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (Triton interpreter)"
    return [f"torch {torch.__version__}; GPU: {device}; hypothesis profile: {settings._current_profile}"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none present (run the GPU lane, docs/gpu.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    from tests.test_zoo import zoo_summary

    for line in zoo_summary():
        terminalreporter.write_line(line)
