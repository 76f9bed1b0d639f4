"""The batched families on fp8-block128 weights (kernels/batched/: the FMA, tensor-core and per-pair kernel families
with the format's loader) and on its 16-row tiles, fp8-block128-t16.

CPU: the families' own CUDA C through a g++ emulation (one lane per thread of a block, shuffles and barriers through
fibers, mma.sync in software) against ``reference.moe_decode(mode="warp_decode", weight_format="fp8-block128")``
and the fp64 oracle on the same weights: partial scale blocks at both edges (H = 200 / 208 / 400, I = 48 / 136 /
144), 8-value loads where H or I is not a multiple of 16 and 16-value ones where both are, the FMA gate_up's
intermediate bitwise the strict FP8 kernel's, the tensor-core kernels (the tile table, the balanced and the grouped
downs, hot tiles, two row tiles per down warp, shared widening), the per-pair kernels, the tiled format, bad ids; the
byte-permute widening over all 256 bytes; the derived and auto rules; the sm_90 compile without spills. GPU: presets
and routings, bitwise repeats, graph replay, the forms that must give the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels import warp_decode_fp8 as wdf
from kernels.batched import fma, mma
from kernels.contract import BF16, Dims
from kernels.family import Compiled
from kernels.formats import FP8, FP8_BLOCK128, FP8_BLOCK128_T16, format_of, get_format, quantize_weights
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tests.test_warp_decode_batched import (
    _assert_lists_equal,
    _emulate,
    _tile_pairs,
    _unpack_lists,
    expert_lists_numpy,
)
from tests.test_warp_decode_fp8 import _emulate as strict_fp8_emulation
from tests.warp_checks import _assert_matches, _poisoned_out, _seed, slow_except

FMT = FP8_BLOCK128.name
T16 = FP8_BLOCK128_T16.name


def _fp8_problem(problem: Problem, weight_format: str = FMT) -> Problem:
    """The problem with its weights in ``weight_format`` (host arrays: e4m3fn values, float32 scales)."""
    q13, q2 = quantize_weights(problem.w13, problem.w2, weight_format)
    return dataclasses.replace(problem, w13=q13, w2=q2)


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


def _grouped(weight_format: str = FMT) -> dict[str, int]:
    """The batch-invariant grouped path's knobs (the tensor-core family's) on ``weight_format``."""
    return mma.grouped_knobs(get_format(weight_format))


def _resolve(dims: Dims | None, path: str, weight_format: str = FMT, **knobs: Any) -> dict[str, int]:
    return batched.family(path, weight_format).resolve(dims, **knobs)


def _assert_lists(raw: np.ndarray, problem: Problem, tile_pairs: int, ids: np.ndarray | None = None) -> None:
    """The lists buffer against its NumPy model (tests/test_warp_decode_batched.py)."""
    dims = _dims(problem)
    _assert_lists_equal(_unpack_lists(raw, dims),
                        expert_lists_numpy(problem.topk_ids if ids is None else ids, dims.experts, tile_pairs))


# ---------------------------------------------------------------------------------------------------
# CPU: the families' CUDA C emulated (g++): tests/test_warp_decode_batched.py's harness, _emulate
# ---------------------------------------------------------------------------------------------------
def _strict_fp8_intermediate(problem: Problem) -> np.ndarray:
    """The strict FP8 kernel's emulated gate_up output [T, K, I] (bf16 bits)."""
    return strict_fp8_emulation(problem, problem.w13, problem.w2, intermediate=True, GU_CHUNK=8)[1]


def _references(problem: Problem, ids: np.ndarray | None = None,
                out_dtype: Any = BF16) -> tuple[np.ndarray, np.ndarray]:
    fmt = format_of(problem.w13)
    args = (problem.x, problem.w13, problem.w2, problem.topk_ids if ids is None else ids, problem.topk_weights)
    return (moe_decode(*args, mode="warp_decode", weight_format=fmt, out_dtype=out_dtype),
            moe_decode(*args, mode="fp64", weight_format=fmt))


def _bits32(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


MULTI_SHAPE = MoEShape("h200-i136", 200, 136, 5, 3)  # partial scale blocks at both edges; 8-value loads (H % 16)
SHAPE_48 = MoEShape("h200-i48", 200, 48, 6, 2)  # one partial I block, two H blocks (the second partial)
SHAPE_16 = MoEShape("h208-i144", 208, 144, 6, 2)  # multiples of 16 with a partial last scale block along H and I
DUPLICATES = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]]  # duplicate ids in a token
EMULATED = [  # (shape, T, routing, path, knobs, also fp32 out)
    ("tiny", 3, "uniform", "fma", fma.FP8_KNOBS, True),  # the FMA kernels as the FP8 variant runs them
    # 8-byte activation chunks (4 bytes of weights), 3 outputs a warp, partial scale blocks at both edges
    (MULTI_SHAPE, 9, "zipf", "fma", {"GB_BYTES": 8, "GB_OUTS": 3, "DB_OUTS": 3}, False),
    (SHAPE_48, 6, DUPLICATES, "fma", {"GB_BYTES": 16, "GB_TILE": 2, "DB_TILE": 3}, False),
    # the tensor-core family with 8-value loads (H % 16 = 8): the tile table with the balanced down (3 warps cutting
    # the runs), the grouped down with hot tiles in two-block passes, duplicate ids
    (MULTI_SHAPE, 12, "same", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, True),
    (MULTI_SHAPE, 9, "zipf", "mma", {"DB_GROUPED": 1, "HOT_NBLK": 2}, False),
    (SHAPE_48, 6, DUPLICATES, "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, False),
    # the per-pair family: one chain over H and two neuron groups a block; GB_KSPLIT 2 over two H blocks (the second
    # partial): a range per warp, each 32-wide k block scaled by its block
    (MULTI_SHAPE, 6, "same", "pairs", {"GB_KSPLIT": 1, "GB_WARPS": 2}, True),
    (SHAPE_48, 4, "zipf", "pairs", {"GB_KSPLIT": 2, "GB_WARPS": 2}, False),
    # 16-value loads (64-wide k blocks: H and I multiples of 16), partial blocks at both edges (H = 208, I = 144):
    # the grouped down with hot tiles, the balanced down's runs cut mid-scale-block, rounds of 3 k blocks
    (SHAPE_16, 7, "zipf", "mma", {"DB_GROUPED": 1, "HOT_NBLK": 2}, True),
    (SHAPE_16, 6, "uniform", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3, "GB_UNROLL": 1}, False),
    (SHAPE_16, 6, "same", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3, "DB_UNROLL": 3}, False),
    (SHAPE_16, 5, "zipf", "pairs", {"GB_KSPLIT": 2, "GB_WARPS": 2}, False),  # ranges of 16 + 10 chunks, each flushed
    (SHAPE_16, 9, "uniform", "mma", {}, False),  # the tensor-core variant's auto knobs
]
EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{c[3]}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "routing", "path", "knobs", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0}))
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any, path: str,
                                     knobs: dict[str, int], fp32: bool) -> None:
    """Lists vs the NumPy model, out vs the reference on the same FP8 weights; the FMA gate_up's intermediate
    bitwise the strict FP8 kernel's at its chunk size (GB_BYTES 16: 8 values)."""
    problem = _fp8_problem(make_problem(shape, tokens, seed=_seed(rng), routing=routing))
    got = _emulate(problem, path=path, **knobs)
    if path != "pairs":  # the per-pair family writes no lists
        _assert_lists(got["lists"], problem, _tile_pairs(_dims(problem), knobs, path, FMT))
    faithful, oracle = _references(problem)
    own_order = path != "fma"  # the tensor core sums 16 products at once
    _assert_matches(got["out"], faithful, oracle, f"fp8 emulated {problem.shape.name} {path} {knobs}",
                    own_order=own_order)
    if path == "fma" and got["params"]["GB_BYTES"] == 16:
        assert np.array_equal(got["inter"], _strict_fp8_intermediate(problem)), "intermediate != strict FP8's"
    if fp32:
        got32 = _emulate(problem, path=path, out_dtype=np.float32, **knobs)["out"]
        faithful32, _ = _references(problem, out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, "fp8 emulated fp32 out", own_order=own_order)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "knobs"), [pytest.param("fma", fma.FP8_KNOBS, id="fma"),
                                             pytest.param("mma", {"DB_GROUPED": 1}, id="mma-grouped"),
                                             pytest.param("pairs", {}, id="pairs")])
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator, path: str, knobs: dict[str, int]) -> None:
    """Out-of-range ids reach the FP8 kernels (as under capture): those tokens' rows NaN, the others right."""
    problem = _fp8_problem(make_problem("tiny", 5, seed=_seed(rng)))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -3
    got = _emulate(problem, path=path, ids=ids, **knobs)
    assert np.all(np.isnan(got["out"][[0, 2]].astype(np.float32)))
    if path != "pairs":
        _assert_lists(got["lists"], problem, _tile_pairs(_dims(problem), knobs, path, FMT), ids=ids)
    good = [1, 3, 4]
    sub = dataclasses.replace(problem, tokens=3, x=problem.x[good], topk_ids=problem.topk_ids[good],
                              topk_weights=problem.topk_weights[good])
    faithful, oracle = _references(sub)
    _assert_matches(got["out"][good], faithful, oracle, "fp8 emulated good tokens", own_order=path != "fma")


def test_fragment_widening_is_exact_and_normal() -> None:
    """The tensor-core A fragment's widening over every finite e4m3fn byte in both halves of a word: each byte
    sign-extended to 16 bits (prmt.b32), shifted left by 4 and masked with 0x87F0 gives the bf16 bits of value x
    2^-120 exactly (subnormals as bf16 subnormals), in either half; the 2^8 the tensor-core kernels put on the B
    fragments (FP8_PRMT 2; the per-pair family's intermediate written x 2^8, FP8_PRMT 3) makes each product value x
    2^-112 x activation -- exact and never subnormal (2^-121 at the least), what the FP8_UNSCALE multiply undoes. The
    bit steps of kernels/device_helpers.py."""
    codes = np.arange(256, dtype=np.uint32)
    values = codes.astype(np.uint8).view(FP8).astype(np.float32)
    finite = np.isfinite(values)
    sext = np.where(codes & 0x80, codes | 0xFF00, codes)  # a sign-extended byte: one 16-bit half
    word = (((sext | (sext[::-1] << 16)) << 4) & 0xFFFFFFFF) & 0x87F087F0  # the high half drops the low's sign copies
    for half, vals in ((0, values), (1, values[::-1])):
        low = (((word >> (16 * half)) & 0xFFFF).astype(np.uint32) << 16).view(np.float32)
        ok = np.isfinite(vals)
        np.testing.assert_array_equal(low[ok], vals[ok] * np.float32(2.0**-120))
        scaled = low * np.float32(256)  # the 2^8 moved to the other operand: the same products
        np.testing.assert_array_equal(scaled[ok], vals[ok] * np.float32(2.0**-112))
        tiny = np.abs(scaled[ok & (vals != 0)])
        assert tiny.min() == np.float32(2.0**-121) and np.all(tiny >= np.finfo(np.float32).tiny)
    assert finite.sum() == 254  # 0x7F and 0xFF: e4m3fn's NaN, which the quantizer never writes


@pytest.mark.parametrize("which", ["one", pytest.param("presets", marks=pytest.mark.slow)])
def test_compile_without_spills(which: str) -> None:
    """The FMA and tensor-core families on fp8-block128 as registered, at the qwen3 shapes' batches, compile for
    sm_90 with no spill (the quick subset compiles the tensor-core family at qwen3-30b T = 64 only)."""
    from kernels.compile import offline_report
    from kernels.shapes import get_shape

    points = (("fma", 1, fma.FP8_KNOBS), ("fma", 4, fma.FP8_KNOBS), ("fma", 16, fma.FP8_KNOBS), ("mma", 8, {}),
              ("mma", 64, {}))
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b") if which == "presets" else ("qwen3-30b-a3b",):
        shape = get_shape(model)
        for path, tokens, knobs in points if which == "presets" else points[-1:]:
            family = batched.family(path, FMT)
            params = family.resolve(Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k),
                                    **knobs)
            for report in offline_report(family.source, **params):
                assert report.spill_stores == 0 and report.spill_loads == 0, (model, path, tokens, report)


def test_weights_and_knobs_must_agree() -> None:
    """The weights say the format (no knob does: W_FP8 / W_TILED and the derived macros are refused as unknown);
    the FMA family on fp8-block128 needs 8- or 16-byte activation chunks; the variants say their format and path."""
    from kernels.variants import get_variant

    with pytest.raises(ValueError, match="fp8-block128 weights load GB_BYTES x 0.5 bytes per activation chunk "
                                         r"\(at least 4\): GB_BYTES must be 8 or 16"):
        _resolve(None, "fma", GB_BYTES=4)
    assert _resolve(None, "fma", "bf16", GB_BYTES=4)["GB_BYTES"] == 4
    for path in batched.FAMILIES:
        for knob in ("W_FP8", "W_TILED", "FP8_LOAD16", "FP8_PRMT", "FP8_BLOCK_SUM", "GB_RANGE_FLUSH", "PER_PAIR",
                     "GB_NBLK"):
            with pytest.raises(ValueError, match=rf"unknown .* parameter\(s\) \['{knob}'\]"):
                _resolve(None, path, **{knob: 1})
    with pytest.raises(ValueError, match="no fma loader for weight format 'fp8-block128-t16'"):
        batched.family("fma", T16)
    registered = {"cupy:warp-decode-batched-fp8": ("fma", FMT, fma.FP8_KNOBS), "cupy:warp-decode-mma-fp8":
                  ("mma", FMT, {}), "cupy:warp-decode-mma-grouped-fp8": ("mma", FMT, _grouped()),
                  "cupy:warp-decode-mma-pairs-fp8": ("pairs", FMT, {}), "cupy:warp-decode-mma-fp8-t16":
                  ("mma", T16, {}), "cupy:warp-decode-mma-grouped-fp8-t16": ("mma", T16, _grouped(T16)),
                  "cupy:warp-decode-mma-pairs-fp8-t16": ("pairs", T16, {})}
    for name, (path, fmt, knobs) in registered.items():
        variant = get_variant(name)
        assert variant.weight_format == fmt and batched.PATHS[name] == (path, knobs), name
        assert variant.kernel_family is batched.family(path, fmt), name
    problem = make_problem("tiny", 2)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        batched.warp_decode_batched(problem.x, q13, q2, problem.topk_ids, problem.topk_weights, path="mma")


def test_derived_and_auto_rules() -> None:
    """FP8_PRMT (derived): the byte-permute widening with its multiply on B on the FP8 tensor-core family (2), the
    per-pair family's intermediate written x 2^8 (3), 0 on bf16; FP8_LOAD16 1 on fp8 where H and I are multiples of 16
    (8-value loads elsewhere). DB_ROW_TILES auto: 2 on the FP8 grouped down from T*K >= 2E at I >= 1536 with DB_UNROLL
    >= 2; DB_UNROLL auto: 4 on the FP8 grouped down with one row tile at I >= 1536, else 2; DB_WARPS auto: 2 on the
    FP8 grouped down at I >= 1536, else 4; DB_GROUPED auto on the FP8 tensor-core path: from T*K >= E/4 at I >=
    1536; HOT_NBLK auto 2 on FP8 from T*K >= 4E."""
    knob_sets = {"mma": ("mma", FMT, {}), "grouped": ("mma", FMT, _grouped()), "pairs": ("pairs", FMT, {}),
                 "fma": ("fma", FMT, fma.FP8_KNOBS), "bf16": ("mma", "bf16", {}),
                 "bf16-grouped": ("mma", "bf16", _grouped("bf16"))}

    def resolved(kind: str, tokens: int, inter: int = 768, **more: int) -> dict[str, int]:
        path, fmt, knobs = knob_sets[kind]
        return _resolve(Dims(tokens, 2048 if inter == 768 else 4096, inter, 128, 8), path, fmt, **{**knobs, **more})

    assert [resolved("mma", t)["FP8_PRMT"] for t in (1, 8, 32, 64)] == [2, 2, 2, 2]
    assert [resolved(k, 64)["FP8_PRMT"] for k in ("grouped", "pairs", "bf16")] == [2, 3, 0]
    assert "FP8_PRMT" not in resolved("fma", 8) and "FP8_LOAD16" not in resolved("fma", 8)  # the FMA loader's own
    assert [resolved(k, 8)["FP8_LOAD16"] for k in ("mma", "pairs", "bf16")] == [1, 1, 0]
    for path in ("mma", "pairs"):  # 8-value loads where H or I is not a multiple of 16
        assert [_resolve(Dims(4, h, i, 6, 2), path)["FP8_LOAD16"] for h, i in ((200, 48), (208, 40), (208, 48))] == [
            0, 0, 1]
    tiles = {(k, t, i): resolved(k, t, i)["DB_ROW_TILES"] for k in ("mma", "grouped", "bf16-grouped")
             for t in (16, 32) for i in (768, 1536)}
    assert {key for key, r in tiles.items() if r == 2} == {("mma", 32, 1536), ("grouped", 32, 1536)}
    assert resolved("mma", 64, 1536, DB_UNROLL=1)["DB_ROW_TILES"] == 1
    unrolls = {(k, t, i): resolved(k, t, i)["DB_UNROLL"] for k in ("mma", "grouped") for t in (8, 16, 32)
               for i in (768, 1536)}
    four = {(k, t, 1536) for k in ("mma", "grouped") for t in (8, 16)}  # the tensor-core path grouped there too
    assert {key for key, u in unrolls.items() if u != 2} == four and {unrolls[key] for key in four} == {4}
    assert resolved("grouped", 16, 1536, DB_UNROLL=2)["DB_UNROLL"] == 2  # a set value stays
    assert resolved("grouped", 16, 1536, DB_ROW_TILES=2)["DB_UNROLL"] == 2  # two tiles spill at 4
    # DB_GROUPED auto on the FP8 tensor-core path: from T*K >= E/4 at I >= 1536, from T*K >= 2E elsewhere and on bf16
    grouped = {(k, t, i): resolved(k, t, i)["DB_GROUPED"] for k in ("mma", "bf16") for t in (2, 3, 4, 16, 32)
               for i in (768, 1536)}
    assert {key for key, g in grouped.items() if g} == {("mma", t, 1536) for t in (4, 16, 32)} | \
        {(k, 32, i) for k in ("mma", "bf16") for i in (768, 1536)}
    assert resolved("mma", 8, 1536, DB_GROUPED=0)["DB_GROUPED"] == 0  # a set value stays
    warps = {(k, i): resolved(k, 64, i)["DB_WARPS"] for k in ("mma", "bf16") for i in (768, 1536)}
    assert warps == {("mma", 768): 4, ("mma", 1536): 2, ("bf16", 768): 4, ("bf16", 1536): 4}  # grouped downs
    hot = {(k, t): resolved(k, t)["HOT_NBLK"] for k in ("mma", "grouped") for t in (16, 32, 64)}
    assert {key for key, h in hot.items() if h} == {("mma", 64), ("grouped", 64)} and set(hot.values()) == {0, 2}
    # the per-pair family: the format's invariant ranges (fp8: 4), a warp each, 2 k blocks in flight, 4 in the down
    per_pair = resolved("pairs", 2)
    assert (per_pair["GB_KSPLIT"], per_pair["GB_WARPS"], per_pair["GB_UNROLL"], per_pair["DB_UNROLL"],
            per_pair["PAIRS_INNER"]) == (mma.FP8_INVARIANT_KSPLIT, mma.FP8_INVARIANT_KSPLIT, 2, 4, 0)
    assert resolved("grouped", 2)["GB_KSPLIT"] == per_pair["GB_KSPLIT"] == mma.invariant_ksplit(get_format(FMT))


SHAPE_400 = MoEShape("h400-i64", 400, 64, 5, 3)  # 50 chunks: ranges of 16, 16, 16, 2; a partial last scale block


@pytest.mark.slow
def test_range_flush_emulated() -> None:
    """GB_RANGE_FLUSH 1 (derived) on FP8 weights -- the split-chain gate_up's ranges in one loop, the scale block's
    partial kept across rounds -- gives the bits of the loop per range (GB_RANGE_FLUSH 0, emulated) and of the
    per-pair form, with 16-value loads, a short last range ending in a masked round and a partial last scale block.
    The rule takes it where every range is whole rounds and whole 128-wide scale blocks, the loop per range elsewhere.
    Rounds of one 64-wide k block: a scale block spans two of them."""
    problem = _fp8_problem(make_problem(SHAPE_400, 9, seed=11, routing="zipf"))
    knobs = {**_grouped(), "GB_KSPLIT": 4, "GB_UNROLL": 1}
    dims = _dims(problem)
    resolved = _resolve(dims, "mma", **knobs)
    assert resolved["FP8_LOAD16"] == 1 and resolved["GB_RANGE_FLUSH"] == 1
    got = _emulate(problem, path="mma", out_dtype=np.float32, **knobs)
    want = _emulate(problem, path="mma", out_dtype=np.float32, GB_RANGE_FLUSH=0, **knobs)
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(_bits32(got["out"]), _bits32(want["out"]))
    per_pair = _emulate(problem, path="pairs", out_dtype=np.float32, GB_KSPLIT=4, GB_WARPS=4)
    assert np.array_equal(_bits32(per_pair["out"]), _bits32(got["out"]))
    faithful, oracle = _references(problem, out_dtype=np.float32)
    _assert_matches(got["out"], faithful, oracle, "FP8 range flush", own_order=True)

    def flush(**more: int) -> int:
        return _resolve(dims, "mma", **{**knobs, **more})["GB_RANGE_FLUSH"]

    assert flush(GB_KSPLIT=8) == 0  # 8-chunk ranges would end inside a scale block
    assert flush(GB_UNROLL=4) == 0  # 16-chunk ranges in rounds of 32
    assert flush(GB_KSPLIT=1) == 0 and flush(GB_UNROLL=2) == 1


@pytest.mark.slow
def test_hot_tiles_emulated() -> None:
    """HOT_NBLK 2: the tile table holds tiles of up to 16 pairs, and a tile with more than 8 runs in ONE pass of two
    8-pair blocks with half the k blocks in flight (the bf16 grouped down: all of them, hot_unroll). In the
    batch-invariant grouped path (split-chain gate_up with the range flush, 16-value loads on FP8; the grouped down)
    that moves work only: the same bits as one block per pass, on FP8 and bf16 weights, with hot tiles (up to 12
    pairs) beside ordinary ones; so do the hot gate_up passes at GB_UNROLL's rounds (GB_HOT_UNROLL 2)."""
    base = make_problem(SHAPE_400, 12, seed=12, routing="zipf")
    counts = np.bincount(base.topk_ids.ravel(), minlength=SHAPE_400.experts)
    assert counts.max() > 8 and 0 < counts.min() <= 8  # hot tiles and ordinary ones
    knobs = {**_grouped(), "GB_KSPLIT": 4, "GB_UNROLL": 2}
    for problem, scaled in ((_fp8_problem(base), True), (base, False)):
        fmt = format_of(problem.w13)
        hot = _resolve(_dims(problem), "mma", fmt, **{**knobs, "HOT_NBLK": 2})
        assert (hot["GB_RANGE_FLUSH"], mma.tile_pairs(hot)) == (1, 16)
        assert hot["DB_HOT_UNROLL"] == (0 if scaled else hot["DB_UNROLL"])  # bf16: the hot down at full rounds
        got = _emulate(problem, path="mma", out_dtype=np.float32, **{**knobs, "HOT_NBLK": 2})
        want = _emulate(problem, path="mma", out_dtype=np.float32, **{**knobs, "HOT_NBLK": 0})
        _assert_lists(got["lists"], problem, 16)
        assert np.array_equal(got["inter"], want["inter"]), fmt
        assert np.array_equal(_bits32(got["out"]), _bits32(want["out"])), fmt
        deep = _emulate(problem, path="mma", out_dtype=np.float32, **{**knobs, "HOT_NBLK": 2, "GB_HOT_UNROLL": 2})
        assert np.array_equal(_bits32(deep["out"]), _bits32(want["out"])), fmt
    for path in ("fma", "pairs"):  # hot tiles are the tensor-core family's tile table
        with pytest.raises(ValueError, match=r"unknown .* parameter\(s\) \['HOT_NBLK'\]"):
            _resolve(None, path, HOT_NBLK=2)


SHAPE_T16 = MoEShape("h192-i192", 192, 192, 6, 2)  # 64-value tiles; a partial last scale block along H and I
SHAPE_T16_WIDE = MoEShape("h512-i128", 512, 128, 6, 2)  # 4 k ranges of one scale block each: the range flush
TILED_CASES = [  # (shape, T, routing, path, knobs): the forms that read fp8-block128-t16 tiles
    (SHAPE_T16, 3, "uniform", "pairs", {}),  # the per-pair form
    (SHAPE_T16, 12, "zipf", "mma", {"HOT_NBLK": 2, "DB_GROUPED": 1, "DB_ROW_TILES": 2}),  # hot passes, 32-row downs
    (SHAPE_T16, 6, "same", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3, "DB_UNROLL": 1}),  # runs cut inside rows
    # the batch-invariant grouped form: 4 split chains walked in one loop (the range flush), the grouped down
    (SHAPE_T16_WIDE, 9, "zipf", "mma", {**_grouped(T16), "GB_UNROLL": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "path", "knobs"), TILED_CASES,
                         ids=["pairs", "hot-grouped", "balanced", "invariant-grouped"])
def test_tiled_values_emulated(shape: Any, tokens: int, routing: Any, path: str, knobs: dict[str, int]) -> None:
    """fp8-block128-t16: the same values in 16-row x 64-value tiles give the bits of fp8-block128's rows in every
    tensor-core form (the same knobs: only the loader's addresses move), and the reference reads the tiles back;
    widths that are not whole tiles are refused."""
    base = make_problem(shape, tokens, seed=tokens, routing=routing)
    rows = _fp8_problem(base)
    tiled = _fp8_problem(base, T16)
    assert (tiled.w13.layout, tiled.w2.layout) == ("t16", "t16") and tiled.w13.values.shape == rows.w13.values.shape
    want = _emulate(rows, path=path, out_dtype=np.float32, **knobs)
    got = _emulate(tiled, path=path, out_dtype=np.float32, **knobs)
    assert got["params"] == want["params"]
    assert np.array_equal(got["inter"], want["inter"])
    assert np.array_equal(_bits32(got["out"]), _bits32(want["out"]))
    if path == "mma" and knobs.get("HOT_NBLK"):
        _assert_lists(got["lists"], tiled, _tile_pairs(_dims(tiled), knobs, path, T16))
    args = (base.x, tiled.w13, tiled.w2, base.topk_ids, base.topk_weights)
    assert np.array_equal(moe_decode(*args, mode="fp64", weight_format=T16),
                          moe_decode(base.x, rows.w13, rows.w2, base.topk_ids, base.topk_weights, mode="fp64",
                                     weight_format=FMT))
    with pytest.raises(ValueError, match="'t16'-ordered"):
        moe_decode(base.x, rows.w13, rows.w2, base.topk_ids, base.topk_weights, weight_format=T16)
    for refused in ("pairs", "mma"):
        with pytest.raises(ValueError, match="fp8-block128-t16 holds 64-value tiles: H and I must be multiples of 64"):
            _resolve(_dims(make_problem(SHAPE_16, 2, seed=0)), refused, T16)
        with pytest.raises(ValueError, match="fp8-block128-t16 holds 64-value tiles"):
            _resolve(Dims(2, 200, 64, 6, 2), refused, T16)  # not even 16-value loads: the tiles' rule names it


# T = 40, K = 2 over 6 experts: expert 0 in every token (5 tiles of 8, 3 of 16), expert 1 in 20 (3 / 2 tiles), 2 in 12
# (2 / 1), 3..5 in the last 8 (1 each)
SHARE_IDS = [[0, 1 if t < 20 else 2 if t < 32 else 3 + t % 3] for t in range(40)]


@pytest.mark.slow
@pytest.mark.parametrize(("hot", "row_tiles", "ksplit"), [(0, 1, 1), (2, 2, 1), (0, 1, 2)])
def test_shared_widening_emulated(hot: int, row_tiles: int, ksplit: int) -> None:
    """GB_SHARE / DB_SHARE 2 / 4: a hot expert's tiles in groups of 2 / 4 whose gate_up and grouped-down warps share
    each round's A fragments (runs of 5, 3 and 2 tiles: groups of 4 + 1, 2 + 2 + 1, 2 + 1, 2) give the bits of every
    tile on its own, intermediate and out, on FP8 and bf16 weights, with warps past I (I = 144: 18 neuron groups in
    blocks of 4), with HOT_NBLK 2's 16-pair tiles, two row tiles per grouped-down warp, and the batch-invariant
    form's split k chains walked in one loop (GB_KSPLIT 2, GB_RANGE_FLUSH); the tile table's runs as the NumPy model
    has them. Refused: groups without one loop over H, groups that do not divide the block, buffers beyond 48 KB,
    down groups without the grouped down."""
    base = make_problem(SHAPE_16, 40, seed=40, routing=SHARE_IDS)
    knobs = {"HOT_NBLK": hot, "DB_GROUPED": 1, "DB_ROW_TILES": row_tiles, "DB_WARPS": 4, "GB_SHARE": 0,
             "DB_SHARE": 0, "GB_KSPLIT": ksplit, **({"GB_UNROLL": 2} if ksplit > 1 else {})}
    for problem in (_fp8_problem(base), base):
        dims, fmt = _dims(problem), format_of(problem.w13)
        want = _emulate(problem, path="mma", out_dtype=np.float32, **knobs)
        for share in (2, 4):
            shared = {**knobs, "GB_SHARE": share, "DB_SHARE": share}
            resolved = _resolve(dims, "mma", fmt, **shared)
            assert (resolved["GB_WARPS"], resolved["DB_WARPS"], resolved["GB_KSPLIT"], resolved["GB_RANGE_FLUSH"],
                    mma.tile_pairs(resolved)) == (4, 4, ksplit, int(ksplit > 1), 8 * max(1, hot))
            got = _emulate(problem, path="mma", out_dtype=np.float32, **shared)
            _assert_lists(got["lists"], problem, mma.tile_pairs(resolved))
            assert np.array_equal(got["inter"], want["inter"]), (fmt, share)
            assert np.array_equal(_bits32(got["out"]), _bits32(want["out"])), (fmt, share)
        if fmt == FMT:
            faithful, oracle = _references(problem, out_dtype=np.float32)
            _assert_matches(want["out"], faithful, oracle, "fp8 shared widening", own_order=True)
    dims = _dims(base)
    refuse = {k: v for k, v in knobs.items() if k != "GB_UNROLL"}
    assert _resolve(dims, "mma", **{**refuse, "GB_KSPLIT": 2, "GB_UNROLL": 4})["GB_RANGE_FLUSH"] == 0
    with pytest.raises(ValueError, match="GB_SHARE groups .* one loop over H: it needs GB_KSPLIT 1 or whole-round"):
        _resolve(dims, "mma", **{**refuse, "GB_SHARE": 2, "GB_KSPLIT": 2, "GB_UNROLL": 4})
    with pytest.raises(ValueError, match="GB_SHARE must be 2 or 4 and divide GB_WARPS"):
        _resolve(dims, "mma", **{**refuse, "GB_KSPLIT": 1, "GB_SHARE": 4, "GB_WARPS": 2})
    with pytest.raises(ValueError, match="static shared memory"):
        _resolve(dims, "mma", **{**refuse, "GB_KSPLIT": 1, "GB_SHARE": 2, "GB_WARPS": 16, "GB_UNROLL": 8})
    with pytest.raises(ValueError, match="DB_SHARE groups the tile table's tiles of one expert in the grouped down"):
        _resolve(dims, "mma", **{**refuse, "DB_SHARE": 2, "DB_GROUPED": 0, "DB_ROW_TILES": 1})


def _subnormal_weights(problem: Problem, seed: int) -> Problem:
    """The FP8 problem with a quarter of its weight values made e4m3fn subnormals (random mantissa, sign kept)."""
    rng = np.random.default_rng(seed)

    def some_subnormal(q: Any) -> Any:
        codes = q.values.view(np.uint8)
        sub = (codes & 0x80) | rng.integers(1, 8, codes.shape, dtype=np.uint8)
        return dataclasses.replace(q, values=np.where(rng.random(codes.shape) < 0.25, sub, codes).view(FP8))

    return dataclasses.replace(problem, w13=some_subnormal(problem.w13), w2=some_subnormal(problem.w2))


WIDENINGS = [  # (shape, T, routing, GB_KSPLIT, grouped knobs): 16-value loads, then 8-value ones (H = 200)
    (SHAPE_16, 7, "zipf", 2, {"HOT_NBLK": 2}),
    (SHAPE_48, 6, DUPLICATES, mma.FP8_INVARIANT_KSPLIT, {}),
]


@pytest.mark.parametrize(("shape", "tokens", "routing", "ksplit", "knobs"),
                         slow_except(WIDENINGS, [f"{c[0].name}-T{c[1]}" for c in WIDENINGS], {0}))
def test_widening_multiply_on_b_emulated(shape: Any, tokens: int, routing: Any, ksplit: int,
                                         knobs: dict[str, int]) -> None:
    """The two places the widening's 2^8 goes: the grouped path's B fragments (FP8_PRMT 2: the activations and the
    intermediate x 2^8 as they are loaded) and the per-pair family's (FP8_PRMT 3: the gate_up writes the intermediate
    already x 2^8) give the same FP32 out bits -- the per-pair intermediate the grouped one's x 2^8 (NaN where it is
    NaN) -- with a quarter of the weights e4m3fn subnormals and activations spanning 2^-100 .. 2^60 (every product
    the same number either way). Both match the reference on the same weights."""
    problem = _subnormal_weights(_fp8_problem(make_problem(shape, tokens, seed=tokens, routing=routing)), tokens)
    rng = np.random.default_rng(tokens)
    spread = np.exp2(rng.integers(-100, 60, problem.x.shape)).astype(np.float32)
    problem = dataclasses.replace(problem, x=(problem.x.astype(np.float32) * spread).astype(BF16))

    def values(bits: np.ndarray) -> np.ndarray:  # the emulation's intermediate: bf16 bits
        return (bits.astype(np.uint32) << 16).view(np.float32)

    grouped = {**_grouped(), "GB_KSPLIT": ksplit, **knobs}
    on_b = _emulate(problem, path="mma", out_dtype=np.float32, **grouped)
    in_inter = _emulate(problem, path="pairs", out_dtype=np.float32, GB_KSPLIT=ksplit)
    assert (on_b["params"]["FP8_PRMT"], in_inter["params"]["FP8_PRMT"]) == (2, 3)
    assert np.array_equal(values(in_inter["inter"]), values(on_b["inter"]) * np.float32(256), equal_nan=True)
    assert np.array_equal(_bits32(in_inter["out"]), _bits32(on_b["out"]))
    mild = _subnormal_weights(_fp8_problem(make_problem(shape, tokens, seed=tokens + 1, routing=routing)), tokens)
    faithful, oracle = _references(mild, out_dtype=np.float32)
    for path, path_knobs in (("mma", grouped), ("pairs", {"GB_KSPLIT": ksplit})):
        _assert_matches(_emulate(mild, path=path, out_dtype=np.float32, **path_knobs)["out"], faithful, oracle,
                        f"fp8 widening with the multiply on B {shape.name} {path}", own_order=True)


ROW_TILES = [  # (shape, T, routing, knobs of the grouped path)
    (SHAPE_16, 12, "same", {"HOT_NBLK": 2}),  # H = 208: the last warp's second tile past H; every tile hot (12 pairs)
    (SHAPE_400, 9, "same", {"DB_UNROLL": 1}),  # H = 400: its second tile half past it
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
    grouped = {**_grouped(), **knobs}  # the FP8 ranges on both formats
    for problem in (_fp8_problem(base), base):
        two = _emulate(problem, path="mma", out_dtype=np.float32, **{**grouped, "DB_ROW_TILES": 2})
        one = _emulate(problem, path="mma", out_dtype=np.float32, **{**grouped, "DB_ROW_TILES": 1})
        assert not np.isnan(two["out"]).any()
        assert np.array_equal(two["inter"], one["inter"]), format_of(problem.w13)
        assert np.array_equal(_bits32(two["out"]), _bits32(one["out"])), format_of(problem.w13)
    with pytest.raises(ValueError, match="DB_ROW_TILES 2 gives the grouped down's warps more rows"):
        _resolve(_dims(base), "mma", "bf16", DB_GROUPED=0, DB_ROW_TILES=2)


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


def _run_poisoned(cupy: Any, problem: Problem, path: str, derived: dict[str, int] | None = None,
                  **knobs: Any) -> np.ndarray:
    """One batched layer on the device (the ``path`` family on the weights' format) with ``knobs``, out and the
    intermediate NaN-poisoned first; out on the host. ``derived``: derived macros set instead of by the rules (as
    ``_emulate`` takes them among its knobs: the other live form of a per-dims choice), run through the family's
    compile directly."""
    dims = _dims(problem)
    fmt = format_of(problem.w13)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    if derived:
        family = batched.family(path, fmt)
        assert set(derived) <= set(family.derived)
        params = {**family.for_device(family.resolve(dims, **knobs)), **derived}
        compiled = Compiled(family, dims, params, family.kernels_for(params), family.workspace(dims, params))
        compiled.workspace.intermediate.view(cupy.uint16).fill(0x7FC0)
        compiled.run(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, out)
    else:
        ws = batched.make_workspace(dims, path, fmt, **knobs)
        ws.intermediate.view(cupy.uint16).fill(0x7FC0)
        batched.warp_decode_batched(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights,
                                    out=out, workspace=ws, path=path, **knobs)
    cupy.cuda.runtime.deviceSynchronize()
    return out.get()


GPU_CASES = [("qwen3-30b-a3b", 4, "uniform", "fma"), ("qwen3-30b-a3b", 8, "zipf-1", "mma"),
             ("qwen3-30b-a3b", 64, "correlated", "mma"), ("qwen3-235b-a22b", 2, "zipf-2", "fma"),
             ("qwen3-235b-a22b", 32, "same", "mma"), ("tiny", 5, DUPLICATES[:5], "fma"), ("tiny", 7, "uniform", "mma"),
             ("qwen3-30b-a3b", 2, "uniform", "pairs"), ("qwen3-235b-a22b", 3, "zipf-2", "pairs"),
             ("qwen3-235b-a22b", 3, "zipf", "mma"), ("qwen3-30b-a3b", 4, "zipf", "mma-capped"),
             ("qwen3-235b-a22b", 2, "zipf", "pairs-two-groups"), ("qwen3-30b-a3b", 1, "uniform", "pairs-t16"),
             ("qwen3-235b-a22b", 3, "zipf", "pairs-t16"), ("qwen3-30b-a3b", 64, "zipf", "mma-t16"),
             ("qwen3-235b-a22b", 32, "same", "mma-t16"), ("qwen3-235b-a22b", 8, "correlated", "mma-t16"),
             ("qwen3-30b-a3b", 16, "zipf", "grouped-t16"), ("qwen3-235b-a22b", 8, "uniform", "grouped-t16"),
             ("qwen3-235b-a22b", 16, "zipf", "grouped")]
# (qwen3-235b at 16 experts and T = 3: T*K >= E/4 runs the grouped down with one row tile, DB_UNROLL 4, 2 warps)
# (tiny's H = 136 runs the tensor-core kernels with 8-value loads: FP8_LOAD16 is 1 at the presets, 0 there)
PATHS = {  # case -> (family path, knobs, the registered variant running them)
    "fma": ("fma", fma.FP8_KNOBS, "cupy:warp-decode-batched-fp8"),
    "mma": ("mma", {}, "cupy:warp-decode-mma-fp8"),
    "grouped": ("mma", _grouped(), "cupy:warp-decode-mma-grouped-fp8"),
    "pairs": ("pairs", {}, "cupy:warp-decode-mma-pairs-fp8"),
    # the gate_up under PASS_REGS (8 bytes of spill), as takes_pass_regs gives it at 128 experts and T = 4: the
    # variant's graph (uncapped at these 16 experts) must give the same bits
    "mma-capped": ("mma", {"GB_MAX_REGS": mma.PASS_REGS}, "cupy:warp-decode-mma-fp8"),
    # two groups of 8 neurons a per-pair gate_up block (GB_WARPS 2 x GB_KSPLIT): the same bits as the variant's one
    # group a block
    "pairs-two-groups": ("pairs", {"GB_WARPS": 2 * mma.FP8_INVARIANT_KSPLIT}, "cupy:warp-decode-mma-pairs-fp8"),
    # fp8-block128-t16's tiles: checked also bitwise against the same family on the row layout
    "mma-t16": ("mma", {}, "cupy:warp-decode-mma-fp8-t16"),
    "pairs-t16": ("pairs", {}, "cupy:warp-decode-mma-pairs-fp8-t16"),
    "grouped-t16": ("mma", _grouped(T16), "cupy:warp-decode-mma-grouped-fp8-t16"),
}


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "case"), GPU_CASES)
def test_gpu_paths(model: str, tokens: int, routing: Any, case: str) -> None:
    """Against the reference on the same FP8 weights (NaN-poisoned out and workspace), bitwise over a repeat, the
    variant's launch and a graph replay (tiles: bitwise the row layout's)."""
    import cupy

    from kernels.shapes import get_shape
    from kernels.variants import get_variant

    shape = get_shape(model)
    run_shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 5, routing=routing))
    tiled = case.endswith("-t16")
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 5, routing=routing), T16 if tiled else FMT)
    path, knobs, name = PATHS[case]
    variant = get_variant(name)
    assert variant.weight_format == format_of(problem.w13) and batched.PATHS[name][0] == path
    dims = _dims(problem)

    def run() -> np.ndarray:
        return _run_poisoned(cupy, problem, path, **knobs)

    first = run()
    faithful, oracle = _references(host)
    _assert_matches(first, faithful, oracle, f"fp8 {case} {model} T={tokens} {routing}", own_order=path != "fma")
    assert np.array_equal(run().view(np.uint16), first.view(np.uint16))
    if tiled:  # only the addresses move: the row layout's bits
        rows = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 5, routing=routing))
        assert np.array_equal(_run_poisoned(cupy, rows, path, **knobs).view(np.uint16), first.view(np.uint16))
    launch = variant.make(dims)
    replay = _poisoned_out(cupy, tokens, shape.hidden)
    stream = cupy.cuda.Stream(non_blocking=True)
    args = (problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, replay)
    with stream:
        launch(*args)
        stream.synchronize()
        assert np.array_equal(replay.get().view(np.uint16), first.view(np.uint16))
        replay.view(cupy.uint16).fill(0x7FC0)
        stream.begin_capture()
        launch(*args)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(replay.get().view(np.uint16), first.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mma", "pairs", "grouped"])
def test_gpu_subnormal_weights(case: str) -> None:
    """Weights that are all e4m3fn subnormals against the reference on the same weights, x scaled by 2^18 so that
    every product and partial stays in FP32's normal range: the widened A fragments must carry every subnormal
    exactly (a widening that lost them would zero the output: 170 x the check's bound, seen on the host by flushing
    the reference's weights). The byte-permute widening with its 2^8 on the B fragments (the tensor-core family,
    FP8_PRMT 2) or in the intermediate (the per-pair family, FP8_PRMT 3): the A fragments of subnormals are bf16
    subnormals."""
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
    path, knobs, _ = PATHS[case]
    out = _run_poisoned(cupy, device, path, **knobs)
    faithful, oracle = _references(host)
    _assert_matches(out, faithful, oracle, f"fp8 {case} subnormal weights", own_order=True)


@pytest.mark.gpu
def test_gpu_fma_intermediate_is_the_strict_fp8_kernels() -> None:
    """On the device too: the FP8 FMA gate_up at 8-value chunks writes the strict FP8 kernel's intermediate, bit for
    bit."""
    import cupy

    problem = _device(cupy, make_problem("qwen3-30b-a3b", 4, seed=3))
    dims = _dims(problem)
    ws = batched.make_workspace(dims, "fma", FMT, **fma.FP8_KNOBS)
    out = cupy.empty((dims.tokens, dims.hidden), BF16)
    batched.warp_decode_batched(problem.x, problem.w13, problem.w2, problem.topk_ids, problem.topk_weights, out=out,
                                workspace=ws, path="fma", **fma.FP8_KNOBS)
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
    """GB_RANGE_FLUSH 1 -- what the rule derives on FP8 weights at the presets' widths (H = 2048 / 4096: 32 / 64-chunk
    ranges, two / four scale blocks each) -- gives the bits of the loop per range (GB_RANGE_FLUSH 0, compiled here by
    hand) and of the per-pair form, every output written (NaN-poisoned out and intermediate), and matches the
    reference on the same weights."""
    import cupy

    from kernels.shapes import get_shape

    shape = get_shape(model)
    run_shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 9, routing=routing))
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 9, routing=routing))
    dims = _dims(problem)
    assert _resolve(dims, "mma", **_grouped())["GB_RANGE_FLUSH"] == 1
    flush = _run_poisoned(cupy, problem, "mma", **_grouped())
    faithful, oracle = _references(host)
    _assert_matches(flush, faithful, oracle, f"fp8 range flush {model} T={tokens} {routing}", own_order=True)
    per_range = _run_poisoned(cupy, problem, "mma", derived={"GB_RANGE_FLUSH": 0}, **_grouped())
    assert np.array_equal(per_range.view(np.uint16), flush.view(np.uint16))
    assert np.array_equal(_run_poisoned(cupy, problem, "pairs").view(np.uint16), flush.view(np.uint16))
    assert np.array_equal(_run_poisoned(cupy, problem, "mma", **_grouped()).view(np.uint16), flush.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-30b-a3b", 32, "zipf"), ("qwen3-235b-a22b", 64, "same")])
def test_gpu_hot_tiles_bitwise(model: str, tokens: int, routing: str) -> None:
    """HOT_NBLK 2 at the presets' widths, 16 experts (hot ones hold up to T pairs): the grouped path gives the bits
    of one 8-pair block per pass, every output written (NaN-poisoned out and intermediate); the plain tensor-core
    path with it (its grouped down too at these T: T*K >= 2E) matches the reference on the same weights -- on FP8
    and on bf16 (there under the auto 96-register caps of the gate_up and the grouped down; the hot gate_up passes
    at 4 k blocks in flight, GB_HOT_UNROLL 4, give the same bits). The balanced down over
    wider tiles is checked emulated (tests/test_warp_decode_batched.py)."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    raw = make_problem(run_shape, tokens, seed=tokens + 3, routing=routing)
    host, problem = _fp8_problem(raw), _device(cupy, raw)
    assert np.bincount(host.topk_ids.ravel()).max() > 8
    hot = _run_poisoned(cupy, problem, "mma", **{**_grouped(), "HOT_NBLK": 2})
    faithful, oracle = _references(host)
    _assert_matches(hot, faithful, oracle, f"fp8 hot tiles {model} T={tokens} {routing}", own_order=True)
    one_block = _run_poisoned(cupy, problem, "mma", **{**_grouped(), "HOT_NBLK": 0})
    assert np.array_equal(one_block.view(np.uint16), hot.view(np.uint16))
    plain = _run_poisoned(cupy, problem, "mma", HOT_NBLK=2)
    _assert_matches(plain, faithful, oracle, f"fp8 hot tiles, plain path {model} T={tokens}", own_order=True)
    bf16 = _bf16_on_device(cupy, raw)
    args = (raw.x, raw.w13, raw.w2, raw.topk_ids, raw.topk_weights)
    faithful, oracle = moe_decode(*args, mode="warp_decode"), moe_decode(*args, mode="fp64")
    for grouped in (True, False):
        hot_knobs = {**(_grouped("bf16") if grouped else {}), "HOT_NBLK": 2}
        assert _resolve(_dims(raw), "mma", "bf16", **hot_knobs)["DB_MAX_REGS"] == mma.PASS_REGS
        hot = _run_poisoned(cupy, bf16, "mma", **hot_knobs)
        what = f"bf16 hot tiles {model} T={tokens} grouped={grouped}"
        _assert_matches(hot, faithful, oracle, what, own_order=True)
        assert np.array_equal(_run_poisoned(cupy, bf16, "mma", **hot_knobs).view(np.uint16), hot.view(np.uint16))
        deep = _run_poisoned(cupy, bf16, "mma", **{**hot_knobs, "GB_HOT_UNROLL": 4})  # the hot gate_up at 4 k blocks
        assert np.array_equal(deep.view(np.uint16), hot.view(np.uint16))
        if grouped:
            one_block = _run_poisoned(cupy, bf16, "mma", **{**hot_knobs, "HOT_NBLK": 0})
            assert np.array_equal(one_block.view(np.uint16), hot.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-235b-a22b", 32, "zipf"), ("qwen3-30b-a3b", 64, "same"),
                          ("qwen3-235b-a22b", 64, "zipf")])
def test_gpu_shared_widening_bitwise(model: str, tokens: int, routing: str) -> None:
    """GB_SHARE / DB_SHARE 2 / 4 (a hot expert's tiles sharing each round's widened A fragments in the gate_up and
    the grouped down) give the bits of no sharing on the tensor-core FP8 path, on bf16 and on the batch-invariant
    grouped path's split k chains at the presets' widths (16 experts: runs of up to 4-8 tiles), every output written
    (NaN-poisoned out and intermediate), repeatably, and match the reference."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    host = _fp8_problem(make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    problem = _device(cupy, make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    assert np.bincount(host.topk_ids.ravel()).max() > 16
    bf16 = _bf16_on_device(cupy, make_problem(run_shape, tokens, seed=tokens + 6, routing=routing))
    faithful, oracle = _references(host)
    for on, knobs in ((problem, {}), (bf16, {}), (bf16, _grouped("bf16"))):
        alone = _run_poisoned(cupy, on, "mma", **{**knobs, "GB_SHARE": 0, "DB_SHARE": 0})
        resolved = _resolve(_dims(on), "mma", format_of(on.w13), **knobs)
        assert resolved["DB_GROUPED"] == 1
        for share in (2, 4):
            down_share = share if resolved["DB_WARPS"] % share == 0 else 2  # 2 where the down has 2 warps (FP8, I 1536)
            shared = _run_poisoned(cupy, on, "mma", **{**knobs, "GB_SHARE": share, "DB_SHARE": down_share})
            assert not np.isnan(shared.astype(np.float32)).any()
            assert np.array_equal(shared.view(np.uint16), alone.view(np.uint16)), (share, on is problem)
            repeat = _run_poisoned(cupy, on, "mma", **{**knobs, "GB_SHARE": share, "DB_SHARE": down_share})
            assert np.array_equal(repeat.view(np.uint16), shared.view(np.uint16))
        if on is problem:
            _assert_matches(alone, faithful, oracle, f"fp8 shared widening {model} T={tokens}", own_order=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"),
                         [("qwen3-30b-a3b", 1, "uniform"), ("qwen3-235b-a22b", 16, "zipf"),
                          ("qwen3-30b-a3b", 64, "same")])
def test_gpu_widening_multiply_on_b_bitwise(model: str, tokens: int, routing: str) -> None:
    """The per-pair family (the widening's 2^8 in the intermediate, FP8_PRMT 3) gives the grouped path's bits (the
    2^8 on the B fragments, FP8_PRMT 2) at the presets' widths, every output written (NaN-poisoned out and
    intermediate), with a quarter of the weights e4m3fn subnormals; those two and the plain tensor-core path match the
    reference on the same weights."""
    import cupy

    from kernels.shapes import get_shape

    run_shape = get_shape(model).with_(experts=16)
    host = _subnormal_weights(_fp8_problem(make_problem(run_shape, tokens, seed=tokens + 7, routing=routing)), 7)
    problem = _copied_to_device(cupy, host)
    faithful, oracle = _references(host)
    outs = {}
    for case in ("mma", "pairs", "grouped"):
        path, knobs, _ = PATHS[case]
        outs[case] = _run_poisoned(cupy, problem, path, **knobs)
        _assert_matches(outs[case], faithful, oracle, f"fp8 {case} subnormal quarter {model} T={tokens}",
                        own_order=True)
    assert np.array_equal(outs["pairs"].view(np.uint16), outs["grouped"].view(np.uint16))


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
    two = _run_poisoned(cupy, problem, "mma", **{**_grouped(), "DB_ROW_TILES": 2, "DB_UNROLL": 1})
    faithful, oracle = _references(host)
    _assert_matches(two, faithful, oracle, f"fp8 row tiles {model} T={tokens} {routing}", own_order=True)
    one = _run_poisoned(cupy, problem, "mma", **{**_grouped(), "DB_ROW_TILES": 1, "DB_UNROLL": 1})
    assert np.array_equal(two.view(np.uint16), one.view(np.uint16))
    bf16 = _bf16_on_device(cupy, make_problem(run_shape, tokens, seed=tokens + 4, routing=routing))
    runs = [_run_poisoned(cupy, bf16, "mma", **{**_grouped(), "DB_ROW_TILES": r}) for r in (2, 1)]  # FP8's ranges
    assert not np.isnan(runs[0].astype(np.float32)).any()
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
