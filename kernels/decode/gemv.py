"""Dense GEMV of a decode step (QKV, O, LM head): y[t, n] = x[t] . W[n] for the step's T tokens, warp decode style.

One warp owns ROWS output rows (a block WARPS * ROWS consecutive rows, the grid one block per row group; the LM
head's argmax mode caps the grid at ARGMAX_BLOCKS blocks that stride over the groups). Each lane streams its 16-byte
chunks c = lane, lane + 32, ... of the warp's weight rows, UNROLL chunks per row in flight (``all_loads_arrived``),
and reads x from L1/L2 (or from the block's shared copy of the normalized rows), so the weights leave HBM once for
all the tokens of a pass; the FP32 accumulators [ROWS][TOKENS] live in registers, and the warp butterfly ends each
dot product. That is the order contract's lane chain (``kernels.numerics.dot_chain``) for bf16 weights, so the
bf16 outputs are bitwise NumPy's. TOKENS tokens per pass (auto: min(T, 8)); larger T loops over token groups, each
pass streaming the weights again (from L2 where they fit).

Modes are compile-time macros chosen by :func:`dense_gemv` from its arguments (never runtime branches in the loop):

* prologue: none; ``add`` (x := bf16(x + add), block 0 writes the sum to ``residual_out``); ``norm`` (RMSNorm of x,
  item 2 of the contract); both. With either, each block first builds the pass's normalized rows in shared memory
  (warp w the rs of tokens w, w + WARPS, ...: the same lane chain whichever warp), then reads x from there.
* weights: bf16 [N, K], or fp8-block128 (:func:`quantize_matrix`: e4m3fn values [N, K] and one float32 scale per
  128 x 128 block). FP8 order (not NumPy-bitwise; checked against fp64): lane l takes 16-value chunks l, l + 32,
  ... in order, each value dequantized as ``__fmul_rn(e4m3, scale)`` (the float32 that
  :func:`kernels.formats.dequantize_blocks` gives) and ``acc = fmaf(w, x, acc)`` in value order, then the butterfly.
* epilogue: out = bf16(y); out = bf16(residual_in + y) (``out`` may alias ``residual_in``); or the argmax over n of
  y in FP32 (greater value, equal value -> lower n; NaN never wins, a row of NaNs gives -1), optionally writing y
  to ``logits`` [T, N] float32: each block leaves its best (value, row) per token in the workspace, takes a ticket,
  and the block with the last ticket reduces the candidates (warp w: tokens w, w + WARPS, ...) and resets the ticket.

Tensor cores: at T >= 9 (bf16 or fp8-block128 weights) :func:`gemv_launch` runs :mod:`kernels.decode.gemv_mma`
instead (the knob ``MMA``, :func:`select_path`): the same arguments, modes and epilogues, sums in the tensor core's
order (within a tolerance of the lane chain, or for fp8 of fp64, not bitwise). T <= 8 and ``MMA=-1`` keep this
kernel.

PDL (knob PDL=1, launched with ``programmatic=True``): the first round of weight loads is issued before
``griddepcontrol.wait``; x, add, norm and residual_in are read after it (``ld_dep`` or plain loads, never ``__ldg``),
and every thread executes the wait before it can exit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.arrays import BF16, check_aligned
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.decode.device import GEMV_SHARED, NORM_HELPERS
from kernels.device_helpers import FP8_HELPERS, PDL_HELPERS, WARP_HELPERS
from kernels.family import KernelFamily
from kernels.formats import BLOCK, Quantized, quantize_blocks

KERNEL = "decode_gemv"
MAX_TOKENS = 64
MAX_ARGMAX_BLOCKS = 1024  # the workspace's candidates per token
SHARED_LIMIT = 227 * 1024  # the H200's dynamic shared memory per block (opt-in above 48 KB)
AUTO_TOKENS = 8  # tokens per pass the rules pick at most
KNOBS: dict[str, int] = {
    "WARPS": 4,  # warps per block
    "ROWS": 1,  # output rows per warp (they share the x loads)
    "UNROLL": 8,  # 16-byte weight chunks per row in flight per lane (K = 2048 bf16: one round)
    "TOKENS": 0,  # tokens per pass (0 = auto: min(T, 8)); T beyond it loops over token groups
    "PDL": 0,  # programmatic dependent launch
    "ARGMAX_BLOCKS": 528,  # the argmax mode's grid cap (4 blocks per H200 SM): candidates per token
    "MAX_REGS": 0,  # __maxnreg__ cap (0: __launch_bounds__ only; fp8 + a prologue at TOKENS > 4 then gets 168)
}
LIMITS = {"WARPS": (1, 32), "ROWS": (1, 8), "UNROLL": (1, 16), "TOKENS": (0, 16), "PDL": (0, 1),
          "ARGMAX_BLOCKS": (1, MAX_ARGMAX_BLOCKS), "MAX_REGS": (0, 255)}
FP8_STAGED_REGS = 168  # ptxas left alone spilled 24 bytes at 96 registers (fp8, add + norm, TOKENS 8); 168 none
# the modes: compile-time macros the entry point sets from its arguments (not knobs)
MODES: dict[str, int] = {"FP8": 0, "NORM": 0, "ADD": 0, "EPILOGUE": 0}
EPILOGUES = {"store": 0, "residual": 1, "argmax": 2, "argmax+logits": 3}


def registers_needed(values: Mapping[str, int], fp8: bool = True) -> int:
    """A ptxas estimate: 4 registers a weight chunk in flight (+1 scale for fp8), one per accumulator, ~40 more."""
    chunks = values["ROWS"] * values["UNROLL"]
    tokens = values["TOKENS"] or AUTO_TOKENS
    return chunks * (5 if fp8 else 4) + values["ROWS"] * tokens + 40


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """TOKENS auto = min(T, 8) (8 without dims); ValueError naming the knob for what cannot run: registers past
    what WARPS leaves per thread."""
    if values["TOKENS"] == 0:
        values["TOKENS"] = min(dims.tokens, AUTO_TOKENS) if dims is not None else AUTO_TOKENS
    registers = min(255, 65536 // (32 * values["WARPS"]))
    if values["MAX_REGS"]:
        registers = min(registers, values["MAX_REGS"])
    need = registers_needed(values)
    if need > registers:
        raise ValueError(f"ROWS {values['ROWS']} x UNROLL {values['UNROLL']} with TOKENS {values['TOKENS']} needs "
                         f"~{need} registers; WARPS {values['WARPS']} leaves {registers}: lower UNROLL, ROWS, TOKENS "
                         f"or WARPS")
    if dims is not None:
        check_gemv_dims(dims.tokens, dims.hidden, dims.intermediate, False)
    return values


MMA_MIN_TOKENS = 9  # MMA auto: the tensor-core kernel from this T on
FMA_ONLY_KNOBS = ("ROWS", "TOKENS", "MAX_REGS")


def select_path(call: GemvCall, mma: Any, knobs: Mapping[str, Any]) -> str:
    """Which kernel :func:`gemv_launch` runs, by its ``MMA`` argument: 0 (auto) tensor cores
    (:mod:`kernels.decode.gemv_mma`, "mma", bf16 or fp8-block128 weights) at T >= 9 unless a knob only the FMA kernel
    has (ROWS, TOKENS, MAX_REGS) is set, else the FMA kernel ("fma": T <= 8 always; bitwise the order contract for
    bf16); 1 tensor cores (ValueError for an FMA-only knob); -1 the FMA kernel. The other knobs go to the kernel
    chosen (the tensor-core one: WARPS, KSPLIT, UNROLL, PDL, ARGMAX_BLOCKS)."""
    if isinstance(mma, bool) or not isinstance(mma, int | np.integer) or int(mma) not in (-1, 0, 1):
        raise ValueError(f"MMA must be -1 (FMA), 0 (auto: tensor cores at T >= {MMA_MIN_TOKENS}) or 1, got {mma!r}")
    fma_only = sorted(set(knobs) & set(FMA_ONLY_KNOBS))
    if mma == 1:
        if fma_only:
            raise ValueError(f"MMA 1: {fma_only} are the FMA kernel's knobs (the tensor-core one has WARPS, KSPLIT, "
                             f"UNROLL, PDL, ARGMAX_BLOCKS)")
        return "mma"
    auto = mma == 0 and call.tokens >= MMA_MIN_TOKENS and not fma_only
    return "mma" if auto else "fma"


def check_gemv_dims(tokens: int, k: int, n: int, fp8: bool) -> None:
    """ValueError for dims the kernel refuses: T in [1, 64], K a positive multiple of 8 (16 for fp8), N >= 1."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"x must hold 1 to {MAX_TOKENS} tokens (T), got {tokens}")
    step = 16 if fp8 else 8
    if k < step or k % step:
        raise ValueError(f"x's K must be a positive multiple of {step} (16-byte loads"
                         f"{' of 16 e4m3 values' if fp8 else ''}), got {k}")
    if n < 1:
        raise ValueError(f"w must have at least one row (N), got {n}")


def rows_per_block(params: Mapping[str, int]) -> int:
    return params["WARPS"] * params["ROWS"]


def with_modes(params: Mapping[str, int], modes: Mapping[str, int], knobs: Mapping[str, int] = ()) -> dict[str, int]:
    """The resolved knobs plus the mode macros; MAX_REGS left at 0 (not set in ``knobs``) becomes FP8_STAGED_REGS
    where fp8 weights meet a prologue at TOKENS > 4 (the one default that spills under __launch_bounds__ alone)."""
    out = {**params, **modes}
    staged = modes.get("NORM") or modes.get("ADD")
    if "MAX_REGS" not in dict(knobs) and not out["MAX_REGS"] and modes.get("FP8") and staged and out["TOKENS"] > 4:
        out["MAX_REGS"] = FP8_STAGED_REGS
    return out


def row_groups(n: int, params: Mapping[str, int]) -> int:
    """Row groups of WARPS * ROWS rows (one block each unless the argmax mode caps the grid)."""
    return -(-n // rows_per_block(params))


def staged_bytes(k: int, params: Mapping[str, int]) -> int:
    """Dynamic shared memory of a prologue mode: the pass's TOKENS normalized rows, bf16."""
    return params["TOKENS"] * k * 2


CODE = r"""
// ==== the decode GEMV (kernels/decode/gemv.py) ====
// Knobs: WARPS warps per block, ROWS rows per warp, UNROLL 16-byte chunks per row in flight, TOKENS tokens per pass,
// PDL. Modes: FP8 (e4m3 weights + 128 x 128 block scales), NORM / ADD (the prologue), EPILOGUE (0 store, 1 residual,
// 2 argmax, 3 argmax and logits).
static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be in [1, 32]");
static_assert(ROWS >= 1 && UNROLL >= 1, "ROWS and UNROLL must be >= 1");
static_assert(TOKENS >= 1 && TOKENS <= 32, "TOKENS must be in [1, 32] (lane j stores token j)");
#if MAX_REGS > 0
#define GEMV_BOUNDS __maxnreg__(MAX_REGS)
#else
#define GEMV_BOUNDS __launch_bounds__(WARPS * 32)
#endif
#define STAGED (NORM || ADD)
#define ARGMAX (EPILOGUE >= 2)
#if FP8
#define W_VALUES 16                  // e4m3 values per 16-byte weight chunk
#else
#define W_VALUES 8                   // bf16 values per 16-byte weight chunk
#endif
#define XPER (W_VALUES / 8)          // 16-byte x chunks per weight chunk
#if STAGED && !defined(GEMV_DYNAMIC_SMEM)
#define GEMV_DYNAMIC_SMEM extern __shared__ uint4 gemv_smem[]
#endif

// acc = fmaf(w, x, acc) over one weight chunk's values in order (x: its XPER 16-byte chunks)
__device__ __forceinline__ float chunk_fma(float acc, const uint4& w, float scale, const uint4 (&x)[XPER]) {
#if FP8
    #pragma unroll
    for (int v = 0; v < 8; ++v) {            // values 2v, 2v + 1: bytes of word v / 2, bf16 pair v % 4 of x[v / 4]
        float lo, hi;
        e4m3x2_to_f32(word(w, v / 2) >> (16 * (v % 2)), lo, hi);
        const u32 xw = word(x[v / 4], v % 4);
        acc = fmaf(__fmul_rn(lo, scale), bf16_lo(xw), acc);
        acc = fmaf(__fmul_rn(hi, scale), bf16_hi(xw), acc);
    }
#else
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 a = word(w, j), b = word(x[0], j);
        acc = fmaf(bf16_lo(a), bf16_lo(b), acc);
        acc = fmaf(bf16_hi(a), bf16_hi(b), acc);
    }
#endif
    return acc;
}

// one round of the warp's weight chunks: row first_row + r, chunks c0 + u * 32 + lane (rows past N read row 0,
// chunks past the row's end zeros: branch-free, so every load of the round issues before the first FMA)
__device__ __forceinline__ void load_round(uint4 (&wv)[ROWS][UNROLL], float (&sc)[ROWS][UNROLL],
                                           const uint4* __restrict__ w, const float* __restrict__ scales,
                                           int first_row, int n, int wchunks, int c0, int lane) {
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = first_row + r < n ? first_row + r : 0;
        const uint4* w_row = w + (size_t)row * wchunks;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32 + lane;
            wv[r][u] = ldg_chunk(w_row, c, c < wchunks);
        }
    }
#if FP8
    const int kblocks = (wchunks + (FP8_BLOCK / 16) - 1) / (FP8_BLOCK / 16);
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = first_row + r < n ? first_row + r : 0;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32 + lane;
            sc[r][u] = __ldg(scales + (size_t)(row / FP8_BLOCK) * kblocks + (c < wchunks ? c / (FP8_BLOCK / 16) : 0));
        }
    }
#endif
}

// ------------------------------------------------------------------------------------------------
// decode_gemv: grid (blocks), block WARPS * 32. For each pass of TOKENS tokens t0 ..: [STAGED: warp w computes the
//   rs of the pass's tokens w, w + WARPS, ... (lane chain of the (summed) x row, butterfly); every thread builds
//   chunks of the normalized rows into shared memory; block 0 writes the sums to residual_out]; then for each row
//   group g = blockIdx.x, + gridDim.x, ...: warp w owns rows g * WARPS * ROWS + w * ROWS + r (r < ROWS); per round
//   lane l loads UNROLL chunks of each row, then per chunk and token one x chunk (global or shared) and ROWS FMA
//   chains into acc[r][j]; the butterfly; lane j stores token t0 + j of each row (or keeps the warp's best for the
//   argmax in shared memory). ARGMAX: block best per token to the workspace, a ticket, the last block reduces.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GEMV_BOUNDS decode_gemv(
    const bf16_t* x,                          // [T, K] (read after the PDL wait)
    const bf16_t* add,                        // [T, K] ADD: summed into x first
    const bf16_t* norm,                       // [K] NORM: the RMSNorm weight
    const uint4* __restrict__ w,              // [N, K] bf16, or [N, K] e4m3 (FP8), as 16-byte chunks
    const float* __restrict__ scales,         // FP8: [ceil(N/128), ceil(K/128)]
    bf16_t* out,                              // [T, N] EPILOGUE 0 / 1
    const bf16_t* residual_in,                // [T, N] EPILOGUE 1 (may be out)
    bf16_t* residual_out,                     // [T, K] ADD: bf16(x + add), written by block 0
    float* logits,                            // [T, N] EPILOGUE 3
    float* best_values,                       // [T, gridDim.x] ARGMAX workspace
    int* best_rows,                           // [T, gridDim.x] ARGMAX workspace
    unsigned* ticket,                         // [1] ARGMAX workspace: 0 before the launch, 0 after it
    int* argmax,                              // [T] ARGMAX
    int tokens, int n, int k, float eps)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wchunks = k / W_VALUES, xchunks = k / 8;
    const int groups = (n + WARPS * ROWS - 1) / (WARPS * ROWS);
#if ARGMAX
    ARGMAX_SHARED;                                            // (kernels/decode/device.py)
    __syncthreads();
#endif
#if STAGED
    GEMV_DYNAMIC_SMEM;                                        // [TOKENS][K / 8] uint4: the pass's normalized rows
    __shared__ float token_rs[TOKENS];
#endif

    uint4 wv[ROWS][UNROLL];
    float sc[ROWS][UNROLL];
    load_round(wv, sc, w, scales, (int)blockIdx.x * WARPS * ROWS + warp * ROWS, n, wchunks, 0, lane);  // no wait
    pdl_wait();                                               // x, add, residual_in: the previous kernels' outputs
    pdl_release();
    bool loaded = true;                                       // wv holds the first round of the first group

    for (int t0 = 0; t0 < tokens; t0 += TOKENS) {
#if STAGED
        __syncthreads();                                      // the previous pass's readers are done
#if NORM
        token_rs_pass(token_rs, x, add, t0, TOKENS, tokens, k, eps, warp, lane);
        __syncthreads();
#endif
        for (int i = threadIdx.x; i < TOKENS * xchunks; i += WARPS * 32) {
            const int j = i / xchunks, c = i - j * xchunks;
            const int t = min(t0 + j, tokens - 1);
            const uint4 v = prologue_chunk(x, add, norm, residual_out, token_rs[j], t, c, k,
                                           blockIdx.x == 0 && t0 + j < tokens);
            gemv_smem[i] = v;
        }
        __syncthreads();
#endif
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            const int first_row = g * WARPS * ROWS + warp * ROWS;
            float acc[ROWS][TOKENS];
            #pragma unroll
            for (int r = 0; r < ROWS; ++r)
                #pragma unroll
                for (int j = 0; j < TOKENS; ++j) acc[r][j] = 0.0f;
            for (int c0 = 0; c0 < wchunks; c0 += 32 * UNROLL) {
                if (!loaded) load_round(wv, sc, w, scales, first_row, n, wchunks, c0, lane);
                loaded = false;
                acc[0][0] += __uint_as_float(all_loads_arrived(wv));   // + 0.0f: the round's loads issue together
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int c = c0 + u * 32 + lane;
                    const bool ok = c < wchunks;
                    #pragma unroll
                    for (int j = 0; j < TOKENS; ++j) {
                        uint4 xv[XPER];
                        #pragma unroll
                        for (int h = 0; h < XPER; ++h) {
#if STAGED
                            xv[h] = zero_unless(ok, gemv_smem[j * xchunks + (ok ? c * XPER + h : 0)]);
#else
                            const int t = min(t0 + j, tokens - 1);
                            xv[h] = load_x(reinterpret_cast<const uint4*>(x + (size_t)t * k), c * XPER + h, ok);
#endif
                        }
                        #pragma unroll
                        for (int r = 0; r < ROWS; ++r) acc[r][j] = chunk_fma(acc[r][j], wv[r][u], sc[r][u], xv);
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int row = first_row + r;
                #pragma unroll
                for (int j = 0; j < TOKENS; ++j) {
                    const float y = warp_sum(acc[r][j]);
                    const int t = t0 + j;
                    if (lane != j || row >= n || t >= tokens) continue;
                    const size_t idx = (size_t)t * n + row;
#if EPILOGUE == 0
                    out[idx] = f32_to_bf16(y);
#elif EPILOGUE == 1
                    out[idx] = f32_to_bf16(__fadd_rn(__uint_as_float((u32)residual_in[idx] << 16), y));
#else
#if EPILOGUE == 3
                    logits[idx] = y;
#endif
                    if (beats(y, row, warp_best[warp][t], warp_best_row[warp][t])) {
                        warp_best[warp][t] = y;
                        warp_best_row[warp][t] = row;
                    }
#endif
                }
            }
        }
    }

#if ARGMAX
    argmax_tail(warp_best, warp_best_row, last_block, best_values, best_rows, ticket, argmax, tokens, n, warp,
                lane);
#endif
}
"""

SOURCE = CudaSource(
    name="decode_gemv", code=WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + NORM_HELPERS + GEMV_SHARED + CODE,
    kernels=(KERNEL,),
    defaults={**KNOBS, "TOKENS": AUTO_TOKENS, **MODES},
    variants=[{"TOKENS": 1}, {"TOKENS": 4}, {"TOKENS": 1, "FP8": 1}, {"TOKENS": 4, "FP8": 1},
              {"TOKENS": 1, "NORM": 1}, {"TOKENS": 4, "NORM": 1, "ADD": 1}, {"TOKENS": 1, "EPILOGUE": 1},
              {"TOKENS": 1, "NORM": 1, "EPILOGUE": 3}, {"TOKENS": 8, "NORM": 1, "EPILOGUE": 2, "FP8": 1},
              {"WARPS": 8, "ROWS": 2, "UNROLL": 4, "TOKENS": 4, "PDL": 1},
              {"WARPS": 8, "ROWS": 4, "UNROLL": 4, "TOKENS": 1, "NORM": 1, "EPILOGUE": 2}],
    warps_knobs={KERNEL: "WARPS"},
    description="the decode step's dense GEMV (QKV, O, LM head): warp per row, all tokens per weight pass, "
                "RMSNorm / residual prologues, residual / argmax epilogues, bf16 or fp8-block128 weights")
GEMV = KernelFamily(name="decode-gemv", source=SOURCE, limits=LIMITS, auto_knobs=("TOKENS",), rules=rules,
                    derived=tuple(MODES))


def quantize_matrix(w: np.ndarray) -> Quantized:
    """A 2-D [N, K] matrix (float32 or bf16, NumPy) in fp8-block128: e4m3fn values [N, K] and float32 scales
    [ceil(N/128), ceil(K/128)] (:func:`kernels.formats.quantize_blocks`). ``cupy.asarray`` of ``values.view(
    np.uint8)`` and of ``scales`` gives what :func:`dense_gemv` takes."""
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        raise TypeError(f"w must be a 2-D NumPy array, got {type(w).__name__}")
    values, scales = quantize_blocks(np.asarray(w, np.float32))
    return Quantized(values, scales)


@dataclass(frozen=True)
class GemvWorkspace:
    """The argmax mode's buffers: the blocks' best values / rows [T, 1024] and the ticket [1] uint32 (zero before
    a launch; the launch leaves it zero). One launch at a time may use it."""

    best_values: Any
    best_rows: Any
    ticket: Any

    @property
    def tokens(self) -> int:
        return int(self.best_values.shape[0])


def make_gemv_workspace(tokens: int) -> GemvWorkspace:
    """A :class:`GemvWorkspace` for up to ``tokens`` tokens on CuPy's current device (T * 8 KB), ticket zeroed.
    Allocate it once, outside a graph capture."""
    import cupy

    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be in [1, {MAX_TOKENS}], got {tokens}")
    return GemvWorkspace(cupy.empty((tokens, MAX_ARGMAX_BLOCKS), np.float32),
                         cupy.empty((tokens, MAX_ARGMAX_BLOCKS), np.int32), cupy.zeros((1,), np.uint32))


_WORKSPACES: dict[tuple[int, int, int], GemvWorkspace] = {}


def _cached_workspace(tokens: int) -> GemvWorkspace:
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), int(cupy.cuda.get_current_stream().ptr), tokens)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = _WORKSPACES[key] = make_gemv_workspace(tokens)
    return workspace


def _is_cupy(arr: Any) -> bool:
    return type(arr).__module__.startswith("cupy")


def _check_array(name: str, arr: Any, dtype: Any, shape: tuple[int, ...], what: str) -> None:
    """TypeError / ValueError naming ``name``: a CuPy array of ``dtype`` and ``shape``, C-contiguous."""
    if not _is_cupy(arr) or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be a cupy.ndarray (the GEMV runs on the GPU), got "
                        f"{type(arr).__module__}.{type(arr).__name__}")
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype}")
    if tuple(arr.shape) != shape:
        raise ValueError(f"{name} must be {what} = {list(shape)}, got shape {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (call .copy() first)")


@dataclass(frozen=True)
class GemvCall:
    """What the checks found: the dims and the mode macros."""

    tokens: int
    k: int
    n: int
    modes: dict[str, int]


def check_gemv_inputs(x: Any, w: Any, out: Any = None, *, norm: Any = None, residual_in: Any = None,
                      residual_out: Any = None, eps: Any = 1e-6, add: Any = None, argmax: Any = None,
                      logits: Any = None, workspace: Any = None) -> GemvCall:
    """Every check of :func:`dense_gemv` that needs no GPU (TypeError / ValueError naming the argument)."""
    if not _is_cupy(x) or not hasattr(x, "dtype"):
        raise TypeError(f"x must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    if getattr(x, "ndim", 0) != 2:
        raise ValueError(f"x must be [T, K], got shape {tuple(getattr(x, 'shape', ()))}")
    tokens, k = (int(d) for d in x.shape)
    _check_array("x", x, BF16, (tokens, k), "[T, K]")
    fp8 = isinstance(w, Quantized)
    if fp8:
        if w.layout != "rows":
            raise ValueError(f"w holds {w.layout!r}-ordered values; the GEMV reads row-major ('rows') fp8-block128")
        values = w.values
        if not _is_cupy(values) or getattr(values, "ndim", 0) != 2:
            raise TypeError("w.values must be a 2-D cupy.ndarray of uint8 (e4m3fn bit patterns)")
        n = int(values.shape[0])
        _check_array("w.values", values, np.uint8, (n, k), "[N, K]")
        _check_array("w.scales", w.scales, np.float32, (-(-n // BLOCK), -(-k // BLOCK)),
                     "[ceil(N/128), ceil(K/128)]")
    else:
        if not _is_cupy(w) or getattr(w, "ndim", 0) != 2:
            raise TypeError(f"w must be a 2-D cupy.ndarray of bfloat16 or an fp8-block128 Quantized, got "
                            f"{type(w).__module__}.{type(w).__name__}")
        n = int(w.shape[0])
        _check_array("w", w, BF16, (n, k), "[N, K]")
    check_gemv_dims(tokens, k, n, fp8)
    if isinstance(eps, bool) or not isinstance(eps, float | int | np.floating):
        raise TypeError(f"eps must be a float, got {eps!r}")
    if not 0 <= float(eps) < 1:
        raise ValueError(f"eps must be in [0, 1), got {eps!r}")
    if norm is not None:
        _check_array("norm", norm, BF16, (k,), "[K]")
    if add is not None:
        _check_array("add", add, BF16, (tokens, k), "[T, K]")
        if residual_out is None:
            raise ValueError("residual_out [T, K] is required with add (the summed residual stream)")
    if residual_out is not None:
        if add is None:
            raise ValueError("residual_out is written only with add; pass add or drop residual_out")
        _check_array("residual_out", residual_out, BF16, (tokens, k), "[T, K]")
    if argmax is not None:
        if out is not None:
            raise ValueError("pass either out (the bf16 outputs) or argmax (the LM head's token ids), not both")
        if residual_in is not None:
            raise ValueError("residual_in goes with out, not with argmax")
        _check_array("argmax", argmax, np.int32, (tokens,), "[T]")
        if logits is not None:
            _check_array("logits", logits, np.float32, (tokens, n), "[T, N]")
        if workspace is not None:
            if not isinstance(workspace, GemvWorkspace):
                raise TypeError(f"workspace must be a GemvWorkspace (make_gemv_workspace), got "
                                f"{type(workspace).__name__}")
            if workspace.tokens < tokens:
                raise ValueError(f"workspace holds {workspace.tokens} tokens, x has {tokens}")
            _check_array("workspace.ticket", workspace.ticket, np.uint32, (1,), "[1]")
        epilogue = EPILOGUES["argmax+logits" if logits is not None else "argmax"]
    else:
        if out is None:
            raise ValueError("out [T, N] bf16 is required (or argmax [T] int32 for the LM head)")
        if logits is not None:
            raise ValueError("logits goes with argmax, not with out")
        if workspace is not None:
            raise ValueError("workspace is the argmax mode's; without argmax pass none")
        _check_array("out", out, BF16, (tokens, n), "[T, N]")
        if residual_in is not None:
            _check_array("residual_in", residual_in, BF16, (tokens, n), "[T, N]")
        epilogue = EPILOGUES["residual" if residual_in is not None else "store"]
    modes = {"FP8": int(fp8), "NORM": int(norm is not None), "ADD": int(add is not None), "EPILOGUE": epilogue}
    return GemvCall(tokens, k, n, modes)


def _span(arr: Any) -> tuple[int, int]:
    start = int(arr.data.ptr)
    return start, start + int(arr.nbytes)


def _check_no_overlap(written: dict[str, Any], read: dict[str, Any]) -> None:
    """ValueError where an output overlaps an input other blocks still read (out and residual_in excepted)."""
    for out_name, out_arr in written.items():
        if out_arr is None:
            continue
        lo, hi = _span(out_arr)
        for in_name, in_arr in read.items():
            if in_arr is None or in_arr is out_arr or (out_name, in_name) == ("out", "residual_in"):
                continue
            in_lo, in_hi = _span(in_arr)
            if lo < in_hi and in_lo < hi:
                raise ValueError(f"{out_name} overlaps {in_name}, which other blocks still read: use another buffer")


def gemv_launch(x: Any, w: Any, out: Any = None, *, norm: Any = None, residual_in: Any = None,
                residual_out: Any = None, eps: float = 1e-6, add: Any = None, argmax: Any = None, logits: Any = None,
                workspace: GemvWorkspace | None = None, **knobs: int) -> Callable[[], None]:
    """Check, resolve and compile once; returns a zero-argument callable that launches the GEMV on CuPy's current
    stream with these arrays (allocates nothing, never syncs: capture it in a CUDA graph, then change the arrays'
    contents and replay). Arguments as :func:`dense_gemv`."""
    call = check_gemv_inputs(x, w, out, norm=norm, residual_in=residual_in, residual_out=residual_out, eps=eps,
                             add=add, argmax=argmax, logits=logits, workspace=workspace)
    fp8 = bool(call.modes["FP8"])
    weights = w.values if fp8 else w
    arrays = {"x": x, "w": weights, "out": out, "residual_in": residual_in, "norm": norm, "add": add,
              "residual_out": residual_out, "logits": logits, "argmax": argmax}
    knobs = dict(knobs)
    from kernels.decode import gemv_mma  # here: gemv_mma imports this module

    tensor_cores = select_path(call, knobs.pop("MMA", 0), knobs) == "mma"
    if tensor_cores:
        params = gemv_mma.resolve_call(call, knobs)
        shared, groups = gemv_mma.shared_bytes(params, params["NT"]), gemv_mma.row_groups(call.n, params)
    else:
        params = with_modes(GEMV.resolve(Dims(call.tokens, call.k, call.n, 1, 1), **knobs), call.modes, knobs)
        staged = call.modes["NORM"] or call.modes["ADD"]
        shared = staged_bytes(call.k, params) if staged else 0
        if shared > SHARED_LIMIT:
            raise ValueError(f"TOKENS {params['TOKENS']} x K {call.k} bf16 rows need {shared} bytes of shared "
                             f"memory (at most {SHARED_LIMIT}): lower TOKENS")
        groups = row_groups(call.n, params)
    check_aligned(**{name: arr for name, arr in arrays.items() if arr is not None})
    _check_no_overlap({"out": out, "residual_out": residual_out, "logits": logits, "argmax": argmax},
                      {"x": x, "w": weights, "norm": norm, "add": add, "residual_in": residual_in})
    mma_family = gemv_mma.GEMV_MMA_FP8 if fp8 else gemv_mma.GEMV_MMA
    family, name = (mma_family, gemv_mma.KERNEL) if tensor_cores else (GEMV, KERNEL)
    kernel = family.kernels_for(params)[name]
    argmax_mode = call.modes["EPILOGUE"] >= 2
    grid = min(groups, params["ARGMAX_BLOCKS"]) if argmax_mode else groups
    if argmax_mode and workspace is None:
        workspace = _cached_workspace(call.tokens)
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    null = np.uint64(0)

    def ptr(arr: Any) -> Any:
        return null if arr is None else arr

    if argmax_mode:
        best_values = workspace.best_values.reshape(-1)[: call.tokens * grid]
        best_rows = workspace.best_rows.reshape(-1)[: call.tokens * grid]
        ticket = workspace.ticket
    else:
        best_values = best_rows = ticket = None
    args = (x, ptr(add), ptr(norm), weights, w.scales if fp8 else null, ptr(out), ptr(residual_in),
            ptr(residual_out), ptr(logits), ptr(best_values), ptr(best_rows), ptr(ticket), ptr(argmax),
            np.int32(call.tokens), np.int32(call.n), np.int32(call.k), np.float32(eps))
    pdl = bool(params["PDL"])
    block = (32 * params["WARPS"],)

    def launch() -> None:
        launch_ex(kernel, (grid,), block, args, shared_mem=shared, programmatic=pdl)

    return launch


def dense_gemv(x: Any, w: Any, out: Any = None, *, norm: Any = None, residual_in: Any = None,
               residual_out: Any = None, eps: float = 1e-6, add: Any = None, argmax: Any = None, logits: Any = None,
               workspace: GemvWorkspace | None = None, **knobs: int) -> Any:
    """y = x . W^T for the step's T tokens in one launch; returns ``out`` (or ``argmax``).

    ``x`` [T, K] bf16 (T <= 64); ``add`` [T, K] bf16: x := bf16(x + add) first, written to ``residual_out`` [T, K];
    ``norm`` [K] bf16: RMSNorm of x with ``eps`` first; ``w`` [N, K] bf16 or an fp8-block128 :class:`Quantized`
    (values [N, K] uint8 e4m3fn bits, scales [ceil(N/128), ceil(K/128)] float32 on the device). Epilogue: ``out``
    [T, N] bf16 = bf16(y), plus ``residual_in`` [T, N] bf16 when given (``out`` may be ``residual_in``); or
    ``argmax`` [T] int32 (the greatest y, ties to the lower row) with optional ``logits`` [T, N] float32, using
    ``workspace`` (:func:`make_gemv_workspace`; one per (device, stream, T) is cached when None). ``knobs``: MMA
    (:func:`select_path`: 0 auto = tensor cores at T >= 9, 1, -1 = FMA), then the chosen kernel's: WARPS,
    ROWS, UNROLL, TOKENS, PDL (launched programmatically), ARGMAX_BLOCKS, MAX_REGS (FMA); WARPS, KSPLIT, UNROLL,
    PDL, ARGMAX_BLOCKS (:mod:`kernels.decode.gemv_mma`). CuPy's current stream, no sync.
    """
    gemv_launch(x, w, out, norm=norm, residual_in=residual_in, residual_out=residual_out, eps=eps, add=add,
                argmax=argmax, logits=logits, workspace=workspace, **knobs)()
    return argmax if argmax is not None else out
