"""The FMA batched pair: warp decode with each expert's weights read once per batch, on the CUDA cores.

Strict warp decode (``kernels.warp_decode_cupy``) gives every (token, slot, neuron) its own warp, so an expert
routed to n tokens has its weights streamed n times. Here the work is grouped by *expert* first:

1. ``moe_expert_lists`` (:mod:`kernels.batched.lists`): the batch's active experts and their pairs.
2. ``moe_gate_up_batched``: one warp per (active expert, GB_OUTS neurons) for ALL pairs of the expert: the gate/up
   row chunks are loaded once per round, then each pair's x chunks (L1 hits: the block's warps share the expert's x
   rows), FP32 accumulators per lane, warp butterfly, ``bf16(SiLU(g) * u)`` into the [T, K, I] intermediate. Lane
   map, FMA order and butterfly are the strict kernel's: at equal load width (GB_BYTES == GU_BYTES) the intermediate
   is BITWISE the strict kernel's.
3. ``moe_down_batched``: one block per DB_OUTS hidden columns for ALL tokens; its warps take the list slots
   round-robin, read ``w2[e, h0:h0+DB_OUTS, :]`` once per tile of the expert's pairs and add ``topk_weight * dot``
   into the warp's shared-memory partial; the block sums its warps' partials in warp order, writes once.

Sized from (T, K, E) only, no host sync, no allocation per call: CUDA-graph capturable, bitwise deterministic.
Numerics = ``reference.moe_decode(mode="warp_decode")`` up to the sum order over a token's K slots (by warp, then by
expert id): within ~1 bf16 ulp, mostly bitwise. One family per weight format with an FMA loader
(:mod:`kernels.batched.loaders`: bf16, fp8-block128, mxfp4, nvfp4). Knobs: :data:`KNOBS` (0 = chosen from the dims by
:func:`rules`); the measurements behind them: notes/FINDINGS.md ("Batched warp decode").
"""

from __future__ import annotations

import math
from typing import Any

from kernels.activation import CONTRACT_LAYER, ExpertLayer
from kernels.batched import lists
from kernels.batched.common import (
    FormatFamilies,
    allocate,
    check_register_caps,
    family_suffix,
    list_stages,
    sample_variants,
)
from kernels.batched.loaders import loader_for
from kernels.compile import CudaSource
from kernels.contract import Dims
from kernels.device_helpers import BATCHED_HELPERS, BLOCK_OUTPUTS, FP8_HELPERS, PDL_HELPERS, WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.formats import BF16_FORMAT, FP8_BLOCK128, MXFP4, NVFP4, WeightFormat

GATE_UP, DOWN = "moe_gate_up_batched", "moe_down_batched"
KERNELS = (lists.KERNEL, GATE_UP, DOWN)
MAX_TILE = 8  # cap of the automatic GB_TILE / DB_TILE
KNOBS: dict[str, int] = {
    "GB_WARPS": 4,  # warps per gate_up block (all on one expert: they share its x rows in L1)
    "GB_OUTS": 2,  # neurons per warp: x loads reused across 2*OUTS rows
    "GB_TILE": 8,  # pairs per pass (FP32 accumulators [TILE][OUTS] x 2 per lane); 0 = auto_tile
    "GB_UNROLL": 4,  # chunk rounds in flight per lane: 2 * OUTS * UNROLL weight loads; 0 = auto (2 at tile 4)
    "GB_BYTES": 8,  # activation bytes per lane and load (= strict's GU_BYTES: the intermediate is then its bits)
    "GB_MAX_REGS": -1,  # __maxnreg__ cap (0: __launch_bounds__ only, which spills at some tiles); -1 = 128
    "DB_WARPS": 4,  # warps per down block (they split the active experts round-robin)
    "DB_OUTS": 4,  # hidden columns per block: intermediate reads reused across OUTS rows
    "DB_TILE": 8,  # 0 = auto_down_tile
    "DB_UNROLL": 1,  # DB_UNROLL x DB_OUTS w2 loads in flight per lane; 0 = auto_down_unroll
    "DB_MAX_REGS": -1,  # likewise; -1 = 128
    "PDL": 1,  # programmatic dependent launch of the three kernels (sm_90+: device_needs turns it off before)
}
DERIVED = {"LIST_THREADS": 256, "LIST_PER": 1, "DB_BYTES": 16}  # lists.list_rules; DB_BYTES: 16-byte loads
AUTO_KNOBS = ("GB_TILE", "GB_UNROLL", "DB_TILE", "DB_UNROLL")
LIMITS = {
    "GB_WARPS": (1, 32), "GB_OUTS": (1, 32), "GB_TILE": (0, 32), "GB_UNROLL": (0, 64), "GB_MAX_REGS": (-1, 255),
    "DB_WARPS": (1, 32), "DB_OUTS": (1, 32), "DB_TILE": (0, 32), "DB_UNROLL": (0, 64), "DB_MAX_REGS": (-1, 255),
    "PDL": (0, 1), "GB_BYTES": (4, 16),
}
# The knobs' defaults where a format's own differ from KNOBS (the family's defaults on that format). mxfp4, nvfp4: 8
# values (4 bytes) a weight chunk, the narrowest the loader contract allows -- GB_BYTES 16
# -- and nvfp4's down capped at 160 registers: with its second scale (the expert's global) and third multiply a value,
# 128 spills at the dims-free defaults (DB_TILE 8; the qwen3-30b and gpt-oss-120b presets, T = 1..64, fit in 128)
FORMAT_DEFAULTS: dict[str, dict[str, int]] = {MXFP4.name: {"GB_BYTES": 16},
                                              NVFP4.name: {"GB_BYTES": 16, "DB_MAX_REGS": 160}}
# fp8-block128: 8-value chunks (GB_BYTES 16: the gate_up's intermediate is then bitwise the strict FP8 kernel's), the
# down capped at 160 registers, which its scales and widening need to stay spill-free at the qwen3 shapes from T = 1
# to 64 (128 spills at qwen3-235b T = 16, launch bounds alone at qwen3-30b T = 1)
FP8_KNOBS = {"GB_BYTES": 16, "DB_MAX_REGS": 160}


def auto_tile(dims: Dims) -> int:
    """gate_up's pairs per pass: 1 at T=1; else the power of two >= 2*m + 1 (m = T*K/E < 1) or >= m + 2
    (m >= 1), capped at MAX_TILE and at T (H200 sweep: results/sweep-batched-*.json)."""
    if dims.tokens == 1:
        return 1
    mean = dims.tokens * dims.top_k / dims.experts
    want = math.ceil(2.0 * mean + 1.0) if mean < 1.0 else math.ceil(mean + 2.0)
    tile = 1 << max(0, (want - 1).bit_length())
    return max(1, min(tile, MAX_TILE, 1 << (dims.tokens - 1).bit_length()))


def auto_down_tile(dims: Dims) -> int:
    """down's pairs per pass: gate_up's tile capped at 4 -- fewer accumulators and intermediate registers per warp,
    and the w2 rows of a second tile are L1 hits (H200 sweep: results/sweep-batched-*.json)."""
    return min(auto_tile(dims), 4)


def auto_down_unroll(dims: Dims, params: dict[str, int]) -> int:
    """Rounds of w2 loads in flight: 2 when the tile leaves room (<= 4 pairs) and the row splits into whole
    rounds of 2 (no half-masked last round: qwen3-235b, I = 1536, 192 chunks of 16 B); else 1 (qwen3-30b,
    I = 768, 96 chunks; H200 sweep: results/sweep-batched-*.json)."""
    chunks = dims.intermediate // (params["DB_BYTES"] // 2)
    return 2 if params["DB_TILE"] <= 4 and chunks % (32 * 2) == 0 else 1


def down_shared_bytes(dims: Dims, params: dict[str, int]) -> int:
    """Dynamic shared memory of the down kernel: per warp an FP32 partial [T][DB_OUTS]."""
    return params["DB_WARPS"] * dims.tokens * params["DB_OUTS"] * 4


def max_tokens(**knobs: Any) -> int:
    """The largest T the down kernel's shared memory allows with these knobs."""
    values = FMA(BF16_FORMAT).resolve(None, **knobs)
    return lists.OPT_IN_SHARED_LIMIT // (values["DB_WARPS"] * values["DB_OUTS"] * 4)


ALLOWED_BYTES = {4: (4, 8, 16), 8: (8, 16), 16: (16,)}


def min_act_bytes(fmt: WeightFormat) -> int:
    """The narrowest activation chunk whose weights are a 4-byte load: 4 bytes on bf16, 8 on fp8, 16 on 4-bit."""
    return max(4, int(8 / fmt.value_bytes))


def make_rules(fmt: WeightFormat) -> Any:
    def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
        """Fill the auto knobs from ``dims``; ValueError for what these kernels cannot run (load widths, register
        caps, the lists' and the down's shared memory)."""
        for key in ("GB_BYTES",):
            if values[key] not in (4, 8, 16):
                raise ValueError(f"{key} must be 4, 8 or 16, got {values[key]}")
            least = min_act_bytes(fmt)
            if values[key] < least:
                raise ValueError(f"{fmt.name} weights load {key} x {fmt.value_bytes / 2:g} bytes per activation "
                                 f"chunk (at least 4): {key} must be {' or '.join(map(str, ALLOWED_BYTES[least]))}, "
                                 f"got {values[key]}")
        check_register_caps(values)
        lists.list_rules(dims, values)
        if dims is None:
            for key in AUTO_KNOBS:
                values[key] = values[key] or KNOBS[key]
            return values
        values["GB_TILE"] = values["GB_TILE"] or auto_tile(dims)
        values["GB_UNROLL"] = values["GB_UNROLL"] or (2 if values["GB_TILE"] == 4 else 4)  # 3 % at qwen3-235b T=16
        values["DB_TILE"] = values["DB_TILE"] or auto_down_tile(dims)
        values["DB_UNROLL"] = values["DB_UNROLL"] or auto_down_unroll(dims, values)
        shared = down_shared_bytes(dims, values)
        if shared > lists.OPT_IN_SHARED_LIMIT:
            raise ValueError(
                f"the down kernel keeps DB_WARPS * T * DB_OUTS fp32 partials in shared memory: {shared} bytes > "
                f"{lists.OPT_IN_SHARED_LIMIT} at T = {dims.tokens}; lower DB_WARPS / DB_OUTS (or use another path)")
        return values

    return rules


def gate_up_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block row (ceil(I / neurons per block) blocks) per list slot."""
    return lists.slots(dims) * -(-dims.intermediate // (params["GB_WARPS"] * params["GB_OUTS"]))


def down_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block per DB_OUTS hidden columns."""
    return -(-dims.hidden // params["DB_OUTS"])


def make_workspace(dims: Dims, **knobs: Any) -> Any:
    """The intermediate and the lists buffer for ``dims`` (CuPy, current device)."""
    return allocate(dims, lists=True, pair_out=False)


def make_stages(fmt: WeightFormat) -> Any:
    def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
               out: Any, b13: Any = None, b2: Any = None) -> list[Stage]:
        """The layer as three launches (expert_lists, gate_up, down) into ``compiled``'s workspace."""
        d, params = compiled.dims, compiled.params
        kernels = tuple(compiled.kernels[name] for name in KERNELS)
        return list_stages(compiled, fmt, kernels, gate_up_blocks(d, params), down_blocks(d, params),
                           down_shared_bytes(d, params), x, w13, w2, topk_ids, topk_weights, out, b13=b13, b2=b2)

    return stages


def make_family(fmt: WeightFormat, layer: ExpertLayer = CONTRACT_LAYER) -> KernelFamily:
    """The FMA pair on ``fmt`` weights computing ``layer``: its loader and layer code, then the shared helpers, the
    lists and the two kernels."""
    code = (WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + FAMILY_DEFINES + BATCHED_HELPERS + BLOCK_OUTPUTS
            + loader_for(fmt, "fma") + layer.device_code() + lists.CODE + CODE)
    suffix = family_suffix(fmt, layer)
    defaults = {**KNOBS, **FORMAT_DEFAULTS.get(fmt.name, {}), **DERIVED}
    source = CudaSource(name=f"batched_fma{suffix}", code=code, kernels=KERNELS, defaults=defaults,
                        warps_knobs={GATE_UP: "GB_WARPS", DOWN: "DB_WARPS"},
                        knob_prefixes={GATE_UP: "GB_", DOWN: "DB_", lists.KERNEL: "LIST_"},
                        description=f"batched warp decode on the CUDA cores, {fmt.name} weights: expert lists, gate_up "
                                    "and down reading each expert once per batch")
    family = KernelFamily(name=f"warp-decode-batched{suffix}", source=source, limits=LIMITS, auto_knobs=AUTO_KNOBS,
                          derived=tuple(DERIVED), rules=make_rules(fmt), device_needs={"PDL": 90},
                          workspace=lambda dims, params: make_workspace(dims), stages=make_stages(fmt))
    source.variants = sample_variants(family.resolve, source.defaults)
    return family


FAMILY_DEFINES = r"""
#define DOWN_WAITS_LATE 0   // the down waits for gate_up before its first load (its w2 loads are sunk below the wait)
#define PAIR_TILES 0        // the lists without a tile table
#define TILE_PAIRS 8
"""
CODE = r"""
// ==== the FMA batched pair (kernels/batched/fma.py) ====
// Knobs (#defines set by kernels.compile): GB_* gate/up, DB_* down: *_WARPS warps per block, *_OUTS outputs per warp,
// *_TILE pairs per pass (FP32 accumulators [TILE][OUTS] in registers), *_UNROLL chunk rounds in flight per lane,
// *_BYTES activation bytes per lane per load (4, 8, 16; the loader's WEIGHT_CHUNK_BYTES of weights), *_MAX_REGS
// register cap (0: __launch_bounds__ only; DB_BYTES is 16, derived); PDL 1: each kernel waits (griddepcontrol.wait)
// before it reads what the kernel right before it wrote, then lets the next kernel's blocks launch (the down reads the
// lists, two kernels back, before its wait).
static_assert(GB_WARPS >= 1 && GB_WARPS <= 32 && DB_WARPS >= 1 && DB_WARPS <= 32, "WARPS must be 1..32");
static_assert(GB_OUTS >= 1 && GB_OUTS <= 32 && DB_OUTS >= 1 && DB_OUTS <= 32, "OUTS must be 1..32");
static_assert(GB_TILE >= 1 && GB_TILE <= 32 && DB_TILE >= 1 && DB_TILE <= 32, "TILE must be 1..32");
static_assert(GB_UNROLL >= 1 && DB_UNROLL >= 1, "UNROLL must be >= 1");
static_assert(GB_BYTES == 4 || GB_BYTES == 8 || GB_BYTES == 16, "GB_BYTES must be 4, 8 or 16");
static_assert(DB_BYTES == 4 || DB_BYTES == 8 || DB_BYTES == 16, "DB_BYTES must be 4, 8 or 16");
static_assert(WEIGHT_CHUNK_BYTES(GB_BYTES) >= 4 && WEIGHT_CHUNK_BYTES(DB_BYTES) >= 4, "a weight chunk is >= 4 bytes");
static_assert(PDL == 0 || PDL == 1, "PDL must be 0 or 1");
// ------------------------------------------------------------------------------------------------
// gate_up's two steps of a round:
//   load:  lane l's chunks c = base + j*32 + l (j < GB_UNROLL) of every gate and up row it owns
//   round: for each pair of the tile, the same chunks of x[t] (L1 hits) and the FMAs in the strict
//          kernel's per-lane order into gate_acc[tt][o] / up_acc[tt][o] (FP32 registers)
// ------------------------------------------------------------------------------------------------
// and each chunk's scale (the loader's chunk_scale: 1 for unscaled weights, no load), sg / su
template <typename W>
__device__ __forceinline__ void gate_up_load_round(W (&wg)[GB_UNROLL][GB_OUTS], W (&wu)[GB_UNROLL][GB_OUTS],
                                                   chunk_scale_t (&sg)[GB_UNROLL][GB_OUTS],
                                                   chunk_scale_t (&su)[GB_UNROLL][GB_OUTS],
                                                   const W* const (&gate_row)[GB_OUTS],
                                                   const W* const (&up_row)[GB_OUTS],
                                                   const scale_row_t (&gate_scale)[GB_OUTS],
                                                   const scale_row_t (&up_scale)[GB_OUTS], int base, int chunks,
                                                   int lane) {
    #pragma unroll
    for (int j = 0; j < GB_UNROLL; ++j) {
        const int c = base + j * 32 + lane;
        const bool ok = c < chunks;
        #pragma unroll
        for (int o = 0; o < GB_OUTS; ++o) {
            wg[j][o] = ldg_chunk(gate_row[o], c, ok);
            wu[j][o] = ldg_chunk(up_row[o], c, ok);
            sg[j][o] = chunk_scale<GB_BYTES>(gate_scale[o], c, ok);
            su[j][o] = chunk_scale<GB_BYTES>(up_scale[o], c, ok);
        }
    }
}

template <typename V, typename W>
__device__ __forceinline__ void gate_up_round(const W (&wg)[GB_UNROLL][GB_OUTS], const W (&wu)[GB_UNROLL][GB_OUTS],
                                              const chunk_scale_t (&sg)[GB_UNROLL][GB_OUTS],
                                              const chunk_scale_t (&su)[GB_UNROLL][GB_OUTS],
                                              const V* const (&x_row)[GB_TILE], int n, int base, int chunks, int lane,
                                              float zero, float (&gate_acc)[GB_TILE][GB_OUTS],
                                              float (&up_acc)[GB_TILE][GB_OUTS]) {
    constexpr int WORDS = sizeof(V) / 4;
    #pragma unroll
    for (int tt = 0; tt < GB_TILE; ++tt) {
        if (tt < n) {                                                // warp-uniform
            V xv[GB_UNROLL];
            #pragma unroll
            for (int j = 0; j < GB_UNROLL; ++j) {
                const int c = base + j * 32 + lane;
                xv[j] = ldg_chunk(x_row[tt], c, c < chunks);
            }
            gate_acc[tt][0] += zero;                                 // += 0.0f, as the strict kernel does
            #pragma unroll
            for (int j = 0; j < GB_UNROLL; ++j) {
                #pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    const float x_lo = bf16_lo(word(xv[j], w)), x_hi = bf16_hi(word(xv[j], w));
                    #pragma unroll
                    for (int o = 0; o < GB_OUTS; ++o) {
                        float g_lo, g_hi, u_lo, u_hi;
                        weight_pair(wg[j][o], w, sg[j][o], g_lo, g_hi);
                        weight_pair(wu[j][o], w, su[j][o], u_lo, u_hi);
                        gate_acc[tt][o] = fmaf(g_lo, x_lo, gate_acc[tt][o]);
                        gate_acc[tt][o] = fmaf(g_hi, x_hi, gate_acc[tt][o]);
                        up_acc[tt][o] = fmaf(u_lo, x_lo, up_acc[tt][o]);
                        up_acc[tt][o] = fmaf(u_hi, x_hi, up_acc[tt][o]);
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_batched: intermediate[p, i] = bf16(act(w13[e, i, :] . x[t], w13[e, I+i, :] . x[t])) (SiLU(g) * u:
//   the contract's activation; the layer's expert_activation, after its biases where it has them)
//   for every pair p = t*K + k routed to expert e.
//   Block b owns list slot a = b / ceil(I / (GB_WARPS*GB_OUTS)) (slots past lists[0] exit at once);
//   its warp w owns neurons i0 .. i0+GB_OUTS-1, i0 = ((b mod that) * GB_WARPS + w) * GB_OUTS, so the
//   block's warps share the expert's x rows in L1. For each tile of GB_TILE of the expert's pairs:
//   lane l loads chunks c = l, l+32, ... (GB_BYTES each) of the gate and up rows ONCE per round
//   (GB_UNROLL rounds of 2*GB_OUTS loads in flight), then the same chunks of x[t] of every pair of the
//   tile, and accumulates gate_acc[tile][o] / up_acc[tile][o] in FP32 registers in strict's per-lane
//   order; warp butterfly; lane o stores neuron i0+o of each pair. Bit-identical to the strict kernel
//   at the same GB_BYTES (lane -> chunk map, FMA order and reduction are the same).
//   The bad-id slot (expert E) writes NaN to its pairs' neurons and reads no weights.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_batched(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const scale_t* __restrict__ s13,          // scaled formats: the loader's scales (w13_scale_row)
    const int* __restrict__ lists,            // from moe_expert_lists
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int slots, int n_pairs,
    const float* __restrict__ g13,            // global-scaled formats: a float32 scale per expert (scale_geometry)
    const bf16_t* __restrict__ b13)           // EXPERT_BIAS: the gate and up biases [E, 2I] (else never read)
{
    (void)n_pairs;                                                   // the tensor-core gate_up's tile table
    typedef typename Vec<GB_BYTES>::T vec_t;
    typedef typename Vec<WEIGHT_CHUNK_BYTES(GB_BYTES)>::T wvec_t;    // the weights' chunk (the loader's bytes)
    const int lane = threadIdx.x & 31;
    const int per_slot = (inter + GB_WARPS * GB_OUTS - 1) / (GB_WARPS * GB_OUTS);   // blocks per slot
    const int a = blockIdx.x / per_slot;
    pdl_wait();  // the lists (and x) come from the kernels before: read only after the wait, through ld_dep
    pdl_release();
    const ListSlot slot = read_list_slot(lists, slots, a);
    if (slot_unused(slot, a)) return;                                // whole block leaves together
    const int i0 = ((blockIdx.x - a * per_slot) * GB_WARPS + (threadIdx.x >> 5)) * GB_OUTS;
    if (i0 >= inter) return;                                         // whole warp leaves together
    const int e = slot.expert;
    const int count = slot.count;
    const int* pairs = sorted_pairs(lists, slots) + slot.offset;
    if (e >= experts) {                                              // bad ids: NaN, no weight read
        for (int j = 0; j < count; ++j) {
            const long long p = __ldg(pairs + j);
            if (lane < GB_OUTS && i0 + lane < inter) intermediate[p * inter + i0 + lane] = BF16_NAN;
        }
        return;
    }

    const int chunks = hidden / (GB_BYTES / 2);                      // H % 8 == 0: whole chunks only
    const scale_geometry_t sgeo = scale_geometry(hidden, inter, g13);  // the loader's (scale rows)
    const wvec_t* gate_row[GB_OUTS];
    const wvec_t* up_row[GB_OUTS];
    scale_row_t gate_scale[GB_OUTS];
    scale_row_t up_scale[GB_OUTS];
    #pragma unroll
    for (int o = 0; o < GB_OUTS; ++o) {
        const int i = min(i0 + o, inter - 1);                        // past-the-end neurons re-read the last row
        const size_t row = ((size_t)e * 2 * inter + i) * (size_t)hidden / VALUES_PER_WEIGHT;
        gate_row[o] = reinterpret_cast<const wvec_t*>(w13 + row);
        up_row[o] = reinterpret_cast<const wvec_t*>(w13 + row + (size_t)inter * hidden / VALUES_PER_WEIGHT);
        gate_scale[o] = w13_scale_row(s13, sgeo, e, i, false);
        up_scale[o] = w13_scale_row(s13, sgeo, e, i, true);
    }

    for (int tile = 0; tile < count; tile += GB_TILE) {              // usually ONE pass (count <= GB_TILE)
        const int n = min(GB_TILE, count - tile);
        const vec_t* x_row[GB_TILE];                                 // x[t] of each pair (past n: a valid row)
        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt) {
            const int p = __ldg(pairs + tile + min(tt, n - 1));      // int: a 32-bit division, no call
            x_row[tt] = reinterpret_cast<const vec_t*>(x + (size_t)(p / top_k) * hidden);
        }
        float gate_acc[GB_TILE][GB_OUTS], up_acc[GB_TILE][GB_OUTS];
        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt)
            #pragma unroll
            for (int o = 0; o < GB_OUTS; ++o) gate_acc[tt][o] = up_acc[tt][o] = 0.0f;

        constexpr int STEP = 32 * GB_UNROLL;                         // chunks per round (all lanes)
        for (int base = 0; base < chunks; base += STEP) {
            // 1) every weight load of the round (2 * GB_OUTS * GB_UNROLL per lane): read once for the tile
            wvec_t wg[GB_UNROLL][GB_OUTS], wu[GB_UNROLL][GB_OUTS];
            chunk_scale_t sg[GB_UNROLL][GB_OUTS], su[GB_UNROLL][GB_OUTS];
            gate_up_load_round(wg, wu, sg, su, gate_row, up_row, gate_scale, up_scale, base, chunks, lane);
            const float zero = __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));
            // 2) per pair of the tile: its x chunks (L1 hits), FMAs in the strict kernel's order
            gate_up_round(wg, wu, sg, su, x_row, n, base, chunks, lane, zero, gate_acc, up_acc);
        }

        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt) {
            if (tt < n) {                                            // warp-uniform
                const long long p = __ldg(pairs + tile + tt);
                #pragma unroll
                for (int o = 0; o < GB_OUTS; ++o) {
                    const float g = warp_sum(gate_acc[tt][o]);
                    const float u = warp_sum(up_acc[tt][o]);
                    if (lane == o && i0 + o < inter) {               // the layer's activation (and biases)
                        const long long gate_bias = (long long)e * 2 * inter + i0 + o;
                        const float hidden_value = expert_activation(WITH_BIAS(g, b13, gate_bias),
                                                                     WITH_BIAS(u, b13, gate_bias + inter));
                        intermediate[p * inter + i0 + o] = f32_to_bf16(hidden_value);  // the one bf16 rounding
                    }
                }
            }
        }
    }
}


// ------------------------------------------------------------------------------------------------
// moe_down_batched: out[t, h] = sum over pairs p = t*K + k of topk_weights[p] * (w2[e_p, h, :] . intermediate[p])
//   Block b owns hidden columns h0 .. h0+DB_OUTS-1 (h0 = b * DB_OUTS) for ALL tokens. Warp w takes list
//   slots a = w, w + DB_WARPS, ... (fixed assignment, ascending): lane l loads chunks c = l, l+32, ... of
//   the DB_OUTS rows w2[e, h, :] ONCE per tile of DB_TILE of the expert's pairs (DB_UNROLL rounds of
//   DB_OUTS loads in flight), then the same chunks of each pair's intermediate row (L1/L2 hits); FP32
//   accumulators acc[tile][o] in registers; warp butterfly; lane o adds topk_weight * dot to the warp's
//   own shared-memory partial[w][t][o] (pairs in fixed order, plain adds). After __syncthreads, thread
//   (t, o) sums the DB_WARPS partials in warp order and writes out[t, h0+o] once: deterministic, no atomics.
//   A token with any expert id outside [0, E) gets NaN (its good pairs are computed and ignored).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DB_BOUNDS moe_down_batched(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const scale_t* __restrict__ s2,           // scaled formats: the loader's scales (w2_scale_row)
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k, int slots,
    const float* __restrict__ g2,             // global-scaled formats: a float32 scale per expert (scale_geometry)
    const bf16_t* __restrict__ b2)            // EXPERT_BIAS: the down biases [E, H] (else never read)
{
    typedef typename Vec<DB_BYTES>::T vec_t;
    typedef typename Vec<WEIGHT_CHUNK_BYTES(DB_BYTES)>::T wvec_t;    // the weights' chunk (the loader's bytes)
    constexpr int WORDS = DB_BYTES / 4;
#ifdef WD_HOST_EMULATION
    float* partial = wdb_dynamic_shared;                             // the CPU emulation's buffer
#else
    extern __shared__ float partial[];                               // [DB_WARPS][T][DB_OUTS]
#endif
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * DB_OUTS;
    float* mine = partial + (size_t)warp * tokens * DB_OUTS;
    down_prologue(mine, tokens * DB_OUTS, lane);

    const int chunks = inter / (DB_BYTES / 2);                       // I % 8 == 0: whole chunks only
    const scale_geometry_t sgeo = scale_geometry(hidden, inter, g2);  // the loader's (scale rows)
    const int used = __ldg(lists);
    for (int a = warp; a < used; a += DB_WARPS) {
        const int e = __ldg(list_expert(lists) + a);
        if (e >= experts) continue;                                  // the bad-id slot: NaN below
        const int count = __ldg(list_count(lists, slots) + a);
        const int* pairs = sorted_pairs(lists, slots) + __ldg(list_offset(lists, slots) + a);
        const wvec_t* rows[DB_OUTS];
        scale_row_t row_scale[DB_OUTS];
        #pragma unroll
        for (int o = 0; o < DB_OUTS; ++o) {
            const int h = min(h0 + o, hidden - 1);                   // past-the-end columns re-read the last row
            rows[o] = reinterpret_cast<const wvec_t*>(w2 + ((size_t)e * hidden + h) * inter / VALUES_PER_WEIGHT);
            row_scale[o] = w2_scale_row(s2, sgeo, e, h);
        }
        for (int tile = 0; tile < count; tile += DB_TILE) {
            const int n = min(DB_TILE, count - tile);
            long long inter_off[DB_TILE];                            // intermediate row of each pair (in chunks)
            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt)
                inter_off[tt] = (long long)__ldg(pairs + tile + min(tt, n - 1)) * chunks;
            float acc[DB_TILE][DB_OUTS];
            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt)
                #pragma unroll
                for (int o = 0; o < DB_OUTS; ++o) acc[tt][o] = 0.0f;

            for (int c0 = 0; c0 < chunks; c0 += 32 * DB_UNROLL) {
                // 1) all DB_UNROLL x DB_OUTS w2 loads of the round (once for the whole tile)
                wvec_t wv[DB_UNROLL][DB_OUTS];
                chunk_scale_t sv[DB_UNROLL][DB_OUTS];                // each chunk's scale (chunk_scale)
                #pragma unroll
                for (int r = 0; r < DB_UNROLL; ++r) {
                    const int c = c0 + r * 32 + lane;
                    #pragma unroll
                    for (int o = 0; o < DB_OUTS; ++o) {
                        sv[r][o] = chunk_scale<DB_BYTES>(row_scale[o], c, c < chunks);
                        wv[r][o] = ldg_chunk(rows[o], c, c < chunks);
                    }
                }
                // 2) ... and the tile's intermediate chunks in the same breath (L2 hits; pairs past n re-read
                //    pair n-1's row, an L1 hit), so their latency overlaps the w2 loads' instead of following it
                vec_t iv[DB_TILE][DB_UNROLL];
                #pragma unroll
                for (int tt = 0; tt < DB_TILE; ++tt)
                    #pragma unroll
                    for (int r = 0; r < DB_UNROLL; ++r) {
                        const int c = c0 + r * 32 + lane;
                        iv[tt][r] = ld_dep_chunk(reinterpret_cast<const vec_t*>(intermediate) + inter_off[tt], c,
                                                 c < chunks);
                    }
                acc[0][0] += __uint_as_float(all_loads_arrived(wv) | all_loads_arrived(iv));  // += 0.0f
                // 3) per pair: FMAs into its accumulators (the intermediate chunk shared by the DB_OUTS rows)
                #pragma unroll
                for (int tt = 0; tt < DB_TILE; ++tt) {
                    if (tt < n) {                                    // warp-uniform
                        #pragma unroll
                        for (int r = 0; r < DB_UNROLL; ++r) {
                            const vec_t v = iv[tt][r];
                            #pragma unroll
                            for (int w = 0; w < WORDS; ++w) {
                                const float a_lo = bf16_lo(word(v, w)), a_hi = bf16_hi(word(v, w));
                                #pragma unroll
                                for (int o = 0; o < DB_OUTS; ++o) {
                                    float w_lo, w_hi;
                                    weight_pair(wv[r][o], w, sv[r][o], w_lo, w_hi);
                                    acc[tt][o] = fmaf(w_lo, a_lo, acc[tt][o]);
                                    acc[tt][o] = fmaf(w_hi, a_hi, acc[tt][o]);
                                }
                            }
                        }
                    }
                }
            }

            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt) {
                if (tt < n) {                                        // warp-uniform
                    const int p = __ldg(pairs + tile + tt);
                    const float weight = __ldg(topk_weights + p);
                    const int t = p / top_k;
                    #pragma unroll
                    for (int o = 0; o < DB_OUTS; ++o) {
                        const float dot = WITH_BIAS(warp_sum(acc[tt][o]), b2,    // (+ the row's bias)
                                                    (long long)e * hidden + min(h0 + o, hidden - 1));
                        if (lane == o) mine[t * DB_OUTS + o] = __fadd_rn(mine[t * DB_OUTS + o], __fmul_rn(weight, dot));
                    }
                }
            }
        }
    }
    __syncthreads();

    // every (token, column) of the block: the warps' partials in warp order, written once
    write_block_outputs<DB_OUTS>(partial, topk_ids, out, out_f32, tokens, hidden, experts, top_k, h0);
}

"""
FMA = FormatFamilies(make_family, (BF16_FORMAT.name, FP8_BLOCK128.name, MXFP4.name, NVFP4.name))
