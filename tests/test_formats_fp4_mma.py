"""mxfp4 and nvfp4 weights through the tensor-core and per-pair families: one loader each
(kernels/batched/loaders_fp4.py ``MXFP4_MMA``, ``NVFP4_MMA``).

The loaders scale each lane's A values by their block scales before the mma, so each A fragment is value x block
scale in bf16, exactly; nvfp4's global scale multiplies each kernel's finished dot. CPU: the families' text is the bf16
families' with the loader exchanged; the widening over every (e2m1 byte, block scale byte), compiled by g++ from the
kernel text, is bitwise the exact product as bf16 (NaN scales NaN, mxfp4's overflows infinite and 2^-127 scales
subnormal); FP4_HALVES per dims; the offline compile for sm_90 at qwen3-30b-a3b and gpt-oss-120b without spills; the
g++ emulation against ``reference.moe_decode(mode="warp_decode")`` on the same weights (the tensor-core tolerance),
with 32-, 16- and 8-value loads, the balanced and the grouped downs, split chains, hot tiles, bad ids -- and, with one
chunk a load (FP4_HALVES 1: the bf16 families' k order) and nvfp4's global scales rounded to powers of two, BITWISE
the bf16 families on the dequantized weights; the batch-invariant pair's forms agree. GPU (``-m gpu``): presets and
routings against the reference, poisoned outputs, bitwise repeats, the variant's launch and a graph replay.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels.batched import loaders, loaders_fp4, mma, pairs
from kernels.contract import BF16, Dims
from kernels.formats import MXFP4, NVFP4, Fp4Format, quantize_weights
from kernels.formats_fp4 import E2M1_VALUES, E4M3_VALUES, E8M0_VALUES
from kernels.numerics import bf16_to_f32
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS, MoEShape
from tests.test_formats_fp4_kernels import _dequantized_bf16
from tests.test_warp_decode_batched import EMULATION_HARNESS, _emulate
from tests.warp_checks import _assert_matches, _poisoned_out, _seed, build_emulator, run_emulator, slow_except

FOUR_BIT = [pytest.param(MXFP4, id="mxfp4"), pytest.param(NVFP4, id="nvfp4")]
MODELS = ("qwen3-30b-a3b", "gpt-oss-120b")
FAMILY_KNOBS = {"mma": mma.KNOBS, "pairs": pairs.KNOBS}


def _mxfp4(problem: Problem, fmt: Fp4Format = MXFP4) -> Problem:
    """The problem's weights in ``fmt`` (nvfp4: each global scale rounded to a power of two, so that the dequantized
    weights are bf16s and the bitwise comparisons with the bf16 families hold)."""
    q13, q2 = quantize_weights(problem.w13, problem.w2, fmt.name)
    if fmt.global_scaled:
        q13, q2 = (dataclasses.replace(q, global_scale=np.exp2(np.round(np.log2(q.global_scale))).astype(np.float32))
                   for q in (q13, q2))
    return dataclasses.replace(problem, w13=q13, w2=q2)


def _dims(problem: Problem) -> Dims:
    s = problem.shape
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)


# ---------------------------------------------------------------------------------------------------
# the families and their rules
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FOUR_BIT)
@pytest.mark.parametrize("path", ["mma", "pairs"])
def test_the_families_are_the_bf16_ones_with_the_loader(path: str, fmt: Fp4Format) -> None:
    family, reference = batched.family(path, fmt.name), batched.family(path, "bf16")
    text = loaders_fp4.MXFP4_MMA if fmt is MXFP4 else loaders_fp4.NVFP4_MMA
    assert family.source.code == reference.source.code.replace(loaders.loader_for("bf16", "mma"),
                                                               text + loaders.ROW_ADDRESSING)


def test_loads_and_rules() -> None:
    """FP4_HALVES: 4 chunks of 8 values a load where H and I are multiples of 32, 2 of 16, else 1 (FP8_LOAD16 and
    FP8_PRMT stay 0); fewer k blocks in flight at 128-wide blocks; shared widening refused (per-lane scales)."""
    family = batched.family("mma", MXFP4.name)
    for (hidden, inter), halves in (((2048, 768), 4), ((2880, 2880), 4), ((208, 48), 2), ((200, 136), 1)):
        params = family.resolve(Dims(4, hidden, inter, 8, 2))
        assert (params["FP4_HALVES"], params["FP8_LOAD16"], params["FP8_PRMT"]) == (halves, 0, 0)
        assert loaders.mma_halves(params) == halves
    s = PRESETS["qwen3-30b-a3b"]
    params = family.resolve(Dims(1, s.hidden, s.intermediate, s.experts, s.top_k))
    assert (params["GB_UNROLL"], params["DB_UNROLL"]) == (2, 2)
    assert batched.family("mma", "bf16").resolve()["FP4_HALVES"] == 0
    assert batched.family("pairs", MXFP4.name).resolve(Dims(1, 2048, 768, 128, 8))["FP4_HALVES"] == 4
    with pytest.raises(ValueError, match="mxfp4's fragments are scaled per lane before the mma"):
        family.resolve(Dims(64, 2048, 768, 16, 8), GB_SHARE=2)


WIDEN_MAIN = r"""
int main(int, char** argv) {
    std::string dir = argv[1];
    std::vector<uint32_t> out;
    for (uint32_t s = 0; s < 256; ++s)            // every scale byte x every byte, each byte at each word position
        for (uint32_t byte = 0; byte < 256; ++byte) {
            const unsigned char row[2] = {(unsigned char)s, (unsigned char)s};   // the scale row of one block
            const uint4 f = e2m1x8_to_bf16x8(byte * 0x01010101u, half_scale2(block_scales(row, 0), 0));
            out.push_back(f.x); out.push_back(f.y); out.push_back(f.z); out.push_back(f.w);
        }
    FILE* f = fopen((dir + "/widened.bin").c_str(), "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_widening_is_the_exact_product_bitwise(fmt: Fp4Format) -> None:
    """Every byte (two e2m1 codes) at every position of a 4-byte chunk, times every block scale byte (e8m0; e4m3), as
    the A fragment's bf16 pairs: bitwise the float32 value x scale as bf16 (exact) -- mxfp4's subnormal weights
    (scales 2^-127 .. 2^-120), overflows to infinity and NaN (255; e4m3's 0x7f / 0xff) included."""
    family = batched.family("mma", fmt.name)
    harness = EMULATION_HARNESS[: EMULATION_HARNESS.index("int main(")] + WIDEN_MAIN
    binary = build_emulator(family.source.render(**family.resolve()), harness)
    with tempfile.TemporaryDirectory() as tmp:
        run_emulator(binary, tmp)
        got = np.fromfile(f"{tmp}/widened.bin", np.uint32).reshape(256, 256, 4)
    halves = np.stack([got & 0xFFFF, got >> 16], axis=-1).astype(np.uint16).view(BF16)  # [scale, byte, word, half]
    byte = np.arange(256)
    codes = np.stack([E2M1_VALUES[byte & 15], E2M1_VALUES[byte >> 4]], axis=-1)  # [byte, lo / hi]
    scales = E4M3_VALUES if fmt.global_scaled else E8M0_VALUES
    with np.errstate(over="ignore", invalid="ignore"):
        want = (codes[None] * scales[:, None, None]).astype(np.float32)  # [scale, byte, lo / hi]
    assert np.array_equal(want.astype(BF16).astype(np.float32), want, equal_nan=True)  # the premise: exact in bf16
    want = np.broadcast_to(want[:, :, None, :], halves.shape)
    widened = bf16_to_f32(halves)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(widened), nan) and nan.any()
    assert np.array_equal(widened[~nan].view(np.uint32), want[~nan].view(np.uint32))
    if not fmt.global_scaled:
        assert np.isinf(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()  # both edges


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_offline_compile_at_the_presets_without_spills(fmt: Fp4Format) -> None:
    """Both families (the tensor-core one with its balanced and its grouped down) at qwen3-30b-a3b T = 1 and
    gpt-oss-120b T = 64 (tools.compile_report covers the families' sample knob sets): zero spills, zero stack."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    cases = []
    for path, knob_sets in (("mma", ({}, mma.grouped_knobs(fmt))), ("pairs", ({},))):
        family = batched.family(path, fmt.name)
        for model, t in zip(MODELS, (1, 64), strict=True):
            s = PRESETS[model]
            for knobs in knob_sets:
                cases.append((family, family.resolve(Dims(t, s.hidden, s.intermediate, s.experts, s.top_k), **knobs)))
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda case: offline_report(case[0].source, **case[1]), cases))
    for (family, params), kernels in zip(cases, reports, strict=True):
        for r in kernels:
            assert r.spills == 0 and r.stack_bytes == 0, (family.name, params, r)


# ---------------------------------------------------------------------------------------------------
# the g++ emulation
# ---------------------------------------------------------------------------------------------------
SHAPE_32 = MoEShape("h256-i96", 256, 96, 6, 2)  # 32-value loads (FP4_HALVES 4), I = 96: a partial 128-wide k block
SHAPE_16 = MoEShape("h208-i48", 208, 48, 6, 2)  # 16-value loads, partial scale blocks (208 = 6 x 32 + 16)
SHAPE_8 = MoEShape("h200-i136", 200, 136, 5, 3)  # 8-value loads, k % 32 = 8
DUPLICATES = [[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [5, 4]]
EMULATED = [  # (shape, T, routing, path, knobs, format, also: bitwise the bf16 family / fp32 out)
    (SHAPE_32, 5, "uniform", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, MXFP4, ("bitwise", "fp32")),
    (SHAPE_32, 4, "same", "pairs", {}, MXFP4, ()),
    (SHAPE_32, 6, "zipf", "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, NVFP4, ("own globals",)),
    (SHAPE_32, 4, "uniform", "pairs", {}, NVFP4, ("bitwise", "fp32")),
    (SHAPE_32, 9, "zipf", "mma", {**mma.grouped_knobs(NVFP4), "HOT_NBLK": 2}, NVFP4, ()),  # split chains, hot tiles
    (SHAPE_16, 6, DUPLICATES, "mma", {"DB_GROUPED": 0, "DB_WARPS": 3}, MXFP4, ()),
    (SHAPE_8, 7, "zipf", "mma", {"DB_GROUPED": 1}, NVFP4, ("bitwise",)),
]
EMULATED_IDS = [f"{getattr(c[0], 'name', c[0])}-T{c[1]}-{c[3]}-{c[5].name}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "routing", "path", "knobs", "fmt", "also"),
                         slow_except(EMULATED, EMULATED_IDS, {0, 3}))
def test_emulated_against_the_reference_and_the_dequantized_bf16_families(
        rng: np.random.Generator, shape: Any, tokens: int, routing: Any, path: str, knobs: dict[str, int],
        fmt: Fp4Format, also: tuple[str, ...]) -> None:
    """The family's CUDA C on 4-bit weights (NaN-poisoned out and intermediate) within the tensor-core tolerance of
    the reference on the same weights -- nvfp4 with global scales rounded to powers of two, and with its quantizer's
    own --; with one chunk a load (FP4_HALVES 1) bitwise the bf16 family, same knobs, on the dequantized weights: the
    mma sees the same A fragments in the same k order (nvfp4's global times each dot, a power of two, is the global
    inside each weight)."""
    raw = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    if "own globals" in also:  # the quantizer's own global scales: no power of two
        q13, q2 = quantize_weights(raw.w13, raw.w2, fmt.name)
        own = dataclasses.replace(raw, w13=q13, w2=q2)
        _assert_matches(_emulate(own, path=path, **knobs)["out"], moe_decode(*own.arrays, mode="warp_decode"),
                        moe_decode(*own.arrays, mode="fp64"), f"emulated {fmt.name} {path} own globals",
                        own_order=True)
    problem = _mxfp4(raw, fmt)
    got = _emulate(problem, path=path, **knobs)
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    _assert_matches(got["out"], faithful, oracle, f"emulated {fmt.name} {path} {problem.shape.name} {knobs}",
                    own_order=True)
    if "bitwise" in also:
        one = _emulate(problem, path=path, FP4_HALVES=1, **knobs)
        same = {k: v for k, v in one["params"].items() if k in FAMILY_KNOBS[path]}
        bf16 = _emulate(_dequantized_bf16(problem, fmt), path=path, **same)
        assert np.array_equal(one["inter"], bf16["inter"])
        assert np.array_equal(one["out"].view(np.uint16), bf16["out"].view(np.uint16))
    if "fp32" in also:
        got32 = _emulate(problem, out_dtype=np.float32, path=path, **knobs)["out"]
        faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
        _assert_matches(got32, faithful32, oracle, f"emulated {fmt.name} {path} fp32 out", own_order=True)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "fmt"), [pytest.param("mma", NVFP4, id="mma-nvfp4"),
                                           pytest.param("pairs", MXFP4, id="pairs-mxfp4")])
def test_emulated_nan_scales_and_bad_ids(rng: np.random.Generator, path: str, fmt: Fp4Format) -> None:
    """A NaN block scale (e8m0 255, e4m3 0x7f) in one gate block of expert e makes exactly the tokens routed to e
    NaN; an id outside [0, E) its token's row; the rest matches the reference."""
    problem = _mxfp4(make_problem(SHAPE_32, 8, seed=_seed(rng)), fmt)
    routed = [int((problem.topk_ids == e).any(axis=1).sum()) for e in range(problem.shape.experts)]
    expert = min((e for e in range(problem.shape.experts) if routed[e]), key=lambda e: routed[e])  # 2 tokens clean
    scales = problem.w13.scales.copy()
    scales[expert, 3, 1] = 0x7F if fmt.global_scaled else 255
    problem = dataclasses.replace(problem, w13=dataclasses.replace(problem.w13, scales=scales))
    ids = problem.topk_ids.copy()
    bad = next(t for t in range(problem.tokens) if expert not in ids[t])
    ids[bad, 1] = problem.shape.experts
    got = _emulate(problem, ids=ids, path=path)["out"].astype(np.float32)
    nan_tokens = {bad} | {t for t in range(problem.tokens) if expert in ids[t]}
    assert set(np.flatnonzero(np.isnan(got).all(axis=1))) == nan_tokens
    good = [t for t in range(problem.tokens) if t not in nan_tokens]
    assert good and not np.isnan(got[good]).any()
    clean = dataclasses.replace(problem, topk_ids=problem.topk_ids[good], topk_weights=problem.topk_weights[good],
                                x=problem.x[good], tokens=len(good))
    faithful = moe_decode(*clean.arrays, mode="warp_decode")
    oracle = moe_decode(*clean.arrays, mode="fp64")
    _assert_matches(got[good].astype(BF16), faithful, oracle, "nan scales: the clean tokens", own_order=True)


@pytest.mark.parametrize(("shape", "fmt"), [pytest.param(SHAPE_32, MXFP4, id="h256-mxfp4"),
                                            pytest.param(SHAPE_8, NVFP4, id="h200-nvfp4", marks=pytest.mark.slow)])
def test_emulated_invariant_pair_keeps_a_tokens_bits(rng: np.random.Generator, shape: MoEShape,
                                                     fmt: Fp4Format) -> None:
    """The batch-invariant policy on 4-bit weights: a token's row from the per-pair form alone (T = 1) is bitwise its
    row from the grouped path in a batch of 6 under Zipf routing (the same k ranges, invariant_ksplit 4, in both)."""
    problem = _mxfp4(make_problem(shape, 6, seed=_seed(rng), routing="zipf"), fmt)
    grouped = _emulate(problem, path="mma", **mma.grouped_knobs(fmt))["out"].view(np.uint16)
    for t in (0, 4):
        alone = dataclasses.replace(problem, tokens=1, x=problem.x[t:t + 1], topk_ids=problem.topk_ids[t:t + 1],
                                    topk_weights=problem.topk_weights[t:t + 1])
        got = _emulate(alone, path="pairs")
        assert got["params"]["GB_KSPLIT"] == mma.invariant_ksplit(fmt) == 4
        assert np.array_equal(got["out"].view(np.uint16)[0], grouped[t]), t


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
PATHS = {"mma": ("mma", False, "mma"), "grouped": ("mma", True, "mma-grouped"), "pairs": ("pairs", False, "mma-pairs")}
GPU_CASES = [(model, t, routing, case) for model in MODELS
             for t, routing, case in ((1, "uniform", "pairs"), (4, "zipf", "mma"), (16, "uniform", "grouped"),
                                      (64, "zipf", "mma"), (64, "uniform", "grouped"))]
GPU_CASES += [(SHAPE_16, 6, DUPLICATES, "mma"), (SHAPE_8, 5, "zipf", "pairs"), ("tiny", 7, "same", "grouped"),
              ("qwen3-30b-a3b", 8, "correlated", "mma"), ("gpt-oss-120b", 8, "zipf-1", "grouped"),
              ("qwen3-30b-a3b", 2, "zipf-2", "pairs")]  # with the cases above: every routing generator


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FOUR_BIT)
@pytest.mark.parametrize(("model", "tokens", "routing", "case"), GPU_CASES)
def test_gpu_4bit_tensor_core_paths(model: Any, tokens: int, routing: Any, case: str, fmt: Fp4Format) -> None:
    """Against the reference on the same weights (NaN-poisoned out and intermediate; nvfp4 with its quantizer's
    global scales), bitwise over a repeat, the registered variant's launch and a CUDA-graph replay."""
    import cupy

    from kernels.shapes import get_shape
    from kernels.variants import get_variant
    from tests.warp_checks import assert_graph_replays_bitwise

    shape = get_shape(model)
    shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    raw = make_problem(shape, tokens, seed=tokens + 11, routing=routing)
    host = dataclasses.replace(raw, **dict(zip(("w13", "w2"), quantize_weights(raw.w13, raw.w2, fmt.name),
                                               strict=True)))
    device = host.to_cupy()
    path, grouped, suffix = PATHS[case]
    knobs = mma.grouped_knobs(fmt) if grouped else {}
    dims = _dims(host)

    def run() -> np.ndarray:
        out = _poisoned_out(cupy, tokens, shape.hidden)
        ws = batched.make_workspace(dims, path, fmt.name, **knobs)
        ws.intermediate.view(cupy.uint16).fill(0x7FC0)
        batched.warp_decode_batched(*device.arrays, out=out, workspace=ws, path=path, **knobs)
        cupy.cuda.runtime.deviceSynchronize()
        return out.get()

    first = run()
    faithful = moe_decode(*host.arrays, mode="warp_decode")
    oracle = moe_decode(*host.arrays, mode="fp64")
    _assert_matches(first, faithful, oracle, f"{fmt.name} {case} {shape.name} T={tokens}", own_order=True)
    assert np.array_equal(run().view(np.uint16), first.view(np.uint16))
    launch = get_variant(f"cupy:warp-decode-{suffix}-{fmt.name}").make(dims)
    assert_graph_replays_bitwise(cupy, launch, device, first)
