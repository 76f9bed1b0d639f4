"""The tensor-core pair: batched warp decode with the dots on ``mma.sync``, the expert's pairs in tiles.

The ownership is the FMA pair's -- a warp owns output rows of ONE expert for all its pairs -- with the dots on
``mma.sync.m16n8k16`` (bf16 products, FP32 accumulators), which is what the FMA kernels run out of at T >= 16:

1. ``moe_expert_lists`` (:mod:`kernels.batched.lists`) with the tile table: every expert's pairs cut into tiles of
   ``8 * max(1, HOT_NBLK)`` (one gate_up pass), so a hot expert spreads over as many block rows as it has tiles;
2. ``moe_gate_up_mma``: block row per tile, a warp per 8 neurons (gate and up rows as the 16 rows of an A tile), the
   tile's pairs as the B columns; SiLU(g) * u and the one bf16 rounding in the lane;
3. the down, either ``moe_down_mma`` -- a block per 16 hidden columns, its warps cutting the (tile, k block) items
   into equal runs, warp partials summed in warp order -- or, with ``DB_GROUPED``, ``moe_down_grouped`` (a grouped
   GEMM over the tiles writing each pair's weighted FP32 row) and ``moe_sum_slots`` (a token's K rows summed in slot
   order from 0, rounded once: with ``GB_KSPLIT`` fixed ranges, a numerics no batch changes -- the batch-invariant
   policy's path from T = 4 on).

Not bitwise the FMA kernels (the sum order inside an mma differs). One family per weight format with a tensor-core
loader (:mod:`kernels.batched.loaders`); knobs :data:`KNOBS` (-1 / 0 = chosen by :func:`make_rules`' rules, each
citing the H200 sweeps behind it). CUDA C: :mod:`kernels.batched.mma_cuda`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.activation import CONTRACT_LAYER, ExpertLayer
from kernels.batched import lists
from kernels.batched.common import (
    FormatFamilies,
    allocate,
    bias_args,
    block_registers,
    check_register_caps,
    experts_average,
    family_suffix,
    global_arg,
    list_stages,
    sample_variants,
    weight_args,
)
from kernels.batched.loaders import loader_for, loader_macros, mma_halves
from kernels.batched.mma_core import CODE as CORE
from kernels.batched.mma_cuda import CODE, DOWN, DOWN_GROUPED, FAMILY_DEFINES, GATE_UP, SUM_SLOTS
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.device_helpers import BATCHED_HELPERS, BLOCK_OUTPUTS, FP8_HELPERS, PDL_HELPERS, WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.formats import BF16_FORMAT, BF16_T16, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4, NVFP4, WeightFormat

SUM_THREADS = 256  # threads of a moe_sum_slots block (its __launch_bounds__), 4 columns each
KNOBS: dict[str, int] = {
    "GB_WARPS": 4,  # warps per gate_up block, 8 neurons each
    "GB_UNROLL": 0,  # k blocks of loads in flight per lane; 0 = MMA_UNROLL
    "GB_KSPLIT": 1,  # the gate_up's k chains in this many fixed ranges, added in order (the invariant pair's numerics)
    "GB_SHARE": -1,  # a hot expert's tiles in groups of 2 / 4 sharing each round's widening; -1 = auto_share
    "DB_SHARE": -1,  # the grouped down likewise; -1 = auto_share
    "GB_HOT_UNROLL": -1,  # k blocks in flight in a hot pass; 0 = the halved rounds, -1 = auto (hot_unroll)
    "GB_MAX_REGS": -1,  # __maxnreg__ cap (0: launch bounds alone); -1 = auto (PASS_REGS where measured, else 128)
    "DB_WARPS": 0,  # warps per down block; 0 = auto_down_warps
    "DB_UNROLL": 0,  # k blocks in flight per lane; 0 = auto (MMA_UNROLL, half at 64-wide blocks; auto_fp8_down_unroll)
    "DB_GROUPED": -1,  # 1: the grouped down + the slot sum; 0: the balanced runs; -1 = auto_grouped
    "DB_ROW_TILES": 0,  # the grouped down's 16-row tiles per warp (1 or 2, sharing B); 0 = auto_row_tiles
    "DB_HOT_UNROLL": -1,  # as GB_HOT_UNROLL, for the grouped down's hot passes
    "DB_MAX_REGS": -1,  # as GB_MAX_REGS; 0 with the 24-warp down
    "HOT_NBLK": -1,  # a tile of more than 8 pairs (a hot expert's) in one pass of HOT_NBLK 8-pair blocks; -1 = auto
    "PDL": 1,  # programmatic dependent launch (sm_90+: device_needs turns it off before)
}
DERIVED = {  # set by the rules from the format and the dims, not knobs
    "LIST_THREADS": 256, "LIST_PER": 1,  # the list kernel's threads, experts per thread (lists.list_rules)
    "GB_RANGE_FLUSH": 0,  # the split chains in one loop of whole rounds, where each range is whole rounds
    "DB_WHOLE_RANGES": 0,  # the bf16 grouped down without a masked round, where its range is whole rounds
    "FP8_LOAD16": 0,  # fp8 loaders: 16 values per load (H and I multiples of 16)
    "FP8_PRMT": 0,  # fp8 loaders: the byte-permute widening with its multiply on B (2)
    "FP4_HALVES": 0,  # 4-bit loaders: chunks of 8 values per A load (4, 2 or 1: loaders.loader_macros)
}
AUTO_KNOBS = ("GB_UNROLL", "DB_WARPS", "DB_UNROLL", "DB_ROW_TILES")
LIMITS = {
    "GB_WARPS": (1, 32), "GB_UNROLL": (0, 64), "GB_KSPLIT": (1, 8), "GB_SHARE": (-1, 4), "DB_SHARE": (-1, 4),
    "GB_HOT_UNROLL": (-1, 8),
    "GB_MAX_REGS": (-1, 255), "DB_WARPS": (0, 32), "DB_UNROLL": (0, 64), "DB_GROUPED": (-1, 1),
    "DB_ROW_TILES": (0, 2), "DB_HOT_UNROLL": (-1, 8), "DB_MAX_REGS": (-1, 255), "HOT_NBLK": (-1, 4), "PDL": (0, 1),
}
MMA_UNROLL = 4  # auto GB_UNROLL / DB_UNROLL: k blocks of loads in flight (DB: 2 at 64-wide)
MMA_DOWN_WARPS = 16  # auto DB_WARPS (H200, results/sweep-batched-pdl-*.json: 7-10 % over 8 at qwen3-30b)
# ... and from T = MMA_WIDE_DOWN_FROM on: 24 warps under launch bounds alone (768 threads -> <= 85 registers each;
# results/sweep-mma-dbwarps-*.json, sweep-split-mma24-30b.json; slower at qwen3-235b T=16, so not below 32)
MMA_WIDE_DOWN_WARPS = 24
MMA_WIDE_DOWN_FROM = 32
GROUPED_DOWN_WARPS = 4  # auto DB_WARPS of the grouped down: 4 warps x 16 rows of one tile per block, as gate_up's
FP8_WIDE_GROUPED_DOWN_WARPS = 2  # ... on FP8 weights at I >= ROW_TILES_FROM_INTER (auto_down_warps)
# 96 registers keep 5 blocks of 4 warps per SM (4 at the 106-120 they take uncapped): the bf16 gate_up's split chains
# and its hot two-block passes, the grouped down's hot passes (results/sweep-2026-12-02-whole-rounds-grouped-regs-
# *.json, sweep-2026-12-03-mma-bf16-gate-up-regs-*.json, sweep-2026-12-03-hot-regs-*.json: 0.8-2 % faster)
PASS_REGS = 96
HOT_EXPERT_BYTES = 16 << 20  # auto_hot_nblk: bf16 hot tiles where an expert's gate_up rows reach this
GROUPED_FROM_PAIRS_PER_EXPERT = 2  # auto DB_GROUPED from T*K / E >= 2 (qwen3: T >= 32)
FP8_WIDE_GROUPED_FROM_PAIRS_PER_EXPERT = 0.25  # on FP8 weights at I >= 1536: from T*K / E >= 1/4 (qwen3-235b: T >= 4)
ROW_TILES_FROM_INTER = 1536  # the FP8 down's wide rules from I = 1536 (qwen3-235b-a22b)
ONE_TILE_DOWN_UNROLL = 4  # auto DB_UNROLL of the FP8 grouped down with one row tile from I = ROW_TILES_FROM_INTER
SHARE_GROUP = 4  # auto GB_SHARE / DB_SHARE where they apply (auto_share)
SHARED_LIMIT = 48 * 1024  # static shared memory of the GB_SHARE buffers
# The batch-invariant numerics: the gate_up's dots as mma chains over fixed k ranges (a function of H alone), added
# in range order; each pair's down row weighted; the slots summed in order from 0 -- here with DB_GROUPED 1, and in
# the per-pair family (kernels/batched/pairs.py) with the same ranges. 8 ranges on bf16, 4 on fp8 (a range of H / 4
# keeps a warp's FP8 loads in flight for twice the loop): H200, results/sweep-2026-12-01-invariant-*-ksplit-*.json,
# sweep-2026-12-02-fp8-grouped-ksplit-unroll-*.json (the grouped FP8 path 2.5-4 % faster at qwen3-235b T = 8..64).
INVARIANT_KSPLIT = 8
FP8_INVARIANT_KSPLIT = 4


def invariant_ksplit(fmt: WeightFormat) -> int:
    """The batch-invariant pair's k ranges on ``fmt`` weights."""
    return FP8_INVARIANT_KSPLIT if fmt.scaled else INVARIANT_KSPLIT


def grouped_knobs(fmt: WeightFormat) -> dict[str, int]:
    """The batch-invariant grouped path's knobs on ``fmt`` weights."""
    return {"DB_GROUPED": 1, "GB_KSPLIT": invariant_ksplit(fmt)}


def wide_fp8(dims: Dims | None, fmt: WeightFormat) -> bool:
    """FP8 weights with rows of I >= :data:`ROW_TILES_FROM_INTER`: where the down's auto rules differ."""
    return bool(dims is not None and fmt.scaled and dims.intermediate >= ROW_TILES_FROM_INTER)


def tile_pairs(params: dict[str, int]) -> int:
    """Pairs per tile of the tile table: one gate_up pass, 8, or 8 * HOT_NBLK where that is wider."""
    return 8 * max(1, params.get("HOT_NBLK", 0))


def down_shared_bytes(dims: Dims, params: dict[str, int]) -> int:
    """Dynamic shared memory of the down: per warp an FP32 partial [T][16] (none when grouped)."""
    return 0 if params["DB_GROUPED"] else params["DB_WARPS"] * dims.tokens * 16 * 4


def auto_grouped(dims: Dims | None, fmt: WeightFormat) -> int:
    """DB_GROUPED: 1 once experts average 2 pairs (T*K >= 2E), else 0. H200, qwen3-30b-a3b / qwen3-235b-a22b
    (results/sweep-2026-12-01-mma-grouped-*.json): from T = 32 the grouped down costs <= 1 % under uniform routing and
    saves 3-5 % under Zipf; at T <= 16 it costs 1-16 % (its fourth launch). On FP8 weights with rows of I >= 1536 from
    a quarter of a pair per expert: qwen3-235b T = 4 / 8 / 16 (results/sweep-2026-12-03-mma-fp8-grouped-*.json)
    140.9 / 247.8 / 383.9 -> 136.2 / 237.4 / 369.7 us uniform, 134.0 / 199.8 / 302.3 -> 129.8 / 192.5 / 294.5 Zipf."""
    if dims is None:
        return 0
    per_expert = FP8_WIDE_GROUPED_FROM_PAIRS_PER_EXPERT if wide_fp8(dims, fmt) else GROUPED_FROM_PAIRS_PER_EXPERT
    return int(experts_average(dims, per_expert))


def auto_down_warps(dims: Dims | None, values: dict[str, int], fmt: WeightFormat) -> int:
    """Warps per down block: the grouped down :data:`GROUPED_DOWN_WARPS`, or on FP8 weights at I >= 1536
    :data:`FP8_WIDE_GROUPED_DOWN_WARPS` (H200, qwen3-235b, results/sweep-2026-12-03-{grouped,mma}-down-warps-235b-
    *.json: Zipf T = 16 / 32 / 64 314.2 / 409.3 / 543.8 -> 308.1 / 403.4 / 533.8 us); the balanced down
    :data:`MMA_DOWN_WARPS`, or from T = :data:`MMA_WIDE_DOWN_FROM` :data:`MMA_WIDE_DOWN_WARPS` where their partials fit
    the shared memory and the register cap allows 768 threads."""
    if values["DB_GROUPED"]:
        return FP8_WIDE_GROUPED_DOWN_WARPS if wide_fp8(dims, fmt) else GROUPED_DOWN_WARPS
    if dims is None or dims.tokens < MMA_WIDE_DOWN_FROM:
        return MMA_DOWN_WARPS
    cap = values["DB_MAX_REGS"]
    fits_registers = cap == -1 or block_registers(MMA_WIDE_DOWN_WARPS, cap) <= 65536
    fits_shared = down_shared_bytes(dims, {**values, "DB_WARPS": MMA_WIDE_DOWN_WARPS}) <= lists.OPT_IN_SHARED_LIMIT
    return MMA_WIDE_DOWN_WARPS if fits_registers and fits_shared else MMA_DOWN_WARPS


def auto_hot_nblk(dims: Dims, values: dict[str, int], fmt: WeightFormat) -> int:
    """HOT_NBLK: FP8 weights 2 once an expert averages 4 pairs (T*K >= 4E; H200 Zipf, results/sweep-2026-12-02-hot-
    nblk-*.json: T = 64 568.5 -> 533.8 us at qwen3-235b); bf16 2 from T*K >= E with the grouped down where an expert's
    gate_up rows reach HOT_EXPERT_BYTES (qwen3-235b, not qwen3-30b; results/sweep-2026-12-03-hot-*.json: Zipf T = 16 /
    32 / 64 530.2 / 682.0 / 884.6 -> 520.4 / 671.1 / 866.0 us); else 0."""
    if fmt.scaled:
        return 2 if experts_average(dims, 4) else 0
    large = 2 * dims.intermediate * dims.hidden * 2 >= HOT_EXPERT_BYTES
    return 2 if large and values["DB_GROUPED"] and experts_average(dims, 1) else 0


def hot_unroll(values: dict[str, int], stage: str, fmt: WeightFormat) -> int:
    """GB_HOT_UNROLL / DB_HOT_UNROLL where auto: on bf16 weights a hot pass keeps the normal pass's k blocks in flight
    (the gate_up's single chain; the grouped down), elsewhere 0 (the halved rounds). H200, qwen3-235b Zipf T = 64
    (results/sweep-2026-12-03-hot-unroll-*.json, sweep-2026-12-03-gate-up-hot-unroll-4r-*.json): the down 880.5 ->
    874.3 us, the gate_up 856.9 -> 851.2; mixtral-8x7b uniform T = 64 the down 804 -> 778-789, the gate_up 739 ->
    710-719."""
    hot = values["HOT_NBLK"] > 1 and (values["GB_KSPLIT"] == 1 if stage == "GB" else values["DB_GROUPED"] == 1)
    return values[f"{stage}_UNROLL"] if hot and not fmt.scaled else 0


def round_sizes(values: dict[str, int], stage: str) -> tuple[int, int]:
    """A stage's k blocks per round: a normal pass's and a hot pass's -- ``*_HOT_UNROLL`` where set, else the halved
    rounds the CUDA C runs (HOT_UNROLL: ``*_UNROLL / HOT_NBLK``, at least 1), which need not divide ``*_UNROLL`` (5 / 2
    = 2: 8-chunk hot rounds straddle 20-chunk ranges). Without hot passes (HOT_NBLK <= 1) both are the normal one."""
    unroll = values[f"{stage}_UNROLL"]
    if values["HOT_NBLK"] <= 1:
        return unroll, unroll
    return unroll, values[f"{stage}_HOT_UNROLL"] or max(1, unroll // values["HOT_NBLK"])


def range_flush(dims: Dims, values: dict[str, int], fmt: WeightFormat) -> int:
    """GB_RANGE_FLUSH: 1 where the split chains' ranges are whole rounds (and whole 128-wide scale blocks on FP8):
    2-4 % faster (H200, results/sweep-2026-12-02-range-flush-grouped-*.json), else 0."""
    if values["GB_KSPLIT"] == 1:
        return 0
    block = 4 * mma_halves(values)  # chunks per k block (MMA_KB)
    per_range = -(-(dims.hidden // 8) // values["GB_KSPLIT"])
    size = -(-per_range // block) * block
    scale_ok = not fmt.scaled or size % 16 == 0
    return int(all(size % (block * r) == 0 for r in round_sizes(values, "GB")) and scale_ok)


def whole_ranges(dims: Dims, values: dict[str, int], fmt: WeightFormat) -> int:
    """DB_WHOLE_RANGES: 1 on the bf16 grouped down where I / 8 is whole rounds of 4 x DB_UNROLL chunks: 1-2 % faster
    (H200, results/sweep-2026-12-02-whole-ranges-*.json), else 0."""
    return int(not fmt.scaled and values["DB_GROUPED"] == 1
               and all((dims.intermediate // 8) % (4 * r) == 0 for r in round_sizes(values, "DB")))


def takes_pass_regs(dims: Dims, values: dict[str, int], fmt: WeightFormat, stage: str) -> bool:
    """Where an auto cap is :data:`PASS_REGS`: the bf16 gate_up's split chains or hot passes, the bf16 grouped down's
    hot passes, and the FP8 gate_up's single chain where E/8 < T*K <= E/4 (qwen3 T = 4; H200, results/sweep-2026-
    12-03-gate-up-regs-fp8-*.json: qwen3-235b 136.3 -> 129.6 us, qwen3-30b 44.9 -> 40.5)."""
    if stage == "DB":
        return bool(values["DB_GROUPED"] and not fmt.scaled and values["HOT_NBLK"] == 2)
    if fmt.scaled:
        return values["GB_KSPLIT"] == 1 and dims.experts < 8 * dims.tokens * dims.top_k <= 2 * dims.experts
    return values["GB_KSPLIT"] > 1 or values["HOT_NBLK"] == 2


def auto_row_tiles(dims: Dims, values: dict[str, int], fmt: WeightFormat) -> int:
    """DB_ROW_TILES: 2 on the FP8 grouped down at I >= 1536 with DB_UNROLL >= 2 where T*K >= 2E, else 1. H200
    (results/sweep-2026-12-03-fp8-widening-row-tiles-*.json): qwen3-235b T = 32 / 64 527.5 / 604.0 -> 523.7 / 591.3
    us. 4-bit weights: 1 (two tiles of 128-wide k blocks spill at gpt-oss-120b T = 64)."""
    wide = values["DB_GROUPED"] and wide_fp8(dims, fmt) and values["DB_UNROLL"] >= 2 and not values["FP4_HALVES"]
    return 2 if wide and experts_average(dims, GROUPED_FROM_PAIRS_PER_EXPERT) else 1


def share_unmet(values: dict[str, int], stage: str, share: int) -> str | None:
    """Why ``stage`` ("GB" / "DB") cannot run groups of ``share`` tiles with these knobs (a ValueError's message), or
    None: the gate_up walking H in one loop / the grouped down, 2 or 4 dividing the stage's warps, the groups'
    buffers within 48 KB of static shared memory."""
    if stage == "GB" and not (values["GB_KSPLIT"] == 1 or values["GB_RANGE_FLUSH"] == 1):
        return "GB_SHARE groups tiles in the gate_up's one loop over H: it needs GB_KSPLIT 1 or whole-round ranges"
    if stage == "DB" and not values["DB_GROUPED"]:
        return "DB_SHARE groups the tile table's tiles of one expert in the grouped down: it needs DB_GROUPED 1"
    warps = values[f"{stage}_WARPS"]
    if share not in (2, 4) or warps % share:
        return (f"{stage}_SHARE must be 2 or 4 and divide {stage}_WARPS, got {stage}_SHARE {share} and {stage}_WARPS "
                f"{warps}")
    unroll = values[f"{stage}_UNROLL"] if values["HOT_NBLK"] <= 1 else (
        values[f"{stage}_HOT_UNROLL"] or max(1, values[f"{stage}_UNROLL"] // values["HOT_NBLK"]))
    halves = mma_halves(values)
    row_tiles = values["DB_ROW_TILES"] if stage == "DB" else 1
    buffers = warps // 2 * 2 * unroll * halves * row_tiles * 2 * 32 * 16
    if buffers > SHARED_LIMIT:
        return (f"{stage}_SHARE: the groups' buffers take {buffers} bytes of static shared memory > {SHARED_LIMIT}; "
                f"lower {stage}_WARPS or {stage}_UNROLL")
    return None


def auto_share(dims: Dims, values: dict[str, int], fmt: WeightFormat, stage: str) -> int:
    """GB_SHARE / DB_SHARE: :data:`SHARE_GROUP` on bf16 weights from T*K >= 2E where the stage can run it, else 0.
    H200, bf16 (results/sweep-2026-12-03-shared-widening-mma-bf16-*.json): Zipf qwen3-30b T = 32 / 64 185.2 / 233.0 ->
    181.2 / 231.2 us (both stages). The down's groups alone, same machine and draws, old code against new without
    them, twice (results/h200-2026-12-04-families-db-share-ab.txt): qwen3-235b Zipf T = 32 / 64 +0.6 / +1.2-1.6 %
    without, uniform within 0.1 %. On FP8 weights 1-9 % slower: off."""
    if fmt.scaled or not experts_average(dims, GROUPED_FROM_PAIRS_PER_EXPERT):
        return 0
    return SHARE_GROUP if share_unmet(values, stage, SHARE_GROUP) is None else 0


def make_rules(fmt: WeightFormat, layer: ExpertLayer = CONTRACT_LAYER) -> Any:
    def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
        """Fill the auto knobs and the derived macros from ``dims``; ValueError for what cannot run."""
        if layer.bias and values["DB_GROUPED"] == 0:
            raise ValueError("a layer with biases adds b2 to each pair's whole dot, which the balanced down splits "
                             "between warps: it needs DB_GROUPED 1 (or -1: auto)")
        if values["DB_GROUPED"] == -1:
            values["DB_GROUPED"] = 1 if layer.bias else auto_grouped(dims, fmt)
        loader_macros(dims, values, fmt, widening=2)  # the byte permute, its multiply on B
        if values["DB_WARPS"] == 0:
            values["DB_WARPS"] = auto_down_warps(dims, values, fmt)
            if values["DB_WARPS"] == MMA_WIDE_DOWN_WARPS and values["DB_MAX_REGS"] == -1:
                values["DB_MAX_REGS"] = 0  # what was measured: __launch_bounds__(768) alone
        auto_caps = {stage for stage in ("GB", "DB") if values[f"{stage}_MAX_REGS"] == -1}
        check_register_caps(values)
        gate_up_unroll_auto, down_unroll_auto = values["GB_UNROLL"] == 0, values["DB_UNROLL"] == 0
        halves = mma_halves(values)  # 64- and 128-wide k blocks: fewer in flight (their B fragments' registers)
        values["GB_UNROLL"] = values["GB_UNROLL"] or (MMA_UNROLL // 2 if halves == 4 else MMA_UNROLL)
        values["DB_UNROLL"] = values["DB_UNROLL"] or (MMA_UNROLL // 2 if halves > 1 else MMA_UNROLL)
        if values["FP4_HALVES"] and max(values["GB_SHARE"], values["DB_SHARE"]) > 1:
            raise ValueError(f"GB_SHARE / DB_SHARE share widened A fragments between warps; {fmt.name}'s fragments are "
                             "scaled per lane before the mma: they take 0 or 1 (-1: auto)")
        lists.list_rules(dims, values)
        if dims is None:
            values["DB_ROW_TILES"] = values["DB_ROW_TILES"] or 1
            for key in ("HOT_NBLK", "GB_SHARE", "DB_SHARE", "DB_HOT_UNROLL", "GB_HOT_UNROLL"):
                values[key] = max(values[key], 0)
            _check_share(values)
            return values
        if values["HOT_NBLK"] == -1:
            values["HOT_NBLK"] = auto_hot_nblk(dims, values, fmt)
        if values["DB_HOT_UNROLL"] == -1:
            values["DB_HOT_UNROLL"] = hot_unroll(values, "DB", fmt)
        if values["GB_HOT_UNROLL"] == -1:
            values["GB_HOT_UNROLL"] = hot_unroll(values, "GB", fmt)
        del gate_up_unroll_auto  # the tensor-core gate_up's rounds: MMA_UNROLL at every T (results/sweep-2026-12-02-
        # unroll-*.json)
        values["GB_RANGE_FLUSH"] = range_flush(dims, values, fmt)
        values["DB_WHOLE_RANGES"] = whole_ranges(dims, values, fmt)
        for stage in auto_caps:
            if takes_pass_regs(dims, values, fmt, stage):
                values[f"{stage}_MAX_REGS"] = PASS_REGS
        if values["DB_ROW_TILES"] == 0:
            values["DB_ROW_TILES"] = auto_row_tiles(dims, values, fmt)
        if down_unroll_auto and values["DB_GROUPED"] and wide_fp8(dims, fmt) and values["DB_ROW_TILES"] == 1:
            values["DB_UNROLL"] = ONE_TILE_DOWN_UNROLL  # results/sweep-2026-12-03-grouped-down-unroll-*.json
        if values["DB_ROW_TILES"] > 1 and not values["DB_GROUPED"]:
            raise ValueError(f"DB_ROW_TILES {values['DB_ROW_TILES']} gives the grouped down's warps more rows: it "
                             "needs DB_GROUPED 1, got 0")
        for stage in ("GB", "DB"):
            if values[f"{stage}_SHARE"] == -1:
                values[f"{stage}_SHARE"] = auto_share(dims, values, fmt, stage)
        _check_share(values)
        shared = down_shared_bytes(dims, values)
        if shared > lists.OPT_IN_SHARED_LIMIT:
            raise ValueError(
                f"the down kernel keeps DB_WARPS * T * 16 fp32 partials in shared memory: {shared} bytes > "
                f"{lists.OPT_IN_SHARED_LIMIT} at T = {dims.tokens}; lower DB_WARPS (or use DB_GROUPED 1)")
        return values

    return rules


def _check_share(values: dict[str, int]) -> None:
    for stage in ("GB", "DB"):
        share = values[f"{stage}_SHARE"]
        unmet = share_unmet(values, stage, share) if share > 1 else None
        if unmet:
            raise ValueError(unmet)


def kernel_names(params: dict[str, int]) -> tuple[str, ...]:
    """The lists, the gate_up and the down (or the grouped down and the sum) these knobs launch."""
    return (lists.KERNEL, GATE_UP, DOWN_GROUPED, SUM_SLOTS) if params["DB_GROUPED"] else (lists.KERNEL, GATE_UP, DOWN)


def gate_up_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block row (ceil(I / 8 GB_WARPS) blocks) per possible tile."""
    return lists.tile_capacity(dims, tile_pairs(params)) * -(-dims.intermediate // (params["GB_WARPS"] * 8))


def down_blocks(dims: Dims, params: dict[str, int]) -> int:
    """One block per 16 hidden columns; grouped: a block row (DB_WARPS x 16 x DB_ROW_TILES rows) per possible tile."""
    if params["DB_GROUPED"]:
        rows = params["DB_WARPS"] * 16 * params["DB_ROW_TILES"]
        return lists.tile_capacity(dims, tile_pairs(params)) * -(-dims.hidden // rows)
    return -(-dims.hidden // 16)


def sum_blocks(dims: Dims) -> int:
    """moe_sum_slots' blocks: one thread per 4 columns of a token."""
    return -(-dims.tokens * (dims.hidden // 4) // SUM_THREADS)


def make_stages(fmt: WeightFormat) -> Any:
    def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
               out: Any, b13: Any = None, b2: Any = None) -> list[Stage]:
        """The layer as three launches (expert_lists, gate_up, down), four with DB_GROUPED (the grouped down + sum)."""
        params, d, ws = compiled.params, compiled.dims, compiled.workspace
        lists_k, gate_up_k, down_k, *sum_k = (compiled.kernels[name] for name in kernel_names(params))
        first = list_stages(compiled, fmt, (lists_k, gate_up_k, down_k), gate_up_blocks(d, params),
                            down_blocks(d, params), down_shared_bytes(d, params), x, w13, w2, topk_ids,
                            topk_weights, out, b13=b13, b2=b2)
        if not sum_k:
            return first
        global2, bias2 = global_arg(w2, fmt), bias_args(b13, b2)[1]
        w2, s2 = weight_args(w2, fmt)
        i32, programmatic = np.int32, bool(params["PDL"])

        def down_grouped() -> None:
            launch_ex(down_k, (down_blocks(d, params),), (params["DB_WARPS"] * 32,),
                      (ws.intermediate, w2, s2, topk_weights, ws.lists, ws.pair_out, i32(d.hidden),
                       i32(d.intermediate), i32(d.experts), i32(d.top_k), i32(lists.slots(d)),
                       i32(d.tokens * d.top_k), global2, bias2), programmatic=programmatic)

        def sum_slots() -> None:
            launch_ex(sum_k[0], (sum_blocks(d),), (SUM_THREADS,),
                      (ws.pair_out, topk_ids, out, i32(1 if out.dtype == np.float32 else 0), i32(d.tokens),
                       i32(d.hidden), i32(d.experts), i32(d.top_k)), programmatic=programmatic)

        return [*first[:2], ("down", down_grouped), ("sum", sum_slots)]

    return stages


def make_family(fmt: WeightFormat, layer: ExpertLayer = CONTRACT_LAYER) -> KernelFamily:
    """The tensor-core pair on ``fmt`` weights computing ``layer``: the helpers, the family's macros, the lists, the
    loader and the layer's code, the core and the kernels."""
    code = (WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + FAMILY_DEFINES + BATCHED_HELPERS + BLOCK_OUTPUTS
            + loader_for(fmt, "mma") + layer.device_code() + lists.CODE + CORE + CODE)
    suffix = family_suffix(fmt, layer)
    source = CudaSource(
        name=f"batched_mma{suffix}", code=code, kernels=(lists.KERNEL, GATE_UP, DOWN, DOWN_GROUPED, SUM_SLOTS),
        defaults={**KNOBS, **DERIVED},
        warps_knobs={GATE_UP: "GB_WARPS", DOWN: "DB_WARPS", DOWN_GROUPED: "DB_WARPS"},
        conditional_kernels={DOWN_GROUPED: "DB_GROUPED", SUM_SLOTS: "DB_GROUPED"},
        knob_prefixes={GATE_UP: "GB_", DOWN: "DB_", DOWN_GROUPED: "DB_", lists.KERNEL: "LIST_"},
        description=f"batched warp decode on tensor cores, {fmt.name} weights: the tile table, mma.sync gate_up, "
                    "balanced or grouped down")
    family = KernelFamily(name=f"warp-decode-mma{suffix}", source=source, limits=LIMITS, auto_knobs=AUTO_KNOBS,
                          derived=tuple(DERIVED), rules=make_rules(fmt, layer), device_needs={"PDL": 90},
                          kernel_names=kernel_names, workspace=make_workspace, stages=make_stages(fmt))
    source.variants = sample_variants(family.resolve, source.defaults, ({}, grouped_knobs(fmt)))
    return family


def make_workspace(dims: Dims, params: dict[str, int]) -> Any:
    """The intermediate, the lists buffer and, for the grouped down, the per-pair rows."""
    return allocate(dims, lists=True, pair_out=bool(params["DB_GROUPED"]))


MMA = FormatFamilies(make_family, (BF16_FORMAT.name, BF16_T16.name, FP8_BLOCK128.name, FP8_BLOCK128_T16.name,
                                   MXFP4.name, NVFP4.name))
