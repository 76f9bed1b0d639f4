"""A whole Qwen3-MoE decode step (``Qwen3MoeForCausalLM``) in NumPy: the reference a step built of kernels must match.

One step takes one token for each of T sequences, each with its own context in a KV cache, and gives each its next
token (greedy), its logits and its final hidden state:

    h = embed[token]
    each layer:  a = RMSNorm(h);  q, k, v = a @ Wqkv^T;  q, k = RoPE(RMSNorm_head(q)), RoPE(RMSNorm_head(k))
                 append k, v to the cache;  h = h + GQA(q, cache) @ Wo^T
                 m = RMSNorm(h);  ids, weights = top-k(softmax(m @ Wrouter^T)), renormalized;  h = h + MoE(m)
    hidden = RMSNorm(h);  logits = hidden @ Wlm^T;  next token = argmax(logits)

Conventions (Hugging Face's Qwen3-MoE): RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w, per head over head_dim for q and
k (``q_norm``, ``k_norm``); RoPE turns the pair (i, i + head_dim/2) by position * theta^(-2i/head_dim)
(``rotate_half``), position = the tokens the sequence's cache held before this one; query head j reads KV head
j // (heads / kv_heads); attention scores are q.k / sqrt(head_dim), softmax over the cached positions (this token's
included). Wqkv stacks q_proj's, k_proj's and v_proj's rows, in that order. Top-k and argmax ties go to the lower id,
as ``kernels.route`` does.

Modes (of a :class:`DecodeState`: a cache holds one mode's numbers):

``"fp64"``  the oracle: every op in float64 on the weights (bf16, or a format's dequantized values, widened exactly),
            the cache in float64, the MoE as ``kernels.reference.moe_decode``'s fp64 mode computes it but on float64
            activations (moe_decode takes bf16 x, which would round the oracle).
``"bf16"``  the step's kernels, operation for operation (the order contract of issue 59; twins in
            ``kernels.numerics`` and ``kernels.decode.moe_order``): FP32 inside each kernel, bf16 between them.
            RMSNorm (:func:`~kernels.numerics.rms_norm_chain`: the sum of squares by the lane chain, rounded once,
            the GEMV's prologue); every projection (QKV, O, router, LM head) by :func:`~kernels.numerics.dot_chain`
            (lane l: 8-element chunks l, l + 32, ..., then the warp butterfly); the QKV output rounded; q/k head
            RMSNorm and RoPE (:func:`~kernels.numerics.head_norm_rope`, cos / sin an fp32 table of float64 angles)
            rounded once, the cache in bf16; attention by :func:`~kernels.numerics.chunked_attention` (chunks of
            ``split`` positions, default :data:`ATTENTION_SPLIT`, exp by ``exp_rn``, combined in chunk order) rounded
            once; the O projection's epilogue ``bf16(r + y)`` in FP32; the router
            (:func:`~kernels.numerics.router_chain`: fp32 logits never stored, exp_rn softmax, top-k); the MoE by
            :func:`~kernels.decode.moe_order.strict_moe_chain` (the strict warp-decode kernels' order at the knobs
            they resolve for the step's dims), its bf16 output added to the residual in FP32 and rounded (the next
            norm's prologue); the final RMSNorm rounded, the logits fp32, the argmax to the lower id on ties. Not
            reproduced: CUDA's expf in the MoE's SiLU (moe_order's docstring). With bf16 weights the GPU step's
            tokens, logits and hidden states must equal this mode's bit for bit; with ``fp8-block128`` weights
            (:func:`make_model`'s ``weight_format``) the projections read the dequantized values in the same order,
            no bitwise promise (the FP8 kernels dequantize in their own order).

Projections, the router and the MoE run each token's rows on their own, attention a sequence at a time: a sequence
gets the same bits in any batch, in both modes (the MoE's knobs follow T, but at ``tiny`` none of them moves its
order: I = 48 is one chunk round). In the bf16 mode that is needed: a perturbation far below an ulp flips a few
roundings, and a few layers of them grow it to the mode's own distance from the oracle (~1e-2 at ``tiny``), so a
check against the bf16 mode is bitwise or no sharper than that. Weights are generated (:func:`make_model`), never
downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from statistics import NormalDist
from typing import Any

import numpy as np

from kernels.arrays import BF16, check_int
from kernels.decode.moe_order import strict_moe_chain
from kernels.formats import Quantized, dequantize_blocks, get_format, quantize_blocks
from kernels.numerics import (
    as_f32,
    bf16_to_f32,
    chunked_attention,
    dot_chain,
    head_norm_rope,
    rms_norm_chain,
    rope_angles,
    rope_tables,
    round_bf16,
    router_chain,
    silu,
)
from kernels.reference import expert_groups, weights_format
from kernels.routing import route
from kernels.shapes import ATTENTION_FIELDS, MoEShape, get_shape

MODES = ("fp64", "bf16")
WEIGHT_FORMATS = ("bf16", "fp8-block128")  # what make_model quantizes wqkv, wo and the experts to
ATTENTION_SPLIT = 64  # positions per attention chunk in the bf16 mode: the attention kernel's default SPLIT
EMBED_STD = 0.02  # Qwen3's initializer_range: what the embedding's scale starts from
NORM_NOISE = 0.05  # norms' weights: 1 + N(0, 0.05^2)
CACHE_HEADROOM = 64  # positions a new state holds beyond its longest sequence unless told


# -- the model ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, bf16 (HF names in the comments); wqkv, wo, w13 and w2 a ``Quantized`` in an
    fp8-block128 model (2-D ones: one scale per 128 x 128 block of the [N, K] matrix)."""

    input_norm: np.ndarray  # [H] input_layernorm
    wqkv: np.ndarray  # [(heads + 2 kv_heads) * head_dim, H] q_proj, k_proj, v_proj rows stacked
    q_norm: np.ndarray  # [head_dim]
    k_norm: np.ndarray  # [head_dim]
    wo: np.ndarray  # [H, heads * head_dim] o_proj
    post_norm: np.ndarray  # [H] post_attention_layernorm
    router: np.ndarray  # [E, H] mlp.gate
    w13: np.ndarray  # [E, 2I, H] gate rows then up rows (the data contract's layout)
    w2: np.ndarray  # [E, H, I] down


@dataclass(frozen=True)
class Model:
    """A generated Qwen3-MoE decoder: ``config`` (a preset with the decoder's fields) and its weights."""

    config: MoEShape
    embed: np.ndarray  # [V, H] embed_tokens
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [H] norm
    lm_head: np.ndarray  # [V, H] (untied)
    weight_format: str = "bf16"  # of wqkv, wo and the experts (WEIGHT_FORMATS); the rest is bf16 in every model


def decoder_config(config: str | MoEShape, name: str = "config") -> MoEShape:
    """The preset ``config`` names, checked to carry the decoder's fields (ValueError naming the missing ones)."""
    if not isinstance(config, str | MoEShape):
        raise TypeError(f"{name} must be a preset name or a MoEShape, got {type(config).__name__}")
    shape = get_shape(config)
    if not shape.has_attention:
        raise ValueError(f"{name} {shape.name!r} has no decoder fields ({', '.join(ATTENTION_FIELDS)}): only the "
                         "Qwen3 MoE presets and 'tiny' carry them")
    return shape


@cache
def _normal_quantiles() -> np.ndarray:
    """The standard normal's quantiles at (i + 1/2) / 2^16, i < 2^16: 16 random bits -> one N(0, 1) draw."""
    normal = NormalDist()
    return np.array([normal.inv_cdf((i + 0.5) / 65536) for i in range(65536)])


def _normal_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    """N(mean, std^2) rounded to bf16, by inverse CDF from 16 random bits a value (tails cut at 4.3 std).

    A table lookup, ~8x faster than ``standard_normal`` and a bf16 rounding (real-width layers quick enough for CPU
    tests); after the rounding the draws are distributed as rounded exact normal ones, to 2^-16 in probability.
    """
    table = round_bf16(mean + std * _normal_quantiles())
    return table[rng.integers(0, 65536, size=shape, dtype=np.uint16)]


def make_model(config: str | MoEShape, seed: int = 0, layers: int | None = None,
               weight_format: str = "bf16") -> Model:
    """A decoder with random bf16 weights scaled like trained ones, deterministic by ``seed``.

    Projections ~ N(0, 1/fan_in) (the router and the LM head too), the embedding ~ N(0, 0.02^2), norms' weights
    ~ 1 + N(0, 0.05^2). ``layers`` (default: the preset's) builds only the first few: layer l's weights depend on
    (seed, l) alone, so they are the same in a shorter model. ``config.with_(experts=..., vocab_size=...)`` shrinks
    a real-width layer for a quick CPU check. ``weight_format="fp8-block128"`` quantizes those bf16 weights' wqkv,
    wo, w13 and w2 to the lab's block-128 FP8 (``kernels.formats``), the router, norms, embedding and LM head left
    bf16 as Qwen3's FP8 checkpoints ship them; both modes read the dequantized values.
    """
    shape = decoder_config(config)
    seed = check_int("seed", seed, 0)
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    layers = shape.layers if layers is None else check_int("layers", layers, 1, shape.layers)
    H, I, E = shape.hidden, shape.intermediate, shape.experts
    heads, kv_heads, head_dim = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    outer = np.random.default_rng([seed, 0])
    embed = _normal_bf16(outer, (shape.vocab_size, H), EMBED_STD)
    final_norm = _normal_bf16(outer, (H,), NORM_NOISE, 1.0)
    lm_head = _normal_bf16(outer, (shape.vocab_size, H), H**-0.5)
    built = []
    for layer in range(layers):
        rng = np.random.default_rng([seed, 1, layer])
        weights = LayerWeights(
            input_norm=_normal_bf16(rng, (H,), NORM_NOISE, 1.0),
            wqkv=_normal_bf16(rng, ((heads + 2 * kv_heads) * head_dim, H), H**-0.5),
            q_norm=_normal_bf16(rng, (head_dim,), NORM_NOISE, 1.0),
            k_norm=_normal_bf16(rng, (head_dim,), NORM_NOISE, 1.0),
            wo=_normal_bf16(rng, (H, heads * head_dim), (heads * head_dim) ** -0.5),
            post_norm=_normal_bf16(rng, (H,), NORM_NOISE, 1.0),
            router=_normal_bf16(rng, (E, H), H**-0.5),
            w13=_normal_bf16(rng, (E, 2 * I, H), H**-0.5),
            w2=_normal_bf16(rng, (E, H, I), I**-0.5),
        )
        if weight_format != "bf16":
            w13, w2 = get_format(weight_format).quantize(weights.w13, weights.w2)
            weights = replace(weights, wqkv=Quantized(*quantize_blocks(bf16_to_f32(weights.wqkv))),
                              wo=Quantized(*quantize_blocks(bf16_to_f32(weights.wo))), w13=w13, w2=w2)
        built.append(weights)
    return Model(shape, embed, tuple(built), final_norm, lm_head, weight_format)


_DEQUANTIZED: dict[int, tuple[Any, np.ndarray]] = {}  # id(Quantized) -> (it, its float32 values)


def dense_weights(weights: Any, matrix: str = "") -> np.ndarray:
    """A matrix as the reference reads it: a bf16 array as is; a ``Quantized`` one dequantized to float32 (2-D: the
    [N, K] matrix's blocks; 3-D: the experts' ``matrix`` "w13" or "w2"), made once per matrix."""
    if not isinstance(weights, Quantized):
        return weights
    held = _DEQUANTIZED.get(id(weights))
    if held is None or held[0] is not weights:
        if np.ndim(weights.values) == 2:
            values = dequantize_blocks(weights.values, weights.scales)
        else:
            values = get_format(weights_format(weights)).dequantize(weights, matrix)
        held = _DEQUANTIZED[id(weights)] = (weights, np.asarray(values, np.float32))
    return held[1]


# -- the ops, each in its input's float precision (float32 or float64) ---------------------------------------------
def _widen(arr: np.ndarray, acc: type) -> np.ndarray:
    """bf16 (exactly) or any float array as ``acc``."""
    arr = np.asarray(arr)
    if arr.dtype == BF16:
        arr = bf16_to_f32(arr)
    return arr.astype(acc, copy=False)


def _float_dtype(x: np.ndarray, name: str) -> type:
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64 (the precision the op runs in), got {x.dtype}")
    return x.dtype.type


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, x / sqrt(mean(x^2) + eps) * weight, in x's precision (float32 or float64)."""
    acc = _float_dtype(np.asarray(x), "x")
    if np.shape(weight) != np.shape(x)[-1:]:
        raise ValueError(f"weight must be [{np.shape(x)[-1]}] like x's last axis, got shape {np.shape(weight)}")
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True, dtype=acc)
    return x * (acc(1.0) / np.sqrt(mean_square + acc(eps))) * _widen(weight, acc)


def rope(x: np.ndarray, positions: Any, theta: float) -> np.ndarray:
    """x [T, heads, head_dim] turned by RoPE at each token's position (``rotate_half`` pairs i, i + head_dim/2).

    Angles position * theta^(-2i/head_dim) in float64; cos and sin in x's precision (float32: the table a kernel
    reads), the rotation in x's precision.
    """
    acc = _float_dtype(np.asarray(x), "x")
    if x.ndim != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, heads, head_dim] with an even head_dim, got shape {x.shape}")
    positions = np.asarray(positions)
    if positions.shape != x.shape[:1] or positions.dtype.kind not in "iu" or (positions.size and positions.min() < 0):
        raise ValueError(f"positions must be {x.shape[0]} integers >= 0 (one per token), got {positions!r}")
    half = x.shape[-1] // 2
    angles = rope_angles(positions, x.shape[-1], theta)[:, None, :]  # [T, 1, half]
    cos, sin = np.cos(angles).astype(acc), np.sin(angles).astype(acc)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def gqa_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One sequence's attention: q [heads, head_dim] over keys, values [n, kv_heads, head_dim] -> [heads, head_dim].

    Query head j reads KV head j // (heads / kv_heads); softmax of q.k / sqrt(head_dim) over the n positions, in q's
    precision (float32 or float64).
    """
    acc = _float_dtype(np.asarray(q), "q")
    if q.ndim != 2:
        raise ValueError(f"q must be [heads, head_dim] (one token), got shape {q.shape}")
    heads, head_dim = q.shape
    if keys.ndim != 3 or keys.shape != values.shape or keys.shape[2] != head_dim or keys.shape[0] < 1:
        raise ValueError(f"keys and values must be [n >= 1, kv_heads, {head_dim}] alike, got shapes {keys.shape} "
                         f"and {values.shape}")
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    grouped = q.reshape(kv_heads, heads // kv_heads, head_dim)
    scores = np.einsum("kgd,nkd->kgn", grouped, keys.astype(acc, copy=False)) * acc(1.0 / np.sqrt(head_dim))
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = np.einsum("kgn,nkd->kgd", weights, values.astype(acc, copy=False)) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(heads, head_dim)


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [T, D] @ weight[N, D]^T in x's precision, one token at a time (a token's result is the same in any batch)."""
    acc = _float_dtype(np.asarray(x), "x")
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x [T, D] and weight [N, D] must agree on D, got shapes {x.shape} and {weight.shape}")
    rows = max(8, (1 << 19) // max(1, weight.shape[1]))  # widen ~2 MB of weight at a time
    out = np.empty((x.shape[0], weight.shape[0]), acc)
    for start in range(0, weight.shape[0], rows):
        block = _widen(weight[start : start + rows], acc)
        for token in range(x.shape[0]):
            out[token, start : start + rows] = block @ x[token]
    return out


def select_experts(logits: np.ndarray, top_k: int, renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (topk_ids [T, K] int32, topk_weights [T, K]): softmax, top-k (ties to the lower id),
    renormalized to sum 1 with ``renormalize`` (``norm_topk_prob``).

    float32 logits go through ``kernels.route`` (the bf16 mode: what the router kernel must reproduce); float64 logits
    are the oracle's, the same rule in float64.
    """
    logits = np.asarray(logits)
    if logits.dtype == np.float32:
        return route(logits, top_k, renormalize)
    if logits.dtype != np.float64:
        raise TypeError(f"logits must be float32 (bf16 mode) or float64 (fp64 mode), got {logits.dtype}")
    if logits.ndim != 2 or logits.shape[0] < 1:
        raise ValueError(f"logits must be [T >= 1, E], got shape {logits.shape}")
    top_k = check_int("top_k", top_k, 1, logits.shape[1])
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    topk_ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    topk_weights = np.take_along_axis(probs, topk_ids, axis=1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(axis=1, keepdims=True)
    return topk_ids.astype(np.int32), topk_weights


def moe_fp64(x: np.ndarray, w13: Any, w2: Any, topk_ids: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """The MoE layer in float64 on float64 activations x [T, H]: ``moe_decode``'s fp64 mode, whose x is bf16.

    Grouped by expert as the reference is, each (token, slot) pair's GEMVs on its own (batch-independent), the
    weighted sum over slots in slot order.
    """
    x = np.asarray(x)
    if x.dtype != np.float64 or x.ndim != 2:
        raise TypeError(f"x must be a float64 [T, H] array, got {x.dtype} of shape {x.shape}")
    fmt = weights_format(w13)
    w13, w2 = fmt.host(w13), fmt.host(w2)
    tokens, top_k = topk_ids.shape
    per_pair = np.empty((tokens * top_k, x.shape[1]))
    for expert, pairs in expert_groups(topk_ids):
        gate_up_weight = _widen(fmt.expert(w13, expert, "w13"), np.float64)  # bf16 or dequantized float32: exact
        down_weight = _widen(fmt.expert(w2, expert, "w2"), np.float64)
        inter = gate_up_weight.shape[0] // 2
        for pair in pairs:
            gate_up = gate_up_weight @ x[pair // top_k]
            per_pair[pair] = down_weight @ (silu(gate_up[:inter]) * gate_up[inter:])
    per_pair = per_pair.reshape(tokens, top_k, -1)
    out = np.zeros_like(x)
    for slot in range(top_k):
        out += np.asarray(topk_weights, np.float64)[:, slot, None] * per_pair[:, slot]
    return out


# -- the KV cache ---------------------------------------------------------------------------------------------------
@dataclass
class SequenceCache:
    """One sequence's K and V for every layer, [layers, capacity, kv_heads, head_dim]; positions < length hold data."""

    keys: np.ndarray
    values: np.ndarray
    length: int = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])


@dataclass
class DecodeState:
    """T sequences' caches, each its own length, in one mode's numbers (float64 for "fp64", bf16 for "bf16")."""

    mode: str
    sequences: list[SequenceCache] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.sequences)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([s.length for s in self.sequences], np.int64)

    def select(self, indices: Sequence[int]) -> DecodeState:
        """Some of the sequences, their caches shared: a step on the selection advances them here too."""
        picked = [self.sequences[check_int("indices", i, 0, self.batch - 1)] for i in indices]
        return DecodeState(self.mode, picked)

    def copy(self) -> DecodeState:
        """An independent copy (steps on it leave this state as it is)."""
        return DecodeState(self.mode, [SequenceCache(s.keys.copy(), s.values.copy(), s.length)
                                       for s in self.sequences])

    def to_mode(self, mode: str) -> DecodeState:
        """A copy in ``mode``'s numbers: bf16 -> fp64 is exact, fp64 -> bf16 rounds (through float32)."""
        dtype = _cache_dtype(mode)
        convert = (lambda a: np.array(_widen(a, np.float64))) if dtype == np.float64 else round_bf16
        return DecodeState(mode, [SequenceCache(convert(s.keys), convert(s.values), s.length) for s in self.sequences])


def _check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return str(mode)


def _cache_dtype(mode: str) -> np.dtype:
    return np.dtype(np.float64) if _check_mode(mode) == "fp64" else BF16


def new_state(model: Model, lengths: Sequence[int], mode: str = "fp64", capacity: int | None = None,
              seed: int = 0) -> DecodeState:
    """A state of ``len(lengths)`` sequences whose caches hold ``lengths[i]`` positions of random K, V.

    The contents are bf16 N(0, 1) values (what q/k-normed, rotated keys and v_proj outputs of unit-RMS activations
    look like), the same in both modes for one seed (``to_mode`` of one gives the other): long contexts without a
    prefill, for attention at real context lengths. Their tokens are fictitious, so a step on them checks the
    numerics, not a sentence. ``capacity`` defaults to the longest + 64 positions.
    """
    _check_model(model)
    dtype = _cache_dtype(mode)
    seed = check_int("seed", seed, 0)
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence | np.ndarray) or len(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty sequence of ints (one per sequence), got {lengths!r}")
    lengths = [check_int(f"lengths[{i}]", n, 0) for i, n in enumerate(lengths)]
    longest = max(lengths)
    capacity = longest + CACHE_HEADROOM if capacity is None else check_int("capacity", capacity, max(1, longest))
    shape = model.config
    full = (len(model.layers), capacity, shape.num_key_value_heads, shape.head_dim)
    rng = np.random.default_rng([seed, 2])
    sequences = []
    for length in lengths:
        keys, values = np.zeros(full, dtype), np.zeros(full, dtype)
        filled = (full[0], length, *full[2:])
        keys[:, :length] = _normal_bf16(rng, filled, 1.0)  # bf16 values: exact in either dtype
        values[:, :length] = _normal_bf16(rng, filled, 1.0)
        sequences.append(SequenceCache(keys, values, length))
    return DecodeState(_check_mode(mode), sequences)


# -- the step -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """What one step gives each of its T sequences."""

    next_tokens: np.ndarray  # [T] int64, argmax of the logits
    logits: np.ndarray  # [T, V] float64 (fp64) / float32 (bf16)
    hidden: np.ndarray  # [T, H] the final RMSNorm's output, the LM head's input: float64 / bf16
    topk_ids: np.ndarray  # [layers, T, K] int32, each layer's routing


def _check_model(model: object) -> Model:
    if not isinstance(model, Model):
        raise TypeError(f"model must be a kernels.decode_reference.Model (make_model), got {type(model).__name__}")
    return model


def _check_state(state: object, model: Model) -> DecodeState:
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState (new_state or prefill), got {type(state).__name__}")
    _check_mode(state.mode)
    if state.batch < 1:
        raise ValueError("state must hold at least one sequence")
    shape, dtype = model.config, _cache_dtype(state.mode)
    for i, seq in enumerate(state.sequences):
        want = (len(model.layers), seq.capacity, shape.num_key_value_heads, shape.head_dim)
        if seq.keys.shape != want or seq.values.shape != want or seq.keys.dtype != dtype or seq.values.dtype != dtype:
            raise ValueError(f"state's sequence {i} holds a cache of shape {seq.keys.shape} {seq.keys.dtype}, this "
                             f"model's {state.mode} cache is {want[0:1] + ('capacity',) + want[2:]} {dtype}")
        if seq.length >= seq.capacity:
            raise ValueError(f"state's sequence {i} is full ({seq.length} of {seq.capacity} positions): make the "
                             "state with a larger capacity")
    return state


def _check_tokens(tokens: Any, batch: int, vocab: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if tokens.shape != (batch,):
        raise ValueError(f"tokens must be [T] = [{batch}] (one per sequence of the state), got shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"tokens must lie in [0, vocab_size) = [0, {vocab}), found [{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.int64)


def decode_step(model: Model, tokens: Any, state: DecodeState, split: int | None = None) -> StepResult:
    """One decode step of ``tokens`` [T] (one per sequence of ``state``), in the state's mode.

    Appends each token's K and V to its sequence's cache (at position = its length, then length + 1). ``split``:
    the bf16 mode's attention chunk (positions, a multiple of 32; default :data:`ATTENTION_SPLIT`); the oracle has
    none.
    """
    model = _check_model(model)
    state = _check_state(state, model)
    tokens = _check_tokens(tokens, state.batch, model.config.vocab_size)
    split = ATTENTION_SPLIT if split is None else check_int("split", split, 32)
    if split % 32:
        raise ValueError(f"split must be a multiple of 32 (whole warps of positions), got {split}")
    result = _step_fp64(model, tokens, state) if state.mode == "fp64" else _step_bf16(model, tokens, state, split)
    for seq in state.sequences:
        seq.length += 1
    return result


def _step_fp64(model: Model, tokens: np.ndarray, state: DecodeState) -> StepResult:
    """The oracle: float64 throughout, the math of the module docstring."""
    shape = model.config
    heads, kv_heads, head_dim, eps = (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                                      shape.rms_norm_eps)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    positions, batch = state.lengths, state.batch
    routing = []
    h = _widen(model.embed[tokens], np.float64)  # the residual stream
    for index, layer in enumerate(model.layers):
        qkv = linear(rms_norm(h, layer.input_norm, eps), dense_weights(layer.wqkv))
        q = qkv[:, :q_size].reshape(batch, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(batch, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].reshape(batch, kv_heads, head_dim)
        q = rope(rms_norm(q, layer.q_norm, eps), positions, shape.rope_theta)
        k = rope(rms_norm(k, layer.k_norm, eps), positions, shape.rope_theta)
        attended = np.empty((batch, heads, head_dim))
        for t, seq in enumerate(state.sequences):
            seq.keys[index, seq.length] = k[t]
            seq.values[index, seq.length] = v[t]
            attended[t] = gqa_attention(q[t], seq.keys[index, : seq.length + 1], seq.values[index, : seq.length + 1])
        h = h + linear(attended.reshape(batch, q_size), dense_weights(layer.wo))
        moe_in = rms_norm(h, layer.post_norm, eps)
        topk_ids, topk_weights = select_experts(linear(moe_in, layer.router), shape.top_k, shape.norm_topk_prob)
        routing.append(topk_ids)
        h = h + moe_fp64(moe_in, layer.w13, layer.w2, topk_ids, topk_weights)
    hidden = rms_norm(h, model.final_norm, eps)
    logits = linear(hidden, model.lm_head)
    return StepResult(np.argmax(logits, axis=1), logits, hidden, _routing(routing, batch, shape.top_k))


def _step_bf16(model: Model, tokens: np.ndarray, state: DecodeState, split: int) -> StepResult:
    """The kernels' step: each op the twin of its kernel (module docstring), bf16 between them."""
    shape = model.config
    heads, kv_heads, head_dim, eps = (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                                      shape.rms_norm_eps)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    batch = state.batch
    cos, sin = rope_tables(state.lengths, head_dim, shape.rope_theta)  # [T, half]
    routing = []
    h = model.embed[tokens]  # the residual stream, bf16
    for index, layer in enumerate(model.layers):
        xn = rms_norm_chain(h, layer.input_norm, eps)
        qkv = round_bf16(dot_chain(xn[:, None, :], dense_weights(layer.wqkv)[None]))
        q = head_norm_rope(qkv[:, :q_size].reshape(batch, heads, head_dim), layer.q_norm, cos[:, None],
                           sin[:, None], eps)
        k = head_norm_rope(qkv[:, q_size : q_size + kv_size].reshape(batch, kv_heads, head_dim), layer.k_norm,
                           cos[:, None], sin[:, None], eps)
        v = qkv[:, q_size + kv_size :].reshape(batch, kv_heads, head_dim)
        attended = np.empty((batch, heads, head_dim), BF16)
        for t, seq in enumerate(state.sequences):
            seq.keys[index, seq.length] = k[t]
            seq.values[index, seq.length] = v[t]
            attended[t] = chunked_attention(q[t], seq.keys[index, : seq.length + 1],
                                            seq.values[index, : seq.length + 1], split)
        y = dot_chain(attended.reshape(batch, 1, q_size), dense_weights(layer.wo)[None])
        h = round_bf16(as_f32(h) + y)  # the O projection's residual epilogue
        moe_in = rms_norm_chain(h, layer.post_norm, eps)
        topk_ids, topk_weights = router_chain(moe_in, layer.router, shape.top_k, shape.norm_topk_prob)
        routing.append(topk_ids)
        out = strict_moe_chain(moe_in, dense_weights(layer.w13, "w13"), dense_weights(layer.w2, "w2"), topk_ids,
                               topk_weights)
        h = round_bf16(as_f32(h) + as_f32(out))  # the next norm's prologue: bf16(h + moe_out)
    hidden = rms_norm_chain(h, model.final_norm, eps)
    logits = dot_chain(hidden[:, None, :], model.lm_head[None])
    return StepResult(np.argmax(logits, axis=1), logits, hidden, _routing(routing, batch, shape.top_k))


def _routing(routing: list[np.ndarray], batch: int, top_k: int) -> np.ndarray:
    return np.stack(routing) if routing else np.empty((0, batch, top_k), np.int32)


def prefill(model: Model, prompts: Sequence[Sequence[int]], mode: str = "fp64", capacity: int | None = None,
            split: int | None = None) -> tuple[DecodeState, StepResult]:
    """Fill a new state's caches with ``prompts`` (token lists, lengths free) by :func:`decode_step`, token by token.

    Sequences advance together while they have tokens left (a step over those that do). Returns the state and each
    sequence's result at its prompt's last token (``next_tokens``: its first generated token). ``capacity``
    defaults to the longest prompt + 64.
    """
    model = _check_model(model)
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token lists, got {prompts!r}")
    prompts = [np.asarray(p) for p in prompts]
    for i, prompt in enumerate(prompts):
        if prompt.ndim != 1 or prompt.size < 1:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got shape {prompt.shape}")
        if prompt.dtype.kind not in "iu":
            raise TypeError(f"prompts[{i}] must hold integer token ids, got dtype {prompt.dtype}")
        if prompt.min() < 0 or prompt.max() >= model.config.vocab_size:
            raise ValueError(f"prompts[{i}] must lie in [0, vocab_size) = [0, {model.config.vocab_size}), found "
                             f"[{prompt.min()}, {prompt.max()}]")
    longest = max(p.size for p in prompts)
    capacity = longest + CACHE_HEADROOM if capacity is None else check_int("capacity", capacity, longest)
    shape = model.config
    full = (len(model.layers), capacity, shape.num_key_value_heads, shape.head_dim)
    dtype = _cache_dtype(mode)
    state = DecodeState(mode, [SequenceCache(np.zeros(full, dtype), np.zeros(full, dtype)) for _ in prompts])
    last: list[tuple[StepResult, int] | None] = [None] * len(prompts)
    for position in range(longest):
        active = [i for i, p in enumerate(prompts) if p.size > position]
        result = decode_step(model, np.array([prompts[i][position] for i in active]), state.select(active), split)
        for row, i in enumerate(active):
            if prompts[i].size == position + 1:
                last[i] = (result, row)
    rows = [(r, row) for r, row in last if r is not None]
    return state, StepResult(np.array([r.next_tokens[row] for r, row in rows]),
                             np.stack([r.logits[row] for r, row in rows]),
                             np.stack([r.hidden[row] for r, row in rows]),
                             np.stack([r.topk_ids[:, row] for r, row in rows], axis=1))


def generate(model: Model, state: DecodeState, tokens: Any, steps: int, split: int | None = None) -> list[StepResult]:
    """``steps`` greedy steps from ``tokens`` [T]: each step's input is the previous step's ``next_tokens``
    (``split``: :func:`decode_step`'s)."""
    steps = check_int("steps", steps, 1)
    results = []
    for _ in range(steps):
        results.append(decode_step(model, tokens, state, split))
        tokens = results[-1].next_tokens
    return results
