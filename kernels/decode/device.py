"""CUDA C device code the decode-step kernels share (prepended as text after ``WARP_HELPERS``).

``EXP_RN``: ``exp_rn(x)``, an FP32 exp from correctly rounded multiplies and adds only, so that NumPy float32
(:func:`kernels.numerics.exp_rn`) reproduces it bit for bit; the router's and the attention's softmax use it.
``NORM_HELPERS``: the RMSNorm pieces of the order contract (the lane chain's sum of squares of a bf16 row, the
reciprocal RMS, the normalized bf16 chunk, the bf16 residual sum), twins of :func:`kernels.numerics.rms_norm_chain`.
"""

from __future__ import annotations

import numpy as np

from kernels.numerics import EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_POLY


def _f32(value: np.float32) -> str:
    """A float32 constant as an exact C hex-float literal (no decimal round trip)."""
    return float(value).hex() + "f"


_C = [_f32(c) for c in EXP_POLY]

EXP_RN = rf"""
// ---- exp_rn (kernels/decode/device.py): FP32 exp from __fmul_rn / __fadd_rn only, bitwise kernels.numerics.exp_rn
#ifndef DECODE_EXP_RN
#define DECODE_EXP_RN
__device__ __forceinline__ float exp_rn(float x) {{
    if (x < -87.0f) return 0.0f;
    x = x > 88.0f ? 88.0f : x;  // not fminf: a NaN stays NaN (a NaN score must not turn into a weight)
    const float n = rintf(__fmul_rn(x, {_f32(EXP_LOG2E)}));
    float r = __fsub_rn(x, __fmul_rn(n, {_f32(EXP_LN2_HI)}));
    r = __fsub_rn(r, __fmul_rn(n, {_f32(EXP_LN2_LO)}));
    float p = {_C[0]};
    p = __fadd_rn(__fmul_rn(p, r), {_C[1]});
    p = __fadd_rn(__fmul_rn(p, r), {_C[2]});
    p = __fadd_rn(__fmul_rn(p, r), {_C[3]});
    p = __fadd_rn(__fmul_rn(p, r), {_C[4]});
    p = __fadd_rn(__fmul_rn(p, r), {_C[5]});
    p = __fadd_rn(__fmul_rn(p, r), {_C[6]});
    return ldexpf(p, (int)n);
}}
#endif
"""

NORM_HELPERS = r"""
// ---- RMSNorm helpers (kernels/decode/device.py): the order contract's item 2, bitwise kernels.numerics ----
#ifndef DECODE_NORM_HELPERS
#define DECODE_NORM_HELPERS
// the 8 bf16 of chunk a + chunk b, each rounded once: bf16(__fadd_rn(a[i], b[i]))
__device__ __forceinline__ uint4 bf16x8_add(const uint4& a, const uint4& b) {
    u32 out[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 x = word(a, j), y = word(b, j);
        out[j] = (u32)f32_to_bf16(__fadd_rn(bf16_lo(x), bf16_lo(y)))
               | ((u32)f32_to_bf16(__fadd_rn(bf16_hi(x), bf16_hi(y))) << 16);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}
// acc = fmaf(v[i], v[i], acc) over the chunk's 8 values in order (one lane's share of dot_chain(x, x))
__device__ __forceinline__ float bf16x8_sumsq(const uint4& v, float acc) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 x = word(v, j);
        acc = fmaf(bf16_lo(x), bf16_lo(x), acc);
        acc = fmaf(bf16_hi(x), bf16_hi(x), acc);
    }
    return acc;
}
// rs = 1 / sqrt(ss / K + eps) (IEEE division and square root)
__device__ __forceinline__ float rms_scale(float ss, int k, float eps) {
    return 1.0f / sqrtf(__fadd_rn(ss / (float)k, eps));
}
// xn[i] = bf16((x[i] * rs) * g[i]) for the chunk's 8 values
__device__ __forceinline__ uint4 bf16x8_norm(const uint4& x, float rs, const uint4& g) {
    u32 out[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 a = word(x, j), b = word(g, j);
        out[j] = (u32)f32_to_bf16(__fmul_rn(__fmul_rn(bf16_lo(a), rs), bf16_lo(b)))
               | ((u32)f32_to_bf16(__fmul_rn(__fmul_rn(bf16_hi(a), rs), bf16_hi(b))) << 16);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}
#endif
"""
