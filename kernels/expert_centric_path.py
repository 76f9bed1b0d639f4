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

Buffers are sized for the worst case, so nothing depends on the routing on the host: at most min(E, T*K)
experts are touched, each padding < BLOCK_M rows, so max_tiles = (T*K + min(E, T*K)*(BLOCK_M-1)) // BLOCK_M.
Kernels over tiles launch max_tiles blocks; blocks past the real count (meta[0]) exit at once: graph-capturable.

Quantization (``quant``, a build argument: one variant per mode) reproduces ``reference.moe_decode(mode=
"classical", quant=...)``: "fp8" stores e4m3 values (exact in bf16) and fp32 group scales, the GEMM scales each
32-wide K chunk's MMA result by its row's scale; "mxfp8" stores q * 2^e (exact in bf16), the plain bf16 GEMM.

:data:`FAMILY` declares the kernels once: knobs (0 = auto for BLOCK_N, WARPS, STAGES: :func:`auto_params` picks
them from the dims -- small T*K narrow many-warp blocks, larger a cp.async ring), the rules that reject tiles that
cannot run, workspace and stages. The sweeps behind the choices: notes/FINDINGS.md ("Expert-centric baseline").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.contract import BF16, Dims, array_module, check_inputs, check_out
from kernels.expert_centric_cuda import DEFAULTS, EXPERT_CENTRIC_SOURCE, KERNELS, W8A8_KERNELS
from kernels.family import Compiled, KernelFamily, Launch, Stage
from kernels.formats import FP8_BLOCK128, Quantized
from kernels.numerics import FP8_GROUP, QUANT_MODES
from kernels.variants import register

QUANT_CODE = {None: 0, "fp8": 1, "mxfp8": 2}
ALIGN_THREADS = 1024
ELEMENTWISE_THREADS = 256
STATIC_SMEM_LIMIT = 48 * 1024
MAX_EXPERTS = 6144
PARAM_NAMES = tuple(DEFAULTS)  # the compile-time knobs; build() and expert_centric() also take fuse_scatter
AUTO_KNOBS = ("BLOCK_N", "WARPS", "STAGES")  # 0 = auto: auto_params(dims) picks them
# ranges (the rules check the rest: BLOCK_N a multiple of 8, shared memory, PREFETCH on the register path only)
LIMITS = {"BLOCK_N": (0, 768), "WARPS": (0, 32), "M_TILES": (1, 96), "UNROLL": (1, 16), "STAGES": (0, 8),
          "PREFETCH": (0, 8), "W8A8": (0, 1)}
BLOCK_SMEM_LIMIT = 227 * 1024  # sm_90 opt-in maximum per block
DYNAMIC_SMEM_LIMIT = 200 * 1024  # cp.async ring per block (H200: 227 KiB per block opt-in, 228 KiB per SM)
SMALL_BATCH_PAIRS = 64  # T*K at or below this: small GEMM tiles (more blocks for the few experts touched)


def auto_params(dims: Dims | None) -> dict[str, Any]:
    """The tile knobs a call gets when it leaves them to the dims (no host sync, fixed per build).

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
        chosen.update(BLOCK_N=32, WARPS=8, STAGES=1)  # register loads: the ring was not timed at T*K <= 64
    return chosen


def ring_bytes(params: Mapping[str, Any]) -> int:
    """Dynamic shared memory of the GEMMs' cp.async ring (0 for the register path, STAGES < 2): [STAGES][WARPS]
    [UNROLL][BLOCK_N/8 + 2*M_TILES][32] 16-byte slots."""
    if params["STAGES"] < 2:
        return 0
    slots = params["BLOCK_N"] // 8 + 2 * params["M_TILES"]
    return params["STAGES"] * params["WARPS"] * 32 * params["UNROLL"] * slots * 16


def reduce_bytes(params: Mapping[str, Any]) -> int:
    """Static shared memory of the GEMMs' split-K reduction (mirrors REDUCE_SLABS in the CUDA source)."""
    slab = 16 * params["M_TILES"] * params["BLOCK_N"] * 4
    if params["WARPS"] > 4:
        return slab
    return max(1, min(params["WARPS"] - 1, (24 * 1024) // slab)) * slab


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """The family's rules on validated knobs (names, int types and :data:`LIMITS` checked): the auto knobs (0)
    from :func:`auto_params` of ``dims``, then ValueError for tiles these kernels cannot run."""
    tiles = auto_params(dims)
    if values["W8A8"] and values["STAGES"] == 0:
        values["STAGES"] = 1  # the W8A8 GEMMs load weights into registers (8 bytes a lane: no 16-byte ring slots)
    for knob in AUTO_KNOBS:
        if values[knob] == 0:
            values[knob] = tiles[knob]
    if values["W8A8"] and (values["STAGES"] >= 2 or values["PREFETCH"]):
        raise ValueError(f"W8A8 (fp8-block128 weights) runs the GEMMs on register loads: STAGES must be 1 and "
                         f"PREFETCH 0, got STAGES={values['STAGES']}, PREFETCH={values['PREFETCH']}")
    if values["PREFETCH"] and values["STAGES"] >= 2:
        raise ValueError(f"PREFETCH (L2 prefetch distance in steps, 0..8) is for the register path (STAGES=1) only, "
                         f"got PREFETCH={values['PREFETCH']} with STAGES={values['STAGES']}")
    if values["BLOCK_N"] % 8:
        raise ValueError(f"BLOCK_N must be a multiple of 8 (n8 MMA tiles), got {values['BLOCK_N']}")
    smem = 16 * values["M_TILES"] * values["BLOCK_N"] * 4
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(
            f"16*M_TILES * BLOCK_N * 4 = {smem} bytes of split-K shared memory exceeds 48 KiB; "
            "lower M_TILES or BLOCK_N"
        )
    ring = ring_bytes(values)
    if ring + reduce_bytes(values) > BLOCK_SMEM_LIMIT:
        raise ValueError(f"the cp.async ring ({ring} B) and the split-K slabs ({reduce_bytes(values)} B) exceed "
                         f"{BLOCK_SMEM_LIMIT} bytes of shared memory per block; lower STAGES, UNROLL or BLOCK_N")
    if ring > DYNAMIC_SMEM_LIMIT:
        raise ValueError(f"the cp.async ring needs {ring} bytes of shared memory per block (limit "
                         f"{DYNAMIC_SMEM_LIMIT}); lower STAGES, UNROLL, WARPS or BLOCK_N")
    return values


def check_params(dims: Dims | None = None, **params: Any) -> dict[str, Any]:
    """Validate the tile knobs; returns the full set: the family's knobs resolved for ``dims``
    (``FAMILY.resolve``: a knob not given, or an auto one at 0, from ``auto_params(dims)``) plus ``fuse_scatter``
    (default True)."""
    unknown = set(params) - set(PARAM_NAMES) - {"fuse_scatter"}
    if unknown:
        raise ValueError(f"unknown expert_centric parameter(s) {sorted(unknown)}; known: "
                         f"{[*PARAM_NAMES, 'fuse_scatter']}")
    fuse_scatter = bool(params.pop("fuse_scatter", True))
    return {**FAMILY.resolve(dims, **params), "fuse_scatter": fuse_scatter}


def _tile_knobs(params: Mapping[str, Any]) -> dict[str, int]:
    """The family's knobs of a ``check_params`` result (without fuse_scatter)."""
    return {name: params[name] for name in PARAM_NAMES}


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


def _family_workspace(dims: Dims, params: dict[str, int]) -> Workspace:
    """The family's workspace (bf16 activations, fused scatter); the quantized variants' builds pass their own."""
    return make_workspace(dims, None, **params)


def _prepare_kernels(kernels: dict[str, Any], params: dict[str, int]) -> None:
    """Once per compiled kernel set: the GEMMs opt into their cp.async ring (static + dynamic may pass 48 KiB)."""
    ring = ring_bytes(params)
    if ring:
        for name, kernel in kernels.items():
            if name.startswith("gemm"):
                kernel.max_dynamic_shared_size_bytes = ring


def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[Stage]:
    """The path as ``[(stage name, zero-argument launcher), ...]`` into ``compiled``'s workspace (which holds the
    quant mode and fuse_scatter); running them in order is one layer."""
    ws, kernels = compiled.workspace, compiled.kernels
    d, p = ws.dims, ws.params
    T, H, I, E, K = d.tokens, d.hidden, d.intermediate, d.experts, d.top_k
    P = T * K
    quant = QUANT_CODE[ws.quant]
    gx, gi = ceil_div(H, FP8_GROUP), ceil_div(I, FP8_GROUP)
    tiles, n_blocks_gu, n_blocks_dn = ws.max_tiles, ceil_div(2 * I, p["BLOCK_N"]), ceil_div(H, p["BLOCK_N"])
    gemm_threads = 32 * p["WARPS"]
    ring = ring_bytes(p)
    i32 = np.int32
    null = np.uint64(0)  # a null device pointer (8 bytes) for optional arguments

    align_k, gather_k = kernels["moe_align"], kernels["gather_rows"]
    silu_k, combine_k = kernels["silu_mul"], kernels["combine"]
    gemm_k = kernels["gemm_fp8_scaled" if ws.quant == "fp8" else "gemm_bf16"]
    out_f32 = i32(1 if out.dtype == np.float32 else 0)

    def align() -> None:
        align_k((1,), (ALIGN_THREADS,), (topk_ids, i32(P), i32(E), i32(tiles), ws.sorted_ids, ws.tile_expert,
                                         ws.meta, ws.row_of_pair), shared_mem=2 * E * 4)

    def quant_x() -> None:
        kernels["quantize_rows"]((T,), (ELEMENTWISE_THREADS,), (x, i32(H), i32(quant), i32(gx), ws.x_q,
                                                                ws.x_scale if ws.x_scale is not None else null))

    def gather() -> None:
        src = ws.x_q if quant else x
        src_scale = ws.x_scale if ws.x_scale is not None else null
        dst_scale = ws.a_scale if ws.a_scale is not None else null
        gather_k((tiles, block_m(p)), (ELEMENTWISE_THREADS,),
                 (src, src_scale, i32(gx), ws.sorted_ids, ws.meta, i32(P), i32(K), i32(H), ws.a_gate_up, dst_scale))

    def gemm(a: Any, a_scale: Any, groups: int, w: Any, n: int, kd: int, c: Any, n_blocks: int,
             split: int) -> None:
        if ws.quant == "fp8":  # W8A8: the weights' values and block scales (split: w13's gate rows), else bf16
            values, scales = (w.values, w.scales) if p["W8A8"] else (w, null)
            args = (a, a_scale, i32(groups), values, scales, i32(split), ws.tile_expert, i32(n), i32(kd), i32(E), c)
        else:
            args = (a, w, ws.tile_expert, i32(n), i32(kd), i32(E), c)
        gemm_k((tiles, n_blocks), (gemm_threads,), args, shared_mem=ring)

    def gemm_gate_up() -> None:
        gemm(ws.a_gate_up, ws.a_scale, gx, w13, 2 * I, H, ws.gate_up, n_blocks_gu, I)

    def silu_mul() -> None:
        silu_k((tiles, block_m(p)), (ELEMENTWISE_THREADS,), (ws.gate_up, ws.meta, i32(I), i32(quant), i32(gi), ws.inter,
                                                 ws.inter_scale if ws.inter_scale is not None else null))

    def gemm_down() -> None:
        gemm(ws.inter, ws.inter_scale, gi, w2, H, I, ws.down, n_blocks_dn, H)

    def scatter() -> None:
        kernels["scatter_rows"]((P,), (ELEMENTWISE_THREADS,), (ws.down, ws.row_of_pair, i32(H), ws.pair_out))

    def combine() -> None:
        if p["fuse_scatter"]:
            args = (ws.down, ws.row_of_pair, topk_weights, i32(K), i32(H), out_f32, out)
        else:
            args = (ws.pair_out, null, topk_weights, i32(K), i32(H), out_f32, out)
        combine_k((T,), (ELEMENTWISE_THREADS,), args)

    listed: list[Stage] = [("align", align)]
    if quant:
        listed.append(("quant_x", quant_x))
    listed += [("gather", gather), ("gemm_gate_up", gemm_gate_up), ("silu_mul" + ("+quant" if quant else ""), silu_mul),
               ("gemm_down", gemm_down)]
    if p["fuse_scatter"]:
        listed.append(("scatter+combine", combine))
    else:
        listed += [("scatter", scatter), ("combine", combine)]
    return listed


FAMILY = KernelFamily(
    name="expert-centric",
    source=EXPERT_CENTRIC_SOURCE,
    limits=LIMITS,
    auto_knobs=AUTO_KNOBS,
    rules=rules,
    kernel_names=lambda params: W8A8_KERNELS if params.get("W8A8") else KERNELS,
    workspace=_family_workspace,
    stages=stages,
    prepare=_prepare_kernels,
)


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
    given (or BLOCK_N, WARPS, STAGES at 0) come from :func:`auto_params` of the dims.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if isinstance(w13, Quantized) and w13.layout != "rows":
        raise ValueError(f"the expert-centric path reads row-major weights; w13 holds {w13.layout!r}-ordered values")
    fp8 = isinstance(w13, Quantized)  # fp8-block128 weights: the W8A8 design (W8A8, fp8 activations)
    if fp8 and quant != "fp8":
        raise ValueError(f"fp8-block128 weights run the W8A8 design: quant must be 'fp8', got {quant!r}")
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, weight_format=FP8_BLOCK128 if fp8 else "bf16")
    params = check_params(dims, **{"W8A8": int(fp8), **params})
    if params["W8A8"] != int(fp8):
        raise ValueError(f"W8A8 {params['W8A8']} needs {'fp8-block128' if params['W8A8'] else 'bf16'} weights")
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
    FAMILY.compile(dims, workspace=workspace, **_tile_knobs(params)).run(x, w13, w2, topk_ids, topk_weights, out)
    return out


def _builder(quant: str | None) -> Callable[..., Launch]:
    """The build of the variant for ``quant``: resolve, allocate the workspace for that mode, compile once (the
    W8A8 variant's knobs hold W8A8 1: its launch takes fp8-block128 weights)."""

    def build(dims: Dims, **params: Any) -> Launch:
        full = check_params(dims, **params)
        workspace = make_workspace(dims, quant, **full)
        compiled = FAMILY.compile(dims, workspace=workspace, **_tile_knobs(full))
        return Launch(run=compiled.run, stages=compiled.stage_list, params=full, workspace=workspace)

    return build


# sweep grids: every combination compiles for sm_90 with zero spills (tests/test_expert_centric.py checks it)
# (UNROLL=4 and fuse_scatter=False lost everywhere in the first sweep; STAGES adds the cp.async ring)
# (points with PREFETCH > 0 and STAGES >= 2, or a ring over 200 KB, are rejected by the rules: no timing)
GRID = {"BLOCK_N": [32, 64, 128], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [1, 2], "STAGES": [1, 2, 4],
        "PREFETCH": [0, 2], "fuse_scatter": [True]}
GRID_FP8 = {"BLOCK_N": [32, 64], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [1, 2], "STAGES": [1, 2, 4],
            "PREFETCH": [0, 2], "fuse_scatter": [True]}

EXPERT_CENTRIC = register(FAMILY.variant(
    "cupy:expert-centric", build=_builder(None), knobs={"fuse_scatter": True}, reference_mode="classical",
    baseline=True, grid=GRID,
    description="vLLM-style expert-centric path: align, gather, mma.sync grouped GEMMs, SiLU, scatter, combine",
))
EXPERT_CENTRIC_FP8 = register(FAMILY.variant(
    "cupy:expert-centric-fp8", build=_builder("fp8"), knobs={"fuse_scatter": True}, reference_mode="classical",
    quant="fp8", grid=GRID_FP8,
    description="expert-centric path with e4m3 activations, fp32 scale per 128 elements (bf16 weights)",
))
EXPERT_CENTRIC_W8A8 = register(FAMILY.variant(
    "cupy:expert-centric-w8a8", build=_builder("fp8"), knobs={"fuse_scatter": True, "W8A8": 1},
    reference_mode="classical", quant="fp8", weight_format=FP8_BLOCK128.name,
    grid={"BLOCK_N": [32, 64, 128], "WARPS": [4, 8], "M_TILES": [1], "UNROLL": [1, 2], "fuse_scatter": [True]},
    description="expert-centric W8A8 on fp8-block128 weights: e4m3 activations per 128 elements, e4m3 weights per "
                "128 x 128 block, each K chunk's MMA scaled by both",
))
EXPERT_CENTRIC_MXFP8 = register(FAMILY.variant(
    "cupy:expert-centric-mxfp8", build=_builder("mxfp8"), knobs={"fuse_scatter": True}, reference_mode="classical",
    quant="mxfp8", grid=GRID,
    description="expert-centric path with MXFP8 activations (power-of-two scale per 32 elements, bf16 weights)",
))
