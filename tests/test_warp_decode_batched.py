"""Batched warp decode (kernels/warp_decode_batched.py).

CPU tests: argument checks before any device call (stand-in "cupy" arrays), knob validation and the auto
knobs, the offline compile (zero spills / stack) of the defaults and of every preset's resolved knobs, the
variant registration, and the CUDA C itself emulated on the CPU (g++, one lane per thread of a
block, shuffles and __syncthreads through barriers): the routing lists against a NumPy model, the whole
layer against ``reference.moe_decode``, the gate/up intermediate BITWISE against the strict kernel's
(kernels/warp_decode_cupy.py, emulated the same way), bad ids -> NaN rows.

GPU tests (``-m gpu``, the H200): presets at T in {1, 3, 8, 64}, odd shapes, every routing (incl. "same" and
fixed ids with duplicates), fp32 out, the intermediate bitwise equal to the strict kernel's, bitwise
repeatability over 3 runs, bad ids (ValueError outside capture, NaN rows inside the kernels), CUDA-graph
capture + replay on new routing, the stages and the variant, a sample of the knob grid.

Tolerance vs ``reference.moe_decode(mode="warp_decode")``: as tests/test_warp_decode_cupy.py explains
(|got - ref| <= ulp(|ref|) + ulp(RMS / 4), >= 85 % bitwise, rel-L2 vs fp64 < 5e-3; tests/warp_checks.py).
The sum over a token's K slots runs in a different order here (by down warp, then by expert id), which
only moves fp32 ulps.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import warp_decode_batched as wdb
from kernels import warp_decode_cupy as wdc
from kernels.contract import BF16, Dims
from kernels.formats import BF16_T16, Quantized, quantize_weights
from kernels.numerics import bf16_to_f32
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.routing import make_routing
from kernels.shapes import PRESETS, MoEShape
from tests.warp_checks import (
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


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


# ---------------------------------------------------------------------------------------------------
# CPU: argument checks, knobs, registration, offline compile
# ---------------------------------------------------------------------------------------------------


def _call(**arrays: Any) -> Any:
    return wdb.warp_decode_batched(arrays["x"], arrays["w13"], arrays["w2"], arrays["topk_ids"],
                                   arrays["topk_weights"], **arrays.get("params", {}))


def test_numpy_inputs_are_a_type_error() -> None:
    problem = make_problem("tiny", 2, seed=3)
    with pytest.raises(TypeError, match="x must be a cupy"):
        wdb.warp_decode_batched(*problem.arrays)


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


QWEN30_T8 = Dims(8, 2048, 768, 128, 8)
BAD_KNOBS = [  # (dims, knobs, error, message)
    (QWEN30_T8, {"GU_OUTS": 2}, ValueError, "unknown"),
    (QWEN30_T8, {"GB_OUTS": 2.0}, TypeError, "GB_OUTS"),
    (QWEN30_T8, {"GB_BYTES": 12}, ValueError, "GB_BYTES"),
    (QWEN30_T8, {"DB_WARPS": 33}, ValueError, "DB_WARPS"),
    (QWEN30_T8, {"LIST_THREADS": 100}, ValueError, "LIST_THREADS"),
    (Dims(1, 8, 8, 1000, 1), {"LIST_THREADS": 64, "LIST_PER": 2}, ValueError, "list kernel"),
    (Dims(800, 64, 32, 48, 40), {}, ValueError, "two per pair"),  # 32000 pairs: > 256 KB of list-kernel shared memory
    (Dims(4096, 2048, 768, 128, 8), {}, ValueError, "shared memory"),
    (QWEN30_T8, {"DB_EARLY_W2": 1}, ValueError, "DB_EARLY_W2"),
    # 24 warps x 128 registers: the H200 answered CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (results/sweep-mma-dbwarps-*)
    (QWEN30_T8, {"DB_MMA": 1, "DB_WARPS": 24}, ValueError, "DB_WARPS 24 x 32 threads x DB_MAX_REGS 128"),
    (QWEN30_T8, {"GB_WARPS": 32, "GB_MAX_REGS": 72}, ValueError, "GB_MAX_REGS"),
    (QWEN30_T8, {"DB_BALANCE": 1}, ValueError, "DB_BALANCE applies to the tensor-core down kernel"),
    (QWEN30_T8, {"DB_MMA": 1, "DB_BALANCE": 2}, ValueError, "DB_BALANCE"),
    (QWEN30_T8, {"GB_KSPLIT": 2}, ValueError, "GB_KSPLIT cuts the tensor-core gate_up"),
    (QWEN30_T8, {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 3, "GB_WARPS": 4}, ValueError, "multiple of GB_KSPLIT"),
    (QWEN30_T8, {"GB_MMA": 1, "GB_KSPLIT": 9}, ValueError, "GB_KSPLIT"),
    (QWEN30_T8, {**wdb.MMA_KNOBS, "PAIRS_INNER": 1}, ValueError, "PAIRS_INNER orders the per-pair kernels"),
]


@pytest.mark.parametrize(("dims", "knobs", "error", "match"), BAD_KNOBS, ids=lambda c: str(c)[:40])
def test_resolve_params_refuses(dims: Dims, knobs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        wdb.resolve_params(dims, **knobs)


def test_resolve_params_validates() -> None:
    dims = QWEN30_T8
    assert wdb.resolve_params(dims, DB_MMA=1, DB_WARPS=24, DB_MAX_REGS=0)["DB_WARPS"] == 24
    assert wdb.resolve_params(dims, DB_MMA=1, DB_WARPS=24, DB_MAX_REGS=80)["DB_MAX_REGS"] == 80
    # auto warps: 24 under launch bounds where the cap is auto, 16 where a cap (128 included) is given
    assert [wdb.resolve_params(Dims(64, 2048, 768, 128, 8), DB_MMA=1, **cap)["DB_WARPS"]
            for cap in ({}, {"DB_MAX_REGS": 128})] == [wdb.MMA_WIDE_DOWN_WARPS, wdb.MMA_DOWN_WARPS]
    resolved = wdb.resolve_params(dims)
    switches = ("MAX_REGS", "MMA", "PDL", "EARLY_W2", "BALANCE", "PAIR_TILES", "GROUPED", "W_FP8", "PER_PAIR",
                "FP8_", "WHOLE_RANGES", "RANGE_FLUSH", "PAIRS_INNER", "HOT_", "SHARE", "W_TILED")  # 0: off
    assert set(resolved) == set(wdb.DEFAULTS)
    assert all(v > 0 for k, v in resolved.items() if not any(s in k for s in switches))


def test_auto_knobs() -> None:
    tiles = {t: wdb.auto_tile(Dims(t, 2048, 768, 128, 8)) for t in (1, 2, 4, 8, 16, 32, 64)}
    assert tiles == {1: 1, 2: 2, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}
    assert wdb.auto_down_tile(Dims(64, 2048, 768, 128, 8)) == 4  # down's tile is capped at 4
    assert wdb.auto_tile(Dims(64, 4096, 14336, 8, 2)) == wdb.MAX_TILE  # mixtral: 16 pairs per expert
    assert wdb.auto_tile(Dims(3, 8, 8, 1, 1)) == 4  # never above the next power of two of T
    assert wdb.resolve_params(Dims(2, 2048, 512, 512, 10))["LIST_PER"] == 3  # (512 + 1) / 256
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8))["DB_UNROLL"] == 1  # 96 chunks: no whole rounds of 2
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8))["DB_UNROLL"] == 2  # 192 chunks
    assert wdb.resolve_params(Dims(32, 2048, 768, 128, 8))["GB_UNROLL"] == 2  # tile 4
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8))["GB_UNROLL"] == 4  # tile 8
    assert wdb.slots(Dims(2, 8, 8, 128, 8)) == 17 and wdb.slots(Dims(64, 8, 8, 128, 8)) == 129
    assert wdb.lists_size(Dims(2, 8, 8, 128, 8)) == 4 + 3 * 17 + 16 + 4 * (17 + 2)
    assert wdb.lists_shared_bytes(Dims(2, 8, 8, 128, 8), wdb.resolve_params()) == (129 * 9 + 2 * 16) * 4
    assert wdb.max_tokens() == 227 * 1024 // (4 * 4 * 4)  # the down kernel opts into 227 KB above 48 KB
    assert wdb.max_tokens(GB_MMA=1, DB_MMA=1) == 227 * 1024 // (16 * 16 * 4)  # auto DB_WARPS: 16 with DB_MMA
    assert wdb.resolve_params(Dims(8, 2048, 768, 128, 8), DB_MMA=1)["DB_WARPS"] == wdb.MMA_DOWN_WARPS
    wide = wdb.resolve_params(Dims(32, 2048, 768, 128, 8), **{**wdb.MMA_KNOBS, "DB_GROUPED": 0})  # from T = 32: 24
    assert (wide["DB_WARPS"], wide["DB_MAX_REGS"]) == (wdb.MMA_WIDE_DOWN_WARPS, 0)
    # auto DB_GROUPED (-1 in the tensor-core knob set): the grouped down (4 warps) once experts average 2 pairs
    grouped = {t: wdb.resolve_params(Dims(t, 2048, 768, 128, 8), **wdb.MMA_KNOBS) for t in (16, 32, 64)}
    assert {t: (r["DB_GROUPED"], r["DB_WARPS"]) for t, r in grouped.items()} == {16: (0, 16), 32: (1, 4), 64: (1, 4)}
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8), **wdb.MIXED_KNOBS, DB_GROUPED=-1)["DB_GROUPED"] == 0
    assert wdb.kernel_names(grouped[64]) == ("moe_expert_lists", "moe_gate_up_mma", "moe_down_grouped",
                                             "moe_sum_slots")
    assert wdb.resolve_params(Dims(32, 2048, 768, 128, 8), **wdb.MIXED_KNOBS, DB_MAX_REGS=80)["DB_WARPS"] == 24
    assert wdb.resolve_params(Dims(32, 2048, 768, 128, 8), **wdb.MIXED_KNOBS, DB_MAX_REGS=96)["DB_WARPS"] == 16
    assert wdb.resolve_params(Dims(200, 2048, 768, 128, 8), **wdb.MIXED_KNOBS)["DB_WARPS"] == 16  # partials: 307 KB
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8))["DB_WARPS"] == 4  # the FMA down
    assert [wdb.resolve_params(Dims(t, 2048, 768, 128, 8), GB_MMA=1)["GB_NBLK"] for t in (32, 64)] == [1, 1]
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8), GB_MMA=1, GB_NBLK=2)["GB_NBLK"] == 2
    fp8 = wdb.resolve_params(Dims(64, 2048, 768, 128, 8), **wdb.MMA_KNOBS, W_FP8=1)  # FP8: one block, byte permute
    assert (fp8["GB_NBLK"], fp8["DB_NBLK"], fp8["FP8_PRMT"], fp8["DB_ROW_TILES"]) == (1, 1, 2, 1)  # I = 768: one tile
    # auto HOT_NBLK: 2 on FP8 from T*K >= 4E (qwen3 T = 64: a hot tile in one two-block pass), else 0
    hot = {(knobs, t): wdb.resolve_params(Dims(t, 2048, 768, 128, 8), **getattr(wdb, knobs))["HOT_NBLK"]
           for knobs in ("MMA_FP8_KNOBS", "FP8_GROUPED_KNOBS", "MMA_KNOBS", "FP8_PER_PAIR_KNOBS") for t in (32, 64)}
    assert [hot[k, t] for k in ("MMA_FP8_KNOBS", "FP8_GROUPED_KNOBS") for t in (32, 64)] == [0, 2, 0, 2]
    assert hot["MMA_KNOBS", 64] == hot["FP8_PER_PAIR_KNOBS", 64] == 0  # qwen3-30b bf16: 6 MiB experts
    # bf16 from T*K >= E with the grouped down (the tensor-core path's from T*K >= 2E) where an expert's gate_up rows
    # reach HOT_EXPERT_BYTES (qwen3-235b), under the 96 caps
    big = {(knobs, t): wdb.resolve_params(Dims(t, 4096, 1536, 128, 8), **getattr(wdb, knobs))
           for knobs in ("MMA_KNOBS", "GROUPED_KNOBS", "PER_PAIR_KNOBS") for t in (8, 16, 32, 64)}
    assert [big[k, t]["HOT_NBLK"] for k in ("MMA_KNOBS", "GROUPED_KNOBS", "PER_PAIR_KNOBS") for t in (8, 16, 32, 64)
            ] == [0, 0, 2, 2, 0, 2, 2, 2, 0, 0, 0, 0]
    assert [(big[k, 64]["GB_MAX_REGS"], big[k, 64]["DB_MAX_REGS"]) for k in ("MMA_KNOBS", "GROUPED_KNOBS")] == [
        (wdb.PASS_REGS, wdb.PASS_REGS)] * 2
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **wdb.MMA_KNOBS, DB_MAX_REGS=120)["DB_MAX_REGS"] == 120
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **wdb.MMA_KNOBS, DB_MAX_REGS=128)["DB_MAX_REGS"] == 128
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **{**wdb.MMA_KNOBS, "HOT_NBLK": 0})["DB_MAX_REGS"] == 128
    # the bf16 grouped down's hot passes keep DB_UNROLL k blocks in flight (auto_hot_down_unroll); FP8's the halved
    # default (0), as does every point without hot passes
    assert [big[k, t]["DB_HOT_UNROLL"] for k in ("MMA_KNOBS", "GROUPED_KNOBS") for t in (16, 64)] == [0, 4, 4, 4]
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **wdb.MMA_FP8_KNOBS)["DB_HOT_UNROLL"] == 0
    # ... and the single-chain gate_up's GB_UNROLL (auto_hot_gate_up_unroll); the split chains keep the halved default
    assert [big[k, t]["GB_HOT_UNROLL"] for k in ("MMA_KNOBS", "GROUPED_KNOBS") for t in (16, 64)] == [0, 4, 0, 0]
    assert [big["MMA_KNOBS", t]["GB_UNROLL"] for t in (32, 64)] == [4, 4]
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **wdb.MMA_FP8_KNOBS)["GB_HOT_UNROLL"] == 0
    # a hot pass's rounds must split I into whole rounds too: 3 k blocks (12 chunks) do not at I = 14336
    mixtral = Dims(64, 4096, 14336, 8, 2)
    assert wdb.resolve_params(mixtral, **{**wdb.MMA_KNOBS, "DB_HOT_UNROLL": 3})["DB_WHOLE_RANGES"] == 0
    with pytest.raises(ValueError, match="DB_HOT_UNROLL 3"):
        wdb.resolve_params(mixtral, **{**wdb.MMA_KNOBS, "DB_HOT_UNROLL": 3, "DB_WHOLE_RANGES": 1})
    # ... and the split-chain gate_up's ranges (16 k blocks at qwen3-235b) a whole number of hot rounds
    assert big["GROUPED_KNOBS", 64]["GB_RANGE_FLUSH"] == 1
    hot3 = {**wdb.GROUPED_KNOBS, "GB_HOT_UNROLL": 3}
    assert wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **hot3)["GB_RANGE_FLUSH"] == 0
    with pytest.raises(ValueError, match="GB_RANGE_FLUSH 1 runs the split-chain"):
        wdb.resolve_params(Dims(64, 4096, 1536, 128, 8), **{**hot3, "GB_RANGE_FLUSH": 1})
    assert wdb.resolve_params(Dims(64, 2048, 768, 128, 8), **wdb.MMA_FP8_KNOBS, GB_NBLK=2)["HOT_NBLK"] == 0
    assert wdb.tile_pairs(fp8) == 16 and wdb.tile_pairs(wdb.resolve_params(None, **wdb.MMA_FP8_KNOBS)) == 8
    assert wdb.resolve_params(Dims(8, 2048, 768, 128, 8), DB_MMA=1, DB_WARPS=4)["DB_WARPS"] == 4
    # auto GB_SHARE / DB_SHARE: groups of 4 on bf16 from T*K >= 2E where the stage can share (the grouped path's split
    # chains walk H in one loop: GB_RANGE_FLUSH); FP8 0
    share = {(knobs, t): tuple(wdb.resolve_params(Dims(t, 4096, 1536, 128, 8), **getattr(wdb, knobs))[k]
                               for k in ("GB_SHARE", "DB_SHARE"))
             for knobs in ("MMA_KNOBS", "GROUPED_KNOBS", "MMA_FP8_KNOBS") for t in (16, 32)}
    assert share == {("MMA_KNOBS", 16): (0, 0), ("MMA_KNOBS", 32): (4, 4), ("GROUPED_KNOBS", 16): (0, 0),
                     ("GROUPED_KNOBS", 32): (4, 4), ("MMA_FP8_KNOBS", 16): (0, 0), ("MMA_FP8_KNOBS", 32): (0, 0)}
    assert wdb.resolve_params(Dims(32, 4096, 1536, 128, 8), **wdb.MMA_KNOBS, GB_WARPS=2)["GB_SHARE"] == 0
    # auto DB_BALANCE (-1 in the tensor-core knob sets): where the round-robin's last round is < 85 % full on average
    balance = {t: wdb.resolve_params(Dims(t, 2048, 768, 128, 8), **wdb.MIXED_KNOBS)["DB_BALANCE"]
               for t in (2, 4, 8, 16, 32, 64)}
    assert balance == {2: 0, 4: 0, 8: 1, 16: 0, 32: 0, 64: 0}  # T = 8: 51.6 experts / 16 warps = 3.2 (80 %)
    assert wdb.resolve_params(Dims(8, 2048, 768, 128, 8), DB_BALANCE=-1)["DB_BALANCE"] == 0  # the FMA down
    assert wdb.resolve_params(Dims(8, 2048, 768, 128, 8), **{**wdb.MMA_KNOBS, "DB_BALANCE": 0})["DB_BALANCE"] == 0
    assert wdb.resolve_params(None, **wdb.MIXED_KNOBS)["DB_BALANCE"] == 0
    assert wdb.resolve_params(None, DB_MMA=1, GB_MMA=1, PAIR_TILES=1, DB_BALANCE=-1)["DB_BALANCE"] == 1  # tiles



def test_tensor_core_gate_up_rounds_and_register_cap() -> None:
    """The tensor-core gate_up's rules from the dims: the per-pair bf16 form keeps 4 k blocks in flight below
    PAIR_FULL_WARPS warps, 2 from there; the FP8 split chains with two 8-pair blocks (set by hand) take 2; the bf16
    tensor-core gate_up runs under PASS_REGS with split chains and one 8-pair block or one chain and two (not
    with split chains and two: they spill there), the FP8 single chain at T*K = E/4; an explicit knob wins over a
    rule."""
    def gate_up(knobs: dict[str, int], tokens: int, hidden: int = 2048, inter: int = 768, **extra: int) -> tuple:
        r = wdb.resolve_params(Dims(tokens, hidden, inter, 128, 8), **{**knobs, **extra})
        return r["GB_UNROLL"], r["GB_MAX_REGS"]

    assert 1 * 8 * 96 * 8 < wdb.PAIR_FULL_WARPS <= 2 * 8 * 96 * 8  # qwen3-30b: T = 1 below, T = 2 at or above
    assert [gate_up(wdb.PER_PAIR_KNOBS, t)[0] for t in (1, 2, 4)] == [4, 2, 2]
    assert gate_up(wdb.PER_PAIR_KNOBS, 1, 4096, 1536)[0] == 2  # qwen3-235b T = 1: 12288 warps
    assert gate_up(wdb.PER_PAIR_KNOBS, 2, GB_UNROLL=8)[0] == 8
    assert [gate_up(wdb.FP8_PER_PAIR_KNOBS, t)[0] for t in (1, 2)] == [2, 2]  # its own sweep's rounds
    assert [gate_up(wdb.FP8_GROUPED_KNOBS, t)[0] for t in (16, 64)] == [4, 4]  # FP8: one 8-pair block per pass
    assert gate_up(wdb.FP8_GROUPED_KNOBS, 64, GB_NBLK=2)[0] == 2  # two blocks: 2, under the register cap
    assert [gate_up(wdb.MMA_FP8_KNOBS, t)[0] for t in (16, 64)] == [4, 4]  # one chain: no spills at 4
    assert [gate_up(wdb.GROUPED_KNOBS, t) for t in (4, 64)] == [(4, wdb.PASS_REGS)] * 2
    assert gate_up(wdb.GROUPED_KNOBS, 64, GB_NBLK=2) == (4, 128)  # split chains with two blocks spill under 96
    assert [gate_up(wdb.MMA_KNOBS, t)[1] for t in (4, 64)] == [128, 128]  # one chain, one block: 80 registers
    assert gate_up(wdb.MMA_KNOBS, 64, GB_NBLK=2)[1] == wdb.PASS_REGS  # one chain, two blocks
    assert gate_up(wdb.GROUPED_KNOBS, 4, GB_MAX_REGS=0)[1] == 0
    # an explicit cap is never changed, the auto value 128 included (a sweep's 128 column is 128); -1 is auto
    assert gate_up(wdb.MMA_FP8_KNOBS, 4, 4096, 1536, GB_MAX_REGS=128)[1] == 128
    assert gate_up(wdb.MMA_FP8_KNOBS, 4, 4096, 1536, GB_MAX_REGS=-1)[1] == wdb.PASS_REGS
    assert gate_up(wdb.GROUPED_KNOBS, 64, GB_MAX_REGS=128)[1] == 128
    assert gate_up(wdb.MMA_KNOBS, 64, GB_MAX_REGS=120)[1] == 120
    assert gate_up(wdb.FP8_GROUPED_KNOBS, 4)[1] == 128 and gate_up(wdb.MMA_FP8_KNOBS, 64, GB_NBLK=2)[1] == 128
    # the FP8 single chain under PASS_REGS where E/8 < T*K <= E/4 (qwen3 T = 4), both models; not the split chains
    assert [gate_up(wdb.MMA_FP8_KNOBS, t)[1] for t in (2, 4, 8)] == [128, wdb.PASS_REGS, 128]
    assert gate_up(wdb.MMA_FP8_KNOBS, 4, 4096, 1536)[1] == wdb.PASS_REGS
    assert gate_up(wdb.MMA_KNOBS, 4)[1] == 128 and gate_up(wdb.FP8_GROUPED_KNOBS, 4, 4096, 1536)[1] == 128
    assert wdb.resolve_params(None, **wdb.PER_PAIR_KNOBS)["GB_UNROLL"] == wdb.MMA_UNROLL  # no dims: the default


def test_source_and_variant_are_registered() -> None:
    from kernels.compile import SOURCES
    from kernels.variants import REGISTRY

    assert SOURCES["warp_decode_batched"] is wdb.SOURCE
    variant = REGISTRY["cupy:warp-decode-batched"]
    assert variant.reference_mode == "warp_decode" and variant.family == "warp-decode-batched"
    assert variant.grid and set(variant.grid) <= set(wdb.DEFAULTS)
    assert variant.kernel_family is wdb.FAMILY and variant.source is wdb.SOURCE
    assert variant.resolve(QWEN30_T8) == wdb.resolve_params(QWEN30_T8)


@pytest.mark.parametrize("which", ["defaults", pytest.param("presets", marks=pytest.mark.slow)])
def test_offline_compile_defaults_and_presets_without_spills(which: str) -> None:
    """Every kernel at the defaults (FMA and tensor-core) and at every preset's resolved knobs: sm_90, zero spills,
    zero stack. Two compiles at a time (NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    param_sets = [{}, {"GB_MMA": 1, "DB_MMA": 1}] if which == "defaults" else list(wdb.SOURCE.variants)
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda params: offline_report(wdb.SOURCE, **params), param_sets))
    for params, reports in zip(param_sets, all_reports, strict=True):
        assert {r.kernel for r in reports} == set(wdb.kernel_names(params))
        for r in reports:
            assert r.spills == 0 and r.stack_bytes == 0, (params, r)
            cap = params.get("DB_MAX_REGS" if "down" in r.kernel else "GB_MAX_REGS", 0)
            assert r.registers <= max(128, cap), (params, r)  # 128, or a knob set's own higher cap (FP8's down)


@pytest.mark.slow
def test_variant_grid_corners_compile() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    dims = Dims(64, 2048, 768, 128, 8)
    resolved = [wdb.resolve_params(dims, **{**variant.params, **corner})
                for variant in (wdb.VARIANT, wdb.MMA_VARIANT)
                for corner in ({k: max(v) for k, v in variant.grid.items()},
                               {k: min(v) for k, v in variant.grid.items()})]
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda params: offline_report(wdb.SOURCE, **params), resolved))
    for params, reports in zip(resolved, all_reports, strict=True):
        assert {r.kernel for r in reports} == set(wdb.kernel_names(params))


# ---------------------------------------------------------------------------------------------------
# CPU: the routing lists, modelled in NumPy
# ---------------------------------------------------------------------------------------------------
def expert_lists_numpy(topk_ids: np.ndarray, experts: int, tile_pairs: int = 0) -> dict[str, Any]:
    """What moe_expert_lists writes: slots in ascending expert id (bad ids last, as expert E), pairs stable; with
    ``tile_pairs`` (PAIR_TILES) the tile table: each slot's pairs in runs of tile_pairs, (expert, first, count,
    t | n << 16: the slot's t-th tile of n)."""
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
            "tiles": np.array(tiles, np.int64).reshape(-1, wdb.TILE_ARRAYS)}


def _tile_pairs(dims: Dims, params: dict[str, Any]) -> int:
    """Pairs per tile of the tile table these knobs write (0: none)."""
    resolved = wdb.resolve_params(dims, **params)
    return wdb.tile_pairs(resolved) if resolved["PAIR_TILES"] else 0


def _unpack_lists(raw: np.ndarray, dims: Dims) -> dict[str, Any]:
    s = wdb.slots(dims)
    used, tiles = int(raw[0]), int(raw[3])
    h = wdb.LIST_HEADER
    pairs = dims.tokens * dims.top_k
    table = h + 3 * s + pairs
    cap = wdb.tile_capacity(dims)
    return {"used": used, "good": int(raw[1]), "bad": int(raw[2]), "expert": raw[h:h + used],
            "offset": raw[h + s:h + s + used], "count": raw[h + 2 * s:h + 2 * s + used],
            "sorted": raw[h + 3 * s:h + 3 * s + pairs],
            "tiles": np.stack([raw[table + j * cap:table + j * cap + tiles] for j in range(wdb.TILE_ARRAYS)],
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
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) for the GB_MMA / DB_MMA kernels: every lane publishes its six
// fragment registers (a0..a3, b0, b1) in the warp's frags, then lane (g, q) computes D rows g, g+8 x columns
// 2q, 2q+1 from the PTX ISA layout: A[m][k] in lane (m%8)*4 + (k%8)/2, register (m >= 8) + 2 (k >= 8);
// B[k][n] in lane n*4 + (k%8)/2, register (k >= 8); the low half of a register is the even k
inline void emulated_mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                               unsigned b1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    uint32_t* mine = g_warp->frags[lane];
    mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
    g_warp->bar.arrive_and_wait();
    auto half = [](unsigned w, int k) { return __uint_as_float(k % 2 ? (w & 0xffff0000u) : (w << 16)); };
    auto a_el = [&](int m, int k) {
        return half(g_warp->frags[(m % 8) * 4 + (k % 8) / 2][(m < 8 ? 0 : 1) + (k < 8 ? 0 : 2)], k);
    };
    auto b_el = [&](int k, int n) { return half(g_warp->frags[n * 4 + (k % 8) / 2][4 + (k < 8 ? 0 : 1)], k); };
    float sums[4];
    for (int r = 0; r < 4; ++r) {
        const int m = g + (r >= 2 ? 8 : 0), n = 2 * q + (r & 1);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum = fmaf(a_el(m, k), b_el(k, n), sum);
        sums[r] = sum;
    }
    g_warp->bar.arrive_and_wait();  // every lane has read the fragments before any lane's next mma writes
    for (int r = 0; r < 4; ++r) d[r] += sums[r];
}
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
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    int f32 = atoi(argv[6]);
    long long gu_blocks = atoll(argv[7]), dn_blocks = atoll(argv[8]);
    int slots = atoi(argv[9]), lists_size = atoi(argv[10]);
    std::string dir = argv[11];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
#if W_FP8  // fp8-block128: e4m3fn bytes and the block scales
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
    std::vector<int> lists(lists_size, -12345);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);
    std::vector<uint32_t> out((size_t)T * H, 0x7fc07fc0u);  // NaN poison in either view
    // the larger of the list kernel's and the down kernel's (partials) shared memory
    const size_t down_shared = (size_t)DB_WARPS * T * (DB_OUTS + 16);  // DB_MMA: 16 columns
    const size_t lists_shared = ((size_t)E + 1) * (1 + LIST_THREADS / 32) + 2 * (size_t)T * K;  // + warps' counts
    std::vector<float> shared(std::max(down_shared, lists_shared), __uint_as_float(0x7fc00000u));
    wdb_dynamic_shared = shared.data();
#if PER_PAIR  // no lists: a pair per gate_up block row, a token per down block (a warp per slot)
    (void)slots;
    launch(gu_blocks, GB_WARPS * 32,
           [&] { moe_gate_up_pair(x.data(), w13.data(), s13, ids.data(), inter.data(), H, I, E, K, T * K); });
    launch(dn_blocks, 32 * K, [&] {
        moe_down_token(inter.data(), w2.data(), s2, ids.data(), wts.data(), out.data(), f32, T, H, I, E, K);
    });
#else
    launch(1, LIST_THREADS, [&] { moe_expert_lists(ids.data(), T * K, E, slots, lists.data()); });
#if GB_MMA
#define GATE_UP_KERNEL moe_gate_up_mma
#else
#define GATE_UP_KERNEL moe_gate_up_batched
#endif
#if DB_MMA
#define DOWN_KERNEL moe_down_mma
#else
#define DOWN_KERNEL moe_down_batched
#endif
    launch(gu_blocks, GB_WARPS * 32,
           [&] { GATE_UP_KERNEL(x.data(), w13.data(), s13, lists.data(), inter.data(), H, I, E, K, slots, T * K); });
#if DB_GROUPED
    std::vector<float> pair_out((size_t)T * K * H, __uint_as_float(0x7fc00000u));
    launch(dn_blocks, DB_WARPS * 32, [&] {
        moe_down_grouped(inter.data(), w2.data(), s2, wts.data(), lists.data(), pair_out.data(), H, I, E, K, slots,
                         T * K);
    });
    launch((T * (H / 4) + 255) / 256, 256,
           [&] { moe_sum_slots(pair_out.data(), ids.data(), out.data(), f32, T, H, E, K); });
#else
    launch(dn_blocks, DB_WARPS * 32, [&] {
        DOWN_KERNEL(inter.data(), w2.data(), s2, ids.data(), wts.data(), lists.data(), out.data(), f32, T, H, I, E, K,
                    slots);
    });
#endif
#endif  // PER_PAIR
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

def _write_inputs(tmp: str, problem: Problem, ids: np.ndarray | None) -> None:
    """The emulator's inputs; weights of another format (a Quantized w13 / w2) as their bytes and scales, if any."""
    problem.x.tofile(f"{tmp}/x.bin")
    for name in ("w13", "w2"):
        weights = getattr(problem, name)
        if isinstance(weights, Quantized):
            weights.values.view(np.uint8).tofile(f"{tmp}/{name}.bin")
            if weights.scales is not None:
                weights.scales.astype(np.float32).tofile(f"{tmp}/{name.replace('w', 's')}.bin")
        else:
            weights.tofile(f"{tmp}/{name}.bin")
    np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
    problem.topk_weights.tofile(f"{tmp}/wts.bin")


def _emulate(problem: Problem, ids: np.ndarray | None = None, out_dtype: Any = BF16,
             **params: int) -> dict[str, np.ndarray]:
    """Run the three kernels' CUDA C on the CPU with the CuPy path's geometry: out, intermediate, lists."""
    dims = _dims(problem)
    resolved = wdb.resolve_params(dims, **params)
    binary = build_emulator(wdb.SOURCE.render(**resolved), EMULATION_HARNESS)
    f32 = int(np.dtype(out_dtype) == np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        _write_inputs(tmp, problem, ids)
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k, f32,
                     wdb.gate_up_blocks(dims, resolved), wdb.down_blocks(dims, resolved), wdb.slots(dims),
                     wdb.lists_size(dims), tmp)
        raw = np.fromfile(f"{tmp}/out.bin", np.float32 if f32 else np.uint16)
        inter = np.fromfile(f"{tmp}/inter.bin", np.uint16).reshape(dims.tokens, dims.top_k, dims.intermediate)
        lists = np.fromfile(f"{tmp}/lists.bin", np.int32)
    out = raw.reshape(dims.tokens, dims.hidden) if f32 else raw.view(BF16).reshape(dims.tokens, dims.hidden)
    return {"out": out, "inter": inter, "lists": lists}


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


EMULATED = [  # (shape, T, routing, knobs, also fp32 out); small: ~1 ms per warp on 2 cores
    ("tiny", 3, "uniform", {}, True),
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_TILE": 1, "DB_TILE": 1}, False),
    ("tiny", 5, "same", {"GB_TILE": 2, "DB_TILE": 3, "GB_OUTS": 3, "DB_OUTS": 3, "DB_WARPS": 3}, False),
    ("tiny", 4, "zipf", {"DB_EARLY_INTER": 0, "DB_UNROLL": 2, "GB_UNROLL": 1}, False),
    (MoEShape("h16-i8-k40", 16, 8, 44, 40), 8, "zipf", {"LIST_THREADS": 32, "LIST_PER": 0}, False),  # 320 pairs
    # the list kernel's warps rank 96 / 96 / 96 / 32 pairs each, hot experts spanning all four ranges
    (MoEShape("h16-i8-k40", 16, 8, 44, 40), 8, "zipf", {"LIST_THREADS": 128, "LIST_PER": 0}, False),
    (MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {}, True),
    (MoEShape("h264-i40", 264, 40, 3, 2), 4, "zipf",
     {"GB_BYTES": 16, "GB_UNROLL": 1, "DB_BYTES": 8, "DB_OUTS": 5, "LIST_THREADS": 32, "LIST_PER": 0}, False),
    (MoEShape("h64-k40", 64, 24, 44, 40), 2, "uniform",
     {"GB_BYTES": 4, "GB_OUTS": 4, "DB_BYTES": 4, "LIST_THREADS": 32, "LIST_PER": 2}, False),
]


# H = 200, I = 136: several k rounds per row with masked tails, a partial last down block, several experts per warp
MULTI_SHAPE = MoEShape("h200-i136", 200, 136, 5, 3)
EMULATED += [
    # tensor-core kernels: masked k tails (25 / 17 chunks), experts with more than 8 (NBLK 1) pairs, 16 columns
    # per block over H = 200 (a partial last block), several experts per down warp, duplicate ids in a token
    (MULTI_SHAPE, 9, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "GB_WARPS": 2, "DB_WARPS": 2, "GB_UNROLL": 2,
                              "DB_UNROLL": 3, "LIST_THREADS": 32, "LIST_PER": 0}, True),
    (MULTI_SHAPE, 12, "same", {"GB_MMA": 1, "DB_MMA": 1, "GB_NBLK": 2, "DB_NBLK": 2, "DB_WARPS": 3,
                               "LIST_THREADS": 32, "LIST_PER": 0}, False),
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1}, False),
    (MULTI_SHAPE, 7, "uniform", {"DB_MMA": 1, "DB_WARPS": 2, "LIST_THREADS": 32, "LIST_PER": 0}, True),  # mixed
    # the balanced (slot, k block) runs (DB_BALANCE): 5 k blocks per slot over 3 / 4 warps, so runs start and end
    # inside slots (partial k ranges, masked tails), duplicate ids in a token
    (MULTI_SHAPE, 9, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "DB_WARPS": 3, "DB_BALANCE": 1,
                              "DB_UNROLL": 2, "LIST_THREADS": 32, "LIST_PER": 0}, True),
    (MULTI_SHAPE, 12, "same", {"DB_MMA": 1, "DB_WARPS": 4, "DB_BALANCE": 1, "DB_NBLK": 2, "DB_EARLY_W2": 1,
                               "LIST_THREADS": 32, "LIST_PER": 0}, False),
    # the tile table (PAIR_TILES): hot slots cut into tiles of 8 / 16 pairs (partial last tiles), gate_up one
    # block row per tile, the down's balanced runs over (tile, k block) items; duplicate ids in a token
    (MULTI_SHAPE, 12, "same", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": -1, "DB_WARPS": 3,
                               "LIST_THREADS": 32, "LIST_PER": 0}, True),
    (MULTI_SHAPE, 14, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": -1, "GB_NBLK": 2,
                               "DB_NBLK": 2, "DB_WARPS": 4, "DB_EARLY_W2": 1, "LIST_THREADS": 32, "LIST_PER": 0},
     False),
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1,
                                                                   "DB_BALANCE": -1}, False),
    # the grouped down (DB_GROUPED): one block row per tile, per-pair rows, the slot-order sum; partial 16-row groups
    # over H = 200, tiles of 8 and 16 pairs, duplicate ids in a token
    (MULTI_SHAPE, 12, "same", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "DB_WARPS": 3,
                               "LIST_THREADS": 32, "LIST_PER": 0}, True),
    (MULTI_SHAPE, 9, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_NBLK": 2,
                              "DB_EARLY_W2": 1, "LIST_THREADS": 32, "LIST_PER": 0}, False),
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1,
                                                                   "DB_GROUPED": 1}, False),
    # the grouped down's auto DB_NBLK (= GB_NBLK: a 16-pair tile in one pass)
    (MULTI_SHAPE, 9, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_NBLK": 0,
                              "GB_UNROLL": 2, "LIST_THREADS": 32, "LIST_PER": 0}, True),
    # the per-pair path (PER_PAIR: no lists, a pair per gate_up block row, a token per down block): partial 16-row
    # groups over H = 200, duplicate ids in a token, a k tail
    (MULTI_SHAPE, 6, "same", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "DB_EARLY_W2": 1, "GB_WARPS": 2}, True),
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1,
                                                                   "DB_UNROLL": 2}, False),
    # GB_KSPLIT: the gate_up's k chains in 4 ranges over 25 chunks (8, 8, 8, 1), a warp per range (the grouped
    # path's ranges in one warp: test_split_k_forms_agree_and_are_batch_invariant_emulated)
    (MULTI_SHAPE, 6, "same", {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 4, "GB_WARPS": 4}, False),
    # PAIRS_INNER: the per-pair blocks numbered pairs (tokens) fastest, one chain and split chains
    (MULTI_SHAPE, 6, "same", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "GB_WARPS": 2, "PAIRS_INNER": 1}, True),
    (MULTI_SHAPE, 5, "zipf", {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 4, "GB_WARPS": 4, "PAIRS_INNER": 1}, False),
    # HOT_NBLK 3: tiles of up to 24 pairs, each (12 pairs) in one gate_up pass of three 8-pair blocks, the last
    # empty; the balanced down's (tile, k block) runs over them
    (MULTI_SHAPE, 12, "same", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": -1, "HOT_NBLK": 3,
                               "DB_WARPS": 3, "LIST_THREADS": 32, "LIST_PER": 0}, False),
]


EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{i}" for i, c in enumerate(EMULATED)]


# the quick subset: the defaults (FMA kernels, bf16 and fp32 out) and the tensor-core kernels on the tiny preset with
# duplicate ids; the rest (every knob family, odd shapes, the list kernel's warps) is slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "params", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0, 11, 17}))
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any,
                                     params: dict[str, int], fp32: bool) -> None:
    """The real kernel text: lists vs the NumPy model, out vs the reference, intermediate vs the strict kernel."""
    problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    dims = _dims(problem)
    got = _emulate(problem, **params)
    if not params.get("PER_PAIR"):  # the per-pair path writes no lists
        _assert_lists_equal(_unpack_lists(got["lists"], dims),
                            expert_lists_numpy(problem.topk_ids, dims.experts, _tile_pairs(dims, params)))
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    own_order = bool(params.get("GB_MMA") or params.get("DB_MMA"))
    _assert_matches(got["out"], faithful, oracle, f"emulated {problem.shape.name} {params}", own_order=own_order)
    resolved = wdb.resolve_params(dims, **params)
    if not resolved["GB_MMA"]:  # the tensor core sums in its own order: compared through the output only
        strict = _emulate_strict_gate_up(problem, GU_BYTES=resolved["GB_BYTES"], GU_UNROLL=1)
        assert np.array_equal(got["inter"], strict), "intermediate differs from the strict kernel's"
    if fp32:
        got32 = _emulate(problem, out_dtype=np.float32, **params)["out"]
        faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, f"emulated fp32 out {problem.shape.name}", own_order=own_order)


MMA_BALANCED = {"GB_MMA": 1, "DB_MMA": 1, "DB_WARPS": 3, "DB_BALANCE": 1}


@pytest.mark.parametrize("knobs", [pytest.param({"GB_TILE": 2, "DB_TILE": 2}, id="fma"),
                                   pytest.param(MMA_BALANCED, id="mma-balanced", marks=pytest.mark.slow),
                                   pytest.param({**MMA_BALANCED, "PAIR_TILES": 1}, id="mma-tiles",
                                                marks=pytest.mark.slow),
                                   pytest.param({"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1},
                                                id="mma-grouped", marks=pytest.mark.slow),
                                   pytest.param({"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1}, id="per-pair",
                                                marks=pytest.mark.slow)])
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator, knobs: dict[str, int]) -> None:
    """Out-of-range ids reach the kernels (as under capture): those tokens' rows NaN, the others exact."""
    problem = make_problem("tiny", 5, seed=_seed(rng))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -3
    ids[2, 1] = 2**31 - 1
    got = _emulate(problem, ids=ids, **knobs)
    assert np.all(np.isnan(got["out"][[0, 2]].astype(np.float32)))
    dims = _dims(problem)
    if not knobs.get("PER_PAIR"):
        _assert_lists_equal(_unpack_lists(got["lists"], dims),
                            expert_lists_numpy(ids, problem.shape.experts, _tile_pairs(dims, knobs)))
    inter = got["inter"]
    assert np.all(inter[0, 1] == 0x7FC0) and np.all(inter[2] == 0x7FC0)  # bad pairs: NaN intermediate
    good = [1, 3, 4]
    sub = Problem(problem.shape, 3, 0, "fixed", problem.x[good], problem.w13, problem.w2, problem.topk_ids[good],
                  problem.topk_weights[good])
    _assert_matches(got["out"][good], moe_decode(*sub.arrays, mode="warp_decode"),
                    moe_decode(*sub.arrays, mode="fp64"), "emulated good tokens", own_order=bool(knobs.get("DB_MMA")))


T16_SHAPE = MoEShape("h96-i64", 96, 64, 6, 2)  # 32-value tiles: 3 k blocks along H, 2 along I
T16_WIDE = MoEShape("h512-i32", 512, 32, 6, 2)  # 8 k ranges of 2 k blocks each (the invariant pair's split chains)
T16_EMULATED = [  # (shape, T, routing, knobs): the tensor-core forms that read bf16-t16 tiles
    (T16_SHAPE, 3, "uniform", wdb.PER_PAIR_KNOBS),
    (T16_SHAPE, 12, "zipf", {**wdb.MMA_KNOBS, "GB_NBLK": 1, "HOT_NBLK": 2, "DB_GROUPED": 1, "LIST_THREADS": 32,
                             "LIST_PER": 0}),   # hot passes, the grouped down
    (T16_SHAPE, 6, "same", {**wdb.MMA_KNOBS, "DB_GROUPED": 0, "DB_BALANCE": 1, "DB_WARPS": 3, "DB_UNROLL": 1,
                            "LIST_THREADS": 32, "LIST_PER": 0}),   # runs cut inside rows
    (T16_WIDE, 9, "zipf", {**wdb.GROUPED_KNOBS, "GB_UNROLL": 2, "LIST_THREADS": 32, "LIST_PER": 0}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs"), T16_EMULATED,
                         ids=["pairs", "hot-grouped", "balanced", "invariant-grouped"])
def test_bf16_tiles_emulated(shape: MoEShape, tokens: int, routing: Any, knobs: dict[str, int]) -> None:
    """bf16-t16 (W_TILED 1 without W_FP8): the same bf16 values in 16-row x 32-value tiles give the row layout's bits
    in every tensor-core form -- only the addresses move -- and the reference reads the tiles back."""
    base = make_problem(shape, tokens, seed=tokens, routing=routing)
    t13, t2 = quantize_weights(base.w13, base.w2, BF16_T16.name)
    assert (t13.layout, t13.scales, t13.values.dtype) == ("t16", None, BF16)
    tiled = dataclasses.replace(base, w13=t13, w2=t2)
    want = _emulate(base, out_dtype=np.float32, **knobs)
    got = _emulate(tiled, out_dtype=np.float32, **{**knobs, "W_TILED": 1})
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32))
    assert np.array_equal(moe_decode(*tiled.arrays, weight_format=BF16_T16.name).view(np.uint16),
                          moe_decode(*base.arrays).view(np.uint16))


def test_bf16_tiles_refused_where_they_cannot_run() -> None:
    """W_TILED on bf16 needs both kernels on tensor cores and H, I multiples of 32; the entry point refuses weights
    whose format the knobs do not read, naming both."""
    with pytest.raises(ValueError, match="W_TILED reads 32-value tiles: H and I must be multiples of 32"):
        wdb.resolve_params(Dims(2, 48, 64, 4, 2), **wdb.MMA_T16_KNOBS)
    with pytest.raises(ValueError, match="W_TILED reads tiles in the tensor-core kernels' 64-byte k blocks"):
        wdb.resolve_params(Dims(2, 64, 64, 4, 2), W_TILED=1)
    assert wdb.resolve_params(Dims(2, 64, 64, 4, 2), **wdb.MMA_T16_KNOBS)["W_TILED"] == 1


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def cupy_mod():
    import cupy

    yield cupy
    cupy.get_default_memory_pool().free_all_blocks()


def _poison(cupy: Any, ws: wdb.Workspace) -> None:
    ws.intermediate.view(cupy.uint16).fill(0x7FC0)
    ws.lists.fill(-7)
    if ws.pair_out is not None:
        ws.pair_out.fill(cupy.nan)


def _poisoned_workspace(cupy: Any, dims: Dims, **params: Any) -> wdb.Workspace:
    ws = wdb.make_workspace(dims, **params)
    _poison(cupy, ws)
    return ws


def _run_and_check(cupy: Any, problem: Problem, what: str, out_dtype: Any = BF16, strict_inter: bool = False,
                   **params: Any) -> np.ndarray:
    dims = _dims(problem)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden, out_dtype)
    ws = _poisoned_workspace(cupy, dims, **params)
    returned = wdb.warp_decode_batched(*problem.arrays, out=out, workspace=ws, **params)
    assert returned is out
    cupy.cuda.runtime.deviceSynchronize()
    got = cupy.asnumpy(out)
    lists = _unpack_lists(cupy.asnumpy(ws.lists), dims)
    _assert_lists_equal(lists, expert_lists_numpy(cupy.asnumpy(problem.topk_ids), dims.experts,
                                                  _tile_pairs(dims, params)))
    if strict_inter:
        resolved = wdb.resolve_params(dims, **params)
        strict = wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate)
        wdc.gate_up(problem.x, problem.w13, problem.topk_ids, strict, GU_BYTES=resolved["GB_BYTES"])
        cupy.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy.asnumpy(ws.intermediate.view(cupy.uint16)),
                              cupy.asnumpy(strict.view(cupy.uint16))), f"{what}: intermediate != strict's"
    faithful, oracle = _references(problem, out_dtype)
    _assert_matches(got, faithful, oracle, what, own_order=bool(params.get("GB_MMA") or params.get("DB_MMA")))
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("model", list(PRESETS))
def test_presets(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int) -> None:
    problem = make_problem(model, tokens, seed=_seed(rng), routing="uniform", xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{model} T={tokens}", strict_inter=True)
    del problem


MMA = dict(wdb.MMA_KNOBS)  # what cupy:warp-decode-mma and kernels.dispatch run
MMA_TILES = {**MMA, "PAIR_TILES": 1}  # the work units both ways: tiles of a slot's pairs, whole slots
MMA_SLOTS = {**MMA, "PAIR_TILES": 0, "DB_GROUPED": 0}
MMA_GROUPED = {**MMA, "PAIR_TILES": 1, "DB_GROUPED": 1}  # the down over the tiles too, then the slot-order sum
MMA_UNITS = {"tiles": {**MMA_TILES, "DB_GROUPED": 0}, "slots": MMA_SLOTS, "grouped": MMA_GROUPED}
MMA_CASES = [("qwen3-30b-a3b", 1, "uniform"), ("qwen3-30b-a3b", 37, "uniform"), ("qwen3-30b-a3b", 64, "zipf"),
             ("qwen3-30b-a3b", 64, "uniform"),
             ("qwen3-235b-a22b", 16, "uniform"), ("mixtral-8x7b", 8, "uniform"), ("qwen3-30b-a3b", 6, "same")]


@pytest.mark.gpu
@pytest.mark.parametrize("units", list(MMA_UNITS))
@pytest.mark.parametrize(("model", "tokens", "routing"), MMA_CASES)
def test_mma_kernels(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int, routing: str,
                     units: str) -> None:
    """The tensor-core kernels (work units: tiles of pairs, or whole slots) against the references (NaN-poisoned
    buffers), then bitwise over two more runs."""
    knobs = MMA_UNITS[units]
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
    first = _run_and_check(cupy_mod, problem, f"mma {model} T={tokens} {routing} {units}", **knobs)
    for _ in range(2):
        out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
        wdb.warp_decode_batched(*problem.arrays, out=out, **knobs)
        cupy_mod.cuda.runtime.deviceSynchronize()
        assert np.array_equal(cupy_mod.asnumpy(out).view(np.uint16), first.view(np.uint16))


def form_cases(cases: list[tuple]) -> list[Any]:
    """(model, tokens, routing, form) cases as pytest params named model-tokens-routing-form."""
    return [pytest.param(*case, id=f"{getattr(case[0], 'name', case[0])}-{case[1]}-{case[2]}-{case[3]}")
            for case in cases]


INVARIANT_CASES = [  # the batch-invariant policy's two knob sets where it runs them, and an odd shape each
    ("qwen3-30b-a3b", 1, "uniform", "pairs"), ("qwen3-235b-a22b", 2, "zipf", "pairs"),
    ("qwen3-30b-a3b", 2, "same", "pairs"), (MULTI_SHAPE, 3, "zipf-2", "pairs"), ("qwen3-30b-a3b", 8, "zipf", "grouped"),
    ("qwen3-235b-a22b", 64, "uniform", "grouped"), (MULTI_SHAPE, 9, "correlated", "grouped")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "form"), form_cases(INVARIANT_CASES))
def test_invariant_knob_sets(cupy_mod: Any, rng: np.random.Generator, model: Any, tokens: int, routing: str,
                             form: str) -> None:
    """``PER_PAIR_KNOBS`` / ``GROUPED_KNOBS`` (their GB_KSPLIT ranges included) against the references (NaN-poisoned
    output), then bitwise over a second run."""
    knobs = {"pairs": wdb.PER_PAIR_KNOBS, "grouped": wdb.GROUPED_KNOBS}[form]
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
    runs = []
    for _ in range(2):
        out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
        wdb.warp_decode_batched(*problem.arrays, out=out, **knobs)
        cupy_mod.cuda.runtime.deviceSynchronize()
        runs.append(cupy_mod.asnumpy(out))
    faithful, oracle = _references(problem)
    _assert_matches(runs[0], faithful, oracle, f"invariant {form} {problem.shape.name} T={tokens} {routing}",
                    own_order=True)
    assert np.array_equal(runs[1].view(np.uint16), runs[0].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["zipf-1", "zipf-2", "correlated", "same"])
@pytest.mark.parametrize("path", ["fma", "mixed", "mma-tiles", "mma-slots", "mma-grouped"])
def test_batched_paths_under_skewed_routings(cupy_mod: Any, rng: np.random.Generator, routing: str, path: str) -> None:
    """Every batched path under the routings that stand for real routers (kernels.routing.GENERATORS): a hot
    expert's many pairs, a batch sharing most of its experts, all tokens on one set."""
    knobs = {"fma": {}, "mixed": wdb.MIXED_KNOBS, **{f"mma-{k}": v for k, v in MMA_UNITS.items()}}[path]
    problem = make_problem("qwen3-30b-a3b", 32, seed=_seed(rng), routing=routing, xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{path} qwen3-30b T=32 {routing}", strict_inter=path in ("fma", "mixed"),
                   **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"), [("qwen3-30b-a3b", 4, "uniform"), ("qwen3-30b-a3b", 8, "same"),
                                                        ("qwen3-235b-a22b", 3, "zipf")])
def test_mixed_kernels(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int, routing: str) -> None:
    """FMA gate_up + tensor-core down (cupy:warp-decode-mixed): the intermediate is bitwise the strict kernel's,
    the output within the tensor-core rule, bitwise repeatable."""
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
    first = _run_and_check(cupy_mod, problem, f"mixed {model} T={tokens} {routing}", strict_inter=True,
                           **wdb.MIXED_KNOBS)
    out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
    wdb.warp_decode_batched(*problem.arrays, out=out, **wdb.MIXED_KNOBS)
    cupy_mod.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy_mod.asnumpy(out).view(np.uint16), first.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ODD_SHAPES))
def test_mma_odd_shapes(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    for tokens, knobs in ((5, {}), (37, {"GB_NBLK": 2, "DB_NBLK": 2, "GB_UNROLL": 8, "DB_UNROLL": 2}),
                          (37, {"PAIR_TILES": 1, "GB_NBLK": 1}), (37, {"PAIR_TILES": 1, "GB_NBLK": 2, "DB_WARPS": 5}),
                          (37, {"PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_NBLK": 2, "DB_WARPS": 3})):
        problem = make_problem(ODD_SHAPES[name], tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"mma {name} T={tokens} {knobs}", **{**MMA, **knobs})


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
T16_FORMS = {"pairs": (wdb.PER_PAIR_T16_KNOBS, wdb.PER_PAIR_T16_VARIANT),
             "mma": (wdb.MMA_T16_KNOBS, wdb.MMA_T16_VARIANT),
             "grouped": (wdb.GROUPED_T16_KNOBS, wdb.GROUPED_T16_VARIANT)}


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "form"), form_cases(T16_GPU_CASES))
def test_bf16_tiles(cupy_mod: Any, rng: np.random.Generator, model: Any, tokens: int, routing: str,
                    form: str) -> None:
    """bf16-t16 weights (tiled on the device) against the references (NaN-poisoned output and workspace), bitwise
    equal to the same knobs on the row layout, over a repeat and over a CUDA-graph replay of the variant."""
    cupy = cupy_mod
    knobs, variant = T16_FORMS[form]
    problem = make_problem(model, tokens, seed=_seed(rng), routing=routing, xp=cupy)
    tiled = dataclasses.replace(problem, **dict(zip(("w13", "w2"), BF16_T16.from_rows(problem.w13, problem.w2),
                                                    strict=True)))
    dims = _dims(problem)
    runs = []
    for _ in range(2):
        out = _poisoned_out(cupy, tokens, dims.hidden)
        wdb.warp_decode_batched(*tiled.arrays, out=out, workspace=_poisoned_workspace(cupy, dims, **knobs), **knobs)
        cupy.cuda.runtime.deviceSynchronize()
        runs.append(cupy.asnumpy(out))
    faithful, oracle = _references(problem)
    _assert_matches(runs[0], faithful, oracle, f"bf16-t16 {form} {dims}", own_order=True)
    assert np.array_equal(runs[1].view(np.uint16), runs[0].view(np.uint16))
    row_knobs = {k: v for k, v in knobs.items() if k != "W_TILED"}
    on_rows = wdb.warp_decode_batched(*problem.arrays, **row_knobs)
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


@pytest.mark.gpu
def test_float32_out(cupy_mod: Any, rng: np.random.Generator) -> None:
    for model, tokens in (("tiny", 3), ("qwen3-30b-a3b", 4)):
        problem = make_problem(model, tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{model} fp32 out", out_dtype=np.float32)


@pytest.mark.gpu
def test_bitwise_identical_over_three_runs(cupy_mod: Any, rng: np.random.Generator) -> None:
    for shape, tokens in ((PRESETS["qwen3-30b-a3b"], 64), (ODD_SHAPES["h264-i40"], 5)):
        problem = make_problem(shape, tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        results = []
        for _ in range(3):
            out = _poisoned_out(cupy_mod, tokens, shape.hidden)
            wdb.warp_decode_batched(*problem.arrays, out=out)
            cupy_mod.cuda.runtime.deviceSynchronize()
            results.append(cupy_mod.asnumpy(out).view(np.uint16))
        assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


@pytest.mark.gpu
def test_out_of_range_ids_raise_outside_capture(cupy_mod: Any, rng: np.random.Generator) -> None:
    problem = make_problem("tiny", 3, seed=_seed(rng), xp=cupy_mod)
    for bad in (problem.shape.experts, -1):
        ids = problem.topk_ids.copy()
        ids[1, 0] = bad
        with pytest.raises(ValueError, match="topk_ids"):
            wdb.warp_decode_batched(problem.x, problem.w13, problem.w2, ids, problem.topk_weights)


@pytest.mark.gpu
def test_bad_ids_in_kernel_give_nan_rows(cupy_mod: Any, rng: np.random.Generator) -> None:
    """Stages launched directly (no value checks, as under capture): bad tokens NaN, the rest still exact."""
    cupy = cupy_mod
    for shape, tokens in ((PRESETS["tiny"], 4), (ODD_SHAPES["h64-k40"], 3), (PRESETS["qwen3-30b-a3b"], 9)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy)
        ids = problem.topk_ids.copy()
        ids[0, -1] = shape.experts
        ids[2, 0] = -7
        ids[2, -1] = 2**31 - 1
        dims = _dims(problem)
        launch = wdb.FAMILY.build(dims)
        out = _poisoned_out(cupy, tokens, shape.hidden)
        launch(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, out)
        cupy.cuda.runtime.deviceSynchronize()
        got = cupy.asnumpy(out).astype(np.float32)
        assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[2]))
        good = [t for t in range(tokens) if t not in (0, 2)]
        sub = Problem(shape, len(good), 0, "fixed", problem.x[good], problem.w13, problem.w2,
                      problem.topk_ids[good], problem.topk_weights[good])
        faithful, oracle = _references(sub)
        _assert_matches(cupy.asnumpy(out)[good], faithful, oracle, "good tokens beside bad ids")


def _capture_and_replay(cupy: Any, problem: Problem, launch: Any, what: str) -> None:
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
    _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{what}: graph replay")
    # new routing (other experts, other counts) written into the same buffers, same graph
    with stream:  # on the replay's stream: a non-blocking stream does not wait for the legacy default stream
        write_fresh_inputs(cupy, problem, problem.seed + 1)
        out.view(cupy.uint16).fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{what}: graph replay on new routing")


@pytest.mark.gpu
def test_graph_capture(cupy_mod: Any, rng: np.random.Generator) -> None:
    cupy = cupy_mod
    for tokens in (4, 33):
        problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
        dims = _dims(problem)
        ws = _poisoned_workspace(cupy, dims)

        def launch(x: Any, w13: Any, w2: Any, ids: Any, wts: Any, out: Any, ws: Any = ws) -> None:
            wdb.warp_decode_batched(x, w13, w2, ids, wts, out=out, workspace=ws)

        _capture_and_replay(cupy, problem, launch, f"entry point T={tokens}")
        _capture_and_replay(cupy, problem, wdb.VARIANT.make(dims), f"variant T={tokens}")


@pytest.mark.gpu
def test_stages_and_variant_match_the_entry_point(cupy_mod: Any, rng: np.random.Generator) -> None:
    cupy = cupy_mod
    problem = make_problem(ODD_SHAPES["h264-i40"], 7, seed=_seed(rng), xp=cupy)
    dims = _dims(problem)
    expected = cupy.asnumpy(wdb.warp_decode_batched(*problem.arrays)).view(np.uint16)
    launch = wdb.VARIANT.make(dims)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    launch(*problem.arrays, out)
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    stages = launch.stages(*problem.arrays, out)
    assert [name for name, _ in stages] == ["expert_lists", "gate_up", "down"]
    for _, fn in stages:
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)


GRID_SAMPLE = [
    {"GB_OUTS": 1, "DB_OUTS": 2, "GB_TILE": 2, "DB_TILE": 2},
    {"GB_OUTS": 3, "GB_UNROLL": 1, "DB_OUTS": 3, "DB_UNROLL": 3, "GB_TILE": 3, "DB_TILE": 5},
    {"GB_BYTES": 16, "GB_UNROLL": 2, "DB_BYTES": 8, "DB_UNROLL": 4},
    {"GB_BYTES": 4, "DB_BYTES": 4, "GB_WARPS": 1, "DB_WARPS": 1, "LIST_THREADS": 1024},
    {"GB_WARPS": 8, "DB_WARPS": 4, "GB_MAX_REGS": 0, "DB_MAX_REGS": 0, "DB_OUTS": 8},
    {"DB_EARLY_INTER": 0, "DB_TILE": 8, "GB_TILE": 8},
    {"PDL": 0, "DB_WARPS": 2},
    {"GB_MMA": 1, "DB_MMA": 1, "DB_WARPS": 24, "DB_UNROLL": 2, "DB_MAX_REGS": 0},
    {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "DB_NBLK": 2},
    {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "DB_BALANCE": 1, "DB_UNROLL": 2},
    {"DB_MMA": 1, "DB_NBLK": 2, "PDL": 0},
    {"GB_MMA": 1, "DB_MMA": 1, "DB_BALANCE": 1, "DB_WARPS": 24, "DB_MAX_REGS": 0},
    {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": 1, "GB_NBLK": 2, "DB_NBLK": 2, "GB_WARPS": 2},
    {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": 0, "PDL": 0},
    {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "PDL": 0, "DB_WARPS": 8},
    {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "DB_EARLY_W2": 1, "DB_NBLK": 2, "DB_UNROLL": 2},
    {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_UNROLL": 2, "DB_NBLK": 0},
]


@pytest.mark.gpu
@pytest.mark.parametrize("params", GRID_SAMPLE, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_knobs_keep_results(cupy_mod: Any, rng: np.random.Generator, params: dict[str, int]) -> None:
    for shape, tokens in ((ODD_SHAPES["h264-i40"], 5), (ODD_SHAPES["h64-k40"], 2), (PRESETS["qwen3-30b-a3b"], 19)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{shape.name} {params}", **params)


PDL_CHAIN_CASES = [  # (model, T, knobs): FMA and tensor-core kernels
    ("qwen3-30b-a3b", 8, {}),
    ("qwen3-235b-a22b", 4, {}),
    ("qwen3-30b-a3b", 64, {"GB_MMA": 1, "DB_MMA": 1}),  # 16 down warps: 64 KB of partials, opted into
    ("qwen3-30b-a3b", 37, {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1}),  # w2 loads before the wait
    ("qwen3-30b-a3b", 8, {"DB_MMA": 1, "DB_EARLY_W2": 1}),  # FMA gate_up, tensor-core down
    ("qwen3-30b-a3b", 48, {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "PAIR_TILES": 1, "DB_BALANCE": 1}),  # tiles
    ("qwen3-30b-a3b", 48, {"GB_MMA": 1, "DB_MMA": 1, "DB_EARLY_W2": 1, "PAIR_TILES": 1, "DB_GROUPED": 1}),  # + sum
]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "params"), PDL_CHAIN_CASES,
                         ids=lambda c: c if isinstance(c, (str, int)) else ",".join(f"{k}={v}" for k, v in c.items()))
def test_pdl_chain_where_each_layer_reads_the_last(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int,
                                                   params: dict[str, int]) -> None:
    """Three kernels per layer under PDL, six layers sharing ONE poisoned workspace: layer l + 1's x is layer l's
    output and every layer has its own routing, so a read hoisted above griddepcontrol.wait (the lists, the
    intermediate, x) or a list kernel overwriting the lists while the last layer's down still reads them gives
    other bits. Graph replays must equal the PDL=0 chain bitwise, every time."""
    cupy = cupy_mod
    problem = make_problem(model, tokens, seed=_seed(rng), xp=cupy)
    shape = problem.shape
    routings = []
    for layer in range(6):
        ids, weights = make_routing(tokens, shape.experts, shape.top_k, "zipf" if layer % 2 else "uniform",
                                    _seed(rng))
        routings.append((cupy.asarray(ids), cupy.asarray(weights)))

    def poison(launch: Any) -> None:
        _poison(cupy, launch.workspace)

    assert_pdl_chain_bitwise(cupy, problem, wdb.FAMILY.build, _dims(problem), poison, routings=routings, replays=10,
                             **params)


def _probe_rows(base: Problem, probe: Problem, seed: int, cases: tuple, out_dtype: Any = BF16) -> list[np.ndarray]:
    """The emulated output row of ``probe``'s token for each (T, position, routing of the others, knobs) case: the
    token at that position among T - 1 other tokens, on ``base``'s weights (its bits: uint16 for bf16, uint32 for
    float32 out -- FP32 shows the sum orders that the bf16 rounding may hide)."""
    rows = []
    for tokens, position, routing, knobs in cases:
        others = make_problem(base.shape, tokens, seed=seed + 2 + tokens, routing=routing)
        x, ids, wts = others.x.copy(), others.topk_ids.copy(), others.topk_weights.copy()
        x[position], ids[position], wts[position] = probe.x[0], probe.topk_ids[0], probe.topk_weights[0]
        batch = Problem(base.shape, tokens, seed, "fixed", x, base.w13, base.w2, ids, wts)
        row = _emulate(batch, out_dtype=out_dtype, **knobs)["out"][position]
        rows.append(row.view(np.uint32 if np.dtype(out_dtype) == np.float32 else np.uint16))
    return rows


@pytest.mark.slow
def test_grouped_tensor_core_path_is_batch_invariant_emulated(rng: np.random.Generator) -> None:
    """With the grouped down forced at every T (DB_GROUPED 1), the tensor-core path's numerics never depend on the
    batch: an mma column is one pair, its k order fixed; each pair's weighted row is written once; a token's slots
    are summed in slot order. A probe token's output row is bitwise the same alone and inside batches of other
    tokens (other routings, other positions, 8-pair and 16-pair tiles) -- the property the batch-invariance issue
    asks of a policy, here on the kernels' own text. (At this size the balanced down and the FMA paths happen to
    match too -- their batch-dependent sums differ in ~0.1 % of elements at real shapes -- so this guards the
    grouped design, it does not rank the others.)"""
    shape = PRESETS["tiny"]
    seed = _seed(rng)
    base = make_problem(shape, 16, seed=seed)
    probe = make_problem(shape, 1, seed=seed + 1)
    two_blocks = {**wdb.GROUPED_KNOBS, "GB_NBLK": 2}  # 16-pair tiles: a work knob, the same bits
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", wdb.GROUPED_KNOBS), (3, 1, "uniform", wdb.GROUPED_KNOBS),
                                           (8, 5, "same", wdb.GROUPED_KNOBS), (16, 11, "zipf", two_blocks),
                                           (1, 0, "uniform", wdb.PER_PAIR_KNOBS), (5, 3, "zipf", wdb.PER_PAIR_KNOBS),
                                           (5, 3, "zipf", {**wdb.PER_PAIR_KNOBS, "PAIRS_INNER": 1})),
                       out_dtype=np.float32)
    assert wdb.resolve_params(Dims(16, shape.hidden, shape.intermediate, shape.experts, shape.top_k),
                              **two_blocks)["DB_NBLK"] == 2  # the 16-token batch runs 16-pair tiles
    for row in rows[1:]:  # the per-pair path (no lists, a token per down block) gives the grouped path's bits
        assert np.array_equal(row, rows[0])


# I = 64: 8 chunks of 8 values, the grouped down's k range one whole round of 2 k blocks (H = 256: 4 ranges of 8
# chunks for the split-chain gate_up)
ALIGNED_SHAPE = MoEShape("h256-i64", 256, 64, 5, 3)
ALIGNED_GROUPED = {**wdb.GROUPED_KNOBS, "GB_KSPLIT": 4, "GB_UNROLL": 2, "DB_UNROLL": 2, "LIST_THREADS": 32,
                   "LIST_PER": 0}


def _aligned_forms_agree(rng: np.random.Generator, key: str) -> tuple[Problem, int, dict[str, int], dict[str, int]]:
    """A probe token's FP32 row on ALIGNED_SHAPE: the per-pair form alone, the grouped path with knob ``key`` 1 and 0
    in a batch of 9 (Zipf), and with ``key`` 1 and 16-pair tiles in a batch of 12 (all on one set) -- asserted to be
    the same bits. Returns the batch of 9, its seed, the grouped knobs with ``key`` 1 and the per-pair knobs."""
    seed = _seed(rng)
    base = make_problem(ALIGNED_SHAPE, 9, seed=seed, routing="zipf")
    probe = make_problem(ALIGNED_SHAPE, 1, seed=seed + 1)
    on, off = {**ALIGNED_GROUPED, key: 1}, {**ALIGNED_GROUPED, key: 0}
    pairs = {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 4, "GB_WARPS": 4}
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", pairs), (9, 4, "zipf", on), (9, 4, "zipf", off),
                                           (12, 7, "same", {**on, "GB_NBLK": 2})), out_dtype=np.float32)
    for row in rows[1:]:
        assert np.array_equal(row, rows[0]), key
    return base, seed, on, pairs


@pytest.mark.slow
def test_whole_ranges_emulated(rng: np.random.Generator) -> None:
    """DB_WHOLE_RANGES 1 (no masked round compiled in the bf16 grouped down) gives the masked rounds' bits, and a
    probe token the per-pair form's bits in any batch; auto takes it where the down's range is whole rounds and
    one 8-pair block runs per pass, and asking for it elsewhere is an error."""
    base, _, whole, _ = _aligned_forms_agree(rng, "DB_WHOLE_RANGES")
    got = _emulate(base, **whole)["out"]
    _assert_matches(got, moe_decode(*base.arrays, mode="warp_decode"), moe_decode(*base.arrays, mode="fp64"),
                    "whole ranges", own_order=True)

    def resolved(shape: MoEShape, tokens: int = 4, **knobs: int) -> int:
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        return wdb.resolve_params(dims, **knobs)["DB_WHOLE_RANGES"]

    auto = {**ALIGNED_GROUPED, "DB_WHOLE_RANGES": -1}
    assert [resolved(ALIGNED_SHAPE, **auto), resolved(ALIGNED_SHAPE, **{**auto, "DB_UNROLL": 4}),
            resolved(ALIGNED_SHAPE, **{**auto, "GB_NBLK": 2}), resolved(PRESETS["tiny"], **auto)] == [1, 0, 0, 0]
    qwen = PRESETS["qwen3-30b-a3b"]  # I = 768: 96 chunks; one 8-pair block at every T unless set
    assert [resolved(qwen, t, **wdb.GROUPED_KNOBS) for t in (1, 16, 64)] == [1, 1, 1]
    assert resolved(qwen, 64, **{**wdb.GROUPED_KNOBS, "GB_NBLK": 2}) == 0
    assert [resolved(qwen, 16, **k) for k in (wdb.MMA_KNOBS, wdb.FP8_GROUPED_KNOBS, wdb.PER_PAIR_KNOBS)] == [0, 0, 0]
    with pytest.raises(ValueError, match="DB_WHOLE_RANGES 1 compiles the grouped down's whole rounds only"):
        resolved(PRESETS["tiny"], **{**ALIGNED_GROUPED, "DB_WHOLE_RANGES": 1})  # I = 48: 6 chunks
    with pytest.raises(ValueError, match="DB_WHOLE_RANGES 1 compiles the grouped down's whole rounds only"):
        resolved(ALIGNED_SHAPE, **{**wdb.FP8_GROUPED_KNOBS, "DB_WHOLE_RANGES": 1})


@pytest.mark.slow
def test_range_flush_emulated(rng: np.random.Generator) -> None:
    """GB_RANGE_FLUSH 1 (the split-chain gate_up's ranges in one loop, each chain added at its range's end) gives
    the loop per range's bits and the per-pair form's in any batch -- also with a short last range ending in a
    partial round and an empty range past H -- and is chosen exactly where no round straddles two ranges."""
    base, seed, flush, pairs = _aligned_forms_agree(rng, "GB_RANGE_FLUSH")
    per_range = {**flush, "GB_RANGE_FLUSH": 0}
    # H = 200: 25 chunks in 8 ranges of 4 -- the seventh 1 chunk long (a partial round), the eighth empty
    odd = make_problem(MULTI_SHAPE, 7, seed=seed + 2, routing="zipf")
    knobs = {**wdb.GROUPED_KNOBS, "GB_UNROLL": 1, "LIST_THREADS": 32, "LIST_PER": 0}
    got = _emulate(odd, out_dtype=np.float32, **{**knobs, "GB_RANGE_FLUSH": 1})
    want = _emulate(odd, out_dtype=np.float32, **{**knobs, "GB_RANGE_FLUSH": 0})
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
    for case in (flush, per_range, pairs):
        inter = bf16_to_f32(_emulate(ones, **case)["inter"][:, :, 5].view(BF16))
        assert np.all(inter == expect), (case, inter)

    def resolved(shape: MoEShape, **knobs: int) -> int:
        dims = Dims(4, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        return wdb.resolve_params(dims, **knobs)["GB_RANGE_FLUSH"]

    auto = {"GB_RANGE_FLUSH": -1}
    assert [resolved(ALIGNED_SHAPE, **{**ALIGNED_GROUPED, **auto}), resolved(MULTI_SHAPE, **{**knobs, **auto}),
            resolved(MULTI_SHAPE, **{**knobs, "GB_UNROLL": 2, **auto}),  # 4-chunk ranges, 8-chunk rounds
            resolved(PRESETS["qwen3-30b-a3b"], **{**wdb.GROUPED_KNOBS, **auto}),
            resolved(PRESETS["qwen3-30b-a3b"], **{**wdb.MMA_KNOBS, **auto})] == [1, 1, 0, 1, 0]
    assert wdb.GROUPED_KNOBS["GB_RANGE_FLUSH"] == -1  # the invariant path's knob set takes it where it can run
    with pytest.raises(ValueError, match="GB_RANGE_FLUSH 1 runs the split-chain gate_up's ranges"):
        resolved(MULTI_SHAPE, **{**knobs, "GB_UNROLL": 2, "GB_RANGE_FLUSH": 1})
    with pytest.raises(ValueError, match="GB_RANGE_FLUSH 1 runs the split-chain gate_up's ranges"):
        resolved(ALIGNED_SHAPE, **{**ALIGNED_GROUPED, "PER_PAIR": 1, "PAIR_TILES": 0, "DB_GROUPED": 0,
                                   "GB_WARPS": 4, "GB_RANGE_FLUSH": 1})  # the per-pair form: a warp per range


@pytest.mark.slow
def test_split_k_forms_agree_and_are_batch_invariant_emulated(rng: np.random.Generator) -> None:
    """GB_KSPLIT: the gate_up's k chains cut into fixed ranges (a function of H alone), the partials added in range
    order. One warp running the ranges in turn (the grouped path, 8- and 16-pair tiles) and a warp per range (the
    per-pair form, partials through shared memory) give a probe token the same bits alone and in any batch; at
    tiny's H = 136 (17 chunks) 4 ranges are 8, 8, 1 and 0 chunks long, 3 ranges 8, 8, 1."""
    shape = PRESETS["tiny"]
    seed = _seed(rng)
    base = make_problem(shape, 16, seed=seed)
    probe = make_problem(shape, 1, seed=seed + 1)
    grouped = {**wdb.GROUPED_KNOBS, "GB_KSPLIT": 4}
    pairs = {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 4, "GB_WARPS": 4}
    rows = _probe_rows(base, probe, seed, ((1, 0, "uniform", pairs), (16, 11, "zipf", {**grouped, "GB_NBLK": 2}),
                                           (3, 1, "uniform", grouped), (5, 3, "zipf", pairs)), out_dtype=np.float32)
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
    for knobs in ({**wdb.GROUPED_KNOBS, "GB_KSPLIT": 3}, {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 3, "GB_WARPS": 3},
                  {**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": 1, "GB_WARPS": 4}, wdb.PER_PAIR_KNOBS, wdb.GROUPED_KNOBS):
        crafted_problem = Problem(shape, 4, seed, "fixed", ones, w13, base.w2, base.topk_ids[:4], base.topk_weights[:4])
        inter = _emulate(crafted_problem, **knobs)["inter"][:, :, 5].view(BF16)
        assert np.all(bf16_to_f32(inter) == expect), (knobs, bf16_to_f32(inter))
