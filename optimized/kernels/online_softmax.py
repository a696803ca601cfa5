"""The attention step shared by the sparse prefill and decode kernels, as Triton device functions.

One program owns a block of query heads of one query token and walks that token's top-k list a
block of gathered KV rows at a time (FlashAttention's online softmax, written the way FlashMLA's
SM90 kernels do it):

    s_j   = <q, K_j>                                  raw scores, fp32 accumulate of bf16 products
    m     = max_j s_j                                 running max of the RAW scores
    p_j   = 2^(s_j*c - m*c),  c = sm_scale*log2(e)    the max element gives exactly 2^0 = 1
    l     = sum_j p_j                                 from the unrounded p
    acc   = sum_j bf16(p_j) V_j                       P is rounded to bf16 for the tensor-core dot
    lse   = m*sm_scale + ln(l),   max_logit = m*sm_scale
    out   = acc / l * sigmoid(lse - sink)            = softmax @ V * 1/(1+e^(sink-lse))

Taking the max on raw scores and scaling after is only right for sm_scale > 0 (callers validate).
Invalid columns are -inf scores over zero-filled rows (masked loads, so a NaN in an unreferenced
row never enters). A row with no valid column keeps l == 0 and comes out as out 0, lse +inf,
max_logit -inf.

`NATIVE` selects bf16 tensor-core dots on a GPU; under the CPU interpreter (whose bf16 dot is
wrong) the same bf16 values are widened exactly (subnormals too) and multiplied as fp32, which is
exact for bf16 products.
"""

import triton
import triton.language as tl

from mla_verify.optimized.kernels.bits import bf16_to_f32, to_bf16

LOG2E = tl.constexpr(1.4426950408889634)
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _dot(a, b, acc, NATIVE: tl.constexpr):
    """acc + a @ b for bf16 a, b with fp32 accumulation."""
    if NATIVE:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(bf16_to_f32(a, NATIVE), bf16_to_f32(b, NATIVE), acc, input_precision="ieee")


@triton.jit
def attend_block(q_nope, q_rope, k_nope, k_rope, valid, m, l, acc, scale_log2e, NATIVE: tl.constexpr):
    """Fold one block of gathered rows into the running (m, l, acc) of a block of heads.

    q_nope [BH, 512], q_rope [BH, 64], k_nope [BN, 512], k_rope [BN, 64] (bf16; invalid rows zero),
    valid [BN], m/l [BH] fp32, acc [BH, 512] fp32. V is k_nope: the first 512 dims of each row.
    """
    zero = tl.zeros((q_nope.shape[0], k_nope.shape[0]), dtype=tl.float32)
    s = _dot(q_rope, tl.trans(k_rope), _dot(q_nope, tl.trans(k_nope), zero, NATIVE), NATIVE)
    s = tl.where(valid[None, :], s, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, 1))
    # While every column so far was invalid m_new is -inf; any finite reference keeps p at 0.
    ref = tl.where(m_new == NEG_INF, 0.0, m_new) * scale_log2e
    alpha = tl.math.exp2(m * scale_log2e - ref)
    p = tl.math.exp2(s * scale_log2e - ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = _dot(to_bf16(p, NATIVE), k_nope, acc * alpha[:, None], NATIVE)
    return m_new, l, acc


@triton.jit
def attend_rows(q, k, valid, m, l, acc, scale_log2e, NATIVE: tl.constexpr):
    """`attend_block` for rows that are both key and value (DeepSeek V4: d_qk = d_v = 512):
    q [BH, D], k [BN, D] bf16 (invalid rows zero), valid [BN]; acc [BH, D]."""
    s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32), NATIVE)
    s = tl.where(valid[None, :], s, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, 1))
    ref = tl.where(m_new == NEG_INF, 0.0, m_new) * scale_log2e
    alpha = tl.math.exp2(m * scale_log2e - ref)
    p = tl.math.exp2(s * scale_log2e - ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = _dot(to_bf16(p, NATIVE), k, acc * alpha[:, None], NATIVE)
    return m_new, l, acc


@triton.jit
def finish(m, l, sm_scale, sink):
    """-> (lse, max_logit, scale): out = acc * scale. Empty rows: +inf, -inf, 0.

    `sink` is the per-head attention-sink logit (-inf for none): it joins the normaliser as one
    more logit whose value vector is zero, so scale = sigmoid(lse - sink) / l, which shrinks out
    and leaves lse alone. The sigmoid is evaluated on the side where e^(-|x|) cannot overflow:
    `1/(l + e^(sink - m))` would turn a sink 90 above the logits into an exact 0 where the true
    factor is still a normal fp32 number.
    """
    nonempty = l > 0.0
    # Empty rows take placeholder values (m 0, l 1) so no inf - inf or log(0) is ever evaluated.
    m_nat = tl.where(nonempty, m, 0.0) * sm_scale
    l_safe = tl.where(nonempty, l, 1.0)
    lse = m_nat + tl.log(l_safe)
    x = lse - sink
    e = tl.math.exp2(-tl.abs(x) * LOG2E)
    sigmoid = tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
    scale = tl.where(nonempty, sigmoid / l_safe, 0.0)
    return tl.where(nonempty, lse, float("inf")), tl.where(nonempty, m_nat, NEG_INF), scale
