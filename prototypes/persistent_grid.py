"""Prototype: persistent-grid warp decode -- as many blocks as can be resident, each warp looping over outputs.

Hypothesis. The strict kernels launch one warp per output: qwen3-30b-a3b T = 1 is 6144 gate_up warps (3072
blocks of 2) and 2048 down warps (512 blocks of 4). Blocks are launched in a ramp, retire one by one, and the
last partial wave leaves SMs idle while the HBM pipe drains. A persistent grid launches exactly
``SMs x PERSIST_BLOCKS`` blocks (read from the device at build time; fewer when there is less work), all
resident at once, and every warp loops over outputs with a grid stride (warp w takes outputs w, w + total
warps, ...): no block-launch ramp, no block retire/relaunch gaps, each warp's next rows are issued right after
its last FMAs. Costs: loop overhead per output (index math, the bad-id branch; a few registers), and
``__launch_bounds__(warps * 32, PERSIST_BLOCKS)`` caps registers so that PERSIST_BLOCKS blocks fit per SM.
Still two kernels, no grid-wide sync, no atomics.

``ORDER`` (which outputs a warp takes): 1 = block b's warps take consecutive outputs (b * WARPS + w, then + total
warps): consecutive rows of the same expert per block at every step (DRAM page / L2 sector locality within an
SM); 0 = plain striding (w * blocks + b): a block's warps read rows ``blocks`` apart.

Numerics: the strict kernels' summation order at ``GU_BYTES=8, GU_OUTS=1, DN_SLOTS=<DN_SLOTS>, DN_UNROLL=1,
DN_OUTS=1`` (8-byte gate_up chunks, GU_UNROLL of them per row in flight; down batches DN_SLOTS routed slots of
one 16-byte w2 chunk each), so results are bitwise equal to ``cupy:warp-decode`` built with those knobs (GPU test).

Prediction with arithmetic (H200: 132 SMs, streaming-read roofline ~4.5 TB/s; strict defaults measured 25 us
(qwen3-30b-a3b) and 78 us (qwen3-235b-a22b) per layer at T = 1). Bytes in flight needed per SM to cover an
assumed ~0.8 us loaded DRAM latency: 4.5 TB/s x 0.8 us / 132 = ~27 KB. A 4-warp block of gate_up has
4 warps x 32 lanes x 12 x 8 B = 12 KB of weight loads in flight (GU_UNROLL 6, not the strict kernel's 8: at
PERSIST_BLOCKS 8 x 4 warps = 32 warps per SM the register cap is 64, and GU_UNROLL 8 needs 72 there and spills
72 bytes; 6 needs 58 at every grid point); of down (DN_SLOTS 4) 4 x 32 x 4 x 16 B = 8 KB.

    PERSIST_BLOCKS (x 4 warps)     1       2       4       8
    warps per SM                   4       8      16      32
    gate_up KB in flight / SM     12      24      48      96     (enough from 4 up; 2 borderline)
    down KB in flight / SM         8      16      32      64     (enough from 4 up)

    outputs (warps of work)   gate_up: T*K*I          down: T*H
    qwen3-30b-a3b    T=1        6144  (PB 8: 1.45 per warp)     2048  (< 4224 persistent warps: grid = work)
                     T=8       49152  (11.6 per warp)          16384  (3.9)
    qwen3-235b-a22b  T=1       12288  (2.9 per warp)           4096   (< 4224: grid = work)
                     T=8       98304  (23.3 per warp)          32768  (7.8)

So: (1) PERSIST_BLOCKS 1 and 2 lose badly at T = 1 (too few bytes in flight: down ~2x slower at PB 1);
(2) at T = 1 the down kernel has less work than one persistent wave, so its grid equals the strict one and
nothing changes; gate_up at 30b T=1 still has a tail (1920 of 4224 warps do a 2nd output), the same
quantization as the strict kernel's 1.45 waves -- predicted gain at T = 1 with PB 8: 0-1 us per layer (only the
block-launch ramp, ~0.5 us); (3) at T = 8 the loop amortizes and gate_up's 11-23 outputs per warp remove
~3-4 block waves of launch/retire gaps: predicted 1-3 % faster (30b T=8: ~146 -> ~143 us); (4) ORDER: at every
step the union of rows read over the whole GPU is the same set ({j * total .. (j + 1) * total}); only which SM
reads which row changes, so predicted no difference beyond noise (< 1 %). A measurable ORDER effect would mean
per-SM locality (L1 / TLB / L2-slice affinity) matters.

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-persistent-grid.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs (this pair has no
PDL; gate_up at GU_UNROLL 6), weights rotated past 3x L2, 8 repeats). Median us per layer, % of the run's 4.48 TB/s
read roofline; T = 1 / 8 IQRs <= 0.6 us; registers gate_up / down from the JSON (spill-free). Strict rows:
results/sweep-proto-outputs-per-warp.json (with PDL) and results/sweep-dn-qwen3-30b-a3b-after-race-fix.json
(PDL 0, T = 1 only):

    PERSIST_BLOCKS  ORDER   registers   T = 1 us       T = 8 us       T = 32 us (IQR)
    8               1       58 / 60     24.3 (69 %)    141.0 (75 %)   550.7 (1.5)
    8               0       58 / 60     24.7 (68 %)    141.2 (75 %)   611.9 (28.5)
    4               1       58 / 66     25.3 (67 %)    155.7 (68 %)   620.9 (31.0)
    4               0       58 / 66     25.4 (67 %)    157.5 (67 %)   598.4 (0.2)
    2               1       58 / 67     33.5 (50 %)    222.1 (47 %)   860.0 (0.6)
    2               0       58 / 67     33.5 (50 %)    224.1 (47 %)   862.2 (0.2)
    1               1       58 / 67     54.0 (31 %)    382.6 (28 %)   1502.3 (0.5)
    1               0       58 / 67     54.0 (31 %)    383.6 (27 %)   1503.0 (0.4)
    strict, PDL 1                       23.2 (73 %)    134.3 (79 %)   530.0 (0.8)
    strict, PDL 0                       25.1

Against the prediction: (1) PERSIST_BLOCKS 1 and 2 lose badly, as predicted (2.2x and 1.4x the time of
PERSIST_BLOCKS 8 at T = 1), but PERSIST_BLOCKS 4 also loses 10 % at T = 8 although its 48 / 32 KB per SM in flight
was predicted to be enough. (2) At T = 1, PERSIST_BLOCKS 8 is 0.4-0.8 us faster than the PDL-free strict pair
(separate run), inside the predicted 0-1 us -- but the strict kernels with PDL stay 1.1 us ahead. (3) At T = 8 the
predicted 1-3 % gain did not come: 141.0 us vs 134.3 us with PDL (+5 %), and about the 140.9 us a PDL-free strict
point measured earlier today (results/sweep-dn-qwen3-30b-a3b-early-inter.json, DN_SLOTS 4, DN_UNROLL 1, before the
race fix). (4) ORDER: ORDER 1 is never slower at T = 1 / 8 and 0-2.0 us (<= 1.6 %) faster, beyond the IQRs but about
the predicted "< 1 %"; T = 32 is not resolvable (PERSIST_BLOCKS 8: 550.7 vs 611.9 us, IQR 28.5).

Conclusion: the persistent grid does not beat the strict one-warp-per-output grid with PDL at any batch (+1.1 us at
T = 1, +5 % at T = 8); the ramp/tail time it saves at T = 1 (~0.8 us) is less than PDL already saves (~2 us). The
library keeps the strict grid with PDL. The only follow-up worth trying is PDL inside the persistent pair (gate_up
triggers ``launch_dependents`` after its last loads), knowing both attack the same gap and may not add up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, get_kernel, launch_ex, register_source
from kernels.contract import BF16, Dims
from kernels.device_helpers import WARP_HELPERS
from kernels.variants import Variant, register

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


def resolve_params(**params: Any) -> dict[str, int]:
    """Validate the knobs (ValueError / TypeError naming the knob); returns every knob as an int."""
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown persistent-grid parameter(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    values = dict(DEFAULTS)
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{key} must be an int, got {value!r}")
        low, high = LIMITS[key]
        if not low <= int(value) <= high:
            raise ValueError(f"{key} must be in {low}..{high}, got {value}")
        values[key] = int(value)
    for prefix in ("GU", "DN"):
        if values["PERSIST_BLOCKS"] * values[f"{prefix}_WARPS"] > 64:
            raise ValueError(
                f"PERSIST_BLOCKS x {prefix}_WARPS must be <= 64 (warps per SM on sm_90), "
                f"got {values['PERSIST_BLOCKS']} x {values[f'{prefix}_WARPS']}"
            )
    return values


SOURCE = register_source(
    CudaSource(
        name="proto_persistent_grid",
        code=CODE,
        kernels=(GATE_UP, DOWN),
        defaults=dict(DEFAULTS),
        variants=[{"PERSIST_BLOCKS": 8}, {"PERSIST_BLOCKS": 1, "ORDER": 0}],
        warps_knobs={GATE_UP: "GU_WARPS", DOWN: "DN_WARPS"},
        description="prototype: persistent-grid warp decode (SMs x PERSIST_BLOCKS blocks, grid-stride warps)",
    )
)


def grid_blocks(outputs: int, warps_per_block: int, sms: int, blocks_per_sm: int) -> int:
    """Blocks of a persistent launch: ``sms x blocks_per_sm``, fewer when there are fewer outputs than warps."""
    return max(1, min(sms * blocks_per_sm, -(-outputs // warps_per_block)))


def build(dims: Dims, **params: Any) -> Any:
    """Compile both kernels, read the SM count, size both persistent grids and allocate the bf16 intermediate
    once; the returned launch only launches (no allocation, no host sync: graph-capturable)."""
    import cupy

    resolved = resolve_params(**params)
    gate_up_kernel = get_kernel(SOURCE, GATE_UP, **resolved)
    down_kernel = get_kernel(SOURCE, DOWN, **resolved)
    sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    workspace = cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16)
    sizes = (
        np.int32(dims.tokens),
        np.int32(dims.hidden),
        np.int32(dims.intermediate),
        np.int32(dims.experts),
        np.int32(dims.top_k),
    )
    gu_blocks = grid_blocks(
        dims.tokens * dims.top_k * dims.intermediate, resolved["GU_WARPS"], sms, resolved["PERSIST_BLOCKS"]
    )
    dn_blocks = grid_blocks(dims.tokens * dims.hidden, resolved["DN_WARPS"], sms, resolved["PERSIST_BLOCKS"])

    def run_gate_up(x: Any, w13: Any, topk_ids: Any) -> None:
        launch_ex(gate_up_kernel, (gu_blocks,), (32 * resolved["GU_WARPS"],), (x, w13, topk_ids, workspace, *sizes))

    def run_down(w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
        out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
        launch_ex(
            down_kernel,
            (dn_blocks,),
            (32 * resolved["DN_WARPS"],),
            (workspace, w2, topk_ids, topk_weights, out, out_f32, *sizes),
        )

    def launch(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
        run_gate_up(x, w13, topk_ids)
        run_down(w2, topk_ids, topk_weights, out)

    def stages(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[tuple[str, Any]]:
        return [
            ("gate_up", lambda: run_gate_up(x, w13, topk_ids)),
            ("down", lambda: run_down(w2, topk_ids, topk_weights, out)),
        ]

    launch.stages = stages  # type: ignore[attr-defined]
    launch.params = resolved  # type: ignore[attr-defined]
    launch.workspace = workspace  # type: ignore[attr-defined]
    launch.blocks = {"gate_up": gu_blocks, "down": dn_blocks, "sms": sms}  # type: ignore[attr-defined]
    return launch


build.source = SOURCE  # type: ignore[attr-defined]  # tools.sweep's compile columns

VARIANT = register(
    Variant(
        name="proto:persistent-grid",
        backend="cupy",
        family="persistent-grid",
        build=build,
        reference_mode="warp_decode",
        params=dict(DEFAULTS),
        description="warp decode on a persistent grid (SMs x PERSIST_BLOCKS blocks, warps loop over outputs)",
        grid={"PERSIST_BLOCKS": [1, 2, 4, 8], "ORDER": [0, 1]},
    )
)
