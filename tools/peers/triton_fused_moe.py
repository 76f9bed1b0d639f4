"""The serving engines' fused-MoE design, re-implemented here in Triton: the peer the lab's paths are measured against.

Not vLLM's or SGLang's code: this lab's own implementation of the design they ship (vLLM
``model_executor/layers/fused_moe``): per layer, five launches --

1. ``align``: the T*K (token, slot) pairs sorted by expert, each expert's run padded to a multiple of ``BLOCK_M``
   (pad slots hold the sentinel T*K), the expert of every ``BLOCK_M`` block, and the padded total -- on the device;
2. ``gemm_gate_up``: a grouped GEMM, one program per (M block of sorted pairs, N block of 2I): the block's tokens'
   x rows gathered, times its expert's w13 rows, fp32 accumulators, stored bf16 [T*K, 2I];
3. ``silu_mul``: ``bf16(SiLU(gate) * up)`` [T*K, I];
4. ``gemm_down``: the same grouped GEMM over w2, the routing weight applied to the fp32 accumulator, stored bf16
   [T*K, H];
5. ``sum``: each token's K rows summed in fp32, one bf16 rounding.

The numerics are ``reference.moe_decode(mode="classical")``'s (bf16 gate/up, activation and per-pair buffers) but
for one rounding: the routing weight is applied before the per-pair bf16 store, as vLLM does. Tile configs
(``CONFIGS``) are of the kind vLLM ships tuned per GPU; ``python -m tools.peers --tune`` picks one per (shape, T).

The W8A8 form (``w8a8=True``: fp8-block128 weights, what serving engines run on FP8 checkpoints) adds the two
activation quantizations of that design: x per token and 128 channels before the gate/up GEMM (``quant_x``), the
SiLU*up activation likewise before the down GEMM (fused into ``silu_mul``), each an e4m3 value with a float32
scale amax / 448 per group; both GEMMs multiply e4m3 by e4m3 on the tensor cores in 128-wide k blocks and scale each
block's fp32 partial by the activation's and the weight block's scales: ``reference.moe_decode(mode="classical",
quant="fp8", weight_format="fp8-block128")`` up to the summation order and the routing weight's place.
The W4A16 form (``w4a16=True``: mxfp4 weights, what serving engines run on MXFP4 checkpoints on Hopper, whose tensor
cores have no 4-bit inputs) keeps x and the activation bf16 and widens the weights in registers: each k step loads
the packed bytes of a [BLOCK_K/2, BLOCK_N] tile (byte j of a row holds k = 2j in its low nibble, 2j + 1 in its high
one), widens both nibbles to e2m1 values times their 32-group's e8m0 scale (exact: a 2-bit significand times a power
of two is a bf16), and multiplies them on the tensor cores by x's even and odd k columns, bf16 x bf16 into the fp32
accumulators: ``reference.moe_decode(mode="classical", weight_format="mxfp4")`` up to the summation order and the
routing weight's place.
Every buffer is allocated at build time and every launch goes on CuPy's current stream, so the layer is captured in
the bench's CUDA graph like the lab's paths.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils.dlpack
import triton
import triton.language as tl

from kernels.contract import Dims
from tools.peers.tile_configs import CONFIGS, DEFAULT_CONFIG, W4A16_CONFIGS, W8A8_CONFIGS, TileConfig  # noqa: F401

GROUP = 128  # activation and weight scale blocks along k
MX_GROUP = 32  # mxfp4's values per e8m0 scale along k
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the CPU tests)


@triton.jit
def _round_e4m3(v):
    """fp32 -> the nearest e4m3fn value (ties to even), still fp32, for |v| <= 448: written out because Triton's CPU
    interpreter rounds wrongly across binades on a plain cast; the cast of the result is then exact everywhere."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)  # a >= 0: the sign bit is clear, so int32 arithmetic is the bits'
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # & 0xFFF00000
    tiny = (a * 512.0 + 12582912.0) - 12582912.0  # below 2^-6: multiples of 2^-9 (1.5 * 2^23 rounds to integers)
    r = tl.where(a < 0.015625, tiny * 0.001953125, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_group(v, mask):
    """One 128-group of fp32 values (``mask``: the real ones) -> (e4m3 values, scale amax / 448; 1 for zeros)."""
    amax = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = _round_e4m3(tl.minimum(tl.maximum(v / scale, -448.0), 448.0))
    return q.to(tl.float8e4nv), scale


@triton.jit
def _quant_rows(src_ptr, q_ptr, scale_ptr, k, groups, BLOCK: tl.constexpr):
    """Program (row, group): row's elements [128 g, 128 g + 128) of bf16 ``src`` as e4m3 ``q`` and their scale."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    v = tl.load(src_ptr + row * k + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_group(v, mask)
    tl.store(q_ptr + row * k + offs, q, mask=mask)
    tl.store(scale_ptr + row * groups + group, scale)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15: 3 magnitude bits, bit 3 the sign) -> their values in fp32. The magnitudes 0, 0.5,
    1, 1.5, 2, 3, 4, 6 of codes 0..7 are three lines, code / 2, code - 2 and 2 code - 8: exact float arithmetic on
    small integers, where placing the bits in a float's exponent and mantissa would make code 1 (0.5) a subnormal
    pattern that needs a flush-free multiply to come out right; a few ALU operations a value, beside the memory
    that decode waits on."""
    mag = (code & 7).to(tl.float32)
    v = tl.where(mag < 4.0, mag * 0.5, tl.where(mag < 6.0, mag - 2.0, mag * 2.0 - 8.0))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e8m0(s):
    """e8m0 scale bytes (int32) -> 2^(s - 127) in fp32, by its bits: s << 23 is that float for s in 1..254; s = 0 is
    the subnormal 2^-127 (bits 0x400000), s = 255 NaN."""
    bits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _widen_mxfp4(packed, s, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A [BLOCK_K/2, BLOCK_N] tile of packed bytes (int32; row j: k = 2j low nibble, 2j + 1 high) and its
    [BLOCK_K/32, BLOCK_N] scale bytes -> the bf16 weights at the even and the odd k, each value times its 32-group's
    scale (exact: a 2-bit significand times a power of two), the scale broadcast over the group's 16 bytes."""
    scale = _e8m0(s)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)), (BLOCK_K // 2, BLOCK_N))
    even = (_e2m1(packed & 15) * scale).to(tl.bfloat16)
    odd = (_e2m1(packed >> 4) * scale).to(tl.bfloat16)
    return even, odd


@triton.jit
def _mxfp4_k_loop(acc, a_rows, live, w_ptr, w_scale_ptr, offs_n, n, k, stride_wn, stride_wsn, DOT_F32: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc`` + A[rows, :k] @ W.T for one expert's mxfp4 W (``w_ptr``: its packed [n, k/2] bytes, ``w_scale_ptr``
    its [n, ceil(k/32)] e8m0 bytes): per k step, the weight tile widened in registers and two bf16 dots, x's even k
    columns by the low nibbles, its odd ones by the high. Past k (a partial last tile or scale group) the bytes read
    as 0 and x as 0."""
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // 32)  # the tile's scale groups (32 values, 16 bytes each)
    n_ok = (offs_n < n)[None, :]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    s_cols = w_scale_ptr + offs_n.to(tl.int64)[None, :] * stride_wsn
    for k0 in range(0, tl.cdiv(k, BLOCK_K)):
        kb = k0 * (BLOCK_K // 2) + offs_b  # byte index along the row: k = 2 kb and 2 kb + 1
        kg = k0 * (BLOCK_K // 32) + offs_g
        packed = tl.load(w_cols + kb[:, None], mask=(kb[:, None] < k // 2) & n_ok, other=0).to(tl.int32)
        s = tl.load(s_cols + kg[:, None], mask=(kg[:, None] < tl.cdiv(k, 32)) & n_ok, other=127).to(tl.int32)
        w_even, w_odd = _widen_mxfp4(packed, s, BLOCK_K, BLOCK_N)
        # x's even and odd k columns loaded apart: x is BLOCK_M rows, the weight tile the bulk of the bytes, which so
        # stays one contiguous load and is never interleaved in registers
        a_mask = live[:, None] & (kb[None, :] < k // 2)
        a_even = tl.load(a_rows + 2 * kb[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows + 2 * kb[None, :] + 1, mask=a_mask, other=0.0)
        if DOT_F32:  # Triton's CPU interpreter reads bf16 dot operands as integers: widen them there
            acc = tl.dot(a_even.to(tl.float32), w_even.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a_odd.to(tl.float32), w_odd.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a_even, w_even, acc)
            acc = tl.dot(a_odd, w_odd, acc)
    return acc


@triton.jit
def _align(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, pairs, experts,
           BLOCK_M: tl.constexpr, PAIRS_P2: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """Program e: expert e's pairs, in pair order, at its padded offset; its blocks' expert id; program 0 the
    padded total. Ids outside [0, E) are left out (their token's output is then NaN, see ``_sum``)."""
    e = tl.program_id(0)
    offs = tl.arange(0, PAIRS_P2)
    ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
    valid = (ids >= 0) & (ids < experts)
    counts = tl.histogram(tl.where(valid, ids, EXPERTS_P2 - 1), EXPERTS_P2)  # the last bin (>= E) takes the rest
    counts = tl.where(tl.arange(0, EXPERTS_P2) < experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    here = tl.arange(0, EXPERTS_P2) == e
    start = tl.sum(tl.where(here, ends - padded, 0))
    size = tl.sum(tl.where(here, padded, 0))
    mine = valid & (ids == e)
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    tl.store(sorted_ptr + start + rank, offs, mask=mine)
    count = tl.sum(mine.to(tl.int32))
    for j in range(count, size):  # the pad slots of this expert's run
        tl.store(sorted_ptr + start + j, pairs)
    for b in range(start // BLOCK_M, (start + size) // BLOCK_M):
        tl.store(block_expert_ptr + b, e)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded))


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr, total_ptr, weights_ptr,
                  n, k, pairs, top_k, stride_a, stride_we, stride_wn, stride_c,
                  a_scale_ptr, w_scale_ptr, a_groups, stride_wse, stride_wsn, split_n,
                  GATHER_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr,
                  W8A8: tl.constexpr, W4A16: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[pair, :] = A[row] @ W[e].T for the sorted pairs of each M block (row = the pair's token when
    GATHER_TOKENS, else the pair), times the pair's routing weight when MUL_WEIGHT; W[e] is [n, k] row-major.
    W8A8: A and W are e4m3 (BLOCK_K = 128); each k block's product is scaled by A's per-row group scale
    (``a_scale`` [rows, a_groups]) and W's block scale (``w_scale`` [E, block rows, ceil(k/128)]): rows below
    ``split_n`` in block row n // 128, the rest (w13's up rows, blocked apart from gate's) in block row
    ceil(split_n / 128) + (n - split_n) // 128. W4A16: W is mxfp4 (packed bytes [E, n, k/2], e8m0 scales ``w_scale``
    [E, n, ceil(k/32)]), A bf16: :func:`_mxfp4_k_loop`."""
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(tl.load(total_ptr), BLOCK_M)
    n_blocks = tl.cdiv(n, BLOCK_N)
    in_group = GROUP_M * n_blocks
    group = pid // in_group
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(m_blocks - first_m, GROUP_M)
    if rows_in_group <= 0:
        return
    pid_m = first_m + (pid % in_group) % rows_in_group
    pid_n = (pid % in_group) // rows_in_group
    if pid_m >= m_blocks:
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    live = pair < pairs
    if GATHER_TOKENS:
        row = pair // top_k
    else:
        row = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + row.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W4A16:
        acc = _mxfp4_k_loop(acc, a_rows, live, w_ptr + expert * stride_we, w_scale_ptr + expert * stride_wse, offs_n, n,
                            k, stride_wn, stride_wsn, DOT_F32, BLOCK_K, BLOCK_N)
    else:
        for k0 in range(0, tl.cdiv(k, BLOCK_K)):
            kk = k0 * BLOCK_K + offs_k
            a = tl.load(a_rows + kk[None, :], mask=live[:, None] & (kk[None, :] < k), other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=(kk[:, None] < k) & (offs_n[None, :] < n), other=0.0)
            if W8A8:
                a_scale = tl.load(a_scale_ptr + row.to(tl.int64) * a_groups + k0, mask=live, other=0.0)
                block_row = tl.where(offs_n < split_n, offs_n // 128,
                                     (split_n + 127) // 128 + (offs_n - split_n) // 128)
                w_scale = tl.load(w_scale_ptr + expert * stride_wse + block_row * stride_wsn + k0, mask=offs_n < n,
                                  other=0.0)
                if DOT_F32:
                    part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, w)
                acc += part * a_scale[:, None] * w_scale[None, :]
            elif DOT_F32:  # Triton's CPU interpreter reads bf16 dot operands as integers: widen them there
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=live, other=0.0)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < n))


@triton.jit
def _silu_mul(gate_up_ptr, act_ptr, scale_ptr, inter, groups, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    """act[pair, i] = bf16(SiLU(gate) * up) from the bf16 gate / up halves of the first GEMM's output; with QUANT
    (BLOCK = 128: one group) that bf16 value quantized to e4m3 with the group's scale (``scale`` [pairs, groups])."""
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + pair * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + pair * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    act = (silu * up).to(tl.bfloat16)
    if QUANT:
        q, scale = _quantize_group(act.to(tl.float32), mask)
        tl.store(act_ptr + pair * inter + offs, q, mask=mask)
        tl.store(scale_ptr + pair * groups + tl.program_id(1), scale)
    else:
        tl.store(act_ptr + pair * inter + offs, act, mask=mask)


@triton.jit
def _sum(per_pair_ptr, ids_ptr, out_ptr, hidden, experts, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, h] = bf16(sum_k per_pair[t*K + k, h]) in fp32; a token with an id outside [0, E) gets NaN."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    bad = 0
    for s in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + s)
        bad += ((e < 0) | (e >= experts)).to(tl.int32)
        acc += tl.load(per_pair_ptr + (t * TOP_K + s) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.where(bad > 0, float("nan"), acc)
    tl.store(out_ptr + t * hidden + offs, acc.to(tl.bfloat16), mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def as_torch(arr: Any) -> torch.Tensor:
    """A zero-copy torch view of a CuPy or NumPy array. CuPy arrays go through a DLPack capsule made with stream -1
    (the protocol's "no synchronization": no stream handshake, which a stream being captured would not allow); bf16
    through a 16-bit integer view."""
    import numpy as np

    from kernels.contract import BF16

    bf16 = arr.dtype == BF16
    if isinstance(arr, np.ndarray):
        tensor = torch.from_numpy(arr.view(np.int16) if bf16 else arr)
    else:
        tensor = torch.utils.dlpack.from_dlpack((arr.view(np.int16) if bf16 else arr).__dlpack__(stream=-1))
    return tensor.view(torch.bfloat16) if bf16 else tensor


def fp8_view(tensor: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8, as the lab's CuPy fp8-block128 values are) as a torch float8_e4m3fn tensor."""
    return tensor if tensor.dtype == torch.float8_e4m3fn else tensor.view(torch.uint8).view(torch.float8_e4m3fn)


class FusedMoE:
    """One layer of the design for fixed dims and one tile config: buffers allocated once, launches only. ``w8a8``:
    fp8-block128 weights (``stages`` then takes each weight as its (values, scales) tensors) and the two
    activation quantizations; ``w4a16``: mxfp4 weights (likewise (packed values, e8m0 scales), uint8), bf16
    activations."""

    def __init__(self, dims: Dims, config: TileConfig = DEFAULT_CONFIG, device: str = "cuda",
                 w8a8: bool = False, w4a16: bool = False) -> None:
        if w8a8 and w4a16:
            raise ValueError("w8a8 and w4a16 are two forms of the layer: choose one")
        if w8a8 and config.block_k != GROUP:
            raise ValueError(f"the W8A8 GEMMs step k by the {GROUP}-wide scale blocks: block_k must be {GROUP}, got "
                             f"{config.block_k} ({config.name})")
        if w4a16 and config.block_k % MX_GROUP:
            raise ValueError(f"the W4A16 GEMMs step k by whole {MX_GROUP}-value scale groups: block_k must be a "
                             f"multiple of {MX_GROUP}, got {config.block_k} ({config.name})")
        self.dims, self.config, self.w8a8, self.w4a16 = dims, config, w8a8, w4a16
        pairs = dims.tokens * dims.top_k
        slots = pairs + dims.experts * (config.block_m - 1)
        self.m_blocks = triton.cdiv(slots, config.block_m)
        i32 = dict(dtype=torch.int32, device=device)
        self.sorted = torch.empty(self.m_blocks * config.block_m, **i32)
        self.block_expert = torch.empty(self.m_blocks, **i32)
        self.total = torch.empty(1, **i32)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.gate_up = torch.empty(pairs, 2 * dims.intermediate, **bf16)
        act_dtype = torch.float8_e4m3fn if w8a8 else torch.bfloat16
        self.act = torch.empty(pairs, dims.intermediate, dtype=act_dtype, device=device)
        self.per_pair = torch.empty(pairs, dims.hidden, **bf16)
        self.h_groups, self.i_groups = triton.cdiv(dims.hidden, GROUP), triton.cdiv(dims.intermediate, GROUP)
        f32 = dict(dtype=torch.float32, device=device)
        if w8a8:  # x per token and the activation per pair, e4m3 with a scale per 128-group
            self.x_q = torch.empty(dims.tokens, dims.hidden, dtype=torch.float8_e4m3fn, device=device)
            self.x_scale = torch.empty(dims.tokens, self.h_groups, **f32)
            self.act_scale = torch.empty(pairs, self.i_groups, **f32)
        else:
            self.x_q = self.x_scale = self.act_scale = torch.empty(1, **f32)  # never read

    def stages(self, x: torch.Tensor, w13: Any, w2: Any, ids: torch.Tensor, weights: torch.Tensor,
               out: torch.Tensor) -> list[tuple[str, Any]]:
        """The layer's launches, named. ``w13`` / ``w2``: bf16 tensors, or with ``w8a8`` / ``w4a16`` (values, scales)
        pairs."""
        d, c = self.dims, self.config
        pairs, inter = d.tokens * d.top_k, d.intermediate
        tiles = dict(DOT_F32=INTERPRETED, W8A8=self.w8a8, W4A16=self.w4a16, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                     BLOCK_K=c.block_k, GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages)
        if self.w8a8:
            (w13, s13), (w2, s2) = (fp8_view(w13[0]), w13[1]), (fp8_view(w2[0]), w2[1])
            a_gate_up, a_down = self.x_q, self.act
        elif self.w4a16:  # the packed bytes and their e8m0 scales, both uint8; x and the activation stay bf16
            (w13, s13), (w2, s2) = w13, w2
            a_gate_up, a_down = x, self.act
        else:
            s13 = s2 = self.x_scale  # never read
            a_gate_up, a_down = x, self.act
        scales13 = (self.x_scale, s13, self.h_groups, s13.stride(0), s13.stride(1) if s13.dim() > 1 else 0, inter)
        scales2 = (self.act_scale, s2, self.i_groups, s2.stride(0), s2.stride(1) if s2.dim() > 1 else 0, d.hidden)

        def quant_x() -> None:
            _quant_rows[(d.tokens, self.h_groups)](x, self.x_q, self.x_scale, d.hidden, self.h_groups, BLOCK=GROUP)

        def align() -> None:
            _align[(d.experts,)](ids, self.sorted, self.block_expert, self.total, pairs, d.experts,
                                 BLOCK_M=c.block_m, PAIRS_P2=_next_pow2(pairs), EXPERTS_P2=_next_pow2(d.experts + 1))

        def gemm_gate_up() -> None:
            grid = (self.m_blocks * triton.cdiv(2 * inter, c.block_n),)
            _grouped_gemm[grid](a_gate_up, w13, self.gate_up, self.sorted, self.block_expert, self.total, weights,
                                2 * inter, d.hidden, pairs, d.top_k, a_gate_up.stride(0), w13.stride(0),
                                w13.stride(1), self.gate_up.stride(0), *scales13, GATHER_TOKENS=True,
                                MUL_WEIGHT=False, **tiles)

        def silu_mul() -> None:
            block = GROUP if self.w8a8 else 1024
            _silu_mul[(pairs, triton.cdiv(inter, block))](self.gate_up, self.act, self.act_scale, inter,
                                                          self.i_groups, QUANT=self.w8a8, BLOCK=block)

        def gemm_down() -> None:
            grid = (self.m_blocks * triton.cdiv(d.hidden, c.block_n),)
            _grouped_gemm[grid](a_down, w2, self.per_pair, self.sorted, self.block_expert, self.total, weights,
                                d.hidden, inter, pairs, d.top_k, a_down.stride(0), w2.stride(0), w2.stride(1),
                                self.per_pair.stride(0), *scales2, GATHER_TOKENS=False, MUL_WEIGHT=True, **tiles)

        def combine() -> None:
            _sum[(d.tokens, triton.cdiv(d.hidden, 1024))](self.per_pair, ids, out, d.hidden, d.experts,
                                                          TOP_K=d.top_k, BLOCK=1024)

        quant = [("quant_x", quant_x)] if self.w8a8 else []
        return [("align", align), *quant, ("gemm_gate_up", gemm_gate_up), ("silu_mul", silu_mul),
                ("gemm_down", gemm_down), ("sum", combine)]

    def __call__(self, x: torch.Tensor, w13: Any, w2: Any, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor) -> None:
        for _, stage in self.stages(x, w13, w2, ids, weights, out):
            stage()
