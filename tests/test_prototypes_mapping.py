"""Prototypes of warp decode's mapping and numerics: proto:outputs-per-warp, proto:warps-per-block (the strict
kernels' knobs), proto:intermediate-fp32 and proto:persistent-grid (their own CUDA sources).

CPU tests: every grid point of every variant compiles for sm_90 (NVRTC, offline) with zero spills and a block
that can launch; knob validation (ValueError / TypeError naming the knob, before any device call); the
registry and tools.compile_report find everything after ``prototypes.load()``; NumPy: the fp32-intermediate math is
within the harness tolerance of ``reference.moe_decode(mode="warp_decode")`` and closer to fp64; the two new
CUDA sources run on the CPU (g++, one thread per lane, shuffles through a barrier) on small odd shapes, with a
tiny persistent grid so every warp loops over several outputs, and bad ids give NaN rows.

GPU tests (``-m gpu``): every grid point on small and odd shapes (H not a multiple of 256, K = 1, E = 1,
K > 32, duplicate ids), NaN-poisoned outputs fully written, 3 identical runs bitwise equal, bad expert ids ->
NaN rows (launch does no value checks, as under graph capture).

Comparison rules.
* bf16 intermediate (outputs-per-warp, warps-per-block, persistent-grid, intermediate-fp32 INTER_F32=0): the
  strict kernel's rule against ``moe_decode(mode="warp_decode")`` (``tests.warp_checks._assert_matches``: every
  output within ulp(|ref|) + ulp(RMS / 4), >= 85 % bitwise, rel-L2 vs fp64 < 5e-3 -- not bitwise: the reference
  sums in BLAS order), AND bitwise equal to ``cupy:warp-decode`` built with the knobs that give the same
  per-output summation order (``STRICT_EQUIVALENT``): the prototype must change the mapping, never the numbers.
* fp32 intermediate (INTER_F32=1): the same rule against :func:`fp32_intermediate_reference` (NumPy, the
  warp_decode mode without the intermediate's bf16 rounding); within the harness tolerance
  (``tools.harness.compare``) of ``moe_decode(mode="warp_decode")``, which is what the sweep checks; and on
  problems of a few thousand outputs, rel-L2 vs fp64 below that of INTER_F32=0 on the same problem.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import numpy as np
import pytest

from kernels.contract import BF16, Dims
from kernels.numerics import bf16_to_f32, rel_l2, round_bf16, silu
from kernels.problem import Problem, make_problem
from kernels.reference import expert_groups, matmul_bf16_t, moe_decode
from kernels.shapes import PRESETS, MoEShape
from tests.warp_checks import (
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    ODD_SHAPES,
    WARP_LOCKSTEP_LAUNCH,
    _assert_matches,
    _poisoned_out,
    _references,
    _seed,
    build_emulator,
    run_emulator,
    slow_except,
)

PROTOTYPES = ("proto:outputs-per-warp", "proto:warps-per-block", "proto:intermediate-fp32", "proto:persistent-grid")
EXPECTED_GRIDS = {
    "proto:outputs-per-warp": {"GU_OUTS": [1, 2, 4], "DN_OUTS": [1, 2, 4]},
    "proto:warps-per-block": {"GU_WARPS": [4, 8, 16], "DN_WARPS": [4, 8, 16]},
    "proto:intermediate-fp32": {"INTER_F32": [0, 1]},
    "proto:persistent-grid": {"PERSIST_BLOCKS": [1, 2, 4, 8], "ORDER": [0, 1]},
}
STRICT_KNOBS = ("proto:outputs-per-warp", "proto:warps-per-block")  # reuse kernels.warp_decode_cupy.build


def _registry() -> dict[str, Any]:
    import prototypes
    from kernels.variants import REGISTRY, load_builtin

    load_builtin()
    prototypes.load()
    return REGISTRY


def _points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]


def _module(name: str) -> Any:
    import prototypes.intermediate_fp32 as inter
    import prototypes.persistent_grid as persist

    return {"proto:intermediate-fp32": inter, "proto:persistent-grid": persist}[name]


def _compile_plan(name: str, point: dict[str, Any], dims: Dims) -> tuple[Any, dict[str, int]]:
    """(CudaSource, resolved knobs) that ``variant.make(dims, **point)`` compiles: its kernel family's."""
    variant = _registry()[name]
    return variant.source, variant.resolve(dims, **point)


def _warps_per_block(source: Any, kernel: str, params: dict[str, int]) -> int:
    return int(params[source.warps_knobs[kernel]])


# ---------------------------------------------------------------------------------------------------
# CPU: registry, grids, offline compiles
# ---------------------------------------------------------------------------------------------------
def test_registry_finds_the_prototypes() -> None:
    import prototypes
    from kernels import warp_decode_cupy as wdc
    from kernels.compile import CudaSource

    names = prototypes.load()
    assert {"outputs_per_warp", "warps_per_block", "intermediate_fp32", "persistent_grid"} <= set(names)
    registry = _registry()
    for name in PROTOTYPES:
        variant = registry[name]
        assert variant.grid == EXPECTED_GRIDS[name]
        assert variant.backend == "cupy" and variant.reference_mode == "warp_decode" and variant.quant is None
        assert isinstance(variant.source, CudaSource), name  # the sweep's compile columns find the source
        family = wdc.FAMILY if name in STRICT_KNOBS else _module(name).FAMILY
        assert variant.kernel_family is family and variant.source is family.source, name
        # every knob of the family, the auto ones left to its rules
        assert variant.params == {**family.defaults, **{knob: 0 for knob in family.auto_knobs}}, name
        doc = importlib.import_module("prototypes." + name.removeprefix("proto:").replace("-", "_")).__doc__
        for section in ("Hypothesis", "Prediction", "Result on the H200", "Conclusion", "qwen3-235b-a22b"):
            assert section in doc, (name, section)


def test_sources_are_registered_for_inspect() -> None:
    from kernels.compile import SOURCES
    from tools import compile_report as offline

    offline.load_sources()
    assert SOURCES["proto_intermediate_fp32"] is _module("proto:intermediate-fp32").SOURCE
    assert SOURCES["proto_persistent_grid"] is _module("proto:persistent-grid").SOURCE
    for source in (SOURCES["proto_intermediate_fp32"], SOURCES["proto_persistent_grid"]):
        code = source.code
        assert "#include" not in code and "__shared__" not in code and "atomic" not in code
        assert code.count("(unsigned)experts") >= 2  # both kernels range-check ids
        for overrides in source.variants:
            source.render(**overrides)


COMPILE_DIMS = (Dims(1, 2048, 768, 128, 8), Dims(5, 136, 48, 6, 2))  # qwen3-30b-a3b T=1 (K=8), tiny (K=2)


def _compile_cases() -> list[tuple[str, dict[str, Any], Dims]]:
    """Every grid point at qwen3-30b's dims; tiny's dims at the strict-knob prototypes' defaults (the quick test's
    defaults run at qwen3-30b's; the others ignore dims)."""
    cases = [(name, point, COMPILE_DIMS[0]) for name in PROTOTYPES for point in _points(EXPECTED_GRIDS[name])]
    return cases + [(name, {}, dims) for name in STRICT_KNOBS for dims in COMPILE_DIMS[1:]]


@pytest.mark.parametrize("which", ["defaults", pytest.param("grid", marks=pytest.mark.slow)])
def test_every_grid_point_compiles_without_spills(which: str) -> None:
    """Every grid point (at the knobs its build resolves to; quick: each prototype's defaults) compiles for sm_90
    with zero spill bytes, and one block fits the register file (registers x 32 x warps <= 65536; 16-warp blocks
    need <= 128 registers); a persistent grid's PERSIST_BLOCKS blocks all fit at once. Each distinct text is
    compiled once, two at a time (NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    cases = [(name, {}, COMPILE_DIMS[0]) for name in PROTOTYPES] if which == "defaults" else _compile_cases()
    plans = [(case, *_compile_plan(*case)) for case in cases]
    unique = {source.render(**params): (source, params) for _, source, params in plans}
    with ThreadPoolExecutor(2) as pool:
        reports_of = dict(zip(unique, pool.map(lambda plan: offline_report(plan[0], **plan[1]), unique.values()),
                              strict=True))
    problems = []
    for (name, point, dims), source, params in plans:
        reports = reports_of[source.render(**params)]
        if {r.kernel for r in reports} != set(source.compiled_kernels(**params)):
            problems.append(f"{name} {point}: kernels {[r.kernel for r in reports]}")
        for report in reports:
            warps = _warps_per_block(source, report.kernel, params)
            blocks = params.get("PERSIST_BLOCKS", 1)
            if report.spills:
                problems.append(f"{name} {point} {dims}: {report.kernel} spills {report.spills} bytes")
            if report.registers * 32 * warps * blocks > 65536:
                problems.append(
                    f"{name} {point}: {report.kernel} {report.registers} registers x {warps} warps"
                    f" x {blocks} blocks exceed the register file"
                )
    assert problems == []


@pytest.mark.parametrize(
    ("name", "params", "error", "match"),
    [
        ("proto:intermediate-fp32", {"INTER_F32": 2}, ValueError, "INTER_F32"),
        ("proto:intermediate-fp32", {"INTER_F32": True}, TypeError, "INTER_F32"),
        ("proto:intermediate-fp32", {"DN_UNROLL": 0}, ValueError, "DN_UNROLL"),
        ("proto:intermediate-fp32", {"GU_WARPS": 33}, ValueError, "GU_WARPS"),
        ("proto:intermediate-fp32", {"BOGUS": 1}, ValueError, "BOGUS"),
        ("proto:persistent-grid", {"PERSIST_BLOCKS": 0}, ValueError, "PERSIST_BLOCKS"),
        ("proto:persistent-grid", {"PERSIST_BLOCKS": 2.0}, TypeError, "PERSIST_BLOCKS"),
        ("proto:persistent-grid", {"ORDER": 2}, ValueError, "ORDER"),
        ("proto:persistent-grid", {"PERSIST_BLOCKS": 32, "GU_WARPS": 4}, ValueError, "PERSIST_BLOCKS x GU_WARPS"),
        ("proto:persistent-grid", {"DN_SLOTS": 0}, ValueError, "DN_SLOTS"),
        ("proto:outputs-per-warp", {"GU_OUTS": 0}, ValueError, "GU_OUTS"),
        ("proto:outputs-per-warp", {"DN_OUTS": 33}, ValueError, "DN_OUTS"),
        ("proto:warps-per-block", {"GU_WARPS": 64}, ValueError, "GU_WARPS"),
        ("proto:warps-per-block", {"DN_WARPS": "8"}, TypeError, "DN_WARPS"),
    ],
)
def test_knob_validation_names_the_knob(name: str, params: dict[str, Any], error: type, match: str) -> None:
    """variant.make() validates its knobs before compiling or allocating (no device call: this is a CPU)."""
    with pytest.raises(error, match=match):
        _registry()[name].make(Dims(1, 136, 48, 6, 2), **params)


def test_persistent_grid_size() -> None:
    persist = _module("proto:persistent-grid")
    assert persist.grid_blocks(6144, 4, 132, 8) == 132 * 8  # qwen3-30b T=1 gate_up: more work than warps
    assert persist.grid_blocks(2048, 4, 132, 8) == 512  # down: less work than a persistent wave
    assert persist.grid_blocks(1, 16, 132, 1) == 1
    blocks = persist.launch_blocks(COMPILE_DIMS[0], persist.resolve_params(PERSIST_BLOCKS=8, DN_WARPS=8))
    sms = blocks["sms"]  # the current GPU's, 132 (the H200's) where there is none
    assert sms >= 1
    assert blocks == {"gate_up": persist.grid_blocks(6144, 4, sms, 8), "down": persist.grid_blocks(2048, 8, sms, 8),
                      "sms": sms}


# ---------------------------------------------------------------------------------------------------
# CPU: the fp32-intermediate math in NumPy
# ---------------------------------------------------------------------------------------------------
def fp32_intermediate_reference(
    x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out_dtype: Any = BF16
) -> np.ndarray:
    """``moe_decode(mode="warp_decode")`` without the intermediate's bf16 rounding (INTER_F32=1's promise)."""
    x, w13, w2, topk_ids, topk_weights = (
        a.get() if hasattr(a, "get") else np.asarray(a) for a in (x, w13, w2, topk_ids, topk_weights)
    )
    tokens, hidden = x.shape
    top_k, inter = topk_ids.shape[1], w2.shape[2]
    activations = bf16_to_f32(x).astype(np.float32)
    per_pair = np.empty((tokens * top_k, hidden), np.float32)
    for expert, pairs in expert_groups(topk_ids):
        gate_up = matmul_bf16_t(activations[pairs // top_k], w13[expert], np.float32)
        hidden_act = silu(gate_up[:, :inter]) * gate_up[:, inter:]  # fp32, not rounded
        per_pair[pairs] = matmul_bf16_t(hidden_act.astype(np.float32), w2[expert], np.float32)
    per_pair = per_pair.reshape(tokens, top_k, hidden)
    out = np.zeros((tokens, hidden), np.float32)
    weights = topk_weights.astype(np.float32)
    for k in range(top_k):
        out += weights[:, k, None] * per_pair[:, k]
    return round_bf16(out) if np.dtype(out_dtype) == BF16 else out.astype(out_dtype)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_fp32_intermediate_within_harness_tolerance_and_closer_to_fp64(seed: int) -> None:
    from tools.harness import compare

    shape = MoEShape("np-fp32-inter", 520, 264, 6, 4)  # odd sizes, 8 x 520 = 4160 outputs
    problem = make_problem(shape, 8, seed=seed)
    fp32_inter = fp32_intermediate_reference(*problem.arrays)
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    check = compare(fp32_inter, faithful, None)  # what the sweep's Workbench checks before timing
    assert check["ok"] and check["all_written"], check
    err_fp32, err_bf16 = rel_l2(fp32_inter.astype(np.float64), oracle), rel_l2(faithful.astype(np.float64), oracle)
    assert err_fp32 < err_bf16, (err_fp32, err_bf16)
    assert err_fp32 < 2e-3


# ---------------------------------------------------------------------------------------------------
# CPU: the new CUDA sources emulated (g++: one lane per CUDA thread, shuffles through a barrier)
# ---------------------------------------------------------------------------------------------------
EMULATION_HARNESS = EMULATION_PRELUDE + r"""
#include "kernel.cu"
#ifndef EMU_INTER_T
#define EMU_INTER_T bf16_t
#endif
""" + WARP_LOCKSTEP_LAUNCH + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    int f32 = atoi(argv[6]);
    long long gu_blocks = atoll(argv[7]), dn_blocks = atoll(argv[8]);
    std::string dir = argv[9];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    auto w13 = load<uint16_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto w2 = load<uint16_t>(dir + "/w2.bin", (size_t)E * H * I);
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    auto wts = load<float>(dir + "/wts.bin", (size_t)T * K);
    std::vector<EMU_INTER_T> inter((size_t)T * K * I);
    std::memset(inter.data(), 0xff, inter.size() * sizeof(EMU_INTER_T));  // NaN poison (bf16 or fp32)
    std::vector<uint32_t> out((size_t)T * H, 0x7fc07fc0u);  // NaN poison in either view
    launch(gu_blocks, GU_WARPS * 32, [&] {
        EMU_GATE_UP(x.data(), w13.data(), ids.data(), inter.data(), T, H, I, E, K);
    });
    launch(dn_blocks, DN_WARPS * 32, [&] {
        EMU_DOWN(inter.data(), w2.data(), ids.data(), wts.data(), out.data(), f32, T, H, I, E, K);
    });
    FILE* f = fopen((dir + "/out.bin").c_str(), "wb");
    fwrite(out.data(), 1, (size_t)T * H * (f32 ? 4 : 2), f);
    fclose(f);
    return 0;
}
"""


def _emulate(
    name: str, problem: Problem, ids: np.ndarray | None = None, out_dtype: Any = BF16, sms: int = 2, **params: int
) -> np.ndarray:
    """Run a prototype's CUDA C on the CPU with its build's launch geometry (``sms`` stands in for the device's
    SM count of the persistent grid, small so that every warp loops); returns out [T, H]."""
    import tempfile

    module = _module(name)
    resolved = module.resolve_params(**params)
    shape = problem.shape
    dims = Dims(problem.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    gu_outputs, dn_outputs = dims.tokens * dims.top_k * dims.intermediate, dims.tokens * dims.hidden
    if name == "proto:persistent-grid":
        gu_blocks = module.grid_blocks(gu_outputs, resolved["GU_WARPS"], sms, resolved["PERSIST_BLOCKS"])
        dn_blocks = module.grid_blocks(dn_outputs, resolved["DN_WARPS"], sms, resolved["PERSIST_BLOCKS"])
        inter_t = "bf16_t"
    else:
        gu_blocks, dn_blocks = -(-gu_outputs // resolved["GU_WARPS"]), -(-dn_outputs // resolved["DN_WARPS"])
        inter_t = "inter_t"
    f32 = int(np.dtype(out_dtype) == np.float32)
    gate_up, down = module.SOURCE.kernels
    binary = build_emulator(module.SOURCE.render(**resolved), EMULATION_HARNESS, f"-DEMU_GATE_UP={gate_up}",
                            f"-DEMU_DOWN={down}", f"-DEMU_INTER_T={inter_t}")
    with tempfile.TemporaryDirectory() as tmp:
        problem.x.tofile(f"{tmp}/x.bin")
        problem.w13.tofile(f"{tmp}/w13.bin")
        problem.w2.tofile(f"{tmp}/w2.bin")
        np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
        problem.topk_weights.tofile(f"{tmp}/wts.bin")
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k, f32, gu_blocks,
                     dn_blocks, tmp)
        raw = np.fromfile(f"{tmp}/out.bin", np.float32 if f32 else np.uint16)
    return raw.reshape(dims.tokens, dims.hidden) if f32 else raw.view(BF16).reshape(dims.tokens, dims.hidden)


EMULATED = [  # (variant, shape, tokens, routing, params, out dtype); small: ~1 ms per warp-output on 2 cores
    ("proto:intermediate-fp32", "tiny", 2, "uniform", {"INTER_F32": 0}, BF16),
    ("proto:intermediate-fp32", "tiny", 2, [0, 0], {"INTER_F32": 1}, BF16),
    (
        "proto:intermediate-fp32",
        MoEShape("h264-i40", 264, 40, 3, 2),
        1,
        "uniform",
        {"INTER_F32": 1, "DN_UNROLL": 1},
        np.float32,
    ),
    ("proto:intermediate-fp32", MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {"INTER_F32": 1}, BF16),
    ("proto:persistent-grid", "tiny", 2, "uniform", {"PERSIST_BLOCKS": 1, "ORDER": 0}, BF16),
    ("proto:persistent-grid", "tiny", 1, [3, 3], {"PERSIST_BLOCKS": 2, "ORDER": 1}, BF16),
    ("proto:persistent-grid", MoEShape("h64-k40", 64, 24, 44, 40), 1, "uniform", {"DN_SLOTS": 6, "ORDER": 0}, BF16),
    ("proto:persistent-grid", MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {"PERSIST_BLOCKS": 1}, np.float32),
]


# the quick subset: each prototype on the tiny preset (fp32 intermediate with a duplicate id; a persistent grid)
@pytest.mark.parametrize(
    ("name", "shape", "tokens", "routing", "params", "out_dtype"),
    slow_except(EMULATED, [f"{c[0][6:]}-{getattr(c[1], 'name', c[1])}-T{c[2]}-{c[4]}" for c in EMULATED], {1, 4}),
)
def test_cuda_source_emulated_on_cpu(
    rng: np.random.Generator, name: str, shape: Any, tokens: int, routing: Any, params: dict[str, int], out_dtype: Any
) -> None:
    """The real kernel text (index math, grid-stride loops, guards, shuffles, rounding) against the reference."""
    problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    got = _emulate(name, problem, out_dtype=out_dtype, **params)
    oracle = moe_decode(*problem.arrays, mode="fp64")
    if params.get("INTER_F32"):
        faithful = fp32_intermediate_reference(*problem.arrays, out_dtype=out_dtype)
    else:
        faithful = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=out_dtype)
    _assert_matches(got, faithful, oracle, f"emulated {name} {problem.shape.name} {params}")


@pytest.mark.parametrize(
    "name, params",
    [
        ("proto:intermediate-fp32", {"INTER_F32": 1}),
        pytest.param("proto:intermediate-fp32", {"INTER_F32": 0}, marks=pytest.mark.slow),
        pytest.param("proto:persistent-grid", {"PERSIST_BLOCKS": 1, "ORDER": 0}, marks=pytest.mark.slow),
    ],
)
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator, name: str, params: dict[str, int]) -> None:
    """Out-of-range ids (past the end, negative, INT_MAX) -> NaN rows; the other tokens still right."""
    shape = PRESETS["tiny"]
    problem = make_problem(shape, 4, seed=_seed(rng))
    ids = problem.topk_ids.copy()
    ids[0, -1] = shape.experts
    ids[2, 0] = -7
    ids[2, -1] = 2**31 - 1
    got = _emulate(name, problem, ids=ids, **params)
    assert np.all(np.isnan(got[[0, 2]].astype(np.float32)))
    good = [1, 3]
    sub = Problem(
        shape,
        2,
        0,
        "fixed",
        problem.x[good],
        problem.w13,
        problem.w2,
        problem.topk_ids[good],
        problem.topk_weights[good],
    )
    reference = fp32_intermediate_reference if params.get("INTER_F32") else None
    faithful = reference(*sub.arrays) if reference else moe_decode(*sub.arrays, mode="warp_decode")
    _assert_matches(got[good], faithful, moe_decode(*sub.arrays, mode="fp64"), f"{name} good tokens beside bad ids")


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
GPU_SHAPES = [  # (shape, tokens, routing): small and odd
    (ODD_SHAPES["h8-i8-e1-k1"], 3, "uniform"),  # E = 1, K = 1
    (ODD_SHAPES["h264-i40"], 5, "uniform"),  # H, I not multiples of 256
    (ODD_SHAPES["h64-k40"], 2, "uniform"),  # K > 32
    (ODD_SHAPES["h1032-i520-k1"], 7, "uniform"),  # K = 1
    (PRESETS["tiny"], 6, [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [4, 4]]),  # duplicate ids
    (PRESETS["qwen3-30b-a3b"], 3, "uniform"),  # enough outputs that persistent warps loop on 132 SMs
]




def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


def _run(cupy: Any, launch: Any, problem: Problem, ids: Any = None, out_dtype: Any = BF16) -> np.ndarray:
    out = _poisoned_out(cupy, problem.tokens, problem.shape.hidden, out_dtype)
    launch(problem.x, problem.w13, problem.w2, problem.topk_ids if ids is None else ids, problem.topk_weights, out)
    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(out)


def STRICT_EQUIVALENT(name: str, resolved: dict[str, int]) -> dict[str, int] | None:  # noqa: N802
    """Knobs of ``cupy:warp-decode`` with the same per-output summation order as this prototype point."""
    if name in STRICT_KNOBS:  # OUTS / WARPS change no order; the resolved down batching does
        return {"DN_SLOTS": resolved["DN_SLOTS"], "DN_UNROLL": resolved["DN_UNROLL"]}
    common = {"GU_BYTES": 8, "GU_OUTS": 1, "DN_OUTS": 1, "DN_BYTES": 16}
    if name == "proto:persistent-grid":
        return {**common, "DN_SLOTS": resolved["DN_SLOTS"], "DN_UNROLL": 1}
    if name == "proto:intermediate-fp32" and not resolved["INTER_F32"]:
        return {**common, "DN_SLOTS": 1, "DN_UNROLL": resolved["DN_UNROLL"]}
    return None


GPU_CASES = [(name, point) for name in PROTOTYPES for point in _points(EXPECTED_GRIDS[name])]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "point"), GPU_CASES, ids=[f"{n[6:]}-" + ",".join(f"{k}={v}" for k, v in p.items()) for n, p in GPU_CASES]
)
def test_grid_point_on_small_and_odd_shapes(
    cupy_mod: Any, rng: np.random.Generator, name: str, point: dict[str, Any]
) -> None:
    from kernels.variants import get_variant

    variant = _registry()[name]
    for shape, tokens, routing in GPU_SHAPES:
        problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing, xp=cupy_mod)
        launch = variant.make(_dims(problem), **point)
        assert launch.params == variant.kernel_family.for_device(variant.resolve(_dims(problem), **point))
        if name == "proto:persistent-grid":  # the grids it launches, sized for this GPU
            assert launch.facts["blocks"] == _module(name).launch_blocks(_dims(problem), launch.params)
            assert launch.facts["blocks"]["sms"] == cupy_mod.cuda.Device().attributes["MultiProcessorCount"]
        got = _run(cupy_mod, launch, problem)
        what = f"{name} {point} {shape.name} T={tokens}"
        if launch.params.get("INTER_F32"):
            faithful = fp32_intermediate_reference(*problem.compact().arrays)
            _, oracle = _references(problem)
            _assert_matches(got, faithful, oracle, what)
        else:
            faithful, oracle = _references(problem)
            _assert_matches(got, faithful, oracle, what)
        equivalent = STRICT_EQUIVALENT(name, launch.params)
        if equivalent is not None:
            strict = get_variant("cupy:warp-decode").make(_dims(problem), **equivalent)
            want = _run(cupy_mod, strict, problem)
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{what}: not bitwise cupy:warp-decode"


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROTOTYPES)
def test_three_runs_bitwise_and_fp32_out(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    problem = make_problem("tiny", 37, seed=_seed(rng), xp=cupy_mod)
    launch = _registry()[name].make(_dims(problem))
    runs = [_run(cupy_mod, launch, problem) for _ in range(3)]  # poisoned before each run
    for run in runs[1:]:
        assert np.array_equal(run.view(np.uint16), runs[0].view(np.uint16))
    got = _run(cupy_mod, launch, problem, out_dtype=np.float32)
    faithful, oracle = _references(problem, np.float32)
    _assert_matches(got, faithful, oracle, f"{name} fp32 out")


@pytest.mark.gpu
@pytest.mark.parametrize("name", PROTOTYPES)
def test_bad_ids_give_nan_rows(cupy_mod: Any, rng: np.random.Generator, name: str) -> None:
    """launch does no value checks (as under graph capture): bad tokens -> NaN rows, the rest still right."""
    for point in _points(EXPECTED_GRIDS[name])[:: max(1, len(_points(EXPECTED_GRIDS[name])) // 3)]:
        for shape, tokens in ((PRESETS["tiny"], 4), (ODD_SHAPES["h64-k40"], 3)):
            problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
            ids = problem.topk_ids.copy()
            ids[0, -1] = shape.experts
            ids[2, 0] = -7
            ids[2, -1] = 2**31 - 1
            launch = _registry()[name].make(_dims(problem), **point)
            got = _run(cupy_mod, launch, problem, ids=ids)
            assert np.all(np.isnan(got[[0, 2]].astype(np.float32))), (name, point)
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
            if launch.params.get("INTER_F32"):
                faithful = fp32_intermediate_reference(*sub.compact().arrays)
            _assert_matches(got[good], faithful, oracle, f"{name} {point} good tokens beside bad ids")


@pytest.mark.gpu
def test_fp32_intermediate_is_closer_to_fp64(cupy_mod: Any, rng: np.random.Generator) -> None:
    """INTER_F32=1 vs 0 on the same problems: within the harness tolerance of the warp_decode reference (what
    the sweep checks), and a smaller rel-L2 vs fp64."""
    from tools.harness import compare

    variant = _registry()["proto:intermediate-fp32"]
    for shape, tokens in ((PRESETS["tiny"], 37), (ODD_SHAPES["h264-i40"], 19), (PRESETS["qwen3-30b-a3b"], 3)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        faithful, oracle = _references(problem)
        bf16_inter = _run(cupy_mod, variant.make(_dims(problem), INTER_F32=0), problem)
        fp32_inter = _run(cupy_mod, variant.make(_dims(problem), INTER_F32=1), problem)
        assert compare(fp32_inter, faithful, None)["ok"], shape.name
        err32 = rel_l2(fp32_inter.astype(np.float64), oracle)
        err16 = rel_l2(bf16_inter.astype(np.float64), oracle)
        assert err32 < err16, (shape.name, err32, err16)
