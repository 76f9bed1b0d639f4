"""Prototype: persistent-grid warp decode -- as many blocks as can be resident, each warp looping over outputs.

Hypothesis. The strict kernels launch one warp per output; blocks launch in a ramp, retire one by one, and the last
partial wave leaves SMs idle while the HBM pipe drains. A persistent grid launches exactly ``SMs x PERSIST_BLOCKS``
blocks (fewer when there is less work), all resident at once, every warp looping over outputs with a grid stride: no
ramp, no retire / relaunch gaps. Costs: loop overhead per output and the register cap of
``__launch_bounds__(warps * 32, PERSIST_BLOCKS)`` (gate_up runs GU_UNROLL 6: GU_UNROLL 8 spills 72 bytes at
PERSIST_BLOCKS 8). Still two kernels, no grid-wide sync, no atomics. ``ORDER`` 1: a block's warps take consecutive
outputs; 0: plain striding.

Numerics: the strict kernels' summation order at ``GU_BYTES=8, GU_OUTS=1, DN_SLOTS=<DN_SLOTS>, DN_UNROLL=1,
DN_OUTS=1`` -- bitwise ``cupy:warp-decode`` built with those knobs (GPU test).

Prediction (H200, ~27 KB in flight per SM needed): PERSIST_BLOCKS 1 and 2 lose badly at T = 1; PERSIST_BLOCKS 8 gains
0-1 us at T = 1 (only the block-launch ramp) and 1-3 % at T = 8; ORDER changes nothing beyond noise (< 1 %).

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; this pair has no PDL):
PERSIST_BLOCKS 8, ORDER 1 24.3 / 141.0 / 550.7 us at T = 1 / 8 / 32; PERSIST_BLOCKS 4 25.3 / 155.7 (10 % slower at
T = 8, not predicted), 2 33.5, 1 54.0 at T = 1. Strict: 23.2 / 134.3 / 530.0 with PDL, 25.1 without (T = 1). ORDER 1
is never slower and 0-2.0 us faster at T = 1 / 8. Full table and comparison: notes/PROTOTYPES.md ("Persistent grid").

Conclusion: the persistent grid does not beat the strict grid with PDL at any batch (+1.1 us at T = 1, +5 % at
T = 8); the ramp / tail it saves at T = 1 (~0.8 us) is less than PDL saves (~2 us). The library keeps the strict grid
with PDL; the only follow-up worth trying is PDL inside the persistent pair.

Results: results/sweep-proto-persistent-grid.json.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, device_sm_count, launch_ex
from kernels.contract import BF16, Dims
from kernels.device_helpers import WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Launch, Stage
from kernels.variants import register

GATE_UP = "proto_persist_gate_up"
DOWN = "proto_persist_down"

CODE = WARP_HELPERS + r"""
// Persistent-grid warp decode: SMs x PERSIST_BLOCKS blocks, each warp loops over outputs with a grid stride.
// Knobs: PERSIST_BLOCKS blocks per SM (also __launch_bounds__ min blocks), ORDER output-to-warp mapping,
// GU_WARPS / DN_WARPS warps per block, GU_UNROLL 8-byte chunks per row in flight per lane (gate_up),
// DN_SLOTS routed slots whose 16-byte w2 chunks are in flight together (down).
// bf16 is handled as raw 16-bit patterns (no cuda_bf16.h).

static_assert(PERSIST_BLOCKS >= 1 && PERSIST_BLOCKS <= 32, "PERSIST_BLOCKS must be 1..32");
static_assert(ORDER == 0 || ORDER == 1, "ORDER must be 0 or 1");
static_assert(GU_WARPS >= 1 && GU_WARPS <= 32 && DN_WARPS >= 1 && DN_WARPS <= 32, "WARPS must be 1..32");
static_assert(GU_UNROLL >= 1 && DN_SLOTS >= 1 && DN_SLOTS <= 32, "GU_UNROLL >= 1, DN_SLOTS 1..32");


// The first output of this warp and the stride: ORDER 1 -> a block's warps take consecutive outputs;
// ORDER 0 -> a block's warps take outputs gridDim.x apart. The stride is the grid's warp count either way.
template <int WARPS>
__device__ __forceinline__ long long first_output() {
    const long long w = threadIdx.x >> 5;
#if ORDER
    return (long long)blockIdx.x * WARPS + w;
#else
    return w * gridDim.x + blockIdx.x;
#endif
}

// ------------------------------------------------------------------------------------------------
// gate_up: intermediate[t, k, i] = bf16(SiLU(w13[e, i, :] . x[t]) * (w13[e, I + i, :] . x[t]))
//   Warp w owns outputs o = first_output(), o + gridDim.x * GU_WARPS, ...; output o is pair p = o / I
//   (t = p / K, k = p % K), neuron i = o % I. Per output, lane l loads 8-byte chunks (4 bf16) c = l, l + 32,
//   ... of the gate row, the up row and x[t]; GU_UNROLL chunks per row in registers before the first FMA.
//   FP32 accumulators gate_acc / up_acc in each lane's registers (reset per output); warp_sum folds the lanes;
//   lane 0 stores bf16(SiLU(g) * u). Expert id outside [0, E): lane 0 stores NaN, no weight read.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GU_WARPS * 32, PERSIST_BLOCKS) proto_persist_gate_up(
    const bf16_t* __restrict__ x,             // [T, H]
    const bf16_t* __restrict__ w13,           // [E, 2I, H]
    const int* __restrict__ topk_ids,         // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int tokens, int hidden, int inter, int experts, int top_k)
{
    const int lane = threadIdx.x & 31;
    const long long outputs = (long long)tokens * top_k * inter;
    const long long stride = (long long)gridDim.x * GU_WARPS;
    const int chunks = hidden / 4;                                // H % 8 == 0: whole 8-byte chunks
    for (long long o = first_output<GU_WARPS>(); o < outputs; o += stride) {   // warp-uniform loop
        const long long pair = o / inter;                         // t * K + k
        const int i = (int)(o - pair * inter);
        const long long t = pair / top_k;
        const int e = __ldg(topk_ids + pair);
        bf16_t* dst = intermediate + pair * inter + i;
        if ((unsigned)e >= (unsigned)experts) {                   // bad id: NaN, no weight read
            if (lane == 0) *dst = BF16_NAN;
            continue;
        }
        const size_t row = ((size_t)e * 2 * inter + i) * (size_t)hidden;
        const uint2* gate_row = reinterpret_cast<const uint2*>(w13 + row);
        const uint2* up_row = reinterpret_cast<const uint2*>(w13 + row + (size_t)inter * hidden);
        const uint2* x_row = reinterpret_cast<const uint2*>(x + t * hidden);
        float gate_acc = 0.0f, up_acc = 0.0f;
        for (int base = 0; base < chunks; base += 32 * GU_UNROLL) {
            uint2 wg[GU_UNROLL][1], wu[GU_UNROLL][1], xv[GU_UNROLL];
            #pragma unroll
            for (int j = 0; j < GU_UNROLL; ++j) {                 // 1) every weight load of the round, then x
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
            for (int j = 0; j < GU_UNROLL; ++j) {                 // 2) widen and FMA in element order
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
            const float silu = g / (1.0f + expf(-g));             // IEEE division (no fast-math)
            *dst = f32_to_bf16(silu * u);                         // the one bf16 rounding
        }
    }
}

// ------------------------------------------------------------------------------------------------
// down: out[t, h] = sum_k topk_weights[t, k] * (w2[e_k, h, :] . intermediate[t, k, :])
//   Warp w owns outputs o = first_output(), o + gridDim.x * DN_WARPS, ...; output o is token t = o / H,
//   hidden unit h = o % H. Per output: the token's ids are range-checked first (lane k checks slots k, k + 32,
//   ...). Then slots go in batches of DN_SLOTS: lane s < DN_SLOTS reads slot k0 + s's id and weight, the
//   others get them by shuffle; per 32-chunk round each lane loads one 16-byte w2 chunk (8 bf16) of every slot
//   of the batch and the matching intermediate chunks (L2 hits), all before the first FMA.
//   ONE FP32 accumulator acc in each lane's registers (reset per output): acc += w2 * (weight_k * inter);
//   warp_sum folds the lanes, lane 0 stores out[t, h] (bf16 RNE, or fp32 when out_f32).
//   Any expert id of token t outside [0, E): out[t, h] = NaN, no w2 or intermediate read.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(DN_WARPS * 32, PERSIST_BLOCKS) proto_persist_down(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const bf16_t* __restrict__ w2,            // [E, H, I]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    const int lane = threadIdx.x & 31;
    const long long outputs = (long long)tokens * hidden;
    const long long stride = (long long)gridDim.x * DN_WARPS;
    const int chunks = inter / 8;                                 // I % 8 == 0: whole 16-byte chunks
    for (long long o = first_output<DN_WARPS>(); o < outputs; o += stride) {   // warp-uniform loop
        const long long t = o / hidden;
        const int h = (int)(o - t * hidden);
        const int* ids_t = topk_ids + t * top_k;
        const float* weights_t = topk_weights + t * top_k;
        bool bad = false;
        for (int k = lane; k < top_k; k += 32) bad |= (unsigned)__ldg(ids_t + k) >= (unsigned)experts;
        const bool token_bad = __any_sync(FULL_MASK, bad);

        float acc = 0.0f;
        if (!token_bad) {
            const uint4* inter_t = reinterpret_cast<const uint4*>(intermediate + t * top_k * (long long)inter);
            for (int k0 = 0; k0 < top_k; k0 += DN_SLOTS) {
                const bool lane_slot = lane < DN_SLOTS && k0 + lane < top_k;
                const int batch_id = lane_slot ? __ldg(ids_t + k0 + lane) : 0;
                const float batch_weight = lane_slot ? __ldg(weights_t + k0 + lane) : 0.0f;
                const uint4* rows[DN_SLOTS];                      // w2[e_k, h, :] of each slot of the batch
                #pragma unroll
                for (int s = 0; s < DN_SLOTS; ++s) {
                    const int e = __shfl_sync(FULL_MASK, batch_id, s);   // past-K slots: expert 0, loads masked
                    rows[s] = reinterpret_cast<const uint4*>(w2 + ((size_t)e * hidden + h) * inter);
                }
                for (int c0 = 0; c0 < chunks; c0 += 32) {
                    const int c = c0 + lane;
                    uint4 wv[DN_SLOTS][1], iv[DN_SLOTS][1];
                    #pragma unroll
                    for (int s = 0; s < DN_SLOTS; ++s) {          // 1) w2 chunk and intermediate chunk per slot
                        const bool ok = k0 + s < top_k && c < chunks;
                        wv[s][0] = ldg_chunk(rows[s], c, ok);
                        iv[s][0] = ldg_chunk(inter_t + (size_t)(ok ? k0 + s : 0) * chunks, c, ok);
                    }
                    acc += __uint_as_float(all_loads_arrived(wv) | all_loads_arrived(iv));  // += 0.0f
                    #pragma unroll
                    for (int s = 0; s < DN_SLOTS; ++s) {          // 2) slot order, element order 0..7
                        const float wk = __shfl_sync(FULL_MASK, batch_weight, s);
                        const float weight = k0 + s < top_k && c < chunks ? wk : 0.0f;
                        #pragma unroll
                        for (int w = 0; w < 4; ++w) {
                            const float a_lo = weight * bf16_lo(word(iv[s][0], w));
                            const float a_hi = weight * bf16_hi(word(iv[s][0], w));
                            acc = fmaf(bf16_lo(word(wv[s][0], w)), a_lo, acc);
                            acc = fmaf(bf16_hi(word(wv[s][0], w)), a_hi, acc);
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
}
"""

DEFAULTS: dict[str, int] = {
    "PERSIST_BLOCKS": 4,  # blocks per SM: the grid is SMs x PERSIST_BLOCKS (fewer when there is less work)
    "ORDER": 1,  # 1: a block's warps take consecutive outputs; 0: plain striding (outputs `blocks` apart)
    "GU_WARPS": 4,
    "GU_UNROLL": 6,  # 8-byte chunks per row in flight per lane (12 weight loads + 6 of x); 8 spills at PB 8
    "DN_WARPS": 4,
    "DN_SLOTS": 4,  # routed slots whose 16-byte w2 chunks are in flight together
}
LIMITS: dict[str, tuple[int, int]] = {
    "PERSIST_BLOCKS": (1, 32),
    "ORDER": (0, 1),
    "GU_WARPS": (1, 32),
    "GU_UNROLL": (1, 32),
    "DN_WARPS": (1, 32),
    "DN_SLOTS": (1, 32),
}


DEFAULT_SMS = 132  # the H200's SM count, where no GPU is present


def _rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """Every block of the persistent grid must be resident at once: PERSIST_BLOCKS x WARPS <= 64 warps per SM."""
    for prefix in ("GU", "DN"):
        if values["PERSIST_BLOCKS"] * values[f"{prefix}_WARPS"] > 64:
            raise ValueError(
                f"PERSIST_BLOCKS x {prefix}_WARPS must be <= 64 (warps per SM on sm_90), "
                f"got {values['PERSIST_BLOCKS']} x {values[f'{prefix}_WARPS']}"
            )
    return values


SOURCE = CudaSource(
    name="proto_persistent_grid",
    code=CODE,
    kernels=(GATE_UP, DOWN),
    defaults=dict(DEFAULTS),
    variants=[{"PERSIST_BLOCKS": 8}, {"PERSIST_BLOCKS": 1, "ORDER": 0}],
    warps_knobs={GATE_UP: "GU_WARPS", DOWN: "DN_WARPS"},
    description="prototype: persistent-grid warp decode (SMs x PERSIST_BLOCKS blocks, grid-stride warps)",
)


def grid_blocks(outputs: int, warps_per_block: int, sms: int, blocks_per_sm: int) -> int:
    """Blocks of a persistent launch: ``sms x blocks_per_sm``, fewer when there are fewer outputs than warps."""
    return max(1, min(sms * blocks_per_sm, -(-outputs // warps_per_block)))


def launch_blocks(dims: Dims, params: dict[str, int]) -> dict[str, int]:
    """Both persistent grids on the current GPU: ``{"gate_up": blocks, "down": blocks, "sms": SM count}``."""
    sms = device_sm_count(DEFAULT_SMS)
    return {
        "gate_up": grid_blocks(dims.tokens * dims.top_k * dims.intermediate, params["GU_WARPS"], sms,
                               params["PERSIST_BLOCKS"]),
        "down": grid_blocks(dims.tokens * dims.hidden, params["DN_WARPS"], sms, params["PERSIST_BLOCKS"]),
        "sms": sms,
    }


def _stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
            out: Any) -> list[Stage]:
    dims, params, workspace = compiled.dims, compiled.params, compiled.workspace
    blocks = launch_blocks(dims, params)
    sizes = (np.int32(dims.tokens), np.int32(dims.hidden), np.int32(dims.intermediate), np.int32(dims.experts),
             np.int32(dims.top_k))
    out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
    return [
        ("gate_up", lambda: launch_ex(compiled.kernels[GATE_UP], (blocks["gate_up"],), (32 * params["GU_WARPS"],),
                                      (x, w13, topk_ids, workspace, *sizes))),
        ("down", lambda: launch_ex(compiled.kernels[DOWN], (blocks["down"],), (32 * params["DN_WARPS"],),
                                   (workspace, w2, topk_ids, topk_weights, out, out_f32, *sizes))),
    ]


def _workspace(dims: Dims, params: dict[str, int]) -> Any:
    """The bf16 [T, K, I] intermediate."""
    import cupy

    return cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16)


FAMILY = KernelFamily(name="persistent-grid", source=SOURCE, limits=LIMITS, rules=_rules, workspace=_workspace,
                      stages=_stages)
resolve_params = FAMILY.resolve  # the tests' and emulator's name for it


def build(dims: Dims, **knobs: Any) -> Launch:
    """Compile both kernels and allocate the bf16 intermediate once; ``launch.facts["blocks"]``: both grids' blocks
    and the SM count they were sized for. The launch only launches (no allocation, no host sync)."""
    compiled = FAMILY.compile(dims, **knobs)
    return Launch(run=compiled.run, stages=compiled.stage_list, params=compiled.params, workspace=compiled.workspace,
                  facts={"blocks": launch_blocks(dims, compiled.params)})


VARIANT = register(
    FAMILY.variant(
        "proto:persistent-grid",
        build=build,
        reference_mode="warp_decode",
        description="warp decode on a persistent grid (SMs x PERSIST_BLOCKS blocks, warps loop over outputs)",
        grid={"PERSIST_BLOCKS": [1, 2, 4, 8], "ORDER": [0, 1]},
    )
)
