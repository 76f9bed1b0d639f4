"""The gate_up lab: ONE parametrised gate_up kernel that the ``gate_up_*`` prototypes sweep (not a variant itself).

``moe_gate_up_lab`` computes what the strict ``moe_gate_up_3d_batched`` computes -- the bf16 [T, K, I]
intermediate ``bf16(SiLU(gate_i . x[t]) * (up_i . x[t]))``, FP32 accumulation, one rounding, bad expert id ->
NaN with no weight read -- with the load shape exposed as knobs (see :data:`DEFAULTS` and the source's
header): warps per block, bytes per lane per load, chunks in flight, whether loads are forced ahead of the
FMAs (the strict kernel's ``all_loads_arrived`` trick), an interleaved gate/up weight layout (needs
:func:`prepack`), and split-K over H (several warps per output, partial sums combined in shared memory in a
fixed order). The down stage is the strict library kernel (``kernels.warp_decode_cupy.FAMILY``) at its
knobs for the dims (``launch.facts["down_params"]``).

Interleaved layout (``LAB_INTERLEAVED=1``): :func:`prepack` turns w13 [E, 2I, H] into [E, I, 2H], row i =
``gate_i[0:8] up_i[0:8] gate_i[8:16] up_i[8:16] ...`` -- 16-byte pieces, whatever ``LAB_BYTES`` is, so one
prepack serves every grid point. A lane's gate chunk and up chunk then sit in one contiguous span:
LAB_BYTES 16 -> 32 bytes (two adjacent ld.v4, gate then up), 32 -> 64 bytes, 8 -> two 8-byte loads in one
32-byte sector. The launch checks w13's shape against the layout it was built for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels import warp_decode_cupy as wdc
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.device_helpers import WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Launch, Stage

KERNEL = "moe_gate_up_lab"
PIECE = 8  # interleave granularity of the prepacked layout, in bf16 elements (16 bytes)

CODE = WARP_HELPERS + r"""
// proto_gate_up_lab: the gate_up stage of warp decode with the load shape exposed (prototypes/_gate_up_lab.py).
//   intermediate[t, k, i] = bf16(SiLU(gate_i . x[t]) * (up_i . x[t])), gate_i / up_i rows of expert topk_ids[t, k]
// bf16 is handled as raw 16-bit patterns: widening is a shift / mask, narrowing integer round-to-nearest-even.
// Knobs (#defines set by kernels.compile):
//   LAB_WARPS        warps per block
//   LAB_BYTES        bytes of each row (gate, up) and of x per lane per chunk: 8 (one ld.v2), 16 (one ld.v4),
//                    32 (two adjacent ld.v4)
//   LAB_UNROLL       chunks per row in flight per lane: one round of a warp covers 32 * LAB_UNROLL chunks
//   LAB_SINK         1: every weight load of a round is issued into registers before the first conversion
//                    (all_loads_arrived, as in the strict kernel); 0: load, convert, FMA in program order and
//                    ptxas interleaves them as it likes
//   LAB_INTERLEAVED  0: w13 [E, 2I, H] as given (gate rows then up rows); 1: w13 prepacked to [E, I, 2H] with
//                    row i = gate[0:8] up[0:8] gate[8:16] up[8:16] ... (16-byte pieces, PIECE elements)
//   LAB_SPLIT        warps sharing one output (split-K over H); partial sums combined through shared memory
//                    in a fixed order (deterministic, no atomics). LAB_WARPS % LAB_SPLIT == 0.
#define PIECE 8

static_assert(LAB_WARPS >= 1 && LAB_WARPS <= 32, "LAB_WARPS must be 1..32");
static_assert(LAB_BYTES == 8 || LAB_BYTES == 16 || LAB_BYTES == 32, "LAB_BYTES must be 8, 16 or 32");
static_assert(LAB_UNROLL >= 1 && LAB_UNROLL <= 16, "LAB_UNROLL must be 1..16");
static_assert(LAB_SINK == 0 || LAB_SINK == 1, "LAB_SINK must be 0 or 1");
static_assert(LAB_INTERLEAVED == 0 || LAB_INTERLEAVED == 1, "LAB_INTERLEAVED must be 0 or 1");
static_assert(LAB_SPLIT >= 1 && LAB_WARPS % LAB_SPLIT == 0, "LAB_WARPS must be a multiple of LAB_SPLIT");

#define VEC_BYTES (LAB_BYTES < 16 ? LAB_BYTES : 16)   // bytes of one load instruction
#define VECS (LAB_BYTES / VEC_BYTES)                   // load instructions per row per chunk (2 for 32 bytes)
#define VEC_ELEMS (VEC_BYTES / 2)                      // bf16 per load instruction
#define VEC_WORDS (VEC_BYTES / 4)                      // 32-bit words per load instruction

typedef Vec<VEC_BYTES>::T vec_t;

// element offset, inside a weight row, of hidden position p (p a multiple of VEC_ELEMS)
__device__ __forceinline__ int row_offset(int p) {
#if LAB_INTERLEAVED
    return ((p & ~(PIECE - 1)) << 1) | (p & (PIECE - 1));   // piece p / 8 starts at 16 * (p / 8)
#else
    return p;
#endif
}

// read-only (ld.global.nc) load of the vector at hidden position p of a weight row, or zeros when !ok.
// Branch-free: a lane past its range loads the row's first vector (valid) and selects zeros, so ptxas
// can hoist every load of a round above the first FMA.
__device__ __forceinline__ vec_t ldg_row(const bf16_t* row, int p, bool ok) {
    return zero_unless(ok, __ldg(reinterpret_cast<const vec_t*>(row + (ok ? row_offset(p) : 0))));
}
__device__ __forceinline__ vec_t ldg_x(const bf16_t* x_row, int p, bool ok) {
    return zero_unless(ok, __ldg(reinterpret_cast<const vec_t*>(x_row + (ok ? p : 0))));
}

// gate += w_gate . x, up += w_up . x over one vector of each (FP32 FMAs, element order lo, hi per word)
__device__ __forceinline__ void fma_vec(float& gate, float& up, const vec_t& g, const vec_t& u, const vec_t& x) {
    #pragma unroll
    for (int w = 0; w < VEC_WORDS; ++w) {
        const float x_lo = bf16_lo(word(x, w)), x_hi = bf16_hi(word(x, w));
        gate = fmaf(bf16_lo(word(g, w)), x_lo, gate);
        gate = fmaf(bf16_hi(word(g, w)), x_hi, gate);
        up = fmaf(bf16_lo(word(u, w)), x_lo, up);
        up = fmaf(bf16_hi(word(u, w)), x_hi, up);
    }
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_lab
//   Output n = (t * K + k) * I + i is owned by a GROUP of LAB_SPLIT consecutive warps of one block:
//   group = blockIdx.x * (LAB_WARPS / LAB_SPLIT) + warp / LAB_SPLIT, part s = warp % LAB_SPLIT.
//   A row is `chunks` chunks of LAB_BYTES (VECS vectors of VEC_ELEMS bf16); part s owns the chunk range
//   [s * part, (s + 1) * part), part = 32 * ceil(chunks / (32 * LAB_SPLIT)) (lane-aligned; late parts may be
//   empty). Lane l of part s loads chunks begin + round + j * 32 + l (j < LAB_UNROLL) of the gate row, of the
//   up row and of x[t]: 2 * LAB_UNROLL * VECS weight loads per lane per round (+ as many of x, L1/L2 hits).
//   FP32 accumulators: gate_acc, up_acc in each lane's registers; warp_sum (butterfly) per warp; with
//   LAB_SPLIT > 1 lane 0 of every warp puts its two sums in shared partial[warp], and after __syncthreads
//   part 0 adds partial[first .. first + LAB_SPLIT - 1] in order s = 0, 1, ... Lane 0 of part 0 applies
//   SiLU(g) * u and stores the bf16. An expert id outside [0, E) reads no weights and stores NaN.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(LAB_WARPS * 32) moe_gate_up_lab(
    const bf16_t* __restrict__ x,             // [T, H]
    const bf16_t* __restrict__ w13,           // [E, 2I, H], or [E, I, 2H] prepacked (LAB_INTERLEAVED)
    const int* __restrict__ topk_ids,         // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int tokens, int hidden, int inter, int experts, int top_k)
{
    constexpr int GROUPS = LAB_WARPS / LAB_SPLIT;                 // outputs per block
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int s = warp % LAB_SPLIT;                               // part of the row this warp dots
    const long long n = (long long)blockIdx.x * GROUPS + warp / LAB_SPLIT;   // the output
    const long long outputs = (long long)tokens * top_k * inter;
    const bool live = n < outputs;
#if LAB_SPLIT == 1
    if (!live) return;                                            // whole warp leaves (no barrier below)
#endif
    const long long pair = live ? n / inter : 0;                  // t * K + k
    const int i = live ? (int)(n - pair * inter) : 0;
    const long long t = pair / top_k;
    const int id = live ? __ldg(topk_ids + pair) : 0;
    const bool bad = (unsigned)id >= (unsigned)experts;
    const long long e = bad ? 0 : id;                             // bad: no weight address is ever loaded

    const int vecs = hidden / VEC_ELEMS;                          // H % 8 == 0: whole vectors only
    const int chunks = (vecs + VECS - 1) / VECS;
    const int part = 32 * ((chunks + 32 * LAB_SPLIT - 1) / (32 * LAB_SPLIT));
    const int begin = s * part;
    const int end = (live && !bad) ? min(chunks, begin + part) : begin;   // empty range: no loads
#if LAB_INTERLEAVED
    const bf16_t* gate_row = w13 + (e * inter + i) * 2 * (long long)hidden;
    const bf16_t* up_row = gate_row + PIECE;                      // same row, the next 16 bytes of each piece
#else
    const bf16_t* gate_row = w13 + (e * 2 * inter + i) * (long long)hidden;
    const bf16_t* up_row = gate_row + (long long)inter * hidden;
#endif
    const bf16_t* x_row = x + t * hidden;

    float gate_acc = 0.0f, up_acc = 0.0f;
    for (int base = begin; base < end; base += 32 * LAB_UNROLL) {
#if LAB_SINK
        // 1) every weight load of the round into registers, then the x loads, then one dependency on all
        vec_t wg[LAB_UNROLL][VECS], wu[LAB_UNROLL][VECS], xv[LAB_UNROLL][VECS];
        #pragma unroll
        for (int j = 0; j < LAB_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            #pragma unroll
            for (int v = 0; v < VECS; ++v) {
                const int q = c * VECS + v;
                const bool ok = c < end && q < vecs;
                wg[j][v] = ldg_row(gate_row, q * VEC_ELEMS, ok);
                wu[j][v] = ldg_row(up_row, q * VEC_ELEMS, ok);
            }
        }
        #pragma unroll
        for (int j = 0; j < LAB_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            #pragma unroll
            for (int v = 0; v < VECS; ++v) {
                const int q = c * VECS + v;
                xv[j][v] = ldg_x(x_row, q * VEC_ELEMS, c < end && q < vecs);
            }
        }
        gate_acc += __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));  // += 0.0f, after all
        // 2) widen and accumulate in FP32
        #pragma unroll
        for (int j = 0; j < LAB_UNROLL; ++j)
            #pragma unroll
            for (int v = 0; v < VECS; ++v) fma_vec(gate_acc, up_acc, wg[j][v], wu[j][v], xv[j][v]);
#else
        // load, convert, multiply in program order; ptxas decides how many loads it keeps in flight
        #pragma unroll
        for (int j = 0; j < LAB_UNROLL; ++j) {
            const int c = base + j * 32 + lane;
            #pragma unroll
            for (int v = 0; v < VECS; ++v) {
                const int q = c * VECS + v;
                const bool ok = c < end && q < vecs;
                const vec_t g = ldg_row(gate_row, q * VEC_ELEMS, ok);
                const vec_t u = ldg_row(up_row, q * VEC_ELEMS, ok);
                const vec_t xq = ldg_x(x_row, q * VEC_ELEMS, ok);
                fma_vec(gate_acc, up_acc, g, u, xq);
            }
        }
#endif
    }

    float g = warp_sum(gate_acc);
    float u = warp_sum(up_acc);
#if LAB_SPLIT > 1
    __shared__ float partial[LAB_WARPS][2];                       // one (gate, up) pair per warp of the block
    if (lane == 0) {
        partial[warp][0] = g;
        partial[warp][1] = u;
    }
    __syncthreads();                                              // every warp of the block gets here
    if (s != 0) return;
    const int first = warp - s;
    g = partial[first][0];
    u = partial[first][1];
    #pragma unroll
    for (int r = 1; r < LAB_SPLIT; ++r) {                          // fixed order: deterministic
        g += partial[first + r][0];
        u += partial[first + r][1];
    }
#endif
    if (lane == 0 && live) {
        bf16_t result = BF16_NAN;
        if (!bad) {
            const float silu = g / (1.0f + expf(-g));             // IEEE division (no fast-math)
            result = f32_to_bf16(silu * u);                       // the one bf16 rounding
        }
        intermediate[n] = result;                                 // [T, K, I] flat: n = pair * I + i
    }
}
"""

# Knob defaults: the strict kernel's tuned gate_up shape (8-byte loads, 8 chunks in flight, 2 warps / block)
DEFAULTS: dict[str, int] = {
    "LAB_WARPS": 2,
    "LAB_BYTES": 8,
    "LAB_UNROLL": 8,
    "LAB_SINK": 1,
    "LAB_INTERLEAVED": 0,
    "LAB_SPLIT": 1,
}
LIMITS: dict[str, tuple[int, int]] = {
    "LAB_WARPS": (1, 32),
    "LAB_BYTES": (8, 32),  # and one of 8, 16, 32 (_rules)
    "LAB_UNROLL": (1, 16),
    "LAB_SINK": (0, 1),
    "LAB_INTERLEAVED": (0, 1),
    "LAB_SPLIT": (1, 32),
}

SOURCE = CudaSource(
    name="proto_gate_up_lab",
    code=CODE,
    kernels=(KERNEL,),
    # LAB_SINK defaults to 0 in the SOURCE (1 in DEFAULTS, what build(), resolve_params() and the variants use):
    # the compile report without dims compiles a knob given as 0 at the source's default when that is not 0
    # ("0 = auto" knobs), which would show SINK=1's registers for SINK=0 points. build() always passes every
    # knob, so this changes no kernel.
    defaults={**DEFAULTS, "LAB_SINK": 0},
    variants=[
        {"LAB_SINK": 1},  # the lab's DEFAULTS
        {"LAB_SINK": 1, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        {"LAB_SINK": 1, "LAB_BYTES": 32, "LAB_UNROLL": 4},
        {"LAB_SINK": 1, "LAB_INTERLEAVED": 1, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        {"LAB_SINK": 1, "LAB_WARPS": 8, "LAB_SPLIT": 4, "LAB_BYTES": 16, "LAB_UNROLL": 2},
    ],
    warps_knobs={KERNEL: "LAB_WARPS"},
    description="prototype gate_up lab: load width / unroll / sink / interleaved w13 / split-K knobs",
)


def _rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """What the limits cannot say: the load widths that exist, and split groups that live in one block."""
    if values["LAB_BYTES"] not in (8, 16, 32):
        raise ValueError(f"LAB_BYTES must be one of 8, 16, 32, got {values['LAB_BYTES']}")
    if values["LAB_WARPS"] % values["LAB_SPLIT"]:
        raise ValueError(
            f"LAB_WARPS ({values['LAB_WARPS']}) must be a multiple of LAB_SPLIT ({values['LAB_SPLIT']}): "
            "the warps sharing one output live in one block"
        )
    return values


# ---------------------------------------------------------------------------------------------------
# The interleaved layout
# ---------------------------------------------------------------------------------------------------
def _module(arr: Any) -> Any:
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def interleave(w13: Any) -> Any:
    """w13 [E, 2I, H] -> [E, I, 2H], row i = gate_i[0:8] up_i[0:8] gate_i[8:16] up_i[8:16] ... (NumPy or CuPy)."""
    if w13.ndim != 3 or w13.shape[1] % 2 or w13.shape[2] % PIECE:
        raise ValueError(f"w13 must be [E, 2I, H] with H a multiple of {PIECE}, got shape {tuple(w13.shape)}")
    xp = _module(w13)
    experts, two_i, hidden = (int(d) for d in w13.shape)
    inter = two_i // 2
    bits = xp.ascontiguousarray(w13).view(xp.uint16)  # raw bf16 bits: a pure data movement
    pieces = bits.reshape(experts, 2, inter, hidden // PIECE, PIECE).transpose(0, 2, 3, 1, 4)
    return xp.ascontiguousarray(pieces).reshape(experts, inter, 2 * hidden).view(w13.dtype)


def deinterleave(packed: Any) -> Any:
    """The inverse of :func:`interleave`: [E, I, 2H] -> [E, 2I, H]."""
    if packed.ndim != 3 or packed.shape[2] % (2 * PIECE):
        raise ValueError(f"packed w13 must be [E, I, 2H] with H a multiple of {PIECE}, got {tuple(packed.shape)}")
    xp = _module(packed)
    experts, inter, two_h = (int(d) for d in packed.shape)
    hidden = two_h // 2
    bits = xp.ascontiguousarray(packed).view(xp.uint16)
    pieces = bits.reshape(experts, inter, hidden // PIECE, 2, PIECE).transpose(0, 3, 1, 2, 4)
    return xp.ascontiguousarray(pieces).reshape(experts, 2 * inter, hidden).view(packed.dtype)


def prepack(w13: Any, w2: Any) -> tuple[Any, Any]:
    """The variant prepack for ``LAB_INTERLEAVED=1``: ``(interleave(w13), w2)``, run once per weight copy."""
    return interleave(w13), w2


# ---------------------------------------------------------------------------------------------------
# The family and the build (no allocation, no host sync in the launch)
# ---------------------------------------------------------------------------------------------------
def blocks(dims: Dims, params: dict[str, int]) -> int:
    """Blocks of the launch: one group of LAB_SPLIT warps per output, LAB_WARPS / LAB_SPLIT groups per block."""
    outputs = dims.tokens * dims.top_k * dims.intermediate
    per_block = params["LAB_WARPS"] // params["LAB_SPLIT"]
    return max(1, -(-outputs // per_block))


def expected_w13_shape(dims: Dims, interleaved: bool) -> tuple[int, int, int]:
    if interleaved:
        return (dims.experts, dims.intermediate, 2 * dims.hidden)
    return (dims.experts, 2 * dims.intermediate, dims.hidden)


def launch_gate_up(
    kernel: Any, params: dict[str, int], dims: Dims, x: Any, w13: Any, topk_ids: Any, intermediate: Any
) -> None:
    """One launch of the lab kernel (w13's shape is checked against the layout: host metadata only)."""
    expected = expected_w13_shape(dims, bool(params["LAB_INTERLEAVED"]))
    if tuple(int(d) for d in w13.shape) != expected:
        layout = "prepacked [E, I, 2H] (LAB_INTERLEAVED=1)" if params["LAB_INTERLEAVED"] else "[E, 2I, H]"
        raise ValueError(f"w13 must be {layout} = {expected}, got {tuple(w13.shape)}")
    launch_ex(
        kernel,
        (blocks(dims, params),),
        (params["LAB_WARPS"] * 32,),
        (
            x,
            w13,
            topk_ids,
            intermediate,
            np.int32(dims.tokens),
            np.int32(dims.hidden),
            np.int32(dims.intermediate),
            np.int32(dims.experts),
            np.int32(dims.top_k),
        ),
    )


def _stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
            out: Any) -> list[Stage]:
    """The family's one stage: the lab gate_up into the [T, K, I] workspace (:func:`build` adds the strict down)."""
    kernel = compiled.kernels[KERNEL]
    return [("gate_up", lambda: launch_gate_up(kernel, compiled.params, compiled.dims, x, w13, topk_ids,
                                               compiled.workspace))]


FAMILY = KernelFamily(
    name="proto-gate-up-lab",
    source=SOURCE,
    limits=LIMITS,
    rules=_rules,
    workspace=lambda dims, params: wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate),
    stages=_stages,
)


def resolve_params(**knobs: Any) -> dict[str, int]:
    """:meth:`FAMILY.resolve <kernels.family.KernelFamily.resolve>` over the lab's :data:`DEFAULTS` (LAB_SINK 1)."""
    return FAMILY.resolve(None, **{**DEFAULTS, **knobs})


def build(dims: Dims, **knobs: Any) -> Launch:
    """Compile once, allocate the [T, K, I] workspace once; the launch only launches (graph-capturable).

    gate_up: the lab kernel with ``knobs`` over :data:`DEFAULTS`; down: the strict library kernel at its knobs for
    ``dims`` (``launch.facts["down_params"]``), reading the lab's workspace.
    """
    lab = FAMILY.compile(dims, **{**DEFAULTS, **knobs})
    strict = wdc.FAMILY.compile(dims, workspace=lab.workspace)

    def stages(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[Stage]:
        down = [stage for stage in strict.stage_list(x, w13, w2, topk_ids, topk_weights, out) if stage[0] == "down"]
        if len(down) != 1:
            raise RuntimeError("kernels.warp_decode_cupy.FAMILY must have exactly one stage named 'down'")
        return [*lab.stage_list(x, w13, w2, topk_ids, topk_weights, out), *down]

    def run(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
        for _, stage in stages(x, w13, w2, topk_ids, topk_weights, out):
            stage()

    return Launch(run=run, stages=stages, params=lab.params, workspace=lab.workspace,
                  facts={"down_params": strict.params})
