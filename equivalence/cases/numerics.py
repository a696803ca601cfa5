"""What the tolerance policy reads of a case: the fields its bounds and the deviations' `applies`
depend on (`Params.numerics` fills it from the case's fields of these names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Numerics:
    """What the policy reads of a case: what its bounds and the deviations' `applies` depend on
    (`Params.numerics` fills it from the case's fields of these names)."""

    cache_dtype: str = "fp8_ds_mla"   # the attention ops without the field read fp8_ds_mla pages (decode) or bf16 rows
    scale_rule: str = "pow2"          # fp8_ds_mla tile scales: powers of two (exact) or raw amax / 448
    dcp_size: int = 1                 # ranks whose partials a DCP output merges
    combine: str = "merge"            # how they are merged (dcp_roundings)

    def replace(self, **changes) -> "Numerics":
        return dataclasses.replace(self, **changes)
