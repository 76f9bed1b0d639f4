"""The decode GEMV on tensor cores (mma.sync m16n8k16), for T >= 9: :func:`kernels.decode.gemv.gemv_launch` picks it
by its ``MMA`` knob (0 auto: T >= 9; 1 always; -1 never), with the same arguments, modes and workspace.

Why: the FMA kernel (:mod:`kernels.decode.gemv`) does T FP32 FMAs per weight element and re-reads the weights once
per 8-token group; at T = 16..64 it is compute-bound (qwen3-30b QKV at T = 64: ~20 us against 4.7 us for its 21 MB
at the memory roofline). Here the products run on the tensor cores and the weights leave HBM once for all T tokens.

Ownership: a block of WARPS warps is TILES = WARPS / KSPLIT row tiles of 16 output rows x KSPLIT k ranges; warp w
takes tile w / KSPLIT and k range w % KSPLIT, and holds all T tokens: NT = ceil(T / 8) n-tiles of 8 tokens, 4 FP32
accumulators each per lane (32 at T = 64). A is 16 weight rows x 16 k (the lab's k permutation: in each k block,
lane (g, q) loads 16 contiguous bytes of rows g and g + 8 with one 16-byte load each, as kernels/batched/mma_core.py:
bf16, values 8q .. 8q + 7 of a 32-wide k block; fp8, values 16q .. 16q + 15 of a 64-wide one, two mma k steps), B
is 16 k x 8 tokens from shared memory.

Weight formats: the format is the batched families' tensor-core loader (:func:`kernels.batched.loaders.loader_for`)
compiled in front of the one kernel text (:func:`make_family`: ``GEMV_MMA`` bf16, ``GEMV_MMA_FP8`` fp8-block128):
the A load type and widening (``a_fragment``), ``MMA_HALVES``, ``a_index`` and the scale macros. fp8-block128: 16
e4m3 values per load (``FP8_LOAD16``), widened exactly to bf16 as value x 2^-112 (``FP8_PRMT`` 1: the byte permute
and one bf16x2 multiply by 2^8 on A -- the warp's 16 rows are fewer than its tokens, so the multiply sits on A and B
is read as staged); the mma sum each 128-wide scale block's products into an FP32 partial, which the loader's flush
multiplies by 2^112 and the block's scale into the accumulators (``fmaf``) where the scale block -- or the warp's k
blocks of the slice -- ends (with UNROLL odd a scale block's two 64-wide halves may be two warps'). Rows g and g + 8
lie in one 128-row block: one scale row per warp.

x in shared memory, by k slices: the block sweeps K in slices of KSPLIT x UNROLL k blocks; per slice every thread
helps stage the block's [8 NT tokens][slice] bf16 rows (x, + add, normalized: the FMA kernel's prologue chunks,
:data:`kernels.decode.device.GEMV_SHARED`), then warp (tile, r) multiplies its UNROLL k blocks of the slice
(sub-slice r) by its 16 rows. The slice's weight loads (and scales) are issued before the staging, so they fly while
it runs. A staged slice serves all the block's 16 TILES rows: x crosses L2 -> shared T / (16 TILES) times per weight
value (LM head, TILES 8: 0.5 at T = 64), and the shared reads per weight value are T / 16 (the B fragments). Row
stride of the staged rows: the 8 lanes of an LDS.128 phase (two tokens x four q) hit distinct banks -- 64 mod 128
bytes where a lane's chunks are adjacent (bf16), 16 mod 32 where they are two apart (fp8). Whole K at once would need
512 KB at T = 64, K = 4096; slices need ``slice_bytes`` (<= 96 KB, the rules' UNROLL).

Numerics: bf16 x bf16 products, FP32 sums in the tensor core's order: per k range r, a chain of mma over its k
blocks (each mma adds its 16 products to the accumulator in the hardware's order), then y = ((p_0 + p_1) + p_2) ...
over the KSPLIT ranges in order (FP32 adds, in shared memory). Not the order contract's lane chain: the FMA path's
bitwise promise does not hold here; y is within K 2^-23 sum |x w| of :func:`kernels.numerics.dot_chain` (tested),
and for fixed knobs and T it is bitwise repeatable (no atomics on values). fp8-block128: each product e x 2^-112 is
exact in FP32, the chains run per scale block, and the flush rounds once: y is within (2^-24 + 128 x 2^-23 +
(ceil(K / 64) + KSPLIT) 2^-24) sum |x d| + K 2^-37 max(s) of fp64 over the dequantized weights d
(tests/test_decode_gemv_mma_fp8.py derives it). The prologue (residual sum, RMSNorm) is the FMA kernel's, bit for
bit; the epilogues are its (bf16 store, residual add, argmax + logits).

Knobs: WARPS, KSPLIT (0 auto: the fewest k ranges that give >= ``SM_TARGET`` blocks), UNROLL (0 auto: 4 up to
T = 32, else 2; less where the staged slice would pass ``SLICE_LIMIT``: fp8's k blocks are twice as wide), PDL,
ARGMAX_BLOCKS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.batched.loaders import loader_for
from kernels.compile import CudaSource
from kernels.contract import Dims
from kernels.decode.device import GEMV_SHARED, NORM_HELPERS
from kernels.device_helpers import FP8_HELPERS, MMA_HELPERS, PDL_HELPERS, WARP_HELPERS
from kernels.family import KernelFamily
from kernels.formats import BF16_FORMAT, FP8_BLOCK128, WeightFormat, get_format

KERNEL = "decode_gemv_mma"
MIN_TOKENS = 9  # MMA auto: tensor cores from this T on
SM_TARGET = 132  # the H200's SMs: KSPLIT auto splits k until the grid has this many blocks (or KSPLIT = WARPS)
SHARED_LIMIT = 227 * 1024  # the H200's dynamic shared memory per block
SLICE_LIMIT = 96 * 1024  # UNROLL auto keeps the staged slice under this (two blocks of 8 warps per SM)
AUTO_UNROLL = 4
KNOBS: dict[str, int] = {
    "WARPS": 8,  # warps per block: WARPS / KSPLIT row tiles x KSPLIT k ranges
    "KSPLIT": 0,  # k ranges per row tile (0 = auto); a power of two dividing WARPS
    "UNROLL": 0,  # k blocks (32-wide; fp8 64) per warp and slice, their A loads in flight together (0 = auto)
    "PDL": 0,  # programmatic dependent launch
    "ARGMAX_BLOCKS": 528,  # the argmax mode's grid cap
}
LIMITS = {"WARPS": (1, 16), "KSPLIT": (0, 16), "UNROLL": (0, 8), "PDL": (0, 1), "ARGMAX_BLOCKS": (1, 1024)}
# the modes: compile-time macros gemv_launch sets (NT: 8-token n-tiles, ceil(T / 8))
MODES: dict[str, int] = {"NT": 8, "NORM": 0, "ADD": 0, "EPILOGUE": 0}
# the derived macros: the modes and the loader's (make_rules sets them from the format)
DERIVED: dict[str, int] = {**MODES, "FP8_LOAD16": 0, "FP8_PRMT": 0}


def slice_chunks(params: Mapping[str, int]) -> int:
    """16-byte chunks of a staged token row (one slice: KSPLIT x UNROLL k blocks of 4 chunks, 8 with FP8_LOAD16),
    padded as the kernel's SROW: the row stride 64 mod 128 bytes (a lane's B chunks adjacent), or 16 mod 32 (two
    apart, FP8_LOAD16)."""
    halves = 2 if params.get("FP8_LOAD16") else 1
    chunks = 4 * halves * params["KSPLIT"] * params["UNROLL"]
    if halves == 1:
        return chunks + (4 if chunks % 8 == 0 else 0)
    return chunks + (1 if chunks % 2 == 0 else 0)


def shared_bytes(params: Mapping[str, int], nt: int) -> int:
    """Dynamic shared memory: the staged slice [8 NT][slice_chunks] (reused for the k ranges' partial sums)."""
    stage = 8 * nt * slice_chunks(params) * 16
    tiles = params["WARPS"] // params["KSPLIT"]
    partial = tiles * (params["KSPLIT"] - 1) * nt * 4 * 32 * 4
    return max(stage, partial)


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """KSPLIT auto: the smallest power of two (<= WARPS) whose grid of ceil(N / (16 WARPS / KSPLIT)) blocks reaches
    SM_TARGET (without dims: 1); UNROLL auto: 4, halved while the T = 64 slice passes SLICE_LIMIT. ValueError naming
    the knob for what cannot run."""
    warps = values["WARPS"]
    if values["KSPLIT"] == 0:
        split = 1
        if dims is not None:
            tiles = -(-dims.intermediate // 16)
            while split < warps and -(-tiles // (warps // split)) < SM_TARGET:
                split *= 2
        values["KSPLIT"] = min(split, warps)
    if warps % values["KSPLIT"]:
        raise ValueError(f"KSPLIT {values['KSPLIT']} must divide WARPS {warps}")
    if values["UNROLL"] == 0:
        nt = -(-dims.tokens // 8) if dims is not None else 8
        values["UNROLL"] = AUTO_UNROLL if nt <= 4 else AUTO_UNROLL // 2
        while values["UNROLL"] > 1 and shared_bytes(values, nt) > SLICE_LIMIT:
            values["UNROLL"] //= 2
    return values


CODE = r"""
// ==== the decode GEMV on tensor cores (kernels/decode/gemv_mma.py) ====
// Knobs: WARPS, KSPLIT (k ranges per 16-row tile), UNROLL (k blocks per warp and slice), PDL. Modes: NT (8-token
// n-tiles), NORM / ADD (the prologue), EPILOGUE (0 store, 1 residual, 2 argmax, 3 argmax and logits). The weight
// format is the loader in front of this text (kernels/batched/loaders.py: a_load_t, MMA_HALVES, a_fragment,
// b_fragment, a_index and the scale macros ROUND_SCALES / LOAD_ROUND_SCALES / APPLY_ROUND_SCALES / mma_sums).
static_assert(WARPS >= 1 && WARPS <= 16 && KSPLIT >= 1 && WARPS % KSPLIT == 0, "KSPLIT must divide WARPS");
static_assert(NT >= 1 && NT <= 8 && UNROLL >= 1, "NT in [1, 8], UNROLL >= 1");
#define MMA_KB (4 * MMA_HALVES)                                // chunks of 8 values per k block: 32- or 64-wide
#define TILES (WARPS / KSPLIT)                                 // 16-row tiles per block
#define SLICE_CHUNKS (MMA_KB * KSPLIT * UNROLL)                // x chunks of a slice's token row
// its stride in shared memory, so that the 8 lanes of an LDS.128 phase (g, g + 1 x q = 0..3, chunks MMA_HALVES q + h)
// hit distinct banks: 64 mod 128 bytes where a lane's chunks are adjacent, 16 mod 32 where they are two apart
#define SROW (SLICE_CHUNKS + (MMA_HALVES == 1 ? (SLICE_CHUNKS % 8 == 0 ? 4 : 0) : (SLICE_CHUNKS % 2 == 0 ? 1 : 0)))
#define ARGMAX (EPILOGUE >= 2)
#ifndef GEMV_MMA_SMEM
#define GEMV_MMA_SMEM extern __shared__ uint4 mma_smem[]
#endif
// a warp's rows' scales along k (the loader's scale macros read tiles[t].scale_lo / scale_hi): rows g and g + 8 of a
// 16-row tile from a multiple of 16 lie in one 128-row scale block, so both point at its scale row
struct ScaleRows { const float* scale_lo; const float* scale_hi; };

// ------------------------------------------------------------------------------------------------
// decode_gemv_mma: grid (blocks), block WARPS * 32; row group g = blockIdx.x, + gridDim.x, ... (one per block but
//   in the argmax mode) of 16 TILES rows. [NORM: warp w the rs of tokens w, w + WARPS, ..., once.] Per slice s: the
//   warp's A loads (and a scaled format's scales); every thread stages chunks of the block's 8 NT token rows (zeros
//   past T and past K; block 0 writes the summed residual during group 0); per k block and n-tile one B fragment
//   from shared memory and two mma (a scaled format: into the block partial, flushed into acc where its 128-wide
//   scale block or the warp's k blocks of the slice end). KSPLIT > 1: ranges 1.. leave their sums in shared memory,
//   range 0 adds them in order and runs the epilogue: lane (g, q) holds rows g, g + 8 of tokens 8 nb + 2q, + 1.
// ------------------------------------------------------------------------------------------------
// (WARPS * 32, 1), not (WARPS * 32): NVRTC 12 gave the one-argument form 80 registers and 12 bytes of spills at
// T = 32 with NORM, the two-argument form 136 registers and none
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) decode_gemv_mma(
    const bf16_t* x, const bf16_t* add, const bf16_t* norm, const weight_t* __restrict__ w,
    const float* __restrict__ scales, bf16_t* out, const bf16_t* residual_in, bf16_t* residual_out, float* logits,
    float* best_values, int* best_rows, unsigned* ticket, int* argmax, int tokens, int n, int k, float eps)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int tile = warp / KSPLIT, split = warp % KSPLIT;
    const int xchunks = k / 8, kblocks = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const int slices = (xchunks + SLICE_CHUNKS - 1) / SLICE_CHUNKS;
    const int groups = (n + 16 * TILES - 1) / (16 * TILES);
    GEMV_MMA_SMEM;                                            // [8 NT][SROW] uint4: the slice; then the partials
    __shared__ float token_rs[GEMV_MAX_TOKENS];
#if ARGMAX
    ARGMAX_SHARED;                                            // (kernels/decode/device.py)
#endif

    // the loader's scope: its scale macros read RT (row tiles: 1), CHECKED (k blocks may pass K), COLS_DEP (0:
    // each row's own scale load), tiles and c_end (the end of the warp's k blocks in the slice, where it flushes)
    constexpr int RT = 1;
    constexpr bool CHECKED = true, COLS_DEP = false;
    ScaleRows tiles[RT];
    int c_end = 0;
    (void)CHECKED; (void)COLS_DEP; (void)tiles; (void)c_end; (void)scales; (void)kblocks;
    a_load_t lo[UNROLL][RT], hi[UNROLL][RT];
    float acc[NT][4], part[NT][4];                            // part: a scaled format's scale-block sums
    ROUND_SCALES(UNROLL, RT);                                 // the loader's: the slice's scales, if any
    float (&sums)[NT][4] = mma_sums(acc, part);               // where the mma accumulate (acc, or part)
    const a_load_t* row_lo = nullptr;
    const a_load_t* row_hi = nullptr;
    auto rows_of = [&](int group) {                           // rows past N read row N - 1 (never stored)
        const int r = group * 16 * TILES + tile * 16 + g;
        row_lo = reinterpret_cast<const a_load_t*>(w + (size_t)min(r, n - 1) * k);
        row_hi = reinterpret_cast<const a_load_t*>(w + (size_t)min(r + 8, n - 1) * k);
        tiles[0].scale_lo = tiles[0].scale_hi = scales + (size_t)(min(r, n - 1) / FP8_BLOCK) * kblocks;
    };
    // the warp's A loads of slice s: k blocks s * KSPLIT * UNROLL + split * UNROLL + u, rows g (lo) and g + 8 (hi),
    // and their scales
    auto load_slice = [&](int s) {
        const int first = s * SLICE_CHUNKS + split * UNROLL * MMA_KB;
        c_end = min(first + UNROLL * MMA_KB, xchunks);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = first + u * MMA_KB + MMA_HALVES * q;
            lo[u][0] = ldg_chunk(row_lo, a_index(c / MMA_HALVES), c < xchunks);
            hi[u][0] = ldg_chunk(row_hi, a_index(c / MMA_HALVES), c < xchunks);
            LOAD_ROUND_SCALES(u, first + u * MMA_KB);
        }
    };
    rows_of(blockIdx.x);
    load_slice(0);                                            // before the wait: the weights are no kernel's output
    pdl_wait();                                               // x, add, norm, residual_in: behind it
    pdl_release();
#if NORM
    token_rs_pass(token_rs, x, add, 0, tokens, tokens, k, eps, warp, lane);
#endif
    bool loaded = true;

    for (int group = blockIdx.x; group < groups; group += gridDim.x) {
        #pragma unroll
        for (int nb = 0; nb < NT; ++nb) {
            acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
            part[nb][0] = part[nb][1] = part[nb][2] = part[nb][3] = 0.0f;
        }
        if (!loaded) rows_of(group);
        for (int s = 0; s < slices; ++s) {
            if (!loaded) load_slice(s);
            loaded = false;
            __syncthreads();                                  // the last slice's readers (and the rs) are done
            for (int i = threadIdx.x; i < 8 * NT * SLICE_CHUNKS; i += WARPS * 32) {
                const int j = i / SLICE_CHUNKS, cc = i - j * SLICE_CHUNKS, c = s * SLICE_CHUNKS + cc;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (j < tokens && c < xchunks)
                    v = prologue_chunk(x, add, norm, residual_out, token_rs[j], j, c, k, group == 0);
                mma_smem[j * SROW + cc] = v;
            }
            __syncthreads();
            sums[0][0] += __uint_as_float(all_loads_arrived(lo) | all_loads_arrived(hi));  // += 0.0f, before any mma
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int cl = (split * UNROLL + u) * MMA_KB + MMA_HALVES * q;   // the lane's chunk in the slice
                #pragma unroll
                for (int h = 0; h < MMA_HALVES; ++h) {
                    const uint4 a_lo = a_fragment(lo[u][0], h), a_hi = a_fragment(hi[u][0], h);
                    #pragma unroll
                    for (int nb = 0; nb < NT; ++nb)
                        mma_k32(sums[nb], a_lo, a_hi, b_fragment(mma_smem[(nb * 8 + g) * SROW + cl + h]));
                }
                APPLY_ROUND_SCALES(u);                        // a scaled format: the block partial into acc
            }
        }
#if KSPLIT > 1
        __syncthreads();                                      // the last slice's readers are done: the partials
        float* part = reinterpret_cast<float*>(mma_smem);     // [TILES][KSPLIT - 1][NT][4][32]
        if (split > 0) {
            #pragma unroll
            for (int nb = 0; nb < NT; ++nb)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    part[(((tile * (KSPLIT - 1) + split - 1) * NT + nb) * 4 + e) * 32 + lane] = acc[nb][e];
        }
        __syncthreads();
        if (split == 0) {
            for (int r = 1; r < KSPLIT; ++r)                  // ranges in order
                #pragma unroll
                for (int nb = 0; nb < NT; ++nb)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[nb][e] += part[(((tile * (KSPLIT - 1) + r - 1) * NT + nb) * 4 + e) * 32 + lane];
        }
#endif
        if (split != 0) continue;
        const int row0 = group * 16 * TILES + tile * 16 + g;
        #pragma unroll
        for (int nb = 0; nb < NT; ++nb) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {                      // token 8 nb + 2q + e: rows row0 (acc e), row0 + 8
                const int t = nb * 8 + 2 * q + e;
#if ARGMAX
                float best = __int_as_float(0xff800000);
                int best_row = 0x7fffffff;
#endif
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = row0 + 8 * half;
                    const float y = acc[nb][2 * half + e];
                    if (row >= n || t >= tokens) continue;
                    const size_t idx = (size_t)t * n + row;
#if EPILOGUE == 0
                    out[idx] = f32_to_bf16(y);
#elif EPILOGUE == 1
                    out[idx] = f32_to_bf16(__fadd_rn(__uint_as_float((u32)residual_in[idx] << 16), y));
#else
#if EPILOGUE == 3
                    logits[idx] = y;
#endif
                    if (beats(y, row, best, best_row)) { best = y; best_row = row; }
#endif
                }
#if ARGMAX
                #pragma unroll
                for (int offset = 4; offset < 32; offset <<= 1) {   // over g: the lanes of the same token
                    const float other = __shfl_xor_sync(FULL_MASK, best, offset);
                    const int other_row = __shfl_xor_sync(FULL_MASK, best_row, offset);
                    if (beats(other, other_row, best, best_row)) { best = other; best_row = other_row; }
                }
                if (g == 0 && t < tokens && beats(best, best_row, warp_best[warp][t], warp_best_row[warp][t])) {
                    warp_best[warp][t] = best;
                    warp_best_row[warp][t] = best_row;
                }
#endif
            }
        }
    }
#if ARGMAX
    argmax_tail(warp_best, warp_best_row, last_block, best_values, best_rows, ticket, argmax, tokens, n, warp, lane);
#endif
}
"""



def make_rules(fmt: WeightFormat) -> Any:
    """The rules (:func:`rules`) with the format's loader macros set first: fp8-block128 reads 16 e4m3 values per
    16-byte load (``FP8_LOAD16`` 1: 64-wide k blocks; the GEMV takes K in multiples of 16) and widens them with the
    byte permute and its x 2^8 on A (``FP8_PRMT`` 1: a warp's 16 rows are fewer than its up to 64 tokens, so the
    multiply belongs on A, and B -- shared memory -- is read as staged)."""

    def format_rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
        values["FP8_LOAD16"] = int(fmt.scaled)
        values["FP8_PRMT"] = 1 if fmt.scaled else 0
        return rules(dims, values)

    return format_rules


def make_family(fmt: WeightFormat) -> KernelFamily:
    """The kernel on ``fmt`` weights: the helpers, the format's tensor-core loader (the batched families' own,
    :func:`kernels.batched.loaders.loader_for`) and the kernel text, one compile per format."""
    suffix = "" if fmt.name == BF16_FORMAT.name else f"[{fmt.name}]"
    values = {} if not fmt.scaled else {"FP8_LOAD16": 1, "FP8_PRMT": 1}
    source = CudaSource(
        name=f"{KERNEL}{suffix}",
        code=(WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + NORM_HELPERS + GEMV_SHARED + MMA_HELPERS
              + loader_for(fmt, "mma") + CODE),
        kernels=(KERNEL,), defaults={**KNOBS, "KSPLIT": 1, "UNROLL": AUTO_UNROLL, **DERIVED, **values},
        variants=[{"NT": 2}, {"NT": 4, "KSPLIT": 4, "NORM": 1, "ADD": 1}, {"KSPLIT": 8, "UNROLL": 2, "EPILOGUE": 1},
                  {"NORM": 1, "EPILOGUE": 3}, {"NT": 3, "KSPLIT": 2, "PDL": 1, "NORM": 1, "EPILOGUE": 2},
                  *([{"NT": 8, "KSPLIT": 8, "UNROLL": 1, "EPILOGUE": 1}] if fmt.scaled else [])],
        warps_knobs={KERNEL: "WARPS"},
        description=f"the decode step's dense GEMV on tensor cores (T >= 9): 16 rows x all T tokens per warp, x "
                    f"staged in k slices in shared memory, the FMA GEMV's prologues and epilogues, {fmt.name} weights")
    return KernelFamily(name=f"decode-gemv-mma{suffix}", source=source, limits=LIMITS,
                        auto_knobs=("KSPLIT", "UNROLL"), rules=make_rules(fmt), derived=tuple(DERIVED))


FAMILIES = {name: make_family(get_format(name)) for name in (BF16_FORMAT.name, FP8_BLOCK128.name)}
GEMV_MMA = FAMILIES[BF16_FORMAT.name]
GEMV_MMA_FP8 = FAMILIES[FP8_BLOCK128.name]
SOURCE = GEMV_MMA.source
FP8_SOURCE = GEMV_MMA_FP8.source


def row_groups(n: int, params: Mapping[str, int]) -> int:
    """Row groups of 16 WARPS / KSPLIT rows (one block each unless the argmax mode caps the grid)."""
    return -(-n // (16 * (params["WARPS"] // params["KSPLIT"])))


def resolve_call(call: Any, knobs: Mapping[str, int]) -> dict[str, int]:
    """The knobs resolved for a checked call (:class:`kernels.decode.gemv.GemvCall`) plus the mode macros."""
    family = GEMV_MMA_FP8 if call.modes["FP8"] else GEMV_MMA
    params = family.resolve(Dims(call.tokens, call.k, call.n, 1, 1), **knobs)
    shared = shared_bytes(params, -(-call.tokens // 8))
    if shared > SHARED_LIMIT:
        raise ValueError(f"KSPLIT {params['KSPLIT']} x UNROLL {params['UNROLL']} slices need {shared} bytes of shared "
                         f"memory at T = {call.tokens} (at most {SHARED_LIMIT}): lower UNROLL or KSPLIT")
    return {**params, "NT": -(-call.tokens // 8), "NORM": call.modes["NORM"], "ADD": call.modes["ADD"],
            "EPILOGUE": call.modes["EPILOGUE"]}
