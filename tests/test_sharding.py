"""A layer split across ranks as data (kernels/sharding.py): TP and EP shards, and the reference of a split layer.

On the CPU, at odd shapes -- I not a multiple of the ranks (bf16 I = 40: units of 8 over 3 ranks), E not a multiple
of them, a rank with no routed expert -- bf16, fp8-block128, mxfp4 and nvfp4 weights, gpt-oss's biases: the shards
hold exactly the layer's slices; in fp64 the sum of the shards' partials is the whole layer's output (to fp64
rounding); in warp decode's numerics the split layer keeps TP's intermediate bitwise and stays within the bf16
tolerance of the whole layer; bad rank counts and bad routing are refused, naming the argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kernels.formats import get_format, quantize_weights
from kernels.numerics import bf16_to_f32, rel_l2
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape, get_shape
from kernels.sharding import Shard, shard, shard_ep, shard_tp, sharded_moe_decode
from tests.warp_checks import _assert_matches

ODD = MoEShape("h48-i40-e5", 48, 40, 5, 2)  # I = 40: 5 units of 8; E = 5
OSS = get_shape("tiny").with_(name="oss-96", hidden=64, intermediate=96, experts=5, top_k=2, activation="gpt-oss",
                              bias=True)


def _problem(shape: Any = ODD, tokens: int = 6, routing: Any = "uniform", weight_format: str = "bf16",
             seed: int = 3) -> Any:
    p = make_problem(shape, tokens, seed=seed, routing=routing)
    if weight_format != "bf16":
        q13, q2 = quantize_weights(p.w13, p.w2, weight_format)
        p = dataclasses.replace(p, w13=q13, w2=q2)
    return p


def _dense(w: Any, matrix: str) -> np.ndarray:
    from kernels.formats import format_of

    return np.asarray(get_format(format_of(w)).dequantize(w, matrix), np.float64) if not isinstance(
        w, np.ndarray) else bf16_to_f32(w).astype(np.float64)


def test_tp_shards_are_the_layers_slices() -> None:
    """I = 40 over 3 ranks: 16, 16, 8 (whole units of 8); each shard's w13 is its gate rows then its up rows, w2 its
    columns; b13 sliced, b2 on rank 0 only; 5 ranks (one unit each) works, 6 is refused."""
    p = _problem(OSS.with_(intermediate=40))
    shards = shard_tp(p.w13, p.w2, 3, p.b13, p.b2)
    assert [s.inter for s in shards] == [(0, 16), (16, 32), (32, 40)]
    for s in shards:
        i0, i1 = s.inter
        assert np.array_equal(s.w13, np.concatenate([p.w13[:, i0:i1], p.w13[:, 40 + i0:40 + i1]], axis=1))
        assert np.array_equal(s.w2, p.w2[:, :, i0:i1])
        assert np.array_equal(s.b13, np.concatenate([p.b13[:, i0:i1], p.b13[:, 40 + i0:40 + i1]], axis=1))
        assert np.array_equal(s.b2, p.b2 if s.rank == 0 else np.zeros_like(p.b2))
    assert [s.inter for s in shard_tp(p.w13, p.w2, 5)] == [(8 * r, 8 * r + 8) for r in range(5)]
    with pytest.raises(ValueError, match=r"ranks must be 1\.\.5 \(I = 40 holds 5 whole units of 8 values"):
        shard_tp(p.w13, p.w2, 6)


def test_ep_shards_hold_their_experts_and_a_zero_one() -> None:
    """E = 5 over 3 ranks: 2, 2, 1 experts, each shard one zero expert after them; the routing maps an owned id to
    its local one and every other slot to the zero expert."""
    p = _problem()
    shards = shard_ep(p.w13, p.w2, 3)
    assert [s.experts for s in shards] == [(0, 2), (2, 4), (4, 5)]
    for s in shards:
        e0, e1 = s.experts
        assert np.array_equal(s.w13[:-1], p.w13[e0:e1]) and not np.any(s.w13[-1].astype(np.float32))
        ids, weights = s.route(p.topk_ids, p.topk_weights)
        owned = (p.topk_ids >= e0) & (p.topk_ids < e1)
        assert np.array_equal(ids[owned], p.topk_ids[owned] - e0) and np.all(ids[~owned] == e1 - e0)
        assert weights is p.topk_weights
    with pytest.raises(ValueError, match=r"ranks must be 1\.\.5 \(E = 5 experts"):
        shard_ep(p.w13, p.w2, 6)


CASES = [  # (kind, ranks, shape, weight format, routing)
    ("tp", 3, ODD, "bf16", "uniform"),
    ("tp", 2, OSS, "bf16", "zipf"),
    ("tp", 3, OSS, "mxfp4", "uniform"),   # I = 96: 3 units of 32
    ("tp", 4, OSS.with_(intermediate=64), "nvfp4", "zipf"),
    ("tp", 2, MoEShape("h136-i256", 136, 256, 3, 2), "fp8-block128", "uniform"),   # 2 blocks of 128 along I
    ("ep", 3, ODD, "bf16", "zipf"),
    ("ep", 2, OSS, "mxfp4", "uniform"),
    ("ep", 4, OSS, "nvfp4", "same"),      # every token on the same experts: ranks with none routed
    ("ep", 2, MoEShape("h136-i256", 136, 256, 3, 2), "fp8-block128", "zipf"),
]


@pytest.mark.parametrize(("kind", "ranks", "shape", "weight_format", "routing"), CASES,
                         ids=[f"{c[0]}{c[1]}-{c[2].name}-{c[3]}-{c[4]}" for c in CASES])
def test_the_sum_of_the_shards_is_the_layer(kind: str, ranks: int, shape: Any, weight_format: str,
                                            routing: Any) -> None:
    """fp64: the shards' partials summed in rank order are the whole layer's output (to fp64 rounding); each
    shard's weights dequantize to the layer's slices. Warp decode's numerics: within the bf16 tolerance of the whole
    layer (TP splits only the down's sum over I; EP sums the slots rank by rank)."""
    p = _problem(shape, 6, routing, weight_format)
    layer = p.layer
    shards = shard(p.w13, p.w2, kind, ranks, p.b13, p.b2)
    whole = moe_decode(*p.arrays, mode="fp64", **layer)
    split = sharded_moe_decode(p.x, shards, p.topk_ids, p.topk_weights, mode="fp64",
                               activation=layer["activation"])
    assert rel_l2(split, whole) < 1e-13
    faithful = moe_decode(*p.arrays, mode="warp_decode", **layer)
    got = sharded_moe_decode(p.x, shards, p.topk_ids, p.topk_weights, activation=layer["activation"])
    _assert_matches(got, faithful, whole, f"{kind} {ranks} {weight_format}", own_order=True)
    if kind == "tp":  # the dequantized slices, exactly
        for s in shards:
            i0, i1 = s.inter
            dense13 = _dense(p.w13, "w13")
            want13 = np.concatenate([dense13[:, i0:i1], dense13[:, shape.intermediate + i0:shape.intermediate + i1]],
                                    axis=1)
            assert np.array_equal(_dense(s.w13, "w13"), want13)
            assert np.array_equal(_dense(s.w2, "w2"), _dense(p.w2, "w2")[:, :, i0:i1])
    if routing == "same" and kind == "ep":  # a rank that no slot routes to adds exactly zero
        idle = [s for s in shards if not np.any((p.topk_ids >= s.experts[0]) & (p.topk_ids < s.experts[1]))]
        assert idle
        for s in idle:
            ids, weights = s.route(p.topk_ids, p.topk_weights)
            part = moe_decode(p.x, s.w13, s.w2, ids, weights, mode="fp64", activation=layer["activation"],
                              b13=s.b13, b2=s.b2)
            assert not np.any(part)


def test_tp_keeps_every_neurons_intermediate() -> None:
    """TP's shards compute each neuron's intermediate from its whole gate and up rows: the warp-decode intermediate
    of the split layer, concatenated over ranks, is the whole layer's bit for bit (only the down's sum is split)."""
    from kernels.activation import get_activation
    from kernels.numerics import through_bf16

    p = _problem(OSS, 4, "zipf")
    act = get_activation("gpt-oss")
    x = bf16_to_f32(p.x)

    def intermediate(w13: Any, b13: Any) -> np.ndarray:
        e = int(p.topk_ids[0, 0])
        gate_up = x[:1] @ bf16_to_f32(w13[e]).T + bf16_to_f32(b13[e])
        return through_bf16(act.apply(gate_up))

    whole = intermediate(p.w13, p.b13)
    parts = [intermediate(s.w13, s.b13) for s in shard_tp(p.w13, p.w2, 3, p.b13, p.b2)]
    assert np.array_equal(np.concatenate(parts, axis=1).view(np.uint32), whole.view(np.uint32))


def test_bad_splits_are_refused() -> None:
    p = _problem()
    with pytest.raises(ValueError, match="kind must be one of"):
        shard(p.w13, p.w2, "pp", 2)
    for bad, error in ((0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match="ranks must be"):
            shard_tp(p.w13, p.w2, bad)
    tiled = quantize_weights(*_problem(MoEShape("h64-i64", 64, 64, 2, 1)).arrays[1:3], "bf16-t16")
    with pytest.raises(ValueError, match="bf16-t16 weights are tiled"):
        shard_ep(*tiled, 2)
    shards = shard_ep(p.w13, p.w2, 2)
    ids = p.topk_ids.copy()
    ids[0, 0] = 5
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 5\)"):
        sharded_moe_decode(p.x, shards, ids, p.topk_weights)
    with pytest.raises(ValueError, match="one split's ranks"):
        sharded_moe_decode(p.x, shards[::-1], p.topk_ids, p.topk_weights)
    with pytest.raises(TypeError, match="shards must be a non-empty list"):
        sharded_moe_decode(p.x, [], p.topk_ids, p.topk_weights)
    assert isinstance(shards[0], Shard)
