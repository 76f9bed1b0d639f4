"""Batched warp decode: kernel families that read each routed expert's weights once per batch.

Strict warp decode (``kernels.warp_decode_cupy``) streams an expert's rows once per (token, slot) routed to it; these
families group the work by expert first, keeping warp decode's output ownership and FP32 register accumulators.
One family per mechanism, each a file with its CUDA C, knobs, rules, workspace and stages:

==========================  =====================================================================================
``lists.py``                ``moe_expert_lists``: active experts, their pairs sorted by expert, the tile table
``fma.py``                  the FMA pair: gate_up and down on the CUDA cores (bitwise strict's intermediate)
``mma.py`` (``mma_cuda.py``)  the tensor-core pair: the tile table, mma.sync gate_up, balanced or grouped down + sum
``pairs.py``                the per-pair pair: the grouped path's numerics in two launches, without lists
``mma_core.py``             the tensor-core rounds both tensor-core families share
``loaders.py``              each weight format's device loader, compiled in front of a family's kernels
==========================  =====================================================================================

Each family exists once per weight format (``MMA("fp8-block128")``): the format's loader supplies how its values
are loaded, widened, addressed and scaled, so the kernels never branch on the format. :func:`warp_decode_batched`
runs a path on CuPy arrays; the registered variants (``cupy:warp-decode-batched``, ``-mma``, ``-mma-grouped``,
``-mma-pairs`` and their format twins, :data:`PATHS`) are what the bench, the sweep and the dispatch run.
"""

from __future__ import annotations

from typing import Any

from kernels.activation import CONTRACT_LAYER, ExpertLayer, expert_layer, kernel_layer
from kernels.batched import loaders_fp4  # noqa: F401 (registers the 4-bit loaders before the families are built)
from kernels.batched.common import Workspace, check_dims
from kernels.batched.fma import FMA
from kernels.batched.fma import FP8_KNOBS as FMA_FP8_KNOBS
from kernels.batched.mma import MMA, grouped_knobs
from kernels.batched.pairs import PAIRS
from kernels.contract import BF16, Dims, check_aligned, check_inputs, check_out, require_cupy
from kernels.family import KernelFamily
from kernels.formats import BF16_T16, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4, NVFP4, Quantized, format_of, get_format
from kernels.variants import Variant, register

FAMILIES = {"fma": FMA, "mma": MMA, "pairs": PAIRS}


def family(path: str, weight_format: str = "bf16", layer: ExpertLayer = CONTRACT_LAYER) -> KernelFamily:
    """The kernel family of ``path`` ("fma", "mma" or "pairs") on ``weight_format`` weights computing ``layer``
    (:func:`kernels.activation.expert_layer`; default the contract's: SiLU, no biases)."""
    if path not in FAMILIES:
        raise ValueError(f"path must be one of {sorted(FAMILIES)}, got {path!r}")
    if not isinstance(layer, ExpertLayer):
        raise TypeError(f"layer must be a kernels.activation.ExpertLayer, got {type(layer).__name__}")
    return FAMILIES[path](weight_format, layer)


def make_workspace(dims: Dims, path: str = "fma", weight_format: str = "bf16", activation: str = "silu",
                   biases: bool = False, **knobs: Any) -> Workspace:
    """The buffers ``path`` needs for ``dims`` with these knobs (CuPy, current device): the intermediate, the lists
    (not the per-pair path) and the grouped down's per-pair rows (which a layer with ``biases`` always runs)."""
    check_dims(dims)
    chosen = family(path, weight_format, kernel_layer(activation, biases))
    return chosen.workspace(dims, chosen.resolve(dims, **knobs))


def warp_decode_batched(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any = None,
                        workspace: Workspace | None = None, path: str = "fma", activation: str = "silu",
                        b13: Any = None, b2: Any = None, **knobs: Any) -> Any:
    """One MoE decode layer by batched warp decode on CuPy arrays; returns ``out`` [T, H] (bf16 unless fp32 given).

    ``path``: "fma", "mma" or "pairs" (the family, on the weights' format); ``knobs``: that family's. ``activation``
    (``kernels.activation``: "silu", "gpt-oss") and the experts' bf16 biases ``b13`` [E, 2I] / ``b2`` [E, H] (both or
    neither) make it the model's own layer, as ``reference.moe_decode`` with the same keywords computes it. With
    ``out`` and ``workspace`` (:func:`make_workspace`, same path, knobs, activation and ``biases``) nothing is
    allocated and nothing syncs with the host (value checks of ``topk_ids`` are skipped during CUDA-graph capture;
    the kernels guard every id: a bad id makes that token's output NaN).
    """
    fmt = get_format(format_of(w13))
    layer = expert_layer(activation, b13, b2)
    cupy = require_cupy(x=x, topk_ids=topk_ids, topk_weights=topk_weights,
                        **({"w13.values": w13.values} if isinstance(w13, Quantized) else {"w13": w13}),
                        **({"w2.values": w2.values} if isinstance(w2, Quantized) else {"w2": w2}),
                        **({"b13": b13, "b2": b2} if layer.bias else {}))
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, weight_format=fmt, b13=b13, b2=b2)
    if out is not None:
        require_cupy(out=out)
        check_out(out, dims, cupy)
    chosen = family(path, fmt.name, layer)
    params = chosen.resolve(dims, **knobs)  # knob errors first (no device call), then the alignment, the compile
    if workspace is not None:
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must come from kernels.batched.make_workspace(), got "
                            f"{type(workspace).__name__}")
        if not workspace.matches(dims):
            raise ValueError(f"workspace was made for {workspace.dims}, this call needs {dims}")
        if params.get("DB_GROUPED") and workspace.pair_out is None:
            raise ValueError("workspace has no per-pair rows, which the grouped down (DB_GROUPED 1) writes: make it "
                             "with make_workspace(dims, path, weight_format, **knobs) for these knobs")
        if path != "pairs" and workspace.lists is None:
            raise ValueError(f"workspace has no lists buffer, which path {path!r} needs: make it for this path")
    check_aligned(x=x, w13=w13.values if isinstance(w13, Quantized) else w13,
                  w2=w2.values if isinstance(w2, Quantized) else w2)
    compiled = chosen.compile(dims, workspace=workspace, **knobs)
    if out is None:
        out = cupy.empty((dims.tokens, dims.hidden), dtype=BF16)
    compiled.run(x, w13, w2, topk_ids, topk_weights, out, **({"b13": b13, "b2": b2} if layer.bias else {}))
    return out


# ---------------------------------------------------------------------------------------------------
# Variants: (path, knobs) per registered name, each on one weight format
# ---------------------------------------------------------------------------------------------------
PATHS: dict[str, tuple[str, dict[str, int]]] = {}


def _register(name: str, path: str, weight_format: str, knobs: dict[str, int], description: str,
              grid: dict[str, list[int]]) -> Variant:
    PATHS[name] = (path, dict(knobs))
    chosen = family(path, weight_format)
    return register(chosen.variant(name, knobs=knobs, reference_mode="warp_decode", weight_format=weight_format,
                                   description=description, grid=grid))


_FMA_GRID = {"GB_WARPS": [4, 8], "GB_OUTS": [1, 2, 4], "GB_UNROLL": [1, 2, 4], "DB_WARPS": [4, 8],
             "DB_OUTS": [2, 4, 8], "DB_UNROLL": [1, 2, 3]}
VARIANT = _register("cupy:warp-decode-batched", "fma", "bf16", {},
                    "batched warp decode: per-expert warps read each expert's weights once per batch",
                    {**_FMA_GRID, "GB_BYTES": [8, 16]})
FP8_VARIANT = _register("cupy:warp-decode-batched-fp8", "fma", FP8_BLOCK128.name, FMA_FP8_KNOBS,
                        "batched warp decode on fp8-block128 weights: e4m3fn chunks widened and scaled in registers",
                        _FMA_GRID)
FOUR_BIT_VARIANTS = {fmt.name: _register(f"cupy:warp-decode-batched-{fmt.name}", "fma", fmt.name, {},
                                         f"batched warp decode on {fmt.name} weights: 8 e2m1 values a 4-byte load, "
                                         "widened and scaled in registers", _FMA_GRID)
                     for fmt in (MXFP4, NVFP4)}
_SUFFIX = {"bf16": "", FP8_BLOCK128.name: "-fp8", BF16_T16.name: "-t16", FP8_BLOCK128_T16.name: "-fp8-t16",
           MXFP4.name: "-mxfp4", NVFP4.name: "-nvfp4"}
_ROUNDS = {"bf16": [4, 8], FP8_BLOCK128.name: [2, 4], BF16_T16.name: [4, 8], FP8_BLOCK128_T16.name: [2, 4],
           MXFP4.name: [1, 2, 4], NVFP4.name: [1, 2, 4]}
for _fmt, _suffix in _SUFFIX.items():
    _rounds = {"GB_UNROLL": _ROUNDS[_fmt], "DB_UNROLL": _ROUNDS[_fmt]}
    _register(f"cupy:warp-decode-mma{_suffix}", "mma", _fmt, {},
              f"batched warp decode on tensor cores, {_fmt} weights: mma.sync m16n8k16, bf16 in, FP32 accumulators",
              {"GB_WARPS": [2, 4, 8], **_rounds, "DB_WARPS": [4, 8, 16]})
    _register(f"cupy:warp-decode-mma-grouped{_suffix}", "mma", _fmt, grouped_knobs(get_format(_fmt)),
              f"the tensor-core path with the grouped down and the slot-order sum at every T, {_fmt} weights: "
              "batch-invariant numerics", {"GB_WARPS": [2, 4, 8], **_rounds})
    _register(f"cupy:warp-decode-mma-pairs{_suffix}", "pairs", _fmt, {},
              f"the grouped tensor-core path's numerics without lists, {_fmt} weights: a pair per gate_up block "
              "row, a token per down block", _rounds)
