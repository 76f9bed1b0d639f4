"""The experts' activation as data: which of w13's rows are gate and which are up, and what the activation makes of
them. The reference (``kernels.reference.moe_decode(..., activation=...)``) reads an :class:`Activation`, and a
kernel implementing one reads the same fields -- a variant of the contract, not a fork of its code.

    hidden = glu(gate) * (up' + up_offset),   glu(g) = g' * sigmoid(alpha * g')
    g' = min(gate, limit),   up' = clamp(up, -limit, limit)        (no clamp when limit is None)

``"silu"`` (the contract's own, every preset but gpt-oss's): gate rows 0..I-1 then up rows I..2I-1, alpha 1, no clamp,
no offset: SiLU(gate) * up, computed with the same operations as :func:`kernels.numerics.silu` (bitwise the same).

``"gpt-oss"``: the clamped SwiGLU of openai/gpt-oss (gpt_oss/torch/model.py, ``swiglu(x, alpha=1.702, limit=7.0)``:
``x_glu, x_linear = x[..., ::2], x[..., 1::2]``, ``x_glu.clamp(max=limit)``, ``x_linear.clamp(-limit, limit)``,
``x_glu * sigmoid(alpha * x_glu) * (x_linear + 1)``; Hugging Face's ``GptOssExperts`` in
transformers/models/gpt_oss/modeling_gpt_oss.py the same). Gate and up are interleaved in w13's rows -- gate j is
row 2j, up j row 2j + 1 -- as the checkpoints store them (``mlp1_weight`` / ``gate_up_proj`` [E, 2I, H]); limit 7.0 is
the configs' ``swiglu_limit``, alpha 1.702 is a constant of the code (no config field).

NaN propagates through the clamps (``np.minimum`` / ``np.clip``, like ``torch.clamp``), but a clamp turns +inf gate
(and +-inf up) into a finite value: under a clamped activation an inf reaches the output only where the rest of the
computation carries it (the model's semantics, not the contract's NaN policy for SiLU).

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
    interleaved=True,
    limit=7.0,
    alpha=1.702,
    up_offset=1.0,
    source="openai/gpt-oss gpt_oss/torch/model.py swiglu(); transformers GptOssExperts (alpha 1.702, limit 7.0)",
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
