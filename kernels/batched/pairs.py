"""The per-pair pair: the grouped tensor-core path's numerics in two launches, without lists.

``moe_gate_up_pair`` runs the tensor-core gate_up on one (token, slot) pair per block row -- the pair's x row in
every B column, ``GB_KSPLIT`` fixed k ranges (a warp each) added in range order -- and ``moe_down_token`` gives a
block one token and 16 hidden rows, warp k the pair of slot k (the grouped down's mma chain over all of I), then sums
the weighted rows in slot order from 0 as ``moe_sum_slots`` does. A token's output is bitwise what the grouped path
(``kernels.batched.mma`` with ``DB_GROUPED`` 1 and the same ranges) gives it, whatever else is in the batch: the
batch-invariant policy's path at small T, and the fastest path at T <= 2 on both models. K <= 16.

One family per weight format with a tensor-core loader; knobs :data:`KNOBS`, all auto by default (the format's
invariant ranges and the sweeps' rounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.activation import CONTRACT_LAYER, ExpertLayer
from kernels.batched.common import (
    FormatFamilies,
    allocate,
    bias_args,
    check_register_caps,
    family_suffix,
    global_arg,
    sample_variants,
    weight_args,
)
from kernels.batched.loaders import loader_for, loader_macros
from kernels.batched.mma import invariant_ksplit
from kernels.batched.mma_core import CODE as CORE
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.device_helpers import BATCHED_HELPERS, FP8_HELPERS, PDL_HELPERS, WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.formats import BF16_FORMAT, BF16_T16, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4, NVFP4, WeightFormat

GATE_UP, DOWN = "moe_gate_up_pair", "moe_down_token"
KERNELS = (GATE_UP, DOWN)
KNOBS: dict[str, int] = {
    "GB_KSPLIT": 0,  # the gate_up's k ranges, a warp each; 0 = the grouped path's (mma.invariant_ksplit): 8 / 4 on fp8
    "GB_WARPS": 0,  # warps per gate_up block: GB_KSPLIT x the block's groups of 8 neurons; 0 = GB_KSPLIT (one group)
    "GB_UNROLL": 0,  # k blocks of loads in flight per lane; 0 = auto_gate_up_unroll
    "GB_MAX_REGS": -1,  # __maxnreg__ cap of the gate_up (0: launch bounds alone); -1 = 128
    "DB_UNROLL": 0,  # k blocks in flight per down warp; 0 = 8 on bf16, 4 on fp8 (a warp streams whole rows alone)
    "PAIRS_INNER": -1,  # 1: blocks numbered pairs (tokens) fastest, so pairs sharing an expert read it back to back;
    # -1 = auto_pairs_inner
    "PDL": 1,  # programmatic dependent launch (sm_90+: device_needs turns it off before)
}
DERIVED = {"FP8_LOAD16": 0, "FP8_PRMT": 0, "FP4_HALVES": 0}  # as the tensor-core pair's; FP8_PRMT 3: the
# intermediate written x 2^8
AUTO_KNOBS = ("GB_KSPLIT", "GB_WARPS", "GB_UNROLL", "DB_UNROLL")
LIMITS = {"GB_KSPLIT": (0, 8), "GB_WARPS": (0, 32), "GB_UNROLL": (0, 64), "GB_MAX_REGS": (-1, 255),
          "DB_UNROLL": (0, 64), "PAIRS_INNER": (-1, 1), "PDL": (0, 1)}
MMA_UNROLL = 4
PAIR_FULL_WARPS = 64 * 132  # the gate_up's warps from which 2 k blocks in flight beat 4 (the H200's 132 SMs)
FP8_GATE_UP_UNROLL, FP8_DOWN_UNROLL, BF16_DOWN_UNROLL = 2, 4, 8


def auto_gate_up_unroll(dims: Dims, values: dict[str, int], fmt: WeightFormat) -> int:
    """k blocks in flight per gate_up lane: fp8 2 (H200, results/sweep-2026-12-02-mma-pairs-fp8-*.json: qwen3-30b T =
    1 / 2 / 4 20.6 / 30.2 / 56.1 us against 24.3 / 37.5 / 69.7 at 4); bf16 4 while its warps (T*K pairs x I/8 neuron
    groups x GB_KSPLIT) number fewer than PAIR_FULL_WARPS, 2 from there (results/sweep-2026-12-02-unroll-*.json:
    qwen3-30b T = 1 23.1 vs 23.7 us, T = 2 38.5 vs 40.3)."""
    if fmt.scaled:
        return FP8_GATE_UP_UNROLL
    warps = dims.tokens * dims.top_k * -(-dims.intermediate // 8) * values["GB_KSPLIT"]
    return MMA_UNROLL if warps < PAIR_FULL_WARPS else MMA_UNROLL // 2


def auto_pairs_inner(dims: Dims | None, fmt: WeightFormat) -> int:
    """PAIRS_INNER: 1 on bf16 from T = 2 on (a token's K experts are distinct, so only the pairs of different tokens
    share one). H200, T = 4 (results/sweep-2026-12-02-pairs-inner-*.json): 10-17 % faster (qwen3-235b 280.6 -> 239.9
    us uniform); T = 2 1-10 % faster under Zipf, 1.4-2.8 % slower uniform; T = 1 0.6-1.9 % slower. fp8: 0 (-1.8 to
    +2.3 % at T = 1 / 2, results/sweep-2026-12-02-pairs-inner-fp8-*)."""
    return int(not fmt.scaled and dims is not None and dims.tokens >= 2)


def make_rules(fmt: WeightFormat) -> Any:
    def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
        """Fill the auto knobs from the format and ``dims``; ValueError for what cannot run."""
        values["GB_KSPLIT"] = values["GB_KSPLIT"] or invariant_ksplit(fmt)
        values["GB_WARPS"] = values["GB_WARPS"] or values["GB_KSPLIT"]
        loader_macros(dims, values, fmt, widening=3)  # ... and the intermediate written x 2^8
        # (128-wide k blocks -- 4-bit weights in 16-byte loads -- half as many: the same values in flight as fp8's,
        # and the down's B fragments within its 128 registers)
        down_unroll = (FP8_DOWN_UNROLL if fmt.scaled else BF16_DOWN_UNROLL) // (2 if values["FP4_HALVES"] == 4 else 1)
        values["DB_UNROLL"] = values["DB_UNROLL"] or down_unroll
        if values["GB_WARPS"] % values["GB_KSPLIT"]:
            raise ValueError(f"the per-pair gate_up gives each of GB_KSPLIT k ranges a warp: GB_WARPS must be a "
                             f"multiple of GB_KSPLIT, got {values['GB_WARPS']} and {values['GB_KSPLIT']}")
        if dims is not None and dims.top_k > 16:
            raise ValueError(f"the per-pair down gives each of a token's K slots a warp of one block: K <= 16, got "
                             f"{dims.top_k}")
        check_register_caps(values, ("GB",))  # (the per-token down has fixed launch bounds)
        if values["PAIRS_INNER"] == -1:
            values["PAIRS_INNER"] = auto_pairs_inner(dims, fmt)
        if values["GB_UNROLL"] == 0:
            values["GB_UNROLL"] = auto_gate_up_unroll(dims, values, fmt) if dims is not None else MMA_UNROLL
        return values

    return rules


def gate_up_blocks(dims: Dims, params: dict[str, int]) -> int:
    """A block per (pair, GB_WARPS / GB_KSPLIT groups of 8 neurons)."""
    groups = params["GB_WARPS"] // params["GB_KSPLIT"]
    return dims.tokens * dims.top_k * -(-dims.intermediate // (groups * 8))


def down_blocks(dims: Dims, params: dict[str, int]) -> int:
    """A block per (token, 16 hidden rows)."""
    return dims.tokens * -(-dims.hidden // 16)


def make_stages(fmt: WeightFormat) -> Any:
    def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
               out: Any, b13: Any = None, b2: Any = None) -> list[Stage]:
        """gate_up one pair per block row, the down one block per (token, 16 rows) with a warp per slot."""
        params, d, ws = compiled.params, compiled.dims, compiled.workspace
        g13, g2 = global_arg(w13, fmt), global_arg(w2, fmt)
        w13, s13 = weight_args(w13, fmt)
        w2, s2 = weight_args(w2, fmt)
        bias13, bias2 = bias_args(b13, b2)
        gate_up_k, down_k = (compiled.kernels[name] for name in KERNELS)
        i32, programmatic = np.int32, bool(params["PDL"])

        def gate_up() -> None:
            launch_ex(gate_up_k, (gate_up_blocks(d, params),), (params["GB_WARPS"] * 32,),
                      (x, w13, s13, topk_ids, ws.intermediate, i32(d.hidden), i32(d.intermediate), i32(d.experts),
                       i32(d.top_k), i32(d.tokens * d.top_k), g13, bias13), programmatic=programmatic)

        def down() -> None:
            launch_ex(down_k, (down_blocks(d, params),), (32 * d.top_k,),
                      (ws.intermediate, w2, s2, topk_ids, topk_weights, out, i32(1 if out.dtype == np.float32 else 0),
                       i32(d.tokens), i32(d.hidden), i32(d.intermediate), i32(d.experts), i32(d.top_k), g2,
                       bias2),
                      programmatic=programmatic)

        return [("gate_up", gate_up), ("down", down)]

    return stages


def make_workspace(dims: Dims, params: dict[str, int] | None = None) -> Any:
    """The intermediate alone (no lists)."""
    return allocate(dims, lists=False, pair_out=False)


def make_family(fmt: WeightFormat, layer: ExpertLayer = CONTRACT_LAYER) -> KernelFamily:
    """The per-pair pair on ``fmt`` weights computing ``layer``: the helpers, the loader and the layer's code, the
    tensor-core core and the two kernels."""
    code = (WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + FAMILY_DEFINES + BATCHED_HELPERS + loader_for(fmt, "mma")
            + layer.device_code() + CORE + CODE)
    suffix = family_suffix(fmt, layer)
    source = CudaSource(name=f"batched_pairs{suffix}", code=code, kernels=KERNELS, defaults={**KNOBS, **DERIVED},
                        warps_knobs={GATE_UP: "GB_WARPS"}, knob_prefixes={GATE_UP: "GB_", DOWN: "DB_"},
                        description=f"the batch-invariant per-pair tensor-core pair on {fmt.name} weights: a pair "
                                    "per gate_up block row, a token per down block")
    family = KernelFamily(name=f"warp-decode-pairs{suffix}", source=source, limits=LIMITS, auto_knobs=AUTO_KNOBS,
                          derived=tuple(DERIVED), rules=make_rules(fmt), device_needs={"PDL": 90},
                          workspace=make_workspace, stages=make_stages(fmt))
    source.variants = sample_variants(family.resolve, source.defaults)
    return family


FAMILY_DEFINES = r"""
#define DOWN_WAITS_LATE 1    // the down issues its first w2 loads before the PDL wait
"""
CODE = r"""
// ==== the per-pair pair (kernels/batched/pairs.py) ====
// Knobs: GB_KSPLIT k ranges (a warp each) of the gate_up's chains; GB_WARPS = GB_KSPLIT x the block's neuron groups;
// GB_UNROLL / DB_UNROLL k blocks in flight per lane; GB_MAX_REGS the gate_up's register cap; PAIRS_INNER 1 numbers
// the blocks pairs (tokens) fastest; PDL 1: programmatic dependent launch.
static_assert(GB_KSPLIT >= 1 && GB_KSPLIT <= 8 && GB_WARPS % GB_KSPLIT == 0, "GB_WARPS is a multiple of GB_KSPLIT");
static_assert(GB_UNROLL >= 1 && DB_UNROLL >= 1, "UNROLL must be >= 1");
static_assert(PDL == 0 || PDL == 1, "PDL must be 0 or 1");
// Block b of a per-pair kernel over `count` items (pairs, or tokens in the down) of `per` blocks each: (item, block
// of it) -- item-major, or with PAIRS_INNER items fastest, so that items sharing an expert read its rows together.
__device__ __forceinline__ int2 pair_block(unsigned b, int count, int per) {   // b: blockIdx.x
    const int item = PAIRS_INNER ? b % count : b / per;
    return make_int2(item, PAIRS_INNER ? b / count : b - item * per);
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_pair: block b owns pair p = b / per_pair (PAIRS_INNER: b % pairs, so that pairs sharing an
//   expert read its rows back to back) and GB_WARPS / GB_KSPLIT groups of 8 neurons of it; warp w works on group
//   w / GB_KSPLIT over k range w % GB_KSPLIT, as moe_gate_up_mma does for a tile -- A rows 0..7 gate, 8..15 up, the
//   same mma chains -- with the pair's x row in every B column. Lane (g, 0) of a group's
//   range-0 warp adds the ranges' column-0 partials in range order (through shared memory when GB_KSPLIT > 1) and
//   writes neuron i0+g. A bad id writes NaN and reads no weights. No warp leaves before the block barrier.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_pair(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const mma_scale_t* __restrict__ s13,      // scaled formats: the loader's scale rows
    const int* __restrict__ topk_ids,         // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int pairs,
    const float* __restrict__ g13,            // global-scaled formats: a float32 scale per expert (GLOBAL_OF)
    const bf16_t* __restrict__ b13)           // EXPERT_BIAS: the gate and up biases [E, 2I] (else never read)
{
#if GB_KSPLIT == 1  // one chain over H per warp: nothing shared, no barrier
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int per_pair = (inter + GB_WARPS * 8 - 1) / (GB_WARPS * 8);
    const int2 pb = pair_block(blockIdx.x, pairs, per_pair);
    const int p = pb.x;
    const int i0 = (pb.y * GB_WARPS + (threadIdx.x >> 5)) * 8;
    pdl_wait();  // topk_ids and x may come from the kernel right before
    pdl_release();
    if (p >= pairs || i0 >= inter) return;                           // whole warp leaves together
    const int e = ld_dep(topk_ids + p);
    if ((unsigned)e >= (unsigned)experts) {
        if (lane < 8 && i0 + lane < inter) intermediate[(long long)p * inter + i0 + lane] = BF16_NAN;
        return;
    }
    const ARows rows = w13_rows(w13, s13, e, min(i0 + g, inter - 1), hidden, inter);   // past the end: the last row
    const uint4* x_row[1] = {reinterpret_cast<const uint4*>(x + (size_t)(p / top_k) * hidden)};
    float acc[1][4];
    bool unused = true;
    mma_rows_by_columns<GB_UNROLL, 1, false>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi, x_row, 0,
                                             hidden / 8, q, unused);
    if (q == 0 && i0 + g < inter) {                                  // column 0: the pair
        const long long bias = (long long)e * 2 * inter + i0 + g;    // (the global scale, the layer's biases)
        const float global13 = GLOBAL_OF(g13, e);
        const float gate = WITH_BIAS(WITH_GLOBAL(acc[0][0], global13), b13, bias);
        const float up = WITH_BIAS(WITH_GLOBAL(acc[0][2], global13), b13, bias + inter);
        intermediate[(long long)p * inter + i0 + g] = intermediate_value(expert_activation(gate, up));  // one rounding
    }
#else  // a warp per (8 neurons, k range); the ranges' partials meet in shared memory
    constexpr int GROUPS = GB_WARPS / GB_KSPLIT;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5, range = w % GB_KSPLIT;
    const int per_pair = (inter + GROUPS * 8 - 1) / (GROUPS * 8);
    const int2 pb = pair_block(blockIdx.x, pairs, per_pair);
    const int p = pb.x;
    const int i0 = (pb.y * GROUPS + w / GB_KSPLIT) * 8;
    pdl_wait();  // topk_ids and x may come from the kernel right before
    pdl_release();
    const bool live = p < pairs && i0 < inter;                       // a group's warps agree
    const int e = live ? ld_dep(topk_ids + p) : 0;
    const bool bad = live && (unsigned)e >= (unsigned)experts;
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (live && !bad) {
        const ARows rows = w13_rows(w13, s13, e, min(i0 + g, inter - 1), hidden, inter);   // past the end: the last
        const uint4* x_row[1] = {reinterpret_cast<const uint4*>(x + (size_t)(p / top_k) * hidden)};
        bool unused = true;
        int k_begin, k_end;
        k_range(hidden / 8, range, k_begin, k_end);
        mma_rows_by_columns<GB_UNROLL, 1, false>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi, x_row, k_begin,
                                                 k_end, q, unused);
    }
    __shared__ float partial[GB_WARPS][16];                          // [warp][gate rows 0..7, up rows 0..7]
    if (q == 0) {                                                    // column 0: the pair
        partial[w][g] = acc[0][0];
        partial[w][8 + g] = acc[0][2];
    }
    __syncthreads();
    const int first = w - range;                                     // the group's range-0 warp
    float gate = partial[first][g], up = partial[first][8 + g];      // column 0: the pair
    for (int r = 1; r < GB_KSPLIT; ++r) {                            // range order, from range 0
        gate = __fadd_rn(gate, partial[first + r][g]);
        up = __fadd_rn(up, partial[first + r][8 + g]);
    }
    if (!live || range != 0) return;
    if (bad) {
        if (lane < 8 && i0 + lane < inter) intermediate[(long long)p * inter + i0 + lane] = BF16_NAN;
        return;
    }
    if (q == 0 && i0 + g < inter) {
        const long long bias = (long long)e * 2 * inter + i0 + g;    // (the global scale, the layer's biases)
        const float global13 = GLOBAL_OF(g13, e);
        const float hidden_value = expert_activation(WITH_BIAS(WITH_GLOBAL(gate, global13), b13, bias),
                                                     WITH_BIAS(WITH_GLOBAL(up, global13), b13, bias + inter));
        intermediate[(long long)p * inter + i0 + g] = intermediate_value(hidden_value);  // the one bf16 rounding
    }
#endif
}

// ------------------------------------------------------------------------------------------------
// moe_down_token: block b owns token t = b / per_token (PAIRS_INNER: b % tokens) and hidden rows
//   h0 .. h0+15; its K warps (one per
//   slot) run the grouped down's mma chain over all of I for the pair (t, k) (its intermediate row in every column)
//   and keep topk_weight * dot of column 0 in shared memory; thread r < 16 then sums the K rows in slot order from
//   0.0f and rounds once -- moe_down_grouped + moe_sum_slots' numerics. A token with a bad id gets NaN and reads no
//   weight of that slot.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(512, 1) moe_down_token(   // K <= 16 warps: <= 128 registers
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const mma_scale_t* __restrict__ s2,       // scaled formats: the loader's scale rows
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k,
    const float* __restrict__ g2,             // global-scaled formats: a float32 scale per expert (GLOBAL_OF)
    const bf16_t* __restrict__ b2)            // EXPERT_BIAS: the down biases [E, H] (else never read)
{
    __shared__ float rows[16][16];                                   // [slot][row]: the weighted dots
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, k = threadIdx.x >> 5;
    const int per_token = (hidden + 15) / 16;
    const int2 tb = pair_block(blockIdx.x, tokens, per_token);
    const int t = tb.x;
    const int h0 = tb.y * 16;
    const int e = __ldg(topk_ids + (long long)t * top_k + k);        // the routing: two kernels back
    const bool bad = (unsigned)e >= (unsigned)experts;
    bool waited = false;
    if (!bad) {
        const ARows a = w2_rows(w2, s2, e, min(h0 + g, hidden - 1), min(h0 + g + 8, hidden - 1), hidden, inter);
        const uint4* inter_row[1] = {
            reinterpret_cast<const uint4*>(intermediate + ((long long)t * top_k + k) * inter)};
        float acc[1][4];
        mma_rows_by_columns<DB_UNROLL, 1, true>(acc, a.lo, a.hi, a.scale_lo, a.scale_hi, inter_row, 0, inter / 8, q,
                                                waited);
        if (q == 0) {                                                // column 0: rows g, g + 8 of the pair
            const float weight = __ldg(topk_weights + (long long)t * top_k + k);
            const long long bias = (long long)e * hidden;            // (the global scale, the layer's biases)
            const float global2 = GLOBAL_OF(g2, e);
            rows[k][g] = __fmul_rn(weight, WITH_BIAS(WITH_GLOBAL(acc[0][0], global2), b2,
                                                     bias + min(h0 + g, hidden - 1)));
            rows[k][g + 8] = __fmul_rn(weight, WITH_BIAS(WITH_GLOBAL(acc[0][2], global2), b2,
                                                         bias + min(h0 + g + 8, hidden - 1)));
        }
    }
    down_epilogue_wait();  // warps that never waited (a bad slot) before out is written
    __syncthreads();
    if (threadIdx.x < 16 && h0 + (int)threadIdx.x < hidden) {
        float v = 0.0f;
        bool token_bad = false;
        for (int s = 0; s < top_k; ++s) {                            // slot order, as moe_sum_slots
            token_bad |= (unsigned)__ldg(topk_ids + (long long)t * top_k + s) >= (unsigned)experts;
            v = __fadd_rn(v, rows[s][threadIdx.x]);
        }
        store_output(out, out_f32, (long long)t * hidden + h0 + threadIdx.x,
                     token_bad ? __int_as_float(0x7fc00000) : v);
    }
}
"""
PAIRS = FormatFamilies(make_family, (BF16_FORMAT.name, BF16_T16.name, FP8_BLOCK128.name, FP8_BLOCK128_T16.name,
                                     MXFP4.name, NVFP4.name))
