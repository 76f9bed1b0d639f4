"""Every bad input gets a ValueError or TypeError that names the argument and the expectation."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kernels import BF16, check_inputs, make_problem, make_weights
from kernels.contract import check_int, check_out, check_out_dtype, check_xp
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


# -- check_int / check_xp: the shared checks of int and array-module arguments ----------------------------------
@pytest.mark.parametrize("value", [7, np.int8(7), np.int64(7), np.uint16(7), np.uint64(7)])
def test_check_int_takes_python_and_numpy_ints(value: object) -> None:
    got = check_int("tokens", value, 1)
    assert got == 7 and type(got) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 7.0, np.float32(7), "7", None, [7], 7 + 0j])
def test_check_int_refuses_non_ints_by_name(value: object) -> None:
    with pytest.raises(TypeError, match=r"^seed must be an int, got "):
        check_int("seed", value)


def test_check_int_range_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^tokens must be an int >= 1, got 0$"):
        check_int("tokens", np.int64(0), 1)
    with pytest.raises(ValueError, match=r"^seed must be an int >= 0, got -3$"):
        check_int("seed", -3)
    with pytest.raises(ValueError, match=r"^top_k must be an int in \[1, 4\], got 5$"):
        check_int("top_k", 5, 1, 4)
    assert check_int("top_k", np.int16(4), 1, 4) == 4 and check_int("seed", 0) == 0


def _fake_cupy(count: object) -> types.ModuleType:
    """A module named cupy whose only CUDA call is getDeviceCount (returning ``count`` or raising it)."""
    def get_device_count() -> object:
        if isinstance(count, BaseException):
            raise count
        return count

    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    return module


def test_check_xp_names_and_modules() -> None:
    assert check_xp(np) is np and check_xp("numpy") is np
    fake = _fake_cupy(1)
    assert check_xp(fake) is fake
    for bad in ("torch", "NumPy", 3, None, np.linalg, types, np.ones(2)):
        with pytest.raises(TypeError, match=r"^xp must be the numpy or cupy module \(or 'numpy' / 'cupy'\), got "):
            check_xp(bad)


def test_check_xp_cupy_without_a_gpu_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^xp=cupy needs a CUDA GPU \(RuntimeError: no driver here\)$"):
        check_xp(_fake_cupy(RuntimeError("no driver\nhere")))
    with pytest.raises(ValueError, match=r"^xp=cupy needs a CUDA GPU \(no CUDA device found\)$"):
        check_xp(_fake_cupy(0))


@pytest.mark.cpu_only
def test_check_xp_cupy_string_without_a_gpu() -> None:
    with pytest.raises(ValueError, match=r"^xp=cupy needs a CUDA GPU \("):
        check_xp("cupy")


# -- make_problem / make_weights: their int and xp arguments --------------------------------------------------
def test_make_problem_takes_numpy_ints(rng: np.random.Generator) -> None:
    seed = int(rng.integers(1 << 30))
    p = make_problem("tiny", np.int64(4), seed=np.uint32(seed), xp="numpy")
    q = make_problem("tiny", 4, seed=seed)
    assert type(p.tokens) is int and type(p.seed) is int and (p.tokens, p.seed) == (4, seed)
    for a, b in zip(p.arrays, q.arrays, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"tokens": 0}, ValueError, r"^tokens must be an int >= 1, got 0$"),
        ({"tokens": True}, TypeError, r"^tokens must be an int, got True$"),
        ({"tokens": 4.0}, TypeError, r"^tokens must be an int, got 4.0$"),
        ({"seed": -1}, ValueError, r"^seed must be an int >= 0, got -1$"),
        ({"seed": np.int64(-5)}, ValueError, r"^seed must be an int >= 0, got -5$"),
        ({"seed": 1.5}, TypeError, r"^seed must be an int, got 1.5$"),
        ({"xp": "torch"}, TypeError, r"^xp must be the numpy or cupy module"),
        ({"xp": None}, TypeError, r"^xp must be the numpy or cupy module"),
        ({"xp": _fake_cupy(RuntimeError("no CUDA driver"))}, ValueError, r"^xp=cupy needs a CUDA GPU \(RuntimeError"),
    ],
)
def test_make_problem_argument_errors(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make_problem("tiny", **{"tokens": 3, **kwargs})


def test_make_weights_argument_errors(rng: np.random.Generator) -> None:
    seed = int(rng.integers(1 << 30))
    w13, w2 = make_weights("tiny", np.int64(seed), "numpy")
    expect13, expect2 = make_weights("tiny", seed)
    np.testing.assert_array_equal(w13.view(np.uint16), expect13.view(np.uint16))
    np.testing.assert_array_equal(w2.view(np.uint16), expect2.view(np.uint16))
    with pytest.raises(ValueError, match=r"^seed must be an int >= 0, got -1$"):
        make_weights("tiny", -1)
    with pytest.raises(TypeError, match=r"^xp must be the numpy or cupy module .*got 'jax'$"):
        make_weights("tiny", xp="jax")
    with pytest.raises(ValueError, match=r"^xp=cupy needs a CUDA GPU \(no CUDA device found\)$"):
        make_weights("tiny", xp=_fake_cupy(0))


@pytest.mark.cpu_only
def test_make_problem_cupy_without_a_gpu() -> None:
    for xp in ("cupy", pytest.importorskip("cupy")):
        with pytest.raises(ValueError, match=r"^xp=cupy needs a CUDA GPU \("):
            make_problem("tiny", 2, xp=xp)
