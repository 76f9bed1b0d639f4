"""Weight quantization on the device: the host quantizers as CUDA kernels, bitwise the same, so weights already on the
GPU (the bench's rotated copies) are quantized where they live instead of through the host.

``quantize_fp8_block128`` (``kernels.formats.quantize_blocks``: scale = amax / 448 in FP32, a zero block's scale 1,
values = w / scale rounded to the nearest e4m3fn, ties to even, saturating at +-448): block (b_c, b_r, e) of 128
threads owns one 128 x 128 block of one expert's matrix: thread j walks column j of it for the amax, the block reduces
the 128 maxima in shared memory, then every thread writes its column's values. A matrix is ``rows`` x ``cols`` at
``w + e * expert_stride + row0 * cols``; w13's gate and up halves are two calls.

``quantize_fp4`` (``kernels.formats_fp4.quantize_mx`` / ``quantize_nv``): a thread per scale block of a row (32 or 16
values), its amax, its scale byte (e8m0: floor(log2 amax) - 2 by frexpf; e4m3: amax / 6 / global rounded by the
hardware's e4m3 conversion) and its packed e2m1 codes (the host's round-half-even on the binade's step); nvfp4's
global scale per expert (amax / 2688) from the bf16 bits' maximum magnitude, in CuPy, first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, get_kernel, launch_ex
from kernels.device_helpers import FP8_HELPERS, WARP_HELPERS

QUANTIZE = "quantize_fp8_block128"

E4M3_ENCODE = r"""
#ifdef WD_HOST_EMULATION
// the g++ emulation: the nearest e4m3fn code (ties to the even code), saturating at +-448
inline unsigned e4m3_encode(float v) {
    const unsigned sign = v < 0.0f ? 0x80u : 0u;
    const float a = fminf(fabsf(v), 448.0f);
    unsigned best = 0;
    float best_err = 1e30f;
    for (unsigned code = 0; code < 0x7Fu; ++code) {               // 0x7F is NaN
        const int exp = (int)(code >> 3), man = (int)(code & 7u);
        const float value = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.0f + man / 8.0f, exp - 7);
        const float err = fabsf(value - a);
        if (err < best_err || (err == best_err && (code & 1u) == 0u)) { best = code; best_err = err; }
    }
    return sign | best;
}
#endif
__device__ __forceinline__ unsigned char to_e4m3(float v) {
#ifdef WD_HOST_EMULATION
    return (unsigned char)e4m3_encode(v);
#else
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));  // v in the low byte
    return (unsigned char)(pair & 0xFFu);
#endif
}

"""
CODE = WARP_HELPERS + E4M3_ENCODE + r"""
extern "C" __global__ void __launch_bounds__(128) quantize_fp8_block128(
    const bf16_t* __restrict__ w,             // [E, ...] bf16: the matrix at w + e * expert_stride + row0 * cols
    long long expert_stride, int row0, int rows, int cols,
    unsigned char* __restrict__ values,       // same layout as w
    float* __restrict__ scales,               // the matrix's scales at scales + e * scale_stride + scale_row0 * cb
    long long scale_stride, int scale_row0)
{
#ifdef WD_HOST_EMULATION
    float* amax_of = reinterpret_cast<float*>(q_shared);
#else
    __shared__ float amax_of[128];
#endif
    const int j = threadIdx.x;
    const int c = blockIdx.x * 128 + j, r_begin = blockIdx.y * 128, e = blockIdx.z;
    const int r_end = min(rows, r_begin + 128);
    const int cb = (cols + 127) / 128;
    const long long base = (long long)e * expert_stride + (long long)row0 * cols;
    float amax = 0.0f;
    if (c < cols)
        for (int r = r_begin; r < r_end; ++r) amax = fmaxf(amax, fabsf(bf16_lo(w[base + (long long)r * cols + c])));
    amax_of[j] = amax;
    __syncthreads();
    for (int half = 64; half > 0; half >>= 1) {
        if (j < half) amax_of[j] = fmaxf(amax_of[j], amax_of[j + half]);
        __syncthreads();
    }
    const float block_amax = amax_of[0];
    const float scale = block_amax > 0.0f ? block_amax / 448.0f : 1.0f;   // IEEE division (no fast-math)
    if (j == 0) scales[(long long)e * scale_stride + (long long)(scale_row0 + blockIdx.y) * cb + blockIdx.x] = scale;
    if (c < cols)
        for (int r = r_begin; r < r_end; ++r) {
            const long long at = base + (long long)r * cols + c;
            values[at] = to_e4m3(bf16_lo(w[at]) / scale);
        }
}
"""

CODE_FP4 = r"""
// the nearest e2m1 code of x (ties to the even code, |x| > 6 saturating to +-6), the sign kept (a negative rounding to
// zero is -0: code 8): kernels/formats_fp4.py e2m1_codes, step by step
__device__ __forceinline__ unsigned e2m1_code(float x) {
    const float a = fabsf(x);
    const float step = a < 2.0f ? 0.5f : a < 4.0f ? 1.0f : 2.0f;
    const float q = fminf(rintf(a / step) * step, 6.0f);            // a / step: a power-of-two division, exact
    const unsigned code = (unsigned)(q < 2.0f ? q * 2.0f : q < 4.0f ? q + 2.0f : q / 2.0f + 4.0f);
    return code | (signbit(x) ? 8u : 0u);
}

// thread id: scale block b of row r of expert e of a matrix [E, R, k] (bf16): its `block` values (the last block of a
// row: the rest), packed two a byte into values [E, R, k/2], its scale byte into scales [E, R, ceil(k / block)];
// nv: an e4m3 block scale under the expert's global scale globals[e] (else e8m0, globals unread)
extern "C" __global__ void __launch_bounds__(128) quantize_fp4(
    const bf16_t* __restrict__ w, int experts, int rows, int k, int block, int nv,
    const float* __restrict__ globals, unsigned char* __restrict__ values, unsigned char* __restrict__ scales)
{
    const long long id = (long long)blockIdx.x * 128 + threadIdx.x;   // 128 threads a block
    const int nb = (k + block - 1) / block;
    if (id >= (long long)experts * rows * nb) return;
    const int b = (int)(id % nb);
    const long long row = id / nb;                                   // e * rows + r
    const bf16_t* src = w + row * k + (long long)b * block;
    const int n = min(block, k - b * block);
    float amax = 0.0f;
    for (int j = 0; j < n; ++j) amax = fmaxf(amax, fabsf(bf16_lo(src[j])));
    unsigned char scale_byte;
    float divisor = 1.0f;                                            // nv: x / divisor
    int shared = -127;                                               // mx: x / 2^shared
    if (nv) {
        const float global = globals[row / rows];
        scale_byte = to_e4m3(fminf(amax / 6.0f / global, 448.0f));  // IEEE divisions (no fast-math)
        float lo, hi;
        e4m3x2_to_f32(scale_byte, lo, hi);
        divisor = lo * global;
    } else {
        int exponent;
        (void)frexpf(amax, &exponent);                              // amax = f x 2^exponent, f in [0.5, 1)
        if (amax > 0.0f) shared = exponent - 1 - 2;                 // floor(log2 amax) - e2m1's emax, ...
        shared = shared < -127 ? -127 : shared > 127 ? 127 : shared;  // ... within e8m0's range
        scale_byte = (unsigned char)(shared + 127);
    }
    unsigned char* out = values + row * (k / 2) + (long long)b * block / 2;
    for (int j = 0; j < n; j += 2) {
        unsigned codes[2];
        for (int h = 0; h < 2; ++h) {
            const float x = bf16_lo(src[j + h]);
            const float scaled = nv ? (divisor > 0.0f ? x / divisor : 0.0f) : ldexpf(x, -shared);
            codes[h] = e2m1_code(scaled);
        }
        out[j / 2] = (unsigned char)(codes[0] | (codes[1] << 4));
    }
    scales[row * nb + b] = scale_byte;
}
"""
QUANTIZE_FP4 = "quantize_fp4"
SOURCE = CudaSource(name="quantize_fp8", code=CODE, kernels=(QUANTIZE,), defaults={},
                    description="fp8-block128 quantization of bf16 weights on the device")
SOURCE_FP4 = CudaSource(name="quantize_fp4", code=WARP_HELPERS + FP8_HELPERS + E4M3_ENCODE + CODE_FP4,
                        kernels=(QUANTIZE_FP4,), defaults={},
                        description="mxfp4 / nvfp4 quantization of bf16 weights on the device")


def quantize_matrix(w: Any, name: str) -> tuple[Any, Any]:
    """``(values uint8, scales float32)`` of a CuPy bf16 ``w`` [E, R, C] in fp8-block128 (w13: gate and up blocked
    apart), bitwise what :meth:`kernels.formats.Fp8Block128.quantize` gives on the host."""
    import cupy

    experts, rows, cols = (int(d) for d in w.shape)
    w = cupy.ascontiguousarray(w)
    halves = ((0, rows // 2), (rows // 2, rows - rows // 2)) if name == "w13" else ((0, rows),)
    cb = -(-cols // 128)
    scale_rows = sum(-(-n // 128) for _, n in halves)
    values = cupy.empty((experts, rows, cols), dtype=cupy.uint8)
    scales = cupy.empty((experts, scale_rows, cb), dtype=cupy.float32)
    kernel = get_kernel(SOURCE, QUANTIZE)
    scale_row0 = 0
    for row0, n in halves:
        launch_ex(kernel, (cb, -(-n // 128), experts), (128,),
                  (w, np.int64(rows * cols), np.int32(row0), np.int32(n), np.int32(cols), values,
                   scales, np.int64(scale_rows * cb), np.int32(scale_row0)))
        scale_row0 += -(-n // 128)
    return values, scales


def quantize_fp4_matrix(w: Any, block: int, nv: bool) -> tuple[Any, Any, Any]:
    """``(values uint8 [E, R, k/2], scales uint8 [E, R, ceil(k/block)], global scales float32 [E] or None)`` of a
    CuPy bf16 ``w`` [E, R, k] in mxfp4 (``block`` 32) or nvfp4 (16, ``nv``), bitwise what
    :func:`kernels.formats_fp4.quantize_expert` gives on the host for each expert."""
    import cupy

    experts, rows, k = (int(d) for d in w.shape)
    w = cupy.ascontiguousarray(w)
    globals_ = None
    if nv:  # amax / (448 x 6) per expert (a matrix of zeros: 1), from the largest bf16 magnitude's bits
        bits = (w.view(cupy.uint16) & cupy.uint16(0x7FFF)).reshape(experts, -1).max(axis=1).astype(cupy.uint32)
        amax = (bits << cupy.uint32(16)).view(cupy.float32)
        globals_ = cupy.where(amax > 0, amax / cupy.float32(448.0 * 6.0), cupy.float32(1.0)).astype(cupy.float32)
    nb = -(-k // block)
    values = cupy.empty((experts, rows, k // 2), dtype=cupy.uint8)
    scales = cupy.empty((experts, rows, nb), dtype=cupy.uint8)
    threads = experts * rows * nb
    launch_ex(get_kernel(SOURCE_FP4, QUANTIZE_FP4), (-(-threads // 128),), (128,),
              (w, np.int32(experts), np.int32(rows), np.int32(k), np.int32(block), np.int32(int(nv)),
               globals_ if globals_ is not None else np.uint64(0), values, scales))
    return values, scales, globals_
