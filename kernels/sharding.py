"""A MoE layer split across ranks, as data: tensor parallel (TP) and expert parallel (EP) shards of its weights.

Serving engines split a layer that does not fit one GPU (qwen3-235b-a22b bf16 is 470 GB) over the GPUs of a host; each
rank computes a partial output [T, H] and an all-reduce sums them. Here a split is data -- each rank's weights, biases
and routing -- so that every path (the reference, a kernel) runs a shard as it runs a whole layer:

``"tp"``  each rank holds a contiguous range of I for every expert: w13's gate rows and up rows of that range, w2's
          columns of it, b13 likewise; b2 on rank 0 only (zeros elsewhere), so that the sum adds it once. Ranges are
          whole units of the format's block along I (bf16: 8 values, the 16-byte loads; fp8-block128: 128; mxfp4: 32;
          nvfp4: 16) split as evenly as the units allow (I = 40 bf16 over 3 ranks: 16, 16, 8). Every neuron's
          intermediate is the unsharded one (its gate and up rows are whole); only the down's sum over I is split.
``"ep"``  each rank holds a contiguous range of experts (E = 5 over 3 ranks: 2, 2, 1) and one more, a zero expert
          (zero weights, zero biases: its output is exactly 0 under any activation); a slot routed elsewhere is routed
          to it, so that every rank runs the whole batch's [T, K] routing with no sentinel id (the kernels' contract
          turns an id outside [0, E) into NaN) and no NaN of another rank's experts can reach it. Its cost in a kernel:
          one more expert's bytes, read once a batch by the batched paths.

:func:`sharded_moe_decode` is the reference of a split layer: each shard's partial output from
``kernels.reference.moe_decode`` (float32; float64 in mode "fp64"), summed in rank order -- an all-reduce's sum -- and
rounded to bf16 once. Host arrays (NumPy); the formats whose rows the kernels read: bf16 (or float32) and the
row-major quantized formats (not the tiled ones).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.arrays import BF16
from kernels.formats import Quantized, format_of, get_format
from kernels.numerics import round_bf16

KINDS = ("tp", "ep")
# TP: I is split in whole units of these (the quantized formats': their scale blocks along I)
UNITS = {"bf16": 8, "fp8-block128": 128, "mxfp4": 32, "nvfp4": 16}


@dataclass(frozen=True)
class Shard:
    """One rank's part of a layer: its weights (the layer's format), biases (None where the layer has none) and what
    it holds -- ``inter`` [first, end) of I (TP) or ``experts`` [first, end) of E, followed by the zero expert (EP)."""

    kind: str
    rank: int
    ranks: int
    w13: Any
    w2: Any
    b13: Any = None
    b2: Any = None
    inter: tuple[int, int] | None = None
    experts: tuple[int, int] | None = None

    def route(self, topk_ids: np.ndarray, topk_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The batch's routing as this rank runs it: TP, unchanged; EP, an owned expert's local id, every other slot
        the zero expert's (the weights unchanged: the zero expert adds exactly 0)."""
        if self.kind == "tp":
            return topk_ids, topk_weights
        first, end = self.experts
        owned = (topk_ids >= first) & (topk_ids < end)
        return np.where(owned, topk_ids - first, end - first).astype(np.int32), topk_weights


def check_ranks(kind: str, ranks: Any, intermediate: int, experts: int, weight_format: str = "bf16") -> int:
    """``ranks`` if a layer of these I and E in ``weight_format`` splits ``kind`` ("tp" / "ep") over that many, else
    TypeError / ValueError naming ``ranks`` and the most it can be (TP: I's whole units of the format's block; EP: E)
    -- what :func:`shard` checks, and what a launcher checks before any rank builds its shard."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int | np.integer):
        raise TypeError(f"ranks must be an int, got {type(ranks).__name__}")
    if kind == "tp":
        if weight_format not in UNITS:
            raise ValueError(f"TP splits {', '.join(UNITS)} weights along I, not {weight_format}")
        unit = UNITS[weight_format]
        most = -(-intermediate // unit)
        what = f"I = {intermediate} holds {most} whole units of {unit} values ({weight_format})"
    else:
        most, what = experts, f"E = {experts} experts, at least one a rank"
    if not 1 <= ranks <= most:
        raise ValueError(f"ranks must be 1..{most} ({what}), got {ranks}")
    return int(ranks)


def _ranges(units: int, ranks: int) -> list[tuple[int, int]]:
    """``units`` split into ``ranks`` contiguous ranges as evenly as they go (the first ones one larger)."""
    base, extra = divmod(units, ranks)
    bounds = np.cumsum([0] + [base + (r < extra) for r in range(ranks)])
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(ranks)]


def _layer_format(w13: Any, w2: Any) -> Any:
    fmt = get_format(format_of(w13))
    if fmt.tiled:
        raise ValueError(f"{fmt.name} weights are tiled: shard their row-major format and tile each shard")
    if format_of(w2) != fmt.name:
        raise ValueError(f"w13 holds {fmt.name} weights, w2 {format_of(w2)}: a layer's matrices share one format")
    return fmt


def _tp_w13(w13: Any, fmt: Any, inter: int, i0: int, i1: int) -> Any:
    """w13's gate rows i0 .. i1 - 1 and their up rows, with their scales."""
    if not isinstance(w13, Quantized):
        return np.concatenate([w13[:, i0:i1], w13[:, inter + i0:inter + i1]], axis=1)
    values = np.concatenate([w13.values[:, i0:i1], w13.values[:, inter + i0:inter + i1]], axis=1)
    if fmt.name == "fp8-block128":  # gate's block rows, then up's: blocks of 128 rows
        half, unit = w13.scales.shape[1] // 2, UNITS[fmt.name]
        b0, b1 = i0 // unit, -(-i1 // unit)
        scales = np.concatenate([w13.scales[:, b0:b1], w13.scales[:, half + b0:half + b1]], axis=1)
    else:  # a row of blocks per weight row
        scales = np.concatenate([w13.scales[:, i0:i1], w13.scales[:, inter + i0:inter + i1]], axis=1)
    return dataclasses.replace(w13, values=values, scales=scales)


def _tp_w2(w2: Any, fmt: Any, i0: int, i1: int) -> Any:
    """w2's columns i0 .. i1 - 1 (I), with their scales."""
    if not isinstance(w2, Quantized):
        return np.ascontiguousarray(w2[:, :, i0:i1])
    per_byte, block = round(1 / fmt.value_bytes), UNITS[fmt.name]  # values a stored byte; a scale block along I
    return dataclasses.replace(w2, values=np.ascontiguousarray(w2.values[:, :, i0 // per_byte:i1 // per_byte]),
                               scales=np.ascontiguousarray(w2.scales[:, :, i0 // block:-(-i1 // block)]))


def shard_tp(w13: Any, w2: Any, ranks: int, b13: Any = None, b2: Any = None) -> list[Shard]:
    """The layer's TP shards over ``ranks`` (module docstring): ValueError where I has fewer whole units of its
    format's block than ranks."""
    fmt = _layer_format(w13, w2)
    experts, two_i, _ = (int(d) for d in fmt.matrix_shape("w13", tuple(_values(w13).shape)))
    inter, unit = two_i // 2, UNITS[fmt.name]
    units = -(-inter // unit)
    ranks = check_ranks("tp", ranks, inter, experts, fmt.name)  # (at most `units`)
    shards = []
    for rank, (u0, u1) in enumerate(_ranges(units, ranks)):
        i0, i1 = u0 * unit, min(u1 * unit, inter)
        bias13 = None if b13 is None else np.concatenate([b13[:, i0:i1], b13[:, inter + i0:inter + i1]], axis=1)
        bias2 = None if b2 is None else (b2 if rank == 0 else np.zeros_like(b2))
        shards.append(Shard("tp", rank, ranks, _tp_w13(w13, fmt, inter, i0, i1), _tp_w2(w2, fmt, i0, i1), bias13,
                            bias2, inter=(i0, i1)))
    return shards


def _values(w: Any) -> Any:
    return w.values if isinstance(w, Quantized) else w


def _with_zero_expert(w13: Any, w2: Any, fmt: Any, e0: int, e1: int) -> tuple[Any, Any]:
    """Experts e0 .. e1 - 1 of the layer and a zero expert after them, in the layer's format."""
    if not isinstance(w13, Quantized):
        return (np.concatenate([w13[e0:e1], np.zeros_like(w13[:1])]),
                np.concatenate([w2[e0:e1], np.zeros_like(w2[:1])]))
    _, two_i, hidden = fmt.matrix_shape("w13", tuple(w13.values.shape))
    zero13, zero2 = fmt.quantize(np.zeros((1, two_i, hidden), np.float32),
                                 np.zeros((1, hidden, two_i // 2), np.float32))
    out = []
    for w, zero in ((w13, zero13), (w2, zero2)):
        glob = None if w.global_scale is None else np.concatenate([w.global_scale[e0:e1], zero.global_scale])
        out.append(dataclasses.replace(w, values=np.concatenate([w.values[e0:e1], zero.values]),
                                       scales=np.concatenate([w.scales[e0:e1], zero.scales]), global_scale=glob))
    return out[0], out[1]


def shard_ep(w13: Any, w2: Any, ranks: int, b13: Any = None, b2: Any = None) -> list[Shard]:
    """The layer's EP shards over ``ranks`` (module docstring): ValueError where E < ranks."""
    fmt = _layer_format(w13, w2)
    experts = int(_values(w13).shape[0])
    ranks = check_ranks("ep", ranks, 0, experts, fmt.name)
    shards = []
    for rank, (e0, e1) in enumerate(_ranges(experts, ranks)):
        s13, s2 = _with_zero_expert(w13, w2, fmt, e0, e1)
        bias13 = None if b13 is None else np.concatenate([b13[e0:e1], np.zeros_like(b13[:1])])
        bias2 = None if b2 is None else np.concatenate([b2[e0:e1], np.zeros_like(b2[:1])])
        shards.append(Shard("ep", rank, ranks, s13, s2, bias13, bias2, experts=(e0, e1)))
    return shards


def shard(w13: Any, w2: Any, kind: str, ranks: int, b13: Any = None, b2: Any = None) -> list[Shard]:
    """:func:`shard_tp` or :func:`shard_ep` by ``kind`` ("tp" / "ep")."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return (shard_tp if kind == "tp" else shard_ep)(w13, w2, ranks, b13, b2)


def sharded_moe_decode(x: np.ndarray, shards: list[Shard], topk_ids: np.ndarray, topk_weights: np.ndarray,
                       mode: str = "warp_decode", activation: Any = "silu", out_dtype: Any = None) -> np.ndarray:
    """The split layer's output: each shard's partial (``reference.moe_decode`` in ``mode``, float32 -- float64 in
    "fp64" -- on its weights, biases and routing), summed in rank order, then rounded once (bf16 unless
    ``out_dtype``; "fp64": float64)."""
    from kernels.reference import moe_decode

    if not shards or not all(isinstance(s, Shard) for s in shards):
        raise TypeError("shards must be a non-empty list of kernels.sharding.Shard (shard_tp / shard_ep)")
    if [s.rank for s in shards] != list(range(shards[0].ranks)) or len({(s.kind, s.ranks) for s in shards}) != 1:
        raise ValueError("shards must be one split's ranks 0 .. ranks - 1, in order")
    if shards[0].kind == "ep":  # an id no rank owns would be dropped, where the whole layer refuses it
        experts = shards[-1].experts[1]
        ids = np.asarray(topk_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= experts):
            raise ValueError(f"topk_ids must be in [0, {experts}) (the split layer's E), got values from {ids.min()} "
                             f"to {ids.max()}")
    partial_dtype = np.float64 if mode == "fp64" else np.float32
    total = None
    for s in shards:
        ids, weights = s.route(np.asarray(topk_ids), np.asarray(topk_weights))
        part = moe_decode(x, s.w13, s.w2, ids, weights, mode=mode, activation=activation, b13=s.b13, b2=s.b2,
                          out_dtype=partial_dtype)
        total = part if total is None else total + part
    if mode == "fp64":
        return total if out_dtype is None else total.astype(out_dtype)
    if out_dtype is None or np.dtype(out_dtype) == BF16:
        return round_bf16(total)
    return total.astype(out_dtype)

