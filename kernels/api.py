"""Public GPU entry points. Each dispatches to its backend module, imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS = {"cupy": "kernels.warp_decode_cupy", "numba": "kernels.warp_decode_numba"}
# the same strict kernels on fp8-block128 weights (``kernels.quantize_weights``): each backend's ``warp_decode_fp8``
FP8_BACKENDS = {"cupy": "kernels.warp_decode_fp8", "numba": "kernels.warp_decode_numba_fp8"}


def warp_decode(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    backend: str = "cupy",
    out: Any = None,
    workspace: Any = None,
    **params: Any,
) -> Any:
    """One MoE decode layer by warp decode: ``moe_gate_up_3d_batched`` then ``moe_down_3d_batched``.

    Inputs follow :mod:`kernels.contract`; returns ``out`` [T, H] (bf16 unless ``out`` is float32) on the
    GPU. With ``out`` and ``workspace`` given the call allocates nothing and never syncs with the host
    (CUDA-graph capturable). ``params`` are the backend's compile-time knobs. fp8-block128 weights
    (``kernels.quantize_weights``) run the backend's strict FP8 kernels (bf16 activations, FP32 accumulation).
    """
    from kernels.formats import Quantized, format_of, get_format

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if get_format(format_of(w13)).tiled:
        raise ValueError(f"strict warp decode reads row-major weights; w13 is {format_of(w13)} (tiles: run "
                         "kernels.moe_decode, whose tensor-core paths read them)")
    if format_of(w13) not in ("bf16", "fp8-block128"):
        raise ValueError(f"no strict warp decode kernel reads {format_of(w13)} weights yet (kernels.reference."
                         "moe_decode does)")
    if isinstance(w13, Quantized) or isinstance(w2, Quantized):
        fp8 = importlib.import_module(FP8_BACKENDS[backend])
        return fp8.warp_decode_fp8(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace, **params)
    module = importlib.import_module(BACKENDS[backend])
    return module.warp_decode(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace, **params)


def expert_centric(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    quant: str | None = None,
    out: Any = None,
    workspace: Any = None,
    **params: Any,
) -> Any:
    """The conventional expert-centric decode path (align, gather, [quant], GEMM, SiLU, GEMM, scatter, combine)."""
    module = importlib.import_module("kernels.expert_centric_path")
    return module.expert_centric(
        x, w13, w2, topk_ids, topk_weights, quant=quant, out=out, workspace=workspace, **params
    )


def moe_decode(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    out: Any = None,
    workspace: Any = None,
    policy: str = "fastest",
    activation: str = "silu",
    b13: Any = None,
    b2: Any = None,
) -> Any:
    """The path for (shape, T) on this GPU with the least worst slowdown over uniform and Zipf routing, from the
    committed table measured on this GPU (it cannot see the routing when it picks), else a documented heuristic
    (:mod:`kernels.dispatch`). ``policy="fastest"``: strict warp decode, batched warp decode (FMA, mixed or
    tensor-core MMA) or the expert-centric path; ``policy="warp_decode"``: the warp-decode paths only (warp
    decode's numerics); ``policy="batch_invariant"``: a token's output bitwise the same whatever batch it rides in
    (the tensor-core path's grouped numerics at every T). fp8-block128 weights (``kernels.quantize_weights``) run
    the FP8 paths, fp8-block128-t16 (bf16-t16) weights the tensor-core FP8 (bf16) paths on tiles, mxfp4 / nvfp4
    weights their 4-bit paths. ``activation`` and the biases ``b13`` / ``b2`` give the model's own layer (gpt-oss's:
    ``activation="gpt-oss"``), on the batched paths. ``workspace``: ``kernels.dispatch.make_workspace(dims,
    policy=policy, weight_format=..., activation=..., biases=...)``. Never syncs inside a graph."""
    module = importlib.import_module("kernels.dispatch")
    return module.moe_decode(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace, policy=policy,
                             activation=activation, b13=b13, b2=b2)
