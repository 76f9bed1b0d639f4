"""Presets match their configs; the bytes / unique-expert / FLOP arithmetic is right."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.shapes import PRESETS, MoEShape, get_shape

EXPECTED = {  # (H, I, E, K, layers, shared experts, shared I) from each model's config.json
    "qwen3-30b-a3b": (2048, 768, 128, 8, 48, 0, 0),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 94, 0, 0),
    "qwen3-coder-480b-a35b": (6144, 2560, 160, 8, 62, 0, 0),
    "qwen3-next-80b-a3b": (2048, 512, 512, 10, 48, 1, 512),
    "mixtral-8x7b": (4096, 14336, 8, 2, 32, 0, 0),
    "deepseek-v3": (7168, 2048, 256, 8, 61, 1, 2048),
    "gpt-oss-120b": (2880, 2880, 128, 4, 36, 0, 0),
    "gpt-oss-20b": (2880, 2880, 32, 4, 24, 0, 0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_match_configs(name: str) -> None:
    s = PRESETS[name]
    assert (
        s.hidden,
        s.intermediate,
        s.experts,
        s.top_k,
        s.layers,
        s.shared_experts,
        s.shared_intermediate,
    ) == EXPECTED[name]
    assert s.source, "every preset names where its numbers come from"


def test_tiny_exists_and_is_odd() -> None:
    tiny = PRESETS["tiny"]
    assert tiny.hidden % 256 and tiny.hidden % 8 == 0


def test_expert_bytes_and_unique_experts() -> None:
    s = get_shape("qwen3-30b-a3b")
    assert s.expert_bytes == 3 * 2048 * 768 * 2  # 9.44 MB, as in the calibration notes
    assert s.expected_unique_experts(1) == pytest.approx(8.0)
    assert s.expected_unique_experts(8) == pytest.approx(51.6, abs=0.1)
    assert s.expected_unique_experts(64) == pytest.approx(126.0, abs=0.5)
    assert s.weight_bytes(1) == pytest.approx(8 * s.expert_bytes)
    assert s.weight_bytes(unique_experts=3) == 3 * s.expert_bytes
    assert s.flops(2) == 2 * 2 * 8 * 3 * 2048 * 768


def test_expected_unique_matches_simulation(rng: np.random.Generator) -> None:
    s = get_shape("qwen3-30b-a3b")
    counts = [np.unique(np.argsort(rng.random((8, s.experts)), axis=1)[:, :8]).size for _ in range(400)]
    assert np.mean(counts) == pytest.approx(s.expected_unique_experts(8), rel=0.02)


def test_activation_bytes() -> None:
    s = get_shape("tiny")
    T = 3
    assert s.activation_bytes(T) == T * s.hidden * 2 + 2 * T * s.top_k * s.intermediate * 2 + T * s.hidden * 2


@pytest.mark.parametrize(
    "changes, message",
    [({"hidden": 12}, "multiples of 8"), ({"intermediate": 0}, r"MoEShape.intermediate must be an int >= 1, got 0"),
     ({"top_k": -1}, r"MoEShape.top_k must be an int >= 1, got -1")],
)
def test_bad_shapes(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PRESETS["tiny"].with_(**changes)


def test_numpy_ints_are_ints() -> None:
    import numpy as np

    shape = PRESETS["tiny"].with_(experts=np.int64(4), top_k=np.int32(2))
    assert shape.experts == 4 and type(shape.experts) is int and type(shape.top_k) is int


def test_lookup_errors() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        get_shape("qwen9")
    with pytest.raises(TypeError):
        get_shape(3)  # type: ignore[arg-type]
    assert get_shape(PRESETS["tiny"]) is PRESETS["tiny"]
    with pytest.raises(ValueError, match="tokens"):
        PRESETS["tiny"].flops(0)
    assert isinstance(PRESETS["tiny"], MoEShape)


def test_expert_layers_of_the_presets() -> None:
    """gpt-oss's experts carry biases and the clamped, interleaved SwiGLU (config.json: swiglu_limit 7.0; the alpha
    1.702 of openai/gpt-oss's swiglu()); every other preset is the contract's SiLU(gate) * up without biases."""
    from kernels.activation import GPT_OSS, SILU

    for name, shape in PRESETS.items():
        gpt_oss = name.startswith("gpt-oss")
        assert shape.activation == ("gpt-oss" if gpt_oss else "silu"), name
        assert shape.bias is gpt_oss, name
        assert shape.expert_activation is (GPT_OSS if gpt_oss else SILU), name
    assert (GPT_OSS.interleaved, GPT_OSS.limit, GPT_OSS.alpha, GPT_OSS.up_offset) == (False, 7.0, 1.702, 1.0)
    assert (SILU.interleaved, SILU.limit, SILU.alpha, SILU.up_offset) == (False, None, 1.0, 0.0)
    oss = PRESETS["gpt-oss-120b"]
    assert oss.bias_bytes == (2 * 2880 + 2880) * 2 and PRESETS["tiny"].bias_bytes == 0
    assert oss.expert_bytes == 3 * 2880 * 2880 * 2  # the weights the kernels read: biases apart


def test_bad_expert_layer_fields() -> None:
    with pytest.raises(ValueError, match=r"MoEShape.activation must be one of silu, gpt-oss, got 'gelu'"):
        PRESETS["tiny"].with_(activation="gelu")
    with pytest.raises(TypeError, match="MoEShape.bias must be a bool"):
        PRESETS["tiny"].with_(bias="yes")
    assert PRESETS["tiny"].with_(bias=np.bool_(True)).bias is True
