"""The NumPy reference: what one MoE decode layer computes, in three numerical flavours.

    out[t] = sum_k  topk_weights[t, k] * w2[e] @ (SiLU(gate) * up),   e = topk_ids[t, k]
    gate   = w13[e, :I] @ x[t],   up = w13[e, I:] @ x[t]

and the model's own layer when asked (``activation=``, ``b13=``, ``b2=``: kernels/contract.py, kernels/activation.py)::

    out[t] = sum_k  topk_weights[t, k] * (w2[e] @ act(gate, up) + b2[e])
    (gate, up) = act.split(w13[e] @ x[t] + b13[e])

(gpt-oss: ``activation="gpt-oss"``, its interleaved rows and clamped SwiGLU). Every mode adds a bias where the dot
product it follows ends: to the fp64 sum, to the fp32 sum (warp_decode: one fp32 add after the dot product, before the
activation / the routing weight), or in the GEMM's epilogue before its bf16 store (classical).

Modes (all read the same inputs; weights in any registered format, read from the weights as ``kernels.moe_decode``
reads it, one expert at a time through it):

``"fp64"``         the oracle: every product and sum in float64, no rounding until the caller's.
``"warp_decode"``  what warp decode promises: both dot products accumulated in fp32, SiLU(g)*u rounded
                   once to bf16 (the [T, K, I] intermediate, the only one), the down dot products and the
                   routing-weighted sum over K accumulated in fp32, one bf16 rounding of the output.
``"classical"``    the expert-centric path: gate/up GEMM outputs stored as bf16, the activation stored as
                   bf16, each expert's down output stored as bf16 (the per-expert output buffer), then the
                   fp32 weighted combine and a bf16 output. ``quant`` quantizes each GEMM's input
                   activation as production FP8 paths do (x before gate/up, the intermediate before down):
                   ``"fp8"`` = e4m3 with one fp32 scale per 128 elements of a token, ``"mxfp8"`` = e4m3
                   with a power-of-two scale per 32 elements.

The work is grouped by expert (one NumPy GEMM per touched expert), so there is no Python loop over
tokens x slots; duplicate ids within a token are two pairs and simply add.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.activation import get_activation
from kernels.contract import BF16, check_inputs
from kernels.numerics import QUANT_MODES, bf16_to_f32, quantize, round_bf16, through_bf16

MODES = ("fp64", "warp_decode", "classical")


def _host(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr


def matmul_bf16_t(activations: np.ndarray, weight: np.ndarray, acc: type) -> np.ndarray:
    """``activations @ weight.T`` for a bf16 (or float32: a dequantized format's) ``weight`` [N, D], widened to
    ``acc`` a row block at a time.

    Widening the whole matrix first (bf16 -> f32 -> f64) streams it through memory three times; a block
    of rows stays in cache, which makes the fp64 oracle about 3x faster at real model sizes.
    """
    rows = max(8, (1 << 19) // max(1, weight.shape[1]))  # ~2 MB of uint32 per block
    out = np.empty((activations.shape[0], weight.shape[0]), acc)
    if weight.dtype == np.float32:
        for start in range(0, weight.shape[0], rows):
            out[:, start : start + rows] = activations @ weight[start : start + rows].astype(acc, copy=False).T
        return out
    bits = np.ascontiguousarray(weight).view(np.uint16)
    widened = np.empty((min(rows, weight.shape[0]), weight.shape[1]), np.uint32)
    for start in range(0, weight.shape[0], rows):
        block = bits[start : start + rows]
        n = block.shape[0]
        np.left_shift(block, 16, out=widened[:n], dtype=np.uint32)  # exact bf16 -> f32
        out[:, start : start + n] = activations @ widened[:n].view(np.float32).astype(acc, copy=False).T
    return out


def expert_groups(topk_ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(expert, pair indices into the flattened [T*K] routing), ...]`` for every touched expert."""
    flat = topk_ids.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    return [(int(e), order[s : s + c]) for e, s, c in zip(experts, starts, counts, strict=True)]


def weights_format(w13: Any, weight_format: Any = None) -> Any:
    """The ``WeightFormat`` to read ``w13`` (and w2) through: the one it is in (``kernels.formats.format_of``), or
    ``weight_format`` when given -- a ValueError naming both unless w13 is in it (``WeightFormat.stores``)."""
    from kernels.formats import Quantized, format_of, get_format

    if weight_format is None:
        return get_format(format_of(w13))
    fmt = get_format(weight_format)
    if fmt.stores(w13):
        return fmt
    if isinstance(w13, Quantized):
        held = (f"{w13.layout!r}-ordered values {'with' if w13.scales is not None else 'without'} scales"
                + (" and a global scale" if w13.global_scale is not None else ""))
        try:
            held = f"{format_of(w13)} weights ({held})"
        except ValueError:
            pass
    else:
        held = f"a plain {type(w13).__name__} (bf16 weights)"
    want = (f"{getattr(fmt, 'layout', 'rows')!r}-ordered values {'with' if fmt.scaled else 'without'} scales"
            + (" and a global scale" if fmt.global_scaled else "") if fmt.name != "bf16" else "a plain array")
    raise ValueError(f"weight_format {fmt.name!r} disagrees with the weights: w13 holds {held}, {fmt.name} weights "
                     f"are {want} (leave weight_format out: the format is read from the weights)")


def moe_decode(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    mode: str = "fp64",
    quant: str | None = None,
    out_dtype: Any = None,
    weight_format: Any = None,
    *,
    activation: Any = "silu",
    b13: Any = None,
    b2: Any = None,
) -> np.ndarray:
    """One MoE decode layer on the host. Returns [T, H]: float64 for ``"fp64"``, else bf16.

    ``out_dtype=np.float32`` returns the fp32 accumulator before its final bf16 rounding (not for fp64).
    The weights' format (``kernels.formats``) is read from w13 as ``kernels.moe_decode`` reads it (``format_of``);
    ``weight_format`` (a name or a ``WeightFormat``, e.g. one no registry holds) names it instead, and a format w13
    is not in is a ValueError naming both. Each touched expert is read through it.
    ``quant`` quantizes activations only (mode ``"classical"``). CuPy inputs are copied to the host first.
    ``activation`` (a name in ``kernels.activation.ACTIVATIONS`` or an ``Activation``) says how gate and up sit in
    w13's rows and what the activation is; ``b13`` [E, 2I] / ``b2`` [E, H] (bf16, None: none) are the experts'
    biases (kernels/contract.py). The defaults are the contract's layer, which the kernels compute.
    A NaN or inf in x or the weights reaches exactly the outputs it feeds, as in the kernels (kernels/contract.py);
    a clamped activation (gpt-oss's) makes an inf it clamps finite.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if quant is not None and mode != "classical":
        raise ValueError(f"quant={quant!r} applies to mode='classical' only, got mode={mode!r}")
    act = get_activation(activation)
    fmt = weights_format(w13, weight_format)
    x, topk_ids, topk_weights = (_host(a) for a in (x, topk_ids, topk_weights))
    b13, b2 = (None if b is None else _host(b) for b in (b13, b2))
    w13, w2 = fmt.host(w13), fmt.host(w2)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, weight_format=fmt, b13=b13, b2=b2)
    T, H, K = dims.tokens, dims.hidden, dims.top_k

    if mode == "fp64":
        acc = np.float64
        out_dtype = np.dtype(np.float64) if out_dtype is None else np.dtype(out_dtype)
    else:
        acc = np.float32
        out_dtype = BF16 if out_dtype is None else np.dtype(out_dtype)
        if out_dtype not in (BF16, np.dtype(np.float32)):
            raise TypeError(f"out_dtype must be bfloat16 or float32 for mode {mode!r}, got {out_dtype}")

    # NaN / inf in x or the weights propagate to the outputs they feed (kernels/contract.py); NumPy would warn
    # at each inf - inf, 0 * inf or inf / inf they meet on the way
    with np.errstate(invalid="ignore"):
        activations = bf16_to_f32(x)
        if mode == "classical":
            activations = quantize(activations, quant)
        activations = activations.astype(acc)

        # the biases widened exactly (bf16 -> f32 -> the accumulator's type), added once where their dot products end
        bias13, bias2 = (None if b is None else bf16_to_f32(b).astype(acc) for b in (b13, b2))
        per_pair = np.empty((T * K, H), acc)  # each (token, slot)'s expert output, before the routing weight
        for expert, pairs in expert_groups(topk_ids):
            tokens_of_pairs = pairs // K
            gate_up = matmul_bf16_t(activations[tokens_of_pairs], fmt.expert(w13, expert, "w13"), acc)  # [n, 2I]
            if bias13 is not None:
                gate_up += bias13[expert]
            if mode == "classical":  # every GEMM output and the activation pass through bf16 buffers
                gate_up = through_bf16(gate_up)
            hidden = act(*act.split(gate_up))
            if mode == "warp_decode":
                hidden = through_bf16(hidden)
            elif mode == "classical":
                hidden = quantize(through_bf16(hidden), quant)
            down = matmul_bf16_t(hidden.astype(acc, copy=False), fmt.expert(w2, expert, "w2"), acc)  # [n, H]
            if bias2 is not None:
                down += bias2[expert]
            per_pair[pairs] = through_bf16(down) if mode == "classical" else down

        per_pair = per_pair.reshape(T, K, H)
        weights = topk_weights.astype(acc)
        out = np.zeros((T, H), acc)
        for k in range(K):  # the kernels' order: one accumulator, slots in order
            out += weights[:, k, None] * per_pair[:, k]
    if out_dtype == BF16:
        return round_bf16(out)
    return out.astype(out_dtype)


def expert_ffn(x: np.ndarray, w13_e: np.ndarray, w2_e: np.ndarray, activation: Any = "silu",
               b13_e: np.ndarray | None = None, b2_e: np.ndarray | None = None) -> np.ndarray:
    """One expert's FFN on [T, H] bf16 tokens in float64: w2_e @ act(w13_e @ x + b13_e) + b2_e (the biases bf16,
    optional; SiLU(gate) * up by default). For tests."""
    act = get_activation(activation)
    xs = bf16_to_f32(x).astype(np.float64)
    gate_up = xs @ bf16_to_f32(w13_e).astype(np.float64).T
    if b13_e is not None:
        gate_up = gate_up + bf16_to_f32(b13_e).astype(np.float64)
    out = act.apply(gate_up) @ bf16_to_f32(w2_e).astype(np.float64).T
    return out if b2_e is None else out + bf16_to_f32(b2_e).astype(np.float64)
