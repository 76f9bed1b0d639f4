"""route() has Qwen3 semantics; the generators are deterministic and do what their names say."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from kernels.routing import GENERATORS, make_routing, route, unique_experts


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


def test_route_errors(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((2, 4))
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=4\], got 5"):
        route(logits, 5)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route(logits[0], 1)
    with pytest.raises(ValueError, match="logits must be finite"):
        route(np.where(np.eye(2, 4) > 0, np.nan, logits), 1)
    with pytest.raises(ValueError, match="logits must be finite"):
        route(np.where(np.eye(2, 4) > 0, -np.inf, logits), 1)


def _softmax_topk_float32(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """route() before the precision fix, for float32 logits (which it must reproduce bit for bit)."""
    logits = logits.astype(np.float32)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    return ids.astype(np.int32), (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


def test_route_float32_logits_are_bitwise_unchanged(rng: np.random.Generator) -> None:
    logits = (rng.standard_normal((33, 128)) * 4).astype(np.float32)
    ids, weights = route(logits, 8)
    expect_ids, expect_weights = _softmax_topk_float32(logits, 8)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(weights.view(np.uint32), expect_weights.view(np.uint32))


@pytest.mark.parametrize("scale", [1e300, 1e39, 3e38])
def test_route_huge_finite_logits_give_finite_weights(rng: np.random.Generator, scale: float) -> None:
    """float64 logits beyond float32's range: shifted in float64, so no overflow, no NaN, no warning."""
    logits = rng.standard_normal((6, 16)) * scale
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning (overflow, invalid) fails the test
        ids, weights = route(logits, 3)
        raw_ids, raw = route(logits, 3, renormalize=False)
    assert np.all(np.isfinite(weights)) and np.all(np.isfinite(raw))
    np.testing.assert_array_equal(ids, raw_ids)
    np.testing.assert_array_equal(ids[:, 0], logits.argmax(axis=1))  # the largest logit wins
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-6)


def test_route_reported_overflow_case() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, weights = route(np.array([[1e300, 0, 0, 0]]), 2)
    assert ids.tolist() == [[0, 1]] and weights.tolist() == [[1.0, 0.0]]
    ids, weights = route(np.array([[-1e308, 1e308, 5.0]]), 2)
    assert ids.tolist() == [[1, 0]] and weights.tolist() == [[1.0, 0.0]]


def test_route_float64_matches_a_float64_softmax(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((9, 32)) * 3 + 1e6  # a large common offset: the fp64 shift removes it exactly
    ids, weights = route(logits, 4, renormalize=False)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(ids, np.argsort(-probs, axis=1, kind="stable")[:, :4])
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids, axis=1), rtol=1e-6)


def test_route_integer_and_narrow_float_logits(rng: np.random.Generator) -> None:
    ints = rng.integers(-50, 50, size=(5, 12))
    ids, weights = route(ints, 3)
    expect_ids, expect_weights = route(ints.astype(np.float64), 3)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(weights, expect_weights)
    halves = rng.standard_normal((5, 12)).astype(np.float16)
    ids, weights = route(halves, 3)  # float16 is widened to float32 exactly: same as float32 logits
    expect_ids, expect_weights = route(halves.astype(np.float32), 3)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(weights, expect_weights)


@pytest.mark.parametrize("dtype", [bool, np.complex64, object, np.str_])
def test_route_refuses_non_numeric_logits(rng: np.random.Generator, dtype: type) -> None:
    logits = (rng.standard_normal((3, 4)) > 0).astype(dtype)
    with pytest.raises(TypeError, match=rf"logits must hold real numbers .*got dtype {re.escape(str(logits.dtype))}$"):
        route(logits, 2)


def test_route_refuses_empty_logits(rng: np.random.Generator) -> None:
    with pytest.raises(ValueError, match=r"logits needs at least one token \(T >= 1\), got shape \(0, 8\)"):
        route(rng.standard_normal((0, 8)), 2)
    with pytest.raises(ValueError, match=r"logits needs at least one expert \(E >= 1\), got shape \(3, 0\)"):
        route(rng.standard_normal((3, 0)), 1)


def test_route_top_k_numpy_ints_and_bools(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((4, 8)).astype(np.float32)
    ids, weights = route(logits, np.int64(3))
    expect_ids, expect_weights = route(logits, 3)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(weights, expect_weights)
    assert route(logits, np.uint8(2))[0].shape == (4, 2)
    for bad in (True, np.bool_(True), 2.0, np.float32(2), "2", None):
        with pytest.raises(TypeError, match="top_k must be an int, got"):
            route(logits, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        route(logits, np.int32(0))


@pytest.mark.parametrize("kind", GENERATORS)
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


def test_skew_grows_with_the_zipf_exponent_and_correlated_tokens_share_their_experts() -> None:
    hottest = {kind: np.bincount(make_routing(512, 128, 8, kind, seed=3)[0].ravel(), minlength=128).max()
               for kind in ("uniform", "zipf-1", "zipf", "zipf-2")}
    assert hottest["uniform"] < hottest["zipf-1"] < hottest["zipf"] < hottest["zipf-2"] <= 512
    ids, _ = make_routing(256, 128, 8, "correlated", seed=3)
    counts = np.bincount(ids.ravel(), minlength=128)
    shared = np.argsort(-counts)[:8]
    kept = np.isin(ids, shared).mean()
    assert 0.70 < kept < 0.80  # each slot keeps the batch's expert with probability 3/4
    assert all(len(set(row)) == 8 for row in ids) and unique_experts(ids) > 8
    assert unique_experts(make_routing(256, 128, 8, "uniform", seed=3)[0]) > unique_experts(ids)


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
        ((0, 8, 2, "uniform"), ValueError, "tokens must be an int >= 1, got 0"),
        ((2, 0, 2, "uniform"), ValueError, "experts must be an int >= 1, got 0"),
        ((2, 8, 0, "uniform"), ValueError, "top_k must be an int >= 1, got 0"),
        ((2.0, 8, 2, "uniform"), TypeError, "tokens must be an int, got 2.0"),
        ((True, 8, 2, "uniform"), TypeError, "tokens must be an int, got True"),
        ((2, np.float64(8), 2, "uniform"), TypeError, "experts must be an int"),
        ((2, 8, np.bool_(True), "uniform"), TypeError, "top_k must be an int"),
        ((2, 8, 2, "uniform", -1), ValueError, "seed must be an int >= 0, got -1"),
        ((2, 8, 2, "uniform", 0.5), TypeError, "seed must be an int, got 0.5"),
    ],
)
def test_generator_errors(args: tuple, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make_routing(*args)


def test_generators_take_numpy_ints() -> None:
    ids, weights = make_routing(np.int64(4), np.int32(16), np.uint8(3), "zipf", seed=np.int64(5))
    expect_ids, expect_weights = make_routing(4, 16, 3, "zipf", seed=5)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(weights, expect_weights)
