"""mla-verify: reference-vs-optimized verification of DeepSeek-style sparse MLA attention.

The Python API (`mla_verify.api`; the CLI is a thin layer over it):

    import mla_verify

    result = mla_verify.check("sparse_decode_fp8", "mykernels.decode:sparse_decode", examples=50)
    mla_verify.assert_equivalent("sparse_prefill", my_prefill, examples=20, seed=1)
    mla_verify.replay("runs/fuzz-.../failures/....json", my_prefill)
    mla_verify.property_check("split_invariance", {"sparse_decode_fp8": my_decode})
    mla_verify.strategies.cases("sparse_prefill", profile="ci")   # a Hypothesis strategy of Cases

Inside pytest, `--mla-verify-profile`, `--mla-verify-examples` and `--mla-verify-device` set the
defaults of these calls (`mla_verify.pytest_plugin`).
"""

import importlib as _importlib
from pathlib import Path as _Path

# Installed, the design's top-level folders (reference/, optimized/, equivalence/, fuzz/, reports/)
# are mapped under this package by pyproject.toml. Run from a source checkout on PYTHONPATH (the GPU
# lane, where nothing is installed), the same folders are found beside this one.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "reference" / "__init__.py").is_file():
    __path__.append(str(_checkout))

__all__ = ["CheckResult", "Failure", "HarnessError", "UsageError", "Unsupported", "__version__", "assert_equivalent",
           "check", "drift", "gate", "history", "property_check", "replay", "strategies", "unsupported"]


def _version() -> str:
    """The installed distribution's version; in a source checkout on PYTHONPATH, pyproject's."""
    from importlib import metadata

    try:
        return metadata.version("mla-verify")
    except metadata.PackageNotFoundError:
        import tomllib

        return tomllib.loads((_checkout / "pyproject.toml").read_text())["project"]["version"]


def __getattr__(name: str):
    # Loaded on first use: `import mla_verify` (and `mla-verify --help`) stays light.
    if name not in __all__:
        raise AttributeError(f"module 'mla_verify' has no attribute {name!r}")
    if name == "__version__":
        return _version()
    module = _importlib.import_module(f"{__name__}.{'strategies' if name == 'strategies' else 'api'}")
    return module if name == "strategies" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
