"""gpt-oss's expert layer on the CPU: the clamped SwiGLU by hand, its interleaved rows, the experts' biases in every
reference mode against a float64 computation written here, the problems that carry them, and the loader of the
checkpoint's MXFP4 tensors on arrays built here (never downloaded).

Sources (cited in kernels/activation.py, kernels/shapes.py, kernels/formats.py): openai/gpt-oss gpt_oss/torch/model.py
(``swiglu``, ``MLPBlock``) and gpt_oss/torch/weights.py (``FP4_VALUES``, low nibble = even element, scale - 127);
transformers' GptOssExperts and convert_gpt_oss_weights_to_hf.py (the Hugging Face tensor names).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels import BF16, gpt_oss_experts_from_checkpoint, make_problem
from kernels.activation import GPT_OSS, SILU, Activation, deinterleave, get_activation
from kernels.formats import Quantized
from kernels.numerics import bf16_to_f32, quantize, rel_l2, silu, through_bf16
from kernels.problem import make_biases
from kernels.reference import expert_ffn, moe_decode
from kernels.shapes import get_shape

# gpt-oss's layer at a size the CPU runs in milliseconds (I a multiple of 32: the MXFP4 blocks)
OSS = get_shape("tiny").with_(name="oss-small", hidden=64, intermediate=32, experts=5, top_k=4,
                              activation="gpt-oss", bias=True)
# gpt-oss's activation reading the checkpoints' own row order (gate j = row 2j, up j = row 2j + 1): what the loader's
# de-interleaving must be equivalent to
OSS_INTERLEAVED = Activation("gpt-oss-interleaved", interleaved=True, limit=7.0, alpha=1.702, up_offset=1.0)
MODES = [("fp64", None), ("warp_decode", None), ("classical", None), ("classical", "fp8"), ("classical", "mxfp8")]


def swiglu_by_hand(g: float, u: float) -> float:
    """gpt-oss's formula written out for one (gate, up) pair, in Python floats."""
    g = min(g, 7.0)
    u = max(-7.0, min(u, 7.0))
    return g * (1.0 / (1.0 + math.exp(-1.702 * g))) * (u + 1.0)


# -- the activation -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpt_oss_activation_by_hand(dtype: type) -> None:
    """Clamps on both sides of up, only above on gate, the +1 on up, alpha 1.702 inside the sigmoid."""
    gate = np.array([10.0, 7.0, 6.5, -10.0, -20.0, 1.0, 0.0, 2.5, 1.0, 3.0], dtype)
    up = np.array([10.0, -10.0, 0.0, 0.0, 3.0, 0.0, 5.0, -1.0, -9.0, 7.5], dtype)
    got = GPT_OSS(gate, up)
    assert got.dtype == dtype
    want = np.array([swiglu_by_hand(float(g), float(u)) for g, u in zip(gate, up, strict=True)])
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-15, atol=1e-30)
    # each piece on its own
    sig = 1.0 / (1.0 + math.exp(-1.702 * 7.0))
    assert got[0] == pytest.approx(7.0 * sig * 8.0, rel=1e-6)  # gate 10 -> 7, up 10 -> 7, then + 1
    assert got[1] == pytest.approx(7.0 * sig * -6.0, rel=1e-6)  # up -10 -> -7, + 1
    assert got[3] == pytest.approx(-10.0 / (1.0 + math.exp(17.02)), rel=1e-6)  # gate is not clamped below
    assert got[5] == pytest.approx(1.0 / (1.0 + math.exp(-1.702)), rel=1e-6)  # alpha: not SiLU(1) = 0.731
    assert got[5] != pytest.approx(1.0 / (1.0 + math.exp(-1.0)), rel=1e-3)
    assert got[6] == 0.0 and got[8] == pytest.approx(-6.0 / (1.0 + math.exp(-1.702)), rel=1e-6)  # up -9 -> -7, + 1
    # NaN passes the clamps (as torch.clamp lets it); an inf gate is clamped to 7
    nan = GPT_OSS(np.array([np.nan, 1.0, np.inf], dtype), np.array([0.0, np.nan, 0.0], dtype))
    assert np.isnan(nan[0]) and np.isnan(nan[1]) and nan[2] == pytest.approx(swiglu_by_hand(7.0, 0.0), rel=1e-6)


def test_silu_activation_is_the_contracts_bitwise() -> None:
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((3, 40)).astype(np.float32) * 6 for _ in range(2))
    got = SILU(gate, up)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), (silu(gate) * up).view(np.uint32))
    gate_up = np.concatenate([gate, up], axis=1)
    assert np.array_equal(SILU.apply(gate_up), got)


def test_interleaved_split() -> None:
    """The lab's gpt-oss activation reads the contract's order; an interleaved activation (the checkpoints' order)
    splits rows 2j / 2j + 1, and deinterleave gathers those rows into the contract's order."""
    gate_up = np.arange(12.0).reshape(2, 6)  # [g0 u0 g1 u1 g2 u2] per row in a gpt-oss checkpoint
    gate, up = OSS_INTERLEAVED.split(gate_up)
    assert gate.tolist() == [[0, 2, 4], [6, 8, 10]] and up.tolist() == [[1, 3, 5], [7, 9, 11]]
    for act in (SILU, GPT_OSS):
        gate, up = act.split(gate_up)
        assert gate.tolist() == [[0, 1, 2], [6, 7, 8]] and up.tolist() == [[3, 4, 5], [9, 10, 11]]
        assert act.gate_rows(3).tolist() == [0, 1, 2] and act.up_rows(3).tolist() == [3, 4, 5]
    assert OSS_INTERLEAVED.gate_rows(3).tolist() == [0, 2, 4] and OSS_INTERLEAVED.up_rows(3).tolist() == [1, 3, 5]
    assert deinterleave(gate_up, axis=-1).tolist() == [[0, 2, 4, 1, 3, 5], [6, 8, 10, 7, 9, 11]]
    with pytest.raises(ValueError, match="must be even"):
        OSS_INTERLEAVED.split(np.zeros((1, 5)))
    with pytest.raises(ValueError, match="axis -1 must be even"):
        deinterleave(np.zeros((1, 5)), axis=-1)


def test_activation_lookup_and_fields() -> None:
    assert get_activation("gpt-oss") is GPT_OSS and get_activation(SILU) is SILU
    with pytest.raises(ValueError, match="unknown activation 'swiglu'; known: silu, gpt-oss"):
        get_activation("swiglu")
    with pytest.raises(TypeError, match="activation must be a name"):
        get_activation(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be > 0"):
        Activation("x", limit=0.0)
    with pytest.raises(ValueError, match="alpha must be finite"):
        Activation("x", alpha=float("nan"))


# -- the reference with biases --------------------------------------------------------------------------------------
def oss_problem(tokens: int = 5, seed: int = 4, x_scale: float = 4.0, bias_scale: float = 8.0,
                routing: object = "uniform"):
    """A gpt-oss problem whose activations reach the clamps: x and the biases scaled by powers of two (exact in
    bf16), so gate_up ~ N(0, 16): |gate_up| > 7 in about 8 % of the values."""
    p = make_problem(OSS, tokens, seed=seed, routing=routing)
    p.x = (bf16_to_f32(p.x) * np.float32(x_scale)).astype(BF16)
    p.b13 = (bf16_to_f32(p.b13) * np.float32(bias_scale)).astype(BF16)
    p.b2 = (bf16_to_f32(p.b2) * np.float32(bias_scale)).astype(BF16)
    return p


def plain_layer(x, w13, w2, ids, wts, b13, b2, mode: str, quant: str | None = None, interleaved: bool = True,
                clamp: bool = True) -> np.ndarray:
    """Token by token, slot by slot, gpt-oss's expert written out (or SiLU * up, ``clamp`` False and halves):
    float64, or float32 with the mode's bf16 roundings (warp_decode: the activation; classical: gate_up after its
    bias, the activation, down after its bias)."""
    acc = np.float64 if mode == "fp64" else np.float32
    T, K = ids.shape
    H, I = x.shape[1], w2.shape[2]
    out = np.zeros((T, H), acc)
    for t in range(T):
        xt = bf16_to_f32(x[t])
        if mode == "classical":
            xt = quantize(xt[None], quant)[0]
        xt = xt.astype(acc)
        for k in range(K):
            e = ids[t, k]
            w13_e, w2_e = bf16_to_f32(w13[e]).astype(acc), bf16_to_f32(w2[e]).astype(acc)
            gu = np.array([np.dot(w13_e[r], xt) for r in range(2 * I)], acc)
            if b13 is not None:
                gu = gu + bf16_to_f32(b13[e]).astype(acc)
            if mode == "classical":
                gu = through_bf16(gu)
            hidden = np.empty(I, acc)
            for j in range(I):
                g, u = (gu[2 * j], gu[2 * j + 1]) if interleaved else (gu[j], gu[I + j])
                if clamp:
                    g, u = min(g, acc(7.0)), min(max(u, acc(-7.0)), acc(7.0))
                    hidden[j] = g / (acc(1) + np.exp(-acc(1.702) * g)) * (u + acc(1))
                else:
                    hidden[j] = g / (acc(1) + np.exp(-g)) * u
            if mode == "warp_decode":
                hidden = through_bf16(hidden)
            if mode == "classical":
                hidden = quantize(through_bf16(hidden)[None], quant)[0]
            down = np.array([np.dot(w2_e[h], hidden.astype(acc)) for h in range(H)], acc)
            if b2 is not None:
                down = down + bf16_to_f32(b2[e]).astype(acc)
            if mode == "classical":
                down = through_bf16(down)
            out[t] += acc(wts[t, k]) * down
    return out


@pytest.mark.parametrize(("mode", "quant"), MODES)
def test_biases_and_gpt_oss_in_every_mode(mode: str, quant: str | None) -> None:
    p = oss_problem(routing=[[0, 1, 1, 4], [4, 2, 0, 3], [3, 3, 3, 3], [1, 0, 2, 4], [2, 4, 1, 0]])
    got = moe_decode(*p.arrays, **p.layer, mode=mode, quant=quant,
                     out_dtype=np.float64 if mode == "fp64" else np.float32)
    want = plain_layer(*p.arrays, p.b13, p.b2, mode, quant, interleaved=False)
    # fp32 sums in BLAS order vs np.dot order: a few ulps; an intermediate bf16 rounding may flip
    assert rel_l2(got, want) < (1e-12 if mode == "fp64" else 2e-3)
    # the inputs reach the clamps, and without biases (or with SiLU) the answer is another
    gate_up = np.einsum("th,rh->tr", bf16_to_f32(p.x).astype(np.float64), bf16_to_f32(p.w13[0]).astype(np.float64))
    I = OSS.intermediate
    assert (gate_up[:, :I] > 7).any() and (gate_up[:, I:] < -7).any() and (gate_up[:, I:] > 7).any()
    for other in ({"activation": "gpt-oss", "b13": p.b13}, {"activation": "gpt-oss", "b2": p.b2},
                  {"activation": "silu", "b13": p.b13, "b2": p.b2}):
        assert rel_l2(moe_decode(*p.arrays, **other, mode=mode, quant=quant, out_dtype=got.dtype), got) > 1e-2


@pytest.mark.parametrize(("mode", "quant"), MODES[:3])
def test_biases_with_silu(mode: str, quant: str | None) -> None:
    """Biases are independent of the activation: the contract's SiLU layer with b13 and b2."""
    p = oss_problem()
    got = moe_decode(*p.arrays, b13=p.b13, b2=p.b2, mode=mode, out_dtype=np.float64 if mode == "fp64" else np.float32)
    want = plain_layer(*p.arrays, p.b13, p.b2, mode, interleaved=False, clamp=False)
    assert rel_l2(got, want) < (1e-12 if mode == "fp64" else 2e-3)


def test_b2_is_weighted_by_the_routing_weight() -> None:
    """x = 0 and no b13: every expert's hidden is 0 (SiLU(0) * 0), so out[t] = sum_k w[t, k] b2[e_k], exactly
    (as gpt-oss's MLPBlock adds mlp2_bias before the expert_weights einsum)."""
    p = oss_problem(tokens=3, routing=[[0, 1, 2, 3], [4, 4, 0, 1], [2, 2, 2, 2]])
    x = np.zeros_like(p.x)
    got = moe_decode(x, p.w13, p.w2, p.topk_ids, p.topk_weights, b2=p.b2)
    b2 = bf16_to_f32(p.b2).astype(np.float64)
    want = np.stack([sum(float(p.topk_weights[t, k]) * b2[p.topk_ids[t, k]] for k in range(4)) for t in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


def test_interleaved_rows_are_the_halves_permuted() -> None:
    """A checkpoint's interleaved w13 (and b13) read by the interleaved activation is the same layer as its rows
    de-interleaved read by the lab's gpt-oss activation."""
    p = oss_problem()
    w13h, b13h = deinterleave(p.w13), deinterleave(p.b13, axis=-1)
    for mode in ("fp64", "warp_decode", "classical"):
        a = moe_decode(*p.arrays, activation=OSS_INTERLEAVED, b13=p.b13, b2=p.b2, mode=mode,
                       out_dtype=np.float64 if mode == "fp64" else np.float32)
        b = moe_decode(p.x, w13h, p.w2, p.topk_ids, p.topk_weights, activation="gpt-oss", b13=b13h, b2=p.b2,
                       mode=mode, out_dtype=a.dtype)
        assert rel_l2(a, b) < (1e-13 if mode == "fp64" else 2e-3), mode


def test_modes_on_a_gpt_oss_problem() -> None:
    """make_problem's own gpt-oss problem (biases at their generated scale): the bf16 modes near the oracle, warp
    decode nearer than the classical path, and expert_ffn's float64 expert the oracle's, pair by pair."""
    p = make_problem(OSS, 6, seed=9)
    oracle = moe_decode(*p.arrays, **p.layer)
    warp = moe_decode(*p.arrays, **p.layer, mode="warp_decode")
    classical = moe_decode(*p.arrays, **p.layer, mode="classical")
    assert warp.dtype == BF16 and rel_l2(warp.astype(np.float32), oracle) < 6e-3
    assert rel_l2(warp.astype(np.float32), oracle) < rel_l2(classical.astype(np.float32), oracle)
    want = np.zeros_like(oracle)
    for t in range(6):
        for k in range(OSS.top_k):
            e = p.topk_ids[t, k]
            want[t] += float(p.topk_weights[t, k]) * expert_ffn(p.x[t:t + 1], p.w13[e], p.w2[e], "gpt-oss",
                                                                 p.b13[e], p.b2[e])[0]
    assert rel_l2(oracle, want) < 1e-13


def test_bias_checks_name_the_argument() -> None:
    p = oss_problem(tokens=2)
    E, I, H = OSS.experts, OSS.intermediate, OSS.hidden
    cases = [
        ({"b13": p.b13.astype(np.float32)}, TypeError, "b13 must have dtype bfloat16, got float32"),
        ({"b2": p.b2[:, :8].copy()}, ValueError, rf"b2 must be \[E, H\] = \[{E}, {H}\] to match the weights"),
        ({"b13": p.b13[:, :I].copy()}, ValueError, rf"b13 must be \[E, 2I\] = \[{E}, {2 * I}\]"),
        ({"b13": p.b13[:-1]}, ValueError, "b13 must be"),
        ({"b2": p.b2[None]}, ValueError, r"b2 must have 2 dimensions \[E, H\]"),
        ({"b2": p.b2[:, ::2]}, ValueError, "b2 must be"),
        ({"b13": p.b13.T.copy().T}, ValueError, "b13 must be C-contiguous"),
        ({"b13": list(p.b13)}, TypeError, "b13 must be a numpy array like x"),
        ({"activation": "relu"}, ValueError, "unknown activation 'relu'"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            moe_decode(*p.arrays, **kwargs)


# -- problems that carry the biases ---------------------------------------------------------------------------------
def test_make_problem_for_gpt_oss() -> None:
    b13, b2 = make_biases("gpt-oss-120b", seed=5)  # the preset's biases (its weights: 20 GB, not here)
    assert b13.dtype == BF16 and b13.shape == (128, 2 * 2880) and b2.dtype == BF16 and b2.shape == (128, 2880)
    assert bf16_to_f32(b13).std() == pytest.approx(2880**-0.5, rel=0.01)
    assert bf16_to_f32(b2).std() == pytest.approx(2880**-0.5, rel=0.01)
    shape = OSS.with_(hidden=96, intermediate=40)  # H != I: each bias at its own fan-in
    p = make_problem(shape, 2, seed=5)
    assert p.b13.dtype == BF16 and p.b13.shape == (5, 80) and p.b2.dtype == BF16 and p.b2.shape == (5, 96)
    assert np.array_equal(p.b13.view(np.uint16), make_biases(shape, 5)[0].view(np.uint16))
    assert bf16_to_f32(p.b13).std() < bf16_to_f32(p.b2).std()  # 1/sqrt(96) < 1/sqrt(40)
    assert p.layer == {"activation": "gpt-oss", "b13": p.b13, "b2": p.b2}
    # the biases have their own stream: the contract's arrays are the bits the same shape without biases gets
    plain = make_problem(shape.with_(bias=False, activation="silu"), 2, seed=5)
    for a, b in zip(p.arrays, plain.arrays, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert plain.b13 is None and plain.layer == {"activation": "silu", "b13": None, "b2": None}
    assert not np.array_equal(make_problem(shape, 2, seed=6).b13.view(np.uint16), p.b13.view(np.uint16))


def test_compact_and_copies_carry_the_biases() -> None:
    p = make_problem(OSS, 3, seed=2, routing=[[4, 1, 1, 4], [1, 4, 4, 1], [4, 4, 4, 4]])
    small = p.compact()
    assert small.shape.experts == 2 and small.b13.shape == (2, 2 * OSS.intermediate)
    assert np.array_equal(small.b13.view(np.uint16), p.b13[[1, 4]].view(np.uint16))
    assert np.array_equal(small.b2.view(np.uint16), p.b2[[1, 4]].view(np.uint16))
    assert np.array_equal(moe_decode(*small.arrays, **small.layer), moe_decode(*p.arrays, **p.layer))
    host = p.to_numpy()
    assert host.b13 is not None and np.array_equal(host.b2.view(np.uint16), p.b2.view(np.uint16))


# -- the checkpoint loader ------------------------------------------------------------------------------------------
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(q: Quantized) -> np.ndarray:
    """The lab's MXFP4 layout read back in float64: values [E, R, k/2] two e2m1 a byte (low nibble = even k),
    scales [E, R, ceil(k/32)] e8m0 = 2^(s - 127)."""
    codes = np.stack([q.values & 0x0F, q.values >> 4], axis=-1).reshape(*q.values.shape[:2], -1)
    k = codes.shape[-1]
    scales = np.repeat(np.ldexp(1.0, q.scales.astype(np.int64) - 127), 32, axis=-1)[..., :k]
    return E2M1[codes] * scales


def dense_to_blocks(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes [E, R, k] packed as a checkpoint's blocks [E, R, k/32, 16]: byte j = code 2j | code 2j + 1 << 4."""
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed.reshape(*codes.shape[:2], -1, 16)


def checkpoint(experts: int = 3, hidden: int = 64, inter: int = 32, seed: int = 0, prefix: str = "",
               names: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """One layer's gpt-oss tensors built here, and the dense weights they hold (float64, as the codes say)."""
    rng = np.random.default_rng(seed)
    gu_codes = rng.integers(0, 16, (experts, 2 * inter, hidden), dtype=np.uint8)
    dn_codes = rng.integers(0, 16, (experts, hidden, inter), dtype=np.uint8)
    gu_scales = rng.integers(117, 131, (experts, 2 * inter, hidden // 32), dtype=np.uint8)
    dn_scales = rng.integers(117, 131, (experts, hidden, inter // 32), dtype=np.uint8)
    b13 = (rng.standard_normal((experts, 2 * inter)) * 0.1).astype(BF16)
    b2 = (rng.standard_normal((experts, hidden)) * 0.1).astype(BF16)
    arrays = (dense_to_blocks(gu_codes), gu_scales, b13, dense_to_blocks(dn_codes), dn_scales, b2)
    names = names or ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                      "down_proj_blocks", "down_proj_scales", "down_proj_bias")
    tensors = {prefix + n: a for n, a in zip(names, arrays, strict=True)}
    dense = {"w13": E2M1[gu_codes] * np.repeat(np.ldexp(1.0, gu_scales.astype(np.int64) - 127), 32, axis=-1),
             "w2": E2M1[dn_codes] * np.repeat(np.ldexp(1.0, dn_scales.astype(np.int64) - 127), 32, axis=-1)}
    return tensors, dense


def test_loader_round_trip() -> None:
    tensors, dense = checkpoint()
    w13, w2, b13, b2 = gpt_oss_experts_from_checkpoint(tensors)
    assert isinstance(w13, Quantized) and w13.layout == "rows-e2m1x2"
    assert w13.values.dtype == np.uint8 and w13.values.shape == (3, 64, 32) and w13.scales.shape == (3, 64, 2)
    assert w2.values.dtype == np.uint8 and w2.values.shape == (3, 64, 16) and w2.scales.shape == (3, 64, 1)
    assert w13.scales.dtype == np.uint8 and w2.scales.dtype == np.uint8
    assert b13.dtype == BF16 and b13.shape == (3, 64) and b2.dtype == BF16 and b2.shape == (3, 64)
    np.testing.assert_array_equal(dequantize_mxfp4(w13), deinterleave(dense["w13"]))  # gate rows, then up rows
    np.testing.assert_array_equal(dequantize_mxfp4(w2), dense["w2"])
    # the bytes are the checkpoint's: w13's rows (and their scales, and b13) gathered, w2's reshaped
    blocks = tensors["gate_up_proj_blocks"].reshape(3, 64, 32)
    assert np.array_equal(w13.values, np.concatenate([blocks[:, 0::2], blocks[:, 1::2]], axis=1))
    assert np.array_equal(w13.scales, deinterleave(tensors["gate_up_proj_scales"]))
    assert np.array_equal(b13.view(np.uint16), deinterleave(tensors["gate_up_proj_bias"], axis=-1).view(np.uint16))
    assert np.shares_memory(w2.values, tensors["down_proj_blocks"])
    assert np.array_equal(b2.view(np.uint16), tensors["down_proj_bias"].view(np.uint16))


def test_loader_reads_as_gpt_oss_reads_the_blocks() -> None:
    """The blocks dequantized the way openai/gpt-oss's weights.py does (per 16-byte block: low nibbles to the even
    positions, high to the odd, ldexp by scale - 127) equal the loaded layout read back."""
    tensors, _ = checkpoint(seed=1)
    w13, _, _, _ = gpt_oss_experts_from_checkpoint(tensors)
    blocks, scales = tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"].astype(np.int64) - 127
    sub = np.empty((*blocks.shape[:-1], 32))
    sub[..., 0::2], sub[..., 1::2] = E2M1[blocks & 0x0F], E2M1[blocks >> 4]
    theirs = np.ldexp(sub, scales[..., None]).reshape(*blocks.shape[:2], -1)
    np.testing.assert_array_equal(dequantize_mxfp4(w13), deinterleave(theirs))


def test_loaded_layer_through_the_reference() -> None:
    """The loaded experts (dequantized here: e2m1 x 2^k is exact in bf16) through the reference's gpt-oss layer equal
    gpt-oss's MLPBlock written in float64 on the checkpoint's dense weights (interleaved rows), biases, the weighted
    b2."""
    tensors, dense = checkpoint(seed=2)
    w13q, w2q, b13, b2 = gpt_oss_experts_from_checkpoint(tensors)
    w13, w2 = dequantize_mxfp4(w13q).astype(BF16), dequantize_mxfp4(w2q).astype(BF16)
    assert np.array_equal(w13.astype(np.float64), deinterleave(dense["w13"]))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 64)) * 0.5).astype(BF16)
    ids = np.array([[0, 1, 2, 0], [2, 2, 1, 0], [1, 0, 2, 1], [0, 0, 0, 0]], np.int32)
    wts = rng.dirichlet(np.ones(4), 4).astype(np.float32)
    got = moe_decode(x, w13, w2, ids, wts, activation="gpt-oss", b13=b13, b2=b2)
    xs, bias13, bias2 = (bf16_to_f32(a).astype(np.float64) for a in (x, tensors["gate_up_proj_bias"], b2))
    want = np.zeros((4, 64))
    for t in range(4):
        for k in range(4):
            e = ids[t, k]
            t1 = dense["w13"][e] @ xs[t] + bias13[e]  # MLP #1
            t1 = np.array([swiglu_by_hand(t1[2 * j], t1[2 * j + 1]) for j in range(32)])
            want[t] += float(wts[t, k]) * (dense["w2"][e] @ t1 + bias2[e])  # MLP #2, + mlp2_bias, weighted
    assert rel_l2(got, want) < 1e-13


def test_loader_names_and_prefixes() -> None:
    hf, _ = checkpoint(prefix="model.layers.7.mlp.experts.")
    original, _ = checkpoint(prefix="block.7.mlp.", names=("mlp1_weight.blocks", "mlp1_weight.scales", "mlp1_bias",
                                                           "mlp2_weight.blocks", "mlp2_weight.scales", "mlp2_bias"))
    a = gpt_oss_experts_from_checkpoint(hf, prefix="model.layers.7.mlp.experts.")
    b = gpt_oss_experts_from_checkpoint(original, prefix="block.7.mlp.")
    assert np.array_equal(a[0].values, b[0].values) and np.array_equal(a[1].scales, b[1].scales)
    assert np.array_equal(a[3].view(np.uint16), b[3].view(np.uint16))
    with pytest.raises(ValueError, match="lacks 'gate_up_proj_blocks'"):
        gpt_oss_experts_from_checkpoint(hf)  # no prefix: nothing matches


def _broken(change: str, **kw: object) -> dict:
    tensors, _ = checkpoint(**kw)
    key = change.split(":")[0]
    arr = tensors[key]
    if change.endswith(":float"):
        tensors[key] = arr.astype(np.float32)
    elif change.endswith(":drop"):
        del tensors[key]
    elif change.endswith(":last8"):
        tensors[key] = np.ascontiguousarray(arr[..., :8])
    elif change.endswith(":rows-1"):
        tensors[key] = np.ascontiguousarray(arr[:, :-1])
    elif change.endswith(":experts-1"):
        tensors[key] = np.ascontiguousarray(arr[:-1])
    elif change.endswith(":nan"):
        arr = arr.copy()
        arr.reshape(-1)[5] = 255 if arr.dtype == np.uint8 else np.float32("nan")
        tensors[key] = arr
    elif change.endswith(":uint16"):
        tensors[key] = arr.view(np.uint16)
    return tensors


@pytest.mark.parametrize(("change", "error", "message"), [
    ("down_proj_scales:drop", ValueError, r"tensors lacks 'down_proj_scales' \(one layer's gpt-oss experts"),
    ("gate_up_proj_blocks:float", TypeError, r"'gate_up_proj_blocks' must be uint8 \(packed e2m1 pairs\), got float32"),
    ("gate_up_proj_scales:float", TypeError, r"'gate_up_proj_scales' must be uint8 \(e8m0 exponents\)"),
    ("gate_up_proj_blocks:last8", ValueError, r"'gate_up_proj_blocks' must be \[E, 2I, H/32, 16\] \(16 bytes"),
    ("gate_up_proj_blocks:rows-1", ValueError, r"its second dimension is 2I .* must be even, got 63"),
    ("down_proj_blocks:rows-1", ValueError, r"'down_proj_blocks' must be \[E, H, I/32, 16\] = \[3, 64, 1, 16\]"),
    ("down_proj_blocks:experts-1", ValueError, r"'down_proj_blocks' must be \[E, H, I/32, 16\]"),
    ("gate_up_proj_scales:rows-1", ValueError, r"'gate_up_proj_scales' must be 'gate_up_proj_blocks''s shape less"),
    ("down_proj_scales:nan", ValueError, r"'down_proj_scales' must be finite scales: 1 e8m0 NaN codes \(255\)"),
    ("gate_up_proj_bias:float", TypeError, r"'gate_up_proj_bias' must be bfloat16 \(or its uint16 bit patterns\)"),
    ("down_proj_bias:rows-1", ValueError, r"'down_proj_bias' must be \[E, H\] = \[3, 64\], got \[3, 63\]"),
])
def test_loader_errors(change: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        gpt_oss_experts_from_checkpoint(_broken(change))


def test_loader_edge_cases() -> None:
    # I not a multiple of 32: down's blocks cannot hold it
    tensors, _ = checkpoint()
    tensors["gate_up_proj_blocks"] = np.ascontiguousarray(tensors["gate_up_proj_blocks"][:, :48])
    tensors["gate_up_proj_scales"] = np.ascontiguousarray(tensors["gate_up_proj_scales"][:, :48])
    tensors["gate_up_proj_bias"] = np.ascontiguousarray(tensors["gate_up_proj_bias"][:, :48])
    with pytest.raises(ValueError, match=r"'down_proj_blocks' is \[E, H, I/32, 16\] with I = 24 .* I/32 = 0.75"):
        gpt_oss_experts_from_checkpoint(tensors)
    # biases as safetensors' NumPy loader gives bf16: uint16 bits
    tensors = _broken("gate_up_proj_bias:uint16")
    assert gpt_oss_experts_from_checkpoint(tensors)[2].dtype == BF16
    # a NaN bias
    tensors, _ = checkpoint()
    bias = tensors["down_proj_bias"].astype(np.float32)
    bias[1, 3] = np.inf
    tensors["down_proj_bias"] = bias.astype(BF16)
    with pytest.raises(ValueError, match=r"'down_proj_bias' must be finite: 1 NaN/inf values, the first at \[1, 3\]"):
        gpt_oss_experts_from_checkpoint(tensors)
    with pytest.raises(TypeError, match="tensors must be a mapping"):
        gpt_oss_experts_from_checkpoint([tensors])  # type: ignore[arg-type]
    tensors, _ = checkpoint()
    tensors["down_proj_bias"] = list(tensors["down_proj_bias"])
    with pytest.raises(TypeError, match="'down_proj_bias' must be a NumPy array, got list"):
        gpt_oss_experts_from_checkpoint(tensors)


def test_loaded_experts_are_the_mxfp4_format() -> None:
    """The loader's Quantized is the lab's mxfp4 (its layout, not fp8-block128's uint8 rows): format_of and the
    format's own dequantizer read it."""
    from kernels.formats import MXFP4, format_of, gpt_oss_experts_from_checkpoint

    rng = np.random.default_rng(7)
    experts, hidden, inter = 2, 64, 32
    tensors = {
        "gate_up_proj_blocks": rng.integers(0, 256, (experts, 2 * inter, hidden // 32, 16), dtype=np.uint8),
        "gate_up_proj_scales": rng.integers(120, 130, (experts, 2 * inter, hidden // 32), dtype=np.uint8),
        "gate_up_proj_bias": rng.standard_normal((experts, 2 * inter)).astype(BF16),
        "down_proj_blocks": rng.integers(0, 256, (experts, hidden, inter // 32, 16), dtype=np.uint8),
        "down_proj_scales": rng.integers(120, 130, (experts, hidden, inter // 32), dtype=np.uint8),
        "down_proj_bias": rng.standard_normal((experts, hidden)).astype(BF16),
    }
    w13, w2, _, _ = gpt_oss_experts_from_checkpoint(tensors)
    assert format_of(w13) == MXFP4.name
    assert MXFP4.dequantize(w13, "w13").shape == (experts, 2 * inter, hidden)
    assert MXFP4.dequantize(w2, "w2").shape == (experts, hidden, inter)
    x = rng.standard_normal((3, hidden)).astype(BF16)
    ids = np.array([[0, 1], [1, 0], [1, 1]], np.int32)
    weights = np.full((3, 2), 0.5, np.float32)
    b13, b2 = gpt_oss_experts_from_checkpoint(tensors)[2:]
    out = moe_decode(x, w13, w2, ids, weights, mode="fp64", activation="gpt-oss", b13=b13, b2=b2)
    assert out.shape == (3, hidden) and np.isfinite(out).all()
