"""The 4-bit expert formats: ``mxfp4`` (what gpt-oss-120b and gpt-oss-20b ship) and ``nvfp4`` (NVIDIA's).

Both store e2m1 values -- 1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code
``s eem``: 0..7 the magnitudes in that order, | 8 the sign) -- two a byte along k, in the data contract's row layouts:
w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8, byte j of a row holding element 2j in its LOW nibble and 2j + 1 in its
high nibble (gpt-oss's checkpoints, its reference dequantizer ``gpt_oss/torch/weights.py``, and ModelOpt's NVFP4
checkpoints pack them so). Each ``kernels.formats.Quantized`` has layout ``"rows-e2m1x2"``. The scales are
stored as the checkpoints store them, one row of blocks along k per weight row (w13's gate and up rows are separate
rows, so never share a block):

``mxfp4``  one e8m0 byte per 32 values along k, value 2^(s - 127) (s = 255 is NaN): scales [E, 2I, ceil(H/32)] and
           [E, H, ceil(I/32)] uint8. Quantized as the OCP Microscaling Formats (MX) Specification v1.0 converts a
           block (section 6.3; E8M0 in section 5.4): shared exponent = floor(log2(amax)) - emax_elem, emax_elem = 2
           for e2m1 (its largest normal is 1.5 x 2^2), clamped to e8m0's [-127, 127] (a block of zeros: -127); the
           values are x / 2^shared_exp (exact) rounded to the nearest e2m1, ties to even, and those above 6 -- the
           block's largest can land in [6, 8) -- saturate to +-6 (the spec clamps normal numbers to the element's
           largest normal).
``nvfp4``  one e4m3 byte (float8_e4m3fn bits) per 16 values along k, scales [E, 2I, ceil(H/16)] and [E, H,
           ceil(I/16)] uint8, and a float32 global scale per matrix per expert (``Quantized.global_scale``, [E]; one
           for the whole of w13[e], gate and up together). Quantized as NVIDIA's two-level NVFP4 recipe (Transformer
           Engine's ``NVFP4BlockScaling``, TensorRT Model Optimizer's NVFP4 checkpoints, whose ``weight_scale_2`` is
           this global scale and ``weight_scale`` the block scales): global = amax(w[e]) / (448 x 6) (a matrix of
           zeros: 1); block scale = amax(block) / 6 / global rounded to the nearest e4m3 (ties to even, at most 448);
           values = x / (block scale x global) rounded to the nearest e2m1, ties to even, saturating at +-6 (the
           rounded block scale can sit below amax / 6). A block whose scale rounds to 0 (amax at most 2^-10 x 6 x
           global: half e4m3's smallest) stores zeros.

Dequantized (:func:`dequantize_rows`, what the reference reads): mxfp4 value x 2^(s - 127), exact in float32 (a 2-bit
significand times a power of two; the quantizer's largest is 6 x 2^125); nvfp4 (value x block scale) x global in
float32 -- the first product exact (2 x 4 significant bits), the second rounded once.

A partial last block (k not a multiple of 32 / 16: tiny's H = 136 is 4 x 32 + 8) covers the row's remaining values:
its scale comes from their amax alone, as if the row were zero-padded to whole blocks, and a kernel reads ceil(k/B)
scales a row. k itself must be even (two values a byte): ``Fp4Format.check_dims`` refuses an odd H or I with a
:class:`~kernels.geometry.FormatDimsError` naming it (the contract's multiples of 8 already imply it).

This module is their arithmetic, on plain arrays (it builds on :mod:`kernels.arrays` and :mod:`kernels.geometry`
only); the formats themselves -- ``kernels.formats.Fp4Format``, ``MXFP4`` and ``NVFP4`` in ``FORMATS`` -- are in
:mod:`kernels.formats`, which builds on this. The reference reads them; so do the batched FMA, tensor-core and
per-pair families (their loaders: kernels/batched/loaders_fp4.py; nvfp4's global scales as the kernels' argument) and
``kernels.moe_decode`` through them; ``kernels/quantize_cuda.py`` quantizes weights already on the GPU.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from kernels.arrays import FP8_E4M3 as FP8
from kernels.arrays import array_module
from kernels.geometry import FormatDimsError

LAYOUT = "rows-e2m1x2"  # row-major, two e2m1 values a byte along k, the even one in the low nibble
E2M1_MAX = 6.0
E2M1_EMAX = 2  # the exponent of e2m1's largest normal, 1.5 x 2^2 (emax_elem in the OCP MX spec)
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # by code
FP8_MAX = 448.0  # the largest finite e4m3fn value
E8M0_VALUES = np.append(np.ldexp(1.0, np.arange(-127, 128)), np.nan).astype(np.float32)  # 2^(s - 127); 255: NaN
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)  # float8_e4m3fn bits -> value
NVFP4_GLOBAL_DIVISOR = FP8_MAX * E2M1_MAX  # 448 x 6: the largest block scale times the largest value
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """The nearest e2m1 of each float (ties to even code, |x| > 6 saturating to +-6) as codes 0..15 (uint8); the
    sign is kept, so a negative that rounds to zero is -0 (code 8), as a hardware conversion gives it.

    Within each binade the e2m1 grid is evenly spaced -- 0.5 apart below 2, 1 apart in [2, 4), 2 apart from 4 -- and
    a grid point's index there has its code's parity, so round-half-even of |x| / step is the code's tie to even."""
    a = np.abs(x.astype(np.float32, copy=False))
    step = np.where(a < 2, np.float32(0.5), np.where(a < 4, np.float32(1), np.float32(2)))
    q = np.minimum(np.rint(a / step) * step, np.float32(E2M1_MAX))  # a / step: a power-of-two division, exact
    code = np.where(q < 2, q * 2, np.where(q < 4, q + 2, q / 2 + 4)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def pack_e2m1(codes: Any, what: str = "k") -> Any:
    """Codes [..., k] as bytes [..., k/2]: element 2j in the low nibble of byte j, 2j + 1 in the high one.
    :class:`FormatDimsError` naming ``what`` unless k is even."""
    k = int(codes.shape[-1])
    if k % 2:
        raise FormatDimsError(f"e2m1 values pack two a byte along k: {what} must be even, got {k}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_e2m1(packed: Any) -> Any:
    """Bytes [..., k/2] as codes [..., k] (the inverse of :func:`pack_e2m1`), where the arrays live."""
    xp = array_module(packed)
    return xp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * int(packed.shape[-1]))


def _pad_blocks(m: np.ndarray, block: int) -> np.ndarray:
    """[R, k] float32 as [R, ceil(k/block), block], zero-padded (a partial last block covers the remaining values)."""
    rows, k = m.shape
    nb = -(-k // block)
    padded = np.zeros((rows, nb * block), np.float32)
    padded[:, :k] = m
    return padded.reshape(rows, nb, block)


def quantize_mx(m: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """One matrix [R, k] (float32) as mxfp4: packed values [R, k/2] and e8m0 scale bytes [R, ceil(k/32)] (the OCP
    MX v1.0 conversion, section 6.3: see the module docstring)."""
    rows, k = m.shape
    if k % 2:
        raise FormatDimsError(f"e2m1 values pack two a byte along k: k must be even, got {k}")
    blocks = _pad_blocks(m, block)
    amax = np.abs(blocks).max(axis=2)
    _, exponent = np.frexp(amax)  # amax = f x 2^exponent, f in [0.5, 1): floor(log2(amax)) = exponent - 1, exactly
    shared = np.where(amax > 0, exponent - 1 - E2M1_EMAX, -127).clip(-127, 127)
    scaled = np.ldexp(blocks, -shared[:, :, None]).reshape(rows, -1)[:, :k]  # x / 2^shared_exp: exact
    return pack_e2m1(e2m1_codes(scaled)), (shared + 127).astype(np.uint8)


def nvfp4_global_scale(m: np.ndarray) -> np.float32:
    """NVFP4's per-tensor scale of ``m``: amax / (448 x 6) in float32 (a matrix of zeros: 1)."""
    amax = np.float32(np.abs(m).max()) if m.size else np.float32(0)
    return amax / np.float32(NVFP4_GLOBAL_DIVISOR) if amax > 0 else np.float32(1)


def quantize_nv(m: np.ndarray, global_scale: np.float32, block: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """One matrix [R, k] (float32) as nvfp4 under ``global_scale``: packed values [R, k/2] and e4m3 scale bytes
    [R, ceil(k/16)] (NVIDIA's recipe: see the module docstring)."""
    rows, k = m.shape
    if k % 2:
        raise FormatDimsError(f"e2m1 values pack two a byte along k: k must be even, got {k}")
    blocks = _pad_blocks(m, block)
    amax = np.abs(blocks).max(axis=2)
    wanted = np.minimum(amax / np.float32(E2M1_MAX) / global_scale, np.float32(FP8_MAX))
    scale_bits = wanted.astype(np.float32).astype(FP8).view(np.uint8)  # nearest e4m3, ties to even
    denominator = E4M3_VALUES[scale_bits] * global_scale
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(denominator[:, :, None] > 0, blocks / denominator[:, :, None], np.float32(0))
    return pack_e2m1(e2m1_codes(scaled.reshape(rows, -1)[:, :k])), scale_bits


def scale_shape(values_shape: tuple[int, ...], block: int) -> tuple[int, int, int]:
    """The scales' shape for packed values [E, R, k/2]: [E, R, ceil(k/block)]."""
    experts, rows, half = (int(d) for d in values_shape)
    return experts, rows, -(-2 * half // block)


def quantize_expert(m: np.ndarray, block: int, e4m3: bool) -> tuple[np.ndarray, np.ndarray, np.float32 | None]:
    """One expert's matrix [R, k] (float32) as (packed values, scale bytes, global scale or None): nvfp4 with
    ``e4m3``, else mxfp4."""
    if e4m3:
        global_scale = nvfp4_global_scale(m)
        return (*quantize_nv(m, global_scale, block), global_scale)
    return (*quantize_mx(m, block), None)


def dequantize_rows(values: Any, scales: Any, global_scale: Any, block: int, e4m3: bool) -> Any:
    """One expert's matrix, packed values [R, k/2] and scale bytes [R, ceil(k/block)] (and nvfp4's 0-d
    ``global_scale``), as float32 [R, k] where the arrays live: value x scale (exact), then x global (one rounding)."""
    xp = array_module(values)
    out = xp.asarray(E2M1_VALUES)[unpack_e2m1(values)]
    bits = scales if scales.dtype == np.uint8 else scales.view(np.uint8)
    scale = xp.asarray(E4M3_VALUES if e4m3 else E8M0_VALUES)[bits]
    out = out * xp.repeat(scale, block, axis=1)[:, : out.shape[1]]
    return out * global_scale if e4m3 else out


def check_arrays(fmt: str, name: str, weights: Any, xp: Any, block: int, e4m3: bool) -> None:
    """TypeError / ValueError naming ``name`` unless ``weights`` (a Quantized whose values the format's base check
    passed: ``xp``'s, 3-D, C-contiguous) holds ``fmt``'s arrays: values uint8 [E, R, k/2]; scales uint8 [E, R,
    ceil(k/block)] (on the host also as ml_dtypes' e4m3 / e8m0, the same bytes); nvfp4's global_scale float32 [E],
    ``xp``'s, C-contiguous (mxfp4: none)."""
    values, scales, gs = weights.values, weights.scales, weights.global_scale
    if values.dtype != np.uint8:
        raise TypeError(f"{name}.values must be uint8 (two e2m1 values a byte), got {values.dtype}")
    allowed = (np.dtype(np.uint8), FP8 if e4m3 else E8M0) if xp is np else (np.dtype(np.uint8),)
    if scales.dtype not in allowed:
        raise TypeError(f"{name}.scales must be {' or '.join(map(str, allowed))} ({'e4m3' if e4m3 else 'e8m0'} "
                        f"bytes), got {scales.dtype}")
    want = scale_shape(tuple(values.shape), block)
    if tuple(int(d) for d in scales.shape) != want:
        raise ValueError(f"{name}.scales must be {list(want)} for values of shape {tuple(values.shape)} (a byte per "
                         f"{block} values along k, a row's last block partial), got {tuple(scales.shape)}")
    if not e4m3:
        if gs is not None:
            raise ValueError(f"{name}.global_scale must be None: {fmt} weights carry none")
        return
    if gs is None:
        raise TypeError(f"{name}.global_scale is None: {fmt} weights carry a float32 global scale per expert")
    if array_module(gs) is not xp:
        raise TypeError(f"{name}.global_scale must be a {xp.__name__} array like x")
    if gs.dtype != np.float32:
        raise TypeError(f"{name}.global_scale must be float32, got {gs.dtype}")
    if tuple(int(d) for d in gs.shape) != (int(values.shape[0]),):
        raise ValueError(f"{name}.global_scale must be [E] = [{int(values.shape[0])}] (one per expert), got "
                         f"{tuple(gs.shape)}")
    if not gs.flags.c_contiguous:
        raise ValueError(f"{name}.global_scale must be C-contiguous")
