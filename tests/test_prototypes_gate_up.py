"""The gate_up lab prototypes (prototypes/_gate_up_lab.py and the gate_up_* experiments that sweep it).

CPU tests: every grid point of every lab variant compiles for sm_90 (NVRTC, offline) with zero spill bytes;
the interleaved prepack against a NumPy re-derivation and its inverse; knob validation; the registry and the
source registration; the launch's layout check. The lab's CUDA C also runs on the CPU (g++, one lane
per CUDA thread of a block, shuffles and __syncthreads through barriers) against a NumPy intermediate:
index math of every layout / width / split, partial last chunks, bad expert ids.

GPU tests (``-m gpu``): every grid point of every variant on small and odd shapes (H not a multiple of 256,
K = 1, E = 1) against ``reference.moe_decode(mode="warp_decode")`` with the rule of tests/warp_checks.py,
NaN-poisoned outputs and workspace, 3 runs bitwise equal, bad ids -> NaN rows, stages and a graph replay,
and the bitwise identities the experiments rely on (interleaved == stacked, SINK 0 == SINK 1, lab at the
strict shape == the strict gate_up).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kernels import warp_decode_cupy as wdc
from kernels.contract import BF16, Dims
from kernels.numerics import bf16_to_f32, silu
from kernels.problem import Problem, make_problem
from kernels.shapes import PRESETS, MoEShape
from prototypes import _gate_up_lab as lab
from tests.warp_checks import (
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    ODD_SHAPES,
    FakeCupyArray,
    _assert_matches,
    _poisoned_out,
    _references,
    _seed,
    build_emulator,
    run_emulator,
    slow_except,
)

VARIANTS = (
    "proto:gate-up-load-width",
    "proto:gate-up-sink",
    "proto:gate-up-split-k",
    "proto:gate-up-interleaved",
    "proto:gate-up-stacked",
)


EXPERIMENTS = ("gate_up_load_width", "gate_up_sink", "gate_up_split_k", "gate_up_interleaved")


def _registry() -> dict[str, Any]:
    """The registry with these experiments imported (only them: another prototype's breakage is not ours)."""
    import importlib

    from kernels.variants import REGISTRY

    for module in EXPERIMENTS:
        importlib.import_module(f"prototypes.{module}")
    return REGISTRY


def _grid_points(variant: Any) -> list[dict[str, int]]:
    keys = list(variant.grid)
    combos = itertools.product(*(variant.grid[k] for k in keys))
    return [{**variant.params, **dict(zip(keys, combo, strict=True))} for combo in combos]


def _all_points() -> list[tuple[str, dict[str, int]]]:
    registry = _registry()
    return [(name, point) for name in VARIANTS for point in _grid_points(registry[name])]


def _dims(shape: MoEShape, tokens: int) -> Dims:
    return Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)


# ---------------------------------------------------------------------------------------------------
# CPU: registry, knobs, source
# ---------------------------------------------------------------------------------------------------
def test_registry_finds_the_variants() -> None:
    import prototypes
    from kernels.variants import REGISTRY

    assert set(EXPERIMENTS) <= set(prototypes.load())
    assert set(VARIANTS) <= set(REGISTRY)
    registry = _registry()
    for name in VARIANTS:
        variant = registry[name]
        assert variant.backend == "cupy" and variant.reference_mode == "warp_decode"
        assert variant.build is lab.build and set(variant.params) == set(lab.DEFAULTS)
        assert variant.kernel_family is lab.FAMILY and variant.family == "proto-gate-up-lab"
        assert variant.source is lab.SOURCE and variant.params["LAB_SINK"] == 1  # the lab's default, not the source's
        assert set(variant.grid) <= set(lab.DEFAULTS)
        for point in _grid_points(variant):
            assert lab.resolve_params(**point) == point
            assert variant.resolve(None, **point) == point  # what the compile report resolves
    assert registry["proto:gate-up-interleaved"].prepack is lab.prepack
    assert registry["proto:gate-up-interleaved"].params["LAB_INTERLEAVED"] == 1
    assert registry["proto:gate-up-stacked"].prepack is None
    assert registry["proto:gate-up-stacked"].params["LAB_INTERLEAVED"] == 0
    assert registry["proto:gate-up-interleaved"].grid == registry["proto:gate-up-stacked"].grid
    assert len(_grid_points(registry["proto:gate-up-load-width"])) >= 12


def test_source_is_registered_for_inspect() -> None:
    from kernels.compile import SOURCES
    from tools import compile_report as offline

    assert SOURCES["proto_gate_up_lab"] is lab.SOURCE
    assert lab.SOURCE.kernels == (lab.KERNEL,)
    assert offline.threads_per_block(lab.SOURCE, lab.KERNEL, {**lab.DEFAULTS, "LAB_WARPS": 8}) == 256
    assert _registry()["proto:gate-up-split-k"].source is lab.SOURCE
    for overrides in lab.SOURCE.variants:
        lab.resolve_params(**overrides)


def test_knob_validation_names_the_knob() -> None:
    assert lab.resolve_params() == lab.DEFAULTS
    cases = [
        ({"LAB_BYTES": 4}, ValueError, "LAB_BYTES"),
        ({"LAB_BYTES": 12}, ValueError, "LAB_BYTES"),
        ({"LAB_WARPS": 0}, ValueError, "LAB_WARPS"),
        ({"LAB_WARPS": 33}, ValueError, "LAB_WARPS"),
        ({"LAB_UNROLL": 0}, ValueError, "LAB_UNROLL"),
        ({"LAB_UNROLL": 17}, ValueError, "LAB_UNROLL"),
        ({"LAB_SINK": 2}, ValueError, "LAB_SINK"),
        ({"LAB_INTERLEAVED": -1}, ValueError, "LAB_INTERLEAVED"),
        ({"LAB_SPLIT": 0}, ValueError, "LAB_SPLIT"),
        ({"LAB_WARPS": 6, "LAB_SPLIT": 4}, ValueError, "LAB_SPLIT"),
        ({"LAB_UNROLL": True}, TypeError, "LAB_UNROLL"),
        ({"LAB_BYTES": 16.0}, TypeError, "LAB_BYTES"),
        ({"GU_WARPS": 4}, ValueError, "unknown"),
    ]
    for params, error, match in cases:
        with pytest.raises(error, match=match):
            lab.resolve_params(**params)


def test_kernel_source_guards_and_comments() -> None:
    code = lab.CODE
    assert "#include" not in code and "atomicAdd" not in code
    assert "(unsigned)id >= (unsigned)experts" in code  # bad ids: no weight address
    for phrase in ("FP32 accumulators", "Lane l", "owned by a GROUP", "fixed order"):
        assert phrase in code
    with pytest.raises(ValueError, match="unknown"):
        lab.SOURCE.render(WARPS=4)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_launch_checks_the_w13_layout(interleaved: int) -> None:
    """A w13 of the other layout is a ValueError before anything is launched (kernel=None is never reached)."""
    dims = Dims(2, 16, 8, 3, 2)
    params = lab.resolve_params(LAB_INTERLEAVED=interleaved)
    wrong = FakeCupyArray(lab.expected_w13_shape(dims, not interleaved), BF16)
    with pytest.raises(ValueError, match="w13 must be"):
        lab.launch_gate_up(None, params, dims, None, wrong, None, None)


def test_blocks_cover_every_output() -> None:
    dims = Dims(3, 136, 48, 6, 2)
    for warps, split in ((2, 1), (8, 4), (8, 8), (6, 3)):
        params = lab.resolve_params(LAB_WARPS=warps, LAB_SPLIT=split)
        groups = lab.blocks(dims, params) * (warps // split)
        assert 3 * 2 * 48 <= groups < 3 * 2 * 48 + warps // split


# ---------------------------------------------------------------------------------------------------
# CPU: the interleaved prepack
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("experts", "inter", "hidden"), [(1, 8, 8), (3, 5, 24), (2, 48, 136)])
def test_prepack_matches_a_numpy_rederivation(rng: np.random.Generator, experts: int, inter: int, hidden: int) -> None:
    w13 = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32).astype(BF16)
    w2 = rng.standard_normal((experts, hidden, inter), dtype=np.float32).astype(BF16)
    packed, w2_packed = lab.prepack(w13, w2)
    assert w2_packed is w2
    assert packed.dtype == BF16 and packed.shape == (experts, inter, 2 * hidden) and packed.flags.c_contiguous
    # element by element, from the layout's definition: hidden position p of neuron i sits at
    # 16 * (p // 8) + p % 8 (gate) and 8 more (up)
    p = np.arange(hidden)
    gate_at = 16 * (p // 8) + p % 8
    bits, packed_bits = w13.view(np.uint16), packed.view(np.uint16)
    assert np.array_equal(packed_bits[:, :, gate_at], bits[:, :inter, :])
    assert np.array_equal(packed_bits[:, :, gate_at + 8], bits[:, inter:, :])
    assert np.array_equal(lab.deinterleave(packed).view(np.uint16), bits)  # round trip, bit for bit


def test_prepack_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="w13"):
        lab.interleave(np.zeros((2, 6, 12), BF16))  # H not a multiple of 8
    with pytest.raises(ValueError, match="w13"):
        lab.interleave(np.zeros((2, 16), BF16))
    with pytest.raises(ValueError, match="packed w13"):
        lab.deinterleave(np.zeros((2, 3, 24), BF16))


# ---------------------------------------------------------------------------------------------------
# CPU: every grid point compiles for sm_90 without spills
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["defaults", pytest.param("grid", marks=pytest.mark.slow)])
def test_every_grid_point_compiles_without_spills(which: str) -> None:
    """The lab kernel at its defaults (quick) and at every grid point of every variant (slow): no spills, no stack."""
    from kernels.compile import offline_report

    points = [("defaults", dict(lab.DEFAULTS))] if which == "defaults" else _all_points()
    unique = {tuple(sorted(p.items())): p for _, p in points}

    def report(params: dict[str, int]) -> Any:
        return offline_report(lab.SOURCE, **params)

    with ThreadPoolExecutor(4) as pool:
        reports = dict(zip(unique, pool.map(report, unique.values()), strict=True))
    for name, point in points:
        (resources,) = reports[tuple(sorted(point.items()))]
        assert resources.kernel == lab.KERNEL
        assert resources.spills == 0, f"{name} {point}: {resources.spills} spill bytes"
        assert resources.stack_bytes == 0, f"{name} {point}: {resources.stack_bytes} bytes of stack"
        assert resources.registers <= 255
        expected_shared = 0 if point["LAB_SPLIT"] == 1 else 8 * point["LAB_WARPS"]
        assert resources.shared_bytes == expected_shared, (name, point)


def test_sweep_compile_columns_show_each_point() -> None:
    """tools.sweep compiles "0" knobs at the source default: LAB_SINK=0 must not be shown as SINK=1's kernel."""
    from kernels.compile import offline_report
    from tools import sweep

    variant = _registry()["proto:gate-up-sink"]
    for point in ({"LAB_SINK": 0, "LAB_UNROLL": 8, "LAB_BYTES": 8}, {"LAB_SINK": 1, "LAB_UNROLL": 8, "LAB_BYTES": 8}):
        columns = sweep.compile_columns(variant, {**variant.params, **point})
        (expected,) = offline_report(lab.SOURCE, **{**variant.params, **point})
        assert columns["registers"] == expected.registers and columns["spills"] == 0, point


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (g++; one lane per CUDA thread of a block)
# ---------------------------------------------------------------------------------------------------
EMULATION_HARNESS = EMULATION_PRELUDE + r"""
#define __shared__ static  // one block at a time: a function-static array is the block's shared memory
EmuBarrier* g_block = nullptr;
inline void __syncthreads() { g_block->arrive_and_wait(); }
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    long long blocks = atoll(argv[6]);
    std::string dir = argv[7];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    auto w13 = load<uint16_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);  // NaN poison
    std::vector<WarpCtx> warps(LAB_WARPS);
    EmuBarrier block(LAB_WARPS * 32);
    g_block = &block;
    run_lanes(LAB_WARPS * 32, [&](int tid) {
        g_warp = &warps[tid / 32];  // the lane's warp: shuffles exchange through it
        for (long long b = 0; b < blocks; ++b) {  // blocks in lockstep: a barrier after each
            threadIdx.x = tid;
            blockIdx.x = (unsigned)b;
            moe_gate_up_lab(x.data(), w13.data(), ids.data(), inter.data(), T, H, I, E, K);
            block.arrive_and_wait();
        }
    });
    FILE* f = fopen((dir + "/inter.bin").c_str(), "wb");
    fwrite(inter.data(), 2, inter.size(), f);
    fclose(f);
    return 0;
}
"""


def _emulate_gate_up(problem: Problem, ids: np.ndarray | None = None, **params: int) -> np.ndarray:
    """The lab kernel's CUDA C on the CPU (same launch geometry as the GPU); returns the [T, K, I] intermediate."""
    import tempfile

    shape = problem.shape
    dims = _dims(shape, problem.tokens)
    resolved = lab.resolve_params(**params)
    binary = build_emulator(lab.SOURCE.render(**resolved), EMULATION_HARNESS)
    w13 = lab.interleave(problem.w13) if resolved["LAB_INTERLEAVED"] else problem.w13
    with tempfile.TemporaryDirectory() as tmp:
        problem.x.tofile(f"{tmp}/x.bin")
        np.ascontiguousarray(w13).tofile(f"{tmp}/w13.bin")
        np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k,
                     lab.blocks(dims, resolved), tmp)
        raw = np.fromfile(f"{tmp}/inter.bin", np.uint16)
    return raw.view(BF16).reshape(dims.tokens, dims.top_k, dims.intermediate)


def _intermediate_references(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 of SiLU(g) * u with fp32 dot products, the same in fp64) for every (t, k, i)."""
    inter = problem.shape.intermediate
    x = bf16_to_f32(problem.x)
    w = bf16_to_f32(problem.w13)[problem.topk_ids]  # [T, K, 2I, H]
    gate_up32 = np.einsum("tkoh,th->tko", w, x, dtype=np.float32)
    gate_up64 = np.einsum("tkoh,th->tko", w.astype(np.float64), x.astype(np.float64))
    faithful = (silu(gate_up32[..., :inter]) * gate_up32[..., inter:]).astype(BF16)
    oracle = silu(gate_up64[..., :inter]) * gate_up64[..., inter:]
    return faithful, oracle


# H = 1000: 250 8-byte chunks, so LAB_SPLIT 4 gives four non-empty parts (64, 64, 64, 58 chunks) and 32-byte
# loads a half last chunk; small I and E keep the emulation fast
SPLIT_SHAPE = MoEShape("h1000-i24", 1000, 24, 3, 2)

EMULATED = [  # (shape, tokens, knobs): every layout / width / split, partial last chunks (H = 136, 264, 8)
    ("tiny", 2, {}),
    ("tiny", 2, {"LAB_SINK": 0, "LAB_UNROLL": 2}),
    ("tiny", 1, {"LAB_BYTES": 32, "LAB_UNROLL": 1}),
    ("tiny", 2, {"LAB_BYTES": 16, "LAB_UNROLL": 2, "LAB_INTERLEAVED": 1}),
    ("tiny", 1, {"LAB_BYTES": 32, "LAB_UNROLL": 2, "LAB_INTERLEAVED": 1, "LAB_SINK": 0}),
    ("tiny", 1, {"LAB_BYTES": 8, "LAB_UNROLL": 1, "LAB_INTERLEAVED": 1}),
    ("tiny", 2, {"LAB_WARPS": 4, "LAB_SPLIT": 2, "LAB_BYTES": 16, "LAB_UNROLL": 1}),
    (ODD_SHAPES["h264-i40"], 1, {"LAB_WARPS": 8, "LAB_SPLIT": 8, "LAB_BYTES": 8, "LAB_UNROLL": 1}),
    (
        ODD_SHAPES["h264-i40"],
        1,
        {"LAB_WARPS": 6, "LAB_SPLIT": 3, "LAB_BYTES": 32, "LAB_UNROLL": 1, "LAB_INTERLEAVED": 1},
    ),
    (SPLIT_SHAPE, 1, {"LAB_WARPS": 4, "LAB_SPLIT": 4, "LAB_BYTES": 8, "LAB_UNROLL": 1}),  # 4 non-empty parts
    (SPLIT_SHAPE, 1, {"LAB_WARPS": 2, "LAB_SPLIT": 2, "LAB_BYTES": 32, "LAB_UNROLL": 1, "LAB_INTERLEAVED": 1}),
    (ODD_SHAPES["h8-i8-e1-k1"], 3, {"LAB_BYTES": 32, "LAB_UNROLL": 2}),
    (ODD_SHAPES["h8-i8-e1-k1"], 2, {"LAB_WARPS": 4, "LAB_SPLIT": 4, "LAB_BYTES": 16, "LAB_INTERLEAVED": 1}),
]


# the quick subset: the defaults, the interleaved layout and a split-K; the rest (every width, odd shapes) is slow
@pytest.mark.parametrize(
    ("shape", "tokens", "params"),
    slow_except(EMULATED, [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{i}" for i, c in enumerate(EMULATED)], {0, 3, 6}),
)
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, params: dict[str, int]) -> None:
    problem = make_problem(shape, tokens, seed=_seed(rng), routing="uniform")
    got = _emulate_gate_up(problem, **params)
    faithful, oracle = _intermediate_references(problem)
    _assert_matches(got, faithful, oracle, f"emulated lab gate_up {problem.shape.name} {params}")


@pytest.mark.slow
def test_emulated_bitwise_identities(rng: np.random.Generator) -> None:
    """Same FMA order, so bitwise equal: interleaved vs stacked, SINK 0 vs 1 (what the experiments compare)."""
    problem = make_problem("tiny", 2, seed=_seed(rng))
    for knobs in ({"LAB_BYTES": 16, "LAB_UNROLL": 2}, {"LAB_BYTES": 32, "LAB_UNROLL": 1}):
        base = _emulate_gate_up(problem, **knobs).view(np.uint16)
        assert np.array_equal(_emulate_gate_up(problem, LAB_INTERLEAVED=1, **knobs).view(np.uint16), base)
        assert np.array_equal(_emulate_gate_up(problem, LAB_SINK=0, **knobs).view(np.uint16), base)


@pytest.mark.slow
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator) -> None:
    problem = make_problem("tiny", 3, seed=_seed(rng))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -5
    faithful, oracle = _intermediate_references(problem)
    for knobs in ({}, {"LAB_WARPS": 4, "LAB_SPLIT": 4, "LAB_BYTES": 16, "LAB_INTERLEAVED": 1}):
        got = _emulate_gate_up(problem, ids=ids, **knobs)
        assert np.all(np.isnan(got[0, 1].astype(np.float32))) and np.all(np.isnan(got[2, 0].astype(np.float32)))
        good = np.ones(ids.shape, bool)
        good[0, 1] = good[2, 0] = False
        _assert_matches(got[good], faithful[good], oracle[good], f"emulated good slots beside bad ids {knobs}")


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------


def _run_variant(cupy: Any, variant: Any, problem: Problem, point: dict[str, int], ids: Any = None) -> np.ndarray:
    """variant.make + prepack (as the harness does) into a NaN-poisoned out and workspace; returns out (host)."""
    dims = _dims(problem.shape, problem.tokens)
    launch = variant.make(dims, **point)
    launch.workspace.view(cupy.uint16).fill(0x7FC0)
    w13, w2 = problem.w13, problem.w2
    if variant.prepack is not None:
        w13, w2 = variant.prepack(w13, w2)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    launch(problem.x, w13, w2, problem.topk_ids if ids is None else ids, problem.topk_weights, out)
    cupy.cuda.runtime.deviceSynchronize()
    if ids is None:  # every (t, k, i) of the intermediate written (the poison is a NaN)
        assert bool(cupy.isfinite(launch.workspace.astype(cupy.float32)).all()), f"{variant.name} {point}"
    return cupy.asnumpy(out)


GPU_SHAPES = [("tiny", 3), ("h264-i40", 5), ("h8-i8-e1-k1", 2), ("h1032-i520-k1", 3), ("h2880-i264", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_every_grid_point_on_small_and_odd_shapes(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    variant = _registry()[name]
    for shape_name, tokens in GPU_SHAPES:
        shape = ODD_SHAPES.get(shape_name) or PRESETS[shape_name]
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        faithful, oracle = _references(problem)
        for point in _grid_points(variant):
            got = _run_variant(cupy_mod, variant, problem, point)
            _assert_matches(got, faithful, oracle, f"{name} {shape_name} T={tokens} {point}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_model_shape_at_t1(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    variant = _registry()[name]
    problem = make_problem("qwen3-30b-a3b", 1, seed=_seed(rng), xp=cupy_mod)
    faithful, oracle = _references(problem)
    for point in _grid_points(variant):
        _assert_matches(_run_variant(cupy_mod, variant, problem, point), faithful, oracle, f"{name} {point}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_three_runs_bitwise_identical(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    variant = _registry()[name]
    problem = make_problem(ODD_SHAPES["h264-i40"], 5, seed=_seed(rng), xp=cupy_mod)
    points = _grid_points(variant)
    for point in (points[0], points[-1]):
        runs = [_run_variant(cupy_mod, variant, problem, point).view(np.uint16) for _ in range(3)]
        assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2]), point


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_bad_ids_give_nan_rows(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    """The launch does no value checks (as under capture): bad tokens -> NaN rows, the others still exact."""
    variant = _registry()[name]
    for shape, tokens in ((PRESETS["tiny"], 4), (ODD_SHAPES["h1032-i520-k1"], 3)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        ids = problem.topk_ids.copy()
        ids[0, -1] = shape.experts
        ids[2, 0] = -7
        good = [t for t in range(tokens) if t not in (0, 2)]
        sub = Problem(
            shape,
            len(good),
            0,
            "fixed",
            problem.x[good],
            problem.w13,
            problem.w2,
            problem.topk_ids[good],
            problem.topk_weights[good],
        )
        faithful, oracle = _references(sub)
        for point in _grid_points(variant)[:: max(1, len(_grid_points(variant)) // 3)]:
            got = _run_variant(cupy_mod, variant, problem, point, ids=ids)
            assert np.all(np.isnan(got[[0, 2]].astype(np.float32))), point
            _assert_matches(got[good], faithful, oracle, f"{name} good tokens beside bad ids {point}")


@pytest.mark.gpu
def test_bitwise_identities_on_gpu(cupy_mod: Any, rng: np.random.Generator) -> None:
    """interleaved == stacked and SINK 0 == SINK 1 (same FMA order); the lab at the strict kernel's gate_up
    shape (8 B x U8, one output per warp) == cupy:warp-decode bitwise."""
    registry = _registry()
    problem = make_problem("qwen3-30b-a3b", 3, seed=_seed(rng), xp=cupy_mod)
    for knobs in ({"LAB_BYTES": 16, "LAB_UNROLL": 4}, {"LAB_BYTES": 32, "LAB_UNROLL": 2}):
        stacked = _run_variant(cupy_mod, registry["proto:gate-up-stacked"], problem, knobs).view(np.uint16)
        interleaved = _run_variant(cupy_mod, registry["proto:gate-up-interleaved"], problem, knobs).view(np.uint16)
        no_sink = _run_variant(cupy_mod, registry["proto:gate-up-sink"], problem, {**knobs, "LAB_SINK": 0})
        assert np.array_equal(interleaved, stacked) and np.array_equal(no_sink.view(np.uint16), stacked), knobs
    dims = _dims(problem.shape, 3)
    strict = _poisoned_out(cupy_mod, 3, dims.hidden)
    wdc.FAMILY.build(dims, GU_BYTES=8, GU_UNROLL=8, GU_OUTS=1)(*problem.arrays, strict)
    got = _run_variant(cupy_mod, registry["proto:gate-up-load-width"], problem, {"LAB_BYTES": 8, "LAB_UNROLL": 8})
    assert np.array_equal(got.view(np.uint16), cupy_mod.asnumpy(strict).view(np.uint16))


@pytest.mark.gpu
def test_stages_and_graph_replay(cupy_mod: Any, rng: np.random.Generator) -> None:
    cupy = cupy_mod
    variant = _registry()["proto:gate-up-interleaved"]
    problem = make_problem(ODD_SHAPES["h264-i40"], 7, seed=_seed(rng), xp=cupy)
    dims = _dims(problem.shape, 7)
    expected = _run_variant(cupy, variant, problem, {}).view(np.uint16)
    launch = variant.make(dims)
    assert launch.params == lab.resolve_params(**variant.params)
    assert launch.facts["down_params"] == wdc.FAMILY.for_device(wdc.resolve_params(dims))  # the strict down's knobs
    w13, w2 = variant.prepack(problem.w13, problem.w2)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    stages = launch.stages(problem.x, w13, w2, problem.topk_ids, problem.topk_weights, out)
    assert [name for name, _ in stages] == ["gate_up", "down"]
    for _, fn in stages:
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)
    with pytest.raises(ValueError, match="w13 must be"):  # the stacked w13 given to the interleaved build
        launch(problem.x, problem.w13, w2, problem.topk_ids, problem.topk_weights, out)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out.view(cupy.uint16).fill(0x7FC0)
        stream.begin_capture()
        launch(problem.x, w13, w2, problem.topk_ids, problem.topk_weights, out)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)
