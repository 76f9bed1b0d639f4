"""gpt-oss's expert layer in the batched kernel families: the activation and the biases as compiled layer code.

``kernels.activation.device_code`` puts ``expert_activation`` (the clamped SwiGLU, or the contract's SiLU) and
``WITH_BIAS`` in front of a family's kernels; a family exists per (weight format, layer). CPU: the layer code (the
contract's layer is the kernels' earlier text: ``tools.sass_hashes`` finds their machine code unchanged); the entry
point's checks; the g++ emulation of the FMA, tensor-core (grouped down) and per-pair families on bf16 and mxfp4
weights against ``reference.moe_decode(**p.layer)`` with activations and biases scaled to reach the clamps; the
balanced down refused with biases. GPU (``-m gpu``): the same against the reference, poisoned outputs, bitwise
repeats and a graph replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels.activation import CONTRACT_LAYER, GPT_OSS, SILU, Activation, ExpertLayer, device_code, expert_layer
from kernels.contract import BF16, Dims
from kernels.formats import quantize_weights
from kernels.numerics import bf16_to_f32
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.shapes import get_shape
from tests.test_warp_decode_batched import _emulate
from tests.warp_checks import _assert_matches, _poisoned_out, _seed, slow_except

# gpt-oss's layer small enough for the emulation: H and I multiples of 32 (mxfp4's 32-value loads)
OSS = get_shape("tiny").with_(name="oss-small", hidden=128, intermediate=64, experts=6, top_k=4,
                              activation="gpt-oss", bias=True)
OSS_ODD = OSS.with_(name="oss-odd", hidden=200, intermediate=48)  # 8- and 16-value loads, partial scale blocks


def oss_problem(shape: Any = OSS, tokens: int = 5, seed: int = 4, weight_format: str = "bf16",
                routing: Any = "uniform") -> Problem:
    """A gpt-oss problem whose activations reach the clamps (x and the biases scaled by powers of two: |gate_up| > 7
    for several percent of the values), in ``weight_format``."""
    p = make_problem(shape, tokens, seed=seed, routing=routing)
    p = dataclasses.replace(p, x=(bf16_to_f32(p.x) * np.float32(4)).astype(BF16),
                            b13=(bf16_to_f32(p.b13) * np.float32(8)).astype(BF16),
                            b2=(bf16_to_f32(p.b2) * np.float32(8)).astype(BF16))
    if weight_format != "bf16":
        p = dataclasses.replace(p, **dict(zip(("w13", "w2"), quantize_weights(p.w13, p.w2, weight_format),
                                              strict=True)))
    return p


def _clamped_fraction(p: Problem) -> float:
    """The fraction of the problem's gate / up values past the clamp (|v| > 7), as the fp64 layer sees them."""
    from kernels.formats import format_of, get_format

    fmt = get_format(format_of(p.w13))
    x = bf16_to_f32(p.x).astype(np.float64)
    vals = []
    for t in range(p.tokens):
        for e in p.topk_ids[t]:
            w13 = fmt.expert(p.w13, int(e), "w13").astype(np.float64)
            vals.append(w13 @ x[t] + bf16_to_f32(p.b13[e]))
    return float((np.abs(np.concatenate(vals)) > 7).mean())


# ---------------------------------------------------------------------------------------------------
# the layer code and the entry point's checks
# ---------------------------------------------------------------------------------------------------
def test_layer_code() -> None:
    """The contract's layer: SiLU as the kernels held it, WITH_BIAS the value itself; gpt-oss's: the clamps as
    compares (a NaN stays NaN), alpha and the up offset as float literals, the bias added with one rounded add."""
    silu = device_code(SILU)
    assert "#define EXPERT_BIAS 0" in silu and "#define WITH_BIAS(v, b, index) (v)" in silu
    assert "const float silu = gate / (1.0f + expf(-gate));" in silu and "return silu * up;" in silu
    oss = device_code(GPT_OSS, bias=True)
    assert "#define EXPERT_BIAS 1" in oss and "__fadd_rn((v)" in oss
    for piece in ("gate > 7.0f ? 7.0f : gate", "up > 7.0f ? 7.0f : up < -7.0f ? -7.0f : up", "expf(-1.702f * g)",
                  "return silu * (u + 1.0f);"):
        assert piece in oss, piece
    assert CONTRACT_LAYER.contract and CONTRACT_LAYER.suffix == ""
    assert ExpertLayer(GPT_OSS, True).suffix == "+gpt-oss+bias" and ExpertLayer(SILU, True).suffix == "+silu+bias"
    assert batched.family("fma", "mxfp4", ExpertLayer(GPT_OSS, True)).name == "warp-decode-batched[mxfp4+gpt-oss+bias]"
    assert batched.family("mma", "bf16", CONTRACT_LAYER) is batched.family("mma")


def test_layer_checks() -> None:
    """Biases come in pairs; an interleaved activation is refused (the kernels read the contract's order); the
    balanced tensor-core down refuses biases (it splits a pair's dot between warps) and the rules pick the grouped
    one; the entry point refuses host arrays before any device call."""
    b = np.zeros((2, 2), BF16)
    with pytest.raises(ValueError, match="b13 and b2 come together .* got only b13"):
        expert_layer("gpt-oss", b13=b)
    interleaved = Activation("interleaved", interleaved=True)
    with pytest.raises(ValueError, match="reads gate and up interleaved"):
        expert_layer(interleaved)
    with pytest.raises(ValueError, match="reads gate and up interleaved"):
        device_code(interleaved)
    family = batched.family("mma", "mxfp4", ExpertLayer(GPT_OSS, True))
    dims = Dims(2, 128, 64, 6, 4)
    assert family.resolve(dims)["DB_GROUPED"] == 1 and batched.family("mma", "mxfp4").resolve(dims)["DB_GROUPED"] == 0
    with pytest.raises(ValueError, match="needs DB_GROUPED 1"):
        family.resolve(dims, DB_GROUPED=0)
    p = oss_problem()
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        batched.warp_decode_batched(*p.arrays, **p.layer)


# ---------------------------------------------------------------------------------------------------
# the g++ emulation
# ---------------------------------------------------------------------------------------------------
EMULATED = [  # (shape, T, weight format, routing, path, knobs)
    (OSS, 5, "mxfp4", "uniform", "fma", {}),
    (OSS, 6, "mxfp4", "zipf", "mma", {}),
    (OSS, 4, "mxfp4", "uniform", "pairs", {}),
    (OSS_ODD, 6, "bf16", "uniform", "mma", {"GB_KSPLIT": 4, "HOT_NBLK": 2}),  # split chains, hot tiles
    (OSS_ODD, 4, "fp8-block128", "uniform", "pairs", {"GB_KSPLIT": 2, "GB_WARPS": 2}),
]
EMULATED_IDS = [f"{c[0].name}-T{c[1]}-{c[2]}-{c[4]}-{i}" for i, c in enumerate(EMULATED)]


@pytest.mark.parametrize(("shape", "tokens", "weight_format", "routing", "path", "knobs"),
                         slow_except(EMULATED, EMULATED_IDS, {0, 1, 2}))
def test_emulated_gpt_oss_layer_against_the_reference(rng: np.random.Generator, shape: Any, tokens: int,
                                                      weight_format: str, routing: Any, path: str,
                                                      knobs: dict[str, int]) -> None:
    """The family of gpt-oss's layer (clamped SwiGLU, both biases) against ``reference.moe_decode(mode=
    "warp_decode", **p.layer)`` on the same weights (the FMA family within the exact-order tolerance, the
    tensor-core ones within theirs), NaN-poisoned out and intermediate, the clamps reached; and (the FMA family on
    mxfp4) a layer whose biases are all zero with SiLU: bitwise the contract's family."""
    p = oss_problem(shape, tokens, _seed(rng), weight_format, routing)
    assert _clamped_fraction(p) > 0.01
    got = _emulate(p, path=path, model_layer=True, **knobs)
    faithful = moe_decode(*p.arrays, mode="warp_decode", **p.layer)
    oracle = moe_decode(*p.arrays, mode="fp64", **p.layer)
    _assert_matches(got["out"], faithful, oracle, f"gpt-oss {path} {weight_format} {shape.name} {knobs}",
                    own_order=path != "fma")
    contract = moe_decode(*p.arrays, mode="warp_decode")  # the layer without its activation and biases: far
    assert not np.array_equal(contract.view(np.uint16), got["out"].view(np.uint16))
    if path != "fma" or weight_format != "mxfp4":
        return
    zero = dataclasses.replace(p, shape=p.shape.with_(activation="silu"), b13=np.zeros_like(p.b13),
                               b2=np.zeros_like(p.b2))
    with_zeros = _emulate(zero, path=path, model_layer=True, **knobs)
    plain = _emulate(zero, path=path, **knobs)
    assert np.array_equal(with_zeros["out"].view(np.uint16), plain["out"].view(np.uint16))


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
GPU_CASES = [("gpt-oss-120b", 1, "pairs"), ("gpt-oss-120b", 4, "fma"), ("gpt-oss-120b", 16, "mma"),
             ("gpt-oss-120b", 64, "mma"), ("gpt-oss-20b", 8, "fma"), (OSS_ODD, 6, "mma")]


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["mxfp4", "bf16"])
@pytest.mark.parametrize(("model", "tokens", "path"), GPU_CASES)
def test_gpu_gpt_oss_layer(model: Any, tokens: int, path: str, weight_format: str) -> None:
    """Against the reference's gpt-oss layer on the same weights (NaN-poisoned out), bitwise over a repeat and a
    CUDA-graph replay of the launch with its biases."""
    import cupy

    shape = get_shape(model) if isinstance(model, str) else model
    shape = shape.with_(experts=min(shape.experts, 16))  # the host quantizes every expert for the reference
    host = oss_problem(shape, tokens, tokens + 3, weight_format, "zipf")
    device = host.to_cupy()
    dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    ws = batched.make_workspace(dims, path, weight_format, activation="gpt-oss", biases=True)

    def run() -> np.ndarray:
        out = _poisoned_out(cupy, tokens, shape.hidden)
        batched.warp_decode_batched(*device.arrays, out=out, workspace=ws, path=path, **device.layer)
        cupy.cuda.runtime.deviceSynchronize()
        return out.get()

    first = run()
    faithful = moe_decode(*host.arrays, mode="warp_decode", **host.layer)
    oracle = moe_decode(*host.arrays, mode="fp64", **host.layer)
    _assert_matches(first, faithful, oracle, f"gpt-oss {path} {weight_format} {shape.name} T={tokens}",
                    own_order=path != "fma")
    assert np.array_equal(run().view(np.uint16), first.view(np.uint16))
    out = _poisoned_out(cupy, tokens, shape.hidden)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        batched.warp_decode_batched(*device.arrays, out=out, workspace=ws, path=path, **device.layer)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(out.get().view(np.uint16), first.view(np.uint16))


def test_dispatch_runs_a_model_layer_on_the_batched_paths() -> None:
    """moe_decode with gpt-oss's layer keeps a batched choice and puts the format's FMA path where the choice is
    strict or expert-centric (no other family compiles a layer); the contract's layer keeps every choice."""
    from kernels import dispatch

    oss = ExpertLayer(GPT_OSS, True)
    assert dispatch.layer_choice(dispatch.STRICT, "bf16", oss) == dispatch.BATCHED
    assert dispatch.layer_choice(dispatch.EXPERT_CENTRIC, "bf16", oss) == dispatch.BATCHED
    assert dispatch.layer_choice(dispatch.FP8_STRICT, "fp8-block128", oss) == dispatch.FP8_BATCHED
    assert dispatch.layer_choice(dispatch.MX4_MMA_PAIRS, "mxfp4", oss) == dispatch.MX4_MMA_PAIRS
    assert dispatch.layer_choice(dispatch.STRICT, "bf16", CONTRACT_LAYER) == dispatch.STRICT
    p = oss_problem(weight_format="mxfp4")
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        dispatch.moe_decode(*p.arrays, **p.layer)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["fastest", "batch_invariant"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_moe_decode_on_gpt_oss(tokens: int, policy: str) -> None:
    """kernels.moe_decode on gpt-oss-120b's mxfp4 layer (16 experts): the reference's gpt-oss layer, bitwise over a
    repeat; a workspace made for the contract's layer refused."""

    from kernels import dispatch

    shape = get_shape("gpt-oss-120b").with_(experts=16)
    host = oss_problem(shape, tokens, tokens, "mxfp4", "zipf")
    device = host.to_cupy()
    dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    ws = dispatch.make_workspace(dims, policy=policy, weight_format="mxfp4", activation="gpt-oss", biases=True)
    first = dispatch.moe_decode(*device.arrays, workspace=ws, policy=policy, **device.layer).get()
    faithful = moe_decode(*host.arrays, mode="warp_decode", **host.layer)
    oracle = moe_decode(*host.arrays, mode="fp64", **host.layer)
    _assert_matches(first, faithful, oracle, f"moe_decode gpt-oss T={tokens} {ws.choice}",
                    own_order=ws.choice != dispatch.MX4_BATCHED)
    again = dispatch.moe_decode(*device.arrays, workspace=ws, policy=policy, **device.layer).get()
    assert np.array_equal(again.view(np.uint16), first.view(np.uint16))
    plain = dispatch.make_workspace(dims, policy=policy, weight_format="mxfp4")
    with pytest.raises(ValueError, match="workspace was made for the layer 'silu' without biases"):
        dispatch.moe_decode(*device.arrays, workspace=plain, policy=policy, **device.layer)
