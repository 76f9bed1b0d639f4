"""Number formats in NumPy: bf16 rounding and the FP8 activation quantizers of production MoE paths.

Everything here works on NumPy arrays. bf16 and FP8 e4m3 come from ``ml_dtypes`` (the dtype CuPy 14 uses
for its own bf16 arrays), conversions round to nearest even, FP8 saturates at +-448.
"""

from __future__ import annotations

import numpy as np

from kernels.contract import BF16, FP8_E4M3

FP8_E4M3_MAX = 448.0
FP8_GROUP = 128  # one fp32 scale per 128 consecutive elements of a token (DeepSeek-V3 style block FP8)
MX_BLOCK = 32  # OCP MX: one power-of-two (E8M0) scale per 32 elements
MX_E4M3_EMAX = 8  # exponent of the largest normal e4m3 value (448 = 1.75 * 2**8)

QUANT_MODES = (None, "fp8", "mxfp8")


def bf16_to_f32(arr: np.ndarray) -> np.ndarray:
    """Exact widening of a bf16 array to float32 (a 16-bit shift, no rounding involved)."""
    bits = np.ascontiguousarray(arr).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def round_bf16(arr: np.ndarray) -> np.ndarray:
    """Round to the nearest bf16 (ties to even); returned as a bf16 array."""
    return np.asarray(arr, dtype=np.float32).astype(BF16)


def through_bf16(arr: np.ndarray) -> np.ndarray:
    """Round to bf16 and widen back to float32: what a bf16 store followed by a load does."""
    return bf16_to_f32(round_bf16(arr))


def silu(gate: np.ndarray) -> np.ndarray:
    """SiLU(g) = g * sigmoid(g), in the dtype of ``gate``, without overflow warnings for large |g|."""
    with np.errstate(over="ignore"):
        return gate / (1.0 + np.exp(-gate))


def _grouped(arr: np.ndarray, group: int) -> tuple[np.ndarray, int]:
    """View the last axis in groups of ``group`` (zero-padding a partial last group)."""
    n = arr.shape[-1]
    pad = (-n) % group
    if pad:
        arr = np.concatenate([arr, np.zeros(arr.shape[:-1] + (pad,), arr.dtype)], axis=-1)
    return arr.reshape(arr.shape[:-1] + (-1, group)), n


def quantize_fp8_groups(arr: np.ndarray, group: int = FP8_GROUP) -> np.ndarray:
    """FP8 e4m3 with one float32 scale ``amax / 448`` per ``group`` elements of the last axis.

    Returns the dequantised float32 values (what the next GEMM sees). An all-zero group keeps scale 1.
    """
    grouped, n = _grouped(np.asarray(arr, np.float32), group)
    amax = np.abs(grouped).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(grouped / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_E4M3)
    deq = q.astype(np.float32) * scale
    return deq.reshape(deq.shape[:-2] + (-1,))[..., :n]


def quantize_mxfp8(arr: np.ndarray) -> np.ndarray:
    """MXFP8 (OCP MX v1.0): e4m3 elements sharing a power-of-two scale per 32 elements.

    shared exponent = floor(log2(amax)) - 8, so the block's largest element lands in e4m3's top binade;
    elements beyond 448 after scaling saturate. Returns dequantised float32 values.
    """
    grouped, n = _grouped(np.asarray(arr, np.float32), MX_BLOCK)
    amax = np.abs(grouped).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(amax)) - MX_E4M3_EMAX, 0.0)
    scale = np.exp2(exponent).astype(np.float32)
    q = np.clip(grouped / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_E4M3)
    deq = q.astype(np.float32) * scale
    return deq.reshape(deq.shape[:-2] + (-1,))[..., :n]


def quantize(arr: np.ndarray, quant: str | None) -> np.ndarray:
    """Apply activation quantization ``quant`` (None, "fp8" or "mxfp8"); float32 in, float32 out."""
    if quant is None:
        return np.asarray(arr, np.float32)
    if quant == "fp8":
        return quantize_fp8_groups(arr)
    if quant == "mxfp8":
        return quantize_mxfp8(arr)
    raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")


def bf16_ulp(values: np.ndarray) -> np.ndarray:
    """The spacing of bf16 numbers at each value (8 significant bits): 2**(floor(log2|v|) - 7)."""
    mag = np.abs(np.asarray(values, np.float64))
    tiny = np.float64(2.0**-133)  # smallest bf16 subnormal spacing
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.maximum(mag, np.float64(2.0**-126))))
    return np.maximum(np.exp2(exponent - 7), tiny)


def rel_l2(result: np.ndarray, oracle: np.ndarray) -> float:
    """||result - oracle|| / ||oracle|| in float64."""
    result = np.asarray(result, np.float64)
    oracle = np.asarray(oracle, np.float64)
    denom = np.linalg.norm(oracle)
    return float(np.linalg.norm(result - oracle) / denom) if denom else float(np.linalg.norm(result))


def max_abs(result: np.ndarray, oracle: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(result, np.float64) - np.asarray(oracle, np.float64))))


def min_cosine(result: np.ndarray, oracle: np.ndarray) -> float:
    """Smallest cosine similarity between matching rows (tokens) of ``result`` and ``oracle``."""
    result = np.asarray(result, np.float64).reshape(-1, np.shape(result)[-1])
    oracle = np.asarray(oracle, np.float64).reshape(-1, np.shape(oracle)[-1])
    dots = np.einsum("th,th->t", result, oracle)
    norms = np.linalg.norm(result, axis=1) * np.linalg.norm(oracle, axis=1)
    return float(np.min(dots / np.where(norms > 0, norms, 1.0)))


# ---------------------------------------------------------------------------------------------------
# Twins of the decode-step kernels' FP32 order (/work/spec: the order contract), bit for bit in NumPy float32
# ---------------------------------------------------------------------------------------------------
EXP_LOG2E = np.float32(1.44269504)
EXP_LN2_HI = np.float32(0.693145751953125)
EXP_LN2_LO = np.float32(1.42860677e-06)
EXP_COEFFS = tuple(np.float32(1.0) / np.float32(d) for d in (720, 120, 24, 6, 2, 1, 1))  # Horner, highest first


def exp_rn(x: np.ndarray) -> np.ndarray:
    """exp in float32 from correctly rounded multiplies and adds only (no FMA), what the kernels' ``exp_rn`` does
    op for op: 0 below -87, the argument clamped at 88 (``fminf``: NaN becomes 88), n = rint(x log2 e), a two-part
    ln 2 reduction, a degree-6 Horner polynomial, ldexp by n."""
    x = np.asarray(x, np.float32)
    under = x < np.float32(-87.0)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.fmin(x, np.float32(88.0))
        n = np.rint(x * EXP_LOG2E)
        r = x - n * EXP_LN2_HI
        r = r - n * EXP_LN2_LO
        p = np.full_like(r, EXP_COEFFS[0])
        for c in EXP_COEFFS[1:]:
            p = p * r + c
        out = np.ldexp(p, n.astype(np.int32)).astype(np.float32)
    return np.where(under, np.float32(0.0), out).astype(np.float32)


def dot_chain(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The kernels' lane chain of two bf16 vectors over the last axis (K % 8 == 0), broadcast over the others:
    lane l (0..31) sums its 8-element chunks l, l + 32, ... in order from 0.0f (bf16 products are exact in float32,
    so ``acc + a * b`` is the kernel's ``fmaf``), then the butterfly ``acc += shfl_xor(acc, off)`` for off = 16 ..
    1. Returns float32 of the broadcast shape without the last axis."""
    a32, b32 = bf16_to_f32(np.asarray(a, BF16)), bf16_to_f32(np.asarray(b, BF16))
    a32, b32 = np.broadcast_arrays(a32, b32)
    k = a32.shape[-1]
    if k % 8:
        raise ValueError(f"dot_chain needs a length that is a multiple of 8, got {k}")
    chunks = k // 8
    rounds = -(-chunks // 32)
    pad = rounds * 32 * 8 - k
    shape = a32.shape[:-1]
    if pad:
        zeros = np.zeros(shape + (pad,), np.float32)
        a32, b32 = np.concatenate([a32, zeros], axis=-1), np.concatenate([b32, zeros], axis=-1)
    products = (a32 * b32).reshape(shape + (rounds, 32, 8))  # [..., round, lane, element]
    acc = np.zeros(shape + (32,), np.float32)
    for r in range(rounds):
        for i in range(8):
            acc = acc + products[..., r, :, i]
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ off]
    return acc[..., 0].astype(np.float32)


def rms_norm_chain(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of bf16 rows x [..., K] with the bf16 weight g [K] in the kernels' order: ss = dot_chain(x, x),
    rs = 1 / sqrt(ss / K + eps) in float32 (IEEE division and square root), xn = bf16((x * rs) * g). bf16 out."""
    x = np.asarray(x, BF16)
    k = x.shape[-1]
    ss = dot_chain(x, x)
    rs = np.float32(1.0) / np.sqrt(ss / np.float32(k) + np.float32(eps))
    xn = (bf16_to_f32(x) * rs[..., None].astype(np.float32)) * bf16_to_f32(np.asarray(g, BF16))
    return xn.astype(np.float32).astype(BF16)
