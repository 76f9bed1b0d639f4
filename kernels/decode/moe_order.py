"""The strict warp-decode MoE (``kernels/warp_decode_cupy.py``, variant "cupy:warp-decode") in its own FP32 order.

:func:`strict_moe_chain` runs the two kernels' float32 operations in their order, in NumPy, for the knobs the strict
family resolves for the call's dims (``resolve_params``; ``params`` overrides some), so that the reference decode
step's bf16 mode gives the step's MoE bit for bit:

* gate_up, per (token, slot) pair and neuron: lane l takes the GU_BYTES / 2-element chunks l, l + 32, ... of the gate
  row, the up row and x[t] in rounds of 32 * GU_UNROLL chunks (chunks past H: zero loads, +0 products); at each
  round's start the warp's first neuron's gate accumulator gets ``+= 0.0f`` (``all_loads_arrived``); ``fmaf`` per
  element in order (exact bf16 products: an add); the butterfly; ``silu = g / (1 + exp(-g))`` in float32 and the one
  bf16 rounding of ``silu * u``.
* down, per token and hidden unit: the slots in batches of DN_SLOTS, each batch's chunks (DN_BYTES / 2 elements of
  I) in rounds of 32 * DN_UNROLL; a round (after ``acc += 0.0f`` on the warp's first output when DN_EARLY_INTER)
  takes, slot by slot of the batch and chunk by chunk, ``a = weight_k * inter`` (float32, rounded) and ``acc =
  fmaf(w2, a, acc)`` per element; slots past K and chunks past I add +0 products; the butterfly; the bf16 output.

Not reproduced: CUDA's ``expf`` in SiLU (at most 2 ulp from e^x, its own rounding). Here e^-g is float64's exp
rounded to float32 (glibc's ``expf`` in the g++ emulation agrees but for rare near-ties); where CUDA's differs by an
ulp the quotient may move an ulp, and the bf16 intermediate flips where it lies that close to a bf16 tie
(~2^-15 of values, an estimate). ``fmaf`` of the down
kernel (bf16 x float32: not exact in float32) is emulated exactly (:func:`kernels.numerics.fma_f32`: the float64 sum
corrected where it is a float32 tie). Bitwise for bf16 weights; float32 weights (a dequantized format's) take the
same order without a promise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.contract import Dims
from kernels.numerics import LANES, as_f32, fma_f32, lane_chunks, round_bf16, warp_sum


def silu_f32(g: np.ndarray) -> np.ndarray:
    """``g / (1.0f + expf(-g))`` in float32, e^-g as float64's exp rounded to float32 (module docstring)."""
    g = np.asarray(g, np.float32)
    with np.errstate(over="ignore"):
        e = np.exp(-g.astype(np.float64)).astype(np.float32)
    return g / (np.float32(1.0) + e)


def strict_params(dims: Dims, params: dict[str, int] | None = None) -> dict[str, int]:
    """The strict family's knobs at ``dims`` (auto knobs filled), ``params`` overriding."""
    from kernels.warp_decode_cupy import resolve_params

    return resolve_params(dims, **(params or {}))


def strict_gate_up(x: np.ndarray, w13: Any, topk_ids: np.ndarray, params: dict[str, int]) -> np.ndarray:
    """The intermediate [T, K, I] bf16 of ``moe_gate_up_3d_batched`` (resolved ``params``): each expert's rows once,
    for the pairs routed to it (every pair's sums are its own)."""
    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    elems, unroll, outs = params["GU_BYTES"] // 2, params["GU_UNROLL"], params["GU_OUTS"]
    chunks = w13.shape[2] // elems
    xc = lane_chunks(as_f32(x), elems, unroll)  # [T, R, U, 32, e]
    first = np.zeros(2 * inter, bool)
    first[:inter:outs] = True  # gate_acc[0]: each warp's first neuron's gate accumulator
    sums = np.empty((tokens * top_k, 2 * inter), np.float32)
    flat = topk_ids.reshape(-1)
    for expert in np.unique(flat):
        pairs = np.flatnonzero(flat == expert)
        wc = lane_chunks(as_f32(w13[expert]), elems, unroll)[None]  # [1, 2I, R, U, 32, e]: gate rows, up rows
        xs = xc[pairs // top_k][:, None]  # [n, 1, R, U, 32, e]
        acc = np.zeros((len(pairs), 2 * inter, LANES), np.float32)
        for r in range(wc.shape[2]):
            acc[:, first] = acc[:, first] + np.float32(0.0)
            for j in range(unroll):
                if (r * unroll + j) * LANES >= chunks:  # every lane's chunk past H: +0 products, as one + 0.0f
                    acc = acc + np.float32(0.0)
                    break
                for e in range(elems):
                    acc = acc + wc[:, :, r, j, :, e] * xs[:, :, r, j, :, e]
        sums[pairs] = warp_sum(acc)
    gate, up = sums[:, :inter], sums[:, inter:]
    return round_bf16(silu_f32(gate) * up).reshape(tokens, top_k, inter)


def strict_down(intermediate: np.ndarray, w2: Any, topk_ids: np.ndarray, topk_weights: np.ndarray,
                params: dict[str, int]) -> np.ndarray:
    """``moe_down_3d_batched``'s FP32 sums [T, H] (before the output's rounding), resolved ``params``."""
    tokens, top_k, inter = intermediate.shape
    hidden = w2.shape[1]
    elems, unroll, slots = params["DN_BYTES"] // 2, params["DN_UNROLL"], params["DN_SLOTS"]
    batches = -(-top_k // slots)
    padded_k = batches * slots
    ids = np.zeros((tokens, padded_k), np.int64)
    ids[:, :top_k] = topk_ids
    live = np.arange(padded_k) < top_k
    weights = np.zeros((tokens, padded_k), np.float32)
    weights[:, :top_k] = topk_weights
    rows = lane_chunks(as_f32(w2[ids]), elems, unroll)  # [T, Kp, H, R, U, 32, e]
    rows[:, ~live] = 0.0  # past-K slots: masked (zero) loads
    ic = np.zeros((tokens, padded_k, inter), np.float32)
    ic[:, :top_k] = as_f32(intermediate)
    ic = lane_chunks(ic, elems, unroll)  # [T, Kp, R, U, 32, e]
    acc = np.zeros((tokens, hidden, LANES), np.float32)
    first = np.zeros(hidden, bool)
    first[:: params["DN_OUTS"]] = True  # acc[0]: each warp's first output
    for b in range(batches):
        for r in range(rows.shape[3]):
            if params["DN_EARLY_INTER"]:
                acc[:, first] = acc[:, first] + np.float32(0.0)
            for s in range(b * slots, (b + 1) * slots):
                for j in range(unroll):
                    for e in range(elems):
                        a = weights[:, s, None] * ic[:, s, r, j, :, e]  # [T, 32] weight_k * inter, rounded
                        acc = fma_f32(rows[:, s, :, r, j, :, e], a[:, None, :], acc)
    return warp_sum(acc)


def strict_moe_chain(x: np.ndarray, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
                     params: dict[str, int] | None = None, out_dtype: Any = None) -> np.ndarray:
    """One MoE layer in the strict kernels' order: x [T, H] bf16, w13 [E, 2I, H], w2 [E, H, I] (bf16, or float32
    dequantized weights), topk_ids [T, K] (ids in [0, E)), topk_weights [T, K] float32 -> out [T, H] bf16 (or the
    float32 sums with ``out_dtype=np.float32``). ``params``: knobs overriding the strict family's resolved ones."""
    x, topk_ids = np.asarray(x), np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights, np.float32)
    if x.ndim != 2 or topk_ids.ndim != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x [T, H], topk_ids and topk_weights [T, K] expected, got {x.shape}, {topk_ids.shape}, "
                         f"{topk_weights.shape}")
    experts, two_i, hidden = w13.shape
    if hidden != x.shape[1] or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] must agree with x's H = {x.shape[1]}, got {w13.shape} "
                         f"and {w2.shape}")
    if topk_ids.min() < 0 or topk_ids.max() >= experts:
        raise ValueError(f"topk_ids must lie in [0, E) = [0, {experts}), found [{topk_ids.min()}, {topk_ids.max()}]")
    dims = Dims(x.shape[0], hidden, two_i // 2, experts, topk_ids.shape[1])
    resolved = strict_params(dims, params)
    intermediate = strict_gate_up(x, w13, topk_ids, resolved)
    sums = strict_down(intermediate, w2, topk_ids, topk_weights, resolved)
    return sums if out_dtype is not None and np.dtype(out_dtype) == np.float32 else round_bf16(sums)
