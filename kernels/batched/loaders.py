"""Weight formats as device-side loaders: the CUDA C a format supplies so that the batched kernels read it.

A batched kernel family is written once, against the names below; the family compiles with the loader of the
weights' format placed before its kernels, so a kernel body never branches on the format. Adding a format to the
batched paths is one :class:`~kernels.formats.WeightFormat` (data: layout, quantize, dequantize) and one
:class:`Loader` registered here (``tests/test_toy_format.py`` does it for a toy format).

**FMA loader** (``Loader.fma``, for the FMA family, ``kernels/batched/fma.py``):

* ``weight_t``: one stored element, ``VALUES_PER_WEIGHT`` values each (2 for two e2m1 a byte, else 1);
  ``WEIGHT_CHUNK_BYTES(act_bytes)``: the bytes of weights holding the values of an activation chunk of ``act_bytes``;
* ``scale_t``: one stored scale; ``scale_geometry_t`` and ``scale_geometry(hidden, inter, globals)``: what the scale
  rows need (computed once by a kernel, where it computed fp8's block counts; ``globals``: the kernel's last argument,
  a float32 scale per expert for a global-scaled format -- nvfp4 -- else null, never read); ``scale_row_t``: a row's
  scales as the kernels hold them (``const scale_t*``, or nvfp4's pointer and its expert's global scale);
  ``w13_scale_row(s13, g, e, i, up)`` / ``w2_scale_row(s2, g, e, h)``: the scales of expert ``e``'s gate (``up``: up)
  row ``i`` / down row ``h`` (the pointer as given where the format has none: never read). A function or a
  function-like macro:
  fp8-block128's w13 rows are a macro, as their expression stood in the kernel before it moved here -- as a
  function, the same addresses compiled to other (equivalent) machine code;
* ``chunk_scale_t`` and ``chunk_scale<ACT_BYTES>(scales, c, ok)``: the scale of chunk ``c`` of a row whose scale row
  is ``scales`` (a float, 1.0f where the format has none: no load; nvfp4: the block's and the expert's, two floats);
* ``weight_pair(chunk, w, scale, lo, hi)``: value pair ``w`` of a loaded weight chunk widened to FP32, dequantized.

An unscaled format's FMA loader ends with :data:`FMA_NO_SCALES` (``scale_t``, the rows, ``chunk_scale``); a format
with one scale per chunk (fp8-block128, mxfp4) declares :data:`FMA_FLOAT_SCALES` (``scale_row_t`` a pointer,
``chunk_scale_t`` a float: with them the kernels are the machine code they were before the two types existed).

**Tensor-core loader** (``Loader.mma``, for the tensor-core and per-pair families):

* ``weight_t`` and ``VALUES_PER_WEIGHT``; ``a_chunk_t`` (a lane's 8 values of an A row), ``a_load_t`` (its load per
  A row and k block), ``MMA_HALVES`` (chunks per load: a k block is 32 values wide times this -- 2 with fp8's
  16-value loads, 4 with the 4-bit formats' 32-value ones);
* ``a_fragment(load, h)``: half ``h`` of a lane's A load as a bf16 m16n8k16 fragment -- or, for a format that scales
  each lane's values before the mma (the 4-bit formats), ``a_fragment(load, h, scale)`` with ``A_SCALE(j, t, row)``,
  the scales its round loaded for k block ``j``, row tile ``t`` and rows g / g + 8; ``b_fragment<PRE>(chunk)``: a
  lane's 8 bf16 activations as its B fragment; ``intermediate_value(v)``: what the gate_up writes for ``v``;
* ``w13_gate_offset(i, hidden)``, ``w13_up_offset(gate, i, hidden, inter)``, ``w2_row_offset(h, inter)``: where a
  row starts inside its expert (values), and ``a_index(idx)``: the index of a row's ``idx``-th load;
* ``mma_scale_t`` (one stored scale), ``MMA_SCALE_GEOMETRY(hidden, inter)`` and ``mma_w13_scale_row(s, e, i, up)`` /
  ``mma_w2_scale_row(s, e, h)``: a row's scales (macros read in the core's row setup; the pointer as given where the
  format has none);
* ``ROUND_SCALES(UNROLL, RT)``, ``LOAD_ROUND_SCALES(j, first)``, ``APPLY_ROUND_SCALES(j)``: a round's scales --
  declared, loaded after the A loads of k block ``j``, applied after its mma (macros read in the round's scope) --
  and ``mma_sums(acc, part)``: where the mma accumulate (``acc``, or a scaled format's partial that the apply scales
  into ``acc``);
* ``FORMAT_WHOLE_ROUNDS``: 1 where unmasked whole rounds pay at every k range (fp8: its widening is most of a
  round), 0 where the family's own choice stands;
* optionally ``GLOBAL_OF(g, e)`` / ``WITH_GLOBAL(v, global)``: a float32 scale per expert (nvfp4's), read from the
  kernel's argument ``g13`` / ``g2`` and multiplied into each finished dot (without them: neither).

Both may read the family's derived macros: ``FP8_LOAD16`` (16 e4m3 values per load: H and I multiples of 16),
``FP8_PRMT`` (the e4m3 widening, kernels/device_helpers.py; 3: the intermediate written x 2^8) and ``FP4_HALVES``
(4-bit loads: :func:`loader_macros`). The 4-bit formats' loaders live in :mod:`kernels.batched.loaders_fp4`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernels.formats import (
    BF16_FORMAT,
    BF16_T16,
    FP8_BLOCK128,
    FP8_BLOCK128_T16,
    Fp4Format,
    WeightFormat,
    tile_k,
)


@dataclass(frozen=True)
class Loader:
    """The device code of one weight format: ``fma`` for the FMA kernels, ``mma`` for the tensor-core ones (None:
    that family does not read the format). ``needs``: derived macro -> the value the format requires (fp8 tiles:
    ``FP8_LOAD16`` 1)."""

    format: str
    fma: str | None
    mma: str | None
    needs: dict[str, int] = field(default_factory=dict)


LOADERS: dict[str, Loader] = {}


def register_loader(loader: Loader) -> Loader:
    """Make ``loader`` the batched families' reader of its format (re-registering a format replaces it)."""
    LOADERS[loader.format] = loader
    return loader


def loader_macros(dims: Any, values: dict[str, int], fmt: WeightFormat, widening: int) -> None:
    """The tensor-core loaders' derived macros in ``values``: ``FP8_LOAD16`` (fp8 where H and I are multiples of 16),
    ``FP8_PRMT`` (``widening`` on fp8: 2 for the tensor-core pair, 3 for the per-pair pair) and ``FP4_HALVES`` (4-bit
    formats: chunks of 8 values per A load, 4 where H and I are multiples of 32, 2 of 16, else 1); ValueError where
    the dims cannot hold the format's tiles (checked first: it names what the tiles need) or the format needs a
    macro these dims cannot give."""
    width = tile_k(1 if fmt.scaled else 2)
    if fmt.tiled and dims is not None and (dims.hidden % width or dims.intermediate % width):
        raise ValueError(f"{fmt.name} holds {width}-value tiles: H and I must be multiples of {width}, got "
                         f"H = {dims.hidden}, I = {dims.intermediate}")

    def fits(k: int) -> bool:
        return dims is None or (dims.hidden % k == 0 and dims.intermediate % k == 0)

    four_bit = isinstance(fmt, Fp4Format)
    values["FP8_LOAD16"] = int(fmt.scaled and not four_bit and fits(16))
    values["FP8_PRMT"] = widening if fmt.scaled and not four_bit else 0
    values["FP4_HALVES"] = (4 if fits(32) else 2 if fits(16) else 1) if four_bit else 0
    for macro, need in LOADERS[fmt.name].needs.items():
        if values[macro] != need:
            raise ValueError(f"{fmt.name} weights need {macro} {need} (H and I multiples of 16)")


def mma_halves(values: dict[str, int]) -> int:
    """Chunks of 8 values per lane A load (``MMA_HALVES``) under a tensor-core family's resolved macros: a k block is
    32 values wide times this."""
    return values.get("FP4_HALVES") or (2 if values.get("FP8_LOAD16") else 1)


def loader_for(fmt: WeightFormat | str, kind: str) -> str:
    """The ``kind`` ("fma" / "mma") loader text of ``fmt``; ValueError naming the formats that have one."""
    name = fmt if isinstance(fmt, str) else fmt.name
    loader = LOADERS.get(name)
    text = getattr(loader, kind) if loader is not None else None
    if text is None:
        have = sorted(n for n, entry in LOADERS.items() if getattr(entry, kind) is not None)
        raise ValueError(f"no {kind} loader for weight format {name!r}; formats with one: {have}")
    return text


# ---------------------------------------------------------------------------------------------------
# FMA loaders
# ---------------------------------------------------------------------------------------------------
FMA_FLOAT_SCALES = r"""typedef const scale_t* scale_row_t;   // a row's scales: where they start
typedef float chunk_scale_t;          // a chunk's scale
"""

FMA_NO_SCALES = r"""
// no scales: the kernels' scale pointers pass through unread, every chunk's scale is 1 (no load)
typedef float scale_t;
""" + FMA_FLOAT_SCALES + r"""
struct scale_geometry_t {};
__device__ __forceinline__ scale_geometry_t scale_geometry(int hidden, int inter, const float* globals) {
    (void)hidden; (void)inter; (void)globals;
    return {};
}
__device__ __forceinline__ const scale_t* w13_scale_row(const scale_t* s, scale_geometry_t g, int e, int i, bool up) {
    (void)g; (void)e; (void)i; (void)up;
    return s;
}
__device__ __forceinline__ const scale_t* w2_scale_row(const scale_t* s, scale_geometry_t g, int e, int h) {
    (void)g; (void)e; (void)h;
    return s;
}
template <int ACT_BYTES>
__device__ __forceinline__ float chunk_scale(const scale_t* scales, int c, bool ok) {
    (void)scales; (void)c; (void)ok;
    return 1.0f;
}
"""

BF16_FMA = r"""
// ---- weight loader: bf16 values (kernels/batched/loaders.py) ----
typedef bf16_t weight_t;
#define VALUES_PER_WEIGHT 1
#define WEIGHT_CHUNK_BYTES(act_bytes) (act_bytes)
template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, float scale, float& lo, float& hi) {
    (void)scale;
    lo = bf16_lo(word(wv, w));
    hi = bf16_hi(word(wv, w));
}
""" + FMA_NO_SCALES

FP8_FMA = r"""
// ---- weight loader: fp8-block128 (kernels/batched/loaders.py) ----
// e4m3fn bytes (a chunk holds the values of an activation chunk of twice the bytes), each widened and multiplied by
// its 128 x 128 block's scale (rounded once in FP32, as the reference reads it)
typedef unsigned char weight_t;
#define VALUES_PER_WEIGHT 1
#define WEIGHT_CHUNK_BYTES(act_bytes) ((act_bytes) / 2)
// scales: float32 [E, 2 ceil(I/128), ceil(H/128)] (gate row i's at block row i / 128, up row i's ceil(I/128) after)
// and [E, ceil(H/128), ceil(I/128)]
typedef float scale_t;
""" + FMA_FLOAT_SCALES + r"""
struct scale_geometry_t { int hblocks, iblocks; };                      // scale blocks along H and I
__device__ __forceinline__ scale_geometry_t scale_geometry(int hidden, int inter, const float* globals) {
    (void)globals;
    return {(hidden + FP8_BLOCK - 1) / FP8_BLOCK, (inter + FP8_BLOCK - 1) / FP8_BLOCK};
}
#define w13_scale_row(s, g, e, i, up)                                                                            \
    scale_row(s, (long long)(e) * 2 * (g).iblocks + ((up) ? (g).iblocks : 0) + (i) / FP8_BLOCK, (g).hblocks)
__device__ __forceinline__ const scale_t* w2_scale_row(const scale_t* s, scale_geometry_t g, int e, int h) {
    return scale_row(s, (long long)e * g.hblocks + h / FP8_BLOCK, g.iblocks);
}
template <int ACT_BYTES>
__device__ __forceinline__ float chunk_scale(const scale_t* scales, int c, bool ok) {
    return __ldg(scales + (ok ? c * (ACT_BYTES / 2) / FP8_BLOCK : 0));
}
template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, float scale, float& lo, float& hi) {
    e4m3x2_to_f32(word(wv, w / 2) >> (16 * (w % 2)), lo, hi);
    lo = __fmul_rn(lo, scale);
    hi = __fmul_rn(hi, scale);
}
"""

# ---------------------------------------------------------------------------------------------------
# Tensor-core loaders: values, addressing, scales
# ---------------------------------------------------------------------------------------------------
BF16_VALUES = r"""
// ---- weight loader: bf16 values (kernels/batched/loaders.py) ----
typedef bf16_t weight_t;
#define VALUES_PER_WEIGHT 1
typedef uint4 a_chunk_t;
typedef uint4 a_load_t;
#define MMA_HALVES 1
#define FORMAT_WHOLE_ROUNDS 0
__device__ __forceinline__ uint4 a_fragment(const uint4& v, int h) { (void)h; return v; }
template <bool PRE_SCALED_B = false>
__device__ __forceinline__ uint4 b_fragment(const uint4& v) { return v; }
__device__ __forceinline__ bf16_t intermediate_value(float v) { return f32_to_bf16(v); }  // the one bf16 rounding
"""

FP8_VALUES = r"""
// ---- weight loader: fp8-block128 values (kernels/batched/loaders.py) ----
// 8 e4m3fn values (8 bytes) per chunk, widened to a bf16 fragment in registers (value x 2^-112, exact; FP8_PRMT 2 / 3
// leave 2^8 of it to the B fragments); 16 per load with FP8_LOAD16 (64-wide k blocks). Whole rounds at every range.
typedef unsigned char weight_t;
#define VALUES_PER_WEIGHT 1
typedef uint2 a_chunk_t;
#if FP8_LOAD16
typedef uint4 a_load_t;
#define MMA_HALVES 2
#else
typedef uint2 a_load_t;
#define MMA_HALVES 1
#endif
#define FORMAT_WHOLE_ROUNDS 1
__device__ __forceinline__ uint4 a_fragment(const uint4& v, int h) {
    return e4m3x8_to_bf16x8(h == 0 ? make_uint2(v.x, v.y) : make_uint2(v.z, v.w));
}
__device__ __forceinline__ uint4 a_fragment(const uint2& v, int h) { (void)h; return e4m3x8_to_bf16x8(v); }
// a lane's B chunk (8 bf16 activations) as its fragment: with FP8_PRMT 2 times 2^8 (the factor the A fragments'
// widening leaves out). FP8_PRMT 3: the gate_up writes the intermediate already x 2^8 (intermediate_value), so the
// down's B (PRE_SCALED_B) is taken as loaded.
#define INTER_X256 (FP8_PRMT == 3)
template <bool PRE_SCALED_B = false>
__device__ __forceinline__ uint4 b_fragment(const uint4& v) {
#if FP8_PRMT >= 2
    if (INTER_X256 && PRE_SCALED_B) return v;
    return make_uint4(bf16x2_times_256(v.x), bf16x2_times_256(v.y), bf16x2_times_256(v.z), bf16x2_times_256(v.w));
#else
    return v;
#endif
}
// the gate_up's intermediate value: the one bf16 rounding of SiLU(g) x u, then with FP8_PRMT 3 x 2^8 (exact below
// 2^120; NaN and infinities stay)
__device__ __forceinline__ bf16_t intermediate_value(float v) {
    const bf16_t r = f32_to_bf16(v);
    if (!INTER_X256) return r;
    return f32_to_bf16(__uint_as_float((u32)r << 16) * 256.0f);
}
"""

ROW_ADDRESSING = r"""
// rows: the data contract's row-major layouts (w13 [E, 2I, H]: gate rows, then up rows; w2 [E, H, I])
__device__ __forceinline__ size_t w13_gate_offset(int i, int hidden) { return (size_t)i * hidden; }
__device__ __forceinline__ size_t w13_up_offset(size_t gate, int i, int hidden, int inter) {
    (void)i;
    return gate + (size_t)inter * hidden;
}
__device__ __forceinline__ size_t w2_row_offset(int h, int inter) { return (size_t)h * inter; }
__device__ __forceinline__ int a_index(int idx) { return idx; }
"""

TILE_ADDRESSING = r"""
// 16-row tiles (kernels/formats.py, bf16-t16 / fp8-block128-t16): the values of TILE_ROWS rows x TILE_K k are one
// contiguous tile of TILE_ROWS x TILE_ROW_BYTES bytes, k block after k block (w13: neuron group i / 8's gate rows,
// then its up rows; w2: rows 16t .. 16t + 15). A row's pointer is its tile's first k block plus its row in the tile
// (tile_row); a_index maps the row-major 16-byte index to the tiled one. The mma's A operand is 16 rows x 64 bytes
// per k block (4 loads of 16 bytes a row: 64 e4m3 or 32 bf16 values): one tile.
#define TILE_K (TILE_ROW_BYTES / (int)sizeof(weight_t))   // values per tile row
#define TILE_VALUES (TILE_ROWS * TILE_K)
#define TILE_CHUNKS (TILE_ROW_BYTES / 16)                   // 16-byte loads per tile row, and per tile:
#define TILE_LOADS (TILE_ROWS * TILE_CHUNKS)
static_assert(TILE_ROWS == 16 && TILE_ROW_BYTES == 64, "tiles: one per mma k block, 16 rows x 64 bytes");
static_assert(sizeof(a_load_t) == 16, "tiles are read in 16-byte loads (fp8: FP8_LOAD16 1)");
// row r of a tiled matrix with `cols` values per row, whose tiles hold `rows_per_tile` of its rows (in values)
__device__ __forceinline__ size_t tile_row(int r, int cols, int rows_per_tile) {
    return (size_t)(r / rows_per_tile) * (cols / TILE_K) * TILE_VALUES + (size_t)(r % rows_per_tile) * TILE_K;
}
__device__ __forceinline__ size_t w13_gate_offset(int i, int hidden) { return tile_row(i, hidden, TILE_ROWS / 2); }
__device__ __forceinline__ size_t w13_up_offset(size_t gate, int i, int hidden, int inter) {
    (void)i; (void)hidden; (void)inter;
    return gate + (TILE_ROWS / 2) * TILE_K;                            // a w13 tile: 8 gate rows, then their up rows
}
__device__ __forceinline__ size_t w2_row_offset(int h, int inter) { return tile_row(h, inter, TILE_ROWS); }
__device__ __forceinline__ int a_index(int idx) { return idx + (idx / TILE_CHUNKS) * (TILE_LOADS - TILE_CHUNKS); }
"""

BLOCK128_SCALE_ROWS = r"""
// scale rows: fp8-block128's float32 [E, 2 ceil(I/128), ceil(H/128)] (gate row i's at block row i / 128, up row i's
// ceil(I/128) after) and [E, ceil(H/128), ceil(I/128)] Macros read in the core's
// w13_rows / w2_rows, after MMA_SCALE_GEOMETRY declared the blocks along H and I: the expressions the core computed
// before they moved here, in the same order, so the machine code stays the same.
typedef float mma_scale_t;
#define MMA_SCALE_GEOMETRY(hidden, inter)                                                                          \
    const int hblocks = ((hidden) + FP8_BLOCK - 1) / FP8_BLOCK, iblocks = ((inter) + FP8_BLOCK - 1) / FP8_BLOCK
#define mma_w13_scale_row(s, e, i, up)                                                                             \
    scale_row(s, (long long)(e) * 2 * iblocks + ((up) ? iblocks : 0) + (i) / FP8_BLOCK, hblocks)
#define mma_w2_scale_row(s, e, h) scale_row(s, (long long)(e) * hblocks + (h) / FP8_BLOCK, iblocks)
"""

NO_SCALES = r"""
// no scales: no scale rows (the kernels' scale pointers pass through unread), the mma accumulate into acc directly
typedef float mma_scale_t;
#define MMA_SCALE_GEOMETRY(hidden, inter) (void)0
#define mma_w13_scale_row(s, e, i, up) (s)
#define mma_w2_scale_row(s, e, h) (s)
#define ROUND_SCALES(UNROLL, RT) (void)part
#define LOAD_ROUND_SCALES(j, first) (void)0
#define APPLY_ROUND_SCALES(j) (void)0
template <int N>
__device__ __forceinline__ auto mma_sums(float (&acc)[N][4], float (&part)[N][4]) -> float (&)[N][4] {
    (void)part;
    return acc;
}
"""

BLOCK_SCALES = r"""
// fp8-block128's scales: the mma accumulate a partial per 128-wide scale block (its k blocks summed in the tensor
// core), which is multiplied by 2^112 and the block's scale into acc when the scale block -- or the warp's k range --
// ends (s_lo for rows g: acc[0], acc[1]; s_hi for rows g + 8). A function of k alone: never of T or the batch.
__device__ __forceinline__ void fp8_flush(float (&acc)[4], float (&part)[4], float s_lo, float s_hi) {
    acc[0] = fmaf(part[0] * FP8_UNSCALE, s_lo, acc[0]);
    acc[1] = fmaf(part[1] * FP8_UNSCALE, s_lo, acc[1]);
    acc[2] = fmaf(part[2] * FP8_UNSCALE, s_hi, acc[2]);
    acc[3] = fmaf(part[3] * FP8_UNSCALE, s_hi, acc[3]);
    part[0] = part[1] = part[2] = part[3] = 0.0f;
}
// (ROUND, not UNROLL: a kernel text after the loader may define UNROLL as a macro, as the decode GEMV's knob)
template <int ROUND, int RT, int N>
__device__ __forceinline__ void apply_block_scales(const float (&s_lo)[ROUND][RT], const float (&s_hi)[ROUND][RT],
                                                   const bool (&flush)[ROUND], int j, float (&acc)[N][4],
                                                   float (&part)[N][4]) {
    constexpr int NB = N / RT;
    if (flush[j]) {                                                  // warp-uniform
        #pragma unroll
        for (int t = 0; t < RT; ++t)
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) fp8_flush(acc[t * NB + nb], part[t * NB + nb], s_lo[j][t], s_hi[j][t]);
    }
}
// The round's scales live in mma_round's registers (ROUND_SCALES); k block j (chunks first .. first + MMA_KB - 1)
// flushes where its scale block or the range ends and loads the rows' scales then (a down's rows -- COLS_DEP: 16 per
// tile from a multiple of 16 -- lie in one 128-row block: one row). A macro, read in mma_round's scope (CHECKED,
// COLS_DEP, RT, c_end, tiles), so that the compiler sees the loads where the round issues them: as a function the
// same loads compiled to other (equivalent) machine code.
#define ROUND_SCALES(UNROLL, RT) float s_lo[UNROLL][RT], s_hi[UNROLL][RT]; bool flush[UNROLL]
#define LOAD_ROUND_SCALES(j, first)                                                                               \
    do {                                                                                                          \
        const int next = (first) + 4 * MMA_HALVES;                                                                \
        flush[j] = next % (FP8_BLOCK / 8) == 0 || next >= c_end;                                                  \
        const int block = flush[j] && (!CHECKED || (first) < c_end) ? (first) / (FP8_BLOCK / 8) : 0;              \
        _Pragma("unroll")                                                                                         \
        for (int t = 0; t < RT; ++t) {                                                                            \
            s_lo[j][t] = COLS_DEP && t > 0 ? s_lo[j][0] : flush[j] ? __ldg(tiles[t].scale_lo + block) : 0.0f;     \
            s_hi[j][t] = COLS_DEP ? s_lo[j][t] : flush[j] ? __ldg(tiles[t].scale_hi + block) : 0.0f;              \
        }                                                                                                         \
    } while (0)
#define APPLY_ROUND_SCALES(j) apply_block_scales(s_lo, s_hi, flush, j, acc, part)
template <int N>
__device__ __forceinline__ auto mma_sums(float (&acc)[N][4], float (&part)[N][4]) -> float (&)[N][4] {
    (void)acc;
    return part;
}
"""


BF16_LOADER = register_loader(Loader(BF16_FORMAT.name, BF16_FMA,
                                     BF16_VALUES + ROW_ADDRESSING + NO_SCALES))
BF16_T16_LOADER = register_loader(Loader(BF16_T16.name, None,
                                         BF16_VALUES + TILE_ADDRESSING + NO_SCALES))
FP8_LOADER = register_loader(Loader(FP8_BLOCK128.name, FP8_FMA,
                                    FP8_VALUES + ROW_ADDRESSING + BLOCK128_SCALE_ROWS + BLOCK_SCALES))
FP8_T16_LOADER = register_loader(Loader(FP8_BLOCK128_T16.name, None,
                                        FP8_VALUES + TILE_ADDRESSING + BLOCK128_SCALE_ROWS + BLOCK_SCALES,
                                        needs={"FP8_LOAD16": 1}))
