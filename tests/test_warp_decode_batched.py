"""Batched warp decode (kernels/batched/: the FMA, tensor-core and per-pair families, one per weight format).

CPU tests: argument checks before any device call (stand-in "cupy" arrays), knob validation and the auto
knobs of each family (a removed or derived knob is an unknown parameter), the offline compile (zero spills /
stack) of the defaults and of every preset's resolved knobs, the variant registration, and the CUDA C itself
emulated on the CPU (g++, one lane per thread of a block, shuffles and __syncthreads through barriers): the
routing lists against a NumPy model, the whole layer against ``reference.moe_decode``, the FMA gate/up
intermediate BITWISE against the strict kernel's (kernels/warp_decode_cupy.py, emulated the same way), bad ids
-> NaN rows, and the batch-invariant forms' bits in any batch.

GPU tests (``-m gpu``, the H200): presets at T in {1, 3, 8, 64}, odd shapes, every routing (incl. "same" and
fixed ids with duplicates), fp32 out, the intermediate bitwise equal to the strict kernel's, bitwise
repeatability over 3 runs, bad ids (ValueError outside capture, NaN rows inside the kernels), CUDA-graph
capture + replay on new routing, the stages and the variant, a sample of each family's knobs.

Tolerance vs ``reference.moe_decode(mode="warp_decode")``: as tests/test_warp_decode_cupy.py explains
(|got - ref| <= ulp(|ref|) + ulp(RMS / 4), >= 85 % bitwise, rel-L2 vs fp64 < 5e-3; tests/warp_checks.py).
The sum over a token's K slots runs in a different order here (by down warp, then by expert id), which
only moves fp32 ulps; the tensor-core families sum in an order of their own (``own_order``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels import warp_decode_cupy as wdc
from kernels.activation import CONTRACT_LAYER, expert_layer
from kernels.batched import fma, lists, mma, pairs
from kernels.batched.common import Workspace
from kernels.contract import BF16, Dims
from kernels.formats import BF16_FORMAT, BF16_T16, FP8_BLOCK128, Quantized, format_of, get_format, quantize_weights
from kernels.numerics import bf16_to_f32
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.routing import make_routing
from kernels.shapes import PRESETS, MoEShape
from tests.warp_checks import (
    EMULATED_MMA,
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    ODD_SHAPES,
    ROUTINGS,
    FakeCupyArray,
    _assert_matches,
    _fake_inputs,
    _poisoned_out,
    _references,
    _seed,
    assert_graph_replays_bitwise,
    assert_pdl_chain_bitwise,
    build_emulator,
    run_emulator,
    slow_except,
)

# ---------------------------------------------------------------------------------------------------
# Helpers of this file (the shared checks live in tests/warp_checks.py)
# ---------------------------------------------------------------------------------------------------


def write_fresh_inputs(cupy: Any, problem: Problem, seed: int, routing: str = "zipf") -> None:
    """New x and routing (other experts, other counts) written into the problem's device buffers (no new weights)."""
    shape = problem.shape
    ids, weights = make_routing(problem.tokens, shape.experts, shape.top_k, routing, seed)
    x = np.random.default_rng([seed, 0]).standard_normal((problem.tokens, shape.hidden), dtype=np.float32)
    problem.x.view(cupy.uint16)[...] = cupy.asarray(x.astype(BF16).view(np.uint16))
    problem.topk_ids[...] = cupy.asarray(ids)
    problem.topk_weights[...] = cupy.asarray(weights)


QWEN30 = PRESETS["qwen3-30b-a3b"]
BF16_NAME = BF16_FORMAT.name
FP8_NAME = FP8_BLOCK128.name
GROUPED = mma.grouped_knobs(BF16_FORMAT)  # the batch-invariant grouped path (cupy:warp-decode-mma-grouped)
FP8_GROUPED = mma.grouped_knobs(FP8_BLOCK128)
STAGE_MODULES = {"fma": fma, "mma": mma, "pairs": pairs}  # each family's gate_up_blocks / down_blocks


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


def _resolve(path: str, dims: Dims | None = None, weight_format: str = BF16_NAME, **knobs: Any) -> dict[str, int]:
    """``path``'s family on ``weight_format`` weights, resolved for ``dims``."""
    return batched.family(path, weight_format).resolve(dims, **knobs)


# ---------------------------------------------------------------------------------------------------
# CPU: argument checks, knobs, registration, offline compile
# ---------------------------------------------------------------------------------------------------


def _call(**arrays: Any) -> Any:
    return batched.warp_decode_batched(arrays["x"], arrays["w13"], arrays["w2"], arrays["topk_ids"],
                                       arrays["topk_weights"], **arrays.get("params", {}))


def test_numpy_inputs_are_a_type_error() -> None:
    problem = make_problem("tiny", 2, seed=3)
    for path in batched.FAMILIES:
        with pytest.raises(TypeError, match="x must be a cupy"):
            batched.warp_decode_batched(*problem.arrays, path=path)


@pytest.mark.parametrize(
    ("name", "replacement", "error", "match"),
    [
        ("x", FakeCupyArray((2, 16), np.float32), TypeError, "x must have dtype"),
        ("w13", FakeCupyArray((3, 15, 16), BF16), ValueError, "even"),
        ("w2", FakeCupyArray((3, 16, 4), BF16), ValueError, "w2 must be"),
        ("topk_ids", FakeCupyArray((2, 2), np.int64), TypeError, "topk_ids must have dtype"),
        ("topk_weights", FakeCupyArray((2, 3), np.float32), ValueError, "topk_weights must be"),
        ("x", FakeCupyArray((2, 12), BF16), ValueError, "w13 is"),
    ],
)
def test_bad_inputs_raise_before_any_device_call(name: str, replacement: Any, error: type, match: str) -> None:
    arrays = _fake_inputs()
    arrays[name] = replacement
    with pytest.raises(error, match=match):
        _call(**arrays)


def test_paths_formats_and_knobs_are_checked_before_any_device_call() -> None:
    """An unknown path, a format without a loader for the family, a knob of another family and bad dims are refused
    with the reason before the workspace is allocated (no device here)."""
    with pytest.raises(ValueError, match=r"path must be one of \['fma', 'mma', 'pairs'\], got 'mixed'"):
        batched.family("mixed")
    with pytest.raises(ValueError, match=r"path must be one of .* got 'mixed'"):
        batched.make_workspace(Dims(2, 16, 8, 3, 2), "mixed")
    with pytest.raises(ValueError, match=r"unknown warp-decode-pairs parameter\(s\) \['DB_WARPS'\]"):
        batched.make_workspace(Dims(2, 16, 8, 3, 2), "pairs", DB_WARPS=4)
    with pytest.raises(ValueError, match="no fma loader for weight format 'bf16-t16'"):
        batched.make_workspace(Dims(2, 64, 64, 3, 2), "fma", BF16_T16.name)
    with pytest.raises(TypeError, match="dims must be a kernels.contract.Dims"):
        batched.make_workspace((2, 16, 8, 3, 2))
    with pytest.raises(ValueError, match="dims.experts must be an int >= 1"):
        batched.make_workspace(Dims(2, 16, 8, 0, 2))


QWEN30_T8 = Dims(8, 2048, 768, 128, 8)
BAD_KNOBS = [  # (path, dims, knobs, error, message)
    ("fma", QWEN30_T8, {"GU_OUTS": 2}, ValueError, r"unknown warp-decode-batched parameter\(s\) \['GU_OUTS'\]"),
    ("fma", QWEN30_T8, {"GB_OUTS": 2.0}, TypeError, "GB_OUTS"),
    ("fma", QWEN30_T8, {"GB_BYTES": 12}, ValueError, "GB_BYTES"),
    ("fma", QWEN30_T8, {"DB_WARPS": 33}, ValueError, "DB_WARPS"),
    ("fma", Dims(1, 8, 8, 5000, 1), {}, ValueError, "the list kernel covers E"),  # E + 1 > 256 threads x 16
    ("mma", Dims(1, 8, 8, 5000, 1), {}, ValueError, "the list kernel covers E"),
    ("fma", Dims(800, 64, 32, 48, 40), {}, ValueError, "two per pair"),  # 32000 pairs: > 227 KB of list-kernel shared
    # the downs' partials: the FMA down's 4 warps x T x 4 columns, the balanced tensor-core down's 16 x T x 16
    ("fma", Dims(4000, 2048, 768, 128, 1), {}, ValueError, "DB_WARPS \\* T \\* DB_OUTS fp32 partials"),
    ("mma", Dims(300, 2048, 768, 128, 8), {"DB_GROUPED": 0}, ValueError, "DB_WARPS \\* T \\* 16 fp32 partials"),
    # 24 warps x 128 registers: the H200 answered CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (results/sweep-mma-dbwarps-*)
    ("mma", QWEN30_T8, {"DB_WARPS": 24}, ValueError, "DB_WARPS 24 x 32 threads x DB_MAX_REGS 128"),
    ("fma", QWEN30_T8, {"GB_WARPS": 32, "GB_MAX_REGS": 72}, ValueError, "GB_MAX_REGS"),
    ("pairs", QWEN30_T8, {"GB_KSPLIT": 3, "GB_WARPS": 4}, ValueError, "multiple of GB_KSPLIT"),
    ("pairs", Dims(2, 64, 32, 48, 40), {}, ValueError, "K <= 16, got 40"),
    ("mma", QWEN30_T8, {"GB_KSPLIT": 9}, ValueError, "GB_KSPLIT"),
    ("mma", QWEN30_T8, {"DB_ROW_TILES": 2, "DB_GROUPED": 0}, ValueError, "DB_ROW_TILES 2 .* needs DB_GROUPED 1"),
    ("mma", QWEN30_T8, {"GB_SHARE": 4, "GB_WARPS": 2}, ValueError, "GB_SHARE must be 2 or 4 and divide GB_WARPS"),
    ("mma", QWEN30_T8, {"GB_SHARE": 3}, ValueError, "GB_SHARE must be 2 or 4"),
]


@pytest.mark.parametrize(("path", "dims", "knobs", "error", "match"), BAD_KNOBS, ids=lambda c: str(c)[:40])
def test_resolve_refuses(path: str, dims: Dims, knobs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _resolve(path, dims, **knobs)


REMOVED_KNOBS = {  # knobs of the old single module that a family no longer takes (constant, a path or a format now),
    # and the derived macros its rules set: a caller passing one gets the unknown-parameter error naming it
    "fma": ("GB_MMA", "DB_MMA", "PER_PAIR", "W_FP8", "W_TILED", "DB_EARLY_W2", "DB_EARLY_INTER", "DB_BALANCE",
            "GB_KSPLIT", "DB_BYTES", "LIST_THREADS", "LIST_PER"),
    "mma": ("GB_MMA", "PER_PAIR", "W_FP8", "W_TILED", "GB_NBLK", "DB_NBLK", "DB_BALANCE", "PAIR_TILES",
            "DB_EARLY_W2", "FP8_BLOCK_SUM", "FP8_LOAD16", "FP8_PRMT", "GB_RANGE_FLUSH", "DB_WHOLE_RANGES",
            "LIST_THREADS", "LIST_PER", "PAIRS_INNER"),
    "pairs": ("PER_PAIR", "W_FP8", "DB_EARLY_W2", "FP8_BLOCK_SUM", "FP8_LOAD16", "FP8_PRMT", "HOT_NBLK", "DB_WARPS",
              "DB_GROUPED"),
}


def test_removed_and_derived_knobs_are_unknown_parameters() -> None:
    for path, knobs in REMOVED_KNOBS.items():
        for weight_format in (BF16_NAME, FP8_NAME):
            family = batched.family(path, weight_format)
            for knob in knobs:
                with pytest.raises(ValueError, match=rf"unknown {family.name}.* parameter\(s\) \['{knob}'\]"):
                    family.resolve(QWEN30_T8, **{knob: 1})
                assert knob not in family.defaults, (path, knob)


def test_resolve_validates() -> None:
    dims = QWEN30_T8
    assert _resolve("mma", dims, DB_GROUPED=0, DB_WARPS=24, DB_MAX_REGS=0)["DB_WARPS"] == 24
    assert _resolve("mma", dims, DB_GROUPED=0, DB_WARPS=24, DB_MAX_REGS=80)["DB_MAX_REGS"] == 80
    # auto warps of the balanced down: 24 under launch bounds where the cap is auto, 16 where a cap (128 included) is
    # given
    assert [_resolve("mma", Dims(64, 2048, 768, 128, 8), DB_GROUPED=0, **cap)["DB_WARPS"]
            for cap in ({}, {"DB_MAX_REGS": 128})] == [mma.MMA_WIDE_DOWN_WARPS, mma.MMA_DOWN_WARPS]
    switches = ("MAX_REGS", "PDL", "GROUPED", "FP8_", "FP4_", "WHOLE_RANGES", "RANGE_FLUSH", "PAIRS_INNER", "HOT_",
                "SHARE")
    for path in batched.FAMILIES:
        family = batched.family(path)
        resolved = family.resolve(dims)
        assert set(resolved) == set(family.source.defaults)  # every knob and every derived macro, as ints
        assert set(family.derived) == set(family.source.defaults) - set(family.defaults)
        assert all(v > 0 for k, v in resolved.items() if not any(s in k for s in switches)), (path, resolved)
        assert family.resolve(None)  # the rules' dims-free choice compiles (test_offline_compile_*)
    assert batched.family("fma") is batched.family("fma", BF16_NAME) is batched.VARIANT.kernel_family


def test_auto_knobs() -> None:
    tiles = {t: fma.auto_tile(Dims(t, 2048, 768, 128, 8)) for t in (1, 2, 4, 8, 16, 32, 64)}
    assert tiles == {1: 1, 2: 2, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}
    assert fma.auto_down_tile(Dims(64, 2048, 768, 128, 8)) == 4  # down's tile is capped at 4
    assert fma.auto_tile(Dims(64, 4096, 14336, 8, 2)) == fma.MAX_TILE  # mixtral: 16 pairs per expert
    assert fma.auto_tile(Dims(3, 8, 8, 1, 1)) == 4  # never above the next power of two of T
    assert _resolve("fma", Dims(2, 2048, 512, 512, 10))["LIST_PER"] == 3  # (512 + 1) / 256 list threads
    assert _resolve("mma", Dims(2, 2048, 512, 300, 10))["LIST_PER"] == 2
    assert _resolve("fma", Dims(64, 2048, 768, 128, 8))["DB_UNROLL"] == 1  # 96 chunks: no whole rounds of 2
    assert _resolve("fma", Dims(64, 4096, 1536, 128, 8))["DB_UNROLL"] == 2  # 192 chunks
    assert _resolve("fma", Dims(32, 2048, 768, 128, 8))["GB_UNROLL"] == 2  # tile 4
    assert _resolve("fma", Dims(64, 2048, 768, 128, 8))["GB_UNROLL"] == 4  # tile 8
    assert lists.slots(Dims(2, 8, 8, 128, 8)) == 17 and lists.slots(Dims(64, 8, 8, 128, 8)) == 129
    assert lists.lists_size(Dims(2, 8, 8, 128, 8)) == 4 + 3 * 17 + 16 + 4 * (17 + 2)
    assert lists.lists_shared_bytes(Dims(2, 8, 8, 128, 8), _resolve("fma")) == (129 * 9 + 2 * 16) * 4  # 8 warps
    assert fma.max_tokens() == 227 * 1024 // (4 * 4 * 4)  # the down kernel opts into 227 KB above 48 KB
    assert _resolve("mma", Dims(8, 2048, 768, 128, 8))["DB_WARPS"] == mma.MMA_DOWN_WARPS
    wide = _resolve("mma", Dims(32, 2048, 768, 128, 8), DB_GROUPED=0)  # from T = 32: 24 warps
    assert (wide["DB_WARPS"], wide["DB_MAX_REGS"]) == (mma.MMA_WIDE_DOWN_WARPS, 0)
    # auto DB_GROUPED: the grouped down (4 warps) once experts average 2 pairs
    grouped = {t: _resolve("mma", Dims(t, 2048, 768, 128, 8)) for t in (16, 32, 64)}
    assert {t: (r["DB_GROUPED"], r["DB_WARPS"]) for t, r in grouped.items()} == {16: (0, 16), 32: (1, 4), 64: (1, 4)}
    assert mma.kernel_names(grouped[64]) == ("moe_expert_lists", "moe_gate_up_mma", "moe_down_grouped",
                                             "moe_sum_slots")
    assert mma.kernel_names(grouped[16]) == ("moe_expert_lists", "moe_gate_up_mma", "moe_down_mma")
    # the balanced down's 24 warps where a given cap allows 768 threads and the partials fit
    assert _resolve("mma", Dims(32, 2048, 768, 128, 8), DB_GROUPED=0, DB_MAX_REGS=80)["DB_WARPS"] == 24
    assert _resolve("mma", Dims(32, 2048, 768, 128, 8), DB_GROUPED=0, DB_MAX_REGS=96)["DB_WARPS"] == 16
    assert _resolve("mma", Dims(200, 2048, 768, 128, 8), DB_GROUPED=0)["DB_WARPS"] == 16  # partials: 307 KB
    assert _resolve("fma", Dims(64, 2048, 768, 128, 8))["DB_WARPS"] == 4  # the FMA down
    fp8 = _resolve("mma", Dims(64, 2048, 768, 128, 8), FP8_NAME)  # FP8: 16-value loads, the byte permute
    assert (fp8["FP8_LOAD16"], fp8["FP8_PRMT"], fp8["DB_ROW_TILES"]) == (1, 2, 1)  # I = 768: one row tile
    assert _resolve("pairs", Dims(1, 2048, 768, 128, 8), FP8_NAME)["FP8_PRMT"] == 3  # the intermediate x 2^8
    assert _resolve("mma", Dims(64, 2056, 768, 128, 8), FP8_NAME)["FP8_LOAD16"] == 0  # H % 16 != 0: 8-value loads
    # auto HOT_NBLK: 2 on FP8 from T*K >= 4E (qwen3 T = 64: a hot tile in one two-block pass), else 0
    hot = {(knobs, t): _resolve("mma", Dims(t, 2048, 768, 128, 8), fmt, **k)["HOT_NBLK"]
           for knobs, fmt, k in (("mma-fp8", FP8_NAME, {}), ("grouped-fp8", FP8_NAME, FP8_GROUPED),
                                 ("mma", BF16_NAME, {})) for t in (32, 64)}
    assert [hot[k, t] for k in ("mma-fp8", "grouped-fp8") for t in (32, 64)] == [0, 2, 0, 2]
    assert hot["mma", 64] == 0  # qwen3-30b bf16: 6 MiB experts
    # bf16 from T*K >= E with the grouped down (the tensor-core path's from T*K >= 2E) where an expert's gate_up rows
    # reach HOT_EXPERT_BYTES (qwen3-235b), under the 96 caps
    big = {(name, t): _resolve("mma", Dims(t, 4096, 1536, 128, 8), **knobs)
           for name, knobs in (("mma", {}), ("grouped", GROUPED)) for t in (8, 16, 32, 64)}
    assert [big[k, t]["HOT_NBLK"] for k in ("mma", "grouped") for t in (8, 16, 32, 64)] == [0, 0, 2, 2, 0, 2, 2, 2]
    assert [(big[k, 64]["GB_MAX_REGS"], big[k, 64]["DB_MAX_REGS"]) for k in ("mma", "grouped")] == [
        (mma.PASS_REGS, mma.PASS_REGS)] * 2
    assert mma.tile_pairs(big["mma", 64]) == 16 and mma.tile_pairs(big["mma", 16]) == 8
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), DB_MAX_REGS=120)["DB_MAX_REGS"] == 120
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), DB_MAX_REGS=128)["DB_MAX_REGS"] == 128
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), HOT_NBLK=0)["DB_MAX_REGS"] == 128
    # the bf16 grouped down's hot passes keep DB_UNROLL k blocks in flight (hot_unroll); FP8's the halved default (0),
    # as does every point without hot passes
    assert [big[k, t]["DB_HOT_UNROLL"] for k in ("mma", "grouped") for t in (16, 64)] == [0, 4, 4, 4]
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), FP8_NAME)["DB_HOT_UNROLL"] == 0
    # ... and the single-chain gate_up's GB_UNROLL; the split chains keep the halved default
    assert [big[k, t]["GB_HOT_UNROLL"] for k in ("mma", "grouped") for t in (16, 64)] == [0, 4, 0, 0]
    assert [big["mma", t]["GB_UNROLL"] for t in (32, 64)] == [4, 4]
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), FP8_NAME)["GB_HOT_UNROLL"] == 0
    # DB_WHOLE_RANGES (derived) needs a hot pass's rounds to split I into whole rounds too: 3 k blocks (12 chunks) do
    # not at I = 14336
    mixtral = Dims(64, 4096, 14336, 8, 2)
    assert [_resolve("mma", mixtral, **k)["DB_WHOLE_RANGES"] for k in ({}, {"DB_HOT_UNROLL": 3})] == [1, 0]
    # ... and GB_RANGE_FLUSH (derived) the split-chain gate_up's ranges (16 k blocks at qwen3-235b) whole hot rounds
    assert big["grouped", 64]["GB_RANGE_FLUSH"] == 1
    assert _resolve("mma", Dims(64, 4096, 1536, 128, 8), **GROUPED, GB_HOT_UNROLL=3)["GB_RANGE_FLUSH"] == 0
    # ... a hot pass's rounds as the CUDA C runs them: the halved rounds (HOT_NBLK 2, *_HOT_UNROLL 0) of UNROLL 5 are 2
    # k blocks, which split neither 20-chunk ranges (H = 320, GB_KSPLIT 2) nor I = 160's 20 chunks
    odd_rounds = {"DB_GROUPED": 1, "HOT_NBLK": 2, "GB_KSPLIT": 2, "GB_UNROLL": 5, "DB_UNROLL": 5, "DB_HOT_UNROLL": 0}
    assert [_resolve("mma", Dims(12, 320, 160, 5, 3), **{**odd_rounds, **k})["GB_RANGE_FLUSH"]
            for k in ({}, {"HOT_NBLK": 0}, {"GB_HOT_UNROLL": 5})] == [0, 1, 1]
    assert [_resolve("mma", Dims(12, 320, 160, 5, 3), **{**odd_rounds, **k})["DB_WHOLE_RANGES"]
            for k in ({}, {"HOT_NBLK": 0}, {"DB_HOT_UNROLL": 5})] == [0, 1, 1]
    assert mma.tile_pairs(fp8) == 16 and mma.tile_pairs(_resolve("mma", None, FP8_NAME)) == 8
    assert _resolve("mma", Dims(8, 2048, 768, 128, 8), DB_WARPS=4)["DB_WARPS"] == 4
    # auto GB_SHARE / DB_SHARE: groups of 4 on bf16 from T*K >= 2E where the stage can share (the grouped path's
    # split chains walk H in one loop: GB_RANGE_FLUSH); FP8 0
    share = {(name, t): tuple(_resolve("mma", Dims(t, 4096, 1536, 128, 8), fmt, **knobs)[k]
                              for k in ("GB_SHARE", "DB_SHARE"))
             for name, fmt, knobs in (("mma", BF16_NAME, {}), ("grouped", BF16_NAME, GROUPED),
                                      ("mma-fp8", FP8_NAME, {})) for t in (16, 32)}
    assert share == {("mma", 16): (0, 0), ("mma", 32): (4, 4), ("grouped", 16): (0, 0), ("grouped", 32): (4, 4),
                     ("mma-fp8", 16): (0, 0), ("mma-fp8", 32): (0, 0)}
    assert _resolve("mma", Dims(32, 4096, 1536, 128, 8), DB_SHARE=2)["DB_SHARE"] == 2  # asked for: kept
    with pytest.raises(ValueError, match="DB_SHARE groups the tile table's tiles of one expert in the grouped down"):
        _resolve("mma", Dims(8, 2048, 768, 128, 8), DB_GROUPED=0, DB_SHARE=2)
    assert _resolve("mma", Dims(32, 4096, 1536, 128, 8), GB_WARPS=2)["GB_SHARE"] == 0
    assert _resolve("mma", Dims(32, 4096, 1536, 128, 8), GB_SHARE=2)["GB_SHARE"] == 2  # asked for: kept
    with pytest.raises(ValueError, match="GB_SHARE groups tiles in the gate_up's one loop over H"):
        _resolve("mma", Dims(64, 4096, 1536, 128, 8), **GROUPED, GB_HOT_UNROLL=3, GB_SHARE=2)  # ranges not whole


def test_tensor_core_gate_up_rounds_and_register_cap() -> None:
    """The tensor-core gate_up's rules from the dims: the per-pair bf16 form keeps 4 k blocks in flight below
    PAIR_FULL_WARPS warps, 2 from there; the bf16 tensor-core gate_up runs under PASS_REGS with split chains or with
    hot two-block passes, the FP8 single chain at T*K = E/4; an explicit knob wins over a rule."""
    def gate_up(path: str, fmt: str, knobs: dict[str, int], tokens: int, hidden: int = 2048, inter: int = 768,
                **extra: int) -> tuple[int, int]:
        r = _resolve(path, Dims(tokens, hidden, inter, 128, 8), fmt, **{**knobs, **extra})
        return r["GB_UNROLL"], r["GB_MAX_REGS"]

    bf16, fp8 = BF16_NAME, FP8_NAME
    assert 1 * 8 * 96 * 8 < pairs.PAIR_FULL_WARPS <= 2 * 8 * 96 * 8  # qwen3-30b: T = 1 below, T = 2 at or above
    assert [gate_up("pairs", bf16, {}, t)[0] for t in (1, 2, 4)] == [4, 2, 2]
    assert gate_up("pairs", bf16, {}, 1, 4096, 1536)[0] == 2  # qwen3-235b T = 1: 12288 warps
    assert gate_up("pairs", bf16, {}, 2, GB_UNROLL=8)[0] == 8
    assert [gate_up("pairs", fp8, {}, t)[0] for t in (1, 2)] == [2, 2]  # its own sweep's rounds
    assert [gate_up("mma", fp8, FP8_GROUPED, t)[0] for t in (16, 64)] == [4, 4]
    assert [gate_up("mma", fp8, {}, t)[0] for t in (16, 64)] == [4, 4]  # one chain: no spills at 4
    assert [gate_up("mma", bf16, GROUPED, t) for t in (4, 64)] == [(4, mma.PASS_REGS)] * 2
    assert [gate_up("mma", bf16, {}, t)[1] for t in (4, 64)] == [128, 128]  # one chain, one block: 80 registers
    assert gate_up("mma", bf16, {}, 64, HOT_NBLK=2)[1] == mma.PASS_REGS  # one chain, hot two-block passes
    assert gate_up("mma", bf16, GROUPED, 4, GB_MAX_REGS=0)[1] == 0
    # an explicit cap is never changed, the auto value 128 included (a sweep's 128 column is 128); -1 is auto
    assert gate_up("mma", fp8, {}, 4, 4096, 1536, GB_MAX_REGS=128)[1] == 128
    assert gate_up("mma", fp8, {}, 4, 4096, 1536, GB_MAX_REGS=-1)[1] == mma.PASS_REGS
    assert gate_up("mma", bf16, GROUPED, 64, GB_MAX_REGS=128)[1] == 128
    assert gate_up("mma", bf16, {}, 64, GB_MAX_REGS=120)[1] == 120
    assert gate_up("mma", fp8, FP8_GROUPED, 4)[1] == 128 and gate_up("mma", fp8, {}, 64, HOT_NBLK=2)[1] == 128
    # the FP8 single chain under PASS_REGS where E/8 < T*K <= E/4 (qwen3 T = 4), both models; not the split chains
    assert [gate_up("mma", fp8, {}, t)[1] for t in (2, 4, 8)] == [128, mma.PASS_REGS, 128]
    assert gate_up("mma", fp8, {}, 4, 4096, 1536)[1] == mma.PASS_REGS
    assert gate_up("mma", bf16, {}, 4)[1] == 128 and gate_up("mma", fp8, FP8_GROUPED, 4, 4096, 1536)[1] == 128
    assert _resolve("pairs")["GB_UNROLL"] == pairs.MMA_UNROLL  # no dims: the default
    # the per-pair family's own auto knobs: the grouped path's ranges, a warp each; PAIRS_INNER on bf16 from T = 2
    assert [_resolve("pairs", None, fmt)["GB_KSPLIT"] for fmt in (bf16, fp8)] == [mma.INVARIANT_KSPLIT,
                                                                                  mma.FP8_INVARIANT_KSPLIT]
    assert [_resolve("pairs", None, fmt)["GB_WARPS"] for fmt in (bf16, fp8)] == [8, 4]
    assert [_resolve("pairs", Dims(t, 2048, 768, 128, 8))["PAIRS_INNER"] for t in (1, 2)] == [0, 1]
    assert _resolve("pairs", Dims(2, 2048, 768, 128, 8), fp8)["PAIRS_INNER"] == 0


def test_source_and_variant_are_registered() -> None:
    from kernels.compile import SOURCES
    from kernels.variants import REGISTRY

    assert set(batched.PATHS) >= {"cupy:warp-decode-batched", "cupy:warp-decode-mma", "cupy:warp-decode-mma-grouped",
                                  "cupy:warp-decode-mma-pairs"}
    assert "cupy:warp-decode-mixed" not in REGISTRY  # removed: never the fastest path
    for name, (path, knobs) in batched.PATHS.items():
        variant = REGISTRY[name]
        family = batched.family(path, variant.weight_format)
        assert variant.reference_mode == "warp_decode" and variant.family == family.name, name
        assert variant.kernel_family is family and variant.source is family.source, name
        assert SOURCES[family.source.name] is family.source, name
        assert variant.grid and set(variant.grid) <= set(family.defaults), name
        assert variant.resolve(QWEN30_T8) == family.resolve(QWEN30_T8, **knobs), name
    assert batched.VARIANT is REGISTRY["cupy:warp-decode-batched"]
    assert batched.PATHS["cupy:warp-decode-mma-grouped"] == ("mma", GROUPED)


@pytest.mark.parametrize("which", ["defaults", pytest.param("presets", marks=pytest.mark.slow)])
def test_offline_compile_defaults_and_presets_without_spills(which: str) -> None:
    """Every kernel of the bf16 families at their dims-free defaults (the tensor-core family both ways: balanced and
    grouped down) and at the knob sets each family's source.variants lists (the dispatch's regimes, resolved:
    kernels.batched.common.sample_variants): sm_90, zero spills, zero stack. Two compiles at a time (NVRTC runs
    outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    families = {path: batched.family(path) for path in batched.FAMILIES}
    if which == "defaults":
        cases = [("fma", families["fma"].resolve()), ("mma", families["mma"].resolve()),
                 ("mma", families["mma"].resolve(None, **GROUPED)), ("pairs", families["pairs"].resolve())]
    else:
        cases = [(path, {**family.source.defaults, **params}) for path, family in families.items()
                 for params in family.source.variants]
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda case: offline_report(families[case[0]].source, **case[1]), cases))
    for (path, params), reports in zip(cases, all_reports, strict=True):
        family = families[path]
        names = family.kernel_names(params) if family.kernel_names else family.source.compiled_kernels(**params)
        assert {r.kernel for r in reports} == set(names)
        for r in reports:
            assert r.spills == 0 and r.stack_bytes == 0, (path, params, r)
            cap = params.get("DB_MAX_REGS" if "down" in r.kernel else "GB_MAX_REGS", 0)
            assert r.registers <= max(128, cap), (path, params, r)  # 128, or a knob set's own higher cap


@pytest.mark.slow
def test_variant_grid_corners_compile() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report
    from kernels.variants import REGISTRY

    dims = Dims(64, 2048, 768, 128, 8)
    variants = [REGISTRY[name] for name in ("cupy:warp-decode-batched", "cupy:warp-decode-mma")]
    cases = [(variant.kernel_family, variant.resolve(dims, **corner)) for variant in variants
             for corner in ({k: max(v) for k, v in variant.grid.items()},
                            {k: min(v) for k, v in variant.grid.items()})]
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda case: offline_report(case[0].source, **case[1]), cases))
    for (family, params), reports in zip(cases, all_reports, strict=True):
        names = family.kernel_names(params) if family.kernel_names else family.source.compiled_kernels(**params)
        assert {r.kernel for r in reports} == set(names)


# ---------------------------------------------------------------------------------------------------
# CPU: the routing lists, modelled in NumPy
# ---------------------------------------------------------------------------------------------------
def expert_lists_numpy(topk_ids: np.ndarray, experts: int, tile_pairs: int = 0) -> dict[str, Any]:
    """What moe_expert_lists writes: slots in ascending expert id (bad ids last, as expert E), pairs stable; with
    ``tile_pairs`` (the tensor-core family's lists) the tile table: each slot's pairs in runs of tile_pairs,
    (expert, first, count, t | n << 16: the slot's t-th tile of n)."""
    flat = np.asarray(topk_ids, np.int64).ravel()
    keyed = np.where((flat < 0) | (flat >= experts), experts, flat)
    order = np.argsort(keyed, kind="stable")
    slot_experts, offsets, counts = np.unique(keyed[order], return_index=True, return_counts=True)
    bad = int(np.sum(keyed == experts))
    tiles = [(int(e), int(o) + f, min(tile_pairs, int(c) - f), f // tile_pairs | -(-int(c) // tile_pairs) << 16)
             for e, o, c in zip(slot_experts, offsets, counts, strict=True)
             for f in range(0, int(c), tile_pairs)] if tile_pairs else []
    return {"used": int(slot_experts.size), "good": flat.size - bad, "bad": bad, "expert": slot_experts,
            "offset": offsets, "count": counts, "sorted": order,
            "tiles": np.array(tiles, np.int64).reshape(-1, lists.TILE_ARRAYS)}


def _tile_pairs(dims: Dims, knobs: dict[str, Any], path: str = "fma", weight_format: str = BF16_NAME) -> int:
    """Pairs per tile of the tile table that ``path`` with these knobs (derived macros among them as _emulate takes
    them) writes (0: none -- the FMA family's lists; the per-pair family writes no lists at all)."""
    if path != "mma":
        return 0
    return mma.tile_pairs(_resolve_with_derived(batched.family(path, weight_format), dims, knobs))


def _unpack_lists(raw: np.ndarray, dims: Dims) -> dict[str, Any]:
    s = lists.slots(dims)
    used, tiles = int(raw[0]), int(raw[3])
    h = lists.LIST_HEADER
    n_pairs = dims.tokens * dims.top_k
    table = h + 3 * s + n_pairs
    cap = lists.tile_capacity(dims)
    return {"used": used, "good": int(raw[1]), "bad": int(raw[2]), "expert": raw[h:h + used],
            "offset": raw[h + s:h + s + used], "count": raw[h + 2 * s:h + 2 * s + used],
            "sorted": raw[h + 3 * s:h + 3 * s + n_pairs],
            "tiles": np.stack([raw[table + j * cap:table + j * cap + tiles] for j in range(lists.TILE_ARRAYS)],
                              axis=1)}


def _assert_lists_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("used", "good", "bad"):
        assert got[key] == want[key], key
    for key in ("expert", "offset", "count", "sorted", "tiles"):
        assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (g++; all threads of a block as lanes, barriers for warps and blocks)
# ---------------------------------------------------------------------------------------------------
EMULATION_HARNESS = EMULATION_PRELUDE + r"""
#define __maxnreg__(...)
#define __shared__ static
EmuBarrier* g_block = nullptr;
float* wdb_dynamic_shared = nullptr;
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline void __syncwarp() { g_warp->bar.arrive_and_wait(); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __match_any_sync(unsigned, int v) {
    unsigned mask = 0;
    for (int l = 0; l < 32; ++l) mask |= (unsigned)(exchange(v, l) == v) << l;
    return mask;
}
""" + EMULATED_MMA + r"""
#include "kernel.cu"

template <class F> void launch(long long blocks, int threads, F body) {
    // every thread of a block is a lane; blocks run one after another (a block barrier between)
    EmuBarrier block_bar(threads);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(new WarpCtx);
    run_lanes(threads, [&](int l) {
        g_warp = warps[l / 32].get();
        for (long long b = 0; b < blocks; ++b) {
            threadIdx.x = l;
            blockIdx.x = (unsigned)b;
            body();
            block_bar.arrive_and_wait();
        }
    });
}
""" + EMULATION_LOAD + r"""
template <class T> void save(const std::string& path, const std::vector<T>& v) {
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(v.data(), sizeof(T), v.size(), f);
    fclose(f);
}
// The family this binary emulates comes from the harness's own macros (prepended by the test: _harness):
// EMU_PATH_FMA / EMU_PATH_MMA / EMU_PATH_PAIRS, and EMU_SCALED for a scaled weight format: 1 fp8-block128 (bytes +
// float32 block scales), 2 mxfp4 (e2m1 pairs + e8m0 bytes), 3 nvfp4 (e2m1 pairs + e4m3 bytes + a float32 global
// scale per expert and matrix: every batched kernel's argument before the biases).
// The family's macros (DB_GROUPED) are the rendered kernel text's; the list kernel's threads and the dynamic shared
// memory come on the command line, from the resolved knobs.
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    int f32 = atoi(argv[6]);
    long long gu_blocks = atoll(argv[7]), dn_blocks = atoll(argv[8]);
    int slots = atoi(argv[9]), lists_size = atoi(argv[10]), list_threads = atoi(argv[11]);
    long long shared_floats = atoll(argv[12]);
    std::string dir = argv[13];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    const float* g13 = nullptr;  // global-scaled weights' scale per expert (nvfp4), else never read
    const float* g2 = nullptr;
#if EMU_SCALED >= 2  // mxfp4 / nvfp4: e2m1 values two a byte along k, an e8m0 / e4m3 byte per 32 / 16 values a row
    const int SB = EMU_SCALED == 2 ? 32 : 16;
    auto w13 = load<uint8_t>(dir + "/w13.bin", (size_t)E * 2 * I * H / 2);
    auto w2 = load<uint8_t>(dir + "/w2.bin", (size_t)E * H * I / 2);
    auto s13v = load<uint8_t>(dir + "/s13.bin", (size_t)E * 2 * I * ((H + SB - 1) / SB));
    auto s2v = load<uint8_t>(dir + "/s2.bin", (size_t)E * H * ((I + SB - 1) / SB));
    const uint8_t* s13 = s13v.data();
    const uint8_t* s2 = s2v.data();
#if EMU_SCALED == 3
    auto g13v = load<float>(dir + "/g13.bin", (size_t)E);
    auto g2v = load<float>(dir + "/g2.bin", (size_t)E);
    g13 = g13v.data();
    g2 = g2v.data();
#endif
#elif EMU_SCALED  // fp8-block128: e4m3fn bytes and the block scales
    auto w13 = load<uint8_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto w2 = load<uint8_t>(dir + "/w2.bin", (size_t)E * H * I);
    const size_t HB = (H + 127) / 128, IB = (I + 127) / 128;
    auto s13v = load<float>(dir + "/s13.bin", (size_t)E * 2 * IB * HB);
    auto s2v = load<float>(dir + "/s2.bin", (size_t)E * HB * IB);
    const float* s13 = s13v.data();
    const float* s2 = s2v.data();
#else
    auto w13 = load<uint16_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto w2 = load<uint16_t>(dir + "/w2.bin", (size_t)E * H * I);
    const float* s13 = nullptr;  // never read
    const float* s2 = nullptr;
#endif
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    auto wts = load<float>(dir + "/wts.bin", (size_t)T * K);
    // the experts' biases, for a family compiled with them (EXPERT_BIAS), else null: never read
    std::vector<uint16_t> b13v, b2v;
    if (EXPERT_BIAS) {
        b13v = load<uint16_t>(dir + "/b13.bin", (size_t)E * 2 * I);
        b2v = load<uint16_t>(dir + "/b2.bin", (size_t)E * H);
    }
    const uint16_t* b13 = EXPERT_BIAS ? b13v.data() : nullptr;
    const uint16_t* b2 = EXPERT_BIAS ? b2v.data() : nullptr;
    std::vector<int> lists(lists_size, -12345);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);
    std::vector<uint32_t> out((size_t)T * H, 0x7fc07fc0u);  // NaN poison in either view
    // the larger of the list kernel's and the down kernel's (partials) dynamic shared memory, NaN-poisoned
    std::vector<float> shared(std::max(shared_floats, 1LL), __uint_as_float(0x7fc00000u));
    wdb_dynamic_shared = shared.data();
#if EMU_PATH_PAIRS  // no lists: a pair per gate_up block row, a token per down block (a warp per slot)
    (void)slots; (void)list_threads;
    launch(gu_blocks, GB_WARPS * 32,
           [&] { moe_gate_up_pair(x.data(), w13.data(), s13, ids.data(), inter.data(), H, I, E, K, T * K, g13, b13); });
    launch(dn_blocks, 32 * K, [&] {
        moe_down_token(inter.data(), w2.data(), s2, ids.data(), wts.data(), out.data(), f32, T, H, I, E, K, g2, b2);
    });
#else
    launch(1, list_threads, [&] { moe_expert_lists(ids.data(), T * K, E, slots, lists.data()); });
#if EMU_PATH_MMA
#define GATE_UP_KERNEL moe_gate_up_mma
#define DOWN_KERNEL moe_down_mma
#else
#define GATE_UP_KERNEL moe_gate_up_batched
#define DOWN_KERNEL moe_down_batched
#endif
    launch(gu_blocks, GB_WARPS * 32,
           [&] { GATE_UP_KERNEL(x.data(), w13.data(), s13, lists.data(), inter.data(), H, I, E, K, slots, T * K,
                                g13, b13); });
#if EMU_PATH_MMA && DB_GROUPED
    std::vector<float> pair_out((size_t)T * K * H, __uint_as_float(0x7fc00000u));
    launch(dn_blocks, DB_WARPS * 32, [&] {
        moe_down_grouped(inter.data(), w2.data(), s2, wts.data(), lists.data(), pair_out.data(), H, I, E, K, slots,
                         T * K, g2, b2);
    });
    launch((T * (H / 4) + 255) / 256, 256,
           [&] { moe_sum_slots(pair_out.data(), ids.data(), out.data(), f32, T, H, E, K); });
#else
    launch(dn_blocks, DB_WARPS * 32, [&] {
        DOWN_KERNEL(inter.data(), w2.data(), s2, ids.data(), wts.data(), lists.data(), out.data(), f32, T, H, I, E, K,
                    slots, g2, b2);
    });
#endif
#endif  // EMU_PATH_PAIRS
    save(dir + "/lists.bin", lists);
    save(dir + "/inter.bin", inter);
    out.resize(f32 ? out.size() : (out.size() + 1) / 2);
    FILE* f = fopen((dir + "/out.bin").c_str(), "wb");
    fwrite(out.data(), 1, (size_t)T * H * (f32 ? 4 : 2), f);
    fclose(f);
    return 0;
}
"""

# the strict kernel's gate_up alone, for the bitwise comparison of the intermediate
STRICT_GATE_UP_MAIN = r"""
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    long long gu_blocks = atoll(argv[6]);
    std::string dir = argv[7];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    auto w13 = load<uint16_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);
    launch(gu_blocks, GU_WARPS * 32,
           [&] { moe_gate_up_3d_batched(x.data(), w13.data(), ids.data(), inter.data(), T, H, I, E, K); });
    FILE* f = fopen((dir + "/inter.bin").c_str(), "wb");
    fwrite(inter.data(), 2, inter.size(), f);
    fclose(f);
    return 0;
}
"""


def _scale_mode(fmt: Any) -> int:
    """The harness's EMU_SCALED for ``fmt``: 0 unscaled, 1 fp8-block128's float32 block scales, 2 mxfp4's bytes, 3
    nvfp4's bytes and global scales."""
    return 0 if not fmt.scaled else {"mxfp4": 2, "nvfp4": 3}.get(fmt.name, 1)


def _harness(path: str, scaled: int) -> str:
    """EMULATION_HARNESS with its own macros for the family it emulates in front (its main launches that family's
    kernels and reads that format's weights: ``scaled``, :func:`_scale_mode`)."""
    if path not in STAGE_MODULES:
        raise ValueError(f"path must be one of {sorted(STAGE_MODULES)}, got {path!r}")
    own = [f"#define EMU_PATH_{name.upper()} {int(name == path)}" for name in STAGE_MODULES]
    return "\n".join([*own, f"#define EMU_SCALED {int(scaled)}", ""]) + EMULATION_HARNESS


def _write_inputs(tmp: str, problem: Problem, ids: np.ndarray | None) -> None:
    """The emulator's inputs; weights of another format (a Quantized w13 / w2) as their bytes and scales, if any."""
    problem.x.tofile(f"{tmp}/x.bin")
    for name in ("w13", "w2"):
        weights = getattr(problem, name)
        if isinstance(weights, Quantized):
            weights.values.view(np.uint8).tofile(f"{tmp}/{name}.bin")
            if weights.scales is not None:  # float32 block scales, or scale bytes (mxfp4's e8m0) as they are
                scales = weights.scales if weights.scales.itemsize == 1 else weights.scales.astype(np.float32)
                scales.tofile(f"{tmp}/{name.replace('w', 's')}.bin")
            if weights.global_scale is not None:  # nvfp4's float32 scale per expert
                np.asarray(weights.global_scale, np.float32).tofile(f"{tmp}/{name.replace('w', 'g')}.bin")
        else:
            weights.tofile(f"{tmp}/{name}.bin")
    np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
    problem.topk_weights.tofile(f"{tmp}/wts.bin")
    for name in ("b13", "b2"):  # the experts' biases, where the problem has them (read by a family with biases)
        if getattr(problem, name) is not None:
            np.ascontiguousarray(getattr(problem, name)).view(np.uint16).tofile(f"{tmp}/{name}.bin")


def _shared_floats(path: str, dims: Dims, params: dict[str, int]) -> int:
    """The dynamic shared memory the emulated launches need (floats): the list kernel's or the down's, the larger."""
    if path == "pairs":
        return 0  # static shared memory only
    down = (fma if path == "fma" else mma).down_shared_bytes(dims, params)
    return max(down, lists.lists_shared_bytes(dims, params)) // 4


def _resolve_with_derived(family: Any, dims: Dims, knobs: dict[str, Any]) -> dict[str, int]:
    """``family`` resolved for ``dims`` with ``knobs``, then the family's derived macros among ``knobs`` put over the
    rules' values (see _emulate)."""
    derived = {key: value for key, value in knobs.items() if key in family.derived}
    return {**family.resolve(dims, **{k: v for k, v in knobs.items() if k not in derived}), **derived}


def _emulate(problem: Problem, ids: np.ndarray | None = None, out_dtype: Any = BF16, *, path: str = "fma",
             model_layer: bool = False, **knobs: int) -> dict[str, Any]:
    """Run ``path``'s kernels ("fma", "mma" or "pairs") as CUDA C on the CPU with the CuPy path's geometry, on the
    family of the problem's weight format (a Quantized w13 names it, as for the entry point): out, intermediate,
    lists (untouched for "pairs") and params, the macros the kernels were rendered with.

    ``knobs`` are the family's; among them a derived macro of the family (GB_RANGE_FLUSH, DB_WHOLE_RANGES,
    FP8_LOAD16, FP8_PRMT, ...), which no caller of the library may set, overrides the rules' value after they ran:
    the emulation then compiles the other form of the same kernels at the same dims (0 is always a form that runs;
    1 only where the rules would pick it). ``model_layer``: the family of the problem's own layer (its shape's
    activation and the problem's biases, ``Problem.layer``), else the contract's."""
    dims = _dims(problem)
    fmt = get_format(format_of(problem.w13))
    layer = expert_layer(**problem.layer) if model_layer else CONTRACT_LAYER
    family = batched.family(path, fmt.name, layer)
    resolved = _resolve_with_derived(family, dims, knobs)
    binary = build_emulator(family.source.render(**resolved), _harness(path, _scale_mode(fmt)))
    f32 = int(np.dtype(out_dtype) == np.float32)
    stages = STAGE_MODULES[path]
    with tempfile.TemporaryDirectory() as tmp:
        _write_inputs(tmp, problem, ids)
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k, f32,
                     stages.gate_up_blocks(dims, resolved), stages.down_blocks(dims, resolved), lists.slots(dims),
                     lists.lists_size(dims), resolved.get("LIST_THREADS", 0), _shared_floats(path, dims, resolved),
                     tmp)
        raw = np.fromfile(f"{tmp}/out.bin", np.float32 if f32 else np.uint16)
        inter = np.fromfile(f"{tmp}/inter.bin", np.uint16).reshape(dims.tokens, dims.top_k, dims.intermediate)
        raw_lists = np.fromfile(f"{tmp}/lists.bin", np.int32)
    out = raw.reshape(dims.tokens, dims.hidden) if f32 else raw.view(BF16).reshape(dims.tokens, dims.hidden)
    return {"out": out, "inter": inter, "lists": raw_lists, "params": resolved}


def _emulate_strict_gate_up(problem: Problem, ids: np.ndarray | None = None, **params: int) -> np.ndarray:
    dims = _dims(problem)
    resolved = wdc.resolve_params(dims, **params)
    harness = EMULATION_HARNESS[: EMULATION_HARNESS.index("int main(")] + STRICT_GATE_UP_MAIN
    binary = build_emulator(wdc.SOURCE.render(**resolved), harness)
    warps = dims.tokens * dims.top_k * -(-dims.intermediate // resolved["GU_OUTS"])
    with tempfile.TemporaryDirectory() as tmp:
        _write_inputs(tmp, problem, ids)
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k,
                     -(-warps // resolved["GU_WARPS"]), tmp)
        return np.fromfile(f"{tmp}/inter.bin", np.uint16).reshape(dims.tokens, dims.top_k, dims.intermediate)


DUP_IDS = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]]  # tiny (K = 2): duplicate ids in a token
K40 = MoEShape("h16-i8-k40", 16, 8, 44, 40)
EMULATED = [  # (shape, T, routing, path, knobs, also fp32 out); small: ~1 ms per warp on 2 cores
    ("tiny", 3, "uniform", "fma", {}, True),
    ("tiny", 6, DUP_IDS, "fma", {"GB_TILE": 1, "DB_TILE": 1}, False),
    ("tiny", 5, "same", "fma", {"GB_TILE": 2, "DB_TILE": 3, "GB_OUTS": 3, "DB_OUTS": 3, "DB_WARPS": 3}, False),
    ("tiny", 4, "zipf", "fma", {"DB_UNROLL": 2, "GB_UNROLL": 1}, False),
    # 280 pairs: the list kernel's 8 warps rank 64 / 64 / 64 / 64 / 24 pairs each, hot experts spanning the ranges
    (K40, 7, "zipf", "fma", {}, False),
    (MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", "fma", {}, True),
    (MoEShape("h264-i40", 264, 40, 3, 2), 4, "zipf", "fma", {"GB_BYTES": 16, "GB_UNROLL": 1, "DB_OUTS": 5}, False),
    (MoEShape("h64-k40", 64, 24, 44, 40), 2, "uniform", "fma", {"GB_BYTES": 4, "GB_OUTS": 4}, False),
    # E = 300: two experts per list thread (LIST_PER 2), most of them idle
    (MoEShape("h16-i8-e300", 16, 8, 300, 4), 5, "zipf", "fma", {}, False),
]


# H = 200, I = 136: several k rounds per row with masked tails, a partial last down block, several experts per warp
MULTI_SHAPE = MoEShape("h200-i136", 200, 136, 5, 3)
EMULATED += [
    # the tensor-core family: masked k tails (25 / 17 chunks), experts with more than 8 pairs (two tiles), 16 columns
    # per block over H = 200 (a partial last block), duplicate ids in a token; the balanced down's (tile, k block)
    # runs over 2 / 3 warps start and end inside tiles (partial k ranges)
    (MULTI_SHAPE, 9, "zipf", "mma", {"GB_WARPS": 2, "DB_WARPS": 2, "GB_UNROLL": 2, "DB_UNROLL": 3,
                                     "DB_GROUPED": 0}, True),
    (MULTI_SHAPE, 12, "same", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, True),  # 12 pairs an expert: tiles 8 + 4
    ("tiny", 6, DUP_IDS, "mma", {"DB_GROUPED": 0}, False),
    # HOT_NBLK 2: tiles of up to 16 pairs, a hot one in ONE gate_up pass of two 8-pair blocks (the balanced down's runs
    # over them)
    (MULTI_SHAPE, 14, "zipf", "mma", {"DB_GROUPED": 0, "HOT_NBLK": 2, "DB_WARPS": 4}, False),
    # HOT_NBLK 3: tiles of up to 24 pairs, each (12 pairs) in one pass of three 8-pair blocks, the last empty
    (MULTI_SHAPE, 12, "same", "mma", {"DB_GROUPED": 0, "HOT_NBLK": 3, "DB_WARPS": 3}, False),
    # the grouped down: one block row per tile, per-pair rows, the slot-order sum; partial 16-row groups over
    # H = 200, tiles of 8 and 16 pairs (hot two-block passes in the gate_up and the down), duplicate ids in a token;
    # auto GB_SHARE 4 (T*K >= 2E, bf16): an expert's tiles in groups (of 2 in the T = 12 "same" cases, of 4 here)
    # share each round's A fragments; DB_SHARE 4 likewise in the grouped down where its warps divide (4, not 3)
    (MULTI_SHAPE, 25, "same", "mma", {"DB_GROUPED": 1, "DB_WARPS": 3}, True),  # 4 tiles an expert: a group of 4
    (MULTI_SHAPE, 9, "zipf", "mma", {"DB_GROUPED": 1, "HOT_NBLK": 2, "GB_UNROLL": 2}, True),
    ("tiny", 6, DUP_IDS, "mma", {}, False),  # the defaults: grouped (T*K >= 2E), GB_SHARE 4
    # the per-pair family (no lists, a pair per gate_up block row, a token per down block): one k chain, partial
    # 16-row groups over H = 200, duplicate ids in a token, a k tail; pair-major and pairs-inner block orders
    (MULTI_SHAPE, 6, "same", "pairs", {"GB_KSPLIT": 1, "GB_WARPS": 2, "PAIRS_INNER": 0}, True),
    ("tiny", 6, DUP_IDS, "pairs", {"GB_KSPLIT": 1, "GB_WARPS": 4, "DB_UNROLL": 2}, False),
    (MULTI_SHAPE, 6, "same", "pairs", {"GB_KSPLIT": 1, "GB_WARPS": 2, "PAIRS_INNER": 1}, True),
    # GB_KSPLIT: the gate_up's k chains in 4 ranges over 25 chunks (8, 8, 8, 1), a warp per range (the grouped path's
    # ranges in one warp: test_split_k_forms_agree_and_are_batch_invariant_emulated), both block orders
    (MULTI_SHAPE, 6, "same", "pairs", {"GB_KSPLIT": 4, "GB_WARPS": 4, "PAIRS_INNER": 0}, False),
    (MULTI_SHAPE, 5, "zipf", "pairs", {"GB_KSPLIT": 4, "GB_WARPS": 4, "PAIRS_INNER": 1}, False),
]


EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{c[3]}-{i}" for i, c in enumerate(EMULATED)]


def test_emulation_cases_run_what_they_name() -> None:
    """The emulated cases' knobs resolve to the forms their comments name (a rule change would quietly move them)."""
    def resolved(index: int) -> dict[str, int]:
        shape, tokens, _, path, knobs, _ = EMULATED[index]
        shape = PRESETS[shape] if isinstance(shape, str) else shape
        return _resolve(path, Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k), **knobs)

    forms = {EMULATED_IDS[i]: resolved(i) for i in range(len(EMULATED))}
    assert forms[EMULATED_IDS[8]]["LIST_PER"] == 2
    mma_cases = {name: r for name, r in forms.items() if "-mma-" in name}
    assert [(r["DB_GROUPED"], r["HOT_NBLK"], r["GB_SHARE"], r["DB_SHARE"]) for r in mma_cases.values()] == [
        (0, 0, 0, 0), (0, 0, 4, 0), (0, 0, 4, 0), (0, 2, 4, 0), (0, 3, 4, 0), (1, 0, 4, 0), (1, 2, 4, 4), (1, 0, 4, 4)]
    pair_cases = [r for name, r in forms.items() if "-pairs-" in name]
    assert [(r["GB_KSPLIT"], r["PAIRS_INNER"]) for r in pair_cases] == [(1, 0), (1, 1), (1, 1), (4, 0), (4, 1)]


# the quick subset: the FMA family's defaults (bf16 and fp32 out) and the tensor-core family on the tiny preset with
# duplicate ids (the balanced down, and the defaults: the grouped down); the rest (every family's forms, odd shapes,
# the list kernel's warps) is slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "path", "knobs", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0, 11, 16}))
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any, path: str,
                                     knobs: dict[str, int], fp32: bool) -> None:
    """The real kernel text: lists vs the NumPy model, out vs the reference, the FMA intermediate vs the strict
    kernel's."""
    problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    dims = _dims(problem)
    got = _emulate(problem, path=path, **knobs)
    if path != "pairs":  # the per-pair family writes no lists
        _assert_lists_equal(_unpack_lists(got["lists"], dims),
                            expert_lists_numpy(problem.topk_ids, dims.experts, _tile_pairs(dims, knobs, path)))
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    own_order = path != "fma"
    _assert_matches(got["out"], faithful, oracle, f"emulated {problem.shape.name} {path} {knobs}", own_order=own_order)
    if path == "fma":  # the tensor core sums in its own order: compared through the output only
        resolved = _resolve(path, dims, **knobs)
        strict = _emulate_strict_gate_up(problem, GU_BYTES=resolved["GB_BYTES"], GU_UNROLL=1)
        assert np.array_equal(got["inter"], strict), "intermediate differs from the strict kernel's"
    if fp32:
        got32 = _emulate(problem, out_dtype=np.float32, path=path, **knobs)["out"]
        faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, f"emulated fp32 out {problem.shape.name} {path}",
                        own_order=own_order)


@pytest.mark.parametrize(("path", "knobs"), [
    pytest.param("fma", {"GB_TILE": 2, "DB_TILE": 2}, id="fma"),
    pytest.param("mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, id="mma-balanced", marks=pytest.mark.slow),
    pytest.param("mma", {"DB_GROUPED": 1}, id="mma-grouped", marks=pytest.mark.slow),
    pytest.param("pairs", {"GB_KSPLIT": 1}, id="pairs-one-chain", marks=pytest.mark.slow),
    pytest.param("pairs", {}, id="pairs-split-chains", marks=pytest.mark.slow)])
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator, path: str, knobs: dict[str, int]) -> None:
    """Out-of-range ids reach the kernels (as under capture): those tokens' rows NaN, the others exact."""
    problem = make_problem("tiny", 5, seed=_seed(rng))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -3
    ids[2, 1] = 2**31 - 1
    got = _emulate(problem, ids=ids, path=path, **knobs)
    assert np.all(np.isnan(got["out"][[0, 2]].astype(np.float32)))
    dims = _dims(problem)
    if path != "pairs":
        _assert_lists_equal(_unpack_lists(got["lists"], dims),
                            expert_lists_numpy(ids, problem.shape.experts, _tile_pairs(dims, knobs, path)))
    inter = got["inter"]
    assert np.all(inter[0, 1] == 0x7FC0) and np.all(inter[2] == 0x7FC0)  # bad pairs: NaN intermediate
    good = [1, 3, 4]
    sub = Problem(problem.shape, 3, 0, "fixed", problem.x[good], problem.w13, problem.w2, problem.topk_ids[good],
                  problem.topk_weights[good])
    _assert_matches(got["out"][good], moe_decode(*sub.arrays, mode="warp_decode"),
                    moe_decode(*sub.arrays, mode="fp64"), "emulated good tokens", own_order=path != "fma")


T16_SHAPE = MoEShape("h96-i64", 96, 64, 6, 2)  # 32-value tiles: 3 k blocks along H, 2 along I
T16_WIDE = MoEShape("h512-i32", 512, 32, 6, 2)  # 8 k ranges of 2 k blocks each (the invariant pair's split chains)
T16_EMULATED = [  # (shape, T, routing, path, knobs): the tensor-core forms that read bf16-t16 tiles
    (T16_SHAPE, 3, "uniform", "pairs", {}),
    (T16_SHAPE, 12, "zipf", "mma", {"HOT_NBLK": 2, "DB_GROUPED": 1}),   # hot passes, the grouped down
    (T16_SHAPE, 6, "same", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3, "DB_UNROLL": 1}),   # runs cut inside rows
    (T16_WIDE, 9, "zipf", "mma", {**GROUPED, "GB_UNROLL": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "path", "knobs"), T16_EMULATED,
                         ids=["pairs", "hot-grouped", "balanced", "invariant-grouped"])
def test_bf16_tiles_emulated(shape: MoEShape, tokens: int, routing: Any, path: str, knobs: dict[str, int]) -> None:
    """bf16-t16 (the tensor-core families' bf16-t16 loader): the same bf16 values in 16-row x 32-value tiles give the
    row layout's bits in every tensor-core form -- only the addresses move -- and the reference reads the tiles
    back."""
    base = make_problem(shape, tokens, seed=tokens, routing=routing)
    t13, t2 = quantize_weights(base.w13, base.w2, BF16_T16.name)
    assert (t13.layout, t13.scales, t13.values.dtype) == ("t16", None, BF16)
    tiled = dataclasses.replace(base, w13=t13, w2=t2)
    want = _emulate(base, out_dtype=np.float32, path=path, **knobs)
    got = _emulate(tiled, out_dtype=np.float32, path=path, **knobs)  # the tiles' family: format_of(w13)
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32))
    assert np.array_equal(moe_decode(*tiled.arrays, weight_format=BF16_T16.name).view(np.uint16),
                          moe_decode(*base.arrays).view(np.uint16))


def test_bf16_tiles_refused_where_they_cannot_run() -> None:
    """bf16-t16 weights: the tensor-core families need H and I multiples of 32; the FMA family has no loader for
    them; the tiles' families resolve as the row layout's."""
    for path in ("mma", "pairs"):
        with pytest.raises(ValueError, match="bf16-t16 holds 32-value tiles: H and I must be multiples of 32"):
            _resolve(path, Dims(2, 48, 64, 4, 2), BF16_T16.name)
        assert _resolve(path, Dims(2, 64, 64, 4, 2), BF16_T16.name) == _resolve(path, Dims(2, 64, 64, 4, 2))
    with pytest.raises(ValueError, match=r"no fma loader for weight format 'bf16-t16'; formats with one: \['bf16', "
                                         r"'fp8-block128', 'mxfp4', 'nvfp4'\]"):
        batched.family("fma", BF16_T16.name)


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------


def _poison(cupy: Any, ws: Workspace) -> None:
    ws.intermediate.view(cupy.uint16).fill(0x7FC0)
    if ws.lists is not None:  # the per-pair family has none
        ws.lists.fill(-7)
    if ws.pair_out is not None:
        ws.pair_out.fill(cupy.nan)


def _poisoned_workspace(cupy: Any, dims: Dims, path: str = "fma", weight_format: str = BF16_NAME,
                        **knobs: Any) -> Workspace:
    ws = batched.make_workspace(dims, path, weight_format, **knobs)
    _poison(cupy, ws)
    return ws


def _run_and_check(cupy: Any, problem: Problem, what: str, out_dtype: Any = BF16, strict_inter: bool = False,
                   path: str = "fma", **knobs: Any) -> np.ndarray:
    """``path`` with ``knobs`` on the problem's (bf16) weights into a NaN-poisoned output and workspace: the lists
    against the NumPy model, the FMA intermediate against the strict kernel's (``strict_inter``), the output against
    the references."""
    dims = _dims(problem)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden, out_dtype)
    ws = _poisoned_workspace(cupy, dims, path, **knobs)
    returned = batched.warp_decode_batched(*problem.arrays, out=out, workspace=ws, path=path, **knobs)
    assert returned is out
    cupy.cuda.runtime.deviceSynchronize()
    got = cupy.asnumpy(out)
    if path != "pairs":
        _assert_lists_equal(_unpack_lists(cupy.asnumpy(ws.lists), dims),
                            expert_lists_numpy(cupy.asnumpy(problem.topk_ids), dims.experts,
                                               _tile_pairs(dims, knobs, path)))
    if strict_inter:
        assert path == "fma", "only the FMA gate_up gives the strict kernel's intermediate"
        resolved = _resolve(path, dims, **knobs)
        strict = wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate)
        wdc.gate_up(problem.x, problem.w13, problem.topk_ids, strict, GU_BYTES=resolved["GB_BYTES"])
        cupy.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy.asnumpy(ws.intermediate.view(cupy.uint16)),
                              cupy.asnumpy(strict.view(cupy.uint16))), f"{what}: intermediate != strict's"
    faithful, oracle = _references(problem, out_dtype)
    _assert_matches(got, faithful, oracle, what, own_order=path != "fma")
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("model", list(PRESETS))
def test_presets(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int) -> None:
    problem = make_problem(model, tokens, seed=_seed(rng), routing="uniform", xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{model} T={tokens}", strict_inter=True)
    del problem


# the tensor-core family's down both ways, and what cupy:warp-decode-mma runs (auto: balanced below T*K = 2E)
MMA_UNITS = {"auto": {}, "balanced": {"DB_GROUPED": 0}, "grouped": {"DB_GROUPED": 1}}
MMA_CASES = [("qwen3-30b-a3b", 1, "uniform"), ("qwen3-30b-a3b", 37, "uniform"), ("qwen3-30b-a3b", 64, "zipf"),
             ("qwen3-30b-a3b", 64, "uniform"),
             ("qwen3-235b-a22b", 16, "uniform"), ("mixtral-8x7b", 8, "uniform"), ("qwen3-30b-a3b", 6, "same")]


@pytest.mark.gpu
@pytest.mark.parametrize("units", list(MMA_UNITS))
@pytest.mark.parametrize(("model", "tokens", "routing"), MMA_CASES)
def test_mma_kernels(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int, routing: str,
                     units: str) -> None:
    """The tensor-core family (the balanced or the grouped down over the tile table) against the references
    (NaN-poisoned buffers), then bitwise over two more runs."""
    knobs = MMA_UNITS[units]
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
    first = _run_and_check(cupy_mod, problem, f"mma {model} T={tokens} {routing} {units}", path="mma", **knobs)
    for _ in range(2):
        out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
        batched.warp_decode_batched(*problem.arrays, out=out, path="mma", **knobs)
        cupy_mod.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy_mod.asnumpy(out).view(np.uint16), first.view(np.uint16))


def form_cases(cases: list[tuple]) -> list[Any]:
    """(model, tokens, routing, form) cases as pytest params named model-tokens-routing-form."""
    return [pytest.param(*case, id=f"{getattr(case[0], 'name', case[0])}-{case[1]}-{case[2]}-{case[3]}")
            for case in cases]


INVARIANT_FORMS = {"pairs": ("pairs", {}), "grouped": ("mma", GROUPED)}  # the batch-invariant policy's two forms
INVARIANT_CASES = [  # the batch-invariant policy's two forms where it runs them, and an odd shape each
    ("qwen3-30b-a3b", 1, "uniform", "pairs"), ("qwen3-235b-a22b", 2, "zipf", "pairs"),
    ("qwen3-30b-a3b", 2, "same", "pairs"), (MULTI_SHAPE, 3, "zipf-2", "pairs"), ("qwen3-30b-a3b", 8, "zipf", "grouped"),
    ("qwen3-235b-a22b", 64, "uniform", "grouped"), (MULTI_SHAPE, 9, "correlated", "grouped")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "form"), form_cases(INVARIANT_CASES))
def test_invariant_knob_sets(cupy_mod: Any, rng: np.random.Generator, model: Any, tokens: int, routing: str,
                             form: str) -> None:
    """The per-pair family and the grouped path (their GB_KSPLIT ranges included) against the references
    (NaN-poisoned output), then bitwise over a second run."""
    path, knobs = INVARIANT_FORMS[form]
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
    runs = []
    for _ in range(2):
        out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
        batched.warp_decode_batched(*problem.arrays, out=out, path=path, **knobs)
        cupy_mod.cuda.runtime.deviceSynchronize()
        runs.append(cupy_mod.asnumpy(out))
    faithful, oracle = _references(problem)
    _assert_matches(runs[0], faithful, oracle, f"invariant {form} {problem.shape.name} T={tokens} {routing}",
                    own_order=True)
    assert np.array_equal(runs[1].view(np.uint16), runs[0].view(np.uint16))


SKEWED_PATHS = {"fma": ("fma", {}), "mma-balanced": ("mma", {"DB_GROUPED": 0}), "mma-grouped": ("mma", GROUPED),
                "pairs": ("pairs", {})}


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["zipf-1", "zipf-2", "correlated", "same"])
@pytest.mark.parametrize("form", list(SKEWED_PATHS))
def test_batched_paths_under_skewed_routings(cupy_mod: Any, rng: np.random.Generator, routing: str, form: str) -> None:
    """Every batched path under the routings that stand for real routers (kernels.routing.GENERATORS): a hot
    expert's many pairs, a batch sharing most of its experts, all tokens on one set."""
    path, knobs = SKEWED_PATHS[form]
    problem = make_problem("qwen3-30b-a3b", 32, seed=_seed(rng), routing=routing, xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{form} qwen3-30b T=32 {routing}", strict_inter=path == "fma", path=path,
                   **knobs)


MMA_ODD_KNOBS = [  # (T, knobs) of the tensor-core family on every odd shape
    (5, {}), (37, {"HOT_NBLK": 2, "GB_UNROLL": 8, "DB_UNROLL": 2, "DB_GROUPED": 0}), (37, {"DB_GROUPED": 0}),
    (37, {"DB_GROUPED": 0, "HOT_NBLK": 2, "DB_WARPS": 5}), (37, {"DB_GROUPED": 1, "HOT_NBLK": 2, "DB_WARPS": 3})]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ODD_SHAPES))
def test_mma_odd_shapes(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    for tokens, knobs in MMA_ODD_KNOBS:
        problem = make_problem(ODD_SHAPES[name], tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"mma {name} T={tokens} {knobs}", path="mma", **knobs)
    if ODD_SHAPES[name].top_k <= 16:  # the per-pair down: a warp per slot
        problem = make_problem(ODD_SHAPES[name], 5, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"pairs {name} T=5", path="pairs")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("name", list(ODD_SHAPES))
def test_odd_shapes(cupy_mod: Any, rng: np.random.Generator, name: str, tokens: int) -> None:
    problem = make_problem(ODD_SHAPES[name], tokens, seed=_seed(rng), xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{name} T={tokens}", strict_inter=True)


T16_GPU_CASES = [  # (model, T, routing, form): bf16-t16 tiles in the three tensor-core forms
    ("qwen3-30b-a3b", 1, "uniform", "pairs"), ("qwen3-235b-a22b", 3, "zipf-2", "pairs"),
    ("qwen3-30b-a3b", 8, "zipf", "mma"), ("qwen3-30b-a3b", 64, "zipf", "mma"), ("qwen3-235b-a22b", 32, "same", "mma"),
    ("qwen3-235b-a22b", 8, "correlated", "mma"), ("qwen3-30b-a3b", 16, "zipf", "grouped"),
    ("qwen3-235b-a22b", 64, "uniform", "grouped"), (MoEShape("h160-i96", 160, 96, 5, 3), 9, "zipf-1", "grouped")]
T16_FORMS = {"pairs": ("pairs", {}, "cupy:warp-decode-mma-pairs-t16"),
             "mma": ("mma", {}, "cupy:warp-decode-mma-t16"),
             "grouped": ("mma", GROUPED, "cupy:warp-decode-mma-grouped-t16")}


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "form"), form_cases(T16_GPU_CASES))
def test_bf16_tiles(cupy_mod: Any, rng: np.random.Generator, model: Any, tokens: int, routing: str,
                    form: str) -> None:
    """bf16-t16 weights (tiled on the device) against the references (NaN-poisoned output and workspace), bitwise
    equal to the same knobs on the row layout, over a repeat and over a CUDA-graph replay of the variant."""
    from kernels.variants import get_variant

    cupy = cupy_mod
    path, knobs, name = T16_FORMS[form]
    variant = get_variant(name)
    assert (variant.weight_format, batched.PATHS[name]) == (BF16_T16.name, (path, knobs))
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy)
    tiled = dataclasses.replace(problem, **dict(zip(("w13", "w2"), BF16_T16.from_rows(problem.w13, problem.w2),
                                                    strict=True)))
    dims = _dims(problem)
    runs = []
    for _ in range(2):
        out = _poisoned_out(cupy, tokens, dims.hidden)
        ws = _poisoned_workspace(cupy, dims, path, BF16_T16.name, **knobs)
        batched.warp_decode_batched(*tiled.arrays, out=out, workspace=ws, path=path, **knobs)
        cupy.cuda.runtime.deviceSynchronize()
        runs.append(cupy.asnumpy(out))
    faithful, oracle = _references(problem)
    _assert_matches(runs[0], faithful, oracle, f"bf16-t16 {form} {dims}", own_order=True)
    assert np.array_equal(runs[1].view(np.uint16), runs[0].view(np.uint16))
    on_rows = batched.warp_decode_batched(*problem.arrays, path=path, **knobs)
    assert np.array_equal(cupy.asnumpy(on_rows).view(np.uint16), runs[0].view(np.uint16)), "tiles != rows"
    assert_graph_replays_bitwise(cupy, variant.make(dims), tiled, runs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routings(cupy_mod: Any, rng: np.random.Generator, routing: str) -> None:
    for model, ids in zip(("tiny", "qwen3-30b-a3b"), ROUTINGS[routing], strict=True):
        problem = make_problem(model, 6, seed=_seed(rng), routing=ids, xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{model} routing {routing}", strict_inter=True)
    ids = ROUTINGS[routing][1]
    if routing == "fixed-per-token":  # [6, K] ids: repeat them over 64 tokens
        ids = np.resize(np.asarray(ids, np.int32), (64, QWEN30.top_k))
    problem = make_problem("qwen3-30b-a3b", 64, seed=_seed(rng), routing=ids, xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"qwen3-30b T=64 routing {routing}")  # "same": 8 passes of 8 pairs
    _run_and_check(cupy_mod, problem, f"mma qwen3-30b T=64 routing {routing}", path="mma")  # "same": 8 tiles an expert


@pytest.mark.gpu
def test_float32_out(cupy_mod: Any, rng: np.random.Generator) -> None:
    for model, tokens in (("tiny", 3), ("qwen3-30b-a3b", 4)):
        problem = make_problem(model, tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        for path in batched.FAMILIES:
            _run_and_check(cupy_mod, problem, f"{model} {path} fp32 out", out_dtype=np.float32, path=path)


@pytest.mark.gpu
def test_bitwise_identical_over_three_runs(cupy_mod: Any, rng: np.random.Generator) -> None:
    for shape, tokens in ((PRESETS["qwen3-30b-a3b"], 64), (ODD_SHAPES["h264-i40"], 5)):
        problem = make_problem(shape, tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        for path in batched.FAMILIES:
            results = []
            for _ in range(3):
                out = _poisoned_out(cupy_mod, tokens, shape.hidden)
                batched.warp_decode_batched(*problem.arrays, out=out, path=path)
                cupy_mod.cuda.runtime.deviceSynchronize()
                results.append(cupy_mod.asnumpy(out).view(np.uint16))
            assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2]), path


@pytest.mark.gpu
def test_out_of_range_ids_raise_outside_capture(cupy_mod: Any, rng: np.random.Generator) -> None:
    problem = make_problem("tiny", 3, seed=_seed(rng), xp=cupy_mod)
    for bad in (problem.shape.experts, -1):
        ids = problem.topk_ids.copy()
        ids[1, 0] = bad
        for path in batched.FAMILIES:
            with pytest.raises(ValueError, match="topk_ids"):
                batched.warp_decode_batched(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, path=path)


@pytest.mark.gpu
def test_entry_point_refuses_a_workspace_it_cannot_use(cupy_mod: Any, rng: np.random.Generator) -> None:
    """A workspace of other dims, of no make_workspace, without the per-pair rows the grouped down writes or without
    the lists a listed path reads: ValueError / TypeError naming what is missing, before any launch."""
    problem = make_problem("tiny", 3, seed=_seed(rng), xp=cupy_mod)
    dims = _dims(problem)
    other = batched.make_workspace(dataclasses.replace(dims, tokens=4))
    with pytest.raises(ValueError, match="workspace was made for"):
        batched.warp_decode_batched(*problem.arrays, workspace=other)
    with pytest.raises(TypeError, match="workspace must come from kernels.batched.make_workspace"):
        batched.warp_decode_batched(*problem.arrays, workspace=object())
    balanced = batched.make_workspace(dims, "mma", DB_GROUPED=0)
    with pytest.raises(ValueError, match="workspace has no per-pair rows"):
        batched.warp_decode_batched(*problem.arrays, workspace=balanced, path="mma", DB_GROUPED=1)
    with pytest.raises(ValueError, match="workspace has no lists buffer, which path 'fma' needs"):
        batched.warp_decode_batched(*problem.arrays, workspace=batched.make_workspace(dims, "pairs"))
    with pytest.raises(ValueError, match=r"unknown warp-decode-pairs parameter\(s\) \['DB_WARPS'\]"):
        batched.warp_decode_batched(*problem.arrays, path="pairs", DB_WARPS=4)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(batched.FAMILIES))
def test_bad_ids_in_kernel_give_nan_rows(cupy_mod: Any, rng: np.random.Generator, path: str) -> None:
    """Stages launched directly (no value checks, as under capture): bad tokens NaN, the rest still exact."""
    cupy = cupy_mod
    for shape, tokens in ((PRESETS["tiny"], 4), (ODD_SHAPES["h64-k40"], 3), (PRESETS["qwen3-30b-a3b"], 9)):
        if path == "pairs" and shape.top_k > 16:
            continue  # the per-pair down: a warp per slot, K <= 16
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy)
        ids = problem.topk_ids.copy()
        ids[0, -1] = shape.experts
        ids[2, 0] = -7
        ids[2, -1] = 2**31 - 1
        dims = _dims(problem)
        launch = batched.family(path).build(dims)
        out = _poisoned_out(cupy, tokens, shape.hidden)
        launch(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, out)
        cupy.cuda.runtime.deviceSynchronize()
        got = cupy.asnumpy(out).astype(np.float32)
        assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[2]))
        good = [t for t in range(tokens) if t not in (0, 2)]
        sub = Problem(shape, len(good), 0, "fixed", problem.x[good], problem.w13, problem.w2,
                      problem.topk_ids[good], problem.topk_weights[good])
        faithful, oracle = _references(sub)
        _assert_matches(cupy.asnumpy(out)[good], faithful, oracle, f"{path}: good tokens beside bad ids",
                        own_order=path != "fma")


def _capture_and_replay(cupy: Any, problem: Problem, launch: Any, what: str, own_order: bool = False) -> None:
    dims = _dims(problem)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch(*problem.arrays, out)  # compile outside the capture
        stream.synchronize()
        out.view(cupy.uint16).fill(0x7FC0)
        stream.synchronize()
        stream.begin_capture()
        launch(*problem.arrays, out)
        graph = stream.end_capture()
        assert bool(np.all(np.isnan(cupy.asnumpy(out).astype(np.float32))))  # capture launched nothing
        graph.launch(stream)
        stream.synchronize()
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{what}: graph replay", own_order=own_order)
    # new routing (other experts, other counts) written into the same buffers, same graph
    with stream:  # on the replay's stream: a non-blocking stream does not wait for the legacy default stream
        write_fresh_inputs(cupy, problem, problem.seed + 1)
        out.view(cupy.uint16).fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{what}: graph replay on new routing", own_order=own_order)


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "variant_name"), [("fma", "cupy:warp-decode-batched"),
                                                    ("mma", "cupy:warp-decode-mma"),
                                                    ("pairs", "cupy:warp-decode-mma-pairs")])
def test_graph_capture(cupy_mod: Any, rng: np.random.Generator, path: str, variant_name: str) -> None:
    from kernels.variants import get_variant

    cupy = cupy_mod
    for tokens in (4, 33):
        problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
        dims = _dims(problem)
        ws = _poisoned_workspace(cupy, dims, path)

        def launch(x: Any, w13: Any, w2: Any, ids: Any, wts: Any, out: Any, ws: Any = ws) -> None:
            batched.warp_decode_batched(x, w13, w2, ids, wts, out=out, workspace=ws, path=path)

        # every path under OWN_ORDER here: the FMA down sums a token's slots in its own order too (by warp, then by
        # expert), which with the intermediate's rare rounding flips against the reference's SiLU moved one element
        # 1.4 x the exact-order bound at T = 33 on the H200; this test is about the graph, the numerics have their own
        _capture_and_replay(cupy, problem, launch, f"{path} entry point T={tokens}", True)
        _capture_and_replay(cupy, problem, get_variant(variant_name).make(dims), f"{variant_name} T={tokens}", True)


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "knobs", "stage_names"), [
    ("fma", {}, ["expert_lists", "gate_up", "down"]),
    ("mma", {"DB_GROUPED": 0}, ["expert_lists", "gate_up", "down"]),
    ("mma", {"DB_GROUPED": 1}, ["expert_lists", "gate_up", "down", "sum"]),
    ("pairs", {}, ["gate_up", "down"])])
def test_stages_and_variant_match_the_entry_point(cupy_mod: Any, rng: np.random.Generator, path: str,
                                                  knobs: dict[str, int], stage_names: list[str]) -> None:
    cupy = cupy_mod
    problem = make_problem(ODD_SHAPES["h264-i40"], 7, seed=_seed(rng), xp=cupy)
    dims = _dims(problem)
    expected = cupy.asnumpy(batched.warp_decode_batched(*problem.arrays, path=path, **knobs)).view(np.uint16)
    launches = [batched.family(path).build(dims, **knobs)] + ([batched.VARIANT.make(dims)] if path == "fma" else [])
    for launch in launches:
        out = _poisoned_out(cupy, dims.tokens, dims.hidden)
        launch(*problem.arrays, out)
        cupy.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)
        out = _poisoned_out(cupy, dims.tokens, dims.hidden)
        stages = launch.stages(*problem.arrays, out)
        assert [name for name, _ in stages] == stage_names
        for _, fn in stages:
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)


GRID_SAMPLE = [  # (path, knobs)
    ("fma", {"GB_OUTS": 1, "DB_OUTS": 2, "GB_TILE": 2, "DB_TILE": 2}),
    ("fma", {"GB_OUTS": 3, "GB_UNROLL": 1, "DB_OUTS": 3, "DB_UNROLL": 3, "GB_TILE": 3, "DB_TILE": 5}),
    ("fma", {"GB_BYTES": 16, "GB_UNROLL": 2, "DB_UNROLL": 4}),
    ("fma", {"GB_BYTES": 4, "GB_WARPS": 1, "DB_WARPS": 1}),
    ("fma", {"GB_WARPS": 8, "DB_WARPS": 4, "GB_MAX_REGS": 0, "DB_MAX_REGS": 0, "DB_OUTS": 8}),
    ("fma", {"DB_TILE": 8, "GB_TILE": 8}),
    ("fma", {"PDL": 0, "DB_WARPS": 2}),
    ("mma", {"DB_GROUPED": 0, "DB_WARPS": 24, "DB_UNROLL": 2, "DB_MAX_REGS": 0}),
    ("mma", {"DB_GROUPED": 0, "DB_UNROLL": 2}),
    ("mma", {"DB_GROUPED": 0, "PDL": 0}),
    ("mma", {"DB_GROUPED": 0, "HOT_NBLK": 2, "GB_WARPS": 2}),
    ("mma", {"HOT_NBLK": 2}),
    ("mma", {"DB_GROUPED": 1, "PDL": 0, "DB_WARPS": 8}),
    ("mma", {"DB_GROUPED": 1, "HOT_NBLK": 2, "DB_UNROLL": 2}),
    ("mma", {"DB_GROUPED": 1, "HOT_NBLK": 2, "GB_HOT_UNROLL": 2, "DB_HOT_UNROLL": 1, "DB_ROW_TILES": 2}),
    ("mma", {"DB_GROUPED": 1, "GB_KSPLIT": 4, "GB_UNROLL": 1, "GB_SHARE": 2}),
    ("pairs", {"GB_KSPLIT": 1, "GB_WARPS": 4, "PAIRS_INNER": 0}),
    ("pairs", {"GB_KSPLIT": 2, "GB_WARPS": 4, "GB_UNROLL": 1, "DB_UNROLL": 2, "PDL": 0}),
]
GRID_SHAPES = ((ODD_SHAPES["h264-i40"], 5), (ODD_SHAPES["h64-k40"], 2), (PRESETS["qwen3-30b-a3b"], 19))


def _grid_points() -> list[tuple[MoEShape, int, str, dict[str, int]]]:
    """GRID_SAMPLE on GRID_SHAPES, each point where its family runs the shape (the per-pair down: K <= 16)."""
    return [(shape, tokens, path, knobs) for path, knobs in GRID_SAMPLE for shape, tokens in GRID_SHAPES
            if path != "pairs" or shape.top_k <= 16]


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "params"), GRID_SAMPLE,
                         ids=lambda p: p if isinstance(p, str) else ",".join(f"{k}={v}" for k, v in p.items()))
def test_knobs_keep_results(cupy_mod: Any, rng: np.random.Generator, path: str, params: dict[str, int]) -> None:
    for shape, tokens, point_path, knobs in _grid_points():
        if (point_path, knobs) != (path, params):
            continue
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{shape.name} {path} {params}", path=path, **params)


PDL_CHAIN_CASES = [  # (model, T, what, (path, knobs)): each family's kernels
    ("qwen3-30b-a3b", 8, "fma", ("fma", {})),
    ("qwen3-235b-a22b", 4, "fma", ("fma", {})),
    ("qwen3-30b-a3b", 8, "pairs", ("pairs", {})),  # no lists: the intermediate and x carry the chain
    ("qwen3-30b-a3b", 64, "mma", ("mma", {})),  # auto: the grouped down + the sum, GB_SHARE
    ("qwen3-30b-a3b", 37, "mma-balanced", ("mma", {"DB_GROUPED": 0})),  # 24 warps: 56 KB of partials, opted into
    ("qwen3-30b-a3b", 48, "mma-hot", ("mma", {"DB_GROUPED": 0, "HOT_NBLK": 2})),  # 16-pair tiles
    ("qwen3-30b-a3b", 48, "mma-grouped", ("mma", {"DB_GROUPED": 1, "HOT_NBLK": 2})),  # + sum
]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "what", "form"), PDL_CHAIN_CASES,
                         ids=lambda c: c if isinstance(c, (str, int)) else None)
def test_pdl_chain_where_each_layer_reads_the_last(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int,
                                                   what: str, form: tuple[str, dict[str, int]]) -> None:
    """Each family's kernels under PDL, six layers sharing ONE poisoned workspace: layer l + 1's x is layer l's
    output and every layer has its own routing, so a read hoisted above griddepcontrol.wait (the lists, the
    intermediate, x) or a list kernel overwriting the lists while the last layer's down still reads them gives
    other bits. Graph replays must equal the PDL=0 chain bitwise, every time."""
    cupy = cupy_mod
    path, knobs = form
    problem = make_problem(model, tokens, seed=_seed(rng), xp=cupy)
    shape = problem.shape
    routings = []
    for layer in range(6):
        ids, weights = make_routing(tokens, shape.experts, shape.top_k, "zipf" if layer % 2 else "uniform",
                                    _seed(rng))
        routings.append((cupy.asarray(ids), cupy.asarray(weights)))

    def poison(launch: Any) -> None:
        _poison(cupy, launch.workspace)

    assert_pdl_chain_bitwise(cupy, problem, batched.family(path).build, _dims(problem), poison, routings=routings,
                             replays=10, **knobs)


def test_gpu_knob_sets_resolve() -> None:
    """Every knob set the GPU tests run resolves where they run it (a rule change fails here, not on the H200), and
    the forms they name are the ones that run."""
    for shape, tokens, path, knobs in _grid_points():
        _resolve(path, Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k), **knobs)
    for name, shape in ODD_SHAPES.items():
        for tokens, knobs in MMA_ODD_KNOBS:
            resolved = _resolve("mma", Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k),
                                **knobs)
            assert all(resolved[k] == v for k, v in knobs.items()), (name, knobs)
    share = _resolve("mma", Dims(19, 2048, 768, 128, 8), DB_GROUPED=1, GB_KSPLIT=4, GB_UNROLL=1, GB_SHARE=2)
    assert (share["GB_RANGE_FLUSH"], share["GB_SHARE"]) == (1, 2)  # the split chains in one loop, shared
    for model, tokens, _, (path, knobs) in PDL_CHAIN_CASES:
        shape = PRESETS[model]
        _resolve(path, Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k), **knobs)


# ---------------------------------------------------------------------------------------------------
# CPU: the batch-invariant forms, emulated
# ---------------------------------------------------------------------------------------------------
def _probe_rows(base: Problem, probe: Problem, seed: int, cases: tuple, out_dtype: Any = BF16) -> list[np.ndarray]:
    """The emulated output row of ``probe``'s token for each (T, position, routing of the others, path, knobs) case:
    the token at that position among T - 1 other tokens, on ``base``'s weights (its bits: uint16 for bf16, uint32 for
    float32 out -- FP32 shows the sum orders that the bf16 rounding may hide)."""
    rows = []
    for tokens, position, routing, path, knobs in cases:
        others = make_problem(base.shape, tokens, seed=seed + 2 + tokens, routing=routing)
        x, ids, wts = others.x.copy(), others.topk_ids.copy(), others.topk_weights.copy()
        x[position], ids[position], wts[position] = probe.x[0], probe.topk_ids[0], probe.topk_weights[0]
        batch = Problem(base.shape, tokens, seed, "fixed", x, base.w13, base.w2, ids, wts)
        row = _emulate(batch, out_dtype=out_dtype, path=path, **knobs)["out"][position]
        rows.append(row.view(np.uint32 if np.dtype(out_dtype) == np.float32 else np.uint16))
    return rows


@pytest.mark.slow
def test_grouped_tensor_core_path_is_batch_invariant_emulated(rng: np.random.Generator) -> None:
    """With the grouped down forced at every T (DB_GROUPED 1), the tensor-core path's numerics never depend on the
    batch: an mma column is one pair, its k order fixed; each pair's weighted row is written once; a token's slots
    are summed in slot order. A probe token's output row is bitwise the same alone and inside batches of other
    tokens (other routings, other positions, 8-pair and 16-pair tiles) and in the per-pair family -- the property
    the batch-invariance issue asks of a policy, here on the kernels' own text. (At this size the balanced down and
    the FMA family happen to match too -- their batch-dependent sums differ in ~0.1 % of elements at real shapes --
    so this guards the grouped design, it does not rank the others.)"""
    shape = PRESETS["tiny"]
    seed = _seed(rng)
    base = make_problem(shape, 16, seed=seed)
    probe = make_problem(shape, 1, seed=seed + 1)
    hot = {**GROUPED, "HOT_NBLK": 2}  # 16-pair tiles, a hot one in one two-block pass: a work knob, the same bits
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", "mma", GROUPED), (3, 1, "uniform", "mma", GROUPED),
                                           (8, 5, "same", "mma", GROUPED), (16, 11, "zipf", "mma", hot),
                                           (1, 0, "uniform", "pairs", {}), (5, 3, "zipf", "pairs", {}),
                                           (5, 3, "zipf", "pairs", {"PAIRS_INNER": 0})),
                       out_dtype=np.float32)
    sixteen = _resolve("mma", Dims(16, shape.hidden, shape.intermediate, shape.experts, shape.top_k), **hot)
    assert mma.tile_pairs(sixteen) == 16  # the 16-token batch runs 16-pair tiles
    for row in rows[1:]:  # the per-pair family (no lists, a token per down block) gives the grouped path's bits
        assert np.array_equal(row, rows[0])


# I = 64: 8 chunks of 8 values, the grouped down's k range one whole round of 2 k blocks (H = 256: 4 ranges of 8
# chunks for the split-chain gate_up)
ALIGNED_SHAPE = MoEShape("h256-i64", 256, 64, 5, 3)
ALIGNED_GROUPED = {**GROUPED, "GB_KSPLIT": 4, "GB_UNROLL": 2, "DB_UNROLL": 2}


def _aligned_forms_agree(rng: np.random.Generator, macro: str) -> tuple[Problem, int, dict[str, int], dict[str, int]]:
    """A probe token's FP32 row on ALIGNED_SHAPE: the per-pair form alone, the grouped path with the derived macro
    ``macro`` at the rules' 1 and forced to 0 in a batch of 9 (Zipf), and at 1 with 16-pair tiles in a batch of 12
    (all on one set) -- asserted to be the same bits. Returns the batch of 9, its seed, the grouped knobs (``macro``
    1, as the rules pick it there) and the per-pair knobs."""
    seed = _seed(rng)
    base = make_problem(ALIGNED_SHAPE, 9, seed=seed, routing="zipf")
    probe = make_problem(ALIGNED_SHAPE, 1, seed=seed + 1)
    on = dict(ALIGNED_GROUPED)
    assert _resolve("mma", _dims(base), **on)[macro] == 1  # the rules' choice at this shape
    off = {**ALIGNED_GROUPED, "GB_SHARE": 0, macro: 0}  # (GB_SHARE needs the one loop of GB_RANGE_FLUSH 1)
    per_pair = {"GB_KSPLIT": 4, "GB_WARPS": 4}
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", "pairs", per_pair), (9, 4, "zipf", "mma", on),
                                           (9, 4, "zipf", "mma", off),
                                           (12, 7, "same", "mma", {**on, "HOT_NBLK": 2})), out_dtype=np.float32)
    for row in rows[1:]:
        assert np.array_equal(row, rows[0]), macro
    return base, seed, on, per_pair


@pytest.mark.slow
def test_whole_ranges_emulated(rng: np.random.Generator) -> None:
    """DB_WHOLE_RANGES 1 (no masked round compiled in the bf16 grouped down) gives the masked rounds' bits, and a
    probe token the per-pair form's bits in any batch; the rules take it where the down's range is whole rounds (a
    hot pass's too), on bf16 with the grouped down only -- and no caller can ask for it."""
    base, _, whole, _ = _aligned_forms_agree(rng, "DB_WHOLE_RANGES")
    got = _emulate(base, path="mma", **whole)["out"]
    _assert_matches(got, moe_decode(*base.arrays, mode="warp_decode"), moe_decode(*base.arrays, mode="fp64"),
                    "whole ranges", own_order=True)

    def resolved(shape: MoEShape, tokens: int = 4, weight_format: str = BF16_NAME, **knobs: int) -> int:
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        return _resolve("mma", dims, weight_format, **knobs)["DB_WHOLE_RANGES"]

    assert [resolved(ALIGNED_SHAPE, **ALIGNED_GROUPED), resolved(ALIGNED_SHAPE, **{**ALIGNED_GROUPED, "DB_UNROLL": 4}),
            resolved(ALIGNED_SHAPE, 12, **{**ALIGNED_GROUPED, "HOT_NBLK": 2, "DB_HOT_UNROLL": 3}),
            resolved(PRESETS["tiny"], **ALIGNED_GROUPED)] == [1, 0, 0, 0]  # tiny: I = 48, 6 chunks
    # a hot pass's halved rounds (DB_UNROLL 5, HOT_NBLK 2: 2 k blocks) do not split I = 160's 20 chunks: the masked
    # rounds run there (whole rounds alone dropped the last 4 chunks of the hot tiles' rows: errors of 1.2)
    hot = make_problem(MoEShape("h64-i160", 64, 160, 5, 3), 12, seed=12, routing="same")  # 12 pairs an expert
    odd_rounds = {"DB_GROUPED": 1, "HOT_NBLK": 2, "DB_UNROLL": 5, "DB_HOT_UNROLL": 0}
    assert [resolved(hot.shape, 12, **{**odd_rounds, "DB_HOT_UNROLL": r}) for r in (0, 5)] == [0, 1]
    _assert_matches(_emulate(hot, out_dtype=np.float32, path="mma", **odd_rounds)["out"],
                    moe_decode(*hot.arrays, mode="warp_decode", out_dtype=np.float32),
                    moe_decode(*hot.arrays, mode="fp64"), "hot passes' halved rounds", own_order=True)
    qwen = PRESETS["qwen3-30b-a3b"]  # I = 768: 96 chunks
    assert [resolved(qwen, t, **GROUPED) for t in (1, 16, 64)] == [1, 1, 1]
    assert [resolved(qwen, 16), resolved(qwen, 16, FP8_NAME, **FP8_GROUPED)] == [0, 0]  # balanced down; FP8
    with pytest.raises(ValueError, match=r"unknown warp-decode-mma parameter\(s\) \['DB_WHOLE_RANGES'\]"):
        resolved(ALIGNED_SHAPE, **{**ALIGNED_GROUPED, "DB_WHOLE_RANGES": 1})


@pytest.mark.slow
def test_range_flush_emulated(rng: np.random.Generator) -> None:
    """GB_RANGE_FLUSH 1 (the split-chain gate_up's ranges in one loop, each chain added at its range's end) gives
    the loop per range's bits and the per-pair form's in any batch -- also with a short last range ending in a
    partial round and an empty range past H -- and is chosen exactly where no round straddles two ranges."""
    base, seed, flush, per_pair = _aligned_forms_agree(rng, "GB_RANGE_FLUSH")
    per_range = {**flush, "GB_SHARE": 0, "GB_RANGE_FLUSH": 0}
    # H = 200: 25 chunks in 8 ranges of 4 -- the seventh 1 chunk long (a partial round), the eighth empty
    odd = make_problem(MULTI_SHAPE, 7, seed=seed + 2, routing="zipf")
    knobs = {**GROUPED, "GB_UNROLL": 1}
    assert _resolve("mma", _dims(odd), **knobs)["GB_RANGE_FLUSH"] == 1
    got = _emulate(odd, out_dtype=np.float32, path="mma", **knobs)
    want = _emulate(odd, out_dtype=np.float32, path="mma", **{**knobs, "GB_SHARE": 0, "GB_RANGE_FLUSH": 0})
    assert np.array_equal(got["inter"], want["inter"]) and np.array_equal(got["out"].view(np.uint32),
                                                                          want["out"].view(np.uint32))
    _assert_matches(got["out"], moe_decode(*odd.arrays, mode="warp_decode", out_dtype=np.float32),
                    moe_decode(*odd.arrays, mode="fp64"), "range flush, H = 200", own_order=True)

    # the order itself: x = 1 and a neuron whose 4 ranges of 64 sum to 2^25, 4 (32 x 0.125: two mma of 2 each),
    # -2^25 and 0 -- a chain per range gives 2^25 + 4 - 2^25 = 4; one chain over H, or a chain over two ranges, loses
    # each 2 against 2^25 (ulp 4, a tie to even) and gives 0
    w13 = base.w13.copy()
    crafted = np.concatenate([np.full(64, 2.0**19), np.full(32, 0.125), np.zeros(32), np.full(64, -(2.0**19)),
                              np.zeros(64)]).astype(BF16)
    w13[:, 5], w13[:, ALIGNED_SHAPE.intermediate + 5] = crafted, crafted      # gate and up of neuron 5
    ones = Problem(ALIGNED_SHAPE, 4, seed, "fixed", np.ones((4, ALIGNED_SHAPE.hidden), BF16), w13, base.w2,
                   base.topk_ids[:4], base.topk_weights[:4])
    expect = bf16_to_f32(np.asarray([4.0 * 4.0 / (1.0 + np.exp(-4.0))], np.float32).astype(BF16))[0]
    for path, case in (("mma", flush), ("mma", per_range), ("pairs", per_pair)):
        inter = bf16_to_f32(_emulate(ones, path=path, **case)["inter"][:, :, 5].view(BF16))
        assert np.all(inter == expect), (path, case, inter)

    # ... and where a hot pass's rounds straddle two ranges the rules leave the flush off: GB_UNROLL 5 with HOT_NBLK 2
    # runs hot rounds of 2 k blocks (8 chunks) over H = 320's two 20-chunk ranges (a flush there once gave a hot tile
    # one chain over H: 0 for this neuron, not 4)
    wide = MoEShape("h320-i64", 320, 64, 5, 3)
    crafted = np.concatenate([np.full(64, 2.0**19), np.zeros(96), np.full(32, 0.125), np.full(64, -(2.0**19)),
                              np.zeros(64)]).astype(BF16)
    hot = make_problem(wide, 12, seed=seed, routing="same")  # 12 pairs an expert: hot 16-pair tiles
    w13 = hot.w13.copy()
    w13[:, 5], w13[:, wide.intermediate + 5] = crafted, crafted
    hot = dataclasses.replace(hot, x=np.ones((12, wide.hidden), BF16), w13=w13)
    odd_rounds = {"DB_GROUPED": 1, "HOT_NBLK": 2, "GB_KSPLIT": 2, "GB_UNROLL": 5}
    assert _resolve("mma", _dims(hot), **odd_rounds)["GB_RANGE_FLUSH"] == 0
    for path, case in (("mma", odd_rounds), ("pairs", {"GB_KSPLIT": 2, "GB_WARPS": 2})):
        inter = bf16_to_f32(_emulate(hot, path=path, **case)["inter"][:, :, 5].view(BF16))
        assert np.all(inter == expect), (path, case, inter)

    def resolved(shape: MoEShape, **extra: int) -> int:
        dims = Dims(4, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        return _resolve("mma", dims, **extra)["GB_RANGE_FLUSH"]

    assert [resolved(ALIGNED_SHAPE, **ALIGNED_GROUPED), resolved(MULTI_SHAPE, **knobs),
            resolved(MULTI_SHAPE, **{**knobs, "GB_UNROLL": 2}),  # 4-chunk ranges, 8-chunk rounds
            resolved(PRESETS["qwen3-30b-a3b"], **GROUPED),
            resolved(PRESETS["qwen3-30b-a3b"])] == [1, 1, 0, 1, 0]  # the single chain: nothing to flush
    with pytest.raises(ValueError, match=r"unknown warp-decode-mma parameter\(s\) \['GB_RANGE_FLUSH'\]"):
        resolved(MULTI_SHAPE, **{**knobs, "GB_RANGE_FLUSH": 1})
    with pytest.raises(ValueError, match=r"unknown warp-decode-pairs parameter\(s\) \['GB_RANGE_FLUSH'\]"):
        _resolve("pairs", QWEN30_T8, GB_RANGE_FLUSH=1)  # the per-pair form: a warp per range, nothing to flush


@pytest.mark.slow
def test_split_k_forms_agree_and_are_batch_invariant_emulated(rng: np.random.Generator) -> None:
    """GB_KSPLIT: the gate_up's k chains cut into fixed ranges (a function of H alone), the partials added in range
    order. One warp running the ranges in turn (the grouped path, 8- and 16-pair tiles) and a warp per range (the
    per-pair family, partials through shared memory) give a probe token the same bits alone and in any batch; at
    tiny's H = 136 (17 chunks) 4 ranges are 8, 8, 1 and 0 chunks long, 3 ranges 8, 8, 1."""
    shape = PRESETS["tiny"]
    seed = _seed(rng)
    base = make_problem(shape, 16, seed=seed)
    probe = make_problem(shape, 1, seed=seed + 1)
    grouped = {**GROUPED, "GB_KSPLIT": 4}
    per_pair = {"GB_KSPLIT": 4, "GB_WARPS": 4}
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", "pairs", per_pair),
                                           (16, 11, "zipf", "mma", {**grouped, "HOT_NBLK": 2}),
                                           (3, 1, "uniform", "mma", grouped), (5, 3, "zipf", "pairs", per_pair)),
                       out_dtype=np.float32)
    for row in rows[1:]:
        assert np.array_equal(row, rows[0])
    alone = Problem(shape, 1, seed, "fixed", probe.x, base.w13, base.w2, probe.topk_ids, probe.topk_weights)
    _assert_matches(rows[0].view(np.float32)[None], moe_decode(*alone.arrays, mode="warp_decode",
                                                               out_dtype=np.float32),
                    moe_decode(*alone.arrays, mode="fp64"), "GB_KSPLIT 4", own_order=True)
    # the order itself, where it shows: x = 1 and a neuron whose 3 ranges sum to 2^26, -2^26 and 1 -- in range
    # order (2^26 - 2^26) + 1 = 1, in any other 0 (1 - 2^26 rounds to -2^26); one chain over H gives 1 as well
    w13 = base.w13.copy()
    crafted = np.concatenate([np.full(64, 2.0**20), np.full(64, -(2.0**20)), np.full(8, 0.125)]).astype(BF16)
    w13[:, 5], w13[:, shape.intermediate + 5] = crafted, crafted      # gate and up of neuron 5, every expert
    ones = np.ones((4, shape.hidden), BF16)
    expect = bf16_to_f32(np.asarray([1.0 / (1.0 + np.exp(-1.0))], np.float32).astype(BF16))[0]
    # (the library's 8 ranges, 4 chunks each: 2^25, 2^25, -2^25, -2^25, 1, then empty ones -- 1 in range order too)
    for path, knobs in (("mma", {**GROUPED, "GB_KSPLIT": 3}), ("pairs", {"GB_KSPLIT": 3, "GB_WARPS": 3}),
                        ("pairs", {"GB_KSPLIT": 1, "GB_WARPS": 4}), ("pairs", {}), ("mma", GROUPED)):
        crafted_problem = Problem(shape, 4, seed, "fixed", ones, w13, base.w2, base.topk_ids[:4], base.topk_weights[:4])
        inter = _emulate(crafted_problem, path=path, **knobs)["inter"][:, :, 5].view(BF16)
        assert np.all(bf16_to_f32(inter) == expect), (path, knobs, bf16_to_f32(inter))
