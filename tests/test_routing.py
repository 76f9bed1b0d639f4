"""route() has Qwen3 semantics; the generators are deterministic and do what their names say."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.routing import make_routing, route, unique_experts


def test_route_softmax_topk_renormalize(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((5, 16)).astype(np.float32)
    ids, weights = route(logits, 4)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    for t in range(5):
        expect = np.argsort(-probs[t])[:4]
        assert list(ids[t]) == list(expect)
        np.testing.assert_allclose(weights[t], probs[t, expect] / probs[t, expect].sum(), rtol=1e-6)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-6)
    _, raw = route(logits, 4, renormalize=False)
    assert np.all(raw.sum(1) < 1.0)


def test_route_errors() -> None:
    with pytest.raises(ValueError, match="top_k"):
        route(np.zeros((2, 4)), 5)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route(np.zeros(4), 1)
    with pytest.raises(ValueError, match="finite"):
        route(np.array([[0.0, np.nan]]), 1)


@pytest.mark.parametrize("kind", ["uniform", "zipf", "same"])
def test_generators_distinct_and_deterministic(kind: str) -> None:
    ids, weights = make_routing(32, 64, 8, kind, seed=7)
    again, weights_again = make_routing(32, 64, 8, kind, seed=7)
    other, _ = make_routing(32, 64, 8, kind, seed=8)
    assert np.array_equal(ids, again) and np.array_equal(weights, weights_again)
    assert not np.array_equal(ids, other)
    assert all(len(set(row)) == 8 for row in ids), "each token's experts are distinct"
    assert ids.min() >= 0 and ids.max() < 64
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-6)
    assert ids.flags.c_contiguous and ids.dtype == np.int32


def test_zipf_is_skewed_and_same_is_one_set() -> None:
    uniform, _ = make_routing(256, 128, 8, "uniform", seed=1)
    zipf, _ = make_routing(256, 128, 8, "zipf", seed=1)
    assert unique_experts(zipf) < unique_experts(uniform)
    hottest = np.bincount(zipf.ravel(), minlength=128).max()
    assert hottest > 3 * np.bincount(uniform.ravel(), minlength=128).max() / 2
    same, _ = make_routing(16, 128, 8, "same", seed=1)
    assert unique_experts(same) == 8


def test_fixed_routing_allows_duplicates() -> None:
    ids, weights = make_routing(3, 10, 4, [1, 1, 2, 9])
    assert ids.shape == (3, 4) and list(ids[2]) == [1, 1, 2, 9]
    full = np.array([[0, 0], [3, 4]])
    assert np.array_equal(make_routing(2, 5, 2, full)[0], full)


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((4, 8, 9, "uniform"), ValueError, "top_k"),
        ((4, 8, 2, "hot"), ValueError, "routing must be"),
        ((2, 8, 2, [1, 2, 3]), ValueError, "fixed routing"),
        ((2, 8, 2, [1, 8]), ValueError, r"\[0, 8\)"),
        ((2, 8, 2, [1.5, 2.0]), TypeError, "integer"),
        ((0, 8, 2, "uniform"), ValueError, "tokens"),
    ],
)
def test_generator_errors(args: tuple, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make_routing(*args)
