"""MoE layer shapes of real models, the sizes of one call (:class:`Dims`), and the arithmetic of what one decode step
must move.

Every preset's numbers are copied from the model's published ``config.json`` (field names in the comment
beside each). Only *shapes* come from there: the toolkit never downloads weights, it generates them.
A preset may also carry the rest of its decoder (attention heads, head dim, RoPE base, vocabulary, norm epsilon:
what a whole decode step needs, ``kernels.decode_reference``); those fields stay None where no config is cited.

Sizes only: this module builds on :mod:`kernels.arrays` alone, so the compile layer (``kernels.compile``'s
``preset_variants``) and the data contract (``kernels.contract``, which re-exports :class:`Dims`) can both use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kernels.activation import ACTIVATIONS, Activation, get_activation
from kernels.arrays import check_int

BF16_BYTES = 2


@dataclass(frozen=True)
class Dims:
    """The sizes one call works on."""

    tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    experts: int  # E
    top_k: int  # K


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: ``experts`` FFNs of ``hidden -> 2 * intermediate -> hidden``, ``top_k`` per token."""

    name: str
    hidden: int  # H
    intermediate: int  # I, the per-expert (moe_)intermediate size
    experts: int  # E, routed experts
    top_k: int  # K, routed experts per token
    layers: int = 1  # MoE-bearing decoder layers in the model (for whole-model figures)
    shared_experts: int = 0
    shared_intermediate: int = 0  # intermediate size of each shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # the experts' activation, a name in kernels.activation.ACTIVATIONS ("silu": SiLU(gate) * up, gate rows then up
    # rows, what every kernel implements; "gpt-oss": the clamped SwiGLU, which the batched families implement too),
    # and whether the experts carry biases (b13 [E, 2I] on gate_up, b2 [E, H] on down: the b13= / b2= keywords)
    activation: str = "silu"
    bias: bool = False
    source: str = ""  # where the numbers come from
    # the rest of the decoder (config.json names): all six set, or none (an MoE layer alone)
    num_attention_heads: int | None = None  # query heads
    num_key_value_heads: int | None = None  # KV heads (grouped-query attention: heads share them in groups)
    head_dim: int | None = None  # q_proj maps H -> heads * head_dim, which need not equal H
    rope_theta: float | None = None  # RoPE base
    vocab_size: int | None = None
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None  # optional even then

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "experts", "top_k", "layers"):  # NumPy ints become ints
            object.__setattr__(self, field, check_int(f"MoEShape.{field}", getattr(self, field), 1))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEShape.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if not isinstance(self.bias, bool | np.bool_):
            raise TypeError(f"MoEShape.bias must be a bool, got {self.bias!r}")
        object.__setattr__(self, "bias", bool(self.bias))
        if self.hidden % 8 or self.intermediate % 8:
            raise ValueError(
                f"MoEShape hidden ({self.hidden}) and intermediate ({self.intermediate}) must be multiples of 8 "
                "(the kernels load 16 bytes = 8 bf16 per lane)"
            )
        self._check_attention()

    def _check_attention(self) -> None:
        """The decoder fields: all of :data:`ATTENTION_FIELDS` or none, each in range, heads a multiple of KV heads."""
        given = [f for f in ATTENTION_FIELDS if getattr(self, f) is not None]
        if given and len(given) < len(ATTENTION_FIELDS):
            missing = [f for f in ATTENTION_FIELDS if getattr(self, f) is None]
            raise ValueError(f"MoEShape {self.name!r}: the decoder fields come together; set {', '.join(missing)} "
                             f"too (or none of {', '.join(ATTENTION_FIELDS)})")
        for field in (*ATTENTION_FIELDS, "max_position_embeddings"):
            value = getattr(self, field)
            if value is None:
                continue
            if field not in ("rope_theta", "rms_norm_eps"):
                object.__setattr__(self, field, check_int(f"MoEShape.{field}", value, 1))
                continue
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
                raise TypeError(f"MoEShape.{field} must be a number, got {value!r}")
            if not 0 < float(value) < float("inf"):
                raise ValueError(f"MoEShape.{field} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, field, float(value))
        if not given:
            return
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"MoEShape.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}): query heads share KV heads in groups")
        if self.head_dim % 2:
            raise ValueError(f"MoEShape.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    @property
    def has_attention(self) -> bool:
        """True when the preset carries its decoder's fields (a whole decode step can be built from it)."""
        return self.num_attention_heads is not None

    # -- bytes -------------------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        """bf16 bytes of one routed expert: gate + up rows (2*I x H) and down (H x I)."""
        return 3 * self.hidden * self.intermediate * BF16_BYTES

    @property
    def layer_bytes(self) -> int:
        """bf16 bytes of all routed experts of one layer (what must sit in HBM)."""
        return self.experts * self.expert_bytes

    @property
    def expert_activation(self) -> Activation:
        """The :class:`kernels.activation.Activation` named by :attr:`activation`."""
        return get_activation(self.activation)

    @property
    def bias_bytes(self) -> int:
        """bf16 bytes of one routed expert's biases (b13's 2I and b2's H values; 0 without biases). Not counted in
        :attr:`expert_bytes`: that is what today's kernels read, and they read no biases."""
        return (2 * self.intermediate + self.hidden) * BF16_BYTES if self.bias else 0

    @property
    def shared_bytes(self) -> int:
        return self.shared_experts * 3 * self.hidden * self.shared_intermediate * BF16_BYTES

    def expected_unique_experts(self, tokens: int) -> float:
        """E[experts touched] when each of ``tokens`` tokens picks ``top_k`` distinct experts uniformly."""
        _check_tokens(tokens)
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)

    def weight_bytes(self, tokens: int | None = None, unique_experts: float | None = None) -> float:
        """Routed-expert weight bytes one layer must read at batch ``tokens``: each touched expert once.

        Give ``unique_experts`` when the routing is known (the bench counts it from ``topk_ids``);
        otherwise the expectation under uniform routing is used.
        """
        if unique_experts is None:
            if tokens is None:
                raise ValueError("weight_bytes needs tokens or unique_experts")
            unique_experts = self.expected_unique_experts(tokens)
        return unique_experts * self.expert_bytes

    def activation_bytes(self, tokens: int) -> int:
        """Bytes of x [T, H] read, the [T, K, I] bf16 intermediate written and read, out [T, H] written."""
        _check_tokens(tokens)
        x = tokens * self.hidden * BF16_BYTES
        intermediate = 2 * tokens * self.top_k * self.intermediate * BF16_BYTES
        out = tokens * self.hidden * BF16_BYTES
        return x + intermediate + out

    # -- the rest of a decode step (decoder presets only) --------------------------------------------
    @property
    def attention_weight_bytes(self) -> int:
        """bf16 bytes of one layer's QKV and O projections."""
        heads, kv_heads, head_dim = self._attention("attention_weight_bytes")
        return (heads + 2 * kv_heads + heads) * head_dim * self.hidden * BF16_BYTES

    def kv_cache_bytes(self, context: int) -> int:
        """bf16 bytes of one layer's K and V for one sequence of ``context`` positions."""
        _, kv_heads, head_dim = self._attention("kv_cache_bytes")
        return 2 * check_int("context", context, 0) * kv_heads * head_dim * BF16_BYTES

    @property
    def router_bytes(self) -> int:
        """bf16 bytes of one layer's router weight [E, H]."""
        return self.experts * self.hidden * BF16_BYTES

    @property
    def lm_head_bytes(self) -> int:
        """bf16 bytes of the LM head [vocab, H]."""
        self._attention("lm_head_bytes")
        return self.vocab_size * self.hidden * BF16_BYTES

    def _attention(self, what: str) -> tuple[int, int, int]:
        if not self.has_attention:
            raise ValueError(f"{what} needs the decoder fields, which preset {self.name!r} does not carry")
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def flops(self, tokens: int) -> int:
        """Multiply-adds x 2 of the routed experts at batch ``tokens`` (gate, up and down GEMVs)."""
        _check_tokens(tokens)
        return 2 * tokens * self.top_k * 3 * self.hidden * self.intermediate

    def with_(self, **changes: object) -> MoEShape:
        """A copy with some fields changed (e.g. fewer experts for a quick CPU check)."""
        return replace(self, **changes)


ATTENTION_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "vocab_size",
    "rms_norm_eps",
)


def _check_tokens(tokens: int) -> None:
    check_int("tokens", tokens, 1)


PRESETS: dict[str, MoEShape] = {
    s.name: s
    for s in (
        # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, moe_intermediate_size 768, num_experts 128,
        # num_experts_per_tok 8, num_hidden_layers 48, norm_topk_prob true, hidden_act "silu";
        # num_attention_heads 32, num_key_value_heads 4, head_dim 128, rope_theta 1000000, vocab_size 151936,
        # rms_norm_eps 1e-06, max_position_embeddings 40960.
        MoEShape(
            "qwen3-30b-a3b",
            2048,
            768,
            128,
            8,
            layers=48,
            source="Qwen/Qwen3-30B-A3B config.json",
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            rope_theta=1000000.0,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
        ),
        # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, moe_intermediate_size 1536, num_experts 128,
        # num_experts_per_tok 8, num_hidden_layers 94, norm_topk_prob true, hidden_act "silu";
        # num_attention_heads 64, num_key_value_heads 4, head_dim 128, rope_theta 1000000, vocab_size 151936,
        # rms_norm_eps 1e-06, max_position_embeddings 40960.
        MoEShape(
            "qwen3-235b-a22b",
            4096,
            1536,
            128,
            8,
            layers=94,
            source="Qwen/Qwen3-235B-A22B config.json",
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            rope_theta=1000000.0,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
        ),
        # Qwen/Qwen3-Coder-480B-A35B-Instruct config.json: hidden_size 6144, moe_intermediate_size 2560,
        # num_experts 160, num_experts_per_tok 8, num_hidden_layers 62, norm_topk_prob true.
        MoEShape(
            "qwen3-coder-480b-a35b",
            6144,
            2560,
            160,
            8,
            layers=62,
            source="Qwen/Qwen3-Coder-480B-A35B-Instruct config.json",
        ),
        # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: hidden_size 2048, moe_intermediate_size 512,
        # num_experts 512, num_experts_per_tok 10, shared_expert_intermediate_size 512 (one shared expert),
        # num_hidden_layers 48, norm_topk_prob true.
        MoEShape(
            "qwen3-next-80b-a3b",
            2048,
            512,
            512,
            10,
            layers=48,
            shared_experts=1,
            shared_intermediate=512,
            source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
        ),
        # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336,
        # num_local_experts 8, num_experts_per_tok 2, num_hidden_layers 32 (top-2 weights renormalised).
        MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, layers=32, source="mistralai/Mixtral-8x7B-v0.1 config.json"),
        # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048,
        # n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, num_hidden_layers 61
        # (first_k_dense_replace 3, so 58 of them are MoE), norm_topk_prob true, routed_scaling_factor 2.5.
        MoEShape(
            "deepseek-v3",
            7168,
            2048,
            256,
            8,
            layers=61,
            shared_experts=1,
            shared_intermediate=2048,
            source="deepseek-ai/DeepSeek-V3 config.json",
        ),
        # openai/gpt-oss-120b config.json: hidden_size 2880, intermediate_size 2880, num_local_experts 128,
        # experts_per_token 4, num_hidden_layers 36, swiglu_limit 7.0 (its original/config.json: num_experts 128;
        # openai/gpt-oss gpt_oss/torch/model.py ModelConfig has the same defaults). Its experts: gate_up and down
        # biases (MLPBlock's mlp1_bias [E, 2I], mlp2_bias [E, H], bf16) and the clamped SwiGLU (kernels.activation.
        # GPT_OSS: limit 7.0, alpha 1.702, up + 1; the checkpoints' interleaved gate / up rows gathered into the
        # contract's order by their loader); the checkpoints ship MXFP4 experts. The bench measures the shape's
        # contract layer (SiLU, no biases: the same weight bytes, 0.1 % fewer bias bytes); the batched families and
        # the reference compute the model's own layer (kernels.problem.Problem.layer).
        MoEShape(
            "gpt-oss-120b",
            2880,
            2880,
            128,
            4,
            layers=36,
            activation="gpt-oss",
            bias=True,
            source="openai/gpt-oss-120b config.json",
        ),
        # openai/gpt-oss-20b config.json: hidden_size 2880, intermediate_size 2880, num_local_experts 32,
        # experts_per_token 4, num_hidden_layers 24, swiglu_limit 7.0; the experts as gpt-oss-120b's.
        MoEShape(
            "gpt-oss-20b",
            2880,
            2880,
            32,
            4,
            layers=24,
            activation="gpt-oss",
            bias=True,
            source="openai/gpt-oss-20b config.json",
        ),
        # Small enough for the CUDA simulator and the CPU tests; H not a multiple of 256 on purpose. Its decoder:
        # heads * head_dim = 128 != H = 136 (as at both Qwen3 MoE presets, q_proj changes the width), two query
        # heads per KV head, a RoPE base small enough that a few hundred positions turn every pair visibly.
        MoEShape(
            "tiny",
            136,
            48,
            6,
            2,
            layers=4,
            source="synthetic",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=10000.0,
            vocab_size=512,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
        ),
    )
}

DEFAULT_MODEL = "qwen3-30b-a3b"


def get_shape(shape: str | MoEShape) -> MoEShape:
    """A preset by name (or pass a shape through)."""
    if isinstance(shape, MoEShape):
        return shape
    if not isinstance(shape, str):
        raise TypeError(f"shape must be a preset name or a MoEShape, got {type(shape).__name__}")
    try:
        return PRESETS[shape]
    except KeyError:
        raise ValueError(f"unknown model {shape!r}; presets: {', '.join(PRESETS)}") from None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
