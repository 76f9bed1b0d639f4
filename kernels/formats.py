"""Weight formats as data: what a format stores per expert, how many bytes a kernel reads for it, how to make it
from fp32/bf16 weights and how to read it back in NumPy.

A variant names its format (``Variant.weight_format``); the harness counts the bytes the format reads (values and
scales: TB/s and % of roofline are of those bytes), the report says which divisor it used, the input check
(``kernels.contract.check_inputs``) asks the format whether w13 / w2 are its weights, and the reference
(``kernels.reference.moe_decode(..., weight_format=)``) reads them one expert at a time through the format.
``bf16`` is the data contract's own layout (w13 [E, 2I, H], w2 [E, H, I], plain arrays, no scales) and the default
everywhere. A scaled format stores each matrix as a :class:`Quantized` (``values`` in the bf16 layout's shape,
``scales``). A new format is one :class:`WeightFormat` subclass registered in :data:`FORMATS`, plus its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.contract import BF16, array_module


@dataclass(frozen=True)
class Quantized:
    """One matrix (w13 or w2) of a scaled format: ``values`` with the bf16 layout's shape, and their ``scales``."""

    values: Any
    scales: Any


def _host(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr


@dataclass(frozen=True)
class WeightFormat:
    """One way of storing an expert's w13 and w2. Subclasses override :meth:`quantize` / :meth:`dequantize` and,
    when they carry scales, :meth:`scale_bytes`."""

    name: str
    description: str
    value_bytes: float  # bytes per stored weight value

    def value_count(self, hidden: int, intermediate: int) -> int:
        """Weight values of one expert: w13 (2I x H) and w2 (H x I)."""
        return 3 * hidden * intermediate

    def scale_bytes(self, hidden: int, intermediate: int) -> int:
        """Bytes of one expert's scales (none for an unscaled format)."""
        return 0

    def expert_bytes(self, hidden: int, intermediate: int) -> int:
        """What a kernel reads for one expert: its values and its scales."""
        return int(self.value_count(hidden, intermediate) * self.value_bytes) + self.scale_bytes(hidden, intermediate)

    def quantize(self, w13: Any, w2: Any) -> tuple[Any, Any]:
        """This format's (w13, w2) from fp32 or bf16 weights in the contract's layouts."""
        raise NotImplementedError

    def dequantize(self, weights: Any) -> np.ndarray:
        """One stored matrix (w13 or w2, as :meth:`quantize` returned it) as float32 on the host."""
        raise NotImplementedError

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        """The values array of ``weights`` after checking they are this format's (a :class:`Quantized` of ``xp``
        arrays, values 3-D and C-contiguous); TypeError / ValueError name ``name``. Its shape is the layout's."""
        if not isinstance(weights, Quantized):
            raise TypeError(f"{name} must be {self.name} weights (kernels.formats.Quantized with .values and "
                            f".scales), got {type(weights).__name__}")
        for part in ("values", "scales"):
            arr = getattr(weights, part)
            if array_module(arr) is not xp:
                raise TypeError(f"{name}.{part} must be a {xp.__name__} array like x")
            if not arr.flags.c_contiguous:
                raise ValueError(f"{name}.{part} must be C-contiguous")
        if weights.values.ndim != 3:
            raise ValueError(f"{name}.values must have 3 dimensions {what}, got shape {tuple(weights.values.shape)}")
        return weights.values

    def host(self, weights: Any) -> Any:
        """``weights`` with every array on the host (anything else unchanged: :meth:`check` then says what is wrong)."""
        if not isinstance(weights, Quantized):
            return weights
        return Quantized(_host(weights.values), _host(weights.scales))

    def expert(self, weights: Any, expert: int) -> np.ndarray:
        """One expert's matrix on the host for the reference: float32 dequantized (bf16 weights: the bf16 slice).
        Override for formats whose whole-matrix :meth:`dequantize` would not fit in memory."""
        return self.dequantize(weights)[expert]


@dataclass(frozen=True)
class Bf16(WeightFormat):
    """The contract's bf16 weights: values only, rounded to nearest even from fp32."""

    def quantize(self, w13: Any, w2: Any) -> tuple[Any, Any]:
        return _as_bf16(w13, "w13"), _as_bf16(w2, "w2")

    def dequantize(self, weights: Any) -> np.ndarray:
        host = _host(weights)
        if host.dtype != BF16:
            raise TypeError(f"bf16 weights must have dtype bfloat16, got {host.dtype}")
        return host.astype(np.float32)

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        from kernels.contract import check_array

        check_array(name, weights, xp, BF16, 3, what)
        return weights

    def host(self, weights: Any) -> Any:
        return _host(weights)

    def expert(self, weights: Any, expert: int) -> np.ndarray:
        return _host(weights)[expert]


def _as_bf16(weights: Any, name: str) -> Any:
    dtype = getattr(weights, "dtype", None)
    if dtype is None or not (dtype == BF16 or np.dtype(dtype).kind == "f"):
        raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(weights).__name__} of {dtype}")
    return weights if dtype == BF16 else weights.astype(BF16)


BF16_FORMAT = Bf16("bf16", "bfloat16 values, no scales (the data contract)", 2)
FORMATS: dict[str, WeightFormat] = {BF16_FORMAT.name: BF16_FORMAT}
DEFAULT_FORMAT = BF16_FORMAT.name


def get_format(weight_format: str | WeightFormat = "bf16") -> WeightFormat:
    """A registered format by name (or pass a :class:`WeightFormat` through); ValueError names the known ones."""
    if isinstance(weight_format, WeightFormat):
        return weight_format
    if not isinstance(weight_format, str):
        raise TypeError(f"weight_format must be a format name or a WeightFormat, got {type(weight_format).__name__}")
    try:
        return FORMATS[weight_format]
    except KeyError:
        raise ValueError(f"unknown weight_format {weight_format!r}; known: {', '.join(FORMATS)}") from None
