"""The CUDA C device helpers every warp-decode source starts with: one copy, prepended as text.

``WARP_HELPERS`` is placed at the top of the strict (``kernels/warp_decode_cupy.py``), batched
(``kernels/batched/``) and prototype sources: bf16 as raw 16-bit patterns (widening is a
shift / mask, narrowing integer round-to-nearest-even; no ``cuda_bf16.h``), 4/8/16-byte vector loads with
branch-free masking, ``all_loads_arrived`` (the trick that makes ptxas issue a round's loads before its first
FMA) and the deterministic shuffle sum. ``WD_HOST_EMULATION`` (defined by the g++ emulations in the tests)
swaps the one inline-PTX instruction for plain C++.
"""

from __future__ import annotations

from kernels.geometry import BLOCK, TILE_ROW_BYTES, TILE_ROWS

WARP_HELPERS = r"""
// ---- shared device helpers (kernels/device_helpers.py) ----
typedef unsigned short bf16_t;
typedef unsigned int u32;
#define FULL_MASK 0xffffffffu
#define BF16_NAN ((bf16_t)0x7fc0)

template <int BYTES> struct Vec;
template <> struct Vec<16> { typedef uint4 T; };
template <> struct Vec<8> { typedef uint2 T; };
template <> struct Vec<4> { typedef u32 T; };

// word w (0..BYTES/4-1, a compile-time constant after unrolling) of a loaded vector
__device__ __forceinline__ u32 word(const uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }
__device__ __forceinline__ u32 word(const uint2& v, int w) { return w == 0 ? v.x : v.y; }
__device__ __forceinline__ u32 word(const u32& v, int) { return v; }

// read-only (ld.global.nc) load of chunk c of a row, or zeros when the lane's chunk lies past the row's
// end. Branch-free on purpose: a lane past the end loads chunk 0 (valid, and in flight for lane 0 anyway)
// and selects zeros, so ptxas can hoist every load of a round above the first FMA.
__device__ __forceinline__ uint4 zero_unless(bool ok, uint4 v) {
    return make_uint4(ok ? v.x : 0u, ok ? v.y : 0u, ok ? v.z : 0u, ok ? v.w : 0u);
}
__device__ __forceinline__ uint2 zero_unless(bool ok, uint2 v) { return make_uint2(ok ? v.x : 0u, ok ? v.y : 0u); }
__device__ __forceinline__ u32 zero_unless(bool ok, u32 v) { return ok ? v : 0u; }
template <typename V>
__device__ __forceinline__ V ldg_chunk(const V* row, int c, bool ok) {
    return zero_unless(ok, __ldg(row + (ok ? c : 0)));
}

// "Everything loaded so far must have arrived": returns 0, but computed from every word of a round's
// registers (0 * finite subnormal = +0 through an FMA the compiler cannot fold). Whatever is made to
// depend on it (an accumulator, an address) waits for all loads of the round. Without it ptxas sinks each
// weight load next to its FMAs, leaving ~1 load in flight per lane.
template <typename V, int A, int B>
__device__ __forceinline__ u32 all_loads_arrived(const V (&v)[A][B]) {
    u32 sink = 0u;
    #pragma unroll
    for (int a = 0; a < A; ++a)
        #pragma unroll
        for (int b = 0; b < B; ++b)
            #pragma unroll
            for (int w = 0; w < (int)(sizeof(V) / 4); ++w) sink ^= word(v[a][b], w);
    float zero;  // inline PTX so that no front end can prove the (finite) operand away
#ifdef WD_HOST_EMULATION  // the g++ emulations in tests/
    zero = fmaf(0.0f, __uint_as_float(sink & 0x007fffffu), 0.0f);
#else
    asm("fma.rn.f32 %0, %1, 0f00000000, 0f00000000;" : "=f"(zero) : "f"(__uint_as_float(sink & 0x007fffffu)));
#endif
    return __float_as_uint(zero);
}

// the two bf16 halves of a 32-bit word, widened exactly to fp32 (element 2j is the low half)
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    const u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((b >> 16) | 0x0040u);
    return (bf16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;  // every lane holds the same sum (fixed butterfly order: deterministic)
}

// Whether any of a token's K expert ids lies outside [0, E) (lane k checks slots k, k + 32, ...; warp-uniform):
// such a token's output is NaN and none of its weights is read.
__device__ __forceinline__ bool token_has_bad_id(const int* __restrict__ ids_t, int top_k, int experts, int lane) {
    bool bad = false;
    for (int k = lane; k < top_k; k += 32) bad |= (unsigned)__ldg(ids_t + k) >= (unsigned)experts;
    return __any_sync(FULL_MASK, bad);
}
// out[idx] = v as float32 (out_f32) or bf16 (the one final rounding)
__device__ __forceinline__ void store_output(void* __restrict__ out, int out_f32, long long idx, float v) {
    if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
    else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);
}
// ---- end of shared device helpers ----
"""

# The FP8 weight helpers (fp8-block128: e4m3fn values, a float32 scale per 128 x 128 block), after WARP_HELPERS:
# the strict FP8 kernels widen values to FP32 (e4m3x2_to_f32); the batched kernels' tensor-core A fragments take
# them as bf16 (e4m3x8_to_bf16x8). The g++ emulation decodes in software, through the same bit steps.
FP8_HELPERS = f"""
// ---- FP8 weight helpers (kernels/device_helpers.py) ----
// the formats' geometry (kernels/formats.py): a scale block's rows and columns; the tiled formats' tile rows and bytes
// a tile row (fp8-block128-t16, bf16-t16)
#define FP8_BLOCK {BLOCK}
#define TILE_ROWS {TILE_ROWS}
#define TILE_ROW_BYTES {TILE_ROW_BYTES}
""" + r"""#ifdef WD_HOST_EMULATION
inline float e4m3_decode(u32 b) {                      // the emulation's software decode of one e4m3fn byte
    const u32 mag = b & 0x7Fu;
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    if (mag == 0x7Fu) return __uint_as_float(0x7fc00000u);  // e4m3fn's NaN
    const int exp = (int)(mag >> 3), man = (int)(mag & 7u);
    return sign * (exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.0f + man / 8.0f, exp - 7));
}
inline u32 f16_bits_of(float v) {                      // an e4m3fn value's fp16 bits (exact: no rounding needed)
    const u32 u = __float_as_uint(v), sign = (u >> 16) & 0x8000u;
    if (v != v) return 0x7fffu;
    if ((u & 0x7fffffffu) == 0u) return sign;
    const int e = (int)((u >> 23) & 0xffu) - 127 + 15;  // e4m3fn values are fp16 normals (e >= 6)
    return sign | ((u32)e << 10) | ((u >> 13) & 0x3ffu);
}
#endif
// the two e4m3fn bytes of a 16-bit half word -> fp16x2 (cvt.rn.f16x2.e4m3x2: exact)
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
#ifdef WD_HOST_EMULATION
    return f16_bits_of(e4m3_decode(pair & 0xFFu)) | (f16_bits_of(e4m3_decode((pair >> 8) & 0xFFu)) << 16);
#else
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(pair & 0xFFFFu)));
    return h2;
#endif
}
// ... -> two floats (exact)
__device__ __forceinline__ void e4m3x2_to_f32(u32 pair, float& lo, float& hi) {
#ifdef WD_HOST_EMULATION
    lo = e4m3_decode(pair & 0xFFu);
    hi = e4m3_decode((pair >> 8) & 0xFFu);
#else
    const u32 h2 = e4m3x2_to_f16x2(pair);
    asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(h2));
#endif
}
// 8 e4m3fn values (a uint2, value v in byte v) as 8 bf16 (a uint4, value v in half v) equal to value x 2^-112,
// exactly and never subnormal: an fp16 value's bits shifted right by 3 are the bf16 bits of that value x 2^-112
// (fp16's 5-bit exponent lands in bf16's 8-bit one, bias 15 instead of 127; the 3 mantissa bits e4m3 has survive;
// the high half's zero low mantissa bits shift into the low half's bits 13..15): the shifted sign (bit 12) is
// cleared and the sign put back at bit 15. The tensor-core kernels multiply each FP32 partial by 2^112
// (FP8_UNSCALE) and the block scale. e4m3fn's NaN (0x7F / 0xFF) does not survive (the quantizer never writes it).
#define FP8_UNSCALE 0x1p112f
// bf16x2 multiply, round to nearest (subnormals kept: mul.rn.bf16x2 has no flush); the 4-bit loaders' widening
// and FP8_PRMT's x 2^8
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
#ifdef WD_HOST_EMULATION
    EmuFtz keep(false);  // the GPU's bf16x2 multiply keeps subnormals (tests/warp_checks.py)
    u32 out = 0;
    for (int half = 0; half < 2; ++half) {  // the float32 product of two bf16s, rounded to bf16
        const float p = __uint_as_float(((a >> (16 * half)) & 0xFFFFu) << 16)
                        * __uint_as_float(((b >> (16 * half)) & 0xFFFFu) << 16);
        out |= (u32)f32_to_bf16(p) << (16 * half);
    }
    return out;
#else
    u32 out;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
    return out;
#endif
}
#if defined(FP8_PRMT) && FP8_PRMT
// FP8_PRMT 1: the same bf16 bits in 4 instructions per 2 values instead of 4.5 (the pairs' byte moves are free):
// bytes 2n and 2n + 1 of w, each sign-extended to 16 bits (prmt.b32: a selector nibble's bit 3 replicates the
// selected byte's sign), shifted left by 4 and masked -- sign at bit 15, the 7 exponent and mantissa bits at 10..4:
// the bf16 bits of value x 2^-120, e4m3fn's subnormals as bf16 subnormals -- then one exact bf16x2 multiply by 2^8.
// The tensor cores take subnormals exactly (notes/diag_mma_subnormals.py), but x 2^-120 would put products and
// partials 2^8 closer to FP32's underflow: the multiply keeps the two widenings' outputs bitwise equal.
__device__ __forceinline__ u32 sext_byte_pair(u32 w, u32 selector) {
#ifdef WD_HOST_EMULATION
    u32 out = 0;
    for (int n = 0; n < 4; ++n) {
        const u32 nib = (selector >> (4 * n)) & 0xFu, byte = (w >> (8 * (nib & 3u))) & 0xFFu;
        out |= ((nib & 8u) ? ((byte & 0x80u) ? 0xFFu : 0u) : byte) << (8 * n);
    }
    return out;
#else
    u32 out;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(out) : "r"(w), "r"(selector));
    return out;
#endif
}
// bf16x2 bits times 2^8 (exact for |value| < 2^120; subnormals become normals)
__device__ __forceinline__ u32 bf16x2_times_256(u32 bits2) {
    return bf16x2_mul(bits2, 0x43804380u);  // 2^8 in both halves
}
// FP8_PRMT 2: the multiply moves to the B fragments (the activations x 2^8: b_fragment in the tensor-core kernels),
// the A fragment stays value x 2^-120 -- every product the same number, 3 instructions per 2 weight values and one
// multiply per 2 activation values, fewer in all where a warp's A rows outnumber its B columns. Exact while the
// activations stay below 2^120 in magnitude (bf16's largest finite value is about 2^128). FP8_PRMT 3 likewise, with the
// down's B fragments -- the intermediate -- written x 2^8 by the gate_up instead.
__device__ __forceinline__ u32 e4m3x2_to_bf16x2_scaled(u32 w, u32 selector) {
    const u32 low = (sext_byte_pair(w, selector) << 4) & 0x87F087F0u;  // value x 2^-120
#if FP8_PRMT >= 2
    return low;
#else
    return bf16x2_times_256(low);
#endif
}
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2& v) {
    return make_uint4(e4m3x2_to_bf16x2_scaled(v.x, 0x9180u), e4m3x2_to_bf16x2_scaled(v.x, 0xB3A2u),
                      e4m3x2_to_bf16x2_scaled(v.y, 0x9180u), e4m3x2_to_bf16x2_scaled(v.y, 0xB3A2u));
}
#else
__device__ __forceinline__ u32 f16x2_to_bf16x2_scaled(u32 h) {
    return ((h >> 3) & 0x0FFF0FFFu) | (h & 0x80008000u);
}
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2& v) {
    return make_uint4(f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2(v.x)), f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2(v.x >> 16)),
                      f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2(v.y)), f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2(v.y >> 16)));
}
#endif
// ---- end of FP8 weight helpers ----
"""

# The helpers of programmatic dependent launch, for sources with a ``PDL`` knob (0 or 1): the strict and the
# batched kernels.
PDL_HELPERS = r"""
// ---- PDL helpers (kernels/device_helpers.py) ----
// Loads of data the kernel right before may have written (x, topk_ids in gate_up; the intermediate in down).
// With PDL that kernel can still be running while this one starts, so these loads must stay behind
// pdl_wait(). __ldg (ld.global.nc on const __restrict__ data) is an invariant load the compiler may hoist
// above the wait -- the H200 caught it: down's intermediate loads were scheduled before griddepcontrol.wait
// and read gate_up's output before it was written. A volatile asm load (plain, coherent ld.global) keeps
// its place after the volatile asm wait.
__device__ __forceinline__ uint4 ld_dep(const uint4* p) {
#ifdef WD_HOST_EMULATION
    return *p;
#else
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}
__device__ __forceinline__ uint2 ld_dep(const uint2* p) {
#ifdef WD_HOST_EMULATION
    return *p;
#else
    uint2 v;
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#endif
}
__device__ __forceinline__ u32 ld_dep(const u32* p) {
#ifdef WD_HOST_EMULATION
    return *p;
#else
    u32 v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#endif
}
__device__ __forceinline__ int ld_dep(const int* p) { return (int)ld_dep(reinterpret_cast<const u32*>(p)); }
template <typename V>
__device__ __forceinline__ V ld_dep_chunk(const V* row, int c, bool ok) {
    return zero_unless(ok, ld_dep(row + (ok ? c : 0)));
}

// Programmatic dependent launch (PDL=1; the kernels are then launched with the programmatic-serialization
// attribute, kernels.compile.launch_ex). pdl_wait: block until the previous kernel in the stream has finished
// and its writes are visible (a no-op for an ordinary launch). pdl_release: let the next kernel's blocks start
// early. Each kernel releases only AFTER its own wait, so the next kernel may read, before its wait, anything
// written two or more kernels back (the routing), but nothing the kernel right before it writes.
__device__ __forceinline__ void pdl_wait() {
#if PDL && !defined(WD_HOST_EMULATION)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if PDL && !defined(WD_HOST_EMULATION)
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// ---- end of PDL helpers ----
"""

# The tensor-core helpers (mma.sync m16n8k16, bf16 x bf16 -> FP32; sm_80+) with the k permutation the batched
# source's comment above its tensor-core kernels explains: in a 32-wide k block a lane loads 16 contiguous bytes
# of its A rows (g, g + 8) and of B column g, words 0-1 feed one mma and words 2-3 the next. Used by the
# batched tensor-core kernels and the fused-layer prototype. ``emulated_mma_16816`` is the g++ emulation's.
MMA_HELPERS = r"""
// ---- tensor-core helpers (kernels/device_helpers.py) ----
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#ifdef WD_HOST_EMULATION
    emulated_mma_16816(d, a0, a1, a2, a3, b0, b1);   // the g++ emulation in tests/ (gathers the fragments)
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// one 32-wide k block: rows_lo / rows_hi are the lane's chunks of A rows g and g + 8, col its chunk of B
__device__ __forceinline__ void mma_k32(float (&d)[4], const uint4& rows_lo, const uint4& rows_hi, const uint4& col) {
    mma_16816(d, rows_lo.x, rows_hi.x, rows_lo.y, rows_hi.y, col.x, col.y);
    mma_16816(d, rows_lo.z, rows_hi.z, rows_lo.w, rows_hi.w, col.z, col.w);
}

// ---- end of tensor-core helpers ----
"""


# The tail of a down whose w2 rows sit in shared memory (after MMA_HELPERS): the fused-layer prototype's. The
# block holds ROWS padded w2 rows of every (token, slot) pair p (row r of pair p at w2_rows + (p * ROWS + r) *
# stride) and the pairs' intermediate rows; :func:`padded_row_bytes` and :func:`staged_parts` are the Python side
# of the same layout.
STAGED_TAIL_HELPERS = r"""
// ---- staged-down tail (kernels/device_helpers.py) ----
// bytes of a staged row: 2I rounded up to 64 mod 128, so the 8 rows of a fragment load hit distinct banks
__device__ __forceinline__ int staged_row_stride(int inter) { return (2 * inter + 63) / 128 * 128 + 64; }
// chunk c of a shared row, or zeros (a value, so no address of a local zero is ever formed)
__device__ __forceinline__ uint4 staged_chunk(const uint4* row, int c, bool ok) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (ok) v = row[c];
    return v;
}
// k parts per (pair, 16-row tile) item: as many as the block's warps can take in one round
template <int ROWS, int WARPS>
__device__ __forceinline__ int staged_parts(int chunks, int pairs) {
    return max(1, min((chunks + 3) / 4, WARPS / (pairs * ((ROWS + 15) / 16))));
}
// Items (pair p, 16-row tile, k part) on tensor cores: A = the 16 staged rows, B column = the pair's intermediate
// row (every column the same), FP32 in two accumulator chains (even / odd k blocks, indexed statically: a runtime
// index put them in local memory, a 48-byte stack frame that made the dots cost 8 us); lane (g, 0) ends with rows
// g, g + 8 of column 0 and writes them times the routing weight into partial[p][part][row]. Pairs of a token with
// a bad id (token_bad) are skipped. A source that defines STAGED_K_LOOP_ROLLED keeps the k loop rolled (fewer
// registers; the fused prototype at 64 registers spilled without it).
template <int ROWS, int WARPS>
__device__ __forceinline__ void staged_dots(const unsigned char* w2_rows, const uint4* inter_rows, float* partial,
                                            const int* token_bad, const float* __restrict__ topk_weights,
                                            int pairs, int top_k, int rows, int chunks, int stride, int parts,
                                            int warp, int lane) {
    const int g = lane >> 2, q = lane & 3;
    const int kblocks = (chunks + 3) / 4;                            // 32-wide k blocks
    constexpr int tiles = (ROWS + 15) / 16;
    for (int item = warp; item < pairs * tiles * parts; item += WARPS) {   // warp-uniform
        const int p = item / (tiles * parts);
        const int tile = (item / parts) % tiles, part = item % parts;
        if (token_bad[p / top_k]) continue;
        const int r_lo = min(tile * 16 + g, rows - 1), r_hi = min(tile * 16 + g + 8, rows - 1);  // past: last row
        const uint4* a_lo = reinterpret_cast<const uint4*>(w2_rows + ((size_t)p * ROWS + r_lo) * stride);
        const uint4* a_hi = reinterpret_cast<const uint4*>(w2_rows + ((size_t)p * ROWS + r_hi) * stride);
        const uint4* b_col = inter_rows + (size_t)p * chunks;
        float even[4] = {0.0f, 0.0f, 0.0f, 0.0f}, odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int kb_end = (part + 1) * kblocks / parts;
#ifdef STAGED_K_LOOP_ROLLED
        #pragma unroll 1
#endif
        for (int kb = part * kblocks / parts; kb < kb_end; kb += 2) {
            const int c = 4 * kb + q, c_next = c + 4;
            const bool ok = c < chunks, ok_next = kb + 1 < kb_end && c_next < chunks;   // else zeros, never stale
            mma_k32(even, staged_chunk(a_lo, c, ok), staged_chunk(a_hi, c, ok), staged_chunk(b_col, c, ok));
            mma_k32(odd, staged_chunk(a_lo, c_next, ok_next), staged_chunk(a_hi, c_next, ok_next),
                    staged_chunk(b_col, c_next, ok_next));
        }
        if (q == 0) {                                                 // lane (g, 0): column 0, rows g and g + 8
            const float wk = __ldg(topk_weights + p);
            float* dst = partial + ((size_t)p * parts + part) * ROWS;
            if (tile * 16 + g < rows) dst[tile * 16 + g] = wk * (even[0] + odd[0]);
            if (tile * 16 + g + 8 < rows) dst[tile * 16 + g + 8] = wk * (even[2] + odd[2]);
        }
    }
}
// every (t, row) of the block (rows h0 ..): its partials summed over slots and parts in order (k major, part
// minor), one write -- bf16 RNE, or fp32 when out_f32; NaN for a token with a bad id
template <int ROWS, int WARPS>
__device__ __forceinline__ void staged_outputs(const float* partial, const int* token_bad, void* __restrict__ out,
                                               int out_f32, int tokens, int top_k, int rows, int parts, int hidden,
                                               int h0, int tid) {
    for (int j = tid; j < tokens * rows; j += WARPS * 32) {
        const int t = j / rows, r = j - t * rows;
        float v = 0.0f;
        const float* mine = partial + (size_t)t * top_k * parts * ROWS + r;    // [k][part] of (t, r)
        for (int kp = 0; kp < top_k * parts; ++kp) v += mine[(size_t)kp * ROWS];
        if (token_bad[t]) v = __int_as_float(0x7fc00000);
        const long long idx = (long long)t * hidden + h0 + r;
        if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
        else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);  // the one final rounding
    }
}
// ---- end of staged-down tail ----
"""


# What the batched families (kernels/batched/) share: register caps, scale rows, the down kernels' start, PDL wait and
# end. Each family defines DOWN_WAITS_LATE (1: the tensor-core downs wait after their first w2 loads) before it.
BATCHED_HELPERS = r"""
// ---- batched helpers (kernels/device_helpers.py) ----
// The scales of weight row `row` (in units of the matrix's rows) of expert e: w13's gate row i at (e * 2 IB +
// i / 128) * HB, its up row at (e * 2 IB + IB + i / 128) * HB; w2's row h at (e * HB + h / 128) * IB.
__device__ __forceinline__ const float* scale_row(const float* scales, long long block_row, int col_blocks) {
    return scales + block_row * col_blocks;
}
// Register caps: __maxnreg__(N) (CUDA >= 12.4). With only __launch_bounds__(threads) ptxas picks ~64
// registers for mid-size tiles and spills; an explicit cap keeps every default spill-free.
#if GB_MAX_REGS > 0
#define GB_BOUNDS __maxnreg__(GB_MAX_REGS)
#else
#define GB_BOUNDS __launch_bounds__(GB_WARPS * 32)
#endif
#if DB_MAX_REGS > 0
#define DB_BOUNDS __maxnreg__(DB_MAX_REGS)
#else
#define DB_BOUNDS __launch_bounds__(DB_WARPS * 32)
#endif
// The start of both down kernels: zero the warp's partial, wait for gate_up, release the next kernel. (Measured
// and removed: a bulk L2 prefetch of each warp's first / next expert's w2 block, before the wait or one expert
// ahead -- 1-20 % slower at every point of results/sweep-batched-pdl-*.json.)
__device__ __forceinline__ void down_prologue(float* mine, int partial_floats, int lane) {
    for (int j = lane; j < partial_floats; j += 32) mine[j] = 0.0f;
#if !DOWN_WAITS_LATE
    pdl_wait();     // the intermediate is gate_up's output: every read of it is an ld_dep after this
    pdl_release();
#endif
    __syncwarp();
}

// DOWN_WAITS_LATE (the tensor-core downs): the wait between a round's w2 loads and its intermediate loads, once per
// warp (warp-uniform). Warps without work wait at the end of the loop (down_epilogue_wait) before the block writes
// anything.
__device__ __forceinline__ void wait_once(bool& waited) {
#if DOWN_WAITS_LATE
    if (!waited) {
        pdl_wait();
        pdl_release();
        waited = true;
    }
#endif
}
__device__ __forceinline__ void down_epilogue_wait() {
#if DOWN_WAITS_LATE
    pdl_wait();     // a no-op once waited
    pdl_release();
#endif
}

// ---- end of batched helpers ----
"""

# The end of the FMA and tensor-core downs (kernels/batched/): the warps' shared-memory partials summed, written once.
BLOCK_OUTPUTS = r"""
// The end of both down kernels (after __syncthreads): every (token, column) of the block sums the DB_WARPS
// partials [w][T][COLUMNS] in warp order and is written once; a token with any expert id outside [0, E)
// gets NaN. Deterministic, no atomics.
template <int COLUMNS>
__device__ __forceinline__ void write_block_outputs(const float* partial, const int* __restrict__ topk_ids,
                                                    void* __restrict__ out, int out_f32, int tokens, int hidden,
                                                    int experts, int top_k, int h0) {
    for (int j = threadIdx.x; j < tokens * COLUMNS; j += DB_WARPS * 32) {
        const int t = j / COLUMNS;
        const int h = h0 + (j - t * COLUMNS);
        if (h >= hidden) continue;
        float v = 0.0f;
        #pragma unroll
        for (int w = 0; w < DB_WARPS; ++w) v = __fadd_rn(v, partial[(size_t)w * tokens * COLUMNS + j]);
        bool bad = false;
        for (int k = 0; k < top_k; ++k) bad |= (unsigned)__ldg(topk_ids + t * top_k + k) >= (unsigned)experts;
        if (bad) v = __int_as_float(0x7fc00000);
        const long long idx = (long long)t * hidden + h;
        if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
        else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);  // the one final rounding
    }
}
"""


def padded_row_bytes(inter: int) -> int:
    """Bytes of one staged w2 row of ``inter`` bf16 (``staged_row_stride`` in the CUDA helpers)."""
    return (2 * inter + 63) // 128 * 128 + 64


def staged_parts(inter: int, rows: int, warps: int, pairs: int) -> int:
    """k parts per (pair, 16-row tile) item of the staged tail (``staged_parts`` in the CUDA helpers)."""
    return max(1, min(-(-(inter // 8) // 4), warps // (pairs * -(-rows // 16))))

