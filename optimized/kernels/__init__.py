"""Our Triton kernels. Each runs compiled on a GPU and, on CPU, under `TRITON_INTERPRET=1`."""

import os
import warnings


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_loop_bounds() -> None:
    """Let the interpreter take a tensor as a `range` bound under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with `int(array)`, which
    numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
    triton-lang/triton#9171, fixed after triton 3.6). Without this, every kernel whose loop runs
    to a run-time bound (a top-k length, a split's range) fails on CPU while it runs on a GPU.
    """
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "fixes_loop_bounds", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.fixes_loop_bounds = True
    interpreter._patch_lang_tensor = patched


def _quiet_interpreter_arithmetic() -> None:
    """The interpreter runs a kernel's arithmetic in numpy, which warns where IEEE gives the answer
    the kernels mean and compiled code gives silently: log(0) = -inf for an empty row's LSE,
    -inf - -inf = NaN in lanes masked out before they are stored. Those warnings say nothing
    about a kernel; a wrong value shows in its outputs."""
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")


if interpreting():
    _fix_interpreter_loop_bounds()
    _quiet_interpreter_arithmetic()
