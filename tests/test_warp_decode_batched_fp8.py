"""Batched and tensor-core warp decode on fp8-block128 weights (W_FP8: kernels/warp_decode_batched*.py).

CPU: the kernels' own CUDA C through the g++ emulation (the batched tests' harness) against
``reference.moe_decode(mode="warp_decode", weight_format="fp8-block128")`` and the fp64 oracle on the same weights:
partial scale blocks at both edges (H = 200 / 136, I = 136 / 48), the FMA gate_up's intermediate bitwise the strict
FP8 kernel's, the tensor-core kernels (tiles, balanced and grouped downs), bad ids; the e4m3 -> bf16 fragment trick
over all 256 bytes; the sm_90 compile without spills. GPU: presets and routings, bitwise repeats, graph replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kernels import warp_decode_batched as wdb
from kernels import warp_decode_fp8 as wdf
from kernels.contract import BF16, Dims
from kernels.formats import FP8, FP8_BLOCK128, FP8_BLOCK128_T16, quantize_weights
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tests.test_warp_decode_batched import (
    MULTI_SHAPE,
    _assert_lists_equal,
    _tile_pairs,
    _unpack_lists,
    expert_lists_numpy,
)
from tests.test_warp_decode_batched import _emulate as emulate_batched
from tests.test_warp_decode_fp8 import _emulate as strict_fp8_emulation
from tests.warp_checks import _assert_matches, _poisoned_out, _seed, slow_except

FMT = FP8_BLOCK128.name


def _fp8_problem(problem: Problem) -> Problem:
    """The problem with its weights in fp8-block128 (host arrays: e4m3fn values, float32 scales)."""
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    return dataclasses.replace(problem, w13=q13, w2=q2)


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


def _emulate(problem: Problem, ids: np.ndarray | None = None, out_dtype: Any = BF16,
             **params: int) -> dict[str, np.ndarray]:
    """The batched tests' emulation (out, intermediate, lists) with the W_FP8 kernels on the problem's FP8 weights."""
    return emulate_batched(problem, ids, out_dtype, W_FP8=1, **params)


def _strict_fp8_intermediate(problem: Problem) -> np.ndarray:
    """The strict FP8 kernel's emulated gate_up output [T, K, I] (bf16 bits)."""
    return strict_fp8_emulation(problem, problem.w13, problem.w2, intermediate=True, GU_CHUNK=8)[1]


def _references(problem: Problem, ids: np.ndarray | None = None,
                out_dtype: Any = BF16) -> tuple[np.ndarray, np.ndarray]:
    args = (problem.x, problem.w13, problem.w2, problem.topk_ids if ids is None else ids, problem.topk_weights)
    return (moe_decode(*args, mode="warp_decode", weight_format=FMT, out_dtype=out_dtype),
            moe_decode(*args, mode="fp64", weight_format=FMT))


SHAPE_48 = MoEShape("h200-i48", 200, 48, 6, 2)  # one partial I block, two H blocks (the second partial)
SHAPE_16 = MoEShape("h208-i144", 208, 144, 6, 2)  # multiples of 16 with a partial last scale block along H and I
EMULATED = [  # (shape, T, routing, knobs, also fp32 out)
    ("tiny", 3, "uniform", {"GB_BYTES": 16}, True),  # the FMA kernels as the FP8 variant runs them
    (MULTI_SHAPE, 9, "zipf", {"GB_BYTES": 8, "DB_BYTES": 8, "GB_OUTS": 3, "DB_OUTS": 3, "LIST_THREADS": 32,
                              "LIST_PER": 0}, False),  # 4-byte weight chunks, partial blocks at both edges
    (SHAPE_48, 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_BYTES": 16, "GB_TILE": 2, "DB_TILE": 3},
     False),  # duplicate ids in a token
    # the tensor-core kernels: the tile table with the balanced down, the grouped down, the slot-balanced down
    (MULTI_SHAPE, 12, "same", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_BALANCE": -1, "DB_WARPS": 3,
                               "LIST_THREADS": 32, "LIST_PER": 0}, True),
    (MULTI_SHAPE, 9, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_NBLK": 2,
                              "DB_EARLY_W2": 1, "LIST_THREADS": 32, "LIST_PER": 0}, False),
    (SHAPE_48, 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "DB_BALANCE": 1,
                                                                     "DB_WARPS": 3, "FP8_PRMT": 1}, False),
    (MULTI_SHAPE, 7, "uniform", {"DB_MMA": 1, "DB_WARPS": 2, "GB_BYTES": 16, "LIST_THREADS": 32, "LIST_PER": 0},
     False),  # FMA gate_up, tensor-core down
    (MULTI_SHAPE, 6, "same", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "GB_WARPS": 2, "FP8_PRMT": 1},
     True),  # no lists; the byte-permute widening here and below where FP8_PRMT is 1
    # GB_KSPLIT 2 over two H blocks (the second partial): a range per warp, each 32-wide k block scaled by its block
    (SHAPE_48, 4, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "GB_WARPS": 2, "GB_KSPLIT": 2}, False),
    # 16-value A loads (64-wide k blocks) and scale-block sums, partial blocks at both edges (H = 208, I = 144)
    (SHAPE_16, 7, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1, "GB_NBLK": 2, "DB_NBLK": 2,
                           "FP8_LOAD16": 1, "FP8_BLOCK_SUM": 1, "FP8_PRMT": 1, "LIST_THREADS": 32, "LIST_PER": 0},
     True),
    (SHAPE_16, 6, "uniform", {"GB_MMA": 1, "DB_MMA": 1, "DB_BALANCE": 1, "DB_WARPS": 3, "FP8_LOAD16": 1,
                              "GB_UNROLL": 1, "LIST_THREADS": 32, "LIST_PER": 0}, False),  # runs cut mid-scale-block
    (SHAPE_16, 6, "same", {"GB_MMA": 1, "DB_MMA": 1, "DB_BALANCE": 1, "DB_WARPS": 3, "FP8_BLOCK_SUM": 1,
                           "DB_UNROLL": 3, "LIST_THREADS": 32, "LIST_PER": 0}, False),
    (SHAPE_16, 5, "zipf", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "GB_WARPS": 2, "GB_KSPLIT": 2, "FP8_LOAD16": 1,
                           "FP8_BLOCK_SUM": 1, "FP8_PRMT": 1}, False),  # ranges of 16 + 10 chunks, each flushed
]
EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "routing", "params", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0}))
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any,
                                     params: dict[str, int], fp32: bool) -> None:
    """Lists vs the NumPy model, out vs the reference on the same FP8 weights; the FMA gate_up's intermediate
    bitwise the strict FP8 kernel's at its chunk size (GB_BYTES 16: 8 values)."""
    problem = _fp8_problem(make_problem(shape, tokens, seed=_seed(rng), routing=routing))
    dims = _dims(problem)
    got = _emulate(problem, **params)
    if not params.get("PER_PAIR"):  # the per-pair path writes no lists
        tiles = _tile_pairs(dims, {**params, "W_FP8": 1})
        want = expert_lists_numpy(problem.topk_ids, dims.experts, tiles)
        _assert_lists_equal(_unpack_lists(got["lists"], dims), want)
    faithful, oracle = _references(problem)
    own_order = bool(params.get("GB_MMA") or params.get("DB_MMA"))
    _assert_matches(got["out"], faithful, oracle, f"fp8 emulated {problem.shape.name} {params}", own_order=own_order)
    if not params.get("GB_MMA") and params.get("GB_BYTES") == 16:
        assert np.array_equal(got["inter"], _strict_fp8_intermediate(problem)), "intermediate != strict FP8's"
    if fp32:
        got32 = _emulate(problem, out_dtype=np.float32, **params)["out"]
        faithful32, _ = _references(problem, out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, "fp8 emulated fp32 out", own_order=own_order)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [pytest.param({"GB_BYTES": 16}, id="fma"),
                                   pytest.param({"GB_MMA": 1, "DB_MMA": 1, "PAIR_TILES": 1, "DB_GROUPED": 1},
                                                id="mma-grouped")])
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator, knobs: dict[str, int]) -> None:
    """Out-of-range ids reach the FP8 kernels (as under capture): those tokens' rows NaN, the others right."""
    problem = _fp8_problem(make_problem("tiny", 5, seed=_seed(rng)))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -3
    got = _emulate(problem, ids=ids, **knobs)
    assert np.all(np.isnan(got["out"][[0, 2]].astype(np.float32)))
    good = [1, 3, 4]
    sub = dataclasses.replace(problem, tokens=3, x=problem.x[good], topk_ids=problem.topk_ids[good],
                              topk_weights=problem.topk_weights[good])
    faithful, oracle = _references(sub)
    _assert_matches(got["out"][good], faithful, oracle, "fp8 emulated good tokens", own_order=bool(knobs.get("DB_MMA")))


def test_fragment_widening_is_exact_and_normal() -> None:
    """The tensor-core A fragment, both widenings (FP8_PRMT 0 / 1), over every finite e4m3fn byte in both halves of
    a word: the bf16 bits of value x 2^-112, exactly and never subnormal (2^-121 at the least), as the tensor cores
    need them. FP8_PRMT 0: fp16 bits (cvt.rn.f16x2.e4m3x2, exact) shifted right by 3 with the sign put back.
    FP8_PRMT 1: each byte sign-extended to 16 bits (prmt.b32), shifted left by 4 and masked with 0x87F0 -- value x
    2^-120, subnormals as bf16 subnormals -- then multiplied by 2^8 in bf16 (exact). The bit steps of
    kernels/device_helpers.py."""
    codes = np.arange(256, dtype=np.uint32)
    values = codes.astype(np.uint8).view(FP8).astype(np.float32)
    finite = np.isfinite(values)
    h = values.astype(np.float16).view(np.uint16).astype(np.uint32)
    pair = h | (h[::-1] << 16)  # two halves at once, as the kernel converts them
    by_cvt = ((pair >> 3) & 0x0FFF0FFF) | (pair & 0x80008000)
    sext = np.where(codes & 0x80, codes | 0xFF00, codes)  # a sign-extended byte: one 16-bit half
    word = (((sext | (sext[::-1] << 16)) << 4) & 0xFFFFFFFF) & 0x87F087F0  # the high half drops the low's sign copies
    for half, vals in ((0, values), (1, values[::-1])):
        low = (((word >> (16 * half)) & 0xFFFF).astype(np.uint32) << 16).view(np.float32)
        ok = np.isfinite(vals)
        np.testing.assert_array_equal(low[ok], vals[ok] * np.float32(2.0**-120))
    scaled = np.stack([((word >> (16 * k)) & 0xFFFF).astype(np.uint32) << 16 for k in (0, 1)]).view(np.float32) * 256
    by_prmt = (scaled.view(np.uint32) >> 16)
    by_prmt = by_prmt[0] | (by_prmt[1] << 16)
    for bf in (by_cvt, by_prmt):
        lo = ((bf & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
        hi = (bf & 0xFFFF0000).astype(np.uint32).view(np.float32)
        want = values * np.float32(2.0**-112)
        np.testing.assert_array_equal(lo[finite], want[finite])
        np.testing.assert_array_equal(hi[finite[::-1]], want[::-1][finite[::-1]])
        tiny = np.abs(lo[finite & (values != 0)])
        assert tiny.min() == np.float32(2.0**-121) and np.all(tiny >= np.finfo(np.float32).tiny)


@pytest.mark.parametrize("which", ["one", pytest.param("presets", marks=pytest.mark.slow)])
def test_compile_without_spills(which: str) -> None:
    """Both FP8 paths as registered, at the qwen3 shapes' batches, compile for sm_90 with no spill (the quick subset
    compiles the tensor-core FP8 path at qwen3-30b T = 64 only; the 20 compiles are slow)."""
    from kernels.compile import offline_report
    from kernels.shapes import get_shape

    points = ((1, wdb.FP8_KNOBS), (4, wdb.FP8_KNOBS), (16, wdb.FP8_KNOBS), (8, wdb.MMA_FP8_KNOBS),
              (64, wdb.MMA_FP8_KNOBS))
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b") if which == "presets" else ("qwen3-30b-a3b",):
        shape = get_shape(model)
        for tokens, knobs in points if which == "presets" else points[-1:]:
            params = wdb.resolve_params(Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k),
                                        **knobs)
            for report in offline_report(wdb.SOURCE, **params):
                assert report.spill_stores == 0 and report.spill_loads == 0, (model, tokens, report)


def test_weights_and_knob_must_agree() -> None:
    """W_FP8 1 needs fp8-block128 weights and 8- or 16-byte activation chunks; the variants say their format."""
    from kernels.variants import get_variant

    with pytest.raises(ValueError, match="W_FP8 loads GB_BYTES / 2 bytes"):
        wdb.resolve_params(None, W_FP8=1, GB_BYTES=4)
    for name in ("cupy:warp-decode-batched-fp8", "cupy:warp-decode-mma-fp8"):
        variant = get_variant(name)
        assert variant.weight_format == FMT and variant.params["W_FP8"] == 1
    problem = make_problem("tiny", 2)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        wdb.warp_decode_batched(problem.x, q13, q2, problem.topk_ids, problem.topk_weights)


def test_widening_rule() -> None:
    """FP8_PRMT auto: the byte permute with its multiply on B on the FP8 tensor-core kernels (the per-pair form with
    its intermediate written x 2^8) but the plain gate_up with two 8-pair blocks (set by hand: the byte permute spills
    there); 0 off FP8 tensor-core kernels; 1 or 2 there is an error. DB_ROW_TILES auto: 2 on the FP8 grouped down
    from T*K >= 2E at I >= 1536 with the multiply on B; DB_UNROLL auto: 4 on the FP8 grouped down with one row tile at
    I >= 1536, else 2; DB_WARPS auto: 2 on the FP8 grouped down at I >= 1536, else 4; DB_GROUPED auto on the FP8
    tensor-core path: from T*K >= E/4 at I >= 1536."""
    def resolved(knobs: dict[str, int], tokens: int, inter: int = 768, **more: int) -> dict[str, int]:
        return wdb.resolve_params(Dims(tokens, 2048 if inter == 768 else 4096, inter, 128, 8), **{**knobs, **more})

    assert [resolved(wdb.MMA_FP8_KNOBS, t)["FP8_PRMT"] for t in (1, 8, 32, 64)] == [2, 2, 2, 2]
    assert resolved(wdb.MMA_FP8_KNOBS, 64, GB_NBLK=2)["FP8_PRMT"] == 0
    assert [resolved(k, 64)["FP8_PRMT"] for k in (wdb.FP8_GROUPED_KNOBS, wdb.FP8_PER_PAIR_KNOBS)] == [2, 3]
    assert [resolved(k, 8)["FP8_PRMT"] for k in (wdb.MMA_KNOBS, wdb.FP8_KNOBS)] == [0, 0]
    for key in ("FP8_PRMT", "FP8_LOAD16"):
        with pytest.raises(ValueError, match=f"{key} shapes the tensor-core kernels' FP8"):
            wdb.resolve_params(None, **{**wdb.FP8_KNOBS, key: 1})
    with pytest.raises(ValueError, match="FP8_PRMT shapes the tensor-core kernels' FP8"):
        wdb.resolve_params(None, **{**wdb.FP8_KNOBS, "FP8_PRMT": 2})
    with pytest.raises(ValueError, match="FP8_PRMT 3 has the tensor-core gate_up write the intermediate"):
        wdb.resolve_params(None, **{**wdb.MIXED_KNOBS, "W_FP8": 1, "FP8_PRMT": 3})
    assert resolved(wdb.MMA_FP8_KNOBS, 64, 1536, FP8_PRMT=3)["DB_ROW_TILES"] == 2
    tiles = {(k, t, i): resolved(knobs, t, i)["DB_ROW_TILES"] for k, knobs in
             (("mma", wdb.MMA_FP8_KNOBS), ("grouped", wdb.FP8_GROUPED_KNOBS), ("bf16", wdb.GROUPED_KNOBS))
             for t in (16, 32) for i in (768, 1536)}
    assert {key for key, r in tiles.items() if r == 2} == {("mma", 32, 1536), ("grouped", 32, 1536)}
    assert resolved(wdb.MMA_FP8_KNOBS, 64, 1536, FP8_PRMT=1)["DB_ROW_TILES"] == 1  # spills with the multiply on A
    assert resolved(wdb.MMA_FP8_KNOBS, 64, 1536, DB_UNROLL=1)["DB_ROW_TILES"] == 1
    unrolls = {(k, t, i): resolved(knobs, t, i)["DB_UNROLL"]
               for k, knobs in (("mma", wdb.MMA_FP8_KNOBS), ("grouped", wdb.FP8_GROUPED_KNOBS))
               for t in (8, 16, 32) for i in (768, 1536)}
    four = {(k, t, 1536) for k in ("mma", "grouped") for t in (8, 16)}  # the tensor-core path grouped there too
    assert {key for key, u in unrolls.items() if u != 2} == four and {unrolls[key] for key in four} == {4}
    assert resolved(wdb.FP8_GROUPED_KNOBS, 16, 1536, DB_UNROLL=2)["DB_UNROLL"] == 2  # a set value stays
    assert resolved(wdb.FP8_GROUPED_KNOBS, 16, 1536, DB_ROW_TILES=2)["DB_UNROLL"] == 2  # two tiles spill at 4
    # DB_GROUPED auto on the FP8 tensor-core path: from T*K >= E/4 at I >= 1536, from T*K >= 2E elsewhere and on bf16
    grouped = {(k, t, i): resolved(knobs, t, i)["DB_GROUPED"]
               for k, knobs in (("fp8", wdb.MMA_FP8_KNOBS), ("bf16", wdb.MMA_KNOBS)) for t in (2, 3, 4, 16, 32)
               for i in (768, 1536)}
    assert {key for key, g in grouped.items() if g} == {("fp8", t, 1536) for t in (4, 16, 32)} | \
        {(k, 32, i) for k in ("fp8", "bf16") for i in (768, 1536)}
    assert resolved(wdb.MMA_FP8_KNOBS, 8, 1536, DB_GROUPED=0)["DB_GROUPED"] == 0  # a set value stays
    warps = {(k, i): resolved(knobs, 64, i)["DB_WARPS"]
             for k, knobs in (("fp8", wdb.MMA_FP8_KNOBS), ("bf16", wdb.MMA_KNOBS)) for i in (768, 1536)}
    assert warps == {("fp8", 768): 4, ("fp8", 1536): 2, ("bf16", 768): 4, ("bf16", 1536): 4}  # grouped downs


SHAPE_400 = MoEShape("h400-i64", 400, 64, 5, 3)  # 50 chunks: ranges of 16, 16, 16, 2; a partial last scale block


@pytest.mark.slow
def test_range_flush_emulated() -> None:
    """GB_RANGE_FLUSH 1 on FP8 weights (the split-chain gate_up's ranges in one loop, the scale block's partial kept
    across rounds): the loop per range's bits and the per-pair form's, with 16-value loads and scale-block sums, a
    short last range ending in a masked round and a partial last scale block. Auto takes it on FP8 with one 8-pair
    block per pass (auto_range_flush); asked for where a range would end inside a scale block, it is an error.
    Rounds of one 64-wide k block: a scale block spans two of them."""
    problem = _fp8_problem(make_problem(SHAPE_400, 9, seed=11, routing="zipf"))
    knobs = {**{k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"}, "GB_KSPLIT": 4, "GB_UNROLL": 1,
             "LIST_THREADS": 32, "LIST_PER": 0}
    dims = _dims(problem)
    resolved = wdb.resolve_params(dims, W_FP8=1, **{**knobs, "GB_RANGE_FLUSH": 1})
    assert resolved["FP8_LOAD16"] == resolved["FP8_BLOCK_SUM"] == 1 and resolved["GB_RANGE_FLUSH"] == 1
    got = _emulate(problem, out_dtype=np.float32, **{**knobs, "GB_RANGE_FLUSH": 1})
    want = _emulate(problem, out_dtype=np.float32, **{**knobs, "GB_RANGE_FLUSH": 0})
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32))
    pairs = {**{k: v for k, v in wdb.FP8_PER_PAIR_KNOBS.items() if k != "W_FP8"}, "GB_KSPLIT": 4, "GB_WARPS": 4}
    assert np.array_equal(_emulate(problem, out_dtype=np.float32, **pairs)["out"].view(np.uint32),
                          got["out"].view(np.uint32))
    faithful, oracle = _references(problem, out_dtype=np.float32)
    _assert_matches(got["out"], faithful, oracle, "FP8 range flush", own_order=True)
    def auto(**more: int) -> int:
        return wdb.resolve_params(dims, W_FP8=1, **{**knobs, "GB_RANGE_FLUSH": -1, **more})["GB_RANGE_FLUSH"]

    assert (auto(GB_NBLK=1), auto(GB_NBLK=2)) == (1, 0)  # on FP8 with one 8-pair block per pass
    with pytest.raises(ValueError, match="GB_RANGE_FLUSH 1 runs the split-chain gate_up's ranges"):
        wdb.resolve_params(dims, W_FP8=1, **{**knobs, "GB_KSPLIT": 8, "GB_RANGE_FLUSH": 1})  # 8-chunk ranges


@pytest.mark.slow
def test_hot_tiles_emulated() -> None:
    """HOT_NBLK 2: the tile table holds tiles of up to 16 pairs, and a tile with more than 8 runs in ONE pass of two
    8-pair blocks with half the k blocks in flight (the bf16 grouped down: all of them, auto_hot_down_unroll). In the
    batch-invariant grouped path (split-chain gate_up with the range flush, 16-value loads, scale-block sums; the
    grouped down) that moves work only: the same bits as one block per pass, on FP8 and bf16 weights, with hot tiles
    (up to 12 pairs) beside ordinary ones."""
    base = make_problem(SHAPE_400, 12, seed=12, routing="zipf")
    counts = np.bincount(base.topk_ids.ravel(), minlength=SHAPE_400.experts)
    assert counts.max() > 8 and 0 < counts.min() <= 8  # hot tiles and ordinary ones
    knobs = {**{k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"}, "GB_KSPLIT": 4, "GB_UNROLL": 2,
             "GB_NBLK": 1, "LIST_THREADS": 32, "LIST_PER": 0}
    for problem, w_fp8 in ((_fp8_problem(base), 1), (base, 0)):
        dims = _dims(problem)
        hot = wdb.resolve_params(dims, W_FP8=w_fp8, **{**knobs, "HOT_NBLK": 2})
        assert (hot["GB_NBLK"], hot["DB_NBLK"], hot["GB_RANGE_FLUSH"], wdb.tile_pairs(hot)) == (1, 1, 1, 16)
        assert hot["DB_HOT_UNROLL"] == (0 if w_fp8 else hot["DB_UNROLL"])  # bf16: the hot down at full rounds
        run = _emulate if w_fp8 else emulate_batched
        got = run(problem, out_dtype=np.float32, **{**knobs, "HOT_NBLK": 2})
        want = run(problem, out_dtype=np.float32, **{**knobs, "HOT_NBLK": 0})
        _assert_lists_equal(_unpack_lists(got["lists"], dims), expert_lists_numpy(problem.topk_ids, dims.experts, 16))
        assert np.array_equal(got["inter"], want["inter"]), w_fp8
        assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32)), w_fp8
        deep = run(problem, out_dtype=np.float32, **{**knobs, "HOT_NBLK": 2, "GB_HOT_UNROLL": 2})  # GB_UNROLL rounds
        assert np.array_equal(deep["out"].view(np.uint32), want["out"].view(np.uint32)), w_fp8
    with pytest.raises(ValueError, match="HOT_NBLK widens the tensor-core gate_up's passes"):
        wdb.resolve_params(dims, HOT_NBLK=2)


SHAPE_T16 = MoEShape("h192-i192", 192, 192, 6, 2)  # 64-value tiles; a partial last scale block along H and I
SHAPE_T16_WIDE = MoEShape("h512-i128", 512, 128, 6, 2)  # 4 k ranges of one scale block each: the range flush
TILED_CASES = [  # (shape, T, routing, knobs): the tensor-core forms that read fp8-block128-t16 tiles
    (SHAPE_T16, 3, "uniform", {k: v for k, v in wdb.FP8_PER_PAIR_KNOBS.items() if k != "W_FP8"}),   # per-pair form
    (SHAPE_T16, 12, "zipf", {**{k: v for k, v in wdb.MMA_FP8_KNOBS.items() if k != "W_FP8"}, "GB_NBLK": 1,
                             "HOT_NBLK": 2, "DB_GROUPED": 1, "DB_ROW_TILES": 2, "LIST_THREADS": 32,
                             "LIST_PER": 0}),   # hot passes, 32-row downs
    (SHAPE_T16, 6, "same", {**{k: v for k, v in wdb.MMA_FP8_KNOBS.items() if k != "W_FP8"}, "DB_GROUPED": 0,
                            "DB_BALANCE": 1, "DB_WARPS": 3, "DB_UNROLL": 1, "LIST_THREADS": 32,
                            "LIST_PER": 0}),   # runs cut inside rows
    # the batch-invariant grouped form: 4 split chains walked in one loop (the range flush), the grouped down
    (SHAPE_T16_WIDE, 9, "zipf", {**{k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"},
                                 "GB_UNROLL": 2, "LIST_THREADS": 32, "LIST_PER": 0}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs"), TILED_CASES,
                         ids=["pairs", "hot-grouped", "balanced", "invariant-grouped"])
def test_tiled_values_emulated(shape: Any, tokens: int, routing: Any, knobs: dict[str, int]) -> None:
    """fp8-block128-t16 (W_TILED 1): the same values in 16-row x 64-value tiles give the bits of fp8-block128's
    rows in every tensor-core form -- only the addresses move -- and the reference reads the tiles back."""
    base = make_problem(shape, tokens, seed=tokens, routing=routing)
    rows = _fp8_problem(base)
    q13, q2 = quantize_weights(base.w13, base.w2, FP8_BLOCK128_T16.name)
    assert (q13.layout, q2.layout) == ("t16", "t16") and q13.values.shape == rows.w13.values.shape
    tiled = dataclasses.replace(base, w13=q13, w2=q2)
    want = _emulate(rows, out_dtype=np.float32, **knobs)
    got = _emulate(tiled, out_dtype=np.float32, **{**knobs, "W_TILED": 1})
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32))
    args = (base.x, q13, q2, base.topk_ids, base.topk_weights)
    assert np.array_equal(moe_decode(*args, mode="fp64", weight_format=FP8_BLOCK128_T16.name),
                          moe_decode(base.x, rows.w13, rows.w2, base.topk_ids, base.topk_weights, mode="fp64",
                                     weight_format=FMT))
    with pytest.raises(ValueError, match="'t16'-ordered"):
        moe_decode(base.x, rows.w13, rows.w2, base.topk_ids, base.topk_weights, weight_format=FP8_BLOCK128_T16.name)
    with pytest.raises(ValueError, match="W_TILED reads 64-value tiles: H and I must be multiples of 64"):
        wdb.resolve_params(_dims(make_problem(SHAPE_16, 2, seed=0)), **{**wdb.FP8_PER_PAIR_KNOBS, "W_TILED": 1})


# T = 40, K = 2 over 6 experts: expert 0 in every token (5 tiles of 8, 3 of 16), expert 1 in 20 (3 / 2 tiles), 2 in 12
# (2 / 1), 3..5 in the last 8 (1 each)
SHARE_IDS = [[0, 1 if t < 20 else 2 if t < 32 else 3 + t % 3] for t in range(40)]


@pytest.mark.slow
@pytest.mark.parametrize(("hot", "row_tiles", "ksplit"), [(0, 1, 1), (2, 2, 1), (0, 1, 2)])
def test_shared_widening_emulated(hot: int, row_tiles: int, ksplit: int) -> None:
    """GB_SHARE / DB_SHARE 2 / 4: a hot expert's tiles in groups of 2 / 4 whose warps share each round's A fragments
    in the gate_up and the grouped down (runs of 5, 3 and 2 tiles: groups of 4 + 1, 2 + 2 + 1, 2 + 1, 2) give the
    bits of every tile on its own, intermediate and out, on FP8 and bf16 weights, with warps past I (I = 144: 18
    neuron groups in blocks of 4) and past H, with HOT_NBLK 2's 16-pair tiles, two row tiles per down warp, and the
    batch-invariant form's split k chains walked in one loop (GB_KSPLIT 2, GB_RANGE_FLUSH); the tile table's runs as
    the NumPy model has them."""
    base = make_problem(SHAPE_16, 40, seed=40, routing=SHARE_IDS)
    knobs = {**{k: v for k, v in wdb.MMA_FP8_KNOBS.items() if k != "W_FP8"}, "GB_NBLK": 1, "HOT_NBLK": hot,
             "DB_GROUPED": 1, "DB_ROW_TILES": row_tiles, "DB_WARPS": 4, "GB_SHARE": 0, "DB_SHARE": 0,
             "LIST_THREADS": 32, "LIST_PER": 0, "GB_KSPLIT": ksplit, **({"GB_UNROLL": 2} if ksplit > 1 else {})}
    for problem, w_fp8 in ((_fp8_problem(base), 1), (base, 0)):
        dims = _dims(problem)
        run = _emulate if w_fp8 else emulate_batched
        want = run(problem, out_dtype=np.float32, **knobs)
        for share in (2, 4):
            shared = {**knobs, "GB_SHARE": share, "DB_SHARE": share}
            resolved = wdb.resolve_params(dims, W_FP8=w_fp8, **shared)
            assert (resolved["GB_WARPS"], resolved["DB_WARPS"], resolved["GB_KSPLIT"], resolved["GB_RANGE_FLUSH"],
                    wdb.tile_pairs(resolved)) == (4, 4, ksplit, int(ksplit > 1), 8 * max(1, hot))
            got = run(problem, out_dtype=np.float32, **shared)
            tiles = expert_lists_numpy(problem.topk_ids, dims.experts, wdb.tile_pairs(resolved))
            _assert_lists_equal(_unpack_lists(got["lists"], dims), tiles)
            assert np.array_equal(got["inter"], want["inter"]), (w_fp8, share)
            assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32)), (w_fp8, share)
        if w_fp8:
            faithful, oracle = _references(problem, out_dtype=np.float32)
            _assert_matches(want["out"], faithful, oracle, "fp8 shared widening", own_order=True)
    knobs = {**{k: v for k, v in knobs.items() if k != "GB_UNROLL"}, "GB_KSPLIT": 1}  # refusals: the single chain
    with pytest.raises(ValueError, match="GB_SHARE groups .* one loop over H: it needs .* GB_RANGE_FLUSH 1"):
        wdb.resolve_params(dims, **{**knobs, "GB_SHARE": 2, "GB_KSPLIT": 2, "GB_RANGE_FLUSH": 0})
    with pytest.raises(ValueError, match="GB_SHARE must be 2 or 4 and divide GB_WARPS"):
        wdb.resolve_params(dims, **{**knobs, "GB_SHARE": 4, "GB_WARPS": 2})
    with pytest.raises(ValueError, match="DB_SHARE groups the tile table's tiles of one expert in the grouped down"):
        wdb.resolve_params(dims, **{**knobs, "DB_SHARE": 2, "DB_GROUPED": 0, "DB_ROW_TILES": 1})
    with pytest.raises(ValueError, match="DB_SHARE runs each tile in one down pass"):
        wdb.resolve_params(dims, **{**knobs, "DB_SHARE": 2, "GB_NBLK": 2, "DB_NBLK": 1, "HOT_NBLK": 0})
    with pytest.raises(ValueError, match="static shared memory"):
        wdb.resolve_params(dims, **{**knobs, "GB_SHARE": 2, "GB_WARPS": 16, "GB_UNROLL": 8})


def _subnormal_weights(problem: Problem, seed: int) -> Problem:
    """The FP8 problem with a quarter of its weight values made e4m3fn subnormals (random mantissa, sign kept)."""
    rng = np.random.default_rng(seed)

    def some_subnormal(q: Any) -> Any:
        codes = q.values.view(np.uint8)
        sub = (codes & 0x80) | rng.integers(1, 8, codes.shape, dtype=np.uint8)
        return dataclasses.replace(q, values=np.where(rng.random(codes.shape) < 0.25, sub, codes).view(FP8))

    return dataclasses.replace(problem, w13=some_subnormal(problem.w13), w2=some_subnormal(problem.w2))


WIDENINGS = [  # (shape, T, routing, knobs): the tensor-core kernels' forms, 8- and 16-value loads
    (SHAPE_16, 7, "zipf", {**{k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"}, "GB_KSPLIT": 2,
                           "HOT_NBLK": 2, "LIST_THREADS": 32, "LIST_PER": 0}),
    (SHAPE_48, 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]], {"GB_MMA": 1, "DB_MMA": 1, "DB_BALANCE": 1,
                                                                     "DB_WARPS": 3}),
    (SHAPE_16, 5, "uniform", {"GB_MMA": 1, "DB_MMA": 1, "PER_PAIR": 1, "GB_WARPS": 2, "GB_KSPLIT": 2,
                              "FP8_LOAD16": 1, "FP8_BLOCK_SUM": 1}),
]


@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs"),
                         slow_except(WIDENINGS, [f"{c[0].name}-T{c[1]}" for c in WIDENINGS], {0}))
def test_widening_multiply_on_b_emulated(shape: Any, tokens: int, routing: Any, knobs: dict[str, int]) -> None:
    """FP8_PRMT 2 (A fragments value x 2^-120, the 2^8 on the activations' B fragments) gives FP8_PRMT 1's bits --
    intermediate and FP32 out -- with a quarter of the weights e4m3fn subnormals and activations spanning 2^-100 ..
    2^60 (every product the same number either way); so does FP8_PRMT 3, whose intermediate is FP8_PRMT 1's x 2^8
    (NaN where it is NaN). It matches the reference on the same weights."""
    problem = _subnormal_weights(_fp8_problem(make_problem(shape, tokens, seed=tokens, routing=routing)), tokens)
    rng = np.random.default_rng(tokens)
    spread = np.exp2(rng.integers(-100, 60, problem.x.shape)).astype(np.float32)
    problem = dataclasses.replace(problem, x=(problem.x.astype(np.float32) * spread).astype(BF16))
    def values(bits: np.ndarray) -> np.ndarray:  # the emulation's intermediate: bf16 bits
        return (bits.astype(np.uint32) << 16).view(np.float32)

    want = _emulate(problem, out_dtype=np.float32, **{**knobs, "FP8_PRMT": 1})
    for widening in (2, 3):
        got = _emulate(problem, out_dtype=np.float32, **{**knobs, "FP8_PRMT": widening})
        scaled = values(want["inter"]) * np.float32(256 if widening == 3 else 1)
        assert np.array_equal(values(got["inter"]), scaled, equal_nan=True), widening
        assert np.array_equal(got["out"].view(np.uint32), want["out"].view(np.uint32)), widening
    mild = _subnormal_weights(_fp8_problem(make_problem(shape, tokens, seed=tokens + 1, routing=routing)), tokens)
    faithful, oracle = _references(mild, out_dtype=np.float32)
    _assert_matches(_emulate(mild, out_dtype=np.float32, **{**knobs, "FP8_PRMT": 2})["out"], faithful, oracle,
                    f"fp8 widening with the multiply on B {shape.name}", own_order=True)


ROW_TILES = [  # (shape, T, routing, knobs of the grouped path)
    (SHAPE_16, 12, "same", {"HOT_NBLK": 2}),  # H = 208: the last warp's second tile past H; every tile hot (12 pairs)
    (SHAPE_400, 9, "same", {"DB_NBLK": 2, "GB_NBLK": 2, "DB_UNROLL": 1}),  # H = 400: its second tile half past it
]


@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs"),
                         slow_except(ROW_TILES, [f"{c[0].name}-T{c[1]}" for c in ROW_TILES], {0}))
def test_row_tiles_emulated(shape: Any, tokens: int, routing: Any, knobs: dict[str, int]) -> None:
    """DB_ROW_TILES 2 (two 16-row tiles per grouped-down warp sharing each B fragment) gives one tile's bits --
    intermediate and FP32 out -- on FP8 and bf16 weights, rows past H never written; 2 without the grouped down is an
    error."""
    base = make_problem(shape, tokens, seed=tokens + 2, routing=routing)
    if knobs.get("HOT_NBLK"):  # the hot branch: both row tiles in one pass of HOT_NBLK blocks
        assert np.bincount(base.topk_ids.ravel()).max() > 8
    grouped = {**{k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"}, "LIST_THREADS": 32, "LIST_PER": 0,
               **knobs}
    for problem, w_fp8 in ((_fp8_problem(base), 1), (base, 0)):
        run = _emulate if w_fp8 else emulate_batched
        two = run(problem, out_dtype=np.float32, **{**grouped, "DB_ROW_TILES": 2})
        one = run(problem, out_dtype=np.float32, **{**grouped, "DB_ROW_TILES": 1})
        assert np.array_equal(two["inter"], one["inter"]), w_fp8
        assert np.array_equal(two["out"].view(np.uint32), one["out"].view(np.uint32)), w_fp8
    with pytest.raises(ValueError, match="DB_ROW_TILES 2 gives the grouped down's warps more rows"):
        wdb.resolve_params(_dims(base), **{**wdb.MMA_KNOBS, "DB_GROUPED": 0, "DB_ROW_TILES": 2})


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
def _device(cupy: Any, problem: Problem, weight_format: str = FMT) -> Problem:
    """The problem on the device with its weights quantized there (bitwise the host quantizer)."""
    x, w13, w2, ids, wts = (cupy.asarray(a) for a in (problem.x, problem.w13, problem.w2, problem.topk_ids,
                                                        problem.topk_weights))
    q13, q2 = quantize_weights(w13, w2, weight_format)
    return dataclasses.replace(problem, x=x, w13=q13, w2=q2, topk_ids=ids, topk_weights=wts)


def _bf16_on_device(cupy: Any, host: Problem) -> Problem:
    """A host bf16 problem copied to the device as it is."""
    return dataclasses.replace(host, x=cupy.asarray(host.x), w13=cupy.asarray(host.w13), w2=cupy.asarray(host.w2),
                               topk_ids=cupy.asarray(host.topk_ids), topk_weights=cupy.asarray(host.topk_weights))


def _copied_to_device(cupy: Any, host: Problem) -> Problem:
    """A host FP8 problem copied to the device as it is (weights values and scales unchanged)."""
    def weights(q: Any) -> Any:
        return dataclasses.replace(q, values=cupy.asarray(q.values.view(np.uint8)), scales=cupy.asarray(q.scales))

    return dataclasses.replace(host, x=cupy.asarray(host.x), topk_ids=cupy.asarray(host.topk_ids),
                               topk_weights=cupy.asarray(host.topk_weights), w13=weights(host.w13),
                               w2=weights(host.w2))


def _run_poisoned(cupy: Any, problem: Problem, **knobs: int) -> np.ndarray:
    """One batched layer on the device with ``knobs``, out and the intermediate NaN-poisoned first; out on the host."""
    dims = _dims(problem)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    ws = wdb.make_workspace(dims, **knobs)
    ws.intermediate.view(cupy.uint16).fill(0x7FC0)
    wdb.warp_decode_batched(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, out=out,
                            workspace=ws, **knobs)
    cupy.cuda.runtime.deviceSynchronize()
    return out.get()


DUPLICATES = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1]]  # duplicate ids in a token
GPU_CASES = [("qwen3-30b-a3b", 4, "uniform", "fma"), ("qwen3-30b-a3b", 8, "zipf-1", "mma"),
             ("qwen3-30b-a3b", 64, "correlated", "mma"), ("qwen3-235b-a22b", 2, "zipf-2", "fma"),
             ("qwen3-235b-a22b", 32, "same", "mma"), ("tiny", 5, DUPLICATES, "fma"), ("tiny", 7, "uniform", "mma"),
             ("qwen3-30b-a3b", 2, "uniform", "pairs"), ("qwen3-235b-a22b", 3, "zipf-2", "pairs"),
             ("qwen3-235b-a22b", 3, "zipf", "mma"), ("qwen3-30b-a3b", 4, "zipf", "mma-capped"),
             ("qwen3-235b-a22b", 2, "zipf", "pairs-two-groups"), ("qwen3-30b-a3b", 1, "uniform", "pairs-t16"),
             ("qwen3-235b-a22b", 3, "zipf", "pairs-t16"), ("qwen3-30b-a3b", 64, "zipf", "mma-t16"),
             ("qwen3-235b-a22b", 32, "same", "mma-t16"), ("qwen3-235b-a22b", 8, "correlated", "mma-t16"),
             ("qwen3-30b-a3b", 16, "zipf", "grouped-t16"), ("qwen3-235b-a22b", 8, "uniform", "grouped-t16")]
# (qwen3-235b at 16 experts and T = 3: T*K >= E/4 runs the grouped down with one row tile, DB_UNROLL 4, 2 warps)
# (tiny's H = 136 runs the tensor-core kernels with 8-value loads: FP8_LOAD16 auto is 0 there, 1 at the presets)
PATHS = {"fma": (wdb.FP8_KNOBS, wdb.FP8_VARIANT), "mma": (wdb.MMA_FP8_KNOBS, wdb.MMA_FP8_VARIANT),
         "pairs": (wdb.FP8_PER_PAIR_KNOBS, wdb.PER_PAIR_FP8_VARIANT),
         # the gate_up under PASS_REGS (8 bytes of spill), as fp8_gate_up_takes_pass_regs gives it at 128 experts and
         # T = 4: the variant's graph (uncapped at these 16 experts) must give the same bits
         "mma-capped": ({**wdb.MMA_FP8_KNOBS, "GB_MAX_REGS": wdb.PASS_REGS}, wdb.MMA_FP8_VARIANT),
         # two groups of 8 neurons a per-pair gate_up block (the form before GB_WARPS = GB_KSPLIT): the same bits as
         # the variant's one group a block
         "pairs-two-groups": ({**wdb.FP8_PER_PAIR_KNOBS, "GB_WARPS": 2 * wdb.FP8_INVARIANT_KSPLIT},
                              wdb.PER_PAIR_FP8_VARIANT),
         # fp8-block128-t16's tiles (W_TILED): checked also bitwise against the row layout's path
         "mma-t16": (wdb.MMA_FP8_T16_KNOBS, wdb.MMA_FP8_T16_VARIANT),
         "pairs-t16": (wdb.FP8_T16_PER_PAIR_KNOBS, wdb.PER_PAIR_FP8_T16_VARIANT),
         "grouped-t16": (wdb.FP8_T16_GROUPED_KNOBS, wdb.GROUPED_FP8_T16_VARIANT)}


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "path"), GPU_CASES)
def test_gpu_paths(model: str, tokens: int, routing: Any, path: str) -> None:
    """Against the reference on the same FP8 weights (NaN-poisoned out and workspace), bitwise over a repeat and a
    graph replay."""
    import cupy

    from kernels.shapes import get_shape

    shape = get_shape(model)
    run_shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 5, routing=routing))
    tiled = path.endswith("-t16")
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 5, routing=routing),
                      FP8_BLOCK128_T16.name if tiled else FMT)
    knobs, variant = PATHS[path]
    dims = _dims(problem)

    def run() -> np.ndarray:
        return _run_poisoned(cupy, problem, **knobs)

    first = run()
    faithful, oracle = _references(host)
    _assert_matches(first, faithful, oracle, f"fp8 {path} {model} T={tokens} {routing}", own_order=path != "fma")
    assert np.array_equal(run().view(np.uint16), first.view(np.uint16))
    if tiled:  # only the addresses move: the row layout's bits
        rows = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 5, routing=routing))
        rows_knobs = {k: v for k, v in knobs.items() if k != "W_TILED"}
        assert np.array_equal(_run_poisoned(cupy, rows, **rows_knobs).view(np.uint16), first.view(np.uint16))
    launch = variant.make(dims)
    replay = _poisoned_out(cupy, tokens, shape.hidden)
    stream = cupy.cuda.Stream(non_blocking=True)
    args = (problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, replay)
    with stream:
        launch(*args)
        stream.synchronize()
        replay.view(cupy.uint16).fill(0x7FC0)
        stream.begin_capture()
        launch(*args)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(replay.get().view(np.uint16), first.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("widening", [1, 2])
@pytest.mark.parametrize("path", ["mma", "pairs", "grouped"])
def test_gpu_subnormal_weights(path: str, widening: int) -> None:
    """Weights that are all e4m3fn subnormals against the reference on the same weights, x scaled by 2^18 so that
    every product and partial stays in FP32's normal range: the widened A fragments must carry every subnormal
    exactly (a widening that lost them would zero the output: 170 x the check's bound, seen on the host by flushing
    the reference's weights). The byte-permute widening, with its multiply on A (FP8_PRMT 1) or on B (2: the A
    fragments of subnormals are bf16 subnormals)."""
    import cupy

    from kernels.shapes import get_shape

    shape = get_shape("qwen3-30b-a3b").with_(experts=8)
    rng = np.random.default_rng(11)
    host = _fp8_problem(make_problem(shape, 5, seed=11, routing="zipf"))

    def subnormal(q: Any) -> Any:  # every value: exponent 0, a random nonzero mantissa, the sign kept
        codes = (q.values.view(np.uint8) & 0x80) | rng.integers(1, 8, q.values.shape, dtype=np.uint8)
        return dataclasses.replace(q, values=codes.astype(np.uint8).view(FP8))

    x = (host.x.astype(np.float32) * np.float32(2.0**18)).astype(BF16)  # exact: a power of two
    host = dataclasses.replace(host, x=x, w13=subnormal(host.w13), w2=subnormal(host.w2))
    device = _copied_to_device(cupy, host)
    knobs = {"mma": wdb.MMA_FP8_KNOBS, "pairs": wdb.FP8_PER_PAIR_KNOBS, "grouped": wdb.FP8_GROUPED_KNOBS}[path]
    knobs = {**knobs, "FP8_PRMT": widening}
    out = _poisoned_out(cupy, host.tokens, shape.hidden)
    wdb.warp_decode_batched(device.x, device.w13, device.w2, device.topk_ids, device.topk_weights, out=out, **knobs)
    cupy.cuda.runtime.deviceSynchronize()
    faithful, oracle = _references(host)
    _assert_matches(out.get(), faithful, oracle, f"fp8 {path} subnormal weights", own_order=True)


@pytest.mark.gpu
def test_gpu_fma_intermediate_is_the_strict_fp8_kernels() -> None:
    """On the device too: the FP8 FMA gate_up at 8-value chunks writes the strict FP8 kernel's intermediate, bit for
    bit."""
    import cupy

    problem = _device(cupy, make_problem("qwen3-30b-a3b", 4, seed=3))
    dims = _dims(problem)
    ws = wdb.make_workspace(dims, **wdb.FP8_KNOBS)
    out = cupy.empty((dims.tokens, dims.hidden), BF16)
    wdb.warp_decode_batched(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, out=out,
                            workspace=ws, **wdb.FP8_KNOBS)
    strict = cupy.empty((dims.tokens, dims.top_k, dims.intermediate), BF16)
    wdf.warp_decode_fp8(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, workspace=strict,
                        GU_CHUNK=8)
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(ws.intermediate.view(cupy.uint16).get(), strict.view(cupy.uint16).get())



FLUSH_CASES = [("qwen3-30b-a3b", 16, "zipf"), ("qwen3-235b-a22b", 4, "uniform"), ("qwen3-30b-a3b", 64, "correlated"),
               ("qwen3-235b-a22b", 32, "zipf-2")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"), FLUSH_CASES)
def test_gpu_range_flush_bitwise(model: str, tokens: int, routing: str) -> None:
    """GB_RANGE_FLUSH 1 on FP8 weights at the presets' widths (H = 2048 / 4096: 32 / 64-chunk ranges, two / four
    scale blocks each) gives the bits of the loop per range and of the per-pair form, every output written
    (NaN-poisoned out and intermediate), and matches the reference on the same weights."""
    import cupy

    from kernels.shapes import get_shape

    shape = get_shape(model)
    run_shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 9, routing=routing))
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 9, routing=routing))
    dims = _dims(problem)

    def run(**knobs: int) -> np.ndarray:
        return _run_poisoned(cupy, problem, **knobs)

    flush_knobs = {**wdb.FP8_GROUPED_KNOBS, "GB_RANGE_FLUSH": 1}
    assert wdb.resolve_params(dims, **flush_knobs)["GB_RANGE_FLUSH"] == 1
    flush = run(**flush_knobs)
    faithful, oracle = _references(host)
    _assert_matches(flush, faithful, oracle, f"fp8 range flush {model} T={tokens} {routing}", own_order=True)
    assert np.array_equal(run(**{**wdb.FP8_GROUPED_KNOBS, "GB_RANGE_FLUSH": 0}).view(np.uint16), flush.view(np.uint16))
    assert np.array_equal(run(**wdb.FP8_PER_PAIR_KNOBS).view(np.uint16), flush.view(np.uint16))
    assert np.array_equal(run(**flush_knobs).view(np.uint16), flush.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-30b-a3b", 32, "zipf"), ("qwen3-235b-a22b", 64, "same")])
def test_gpu_hot_tiles_bitwise(model: str, tokens: int, routing: str) -> None:
    """HOT_NBLK 2 at the presets' widths, 16 experts (hot ones hold up to T pairs): the grouped path gives the bits
    of one 8-pair block per pass, every output written (NaN-poisoned out and intermediate); the plain tensor-core
    path with it (its grouped down too at these T: T*K >= 2E) matches the reference on the same weights -- on FP8
    and on bf16 (there under the auto 96-register caps of the gate_up and the grouped down; the hot gate_up passes
    at 4 k blocks in flight, GB_HOT_UNROLL 4, give the same bits). The balanced down over
    wider tiles is checked emulated (tests/test_warp_decode_batched.py, HOT_NBLK 3)."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    raw = make_problem(run_shape, tokens, seed=tokens + 3, routing=routing)
    host, problem = _fp8_problem(raw), _device(cupy, raw)
    assert np.bincount(host.topk_ids.ravel()).max() > 8
    hot = _run_poisoned(cupy, problem, **{**wdb.FP8_GROUPED_KNOBS, "HOT_NBLK": 2})
    faithful, oracle = _references(host)
    _assert_matches(hot, faithful, oracle, f"fp8 hot tiles {model} T={tokens} {routing}", own_order=True)
    one_block = _run_poisoned(cupy, problem, **{**wdb.FP8_GROUPED_KNOBS, "HOT_NBLK": 0})
    assert np.array_equal(one_block.view(np.uint16), hot.view(np.uint16))
    plain = _run_poisoned(cupy, problem, **{**wdb.MMA_FP8_KNOBS, "HOT_NBLK": 2})
    _assert_matches(plain, faithful, oracle, f"fp8 hot tiles, plain path {model} T={tokens}", own_order=True)
    bf16 = _bf16_on_device(cupy, raw)
    args = (raw.x, raw.w13, raw.w2, raw.topk_ids, raw.topk_weights)
    faithful, oracle = moe_decode(*args, mode="warp_decode"), moe_decode(*args, mode="fp64")
    for knobs in (wdb.GROUPED_KNOBS, wdb.MMA_KNOBS):
        hot_knobs = {**knobs, "HOT_NBLK": 2}
        assert wdb.resolve_params(_dims(raw), **hot_knobs)["DB_MAX_REGS"] == wdb.PASS_REGS
        hot = _run_poisoned(cupy, bf16, **hot_knobs)
        what = f"bf16 hot tiles {model} T={tokens} grouped={knobs is wdb.GROUPED_KNOBS}"
        _assert_matches(hot, faithful, oracle, what, own_order=True)
        assert np.array_equal(_run_poisoned(cupy, bf16, **hot_knobs).view(np.uint16), hot.view(np.uint16))
        deep = _run_poisoned(cupy, bf16, **{**hot_knobs, "GB_HOT_UNROLL": 4})  # the hot gate_up at 4 k blocks
        assert np.array_equal(deep.view(np.uint16), hot.view(np.uint16))
        if knobs is wdb.GROUPED_KNOBS:
            one_block = _run_poisoned(cupy, bf16, **{**knobs, "HOT_NBLK": 0})
            assert np.array_equal(one_block.view(np.uint16), hot.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-235b-a22b", 32, "zipf"), ("qwen3-30b-a3b", 64, "same"),
                          ("qwen3-235b-a22b", 64, "zipf")])
def test_gpu_shared_widening_bitwise(model: str, tokens: int, routing: str) -> None:
    """GB_SHARE / DB_SHARE 2 / 4 (a hot expert's tiles sharing each round's widened A fragments in the gate_up and
    the grouped down; DB_SHARE 2 where the down has 2 warps) give the bits of no sharing on the tensor-core FP8 path,
    on bf16 and on the batch-invariant grouped path's split k chains at the presets' widths (16 experts: runs of up
    to 4-8 tiles; 16-pair tiles at T = 64, on bf16 by hand), every output written (NaN-poisoned out and
    intermediate), repeatably, and match the reference."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    assert np.bincount(host.topk_ids.ravel()).max() > 16
    bf16 = _bf16_on_device(cupy, make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    bf16_knobs = {k: v for k, v in wdb.MMA_FP8_KNOBS.items() if k != "W_FP8"}
    faithful, oracle = _references(host)
    for on, knobs in ((problem, wdb.MMA_FP8_KNOBS), (bf16, bf16_knobs), (bf16, wdb.GROUPED_KNOBS),
                      (bf16, {**wdb.GROUPED_KNOBS, "GB_NBLK": 2})):
        alone = _run_poisoned(cupy, on, **{**knobs, "GB_SHARE": 0, "DB_SHARE": 0})
        resolved = wdb.resolve_params(_dims(on), **knobs)
        assert resolved["DB_GROUPED"] == 1
        for share in (2, 4):
            both = {**knobs, "GB_SHARE": share, "DB_SHARE": share if resolved["DB_WARPS"] % share == 0 else 2}
            shared = _run_poisoned(cupy, on, **both)
            assert not np.isnan(shared.astype(np.float32)).any()
            assert np.array_equal(shared.view(np.uint16), alone.view(np.uint16)), (share, on is problem)
            assert np.array_equal(_run_poisoned(cupy, on, **both).view(np.uint16), shared.view(np.uint16))
        if on is problem:
            _assert_matches(alone, faithful, oracle, f"fp8 shared widening {model} T={tokens}", own_order=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-30b-a3b", 1, "uniform"), ("qwen3-235b-a22b", 16, "zipf"),
                          ("qwen3-30b-a3b", 64, "same")])
def test_gpu_widening_multiply_on_b_bitwise(model: str, tokens: int, routing: str) -> None:
    """FP8_PRMT 2 (the widening's 2^8 on the activations' B fragments) and 3 (the down's B, the intermediate, written
    x 2^8) give FP8_PRMT 1's bits on the three FP8 tensor-core paths at the presets' widths, every output written
    (NaN-poisoned out and intermediate), with a quarter of the weights e4m3fn subnormals; they match the reference on
    the same weights."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    host = _subnormal_weights(_fp8_problem(make_problem(run_shape, tokens, seed=tokens + 7, routing=routing)), 7)
    problem = _copied_to_device(cupy, host)
    faithful, oracle = _references(host)
    for path, knobs in (("mma", wdb.MMA_FP8_KNOBS), ("pairs", wdb.FP8_PER_PAIR_KNOBS),
                        ("grouped", wdb.FP8_GROUPED_KNOBS)):
        on_a = _run_poisoned(cupy, problem, **{**knobs, "FP8_PRMT": 1})
        for widening in (2, 3):  # 3: the intermediate written x 2^8
            on_b = _run_poisoned(cupy, problem, **{**knobs, "FP8_PRMT": widening})
            _assert_matches(on_b, faithful, oracle, f"fp8 {path} FP8_PRMT {widening} {model} T={tokens}",
                            own_order=True)
            assert np.array_equal(on_b.view(np.uint16), on_a.view(np.uint16)), (path, widening)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-30b-a3b", 16, "zipf"), ("qwen3-235b-a22b", 64, "same")])
def test_gpu_row_tiles_bitwise(model: str, tokens: int, routing: str) -> None:
    """DB_ROW_TILES 2 (two 16-row tiles per grouped-down warp) gives one tile's bits at the presets' widths on FP8 and
    bf16 weights (hot tiles at T = 64), every output written (NaN-poisoned out and intermediate), and matches the
    reference on the same weights."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 4, routing=routing))
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 4, routing=routing))
    two = _run_poisoned(cupy, problem, **{**wdb.FP8_GROUPED_KNOBS, "DB_ROW_TILES": 2, "DB_UNROLL": 1})
    faithful, oracle = _references(host)
    _assert_matches(two, faithful, oracle, f"fp8 row tiles {model} T={tokens} {routing}", own_order=True)
    one = _run_poisoned(cupy, problem, **{**wdb.FP8_GROUPED_KNOBS, "DB_ROW_TILES": 1, "DB_UNROLL": 1})
    assert np.array_equal(two.view(np.uint16), one.view(np.uint16))
    bf16 = _bf16_on_device(cupy, make_problem(run_shape, tokens, seed=tokens + 4, routing=routing))
    bf16_knobs = {k: v for k, v in wdb.FP8_GROUPED_KNOBS.items() if k != "W_FP8"}
    runs = [_run_poisoned(cupy, bf16, **{**bf16_knobs, "DB_ROW_TILES": r}) for r in (2, 1)]
    assert not np.isnan(runs[0].astype(np.float32)).any()
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
