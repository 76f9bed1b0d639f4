"""Numba warp decode: the real kernels on the CUDA simulator (CPU, in a subprocess), offline PTX checks,
and ``@pytest.mark.gpu`` tests for the H200.

Tolerance (simulator and GPU), per output element vs ``reference.moe_decode(mode="warp_decode")``: the one output
checker, ``kernels.checks.check_output`` under ``SIMULATOR`` (at most 4 x (ulp(|ref|) + ulp(RMS(ref) / 8)), and
rel-L2 vs the fp64 oracle < 5e-3). Why not bitwise: the GPU sums in a different order than NumPy's BLAS (and
contracts multiply-adds into FMAs), so an FP32 result may round to the neighbouring bf16 -- once in the [T, K, I]
intermediate (which moves an output by ~RMS * 2**-8 / sqrt(I), hence the RMS term) and once in the output (1 ulp).
Most elements are bitwise equal; the fraction is asserted to be high.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SIMULATING = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

# ---------------------------------------------------------------------------------------------------------
# CPU: the simulator, in a fresh interpreter (NUMBA_ENABLE_CUDASIM must be set before numba is imported)
# ---------------------------------------------------------------------------------------------------------
_SIM_SCRIPT = r"""
import json
import os
import sys

# The simulator runs a Python thread per CUDA thread, in lockstep through barriers: every step hands the GIL from
# thread to thread. Across two cores each hand-off wakes the other core (2-10x slower on 2 CPUs than on one,
# measured), so the simulation keeps to one CPU. The threads still interleave only through the GIL.
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import numpy as np
from numba import cuda
from kernels import simt
from kernels.warp_decode_numba import FAMILY, simulate_bad_ids

cases, bad_ids = json.loads(sys.argv[1])

# the shim's warp semantics on their own: 2 warps, every shuffle flavour
@cuda.jit
def shuffles(out):
    tid = cuda.threadIdx.x
    lane = tid & 31
    v = np.float32(tid * 10)
    out[0, tid] = cuda.shfl_xor_sync(0xFFFFFFFF, v, 5)
    out[1, tid] = cuda.shfl_down_sync(0xFFFFFFFF, v, 3)
    out[2, tid] = cuda.shfl_up_sync(0xFFFFFFFF, v, 2)
    out[3, tid] = cuda.shfl_sync(0xFFFFFFFF, v, 7)
    cuda.syncwarp()
    s = np.float32(lane)
    offset = 16
    while offset > 0:
        s = np.float32(s + cuda.shfl_xor_sync(0xFFFFFFFF, s, offset))
        offset //= 2
    out[4, tid] = s

out = np.zeros((5, 64), np.float32)
shuffles[1, 64](out)
tid = np.arange(64)
lane, base = tid % 32, tid - tid % 32
expect = np.stack([
    (base + (lane ^ 5)) * 10,
    np.where(lane + 3 < 32, tid + 3, tid) * 10,
    np.where(lane - 2 >= 0, tid - 2, tid) * 10,
    (base + 7) * 10,
    np.full(64, sum(range(32))),
]).astype(np.float32)
print(json.dumps({
    "shuffles_ok": bool(np.array_equal(out, expect)),
    "cases": FAMILY.simulate(tuple(cases)),  # simulator_selfcheck, as the bench's CPU path calls it
    "bad_ids": simulate_bad_ids() if bad_ids else None,
}))
"""

# The quick subset runs the smallest case (E = 1, K = 1, one warp per block) and the shuffles; the other cases and
# the bad-id guard (~20 s together: one Python thread per simulated CUDA thread) are slow.
QUICK_SIM_CASES = ("h8-k1-e1",)


def _simulate(cases: list[str], bad_ids: bool, timeout: int) -> dict:
    """The simulator script in a fresh interpreter (NUMBA_ENABLE_CUDASIM must be set before numba is imported);
    ``timeout`` only guards against a hang."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _SIM_SCRIPT, json.dumps([cases, bad_ids])], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def simulated_quick() -> dict:
    """The quick subset's simulator process: the shuffles and the quick cases (~2 s on 2 idle cores). The slow test
    runs the other cases in a process of its own, which a parallel run starts beside this one."""
    return _simulate(list(QUICK_SIM_CASES), bad_ids=False, timeout=300)


def _assert_case_matches(case: dict) -> None:
    from kernels.checks import SIMULATOR

    assert case["tolerance"] == SIMULATOR.name, case
    assert case["all_written"], case["case"]
    assert case["rel_l2_fp64"] < SIMULATOR.max_rel_l2_fp64, case
    assert case["max_ulp"] <= SIMULATOR.max_ulp, case
    assert case["ok"], case
    if case["out_dtype"] == "bfloat16":  # the simulator rounds every FP32 op like the GPU, no FMA
        assert case["bitwise_fraction"] > 0.95, case


def test_simulator_warp_shuffles(simulated_quick: dict) -> None:
    assert simulated_quick["shuffles_ok"]


def test_simulator_smallest_case_matches_reference(simulated_quick: dict) -> None:
    assert [case["case"] for case in simulated_quick["cases"]] == list(QUICK_SIM_CASES)
    for case in simulated_quick["cases"]:
        _assert_case_matches(case)


@pytest.mark.slow
def test_simulator_kernels_match_reference_and_guard_bad_ids() -> None:
    """Every other case (~20 s together) and the bad-id guard, in one simulator process."""
    from kernels.warp_decode_numba import SIM_CASES

    simulated = _simulate([name for name in SIM_CASES if name not in QUICK_SIM_CASES], bad_ids=True, timeout=1800)
    cases = {case["case"]: case for case in simulated["cases"]}
    assert set(cases) | set(QUICK_SIM_CASES) == set(SIM_CASES)
    for case in cases.values():
        _assert_case_matches(case)
    bad = simulated["bad_ids"]
    assert bad["bad_rows_nan"] and bad["good_row_finite"]
    assert bad["ok"], bad


# ---------------------------------------------------------------------------------------------------------
# CPU: offline compile, registry, argument checks (normal numba, no simulator, no GPU)
# ---------------------------------------------------------------------------------------------------------
needs_real_numba = pytest.mark.skipif(SIMULATING, reason="needs Numba's real CUDA target (no simulator)")


@needs_real_numba
def test_offline_reports_no_spills_no_stack() -> None:
    from kernels.warp_decode_numba import KERNEL_NAMES, offline_reports

    reports = offline_reports()
    assert {r.kernel for r in reports} == set(KERNEL_NAMES) and len(reports) == 4  # bf16 and f32 out
    for report in reports:
        assert report.spills == 0 and report.stack_bytes == 0, report
        assert 0 < report.registers <= 128, report


@needs_real_numba
def test_ptx_uses_16_byte_nc_loads_and_no_local_memory() -> None:
    from kernels.warp_decode_numba import compile_ptx, ptx_load_widths

    for knobs in ({}, {"rows": 2, "unroll": 4, "slots": 1}, {"out_f32": True}):  # {} and out_f32: offline_reports' PTX
        for name, ptx in compile_ptx(**knobs).items():
            widths = ptx_load_widths(ptx)
            assert widths.get("ld.global.nc.v2.u64", 0) > 0, (name, widths)
            assert not any(".local" in op for op in widths), (name, widths)
            assert "ld.global.u64" not in widths, (name, widths)  # every weight / activation load is 16 bytes


@needs_real_numba
def test_variant_registered() -> None:
    import kernels.warp_decode_numba as wdn
    from kernels.contract import Dims
    from kernels.variants import get_variant

    variant = get_variant("numba:warp-decode")
    assert variant.backend == "numba" and variant.reference_mode == "warp_decode"
    assert set(variant.grid) == {"warps", "rows", "unroll", "slots"}
    family = variant.kernel_family
    assert family is wdn.FAMILY and family.name == "warp-decode-numba" and family.source is None
    assert variant.source is None and family.defaults == wdn.DEFAULTS and variant.params == wdn.DEFAULTS
    assert family.offline_reports is wdn.offline_reports and family.simulate is wdn.simulator_selfcheck
    assert family.stages is wdn.stages and variant.build is wdn.build
    assert variant.resolve(Dims(3, 136, 48, 6, 2), rows=2) == {**wdn.DEFAULTS, "rows": 2}


@needs_real_numba
def test_argument_errors() -> None:
    from kernels.problem import make_problem
    from kernels.warp_decode_numba import warp_decode

    problem = make_problem("tiny", 2)
    with pytest.raises(TypeError, match="CuPy"):
        warp_decode(*problem.arrays)  # NumPy arrays off the simulator
    with pytest.raises(ValueError, match="topk_ids"):
        warp_decode(problem.x, problem.w13, problem.w2, problem.topk_ids[:, :1], problem.topk_weights)
    from kernels.warp_decode_numba import _check_params

    with pytest.raises(ValueError, match="rows"):
        _check_params(8, 3, 2)
    with pytest.raises(ValueError, match="warps"):
        _check_params(0, 1, 2)
    with pytest.raises(ValueError, match="slots"):
        _check_params(8, 1, 2, 0)
    with pytest.raises(ValueError, match="unroll"):
        _check_params(8, 1, 5)
    from kernels.warp_decode_numba import FAMILY

    with pytest.raises(TypeError, match="rows must be an int"):
        FAMILY.resolve(None, rows=2.0)
    with pytest.raises(ValueError, match="unknown"):
        FAMILY.resolve(None, outs=2)


def test_compare_is_the_one_checker() -> None:
    """``compare`` is ``kernels.checks.check_output`` under ``SIMULATOR`` against the warp_decode mode and fp64:
    the reference itself passes bitwise, a poison left or an output off by a few ulps of the RMS fails."""
    from kernels.checks import SIMULATOR, check_output
    from kernels.contract import BF16
    from kernels.problem import make_problem
    from kernels.reference import moe_decode
    from kernels.warp_decode_numba import compare

    problem = make_problem("tiny", 3, seed=4)
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    record = compare(faithful, problem)
    assert record == check_output(faithful, faithful, SIMULATOR, oracle=oracle)
    assert record["ok"] and record["bitwise_fraction"] == 1.0 and record["max_ulp"] == 0.0
    assert record["tolerance"] == "simulator" and record["rel_l2_fp64"] < SIMULATOR.max_rel_l2_fp64
    poisoned = faithful.copy()
    poisoned[1, 5] = np.nan
    assert not compare(poisoned, problem)["ok"] and not compare(poisoned, problem)["all_written"]
    rms = float(np.sqrt(np.mean(faithful.astype(np.float64) ** 2)))
    off = faithful.astype(np.float32)
    off[2, 7] += 0.5 * rms
    wrong = compare(off.astype(BF16), problem)
    assert not wrong["ok"] and wrong["max_ulp"] > SIMULATOR.max_ulp and wrong["why"].startswith("|got - ref|")
    f32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
    assert compare(f32, problem, np.float32)["ok"]


def test_simt_does_nothing_off_the_simulator() -> None:
    if SIMULATING:
        pytest.skip("needs a process without Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM unset)")
    from kernels import simt

    assert simt.install() == []


def test_simt_warp_barrier_holds_every_lane_and_breaks_on_a_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shuffles' barrier: no lane passes generation n before every lane has arrived at it (lanes that run ahead
    into n+1 included), and a lane that never arrives breaks it for the waiting lanes and later arrivals."""
    import threading

    from kernels import simt

    lanes, rounds = 8, 200
    barrier, arrived, seen = simt._WarpBarrier(lanes), [0] * lanes, []

    def lane(index: int) -> None:
        for n in range(rounds):
            arrived[index] = n + 1
            barrier.wait()
            seen.append(min(arrived) >= n + 1)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == lanes * rounds and all(seen) and barrier.generation == rounds

    monkeypatch.setattr(simt, "BARRIER_TIMEOUT_S", 0.05)
    lonely = simt._WarpBarrier(2)
    with pytest.raises(threading.BrokenBarrierError):
        lonely.wait()
    with pytest.raises(threading.BrokenBarrierError):
        lonely.wait()


# ---------------------------------------------------------------------------------------------------------
# GPU (the H200): PYTHONPATH=. python3 -m pytest -m gpu tests/test_warp_decode_numba.py
# ---------------------------------------------------------------------------------------------------------
PRESET_TOKENS = (1, 8, 64)
GPU_EXPERTS_CAP = 32  # T > 1 runs keep the real H, I, K but at most 32 experts: the host reference stays fast


def _run(problem, out_dtype=None, **knobs):
    import cupy

    from kernels.contract import BF16
    from kernels.warp_decode_numba import warp_decode

    out = cupy.full((problem.tokens, problem.shape.hidden), np.nan, out_dtype or BF16)
    workspace = cupy.full((problem.tokens, problem.shape.top_k, problem.shape.intermediate), np.nan, BF16)
    warp_decode(*problem.arrays, out=out, workspace=workspace, **knobs)
    cupy.cuda.runtime.deviceSynchronize()
    return out.get()


def _assert_close(result, problem, out_dtype=None):
    from kernels.contract import BF16
    from kernels.warp_decode_numba import compare

    assert np.all(np.isfinite(result.astype(np.float32))), "output not fully written (NaN poison left)"
    report = compare(result, problem, out_dtype or BF16)
    assert report["ok"], report
    if (out_dtype or BF16) == BF16:
        # long sums flip more roundings: 84% bitwise at qwen3-coder-480b (I = 2560) on the H200
        assert report["bitwise_fraction"] > 0.8, report
    return report


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-coder-480b-a35b", "qwen3-next-80b-a3b",
                                    "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b", "tiny"])
def test_gpu_presets(preset: str) -> None:
    import cupy

    from kernels.problem import make_problem
    from kernels.shapes import PRESETS

    shape = PRESETS[preset]
    for tokens in PRESET_TOKENS:
        run_shape = shape if tokens == 1 else shape.with_(experts=min(shape.experts, GPU_EXPERTS_CAP))
        problem = make_problem(run_shape, tokens, seed=tokens, xp=cupy)
        first = _run(problem)
        _assert_close(first, problem)
        if tokens == 8:  # bitwise identical over 3 runs
            for _ in range(2):
                assert np.array_equal(_run(problem).view(np.uint16), first.view(np.uint16))
        del problem
        cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "zipf", "same", "fixed"])
def test_gpu_routings(routing: str) -> None:
    import cupy

    from kernels.problem import make_problem

    shape = "qwen3-30b-a3b"
    ids = routing
    if routing == "fixed":  # duplicates: both slots of every token on expert 3, and 0 / 127 at the edges
        ids = np.tile(np.array([[3, 3, 0, 127, 5, 5, 5, 9]], np.int32), (8, 1))
    problem = make_problem(shape, 8, seed=11, routing=ids, xp=cupy)
    _assert_close(_run(problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hidden,inter,experts,top_k,tokens",
    [(8, 8, 1, 1, 1), (8, 8, 1, 1, 5), (40, 24, 3, 2, 4), (264, 16, 2, 1, 3), (2056, 776, 5, 3, 7),
     (64, 32, 48, 40, 3)],  # the last: K = 40 > 32 routed slots, many rounds of SLOTS
)
def test_gpu_odd_shapes(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> None:
    import cupy

    from kernels.problem import make_problem
    from kernels.shapes import MoEShape

    shape = MoEShape("odd", hidden, inter, experts, top_k)
    problem = make_problem(shape, tokens, seed=hidden, xp=cupy)
    knob_sets = ({}, {"rows": 8, "unroll": 1, "warps": 4, "slots": 1},
                 {"rows": 2, "unroll": 4, "warps": 16, "slots": 2})
    for knobs in knob_sets:
        _assert_close(_run(problem, **knobs), problem)


@pytest.mark.gpu
def test_gpu_float32_out_and_api_dispatch() -> None:
    import cupy

    import kernels
    from kernels.problem import make_problem

    problem = make_problem("qwen3-30b-a3b", 8, seed=3, xp=cupy)
    _assert_close(_run(problem, np.float32), problem, np.float32)
    out = kernels.warp_decode(*problem.arrays, backend="numba")
    _assert_close(out.get(), problem)


@pytest.mark.gpu
def test_gpu_bad_expert_ids_give_nan_rows() -> None:
    import cupy

    from kernels.contract import BF16, Dims
    from kernels.problem import make_problem
    from kernels.variants import get_variant

    problem = make_problem("tiny", 4, seed=5, xp=cupy)
    ids = problem.topk_ids.copy()
    ids[1, 0] = problem.shape.experts
    ids[3, 1] = -1
    launch = get_variant("numba:warp-decode").make(Dims(4, 136, 48, 6, 2))
    out = cupy.full((4, 136), np.nan, BF16)
    launch(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, out)  # no host-side id check
    cupy.cuda.runtime.deviceSynchronize()
    result = out.get().astype(np.float32)
    assert np.all(np.isnan(result[[1, 3]]))
    good = problem.to_numpy()
    good.tokens, good.x = 2, good.x[[0, 2]]
    good.topk_ids, good.topk_weights = good.topk_ids[[0, 2]], good.topk_weights[[0, 2]]
    _assert_close(result[[0, 2]].astype(BF16), good)


@pytest.mark.gpu
def test_gpu_variant_graph_capture_and_stages() -> None:
    import cupy

    from kernels.contract import BF16, Dims
    from kernels.family import Launch
    from kernels.problem import make_problem
    from kernels.variants import get_variant

    problem = make_problem("qwen3-30b-a3b", 8, seed=7, xp=cupy)
    dims = problem.shape
    variant = get_variant("numba:warp-decode")
    launch = variant.make(Dims(8, dims.hidden, dims.intermediate, dims.experts, dims.top_k))
    assert isinstance(launch, Launch) and launch.params == variant.resolve()
    assert launch.workspace.shape == (8, dims.top_k, dims.intermediate) and launch.workspace.dtype == BF16
    out = cupy.full((8, dims.hidden), np.nan, BF16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch(*problem.arrays, out)  # warm-up outside capture
        stream.synchronize()
        direct = out.get()
        out.fill(np.nan)
        stream.begin_capture()
        launch(*problem.arrays, out)
        graph = stream.end_capture()
        for _ in range(3):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(out.get().view(np.uint16), direct.view(np.uint16))
        out.fill(np.nan)
        names = []
        for name, run_stage in launch.stages(*problem.arrays, out):
            names.append(name)
            run_stage()
        stream.synchronize()
    assert names == ["gate_up", "down"]
    assert np.array_equal(out.get().view(np.uint16), direct.view(np.uint16))
    _assert_close(direct, problem)
