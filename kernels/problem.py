"""Input generation: one MoE decode problem (activations, weights, routing) for a shape and a batch.

Weights are random normal scaled like trained checkpoints (std 1/sqrt(fan-in): ``w13`` ~ N(0, 1/H),
``w2`` ~ N(0, 1/I)), activations ~ N(0, 1); never zeros. NumPy problems are generated on the CPU; CuPy
problems are generated on the GPU directly (a 20 GB layer takes milliseconds there, minutes here).

A shape whose experts carry biases (``MoEShape.bias``: gpt-oss's) also gets ``b13`` [E, 2I] and ``b2`` [E, H] in
bf16, at the scale of one weight row's contribution: N(0, 1/H) and N(0, 1/I), PyTorch's ``nn.Linear`` bias scale
(bound 1/sqrt(fan-in)); no trained checkpoint's bias statistics are cited here. They come from their own random
stream, so x, w13 and w2 are the same bits with or without them. ``Problem.arrays`` stays the contract's five (what
the kernels compute); ``Problem.layer`` holds the keywords that make ``kernels.reference.moe_decode`` compute the
model's own layer: ``moe_decode(*p.arrays, **p.layer)``. With gpt-oss's activation, gate_up ~ N(0, 1 + 1/H) reaches
its clamp at 7 about never: a test of the clamps builds its own inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.contract import BF16, check_int, check_xp
from kernels.formats import Quantized
from kernels.routing import make_routing, unique_experts
from kernels.shapes import MoEShape, get_shape


@dataclass
class Problem:
    """The five inputs of one MoE decode call, plus where they came from."""

    shape: MoEShape
    tokens: int
    seed: int
    routing: str
    x: Any  # [T, H] bf16
    w13: Any  # [E, 2I, H] bf16
    w2: Any  # [E, H, I] bf16
    topk_ids: Any  # [T, K] int32
    topk_weights: Any  # [T, K] float32
    meta: dict = field(default_factory=dict)
    b13: Any = None  # [E, 2I] bf16, when the shape's experts carry biases
    b2: Any = None  # [E, H] bf16

    @property
    def layer(self) -> dict[str, Any]:
        """``kernels.reference.moe_decode``'s keywords for the model's own layer: the shape's activation and the
        biases (None where it has none), so ``moe_decode(*p.arrays, **p.layer)`` works for every problem."""
        return {"activation": self.shape.activation, "b13": self.b13, "b2": self.b2}

    @property
    def arrays(self) -> tuple[Any, Any, Any, Any, Any]:
        """``(x, w13, w2, topk_ids, topk_weights)``, the positional arguments of every entry point."""
        return self.x, self.w13, self.w2, self.topk_ids, self.topk_weights

    @property
    def xp(self) -> Any:
        from kernels.contract import array_module

        return array_module(self.x)

    @property
    def unique_experts(self) -> int:
        return unique_experts(_to_numpy(self.topk_ids))

    def compact(self) -> Problem:
        """A host copy holding only the experts the routing touches, ids renumbered to match.

        The reference's answer is unchanged, and checking a GPU result at a 20 GB preset copies only the
        touched experts' weights back to the host.
        """
        ids = _to_numpy(self.topk_ids)
        touched, remapped = np.unique(ids, return_inverse=True)
        xp = self.xp
        index = xp.asarray(touched.astype(np.int64))
        return Problem(
            self.shape.with_(experts=int(touched.size)),
            self.tokens,
            self.seed,
            self.routing,
            _to_numpy(self.x),
            _to_numpy(self.w13[index]),
            _to_numpy(self.w2[index]),
            remapped.reshape(ids.shape).astype(np.int32),
            _to_numpy(self.topk_weights),
            meta={**self.meta, "experts_touched": touched},
            b13=None if self.b13 is None else _to_numpy(self.b13[index]),
            b2=None if self.b2 is None else _to_numpy(self.b2[index]),
        )

    def to_numpy(self) -> Problem:
        """The same problem with every array on the host."""
        return self._with_arrays(_to_numpy)

    def to_cupy(self) -> Problem:
        """The same problem with every array on the current GPU."""
        import cupy

        return self._with_arrays(cupy.asarray)

    def _with_arrays(self, convert: Any) -> Problem:
        return Problem(
            self.shape,
            self.tokens,
            self.seed,
            self.routing,
            *(convert_array(a, convert) for a in self.arrays),
            meta=dict(self.meta),
            b13=convert_array(self.b13, convert),
            b2=convert_array(self.b2, convert),
        )


def convert_array(arr: Any, convert: Any) -> Any:
    """``convert(arr)`` (``cupy.asarray``, say), or for a quantized weight the same :class:`Quantized` with each of its
    arrays converted (values, scales, a global scale); None stays None."""
    if arr is None:
        return None
    if not isinstance(arr, Quantized):
        return convert(arr)
    parts = ("values", "scales", "global_scale")
    return dataclasses.replace(arr, **{name: convert(getattr(arr, name)) for name in parts
                                       if getattr(arr, name) is not None})


def _to_numpy(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


def _normal_bf16_numpy(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    return values.astype(BF16)


def _normal_bf16_cupy(seed: int, shape: tuple[int, ...], std: float) -> Any:
    """N(0, std^2) rounded to bf16 on the GPU, by integer round-to-nearest-even on the fp32 bits.

    Generated in slabs of the leading axis (~64 M values each) so a 22 GB layer never needs its fp32
    temporaries all at once.
    """
    import cupy

    rng = cupy.random.default_rng(seed)
    out = cupy.empty(shape, dtype=cupy.uint16)
    per_row = max(1, int(np.prod(shape[1:])))
    rows = max(1, (64 << 20) // per_row)
    for start in range(0, shape[0], rows):
        slab = out[start : start + rows]
        values = rng.standard_normal(slab.shape, dtype=cupy.float32)
        values *= cupy.float32(std)
        bits = values.view(cupy.uint32)
        slab[...] = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
        del values, bits
    return out.view(BF16)


def make_weights(shape: MoEShape | str, seed: int = 0, xp: Any = np) -> tuple[Any, Any]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` in bf16 on NumPy or CuPy, deterministic by seed.

    ``seed`` is an int >= 0; ``xp`` is ``numpy`` or ``cupy`` (module or name; cupy needs a CUDA GPU).
    """
    shape = get_shape(shape)
    seed = check_int("seed", seed, 0)
    xp = check_xp(xp)
    H, I, E = shape.hidden, shape.intermediate, shape.experts
    if xp is np:
        rng = np.random.default_rng([seed, 1])
        return (
            _normal_bf16_numpy(rng, (E, 2 * I, H), H**-0.5),
            _normal_bf16_numpy(rng, (E, H, I), I**-0.5),
        )
    w13 = _normal_bf16_cupy(seed * 2 + 1, (E, 2 * I, H), H**-0.5)
    w2 = _normal_bf16_cupy(seed * 2 + 2, (E, H, I), I**-0.5)
    # generation ran on the current stream: finish it, or work on another (non-blocking) stream may read
    # the weights before they exist
    xp.cuda.get_current_stream().synchronize()
    return w13, w2


def make_problem(
    shape: MoEShape | str,
    tokens: int,
    seed: int = 0,
    routing: Any = "uniform",
    xp: Any = np,
) -> Problem:
    """A fresh problem: ``tokens`` decode tokens through one layer of ``shape``.

    ``tokens`` is an int >= 1 and ``seed`` an int >= 0 (Python or NumPy ints); ``routing`` is a generator
    name (``kernels.routing.GENERATORS``: "uniform", "zipf", "correlated", "same", ...) or fixed ids (see
    ``make_routing``); ``xp`` is ``numpy`` or ``cupy`` (module or name; cupy generates the weights on the GPU and
    needs one). Every argument is checked before any array is made.
    """
    shape = get_shape(shape)
    tokens = check_int("tokens", tokens, 1)
    seed = check_int("seed", seed, 0)
    xp = check_xp(xp)
    topk_ids, topk_weights = make_routing(tokens, shape.experts, shape.top_k, routing, seed)
    rng = np.random.default_rng([seed, 0])
    x = _normal_bf16_numpy(rng, (tokens, shape.hidden), 1.0)
    w13, w2 = make_weights(shape, seed, xp)
    b13, b2 = make_biases(shape, seed) if shape.bias else (None, None)
    if xp is not np:
        x, topk_ids, topk_weights = (xp.asarray(a) for a in (x, topk_ids, topk_weights))
        b13, b2 = (None if b is None else xp.asarray(b) for b in (b13, b2))
        xp.cuda.get_current_stream().synchronize()  # see make_weights: the copies must land before use
    name = routing if isinstance(routing, str) else "fixed"
    return Problem(shape, tokens, seed, name, x, w13, w2, topk_ids, topk_weights, b13=b13, b2=b2)


def make_biases(shape: MoEShape | str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(b13 [E, 2I], b2 [E, H])`` in bf16 on the host, deterministic by seed (a stream of their own):
    N(0, 1/H) and N(0, 1/I), the scale of one weight row's contribution (the module docstring). Small: a host copy
    is all a GPU problem needs (E x (2I + H) values)."""
    shape = get_shape(shape)
    seed = check_int("seed", seed, 0)
    rng = np.random.default_rng([seed, 2])
    E, H, I = shape.experts, shape.hidden, shape.intermediate
    return _normal_bf16_numpy(rng, (E, 2 * I), H**-0.5), _normal_bf16_numpy(rng, (E, H), I**-0.5)
