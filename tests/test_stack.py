"""kernels.stack: cheap sparse problems, the any-dtype fp64 oracle, and the multi-layer stack (CPU, fast)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.contract import BF16
from kernels.numerics import bf16_to_f32, rel_l2
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.routing import make_routing
from kernels.shapes import get_shape
from kernels.stack import (
    PATHS,
    RMS_EPS,
    Stack,
    expert_weights,
    moe_fp64,
    routing_mismatch,
    sparse_problem,
)

TINY = get_shape("tiny")
ODD = TINY.with_(name="odd", hidden=40, intermediate=24, experts=9, top_k=3)


@pytest.mark.parametrize("shape", [TINY, ODD])
def test_moe_fp64_equals_reference_fp64(shape):
    problem = make_problem(shape, 5, seed=3)
    ours = moe_fp64(*problem.arrays)
    ref = moe_decode(*problem.arrays, mode="fp64")
    assert ours.dtype == np.float64
    np.testing.assert_allclose(ours, ref, rtol=1e-13, atol=1e-13)


def test_moe_fp64_takes_fp64_activations_and_weights():
    problem = make_problem(TINY, 4, seed=1)
    x64 = bf16_to_f32(problem.x).astype(np.float64)
    w64 = problem.topk_weights.astype(np.float64)
    np.testing.assert_allclose(
        moe_fp64(x64, problem.w13, problem.w2, problem.topk_ids, w64),
        moe_fp64(*problem.arrays), rtol=1e-14, atol=1e-14,
    )


def test_moe_fp64_on_fp8_weights_is_the_reference_oracle_on_them():
    """weight_format="fp8-block128": each expert dequantized where the weights live -- the uint8 bit patterns the
    device holds too (a table lookup, what runs on CuPy) -- gives the reference's fp64 oracle on those weights."""
    from kernels.formats import Quantized, quantize_weights

    problem = make_problem(ODD.with_(hidden=136, intermediate=200), 4, seed=7)  # partial blocks at both edges
    q13, q2 = quantize_weights(problem.w13, problem.w2, "fp8-block128")
    bits = tuple(Quantized(q.values.view(np.uint8), q.scales) for q in (q13, q2))
    args = (problem.x, q13, q2, problem.topk_ids, problem.topk_weights)
    ref = moe_decode(*args, mode="fp64", weight_format="fp8-block128")
    for w13, w2 in ((q13, q2), bits):
        ours = moe_fp64(problem.x, w13, w2, problem.topk_ids, problem.topk_weights, weight_format="fp8-block128")
        np.testing.assert_allclose(ours, ref, rtol=1e-13, atol=1e-13)
    assert rel_l2(moe_fp64(*problem.arrays), ref) > 1e-3  # the format's own error: the oracles differ


def test_sparse_problem_is_the_full_problem_restricted_to_touched_experts():
    shape = ODD
    problem = sparse_problem(shape, 4, seed=5)
    ids, weights = make_routing(4, shape.experts, shape.top_k, "uniform", 5)
    touched = problem.meta["experts_touched"]
    assert problem.shape.experts == touched.size == np.unique(ids).size
    np.testing.assert_array_equal(touched[problem.topk_ids], ids)
    np.testing.assert_array_equal(problem.topk_weights, weights)
    np.testing.assert_array_equal(problem.x.view(np.uint16), make_problem(shape, 4, seed=5).x.view(np.uint16))
    full = [expert_weights(shape, 5, e) for e in range(shape.experts)]
    w13 = np.stack([w[0] for w in full])
    w2 = np.stack([w[1] for w in full])
    np.testing.assert_array_equal(problem.w13.view(np.uint16), w13[touched].view(np.uint16))
    expect = moe_decode(problem.x, w13, w2, ids, weights, mode="warp_decode")
    got = moe_decode(*problem.arrays, mode="warp_decode")
    np.testing.assert_array_equal(got.view(np.uint16), expect.view(np.uint16))


def test_sparse_problem_cache_is_shared_and_weights_look_right():
    cache: dict = {}
    a = sparse_problem(TINY, 1, seed=2, cache=cache)
    b = sparse_problem(TINY, 8, seed=2, cache=cache)
    assert len(cache) >= b.shape.experts >= a.shape.experts
    w13 = bf16_to_f32(b.w13)
    assert w13.dtype == np.float32 and b.w13.dtype == BF16
    assert abs(float(w13.std()) - TINY.hidden**-0.5) < 0.2 * TINY.hidden**-0.5
    with pytest.raises(ValueError, match="tokens"):
        sparse_problem(TINY, 0)


def test_routing_mismatch_counts_sets_not_orders():
    a = np.array([[1, 2], [3, 4], [0, 5]], np.int32)
    b = np.array([[2, 1], [3, 5], [0, 5]], np.int32)
    assert routing_mismatch(a, b) == 1
    assert routing_mismatch(a, a) == 0


def _plain_fp64_stack(stack: Stack, x: np.ndarray) -> list[np.ndarray]:
    """The fp64 stack written as a plain per-token, per-slot loop."""
    shape, K, I = stack.shape, stack.shape.top_k, stack.shape.intermediate
    h = bf16_to_f32(x).astype(np.float64)
    outs = []
    for index, layer in enumerate(stack.layers):
        new = h.copy()
        for t in range(h.shape[0]):
            row = h[t]
            a = row / np.sqrt(np.mean(row * row) + RMS_EPS) * bf16_to_f32(layer.gamma).astype(np.float64)
            logits = bf16_to_f32(layer.router).astype(np.float64) @ a
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs, kind="stable")[:K]
            weights = probs[chosen] / probs[chosen].sum()
            for e, w in zip(chosen, weights, strict=True):
                w13, w2 = (
                    bf16_to_f32(m).astype(np.float64) for m in expert_weights(shape, stack.seed, int(e), index + 1)
                )
                gate, up = w13[:I] @ a, w13[I:] @ a
                new[t] += w * (w2 @ (gate / (1 + np.exp(-gate)) * up))
        h = new
        outs.append(h)
    return outs


def test_fp64_stack_equals_a_plain_loop():
    stack = Stack(TINY, 3, seed=4)
    x = stack.input(5)
    trace = stack.run_fp64(x)
    plain = _plain_fp64_stack(stack, x)
    assert len(trace.outputs) == 3
    for ours, ref in zip(trace.outputs, plain, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", list(PATHS))
def test_bf16_paths_run_and_stay_close_at_first_layer(path):
    stack = Stack(TINY, 3, seed=6)
    x = stack.input(6)
    oracle = stack.run_fp64(x)
    trace = stack.run_path(x, path)
    assert [o.dtype for o in trace.outputs] == [BF16] * 3
    assert all(np.isfinite(bf16_to_f32(o)).all() for o in trace.outputs)
    assert rel_l2(bf16_to_f32(trace.outputs[0]), oracle.outputs[0]) < 0.05
    # the residual stream stays bounded (the weights are scaled for that)
    assert float(np.sqrt(np.mean(oracle.outputs[-1] ** 2))) < 10


def test_quantized_stack_reads_each_expert_quantized_once_and_its_oracle_dequantized():
    """On fp8-block128 weights: a path gets each touched expert quantized on its own (the same values whichever
    experts share the call), and the fp64 stack runs on exactly those values dequantized."""
    from kernels.formats import Quantized, get_format

    fmt = get_format("fp8-block128")
    stack = Stack(TINY, 2, seed=5)
    x = stack.input(6)
    seen: list[tuple] = []

    def record(a, w13, w2, ids, weights):
        seen.append((w13, w2, ids))
        return moe_decode(a, w13, w2, ids, weights, mode="warp_decode", weight_format=fmt)

    trace = stack.run_path(x, "warp_decode", moe=record, weight_format=fmt.name)
    for layer, (w13, w2, _) in enumerate(seen):
        assert isinstance(w13, Quantized) and isinstance(w2, Quantized)
        touched = np.unique(trace.topk_ids[layer])
        for local, e in enumerate(touched):
            own13, own2 = fmt.quantize(*(m[None] for m in expert_weights(TINY, stack.seed, int(e), layer + 1)))
            np.testing.assert_array_equal(w13.values[local].view(np.uint8), own13.values[0].view(np.uint8))
            np.testing.assert_array_equal(w2.scales[local], own2.scales[0])
    assert stack.run_path(x, "warp_decode", weight_format=fmt.name).outputs[-1].tobytes() == trace.outputs[-1].tobytes()
    plain, deq = stack.run_fp64(x), stack.run_fp64(x, fmt.name)
    # one layer by hand on the dequantized experts equals the quantized oracle's first layer
    w13, w2, local = stack._experts(0, deq.topk_ids[0], fmt.name)
    h = bf16_to_f32(x).astype(np.float64)
    gamma = bf16_to_f32(stack.layers[0].gamma).astype(np.float64)
    a = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + RMS_EPS) * gamma
    logits = a @ bf16_to_f32(stack.layers[0].router).astype(np.float64).T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    weights = np.take_along_axis(probs, deq.topk_ids[0], axis=1)
    if TINY.norm_topk_prob:
        weights = weights / weights.sum(axis=1, keepdims=True)
    by_hand = h + moe_fp64(a, fmt.dequantize(w13, "w13"), fmt.dequantize(w2, "w2"), local, weights)
    np.testing.assert_allclose(deq.outputs[0], by_hand, rtol=1e-12, atol=1e-12)
    assert rel_l2(deq.outputs[0], plain.outputs[0]) > 1e-3  # a different oracle: the format's own error


def test_stack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="layers"):
        Stack(TINY, 0)
    with pytest.raises(ValueError, match="path"):
        Stack(TINY, 1).run_path(Stack(TINY, 1).input(2), "nope")
