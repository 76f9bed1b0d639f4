"""CUDA C device code the decode-step kernels share (prepended as text after ``WARP_HELPERS``).

``EXP_RN``: ``exp_rn(x)``, an FP32 exp from correctly rounded multiplies and adds only, so that NumPy float32
(:func:`kernels.numerics.exp_rn`) reproduces it bit for bit; the router's and the attention's softmax use it.
``NORM_HELPERS``: the RMSNorm pieces of the order contract (the lane chain's sum of squares of a bf16 row, the
reciprocal RMS, the normalized bf16 chunk, the bf16 residual sum), twins of :func:`kernels.numerics.rms_norm_chain`.
``GEMV_SHARED``: what the two decode GEMVs share (x loads, the norm prologue, the argmax's block tail).
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

# ``GEMV_SHARED``: the device code both decode GEMVs share (kernels/decode/gemv.py, FMA; gemv_mma.py, tensor cores):
# the x loads, the prologue (the rs pass, a chunk of the row the GEMV multiplies) and the argmax's block tail. Reads
# the macros WARPS, PDL, NORM, ADD.
GEMV_SHARED = r"""
// ==== the decode GEMVs' shared device code (kernels/decode/device.py) ====
#define GEMV_MAX_TOKENS 64
// the argmax epilogue's shared memory: each warp's best value and row per token, set to (-inf, INT_MAX) by the block,
// and the block's ticket (a statement list for the top of a GEMV kernel that has ARGMAX; WARPS: the kernel's)
#define ARGMAX_SHARED                                                                                              \
    __shared__ float warp_best[WARPS][GEMV_MAX_TOKENS];                                                           \
    __shared__ int warp_best_row[WARPS][GEMV_MAX_TOKENS];                                                         \
    __shared__ int last_block;                                                                                    \
    for (int i = threadIdx.x; i < WARPS * GEMV_MAX_TOKENS; i += WARPS * 32) {                                     \
        (&warp_best[0][0])[i] = __int_as_float(0xff800000);   /* -inf */                                          \
        (&warp_best_row[0][0])[i] = 0x7fffffff;                                                                   \
    }
// x chunks the previous kernel may have written: behind the PDL wait (ld_dep), else the read-only path
__device__ __forceinline__ uint4 load_x(const uint4* row, int c, bool ok) {
#if PDL
    return ld_dep_chunk(row, c, ok);
#else
    return ldg_chunk(row, c, ok);
#endif
}

// (value, row) a beats (best, best_row): greater value, or the same value and a lower row (NaN never wins)
__device__ __forceinline__ bool beats(float value, int row, float best, int best_row) {
    return value > best || (value == best && row < best_row);
}

// NORM: warp w writes the rs of token t0 + j to token_rs[j] for j = w, w + WARPS, ... < count (t clamped to T - 1:
// past T, unused): the lane chain of the (summed) row's squares, the butterfly
__device__ __forceinline__ void token_rs_pass(float* token_rs, const bf16_t* x, const bf16_t* add, int t0, int count,
                                              int tokens, int k, float eps, int warp, int lane) {
    const int xchunks = k / 8;
    for (int j = warp; j < count; j += WARPS) {
        const int t = min(t0 + j, tokens - 1);
        const uint4* x_row = reinterpret_cast<const uint4*>(x + (size_t)t * k);
        float ss = 0.0f;
        for (int c = lane; c < xchunks; c += 32) {
            uint4 v = load_x(x_row, c, true);
#if ADD
            v = bf16x8_add(v, load_x(reinterpret_cast<const uint4*>(add + (size_t)t * k), c, true));
#endif
            ss = bf16x8_sumsq(v, ss);
        }
        ss = warp_sum(ss);
        if (lane == 0) token_rs[j] = rms_scale(ss, k, eps);
    }
}

// chunk c of token t's row as the GEMV multiplies it: x (ADD: + add, rounded, written to residual_out where `write`;
// NORM: normalized with rs)
__device__ __forceinline__ uint4 prologue_chunk(const bf16_t* x, const bf16_t* add, const bf16_t* norm,
                                                bf16_t* residual_out, float rs, int t, int c, int k, bool write) {
    uint4 v = load_x(reinterpret_cast<const uint4*>(x + (size_t)t * k), c, true);
#if ADD
    v = bf16x8_add(v, load_x(reinterpret_cast<const uint4*>(add + (size_t)t * k), c, true));
    if (write) reinterpret_cast<uint4*>(residual_out + (size_t)t * k)[c] = v;
#else
    (void)add; (void)residual_out; (void)write;
#endif
#if NORM
    v = bf16x8_norm(v, rs, load_x(reinterpret_cast<const uint4*>(norm), c, true));
#else
    (void)norm; (void)rs;
#endif
    return v;
}

// The argmax's tail: the block's best per token (its warps' bests, warps in order) to the workspace, a ticket, and
// the block with the last ticket reduces every block's candidates (warp w: tokens w, w + WARPS, ...) and resets the
// ticket. Every thread of the block calls it.
__device__ __forceinline__ void argmax_tail(const float (&warp_best)[WARPS][GEMV_MAX_TOKENS],
                                            const int (&warp_best_row)[WARPS][GEMV_MAX_TOKENS], int& last_block,
                                            float* best_values, int* best_rows, unsigned* ticket, int* argmax,
                                            int tokens, int n, int warp, int lane) {
    __syncthreads();
    for (int t = threadIdx.x; t < tokens; t += WARPS * 32) {   // the block's best per token, warps in order
        float best = warp_best[0][t];
        int best_row = warp_best_row[0][t];
        for (int v = 1; v < WARPS; ++v)
            if (beats(warp_best[v][t], warp_best_row[v][t], best, best_row)) {
                best = warp_best[v][t];
                best_row = warp_best_row[v][t];
            }
        best_values[(size_t)t * gridDim.x + blockIdx.x] = best;
        best_rows[(size_t)t * gridDim.x + blockIdx.x] = best_row;
    }
    __threadfence();                                          // this thread's candidates visible device-wide
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned taken = atomicAdd(ticket, 1u);
        last_block = taken == gridDim.x - 1;
        if (last_block) {
            *ticket = 0u;                                     // every block has taken its ticket
            __threadfence();                                  // the others' candidates before the reads below
        }
    }
    __syncthreads();
    if (!last_block) return;
    for (int t = warp; t < tokens; t += WARPS) {
        float best = __int_as_float(0xff800000);
        int best_row = 0x7fffffff;
        for (int b = lane; b < (int)gridDim.x; b += 32) {
            const float v = __ldcg(best_values + (size_t)t * gridDim.x + b);   // L2: not a stale L1 line
            const int row = __ldcg(best_rows + (size_t)t * gridDim.x + b);
            if (beats(v, row, best, best_row)) { best = v; best_row = row; }
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_row = __shfl_xor_sync(FULL_MASK, best_row, offset);
            if (beats(other, other_row, best, best_row)) { best = other; best_row = other_row; }
        }
        if (lane == 0) argmax[t] = best_row < n ? best_row : -1;
    }
}
"""
