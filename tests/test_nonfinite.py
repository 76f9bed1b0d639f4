"""The NaN / inf policy (kernels/contract.py's docstring): the routing is checked; activations and weights are never
inspected, and a NaN or inf in them reaches exactly the outputs it feeds -- one in x[t] makes out[t] non-finite, one in
expert e's weights only the tokens routed to e (w13's: whole rows; w2[e, h, :]'s: column h) -- every other output
bitwise what it is without it. In the reference (every mode, every weight format) on the CPU; in kernels.moe_decode
(every weight format and policy), the strict path and the expert-centric path (every quant, W8A8) on the GPU, at
qwen3-30b-a3b, outputs NaN-poisoned first (and once more filled with finite bits: a row never written cannot pass
as a NaN one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kernels
from kernels.contract import BF16, array_module, check_inputs
from kernels.formats import BF16_T16, FORMATS, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4, NVFP4, get_format
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS, MoEShape

TINY = PRESETS["tiny"]
TINY_TILED = TINY.with_(name="tiny-tiled", hidden=192, intermediate=64)  # whole tiles of 64 values
QWEN30 = PRESETS["qwen3-30b-a3b"]
REFERENCE_MODES = [("fp64", None), ("warp_decode", None), ("classical", None), ("classical", "fp8"),
                   ("classical", "mxfp8")]
HIT, DOWN, MISS = 0, 1, 5  # w13 poisoned / w2 poisoned / both poisoned and routed by no token
BF16_NAN, BF16_INF = 0x7FC0, 0x7F80
SCALE_BLOCK = 128


def poisoned_routing(rng: np.random.Generator, shape: MoEShape, tokens: int) -> np.ndarray:
    """[T, K] distinct ids per token, none of them HIT, DOWN or MISS but: from T = 3, token 0 routes to HIT, token 1
    to HIT and DOWN, token 2 to DOWN (the rest to neither); below, token 0 to DOWN only."""
    others = np.setdiff1d(np.arange(shape.experts), [HIT, DOWN, MISS])
    k = shape.top_k
    ids = np.stack([rng.permutation(others)[:k] for _ in range(tokens)]).astype(np.int32)
    if tokens >= 3:
        ids[0, 0], ids[1, k - 1], ids[1, 0], ids[2, k // 2] = HIT, HIT, DOWN, DOWN
    else:
        ids[0, 0] = DOWN
    return ids


def x_rows(tokens: int) -> list[int]:
    """The tokens whose activations get a NaN (the first) or an inf (the second)."""
    return [0] if tokens < 3 else [1, tokens - 1]


def poison_x(x: Any) -> Any:
    """A copy of x with a NaN in x[rows[0], 3] and an inf in x[rows[1], H - 1] (where the arrays live)."""
    x = x.copy()
    bits = x.view(np.uint16)
    rows = x_rows(int(x.shape[0]))
    bits[rows[0], 3] = BF16_NAN
    if len(rows) > 1:
        bits[rows[1], int(x.shape[1]) - 1] = BF16_INF
    return x


def in_format(fmt: str, w13: Any, w2: Any, poison: bool) -> tuple[Any, Any, list[int]]:
    """``(w13, w2, rows)``: bf16 weights (NumPy or CuPy, copied) in ``fmt``; with ``poison`` HIT's w13 holds an inf,
    DOWN's w2 a NaN in output rows ``rows``, MISS's both. On bf16 values one value each; on the fp8 formats one block
    scale each (a weight is value x scale): DOWN's w2 block row 1 (rows 128..255); on the 4-bit formats one scale
    byte each (e8m0's NaN 0xFF, e4m3's 0x7F), nvfp4's HIT through its global scale (inf: its whole w13)."""
    w13, w2 = w13.copy(), w2.copy()
    hidden, inter = int(w2.shape[1]), int(w2.shape[2])
    if fmt in (MXFP4.name, NVFP4.name):
        q13, q2 = kernels.quantize_weights(w13, w2, fmt)
        rows = [hidden // 2 + 3]
        if poison:
            nan = 0x7F if fmt == NVFP4.name else 0xFF
            if fmt == NVFP4.name:
                q13.global_scale[HIT] = np.inf
            else:
                q13.scales[HIT, 3, 0] = nan  # gate row 3, values 0..31
            q13.scales[MISS, 2 * inter - 1, -1] = nan  # an up row's last block
            q2.scales[DOWN, rows[0], 0] = nan
            q2.scales[MISS, 0, 0] = nan
        return q13, q2, rows
    if fmt in ("bf16", BF16_T16.name):
        rows = [hidden // 2 + 3]
        if poison:
            bits13, bits2 = w13.view(np.uint16), w2.view(np.uint16)
            bits13[HIT, 3, 5] = BF16_INF  # a gate row
            bits13[MISS, 2 * inter - 1, hidden - 1] = BF16_INF  # an up row
            bits2[DOWN, rows[0], 7] = BF16_NAN
            bits2[MISS, 0, 0] = BF16_NAN
        return (w13, w2, rows) if fmt == "bf16" else (*BF16_T16.from_rows(w13, w2), rows)
    q13, q2 = kernels.quantize_weights(w13, w2, FP8_BLOCK128.name)
    rows = list(range(SCALE_BLOCK, min(2 * SCALE_BLOCK, hidden)))
    if poison:
        q13.scales[HIT, 0, 0] = float("inf")  # gate rows 0..127 x columns 0..127
        q13.scales[MISS, -1, -1] = float("inf")
        q2.scales[DOWN, 1, 0] = float("nan")
        q2.scales[MISS, 0, 0] = float("nan")
    return (q13, q2, rows) if fmt == FP8_BLOCK128.name else (*FP8_BLOCK128_T16.from_rows(q13, q2), rows)


def weight_mask(ids: np.ndarray, hidden: int, rows: list[int]) -> np.ndarray:
    """Where poisoned weights (:func:`in_format`) must make the output non-finite: the whole rows of tokens routed
    to HIT, ``rows`` of those routed to DOWN, nothing else."""
    mask = np.zeros((ids.shape[0], hidden), bool)
    for t, routed in enumerate(ids):
        if HIT in routed:
            mask[t] = True
        elif DOWN in routed:
            mask[t, rows] = True
    return mask


def x_mask(tokens: int, hidden: int) -> np.ndarray:
    mask = np.zeros((tokens, hidden), bool)
    mask[x_rows(tokens)] = True
    return mask


def _bits(out: np.ndarray) -> np.ndarray:
    return out.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[out.dtype.itemsize])


def assert_propagates(got: np.ndarray, clean: np.ndarray, mask: np.ndarray, what: str) -> None:
    """Non-finite exactly where ``mask`` says; everywhere else bitwise the clean run's output (which is finite)."""
    assert np.isfinite(clean.astype(np.float32)).all(), f"{what}: the clean run is not finite"
    nonfinite = ~np.isfinite(got.astype(np.float32))
    wrong = np.argwhere(nonfinite != mask)
    if wrong.size:
        t, h = (int(i) for i in wrong[0])
        pytest.fail(f"{what}: {len(wrong)} outputs {'finite' if mask[t, h] else 'non-finite'} where they should not "
                    f"be, the first out[{t}, {h}] = {got[t, h]} (rows wrong: {sorted(set(wrong[:, 0].tolist()))})")
    differs = np.argwhere((_bits(got) != _bits(clean)) & ~mask)
    if differs.size:
        t, h = (int(i) for i in differs[0])
        pytest.fail(f"{what}: {len(differs)} finite outputs differ from the clean run's, the first out[{t}, {h}] = "
                    f"{got[t, h]} vs {clean[t, h]}: the non-finite value reached outputs it does not feed")


# ---------------------------------------------------------------------------------------------------
# The reference, on the CPU
# ---------------------------------------------------------------------------------------------------
def test_routing_is_checked_data_is_not() -> None:
    """check_inputs refuses a non-finite routing weight but reads neither x nor the weights: NaN there passes."""
    p = make_problem("tiny", 3, seed=4)
    w13, w2, _ = in_format("bf16", p.w13, p.w2, poison=True)
    assert check_inputs(poison_x(p.x), w13, w2, p.topk_ids, p.topk_weights).tokens == 3
    bad = p.topk_weights.copy()
    bad[1, 0] = np.nan
    with pytest.raises(ValueError, match="topk_weights must be finite"):
        check_inputs(p.x, p.w13, p.w2, p.topk_ids, bad)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_propagates_to_exactly_the_outputs_fed(rng: np.random.Generator, fmt: str) -> None:
    """reference.moe_decode in every mode (classical: every activation quantization too): a NaN / inf in x[t] makes
    out[t] non-finite, one in expert e's weights reaches only the tokens routed to e, as far as it feeds them;
    every other output is bitwise the clean run's. The tiny shape (tiled formats: H = 192, I = 64), T = 6."""
    shape = TINY_TILED if get_format(fmt).tiled else TINY
    tokens = 6
    p = make_problem(shape, tokens, seed=int(rng.integers(1 << 30)), routing=poisoned_routing(rng, shape, tokens))
    clean13, clean2, rows = in_format(fmt, p.w13, p.w2, poison=False)
    bad13, bad2, _ = in_format(fmt, p.w13, p.w2, poison=True)
    ids, wts = p.topk_ids, p.topk_weights
    assert (wts > 0).all()
    for mode, quant in REFERENCE_MODES:
        what = f"reference {mode}{f' {quant}' if quant else ''} on {fmt}"
        clean = moe_decode(p.x, clean13, clean2, ids, wts, mode=mode, quant=quant)
        assert_propagates(moe_decode(p.x, bad13, bad2, ids, wts, mode=mode, quant=quant), clean,
                          weight_mask(ids, shape.hidden, rows), f"{what}, poisoned weights")
        assert_propagates(moe_decode(poison_x(p.x), clean13, clean2, ids, wts, mode=mode, quant=quant), clean,
                          x_mask(tokens, shape.hidden), f"{what}, poisoned x")


def test_poisoned_routing_leaves_tokens_untouched(rng: np.random.Generator) -> None:
    """The routing the tests use: some tokens route to the poisoned experts, some to none; MISS to no token."""
    for shape, tokens in ((TINY, 6), (QWEN30, 8), (QWEN30, 1)):
        ids = poisoned_routing(rng, shape, tokens).tolist()
        assert all(len(set(row)) == shape.top_k for row in ids) and MISS not in np.asarray(ids)
        assert any(DOWN in row and HIT not in row for row in ids)
        if tokens >= 3:
            assert any(HIT in row for row in ids) and any(HIT not in row and DOWN not in row for row in ids)


# ---------------------------------------------------------------------------------------------------
# The GPU paths
# ---------------------------------------------------------------------------------------------------


def _runs(cupy: Any, call: Any, tokens: int, hidden: int) -> list[np.ndarray]:
    """``call(out)`` into a NaN-poisoned output and into one filled with finite bits (1.0): a row it never writes
    fails one of the two checks."""
    got = []
    for fill in (BF16_NAN, 0x3F80):
        out = cupy.empty((tokens, hidden), BF16)
        out.view(cupy.uint16).fill(fill)
        assert call(out) is out
        cupy.cuda.runtime.deviceSynchronize()
        got.append(cupy.asnumpy(out))
    return got


def _check_path(cupy: Any, call: Any, p: Any, weights: tuple[Any, Any, Any, Any], rows: list[int],
                what: str) -> None:
    """``call(x, w13, w2, out)`` on clean inputs, poisoned weights and poisoned x (``weights``: clean w13, w2, then
    poisoned ones)."""
    clean13, clean2, bad13, bad2 = weights
    tokens, hidden = p.tokens, p.shape.hidden
    ids = cupy.asnumpy(p.topk_ids)
    clean = _runs(cupy, lambda out: call(p.x, clean13, clean2, out), tokens, hidden)
    assert np.array_equal(_bits(clean[0]), _bits(clean[1])), f"{what}: clean runs differ (a row not written?)"
    for got in _runs(cupy, lambda out: call(p.x, bad13, bad2, out), tokens, hidden):
        assert_propagates(got, clean[0], weight_mask(ids, hidden, rows), f"{what}, poisoned weights")
    x = poison_x(p.x)
    for got in _runs(cupy, lambda out: call(x, clean13, clean2, out), tokens, hidden):
        assert_propagates(got, clean[0], x_mask(tokens, hidden), f"{what}, poisoned x")


def _gpu_problem(cupy: Any, rng: np.random.Generator, tokens: int) -> Any:
    ids = poisoned_routing(rng, QWEN30, tokens)
    return make_problem(QWEN30, tokens, seed=int(rng.integers(1, 1 << 30)), routing=ids, xp=cupy)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_decode_propagates_to_exactly_the_outputs_fed(cupy_mod: Any, rng: np.random.Generator, tokens: int,
                                                         fmt: str) -> None:
    """kernels.moe_decode on every weight format under every policy (each policy's choice for qwen3-30b at this T on
    this GPU): the reference's propagation, bitwise outside the poisoned outputs."""
    from kernels import dispatch

    if fmt not in dispatch.FORMAT_CANDIDATES:
        pytest.skip(f"no kernel reads {fmt} weights yet (the reference does: the CPU test above)")
    cupy = cupy_mod
    p = _gpu_problem(cupy, rng, tokens)
    clean13, clean2, rows = in_format(fmt, p.w13, p.w2, poison=False)
    bad13, bad2, _ = in_format(fmt, p.w13, p.w2, poison=True)
    dims = check_inputs(p.x, clean13, clean2, p.topk_ids, p.topk_weights, weight_format=fmt)
    for policy in dispatch.POLICIES:
        ws = dispatch.make_workspace(dims, policy=policy, weight_format=fmt)

        def call(x: Any, w13: Any, w2: Any, out: Any, ws: Any = ws, policy: str = policy) -> Any:
            return kernels.moe_decode(x, w13, w2, p.topk_ids, p.topk_weights, out=out, workspace=ws, policy=policy)

        _check_path(cupy, call, p, (clean13, clean2, bad13, bad2), rows,
                    f"moe_decode {fmt} T={tokens} {policy} ({ws.choice})")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_strict_and_expert_centric_paths_propagate_likewise(cupy_mod: Any, rng: np.random.Generator,
                                                            tokens: int) -> None:
    """The strict path (bf16, fp8-block128) and the expert-centric path -- bf16 with each activation quantization
    (the reference's "classical" mode) and W8A8 on fp8-block128 -- called directly, whatever the table picks."""
    cupy = cupy_mod
    p = _gpu_problem(cupy, rng, tokens)
    for fmt in ("bf16", FP8_BLOCK128.name):
        clean13, clean2, rows = in_format(fmt, p.w13, p.w2, poison=False)
        bad13, bad2, _ = in_format(fmt, p.w13, p.w2, poison=True)
        weights = (clean13, clean2, bad13, bad2)

        def strict(x: Any, w13: Any, w2: Any, out: Any) -> Any:
            return kernels.warp_decode(x, w13, w2, p.topk_ids, p.topk_weights, out=out)

        _check_path(cupy, strict, p, weights, rows, f"warp_decode (strict) {fmt} T={tokens}")
        for quant in ((None, "fp8", "mxfp8") if fmt == "bf16" else ("fp8",)):
            def expert_centric(x: Any, w13: Any, w2: Any, out: Any, quant: str | None = quant) -> Any:
                return kernels.expert_centric(x, w13, w2, p.topk_ids, p.topk_weights, quant=quant, out=out)

            _check_path(cupy, expert_centric, p, weights, rows, f"expert_centric quant={quant} {fmt} T={tokens}")


def test_helpers_live_where_the_arrays_do() -> None:
    """in_format and poison_x work on the arrays' own module (NumPy here, CuPy on the GPU tests) and copy."""
    p = make_problem("tiny", 2, seed=1)
    w13, w2, _ = in_format("bf16", p.w13, p.w2, poison=True)
    assert array_module(w13) is np and np.isfinite(p.w13.astype(np.float32)).all()
    assert not np.isfinite(w13.astype(np.float32)).all() and not np.isfinite(w2.astype(np.float32)).all()
    x = poison_x(p.x)
    assert np.isfinite(p.x.astype(np.float32)).all() and np.isnan(x.astype(np.float32)[0, 3])
