"""Numba strict warp decode on fp8-block128 weights (kernels/warp_decode_numba_fp8.py).

CPU: the real kernels on Numba's CUDA simulator (a fresh interpreter) against ``reference.moe_decode(mode=
"warp_decode", weight_format="fp8-block128")`` by the one output checker (``SIMULATOR``), partial scale blocks at
both edges, bad ids; the sm_90 compile without spills; the e4m3fn widening by integer moves over all 256 bytes.
GPU: the presets against the same reference, bitwise repeats and a CUDA-graph replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.formats import FP8, FP8_BLOCK128, Quantized, quantize_weights

REPO = Path(__file__).resolve().parents[1]
SIMULATING = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
needs_real_numba = pytest.mark.skipif(SIMULATING, reason="needs Numba's real CUDA target (no simulator)")

_SIM_SCRIPT = r"""
import json, os, sys
if hasattr(os, "sched_setaffinity"):  # one CPU: the simulator hands the GIL around (see the bf16 tests)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from kernels.warp_decode_numba_fp8 import FAMILY, simulate_bad_ids
cases, bad_ids = json.loads(sys.argv[1])
print(json.dumps({"cases": FAMILY.simulate(tuple(cases)), "bad_ids": simulate_bad_ids() if bad_ids else None}))
"""


def _simulate(cases: list[str], bad_ids: bool, timeout: int) -> dict:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _SIM_SCRIPT, json.dumps([cases, bad_ids])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_case_matches(case: dict) -> None:
    from kernels.checks import SIMULATOR

    assert case["tolerance"] == SIMULATOR.name and case["all_written"], case
    assert case["rel_l2_fp64"] < SIMULATOR.max_rel_l2_fp64 and case["max_ulp"] <= SIMULATOR.max_ulp, case
    assert case["ok"], case
    if case["out_dtype"] == "bfloat16":
        assert case["bitwise_fraction"] > 0.95, case


QUICK_SIM_CASE = "h264-same"


@pytest.fixture(scope="module")
def simulation() -> dict:
    """The quick subset's simulator process (its one case). The slow test runs every other case and the bad-id guard
    (~30 s more on 2 idle cores) in a process of its own, which a parallel run starts beside this one."""
    return _simulate([QUICK_SIM_CASE], bad_ids=False, timeout=300)


def test_simulator_smallest_case_matches_reference(simulation: dict) -> None:
    """The quick subset's case: H = 264, one expert, a second (partial) chunk round and a partial scale block."""
    case = simulation["cases"][0]
    assert case["case"] == QUICK_SIM_CASE
    _assert_case_matches(case)


@pytest.mark.slow
def test_simulator_kernels_match_reference_and_guard_bad_ids() -> None:
    from kernels.warp_decode_numba_fp8 import SIM_CASES

    rest = [name for name in SIM_CASES if name != QUICK_SIM_CASE]
    simulated = _simulate(rest, bad_ids=True, timeout=1800)
    assert [c["case"] for c in simulated["cases"]] == rest
    for case in simulated["cases"]:
        _assert_case_matches(case)
    bad = simulated["bad_ids"]
    assert bad["bad_rows_nan"] and bad["good_row_finite"] and bad["ok"], bad


def test_e4m3_widening_by_bit_moves_is_exact() -> None:
    """The kernels' widening -- the byte's bits moved into a float32, times 2**120 -- over all 256 bytes:
    every finite e4m3fn value (subnormals included) exactly, and NaN for 0x7F / 0xFF."""
    b = np.arange(256, dtype=np.uint32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    widened = bits.view(np.float32) * np.float32(2.0**120)
    widened[(b & 0x7F) == 0x7F] = np.nan
    want = b.astype(np.uint8).view(FP8).astype(np.float32)
    np.testing.assert_array_equal(widened.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(widened[np.isnan(want)]).all() and np.isnan(want).sum() == 2


@needs_real_numba
def test_offline_reports_no_spills_no_stack() -> None:
    from kernels.warp_decode_numba_fp8 import KERNEL_NAMES, offline_reports

    reports = offline_reports()
    assert {r.kernel for r in reports} == set(KERNEL_NAMES) and len(reports) == 4  # bf16 and float32 out
    for report in reports:
        assert report.spills == 0 and report.stack_bytes == 0, report
        assert 0 < report.registers <= 160, report


@needs_real_numba
def test_variant_registered_and_argument_errors() -> None:
    import kernels.warp_decode_numba_fp8 as wdnf
    from kernels.problem import make_problem
    from kernels.variants import get_variant

    variant = get_variant("numba:warp-decode-fp8")
    assert variant.backend == "numba" and variant.weight_format == "fp8-block128"
    assert variant.kernel_family is wdnf.FAMILY and variant.build is wdnf.build
    assert set(variant.grid) == set(wdnf.DEFAULTS)
    problem = make_problem("tiny", 2)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FP8_BLOCK128)
    with pytest.raises(TypeError, match="CuPy"):
        wdnf.warp_decode_fp8(problem.x, q13, q2, problem.topk_ids, problem.topk_weights)  # NumPy off the simulator
    with pytest.raises(TypeError, match="w13 must be fp8-block128 weights"):
        wdnf.warp_decode_fp8(*problem.arrays)
    with pytest.raises(ValueError, match="unknown"):
        wdnf.FAMILY.resolve(None, rows=2)
    with pytest.raises(ValueError, match="slots"):
        wdnf.FAMILY.resolve(None, slots=0)


# ---------------------------------------------------------------------------------------------------------
# GPU (the H200)
# ---------------------------------------------------------------------------------------------------------
def _device(cupy: Any, weights: Quantized) -> Quantized:
    return Quantized(cupy.asarray(weights.values.view(np.uint8)), cupy.asarray(weights.scales))


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"), [("qwen3-30b-a3b", 1, "uniform"), ("qwen3-30b-a3b", 8, "zipf"),
                                                          ("qwen3-235b-a22b", 4, "correlated"), ("tiny", 5, "same")])
def test_gpu_presets(model: str, tokens: int, routing: str) -> None:
    """Against the reference on the same FP8 weights (NaN-poisoned out and workspace), bitwise over a repeat and a
    CUDA-graph replay of the variant's launch."""
    import cupy

    from kernels.contract import BF16, Dims
    from kernels.problem import make_problem
    from kernels.shapes import get_shape
    from kernels.warp_decode_numba_fp8 import build, compare, warp_decode_fp8

    shape = get_shape(model)
    run_shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    problem = make_problem(run_shape, tokens, seed=tokens + 11, routing=routing)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FP8_BLOCK128)
    d13, d2 = _device(cupy, q13), _device(cupy, q2)
    x, ids, wts = (cupy.asarray(a) for a in (problem.x, problem.topk_ids, problem.topk_weights))

    def run() -> np.ndarray:
        out = cupy.full((tokens, shape.hidden), np.nan, BF16)
        workspace = cupy.full((tokens, shape.top_k, shape.intermediate), np.nan, BF16)
        warp_decode_fp8(x, d13, d2, ids, wts, out=out, workspace=workspace)
        cupy.cuda.runtime.deviceSynchronize()
        return out.get()

    first = run()
    report = compare(first, problem.x, q13, q2, problem.topk_ids, problem.topk_weights)
    assert report["ok"] and report["all_written"], report
    assert np.array_equal(run().view(np.uint16), first.view(np.uint16))
    launch = build(Dims(tokens, shape.hidden, shape.intermediate, run_shape.experts, shape.top_k))
    replay = cupy.full((tokens, shape.hidden), np.nan, BF16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch(x, d13, d2, ids, wts, replay)  # eager first: nothing compiles under capture
        stream.synchronize()
        replay.fill(np.nan)
        stream.begin_capture()
        launch(x, d13, d2, ids, wts, replay)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(replay.get().view(np.uint16), first.view(np.uint16))
