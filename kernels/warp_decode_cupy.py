"""Warp decode as CuPy RawKernel CUDA C: ``moe_gate_up_3d_batched`` then ``moe_down_3d_batched``.

Each warp owns one output scalar (or ``*_OUTS`` consecutive ones, reusing its activation loads):

* gate_up: warp (t, k, i) reads gate row i and up row i of expert ``topk_ids[t, k]`` (``w13[e, i, :]``,
  ``w13[e, I + i, :]``) once, streams ``x[t]`` once for both dot products, accumulates in FP32 registers,
  reduces with shuffles and writes ``bf16(SiLU(g) * u)`` into the [T, K, I] intermediate.
* down: warp (t, h) loops over the K routed experts, reads row h of each ``w2[e]``, dots it with
  ``intermediate[t, k, :]`` and folds the routing weight into ONE FP32 accumulator; reduce, write once.

No shared memory, no atomics, no inter-warp sync, no buffer besides the bf16 intermediate. Every expert id
is range-checked in the kernels (bad id -> NaN for that token, no weight read).

Public API: :func:`warp_decode` (what ``kernels.warp_decode(..., backend="cupy")`` calls), the stages
:func:`gate_up` and :func:`down`, :func:`make_workspace`, :func:`resolve_params`; variant
``"cupy:warp-decode"`` in :mod:`kernels.variants`.

Loads in flight. ptxas, left alone, sinks each weight load next to its FMAs (one load in flight per lane,
whatever the unroll). ``all_loads_arrived`` folds every loaded word into a zero that the accumulators (gate_up)
or the intermediate addresses (down) depend on, so all of a round's weight loads are issued before the first
FMA -- checked in the SASS (nvdisasm) of the defaults: gate_up issues 8 LDG.64 then FMAs, down 12 LDG.128.

With PDL (on from sm_90) down's blocks start while gate_up drains; loads of gate_up's output go through
``ld_dep`` (a volatile asm load the compiler cannot hoist above ``griddepcontrol.wait``). ``DN_STAGED`` (off) is a
down that copies its w2 share into shared memory before that wait. The defaults (``DEFAULTS``, ``_auto_down``) are
what won the H200 sweeps; the predictions, sweeps and final numbers: notes/FINDINGS.md ("Strict warp decode").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import (
    CudaSource,
    device_sm_count,
    for_device,
    get_kernel,
    launch_ex,
    prefer_shared_memory,
    preset_variants,
    register_source,
    validate_knobs,
)
from kernels.contract import BF16, Dims, array_module, check_aligned, check_inputs, check_out, require_cupy
from kernels.device_helpers import (
    MMA_HELPERS,
    PDL_HELPERS,
    STAGED_TAIL_HELPERS,
    WARP_HELPERS,
    padded_row_bytes,
    staged_parts,
)
from kernels.variants import Variant, register

GATE_UP = "moe_gate_up_3d_batched"
DOWN = "moe_down_3d_batched"
STAGED_DOWN = "moe_down_3d_staged"  # DN_STAGED=1's down (sm_90+)

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
static_assert(GU_PREFETCH == 0 || (GU_PREFETCH == 1 && GU_OUTS <= 16), "GU_PREFETCH 0 or 1 (1 needs GU_OUTS <= 16)");
static_assert(DN_PREFETCH == 0 || DN_PREFETCH == 1, "DN_PREFETCH must be 0 or 1");
static_assert(DN_BULK == 0 || (DN_BULK == 1 && DN_OUTS == 1 && DN_BYTES == 16), "DN_BULK=1: DN_OUTS 1, DN_BYTES 16");
static_assert(DN_STAGED == 0 || DN_STAGED == 1, "DN_STAGED must be 0 or 1");
static_assert(DN_ROWS >= 1 && DN_ROWS <= 1024, "DN_ROWS must be 1..1024");
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
#if GU_PREFETCH  // lane o: gate row o, lane 16 + o: up row o, past what the first round loads anyway
    {
        const unsigned first = 32u * GU_UNROLL * GU_BYTES, row_bytes = 2u * (unsigned)hidden;
        #pragma unroll
        for (int o = 0; o < GU_OUTS; ++o) {
            if (row_bytes > first && lane == o) prefetch_l2((const char*)gate_row[o] + first, row_bytes - first);
            if (row_bytes > first && lane == 16 + o) prefetch_l2((const char*)up_row[o] + first, row_bytes - first);
        }
    }
#endif

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

#if DN_BULK || DN_STAGED
// the 32-bit shared-memory address of a generic pointer (the opt-in DN_BULK and DN_STAGED copies take it)
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
#endif

#if DN_BULK
// DN_BULK=1: the warp's K w2 rows land in its OWN slice of the block's dynamic shared memory through the
// copy engine (cp.async.bulk, one instruction per row, completion counted in bytes on a per-warp mbarrier).
// The whole row set is requested at once without holding registers, so a small down grid (T = 1) keeps all
// of its bytes in flight in one round instead of DN_SLOTS x 16 B per lane per round. No warp reads another
// warp's slice; there is no block-level synchronisation.
extern __shared__ __align__(16) unsigned char dn_smem[];  // [DN_WARPS] barriers (16 B each), then slices


__device__ __forceinline__ void down_accumulate_bulk(
    float (&acc)[DN_OUTS], const bf16_t* __restrict__ intermediate_t, const bf16_t* __restrict__ w2,
    const int* __restrict__ ids_t, const float* __restrict__ weights_t, int lane, int h0, int hidden, int inter,
    int top_k)
{
    const int warp_in_block = threadIdx.x >> 5;
    const unsigned row_bytes = 2u * (unsigned)inter;              // I % 8 == 0: a multiple of 16
    const unsigned bar = smem_u32(dn_smem + 16 * warp_in_block);
    const uint4* rows = reinterpret_cast<const uint4*>(
        dn_smem + 16 * DN_WARPS + (size_t)warp_in_block * top_k * row_bytes);  // [K][I] bf16, this warp's
    if (lane == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
        asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar), "r"(row_bytes * (unsigned)top_k) : "memory");
    }
    __syncwarp();
    for (int k = lane; k < top_k; k += 32) {                      // lane k: row h0 of expert e_k (range-checked)
        const bf16_t* src = w2 + ((size_t)__ldg(ids_t + k) * hidden + h0) * inter;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_u32(rows) + (unsigned)k * row_bytes), "l"(src), "r"(row_bytes), "r"(bar)
                     : "memory");
    }
    pdl_wait();  // w2 is requested; the intermediate is gate_up's output
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(bar) : "memory");
    }
    // same per-lane order as the register path with DN_UNROLL 1: slot groups of DN_SLOTS, chunk rounds, slots
    const int chunks = inter / 8;
    const uint4* inter_t = reinterpret_cast<const uint4*>(intermediate_t);
    for (int k0 = 0; k0 < top_k; k0 += DN_SLOTS)
        for (int c = lane; c < chunks; c += 32)
            #pragma unroll
            for (int s = 0; s < DN_SLOTS; ++s) {
                const int k = k0 + s;
                if (k < top_k) {
                    const uint4 wv = rows[(size_t)k * chunks + c];
                    const uint4 iv = ld_dep(inter_t + (size_t)k * chunks + c);  // L1/L2 hit, after pdl_wait
                    const float wk = __ldg(weights_t + k);
                    #pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        const float a_lo = wk * bf16_lo(word(iv, w)), a_hi = wk * bf16_hi(word(iv, w));
                        acc[0] = fmaf(bf16_lo(word(wv, w)), a_lo, acc[0]);
                        acc[0] = fmaf(bf16_hi(word(wv, w)), a_hi, acc[0]);
                    }
                }
            }
}
#endif

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
#if DN_PREFETCH  // item (slot k, output o) -> lane item % 32: its w2 row, past what the first round loads
        for (int item = lane; item < top_k * DN_OUTS; item += 32) {
            const int k = item / DN_OUTS, o = item - k * DN_OUTS;
            const unsigned row_bytes = 2u * (unsigned)inter;
            const unsigned skip = k < DN_SLOTS ? min(row_bytes, 32u * DN_UNROLL * DN_BYTES) : 0u;
            const bf16_t* row = w2 + ((size_t)__ldg(ids_t + k) * hidden + min(h0 + o, hidden - 1)) * inter;
            if (row_bytes > skip) prefetch_l2((const char*)row + skip, row_bytes - skip);
        }
#endif
        const bf16_t* intermediate_t = intermediate + t * top_k * (long long)inter;
#if DN_BULK
        down_accumulate_bulk(acc, intermediate_t, w2, ids_t, weights_t, lane, h0, hidden, inter, top_k);
#else
        down_accumulate(acc, intermediate_t, w2, ids_t, weights_t, lane, h0, hidden, inter, top_k);
#endif
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

#if DN_STAGED && !defined(WD_HOST_EMULATION)   // compiled only when asked for
""" + MMA_HELPERS + STAGED_TAIL_HELPERS + r"""
// ------------------------------------------------------------------------------------------------
// moe_down_3d_staged (DN_STAGED=1, sm_90+): out[t, h] for a layer whose w2 share per block fits in shared
//   memory (qwen3-30b-a3b T = 1: 8 slots x 16 rows x 1.5 KiB = 192 KiB a block, one block per SM).
//   Block b owns hidden rows h0 = b * DN_ROWS .. h0 + DN_ROWS - 1 of ALL T tokens.
//   1) Before the PDL wait, warp w copies rows w, w + DN_WARPS, ... of the (t, k) slots' w2[e, h0 + r, :]
//      into padded shared rows (stride = 64 mod 128 bytes: conflict-free for the fragment loads below) with
//      cp.async (16 bytes a lane, no registers held). (A first version asked the copy engine, cp.async.bulk,
//      per row or per slot: 14.9 us for this kernel alone at qwen3-30b T = 1 against 8.8 for the plain down.)
//      The block is resident beside gate_up's blocks (gate_up prefers the maximum shared-memory carveout,
//      kernels_for), so w2 streams while gate_up still reads w13: what is left after gate_up is the tail.
//   2) After the wait (gate_up complete) the block copies intermediate[T, K, I] into shared memory.
//   3) Items (slot p = t * K + k, 16-row tile m, k part s): A = the 16 staged rows, B column = the slot's
//      intermediate row (every column the same), FP32 in the tensor core (mma_k32, two accumulator chains);
//      lane (g, 0) ends with rows g, g + 8 of column 0, times the routing weight into partial[p][s][row].
//   4) Every (t, row): the partials summed over k and s in a fixed order (deterministic, one writer per output) and
//      written once (bf16 RNE or fp32). A token with any id outside [0, E) gets NaN; none of its w2 is read.
// Shared memory: [T flags, padded to 16 B][w2: T*K x DN_ROWS padded rows][intermediate:
//   T*K x I bf16][partial: T*K x parts x DN_ROWS floats] (staged_shared_bytes in Python says the same)
// ------------------------------------------------------------------------------------------------
// No register cap: ~91 a thread (a 64 cap spilled), so DN_WARPS 4 takes 12 K registers beside gate_up's warps
extern "C" __global__ void __launch_bounds__(DN_WARPS * 32, 1) moe_down_3d_staged(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const bf16_t* __restrict__ w2,            // [E, H, I]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    extern __shared__ __align__(16) unsigned char staged_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h0 = blockIdx.x * DN_ROWS;
    const int rows = min(DN_ROWS, hidden - h0);                      // the last block may own fewer
    const int pairs = tokens * top_k;
    const int chunks = inter / 8;                                    // 16-byte chunks (I % 8 == 0)
    const int stride = staged_row_stride(inter);
    const int parts = staged_parts<DN_ROWS, DN_WARPS>(chunks, pairs);   // k parts per (slot, tile) item
    int* token_bad = reinterpret_cast<int*>(staged_smem);
    unsigned char* w2_rows = staged_smem + ((size_t)4 * tokens + 15) / 16 * 16;
    uint4* inter_rows = reinterpret_cast<uint4*>(w2_rows + (size_t)pairs * DN_ROWS * stride);
    float* partial = reinterpret_cast<float*>(inter_rows + (size_t)pairs * chunks);   // [pairs][parts][DN_ROWS]

    // 1) range-check every id (topk_ids was complete before gate_up started: readable before the wait), then
    //    request the good tokens' w2 rows
    for (int t = tid; t < tokens; t += DN_WARPS * 32) token_bad[t] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += DN_WARPS * 32)
        if ((unsigned)__ldg(topk_ids + p) >= (unsigned)experts) token_bad[p / top_k] = 1;   // same value: benign
    __syncthreads();
    for (int pr = warp; pr < pairs * rows; pr += DN_WARPS) {         // warp-uniform: row r of slot p
        // slot-minor and rotated by block: at any moment the GPU's copies spread over every routed expert
        const int r = pr / pairs, p = (pr - r * pairs + blockIdx.x) % pairs;
        if (token_bad[p / top_k]) continue;
        const uint4* src = reinterpret_cast<const uint4*>(w2 + ((size_t)__ldg(topk_ids + p) * hidden + h0 + r) * inter);
        const unsigned dst = smem_u32(w2_rows + ((size_t)p * DN_ROWS + r) * stride);
        for (int c = lane; c < chunks; c += 32)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + 16u * c), "l"(src + c) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");

    // 2) gate_up's output, once it is complete
    pdl_wait();
    pdl_release();
    const uint4* inter_global = reinterpret_cast<const uint4*>(intermediate);
    for (int j = tid; j < pairs * chunks; j += DN_WARPS * 32) inter_rows[j] = ld_dep(inter_global + j);
    asm volatile("cp.async.wait_all;" ::: "memory");                 // this thread's w2 copies have landed
    __syncthreads();                                                 // ... and everyone's

    // 3) tensor-core dots: item (p, tile, part) -> partial[p][part][row] (weighted)
    staged_dots<DN_ROWS, DN_WARPS>(w2_rows, inter_rows, partial, token_bad, topk_weights, pairs, top_k, rows, chunks,
                                   stride, parts, warp, lane);
    __syncthreads();

    // 4) every (t, row): sum over slots and parts in order, one write
    staged_outputs<DN_ROWS, DN_WARPS>(partial, token_bad, out, out_f32, tokens, top_k, rows, parts, hidden, h0, tid);
}
#endif
"""

# Compile-time knobs and their concrete defaults (what the offline report compiles as "defaults"; those of
# qwen3-30b-a3b at T = 1). At run time DN_SLOTS / DN_UNROLL / DN_MIN_BLOCKS = 0 mean "auto": resolve_params()
# picks them from the problem's dims (see _auto_down).
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
    "GU_PREFETCH": 0,  # 1: bulk L2 prefetch of the rest of each owned row at the start (sm_90+)
    "DN_PREFETCH": 0,  # 1: bulk L2 prefetch of every routed w2 row of the warp at the start (sm_90+)
    "DN_BULK": 0,  # 1: each warp's w2 rows copied into its shared-memory slice by cp.async.bulk (sm_90+)
    "DN_EARLY_INTER": 1,  # 1: intermediate chunks loaded in the same batch as w2 (one latency per round)
    "PDL": 1,  # programmatic dependent launch: down's first w2 loads overlap gate_up's tail (sm_90+; 0 before)
    "DN_STAGED": 0,  # 1: moe_down_3d_staged -- each block's whole w2 share copied into shared memory while
    # gate_up runs (sm_90+; needs T x K x DN_ROWS x I x 2 bytes + the intermediate per block)
    "DN_ROWS": 16,  # DN_STAGED's hidden rows per block (0 = auto: one block per SM at most, see _staged_rows)
}
AUTO_KNOBS = ("DN_SLOTS", "DN_UNROLL", "DN_MIN_BLOCKS", "DN_WARPS", "DN_ROWS")
LIMITS = {
    "GU_WARPS": (1, 32), "DN_WARPS": (0, 32), "GU_OUTS": (1, 32), "DN_OUTS": (1, 32),
    "GU_UNROLL": (1, 64), "DN_UNROLL": (0, 64), "DN_SLOTS": (0, 32),
    "GU_MIN_BLOCKS": (0, 32), "DN_MIN_BLOCKS": (0, 32), "PDL": (0, 1), "DN_EARLY_INTER": (0, 1),
    "GU_PREFETCH": (0, 1), "DN_PREFETCH": (0, 1), "DN_BULK": (0, 1), "DN_STAGED": (0, 1), "DN_ROWS": (0, 1024),
}


def resolve_params(dims: Dims | None = None, **params: Any) -> dict[str, int]:
    """Validate the knobs and fill the auto ones (``DN_SLOTS`` / ``DN_UNROLL`` / ``DN_MIN_BLOCKS`` = 0) from
    ``dims``; returns every knob as an int. Without ``dims`` auto knobs take :data:`DEFAULTS`."""
    values = validate_knobs("warp-decode", params, DEFAULTS, LIMITS, AUTO_KNOBS)
    for key in ("GU_BYTES", "DN_BYTES"):
        if values[key] not in (4, 8, 16):
            raise ValueError(f"{key} must be 4, 8 or 16, got {values[key]}")
    auto = _auto_down(dims, values) if dims is not None else {k: DEFAULTS[k] for k in AUTO_KNOBS}
    for key in ("DN_SLOTS", "DN_UNROLL", "DN_WARPS"):
        if values[key] == 0:
            values[key] = auto[key]
    if values["DN_MIN_BLOCKS"] == 0:
        values["DN_MIN_BLOCKS"] = _down_min_blocks(values) if dims is not None else DEFAULTS["DN_MIN_BLOCKS"]
    if values["DN_STAGED"] and values["DN_BULK"]:
        raise ValueError("DN_STAGED=1 replaces the down kernel: it takes DN_BULK=0")
    if values["DN_BULK"]:
        if values["DN_OUTS"] != 1 or values["DN_BYTES"] != 16:
            raise ValueError(
                f"DN_BULK=1 needs DN_OUTS=1 and DN_BYTES=16, got {values['DN_OUTS']} and {values['DN_BYTES']}"
            )
        shared = down_shared_bytes(values, dims) if dims is not None else 0
        if shared > SHARED_LIMIT:
            raise ValueError(f"DN_BULK=1 needs DN_WARPS x (16 + K x I x 2) = {shared} bytes of shared memory per "
                             f"block, over {SHARED_LIMIT}: lower DN_WARPS or use DN_BULK=0")
    if not values["DN_STAGED"]:
        values["DN_ROWS"] = DEFAULTS["DN_ROWS"]  # unused: one compiled module whatever was asked
    else:
        if params.get("DN_WARPS", 0) == 0:
            values["DN_WARPS"] = STAGED_DOWN_WARPS
        if values["DN_ROWS"] == 0:
            values["DN_ROWS"] = _staged_rows(dims) if dims is not None else DEFAULTS["DN_ROWS"]
        shared = staged_shared_bytes(values, dims) if dims is not None else 0
        if shared > SHARED_LIMIT:
            raise ValueError(
                f"DN_STAGED=1 needs T x K x (DN_ROWS padded w2 rows + the intermediate row + partials) = {shared} "
                f"bytes of shared memory per block (T={dims.tokens}, K={dims.top_k}, DN_ROWS={values['DN_ROWS']}, "
                f"I={dims.intermediate}), over {SHARED_LIMIT}: lower DN_ROWS or use DN_STAGED=0"
            )
    return values


STAGED_DOWN_WARPS = 8  # auto DN_WARPS of the staged down (its compute runs from shared memory after gate_up)


def _staged_rows(dims: Dims) -> int:
    """Auto ``DN_ROWS``: the fewest rows per block that still give at most one block per SM of the current GPU
    (132 SMs -- the H200 -- without one), so every block's copies start at once beside gate_up."""
    sms = device_sm_count(default=132)
    return max(1, -(-dims.hidden // sms))


def staged_shared_bytes(params: dict[str, int], dims: Dims) -> int:
    """Dynamic shared memory of ``moe_down_3d_staged`` (the kernel's layout comment): T flags, the
    staged w2 rows (2I bytes padded to 64 mod 128), the intermediate and the FP32 partials."""
    pairs, rows, inter = dims.tokens * dims.top_k, params["DN_ROWS"], dims.intermediate
    stride = padded_row_bytes(inter)
    parts = staged_parts(inter, rows, params["DN_WARPS"], pairs)
    return -(-4 * dims.tokens // 16) * 16 + pairs * (rows * stride + 2 * inter + 4 * parts * rows)


# down warps that fit in one wave at ~104 registers (8 slots x 16 B in flight): 16 warps x 132 SMs on the H200
ONE_WAVE_DOWN_WARPS = 2048


def _auto_down(dims: Dims, values: dict[str, int]) -> dict[str, int]:
    """Loads in flight per lane for the down kernel: one chunk round of up to 4 routed slots, or 8 when the
    down grid is small enough to be one wave even at the registers 8 slots need.

    Measured on the H200 (tools.sweep, decode-step graphs, results/sweep-dn-*-early-inter.json, DN_EARLY_INTER=1,
    PDL=1): qwen3-30b-a3b T = 1 (2048 down warps) 8 x 1 23.1 us vs 4 x 1 23.8 (22.4 with DN_EARLY_INTER=0);
    T = 8 (16384 warps) 4 x 1 136 us vs 8 x 1 154; qwen3-235b-a22b T = 1 (4096 warps) 4 x 1 74.7 us, 2 x 2
    73.4, 8 x 1 80.6. More loads per warp only pay while every warp is resident anyway; otherwise 4 loads at
    64 registers (32 warps / SM) win on occupancy (the first sweep, results/sweep-dn-*.json, said the same).
    One-wave grids also get one-warp blocks (DN_WARPS 1): 2048 warps spread 16 / 15 per SM instead of 4- or
    3-block lumps -- qwen3-30b-a3b T = 1 21.8 us vs 23.0 (DN_WARPS 4) and 23.2 (2); at T = 2 (4096 warps)
    4-warp blocks stay ahead, 37.8 vs 39.7 us (results/sweep-bulk-*.json).
    """
    warps = dims.tokens * -(-dims.hidden // values["DN_OUTS"])
    one_wave = warps <= ONE_WAVE_DOWN_WARPS
    slots = max(1, min(dims.top_k, (8 if one_wave else 4) // values["DN_OUTS"] or 1, 32))
    return {"DN_SLOTS": slots, "DN_UNROLL": 1, "DN_MIN_BLOCKS": 0, "DN_WARPS": 1 if one_wave else DEFAULTS["DN_WARPS"]}


def _down_min_blocks(values: dict[str, int]) -> int:
    """__launch_bounds__ min blocks that caps the down kernel's registers near what its loads need.

    Fitted to the offline report (sm_90, DN_BYTES 16): ~24 registers of bookkeeping, a 64-bit w2 row pointer
    per slot and output, and per item in flight DN_OUTS w2 chunks plus one intermediate chunk of DN_BYTES / 4
    registers each (4 x 1 -> 64, 8 x 1 -> 104, 4 x 3 -> 128). A cap below that spills: the first H200 sweep
    timed DN_SLOTS 8 with spills under an older formula (tests/test_warp_decode_cupy.py now compiles the
    sweep grid's auto caps and asserts zero spills).
    """
    items = values["DN_SLOTS"] * values["DN_UNROLL"]
    per_item = (values["DN_OUTS"] + 1) * values["DN_BYTES"] // 4
    registers = 24 + 2 * values["DN_SLOTS"] * values["DN_OUTS"] + items * per_item
    # with 4+ warps per block the floor below leaves headroom; small blocks get 16 registers of it explicitly
    registers = min(255, -(-registers // 8) * 8 + (16 if values["DN_WARPS"] < 4 else 0))
    return max(1, min(32, 65536 // (registers * 32 * values["DN_WARPS"])))  # 32: resident blocks per SM


SHARED_LIMIT = 227 * 1024  # dynamic shared memory one block may opt into on sm_90


def down_shared_bytes(params: dict[str, int], dims: Dims) -> int:
    """Dynamic shared memory of the down kernel: 0, or with DN_BULK a 16-byte barrier and a K x I bf16 landing
    slice per warp, or with DN_STAGED :func:`staged_shared_bytes`."""
    if params.get("DN_STAGED"):
        return staged_shared_bytes(params, dims)
    if not params["DN_BULK"]:
        return 0
    return params["DN_WARPS"] * (16 + dims.top_k * dims.intermediate * 2)


SOURCE = register_source(
    CudaSource(
        name="warp_decode_cupy",
        code=CODE,
        kernels=(GATE_UP, DOWN, STAGED_DOWN),
        defaults=dict(DEFAULTS),
        variants=preset_variants(resolve_params, DEFAULTS),
        warps_knobs={GATE_UP: "GU_WARPS", DOWN: "DN_WARPS", STAGED_DOWN: "DN_WARPS"},
        conditional_kernels={STAGED_DOWN: "DN_STAGED"},
        description="warp decode: one warp per output scalar (gate_up, down), CuPy RawKernel",
    )
)
# which knob is each kernel's warps-per-block (tools.compile_report reads this for occupancy)


# ---------------------------------------------------------------------------------------------------
# Kernel handles and launches (no allocation, no host sync)
# ---------------------------------------------------------------------------------------------------
_HANDLES: dict[tuple[int, str, tuple[tuple[str, int], ...]], tuple[Any, Any]] = {}


def kernels_for(params: dict[str, int]) -> tuple[Any, Any]:
    """``(gate_up kernel, down kernel)`` compiled for these resolved knobs, cached per device, source text and set.

    The key holds ``SOURCE.code`` itself, so editing the source string (IPython) compiles the new text.
    """
    import cupy

    key = (cupy.cuda.Device().id, SOURCE.code, tuple(sorted(params.items())))
    handles = _HANDLES.get(key)
    if handles is None:
        gate_up_kernel = get_kernel(SOURCE, GATE_UP, **params)
        if params.get("DN_STAGED"):
            # the SMs keep the maximum shared-memory carveout while gate_up runs, so the staged down's blocks
            # (~200 KB each) can become resident beside gate_up's instead of after it has drained
            prefer_shared_memory(gate_up_kernel)
        handles = (gate_up_kernel, get_kernel(SOURCE, STAGED_DOWN if params.get("DN_STAGED") else DOWN, **params))
        _HANDLES[key] = handles
    return handles


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
    if params["DN_STAGED"]:
        blocks = -(-dims.hidden // params["DN_ROWS"])  # block b: rows b * DN_ROWS .., all tokens
    else:
        blocks = _blocks(dims.tokens * -(-dims.hidden // params["DN_OUTS"]), params["DN_WARPS"])
    out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
    shared = down_shared_bytes(params, dims)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:  # opt in above 48 KB, once
        kernel.max_dynamic_shared_size_bytes = shared
    launch_ex(
        kernel, (blocks,), (params["DN_WARPS"] * 32,),
        (intermediate, w2, topk_ids, topk_weights, out, out_f32, np.int32(dims.tokens), np.int32(dims.hidden),
         np.int32(dims.intermediate), np.int32(dims.experts), np.int32(dims.top_k)),
        shared_mem=shared,
        programmatic=bool(params["PDL"]),
    )


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


def make_workspace(tokens: int, top_k: int, intermediate: int) -> Any:
    """The [T, K, I] bf16 intermediate buffer (the only buffer warp decode needs)."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("intermediate", intermediate)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    import cupy

    return cupy.empty((int(tokens), int(top_k), int(intermediate)), dtype=BF16)


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
    kernels guard every id). ``params`` are compile-time knobs (see :data:`DEFAULTS`; ``DN_UNROLL=0`` auto).
    """
    cupy = require_cupy(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, check_values=False)  # kinds, dtypes, shapes
    if out is not None:
        require_cupy(out=out)
        check_out(out, dims, cupy)
    if workspace is not None:
        require_cupy(workspace=workspace)
        _check_stage_array("workspace", workspace, BF16, (dims.tokens, dims.top_k, dims.intermediate))
    resolved = for_device(resolve_params(dims, **params))
    check_inputs(x, w13, w2, topk_ids, topk_weights)  # ids in range, weights finite (skipped under capture)
    check_aligned(x=x, w13=w13, w2=w2)
    if out is None:
        out = cupy.empty((dims.tokens, dims.hidden), dtype=BF16)
    if workspace is None:
        workspace = make_workspace(dims.tokens, dims.top_k, dims.intermediate)
    check_aligned(workspace=workspace)
    gate_up_kernel, down_kernel = kernels_for(resolved)
    _launch_gate_up(gate_up_kernel, resolved, dims, x, w13, topk_ids, workspace)
    _launch_down(down_kernel, resolved, dims, workspace, w2, topk_ids, topk_weights, out)
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
    resolved = for_device(resolve_params(dims, **params))
    check_aligned(x=x, w13=w13, intermediate=intermediate)
    _launch_gate_up(kernels_for(resolved)[0], resolved, dims, x, w13, topk_ids, intermediate)
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
    resolved = for_device(resolve_params(dims, **params))
    check_aligned(intermediate=intermediate, w2=w2)
    _launch_down(kernels_for(resolved)[1], resolved, dims, intermediate, w2, topk_ids, topk_weights, out)
    return out


# ---------------------------------------------------------------------------------------------------
# Variant registry
# ---------------------------------------------------------------------------------------------------
def build(dims: Dims, **params: Any) -> Any:
    """Compile once, allocate the workspace once; the returned launch only launches (graph-capturable)."""
    resolved = for_device(resolve_params(dims, **params))
    gate_up_kernel, down_kernel = kernels_for(resolved)
    workspace = make_workspace(dims.tokens, dims.top_k, dims.intermediate)

    def launch(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
        _launch_gate_up(gate_up_kernel, resolved, dims, x, w13, topk_ids, workspace)
        _launch_down(down_kernel, resolved, dims, workspace, w2, topk_ids, topk_weights, out)

    def stages(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[tuple[str, Any]]:
        return [
            ("gate_up", lambda: _launch_gate_up(gate_up_kernel, resolved, dims, x, w13, topk_ids, workspace)),
            ("down", lambda: _launch_down(down_kernel, resolved, dims, workspace, w2, topk_ids, topk_weights, out)),
        ]

    launch.stages = stages  # type: ignore[attr-defined]
    launch.params = resolved  # type: ignore[attr-defined]
    launch.workspace = workspace  # type: ignore[attr-defined]
    return launch


build.resolve = resolve_params  # type: ignore[attr-defined]  # tools.sweep resolves auto knobs with it

VARIANT = register(
    Variant(
        name="cupy:warp-decode",
        backend="cupy",
        family="warp-decode",
        build=build,
        reference_mode="warp_decode",
        params={**DEFAULTS, **{knob: 0 for knob in AUTO_KNOBS}},
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
