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
# The decode step's order contract (issue #59) in NumPy float32: what the decode kernels compute, bit for bit.
# ---------------------------------------------------------------------------------------------------
_EXP_COEFFS = tuple(np.float32(c) for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0))


def exp_rn(x: np.ndarray) -> np.ndarray:
    """exp in float32 from correctly rounded multiplies and adds only, bitwise the kernels' ``exp_rn``
    (kernels/decode/device.py): 0 below -87, x clamped to 88 (``fmin``: NaN becomes 88, as ``fminf``), n =
    rint(x log2 e), r = x - n ln2 (two parts), a degree-6 Horner polynomial in r, times 2^n."""
    f32 = np.float32
    x = np.asarray(x, f32)
    with np.errstate(invalid="ignore"):  # -inf: NaN on the way, 0 in the end
        y = np.fmin(x, f32(88.0))
        n = np.rint(y * f32(1.44269504))
        r = y - n * f32(0.693145751953125)
        r = r - n * f32(1.42860677e-06)
        p = np.full_like(r, _EXP_COEFFS[0])
        for c in _EXP_COEFFS[1:]:
            p = p * r + c
        out = np.ldexp(p, np.where(np.isfinite(n), n, 0).astype(np.int32)).astype(f32)
    return np.where(x < f32(-87.0), f32(0.0), out).astype(f32)


def lane_butterfly(acc: np.ndarray) -> np.ndarray:
    """The warp butterfly (``warp_sum``: ``v += shfl_xor(v, off)`` for off 16 .. 1) over the last axis (32 lanes'
    float32 partials): every lane ends with the same value, this one."""
    acc = np.asarray(acc, np.float32)
    for off in (16, 8, 4, 2, 1):
        acc = acc[..., :off] + acc[..., off : 2 * off]
    return acc[..., 0]


def head_dot(products: np.ndarray) -> np.ndarray:
    """The head lane chain over the last axis (D, a multiple of 32) of exact float32 products (bf16 x bf16):
    element i in lane i % 32, register i // 32, each lane's chain in register order, then the butterfly."""
    products = np.asarray(products, np.float32)
    regs = products.reshape(products.shape[:-1] + (-1, 32))
    acc = np.zeros(regs.shape[:-2] + (32,), np.float32)
    for r in range(regs.shape[-2]):
        acc = acc + regs[..., r, :]
    return lane_butterfly(acc)


def head_norm_rope(x: np.ndarray, weight: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm then RoPE of bf16 rows x [rows, D] (weight [D] bf16; cos, sin [rows, D/2] float32, each row
    its token's position): the contract's item 4, bitwise ``qk_norm_rope_append``. Returns bf16 [rows, D]."""
    f32 = np.float32
    xf, g = bf16_to_f32(x), bf16_to_f32(weight)
    dim = xf.shape[-1]
    half = dim // 2
    ss = head_dot(xf * xf)
    rs = f32(1.0) / np.sqrt(ss / f32(dim) + f32(eps))
    xn = (xf * rs[..., None]) * g
    first, second = xn[..., :half], xn[..., half:]
    return round_bf16(np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1))


def attention_partials(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                       split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk's (m_c, l_c, o_c) of :func:`chunked_attention` (contract item 6), float32: m and l [chunks, heads],
    o [chunks, heads, D] -- what ``decode_attention`` writes to its workspace."""
    f32 = np.float32
    heads, dim = q.shape
    n, kv_heads = keys.shape[:2]
    if keys.shape != values.shape or keys.shape[2] != dim or n < 1 or heads % kv_heads:
        raise ValueError(f"keys, values must be [n >= 1, kv_heads | heads, D = {dim}], got {keys.shape}, "
                         f"{values.shape}")
    if split < 32 or split % 32:
        raise ValueError(f"split must be a positive multiple of 32, got {split}")
    group = heads // kv_heads
    qf = bf16_to_f32(q).reshape(kv_heads, group, dim)
    kf, vf = bf16_to_f32(keys), bf16_to_f32(values)
    scale = f32(1.0 / np.sqrt(np.float64(dim)))
    ms, ls, os_ = [], [], []
    for start in range(0, n, split):
        k_chunk, v_chunk = kf[start : start + split], vf[start : start + split]
        count = len(k_chunk)
        scores = head_dot(qf[None] * k_chunk[:, :, None, :]) * scale  # [P, kv, G]
        m = scores.max(axis=0)
        w = exp_rn(scores - m)
        padded = np.zeros((-(-count // 32) * 32,) + w.shape[1:], f32)
        padded[:count] = w
        lanes = np.zeros(w.shape[1:] + (32,), f32)
        for row in padded.reshape(-1, 32, *w.shape[1:]):  # lane j: positions j, j + 32, ... in order
            lanes = lanes + np.moveaxis(row, 0, -1)
        o = np.zeros((kv_heads, group, dim), f32)
        for p in range(count):
            o = o + w[p][..., None] * v_chunk[p][:, None, :]
        ms.append(m.reshape(heads))
        ls.append(lane_butterfly(lanes).reshape(heads))
        os_.append(o.reshape(heads, dim))
    return np.stack(ms), np.stack(ls), np.stack(os_)


def chunked_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, split: int) -> np.ndarray:
    """One sequence's decode attention in the contract's order (item 6), bitwise ``decode_attention`` with SPLIT =
    ``split``: q [heads, D] bf16 over keys, values [n, kv_heads, D] bf16 (query head j reads KV head j // (heads /
    kv_heads)) -> [heads, D] bf16. Chunks of ``split`` positions give (m_c, l_c, o_c) each
    (:func:`attention_partials`: scores by the head lane chain times (float)(1 / sqrt(D)); weights exp_rn(score -
    m_c); l_c by the lane chain over positions; o_c in position order), combined in chunk order with a_c =
    exp_rn(m_c - M); out = bf16(O / L)."""
    ms, ls, os_ = attention_partials(q, keys, values, split)
    big_m = ms.max(axis=0)
    total_l = np.zeros_like(big_m)
    total_o = np.zeros_like(os_[0])
    for m, l_c, o in zip(ms, ls, os_, strict=True):
        a = exp_rn(m - big_m)
        total_l = total_l + a * l_c
        total_o = total_o + a[..., None] * o
    return round_bf16(total_o / total_l[..., None])
