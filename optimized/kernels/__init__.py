"""Our Triton kernels. Each runs compiled on a GPU and, on CPU, under `TRITON_INTERPRET=1`."""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
