"""nvfp4 weights through the batched FMA family: one loader (kernels/batched/loaders_fp4.py ``NVFP4_FMA``) and the
per-expert global scale as the FMA kernels' last argument (``scale_geometry``'s ``globals``).

CPU: the family's text is the bf16 family's with the loader exchanged; the widening, compiled by g++ from the kernel
text, gives every (e2m1 code, e4m3 block scale) pair under several global scales -- 1, non-powers of two, subnormal,
huge, infinite, NaN -- bitwise the reference's dequantized float32, (value x block) x global, which folding the global
into the block scale would not give (its offline compile: tests/test_formats_fp4_kernels.py, with mxfp4's); the g++
emulation at odd shapes (partial 16-value scale blocks: k % 16 = 8) against
``reference.moe_decode(mode="warp_decode")`` on the same nvfp4 weights (the bf16 batched tests' tolerance), and, with
the global scales rounded to powers of two (the dequantized weights are then bf16s), BITWISE against the same family
on the dequantized weights stored as bf16; NaN block scales, an infinite global scale and bad ids.

GPU (``-m gpu``): presets against the reference on the same weights, bitwise over a repeat and a graph replay.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels.contract import BF16, Dims
from kernels.formats import NVFP4, quantize_weights
from kernels.formats_fp4 import E2M1_VALUES, E4M3_VALUES
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tests.test_formats_fp4_kernels import _dequantized_bf16 as dequantized_bf16
from tests.test_warp_decode_batched import EMULATION_HARNESS, _emulate
from tests.warp_checks import _assert_matches, _seed, build_emulator, run_emulator, slow_except

FMT = NVFP4.name
MODELS = ("qwen3-30b-a3b", "gpt-oss-120b")


def _nvfp4(problem: Problem, pow2_globals: bool = False) -> Problem:
    """The problem's weights as nvfp4; ``pow2_globals``: each global scale rounded to a power of two (the values and
    block scales as quantized), so that every dequantized weight is exact in bf16."""
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    if pow2_globals:
        q13, q2 = (dataclasses.replace(q, global_scale=np.exp2(np.round(np.log2(q.global_scale))).astype(np.float32))
                   for q in (q13, q2))
    return dataclasses.replace(problem, w13=q13, w2=q2)


def _dequantized_bf16(problem: Problem) -> Problem:
    return dequantized_bf16(problem, NVFP4)


# ---------------------------------------------------------------------------------------------------
# the widening, exhaustively (the loader's own functions, compiled from the family's text by g++)
# ---------------------------------------------------------------------------------------------------
GLOBALS = np.array([1.0, 0.0123456789, 3.0e-5, 7.7e-41, 1.0e30, 3.3e38, np.inf, np.nan, 1.0 / 3.0], np.float32)
WIDEN_MAIN = r"""
int main(int argc, char** argv) {
    std::string dir = argv[1];
    auto globals = load<float>(dir + "/globals.bin", (size_t)atoi(argv[2]));
    std::vector<uint8_t> scales(256);
    for (int s = 0; s < 256; ++s) scales[s] = (uint8_t)s;
    std::vector<float> out;  // [global][scale][byte][position][lo, hi]
    for (float g : globals) {
        const scale_row_t row = {scales.data(), g};
        for (int s = 0; s < 256; ++s) {
            const chunk_scale_t scale = chunk_scale<16>(row, 2 * s, true);  // 8 values a chunk: block 2s * 8 / 16
            for (int b = 0; b < 256; ++b)
                for (int w = 0; w < 4; ++w) {                                // the byte's place in the 4-byte chunk
                    float lo, hi;
                    weight_pair((u32)b << (8 * w), w, scale, lo, hi);
                    out.push_back(lo);
                    out.push_back(hi);
                }
        }
    }
    const scale_row_t past = {scales.data() + 9, 2.0f};
    const chunk_scale_t end = chunk_scale<16>(past, 1000, false);          // past the row: block 0's scale
    out.push_back(bf16_lo(end.block2));
    out.push_back(end.global);
    FILE* f = fopen((dir + "/widened.bin").c_str(), "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
    return 0;
}
"""


def test_widening_is_the_references_dequantization_bitwise() -> None:
    """Every e2m1 code at every byte position and nibble, times every e4m3 block scale (subnormals, 0x7f / 0xff NaN,
    negative bytes), times each of :data:`GLOBALS`: bitwise the reference's float32 (value x block) x global
    (``formats_fp4.dequantize_rows``) -- rounded once, subnormal and infinite products, NaN included -- where
    value x (block x global), the folded form, differs."""
    family = batched.family("fma", FMT)
    harness = EMULATION_HARNESS[: EMULATION_HARNESS.index("int main(")] + WIDEN_MAIN
    binary = build_emulator(family.source.render(**family.resolve()), harness)
    with tempfile.TemporaryDirectory() as tmp:
        GLOBALS.tofile(f"{tmp}/globals.bin")
        run_emulator(binary, tmp, len(GLOBALS))
        got = np.fromfile(f"{tmp}/widened.bin", np.float32)
    assert got[-2] == E4M3_VALUES[9] and got[-1] == 2.0
    got = got[:-2].reshape(len(GLOBALS), 256, 256, 4, 2)
    byte = np.arange(256)
    values = np.stack([E2M1_VALUES[byte & 15], E2M1_VALUES[byte >> 4]], axis=-1)  # [byte, lo / hi]
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        exact = (values[None] * E4M3_VALUES[:, None, None]).astype(np.float32)  # [scale, byte, lo / hi]: exact
        want = (exact[None] * GLOBALS[:, None, None, None]).astype(np.float32)
        folded = (values[None, None] * (E4M3_VALUES[None, :] * GLOBALS[:, None])[:, :, None, None]).astype(np.float32)
    want = np.broadcast_to(want[:, :, :, None, :], got.shape)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan[GLOBALS.tolist().index(1.0), 0x7F].all()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()  # both edges hit
    fin = np.isfinite(want[:, :, :, 0]) & np.isfinite(folded)
    assert (want[:, :, :, 0][fin] != folded[fin]).any()  # the order matters, and the test tells the two apart


# ---------------------------------------------------------------------------------------------------
# the g++ emulation
# ---------------------------------------------------------------------------------------------------
MULTI_SHAPE = MoEShape("h200-i136", 200, 136, 5, 3)  # k % 16 = 8 along both: a partial last scale block
SHAPE_48 = MoEShape("h208-i40", 208, 40, 6, 2)  # H % 16 = 0, I % 16 = 8
DUPLICATES = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]]
EMULATED = [  # (shape, T, routing, knobs, also fp32 out); tiny: H 136 = 8 x 16 + 8
    ("tiny", 3, "uniform", {}, True),
    ("tiny", 6, DUPLICATES, {"GB_TILE": 1, "DB_TILE": 1}, False),
    (MULTI_SHAPE, 9, "zipf", {"GB_OUTS": 3, "DB_OUTS": 3, "DB_WARPS": 3}, True),
    (SHAPE_48, 6, "same", {"GB_TILE": 2, "DB_TILE": 3, "GB_UNROLL": 1, "DB_UNROLL": 2}, False),
    (MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {}, False),  # one chunk a row, half a block
]
EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0}))
def test_emulated_against_the_reference_and_the_dequantized_bf16_path(
        rng: np.random.Generator, shape: Any, tokens: int, routing: Any, knobs: dict[str, int], fp32: bool) -> None:
    """The family's CUDA C on nvfp4 weights (NaN-poisoned out and intermediate): within the bf16 batched tests'
    tolerance of the reference on the same weights (the quantizer's global scales: the weights are float32s, not
    bf16s); with the globals rounded to powers of two, also bitwise what the bf16 family (GB_BYTES 16: the same lane
    map) gives on the dequantized weights -- the loader changes the weights' storage, nothing else."""
    seed = _seed(rng)
    for pow2 in (False, True):
        problem = _nvfp4(make_problem(shape, tokens, seed=seed, routing=routing), pow2_globals=pow2)
        got = _emulate(problem, path="fma", **knobs)
        assert got["params"]["GB_BYTES"] == 16
        faithful = moe_decode(*problem.arrays, mode="warp_decode")
        oracle = moe_decode(*problem.arrays, mode="fp64")
        _assert_matches(got["out"], faithful, oracle, f"emulated nvfp4 {problem.shape.name} {knobs} pow2 {pow2}")
        if pow2:
            bf16 = _emulate(_dequantized_bf16(problem), path="fma", **{"GB_BYTES": 16, **knobs})
            assert np.array_equal(got["inter"], bf16["inter"])
            assert np.array_equal(got["out"].view(np.uint16), bf16["out"].view(np.uint16))
        if fp32:
            got32 = _emulate(problem, out_dtype=np.float32, path="fma", **knobs)["out"]
            faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
            _assert_matches(got32, faithful32, oracle, f"emulated nvfp4 fp32 out {problem.shape.name}")


def test_emulated_global_scales_are_per_expert_and_per_matrix(rng: np.random.Generator) -> None:
    """Each expert's w13 and w2 global scales, exchanged for other powers of two (2^-6 .. 2^6, w13's and w2's
    different): the emulated layer stays bitwise the bf16 family on the dequantized weights -- the kernels read
    expert e's global for e's rows of each matrix, not another expert's or the other matrix's."""
    problem = _nvfp4(make_problem(MULTI_SHAPE, 7, seed=_seed(rng), routing="uniform"), pow2_globals=True)
    experts = problem.shape.experts
    g13 = np.exp2(rng.permutation(np.arange(-6, 7))[:experts]).astype(np.float32)
    g2 = np.exp2(rng.permutation(np.arange(-6, 7))[:experts]).astype(np.float32)
    problem = dataclasses.replace(problem, w13=dataclasses.replace(problem.w13, global_scale=g13),
                                  w2=dataclasses.replace(problem.w2, global_scale=g2))
    got = _emulate(problem, path="fma")
    bf16 = _emulate(_dequantized_bf16(problem), path="fma", GB_BYTES=16)
    assert np.array_equal(got["inter"], bf16["inter"])
    assert np.array_equal(got["out"].view(np.uint16), bf16["out"].view(np.uint16))


def test_emulated_nan_scales_inf_global_and_bad_ids(rng: np.random.Generator) -> None:
    """An e4m3 NaN (0x7f) in one gate block of expert e, and an infinite w2 global scale of expert f: exactly the
    reference's outputs are NaN (the tokens routed to e or f: inf x the zeros among f's weights is NaN); an id outside
    [0, E) makes its token's row NaN; the rest matches the reference."""
    problem = _nvfp4(make_problem("tiny", 6, seed=_seed(rng)))
    expert = int(problem.topk_ids[1, 0])
    other = next(int(e) for e in problem.topk_ids.ravel() if e != expert)
    scales = problem.w13.scales.copy()
    scales[expert, 3, 1] = 0x7F
    g2 = problem.w2.global_scale.copy()
    g2[other] = np.inf
    problem = dataclasses.replace(problem, w13=dataclasses.replace(problem.w13, scales=scales),
                                  w2=dataclasses.replace(problem.w2, global_scale=g2))
    ids = problem.topk_ids.copy()
    bad = next((t for t in range(problem.tokens) if expert not in ids[t] and other not in ids[t]), None)
    if bad is None:
        bad = 0
    ids[bad, 1] = problem.shape.experts
    got = _emulate(problem, ids=ids, path="fma")["out"].astype(np.float32)
    checked = dataclasses.replace(problem, topk_ids=ids)
    poisoned = {t for t in range(problem.tokens) if expert in ids[t] or other in ids[t]}
    nan_tokens = {bad} | poisoned
    want = moe_decode(*dataclasses.replace(checked, topk_ids=np.where(ids < problem.shape.experts, ids, 0)).arrays,
                      mode="warp_decode").astype(np.float32)
    assert np.isnan(want[sorted(poisoned)]).all(axis=1).all()  # the reference's too
    assert set(np.flatnonzero(np.isnan(got).all(axis=1))) == nan_tokens
    assert not np.isnan(np.delete(got, sorted(nan_tokens), axis=0)).any()
    good = [t for t in range(problem.tokens) if t not in nan_tokens]
    if good:
        clean = dataclasses.replace(checked, topk_ids=problem.topk_ids[good], topk_weights=problem.topk_weights[good],
                                    x=problem.x[good], tokens=len(good))
        faithful = moe_decode(*clean.arrays, mode="warp_decode")
        oracle = moe_decode(*clean.arrays, mode="fp64")
        _assert_matches(got[good].astype(BF16), faithful, oracle, "nan scales: the clean tokens")


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
GPU_CASES = [(model, t, routing) for model in MODELS for t, routing in ((1, "uniform"), (8, "zipf"), (64, "uniform"))]
GPU_CASES += [(MULTI_SHAPE, 9, "zipf"), ("tiny", 5, "same")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"), GPU_CASES)
def test_gpu_nvfp4_fma(model: Any, tokens: int, routing: Any) -> None:
    """Against the reference on the same nvfp4 weights (NaN-poisoned out), bitwise over a repeat and a CUDA-graph
    replay."""
    import cupy

    from kernels.shapes import get_shape
    from tests.test_formats_fp4_kernels import _run
    from tests.warp_checks import assert_graph_replays_bitwise

    shape = get_shape(model)
    shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _nvfp4(make_problem(shape, tokens, seed=tokens + 7, routing=routing))
    device = host.to_cupy()
    first = _run(cupy, device)
    faithful = moe_decode(*host.arrays, mode="warp_decode")
    oracle = moe_decode(*host.arrays, mode="fp64")
    _assert_matches(first, faithful, oracle, f"nvfp4 fma {shape.name} T={tokens}")
    assert np.array_equal(_run(cupy, device).view(np.uint16), first.view(np.uint16))
    dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    ws = batched.make_workspace(dims, "fma", FMT)

    def launch(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> None:
        batched.warp_decode_batched(x, w13, w2, ids, weights, out=out, workspace=ws, path="fma")

    assert_graph_replays_bitwise(cupy, launch, device, first)
