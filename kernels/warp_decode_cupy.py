"""Strict warp decode as CuPy RawKernel CUDA C: ``moe_gate_up_3d_batched`` then ``moe_down_3d_batched``.

Each warp owns one output scalar (or ``*_OUTS`` consecutive ones, reusing its activation loads):

* gate_up: warp (t, k, i) reads gate row i and up row i of expert ``topk_ids[t, k]`` once, streams ``x[t]`` once
  for both dot products, accumulates in FP32 registers, reduces with shuffles and writes ``bf16(SiLU(g) * u)``
  into the [T, K, I] intermediate.
* down: warp (t, h) loops over the K routed experts, dots row h of each ``w2[e]`` with ``intermediate[t, k, :]``
  and folds the routing weight into ONE FP32 accumulator; reduce, write once.

No shared memory, no atomics, no inter-warp sync, no buffer besides the bf16 intermediate. Every expert id is
range-checked in the kernels (bad id -> NaN for that token, no weight read).

Loads in flight: left alone, ptxas sinks each weight load next to its FMAs; ``all_loads_arrived`` makes every
load of a round issue before the first FMA. With PDL (sm_90+) down's blocks start while gate_up drains and issue
their first w2 loads; loads of gate_up's output go through ``ld_dep``, which stays behind ``griddepcontrol.wait``.

The module declares one kernel family, :data:`FAMILY` (knobs, auto rules, workspace, stages), and its variant
``"cupy:warp-decode"``. Public API: :func:`warp_decode` (what ``kernels.warp_decode(..., backend="cupy")``
calls), the stages :func:`gate_up` and :func:`down`, :func:`make_workspace`, :func:`resolve_params`.
The defaults (:data:`DEFAULTS`, :func:`_auto_down`) won the H200 sweeps: notes/FINDINGS.md ("Strict warp
decode"), notes/strict.md; the experiments removed from here: notes/PROTOTYPES.md ("Removed from the library").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, launch_ex, preset_variants
from kernels.contract import BF16, Dims, array_module, check_aligned, check_inputs, check_out, require_cupy
from kernels.device_helpers import PDL_HELPERS, WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.variants import register

GATE_UP = "moe_gate_up_3d_batched"
DOWN = "moe_down_3d_batched"

CODE = WARP_HELPERS + PDL_HELPERS + r"""
// Warp decode for MoE decode. bf16 is handled as raw 16-bit patterns: widening is a shift / mask,
// narrowing is integer round-to-nearest-even (no cuda_bf16.h).
// Knobs (set as #defines by kernels.compile): GU_* for gate_up, DN_* for down:
//   *_WARPS  warps per block          *_OUTS   consecutive outputs per warp (reuse x / intermediate loads)
//   *_UNROLL loads in flight per lane  *_BYTES  bytes per lane per load (4, 8 or 16)
//   *_MIN_BLOCKS  __launch_bounds__ min blocks per SM (0 = let ptxas choose registers)
static_assert(GU_WARPS >= 1 && GU_WARPS <= 32 && DN_WARPS >= 1 && DN_WARPS <= 32, "WARPS must be 1..32");
static_assert(GU_OUTS >= 1 && GU_OUTS <= 32 && DN_OUTS >= 1 && DN_OUTS <= 32, "OUTS must be 1..32");
static_assert(GU_UNROLL >= 1 && DN_UNROLL >= 1, "UNROLL must be >= 1");
static_assert(DN_SLOTS >= 1 && DN_SLOTS <= 32, "DN_SLOTS must be 1..32");
static_assert(DN_EARLY_INTER == 0 || DN_EARLY_INTER == 1, "DN_EARLY_INTER must be 0 or 1");
static_assert(GU_BYTES == 4 || GU_BYTES == 8 || GU_BYTES == 16, "GU_BYTES must be 4, 8 or 16");
static_assert(DN_BYTES == 4 || DN_BYTES == 8 || DN_BYTES == 16, "DN_BYTES must be 4, 8 or 16");

#if GU_MIN_BLOCKS > 0
#define GU_BOUNDS __launch_bounds__(GU_WARPS * 32, GU_MIN_BLOCKS)
#else
#define GU_BOUNDS __launch_bounds__(GU_WARPS * 32)
#endif
#if DN_MIN_BLOCKS > 0
#define DN_BOUNDS __launch_bounds__(DN_WARPS * 32, DN_MIN_BLOCKS)
#else
#define DN_BOUNDS __launch_bounds__(DN_WARPS * 32)
#endif

// ------------------------------------------------------------------------------------------------
// moe_gate_up_3d_batched: intermediate[t, k, i] = bf16(SiLU(w13[e, i, :] . x[t]) * (w13[e, I+i, :] . x[t]))
//   Warp g (global, blockIdx.x * GU_WARPS + warp in block) owns pair p = g / ceil(I / GU_OUTS), i.e.
//   token t = p / K and slot k = p % K, and the GU_OUTS consecutive neurons i0 .. i0 + GU_OUTS - 1.
//   Lane l loads chunks c = l, l + 32, ... of GU_BYTES (GU_BYTES / 2 bf16) of each owned gate row and up
//   row and the same chunks of x[t]; GU_UNROLL chunks per row are loaded into registers before any FMA.
//   FP32 accumulators: gate_acc[o], up_acc[o] in each lane's registers, summed over the warp by shuffles;
//   lane o applies SiLU(g) * u and stores neuron i0 + o.
//   An expert id outside [0, E) writes NaN to the warp's neurons and reads no weights.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GU_BOUNDS moe_gate_up_3d_batched(
    const bf16_t* __restrict__ x,             // [T, H]
    const bf16_t* __restrict__ w13,           // [E, 2I, H]
    const int* __restrict__ topk_ids,         // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int tokens, int hidden, int inter, int experts, int top_k)
{
    typedef typename Vec<GU_BYTES>::T vec_t;
    constexpr int ELEMS = GU_BYTES / 2;     // bf16 per load
    constexpr int WORDS = GU_BYTES / 4;     // 32-bit words per load
    const int lane = threadIdx.x & 31;
    const long long groups = (inter + GU_OUTS - 1) / GU_OUTS;    // warps per (t, k) pair
    const long long warp = (long long)blockIdx.x * GU_WARPS + (threadIdx.x >> 5);
    pdl_wait();     // topk_ids and x may come from the kernel right before this one: nothing is read earlier
    pdl_release();
    if (warp >= (long long)tokens * top_k * groups) return;    // whole warp leaves together
    const long long pair = warp / groups;                         // t * K + k
    const int i0 = (int)(warp - pair * groups) * GU_OUTS;
    const long long t = pair / top_k;
    const int e = ld_dep(topk_ids + pair);                        // after pdl_wait: the router may write it
    bf16_t* dst = intermediate + pair * inter;
    if ((unsigned)e >= (unsigned)experts) {                       // bad id: NaN, no weight read
        if (lane < GU_OUTS && i0 + lane < inter) dst[i0 + lane] = BF16_NAN;
        return;
    }

    const int chunks = hidden / ELEMS;                            // H % 8 == 0: whole chunks only
    const vec_t* x_row = reinterpret_cast<const vec_t*>(x + t * hidden);
    const vec_t* gate_row[GU_OUTS];
    const vec_t* up_row[GU_OUTS];
    #pragma unroll
    for (int o = 0; o < GU_OUTS; ++o) {
        const int i = min(i0 + o, inter - 1);                     // past-the-end neurons re-read the last row
        const size_t row = ((size_t)e * 2 * inter + i) * (size_t)hidden;
        gate_row[o] = reinterpret_cast<const vec_t*>(w13 + row);
        up_row[o] = reinterpret_cast<const vec_t*>(w13 + row + (size_t)inter * hidden);
    }

    float gate_acc[GU_OUTS], up_acc[GU_OUTS];
    #pragma unroll
    for (int o = 0; o < GU_OUTS; ++o) gate_acc[o] = up_acc[o] = 0.0f;

    for (int base = 0; base < chunks; base += 32 * GU_UNROLL) {
        vec_t wg[GU_UNROLL][GU_OUTS], wu[GU_UNROLL][GU_OUTS], xv[GU_UNROLL];
        // 1) issue every weight load of this round (2 * GU_OUTS * GU_UNROLL per lane), then x (L1/L2 hits)
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            const bool ok = c < chunks;
            #pragma unroll
            for (int o = 0; o < GU_OUTS; ++o) {
                wg[j][o] = ldg_chunk(gate_row[o], c, ok);
                wu[j][o] = ldg_chunk(up_row[o], c, ok);
            }
        }
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            xv[j] = ld_dep_chunk(x_row, c, c < chunks);         // x: the previous layer's output
        }
        gate_acc[0] += __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));  // += 0.0f
        // 2) widen and accumulate in FP32 (x widened once, used for all 2 * GU_OUTS rows)
        #pragma unroll
        for (int j = 0; j < GU_UNROLL; ++j) {
            #pragma unroll
            for (int w = 0; w < WORDS; ++w) {
                const float x_lo = bf16_lo(word(xv[j], w)), x_hi = bf16_hi(word(xv[j], w));
                #pragma unroll
                for (int o = 0; o < GU_OUTS; ++o) {
                    gate_acc[o] = fmaf(bf16_lo(word(wg[j][o], w)), x_lo, gate_acc[o]);
                    gate_acc[o] = fmaf(bf16_hi(word(wg[j][o], w)), x_hi, gate_acc[o]);
                    up_acc[o] = fmaf(bf16_lo(word(wu[j][o], w)), x_lo, up_acc[o]);
                    up_acc[o] = fmaf(bf16_hi(word(wu[j][o], w)), x_hi, up_acc[o]);
                }
            }
        }
    }
    (void)ELEMS;

    #pragma unroll
    for (int o = 0; o < GU_OUTS; ++o) {
        const float g = warp_sum(gate_acc[o]);
        const float u = warp_sum(up_acc[o]);
        if (lane == o && i0 + o < inter) {
            const float silu = g / (1.0f + expf(-g));             // IEEE division (no fast-math)
            dst[i0 + o] = f32_to_bf16(silu * u);                  // the one bf16 rounding
        }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_down_3d_batched: out[t, h] = sum_k topk_weights[t, k] * (w2[e_k, h, :] . intermediate[t, k, :])
//   Warp g owns token t = g / ceil(H / DN_OUTS) and the DN_OUTS consecutive hidden units h0 .. h0+DN_OUTS-1.
//   The K x ceil(I / (32 * DN_BYTES / 2)) chunks a lane reads form one flat list of items (slot k major);
//   lane l reads chunks c = l, l + 32, ... of each slot's w2 row(s), DN_UNROLL items loaded into
//   registers before the first FMA, with the matching intermediate chunks (L2 hits) in the same batch.
//   For K <= 32, lane k holds slot k's expert id and routing weight and items get them by warp shuffle
//   (no global load in front of a w2 address); for K > 32 they are read with __ldg.
//   ONE FP32 accumulator per output, acc[o] in each lane's registers: acc += w2 * (weight_k * inter);
//   summed over the warp by shuffles, lane o stores out[t, h0 + o] once (bf16 RNE, or fp32).
//   Any expert id of token t outside [0, E) makes out[t, h0..] NaN and no weights are read.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void down_accumulate(
    float (&acc)[DN_OUTS], const bf16_t* __restrict__ intermediate_t, const bf16_t* __restrict__ w2,
    const int* __restrict__ ids_t, const float* __restrict__ weights_t, int lane, int h0, int hidden, int inter,
    int top_k)
{
    typedef typename Vec<DN_BYTES>::T vec_t;
    constexpr int ELEMS = DN_BYTES / 2;
    constexpr int WORDS = DN_BYTES / 4;
    const int chunks = inter / ELEMS;                             // I % 8 == 0: whole chunks only
    const vec_t* inter_t = reinterpret_cast<const vec_t*>(intermediate_t);
    bool waited = false;  // PDL: the first round's w2 loads are issued before waiting for gate_up
    for (int k0 = 0; k0 < top_k; k0 += DN_SLOTS) {               // DN_SLOTS routed slots per batch
        // lane s < DN_SLOTS reads slot k0 + s's (already range-checked) id and weight; items shuffle them
        const bool lane_slot = lane < DN_SLOTS && k0 + lane < top_k;
        const int batch_id = lane_slot ? __ldg(ids_t + k0 + lane) : 0;
        const float batch_weight = lane_slot ? __ldg(weights_t + k0 + lane) : 0.0f;
        const vec_t* rows[DN_SLOTS][DN_OUTS];                     // w2[e_k, h, :] of each slot and output
        #pragma unroll
        for (int s = 0; s < DN_SLOTS; ++s) {
            const int e = __shfl_sync(FULL_MASK, batch_id, s);     // past-K slots: expert 0, loads masked
            #pragma unroll
            for (int o = 0; o < DN_OUTS; ++o) {
                const int h = min(h0 + o, hidden - 1);            // past-the-end outputs re-read the last row
                rows[s][o] = reinterpret_cast<const vec_t*>(w2 + ((size_t)e * hidden + h) * inter);
            }
        }
        for (int c0 = 0; c0 < chunks; c0 += 32 * DN_UNROLL) {    // DN_UNROLL chunk rounds per slot
            // 1) issue all DN_SLOTS x DN_UNROLL x DN_OUTS w2 loads (branch-free: see ldg_chunk)
            vec_t wv[DN_SLOTS * DN_UNROLL][DN_OUTS];
            #pragma unroll
            for (int s = 0; s < DN_SLOTS; ++s)
                #pragma unroll
                for (int r = 0; r < DN_UNROLL; ++r) {
                    const int c = c0 + r * 32 + lane;
                    const bool ok = k0 + s < top_k && c < chunks;
                    #pragma unroll
                    for (int o = 0; o < DN_OUTS; ++o) wv[s * DN_UNROLL + r][o] = ldg_chunk(rows[s][o], c, ok);
                }
            if (!waited) {  // the intermediate is gate_up's output: read it only after gate_up has finished
                pdl_wait();
                waited = true;
            }
            // the matching intermediate chunks (L2 hits, shared by all DN_OUTS rows). DN_EARLY_INTER=1: issued
            // now, in the same batch as the w2 loads, so a round costs one memory latency; 0: issued after
            // every w2 load has arrived (a DRAM latency, then an L2 latency, per round)
            vec_t iv[DN_SLOTS * DN_UNROLL][1];
#if DN_EARLY_INTER
            const vec_t* inter_r = inter_t;
#else
            const vec_t* inter_r = inter_t + all_loads_arrived(wv);  // + 0, after every w2 load arrived
#endif
            #pragma unroll
            for (int s = 0; s < DN_SLOTS; ++s)
                #pragma unroll
                for (int r = 0; r < DN_UNROLL; ++r) {
                    const int c = c0 + r * 32 + lane;
                    const bool ok = k0 + s < top_k && c < chunks;
                    iv[s * DN_UNROLL + r][0] = ld_dep_chunk(inter_r + (size_t)(ok ? k0 + s : 0) * chunks, c, ok);
                }
#if DN_EARLY_INTER
            acc[0] += __uint_as_float(all_loads_arrived(wv) | all_loads_arrived(iv));  // += 0.0f, after all
#endif
            // 2) per item: intermediate chunk times the routing weight, FMA into the one accumulator per output
            #pragma unroll
            for (int s = 0; s < DN_SLOTS; ++s) {
                const bool live = k0 + s < top_k;
                const float wk = __shfl_sync(FULL_MASK, batch_weight, s);
                #pragma unroll
                for (int r = 0; r < DN_UNROLL; ++r) {
                    const int c = c0 + r * 32 + lane;
                    const bool ok = live && c < chunks;
                    const vec_t iv_r = iv[s * DN_UNROLL + r][0];
                    const float weight = ok ? wk : 0.0f;
                    #pragma unroll
                    for (int w = 0; w < WORDS; ++w) {
                        const float a_lo = weight * bf16_lo(word(iv_r, w)), a_hi = weight * bf16_hi(word(iv_r, w));
                        #pragma unroll
                        for (int o = 0; o < DN_OUTS; ++o) {
                            acc[o] = fmaf(bf16_lo(word(wv[s * DN_UNROLL + r][o], w)), a_lo, acc[o]);
                            acc[o] = fmaf(bf16_hi(word(wv[s * DN_UNROLL + r][o], w)), a_hi, acc[o]);
                        }
                    }
                }
            }
        }
    }
}

extern "C" __global__ void DN_BOUNDS moe_down_3d_batched(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const bf16_t* __restrict__ w2,            // [E, H, I]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    const int lane = threadIdx.x & 31;
    const long long groups = (hidden + DN_OUTS - 1) / DN_OUTS;   // warps per token
    const long long warp = (long long)blockIdx.x * DN_WARPS + (threadIdx.x >> 5);
    if (warp >= (long long)tokens * groups) return;              // whole warp leaves together
    const long long t = warp / groups;
    const int h0 = (int)(warp - t * groups) * DN_OUTS;
    const int* ids_t = topk_ids + t * top_k;
    const float* weights_t = topk_weights + t * top_k;

    // every expert id of the token is range-checked (lane k checks slots k, k + 32, ...) before any w2 read
    bool bad = false;
    for (int k = lane; k < top_k; k += 32) bad |= (unsigned)__ldg(ids_t + k) >= (unsigned)experts;
    const bool token_bad = __any_sync(FULL_MASK, bad);

    float acc[DN_OUTS];
    #pragma unroll
    for (int o = 0; o < DN_OUTS; ++o) acc[o] = 0.0f;
    if (!token_bad) {
        const bf16_t* intermediate_t = intermediate + t * top_k * (long long)inter;
        down_accumulate(acc, intermediate_t, w2, ids_t, weights_t, lane, h0, hidden, inter, top_k);
    }
    pdl_wait();  // (again, for bad tokens and idle lanes: a no-op once waited) before out is written
    pdl_release();

    #pragma unroll
    for (int o = 0; o < DN_OUTS; ++o) {
        float v = warp_sum(acc[o]);
        if (token_bad) v = __int_as_float(0x7fc00000);
        if (lane == o && h0 + o < hidden) {
            const long long idx = t * hidden + h0 + o;
            if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
            else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);  // the one final rounding
        }
    }
}
"""

# Compile-time knobs and their concrete defaults (what the offline report compiles as "defaults"; those of
# qwen3-30b-a3b at T = 1). At run time the AUTO_KNOBS at 0 mean "auto": the rules pick them from the problem's
# dims (see _auto_down).
DEFAULTS: dict[str, int] = {
    "GU_WARPS": 2,  # warps per block
    "GU_OUTS": 1,  # consecutive neurons per warp (x loads reused)
    "GU_UNROLL": 8,  # chunks per row in flight per lane (x 2 rows x GU_OUTS): 16 x 8 B loads + 8 of x
    "GU_BYTES": 8,  # bytes per lane per load: 4, 8 or 16 (16 with UNROLL 2 needs 46 registers)
    "GU_MIN_BLOCKS": 0,  # __launch_bounds__ min blocks / SM (0: none; ptxas uses 40 registers -> 48 warps / SM)
    "DN_WARPS": 4,
    "DN_OUTS": 1,  # consecutive hidden units per warp (intermediate loads reused)
    "DN_SLOTS": 4,  # routed slots whose w2 rows are loaded together
    "DN_UNROLL": 1,  # 16-byte chunk rounds per slot in flight: DN_SLOTS x DN_UNROLL x DN_OUTS loads per lane
    "DN_BYTES": 16,
    "DN_MIN_BLOCKS": 8,  # 8 x 4 warps -> <= 64 registers, 32 warps / SM (what 4 x 16-byte loads need);
    # 0 = auto (from DN_SLOTS x DN_UNROLL x DN_OUTS, see _down_min_blocks); 1 = effectively no cap
    "DN_EARLY_INTER": 1,  # 1: intermediate chunks loaded in the same batch as w2 (one latency per round)
    "PDL": 1,  # programmatic dependent launch: down's first w2 loads overlap gate_up's tail (sm_90+; 0 before)
}
AUTO_KNOBS = ("DN_SLOTS", "DN_UNROLL", "DN_MIN_BLOCKS", "DN_WARPS")
LIMITS = {
    "GU_WARPS": (1, 32), "DN_WARPS": (0, 32), "GU_OUTS": (1, 32), "DN_OUTS": (1, 32),
    "GU_UNROLL": (1, 64), "DN_UNROLL": (0, 64), "DN_SLOTS": (0, 32),
    "GU_MIN_BLOCKS": (0, 32), "DN_MIN_BLOCKS": (0, 32), "PDL": (0, 1), "DN_EARLY_INTER": (0, 1),
}


def _rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """The family's rules on validated knobs: load widths of 4, 8 or 16 bytes; the auto knobs (0) filled from
    ``dims`` (:func:`_auto_down`, :func:`_down_min_blocks`), or from :data:`DEFAULTS` without dims."""
    for key in ("GU_BYTES", "DN_BYTES"):
        if values[key] not in (4, 8, 16):
            raise ValueError(f"{key} must be 4, 8 or 16, got {values[key]}")
    auto = _auto_down(dims, values) if dims is not None else {k: DEFAULTS[k] for k in AUTO_KNOBS}
    for key in ("DN_SLOTS", "DN_UNROLL", "DN_WARPS"):
        if values[key] == 0:
            values[key] = auto[key]
    if values["DN_MIN_BLOCKS"] == 0:
        values["DN_MIN_BLOCKS"] = _down_min_blocks(values) if dims is not None else DEFAULTS["DN_MIN_BLOCKS"]
    return values


# down warps that fit in one wave at ~104 registers (8 slots x 16 B in flight): 16 warps x 132 SMs on the H200
ONE_WAVE_DOWN_WARPS = 2048


def _auto_down(dims: Dims, values: dict[str, int]) -> dict[str, int]:
    """Auto loads in flight per lane for the down kernel: one chunk round of up to 4 routed slots; or of 8, in
    one-warp blocks, when the down grid is one wave even at the registers 8 slots need. What the H200 sweeps
    chose: results/sweep-dn-*-early-inter.json (slots), results/sweep-bulk-*.json (one-warp blocks)."""
    warps = dims.tokens * -(-dims.hidden // values["DN_OUTS"])
    one_wave = warps <= ONE_WAVE_DOWN_WARPS
    slots = max(1, min(dims.top_k, (8 if one_wave else 4) // values["DN_OUTS"] or 1, 32))
    return {"DN_SLOTS": slots, "DN_UNROLL": 1, "DN_MIN_BLOCKS": 0, "DN_WARPS": 1 if one_wave else DEFAULTS["DN_WARPS"]}


def _down_min_blocks(values: dict[str, int]) -> int:
    """__launch_bounds__ min blocks that caps the down kernel's registers near what its loads need, fitted to the
    sm_90 offline report (4 x 1 items -> 64 registers, 8 x 1 -> 104, 4 x 3 -> 128); a lower cap spills
    (tests/test_warp_decode_cupy.py compiles the sweep grid's auto caps and asserts zero spills)."""
    items = values["DN_SLOTS"] * values["DN_UNROLL"]
    per_item = (values["DN_OUTS"] + 1) * values["DN_BYTES"] // 4
    registers = 24 + 2 * values["DN_SLOTS"] * values["DN_OUTS"] + items * per_item
    # with 4+ warps per block the floor below leaves headroom; small blocks get 16 registers of it explicitly
    registers = min(255, -(-registers // 8) * 8 + (16 if values["DN_WARPS"] < 4 else 0))
    return max(1, min(32, 65536 // (registers * 32 * values["DN_WARPS"])))  # 32: resident blocks per SM


# ---------------------------------------------------------------------------------------------------
# Workspace and launches (no allocation, no host sync)
# ---------------------------------------------------------------------------------------------------
def make_workspace(tokens: int, top_k: int, intermediate: int) -> Any:
    """The [T, K, I] bf16 intermediate buffer (the only buffer warp decode needs)."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    import cupy

    return cupy.empty((int(tokens), int(top_k), int(intermediate)), dtype=BF16)


def _workspace(dims: Dims, params: dict[str, int]) -> Any:
    return make_workspace(dims.tokens, dims.top_k, dims.intermediate)


def _blocks(warps: int, warps_per_block: int) -> int:
    return max(1, -(-warps // warps_per_block))


def _launch_gate_up(kernel: Any, params: dict[str, int], dims: Dims, x: Any, w13: Any, topk_ids: Any,
                    intermediate: Any) -> None:
    groups = -(-dims.intermediate // params["GU_OUTS"])
    warps = dims.tokens * dims.top_k * groups
    launch_ex(
        kernel, (_blocks(warps, params["GU_WARPS"]),), (params["GU_WARPS"] * 32,),
        (x, w13, topk_ids, intermediate, np.int32(dims.tokens), np.int32(dims.hidden),
         np.int32(dims.intermediate), np.int32(dims.experts), np.int32(dims.top_k)),
        programmatic=bool(params["PDL"]),
    )


def _launch_down(kernel: Any, params: dict[str, int], dims: Dims, intermediate: Any, w2: Any, topk_ids: Any,
                 topk_weights: Any, out: Any) -> None:
    blocks = _blocks(dims.tokens * -(-dims.hidden // params["DN_OUTS"]), params["DN_WARPS"])
    out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
    launch_ex(
        kernel, (blocks,), (params["DN_WARPS"] * 32,),
        (intermediate, w2, topk_ids, topk_weights, out, out_f32, np.int32(dims.tokens), np.int32(dims.hidden),
         np.int32(dims.intermediate), np.int32(dims.experts), np.int32(dims.top_k)),
        programmatic=bool(params["PDL"]),
    )


def _stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
            out: Any) -> list[Stage]:
    kernels, params, dims, workspace = compiled.kernels, compiled.params, compiled.dims, compiled.workspace
    return [
        ("gate_up", lambda: _launch_gate_up(kernels[GATE_UP], params, dims, x, w13, topk_ids, workspace)),
        ("down", lambda: _launch_down(kernels[DOWN], params, dims, workspace, w2, topk_ids, topk_weights, out)),
    ]


FAMILY = KernelFamily(
    name="warp-decode",
    source=CudaSource(
        name="warp_decode_cupy",
        code=CODE,
        kernels=(GATE_UP, DOWN),
        defaults=dict(DEFAULTS),
        # which knob is each kernel's warps per block (tools.compile_report reads this for occupancy)
        warps_knobs={GATE_UP: "GU_WARPS", DOWN: "DN_WARPS"},
        knob_prefixes={GATE_UP: "GU_", DOWN: "DN_"},  # no GU_ knob in the down's code, no DN_ one in the gate_up's
        description="warp decode: one warp per output scalar (gate_up, down), CuPy RawKernel",
    ),
    limits=LIMITS,
    auto_knobs=AUTO_KNOBS,
    rules=_rules,
    device_needs={"PDL": 90},  # griddepcontrol: sm_90+ (0 before: the kernels then wait for nothing)
    workspace=_workspace,
    stages=_stages,
)
SOURCE = FAMILY.source
# what the offline report compiles besides the defaults: the knobs every preset resolves to
FAMILY.source.variants = preset_variants(FAMILY.resolve, DEFAULTS)


def resolve_params(dims: Dims | None = None, **params: Any) -> dict[str, int]:
    """Every knob as an int, validated, the auto ones (0) filled from ``dims`` (``FAMILY.resolve``)."""
    return FAMILY.resolve(dims, **params)


# ---------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------
def _check_stage_array(name: str, arr: Any, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype}")
    if tuple(int(d) for d in arr.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


# ---------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------
def warp_decode(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    out: Any = None,
    workspace: Any = None,
    **params: Any,
) -> Any:
    """One MoE decode layer by warp decode on CuPy arrays; returns ``out`` [T, H] (bf16 unless given fp32).

    With ``out`` and ``workspace`` (from :func:`make_workspace`) given, nothing is allocated and nothing
    syncs with the host (value checks of ``topk_ids`` are skipped while a CUDA graph is captured; the
    kernels guard every id). ``params`` are compile-time knobs (see :data:`DEFAULTS`; ``AUTO_KNOBS`` 0: auto).
    """
    cupy = require_cupy(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, check_values=False)  # kinds, dtypes, shapes
    if out is not None:
        require_cupy(out=out)
        check_out(out, dims, cupy)
    if workspace is not None:
        require_cupy(workspace=workspace)
        _check_stage_array("workspace", workspace, BF16, (dims.tokens, dims.top_k, dims.intermediate))
    compiled = FAMILY.compile(dims, workspace=workspace, **params)  # knobs checked; a workspace if none given
    check_inputs(x, w13, w2, topk_ids, topk_weights)  # ids in range, weights finite (skipped under capture)
    check_aligned(x=x, w13=w13, w2=w2, workspace=compiled.workspace)
    if out is None:
        out = cupy.empty((dims.tokens, dims.hidden), dtype=BF16)
    compiled.run(x, w13, w2, topk_ids, topk_weights, out)
    return out


def gate_up(x: Any, w13: Any, topk_ids: Any, intermediate: Any, **params: Any) -> Any:
    """Stage 1 alone: ``intermediate[t, k, :] = bf16(SiLU(gate) * up)``; returns ``intermediate``."""
    require_cupy(x=x, w13=w13, topk_ids=topk_ids, intermediate=intermediate)
    if x.ndim != 2 or w13.ndim != 3 or topk_ids.ndim != 2:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], topk_ids [T, K] expected, got {x.shape}, {w13.shape}, {topk_ids.shape}"
        )
    tokens, hidden = (int(d) for d in x.shape)
    experts, two_i = int(w13.shape[0]), int(w13.shape[1])
    top_k = int(topk_ids.shape[1])
    dims = Dims(tokens, hidden, two_i // 2, experts, top_k)
    if min(tokens, experts, top_k) < 1 or two_i < 2 or two_i % 2 or hidden % 8 or (two_i // 2) % 8:
        raise ValueError(f"bad sizes: x {x.shape}, w13 {w13.shape}, topk_ids {topk_ids.shape}")
    _check_stage_array("x", x, BF16, (tokens, hidden))
    _check_stage_array("w13", w13, BF16, (experts, two_i, hidden))
    _check_stage_array("topk_ids", topk_ids, np.dtype(np.int32), (tokens, top_k))
    _check_stage_array("intermediate", intermediate, BF16, (tokens, top_k, dims.intermediate))
    compiled = FAMILY.compile(dims, workspace=intermediate, **params)
    check_aligned(x=x, w13=w13, intermediate=intermediate)
    _launch_gate_up(compiled.kernels[GATE_UP], compiled.params, dims, x, w13, topk_ids, intermediate)
    return intermediate


def down(intermediate: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any, **params: Any) -> Any:
    """Stage 2 alone: ``out[t, h] = sum_k weight * w2[e, h, :] . intermediate[t, k, :]``; returns ``out``."""
    require_cupy(intermediate=intermediate, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights, out=out)
    if intermediate.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"intermediate [T, K, I] and w2 [E, H, I] expected, got {intermediate.shape}, {w2.shape}")
    tokens, top_k, inter = (int(d) for d in intermediate.shape)
    experts, hidden = int(w2.shape[0]), int(w2.shape[1])
    dims = Dims(tokens, hidden, inter, experts, top_k)
    if min(tokens, top_k, inter, experts, hidden) < 1 or hidden % 8 or inter % 8:
        raise ValueError(f"bad sizes: intermediate {intermediate.shape}, w2 {w2.shape}")
    _check_stage_array("intermediate", intermediate, BF16, (tokens, top_k, inter))
    _check_stage_array("w2", w2, BF16, (experts, hidden, inter))
    _check_stage_array("topk_ids", topk_ids, np.dtype(np.int32), (tokens, top_k))
    _check_stage_array("topk_weights", topk_weights, np.dtype(np.float32), (tokens, top_k))
    check_out(out, dims, array_module(out))
    compiled = FAMILY.compile(dims, workspace=intermediate, **params)
    check_aligned(intermediate=intermediate, w2=w2)
    _launch_down(compiled.kernels[DOWN], compiled.params, dims, intermediate, w2, topk_ids, topk_weights, out)
    return out


# ---------------------------------------------------------------------------------------------------
# Variant registry
# ---------------------------------------------------------------------------------------------------
VARIANT = register(
    FAMILY.variant(
        "cupy:warp-decode",
        reference_mode="warp_decode",
        description="warp decode, CUDA C via CuPy RawKernel: one warp per output scalar, 16-byte loads",
        grid={
            "GU_WARPS": [4, 8],
            "GU_OUTS": [1, 2],
            "GU_UNROLL": [1, 2, 4],
            "DN_WARPS": [2, 4, 8],
            "DN_OUTS": [1, 2],
            "DN_SLOTS": [0, 1, 2, 4],
            "DN_UNROLL": [0, 2, 3, 4, 6],
        },
    )
)
