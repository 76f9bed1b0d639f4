"""The expert-centric baseline (kernels.expert_centric_path): CPU checks of its logic, GPU checks of its results.

Tolerance vs reference.moe_decode(mode="classical", quant=q): both compute the same chain of bf16 buffers
(gate/up, activation, per-expert down output) and the same fp32 combine (slots in order, separate multiply
and add); the only difference is the fp32 summation order inside the GEMMs (tensor-core MMA + split-K vs
BLAS; for fp8 also scale-per-32-chunk vs (q*s)*w). That moves a GEMM output by ~1e-7 relative, which now
and then flips its bf16 rounding by one ulp; a flipped down output reaches ``out`` scaled by its routing
weight (<= 1) and the output's own rounding may flip. So each element may differ by at most
2 bf16 ulps of its token's largest |out| (a flip of an intermediate element is ~100x smaller than that),
most elements must be bitwise equal, and the relative L2 error must stay at rounding level.
"""

from __future__ import annotations

import gc
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kernels.compile import SOURCES, KernelResources, offline_report
from kernels.contract import BF16, Dims
from kernels.expert_centric_cuda import DEFAULTS, EXPERT_CENTRIC_SOURCE, KERNELS, VARIANTS, W8A8_KERNELS
from kernels.expert_centric_path import (
    DYNAMIC_SMEM_LIMIT,
    FAMILY,
    GRID,
    GRID_FP8,
    align_metadata_numpy,
    auto_params,
    check_params,
    expert_centric,
    max_tiles,
    quantize_rows_numpy,
    ring_bytes,
    round_e4m3_numpy,
)
from kernels.family import Launch
from kernels.numerics import bf16_to_f32, bf16_ulp, quantize, rel_l2
from kernels.problem import make_problem
from kernels.reference import expert_groups, moe_decode
from kernels.routing import make_routing
from kernels.shapes import PRESETS, MoEShape
from kernels.variants import REGISTRY, load_builtin

QUANTS = (None, "fp8", "mxfp8")


# =============================================================================================== CPU
def test_registered_variants() -> None:
    load_builtin()
    base = REGISTRY["cupy:expert-centric"]
    assert base.baseline and base.reference_mode == "classical" and base.quant is None and base.grid
    for name, quant in (("cupy:expert-centric-fp8", "fp8"), ("cupy:expert-centric-mxfp8", "mxfp8")):
        assert REGISTRY[name].quant == quant and not REGISTRY[name].baseline
        assert REGISTRY[name].reference_mode == "classical"
    for name in ("cupy:expert-centric", "cupy:expert-centric-fp8", "cupy:expert-centric-mxfp8"):
        variant = REGISTRY[name]
        assert variant.kernel_family is FAMILY and variant.family == "expert-centric" and variant.backend == "cupy"
        assert variant.source is EXPERT_CENTRIC_SOURCE and SOURCES["expert_centric"] is EXPERT_CENTRIC_SOURCE
        # the tile knobs left to the dims (0 = auto), the scatter fused; what make(dims) runs is what resolve says
        assert variant.params == {**DEFAULTS, "BLOCK_N": 0, "WARPS": 0, "STAGES": 0, "fuse_scatter": True}
        for tokens in (1, 8, 9, 64):
            dims = Dims(tokens, 2048, 768, 128, 8)
            assert variant.resolve(dims) == check_params(dims), (name, tokens)
        assert variant.resolve(Dims(1, 2048, 768, 128, 8), BLOCK_N=128, fuse_scatter=False) == check_params(
            Dims(1, 2048, 768, 128, 8), BLOCK_N=128, fuse_scatter=False)


_REPORTS: dict[str, dict[str, KernelResources]] = {}  # rendered text -> kernel -> resources, for this module


def _reports(param_sets: list[dict[str, int]]) -> list[dict[str, KernelResources]]:
    """Each knob set's offline report (sm_90) by kernel. A text is compiled once per test run however many
    tests ask for it (the fp8 sweep grid is a subset of the bf16 one), two compiles at a time (NVRTC runs
    outside the GIL)."""
    texts = [EXPERT_CENTRIC_SOURCE.render(**params) for params in param_sets]
    missing = {text: params for text, params in zip(texts, param_sets, strict=True) if text not in _REPORTS}

    def compile_one(params: dict[str, int]) -> dict[str, KernelResources]:
        return {r.kernel: r for r in offline_report(EXPERT_CENTRIC_SOURCE, **params)}

    with ThreadPoolExecutor(2) as pool:
        _REPORTS.update(zip(missing, pool.map(compile_one, missing.values()), strict=True))
    return [_REPORTS[text] for text in texts]


@pytest.mark.parametrize("which", ["defaults", pytest.param("variants", marks=pytest.mark.slow)])
def test_offline_compile_zero_spills(which: str) -> None:
    """Every kernel compiles for sm_90 without spills, at the defaults and every listed variant."""
    param_sets = [{}] if which == "defaults" else list(VARIANTS)
    for params, reports in zip(param_sets, _reports(param_sets), strict=True):
        assert set(reports) == set(W8A8_KERNELS if params.get("W8A8") else KERNELS), params
        for report in reports.values():
            assert report.spills == 0 and report.stack_bytes == 0, (params, report)
            assert report.registers <= 255


def _pairwise(grid: dict[str, list[int]], keys: list[str]) -> list[tuple[int, ...]]:
    """Combinations of ``grid`` in which every pair of two knobs' values appears at least once (greedy, in the
    grid's order: deterministic), with the all-smallest and all-largest combinations first."""
    every = list(itertools.product(*(grid[k] for k in keys)))
    chosen = [every[0], every[-1]]
    pairs = {(a, va, b, vb) for a, b in itertools.combinations(range(len(keys)), 2)
             for va in grid[keys[a]] for vb in grid[keys[b]]}

    def covered(combo: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
        return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(range(len(keys)), 2)}

    for combo in chosen:
        pairs -= covered(combo)
    while pairs:
        best = max(every, key=lambda combo: len(covered(combo) & pairs))
        chosen.append(best)
        pairs -= covered(best)
    return chosen


@pytest.mark.slow
def test_sweep_grid_zero_spills() -> None:
    """The GEMM compiles without spills across the variants' sweep grids: bf16's, then FP8's (a subset of bf16's
    texts, so in one test: run beside it, it would wait for the same compiles). Every pair of knob values and the
    all-smallest and all-largest tiles (the register-hungriest corner), not all 72 combinations: the suite's time;
    the sweep's own compile report covers each point it runs."""
    keys = [k for k in ("BLOCK_N", "WARPS", "M_TILES", "UNROLL", "STAGES", "PREFETCH")]
    for grid, kernel in ((GRID, "gemm_bf16"), (GRID_FP8, "gemm_fp8_scaled")):
        valid = []
        for values in _pairwise(grid, keys):
            params = dict(zip(keys, values, strict=True))
            try:
                check_params(**params)
            except ValueError:
                # the reasons allowed: a ring too large, or a prefetch distance on the ring
                assert ring_bytes({**DEFAULTS, **params}) > DYNAMIC_SMEM_LIMIT or (
                    params["STAGES"] >= 2 and params["PREFETCH"])
                continue
            valid.append(params)
        assert valid, kernel
        for params, reports in zip(valid, _reports(valid), strict=True):
            assert reports[kernel].spills == 0, (kernel, params, reports[kernel])


def test_input_errors() -> None:
    p = make_problem("tiny", 3, seed=1)
    with pytest.raises(ValueError, match="quant"):
        expert_centric(*p.arrays, quant="int4")
    with pytest.raises(ValueError, match="BLOCK_N"):
        expert_centric(*p.arrays, BLOCK_N=12)
    with pytest.raises(ValueError, match="unknown"):
        expert_centric(*p.arrays, BLOCK_K=32)
    with pytest.raises(ValueError, match="shared memory"):
        check_params(BLOCK_N=256, M_TILES=4)
    with pytest.raises(ValueError, match="STAGES"):
        check_params(STAGES=9)
    with pytest.raises(ValueError, match="STAGES"):
        check_params(STAGES=-1)
    with pytest.raises(ValueError, match="WARPS"):
        check_params(WARPS=33)
    with pytest.raises(TypeError, match="BLOCK_N must be an int"):
        check_params(BLOCK_N=32.0)
    with pytest.raises(ValueError, match="PREFETCH"):
        check_params(STAGES=2, PREFETCH=1)
    with pytest.raises(ValueError, match="PREFETCH"):
        check_params(PREFETCH=-1)
    with pytest.raises(ValueError, match="cp.async ring"):
        check_params(BLOCK_N=128, WARPS=8, UNROLL=2, STAGES=4)
    with pytest.raises(TypeError, match="x must have dtype"):
        expert_centric(p.x.astype(np.float32), *p.arrays[1:])
    with pytest.raises(ValueError, match="topk_ids must lie"):
        bad = p.topk_ids.copy()
        bad[0, 0] = p.shape.experts
        expert_centric(p.x, p.w13, p.w2, bad, p.topk_weights)
    with pytest.raises(TypeError, match="cupy"):
        expert_centric(*p.arrays)  # NumPy inputs: this path runs on the GPU only


def test_auto_params() -> None:
    """Tiles follow the dims (decided at build time, never from the routing): small batches small tiles."""
    small = check_params(Dims(1, 2048, 768, 128, 8))
    large = check_params(Dims(64, 2048, 768, 128, 8))
    assert (small["BLOCK_N"], small["WARPS"], small["STAGES"]) == (32, 8, 1)  # register loads
    assert (large["BLOCK_N"], large["WARPS"], large["STAGES"]) == (64, 4, 2)  # the H200 sweep's T=64 winner
    assert small["fuse_scatter"] and large["fuse_scatter"]
    assert check_params(Dims(1, 2048, 768, 128, 8), BLOCK_N=64)["BLOCK_N"] == 64  # explicit knobs win
    assert check_params(Dims(64, 2048, 768, 128, 8), STAGES=1)["STAGES"] == 1  # register loads at any T
    assert auto_params(None) == {**DEFAULTS, "fuse_scatter": True}
    for dims in (Dims(1, 2048, 768, 128, 8), Dims(64, 2048, 768, 128, 8), None):  # 0 = auto, as not given
        assert check_params(dims, BLOCK_N=0, WARPS=0, STAGES=0) == check_params(dims)
    # resolved knobs resolve to themselves (a build re-resolves what check_params returned)
    for dims in (Dims(1, 2048, 768, 128, 8), Dims(64, 2048, 768, 128, 8)):
        full = check_params(dims)
        assert check_params(dims, **full) == full


def _ring_schedule(chunks: int, warps: int, unroll: int, stages: int) -> list[tuple[int, int, int]]:
    """Replays one warp's cp.async ring loop of grouped_gemm (STAGES >= 2) on the host: returns, per warp,
    the (step, chunk, stage) it multiplies, asserting at each multiply that the step's copy group has
    completed under wait_group(STAGES-1) and that its slot was not refilled by a later step meanwhile."""
    used = []
    nsteps = -(-chunks // (warps * unroll))
    for warp in range(warps):
        committed: list[int | None] = []  # step of each commit group (None: empty group)
        slot_owner: dict[int, int] = {}  # ring slot -> the step whose copies were issued into it last
        for s in range(stages - 1):
            if s < nsteps:
                slot_owner[s % stages] = s
            committed.append(s if s < nsteps else None)
        for s in range(nsteps):
            if s + stages - 1 < nsteps:
                slot_owner[(s + stages - 1) % stages] = s + stages - 1
                committed.append(s + stages - 1)
            else:
                committed.append(None)
            done = committed[: len(committed) - (stages - 1)]  # wait_group(STAGES-1)
            assert s in done, (warp, s)
            assert slot_owner[s % stages] == s, (warp, s)  # not overwritten before its MMAs
            c0 = (s * warps + warp) * unroll
            if c0 >= chunks:
                continue
            used += [(s, c0 + u, s % stages) for u in range(unroll)]
    return used


@pytest.mark.parametrize("chunks", [1, 5, 24, 64, 90])
@pytest.mark.parametrize("warps, unroll, stages", [(4, 1, 4), (4, 2, 2), (8, 1, 4), (4, 1, 3), (1, 1, 2), (8, 2, 8)])
def test_cp_async_ring_schedule(chunks: int, warps: int, unroll: int, stages: int) -> None:
    """The ring visits every K chunk exactly once, the same chunks as the register path's loop, and never
    reads a step whose copies may be pending or whose slot was refilled."""
    ring = sorted(c for _, c, _ in _ring_schedule(chunks, warps, unroll, stages))
    register_path = sorted(c0 + u for w in range(warps) for c0 in range(w * unroll, chunks, warps * unroll)
                           for u in range(unroll))
    assert ring == register_path
    assert [c for c in ring if c < chunks] == list(range(chunks))


def test_max_tiles_bound_is_tight() -> None:
    """max_tiles covers every routing and is reached: each pair on its own expert (E >= T*K)."""
    rng = np.random.default_rng(0)
    for tokens, experts, top_k, bm in [(1, 128, 8, 16), (64, 128, 8, 16), (5, 3, 2, 16), (7, 512, 10, 32)]:
        dims = Dims(tokens, 8, 8, experts, top_k)
        bound = max_tiles(dims, bm)
        for _ in range(20):
            ids = rng.integers(0, experts, (tokens, top_k))
            assert align_metadata_numpy(ids, experts, bm)["num_tiles"] <= bound
        spread = np.arange(tokens * top_k).reshape(tokens, top_k) % experts
        worst = align_metadata_numpy(spread, experts, bm)["num_tiles"]
        assert worst <= bound and (experts < tokens * top_k or worst == bound)


@pytest.mark.parametrize("routing", ["uniform", "zipf", "same", "fixed"])
def test_align_model_format(routing: str) -> None:
    """The NumPy model of moe_align: expert-major, pair order inside an expert, sentinel padding, tile table."""
    tokens, experts, top_k, bm = 9, 6, 3, 4
    fixed = np.array([[2, 2, 5]] * tokens)
    ids, _ = make_routing(tokens, experts, top_k, fixed if routing == "fixed" else routing, seed=3)
    meta = align_metadata_numpy(ids, experts, bm)
    sorted_ids, tile_expert, pairs = meta["sorted_ids"], meta["tile_expert"], tokens * top_k
    assert sorted_ids.size == meta["num_tiles"] * bm
    expected = []
    for expert, members in expert_groups(ids):  # the reference's grouping, in expert order
        expected.append(members)
        rows = np.flatnonzero(np.isin(sorted_ids, members))
        assert np.all(tile_expert[rows // bm] == expert)
        np.testing.assert_array_equal(sorted_ids[rows], members)
        np.testing.assert_array_equal(meta["row_of_pair"][members], rows)
    real = sorted_ids[sorted_ids < pairs]
    np.testing.assert_array_equal(real, np.concatenate(expected))
    assert np.all(np.diff(tile_expert) >= 0)
    for tile in range(meta["num_tiles"]):  # padding only at the end of an expert's last tile
        block = sorted_ids[tile * bm : (tile + 1) * bm]
        pad = block == pairs
        assert not np.any(pad[:-1] & ~pad[1:])
    bad = ids.copy()
    bad[1, 0] = -1
    bad[2, 2] = experts
    meta_bad = align_metadata_numpy(bad, experts, bm)
    assert meta_bad["row_of_pair"][1 * top_k] == -1 and meta_bad["row_of_pair"][2 * top_k + 2] == -1


def _align_kernel_replay(ids: np.ndarray, experts: int, bm: int, tiles: int) -> dict[str, np.ndarray]:
    """moe_align's algorithm step by step on the host (warp 0's match_any walk, the scan, the placement)."""
    flat = np.asarray(ids).ravel().astype(np.int64)
    pairs = flat.size
    counts = np.zeros(experts, np.int64)
    row_of_pair = np.empty(pairs, np.int64)
    for i0 in range(0, pairs, 32):
        lanes = [flat[i] if i < pairs else -1 for i in range(i0, i0 + 32)]
        before = [counts[e] if 0 <= e < experts else 0 for e in lanes]  # every lane reads, then leaders write
        for lane, e in enumerate(lanes):
            group = [other for other in range(32) if lanes[other] == e]  # __match_any_sync
            lower = sum(1 for other in group if other < lane)
            valid = 0 <= e < experts
            if valid and lower == 0:
                counts[e] = before[lane] + len(group)
            if i0 + lane < pairs:
                row_of_pair[i0 + lane] = before[lane] + lower if valid else -1
    per_expert_tiles = -(-counts // bm)
    tile_off = np.concatenate([[0], np.cumsum(per_expert_tiles)[:-1]])
    total = int(per_expert_tiles.sum())
    sorted_ids = np.full(tiles * bm, -99, np.int64)  # -99: never written
    tile_expert = np.full(tiles, -99, np.int64)
    for e in range(experts):
        tile_expert[tile_off[e] : tile_off[e] + per_expert_tiles[e]] = e
    tile_expert[total:] = -1
    for i in range(pairs):
        if row_of_pair[i] >= 0:
            r = tile_off[flat[i]] * bm + row_of_pair[i]
            sorted_ids[r] = i
            row_of_pair[i] = r
    for e in range(experts):
        base = tile_off[e] * bm
        sorted_ids[base + counts[e] : base + per_expert_tiles[e] * bm] = pairs
    return {"sorted_ids": sorted_ids, "tile_expert": tile_expert, "num_tiles": total, "row_of_pair": row_of_pair}


@pytest.mark.parametrize("tokens, experts, top_k, bm", [(1, 128, 8, 16), (64, 128, 8, 16), (5, 3, 2, 16),
                                                        (33, 40, 8, 16), (8, 512, 10, 16), (7, 6, 3, 32)])
def test_align_kernel_replay_matches_model(tokens: int, experts: int, top_k: int, bm: int) -> None:
    """The kernel's rank-by-match_any algorithm (replayed on the host) writes exactly the NumPy model's
    metadata, including out-of-range ids (-1 rows, not counted) and skewed routings."""
    rng = np.random.default_rng(tokens * 1000 + experts)
    dims = Dims(tokens, 8, 8, experts, top_k)
    tiles = max_tiles(dims, bm)
    for trial in range(4):
        if trial == 0:
            ids = rng.integers(0, experts, (tokens, top_k))
        elif trial == 1:
            ids = np.minimum(rng.zipf(1.5, (tokens, top_k)) - 1, experts - 1)
        elif trial == 2:
            ids = np.zeros((tokens, top_k), np.int64) + experts // 2
        else:
            ids = rng.integers(0, experts, (tokens, top_k))
            ids.flat[rng.integers(0, ids.size, 3)] = [-1, experts, 1 << 30][: min(3, ids.size)]
        model = align_metadata_numpy(ids, experts, bm)
        got = _align_kernel_replay(ids, experts, bm, tiles)
        n = model["num_tiles"]
        assert got["num_tiles"] == n
        np.testing.assert_array_equal(got["sorted_ids"][: n * bm], model["sorted_ids"])
        np.testing.assert_array_equal(got["tile_expert"][:n], model["tile_expert"])
        assert np.all(got["tile_expert"][n:] == -1)
        np.testing.assert_array_equal(got["row_of_pair"], model["row_of_pair"])


def test_e4m3_rounding_twin_matches_ml_dtypes() -> None:
    """The kernels' bit-level e4m3 RNE equals ml_dtypes on every bf16 value, random floats and all ties."""
    bf16_all = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    rng = np.random.default_rng(0)
    randoms = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * s for s in (1e-3, 0.1, 1, 30)])
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.sort(grid[np.isfinite(grid)])
    ties = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact midpoints
    for values in (bf16_all, randoms, ties, grid):
        values = np.clip(values[~np.isnan(values)], -448, 448).astype(np.float32)
        mine = round_e4m3_numpy(values)
        theirs = values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(mine.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("quant", ["fp8", "mxfp8"])
@pytest.mark.parametrize("width", [136, 256, 48, 2880])
def test_quantize_twin_matches_numerics(quant: str, width: int, rng: np.random.Generator) -> None:
    """What the kernels store (fp8: e4m3 + fp32 group scale; mxfp8: q * 2^e as bf16) dequantizes to exactly
    numerics.quantize of the same bf16 rows, including rows with huge / tiny / zero groups."""
    rows = rng.standard_normal((6, width)).astype(np.float32) * np.float32(3.0)
    rows[1] *= np.float32(1e4)
    rows[2] *= np.float32(1e-5)
    rows[3, :40] = 0.0
    rows[4] = 0.0
    rows = bf16_to_f32(rows.astype(BF16))
    values, scales = quantize_rows_numpy(rows, quant)
    if quant == "fp8":
        assert np.array_equal(values, bf16_to_f32(values.astype(BF16)))  # e4m3 values are exact in bf16
        deq = values * np.repeat(scales, 128, axis=1)[:, :width]
    else:
        assert np.array_equal(values, bf16_to_f32(values.astype(BF16)))  # q * 2^e is exact in bf16
        deq = values
    np.testing.assert_array_equal(deq.view(np.uint32), quantize(rows, quant).view(np.uint32))


# =============================================================================================== GPU
def _poisoned_out(cp, tokens: int, hidden: int, dtype=BF16):
    out = cp.empty((tokens, hidden), dtype)
    out.view(cp.uint16 if dtype == BF16 else cp.uint32).fill(0x7FC0 if dtype == BF16 else 0x7FC00000)
    return out


def _run(p, quant=None, out=None, **params) -> np.ndarray:
    import cupy as cp

    out = _poisoned_out(cp, p.tokens, p.shape.hidden) if out is None else out
    expert_centric(*p.arrays, quant=quant, out=out, **params)
    cp.cuda.runtime.deviceSynchronize()
    return out.get()


def _f32(arr: np.ndarray) -> np.ndarray:
    return bf16_to_f32(arr) if arr.dtype == BF16 else arr.astype(np.float32)


def _check_close(result: np.ndarray, ref: np.ndarray, min_equal: float = 0.8) -> None:
    result, ref = _f32(result), _f32(ref)
    assert np.isfinite(result).all(), "output not fully written (NaN poison left) or non-finite"
    token_max = np.abs(ref).max(axis=1, keepdims=True)
    err = np.abs(result - ref)
    tol = 2 * bf16_ulp(token_max)
    worst = float((err / tol).max())
    assert worst <= 1.0, f"max error {worst:.2f} x tolerance (2 bf16 ulps of the token's max |out|)"
    equal = float(np.mean(result == ref))
    assert equal >= min_equal, f"only {equal:.1%} of elements bitwise equal to the classical reference"
    assert rel_l2(result, ref) < 4e-3


def _check_vs_reference(p, result: np.ndarray, quant=None, oracle: bool = False) -> None:
    host = p.compact()
    ref = moe_decode(*host.arrays, mode="classical", quant=quant)
    _check_close(result, ref)
    if oracle:
        exact = moe_decode(*host.arrays, mode="fp64")
        assert rel_l2(_f32(result), exact) < 1.5e-2


def _free() -> None:
    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_qwen3_preset(tokens: int) -> None:
    import cupy as cp

    p = make_problem("qwen3-30b-a3b", tokens, seed=10 + tokens, xp=cp)
    result = _run(p)
    _check_vs_reference(p, result, oracle=tokens <= 8)
    del p
    _free()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8", "mxfp8"])
def test_qwen3_quant_t64(quant: str) -> None:
    import cupy as cp

    p = make_problem("qwen3-30b-a3b", 64, seed=7, xp=cp)
    _check_vs_reference(p, _run(p, quant=quant), quant=quant)
    del p
    _free()


@pytest.mark.gpu
def test_qwen3_next_many_experts() -> None:
    import cupy as cp

    p = make_problem("qwen3-next-80b-a3b", 8, seed=3, xp=cp)  # E = 512, K = 10
    _check_vs_reference(p, _run(p))
    del p
    _free()


ODD_SHAPES = [
    MoEShape("h8", 8, 8, 4, 2),
    MoEShape("k1", 264, 40, 5, 1),
    MoEShape("e1", 136, 48, 1, 1),
    MoEShape("h2880", 2880, 360, 16, 4),  # H not a multiple of 256, I not a multiple of 128
    PRESETS["tiny"],
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("quant", QUANTS)
def test_odd_shapes(shape: MoEShape, quant) -> None:
    import cupy as cp

    p = make_problem(shape, 5, seed=2, xp=cp)
    _check_vs_reference(p, _run(p, quant=quant), quant=quant)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "zipf", "same", "fixed"])
@pytest.mark.parametrize("quant", QUANTS)
def test_routings(routing: str, quant) -> None:
    import cupy as cp

    shape = PRESETS["qwen3-30b-a3b"].with_(experts=32)
    fixed = np.array([[3, 3, 3, 7, 7, 0, 31, 3]] * 40)  # duplicates: contributions add
    p = make_problem(shape, 40, seed=5, routing=fixed if routing == "fixed" else routing, xp=cp)
    _check_vs_reference(p, _run(p, quant=quant), quant=quant)
    del p
    _free()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "params",
    [dict(fuse_scatter=False), dict(BLOCK_N=32, UNROLL=4), dict(BLOCK_N=128, WARPS=8, STAGES=1), dict(M_TILES=2),
     dict(WARPS=1, UNROLL=1), dict(STAGES=1), dict(STAGES=3, BLOCK_N=64), dict(STAGES=2, WARPS=1, UNROLL=1),
     dict(STAGES=8, BLOCK_N=32, UNROLL=1), dict(STAGES=4, M_TILES=2, BLOCK_N=64), dict(PREFETCH=1, STAGES=1),
     dict(PREFETCH=3, BLOCK_N=64, STAGES=1), *(v for v in VARIANTS if not v.get("W8A8"))],  # W8A8 sets: the w8a8 test
    ids=str,
)
def test_tile_params(params: dict) -> None:
    import cupy as cp

    p = make_problem(PRESETS["qwen3-30b-a3b"].with_(experts=24), 20, seed=4, routing="zipf", xp=cp)
    base = _run(p)
    other = _run(p, **params)
    for quant in ("fp8", "mxfp8") if params.get("STAGES", 0) >= 2 or params.get("PREFETCH") else ():  # ring / L2
        _check_vs_reference(p, _run(p, quant=quant, **params), quant=quant)
    _check_close(other, base, min_equal=0.95)  # same numerics; split-K order may differ with WARPS/UNROLL
    if params.get("WARPS", DEFAULTS["WARPS"]) == DEFAULTS["WARPS"] and params.get("UNROLL", 2) == 2:
        np.testing.assert_array_equal(other.view(np.uint16), base.view(np.uint16))


@pytest.mark.gpu
def test_device_metadata_and_quant_match_numpy_models() -> None:
    """The align kernel's buffers equal the NumPy model exactly; quantize_rows equals its twin exactly."""
    import cupy as cp

    from kernels.variants import get_variant

    shape = PRESETS["qwen3-30b-a3b"].with_(experts=40)
    p = make_problem(shape, 33, seed=6, routing="zipf", xp=cp)
    dims = Dims(33, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    for quant_name, quant in (("cupy:expert-centric-fp8", "fp8"), ("cupy:expert-centric-mxfp8", "mxfp8")):
        launch = get_variant(quant_name).make(dims)
        out = _poisoned_out(cp, 33, shape.hidden)
        stages = dict(launch.stages(*p.arrays, out))
        stages["align"]()
        stages["quant_x"]()
        cp.cuda.runtime.deviceSynchronize()
        ws = launch.workspace
        model = align_metadata_numpy(p.topk_ids.get(), shape.experts, 16)
        tiles = int(ws.meta[0].get())
        assert tiles == model["num_tiles"]
        np.testing.assert_array_equal(ws.sorted_ids[: tiles * 16].get(), model["sorted_ids"])
        np.testing.assert_array_equal(ws.tile_expert[:tiles].get(), model["tile_expert"])
        assert np.all(ws.tile_expert[tiles:].get() == -1)
        np.testing.assert_array_equal(ws.row_of_pair.get(), model["row_of_pair"])
        values, scales = quantize_rows_numpy(bf16_to_f32(p.x.get()), quant)
        np.testing.assert_array_equal(bf16_to_f32(ws.x_q.get()), values)
        if quant == "fp8":
            np.testing.assert_array_equal(ws.x_scale.get(), scales)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_stages_equal_launch_and_determinism(quant) -> None:
    import cupy as cp

    from kernels.variants import get_variant

    name = {None: "cupy:expert-centric", "fp8": "cupy:expert-centric-fp8", "mxfp8": "cupy:expert-centric-mxfp8"}[quant]
    p = make_problem(PRESETS["qwen3-30b-a3b"].with_(experts=32), 16, seed=8, xp=cp)
    dims = Dims(16, p.shape.hidden, p.shape.intermediate, 32, p.shape.top_k)
    launch = get_variant(name).make(dims)
    assert isinstance(launch, Launch) and launch.params == get_variant(name).resolve(dims)
    assert launch.workspace.quant == quant and launch.reference_mode is None and not launch.facts
    runs = []
    for _ in range(3):
        out = _poisoned_out(cp, 16, p.shape.hidden)
        launch(*p.arrays, out)
        cp.cuda.runtime.deviceSynchronize()
        runs.append(out.get())
    for r in runs[1:]:
        np.testing.assert_array_equal(r.view(np.uint16), runs[0].view(np.uint16))
    out = _poisoned_out(cp, 16, p.shape.hidden)
    names = []
    for stage, run in launch.stages(*p.arrays, out):
        names.append(stage)
        run()
    cp.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(out.get().view(np.uint16), runs[0].view(np.uint16))
    assert names[0] == "align" and names[-1] == "scatter+combine" and len(names) == (7 if quant else 6)
    _check_vs_reference(p, runs[0], quant=quant)


@pytest.mark.gpu
def test_float32_out() -> None:
    import cupy as cp

    p = make_problem("tiny", 7, seed=9, xp=cp)
    out = _poisoned_out(cp, 7, p.shape.hidden, np.float32)
    result = _run(p, out=out)
    host = p.compact()
    ref = moe_decode(*host.arrays, mode="classical", out_dtype=np.float32)
    assert np.isfinite(result).all()
    np.testing.assert_allclose(result, ref, rtol=0, atol=float(2 * bf16_ulp(np.abs(ref).max())))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_graph_capture_replay(quant) -> None:
    import cupy as cp

    from kernels.expert_centric_path import make_workspace

    p = make_problem(PRESETS["qwen3-30b-a3b"].with_(experts=20), 12, seed=11, routing="zipf", xp=cp)
    dims = Dims(12, p.shape.hidden, p.shape.intermediate, 20, p.shape.top_k)
    ws = make_workspace(dims, quant)
    eager = _run(p, quant=quant, workspace=ws)
    out = _poisoned_out(cp, 12, p.shape.hidden)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        expert_centric(*p.arrays, quant=quant, out=out, workspace=ws)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(out.get().view(np.uint16), eager.view(np.uint16))
    # new routing, same graph: the metadata is recomputed on the device
    ids, weights = make_routing(12, 20, p.shape.top_k, "uniform", seed=12)
    with stream:  # on the replay's stream: a non-blocking stream does not wait for the legacy default stream
        p.topk_ids[...] = cp.asarray(ids)
        p.topk_weights[...] = cp.asarray(weights)
        out.view(cp.uint16).fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    _check_vs_reference(p, out.get(), quant=quant)
    np.testing.assert_array_equal(out.get().view(np.uint16), _run(p, quant=quant, workspace=ws).view(np.uint16))


@pytest.mark.gpu
def test_bad_expert_ids_give_nan_rows() -> None:
    """Out-of-range ids (not checkable during capture) poison only their token; no illegal access."""
    import cupy as cp

    from kernels.variants import get_variant

    p = make_problem(PRESETS["qwen3-30b-a3b"].with_(experts=16), 6, seed=13, xp=cp)
    dims = Dims(6, p.shape.hidden, p.shape.intermediate, 16, p.shape.top_k)
    for fuse in (False, True):
        launch = get_variant("cupy:expert-centric").make(dims, fuse_scatter=fuse)
        good = _poisoned_out(cp, 6, p.shape.hidden)
        launch(*p.arrays, good)
        bad_ids = p.topk_ids.copy()
        bad_ids[1, 3] = 16
        bad_ids[4, 0] = -7
        bad_ids[5, 7] = 1 << 30
        out = _poisoned_out(cp, 6, p.shape.hidden)
        launch(p.x, p.w13, p.w2, bad_ids, p.topk_weights, out)
        cp.cuda.runtime.deviceSynchronize()
        result, expected = _f32(out.get()), _f32(good.get())
        assert np.isnan(result[[1, 4, 5]]).all()
        np.testing.assert_array_equal(result[[0, 2, 3]], expected[[0, 2, 3]])


@pytest.mark.gpu
def test_workspace_mismatch_and_gpu_input_errors() -> None:
    import cupy as cp

    from kernels.expert_centric_path import make_workspace

    p = make_problem("tiny", 4, seed=14, xp=cp)
    ws = make_workspace(Dims(5, 136, 48, 6, 2), None)
    with pytest.raises(ValueError, match="workspace"):
        expert_centric(*p.arrays, out=cp.empty((4, 136), BF16), workspace=ws)
    with pytest.raises(ValueError, match="out must be"):
        expert_centric(*p.arrays, out=cp.empty((3, 136), BF16))
    with pytest.raises(TypeError, match="cupy"):
        expert_centric(p.x.get(), *p.arrays[1:])


# -- W8A8 on fp8-block128 weights ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "tokens", "routing"), [
    ("qwen3-30b-a3b", 1, "uniform"), ("qwen3-30b-a3b", 64, "zipf"), ("qwen3-235b-a22b", 8, "correlated"),
    (MoEShape("h2880", 2880, 360, 16, 4), 5, "same"),  # partial scale blocks along H and I
    ("tiny", 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]])])  # duplicate ids in a token
def test_w8a8_on_fp8_weights(shape: Any, tokens: int, routing: Any) -> None:
    """cupy:expert-centric-w8a8 against ``reference.moe_decode(mode="classical", quant="fp8", weight_format=
    "fp8-block128")`` on the same (device-quantized, bitwise the host's) weights: NaN-poisoned out fully written,
    within 2 bf16 ulps of each token's largest output; bitwise over a repeat."""
    import cupy as cp

    from kernels.formats import quantize_weights

    base = PRESETS[shape] if isinstance(shape, str) else shape
    run_shape = base.with_(experts=min(base.experts, 16))  # the host quantizes every expert for the reference
    p = make_problem(run_shape, tokens, seed=tokens + 3, routing=routing)
    q13, q2 = quantize_weights(*(cp.asarray(w) for w in (p.w13, p.w2)), "fp8-block128")
    x, ids, wts = (cp.asarray(a) for a in (p.x, p.topk_ids, p.topk_weights))

    def run() -> np.ndarray:
        out = cp.full((tokens, run_shape.hidden), np.nan, BF16)
        expert_centric(x, q13, q2, ids, wts, quant="fp8", out=out, W8A8=1)
        cp.cuda.runtime.deviceSynchronize()
        return out.get()

    got = run()
    host13, host2 = quantize_weights(p.w13, p.w2, "fp8-block128")
    ref = moe_decode(p.x, host13, host2, p.topk_ids, p.topk_weights, mode="classical", quant="fp8",
                     weight_format="fp8-block128")
    _check_close(got, ref, min_equal=0.5)
    assert np.array_equal(run().view(np.uint16), got.view(np.uint16))
    with pytest.raises(ValueError, match="quant must be 'fp8'"):
        expert_centric(x, q13, q2, ids, wts)
    _free()


def test_w8a8_knob_rules() -> None:
    """W8A8 runs the register-load GEMMs: auto STAGES becomes 1, an explicit ring or prefetch is refused."""
    from kernels.expert_centric_path import check_params

    dims = Dims(64, 2048, 768, 128, 8)
    assert check_params(dims)["STAGES"] == 2 and check_params(dims, W8A8=1)["STAGES"] == 1
    with pytest.raises(ValueError, match="W8A8 .* STAGES must be 1"):
        check_params(dims, W8A8=1, STAGES=2)
    with pytest.raises(ValueError, match="PREFETCH 0"):
        check_params(dims, W8A8=1, PREFETCH=2)
    assert REGISTRY["cupy:expert-centric-w8a8"].weight_format == "fp8-block128"
