"""mxfp4 weights through the batched FMA family: one loader (kernels/batched/loaders_fp4.py ``MXFP4_FMA``), no kernel
edit.

CPU: the family's text is the bf16 family's with the loader exchanged; the widening, compiled by g++ from the kernel
text, gives every (e2m1 code, e8m0 scale) pair bitwise the reference's dequantized float32 (NaN scales NaN); the
offline compile for sm_90 at qwen3-30b-a3b and gpt-oss-120b shapes (H = I = 2880: 90 scale blocks a row) at T = 1 to
64 without spills or stack; the g++ emulation at odd shapes (partial 32-value scale blocks: k % 32 = 8, 16) against
``reference.moe_decode(mode="warp_decode")`` on the same mxfp4 weights (the bf16 batched tests' tolerance), and
BITWISE against the same family on the dequantized weights stored as bf16 (the same lane map and FMA order on the same
weights), NaN-poisoned outputs and intermediate (the harness's), NaN scales and bad ids.

GPU (``-m gpu``): presets and odd shapes against the reference on the same weights, poisoned outputs, bitwise the bf16
family on the dequantized weights, bitwise over a repeat and a graph replay.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels.batched import fma, loaders, loaders_fp4
from kernels.contract import BF16, Dims
from kernels.formats import MXFP4, NVFP4, quantize_weights
from kernels.formats_fp4 import E2M1_VALUES, E8M0_VALUES
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS, MoEShape
from tests.test_warp_decode_batched import EMULATION_HARNESS, _emulate
from tests.warp_checks import _assert_matches, _seed, build_emulator, run_emulator, slow_except

FMT = MXFP4.name
MODELS = ("qwen3-30b-a3b", "gpt-oss-120b")


def _mxfp4(problem: Problem) -> Problem:
    q13, q2 = quantize_weights(problem.w13, problem.w2, FMT)
    return dataclasses.replace(problem, w13=q13, w2=q2)


def _dequantized_bf16(problem: Problem, fmt: Any = MXFP4) -> Problem:
    """The 4-bit problem with its weights dequantized and stored as bf16 (exact, asserted: mxfp4's always are, nvfp4's
    with power-of-two global scales)."""
    w13, w2 = (fmt.dequantize(getattr(problem, name), name) for name in ("w13", "w2"))
    as_bf16 = [w.astype(BF16) for w in (w13, w2)]
    for w, b in zip((w13, w2), as_bf16, strict=True):
        assert np.array_equal(b.astype(np.float32), w)  # the premise: no rounding
    return dataclasses.replace(problem, w13=as_bf16[0], w2=as_bf16[1])


# ---------------------------------------------------------------------------------------------------
# the family and its rules
# ---------------------------------------------------------------------------------------------------
FOUR_BIT = [(MXFP4, "MXFP4_FMA"), (NVFP4, "NVFP4_FMA")]


@pytest.mark.parametrize(("fmt", "loader"), FOUR_BIT, ids=["mxfp4", "nvfp4"])
def test_the_4bit_family_is_the_bf16_family_with_its_loader(fmt: Any, loader: str) -> None:
    family = batched.family("fma", fmt.name)
    reference = batched.family("fma", "bf16")
    assert family.name == f"warp-decode-batched[{fmt.name}]" and fmt.name in fma.FMA.families
    assert family.source.code == reference.source.code.replace(loaders.loader_for("bf16", "fma"),
                                                               getattr(loaders_fp4, loader))


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
def test_4bit_chunks_are_8_values(fmt: Any) -> None:
    """GB_BYTES 16 by default (8 values, a 4-byte weight load, inside one 32- or 16-value scale block); narrower
    activation chunks are refused (their weights would be under 4 bytes)."""
    family = batched.family("fma", fmt.name)
    assert family.resolve()["GB_BYTES"] == 16 and family.resolve()["DB_BYTES"] == 16
    assert batched.family("fma", "bf16").resolve()["GB_BYTES"] == 8  # the other formats' defaults stand
    for narrow in (4, 8):
        with pytest.raises(ValueError, match="GB_BYTES must be 16, got"):
            family.resolve(None, GB_BYTES=narrow)


# ---------------------------------------------------------------------------------------------------
# the widening, exhaustively (the loader's own functions, compiled from the family's text by g++)
# ---------------------------------------------------------------------------------------------------
WIDEN_MAIN = r"""
int main(int argc, char** argv) {
    std::string dir = argv[1];
    std::vector<uint8_t> scales(256);
    for (int s = 0; s < 256; ++s) scales[s] = (uint8_t)s;
    std::vector<float> out;  // [scale][byte][position][lo, hi]
    for (int s = 0; s < 256; ++s) {
        const chunk_scale_t scale = chunk_scale<16>(scales.data(), 4 * s, true);  // 8 values a chunk: block 4s * 8 / 32
        for (int b = 0; b < 256; ++b)
            for (int w = 0; w < 4; ++w) {                                  // the byte's place in the 4-byte chunk
                float lo, hi;
                weight_pair((u32)b << (8 * w), w, scale, lo, hi);
                out.push_back(lo);
                out.push_back(hi);
            }
    }
    out.push_back(bf16_lo(chunk_scale<16>(scales.data() + 7, 1000, false)));  // past the row: block 0's scale
    FILE* f = fopen((dir + "/widened.bin").c_str(), "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
    return 0;
}
"""


def test_widening_is_the_references_dequantization_bitwise() -> None:
    """Every e2m1 code at every byte position and nibble, times every e8m0 scale (0: 2^-127, a subnormal; 255: NaN),
    as the loader widens it: bitwise the reference's float32 value x scale -- subnormal products, overflows to
    infinity and NaN included."""
    family = batched.family("fma", FMT)
    harness = EMULATION_HARNESS[: EMULATION_HARNESS.index("int main(")] + WIDEN_MAIN
    binary = build_emulator(family.source.render(**family.resolve()), harness)
    with tempfile.TemporaryDirectory() as tmp:
        run_emulator(binary, tmp)
        got = np.fromfile(f"{tmp}/widened.bin", np.float32)
    assert got[-1] == E8M0_VALUES[7]
    got = got[:-1].reshape(256, 256, 4, 2)
    byte = np.arange(256)
    want = np.stack([E2M1_VALUES[byte & 15], E2M1_VALUES[byte >> 4]], axis=-1)  # [byte, lo / hi]
    with np.errstate(over="ignore", invalid="ignore"):
        want = (want[None] * E8M0_VALUES[:, None, None]).astype(np.float32)  # [scale, byte, lo / hi]
    want = np.broadcast_to(want[:, :, None, :], got.shape)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan[255].all() and not nan[:255].any()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()  # both edges hit


# ---------------------------------------------------------------------------------------------------
# offline compile (sm_90): no spills at the presets
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=["mxfp4", "nvfp4"])
def test_offline_compile_at_the_presets_without_spills(fmt: Any) -> None:
    """qwen3-30b-a3b (H 2048, I 768) and gpt-oss-120b (H = I = 2880) at T = 1, 4, 16, 64 and the dims-free defaults:
    zero spills, zero stack, within the register caps (128; nvfp4's down 160, where 128 spills at the dims-free
    defaults). Two compiles at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    family = batched.family("fma", fmt.name)
    cases = [family.resolve()]
    for model in MODELS:
        s = PRESETS[model]
        cases += [family.resolve(Dims(t, s.hidden, s.intermediate, s.experts, s.top_k)) for t in (1, 4, 16, 64)]
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda params: offline_report(family.source, **params), cases))
    for params, kernels in zip(cases, reports, strict=True):
        assert {r.kernel for r in kernels} == set(fma.KERNELS)
        for r in kernels:
            assert r.spills == 0 and r.stack_bytes == 0, (params, r)
            cap = params["GB_MAX_REGS"] if r.kernel == fma.GATE_UP else params["DB_MAX_REGS"]
            assert r.registers <= (cap if r.kernel in (fma.GATE_UP, fma.DOWN) else 128), (params, r)
    assert fmt is NVFP4 or all(params["GB_MAX_REGS"] == params["DB_MAX_REGS"] == 128 for params in cases)


# ---------------------------------------------------------------------------------------------------
# the g++ emulation
# ---------------------------------------------------------------------------------------------------
MULTI_SHAPE = MoEShape("h200-i136", 200, 136, 5, 3)  # k % 32 = 8 along both: a partial last scale block
SHAPE_48 = MoEShape("h208-i48", 208, 48, 6, 2)  # k % 32 = 16
DUPLICATES = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]]
EMULATED = [  # (shape, T, routing, knobs, also fp32 out); tiny: H 136 = 4 x 32 + 8
    ("tiny", 3, "uniform", {}, True),
    ("tiny", 6, DUPLICATES, {"GB_TILE": 1, "DB_TILE": 1}, False),
    (MULTI_SHAPE, 9, "zipf", {"GB_OUTS": 3, "DB_OUTS": 3, "DB_WARPS": 3}, True),
    (SHAPE_48, 6, "same", {"GB_TILE": 2, "DB_TILE": 3, "GB_UNROLL": 1, "DB_UNROLL": 2}, False),
    (MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {}, False),  # one chunk a row
    (MoEShape("h64-k40", 64, 24, 44, 40), 2, "uniform", {"GB_OUTS": 4}, False),
]
EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "routing", "knobs", "fp32"),
                         slow_except(EMULATED, EMULATED_IDS, {0}))
def test_emulated_against_the_reference_and_the_dequantized_bf16_path(
        rng: np.random.Generator, shape: Any, tokens: int, routing: Any, knobs: dict[str, int], fp32: bool) -> None:
    """The family's CUDA C on mxfp4 weights (NaN-poisoned out and intermediate): within the bf16 batched tests'
    tolerance of the reference on the same weights, and bitwise what the bf16 family (GB_BYTES 16: the same lane
    map) gives on the dequantized weights -- the loader changes the weights' storage, nothing else."""
    problem = _mxfp4(make_problem(shape, tokens, seed=_seed(rng), routing=routing))
    got = _emulate(problem, path="fma", **knobs)
    assert got["params"]["GB_BYTES"] == 16
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    _assert_matches(got["out"], faithful, oracle, f"emulated mxfp4 {problem.shape.name} {knobs}")
    bf16 = _emulate(_dequantized_bf16(problem), path="fma", **{"GB_BYTES": 16, **knobs})
    assert np.array_equal(got["inter"], bf16["inter"])
    assert np.array_equal(got["out"].view(np.uint16), bf16["out"].view(np.uint16))
    if fp32:
        got32 = _emulate(problem, out_dtype=np.float32, path="fma", **knobs)["out"]
        faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, f"emulated mxfp4 fp32 out {problem.shape.name}")


@pytest.mark.slow
def test_emulated_extreme_scales(rng: np.random.Generator) -> None:
    """Scales at both ends of e8m0 through the whole layer, finite: w13's block column 1 at 2^123 (x zero there: the
    widened weights meet zeros), column 2 at 2^-127 .. 2^-124 (subnormal weights; x there x 2^100, so that their
    products count), the rest 2^-12 .. 2^8 (scales above 2 included); w2's at 2^-20 .. 2^8 and a few subnormal
    blocks. Random codes. Against the reference on the same weights."""
    problem = _mxfp4(make_problem(MULTI_SHAPE, 5, seed=_seed(rng), routing="zipf"))
    q13, q2 = problem.w13, problem.w2
    s13 = rng.integers(115, 136, q13.scales.shape, dtype=np.uint8)
    s13[:, :, 1] = 250
    s13[:, :, 2] = rng.integers(0, 4, s13[:, :, 2].shape, dtype=np.uint8)
    s2 = rng.integers(107, 136, q2.scales.shape, dtype=np.uint8)
    s2[:, ::7, 0] = 0
    w13 = dataclasses.replace(q13, values=rng.integers(0, 256, q13.values.shape, dtype=np.uint8), scales=s13)
    w2 = dataclasses.replace(q2, values=rng.integers(0, 256, q2.values.shape, dtype=np.uint8), scales=s2)
    x = problem.x.astype(np.float32)
    x[:, 32:64] = 0
    x[:, 64:96] *= np.float32(2.0**100)
    problem = dataclasses.replace(problem, x=x.astype(BF16), w13=w13, w2=w2)
    got = _emulate(problem, path="fma")
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    assert np.isfinite(faithful.astype(np.float32)).all()
    _assert_matches(got["out"], faithful, oracle, "extreme scales")
    bf16 = _emulate(_dequantized_bf16(problem), path="fma", GB_BYTES=16)
    assert np.array_equal(got["out"].view(np.uint16), bf16["out"].view(np.uint16))


def test_emulated_nan_scales_and_bad_ids(rng: np.random.Generator) -> None:
    """An e8m0 NaN (255) in one gate block of expert e makes exactly the reference's outputs NaN (the tokens routed
    to e); an id outside [0, E) makes its token's row NaN; the rest matches the reference."""
    problem = _mxfp4(make_problem("tiny", 5, seed=_seed(rng)))
    expert = int(problem.topk_ids[1, 0])
    scales = problem.w13.scales.copy()
    scales[expert, 3, 1] = 255
    problem = dataclasses.replace(problem, w13=dataclasses.replace(problem.w13, scales=scales))
    ids = problem.topk_ids.copy()
    bad = next(t for t in range(problem.tokens) if expert not in ids[t])
    ids[bad, 1] = problem.shape.experts
    got = _emulate(problem, ids=ids, path="fma")["out"].astype(np.float32)
    checked = dataclasses.replace(problem, topk_ids=ids)
    nan_tokens = {bad} | {t for t in range(problem.tokens) if expert in ids[t]}
    assert set(np.flatnonzero(np.isnan(got).all(axis=1))) == nan_tokens
    assert not np.isnan(np.delete(got, sorted(nan_tokens), axis=0)).any()
    good = [t for t in range(problem.tokens) if t not in nan_tokens]
    clean = dataclasses.replace(checked, topk_ids=problem.topk_ids[good], topk_weights=problem.topk_weights[good],
                                x=problem.x[good], tokens=len(good))
    faithful = moe_decode(*clean.arrays, mode="warp_decode")
    oracle = moe_decode(*clean.arrays, mode="fp64")
    _assert_matches(got[good].astype(BF16), faithful, oracle, "nan scales: the clean tokens")


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
def _run(cupy: Any, problem: Problem, **knobs: Any) -> np.ndarray:
    """One FMA layer into a NaN-poisoned out (and intermediate)."""
    from tests.warp_checks import _poisoned_out

    s = problem.shape
    dims = Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)
    from kernels.formats import format_of

    fmt = format_of(problem.w13)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    ws = batched.make_workspace(dims, "fma", fmt, **knobs)
    ws.intermediate.view(cupy.uint16).fill(0x7FC0)
    batched.warp_decode_batched(*problem.arrays, out=out, workspace=ws, path="fma", **knobs)
    cupy.cuda.runtime.deviceSynchronize()
    return out.get()


GPU_CASES = [(model, t, routing) for model in MODELS for t, routing in ((1, "uniform"), (8, "zipf"), (64, "uniform"))]
GPU_CASES += [(MULTI_SHAPE, 9, "zipf"), (SHAPE_48, 6, DUPLICATES), ("tiny", 5, "same")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "tokens", "routing"), GPU_CASES)
def test_gpu_mxfp4_fma(model: Any, tokens: int, routing: Any) -> None:
    """Against the reference on the same mxfp4 weights (NaN-poisoned out), bitwise the bf16 family on the dequantized
    weights, bitwise over a repeat and a CUDA-graph replay."""
    import cupy

    from kernels.shapes import get_shape
    from tests.warp_checks import assert_graph_replays_bitwise

    shape = get_shape(model)
    shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = _mxfp4(make_problem(shape, tokens, seed=tokens + 7, routing=routing))
    device = host.to_cupy()
    first = _run(cupy, device)
    faithful = moe_decode(*host.arrays, mode="warp_decode")
    oracle = moe_decode(*host.arrays, mode="fp64")
    _assert_matches(first, faithful, oracle, f"mxfp4 fma {shape.name} T={tokens}")
    assert np.array_equal(_run(cupy, device).view(np.uint16), first.view(np.uint16))
    bf16 = _run(cupy, _dequantized_bf16(host).to_cupy(), GB_BYTES=16)
    assert np.array_equal(bf16.view(np.uint16), first.view(np.uint16))
    dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    ws = batched.make_workspace(dims, "fma", FMT)

    def launch(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> None:
        batched.warp_decode_batched(x, w13, w2, ids, weights, out=out, workspace=ws, path="fma")

    assert_graph_replays_bitwise(cupy, launch, device, first)
