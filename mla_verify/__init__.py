"""mla-verify: reference-vs-optimized verification of DeepSeek-style sparse MLA attention."""

from pathlib import Path as _Path

# Installed, the design's top-level folders (reference/, optimized/, equivalence/, fuzz/, reports/)
# are mapped under this package by pyproject.toml. Run from a source checkout on PYTHONPATH (the GPU
# lane, where nothing is installed), the same folders are found beside this one.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "reference" / "__init__.py").is_file():
    __path__.append(str(_checkout))
