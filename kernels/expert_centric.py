"""The conventional expert-centric MoE decode path (vLLM fused-MoE style) in CuPy: the honest baseline.

Stages, each its own kernel (``kernels/expert_centric_cuda.py``), each timed alone through ``launch.stages``:

1. ``align``       routing metadata in one 1024-thread block (moe_align_block_size semantics): per-expert
                   pair counts, exclusive scan of ceil(count / BLOCK_M), pair ids sorted by expert (pair order
                   inside an expert) and padded per expert to BLOCK_M with the sentinel T*K, the expert of each
                   tile, the real tile count (device-side, read by every later kernel) and each pair's row.
2. ``quant_x``     (fp8 / mxfp8 only) quantize x per token: e4m3 + fp32 scale per 128 / power-of-two per 32.
3. ``gather``      permute token rows into the expert-major padded buffer [max_rows, H] (padding rows zero).
4. ``gemm_gate_up`` grouped GEMM, mma.sync m16n8k16 bf16 -> fp32, bf16 output [max_rows, 2I].
5. ``silu_mul``    bf16(SiLU(g) * u) [max_rows, I] (+ the intermediate's quantization).
6. ``gemm_down``   grouped GEMM -> per-expert output buffer [max_rows, H] bf16.
7. ``scatter``     un-permute to pair order [T*K, H] (``fuse_scatter=True`` folds it into 8 instead).
8. ``combine``     routing-weighted fp32 sum over each token's K slots (k = 0..K-1) -> out [T, H].

Buffers are sized for the worst case, so nothing depends on the routing on the host: at most
min(E, T*K) experts are touched, each padding < BLOCK_M rows, so max_tiles = (T*K + min(E, T*K)*(BLOCK_M-1))
// BLOCK_M (tighter than, and implied by, vLLM's T*K + E*(BLOCK_M-1) rows). Kernels over tiles launch
max_tiles blocks; blocks past the real count (meta[0]) exit at once. The whole path is graph-capturable.

Quantization (``quant``) reproduces ``reference.moe_decode(mode="classical", quant=...)``: "fp8" stores the
e4m3 values (exact in bf16) and fp32 group scales, and the GEMM multiplies each 32-wide K chunk's MMA result
by its row's scale (so sum order differs from NumPy's sum of (q*s)*w at fp32 level only); "mxfp8" stores
q * 2^e, which is exact in bf16, and runs the plain bf16 GEMM.

Predictions (H200, ~4.5 TB/s streaming reads), qwen3-30b-a3b at T=64 (uniform routing, ~126 experts):
  gemm_gate_up reads 126 * 2I*H*2 B = 0.79 GB -> ~190 us at 90 % of roofline; gemm_down 0.40 GB -> ~100 us;
  align ~5 us (one block, launch-bound), gather 2 MB / quant / silu 7 MB / scatter 4 MB / combine 2 MB:
  ~3-5 us each (launch + a few MB).  Whole path ~310-330 us (bar: <= 375 us), five of eight stages doing
  no FLOPs but costing ~15-20 us together. At T=1 (8 experts, 75 MB) the GEMMs have only 8 tiles x N/BLOCK_N
  blocks: ~25-35 us of GEMM + ~15-20 us for the six small launches -> ~45-60 us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.compile import get_kernel
from kernels.contract import BF16, Dims, array_module, check_inputs, check_out
from kernels.expert_centric_cuda import DEFAULTS, EXPERT_CENTRIC_SOURCE
from kernels.numerics import FP8_GROUP, QUANT_MODES
from kernels.variants import Variant, register

QUANT_CODE = {None: 0, "fp8": 1, "mxfp8": 2}
ALIGN_THREADS = 1024
ELEMENTWISE_THREADS = 256
STATIC_SMEM_LIMIT = 48 * 1024
MAX_EXPERTS = 6144
PARAM_NAMES = ("BLOCK_N", "WARPS", "M_TILES", "UNROLL")


def check_params(**params: Any) -> dict[str, Any]:
    """Validate the tile knobs; returns the full set (defaults filled in, plus ``fuse_scatter``)."""
    unknown = set(params) - set(PARAM_NAMES) - {"fuse_scatter"}
    if unknown:
        known = [*PARAM_NAMES, "fuse_scatter"]
        raise ValueError(f"unknown expert_centric parameter(s) {sorted(unknown)}; known: {known}")
    full = {**DEFAULTS, "fuse_scatter": False, **params}
    for name in PARAM_NAMES:
        value = full[name]
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        full[name] = int(value)
    if full["BLOCK_N"] % 8:
        raise ValueError(f"BLOCK_N must be a multiple of 8 (n8 MMA tiles), got {full['BLOCK_N']}")
    if full["WARPS"] > 32:
        raise ValueError(f"WARPS must be <= 32, got {full['WARPS']}")
    smem = 16 * full["M_TILES"] * full["BLOCK_N"] * 4
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(
            f"16*M_TILES * BLOCK_N * 4 = {smem} bytes of split-K shared memory exceeds 48 KiB; "
            "lower M_TILES or BLOCK_N"
        )
    full["fuse_scatter"] = bool(full["fuse_scatter"])
    return full


def block_m(params: dict[str, Any]) -> int:
    return 16 * params["M_TILES"]


def max_tiles(dims: Dims, bm: int) -> int:
    """Worst-case padded tile count over all routings of ``dims``."""
    pairs = dims.tokens * dims.top_k
    return (pairs + min(dims.experts, pairs) * (bm - 1)) // bm


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)



# ---------------------------------------------------------------------------------------------------
# NumPy models of what the kernels compute (CPU tests check them; GPU tests compare the device against them)
# ---------------------------------------------------------------------------------------------------
def align_metadata_numpy(topk_ids: np.ndarray, experts: int, bm: int) -> dict[str, Any]:
    """What ``moe_align`` writes, in NumPy: experts in id order, each expert's pairs in pair order, padded
    to ``bm`` rows with the sentinel T*K. Returns sorted_ids (real tiles' rows only), tile_expert (real
    tiles), num_tiles and row_of_pair (-1 for an out-of-range id)."""
    flat = np.asarray(topk_ids).ravel()
    pairs = flat.size
    sorted_ids: list[int] = []
    tile_expert: list[int] = []
    row_of_pair = np.full(pairs, -1, np.int32)
    for e in range(experts):
        members = np.flatnonzero(flat == e)
        if members.size == 0:
            continue
        tiles = ceil_div(members.size, bm)
        row_of_pair[members] = len(sorted_ids) + np.arange(members.size)
        sorted_ids += members.tolist() + [pairs] * (tiles * bm - members.size)
        tile_expert += [e] * tiles
    return {
        "sorted_ids": np.asarray(sorted_ids, np.int32), "tile_expert": np.asarray(tile_expert, np.int32),
        "num_tiles": len(tile_expert), "row_of_pair": row_of_pair,
    }


def round_e4m3_numpy(values: np.ndarray) -> np.ndarray:
    """The kernels' bit-level e4m3 round-to-nearest-even of float32 values already clipped to [-448, 448]."""
    v = np.asarray(values, np.float32)
    a = np.abs(v)
    with np.errstate(invalid="ignore"):
        small = a < np.float32(2.0**-6)
    sub = (np.rint(a * np.float32(512.0)) * np.float32(2.0**-9)).astype(np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).astype(np.uint32).view(np.float32)
    r = np.where(small, sub, normal)
    r = np.copysign(r, v)
    return np.where(np.isnan(v), v, r).astype(np.float32)


def quantize_rows_numpy(rows: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The kernels' ``quantize_store`` on float32 rows [n, D] (D a multiple of 8): returns what is stored,
    ``(values, scales)``: fp8 -> (e4m3 values q, fp32 scale per 128), mxfp8 -> (q * 2^e, None)."""
    rows = np.asarray(rows, np.float32)
    n, width = rows.shape
    group = FP8_GROUP if quant == "fp8" else 32
    groups = ceil_div(width, group)
    padded = np.zeros((n, groups * group), np.float32)
    padded[:, :width] = rows
    grouped = padded.reshape(n, groups, group)
    amax = np.abs(grouped).max(axis=-1)
    if quant == "fp8":
        scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    else:
        _, exp = np.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): ilogb = exp - 1
        scale = np.ldexp(np.float32(1.0), np.where(amax > 0, exp - 1 - 8, 0)).astype(np.float32)
    q = round_e4m3_numpy(np.clip(grouped / scale[..., None], -448.0, 448.0))
    if quant == "fp8":
        return q.reshape(n, -1)[:, :width], scale
    return (q * scale[..., None]).astype(np.float32).reshape(n, -1)[:, :width], None

@dataclass
class Workspace:
    """Every intermediate buffer of one (dims, quant, params) combination, allocated once."""

    dims: Dims
    quant: str | None
    params: dict[str, Any]
    max_tiles: int
    sorted_ids: Any  # [max_rows] int32: pair id or the sentinel T*K
    tile_expert: Any  # [max_tiles] int32
    meta: Any  # [4] int32: meta[0] = real tile count
    row_of_pair: Any  # [T*K] int32: padded row of each pair (-1: bad expert id)
    x_q: Any  # [T, H] bf16 (quantized x) or None
    x_scale: Any  # [T, ceil(H/128)] fp32 (fp8) or None
    a_gate_up: Any  # [max_rows, H] bf16 gathered activations
    a_scale: Any  # [max_rows, ceil(H/128)] fp32 (fp8) or None
    gate_up: Any  # [max_rows, 2I] bf16
    inter: Any  # [max_rows, I] bf16
    inter_scale: Any  # [max_rows, ceil(I/128)] fp32 (fp8) or None
    down: Any  # [max_rows, H] bf16 per-expert output buffer
    pair_out: Any  # [T*K, H] bf16 (unfused scatter) or None

    def matches(self, dims: Dims, quant: str | None, params: dict[str, Any]) -> bool:
        return self.dims == dims and self.quant == quant and self.params == params


def make_workspace(dims: Dims, quant: str | None = None, **params: Any) -> Workspace:
    """Allocate the buffers for ``dims`` / ``quant`` / tile ``params`` (CuPy, on the current device)."""
    import cupy

    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if dims.experts > MAX_EXPERTS:
        raise ValueError(f"the align kernel keeps 2 ints per expert in shared memory: E <= {MAX_EXPERTS}, "
                         f"got {dims.experts}")
    params = check_params(**params)
    bm = block_m(params)
    tiles = max_tiles(dims, bm)
    rows = tiles * bm
    T, H, I, K = dims.tokens, dims.hidden, dims.intermediate, dims.top_k
    gx, gi = ceil_div(H, FP8_GROUP), ceil_div(I, FP8_GROUP)
    fp8 = quant == "fp8"
    return Workspace(
        dims=dims, quant=quant, params=params, max_tiles=tiles,
        sorted_ids=cupy.empty(rows, cupy.int32),
        tile_expert=cupy.empty(tiles, cupy.int32),
        meta=cupy.zeros(4, cupy.int32),
        row_of_pair=cupy.empty(T * K, cupy.int32),
        x_q=cupy.empty((T, H), BF16) if quant else None,
        x_scale=cupy.empty((T, gx), cupy.float32) if fp8 else None,
        a_gate_up=cupy.empty((rows, H), BF16),
        a_scale=cupy.empty((rows, gx), cupy.float32) if fp8 else None,
        gate_up=cupy.empty((rows, 2 * I), BF16),
        inter=cupy.empty((rows, I), BF16),
        inter_scale=cupy.empty((rows, gi), cupy.float32) if fp8 else None,
        down=cupy.empty((rows, H), BF16),
        pair_out=None if params["fuse_scatter"] else cupy.empty((T * K, H), BF16),
    )


_KERNELS: dict[tuple, Any] = {}


def _kernel_getter(params: dict[str, Any]) -> Callable[[str], Any]:
    """RawKernel lookup by name for these tile params, memoised (no module work at launch time)."""
    tile_params = {name: params[name] for name in PARAM_NAMES}

    def kernel(name: str) -> Any:
        key = (name, EXPERT_CENTRIC_SOURCE.code, *tile_params.values())  # an edited source recompiles
        found = _KERNELS.get(key)
        if found is None:
            found = _KERNELS[key] = get_kernel(EXPERT_CENTRIC_SOURCE, name, **tile_params)
        return found

    return kernel


def _stage_list(ws: Workspace, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[
    tuple[str, Callable[[], None]]
]:
    """The path as ``[(stage name, zero-argument launcher), ...]``; running them in order is one layer."""
    d, p = ws.dims, ws.params
    kernel = _kernel_getter(p)
    T, H, I, E, K = d.tokens, d.hidden, d.intermediate, d.experts, d.top_k
    P = T * K
    quant = QUANT_CODE[ws.quant]
    gx, gi = ceil_div(H, FP8_GROUP), ceil_div(I, FP8_GROUP)
    tiles, n_blocks_gu, n_blocks_dn = ws.max_tiles, ceil_div(2 * I, p["BLOCK_N"]), ceil_div(H, p["BLOCK_N"])
    gemm_threads = 32 * p["WARPS"]
    i32 = np.int32
    null = np.uint64(0)  # a null device pointer (8 bytes) for optional arguments

    align_k, gather_k = kernel("moe_align"), kernel("gather_rows")
    silu_k, combine_k = kernel("silu_mul"), kernel("combine")
    gemm_k = kernel("gemm_fp8_scaled" if ws.quant == "fp8" else "gemm_bf16")
    out_f32 = i32(1 if out.dtype == np.float32 else 0)

    def align() -> None:
        align_k((1,), (ALIGN_THREADS,), (topk_ids, i32(P), i32(E), i32(tiles), ws.sorted_ids, ws.tile_expert,
                                         ws.meta, ws.row_of_pair), shared_mem=2 * E * 4)

    def quant_x() -> None:
        kernel("quantize_rows")((T,), (ELEMENTWISE_THREADS,), (x, i32(H), i32(quant), i32(gx), ws.x_q,
                                                               ws.x_scale if ws.x_scale is not None else null))

    def gather() -> None:
        src = ws.x_q if quant else x
        src_scale = ws.x_scale if ws.x_scale is not None else null
        dst_scale = ws.a_scale if ws.a_scale is not None else null
        gather_k((tiles,), (ELEMENTWISE_THREADS,), (src, src_scale, i32(gx), ws.sorted_ids, ws.meta, i32(P), i32(K),
                                                   i32(H), ws.a_gate_up, dst_scale))

    def gemm(a: Any, a_scale: Any, groups: int, w: Any, n: int, kd: int, c: Any, n_blocks: int) -> None:
        if ws.quant == "fp8":
            args = (a, a_scale, i32(groups), w, ws.tile_expert, ws.meta, i32(n), i32(kd), i32(E), c)
        else:
            args = (a, w, ws.tile_expert, ws.meta, i32(n), i32(kd), i32(E), c)
        gemm_k((tiles, n_blocks), (gemm_threads,), args)

    def gemm_gate_up() -> None:
        gemm(ws.a_gate_up, ws.a_scale, gx, w13, 2 * I, H, ws.gate_up, n_blocks_gu)

    def silu_mul() -> None:
        silu_k((tiles, block_m(p)), (ELEMENTWISE_THREADS,), (ws.gate_up, ws.meta, i32(I), i32(quant), i32(gi), ws.inter,
                                                 ws.inter_scale if ws.inter_scale is not None else null))

    def gemm_down() -> None:
        gemm(ws.inter, ws.inter_scale, gi, w2, H, I, ws.down, n_blocks_dn)

    def scatter() -> None:
        kernel("scatter_rows")((P,), (ELEMENTWISE_THREADS,), (ws.down, ws.row_of_pair, i32(H), ws.pair_out))

    def combine() -> None:
        if p["fuse_scatter"]:
            args = (ws.down, ws.row_of_pair, topk_weights, i32(K), i32(H), out_f32, out)
        else:
            args = (ws.pair_out, null, topk_weights, i32(K), i32(H), out_f32, out)
        combine_k((T,), (ELEMENTWISE_THREADS,), args)

    stages: list[tuple[str, Callable[[], None]]] = [("align", align)]
    if quant:
        stages.append(("quant_x", quant_x))
    stages += [("gather", gather), ("gemm_gate_up", gemm_gate_up), ("silu_mul" + ("+quant" if quant else ""), silu_mul),
               ("gemm_down", gemm_down)]
    if p["fuse_scatter"]:
        stages.append(("scatter+combine", combine))
    else:
        stages += [("scatter", scatter), ("combine", combine)]
    return stages


def expert_centric(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    quant: str | None = None,
    out: Any = None,
    workspace: Workspace | None = None,
    **params: Any,
) -> Any:
    """One MoE decode layer by the expert-centric path; returns ``out`` [T, H] (bf16, or float32 if given).

    Inputs follow :mod:`kernels.contract` (CuPy arrays). With ``out`` and a matching ``workspace``
    (``make_workspace(dims, quant, **params)``) the call allocates nothing and never syncs with the host.
    ``params``: BLOCK_N, WARPS, M_TILES, UNROLL (compile-time tile knobs), fuse_scatter.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    params = check_params(**params)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights)
    xp = array_module(x)
    if xp is np:
        raise TypeError("expert_centric runs on the GPU: pass cupy arrays (reference.moe_decode is the host version)")
    if out is None:
        out = xp.empty((dims.tokens, dims.hidden), BF16)
    else:
        check_out(out, dims, xp)
    if workspace is None:
        workspace = make_workspace(dims, quant, **params)
    elif not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must come from make_workspace(), got {type(workspace).__name__}")
    elif not workspace.matches(dims, quant, params):
        raise ValueError(
            f"workspace was made for {workspace.dims}, quant={workspace.quant!r}, {workspace.params}; "
            f"this call needs {dims}, quant={quant!r}, {params}"
        )
    for _, run in _stage_list(workspace, x, w13, w2, topk_ids, topk_weights, out):
        run()
    return out


def _build(quant: str | None) -> Callable[..., Any]:
    def build(dims: Dims, **params: Any) -> Callable[..., None]:
        workspace = make_workspace(dims, quant, **params)

        def launch(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
            for _, run in _stage_list(workspace, x, w13, w2, topk_ids, topk_weights, out):
                run()

        def stages(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[
            tuple[str, Callable[[], None]]
        ]:
            return _stage_list(workspace, x, w13, w2, topk_ids, topk_weights, out)

        launch.stages = stages  # type: ignore[attr-defined]
        launch.workspace = workspace  # type: ignore[attr-defined]
        return launch

    return build


# sweep grids: every combination compiles for sm_90 with zero spills (tests/test_expert_centric.py checks it)
GRID = {"BLOCK_N": [32, 64, 128], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [2, 4], "fuse_scatter": [False, True]}
GRID_FP8 = {"BLOCK_N": [32, 64], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [2, 4], "fuse_scatter": [False, True]}

EXPERT_CENTRIC = register(Variant(
    name="cupy:expert-centric", backend="cupy", family="expert-centric", build=_build(None),
    reference_mode="classical", quant=None, params=dict(DEFAULTS), baseline=True, grid=GRID,
    description="vLLM-style expert-centric path: align, gather, mma.sync grouped GEMMs, SiLU, scatter, combine",
))
EXPERT_CENTRIC_FP8 = register(Variant(
    name="cupy:expert-centric-fp8", backend="cupy", family="expert-centric", build=_build("fp8"),
    reference_mode="classical", quant="fp8", params=dict(DEFAULTS), grid=GRID_FP8,
    description="expert-centric path with e4m3 activations, fp32 scale per 128 elements (bf16 weights)",
))
EXPERT_CENTRIC_MXFP8 = register(Variant(
    name="cupy:expert-centric-mxfp8", backend="cupy", family="expert-centric", build=_build("mxfp8"),
    reference_mode="classical", quant="mxfp8", params=dict(DEFAULTS), grid=GRID,
    description="expert-centric path with MXFP8 activations (power-of-two scale per 32 elements, bf16 weights)",
))
