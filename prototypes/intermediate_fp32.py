"""Prototype: warp decode with an FP32 [T, K, I] intermediate instead of the bf16 one (``INTER_F32``).

Hypothesis. The bf16 intermediate is warp decode's only rounding besides the output's. Keeping it in fp32
(``INTER_F32=1``: down reads it with 16-byte loads of 4 floats, two per 16-byte w2 chunk) removes that error at the
price of a 2x bigger intermediate and twice the intermediate load instructions in down. At decode the intermediate
is tiny next to the weights (< 0.05 % of the bytes, and L2-resident), so the cost should be invisible.

Prediction: INTER_F32 1 vs 0 within noise (< 1 %); down 47 -> 59 registers (offline), a second-order occupancy cost;
rel-L2 vs fp64 down by ~sqrt(2) (NumPy: 2.3e-3 -> 1.66e-3, -28 %).

This pair is written for the comparison, with the strict kernel's summation order at ``GU_BYTES=8, DN_SLOTS=1``:
``INTER_F32=0`` is bitwise ``cupy:warp-decode`` built with ``GU_BYTES=8, DN_SLOTS=1, DN_UNROLL=<same>`` (GPU test).
Accuracy rule for INTER_F32=1 (tests/test_prototypes_mapping.py): the harness checks it against
``reference.moe_decode(mode="warp_decode")`` within ``TOLERANCES`` (it differs by about one rounding of the
intermediate); on the GPU it is compared with a NumPy fp32-intermediate reference by the strict kernel's rule and
must be closer to fp64 than INTER_F32=0 on the same problem.

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; no PDL): INTER_F32 0 25.3 /
136.4 / 524.5 us at T = 1 / 8 / 32, INTER_F32 1 25.7 / 140.5 / 543.8 (+1.6 / +3.0 / +3.7 %: down's doubled
intermediate loads and registers, not the bytes -- the time prediction was wrong). rel-L2 vs fp64 2.45e-3 /
2.33e-3 / 2.37e-3 -> 1.67e-3 at every T (-28 to -32 %, as predicted). Full tables: notes/PROTOTYPES.md.

Conclusion: ~30 % lower error vs fp64 for 1.6-3.7 % more time per layer. The library keeps the bf16 intermediate
(faster, and what ``moe_decode(mode="warp_decode")`` and the bitwise tests specify); fp32 is a candidate for an
opt-in accuracy mode, after cutting its cost in down (registers and load instructions), not its bytes.

Results: results/sweep-proto-intermediate-fp32.json.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, launch_ex
from kernels.contract import BF16, Dims
from kernels.device_helpers import WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.variants import register

GATE_UP = "proto_inter_gate_up"
DOWN = "proto_inter_down"

CODE = WARP_HELPERS + r"""
// Warp decode with a selectable intermediate type: INTER_F32 = 0 -> bf16 [T, K, I] (as the strict kernel),
// 1 -> fp32 [T, K, I], never rounded. bf16 is handled as raw 16-bit patterns (no cuda_bf16.h).
// Knobs: GU_WARPS / DN_WARPS warps per block, GU_UNROLL 8-byte chunks per row in flight per lane (gate_up),
// DN_UNROLL 16-byte w2 chunks in flight per lane (down), DN_MIN_BLOCKS __launch_bounds__ min blocks (0 = none).

static_assert(INTER_F32 == 0 || INTER_F32 == 1, "INTER_F32 must be 0 or 1");
static_assert(GU_WARPS >= 1 && GU_WARPS <= 32 && DN_WARPS >= 1 && DN_WARPS <= 32, "WARPS must be 1..32");
static_assert(GU_UNROLL >= 1 && DN_UNROLL >= 1, "UNROLL must be >= 1");

#if INTER_F32
typedef float inter_t;                       // the [T, K, I] intermediate element
#define INTER_WORDS_PER_CHUNK 8              // 8 fp32 per 8-element chunk: two 16-byte loads
#else
typedef bf16_t inter_t;
#define INTER_WORDS_PER_CHUNK 4              // 8 bf16 per 8-element chunk: one 16-byte load
#endif
#define INTER_LOADS (INTER_WORDS_PER_CHUNK / 4)

__device__ __forceinline__ inter_t to_inter(float v) {
#if INTER_F32
    return v;                                                      // no rounding
#else
    return f32_to_bf16(v);                                         // the strict kernel's one bf16 rounding
#endif
}

#if DN_MIN_BLOCKS > 0
#define DN_BOUNDS __launch_bounds__(DN_WARPS * 32, DN_MIN_BLOCKS)
#else
#define DN_BOUNDS __launch_bounds__(DN_WARPS * 32)
#endif

// ------------------------------------------------------------------------------------------------
// gate_up: intermediate[t, k, i] = to_inter(SiLU(w13[e, i, :] . x[t]) * (w13[e, I + i, :] . x[t]))
//   Warp g = blockIdx.x * GU_WARPS + warp-in-block owns ONE output: pair p = g / I (t = p / K, k = p % K)
//   and neuron i = g % I. Lane l loads 8-byte chunks (4 bf16) c = l, l + 32, ... of the gate row, the up
//   row and x[t]; GU_UNROLL chunks per row are in registers before the first FMA.
//   FP32 accumulators gate_acc / up_acc live in each lane's registers; warp_sum folds the lanes; lane 0
//   applies SiLU(g) * u and stores it (fp32 as is, or bf16 RNE).
//   Expert id outside [0, E): lane 0 stores NaN, no weight is read.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GU_WARPS * 32) proto_inter_gate_up(
    const bf16_t* __restrict__ x,             // [T, H]
    const bf16_t* __restrict__ w13,           // [E, 2I, H]
    const int* __restrict__ topk_ids,         // [T, K]
    inter_t* __restrict__ intermediate,       // [T, K, I]
    int tokens, int hidden, int inter, int experts, int top_k)
{
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * GU_WARPS + (threadIdx.x >> 5);
    if (warp >= (long long)tokens * top_k * inter) return;        // whole warp leaves together
    const long long pair = warp / inter;                          // t * K + k
    const int i = (int)(warp - pair * inter);
    const long long t = pair / top_k;
    const int e = __ldg(topk_ids + pair);
    inter_t* dst = intermediate + pair * inter + i;
    if ((unsigned)e >= (unsigned)experts) {                       // bad id: NaN, no weight read
        if (lane == 0) *dst = to_inter(__int_as_float(0x7fc00000));
        return;
    }
    const int chunks = hidden / 4;                                // H % 8 == 0: whole 8-byte chunks
    const size_t row = ((size_t)e * 2 * inter + i) * (size_t)hidden;
    const uint2* gate_row = reinterpret_cast<const uint2*>(w13 + row);
    const uint2* up_row = reinterpret_cast<const uint2*>(w13 + row + (size_t)inter * hidden);
    const uint2* x_row = reinterpret_cast<const uint2*>(x + t * hidden);

    float gate_acc = 0.0f, up_acc = 0.0f;
    for (int base = 0; base < chunks; base += 32 * GU_UNROLL) {
        uint2 wg[GU_UNROLL][1], wu[GU_UNROLL][1], xv[GU_UNROLL];
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {                     // 1) every weight load of the round, then x
            const int c = base + j * 32 + lane;
            wg[j][0] = ldg_chunk(gate_row, c, c < chunks);
            wu[j][0] = ldg_chunk(up_row, c, c < chunks);
        }
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            xv[j] = ldg_chunk(x_row, c, c < chunks);
        }
        gate_acc += __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));  // += 0.0f
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {                     // 2) widen and FMA in element order
            #pragma unroll
            for (int w = 0; w < 2; ++w) {
                const float x_lo = bf16_lo(word(xv[j], w)), x_hi = bf16_hi(word(xv[j], w));
                gate_acc = fmaf(bf16_lo(word(wg[j][0], w)), x_lo, gate_acc);
                gate_acc = fmaf(bf16_hi(word(wg[j][0], w)), x_hi, gate_acc);
                up_acc = fmaf(bf16_lo(word(wu[j][0], w)), x_lo, up_acc);
                up_acc = fmaf(bf16_hi(word(wu[j][0], w)), x_hi, up_acc);
            }
        }
    }
    const float g = warp_sum(gate_acc);
    const float u = warp_sum(up_acc);
    if (lane == 0) {
        const float silu = g / (1.0f + expf(-g));                 // IEEE division (no fast-math)
        *dst = to_inter(silu * u);
    }
}

// ------------------------------------------------------------------------------------------------
// down: out[t, h] = sum_k topk_weights[t, k] * (w2[e_k, h, :] . intermediate[t, k, :])
//   Warp g owns ONE output: token t = g / H, hidden unit h = g % H. Slots k = 0 .. K-1 in order; per slot
//   lane l reads 16-byte w2 chunks (8 bf16) c = l, l + 32, ... of row w2[e_k, h, :] -- DN_UNROLL of them in
//   registers before the first FMA -- and the matching 8 intermediate elements: one 16-byte load (bf16) or
//   two 16-byte loads of 4 floats (fp32), L2 hits.
//   ONE FP32 accumulator acc in each lane's registers: acc += w2 * (weight_k * intermediate); warp_sum folds
//   the lanes, lane 0 stores out[t, h] once (bf16 RNE, or fp32 when out_f32).
//   Any expert id of token t outside [0, E): out[t, h] = NaN, no w2 or intermediate read.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DN_BOUNDS proto_inter_down(
    const inter_t* __restrict__ intermediate, // [T, K, I]
    const bf16_t* __restrict__ w2,            // [E, H, I]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * DN_WARPS + (threadIdx.x >> 5);
    if (warp >= (long long)tokens * hidden) return;              // whole warp leaves together
    const long long t = warp / hidden;
    const int h = (int)(warp - t * hidden);
    const int* ids_t = topk_ids + t * top_k;
    const float* weights_t = topk_weights + t * top_k;

    bool bad = false;                                             // every id of the token, before any w2 read
    for (int k = lane; k < top_k; k += 32) bad |= (unsigned)__ldg(ids_t + k) >= (unsigned)experts;
    const bool token_bad = __any_sync(FULL_MASK, bad);

    float acc = 0.0f;
    if (!token_bad) {
        const int chunks = inter / 8;                             // I % 8 == 0: whole 8-element chunks
        for (int k = 0; k < top_k; ++k) {
            const int e = __ldg(ids_t + k);
            const float wk = __ldg(weights_t + k);
            const uint4* w2_row = reinterpret_cast<const uint4*>(w2 + ((size_t)e * hidden + h) * inter);
            const uint4* inter_row = reinterpret_cast<const uint4*>(intermediate + (t * top_k + k) * (long long)inter);
            for (int c0 = 0; c0 < chunks; c0 += 32 * DN_UNROLL) {
                uint4 wv[DN_UNROLL][1], iv[DN_UNROLL][INTER_LOADS];
                #pragma unroll
                for (int r = 0; r < DN_UNROLL; ++r) {             // 1) w2 chunks and their intermediate
                    const int c = c0 + r * 32 + lane;
                    const bool ok = c < chunks;
                    wv[r][0] = ldg_chunk(w2_row, c, ok);
                    #pragma unroll
                    for (int q = 0; q < INTER_LOADS; ++q) iv[r][q] = ldg_chunk(inter_row, c * INTER_LOADS + q, ok);
                }
                acc += __uint_as_float(all_loads_arrived(wv) | all_loads_arrived(iv));  // += 0.0f
                #pragma unroll
                for (int r = 0; r < DN_UNROLL; ++r) {             // 2) element order 0..7 of each chunk
                    const float weight = c0 + r * 32 + lane < chunks ? wk : 0.0f;
                    #pragma unroll
                    for (int w = 0; w < 4; ++w) {
#if INTER_F32
                        const float i_lo = __uint_as_float(word(iv[r][w / 2], (w % 2) * 2));
                        const float i_hi = __uint_as_float(word(iv[r][w / 2], (w % 2) * 2 + 1));
#else
                        const float i_lo = bf16_lo(word(iv[r][0], w)), i_hi = bf16_hi(word(iv[r][0], w));
#endif
                        const float a_lo = weight * i_lo, a_hi = weight * i_hi;
                        acc = fmaf(bf16_lo(word(wv[r][0], w)), a_lo, acc);
                        acc = fmaf(bf16_hi(word(wv[r][0], w)), a_hi, acc);
                    }
                }
            }
        }
    }
    float v = warp_sum(acc);
    if (token_bad) v = __int_as_float(0x7fc00000);
    if (lane == 0) {
        const long long idx = t * hidden + h;
        if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
        else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);  // the one final rounding
    }
}
"""

DEFAULTS: dict[str, int] = {
    "INTER_F32": 0,  # 0: bf16 intermediate (strict numerics), 1: fp32 intermediate (not rounded)
    "GU_WARPS": 4,
    "GU_UNROLL": 8,  # 8-byte chunks per row in flight per lane: 16 weight loads + 8 of x
    "DN_WARPS": 4,
    "DN_UNROLL": 3,  # 16-byte w2 chunks in flight per lane (3 x 32 x 8 = 768 = qwen3-30b's I in one round)
    "DN_MIN_BLOCKS": 0,  # __launch_bounds__ min blocks per SM for down (0: none)
}
LIMITS: dict[str, tuple[int, int]] = {
    "INTER_F32": (0, 1),
    "GU_WARPS": (1, 32),
    "GU_UNROLL": (1, 32),
    "DN_WARPS": (1, 32),
    "DN_UNROLL": (1, 32),
    "DN_MIN_BLOCKS": (0, 32),
}

SOURCE = CudaSource(
    name="proto_intermediate_fp32",
    code=CODE,
    kernels=(GATE_UP, DOWN),
    defaults=dict(DEFAULTS),
    variants=[{"INTER_F32": 1}],
    warps_knobs={GATE_UP: "GU_WARPS", DOWN: "DN_WARPS"},
    description="prototype: warp decode with a bf16 or fp32 (INTER_F32) intermediate",
)


def intermediate_dtype(params: dict[str, int]) -> np.dtype:
    return np.dtype(np.float32) if params["INTER_F32"] else BF16


def _workspace(dims: Dims, params: dict[str, int]) -> Any:
    """The [T, K, I] intermediate, fp32 or bf16 by ``INTER_F32``."""
    import cupy

    return cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=intermediate_dtype(params))


def _stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
            out: Any) -> list[Stage]:
    dims, params, workspace = compiled.dims, compiled.params, compiled.workspace
    sizes = (np.int32(dims.tokens), np.int32(dims.hidden), np.int32(dims.intermediate), np.int32(dims.experts),
             np.int32(dims.top_k))
    gu_blocks = -(-dims.tokens * dims.top_k * dims.intermediate // params["GU_WARPS"])
    dn_blocks = -(-dims.tokens * dims.hidden // params["DN_WARPS"])
    out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
    return [
        ("gate_up", lambda: launch_ex(compiled.kernels[GATE_UP], (gu_blocks,), (32 * params["GU_WARPS"],),
                                      (x, w13, topk_ids, workspace, *sizes))),
        ("down", lambda: launch_ex(compiled.kernels[DOWN], (dn_blocks,), (32 * params["DN_WARPS"],),
                                   (workspace, w2, topk_ids, topk_weights, out, out_f32, *sizes))),
    ]


FAMILY = KernelFamily(name="intermediate-fp32", source=SOURCE, limits=LIMITS, workspace=_workspace, stages=_stages)
resolve_params = FAMILY.resolve  # the tests' and emulator's name for it

VARIANT = register(
    FAMILY.variant(
        "proto:intermediate-fp32",
        reference_mode="warp_decode",
        description="warp decode with an fp32 (INTER_F32=1) vs bf16 [T, K, I] intermediate: bytes vs accuracy",
        grid={"INTER_F32": [0, 1]},
    )
)
