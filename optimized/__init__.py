"""The optimized side: real kernels and our own, composed like vLLM's FlashMLA sparse backend.

Importing the package registers every implementation, each with its priority
(`optimized.registry`): flash_mla's kernels first where they exist, then our Triton kernels, then
the float32 eager fallbacks (`optimized.eager`); metadata and spec-decode helpers have one
implementation each. The order of the imports below does not matter. On a CPU the Triton kernels
run interpreted, so there the eager ones are the default and Triton runs by name.
"""

import os

import torch

# Triton picks interpreter or compiler when a kernel is defined: with no GPU only the interpreter
# runs (however this package was reached: the CLI, `mla_verify.check`, a user's import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported to register.
from . import flashmla, flashmla_v4  # noqa: E402,F401
from .kernels import cache_writer, concat, dcp_merge, gather, indices, sparse_decode, sparse_prefill, swap  # noqa: E402,F401
from .kernels import union_decode, v4_cache_writer, v4_indices  # noqa: E402,F401
from . import eager, metadata, spec_decode  # noqa: E402,F401
from . import hisparse, index_group  # noqa: E402,F401
from .pipeline import PipelineResult, forward_mqa, forward_mqa_dcp, needed_stages  # noqa: E402

__all__ = ["PipelineResult", "forward_mqa", "forward_mqa_dcp", "needed_stages"]
