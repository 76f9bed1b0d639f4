"""Prototype fused warp decode (prototypes/fused_layer.py): one persistent kernel per layer.

CPU tests: knob validation, the shared-memory eligibility rule (which dims it can run), the registration, and the
kernel compiled for sm_90 through NVRTC without local memory at its defaults and the sweep grid's non-spilling
points. The kernel has a grid barrier, so it has no g++ emulation (the emulation runs blocks one after another).

GPU tests (``-m gpu``): against the fp64 oracle and the bf16-faithful reference with NaN-poisoned outputs at every
shape it can run (presets, odd shapes, every routing), bitwise the same eagerly and in graphs replayed many times
(the barrier's counters must come back to zero after every launch), bad ids give NaN rows, and a PDL chain where
each layer reads the last one's output equals the PDL=0 chain bitwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels.compile import SOURCES, offline_report
from kernels.contract import BF16, Dims
from kernels.problem import Problem, make_problem
from kernels.shapes import PRESETS
from kernels.variants import get_variant
from prototypes import fused_layer as wdf
from tests.warp_checks import (
    ODD_SHAPES,
    ROUTINGS,
    _assert_matches,
    _poisoned_out,
    _references,
    _seed,
    assert_graph_replays_bitwise,
    assert_pdl_chain_bitwise,
)

QWEN30 = PRESETS["qwen3-30b-a3b"]
DIMS_30B_T1 = Dims(1, QWEN30.hidden, QWEN30.intermediate, QWEN30.experts, QWEN30.top_k)


def _dims(shape: Any, tokens: int) -> Dims:
    return Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)


# ---------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------
def test_resolve_params_validates() -> None:
    resolved = wdf.resolve_params(DIMS_30B_T1)
    assert resolved["FU_ROWS"] == -(-QWEN30.hidden // wdf.grid_blocks())
    with pytest.raises(ValueError, match="unknown fused"):
        wdf.resolve_params(DIMS_30B_T1, GU_WARPS=2)
    with pytest.raises(TypeError, match="FU_WARPS must be an int"):
        wdf.resolve_params(DIMS_30B_T1, FU_WARPS=2.0)
    with pytest.raises(ValueError, match="FU_WARPS must be in 1..32"):
        wdf.resolve_params(DIMS_30B_T1, FU_WARPS=33)
    with pytest.raises(ValueError, match="FU_BYTES must be 4, 8 or 16"):
        wdf.resolve_params(DIMS_30B_T1, FU_BYTES=12)
    with pytest.raises(ValueError, match="FU_ROWS=1 x .* covers"):
        wdf.resolve_params(DIMS_30B_T1, FU_ROWS=1)
    with pytest.raises(ValueError, match="bytes of shared memory a block .* over"):
        wdf.resolve_params(_dims(QWEN30, 2))  # 16 pairs x 16 rows x 1.6 KB


def test_supported_dims_are_the_ones_whose_w2_share_fits() -> None:
    assert wdf.fused_supported(DIMS_30B_T1)
    assert not wdf.fused_supported(_dims(QWEN30, 2))
    assert not wdf.fused_supported(_dims(PRESETS["qwen3-235b-a22b"], 1))  # 8 x 32 rows of 3 KB
    for name, tokens in (("h8-i8-e1-k1", 3), ("h264-i40", 5), ("h64-k40", 2), ("h136-tiny", 4)):
        assert wdf.fused_supported(_dims(ODD_SHAPES[name], tokens)), name
    # the Python layout is the kernel's: mbarrier, flags and ids, padded w2 rows, intermediate, partials (3 parts)
    resolved = wdf.resolve_params(DIMS_30B_T1)
    assert wdf.fused_shared_bytes(resolved, DIMS_30B_T1) == 16 + 48 + 8 * 16 * 1600 + 8 * 768 * 2 + 8 * 3 * 16 * 4


def test_variant_and_source_are_registered() -> None:
    import prototypes

    prototypes.load()
    variant = get_variant("proto:fused-layer")
    assert variant.build is wdf.build and variant.reference_mode == "warp_decode"
    assert variant.kernel_family is wdf.FAMILY and variant.family == "warp-decode"
    assert wdf.SOURCE.kernels == (wdf.FUSED,)
    assert SOURCES["proto_fused_layer"] is wdf.SOURCE  # tools.compile_report finds it
    assert variant.can_run(DIMS_30B_T1) and not variant.can_run(_dims(QWEN30, 2))  # the harness: "unsupported"
    assert not variant.can_run(DIMS_30B_T1, FU_ROWS=1)  # the knobs count too
    assert get_variant("cupy:warp-decode").can_run(_dims(QWEN30, 64))  # no supports(): runs every dims
    assert variant.source is wdf.SOURCE  # tools.sweep's compile columns find the source
    assert variant.params == {**wdf.DEFAULTS, "FU_ROWS": 0}  # FU_ROWS auto
    assert variant.resolve(DIMS_30B_T1) == wdf.resolve_params(DIMS_30B_T1)  # what the compile columns report
    assert wdf.FAMILY.device_needs == {"PDL": 90}


def test_compiles_without_local_memory() -> None:
    """At the defaults and the sweep's spill-free points no spill and no stack frame: the
    H200 showed a 48-byte stack frame in a tensor-core tail costing 8 us (results/diag-staged-probe.json). Two
    compiles at a time (NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    points = [(dims, knobs, wdf.resolve_params(dims, **knobs))
              for dims in (DIMS_30B_T1, _dims(ODD_SHAPES["h64-k40"], 2))
              for knobs in ({}, {"FU_WARPS": 32, "FU_BYTES": 8}, {"FU_BYTES": 8, "FU_UNROLL": 8},
                            {"FU_WARPS": 16, "FU_UNROLL": 8}, {"FU_COPY": 1, "FU_TAIL": 1},
                            {"FU_COPY": 1, "FU_WARPS": 32, "FU_BYTES": 8})]
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda point: offline_report(wdf.SOURCE, **point[2]), points))
    for (dims, knobs, resolved), reports in zip(points, all_reports, strict=True):
        (report,) = reports
        assert report.spills == 0 and report.stack_bytes == 0, (dims, knobs, report)
        assert report.registers <= 65536 // (resolved["FU_WARPS"] * 32), report


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------


def _run_and_check(cupy: Any, problem: Problem, what: str, out_dtype: Any = BF16, **params: Any) -> np.ndarray:
    dims = _dims(problem.shape, problem.tokens)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden, out_dtype)
    ws = wdf.make_workspace(dims)
    ws.intermediate.view(cupy.uint16).fill(0x7FC0)
    returned = wdf.warp_decode_fused(*problem.arrays, out=out, workspace=ws, **params)
    assert returned is out
    cupy.cuda.runtime.deviceSynchronize()
    assert int(ws.grid_sync.sum()) == 0, "the barrier's counters must be back at zero after a launch"
    got = cupy.asnumpy(out)
    faithful, oracle = _references(problem, out_dtype)
    _assert_matches(got, faithful, oracle, what, own_order=True)
    return got


CASES = [
    ("qwen3-30b-a3b", 1, {}),
    ("qwen3-30b-a3b", 1, {"FU_WARPS": 24, "FU_UNROLL": 8}),
    ("qwen3-30b-a3b", 1, {"FU_WARPS": 16, "FU_BYTES": 16, "PDL": 0}),
    ("qwen3-30b-a3b", 1, {"FU_COPY": 1}),
    ("qwen3-30b-a3b", 1, {"FU_TAIL": 1, "FU_COOP": 0}),
    ("h264-i40", 5, {"FU_COPY": 1, "FU_TAIL": 1}),
    ("h64-k40", 2, {"FU_COPY": 1, "FU_TAIL": 1, "FU_COOP": 0}),
    ("h8-i8-e1-k1", 3, {}),
    ("h264-i40", 5, {}),
    ("h64-k40", 2, {}),  # K = 40 > 32
    ("h136-tiny", 4, {"FU_ROWS": 2}),
    ("h1032-i520-k1", 3, {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("model, tokens, knobs", CASES,
                         ids=[f"{m}-T{t}-" + (",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
                              for m, t, p in CASES])
def test_matches_and_repeats_in_graphs(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int,
                                      knobs: dict[str, int]) -> None:
    """Matches both references with every output written; a graph of 4 launches replayed 25 times (100 barriers on
    one workspace) gives the eager result bitwise every time."""
    cupy = cupy_mod
    shape = ODD_SHAPES.get(model) or PRESETS[model]
    problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy)
    eager = _run_and_check(cupy, problem, f"{model} T={tokens} fused {knobs}", **knobs)
    launch = wdf.build(_dims(shape, tokens), **knobs)
    assert_graph_replays_bitwise(cupy, launch, problem, eager, replays=25)
    assert int(launch.workspace.grid_sync.sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routings(cupy_mod: Any, rng: np.random.Generator, routing: str) -> None:
    """Every routing generator, repeated ids included: tiny at T = 6 and qwen3-30b-a3b at T = 1 (per-token lists:
    the first token's, all 8 slots on expert 127)."""
    tiny_ids, qwen_ids = ROUTINGS[routing]
    if isinstance(qwen_ids, list) and isinstance(qwen_ids[0], list):
        qwen_ids = qwen_ids[:1]
    for model, tokens, ids in (("tiny", 6, tiny_ids), ("qwen3-30b-a3b", 1, qwen_ids)):
        problem = make_problem(model, tokens, seed=_seed(rng), routing=ids, xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{model} T={tokens} routing {routing}")


@pytest.mark.gpu
def test_float32_out(cupy_mod: Any, rng: np.random.Generator) -> None:
    problem = make_problem("qwen3-30b-a3b", 1, seed=_seed(rng), xp=cupy_mod)
    _run_and_check(cupy_mod, problem, "qwen3-30b-a3b T=1 fp32 out", out_dtype=np.dtype(np.float32))


@pytest.mark.gpu
def test_bad_ids_in_kernel_give_nan_rows(cupy_mod: Any, rng: np.random.Generator) -> None:
    """Inside a graph the host cannot check ids: a token with an id outside [0, E) gets NaN, the others are right."""
    cupy = cupy_mod
    shape = ODD_SHAPES["h264-i40"]
    problem = make_problem(shape, 4, seed=_seed(rng), xp=cupy)
    ids = problem.topk_ids.copy()
    ids[0, 0] = shape.experts
    ids[2, 1] = -1
    launch = wdf.build(_dims(shape, 4))
    got = _poisoned_out(cupy, 4, shape.hidden)
    launch(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, got)
    cupy.cuda.runtime.deviceSynchronize()
    host = cupy.asnumpy(got).astype(np.float32)
    assert np.all(np.isnan(host[[0, 2]]))
    good = [1, 3]
    sub = Problem(problem.shape, 2, 0, "fixed", cupy.asnumpy(problem.x)[good], cupy.asnumpy(problem.w13),
                  cupy.asnumpy(problem.w2), cupy.asnumpy(problem.topk_ids)[good],
                  cupy.asnumpy(problem.topk_weights)[good])
    faithful, oracle = _references(sub)
    _assert_matches(cupy.asnumpy(got)[good], faithful, oracle, "fused good tokens", own_order=True)
    assert int(launch.workspace.grid_sync.sum()) == 0


@pytest.mark.gpu
def test_pdl_chain_where_each_layer_reads_the_last(cupy_mod: Any, rng: np.random.Generator) -> None:
    """Layer l + 1's x is layer l's output and all layers share one workspace (intermediate and barrier): the
    PDL=1 graph, replayed 20 times, equals the PDL=0 chain bitwise."""
    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", 1, seed=_seed(rng), xp=cupy)
    assert_pdl_chain_bitwise(cupy, problem, wdf.build, _dims(problem.shape, 1),
                             lambda launch: launch.workspace.intermediate.view(cupy.uint16).fill(0x7FC0))
