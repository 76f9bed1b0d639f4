"""Number formats in NumPy: bf16 rounding, the FP8 activation quantizers of production MoE paths, and the decode
step kernels' FP32 operation orders (twins of the CUDA C, bit for bit).

Everything here works on NumPy arrays. bf16 and FP8 e4m3 come from ``ml_dtypes`` (the dtype CuPy 14 uses
for its own bf16 arrays), conversions round to nearest even, FP8 saturates at +-448.

The twins (the order contract of the decode-step kernels, issue 59): :func:`dot_chain` (the lane chain and warp
butterfly of every GEMV), :func:`rms_norm_chain`, :func:`exp_rn` (an exp of correctly rounded FP32 mul/add only),
:func:`head_norm_rope`, :func:`chunked_attention`, :func:`router_chain`. Each runs the kernel's float32 operations
in the kernel's order, vectorized over everything the kernel runs in parallel (lanes, rows, tokens, heads); NumPy's
float32 add, multiply, divide and sqrt are IEEE round-to-nearest like the CUDA intrinsics ``__fadd_rn`` etc. A
``fmaf`` of two bf16 values is an add (their product is exact in FP32); :func:`fma_f32` emulates the general one.
"""

from __future__ import annotations

from typing import Any

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


# -- the decode-step kernels' FP32 orders (issue 59's contract) -------------------------------------------------------
LANES = 32  # a warp
CHAIN_ELEMS = 8  # bf16 per 16-byte load: a lane's chunk in dot_chain
_F32 = np.float32


def as_f32(arr: np.ndarray) -> np.ndarray:
    """bf16 widened exactly, float32 as is, other floats rounded to float32 (e.g. dequantized weights)."""
    arr = np.asarray(arr)
    if arr.dtype == BF16:
        return bf16_to_f32(arr)
    return arr.astype(np.float32, copy=False)


def warp_sum(lanes: np.ndarray) -> np.ndarray:
    """The butterfly ``for off in 16, 8, 4, 2, 1: v += shfl_xor(v, off)`` over the last axis (32 lanes, float32);
    returns lane 0's sum (every lane's: the adds commute)."""
    v = np.asarray(lanes, np.float32)
    if v.shape[-1] != LANES:
        raise ValueError(f"the last axis must hold the {LANES} lanes, got shape {v.shape}")
    lead = v.shape[:-1]
    for offset in (16, 8, 4, 2, 1):  # lane l ^ offset is lane l's partner: the other half of its pair of blocks
        pairs = v.reshape(lead + (LANES // (2 * offset), 2, offset))
        v = (pairs + pairs[..., ::-1, :]).reshape(lead + (LANES,))
    return v[..., 0]


def lane_chunks(arr: np.ndarray, elems: int, per_round: int = 1) -> np.ndarray:
    """The last axis [K] (K % elems == 0) as [rounds, per_round, 32, elems]: chunk c = (r * per_round + j) * 32 + l
    of ``elems`` values is lane l's j-th chunk of round r; chunks past K are zeros (the kernels' masked loads)."""
    k = arr.shape[-1]
    if k % elems:
        raise ValueError(f"the last axis ({k}) must be a multiple of {elems}")
    chunks = k // elems
    per = LANES * per_round
    padded = -(-chunks // per) * per
    if padded != chunks:
        arr = np.concatenate([arr, np.zeros(arr.shape[:-1] + ((padded - chunks) * elems,), arr.dtype)], axis=-1)
    return arr.reshape(arr.shape[:-1] + (padded // per, per_round, LANES, elems))


def dot_chain(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The lane chain of two bf16 vectors [..., K] (K % 8 == 0; leading axes broadcast) -> float32 [...].

    Lane l takes the 8-element chunks l, l + 32, ... in order, ``acc = fmaf(a[i], b[i], acc)`` from 0.0f (an FP32
    add here: a bf16 x bf16 product is exact in FP32, barring products below FP32's normal range), then the
    butterfly (:func:`warp_sum`). Lanes past K's end add +0.0f products (the kernels' zero-filled loads). float32
    inputs (dequantized weights) go through the same order, their products rounded first.
    """
    a, b = as_f32(a), as_f32(b)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b must agree on K (the last axis), got shapes {a.shape} and {b.shape}")
    ca, cb = lane_chunks(a, CHAIN_ELEMS), lane_chunks(b, CHAIN_ELEMS)
    acc = np.zeros(np.broadcast_shapes(ca.shape[:-4], cb.shape[:-4]) + (LANES,), np.float32)
    for r in range(ca.shape[-4]):
        for j in range(CHAIN_ELEMS):
            acc = acc + ca[..., r, 0, :, j] * cb[..., r, 0, :, j]
    return warp_sum(acc)


def rms_norm_chain(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of bf16 rows x [..., K] with bf16 weight g [K] -> bf16: ``ss = dot_chain(x, x)``, ``rs = 1 / sqrt(ss / K
    + eps)`` (IEEE, eps as float32), ``bf16((x * rs) * g)``."""
    xf = as_f32(x)
    k = xf.shape[-1]
    ss = dot_chain(xf, xf)
    rs = _F32(1.0) / np.sqrt(ss / _F32(k) + _F32(eps))
    return round_bf16((xf * rs[..., None]) * as_f32(g))


EXP_LOG2E = _F32(1.44269504)
EXP_LN2_HI = _F32(0.693145751953125)
EXP_LN2_LO = _F32(1.42860677e-06)
EXP_POLY = tuple(_F32(c) for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0))  # Horner, highest first


def exp_rn(x: np.ndarray) -> np.ndarray:
    """e^x in float32 with correctly rounded mul / add only (the kernels' ``exp_rn``, reproducible bit for bit):
    0 below -87; x = min(x, 88) by a compare (a NaN stays NaN, and so does the result); n = rint(x * log2 e);
    r = x - n ln2_hi - n ln2_lo; the degree-6 Taylor polynomial in r by Horner; ldexp(p, n). Within 3 ulp of e^x
    on [-87, 88] (2.96 at most, 0.5 % of inputs beyond 2: the Taylor tail alone is ~1.7 ulp at r = -ln2 / 2)."""
    x = np.asarray(x, np.float32)
    small = x < _F32(-87.0)
    with np.errstate(invalid="ignore"):
        x = np.where(small, _F32(0.0), np.where(x > _F32(88.0), _F32(88.0), x))  # -inf: no inf - inf on the way
    n = np.rint(x * EXP_LOG2E)
    r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    with np.errstate(invalid="ignore"):
        out = np.ldexp(p, np.where(np.isnan(n), _F32(0.0), n).astype(np.int32)).astype(np.float32, copy=False)
    return np.where(small, _F32(0.0), out)


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fmaf(a, b, c)``: a * b + c rounded once to float32, for float32 a, b whose product is exact in float64 (at
    most 53 significant bits: a bf16 times a float32 is 32). The float64 sum s and its error (TwoSum) decide the one
    case where rounding s to float32 would round twice wrongly: s exactly halfway between two floats. Exact for
    results in float32's normal range."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    bits = s.view(np.uint64) if isinstance(s, np.ndarray) else np.asarray(s).view(np.uint64)
    tie = (bits & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)
    fix = tie & (err != 0)
    if np.any(fix):
        s = np.where(fix, np.nextafter(s, np.copysign(np.inf, err)), s)
    with np.errstate(over="ignore"):
        return s.astype(np.float32)


def rope_angles(positions: Any, head_dim: int, theta: float) -> np.ndarray:
    """RoPE's angles [len(positions), head_dim / 2] in float64: position * theta^(-2i / head_dim) (``rotate_half``
    pairs i, i + head_dim / 2). The reference's oracle takes their cos / sin in float64, the kernels read them as
    float32 tables (:func:`rope_tables`)."""
    half = int(head_dim) // 2
    inv_freq = float(theta) ** (-np.arange(half, dtype=np.float64) * 2.0 / int(head_dim))
    return np.asarray(positions).astype(np.float64).reshape(-1, 1) * inv_freq


def rope_tables(positions: Any, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """The float32 cos / sin tables [len(positions), head_dim / 2] the decode kernels read: :func:`rope_angles`
    rounded once."""
    angles = rope_angles(positions, head_dim, theta)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def head_lane_chain(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Item 4's head layout: element i in lane i % 32, register i // 32; each lane ``fmaf(a, b, acc)`` over its
    registers in order from 0.0f, then the butterfly. [..., D] (D % 32 == 0, leading axes broadcast) -> [...]."""
    a, b = as_f32(a), as_f32(b)
    d = a.shape[-1]
    if d % LANES or b.shape[-1] != d:
        raise ValueError(f"head rows must be [..., D] alike with D a multiple of 32, got {a.shape} and {b.shape}")
    ra = a.reshape(a.shape[:-1] + (d // LANES, LANES))
    rb = b.reshape(b.shape[:-1] + (d // LANES, LANES))
    acc = np.zeros(np.broadcast_shapes(ra.shape[:-2], rb.shape[:-2]) + (LANES,), np.float32)
    for r in range(d // LANES):
        acc = acc + ra[..., r, :] * rb[..., r, :]
    return warp_sum(acc)


def head_norm_rope(x: np.ndarray, g: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm then RoPE of bf16 head rows x [..., D] -> bf16 [..., D] (item 4).

    ``ss`` by :func:`head_lane_chain`; ``rs = 1 / sqrt(ss / D + eps)``; ``xn = (x * rs) * g`` kept in FP32; with
    half = D / 2: ``out[i] = xn[i] cos[i] - xn[i + half] sin[i]``, ``out[i + half] = xn[i + half] cos[i] + xn[i]
    sin[i]`` (each product rounded, then the add), rounded once to bf16. ``cos``, ``sin``: float32 [..., half]
    broadcasting against x[..., :half] (the host's table, :func:`rope_tables`).
    """
    xf = as_f32(x)
    d = xf.shape[-1]
    ss = head_lane_chain(xf, xf)
    rs = _F32(1.0) / np.sqrt(ss / _F32(d) + _F32(eps))
    xn = (xf * rs[..., None]) * as_f32(g)
    half = d // 2
    cos, sin = np.asarray(cos, np.float32), np.asarray(sin, np.float32)
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
        scores = head_lane_chain(qf[None], k_chunk[:, :, None, :]) * scale  # [P, kv, G]
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
        ls.append(warp_sum(lanes).reshape(heads))
        os_.append(o.reshape(heads, dim))
    return np.stack(ms), np.stack(ls), np.stack(os_)


def chunked_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, split: int) -> np.ndarray:
    """One sequence's decode attention in the kernels' order (item 6): q [heads, D] bf16 over keys, values
    [n, kv_heads, D] bf16 -> [heads, D] bf16.

    Query head j reads KV head j // (heads / kv_heads). The n positions split into chunks of ``split`` (a multiple
    of 32; the last shorter). Per chunk: scores ``head_lane_chain(q, k) * scale`` (scale = float32(1 / sqrt(D)) from
    float64), its max m, weights ``exp_rn(s - m)``, their sum by lanes (lane j: positions j, j + 32, ... of the
    chunk) then the butterfly, and o = sum over positions in order of ``w * v`` (products rounded, then added).
    Combine in chunk order: M = max m, a = exp_rn(m - M), L = sum a * l, O = sum a * o (sequential from 0),
    ``bf16(O / L)``.
    """
    q, keys, values = as_f32(q), as_f32(keys), as_f32(values)
    heads, d = q.shape
    n, kv_heads = keys.shape[:2]
    if split < LANES or split % LANES:
        raise ValueError(f"split must be a positive multiple of 32, got {split}")
    if keys.shape != (n, kv_heads, d) or values.shape != keys.shape or n < 1 or heads % kv_heads:
        raise ValueError(f"q [heads, D], keys and values [n >= 1, kv_heads, D] with heads a multiple of kv_heads "
                         f"expected, got {q.shape}, {keys.shape}, {values.shape}")
    group = heads // kv_heads
    chunks = -(-n // split)
    padded = chunks * split
    qg = q.reshape(kv_heads, group, 1, d)
    kt = np.zeros((kv_heads, 1, padded, d), np.float32)
    kt[:, 0, :n] = keys.transpose(1, 0, 2)
    vt = np.zeros((kv_heads, 1, padded, d), np.float32)
    vt[:, 0, :n] = values.transpose(1, 0, 2)
    scale = _F32(1.0 / np.sqrt(np.float64(d)))
    scores = head_lane_chain(qg, kt) * scale  # [kv, G, padded]
    live = np.arange(padded) < n
    scores = np.where(live, scores, -np.inf).reshape(kv_heads, group, chunks, split)
    m = scores.max(axis=-1)  # [kv, G, C]
    with np.errstate(invalid="ignore"):
        w = np.where(live.reshape(chunks, split), exp_rn(scores - m[..., None]), _F32(0.0))
    l_sum = warp_sum(_lane_sums(w.reshape(kv_heads, group, chunks, split // LANES, LANES)))  # [kv, G, C]
    vc = vt.reshape(kv_heads, 1, chunks, split, d)
    o = np.zeros((kv_heads, group, chunks, d), np.float32)
    for p in range(min(split, n)):
        o = o + w[..., p, None] * vc[:, :, :, p]
    big = m.max(axis=-1)  # [kv, G]
    a = exp_rn(m - big[..., None])
    total = np.zeros((kv_heads, group), np.float32)
    out = np.zeros((kv_heads, group, d), np.float32)
    for c in range(chunks):
        total = total + a[..., c] * l_sum[..., c]
        out = out + a[..., c, None] * o[:, :, c]
    return round_bf16(out / total[..., None]).reshape(heads, d)


def _lane_sums(regs: np.ndarray) -> np.ndarray:
    """[..., registers, 32] -> [..., 32]: each lane adds its registers in order from 0.0f."""
    acc = np.zeros(regs.shape[:-2] + (LANES,), np.float32)
    for r in range(regs.shape[-2]):
        acc = acc + regs[..., r, :]
    return acc


def router_chain(xn: np.ndarray, w_router: np.ndarray, top_k: int, renormalize: bool = True,
                 exp: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """The fused router's numbers (item 7): xn [T, H] bf16, w_router [E, H] bf16 -> (ids [T, K] int32, weights [T, K]
    float32).

    Logits by :func:`dot_chain`; the max (NaNs skipped, as fmaxf does); p[e] = exp(logit - max) (``exp``: default
    :func:`exp_rn`); their sum by lanes (lane l: experts l, l + 32, ...) then the butterfly; p /= sum (IEEE); K rounds
    of argmax (greater p, equal p -> lower id; NaN never chosen; none left -> id -1, weight NaN); with
    ``renormalize`` each chosen p divided by the chosen ones' sum in slot order.
    """
    exp = exp_rn if exp is None else exp
    logits = dot_chain(np.asarray(xn)[:, None, :], np.asarray(w_router)[None])  # [T, E]
    tokens, experts = logits.shape
    top_k = int(top_k)
    top = np.fmax.reduce(logits, axis=1)
    with np.errstate(invalid="ignore"):
        p = np.asarray(exp(logits - top[:, None]), np.float32)
    padded = -(-experts // LANES) * LANES
    lanes = np.zeros((tokens, padded), np.float32)
    lanes[:, :experts] = p
    with np.errstate(invalid="ignore"):
        probs = p / warp_sum(_lane_sums(lanes.reshape(tokens, padded // LANES, LANES)))[:, None]
    work = np.where(probs >= 0, probs, _F32(-1.0))  # NaN: never a candidate
    ids = np.full((tokens, top_k), -1, np.int32)
    weights = np.full((tokens, top_k), np.nan, np.float32)
    chosen = np.zeros(tokens, np.float32)
    rows = np.arange(tokens)
    for k in range(top_k):
        best = np.argmax(work, axis=1)  # the first maximum: ties to the lower id
        value = work[rows, best]
        found = value >= 0
        ids[found, k] = best[found]
        weights[found, k] = value[found]
        chosen = chosen + np.where(found, value, np.float32(np.nan))
        work[rows[found], best[found]] = -1.0
    if renormalize:
        with np.errstate(invalid="ignore"):
            weights = weights / chosen[:, None]
    return ids, weights
