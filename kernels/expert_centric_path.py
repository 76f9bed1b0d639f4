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

Tiles come from the dims (:func:`auto_params`: small T*K -> narrow, many-warp GEMM blocks; larger -> a cp.async ring);
the predictions, the H200 sweeps that chose them and the measured times: notes/FINDINGS.md ("Expert-centric baseline").
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
PARAM_NAMES = ("BLOCK_N", "WARPS", "M_TILES", "UNROLL", "STAGES", "PREFETCH")
NON_NEGATIVE = ("STAGES", "PREFETCH")
BLOCK_SMEM_LIMIT = 227 * 1024  # sm_90 opt-in maximum per block
DYNAMIC_SMEM_LIMIT = 200 * 1024  # cp.async ring per block (H200: 227 KiB per block opt-in, 228 KiB per SM)
SMALL_BATCH_PAIRS = 64  # T*K at or below this: small GEMM tiles (more blocks for the few experts touched)


def auto_params(dims: Dims | None) -> dict[str, Any]:
    """The tile knobs a call gets when it names none, from the dims alone (no host sync, fixed per build).

    From the H200 sweep of the whole path (weights rotated past L2, CUDA-graph replay): T*K <= 64 (T=1: 8
    experts x few N tiles) wants many small blocks, BLOCK_N=32 / WARPS=8 (44 us vs 57 us with 128-wide
    tiles at T=1, register loads); larger batches (and no dims: ``DEFAULTS``) want BLOCK_N=64 / WARPS=4 with
    the two-stage cp.async ring (STAGES=2): qwen3-30b-a3b T=64 350 us vs 372 (BLOCK_N=128, STAGES=2), 386
    (64, STAGES=4), 433 (128, register loads: the earlier choice) and 683 (L2 prefetch, PREFETCH=2), from
    results/sweep-ec-stages.json.
    fuse_scatter=True (combine reads the padded down rows through row_of_pair, as vLLM does) saves a launch
    and a [T*K, H] round trip at every T."""
    chosen: dict[str, Any] = {**DEFAULTS, "fuse_scatter": True}
    if dims is not None and dims.tokens * dims.top_k <= SMALL_BATCH_PAIRS:
        chosen.update(BLOCK_N=32, WARPS=8, STAGES=0)  # register loads: the ring was not timed at T*K <= 64
    return chosen


def ring_bytes(params: dict[str, Any]) -> int:
    """Dynamic shared memory of the GEMMs' cp.async ring (0 for STAGES=0): [STAGES][WARPS][UNROLL]
    [BLOCK_N/8 + 2*M_TILES][32] 16-byte slots."""
    if not params["STAGES"]:
        return 0
    slots = params["BLOCK_N"] // 8 + 2 * params["M_TILES"]
    return params["STAGES"] * params["WARPS"] * 32 * params["UNROLL"] * slots * 16


def reduce_bytes(params: dict[str, Any]) -> int:
    """Static shared memory of the GEMMs' split-K reduction (mirrors REDUCE_SLABS in the CUDA source)."""
    slab = 16 * params["M_TILES"] * params["BLOCK_N"] * 4
    if params["WARPS"] > 4:
        return slab
    return max(1, min(params["WARPS"] - 1, (24 * 1024) // slab)) * slab


def check_params(dims: Dims | None = None, **params: Any) -> dict[str, Any]:
    """Validate the tile knobs; returns the full set (``auto_params(dims)`` filled in, plus ``fuse_scatter``)."""
    unknown = set(params) - set(PARAM_NAMES) - {"fuse_scatter"}
    if unknown:
        known = [*PARAM_NAMES, "fuse_scatter"]
        raise ValueError(f"unknown expert_centric parameter(s) {sorted(unknown)}; known: {known}")
    full = {**auto_params(dims), **params}
    for name in PARAM_NAMES:
        value = full[name]
        lowest = 0 if name in NON_NEGATIVE else 1
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lowest:
            raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        full[name] = int(value)
    if full["STAGES"] == 1 or full["STAGES"] > 8:
        raise ValueError(f"STAGES must be 0 (register loads) or 2..8 (cp.async ring), got {full['STAGES']}")
    if full["PREFETCH"] > 8 or (full["PREFETCH"] and full["STAGES"]):
        raise ValueError(f"PREFETCH (L2 prefetch distance in steps, 0..8) is for the register path (STAGES=0) only, "
                         f"got PREFETCH={full['PREFETCH']} with STAGES={full['STAGES']}")
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
    ring = ring_bytes(full)
    if ring + reduce_bytes(full) > BLOCK_SMEM_LIMIT:
        raise ValueError(f"the cp.async ring ({ring} B) and the split-K slabs ({reduce_bytes(full)} B) exceed "
                         f"{BLOCK_SMEM_LIMIT} bytes of shared memory per block; lower STAGES, UNROLL or BLOCK_N")
    if ring > DYNAMIC_SMEM_LIMIT:
        raise ValueError(f"the cp.async ring needs {ring} bytes of shared memory per block (limit "
                         f"{DYNAMIC_SMEM_LIMIT}); lower STAGES, UNROLL, WARPS or BLOCK_N")
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
    params = check_params(dims, **params)
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

    ring = ring_bytes(params)

    def kernel(name: str) -> Any:
        key = (name, EXPERT_CENTRIC_SOURCE.code, *tile_params.values())  # an edited source recompiles
        found = _KERNELS.get(key)
        if found is None:
            found = get_kernel(EXPERT_CENTRIC_SOURCE, name, **tile_params)
            if name.startswith("gemm") and ring:  # opt in (function attribute): static + dynamic may pass 48 KiB
                found.max_dynamic_shared_size_bytes = ring
            _KERNELS[key] = found
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
        gather_k((tiles, block_m(p)), (ELEMENTWISE_THREADS,),
                 (src, src_scale, i32(gx), ws.sorted_ids, ws.meta, i32(P), i32(K), i32(H), ws.a_gate_up, dst_scale))

    def gemm(a: Any, a_scale: Any, groups: int, w: Any, n: int, kd: int, c: Any, n_blocks: int) -> None:
        if ws.quant == "fp8":
            args = (a, a_scale, i32(groups), w, ws.tile_expert, i32(n), i32(kd), i32(E), c)
        else:
            args = (a, w, ws.tile_expert, i32(n), i32(kd), i32(E), c)
        gemm_k((tiles, n_blocks), (gemm_threads,), args, shared_mem=ring_bytes(p))

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
    ``params``: BLOCK_N, WARPS, M_TILES, UNROLL, STAGES, PREFETCH (compile-time knobs), fuse_scatter; any not
    given come from :func:`auto_params` of the dims.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights)
    params = check_params(dims, **params)
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
# (UNROLL=4 and fuse_scatter=False lost everywhere in the first sweep; STAGES adds the cp.async ring)
# (points with PREFETCH > 0 and STAGES > 0, or a ring over 200 KB, are rejected by check_params: no timing)
GRID = {"BLOCK_N": [32, 64, 128], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [1, 2], "STAGES": [0, 2, 4],
        "PREFETCH": [0, 2], "fuse_scatter": [True]}
GRID_FP8 = {"BLOCK_N": [32, 64], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [1, 2], "STAGES": [0, 2, 4],
            "PREFETCH": [0, 2], "fuse_scatter": [True]}

EXPERT_CENTRIC = register(Variant(
    name="cupy:expert-centric", backend="cupy", family="expert-centric", build=_build(None),
    reference_mode="classical", quant=None, params={}, baseline=True, grid=GRID,
    description="vLLM-style expert-centric path: align, gather, mma.sync grouped GEMMs, SiLU, scatter, combine",
))
EXPERT_CENTRIC_FP8 = register(Variant(
    name="cupy:expert-centric-fp8", backend="cupy", family="expert-centric", build=_build("fp8"),
    reference_mode="classical", quant="fp8", params={}, grid=GRID_FP8,
    description="expert-centric path with e4m3 activations, fp32 scale per 128 elements (bf16 weights)",
))
EXPERT_CENTRIC_MXFP8 = register(Variant(
    name="cupy:expert-centric-mxfp8", backend="cupy", family="expert-centric", build=_build("mxfp8"),
    reference_mode="classical", quant="mxfp8", params={}, grid=GRID,
    description="expert-centric path with MXFP8 activations (power-of-two scale per 32 elements, bf16 weights)",
))
