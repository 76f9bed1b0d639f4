"""The data contract every backend shares, and the one place its inputs are checked.

    x             [T, H]      bf16     activations of the T decode tokens
    w13           [E, 2I, H]  bf16     per expert: gate rows 0..I-1, then up rows I..2I-1
                                       (vLLM's ``w1`` / Hugging Face's ``gate_up_proj`` layout)
    w2            [E, H, I]   bf16     per expert: down projection
    topk_ids      [T, K]      int32    routed experts of each token (duplicates legal: contributions add)
    topk_weights  [T, K]      float32  routing weight of each (token, slot)
    out           [T, H]      bf16 (float32 on request)

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (SiLU(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_ids[t, k]

H and I must be multiples of 8: the kernels load 16 bytes (8 bf16) per lane.

The model's own expert layer (``kernels.reference.moe_decode``'s keywords; the kernels implement the default). Two
optional bias arrays and an activation variant, all data (:mod:`kernels.activation`), never a fork of the formula:

    b13           [E, 2I]     bf16     per expert: added to gate_up = w13[e] @ x[t], in w13's row order
    b2            [E, H]      bf16     per expert: added to w2[e] @ hidden, before the routing weight
    activation    "silu" (default) | "gpt-oss" | an Activation: how gate / up sit in w13's rows and hidden = f(gate, up)

    out[t] = sum_k topk_weights[t, k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e])

so b2 is weighted by the routing weight like the rest of its expert's output, as gpt-oss's MoE does (openai/gpt-oss
gpt_oss/torch/model.py MLPBlock: ``t += mlp2_bias`` before the ``expert_weights`` einsum). Biases are bf16 because
that is what gpt-oss's checkpoints ship (MLPBlock's ``mlp1_bias`` / ``mlp2_bias`` are bfloat16, and
``kernels.gpt_oss_experts_from_checkpoint`` passes them through bit for bit); a kernel widens them exactly, as it
widens bf16 weights, and they cost (2I + H) x 2 bytes per expert beside its weights. Either may be given alone.
They are data like the weights: never inspected on the hot path; one NaN in b13[e] or b2[e] reaches only the tokens
routed to e.

Arrays may be NumPy or CuPy (all of one kind). Checks that need the *values* of ``topk_ids`` and
``topk_weights`` (ids in range, weights finite) read them back; on a GPU that is a host sync, so they are
skipped while a CUDA graph is being captured, and the kernels instead guard every expert id (an
out-of-range id makes that token's output NaN, never an illegal access).

NaN and inf. The routing (``topk_ids``, ``topk_weights``) is control data: checked, as above. Activations and
weights are data: never inspected on the hot path (that would cost a pass over them and a host sync). A NaN or inf
in them propagates IEEE-style to exactly the outputs it feeds, in every path and in the reference
(``kernels.reference.moe_decode``, every mode): one in ``x[t]`` makes ``out[t]`` non-finite and leaves every other
token's row as it would be without it; one in expert e's weights reaches only the tokens routed to e (w13's: their
whole rows; ``w2[e, h, :]``'s: their column h). In the fp8-block128 formats a weight is value x block scale, so a
non-finite weight is a non-finite scale (its whole block); e4m3fn's NaN codes (0x7F, 0xFF) are not values these
formats hold -- the tensor-core paths widen them as +-480 -- and nothing here writes them. In the 4-bit formats
(:mod:`kernels.formats_fp4`) e2m1 values are finite; a non-finite weight is a NaN scale byte (e8m0's 0xFF, e4m3's
0x7F / 0xFF: its block of one row) or nvfp4's non-finite global scale (its expert's whole matrix). The offline
constructors refuse non-finite values, a ValueError naming the matrix and where: ``kernels.quantize_weights``
(:func:`check_weights`: a block scale cannot represent them) and ``kernels.fp8_experts_from_checkpoint`` (NaN codes,
non-finite scales).

Where the names live. This module is the one place a call's inputs are checked (:func:`check_inputs`,
:func:`check_out`); it is written in the vocabulary of the modules below it, and re-exports their names so that
``from kernels.contract import ...`` is all a backend needs: the dtypes and the checks of one argument
(:mod:`kernels.arrays`), the sizes of a call (:class:`Dims`, :mod:`kernels.shapes`) and the weights' own checks
(:func:`check_weight_dims`, :func:`check_weights`: :mod:`kernels.formats`, whose formats say what w13 and w2 hold).
Those modules never import this one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.activation import ACTIVATIONS, Activation, get_activation
from kernels.arrays import (
    BF16,
    FP8_E4M3,
    array_module,
    check_aligned,
    check_array,
    check_int,
    check_xp,
    is_capturing,
    require_cupy,
)
from kernels.formats import check_weight_dims, check_weights, get_format
from kernels.shapes import Dims

__all__ = [
    "ACTIVATIONS",
    "BF16",
    "FP8_E4M3",
    "OUT_DTYPES",
    "Activation",
    "Dims",
    "array_module",
    "check_aligned",
    "check_array",
    "check_biases",
    "check_inputs",
    "check_int",
    "check_out",
    "check_out_dtype",
    "check_weight_dims",
    "check_weights",
    "check_xp",
    "get_activation",
    "is_capturing",
    "require_cupy",
]

OUT_DTYPES = (BF16, np.dtype(np.float32))


def check_inputs(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, *, check_values: bool = True,
                 weight_format: Any = "bf16", b13: Any = None, b2: Any = None) -> Dims:
    """Validate the five inputs of an MoE decode call against the contract; return their sizes.

    Raises ``TypeError`` for a wrong array kind or dtype and ``ValueError`` for a wrong shape or value,
    naming the argument and what was expected. ``check_values`` reads ``topk_ids`` / ``topk_weights``
    (skipped automatically during CUDA-graph capture). ``weight_format`` (a name or a
    ``kernels.formats.WeightFormat``) checks w13 / w2 as that format stores them; their values keep the layouts (the
    4-bit formats' two a byte along k: ``WeightFormat.matrix_shape`` gives the contract's shapes).
    ``b13`` / ``b2``, when given, are checked by :func:`check_biases` against the weights' E, 2I and H.
    """
    xp = array_module(x)
    check_array("x", x, xp, BF16, 2, "[T, H]")
    fmt = get_format(weight_format)
    w13 = fmt.check("w13", w13, xp, "[E, 2I, H]")
    w2 = fmt.check("w2", w2, xp, "[E, H, I]")
    check_array("topk_ids", topk_ids, xp, np.dtype(np.int32), 2, "[T, K]")
    check_array("topk_weights", topk_weights, xp, np.dtype(np.float32), 2, "[T, K]")

    tokens = int(x.shape[0])
    if tokens < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {tuple(x.shape)}")
    experts, hidden, intermediate = check_weight_dims(fmt.matrix_shape("w13", w13.shape),
                                                      fmt.matrix_shape("w2", w2.shape), hidden=int(x.shape[1]))
    if int(topk_ids.shape[0]) != tokens:
        raise ValueError(f"topk_ids must be [T, K] with T = {tokens} (from x), got shape {tuple(topk_ids.shape)}")
    top_k = int(topk_ids.shape[1])
    if top_k < 1:
        raise ValueError(
            f"topk_ids must route each token to at least one expert (K >= 1), got shape {tuple(topk_ids.shape)}"
        )
    if tuple(int(d) for d in topk_weights.shape) != (tokens, top_k):
        raise ValueError(
            f"topk_weights must be [T, K] = [{tokens}, {top_k}] like topk_ids, got shape {tuple(topk_weights.shape)}"
        )

    if check_values and not (xp is not np and is_capturing()):
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= experts:
            raise ValueError(f"topk_ids must lie in [0, E) = [0, {experts}), found values in [{low}, {high}]")
        if not bool(xp.isfinite(topk_weights).all()):
            raise ValueError("topk_weights must be finite, found NaN or inf")
    dims = Dims(tokens, hidden, intermediate, experts, top_k)
    check_biases(b13, b2, dims, xp)
    return dims


def check_biases(b13: Any, b2: Any, dims: Dims, xp: Any) -> None:
    """The optional expert biases against the weights' sizes: ``b13`` [E, 2I] and ``b2`` [E, H], bf16 ``xp`` arrays,
    C-contiguous (None: no bias). TypeError / ValueError name the argument and the shape expected."""
    want = {"b13": (dims.experts, 2 * dims.intermediate), "b2": (dims.experts, dims.hidden)}
    what = {"b13": "[E, 2I]", "b2": "[E, H]"}
    for name, bias in (("b13", b13), ("b2", b2)):
        if bias is None:
            continue
        check_array(name, bias, xp, BF16, 2, what[name])
        if tuple(int(d) for d in bias.shape) != want[name]:
            raise ValueError(f"{name} must be {what[name]} = {list(want[name])} to match the weights, got shape "
                             f"{tuple(bias.shape)}")


def check_out(out: Any, dims: Dims, xp: Any, name: str = "out") -> None:
    """``out`` must be a contiguous [T, H] bf16 or float32 array of the inputs' kind."""
    if array_module(out) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like x")
    if tuple(int(d) for d in out.shape) != (dims.tokens, dims.hidden):
        raise ValueError(f"{name} must be [T, H] = [{dims.tokens}, {dims.hidden}], got shape {tuple(out.shape)}")
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"{name} must have dtype bfloat16 or float32, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_out_dtype(out_dtype: Any) -> np.dtype:
    """Normalise an ``out_dtype`` argument to bf16 or float32."""
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype!r}") from None
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {dtype}")
    return dtype
