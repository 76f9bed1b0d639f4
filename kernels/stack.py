"""Cheap problems and a multi-layer MoE stack, for measuring how numerical error grows with depth.

Two things live here (NumPy, optionally CuPy for :func:`moe_fp64`):

* :func:`expert_weights` / :func:`sparse_problem`: one expert's weights from its own seeded generator,
  so a problem at a 20 GB preset costs only the experts its routing touches (the routing is drawn first,
  the touched experts generated, the ids renumbered). Same distributions as :mod:`kernels.problem`
  (``w13`` ~ N(0, 1/H), ``w2`` ~ N(0, 1/I), x ~ N(0, 1), all bf16), different random streams.
* :func:`moe_fp64`: the fp64 oracle of one MoE layer for activations of any float dtype (the fp64 stack
  carries fp64 activations, which the bf16 contract of ``reference.moe_decode`` does not accept), on
  NumPy or CuPy. On bf16 inputs it equals ``reference.moe_decode(mode="fp64")``.
* :class:`Stack`: L decoder layers of (RMSNorm, router, MoE, residual add), run once in fp64 and once per
  compared path with a bf16 residual stream (see :meth:`Stack.run_path`).

One layer, ``h`` the residual stream ([T, H]), ``l`` the layer::

    a      = RMSNorm(h) * gamma_l              eps 1e-6, gamma_l ~ bf16(1 + 0.1 N(0, 1))
    logits = a @ router_l.T                    router_l [E, H] ~ N(0, 1/H), so logits ~ N(0, 1)
    ids, w = route(logits, K)                  softmax, top-k, renormalised (kernels.routing.route)
    h      = h + MoE_l(a, ids, w)              experts generated on first use, per (seed, layer, expert)

fp64 path: every step in float64 (routing ids from ``route`` on the fp64 logits, weights recomputed in
float64). bf16 paths: h is bf16; RMSNorm in fp32, its output rounded to bf16 (the MoE's x); router logits
fp32-accumulated and stored bf16, softmax in fp32; the MoE by ``reference.moe_decode`` in the path's mode
(bf16 out); the residual add in fp32, rounded to bf16.

A quantized weight format (``weight_format="fp8-block128"``): every expert's generated weights quantized once
(per expert, so the same expert has the same values in every run); the fp64 stack then runs on the dequantized
weights (the oracle that isolates a path's numerics from the format's error) and a path reads the quantized ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.contract import BF16, array_module, check_int
from kernels.formats import Quantized, get_format
from kernels.numerics import bf16_to_f32, round_bf16
from kernels.problem import Problem
from kernels.reference import expert_groups, moe_decode
from kernels.routing import make_routing, route
from kernels.shapes import MoEShape, get_shape

RMS_EPS = 1e-6
# the compared paths: name -> (reference mode, quant)
PATHS: dict[str, tuple[str, str | None]] = {
    "warp_decode": ("warp_decode", None),
    "classical": ("classical", None),
    "classical+fp8": ("classical", "fp8"),
    "classical+mxfp8": ("classical", "mxfp8"),
}


def _normal_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    if mean:
        values += np.float32(mean)
    return values.astype(BF16)


def decode_input(hidden: int, tokens: int, seed: int) -> np.ndarray:
    """x [T, H] bf16 ~ N(0, 1): the same values ``make_problem(shape, tokens, seed)`` puts in ``x``."""
    return _normal_bf16(np.random.default_rng([seed, 0]), (tokens, hidden), 1.0)


def expert_weights(shape: MoEShape, seed: int, expert: int, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(w13_e [2I, H], w2_e [H, I])`` bf16 of one expert, from a generator seeded by (seed, layer, expert)."""
    H, I = shape.hidden, shape.intermediate
    rng = np.random.default_rng([seed, 7, layer, expert])
    return _normal_bf16(rng, (2 * I, H), H**-0.5), _normal_bf16(rng, (H, I), I**-0.5)


def sparse_problem(
    shape: MoEShape | str,
    tokens: int,
    seed: int = 0,
    routing: Any = "uniform",
    cache: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Problem:
    """A compact host problem: routing over ``shape.experts`` first, then only the touched experts' weights.

    The returned problem has ``shape.experts`` = number touched and renumbered ``topk_ids``;
    ``meta["experts_touched"]`` holds the original ids. x and the routing are those of
    ``make_problem(shape, tokens, seed, routing)``; the weights come from :func:`expert_weights`.
    ``cache`` (expert id -> weights, for this shape and seed only) lets several batches share experts.
    """
    shape = get_shape(shape)
    tokens = check_int("tokens", tokens, 1)
    topk_ids, topk_weights = make_routing(tokens, shape.experts, shape.top_k, routing, seed)
    x = decode_input(shape.hidden, tokens, seed)
    touched, remapped = np.unique(topk_ids, return_inverse=True)
    cache = {} if cache is None else cache
    for e in touched:
        if int(e) not in cache:
            cache[int(e)] = expert_weights(shape, seed, int(e))
    pairs = [cache[int(e)] for e in touched]
    w13 = np.stack([p[0] for p in pairs])
    w2 = np.stack([p[1] for p in pairs])
    name = routing if isinstance(routing, str) else "fixed"
    return Problem(
        shape.with_(experts=int(touched.size)), tokens, seed, name, x, w13, w2,
        remapped.reshape(topk_ids.shape).astype(np.int32), topk_weights,
        meta={"experts_touched": touched, "model_experts": shape.experts},
    )


def _widen64(arr: Any, xp: Any) -> Any:
    """float64 copy of a bf16 (exact widening) or float array."""
    if arr.dtype == BF16:
        bits = arr.view(xp.uint16).astype(xp.uint32) << 16
        return bits.view(xp.float32).astype(xp.float64)
    return arr.astype(xp.float64)


def moe_fp64(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, weight_format: str = "bf16") -> Any:
    """fp64 oracle of one MoE layer: every product and sum in float64; returns [T, H] float64.

    Unlike ``reference.moe_decode`` it takes activations and routing weights of any float dtype (bf16,
    float32, float64), and runs on NumPy or CuPy (whichever owns ``x``; ``topk_ids`` is read on the host); weights
    in ``weight_format`` are dequantized one expert at a time where they live.
    """
    fmt = get_format(weight_format)
    xp = array_module(x)
    ids = topk_ids.get() if hasattr(topk_ids, "get") and not isinstance(topk_ids, np.ndarray) else topk_ids
    ids = np.asarray(ids)
    T, H = (int(d) for d in x.shape)
    K = int(ids.shape[1])
    I = int(getattr(w13, "values", w13).shape[1]) // 2  # a Quantized holds its values in the layout
    xs = _widen64(x, xp)
    per_pair = xp.empty((T * K, H), xp.float64)
    for expert, pairs in expert_groups(ids):
        rows = xp.asarray(pairs)
        gate_up = xs[rows // K] @ _widen64(fmt.expert_here(w13, expert, "w13"), xp).T
        gate, up = gate_up[:, :I], gate_up[:, I:]
        hidden = gate / (1.0 + xp.exp(-gate)) * up
        per_pair[rows] = hidden @ _widen64(fmt.expert_here(w2, expert, "w2"), xp).T
    per_pair = per_pair.reshape(T, K, H)
    weights = xp.asarray(topk_weights).astype(xp.float64)
    out = xp.zeros((T, H), xp.float64)
    for k in range(K):
        out += weights[:, k, None] * per_pair[:, k]
    return out


# -- the stack ------------------------------------------------------------------------------------------


@dataclass
class _Layer:
    gamma: np.ndarray  # [H] bf16
    router: np.ndarray  # [E, H] bf16
    experts: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # generated on first use
    # (format, expert) -> that expert's (w13, w2) quantized, each with a leading expert axis of 1
    quantized: dict[tuple[str, int], tuple[Quantized, Quantized]] = field(default_factory=dict)


@dataclass
class PathTrace:
    """One path through the stack: its output after every layer and its routing at every layer."""

    path: str
    outputs: list[np.ndarray]  # per layer, [T, H] (float64 for "fp64", else bf16), after the residual add
    topk_ids: list[np.ndarray]  # per layer, [T, K] int32


class Stack:
    """``layers`` decoder layers of a model shape; weights deterministic by ``seed``.

    Router weights and RMSNorm gains are generated up front ([E, H] per layer); expert weights on first use
    (per seed, layer and expert), so a path only pays for the experts its routing touches.
    """

    def __init__(self, shape: MoEShape | str, layers: int, seed: int = 0) -> None:
        shape = get_shape(shape)
        layers = check_int("layers", layers, 1)
        self.shape, self.seed = shape, seed
        H, E = shape.hidden, shape.experts
        self.layers: list[_Layer] = []
        for layer in range(layers):
            rng = np.random.default_rng([seed, 11, layer])
            self.layers.append(_Layer(_normal_bf16(rng, (H,), 0.1, mean=1.0), _normal_bf16(rng, (E, H), H**-0.5)))

    def input(self, tokens: int) -> np.ndarray:
        """The stack's input residual stream [T, H] bf16 ~ N(0, 1), deterministic by (seed, tokens)."""
        return _normal_bf16(np.random.default_rng([self.seed, 12, tokens]), (tokens, self.shape.hidden), 1.0)

    def _experts(self, layer: int, ids: np.ndarray, weight_format: str = "bf16") -> tuple[Any, Any, np.ndarray]:
        """Compact ``(w13, w2, renumbered ids)`` for the experts ``ids`` touches at ``layer``, in
        ``weight_format`` (bf16 arrays, or :class:`kernels.formats.Quantized` of a quantized format)."""
        fmt = get_format(weight_format)
        store = self.layers[layer]
        cache = store.experts
        touched, remapped = np.unique(ids, return_inverse=True)
        for e in touched:
            if int(e) not in cache:
                cache[int(e)] = expert_weights(self.shape, self.seed, int(e), layer=layer + 1)
        local = remapped.reshape(ids.shape).astype(np.int32)
        if fmt.name == "bf16":
            return np.stack([cache[int(e)][0] for e in touched]), np.stack([cache[int(e)][1] for e in touched]), local
        for e in touched:
            if (fmt.name, int(e)) not in store.quantized:
                w13_e, w2_e = cache[int(e)]
                store.quantized[(fmt.name, int(e))] = fmt.quantize(w13_e[None], w2_e[None])
        pairs = [store.quantized[(fmt.name, int(e))] for e in touched]
        w13, w2 = (Quantized(np.concatenate([p[m].values for p in pairs]),
                             None if pairs[0][m].scales is None else np.concatenate([p[m].scales for p in pairs]),
                             pairs[0][m].layout) for m in (0, 1))
        return w13, w2, local

    def run_fp64(self, x: np.ndarray, weight_format: str = "bf16") -> PathTrace:
        """Every step in float64 (the oracle of the whole stack); with a quantized ``weight_format``, on the
        dequantized weights (float32 values x scale, widened exactly)."""
        fmt = get_format(weight_format)
        K = self.shape.top_k
        h = bf16_to_f32(x).astype(np.float64)
        outs, all_ids = [], []
        for index, layer in enumerate(self.layers):
            gamma = bf16_to_f32(layer.gamma).astype(np.float64)
            a = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + RMS_EPS) * gamma
            logits = a @ bf16_to_f32(layer.router).astype(np.float64).T
            ids, _ = route(logits, K, renormalize=self.shape.norm_topk_prob)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            weights = np.take_along_axis(probs, ids, axis=1)
            if self.shape.norm_topk_prob:
                weights = weights / weights.sum(axis=1, keepdims=True)
            w13, w2, local = self._experts(index, ids, fmt.name)
            if fmt.name != "bf16":
                w13, w2 = fmt.dequantize(w13, "w13"), fmt.dequantize(w2, "w2")
            h = h + moe_fp64(a, w13, w2, local, weights)
            outs.append(h.copy())
            all_ids.append(ids)
        return PathTrace("fp64", outs, all_ids)

    def run_path(
        self, x: np.ndarray, path: str, moe: Callable[..., np.ndarray] | None = None, weight_format: str = "bf16"
    ) -> PathTrace:
        """One compared path with a bf16 residual stream. ``moe(x, w13, w2, ids, weights) -> bf16 [T, H]``
        defaults to ``reference.moe_decode`` in the path's mode (see :data:`PATHS`); it gets the weights in
        ``weight_format``."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {tuple(PATHS)}, got {path!r}")
        mode, quant = PATHS[path]
        fmt = get_format(weight_format)
        if moe is None:
            def moe(*arrays: Any) -> np.ndarray:
                return moe_decode(*arrays, mode=mode, quant=quant, weight_format=fmt)
        K = self.shape.top_k
        h = np.ascontiguousarray(x, dtype=BF16)
        outs, all_ids = [], []
        for index, layer in enumerate(self.layers):
            hf = bf16_to_f32(h)
            inv = 1.0 / np.sqrt(np.mean(hf * hf, axis=1, keepdims=True, dtype=np.float32) + np.float32(RMS_EPS))
            a = round_bf16(hf * inv.astype(np.float32) * bf16_to_f32(layer.gamma))
            logits = bf16_to_f32(round_bf16(bf16_to_f32(a) @ bf16_to_f32(layer.router).T))
            ids, weights = route(logits, K, renormalize=self.shape.norm_topk_prob)
            w13, w2, local = self._experts(index, ids, fmt.name)
            out = moe(a, w13, w2, local, weights)
            h = round_bf16(hf + bf16_to_f32(np.asarray(out)))
            outs.append(h)
            all_ids.append(ids)
        return PathTrace(path, outs, all_ids)


def routing_mismatch(ids: np.ndarray, oracle_ids: np.ndarray) -> int:
    """How many tokens' top-k *sets* differ between two routings [T, K]."""
    return int(np.sum(np.any(np.sort(ids, axis=1) != np.sort(oracle_ids, axis=1), axis=1)))
