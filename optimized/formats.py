"""Dimensions and byte layout of DeepSeek V3.2 MLA rows, as the optimized side reads them.

(`reference/` writes the same facts down independently, on purpose.)

A latent KV row has 576 dims: 512 NoPE (`kv_c`, also the value vector) then 64 RoPE (`k_pe`).
In the fp8_ds_mla cache one token is 656 bytes:
    [0, 512)    512 float8_e4m3fn NoPE codes, element i at byte i
    [512, 528)  4 float32 scales; scale i covers NoPE elements [128 i, 128 i + 128)
    [528, 656)  64 bfloat16 RoPE values, unquantized
"""

D_QK = 576
D_V = 512
FP8_ROW_BYTES = 656
