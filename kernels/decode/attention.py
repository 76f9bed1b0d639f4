"""Decode attention of one step: q/k RMSNorm + RoPE + KV append, then flash-decoding over the KV cache.

Two kernel families, both in the order the contract of issue #59 fixes (so
:func:`kernels.numerics.head_norm_rope` and :func:`kernels.numerics.chunked_attention` reproduce them bit for bit):

* ``decode-qk-rope`` -- :func:`qk_norm_rope_append`: a warp per (token, head) row of the QKV output. q and k rows get
  the per-head RMSNorm and RoPE at the token's position ``lengths[t]`` (contract item 4: element i in lane i % 32,
  register i // 32); q goes to ``q_out`` [T, heads, D], k and the unchanged v rows into the caches at
  [t, kv_head, lengths[t], :]. :func:`rope_tables` makes the float32 cos / sin tables on the host.
* ``decode-attention`` -- :func:`decode_attention` (item 6): a grid over (chunk of SPLIT positions, kv head,
  sequence). A block loads its chunk's K and V rows once into shared memory (16-byte loads) and uses them for the
  G = heads / kv_heads query heads: a thread per (head, position) computes the score (its 32 lane chains and the
  butterfly's tree, the warp butterfly's sums in the same order), a warp per head the chunk's max, weights and
  l_c, a thread per (head, 8 elements of D) o_c. (m_c, l_c, o_c) go to a workspace; the block takes a ticket on
  its (sequence, kv head) counter and the last block combines the chunks and writes ``out`` [T, heads * D] bf16.

Sequences of different lengths share a launch: the grid covers the workspace's ``max_length`` (fixed, so a CUDA
graph replays with new lengths); a block past its sequence's end exits without a ticket -- a sequence's ticket
count is its own chunk count. A sequence whose ``lengths[t] + 1`` exceeds the cache's capacity or the workspace's
``max_length`` gets a NaN output (lengths live on the device: they cannot be checked on the host during capture).

PDL knob (1: launched with programmatic dependent launch): each kernel executes ``griddepcontrol.wait`` before it
reads what the kernel before it wrote (qkv; q and the new KV position, through ``ld_dep``) and every block executes
it before exiting. The attention reads ``lengths`` and the KV positions of earlier steps before its wait (those were
written two or more kernels back), so those loads overlap the previous kernel's tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels import numerics
from kernels.arrays import BF16, check_aligned
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.decode.device import EXP_RN
from kernels.device_helpers import PDL_HELPERS, WARP_HELPERS
from kernels.family import KernelFamily

ROPE_KERNEL = "qk_norm_rope_append"
ATTENTION_KERNEL = "decode_attention"
HEAD_DIMS = (32, 64, 128, 256)
MAX_SHARED = 227 * 1024  # sm_90's dynamic shared memory per block (opt-in above 48 KB)
STATIC_SHARED_LIMIT = 48 * 1024

ROPE_KNOBS: dict[str, int] = {"WARPS": 4, "PDL": 0}  # warps per block (a warp per row); PDL
ROPE_LIMITS = {"WARPS": (1, 32), "PDL": (0, 1)}
ATTENTION_KNOBS: dict[str, int] = {
    "SPLIT": 64,  # positions per chunk (a multiple of 32): T = 1, C = 2048, 4 kv heads -> 128 blocks on 132 SMs
    "WARPS": 4,   # warps per block
    "PDL": 0,
}
ATTENTION_LIMITS = {"SPLIT": (32, 4096), "WARPS": (1, 16), "PDL": (0, 1)}  # WARPS 32: 64 registers, spills


def _rope_rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """No auto knob and nothing the dims decide (head_dim, heads and kv_heads are launch arguments)."""
    return values


def _attention_rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """SPLIT must be a multiple of 32 (a lane per position in each 32-position tile)."""
    if values["SPLIT"] % 32:
        raise ValueError(f"SPLIT must be a multiple of 32 (positions per chunk), got {values['SPLIT']}")
    return values


def attention_shared_bytes(split: int, head_dim: int, group: int) -> int:
    """Dynamic shared memory of one attention block: the K tile (rows padded by 16 bytes: a lane per position reads
    one column, conflict-free), the V tile, the group's q rows in FP32 and its scores."""
    return 2 * split * (head_dim + 8) + 2 * split * head_dim + 4 * group * head_dim + 4 * group * split


ROPE_CODE = r"""
// ==== decode q/k RMSNorm + RoPE + KV append (kernels/decode/attention.py) ====
// Knobs: WARPS warps per block (a warp per row), PDL.
static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be in [1, 32]");

// One (token t, head j) row of the QKV output [T, (heads + 2 kv_heads) * D]: j < heads a q head, then the k heads,
// then the v heads. Element i of the row lives in lane i % 32, register i // 32 (the contract's layout); the lane
// loads the 32-bit word holding it (two lanes a word: coalesced) after the wait -- qkv is the previous kernel's.
// q, k: ss by the lane chain over the registers (fmaf) and the butterfly, rs = 1 / sqrt(ss / D + eps), xn =
// x * rs * g in FP32 (two roundings), RoPE with the table row of position pos: out[i] = xn[i] cos[i] - xn[i + D/2]
// sin[i], out[i + D/2] = xn[i + D/2] cos[i] + xn[i] sin[i] (each product and the sum rounded, no FMA), one bf16
// rounding. D = 32: i + 16 lives in lane i + 16 (one shuffle). v: the bits copied. A position outside the cache
// (pos < 0 or pos >= capacity) writes no k / v and NaN q rows (the attention then writes NaN for that sequence).
template <int D>
__device__ __forceinline__ void qk_rope_row(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ q_norm,
                                            const bf16_t* __restrict__ k_norm, const float* __restrict__ cos_table,
                                            const float* __restrict__ sin_table, bf16_t* __restrict__ q_out,
                                            bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int t, int j,
                                            int pos, int heads, int kv_heads, int capacity, float eps, int lane) {
    constexpr int R = D / 32, HALF = D / 2;
    const u32* row = reinterpret_cast<const u32*>(qkv + ((size_t)t * (heads + 2 * kv_heads) + j) * D);
    u32 bits[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const u32 w = ld_dep(row + ((lane + 32 * r) >> 1));
        bits[r] = (lane & 1) ? (w >> 16) : (w & 0xffffu);
    }
    const bool in_cache = pos >= 0 && pos < capacity;
    if (j >= heads + kv_heads) {                                     // a v row: copied
        if (!in_cache) return;
        bf16_t* dst = v_cache + (((size_t)t * kv_heads + (j - heads - kv_heads)) * capacity + pos) * D;
        #pragma unroll
        for (int r = 0; r < R; ++r) dst[lane + 32 * r] = (bf16_t)bits[r];
        return;
    }
    const bool is_q = j < heads;
    const bf16_t* g = is_q ? q_norm : k_norm;
    float x[R];
    float ss = 0.0f;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        x[r] = __uint_as_float(bits[r] << 16);
        ss = fmaf(x[r], x[r], ss);
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(__fadd_rn(ss / (float)D, eps));
    float xn[R];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        xn[r] = __fmul_rn(__fmul_rn(x[r], rs), __uint_as_float((u32)__ldg(g + lane + 32 * r) << 16));
    const float* cs = cos_table + (size_t)(in_cache ? pos : 0) * HALF;
    const float* sn = sin_table + (size_t)(in_cache ? pos : 0) * HALF;
    float out[R];
    if constexpr (D == 32) {
        const float partner = __shfl_xor_sync(FULL_MASK, xn[0], 16);
        const int i = lane & 15;
        const float c = __ldg(cs + i), s = __ldg(sn + i);
        out[0] = lane < 16 ? __fsub_rn(__fmul_rn(xn[0], c), __fmul_rn(partner, s))
                           : __fadd_rn(__fmul_rn(xn[0], c), __fmul_rn(partner, s));
    } else {
        #pragma unroll
        for (int r = 0; r < R / 2; ++r) {
            const float c = __ldg(cs + lane + 32 * r), s = __ldg(sn + lane + 32 * r);
            out[r] = __fsub_rn(__fmul_rn(xn[r], c), __fmul_rn(xn[r + R / 2], s));
            out[r + R / 2] = __fadd_rn(__fmul_rn(xn[r + R / 2], c), __fmul_rn(xn[r], s));
        }
    }
    if (is_q) {
        bf16_t* dst = q_out + ((size_t)t * heads + j) * D;
        #pragma unroll
        for (int r = 0; r < R; ++r) dst[lane + 32 * r] = in_cache ? f32_to_bf16(out[r]) : BF16_NAN;
    } else if (in_cache) {
        bf16_t* dst = k_cache + (((size_t)t * kv_heads + (j - heads)) * capacity + pos) * D;
        #pragma unroll
        for (int r = 0; r < R; ++r) dst[lane + 32 * r] = f32_to_bf16(out[r]);
    }
}

// grid: ceil(T * (heads + 2 kv_heads) / WARPS) blocks; warp w of block b owns row b * WARPS + w (token-major).
extern "C" __global__ void __launch_bounds__(WARPS * 32) qk_norm_rope_append(
    const bf16_t* __restrict__ qkv,          // [T, (heads + 2 kv_heads) * D] the QKV projection's output
    const bf16_t* __restrict__ q_norm,       // [D]
    const bf16_t* __restrict__ k_norm,       // [D]
    const float* __restrict__ cos_table,     // [positions >= capacity, D / 2]
    const float* __restrict__ sin_table,     // [positions >= capacity, D / 2]
    const int* __restrict__ lengths,         // [T] positions held before this step: the new one's index
    bf16_t* __restrict__ q_out,              // [T, heads, D]
    bf16_t* __restrict__ k_cache,            // [S >= T, kv_heads, capacity, D]
    bf16_t* __restrict__ v_cache,            // [S >= T, kv_heads, capacity, D]
    int tokens, int heads, int kv_heads, int head_dim, int capacity, float eps)
{
    const int lane = threadIdx.x & 31;
    const int per_token = heads + 2 * kv_heads;
    const int row = (int)blockIdx.x * WARPS + (int)(threadIdx.x >> 5);
    pdl_wait();                                                      // qkv: the previous kernel's output
    pdl_release();
    if (row >= tokens * per_token) return;                           // warp-uniform
    const int t = row / per_token, j = row - t * per_token;
    const int pos = __ldg(lengths + t);
    switch (head_dim) {
    case 32: qk_rope_row<32>(qkv, q_norm, k_norm, cos_table, sin_table, q_out, k_cache, v_cache, t, j, pos, heads,
                             kv_heads, capacity, eps, lane); break;
    case 64: qk_rope_row<64>(qkv, q_norm, k_norm, cos_table, sin_table, q_out, k_cache, v_cache, t, j, pos, heads,
                             kv_heads, capacity, eps, lane); break;
    case 128: qk_rope_row<128>(qkv, q_norm, k_norm, cos_table, sin_table, q_out, k_cache, v_cache, t, j, pos, heads,
                               kv_heads, capacity, eps, lane); break;
    default: qk_rope_row<256>(qkv, q_norm, k_norm, cos_table, sin_table, q_out, k_cache, v_cache, t, j, pos, heads,
                              kv_heads, capacity, eps, lane); break;
    }
}
"""

ATTENTION_CODE = r"""
// ==== decode attention, flash-decoding (kernels/decode/attention.py) ====
// Knobs: SPLIT positions per chunk (a multiple of 32), WARPS warps per block, PDL.
static_assert(SPLIT >= 32 && SPLIT % 32 == 0, "SPLIT must be a positive multiple of 32");
static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be in [1, 32]");
#define ATTN_THREADS (WARPS * 32)
#ifndef WD_HOST_EMULATION
extern __shared__ uint4 attn_smem[];                                 // dynamic: attention_shared_bytes()
#endif

// The score of one (query head, position): q [D] FP32 (shared), k [D] bf16 (shared). The contract's head lane
// chain -- lane l's accumulator takes elements l, l + 32, ... in order -- is acc[l] here, all 32 in one thread,
// then the butterfly's tree: at offset off, lane l's value is its own plus lane l ^ off's, so acc[l] + acc[l + off]
// for l < off (the sums the warp's lanes would make, in the same order; lane 0's is the result).
__device__ __forceinline__ float head_dot(const float* q, const bf16_t* k, int head_dim) {
    float acc[32];
    #pragma unroll
    for (int l = 0; l < 32; ++l) acc[l] = 0.0f;
    for (int r = 0; r < head_dim; r += 32) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4 kv = *reinterpret_cast<const uint4*>(k + r + 8 * j);
            const float4 qa = *reinterpret_cast<const float4*>(q + r + 8 * j);
            const float4 qb = *reinterpret_cast<const float4*>(q + r + 8 * j + 4);
            acc[8 * j + 0] = fmaf(qa.x, bf16_lo(kv.x), acc[8 * j + 0]);
            acc[8 * j + 1] = fmaf(qa.y, bf16_hi(kv.x), acc[8 * j + 1]);
            acc[8 * j + 2] = fmaf(qa.z, bf16_lo(kv.y), acc[8 * j + 2]);
            acc[8 * j + 3] = fmaf(qa.w, bf16_hi(kv.y), acc[8 * j + 3]);
            acc[8 * j + 4] = fmaf(qb.x, bf16_lo(kv.z), acc[8 * j + 4]);
            acc[8 * j + 5] = fmaf(qb.y, bf16_hi(kv.z), acc[8 * j + 5]);
            acc[8 * j + 6] = fmaf(qb.z, bf16_lo(kv.w), acc[8 * j + 6]);
            acc[8 * j + 7] = fmaf(qb.w, bf16_hi(kv.w), acc[8 * j + 7]);
        }
    }
    #pragma unroll
    for (int l = 0; l < 16; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 16]);    // constant bounds: acc in registers
    #pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 8]);
    #pragma unroll
    for (int l = 0; l < 4; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 4]);
    acc[0] = __fadd_rn(acc[0], acc[2]);
    acc[1] = __fadd_rn(acc[1], acc[3]);
    return __fadd_rn(acc[0], acc[1]);
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;  // exact in any order
}

// grid (max_chunks, kv_heads, T): block (c, kvh, s) owns positions [c SPLIT, min((c + 1) SPLIT, n)) of sequence s
// (n = lengths[s] + 1 after this step's append) for kv head kvh and its G query heads kvh G .. kvh G + G - 1.
//  Load: the chunk's K rows (padded) and V rows into shared memory, 16 bytes a thread at a time; the positions of
//    earlier steps before the PDL wait, the new one (lengths[s], the previous kernel's append) and q after it.
//  Scores (a thread per (head, position); warps over 32-position tiles): head_dot x scale -> scores[g][p].
//  Weights (a warp per head): m_c = max (exact), w_p = exp_rn(score - m_c) in place, l_c = lane j's chain over
//    positions j, j + 32, ... (__fadd_rn), then the butterfly. Lane 0 writes (m_c, l_c) to partial_ml.
//  o_c (a thread per (head, 8 elements)): o = o + w_p v_p[i] over the positions in order (no FMA) -> partial_o.
//  Ticket: fence, sync, thread 0 fences and takes a ticket on tickets[s][kvh]; the block with the sequence's last
//    (its chunk count - 1) resets the counter and combines: a warp per head takes M = max m_c (exact) and writes
//    a_c = exp_rn(m_c - M) over m_c, lane 0 sums L = sum a_c l_c in chunk order; a thread per (head, 8 elements)
//    O = sum a_c o_c in chunk order; out = bf16(O / L) (IEEE division).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) decode_attention(
    const bf16_t* __restrict__ q,            // [T, heads, D] after norm + RoPE (the previous kernel's output)
    const bf16_t* __restrict__ k_cache,      // [S >= T, kv_heads, capacity, D]
    const bf16_t* __restrict__ v_cache,      // [S >= T, kv_heads, capacity, D]
    const int* __restrict__ lengths,         // [T] positions before this step (n = lengths + 1 attended)
    bf16_t* __restrict__ out,                // [T, heads * D]
    float* __restrict__ partial_o,           // [T, heads, max_chunks, D] workspace
    float* __restrict__ partial_ml,          // [T, heads, max_chunks, 2] workspace: (m_c, l_c), then (a_c, l_c)
    unsigned* __restrict__ tickets,          // [T, kv_heads] workspace: 0 before the launch, 0 after it
    int heads, int kv_heads, int head_dim, int capacity, int max_chunks, float scale)
{
    __shared__ int last_block;
    const int c = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = heads / kv_heads, row_chunks = head_dim / 8, k_stride = head_dim + 8;
    const int old = __ldg(lengths + s);                              // written by earlier steps, not the last kernel
    const int n = old + 1;
    const bool bad = old < 0 || n > min(capacity, max_chunks * SPLIT);
    const int chunks = bad ? 1 : (n + SPLIT - 1) / SPLIT;
    if (c >= chunks) {                                               // past the sequence's end: no ticket
        pdl_wait();
        pdl_release();
        return;
    }
    bf16_t* k_tile = reinterpret_cast<bf16_t*>(attn_smem);           // [SPLIT][D + 8]
    bf16_t* v_tile = k_tile + SPLIT * k_stride;                      // [SPLIT][D]
    float* q_rows = reinterpret_cast<float*>(v_tile + SPLIT * head_dim);   // [G][D]
    float* scores = q_rows + group * head_dim;                       // [G][SPLIT]
    const int first = c * SPLIT, count = bad ? 0 : min(SPLIT, n - first);
    const size_t kv_row0 = ((size_t)s * kv_heads + kvh) * capacity + first;
    const uint4* k_src = reinterpret_cast<const uint4*>(k_cache + kv_row0 * head_dim);
    const uint4* v_src = reinterpret_cast<const uint4*>(v_cache + kv_row0 * head_dim);
    for (int j = tid; j < count * row_chunks; j += ATTN_THREADS) {   // earlier steps' positions: before the wait
        const int p = j / row_chunks, x = j - p * row_chunks;
        if (first + p == old) continue;
        *reinterpret_cast<uint4*>(k_tile + p * k_stride + 8 * x) = __ldg(k_src + j);
        *reinterpret_cast<uint4*>(v_tile + p * head_dim + 8 * x) = __ldg(v_src + j);
    }
    pdl_wait();                                                      // q and the new position: the last kernel's
    pdl_release();
    const int h0 = kvh * group;
    if (bad) {                                                       // a length past the cache / workspace: NaN
        bf16_t* dst = out + ((size_t)s * heads + h0) * head_dim;
        for (int j = tid; j < group * head_dim; j += ATTN_THREADS) dst[j] = BF16_NAN;
        return;
    }
    if (old >= first && old < first + count) {
        const int p = old - first;
        for (int x = tid; x < row_chunks; x += ATTN_THREADS) {
            *reinterpret_cast<uint4*>(k_tile + p * k_stride + 8 * x) = ld_dep(k_src + p * row_chunks + x);
            *reinterpret_cast<uint4*>(v_tile + p * head_dim + 8 * x) = ld_dep(v_src + p * row_chunks + x);
        }
    }
    const uint4* q_src = reinterpret_cast<const uint4*>(q + ((size_t)s * heads + h0) * head_dim);
    for (int j = tid; j < group * row_chunks; j += ATTN_THREADS) {
        const uint4 v = ld_dep(q_src + j);
        float* dst = q_rows + 8 * j;
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            dst[2 * w] = bf16_lo(word(v, w));
            dst[2 * w + 1] = bf16_hi(word(v, w));
        }
    }
    __syncthreads();

    const int tiles = (count + 31) / 32;                             // scores: warp task (g, tile), lane a position
    for (int task = warp; task < group * tiles; task += WARPS) {
        const int g = task / tiles, p = (task - g * tiles) * 32 + lane;
        if (p < count) scores[g * SPLIT + p] = __fmul_rn(head_dot(q_rows + g * head_dim, k_tile + p * k_stride,
                                                                  head_dim), scale);
    }
    __syncthreads();

    float* ml = partial_ml + ((size_t)s * heads + h0) * max_chunks * 2;
    for (int g = warp; g < group; g += WARPS) {                      // weights, l_c: a warp per head
        float* row = scores + g * SPLIT;
        float m = __int_as_float(0xff800000);
        for (int p = lane; p < count; p += 32) m = fmaxf(m, row[p]);
        m = warp_max(m);
        float l = 0.0f;
        for (int p = lane; p < count; p += 32) {
            const float w = exp_rn(__fsub_rn(row[p], m));
            row[p] = w;
            l = __fadd_rn(l, w);
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[((size_t)g * max_chunks + c) * 2] = m;
            ml[((size_t)g * max_chunks + c) * 2 + 1] = l;
        }
    }
    __syncthreads();

    float* po = partial_o + ((size_t)s * heads + h0) * max_chunks * head_dim;
    for (int j = tid; j < group * row_chunks; j += ATTN_THREADS) {   // o_c: a thread per (head, 8 elements)
        const int g = j / row_chunks, x = j - g * row_chunks;
        const float* w = scores + g * SPLIT;
        float o[8];
        #pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.0f;
        for (int p = 0; p < count; ++p) {
            const float wp = w[p];
            const uint4 v = *reinterpret_cast<const uint4*>(v_tile + p * head_dim + 8 * x);
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                o[2 * e] = __fadd_rn(o[2 * e], __fmul_rn(wp, bf16_lo(word(v, e))));
                o[2 * e + 1] = __fadd_rn(o[2 * e + 1], __fmul_rn(wp, bf16_hi(word(v, e))));
            }
        }
        float4* dst = reinterpret_cast<float4*>(po + ((size_t)g * max_chunks + c) * head_dim + 8 * x);
        dst[0] = make_float4(o[0], o[1], o[2], o[3]);
        dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    }

    __threadfence();                                                 // this thread's partials visible device-wide
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        unsigned* ticket_of = tickets + (size_t)s * kv_heads + kvh;
        const unsigned ticket = atomicAdd(ticket_of, 1u);
        last_block = ticket == (unsigned)(chunks - 1);
        if (last_block) {
            *ticket_of = 0u;                                         // every chunk of (s, kvh) has taken its ticket
            __threadfence();                                         // the others' partials before the reads below
        }
    }
    __syncthreads();
    if (!last_block) return;

    float* total_l = scores;                                         // [G], the scores are done with
    for (int g = warp; g < group; g += WARPS) {                      // M, a_c, L: a warp per head
        float* mine = ml + (size_t)g * max_chunks * 2;
        float m = __int_as_float(0xff800000);
        for (int k = lane; k < chunks; k += 32) m = fmaxf(m, __ldcg(mine + 2 * k));
        m = warp_max(m);
        for (int k = lane; k < chunks; k += 32) mine[2 * k] = exp_rn(__fsub_rn(__ldcg(mine + 2 * k), m));
        __threadfence_block();
        __syncwarp();
        if (lane == 0) {
            float l = 0.0f;
            for (int k = 0; k < chunks; ++k)
                l = __fadd_rn(l, __fmul_rn(__ldcg(mine + 2 * k), __ldcg(mine + 2 * k + 1)));
            total_l[g] = l;
        }
    }
    __threadfence_block();
    __syncthreads();
    for (int j = tid; j < group * row_chunks; j += ATTN_THREADS) {   // O, out: a thread per (head, 8 elements)
        const int g = j / row_chunks, x = j - g * row_chunks;
        const float* a = ml + (size_t)g * max_chunks * 2;
        const float* src = po + (size_t)g * max_chunks * head_dim + 8 * x;
        float o[8];
        #pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.0f;
        for (int k = 0; k < chunks; ++k) {
            const float ak = __ldcg(a + 2 * k);
            const float4 lo = __ldcg(reinterpret_cast<const float4*>(src + (size_t)k * head_dim));
            const float4 hi = __ldcg(reinterpret_cast<const float4*>(src + (size_t)k * head_dim + 4));
            o[0] = __fadd_rn(o[0], __fmul_rn(ak, lo.x));
            o[1] = __fadd_rn(o[1], __fmul_rn(ak, lo.y));
            o[2] = __fadd_rn(o[2], __fmul_rn(ak, lo.z));
            o[3] = __fadd_rn(o[3], __fmul_rn(ak, lo.w));
            o[4] = __fadd_rn(o[4], __fmul_rn(ak, hi.x));
            o[5] = __fadd_rn(o[5], __fmul_rn(ak, hi.y));
            o[6] = __fadd_rn(o[6], __fmul_rn(ak, hi.z));
            o[7] = __fadd_rn(o[7], __fmul_rn(ak, hi.w));
        }
        const float l = total_l[g];
        u32 packed[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            packed[e] = (u32)f32_to_bf16(o[2 * e] / l) | ((u32)f32_to_bf16(o[2 * e + 1] / l) << 16);
        *reinterpret_cast<uint4*>(out + ((size_t)s * heads + h0 + g) * head_dim + 8 * x) =
            make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}
"""

ROPE_SOURCE = CudaSource(name="decode_qk_rope", code=WARP_HELPERS + PDL_HELPERS + ROPE_CODE, kernels=(ROPE_KERNEL,),
                         defaults=dict(ROPE_KNOBS), variants=[{"WARPS": 8}, {"PDL": 1}],
                         warps_knobs={ROPE_KERNEL: "WARPS"},
                         description="a decode step's per-head q/k RMSNorm + RoPE and KV-cache append (a warp per "
                                     "(token, head) row)")
ROPE = KernelFamily(name="decode-qk-rope", source=ROPE_SOURCE, limits=ROPE_LIMITS, rules=_rope_rules,
                    device_needs={"PDL": 90})

ATTENTION_SOURCE = CudaSource(name="decode_attention", code=WARP_HELPERS + PDL_HELPERS + EXP_RN + ATTENTION_CODE,
                              kernels=(ATTENTION_KERNEL,), defaults=dict(ATTENTION_KNOBS),
                              variants=[{"SPLIT": 32}, {"SPLIT": 128, "WARPS": 8}, {"SPLIT": 256, "WARPS": 8},
                                        {"PDL": 1}],
                              warps_knobs={ATTENTION_KERNEL: "WARPS"},
                              description="flash-decoding attention over the KV cache: a block per (chunk of SPLIT "
                                          "positions, kv head, sequence), the last block of each (sequence, kv head) "
                                          "combines")
ATTENTION = KernelFamily(name="decode-attention", source=ATTENTION_SOURCE, limits=ATTENTION_LIMITS,
                         rules=_attention_rules, device_needs={"PDL": 90})


# ---------------------------------------------------------------------------------------------------
# Host side: tables, workspace, input checks
# ---------------------------------------------------------------------------------------------------
def rope_tables(max_positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), float32 NumPy [max_positions, head_dim / 2]: angle pos * theta^(-2 i / head_dim) in float64,
    then rounded -- exactly the values :func:`kernels.decode_reference.rope` uses. Copy them to the device once."""
    if isinstance(max_positions, bool) or not isinstance(max_positions, int | np.integer) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int | np.integer) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    return numerics.rope_tables(np.arange(int(max_positions)), int(head_dim), theta)


@dataclass(frozen=True)
class AttentionWorkspace:
    """What :func:`decode_attention`'s blocks share: ``partial_o`` [T, heads, max_chunks, D] and ``partial_ml``
    [T, heads, max_chunks, 2] float32 (each chunk's o_c and (m_c, l_c)), ``tickets`` [T, kv_heads] uint32 (zero
    before a launch; a launch leaves them zero) and the knobs it was sized for (``params``: max_chunks = ceil(
    max_length / SPLIT)). One launch at a time may use it."""

    partial_o: Any
    partial_ml: Any
    tickets: Any
    params: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.partial_o.shape[0])

    @property
    def heads(self) -> int:
        return int(self.partial_o.shape[1])

    @property
    def max_chunks(self) -> int:
        return int(self.partial_o.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.partial_o.shape[3])

    @property
    def kv_heads(self) -> int:
        return int(self.tickets.shape[1])

    @property
    def max_length(self) -> int:
        return self.max_chunks * int(self.params["SPLIT"])


def _positive(name: str, value: Any, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1 or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be in [1, {maximum if maximum is not None else 'inf'}], got {value}")
    return int(value)


def _check_heads(heads: Any, kv_heads: Any) -> tuple[int, int]:
    heads, kv_heads = _positive("heads", heads), _positive("kv_heads", kv_heads, 65535)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return heads, kv_heads


def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name}'s head_dim must be one of {HEAD_DIMS}, got {head_dim}")


def _check_shared(params: dict[str, int], head_dim: int, group: int) -> int:
    """The attention block's dynamic shared memory; ValueError naming SPLIT where it is past the device's 227 KB."""
    need = attention_shared_bytes(params["SPLIT"], head_dim, group)
    if need > MAX_SHARED:
        raise ValueError(f"SPLIT {params['SPLIT']} needs {need} bytes of shared memory at head_dim {head_dim}, G "
                         f"{group} (at most {MAX_SHARED}): lower SPLIT")
    return need


def make_attention_workspace(tokens: int, heads: int, kv_heads: int, head_dim: int, max_length: int,
                             **knobs: Any) -> AttentionWorkspace:
    """An :class:`AttentionWorkspace` on CuPy's current device for T = ``tokens`` sequences of up to ``max_length``
    positions (after this step's append), with the knobs ``knobs`` (the attention family's; the launch uses them).
    T * heads * ceil(max_length / SPLIT) * (D + 2) * 4 bytes: at T = 64, 32 heads, D = 128 and 32768 positions,
    540 MB. Allocate it once, outside a graph capture, and pass it to every call."""
    tokens = _positive("tokens", tokens, 65535)
    heads, kv_heads = _check_heads(heads, kv_heads)
    _check_head_dim("the workspace", _positive("head_dim", head_dim))
    max_length = _positive("max_length", max_length)
    params = ATTENTION.resolve(**knobs)
    _check_shared(params, head_dim, heads // kv_heads)
    chunks = -(-max_length // params["SPLIT"])
    if chunks > 2**31 - 1:
        raise ValueError(f"max_length {max_length} is too long for the grid")
    import cupy

    return AttentionWorkspace(cupy.empty((tokens, heads, chunks, head_dim), dtype=np.float32),
                              cupy.empty((tokens, heads, chunks, 2), dtype=np.float32),
                              cupy.zeros((tokens, kv_heads), dtype=np.uint32), dict(params))


_WORKSPACES: dict[tuple[Any, ...], AttentionWorkspace] = {}


def _cached_workspace(tokens: int, heads: int, kv_heads: int, head_dim: int, max_length: int,
                      knobs: dict[str, Any]) -> AttentionWorkspace:
    """The workspace of (device, stream, shapes, knobs), made on first use: calls on one stream run in turn."""
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), int(cupy.cuda.get_current_stream().ptr), tokens, heads, kv_heads,
           head_dim, max_length, tuple(sorted(ATTENTION.resolve(**knobs).items())))
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = _WORKSPACES[key] = make_attention_workspace(tokens, heads, kv_heads, head_dim, max_length,
                                                                **knobs)
    return workspace


def _is_cupy(arr: Any) -> bool:
    return type(arr).__module__.startswith("cupy")


def _check_array(name: str, arr: Any, dtype: Any, ndim: int, what: str, shape: tuple[int, ...] | None = None) -> None:
    """TypeError / ValueError naming ``name``: a C-contiguous CuPy array of ``dtype`` with ``ndim`` dimensions
    (``shape`` where given; ``what`` describes it)."""
    if not _is_cupy(arr) or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be a cupy.ndarray (the kernel runs on the GPU), got "
                        f"{type(arr).__module__}.{type(arr).__name__}")
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim != ndim or (shape is not None and tuple(arr.shape) != tuple(shape)):
        want = list(shape) if shape is not None else f"{ndim} dimensions"
        raise ValueError(f"{name} must be {what} = {want}, got shape {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (call .copy() first)")


def _check_caches(k_cache: Any, v_cache: Any, tokens: int, kv_heads: int | None, head_dim: int) -> tuple[int, int]:
    """k_cache, v_cache [S >= T, kv_heads, capacity, D] bf16, the same shape; returns (kv_heads, capacity)."""
    _check_array("k_cache", k_cache, BF16, 4, "[S, kv_heads, capacity, D]")
    slots, cache_kv, capacity, dim = (int(d) for d in k_cache.shape)
    if dim != head_dim or (kv_heads is not None and cache_kv != kv_heads) or slots < tokens or capacity < 1:
        raise ValueError(f"k_cache must be [S >= T = {tokens}, kv_heads{'' if kv_heads is None else f' = {kv_heads}'}"
                         f", capacity >= 1, D = {head_dim}], got shape {tuple(k_cache.shape)}")
    _check_array("v_cache", v_cache, BF16, 4, "k_cache's shape", tuple(k_cache.shape))
    return cache_kv, capacity


def check_rope_inputs(qkv: Any, q_norm: Any, k_norm: Any, cos: Any, sin: Any, lengths: Any, q_out: Any, k_cache: Any,
                      v_cache: Any, heads: Any, kv_heads: Any, eps: Any) -> tuple[int, int, int, int, int]:
    """Every check of :func:`qk_norm_rope_append` that needs no GPU; returns (T, heads, kv_heads, D, capacity)."""
    heads, kv_heads = _check_heads(heads, kv_heads)
    if isinstance(eps, bool) or not isinstance(eps, float | int | np.floating | np.integer) or not eps >= 0:
        raise TypeError(f"eps must be a float >= 0, got {eps!r}")
    _check_array("q_out", q_out, BF16, 3, "[T, heads, D]")
    tokens, out_heads, head_dim = (int(d) for d in q_out.shape)
    if out_heads != heads or not 1 <= tokens <= 65535:
        raise ValueError(f"q_out must be [T in 1..65535, heads = {heads}, D], got shape {tuple(q_out.shape)}")
    _check_head_dim("q_out", head_dim)
    _check_array("qkv", qkv, BF16, 2, "[T, (heads + 2 kv_heads) * D]", (tokens, (heads + 2 * kv_heads) * head_dim))
    _check_array("q_norm", q_norm, BF16, 1, "[D]", (head_dim,))
    _check_array("k_norm", k_norm, BF16, 1, "[D]", (head_dim,))
    _, capacity = _check_caches(k_cache, v_cache, tokens, kv_heads, head_dim)
    _check_array("cos", cos, np.float32, 2, "[positions >= capacity, D / 2]")
    if int(cos.shape[0]) < capacity or int(cos.shape[1]) != head_dim // 2:
        raise ValueError(f"cos must be [positions >= the cache's capacity {capacity}, D / 2 = {head_dim // 2}] "
                         f"(rope_tables), got shape {tuple(cos.shape)}")
    _check_array("sin", sin, np.float32, 2, "cos's shape", tuple(cos.shape))
    _check_array("lengths", lengths, np.int32, 1, "[T]", (tokens,))
    return tokens, heads, kv_heads, head_dim, capacity


def check_attention_inputs(q: Any, k_cache: Any, v_cache: Any, lengths: Any, out: Any,
                           workspace: Any = None) -> tuple[int, int, int, int, int]:
    """Every check of :func:`decode_attention` that needs no GPU; returns (T, heads, kv_heads, D, capacity)."""
    _check_array("q", q, BF16, 3, "[T, heads, D]")
    tokens, heads, head_dim = (int(d) for d in q.shape)
    if not 1 <= tokens <= 65535 or heads < 1:
        raise ValueError(f"q must be [T in 1..65535, heads >= 1, D], got shape {tuple(q.shape)}")
    _check_head_dim("q", head_dim)
    kv_heads, capacity = _check_caches(k_cache, v_cache, tokens, None, head_dim)
    if kv_heads < 1 or heads % kv_heads or kv_heads > 65535:
        raise ValueError(f"k_cache's kv_heads ({kv_heads}) must divide q's heads ({heads})")
    _check_array("lengths", lengths, np.int32, 1, "[T]", (tokens,))
    _check_array("out", out, BF16, 2, "[T, heads * D]", (tokens, heads * head_dim))
    if workspace is not None:
        if not isinstance(workspace, AttentionWorkspace):
            raise TypeError(f"workspace must be an AttentionWorkspace (make_attention_workspace), got "
                            f"{type(workspace).__name__}")
        chunks = workspace.max_chunks if getattr(workspace.partial_o, "ndim", 0) == 4 else -1
        _check_array("workspace.partial_o", workspace.partial_o, np.float32, 4, "[T, heads, max_chunks, D]",
                     (tokens, heads, chunks, head_dim))
        _check_array("workspace.partial_ml", workspace.partial_ml, np.float32, 4, "[T, heads, max_chunks, 2]",
                     (tokens, heads, chunks, 2))
        _check_array("workspace.tickets", workspace.tickets, np.uint32, 2, "[T, kv_heads]", (tokens, kv_heads))
    return tokens, heads, kv_heads, head_dim, capacity


# ---------------------------------------------------------------------------------------------------
# Entry points: each a stage (a zero-argument launch callable: compile and allocate once, then capture) and a call
# ---------------------------------------------------------------------------------------------------
def qk_rope_stage(qkv: Any, q_norm: Any, k_norm: Any, cos: Any, sin: Any, lengths: Any, q_out: Any, k_cache: Any,
                  v_cache: Any, *, heads: int, kv_heads: int, eps: float = 1e-6, **knobs: Any) -> Callable[[], None]:
    """:func:`qk_norm_rope_append` as a zero-argument launch: checks, compiles (once per device and knob set) now;
    the callable only launches (on CuPy's current stream; graph-capturable, allocation-free)."""
    tokens, heads, kv_heads, head_dim, capacity = check_rope_inputs(qkv, q_norm, k_norm, cos, sin, lengths, q_out,
                                                                    k_cache, v_cache, heads, kv_heads, eps)
    check_aligned(qkv=qkv, q_out=q_out, k_cache=k_cache, v_cache=v_cache)
    params = ROPE.for_device(ROPE.resolve(**knobs))
    kernel = ROPE.kernels_for(params)[ROPE_KERNEL]
    rows = tokens * (heads + 2 * kv_heads)
    grid = (-(-rows // params["WARPS"]),)
    i32 = np.int32
    args = (qkv, q_norm, k_norm, cos, sin, lengths, q_out, k_cache, v_cache, i32(tokens), i32(heads), i32(kv_heads),
            i32(head_dim), i32(capacity), np.float32(eps))
    programmatic = bool(params["PDL"])

    def launch() -> None:
        launch_ex(kernel, grid, (32 * params["WARPS"],), args, programmatic=programmatic)

    return launch


def qk_norm_rope_append(qkv: Any, q_norm: Any, k_norm: Any, cos: Any, sin: Any, lengths: Any, q_out: Any,
                        k_cache: Any, v_cache: Any, *, heads: int, kv_heads: int, eps: float = 1e-6,
                        **knobs: Any) -> None:
    """Per-head RMSNorm + RoPE of the step's q and k rows, and the KV-cache append (contract item 4).

    ``qkv`` [T, (heads + 2 kv_heads) * D] bf16 (q heads, then k, then v); ``q_norm``, ``k_norm`` [D] bf16; ``cos``,
    ``sin`` float32 [positions >= capacity, D / 2] (:func:`rope_tables` copied to the device); ``lengths`` [T] int32
    (token t's position; never changed). Writes ``q_out`` [T, heads, D] and k, v into ``k_cache``, ``v_cache``
    [S >= T, kv_heads, capacity, D] at [t, :, lengths[t], :]. D in {32, 64, 128, 256}. Knobs: WARPS, PDL."""
    qk_rope_stage(qkv, q_norm, k_norm, cos, sin, lengths, q_out, k_cache, v_cache, heads=heads, kv_heads=kv_heads,
                  eps=eps, **knobs)()


def attention_stage(q: Any, k_cache: Any, v_cache: Any, lengths: Any, out: Any,
                    workspace: AttentionWorkspace | None = None, **knobs: Any) -> Callable[[], None]:
    """:func:`decode_attention` as a zero-argument launch: checks, compiles and (without ``workspace``) allocates
    now; the callable only launches (graph-capturable)."""
    tokens, heads, kv_heads, head_dim, capacity = check_attention_inputs(q, k_cache, v_cache, lengths, out, workspace)
    params = ATTENTION.resolve(**knobs)
    if workspace is not None:  # the workspace fixes the knobs (its chunk count is SPLIT's)
        for knob, value in knobs.items():
            if workspace.params.get(knob) != params[knob]:
                raise ValueError(f"{knob} {value} differs from the workspace's {workspace.params.get(knob)} "
                                 f"(make_attention_workspace(..., {knob}={value}))")
        params = dict(workspace.params)
    group = heads // kv_heads
    shared = _check_shared(params, head_dim, group)
    check_aligned(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    if workspace is None:
        workspace = _cached_workspace(tokens, heads, kv_heads, head_dim, capacity, knobs)
    params = ATTENTION.for_device(params)
    kernel = ATTENTION.kernels_for(params)[ATTENTION_KERNEL]
    if shared > STATIC_SHARED_LIMIT and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    grid = (workspace.max_chunks, kv_heads, tokens)
    i32 = np.int32
    scale = np.float32(1.0 / math.sqrt(head_dim))
    args = (q, k_cache, v_cache, lengths, out, workspace.partial_o, workspace.partial_ml, workspace.tickets,
            i32(heads), i32(kv_heads), i32(head_dim), i32(capacity), i32(workspace.max_chunks), scale)
    programmatic = bool(params["PDL"])

    def launch() -> None:
        launch_ex(kernel, grid, (32 * params["WARPS"],), args, shared_mem=shared, programmatic=programmatic)

    return launch


def decode_attention(q: Any, k_cache: Any, v_cache: Any, lengths: Any, out: Any,
                     workspace: AttentionWorkspace | None = None, **knobs: Any) -> Any:
    """Decode attention of T sequences over their KV caches (contract item 6, flash-decoding); returns ``out``.

    ``q`` [T, heads, D] bf16 (after :func:`qk_norm_rope_append`); ``k_cache``, ``v_cache`` [S >= T, kv_heads,
    capacity, D] bf16 (slot t is sequence t); ``lengths`` [T] int32 (positions before this step's append: sequence t
    attends to lengths[t] + 1); ``out`` [T, heads * D] bf16. ``workspace``: :func:`make_attention_workspace` (it
    fixes the knobs and the longest sequence); without one, one sized for the cache's capacity is cached per
    (device, stream, shapes, knobs) -- at long capacities a large one: pass your own. Knobs: SPLIT, WARPS, PDL."""
    attention_stage(q, k_cache, v_cache, lengths, out, workspace, **knobs)()
    return out
