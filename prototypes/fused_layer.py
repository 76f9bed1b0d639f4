"""Prototype: fused warp decode -- the whole MoE layer in ONE persistent kernel (gate_up, grid barrier, down).

Hypothesis. At T = 1 two kernels cannot reach the memory roofline: one plain kernel reads qwen3-30b-a3b's 75.5 MB
layer in 18.2 us on the H200 (results/diag-small-reads.json), gate_up then down in 21.8 us even with PDL
(results/diag-2026-12-01-list-cost-layer-reads.json). The down's BYTES do not depend on gate_up -- only its dots do:

1. one block per SM, all resident (cooperative launch, occupancy-checked grid); block b owns hidden rows
   ``h0 = b * FU_ROWS ..`` and first asks for ``w2[e, h0 + r, :]`` of every (token, slot) pair with ``cp.async``
   into padded shared-memory rows (~200 KB a block), which land while ...
2. ... its warps run gate_up as strict warp decode does (one warp per (pair, neuron), a grid stride over all
   ``SMs x FU_WARPS`` warps) into the [T, K, I] workspace;
3. a grid barrier (fence, an arrive counter in the workspace, reset by the last block through);
4. the down from shared memory on tensor cores, weighted partials summed per (token, row) in a fixed order.

Eligible only where ``T x K x FU_ROWS`` padded w2 rows and the intermediate fit in 227 KB a block
(:func:`fused_supported`, the variant's ``supports``): qwen3-30b-a3b at T = 1; not T = 2, not qwen3-235b-a22b
(786 KB of w2 a block; not measured). No atomics on data.

Prediction: 18.2 us of reads + ~1 us barrier + ~0.8 us tail = ~19.5-20.5 us, against the 85 % bar's 19.4 us.

Result on the H200 (2026-12-01, qwen3-30b-a3b T = 1): 25.76 us at best over 18 points (strict 21.88 in the same
run); 24.68-25.77 us over FU_COPY / FU_TAIL / FU_COOP; 24.81 us at the defaults after the staged-tail refactor. The
probe (notes/diag_fused_probe.py): the w2 copies add ~6 us (not hidden behind gate_up), barrier + tail ~4.5 us of
latency chains. The GPU tests pass (references, NaN poison, every routing, bad ids, 100 barriers per graph, a PDL
chain). Tables: notes/PROTOTYPES.md ("Fused layer").

Conclusion: negative at its only eligible point; kept as the tested record of the one-kernel design, strict warp
decode stays the T = 1 path. Results: results/sweep-proto-fused-layer-30b-t1.json, -knobs-30b-t1.json,
-after-mend.json, results/sweep-2026-12-01-strict-30b-t1.json, results/diag-2026-12-01-fused-probe.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.compile import CudaSource, device_sm_count, launch_ex, max_active_blocks
from kernels.contract import BF16, Dims, check_aligned, check_inputs, check_out, require_cupy
from kernels.device_helpers import (
    MMA_HELPERS,
    PDL_HELPERS,
    STAGED_TAIL_HELPERS,
    WARP_HELPERS,
    padded_row_bytes,
    staged_parts,
)
from kernels.family import Compiled, KernelFamily, Launch, Stage
from kernels.variants import register

FUSED = "moe_fused_3d"

CODE = WARP_HELPERS + PDL_HELPERS + MMA_HELPERS + "#define STAGED_K_LOOP_ROLLED\n" + STAGED_TAIL_HELPERS + r"""
// Fused warp decode (prototypes/fused_layer.py): gate_up, a grid barrier and down in ONE kernel.
// Knobs: FU_WARPS warps per block (one block per SM), FU_BYTES bytes per lane per gate_up load (4, 8, 16),
// FU_UNROLL gate_up chunks per row in flight per lane, FU_ROWS hidden rows per block in the down, PDL,
// FU_COPY how w2 reaches shared memory (0 cp.async, 1 the copy engine), FU_TAIL the down's dots (0 tensor cores
// over k parts + partial sums, 1 one warp per row with FMAs); FU_COOP (host only) the cooperative attribute.
static_assert(FU_WARPS >= 1 && FU_WARPS <= 32, "FU_WARPS must be 1..32");
static_assert(FU_BYTES == 4 || FU_BYTES == 8 || FU_BYTES == 16, "FU_BYTES must be 4, 8 or 16");
static_assert(FU_UNROLL >= 1 && FU_UNROLL <= 32, "FU_UNROLL must be 1..32");
static_assert(FU_ROWS >= 1 && FU_ROWS <= 1024, "FU_ROWS must be 1..1024");
static_assert(FU_COPY == 0 || FU_COPY == 1, "FU_COPY must be 0 (cp.async) or 1 (copy engine)");
static_assert(FU_TAIL == 0 || FU_TAIL == 1, "FU_TAIL must be 0 (tensor cores, k parts) or 1 (one warp a row, FMA)");
#define SPIN_LIMIT (1ll << 26)   // 2^26 polls, tens of seconds: a grid that is not co-resident traps, never hangs

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// another SM's global write, read through L2 (never a stale L1 line)
__device__ __forceinline__ uint4 ld_l2(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// All blocks arrive (after a fence that publishes the block's intermediate writes), then wait for the rest.
// grid_sync[0] counts arrivals, grid_sync[1] departures; the last block through resets both to 0, so every
// launch starts from zeros (stream order, or PDL's wait, keeps the next launch behind this one's reset).
__device__ __forceinline__ void grid_barrier(unsigned* grid_sync) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(grid_sync, 1u);
        long long spins = 0;
        while (ld_acquire(grid_sync) < gridDim.x)
            if (++spins > SPIN_LIMIT) __trap();
        if (atomicAdd(grid_sync + 1, 1u) == gridDim.x - 1) {
            grid_sync[0] = 0u;
            grid_sync[1] = 0u;
        }
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// moe_fused_3d: out[t, h] = sum_k w_tk * (w2[e_tk, h, :] . bf16(SiLU(w13[e_tk, :I] . x_t) * (w13[e_tk, I:] . x_t)))
//   Shared memory: [T bad-token flags, T*K expert ids; 16-byte aligned][w2: T*K x FU_ROWS padded rows]
//   [intermediate: T*K x I bf16][partial: T*K x parts x FU_ROWS floats] (fused_shared_bytes says the same).
//   A token with any id outside [0, E) gets NaN outputs; none of its weights are read.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(FU_WARPS * 32, 1) moe_fused_3d(
    const bf16_t* __restrict__ x,             // [T, H]
    const bf16_t* __restrict__ w13,           // [E, 2I, H]
    const bf16_t* __restrict__ w2,            // [E, H, I]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I] workspace
    unsigned* __restrict__ grid_sync,         // [2] workspace, zero between launches
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    extern __shared__ __align__(16) unsigned char fused_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pairs = tokens * top_k;
    const int h0 = blockIdx.x * FU_ROWS;
    const int rows = max(0, min(FU_ROWS, hidden - h0));            // blocks past H only run gate_up
    const int chunks16 = inter / 8;                                  // 16-byte chunks of an I row (I % 8 == 0)
    const int stride = staged_row_stride(inter);
    const unsigned copies_done = smem_addr(fused_smem);             // FU_COPY 1: the copies' mbarrier (16 B)
    int* token_bad = reinterpret_cast<int*>(fused_smem + 16);
    int* pair_expert = token_bad + tokens;
    unsigned char* w2_rows = fused_smem + 16 + ((size_t)4 * (tokens + pairs) + 15) / 16 * 16;
    uint4* inter_rows = reinterpret_cast<uint4*>(w2_rows + (size_t)pairs * FU_ROWS * stride);
    float* partial = reinterpret_cast<float*>(inter_rows + (size_t)pairs * chunks16);

    pdl_wait();     // x and topk_ids may come from the kernel right before; so may the barrier's reset
    pdl_release();
    // 0) ids into shared memory, every token's range check
    for (int t = tid; t < tokens; t += FU_WARPS * 32) token_bad[t] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += FU_WARPS * 32) {
        const int e = ld_dep(topk_ids + p);
        pair_expert[p] = e;
        if ((unsigned)e >= (unsigned)experts) token_bad[p / top_k] = 1;   // same value from every writer
    }
    __syncthreads();

    // 1) this block's w2 rows, requested before gate_up so they land while it runs
#if FU_COPY == 0   // warp w copies rows (p, r) = w, w + FU_WARPS, ... with cp.async, 16 bytes a lane
    for (int pr = warp; pr < pairs * rows; pr += FU_WARPS) {       // warp-uniform
        const int p = pr / rows, r = pr - p * rows;
        if (token_bad[p / top_k]) continue;
        const uint4* src = reinterpret_cast<const uint4*>(w2 + ((size_t)pair_expert[p] * hidden + h0 + r) * inter);
        const unsigned dst = smem_addr(w2_rows + ((size_t)p * FU_ROWS + r) * stride);
        for (int c = lane; c < chunks16; c += 32)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + 16u * c), "l"(src + c) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
#else              // the copy engine: lane 0 of warp w asks for whole rows w, w + FU_WARPS, ...; one mbarrier counts
                   // the bytes (the requests skip the SM's load pipeline that gate_up's loads use)
    const unsigned row_bytes = 2u * (unsigned)inter;
    if (tid == 0) {
        unsigned good = 0;
        for (int p = 0; p < pairs; ++p) good += token_bad[p / top_k] ? 0u : 1u;
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(copies_done));
        asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(copies_done), "r"(good * (unsigned)rows * row_bytes) : "memory");
    }
    __syncthreads();
    if (lane == 0)
        for (int pr = warp; pr < pairs * rows; pr += FU_WARPS) {
            const int p = pr / rows, r = pr - p * rows;
            if (token_bad[p / top_k]) continue;
            const bf16_t* src = w2 + ((size_t)pair_expert[p] * hidden + h0 + r) * inter;
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(smem_addr(w2_rows + ((size_t)p * FU_ROWS + r) * stride)), "l"(src), "r"(row_bytes),
                            "r"(copies_done) : "memory");
        }
#endif

    // 2) gate_up: warp g of the grid owns items (p, i) = g, g + all warps, ...; lane l reads chunks l, l + 32, ...
    //    of gate row i, up row i and x[t]; FP32 accumulators in registers; lane 0 writes the bf16 intermediate
    {
        typedef typename Vec<FU_BYTES>::T vec_t;
        constexpr int WORDS = FU_BYTES / 4;
        const int chunks = hidden / (FU_BYTES / 2);                  // H % 8 == 0: whole chunks only
        const int items = pairs * inter;                             // small: the shared-memory check bounds T*K
        for (int item = blockIdx.x * FU_WARPS + warp; item < items; item += gridDim.x * FU_WARPS) {
            const int p = item / inter, i = item - p * inter;
            const int t = p / top_k;
            if (token_bad[t]) continue;                              // warp-uniform
            const size_t row = ((size_t)pair_expert[p] * 2 * inter + i) * (size_t)hidden;
            const vec_t* gate_row = reinterpret_cast<const vec_t*>(w13 + row);
            const vec_t* up_row = reinterpret_cast<const vec_t*>(w13 + row + (size_t)inter * hidden);
            const vec_t* x_row = reinterpret_cast<const vec_t*>(x + (size_t)t * hidden);
            float gate_acc = 0.0f, up_acc = 0.0f;
            for (int base = 0; base < chunks; base += 32 * FU_UNROLL) {
                vec_t wg[FU_UNROLL][1], wu[FU_UNROLL][1], xv[FU_UNROLL];
                #pragma unroll
                for (int j = 0; j < FU_UNROLL; ++j) {                // every weight load of the round first
                    const int c = base + j * 32 + lane;
                    wg[j][0] = ldg_chunk(gate_row, c, c < chunks);
                    wu[j][0] = ldg_chunk(up_row, c, c < chunks);
                }
                #pragma unroll
                for (int j = 0; j < FU_UNROLL; ++j) {
                    const int c = base + j * 32 + lane;
                    xv[j] = ld_dep_chunk(x_row, c, c < chunks);
                }
                gate_acc += __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));   // += 0.0f
                #pragma unroll
                for (int j = 0; j < FU_UNROLL; ++j)
                    #pragma unroll
                    for (int w = 0; w < WORDS; ++w) {
                        const float x_lo = bf16_lo(word(xv[j], w)), x_hi = bf16_hi(word(xv[j], w));
                        gate_acc = fmaf(bf16_lo(word(wg[j][0], w)), x_lo, gate_acc);
                        gate_acc = fmaf(bf16_hi(word(wg[j][0], w)), x_hi, gate_acc);
                        up_acc = fmaf(bf16_lo(word(wu[j][0], w)), x_lo, up_acc);
                        up_acc = fmaf(bf16_hi(word(wu[j][0], w)), x_hi, up_acc);
                    }
            }
            const float g = warp_sum(gate_acc), u = warp_sum(up_acc);
            if (lane == 0) intermediate[(size_t)p * inter + i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
        }
    }

    // 3) every block's intermediate is written
    grid_barrier(grid_sync);
    if (rows == 0) return;                                           // block-uniform

    // 4) down from shared memory: the intermediate in, then items (pair p, k part) on tensor cores
    const uint4* inter_global = reinterpret_cast<const uint4*>(intermediate);
    for (int j = tid; j < pairs * chunks16; j += FU_WARPS * 32) inter_rows[j] = ld_l2(inter_global + j);
#if FU_COPY == 0
    asm volatile("cp.async.wait_all;" ::: "memory");                 // this thread's w2 copies have landed
#else
    for (unsigned landed = 0; !landed;)                              // every requested byte has landed
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(landed) : "r"(copies_done) : "memory");
#endif
    __syncthreads();                                                 // ... and everyone's
#if FU_TAIL == 1   // warp w owns rows w, w + FU_WARPS, ... for every token: FMA over slots and chunks, one sum
    for (int r = warp; r < rows; r += FU_WARPS)
        for (int t = 0; t < tokens; ++t) {
            float acc = 0.0f;
            for (int k = 0; k < top_k && !token_bad[t]; ++k) {       // warp-uniform
                const int p = t * top_k + k;
                const uint4* w_row = reinterpret_cast<const uint4*>(w2_rows + ((size_t)p * FU_ROWS + r) * stride);
                const uint4* i_row = inter_rows + (size_t)p * chunks16;
                const float wk = __ldg(topk_weights + p);
                for (int c = lane; c < chunks16; c += 32) {
                    const uint4 wv = w_row[c], iv = i_row[c];
                    #pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        acc = fmaf(bf16_lo(word(wv, w)), wk * bf16_lo(word(iv, w)), acc);
                        acc = fmaf(bf16_hi(word(wv, w)), wk * bf16_hi(word(iv, w)), acc);
                    }
                }
            }
            float v = warp_sum(acc);
            if (token_bad[t]) v = __int_as_float(0x7fc00000);
            const long long idx = (long long)t * hidden + h0 + r;
            if (lane == 0) {
                if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
                else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);
            }
        }
#else              // tensor cores: items (pair p, k part) -> weighted partials, then a fixed-order sum per output
    const int parts = staged_parts<FU_ROWS, FU_WARPS>(chunks16, pairs);
    staged_dots<FU_ROWS, FU_WARPS>(w2_rows, inter_rows, partial, token_bad, topk_weights, pairs, top_k, rows, chunks16,
                                   stride, parts, warp, lane);
    __syncthreads();
    // 5) every (t, row): its partials summed over slots and parts in order, one write
    staged_outputs<FU_ROWS, FU_WARPS>(partial, token_bad, out, out_f32, tokens, top_k, rows, parts, hidden, h0, tid);
#endif
}
"""

DEFAULTS: dict[str, int] = {
    "FU_WARPS": 24,  # warps per block (one block per SM): the sweep's best (32 caps registers at 64)
    "FU_BYTES": 16,  # gate_up bytes per lane per load (8 = strict's GU_BYTES: a bitwise-equal intermediate)
    "FU_UNROLL": 4,  # gate_up chunks per row in flight per lane
    "FU_ROWS": 16,  # hidden rows per block in the down (0 = auto: ceil(H / SMs), every SM one block)
    "PDL": 1,  # programmatic dependent launch (sm_90+; 0 before)
    "FU_COPY": 0,  # w2 into shared memory by 0: cp.async (16 bytes a lane), 1: the copy engine (a row a request)
    "FU_TAIL": 0,  # the down's dots: 0 tensor cores over (pair, k part) items + a sum of partials, 1 one warp a row
    "FU_COOP": 1,  # 1: cooperative launch (the driver checks that every block is resident); 0: the occupancy check
}
AUTO_KNOBS = ("FU_ROWS",)
LIMITS = {"FU_WARPS": (1, 32), "FU_UNROLL": (1, 32), "FU_ROWS": (0, 1024), "PDL": (0, 1), "FU_COPY": (0, 1),
          "FU_TAIL": (0, 1), "FU_COOP": (0, 1)}
SHARED_LIMIT = 227 * 1024  # dynamic shared memory one block may opt into on sm_90
DEFAULT_SMS = 132  # the H200's SM count, used where no GPU is present (CPU-side resolution, offline reports)


def grid_blocks() -> int:
    """One block per SM of the current GPU (132 where there is none)."""
    return device_sm_count(DEFAULT_SMS)


def fused_shared_bytes(params: dict[str, int], dims: Dims) -> int:
    """Dynamic shared memory of ``moe_fused_3d`` (its layout comment): flags and ids, the padded w2 rows, the
    intermediate, the partials."""
    pairs = dims.tokens * dims.top_k
    row = padded_row_bytes(dims.intermediate)
    parts = staged_parts(dims.intermediate, params["FU_ROWS"], params["FU_WARPS"], pairs)
    head = 16 + (4 * (dims.tokens + pairs) + 15) // 16 * 16  # the copies' mbarrier, flags, ids
    rows = params["FU_ROWS"]
    return head + pairs * rows * row + pairs * dims.intermediate * 2 + pairs * parts * rows * 4


def _rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """FU_BYTES a load width; fill ``FU_ROWS`` = 0 (auto: ``ceil(H / SMs)``); with ``dims``, check that the rows
    cover H and that the block's shared memory fits (ValueError naming the sizes otherwise)."""
    if values["FU_BYTES"] not in (4, 8, 16):
        raise ValueError(f"FU_BYTES must be 4, 8 or 16, got {values['FU_BYTES']}")
    if dims is None:
        if values["FU_ROWS"] == 0:
            values["FU_ROWS"] = DEFAULTS["FU_ROWS"]
        return values
    blocks = grid_blocks()
    if values["FU_ROWS"] == 0:
        values["FU_ROWS"] = -(-dims.hidden // blocks)
    if values["FU_ROWS"] * blocks < dims.hidden:
        raise ValueError(f"FU_ROWS={values['FU_ROWS']} x {blocks} blocks (one per SM) covers "
                         f"{values['FU_ROWS'] * blocks} < H={dims.hidden} hidden rows: raise FU_ROWS or use 0 (auto)")
    shared = fused_shared_bytes(values, dims)
    if shared > SHARED_LIMIT:
        raise ValueError(
            f"the fused kernel needs {shared} bytes of shared memory a block (T*K={dims.tokens * dims.top_k} pairs x "
            f"FU_ROWS={values['FU_ROWS']} w2 rows of I={dims.intermediate} + the intermediate), over {SHARED_LIMIT}: "
            "it is for decode batches whose w2 share per SM fits (see fused_supported); use another path"
        )
    return values


SOURCE = CudaSource(
    name="proto_fused_layer",
    code=CODE,
    kernels=(FUSED,),
    defaults=dict(DEFAULTS),
    warps_knobs={FUSED: "FU_WARPS"},
    description="fused warp decode: gate_up, grid barrier and down in one persistent kernel (sm_90+)",
)


@dataclass
class Workspace:
    """What the fused kernel needs besides its inputs: the bf16 intermediate and the barrier's two counters."""

    dims: Dims
    intermediate: Any  # [T, K, I] bf16
    grid_sync: Any  # [2] uint32, zero between launches (the kernel resets it)


def make_workspace(dims: Dims) -> Workspace:
    """Allocate the intermediate and the zeroed barrier counters for ``dims`` (CuPy, current device)."""
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
    import cupy

    return Workspace(dims, cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16),
                     cupy.zeros(2, dtype=cupy.uint32))


def _launch(kernel: Any, params: dict[str, int], dims: Dims, x: Any, w13: Any, w2: Any, topk_ids: Any,
            topk_weights: Any, out: Any, ws: Workspace) -> None:
    out_f32 = np.int32(1 if out.dtype == np.float32 else 0)
    launch_ex(
        kernel, (grid_blocks(),), (params["FU_WARPS"] * 32,),
        (x, w13, w2, topk_ids, topk_weights, ws.intermediate, ws.grid_sync, out, out_f32, np.int32(dims.tokens),
         np.int32(dims.hidden), np.int32(dims.intermediate), np.int32(dims.experts), np.int32(dims.top_k)),
        shared_mem=fused_shared_bytes(params, dims),
        programmatic=bool(params["PDL"]),
        cooperative=bool(params["FU_COOP"]),
    )


def _stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
            out: Any) -> list[Stage]:
    return [("fused", lambda: _launch(compiled.kernels[FUSED], compiled.params, compiled.dims, x, w13, w2, topk_ids,
                                      topk_weights, out, compiled.workspace))]


FAMILY = KernelFamily(
    name="fused-layer",
    source=SOURCE,
    limits=LIMITS,
    auto_knobs=AUTO_KNOBS,
    rules=_rules,
    device_needs={"PDL": 90},
    workspace=lambda dims, params: make_workspace(dims),
    stages=_stages,
)
resolve_params = FAMILY.resolve  # resolve_params(dims=None, **knobs): the tests' and notes/'s name for it


def fused_supported(dims: Dims, **params: Any) -> bool:
    """Whether the fused kernel can run ``dims`` on this GPU (its shared memory fits at these knobs)."""
    try:
        FAMILY.resolve(dims, **params)
    except ValueError:
        return False
    return True


def _compile(dims: Dims, workspace: Workspace | None = None, **knobs: Any) -> Compiled:
    """Resolve (knob errors first, before any device call), check the device (sm_90+), compile, opt the kernel into
    its shared memory and check that one block fits per SM (else ValueError: the grid barrier needs every block
    resident); allocates the workspace unless one is given."""
    FAMILY.resolve(dims, **knobs)
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        raise ValueError("the fused kernel needs sm_90+ (227 KB of shared memory a block); use another path")
    compiled = FAMILY.compile(dims, workspace=workspace, **knobs)
    params, kernel = compiled.params, compiled.kernels[FUSED]
    shared = fused_shared_bytes(params, dims)
    if kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    if max_active_blocks(kernel, params["FU_WARPS"] * 32, shared) < 1:
        raise ValueError(f"moe_fused_3d does not fit on an SM with {shared} bytes of shared memory and "
                         f"{params['FU_WARPS']} warps: lower FU_ROWS or FU_WARPS, or use another path")
    return compiled


def warp_decode_fused(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any = None,
                      workspace: Workspace | None = None, **params: Any) -> Any:
    """One MoE decode layer in one kernel on CuPy arrays; returns ``out`` [T, H] (bf16 unless given fp32).

    With ``out`` and ``workspace`` (:func:`make_workspace`) given, nothing is allocated and nothing syncs with the
    host (id value checks are skipped under graph capture; the kernel guards every id). ValueError where the
    dims do not fit (:func:`fused_supported`)."""
    cupy = require_cupy(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, check_values=False)
    if out is not None:
        require_cupy(out=out)
        check_out(out, dims, cupy)
    if workspace is not None:
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must come from warp_decode_fused.make_workspace(), got "
                            f"{type(workspace).__name__}")
        if workspace.dims != dims:
            raise ValueError(f"workspace was made for {workspace.dims}, this call needs {dims}")
    compiled = _compile(dims, workspace, **params)
    check_inputs(x, w13, w2, topk_ids, topk_weights)  # ids in range, weights finite (skipped under capture)
    check_aligned(x=x, w13=w13, w2=w2)
    if out is None:
        out = cupy.empty((dims.tokens, dims.hidden), dtype=BF16)
    compiled.run(x, w13, w2, topk_ids, topk_weights, out)
    return out


def build(dims: Dims, **knobs: Any) -> Launch:
    """Compile once, allocate the workspace once; the launch only launches (graph-capturable)."""
    return _compile(dims, **knobs).launch()


VARIANT = register(
    FAMILY.variant(
        "proto:fused-layer",
        family="warp-decode",
        build=build,
        reference_mode="warp_decode",
        description="fused warp decode: one persistent kernel per layer (gate_up, grid barrier, down from shared "
        "memory on tensor cores); decode batches whose w2 share per SM fits in shared memory",
        grid={"FU_WARPS": [16, 24, 32], "FU_BYTES": [8, 16], "FU_UNROLL": [4, 6, 8]},  # the H200 sweep
        supports=lambda dims, **params: fused_supported(dims, **params),
    )
)
