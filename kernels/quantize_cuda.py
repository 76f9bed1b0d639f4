"""fp8-block128 quantization on the device: the host quantizer (``kernels.formats.quantize_blocks``) as one CUDA
kernel, bitwise the same (scale = amax / 448 in FP32, a zero block's scale 1, values = w / scale rounded to the
nearest e4m3fn, ties to even, saturating at +-448), so weights already on the GPU (the bench's rotated copies) are
quantized where they live instead of through the host.

Block (b_c, b_r, e) of 128 threads owns one 128 x 128 block of one expert's matrix: thread j walks column j of it
for the amax, the block reduces the 128 maxima in shared memory, then every thread writes its column's values.
A matrix is ``rows`` x ``cols`` at ``w + e * expert_stride + row0 * cols``; w13's gate and up halves are two calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, get_kernel, launch_ex
from kernels.device_helpers import WARP_HELPERS

QUANTIZE = "quantize_fp8_block128"

CODE = WARP_HELPERS + r"""
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

SOURCE = CudaSource(name="quantize_fp8", code=CODE, kernels=(QUANTIZE,), defaults={},
                    description="fp8-block128 quantization of bf16 weights on the device")


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
