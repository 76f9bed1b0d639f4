"""The 4-bit expert formats, mxfp4 and nvfp4 (kernels/formats_fp4.py): the e2m1 grid and its rounding, the scale
rules, the packing, the checks, and the reference reading them.

Sources the rules are checked against (by hand below, and through independent oracles built on ml_dtypes' float4_e2m1fn
/ float8_e4m3fn conversions, never on the module's own rounding):

* OCP Microscaling Formats (MX) Specification v1.0 (opencompute.org, ocp-microscaling-formats-mx-v1-0-spec-final.pdf):
  section 5.4, the E8M0 scale (2^(s - 127), 0xFF NaN); section 6.3, converting a block: shared_exp =
  floor(log2(max |V_i|)) - emax_elem (emax_elem = 2 for e2m1), P_i = V_i / 2^shared_exp rounded to the element
  format, normal numbers clamped to its largest (6).
* NVIDIA's NVFP4 (Transformer Engine's NVFP4BlockScaling recipe; TensorRT Model Optimizer's NVFP4 checkpoints, whose
  weight_scale_2 is the per-tensor fp32 scale and weight_scale the per-16 e4m3 scales; NVIDIA's "Introducing NVFP4"
  blog): global = amax / (448 x 6), block scale = amax_block / 6 / global rounded to e4m3, values = x / (block scale
  x global) rounded to e2m1; a value decodes as e2m1 x e4m3 x fp32.
* gpt-oss's reference dequantizer (openai/gpt-oss, gpt_oss/torch/weights.py): ``*_blocks`` [..., k/32, 16] bytes,
  element 2j in the low nibble of byte j, ``*_scales`` [..., k/32] e8m0 bytes, value = lut[nibble] x 2^(scale - 127).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import kernels
from kernels import formats_fp4 as fp4
from kernels.contract import BF16, check_inputs
from kernels.formats import MXFP4, NVFP4, FormatDimsError, Quantized, format_of, get_format
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS

F4 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FORMATS_FP4 = (MXFP4, NVFP4)
TINY = PRESETS["tiny"]  # H = 136 (4 x 32 + 8, 8 x 16 + 8), I = 48 (32 + 16): partial blocks in both formats
ODD = TINY.with_(name="tiny-odd", hidden=104, intermediate=40)  # partial last blocks of both matrices, both formats


def _values(codes: np.ndarray) -> np.ndarray:
    return fp4.E2M1_VALUES[codes]


# ---------------------------------------------------------------------------------------------------
# e2m1: the grid and round to nearest even
# ---------------------------------------------------------------------------------------------------
def test_e2m1_grid_is_the_ocp_one() -> None:
    """Codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (1 sign, 2 exponent bits of bias 1, 1 mantissa bit), 8..15 their
    negatives -- as ml_dtypes decodes float4_e2m1fn and as gpt-oss's FP4_VALUES table lists them."""
    assert fp4.E2M1_VALUES[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert fp4.E2M1_VALUES[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(fp4.E2M1_VALUES[8])
    np.testing.assert_array_equal(np.arange(16, dtype=np.uint8).view(F4).astype(np.float32), fp4.E2M1_VALUES)


def test_e2m1_rounds_to_nearest_even_and_saturates_by_hand() -> None:
    ties = {0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5: 4}  # each tie goes to the even code
    near = {0.24: 0, 0.26: 0.5, 1.3: 1.5, 2.4: 2, 2.6: 3, 4.9: 4, 5.1: 6, 6: 6}
    saturated = {6.5: 6, 7: 6, 8: 6, 1e30: 6}  # above 6: +-6, never a NaN
    for table in (ties, near, saturated):
        x = np.array(list(table), np.float32)
        for sign in (1, -1):
            got = _values(fp4.e2m1_codes(sign * x))
            assert got.tolist() == [sign * v for v in table.values()], (sign, table)
    assert fp4.e2m1_codes(np.array([-0.1, -0.0, 0.0], np.float32)).tolist() == [8, 8, 0]  # the sign is kept


def test_e2m1_rounding_matches_ml_dtypes_everywhere(rng: np.random.Generator) -> None:
    """Every multiple of 1/256 in [-10, 10] (every tie among them) and random floats over decades: the codes
    ml_dtypes' float4_e2m1fn conversion (round to nearest even, saturating) gives."""
    x = np.concatenate([np.arange(-2560, 2561, dtype=np.float32) / 256,
                        (rng.standard_normal(20000) * np.exp(rng.uniform(-8, 4, 20000))).astype(np.float32)])
    np.testing.assert_array_equal(fp4.e2m1_codes(x), x.astype(F4).view(np.uint8))


def test_packing_puts_the_even_element_in_the_low_nibble() -> None:
    codes = np.array([[7, 9, 1, 15, 0, 2]], np.uint8)  # 6, -0.5, 0.5, -6, 0, 1
    packed = fp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x97, 0xF1, 0x20]]
    np.testing.assert_array_equal(fp4.unpack_e2m1(packed), codes)
    with pytest.raises(FormatDimsError, match="k must be even, got 5"):
        fp4.pack_e2m1(codes[:, :5], "k")


# ---------------------------------------------------------------------------------------------------
# The scale rules, by hand against the specs
# ---------------------------------------------------------------------------------------------------
def _mx_row(first: list[float], k: int = 32) -> np.ndarray:
    row = np.zeros((1, k), np.float32)
    row[0, : len(first)] = first
    return row


def test_mxfp4_scale_is_the_ocp_mx_shared_exponent() -> None:
    """OCP MX v1.0 section 6.3: shared_exp = floor(log2(amax)) - 2, the scale byte shared_exp + 127 (section 5.4),
    values V / 2^shared_exp rounded to e2m1, those above 6 clamped to 6."""
    cases = [  # block amax -> scale byte
        (1.0, 125),  # floor(log2 1) - 2 = -2
        (6.0, 127),  # 2 - 2 = 0: 6 stored as 6 x 2^0
        (7.9, 127),  # still 2^2 <= amax < 2^3: scaled 7.9 saturates to 6
        (8.0, 128),
        (0.3, 123),  # floor(log2 0.3) = -2
        (2.0**-126, 0),  # -128 clamps to e8m0's smallest, 2^-127
    ]
    for amax, byte in cases:
        values, scales = fp4.quantize_mx(_mx_row([amax, -amax / 3]))
        assert scales.tolist() == [[byte]], amax
        assert fp4.E8M0_VALUES[byte] == 2.0 ** (byte - 127)
    values, scales = fp4.quantize_mx(_mx_row([7.9, 5.0, 0.75, -2.5]))
    assert _values(fp4.unpack_e2m1(values))[0, :4].tolist() == [6, 4, 1, -2]  # saturated, then three ties to even
    values, scales = fp4.quantize_mx(np.zeros((1, 32), np.float32))  # a block of zeros: the smallest scale, zeros
    assert scales.tolist() == [[0]] and not values.any()
    assert math.isnan(fp4.E8M0_VALUES[255])  # 0xFF: e8m0's NaN (the spec's; no quantizer writes it)


def test_nvfp4_scales_are_nvidias_recipe() -> None:
    """global = amax / (448 x 6); block scale = amax_block / 6 / global, the nearest e4m3 (ties to even); values
    x / (block scale x global) rounded to e2m1, saturating at 6 where the rounded scale sits below amax / 6."""
    m = np.zeros((1, 96), np.float32)
    m[0, 0] = 2688.0  # the matrix amax: global = 1
    m[0, 16] = 6.0  # block scale 1 (e4m3 0x38)
    m[0, 32] = 6.375  # wants 1.0625: the tie between 1 and 1.125 goes to 1 (even), and 6.375 saturates to 6
    m[0, 48] = 7.125  # wants 1.1875: the tie between 1.125 and 1.25 goes to 1.25; 7.125 / 1.25 = 5.7 -> 6
    m[0, 80] = 1e-4  # wants 1.7e-5, below half e4m3's smallest (2^-10): scale 0, the block stores zeros
    g = fp4.nvfp4_global_scale(m)
    assert g == np.float32(1.0)
    values, scales = fp4.quantize_nv(m, g)
    decoded = fp4.E4M3_VALUES[scales[0]].tolist()
    assert decoded == [448.0, 1.0, 1.0, 1.25, 0.0, 0.0]  # the fifth block is all zeros: scale 0 too
    assert scales[0, :2].tolist() == [0x7E, 0x38]
    got = _values(fp4.unpack_e2m1(values))[0]
    assert got[[0, 16, 32, 48, 80]].tolist() == [6, 6, 6, 6, 0]
    m = np.full((2, 16), 3.0, np.float32)
    assert fp4.nvfp4_global_scale(m) == np.float32(3.0) / np.float32(2688)
    assert fp4.nvfp4_global_scale(np.zeros((2, 16), np.float32)) == 1.0  # a matrix of zeros


def _mx_oracle(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mxfp4 of one matrix block by block in float64 / math (floor(log2)) and ml_dtypes' e2m1 rounding."""
    rows, k = m.shape
    codes = np.zeros((rows, k), np.uint8)
    scales = np.zeros((rows, -(-k // 32)), np.uint8)
    for r in range(rows):
        for b in range(0, k, 32):
            block = m[r, b:b + 32].astype(np.float64)
            amax = float(np.abs(block).max())
            shared = max(-127, math.floor(math.log2(amax)) - 2) if amax > 0 else -127
            scales[r, b // 32] = shared + 127
            codes[r, b:b + 32] = (block / 2.0**shared).astype(np.float32).astype(F4).view(np.uint8)
    return codes, scales


def _nv_oracle(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """nvfp4 of one matrix block by block, e4m3 and e2m1 rounding by ml_dtypes."""
    rows, k = m.shape
    g = np.float32(np.abs(m).max()) / np.float32(448 * 6)
    codes = np.zeros((rows, k), np.uint8)
    scales = np.zeros((rows, -(-k // 16)), np.uint8)
    for r in range(rows):
        for b in range(0, k, 16):
            block = m[r, b:b + 16]
            s = np.float32(np.abs(block).max()) / np.float32(6) / g
            scales[r, b // 16] = np.float32(min(s, 448)).astype(E4M3).view(np.uint8)
            denominator = np.float32(scales[r, b // 16:b // 16 + 1].view(E4M3).astype(np.float32)[0] * g)
            scaled = block / denominator if denominator > 0 else np.zeros_like(block)
            codes[r, b:b + 16] = scaled.astype(F4).view(np.uint8)
    return codes, scales, g


def _spread(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Normal weights whose rows' magnitudes spread over 4 decades (bf16-exact, as checkpoints are)."""
    m = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-5, 4, (rows, 1)))
    return m.astype(BF16).astype(np.float32)


@pytest.mark.parametrize("k", [64, 136, 40])
def test_quantizers_equal_independent_oracles(rng: np.random.Generator, k: int) -> None:
    """Bitwise the block-by-block oracles above (whole and partial last blocks: k = 136 is 4 x 32 + 8 and
    8 x 16 + 8, k = 40 is 32 + 8 and 2 x 16 + 8)."""
    m = _spread(rng, 24, k)
    m[3, :] = 0.0  # a row of zeros
    values, scales = fp4.quantize_mx(m)
    codes, want_scales = _mx_oracle(m)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(values, fp4.pack_e2m1(codes))
    g = fp4.nvfp4_global_scale(m)
    values, scales = fp4.quantize_nv(m, g)
    codes, want_scales, want_g = _nv_oracle(m)
    assert g == want_g
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(values, fp4.pack_e2m1(codes))


def test_partial_last_block_is_scaled_by_its_own_values() -> None:
    """k = 136: the last mxfp4 block holds values 128..135 only, the last nvfp4 block too; a big value elsewhere
    in the row does not widen their scale (as if the row were zero-padded to whole blocks)."""
    m = np.zeros((2, 136), np.float32)
    m[:, 0] = 1000.0
    m[:, 130] = 0.75  # the partial block's amax
    m[1, 135] = -0.5
    _, scales = fp4.quantize_mx(m)
    assert scales.shape == (2, 5) and scales[:, 4].tolist() == [124, 124]  # floor(log2 0.75) - 2 = -3
    g = np.float32(1000 / 2688)
    _, scales = fp4.quantize_nv(m, g)
    assert scales.shape == (2, 9)
    assert fp4.E4M3_VALUES[scales[0, 8]] == np.float32(np.float32(0.75) / np.float32(6) / g).astype(E4M3).astype(
        np.float32)


def test_odd_k_is_refused_naming_the_dim() -> None:
    for fmt in FORMATS_FP4:
        fmt.check_dims(136, 48)
        with pytest.raises(FormatDimsError, match=rf"{fmt.name} packs two e2m1 values a byte along k: H \(w13's k\) "
                                                  r"must be even, got H = 135"):
            fmt.check_dims(135, 48)
        with pytest.raises(FormatDimsError, match=r"I \(w2's k\) must be even, got I = 47 \(w2 \[6, 136, 47\]\)"):
            fmt.check_dims(136, 47, "w2 [6, 136, 47]")
    for quantize in (fp4.quantize_mx, lambda m: fp4.quantize_nv(m, np.float32(1))):
        with pytest.raises(FormatDimsError, match="k must be even, got 33"):
            quantize(np.ones((2, 33), np.float32))
    # through quantize_weights the contract refuses them first (H and I multiples of 8), a ValueError naming H
    with pytest.raises(ValueError, match="H a multiple of 8"):
        kernels.quantize_weights(np.ones((1, 16, 135), np.float32), np.ones((1, 135, 8), np.float32), "mxfp4")


# ---------------------------------------------------------------------------------------------------
# The formats: layouts, bytes, round trip, checkpoints' layouts
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS_FP4, ids=lambda f: f.name)
def test_layouts_and_round_trip(rng: np.random.Generator, fmt: object) -> None:
    """quantize_weights gives the contract's layouts packed (w13 [E, 2I, H/2], w2 [E, H, I/2] uint8, scales [E, rows,
    ceil(k/B)] uint8, nvfp4's global [E] float32, one per expert and matrix); dequantize is exact float32 and within
    a quarter of max(|x|, its block's scale) of the original -- half a grid step (a saturated value: less than 2 of
    the block's 8 scaled units); gate and up rows keep their own blocks."""
    experts, inter, hidden = 3, ODD.intermediate, ODD.hidden
    w13 = np.stack([_spread(rng, 2 * inter, hidden) for _ in range(experts)])
    w2 = np.stack([_spread(rng, hidden, inter) for _ in range(experts)])
    q13, q2 = kernels.quantize_weights(w13, w2, fmt.name)
    b = fmt.block
    assert q13.values.shape == (experts, 2 * inter, hidden // 2) and q13.values.dtype == np.uint8
    assert q2.values.shape == (experts, hidden, inter // 2)
    assert q13.scales.shape == (experts, 2 * inter, -(-hidden // b)) and q13.scales.dtype == np.uint8
    assert q2.scales.shape == (experts, hidden, -(-inter // b))
    assert (q13.layout, format_of(q13), format_of(q2)) == ("rows-e2m1x2", fmt.name, fmt.name)
    for q, w, matrix in ((q13, w13, "w13"), (q2, w2, "w2")):
        back = fmt.dequantize(q, matrix)
        assert back.dtype == np.float32 and back.shape == w.shape
        np.testing.assert_array_equal(fmt.expert(q, 1, matrix), back[1])
        codes = fp4.unpack_e2m1(q.values)
        scale = (fp4.E4M3_VALUES if fmt.e4m3 else fp4.E8M0_VALUES)[np.repeat(q.scales, b, axis=2)[:, :, : w.shape[2]]]
        if fmt.e4m3:
            assert q.global_scale.shape == (experts,) and q.global_scale.dtype == np.float32
            for e in range(experts):
                assert q.global_scale[e] == np.float32(np.abs(w[e]).max()) / np.float32(2688)
            g = q.global_scale[:, None, None]
            np.testing.assert_array_equal(back, (fp4.E2M1_VALUES[codes] * scale) * g)  # exact product, one rounding
            unit = scale * g
        else:
            assert q.global_scale is None
            exact = fp4.E2M1_VALUES[codes].astype(np.float64) * scale.astype(np.float64)
            np.testing.assert_array_equal(back.astype(np.float64), exact)  # exact in float32
            unit = scale
        assert np.all(np.abs(back - w) <= np.maximum(np.abs(w), unit) / 4 * (1 + 1e-6))
    error = {m: np.linalg.norm(fmt.dequantize(q, m) - w) / np.linalg.norm(w) for q, w, m in ((q13, w13, "w13"),
                                                                                            (q2, w2, "w2"))}
    assert all(0.03 < e < 0.15 for e in error.values()), error  # 4-bit weights: ~10 % relative L2 on normals


def test_nvfp4_is_closer_than_mxfp4_on_normal_weights(rng: np.random.Generator) -> None:
    """Half the block and a 3-bit-mantissa scale: NVFP4's round trip is closer than MXFP4's (NVIDIA's claim for
    the format), on the same weights."""
    w13 = rng.standard_normal((2, 96, 256), dtype=np.float32)
    w2 = rng.standard_normal((2, 256, 48), dtype=np.float32)
    err = {}
    for fmt in FORMATS_FP4:
        q13, _ = kernels.quantize_weights(w13, w2, fmt.name)
        err[fmt.name] = np.linalg.norm(fmt.dequantize(q13, "w13") - w13) / np.linalg.norm(w13)
    assert err["nvfp4"] < err["mxfp4"], err


def test_mxfp4_values_and_scales_are_gpt_oss_checkpoint_tensors(rng: np.random.Generator) -> None:
    """A gpt-oss ``*_blocks`` tensor [E, R, k/32, 16] is the values reshaped, its ``*_scales`` [E, R, k/32] the
    scales: gpt-oss's own dequantizer (re-derived here: lut[low nibble] at 2j, lut[high nibble] at 2j + 1, times
    2^(scale - 127)) reads them as the format does."""
    w13 = rng.standard_normal((2, 64, 128), dtype=np.float32)
    w2 = rng.standard_normal((2, 128, 32), dtype=np.float32)
    q13, _ = kernels.quantize_weights(w13, w2, "mxfp4")
    blocks = q13.values.reshape(2, 64, 128 // 32, 16)
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    out = np.empty((*blocks.shape[:-1], 32))
    out[..., 0::2] = lut[blocks & 0x0F]
    out[..., 1::2] = lut[blocks >> 4]
    out = np.ldexp(out, q13.scales.astype(np.int32)[..., None] - 127).reshape(2, 64, 128)
    np.testing.assert_array_equal(MXFP4.dequantize(q13, "w13"), out.astype(np.float32))
    assert np.linalg.norm(out - w13) / np.linalg.norm(w13) < 0.15  # and what gpt-oss reads is the weights (4-bit)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-120b", "tiny"])
def test_expert_bytes_are_values_and_scales(model: str) -> None:
    """What a kernel reads per expert: 3 H I / 2 bytes of values and a scale byte per block of each row (nvfp4:
    and two float32 globals). qwen3-30b-a3b: 0.27x (mxfp4) and 0.28x (nvfp4) of bf16 -- the bench's divisor."""
    from tools import harness

    shape = PRESETS[model]
    hidden, inter = shape.hidden, shape.intermediate
    for fmt, block, extra in ((MXFP4, 32, 0), (NVFP4, 16, 8)):
        scales = 2 * inter * -(-hidden // block) + hidden * -(-inter // block)
        assert fmt.expert_bytes(hidden, inter) == 3 * hidden * inter // 2 + scales + extra
        assert fmt.scaled and fmt.global_scaled == (fmt is NVFP4) and not fmt.tiled
    if model == "qwen3-30b-a3b":
        bf16 = 3 * 2048 * 768 * 2
        assert MXFP4.expert_bytes(2048, 768) == 2_359_296 + 147_456 and round(MXFP4.expert_bytes(2048, 768) / bf16,
                                                                                2) == 0.27
        assert round(NVFP4.expert_bytes(2048, 768) / bf16, 2) == 0.28
        ids = np.array([[0, 1, 2, 3, 4, 5, 6, 7]], np.int32)
        record = harness.bytes_breakdown(shape, ids, "mxfp4")
        assert record["weight_format"] == "mxfp4" and record["weights"] == 8 * MXFP4.expert_bytes(2048, 768)
        assert round(record["weights"] / harness.bytes_breakdown(shape, ids)["weights"], 2) == 0.27


# ---------------------------------------------------------------------------------------------------
# Checks: bad inputs are refused naming the argument
# ---------------------------------------------------------------------------------------------------
def test_checks_name_the_argument() -> None:
    p = make_problem("tiny", 3, seed=5)
    x, ids, wts = p.x, p.topk_ids, p.topk_weights
    m13, m2 = kernels.quantize_weights(p.w13, p.w2, "mxfp4")
    n13, n2 = kernels.quantize_weights(p.w13, p.w2, "nvfp4")
    assert check_inputs(x, m13, m2, ids, wts, weight_format="mxfp4").hidden == 136  # the contract's H, unpacked
    assert check_inputs(x, n13, n2, ids, wts, weight_format="nvfp4").intermediate == 48

    def refused(kind: type, match: str, w13: object, w2: object, fmt: str) -> None:
        with pytest.raises(kind, match=match):
            check_inputs(x, w13, w2, ids, wts, weight_format=fmt)

    refused(TypeError, "w13.values must be uint8 \\(two e2m1 values a byte\\), got float32",
            dataclasses.replace(m13, values=m13.values.astype(np.float32)), m2, "mxfp4")
    refused(TypeError, "w2.scales must be uint8 or float8_e8m0fnu \\(e8m0 bytes\\), got float32",
            m13, dataclasses.replace(m2, scales=m2.scales.astype(np.float32)), "mxfp4")
    refused(ValueError, r"w2.scales must be \[6, 136, 2\] for values of shape \(6, 136, 24\)",
            m13, dataclasses.replace(m2, scales=np.ascontiguousarray(m2.scales[:, :, :1])), "mxfp4")
    refused(ValueError, r"w13.scales must be \[6, 96, 9\]", dataclasses.replace(n13, scales=m13.scales), n2, "nvfp4")
    refused(ValueError, "w13.values must be C-contiguous",
            dataclasses.replace(m13, values=np.asfortranarray(m13.values)), m2, "mxfp4")
    refused(ValueError, r"w13 is \[E, 2I, H\] with H = 136 \(from x\), got shape \(6, 96, 128\)",
            Quantized(np.ascontiguousarray(m13.values[:, :, :64]), np.ascontiguousarray(m13.scales[:, :, :4]),
                      m13.layout), m2, "mxfp4")
    refused(ValueError, "w13 holds 'rows'-ordered values, mxfp4 weights are 'rows-e2m1x2'",
            dataclasses.replace(m13, layout="rows"), m2, "mxfp4")
    refused(ValueError, "w2.global_scale must be None: mxfp4 weights carry none",
            m13, dataclasses.replace(m2, global_scale=n2.global_scale), "mxfp4")
    refused(TypeError, "w13.global_scale is None: nvfp4 weights carry a float32 global scale per expert",
            dataclasses.replace(n13, global_scale=None), n2, "nvfp4")
    refused(TypeError, "w2.global_scale must be float32, got float64",
            n13, dataclasses.replace(n2, global_scale=n2.global_scale.astype(np.float64)), "nvfp4")
    refused(ValueError, r"w2.global_scale must be \[E\] = \[6\] \(one per expert\), got \(5,\)",
            n13, dataclasses.replace(n2, global_scale=n2.global_scale[:5].copy()), "nvfp4")
    refused(TypeError, "w13.scales is None: nvfp4 weights carry scales", dataclasses.replace(n13, scales=None), n2,
            "nvfp4")
    # ml_dtypes' e8m0 / e4m3 scale dtypes are the same bytes: accepted, read alike
    as_e8m0 = dataclasses.replace(m2, scales=m2.scales.view(fp4.E8M0))
    np.testing.assert_array_equal(MXFP4.dequantize(as_e8m0, "w2"), MXFP4.dequantize(m2, "w2"))
    check_inputs(x, m13, as_e8m0, ids, wts, weight_format="mxfp4")
    # the reference names a format the weights are not in, and what they are
    with pytest.raises(ValueError, match=r"weight_format 'nvfp4' disagrees with the weights: w13 holds mxfp4 weights "
                                         r"\('rows-e2m1x2'-ordered values with scales\), nvfp4 weights are "
                                         "'rows-e2m1x2'-ordered values with scales and a global scale"):
        moe_decode(x, m13, m2, ids, wts, weight_format="nvfp4")
    with pytest.raises(ValueError, match="matrix must be 'w13' or 'w2', got 'w3'"):
        MXFP4.dequantize(m2, "w3")
    with pytest.raises(TypeError, match="w13 must be a float32 or bfloat16 array"):
        kernels.quantize_weights(p.w13.astype(np.int32), p.w2, "nvfp4")
    with pytest.raises(ValueError, match="no strict warp decode kernel reads mxfp4 weights yet"):
        kernels.warp_decode(x, m13, m2, ids, wts)
    with pytest.raises(ValueError, match="unknown weight_format 'fp4'; known: .*mxfp4, nvfp4"):
        get_format("fp4")


# ---------------------------------------------------------------------------------------------------
# The reference reads them exactly
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [TINY, ODD], ids=lambda s: s.name)
@pytest.mark.parametrize("fmt", FORMATS_FP4, ids=lambda f: f.name)
def test_reference_reads_the_dequantized_weights(fmt: object, shape: object) -> None:
    """Every mode reads a 4-bit expert as its dequantized float32 weights: fp64 equals a float64 computation on
    them; mxfp4's are exact in bf16, so every mode is bitwise the bf16 reference on them; nvfp4's warp-decode
    numerics sit as close to fp64 as bf16 roundings allow, far closer than the format is to the original weights."""
    from kernels.numerics import bf16_to_f32, rel_l2, silu

    problem = make_problem(shape, 5, seed=11, routing="zipf")
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    q13, q2 = kernels.quantize_weights(problem.w13, problem.w2, fmt.name)
    d13, d2 = fmt.dequantize(q13, "w13"), fmt.dequantize(q2, "w2")
    xs = bf16_to_f32(x).astype(np.float64)
    inter = shape.intermediate
    want = np.zeros((5, shape.hidden))
    for t in range(5):
        for k in range(ids.shape[1]):
            gu = d13[ids[t, k]].astype(np.float64) @ xs[t]
            want[t] += wts[t, k] * (d2[ids[t, k]].astype(np.float64) @ (silu(gu[:inter]) * gu[inter:]))
    fp64 = moe_decode(x, q13, q2, ids, wts, mode="fp64")
    np.testing.assert_allclose(fp64, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(moe_decode(x, q13, q2, ids, wts, mode="fp64", weight_format=fmt.name), fp64)
    original = moe_decode(x, problem.w13, problem.w2, ids, wts, mode="fp64")
    format_error = rel_l2(fp64, original)
    assert 0.02 < format_error < 0.3  # 4-bit weights
    modes = (("warp_decode", None), ("classical", None), ("classical", "fp8"))
    if not fmt.e4m3:
        assert np.array_equal(d13.astype(BF16).astype(np.float32), d13)  # exact in bf16
        for mode, quant in modes:
            got = moe_decode(x, q13, q2, ids, wts, mode=mode, quant=quant)
            plain = moe_decode(x, d13.astype(BF16), d2.astype(BF16), ids, wts, mode=mode, quant=quant)
            assert np.array_equal(got.view(np.uint16), plain.view(np.uint16)), mode
    kernel_numerics = moe_decode(x, q13, q2, ids, wts, mode="warp_decode")
    assert rel_l2(kernel_numerics.astype(np.float32), fp64) < format_error / 5


@pytest.mark.parametrize("fmt", FORMATS_FP4, ids=lambda f: f.name)
def test_quantize_weights_from_bf16_and_fp32_agree(rng: np.random.Generator, fmt: object) -> None:
    """bf16 weights and the same values in fp32 give the same bytes (the quantizer works in fp32)."""
    w13 = rng.standard_normal((2, 32, 64)).astype(BF16)
    w2 = rng.standard_normal((2, 64, 16)).astype(BF16)
    a13, a2 = kernels.quantize_weights(w13, w2, fmt.name)
    b13, b2 = kernels.quantize_weights(w13.astype(np.float32), w2.astype(np.float32), fmt.name)
    for a, b in ((a13, b13), (a2, b2)):
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.scales, b.scales)
        assert (a.global_scale is None) == (b.global_scale is None)
        if a.global_scale is not None:
            np.testing.assert_array_equal(a.global_scale, b.global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS_FP4, ids=lambda f: f.name)
def test_device_weights_are_the_host_ones(rng: np.random.Generator, fmt: object) -> None:
    """quantize_weights on CuPy bf16 arrays (the device quantizer) gives the host bytes, scales and global scales on the
    device; expert_here reads them there as the host reads its own."""
    import cupy

    w13 = rng.standard_normal((2, 32, 72)).astype(BF16)
    w2 = rng.standard_normal((2, 72, 16)).astype(BF16)
    host = kernels.quantize_weights(w13, w2, fmt.name)
    dev = kernels.quantize_weights(cupy.asarray(w13), cupy.asarray(w2), fmt.name)
    for d, h, matrix in zip(dev, host, ("w13", "w2"), strict=True):
        assert isinstance(d.values, cupy.ndarray) and isinstance(d.scales, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(d.values), h.values)
        np.testing.assert_array_equal(cupy.asnumpy(d.scales), h.scales)
        if fmt.global_scaled:
            np.testing.assert_array_equal(cupy.asnumpy(d.global_scale), h.global_scale)
        np.testing.assert_array_equal(cupy.asnumpy(fmt.expert_here(d, 1, matrix)), fmt.expert(h, 1, matrix))


QUANTIZE_FP4_MAIN = r"""
#include "kernel.cu"
int main(int argc, char** argv) {
    int E = atoi(argv[1]), R = atoi(argv[2]), K = atoi(argv[3]), block = atoi(argv[4]), nv = atoi(argv[5]);
    std::string dir = argv[6];
    auto w = load<uint16_t>(dir + "/w.bin", (size_t)E * R * K);
    auto g = load<float>(dir + "/g.bin", (size_t)E);
    const int nb = (K + block - 1) / block;
    std::vector<unsigned char> values((size_t)E * R * K / 2, 0xAB), scales((size_t)E * R * nb, 0xCD);
    const long long threads = (long long)E * R * nb;
    for (long long b = 0; b < (threads + 127) / 128; ++b)
        for (int t = 0; t < 128; ++t) {               // no barriers, no warp operations: one thread after another
            blockIdx.x = (unsigned)b;
            threadIdx.x = t;
            quantize_fp4(w.data(), E, R, K, block, nv, g.data(), values.data(), scales.data());
        }
    FILE* f = fopen((dir + "/values.bin").c_str(), "wb"); fwrite(values.data(), 1, values.size(), f); fclose(f);
    f = fopen((dir + "/scales.bin").c_str(), "wb"); fwrite(scales.data(), 1, scales.size(), f); fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("fmt", FORMATS_FP4, ids=lambda f: f.name)
def test_device_quantizer_emulated_is_bitwise_the_host_one(rng: np.random.Generator, fmt: object) -> None:
    """kernels/quantize_cuda.py's quantize_fp4, run on the CPU by g++, gives the host quantizer's bytes and scale
    bytes (partial last blocks: k = 200 = 6 x 32 + 8; scales spread over 2^-12 .. 2^8 per row; a row of zeros; its
    global scales -- computed by the CuPy lines of quantize_fp4_matrix, here in NumPy -- the host's)."""
    import tempfile

    from kernels import quantize_cuda
    from tests.warp_checks import EMULATION_LOAD, EMULATION_PRELUDE, build_emulator, run_emulator

    experts, rows, k = 3, 20, 200
    w = (rng.standard_normal((experts, rows, k)) * np.exp(rng.uniform(-8, 6, (experts, rows, 1)))).astype(BF16)
    w[1, 4] = 0
    want = [fp4.quantize_expert(w[e].astype(np.float32), fmt.block, fmt.e4m3) for e in range(experts)]
    bits = (w.view(np.uint16) & 0x7FFF).reshape(experts, -1).max(axis=1).astype(np.uint32)  # the CuPy lines
    amax = (bits << 16).view(np.float32)
    globals_ = np.where(amax > 0, amax / np.float32(448.0 * 6.0), np.float32(1.0)).astype(np.float32)
    if fmt.e4m3:
        assert np.array_equal(globals_, np.array([g for _, _, g in want], np.float32))
    binary = build_emulator(quantize_cuda.SOURCE_FP4.render(),
                            EMULATION_PRELUDE + EMULATION_LOAD + QUANTIZE_FP4_MAIN)
    with tempfile.TemporaryDirectory() as tmp:
        w.tofile(f"{tmp}/w.bin")
        globals_.tofile(f"{tmp}/g.bin")
        run_emulator(binary, experts, rows, k, fmt.block, int(fmt.e4m3), tmp)
        values = np.fromfile(f"{tmp}/values.bin", np.uint8).reshape(experts, rows, k // 2)
        scales = np.fromfile(f"{tmp}/scales.bin", np.uint8).reshape(experts, rows, -(-k // fmt.block))
    assert np.array_equal(values, np.stack([v for v, _, _ in want]))
    assert np.array_equal(scales, np.stack([sc for _, sc, _ in want]))


def test_device_quantizer_compiles_for_sm90() -> None:
    from kernels import quantize_cuda
    from kernels.compile import offline_report

    [report] = offline_report(quantize_cuda.SOURCE_FP4)
    assert report.kernel == quantize_cuda.QUANTIZE_FP4 and report.spill_stores == report.stack_bytes == 0
