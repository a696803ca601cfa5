"""Upstream kernels' native signatures wrapped into mla-verify's contract, under their public name.

The adapters live with the kernels (`optimized/adapters.py`): the project's own FlashMLA
implementations go through them as a user's FlashMLA build does, and the optimized side imports
nothing of the harness. `from mla_verify import adapters` is the name users and error messages give.
"""

from mla_verify.optimized.adapters import *  # noqa: F401,F403 - the public face of the module
from mla_verify.optimized.adapters import __all__, __doc__ as _doc  # noqa: F401

__doc__ = _doc
