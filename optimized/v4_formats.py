"""DeepSeek V4 / V4.1 cache rows and pages, as the optimized side reads and writes them.

(`reference/` writes the same facts down independently, on purpose.)

A token's latent is 512 dims (448 NoPE then 64 RoPE; V is all 512). Its row is D data bytes and
S scale bytes:
    V4       D 576: 448 e4m3 (dims 0..447) + 64 bf16 (dims 448..511);  S 8: 7 ue8m0, tile 64, pad 0
    V4.1     D 512: 512 e4m3;                                            S 16: ue8m0, tile 32
    V4.1 FP4 D 256: 512 e2m1, dim d in byte d // 2 (even d low nibble);  S 32: e4m3, tile 16
ue8m0 byte e is 2^(e - 127) (255: NaN). A cache is [num_blocks, block_size, D + S] uint8, block b
at byte b * stride(0); block-major pages keep all block_size data rows, then the scale rows
(data of offset o at o * D, scales at block_size * D + o * S); per-token pages keep row o at
o * (D + S), data then scales.
"""

from __future__ import annotations

from typing import NamedTuple

D_QK = 512
D_V = 512


class CacheFormat(NamedTuple):
    name: str
    code: int          # the kernels' FMT switch: 0 V4, 1 V4.1 FP8, 2 V4.1 FP4
    data_bytes: int
    scale_bytes: int
    block_major: bool
    pad_to: int        # allocation pads a block-major block to a multiple of this

    @property
    def width(self) -> int:
        return self.data_bytes + self.scale_bytes


V4 = CacheFormat("V4", 0, 576, 8, True, 576)
V41 = CacheFormat("V41", 1, 512, 16, False, 1)
V41_FP4 = CacheFormat("V41_FP4", 2, 256, 32, False, 1)
V41_BLOCK = CacheFormat("V41_BLOCK", 1, 512, 16, True, 512)
V41_FP4_BLOCK = CacheFormat("V41_FP4_BLOCK", 2, 256, 32, True, 512)
FORMATS = {f.name: f for f in (V4, V41, V41_FP4, V41_BLOCK, V41_FP4_BLOCK)}
# A cache's width names its format when none is given (FlashMLA detects it so); the legacy
# block-major V4.1 layouts are named explicitly.
BY_WIDTH = {V4.width: V4, V41.width: V41, V41_FP4.width: V41_FP4}
