"""Every bad input gets a ValueError or TypeError that names the argument and the expectation."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import BF16, check_inputs, make_problem
from kernels.contract import check_out, check_out_dtype
from kernels.reference import moe_decode


@pytest.fixture
def arrays() -> dict:
    p = make_problem("tiny", 3, seed=2)
    return dict(zip(["x", "w13", "w2", "topk_ids", "topk_weights"], p.arrays, strict=True))


def test_good_inputs_give_dims(arrays: dict) -> None:
    d = check_inputs(**arrays)
    assert (d.tokens, d.hidden, d.intermediate, d.experts, d.top_k) == (3, 136, 48, 6, 2)


def _mutations(a: dict) -> list[tuple[str, object, type, str]]:
    ids = a["topk_ids"]
    return [
        ("x", a["x"][0], ValueError, r"x must have 2 dimensions"),
        ("x", a["x"].astype(np.float32), TypeError, r"x must have dtype bfloat16"),
        ("x", a["x"].tolist(), TypeError, r"numpy.ndarray or cupy.ndarray"),
        ("x", np.asfortranarray(np.concatenate([a["x"]] * 2)[:, :]).T.copy().T, ValueError, "x must be C-contiguous"),
        ("w13", a["w13"][:, :, :128].copy(), ValueError, r"w13 is \[E, 2I, H\] with H = 136"),
        ("w13", a["w13"][:, :95].copy(), ValueError, "must be even"),
        ("w2", a["w2"][:, :, :40].copy(), ValueError, r"w2 must be \[E, H, I\] = \[6, 136, 48\]"),
        ("w2", a["w2"][:5].copy(), ValueError, r"w2 must be \[E, H, I\]"),
        ("topk_ids", ids.astype(np.int64), TypeError, "topk_ids must have dtype int32"),
        ("topk_ids", ids[:2].copy(), ValueError, r"topk_ids must be \[T, K\] with T = 3"),
        ("topk_ids", np.full_like(ids, 6), ValueError, r"topk_ids must lie in \[0, E\) = \[0, 6\)"),
        ("topk_ids", np.full_like(ids, -1), ValueError, r"\[0, 6\)"),
        ("topk_weights", a["topk_weights"][:, :1].copy(), ValueError, r"topk_weights must be \[T, K\] = \[3, 2\]"),
        ("topk_weights", a["topk_weights"].astype(np.float64), TypeError, "topk_weights must have dtype float32"),
        (
            "topk_weights",
            np.where(np.eye(3, 2) > 0, np.nan, a["topk_weights"]).astype(np.float32),
            ValueError,
            "finite",
        ),
        ("topk_weights", np.full((3, 2), np.inf, np.float32), ValueError, "finite"),
    ]


def test_each_bad_input_is_named(arrays: dict) -> None:
    for name, bad, error, message in _mutations(arrays):
        with pytest.raises(error, match=message):
            check_inputs(**{**arrays, name: bad})
        with pytest.raises(error, match=message):  # and the reference uses the same checks
            moe_decode(**{**arrays, name: bad})


def test_h_and_i_multiple_of_8() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 12)).astype(BF16)
    w13 = rng.standard_normal((2, 16, 12)).astype(BF16)
    w2 = rng.standard_normal((2, 12, 8)).astype(BF16)
    ids, weights = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    with pytest.raises(ValueError, match=r"H \(x.shape\[1\]\) must be a multiple of 8"):
        check_inputs(x, w13, w2, ids, weights)
    x8 = rng.standard_normal((1, 8)).astype(BF16)
    with pytest.raises(ValueError, match=r"I \(w2.shape\[2\]\) must be a multiple of 8"):
        check_inputs(
            x8, rng.standard_normal((2, 12, 8)).astype(BF16), rng.standard_normal((2, 8, 6)).astype(BF16), ids, weights
        )


def test_empty_dimensions(arrays: dict) -> None:
    with pytest.raises(ValueError, match="T >= 1"):
        check_inputs(
            **{
                **arrays,
                "x": arrays["x"][:0],
                "topk_ids": arrays["topk_ids"][:0],
                "topk_weights": arrays["topk_weights"][:0],
            }
        )
    with pytest.raises(ValueError, match="K >= 1"):
        check_inputs(
            **{
                **arrays,
                "topk_ids": arrays["topk_ids"][:, :0].copy(),
                "topk_weights": arrays["topk_weights"][:, :0].copy(),
            }
        )
    with pytest.raises(ValueError, match="E >= 1"):
        check_inputs(**{**arrays, "w13": arrays["w13"][:0], "w2": arrays["w2"][:0]})


def test_out_checks(arrays: dict) -> None:
    dims = check_inputs(**arrays)
    check_out(np.empty((3, 136), BF16), dims, np)
    check_out(np.empty((3, 136), np.float32), dims, np)
    with pytest.raises(ValueError, match=r"out must be \[T, H\] = \[3, 136\]"):
        check_out(np.empty((3, 135), BF16), dims, np)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        check_out(np.empty((3, 136), np.float16), dims, np)
    with pytest.raises(TypeError, match="out_dtype"):
        check_out_dtype(np.int8)
    assert check_out_dtype("float32") == np.float32
