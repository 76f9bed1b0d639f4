"""The experts' activation as data: which of w13's rows are gate and which are up, and what the activation makes of
them. The reference (``kernels.reference.moe_decode(..., activation=...)``) reads an :class:`Activation`, and the
batched kernel families compile its :func:`device_code` in front of their kernels -- a variant of the contract, not a
fork of its code.

    hidden = glu(gate) * (up' + up_offset),   glu(g) = g' * sigmoid(alpha * g')
    g' = min(gate, limit),   up' = clamp(up, -limit, limit)        (no clamp when limit is None)

``"silu"`` (the contract's own, every preset but gpt-oss's): gate rows 0..I-1 then up rows I..2I-1, alpha 1, no clamp,
no offset: SiLU(gate) * up, computed with the same operations as :func:`kernels.numerics.silu` (bitwise the same).

``"gpt-oss"``: the clamped SwiGLU of openai/gpt-oss (gpt_oss/torch/model.py, ``swiglu(x, alpha=1.702, limit=7.0)``:
``x_glu, x_linear = x[..., ::2], x[..., 1::2]``, ``x_glu.clamp(max=limit)``, ``x_linear.clamp(-limit, limit)``,
``x_glu * sigmoid(alpha * x_glu) * (x_linear + 1)``; Hugging Face's ``GptOssExperts`` in
transformers/models/gpt_oss/modeling_gpt_oss.py the same); limit 7.0 is the configs' ``swiglu_limit``, alpha 1.702 a
constant of the code (no config field). The checkpoints interleave gate and up in w13's rows (gate j = row 2j, up j =
row 2j + 1: ``mlp1_weight`` / ``gate_up_proj`` [E, 2I, H]); the lab keeps ONE row order, the contract's -- gate rows
then up rows -- and its checkpoint loader (``kernels.formats.gpt_oss_experts_from_checkpoint``) gathers the rows (and
b13) into it with :func:`deinterleave`, so every kernel reads gpt-oss's layer as it reads any other. ``interleaved``
stays a field for reading such rows in the reference (tests check the loader against gpt-oss's own order with it);
the kernels refuse an interleaved activation.

NaN propagates through the clamps (``np.minimum`` / ``np.clip``, like ``torch.clamp``; the kernels' compares keep a
NaN too), but a clamp turns +inf gate (and +-inf up) into a finite value: under a clamped activation an inf reaches
the output only where the rest of the computation carries it (the model's semantics, not the contract's NaN policy
for SiLU).

Built on NumPy alone: :mod:`kernels.shapes` validates a preset's ``activation`` name against :data:`ACTIVATIONS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Activation:
    """One expert activation: how gate / up sit in w13's 2I rows and the function of them (module docstring)."""

    name: str
    interleaved: bool = False  # False: gate rows 0..I-1, up rows I..2I-1; True: gate row 2j, up row 2j + 1
    limit: float | None = None  # clamp gate <= limit and -limit <= up <= limit; None: no clamp
    alpha: float = 1.0  # glu(g) = g * sigmoid(alpha * g)
    up_offset: float = 0.0  # hidden = glu * (up + up_offset)
    source: str = ""  # where the definition comes from

    def __post_init__(self) -> None:
        for field in ("limit", "alpha", "up_offset"):
            value = getattr(self, field)
            if value is None and field == "limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise TypeError(f"Activation.{field} must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise ValueError(f"Activation.{field} must be finite, got {value!r}")
            object.__setattr__(self, field, float(value))
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"Activation.limit must be > 0 (or None: no clamp), got {self.limit}")
        if self.alpha <= 0:
            raise ValueError(f"Activation.alpha must be > 0, got {self.alpha}")

    def gate_rows(self, intermediate: int) -> np.ndarray:
        """Indices of the I gate rows among w13's 2I rows, gate j first."""
        return np.arange(intermediate) * 2 if self.interleaved else np.arange(intermediate)

    def up_rows(self, intermediate: int) -> np.ndarray:
        """Indices of the I up rows among w13's 2I, in the order of the gate rows they pair with."""
        return np.arange(intermediate) * 2 + 1 if self.interleaved else np.arange(intermediate) + intermediate

    def split(self, gate_up: Any) -> tuple[Any, Any]:
        """``(gate, up)`` views of ``gate_up`` [..., 2I] (w13's row order along the last axis), [..., I] each."""
        two_i = gate_up.shape[-1]
        if two_i % 2:
            raise ValueError(f"gate_up's last dimension is 2I (gate and up rows), must be even, got {two_i}")
        if self.interleaved:
            return gate_up[..., 0::2], gate_up[..., 1::2]
        return gate_up[..., : two_i // 2], gate_up[..., two_i // 2 :]

    def __call__(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """hidden [..., I] from gate and up [..., I] in their dtype (float32 stays float32, float64 float64)."""
        scalar = np.asarray(gate).dtype.type
        if self.limit is not None:
            limit = scalar(self.limit)
            gate = np.minimum(gate, limit)
            up = np.clip(up, -limit, limit)
        z = gate if self.alpha == 1.0 else scalar(self.alpha) * gate
        with np.errstate(over="ignore"):  # exp(-z) overflows to inf for very negative z: glu -> -0, as it should
            glu = gate / (1.0 + np.exp(-z))
        if self.up_offset:
            up = up + scalar(self.up_offset)
        return glu * up

    def apply(self, gate_up: np.ndarray) -> np.ndarray:
        """hidden [..., I] from gate_up [..., 2I] in w13's row order: ``self(*self.split(gate_up))``."""
        return self(*self.split(gate_up))


SILU = Activation("silu", source="the data contract: SiLU(gate) * up, gate rows then up rows (vLLM w1)")
GPT_OSS = Activation(
    "gpt-oss",
    limit=7.0,
    alpha=1.702,
    up_offset=1.0,
    source="openai/gpt-oss gpt_oss/torch/model.py swiglu(); transformers GptOssExperts (alpha 1.702, limit 7.0); "
           "the checkpoints' interleaved rows gathered into the contract's order by their loader",
)
ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (SILU, GPT_OSS)}


def get_activation(activation: str | Activation = "silu") -> Activation:
    """A known activation by name (or pass an :class:`Activation` through); ValueError names the known ones."""
    if isinstance(activation, Activation):
        return activation
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a name or an Activation, got {type(activation).__name__}")
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}") from None


def deinterleave(rows: np.ndarray, axis: int = -2) -> np.ndarray:
    """Host rows interleaved gate / up along ``axis`` (gate j at 2j, up j at 2j + 1: gpt-oss's checkpoints) in the
    contract's order, gate rows then up rows (a copy)."""
    two_i = int(rows.shape[axis])
    if two_i % 2:
        raise ValueError(f"interleaved gate / up rows come in pairs: axis {axis} must be even, got {two_i}")
    return np.concatenate([np.take(rows, np.arange(0, two_i, 2), axis=axis),
                           np.take(rows, np.arange(1, two_i, 2), axis=axis)], axis=axis)


def _c_float(value: float) -> str:
    """``value`` as a float32 C literal: the shortest decimal that reads back as NumPy's float32 of it."""
    text = np.format_float_positional(np.float32(value), unique=True)
    return f"{text}0f" if text.endswith(".") else f"{text}f"


def device_code(activation: str | Activation = "silu", bias: bool = False) -> str:
    """The CUDA C the batched families compile in front of their kernels for this expert layer:
    ``expert_activation(gate, up)`` (FP32, the reference's operations in its order: the clamps as compares, so a NaN
    stays NaN; ``expf`` where the reference has ``np.exp``) and ``EXPERT_BIAS`` with ``WITH_BIAS(v, b, index)``: ``v``
    plus the bf16 bias ``b[index]`` in FP32 (one rounded add, where the reference adds it), or ``v`` itself where the
    layer has no biases -- the SiLU layer without biases is the text the kernels held before (their machine code)."""
    act = kernel_layer(activation).activation
    body = []
    gate, up = "gate", "up"
    if act.limit is not None:
        lim = _c_float(act.limit)
        body += [f"    const float g = gate > {lim} ? {lim} : gate;  // min(gate, limit): a NaN stays NaN",
                 f"    const float u = up > {lim} ? {lim} : up < -{lim} ? -{lim} : up;  // clamp(up, -limit, limit)"]
        gate, up = "g", "u"
    z = gate if act.alpha == 1.0 else f"{_c_float(act.alpha)} * {gate}"
    body.append(f"    const float silu = {gate} / (1.0f + expf(-{z}));  // IEEE division (no fast-math)")
    offset = f"({up} + {_c_float(act.up_offset)})" if act.up_offset else up
    body.append(f"    return silu * {offset};")
    widen = "__uint_as_float((u32)__ldg((b) + (index)) << 16)"
    return "\n".join([
        f"// ---- the expert layer: activation {act.name}, {'bf16 biases' if bias else 'no biases'} "
        "(kernels/activation.py) ----",
        f"#define EXPERT_BIAS {int(bias)}",
        f"#define WITH_BIAS(v, b, index) __fadd_rn((v), {widen})" if bias else "#define WITH_BIAS(v, b, index) (v)",
        "__device__ __forceinline__ float expert_activation(float gate, float up) {",
        *body, "}", ""])


@dataclass(frozen=True)
class ExpertLayer:
    """What a batched kernel family computes around the experts' dots: the activation and whether the experts carry
    bf16 biases (b13 on gate_up, b2 on down) -- one family per (weight format, layer); the contract's layer (SiLU,
    no biases) is every family's default."""

    activation: Activation = SILU
    bias: bool = False

    @property
    def contract(self) -> bool:
        """The data contract's own layer: SiLU, no biases."""
        return self.activation == SILU and not self.bias

    @property
    def suffix(self) -> str:
        """How a family's name says the layer ("" for the contract's: "+gpt-oss+bias")."""
        return "" if self.contract else f"+{self.activation.name}" + ("+bias" if self.bias else "")

    def device_code(self) -> str:
        return device_code(self.activation, self.bias)


CONTRACT_LAYER = ExpertLayer()


def kernel_layer(activation: str | Activation = "silu", biases: bool = False) -> ExpertLayer:
    """The layer a batched family compiles for ``activation`` (with ``biases``); ValueError for an activation that reads
    gate and up interleaved (the kernels read the contract's row order)."""
    act = get_activation(activation)
    if act.interleaved:
        raise ValueError(f"activation {act.name!r} reads gate and up interleaved; the kernels read the contract's "
                         "order (gate rows, then up rows): gather the rows with kernels.activation.deinterleave")
    return ExpertLayer(act, bool(biases))


def expert_layer(activation: str | Activation = "silu", b13: Any = None, b2: Any = None) -> ExpertLayer:
    """The layer a call asks for: its activation, and biases where it passes both (one alone: ValueError)."""
    if (b13 is None) != (b2 is None):
        raise ValueError(f"b13 and b2 come together (the experts' gate_up and down biases), got only "
                         f"{'b13' if b2 is None else 'b2'}")
    return kernel_layer(activation, b13 is not None)
