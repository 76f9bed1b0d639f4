"""Weight formats as data: bytes per expert, quantize / dequantize, and the bench's bytes accounting."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kernels
from kernels import formats
from kernels.contract import BF16, check_inputs
from kernels.formats import BF16_FORMAT, FORMATS, Quantized, WeightFormat, get_format
from kernels.routing import make_routing
from kernels.shapes import PRESETS
from tools import harness


@pytest.mark.parametrize("model", ["tiny", "qwen3-30b-a3b", "deepseek-v3"])
def test_bf16_bytes_are_the_contract_bytes(model: str) -> None:
    shape = PRESETS[model]
    assert BF16_FORMAT.expert_bytes(shape.hidden, shape.intermediate) == shape.expert_bytes
    assert BF16_FORMAT.scale_bytes(shape.hidden, shape.intermediate) == 0


def test_bf16_quantize_rounds_to_nearest_even_and_reads_back(rng: np.random.Generator) -> None:
    w13 = rng.standard_normal((3, 16, 24), dtype=np.float32)
    w2 = rng.standard_normal((3, 24, 8), dtype=np.float32)
    q13, q2 = BF16_FORMAT.quantize(w13, w2)
    assert q13.dtype == BF16 and q2.dtype == BF16
    assert np.array_equal(q13.view(np.uint16), w13.astype(BF16).view(np.uint16))
    back = BF16_FORMAT.dequantize(q13, "w13")
    assert back.dtype == np.float32 and np.max(np.abs(back - w13) / np.abs(w13)) <= 2.0**-8
    assert BF16_FORMAT.quantize(q13, q2)[0] is q13  # already bf16: unchanged
    with pytest.raises(TypeError, match="w2 must be a float32 or bfloat16 array"):
        BF16_FORMAT.quantize(w13, w2.astype(np.int32))


def test_lookup() -> None:
    assert get_format("bf16") is BF16_FORMAT and get_format(BF16_FORMAT) is BF16_FORMAT
    assert set(FORMATS) >= {"bf16"} and all(isinstance(f, WeightFormat) for f in FORMATS.values())
    with pytest.raises(ValueError, match="unknown weight_format 'int3'; known: bf16"):
        get_format("int3")
    with pytest.raises(TypeError, match="weight_format must be"):
        get_format(8)


def test_bench_bytes_follow_the_format() -> None:
    """A scaled format's TB/s counts its values and its scales: the bytes it reads."""

    class Halves(WeightFormat):
        def scale_bytes(self, hidden: int, intermediate: int) -> int:
            return 4 * (hidden // 8)

    shape = PRESETS["tiny"]
    ids, _ = make_routing(4, shape.experts, shape.top_k, "uniform", 0)
    plain = harness.bytes_breakdown(shape, ids)
    half = harness.bytes_breakdown(shape, ids, Halves("halves", "1 byte a value, a scale per 8 rows", 1))
    unique = plain["unique_experts"]
    assert plain["weight_format"] == "bf16" and plain["weights"] == unique * shape.expert_bytes
    assert half["weight_format"] == "halves"
    assert half["weights"] == unique * (3 * shape.hidden * shape.intermediate + 4 * (shape.hidden // 8))
    assert half["activation"] == plain["activation"]


def test_variants_default_to_bf16() -> None:
    """Every library variant reads bf16 weights but the FP8, tiled and 4-bit paths, which say so (the bench then gives
    them copies in their format and counts that format's bytes)."""
    from kernels.variants import load_builtin

    formats = {v.name: v.weight_format for v in load_builtin().values() if not v.prototype}
    assert {name: fmt for name, fmt in formats.items() if fmt != "bf16"} == dict.fromkeys(
        ["cupy:warp-decode-fp8", "numba:warp-decode-fp8", "cupy:warp-decode-batched-fp8", "cupy:warp-decode-mma-fp8",
         "cupy:auto-fp8", "cupy:expert-centric-w8a8", "cupy:warp-decode-mma-grouped-fp8",
         "cupy:warp-decode-mma-pairs-fp8", "cupy:auto-invariant-fp8"], "fp8-block128") | dict.fromkeys(
        ["cupy:warp-decode-mma-fp8-t16", "cupy:warp-decode-mma-pairs-fp8-t16", "cupy:warp-decode-mma-grouped-fp8-t16",
         "cupy:auto-fp8-t16", "cupy:auto-invariant-fp8-t16"], "fp8-block128-t16") | dict.fromkeys(
        ["cupy:warp-decode-mma-t16", "cupy:warp-decode-mma-pairs-t16", "cupy:warp-decode-mma-grouped-t16",
         "cupy:auto-t16", "cupy:auto-invariant-t16"], "bf16-t16") | dict.fromkeys(
        ["cupy:warp-decode-batched-mxfp4", "cupy:warp-decode-mma-mxfp4", "cupy:warp-decode-mma-pairs-mxfp4",
         "cupy:warp-decode-mma-grouped-mxfp4", "cupy:auto-mxfp4", "cupy:auto-invariant-mxfp4"],
        "mxfp4") | dict.fromkeys(
        ["cupy:warp-decode-batched-nvfp4", "cupy:warp-decode-mma-nvfp4", "cupy:warp-decode-mma-pairs-nvfp4",
         "cupy:warp-decode-mma-grouped-nvfp4", "cupy:auto-nvfp4", "cupy:auto-invariant-nvfp4"], "nvfp4")


class ExpertScaled(WeightFormat):
    """A toy scaled format (one power-of-two float32 scale per expert and matrix, bf16 values): what adding a format
    takes -- this class -- and, because its values times its scales are exact in bf16, a format whose reference
    must equal the bf16 reference on its dequantized weights bit for bit."""

    def scale_bytes(self, hidden: int, intermediate: int) -> int:
        return 2 * 4

    def quantize(self, w13: np.ndarray, w2: np.ndarray) -> tuple[Quantized, Quantized]:
        def one(w: np.ndarray) -> Quantized:
            amax = np.abs(w.astype(np.float32)).max(axis=(1, 2))
            scales = np.exp2(np.ceil(np.log2(amax))).astype(np.float32)
            return Quantized((w.astype(np.float32) / scales[:, None, None]).astype(BF16), scales)

        return one(w13), one(w2)

    def dequantize(self, weights: Quantized, matrix: str) -> np.ndarray:
        return weights.values.astype(np.float32) * weights.scales[:, None, None]


def test_reference_reads_weights_through_their_format() -> None:
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    problem = make_problem("tiny", 5, routing="uniform", seed=3)
    fmt = ExpertScaled("expert-scaled", "bf16 values, one scale per expert", 2)
    q13, q2 = fmt.quantize(problem.w13, problem.w2)
    assert not np.array_equal(q13.values.view(np.uint16), problem.w13.view(np.uint16))  # really scaled
    d13, d2 = fmt.dequantize(q13, "w13").astype(BF16), fmt.dequantize(q2, "w2").astype(BF16)
    assert np.array_equal(d13.astype(np.float32), fmt.dequantize(q13, "w13"))  # exact in bf16
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    for mode, quant in (("fp64", None), ("warp_decode", None), ("classical", None), ("classical", "fp8")):
        via_format = moe_decode(x, q13, q2, ids, wts, mode=mode, quant=quant, weight_format=fmt)
        plain = moe_decode(x, d13, d2, ids, wts, mode=mode, quant=quant)
        assert np.array_equal(via_format.view(np.uint8), plain.view(np.uint8)), mode
    with pytest.raises(ValueError, match=r"weight_format 'expert-scaled' disagrees with the weights: w13 holds a plain "
                                         r"ndarray \(bf16 weights\), expert-scaled weights are 'rows'-ordered values "
                                         "with scales"):
        moe_decode(x, problem.w13, q2, ids, wts, weight_format=fmt)
    with pytest.raises(TypeError, match="w2 must be a numpy array like x, got kernels.formats.Quantized"):
        moe_decode(x, problem.w13, q2, ids, wts)
    with pytest.raises(ValueError, match="w13.values must have 3 dimensions"):
        moe_decode(x, Quantized(q13.values[0], q13.scales), q2, ids, wts, weight_format=fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_reads_the_format_from_the_weights(rng: np.random.Generator, fmt: str) -> None:
    """reference.moe_decode reads the weights' format from them, as kernels.moe_decode does (format_of): the same
    result as naming it; a weight_format the weights are not in is a ValueError naming both."""
    from kernels.reference import moe_decode

    w13, w2 = _finite_weights(rng, experts=3)
    q13, q2 = kernels.quantize_weights(w13, w2, fmt)
    x = rng.standard_normal((4, 128)).astype(BF16)
    ids = rng.integers(0, 3, (4, 2)).astype(np.int32)
    wts = rng.random((4, 2)).astype(np.float32)
    for mode in ("fp64", "warp_decode", "classical"):
        named = moe_decode(x, q13, q2, ids, wts, mode=mode, weight_format=fmt)
        assert np.array_equal(moe_decode(x, q13, q2, ids, wts, mode=mode).view(np.uint8), named.view(np.uint8))
        assert np.array_equal(moe_decode(x, q13, q2, ids, wts, mode=mode, weight_format=get_format(fmt))
                              .view(np.uint8), named.view(np.uint8))
    for other in FORMATS:
        if other != fmt:
            with pytest.raises(ValueError, match=rf"weight_format '{other}' disagrees with the weights: w13 holds "
                                                 + (r"a plain ndarray" if fmt == "bf16" else rf"{fmt} weights")):
                moe_decode(x, q13, q2, ids, wts, weight_format=other)


# ---------------------------------------------------------------------------------------------------
# fp8-block128: the format FP8 MoE checkpoints ship
# ---------------------------------------------------------------------------------------------------
FP8_BLOCK = formats.FP8_BLOCK128


def _blockwise_oracle(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8-block128 of one matrix, block by block in plain loops (independent of the vectorised quantizer)."""
    rows, cols = m.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    values = np.zeros((rows, cols), formats.FP8)
    scales = np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            block = m[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].astype(np.float32)
            amax = np.float32(np.abs(block).max())
            scale = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            scales[i, j] = scale
            values[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = np.clip(block / scale, -448, 448).astype(formats.FP8)
    return values, scales


def _fp8_weights(rng: np.random.Generator, experts: int = 3, hidden: int = 264, inter: int = 200) -> tuple:
    """bf16 weights with partial blocks at both edges (H = 264, I = 200) and magnitudes spread over decades."""
    w13 = (rng.standard_normal((experts, 2 * inter, hidden)) * np.exp(rng.uniform(-6, 3, (experts, 2 * inter, 1))))
    w2 = (rng.standard_normal((experts, hidden, inter)) * np.exp(rng.uniform(-6, 3, (experts, 1, inter))))
    return w13.astype(BF16), w2.astype(BF16)


def test_fp8_block128_quantizes_block_by_block(rng: np.random.Generator) -> None:
    """Values and scales equal a loop over blocks (gate and up apart), the layouts are the checkpoints', and the
    dequantized weights sit within half an e4m3 step of the originals."""
    w13, w2 = _fp8_weights(rng)
    q13, q2 = kernels.quantize_weights(w13, w2, "fp8-block128")
    assert q13.values.dtype == formats.FP8 and q13.values.shape == w13.shape
    assert q13.scales.shape == (3, 2 * 2, 3) and q2.scales.shape == (3, 3, 2)  # I = 200: 2 gate + 2 up block rows
    for e in range(3):
        gate, up = w13[e, :200].astype(np.float32), w13[e, 200:].astype(np.float32)
        for got_v, got_s, part in ((q13.values[e, :200], q13.scales[e, :2], gate),
                                   (q13.values[e, 200:], q13.scales[e, 2:], up),
                                   (q2.values[e], q2.scales[e], w2[e].astype(np.float32))):
            want_v, want_s = _blockwise_oracle(part)
            assert np.array_equal(got_s, want_s)
            assert np.array_equal(got_v.view(np.uint8), want_v.view(np.uint8))
    for q, w, matrix in ((q13, w13, "w13"), (q2, w2, "w2")):
        original = w.astype(np.float32)
        back = FP8_BLOCK.dequantize(q, matrix)
        scale = np.abs(original).max() / 448
        # e4m3: 3 mantissa bits (a relative half-step of 2^-4), subnormal step 2^-9 of the block's scale
        assert np.all(np.abs(back - original) <= np.abs(original) * 2.0**-4 + 2.0**-10 * scale * 448)
        assert np.array_equal(FP8_BLOCK.expert(q, 1, matrix), back[1])
    assert FP8_BLOCK.expert_bytes(2048, 768) == 3 * 2048 * 768 + 4 * (2 * 6 * 16 + 16 * 6)  # qwen3-30b-a3b
    assert 8 * FP8_BLOCK.expert_bytes(2048, 768) == 37_757_952  # T = 1 reads 8 experts: 37.8 MB


def test_fp8_dequantize_reads_bit_patterns_by_lookup(rng: np.random.Generator) -> None:
    """The uint8 bit patterns (CuPy's view of e4m3fn) dequantize through the value table exactly as the float8
    values do, NaN patterns included."""
    from kernels.formats import FP8, dequantize_blocks

    values = rng.integers(0, 256, (130, 260), dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    np.testing.assert_array_equal(dequantize_blocks(values, scales), dequantize_blocks(values.view(FP8), scales))


def test_fp8_block128_keeps_gate_and_up_apart() -> None:
    """A partial last gate block (I = 200) is scaled by gate rows only; a zero block gets scale 1 and zeros."""
    w13 = np.zeros((1, 400, 128), np.float32)
    w13[0, :200] = 0.001
    w13[0, 199, 5] = 0.002  # the gate's partial second block
    w13[0, 200:] = 1000.0  # up: 10^6 larger
    w13[0, 328:] = 0.0  # up's second block: all zero
    w2 = np.ones((1, 128, 200), np.float32)
    q13, _ = FP8_BLOCK.quantize(w13, w2)
    assert q13.scales[0, :, 0].tolist() == pytest.approx([0.001 / 448, 0.002 / 448, 1000 / 448, 1.0], rel=1e-6)
    assert np.all(q13.values[0, 328:].astype(np.float32) == 0)
    assert np.array_equal(FP8_BLOCK.dequantize(q13, "w13")[0, 199, 5], np.float32(0.002))


def test_fp8_block128_checks_name_the_problem(rng: np.random.Generator) -> None:
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    problem = make_problem("tiny", 3, seed=5)
    q13, q2 = kernels.quantize_weights(problem.w13, problem.w2)
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    bits = Quantized(q13.values.view(np.uint8), q13.scales)  # the uint8 bit patterns are accepted
    assert np.array_equal(moe_decode(x, bits, q2, ids, wts, weight_format="fp8-block128"),
                          moe_decode(x, q13, q2, ids, wts, weight_format="fp8-block128"))
    with pytest.raises(ValueError, match=r"w13.scales must be \[6, 2, 2\]"):
        moe_decode(x, Quantized(q13.values, np.ascontiguousarray(q13.scales[:, :1])), q2, ids, wts,
                   weight_format="fp8-block128")
    with pytest.raises(TypeError, match="w2.values must be float8_e4m3fn or uint8"):
        moe_decode(x, q13, Quantized(q2.values.astype(np.float32), q2.scales), ids, wts, weight_format="fp8-block128")
    with pytest.raises(TypeError, match="w2.scales must be float32"):
        moe_decode(x, q13, Quantized(q2.values, q2.scales.astype(np.float64)), ids, wts, weight_format="fp8-block128")
    with pytest.raises(TypeError, match="w13 must be a float32 or bfloat16 array"):
        kernels.quantize_weights(problem.w13.astype(np.int32), problem.w2)
    with pytest.raises(ValueError, match="unknown weight_format 'fp4'"):
        kernels.quantize_weights(problem.w13, problem.w2, "fp4")


def _finite_weights(rng: np.random.Generator, experts: int = 4, hidden: int = 128, inter: int = 64) -> tuple:
    """fp32 weights every format stores (H and I whole tiles of 64 values)."""
    return (rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32),
            rng.standard_normal((experts, hidden, inter), dtype=np.float32))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_weights_refuses_non_finite(rng: np.random.Generator, fmt: str) -> None:
    """A NaN or inf weight is a ValueError naming the matrix, the experts holding them (and how many each) and the
    first one's index, in every format and from fp32 or bf16: unchecked, a NaN left its fp8-block128 block's scale
    at 1 (the block's other values quantized unscaled) and an inf zeroed the rest of its block."""
    w13, w2 = _finite_weights(rng)
    bad13 = w13.copy()
    bad13[2, 5, 7] = np.nan
    bad13[2, 100, 0] = -np.inf
    bad13[3, 0, 127] = np.nan
    with pytest.raises(ValueError, match=r"w13 must be finite to become .* 3 NaN/inf values in 2 of 4 experts "
                                         r"\(expert \(count\): 2 \(2\), 3 \(1\)\); the first is w13\[2, 5, 7\] = nan"):
        kernels.quantize_weights(bad13, w2, fmt)
    bad2 = w2.astype(BF16)
    bad2[1, 64, 3] = np.inf
    with pytest.raises(ValueError, match=r"w2 must be finite .* 1 NaN/inf values in 1 of 4 experts .* "
                                         r"w2\[1, 64, 3\] = inf"):
        kernels.quantize_weights(w13.astype(BF16), bad2, fmt)
    kernels.quantize_weights(w13, w2, fmt)  # finite: fine


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_weights_refuses_inconsistent_shapes(rng: np.random.Generator, fmt: str) -> None:
    """w13 / w2 that no entry point could take are refused where they are quantized, naming the argument and the
    shape expected -- not later, at the first call: swapped, mismatched, H or I not a multiple of 8, and (tiled
    formats) not whole tiles."""
    w13, w2 = _finite_weights(rng)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] = \[4, 64, 64\] to match w13 \[E, 2I, H\] = "
                                         r"\[4, 128, 64\], got shape \(4, 128, 128\) \(w13 and w2 swapped\?\)"):
        kernels.quantize_weights(w2, w13, fmt)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] = \[4, 128, 64\] to match w13 \[E, 2I, H\]"):
        kernels.quantize_weights(w13, w2[:, :100], fmt)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] = \[4, 128, 64\] .*, got shape \(3, 128, 64\)"):
        kernels.quantize_weights(w13, w2[:3], fmt)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, H\] and w2 \[E, H, I\] with H a multiple of 8 "
                                         r"\(16-byte loads\), got H = 100"):
        kernels.quantize_weights(w13[:, :, :100], w2[:, :100], fmt)
    with pytest.raises(ValueError, match=r"with I a multiple of 8 .*, got I = 60"):
        kernels.quantize_weights(w13[:, :120], w2[:, :, :60], fmt)
    with pytest.raises(ValueError, match="must be even, got 127"):
        kernels.quantize_weights(w13[:, :127], w2, fmt)
    with pytest.raises(ValueError, match=r"w2 must have 3 dimensions \[E, H, I\], got shape \(128, 64\)"):
        kernels.quantize_weights(w13, w2[0], fmt)
    with pytest.raises(TypeError, match="w2 must be a float32 or bfloat16 array"):
        kernels.quantize_weights(w13, w2.astype(np.int16), fmt)
    if get_format(fmt).tiled:  # H = 192 (3 tiles of 64), I = 40: a multiple of 8, not of 32 or 64
        with pytest.raises(ValueError, match=rf"{fmt} tiles need I and H multiples of \d+, got I = 40, H = 192 "
                                             r"\(w13 \[E, 2I, H\] = \[1, 80, 192\], w2 \[E, H, I\] = \[1, 192, 40\]\)"):
            kernels.quantize_weights(np.ones((1, 80, 192), np.float32), np.ones((1, 192, 40), np.float32), fmt)


@pytest.mark.gpu
def test_device_quantize_weights_refuses_non_finite_and_bad_shapes(rng: np.random.Generator) -> None:
    """The same checks where the weights live (CuPy: bf16 on the device quantizer, fp32 through the host)."""
    import cupy

    w13, w2 = _finite_weights(rng)
    for dtype in (BF16, np.float32):
        bad13 = w13.astype(dtype)
        bad13[3, 9, 11] = np.nan
        dev13, dev2 = cupy.asarray(bad13), cupy.asarray(w2.astype(dtype))
        for fmt in FORMATS:
            with pytest.raises(ValueError, match=r"w13 must be finite .* 1 of 4 experts .* w13\[3, 9, 11\] = nan"):
                kernels.quantize_weights(dev13, dev2, fmt)
            with pytest.raises(ValueError, match=r"\(w13 and w2 swapped\?\)"):
                kernels.quantize_weights(dev2, dev13, fmt)
    with pytest.raises(TypeError, match="w2 must be a cupy array like w13"):
        kernels.quantize_weights(cupy.asarray(w13), w2)


def test_fp8_reference_is_the_dequantized_weights(rng: np.random.Generator) -> None:
    """Every mode reads an fp8-block128 expert as value x block scale: fp64 equals a float64 computation on the
    dequantized weights, and the format's error (fp64 on the originals) is measured apart from the modes'."""
    from kernels.numerics import bf16_to_f32, rel_l2, silu
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    problem = make_problem("tiny", 6, seed=11, routing="zipf")
    q13, q2 = kernels.quantize_weights(problem.w13, problem.w2)
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    d13, d2 = FP8_BLOCK.dequantize(q13, "w13").astype(np.float64), FP8_BLOCK.dequantize(q2, "w2").astype(np.float64)
    xs = bf16_to_f32(x).astype(np.float64)
    inter = d13.shape[1] // 2
    want = np.zeros((6, x.shape[1]))
    for t in range(6):
        for k in range(ids.shape[1]):
            gu = d13[ids[t, k]] @ xs[t]
            want[t] += wts[t, k] * (d2[ids[t, k]] @ (silu(gu[:inter]) * gu[inter:]))
    fp64 = moe_decode(x, q13, q2, ids, wts, mode="fp64", weight_format="fp8-block128")
    assert np.allclose(fp64, want, rtol=1e-12, atol=1e-12)
    original = moe_decode(x, problem.w13, problem.w2, ids, wts, mode="fp64")
    kernel_numerics = moe_decode(x, q13, q2, ids, wts, mode="warp_decode", weight_format="fp8-block128")
    served = moe_decode(x, q13, q2, ids, wts, mode="classical", quant="fp8", weight_format="fp8-block128")
    format_error = rel_l2(fp64, original)
    assert 1e-3 < format_error < 0.1  # e4m3's 3 mantissa bits
    assert rel_l2(kernel_numerics.astype(np.float32), fp64) < format_error / 5  # bf16 roundings only
    assert rel_l2(served.astype(np.float32), fp64) > rel_l2(kernel_numerics.astype(np.float32), fp64)


def _checkpoint_tensors(q13: Quantized, q2: Quantized, inter: int) -> list[dict[str, np.ndarray]]:
    nb = q13.scales.shape[1] // 2
    return [{"gate_proj.weight": q13.values[e, :inter], "gate_proj.weight_scale_inv": q13.scales[e, :nb],
             "up_proj.weight": q13.values[e, inter:], "up_proj.weight_scale_inv": q13.scales[e, nb:],
             "down_proj.weight": q2.values[e], "down_proj.weight_scale_inv": q2.scales[e]}
            for e in range(q13.values.shape[0])]


def test_fp8_checkpoint_loader_assembles_the_lab_layout(rng: np.random.Generator) -> None:
    """A checkpoint's per-expert gate / up / down tensors and their weight_scale_inv (built here: nothing is
    downloaded) become the lab's w13 / w2, bitwise; uint8 bit patterns load too; a bad tensor is named."""
    w13, w2 = _fp8_weights(rng)
    q13, q2 = FP8_BLOCK.quantize(w13, w2)
    experts = _checkpoint_tensors(q13, q2, 200)
    got13, got2 = kernels.fp8_experts_from_checkpoint(experts)
    for got, want in ((got13, q13), (got2, q2)):
        assert np.array_equal(got.values.view(np.uint8), want.values.view(np.uint8))
        assert np.array_equal(got.scales, want.scales)
    experts[1] = {k: (v.view(np.uint8) if v.dtype == formats.FP8 else v) for k, v in experts[1].items()}
    assert np.array_equal(kernels.fp8_experts_from_checkpoint(experts)[0].values.view(np.uint8),
                          q13.values.view(np.uint8))
    broken = [dict(e) for e in experts]
    broken[2]["down_proj.weight_scale_inv"] = broken[2]["down_proj.weight_scale_inv"][:1]
    with pytest.raises(ValueError, match=r"experts\[2\]\['down_proj.weight_scale_inv'\] must be \[3, 2\]"):
        kernels.fp8_experts_from_checkpoint(broken)
    broken = [dict(e) for e in experts]
    del broken[0]["up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"experts\[0\] lacks up_proj.weight_scale_inv"):
        kernels.fp8_experts_from_checkpoint(broken)
    broken = [dict(e) for e in experts]
    broken[1]["gate_proj.weight"] = broken[1]["gate_proj.weight"].astype(np.float32)
    with pytest.raises(TypeError, match=r"experts\[1\]\['gate_proj.weight'\] must be float8_e4m3fn"):
        kernels.fp8_experts_from_checkpoint(broken)
    with pytest.raises(TypeError, match="non-empty sequence"):
        kernels.fp8_experts_from_checkpoint([])


def test_fp8_checkpoint_loader_refuses_non_finite(rng: np.random.Generator) -> None:
    """e4m3fn's NaN codes (0x7F, 0xFF: the tensor-core paths would widen them as +-480, the strict ones as NaN) and
    NaN / inf scales are refused where a checkpoint is loaded, naming the expert, the tensor and the first index."""
    w13, w2 = _fp8_weights(rng)
    q13, q2 = FP8_BLOCK.quantize(w13, w2)
    for code in (0x7F, 0xFF):
        experts = _checkpoint_tensors(q13, q2, 200)
        gate = experts[1]["gate_proj.weight"].view(np.uint8).copy()
        gate[7, 9] = code
        experts[1] = {**experts[1], "gate_proj.weight": gate}
        with pytest.raises(ValueError, match=r"experts\[1\]\['gate_proj.weight'\] must be finite: 1 e4m3fn NaN codes "
                                             r"\(0x7F / 0xFF\), the first at \[7, 9\]"):
            kernels.fp8_experts_from_checkpoint(experts)
    for value in (np.nan, np.inf):
        experts = _checkpoint_tensors(q13, q2, 200)
        scales = experts[2]["down_proj.weight_scale_inv"].copy()
        scales[1, 0] = value
        experts[2] = {**experts[2], "down_proj.weight_scale_inv": scales}
        with pytest.raises(ValueError, match=r"experts\[2\]\['down_proj.weight_scale_inv'\] must be finite: 1 NaN/inf "
                                             r"scales, the first at \[1, 0\]"):
            kernels.fp8_experts_from_checkpoint(experts)


# ---------------------------------------------------------------------------------------------------
# fp8-block128 on the device: the quantize kernel's text through the g++ emulation, then on the GPU
# ---------------------------------------------------------------------------------------------------
QUANTIZE_HARNESS = r"""
#define __shared__ static
EmuBarrier* g_block = nullptr;
float q_shared[128];
inline void __syncthreads() { g_block->arrive_and_wait(); }
#include "kernel.cu"
template <class F> void launch(int gx, int gy, int gz, F body) {
    EmuBarrier block_bar(128);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int w = 0; w < 4; ++w) warps.emplace_back(new WarpCtx);
    run_lanes(128, [&](int l) {
        g_warp = warps[l / 32].get();
        for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
            threadIdx.x = l; blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
            body();
            block_bar.arrive_and_wait();
        }
    });
}
""" + "{load}" + r"""
int main(int argc, char** argv) {
    int E = atoi(argv[1]), R = atoi(argv[2]), C = atoi(argv[3]), split = atoi(argv[4]);
    std::string dir = argv[5];
    auto w = load<uint16_t>(dir + "/w.bin", (size_t)E * R * C);
    std::vector<unsigned char> values((size_t)E * R * C, 0xFF);
    const int cb = (C + 127) / 128;
    const int halves = split ? 2 : 1, n = split ? R / 2 : R, srows = halves * ((n + 127) / 128);
    std::vector<float> scales((size_t)E * srows * cb, -1.0f);
    for (int h = 0; h < halves; ++h)
        launch(cb, (n + 127) / 128, E, [&] {
            quantize_fp8_block128(w.data(), (long long)R * C, h * n, n, C, values.data(), scales.data(),
                                  (long long)srows * cb, h * ((n + 127) / 128));
        });
    FILE* f = fopen((dir + "/values.bin").c_str(), "wb"); fwrite(values.data(), 1, values.size(), f); fclose(f);
    f = fopen((dir + "/scales.bin").c_str(), "wb"); fwrite(scales.data(), 4, scales.size(), f); fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize(("matrix", "experts", "rows", "cols"), [("w13", 2, 400, 264), ("w2", 1, 136, 200)])
def test_device_quantizer_emulated_is_bitwise_the_host_one(rng: np.random.Generator, matrix: str, experts: int,
                                                           rows: int, cols: int) -> None:
    """The device kernel's text, run on the CPU, gives the host quantizer's values and scales bit for bit (partial
    blocks at both edges; w13's gate and up halves blocked apart)."""
    import tempfile

    from kernels import quantize_cuda
    from tests.warp_checks import EMULATION_LOAD, EMULATION_PRELUDE, build_emulator, run_emulator

    w = (rng.standard_normal((experts, rows, cols)) * np.exp(rng.uniform(-8, 4, (experts, rows, 1)))).astype(BF16)
    w[0, :5] = 0  # rows of zeros inside a block
    binary = build_emulator(quantize_cuda.SOURCE.render(),
                            EMULATION_PRELUDE + QUANTIZE_HARNESS.replace("{load}", EMULATION_LOAD))
    with tempfile.TemporaryDirectory() as tmp:
        w.tofile(f"{tmp}/w.bin")
        run_emulator(binary, experts, rows, cols, int(matrix == "w13"), tmp)
        values = np.fromfile(f"{tmp}/values.bin", np.uint8).reshape(experts, rows, cols)
        scales = np.fromfile(f"{tmp}/scales.bin", np.float32)
    want = FP8_BLOCK._quantize(matrix, w)
    assert np.array_equal(scales.reshape(want.scales.shape), want.scales)
    assert np.array_equal(values, want.values.view(np.uint8))


@pytest.mark.gpu
def test_device_quantizer_is_bitwise_the_host_one(rng: np.random.Generator) -> None:
    import cupy

    w13, w2 = _fp8_weights(rng)
    host13, host2 = kernels.quantize_weights(w13, w2)
    dev13, dev2 = kernels.quantize_weights(cupy.asarray(w13), cupy.asarray(w2))
    for dev, host in ((dev13, host13), (dev2, host2)):
        assert dev.values.dtype == cupy.uint8
        assert np.array_equal(cupy.asnumpy(dev.values), host.values.view(np.uint8))
        assert np.array_equal(cupy.asnumpy(dev.scales), host.scales)


def test_device_quantizer_compiles_for_sm90() -> None:
    """The kernel compiles for sm_90 (cvt.rn.satfinite.e4m3x2.f32 needs sm_89+) without spills."""
    from kernels import quantize_cuda
    from kernels.compile import offline_report

    [report] = offline_report(quantize_cuda.SOURCE)
    assert report.kernel == quantize_cuda.QUANTIZE and report.spill_stores == report.stack_bytes == 0


def test_tiled_values() -> None:
    """fp8-block128-t16 holds fp8-block128's values (bit for bit, its scales unchanged) in 16-row x 64-value tiles:
    w13's tile j is neuron group j's 8 gate rows, then its 8 up rows, k block after k block; w2's is rows 16t ..
    16t + 15. The reference reads it as the same weights; each layout's checks refuse the other; shapes that do not
    tile, and knobs that cannot read tiles, are refused with the reason."""
    from kernels import batched
    from kernels.contract import Dims
    from kernels.formats import FP8_BLOCK128, FP8_BLOCK128_T16, quantize_weights, tile_values, untile_values
    from kernels.reference import moe_decode

    rng = np.random.default_rng(3)
    experts, inter, hidden = 2, 128, 192
    w13 = rng.standard_normal((experts, 2 * inter, hidden)).astype(np.float32)
    w2 = rng.standard_normal((experts, hidden, inter)).astype(np.float32)
    rows13, rows2 = quantize_weights(w13, w2, FP8_BLOCK128.name)
    t13, t2 = quantize_weights(w13, w2, FP8_BLOCK128_T16.name)
    assert (t13.layout, t2.layout, rows13.layout) == ("t16", "t16", "rows")
    for rows, tiled, matrix in ((rows13, t13, "w13"), (rows2, t2, "w2")):
        bits = rows.values.view(np.uint8)
        assert np.array_equal(tiled.values.view(np.uint8), tile_values(bits, matrix))
        assert np.array_equal(untile_values(tiled.values.view(np.uint8), matrix), bits)
        assert np.array_equal(tiled.scales, rows.scales)
        assert np.array_equal(FP8_BLOCK128_T16.dequantize(tiled, matrix), FP8_BLOCK128.dequantize(rows, matrix))
    flat13, flat2 = t13.values.view(np.uint8).reshape(experts, -1), t2.values.view(np.uint8).reshape(experts, -1)
    kb13, kb2 = hidden // 64, inter // 64
    e, j, k, r, c = 1, 3, 2, 5, 17  # group 3, k block 2, row 5 of the tile, value 17 of the k block
    assert flat13[e][((j * kb13 + k) * 16 + r) * 64 + c] == rows13.values.view(np.uint8)[e, 8 * j + r, 64 * k + c]
    assert flat13[e][((j * kb13 + k) * 16 + 8 + r) * 64 + c] == rows13.values.view(np.uint8)[e, inter + 8 * j + r,
                                                                                              64 * k + c]
    assert flat2[e][((j * kb2 + 1) * 16 + r) * 64 + c] == rows2.values.view(np.uint8)[e, 16 * j + r, 64 + c]
    checkpoint = [{"gate_proj.weight": rows13.values[e, :inter], "up_proj.weight": rows13.values[e, inter:],
                   "down_proj.weight": rows2.values[e],
                   "gate_proj.weight_scale_inv": rows13.scales[e, :rows13.scales.shape[1] // 2],
                   "up_proj.weight_scale_inv": rows13.scales[e, rows13.scales.shape[1] // 2:],
                   "down_proj.weight_scale_inv": rows2.scales[e]} for e in range(experts)]
    for loaded, tiled in zip(FP8_BLOCK128_T16.from_rows(*formats.fp8_experts_from_checkpoint(checkpoint)), (t13, t2),
                             strict=True):  # a checkpoint's tensors, tiled
        assert loaded.layout == "t16" and np.array_equal(loaded.values.view(np.uint8), tiled.values.view(np.uint8))
    with pytest.raises(ValueError, match="w13 holds 't16'-ordered values, fp8-block128 weights are 'rows'"):
        FP8_BLOCK128_T16.from_rows(t13, t2)
    # what an entry point given these weights runs: the format their layout names
    assert [formats.format_of(w) for w in (w13.astype(BF16), rows13, t13)] == ["bf16", FP8_BLOCK128.name,
                                                                              FP8_BLOCK128_T16.name]
    with pytest.raises(ValueError, match="w13 holds 'cols'-ordered values with scales; the formats know rows, "
                                         "rows-e2m1x2, t16"):
        formats.format_of(dataclasses.replace(t13, layout="cols"))
    x = rng.standard_normal((3, hidden)).astype(BF16)
    ids = rng.integers(0, experts, (3, 2)).astype(np.int32)
    wts = rng.random((3, 2)).astype(np.float32)
    assert np.array_equal(moe_decode(x, t13, t2, ids, wts, mode="fp64", weight_format=FP8_BLOCK128_T16.name),
                          moe_decode(x, rows13, rows2, ids, wts, mode="fp64", weight_format=FP8_BLOCK128.name))
    with pytest.raises(ValueError, match=r"weight_format 'fp8-block128' disagrees with the weights: w13 holds "
                                         r"fp8-block128-t16 weights \('t16'-ordered values with scales\), fp8-block128 "
                                         "weights are 'rows'-ordered values with scales"):
        moe_decode(x, t13, t2, ids, wts, weight_format=FP8_BLOCK128.name)
    with pytest.raises(ValueError, match="w2 holds 'rows'-ordered values, fp8-block128-t16 weights are 't16'"):
        moe_decode(x, t13, rows2, ids, wts, weight_format=FP8_BLOCK128_T16.name)
    with pytest.raises(ValueError, match="tiles need I and H multiples of 64, got I = 128, H = 200"):
        quantize_weights(np.zeros((1, 256, 200), np.float32), np.zeros((1, 200, 128), np.float32),
                         FP8_BLOCK128_T16.name)
    # the tensor-core families read the tiles in 16-value loads (their FP8_LOAD16, derived from H and I), the FMA
    # family not at all
    for path in ("mma", "pairs"):
        family = batched.family(path, FP8_BLOCK128_T16.name)
        assert family.resolve(Dims(1, hidden, inter, experts, 2))["FP8_LOAD16"] == 1
        for hidden_odd in (200, 208):  # not whole 16-value loads, then not whole tiles: the tiles' rule names it
            with pytest.raises(ValueError, match="fp8-block128-t16 holds 64-value tiles: H and I must be multiples"):
                family.resolve(Dims(1, hidden_odd, inter, experts, 2))
    with pytest.raises(ValueError, match="no fma loader for weight format 'fp8-block128-t16'"):
        batched.family("fma", FP8_BLOCK128_T16.name)


def test_bf16_tiles(rng: np.random.Generator) -> None:
    """bf16-t16 holds the contract's bf16 values (bit for bit) in 16-row x 32-value tiles, 64 bytes a tile row as
    fp8-block128-t16's, no scales: the reference reads them as the same weights, format_of names them, and each
    check refuses the other layouts and shapes that do not tile."""
    from kernels.formats import BF16_T16, FP8_BLOCK128_T16, quantize_weights, tile_k, untile_values
    from kernels.reference import moe_decode

    experts, inter, hidden = 2, 64, 96
    w13 = rng.standard_normal((experts, 2 * inter, hidden)).astype(np.float32)
    w2 = rng.standard_normal((experts, hidden, inter)).astype(np.float32)
    t13, t2 = quantize_weights(w13, w2, BF16_T16.name)
    assert (t13.layout, t13.scales, t13.values.dtype, tile_k(2)) == ("t16", None, BF16, 32)
    for tiled, w, matrix in ((t13, w13, "w13"), (t2, w2, "w2")):
        assert np.array_equal(untile_values(tiled.values, matrix).view(np.uint16), w.astype(BF16).view(np.uint16))
        assert np.array_equal(BF16_T16.dequantize(tiled, matrix), w.astype(BF16).astype(np.float32))
    rows13 = w13.astype(BF16)
    flat = t13.values.view(np.uint16).reshape(experts, -1)
    e, j, k, r, c = 1, 5, 2, 3, 17  # neuron group 5, k block 2, row 3 of the tile, value 17 of the k block
    assert flat[e][((j * 3 + k) * 16 + r) * 32 + c] == rows13.view(np.uint16)[e, 8 * j + r, 32 * k + c]
    assert flat[e][((j * 3 + k) * 16 + 8 + r) * 32 + c] == rows13.view(np.uint16)[e, inter + 8 * j + r, 32 * k + c]
    assert formats.format_of(t13) == BF16_T16.name and BF16_T16.expert_bytes(hidden, inter) == 3 * hidden * inter * 2
    assert BF16_T16.tiled and not BF16_T16.scaled and FP8_BLOCK128_T16.scaled
    x = rng.standard_normal((3, hidden)).astype(BF16)
    ids = rng.integers(0, experts, (3, 2)).astype(np.int32)
    wts = rng.random((3, 2)).astype(np.float32)
    assert np.array_equal(moe_decode(x, t13, t2, ids, wts, weight_format=BF16_T16.name).view(np.uint16),
                          moe_decode(x, rows13, w2.astype(BF16), ids, wts).view(np.uint16))
    with pytest.raises(ValueError, match="weight_format 'bf16-t16' disagrees with the weights: w13 holds a plain "
                                         "ndarray"):
        moe_decode(x, rows13, t2, ids, wts, weight_format=BF16_T16.name)
    with pytest.raises(ValueError, match="w2 holds 'rows'-ordered values, bf16-t16 weights are 't16'-ordered bf16"):
        moe_decode(x, t13, dataclasses.replace(t2, layout="rows"), ids, wts, weight_format=BF16_T16.name)
    with pytest.raises(ValueError, match=r"w13 holds bf16-t16 weights \('t16'-ordered values without scales\), "
                                         "fp8-block128-t16 weights are 't16'-ordered values with scales"):
        moe_decode(x, t13, t2, ids, wts, weight_format=FP8_BLOCK128_T16.name)
    with pytest.raises(TypeError, match=r"w13.scales is None: fp8-block128-t16 weights carry scales"):
        check_inputs(x, t13, t2, ids, wts, weight_format=FP8_BLOCK128_T16.name)
    with pytest.raises(TypeError, match=r"w13.values must have dtype bfloat16"):
        moe_decode(x, dataclasses.replace(t13, values=t13.values.astype(np.float32)), t2, ids, wts,
                   weight_format=BF16_T16.name)
    with pytest.raises(ValueError, match="bf16-t16 tiles need I and H multiples of 32, got I = 64, H = 200"):
        quantize_weights(np.zeros((1, 128, 200), np.float32), np.zeros((1, 200, 64), np.float32), BF16_T16.name)
    with pytest.raises(ValueError, match="strict warp decode reads row-major weights; w13 is bf16-t16"):
        kernels.warp_decode(x, t13, t2, ids, wts)
    from kernels.expert_centric_path import expert_centric

    with pytest.raises(ValueError, match="the expert-centric path reads row-major weights"):
        expert_centric(x, t13, t2, ids, wts)


def test_which_dims_each_format_stores() -> None:
    """Tiled formats store whole tiles only (64 e4m3 or 32 bf16 values a tile row); the others any contract dims.
    The harness and tools.accuracy ask check_dims before any work."""
    from kernels.formats import FormatDimsError

    tiny = PRESETS["tiny"]  # H = 136, I = 48
    for fmt in FORMATS.values():
        fmt.check_dims(2048, 768)  # qwen3-30b-a3b: every format
        if fmt.tiled:
            with pytest.raises(FormatDimsError, match=f"{fmt.name} tiles need I and H multiples of "
                                                      f"{64 // int(fmt.value_bytes)}, got I = 48, H = 136"):
                fmt.check_dims(tiny.hidden, tiny.intermediate)
        else:
            fmt.check_dims(tiny.hidden, tiny.intermediate)
    assert sorted(f.name for f in FORMATS.values() if f.tiled) == ["bf16-t16", "fp8-block128-t16"]
    get_format("fp8-block128-t16").check_dims(2880, 2880)  # gpt-oss-120b: 45 tiles of 64 values a row
    with pytest.raises(FormatDimsError):  # ... not at tools.accuracy's reduced width, 720 (22.5 tiles of 32)
        get_format("bf16-t16").check_dims(720, 720)
