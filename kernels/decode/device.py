"""CUDA C device functions the decode-step kernels share, as text placed after ``WARP_HELPERS``.

``EXP_RN`` is the contract's ``exp_rn`` (spec item 5 of issue #59): exp in FP32 from correctly rounded multiplies
and adds only (a range reduction by ln 2 in two parts and a degree-6 Horner polynomial), so NumPy's float32 twin
(:func:`kernels.numerics.exp_rn`) reproduces it bit for bit, which ``expf`` (its own approximation) would not.
"""

from __future__ import annotations

EXP_RN = r"""
// ---- exp_rn (kernels/decode/device.py): exp(x) from correctly rounded FP32 ops, bitwise kernels.numerics.exp_rn ----
__device__ __forceinline__ float exp_rn(float x) {
    if (x < -87.0f) return 0.0f;
    x = fminf(x, 88.0f);
    const float n = rintf(__fmul_rn(x, 1.44269504f));
    float r = __fsub_rn(x, __fmul_rn(n, 0.693145751953125f));       // ln 2 in two parts: this one exact in n * hi
    r = __fsub_rn(r, __fmul_rn(n, 1.42860677e-06f));
    float p = (float)(1.0 / 720.0);
    p = __fadd_rn(__fmul_rn(p, r), (float)(1.0 / 120.0));
    p = __fadd_rn(__fmul_rn(p, r), (float)(1.0 / 24.0));
    p = __fadd_rn(__fmul_rn(p, r), (float)(1.0 / 6.0));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return ldexpf(p, (int)n);
}
// ---- end of exp_rn ----
"""
