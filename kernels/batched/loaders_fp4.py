"""The 4-bit formats' device loaders (``mxfp4``, ``nvfp4``: :mod:`kernels.formats_fp4`), registered with the batched
families as :mod:`kernels.batched.loaders`' others are, whose docstring states the contract they implement.

e2m1 values two a byte along k, the even one in the low nibble; every loader widens a byte by bit placement and two
exact bf16x2 multiplies (``E2M1_BF16``: no FP32 subnormal on the way, which the kernels' FP32 arithmetic would
flush), never a lookup (why: ``MXFP4_FMA``'s comment). The FMA loaders read mxfp4 and nvfp4; the tensor-core loaders
(``MXFP4_MMA``, ``NVFP4_MMA``: the shared ``E2M1_MMA`` after each format's block scales, for the tensor-core and
per-pair families) scale each lane's values before the mma (nvfp4's global scale after it).
"""

from __future__ import annotations

from kernels.batched.loaders import ROW_ADDRESSING, Loader, register_loader
from kernels.formats import MXFP4, NVFP4

E2M1_BF16 = r"""// ---- e2m1 pairs to bf16 pairs (kernels/batched/loaders_fp4.py) ----
// Per byte (two values): one integer multiply places the low nibble's bits at 9..6 and the high one's at 25..22, a
// mask keeps both magnitudes (bf16 bits 8..6 and 24..22) and a shifted copy the signs (15, 31): each half is then
// value x 2^-126 exactly (0.5 is bf16's subnormal 2^-127); two bf16x2 multiplies, exact, make it the value (x 2^126)
// and the weight (x the block scale as bf16: an e8m0 scale is a power of two, an e4m3 one has four significant bits,
// an e2m1 value two, so the product is a bf16 wherever its float32 is finite, subnormals included). Why bf16x2 and
// not float32: the kernels' FP32 arithmetic flushes subnormals (kernels/compile.py: -ftz=true), and the subnormal
// 2^-127 is both 0.5's bits and an e8m0 scale of 0; bf16x2 multiplies keep them (bf16x2_mul:
// kernels/device_helpers.py).
// byte (bits 7..0 of w: two e2m1 values) x the scale in both halves of scale2, as bf16x2
__device__ __forceinline__ u32 e2m1x2_to_bf16x2(u32 w, u32 scale2) {
    const u32 v = (w & 0xFFu) * 0x40040u;                            // byte << 6 | byte << 18
    const u32 bits = (v & 0x01C001C0u) | ((v << 6) & 0x80008000u);  // value x 2^-126, each half
    return bf16x2_mul(bf16x2_mul(bits, 0x7E807E80u), scale2);        // x 2^126, x the scale
}
"""

E8M0_BF16 = r"""// an e8m0 scale as bf16 in both halves: 2^(s - 127) (s = 0: the subnormal 2^-127; 255: NaN)
__device__ __forceinline__ u32 e8m0_bf16x2(u32 s) {
    const u32 bits = s == 0u ? 0x0040u : s == 255u ? 0x7FC0u : s << 7;
    return bits | (bits << 16);
}
"""

E4M3_BF16 = r"""// an e4m3fn byte as bf16 bits (exact: every e4m3 is a bf16; cvt to f32, the top half; 0x7f / 0xff NaN)
__device__ __forceinline__ u32 e4m3_bf16(u32 b) {
    float lo, hi;
    e4m3x2_to_f32(b & 0xFFu, lo, hi);
    return __float_as_uint(lo) >> 16;
}
"""

MXFP4_FMA = r"""
// ---- weight loader: mxfp4 (kernels/batched/loaders.py) ----
// e2m1 values two a byte along k, the even one in the low nibble (kernels/formats_fp4.py): a weight chunk holds the
// values of an activation chunk in a quarter of its bytes (GB_BYTES / DB_BYTES 16: 8 values in a 4-byte load), which
// lie in one 32-value block of the row, so a chunk has one e8m0 scale, 2^(s - 127) (s = 0: 2^-127, a subnormal;
// s = 255: NaN), read as a byte per chunk and held as bf16 in both halves of a word.
//
// Widening: bit placement and two exact bf16x2 multiplies per byte (E2M1_BF16 above), no lookup: each weight is
// value x scale exactly, the reference's dequantized float32 (a bf16 wherever it is finite, NaN and infinity as the
// reference rounds them). Why not a lookup: a 16-entry table indexed per lane cannot live in registers (no indexed
// registers), and in constant memory divergent indices serialize. Per two values: one integer multiply, three
// integer operations, two bf16x2 multiplies and the two halves' unpacking, amortized over a tile's pairs.
typedef unsigned char weight_t;
#define VALUES_PER_WEIGHT 2
#define WEIGHT_CHUNK_BYTES(act_bytes) ((act_bytes) / 4)
#define MX_BLOCK 32
// scales: uint8 [E, 2I, ceil(H/32)] (w13's gate rows, then its up rows) and [E, H, ceil(I/32)]: a row of blocks per
// weight row
typedef unsigned char scale_t;
typedef const scale_t* scale_row_t;   // a row's scales: where they start
typedef u32 chunk_scale_t;            // a chunk's scale as bf16, in both halves
struct scale_geometry_t { int hidden, inter, hblocks, iblocks; };      // the dims, a row's blocks along H and I
__device__ __forceinline__ scale_geometry_t scale_geometry(int hidden, int inter, const float* globals) {
    (void)globals;
    return {hidden, inter, (hidden + MX_BLOCK - 1) / MX_BLOCK, (inter + MX_BLOCK - 1) / MX_BLOCK};
}
__device__ __forceinline__ const scale_t* w13_scale_row(const scale_t* s, scale_geometry_t g, int e, int i, bool up) {
    return s + ((size_t)e * 2 * g.inter + (up ? g.inter : 0) + i) * (size_t)g.hblocks;
}
__device__ __forceinline__ const scale_t* w2_scale_row(const scale_t* s, scale_geometry_t g, int e, int h) {
    return s + ((size_t)e * g.hidden + h) * (size_t)g.iblocks;
}
""" + E8M0_BF16 + r"""// a lane past the row's end (ok false) reads block 0's byte (its values are zeros; were that
// scale NaN, the row's dot product is NaN anyway, as in the reference)
template <int ACT_BYTES>
__device__ __forceinline__ chunk_scale_t chunk_scale(const scale_t* scales, int c, bool ok) {
    static_assert(MX_BLOCK % (ACT_BYTES / 2) == 0, "a chunk lies in one scale block");
    return e8m0_bf16x2(__ldg(scales + (ok ? c * (ACT_BYTES / 2) / MX_BLOCK : 0)));
}
""" + E2M1_BF16 + r"""template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, chunk_scale_t scale2, float& lo, float& hi) {
    const u32 pair = e2m1x2_to_bf16x2(word(wv, w / 4) >> (8 * (w % 4)), scale2);  // values 2w and 2w + 1, scaled
    lo = bf16_lo(pair);
    hi = bf16_hi(pair);
}
"""

NVFP4_FMA = r"""
// ---- weight loader: nvfp4 (kernels/batched/loaders.py) ----
// e2m1 values as mxfp4's (two a byte along k, the even one in the low nibble; a 4-byte chunk of 8 values at GB_BYTES
// / DB_BYTES 16), an e4m3fn block scale per 16 values along k (a chunk lies in one block: one byte a chunk), and a
// float32 global scale per expert and matrix (w13's gate and up rows share theirs). The reference's weight is
// (value x block scale) x global in float32: the first product exact (2 x 4 significant bits), the second rounded
// once. So the global scale is applied per weight, after the block scale, never folded into it (block x global would
// round first and value x that round again: a 1.5 or 3 value would differ in the last bit). The global scales come as
// the kernels' last argument (scale_geometry's globals, [E] float32); each scale row carries its expert's (one load
// per row, where the rows are set up), each chunk's scale is the pair (block as bf16 in both halves, global).
//
// Widening: value x block scale as mxfp4's (E2M1_BF16: exact, a bf16), then x global in FP32 (the one rounding):
// bitwise the reference's dequantized float32 weight for every byte, block scale and global.
typedef unsigned char weight_t;
#define VALUES_PER_WEIGHT 2
#define WEIGHT_CHUNK_BYTES(act_bytes) ((act_bytes) / 4)
#define NV_BLOCK 16
// scales: uint8 e4m3fn bytes [E, 2I, ceil(H/16)] (w13's gate rows, then its up rows) and [E, H, ceil(I/16)]; globals
// float32 [E] per matrix
typedef unsigned char scale_t;
struct scale_row_t { const scale_t* blocks; float global; };        // a row's block scales and its expert's global
struct chunk_scale_t { u32 block2; float global; };                 // a chunk's (the block's as bf16, twice)
struct scale_geometry_t { const float* globals; int hidden, inter, hblocks, iblocks; };
__device__ __forceinline__ scale_geometry_t scale_geometry(int hidden, int inter, const float* globals) {
    return {globals, hidden, inter, (hidden + NV_BLOCK - 1) / NV_BLOCK, (inter + NV_BLOCK - 1) / NV_BLOCK};
}
__device__ __forceinline__ scale_row_t w13_scale_row(const scale_t* s, scale_geometry_t g, int e, int i, bool up) {
    return {s + ((size_t)e * 2 * g.inter + (up ? g.inter : 0) + i) * (size_t)g.hblocks, __ldg(g.globals + e)};
}
__device__ __forceinline__ scale_row_t w2_scale_row(const scale_t* s, scale_geometry_t g, int e, int h) {
    return {s + ((size_t)e * g.hidden + h) * (size_t)g.iblocks, __ldg(g.globals + e)};
}
""" + E4M3_BF16 + r"""// a lane past the row's end (ok false) reads block 0's byte (its values are zeros; were that
// scale NaN, the row's dot product is NaN anyway, as in the reference)
template <int ACT_BYTES>
__device__ __forceinline__ chunk_scale_t chunk_scale(const scale_row_t& row, int c, bool ok) {
    static_assert(NV_BLOCK % (ACT_BYTES / 2) == 0, "a chunk lies in one scale block");
    const u32 block = e4m3_bf16(__ldg(row.blocks + (ok ? c * (ACT_BYTES / 2) / NV_BLOCK : 0)));
    return {block | (block << 16), row.global};
}
""" + E2M1_BF16 + r"""template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, const chunk_scale_t& scale, float& lo, float& hi) {
    const u32 pair = e2m1x2_to_bf16x2(word(wv, w / 4) >> (8 * (w % 4)), scale.block2);  // value x block, exact
    lo = __fmul_rn(bf16_lo(pair), scale.global);                                       // x global: the rounding
    hi = __fmul_rn(bf16_hi(pair), scale.global);
}
"""

E2M1_MMA = r"""
// ---- weight loader: e2m1 values on tensor cores (kernels/batched/loaders_fp4.py) ----
// e2m1 values two a byte along k (the even one in the low nibble). A lane's A load holds FP4_HALVES chunks of 8 values
// (4: 16 bytes, where H and I are multiples of 32; 2: 8 bytes, multiples of 16; 1: 4 bytes), each inside one scale
// block of its row (32 values: mxfp4; 16: nvfp4, whose 16-byte loads hold two blocks, a scale each): the lane scales
// its own values before the mma (a_fragment(load, h, scale)), so each A fragment is the value times its block scale
// exactly -- e2m1 has two significant bits, an e8m0 scale none and an e4m3 one four, so the product is a bf16
// wherever its float32 is finite -- and the mma sums what the bf16 tensor-core path sums on those weights. The
// widening is E2M1_BF16's; the tensor cores take subnormal bf16 exactly (notes/diag_mma_subnormals.py).
typedef unsigned char weight_t;
#define VALUES_PER_WEIGHT 2
typedef u32 a_chunk_t;
#if FP4_HALVES == 4
typedef uint4 a_load_t;
#elif FP4_HALVES == 2
typedef uint2 a_load_t;
#else
typedef u32 a_load_t;
#endif
#define MMA_HALVES FP4_HALVES
#define FORMAT_WHOLE_ROUNDS 1
static_assert(FP4_HALVES == 1 || FP4_HALVES == 2 || FP4_HALVES == 4, "FP4_HALVES is 1, 2 or 4");
""" + E2M1_BF16 + r"""__device__ __forceinline__ uint4 e2m1x8_to_bf16x8(u32 w, u32 scale2) {
    return make_uint4(e2m1x2_to_bf16x2(w, scale2), e2m1x2_to_bf16x2(w >> 8, scale2),
                      e2m1x2_to_bf16x2(w >> 16, scale2), e2m1x2_to_bf16x2(w >> 24, scale2));
}
// the lane's scales of k block j as the loader's A_SCALE holds them: two bf16 (halves h 0, 1 of a 16-byte load
// in the low one, 2, 3 in the high one; one scale for a whole load: the same in both)
__device__ __forceinline__ u32 half_scale2(u32 scales, int h) {
    const u32 s = h < 2 ? (scales & 0xFFFFu) : (scales >> 16);
    return s | (s << 16);
}
__device__ __forceinline__ uint4 a_fragment(const uint4& v, int h, u32 scales) {
    return e2m1x8_to_bf16x8(h == 0 ? v.x : h == 1 ? v.y : h == 2 ? v.z : v.w, half_scale2(scales, h));
}
__device__ __forceinline__ uint4 a_fragment(const uint2& v, int h, u32 scales) {
    return e2m1x8_to_bf16x8(h == 0 ? v.x : v.y, scales);
}
__device__ __forceinline__ uint4 a_fragment(const u32& v, int h, u32 scales) {
    (void)h;
    return e2m1x8_to_bf16x8(v, scales);
}
template <bool PRE_SCALED_B = false>
__device__ __forceinline__ uint4 b_fragment(const uint4& v) { return v; }
__device__ __forceinline__ bf16_t intermediate_value(float v) { return f32_to_bf16(v); }  // the one bf16 rounding
// scale rows: a byte per block of each row, uint8 [E, 2I, ceil(H/SCALE_BLOCK)] (gate rows, then up rows) and
// [E, H, ceil(I/SCALE_BLOCK)]
typedef unsigned char mma_scale_t;
#define MMA_SCALE_GEOMETRY(hidden, inter)                                                                          \
    const int hblocks = ((hidden) + SCALE_BLOCK - 1) / SCALE_BLOCK;                                                \
    const int iblocks = ((inter) + SCALE_BLOCK - 1) / SCALE_BLOCK;                                                 \
    (void)hblocks; (void)iblocks
#define mma_w13_scale_row(s, e, i, up) ((s) + ((size_t)(e) * 2 * inter + ((up) ? inter : 0) + (i)) * (size_t)hblocks)
#define mma_w2_scale_row(s, e, h) ((s) + ((size_t)(e) * hidden + (h)) * (size_t)iblocks)
// a round's scales: per k block j, row tile t and rows g / g + 8, the lane's blocks' (read after the block's A loads;
// a lane past the range's end reads block 0's: its values are zeros -- were that scale NaN, the row's dot is NaN
// anyway, as in the reference). A macro read in mma_round's scope (q, CHECKED, c_end, tiles, RT); the format's
// block_scales(row, c) gives the two bf16 of chunk c's load.
#define ROUND_SCALES(UNROLL, RT) u32 a_scales[UNROLL][RT][2]; (void)part
#define LOAD_ROUND_SCALES(j, first)                                                                               \
    do {                                                                                                          \
        const int c_ = (first) + MMA_HALVES * q;                                                                  \
        const int chunk_ = !CHECKED || c_ < c_end ? c_ : 0;                                                       \
        _Pragma("unroll")                                                                                         \
        for (int t = 0; t < RT; ++t) {                                                                            \
            a_scales[j][t][0] = block_scales(tiles[t].scale_lo, chunk_);                                          \
            a_scales[j][t][1] = block_scales(tiles[t].scale_hi, chunk_);                                          \
        }                                                                                                         \
    } while (0)
#define APPLY_ROUND_SCALES(j) (void)0
#define A_SCALE(j, t, row) a_scales[j][t][row]
template <int N>
__device__ __forceinline__ auto mma_sums(float (&acc)[N][4], float (&part)[N][4]) -> float (&)[N][4] {
    (void)part;
    return acc;
}
"""

MXFP4_MMA = r"""
// ---- weight loader: mxfp4 on tensor cores (kernels/batched/loaders_fp4.py) ----
// an e8m0 scale per 32 values (E8M0_BF16), one per lane load.
#define SCALE_BLOCK 32
""" + E8M0_BF16 + r"""// chunk c's load: one block
__device__ __forceinline__ u32 block_scales(const unsigned char* row, int c) {
    return e8m0_bf16x2(__ldg(row + c * 8 / SCALE_BLOCK));
}
""" + E2M1_MMA

NVFP4_MMA = r"""
// ---- weight loader: nvfp4 on tensor cores (kernels/batched/loaders_fp4.py) ----
// an e4m3 scale per 16 values (E4M3_BF16), two per 16-byte lane load; the
// expert's float32 global scale after the mma, where each kernel's dot is complete (GLOBAL_OF / WITH_GLOBAL, its
// argument g13 / g2): the fragments hold value x block scale exactly and the dot is multiplied once -- the
// reference rounds each weight after that multiply instead (the tensor-core tolerance covers the difference).
#define SCALE_BLOCK 16
#define GLOBAL_OF(g, e) __ldg((g) + (e))
#define WITH_GLOBAL(v, global) __fmul_rn((v), (global))
""" + E4M3_BF16 + r"""// chunk c's load: block c / 2 (and the next)
__device__ __forceinline__ u32 block_scales(const unsigned char* row, int c) {
    const u32 first = e4m3_bf16(__ldg(row + c / 2));
    return FP4_HALVES == 4 ? first | (e4m3_bf16(__ldg(row + c / 2 + 1)) << 16) : first | (first << 16);
}
""" + E2M1_MMA


MXFP4_LOADER = register_loader(Loader(MXFP4.name, MXFP4_FMA, MXFP4_MMA + ROW_ADDRESSING))
NVFP4_LOADER = register_loader(Loader(NVFP4.name, NVFP4_FMA, NVFP4_MMA + ROW_ADDRESSING))
