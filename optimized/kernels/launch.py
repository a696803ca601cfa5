"""What every kernel entry point decides before a launch: can it run here, which conversions, how
many rows a program takes."""

from __future__ import annotations

import torch

from mla_verify.optimized.kernels import interpreting
from mla_verify.optimized.validation import InputError


def check_launchable(device: torch.device) -> None:
    """CPU tensors run only under the interpreter: say so instead of letting Triton fail obscurely."""
    if device.type == "cpu" and not interpreting():
        raise InputError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
        )


def native(device: torch.device) -> bool:
    """The NATIVE constexpr for a launch on `device`: hardware conversions unless interpreting."""
    check_launchable(device)
    return not interpreting()


def rows_per_program() -> int:
    """Rows of a row-wise kernel that one program converts.

    A few rows keep a GPU program's registers small while its loads stay coalesced; the
    interpreter pays a fixed cost per program, so it takes bigger tiles (the bits are the same).
    """
    return 32 if interpreting() else 4
