"""The fused router: logits, softmax and top-k of T tokens in one launch, ids and weights left on the device.

``fused_router(h, w_router, top_k)`` computes, for every token t, the router logits h[t] . W_router[e] in FP32 with
warp-decode's pattern (a warp per expert row, 16-byte loads, FP32 accumulators, the warp butterfly) over a grid of
(token, expert-row group) blocks, so the router matrix is read by every SM rather than one; the logits go to a
workspace [T, E] in global memory. Each block then takes a ticket on its token's counter (``atomicAdd`` after a
``__threadfence``): the block that takes the last one reads the token's E logits back and one warp takes the FP32
softmax over the E experts and the top-K (ties to the lower expert id, as :func:`kernels.routing.route`),
renormalized with ``norm_topk_prob``, and resets the counter to 0 for the next launch. Every logit is the same lane
chain and butterfly whichever block computes it and whichever block finishes last, so the outputs are deterministic.
It writes ``topk_ids`` [T, K] int32 and ``topk_weights`` [T, K] float32 for the MoE kernels: no host round trip, and
with the outputs and a workspace (:func:`make_router_workspace`) passed in nothing is allocated, so a CUDA graph can
capture it. E <= 512, K <= 16, H a multiple of 8.

The numbers follow the decode step's order contract: the logits are the lane chain
(:func:`kernels.numerics.dot_chain`) and the softmax's exp is ``exp_rn`` (:func:`kernels.numerics.exp_rn`), so a
NumPy twin reproduces ids and weights bit for bit; against :func:`kernels.decode_reference.select_experts` on fp32
logits ids match wherever no two logits lie within a few ulps of the k-th, and weights within ~1e-6 relative. With
``norm`` the post-attention RMSNorm runs in each block's prologue (h is then the residual stream; the normalized row
lives in shared memory, and block (t, 0) writes it to ``moe_in`` for the MoE). PDL: the first round of router weights
is loaded before ``griddepcontrol.wait``, h after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.arrays import BF16, check_aligned
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.decode.device import EXP_RN, NORM_HELPERS
from kernels.device_helpers import PDL_HELPERS, WARP_HELPERS
from kernels.family import KernelFamily

KERNEL = "fused_router"
MAX_EXPERTS = 512  # the last block's shared copy of the logits (2 KB) and 16 per lane in the softmax warp
MAX_TOP_K = 16
KNOBS: dict[str, int] = {
    "WARPS": 4,  # warps per block (a block is one token's group of WARPS * ROWS expert rows)
    "UNROLL": 8,  # 16-byte chunks of W (and of h) in flight per lane: all of H = 2048 in one round
    "ROWS": 1,  # expert rows per warp, one after another (fewer, fuller blocks where T * E is large)
    "PDL": 0,  # programmatic dependent launch: the first round of W loads before griddepcontrol.wait
}
LIMITS = {"WARPS": (1, 32), "UNROLL": (1, 16), "ROWS": (1, 8), "PDL": (0, 1)}
SHARED_LIMIT = 227 * 1024  # the H200's dynamic shared memory per block (NORM keeps the normalized row there)


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """No auto knob; ValueError for dims the kernel cannot take (E, K, H) and for UNROLL past what WARPS leaves."""
    registers = min(255, 65536 // (32 * values["WARPS"]))  # the launch bounds' cap per thread
    if 8 * values["UNROLL"] + 24 > registers:  # 8 registers a chunk pair in flight, ~24 more (ptxas: 64 spill at 8)
        raise ValueError(f"UNROLL {values['UNROLL']} needs ~{8 * values['UNROLL'] + 24} registers; WARPS "
                         f"{values['WARPS']} leaves {registers}: lower UNROLL or WARPS")
    if dims is not None:
        check_router_dims(dims.hidden, dims.experts, dims.top_k)
    return values


def row_groups(experts: int, params: dict[str, int]) -> int:
    """Blocks per token: the expert-row groups of WARPS * ROWS rows (the grid's y)."""
    rows = params["WARPS"] * params["ROWS"]
    return -(-experts // rows)


def check_router_dims(hidden: int, experts: int, top_k: int) -> None:
    """ValueError naming the argument for what the kernel refuses: E in [1, 512], K in [1, min(16, E)], H % 8."""
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"w_router's experts (E) must be in [1, {MAX_EXPERTS}] (the logits live in shared memory), "
                         f"got {experts}")
    if not 1 <= top_k <= min(MAX_TOP_K, experts):
        raise ValueError(f"top_k must be in [1, min({MAX_TOP_K}, E={experts})], got {top_k}")
    if hidden < 8 or hidden % 8:
        raise ValueError(f"the hidden size (H) must be a positive multiple of 8 (16-byte loads), got {hidden}")


CODE = r"""
// ==== the fused router (kernels/decode/router.py) ====
// Knobs: WARPS warps per block, ROWS expert rows per warp, UNROLL 16-byte chunks in flight per lane, PDL. Mode: NORM
// (the post-attention RMSNorm of h fused in front, the normalized rows in shared memory and, from block (t, 0),
// in moe_in).
#define ROUTER_MAX_EXPERTS 512
#if NORM && !defined(ROUTER_DYNAMIC_SMEM)
#define ROUTER_DYNAMIC_SMEM extern __shared__ uint4 router_smem[]
#endif
static_assert(WARPS >= 1 && WARPS <= 32, "WARPS must be in [1, 32]");
static_assert(UNROLL >= 1, "UNROLL must be >= 1");
static_assert(ROWS >= 1, "ROWS must be >= 1");

// ------------------------------------------------------------------------------------------------
// fused_router: grid (T, groups); block (t, g) owns token t's expert rows g * WARPS * ROWS + w + r * WARPS
//   (warp w, r < ROWS). Phase 1: per row, lane l reads 16-byte chunks l, l + 32, ... of the expert's W row and
//   of h[t] (UNROLL chunks in flight), one FP32 FMA chain per lane, then the warp butterfly -- into
//   logits[t, e] (global). Ticket: every writer fences, the block syncs, thread 0 fences and takes a ticket on
//   tickets[t]; the block with the last ticket (gridDim.y - 1) resets the counter, reads the token's logits
//   back through L2 (__ldcg) into shared memory and goes on with warp 0. Phase 2 (warp 0): the max (exact),
//   p[e] = exp_rn(logit - max) (a NaN difference kept NaN) summed lane-strided then by the butterfly, p[e] /= sum
//   (IEEE); then K rounds of a
//   warp argmax over p (greater value, or equal value and lower id: ties to the lower expert id), the chosen p
//   marked taken (-1). Lane k keeps slot k and writes it, divided by the chosen p's sum (in slot order) when
//   renormalize. A round that finds no candidate (NaN logits) writes id -1 and a NaN weight, which the MoE
//   kernels treat as a bad id.
// ------------------------------------------------------------------------------------------------
// the W chunks of one round of expert row `row` (chunks past the row's end: zeros, branch-free)
__device__ __forceinline__ void load_w_round(uint4 (&v)[UNROLL], const uint4* __restrict__ row, int c0, int chunks,
                                             int lane) {
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int c = c0 + u * 32 + lane;
        v[u] = ldg_chunk(row, c, c < chunks);
    }
}
// h chunks the previous kernel may have written: behind the PDL wait (ld_dep), else the read-only path
__device__ __forceinline__ uint4 load_h(const uint4* row, int c, bool ok) {
#if PDL
    return ld_dep_chunk(row, c, ok);
#else
    return ldg_chunk(row, c, ok);
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) fused_router(
    const bf16_t* h,                          // [T, H] the residual stream (NORM) or its post-attention norm
    const bf16_t* __restrict__ w_router,      // [E, H]
    float* __restrict__ logits,               // [T, E] workspace
    unsigned* __restrict__ tickets,           // [T] workspace: 0 before the launch, 0 after it
    int* __restrict__ topk_ids,               // [T, K]
    float* __restrict__ topk_weights,         // [T, K]
    const bf16_t* norm,                       // [H] NORM: the post-attention RMSNorm weight
    bf16_t* moe_in,                           // [T, H] NORM: the normalized rows (block (t, 0) writes them), or null
    int hidden, int experts, int top_k, int renormalize, float eps)
{
    __shared__ float probs[ROUTER_MAX_EXPERTS];                      // the logits, then the softmax
    __shared__ int last_block;
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = hidden / 8;
    const uint4* x = reinterpret_cast<const uint4*>(h + (size_t)t * hidden);
    float* token_logits = logits + (size_t)t * experts;
    const int first = (int)blockIdx.y * (WARPS * ROWS) + warp;
    uint4 v[2][UNROLL];                                              // [W, h][chunk]
    load_w_round(v[0], reinterpret_cast<const uint4*>(w_router + (size_t)(first < experts ? first : 0) * hidden), 0,
                 chunks, lane);                                      // weights: before the PDL wait
    pdl_wait();                                                      // h: the previous kernel's output
    pdl_release();
#if NORM
    // RMSNorm of h[t] into shared memory (the order contract's item 2): warp 0's lane chain and butterfly -> rs;
    // every thread normalizes chunks; block (t, 0) also writes them to moe_in[t].
    ROUTER_DYNAMIC_SMEM;                                             // [H / 8] uint4
    __shared__ float token_rs;
    if (warp == 0) {
        float ss = 0.0f;
        for (int c = lane; c < chunks; c += 32) ss = bf16x8_sumsq(load_h(x, c, true), ss);
        ss = warp_sum(ss);
        if (lane == 0) token_rs = rms_scale(ss, hidden, eps);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += WARPS * 32) {
        const uint4 xn = bf16x8_norm(load_h(x, c, true), token_rs,
                                     load_h(reinterpret_cast<const uint4*>(norm), c, true));
        router_smem[c] = xn;
        if (moe_in != nullptr && blockIdx.y == 0) reinterpret_cast<uint4*>(moe_in + (size_t)t * hidden)[c] = xn;
    }
    __syncthreads();
#endif
    bool loaded = true;                                              // v[0] holds the first row's first round
    for (int r = 0; r < ROWS; ++r) {
        const int e = first + r * WARPS;
        if (e >= experts) break;                                     // warp-uniform
        const uint4* row = reinterpret_cast<const uint4*>(w_router + (size_t)e * hidden);
        float acc = 0.0f;
        for (int c0 = 0; c0 < chunks; c0 += 32 * UNROLL) {
            if (!loaded) load_w_round(v[0], row, c0, chunks, lane);
            loaded = false;
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + u * 32 + lane;
#if NORM
                v[1][u] = zero_unless(c < chunks, router_smem[c < chunks ? c : 0]);
#else
                v[1][u] = load_h(x, c, c < chunks);
#endif
            }
            acc += __uint_as_float(all_loads_arrived(v));            // + 0.0f: the round's loads issue together
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 a = word(v[0][u], j), b = word(v[1][u], j);
                    acc = fmaf(bf16_lo(a), bf16_lo(b), acc);
                    acc = fmaf(bf16_hi(a), bf16_hi(b), acc);
                }
        }
        acc = warp_sum(acc);
        if (lane == 0) token_logits[e] = acc;
    }
    __threadfence();                                                 // this thread's logits visible device-wide
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned ticket = atomicAdd(&tickets[t], 1u);
        last_block = ticket == gridDim.y - 1;
        if (last_block) {
            tickets[t] = 0u;                                         // every block of t has taken its ticket
            __threadfence();                                         // the others' logits before the reads below
        }
    }
    __syncthreads();
    if (!last_block || warp != 0) return;

    for (int e = lane; e < experts; e += 32) probs[e] = __ldcg(token_logits + e);   // L2: not a stale L1 line
    __syncwarp();
    float top = __int_as_float(0xff800000);                          // -inf; the max is exact in any order
    for (int e = lane; e < experts; e += 32) top = fmaxf(top, probs[e]);
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL_MASK, top, offset));
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) {
        const float d = __fsub_rn(probs[e], top);
        const float p = d == d ? exp_rn(d) : d;                      // NaN stays NaN (exp_rn clamps it to 88)
        probs[e] = p;
        sum = __fadd_rn(sum, p);
    }
    sum = warp_sum(sum);
    for (int e = lane; e < experts; e += 32) probs[e] = probs[e] / sum;
    __syncwarp();

    float mine = __int_as_float(0x7fc00000), chosen = 0.0f;          // lane k: slot k's p; every lane: the sum
    int mine_id = -1;
    for (int k = 0; k < top_k; ++k) {
        float best = -1.0f;
        int best_id = 0x7fffffff;
        for (int e = lane; e < experts; e += 32) {                   // ids rise: strict > keeps the lowest
            const float p = probs[e];
            if (p >= 0.0f && p > best) { best = p; best_id = e; }
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_id = __shfl_xor_sync(FULL_MASK, best_id, offset);
            if (other > best || (other == best && other_id < best_id)) { best = other; best_id = other_id; }
        }
        const bool found = best_id < experts;                        // warp-uniform
        if (lane == k) {
            mine = found ? best : __int_as_float(0x7fc00000);
            mine_id = found ? best_id : -1;
        }
        chosen += found ? best : __int_as_float(0x7fc00000);         // slot order
        __syncwarp();
        if (found && lane == 0) probs[best_id] = -1.0f;              // taken
        __syncwarp();
    }
    if (lane < top_k) {
        topk_ids[(size_t)t * top_k + lane] = mine_id;
        topk_weights[(size_t)t * top_k + lane] = renormalize ? mine / chosen : mine;
    }
}
"""

SOURCE = CudaSource(name="decode_router", code=WARP_HELPERS + PDL_HELPERS + EXP_RN + NORM_HELPERS + CODE,
                    kernels=(KERNEL,), defaults={**KNOBS, "NORM": 0},
                    variants=[{"WARPS": 8, "UNROLL": 2}, {"WARPS": 32, "UNROLL": 4}, {"WARPS": 16, "UNROLL": 8},
                              {"WARPS": 4, "UNROLL": 1}, {"WARPS": 8, "UNROLL": 4, "ROWS": 4}, {"NORM": 1},
                              {"NORM": 1, "PDL": 1}, {"WARPS": 8, "UNROLL": 4, "ROWS": 4, "NORM": 1}],
                    warps_knobs={KERNEL: "WARPS"},
                    description="the fused router of a decode step: logits (a warp per (token, expert) row over "
                                "the grid), then softmax and top-k in each token's last block")
ROUTER = KernelFamily(name="decode-router", source=SOURCE, limits=LIMITS, rules=rules, derived=("NORM",))


@dataclass(frozen=True)
class RouterWorkspace:
    """What :func:`fused_router` keeps between its blocks: ``logits`` [T, E] float32 and ``tickets`` [T] uint32
    (zero before a launch; the launch leaves them zero). One launch at a time may use it: two streams that route
    concurrently need a workspace each."""

    logits: Any
    tickets: Any

    @property
    def tokens(self) -> int:
        return int(self.logits.shape[0])

    @property
    def experts(self) -> int:
        return int(self.logits.shape[1])


def make_router_workspace(tokens: int, experts: int) -> RouterWorkspace:
    """A :class:`RouterWorkspace` for ``tokens`` tokens and ``experts`` experts on CuPy's current device, tickets
    zeroed (T * (E + 1) * 4 bytes). Allocate it once, outside a graph capture, and pass it to every call."""
    import cupy

    if tokens < 1 or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"a router workspace needs tokens >= 1 and experts in [1, {MAX_EXPERTS}], got "
                         f"({tokens}, {experts})")
    return RouterWorkspace(cupy.empty((tokens, experts), dtype=np.float32), cupy.zeros((tokens,), dtype=np.uint32))


_WORKSPACES: dict[tuple[int, int, int, int], RouterWorkspace] = {}


def _cached_workspace(tokens: int, experts: int) -> RouterWorkspace:
    """The workspace of (device, stream, T, E), made on first use: calls on one stream run one after another."""
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), int(cupy.cuda.get_current_stream().ptr), tokens, experts)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = _WORKSPACES[key] = make_router_workspace(tokens, experts)
    return workspace


def _is_cupy(arr: Any) -> bool:
    return type(arr).__module__.startswith("cupy")


def _check_array(name: str, arr: Any, dtype: Any, shape: tuple[int, ...] | None, what: str) -> None:
    """TypeError / ValueError naming ``name``: a CuPy array of ``dtype``, ``len(what)`` dims (``shape`` if given),
    C-contiguous."""
    if not _is_cupy(arr) or not hasattr(arr, "dtype"):
        raise TypeError(f"{name} must be a cupy.ndarray (the router runs on the GPU), got "
                        f"{type(arr).__module__}.{type(arr).__name__}")
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype}")
    if arr.ndim != len(what.split(",")) or (shape is not None and tuple(arr.shape) != shape):
        want = list(shape) if shape is not None else "2 dimensions"
        raise ValueError(f"{name} must be {what} = {want}, got shape {tuple(arr.shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (call .copy() first)")


def check_router_inputs(h: Any, w_router: Any, top_k: Any, norm_topk_prob: Any = True, topk_ids: Any = None,
                        topk_weights: Any = None, workspace: Any = None, norm: Any = None, moe_in: Any = None,
                        eps: Any = 1e-6) -> tuple[int, int, int, int]:
    """Every check of :func:`fused_router` that needs no GPU; returns (T, H, E, K)."""
    _check_array("h", h, BF16, None, "[T, H]")
    _check_array("w_router", w_router, BF16, None, "[E, H]")
    tokens, hidden = (int(d) for d in h.shape)
    experts = int(w_router.shape[0])
    if tokens < 1:
        raise ValueError(f"h must hold at least one token, got shape {tuple(h.shape)}")
    if int(w_router.shape[1]) != hidden:
        raise ValueError(f"w_router must be [E, H] with h's H = {hidden}, got shape {tuple(w_router.shape)}")
    if isinstance(top_k, bool | np.bool_) or not isinstance(top_k, int | np.integer):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if not isinstance(norm_topk_prob, bool | np.bool_):
        raise TypeError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    check_router_dims(hidden, experts, int(top_k))
    if topk_ids is not None:
        _check_array("topk_ids", topk_ids, np.int32, (tokens, int(top_k)), "[T, K]")
    if topk_weights is not None:
        _check_array("topk_weights", topk_weights, np.float32, (tokens, int(top_k)), "[T, K]")
    if workspace is not None:
        if not isinstance(workspace, RouterWorkspace):
            raise TypeError(f"workspace must be a RouterWorkspace (make_router_workspace), got "
                            f"{type(workspace).__name__}")
        _check_array("workspace.logits", workspace.logits, np.float32, (tokens, experts), "[T, E]")
        _check_array("workspace.tickets", workspace.tickets, np.uint32, (tokens,), "[T]")
    if isinstance(eps, bool) or not isinstance(eps, float | int | np.floating):
        raise TypeError(f"eps must be a float, got {eps!r}")
    if not 0 <= float(eps) < 1:
        raise ValueError(f"eps must be in [0, 1), got {eps!r}")
    if norm is not None:
        _check_array("norm", norm, BF16, (hidden,), "[H]")
        if 2 * hidden > SHARED_LIMIT:
            raise ValueError(f"norm: the normalized row (H = {hidden}) must fit in {SHARED_LIMIT} bytes of shared "
                             f"memory")
    if moe_in is not None:
        if norm is None:
            raise ValueError("moe_in (the normalized rows) is written only with norm; pass norm or drop moe_in")
        _check_array("moe_in", moe_in, BF16, (tokens, hidden), "[T, H]")
    return tokens, hidden, experts, int(top_k)


def fused_router(h: Any, w_router: Any, top_k: int, norm_topk_prob: bool = True, topk_ids: Any = None,
                 topk_weights: Any = None, workspace: RouterWorkspace | None = None, *, norm: Any = None,
                 moe_in: Any = None, eps: float = 1e-6, **knobs: int) -> tuple[Any, Any]:
    """Route T tokens on the GPU in one launch: (topk_ids [T, K] int32, topk_weights [T, K] float32).

    ``h`` [T, H] bf16 and ``w_router`` [E, H] bf16, CuPy arrays. With ``norm`` [H] bf16, ``h`` is the residual
    stream and the post-attention RMSNorm (``eps``; the order contract's item 2) runs in each block's prologue;
    ``moe_in`` [T, H] bf16 then receives the normalized rows the MoE consumes. Without it ``h`` is already
    normalized. Pass ``topk_ids`` / ``topk_weights`` to write into and a ``workspace``
    (:func:`make_router_workspace` (T, E)) for the logits and the per-token tickets: nothing is then allocated
    (graph-capturable). Without one, a workspace cached per (device, stream, T, E) is made on first use (so capture
    after a first call). ``knobs``: WARPS, UNROLL, ROWS, PDL (launched programmatically: the first round of router
    weights loads before the wait). Compiled on first use per device; CuPy's current stream, never syncs.
    """
    launch, topk_ids, topk_weights = _prepare(h, w_router, top_k, norm_topk_prob, topk_ids, topk_weights, workspace,
                                              norm, moe_in, eps, knobs)
    launch()
    return topk_ids, topk_weights


def router_stage(h: Any, w_router: Any, top_k: int, norm_topk_prob: bool, topk_ids: Any, topk_weights: Any,
                 workspace: RouterWorkspace | None = None, *, norm: Any = None, moe_in: Any = None, eps: float = 1e-6,
                 **knobs: int) -> Callable[[], None]:
    """:func:`fused_router` into given outputs as a zero-argument launch: checked, resolved and compiled now (the
    workspace made now when None); the callable only launches (graph-capturable, allocation-free)."""
    return _prepare(h, w_router, top_k, norm_topk_prob, topk_ids, topk_weights, workspace, norm, moe_in, eps, knobs)[0]


def _prepare(h: Any, w_router: Any, top_k: Any, norm_topk_prob: Any, topk_ids: Any, topk_weights: Any,
             workspace: RouterWorkspace | None, norm: Any, moe_in: Any, eps: Any,
             knobs: dict[str, int]) -> tuple[Callable[[], None], Any, Any]:
    """Checks, knobs, outputs (made when None, after every check), workspace and kernel, once: (launch, topk_ids,
    topk_weights)."""
    tokens, hidden, experts, top_k = check_router_inputs(h, w_router, top_k, norm_topk_prob, topk_ids, topk_weights,
                                                         workspace, norm, moe_in, eps)
    params = {**ROUTER.resolve(Dims(tokens, hidden, 1, experts, top_k), **knobs),
              "NORM": int(norm is not None)}
    check_aligned(h=h, w_router=w_router, **({"norm": norm} if norm is not None else {}),
                  **({"moe_in": moe_in} if moe_in is not None else {}))
    if topk_ids is None or topk_weights is None:
        import cupy

        topk_ids = cupy.empty((tokens, top_k), dtype=np.int32) if topk_ids is None else topk_ids
        topk_weights = cupy.empty((tokens, top_k), dtype=np.float32) if topk_weights is None else topk_weights
    if workspace is None:
        workspace = _cached_workspace(tokens, experts)
    kernel = ROUTER.kernels_for(params)[KERNEL]
    shared = 2 * hidden if norm is not None else 0
    if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    i32, null = np.int32, np.uint64(0)
    grid, block = (tokens, row_groups(experts, params)), (32 * params["WARPS"],)
    args = (h, w_router, workspace.logits, workspace.tickets, topk_ids, topk_weights,
            null if norm is None else norm, null if moe_in is None else moe_in, i32(hidden), i32(experts),
            i32(top_k), i32(bool(norm_topk_prob)), np.float32(eps))
    programmatic = bool(params["PDL"])
    return (lambda: launch_ex(kernel, grid, block, args, shared_mem=shared, programmatic=programmatic),
            topk_ids, topk_weights)
