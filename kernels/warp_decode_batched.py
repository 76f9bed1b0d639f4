"""Batched warp decode: output-centric like strict warp decode, but each expert's weights are read once per batch.

Strict warp decode (``kernels.warp_decode_cupy``) gives every (token, slot, neuron) its own warp, so an expert
routed to n tokens has its weights streamed n times. Here the work is grouped by *expert* first:

1. ``expert_lists`` (``moe_expert_lists``, one block): from ``topk_ids`` the batch's active experts in ascending id,
   each one's offset / count into a pair list sorted by expert (pair = t*K + k, stable by pair index), and the number
   of list slots used. Deterministic (warp-parallel ranks with __match_any_sync, exclusive prefixes over the warps),
   no atomics, in shared memory. Out-of-range ids go to one extra pseudo-expert slot (E) whose pairs get NaN.
2. ``gate_up`` (``moe_gate_up_batched``): one warp per (active expert, GB_OUTS neurons) for ALL pairs of the expert:
   the gate/up row chunks are loaded once per round, then each pair's x chunks (L1 hits: the block's warps share the
   expert's x rows), FP32 accumulators per lane, warp butterfly, ``bf16(SiLU(g) * u)`` into the [T, K, I]
   intermediate. Lane map, FMA order and butterfly are the strict kernel's: at equal load width (GB_BYTES == GU_BYTES)
   the intermediate is BITWISE the strict kernel's.
3. ``down`` (``moe_down_batched``): one block per DB_OUTS hidden columns for ALL tokens; its warps take the list
   slots round-robin, read ``w2[e, h0:h0+DB_OUTS, :]`` once per tile of the expert's pairs and add ``topk_weight *
   dot`` into the warp's shared-memory partial; the block sums its warps' partials in warp order, writes once.

Tensor-core kernels (``GB_MMA`` / ``DB_MMA``: ``cupy:warp-decode-mma``; ``cupy:warp-decode-mixed`` = FMA gate_up +
tensor-core down): the same ownership -- a warp owns 8 neurons (gate and up rows as the 16 rows of an m16n8k16 A tile)
of one active expert for all its pairs, a down block 16 hidden columns -- with the dots on ``mma.sync`` (bf16
products, FP32 accumulators), which is what the FMA kernels run out of at T >= 16. Not bitwise the FMA kernels.

Sized from (T, K, E) only: S = min(E, T*K) + 1 list slots, gate_up grid S * ceil(I / (GB_WARPS*GB_OUTS)) blocks
(those past the used slots exit at once), down grid ceil(H / DB_OUTS). No host sync, no allocation per call: CUDA-graph
capturable, bitwise deterministic. Numerics = ``reference.moe_decode(mode="warp_decode")`` up to the sum order over a
token's K slots (by warp, then by expert id): within ~1 bf16 ulp, mostly bitwise. The module is one
:class:`~kernels.family.KernelFamily` (:data:`FAMILY`); knobs: :data:`DEFAULTS` (0 = chosen from the dims by
:func:`rules`); the measurements behind them: notes/FINDINGS.md ("Batched warp decode"), notes/PROTOTYPES.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.compile import CudaSource, launch_ex, preset_variants
from kernels.contract import BF16, Dims, check_aligned, check_inputs, check_out, require_cupy
from kernels.family import Compiled, KernelFamily, Stage
from kernels.formats import BF16_T16, FORMATS, FP8_BLOCK128, FP8_BLOCK128_T16, Quantized, format_of, get_format, tile_k
from kernels.shapes import PRESETS
from kernels.variants import Variant, register
from kernels.warp_decode_batched_cuda import CODE, GROUPED_KERNELS, KERNELS, MMA_KERNELS, PER_PAIR_KERNELS

EXPERT_LISTS, GATE_UP, DOWN = KERNELS
GATE_UP_MMA, DOWN_MMA = MMA_KERNELS
DOWN_GROUPED, SUM_SLOTS = GROUPED_KERNELS
GATE_UP_PAIR, DOWN_TOKEN = PER_PAIR_KERNELS
SUM_THREADS = 256  # threads of a moe_sum_slots block (its __launch_bounds__), 4 columns each
LIST_HEADER = 4  # int32s before the slot arrays in the lists buffer (must match LIST_HEADER in the CUDA C)
SHARED_LIMIT = 48 * 1024  # dynamic shared memory without opt-in
OPT_IN_SHARED_LIMIT = 227 * 1024  # what the down and list kernels opt into above 48 KB (sm_90; launches set it)
MAX_TILE = 8  # cap of the automatic GB_TILE / DB_TILE
REGISTERS_PER_BLOCK = 65536  # sm_70 .. sm_90

DEFAULTS: dict[str, int] = {
    "LIST_THREADS": 256,  # threads of the one-block list kernel
    "LIST_PER": 1,  # experts (+1 pseudo expert for bad ids) per list thread: (E + 1) <= THREADS * PER
    "GB_WARPS": 4,  # warps per gate_up block (all on one expert: they share its x rows in L1)
    "GB_OUTS": 2,  # neurons per warp: x loads reused across 2*OUTS rows
    "GB_TILE": 8,  # pairs per pass (FP32 accumulators [TILE][OUTS] x 2 per lane)
    "GB_UNROLL": 4,  # chunk rounds in flight per lane: 2 * OUTS * UNROLL weight loads (8 B each); auto: 2 at tile 4
    "GB_BYTES": 8,  # = strict's GU_BYTES: the intermediate is then bitwise the strict kernel's
    "GB_MAX_REGS": -1,  # __maxnreg__ cap (0: __launch_bounds__ only, which spills at some tiles); -1 = auto:
    # PASS_REGS where gate_up_takes_pass_regs / fp8_gate_up_takes_pass_regs say, else DEFAULT_MAX_REGS
    "DB_WARPS": 4,  # warps per down block (split the active experts round-robin); 0 = auto_down_warps
    "DB_OUTS": 4,  # hidden columns per block: intermediate reads reused across OUTS rows
    "DB_TILE": 8,
    "DB_UNROLL": 1,  # DB_UNROLL x DB_OUTS w2 loads of DB_BYTES in flight per lane (0 = auto: auto_*down_unroll)
    "DB_BYTES": 16,
    "DB_MAX_REGS": -1,  # likewise; -1 = auto: 0 for the 24-warp tensor-core down (auto_down_warps), PASS_REGS where
    # down_takes_pass_regs says, else DEFAULT_MAX_REGS. An explicit cap, 128 included, is never changed
    "DB_EARLY_INTER": 1,  # 1: intermediate loads issued with the w2 loads (latencies overlap); 0: after them
    "GB_MMA": 0,  # 1: gate_up on tensor cores (moe_gate_up_mma: 8 neurons x 8-pair blocks per warp, mma.sync)
    "DB_MMA": 0,  # 1: down on tensor cores (moe_down_mma: 16 hidden columns per block)
    "GB_NBLK": 1,  # MMA: blocks of 8 pairs per pass (the A fragment shared by NBLK mma per k step); auto: auto_nblk
    "DB_NBLK": 1,  # auto (0): GB_NBLK with DB_GROUPED -- one pass per tile -- else 1
    "HOT_NBLK": 0,  # tiles (PAIR_TILES) of up to 8 * HOT_NBLK pairs where HOT_NBLK > GB_NBLK: a tile with more pairs
    # than one gate_up pass runs in ONE pass of HOT_NBLK 8-pair blocks (its weights loaded and widened once), with
    # GB_UNROLL * GB_NBLK / HOT_NBLK k blocks in flight; the grouped down likewise. The gate_up and the grouped down
    # give the same bits (the balanced down's runs follow the tile table); 0 = off, -1 = auto (auto_hot_nblk; the
    # tensor-core knob sets use it)
    "PDL": 1,  # programmatic dependent launch of all three kernels (sm_90+: device_needs turns it off before)
    "DB_EARLY_W2": 0,  # 1: down issues its first round of w2 loads before its PDL wait (they overlap gate_up's tail)
    "DB_BALANCE": 0,  # MMA down: 1 cuts the (slot, k block) items into equal runs, one per warp; -1 = auto
    # (auto_balance; the tensor-core paths' knob sets use it)
    "PAIR_TILES": 0,  # MMA gate_up: 1 runs one block row per tile of 8 * GB_NBLK of a slot's pairs (the list
    # kernel's tile table), and the balanced MMA down cuts (tile, k block) items: skew-proof work units
    "DB_GROUPED": 0,  # 1: the down as a grouped GEMM over the tiles (moe_down_grouped, DB_WARPS x 16 hidden rows per
    # block, per-pair FP32 rows), then moe_sum_slots sums each token's slots in slot order; needs DB_MMA, PAIR_TILES;
    # -1 = auto (auto_grouped; the tensor-core path's knob set uses it)
    "W_FP8": 0,  # 1: fp8-block128 weights (kernels.formats: e4m3fn values and block scales, widened in registers)
    "PER_PAIR": 0,  # 1 (with GB_MMA, DB_MMA): no lists, one pair per gate_up block row, the down per token with its
    # K slots' rows summed in slot order -- the grouped tensor-core path's numerics in two launches
    "GB_KSPLIT": 1,  # tensor-core gate_up: each dot's k chain in this many fixed ranges, partials added in order --
    # in one warp (tiles) or one warp per range (PER_PAIR: S x the warps at small T); the invariant pair's numerics
    # (GROUPED_KNOBS, PER_PAIR_KNOBS: INVARIANT_KSPLIT)
    "FP8_LOAD16": 0,  # W_FP8 tensor-core kernels: 1 loads 16 e4m3 values per A row and lane per k step (16-byte
    # loads, 64-wide k blocks; H and I multiples of 16), 0 loads 8 (8-byte loads, 32-wide k blocks); -1 = auto
    # (auto_fp8_mma: 1 wherever it can run; the tensor-core knob sets use it)
    "FP8_BLOCK_SUM": 0,  # W_FP8 tensor-core kernels: 1 sums a 128-wide scale block's k blocks in one FP32 partial
    # before its scale multiplies it, 0 scales each k block's partial; -1 = auto (1 with W_FP8 on tensor cores)
    "FP8_PRMT": 0,  # W_FP8 tensor-core kernels: how e4m3 bytes become bf16 fragments (value x 2^-112, the same
    # bits either way): 1 by a sign-extending byte permute, a shift, a mask and a bf16x2 multiply (4 instructions per
    # 2 values), 0 through cvt.rn.f16x2.e4m3x2, a shift and two masks (4.5), 2 as 1 with the multiply moved to the
    # B fragments (3 per 2 weight values and 1 per 2 activation values: the same products, exact while activations
    # stay below 2^120), 3 as 2 with the gate_up writing the intermediate x 2^8 so that the down's B fragments need no
    # multiply (the workspace's intermediate then holds its values x 2^8; needs GB_MMA 1 and DB_MMA 1); -1 = auto
    # (auto_fp8_widening: 3 on the per-pair form, else 2; the tensor-core knob sets use it)
    "GB_RANGE_FLUSH": 0,  # the split-chain gate_up (GB_MMA, GB_KSPLIT > 1, lists): 1 walks H in one loop of rounds
    # and adds each range's chain at its end (the same sums as a loop per range, 0); needs every range a whole number
    # of rounds (and of scale blocks with FP8_BLOCK_SUM; checked: range_flush_allowed); -1 = auto (auto_range_flush;
    # the tensor-core knob sets use it)
    "PAIRS_INNER": 0,  # PER_PAIR: 1 numbers the blocks pairs (the down: tokens) fastest, so that the pairs of a batch
    # that share an expert read each row block of it back to back (the second read from L2); 0 pair-major. Moves
    # work only: the numerics are the same. -1 = auto (auto_pairs_inner; the per-pair knob set uses it)
    "DB_WHOLE_RANGES": 0,  # the bf16 grouped down (DB_GROUPED): 1 compiles whole rounds only, no masked round --
    # its k range (I / 8 chunks) must be a whole number of rounds of 4 x DB_UNROLL chunks (checked) -- 0 masks every
    # round; -1 = auto (auto_whole_ranges; the tensor-core knob sets use it)
    "DB_ROW_TILES": 1,  # the grouped down (DB_GROUPED): tiles of 16 hidden rows per warp, 1 or 2 (2: the two tiles
    # share each B fragment -- fewer intermediate loads and multiplies per weight byte; 2 needs DB_GROUPED 1); the
    # same bits either way; 0 = auto (auto_row_tiles; the tensor-core knob sets use it)
    "GB_SHARE": 0,  # the tensor-core gate_up on the tile table walking H in one loop (a single k chain, or split
    # chains with GB_RANGE_FLUSH): up to GB_SHARE (2 or 4, dividing GB_WARPS) tiles of one expert run in one block
    # whose warps share each round's A fragments -- every k block loaded and widened by one warp of the group, passed
    # through shared memory -- instead of each tile's warps re-loading and re-widening the same rows; each warp's mma
    # chains are unchanged (the same bits); 0 / 1 off; -1 = auto (auto_share; the tensor-core knob sets use it)
    "DB_SHARE": 0,  # the grouped down (DB_GROUPED) likewise: up to DB_SHARE (2 or 4, dividing DB_WARPS) tiles of one
    # expert per block, each round's w2 fragments loaded and widened once for the group; 0 / 1 off; -1 = auto
    "GB_HOT_UNROLL": 0,  # the tensor-core gate_up's hot passes (HOT_NBLK): k blocks in flight per lane; 0 = GB_UNROLL
    # * GB_NBLK / HOT_NBLK (the B fragments' registers of a normal pass); -1 = auto (auto_hot_gate_up_unroll; the
    # tensor-core knob sets use it). Moves work only: the same bits
    "DB_HOT_UNROLL": 0,  # the grouped down's hot passes (HOT_NBLK): k blocks in flight per lane; 0 = DB_UNROLL *
    # DB_NBLK / HOT_NBLK (the B fragments' registers of a normal pass); -1 = auto (auto_hot_down_unroll; the
    # tensor-core knob sets use it). Moves work only: the same bits
    "W_TILED": 0,  # 1: the weights are tiled (kernels.formats: fp8-block128-t16 with W_FP8, bf16-t16 without: 16-row
    # tiles, a warp's k block 1 KB contiguous); needs both kernels on tensor cores (and FP8_LOAD16 with W_FP8). The
    # same bits
}
AUTO_KNOBS = ("LIST_PER", "GB_TILE", "GB_UNROLL", "DB_TILE", "DB_UNROLL", "DB_WARPS", "GB_NBLK", "DB_NBLK",
              "DB_ROW_TILES")
MMA_DOWN_WARPS = 16  # auto DB_WARPS with DB_MMA (H200, results/sweep-batched-pdl-*.json: 7-10 % over 8 at qwen3-30b)
# ... and from T = MMA_WIDE_DOWN_FROM on: 24 warps under launch bounds alone (768 threads -> <= 85 registers each;
# results/sweep-mma-dbwarps-*.json, sweep-split-mma24-30b.json; slower at qwen3-235b T=16, so not below 32)
MMA_WIDE_DOWN_WARPS = 24
MMA_UNROLL = 4  # auto GB_UNROLL / DB_UNROLL of the tensor-core kernels: k blocks of loads in flight (DB: 2 at 64-wide)
MMA_WIDE_DOWN_FROM = 32
# The bf16 tensor-core kernels on the tile table, where GB_MAX_REGS / DB_MAX_REGS are left auto (-1): 96
# registers keep 5 blocks of 4 warps per SM (4 at the 106-120 they take uncapped), spill-free for the gate_up's
# split chains with one 8-pair block and its single chain with two (a split chain with two spills under it), and for
# the grouped down's hot two-block passes (8 bytes of spill there with auto_hot_down_unroll's rounds, measured
# faster all the same, 2026-12-03 evening): the split chains 2 % faster at qwen3-30b / qwen3-235b T = 4 / 16 (H200,
# results/sweep-2026-12-02-whole-rounds-grouped-regs-*.json), the single chain with two blocks 0.8-1.6 % faster at
# T = 64, both models and routings (sweep-2026-12-03-mma-bf16-gate-up-regs-*.json); with hot passes (auto_hot_nblk)
# at qwen3-235b Zipf T = 64 the tensor-core path 863.3 us with both capped, 871.0 the gate_up alone, 875.9 the down
# alone, 880.6 neither (879.0 without hot passes); the grouped path 866.0 capped, 870.4 not
# (sweep-2026-12-03-hot-regs-*.json; 112 registers, spill-free with the hot rounds, were 0.8-1.0 % slower than 96,
# sweep-2026-12-03-hot-unroll-regs-mma-235b-zipf.json)
PASS_REGS = 96
DEFAULT_MAX_REGS = 128  # GB_MAX_REGS / DB_MAX_REGS where auto and no rule caps lower: spill-free at the defaults
HOT_EXPERT_BYTES = 16 << 20  # auto_hot_nblk: bf16 hot tiles where an expert's gate_up rows reach this
PAIR_FULL_WARPS = 64 * 132  # the per-pair gate_up's warps from which 2 k blocks in flight beat 4 (the H200's 132 SMs)
GROUPED_DOWN_WARPS = 4  # auto DB_WARPS of the grouped down: 4 warps x 16 rows of one tile per block, as gate_up's
FP8_WIDE_GROUPED_DOWN_WARPS = 2  # ... on FP8 weights at I >= ROW_TILES_FROM_INTER (auto_down_warps)
LIMITS = {
    "LIST_THREADS": (32, 1024), "LIST_PER": (0, 16),
    "GB_WARPS": (1, 32), "GB_OUTS": (1, 32), "GB_TILE": (0, 32), "GB_UNROLL": (0, 64), "GB_MAX_REGS": (-1, 255),
    "DB_WARPS": (0, 32), "DB_OUTS": (1, 32), "DB_TILE": (0, 32), "DB_UNROLL": (0, 64), "DB_MAX_REGS": (-1, 255),
    "DB_EARLY_INTER": (0, 1), "HOT_NBLK": (-1, 4),
    "GB_MMA": (0, 1), "DB_MMA": (0, 1), "GB_NBLK": (0, 4), "DB_NBLK": (0, 4), "PDL": (0, 1), "DB_EARLY_W2": (0, 1),
    "DB_BALANCE": (-1, 1), "PAIR_TILES": (0, 1), "DB_GROUPED": (-1, 1), "W_FP8": (0, 1),
    "PER_PAIR": (0, 1), "GB_KSPLIT": (1, 8), "FP8_LOAD16": (-1, 1), "FP8_BLOCK_SUM": (-1, 1),
    "FP8_PRMT": (-1, 3), "DB_WHOLE_RANGES": (-1, 1), "GB_RANGE_FLUSH": (-1, 1), "PAIRS_INNER": (-1, 1),
    "DB_ROW_TILES": (0, 2), "GB_SHARE": (-1, 4), "DB_SHARE": (-1, 4), "DB_HOT_UNROLL": (-1, 8),
    "GB_HOT_UNROLL": (-1, 8), "W_TILED": (0, 1),
}


# ---------------------------------------------------------------------------------------------------
# Knobs
# ---------------------------------------------------------------------------------------------------
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


def experts_average(dims: Dims, pairs: float) -> bool:
    """T*K >= pairs x E: an expert averages at least ``pairs`` (token, expert) pairs (qwen3, E / K = 16: from
    T = 16 x pairs) -- the load measure the auto rules switch on."""
    return dims.tokens * dims.top_k >= pairs * dims.experts


def auto_nblk() -> int:
    """The tensor-core gate_up's 8-pair blocks per pass where auto: 1, on bf16 and FP8 weights at every T. FP8: a
    second block's x fragments cost the registers the widening needs, and the grouped down's second block its
    occupancy (H200, T = 64, uniform: the tensor-core FP8 path qwen3-30b 199.7 -> 169.5 us, qwen3-235b 740.0 ->
    612.3, results/sweep-2026-12-02-fp8-nblk-*.json; the grouped FP8 path 209.6 -> 167.1 and 747.2 -> 602.5,
    results/sweep-2026-12-02-fp8-grouped-nblk-*.json). bf16 took 2 from T*K >= 4E until the hot experts' tiles shared
    one widening (GB_SHARE / DB_SHARE) and the grouped down ran whole ranges with one block: since then one block is
    as fast or faster at T = 64 (H200, results/sweep-2026-12-03-nblk-t64-*.json, two blocks under PASS_REGS):
    the tensor-core path at qwen3-235b 1098 -> 1085 us uniform, 899 -> 898 Zipf; the grouped (batch-invariant) path
    1112 -> 1079 at qwen3-235b and 293 -> 285.5 at qwen3-30b uniform, within 0.5 % under Zipf."""
    return 1


def auto_hot_nblk(dims: Dims | None, values: dict[str, int]) -> int:
    """HOT_NBLK where auto (-1), on the tensor-core tile table with one 8-pair block per pass, else 0:
    - FP8 weights: 2 once an expert averages 4 pairs (T*K >= 4E, qwen3 T >= 64). H200, Zipf routing
      (results/sweep-2026-12-02-hot-nblk-*.json): at T = 64 the tensor-core FP8 path 568.5 -> 533.8 us at qwen3-235b,
      the grouped FP8 path 573.6 -> 541.4 and 154.8 -> 149.3 at qwen3-30b; T = 32 within +-2 %; uniform T = 64 +1.2 %.
    - bf16 weights: 2 from T*K >= E with the grouped down, where an expert's gate_up rows are large (2*I*H bf16 >=
      HOT_EXPERT_BYTES: qwen3-235b's 24 MiB, not qwen3-30b's 6 MiB), with the passes held to PASS_REGS
      (gate_up_takes_pass_regs, down_takes_pass_regs). H200 (results/sweep-2026-12-03-hot-*.json), Zipf at
      qwen3-235b: the grouped path T = 16 / 32 / 64 530.2 / 682.0 / 884.6 -> 520.4 / 671.1 / 866.0 us, the
      tensor-core path T = 32 / 64 676.3 / 879.0 -> 669.9 / 863.3; uniform T = 64 within 0.1 % (grouped), 1069.6 ->
      1059.3 (tensor-core); mixtral-8x7b uniform T = 64 896.3 -> 786.6 (tensor-core), 930.9 -> 798.0 (grouped),
      T = 8 within 0.5 %.
      Not qwen3-30b (grouped -0.4 to +0.3 %, tensor-core +0.9 / +1.2 % at Zipf T = 32 / 64), nor the balanced
      (not grouped) down: the tensor-core path at qwen3-235b Zipf T = 16 536.6 -> 550.2."""
    if dims is None or not (values["GB_MMA"] and values["PAIR_TILES"] and values["GB_NBLK"] == 1):
        return 0
    if values["W_FP8"]:
        return 2 if experts_average(dims, 4) else 0
    large = 2 * dims.intermediate * dims.hidden * 2 >= HOT_EXPERT_BYTES
    return 2 if large and values["DB_GROUPED"] and experts_average(dims, 1) else 0


def auto_hot_down_unroll(values: dict[str, int]) -> int:
    """DB_HOT_UNROLL where auto (-1): on bf16 weights the grouped down's hot passes keep the normal pass's DB_UNROLL
    k blocks in flight (twice the halved default; 8 bytes of spill under PASS_REGS), elsewhere 0 (the halved
    default). H200, qwen3-235b Zipf (results/sweep-2026-12-03-hot-unroll-*.json, two interleaved runs each within
    0.2 %): T = 64 880.5 -> 874.3 us on the tensor-core path and 884.9 -> 878.1 on the grouped path (a second process:
    862.7 -> 856.9), T = 16 / 32 and uniform T = 64 within +-0.2 %; mixtral-8x7b uniform T = 64 804 -> 778-789. 3 k
    blocks (spill-free) took half the gain. FP8 (1 -> 2 k blocks, 4 bytes of spill): within that path's run-to-run
    drift at T = 32 / 64."""
    hot = values["HOT_NBLK"] > values["DB_NBLK"] and values["DB_GROUPED"] == 1
    return values["DB_UNROLL"] if hot and not values["W_FP8"] else 0


def auto_hot_gate_up_unroll(values: dict[str, int]) -> int:
    """GB_HOT_UNROLL where auto (-1): on bf16 weights the single-chain tensor-core gate_up's hot passes keep the
    normal pass's GB_UNROLL k blocks in flight (spill-free under PASS_REGS), elsewhere 0 (the halved default). H200,
    the tensor-core path, four interleaved rounds within 0.05 % (results/sweep-2026-12-03-gate-up-hot-unroll-4r-*.json,
    2026-12-03 21:00 UTC): qwen3-235b Zipf T = 32 / 64 669.4 / 856.9 -> 665.6 / 851.2 us; uniform T = 32 / 64 within
    0.1 %; mixtral-8x7b uniform T = 64 739 -> 710-719, T = 8 flat. 3 k blocks were 2-3 % slower than the default. The
    split chains spill 20 bytes with 4 and ran 1 % slower at qwen3-235b Zipf T = 16..64
    (sweep-2026-12-03-gate-up-hot-unroll-grouped-235b-zipf.json)."""
    hot = values["HOT_NBLK"] > values["GB_NBLK"] and values["GB_MMA"] and values["GB_KSPLIT"] == 1
    return values["GB_UNROLL"] if hot and not values["W_FP8"] and not values["PER_PAIR"] else 0


def fp8_on_tensor_cores(values: dict[str, int]) -> bool:
    """FP8 weights reach tensor-core kernels: what the FP8_* knobs shape."""
    return bool(values["W_FP8"] and (values["GB_MMA"] or values["DB_MMA"]))


def auto_fp8_mma(dims: Dims | None, values: dict[str, int]) -> None:
    """FP8_LOAD16 and FP8_BLOCK_SUM where auto (-1): both 1 for FP8 weights on tensor cores (FP8_LOAD16 where H and
    I are multiples of 16), else 0. H200, both models, T = 8 / 32 / 64 (results/sweep-2026-12-02-mma-fp8-load16-*.json):
    16-value loads take the tensor-core FP8 path 11-15 % faster (qwen3-30b 95.4 / 188.8 / 240.5 -> 85.8 / 168.2 /
    211.6 us, qwen3-235b 340.4 / 742.6 / 947.3 -> 302.7 / 649.7 / 804.8); the scale-block sums add 0-1.5 % there and
    take the per-pair form from 21.6 to 20.6 us at qwen3-30b T = 1. A function of the dims alone, never of T: the
    batch-invariant FP8 pair keeps one numerics. FP8_PRMT auto is 0 here without FP8 tensor-core kernels (else
    auto_fp8_widening, once GB_NBLK is known)."""
    fp8_mma = fp8_on_tensor_cores(values)
    if values["FP8_LOAD16"] == -1:
        fits = dims is None or (dims.hidden % 16 == 0 and dims.intermediate % 16 == 0)
        values["FP8_LOAD16"] = int(fp8_mma and fits)
    if values["FP8_BLOCK_SUM"] == -1:
        values["FP8_BLOCK_SUM"] = int(fp8_mma)
    if values["FP8_PRMT"] == -1 and not fp8_mma:
        values["FP8_PRMT"] = 0


def auto_fp8_widening(values: dict[str, int]) -> int:
    """FP8_PRMT where auto (-1) on FP8 tensor-core kernels: the byte-permute widening with its multiply on the B
    fragments (2) except with the plain tensor-core gate_up with two 8-pair blocks (GB_NBLK 2 set by hand, no split
    chains), where the byte permute spills at 4 k blocks in flight (0). A work knob (the outputs are bitwise the
    same). H200, both models: the byte permute against cvt (results/sweep-2026-12-02-fp8-widening-*.json) took the
    per-pair FP8 form 9-13 % faster (qwen3-30b T = 1 18.2 -> 15.8 us; qwen3-235b 46.3 -> 42.1), the grouped FP8 path
    2-7 %, the tensor-core FP8 path 0-3 %; its multiply on B instead of A
    (results/sweep-2026-12-03-fp8-widening-row-tiles-*.json) 2.1-2.2 % more on the tensor-core FP8 path at qwen3-235b
    T = 32 / 64 (538.6 / 617.5 -> 527.5 / 604.0 us), 0.9-1.7 % under Zipf, within +-0.3 % at T = 1 / 2 / 8 / 16 and
    -1.5 % at qwen3-30b T = 4 (per-pair), -1.0 % at T = 64 (grouped); it leaves DB_ROW_TILES 2 spill-free. The
    per-pair form takes 3 (its intermediate written x 2^8, its down's B multiply gone;
    results/sweep-2026-12-03-intermediate-x256-*.json, 40 replays): qwen3-30b T = 1 / 2 15.09 / 23.59 -> 14.72 /
    23.34 us, qwen3-235b 41.58 / 80.57 -> 41.26 / 79.91, Zipf -0.4 / -0.7 % (+1.1 % at qwen3-235b T = 4, where the
    dispatch takes other paths); on the tensor-core and grouped paths 3 was within +-1 %
    (results/sweep-2026-12-03-prmt3-gb-row-tiles-*.json), so they keep an intermediate in its own scale."""
    if values["GB_MMA"] and values["GB_NBLK"] > 1 and values["GB_KSPLIT"] == 1:  # the plain gate_up, two blocks
        return 0
    return 3 if values["PER_PAIR"] and values["GB_MMA"] and values["DB_MMA"] else 2


def round_sizes(values: dict[str, int], stage: str) -> tuple[int, int]:
    """A stage's ("GB" / "DB") k blocks per round: a normal pass's and a hot pass's where ``*_HOT_UNROLL`` sets them
    (else the normal pass's again: the halved default always divides it)."""
    return values[f"{stage}_UNROLL"], values[f"{stage}_HOT_UNROLL"] or values[f"{stage}_UNROLL"]


def whole_ranges(dims: Dims | None, values: dict[str, int]) -> bool:
    """Whether DB_WHOLE_RANGES 1 can run: bf16 weights, the grouped down, and its k range (I / 8 chunks of 8 values)
    a whole number of rounds of 4 x DB_UNROLL chunks (and of 4 x DB_HOT_UNROLL, a hot pass's). False without dims."""
    return bool(dims is not None and not values["W_FP8"] and values["DB_GROUPED"] == 1
                and all((dims.intermediate // 8) % (4 * r) == 0 for r in round_sizes(values, "DB")))


def range_flush_allowed(dims: Dims | None, values: dict[str, int]) -> bool:
    """Whether GB_RANGE_FLUSH 1 can run: the split-chain gate_up of the lists path, and k_range's range size (whole
    k blocks of 4 chunks of 8 values, 8 with FP8_LOAD16) a multiple of a round's k blocks x GB_UNROLL (and x
    GB_HOT_UNROLL, a hot pass's), so that no round straddles two ranges -- and with FP8_BLOCK_SUM a multiple of a
    128-wide scale block, so that each range ends on one. False without dims."""
    if dims is None or not values["GB_MMA"] or values["GB_KSPLIT"] == 1 or values["PER_PAIR"]:
        return False
    block = 8 if values["W_FP8"] and values["FP8_LOAD16"] else 4  # chunks per k block (MMA_KB)
    per_range = -(-(dims.hidden // 8) // values["GB_KSPLIT"])
    size = -(-per_range // block) * block
    scale_ok = not (values["W_FP8"] and values["FP8_BLOCK_SUM"]) or size % 16 == 0
    return all(size % (block * r) == 0 for r in round_sizes(values, "GB")) and scale_ok


def _auto_or_refuse(values: dict[str, int], key: str, auto: int, can_run: bool, needs: str) -> None:
    """An on/off knob that the dims decide: -1 takes ``auto``; 1 where it cannot run is a ValueError saying what
    it needs (``needs``, after "<key> 1 ")."""
    if values[key] == -1:
        values[key] = auto
    elif values[key] == 1 and not can_run:
        raise ValueError(f"{key} 1 {needs}")


def auto_pairs_inner(dims: Dims | None, values: dict[str, int]) -> int:
    """PAIRS_INNER where auto (-1): 1 for the per-pair kernels from T = 2 on (a token's K experts are distinct, so
    only the pairs of different tokens can share one), else 0. H200, bf16, T = 1 / 2 / 4
    (results/sweep-2026-12-02-pairs-inner-*.json): at T = 4 10-17 % faster under both routings (qwen3-235b 280.6
    -> 239.9 us uniform, 279.0 -> 232.0 Zipf); at T = 2 1-10 % faster under Zipf (qwen3-235b 143.9 -> 130.0) and
    1.4-2.8 % slower under uniform routing, which shares no expert there; at T = 1 0.6-1.9 % slower."""
    return int(bool(values["PER_PAIR"]) and dims is not None and dims.tokens >= 2)


def auto_range_flush(dims: Dims | None, values: dict[str, int]) -> int:
    """GB_RANGE_FLUSH where auto (-1): 1 wherever it can run on bf16 weights, and on FP8 weights with one 8-pair block
    per pass (GB_NBLK 1). H200, the grouped path at T = 4 / 16 / 64: bf16 2-4 % faster everywhere
    (results/sweep-2026-12-02-range-flush-grouped-*.json: qwen3-30b 65.0 / 179.5 / 291.4 -> 63.4 / 175.5 / 284.0
    us); FP8 (results/sweep-2026-12-02-range-flush-grouped-fp8-*.json) 1.3-2.5 % faster at T = 4 (qwen3-30b 49.4 ->
    48.1, qwen3-235b 141.8 -> 140.0), within 0.6 % at T = 16, 1-2 % slower at T = 64 with two blocks and 2 rounds
    in flight (211.4 -> 213.6, 770.2 -> 786.3)."""
    return int(range_flush_allowed(dims, values) and (not values["W_FP8"] or values["GB_NBLK"] == 1))


def auto_whole_ranges(dims: Dims | None, values: dict[str, int]) -> int:
    """DB_WHOLE_RANGES where auto (-1): 1 where it can run with one 8-pair block per pass (DB_NBLK 1). H200, both
    models, the grouped path (results/sweep-2026-12-02-whole-ranges-*.json): 1-2 % faster at T = 4 / 16 (qwen3-30b
    66.3 / 183.3 -> 65.3 / 181.8 us, qwen3-235b 235.8 / 701.6 -> 231.5 / 691.5), 3 % slower at T = 64 with two blocks
    (293.5 -> 302.1, 1123 -> 1159: 128 registers instead of 112), the plain tensor-core path's grouped down too."""
    return int(whole_ranges(dims, values) and values["DB_NBLK"] == 1)


def auto_mma_gate_up_unroll(dims: Dims, values: dict[str, int]) -> int:
    """The tensor-core gate_up's k blocks of loads in flight per lane (H200 sweeps,
    results/sweep-2026-12-02-unroll-*.json; knobs that only move work, never the numerics):

    * the per-pair form on bf16: 4 while its warps (T*K pairs x I/8 neuron groups x GB_KSPLIT ranges) number fewer
      than PAIR_FULL_WARPS, 2 from there -- qwen3-30b T = 1 23.1 vs 23.7 us, T = 2 38.5 vs 40.3; qwen3-235b T = 1
      73.8 vs 75.4;
    * FP8 16-value loads with split chains and two 8-pair blocks (set by hand: auto_nblk gives one): 2, which
      stays under the 128-register cap (4 spilled) -- qwen3-30b T = 64 218.7 vs 222.8 us, qwen3-235b 788.8 vs 809.8;
    * else MMA_UNROLL.
    """
    if values["PER_PAIR"] and not values["W_FP8"]:
        warps = dims.tokens * dims.top_k * -(-dims.intermediate // 8) * values["GB_KSPLIT"]
        return MMA_UNROLL if warps < PAIR_FULL_WARPS else MMA_UNROLL // 2
    if values["FP8_LOAD16"] and values["GB_KSPLIT"] > 1 and values["GB_NBLK"] > 1:
        return MMA_UNROLL // 2
    return MMA_UNROLL


def gate_up_takes_pass_regs(values: dict[str, int]) -> bool:
    """Whether the bf16 tensor-core gate_up on the tile table takes PASS_REGS: split k chains with one 8-pair block
    per pass, or a single chain whose widest pass (GB_NBLK or HOT_NBLK) has two (what compiles spill-free under it
    at every preset)."""
    if not values["GB_MMA"] or values["PER_PAIR"] or values["W_FP8"]:
        return False
    if values["GB_KSPLIT"] > 1:
        return values["GB_NBLK"] == 1
    return max(values["GB_NBLK"], values["HOT_NBLK"]) == 2 and bool(values["PAIR_TILES"])


def fp8_gate_up_takes_pass_regs(dims: Dims | None, values: dict[str, int]) -> bool:
    """Whether the FP8 tensor-core gate_up on the tile table (one k chain) takes PASS_REGS: where an expert averages
    more than an eighth and at most a quarter of a pair (E/8 < T*K <= E/4: qwen3 T = 4). 122-124 registers uncapped
    hold 4 blocks of 4 warps per SM, 96 (8 bytes of spill) hold 5, so the ~30 tiles of T = 4 run in fewer waves.
    H200, two interleaved rounds each (results/sweep-2026-12-03-gate-up-regs-fp8-*.json), T = 4: qwen3-235b 136.3 ->
    129.6 us uniform, 130.2 -> 123.9 under Zipf; qwen3-30b 44.9 -> 40.5 and 43.0 -> 38.9. Elsewhere it loses or
    depends on the routing's tile count: qwen3-30b T = 2 +4 %; T = 8 -3.3 % uniform but +7.8 % under Zipf at
    qwen3-30b, +2.6 / -0.7 % at qwen3-235b; T = 16 flat to +6 %; T = 32 / 64 +1.3-4.8 % at qwen3-30b."""
    return bool(dims is not None and values["W_FP8"] and values["GB_MMA"] and values["PAIR_TILES"]
                and values["GB_KSPLIT"] == 1 and dims.experts < 8 * dims.tokens * dims.top_k <= 2 * dims.experts)


def down_takes_pass_regs(values: dict[str, int]) -> bool:
    """Whether the bf16 grouped down takes PASS_REGS: one 8-pair block per pass with hot tiles in two (116 registers
    uncapped, 4 blocks per SM; under 96 spill-free at every preset with the halved hot rounds, 8 bytes of spill with
    auto_hot_down_unroll's, measured faster)."""
    return bool(values["DB_GROUPED"] and not values["W_FP8"] and values["DB_NBLK"] == 1 and values["HOT_NBLK"] == 2)


def auto_down_unroll(dims: Dims, params: dict[str, int]) -> int:
    """Rounds of w2 loads in flight: 2 when the tile leaves room (<= 4 pairs) and the row splits into whole
    rounds of 2 (no half-masked last round: qwen3-235b, I = 1536, 192 chunks of 16 B); else 1 (qwen3-30b,
    I = 768, 96 chunks; H200 sweep: results/sweep-batched-*.json)."""
    chunks = dims.intermediate // (params["DB_BYTES"] // 2)
    return 2 if params["DB_TILE"] <= 4 and chunks % (32 * 2) == 0 else 1


def block_registers(warps: int, cap: int) -> int:
    """Registers a block of ``warps`` warps takes under a __maxnreg__ ``cap`` (allocated in units of 8)."""
    return warps * 32 * -(-cap // 8) * 8


def auto_down_warps(dims: Dims | None, params: dict[str, int]) -> int:
    """Warps per down block: 4 for the FMA down (results/sweep-batched-235b-t4.json, sweep-batched-db-30b.json);
    with DB_MMA :data:`MMA_DOWN_WARPS`, or from T = :data:`MMA_WIDE_DOWN_FROM` on :data:`MMA_WIDE_DOWN_WARPS` when
    their partials fit the shared memory and the register cap allows 768 threads (the default cap of 128 then gives
    way to launch bounds alone). The grouped down: :data:`GROUPED_DOWN_WARPS`, or on FP8 weights at I >= 1536
    :data:`FP8_WIDE_GROUPED_DOWN_WARPS` -- smaller blocks spread a hot expert's tiles finer: H200, qwen3-235b
    (results/sweep-2026-12-03-{grouped,mma}-down-warps-235b-*.json, 4 -> 2 warps), Zipf T = 16 / 32 / 64 314.2 /
    409.3 / 543.8 -> 308.1 / 403.4 / 533.8 us, uniform within 0.4 %; 8 warps slower everywhere."""
    if not params["DB_MMA"]:
        return DEFAULTS["DB_WARPS"]
    if params["DB_GROUPED"]:
        return FP8_WIDE_GROUPED_DOWN_WARPS if wide_fp8_grouped_down(dims, params) else GROUPED_DOWN_WARPS
    if dims is None or dims.tokens < MMA_WIDE_DOWN_FROM:
        return MMA_DOWN_WARPS
    cap = params["DB_MAX_REGS"]
    fits_registers = cap == -1 or block_registers(MMA_WIDE_DOWN_WARPS, cap) <= REGISTERS_PER_BLOCK  # -1: auto
    fits_shared = down_shared_bytes(dims, {**params, "DB_WARPS": MMA_WIDE_DOWN_WARPS}) <= OPT_IN_SHARED_LIMIT
    return MMA_WIDE_DOWN_WARPS if fits_registers and fits_shared else MMA_DOWN_WARPS


BALANCE_BELOW = 0.85  # auto DB_BALANCE when a round-robin's last round of experts is less full than this


def auto_balance(dims: Dims | None, params: dict[str, int]) -> int:
    """DB_BALANCE for the tensor-core down: 1 with PAIR_TILES; else 1 when dealing the expected active experts
    (E * (1 - (1 - K/E)**T), at most T*K) round-robin to DB_WARPS warps leaves the last round less than
    :data:`BALANCE_BELOW` full on average (mean / ceil(mean) experts per warp), else 0 (H200 sweeps:
    results/sweep-stage-*.json)."""
    if not params["DB_MMA"]:
        return 0
    if params["PAIR_TILES"]:  # the tile table weighs experts by their pairs: balance by it at every T
        return 1
    if dims is None:
        return 0
    k, e = dims.top_k, dims.experts
    active = min(e * (1.0 - (1.0 - min(k, e) / e) ** dims.tokens), dims.tokens * k)
    mean = active / params["DB_WARPS"]
    return 1 if mean / math.ceil(mean) < BALANCE_BELOW else 0


GROUPED_FROM_PAIRS_PER_EXPERT = 2  # auto DB_GROUPED from T*K / E >= 2 (qwen3: T >= 32)
FP8_WIDE_GROUPED_FROM_PAIRS_PER_EXPERT = 0.25  # on FP8 weights at I >= 1536: from T*K / E >= 1/4 (qwen3-235b: T >= 4)


def auto_grouped(dims: Dims | None, params: dict[str, int]) -> int:
    """DB_GROUPED for the tensor-core path with tiles: 1 once experts average 2 pairs (T*K >= 2E), else 0. H200,
    qwen3-30b-a3b / qwen3-235b-a22b (results/sweep-2026-12-01-mma-grouped-*.json): from T = 32 the grouped down
    costs <= 1 % under uniform routing and saves 3-5 % under Zipf; at T <= 16 it costs 1-16 % (its fourth launch).
    On FP8 weights with rows of I >= 1536 (its 2-warp blocks of one row tile, 4 rounds in flight) from a quarter of
    a pair per expert: qwen3-235b T = 4 / 8 / 16 (results/sweep-2026-12-03-mma-fp8-grouped-*.json, the knob
    interleaved twice) 140.9 / 247.8 / 383.9 -> 136.2 / 237.4 / 369.7 us uniform, 134.0 / 199.8 / 302.3 -> 129.8 /
    192.5 / 294.5 under Zipf; at qwen3-30b (I = 768) T = 8 / 16 it gains nothing (-0.9 to +2.5 %)."""
    if dims is None or not (params["DB_MMA"] and params["PAIR_TILES"]):
        return 0
    per_expert = FP8_WIDE_GROUPED_FROM_PAIRS_PER_EXPERT if wide_fp8(dims, params) else GROUPED_FROM_PAIRS_PER_EXPERT
    return 1 if experts_average(dims, per_expert) else 0


ROW_TILES_FROM_INTER = 1536  # auto DB_ROW_TILES 2 from I = 1536 (qwen3-235b-a22b), measured below


def wide_fp8(dims: Dims | None, values: dict[str, int]) -> bool:
    """FP8 weights with rows of I >= :data:`ROW_TILES_FROM_INTER` (qwen3-235b's 1536): where the down's auto rules
    (grouping, row tiles, rounds, warps per block) differ from the defaults (each rule adds its own conditions)."""
    return bool(dims is not None and values["W_FP8"] and dims.intermediate >= ROW_TILES_FROM_INTER)


def wide_fp8_grouped_down(dims: Dims | None, values: dict[str, int]) -> bool:
    """The grouped down on :func:`wide_fp8` weights."""
    return bool(values["DB_GROUPED"]) and wide_fp8(dims, values)


def auto_row_tiles(dims: Dims | None, values: dict[str, int]) -> int:
    """DB_ROW_TILES where auto (0): 2 for FP8 weights on the grouped down with the widening's multiply on B (FP8_PRMT
    2: with it the two tiles fit 128 registers spill-free at DB_UNROLL 2), where T*K >= 2E and I >= 1536; else 1.
    H200 (results/sweep-2026-12-03-fp8-widening-row-tiles-*.json, DB_UNROLL 2): the tensor-core FP8 path at
    qwen3-235b T = 32 / 64 527.5 / 604.0 -> 523.7 / 591.3 us uniform (0.7 / 2.1 %), 397.8 / 537.4 -> 396.0 / 531.3
    under Zipf; at qwen3-30b (I = 768) T = 64 +0.5 %, T = 16 +2.2 %, at qwen3-235b T = 8 +2.8 % (fewer warps where
    there are few tiles). At DB_UNROLL 1 two tiles beat one but both lose 8-15 % to DB_UNROLL 2. A hot tile (HOT_NBLK)
    runs both row tiles in its pass -- spill-free since the downs load one scale row per warp -- 3-4 % faster at
    qwen3-235b T = 64 Zipf than one at a time (525.3 -> 504.2 us; results/sweep-2026-12-03-down-one-scale-row-*.json,
    sweep-2026-12-03-hot-down-row-tiles-*.json)."""
    if dims is None or not wide_fp8_grouped_down(dims, values) or values["FP8_PRMT"] < 2 or values["DB_UNROLL"] < 2:
        return 1
    return 2 if experts_average(dims, GROUPED_FROM_PAIRS_PER_EXPERT) else 1


ONE_TILE_DOWN_UNROLL = 4  # auto DB_UNROLL of the FP8 grouped down with one row tile from I = ROW_TILES_FROM_INTER


def auto_fp8_down_unroll(dims: Dims, values: dict[str, int]) -> int:
    """DB_UNROLL where auto on a tensor-core down: :data:`ONE_TILE_DOWN_UNROLL` 64-wide k blocks in flight on the FP8
    grouped down where its warps keep one row tile (DB_ROW_TILES 1) at I >= 1536, else the tensor-core default
    (:data:`MMA_UNROLL` / 2 at 64-wide blocks; two row tiles spill at 4). H200 (results/sweep-2026-12-03-grouped-down-
    {row-tiles,unroll}-*.json, the grouped FP8 path, DB_UNROLL 2 -> 4): qwen3-235b T = 8 / 16 251.3 / 393.2 -> 249.6 /
    387.2 us uniform, 203.6 / 307.5 -> 200.7 / 301.7 under Zipf; at qwen3-30b (I = 768) -1.2 to +1.2 %: unchanged."""
    one_tile = values["DB_ROW_TILES"] == 1 and values["FP8_LOAD16"] and values["FP8_PRMT"] >= 2
    return ONE_TILE_DOWN_UNROLL if wide_fp8_grouped_down(dims, values) and one_tile else values["DB_UNROLL"]


def slots(dims: Dims) -> int:
    """List slots: every active expert (<= min(E, T*K)) plus one for out-of-range ids."""
    return min(dims.experts, dims.tokens * dims.top_k) + 1


def tile_capacity(dims: Dims, tile_pairs: int = 8) -> int:
    """Tiles of ``tile_pairs`` pairs the batch's slots can need at most: sum of ceil(count / tile) over the
    slots <= T*K // tile + slots. The tile table is sized for 8 (the smallest tile)."""
    return slots(dims) + dims.tokens * dims.top_k // tile_pairs


def tile_pairs(params: dict[str, int]) -> int:
    """Pairs per tile of the tile table: one gate_up pass, 8 * GB_NBLK, or 8 * HOT_NBLK where that is wider."""
    return 8 * max(params["GB_NBLK"], params.get("HOT_NBLK", 0))


TILE_ARRAYS = 4  # the tile table's arrays: expert, first pair, pairs, place in the expert's run of tiles


def lists_size(dims: Dims) -> int:
    """int32s of the lists buffer: header, expert / offset / count per slot, the sorted pairs, the tile table
    (expert / first / count / place in its expert's run per tile, written with PAIR_TILES)."""
    return LIST_HEADER + 3 * slots(dims) + dims.tokens * dims.top_k + TILE_ARRAYS * tile_capacity(dims)


def lists_shared_bytes(dims: Dims, params: dict[str, int]) -> int:
    """Dynamic shared memory of the list kernel: one int per expert (+1 for bad ids) and per warp's count table
    of them, two per pair (its expert and its rank)."""
    warps = params["LIST_THREADS"] // 32
    return ((dims.experts + 1) * (1 + warps) + 2 * dims.tokens * dims.top_k) * 4


def down_columns(params: dict[str, int]) -> int:
    """Hidden columns per down block: DB_OUTS, or 16 (the mma's M) with DB_MMA."""
    return 16 if params.get("DB_MMA") else params["DB_OUTS"]


def down_shared_bytes(dims: Dims, params: dict[str, int]) -> int:
    """Dynamic shared memory of the down kernel: per warp an FP32 partial [T][columns] (none when grouped)."""
    if params.get("DB_GROUPED"):
        return 0
    return params["DB_WARPS"] * dims.tokens * down_columns(params) * 4


def share_shared_bytes(values: dict[str, int], stage: str) -> int:
    """Static shared memory of GB_SHARE / DB_SHARE (``stage`` "GB" / "DB"): two round buffers of widened A fragments
    (UNROLL k blocks x halves x row tiles x 2 x 32 lanes x 16 bytes) for each of WARPS / 2 groups."""
    nblk, unroll = values[f"{stage}_NBLK"], values[f"{stage}_UNROLL"]
    if values["HOT_NBLK"] > nblk:
        unroll = max(1, unroll * nblk // values["HOT_NBLK"])
    halves = 2 if values["W_FP8"] and values["FP8_LOAD16"] else 1
    row_tiles = values["DB_ROW_TILES"] if stage == "DB" else 1
    return values[f"{stage}_WARPS"] // 2 * 2 * unroll * halves * row_tiles * 2 * 32 * 16


def share_unmet(values: dict[str, int], stage: str, share: int) -> str | None:
    """Why ``stage`` ("GB" / "DB") cannot run groups of ``share`` tiles with these resolved knobs (a ValueError's
    message), or None: the gate_up on the tile table walking H in one loop (a single k chain, or split chains with
    GB_RANGE_FLUSH) / the grouped down with a tile in one pass, 2 or 4 dividing the stage's warps, the groups'
    buffers within 48 KB of static shared memory."""
    one_loop = values["GB_KSPLIT"] == 1 or values["GB_RANGE_FLUSH"] == 1
    if stage == "GB" and not (values["GB_MMA"] and values["PAIR_TILES"] and one_loop):
        return ("GB_SHARE groups the tile table's tiles of one expert in the tensor-core gate_up's one loop over H: it "
                "needs GB_MMA 1, PAIR_TILES 1 and GB_KSPLIT 1 or GB_RANGE_FLUSH 1")
    if stage == "DB" and not values["DB_GROUPED"]:
        return "DB_SHARE groups the tile table's tiles of one expert in the grouped down: it needs DB_GROUPED 1"
    warps = values[f"{stage}_WARPS"]
    if share not in (2, 4) or warps % share:
        return (f"{stage}_SHARE must be 2 or 4 and divide {stage}_WARPS, got {stage}_SHARE {share} and {stage}_WARPS "
                f"{warps}")
    if share_shared_bytes(values, stage) > SHARED_LIMIT:
        return (f"{stage}_SHARE: the groups' buffers take {share_shared_bytes(values, stage)} bytes of static shared "
                f"memory > {SHARED_LIMIT}; lower {stage}_WARPS or {stage}_UNROLL")
    if stage == "DB" and 8 * max(values["DB_NBLK"], values["HOT_NBLK"]) < tile_pairs(values):
        return (f"DB_SHARE runs each tile in one down pass: 8 x max(DB_NBLK, HOT_NBLK) must hold a tile of "
                f"{tile_pairs(values)} pairs, got DB_NBLK {values['DB_NBLK']}")
    return None


SHARE_GROUP = 4  # auto GB_SHARE / DB_SHARE where they apply (auto_share)


def auto_share(dims: Dims | None, values: dict[str, int], stage: str) -> int:
    """GB_SHARE / DB_SHARE where auto (-1): :data:`SHARE_GROUP` on bf16 weights from T*K >= 2E (experts average 2
    pairs: a hot expert's tiles repeat) where the stage can run it (:func:`share_unmet`), else 0. H200, bf16, groups
    of 4 in both stages (results/sweep-2026-12-03-shared-widening-mma-bf16-*.json, two interleaved runs, within
    0.2 %): Zipf qwen3-235b T = 32 / 64 688.7 / 882.3 -> 682.3 / 868.7 us (the gate_up's share 0.8 / 1.0 %, the
    down's 0.1 / 0.5 %), qwen3-30b 185.2 / 233.0 -> 181.2 / 231.2; uniform qwen3-235b 951.6 / 1074.3 -> 947.6 /
    1077.1. The batch-invariant grouped path's split chains (GB_RANGE_FLUSH) share too: its gate_up 0.3-1.0 % faster
    under Zipf (results/sweep-2026-12-03-grouped-split-chain-share-*.json: qwen3-235b T = 32 / 64 686.0 / 878.3 ->
    679.3 / 872.3 us, qwen3-30b 185.1 / 232.4 -> 184.7 / 231.7). On FP8 weights (within 3.3 % run-to-run drift
    there) the shared rounds were 1-3 % slower at qwen3-235b T = 32 / 64 and 1.6-8.7 % at qwen3-30b T = 64 Zipf:
    off."""
    if dims is None or values["W_FP8"] or not experts_average(dims, GROUPED_FROM_PAIRS_PER_EXPERT):
        return 0
    return SHARE_GROUP if share_unmet(values, stage, SHARE_GROUP) is None else 0


def _check_share(values: dict[str, int]) -> None:
    """GB_SHARE / DB_SHARE set above 1 on resolved knobs: ValueError saying what the stage needs."""
    for stage in ("GB", "DB"):
        share = values[f"{stage}_SHARE"]
        unmet = share_unmet(values, stage, share) if share > 1 else None
        if unmet:
            raise ValueError(unmet)


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """The family's rules on validated knobs (:meth:`KernelFamily.resolve` has checked names, types and
    :data:`LIMITS`): reject combinations that cannot run and fill the auto knobs (0) from ``dims``.

    Without ``dims`` auto knobs take :data:`DEFAULTS`. ValueError names a knob combination these kernels cannot
    run, or a problem these knobs cannot run (too many experts for the list kernel, too many tokens for the down
    kernel's shared memory).
    """
    if values["DB_EARLY_W2"] and not values["DB_MMA"]:
        raise ValueError("DB_EARLY_W2 applies to the tensor-core down kernel: it needs DB_MMA 1")
    if values["DB_BALANCE"] == 1 and not values["DB_MMA"]:
        raise ValueError("DB_BALANCE applies to the tensor-core down kernel: it needs DB_MMA 1")
    if values["PAIR_TILES"] and not values["GB_MMA"]:
        raise ValueError("PAIR_TILES cuts the tensor-core gate_up's work into tiles: it needs GB_MMA 1")
    if values["DB_GROUPED"] == -1:
        values["DB_GROUPED"] = auto_grouped(dims, values)
    if values["DB_GROUPED"] and not (values["DB_MMA"] and values["PAIR_TILES"]):
        raise ValueError("DB_GROUPED runs the tensor-core down over the tile table: it needs DB_MMA 1 and PAIR_TILES 1")
    if values["PER_PAIR"] and not (values["GB_MMA"] and values["DB_MMA"]) or \
            values["PER_PAIR"] and (values["PAIR_TILES"] or values["DB_GROUPED"]):
        raise ValueError("PER_PAIR runs the tensor-core kernels without lists: it needs GB_MMA 1 and DB_MMA 1, and "
                         "PAIR_TILES 0 and DB_GROUPED 0")
    if values["PAIRS_INNER"] == -1:
        values["PAIRS_INNER"] = auto_pairs_inner(dims, values)
    elif values["PAIRS_INNER"] and not values["PER_PAIR"]:
        raise ValueError("PAIRS_INNER orders the per-pair kernels' blocks: it needs PER_PAIR 1")
    if values["HOT_NBLK"] > 0 and not values["GB_MMA"]:
        raise ValueError("HOT_NBLK widens the tensor-core gate_up's passes over a hot expert: it needs GB_MMA 1")
    if values["GB_KSPLIT"] > 1 and not values["GB_MMA"]:
        raise ValueError("GB_KSPLIT cuts the tensor-core gate_up's k chains: it needs GB_MMA 1")
    auto_fp8_mma(dims, values)
    for key in ("FP8_LOAD16", "FP8_BLOCK_SUM", "FP8_PRMT"):
        if values[key] > 0 and not fp8_on_tensor_cores(values):
            raise ValueError(f"{key} shapes the tensor-core kernels' FP8 loads, widening and scaling: it needs W_FP8 1 "
                             "and GB_MMA or DB_MMA 1")
    if values["FP8_PRMT"] == 3 and not (values["GB_MMA"] and values["DB_MMA"]):
        raise ValueError("FP8_PRMT 3 has the tensor-core gate_up write the intermediate x 2^8 for the tensor-core "
                         f"down: it needs GB_MMA 1 and DB_MMA 1, got {values['GB_MMA']} and {values['DB_MMA']}")
    if values["FP8_LOAD16"] and dims is not None and (dims.hidden % 16 or dims.intermediate % 16):
        raise ValueError(f"FP8_LOAD16 loads 16 e4m3 values per row and lane: H and I must be multiples of 16, got "
                         f"H = {dims.hidden}, I = {dims.intermediate}")
    fp8_loads_whole = values["FP8_LOAD16"] or not values["W_FP8"]
    if values["W_TILED"] and not (values["GB_MMA"] and values["DB_MMA"] and fp8_loads_whole):
        raise ValueError(f"W_TILED reads tiles in the tensor-core kernels' 64-byte k blocks: it needs GB_MMA 1 and "
                         f"DB_MMA 1 (and FP8_LOAD16 1 with W_FP8), got {values['GB_MMA']}, {values['DB_MMA']} (and "
                         f"{values['FP8_LOAD16']} with W_FP8 {values['W_FP8']})")
    width = tile_k(1 if values["W_FP8"] else 2)
    if values["W_TILED"] and dims is not None and (dims.hidden % width or dims.intermediate % width):
        raise ValueError(f"W_TILED reads {width}-value tiles: H and I must be multiples of {width}, got "
                         f"H = {dims.hidden}, I = {dims.intermediate}")
    if values["PER_PAIR"] and values["GB_WARPS"] % values["GB_KSPLIT"]:
        raise ValueError(f"PER_PAIR gives each of GB_KSPLIT k ranges a warp: GB_WARPS must be a multiple of "
                         f"GB_KSPLIT, got {values['GB_WARPS']} and {values['GB_KSPLIT']}")
    if values["PER_PAIR"] and dims is not None and dims.top_k > 16:
        raise ValueError(f"PER_PAIR gives each of a token's K slots a warp of one block: K <= 16, got {dims.top_k}")
    if values["LIST_THREADS"] % 32:
        raise ValueError(f"LIST_THREADS must be a multiple of 32, got {values['LIST_THREADS']}")
    for key in ("GB_BYTES", "DB_BYTES"):
        if values[key] not in (4, 8, 16):
            raise ValueError(f"{key} must be 4, 8 or 16, got {values[key]}")
        if values["W_FP8"] and values[key] < 8:
            raise ValueError(f"W_FP8 loads {key} / 2 bytes of weights per activation chunk: {key} must be 8 or 16, "
                             f"got {values[key]}")
    if values["DB_WARPS"] == 0:  # the tensor-core down wants more warps per block (one block per SM)
        values["DB_WARPS"] = auto_down_warps(dims, values)
        if values["DB_WARPS"] == MMA_WIDE_DOWN_WARPS and values["DB_MAX_REGS"] == -1:
            values["DB_MAX_REGS"] = 0  # what was measured: __launch_bounds__(768) alone
    auto_caps = {kernel for kernel in ("GB", "DB") if values[f"{kernel}_MAX_REGS"] == -1}  # PASS_REGS may apply below
    for kernel in ("GB", "DB"):  # a __maxnreg__ cap is per thread: the block must still fit the register file
        if kernel in auto_caps:
            values[f"{kernel}_MAX_REGS"] = DEFAULT_MAX_REGS
        warps, cap = values[f"{kernel}_WARPS"], values[f"{kernel}_MAX_REGS"]
        if cap and block_registers(warps, cap) > REGISTERS_PER_BLOCK:
            raise ValueError(
                f"{kernel}_WARPS {warps} x 32 threads x {kernel}_MAX_REGS {cap} registers exceeds the "
                f"{REGISTERS_PER_BLOCK} registers of a block (the launch would fail): lower {kernel}_WARPS or "
                f"{kernel}_MAX_REGS (0 lets __launch_bounds__ fit the block)")
    mma_gate_up_unroll_auto = values["GB_UNROLL"] == 0 and values["GB_MMA"]
    mma_down_unroll_auto = values["DB_UNROLL"] == 0 and values["DB_MMA"]
    for kernel in ("GB", "DB"):  # the tensor-core kernels' rounds (the gate_up's refined from the dims below)
        if values[f"{kernel}_UNROLL"] == 0 and values[f"{kernel}_MMA"]:
            values[f"{kernel}_UNROLL"] = MMA_UNROLL
            if kernel == "DB" and values["FP8_LOAD16"]:  # 64-wide k blocks: half the rounds, the same bytes
                values["DB_UNROLL"] = MMA_UNROLL // 2
    if values["DB_BALANCE"] == -1:
        values["DB_BALANCE"] = auto_balance(dims, values)
    if dims is None:
        for key in AUTO_KNOBS:
            if values[key] == 0:
                values[key] = DEFAULTS[key]
        if values["FP8_PRMT"] == -1:
            values["FP8_PRMT"] = auto_fp8_widening(values)
        for key in ("DB_WHOLE_RANGES", "GB_RANGE_FLUSH", "HOT_NBLK", "GB_SHARE", "DB_SHARE", "DB_HOT_UNROLL",
                    "GB_HOT_UNROLL"):
            values[key] = max(values[key], 0)                                          # (checked where known)
        _check_share(values)
        return values
    if values["LIST_PER"] == 0:
        values["LIST_PER"] = -(-(dims.experts + 1) // values["LIST_THREADS"])
    if (dims.experts + 1) > values["LIST_THREADS"] * values["LIST_PER"]:
        raise ValueError(
            f"the list kernel covers LIST_THREADS * LIST_PER = {values['LIST_THREADS'] * values['LIST_PER']} "
            f"experts, needs E + 1 = {dims.experts + 1}: raise LIST_THREADS (<= 1024) or LIST_PER (<= 16)"
        )
    if values["LIST_PER"] > LIMITS["LIST_PER"][1]:
        raise ValueError(f"E = {dims.experts} needs LIST_PER > 16 at LIST_THREADS {values['LIST_THREADS']}: "
                         "raise LIST_THREADS (<= 1024)")
    if lists_shared_bytes(dims, values) > OPT_IN_SHARED_LIMIT:
        raise ValueError(
            f"the list kernel keeps (1 + LIST_THREADS / 32) ints per expert and two per pair in shared memory: "
            f"E = {dims.experts} and T * K = {dims.tokens * dims.top_k} need {lists_shared_bytes(dims, values)} "
            f"bytes > {OPT_IN_SHARED_LIMIT}")
    if values["GB_TILE"] == 0:
        values["GB_TILE"] = auto_tile(dims)
    if values["GB_UNROLL"] == 0:  # the sweep: 2 rounds with 4-pair tiles (3 % at qwen3-235b T=16), else 4
        values["GB_UNROLL"] = 2 if values["GB_TILE"] == 4 else 4
    if values["DB_TILE"] == 0:
        values["DB_TILE"] = auto_down_tile(dims)
    if values["DB_UNROLL"] == 0:
        values["DB_UNROLL"] = auto_down_unroll(dims, values)
    if values["GB_NBLK"] == 0:
        values["GB_NBLK"] = auto_nblk()
    if values["DB_NBLK"] == 0:  # the grouped down: a tile's pairs in one pass (H200, results/sweep-2026-12-01-mma-
        # nblk-*.json: qwen3-235b Zipf T = 64 975 -> 940 us, qwen3-30b 245 -> 241; uniform within 0.5 %)
        values["DB_NBLK"] = values["GB_NBLK"] if values["DB_GROUPED"] else 1
    if values["FP8_PRMT"] == -1:
        values["FP8_PRMT"] = auto_fp8_widening(values)
    if values["HOT_NBLK"] == -1:
        values["HOT_NBLK"] = auto_hot_nblk(dims, values)
    if values["DB_HOT_UNROLL"] == -1:
        values["DB_HOT_UNROLL"] = auto_hot_down_unroll(values)
    if mma_gate_up_unroll_auto:
        values["GB_UNROLL"] = auto_mma_gate_up_unroll(dims, values)
    if values["GB_HOT_UNROLL"] == -1:
        values["GB_HOT_UNROLL"] = auto_hot_gate_up_unroll(values)
    _auto_or_refuse(values, "GB_RANGE_FLUSH", auto_range_flush(dims, values), range_flush_allowed(dims, values), (
        f"runs the split-chain gate_up's ranges in one loop of whole rounds: it needs GB_MMA 1, GB_KSPLIT > 1, "
        f"PER_PAIR 0 and each range a whole number of rounds of GB_UNROLL k blocks (and of 128-wide scale blocks with "
        f"FP8_BLOCK_SUM), got GB_KSPLIT {values['GB_KSPLIT']}, PER_PAIR {values['PER_PAIR']}, H = {dims.hidden}, "
        f"GB_UNROLL {values['GB_UNROLL']}, W_FP8 {values['W_FP8']}, FP8_LOAD16 {values['FP8_LOAD16']}, "
        f"FP8_BLOCK_SUM {values['FP8_BLOCK_SUM']}"))
    _auto_or_refuse(values, "DB_WHOLE_RANGES", auto_whole_ranges(dims, values), whole_ranges(dims, values), (
        f"compiles the grouped down's whole rounds only, with no masked round: it needs bf16 weights, DB_GROUPED 1 "
        f"and I / 8 a multiple of 4 x DB_UNROLL (and of 4 x DB_HOT_UNROLL), got W_FP8 {values['W_FP8']}, DB_GROUPED "
        f"{values['DB_GROUPED']}, I = {dims.intermediate}, DB_UNROLL {values['DB_UNROLL']}, DB_HOT_UNROLL "
        f"{values['DB_HOT_UNROLL']}"))
    if "GB" in auto_caps and (gate_up_takes_pass_regs(values) or fp8_gate_up_takes_pass_regs(dims, values)):
        values["GB_MAX_REGS"] = PASS_REGS
    if "DB" in auto_caps and down_takes_pass_regs(values):
        values["DB_MAX_REGS"] = PASS_REGS
    if values["DB_ROW_TILES"] == 0:
        values["DB_ROW_TILES"] = auto_row_tiles(dims, values)
    if mma_down_unroll_auto:
        values["DB_UNROLL"] = auto_fp8_down_unroll(dims, values)
    if values["DB_ROW_TILES"] > 1 and not values["DB_GROUPED"]:
        raise ValueError(f"DB_ROW_TILES {values['DB_ROW_TILES']} gives the grouped down's warps more rows: it needs "
                         f"DB_GROUPED 1 (see auto_grouped), got 0")
    for stage in ("GB", "DB"):
        if values[f"{stage}_SHARE"] == -1:
            values[f"{stage}_SHARE"] = auto_share(dims, values, stage)
    _check_share(values)
    shared = down_shared_bytes(dims, values)
    if shared > OPT_IN_SHARED_LIMIT:
        raise ValueError(
            f"the down kernel keeps DB_WARPS * T * columns fp32 partials in shared memory: {shared} bytes > "
            f"{OPT_IN_SHARED_LIMIT} at T = {dims.tokens}; lower DB_WARPS / DB_OUTS (or use another path for this T)"
        )
    return values


def resolve_params(dims: Dims | None = None, **params: Any) -> dict[str, int]:
    """Every knob as an int, auto ones filled from ``dims`` (:meth:`FAMILY.resolve <KernelFamily.resolve>`)."""
    return FAMILY.resolve(dims, **params)


def max_tokens(top_k: int = 1, **params: Any) -> int:
    """The largest T the down kernel's shared memory allows with these knobs."""
    values = resolve_params(None, **params)
    return OPT_IN_SHARED_LIMIT // (values["DB_WARPS"] * down_columns(values) * 4)


# The knob sets of the other two batched paths (kernels.dispatch launches them with these). DB_EARLY_W2 1: the
# first w2 loads before the PDL wait (results/sweep-batched-early-w2-*.json); DB_BALANCE -1: the balanced down runs
# where auto_balance says (results/sweep-stage-*.json).
MMA_KNOBS = {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "DB_BALANCE": -1, "PAIR_TILES": 1,  # both on tensor cores
             "DB_GROUPED": -1, "DB_NBLK": 0, "FP8_LOAD16": -1, "FP8_BLOCK_SUM": -1, "FP8_PRMT": -1,
             "DB_WHOLE_RANGES": -1, "GB_RANGE_FLUSH": -1, "HOT_NBLK": -1, "DB_ROW_TILES": 0, "GB_SHARE": -1,
             "DB_SHARE": -1, "DB_HOT_UNROLL": -1, "GB_HOT_UNROLL": -1}
MIXED_KNOBS = {"DB_MMA": 1, "DB_EARLY_W2": 1, "DB_BALANCE": -1}  # FMA gate_up (bitwise strict's), tensor-core down
# The batch-invariant pair (kernels.dispatch policy "batch_invariant"): the tensor-core path with the grouped down
# at every T, and its per-pair form (no lists, two launches) -- one numerics: a pair's gate_up dots are mma chains
# over INVARIANT_KSPLIT fixed k ranges (k_range: a function of H alone), added in range order (one column of an mma
# never sees another), each pair's down row is weighted and the slots are summed in slot order from 0. Knobs that
# only move work (NBLK, WARPS, UNROLL) keep the numerics; GB_KSPLIT is numerics, so both forms take the same.
# GB_KSPLIT 8 (H200, results/sweep-2026-12-01-invariant-*-ksplit-*.json): the per-pair form a warp per range, 8x the
# warps -- qwen3-30b T = 1 23.9 us vs 28.6 at one range, T = 2 41.1 vs 48.4; qwen3-235b T = 1 76.6 vs 100.7 (87.7 at
# UNROLL 8) -- and the grouped path its ranges in turn, 4 % faster at qwen3-30b T = 8, the same from T = 16.
INVARIANT_KSPLIT = 8
GROUPED_KNOBS = {**MMA_KNOBS, "DB_GROUPED": 1, "GB_KSPLIT": INVARIANT_KSPLIT}
# (GB_WARPS 8 = a block per 8 neurons, one warp per range; GB_UNROLL auto (auto_mma_gate_up_unroll: 4 or 2; UNROLL 8
# was 26.6 us at qwen3-30b T = 1, 25 % occupancy); DB_UNROLL 8: a per-pair down warp streams whole rows alone -- H200,
# results/sweep-2026-12-01-mma-pairs-*.json: qwen3-235b T = 1 86.7 us vs 116.5 at 4 / 4)
PER_PAIR_KNOBS = {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "PER_PAIR": 1, "GB_KSPLIT": INVARIANT_KSPLIT,
                  "GB_WARPS": INVARIANT_KSPLIT, "GB_UNROLL": 0, "DB_UNROLL": 8, "FP8_LOAD16": -1, "FP8_BLOCK_SUM": -1,
                  "FP8_PRMT": -1, "PAIRS_INNER": -1}
# The FP8 paths (fp8-block128 weights, W_FP8): FMA kernels with 8-value chunks (GB_BYTES 16: the gate_up's
# intermediate is then bitwise the strict FP8 kernel's; the down capped at 160 registers, which its scales and
# widening need to stay spill-free at the qwen3 shapes from T = 1 to 64 -- 128 spills at qwen3-235b T = 16,
# launch bounds alone at qwen3-30b T = 1), and the tensor-core path with the bf16 path's knobs, its FP8 loads and
# scaling auto (auto_fp8_mma, swept on the H200).
FP8_KNOBS = {"W_FP8": 1, "GB_BYTES": 16, "DB_MAX_REGS": 160}
# The batch-invariant pair on FP8 weights: the same numerics knobs in both forms (GB_KSPLIT; FP8_LOAD16 and
# FP8_BLOCK_SUM auto, from the dims alone); the per-pair form's rounds from its H200 sweep
# (results/sweep-2026-12-02-mma-pairs-fp8-*.json: GB_UNROLL 2, DB_UNROLL 4 -- qwen3-30b T = 1 / 2 / 4 20.6 / 30.2 /
# 56.1 us against 24.3 / 37.5 / 69.7 at the bf16 form's 4 / 8); PAIRS_INNER 0: on FP8 weights 1 changed T = 1 / 2
# by -1.8 to +2.3 % (both models, both routings) and saved 1.8-2.4 % at qwen3-30b T = 4 (235b T = 4 not measured;
# results/sweep-2026-12-02-pairs-inner-fp8-*) -- not yet a case for a rule
# GB_KSPLIT 4, not the bf16 pair's 8 (H200, results/sweep-2026-12-02-fp8-pairs-ksplit-*.json,
# sweep-2026-12-02-fp8-grouped-ksplit-unroll-*.json): per-pair 5-7 % faster at qwen3-30b T = 1 / 2 / 4 (15.0 vs 15.8 us
# at T = 1) and 2-3 % at qwen3-235b, the grouped path 2.5-4 % faster at qwen3-235b T = 8..64 (5-6 % under Zipf), the
# same at qwen3-30b: a range of H / 4 keeps a warp's k blocks in flight for twice the loop (FP8 rows are half the bytes)
# The per-pair form's blocks hold one group of 8 neurons, a warp per range (GB_WARPS = GB_KSPLIT), as the bf16 pair's:
# against two groups a block (GB_WARPS 8, which those sweeps ran), 1.0-1.3 % faster at T = 1 / 2 at qwen3-235b and
# 1.2-3.2 % at qwen3-30b, 2-7 % at T = 4 (H200, results/sweep-2026-12-04-fp8-pairs-gate-up-warps-*.json); same bits
FP8_INVARIANT_KSPLIT = 4
FP8_GROUPED_KNOBS = {**GROUPED_KNOBS, "W_FP8": 1, "GB_KSPLIT": FP8_INVARIANT_KSPLIT}
FP8_PER_PAIR_KNOBS = {**PER_PAIR_KNOBS, "W_FP8": 1, "GB_KSPLIT": FP8_INVARIANT_KSPLIT, "GB_WARPS": FP8_INVARIANT_KSPLIT,
                      "GB_UNROLL": 2, "DB_UNROLL": 4, "PAIRS_INNER": 0}
MMA_FP8_KNOBS = {**MMA_KNOBS, "W_FP8": 1}
# the same three on fp8-block128-t16 tiles (kernels.formats): the same sums, each k block's A rows 1 KB contiguous
MMA_FP8_T16_KNOBS = {**MMA_FP8_KNOBS, "W_TILED": 1}
FP8_T16_PER_PAIR_KNOBS = {**FP8_PER_PAIR_KNOBS, "W_TILED": 1}
FP8_T16_GROUPED_KNOBS = {**FP8_GROUPED_KNOBS, "W_TILED": 1}
# ... and the bf16 three on bf16-t16 tiles: the same sums as on rows
MMA_T16_KNOBS = {**MMA_KNOBS, "W_TILED": 1}
PER_PAIR_T16_KNOBS = {**PER_PAIR_KNOBS, "W_TILED": 1}
GROUPED_T16_KNOBS = {**GROUPED_KNOBS, "W_TILED": 1}


# ---------------------------------------------------------------------------------------------------
# Workspace, kernels, stages (no allocation, no host sync)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    """The buffers batched warp decode needs, allocated once per dims (and knob set: the grouped down's rows)."""

    dims: Dims
    intermediate: Any  # [T, K, I] bf16 (the same buffer as strict warp decode's)
    lists: Any  # [lists_size(dims)] int32: routing lists written by moe_expert_lists
    pair_out: Any = None  # [T*K, H] float32: each pair's weighted down row (DB_GROUPED only)

    def matches(self, dims: Dims) -> bool:
        return self.dims == dims


def make_workspace(dims: Dims, **params: Any) -> Workspace:
    """Allocate the intermediate and the routing-list buffer for ``dims`` (CuPy, current device), and the per-pair
    rows of the grouped down when the knobs ``params`` (as for :func:`warp_decode_batched`) run it."""
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
    for name in ("tokens", "hidden", "intermediate", "experts", "top_k"):
        value = getattr(dims, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"dims.{name} must be an int >= 1, got {value!r}")
    grouped = resolve_params(dims, **params)["DB_GROUPED"]
    import cupy

    return Workspace(
        dims=dims,
        intermediate=cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16),
        lists=cupy.zeros(lists_size(dims), dtype=cupy.int32),
        pair_out=cupy.empty((dims.tokens * dims.top_k, dims.hidden), dtype=np.float32) if grouped else None,
    )


def _family_workspace(dims: Dims, params: dict[str, int]) -> Workspace:
    return make_workspace(dims, **params)


def kernel_names(params: dict[str, int]) -> tuple[str, ...]:
    """The (lists, gate_up, down[, sum]) kernels these knobs compile: the FMA kernels or, with GB_MMA / DB_MMA, the
    tensor-core ones; with DB_GROUPED the grouped down and the slot sum."""
    if params.get("PER_PAIR"):
        return (GATE_UP_PAIR, DOWN_TOKEN)
    gate_up = GATE_UP_MMA if params.get("GB_MMA") else GATE_UP
    if params.get("DB_GROUPED"):
        return (EXPERT_LISTS, gate_up, DOWN_GROUPED, SUM_SLOTS)
    return (EXPERT_LISTS, gate_up, DOWN_MMA if params.get("DB_MMA") else DOWN)


def gate_up_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block row (ceil(I / neurons per block) blocks) per list slot, or with PAIR_TILES per possible tile."""
    neurons_per_warp = 8 if params["GB_MMA"] else params["GB_OUTS"]
    if params.get("PER_PAIR"):  # GB_WARPS / GB_KSPLIT groups of 8 neurons per block
        groups = params["GB_WARPS"] // params.get("GB_KSPLIT", 1)
        return dims.tokens * dims.top_k * -(-dims.intermediate // (groups * 8))
    rows = tile_capacity(dims, tile_pairs(params)) if params["PAIR_TILES"] else slots(dims)
    return rows * -(-dims.intermediate // (params["GB_WARPS"] * neurons_per_warp))


def down_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block per down_columns hidden columns; grouped: a block row (DB_WARPS x 16 x DB_ROW_TILES rows each) per
    possible tile; PER_PAIR: one block per (token, 16 hidden rows)."""
    if params.get("PER_PAIR"):
        return dims.tokens * -(-dims.hidden // 16)
    if params.get("DB_GROUPED"):
        rows = params["DB_WARPS"] * 16 * params.get("DB_ROW_TILES", 1)
        return tile_capacity(dims, tile_pairs(params)) * -(-dims.hidden // rows)
    return -(-dims.hidden // down_columns(params))


def sum_blocks(dims: Dims) -> int:
    """moe_sum_slots' blocks: one thread per 4 columns of a token."""
    return -(-dims.tokens * (dims.hidden // 4) // SUM_THREADS)


NO_SCALES = np.uint64(0)  # the scale pointer of bf16 weights (never read)


def weight_args(w: Any, fp8: bool) -> tuple[Any, Any]:
    """A weight matrix as the kernels take it: (values, scales) of fp8-block128 weights (W_FP8), (bf16 values, null)
    otherwise (a plain array, or bf16-t16's tiles)."""
    if fp8:
        return w.values, w.scales
    return (w.values if isinstance(w, Quantized) else w), NO_SCALES


def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
           out: Any) -> list[Stage]:
    """The layer as three launches (expert_lists, gate_up, down) of ``compiled``'s kernels into its workspace, four
    with DB_GROUPED (+ sum)."""
    params, d, ws = compiled.params, compiled.dims, compiled.workspace
    w13, s13 = weight_args(w13, bool(params["W_FP8"]))
    w2, s2 = weight_args(w2, bool(params["W_FP8"]))
    if params["PER_PAIR"]:
        return _per_pair_stages(compiled, x, w13, s13, w2, s2, topk_ids, topk_weights, out)
    lists_k, gate_up_k, down_k, *sum_k = (compiled.kernels[name] for name in kernel_names(params))
    i32 = np.int32
    n_slots = slots(d)
    out_f32 = i32(1 if out.dtype == np.float32 else 0)

    programmatic = bool(params["PDL"])
    lists_shared = lists_shared_bytes(d, params)
    down_shared = down_shared_bytes(d, params)
    for kernel, shared in ((lists_k, lists_shared), (down_k, down_shared)):  # sized by dims: opt in here, once
        if shared > SHARED_LIMIT and kernel.max_dynamic_shared_size_bytes < shared:  # above 48 KB
            kernel.max_dynamic_shared_size_bytes = shared

    def expert_lists() -> None:
        launch_ex(lists_k, (1,), (params["LIST_THREADS"],),
                  (topk_ids, i32(d.tokens * d.top_k), i32(d.experts), i32(n_slots), ws.lists),
                  shared_mem=lists_shared, programmatic=programmatic)

    def gate_up() -> None:
        launch_ex(gate_up_k, (gate_up_blocks(d, params),), (params["GB_WARPS"] * 32,),
                  (x, w13, s13, ws.lists, ws.intermediate, i32(d.hidden), i32(d.intermediate), i32(d.experts),
                   i32(d.top_k), i32(n_slots), i32(d.tokens * d.top_k)), programmatic=programmatic)

    def down() -> None:
        launch_ex(down_k, (down_blocks(d, params),), (params["DB_WARPS"] * 32,),
                  (ws.intermediate, w2, s2, topk_ids, topk_weights, ws.lists, out, out_f32, i32(d.tokens),
                   i32(d.hidden), i32(d.intermediate), i32(d.experts), i32(d.top_k), i32(n_slots)),
                  shared_mem=down_shared, programmatic=programmatic)

    def down_grouped() -> None:
        launch_ex(down_k, (down_blocks(d, params),), (params["DB_WARPS"] * 32,),
                  (ws.intermediate, w2, s2, topk_weights, ws.lists, ws.pair_out, i32(d.hidden), i32(d.intermediate),
                   i32(d.experts), i32(d.top_k), i32(n_slots), i32(d.tokens * d.top_k)), programmatic=programmatic)

    def sum_slots() -> None:
        launch_ex(sum_k[0], (sum_blocks(d),), (SUM_THREADS,),
                  (ws.pair_out, topk_ids, out, out_f32, i32(d.tokens), i32(d.hidden), i32(d.experts), i32(d.top_k)),
                  programmatic=programmatic)

    if sum_k:
        return [("expert_lists", expert_lists), ("gate_up", gate_up), ("down", down_grouped), ("sum", sum_slots)]
    return [("expert_lists", expert_lists), ("gate_up", gate_up), ("down", down)]


def _per_pair_stages(compiled: Compiled, x: Any, w13: Any, s13: Any, w2: Any, s2: Any, topk_ids: Any,
                     topk_weights: Any, out: Any) -> list[Stage]:
    """PER_PAIR: gate_up one pair per block row, the down one block per (token, 16 rows) with a warp per slot."""
    params, d, ws = compiled.params, compiled.dims, compiled.workspace
    gate_up_k, down_k = (compiled.kernels[name] for name in PER_PAIR_KERNELS)
    i32 = np.int32
    programmatic = bool(params["PDL"])

    def gate_up() -> None:
        launch_ex(gate_up_k, (gate_up_blocks(d, params),), (params["GB_WARPS"] * 32,),
                  (x, w13, s13, topk_ids, ws.intermediate, i32(d.hidden), i32(d.intermediate), i32(d.experts),
                   i32(d.top_k), i32(d.tokens * d.top_k)), programmatic=programmatic)

    def down() -> None:
        launch_ex(down_k, (down_blocks(d, params),), (32 * d.top_k,),
                  (ws.intermediate, w2, s2, topk_ids, topk_weights, out, i32(1 if out.dtype == np.float32 else 0),
                   i32(d.tokens), i32(d.hidden), i32(d.intermediate), i32(d.experts), i32(d.top_k)),
                  programmatic=programmatic)

    return [("gate_up", gate_up), ("down", down)]


FAMILY = KernelFamily(
    name="warp-decode-batched",
    source=CudaSource(
        name="warp_decode_batched",
        code=CODE,
        kernels=KERNELS + MMA_KERNELS + GROUPED_KERNELS + PER_PAIR_KERNELS,
        defaults=dict(DEFAULTS),
        warps_knobs={GATE_UP: "GB_WARPS", DOWN: "DB_WARPS", GATE_UP_MMA: "GB_WARPS", DOWN_MMA: "DB_WARPS",
                     DOWN_GROUPED: "DB_WARPS", GATE_UP_PAIR: "GB_WARPS"},
        description="batched warp decode: expert lists, gate_up and down reading each expert once per batch",
    ),
    limits=LIMITS,
    auto_knobs=AUTO_KNOBS,
    rules=rules,
    device_needs={"PDL": 90},  # griddepcontrol: sm_90+
    kernel_names=kernel_names,
    workspace=_family_workspace,
    stages=stages,
)
SOURCE = FAMILY.source
# what the offline report compiles besides the defaults: every preset's resolved knobs, and the tensor-core and
# mixed paths as they run (auto knobs resolved; the FP8 tensor-core sets also at qwen3-30b-a3b T = 64, as auto runs
# them and with two 8-pair blocks set by hand: the ones nearest the register cap)
_QWEN30_T64 = Dims(64, PRESETS["qwen3-30b-a3b"].hidden, PRESETS["qwen3-30b-a3b"].intermediate,
                   PRESETS["qwen3-30b-a3b"].experts, PRESETS["qwen3-30b-a3b"].top_k)
SOURCE.variants = [*preset_variants(resolve_params, DEFAULTS), resolve_params(None, **MMA_KNOBS),
                   resolve_params(None, **MIXED_KNOBS),
                   resolve_params(None, **MMA_KNOBS, DB_WARPS=MMA_WIDE_DOWN_WARPS, DB_MAX_REGS=0),
                   resolve_params(None, **FP8_KNOBS),
                   resolve_params(None, **MMA_KNOBS, W_FP8=1),
                   resolve_params(None, **FP8_GROUPED_KNOBS),
                   resolve_params(None, **PER_PAIR_KNOBS), resolve_params(None, **FP8_PER_PAIR_KNOBS),
                   resolve_params(_QWEN30_T64, **MMA_FP8_KNOBS), resolve_params(_QWEN30_T64, **FP8_GROUPED_KNOBS),
                   resolve_params(_QWEN30_T64, **MMA_FP8_KNOBS, GB_NBLK=2),
                   resolve_params(_QWEN30_T64, **FP8_GROUPED_KNOBS, GB_NBLK=2),
                   resolve_params(None, **FP8_T16_PER_PAIR_KNOBS), resolve_params(_QWEN30_T64, **MMA_FP8_T16_KNOBS),
                   resolve_params(_QWEN30_T64, **FP8_T16_GROUPED_KNOBS), resolve_params(None, **PER_PAIR_T16_KNOBS),
                   resolve_params(_QWEN30_T64, **MMA_T16_KNOBS), resolve_params(_QWEN30_T64, **GROUPED_T16_KNOBS)]


# ---------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------
def warp_decode_batched(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    out: Any = None,
    workspace: Workspace | None = None,
    **params: Any,
) -> Any:
    """One MoE decode layer by batched warp decode on CuPy arrays; returns ``out`` [T, H] (bf16 unless fp32 given).

    With ``out`` and ``workspace`` (``make_workspace(dims)``) given nothing is allocated and nothing syncs
    with the host (value checks of ``topk_ids`` are skipped during CUDA-graph capture; the kernels guard
    every id: a bad id makes that token's output NaN). ``params``: compile-time knobs (:data:`DEFAULTS`).
    fp8-block128 weights (``kernels.quantize_weights(w13, w2, "fp8-block128")``) run the W_FP8 kernels;
    fp8-block128-t16 and bf16-t16 weights (values in 16-row tiles) the tensor-core ones with W_TILED.
    """
    fmt = get_format(format_of(w13))  # the weights' format sets W_FP8 (scaled) and W_TILED (tiled)
    fp8, tiled = fmt.scaled, fmt.tiled
    cupy = require_cupy(x=x, topk_ids=topk_ids, topk_weights=topk_weights,
                        **({"w13.values": w13.values} if isinstance(w13, Quantized) else {"w13": w13}),
                        **({"w2.values": w2.values} if isinstance(w2, Quantized) else {"w2": w2}))
    params = {"W_FP8": int(fp8), "W_TILED": int(tiled), **params}
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, weight_format=fmt)
    if out is not None:
        require_cupy(out=out)
        check_out(out, dims, cupy)
    if workspace is not None:
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must come from warp_decode_batched.make_workspace(), "
                            f"got {type(workspace).__name__}")
        if not workspace.matches(dims):
            raise ValueError(f"workspace was made for {workspace.dims}, this call needs {dims}")
    resolved = resolve_params(dims, **params)  # knob errors first (no device call), then the alignment, the compile
    if resolved["W_FP8"] != int(fp8) or resolved["W_TILED"] != int(tiled):
        knobs = (bool(resolved["W_FP8"]), bool(resolved["W_TILED"]))
        reads = next((f.name for f in FORMATS.values() if (f.scaled, f.tiled) == knobs), "no")
        raise ValueError(f"W_FP8 {resolved['W_FP8']} / W_TILED {resolved['W_TILED']} read {reads} weights, but "
                         f"w13 / w2 are {fmt.name}")
    if workspace is not None and resolved["DB_GROUPED"] and workspace.pair_out is None:
        raise ValueError("workspace has no per-pair rows, which the grouped down (DB_GROUPED 1) writes: make it with "
                         "make_workspace(dims, **params) for these knobs")
    check_aligned(x=x, w13=weight_args(w13, fp8)[0], w2=weight_args(w2, fp8)[0])
    compiled = FAMILY.compile(dims, workspace=workspace, **params)
    if out is None:
        out = cupy.empty((dims.tokens, dims.hidden), dtype=BF16)
    compiled.run(x, w13, w2, topk_ids, topk_weights, out)
    return out


# ---------------------------------------------------------------------------------------------------
# Variant registry
# ---------------------------------------------------------------------------------------------------
def _register_path(name: str, knobs: dict[str, int], description: str, grid: dict[str, list[int]],
                   weight_format: str = "bf16") -> Variant:
    """One batched-module path as a variant reading ``weight_format``: the defaults with the auto knobs left to the
    rules, + knobs."""
    return register(FAMILY.variant(name, knobs=knobs, reference_mode="warp_decode", weight_format=weight_format,
                                   description=description, grid=grid))


VARIANT = _register_path(
    "cupy:warp-decode-batched", {},
    "batched warp decode: per-expert warps read each expert's weights once per batch",
    {"GB_WARPS": [4, 8], "GB_OUTS": [1, 2, 4], "GB_UNROLL": [1, 2, 4], "GB_BYTES": [8, 16], "DB_WARPS": [4, 8],
     "DB_OUTS": [2, 4, 8], "DB_UNROLL": [1, 2, 3], "DB_EARLY_INTER": [0, 1]},
)
MMA_VARIANT = _register_path(
    "cupy:warp-decode-mma", MMA_KNOBS,
    "batched warp decode on tensor cores: mma.sync m16n8k16, bf16 in, FP32 accumulators",
    {"GB_WARPS": [2, 4, 8], "GB_UNROLL": [4, 8], "GB_NBLK": [1, 2], "DB_WARPS": [4, 8], "DB_UNROLL": [4, 8],
     "DB_NBLK": [1, 2]},
)
MIXED_VARIANT = _register_path(
    "cupy:warp-decode-mixed", MIXED_KNOBS,
    "batched warp decode: FMA gate_up, tensor-core down (16 hidden columns per block, 16-24 warps)",
    {"GB_WARPS": [4, 8], "GB_UNROLL": [2, 4], "DB_WARPS": [8, 16], "DB_UNROLL": [2, 4]},
)


FP8_VARIANT = _register_path(
    "cupy:warp-decode-batched-fp8", FP8_KNOBS,
    "batched warp decode on fp8-block128 weights: e4m3fn chunks widened and scaled in registers",
    {"GB_WARPS": [4, 8], "GB_OUTS": [1, 2, 4], "GB_UNROLL": [1, 2, 4], "DB_WARPS": [4, 8], "DB_OUTS": [2, 4, 8],
     "DB_UNROLL": [1, 2, 3]}, FP8_BLOCK128.name)
MMA_FP8_VARIANT = _register_path(
    "cupy:warp-decode-mma-fp8", MMA_FP8_KNOBS,
    "batched warp decode on tensor cores, fp8-block128 weights: 16-value e4m3fn loads -> bf16 fragments, each 128-wide "
    "scale block's FP32 partial scaled once",
    {"GB_WARPS": [2, 4, 8], "GB_UNROLL": [4, 8], "GB_NBLK": [1, 2], "DB_WARPS": [4, 8], "DB_UNROLL": [4, 8],
     "DB_NBLK": [1, 2]}, FP8_BLOCK128.name)
GROUPED_VARIANT = _register_path(
    "cupy:warp-decode-mma-grouped", GROUPED_KNOBS,
    "the tensor-core path with the grouped down and the slot-order sum at every T: batch-invariant numerics",
    {"GB_WARPS": [2, 4, 8], "GB_UNROLL": [4, 8], "GB_NBLK": [1, 2], "DB_WARPS": [4, 8], "DB_NBLK": [1, 2]},
)
PER_PAIR_VARIANT = _register_path(
    "cupy:warp-decode-mma-pairs", PER_PAIR_KNOBS,
    "the grouped tensor-core path's numerics without lists: a pair per gate_up block row, a token per down block",
    {"GB_WARPS": [2, 4, 8], "GB_UNROLL": [4, 8], "DB_UNROLL": [2, 4, 8]},
)
GROUPED_FP8_VARIANT = _register_path(
    "cupy:warp-decode-mma-grouped-fp8", FP8_GROUPED_KNOBS,
    "the batch-invariant grouped tensor-core path on fp8-block128 weights",
    {"GB_WARPS": [2, 4, 8], "GB_NBLK": [1, 2], "DB_NBLK": [1, 2]}, FP8_BLOCK128.name)
PER_PAIR_FP8_VARIANT = _register_path(
    "cupy:warp-decode-mma-pairs-fp8", FP8_PER_PAIR_KNOBS,
    "the batch-invariant per-pair tensor-core path on fp8-block128 weights",
    {"GB_WARPS": [2, 4, 8], "GB_UNROLL": [4, 8], "DB_UNROLL": [2, 4, 8]}, FP8_BLOCK128.name)
def _register_tiled(suffix: str, weight_format: str, what: str, knob_sets: tuple[dict[str, int], ...],
                    rounds: list[int]) -> tuple[Variant, Variant, Variant]:
    """The tensor-core three (path, per-pair form, grouped form) on one tiled format's weights (W_TILED)."""
    mma, pairs, grouped = knob_sets
    unroll = {"GB_UNROLL": rounds, "DB_UNROLL": rounds}
    return (_register_path(f"cupy:warp-decode-mma{suffix}", mma, f"the tensor-core {what}path on {weight_format} "
                           "weights: each warp's k block of 16 rows 1 KB contiguous", unroll, weight_format),
            _register_path(f"cupy:warp-decode-mma-pairs{suffix}", pairs, f"the batch-invariant per-pair tensor-core "
                           f"{what}path on {weight_format} weights", unroll, weight_format),
            _register_path(f"cupy:warp-decode-mma-grouped{suffix}", grouped, f"the batch-invariant grouped tensor-core "
                           f"{what}path on {weight_format} weights", {"GB_NBLK": [1, 2], "DB_NBLK": [1, 2]},
                           weight_format))


MMA_FP8_T16_VARIANT, PER_PAIR_FP8_T16_VARIANT, GROUPED_FP8_T16_VARIANT = _register_tiled(
    "-fp8-t16", FP8_BLOCK128_T16.name, "FP8 ", (MMA_FP8_T16_KNOBS, FP8_T16_PER_PAIR_KNOBS, FP8_T16_GROUPED_KNOBS),
    [2, 4])
MMA_T16_VARIANT, PER_PAIR_T16_VARIANT, GROUPED_T16_VARIANT = _register_tiled(
    "-t16", BF16_T16.name, "", (MMA_T16_KNOBS, PER_PAIR_T16_KNOBS, GROUPED_T16_KNOBS), [4, 8])
