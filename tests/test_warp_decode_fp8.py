"""Strict warp decode on fp8-block128 weights (kernels/warp_decode_fp8.py).

CPU: the kernels' own CUDA C run through the g++ emulation against the reference on the same FP8 weights
(``weight_format="fp8-block128"``: warp decode's numerics on the dequantized weights, summed in the kernel's own
order), partial scale blocks at both edges, bad ids, and the sm_90 compile without spills. GPU: the same checks on
the presets, bitwise repeat and graph replay.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import warp_decode_fp8 as wdf
from kernels.contract import BF16, Dims
from kernels.formats import FP8_BLOCK128, Quantized, quantize_weights
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tests.warp_checks import (
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    WARP_LOCKSTEP_LAUNCH,
    _assert_matches,
    _poisoned_out,
    _seed,
    build_emulator,
    run_emulator,
)

FMT = "fp8-block128"

EMULATION_HARNESS = EMULATION_PRELUDE + r"""
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
#include "kernel.cu"
""" + WARP_LOCKSTEP_LAUNCH + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    int f32 = atoi(argv[6]);
    std::string dir = argv[7];
    const int hb = (H + 127) / 128, ib = (I + 127) / 128;
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    auto w13 = load<uint2>(dir + "/w13.bin", (size_t)E * 2 * I * H / 8);
    auto s13 = load<float>(dir + "/s13.bin", (size_t)E * 2 * ib * hb);
    auto w2 = load<uint2>(dir + "/w2.bin", (size_t)E * H * I / 8);
    auto s2 = load<float>(dir + "/s2.bin", (size_t)E * hb * ib);
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    auto wts = load<float>(dir + "/wts.bin", (size_t)T * K);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);
    std::vector<uint32_t> out((size_t)T * H, 0x7fc07fc0u);  // NaN poison in either view
    launch(((long long)T * K * I + GU_WARPS - 1) / GU_WARPS, GU_WARPS * 32,
           [&] { moe_gate_up_fp8(x.data(), w13.data(), s13.data(), ids.data(), inter.data(), T, H, I, E, K); });
    launch(((long long)T * H + DN_WARPS - 1) / DN_WARPS, DN_WARPS * 32, [&] {
        moe_down_fp8(inter.data(), w2.data(), s2.data(), ids.data(), wts.data(), out.data(), f32, T, H, I, E, K);
    });
    FILE* f = fopen((dir + "/out.bin").c_str(), "wb");
    fwrite(out.data(), 1, (size_t)T * H * (f32 ? 4 : 2), f);
    fclose(f);
    f = fopen((dir + "/inter.bin").c_str(), "wb");
    fwrite(inter.data(), 2, inter.size(), f);
    fclose(f);
    return 0;
}
"""


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


def _emulate(problem: Problem, q13: Quantized, q2: Quantized, ids: np.ndarray | None = None,
             out_dtype: Any = BF16, intermediate: bool = False, **params: int) -> Any:
    """The two kernels' CUDA C on the CPU; returns out [T, H] (``intermediate``: and the [T, K, I] bf16 bits)."""
    dims = _dims(problem)
    f32 = int(np.dtype(out_dtype) == np.float32)
    binary = build_emulator(wdf.SOURCE.render(**wdf.FAMILY.resolve(dims, **params)), EMULATION_HARNESS)
    with tempfile.TemporaryDirectory() as tmp:
        problem.x.tofile(f"{tmp}/x.bin")
        q13.values.view(np.uint8).tofile(f"{tmp}/w13.bin")
        q13.scales.tofile(f"{tmp}/s13.bin")
        q2.values.view(np.uint8).tofile(f"{tmp}/w2.bin")
        q2.scales.tofile(f"{tmp}/s2.bin")
        np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
        problem.topk_weights.tofile(f"{tmp}/wts.bin")
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k, f32, tmp)
        raw = np.fromfile(f"{tmp}/out.bin", np.float32 if f32 else np.uint16)
        inter = np.fromfile(f"{tmp}/inter.bin", np.uint16).reshape(dims.tokens, dims.top_k, dims.intermediate)
    out = raw.reshape(dims.tokens, dims.hidden) if f32 else raw.view(BF16).reshape(dims.tokens, dims.hidden)
    return (out, inter) if intermediate else out


def _fp8_references(problem: Problem, q13: Quantized, q2: Quantized, ids: np.ndarray | None = None,
                    out_dtype: Any = BF16) -> tuple[np.ndarray, np.ndarray]:
    args = (problem.x, q13, q2, problem.topk_ids if ids is None else ids, problem.topk_weights)
    return (moe_decode(*args, mode="warp_decode", weight_format=FMT, out_dtype=out_dtype),
            moe_decode(*args, mode="fp64", weight_format=FMT))


EMULATED = [  # (shape, T, routing, knobs, also fp32 out)
    ("tiny", 3, "uniform", {}, True),
    # partial scale blocks at both edges (H = 264, I = 200), duplicate ids in a token
    (MoEShape("h264-i200", 264, 200, 3, 2), 4, [[1, 1], [0, 2], [2, 0], [1, 2]], {"DN_SLOTS": 1, "GU_UNROLL": 1},
     False),
    (MoEShape("h136-k5", 136, 48, 6, 5), 2, "zipf", {"DN_SLOTS": 2, "DN_UNROLL": 1, "GU_WARPS": 3}, False),
    # 16-value chunks (16-byte loads) with partial scale blocks at both edges (H = I = 144), a short last round
    (MoEShape("h144-i144", 144, 144, 4, 3), 3, "zipf", {"GU_CHUNK": 16, "DN_CHUNK": 16, "DN_SLOTS": 2, "GU_UNROLL": 2},
     True),
]


@pytest.mark.parametrize(("shape", "tokens", "routing", "params", "fp32"), [
    pytest.param(*case, id=f"{getattr(case[0], 'name', case[0])}-T{case[1]}", marks=() if i == 0 else pytest.mark.slow)
    for i, case in enumerate(EMULATED)])
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any,
                                     params: dict[str, int], fp32: bool) -> None:
    """The kernels' text against the reference on the same FP8 weights (every product value x scale x activation
    in FP32, summed in the kernel's order), bf16 and fp32 outputs."""
    problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    got = _emulate(problem, q13, q2, **params)
    faithful, oracle = _fp8_references(problem, q13, q2)
    _assert_matches(got, faithful, oracle, f"fp8 emulated {problem.shape.name}", own_order=True)
    if fp32:
        got32 = _emulate(problem, q13, q2, out_dtype=np.float32, **params)
        faithful32, _ = _fp8_references(problem, q13, q2, out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, "fp8 emulated fp32 out", own_order=True)


@pytest.mark.slow
def test_bad_ids_emulated_on_cpu(rng: np.random.Generator) -> None:
    """Out-of-range ids reach the kernels (as under capture): those tokens' rows NaN, the others as the reference."""
    problem = make_problem("tiny", 4, seed=_seed(rng))
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    ids = problem.topk_ids.copy()
    ids[1, 0] = problem.shape.experts
    ids[3, 1] = -2
    got = _emulate(problem, q13, q2, ids=ids)
    assert np.all(np.isnan(got[[1, 3]].astype(np.float32)))
    good = [0, 2]
    sub = Problem(problem.shape, 2, 0, "fixed", problem.x[good], problem.w13, problem.w2, problem.topk_ids[good],
                  problem.topk_weights[good])
    faithful, oracle = _fp8_references(sub, q13, q2)
    _assert_matches(got[good], faithful, oracle, "fp8 emulated good tokens", own_order=True)


def test_offline_compile_without_spills() -> None:
    """Both kernels compile for sm_90 (the e4m3x2 conversion needs sm_89+) at the defaults and the knob corners,
    without spills or a stack frame -- except the auto rule's 8-slot down under its 128-register cap, measured
    faster with its small spill (L1-resident) than uncapped at 142 registers (kernels/warp_decode_fp8.py)."""
    from kernels.compile import offline_report

    qwen30_t1 = Dims(1, 2048, 768, 128, 8)
    assert wdf.FAMILY.resolve(qwen30_t1)["DN_SLOTS"] == 8 and wdf.FAMILY.resolve(qwen30_t1)["DN_MIN_BLOCKS"] == 4
    for knobs, spill_limit in (({}, 0), ({"GU_UNROLL": 8, "DN_SLOTS": 8, "DN_UNROLL": 1, "DN_MIN_BLOCKS": 1}, 0),
                               ({"GU_UNROLL": 1, "DN_SLOTS": 1}, 0),
                               ({"DN_SLOTS": 8}, wdf.ACCEPTED_SPILL_BYTES[wdf.DOWN]),
                               ({"GU_CHUNK": 16, "DN_CHUNK": 16, "DN_SLOTS": 4}, 0)):
        reports = offline_report(wdf.SOURCE, **wdf.FAMILY.resolve(None, **knobs))
        assert {r.kernel for r in reports} == {wdf.GATE_UP, wdf.DOWN}
        for r in reports:
            limit = spill_limit if r.kernel == wdf.DOWN else 0
            assert max(r.spill_stores, r.spill_loads, r.stack_bytes) <= limit, (knobs, r)


def test_chunk_knobs_refuse_what_they_cannot_cover() -> None:
    """16-value chunks need H (gate_up) or I (down) a multiple of 16; other chunk sizes are refused, naming the knob."""
    with pytest.raises(ValueError, match="GU_CHUNK 16 needs H"):
        wdf.FAMILY.resolve(Dims(1, 136, 48, 6, 5), GU_CHUNK=16)
    with pytest.raises(ValueError, match="DN_CHUNK 16 needs I"):
        wdf.FAMILY.resolve(Dims(1, 144, 40, 6, 5), DN_CHUNK=16)
    with pytest.raises(ValueError, match="GU_CHUNK must be 8 or 16"):
        wdf.FAMILY.resolve(None, GU_CHUNK=12)
    assert wdf.FAMILY.resolve(Dims(1, 144, 48, 6, 5), GU_CHUNK=16, DN_CHUNK=16)["DN_CHUNK"] == 16


def test_inputs_must_be_fp8_weights() -> None:
    """bf16 weights (or NumPy arrays) are refused before any device call, naming the argument."""
    problem = make_problem("tiny", 2, seed=1)
    with pytest.raises(TypeError, match="cupy"):
        wdf.warp_decode_fp8(*problem.arrays)


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------


def _device_fp8(cupy: Any, *weights: Quantized) -> tuple[Quantized, ...]:
    """Host fp8-block128 weights on the device (values as their uint8 bits)."""
    return tuple(Quantized(cupy.asarray(w.values.view(np.uint8)), cupy.asarray(w.scales)) for w in weights)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing", "knobs"), [
    ("qwen3-30b-a3b", 1, "uniform", {}), ("qwen3-30b-a3b", 8, "zipf", {}), ("qwen3-235b-a22b", 1, "uniform", {}),
    ("tiny", 5, "same", {}), ("qwen3-30b-a3b", 4, "zipf-2", {}), ("qwen3-30b-a3b", 6, "correlated", {}),
    (MoEShape("h2880-i360", 2880, 360, 16, 4), 3, [[1, 1, 2, 3], [0, 5, 5, 5], [15, 14, 13, 12]], {}),  # partial blocks
    ("qwen3-30b-a3b", 1, "uniform", {"GU_CHUNK": 16, "DN_CHUNK": 16}),  # 16-value chunks
    (MoEShape("h2880-i368", 2880, 368, 16, 4), 3, "zipf", {"GU_CHUNK": 16, "DN_CHUNK": 16, "DN_SLOTS": 4}),
])
def test_presets(cupy_mod: Any, rng: np.random.Generator, model: Any, tokens: int, routing: Any,
                 knobs: dict[str, int]) -> None:
    """Against the reference on the same FP8 weights (NaN-poisoned output), bitwise over a second run and a graph
    replay; with the chunk knobs too."""
    from kernels.shapes import get_shape

    shape = get_shape(model)  # at most 32 experts: the host quantizes and the reference reads them all
    problem = make_problem(shape.with_(experts=min(shape.experts, 32)), tokens, seed=_seed(rng), routing=routing)
    host13, host2 = quantize_weights(problem.w13, problem.w2, FMT)  # once, on the host
    q13, q2 = _device_fp8(cupy_mod, host13, host2)
    x, ids, wts = (cupy_mod.asarray(a) for a in (problem.x, problem.topk_ids, problem.topk_weights))
    out = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
    wdf.warp_decode_fp8(x, q13, q2, ids, wts, out=out, **knobs)
    cupy_mod.cuda.runtime.deviceSynchronize()
    got = cupy_mod.asnumpy(out)
    faithful, oracle = _fp8_references(problem, host13, host2)
    _assert_matches(got, faithful, oracle, f"fp8 {model} T={tokens} {routing}", own_order=True)
    again = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
    wdf.warp_decode_fp8(x, q13, q2, ids, wts, out=again, **knobs)
    cupy_mod.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy_mod.asnumpy(again).view(np.uint16), got.view(np.uint16))
    dims = _dims(problem)
    compiled = wdf.FAMILY.compile(dims, **knobs)
    stream = cupy_mod.cuda.Stream(non_blocking=True)
    replay = _poisoned_out(cupy_mod, tokens, problem.shape.hidden)
    with stream:
        compiled.run(x, q13, q2, ids, wts, replay)
        stream.synchronize()
        replay.view(cupy_mod.uint16).fill(0x7FC0)
        stream.begin_capture()
        compiled.run(x, q13, q2, ids, wts, replay)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cupy_mod.asnumpy(replay).view(np.uint16), got.view(np.uint16))


def test_format_bytes_are_what_the_kernels_read() -> None:
    """The bench divides by the format's bytes: values (1 byte each) and one float32 per 128 x 128 block."""
    assert FP8_BLOCK128.expert_bytes(4096, 1536) == 3 * 4096 * 1536 + 4 * (2 * 12 * 32 + 32 * 12)
