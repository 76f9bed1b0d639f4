"""bf16 rounding and the FP8 quantizers behave as their formats define."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels.numerics import (
    bf16_to_f32,
    bf16_ulp,
    max_abs,
    min_cosine,
    quantize,
    quantize_fp8_groups,
    quantize_mxfp8,
    rel_l2,
    round_bf16,
)


def test_bf16_round_trip_and_ties_to_even() -> None:
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1e-40], np.float32)
    rounded = bf16_to_f32(round_bf16(values))
    assert rounded[0] == 1.0
    assert rounded[1] == 1.0  # halfway -> even (1.0)
    assert rounded[2] == 1.0 + 4 * 2**-8  # halfway -> even (1 + 2**-6)
    assert rounded[3] == -2.5
    np.testing.assert_array_equal(bf16_to_f32(round_bf16(rounded)), rounded)


def test_bf16_ulp() -> None:
    assert bf16_ulp(np.array([1.0]))[0] == 2**-7
    assert bf16_ulp(np.array([-3.0]))[0] == 2**-6
    assert bf16_ulp(np.array([0.0]))[0] > 0


def test_fp8_groups_scale_and_error(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 300)).astype(np.float32)  # 2 full groups + a partial one
    deq = quantize_fp8_groups(x)
    assert deq.shape == x.shape
    for start in range(0, 300, 128):
        block, got = x[:, start : start + 128], deq[:, start : start + 128]
        scale = np.abs(block).max(axis=1, keepdims=True) / 448
        # each element is an e4m3 value times its group's scale (up to the fp32 rounding of that product)
        q = got / scale
        np.testing.assert_allclose(q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), q, rtol=1e-6)
        assert np.allclose(np.abs(got).max(axis=1), np.abs(block).max(axis=1), rtol=1e-6)
    assert 0 < rel_l2(deq, x) < 0.05  # e4m3 has 3 mantissa bits: ~2-4% error


def test_mxfp8_power_of_two_scales(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((2, 64)) * 37).astype(np.float32)
    deq = quantize_mxfp8(x)
    for start in (0, 32):
        block = x[:, start : start + 32]
        exponent = np.floor(np.log2(np.abs(block).max(axis=1))) - 8
        q = deq[:, start : start + 32] / np.exp2(exponent)[:, None]
        np.testing.assert_array_equal(q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), q)
    assert 0 < rel_l2(deq, x) < 0.08


def test_quantize_dispatch_and_zeros() -> None:
    zeros = np.zeros((1, 128), np.float32)
    assert not quantize_fp8_groups(zeros).any() and not quantize_mxfp8(zeros).any()
    assert quantize(np.ones(4), None).dtype == np.float32
    with pytest.raises(ValueError, match="quant must be"):
        quantize(zeros, "int8")


def test_metrics() -> None:
    oracle = np.array([[3.0, 4.0], [1.0, 0.0]])
    assert rel_l2(oracle, oracle) == 0.0
    assert rel_l2(oracle * 1.1, oracle) == pytest.approx(0.1)
    assert max_abs(oracle + [[0, 0.5], [0, 0]], oracle) == 0.5
    assert min_cosine(oracle, oracle) == pytest.approx(1.0)
    assert min_cosine(np.array([[4.0, -3.0], [1.0, 0.0]]), oracle) == pytest.approx(0.0)
