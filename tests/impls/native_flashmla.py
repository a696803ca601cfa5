"""FlashMLA's own functions through `mla_verify.adapters`, as a kernel developer holding a
flash_mla build would pass them (GPU only: importing flash_mla loads its CUDA extension). The SM90
decode kernel declares its documented deviations the way a user's kernel does."""

import flash_mla

from mla_verify import adapters

sparse_prefill = adapters.flash_mla_sparse_fwd(flash_mla.flash_mla_sparse_fwd, use_legacy=True)
sparse_decode_fp8 = adapters.flash_mla_with_kvcache(flash_mla.flash_mla_with_kvcache, flash_mla.get_mla_metadata,
                                                    use_legacy=True)
sparse_decode_fp8.__mla_verify_deviations__ = ("bf16_cache_scale", "bf16_dequant", "split_kv")
