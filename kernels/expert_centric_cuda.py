"""CUDA C of the expert-centric (vLLM-style fused-MoE) decode path; its kernel family is declared in
kernels.expert_centric_path (``FAMILY``), which registers this source.

Knobs (``#define``): ``BLOCK_N`` output features per GEMM block (multiple of 8), ``WARPS`` warps per GEMM
block (split-K inside the block), ``M_TILES`` 16-row MMA tiles per GEMM block (``BLOCK_M = 16 * M_TILES``,
also the padding unit of the routing metadata), ``UNROLL`` 32-wide K chunks each warp loads before its MMAs
(one "step"), ``STAGES`` 1 = a step's loads go to registers, >= 2 = cp.async ring of STAGES steps in dynamic
shared memory (``ring_bytes`` in kernels.expert_centric_path; STAGES-1 steps in flight per warp), ``PREFETCH``
(register path only) 0 = off, d >= 1 = each lane prefetches into L2 the weights it will load d steps later.
``BLOCK_N``, ``WARPS`` and ``STAGES`` at 0 mean "auto" to the family (its rules pick them from the dims), so 0
never reaches this text from there; the text treats STAGES < 2 as the register path. (Results written before
the kernel family spell the register path STAGES=0.)

bf16 values travel as raw ``unsigned short`` bits (no cuda_bf16.h); conversions are bit-exact RNE.

``W8A8`` 1 (with fp8 activations: the W8A8 design serving engines run on FP8 checkpoints) reads fp8-block128
weights: each lane loads its 8 e4m3 values of a weight row (8 bytes), widens them to bf16 fragments (exact, times
2^-112: kernels/device_helpers.py FP8_HELPERS) and each 32-wide K chunk's MMA result is scaled by the activation
row's group scale, the weight block's scale and 2^112. Register loads only (STAGES 1, no PREFETCH).
"""

from __future__ import annotations

from kernels.compile import CudaSource
from kernels.device_helpers import FP8_HELPERS

CODE = r"""
#define BLOCK_M (16 * M_TILES)
#define NT (BLOCK_N / 8)
typedef unsigned short bf16;
typedef unsigned int u32;
static_assert(W8A8 == 0 || (W8A8 == 1 && STAGES < 2 && PREFETCH == 0), "W8A8 runs on register loads only");
#if W8A8
typedef unsigned char wt_t;                       // e4m3fn bytes, a float32 scale per 128 x 128 block
#else
typedef bf16 wt_t;
#endif
""" + FP8_HELPERS + r"""

// ---------------------------------------------------------------- number helpers ------------------
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ unsigned f32_to_bf16_bits(float f) {    // round to nearest even, NaN stays NaN
    unsigned u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ((u >> 16) | 0x40u) & 0xFFFFu;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << 16);
}
__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float(f32_to_bf16_bits(f) << 16); }
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
}
// FP8 e4m3fn round to nearest even of a value already clipped to [-448, 448] (NaN passes through):
// below 2^-6 the grid is the subnormal step 2^-9, above it 3 mantissa bits are kept.
__device__ __forceinline__ float round_e4m3(float v) {
    float a = fabsf(v);
    if (!(a == a)) return v;
    float r;
    if (a < 0.015625f) {
        r = rintf(a * 512.0f) * 0.001953125f;
    } else {
        unsigned u = __float_as_uint(a);
        r = __uint_as_float((u + 0x7FFFFu + ((u >> 20) & 1u)) & 0xFFF00000u);
    }
    return copysignf(r, v);
}
__device__ __forceinline__ float clip448(float v) { return v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v); }
__device__ __forceinline__ float nanmax(float m, float a) { return (a > m || a != a) ? a : m; }

// Quantize the 8 values one lane holds (chunk ``chunk`` of a row); groups of lanes share a scale.
// quant 1 = fp8 (scale amax/448 per 128 elements = 16 lanes; writes bf16(q) and the fp32 scale),
// quant 2 = mxfp8 (scale 2^(floor(log2 amax) - 8) per 32 elements = 4 lanes; writes bf16(q * scale), exact).
// Every lane of the warp must call this (shuffles); ``active`` lanes store.
__device__ __forceinline__ void quantize_store(float* v, bool active, int chunk, int quant, bf16* dst_row,
                                               float* scale_row) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = nanmax(amax, fabsf(v[i]));
    const int lanes = quant == 1 ? 16 : 4;
    for (int off = lanes / 2; off > 0; off >>= 1) amax = nanmax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    float scale;
    if (quant == 1) {
        scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
    } else {
        int e = amax > 0.0f ? ilogbf(amax) - 8 : 0;
        scale = ldexpf(1.0f, e);
    }
    float q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        q[i] = round_e4m3(clip448(__fdiv_rn(v[i], scale)));
        if (quant == 2) q[i] = __fmul_rn(q[i], scale);
    }
    if (active) {
        *reinterpret_cast<uint4*>(dst_row + (size_t)chunk * 8) = pack8(q);
        if (quant == 1 && (chunk & 15) == 0) scale_row[chunk >> 4] = scale;
    }
}

// ---------------------------------------------------------------- stage 1: routing metadata -------
// One block (1024 threads). Warp 0 walks the pairs in order, 32 at a time: lanes holding the same expert
// find each other (__match_any_sync), each pair's rank inside its expert = pairs of that expert in earlier
// chunks (counts[e], shared) + lower lanes of its group, and the group's lowest lane adds the group size to
// counts[e]; the rank parks in row_of_pair[i] (deterministic: pair order, no atomics). Then the block does
// an exclusive scan of tiles per expert = ceil(count / BLOCK_M), every pair writes its padded row
// tile_off[e] * BLOCK_M + rank, and a thread per expert pads that expert's last tile with the sentinel P.
// Out: sorted_ids[max_tiles*BLOCK_M] (pair id or P), tile_expert[max_tiles] (-1 past the real tiles),
// meta[0] = real tile count, row_of_pair[P] (padded row of each pair, -1 for an out-of-range expert id).
extern "C" __global__ void __launch_bounds__(1024) moe_align(
    const int* __restrict__ topk_ids, int P, int E, int max_tiles,
    int* __restrict__ sorted_ids, int* __restrict__ tile_expert, int* __restrict__ meta, int* __restrict__ row_of_pair)
{
    extern __shared__ int smem[];
    int* counts = smem;              // [E]
    int* tile_off = smem + E;        // [E]
    __shared__ int warp_sums[32];
    __shared__ int total_tiles;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    for (int e = tid; e < E; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    if (warp == 0) {
        for (int i0 = 0; i0 < P; i0 += 32) {
            const int i = i0 + lane;
            const int e = i < P ? topk_ids[i] : -1;
            const bool valid = e >= 0 && e < E;
            const unsigned group = __match_any_sync(0xFFFFFFFFu, e);   // lanes with the same id (valid or not)
            const int before = valid ? counts[e] : 0;
            __syncwarp();
            if (valid && (group & ((1u << lane) - 1u)) == 0) counts[e] = before + __popc(group);   // group leader
            if (i < P) row_of_pair[i] = valid ? before + __popc(group & ((1u << lane) - 1u)) : -1;
            __syncwarp();
        }
    }
    __syncthreads();
    // block exclusive scan of tiles per expert: each thread owns a run of `per` experts
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int e0 = tid * per;
    int local = 0;
    for (int e = e0; e < min(E, e0 + per); ++e) local += (counts[e] + BLOCK_M - 1) / BLOCK_M;
    int incl = local;
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? warp_sums[lane] : 0, wi = w;
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFFu, wi, off);
            if (lane >= off) wi += y;
        }
        warp_sums[lane] = wi - w;                     // exclusive prefix of each warp
        if (lane == 31) { meta[0] = wi; total_tiles = wi; }   // real tile count
    }
    __syncthreads();
    int run = warp_sums[warp] + incl - local;
    for (int e = e0; e < min(E, e0 + per); ++e) { tile_off[e] = run; run += (counts[e] + BLOCK_M - 1) / BLOCK_M; }
    __syncthreads();
    const int total = total_tiles;
    for (int e = tid; e < E; e += blockDim.x) {
        const int n = (counts[e] + BLOCK_M - 1) / BLOCK_M;
        for (int j = 0; j < n; ++j) tile_expert[tile_off[e] + j] = e;
    }
    for (int j = total + tid; j < max_tiles; j += blockDim.x) tile_expert[j] = -1;
    // placement: thread per pair (its rank was parked in row_of_pair by warp 0 before the barriers above),
    // then thread per expert for the padding
    for (int i = tid; i < P; i += blockDim.x) {
        const int rank = row_of_pair[i];
        if (rank < 0) continue;
        const int r = tile_off[topk_ids[i]] * BLOCK_M + rank;
        sorted_ids[r] = i;
        row_of_pair[i] = r;
    }
    for (int e = tid; e < E; e += blockDim.x) {
        const int count = counts[e];
        const int base = tile_off[e] * BLOCK_M;
        const int padded = ((count + BLOCK_M - 1) / BLOCK_M) * BLOCK_M;
        for (int r = count; r < padded; ++r) sorted_ids[base + r] = P;
    }
}

// ---------------------------------------------------------------- stage 3a: quantize x ------------
// Block per token row; each lane owns 8 consecutive elements (one 16-byte chunk) per iteration.
extern "C" __global__ void quantize_rows(const bf16* __restrict__ src, int H, int quant, int scale_groups,
                                         bf16* __restrict__ dst, float* __restrict__ dst_scale)
{
    const int row = blockIdx.x, chunks = H / 8;
    for (int base = 0; base < chunks; base += blockDim.x) {
        const int c = base + threadIdx.x;
        const bool active = c < chunks;
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (active) unpack8(*reinterpret_cast<const uint4*>(src + (size_t)row * H + (size_t)c * 8), v);
        quantize_store(v, active, c, quant, dst + (size_t)row * H, dst_scale + (size_t)row * scale_groups);
    }
}

// ---------------------------------------------------------------- stage 2: gather / permute -------
// Block (tile, r) per padded row tile * BLOCK_M + r (blocks past the real tile count exit): it copies token
// sorted_ids[row] / K of src (16-byte chunks, one per thread), a padding row gets zeros; fp32 group scales
// follow (0 for padding). One row per block: one sorted_ids load, then independent copies (no serial walk).
extern "C" __global__ void gather_rows(const bf16* __restrict__ src, const float* __restrict__ src_scale,
                                       int scale_groups, const int* __restrict__ sorted_ids,
                                       const int* __restrict__ meta, int P, int K, int H,
                                       bf16* __restrict__ dst, float* __restrict__ dst_scale)
{
    const int tile = blockIdx.x;
    if (tile >= meta[0]) return;
    const int chunks = H / 8;
    const size_t row = (size_t)tile * BLOCK_M + blockIdx.y;
    const int pair = sorted_ids[row];
    const bool real = pair >= 0 && pair < P;
    const size_t token = real ? (size_t)(pair / K) : 0;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (real) v = *reinterpret_cast<const uint4*>(src + token * H + (size_t)c * 8);
        *reinterpret_cast<uint4*>(dst + row * H + (size_t)c * 8) = v;
    }
    if (src_scale != nullptr) {
        for (int g = threadIdx.x; g < scale_groups; g += blockDim.x)
            dst_scale[row * scale_groups + g] = real ? src_scale[token * scale_groups + g] : 0.0f;
    }
}

// ---------------------------------------------------------------- stages 4 & 6: grouped GEMM ------
// C[row, n] = sum_k A[row, k] * W[expert, n, k] over one padded tile of BLOCK_M rows (one expert) and
// BLOCK_N output features. mma.sync m16n8k16 bf16 -> fp32. Warps split K: warp w takes the 32-wide chunks
// (it * WARPS + w) * UNROLL + u, so at each step the block streams WARPS*UNROLL*64 contiguous bytes of every
// weight row. Lane (g = lane/4, t = lane%4) loads 16 bytes = k in [8t, 8t+8) of a 32-chunk, for weight row
// n0 + g of each n8 tile (B) and activation rows g, g+8 of each m16 tile (A, from L2 into registers).
// The MMA's k order is permuted identically for A and B (step s uses k 8t+4s..8t+4s+3), so each lane's
// 16 bytes feed two m16n8k16 steps without shuffles. FP32 accumulators acc[m][j][4] live in registers;
// warps 1..WARPS-1 hand theirs to warp 0 through shared memory (fixed order: deterministic), which
// rounds to bf16 and stores. SCALED (fp8): A holds e4m3 values, each 32-chunk's MMA result is multiplied by
// the row's fp32 group scale (group 128 = 4 chunks) before it joins the accumulator.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint4 load_weights(const bf16* p) {   // streamed once: skip L1
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// W8A8: 8 e4m3 weights (8 bytes) as the 8 bf16 of a B fragment (value x 2^-112, exact)
__device__ __forceinline__ uint4 load_weights(const unsigned char* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return e4m3x8_to_bf16x8(v);
}

// cp.async of 16 bytes global -> shared, L2 only (weights are streamed once); src_bytes 0 zero-fills the slot
// (used for k or n past the edge; the source address is then still a valid one but is not read).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, int src_bytes) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N_PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N_PENDING) : "memory");
}

// Prefetch into L2 the weight bytes this lane would load for the step starting at chunk c0 (in range only).
__device__ __forceinline__ void prefetch_step(const wt_t* Wexp, int c0, int n0, int g, int t, int N, int Kd) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int k = (c0 + u) * 32 + 8 * t;
        if (k >= Kd) continue;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = n0 + 8 * j;
            if (n < N) asm volatile("prefetch.global.L2 [%0];" :: "l"(Wexp + (size_t)(n + g) * Kd + k));
        }
    }
}

// W8A8: the weight block scales of this block's n8 tiles at K chunk c, times 2^112 (the fragments' unscale);
// w_scale is the expert's [block rows][kgroups], rows below w_split (w13's gate) in block row n / 128, the rest
// (w13's up rows, blocked apart) in ceil(w_split / 128) + (n - w_split) / 128
struct WeightScales { const float* w_scale; int w_split, kgroups, n0, N; };
__device__ __forceinline__ float weight_scale(const WeightScales& s, int j, int c) {
    const int n = s.n0 + 8 * j;
    if (n >= s.N) return 0.0f;
    const int block_row = n < s.w_split ? n / 128 : (s.w_split + 127) / 128 + (n - s.w_split) / 128;
    return s.w_scale[(size_t)block_row * s.kgroups + (c >> 2)] * FP8_UNSCALE;
}

// The MMAs of one 32-wide K chunk c (chunk index, for the fp8 scales) with fragments already in registers.
template <bool SCALED>
__device__ __forceinline__ void chunk_mma(float (*acc)[NT][4], const uint4 (*a)[2], const uint4* b, int c,
                                          int chunks, const float* __restrict__ A_scale, int scale_groups,
                                          size_t row0, int g, const WeightScales& ws) {
    (void)ws;
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
        const uint4 lo = a[m][0], hi = a[m][1];      // rows g and g+8
        if (!SCALED) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                mma_bf16(acc[m][j], lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
                mma_bf16(acc[m][j], lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
            }
        } else {
            float s_lo = 0.0f, s_hi = 0.0f;
            if (c < chunks) {
                const int grp = c >> 2;
                s_lo = A_scale[(row0 + 16 * m + g) * scale_groups + grp];
                s_hi = A_scale[(row0 + 16 * m + g + 8) * scale_groups + grp];
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_bf16(part, lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
                mma_bf16(part, lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
#if W8A8
                const float w_s = c < chunks ? weight_scale(ws, j, c) : 0.0f;
                acc[m][j][0] += part[0] * (s_lo * w_s);
                acc[m][j][1] += part[1] * (s_lo * w_s);
                acc[m][j][2] += part[2] * (s_hi * w_s);
                acc[m][j][3] += part[3] * (s_hi * w_s);
#else
                acc[m][j][0] += part[0] * s_lo;
                acc[m][j][1] += part[1] * s_lo;
                acc[m][j][2] += part[2] * s_hi;
                acc[m][j][3] += part[3] * s_hi;
#endif
            }
        }
    }
}

// STAGES < 2 (1): each step's loads go to registers, then its MMAs run (one step in flight per warp).
// STAGES >= 2: a ring of STAGES steps in dynamic shared memory filled by cp.async, STAGES-1 steps in flight
// per warp while one is multiplied. Every lane reads back only the 16-byte slots it copied itself (the same
// lane -> (row, k) map as the register path), so cp.async.wait_group alone orders it: no barrier, and the
// MMA order (hence every bit of the result) is that of the register path with the same WARPS / UNROLL.
// Ring layout: [STAGES][WARPS][UNROLL][SLOT_VECS][32 lanes] uint4, SLOT_VECS = NT weight vectors then
// 2 * M_TILES activation vectors (rows g, g+8 of each m16 tile); lanes are contiguous: conflict-free.
#define SLOT_VECS (NT + 2 * M_TILES)
// split-K reduction slabs: one warp's accumulators (lane-major); as many as fit in 24 KiB, at least one
#define SLAB_FLOATS (M_TILES * NT * 4 * 32)
#define SLABS_FIT (6144 / SLAB_FLOATS)
// (WARPS > 4 keeps one slab: the multi-slab form cost those builds registers, e.g. 64 -> 70 at BLOCK_N=32)
#define REDUCE_SLABS \
    (WARPS - 1 < 1 || WARPS > 4 ? 1 : (SLABS_FIT < 1 ? 1 : (SLABS_FIT < WARPS - 1 ? SLABS_FIT : WARPS - 1)))
// (an explicit min-blocks of 1 for the ring and UNROLL=1: without it ptxas capped some of those builds at 64-80
// registers and spilled; the measured register-path builds keep their bounds, hence their register counts)
#if STAGES < 2 && UNROLL > 1
#define GEMM_BOUNDS __launch_bounds__(WARPS * 32)
#else
#define GEMM_BOUNDS __launch_bounds__(WARPS * 32, 1)
#endif
template <bool SCALED>
__device__ __forceinline__ void grouped_gemm(const bf16* __restrict__ A, const float* __restrict__ A_scale,
                                             int scale_groups, const wt_t* __restrict__ W,
                                             const float* __restrict__ W_scale, int w_split,
                                             const int* __restrict__ tile_expert,
                                             int N, int Kd, int E, bf16* __restrict__ C)
{
    static_assert(!W8A8 || SCALED, "W8A8 is the W8A8 design: fp8 activations (gemm_fp8_scaled)");
    __shared__ float partial[REDUCE_SLABS * SLAB_FLOATS];
    const int tile = blockIdx.x;
    // tile_expert is -1 past the real tile count (align writes it), so one load decides the block's fate
    const int expert = tile_expert[tile];
    if (expert < 0 || expert >= E) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.y * BLOCK_N;
    const size_t row0 = (size_t)tile * BLOCK_M;
    const int chunks = (Kd + 31) / 32;
    const wt_t* Wexp = W + (size_t)expert * N * Kd;
    const int kgroups = (Kd + 127) / 128, w_rows = (w_split + 127) / 128 + (N - w_split + 127) / 128;
    const WeightScales ws{W_scale != nullptr ? W_scale + (size_t)expert * w_rows * kgroups : nullptr, w_split, kgroups,
                          n0, N};

    float acc[M_TILES][NT][4];
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;

#if STAGES < 2
#if PREFETCH > 0
    // L2 prefetches of the weights PREFETCH steps ahead (no registers held, results unchanged): the steps
    // 1..PREFETCH-1 here, step s + PREFETCH at the top of step s
    for (int d = 1; d < PREFETCH; ++d) prefetch_step(Wexp, (d * WARPS + warp) * UNROLL, n0, g, t, N, Kd);
#endif
    for (int c0 = warp * UNROLL; c0 < chunks; c0 += WARPS * UNROLL) {
#if PREFETCH > 0
        prefetch_step(Wexp, c0 + PREFETCH * WARPS * UNROLL, n0, g, t, N, Kd);
#endif
        uint4 b[UNROLL][NT];
        uint4 a[UNROLL][M_TILES][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {                       // issue every load of this step first
            const int k = (c0 + u) * 32 + 8 * t;
            const bool kin = k < Kd;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = n0 + 8 * j;
                b[u][j] = (kin && n < N) ? load_weights(Wexp + (size_t)(n + g) * Kd + k) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                const bf16* ar = A + (row0 + 16 * m + g) * Kd + k;
                a[u][m][0] = kin ? *reinterpret_cast<const uint4*>(ar) : make_uint4(0, 0, 0, 0);
                a[u][m][1] = kin ? *reinterpret_cast<const uint4*>(ar + (size_t)8 * Kd) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            chunk_mma<SCALED>(acc, a[u], b[u], c0 + u, chunks, A_scale, scale_groups, row0, g, ws);
    }
#else
    extern __shared__ uint4 ring[];
    // step s of this warp covers chunks (s * WARPS + warp) * UNROLL + u; every warp runs the same step count
    // (a step wholly past K copies zeros and skips its MMAs, as the register path skips it)
    const int nsteps = (chunks + WARPS * UNROLL - 1) / (WARPS * UNROLL);
    auto slot_of = [&](int stage, int u, int v) -> uint4* {
        return ring + ((((size_t)stage * WARPS + warp) * UNROLL + u) * SLOT_VECS + v) * 32 + lane;
    };
    auto issue = [&](int s) {                                    // cp.async every 16 bytes of step s
        const int stage = s % STAGES;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = ((s * WARPS + warp) * UNROLL + u) * 32 + 8 * t;
            const bool kin = k < Kd;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = n0 + 8 * j;
                const bool in = kin && n < N;
                cp_async16(slot_of(stage, u, j), in ? Wexp + (size_t)(n + g) * Kd + k : Wexp, in ? 16 : 0);
            }
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                const bf16* ar = A + (row0 + 16 * m + g) * Kd + (kin ? k : 0);
                cp_async16(slot_of(stage, u, NT + 2 * m), ar, kin ? 16 : 0);
                cp_async16(slot_of(stage, u, NT + 2 * m + 1), ar + (size_t)8 * Kd, kin ? 16 : 0);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {                       // prologue: steps 0..STAGES-2 in flight
        if (s < nsteps) issue(s);
        cp_async_commit();                                       // (empty groups keep the count uniform)
    }
    for (int s = 0; s < nsteps; ++s) {
        // refill the slot step s-1 used (this lane read it last iteration, before its MMAs), then wait for
        // step s: groups committed so far = STAGES + s, the newest STAGES-1 may still be pending
        if (s + STAGES - 1 < nsteps) issue(s + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        const int c0 = (s * WARPS + warp) * UNROLL;
        if (c0 >= chunks) continue;                              // warp-uniform
        const int stage = s % STAGES;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            uint4 b[NT];
            uint4 a[M_TILES][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) b[j] = *slot_of(stage, u, j);
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                a[m][0] = *slot_of(stage, u, NT + 2 * m);
                a[m][1] = *slot_of(stage, u, NT + 2 * m + 1);
            }
            chunk_mma<SCALED>(acc, a, b, c0 + u, chunks, A_scale, scale_groups, row0, g, ws);
        }
    }
    cp_async_wait<0>();                                          // nothing left in flight at exit
#endif
    // split-K reduction through shared slabs (lane-major, conflict-free), REDUCE_SLABS warps per round:
    // warps w0..w0+REDUCE_SLABS-1 store at once, then warp 0 adds them in warp order; the sum is
    // ((acc_0 + acc_1) + acc_2) + ... in every configuration (deterministic, same bits as one warp per round)
    for (int w0 = 1; w0 < WARPS; w0 += REDUCE_SLABS) {
        if (warp >= w0 && warp < w0 + REDUCE_SLABS) {
            float* slab = partial + (warp - w0) * SLAB_FLOATS;
#pragma unroll
            for (int m = 0; m < M_TILES; ++m)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) slab[((m * NT + j) * 4 + q) * 32 + lane] = acc[m][j][q];
        }
        __syncthreads();
        if (warp == 0) {
            const int n_slabs = min(REDUCE_SLABS, WARPS - w0);
#pragma unroll
            for (int sl = 0; sl < REDUCE_SLABS; ++sl) {
                if (sl >= n_slabs) break;
                const float* slab = partial + sl * SLAB_FLOATS;
#pragma unroll
                for (int m = 0; m < M_TILES; ++m)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int q = 0; q < 4; ++q) acc[m][j][q] += slab[((m * NT + j) * 4 + q) * 32 + lane];
            }
        }
        if (w0 + REDUCE_SLABS < WARPS) __syncthreads();          // the slabs are reused by the next round
    }
    if (warp != 0) return;
    // epilogue: lane holds rows g, g+8 and columns 2t, 2t+1 of each n8 tile -> bf16x2 stores
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = n0 + 8 * j + 2 * t;
            if (n0 + 8 * j >= N) continue;
            const size_t r = row0 + 16 * m + g;
            *reinterpret_cast<unsigned*>(C + r * N + n) = pack_bf16x2(acc[m][j][0], acc[m][j][1]);
            *reinterpret_cast<unsigned*>(C + (r + 8) * N + n) = pack_bf16x2(acc[m][j][2], acc[m][j][3]);
        }
}

#if !W8A8
extern "C" __global__ void GEMM_BOUNDS gemm_bf16(
    const bf16* __restrict__ A, const bf16* __restrict__ W, const int* __restrict__ tile_expert,
    int N, int Kd, int E, bf16* __restrict__ C)
{
    grouped_gemm<false>(A, nullptr, 0, W, nullptr, N, tile_expert, N, Kd, E, C);
}
#endif

// W8A8: W holds e4m3 bytes, W_scale its block scales [E][block rows][ceil(Kd / 128)] (w_split: see weight_scale)
extern "C" __global__ void GEMM_BOUNDS gemm_fp8_scaled(
    const bf16* __restrict__ A, const float* __restrict__ A_scale, int scale_groups, const wt_t* __restrict__ W,
    const float* __restrict__ W_scale, int w_split, const int* __restrict__ tile_expert, int N, int Kd, int E,
    bf16* __restrict__ C)
{
    grouped_gemm<true>(A, A_scale, scale_groups, W, W_scale, w_split, tile_expert, N, Kd, E, C);
}

// ---------------------------------------------------------------- stage 5: SiLU(gate) * up --------
// Block per padded tile; rows one after another, each lane owns 8 consecutive intermediate features.
// Reads the bf16 gate/up GEMM output, h = bf16(SiLU(g) * u) in fp32 (no FMA contraction: numpy's order),
// then stores h (quant 0) or its fp8 / mxfp8 quantization (quant 1 / 2).
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, const int* __restrict__ meta, int I, int quant,
                                    int scale_groups, bf16* __restrict__ inter, float* __restrict__ inter_scale)
{
    // Block (tile, r) owns padded row tile * BLOCK_M + r; its threads own consecutive 8-element chunks, so a
    // quantization group (16 or 4 chunks) lies within one warp. One row per block keeps every load independent.
    const int tile = blockIdx.x;
    if (tile >= meta[0]) return;
    const int chunks = I / 8;
    const size_t row = (size_t)tile * BLOCK_M + blockIdx.y;
    for (int base = 0; base < chunks; base += blockDim.x) {
        const int c = base + threadIdx.x;
        const bool active = c < chunks;
        float gate[8], up[8], h[8];
        for (int i = 0; i < 8; ++i) h[i] = 0.0f;
        if (active) {
            unpack8(*reinterpret_cast<const uint4*>(gate_up + row * 2 * I + (size_t)c * 8), gate);
            unpack8(*reinterpret_cast<const uint4*>(gate_up + row * 2 * I + I + (size_t)c * 8), up);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float silu = __fdiv_rn(gate[i], __fadd_rn(1.0f, expf(-gate[i])));
                h[i] = round_bf16(__fmul_rn(silu, up[i]));
            }
        }
        if (quant == 0) {
            if (active) *reinterpret_cast<uint4*>(inter + row * I + (size_t)c * 8) = pack8(h);
        } else {
            quantize_store(h, active, c, quant, inter + row * I, inter_scale + row * scale_groups);
        }
    }
}

// ---------------------------------------------------------------- stage 7: scatter / un-permute ---
// Block per (token, slot) pair: copy its padded down-GEMM row back to pair order; NaN for a bad expert id.
extern "C" __global__ void scatter_rows(const bf16* __restrict__ down, const int* __restrict__ row_of_pair, int H,
                                        bf16* __restrict__ pair_out)
{
    const int pair = blockIdx.x, row = row_of_pair[pair];
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        uint4 v = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
        if (row >= 0) v = *reinterpret_cast<const uint4*>(down + (size_t)row * H + (size_t)c * 8);
        *reinterpret_cast<uint4*>(pair_out + (size_t)pair * H + (size_t)c * 8) = v;
    }
}

// ---------------------------------------------------------------- stage 8: combine ----------------
#define COMBINE_GROUP 4
// Block per token; lane owns 8 hidden features, one fp32 accumulator each, slots k = 0..K-1 in order,
// acc = acc + w * v with separate roundings (numpy's order). rows == nullptr: src is [T*K, H] in pair order
// (after scatter); otherwise src is the padded down buffer read through rows (scatter fused; -1 -> NaN).
extern "C" __global__ void combine(const bf16* __restrict__ src, const int* __restrict__ rows,
                                   const float* __restrict__ topk_weights, int K, int H, int out_f32,
                                   void* __restrict__ out)
{
    const int token = blockIdx.x;
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        // slots in groups of COMBINE_GROUP: every row index, weight and 16-byte load of a group is issued
        // before its adds (independent loads in flight), the adds stay in slot order k = 0..K-1
        for (int k0 = 0; k0 < K; k0 += COMBINE_GROUP) {
            int row[COMBINE_GROUP];
            float w[COMBINE_GROUP];
            uint4 v[COMBINE_GROUP];
#pragma unroll
            for (int u = 0; u < COMBINE_GROUP; ++u) {
                const int pair = token * K + k0 + u;
                const bool in = k0 + u < K;
                row[u] = in ? (rows == nullptr ? pair : rows[pair]) : -1;
                w[u] = in ? topk_weights[pair] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < COMBINE_GROUP; ++u)
                v[u] = row[u] >= 0 ? *reinterpret_cast<const uint4*>(src + (size_t)row[u] * H + (size_t)c * 8)
                                   : make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);   // NaN
#pragma unroll
            for (int u = 0; u < COMBINE_GROUP; ++u) {
                if (k0 + u >= K) break;
                float f[8];
                unpack8(v[u], f);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[u], f[i]));
            }
        }
        if (out_f32) {
            float4* o = reinterpret_cast<float4*>(static_cast<float*>(out) + (size_t)token * H + (size_t)c * 8);
            o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        } else {
            *reinterpret_cast<uint4*>(static_cast<bf16*>(out) + (size_t)token * H + (size_t)c * 8) = pack8(acc);
        }
    }
}
"""

KERNELS = (
    "moe_align", "quantize_rows", "gather_rows", "gemm_bf16", "gemm_fp8_scaled", "silu_mul", "scatter_rows", "combine",
)
W8A8_KERNELS = tuple(k for k in KERNELS if k != "gemm_bf16")  # W8A8 1: the bf16 GEMM is not compiled
# DEFAULTS are the compile-time knobs of the large-batch tiles, what kernels.expert_centric_path.auto_params picks
# above T*K = 64 (below: BLOCK_N=32, WARPS=8, register loads); VARIANTS the other sets the offline report compiles.
DEFAULTS = {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 1, "UNROLL": 2, "STAGES": 2, "PREFETCH": 0, "W8A8": 0}
VARIANTS = [
    {"BLOCK_N": 128, "WARPS": 4, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 32, "WARPS": 8, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 1, "UNROLL": 4, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 64, "WARPS": 8, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 2, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0},
    {"BLOCK_N": 128, "WARPS": 4, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 2},
    {"BLOCK_N": 32, "WARPS": 8, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 1},
    {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 1, "UNROLL": 1, "STAGES": 4, "PREFETCH": 0},
    {"BLOCK_N": 128, "WARPS": 4, "M_TILES": 1, "UNROLL": 1, "STAGES": 3, "PREFETCH": 0},
    {"BLOCK_N": 32, "WARPS": 8, "M_TILES": 1, "UNROLL": 1, "STAGES": 4, "PREFETCH": 0},
    {"BLOCK_N": 32, "WARPS": 8, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0, "W8A8": 1},  # W8A8
    {"BLOCK_N": 64, "WARPS": 4, "M_TILES": 1, "UNROLL": 2, "STAGES": 1, "PREFETCH": 0, "W8A8": 1},
]

# kernels.expert_centric_path.FAMILY registers it (tools.compile_report finds it there)
EXPERT_CENTRIC_SOURCE = CudaSource(
    name="expert_centric",
    code=CODE,
    kernels=KERNELS,
    defaults=dict(DEFAULTS),
    variants=[dict(v) for v in VARIANTS],
    description="expert-centric MoE decode: align, quantize, gather, mma.sync grouped GEMMs, SiLU, scatter, combine",
)
