"""The NumPy reference: equal to a plainly written loop, the identities of the math, and its error ordering."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import BF16, get_shape, make_problem
from kernels.numerics import bf16_to_f32, quantize, rel_l2, silu, through_bf16
from kernels.reference import expert_ffn, moe_decode

SMALL = get_shape("tiny").with_(name="small", hidden=64, intermediate=24, experts=5, top_k=3)


def plain_loop(x, w13, w2, topk_ids, topk_weights, mode: str, quant: str | None = None) -> np.ndarray:
    """Token by token, slot by slot, written the obvious way (float64 or float32 + explicit roundings)."""
    acc = np.float64 if mode == "fp64" else np.float32
    T, K = topk_ids.shape
    I = w2.shape[2]
    out = np.zeros((T, x.shape[1]), acc)
    for t in range(T):
        xt = bf16_to_f32(x[t])
        if mode == "classical":
            xt = quantize(xt[None], quant)[0]
        xt = xt.astype(acc)
        for k in range(K):
            e = topk_ids[t, k]
            w13_e = bf16_to_f32(w13[e]).astype(acc)
            w2_e = bf16_to_f32(w2[e]).astype(acc)
            gate = np.array([np.dot(w13_e[i], xt) for i in range(I)], acc)
            up = np.array([np.dot(w13_e[I + i], xt) for i in range(I)], acc)
            if mode == "classical":
                gate, up = through_bf16(gate), through_bf16(up)
            hidden = silu(gate) * up
            if mode == "warp_decode":
                hidden = through_bf16(hidden)
            if mode == "classical":
                hidden = quantize(through_bf16(hidden)[None], quant)[0]
            down = np.array([np.dot(w2_e[h], hidden.astype(acc)) for h in range(x.shape[1])], acc)
            if mode == "classical":
                down = through_bf16(down)
            out[t] += acc(topk_weights[t, k]) * down
    return out


@pytest.mark.parametrize(
    "mode, quant",
    [("fp64", None), ("warp_decode", None), ("classical", None), ("classical", "fp8"), ("classical", "mxfp8")],
)
def test_matches_plain_loop(mode: str, quant: str | None) -> None:
    p = make_problem(SMALL, 4, seed=11, routing=[[0, 1, 1], [4, 2, 0], [3, 3, 3], [1, 0, 2]])
    got = moe_decode(*p.arrays, mode=mode, quant=quant, out_dtype=np.float64 if mode == "fp64" else np.float32)
    want = plain_loop(*p.arrays, mode=mode, quant=quant)
    # float32 sums in BLAS order vs np.dot order: a few fp32 ulps; an intermediate bf16 rounding may flip
    tol = 1e-12 if mode == "fp64" else 2e-3
    assert rel_l2(got, want) < tol
    if mode != "fp64":
        assert moe_decode(*p.arrays, mode=mode, quant=quant).dtype == BF16


def test_linear_in_topk_weights(rng: np.random.Generator) -> None:
    p = make_problem("tiny", 5, seed=int(rng.integers(1 << 30)))
    # dyadic weights, so that w_a + w_b is exact in float32 and only the reference's linearity is tested
    w_a = (rng.integers(0, 256, p.topk_weights.shape) / 256).astype(np.float32)
    w_b = (rng.integers(0, 256, p.topk_weights.shape) / 256).astype(np.float32)
    run = lambda w: moe_decode(p.x, p.w13, p.w2, p.topk_ids, w)  # noqa: E731
    np.testing.assert_allclose(run(w_a + w_b), run(w_a) + run(w_b), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(run(np.float32(3) * w_a), 3 * run(w_a), rtol=1e-12)


def test_invariant_to_permuting_slots(rng: np.random.Generator) -> None:
    p = make_problem("tiny", 6, seed=int(rng.integers(1 << 30)))
    perm = rng.permutation(p.shape.top_k)
    base = moe_decode(*p.arrays)
    permuted = moe_decode(
        p.x, p.w13, p.w2, np.ascontiguousarray(p.topk_ids[:, perm]), np.ascontiguousarray(p.topk_weights[:, perm])
    )
    np.testing.assert_allclose(permuted, base, rtol=1e-12, atol=1e-12)


def test_one_expert_weight_one_is_its_ffn(rng: np.random.Generator) -> None:
    shape = get_shape("tiny").with_(top_k=1)
    p = make_problem(shape, 3, seed=int(rng.integers(1 << 30)), routing=[4])
    ones = np.ones((3, 1), np.float32)
    got = moe_decode(p.x, p.w13, p.w2, p.topk_ids, ones)
    np.testing.assert_allclose(got, expert_ffn(p.x, p.w13[4], p.w2[4]), rtol=1e-12, atol=1e-12)


def test_duplicate_ids_add_their_contributions(rng: np.random.Generator) -> None:
    """Duplicate expert ids within a token are legal: each slot contributes, so weights add."""
    p = make_problem("tiny", 2, seed=int(rng.integers(1 << 30)), routing=[[1, 1], [3, 1]])
    weights = np.array([[0.375, 0.5], [0.25, 0.75]], np.float32)  # dyadic: sums are exact
    merged = moe_decode(
        p.x, p.w13, p.w2, np.array([[1, 3], [3, 1]], np.int32), np.array([[0.875, 0.0], [0.25, 0.75]], np.float32)
    )
    np.testing.assert_allclose(moe_decode(p.x, p.w13, p.w2, p.topk_ids, weights), merged, rtol=1e-12, atol=1e-12)


def test_float32_output_is_the_unrounded_accumulator() -> None:
    p = make_problem("tiny", 3, seed=5)
    acc = moe_decode(*p.arrays, mode="warp_decode", out_dtype=np.float32)
    assert acc.dtype == np.float32
    assert np.array_equal(acc.astype(BF16), moe_decode(*p.arrays, mode="warp_decode"))


def test_error_ordering_over_seeds() -> None:
    """warp_decode is closer to fp64 than classical on (nearly) every seed; fp8 is farther still."""
    shape = get_shape("qwen3-30b-a3b").with_(experts=16, hidden=512, intermediate=256)
    errors = {"warp_decode": [], "classical": [], "fp8": [], "mxfp8": []}
    for seed in range(12):
        p = make_problem(shape, 4, seed=seed)
        oracle = moe_decode(*p.arrays)
        errors["warp_decode"].append(rel_l2(moe_decode(*p.arrays, mode="warp_decode"), oracle))
        errors["classical"].append(rel_l2(moe_decode(*p.arrays, mode="classical"), oracle))
        errors["fp8"].append(rel_l2(moe_decode(*p.arrays, mode="classical", quant="fp8"), oracle))
        errors["mxfp8"].append(rel_l2(moe_decode(*p.arrays, mode="classical", quant="mxfp8"), oracle))
    e = {k: np.array(v) for k, v in errors.items()}
    assert np.mean(e["warp_decode"] < e["classical"]) >= 0.9
    assert np.median(e["classical"] / e["warp_decode"]) > 1.1
    assert np.all(e["fp8"] > e["classical"]) and np.all(e["mxfp8"] > e["classical"])
    assert np.all(e["warp_decode"] < 5e-3)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"mode": "fp16"}, "mode must be"),
        ({"quant": "int4", "mode": "classical"}, "quant must be"),
        ({"quant": "fp8", "mode": "warp_decode"}, "applies to mode='classical'"),
        ({"mode": "warp_decode", "out_dtype": np.float16}, "out_dtype"),
    ],
)
def test_argument_errors(bad: dict, message: str) -> None:
    p = make_problem("tiny", 1, seed=0)
    with pytest.raises((ValueError, TypeError), match=message):
        moe_decode(*p.arrays, **bad)


def test_fp64_is_two_gemms_per_touched_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the oracle is fast at model sizes (tools/cpu_timings.py measures it): the work is grouped by expert,
    exactly two GEMMs (gate/up, then down) per touched expert over all of its (token, slot) pairs at once, no
    loop over tokens or slots, untouched experts never read; and the result is the per-(token, slot) loop's."""
    import kernels.reference as reference

    calls: list[tuple[int, tuple[int, ...]]] = []
    matmul = reference.matmul_bf16_t

    def counting(activations: np.ndarray, weight: np.ndarray, acc: type) -> np.ndarray:
        calls.append((activations.shape[0], weight.shape))
        return matmul(activations, weight, acc)

    monkeypatch.setattr(reference, "matmul_bf16_t", counting)
    # 8 tokens x 3 slots, duplicate ids within tokens, expert 3 never routed to
    routing = [[0, 1, 1], [4, 2, 0], [1, 1, 1], [2, 0, 4], [0, 0, 2], [4, 4, 1], [2, 1, 0], [1, 2, 4]]
    p = make_problem(SMALL, 8, seed=13, routing=routing)
    got = moe_decode(*p.arrays, mode="fp64")
    H, I = SMALL.hidden, SMALL.intermediate
    pairs = {int(e): int(np.sum(p.topk_ids == e)) for e in np.unique(p.topk_ids)}
    assert 3 not in pairs and sum(pairs.values()) == 8 * 3
    expected = [call for e in sorted(pairs) for call in ((pairs[e], (2 * I, H)), (pairs[e], (H, I)))]
    assert calls == expected
    assert got.dtype == np.float64
    assert rel_l2(got, plain_loop(*p.arrays, mode="fp64")) < 1e-12
