"""Weight formats as data: what a format stores per expert, how many bytes a kernel reads for it, how to make it
from fp32/bf16 weights and how to read it back in NumPy.

A variant names its format (``Variant.weight_format``); the harness counts the bytes the format reads (values and
scales: TB/s and % of roofline are of those bytes), the report says which divisor it used, the input check
(``kernels.contract.check_inputs``) asks the format whether w13 / w2 are its weights, and the reference
(``kernels.reference.moe_decode``, which like ``kernels.moe_decode`` reads the format from the weights:
:func:`format_of`) reads them one expert at a time through the format.
``bf16`` is the data contract's own layout (w13 [E, 2I, H], w2 [E, H, I], plain arrays, no scales) and the default
everywhere. A scaled format stores each matrix as a :class:`Quantized` (``values`` in the bf16 layout's shape,
``scales``). A new format is one :class:`WeightFormat` subclass registered in :data:`FORMATS`, plus its kernels.

``fp8-block128`` is what FP8 MoE checkpoints ship (Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8, DeepSeek-V3): float8
e4m3fn values in the bf16 layouts' shapes and one float32 scale per 128 x 128 block, dequantized = value x scale
(a checkpoint's ``weight_scale_inv``). w13's scales are [E, 2 ceil(I/128), ceil(H/128)] -- gate's block rows, then
up's: the two are separate matrices in a checkpoint, so a partial last gate block never mixes with up rows -- and
w2's [E, ceil(H/128), ceil(I/128)]; partial blocks at the edges are legal. :func:`quantize_weights` makes them from
fp32 / bf16 weights, :func:`fp8_experts_from_checkpoint` assembles a checkpoint's per-expert tensors.
``fp8-block128-t16`` holds the same values and scales with the values reordered into 16-row x 64-value tiles
(:func:`tile_values`; :meth:`Fp8Block128T16.from_rows` tiles a checkpoint's), the unit a tensor-core warp reads per
k block: 1 KB contiguous instead of 16 pieces a row apart, 1-5 % faster on the H200 (notes/FINDINGS.md).
``bf16-t16`` puts bf16 values in the same tiles (16 rows x 32 values: 64 bytes a row, the tensor-core bf16 kernels' k
block), without scales. ``Quantized.layout`` names the order, and each format's check refuses the other's.
``mxfp4`` (gpt-oss's checkpoints) and ``nvfp4`` (:class:`Fp4Format`) hold e2m1 values two a byte along k (w13 [E, 2I,
H/2], w2 [E, H, I/2] uint8, layout "rows-e2m1x2") and a scale byte per 32 (e8m0) or 16 (e4m3, with a float32
``Quantized.global_scale`` per expert) values along k; their arithmetic and its sources: :mod:`kernels.formats_fp4`.

gpt-oss ships MXFP4 experts (e2m1 values two a byte, one e8m0 power-of-two scale per 32 along k):
:func:`gpt_oss_experts_from_checkpoint` turns one layer's tensors into ``Quantized(values=uint8 [E, rows, k/2],
scales=uint8 [E, rows, k/32])`` -- the layout of the ``mxfp4`` format -- and the layer's bf16 biases, w13's rows
(and b13) gathered from the checkpoint's interleaved order into the contract's (:mod:`kernels.activation`).

The weights' own checks are here, beside the formats they consult: :func:`check_weight_dims` (w13 and w2's shapes,
whatever the format) and :func:`check_weights` (weights about to be converted). ``kernels.contract`` re-exports both
and builds its input check on this module; this module builds on :mod:`kernels.arrays`, :mod:`kernels.geometry` and
:mod:`kernels.formats_fp4` (and, on first use, the on-device quantizer ``kernels.quantize_cuda``), never on
``kernels.contract``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from kernels import formats_fp4 as fp4
from kernels.activation import deinterleave
from kernels.arrays import BF16, array_module, check_array
from kernels.geometry import BLOCK, TILE_ROWS, tile_k
from kernels.geometry import TILE_ROW_BYTES as TILE_ROW_BYTES  # the geometry's every name, here as before
from kernels.geometry import FormatDimsError as FormatDimsError


@dataclass(frozen=True)
class Quantized:
    """One matrix (w13 or w2) of a format other than plain bf16: ``values`` with the bf16 layout's shape, and their
    ``scales`` (None for ``bf16-t16``, which has none); ``layout`` says how the values are ordered in that shape
    ("rows": the contract's row-major layout; "t16": the 16-row tiles of ``fp8-block128-t16`` and ``bf16-t16``), so
    that no kernel reads one layout as the other; ``global_scale``: a format's one float32 scale per expert on top
    of the block scales ([E]: nvfp4's, :mod:`kernels.formats_fp4`), None for every other format.

    The global scale is a field here rather than a subclass: everything that takes a format's weights (the entry
    points, :func:`format_of`, the reference, ``WeightFormat.host``) already knows a Quantized as "this format's
    arrays", and an optional field leaves every other format's Quantized, and every call making one, as it was."""

    values: Any
    scales: Any
    layout: str = "rows"
    global_scale: Any = None


def _host(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr


@dataclass(frozen=True)
class WeightFormat:
    """One way of storing an expert's w13 and w2. Subclasses override :meth:`quantize` / :meth:`dequantize` and,
    when they carry scales, :meth:`scale_bytes`."""

    name: str
    description: str
    value_bytes: float  # bytes per stored weight value

    @property
    def scaled(self) -> bool:
        """Whether the format carries scales (fp8-block128's per block: its loaders apply them)."""
        return self.scale_bytes(256, 256) > 0

    @property
    def global_scaled(self) -> bool:
        """Whether the format carries a float32 global scale per expert and matrix (``Quantized.global_scale``)."""
        return False

    @property
    def tiled(self) -> bool:
        """Whether its values are in 16-row tiles (the batched kernels read them through its loader)."""
        return getattr(self, "layout", "rows") == "t16"

    def stores(self, weights: Any) -> bool:
        """Whether ``weights`` (w13 or w2 as an entry point got them) claim to be this format: plain arrays for
        bf16, a :class:`Quantized` of this format's layout, with or without scales as it has them."""
        return (isinstance(weights, Quantized) and weights.layout == getattr(self, "layout", "rows")
                and (weights.scales is not None) == self.scaled
                and (weights.global_scale is not None) == self.global_scaled)

    def matrix_shape(self, name: str, values_shape: tuple[int, ...]) -> tuple[int, ...]:
        """``name``'s shape in the contract's terms (w13 [E, 2I, H], w2 [E, H, I]) given the shape of the values this
        format stores for it: the same, but in the packed 4-bit formats (two values a byte along k)."""
        return tuple(int(d) for d in values_shape)

    def check_dims(self, hidden: int, intermediate: int, what: str = "") -> None:
        """:class:`FormatDimsError` unless this format can store experts of these H and I (a tiled format: whole
        tiles of :func:`tile_k` values a row; every other format can); ``what`` says whose dims they are."""
        if self.tiled:
            check_tile_dims(self.name, hidden, intermediate, tile_k(int(self.value_bytes)), what)

    def _check_values(self, name: str, values: Any) -> None:
        """:meth:`check_dims` on ``name``'s values ([E, 2I, H] for w13, [E, H, I] for w2), naming them."""
        if self.tiled:
            shape = tuple(int(d) for d in values.shape)
            hidden, inter = (shape[2], shape[1] // 2) if name == "w13" else (shape[1], shape[2])
            check_tile_dims(self.name, hidden, inter, tile_k(int(self.value_bytes)),
                            f"{name} values of shape {list(shape)}")

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
        """This format's (w13, w2) from fp32 or bf16 weights in the contract's layouts. The built-in formats check
        them first with :func:`check_weights` (shapes, the dims the format stores, finite values)."""
        raise NotImplementedError

    def dequantize(self, weights: Any, matrix: str) -> np.ndarray:
        """One stored matrix (``matrix`` "w13" or "w2", as :meth:`quantize` returned it) as float32 on the host."""
        raise NotImplementedError

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        """The values array of ``weights`` after checking they are this format's (a :class:`Quantized` of ``xp``
        arrays, values 3-D and C-contiguous); TypeError / ValueError name ``name``. Its shape is the layout's."""
        if not isinstance(weights, Quantized):
            raise TypeError(f"{name} must be {self.name} weights (kernels.formats.Quantized with .values and "
                            f".scales), got {type(weights).__name__}")
        for part in ("values", "scales"):
            arr = getattr(weights, part)
            if arr is None:
                raise TypeError(f"{name}.{part} is None: {self.name} weights carry {part}")
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
        return dataclasses.replace(weights, values=_host(weights.values), scales=_host(weights.scales),
                                   global_scale=_host(weights.global_scale))

    def expert(self, weights: Any, expert: int, matrix: str) -> np.ndarray:
        """One expert's ``matrix`` ("w13" or "w2") on the host for the reference: float32 dequantized (bf16
        weights: the bf16 slice). Override for formats whose whole-matrix :meth:`dequantize` would not fit."""
        return self.dequantize(weights, matrix)[expert]

    def expert_here(self, weights: Any, expert: int, matrix: str) -> Any:
        """:meth:`expert` where the weights live (NumPy or CuPy): what a device-side fp64 oracle widens."""
        return self.expert(weights, expert, matrix)


@dataclass(frozen=True)
class ExpertWise(WeightFormat):
    """A format whose values are read one expert at a time (``_expert(weights, e, matrix)``: float32 on the host, or
    where the weights live): :meth:`dequantize` stacks the experts, :meth:`expert` and :meth:`expert_here` read one."""

    def _expert(self, weights: Any, expert: int, matrix: str) -> Any:
        raise NotImplementedError

    def dequantize(self, weights: Any, matrix: str) -> np.ndarray:
        host = self.host(weights)
        return np.stack([self._expert(host, e, matrix) for e in range(host.values.shape[0])])

    def expert(self, weights: Any, expert: int, matrix: str) -> np.ndarray:
        return self._expert(self.host(weights), expert, matrix)

    def expert_here(self, weights: Any, expert: int, matrix: str) -> Any:
        return self._expert(weights, expert, matrix)


@dataclass(frozen=True)
class Bf16(WeightFormat):
    """The contract's bf16 weights: values only, rounded to nearest even from fp32."""

    def quantize(self, w13: Any, w2: Any) -> tuple[Any, Any]:
        check_weights(w13, w2, self)
        return _as_bf16(w13, "w13"), _as_bf16(w2, "w2")

    def dequantize(self, weights: Any, matrix: str = "") -> np.ndarray:
        host = _host(weights)
        if host.dtype != BF16:
            raise TypeError(f"bf16 weights must have dtype bfloat16, got {host.dtype}")
        return host.astype(np.float32)

    def stores(self, weights: Any) -> bool:
        return not isinstance(weights, Quantized)

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        check_array(name, weights, xp, BF16, 3, what)
        return weights

    def host(self, weights: Any) -> Any:
        return _host(weights)

    def expert(self, weights: Any, expert: int, matrix: str = "") -> np.ndarray:
        return _host(weights)[expert]

    def expert_here(self, weights: Any, expert: int, matrix: str = "") -> Any:
        return weights[expert]


def _as_bf16(weights: Any, name: str) -> Any:
    dtype = getattr(weights, "dtype", None)
    if dtype is None or not (dtype == BF16 or np.dtype(dtype).kind == "f"):
        raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(weights).__name__} of {dtype}")
    return weights if dtype == BF16 else weights.astype(BF16)


FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite e4m3fn value
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)  # each bit pattern's value (exact)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One expert's matrix [R, C] (float32) as e4m3fn values [R, C] and float32 scales [ceil(R/128), ceil(C/128)]:
    per block scale = amax / 448 (a block of zeros: 1), values = w / scale rounded to the nearest e4m3fn (ties to
    even), saturating at +-448 (float rounding of amax / scale can land a hair above it)."""
    rows, cols = w.shape
    padded = np.zeros((_blocks(rows) * BLOCK, _blocks(cols) * BLOCK), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(_blocks(rows), BLOCK, _blocks(cols), BLOCK)
    amax = np.abs(tiles).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    scaled = np.clip(tiles / scales[:, None, :, None], -FP8_MAX, FP8_MAX)
    values = scaled.reshape(padded.shape)[:rows, :cols].astype(FP8)
    return values, scales


def dequantize_blocks(values: Any, scales: Any) -> Any:
    """float32 [R, C] of e4m3fn ``values`` (or their uint8 bit patterns: NumPy or CuPy, which has no float8 dtype)
    times each one's block scale (a float32 multiply, what the kernels do), where the arrays live."""
    xp = array_module(values)
    vals = xp.asarray(E4M3_VALUES)[values] if values.dtype == np.uint8 else values.astype(np.float32)
    expanded = xp.repeat(xp.repeat(scales, BLOCK, axis=0), BLOCK, axis=1)[: vals.shape[0], : vals.shape[1]]
    return vals * expanded


@dataclass(frozen=True)
class Fp8Block128(ExpertWise):
    """float8 e4m3fn values, one float32 scale per 128 x 128 block (gate and up blocked apart in w13). On the
    device (CuPy has no float8 dtype) the values are uint8 arrays of the same bit patterns."""

    layout: str = "rows"  # the values' order (Quantized.layout)

    def scale_bytes(self, hidden: int, intermediate: int) -> int:
        return 4 * (2 * _blocks(intermediate) * _blocks(hidden) + _blocks(hidden) * _blocks(intermediate))

    @staticmethod
    def scale_shape(name: str, values_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """The scales' shape for ``name``'s values: w13 [E, 2I, H] -> [E, 2 ceil(I/128), ceil(H/128)] (gate's
        block rows, then up's); any other matrix [E, R, C] -> [E, ceil(R/128), ceil(C/128)]."""
        experts, rows, cols = values_shape
        if name == "w13":
            return experts, 2 * _blocks(rows // 2), _blocks(cols)
        return experts, _blocks(rows), _blocks(cols)

    def quantize(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        check_weights(w13, w2, self)
        return self._quantize("w13", w13), self._quantize("w2", w2)

    def _quantize(self, name: str, w: Any) -> Quantized:
        dtype = getattr(w, "dtype", None)
        if dtype is None or not (dtype == BF16 or np.dtype(dtype).kind == "f"):
            raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(w).__name__} of {dtype}")
        if w.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions, got shape {tuple(w.shape)}")
        if name == "w13" and w.shape[1] % 2:
            raise ValueError(f"w13's second dimension is 2I (gate then up rows), must be even, got {w.shape[1]}")
        xp = array_module(w)
        if xp is not np and w.dtype == BF16:  # on the device, where the weights are (bitwise the host result)
            from kernels.quantize_cuda import quantize_matrix

            return Quantized(*quantize_matrix(w, name))
        experts, rows, cols = (int(d) for d in w.shape)
        values = np.empty((experts, rows, cols), FP8)
        scales = np.empty(self.scale_shape(name, (experts, rows, cols)), np.float32)
        for e in range(experts):  # one expert at a time: bounded host memory at real model sizes
            m = _host(w[e]).astype(np.float32)
            halves = (m[: rows // 2], m[rows // 2 :]) if name == "w13" else (m,)
            parts = [quantize_blocks(h) for h in halves]
            values[e] = np.concatenate([v for v, _ in parts], axis=0)
            scales[e] = np.concatenate([sc for _, sc in parts], axis=0)
        if xp is np:
            return Quantized(values, scales)
        return Quantized(xp.asarray(values.view(np.uint8)), xp.asarray(scales))  # float32 on the device: via host

    @staticmethod
    def _expert(weights: Quantized, expert: int, matrix: str) -> Any:
        values, scales = weights.values[expert], weights.scales[expert]
        if matrix == "w13":  # gate's block rows, then up's (a partial last gate block holds gate rows only)
            rows, half = values.shape[0] // 2, scales.shape[0] // 2
            return array_module(values).concatenate([dequantize_blocks(values[:rows], scales[:half]),
                                                     dequantize_blocks(values[rows:], scales[half:])])
        if matrix != "w2":
            raise ValueError(f"matrix must be 'w13' or 'w2', got {matrix!r}")
        return dequantize_blocks(values, scales)

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        values = super().check(name, weights, xp, what)
        if weights.layout != self.layout:
            raise ValueError(f"{name} holds {weights.layout!r}-ordered values, {self.name} weights are "
                             f"{self.layout!r}-ordered (quantize_weights(w13, w2, {self.name!r}) makes them)")
        allowed = (FP8, np.dtype(np.uint8)) if xp is np else (np.dtype(np.uint8),)
        if values.dtype not in allowed:
            raise TypeError(f"{name}.values must be {' or '.join(map(str, allowed))} (e4m3fn bit patterns), got "
                            f"{values.dtype}")
        if weights.scales.dtype != np.float32:
            raise TypeError(f"{name}.scales must be float32, got {weights.scales.dtype}")
        want = self.scale_shape(name, tuple(int(d) for d in values.shape))
        if tuple(int(d) for d in weights.scales.shape) != want:
            raise ValueError(f"{name}.scales must be {list(want)} for values of shape {tuple(values.shape)} "
                             f"(one per {BLOCK} x {BLOCK} block{', gate and up apart' if name == 'w13' else ''}), "
                             f"got {tuple(weights.scales.shape)}")
        return values


def tile_values(values: Any, matrix: str) -> Any:
    """Row-major values [E, R, C] (e4m3 or bf16) in the tiled formats' order, where they live: w13's neuron group j
    (gate rows 8j .. 8j + 7, then up rows 8j .. 8j + 7) and w2's rows 16t .. 16t + 15 as tiles of 16 rows x
    :func:`tile_k` values, k block after k block -- the 16 rows a tensor-core warp reads in one k block are 1 KB
    apart from the next k block's, not one row (C values) apart."""
    xp = array_module(values)
    dtype, values = values.dtype, _bits(values)
    experts, rows, cols = (int(d) for d in values.shape)
    width = tile_k(dtype.itemsize)
    kb = cols // width
    if matrix == "w13":
        inter = rows // 2
        half = TILE_ROWS // 2  # a w13 tile: a neuron group's gate rows, then its up rows
        halves = [values[:, h * inter:(h + 1) * inter].reshape(experts, inter // half, half, kb, width)
                  .transpose(0, 1, 3, 2, 4) for h in (0, 1)]
        tiled = xp.concatenate(halves, axis=3)                       # [E, I/8, KB, 16, width]
    else:
        tiled = values.reshape(experts, rows // TILE_ROWS, TILE_ROWS, kb, width).transpose(0, 1, 3, 2, 4)
    return xp.ascontiguousarray(tiled).reshape(experts, rows, cols).view(dtype)


def _bits(values: Any) -> Any:
    """``values`` viewed as unsigned ints of their size: CuPy moves bfloat16 (and has no float8) only as bits."""
    return values.view({1: np.uint8, 2: np.uint16}[values.dtype.itemsize])


def untile_values(values: Any, matrix: str) -> Any:
    """The inverse of :func:`tile_values`: row-major values [E, R, C] again."""
    xp = array_module(values)
    dtype, values = values.dtype, _bits(values)
    experts, rows, cols = (int(d) for d in values.shape)
    width = tile_k(dtype.itemsize)
    kb = cols // width
    if matrix == "w13":
        inter = rows // 2
        half = TILE_ROWS // 2
        tiled = values.reshape(experts, inter // half, kb, TILE_ROWS, width)
        halves = [tiled[:, :, :, h * half:(h + 1) * half].transpose(0, 1, 3, 2, 4).reshape(experts, inter, cols)
                  for h in (0, 1)]
        return xp.ascontiguousarray(xp.concatenate(halves, axis=1)).view(dtype)
    tiled = values.reshape(experts, rows // TILE_ROWS, kb, TILE_ROWS, width).transpose(0, 1, 3, 2, 4)
    return xp.ascontiguousarray(tiled).reshape(experts, rows, cols).view(dtype)


def check_tile_dims(fmt: str, hidden: int, intermediate: int, width: int, what: str = "") -> None:
    """:class:`FormatDimsError` unless H and I are whole tiles ``width`` values wide (which makes every tile's 16
    rows whole too); ``what`` says whose dims they are."""
    if intermediate % width or hidden % width:
        raise FormatDimsError(f"{fmt} tiles need I and H multiples of {width}, got I = {intermediate}, H = {hidden}"
                              + (f" ({what})" if what else ""))


@dataclass(frozen=True)
class Fp8Block128T16(Fp8Block128):
    """fp8-block128's values and scales with the values in 16-row x 64-value tiles (:func:`tile_values`): the
    tensor-core kernels' warp reads each k block of its 16 rows as 1 KB of contiguous bytes. The scales keep
    fp8-block128's layout. Needs I % 64 == 0 and H % 64 == 0."""

    layout: str = "t16"

    def quantize(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        return self.from_rows(*super().quantize(w13, w2))

    def from_rows(self, w13: Quantized, w2: Quantized) -> tuple[Quantized, Quantized]:
        """fp8-block128 (w13, w2) -- e.g. :func:`fp8_experts_from_checkpoint`'s -- as this format, where they live."""
        tiled = []
        for name, q in (("w13", w13), ("w2", w2)):
            FP8_BLOCK128.check(name, q, array_module(q.values), "[E, 2I, H]" if name == "w13" else "[E, H, I]")
            self._check_values(name, q.values)
            tiled.append(Quantized(tile_values(q.values, name), q.scales, self.layout))
        return tiled[0], tiled[1]

    @staticmethod
    def _expert(weights: Quantized, expert: int, matrix: str) -> Any:
        values = untile_values(weights.values[expert:expert + 1], matrix)
        return Fp8Block128._expert(Quantized(values, weights.scales[expert:expert + 1]), 0, matrix)

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        values = super().check(name, weights, xp, what)
        self._check_values(name, values)
        return values


@dataclass(frozen=True)
class Bf16T16(WeightFormat):
    """The contract's bf16 values in 16-row x 32-value tiles (:func:`tile_values`; 64 bytes a tile row, so a
    tensor-core warp's k block of 16 rows is 1 KB contiguous, as in fp8-block128-t16), no scales: each matrix a
    :class:`Quantized` with ``scales`` None and layout "t16". Needs I % 32 == 0 and H % 32 == 0."""

    layout: str = "t16"

    def quantize(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        check_weights(w13, w2, self)
        return self.from_rows(_as_bf16(w13, "w13"), _as_bf16(w2, "w2"))

    def from_rows(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        """bf16 (w13, w2) in the contract's layouts as this format, where they live."""
        tiled = []
        for name, w in (("w13", w13), ("w2", w2)):
            BF16_FORMAT.check(name, w, array_module(w), "[E, 2I, H]" if name == "w13" else "[E, H, I]")
            self._check_values(name, w)
            tiled.append(Quantized(tile_values(w, name), None, self.layout))
        return tiled[0], tiled[1]

    def dequantize(self, weights: Any, matrix: str) -> np.ndarray:
        return untile_values(_host(weights.values), matrix).astype(np.float32)

    def host(self, weights: Any) -> Any:
        if not isinstance(weights, Quantized):
            return weights
        return dataclasses.replace(weights, values=_host(weights.values))

    def expert(self, weights: Any, expert: int, matrix: str) -> np.ndarray:
        return untile_values(_host(weights.values[expert:expert + 1]), matrix)[0]  # bf16, as the contract's

    def expert_here(self, weights: Any, expert: int, matrix: str) -> Any:
        return untile_values(weights.values[expert:expert + 1], matrix)[0]

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        if not isinstance(weights, Quantized):
            raise TypeError(f"{name} must be {self.name} weights (kernels.formats.Quantized: quantize_weights(w13, "
                            f"w2, {self.name!r}) makes them), got {type(weights).__name__}")
        if weights.layout != self.layout or weights.scales is not None:
            held = f"{weights.layout!r}-ordered values{' with scales' if weights.scales is not None else ''}"
            raise ValueError(f"{name} holds {held}, {self.name} weights are {self.layout!r}-ordered bf16 without "
                             f"scales (quantize_weights(w13, w2, {self.name!r}) makes them)")
        check_array(f"{name}.values", weights.values, xp, BF16, 3, what)
        self._check_values(name, weights.values)
        return weights.values


@dataclass(frozen=True)
class Fp4Format(ExpertWise):
    """``mxfp4`` / ``nvfp4``: e2m1 values two a byte along k ([E, 2I, H/2], [E, H, I/2] uint8, the even value in the
    low nibble), one scale byte per ``block`` values along k ([E, rows, ceil(k/block)]: e8m0, or e4m3 with a float32
    global scale per expert and matrix when ``e4m3``). Their arithmetic, layouts and sources (the OCP MX v1.0 spec,
    NVIDIA's NVFP4 recipe): :mod:`kernels.formats_fp4`."""

    block: int = 32
    e4m3: bool = False
    layout: str = fp4.LAYOUT

    @property
    def global_scaled(self) -> bool:
        return self.e4m3

    def matrix_shape(self, name: str, values_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*tuple(int(d) for d in values_shape[:-1]), 2 * int(values_shape[-1]))

    def scale_bytes(self, hidden: int, intermediate: int) -> int:
        """A byte per block of each row (w13: 2I rows of H, w2: H rows of I), and nvfp4's two float32 globals."""
        blocks = 2 * intermediate * -(-hidden // self.block) + hidden * -(-intermediate // self.block)
        return blocks + (2 * 4 if self.e4m3 else 0)

    def check_dims(self, hidden: int, intermediate: int, what: str = "") -> None:
        """:class:`FormatDimsError` unless H (w13's k) and I (w2's k) are even: two values a byte."""
        for dim, value, matrix in (("H", hidden, "w13"), ("I", intermediate, "w2")):
            if value % 2:
                raise FormatDimsError(f"{self.name} packs two e2m1 values a byte along k: {dim} ({matrix}'s k) must "
                                      f"be even, got {dim} = {value}" + (f" ({what})" if what else ""))

    def quantize(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        check_weights(w13, w2, self)
        return self._quantize(w13), self._quantize(w2)

    def _quantize(self, w: Any) -> Quantized:
        """One matrix [E, R, k], where it lives: CuPy bf16 weights on the device (``kernels.quantize_cuda``, bitwise
        the host's), else an expert at a time on the host (bounded host memory at real model sizes)."""
        xp = array_module(w)
        if xp is not np and w.dtype == BF16:
            from kernels.quantize_cuda import quantize_fp4_matrix

            values, scales, globals_ = quantize_fp4_matrix(w, self.block, self.e4m3)
            return Quantized(values, scales, self.layout, globals_)
        experts, rows, k = (int(d) for d in w.shape)
        values = np.empty((experts, rows, k // 2), np.uint8)
        scales = np.empty((experts, rows, -(-k // self.block)), np.uint8)
        globals_ = np.empty(experts, np.float32) if self.e4m3 else None
        for e in range(experts):
            values[e], scales[e], g = fp4.quantize_expert(_host(w[e]).astype(np.float32), self.block, self.e4m3)
            if globals_ is not None:
                globals_[e] = g
        if xp is not np:
            values, scales = xp.asarray(values), xp.asarray(scales)
            globals_ = None if globals_ is None else xp.asarray(globals_)
        return Quantized(values, scales, self.layout, globals_)

    def _expert(self, weights: Quantized, expert: int, matrix: str) -> Any:
        if matrix not in ("w13", "w2"):
            raise ValueError(f"matrix must be 'w13' or 'w2', got {matrix!r}")
        gs = None if weights.global_scale is None else weights.global_scale[expert]
        return fp4.dequantize_rows(weights.values[expert], weights.scales[expert], gs, self.block, self.e4m3)

    def check(self, name: str, weights: Any, xp: Any, what: str) -> Any:
        values = super().check(name, weights, xp, what)
        if weights.layout != self.layout:
            raise ValueError(f"{name} holds {weights.layout!r}-ordered values, {self.name} weights are "
                             f"{self.layout!r} (quantize_weights(w13, w2, {self.name!r}) makes them)")
        fp4.check_arrays(self.name, name, weights, xp, self.block, self.e4m3)
        return values


BF16_FORMAT = Bf16("bf16", "bfloat16 values, no scales (the data contract)", 2)
BF16_T16 = Bf16T16("bf16-t16", "bf16 with its values in 16-row x 32-value tiles", 2)
FP8_BLOCK128 = Fp8Block128("fp8-block128", "float8 e4m3fn values, a float32 scale per 128 x 128 block", 1)
FP8_BLOCK128_T16 = Fp8Block128T16("fp8-block128-t16", "fp8-block128 with its values in 16-row x 64-value tiles", 1)
MXFP4 = Fp4Format("mxfp4", "e2m1 values two a byte, an e8m0 scale per 32 values along k (OCP MX)", 0.5)
NVFP4 = Fp4Format("nvfp4", "e2m1 values two a byte, an e4m3 scale per 16 values along k, a float32 scale per "
                  "expert matrix (NVIDIA NVFP4)", 0.5, block=16, e4m3=True)
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (BF16_FORMAT, BF16_T16, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4,
                                                        NVFP4)}
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


def format_of(w13: Any) -> str:
    """The name of the format ``w13`` is in: "bf16" for a plain array, else the format whose layout (and scales or
    none) its :class:`Quantized` holds (what an entry point given these weights runs: the format's own paths)."""
    for fmt in FORMATS.values():
        if fmt.stores(w13):
            return fmt.name
    layouts = sorted({getattr(fmt, "layout", "rows") for fmt in FORMATS.values()})
    scales = "with" if w13.scales is not None else "without"
    extra = " and a global scale" if w13.global_scale is not None else ""
    raise ValueError(f"w13 holds {w13.layout!r}-ordered values {scales} scales{extra}; the formats know "
                     f"{', '.join(layouts)} ({', '.join(FORMATS)})")


def check_weight_dims(w13_shape: Any, w2_shape: Any, hidden: int | None = None) -> tuple[int, int, int]:
    """``(E, H, I)`` of w13 [E, 2I, H] and w2 [E, H, I] given their shapes; a ValueError naming the argument and the
    shape expected unless E >= 1, w13's 2I is even, w2 matches w13 and H and I are multiples of 8. ``hidden``: H as
    x says (``kernels.contract.check_inputs``); without it (weights alone, :func:`check_weights`) w13's last
    dimension is H."""
    w13_shape, w2_shape = tuple(int(d) for d in w13_shape), tuple(int(d) for d in w2_shape)
    experts, two_i, w13_hidden = w13_shape
    from_x = hidden is not None
    if experts < 1:
        raise ValueError(f"w13 must hold at least one expert (E >= 1), got shape {w13_shape}")
    if from_x and w13_hidden != hidden:
        raise ValueError(f"w13 is [E, 2I, H] with H = {hidden} (from x), got shape {w13_shape}")
    hidden = w13_hidden
    if two_i < 2 or two_i % 2:
        raise ValueError(f"w13's second dimension is 2I (gate then up rows), must be even, got {two_i}")
    intermediate = two_i // 2
    if w2_shape != (experts, hidden, intermediate):
        # w13 given w2's [E, H, I] and w2 given w13's [E, 2I, H]
        swapped = len(w2_shape) == 3 and w2_shape[1] == 2 * w13_shape[2] and w2_shape[2] == w13_shape[1]
        raise ValueError(
            f"w2 must be [E, H, I] = [{experts}, {hidden}, {intermediate}] to match "
            + ("w13 and x" if from_x else f"w13 [E, 2I, H] = {list(w13_shape)}")
            + f", got shape {w2_shape}" + (" (w13 and w2 swapped?)" if swapped else "")
        )
    for dim, value, where in (("H", hidden, "x.shape[1]"), ("I", intermediate, "w2.shape[2]")):
        if value % 8 and from_x:
            raise ValueError(f"{dim} ({where}) must be a multiple of 8 for 16-byte loads, got {value}")
        if value % 8:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] with {dim} a multiple of 8 (16-byte loads), "
                             f"got {dim} = {value}: w13 {w13_shape}, w2 {w2_shape}")
    return experts, hidden, intermediate


def check_weights(w13: Any, w2: Any, weight_format: Any = "bf16") -> tuple[int, int, int]:
    """Check weights in the contract's layouts before they are converted offline into ``weight_format``
    (``kernels.quantize_weights``); return ``(E, H, I)``.

    w13 [E, 2I, H] and w2 [E, H, I] must be float32 or bf16 (any float) arrays of one kind, NumPy or CuPy, with the
    dims of :func:`check_weight_dims` and those the format stores (``WeightFormat.check_dims``: a tiled format's whole
    tiles), and every value finite: a NaN or inf is a ValueError naming the matrix, the experts holding them and the
    first one's index. A block scale cannot represent them (unchecked, a NaN left its fp8-block128 block unscaled and
    an inf zeroed the rest of it), and an offline conversion is where a corrupt weight costs least to catch. The
    finiteness pass reads every value once, an expert at a time; on CuPy it reads one count back to the host.
    """
    fmt = get_format(weight_format)
    xp = None
    for name, w in (("w13", w13), ("w2", w2)):
        dtype = getattr(w, "dtype", None)
        if dtype is None or not (dtype == BF16 or np.dtype(dtype).kind == "f"):
            raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(w).__name__} of {dtype}")
        module = array_module(w)
        if xp is not None and module is not xp:
            raise TypeError(f"w2 must be a {xp.__name__} array like w13, got {type(w).__module__}.{type(w).__name__}")
        xp = module
        if w.ndim != 3:
            want = "[E, 2I, H]" if name == "w13" else "[E, H, I]"
            raise ValueError(f"{name} must have 3 dimensions {want}, got shape {tuple(w.shape)}")
    experts, hidden, intermediate = check_weight_dims(w13.shape, w2.shape)
    fmt.check_dims(hidden, intermediate, f"w13 [E, 2I, H] = {list(w13.shape)}, w2 [E, H, I] = {list(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        _check_finite(name, w, fmt.name)
    return experts, hidden, intermediate


def _check_finite(name: str, w: Any, target: str) -> None:
    """ValueError unless every value of ``w`` [E, R, C] is finite (one expert at a time: bounded temporaries)."""
    xp = array_module(w)
    counts = xp.zeros(int(w.shape[0]), np.int64)
    for e in range(int(w.shape[0])):
        m = w[e]
        bad = (m.view(np.uint16) & 0x7F80) == 0x7F80 if m.dtype == BF16 else ~xp.isfinite(m)
        counts[e] = xp.count_nonzero(bad)
    if not int(counts.sum()):
        return
    counts = counts.get() if xp is not np else counts
    experts = np.flatnonzero(counts)
    first = int(experts[0])
    m = w[first]
    host = (m.get() if xp is not np else m).astype(np.float32)
    row, col = (int(i) for i in np.argwhere(~np.isfinite(host))[0])
    listed = ", ".join(f"{int(e)} ({int(counts[e])})" for e in experts[:8]) + (", ..." if len(experts) > 8 else "")
    raise ValueError(f"{name} must be finite to become {target} weights: {int(counts.sum())} NaN/inf values in "
                     f"{len(experts)} of {len(counts)} experts (expert (count): {listed}); the first is "
                     f"{name}[{first}, {row}, {col}] = {host[row, col]}")


def quantize_weights(w13: Any, w2: Any, weight_format: str | WeightFormat = FP8_BLOCK128.name) -> tuple[Any, Any]:
    """``(w13, w2)`` in ``weight_format`` from fp32 / bf16 weights in the data contract's layouts (NumPy or CuPy:
    the result lives where the input did). For ``"fp8-block128"`` each is a :class:`Quantized` that every entry
    point taking that format and ``reference.moe_decode`` accept in place of bf16 weights (they read the format from
    it). Checked first (:func:`check_weights`): w13 [E, 2I, H] and w2 [E, H, I] with H and I as the
    format stores them, every value finite -- a NaN or inf is a ValueError naming the matrix and the experts."""
    return get_format(weight_format).quantize(w13, w2)


CHECKPOINT_TENSORS = ("gate_proj.weight", "gate_proj.weight_scale_inv", "up_proj.weight", "up_proj.weight_scale_inv",
                      "down_proj.weight", "down_proj.weight_scale_inv")


def fp8_experts_from_checkpoint(experts: Sequence[Mapping[str, Any]]) -> tuple[Quantized, Quantized]:
    """fp8-block128 (w13, w2) on the host from an FP8 checkpoint's per-expert tensors, expert e = ``experts[e]``:
    a mapping with :data:`CHECKPOINT_TENSORS` -- ``gate_proj.weight`` / ``up_proj.weight`` [I, H] and
    ``down_proj.weight`` [H, I] (float8 e4m3fn or their uint8 bit patterns) and each one's ``weight_scale_inv``
    (float32, one per 128 x 128 block; dequantized = value x scale). From a flat state dict, e.g.::

        prefix = "model.layers.3.mlp.experts"
        experts = [{k[len(f"{prefix}.{e}."):]: v for k, v in state.items() if k.startswith(f"{prefix}.{e}.")}
                   for e in range(num_experts)]

    ValueError / TypeError name the expert, the tensor and what was expected; non-finite values (e4m3fn's NaN codes,
    NaN or inf scales) are refused (the NaN policy: kernels/contract.py)."""
    if isinstance(experts, Mapping) or not isinstance(experts, Sequence) or not experts:
        raise TypeError("experts must be a non-empty sequence of per-expert mappings (tensor name -> array)")
    first = experts[0]
    if not isinstance(first, Mapping) or "gate_proj.weight" not in first:
        raise ValueError("experts[0] must be a mapping holding 'gate_proj.weight' (and the other checkpoint tensors)")
    inter, hidden = (int(d) for d in np.shape(first["gate_proj.weight"]))
    shapes = {"gate_proj.weight": (inter, hidden), "up_proj.weight": (inter, hidden),
              "down_proj.weight": (hidden, inter),
              "gate_proj.weight_scale_inv": (_blocks(inter), _blocks(hidden)),
              "up_proj.weight_scale_inv": (_blocks(inter), _blocks(hidden)),
              "down_proj.weight_scale_inv": (_blocks(hidden), _blocks(inter))}
    count = len(experts)
    w13 = Quantized(np.empty((count, 2 * inter, hidden), FP8), np.empty((count, 2 * _blocks(inter), _blocks(hidden)),
                                                                        np.float32))
    w2 = Quantized(np.empty((count, hidden, inter), FP8),
                   np.empty((count, _blocks(hidden), _blocks(inter)), np.float32))
    for e, tensors in enumerate(experts):
        if not isinstance(tensors, Mapping):
            raise TypeError(f"experts[{e}] must be a mapping of tensor name -> array, got {type(tensors).__name__}")
        missing = [name for name in CHECKPOINT_TENSORS if name not in tensors]
        if missing:
            raise ValueError(f"experts[{e}] lacks {', '.join(missing)}")
        got = {}
        for name in CHECKPOINT_TENSORS:
            arr = _host(tensors[name])
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"experts[{e}][{name!r}] must be a NumPy array, got {type(arr).__name__}")
            if tuple(arr.shape) != shapes[name]:
                raise ValueError(f"experts[{e}][{name!r}] must be {list(shapes[name])} (I = {inter}, H = {hidden} "
                                 f"from experts[0]'s gate_proj.weight), got {list(arr.shape)}")
            if name.endswith("scale_inv"):
                if arr.dtype != np.float32:
                    raise TypeError(f"experts[{e}][{name!r}] must be float32, got {arr.dtype}")
            elif arr.dtype not in (FP8, np.dtype(np.uint8)):
                raise TypeError(f"experts[{e}][{name!r}] must be float8_e4m3fn (or its uint8 bit patterns), got "
                                f"{arr.dtype}")
            bad = ~np.isfinite(arr) if name.endswith("scale_inv") else (arr.view(np.uint8) & 0x7F) == 0x7F
            if bad.any():
                what = "NaN/inf scales" if name.endswith("scale_inv") else "e4m3fn NaN codes (0x7F / 0xFF)"
                raise ValueError(f"experts[{e}][{name!r}] must be finite: {int(bad.sum())} {what}, the first at "
                                 f"{list(int(i) for i in np.argwhere(bad)[0])}")
            got[name] = arr.view(FP8) if arr.dtype == np.uint8 else arr
        w13.values[e, :inter], w13.values[e, inter:] = got["gate_proj.weight"], got["up_proj.weight"]
        w13.scales[e] = np.concatenate([got["gate_proj.weight_scale_inv"], got["up_proj.weight_scale_inv"]])
        w2.values[e], w2.scales[e] = got["down_proj.weight"], got["down_proj.weight_scale_inv"]
    return w13, w2



# gpt-oss's expert tensors, one layer: Hugging Face's names (model.layers.{n}.mlp.experts.<name>) and the original
# checkpoint's (original/*.safetensors: block.{n}.mlp.<name>); transformers' convert_gpt_oss_weights_to_hf.py maps
# mlp1_weight.blocks -> gate_up_proj_blocks and so on, the arrays unchanged
GPT_OSS_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                   "down_proj_blocks", "down_proj_scales", "down_proj_bias")
GPT_OSS_ORIGINAL_TENSORS = ("mlp1_weight.blocks", "mlp1_weight.scales", "mlp1_bias",
                            "mlp2_weight.blocks", "mlp2_weight.scales", "mlp2_bias")
MX_BLOCK = 32  # values per e8m0 scale along k (OCP MX); a checkpoint block holds them in 16 bytes
E8M0_NAN = 255  # the e8m0 code that is NaN (OCP MX spec): no scale


def gpt_oss_experts_from_checkpoint(
    tensors: Mapping[str, Any], prefix: str = ""
) -> tuple[Quantized, Quantized, np.ndarray, np.ndarray]:
    """``(w13, w2, b13, b2)`` on the host from one layer of a gpt-oss checkpoint, keyed ``prefix + name`` for the
    names of :data:`GPT_OSS_TENSORS` (Hugging Face's, e.g. ``prefix="model.layers.3.mlp.experts."``) or of
    :data:`GPT_OSS_ORIGINAL_TENSORS` (the original checkpoint's, ``prefix="block.3.mlp."``):

    ======================  ==================  =====  =========================================================
    gate_up_proj_blocks     [E, 2I, H/32, 16]   uint8  e2m1 pairs, low nibble = the even k (gpt_oss/torch/weights.py)
    gate_up_proj_scales     [E, 2I, H/32]       uint8  e8m0: 2^(s - 127) per 32 values along k
    gate_up_proj_bias       [E, 2I]             bf16   (or its uint16 bits: safetensors' NumPy loader has no bf16)
    down_proj_blocks        [E, H, I/32, 16]    uint8
    down_proj_scales        [E, H, I/32]        uint8
    down_proj_bias          [E, H]              bf16
    ======================  ==================  =====  =========================================================

    Returns the lab's mxfp4 (:data:`MXFP4`): ``Quantized(values=uint8 [E, rows, k/2], scales=uint8 [E, rows, k/32])``,
    two e2m1 a byte, low nibble the even element: the blocks' last two axes merged, bytes unchanged -- and the biases
    as bf16 [E, 2I] / [E, H]. The checkpoint interleaves gate and up in w13's rows (gate j = row 2j); w13's rows, their
    scales and b13 come back in the contract's order, gate rows then up rows (``kernels.activation.deinterleave``), as
    every path reads them: ``kernels.reference.moe_decode(..., activation="gpt-oss", b13=b13, b2=b2)`` or
    ``kernels.moe_decode(...)`` with the same keywords (the format is the lab's mxfp4).

    ValueError / TypeError name the tensor and what was expected: a missing tensor, a dtype, a shape (E, 2I, H and I
    must agree across the six; 2I even), an e8m0 NaN scale (255) or a NaN / inf bias (refused as
    ``fp8_experts_from_checkpoint`` refuses them: the NaN policy of kernels/contract.py).
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of tensor name -> array, got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    names = GPT_OSS_TENSORS
    if prefix + GPT_OSS_TENSORS[0] not in tensors and prefix + GPT_OSS_ORIGINAL_TENSORS[0] in tensors:
        names = GPT_OSS_ORIGINAL_TENSORS
    missing = [prefix + name for name in names if prefix + name not in tensors]
    if missing:
        other = GPT_OSS_ORIGINAL_TENSORS if names is GPT_OSS_TENSORS else GPT_OSS_TENSORS
        raise ValueError(f"tensors lacks {', '.join(repr(m) for m in missing)} (one layer's gpt-oss experts: "
                         f"{', '.join(prefix + n for n in names)}; or the original checkpoint's "
                         f"{', '.join(prefix + n for n in other)})")
    got = {}
    for role, name in zip(GPT_OSS_TENSORS, names, strict=True):
        arr = _host(tensors[prefix + name])
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{prefix + name!r} must be a NumPy array, got {type(arr).__name__}")
        got[role] = (prefix + name, arr)

    def shape_error(role: str, want: str, values: tuple[int, ...], why: str = "") -> ValueError:
        key, arr = got[role]
        return ValueError(f"{key!r} must be {want} = {list(values)}{why}, got {list(arr.shape)}")

    for role in ("gate_up_proj_blocks", "down_proj_blocks", "gate_up_proj_scales", "down_proj_scales"):
        key, arr = got[role]
        if arr.dtype != np.uint8:
            what = "packed e2m1 pairs" if role.endswith("blocks") else "e8m0 exponents"
            raise TypeError(f"{key!r} must be uint8 ({what}), got {arr.dtype}")
    key, gu = got["gate_up_proj_blocks"]
    if gu.ndim != 4 or gu.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"{key!r} must be [E, 2I, H/32, 16] (16 bytes = 32 e2m1 values a block), got {list(gu.shape)}")
    experts, two_i, h_blocks, _ = (int(d) for d in gu.shape)
    if experts < 1 or two_i < 2 or h_blocks < 1:
        raise ValueError(f"{key!r} must be [E, 2I, H/32, 16] with E >= 1, 2I >= 2 and H >= 32, got {list(gu.shape)}")
    if two_i % 2:
        raise ValueError(f"{key!r} is [E, 2I, H/32, 16]: its second dimension is 2I (gate and up rows "
                         f"interleaved), must be even, got {two_i}")
    hidden, inter = h_blocks * MX_BLOCK, two_i // 2
    key, dn = got["down_proj_blocks"]
    if dn.ndim != 4 or dn.shape[-1] != MX_BLOCK // 2 or int(dn.shape[0]) != experts or int(dn.shape[1]) != hidden:
        raise ValueError(f"{key!r} must be [E, H, I/32, 16] = [{experts}, {hidden}, {inter / MX_BLOCK:g}, 16] (E, H "
                         f"and 2I from {got['gate_up_proj_blocks'][0]!r}), got {list(dn.shape)}")
    if int(dn.shape[2]) * MX_BLOCK != inter:
        raise ValueError(f"{key!r} is [E, H, I/32, 16] with I = {inter} ({got['gate_up_proj_blocks'][0]!r}'s 2I / 2): "
                         f"I must be a multiple of 32 and dn.shape[2] = I/32 = {inter / MX_BLOCK:g}, got "
                         f"{list(dn.shape)}")
    for role, blocks_role in (("gate_up_proj_scales", "gate_up_proj_blocks"), ("down_proj_scales", "down_proj_blocks")):
        want = tuple(int(d) for d in got[blocks_role][1].shape[:3])
        key, scales = got[role]
        if tuple(int(d) for d in scales.shape) != want:
            raise shape_error(role, f"{got[blocks_role][0]!r}'s shape less its last axis", want)
        bad = scales == E8M0_NAN
        if bad.any():
            raise ValueError(f"{key!r} must be finite scales: {int(bad.sum())} e8m0 NaN codes (255), the first at "
                             f"{[int(i) for i in np.argwhere(bad)[0]]}")
    biases = {}
    for role, want, what in (("gate_up_proj_bias", (experts, two_i), "[E, 2I]"),
                             ("down_proj_bias", (experts, hidden), "[E, H]")):
        key, bias = got[role]
        if bias.dtype not in (BF16, np.dtype(np.uint16)):
            raise TypeError(f"{key!r} must be bfloat16 (or its uint16 bit patterns), got {bias.dtype}")
        if tuple(int(d) for d in bias.shape) != want:
            raise shape_error(role, what, want)
        bias = np.ascontiguousarray(bias).view(BF16)
        bad = (bias.view(np.uint16) & 0x7F80) == 0x7F80
        if bad.any():
            raise ValueError(f"{key!r} must be finite: {int(bad.sum())} NaN/inf values, the first at "
                             f"{[int(i) for i in np.argwhere(bad)[0]]}")
        biases[role] = bias
    w13 = Quantized(deinterleave(gu.reshape(experts, two_i, hidden // 2)),
                    deinterleave(got["gate_up_proj_scales"][1]), MXFP4.layout)
    w2 = Quantized(np.ascontiguousarray(dn).reshape(experts, hidden, inter // 2),
                   np.ascontiguousarray(got["down_proj_scales"][1]), MXFP4.layout)
    return w13, w2, deinterleave(biases["gate_up_proj_bias"], axis=-1), biases["down_proj_bias"]
